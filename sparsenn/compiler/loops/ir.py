"""The loop IR: frozen nodes for the C++ kernels the lowerer builds.

Expressions are values (``Var``, ``Const``, ``Load`` of a typed array, ``Bin``,
``Call``...); statements are declarations, assignments, stores, loops, conditionals and
blocks. Arrays are named by *what* they are (``Array("crd", slot=0, level=1)``, the
output, a workspace), never by their C++ spelling: :mod:`..backend.c` is the only place
that spells them, and the helpers and pragmas. Local variables carry the names the
lowerer chose (``i0``, ``q3``), unique within a kernel.

Scalar types: ``"int"`` (a C ``int`` counter), ``"index"`` (``int64_t``), ``"I"`` (the
kernel's stored index type), ``"V"`` (its value type), ``"VV"`` (a SIMD vector of V),
``"bool"``, ``"size"`` (``size_t``).

A sparse output is assembled through the runtime of ``sparsenn_assembly.h``: the
kernel's result, the current chunk's level buffers and the thread's workspace are
reached through :class:`Effect` statements and :class:`RuntimeCall` expressions whose
operations are listed in :data:`EFFECTS` and :data:`RUNTIME_CALLS`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Expr", "Stmt", "Var", "Const", "Lanes", "VectorZero", "Array", "Load", "Address", "Bin", "Select", "Cast",
    "Call", "Math", "RuntimeCall", "VectorLoad", "Gather", "Elem", "Decl", "Assign", "Incr", "VectorStore", "Prefetch", "Effect",
    "If", "For", "While", "Block", "Parallel", "Team", "Guarded", "Continue", "Break", "Return", "EFFECTS",
    "RUNTIME_CALLS", "WORKSPACES", "add", "sub", "mul", "lt", "le", "eq", "and_", "or_", "min_", "max_",
    "c",
]

# Operations of :class:`Effect` (statements), with their arguments.
EFFECTS = {
    "hsums": "(acc, out): out[r] = the lanes of acc[r][:] summed, by a transpose-and-add",
    "new_result": "(rank, inserted): the kernel's result under assembly, handed back through handle",
    "keep_arguments": "(): a two-phase result keeps the kernel's arrays and dims for its second phase",
    "count_rows": "(rows): a two-phase result's row_pos gets rows + 1 zeros (row r counts into r + 1)",
    "read_rows": "(): the second phase reads row_pos and writes out_pos, out_crd, out_val",
    "chunks": "(n): the result gets n chunks of level buffers",
    "open_chunk": "(c): chunk c (emptied) takes what the following statements append",
    "append_crd": "(level, x): coordinate x appended to the chunk's level",
    "drop_crd": "(level): the chunk's last coordinate of level dropped (it got no children)",
    "append_count": "(level, n): n children of the last parent appended to the chunk's level",
    "append_val": "(v): value v appended to the chunk",
    "declare_workspace": "(kind): the thread's workspace, a WORKSPACES kind, over no keys yet",
    "init_workspace": "(size): the workspace over keys [0, size)",
    "ws_add": "(key, v): v added at key",
    "ws_mark": "(key): key marked present in the current row (pattern only)",
    "declare_pack": "(pack, id, n): pack, the thread's buffer number id of at least n values V, kept across calls",
    "transpose_block": "(src, src_stride, dst, dst_stride): the lanes x lanes block at address src (rows src_stride "
                       "values apart) transposed into address dst (rows dst_stride apart)",
    "run_stage": "(k): stage k of a fused kernel printed apart, at team coordinate sn_at (its own function)",
    "ws_drain": "(level, rank, dims): the workspace's entries, in key order, appended to the chunk as output "
                "levels level.. rank - 1 (keys linear over dims); the workspace is left empty",
}
# Operations of :class:`RuntimeCall` (expressions that read or change the runtime's state).
RUNTIME_CALLS = {
    "crd_count": "(level): number of coordinates in the chunk's level",
    "ws_count": "(): number of keys marked in the current row; starts the next row",
    "ws_drain_row": "(at): the row's keys in order into out_crd, their sums into out_val, from position at; "
                    "returns their number and starts the next row",
}
# Workspace kinds: "dense" and "sparse" accumulate a row's (key, value) pairs for
# appended chunks; "count" and "fill" count, then write, a two-phase output's rows.
WORKSPACES = ("dense", "sparse", "count", "fill")


class Expr:
    """An expression node (frozen dataclasses below)."""


class Stmt:
    """A statement node (frozen dataclasses below)."""


@dataclass(frozen=True)
class Var(Expr):
    name: str


@dataclass(frozen=True)
class Const(Expr):
    """An integer or a floating-point constant (printed as ``V(x)``)."""

    value: int | float


@dataclass(frozen=True)
class Lanes(Expr):
    """The number of V lanes of a SIMD vector (a compile-time constant of the kernel)."""


@dataclass(frozen=True)
class VectorZero(Expr):
    """A SIMD vector of zeros."""


@dataclass(frozen=True)
class Array:
    """A kernel array: an operand slot's ``pos``/``crd`` of storage level ``level``,
    its ``val``ues, a dense operand (``dense``), the dense output (``out``), a dense
    factor's packed panel (``pack``, values V), the extents of the index variables
    (``dims``); for a two-phase sparse output, each
    row's first position (``row_pos``, int64, counted by the first phase) and the
    caller's ``out_pos``, ``out_crd`` (of run-time index width) and ``out_val``."""

    kind: str
    slot: int = -1
    level: int = -1


