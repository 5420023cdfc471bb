"""A matrix product plus broadcast terms as one BLAS call, for the dense path.

``out[p, q] = α Σ_c A[p, c] B[q, c] + Σ β_t bias_t[p or q or both]`` (the factors in any
layout, the output in either order of ``p`` and ``q``) is ``torch.addmm(bias, A', B',
beta=β, alpha=α)`` on views of the factors (BLAS reads a transposed view as it is):
one call, the bias broadcast by BLAS's own ``C`` input, where one ``torch.einsum`` per
term and an add make three passes and their dispatches (a SparseLinear layer's dense
path at batch 1: 25 µs against 11 µs). ``A · Wᵀ + bias[q]`` (the right factor read
transposed, no coefficients) is ``F.linear(A, W, bias)``, which takes the transpose
inside torch: a view made in Python costs about 2 µs. The form is worked out once per
assignment (:func:`blas_form`), so a call costs the views and the BLAS call. Its gradients
(:meth:`BlasForm.gradients`) are BLAS calls and sums too: ``dA' = α · dOut · B'ᵀ``,
``dB' = α · A'ᵀ · dOut``, ``dbias_t = β_t · dOut`` summed over the indices it lacks,
each factor read through one view at most (``B'ᵀ`` of a factor read transposed is the
operand itself).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..frontend.notation import Access, Assignment, Term

__all__ = ["BlasForm", "blas_form"]


@dataclass(frozen=True)
class _Matrix:
    """An operand read as a matrix of the product: itself, or its transposed view."""

    operand: int
    transposed: bool

    def of(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        tensor = operands[self.operand]
        return tensor.T if self.transposed else tensor

    def transposed_of(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        """The transpose of :meth:`of`."""
        tensor = operands[self.operand]
        return tensor if self.transposed else tensor.T


@dataclass(frozen=True)
class _Bias:
    """A one-factor term: ``coefficient`` times its operand, broadcast over the output
    ``(p, q)`` (``over_rows``: it holds ``p`` alone, viewed as a column)."""

    operand: int
    coefficient: float
    transposed: bool
    over_rows: bool
    columns_only: bool  # it holds ``q`` alone: a vector over the columns

    def of(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        tensor = operands[self.operand]
        if self.over_rows:
            return tensor.unsqueeze(1)
        return tensor.T if self.transposed else tensor

    def gradient(self, ndim: int, grad: torch.Tensor) -> torch.Tensor:
        """``dOut`` summed over the output indices this term lacks, in its operand's
        layout (``ndim`` its operand's order), the coefficient not applied."""
        if self.over_rows:
            return grad.sum(1)
        if ndim == 1:
            return grad.sum(0)
        return grad.T if self.transposed else grad


@dataclass(frozen=True)
class BlasForm:
    """``alpha · lhs @ rhs + Σ biases`` (see the module doc)."""

    lhs: _Matrix
    rhs: _Matrix
    alpha: float
    biases: tuple[_Bias, ...]

    @functools.cached_property
    def linear(self) -> bool:
        """Whether the form is ``F.linear(A, W, bias)``: ``A · Wᵀ`` with at most one bias
        over the columns alone, no coefficients."""
        return (not self.lhs.transposed and self.rhs.transposed and self.alpha == 1.0 and len(self.biases) <= 1
                and all(b.coefficient == 1.0 and b.columns_only for b in self.biases))

    def run(self, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.linear:
            bias = operands[self.biases[0].operand] if self.biases else None
            return F.linear(operands[self.lhs.operand], operands[self.rhs.operand], bias)
        lhs, rhs = self.lhs.of(operands), self.rhs.of(operands)
        if not self.biases:
            out = torch.mm(lhs, rhs)
            return out if self.alpha == 1.0 else out.mul_(self.alpha)
        first, *rest = self.biases
        bias, beta = first.of(operands), first.coefficient
        if rest:
            bias = beta * bias + sum(b.coefficient * b.of(operands) for b in rest)
            beta = 1.0
        return torch.addmm(bias, lhs, rhs, beta=beta, alpha=self.alpha)

    def gradients(self, operands: Sequence[torch.Tensor], grad: torch.Tensor,
                  wanted: Sequence[bool]) -> list[torch.Tensor | None]:
        """``d(loss)/d(operand)`` of each operand ``n`` with ``wanted[n]`` that the form
        reads (else None), given ``grad = d(loss)/d(out)``, in its operand's shape (see
        the module doc); a factor's computed in its operand's own layout, as torch's
        ``mm`` backward does (``dOutᵀ · X`` for a weight read transposed: a 512×128 by
        512×7 product 4x faster than its transpose). Recorded by autograd when grad mode
        is on (``create_graph``)."""
        grads: list[torch.Tensor | None] = [None] * len(operands)
        lhs, rhs, alpha = self.lhs, self.rhs, self.alpha
        if wanted[lhs.operand]:  # dA' = dOut · B'ᵀ, or its transpose B' · dOutᵀ when A is A'ᵀ
            g = torch.mm(rhs.of(operands), grad.T) if lhs.transposed else torch.mm(grad, rhs.transposed_of(operands))
            _add(grads, lhs.operand, g if alpha == 1.0 else g * alpha)
        if wanted[rhs.operand]:  # dB' = A'ᵀ · dOut, or its transpose dOutᵀ · A' when B is B'ᵀ
            g = torch.mm(grad.T, lhs.of(operands)) if rhs.transposed else torch.mm(lhs.transposed_of(operands), grad)
            _add(grads, rhs.operand, g if alpha == 1.0 else g * alpha)
        for bias in self.biases:
            if wanted[bias.operand]:
                g = bias.gradient(operands[bias.operand].dim(), grad)
                _add(grads, bias.operand, g if bias.coefficient == 1.0 else g * bias.coefficient)
        return grads


def _add(grads: list[torch.Tensor | None], n: int, g: torch.Tensor) -> None:
    """Add ``g`` to operand ``n``'s gradient (an operand read by several terms)."""
    grads[n] = g if grads[n] is None else grads[n] + g


@functools.lru_cache(maxsize=256)
def blas_form(assignment: Assignment) -> BlasForm | None:
    """The one-BLAS-call form of a plain sum of products over dense operands: one term
    the product of two factors over three distinct indices, ``p`` and ``q`` each in one
    factor and the output, ``c`` in both factors and summed; every other term one factor
    over distinct output indices. None for any other form."""
    products = [t for t in assignment.terms if len(t.factors) == 2]
    if len(products) != 1 or len(assignment.output) != 2 or not assignment.is_product_sum:
        return None
    (term,) = products
    matrices = _matrices(term, assignment.output)
    others = [t for t in assignment.terms if t is not term]
    biases = [_bias(t, assignment.output) for t in others]
    if matrices is None or None in biases:
        return None
    return BlasForm(*matrices, term.coefficient, tuple(biases))


def _matrices(term: Term, output: tuple[str, ...]) -> tuple[_Matrix, _Matrix] | None:
    """(left ``[p, c]``, right ``[c, q]``) of the two factors of ``term`` for the output
    ``(p, q)``, or None if the term is not such a product."""
    a, b = term.factors
    p, q = output
    if p in b.indices:
        a, b = b, a
    if len(a.indices) != 2 or len(b.indices) != 2 or p not in a.indices or q not in b.indices:
        return None
    shared = set(a.indices) & set(b.indices)
    if len(shared) != 1 or len(set(a.indices) | set(b.indices)) != 3:
        return None
    (c,) = shared
    if c in output:
        return None
    return _Matrix(a.operand, a.indices != (p, c)), _Matrix(b.operand, b.indices != (c, q))


def _bias(term: Term, output: tuple[str, ...]) -> _Bias | None:
    """``term`` as a bias over the output, or None if it is not one factor over
    distinct output indices."""
    if len(term.factors) != 1:
        return None
    (access,) = term.factors
    indices: tuple[str, ...] = access.indices if isinstance(access, Access) else ()
    if not indices or len(set(indices)) != len(indices) or not set(indices) <= set(output):
        return None
    return _Bias(access.operand, term.coefficient, indices == output[::-1], indices == output[:1],
                 indices == output[1:])
