"""Register tiles (``plan/microkernel.py``): the loop ``a`` just above the register
block's reductions ``R`` unrolled into a ``rows x vectors`` tile of accumulators.

A nest ``P' + (a,) + R + (k,)`` with a register tile runs::

    for P': for ab in whole tiles of a: a = ab; locate a
                for kb in whole blocks of k: acc[0:T][0:B] = 0
                    for R: x[v] = vector factors[kb + v]; s[t] = scalar factors at a + t
                           acc[t][v] += s[t] * x[v]
                    out[P', ab + t, kb : kb + B] (+)= coef * acc[t]
            for a in the whole tiles: for R: for k in the partial block: out[P, k] += ...
            for a in the last, partial tile: the register block (:mod:`.microkernel`)

the scalars at ``a + t`` read at their position at ``a`` plus ``t`` times the extent
below ``a`` (their levels from ``a`` down are dense, so positions are affine in ``a``).
Rows gathered by a sparse level take whole tiles of its stored positions ``q .. q + T``
instead (row ``t`` is ``crd[q + t]``; the gathering factor's value is at ``q + t``), and
the plain nest continues from the first coordinate left. Scalar factors constant
across ``R`` (a gate's value at each gathered row) scale the stored sums instead of
every step. With *packed* factors every row runs one panel of ``k`` at a time::

    for layers [dl, de) of d (one layer: all of d): for panels [pk, pe) of whole blocks of k:
        if a has rows: for d in [dl, de): prefetch factor[..., d + ahead, pk : pe]
            pack[(kb - pk) / B][d - dl][0:B] = factor[..., d, kb : kb + B]  for kb in the panel
        for ab in whole tiles of a: for kb in [pk, pe): ... the tile over d in [dl, de), reading pack
        for a in the rows left: for kb in [pk, pe): ... a tile of one row, reading pack
    for a in all rows: for R: for k in the partial block: out[P, k] += ...

(``pack`` a per-thread buffer kept across calls; ``R`` is the one dense loop ``d``, or
the stored coordinates of one factor's fiber over ``d``; every layer's tiles add into
the output; a factor laid out with ``d`` last is packed by blocks of lanes x lanes, each
transposed in registers; ``ahead`` is the target's ``pack_prefetch_rows``).
"""

from __future__ import annotations

from ..loops import ir
from ..plan.schedule import Nest
from .context import Lowering, counted, product_of
from .iterators import Cursor, locate, open_cursor
from .order import NestWalk, emit_order
from .tile_access import OUT, by_layers, held, located, rows_left, shifted_pos, shifted_value, vector_at

__all__ = ["RegisterTileLowering"]

ROW = ir.Var("t")


