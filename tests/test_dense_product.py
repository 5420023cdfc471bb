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
    "every bias": ("Y[p,q] = 0.5 * A[p,c] * B[q,c] + 3 * C[p] + D[q] + E[p,q] - F[q,p]",
                   [("p", "c"), ("q", "c"), ("p",), ("q",), ("p", "q"), ("q", "p")]),
}


@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [{"p": 3, "q": 5, "c": 7}, {"p": 1, "q": 1, "c": 1}, {"p": 0, "q": 4, "c": 3},
                                   {"p": 2, "q": 3, "c": 0}])
def test_gradients_match_autograd(name, dtype, sizes):
    text, modes = EXPRESSIONS[name]
    form = blas_form(compile_expression(text, out_format="dense").assignment)
    assert form is not None
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*(sizes[m] for m in mode), dtype=dtype, generator=generator) for mode in modes]
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
