"""Co-iteration: one loop over an index shared by several factors.

At loop ``i`` the factors whose next level is over ``i`` are co-iterated:

* no iterated level: a dense loop over the coordinates (``[lo, hi)`` or ``[0, N)``),
  locating every locatable level;
* one: a loop over that level's positions ``q``, coordinate ``crd[q]`` (a non-unique
  level's ``q`` jumps over its segment), optionally with prefetches (see
  :mod:`.prefetch`) or a blocked loop first (see :mod:`.reductions`);
* several: a merge of sorted streams. Each *stream* is the intersection of some
  cursors (the factors of one term; a product is zero elsewhere); the loop visits the
  union of the streams: at each step ``i = min`` of the live cursors' coordinates, a
  stream is present when all its cursors sit at ``i``, and every cursor at ``i``
  advances past its segment. One stream is an intersection (the loop ends when a cursor
  does); several are a union (it ends when all streams have).
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
        merge_streams(lo, index, [(states, cursors, None)], lambda present: body(present[0][1]))
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


def merge_streams(
    lo: Lowering, index: str, streams: Sequence[tuple[list, list[Cursor], ir.Expr | None]],
    body: Callable[[list[tuple[ir.Expr, list]]], None],
) -> None:
    """The merge loop over ``streams`` = (states, their open cursors, active flag or
    None) (see the module doc). ``body(present)`` gets, per stream, the condition that
    it is present at ``i`` and its states there; it runs where any stream is present."""
    var = lo.var(index)
    union = len(streams) > 1
    alive = [ir.and_(*(ir.lt(c.q, c.h) for c in cursors)) for _, cursors, _ in streams]

    def step():
        coords = {}
        for s, (_, cursors, _) in enumerate(streams):
            for cursor in cursors:
                value = ir.Load(cursor.crd, cursor.q)
                if union:  # a finished stream's cursors no longer count
                    value = ir.Select(alive[s], ir.Cast("index", value), ir.Call("max_index", ()))
                coord = lo.fresh("c")
                lo.emit(ir.Decl(coord, "index", value, const=True))
                coords[cursor] = coord
        lo.emit(ir.Decl(var, "index", ir.min_(*coords.values()), const=True))
        present, advances = [], []
        for states, cursors, _ in streams:
            hit = ir.and_(*(ir.eq(coords[c], var) for c in cursors))
            if union:
                flag = lo.fresh("a")
                lo.emit(ir.Decl(flag, "bool", hit, const=True))
                hit = flag
            new = list(states)
            for cursor in cursors:
                at = ir.eq(coords[cursor], var)
                new[cursor.k], after = enter_position(lo, cursor, states[cursor.k], at)
                advances.append(ir.If(at, ir.Block((ir.Assign(cursor.q, after),), scoped=False)))
            present.append((hit, new))

        def visit():
            located = []
            for hit, new in present:  # locating is arithmetic: done for absent streams too
                at = list(new)
                locate(lo, index, new, at)
                located.append((hit, at))
            body(located)

        lo.emit(ir.If(ir.or_(*(hit for hit, _ in present)) if union else present[0][0], lo.block(visit)))
        lo.emit(*advances)

    lo.emit(ir.While(ir.or_(*alive) if union else alive[0], lo.block(step)))
