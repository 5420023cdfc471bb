"""Level iteration from capabilities: where each factor is, and how its next level is
entered at a loop.

A factor during lowering is a :class:`FactorState`: the storage levels it reads, in
loop order, and its position ``pos`` in the last level entered (a dense operand keeps
its indices instead). At loop ``i`` a factor whose next level is over ``i`` either
*locates* it (a locatable level: ``level.locate(p, i)``, e.g. ``p * N + i``) or
*iterates* it through a :class:`Cursor` over ``level.position_bounds(p)``. The IR of
those expressions is built by :class:`LevelExprs`, the :class:`IndexBuilder` the
level capabilities receive (formats never import the compiler). A non-unique level
groups equal coordinates into a segment ``[q, e)`` that its child iterates:
:func:`segment_end` is the one place that finds ``e``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sparsenn.formats.level import Level

from ..loops import ir
from ..frontend.notation import Term
from .context import Lowering, Slot

__all__ = ["initial_states", "FactorState", "LevelExprs", "Cursor", "open_cursor", "locate", "level_size", "segment_end",
           "filtering", "enter_position", "fiber_length"]


@dataclass(frozen=True)
class FactorState:
    """A factor during lowering: which storage level it reads next and where it is."""

    slot: int
    levels: tuple[tuple[str, Level], ...]  # (index, level) in loop order; () if dense
    dense_indices: tuple[str, ...] = ()  # a dense operand's indices, row-major
    depth: int = 0
    pos: ir.Expr = ir.Const(0)
    seg_end: ir.Expr | None = None
    valued: bool = True  # False: the term reads the factor's stored positions only (its value is 1)

    @property
    def sparse(self) -> bool:
        return bool(self.levels)

    @property
    def level(self) -> Level:
        return self.levels[self.depth][1]

    def next_index(self) -> str | None:
        return self.levels[self.depth][0] if self.depth < len(self.levels) else None

    def crd(self) -> ir.Array:
        return ir.Array("crd", self.slot, self.depth)

    def entered(self, pos: ir.Expr, seg_end: ir.Expr | None = None) -> FactorState:
        return replace(self, depth=self.depth + 1, pos=pos, seg_end=seg_end)


@dataclass(frozen=True)
class LevelExprs:
    """IR for one storage level of one slot, as the level capabilities build it."""

    slot: int
    level: int

    def pos(self, at) -> ir.Expr:
        return ir.Load(ir.Array("pos", self.slot, self.level), ir.c(at))

    def crd(self, at) -> ir.Expr:
        return ir.Load(ir.Array("crd", self.slot, self.level), ir.c(at))

    def add(self, a, b) -> ir.Expr:
        return ir.add(a, b)

    def mul(self, a, b) -> ir.Expr:
        return ir.mul(a, b)


@dataclass(frozen=True)
class Cursor:
    """Positions ``[q, h)`` of factor ``k``'s next level; ``q`` advances."""

    k: int
    q: ir.Var
    h: ir.Var
    crd: ir.Array


class _Integers:
    """Level arithmetic on Python ints (an :class:`IndexBuilder` without arrays)."""

    def add(self, a, b):
        return a + b

    def mul(self, a, b):
        return a * b


def fiber_length(level) -> int:
    """The positions of every fiber of a level with affine fibers (``affine_fibers``)."""
    first, last = level.position_bounds(_Integers(), 0)
    return last - first


def filtering(index: str, states) -> list[int]:
    """The factors whose next level is over ``index`` and is iterated (not locatable)."""
    return [k for k, st in enumerate(states) if st.next_index() == index and not st.level.locatable]


