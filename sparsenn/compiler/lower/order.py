"""A nest's loops in order, each emitted as its schedule decided.

:func:`emit_order` walks ``order[position:]``: each loop is co-iterated
(:mod:`.merge`), or, where the nest's decisions say so, emitted as a vector or sparse
reduction or with a row block (:mod:`.reductions`) and prefetches (:mod:`.prefetch`);
``around[j]`` wraps loop ``j`` (a reduction's accumulator and its store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..loops import ir
from ..plan.schedule import Nest
from . import reductions
from .context import Lowering
from .iterators import filtering, locate
from .merge import co_iterate
from .prefetch import prefetcher, spans
from .reductions import Summed

__all__ = ["NestWalk", "emit_order"]

Hook = Callable[[list], None]


@dataclass
class NestWalk:
    """What a walk over a nest's loops carries: the nest (its decisions), the leaf,
    loop bounds (tiles, chunks), wrappers, the accumulator of trailing reductions, how
    it combines (``sum``, ``max``, ``min``) and its sum of products, an open register block
    ``(k, start, end)`` from loop position ``block_from``, and ``wrap[j](states,
    inner)``, which emits what encloses loop ``j`` and calls ``inner`` for the loops
    from ``j`` on; ``blocked[j](states)``: the emitter of loop ``j``'s whole blocks of
    positions (see :func:`.merge.co_iterate`)."""

    nest: Nest
    order: Sequence[str]
    leaf: Hook
    bounds: dict = field(default_factory=dict)
    around: dict = field(default_factory=dict)
    accumulator: ir.Var | None = None
    combine: str = "sum"
    summed: Summed | None = None
    block: tuple | None = None
    block_from: int = 0
    wrap: dict = field(default_factory=dict)
    blocked: dict = field(default_factory=dict)


def _prefetched(nest: Nest, index: str) -> tuple[int, ...]:
    return next((loop.factors for loop in nest.prefetch if loop.index == index), ())


def emit_order(lo: Lowering, walk: NestWalk, states: list, position: int = 0, wrapped: bool = False) -> None:
    order, nest = walk.order, walk.nest
    if position == 0 and (nest.team_loops > 1 or lo.team_coordinate is not None):
        _team_loops(lo, walk, states)
        return
    if position in walk.wrap and not wrapped:
        walk.wrap[position](states, lambda: emit_order(lo, walk, states, position, True))
        return
    if position == len(order):
        walk.leaf(states)
        return
    before, after = walk.around.get(position, (None, None))
    if before:
        before(states)
    index = order[position]
    innermost = position == len(order) - 1
    bounds = walk.bounds.get(index)
    reduced = walk.summed is not None
    if reduced and innermost and nest.vector_reduction and nest.vector_reduction.index == index:
        reductions.vector_reduction(lo, index, states, walk.accumulator, walk.summed, nest.vector_reduction.vectors,
                                    nest.vector_reduction.accumulators, bounds)
    elif walk.combine != "sum" and innermost and nest.vector_reduction and nest.vector_reduction.index == index:
        coef = ir.Const(float(lo.a.terms[nest.term].coefficient))
        reductions.extremum_reduction(lo, index, states, walk.accumulator, walk.combine, coef,
                                      nest.vector_reduction.accumulators, bounds)
    elif reduced and innermost and nest.sparse_reduction and nest.sparse_reduction.index == index:
        (driver,) = filtering(index, states)
        reductions.sparse_reduction(lo, index, states, driver, walk.accumulator, walk.summed,
                                    nest.sparse_reduction.accumulators, bounds, nest.sparse_reduction.gathered)
    else:
        blocked = walk.blocked[position](states) if position in walk.blocked else None
        if reduced and nest.row_block and nest.row_block.index == index and position == len(order) - 2:
            (driver,) = filtering(index, states)
            blocked = reductions.row_blocker(lo, nest.row_block, states, driver, walk.around.get(position + 1),
                                             walk.accumulator, walk.summed, walk.bounds)
        gathered = _prefetched(nest, index)
        block = walk.block if walk.block is not None and position >= walk.block_from else None
        declare = None
        if gathered:
            declare = prefetcher(lo, lo.s.prefetch_policy, states, spans(lo, gathered, index, states, walk.bounds,
                                                                           block), index)
        co_iterate(
            lo, index, states, lambda st: emit_order(lo, walk, st, position + 1), bounds,
            walk.accumulator if innermost else None, declare, blocked,
            innermost and nest.simd == index, walk.combine,
        )
    if after:
        after(states)



def _team_loops(lo: Lowering, walk: NestWalk, states: list) -> None:
    """The loops the team shares as one loop over their flattened coordinates (in the
    chunk's bounds, those of ``order[0]``), each iteration decomposing its coordinate
    into the loops' indices and locating the factors' levels there; in a fused
    kernel's stage, the one coordinate it runs at, with no loop (a loop of one
    iteration around an ``omp simd`` reduction keeps GCC from vectorising it)."""
    team = walk.order[:walk.nest.team_loops]
    flat = lo.fresh("flat")
    if lo.team_coordinate is not None:
        lo.emit(ir.Decl(flat, "index", lo.team_coordinate, const=True))
        _step_at(lo, team, flat, walk, states)
        return
    first, last = walk.bounds[team[0]]
    lo.emit(ir.For(ir.Decl(flat, "index", first), ir.lt(flat, last), ir.Incr(flat),
                   lo.block(lambda: _step_at(lo, team, flat, walk, states))))


def _step_at(lo: Lowering, team: Sequence[str], flat: ir.Var, walk: NestWalk, states: list) -> None:
    """The team loops' indices decomposed from their flattened coordinate ``flat``, the
    factors located there, and the loops below."""
    rest: ir.Expr = flat
    for index in reversed(team[1:]):
        lo.emit(ir.Decl(lo.var(index), "index", ir.Bin("%", rest, lo.dim(index)), const=True))
        rest = ir.Bin("/", rest, lo.dim(index))
    lo.emit(ir.Decl(lo.var(team[0]), "index", rest, const=True))
    located = states
    for index in team:
        located, before = list(located), located
        locate(lo, index, before, located)
    emit_order(lo, walk, located, len(team))
