"""Co-iteration: one loop over an index shared by several factors, of one term or of
several (a sum).

For one term (a product) at loop ``i``, the factors whose next level is over ``i``:

* no iterated level: a dense loop over the coordinates (``[lo, hi)`` or ``[0, N)``),
  locating every locatable level;
* one: a loop over that level's positions ``q``, coordinate ``crd[q]`` (a non-unique
  level's ``q`` jumps over its segment), optionally with prefetches (see
  :mod:`.prefetch`) or a blocked loop first (see :mod:`.reductions`);
* several: a merge of their cursors visiting the intersection (a product is zero
  elsewhere).

:func:`merge` co-iterates the cursors of one or more terms, parametrised by the merge
lattice: a term is *present* at ``i`` when all its cursors sit at ``i`` (a term with
no iterated level here, whenever it is active), and the body runs where some term is
present: with one term that is the intersection, with several the union. Each step
takes ``i = min`` of the live cursors' coordinates, or every ``i`` of the range when
some term has no cursor or the caller needs every coordinate (a dense output level);
then every cursor at ``i`` advances past its segment. The loop runs while some term may
still be present (all its cursors live).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..loops import ir
from .context import Lowering
from .iterators import Cursor, enter_position, filtering, locate, open_cursor

__all__ = ["co_iterate", "merge", "Body", "Merged"]

Body = Callable[[list], None]
Merged = Callable[[list[list], list], None]  # body(states per term, presence per term)


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
        merge(lo, index, [states], [cursors], lambda new, present: body(new[0]))
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
    def step():
        locate(lo, index, states, new)
        body(list(new))

    pragma = "simd_reduction" if reduction is not None else "simd" if independent else None
    _coordinates(lo, index, bounds, step, pragma, reduction)


def _coordinates(lo, index, bounds, step: Callable[[], None], pragma=None, reduction=None) -> None:
    """``for i in [lo, hi)`` (the bounds, or ``[0, N)``), its body what ``step`` emits."""
    var = lo.var(index)
    first, last = bounds or (ir.Const(0), lo.dim(index))
    if bounds is not None:
        end = lo.fresh("end")
        lo.emit(ir.Decl(end, "index", last, const=True))
        last = end
    lo.emit(ir.For(ir.Decl(var, "index", first), ir.lt(var, last), ir.Incr(var), lo.block(step), pragma, reduction))


END = ir.Const((1 << 63) - 1)  # the coordinate of an exhausted cursor


def merge(
    lo: Lowering, index: str, states: Sequence[list], cursors: Sequence[Sequence[Cursor]], body: Merged,
    bounds=None, active: Sequence[ir.Expr | None] | None = None, every: bool = False,
) -> None:
    """The merge loop of the terms' ``cursors`` (``cursors[t]`` over ``states[t]``; see
    the module doc). ``active[t]``: whether term ``t`` is active at all (None: it is);
    ``every``: visit every coordinate. ``body(states, present)`` gets each term's
    states at ``i`` and whether it is present there (None: always)."""
    var = lo.var(index)
    active = active or [None] * len(states)
    walk = every or not all(cursors)
    sums = len(states) > 1 or every  # presences are flags the body tests
    exhaustible = walk or len(states) > 1  # a cursor may be exhausted while the loop runs
    # Terms of one cursor each: one sits at the minimum, so a term is present.
    certain = not walk and len(states) > 1 and all(len(group) == 1 for group in cursors)

    def step():
        coords = []
        for group in cursors:
            for cursor in group:
                coord, value = lo.fresh("c"), ir.Load(cursor.crd, cursor.q)
                if exhaustible:
                    value = ir.Select(ir.lt(cursor.q, cursor.h), ir.Cast("index", value), END)
                lo.emit(ir.Decl(coord, "index", value, const=True))
                coords.append(coord)
        if not walk:
            lo.emit(ir.Decl(var, "index", ir.min_(*coords), const=True))
        new, present, advances = [list(s) for s in states], [], []
        at_coords = iter(coords)
        for t, group in enumerate(cursors):
            ats = []
            for cursor in group:
                at = ir.eq(next(at_coords), var)
                new[t][cursor.k], after = enter_position(lo, cursor, states[t][cursor.k], at)
                advances.append(ir.If(at, ir.Block((ir.Assign(cursor.q, after),), scoped=False)))
                ats.append(at)
            present.append(ir.and_(*ats) if ats else active[t])
        if sums:
            present = [p if p is None or isinstance(p, ir.Var) else _flag(lo, p) for p in present]

        def visit():
            located = [list(n) for n in new]
            for t, n in enumerate(new):
                locate(lo, index, n, located[t])
            body(located, present)

        if every or certain or any(p is None for p in present):
            lo.emit(lo.block(visit))
        else:
            lo.emit(ir.If(ir.or_(*present), lo.block(visit)))
        lo.emit(*advances)

    if walk:
        _coordinates(lo, index, bounds, step)
    else:
        lo.emit(ir.While(ir.or_(*(ir.and_(*(ir.lt(c.q, c.h) for c in group)) for group in cursors)),
                         lo.block(step)))


def _flag(lo: Lowering, value: ir.Expr) -> ir.Var:
    flag = lo.fresh("a")
    lo.emit(ir.Decl(flag, "bool", value, const=True))
    return flag
