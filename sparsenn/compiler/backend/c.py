"""The C++ printer: loop IR (:mod:`..loops.ir`) to the statements of a kernel function.

This is the only place that spells the kernel's array names (``s0_crd1``, ``d2``,
``out``), the runtime helpers (``sn_load``, ``sn_hsum``, ``sn_prefetch``,
``sn_balanced_bound``), the assembly runtime's objects and methods (``Result``,
``Chunk``, the workspaces, ``IndexOut``: see ``runtime/sparsenn_assembly.h``) and the
pragmas; the prelude and entry points around the printed statements come from
:mod:`.codegen`.

Arrays of 16-bit values (``stored``: their kinds, see :mod:`.precision`) are read
through ``sn_widen`` and written through ``sn_narrow`` (rounding once); vector loads
and stores convert by their pointer's type.
"""

from __future__ import annotations

import math

from ..loops import ir

__all__ = ["print_block", "print_expr", "array_name"]

_TYPES = {"int": "int", "index": "int64_t", "I": "I", "V": "V", "VV": "VV", "bool": "bool", "size": "size_t",
          "lanes": "sn_lane_mask"}

# Binary operators by precedence (higher binds tighter).
_PRECEDENCE = {"*": 6, "/": 6, "%": 6, "+": 5, "-": 5, "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 3, "!=": 3,
               "&&": 2, "||": 1}
_ATOM = 10
_INT64_MAX = (1 << 63) - 1

_EFFECTS = {
    "hsums": "sn_hsums({0}, {1});",
    "new_result": "Result* res = new Result({0}, {1});\n*handle = res;",
    "keep_arguments": "res->arrays = arrays;\nres->dims = dims;",
    "count_rows": "res->pos.assign({0} + 1, 0);\nint64_t* __restrict__ sn_pos = res->pos.data();",
    "read_rows": "const int64_t* __restrict__ sn_pos = res->pos.data();\nconst IndexOut sn_out_pos{{out[0], wide}};\n"
                 "const IndexOut sn_out_crd{{out[1], wide}};\nS* __restrict__ sn_out_val = (S*)out[2];",
    "chunks": "res->chunks.resize({0});",
    "open_chunk": "Chunk& C = res->chunks[{0}];\nC.init(res->rank);",
    "append_crd": "C.crd[{0}].push_back({1});",
    "drop_crd": "C.crd[{0}].pop_back();",
    "append_count": "C.cnt[{0}].push_back((int64_t)({1}));",
    "append_val": "C.val.push_back({0});",
    "declare_workspace": "{0} ws;",
    "init_workspace": "ws.init({0});",
    "ws_add": "ws.add({0}, {1});",
    "ws_mark": "ws.mark({0});",
    "ws_drain": "ws.drain(C, {0}, {1}, {2});",
    "declare_pack": "V* __restrict__ {0} = sn_scratch<{1}>({2});",
    "transpose_block": "sn_transpose_block({0}, {1}, {2}, {3});",
    "run_stage": "sn_stage{0}(sn_at, arrays, dims, nthreads);",
}
_RUNTIME_CALLS = {
    "crd_count": "C.crd[{0}].size()",
    "ws_count": "ws.count()",
    "ws_drain_row": "ws.drain(sn_out_crd, {0}, sn_out_val + {0})",
}
_WORKSPACES = {"dense": "DenseWS", "sparse": "SparseWS", "count": "CountWS", "fill": "FillWS"}
# Arrays of run-time index width (int32 or int64, as the caller allocated them).
_INDEX_OUTPUTS = ("out_pos", "out_crd")

_CALLS = {"abs": "std::abs", "hsum": "sn_hsum", "first_lanes": "sn_first_lanes", "balanced_bound": "sn_balanced_bound", "splat": "sn_splat",
          "vmax": "sn_vmax", "vmin": "sn_vmin", "hmax": "sn_hmax", "hmin": "sn_hmin"}


