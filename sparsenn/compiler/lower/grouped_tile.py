"""Grouped tiles (``plan/microkernel.py``): the rows of an n:m weight ``W`` unrolled into
a register tile, each row stepping through its own group of the innermost reduction
``e`` (``W``'s last level holds a fixed number of entries per group). A nest
``P' + (a, R, k)`` with a grouped tile runs::

    for P': for ab in whole tiles of a: a = ab; locate a
                for kb in whole blocks of k, then the partial block (masked):
                    acc[0:T][0:B] = 0
                    for R without e: for t in the tile: for e in row t's group:
                        acc[t][:] += W at row a + t * vector factors[kb : kb + B]
                    out[P', ab + t, kb : kb + B] (+)= coef * acc[t]
            for a in the rows left: the register block (:mod:`.microkernel`)

(``W``'s position at row ``a + t`` is its position at ``a`` plus ``t`` times the extents
of its dense levels between ``a`` and ``e``; each row's loop over its group is unrolled,
every group holding the same number of entries). A packed grouped tile reads the vector
factors only from their packs (:class:`_GroupedPacks`): every block of ``k``, the last,
partial one too (masked stores), and the rows left as tiles of one row. A tile with
``prefetch_next`` first prefetches the next tile's rows (the last row at most): their
output at the block of ``k`` and, at a panel's first block, their stored entries of ``W``
over the layer (the later blocks find them in the L2, a row block's filling a quarter).
"""

from __future__ import annotations

import dataclasses

from ..loops import ir
from ..plan.schedule import Nest
from .context import Lowering, counted, product_of
from .iterators import FactorState, LevelExprs, fiber_length, locate
from .order import NestWalk, emit_order
from .tile_access import OUT, blocks_of_k, by_layers, rows_left
from .transposed_strip import emit_transposed_strip

__all__ = ["grouped_tile"]


def grouped_tile(lo: Lowering, nest: Nest, plain: NestWalk, coef, once, k_range, with_k, scalars):
    """The wrapper of loop ``a`` that runs its grouped tiles (see the module doc), then,
    unpacked, ``plain`` (the register block) over the rows left."""
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

    def rows_of_group(st, rows: int):
        """At the shared reductions' innermost point: each row's own loop over its
        group, unrolled (every group holds the same number of entries)."""
        for t in range(rows):
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

    def block_pass(st, rows: int):
        """One block of ``k`` for the tile's ``rows``: sums over the reductions, stored."""
        lo.emit(ir.Decl(acc, "VV", "zero", shape=(rows, vectors)))
        walk = NestWalk(nest_without_prefetch, order[:-2], lambda s: rows_of_group(s, rows), dict(plain.bounds))
        emit_order(lo, walk, st, r)
        lo.emit(ir.Decl(var_k, "index", kb, const=True))
        for t in range(rows):
            at = ir.add(lo.offset(lo.s.output_order, {a: ir.add(ab, ir.Const(t))}), lane)
            scaled = ir.mul(coef, ir.Elem(acc, (ir.Const(t), v)))
            value = scaled if once else ir.add(ir.VectorLoad(OUT, at, count()), scaled)
            lo.emit(counted(v, vectors, ir.VectorStore(OUT, at, value, count())))

    def entries_of_row(state: FactorState, row: ir.Expr) -> tuple[ir.Expr, ir.Expr]:
        """(first stored position, number of positions) of the grouping factor's row
        ``row`` over the open layer of ``d``: ``state`` is the factor above its level
        over ``a``, whose levels from there down to ``e`` are dense."""
        d, e = order[r], order[-2]
        start, end = packs.layer
        positions: ir.Expr = ir.Const(fiber_length(state.levels[-1][1]))
        while state.next_index() != e:
            index = state.next_index()
            at = {a: row, d: start}.get(index, ir.Const(0))
            if index != a:
                positions = ir.mul(positions, ir.sub(end, start) if index == d else lo.dim(index))
            state = state.entered(state.level.locate(LevelExprs(state.slot, state.depth), state.pos, at,
                                                     lo.dim(index)))
        first, _ = state.level.position_bounds(LevelExprs(state.slot, state.depth), state.pos)
        return first, positions

    def prefetch_next_tile(st, rows: int) -> None:
        """Prefetch the rows of the tile after the one at ``ab`` (see the module doc)."""
        value, index = ir.Call("value_size", ()), ir.Call("index_size", ())
        last_row = ir.sub(lo.dim(a), ir.Const(1))
        grouping = st[w]
        crd = ir.Array("crd", grouping.slot, len(grouping.levels) - 1)
        next_rows = [ir.min_(ir.add(ab, ir.Const(rows + t)), last_row) for t in range(rows)]
        for row in next_rows:
            lo.emit(ir.Prefetch(OUT, lo.offset(lo.s.output_order, {a: row, k: kb}), ir.mul(ir.Const(size), value)))

        def entries():
            for row in next_rows:
                first, positions = entries_of_row(grouping, row)
                lo.emit(ir.Prefetch(ir.Array("val", grouping.slot), first, ir.mul(positions, value)))
                lo.emit(ir.Prefetch(crd, first, ir.mul(positions, index)))

        lo.emit(ir.If(ir.eq(kb, packs.panel_start), lo.block(entries)))

    def tiles_over(st, rows_range, rows: int, blocks):
        """Tiles of ``rows`` rows over ``rows_range``; ``blocks(one_block)`` emits each
        tile's blocks of ``k``, ``one_block(last)`` one block (the last, partial one masked)."""
        def run_tile():
            if tile.prefetch_next and packs is not None:
                prefetch_next_tile(st, rows)
            lo.emit(ir.Decl(var_a, "index", ab, const=True))
            at_a = list(st)
            locate(lo, a, st, at_a)

            def one_block(last: bool):
                partial[0] = last
                block_pass(at_a, rows)
                partial[0] = False

            blocks(one_block)

        lo.emit(ir.For(ir.Decl(ab, "index", rows_range[0]), ir.lt(ab, rows_range[1]),
                       ir.Assign(ab, ir.Const(rows), "+="), lo.block(run_tile)))

    def wrapper(st, inner):
        a_lo, a_hi = plain.bounds.get(a, (ir.Const(0), lo.dim(a)))
        lo.emit(ir.Decl(left, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(tile.rows))),
                        const=True))
        if packs is None:
            tiles_over(st, (a_lo, left), tile.rows,
                       lambda one_block: blocks_of_k(lo, kb, mask, size, k_range, one_block))
            rows_left(plain, a, (left, a_hi), inner)
            return

        def panel_tiles(rows_range, rows: int):
            packs.each_block_of_panel(kb, mask, lambda last: tiles_over(
                st, rows_range, rows, lambda one_block: one_block(last)))

        packs.each_panel(st, (a_lo, left, a_hi), k_range, panel_tiles)

    return wrapper


