"""Index notation: the compiler's first IR, and the two parsers that produce it.

An expression is an :class:`Assignment` ``Out[o...] = sum_t c_t * prod_f T_f[idx_f...]``:
a sum of products (terms), each term summed over its own indices that do not appear
in the output (Einstein convention scoped per term). Operands are referred to by
position; user-chosen names are kept only for display and never reach generated code.

Two front ends build it:

* :func:`parse_einsum` (here) — torch's ``einsum`` strings (``"ij,jk->ik"``, implicit
  output) in their core form: one letter per dimension, none twice in an operand.
  Ellipses, diagonals and size-1 broadcasting are rewritten into that form first
  (:mod:`sparsenn.compiler.frontend.equation`);
* :func:`~.expression.parse_expression` — index notation for sums of products,
  ``"D[i,j] = A[i,k] * B[k,j] + 0.5 * C[i,j]"`` (the plain case of the grammar of
  :mod:`.expression`, whose other statements :mod:`.staging` stages into several
  assignments).

Both are strict hand-written parsers: no ``eval``/``exec``, every error names the problem.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Access", "Term", "Assignment", "Epilogue", "Value", "Factor", "Constant", "Reduced", "Apply",
           "REDUCTIONS", "parse_einsum", "NotationError"]

REDUCTIONS = ("sum", "max", "min")  # how a term's values combine over its reduction indices


class NotationError(ValueError):
    """A malformed einsum equation or index-notation expression."""


@dataclass(frozen=True)
class Access:
    """``operand[indices]``: operand position and one index variable per mode."""

    operand: int
    indices: tuple[str, ...]


class Value:
    """A scalar expression a kernel evaluates at each point it visits: over a term's
    factor values (``Factor(k)``), or, in an :class:`Epilogue`, over the output
    element's reduced value and the epilogue's factors."""


@dataclass(frozen=True)
class Factor(Value):
    """The value of factor ``k`` (of the term, or of the epilogue) at the current point."""

    k: int


@dataclass(frozen=True)
class Constant(Value):
    value: float


@dataclass(frozen=True)
class Reduced(Value):
    """In an epilogue: the output element's value once every term is reduced."""


@dataclass(frozen=True)
class Apply(Value):
    """``function(*args)``, a function of :data:`sparsenn.compiler.frontend.functions.FUNCTIONS`."""

    function: str
    args: tuple[Value, ...]


@dataclass(frozen=True)
class Term:
    """``coefficient * value``, reduced over its indices absent from the output; the
    value is the product of the factors, or ``value`` (a :class:`Value` over them)
    when given. The term is visited where all its sparse factors have stored entries
    (their intersection), whatever ``value`` computes there."""

    coefficient: float
    factors: tuple[Access, ...]
    value: Value | None = None

    @property
    def multiplied(self) -> tuple[int, ...] | None:
        """The factors whose values the term multiplies, when its value is such a product:
        every factor without a value tree, or those a tree of ``mul`` over distinct
        factors reads (the other factors count for their stored positions only, as a
        masked statement's mask does); None for any other value."""
        if self.value is None:
            return tuple(range(len(self.factors)))
        read: list[int] = []
        pending = [self.value]
        while pending:
            node = pending.pop()
            if isinstance(node, Factor):
                read.append(node.k)
            elif isinstance(node, Apply) and node.function == "mul":
                pending.extend(node.args)
            else:
                return None
        return tuple(sorted(read)) if len(set(read)) == len(read) else None

    @property
    def indices(self) -> tuple[str, ...]:
        """Index variables of the term, in order of first appearance."""
        seen: dict[str, None] = {}
        for access in self.factors:
            for index in access.indices:
                seen.setdefault(index, None)
        return tuple(seen)


@dataclass(frozen=True)
class Epilogue:
    """``Out[o] = value`` once ``Out[o]``'s reduction is complete: ``value`` reads the
    reduced value (:class:`Reduced`) and ``factors``, dense operands indexed by output
    indices only (a bias ``b[k]``)."""

    factors: tuple[Access, ...]
    value: Value


