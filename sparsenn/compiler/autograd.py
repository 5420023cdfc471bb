"""Autograd: every backward pass is itself a compiled sparse einsum.

The gradient of a call with respect to each operand, and its tangent, are assignments
(:mod:`.derivatives`) over the output gradient, the operands and a few extras (all-ones
tensors, the operand's pattern, the result, tie counts of a max), made here. An epilogue
``Out = e(R)`` runs, when gradients are needed, as ``R`` and then ``e`` as an
elementwise term over ``R``, so each has such a gradient.

All contributions for one operand form one expression, compiled and scheduled like
any other. Only the gradients that are needed are built and run. They are evaluated
as differentiable calls, so a backward with ``create_graph=True`` (or a nested
``torch.func`` transform) differentiates them again: higher-order gradients.

torch.func (:class:`_SparseEinsum`, in ``forward`` + ``setup_context`` form): ``grad``,
``vjp`` and ``jacrev`` use the backward above; ``jvp`` and ``jacfwd`` the tangent, one
einsum; ``vmap`` one batched einsum
(:mod:`.batching`). Under any transform every call goes through the Function, whose
rules hand the kernels plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import is_grad_enabled
from torch._C import _are_functorch_transforms_active as _transforms_active
from torch._C import _is_any_autocast_enabled as _any_autocast
from torch._C import _is_tracing as _jit_tracing
from torch.compiler import is_compiling
from torch._functorch.autograd_function import custom_function_call
from torch._C._functorch import unwrap_if_dead as _unwrap_if_dead
from torch.autograd import forward_ad as _forward_ad

from sparsenn.formats import SparseTensor

from .backend import jit
from .batching import batched_call
from .derivatives import differentiated, gradient_assignment, tangent_assignment, ties, without_zero_term
from .frontend.notation import Assignment
from .plan.bias import split_epilogue
from .runtime.cache import Guard
from .runtime.evaluate import Run, build_together, evaluate, guarded_run
from .runtime.tracing import traced_evaluate, tracing, transforming
from .runtime.validate import call_guard

__all__ = ["differentiable_evaluate", "gradient_call", "held_evaluate", "recorded", "differentiated", "unobserved",
           "unobserved_call", "HeldGradient"]


def _operand(template: SparseTensor | None, tensor: torch.Tensor):
    """``tensor`` as an operand: itself if dense, else values on ``template``'s pattern
    (``template`` itself when these are its values)."""
    if template is None or tensor is template.values:
        return tensor if template is None else template
    return template._share(template.shape, template.format, tensor)


class HeldGradient(NamedTuple):
    """A gradient call of one operand, held for the next backward of the same signature:
    its assignment and request, the inputs after ``(grad_out, *operands)`` (all-ones
    tensors, constants of the signature, or the number of the operand whose pattern the
    input is), and the guard and run of the cached resolution
    (:func:`~.runtime.evaluate.guarded_run`)."""

    assignment: Assignment
    out_format: object
    extras: tuple[torch.Tensor | int, ...]
    guard: Guard
    run: Run


class _Spec:
    """Everything about a call that is not a tensor autograd tracks. ``forward``: the run
    of the call's held signature (else it is evaluated); ``held``: the gradient calls a
    call site holds for its signature, by operand number (else none are held)."""

    __slots__ = ("assignment", "templates", "out_format", "evaluate", "forward", "held", "result", "built_kernels")

    def __init__(self, assignment: Assignment, templates: list, out_format, evaluate,
                 forward: Run | None = None, held: dict[int, HeldGradient] | None = None):
        self.assignment = assignment
        self.templates = templates  # per operand: SparseTensor pattern, or None if dense
        self.out_format = out_format
        self.evaluate = evaluate
        self.forward = forward
        self.held = held
        self.result: SparseTensor | None = None
        self.built_kernels = False  # the forward compiled a kernel: the backward's are likely new too

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> list:
        """The operands: dense tensors, or values on their templates' patterns."""
        return [_operand(tpl, t) for tpl, t in zip(self.templates, tensors)]

    def run(self, assignment: Assignment, operands: list, out_format):
        """``assignment`` evaluated as this call is, recorded for autograd and torch.func
        when they need it (a backward, tangent or batched call is one)."""
        return differentiable_evaluate(self.evaluate, assignment, operands, out_format)


