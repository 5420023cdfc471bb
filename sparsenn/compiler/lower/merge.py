"""Co-iteration: one loop over an index shared by several factors.

At loop ``i`` the factors whose next level is over ``i`` are co-iterated:

* no iterated level: a dense loop over the coordinates (``[lo, hi)`` or ``[0, N)``),
  locating every locatable level;
* one: a loop over that level's positions ``q``, coordinate ``crd[q]`` (a non-unique
  level's ``q`` jumps over its segment), optionally with prefetches (see
  :mod:`.prefetch`) or a blocked loop first (see :mod:`.reductions`);
* several: a merge of the sorted cursors visiting their intersection (a product is
  zero elsewhere): at each step ``i = min`` of their coordinates; the body runs where
  all sit at ``i``; every cursor at ``i`` advances past its segment; the loop ends
  when a cursor does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..loops import ir
from .context import Lowering
from .iterators import Cursor, enter_position, filtering, locate, open_cursor

__all__ = ["co_iterate", "merge_streams", "Body"]

Body = Callable[[list], None]


def co_iterate(
    lo: Lowering, index: str, states: list, body: Body, bounds=None, reduction: ir.Var | None = None,
    prefetcher=None, blocked=None, independent: bool = False,
) -> None:
    """Emit loop ``index`` over the factors in ``states`` (their intersection).

    ``reduction``: the body sums into this scalar, so a dense loop carries ``omp simd
    reduction``; ``independent``: the body writes a different output element per
    iteration (``omp simd``). ``prefetcher(cursor, state)`` (one iterated level only)
    declares a run-time flag and returns it with the per-position prefetch emitter;
    ``blocked(cursor, prefetch)`` emits a loop over whole blocks of positions first."""
    sparse = filtering(index, states)
    new = list(states)
    if not sparse:
        _dense_loop(lo, index, states, new, body, bounds, reduction, independent)
        return
    cursors = [open_cursor(lo, k, states[k], bounds) for k in sparse]
    if len(cursors) > 1:
        merge_streams(lo, index, states, cursors, body)
        return
    (cursor,) = cursors
    st = states[cursor.k]

    def fiber(prefetch) -> ir.Block:
        def fill():
            if blocked is not None and st.level.unique:
                blocked(cursor, prefetch)

            def step():
                lo.emit(ir.Decl(lo.var(index), "index", ir.Load(cursor.crd, cursor.q), const=True))
                if prefetch:
                    prefetch(cursor.q)
                entered, after = enter_position(lo, cursor, st)
                new[cursor.k] = entered
                locate(lo, index, states, new)
                body(list(new))
                if not st.level.unique:
                    lo.emit(ir.Assign(cursor.q, after))

            loop_body = lo.block(step)
            if st.level.unique:
                lo.emit(ir.For(None, ir.lt(cursor.q, cursor.h), ir.Incr(cursor.q), loop_body))
            else:
                lo.emit(ir.While(ir.lt(cursor.q, cursor.h), loop_body))

        return lo.block(fill)

    if prefetcher is None:
        lo.emit(*fiber(None).stmts)
        return
    flag, prefetch = prefetcher(cursor, st)
    lo.emit(ir.If(flag, fiber(prefetch), fiber(None)))


def _dense_loop(lo, index, states, new, body, bounds, reduction, independent) -> None:
    var = lo.var(index)
    first, last = bounds or (ir.Const(0), lo.dim(index))
    if bounds is not None:
        end = lo.fresh("end")
        lo.emit(ir.Decl(end, "index", last, const=True))
        last = end

    def step():
        locate(lo, index, states, new)
        body(list(new))

    pragma = "simd_reduction" if reduction is not None else "simd" if independent else None
    lo.emit(ir.For(ir.Decl(var, "index", first), ir.lt(var, last), ir.Incr(var), lo.block(step), pragma, reduction))


def merge_streams(lo: Lowering, index: str, states: list, cursors: Sequence[Cursor], body: Body) -> None:
    """The merge loop over the intersection of ``cursors`` (see the module doc):
    ``i = min`` of their coordinates, the body where all sit at ``i``, then every
    cursor at ``i`` advances past its segment."""
    var = lo.var(index)

    def step():
        coords = {}
        for cursor in cursors:
            coords[cursor] = lo.fresh("c")
            lo.emit(ir.Decl(coords[cursor], "index", ir.Load(cursor.crd, cursor.q), const=True))
        lo.emit(ir.Decl(var, "index", ir.min_(*coords.values()), const=True))
        new, advances = list(states), []
        for cursor in cursors:
            at = ir.eq(coords[cursor], var)
            new[cursor.k], after = enter_position(lo, cursor, states[cursor.k], at)
            advances.append(ir.If(at, ir.Block((ir.Assign(cursor.q, after),), scoped=False)))

        def visit():
            located = list(new)
            locate(lo, index, new, located)
            body(located)

        lo.emit(ir.If(ir.and_(*(ir.eq(coords[c], var) for c in cursors)), lo.block(visit)))
        lo.emit(*advances)

    lo.emit(ir.While(ir.and_(*(ir.lt(c.q, c.h) for c in cursors)), lo.block(step)))
