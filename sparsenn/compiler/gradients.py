"""A backward's gradient einsums under a torch.func transform, as one function.

A backward computes d(loss)/d(operand) for each wanted operand with one einsum
(:func:`.autograd._gradient_expression`). Under a transform (``vmap(grad(...))``: per-sample
gradients) each einsum applied as its own ``autograd.Function`` passes torch.func's Python
machinery at every level (a Function class made per call, pytree flattening of its
arguments): a few hundred µs each, more than a small call's kernels. :class:`_Gradients`
applies all of a backward's einsums as one Function, with the rules of each einsum: ``vmap``
batches each (one kernel each, :func:`.batching.batched_call`), ``backward`` (a second
derivative) and ``jvp`` apply each one's own (:func:`.autograd._gradients`,
:func:`.autograd.tangent`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sparsenn.formats import SparseTensor

from .autograd import _apply, _gradients, _operand, _Spec, tangent
from .batching import batched_call
from .runtime.tracing import transforming

__all__ = ["gradients_together"]


class _Calls:
    """The einsums of one backward: a :class:`~.autograd._Spec` each (its ``result`` the
    pattern of a sparse result, once computed) and the positions of its inputs among the
    flat tensors, each tensor once (the incoming gradient and the call's operands feed
    every einsum: fewer arguments for torch.func to flatten and wrap)."""

    def __init__(self, specs: list[_Spec], positions: list[list[int]]) -> None:
        self.specs, self.positions = specs, positions

    def split(self, tensors: Sequence) -> list[list]:
        """Per einsum, its inputs' entries of ``tensors`` (one per flat tensor)."""
        return [[tensors[k] for k in where] for where in self.positions]


class _Gradients(torch.autograd.Function):
    """Several einsums as one function of all their inputs (dense tensors, sparse
    operands' values); one output each: a dense result, or a sparse result's values."""

    @staticmethod
    def forward(calls: _Calls, *tensors):
        outputs = []
        for spec, part in zip(calls.specs, calls.split(tensors)):
            part = [t if tpl is None else t.contiguous() for tpl, t in zip(spec.templates, part)]
            result = spec.evaluate(spec.assignment, spec.rebuild(part), spec.out_format)
            if isinstance(result, SparseTensor):
                spec.result = result
                result = result.values
            outputs.append(result)
        return tuple(outputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.calls = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        calls: _Calls = ctx.calls
        tensors = ctx.saved_tensors
        needed = ctx.needs_input_grad[1:]
        out: list = [None] * len(tensors)
        for spec, part, where, grad in zip(calls.specs, calls.split(tensors), calls.positions, grads):
            wanted = [n for n, k in enumerate(where) if needed[k]]
            if grad is None or not wanted:
                continue
            grad_out = _operand(spec.result, grad if transforming() else grad.contiguous())
            for n, g in zip(wanted, _gradients(spec, spec.rebuild(part), grad_out, None, wanted)):
                if g is not None:
                    k = where[n]
                    out[k] = g if out[k] is None else out[k] + g
        return (None, *out)

    @staticmethod
    def jvp(ctx, _, *tangents):
        calls: _Calls = ctx.calls
        return tuple(tangent(spec, part, moving) for spec, part, moving
                     in zip(calls.specs, calls.split(ctx.saved_tensors), calls.split(tangents)))

    @staticmethod
    def vmap(info, in_dims, calls: _Calls, *tensors):
        outputs, out_dims = [], []
        for spec, part, dims in zip(calls.specs, calls.split(tensors), calls.split(in_dims[1:])):
            batched = batched_call(spec.run, spec.assignment, spec.templates, part, dims, info.batch_size,
                                   spec.out_format)
            if batched.pattern is not None:
                spec.result = batched.pattern
            outputs.append(batched.tensor)
            out_dims.append(batched.out_dim)
        return tuple(outputs), tuple(out_dims)


def gradients_together(evaluate: Callable, calls: list[tuple]) -> list[torch.Tensor]:
    """The results of gradient calls ``(assignment, inputs, out_format)`` (inputs dense
    tensors or SparseTensors; sums, with a dense result or one on a sparse input's
    pattern) as one :class:`_Gradients`: each a dense tensor or the sparse result's values."""
    specs, positions, tensors, seen = [], [], [], {}
    for assignment, inputs, out_format in calls:
        templates = [op if isinstance(op, SparseTensor) else None for op in inputs]
        specs.append(_Spec(assignment, templates, out_format, evaluate))
        where = []
        for op in inputs:
            tensor = op.values if isinstance(op, SparseTensor) else op
            if id(tensor) not in seen:
                seen[id(tensor)] = len(tensors)
                tensors.append(tensor)
            where.append(seen[id(tensor)])
        positions.append(where)
    return list(_apply(_Gradients, _Calls(specs, positions), *tensors))
