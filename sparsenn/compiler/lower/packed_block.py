"""Packed register blocks (``plan/block_pack.py``): a register block's vector factor,
laid out ``[k][d]``, packed per thread around the nest ``a, d, k``::

    for panels [pk, pe) of k (register blocks, the last one partial):
        if a has rows: for each block [kb, kb + B) of the panel:
            pack[(kb - pk) / B][d][0:B] = X[kb : kb + B, d]
              (lanes x lanes blocks of k and d transposed in registers where whole, the
               rest element by element, zeros past k)
        for a in the chunk: for kb in [pk, pe) step B: the register block, its vector
            X[kb : kb + B, d] read as pack[(kb - pk) / B][d][0:B]

(``pack`` a per-thread buffer kept across calls, ``B`` the register block).
"""

from __future__ import annotations

from ..loops import ir
from ..plan.schedule import Nest
from .context import Lowering
from .transposed_strip import emit_transposed_strip

__all__ = ["BlockPacks"]


class BlockPacks:
    """The packs of a packed register block (see the module doc): ``wrapper`` encloses
    loop ``a`` in the panels, setting ``k_span`` (the register block's range of ``k``,
    a list the block's loops read) to each panel's; ``load`` reads the packed factor."""

    def __init__(self, lo: Lowering, nest: Nest, k_span: list) -> None:
        self.lo, self.k_span, self.size = lo, k_span, nest.register_block.size
        self.packed = nest.packed_block
        self.a, self.d, self.k = nest.order
        self.n = self.packed.factor
        self.pack_array = ir.Array("pack", self.n)
        self.panel_start: ir.Expr = ir.Const(0)
        self.panel_end: ir.Expr = ir.Const(0)

    def offset(self, block_start: ir.Expr, step: ir.Expr, lane: ir.Expr) -> ir.Expr:
        """``[(block_start - panel start) / B][step][lane]`` in the pack."""
        block = ir.Bin("/", ir.sub(block_start, self.panel_start), ir.Const(self.size))
        return ir.add(ir.mul(ir.add(ir.mul(block, self.lo.dim(self.d)), step), ir.Const(self.size)), lane)

    def row(self, block_start: ir.Expr, step: ir.Expr) -> tuple[ir.Array, ir.Expr]:
        """(array, offset) of the packed factor's row ``step`` of the block at ``block_start``."""
        return self.pack_array, self.offset(block_start, step, ir.Const(0))

    def load(self, block_start: ir.Expr, count: ir.Expr | None) -> ir.Expr:
        """The packed factor's vector ``v`` at the current ``d`` and block of ``k``."""
        lane = ir.mul(ir.Var("v"), ir.Lanes())
        return ir.VectorLoad(self.pack_array, self.offset(block_start, self.lo.var(self.d), lane), count)

    def wrapper(self, bounds: dict):
        """The wrapper of loop ``a`` (``wrapper(states, inner)``); ``bounds``: the walk's
        loop bounds (a chunk's rows of ``a``)."""
        lo, size = self.lo, self.size

        def wrap(st, inner) -> None:
            k_lo, n_k = self.k_span
            a_lo, a_hi = bounds.get(self.a, (ir.Const(0), lo.dim(self.a)))
            blocks = ir.Bin("/", ir.add(ir.sub(n_k, k_lo), ir.Const(size - 1)), ir.Const(size))
            width = ir.min_(ir.Const(self.packed.panel), ir.mul(blocks, ir.Const(size)))
            lo.emit(ir.Effect("declare_pack", (self.pack_array, ir.Const(self.n), ir.mul(lo.dim(self.d), width))))
            panel, panel_end = lo.fresh("pk"), lo.fresh("pkend")

            def one_panel():
                lo.emit(ir.Decl(panel_end, "index", ir.min_(ir.add(panel, self.packed.panel), n_k), const=True))
                self.panel_start, self.panel_end = panel, panel_end
                self.k_span[:] = [panel, panel_end]
                lo.emit(ir.If(ir.lt(a_lo, a_hi), lo.block(lambda: self._pack(st))))
                inner()
                self.k_span[:] = [k_lo, n_k]

            lo.emit(ir.For(ir.Decl(panel, "index", k_lo), ir.lt(panel, n_k),
                           ir.Assign(panel, ir.Const(self.packed.panel), "+="), lo.block(one_panel)))

        return wrap

    def _pack(self, st) -> None:
        """The open panel's strip: for each block, ``lanes x lanes`` blocks of ``k`` and
        ``d`` transposed in registers where whole, the rest element by element (zeros
        past the panel's end)."""
        lo, d, k = self.lo, self.d, self.k

        def source(block: ir.Expr, c: ir.Expr, j: ir.Expr) -> ir.Expr:
            return lo.dense_offset(st[self.n], {k: ir.add(block, c), d: j})

        # the factor holds just k and d, laid out [k][d]: d's extent apart between consecutive k
        emit_transposed_strip(lo, ir.Array("dense", st[self.n].slot), self.pack_array, source,
                              lambda block, c, j: self.offset(block, j, c), lo.dim(d), lo.dim(d), self.size,
                              (self.panel_start, self.panel_end))
