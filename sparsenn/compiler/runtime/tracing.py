"""The bottom of tracing: whether a tracer records the current call, and the one op call
it records for an evaluation.

A tracer (``torch.compile``/``torch.export``, ``torch.jit.trace``) cannot run the planner
(Python objects, data-dependent validation, ctypes), so while tracing,
:func:`traced_evaluate` replaces each evaluation by
``sparsenn::evaluate(call, tensors, shapes, order)`` (registered with its kernels in
:mod:`.ops`):

* ``call`` is the call's text (:mod:`.callspec`: what runs as written, each operand's
  layout, the request, whose pattern the result has), computed once per traced call
  site from constants only;
* ``tensors`` are the operands' index arrays, values and dense tensors, flattened, and
  ``shapes`` the sparse operands' shapes (:mod:`.traced_operands`);
* ``order`` is the dense result's memory layout, its dimensions from outermost to
  innermost (empty: contiguous): the layout the planned kernel writes, found at trace time
  when the shapes are static (:func:`planned_layouts`), so the result is handed on as the
  kernel wrote it (a ``SparseLinear`` writes feature-major) instead of being copied. A
  dense operand stored otherwise than the kernel reads it is re-laid out by torch ops in
  the traced graph (where inductor transposes it with a tiled kernel, or writes it so
  where it is produced) rather than copied by the op.

A sparse result is returned as its values on the pattern of operand ``CallSpec.anchor``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import SymInt, Tensor
from torch.compiler import is_compiling
from torch.jit import is_tracing
from torch.onnx import is_in_onnx_export
from torch.fx.experimental.symbolic_shapes import has_static_value

from sparsenn.formats import SparseTensor

from ..frontend.notation import Assignment
from ..plan.planner import memory_order
from .callspec import CallSpec, Layout, anchor_of, decode, derived, remember_spec
from .evaluate import SplitCall, resolve
from .launcher import Launch
from .traced_operands import describe, differentiable_slots, flatten, rebuild, sparse_shapes, unchecked_pattern
from .validate import check_call

__all__ = ["encoded_call", "planned_layouts", "traced_evaluate", "traced_op", "tracing", "transforming"]


def tracing() -> bool:
    """Whether a tracer (``torch.compile``/``torch.export`` or ``torch.jit.trace``) is
    recording the current call."""
    return is_compiling() or is_tracing()


def transforming() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, vmap, ...) is running: its tensors
    are wrappers without storage, which reach kernels only through the autograd
    Functions' rules (``..autograd``, ``sparsenn.functional``). False while
    ``torch.compile`` traces (its graphs hold the ops)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


@torch.compiler.assume_constant_result
def encoded_call(assignment: Assignment | None, derive: tuple, out_format, *fields) -> tuple[str, int | None]:
    """The call string and anchor of ``derived(assignment, derive)`` over operands
    described by ``fields``: three per operand, ``format, index_dtype, shares`` (a None
    format: dense). Constant per call site: the tracer runs it once and records the
    string (it passes frozen dataclasses only as separate arguments read from module
    attributes, hence the flat fields and ``derive``)."""
    layouts = tuple(None if fields[k] is None else Layout(*fields[k:k + 3]) for k in range(0, len(fields), 3))
    target, written = derived(assignment, derive)
    spec = CallSpec(target, layouts, out_format, anchor_of(target, layouts, out_format), written)
    return remember_spec(spec), spec.anchor



def _static_layouts(call: str, tensors: Sequence[Tensor], shapes: Sequence
                    ) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """The ``order`` argument of a traced call and the order the kernel reads each
    tensor in (:func:`planned_layouts`) when every size is static, else contiguous and
    as given. Traced code: sizes are tested with ``has_static_value``, as Dynamo reports
    a symbolic size's type as ``int``; ``torch.jit.trace`` records sizes as tensors.
    Reads no class that the layers read too (see ``formats.tensor.is_sparse``)."""
    dims = [tuple(t.shape) for t in tensors]
    strides = [tuple(t.stride()) for t in tensors]
    sizes = [*shapes, *(n for d in dims for n in d), *(n for d in strides for n in d)]
    if not all(isinstance(n, (int, SymInt)) and has_static_value(n) for n in sizes):
        return [], ((),) * len(tensors)
    order, reads = planned_layouts(call, tuple(t.dtype for t in tensors),
                                   tuple(tuple(int(n) for n in d) for d in dims), tuple(int(n) for n in shapes),
                                   tuple(tuple(int(n) for n in d) for d in strides))
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
                    shapes: tuple[int, ...], strides: tuple[tuple[int, ...], ...] | None = None
                    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The memory layouts of the kernel of ``call`` over tensors of ``dtypes``, sizes
    ``dims`` and ``strides`` (None: contiguous; sparse shapes ``shapes``), as the planner
    decides them (from formats, shapes, dense operands' memory orders, stored positions
    and dtypes: deterministic):

    * the dense result's dimensions from outermost to innermost in memory as the kernel
      writes them, () for contiguous or when that is decided only by running (a sparse
      result, pairwise contractions, torch.einsum, a program of several statements);
    * per tensor, the order in which the kernel reads it when it is a dense operand
      (the kernel's launch copies an operand stored otherwise), () when it is not, or
      not known before running.

    Planned on stand-in tensors of those sizes, as evaluation plans the call."""
    spec = decode(call)
    unknown: tuple[tuple[int, ...], ...] = ((),) * len(dims)
    if not isinstance(spec.assignment, Assignment):  # a program of statements
        return (), unknown
    strides = strides or ((),) * len(dims)
    stand_ins = [_stand_in(dtype, dim, stride) for dtype, dim, stride in zip(dtypes, dims, strides)]
    try:
        result, reads = _planned_result(spec.assignment, rebuild(spec, stand_ins, shapes, unchecked_pattern),
                                        spec.out_format)
    except (TypeError, ValueError, NotImplementedError):
        return (), unknown  # the call itself reports what is wrong
    orders = dict.fromkeys(range(len(dims)), ())
    for n, (layout, slot) in enumerate(zip(spec.layouts, differentiable_slots(spec))):
        if layout is None:  # a dense operand (a dense-format SparseTensor's values are converted by the op)
            orders[slot] = reads.get(n, ())
    inputs = tuple(orders.values())
    if result is None or spec.anchor is not None:
        return (), inputs
    order = sorted(range(result.dim()), key=lambda d: (-result.stride(d), d))
    return (() if order == list(range(result.dim())) else tuple(order)), inputs


