"""The compiler as ``torch.library`` custom ops, for ``torch.compile``, ``torch.export``
and ``torch.jit.trace``.

A tracer cannot run the planner (Python objects, data-dependent validation, ctypes), so
while tracing, :func:`traced_evaluate` replaces each evaluation of an assignment by
``sparsenn::evaluate(call, tensors, shapes, order)``:

* ``call`` encodes a :class:`CallSpec` (the assignment, each operand's layout — dense, or
  a sparse format and index dtype — the requested format and whose pattern the result
  has), computed once per traced call site from constants only;
* ``tensors`` are the operands' index arrays, values and dense tensors, flattened, and
  ``shapes`` the sparse operands' shapes (symbolic under dynamic shapes);
* ``order`` is the dense result's memory layout, its dimensions from outermost to
  innermost (empty: contiguous): the layout the planned kernel writes, found at trace time
  when the shapes are static (:func:`planned_layouts`), so the result is handed on as the
  kernel wrote it (a ``SparseLinear`` writes feature-major) instead of being copied. A
  dense operand stored otherwise than the kernel reads it is re-laid out by torch ops in
  the traced graph (where inductor transposes it with a tiled kernel, or writes it so
  where it is produced) rather than copied by the op.

Its kernel rebuilds the :class:`SparseTensor` s (index arrays validated once per version,
so a module whose pattern buffers were edited raises instead of crashing) and evaluates
as in eager mode (a repeated call is replayed: :mod:`.replay`), returning a dense result in ``order`` (copied only if the kernel wrote
another layout); its fake kernel derives the result's shape from the spec and its strides
from ``order``; its autograd formula is ``sparsenn::evaluate_backward``, which runs the
compiler's own gradient expressions (:mod:`..autograd`). A sparse result is returned as
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
from torch.fx.experimental.symbolic_shapes import has_static_value

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.tensor import array_version

from ..expression import Script, Statement, parse_script
from ..notation import Assignment
from ..plan.bias import split_epilogue
from .cache import LRUCache
from .evaluate import SplitCall, evaluate, resolve, resolved
from .launcher import Launch
from .replay import remember, replay
from .validate import check_call

if TYPE_CHECKING:
    from ..program import Program

__all__ = ["CallSpec", "Layout", "derived", "planned_layouts", "register_kernels", "traced_evaluate", "tracing",
           "transforming"]


def tracing() -> bool:
    """Whether a tracer (``torch.compile``/``torch.export`` or ``torch.jit.trace``) is
    recording the current call."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def transforming() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, ...) is running: its tensors
    are wrappers without storage, which reach kernels only through the autograd
    Functions' rules (``..autograd``, ``sparsenn.functional``). False while
    ``torch.compile`` traces (its graphs hold the ops)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


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
    """One traced evaluation: ``assignment`` (or a compiled expression's ``Statement`` or
    ``Script``, run as its staged program, fused as the planner groups it) over operands
    of ``layouts`` (None: dense),
    ``out_format`` requested; the result is dense when ``anchor`` is None, else values
    on operand ``anchor``'s pattern."""

    assignment: Assignment | Statement | Script
    layouts: tuple[Layout | None, ...]
    out_format: object
    anchor: int | None

    def program(self) -> Program:
        """The stages of a statement for these layouts' formats."""
        from ..program import stage  # program -> autograd -> this module

        return stage(self.assignment, tuple(None if lay is None else lay.format for lay in self.layouts),
                     self.out_format)

    def run(self, operands: Sequence):
        if isinstance(self.assignment, (Statement, Script)):
            from .programs import run

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


# Call string -> spec; a string traced in this process maps to the spec it was encoded
# from, whose assignment is the very object eager calls use (the compiler's caches then
# compare keys by identity).
_specs: LRUCache[CallSpec] = LRUCache("call strings", 1024)


