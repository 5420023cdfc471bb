"""Contraction paths for products of three or more operands.

One fused loop nest is not always best: ``A[i,j] B[j,k] C[k,l]`` fused iterates
``nnz(A) * K * L`` points, while contracting ``A B`` first (``nnz(A) * K``) and then the
dense ``(A B) C`` costs far less. Fusion wins when it avoids a large intermediate, as in
SDDMM ``A[i,j] X[i,k] Y[j,k]`` (the dense ``X Yᵀ`` never exists) or ``bn,bd,ndh->bh``
with sparse ``bn`` (only the nonzero ``(b, n)`` pairs are visited).

:func:`best_path` compares the fused schedule's cost with the cheapest tree of pairwise
contractions (each pair itself scheduled, or left to BLAS when both are dense) and
returns ``None`` when fusing everything is cheapest. Every pair is a launch of its own,
where the fused nest is one: a pair costs the target's ``launch_cycles`` besides its work
(``launch_cost``), and so does the fused nest. Intermediates are internal, so
their format is free: one whose estimated fill reaches ``SPARSE_OUTPUT_DENSITY`` is
kept dense (``X·Wᵀ``-like products of a dense and a sparse operand fill in), instead of
being assembled as a sparse tensor that is then nearly full; one with exactly an
operand's pattern is that operand's values computed in place (:mod:`.anchor`), as the
step will run. Its indices come in the output's order, but for such an in-place result:
it keeps its operands' order (two tensors on one pattern multiplied where they are
stored, not assembled transposed).

**Search.** An intermediate is named by the set ``S`` of operands it holds; it keeps
the indices of ``S`` that the output or an operand outside ``S`` still needs. A greedy
search first contracts, at each step, the cheapest pair that shares an index (any
pair, when none does). Then, for up to :data:`EXACT_OPERANDS` operands and at most
:data:`EXACT_SPLITS` candidate splits, dynamic programming over these sets (opt_einsum's
``dp``) computes each set's cheapest tree once, after those of its parts::

    cost({k}) = 0,   cost(S) = min over splits S = L ⊔ R of cost(L) + cost(R) + pair(L, R)

A split is skipped when ``cost(L) + cost(R)`` already exceeds the best tree found for
``S``, the greedy tree or the fused cost (a pair's cost is never negative). Up to
:data:`ALL_SPLITS_OPERANDS` operands every split is a candidate (for three: every pair
order, as an exhaustive search); beyond, only splits of a connected set into two
connected sets that share an index (no outer products), and then every split of the
product's connected components. Each pair (two operands or intermediates and the
indices kept) is costed once per planning, and its schedule is cached across plannings:
``schedule`` calls are the expensive part (``cache_stats()["pair schedules"]`` counts
them as misses). No intermediate of more than :data:`~..backend.abi.MAX_OUTPUT_RANK`
indices is formed.

:func:`pairwise_path` is the tree search alone: the cheapest tree whatever fusing
would cost, within a rank bound.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .anchor import find_anchor
from .infer import SPARSE_OUTPUT_DENSITY, infer_output_format
from ..frontend.notation import Access, Assignment, Term
from ..backend.abi import MAX_OUTPUT_RANK
from ..runtime.cache import LRUCache
from .cost import estimate_positions
from .schedule import GEMM_SPEEDUP, OperandInfo, Schedule, schedule
from .target import Target

__all__ = ["Step", "best_path", "pairwise_path", "describe_path", "launch_cost"]

INTERMEDIATE_COST = 2.0  # per element of a dense intermediate: written, then read back
ALL_SPLITS_OPERANDS = 5  # up to this many operands, outer-product splits are searched too
EXACT_OPERANDS = 10  # beyond, greedy only (listing the splits alone takes 3^n steps)
EXACT_SPLITS = 500  # more candidate splits than this: greedy only

_pair_schedules: LRUCache[Schedule] = LRUCache("pair schedules", 512)


@dataclass(frozen=True)
class Step:
    """Contract operands ``left`` and ``right`` of the current list into one with
    ``indices`` (a dense tensor if ``dense``); the result is appended to the list."""

    left: int
    right: int
    indices: tuple[str, ...]
    dense: bool = False


@dataclass(frozen=True)
class _Tree:
    """The operands in ``mask`` (bit ``k`` for operand ``k``) contracted into one with
    ``indices``, at total ``cost``; ``parts`` are the (left, right) subtrees, none for an
    operand."""

    mask: int
    indices: tuple[str, ...]
    info: OperandInfo
    cost: float = 0.0
    parts: tuple[_Tree, ...] = ()
    pattern: int | None = None  # the operand whose pattern (index arrays) this tree's result has


def _pattern(infos: Sequence[OperandInfo], operand: int) -> int | None:
    """The operand whose pattern sparse operand ``operand`` has (the first sharing it)."""
    if infos[operand].format is None:
        return None
    return operand if infos[operand].pattern is None else infos[operand].pattern


def _lowest(mask: int) -> int:
    return mask & -mask


class _Pairs:
    """Pairwise contractions within one product term, each costed once; none forms an
    intermediate of more than ``max_rank`` indices."""

    def __init__(self, term: Term, output: tuple[str, ...], infos: Sequence[OperandInfo], itemsize: int,
                 max_rank: int = MAX_OUTPUT_RANK):
        self.output = output
        self.full = (1 << len(term.factors)) - 1
        self.itemsize = itemsize
        self.max_rank = max_rank
        self.dims = {i: infos[a.operand].shape[m] for a in term.factors for m, i in enumerate(a.indices)}
        self.operand_indices = [set(a.indices) for a in term.factors]
        self.launch = launch_cost(Target.current())
        self._costs: dict[tuple, tuple[float, OperandInfo, int | None]] = {}

    def join(self, a: _Tree, b: _Tree) -> tuple[float, _Tree]:
        """(cost of the pair, the tree contracting ``a`` and ``b``). The left factor is
        the one that comes first in the list :func:`_steps` keeps: operands in their
        order, then intermediates in the order they are made (lowest operand first)."""
        left, right = sorted((a, b), key=lambda t: (bool(t.parts), _lowest(t.mask)))
        mask = left.mask | right.mask
        needed = set(self.output).union(
            *(s for k, s in enumerate(self.operand_indices) if not mask >> k & 1)
        )
        seen = dict.fromkeys(left.indices + right.indices)
        keep = tuple(i for i in self.output if i in seen) + tuple(
            i for i in seen if i in needed and i not in self.output
        )
        held = tuple(i for i in seen if i in needed)  # the operands' order
        term = Term(1.0, (Access(0, left.indices), Access(1, right.indices)))
        shared = left.pattern is not None and left.pattern == right.pattern
        infos = (replace(left.info, pattern=None), replace(right.info, pattern=0 if shared else None))
        cost, info, anchor = self.result(Assignment(held, (term,), ("left", "right")), infos)
        indices = held
        if anchor is None or mask == self.full:
            indices = keep
            cost, info, anchor = self.result(Assignment(keep, (term,), ("left", "right")), infos)
        pattern = None if anchor is None else (left, right)[anchor].pattern
        return cost, _Tree(mask, indices, info, left.cost + right.cost + cost, (left, right), pattern)

    def result(self, pair: Assignment, infos: tuple[OperandInfo, ...]) -> tuple[float, OperandInfo, int | None]:
        """:meth:`_result`, once per pair."""
        key = (pair, *infos)
        if key not in self._costs:
            self._costs[key] = self._result(pair, infos)
        return self._costs[key]

    def _schedule(self, pair: Assignment, infos: tuple[OperandInfo, ...], fmt, anchor: int | None = None) -> Schedule:
        key = (pair, infos, fmt, anchor, self.itemsize)
        planned = _pair_schedules.get(key)
        if planned is None:
            planned = schedule(pair, infos, fmt, self.itemsize, anchor=anchor)
            _pair_schedules.put(key, planned)
        return planned

    def _result(self, pair: Assignment, infos: tuple[OperandInfo, ...]) -> tuple[float, OperandInfo, int | None]:
        """(cost, info, anchor) of contracting a pair: a launch, then a BLAS call when
        both are dense (``flops / GEMM_SPEEDUP``), else the pair's schedule; a dense
        result adds ``INTERMEDIATE_COST`` per element; a result on an operand's pattern
        (that operand: ``anchor``) is its values, computed in place; infinite beyond
        ``max_rank`` indices."""
        cost, info, anchor = self._work(pair, infos)
        return cost + self.launch, info, anchor

    def _work(self, pair: Assignment, infos: tuple[OperandInfo, ...]) -> tuple[float, OperandInfo, int | None]:
        shape = tuple(self.dims[i] for i in pair.output)
        if len(shape) > self.max_rank:
            return math.inf, OperandInfo(None, shape), None
        if all(i.format is None for i in infos):
            flops = math.prod(self.dims[i] for i in pair.terms[0].indices)
            return flops / GEMM_SPEEDUP + INTERMEDIATE_COST * math.prod(shape), OperandInfo(None, shape), None
        fmt = infer_output_format(pair, [i.format for i in infos])
        if fmt is not None and self._schedule(pair, infos, None).leaves >= SPARSE_OUTPUT_DENSITY * math.prod(shape):
            fmt = None  # fills in: keep the intermediate dense
        anchor = find_anchor(pair, infos, None, fmt)
        if anchor is not None:
            sched = self._schedule(pair, infos, None, anchor)
            if not any(pair.terms[0].factors[k].operand == anchor for (_, k), _ in sched.transposes):
                return sched.cost, replace(infos[anchor], shape=shape, pattern=None), anchor
        sched = self._schedule(pair, infos, fmt)
        if fmt is None:
            return sched.cost + INTERMEDIATE_COST * math.prod(shape), OperandInfo(None, shape), None
        nnz = int(min(math.prod(shape), max(sched.leaves, 1.0)))
        sizes = [shape[m] for m in fmt.mode_order]
        positions = tuple(int(p) for p in estimate_positions(fmt.levels, sizes, nnz))
        return sched.cost, OperandInfo(fmt, shape, positions), None


# ----------------------------------------------------------------------------- candidate splits

_Splits = dict[int, list[tuple[int, int]]]  # set of operands -> its (part, part) splits


def _halves(mask: int) -> list[tuple[int, int]]:
    """Each split of ``mask`` into two non-empty sets once, as (larger mask, smaller), by
    increasing larger mask (for three operands: ``{0,1}`` contracted first, then
    ``{0,2}``, then ``{1,2}``)."""
    found = []
    part = (mask - 1) & mask
    while part:
        if part > mask ^ part:
            found.append((part, mask ^ part))
        part = (part - 1) & mask
    return found[::-1]


def _splits(operand_indices: Sequence[set[str]]) -> _Splits | None:
    """The sets of operands the exact search visits, each with its candidate splits, in
    increasing mask order (every part before the sets it splits); ``None`` beyond
    :data:`EXACT_OPERANDS` operands or :data:`EXACT_SPLITS` splits."""
    n = len(operand_indices)
    if n > EXACT_OPERANDS:
        return None
    full = (1 << n) - 1
    if n <= ALL_SPLITS_OPERANDS:
        return {m: _halves(m) for m in range(1, full + 1) if m & (m - 1)}
    indices = {1 << k: s for k, s in enumerate(operand_indices)}
    connected = set(indices)
    splits: _Splits = {}
    count = 0
    for mask in range(1, full + 1):
        if not mask & (mask - 1):
            continue
        low = _lowest(mask)
        indices[mask] = indices[low] | indices[mask ^ low]
        found = [(a, b) for a, b in _halves(mask) if a in connected and b in connected and indices[a] & indices[b]]
        count += len(found)
        if count > EXACT_SPLITS:
            return None
        if found:
            connected.add(mask)
            splits[mask] = found
    components: list[int] = []
    for k in range(n):
        touching = [c for c in components if indices[c] & operand_indices[k]]
        components = [c for c in components if c not in touching] + [(1 << k) + sum(touching)]
    if len(components) > 1:  # joined by outer products, every split of them tried
        components.sort()

        def union(chosen: int) -> int:
            return sum(c for k, c in enumerate(components) if chosen >> k & 1)

        for chosen in range(1, 1 << len(components)):
            if chosen & (chosen - 1):
                found = [(union(a), union(b)) for a, b in _halves(chosen)]
                count += len(found)
                if count > EXACT_SPLITS:
                    return None
                splits[union(chosen)] = found
        splits = dict(sorted(splits.items()))
    return splits


# ----------------------------------------------------------------------------- search


def _greedy(leaves: Sequence[_Tree], pairs: _Pairs) -> _Tree:
    """Contract the cheapest pair sharing an index (any pair, when none does) until one
    tree remains."""
    trees = list(leaves)
    while len(trees) > 1:
        candidates = list(itertools.combinations(trees, 2))
        candidates = [(a, b) for a, b in candidates if set(a.indices) & set(b.indices)] or candidates
        _, tree = min((pairs.join(a, b) for a, b in candidates), key=lambda joined: joined[0])
        trees = [t for t in trees if not t.mask & tree.mask] + [tree]
    return trees[0]


def _exact(leaves: Sequence[_Tree], splits: _Splits, pairs: _Pairs, bound: float) -> _Tree | None:
    """The cheapest tree over all candidate splits (the first split on ties), by dynamic
    programming over sets; splits whose parts already cost more than ``bound`` are
    skipped. ``None`` if every split of some set needed was skipped."""
    best = {leaf.mask: leaf for leaf in leaves}
    for mask, candidates in splits.items():
        chosen = None
        for a, b in candidates:
            left, right = best.get(a), best.get(b)
            if left is None or right is None:
                continue
            lower = left.cost + right.cost
            if lower > bound or (chosen is not None and lower > chosen.cost):
                continue
            _, tree = pairs.join(left, right)
            if chosen is None or tree.cost < chosen.cost:
                chosen = tree
        if chosen is not None:
            best[mask] = chosen
    return best.get((1 << len(leaves)) - 1)


def _steps(tree: _Tree, n: int) -> list[Step]:
    """The tree as list steps, each subtree's left part first."""
    current = [1 << k for k in range(n)]
    full = (1 << n) - 1
    steps: list[Step] = []

    def emit(t: _Tree) -> None:
        if not t.parts:
            return
        left, right = t.parts
        emit(left)
        emit(right)
        dense = t.mask != full and t.info.format is None
        steps.append(Step(current.index(left.mask), current.index(right.mask), t.indices, dense))
        current.remove(left.mask)
        current.remove(right.mask)
        current.append(t.mask)

    emit(tree)
    return steps


