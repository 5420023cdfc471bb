"""The compiler as ``torch.library`` custom ops, for ``torch.compile``, ``torch.export``
and ``torch.jit.trace``.

A tracer cannot run the planner (Python objects, data-dependent validation, ctypes), so
while tracing, :func:`traced_evaluate` replaces each evaluation of an assignment by
``sparsenn::evaluate(call, tensors)``:

* ``call`` encodes a :class:`CallSpec` (the assignment, each operand's layout — dense, or
  a sparse format and index dtype — the requested format and whose pattern the result
  has), computed once per traced call site from constants only;
* ``tensors`` are the operands' index arrays, values and dense tensors, flattened, and
  ``shapes`` the sparse operands' shapes (symbolic under dynamic shapes).

Its kernel rebuilds the :class:`SparseTensor` s (index arrays validated once per version,
so a module whose pattern buffers were edited raises instead of crashing) and evaluates
as in eager mode; its fake kernel derives the result's shape from the spec; its autograd
formula is ``sparsenn::evaluate_backward``, which runs the compiler's own gradient
expressions (:mod:`..autograd`). A dense result is returned contiguous, a sparse one as
its values on the pattern of operand ``CallSpec.anchor``.
"""

from __future__ import annotations

import base64
import functools
import io
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.tensor import array_version

from ..expression import Statement
from ..notation import Assignment
from .cache import LRUCache
from .evaluate import evaluate

if TYPE_CHECKING:
    from ..program import Program

__all__ = ["CallSpec", "Layout", "derived", "register_kernels", "traced_evaluate", "tracing"]


def tracing() -> bool:
    """Whether a tracer (``torch.compile``/``torch.export`` or ``torch.jit.trace``) is
    recording the current call."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


@dataclass(frozen=True)
class Layout:
    """A sparse operand's structure, all but its shape and arrays: ``shares`` is the
    earlier operand whose index arrays it uses (then only its values are passed), or None."""

    format: Format
    index_dtype: torch.dtype
    shares: int | None = None

    @property
    def num_arrays(self) -> int:
        """Index arrays passed for it: one per ``pos``/``crd`` its levels store."""
        if self.shares is not None:
            return 0
        return sum(int(level.has_pos) + int(level.has_crd) for level in self.format.levels)


@dataclass(frozen=True)
class CallSpec:
    """One traced evaluation: ``assignment`` (or a compiled expression's ``Statement``,
    run as its staged program) over operands of ``layouts`` (None: dense),
    ``out_format`` requested; the result is dense when ``anchor`` is None, else values
    on operand ``anchor``'s pattern."""

    assignment: Assignment | Statement
    layouts: tuple[Layout | None, ...]
    out_format: object
    anchor: int | None

    def program(self) -> Program:
        """The stages of a statement for these layouts' formats."""
        from ..program import stage  # program -> autograd -> this module

        return stage(self.assignment, tuple(None if lay is None else lay.format for lay in self.layouts),
                     self.out_format)

    def run(self, operands: Sequence):
        if isinstance(self.assignment, Statement):
            from ..program import run

            return run(self.program(), operands)
        return evaluate(self.assignment, operands, self.out_format)

    def encode(self) -> str:
        return "sparsenn-call:" + base64.b64encode(pickle.dumps(self)).decode("ascii")


_SPEC_MODULES = frozenset({"sparsenn.compiler.notation", "sparsenn.compiler.expression", "sparsenn.formats.format",
                           "sparsenn.formats.level", __name__})
_SPEC_BUILTINS = frozenset({("torch", "float32"), ("torch", "float64"), ("torch", "int32"), ("torch", "int64"),
                            ("builtins", "frozenset"), ("builtins", "set")})


class _SpecUnpickler(pickle.Unpickler):
    """Rebuilds only the plain data classes of a call (notation, formats, this module's)
    and torch dtypes: a call string comes from a traced or exported program, which must
    not run arbitrary code (or build a kernel) when loaded."""

    def find_class(self, module: str, name: str):
        if (module, name) in _SPEC_BUILTINS:
            return super().find_class(module, name)
        found = super().find_class(module, name) if module in _SPEC_MODULES else None
        if not isinstance(found, type):
            raise pickle.UnpicklingError(f"sparsenn call strings cannot reference {module}.{name}")
        return found


