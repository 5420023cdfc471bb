"""Dense and sampled outputs: each term's nest adds into ``out``.

The output is a dense array in the schedule's output order, or, for a *sampled*
output, the values of an anchor operand's pattern (written at the anchor's
positions). Trailing reduction loops sum into a scalar that is stored once after them,
scaled by the factors constant across them; a term with a value tree evaluates it
whole at each point, and a max or min reduction combines like a sum: into a scalar
that starts at the reduction's identity across trailing reduction loops, else into the
output (filled with the identity unless stored once). An epilogue
runs per output slice or after the nests (:mod:`.epilogue`). The first nest stores
with ``=`` when the schedule says it stores each element once. A parallel nest's
outermost loop (or its team loops, flattened: :func:`.order.emit_order`) runs in chunks
(:mod:`.chunks`); a nest with a register block runs its micro-kernel
(:mod:`.microkernel`).
"""

from __future__ import annotations

import functools

from ..frontend.functions import IDENTITY
from ..loops import ir
from ..plan.decisions import reductions_from
from ..plan.block_pack import PACKED_BLOCK_CHUNKS_PER_THREAD
from ..plan.microkernel import PACKED_CHUNKS_PER_THREAD
from ..plan.schedule import Nest
from .chunks import HI, LO, NCHUNKS, balancing_pos, chunk_bounds, chunk_prologue
from .context import Lowering, product_of
from .epilogue import epilogue_pass, fuse_epilogue
from .iterators import initial_states
from .microkernel import dot_tile, register_blocked
from .order import NestWalk, emit_order
from .tile_access import OUT

__all__ = ["lower_dense_output", "anchor_factor"]


def anchor_factor(term, output: tuple[str, ...], anchor: int) -> int:
    """The factor of ``term`` that reads operand ``anchor`` at exactly the output indices."""
    return next(k for k, f in enumerate(term.factors) if f.operand == anchor and f.indices == output)


def lower_dense_output(lo: Lowering, anchor: int | None) -> bool:
    """Emit every term's nest, and the epilogue after them unless a nest fuses it;
    returns whether the first nest stores each element once (the caller then need not
    fill the output with the reduction's identity)."""
    overwrites = False
    for n, nest in enumerate(lo.s.nests):
        once = n == 0 and (nest.stores_once if anchor is None else anchor in nest.stores_once_anchors)
        overwrites |= once
        lo.emit(lo.block(lambda nest=nest, once=once: _nest(lo, nest, anchor, once)))
    if lo.a.epilogue is not None and not any(nest.epilogue_at is not None for nest in lo.s.nests):
        epilogue_pass(lo)
    return overwrites


