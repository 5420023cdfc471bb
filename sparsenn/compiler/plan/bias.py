"""Biases folded into an epilogue.

A term whose factors are all dense and indexed by output indices only adds the same
dense values to the output whatever the other terms do: ``Y[b,o] = X[b,i] W[o,i] +
bias[o]``. As a term it is a second nest, a second pass over the output; folded into
the epilogue (``Y = R + bias[o]``, :class:`~..notation.Epilogue`) it is added to each
output slice right after the product that finishes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsenn.formats import Format

from ..functions import apply
from ..notation import Assignment, Constant, Epilogue, Factor, Reduced, Term, Value
from .infer import result_format

__all__ = ["fold_bias"]


def _is_bias(term: Term, output: tuple[str, ...], formats: Sequence[Format | None]) -> bool:
    return (term.value is None and bool(term.factors) and set(term.indices) <= set(output)
            and all(formats[a.operand] is None for a in term.factors))


def fold_bias(assignment: Assignment, formats: Sequence[Format | None], request) -> Assignment:
    """``assignment`` with its bias terms in an epilogue when it is a sum of products
    whose result is dense (``request``: the checked ``out_format``); itself when it
    has no bias terms, or nothing but them."""
    if not assignment.is_product_sum or len(assignment.terms) < 2:
        return assignment
    if not (request == "dense" or (request is None and result_format(assignment, formats) is None)):
        return assignment
    output = assignment.output
    bias = [t for t in assignment.terms if _is_bias(t, output, formats)]
    kept = [t for t in assignment.terms if not _is_bias(t, output, formats)]
    if not bias or not kept:
        return assignment
    factors: list = []
    value: Value = Reduced()
    for term in bias:
        product: Value = Constant(term.coefficient)
        for access in term.factors:
            product = apply("mul", product, Factor(len(factors)))
            factors.append(access)
        value = apply("add", value, product)
    return Assignment(output, tuple(kept), assignment.operand_names, "sum", Epilogue(tuple(factors), value))
