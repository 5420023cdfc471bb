"""A differentiable program recorded as one autograd node (compiler/program_autograd.py):
its gradients against torch's on the dense (or torch.sparse) equivalent in float64,
``detach`` (forward identity, gradient 0), one node per program, double backward."""

from __future__ import annotations

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from _graphs import autograd_nodes

SOFTMAX = ("M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - detach(M[i])); Z[i] = sum[j](E[i,j]); "
           "P<E>[i,j] = E[i,j] / Z[i]")
LOG_SOFTMAX = ("M[i] = max[j](S[i,j]); Z[i] = sum[j](exp(S[i,j] - detach(M[i]))); W[i] = log(Z[i]); "
               "L<S>[i,j] = S[i,j] - detach(M[i]) - W[i]")
CHAIN = "H[i,k] = A[i,j] * X[j,k]; E<A>[i,j] = A[i,j] * H[i,k] * Q[j,k]; y[i] = sum[j](E[i,j] * E[i,j])"


def random_sparse(shape, fmt, seed=0, density=0.4) -> SparseTensor:
    """float64 values on a random pattern with an entry in every row."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    keep = torch.rand(shape, generator=g) < density
    keep[:, 0] = True
    return sparsenn.from_dense(dense * keep, format=fmt)




@pytest.mark.parametrize(("text", "reference", "fmt"), [
    (SOFTMAX, torch.sparse.softmax, "csr"), (SOFTMAX, torch.sparse.softmax, "bsr(4,4)"),
    (LOG_SOFTMAX, torch.sparse.log_softmax, "csr"),
    (LOG_SOFTMAX, torch.sparse.log_softmax, "bsr(4,4)"),
], ids=["softmax-csr", "softmax-bsr", "log_softmax-csr", "log_softmax-bsr"])
def test_row_program_gradients_match_torch_sparse(text, reference, fmt):
    S = random_sparse((12, 16), fmt, seed=1)
    grad = torch.randn(S.nnz, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    values = S.values.clone().requires_grad_()
    out = sparsenn.compile(text)(S.with_values(values))
    out.values.backward(grad)
    coo = S.to_torch(torch.sparse_coo).detach().requires_grad_()
    ref = reference(coo, 1)
    ref.backward(S.with_values(grad).to_torch(torch.sparse_coo))
    torch.testing.assert_close(out.to_torch(torch.sparse_coo).coalesce().values(), ref.coalesce().values(),
                               rtol=1e-12, atol=1e-13)
    ours = S.with_values(values.grad).to_torch(torch.sparse_coo).coalesce().values()
    torch.testing.assert_close(ours, coo.grad.coalesce().values(), rtol=1e-10, atol=1e-12)


def test_chain_with_a_sparse_operand_matches_dense_torch():
    A = random_sparse((7, 9), "csr", seed=3)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    Q = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    values = A.values.clone().requires_grad_()
    y = sparsenn.compile(CHAIN)(A.with_values(values), X, Q)
    weight = torch.randn(7, dtype=torch.float64, generator=g)
    (y * weight).sum().backward()

    dense = A.to_dense().detach().requires_grad_()
    X0, Q0 = X.detach().clone().requires_grad_(), Q.detach().clone().requires_grad_()
    E = dense * ((dense @ X0) @ Q0.T)
    ref = (E * E).sum(1)
    (ref * weight).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(X.grad, X0.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(Q.grad, Q0.grad, rtol=1e-10, atol=1e-12)
    stored = A.with_values(values.grad).to_dense() != 0
    torch.testing.assert_close(A.with_values(values.grad).to_dense(), dense.grad * (A.to_dense() != 0))
    assert stored.any()


def test_a_program_is_one_autograd_node():
    S = random_sparse((6, 8), "csr", seed=5)
    values = S.values.clone().requires_grad_()
    P = sparsenn.compile(SOFTMAX)(S.with_values(values))
    names = autograd_nodes(P.values)
    assert names.count("_ProgramFunctionBackward") == 1, names
    assert not any("SparseEinsum" in name for name in names), names


def test_returned_results_are_outputs_of_the_one_node():
    S = random_sparse((6, 8), "csr", seed=6)
    values = S.values.clone().requires_grad_()
    Z, P = sparsenn.compile(SOFTMAX, returns=("Z", "P"))(S.with_values(values))
    assert Z.grad_fn is P.values.grad_fn
    g = torch.Generator().manual_seed(7)
    dZ, dP = torch.randn(Z.shape, dtype=torch.float64, generator=g), torch.randn(P.nnz, dtype=torch.float64,
                                                                                generator=g)
    torch.autograd.backward([Z, P.values], [dZ, dP])

    dense = S.to_dense().masked_fill(S.to_dense() == 0, float("-inf")).detach().requires_grad_()
    E = torch.exp(dense - dense.amax(1, keepdim=True).detach())
    Zr = E.sum(1)
    Pr = E / Zr[:, None]
    stored = S.to_dense() != 0
    torch.autograd.backward([Zr, Pr], [dZ, S.with_values(dP).to_dense()])
    torch.testing.assert_close(Z, Zr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.with_values(values.grad).to_dense(), dense.grad * stored, rtol=1e-10, atol=1e-12)


def test_gradcheck_softmax_program():
    S = random_sparse((4, 6), "csr", seed=8)
    program = sparsenn.compile(SOFTMAX)
    values = S.values.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: program(S.with_values(v)).values, (values,))


def test_detach_is_the_identity_with_gradient_zero():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    y = sparsenn.compile("y[i] = detach(x[i]) * x[i]")(x)
    torch.testing.assert_close(y, x.detach() ** 2)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, x.detach(), msg="d(detach(x) x)/dx = detach(x)")
    (grad,) = torch.autograd.grad(sparsenn.compile("y[i] = detach(x[i])")(x).sum(), x)
    assert torch.equal(grad, torch.zeros_like(x))


def test_detach_in_a_program_gives_no_gradient_through_that_path():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    y = sparsenn.compile("m[] = sum[i](x[i] * w[i]); y[i] = x[i] - detach(m[])")(x, w)
    assert autograd_nodes(y).count("_ProgramFunctionBackward") == 1
    gx, gw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
    torch.testing.assert_close(gx, torch.ones_like(x))
    assert gw is None or torch.equal(gw, torch.zeros_like(w))


def test_double_backward_of_a_program():
    S = random_sparse((6, 8), "csr", seed=11)
    g = torch.Generator().manual_seed(12)
    dP, u = (torch.randn(S.nnz, dtype=torch.float64, generator=g) for _ in range(2))
    values = S.values.clone().requires_grad_()
    P = sparsenn.compile(SOFTMAX)(S.with_values(values))
    (first,) = torch.autograd.grad(P.values, values, dP, create_graph=True)
    (second,) = torch.autograd.grad(first, values, u)

    coo = S.with_values(torch.arange(S.nnz, dtype=torch.float64)).to_torch(torch.sparse_coo).coalesce()
    (rows, cols), position = coo.indices(), coo.values().long()  # the entries and their places in S.values

    def dense_softmax(v):
        dense = torch.full(S.shape, float("-inf"), dtype=torch.float64).index_put((rows, cols), v[position])
        return torch.zeros_like(v).index_put((position,), torch.softmax(dense, 1)[rows, cols])

    leaf = S.values.clone().requires_grad_()
    (first_ref,) = torch.autograd.grad(dense_softmax(leaf), leaf, dP, create_graph=True)
    (second_ref,) = torch.autograd.grad(first_ref, leaf, u)
    torch.testing.assert_close(first, first_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(second, second_ref, rtol=1e-10, atol=1e-12)


def test_a_program_with_an_epilogue_still_differentiates():
    A = random_sparse((6, 7), "csr", seed=13)
    g = torch.Generator().manual_seed(14)
    X = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    y = sparsenn.compile("Y[i,k] = tanh(A[i,j] * X[j,k] + b[k]); y[i] = sum[k](Y[i,k] * Y[i,k])")(A, X, b)
    gX, gb = torch.autograd.grad(y.sum(), (X, b))
    X0, b0 = X.detach().requires_grad_(), b.detach().requires_grad_()
    ref = torch.tanh(A.to_dense() @ X0 + b0).pow(2).sum(1)
    rX, rb = torch.autograd.grad(ref.sum(), (X0, b0))
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gX, rX)
    torch.testing.assert_close(gb, rb)


def test_the_node_keeps_no_reference_cycle_to_its_outputs():
    import gc
    import weakref

    S = random_sparse((6, 8), "csr", seed=15)
    values = S.values.clone().requires_grad_()
    P = sparsenn.compile(SOFTMAX)(S.with_values(values))
    gc.disable()
    try:
        alive = weakref.ref(P.values)
        del P
        assert alive() is None, "the output is freed by reference counting alone"
    finally:
        gc.enable()


def test_dense_operands_and_an_operand_read_twice():
    g = torch.Generator().manual_seed(16)
    x = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    y = sparsenn.compile("H[i,k] = x[i,j] * w[j,k]; y[i] = sum[k](sigmoid(H[i,k]) * x[i,k])")(x, w[:, :3])
    assert autograd_nodes(y).count("_ProgramFunctionBackward") == 1
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    x0, w0 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = (torch.sigmoid(x0 @ w0[:, :3]) * x0).sum(1)
    rx, rw = torch.autograd.grad(ref.sum(), (x0, w0))
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
