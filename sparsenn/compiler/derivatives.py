"""The derivatives of an assignment, as assignments: the symbolic half of autograd.

For ``Out = sum_t c_t prod_f T_f`` the gradient with respect to an operand ``X`` sums,
over each factor ``f`` that reads ``X``, the product of the output gradient and the
other factors of ``f``'s term, contracted onto ``f``'s indices
(:func:`gradient_assignment`):

* ``X`` dense: ``dX[x] = sum_t c_t sum_{rest} dOut[o] prod_{g != f} T_g`` — an ordinary
  (often sparse-times-dense) einsum with a dense result;
* ``X`` sparse: the gradient lives on ``X``'s pattern only (its values are the leaf),
  so the same product is *sampled* by a mask with ``X``'s pattern (read for its stored
  positions only) — an SDDMM-like kernel that iterates the pattern — plus a zero-valued
  copy of the pattern, so the result has exactly ``X``'s stored positions and its values
  line up with ``X.values``; that copy is left out when nothing else narrows the
  pattern (:func:`without_zero_term`: the kernel then writes at the mask's positions).

A term with a value tree ``v`` over its factors contributes ``dOut * dv/dT_f``, the
derivative tree built by :func:`~.frontend.functions.derivative` and read at the same points
(all the term's factors, so the term's pattern); under a max or min, only where ``v``
equals the result, split equally between ties (:func:`ties`, as ``torch.amax``).

Forward mode (:func:`tangent_assignment`): ``dOut = sum_t sum_{f reads X} (T_f replaced
by dT_f)`` of a multilinear term (a value tree contributes ``dv/dT_f * dT_f``), one einsum.
"""

from __future__ import annotations

import functools

from sparsenn.formats import Format

from .frontend.functions import apply, derivative, product, renumbered
from .frontend.notation import Access, Apply, Assignment, Constant, Factor, Term, Value
from .plan.anchor import sampled_operand

__all__ = ["Extra", "differentiated", "gradient_assignment", "reduced_value", "tangent_assignment", "ties",
           "without_zero_term"]


# What a gradient expression reads besides ``(grad_out, *operands)``, in order: an
# all-ones tensor over some of the operand's modes, the operand's pattern (the operand
# itself: its values are not read), the forward result, or the number of arg-max entries
# of each output element.
Extra = tuple


def _rename(indices: tuple[str, ...], rename: dict[str, str]) -> tuple[str, ...]:
    return tuple(rename.get(i, i) for i in indices)


def reduced_value(term: Term) -> Value:
    """What the reduction combines: the term's value (its product by default) times its
    coefficient."""
    value = product(len(term.factors)) if term.value is None else term.value
    return value if term.coefficient == 1.0 else apply("mul", Constant(term.coefficient), value)


def _shifted_one(value: Value) -> Value:
    """``value`` with every factor number moved on by one (``dOut`` is factor 0)."""
    return renumbered(value, lambda k: Factor(k + 1))


def _pointwise(assignment: Assignment) -> bool:
    """Whether ``assignment`` is ``Out = v(T...)`` at each visited point: one term,
    coefficient 1, every index an output index."""
    if assignment.reduction != "sum" or len(assignment.terms) != 1:
        return False
    (term,) = assignment.terms
    return term.coefficient == 1.0 and all(i in assignment.output for a in term.factors for i in a.indices)


def _replaced(tree: Value, part: Value, by: Value) -> Value:
    """``tree`` with every subtree equal to ``part`` replaced by ``by``."""
    if tree == part:
        return by
    if isinstance(tree, Apply):
        return Apply(tree.function, tuple(_replaced(a, part, by) for a in tree.args))
    return tree


@functools.lru_cache(maxsize=1024)
def differentiated(assignment: Assignment) -> frozenset[int]:
    """The operands the result moves with: those a term multiplies, or whose value tree's
    derivative is not 0 (a factor read for its pattern only, or under ``detach``, has none)."""
    operands = set()
    for term in assignment.terms:
        multiplied = term.multiplied if assignment.reduction == "sum" else None
        value = reduced_value(term)
        for k, factor in enumerate(term.factors):
            if (multiplied is not None and k in multiplied) or derivative(value, Factor(k)) != Constant(0.0):
                operands.add(factor.operand)
    return frozenset(operands)


