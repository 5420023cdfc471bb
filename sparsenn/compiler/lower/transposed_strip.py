"""Packs copied by ``lanes x lanes`` blocks transposed in registers (GotoBLAS's packed
``B``): the code both packed grouped tiles (:mod:`.grouped_tile`) and packed register
blocks (:mod:`.packed_block`) emit for a panel of a factor read across its layout."""

from __future__ import annotations

from collections.abc import Callable

from ..loops import ir

__all__ = ["emit_transposed_strip"]

Offset = Callable[[ir.Expr, ir.Expr, ir.Expr], ir.Expr]


def emit_transposed_strip(lo, dense: ir.Array, pack: ir.Array, source: Offset, at: Offset, stride: ir.Expr,
                          rows: ir.Expr, size: int, panel: tuple[ir.Expr, ir.Expr]) -> None:
    """For each block of ``size`` columns of ``panel = (start, end)``: the strip's
    ``rows`` rows, element ``source(block, c, j)`` of ``dense`` (``stride`` apart from
    one column to the next), written to ``pack`` at ``at(block, c, j)``; ``lanes x
    lanes`` blocks transposed in registers where whole, the rest element by element
    (zeros past the panel's end)."""
    start, end = panel
    block_start, column, row, whole_rows, whole_columns = (
        lo.fresh(x) for x in ("pb", "pj", "pr", "prows", "pcols"))
    transpose = ir.Effect("transpose_block", (ir.Address(dense, source(block_start, column, row)), stride,
                                              ir.Address(pack, at(block_start, column, row)), ir.Const(size)))
    lanes_of_rows = ir.For(ir.Decl(row, "index", ir.Const(0)), ir.lt(row, whole_rows),
                           ir.Assign(row, ir.Lanes(), "+="), ir.Block((transpose,)))
    blocks = ir.For(ir.Decl(column, "index", ir.Const(0)), ir.lt(column, whole_columns),
                    ir.Assign(column, ir.Lanes(), "+="), ir.Block((lanes_of_rows,)))

    def elements(columns: tuple[ir.Expr, ir.Expr], rows_range: tuple[ir.Expr, ir.Expr]) -> ir.Stmt:
        value = ir.Select(ir.lt(ir.add(block_start, column), end),
                          ir.Load(dense, source(block_start, column, row)), ir.Const(0.0))
        inner = ir.For(ir.Decl(row, "index", rows_range[0]), ir.lt(row, rows_range[1]), ir.Incr(row),
                       ir.Block((ir.Assign(ir.Load(pack, at(block_start, column, row)), value),)))
        return ir.For(ir.Decl(column, "index", columns[0]), ir.lt(column, columns[1]), ir.Incr(column),
                      ir.Block((inner,)))

    present = ir.sub(end, block_start)  # columns of the block, from 1 up
    whole = ir.min_(ir.Const(size), ir.sub(present, ir.Bin("%", present, ir.Lanes())))
    body = (ir.Decl(whole_columns, "index", whole, const=True),
            blocks,
            elements((ir.Const(0), ir.Const(size)), (whole_rows, rows)),
            elements((whole_columns, ir.Const(size)), (ir.Const(0), whole_rows)))
    lo.emit(ir.Decl(whole_rows, "index", ir.sub(rows, ir.Bin("%", rows, ir.Lanes())), const=True))
    lo.emit(ir.For(ir.Decl(block_start, "index", start), ir.lt(block_start, end),
                   ir.Assign(block_start, ir.Const(size), "+="), ir.Block(body)))
