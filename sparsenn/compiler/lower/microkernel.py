"""Micro-kernels of dense-output nests (``plan/microkernel.py``): register blocks with
their interleaved sums, grouped tiles and dot tiles; register tiles are lowered by
:mod:`.register_tile`.

A register-blocked nest ``P + R + (k,)`` runs::

    for P: for kb in whole blocks of k: acc[0:B] = 0
               for R: acc[:] += scalar factors * vector factors[kb : kb + B]
               out[P, kb : kb + B] (+)= coef * outside vectors[kb : kb + B] * acc
           the last, partial block the same way, its vectors' lanes past k masked

with ``acc`` ``B / lanes`` SIMD vectors kept in registers; the *outside* vectors hold
``k`` but no index of ``R`` (a sampled output's anchor, whose positions the stores
take). With ``S`` interleaved sums (``R`` one sparse loop), the stored positions
``q .. q + S - 1`` of each whole group add into ``S`` sets of accumulators, summed
into ``acc`` after the groups (a block of one vector would wait on every add).

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
of its dense levels between ``a`` and ``e``; each row's loop over its group is unrolled,
every group holding the same number of entries). A packed grouped tile runs its whole
blocks of ``k`` over layers, panels and row blocks (:class:`_GroupedPacks`), reading the
vector factors from their packs, then the last, partial block of ``k`` as above.
"""

from __future__ import annotations

import dataclasses

from ..loops import ir
from ..plan.decisions import reductions_from
from ..plan.schedule import Nest
from .context import Lowering, counted, product_of
from .epilogue import fuse_epilogue, vector_epilogue
from .iterators import LevelExprs, fiber_length, locate
from .order import NestWalk, emit_order
from .reductions import enter
from .register_tile import RegisterTileLowering
from .tile_access import OUT, by_layers, held, located, rows_left, shifted_pos, shifted_value, vector_at

__all__ = ["register_blocked", "dot_tile"]


def register_blocked(lo, nest, walk, states, term, offset, coef, once, k_anchor) -> None:
    """The register-blocked nest (see the module doc); ``k_anchor``: the factor whose
    positions a sampled output's values take (None for a dense output)."""
    order, output = nest.order, lo.a.output
    size = nest.register_block.size
    k = order[-1]
    r = reductions_from(order, output, len(order) - 1)
    summed = set(order[r:-1])
    outside = [n for n, st in enumerate(states) if k in held(st) and not summed & set(held(st))]
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
    # The epilogue on the accumulators before the store: its slice is the block's span
    # of k (fused right after the block's reductions), its functions have vector forms.
    in_registers = (lo.a.epilogue is not None and nest.epilogue_at == r and nest.register_tile is None
                    and k_anchor is None and vector_epilogue(lo, k, lane, None) is not None)
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
            at_k = located(lo, k, st)
            scaled = product_of([coef, ir.Elem(acc, (v,)), *(vector_at(lo, at_k[n], lane, count=count())
                                                            for n in outside)])
            value = scaled if once else ir.add(ir.VectorLoad(OUT, ir.add(offset(at_k), lane), count()), scaled)
            if in_registers:
                value = vector_epilogue(lo, k, lane, count())(value)
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
        wrap[r - 1] = RegisterTileLowering(lo, nest, plain, coef, once, (k_lo, n_k), with_k, scalars, outside,
                                           k_anchor, offset)
    if not in_registers and lo.a.epilogue is not None and nest.epilogue_at is not None:
        fuse_epilogue(lo, wrap, plain.bounds, order, nest.epilogue_at)
    emit_order(lo, plain, states)


def _blocks_of_k(lo: Lowering, kb: ir.Var, mask: ir.Var, size: int, k_range, one_block) -> None:
    """``one_block(False)`` for ``kb`` at each whole block of ``size`` in ``k_range``, then
    ``one_block(True)`` for the last, partial block (:func:`_last_block_of_k`)."""
    k_lo, n_k = k_range
    lo.emit(ir.For(ir.Decl(kb, "index", k_lo), ir.le(ir.add(kb, size), n_k), ir.Assign(kb, ir.Const(size), "+="),
                   lo.block(lambda: one_block(False))))
    _last_block_of_k(lo, kb, mask, size, k_range, one_block)