def array_name(array: ir.Array) -> str:
    """The C++ name of a kernel array."""
    if array.kind in ("pos", "crd"):
        return f"s{array.slot}_{array.kind}{array.level}"
    if array.kind == "val":
        return f"s{array.slot}_val"
    if array.kind == "dense":
        return f"d{array.slot}"
    if array.kind == "out":  # a fused kernel's stage outputs are numbered
        return "out" if array.slot < 0 else f"out{array.slot}"
    if array.kind == "pack":
        return f"pack{array.slot}"
    if array.kind in ("dims", "out_val"):
        return "dims" if array.kind == "dims" else "sn_out_val"
    if array.kind == "row_pos":
        return "sn_pos"
    if array.kind in _INDEX_OUTPUTS:
        return f"sn_{array.kind}"
    raise ValueError(f"unknown array kind {array.kind!r}")


def _arg(arg: ir.Expr | ir.Array | str, stored: frozenset[str]) -> str:
    if isinstance(arg, str):
        return _WORKSPACES[arg]
    return array_name(arg) if isinstance(arg, ir.Array) else print_expr(arg, stored)


def _expr(e: ir.Expr, stored: frozenset[str]) -> tuple[str, int]:
    """(text, precedence) of ``e``, reading the arrays of kinds ``stored`` through ``sn_widen``."""
    if isinstance(e, ir.Var):
        return e.name, _ATOM
    if isinstance(e, ir.Const):
        if isinstance(e.value, float):
            if math.isinf(e.value):
                return f"{'-' if e.value < 0 else ''}std::numeric_limits<V>::infinity()", _ATOM if e.value > 0 else 7
            return f"V({e.value!r})", _ATOM
        if e.value == _INT64_MAX:
            return "INT64_MAX", _ATOM
        return str(e.value), _ATOM if e.value >= 0 else 7
    if isinstance(e, ir.Lanes):
        return "SN_W", _ATOM
    if isinstance(e, ir.VectorZero):
        return "VV{}", _ATOM
    if isinstance(e, ir.Load):
        element = f"{array_name(e.array)}[{print_expr(e.index, stored)}]"
        return (f"sn_widen({element})" if e.array.kind in stored else element), _ATOM
    if isinstance(e, ir.Elem):
        return e.base.name + "".join(f"[{print_expr(i, stored)}]" for i in e.index), _ATOM
    if isinstance(e, ir.Address):
        return _binary("+", ir.Var(array_name(e.array)), e.offset, stored)
    if isinstance(e, ir.Bin):
        return _binary(e.op, e.left, e.right, stored)
    if isinstance(e, ir.Select):
        return f"{_wrap(e.cond, 1, stored)} ? {print_expr(e.then, stored)} : {print_expr(e.other, stored)}", 0
    if isinstance(e, ir.Cast):
        return f"({_TYPES[e.type]}){_wrap(e.operand, _ATOM, stored)}", 7
    if isinstance(e, ir.VectorLoad):
        at = _expr(ir.Address(e.array, e.offset), stored)[0]
        if e.lanes is None:
            return f"sn_load({at})", _ATOM
        return f"sn_load_first({at}, {print_expr(e.lanes, stored)})", _ATOM
    if isinstance(e, ir.Gather):
        base = _expr(ir.Address(e.array, e.offset), stored)[0]
        crd = _expr(ir.Address(e.crd, e.at), stored)[0]
        return f"sn_gather({base}, {crd}, {print_expr(e.stride, stored)})", _ATOM
    if isinstance(e, ir.Call):
        return _call(e, stored), _ATOM
    if isinstance(e, ir.Math):
        return f"sn_{e.function}({', '.join(_arg(a, stored) for a in e.args)})", _ATOM
    if isinstance(e, ir.RuntimeCall):
        return _RUNTIME_CALLS[e.op].format(*(_arg(a, stored) for a in e.args)), _ATOM
    raise TypeError(f"not an expression: {e!r}")


def _call(e: ir.Call, stored: frozenset[str]) -> str:
    args = [_arg(a, stored) for a in e.args]
    if e.name in ("min", "max"):
        return f"sn_i{e.name}({', '.join(args)})"
    if e.name == "lower_bound":
        crd, lo, hi, value = args
        return f"sn_lower_bound({crd} + {lo}, {crd} + {hi}, (I)({value})) - {crd}"
    if e.name == "value_size":
        return "(int64_t)sizeof(S)" if stored else "(int64_t)sizeof(V)"
    if e.name == "index_size":
        return "(int64_t)sizeof(I)"
    return f"{_CALLS[e.name]}({', '.join(args)})"


