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

:func:`merge` co-iterates the cursors of one or more terms along their **merge
lattice**: a term is *present* at ``i`` when all its cursors sit at ``i``; the body runs
where some term is present (one term: the intersection; several: the union). Each step
takes ``i = min`` of the cursors' coordinates, visits, then advances every cursor at
``i`` past its segment. Either each point of the lattice (a set of terms whose cursors
are all live) has its own loop, the points largest first, so a point's loop starts once
every term outside it is exhausted (one term with one cursor: a plain fiber loop; one
term: the single point, the intersection); or the points are collapsed into one loop
in which an exhausted cursor's coordinate is past every other (``END``), ending when
all are. When some term has no cursor (it is present wherever it is active) or the
caller needs every coordinate (a dense output level), one loop walks every coordinate,
testing each cursor the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from ..loops import ir
from .context import Lowering
from .iterators import Cursor, enter_position, filtering, locate, open_cursor

__all__ = ["co_iterate", "merge", "lattice", "Body", "Merged"]

Body = Callable[[list], None]
# body({term: (its states at i, whether it is present: a flag, or None for always)}),
# terms absent at the lattice point left out
Merged = Callable[[dict[int, tuple[list, ir.Expr | None]]], None]


def co_iterate(
    lo: Lowering, index: str, states: list, body: Body, bounds=None, reduction: ir.Var | None = None,
    prefetcher=None, blocked=None, independent: bool = False, combine: str = "sum",
) -> None:
    """Emit loop ``index`` over the factors in ``states`` (their intersection).

    ``reduction``: the body combines into this scalar by ``combine`` (``sum``, ``max``
    or ``min``), so a dense loop carries ``omp simd reduction``; ``independent``: the
    body writes a different output element per iteration (``omp simd``).
    ``prefetcher(cursor, state)`` (one iterated level only) declares a run-time flag and
    returns it with the per-position prefetch emitter; ``blocked(cursor, prefetch)``
    emits a loop over whole blocks of positions first."""
    sparse = filtering(index, states)
    new = list(states)
    if not sparse:
        _dense_loop(lo, index, states, new, body, bounds, reduction, independent, combine)
        return
    followers = _followers(lo, states, sparse)
    if followers:
        inner, blocked = body, None  # a blocked loop reads the cursor's own factor only

        def body(entered: list) -> None:
            for k, leader in followers.items():
                entered[k] = states[k].entered(entered[leader].pos, entered[leader].seg_end)
            inner(entered)

    cursors = [open_cursor(lo, k, states[k], bounds) for k in sparse if k not in followers]
    if len(cursors) > 1:
        merge(lo, index, [states], [cursors], lambda present: body(present[0][0]))
        return
    (cursor,) = cursors
    st = states[cursor.k]

    def fiber(prefetch) -> ir.Block:
        def fill():
            if blocked is not None and st.level.unique:
                blocked(cursor, prefetch)
            _fiber(lo, index, states, cursor, body, prefetch)

        return lo.block(fill)

    if prefetcher is None:
        lo.emit(*fiber(None).stmts)
        return
    flag, prefetch = prefetcher(cursor, st)
    lo.emit(ir.If(flag, fiber(prefetch), fiber(None)))


def _followers(lo: Lowering, states: list, sparse: Sequence[int]) -> dict[int, int]:
    """The factors of ``sparse`` that read a level another of them reads at the same
    position (operands sharing index arrays, or one operand read twice, each as it is
    stored): follower -> leader. A follower is entered where its leader is instead of
    being co-iterated with it (merging equal coordinates)."""
    patterns = lo.s.patterns
    leaders: dict[tuple, int] = {}
    followers: dict[int, int] = {}
    for k in sparse:
        st = states[k]
        slot = lo.slots[st.slot]
        if slot.fmt != lo.formats[slot.operand]:
            continue  # a re-stored copy has arrays of its own
        shared = patterns[slot.operand] if patterns else None
        # The same arrays read over the same indices down to this level: every level above
        # was entered at the same coordinates, so at the same positions.
        key = (slot.operand if shared is None else shared, st.levels, st.depth)
        if key in leaders:
            followers[k] = leaders[key]
        else:
            leaders[key] = k
    return followers