def _stand_in(dtype: torch.dtype, dim: tuple[int, ...], stride: tuple[int, ...]) -> Tensor:
    """A tensor planned as one of ``dim`` with ``stride`` is: a permutation of a
    contiguous tensor is allocated so (memory never touched), any other is one element
    expanded (planned as contiguous; the kernel's launch copies it)."""
    order = memory_order(dim, stride) if stride else None
    if order is None:
        return torch.empty((), dtype=dtype).expand(dim)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return torch.empty([dim[d] for d in order], dtype=dtype).permute(inverse)


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


def traced_evaluate(assignment: Assignment | None, operands: Sequence, out_format, derive: tuple = ()):
    """``evaluate(derived(assignment, derive), operands, out_format)`` as one
    ``sparsenn::evaluate`` op (differentiable through ``sparsenn::evaluate_backward``); a
    sparse result keeps the anchor operand's pattern."""
    fields = describe(operands)
    call, anchor = encoded_call(assignment, derive, out_format, *fields)
    result = traced_op(call, flatten(operands, fields[2::3]), sparse_shapes(operands))
    if anchor is None:
        return result
    pattern = operands[anchor]
    return pattern._share(pattern.shape, pattern.format, result)  # the op's values: no checks to trace


def traced_op(call: str, tensors: Sequence[Tensor], shapes: Sequence) -> Tensor:
    """The ``sparsenn::evaluate`` op of ``call`` over the flattened ``tensors`` and the
    sparse operands' ``shapes`` (:mod:`.traced_operands`), each dense operand read in
    the order its kernel reads it and the result in the layout the kernel writes
    (:func:`planned_layouts`, when the sizes are static)."""
    if is_in_onnx_export():
        raise RuntimeError("torch.onnx.export cannot export sparsenn's compiled sparse kernels (the sparsenn::evaluate "
                           "op has no ONNX equivalent); use torch.export.export (the ExportedProgram keeps sparsenn's "
                           "ops, and runs where sparsenn is installed) or torch.compile")
    order, reads = _static_layouts(call, tensors, shapes)
    tensors = [_read_in(t, read) for t, read in zip(tensors, reads)]
    return torch.ops.sparsenn.evaluate(call, tensors, shapes, order)