def _gradient_expression(spec: _Spec, operand: int, operands: list, grad_out, result,
                         read_result: bool = False) -> tuple[Assignment, list, object]:
    """The assignment, operand list and out_format computing d(loss)/d(operand)
    (``read_result``: see :func:`operand_gradients`)."""
    template = spec.templates[operand]
    if template is not None and template.format.is_dense:
        template = None  # stored densely: compute a dense gradient, then lay it out as values
    rank = len(operands[operand].shape)
    assignment, extras = gradient_assignment(spec.assignment, operand, rank, template is not None, read_result)
    inputs = [grad_out] + list(operands)
    shape = operands[operand].shape
    for extra in extras:
        if extra[0] == "ones":
            inputs.append(torch.ones([shape[m] for m in extra[1]], dtype=_dtype_of(grad_out)))
        elif extra[0] == "mask":  # read for its stored positions only (a zero term's factors too)
            inputs.append(operands[operand])
        elif extra[0] == "result":
            inputs.append(result)
        else:
            inputs.append(spec.run(ties(spec.assignment), list(operands) + [result], "dense"))
    if template is None:
        return assignment, inputs, "dense"
    formats = tuple(op.format if isinstance(op, SparseTensor) else None for op in inputs)
    mask = 1 + len(operands) + extras.index(("mask",))
    return without_zero_term(assignment, formats, _shared_patterns(inputs), mask), inputs, template.format


def _shared_patterns(inputs: Sequence) -> tuple[int | None, ...]:
    """Per input, the first earlier sparse input with the same format and index arrays
    (the same tensors), or None: the patterns :func:`~.plan.anchor.sampled_operand` takes."""
    first: dict[tuple, int] = {}
    patterns: list[int | None] = []
    for n, op in enumerate(inputs):
        if not isinstance(op, SparseTensor):
            patterns.append(None)
            continue
        root = first.setdefault((op.format, *map(id, op.pos), *map(id, op.crd)), n)
        patterns.append(None if root == n else root)
    return tuple(patterns)


def _dtype_of(grad_out) -> torch.dtype:
    return grad_out.values.dtype if isinstance(grad_out, SparseTensor) else grad_out.dtype


@torch.compiler.assume_constant_result
def _epilogue_reads(assignment: Assignment) -> tuple[int, ...]:
    """The operands an epilogue reads (:func:`~.plan.bias.split_epilogue`), a constant for tracers."""
    return split_epilogue(assignment)[2]


class _SparseEinsum(torch.autograd.Function):
    """One evaluation as a function of its dense operands and sparse operands' values
    (the patterns are constants of ``spec``), with the torch.func rules: ``backward``
    (vjp) and ``jvp`` are compiled einsums, ``vmap`` one batched einsum
    (:mod:`.batching`)."""

    @staticmethod
    def forward(spec: _Spec, *tensors):
        tensors = [t if tpl is None else t.contiguous() for tpl, t in zip(spec.templates, tensors)]  # kernels' layout
        built = jit.builds
        operands = spec.rebuild(tensors)
        result = (spec.evaluate(spec.assignment, operands, spec.out_format) if spec.forward is None
                  else spec.forward(operands))
        spec.built_kernels = jit.builds != built
        if isinstance(result, SparseTensor):
            spec.result = result  # the pattern is fixed; its values carry the gradient
            return result.values
        return result

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec, *tensors = inputs
        ctx.spec = spec
        if spec.assignment.reduction != "sum":  # the gradient flows to the entries equal to the result
            ctx.save_for_backward(*tensors, output)
        else:
            ctx.save_for_backward(*tensors)
        if _forward_ad._current_level >= 0 or _transforms_active():  # a tangent may be asked for (jvp)
            ctx.save_for_forward(*tensors)

    @staticmethod
    def backward(ctx, grad):
        spec: _Spec = ctx.spec
        tensors = ctx.saved_tensors
        result = None
        if spec.assignment.reduction != "sum":
            *tensors, result = tensors
        operands = spec.rebuild(tensors)
        if not transforming():  # a transform's rules lay out its tensors
            grad = grad.contiguous()
        grad_out = _operand(spec.result, grad)
        wanted = [n for n, needed in enumerate(ctx.needs_input_grad[1:]) if needed]
        grads: list = [None] * len(tensors)
        for n, g in zip(wanted, _gradients(spec, operands, grad_out, result, wanted)):
            grads[n] = g
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _, *tangents):
        return tangent(ctx.spec, ctx.saved_tensors, tangents)

    @staticmethod
    def vmap(info, in_dims, spec: _Spec, *tensors):
        batched = batched_call(spec.run, spec.assignment, spec.templates, tensors, in_dims[1:], info.batch_size,
                               spec.out_format)
        if batched.pattern is not None:
            spec.result = batched.pattern
        return batched.tensor, batched.out_dim


