"""Biases folded into an epilogue, invariant factors moved out of a sum, and an
epilogue split off its reduction.

A term whose factors are all dense and indexed by output indices only adds the same
dense values to the output whatever the other terms do: ``Y[b,o] = X[b,i] W[o,i] +
bias[o]``. As a term it is a second nest, a second pass over the output; folded into
the epilogue (``Y = R + bias[o]``, :class:`~..frontend.notation.Epilogue`) it is added to each
output slice right after the product that finishes it. Likewise a reduced term's value
that multiplies a function of dense factors indexed by output indices only
(``dZ[i] = sum_j dP[i,j] E[i,j] (-1 / Z[i]^2)``, a derivative) varies along no summed
index: :func:`hoist_invariant` computes it once per output element, in the epilogue
(``dZ = R · (-1 / Z^2)``), leaving a plain product to sum. :func:`split_epilogue` undoes
an epilogue into the reduction and one elementwise assignment over its result (training
keeps the reduced values; a contraction path computes them apart).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sparsenn.formats import Format

from ..frontend.functions import apply, factors_of, renumbered
from ..frontend.notation import Access, Apply, Assignment, Constant, Epilogue, Factor, Reduced, Term, Value
from .infer import result_format

__all__ = ["fold_bias", "hoist_invariant", "split_epilogue"]


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


def hoist_invariant(assignment: Assignment, formats: Sequence[Format | None], request) -> Assignment:
    """``assignment`` with the multiplicands of its one reduced term's value that read only
    dense factors indexed by output indices moved into an epilogue (see the module doc);
    itself when there are none, or when it is not such a sum with a dense result."""
    if (assignment.reduction != "sum" or assignment.epilogue is not None or len(assignment.terms) != 1
            or not (request == "dense" or (request is None and result_format(assignment, formats) is None))):
        return assignment
    (term,) = assignment.terms
    output = set(assignment.output)
    if term.value is None or set(term.indices) <= output:
        return assignment
    invariant = {k for k, a in enumerate(term.factors) if formats[a.operand] is None and set(a.indices) <= output}
    moved, kept = [], []
    for part in _multiplicands(term.value, invariant):
        (moved if factors_of(part) <= invariant and factors_of(part) else kept).append(part)
    if not moved or not kept:
        return assignment
    read_by_kept = set().union(*(factors_of(p) for p in kept))
    remaining = [k for k in range(len(term.factors)) if k in read_by_kept or k not in invariant]
    hoisted = sorted(set().union(*(factors_of(p) for p in moved)))
    value = _product_of(kept, {k: n for n, k in enumerate(remaining)})
    epilogue = apply("mul", Reduced(), _product_of(moved, {k: n for n, k in enumerate(hoisted)}))
    reduced = Term(term.coefficient, tuple(term.factors[k] for k in remaining), value)
    return Assignment(assignment.output, (reduced,), assignment.operand_names, "sum",
                      Epilogue(tuple(term.factors[k] for k in hoisted), epilogue))


def _multiplicands(value: Value, invariant: set[int]) -> list[Value]:
    """The operands of ``value``'s top-level chain of products, a division by a function
    of ``invariant`` factors read as a product with its reciprocal."""
    if isinstance(value, Apply) and value.function == "mul":
        return [m for arg in value.args for m in _multiplicands(arg, invariant)]
    if isinstance(value, Apply) and value.function == "div" and factors_of(value.args[1]) and (
            factors_of(value.args[1]) <= invariant):
        return _multiplicands(value.args[0], invariant) + [Apply("div", (Constant(1.0), value.args[1]))]
    return [value]


def _product_of(parts: Sequence[Value], numbers: dict[int, int]) -> Value:
    """The product of ``parts``, factor ``k`` read as factor ``numbers[k]``."""
    product: Value | None = None
    for part in parts:
        part = renumbered(part, lambda k: Factor(numbers[k]))
        product = part if product is None else apply("mul", product, part)
    return product


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