@functools.lru_cache(maxsize=1024)
def decode(call: str) -> CallSpec:
    """The :class:`CallSpec` a ``sparsenn::evaluate`` call string encodes."""
    prefix = "sparsenn-call:"
    if not isinstance(call, str) or not call.startswith(prefix):
        raise ValueError(f"not a sparsenn call string: {call!r:.60}")
    spec = _SpecUnpickler(io.BytesIO(base64.b64decode(call[len(prefix):]))).load()
    if not isinstance(spec, CallSpec):
        raise ValueError("a sparsenn call string must encode a CallSpec")
    return spec


_TABLES: dict[str, Callable[..., Assignment]] = {}


def register_kernels(table: str, kernel: Callable[..., Assignment]) -> None:
    """Make ``kernel(*args)`` (an assignment built from constants, e.g. one of a
    function's kernels) nameable as ``("kernel", table, *args)`` by traced code, which
    cannot pass assignments it did not read from a module attribute."""
    _TABLES[table] = kernel


def derived(assignment: Assignment | Statement | None, derive: tuple) -> Assignment | Statement:
    """What a traced call runs, named by constants:

    * ``()``: ``assignment``; ``("program",)``: the statement ``assignment``'s program;
    * ``("einsum", equation, num_operands)``: the parsed equation;
    * ``("reduced",)``, ``("epilogue",)``: the reduction or the epilogue of ``assignment``,
      run apart when training (``autograd._without_epilogue``);
    * ``("kernel", table, *args)``: a kernel of :func:`register_kernels`."""
    from ..autograd import _without_epilogue  # autograd -> this module
    from .api import parse  # api -> this module

    if not derive or derive[0] == "program":
        return assignment
    if derive[0] == "einsum":
        return parse(*derive[1:])
    if derive[0] == "reduced":
        return _without_epilogue(assignment)[0]
    if derive[0] == "epilogue":
        return _without_epilogue(assignment)[1]
    return _TABLES[derive[1]](*derive[2:])


@torch.compiler.assume_constant_result
def _encoded(assignment: Assignment | None, derive: tuple, out_format, *fields) -> tuple[str, int | None]:
    """The call string and anchor of the assignment ``derived(assignment, derive)`` (or
    of a statement's program) over
    operands described by ``fields``: three per operand, ``format, index_dtype, shares``
    (a None format: dense). Constant per call site: the tracer runs it once and
    records the string (it passes frozen dataclasses only as separate arguments read
    from module attributes, hence the flat fields and ``derive``)."""
    layouts = tuple(None if fields[k] is None else Layout(*fields[k:k + 3]) for k in range(0, len(fields), 3))
    target = derived(assignment, derive)
    if isinstance(target, Statement):
        anchor = _statement_anchor(target, layouts, out_format)
    else:
        anchor = _anchor(target, layouts)
    spec = CallSpec(target, layouts, out_format, anchor)
    return spec.encode(), spec.anchor


def _statement_anchor(statement: Statement, layouts: tuple[Layout | None, ...], out_format) -> int | None:
    """A masked statement's result has its mask's pattern; others must be dense."""
    if statement.mask is not None:
        return statement.operands.index(statement.mask)
    spec = CallSpec(statement, layouts, out_format, None)
    if _result_format(spec.program(), [None if lay is None else lay.format for lay in layouts]) is not None:
        raise NotImplementedError(
            "sparsenn: a traced compiled expression must have a dense result or an output mask (P<S>[...] = ...); "
            f"{statement.output}[...] would be sparse with a pattern computed from the data")
    return None


def _result_format(program: Program, formats: list[Format | None]) -> Format | None:
    """The format of a program's result (None: dense), stage by stage as evaluation
    decides it: the requested ``out_format``, else inferred from the inputs' formats."""
    from ..plan.infer import result_format
    from ..program import UserOperand

    results: list[Format | None] = []
    for step in program.stages:
        inputs = [formats[s.n] if isinstance(s, UserOperand) else results[s.stage] for s in step.inputs]
        if step.out_format == "dense":
            results.append(None)
        elif isinstance(step.out_format, Format):
            results.append(step.out_format)
        else:
            results.append(result_format(step.assignment, inputs))
    return results[-1]