def tangent(spec: _Spec, tensors: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor | None]):
    """The tangent of the call ``spec`` at ``tensors`` (its dense operands and sparse
    operands' values) given ``tangents`` of them (None: not moving), a compiled einsum."""
    moving = tuple(n for n, t in enumerate(tangents) if t is not None)
    assignment = tangent_assignment(spec.assignment, moving, spec.result is not None)
    inputs = spec.rebuild(tensors) + [_operand(spec.templates[n], tangents[n]) for n in moving]
    if spec.result is None:
        return spec.run(assignment, inputs, "dense")
    pattern = spec.result
    inputs.append(pattern)  # read for its stored positions only
    return spec.run(assignment, inputs, pattern.format).values


def _gradients(spec: _Spec, operands: list, grad_out, result, wanted: Sequence[int],
               read_result: bool = False) -> list:
    """d(loss)/d(operand) for each operand number in ``wanted``: a tensor shaped like its
    values (sparse) or like it (dense); zeros for one the result does not move with
    (:func:`differentiated`), None for one no factor reads. Gradient calls a call site
    holds (``spec.held``) run by their guard and run alone; the others are built and
    evaluated, and held when the site can keep them. After a forward that compiled its
    kernel, the gradients' kernels are built together first."""
    moving = differentiated(spec.assignment)
    read = {a.operand for a in spec.assignment.accesses}
    # held calls reach their kernels only: no graph recorded (create_graph), nothing observing
    holds = (spec.held is not None and not is_grad_enabled() and unobserved() and spec.assignment.reduction == "sum"
             and not read_result)
    found = _held_gradients(spec.held, operands, grad_out, wanted) if holds else {}
    calls = {n: _gradient_expression(spec, n, operands, grad_out, result, read_result)
             for n in wanted if n in moving and n not in found}
    if spec.built_kernels and len(calls) > 1:
        build_together(list(calls.values()))
    if transforming() and len(calls) > 1 and _together(spec, calls):
        from .gradients import gradients_together  # gradients -> this module

        computed = dict(zip(calls, gradients_together(spec.evaluate, list(calls.values()))))
        return [computed[n] if n in computed else _zeros(operands[n], n in read) for n in wanted]
    grads = []
    for n in wanted:
        if n in found:
            g = found[n]
        elif n in calls:
            g = spec.run(*calls[n])
            if holds:
                _hold(spec.held, n, calls[n], len(operands))
        else:
            grads.append(_zeros(operands[n], n in read))
            continue
        template = spec.templates[n]
        if isinstance(g, SparseTensor):
            g = g.values
            assert g.shape == template.values.shape, "sampled gradient lost positions of its pattern"
        elif template is not None:  # a dense-format SparseTensor: values in storage order
            g = g.permute(template.format.mode_order).reshape(-1)
        grads.append(g)
    return grads


def unobserved() -> bool:
    """Whether no autocast (on any device), torch.func transform or tracer sees the
    current call: four queries of torch's thread state (``torch.compile``'s first: its
    trace reads no other)."""
    return not (is_compiling() or _jit_tracing() or _any_autocast() or _transforms_active())


