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
(:mod:`.chunks`); a register-blocked nest ``P + R + (k,)`` runs::

    for P: for kb in whole blocks of k: acc[0:B] = 0
               for R: acc[:] += scalar factors * vector factors[kb : kb + B]
               out[P, kb : kb + B] (+)= coef * outside vectors[kb : kb + B] * acc
           the last, partial block the same way, its vectors' lanes past k masked

with ``acc`` ``B / lanes`` SIMD vectors kept in registers; the *outside* vectors hold
``k`` but no index of ``R`` (a sampled output's anchor, whose positions the stores
take). With ``S`` interleaved sums (``R`` one sparse loop), the stored positions
``q .. q + S - 1`` of each whole group add into ``S`` sets of accumulators, summed
into ``acc`` after the groups (a block of one vector would wait on every add). A
register tile over the loop
``a`` just above ``R`` (``P = P' + (a,)``) runs::

    for P': for ab in whole tiles of a: a = ab; locate a
                for kb in whole blocks of k: acc[0:T][0:B] = 0
                    for R: x[v] = vector factors[kb + v]; s[t] = scalar factors at a + t
                           acc[t][v] += s[t] * x[v]
                    out[P', ab + t, kb : kb + B] (+)= coef * acc[t]
            for a in the whole tiles: for R: for k in the partial block: out[P, k] += ...
            for a in the last, partial tile: the register block above

the scalars at ``a + t`` read at their position at ``a`` plus ``t`` times the extent
below ``a`` (their levels from ``a`` down are dense, so positions are affine in ``a``).
Rows gathered by a sparse level take whole tiles of its stored positions ``q .. q + T``
instead (row ``t`` is ``crd[q + t]``; the gathering factor's value is at ``q + t``), and
the plain nest continues from the first coordinate left. Scalar factors constant
across ``R`` (a gate's value at each gathered row) scale the stored sums instead of
every step. With *packed* factors every row runs one panel of ``k`` at a time::

    for layers [dl, de) of d (one layer: all of d): for panels [pk, pe) of whole blocks of k:
        if a has rows: for d in [dl, de): prefetch factor[..., d + 8, pk : pe]
            pack[(kb - pk) / B][d - dl][0:B] = factor[..., d, kb : kb + B]  for kb in the panel
        for ab in whole tiles of a: for kb in [pk, pe): ... the tile over d in [dl, de), reading pack
        for a in the rows left: for kb in [pk, pe): ... a tile of one row, reading pack
    for a in all rows: for R: for k in the partial block: out[P, k] += ...

(``pack`` a per-thread buffer kept across calls; ``R`` is the one dense loop ``d``; every
layer's tiles add into the output; a factor laid out with ``d`` last is packed by
blocks of lanes x lanes, each transposed in registers).

A *grouped* tile (``W``'s last level ``e`` holds a fixed number of entries per group)
runs::

    for P': for ab in whole tiles of a: a = ab; locate a
                for kb in whole blocks of k, then the partial block (masked):
                    acc[0:T][0:B] = 0
                    for R without e: for t in the tile: for e in row t's group:
                        acc[t][:] += W at row a + t * vector factors[kb : kb + B]
                    out[P', ab + t, kb : kb + B] (+)= coef * acc[t]
            for a in the rows left: the register block above

(``W``'s position at row ``a + t`` is its position at ``a`` plus ``t`` times the extents
of its dense levels between ``a`` and ``e``).
"""

from __future__ import annotations

import dataclasses
import functools

from ..functions import IDENTITY
from ..loops import ir
from ..plan.decisions import reductions_from
from ..plan.schedule import Nest
from .chunks import CHUNKS_PER_THREAD, EVEN_RANGE_CHUNKS_PER_THREAD, HI, LO, NCHUNKS, balancing_pos, chunk_bounds, \
    chunk_prologue
from .context import ONES, Lowering, counted, product_of
from .epilogue import epilogue_pass, fuse_epilogue
from .iterators import initial_states, locate, open_cursor
from .reductions import enter
from .order import NestWalk, emit_order

__all__ = ["lower_dense_output", "anchor_factor"]

OUT = ir.Array("out")


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
            walk.wrap[order.index(nest.dot_tile.rows)] = _dot_tile(lo, nest, walk, inside, outside, coef, store,
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
            _register_blocked(lo, nest, walk, states, term, offset, coef, once, k_anchor)
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
    chunk_prologue(lo, functools.reduce(ir.mul, [lo.dim(index) for index in team]),
                   CHUNKS_PER_THREAD if balance is not None else EVEN_RANGE_CHUNKS_PER_THREAD)

    def body():
        chunk_bounds(lo, chunk, NCHUNKS, balance)
        walk.bounds[nest.order[0]] = (LO, HI)  # of the flattened coordinates when the team shares several loops
        run()

    lo.emit(ir.For(ir.Decl(chunk, "index", ir.Const(0)), ir.lt(chunk, NCHUNKS), ir.Incr(chunk), lo.block(body),
                   "omp_for"))


def _register_blocked(lo, nest, walk, states, term, offset, coef, once, k_anchor) -> None:
    """The register-blocked nest (see the module doc); ``k_anchor``: the factor whose
    positions a sampled output's values take (None for a dense output)."""
    order, output = nest.order, lo.a.output
    size = nest.register_block.size
    k = order[-1]
    r = reductions_from(order, output, len(order) - 1)
    summed = set(order[r:-1])
    outside = [n for n, st in enumerate(states) if k in _held(st) and not summed & set(_held(st))]
    with_k = [n for n, st in enumerate(states) if not st.sparse and k in st.dense_indices and n not in outside]
    scalars = [n for n in range(len(term.factors)) if n not in with_k and n not in outside]
    kb, acc, mask = lo.fresh("kb"), lo.fresh("vacc"), lo.fresh("kmask")
    var_k, v = lo.var(k), ir.Var("v")
    k_lo, n_k = walk.bounds.get(k, (ir.Const(0), lo.dim(k)))
    if k in walk.bounds:
        end = lo.fresh("kend")
        lo.emit(ir.Decl(end, "index", n_k, const=True))
        n_k = end
    vectors = ir.Bin("/", ir.Const(size), ir.Lanes())
    lane = ir.mul(v, ir.Lanes())
    # Whether the pass being emitted is the last, partial block: vector v then holds
    # the lanes ``mask[v]`` of its span.
    partial = [False]

    def count() -> ir.Expr | None:
        return ir.Elem(mask, (v,)) if partial[0] else None

    # The block's sums: ``acc``, and with interleaved sums, ``sums[u]`` for the position
    # ``u`` of each whole group of the sparse loop's positions (``sums[0]`` is ``acc``).
    sums = [acc, *(lo.fresh("vacc") for _ in range(nest.block_sums - 1))]
    into = [acc]  # the sums the leaf adds into

    def vector_leaf(st):
        lo.emit(ir.Decl(var_k, "index", kb, const=True))
        loads = [lo.vector_load(st[n], count=count()) for n in with_k]
        lo.emit(counted(v, vectors, ir.Assign(ir.Elem(into[0], (v,)), product_of([lo.product(st, scalars), *loads]),
                                              "+=")))

    def interleaved(states_at_r):
        """Whole groups of ``len(sums)`` positions of the sparse loop ``order[r]``, each
        position into its own sums, added into ``acc`` after the groups."""
        def emit(cursor, prefetch):
            q, group = cursor.q, len(sums)

            def at_position(u: int):
                if prefetch:
                    prefetch(ir.add(q, u))
                into[0] = sums[u]
                emit_order(lo, plain, enter(lo, order[r], states_at_r, cursor, ir.add(q, u)), r + 1)
                into[0] = acc

            lo.emit(ir.For(None, ir.le(ir.add(q, group), cursor.h), ir.Assign(q, ir.Const(group), "+="),
                           ir.Block(tuple(lo.block(lambda u=u: at_position(u)) for u in range(group)))))
            lo.emit(counted(v, vectors, *(ir.Assign(ir.Elem(acc, (v,)), ir.Elem(other, (v,)), "+=")
                                          for other in sums[1:])))
        return emit

    def one_pass(st, inner):
        """One pass over the reductions: the block's sums in registers, then stored."""
        for each in sums:
            lo.emit(ir.Decl(each, "VV", None, shape=(vectors,)))
            lo.emit(counted(v, vectors, ir.Assign(ir.Elem(each, (v,)), ir.VectorZero())))
        inner()

        def store():
            lo.emit(ir.Decl(var_k, "index", kb, const=True))
            at_k = _located(lo, k, st)
            scaled = product_of([coef, ir.Elem(acc, (v,)), *(_vector_at(lo, at_k[n], lane, count=count())
                                                            for n in outside)])
            value = scaled if once else ir.add(ir.VectorLoad(OUT, ir.add(offset(at_k), lane), count()), scaled)
            lo.emit(counted(v, vectors, ir.VectorStore(OUT, ir.add(offset(at_k), lane), value, count())))

        lo.emit(lo.block(store))

    def blocks(st, inner):
        """Loop ``r`` and those inside it, wrapped in whole blocks of k, then in the
        last, partial block, masked."""
        def one_block(last: bool):
            partial[0], plain.block = last, (k, kb, n_k if last else ir.add(kb, size))
            one_pass(st, inner)
            partial[0], plain.block = False, (k, kb, ir.add(kb, size))

        _blocks_of_k(lo, kb, mask, size, (k_lo, n_k), one_block)

    wrap = {r: blocks}
    plain = NestWalk(nest, order[:-1], vector_leaf, dict(walk.bounds), block=(k, kb, ir.add(kb, size)),
                     block_from=r, wrap=wrap, blocked={r: interleaved} if len(sums) > 1 else {})
    if nest.register_tile is not None and nest.register_tile.grouped_by is not None:
        wrap[r - 1] = _grouped_tile(lo, nest, plain, coef, once, (k_lo, n_k), with_k, scalars)
    elif nest.register_tile is not None:
        wrap[r - 1] = _register_tile(lo, nest, plain, term, coef, once, (k_lo, n_k), with_k, scalars, outside,
                                     k_anchor, offset)
    if lo.a.epilogue is not None and nest.epilogue_at is not None:
        fuse_epilogue(lo, wrap, plain.bounds, order, nest.epilogue_at)
    emit_order(lo, plain, states)


def _blocks_of_k(lo: Lowering, kb: ir.Var, mask: ir.Var, size: int, k_range, one_block) -> None:
    """``one_block(False)`` for ``kb`` at each whole block of ``size`` in ``k_range``, then
    ``one_block(True)`` for the last, partial block at ``kb``, whose vector ``v`` holds
    the lanes ``mask[v]``."""
    k_lo, n_k = k_range
    v, lane = ir.Var("v"), ir.mul(ir.Var("v"), ir.Lanes())
    rest = lo.fresh("krest")
    lo.emit(ir.For(ir.Decl(kb, "index", k_lo), ir.le(ir.add(kb, size), n_k), ir.Assign(kb, ir.Const(size), "+="),
                   lo.block(lambda: one_block(False))))
    lo.emit(ir.Decl(rest, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(size))), const=True))

    def partial_block():
        vectors = ir.Bin("/", ir.Const(size), ir.Lanes())
        lo.emit(ir.Decl(kb, "index", rest, const=True), ir.Decl(mask, "lanes", None, shape=(vectors,)))
        lo.emit(counted(v, vectors, ir.Assign(ir.Elem(mask, (v,)), ir.Call("first_lanes", (ir.sub(n_k, ir.add(
            rest, lane)),)))))
        one_block(True)

    lo.emit(ir.If(ir.lt(rest, n_k), lo.block(partial_block)))


def _grouped_tile(lo, nest, plain: NestWalk, coef, once, k_range, with_k, scalars):
    """The wrapper of loop ``a`` that runs its whole grouped tiles (see the module doc),
    then ``plain`` (the register block) over the rows left."""
    order, tile, size = nest.order, nest.register_tile, nest.register_block.size
    a, k, w = tile.index, order[-1], tile.grouped_by
    r = order.index(a) + 1
    var_a, var_k, v = lo.var(a), lo.var(k), ir.Var("v")
    ab, kb, left, acc, mask = (lo.fresh(n) for n in ("ab", "kb", "aleft", "gacc", "kmask"))
    vectors = ir.Bin("/", ir.Const(size), ir.Lanes())
    lane = ir.mul(v, ir.Lanes())
    nest_without_prefetch = dataclasses.replace(nest, prefetch=())
    partial = [False]

    def count() -> ir.Expr | None:
        return ir.Elem(mask, (v,)) if partial[0] else None

    def row_shift(st, t: int) -> ir.Expr:
        """How far row ``t`` of the tile moves the grouping factor's position at its
        current level: ``t`` times the extents of its dense levels below ``a``."""
        held = [i for i, _ in st.levels]
        below = [lo.dim(i) for i in held[held.index(a) + 1:st.depth]]
        return ir.mul(ir.Const(t), product_of(below)) if below else ir.Const(t)

    def rows_of_group(st):
        """At the shared reductions' innermost point: each row's own loop over its group."""
        for t in range(tile.rows):
            def row(t=t):
                shifted = list(st)
                shifted[w] = dataclasses.replace(st[w], pos=ir.add(st[w].pos, row_shift(st[w], t)))

                def fma(at):
                    lo.emit(ir.Decl(var_k, "index", kb, const=True))
                    loads = [lo.vector_load(at[n], count=count()) for n in with_k]
                    lo.emit(counted(v, vectors, ir.Assign(ir.Elem(acc, (ir.Const(t), v)),
                                                          product_of([lo.product(at, scalars), *loads]), "+=")))

                walk = NestWalk(nest_without_prefetch, order[:-1], fma, dict(plain.bounds))
                emit_order(lo, walk, shifted, len(order) - 2)
            lo.emit(lo.block(row))

    def block_pass(st):
        """One block of ``k`` for the tile's rows: sums over the reductions, stored."""
        lo.emit(ir.Decl(acc, "VV", "zero", shape=(tile.rows, vectors)))
        emit_order(lo, NestWalk(nest_without_prefetch, order[:-2], rows_of_group, dict(plain.bounds)), st, r)
        lo.emit(ir.Decl(var_k, "index", kb, const=True))
        for t in range(tile.rows):
            at = ir.add(lo.offset(lo.s.output_order, {a: ir.add(ab, ir.Const(t))}), lane)
            scaled = ir.mul(coef, ir.Elem(acc, (ir.Const(t), v)))
            value = scaled if once else ir.add(ir.VectorLoad(OUT, at, count()), scaled)
            lo.emit(counted(v, vectors, ir.VectorStore(OUT, at, value, count())))

    def wrapper(st, inner):
        a_lo, a_hi = plain.bounds.get(a, (ir.Const(0), lo.dim(a)))
        lo.emit(ir.Decl(left, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(tile.rows))),
                        const=True))

        def run_tile():
            lo.emit(ir.Decl(var_a, "index", ab, const=True))
            located = list(st)
            locate(lo, a, st, located)

            def one_block(last: bool):
                partial[0] = last
                block_pass(located)
                partial[0] = False

            _blocks_of_k(lo, kb, mask, size, k_range, one_block)

        lo.emit(ir.For(ir.Decl(ab, "index", a_lo), ir.lt(ab, left), ir.Assign(ab, ir.Const(tile.rows), "+="),
                       lo.block(run_tile)))
        _rows_left(plain, a, (left, a_hi), inner)

    return wrapper


ROW = ir.Var("t")
PACK_PREFETCH_ROWS = 8  # a strip's rows are a row length apart: too far for the hardware's stride prefetcher


def _register_tile(lo, nest, plain: NestWalk, term, coef, once, k_range, with_k, scalars, outside, k_anchor, offset):
    """The wrapper of loop ``a`` that runs its whole tiles (see the module doc), then
    ``plain`` (the register block) over the rows left; ``outside``: the vector factors
    scaling the stored sums, ``k_anchor`` and ``offset`` as for :func:`_register_blocked`."""
    order = nest.order
    tile, size = nest.register_tile, nest.register_block.size
    a, k = tile.index, order[-1]
    r = order.index(a) + 1
    var_a, var_k, v = lo.var(a), lo.var(k), ir.Var("v")
    k_lo, n_k = k_range
    ab, k_rest, acc, x, row_scalar = (lo.fresh(n) for n in ("ab", "krest", "tacc", "x", "s"))
    vectors = ir.Bin("/", ir.Const(size), ir.Lanes())

    gathered = tile.gathered_by
    rows_at = lo.fresh("rows")  # gathered rows: the coordinates at positions q .. q + rows - 1
    first = lo.fresh("q")  # ... and q

    def row(t: ir.Expr) -> ir.Expr:
        """Row ``t`` of the tile: ``a + t``, or the ``t``-th gathered coordinate."""
        return ir.add(var_a, t) if gathered is None else ir.Elem(rows_at, (t,))

    def at_row(st) -> ir.Expr:
        """The factor's value at row ``t``."""
        if gathered is None or not st.valued:
            return _shifted_value(lo, st, {a: ROW})
        if st.sparse:  # the gathering factor: its value at position q + t
            return ir.Load(ir.Array("val", st.slot), ir.add(first, ROW))
        return ir.Load(ir.Array("dense", st.slot), lo.dense_offset(st, {a: row(ROW)}))

    d = order[r] if tile.packed else None
    # The k range the whole tiles cover: [k_lo, n_k), or one packed panel at a time; the
    # d range of a pack: all of d, or one layer at a time (None: all of d).
    span = [k_lo, n_k]
    layer: list = [None]
    # A reduction d stepped through by a sparse factor's fiber (a weight gradient's stored
    # rows c): the cursor over it, at its first position q; pack row p - q holds the
    # strip at coordinate crd[p].
    fiber: list = [None]

    def packed_at(n: int, block_start: ir.Expr, step: ir.Expr, lane: ir.Expr) -> ir.Expr:
        """Offset in factor ``n``'s panel: ``[(block_start - panel start) / size][step - layer start][lane]``."""
        block = ir.Bin("/", ir.sub(block_start, span[0]), ir.Const(size))
        if fiber[0] is not None:
            depth, step_in = lo.dim(d), ir.sub(step, fiber[0].q)
        elif layer[0] is None:
            depth, step_in = lo.dim(d), step
        else:
            depth, step_in = ir.sub(layer[0][1], layer[0][0]), ir.sub(step, layer[0][0])
        return ir.add(ir.mul(ir.add(ir.mul(block, depth), step_in), ir.Const(size)), lane)

    def pack(st) -> None:
        """Each packed factor's strip ``[layer, span)`` into its panel: a factor laid out
        with ``k`` last a row of the strip at a time, prefetching the row
        :data:`PACK_PREFETCH_ROWS` ahead; one laid out with ``d`` last (``W[e, k, d]``)
        by blocks transposed in registers; any other element by element."""
        block_start, step, column = lo.fresh("pb"), lo.fresh("pd"), lo.fresh("pj")
        lane = ir.mul(v, ir.Lanes())
        by_rows = [n for n in tile.packed if st[n].dense_indices[-1] == k]
        by_columns = [n for n in tile.packed if n not in by_rows]
        if fiber[0] is None:
            d_lo, d_hi = layer[0] or (ir.Const(0), lo.dim(d))

            def coordinate(q: ir.Expr) -> ir.Expr:
                return q
        else:
            assert not by_columns, "a stepped reduction packs factors laid out with k last"
            d_lo, d_hi = fiber[0].q, fiber[0].h

            def coordinate(q: ir.Expr) -> ir.Expr:
                return ir.Cast("index", ir.Load(fiber[0].crd, q))

        def blocks_of_span(*body: ir.Stmt) -> ir.For:
            return ir.For(ir.Decl(block_start, "index", span[0]), ir.lt(block_start, span[1]),
                          ir.Assign(block_start, ir.Const(size), "+="), ir.Block(body))

        if by_rows:
            ahead = ir.min_(ir.add(step, PACK_PREFETCH_ROWS), ir.sub(d_hi, 1))
            width = ir.mul(ir.sub(span[1], span[0]), ir.Call("value_size", ()))
            prefetches = [ir.Prefetch(ir.Array("dense", st[n].slot),
                                      lo.dense_offset(st[n], {d: coordinate(ahead), k: span[0]}), width)
                          for n in by_rows]
            copies = [ir.VectorStore(ir.Array("pack", n), packed_at(n, block_start, step, lane),
                                     lo.vector_load(st[n], {d: coordinate(step), k: block_start}, lane))
                      for n in by_rows]
            lo.emit(ir.For(ir.Decl(step, "index", d_lo), ir.lt(step, d_hi), ir.Incr(step), ir.Block((
                *prefetches, blocks_of_span(*(counted(v, vectors, c) for c in copies))))))
        for n in by_columns:  # a column of blocks (lanes of k) at a time down the layer's steps of d
            column_start, block_step, rest = lo.fresh("pj"), lo.fresh("ps"), lo.fresh("psrest")
            if st[n].dense_indices[-1] == d:
                held = st[n].dense_indices
                k_stride = product_of([lo.dim(i) for i in held[held.index(k) + 1:]])
                at = {d: block_step, k: ir.add(block_start, column_start)}
                transpose = ir.Effect("transpose_block", (
                    ir.Address(ir.Array("dense", st[n].slot), lo.dense_offset(st[n], at)), k_stride,
                    ir.Address(ir.Array("pack", n), packed_at(n, block_start, block_step, column_start)),
                    ir.Const(size)))
                steps = ir.For(ir.Decl(block_step, "index", d_lo), ir.le(ir.add(block_step, ir.Lanes()), d_hi),
                               ir.Assign(block_step, ir.Lanes(), "+="), ir.Block((transpose,)))
                lo.emit(blocks_of_span(ir.For(ir.Decl(column_start, "index", ir.Const(0)),
                                              ir.lt(column_start, ir.Const(size)),
                                              ir.Assign(column_start, ir.Lanes(), "+="), ir.Block((steps,)))))
                lo.emit(ir.Decl(rest, "index", ir.sub(d_hi, ir.Bin("%", ir.sub(d_hi, d_lo), ir.Lanes())),
                                const=True))
            else:
                lo.emit(ir.Decl(rest, "index", d_lo, const=True))
            at = {d: step, k: ir.add(block_start, column)}
            copy = ir.Assign(ir.Load(ir.Array("pack", n), packed_at(n, block_start, step, column)),
                             ir.Load(ir.Array("dense", st[n].slot), lo.dense_offset(st[n], at)))
            lo.emit(blocks_of_span(counted(column, size, ir.For(
                ir.Decl(step, "index", rest), ir.lt(step, d_hi), ir.Incr(step), ir.Block((copy,))), pragma=None)))

    def in_panels(st, has_rows: ir.Expr, restart: ir.Stmt | None, tiles) -> None:
        """``tiles`` once per packed panel of whole blocks of k (``restart`` rewinds
        the rows first), after packing it if ``has_rows``; with layers, all of that
        once per layer of d, the tiles' loop d bounded by the layer."""
        for n in tile.packed:
            values = ir.mul(ir.Const(tile.depth) if tile.depth else lo.dim(d), ir.Const(tile.panel))
            lo.emit(ir.Effect("declare_pack", (ir.Array("pack", n), ir.Const(n), values)))
        whole_end, panel, panel_end = lo.fresh("kwhole"), lo.fresh("pk"), lo.fresh("pkend")
        lo.emit(ir.Decl(whole_end, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(size))), const=True))

        def body():
            lo.emit(ir.Decl(panel_end, "index", ir.min_(ir.add(panel, tile.panel), whole_end), const=True))
            span[:] = [panel, panel_end]
            if restart is not None:
                lo.emit(restart)
            lo.emit(ir.If(has_rows, lo.block(lambda: pack(st))))
            tiles()
            span[:] = [k_lo, n_k]

        def panels():
            lo.emit(ir.For(ir.Decl(panel, "index", k_lo), ir.lt(panel, whole_end),
                           ir.Assign(panel, ir.Const(tile.panel), "+="), lo.block(body)))

        if not tile.depth:
            panels()
            return
        assert d not in plain.bounds, "a layered reduction is not tiled"
        start, end = lo.fresh("layer"), lo.fresh("layerend")

        def one_layer():
            lo.emit(ir.Decl(end, "index", ir.min_(ir.add(start, tile.depth), lo.dim(d)), const=True))
            layer[0] = plain.bounds[d] = (start, end)
            panels()
            layer[0] = None
            del plain.bounds[d]

        lo.emit(ir.For(ir.Decl(start, "index", ir.Const(0)), ir.lt(start, lo.dim(d)),
                       ir.Assign(start, ir.Const(tile.depth), "+="), lo.block(one_layer)))

    def vector_factor(st, n: int) -> ir.Expr:
        if n in tile.packed:
            step = lo.var(d) if tile.stepped_by is None else st[tile.stepped_by].pos
            return ir.VectorLoad(ir.Array("pack", n), packed_at(n, ab_k, step, ir.mul(v, ir.Lanes())))
        return lo.vector_load(st[n])

    summed = set(order[r:-1])

    def scales(st) -> list[int]:
        """The scalar factors constant across the sums (a gate's value at each row): they
        scale each row's sums where they are stored, not every step."""
        return [n for n in scalars if not summed & set(_held(st[n]))]

    def tile_walk(rows: int) -> NestWalk:
        """The loops below ``a`` for a tile of ``rows`` rows."""
        def leaf(st):
            lo.emit(ir.Decl(var_k, "index", ab_k, const=True))
            summed_scalars = [n for n in scalars if n not in scales(st)]
            by_row = [n for n in summed_scalars if a in _held(st[n])]
            fixed = [n for n in summed_scalars if n not in by_row]
            lo.emit(ir.Decl(row_scalar, "V", None, shape=(rows,)))
            scalar = product_of([*lo.values(st, fixed), *(at_row(st[n]) for n in by_row)])
            lo.emit(counted(ROW, rows, ir.Assign(ir.Elem(row_scalar, (ROW,)), scalar)))
            loads = product_of([vector_factor(st, n) for n in with_k])
            lo.emit(counted(v, vectors, ir.Decl(x, "VV", loads, const=True), counted(ROW, rows, ir.Assign(
                ir.Elem(acc, (ROW, v)), ir.mul(ir.Elem(row_scalar, (ROW,)), x), "+="))))

        def blocks(st, inner):
            def body():
                lo.emit(ir.Decl(acc, "VV", "zero", shape=(rows, vectors)))
                inner()
                lo.emit(ir.Decl(var_k, "index", ab_k, const=True))
                at_k = _located(lo, k, st)
                if k_anchor is None:
                    at = lo.offset(lo.s.output_order, {a: row(ROW)})
                else:
                    at = _shifted_pos(lo, at_k[k_anchor], {a: ROW})
                lane = ir.mul(v, ir.Lanes())
                row_scales = [at_row(st[n]) if a in _held(st[n]) else lo.values(st, [n])[0] for n in scales(st)]
                scaled = product_of([coef, *row_scales, ir.Elem(acc, (ROW, v)),
                                     *(_vector_at(lo, at_k[n], lane, {a: ROW}) for n in outside)])
                value = scaled if once else ir.add(ir.VectorLoad(OUT, ir.add(at, lane)), scaled)
                lo.emit(counted(ROW, rows, counted(v, vectors, ir.VectorStore(OUT, ir.add(at, lane), value))))

            lo.emit(ir.For(ir.Decl(ab_k, "index", span[0]), ir.le(ir.add(ab_k, size), span[1]),
                           ir.Assign(ab_k, ir.Const(size), "+="), lo.block(body)))

        return NestWalk(nest, order[:-1], leaf, plain.bounds, block=(k, ab_k, ir.add(ab_k, size)), block_from=r,
                        wrap={r: blocks})

    ab_k = lo.fresh("kb")

    def zero_tail(st):
        lo.emit(ir.For(ir.Decl(var_k, "index", k_rest), ir.lt(var_k, n_k), ir.Incr(var_k), lo.block(
            lambda: lo.emit(ir.Assign(ir.Load(OUT, offset(_located(lo, k, st))), ir.Const(0))))))

    # Packed: the rows past the last whole tile run one at a time from the same panels
    # (read in place, a factor's strip would come from memory again for each of them).
    sizes = (tile.rows, 1) if tile.packed else (tile.rows,)

    def wrapper(st, inner):
        a_lo, a_hi = plain.bounds.get(a, (ir.Const(0), lo.dim(a)))
        if tile.stepped_by is not None:
            fiber[0] = open_cursor(lo, tile.stepped_by, st[tile.stepped_by])
        left = lo.fresh("aleft")  # the first row the whole tiles leave (to ``plain``, or one-row tiles)
        if gathered is None:
            lo.emit(ir.Decl(left, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(tile.rows))),
                            const=True))

            def run_tile(rows: int):
                lo.emit(ir.Decl(var_a, "index", ab, const=True))
                located = list(st)
                locate(lo, a, st, located)
                emit_order(lo, tile_walk(rows), located, r)

            def tiles():
                bounds = {tile.rows: (a_lo, left), 1: (left, a_hi)}
                for rows in sizes:
                    start, end = bounds[rows]
                    lo.emit(ir.For(ir.Decl(ab, "index", start), ir.lt(ab, end), ir.Assign(ab, ir.Const(rows), "+="),
                                   lo.block(lambda rows=rows: run_tile(rows))))

            if tile.packed:
                in_panels(st, ir.lt(a_lo, a_hi), None, tiles)
            else:
                tiles()
        else:  # tiles of stored positions of the gathering factor's fiber
            cursor = open_cursor(lo, gathered, st[gathered], plain.bounds.get(a))

            def run_tile(rows: int):
                lo.emit(ir.Decl(first, "index", cursor.q, const=True))
                coordinates = tuple(ir.Load(cursor.crd, ir.add(cursor.q, t)) for t in range(rows))
                lo.emit(ir.Decl(rows_at, "index", coordinates, const=True, shape=(rows,)))
                emit_order(lo, tile_walk(rows), st, r)

            def tiles():
                for rows in sizes:
                    lo.emit(ir.For(None, ir.le(ir.add(cursor.q, rows), cursor.h), ir.Assign(cursor.q, ir.Const(rows), "+="),
                                   lo.block(lambda rows=rows: run_tile(rows))))

            if tile.packed:
                fiber_start = lo.fresh("qstart")
                lo.emit(ir.Decl(fiber_start, "I", cursor.q, const=True))
                in_panels(st, ir.lt(fiber_start, cursor.h), ir.Assign(cursor.q, fiber_start), tiles)
            else:
                tiles()
                next_row = ir.Cast("index", ir.Load(cursor.crd, cursor.q))
                lo.emit(ir.Decl(left, "index", ir.Select(ir.lt(cursor.q, cursor.h), next_row, a_hi), const=True))
        # The tiles' rows over the last, partial block of k; then ``plain`` over the rows
        # left (none when packed).
        lo.emit(ir.Decl(k_rest, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(size))), const=True))
        rows_done = a_hi if tile.packed else left
        tail = NestWalk(nest, order, lambda inner_st: lo.emit(ir.Assign(
            ir.Load(OUT, offset(inner_st)), product_of([coef, *lo.values(inner_st)]), "+=")),
            {**plain.bounds, a: (a_lo, rows_done), k: (k_rest, n_k)}, around={r: (zero_tail, None)} if once else {})
        lo.emit(ir.If(ir.lt(k_rest, n_k), lo.block(lambda: emit_order(lo, tail, st, r - 1))))
        fiber[0] = None  # the wrapper may be emitted again (in another branch)
        if tile.packed:
            return
        _rows_left(plain, a, (left, a_hi), inner)

    return wrapper


