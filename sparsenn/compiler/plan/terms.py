"""Terms that visit the same points, merged into one.

A term is visited where all its sparse factors store an entry. Terms of a sum whose
sparse factors have the same patterns, read at the same indices (the same operand, or
operands sharing its index arrays: ``P`` and ``dP = P.with_values(...)``), over the
same indices, are visited at the same points: one term whose value is the sum of
their values computes the same result in one pass, without co-iterating equal
patterns. ``dS<P>[i,j] = P[i,j] * (dP[i,j] - G[i])`` (three terms once staged:
``P dP``, ``-P G`` and the mask's ``0 P``) becomes the single term
``P dP - P G`` over ``P, dP, G``. Only sum reductions: a max or min is taken per term.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..frontend.functions import apply, product, renumbered
from ..frontend.notation import Access, Assignment, Constant, Factor, Term, Value
from .cost import OperandInfo

__all__ = ["merge_terms"]


def merge_terms(assignment: Assignment, infos: Sequence[OperandInfo]) -> Assignment:
    """``assignment`` with the terms that visit the same points merged (see the module
    doc); itself when no two do."""
    if assignment.reduction != "sum" or len(assignment.terms) < 2:
        return assignment
    groups: dict[tuple | None, list[Term]] = {}
    for term in assignment.terms:
        groups.setdefault(_visits(term, infos), []).append(term)
    terms: list[Term] = []
    for key, group in groups.items():
        terms.extend(group if key is None or len(group) == 1 else [_merged(group)])
    if len(terms) == len(assignment.terms):
        return assignment
    return Assignment(assignment.output, tuple(terms), assignment.operand_names, assignment.reduction,
                      assignment.epilogue)


def _visits(term: Term, infos: Sequence[OperandInfo]) -> tuple | None:
    """What decides where ``term`` is visited: its sparse factors' patterns and
    indices, and its indices; None for a term of dense factors only (never merged)."""
    sparse = frozenset((_root(a.operand, infos), a.indices) for a in term.factors
                       if infos[a.operand].format is not None)
    if not sparse:
        return None
    return sparse, frozenset(i for a in term.factors for i in a.indices)


def _root(operand: int, infos: Sequence[OperandInfo]) -> int:
    """The first operand with ``operand``'s index arrays."""
    pattern = infos[operand].pattern
    return operand if pattern is None else pattern


def _merged(group: Sequence[Term]) -> Term:
    """One term over the group's distinct factors whose value is the sum of theirs."""
    factors: list[Access] = []
    total: Value | None = None
    for term in group:
        if term.coefficient == 0.0:
            continue
        numbers = []
        for access in term.factors:
            if access not in factors:
                factors.append(access)
            numbers.append(factors.index(access))
        value = renumbered(term.value if term.value is not None else product(len(term.factors)),
                           lambda k, numbers=numbers: Factor(numbers[k]))
        if term.coefficient != 1.0:
            value = apply("mul", Constant(term.coefficient), value)
        total = value if total is None else apply("add", total, value)
    for term in group:  # the factors of terms that only count their positions (a mask's zero term)
        factors += [a for a in term.factors if a not in factors]
    return Term(1.0, tuple(factors), Constant(0.0) if total is None else total)
