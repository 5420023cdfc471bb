"""How the shared loops of a sparse output write it: one :class:`Assembler` per
strategy of :class:`~..plan.decisions.OutputAssembly`, each emitting IR at the hook
points of :mod:`.sparse_output`'s loops (a hook a strategy does not need emits nothing).

* :class:`Append`: each chunk appends, per appended level, its coordinates and each
  parent's number of children, and the values, into its own buffers (``Chunk``); a
  parent left without children is dropped again. ``sn_finish`` copies the chunks out.
* :class:`Count` (two-phase, first): ``row_pos[r + 1]`` = the entries of row ``r`` (the
  position of the inserted levels' coordinates), pattern only; then prefix sums make
  ``row_pos`` the rows' offsets and give the output's size.
* :class:`Fill` (two-phase, second, in ``sn_finish``): row ``r``'s entries go to
  ``out_crd/out_val[row_pos[r] ..]`` of the caller's arrays.
"""

from __future__ import annotations

from ..loops import ir
from .context import Lowering, product_of

__all__ = ["Assembler", "Append", "Count", "Fill", "assembler", "WS_DIMS"]

WS_DIMS = ir.Var("ws_dims")  # the workspace's index extents (its keys are linear over them)
ROWS = ir.Var("sn_rows")
ROW_POS, OUT_POS, OUT_CRD, OUT_VAL = (ir.Array(kind) for kind in ("row_pos", "out_pos", "out_crd", "out_val"))


class Assembler:
    """The hooks; ``values``: whether the loops compute values (else the pattern only)."""

    values = True
    workspace_kind = ""

    def __init__(self, lo: Lowering):
        self.rank = len(lo.s.output_order)
        self.inserted = lo.s.assembly.inserted
        self.levels = lo.s.output_format.levels

    def start(self, lo: Lowering) -> None:
        """Before the chunks are laid out."""

    def chunks(self, lo: Lowering, count: ir.Expr) -> None:
        """Once their number is known."""

    def chunk(self, lo: Lowering, chunk: ir.Expr) -> None:
        """At the start of chunk ``chunk``."""

    def finish(self, lo: Lowering) -> None:
        """After the thread team."""

    def declare_workspace(self, lo: Lowering, dims: list[ir.Expr], error: ir.Var) -> None:
        """The thread's workspace over keys linear in ``dims``; allocation failures set ``error``."""
        lo.emit(ir.Effect("declare_workspace", (self.workspace_kind,)))
        lo.emit(ir.Guarded(ir.Block((ir.Effect("init_workspace", (product_of(dims),)),)), error))

    def open(self, lo: Lowering, level: int, coord: ir.Expr) -> ir.Var | None:
        """Before visiting the children of output level ``level`` at ``coord``; returns
        the mark :meth:`close` gets."""
        return None

    def close(self, lo: Lowering, level: int, mark: ir.Var | None) -> None:
        """After visiting them."""

    def store(self, lo: Lowering, value: ir.Expr | None) -> None:
        """One entry of the last output level, with ``value`` (None: pattern only)."""

    def scatter(self, lo: Lowering, key: ir.Expr, value: ir.Expr | None) -> None:
        """Add ``value`` at workspace ``key``."""

    def drain(self, lo: Lowering, level: int) -> None:
        """The workspace's entries become output levels ``level`` and below."""


class Append(Assembler):
    def __init__(self, lo: Lowering):
        super().__init__(lo)
        self.workspace_kind = "" if lo.s.workspace is None else lo.s.workspace.kind

    def start(self, lo):
        lo.emit(ir.Effect("new_result", (ir.Const(self.rank), ir.Const(self.inserted))))

    def chunks(self, lo, count):
        lo.emit(ir.Effect("chunks", (count,)))

    def chunk(self, lo, chunk):
        lo.emit(ir.Effect("open_chunk", (chunk,)))

    def declare_workspace(self, lo, dims, error):
        super().declare_workspace(lo, dims, error)
        lo.emit(ir.Decl(WS_DIMS, "index", tuple(dims), const=True, shape=(len(dims),)))

    def open(self, lo, level, coord):
        appended = level >= self.inserted
        if appended:
            lo.emit(ir.Effect("append_crd", (ir.Const(level), coord)))
        if level + 1 >= self.rank or not (appended or level + 1 == self.inserted):
            return None
        mark = lo.fresh("m")
        lo.emit(ir.Decl(mark, "size", ir.RuntimeCall("crd_count", (ir.Const(level + 1),)), const=True))
        return mark

    def close(self, lo, level, mark):
        if mark is None:
            return
        now = ir.RuntimeCall("crd_count", (ir.Const(level + 1),))
        count = ir.Effect("append_count", (ir.Const(level + 1), ir.sub(now, mark)))
        if level >= self.inserted:  # an appended parent without children is dropped
            lo.emit(ir.If(ir.eq(now, mark), ir.Block((ir.Effect("drop_crd", (ir.Const(level),)),)),
                          ir.Block((count,))))
        else:
            lo.emit(count)

    def store(self, lo, value):
        lo.emit(ir.Effect("append_val", (value,)))

    def scatter(self, lo, key, value):
        lo.emit(ir.Effect("ws_add", (key, value)))

    def drain(self, lo, level):
        lo.emit(ir.Effect("ws_drain", (ir.Const(level), ir.Const(self.rank), WS_DIMS)))