class RegisterTileLowering:
    """The wrapper of loop ``a`` (called as ``wrapper(states, inner)``) that runs its
    whole tiles, then ``plain`` (the register block) over the rows left; ``outside``:
    the vector factors scaling the stored sums, ``k_anchor`` and ``offset`` as for the
    register block (:func:`.microkernel.register_blocked`).

    While it is emitted: ``span`` is the range of ``k`` the whole tiles cover (all of
    it, or one packed panel), ``layer`` the range of ``d`` a pack holds (None: all of
    ``d``), ``fiber`` the cursor over a reduction stepped through a sparse factor's
    stored coordinates (None: a dense ``d``), at whose first position ``q`` pack row
    ``p - q`` holds the strip at coordinate ``crd[p]``."""

    def __init__(self, lo: Lowering, nest: Nest, plain: NestWalk, coef: ir.Expr, once: bool, k_range,
                 with_k: list[int], scalars: list[int], outside: list[int], k_anchor: int | None, offset) -> None:
        self.lo, self.nest, self.plain, self.coef, self.once = lo, nest, plain, coef, once
        self.with_k, self.scalars, self.outside, self.k_anchor, self.offset = with_k, scalars, outside, k_anchor, offset
        order = nest.order
        self.tile, self.size = nest.register_tile, nest.register_block.size
        self.a, self.k = self.tile.index, order[-1]
        self.r = order.index(self.a) + 1
        self.var_a, self.var_k, self.v = lo.var(self.a), lo.var(self.k), ir.Var("v")
        self.k_lo, self.n_k = k_range
        self.ab, self.k_rest, self.acc, self.x, self.row_scalar = (
            lo.fresh(n) for n in ("ab", "krest", "tacc", "x", "s"))
        self.vectors = ir.Bin("/", ir.Const(self.size), ir.Lanes())
        self.gathered = self.tile.gathered_by
        self.rows_at = lo.fresh("rows")  # gathered rows: the coordinates at positions q .. q + rows - 1
        self.first = lo.fresh("q")  # ... and q
        self.d = order[self.r] if self.tile.packed else None
        self.summed = set(order[self.r:-1])
        self.span: tuple[ir.Expr, ir.Expr] = (self.k_lo, self.n_k)
        self.layer: tuple[ir.Expr, ir.Expr] | None = None
        self.fiber: Cursor | None = None
        self.ab_k = lo.fresh("kb")
        # Packed: the rows past the last whole tile run one at a time from the same panels
        # (read in place, a factor's strip would come from memory again for each of them).
        self.sizes = (self.tile.rows, 1) if self.tile.packed else (self.tile.rows,)

    # ------------------------------------------------------------------ rows

    def row(self, t: ir.Expr) -> ir.Expr:
        """Row ``t`` of the tile: ``a + t``, or the ``t``-th gathered coordinate."""
        return ir.add(self.var_a, t) if self.gathered is None else ir.Elem(self.rows_at, (t,))

    def at_row(self, st) -> ir.Expr:
        """The factor's value at row ``t``."""
        lo = self.lo
        if self.gathered is None or not st.valued:
            return shifted_value(lo, st, {self.a: ROW})
        if st.sparse:  # the gathering factor: its value at position q + t
            return ir.Load(ir.Array("val", st.slot), ir.add(self.first, ROW))
        return ir.Load(ir.Array("dense", st.slot), lo.dense_offset(st, {self.a: self.row(ROW)}))

    def scales(self, st) -> list[int]:
        """The scalar factors constant across the sums (a gate's value at each row): they
        scale each row's sums where they are stored, not every step."""
        return [n for n in self.scalars if not self.summed & set(held(st[n]))]

    # ------------------------------------------------------------------ packs

    def packed_at(self, n: int, block_start: ir.Expr, step: ir.Expr, lane: ir.Expr) -> ir.Expr:
        """Offset in factor ``n``'s panel: ``[(block_start - panel start) / size][step - layer start][lane]``."""
        lo, d = self.lo, self.d
        block = ir.Bin("/", ir.sub(block_start, self.span[0]), ir.Const(self.size))
        if self.fiber is not None:
            depth, step_in = lo.dim(d), ir.sub(step, self.fiber.q)
        elif self.layer is None:
            depth, step_in = lo.dim(d), step
        else:
            depth, step_in = ir.sub(self.layer[1], self.layer[0]), ir.sub(step, self.layer[0])
        return ir.add(ir.mul(ir.add(ir.mul(block, depth), step_in), ir.Const(self.size)), lane)

    def pack(self, st) -> None:
        """Each packed factor's strip ``[layer, span)`` into its panel: a factor laid out
        with ``k`` last a row of the strip at a time, prefetching the row the target's
        ``pack_prefetch_rows`` ahead; one laid out with ``d`` last (``W[e, k, d]``) by
        blocks transposed in registers; any other element by element."""
        lo, tile, d, k, v, size, span = self.lo, self.tile, self.d, self.k, self.v, self.size, self.span
        block_start, step, column = lo.fresh("pb"), lo.fresh("pd"), lo.fresh("pj")
        lane = ir.mul(v, ir.Lanes())
        by_rows = [n for n in tile.packed if st[n].dense_indices[-1] == k]
        by_columns = [n for n in tile.packed if n not in by_rows]
        fiber = self.fiber
        if fiber is None:
            d_lo, d_hi = self.layer or (ir.Const(0), lo.dim(d))

            def coordinate(q: ir.Expr) -> ir.Expr:
                return q
        else:
            assert not by_columns, "a stepped reduction packs factors laid out with k last"
            d_lo, d_hi = fiber.q, fiber.h

            def coordinate(q: ir.Expr) -> ir.Expr:
                return ir.Cast("index", ir.Load(fiber.crd, q))

        def blocks_of_span(*body: ir.Stmt) -> ir.For:
            return ir.For(ir.Decl(block_start, "index", span[0]), ir.lt(block_start, span[1]),
                          ir.Assign(block_start, ir.Const(size), "+="), ir.Block(body))

        if by_rows:
            ahead = ir.min_(ir.add(step, lo.s.target.pack_prefetch_rows), ir.sub(d_hi, 1))
            width = ir.mul(ir.sub(span[1], span[0]), ir.Call("value_size", ()))
            prefetches = [ir.Prefetch(ir.Array("dense", st[n].slot),
                                      lo.dense_offset(st[n], {d: coordinate(ahead), k: span[0]}), width)
                          for n in by_rows]
            copies = [ir.VectorStore(ir.Array("pack", n), self.packed_at(n, block_start, step, lane),
                                     lo.vector_load(st[n], {d: coordinate(step), k: block_start}, lane))
                      for n in by_rows]
            lo.emit(ir.For(ir.Decl(step, "index", d_lo), ir.lt(step, d_hi), ir.Incr(step), ir.Block((
                *prefetches, blocks_of_span(*(counted(v, self.vectors, c) for c in copies))))))
        for n in by_columns:  # a column of blocks (lanes of k) at a time down the layer's steps of d
            column_start, block_step, rest = lo.fresh("pj"), lo.fresh("ps"), lo.fresh("psrest")
            if st[n].dense_indices[-1] == d:
                indices = st[n].dense_indices
                k_stride = product_of([lo.dim(i) for i in indices[indices.index(k) + 1:]])
                at = {d: block_step, k: ir.add(block_start, column_start)}
                transpose = ir.Effect("transpose_block", (
                    ir.Address(ir.Array("dense", st[n].slot), lo.dense_offset(st[n], at)), k_stride,
                    ir.Address(ir.Array("pack", n), self.packed_at(n, block_start, block_step, column_start)),
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
            copy = ir.Assign(ir.Load(ir.Array("pack", n), self.packed_at(n, block_start, step, column)),
                             ir.Load(ir.Array("dense", st[n].slot), lo.dense_offset(st[n], at)))
            lo.emit(blocks_of_span(counted(column, size, ir.For(
                ir.Decl(step, "index", rest), ir.lt(step, d_hi), ir.Incr(step), ir.Block((copy,))), pragma=None)))

    def in_panels(self, st, has_rows: ir.Expr, restart: ir.Stmt | None, tiles) -> None:
        """``tiles`` once per packed panel of whole blocks of k (``restart`` rewinds
        the rows first), after packing it if ``has_rows``; with layers, all of that
        once per layer of d, the tiles' loop d bounded by the layer."""
        lo, tile, d, plain = self.lo, self.tile, self.d, self.plain
        k_lo, n_k, size = self.k_lo, self.n_k, self.size
        for n in tile.packed:
            values = ir.mul(ir.Const(tile.depth) if tile.depth else lo.dim(d), ir.Const(tile.panel))
            lo.emit(ir.Effect("declare_pack", (ir.Array("pack", n), ir.Const(n), values)))
        whole_end, panel, panel_end = lo.fresh("kwhole"), lo.fresh("pk"), lo.fresh("pkend")
        lo.emit(ir.Decl(whole_end, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(size))), const=True))

        def body():
            lo.emit(ir.Decl(panel_end, "index", ir.min_(ir.add(panel, tile.panel), whole_end), const=True))
            self.span = (panel, panel_end)
            if restart is not None:
                lo.emit(restart)
            lo.emit(ir.If(has_rows, lo.block(lambda: self.pack(st))))
            tiles()
            self.span = (k_lo, n_k)

        def panels():
            lo.emit(ir.For(ir.Decl(panel, "index", k_lo), ir.lt(panel, whole_end),
                           ir.Assign(panel, ir.Const(tile.panel), "+="), lo.block(body)))

        by_layers(lo, plain, d, tile.depth, panels, self._at_layer)

    def _at_layer(self, layer: tuple[ir.Expr, ir.Expr] | None) -> None:
        self.layer = layer

    def vector_factor(self, st, n: int) -> ir.Expr:
        """Vector factor ``n`` at the current block of ``k``: from its pack if packed."""
        tile = self.tile
        if n in tile.packed:
            step = self.lo.var(self.d) if tile.stepped_by is None else st[tile.stepped_by].pos
            return ir.VectorLoad(ir.Array("pack", n), self.packed_at(n, self.ab_k, step, ir.mul(self.v, ir.Lanes())))
        return self.lo.vector_load(st[n])

    # ------------------------------------------------------------------ tiles

    def tile_walk(self, rows: int) -> NestWalk:
        """The loops below ``a`` for a tile of ``rows`` rows."""
        lo, a, k, v, size, ab_k = self.lo, self.a, self.k, self.v, self.size, self.ab_k
        acc, vectors = self.acc, self.vectors

        def leaf(st):
            lo.emit(ir.Decl(self.var_k, "index", ab_k, const=True))
            summed_scalars = [n for n in self.scalars if n not in self.scales(st)]
            by_row = [n for n in summed_scalars if a in held(st[n])]
            fixed = [n for n in summed_scalars if n not in by_row]
            lo.emit(ir.Decl(self.row_scalar, "V", None, shape=(rows,)))
            scalar = product_of([*lo.values(st, fixed), *(self.at_row(st[n]) for n in by_row)])
            lo.emit(counted(ROW, rows, ir.Assign(ir.Elem(self.row_scalar, (ROW,)), scalar)))
            loads = product_of([self.vector_factor(st, n) for n in self.with_k])
            lo.emit(counted(v, vectors, ir.Decl(self.x, "VV", loads, const=True), counted(ROW, rows, ir.Assign(
                ir.Elem(acc, (ROW, v)), ir.mul(ir.Elem(self.row_scalar, (ROW,)), self.x), "+="))))

        def blocks(st, inner):
            def body():
                lo.emit(ir.Decl(acc, "VV", "zero", shape=(rows, vectors)))
                inner()
                lo.emit(ir.Decl(self.var_k, "index", ab_k, const=True))
                at_k = located(lo, k, st)
                if self.k_anchor is None:
                    at = lo.offset(lo.s.output_order, {a: self.row(ROW)})
                else:
                    at = shifted_pos(lo, at_k[self.k_anchor], {a: ROW})
                lane = ir.mul(v, ir.Lanes())
                row_scales = [self.at_row(st[n]) if a in held(st[n]) else lo.values(st, [n])[0]
                              for n in self.scales(st)]
                scaled = product_of([self.coef, *row_scales, ir.Elem(acc, (ROW, v)),
                                     *(vector_at(lo, at_k[n], lane, {a: ROW}) for n in self.outside)])
                value = scaled if self.once else ir.add(ir.VectorLoad(OUT, ir.add(at, lane)), scaled)
                lo.emit(counted(ROW, rows, counted(v, vectors, ir.VectorStore(OUT, ir.add(at, lane), value))))

            lo.emit(ir.For(ir.Decl(ab_k, "index", self.span[0]), ir.le(ir.add(ab_k, size), self.span[1]),
                           ir.Assign(ab_k, ir.Const(size), "+="), lo.block(body)))

        return NestWalk(self.nest, self.nest.order[:-1], leaf, self.plain.bounds, block=(k, ab_k, ir.add(ab_k, size)),
                        block_from=self.r, wrap={self.r: blocks})

    def zero_tail(self, st) -> None:
        """Zero the output's last, partial block of ``k`` (a nest that stores once)."""
        lo, var_k = self.lo, self.var_k
        lo.emit(ir.For(ir.Decl(var_k, "index", self.k_rest), ir.lt(var_k, self.n_k), ir.Incr(var_k), lo.block(
            lambda: lo.emit(ir.Assign(ir.Load(OUT, self.offset(located(lo, self.k, st))), ir.Const(0))))))

    def __call__(self, st, inner) -> None:
        lo, tile, plain, a, ab, r = self.lo, self.tile, self.plain, self.a, self.ab, self.r
        order = self.nest.order
        a_lo, a_hi = plain.bounds.get(a, (ir.Const(0), lo.dim(a)))
        if tile.stepped_by is not None:
            self.fiber = open_cursor(lo, tile.stepped_by, st[tile.stepped_by])
        left = lo.fresh("aleft")  # the first row the whole tiles leave (to ``plain``, or one-row tiles)
        if self.gathered is None:
            lo.emit(ir.Decl(left, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(tile.rows))),
                            const=True))

            def run_tile(rows: int):
                lo.emit(ir.Decl(self.var_a, "index", ab, const=True))
                at_a = list(st)
                locate(lo, a, st, at_a)
                emit_order(lo, self.tile_walk(rows), at_a, r)

            def tiles():
                bounds = {tile.rows: (a_lo, left), 1: (left, a_hi)}
                for rows in self.sizes:
                    start, end = bounds[rows]
                    lo.emit(ir.For(ir.Decl(ab, "index", start), ir.lt(ab, end), ir.Assign(ab, ir.Const(rows), "+="),
                                   lo.block(lambda rows=rows: run_tile(rows))))

            if tile.packed:
                self.in_panels(st, ir.lt(a_lo, a_hi), None, tiles)
            else:
                tiles()
        else:  # tiles of stored positions of the gathering factor's fiber
            cursor = open_cursor(lo, self.gathered, st[self.gathered], plain.bounds.get(a))

            def run_tile(rows: int):
                lo.emit(ir.Decl(self.first, "index", cursor.q, const=True))
                coordinates = tuple(ir.Load(cursor.crd, ir.add(cursor.q, t)) for t in range(rows))
                lo.emit(ir.Decl(self.rows_at, "index", coordinates, const=True, shape=(rows,)))
                emit_order(lo, self.tile_walk(rows), st, r)

            def tiles():
                for rows in self.sizes:
                    step = ir.Assign(cursor.q, ir.Const(rows), "+=")
                    lo.emit(ir.For(None, ir.le(ir.add(cursor.q, rows), cursor.h), step,
                                   lo.block(lambda rows=rows: run_tile(rows))))

            if tile.packed:
                fiber_start = lo.fresh("qstart")
                lo.emit(ir.Decl(fiber_start, "I", cursor.q, const=True))
                self.in_panels(st, ir.lt(fiber_start, cursor.h), ir.Assign(cursor.q, fiber_start), tiles)
            else:
                tiles()
                next_row = ir.Cast("index", ir.Load(cursor.crd, cursor.q))
                lo.emit(ir.Decl(left, "index", ir.Select(ir.lt(cursor.q, cursor.h), next_row, a_hi), const=True))
        # The tiles' rows over the last, partial block of k; then ``plain`` over the rows
        # left (none when packed).
        k_lo, n_k, k_rest = self.k_lo, self.n_k, self.k_rest
        lo.emit(ir.Decl(k_rest, "index", ir.sub(n_k, ir.Bin("%", ir.sub(n_k, k_lo), ir.Const(self.size))), const=True))
        rows_done = a_hi if tile.packed else left
        tail = NestWalk(self.nest, order, lambda inner_st: lo.emit(ir.Assign(
            ir.Load(OUT, self.offset(inner_st)), product_of([self.coef, *lo.values(inner_st)]), "+=")),
            {**plain.bounds, a: (a_lo, rows_done), self.k: (k_rest, n_k)},
            around={r: (self.zero_tail, None)} if self.once else {})
        lo.emit(ir.If(ir.lt(k_rest, n_k), lo.block(lambda: emit_order(lo, tail, st, r - 1))))
        self.fiber = None  # the wrapper may be emitted again (in another branch)
        if tile.packed:
            return
        rows_left(plain, a, (left, a_hi), inner)
