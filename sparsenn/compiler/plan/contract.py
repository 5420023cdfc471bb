"""Contraction paths for products of three or more operands.

One fused loop nest is not always best: ``A[i,j] B[j,k] C[k,l]`` fused iterates
``nnz(A) * K * L`` points, while contracting ``A B`` first (``nnz(A) * K``) and then the
dense ``(A B) C`` costs far less. Fusion wins when it avoids a large intermediate, as in
SDDMM ``A[i,j] X[i,k] Y[j,k]`` (the dense ``X Yᵀ`` never exists) or ``bn,bd,ndh->bh``
with sparse ``bn`` (only the nonzero ``(b, n)`` pairs are visited).

:func:`best_path` compares the fused schedule's cost with every sequence of pairwise
contractions (each pair itself scheduled, or left to BLAS when both are dense) and
returns ``None`` when fusing everything is cheapest. Intermediates are internal, so
their format is free: one whose estimated fill reaches ``SPARSE_OUTPUT_DENSITY`` is
kept dense (``X·Wᵀ``-like products of a dense and a sparse operand fill in), instead of
being assembled as a sparse tensor that is then nearly full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .infer import SPARSE_OUTPUT_DENSITY, infer_output_format
from ..notation import Access, Assignment, Term
from .schedule import OperandInfo, estimate_positions, schedule

__all__ = ["Step", "best_path"]

# BLAS versus the cost model's accounting, in which vectorised loops already count 1/8:
# measured 8.4 ms for a fused SDDMM costed 1.9e7 against >= 10 ms for a 2.7e8-MAC sgemm.
DENSE_GEMM_SPEEDUP = 8.0
INTERMEDIATE_COST = 2.0  # per element of a dense intermediate: written, then read back


@dataclass(frozen=True)
class Step:
    """Contract operands ``left`` and ``right`` of the current list into one with
    ``indices`` (a dense tensor if ``dense``); the result is appended to the list."""

    left: int
    right: int
    indices: tuple[str, ...]
    dense: bool = False


def _pair_assignment(a: Access, b: Access, keep: tuple[str, ...]) -> Assignment:
    term = Term(1.0, (Access(0, a.indices), Access(1, b.indices)))
    return Assignment(keep, (term,), ("left", "right"))


def _result_info(pair: Assignment, infos: Sequence[OperandInfo], dims: dict[str, int], itemsize: int):
    """(cost, info) of contracting a pair."""
    shape = tuple(dims[i] for i in pair.output)
    if all(i.format is None for i in infos):
        flops = math.prod(dims[i] for i in pair.terms[0].indices)
        return flops / DENSE_GEMM_SPEEDUP + INTERMEDIATE_COST * math.prod(shape), OperandInfo(None, shape)
    fmt = infer_output_format(pair, [i.format for i in infos])
    if fmt is not None and schedule(pair, infos, None, itemsize).leaves >= SPARSE_OUTPUT_DENSITY * math.prod(shape):
        fmt = None  # fills in: keep the intermediate dense
    sched = schedule(pair, infos, fmt, itemsize)
    if fmt is None:
        return sched.cost + INTERMEDIATE_COST * math.prod(shape), OperandInfo(None, shape)
    nnz = int(min(math.prod(shape), max(sched.leaves, 1.0)))
    sizes = [shape[m] for m in fmt.mode_order]
    positions = tuple(int(p) for p in estimate_positions(fmt.levels, sizes, nnz))
    return sched.cost, OperandInfo(fmt, shape, positions)


def best_path(
    assignment: Assignment, infos: Sequence[OperandInfo], itemsize: int, anchored: bool = False
) -> list[Step] | None:
    """The cheapest pairwise contraction sequence, or ``None`` to fuse all operands.

    ``anchored``: the fused result would take a sampling operand's pattern (SDDMM), so
    it is costed as the dense-output nest that writes values in place, with no assembly."""
    (term,) = assignment.terms
    if len(term.factors) < 3:
        return None
    dims = {i: infos[a.operand].shape[m] for a in term.factors for m, i in enumerate(a.indices)}
    output = assignment.output
    fmt = None if anchored else infer_output_format(assignment, [i.format for i in infos])
    fused = schedule(assignment, infos, fmt, itemsize).cost

    def search(items: tuple[tuple[Access, OperandInfo], ...]) -> tuple[float, list[Step]]:
        if len(items) == 1:
            return 0.0, []
        best: tuple[float, list[Step]] = (math.inf, [])
        for x in range(len(items)):
            for y in range(x + 1, len(items)):
                (a, ia), (b, ib) = items[x], items[y]
                rest = [items[k] for k in range(len(items)) if k not in (x, y)]
                needed = set(output) | {i for acc, _ in rest for i in acc.indices}
                seen = list(dict.fromkeys(a.indices + b.indices))
                keep = tuple(i for i in output if i in seen) + tuple(
                    i for i in seen if i in needed and i not in output
                )
                if not rest:
                    keep = output
                pair = _pair_assignment(a, b, keep)
                cost, info = _result_info(pair, (ia, ib), dims, itemsize)
                sub_cost, sub_steps = search(tuple(rest) + ((Access(-1, keep), info),))
                if cost + sub_cost < best[0]:
                    dense = bool(rest) and info.format is None
                    best = (cost + sub_cost, [Step(x, y, keep, dense)] + sub_steps)
        return best

    items = tuple((a, infos[a.operand]) for a in term.factors)
    cost, steps = search(items)
    return steps if cost < fused else None
