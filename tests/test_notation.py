"""Printing index notation: coefficients other than +-1 are shown, so every term of a
generated expression (such as the ``0 * mask`` term of a sampled gradient) is visible."""

from __future__ import annotations

import pytest

from sparsenn.compiler.derivatives import gradient_assignment
from sparsenn.compiler.frontend.expression import parse_expression
from sparsenn.compiler.frontend.notation import Access, Assignment, NotationError, Term, parse_einsum


def single(coefficient: float) -> Assignment:
    return Assignment(("i",), (Term(coefficient, (Access(0, ("i", "k")),)),), ("A",))


@pytest.mark.parametrize(("coefficient", "text"), [
    (1.0, "Out[i] = sum_{k} A[i,k]"),
    (-1.0, "Out[i] = -sum_{k} A[i,k]"),
    (0.5, "Out[i] = 0.5 * sum_{k} A[i,k]"),
    (-2.0, "Out[i] = -2 * sum_{k} A[i,k]"),
    (0.0, "Out[i] = 0 * sum_{k} A[i,k]"),
    (1e-8, "Out[i] = 1e-08 * sum_{k} A[i,k]"),
])
def test_first_term_coefficient(coefficient: float, text: str) -> None:
    assert str(single(coefficient)) == text


def test_later_terms_print_sign_then_magnitude() -> None:
    terms = (Term(1.0, (Access(0, ("i",)),)), Term(0.5, (Access(1, ("i",)),)),
             Term(-2.0, (Access(1, ("i",)),)), Term(0.0, (Access(0, ("i",)),)), Term(-1.0, (Access(0, ("i",)),)))
    assert str(Assignment(("i",), terms, ("A", "B"))) == "Out[i] = A[i] + 0.5 * B[i] - 2 * B[i] + 0 * A[i] - A[i]"


def test_parsed_expressions_print_unit_coefficients_as_signs() -> None:
    parsed = parse_expression("D[i,j] = -A[i,j] - (B[i,j] - A[i,j]) * C[i,j]")
    assert str(parsed) == "Out[i,j] = -A[i,j] - B[i,j] * C[i,j] + A[i,j] * C[i,j]"


def test_sampled_gradient_shows_its_zero_mask_term() -> None:
    """d/dA of ``ij,jk->ik`` for sparse A: the product sampled at A's pattern, plus
    ``0 * mask`` keeping every stored position (printed as ``+ M`` before)."""
    gradient, _ = gradient_assignment(parse_einsum("ij,jk->ik", 2), 0, 2, True)
    assert str(gradient).endswith("+ 0 * operand3[@0,@1]")



def test_parsed_numbers_are_coefficients() -> None:
    parsed = parse_expression("y[i] = 0.5 * A[i,j] * x[j] - b[i] / 4 + 1e-3 * (2 * b[i])")
    assert str(parsed) == "Out[i] = 0.5 * sum_{j} A[i,j] * x[j] - 0.25 * b[i] + 0.002 * b[i]"


@pytest.mark.parametrize("text", ["Y[i] = relu(A[i])", "Y[i] = max[j](A[i,j])", "Y[i] = A[i] / d[i]",
                                  "Y<S>[i] = A[i]", "Y[i] = A[i] + 1"])
def test_parse_expression_takes_plain_sums_of_products_only(text: str) -> None:
    with pytest.raises(NotationError, match="not a sum of products of tensors.*sparsenn.compile"):
        parse_expression(text)
