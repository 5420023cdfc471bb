"""Inner reductions the schedule chose (see :mod:`..plan.decisions`):

* :func:`vector_reduction`: ``acc += coef * scalars * sum_k prod(vectors[k])`` with
  ``A`` SIMD accumulators over blocks of ``A`` vectors, then single vectors, a tree sum
  of the lanes and a scalar tail;
* :func:`extremum_reduction`: ``acc = max(acc, coef * X)`` (or min) the same way,
  lanes combined by NaN-keeping ``sn_vmax`` / ``sn_vmin``;
* :func:`sparse_reduction`: ``acc += coef * sum_q prod(factors at crd[q])`` over a
  fiber, gathered: whole vectors of positions first (values loaded, dense factors
  gathered at ``crd[q : q + lanes]``); then position ``q`` into sum ``q mod A`` of
  ``A`` interleaved sums, a scalar tail;
* :func:`row_blocker`: blocks of ``R`` positions of a fiber whose vector reductions
  share the loads of the factors not indexed by it, then one transpose-and-add
  (``hsums``) of the ``R`` sums.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..frontend.functions import IDENTITY
from ..loops import ir
from ..plan.decisions import RowBlock
from .context import ONES, Lowering, counted, product_of
from .iterators import Cursor, FactorState, locate, open_cursor

__all__ = ["Summed", "vector_reduction", "extremum_reduction", "sparse_reduction", "row_blocker", "enter"]

Summed = tuple[ir.Expr, Sequence[int]]  # the leaf's sum: coefficient, factors
V = ir.Var("v")
U = ir.Var("u")
R = ir.Var("r")


def _scale(coef: ir.Expr, lo: Lowering, states, scalars: Sequence[int], total: ir.Expr) -> ir.Expr:
    return product_of([coef, *lo.values(states, scalars), total])


def vector_reduction(
    lo: Lowering, index: str, states, accumulator: ir.Var, summed: Summed, vectors: Sequence[int],
    accumulators: int, bounds=None,
) -> None:
    var = lo.var(index)
    coef, factors = summed
    scalars = [k for k in factors if k not in vectors]
    first, last = bounds or (ir.Const(0), lo.dim(index))
    acc, end, total = lo.fresh("vsum"), lo.fresh("end"), lo.fresh("tot")
    block = ir.mul(accumulators, ir.Lanes())

    def located() -> list:
        """The factors at ``index``'s current coordinate (sparse ones: its dense level located)."""
        new = list(states)
        locate(lo, index, states, new)
        return new

    def load(st: FactorState, lane: ir.Expr) -> ir.Expr:
        if st.sparse and st.valued:  # a dense innermost level of a sparse factor: its values at pos + lane
            return ir.VectorLoad(ir.Array("val", st.slot), ir.add(st.pos, lane))
        return lo.vector_load(st, lane=lane)  # ONES for a factor read for its pattern only

    def loads(lane: ir.Expr) -> ir.Expr:
        at = located()
        return product_of([load(at[k], lane) for k in vectors])

    def fill():
        lo.emit(ir.Decl(end, "index", last, const=True),
                ir.Decl(acc, "VV", "zero", shape=(accumulators,)),
                ir.Decl(var, "index", first))
        lo.emit(ir.For(None, ir.le(ir.add(var, block), end), ir.Assign(var, block, "+="), lo.block(lambda: lo.emit(
            counted(V, accumulators, ir.Assign(ir.Elem(acc, (V,)), loads(ir.mul(V, ir.Lanes())), "+="))))))
        lo.emit(ir.For(None, ir.le(ir.add(var, ir.Lanes()), end), ir.Assign(var, ir.Lanes(), "+="), lo.block(
            lambda: lo.emit(ir.Assign(ir.Elem(acc, (ir.Const(0),)), loads(ir.Const(0)), "+=")))))
        lo.emit(counted(V, accumulators, ir.Assign(ir.Elem(acc, (ir.Const(0),)), ir.Elem(acc, (V,)), "+="),
                        pragma=None, start=1))
        lo.emit(ir.Decl(total, "V", ir.Call("hsum", (ir.Elem(acc, (ir.Const(0),)),))))
        lo.emit(ir.For(None, ir.lt(var, end), ir.Incr(var), lo.block(lambda: lo.emit(
            ir.Assign(total, lo.product(located(), vectors), "+=")))))
        lo.emit(ir.Assign(accumulator, _scale(coef, lo, states, scalars, total), "+="))

    lo.emit(lo.block(fill))