def _last_block_of_k(lo: Lowering, kb: ir.Var, mask: ir.Var, size: int, k_range, one_block) -> None:
    """``one_block(True)`` for ``kb`` at the last, partial block of ``size`` in
    ``k_range`` if there is one, its vector ``v`` holding the lanes ``mask[v]``."""
    k_lo, n_k = k_range
    v, lane = ir.Var("v"), ir.mul(ir.Var("v"), ir.Lanes())
    rest = lo.fresh("krest")
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
    packs = _GroupedPacks(lo, nest, plain) if tile.packed else None

    def count() -> ir.Expr | None:
        return ir.Elem(mask, (v,)) if partial[0] else None

    def row_shift(st, t: int) -> ir.Expr:
        """How far row ``t`` of the tile moves the grouping factor's position at its
        current level: ``t`` times the extents of its dense levels below ``a``."""
        held = [i for i, _ in st.levels]
        below = [lo.dim(i) for i in held[held.index(a) + 1:st.depth]]
        return ir.mul(ir.Const(t), product_of(below)) if below else ir.Const(t)

    def vector(at, n: int) -> ir.Expr:
        """Vector factor ``n`` at the current block of ``k``: from its pack while one is open."""
        if packs is not None and packs.open:
            return packs.load(n, kb)
        return lo.vector_load(at[n], count=count())

    def rows_of_group(st):
        """At the shared reductions' innermost point: each row's own loop over its
        group, unrolled (every group holds the same number of entries)."""
        for t in range(tile.rows):
            def row(t=t):
                grouping = dataclasses.replace(st[w], pos=ir.add(st[w].pos, row_shift(st[w], t)))
                first, _ = grouping.level.position_bounds(LevelExprs(grouping.slot, grouping.depth), grouping.pos)
                entry, q = lo.fresh("g"), lo.fresh("q")

                def fma():
                    lo.emit(ir.Decl(q, "index", ir.add(first, entry), const=True))
                    lo.emit(ir.Decl(lo.var(order[-2]), "index", ir.Cast("index", ir.Load(grouping.crd(), q)),
                                    const=True))
                    at = list(st)
                    at[w] = grouping.entered(q)
                    lo.emit(ir.Decl(var_k, "index", kb, const=True))
                    loads = [vector(at, n) for n in with_k]
                    lo.emit(counted(v, vectors, ir.Assign(ir.Elem(acc, (ir.Const(t), v)),
                                                          product_of([lo.product(at, scalars), *loads]), "+=")))

                lo.emit(counted(entry, fiber_length(grouping.level), lo.block(fma)))
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

    def run_tile(st, blocks):
        """The tile at row ``ab``: ``blocks(one_block)`` emits its blocks of ``k``."""
        lo.emit(ir.Decl(var_a, "index", ab, const=True))
        located = list(st)
        locate(lo, a, st, located)

        def one_block(last: bool):
            partial[0] = last
            block_pass(located)
            partial[0] = False

        blocks(one_block)

    def tiles_over(st, rows_range, blocks):
        lo.emit(ir.For(ir.Decl(ab, "index", rows_range[0]), ir.lt(ab, rows_range[1]),
                       ir.Assign(ab, ir.Const(tile.rows), "+="), lo.block(lambda: run_tile(st, blocks))))

    def wrapper(st, inner):
        a_lo, a_hi = plain.bounds.get(a, (ir.Const(0), lo.dim(a)))
        lo.emit(ir.Decl(left, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(tile.rows))),
                        const=True))
        if packs is None:
            tiles_over(st, (a_lo, left), lambda one_block: _blocks_of_k(lo, kb, mask, size, k_range, one_block))
        else:
            def panel_tiles(block_range):
                def blocks(one_block):
                    one_block(False)

                def each_block():
                    tiles_over(st, block_range, blocks)
                packs.each_block_of_panel(kb, each_block)

            packs.each_panel(st, (a_lo, left), k_range, panel_tiles)
            tiles_over(st, (a_lo, left), lambda one_block: _last_block_of_k(lo, kb, mask, size, k_range, one_block))
        rows_left(plain, a, (left, a_hi), inner)

    return wrapper