def _anchor(assignment: Assignment, layouts: tuple[Layout | None, ...]) -> int | None:
    """The operand whose pattern a sparse result takes: the first sparse one read at
    exactly the output's indices (a sampled product, an elementwise map), None when no
    operand is (the result is then dense, or assembled — which tracing cannot express,
    see :func:`_check_result`)."""
    for access in assignment.accesses:
        layout = layouts[access.operand]
        if layout is not None and access.indices == assignment.output:
            return access.operand if layout.shares is None else layout.shares
    return None


def _describe(operands: Sequence) -> list:
    """The operands' fields of the call string (constants only: traced code reads the
    layout of a SparseTensor, never its arrays' contents)."""
    parts: list[tuple] = []
    for n, op in enumerate(operands):
        if not isinstance(op, SparseTensor):
            parts.append((None, None, None))
            continue
        shares = None
        for m in range(n):
            other = operands[m]
            if isinstance(other, SparseTensor) and other.format == op.format and all(
                    (a is None and b is None) or a is b for a, b in zip(op.pos + op.crd, other.pos + other.crd)):
                shares = m if parts[m][2] is None else parts[m][2]
                break
        parts.append((op.format, op.index_dtype, shares))
    return [field for part in parts for field in part]


def _flatten(operands: Sequence, shares: Sequence[int | None]) -> list[Tensor]:
    """A dense operand; a sparse one's index arrays (unless it ``shares`` an earlier
    one's) and values."""
    tensors: list[Tensor] = []
    for op, shared in zip(operands, shares):
        if not isinstance(op, SparseTensor):
            tensors.append(op)
            continue
        if shared is None:
            tensors += [a for a in op.pos + op.crd if a is not None]
        tensors.append(op.values)
    return tensors


def _differentiable_slots(spec: CallSpec) -> list[int]:
    """Position in the flattened tensors of each operand's values or dense tensor."""
    slots, at = [], 0
    for layout in spec.layouts:
        at += 0 if layout is None else layout.num_arrays
        slots.append(at)
        at += 1
    return slots


_patterns: LRUCache[SparseTensor] = LRUCache("traced patterns", 256)


def _shapes(operands: Sequence) -> list[int]:
    """The sparse operands' shapes, concatenated."""
    return [n for op in operands if isinstance(op, SparseTensor) for n in op.shape]


def _split_shapes(spec: CallSpec, shapes: Sequence[int]) -> list[tuple[int, ...] | None]:
    """Per operand, its shape from ``shapes`` if sparse, else None."""
    split, at = [], 0
    for layout in spec.layouts:
        rank = None if layout is None else layout.format.rank
        split.append(None if rank is None else tuple(shapes[at:at + rank]))
        at += rank or 0
    return split


def _rebuild(spec: CallSpec, tensors: Sequence[Tensor], shapes: Sequence[int]) -> list:
    """The operands of a call from its flattened tensors. A pattern is validated the
    first time its arrays (identity and version) are seen; the cache keeps those arrays
    alive, so an address cannot be reused by other contents while the entry exists."""
    operands: list = []
    at = 0
    for layout, shape in zip(spec.layouts, _split_shapes(spec, shapes)):
        if layout is None:
            operands.append(tensors[at])
            at += 1
            continue
        if layout.shares is not None:
            operands.append(operands[layout.shares].with_values(tensors[at]))
            at += 1
            continue
        arrays = tuple(tensors[at:at + layout.num_arrays])
        values = tensors[at + layout.num_arrays]
        at += layout.num_arrays + 1
        key = (layout.format, shape, tuple(array_version(a) for a in arrays), tuple(a.dtype for a in arrays))
        pattern = _patterns.get(key)
        if pattern is None:
            pos, crd = _levels(layout.format, arrays)
            pattern = SparseTensor(shape, layout.format, pos, crd, values)
            _patterns.put(key, pattern)
        operands.append(pattern.with_values(values))
    return operands