def _rows_left(plain: NestWalk, a: str, rows: tuple, inner) -> None:
    """``inner()`` (``plain``, the register block) over ``rows`` of loop ``a``, the rows a
    tile's wrapper left; ``plain``'s bounds of ``a`` are restored after, since the wrapper
    may be emitted again (in another branch)."""
    given = plain.bounds.get(a)
    plain.bounds[a] = rows
    inner()
    if given is None:
        del plain.bounds[a]
    else:
        plain.bounds[a] = given


def _held(st) -> tuple[str, ...]:
    return tuple(i for i, _ in st.levels) if st.sparse else st.dense_indices


def _located(lo: Lowering, index: str, states) -> list:
    """``states`` with the levels over ``index`` located at its current coordinate."""
    located = list(states)
    locate(lo, index, states, located)
    return located


def _vector_at(lo: Lowering, st, lane: ir.Expr, shifts: dict[str, ir.Expr] | None = None,
               count: ir.Expr | None = None) -> ir.Expr:
    """SIMD vector of a factor ``lane`` elements past its position (moved on by
    ``shifts``, see :func:`_shifted_pos`): a dense operand laid out with the vector's
    index last, or a sparse one whose last level is over it, dense; with ``count``, its
    first ``count`` lanes."""
    if not st.valued:
        return ONES
    if not st.sparse:
        at = {i: ir.add(lo.var(i), shift) for i, shift in (shifts or {}).items() if i in st.dense_indices}
        return lo.vector_load(st, at, lane, count)
    return ir.VectorLoad(ir.Array("val", st.slot), ir.add(_shifted_pos(lo, st, shifts or {}), lane), count)


