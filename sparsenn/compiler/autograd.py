"""Autograd: every backward pass is itself a compiled sparse einsum.

For ``Out = sum_t c_t prod_f T_f`` the gradient with respect to an operand ``X`` sums,
over each factor ``f`` that reads ``X``, the product of the output gradient and the
other factors of ``f``'s term, contracted onto ``f``'s indices:

* ``X`` dense: ``dX[x] = sum_t c_t sum_{rest} dOut[o] prod_{g != f} T_g`` — an ordinary
  (often sparse-times-dense) einsum with a dense result;
* ``X`` sparse: the gradient lives on ``X``'s pattern only (its values are the leaf),
  so the same product is *sampled* by a mask with ``X``'s pattern — an SDDMM-like kernel
  that iterates the pattern — plus a zero-valued copy of the pattern, so the result has
  exactly ``X``'s stored positions and its values line up with ``X.values``.

All contributions for one operand form one sum-of-products expression, compiled and
scheduled like any other. Only the gradients that are needed are built and run.
Higher-order gradients are not supported.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from sparsenn.formats import SparseTensor

from .notation import Access, Assignment, Term

__all__ = ["differentiable_evaluate"]


class _Spec:
    """Everything about a call that is not a tensor autograd tracks."""

    def __init__(self, assignment: Assignment, operands: Sequence, templates: list, out_format, evaluate):
        self.assignment = assignment
        self.operands = operands  # as given, for the forward pass only
        self.templates = templates  # per operand: SparseTensor pattern, or None if dense
        self.out_format = out_format
        self.evaluate = evaluate
        self.result: SparseTensor | None = None

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> list:
        return [t if tpl is None else tpl.with_values(t) for tpl, t in zip(self.templates, tensors)]


def _gradient_expression(spec: _Spec, operand: int, operands: list, grad_out) -> tuple[Assignment, list, object]:
    """The assignment, operand list and out_format computing d(loss)/d(operand)."""
    template = spec.templates[operand]
    if template is not None and template.format.is_dense:
        template = None  # stored densely: compute a dense gradient, then lay it out as values
    rank = len(operands[operand].shape)
    assignment, ones = _gradient_assignment(spec.assignment, operand, rank, template is not None)
    inputs = [grad_out] + list(operands)
    if template is not None:  # the pattern, with ones: samples the product at the pattern
        inputs.append(template.with_values(torch.ones_like(template.values)))
        return assignment, inputs, template.format
    shape = operands[operand].shape
    inputs += [torch.ones([shape[m] for m in modes], dtype=_dtype_of(grad_out)) for modes in ones]
    return assignment, inputs, "dense"


@functools.lru_cache(maxsize=1024)
def _gradient_assignment(assignment: Assignment, operand: int, rank: int,
                         sampled: bool) -> tuple[Assignment, tuple[tuple[int, ...], ...]]:
    """d(loss)/d(operand) as an assignment over ``(grad_out, *operands, extra...)``.

    ``sampled``: the extra input is a mask with the operand's pattern. Otherwise the
    extra inputs are all-ones tensors over the operand's modes (returned, in order) that
    a contributing factor reads but no other factor of its term covers: the gradient is
    constant along them. Cached: the same call's backward builds the same expression."""
    target = tuple(f"@{m}" for m in range(rank))  # cannot clash with user index names
    extra = 1 + assignment.num_operands
    ones: list[tuple[int, ...]] = []
    terms = []
    for term in assignment.terms:
        for k, factor in enumerate(term.factors):
            if factor.operand != operand:
                continue
            rename = dict(zip(factor.indices, target))

            def renamed(indices, rename=rename):
                return tuple(rename.get(i, i) for i in indices)

            factors = [Access(0, renamed(assignment.output))]
            factors += [Access(1 + g.operand, renamed(g.indices)) for j, g in enumerate(term.factors) if j != k]
            covered = {i for f in factors for i in f.indices}
            if sampled:
                factors.append(Access(extra, target))
            else:
                missing = tuple(i for i in target if i not in covered)
                if missing:
                    factors.append(Access(extra + len(ones), missing))
                    ones.append(tuple(target.index(i) for i in missing))
            terms.append(Term(term.coefficient, tuple(factors)))
    if sampled:
        # 0 * mask keeps every stored position in the result, so values line up with X's.
        terms.append(Term(0.0, (Access(extra, target),)))
    names = tuple(f"operand{n}" for n in range(extra + (1 if sampled else len(ones))))
    return Assignment(target, tuple(terms), names), tuple(ones)


def _dtype_of(grad_out) -> torch.dtype:
    return grad_out.values.dtype if isinstance(grad_out, SparseTensor) else grad_out.dtype


class _SparseEinsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):
        result = spec.evaluate(spec.assignment, spec.operands, spec.out_format)  # operands hold ``tensors``
        spec.operands = None
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        if isinstance(result, SparseTensor):
            spec.result = result  # the pattern is fixed; its values carry the gradient
            return result.values
        return result

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "sparsenn: higher-order gradients (create_graph=True) of sparse einsums are not supported"
            )
        spec: _Spec = ctx.spec
        tensors = ctx.saved_tensors
        operands = spec.rebuild(tensors)
        grad_out = spec.result.with_values(grad.contiguous()) if spec.result is not None else grad.contiguous()
        grads = []
        for n, needed in enumerate(ctx.needs_input_grad[1:]):
            if not needed:
                grads.append(None)
                continue
            assignment, inputs, out_format = _gradient_expression(spec, n, operands, grad_out)
            g = spec.evaluate(assignment, inputs, out_format)
            template = spec.templates[n]
            if isinstance(g, SparseTensor):
                g = g.values
                assert g.shape == tensors[n].shape, "sampled gradient lost positions of its pattern"
            elif template is not None:  # a dense-format SparseTensor: values in storage order
                g = g.permute(template.format.mode_order).reshape(-1)
            grads.append(g)
        return (None, *grads)


def differentiable_evaluate(evaluate, assignment: Assignment, operands: Sequence, out_format):
    """``evaluate(assignment, operands, out_format)``, recorded for autograd when any
    dense operand or sparse operand's values require grad."""
    if not torch.is_grad_enabled() or not any(
        (op.values if isinstance(op, SparseTensor) else op).requires_grad
        for op in operands if isinstance(op, (SparseTensor, torch.Tensor))
    ):
        return evaluate(assignment, operands, out_format)
    tensors = [op.values if isinstance(op, SparseTensor) else op for op in operands]
    templates = []
    for op in operands:
        if isinstance(op, SparseTensor):
            templates.append(op)
        elif isinstance(op, torch.Tensor):
            templates.append(None)
        else:
            return evaluate(assignment, operands, out_format)  # raises the usual TypeError
    spec = _Spec(assignment, operands, templates, out_format, evaluate)
    values = _SparseEinsum.apply(spec, *tensors)
    return spec.result.with_values(values) if spec.result is not None else values