def extremum_reduction(
    lo: Lowering, index: str, states, accumulator: ir.Var, combine: str, coef: ir.Expr, accumulators: int,
    bounds=None,
) -> None:
    """``acc = max(acc, coef * X[.., index])`` (or ``min``) of the one factor, read with
    unit stride: ``A`` SIMD accumulators over blocks of ``A`` vectors, then single
    vectors, a tree over the lanes and a scalar tail, every step keeping a NaN."""
    var = lo.var(index)
    first, last = bounds or (ir.Const(0), lo.dim(index))
    acc, end = lo.fresh("vext"), lo.fresh("end")
    block = ir.mul(accumulators, ir.Lanes())

    def located() -> FactorState:
        new = list(states)
        locate(lo, index, states, new)
        return new[0]

    def vector(lane: ir.Expr) -> ir.Expr:
        st = located()
        if not st.sparse:
            return ir.mul(coef, lo.vector_load(st, lane=lane))
        return ir.mul(coef, ir.VectorLoad(ir.Array("val", st.slot), ir.add(st.pos, lane)))

    def fold(target: ir.Expr, value: ir.Expr) -> ir.Stmt:
        return ir.Assign(target, ir.Call(f"v{combine}", (target, value)))

    def fill():
        lo.emit(ir.Decl(end, "index", last, const=True),
                ir.Decl(acc, "VV", None, shape=(accumulators,)),
                counted(V, accumulators, ir.Assign(ir.Elem(acc, (V,)), ir.Call("splat", (
                    ir.Const(IDENTITY[combine]),)))),
                ir.Decl(var, "index", first))
        lo.emit(ir.For(None, ir.le(ir.add(var, block), end), ir.Assign(var, block, "+="), lo.block(
            lambda: lo.emit(counted(V, accumulators, fold(ir.Elem(acc, (V,)), vector(ir.mul(V, ir.Lanes()))))))))
        lo.emit(ir.For(None, ir.le(ir.add(var, ir.Lanes()), end), ir.Assign(var, ir.Lanes(), "+="), lo.block(
            lambda: lo.emit(fold(ir.Elem(acc, (ir.Const(0),)), vector(ir.Const(0)))))))
        lo.emit(counted(V, accumulators, fold(ir.Elem(acc, (ir.Const(0),)), ir.Elem(acc, (V,))), pragma=None, start=1))
        lo.emit(ir.Assign(accumulator, ir.Math(combine, (accumulator, ir.Call(f"h{combine}", (
            ir.Elem(acc, (ir.Const(0),)),))))))
        lo.emit(ir.For(None, ir.lt(var, end), ir.Incr(var), lo.block(lambda: lo.emit(ir.Assign(
            accumulator, ir.Math(combine, (accumulator, ir.mul(coef, lo.product([located()])))))))))

    lo.emit(lo.block(fill))


def enter(lo: Lowering, index: str, states, cursor: Cursor, position: ir.Expr) -> list:
    """Bind ``index`` to the coordinate at ``position`` of the cursor's unique level and
    locate the locatable levels indexed by it."""
    lo.emit(ir.Decl(lo.var(index), "index", ir.Load(cursor.crd, position), const=True))
    new = list(states)
    new[cursor.k] = states[cursor.k].entered(position)
    locate(lo, index, states, new)
    return new