def _wrap(e: ir.Expr, at_least: int, stored: frozenset[str]) -> str:
    text, prec = _expr(e, stored)
    return text if prec >= at_least else f"({text})"


def _binary(op: str, left: ir.Expr, right: ir.Expr, stored: frozenset[str]) -> tuple[str, int]:
    prec = _PRECEDENCE[op]
    # Left-associative: an equal-precedence right operand keeps its parentheses (so a
    # floating-point product keeps its evaluation order).
    return f"{_wrap(left, prec, stored)} {op} {_wrap(right, prec + 1, stored)}", prec


def print_expr(e: ir.Expr, stored: frozenset[str] = frozenset()) -> str:
    """``e`` in C++; the arrays of kinds ``stored`` hold 16-bit values."""
    return _expr(e, stored)[0]


def _decl(d: ir.Decl, stored: frozenset[str]) -> str:
    shape = "".join(f"[{n if isinstance(n, int) else print_expr(n, stored)}]" for n in d.shape)
    text = f"{'const ' if d.const else ''}{_TYPES[d.type]} {d.var.name}{shape}"
    if d.init is None:
        return text
    if d.init == "zero":
        return text + " = {}"
    if isinstance(d.init, tuple):
        return text + f" = {{{', '.join(print_expr(x, stored) for x in d.init)}}}"
    return text + f" = {print_expr(d.init, stored)}"


def _simple(s: ir.Stmt, stored: frozenset[str]) -> str:
    """A statement without its semicolon (for a for-loop's init and step)."""
    if isinstance(s, ir.Decl):
        return _decl(s, stored)
    if isinstance(s, ir.Assign):
        target, value = s.target, print_expr(s.value, stored)
        if isinstance(target, ir.Load) and target.array.kind in _INDEX_OUTPUTS and s.op == "=":
            return f"{array_name(target.array)}.put({print_expr(target.index, stored)}, {value})"
        if isinstance(target, ir.Load) and target.array.kind in stored:
            if s.op != "=":  # a 16-bit array is written once, never accumulated in (see precision.py)
                raise ValueError(f"internal error: {s.op} into the 16-bit array {array_name(target.array)}")
            return f"{array_name(target.array)}[{print_expr(target.index, stored)}] = sn_narrow({value})"
        return f"{print_expr(target, stored)} {s.op} {value}"
    if isinstance(s, ir.Incr):
        return f"++{s.var.name}"
    raise TypeError(f"not a simple statement: {s!r}")


_PRAGMAS = {
    "simd": "#pragma omp simd",
    "unroll": "#pragma GCC unroll 16",
    "omp_for": "#pragma omp for schedule(dynamic, 1)",
    "omp_parallel_for": "#pragma omp parallel for num_threads(nthreads)",
}
# Lines of a parallel nest above which it is printed once (see ``_Printer.parallel``).
ONE_COPY_LINES = 150
# How an ``omp simd`` reduction combines its lanes, by reduction (the header declares
# the max and min reductions, which keep a NaN as sn_max and sn_min do).
_COMBINERS = {"sum": "+", "max": "sn_max_reduction", "min": "sn_min_reduction"}