def _nest(lo: Lowering, nest: Nest, anchor: int | None, once: bool) -> None:
    term = lo.a.terms[nest.term]
    states = initial_states(lo, nest.term, term)
    order, output = nest.order, lo.a.output
    coef = ir.Const(float(term.coefficient))
    store = "=" if once else "+="
    k_anchor = None if anchor is None else anchor_factor(term, output, anchor)
    if anchor is None:
        dense = lo.offset(lo.s.output_order)

        def offset(st):
            return dense
    else:

        def offset(st):
            return st[k_anchor].pos

    split = reductions_from(order, output, len(order))
    walk = NestWalk(nest, order, None)
    reduction = lo.a.reduction
    if split < len(order):
        inner = set(order[split:])
        # A product's factors constant across the reductions multiply the sum once; a
        # value tree is evaluated whole at each point.
        outside = [] if term.multiplied is None else [k for k, f in enumerate(term.factors)
                                                      if not inner & set(f.indices)]
        acc = lo.fresh("acc")
        walk.accumulator, walk.combine = acc, reduction
        if reduction == "sum":
            inside = [k for k in range(len(term.factors)) if k not in outside]
            walk.summed = ir.Const(1.0), inside

        def start(st):
            lo.emit(ir.Decl(acc, "V", ir.Const(IDENTITY[reduction])))

        def finish(st):
            if reduction == "sum":
                lo.emit(ir.Assign(ir.Load(OUT, offset(st)), product_of([coef, *lo.values(st, outside), acc]), store))
            else:
                _combine(lo, ir.Load(OUT, offset(st)), acc, reduction, once)

        walk.around[split] = (start, finish)
        if reduction != "sum":  # the coefficient scales each value, before the max
            walk.leaf = lambda st: _combine(lo, acc, ir.mul(coef, lo.term_value(term, st)), reduction, False)
        elif term.multiplied is None:
            walk.leaf = lambda st: _combine(lo, acc, lo.term_value(term, st), reduction, False)
        else:
            walk.leaf = lambda st: lo.emit(ir.Assign(acc, lo.product(st, inside), "+="))
        if nest.dot_tile is not None:
            walk.wrap[order.index(nest.dot_tile.rows)] = dot_tile(lo, nest, walk, inside, outside, coef, store,
                                                                    k_anchor)
    else:
        walk.leaf = lambda st: _combine(lo, ir.Load(OUT, offset(st)), ir.mul(coef, lo.term_value(term, st)),
                                        reduction, once)
    if lo.a.epilogue is not None and nest.epilogue_at is not None and nest.register_block is None:
        fuse_epilogue(lo, walk.wrap, walk.bounds, order, nest.epilogue_at)

    tiles = [t for t in nest.tiles if t.index != order[0]]

    def loops():
        starts = {}
        for tile in tiles:
            tv = starts[tile.index] = ir.Var(f"T{lo.indices.index(tile.index)}")
            walk.bounds[tile.index] = (tv, ir.min_(ir.add(tv, tile.size), lo.dim(tile.index)))
            lo.tile_bounds[tile.index] = walk.bounds[tile.index]
        body = lo.block(lambda: _chunks(lo, nest, walk, states, term, offset, coef, once, k_anchor), scoped=False)
        for tile in reversed(tiles):
            tv, n = starts[tile.index], lo.dim(tile.index)
            body = ir.Block((ir.For(ir.Decl(tv, "index", ir.Const(0)), ir.lt(tv, n), ir.Assign(tv, ir.Const(tile.size), "+="),
                                    body),), scoped=False)
        lo.emit(*body.stmts)

    if nest.parallel and lo.team_coordinate is None:
        lo.emit(ir.Parallel(lo.block(loops)))
    else:
        loops()


def _combine(lo: Lowering, target: ir.Expr, value: ir.Expr, reduction: str, once: bool) -> None:
    """``target`` (+)= ``value``, or ``target = max(target, value)`` (min) unless stored once."""
    if once:
        lo.emit(ir.Assign(target, value))
    elif reduction == "sum":
        lo.emit(ir.Assign(target, value, "+="))
    else:
        lo.emit(ir.Assign(target, ir.Math(reduction, (target, value))))


def _chunks(lo, nest, walk, states, term, offset, coef, once, k_anchor) -> None:
    """The nest's loops, the outermost (or the team loops, flattened) in chunks shared by
    the team if parallel."""
    def run():
        if nest.register_block is not None:
            register_blocked(lo, nest, walk, states, term, offset, coef, once, k_anchor)
        else:
            emit_order(lo, walk, states)

    if not nest.parallel:
        run()
        return
    if lo.team_coordinate is not None:
        run()
        return
    chunk = ir.Var("sn_chunk")
    team = nest.order[:nest.team_loops]
    balance = balancing_pos(states, nest.order[0]) if len(team) == 1 else None
    target = lo.s.target
    per_thread = target.chunks_per_thread if balance is not None else target.even_range_chunks_per_thread
    tile = nest.register_tile
    if tile is not None and tile.packed and tile.grouped_by is not None:
        per_thread = PACKED_CHUNKS_PER_THREAD  # each chunk copies its packs
    if nest.packed_block is not None:
        per_thread = PACKED_BLOCK_CHUNKS_PER_THREAD  # ... and so does a packed block's
    chunk_prologue(lo, functools.reduce(ir.mul, [lo.dim(index) for index in team]), per_thread)

    def body():
        chunk_bounds(lo, chunk, NCHUNKS, balance)
        walk.bounds[nest.order[0]] = (LO, HI)  # of the flattened coordinates when the team shares several loops
        run()

    lo.emit(ir.For(ir.Decl(chunk, "index", ir.Const(0)), ir.lt(chunk, NCHUNKS), ir.Incr(chunk), lo.block(body),
                   "omp_for"))


