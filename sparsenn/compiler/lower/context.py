"""The lowering context: names, operand slots, and the statement builder.

:class:`Lowering` builds loop IR like a compiler's IR builder: ``emit`` appends a
statement at the current point and ``block(fn)`` collects what ``fn`` emits into a
nested :class:`~..loops.ir.Block`. It also owns the names (index variable ``i<n>`` and
extent ``N<n>`` of the ``n``-th index, fresh locals) and the slots (each operand as the
kernel reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sparsenn.formats import Format

from ..loops import ir
from ..frontend.notation import Assignment, Constant, Factor, Reduced, Term, Value
from ..plan.schedule import Schedule

__all__ = ["Slot", "Lowering", "lower_value", "product_of", "counted", "ONES"]

ONES = ir.Call("splat", (ir.Const(1.0),))  # the vector value of a factor read for its pattern only


@dataclass(frozen=True)
class Slot:
    """One operand as the kernel reads it: a sparse operand stored as is or re-stored
    in another mode order (``fmt``), or a dense tensor (``fmt is None``), contiguous
    with its modes permuted by ``layout`` when the schedule asked for it, in panels of
    ``panel`` along its last mode if given (``[panel][other modes][offset]``)."""

    operand: int
    fmt: Format | None
    layout: tuple[int, ...] | None = None
    panel: int | None = None


class Lowering:
    def __init__(self, assignment: Assignment, sched: Schedule, formats: Sequence[Format | None]):
        self.a = assignment
        self.s = sched
        self.formats = formats
        self.indices = tuple(sorted({i for t in assignment.terms for i in t.indices} | set(assignment.output)))
        self.slots: list[Slot] = []
        self._counter = 0
        self._stack: list[list[ir.Stmt]] = [[]]
        self.tile_bounds: dict[str, tuple[ir.Expr, ir.Expr]] = {}  # open tile loops: index -> (start, end)
        # Set for a stage of a fused kernel (lower/fuse.py): every nest's team loops run at
        # this one (flattened) coordinate, with no team or chunks of their own.
        self.team_coordinate: ir.Expr | None = None
        # Dense factors read from a per-thread pack while it is open (lower/packed_block.py):
        # factor -> row(coordinate) giving the (array, offset) of its packed row at the open block.
        self.packed_rows: dict[int, Callable[[ir.Expr], tuple[ir.Array, ir.Expr]]] = {}

    # -- building -------------------------------------------------------------
    def emit(self, *stmts: ir.Stmt) -> None:
        self._stack[-1].extend(stmts)

    def block(self, fill: Callable[[], None], scoped: bool = True) -> ir.Block:
        """The statements ``fill`` emits, as a block."""
        self._stack.append([])
        fill()
        return ir.Block(tuple(self._stack.pop()), scoped)

    def fresh(self, prefix: str) -> ir.Var:
        self._counter += 1
        return ir.Var(f"{prefix}{self._counter}")

    def take(self) -> ir.Block:
        """Everything emitted at the top level."""
        return ir.Block(tuple(self._stack[0]), scoped=False)

    # -- names ---------------------------------------------------------------
    def var(self, index: str) -> ir.Var:
        return ir.Var(f"i{self.indices.index(index)}")

    def dim(self, index: str) -> ir.Var:
        """The extent of ``index`` (declared from ``dims``)."""
        return ir.Var(f"N{self.indices.index(index)}")

    def slot_of(self, slot: Slot) -> int:
        if slot not in self.slots:
            self.slots.append(slot)
        return self.slots.index(slot)

    def declare_dims(self) -> None:
        """Each index's extent ``N<n>``: read from ``dims``, or the constant the
        assignment fixes (the compiler then drops the loops and branches it never runs)."""
        fixed = dict(self.a.extents)
        for n, index in enumerate(self.indices):
            extent = ir.Const(fixed[index]) if index in fixed else ir.Load(ir.Array("dims"), ir.Const(n))
            self.emit(ir.Decl(ir.Var(f"N{n}"), "index", extent, const=True))

    # -- values ----------------------------------------------------------------
    def offset(self, indices: Sequence[str], at: dict[str, ir.Expr] | None = None) -> ir.Expr:
        """Row-major linear offset of ``indices`` (Horner form), at the index variables'
        current values or at the expressions ``at`` gives."""
        if not indices:
            return ir.Const(0)
        value = (at or {}).get
        expr = value(indices[0], self.var(indices[0]))
        for index in indices[1:]:
            expr = ir.add(ir.mul(expr, self.dim(index)), value(index, self.var(index)))
        return expr

    def product(self, states, only: Sequence[int] | None = None, at: dict[str, ir.Expr] | None = None) -> ir.Expr:
        """The product of the factors' values at their current positions (of those
        numbered in ``only``, if given; dense operands at ``at``, see :meth:`offset`)."""
        return product_of(self.values(states, only, at))

    def term_value(self, term: Term, states) -> ir.Expr:
        """The term's value at its factors' current positions: their product, or its
        value tree over them."""
        if term.value is None:
            return self.product(states)
        return lower_value(term.value, self.values(states))

    def values(self, states, only: Sequence[int] | None = None, at: dict[str, ir.Expr] | None = None) -> list:
        """The factors' values that :meth:`product` multiplies, in order."""
        parts = []
        for k, st in enumerate(states):
            if only is not None and k not in only:
                continue
            if not st.valued:
                parts.append(ir.Const(1.0))
            elif st.sparse:
                parts.append(ir.Load(ir.Array("val", st.slot), st.pos))
            else:
                parts.append(ir.Load(ir.Array("dense", st.slot), self.dense_offset(st, at)))
        return parts

    def dense_offset(self, st, at: dict[str, ir.Expr] | None = None) -> ir.Expr:
        """The element offset of a dense factor: row-major (:meth:`offset`), or, for a
        slot in panels along the tiled index ``k`` (open tile ``[T, E)``),
        ``T * rows + offset(other modes) * (E - T) + (k - T)``."""
        if self.slots[st.slot].panel is None:
            return self.offset(st.dense_indices, at)
        *rows, k = st.dense_indices
        start, end = self.tile_bounds[k]
        within = ir.sub((at or {}).get(k, self.var(k)), start)
        row_count = product_of([self.dim(i) for i in rows])
        return ir.add(ir.add(ir.mul(start, row_count), ir.mul(self.offset(rows, at), ir.sub(end, start))), within)

    def vector_load(self, st, at: dict[str, ir.Expr] | None = None, lane: ir.Expr | None = None,
                    count: ir.Expr | None = None) -> ir.Expr:
        """SIMD vector of a unit-stride dense factor ``lane`` elements past its current
        position (or past ``at``); with ``count``, its first ``count`` lanes."""
        if not st.valued:
            return ONES
        lane = ir.mul(ir.Var("v"), ir.Lanes()) if lane is None else lane
        return ir.VectorLoad(ir.Array("dense", st.slot), ir.add(self.dense_offset(st, at), lane), count)