class _Printer:
    def __init__(self, depth: int, stored: frozenset[str]):
        self.lines: list[str] = []
        self.depth = depth
        self.stored = stored

    def line(self, text: str) -> None:
        self.lines += ["  " * self.depth + part for part in text.split("\n")]

    def open(self, text: str) -> None:
        self.line(f"{text} {{" if text else "{")
        self.depth += 1

    def close(self, text: str = "}") -> None:
        self.depth -= 1
        self.line(text)

    def body(self, block: ir.Block) -> None:
        for s in block.stmts:
            self.stmt(s)

    def stmt(self, s: ir.Stmt) -> None:
        if isinstance(s, (ir.Decl, ir.Assign, ir.Incr)):
            self.line(_simple(s, self.stored) + ";")
        elif isinstance(s, (ir.VectorStore, ir.Prefetch)):
            at = _expr(ir.Address(s.array, s.offset), self.stored)[0]
            if isinstance(s, ir.VectorStore) and s.lanes is None:
                self.line(f"sn_store({at}, {print_expr(s.value, self.stored)});")
            elif isinstance(s, ir.VectorStore):
                self.line(f"sn_store_first({at}, {print_expr(s.value, self.stored)}, {print_expr(s.lanes, self.stored)});")
            else:
                self.line(f"sn_prefetch({at}, {print_expr(s.size, self.stored)});")
        elif isinstance(s, ir.Effect):
            self.line(_EFFECTS[s.name].format(*(_arg(a, self.stored) for a in s.args)))
        elif isinstance(s, ir.Block):
            if s.scoped:
                self.open("")
                self.body(s)
                self.close()
            else:
                self.body(s)
        elif isinstance(s, ir.If):
            self.open(f"if ({print_expr(s.cond, self.stored)})")
            self.body(s.then)
            if s.other is not None and s.other.stmts:
                self.close("} else {")
                self.depth += 1
                self.body(s.other)
            self.close()
        elif isinstance(s, ir.For):
            if s.pragma == "simd_reduction":
                self.line(f"#pragma omp simd reduction({_COMBINERS[s.combine]}:{s.reduction.name})")
            elif s.pragma is not None:
                self.line(_PRAGMAS[s.pragma])
            init = "" if s.init is None else _simple(s.init, self.stored)
            self.open(f"for ({init}; {print_expr(s.cond, self.stored)}; {_simple(s.step, self.stored)})")
            self.body(s.body)
            self.close()
        elif isinstance(s, ir.While):
            self.open(f"while ({print_expr(s.cond, self.stored)})")
            self.body(s.body)
            self.close()
        elif isinstance(s, ir.Parallel):
            self.parallel(s)
        elif isinstance(s, ir.Team):
            self.line(f"#pragma omp parallel num_threads({print_expr(s.threads, self.stored)})")
            self.open("")
            self.body(s.body)
            self.close()
        elif isinstance(s, ir.Guarded):
            self.open("try")
            self.body(s.body)
            self.close("} catch (const std::bad_alloc&) {")
            self.depth += 1
            self.line(f"sn_fail({s.error.name});")
            self.close()
        elif isinstance(s, ir.Continue):
            self.line("continue;")
        elif isinstance(s, ir.Break):
            self.line("break;")
        elif isinstance(s, ir.Return):
            self.line(f"return {print_expr(s.value, self.stored)};")
        else:
            raise TypeError(f"not a statement: {s!r}")

    def parallel(self, s: ir.Parallel) -> None:
        """A short nest twice: under a team when ``nthreads > 1``, else without one (a
        team of one thread costs about 0.5 µs a call). A nest of more than
        ``ONE_COPY_LINES`` lines once, run by a team of one thread when ``nthreads == 1``:
        a second copy costs more compile time (about 1.5 ms a line at -O3) than the team
        costs a call that large."""
        nest = _Printer(self.depth + 2, self.stored)  # as the team's copy is indented
        nest.body(s.body)
        dedented = [line.removeprefix("  ") for line in nest.lines]  # one level less
        if len(nest.lines) > ONE_COPY_LINES:
            self.line("#pragma omp parallel num_threads(nthreads) if(nthreads > 1)")
            self.open("")
            self.lines += dedented
            self.close()
            return
        self.open("if (nthreads > 1)")
        self.line("#pragma omp parallel num_threads(nthreads)")
        self.open("")
        self.lines += nest.lines
        self.close()
        self.close("} else {")
        self.lines += dedented
        self.line("}")


def print_block(block: ir.Block, depth: int = 2, stored: frozenset[str] = frozenset()) -> str:
    """The C++ statements of ``block`` (its own braces left out), indented ``depth``;
    the arrays of kinds ``stored`` hold 16-bit values."""
    printer = _Printer(depth, stored)
    printer.body(block)
    return "\n".join(printer.lines)
