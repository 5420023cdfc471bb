"""A training step run densely, when the planner's cost model finds it cheaper.

A recorded call ``Out = A · X (+ bias)`` of one sparse operand ``A`` whose values require
a gradient runs, in a training step, the call and its gradient calls (``dX = dOut · A``,
``dA = (dOutᵀ X)`` sampled at ``A``'s pattern). At moderate sparsity or on small layers
each of these sparse kernels is slower than BLAS on the dense matrix, and every call pays
a launch. :func:`plan_step` weighs the step both ways
(:func:`~.plan.dense_path.step_path`: each call as the planner routes it, against one
copy of ``A`` made dense per step and BLAS products); :class:`DenseStep` runs the dense
one as one autograd node (:class:`_DenseStepFunction`): its forward makes ``A`` dense
(made again after its values' version moved, else the copy kept while they are
unchanged, :data:`.runtime.densified.COPIES`) and runs the product as one BLAS call
(:mod:`.runtime.dense_product`); its backward runs each gradient product by BLAS in its
operand's layout and samples the dense ``dA`` at ``A``'s stored positions by a compiled
call. Under ``create_graph`` the backward records those gradients over
:class:`_Densified` (``A`` made dense as a differentiable function of its values).

It applies to a plain sum of products of one unblocked sparse operand with values
requiring a gradient, and dense ones, in one BLAS call's form, with a dense result in
float32 or float64, outside a forward-mode AD level (the sparse call's node has the
tangent rule). A step whose result is not finite runs sparse: BLAS multiplies every
unstored zero, ``0 · inf`` where an input holds an infinity the sparse kernels never
read (see :class:`~.runtime.evaluate.DensifiedCall`): the forward sums its result once
(the weight's values cannot tell, the infinity being in the input).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd import forward_ad as _forward_ad

from sparsenn.formats import SparseTensor

from .autograd import _apply, _gradient_expression, _Spec, differentiable_evaluate, gradient_call
from .derivatives import gradient_assignment
from .frontend.notation import Assignment, parse_einsum
from .plan.dense_path import StepPath, call_cycles, dense_product_cycles, step_path
from .plan.sampled_path import sampled_kernel_cycles
from .plan.planner import DENSE, ShapePlan, operand_infos
from .plan.target import Target
from .runtime.cache import Guard
from .runtime.dense_product import BlasForm, blas_form
from .runtime.densified import COPIES
from .runtime.evaluate import DenseCall, DensifiedCall, Run, SampledDenseCall, evaluate, guarded_run, route
from .runtime.validate import call_guard, check_call

__all__ = ["DenseStep", "plan_step", "dense_step"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DTYPES = (torch.float32, torch.float64)


def _sparse_operand(assignment: Assignment, operands: Sequence, out_format) -> int | None:
    """The number of the one sparse operand of a call the dense step may run, else None."""
    if (out_format not in (None, DENSE) or assignment.epilogue is not None or not assignment.is_product_sum
            or blas_form(assignment) is None):
        return None
    sparse = [n for n, op in enumerate(operands) if isinstance(op, SparseTensor)]
    if len(sparse) != 1 or not all(isinstance(op, (SparseTensor, torch.Tensor)) for op in operands):
        return None
    (k,) = sparse
    op = operands[k]
    if op.format.block is not None or op.format.is_dense or op.values.dtype not in _DTYPES \
            or not op.values.requires_grad:
        return None
    return k


def _routed_cycles(assignment: Assignment, operands: Sequence, out_format, target: Target) -> float | None:
    """Cycles of one call as the planner routes it (a kernel, or the per-call dense path
    with a copy: the values are new at every step), its launch not counted; None for a
    call routed otherwise (a contraction path, split blocks)."""
    checked = check_call(assignment, operands, out_format)
    routed = route(assignment, checked)
    itemsize = checked.dtype.itemsize
    if isinstance(routed, DensifiedCall):
        return routed.dense.dense_cycles + routed.dense.densify_cycles
    if isinstance(routed, SampledDenseCall):
        return routed.sampled.dense_cycles
    if isinstance(routed, DenseCall):
        return dense_product_cycles(assignment, [tuple(op.shape) for op in checked.operands], itemsize, target)
    if not isinstance(routed, ShapePlan) or (routed.output_format is not None and routed.anchor is None):
        return None
    sched, infos = routed.schedule, operand_infos(checked.operands)
    stored = [op.nnz if isinstance(op, SparseTensor) else 0 for op in checked.operands]
    sparse = [n for n, info in enumerate(infos) if info.format is not None]
    if len(sparse) == 1:
        return call_cycles(routed.plan.assignment, sched, infos, stored, itemsize, target)
    # a sampled gradient reads one pattern twice, as the operand and as its output's mask
    return sampled_kernel_cycles(routed.plan.assignment, sched, infos, stored, sparse[0], itemsize, target)


def plan_step(assignment: Assignment, operands: Sequence, out_format) -> StepPath | None:
    """The training step of a recorded call weighed sparse against dense
    (:func:`~.plan.dense_path.step_path`), or None when the dense step does not apply
    (see the module doc). The gradients costed are those of the operands requiring one."""
    k = _sparse_operand(assignment, operands, out_format)
    if k is None:
        return None
    target = Target.current()
    op = operands[k]
    itemsize = op.values.dtype.itemsize
    wanted = [n for n, x in enumerate(operands) if (x.values if isinstance(x, SparseTensor) else x).requires_grad]
    with torch.no_grad():
        operands = [x.detach() for x in operands]
        shapes = [tuple(x.shape) for x in operands]
        checked = check_call(assignment, operands, out_format)
        out_shape = tuple(checked.sizes[i] for i in assignment.output)
        grad_out = torch.empty(out_shape, dtype=op.values.dtype)
        spec = _Spec(assignment, [x if isinstance(x, SparseTensor) else None for x in operands], out_format, evaluate)
        sparse_calls = [_routed_cycles(assignment, operands, out_format, target)]
        dense_products = [dense_product_cycles(assignment, shapes, itemsize, target)]
        for n in wanted:
            gradient, inputs, request = _gradient_expression(spec, n, operands, grad_out, None)
            sparse_calls.append(_routed_cycles(gradient, inputs, request, target))
            dense_gradient, extras = gradient_assignment(assignment, n, len(shapes[n]), False)
            if any(extra[0] != "ones" for extra in extras):
                return None
            extra_shapes = [tuple(shapes[n][m] for m in extra[1]) for extra in extras]
            dense_products.append(dense_product_cycles(dense_gradient, [out_shape, *shapes, *extra_shapes],
                                                       itemsize, target))
    if None in sparse_calls:
        return None
    return step_path(k, [c + target.launch_cycles for c in sparse_calls], dense_products, op.nnz,
                     math.prod(op.shape) * itemsize, itemsize, target)


class _Densified(torch.autograd.Function):
    """``operand`` (a SparseTensor whose values are ``values``) as a strided tensor,
    differentiable in its values (a step's gradients recorded for ``create_graph``):
    the gradient is the dense one sampled at its pattern, itself recorded."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, operand: SparseTensor, conversions: _Conversions):
        ctx.operand, ctx.conversions = operand, conversions
        return COPIES.copy_for(operand, conversions.made_dense).detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pattern = ctx.operand.detach()
        sample = ctx.conversions.sample
        inputs = [grad.contiguous(), pattern, pattern]  # the output gradient, the operand, its pattern as the mask
        return differentiable_evaluate(evaluate, sample.assignment, inputs, sample.request).values, None, None


class _StepCall:
    """One call of a :class:`DenseStep`: its operands, and whether its result is finite."""

    __slots__ = ("step", "operands", "finite")

    def __init__(self, step: DenseStep, operands: Sequence) -> None:
        self.step, self.operands, self.finite = step, operands, True


class _DenseStepFunction(torch.autograd.Function):
    """A dense step's call as one autograd node, a function of the call's dense operands
    and sparse operand's values: the forward one BLAS call over the sparse operand's
    dense copy (kept while its values are unchanged, :data:`COPIES`); the backward the
    BLAS gradients (:meth:`.BlasForm.gradients`), the sparse operand's sampled at its
    stored positions by a compiled call. Under ``create_graph`` the backward records
    the same gradients over :class:`_Densified` (each a differentiable function)."""

    @staticmethod
    def forward(ctx, call: _StepCall, *tensors: torch.Tensor) -> torch.Tensor:
        step = call.step
        k, form = step.path.operand, step.form
        dense = list(tensors)
        dense[k] = step.conversions.dense_copy(call.operands[k])
        out = form.run(dense)
        call.finite = math.isfinite(float(out.sum()))  # grad mode is off in a forward: no detach
        ctx.call, ctx.dense, ctx.tensors = call, dense[k], tensors
        ctx.save_for_backward(tensors[form.lhs.operand], tensors[form.rhs.operand])  # what torch's mm saves
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        call: _StepCall = ctx.call
        step = call.step
        k, form = step.path.operand, step.form
        tensors = list(ctx.tensors)
        tensors[form.lhs.operand], tensors[form.rhs.operand] = ctx.saved_tensors  # raises if edited in place since
        conversions = step.conversions
        recording = torch.is_grad_enabled()  # create_graph
        tensors[k] = _Densified.apply(tensors[k], call.operands[k], conversions) if recording else ctx.dense
        grads = form.gradients(tensors, grad, ctx.needs_input_grad[1:])
        dense = grads[k]
        if dense is not None:
            pattern = conversions.pattern(call.operands[k])
            inputs = [dense.contiguous(), pattern, pattern]  # the dense gradient, the operand, its pattern as the mask
            sample = conversions.sample
            grads[k] = (differentiable_evaluate(evaluate, sample.assignment, inputs, sample.request) if recording
                        else sample(inputs)).values
        return (None, *grads)


class _HeldCall:
    """``call(inputs)``: a compiled call of ``assignment``, the guard and run of its last
    signature held (as a call site holds its calls). The inputs numbered in ``vouched``
    are the held signature's sparse operand, which the caller's own guard passed (a
    call site's): the held guard tests only that their index arrays are unedited
    (:func:`~.runtime.validate.call_guard`'s ``fixed``)."""

    def __init__(self, assignment: Assignment, request, vouched: frozenset[int]) -> None:
        self.assignment, self.request, self.vouched = assignment, request, vouched
        self._held: tuple[Guard, Run] | None = None

    def __call__(self, inputs: list):
        held = self._held
        if held is not None and held[0](inputs, self.request):
            return held[1](inputs)
        result = evaluate(self.assignment, inputs, self.request)
        entry = guarded_run(self.assignment, inputs, self.request)
        if entry is not None:
            self._held = (call_guard(self.assignment, inputs, self.request, self.vouched), entry[1])
        return result


class _Conversions:
    """A sparse operand's conversions in a dense step: made dense (a scatter of its
    entries) and a dense gradient sampled at its stored positions (the derivative of
    ``Out = A`` in ``A``), each a compiled call."""

    def __init__(self, operand: SparseTensor) -> None:
        letters = _LETTERS[: operand.ndim]
        copy = parse_einsum(f"{letters}->{letters}", 1)
        self.dense = _HeldCall(copy, DENSE, frozenset({0}))
        with torch.no_grad():
            sampling, _, request = gradient_call(copy, 0, [operand], torch.empty(operand.shape,
                                                                                dtype=operand.values.dtype), None)
        self.sample = _HeldCall(sampling, request, frozenset({1, 2}))  # (dA, A, A's pattern)
        self._pattern: tuple[SparseTensor, SparseTensor] | None = None  # (an operand, its pattern)

    def pattern(self, operand: SparseTensor) -> SparseTensor:
        """``operand`` detached (its values read as the sampling's pattern only), kept
        for the operand last asked about (a layer's weight is one object while unchanged)."""
        kept = self._pattern
        if kept is None or kept[0] is not operand:
            kept = self._pattern = (operand, operand.detach())
        return kept[1]

    def dense_copy(self, operand: SparseTensor) -> torch.Tensor:
        """``operand`` as a strided tensor: the kept copy while its values are unchanged,
        else made now (not kept while they are trained, :meth:`~.runtime.densified.DenseCopies.copy_for`).
        Called in an autograd Function's forward."""
        return COPIES.copy_for(operand, self.made_dense)

    def made_dense(self, operand: SparseTensor) -> torch.Tensor:
        """``operand`` as a strided tensor; called in an autograd Function's forward (grad mode off)."""
        return self.dense([operand])


class DenseStep:
    """A call run as the dense step of :func:`plan_step`: one autograd node
    (:class:`_DenseStepFunction`) over the sparse operand made dense and BLAS."""

    def __init__(self, path: StepPath, form: BlasForm, conversions: _Conversions) -> None:
        self.path, self.form, self.conversions = path, form, conversions

    def run(self, operands: Sequence) -> torch.Tensor | None:
        """The call's result, recorded for torch's autograd; None when it is not finite
        (the caller then runs the sparse kernels)."""
        if _forward_ad._current_level >= 0:  # a tangent may be asked for: the sparse kernels' jvp
            return None
        call = _StepCall(self, operands)
        tensors = list(operands)  # dense operands, and the sparse operand's values
        k = self.path.operand
        tensors[k] = operands[k].values
        out = _apply(_DenseStepFunction, call, *tensors)
        return out if call.finite else None


def dense_step(assignment: Assignment, operands: Sequence, out_format) -> DenseStep | None:
    """The :class:`DenseStep` of a recorded call when :func:`plan_step` finds it cheaper,
    else None."""
    path = plan_step(assignment, operands, out_format)
    if path is None or not path.dense:
        return None
    return DenseStep(path, blas_form(assignment), _Conversions(operands[path.operand].detach()))