def _fiber(lo: Lowering, index: str, states: list, cursor: Cursor, body: Body, prefetch=None) -> None:
    """The loop over the positions of one cursor's level: ``i = crd[q]``."""
    st = states[cursor.k]

    def step():
        lo.emit(ir.Decl(lo.var(index), "index", ir.Load(cursor.crd, cursor.q), const=True))
        if prefetch:
            prefetch(cursor.q)
        new = list(states)
        new[cursor.k], after = enter_position(lo, cursor, st)
        located = list(new)
        locate(lo, index, states, located)
        body(located)
        if not st.level.unique:
            lo.emit(ir.Assign(cursor.q, after))

    loop_body = lo.block(step)
    if st.level.unique:
        lo.emit(ir.For(None, ir.lt(cursor.q, cursor.h), ir.Incr(cursor.q), loop_body))
    else:
        lo.emit(ir.While(ir.lt(cursor.q, cursor.h), loop_body))


def _dense_loop(lo, index, states, new, body, bounds, reduction, independent, combine) -> None:
    def step():
        locate(lo, index, states, new)
        body(list(new))

    pragma = "simd_reduction" if reduction is not None else "simd" if independent else None
    _coordinates(lo, index, bounds, step, pragma, reduction, combine)


def _coordinates(lo, index, bounds, step: Callable[[], None], pragma=None, reduction=None, combine="sum") -> None:
    """``for i in [lo, hi)`` (the bounds, or ``[0, N)``), its body what ``step`` emits."""
    var = lo.var(index)
    first, last = bounds or (ir.Const(0), lo.dim(index))
    if bounds is not None:
        end = lo.fresh("end")
        lo.emit(ir.Decl(end, "index", last, const=True))
        last = end
    lo.emit(ir.For(ir.Decl(var, "index", first), ir.lt(var, last), ir.Incr(var), lo.block(step), pragma, reduction,
                   combine))


END = ir.Const((1 << 63) - 1)  # the coordinate of an exhausted cursor


def merge(
    lo: Lowering, index: str, states: Sequence[list], cursors: Sequence[Sequence[Cursor]], body: Merged,
    bounds=None, active: Sequence[ir.Expr | None] | None = None, every: bool = False, by_points: bool = True,
) -> None:
    """The merge of the terms' ``cursors`` (``cursors[t]`` over ``states[t]``; see the
    module doc). ``active[t]``: whether term ``t`` is active at all (None: it is);
    ``every``: visit every coordinate (of ``bounds``, if given); ``by_points``: a loop
    per lattice point, else one loop."""
    active = active or [None] * len(states)
    if every or not all(cursors):
        _one_loop(lo, index, states, cursors, body, active, walk=True, every=every, bounds=bounds)
    elif by_points or len(states) == 1:
        for point in lattice(len(states)):
            _point(lo, index, states, cursors, point, body)
    else:
        _one_loop(lo, index, states, cursors, body, active, walk=False)


def lattice(terms: int) -> list[tuple[int, ...]]:
    """The points of a union of ``terms`` terms: every non-empty set of them, largest
    first (for one term, its intersection)."""
    return [point for size in range(terms, 0, -1) for point in itertools.combinations(range(terms), size)]