def open_cursor(lo: Lowering, k: int, st: FactorState, bounds=None, active: ir.Expr | None = None) -> Cursor:
    """Declare a cursor over ``st``'s next level under its position: every position, or
    those whose coordinates lie in ``bounds``; empty unless ``active`` holds."""
    first, last = st.level.position_bounds(LevelExprs(st.slot, st.depth), st.pos, st.seg_end)
    q, h, crd = lo.fresh("q"), lo.fresh("h"), st.crd()

    def guard(e: ir.Expr) -> ir.Expr:
        return e if active is None else ir.Select(active, ir.Cast("I", e), ir.Cast("I", ir.Const(0)))

    if bounds is not None:
        whole = lo.fresh("hb")
        lo.emit(ir.Decl(whole, "I", guard(last), const=True))
        lo.emit(ir.Decl(q, "I", guard(ir.Call("lower_bound", (crd, first, whole, bounds[0])))))
        lo.emit(ir.Decl(h, "I", guard(ir.Call("lower_bound", (crd, q, whole, bounds[1]))), const=True))
    else:
        lo.emit(ir.Decl(q, "I", guard(first)))
        lo.emit(ir.Decl(h, "I", guard(last), const=True))
    return Cursor(k, q, h, crd)


def segment_end(lo: Lowering, cursor: Cursor, when: ir.Expr | None = None) -> ir.Var:
    """Declare ``e``: the end of the run of positions from ``q`` sharing ``crd[q]`` (a
    non-unique level's segment), scanned only if ``when`` holds (else ``q + 1``)."""
    e = lo.fresh("e")
    q, h, crd = cursor.q, cursor.h, cursor.crd
    lo.emit(ir.Decl(e, "I", ir.add(q, 1)))
    scan = ir.While(ir.and_(ir.lt(e, h), ir.eq(ir.Load(crd, e), ir.Load(crd, q))), ir.Block((ir.Incr(e),)))
    lo.emit(scan if when is None else ir.If(when, ir.Block((scan,), scoped=False)))
    return e


def enter_position(lo: Lowering, cursor: Cursor, st: FactorState, when: ir.Expr | None = None):
    """``st`` at the cursor's position, and the position after its segment there."""
    if st.level.unique:
        return st.entered(cursor.q), ir.add(cursor.q, 1)
    e = segment_end(lo, cursor, when)
    return st.entered(cursor.q, e), e


def locate(lo: Lowering, index: str, states, new: list) -> None:
    """Into ``new``: the factors whose next level, over ``index``, is locatable, located
    at the current coordinate."""
    for k, st in enumerate(states):
        if st.next_index() == index and st.level.locatable:
            p = lo.fresh("p")
            at = st.level.locate(LevelExprs(st.slot, st.depth), st.pos, lo.var(index), lo.dim(index))
            lo.emit(ir.Decl(p, "index", at, const=True))
            new[k] = st.entered(p)


def level_size(lo: Lowering, st: FactorState, depth: int) -> ir.Expr:
    """Number of positions of ``st``'s storage level ``depth`` (its ``crd`` length)."""
    if depth < 0:
        return ir.Const(1)
    index, level = st.levels[depth]
    return level.positions(LevelExprs(st.slot, depth), level_size(lo, st, depth - 1), lo.dim(index))


def initial_states(lo: Lowering, t: int, term: Term) -> list[FactorState]:
    """Term ``t``'s factors before any loop, each through its slot (re-stored or re-laid
    out in loop order where the schedule says so)."""
    states = []
    multiplied = term.multiplied
    for k, access in enumerate(term.factors):
        # a term of coefficient 0 (a pattern's positions kept in the result) reads none of its values
        valued = (multiplied is None or k in multiplied) and term.coefficient != 0.0
        fmt = lo.formats[access.operand]
        order = lo.s.factor_mode_order(t, k)
        if fmt is None:
            nest = next(n for n in lo.s.nests if n.term == t)
            panel = next((size for k2, size in nest.panels if k2 == k), None)
            n = lo.slot_of(Slot(access.operand, None, order, panel))
            indices = access.indices if order is None else tuple(access.indices[m] for m in order)
            states.append(FactorState(n, (), indices, valued=valued))
            continue
        if order is not None and order != fmt.mode_order:  # a term's value needs its factors' exact patterns
            fmt = fmt.in_mode_order(order, exact=term.value is not None)
        n = lo.slot_of(Slot(access.operand, fmt))
        levels = tuple((access.indices[m], lvl) for m, lvl in zip(fmt.mode_order, fmt.levels))
        states.append(FactorState(n, levels, valued=valued))
    return states