def decode(call: str) -> CallSpec:
    """The :class:`CallSpec` a ``sparsenn::evaluate`` call string encodes."""
    spec = _specs.get(call)
    if spec is not None:
        return spec
    prefix = "sparsenn-call:"
    if not isinstance(call, str) or not call.startswith(prefix):
        raise ValueError(f"not a sparsenn call string: {call!r:.60}")
    spec = _SpecUnpickler(io.BytesIO(base64.b64decode(call[len(prefix):]))).load()
    if not isinstance(spec, CallSpec):
        raise ValueError("a sparsenn call string must encode a CallSpec")
    _specs.put(call, spec)
    return spec


def derived(assignment: Assignment | Statement | None, derive: tuple) -> Assignment | Statement:
    """What a traced call runs, named by constants:

    * ``()``: ``assignment``; ``("program",)``: the statement ``assignment``'s program;
    * ``("einsum", equation, num_operands)``: the parsed equation;
    * ``("script", text)``: the parsed statements of a compiled program's text;
    * ``("reduced",)``, ``("epilogue",)``: the reduction or the epilogue of ``assignment``,
      run apart when training (:func:`~..plan.bias.split_epilogue`);"""
    from .api import parse  # api -> this module

    if not derive or derive[0] == "program":
        return assignment
    if derive[0] == "einsum":
        return parse(*derive[1:])
    if derive[0] == "script":
        return _script(derive[1])
    if derive[0] == "reduced":
        return split_epilogue(assignment)[0]
    return split_epilogue(assignment)[1]


@functools.lru_cache(maxsize=256)
def _script(text: str) -> Script:
    """``parse_script(text)``, one object per text (the compiler's caches key on it)."""
    return parse_script(text)


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
    if isinstance(target, (Statement, Script)):
        anchor = _statement_anchor(target, layouts, out_format)
    else:
        anchor = _anchor(target, layouts)
    spec = CallSpec(target, layouts, out_format, anchor)
    call = spec.encode()
    _specs.put(call, spec)
    return call, spec.anchor


def _statement_anchor(statement: Statement | Script, layouts: tuple[Layout | None, ...], out_format) -> int | None:
    """A masked statement's result has its mask's pattern (a script's: its last
    statement's mask, or that mask's own mask when an earlier statement wrote it); others
    must be dense."""
    mask = _mask_operand(statement)
    if mask is not None:
        return statement.operands.index(mask)
    spec = CallSpec(statement, layouts, out_format, None)
    if _result_format(spec.program(), [None if lay is None else lay.format for lay in layouts]) is not None:
        raise NotImplementedError(
            "sparsenn: a traced compiled expression must have a dense result or an output mask (P<S>[...] = ...); "
            f"{statement.output}[...] would be sparse with a pattern computed from the data")
    return None