def _point(lo: Lowering, index: str, states, cursors, point: tuple[int, ...], body: Merged) -> None:
    """The loop of one lattice point: while all its terms' cursors are live."""
    group = [(t, cursor) for t in point for cursor in cursors[t]]
    if len(group) == 1:
        ((t, cursor),) = group
        _fiber(lo, index, states[t], cursor, lambda new: body({t: (new, None)}))
        return
    var = lo.var(index)

    def step():
        coords = []
        for _, cursor in group:
            coords.append(lo.fresh("c"))
            lo.emit(ir.Decl(coords[-1], "index", ir.Load(cursor.crd, cursor.q), const=True))
        lo.emit(ir.Decl(var, "index", ir.min_(*coords) if len(point) == 1 else _least(coords), const=True))
        new, present, advances = {t: list(states[t]) for t in point}, {}, []
        for (t, cursor), coord in zip(group, coords):
            at = ir.eq(coord, var)
            new[t][cursor.k], after = enter_position(lo, cursor, states[t][cursor.k], at)
            advances.append(ir.If(at, ir.Block((ir.Assign(cursor.q, after),), scoped=False)))
            present[t] = at if t not in present else ir.and_(present[t], at)
        if len(point) > 1:
            present = {t: _flag(lo, p) for t, p in present.items()}
        _visit(lo, index, new, present, body, False)
        lo.emit(*advances)

    lo.emit(ir.While(ir.and_(*(ir.lt(c.q, c.h) for _, c in group)), lo.block(step)))


def _one_loop(
    lo: Lowering, index: str, states, cursors, body: Merged, active, walk: bool, every: bool = False, bounds=None,
) -> None:
    """One loop over every coordinate of ``bounds`` (``walk``; visiting each if
    ``every``), or over the cursors' coordinates until all are exhausted."""
    var = lo.var(index)

    def step():
        coords = []
        for group in cursors:
            for cursor in group:
                coords.append(lo.fresh("c"))
                lo.emit(ir.Decl(coords[-1], "index", ir.Select(
                    ir.lt(cursor.q, cursor.h), ir.Cast("index", ir.Load(cursor.crd, cursor.q)), END), const=True))
        if not walk:
            lo.emit(ir.Decl(var, "index", _least(coords), const=True),
                    ir.If(ir.eq(var, END), ir.Block((ir.Break(),))))
        new, present, advances = {t: list(s) for t, s in enumerate(states)}, {}, []
        at_coords = iter(coords)
        for t, group in enumerate(cursors):
            ats = []
            for cursor in group:
                at = ir.eq(next(at_coords), var)
                new[t][cursor.k], after = enter_position(lo, cursor, states[t][cursor.k], at)
                advances.append(ir.If(at, ir.Block((ir.Assign(cursor.q, after),), scoped=False)))
                ats.append(at)
            present[t] = ir.and_(*ats) if ats else active[t]
        present = {t: p if p is None or isinstance(p, ir.Var) else _flag(lo, p) for t, p in present.items()}
        _visit(lo, index, new, present, body, every)
        lo.emit(*advances)

    if walk:
        _coordinates(lo, index, bounds, step)
    else:
        lo.emit(ir.While(ir.Const(1), lo.block(step)))


def _visit(lo: Lowering, index: str, new: dict, present: dict, body: Merged, always: bool) -> None:
    """Locate the terms' levels at ``i`` and run the body where some term is present
    (everywhere if ``always`` or a term is always present)."""
    def visit():
        located = {}
        for t, st in new.items():
            located[t] = list(st)
            locate(lo, index, st, located[t])
        body({t: (located[t], present[t]) for t in new})

    if always or any(p is None for p in present.values()):
        lo.emit(lo.block(visit))
    else:
        lo.emit(ir.If(ir.or_(*present.values()), lo.block(visit)))


def _least(coords: Sequence[ir.Expr]) -> ir.Expr:
    """The least of ``coords`` as nested selections (``c < least ? c : least``, the
    partial minimum repeated rather than declared: compilers then thread the selections'
    branches into the presence tests that follow)."""
    least = coords[0]
    for coord in coords[1:]:
        least = ir.Select(ir.lt(coord, least), coord, least)
    return least


def _flag(lo: Lowering, value: ir.Expr) -> ir.Var:
    flag = lo.fresh("a")
    lo.emit(ir.Decl(flag, "bool", value, const=True))
    return flag
