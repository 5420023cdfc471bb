"""The top of tracing: the ``sparsenn::evaluate`` and ``sparsenn::evaluate_backward``
custom ops that :func:`.tracing.traced_evaluate` records, with their kernels.

The CPU kernel reads the call string (:func:`.callspec.decode`), rebuilds the
:class:`SparseTensor` s (:mod:`.traced_operands`: index arrays validated once per
version, so a module whose pattern buffers were edited raises instead of crashing) and
evaluates as in eager mode — an assignment by :func:`.evaluate.evaluate`, a compiled
statement or script by :func:`..program_autograd.run` — returning a dense result in ``order``
(copied only if the kernel wrote another layout); a repeated call is replayed
(:mod:`.replay`). The fake kernel derives the result's shape from the spec and its
strides from ``order``. The autograd kernel records ``sparsenn::evaluate_backward``,
which runs the compiler's own gradient expressions (:mod:`..autograd`); a program's
gradients are recorded by torch's autograd as in eager mode. A sparse result is returned
as its values on the pattern of operand ``CallSpec.anchor``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from sparsenn.formats import SparseTensor

from ..autograd import operand_gradients
from ..frontend.notation import Assignment
from ..frontend.program import Program, UserOperand
from .callspec import CallSpec, decode
from .evaluate import evaluate, resolved
from ..program_autograd import run
from .replay import remember, replay
from .traced_operands import differentiable_slots, rebuild, split_shapes

__all__ = ["evaluate_op", "evaluate_backward_op"]


def _run(spec: CallSpec, operands: Sequence):
    """Evaluate the call: an assignment, or a statement's or script's staged program."""
    if isinstance(spec.assignment, Assignment):
        return evaluate(spec.assignment, operands, spec.out_format)
    return run(spec.program(), operands)


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
    operands = rebuild(spec, tensors, shapes)
    result = _check_result(spec, operands, _run(spec, operands), order)
    if isinstance(spec.assignment, Assignment):
        run = resolved(spec.assignment, operands, spec.out_format)
        strides = None if spec.anchor is not None else result.stride()
        remember(call, tensors, shapes, order, operands, differentiable_slots(spec), run,
                 functools.partial(_check_result, spec, order=order), strides)
    return result


def _evaluate_fake(call: str, tensors: list[Tensor], shapes: list[int], order: list[int]) -> Tensor:
    spec = decode(call)
    slots = differentiable_slots(spec)
    dtype = tensors[slots[0]].dtype
    if spec.anchor is not None:
        _check_order(order, 1)
        return tensors[slots[spec.anchor]].new_empty(tensors[slots[spec.anchor]].shape, dtype=dtype)
    sparse_shapes = split_shapes(spec, shapes)
    operand_shapes = [tuple(tensors[slot].shape) if shape is None else shape
                      for slot, shape in zip(slots, sparse_shapes)]
    if not isinstance(spec.assignment, Assignment):
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
    spec = decode(call)
    operands = rebuild(spec, tensors, shapes)
    grad_out = grad.contiguous() if spec.anchor is None else operands[spec.anchor].with_values(grad.contiguous())
    if spec.anchor is not None:
        result = operands[spec.anchor].with_values(result)
    wanted = [n for n, need in enumerate(needed) if need]
    if not isinstance(spec.assignment, Assignment):
        grads = _program_gradients(spec, operands, grad_out, wanted)
    else:
        grads = operand_gradients(spec.assignment, operands, spec.out_format, grad_out, result, wanted)
    slots = differentiable_slots(spec)
    return [torch.zeros(tensors[slots[n]].shape, dtype=tensors[slots[n]].dtype) if g is None else g.contiguous()
            for g, n in zip(grads, wanted)]


def _evaluate_backward_fake(call: str, tensors: list[Tensor], shapes: list[int], grad: Tensor, result: Tensor,
                            needed: list[bool]) -> list[Tensor]:
    slots = differentiable_slots(decode(call))
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
        out = _run(spec, rebuilt)
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
        ctx.call, ctx.shapes, ctx.slots = call, shapes, differentiable_slots(decode(call))
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