@functools.lru_cache(maxsize=256)
def ties(assignment: Assignment) -> Assignment:
    """``count[o] = sum_r (value == Out[o])`` over ``(*operands, Out)``: how many entries
    share each max (or min), which split its gradient equally (as torch.amax)."""
    (term,) = assignment.terms
    out = Access(assignment.num_operands, assignment.output)
    value = apply("equal", reduced_value(term), Factor(len(term.factors)))
    names = assignment.operand_names + ("Out",)
    return Assignment(assignment.output, (Term(1.0, term.factors + (out,), value),), names)


@functools.lru_cache(maxsize=1024)
def gradient_assignment(assignment: Assignment, operand: int, rank: int, sampled: bool,
                         read_result: bool = False) -> tuple[Assignment, tuple[Extra, ...]]:
    """d(loss)/d(operand) as an assignment over ``(grad_out, *operands, *extras)``.

    ``sampled``: the operand is sparse and an extra input is a mask with its pattern.
    A product term contributes ``dOut * (the other factors)`` (those it reads for their
    patterns only stay pattern-only: :attr:`~.frontend.notation.Term.multiplied`); a factor the
    others do not cover gets an all-ones tensor over the operand's modes it lacks (the
    gradient is constant along them). A term with another value tree, or a factor it
    reads for its pattern only, contributes ``dOut * dvalue/dfactor``
    over all its factors; under a max or min, only where the value equals the result,
    divided by the number of such entries (the extras ``result`` and ``count``).
    ``read_result``: in the derivative of a pointwise statement (``Out = v(T...)``, one
    term, nothing reduced) ``v`` itself is read from the result (``d exp(x) = exp(x) dx``).
    Cached: the same call's backward builds the same expression."""
    used = set(assignment.output).union(*(a.indices for a in assignment.accesses))
    primes = 0  # a gradient's own gradient renames its indices again: "@'0", ...
    while any(f"@{chr(39) * primes}{m}" in used for m in range(rank)):
        primes += 1
    target = tuple(f"@{chr(39) * primes}{m}" for m in range(rank))  # user index names cannot start with @
    extra = 1 + assignment.num_operands
    extras: list[Extra] = []

    def input_of(kind: Extra) -> int:
        if kind not in extras:
            extras.append(kind)
        return extra + extras.index(kind)

    stored = read_result and _pointwise(assignment)
    terms = []
    for term in assignment.terms:
        multiplied = term.multiplied if assignment.reduction == "sum" else None
        for k, factor in enumerate(term.factors):
            if factor.operand != operand:
                continue
            rename = dict(zip(factor.indices, target))
            factors = [Access(0, _rename(assignment.output, rename))]
            if multiplied is None or k not in multiplied:
                factors += [Access(1 + g.operand, _rename(g.indices, rename)) for g in term.factors]
                value = reduced_value(term)
                local = apply("mul", Factor(0), _shifted_one(derivative(value, Factor(k))))
                if local == Constant(0.0):
                    continue
                if stored and term.value is not None:
                    read = _replaced(local, _shifted_one(term.value), Factor(len(factors)))
                    if read != local:
                        local = read
                        factors.append(Access(input_of(("result",)), _rename(assignment.output, rename)))
                if assignment.reduction != "sum":
                    out = len(factors)
                    factors += [Access(input_of(("result",)), _rename(assignment.output, rename)),
                                Access(input_of(("count",)), _rename(assignment.output, rename))]
                    local = apply("div", apply("mul", local, apply("equal", _shifted_one(value), Factor(out))),
                                  Factor(out + 1))
                coefficient = 1.0
            else:
                others = [j for j in range(len(term.factors)) if j != k]
                factors += [Access(1 + term.factors[j].operand, _rename(term.factors[j].indices, rename))
                            for j in others]
                local, coefficient = None, term.coefficient
                if len(multiplied) < len(term.factors):  # dOut times the multiplied others; the rest filter
                    local = Factor(0)
                    for n, j in enumerate(others):
                        if j in multiplied:
                            local = apply("mul", local, Factor(n + 1))
            covered = {i for f in factors for i in f.indices}
            if sampled:  # the mask's stored positions restrict the term; its values are not read
                if local is None:
                    local = product(len(factors))
                factors.append(Access(input_of(("mask",)), target))
            else:
                missing = tuple(i for i in target if i not in covered)
                if missing:
                    factors.append(Access(input_of(("ones", tuple(target.index(i) for i in missing))), missing))
            terms.append(Term(coefficient, tuple(factors), local))
    if sampled:
        # 0 * mask keeps every stored position in the result, so values line up with X's.
        terms.append(Term(0.0, (Access(input_of(("mask",)), target),)))
    names = tuple(f"operand{n}" for n in range(extra + len(extras)))
    return Assignment(target, tuple(terms), names), tuple(extras)