class _Rows(Assembler):
    """Both phases of a two-phase output: ``row`` is the linear position of the current
    row (the inserted levels' coordinates), ``ROWS`` their number."""

    def __init__(self, lo: Lowering):
        super().__init__(lo)
        inserted = lo.s.output_order[: self.inserted]
        self.row = lo.offset(inserted)
        self.rows = product_of([lo.dim(i) for i in inserted])
        self.cursor: ir.Var | None = None  # the current row's count (first phase) or position (second)


class Count(_Rows):
    values = False
    workspace_kind = "count"

    def start(self, lo):
        lo.emit(ir.Effect("new_result", (ir.Const(self.rank), ir.Const(self.inserted))),
                ir.Effect("keep_arguments"),
                ir.Decl(ROWS, "index", self.rows, const=True),
                ir.Effect("count_rows", (ROWS,)))

    def finish(self, lo):
        r = lo.fresh("r")
        lo.emit(ir.For(ir.Decl(r, "index", ir.Const(0)), ir.lt(r, ROWS), ir.Incr(r), ir.Block((
            ir.Assign(ir.Load(ROW_POS, ir.add(r, 1)), ir.Load(ROW_POS, r), "+="),))))

    def open(self, lo, level, coord):
        if level != self.inserted - 1:
            return None
        self.cursor = lo.fresh("n")
        lo.emit(ir.Decl(self.cursor, "index", ir.Const(0)))
        return self.cursor

    def close(self, lo, level, mark):
        if mark is not None:
            lo.emit(ir.Assign(ir.Load(ROW_POS, ir.add(self.row, 1)), mark))

    def store(self, lo, value):
        lo.emit(ir.Incr(self.cursor))

    def scatter(self, lo, key, value):
        lo.emit(ir.Effect("ws_mark", (key,)))

    def drain(self, lo, level):
        lo.emit(ir.Assign(self.cursor, ir.RuntimeCall("ws_count")))


class Fill(_Rows):
    workspace_kind = "fill"

    def __init__(self, lo: Lowering):
        super().__init__(lo)
        self.last = lo.var(lo.s.output_order[-1])

    def start(self, lo):
        r = lo.fresh("r")
        lo.emit(ir.Effect("read_rows"),
                ir.Decl(ROWS, "index", self.rows, const=True),
                ir.For(ir.Decl(r, "index", ir.Const(0)), ir.le(r, ROWS), ir.Incr(r), ir.Block((
                    ir.Assign(ir.Load(OUT_POS, r), ir.Load(ROW_POS, r)),)), "omp_parallel_for"))

    def open(self, lo, level, coord):
        if level == self.inserted - 1:
            self.cursor = lo.fresh("at")
            lo.emit(ir.Decl(self.cursor, "index", ir.Load(ROW_POS, self.row)))
        return None

    def store(self, lo, value):
        lo.emit(ir.Assign(ir.Load(OUT_CRD, self.cursor), self.last),
                ir.Assign(ir.Load(OUT_VAL, self.cursor), value),
                ir.Incr(self.cursor))

    def scatter(self, lo, key, value):
        lo.emit(ir.Effect("ws_add", (key, value)))

    def drain(self, lo, level):
        lo.emit(ir.Assign(self.cursor, ir.RuntimeCall("ws_drain_row", (self.cursor,)), "+="))


def assembler(lo: Lowering, second_phase: bool = False) -> Assembler:
    """The assembler of the schedule's output: appended, or a two-phase output's first
    (or ``second_phase``) phase."""
    if not lo.s.assembly.two_phase:
        return Append(lo)
    return Fill(lo) if second_phase else Count(lo)
