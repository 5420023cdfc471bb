"""A sum of products run as one BLAS call (``runtime/dense_product.py``): its gradients
(``BlasForm.gradients``, the dense step's backward) against torch's autograd of the
call itself (``BlasForm.run``, torch ops)."""

import pytest
import torch

from sparsenn.compiler.api import compile_expression
from sparsenn.compiler.runtime.dense_product import blas_form

EXPRESSIONS = {
    "plain": ("Y[p,q] = A[p,c] * B[c,q]", [("p", "c"), ("c", "q")]),
    "transposed factors, scaled": ("Y[p,q] = 2 * A[c,p] * B[q,c]", [("c", "p"), ("q", "c")]),
    "linear": ("Y[p,q] = A[p,c] * W[q,c] + b[q]", [("p", "c"), ("q", "c"), ("q",)]),
    "linear, scaled bias": ("Y[p,q] = A[p,c] * W[q,c] + 2 * b[q]", [("p", "c"), ("q", "c"), ("q",)]),
    "every bias": ("Y[p,q] = 0.5 * A[p,c] * B[q,c] + 3 * C[p] + D[q] + E[p,q] - F[q,p]",
                   [("p", "c"), ("q", "c"), ("p",), ("q",), ("p", "q"), ("q", "p")]),
}


CASES = pytest.mark.parametrize("name, dtype, sizes", [
    (name, dtype, sizes) for name in sorted(EXPRESSIONS) for dtype in (torch.float32, torch.float64)
    for sizes in ({"p": 3, "q": 5, "c": 7}, {"p": 1, "q": 1, "c": 1}, {"p": 0, "q": 4, "c": 3}, {"p": 2, "q": 3, "c": 0})])


def form_and_operands(name, dtype, sizes, seed):
    """The BLAS form of expression ``name``, its operands at ``sizes`` and their generator."""
    text, modes = EXPRESSIONS[name]
    form = blas_form(compile_expression(text, out_format="dense").assignment)
    assert form is not None
    generator = torch.Generator().manual_seed(seed)
    return form, [torch.randn(*(sizes[m] for m in mode), dtype=dtype, generator=generator) for mode in modes], generator


@CASES
def test_gradients_match_autograd(name, dtype, sizes):
    form, tensors, generator = form_and_operands(name, dtype, sizes, 0)
    grad = torch.randn(sizes["p"], sizes["q"], dtype=dtype, generator=generator)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = form.run(leaves)
    out.backward(grad)
    wanted = [True] * len(tensors)
    wanted[-1] = False  # an operand not asked for gets None
    grads = form.gradients(tensors, grad, wanted)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for n, (leaf, g) in enumerate(zip(leaves, grads)):
        if not wanted[n]:
            assert g is None
            continue
        assert g.shape == leaf.shape
        torch.testing.assert_close(g, leaf.grad, **tol)


@pytest.mark.parametrize("size", [0, 1, 5])
def test_an_operand_read_by_both_factors_sums_its_gradients(size):
    form = blas_form(compile_expression("Y[p,q] = A[p,c] * A[q,c]", out_format="dense").assignment)
    assert form is not None and form.lhs.operand == form.rhs.operand == 0
    a = torch.randn(size, 3, dtype=torch.float64)
    grad = torch.randn(size, size, dtype=torch.float64)
    leaf = a.clone().requires_grad_()
    form.run([leaf]).backward(grad)
    (g,) = form.gradients([a], grad, [True])
    torch.testing.assert_close(g, leaf.grad)


@CASES
def test_run_matches_torch_einsum(name, dtype, sizes):
    form, tensors, _ = form_and_operands(name, dtype, sizes, 1)
    modes = EXPRESSIONS[name][1]
    letters = {"p": "p", "q": "q", "c": "c"}
    expected = None
    for term, (coefficient, factors) in enumerate(_terms(name)):
        inputs = ",".join("".join(letters[m] for m in modes[n]) for n in factors)
        value = coefficient * torch.einsum(f"{inputs}->{''.join(i for i in 'pq' if i in inputs)}",
                                           *[tensors[n] for n in factors])
        value = value.reshape([sizes[i] if i in inputs else 1 for i in "pq"])
        expected = value if expected is None else expected + value
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(form.run(tensors), expected.expand(sizes["p"], sizes["q"]), **tol)


def _terms(name: str) -> list[tuple[float, list[int]]]:
    """(coefficient, operands) of each term of ``EXPRESSIONS[name]``."""
    return {"plain": [(1.0, [0, 1])], "transposed factors, scaled": [(2.0, [0, 1])],
            "linear": [(1.0, [0, 1]), (1.0, [2])], "linear, scaled bias": [(1.0, [0, 1]), (2.0, [2])],
            "every bias": [(0.5, [0, 1]), (3.0, [2]), (1.0, [3]), (1.0, [4]), (-1.0, [5])]}[name]


def test_only_a_product_with_its_right_factor_transposed_and_a_column_bias_is_torchs_linear():
    linear = {name: blas_form(compile_expression(EXPRESSIONS[name][0], out_format="dense").assignment).linear
              for name in EXPRESSIONS}
    assert linear == {"plain": False, "transposed factors, scaled": False, "linear": True,
                      "linear, scaled bias": False, "every bias": False}
    assert blas_form(compile_expression("Y[p,q] = A[p,c] * W[q,c]", out_format="dense").assignment).linear