@dataclass(frozen=True)
class Load(Expr):
    array: Array
    index: Expr


@dataclass(frozen=True)
class Address(Expr):
    """``array + offset``: a pointer into an array."""

    array: Array
    offset: Expr


@dataclass(frozen=True)
class Bin(Expr):
    """``left op right`` for op in ``+ - * / % < <= > >= == != && ||``."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Select(Expr):
    """``cond ? then : other``."""

    cond: Expr
    then: Expr
    other: Expr


@dataclass(frozen=True)
class Cast(Expr):
    type: str
    operand: Expr


@dataclass(frozen=True)
class Call(Expr):
    """A pure helper: ``min``/``max`` (any number of arguments, int64), ``abs``,
    ``lower_bound(array, lo, hi, value)`` (the first position in ``[lo, hi)`` whose
    coordinate is not below ``value``), ``hsum(vector)`` (sum of its lanes),
    ``balanced_bound(pos, extent, work)``, ``value_size`` (bytes of one V), ``index_size`` (of one I),
    ``first_lanes(n)`` (the mask of a vector's first ``n`` lanes, ``n`` clamped to
    ``[0, lanes]``; a ``lanes`` variable)."""

    name: str
    args: tuple[Expr | Array, ...]


@dataclass(frozen=True)
class Math(Expr):
    """A scalar function of values (V), one of :data:`sparsenn.compiler.frontend.functions.FUNCTIONS`
    other than arithmetic (printed as its runtime helper ``sn_<function>``)."""

    function: str
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class RuntimeCall(Expr):
    """A call into the assembly runtime that returns a value (see :data:`RUNTIME_CALLS`):
    it reads or changes the runtime's state, so it is never folded, dropped or moved."""

    op: str
    args: tuple[Expr, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in RUNTIME_CALLS:
            raise ValueError(f"unknown runtime call {self.op!r}")


@dataclass(frozen=True)
class VectorLoad(Expr):
    """The SIMD vector of ``array`` starting at ``offset``; with ``lanes`` (a lane mask,
    ``first_lanes(n)``), only those lanes (the others zero; nothing past them is read)."""

    array: Array
    offset: Expr
    lanes: Expr | None = None


@dataclass(frozen=True)
class Gather(Expr):
    """The SIMD vector of ``array`` at ``offset + crd[at + l] * stride`` for each lane
    ``l`` (the elements a vector of stored coordinates picks)."""

    array: Array
    offset: Expr
    crd: Array
    at: Expr
    stride: Expr


@dataclass(frozen=True)
class Elem(Expr):
    """Element ``index`` of a local array variable (``index`` may be a tuple)."""

    base: Var
    index: tuple[Expr, ...]


@dataclass(frozen=True)
class Decl(Stmt):
    """``type var[shape] = init``: ``init`` an Expr, a tuple of them (an initialiser
    list), ``"zero"`` (``{}``) or None (uninitialised)."""

    var: Var
    type: str
    init: Expr | tuple[Expr, ...] | str | None = None
    const: bool = False
    shape: tuple[int | Expr, ...] = ()


@dataclass(frozen=True)
class Assign(Stmt):
    """``target op value`` with op ``=`` or ``+=``; target a Var, Elem or Load."""

    target: Expr
    value: Expr
    op: str = "="


@dataclass(frozen=True)
class Incr(Stmt):
    """``++var``."""

    var: Var


@dataclass(frozen=True)
class VectorStore(Stmt):
    """Store SIMD vector ``value`` at ``array + offset``; with ``lanes`` (a lane mask),
    only those lanes."""

    array: Array
    offset: Expr
    value: Expr
    lanes: Expr | None = None


@dataclass(frozen=True)
class Prefetch(Stmt):
    """Bring ``size`` bytes from ``array + offset`` towards the core."""

    array: Array
    offset: Expr
    size: Expr


@dataclass(frozen=True)
class Effect(Stmt):
    """A runtime call for its effect (see :data:`EFFECTS`)."""

    name: str
    args: tuple[Expr | Array | str, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in EFFECTS:
            raise ValueError(f"unknown effect {self.name!r}")


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: Block
    other: Block | None = None


@dataclass(frozen=True)
class For(Stmt):
    """``for (init; cond; step) body``. ``init`` None continues a declared variable.
    ``pragma``: ``simd``, ``simd_reduction`` (of ``reduction``, combined by ``combine``:
    ``sum``, ``max`` or ``min``), ``unroll`` (GCC unroll 16), ``omp_for`` (a dynamic,
    one-iteration OpenMP work-sharing loop) or None."""

    init: Stmt | None
    cond: Expr
    step: Stmt
    body: Block
    pragma: str | None = None
    reduction: Var | None = None
    combine: str = "sum"


@dataclass(frozen=True)
class While(Stmt):
    cond: Expr
    body: Block


@dataclass(frozen=True)
class Block(Stmt):
    """Statements in order; ``scoped`` prints braces (a C++ scope)."""

    stmts: tuple[Stmt, ...] = ()
    scoped: bool = True


@dataclass(frozen=True)
class Parallel(Stmt):
    """``body`` run by a team of ``nthreads`` OpenMP threads when ``nthreads > 1``;
    one thread runs a short body without a team (its ``omp for`` then runs every
    iteration; a team of one costs about 0.5 µs a call) and a long one in a team of
    one (one copy to compile; see ``backend.c``)."""

    body: Block


@dataclass(frozen=True)
class Team(Stmt):
    """``body`` run by every thread of an OpenMP team of ``threads`` threads."""

    body: Block
    threads: Expr


@dataclass(frozen=True)
class Guarded(Stmt):
    """``body``, where running out of memory sets the flag ``error`` (atomically) and
    leaves the rest of ``body``: no exception crosses a thread team."""

    body: Block
    error: Var


@dataclass(frozen=True)
class Continue(Stmt):
    """Next iteration of the innermost loop."""


@dataclass(frozen=True)
class Break(Stmt):
    """Leave the innermost loop."""


@dataclass(frozen=True)
class Return(Stmt):
    """Leave the kernel function with ``value``."""

    value: Expr


# -- builders: the lowerer writes arithmetic through these, with plain ints as constants


def c(value: int | float | Expr) -> Expr:
    return value if isinstance(value, Expr) else Const(value)


def add(a, b) -> Expr:
    return Bin("+", c(a), c(b))


def sub(a, b) -> Expr:
    return Bin("-", c(a), c(b))


def mul(a, b) -> Expr:
    return Bin("*", c(a), c(b))


def lt(a, b) -> Expr:
    return Bin("<", c(a), c(b))


def le(a, b) -> Expr:
    return Bin("<=", c(a), c(b))


def eq(a, b) -> Expr:
    return Bin("==", c(a), c(b))


def and_(*terms: Expr) -> Expr:
    out = terms[0]
    for t in terms[1:]:
        out = Bin("&&", out, t)
    return out


def or_(*terms: Expr) -> Expr:
    out = terms[0]
    for t in terms[1:]:
        out = Bin("||", out, t)
    return out


def min_(*args) -> Expr:
    return Call("min", tuple(c(a) for a in args))


def max_(*args) -> Expr:
    return Call("max", tuple(c(a) for a in args))