def _levels(fmt: Format, arrays: Sequence[Tensor]) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
    """``pos`` and ``crd`` per storage level from the arrays :func:`_flatten` passed."""
    present = iter(arrays)
    pos = tuple(next(present) if level.has_pos else None for level in fmt.levels)
    crd = tuple(next(present) if level.has_crd else None for level in fmt.levels)
    return pos, crd


def _check_result(spec: CallSpec, operands: Sequence, result) -> Tensor:
    """The op's output: the dense result, or the values of a result on the anchor's pattern."""
    if spec.anchor is None:
        if isinstance(result, SparseTensor):
            raise NotImplementedError(
                f"sparsenn: {spec.assignment} has a sparse result whose pattern is computed from the data; "
                "torch.compile / torch.export / torch.jit.trace can only record sparse results sampled on an "
                "operand's pattern (ask for out_format='dense', or run this call eagerly)")
        return result.contiguous()
    anchor = operands[spec.anchor]
    if not isinstance(result, SparseTensor) or any(
            not (a is b or (a is not None and b is not None and torch.equal(a, b)))
            for a, b in zip(result.pos + result.crd, anchor.pos + anchor.crd)):
        raise NotImplementedError(
            f"sparsenn: the result of {spec.assignment} does not have the pattern of operand {spec.anchor}; "
            "traced programs can only record sparse results sampled on an operand's pattern")
    return result.values


# Defined with the low-level API: torch.library.custom_op's Python wrappers cost about
# 10 µs per call, a third of a small layer's own overhead.
_library = torch.library.Library("sparsenn", "FRAGMENT")
_library.define("evaluate(str call, Tensor[] tensors, SymInt[] shapes) -> Tensor")
_library.define("evaluate_backward(str call, Tensor[] tensors, SymInt[] shapes, Tensor grad, Tensor result, "
                "bool[] needed) -> Tensor[]")


def evaluate_op(call: str, tensors: list[Tensor], shapes: list[int]) -> Tensor:
    """``evaluate(assignment, operands, out_format)`` of the encoded call."""
    spec = decode(call)
    operands = _rebuild(spec, tensors, shapes)
    return _check_result(spec, operands, spec.run(operands))


def _evaluate_fake(call: str, tensors: list[Tensor], shapes: list[int]) -> Tensor:
    spec = decode(call)
    slots = _differentiable_slots(spec)
    dtype = tensors[slots[0]].dtype
    if spec.anchor is not None:
        return tensors[slots[spec.anchor]].new_empty(tensors[slots[spec.anchor]].shape, dtype=dtype)
    sizes = {}
    sparse_shapes = _split_shapes(spec, shapes)
    for operand, indices in _user_accesses(spec):
        shape = sparse_shapes[operand]
        sizes.update(zip(indices, tensors[slots[operand]].shape if shape is None else shape))
    output = spec.assignment.indices if isinstance(spec.assignment, Statement) else spec.assignment.output
    return tensors[slots[0]].new_empty([sizes[i] for i in output], dtype=dtype)


def _user_accesses(spec: CallSpec) -> list[tuple[int, tuple[str, ...]]]:
    """``(operand, indices)`` of every read of a call's operands."""
    if not isinstance(spec.assignment, Statement):
        return [(a.operand, a.indices) for a in spec.assignment.accesses]
    from ..program import UserOperand

    reads = []
    for step in spec.program().stages:
        for access in step.assignment.accesses:
            source = step.inputs[access.operand]
            if isinstance(source, UserOperand):
                reads.append((source.n, access.indices))
    return reads