@functools.lru_cache(maxsize=1024)
def without_zero_term(assignment: Assignment, formats: tuple[Format | None, ...],
                       patterns: tuple[int | None, ...], mask: int) -> Assignment:
    """A sampled gradient (:func:`gradient_assignment`) without its ``0 * mask`` term when
    its other terms alone have exactly the mask's pattern (the planner writes them at its
    positions, :func:`~.plan.anchor.sampled_operand`; any anchor it finds is read where
    the mask is, so has its pattern): one term, whose kernel need not add a second one
    into its output. ``formats`` and ``patterns``: its inputs' (:func:`_shared_patterns`)."""
    kept = Assignment(assignment.output, assignment.terms[:-1], assignment.operand_names)
    return kept if sampled_operand(kept, formats, patterns, formats[mask]) is not None else assignment


@functools.lru_cache(maxsize=1024)
def tangent_assignment(assignment: Assignment, moving: tuple[int, ...], sampled: bool) -> Assignment:
    """The tangent of ``assignment`` given tangents of the operands ``moving``, over
    ``(*operands, *their tangents, mask if sampled)``: per term and factor ``k`` of a
    moving operand, the term with ``T_k`` replaced by its tangent ``dT_k`` where the term
    multiplies it (multilinear), else ``dvalue/dT_k * dT_k`` read at all its factors.
    ``sampled``: the result is sparse, and ``0 * mask`` (its pattern) keeps every stored
    position, as for a sampled gradient. Max and min reductions have no tangent here."""
    if assignment.reduction != "sum":
        raise NotImplementedError(f"sparsenn: forward-mode derivatives (jvp, jacfwd) of a {assignment.reduction}-"
                                  "reduction are not supported; use reverse mode (vjp, grad, jacrev)")
    count = assignment.num_operands
    slot = {n: count + j for j, n in enumerate(moving)}
    terms = []
    for term in assignment.terms:
        multiplied = term.multiplied
        for k, factor in enumerate(term.factors):
            if factor.operand not in slot:
                continue
            tangent = Access(slot[factor.operand], factor.indices)
            if multiplied is not None and k in multiplied:
                terms.append(Term(term.coefficient, term.factors[:k] + (tangent,) + term.factors[k + 1:], term.value))
                continue
            partial = derivative(reduced_value(term), Factor(k))
            if partial != Constant(0.0):
                terms.append(Term(1.0, term.factors + (tangent,), apply("mul", partial, Factor(len(term.factors)))))
    names = assignment.operand_names + tuple(f"d{assignment.operand_names[n]}" for n in moving)
    if sampled:
        terms.append(Term(0.0, (Access(len(names), assignment.output),)))
        names += ("mask",)
    elif not terms:  # nothing moves: zeros of the result's shape
        terms.append(Term(0.0, assignment.terms[0].factors, assignment.terms[0].value))
    return Assignment(assignment.output, tuple(terms), names)