def lower_value(value: Value, factors: Sequence[ir.Expr], reduced: ir.Expr | None = None) -> ir.Expr:
    """A :class:`~..frontend.notation.Value` as an expression over the factors' values (and the
    reduced value, in an epilogue)."""
    if isinstance(value, Factor):
        return factors[value.k]
    if isinstance(value, Constant):
        return ir.Const(float(value.value))
    if isinstance(value, Reduced):
        return reduced
    args = tuple(lower_value(a, factors, reduced) for a in value.args)
    operator = _OPERATORS.get(value.function)
    return ir.Bin(operator, *args) if operator else ir.Math(value.function, args)


_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def product_of(parts: Sequence[ir.Expr]) -> ir.Expr:
    """``parts[0] * parts[1] * ...`` evaluated left to right; 1 if empty."""
    if not parts:
        return ir.Const(1.0)
    out = parts[0]
    for p in parts[1:]:
        out = ir.mul(out, p)
    return out


def counted(var: ir.Var, n: int | ir.Expr, *stmts: ir.Stmt, pragma: str | None = "unroll", start: int = 0) -> ir.For:
    """``for (int var = start; var < n; ++var) { stmts }``, unrolled by default."""
    return ir.For(ir.Decl(var, "int", ir.Const(start)), ir.lt(var, n), ir.Incr(var), ir.Block(stmts), pragma)