def sparse_reduction(
    lo: Lowering, index: str, states, driver: int, accumulator: ir.Var, summed: Summed, accumulators: int,
    bounds=None, gathered: bool = False,
) -> None:
    coef, factors = summed
    acc = lo.fresh("sacc")
    n = accumulators

    def fill():
        cursor = open_cursor(lo, driver, states[driver], bounds)
        q = cursor.q

        def step(position: ir.Expr, target: ir.Expr) -> ir.Block:
            def body():
                new = enter(lo, index, states, cursor, position)
                lo.emit(ir.Assign(target, lo.product(new, factors), "+="))
            return lo.block(body)

        lo.emit(ir.Decl(acc, "V", "zero", shape=(n,)))
        if gathered:
            _gathered_sums(lo, index, states, driver, cursor, factors, ir.Elem(acc, (ir.Const(0),)))
        lo.emit(ir.For(None, ir.le(ir.add(q, n), cursor.h), ir.Assign(q, ir.Const(n), "+="), ir.Block((
            counted(U, n, *step(ir.add(q, U), ir.Elem(acc, (U,))).stmts),))))
        lo.emit(ir.For(None, ir.lt(q, cursor.h), ir.Incr(q), step(q, ir.Elem(acc, (ir.Const(0),)))))
        lo.emit(counted(U, n, ir.Assign(ir.Elem(acc, (ir.Const(0),)), ir.Elem(acc, (U,)), "+="), pragma=None, start=1))
        lo.emit(ir.Assign(accumulator, ir.mul(coef, ir.Elem(acc, (ir.Const(0),))), "+="))

    lo.emit(lo.block(fill))


def _gathered_sums(lo: Lowering, index: str, states, driver: int, cursor: Cursor, factors: Sequence[int],
                   into: ir.Expr) -> None:
    """When the fiber holds a whole group of ``n`` vectors of positions from ``q`` (``n``
    the target's ``gathered_vectors``): every such group, the driving factor's values
    loaded, each dense factor gathered at the positions' coordinates (its offset is
    affine in the coordinate), summed into SIMD sums, whose lanes are then added into
    ``into``."""
    q, sums = cursor.q, lo.fresh("gsum")
    lanes = ir.mul(U, ir.Lanes())

    def lane_values(st, k: int) -> ir.Expr:
        if not st.valued:
            return ONES
        if k == driver:
            return ir.VectorLoad(ir.Array("val", st.slot), ir.add(q, lanes))
        if index not in st.dense_indices:
            return ir.Call("splat", (lo.values(states, [k])[0],))
        base = lo.dense_offset(st, {index: ir.Const(0)})
        if lo.slots[st.slot].panel is None:  # row-major: the extents after the index
            after = [lo.dim(i) for i in st.dense_indices[st.dense_indices.index(index) + 1:]]
            stride = product_of(after) if after else ir.Const(1)
        else:
            stride = ir.sub(lo.dense_offset(st, {index: ir.Const(1)}), base)
        return ir.Gather(ir.Array("dense", st.slot), base, cursor.crd, ir.add(q, lanes), stride)

    n = lo.s.target.gathered_vectors
    step = ir.mul(ir.Const(n), ir.Lanes())

    def groups():
        lo.emit(ir.Decl(sums, "VV", "zero", shape=(n,)))
        lo.emit(ir.For(None, ir.le(ir.add(q, step), cursor.h), ir.Assign(q, step, "+="), ir.Block((
            counted(U, n, ir.Assign(ir.Elem(sums, (U,)), product_of(
                [lane_values(states[k], k) for k in factors]), "+=")),))))
        lo.emit(counted(U, n, ir.Assign(ir.Elem(sums, (ir.Const(0),)), ir.Elem(sums, (U,)), "+="),
                        pragma=None, start=1))
        lo.emit(ir.Assign(into, ir.Call("hsum", (ir.Elem(sums, (ir.Const(0),)),)), "+="))

    lo.emit(ir.If(ir.le(ir.add(q, step), cursor.h), lo.block(groups)))