def evaluate_backward_op(call: str, tensors: list[Tensor], shapes: list[int], grad: Tensor, result: Tensor,
                         needed: list[bool]) -> list[Tensor]:
    """The gradients of the encoded call with respect to each operand ``needed`` (its
    values, or the dense tensor), from the compiler's gradient expressions."""
    from ..autograd import operand_gradients

    spec = decode(call)
    operands = _rebuild(spec, tensors, shapes)
    grad_out = grad.contiguous() if spec.anchor is None else operands[spec.anchor].with_values(grad.contiguous())
    if spec.anchor is not None:
        result = operands[spec.anchor].with_values(result)
    wanted = [n for n, need in enumerate(needed) if need]
    if isinstance(spec.assignment, Statement):
        grads = _program_gradients(spec, operands, grad_out, wanted)
    else:
        grads = operand_gradients(spec.assignment, operands, spec.out_format, grad_out, result, wanted)
    slots = _differentiable_slots(spec)
    return [torch.zeros(tensors[slots[n]].shape, dtype=tensors[slots[n]].dtype) if g is None else g.contiguous()
            for g, n in zip(grads, wanted)]


def _evaluate_backward_fake(call: str, tensors: list[Tensor], shapes: list[int], grad: Tensor, result: Tensor,
                            needed: list[bool]) -> list[Tensor]:
    slots = _differentiable_slots(decode(call))
    return [tensors[slots[n]].new_empty(tensors[slots[n]].shape) for n, need in enumerate(needed) if need]


_autograd_thread: ThreadPoolExecutor | None = None


def _program_gradients(spec: CallSpec, operands: list, grad_out, wanted: list[int]) -> list:
    """A staged program's gradients, recorded by torch's autograd as in eager mode on a
    thread of its own: an op's kernel runs below autograd, and that state is per thread."""
    global _autograd_thread

    def gradients():
        leaves = [op.values if isinstance(op, SparseTensor) else op for op in operands]
        leaves = [leaf.detach().requires_grad_(n in wanted) for n, leaf in enumerate(leaves)]
        rebuilt = [op.with_values(leaf) if isinstance(op, SparseTensor) else leaf for op, leaf in zip(operands, leaves)]
        out = spec.run(rebuilt)
        out, grad = (out.values, grad_out.values) if isinstance(out, SparseTensor) else (out, grad_out)
        return torch.autograd.grad(out, [leaves[n] for n in wanted], grad, allow_unused=True)

    if _autograd_thread is None:
        _autograd_thread = ThreadPoolExecutor(1, thread_name_prefix="sparsenn-autograd")
    return list(_autograd_thread.submit(gradients).result())


def _setup_context(ctx, inputs, output) -> None:
    call, tensors, shapes = inputs
    slots = _differentiable_slots(decode(call))
    ctx.call, ctx.shapes = call, shapes
    ctx.slots = slots
    ctx.needed = [tensors[slot].requires_grad for slot in slots]
    ctx.save_for_backward(*tensors, output)


def _backward(ctx, grad: Tensor):
    *tensors, output = ctx.saved_tensors
    grads: list[Tensor | None] = [None] * len(tensors)
    if any(ctx.needed):
        computed = iter(torch.ops.sparsenn.evaluate_backward(ctx.call, list(tensors), ctx.shapes, grad, output,
                                                             ctx.needed))
        for slot, need in zip(ctx.slots, ctx.needed):
            if need:
                grads[slot] = next(computed)
    return None, grads, None


_library.impl("evaluate", evaluate_op, "CPU")
_library.impl("evaluate_backward", evaluate_backward_op, "CPU")
torch.library.register_fake("sparsenn::evaluate", _evaluate_fake, lib=_library)
torch.library.register_fake("sparsenn::evaluate_backward", _evaluate_backward_fake, lib=_library)
torch.library.register_autograd("sparsenn::evaluate", _backward, setup_context=_setup_context, lib=_library)


def traced_evaluate(assignment: Assignment | None, operands: Sequence, out_format, derive: tuple = ()):
    """``evaluate(derived(assignment, derive), operands, out_format)`` as one
    ``sparsenn::evaluate`` op (differentiable through ``sparsenn::evaluate_backward``); a
    sparse result keeps the anchor operand's pattern."""
    fields = _describe(operands)
    call, anchor = _encoded(assignment, derive, out_format, *fields)
    result = torch.ops.sparsenn.evaluate(call, _flatten(operands, fields[2::3]), _shapes(operands))
    if anchor is None:
        return result
    pattern = operands[anchor]
    return pattern._share(pattern.shape, pattern.format, result)  # the op's values: no checks to trace