def best_path(
    assignment: Assignment, infos: Sequence[OperandInfo], itemsize: int, anchored: bool = False, dense: bool = False
) -> list[Step] | None:
    """The cheapest pairwise contraction sequence, or ``None`` to fuse all operands.

    ``anchored``: the fused result would take a sampling operand's pattern (SDDMM), so
    it is costed as the dense-output nest that writes values in place, with no assembly;
    ``dense``: the result is requested dense, and the fused nest is costed so."""
    (term,) = assignment.terms
    if len(term.factors) < 3:
        return None
    fmt = None if anchored or dense else infer_output_format(assignment, [i.format for i in infos])
    fused = schedule(assignment, infos, fmt, itemsize).cost + launch_cost(Target.current())
    found = pairwise_path(assignment, infos, itemsize, bound=fused)
    return None if found is None else found[1]


def pairwise_path(
    assignment: Assignment, infos: Sequence[OperandInfo], itemsize: int, bound: float = math.inf,
    max_rank: int = MAX_OUTPUT_RANK,
) -> tuple[float, list[Step]] | None:
    """``(cost, steps)`` of the cheapest tree of pairwise contractions the search finds
    for ``assignment``'s single product term, or ``None`` when none costs less than
    ``bound`` with every intermediate within ``max_rank`` indices."""
    (term,) = assignment.terms
    n = len(term.factors)
    pairs = _Pairs(term, assignment.output, infos, itemsize, max_rank)
    leaves = [_Tree(1 << k, a.indices, infos[a.operand], pattern=_pattern(infos, a.operand))
              for k, a in enumerate(term.factors)]
    tree = _greedy(leaves, pairs)
    splits = _splits(pairs.operand_indices)
    if splits is not None:
        exact = _exact(leaves, splits, pairs, min(bound, tree.cost))
        if exact is not None and exact.cost <= tree.cost:
            tree = exact
    return (tree.cost, _steps(tree, n)) if tree.cost < bound else None


def launch_cost(target: Target) -> float:
    """A kernel's launch in the cost model's units (``target.launch_cycles``)."""
    return target.launch_cycles / target.cycles_per_cost_unit


def describe_path(assignment: Assignment, steps: Sequence[Step]) -> list[str]:
    """One line per step of a contraction path over ``assignment``'s single term, its
    intermediates named ``T1``, ``T2``, ... in the order they are made."""
    (term,) = assignment.terms
    names = [f"operand{a.operand}[{','.join(a.indices)}]" for a in term.factors]
    lines = []
    for n, step in enumerate(steps, 1):
        left, right = names[step.left], names[step.right]
        last = n == len(steps)
        made = "Out" if last else f"T{n}"
        kind = "the result" if last else "dense" if step.dense else "format chosen by its fill"
        lines.append(f"  step {n}: {made}[{','.join(step.indices)}] = {left} * {right} ({kind})")
        kept = [x for k, x in enumerate(names) if k not in (step.left, step.right)]
        names = [*kept, f"{made}[{','.join(step.indices)}]"]
    return lines