class _GroupedPacks:
    """The packs of a grouped tile's vector factors (``nest.register_tile.packed``,
    each laid out ``[d][e][k]``), in the loops around its whole tiles::

        for layers [dl, de) of d (one layer: all of d): for panels [pk, pe) of whole blocks of k:
            if a has whole tiles: pack[(kb - pk) / B][d - dl][e][0:B] = factor[d, e, kb : kb + B]
            for row blocks [ob, oe) of the whole tiles' rows: for kb in [pk, pe) step B:
                for ab in [ob, oe) step the tile's rows: the tile over d in [dl, de), reading pack

    so that one block's strip of the pack stays in the L1 for a row block's tiles, and
    their stored entries of ``W`` over a layer in the L2 (``pack`` a per-thread buffer
    kept across calls)."""

    def __init__(self, lo: Lowering, nest: Nest, plain: NestWalk) -> None:
        self.lo, self.tile, self.plain, self.size = lo, nest.register_tile, plain, nest.register_block.size
        r = nest.order.index(self.tile.index) + 1
        self.d, self.e, self.k = nest.order[r:]
        self.open = False
        self.panel_start: ir.Expr = ir.Const(0)
        self.panel_end: ir.Expr = ir.Const(0)
        self.layer: tuple[ir.Expr, ir.Expr] = (ir.Const(0), lo.dim(self.d))

    def offset(self, block_start: ir.Expr, step: ir.Expr, entry: ir.Expr, lane: ir.Expr) -> ir.Expr:
        """``[(block_start - panel start) / B][step - layer start][entry][lane]`` in a pack."""
        lo, (start, end) = self.lo, self.layer
        block = ir.Bin("/", ir.sub(block_start, self.panel_start), ir.Const(self.size))
        row = ir.add(ir.mul(ir.add(ir.mul(block, ir.sub(end, start)), ir.sub(step, start)), lo.dim(self.e)), entry)
        return ir.add(ir.mul(row, ir.Const(self.size)), lane)

    def load(self, n: int, block_start: ir.Expr) -> ir.Expr:
        """Factor ``n``'s vector at the current ``d``, ``e`` and block of ``k``."""
        lo = self.lo
        at = self.offset(block_start, lo.var(self.d), lo.var(self.e), ir.mul(ir.Var("v"), ir.Lanes()))
        return ir.VectorLoad(ir.Array("pack", n), at)

    def pack(self, st, panel_end: ir.Expr) -> None:
        """Each packed factor's strip of the layer and panel into its pack, a row
        ``(d, e)`` at a time."""
        lo, d, e, k, size = self.lo, self.d, self.e, self.k, self.size
        step, entry, block_start, v = lo.fresh("pd"), lo.fresh("pe"), lo.fresh("pb"), ir.Var("v")
        lane = ir.mul(v, ir.Lanes())
        copies = [ir.VectorStore(ir.Array("pack", n), self.offset(block_start, step, entry, lane),
                                 lo.vector_load(st[n], {d: step, e: entry, k: block_start}, lane))
                  for n in self.tile.packed]
        blocks = ir.For(ir.Decl(block_start, "index", self.panel_start), ir.lt(block_start, panel_end),
                        ir.Assign(block_start, ir.Const(size), "+="),
                        ir.Block(tuple(counted(v, ir.Bin("/", ir.Const(size), ir.Lanes()), c) for c in copies)))
        entries = ir.For(ir.Decl(entry, "index", ir.Const(0)), ir.lt(entry, lo.dim(e)), ir.Incr(entry),
                         ir.Block((blocks,)))
        lo.emit(ir.For(ir.Decl(step, "index", self.layer[0]), ir.lt(step, self.layer[1]), ir.Incr(step),
                       ir.Block((entries,))))

    def each_panel(self, st, rows: tuple[ir.Expr, ir.Expr], k_range, panel_tiles) -> None:
        """``panel_tiles(row block)`` for each row block of ``rows`` in each panel of
        each layer, the panel packed first; the tiles' loop ``d`` bounded by the layer."""
        lo, tile, d, plain = self.lo, self.tile, self.d, self.plain
        k_lo, n_k = k_range
        for n in tile.packed:
            values = ir.mul(ir.mul(ir.Const(tile.depth) if tile.depth else lo.dim(d), lo.dim(self.e)),
                            ir.Const(tile.panel))
            lo.emit(ir.Effect("declare_pack", (ir.Array("pack", n), ir.Const(n), values)))
        whole_end, panel, panel_end = lo.fresh("kwhole"), lo.fresh("pk"), lo.fresh("pkend")
        block, block_end = lo.fresh("ob"), lo.fresh("obend")
        lo.emit(ir.Decl(whole_end, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(self.size))),
                        const=True))

        def row_block():
            lo.emit(ir.Decl(block_end, "index", ir.min_(ir.add(block, tile.row_block), rows[1]), const=True))
            panel_tiles((block, block_end))

        def one_panel():
            lo.emit(ir.Decl(panel_end, "index", ir.min_(ir.add(panel, tile.panel), whole_end), const=True))
            self.panel_start, self.panel_end = panel, panel_end
            lo.emit(ir.If(ir.lt(rows[0], rows[1]), lo.block(lambda: self.pack(st, panel_end))))
            self.open = True
            lo.emit(ir.For(ir.Decl(block, "index", rows[0]), ir.lt(block, rows[1]),
                           ir.Assign(block, ir.Const(tile.row_block), "+="), lo.block(row_block)))
            self.open = False

        def panels():
            lo.emit(ir.For(ir.Decl(panel, "index", k_lo), ir.lt(panel, whole_end),
                           ir.Assign(panel, ir.Const(tile.panel), "+="), lo.block(one_panel)))

        by_layers(lo, plain, d, tile.depth, panels, self._at_layer)

    def _at_layer(self, layer: tuple[ir.Expr, ir.Expr] | None) -> None:
        self.layer = layer or (ir.Const(0), self.lo.dim(self.d))

    def each_block_of_panel(self, kb: ir.Var, body) -> None:
        """``body()`` for ``kb`` at each whole block of the open panel."""
        lo = self.lo
        lo.emit(ir.For(ir.Decl(kb, "index", self.panel_start), ir.lt(kb, self.panel_end),
                       ir.Assign(kb, ir.Const(self.size), "+="), lo.block(body)))



ROW_T, COL_T = ir.Var("t"), ir.Var("u")


def dot_tile(lo: Lowering, nest: Nest, walk: NestWalk, inside, outside, coef, store: str, anchor_k: int | None):
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
        by_row = [k for k in vectors if a in held(st[k])]
        by_col = [k for k in vectors if b in held(st[k])]
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
        tail = product_of([shifted_value(lo, st[k], shift) for k in inside])
        lo.emit(ir.For(None, ir.lt(var_d, end), ir.Incr(var_d), ir.Block((
            counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Elem(sums, (sum_at,)), tail, "+="))),))))
        if anchor_k is None:
            target = lo.offset(lo.s.output_order, {a: ir.add(var_a, ROW_T), b: ir.add(var_b, COL_T)})
        else:
            target = shifted_pos(lo, st[anchor_k], shift)
        value = product_of([coef, *(shifted_value(lo, st[k], shift) for k in outside), ir.Elem(sums, (sum_at,))])
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
