"""Biases folded into an epilogue, and an epilogue split off its reduction.

A term whose factors are all dense and indexed by output indices only adds the same
dense values to the output whatever the other terms do: ``Y[b,o] = X[b,i] W[o,i] +
bias[o]``. As a term it is a second nest, a second pass over the output; folded into
the epilogue (``Y = R + bias[o]``, :class:`~..frontend.notation.Epilogue`) it is added to each
output slice right after the product that finishes it. :func:`split_epilogue` undoes
an epilogue into the reduction and one elementwise assignment over its result (training
keeps the reduced values; a contraction path computes them apart).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sparsenn.formats import Format

from ..frontend.functions import apply
from ..frontend.notation import Access, Apply, Assignment, Constant, Epilogue, Factor, Reduced, Term, Value
from .infer import result_format

__all__ = ["fold_bias", "split_epilogue"]


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


@functools.lru_cache(maxsize=256)
def split_epilogue(assignment: Assignment) -> tuple[Assignment, Assignment, tuple[int, ...]]:
    """``Out = epilogue(R)`` as ``R`` (the reduced terms, a dense result) and the
    epilogue as one elementwise term over ``R`` (factor 0) and the operands it reads
    (their numbers returned, in order: factors 1, 2, ...)."""
    epilogue = assignment.epilogue
    reduced = Assignment(assignment.output, assignment.terms, assignment.operand_names, assignment.reduction)
    read = tuple(sorted({a.operand for a in epilogue.factors}))
    factors = (Access(0, assignment.output),) + tuple(Access(1 + read.index(a.operand), a.indices)
                                                     for a in epilogue.factors)
    names = ("Reduced",) + tuple(assignment.operand_names[n] for n in read)
    term = Term(1.0, factors, _over_reduced(epilogue.value))
    return reduced, Assignment(assignment.output, (term,), names), read


def _over_reduced(value: Value) -> Value:
    """An epilogue's value as a term's: the reduced value is factor 0, epilogue factor
    ``k`` is ``k + 1``."""
    if isinstance(value, Reduced):
        return Factor(0)
    if isinstance(value, Factor):
        return Factor(value.k + 1)
    if isinstance(value, Apply):
        return Apply(value.function, tuple(_over_reduced(a) for a in value.args))
    return value