def _shifted_pos(lo: Lowering, st, shifts: dict[str, ir.Expr]) -> ir.Expr:
    """A sparse factor's position with index ``i`` moved on by ``shifts[i]``: its levels
    from the first shifted one down are dense, so it moves by ``shift`` times the
    extent of the levels below ``i``."""
    held = [i for i, _ in st.levels]
    pos = st.pos
    for index, shift in shifts.items():
        if index in held:
            below = [lo.dim(i) for i in held[held.index(index) + 1:]]
            pos = ir.add(pos, ir.mul(shift, product_of(below)) if below else shift)
    return pos


def _shifted_value(lo: Lowering, st, shifts: dict[str, ir.Expr]) -> ir.Expr:
    """A factor's value with its indices moved on by ``shifts`` (see :func:`_shifted_pos`)."""
    if not st.valued:
        return ir.Const(1.0)
    if not st.sparse:
        at = {i: ir.add(lo.var(i), shift) for i, shift in shifts.items() if i in st.dense_indices}
        return ir.Load(ir.Array("dense", st.slot), lo.dense_offset(st, at))
    return ir.Load(ir.Array("val", st.slot), _shifted_pos(lo, st, shifts))


ROW_T, COL_T = ir.Var("t"), ir.Var("u")


def _dot_tile(lo: Lowering, nest: Nest, walk: NestWalk, inside, outside, coef, store: str, anchor_k: int | None):
    """The wrapper of loop ``a`` that runs whole ``rows x cols`` tiles of sums over the
    innermost ``d`` (the nest's dot tile), then the plain nest over the rows and columns
    left::

        for ab in whole tiles of a: a = ab; locate a
            for bb in whole tiles of b: b = bb; locate b
                acc[t][u] = 0
                for d in whole vectors: x[t] = a-factors at (ab + t, d); y[u] = b-factors at (bb + u, d)
                                        acc[t][u] += x[t] * y[u] * common factors at d
                s[t][u] = lanes of acc[t][u] summed (one transpose-and-add)
                for d in the rest: s[t][u] += the product at (ab + t, bb + u, d)
                out[ab + t, bb + u] (+)= coef * outside factors at (ab + t, bb + u) * s[t][u]
        the plain nest over rows [a_lo, a_rest) x columns [b_rest, b_hi), then rows [a_rest, a_hi)
    """
    tile, order = nest.dot_tile, nest.order
    a, b, d = tile.rows, tile.cols, order[-1]
    rows, cols = tile.row_count, tile.col_count
    position = order.index(a)
    vectors = nest.vector_reduction.vectors
    ab, bb, a_rest, b_rest, acc, sums, xa, xb, end = (
        lo.fresh(n) for n in ("ab", "bb", "arest", "brest", "dacc", "dsum", "xa", "xb", "dend"))
    var_d, var_a, var_b = lo.var(d), lo.var(a), lo.var(b)
    sum_at = ir.add(ir.mul(ROW_T, cols), COL_T)

    def tile_body(st) -> None:
        by_row = [k for k in vectors if a in _held(st[k])]
        by_col = [k for k in vectors if b in _held(st[k])]
        common = [k for k in vectors if k not in by_row and k not in by_col]
        d_lo, d_hi = walk.bounds.get(d, (ir.Const(0), lo.dim(d)))
        lane0 = ir.Const(0)

        def loads(ks, shift) -> ir.Expr:
            return product_of([lo.vector_load(st[k], {i: ir.add(lo.var(i), s) for i, s in shift.items()}, lane0)
                               for k in ks])

        lo.emit(ir.Decl(acc, "VV", "zero", shape=(rows * cols, 1)))
        lo.emit(ir.Decl(end, "index", d_hi, const=True), ir.Decl(var_d, "index", d_lo))
        step = [ir.Decl(xa, "VV", None, shape=(rows,)), ir.Decl(xb, "VV", None, shape=(cols,)),
                counted(ROW_T, rows, ir.Assign(ir.Elem(xa, (ROW_T,)), loads(by_row, {a: ROW_T}))),
                counted(COL_T, cols, ir.Assign(ir.Elem(xb, (COL_T,)), loads(by_col, {b: COL_T})))]
        term = ir.mul(ir.Elem(xa, (ROW_T,)), ir.Elem(xb, (COL_T,)))
        if common:
            term = ir.mul(term, loads(common, {}))
        step.append(counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Elem(acc, (sum_at, ir.Const(0))), term,
                                                                        "+="))))
        lo.emit(ir.For(None, ir.le(ir.add(var_d, ir.Lanes()), end), ir.Assign(var_d, ir.Lanes(), "+="),
                       ir.Block(tuple(step))))
        lo.emit(ir.Decl(sums, "V", None, shape=(rows * cols,)))
        lo.emit(ir.Effect("hsums", (acc, sums)))
        shift = {a: ROW_T, b: COL_T}
        tail = product_of([_shifted_value(lo, st[k], shift) for k in inside])
        lo.emit(ir.For(None, ir.lt(var_d, end), ir.Incr(var_d), ir.Block((
            counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Elem(sums, (sum_at,)), tail, "+="))),))))
        if anchor_k is None:
            target = lo.offset(lo.s.output_order, {a: ir.add(var_a, ROW_T), b: ir.add(var_b, COL_T)})
        else:
            target = _shifted_pos(lo, st[anchor_k], shift)
        value = product_of([coef, *(_shifted_value(lo, st[k], shift) for k in outside), ir.Elem(sums, (sum_at,))])
        lo.emit(counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Load(OUT, target), value, store))))

    def wrapper(st, inner) -> None:
        a_lo, a_hi = walk.bounds.get(a, (ir.Const(0), lo.dim(a)))
        b_lo, b_hi = walk.bounds.get(b, (ir.Const(0), lo.dim(b)))
        lo.emit(ir.Decl(a_rest, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(rows))), const=True))
        lo.emit(ir.Decl(b_rest, "index", ir.sub(b_hi, ir.Bin("%", ir.sub(b_hi, b_lo), ir.Const(cols))), const=True))

        def row_tile():
            lo.emit(ir.Decl(var_a, "index", ab, const=True))
            at_a = list(st)
            locate(lo, a, st, at_a)

            def col_tile():
                lo.emit(ir.Decl(var_b, "index", bb, const=True))
                at_b = list(at_a)
                locate(lo, b, at_a, at_b)
                tile_body(at_b)

            lo.emit(ir.For(ir.Decl(bb, "index", b_lo), ir.lt(bb, b_rest), ir.Assign(bb, ir.Const(cols), "+="),
                           lo.block(col_tile)))

        lo.emit(ir.For(ir.Decl(ab, "index", a_lo), ir.lt(ab, a_rest), ir.Assign(ab, ir.Const(rows), "+="),
                       lo.block(row_tile)))
        for bounds in ({a: (a_lo, a_rest), b: (b_rest, b_hi)}, {a: (a_rest, a_hi)}):
            rest = dataclasses.replace(walk, bounds={**walk.bounds, **bounds})
            lo.emit(lo.block(lambda rest=rest: emit_order(lo, rest, st, position, True)))

    return wrapper