class _GroupedPacks:
    """The packs of a grouped tile's vector factors (``nest.register_tile.packed``), in the
    loops around its tiles::

        for layers [dl, de) of d (one layer: all of d): for panels [pk, pe) of blocks of k:
            if a has rows: pack[(kb - pk) / B][d - dl][e][0:B] = factor[d, e, kb : kb + B]
            for row blocks [ob, oe) of the whole tiles' rows: for kb in [pk, pe) step B:
                for ab in [ob, oe) step the tile's rows: the tile over d in [dl, de), reading pack
            for kb in [pk, pe) step B: for a in the rows left: a tile of one row, reading pack

    so that one block's strip of the pack stays in the L1 for a row block's tiles, and
    their stored entries of ``W`` over a layer in the L2 (``pack`` a per-thread buffer
    kept across calls). The last panel's last block may be partial: its lanes past ``k``
    are packed as zeros. A factor laid out ``[d][e][k]`` is packed a row ``(d, e)`` at a
    time; one laid out ``[k][d][e]`` (``tile.transposed``: read in place) by blocks of
    ``lanes x lanes`` of ``k`` and the layer's rows ``(d, e)``, transposed in registers,
    the rest element by element."""

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

    def pack(self, st) -> None:
        """Each packed factor's strip of the layer and panel into its pack."""
        for n in self.tile.packed:
            if n in self.tile.transposed:
                self._pack_transposed(st, n)
            else:
                self._pack_rows(st, n)

    def _pack_rows(self, st, n: int) -> None:
        """Factor ``n``, laid out ``[d][e][k]``: a row ``(d, e)`` of the strip at a time,
        the last, partial block's lanes past ``k`` loaded as zeros."""
        lo, d, e, k, size = self.lo, self.d, self.e, self.k, self.size
        step, entry, block_start, rest = (lo.fresh(x) for x in ("pd", "pe", "pb", "prest"))
        v = ir.Var("v")
        lane = ir.mul(v, ir.Lanes())
        end = self.panel_end
        vectors = ir.Bin("/", ir.Const(size), ir.Lanes())

        def copy(lanes: ir.Expr | None) -> ir.Stmt:
            value = lo.vector_load(st[n], {d: step, e: entry, k: block_start}, lane,
                                   None if lanes is None else ir.Call("first_lanes", (lanes,)))
            return counted(v, vectors, ir.VectorStore(ir.Array("pack", n), self.offset(block_start, step, entry, lane),
                                                      value))

        lo.emit(ir.Decl(rest, "index", ir.sub(end, ir.Bin("%", ir.sub(end, self.panel_start), ir.Const(size))),
                        const=True))
        whole = ir.For(ir.Decl(block_start, "index", self.panel_start), ir.lt(block_start, rest),
                       ir.Assign(block_start, ir.Const(size), "+="), ir.Block((copy(None),)))
        last = ir.If(ir.lt(rest, end), ir.Block((ir.Decl(block_start, "index", rest, const=True),
                                                 copy(ir.sub(end, ir.add(rest, lane))))))
        entries = ir.For(ir.Decl(entry, "index", ir.Const(0)), ir.lt(entry, lo.dim(e)), ir.Incr(entry),
                         ir.Block((whole, last)))
        lo.emit(ir.For(ir.Decl(step, "index", self.layer[0]), ir.lt(step, self.layer[1]), ir.Incr(step),
                       ir.Block((entries,))))

    def _pack_transposed(self, st, n: int) -> None:
        """Factor ``n``, laid out ``[k][d][e]``: for each block of the panel, the layer's
        rows ``j = (d - dl) E + e`` (contiguous in the factor) by ``lanes x lanes``
        blocks transposed in registers where whole, the rest element by element (zeros
        past ``k``)."""
        lo, d, e, k = self.lo, self.d, self.e, self.k
        start, end = self.layer

        def source(block: ir.Expr, c: ir.Expr, j: ir.Expr) -> ir.Expr:
            return lo.dense_offset(st[n], {k: ir.add(block, c), d: start, e: j})

        emit_transposed_strip(lo, ir.Array("dense", st[n].slot), ir.Array("pack", n), source,
                              lambda block, c, j: self.offset(block, start, j, c),
                              ir.mul(lo.dim(d), lo.dim(e)),  # between consecutive k
                              ir.mul(ir.sub(end, start), lo.dim(e)), self.size, (self.panel_start, self.panel_end))

    def each_panel(self, st, rows: tuple[ir.Expr, ir.Expr, ir.Expr], k_range, panel_tiles) -> None:
        """``panel_tiles(rows, tile rows)`` for each row block of the whole tiles' rows
        ``[rows[0], rows[1])``, then with tiles of one row for the rows left up to
        ``rows[2]``, in each panel of each layer, the panel packed first; the tiles' loop
        ``d`` bounded by the layer."""
        lo, tile, d, plain = self.lo, self.tile, self.d, self.plain
        k_lo, n_k = k_range
        for n in tile.packed:
            values = ir.mul(ir.mul(ir.Const(tile.depth) if tile.depth else lo.dim(d), lo.dim(self.e)),
                            ir.Const(tile.panel))
            lo.emit(ir.Effect("declare_pack", (ir.Array("pack", n), ir.Const(n), values)))
        panel, panel_end = lo.fresh("pk"), lo.fresh("pkend")
        block, block_end = lo.fresh("ob"), lo.fresh("obend")

        def row_block():
            lo.emit(ir.Decl(block_end, "index", ir.min_(ir.add(block, tile.row_block), rows[1]), const=True))
            panel_tiles((block, block_end), tile.rows)

        def one_panel():
            lo.emit(ir.Decl(panel_end, "index", ir.min_(ir.add(panel, tile.panel), n_k), const=True))
            self.panel_start, self.panel_end = panel, panel_end
            lo.emit(ir.If(ir.lt(rows[0], rows[2]), lo.block(lambda: self.pack(st))))
            self.open = True
            lo.emit(ir.For(ir.Decl(block, "index", rows[0]), ir.lt(block, rows[1]),
                           ir.Assign(block, ir.Const(tile.row_block), "+="), lo.block(row_block)))
            panel_tiles((rows[1], rows[2]), 1)
            self.open = False

        def panels():
            lo.emit(ir.For(ir.Decl(panel, "index", k_lo), ir.lt(panel, n_k),
                           ir.Assign(panel, ir.Const(tile.panel), "+="), lo.block(one_panel)))

        by_layers(lo, plain, d, tile.depth, panels, self._at_layer)

    def _at_layer(self, layer: tuple[ir.Expr, ir.Expr] | None) -> None:
        self.layer = layer or (ir.Const(0), self.lo.dim(self.d))

    def each_block_of_panel(self, kb: ir.Var, mask: ir.Var, body) -> None:
        """``body(False)`` for ``kb`` at each whole block of the open panel, then
        ``body(True)`` at its last, partial block if it has one (lanes ``mask[v]``)."""
        blocks_of_k(self.lo, kb, mask, self.size, (self.panel_start, self.panel_end), body)
