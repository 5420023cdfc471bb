"""The scheduler's cost model: the expected work of a loop nest.

The cost of an order is the work of the nest: at each loop, co-iterating the sparse
levels indexed there (``SPARSE_ITERATION_COST * sum`` of fiber lengths, with an expected
intersection of ``N * prod(f_k / N)``) or ``N`` for a dense loop (``ceil(N / W)``
vectors innermost, ``W`` the target's ``cost_vector_lanes``: a loop of one trip is one
step, not an eighth of one), times the iterations of the enclosing loops; plus the
leaf's products (per vector when the innermost loop is dense); plus ``SHORT_OUTPUT_LOOP_COST`` per entry of an
innermost output loop shorter than a vector (``lanes`` values) inside a reduction loop
when no register block can hold its outputs (:func:`register_blockable`; each entry
then starts a loop too short for a vector and reloads what the previous entry stored,
where a reduction innermost sums in registers: the SpMV form); plus
re-storing any operand whose storage order disagrees with the loop order
(``TRANSPOSE_COST`` per stored entry and index entry, ``DENSE_COPY_COST`` per element
of a dense operand, plus the target's ``relayout_cycles`` per dense copy: its allocation
and call, which outweigh the elements of a small one; a dense operand is read in place
when its memory order, indices of extent one aside, is the loop order); plus
``RESTREAM_COST`` per stored and index entry for every extra pass over a sparse operand
that an enclosing loop it does not index makes it traverse in full (its first level
entered under that loop without another factor filtering it: ``b, o, i`` over a weight ``W[o, i]`` reads all of ``W`` once per ``b``; a gathered
operand, entered at another's stored coordinates, is not traversed in full). An
innermost sparse reduction that gathers its dense factors
(:func:`~.decisions.gathered_reduction`, an SpMV's ``x[crd[q]]``) runs the whole groups
of ``G = gathered_vectors x lanes`` positions of each fiber ``lanes`` at a time: each
position costs ``(SPARSE_ITERATION_COST + factors) / lanes`` plus ``GATHER_COST`` per
gathered factor, the rest of the fiber (all of it when shorter than ``G``, else about
``G / 2``) ``SPARSE_ITERATION_COST + factors`` as any scalar step. Only level
capabilities are used, never format names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sparsenn.formats import Format
from sparsenn.formats.level import Dense, Level

from ..frontend.notation import Term
from .decisions import NestFactor, gathered_reduction, reductions_from
from .target import Target

__all__ = ["OperandInfo", "Factor", "estimate_positions", "stored_in_order", "read_in_order", "outside_vector",
           "register_blockable", "nest_cost", "NestCosts"]

TRANSPOSE_COST = 4.0
SPARSE_ITERATION_COST = 4.0  # an indirect (crd, value) step versus a dense one
DENSE_COPY_COST = 1.0  # per element, to re-lay a dense operand out in loop order
RESTREAM_COST = 0.5  # per stored and index entry, for each extra full pass over a sparse operand
SHORT_OUTPUT_LOOP_COST = 32.0  # per entry of a loop over fewer outputs than a vector, in memory
GATHER_COST = 1.0  # per lane of a gathered load: one indexed element


@dataclass(frozen=True)
class OperandInfo:
    """What the scheduler knows about one operand."""

    format: Format | None
    shape: tuple[int, ...]
    positions: tuple[int, ...] = ()  # stored positions per storage level (sparse only)
    pattern: int | None = None  # the first operand whose index arrays this one shares (its pattern)
    layout: tuple[int, ...] | None = None  # a dense operand's modes in memory order, outermost first (None: as indexed)

    @property
    def nnz(self) -> int:
        return self.positions[-1] if self.positions else math.prod(self.shape)


@dataclass
class Factor:
    """A factor's storage levels as (index, level), in the order the nest reads them
    (a dense operand: its indices in layout order, each a dense level)."""

    operand: int
    sparse: bool
    levels: list[tuple[str, Level]]
    fibers: list[float]
    natural: bool  # read in its own index (dense) or storage (sparse) order
    in_place: bool  # read where it is, without a copy
    nnz: int
    storage: float = 0.0  # index entries of the (possibly re-stored) levels

    @property
    def transpose_cost(self) -> float:
        if self.in_place:
            return 0.0
        if not self.sparse:
            return DENSE_COPY_COST * self.nnz
        return TRANSPOSE_COST * (self.nnz + self.storage)

    def nest_factor(self) -> NestFactor:
        return NestFactor(self.operand, self.sparse, tuple(self.levels))


def estimate_positions(levels: Sequence[Level], sizes: Sequence[int], nnz: int) -> list[float]:
    """Expected positions of each storage level of a tensor with ``nnz`` entries."""
    positions, parent, full = [], 1.0, 1.0
    for level, size in zip(levels, sizes):
        full *= max(size, 1)
        parent = level.estimate_positions(parent, nnz, full, size)
        positions.append(parent)
    return positions


def stored_in_order(access, fmt: Format, loop_rank: dict[str, int]) -> bool:
    """Whether loops ranked ``loop_rank`` visit a sparse ``access``'s indices in its
    storage order (read as stored, no re-stored copy)."""
    stored = [access.indices[m] for m in fmt.mode_order]
    return all(loop_rank[a] <= loop_rank[b] for a, b in zip(stored, stored[1:]))


def read_in_order(access, info: OperandInfo, loop_rank: dict[str, int], term: Term) -> Factor:
    """A factor read in loop order. A dense operand is laid out in loop order too (a
    copy when that differs from its memory order, indices of extent one aside), so its
    innermost accesses are unit-stride."""
    if info.format is None:
        layout = sorted(access.indices, key=lambda i: loop_rank[i])
        stored = access.indices if info.layout is None else tuple(access.indices[m] for m in info.layout)
        wide = {i for i, n in zip(access.indices, info.shape) if n != 1}
        in_place = [i for i in layout if i in wide] == [i for i in stored if i in wide]
        return Factor(access.operand, False, [(i, Dense()) for i in layout], [], layout == list(access.indices),
                      in_place, info.nnz)
    fmt = info.format
    natural = [access.indices[m] for m in fmt.mode_order]
    in_order = stored_in_order(access, fmt, loop_rank)
    wanted = natural if in_order else sorted(natural, key=lambda i: loop_rank[i])
    levels = fmt.levels
    if in_order:
        positions = list(info.positions)
    else:
        levels = fmt.restored_levels(exact=term.value is not None)
        sizes = [info.shape[access.indices.index(i)] for i in wanted]
        positions = estimate_positions(levels, sizes, info.nnz)
    fibers, parent, storage = [], 1.0, 0.0
    for level, p in zip(levels, positions):
        fibers.append(p / parent if parent > 0 else 0.0)
        storage += level.index_entries(parent, p)
        parent = p
    return Factor(access.operand, True, list(zip(wanted, levels)), fibers, in_order, in_order, info.nnz, storage)


def outside_vector(f: Factor, k: str, reductions: set[str], below: str | None = None) -> bool:
    """Whether factor ``f`` holds a register-blocked ``k`` as its last level, dense, and
    no index of the reductions the block sums over: it is read as a vector where the
    block is stored, scaling the sums (a sampled output's anchor). ``below``: its levels
    from this index down must be dense too (positions affine in a register tile's rows)."""
    held = [i for i, _ in f.levels]
    if not held or held[-1] != k or reductions & set(held):
        return False
    start = held.index(below) if below in held else len(held) - 1
    return all(level.full and level.locatable for _, level in f.levels[start:])


def register_blockable(order: Sequence[str], output: Sequence[str], factors: Sequence[Factor]) -> bool:
    """Whether the innermost loop ``k`` can keep a block of outputs in registers (one
    vector at least, masked where ``k`` is narrower) across reduction loops directly
    above it: ``k`` is an output index, read by some factor inside the sums and by no
    sparse one but vectors outside them (so every factor holding it is a dense operand
    laid out with it last, or a dense last level)."""
    if len(order) < 2 or order[-1] not in output or order[-2] in output:
        return False
    k = order[-1]
    reductions = set(order[reductions_from(order, output, len(order) - 1):-1])
    inside = [f for f in factors if any(i == k for i, _ in f.levels) and not outside_vector(f, k, reductions)]
    return bool(inside) and not any(f.sparse for f in inside)  # else broadcast over k, or k sparse


def nest_cost(
    term: Term,
    order: Sequence[str],
    infos: Sequence[OperandInfo],
    dims: dict[str, int],
    target: Target,
    output: tuple[str, ...] = (),
    lanes: int | None = None,
) -> tuple[float, float, list[Factor]]:
    """(cost, leaf iterations, factors) of running ``term`` in loop ``order``.

    ``output`` (dense outputs) counts toward the innermost loop's unit stride;
    ``lanes``: the values per vector, below which an innermost output loop is short
    (None: the target's ``cost_vector_lanes``)."""
    width = target.cost_vector_lanes
    lanes = width if lanes is None else lanes
    rank = {i: n for n, i in enumerate(order)}
    factors = [read_in_order(a, infos[a.operand], rank, term) for a in term.factors]
    depth = [0] * len(factors)
    cost, iters = 0.0, 1.0
    if output and list(output) != sorted(output, key=rank.__getitem__):  # output re-laid out too
        cost += DENSE_COPY_COST * math.prod(dims[i] for i in output)
    last_reduction = max((p for p, i in enumerate(order) if i not in output), default=None) if output else None
    nest_factors = [f.nest_factor() for f in factors]
    gathered = bool(output) and bool(order) and gathered_reduction(order, output, nest_factors)
    for position, index in enumerate(order):
        n = float(max(dims[index], 1))
        if position == len(order) - 1 and last_reduction is not None and last_reduction < position \
                and n < lanes and not register_blockable(order, output, factors):
            cost += iters * SHORT_OUTPUT_LOOP_COST
        fibers, entered = [], []
        for k, f in enumerate(factors):
            if f.sparse and depth[k] < len(f.levels) and f.levels[depth[k]][0] == index:
                if not f.levels[depth[k]][1].locatable:
                    fibers.append(f.fibers[depth[k]])
                if depth[k] == 0:
                    entered.append((k, f.levels[0][1].locatable))
                depth[k] += 1
        for k, located in entered:
            if iters > 1 and len(fibers) == (0 if located else 1):  # traversed in full, ``iters`` times
                cost += RESTREAM_COST * (iters - 1) * (factors[k].nnz + factors[k].storage)
        if fibers and gathered and position == len(order) - 1:
            trip = fibers[0]
            work = _gathered_work(trip, nest_factors, index, len(term.factors), lanes, target)
        elif fibers:
            trip = n * math.prod(min(fk / n, 1.0) for fk in fibers)
            work = SPARSE_ITERATION_COST * sum(fibers)
        else:
            trip = work = n
            if position == len(order) - 1:
                work = math.ceil(n / width)
        cost += iters * max(work, 1.0)
        iters *= trip
    innermost_dense = bool(order) and not any(
        f.sparse and f.levels[-1][0] == order[-1] and not f.levels[-1][1].locatable for f in factors
    )
    if innermost_dense:  # whole vectors per trip of the loops outside the innermost
        inner = max(dims[order[-1]], 1)
        cost += iters / inner * math.ceil(inner / width) * len(term.factors)
    elif not gathered:  # a gathered reduction's products are in its loop's work
        cost += iters * len(term.factors)
    relaid = sum(1 for f in factors if not (f.in_place or f.sparse))
    cost += sum(f.transpose_cost for f in factors) + relaid * target.relayout_cycles / target.cycles_per_cost_unit
    return cost, iters, factors


def _gathered_work(fiber: float, factors: Sequence[NestFactor], index: str, products: int, lanes: int,
                   target: Target) -> float:
    """The work of a gathered reduction over a fiber of ``fiber`` positions (see the
    module doc): its whole groups a vector of positions at a time, the rest one by one."""
    group = target.gathered_vectors * lanes
    scalar = fiber if fiber < group else group / 2
    gathers = sum(1 for f in factors if not f.sparse and index in f.indices)
    step = SPARSE_ITERATION_COST + products
    return step * scalar + (fiber - scalar) * (step / lanes + GATHER_COST * gathers)


class NestCosts:
    """:func:`nest_cost` of one ``term`` over the loop orders a search tries, each order
    costed once (a search asks for an order's cost, then its factors and leaf count;
    both are the same at every ``lanes``)."""

    def __init__(self, term: Term, infos: Sequence[OperandInfo], dims: dict[str, int], target: Target,
                 output: tuple[str, ...] = (), lanes: int | None = None) -> None:
        self.term, self.infos, self.dims, self.target, self.output, self.lanes = term, infos, dims, target, output, lanes
        self._costed: dict[tuple[str, ...], tuple[float, float, list[Factor]]] = {}

    def __call__(self, order: tuple[str, ...]) -> tuple[float, float, list[Factor]]:
        """(cost, leaf iterations, factors) of ``order``."""
        costed = self._costed.get(order)
        if costed is None:
            costed = nest_cost(self.term, order, self.infos, self.dims, self.target, self.output, self.lanes)
            self._costed[order] = costed
        return costed

    def reads_anchor_as_stored(self, order: tuple[str, ...], anchor: int) -> bool:
        """Whether ``order`` reads every access of operand ``anchor`` in its storage order."""
        rank = {i: n for n, i in enumerate(order)}
        fmt = self.infos[anchor].format
        return all(stored_in_order(a, fmt, rank) for a in self.term.factors if a.operand == anchor)