def unobserved_call(operands: Sequence) -> bool:
    """Whether nothing but evaluation sees a call over ``operands``: no autocast (on any
    device), torch.func transform or tracer, and autograd does not record it: a cached
    call's entry test."""
    return unobserved() and not recorded(operands)


def _held_gradients(held: dict[int, HeldGradient], operands: list, grad_out, wanted: Sequence[int]) -> dict:
    """The gradients of the operands in ``wanted`` whose held calls' guards pass, by operand number."""
    found = {}
    for n in wanted:
        call = held.get(n)
        if call is not None:
            inputs = [grad_out, *operands, *(operands[x] if isinstance(x, int) else x for x in call.extras)]
            if call.guard(inputs, call.out_format):
                found[n] = call.run(inputs)
    return found


def _hold(held: dict[int, HeldGradient], n: int, call: tuple, count: int) -> None:
    """Hold the gradient ``call`` of operand ``n`` (just evaluated) if its signature is
    cached. Its guard tests the output gradient in full; the forward's operands (whose
    signature the site's guard passed: ``held`` is that signature's) and the extras (held
    here) only for unedited index arrays."""
    assignment, inputs, out_format = call
    entry = guarded_run(assignment, inputs, out_format)
    if entry is not None:
        guard = call_guard(assignment, inputs, out_format, frozenset(range(1, len(inputs))))
        operands = inputs[1:1 + count]
        extras = tuple(next((m for m, op in enumerate(operands) if op is x), x) for x in inputs[1 + count:])
        held[n] = HeldGradient(assignment, out_format, extras, guard, entry[1])


def _zeros(operand, read: bool) -> torch.Tensor | None:
    """The gradient of an operand the result does not move with: 0 (its values' shape
    when sparse) if a factor reads it, else None."""
    if not read:
        return None
    return torch.zeros_like(operand.values if isinstance(operand, SparseTensor) else operand)


def _together(spec: _Spec, calls: dict[int, tuple]) -> bool:
    """Whether the gradient calls of ``spec``'s operands can run as one function under a
    torch.func transform (:mod:`.gradients`): sums whose results are dense tensors, or
    values on the operand's pattern (not a dense-format operand's values in storage order)."""
    return all(calls[n][0].reduction == "sum" and (spec.templates[n] is None or not spec.templates[n].format.is_dense)
               for n in calls)


def operand_gradients(assignment: Assignment, operands: Sequence, out_format, grad_out, result,
                      wanted: Sequence[int], read_result: bool = False) -> list:
    """The gradients :class:`_SparseEinsum` computes, for a call recorded outside torch's
    autograd (a traced ``sparsenn::evaluate`` op, a stage of a program recorded as one
    node): ``grad_out`` and ``result`` shaped as the call's result; ``read_result``: a
    pointwise statement's derivative reads its value from ``result`` instead of
    computing it again (:func:`_gradient_assignment`)."""
    templates = [op if isinstance(op, SparseTensor) else None for op in operands]
    spec = _Spec(assignment, templates, out_format, evaluate)
    with torch.no_grad():  # an op's kernel runs below autograd: nothing is recorded there
        return _gradients(spec, list(operands), grad_out, result, wanted, read_result)


def gradient_call(assignment: Assignment, operand: int, operands: Sequence, grad_out, result
                  ) -> tuple[Assignment, list, object]:
    """The gradient einsum of ``operand`` of a call of ``assignment`` over ``operands``
    (``grad_out`` and ``result`` as the call's result; a pointwise statement's derivative
    reads ``result``): its assignment over ``(grad_out, *operands, *extras)``, the extras
    (all-ones tensors, the operand's pattern, the result, a max's tie count: computed
    here) and its out_format."""
    templates = [op if isinstance(op, SparseTensor) else None for op in operands]
    spec = _Spec(assignment, templates, None, evaluate)
    with torch.no_grad():
        gradient, inputs, out_format = _gradient_expression(spec, operand, list(operands), grad_out, result, True)
    return gradient, inputs[1 + len(operands):], out_format