def row_blocker(
    lo: Lowering, block: RowBlock, states, driver: int, around, accumulator: ir.Var, summed: Summed, bounds: dict,
):
    """The ``blocked(cursor, prefetch)`` emitter of loop ``block.index`` (see the module
    doc); ``around`` is the (before, after) pair of the loop inside, if any."""
    index, inner, vectors = block.index, block.inner, block.loads
    common = [k for k in vectors if index not in states[k].dense_indices]
    before, after = around or (None, None)
    coef, factors = summed
    scalars = [k for k in factors if k not in vectors]
    size = block.size

    def emit(cursor: Cursor, prefetch) -> None:
        q = cursor.q

        def body():
            rows = lo.fresh("rows")
            lo.emit(ir.Decl(rows, "index", tuple(ir.Load(cursor.crd, ir.add(q, r)) for r in range(size)),
                            const=True, shape=(size,)))
            if prefetch:
                for r in range(size):
                    prefetch(ir.add(q, r))
            totals = _row_block_sums(lo, block, states, vectors, common, ir.Elem(rows, (R,)), bounds.get(inner))
            for r in range(size):
                def entry(r=r):
                    new = enter(lo, index, states, cursor, ir.add(q, r))
                    if before:
                        before(new)
                    lo.emit(ir.Assign(accumulator, _scale(coef, lo, new, scalars, ir.Elem(totals, (ir.Const(r),))),
                                      "+="))
                    if after:
                        after(new)
                lo.emit(lo.block(entry))

        lo.emit(ir.For(None, ir.le(ir.add(q, size), cursor.h), ir.Assign(q, ir.Const(size), "+="), lo.block(body)))

    return emit


def _row_block_sums(
    lo: Lowering, block: RowBlock, states, vectors: Sequence[int], common: Sequence[int], row: ir.Expr, bounds,
) -> ir.Var:
    """Declare ``t[R]``, ``t[r] = sum_inner prod(vectors)`` with the block's index at
    ``row`` (an expression of ``r``): ``common`` factors loaded once per vector for all
    ``r``, each ``r`` into ``block.vectors`` SIMD accumulators, then scalars."""
    index = block.inner
    var = lo.var(index)
    first, last = bounds or (ir.Const(0), lo.dim(index))
    acc, end, total, x = lo.fresh("rsum"), lo.fresh("end"), lo.fresh("rtot"), lo.fresh("x")
    at = {block.index: row}
    own = [k for k in vectors if k not in common]
    size, width = block.size, block.vectors

    def fma(v: ir.Expr, lane: ir.Expr) -> ir.Block:
        shared = product_of([lo.vector_load(states[k], lane=lane) for k in common])
        loads = product_of([lo.vector_load(states[k], at, lane) for k in own])
        return ir.Block((
            ir.Decl(x, "VV", shared, const=True),
            counted(R, size, ir.Assign(ir.Elem(acc, (R, v)), ir.mul(x, loads), "+=")),
        ), scoped=False)

    lo.emit(ir.Decl(total, "V", None, shape=(size,)))

    def fill():
        lo.emit(ir.Decl(end, "index", last, const=True),
                ir.Decl(acc, "VV", "zero", shape=(size, width)),
                ir.Decl(var, "index", first))
        step = ir.mul(width, ir.Lanes())
        lo.emit(ir.For(None, ir.le(ir.add(var, step), end), ir.Assign(var, step, "+="), ir.Block((
            counted(V, width, *fma(V, ir.mul(V, ir.Lanes())).stmts),))))
        if width > 1:
            lo.emit(ir.For(None, ir.le(ir.add(var, ir.Lanes()), end), ir.Assign(var, ir.Lanes(), "+="),
                           fma(ir.Const(0), ir.Const(0))))
        lo.emit(ir.Effect("hsums", (acc, total)))
        lo.emit(ir.For(None, ir.lt(var, end), ir.Incr(var), ir.Block((
            counted(R, size, ir.Assign(ir.Elem(total, (R,)), lo.product(states, vectors, at), "+=")),))))

    lo.emit(lo.block(fill))
    return total
