"""How a tile's rows read the factors: a factor's position and value with its indices
moved on by a row's shift (its levels from the shifted index down are dense, so its
position is affine in the index), SIMD vectors of factors, the walk over the rows a
tile left; the blocks of the register block's loop ``k``."""

from __future__ import annotations

from collections.abc import Callable

from ..loops import ir
from .context import ONES, Lowering, counted, product_of
from .iterators import locate
from .order import NestWalk

__all__ = ["OUT", "rows_left", "by_layers", "blocks_of_k", "last_block_of_k", "held", "located", "vector_at",
           "shifted_pos", "shifted_value"]

OUT = ir.Array("out")


def rows_left(plain: NestWalk, a: str, rows: tuple, inner) -> None:
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


def by_layers(lo: Lowering, plain: NestWalk, d: str, depth: int, body: Callable[[], None],
              at_layer: Callable[[tuple[ir.Expr, ir.Expr] | None], None]) -> None:
    """``body()`` over all of the reduction ``d`` (``depth`` 0), else once per layer of
    ``depth`` steps of it (a packed tile's ``k_c``), with ``plain``'s bounds of ``d`` and
    ``at_layer`` given the layer's ``(start, end)`` while it runs (None after)."""
    if not depth:
        body()
        return
    assert d not in plain.bounds, "a layered reduction is not tiled"
    start, end = lo.fresh("layer"), lo.fresh("layerend")

    def one_layer():
        lo.emit(ir.Decl(end, "index", ir.min_(ir.add(start, depth), lo.dim(d)), const=True))
        plain.bounds[d] = (start, end)
        at_layer((start, end))
        body()
        at_layer(None)
        del plain.bounds[d]

    lo.emit(ir.For(ir.Decl(start, "index", ir.Const(0)), ir.lt(start, lo.dim(d)),
                   ir.Assign(start, ir.Const(depth), "+="), lo.block(one_layer)))


def blocks_of_k(lo: Lowering, kb: ir.Var, mask: ir.Var, size: int, k_range, one_block) -> None:
    """``one_block(False)`` for ``kb`` at each whole block of ``size`` in ``k_range``, then
    ``one_block(True)`` for the last, partial block (:func:`last_block_of_k`)."""
    k_lo, n_k = k_range
    lo.emit(ir.For(ir.Decl(kb, "index", k_lo), ir.le(ir.add(kb, size), n_k), ir.Assign(kb, ir.Const(size), "+="),
                   lo.block(lambda: one_block(False))))
    last_block_of_k(lo, kb, mask, size, k_range, one_block)


def last_block_of_k(lo: Lowering, kb: ir.Var, mask: ir.Var, size: int, k_range, one_block) -> None:
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


def held(st) -> tuple[str, ...]:
    """The indices a factor's state reads: its levels' (sparse) or its layout's (dense)."""
    return tuple(i for i, _ in st.levels) if st.sparse else st.dense_indices


def located(lo: Lowering, index: str, states) -> list:
    """``states`` with the levels over ``index`` located at its current coordinate."""
    at = list(states)
    locate(lo, index, states, at)
    return at


def vector_at(lo: Lowering, st, lane: ir.Expr, shifts: dict[str, ir.Expr] | None = None,
               count: ir.Expr | None = None) -> ir.Expr:
    """SIMD vector of a factor ``lane`` elements past its position (moved on by
    ``shifts``, see :func:`shifted_pos`): a dense operand laid out with the vector's
    index last, or a sparse one whose last level is over it, dense; with ``count``, its
    first ``count`` lanes."""
    if not st.valued:
        return ONES
    if not st.sparse:
        at = {i: ir.add(lo.var(i), shift) for i, shift in (shifts or {}).items() if i in st.dense_indices}
        return lo.vector_load(st, at, lane, count)
    return ir.VectorLoad(ir.Array("val", st.slot), ir.add(shifted_pos(lo, st, shifts or {}), lane), count)


def shifted_pos(lo: Lowering, st, shifts: dict[str, ir.Expr]) -> ir.Expr:
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


def shifted_value(lo: Lowering, st, shifts: dict[str, ir.Expr]) -> ir.Expr:
    """A factor's value with its indices moved on by ``shifts`` (see :func:`shifted_pos`)."""
    if not st.valued:
        return ir.Const(1.0)
    if not st.sparse:
        at = {i: ir.add(lo.var(i), shift) for i, shift in shifts.items() if i in st.dense_indices}
        return ir.Load(ir.Array("dense", st.slot), lo.dense_offset(st, at))
    return ir.Load(ir.Array("val", st.slot), shifted_pos(lo, st, shifts))