def _mask_operand(statement: Statement | Script) -> str | None:
    """The caller's operand whose pattern a masked result has, or None."""
    if isinstance(statement, Statement):
        return statement.mask
    masks = {s.output: s.mask for s in statement.statements}
    mask = masks[statement.output]
    while mask in masks and masks[mask] is not None:
        mask = masks[mask]
    return None if mask in masks else mask


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
            if isinstance(other, SparseTensor) and other.format == op.format and other.shape == op.shape and all(
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


def _validated_pattern(layout: Layout, shape: tuple[int, ...], arrays: Sequence[Tensor],
                       values: Tensor) -> SparseTensor:
    """The pattern of these index arrays, validated the first time their identity and
    version are seen; the cache keeps those arrays alive, so an address cannot be reused
    by other contents while the entry exists."""
    key = (layout.format, shape, tuple(map(array_version, arrays)), tuple([a.dtype for a in arrays]))
    pattern = _patterns.get(key)
    if pattern is None:
        pos, crd = _levels(layout.format, arrays)
        pattern = SparseTensor(shape, layout.format, pos, crd, values)
        _patterns.put(key, pattern)
    return pattern


def _unchecked_pattern(layout: Layout, shape: tuple[int, ...], arrays: Sequence[Tensor],
                       values: Tensor) -> SparseTensor:
    """The pattern of arrays known to be shaped right (stand-ins for planning)."""
    pos, crd = _levels(layout.format, arrays)
    return SparseTensor(shape, layout.format, pos, crd, values, check=False)


def _rebuild(spec: CallSpec, tensors: Sequence[Tensor], shapes: Sequence[int],
             pattern_of: Callable[..., SparseTensor] = _validated_pattern) -> list:
    """The operands of a call from its flattened tensors. The values are not checked
    here: evaluation checks that they fit the pattern (``SparseTensor.check_unmodified``)."""
    operands: list = []
    at = 0
    for layout, shape in zip(spec.layouts, _split_shapes(spec, shapes)):
        if layout is None:
            operands.append(tensors[at])
            at += 1
            continue
        if layout.shares is None:
            count = layout.num_arrays
            pattern = pattern_of(layout, shape, tensors[at:at + count], tensors[at + count])
        else:
            count, pattern = 0, operands[layout.shares]
            if pattern.shape != shape:
                raise ValueError(f"sparsenn call: operand {len(operands)} shares the index arrays of operand "
                                 f"{layout.shares} of shape {pattern.shape} but has shape {shape}")
        operands.append(pattern._share(shape, layout.format, tensors[at + count]))
        at += count + 1
    return operands


def _levels(fmt: Format, arrays: Sequence[Tensor]) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
    """``pos`` and ``crd`` per storage level from the arrays :func:`_flatten` passed."""
    present = iter(arrays)
    pos = tuple(next(present) if level.has_pos else None for level in fmt.levels)
    crd = tuple(next(present) if level.has_crd else None for level in fmt.levels)
    return pos, crd


# ----------------------------------------------------------------------------- result layout


def _static_layouts(call: str, tensors: Sequence[Tensor], shapes: Sequence
                    ) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """The ``order`` argument of a traced call and the order the kernel reads each
    tensor in (:func:`planned_layouts`) when every size is static, else contiguous and
    as given. Traced code: sizes are tested with ``has_static_value``, as Dynamo reports
    a symbolic size's type as ``int`` (``torch.jit.trace`` records sizes as tensors)."""
    dims = [tuple(t.shape) for t in tensors]
    sizes = [*shapes, *(n for d in dims for n in d)]
    if any(isinstance(n, Tensor) for n in sizes) or not all(has_static_value(n) for n in sizes):
        return [], ((),) * len(tensors)
    order, reads = planned_layouts(call, tuple(t.dtype for t in tensors),
                                   tuple(tuple(int(n) for n in d) for d in dims), tuple(int(n) for n in shapes))
    return list(order), reads


def _read_in(tensor: Tensor, order: tuple[int, ...]) -> Tensor:
    """``tensor`` stored with its dimensions in ``order`` (outermost first), as a kernel
    reads it: itself when it is, else a copy recorded in the traced graph (where the
    compiler transposes it, or writes it so in the kernel that produces it, instead of
    the op copying it as it runs)."""
    if not order or tensor.permute(order).is_contiguous():
        return tensor
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return tensor.permute(order).contiguous().permute(inverse)


@torch.compiler.assume_constant_result
def planned_layouts(call: str, dtypes: tuple[torch.dtype, ...], dims: tuple[tuple[int, ...], ...],
                    shapes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The memory layouts of the kernel of ``call`` over tensors of ``dtypes`` and sizes
    ``dims`` (sparse shapes ``shapes``), as the planner decides them (from formats,
    shapes, stored positions and dtypes: deterministic):

    * the dense result's dimensions from outermost to innermost in memory as the kernel
      writes them, () for contiguous or when that is decided only by running (a sparse
      result, pairwise contractions, torch.einsum, a program of several statements);
    * per tensor, the order in which the kernel reads it when it is a dense operand
      (the kernel's launch copies an operand stored otherwise), () when it is not, or
      not known before running.

    Planned on stand-in tensors of those sizes, as evaluation plans the call."""
    spec = decode(call)
    unknown: tuple[tuple[int, ...], ...] = ((),) * len(dims)
    if isinstance(spec.assignment, (Statement, Script)):
        return (), unknown
    stand_ins = [torch.empty((), dtype=dtype).expand(dim) for dtype, dim in zip(dtypes, dims)]
    try:
        result, reads = _planned_result(spec.assignment, _rebuild(spec, stand_ins, shapes, _unchecked_pattern),
                                        spec.out_format)
    except (TypeError, ValueError, NotImplementedError):
        return (), unknown  # the call itself reports what is wrong
    orders = dict.fromkeys(range(len(dims)), ())
    for n, (layout, slot) in enumerate(zip(spec.layouts, _differentiable_slots(spec))):
        if layout is None:  # a dense operand (a dense-format SparseTensor's values are converted by the op)
            orders[slot] = reads.get(n, ())
    inputs = tuple(orders.values())
    if result is None or spec.anchor is not None:
        return (), inputs
    order = sorted(range(result.dim()), key=lambda d: (-result.stride(d), d))
    return (() if order == list(range(result.dim())) else tuple(order)), inputs


def _planned_result(assignment: Assignment, operands: Sequence, out_format
                    ) -> tuple[Tensor | None, dict[int, tuple[int, ...]]]:
    """A meta tensor laid out as the dense result of evaluating ``assignment`` over
    ``operands`` (resolved as :func:`.evaluate.evaluate` resolves it; nothing runs), or
    None when its layout is not the plan's (see :func:`planned_layouts`); and the order
    in which one kernel reads each dense operand it reads in one order only."""
    checked = check_call(assignment, operands, out_format)
    runnable = resolve(assignment, checked)
    if isinstance(runnable, SplitCall):
        split = runnable.split
        if split.stored is not None or any(fmt is not None for fmt in split.converted):
            return None, {}
        inner, _ = _planned_result(split.assignment, split.operands(checked.operands), split.request)
        return (None if inner is None else split.result(inner)), {}
    if not isinstance(runnable, Launch):
        return None, {}
    reads: dict[int, set[tuple[int, ...]]] = {}
    for slot in runnable.plan.kernel.slots:
        if slot.fmt is None and slot.panel is None:
            rank = checked.operands[slot.operand].dim()
            reads.setdefault(slot.operand, set()).add(slot.layout or tuple(range(rank)))
    orders = {n: next(iter(found)) for n, found in reads.items() if len(found) == 1}
    if runnable.plan.output_format is not None or runnable.final_format is not None:
        return None, orders
    out = torch.empty(runnable.allocation, device="meta")
    permutation = runnable.plan.output_permutation
    return (out if permutation is None else out.permute(permutation)), orders


def _strides(shape: Sequence, order: Sequence[int]) -> list:
    """Strides of a tensor of ``shape`` stored with its dimensions in ``order``
    (outermost first), as torch computes contiguous strides."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step = step * max(shape[d], 1)
    return strides


def _check_order(order: Sequence[int], rank: int) -> None:
    if order and sorted(order) != list(range(rank)):
        raise ValueError(f"sparsenn call: order {list(order)} is not a permutation of the result's {rank} dimensions")


def _laid_out(result: Tensor, order: Sequence[int]) -> Tensor:
    """``result`` stored in ``order`` (contiguous when empty): as it is when the kernel
    wrote that layout, else copied."""
    if not order:
        return result.contiguous()
    _check_order(order, result.dim())
    shape = result.shape
    strides = _strides(shape, order)
    actual = result.stride()
    if actual == tuple(strides):
        return result
    if result.numel() == 0 or all(a == b or n == 1 for n, a, b in zip(shape, actual, strides)):
        return result.as_strided(shape, strides)  # differs only in the strides of size-1 dimensions
    return result.new_empty_strided(shape, strides).copy_(result)


def _check_result(spec: CallSpec, operands: Sequence, result, order: Sequence[int]) -> Tensor:
    """The op's output: the dense result in ``order``, or the values of a result on the
    anchor's pattern."""
    if spec.anchor is None:
        if isinstance(result, SparseTensor):
            raise NotImplementedError(
                f"sparsenn: {spec.assignment} has a sparse result whose pattern is computed from the data; "
                "torch.compile / torch.export / torch.jit.trace can only record sparse results sampled on an "
                "operand's pattern (ask for out_format='dense', or run this call eagerly)")
        return _laid_out(result, order)
    anchor = operands[spec.anchor]
    if not isinstance(result, SparseTensor) or any(
            not (a is b or (a is not None and b is not None and torch.equal(a, b)))
            for a, b in zip(result.pos + result.crd, anchor.pos + anchor.crd)):
        raise NotImplementedError(
            f"sparsenn: the result of {spec.assignment} does not have the pattern of operand {spec.anchor}; "
            "traced programs can only record sparse results sampled on an operand's pattern")
    return result.values


# Defined with the low-level API, autograd kernel included: torch.library.custom_op's and
# register_autograd's Python wrappers cost about 10 µs per call, a third of a small
# layer's own overhead.
_library = torch.library.Library("sparsenn", "FRAGMENT")
_library.define("evaluate(str call, Tensor[] tensors, SymInt[] shapes, int[] order) -> Tensor")
_library.define("evaluate_backward(str call, Tensor[] tensors, SymInt[] shapes, Tensor grad, Tensor result, "
                "bool[] needed) -> Tensor[]")


def evaluate_op(call: str, tensors: list[Tensor], shapes: list[int], order: list[int]) -> Tensor:
    """``evaluate(assignment, operands, out_format)`` of the encoded call, a dense result
    stored in ``order``; a repeated call is replayed (:mod:`.replay`)."""
    result = replay(call, tensors, shapes, order)
    if result is not None:
        return result
    spec = decode(call)
    operands = _rebuild(spec, tensors, shapes)
    result = _check_result(spec, operands, spec.run(operands), order)
    if isinstance(spec.assignment, Assignment):
        run = resolved(spec.assignment, operands, spec.out_format)
        strides = None if spec.anchor is not None else result.stride()
        remember(call, tensors, shapes, order, operands, _differentiable_slots(spec), run,
                 functools.partial(_check_result, spec, order=order), strides)
    return result


def _evaluate_fake(call: str, tensors: list[Tensor], shapes: list[int], order: list[int]) -> Tensor:
    spec = decode(call)
    slots = _differentiable_slots(spec)
    dtype = tensors[slots[0]].dtype
    if spec.anchor is not None:
        _check_order(order, 1)
        return tensors[slots[spec.anchor]].new_empty(tensors[slots[spec.anchor]].shape, dtype=dtype)
    sparse_shapes = _split_shapes(spec, shapes)
    operand_shapes = [tuple(tensors[slot].shape) if shape is None else shape
                      for slot, shape in zip(slots, sparse_shapes)]
    if isinstance(spec.assignment, (Statement, Script)):
        shape = _program_shape(spec.program(), operand_shapes)
    else:
        sizes = {}
        for access in spec.assignment.accesses:
            sizes.update(zip(access.indices, operand_shapes[access.operand]))
        shape = [sizes[i] for i in spec.assignment.output]
    _check_order(order, len(shape))
    if not order:
        return tensors[slots[0]].new_empty(shape, dtype=dtype)
    return tensors[slots[0]].new_empty_strided(shape, _strides(shape, order), dtype=dtype)


def _program_shape(program: Program, operand_shapes: Sequence[tuple]) -> list:
    """The shape of a program's result, from the shapes of the caller's operands."""
    from ..program import UserOperand

    results: list = []
    for step in program.stages:
        shapes = [operand_shapes[s.n] if isinstance(s, UserOperand) else results[s.stage] for s in step.inputs]
        sizes = {}
        for access in step.assignment.accesses:
            sizes.update(zip(access.indices, shapes[access.operand]))
        results.append(tuple(sizes[i] for i in step.assignment.output))
    return list(results[-1])


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
    if isinstance(spec.assignment, (Statement, Script)):
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


class _RecordedEvaluate(torch.autograd.Function):
    """``sparsenn::evaluate`` recorded for autograd: the op's kernel below autograd
    forward, ``sparsenn::evaluate_backward`` backward (the tensors are passed one by one
    so that autograd tracks each)."""

    @staticmethod
    def forward(keyset, call: str, shapes: list, order: list, *tensors: Tensor) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            return _EVALUATE.redispatch(keyset & torch._C._after_autograd_keyset, call, list(tensors), shapes, order)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, call, shapes, _, *tensors = inputs
        ctx.call, ctx.shapes, ctx.slots = call, shapes, _differentiable_slots(decode(call))
        ctx.needed = [tensors[slot].requires_grad for slot in ctx.slots]
        ctx.save_for_backward(*tensors, output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        *tensors, output = ctx.saved_tensors
        grads: list[Tensor | None] = [None] * len(tensors)
        if any(ctx.needed):
            computed = iter(torch.ops.sparsenn.evaluate_backward(ctx.call, list(tensors), ctx.shapes, grad, output,
                                                                 ctx.needed))
            for slot, need in zip(ctx.slots, ctx.needed):
                if need:
                    grads[slot] = next(computed)
        return None, None, None, None, *grads


_BELOW_AUTOGRAD = torch._C._after_ADInplaceOrView_keyset  # the keys a call meets after autograd's

# Raw dispatch key set -> whether the kernel after autograd's is the CPU one (a
# DispatchKeySet is not hashable, and testing one costs most of a small call's overhead).
_reaches_cpu: dict[int, bool] = {}


def _evaluate_autograd(keyset, call: str, tensors: list[Tensor], shapes: list, order: list[int]) -> Tensor:
    """The op's autograd kernel: recorded when a gradient is needed, else the kernel the
    dispatcher would reach next — called directly when that is the CPU one (plain CPU
    tensors, no mode or tensor subclass in between), saving a second dispatch."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _RecordedEvaluate.apply(keyset, call, shapes, order, *tensors)
    raw = keyset.raw_repr()
    direct = _reaches_cpu.get(raw)
    if direct is None:
        direct = _reaches_cpu[raw] = (keyset & _BELOW_AUTOGRAD).highestPriorityTypeId() == torch._C.DispatchKey.CPU
    if direct:
        return evaluate_op(call, tensors, shapes, order)
    with torch._C._AutoDispatchBelowAutograd():
        return _EVALUATE.redispatch(keyset & torch._C._after_autograd_keyset, call, tensors, shapes, order)


_library.impl("evaluate", evaluate_op, "CPU")
_library.impl("evaluate", _evaluate_autograd, "Autograd", with_keyset=True)
_library.impl("evaluate_backward", evaluate_backward_op, "CPU")
torch.library.register_fake("sparsenn::evaluate", _evaluate_fake, lib=_library)
torch.library.register_fake("sparsenn::evaluate_backward", _evaluate_backward_fake, lib=_library)
_EVALUATE = torch.ops.sparsenn.evaluate.default


def traced_evaluate(assignment: Assignment | None, operands: Sequence, out_format, derive: tuple = ()):
    """``evaluate(derived(assignment, derive), operands, out_format)`` as one
    ``sparsenn::evaluate`` op (differentiable through ``sparsenn::evaluate_backward``); a
    sparse result keeps the anchor operand's pattern."""
    if torch.onnx.is_in_onnx_export():
        raise RuntimeError("torch.onnx.export cannot export sparsenn's compiled sparse kernels (the sparsenn::evaluate "
                           "op has no ONNX equivalent); use torch.export.export (the ExportedProgram keeps sparsenn's "
                           "ops, and runs where sparsenn is installed) or torch.compile")
    fields = _describe(operands)
    call, anchor = _encoded(assignment, derive, out_format, *fields)
    tensors, shapes = _flatten(operands, fields[2::3]), _shapes(operands)
    order, reads = _static_layouts(call, tensors, shapes)
    tensors = [_read_in(t, read) for t, read in zip(tensors, reads)]
    result = torch.ops.sparsenn.evaluate(call, tensors, shapes, order)
    if anchor is None:
        return result
    pattern = operands[anchor]
    return pattern._share(pattern.shape, pattern.format, result)  # the op's values: no checks to trace