def recorded(operands: Sequence) -> bool:
    """Whether autograd records a call over ``operands`` (grad mode, and a dense operand or
    sparse operand's values requiring grad)."""
    if not is_grad_enabled():
        return False
    for op in operands:  # a plain loop: this runs on every call
        if isinstance(op, SparseTensor):
            op = op.values
        elif not isinstance(op, torch.Tensor):
            continue
        if op.requires_grad:
            return True
    return False


def differentiable_evaluate(evaluate, assignment: Assignment, operands: Sequence, out_format):
    """``evaluate(assignment, operands, out_format)``, recorded for autograd when any
    dense operand or sparse operand's values require grad, and for a torch.func transform
    (whose rules :class:`_SparseEinsum` defines) while one runs. An epilogue is then run
    as a second, elementwise assignment over the saved reduced values (see
    :func:`~.plan.bias.split_epilogue`). Under a tracer each evaluation is one
    ``sparsenn::evaluate`` op (:mod:`.runtime.tracing`) with the same gradients."""
    if tracing():  # each op's autograd formula records its gradients
        if assignment.epilogue is None or not recorded(operands):
            return traced_evaluate(assignment, operands, out_format)
        pre = traced_evaluate(assignment, operands, "dense", ("reduced",))
        return traced_evaluate(assignment, [pre, *(operands[n] for n in _epilogue_reads(assignment))], out_format,
                               ("epilogue",))
    if not recorded(operands) and not transforming():
        return evaluate(assignment, operands, out_format)
    if assignment.epilogue is not None:
        reduced, apply_epilogue, read = split_epilogue(assignment)
        pre = differentiable_evaluate(evaluate, reduced, operands, "dense")
        return differentiable_evaluate(evaluate, apply_epilogue, [pre, *(operands[n] for n in read)], out_format)
    tensors = [op.values if isinstance(op, SparseTensor) else op for op in operands]
    templates = []
    for op in operands:
        if isinstance(op, SparseTensor):
            templates.append(op)
        elif isinstance(op, torch.Tensor):
            templates.append(None)
        else:
            return evaluate(assignment, operands, out_format)  # raises the usual TypeError
    spec = _Spec(assignment, templates, out_format, evaluate)
    values = _apply(_SparseEinsum, spec, *tensors)
    return values if spec.result is None else _operand(spec.result, values)


def held_evaluate(assignment: Assignment, operands: Sequence, out_format, run: Run,
                  held: dict[int, HeldGradient]):
    """``run(operands)``, the held signature of a call site's ``assignment`` (no
    epilogue), recorded for autograd as :func:`differentiable_evaluate` records it; its
    backward's gradient calls are held in ``held`` (:class:`HeldGradient`)."""
    tensors = [op.values if isinstance(op, SparseTensor) else op for op in operands]
    templates = [op if isinstance(op, SparseTensor) else None for op in operands]
    spec = _Spec(assignment, templates, out_format, evaluate, run, held)
    values = _apply(_SparseEinsum, spec, *tensors)
    return values if spec.result is None else _operand(spec.result, values)


def _apply(function: type[torch.autograd.Function], spec: _Spec, *tensors):
    """``function.apply(spec, *tensors)`` for a Function whose ``forward`` has no default
    arguments: what ``Function.apply`` does (torch.func's dispatch under a transform, else
    dead functorch wrappers unwrapped and torch's C entry point) without the rest of its
    Python wrapper, which costs as much as a small call's kernel (binding the default
    arguments with ``inspect`` once ``setup_context`` is defined: several µs per call)."""
    if _transforms_active():
        return custom_function_call(function, spec, *tensors)
    entry = _C_APPLY.get(function)
    if entry is None:
        entry = _C_APPLY[function] = super(torch.autograd.Function, function).apply
    return entry(spec, *[_unwrap_if_dead(t) for t in tensors])


_C_APPLY: dict[type, object] = {}  # per Function, torch's C entry point