@dataclass(frozen=True)
class Assignment:
    """``Out[output] = epilogue(reduce(terms))``: the terms' values combined by
    ``reduction`` (``"sum"``; ``"max"``/``"min"`` for a single term) over each term's
    indices absent from the output, then ``epilogue`` if given; ``operand_names`` are
    for display only. ``extents``: ``(index, extent)`` of indices whose extent the
    operands' formats fix (the in-block coordinate of an index split by blocks), which
    kernels take as constants."""

    output: tuple[str, ...]
    terms: tuple[Term, ...]
    operand_names: tuple[str, ...]
    reduction: str = "sum"
    epilogue: Epilogue | None = None
    extents: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.reduction != "sum" and (len(self.terms) != 1 or self.terms[0].value is None):
            raise ValueError(f"a {self.reduction}-reduction takes one term with a value (Factor(0) for a plain "
                             "access): a stored zero is an entry, so its factors are read by their patterns")

    def __hash__(self) -> int:
        """Computed once: assignments key the plan cache on every call."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.output, self.terms, self.operand_names, self.reduction, self.epilogue, self.extents))
            object.__setattr__(self, "_hash", value)
            return value

    def __reduce__(self):
        """Pickle the fields only: the cached hash is per process (str hashes are salted)."""
        return type(self), (self.output, self.terms, self.operand_names, self.reduction, self.epilogue, self.extents)

    @property
    def accesses(self) -> tuple[Access, ...]:
        """Every access: the terms' factors, then the epilogue's."""
        factors = tuple(a for t in self.terms for a in t.factors)
        return factors + (self.epilogue.factors if self.epilogue is not None else ())

    @property
    def dense_result(self) -> bool:
        """The result is dense whatever the operands: a max or min gives the identity
        where nothing is stored, an epilogue is applied to every element."""
        return self.reduction != "sum" or self.epilogue is not None

    @property
    def is_product_sum(self) -> bool:
        """A plain sum of products: no values, no other reduction, no epilogue."""
        return self.reduction == "sum" and self.epilogue is None and all(t.value is None for t in self.terms)

    @property
    def num_operands(self) -> int:
        return len(self.operand_names)

    def reduction_indices(self, term: Term) -> tuple[str, ...]:
        return tuple(i for i in term.indices if i not in self.output)

    def __str__(self) -> str:
        """``Out[i] = A[i] - 0.5 * sum_{k} B[i,k] * C[k]``: a coefficient ``c`` prints as
        its sign and, unless ``|c| = 1``, ``|c| *`` (so a ``0 * M`` term stays visible);
        a term's value prints over its factors, a max-reduction as ``max_{k}``, an
        epilogue around the whole sum (``relu(R + b[k])`` with ``R`` the sum)."""

        def access(a: Access) -> str:
            return f"{self.operand_names[a.operand]}[{','.join(a.indices)}]"

        parts = []
        for n, term in enumerate(self.terms):
            sign = "-" if term.coefficient < 0 else "+"
            if term.value is None:
                body = " * ".join(access(a) for a in term.factors)
            else:
                body = show_value(term.value, [access(a) for a in term.factors])
            red = self.reduction_indices(term)
            if red:
                body = f"{self.reduction}_{{{','.join(red)}}} {body}"
            if abs(term.coefficient) != 1.0:
                body = f"{_magnitude(term.coefficient)} * {body}"
            parts.append(body if n == 0 and sign == "+" else f"{sign} {body}")
        out = f"Out[{','.join(self.output)}]"
        text = " ".join(parts)
        if self.epilogue is not None:
            names = [access(a) for a in self.epilogue.factors]
            text = show_value(self.epilogue.value, names, reduced=f"({text})".replace("(- ", "(-"))
        return f"{out} = {text}".replace("= - ", "= -")


def show_value(value: Value, factors: Sequence[str], reduced: str = "R") -> str:
    """``value`` as text, factor ``k`` shown as ``factors[k]``."""
    if isinstance(value, Factor):
        return factors[value.k]
    if isinstance(value, Constant):
        return repr(float(value.value)).removesuffix(".0")
    if isinstance(value, Reduced):
        return reduced
    args = [show_value(a, factors, reduced) for a in value.args]
    symbol = _INFIX.get(value.function)
    if symbol is not None:
        return f"({args[0]} {symbol} {args[1]})"
    return f"{value.function}({', '.join(args)})"


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def _magnitude(coefficient: float) -> str:
    """``|c|`` as the shortest text that reads back as it: ``0.5``, ``2``, ``0``, ``1e-08``."""
    text = repr(abs(float(coefficient)))
    return text.removesuffix(".0")


def _check_access(indices: tuple[str, ...], where: str) -> None:
    seen = set()
    for index in indices:
        if index in seen:
            raise NotationError(
                f"index '{index}' appears twice in {where}; repeated indices within one "
                "operand (diagonals) are not supported — take the diagonal first"
            )
        seen.add(index)


def parse_einsum(equation: str, num_operands: int) -> Assignment:
    """Parse a torch-style einsum equation for ``num_operands`` operands.

    Letters ``a-zA-Z`` are indices; spaces are ignored; without ``->`` the output is
    the alphabetically sorted indices that appear exactly once (torch's rule).
    """
    if not isinstance(equation, str):
        raise TypeError(f"einsum equation must be a str, got {type(equation).__name__}")
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise NotationError(f"einsum equation {equation!r} has more than one '->'")
    if "..." in eq:
        raise NotationError(f"einsum equation {equation!r}: ellipsis '...' must be expanded first "
                            "(sparsenn.compiler.frontend.equation.normalise)")
    lhs, arrow, rhs = eq.partition("->")
    bad = set(re.sub(r"[A-Za-z,]", "", lhs)) | set(re.sub(r"[A-Za-z]", "", rhs))
    if bad:
        raise NotationError(
            f"einsum equation {equation!r} contains invalid characters {sorted(bad)}; "
            "indices must be letters a-z, A-Z"
        )
    inputs = lhs.split(",")
    if len(inputs) != num_operands:
        raise NotationError(
            f"einsum equation {equation!r} names {len(inputs)} operand(s) but "
            f"{num_operands} were given"
        )
    accesses = []
    for n, spec in enumerate(inputs):
        indices = tuple(spec)
        _check_access(indices, f"operand {n} ({spec!r})")
        accesses.append(Access(n, indices))
    counts: dict[str, int] = {}
    for access in accesses:
        for index in access.indices:
            counts[index] = counts.get(index, 0) + 1
    if arrow:
        output = tuple(rhs)
        _check_access(output, f"the output ({rhs!r})")
        for index in output:
            if index not in counts:
                raise NotationError(
                    f"output index '{index}' of {equation!r} does not appear in any operand"
                )
    else:
        output = tuple(sorted(i for i, c in counts.items() if c == 1))  # ASCII: A-Z before a-z, as torch
    names = tuple(f"operand{n}" for n in range(num_operands))
    return Assignment(output, (Term(1.0, tuple(accesses)),), names)
