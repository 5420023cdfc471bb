"""Gradients of compiled einsums: every backward is itself a compiled einsum."""

from __future__ import annotations

import resource

import pytest
import torch
from torch.autograd import gradcheck

import sparsenn
from sparsenn import SparseTensor


def sparse(shape, fmt="csr", density=0.4, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    dense[torch.rand(shape, generator=g) > density] = 0
    return sparsenn.from_dense(dense, format=fmt)


def leaf(s: SparseTensor) -> torch.Tensor:
    return s.values.clone().requires_grad_()


def dense(*shape, seed=1):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def out_values(result):
    return result.values if isinstance(result, SparseTensor) else result


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr"])
def test_spmm_grad_to_dense_and_sparse_values(fmt):
    a = sparse((6, 5), fmt)
    v, x = leaf(a), dense(5, 3)
    assert gradcheck(lambda v, x: sparsenn.einsum("ij,jk->ik", a.with_values(v), x, out_format="dense"), (v, x))


@pytest.mark.parametrize("fmt", ["bsr(2,3)", "bsc(3,2)", "nm(2,3)", "ddc(1,2,3)"])
def test_spmm_and_sddmm_grad_through_structured_values(fmt):
    batched = fmt.startswith("ddc")
    a = sparse((2, 6, 6) if batched else (6, 6), fmt)
    spmm, sddmm = ("hij,hjk->hik", "hij,hik,hjk->hij") if batched else ("ij,jk->ik", "ij,ik,jk->ij")
    x, y = (dense(2, 6, 3), dense(2, 6, 3, seed=2)) if batched else (dense(6, 3), dense(6, 3, seed=2))
    assert gradcheck(lambda v, x: sparsenn.einsum(spmm, a.with_values(v), x, out_format="dense"), (leaf(a), x))
    assert gradcheck(lambda v, x, y: sparsenn.einsum(sddmm, a.with_values(v), x, y).values, (leaf(a), x, y))


def test_spmv_grad():
    a = sparse((7, 6))
    assert gradcheck(lambda v, x: sparsenn.einsum("ij,j->i", a.with_values(v), x), (leaf(a), dense(6)))


@pytest.mark.parametrize("equation", ["ij,ik,jk->ij", "ij,ik,kj->ij"])
def test_sddmm_grad(equation):
    a = sparse((6, 7), "csr")
    y = dense(7, 3) if equation.endswith("jk->ij") else dense(3, 7)
    f = lambda v, x, y: sparsenn.einsum(equation, a.with_values(v), x, y).values
    assert gradcheck(f, (leaf(a), dense(6, 3), y))


def test_spgemm_grad_dense_and_sparse_output():
    a, b = sparse((5, 6), "csr", seed=1), sparse((6, 4), "csr", seed=2)
    f = lambda va, vb: sparsenn.einsum("ij,jk->ik", a.with_values(va), b.with_values(vb), out_format="dense")
    assert gradcheck(f, (leaf(a), leaf(b)))
    g = lambda va, vb: sparsenn.einsum("ij,jk->ik", a.with_values(va), b.with_values(vb)).values
    assert gradcheck(g, (leaf(a), leaf(b)))


@pytest.mark.parametrize("op", ["*", "+", "-"])
def test_elementwise_grad(op):
    a, b = sparse((5, 6), "csr", seed=1), sparse((5, 6), "coo", seed=2)
    expr = sparsenn.compile(f"C[i,j] = A[i,j] {op} B[i,j]")
    assert gradcheck(lambda va, vb: expr(a.with_values(va), b.with_values(vb)).values, (leaf(a), leaf(b)))


def test_batched_and_fused_three_operand_grads():
    a = sparse((2, 4, 5), "dcc")
    f = lambda v, x: out_values(sparsenn.einsum("bij,bjk->bik", a.with_values(v), x))
    assert gradcheck(f, (leaf(a), dense(2, 5, 3)))
    bn = sparse((4, 6), "csr")
    f = lambda v, x, y: sparsenn.einsum("bn,bd,ndh->bh", bn.with_values(v), x, y)
    assert gradcheck(f, (leaf(bn), dense(4, 3), dense(6, 3, 2)))


def test_sums_of_products_grad_flows_to_each_term():
    a, c = sparse((4, 5), "csr", seed=1), sparse((4, 6), "csr", seed=2)
    expr = sparsenn.compile("D[i,j] = A[i,k] * B[k,j] - C[i,j] + e[i]")
    f = lambda va, b, vc, e: out_values(expr(a.with_values(va), b, c.with_values(vc), e))
    assert gradcheck(f, (leaf(a), dense(5, 6), leaf(c), dense(4)))


def test_gradient_of_an_index_only_one_operand_has():
    x = dense(4, 3)
    a = sparse((4,), "coo")
    f = lambda v, x: out_values(sparsenn.einsum("i,ij->i", a.with_values(v), x))
    assert gradcheck(f, (leaf(a), x))


def test_only_needed_gradients_and_no_graph_without_grad():
    a = sparse((6, 5))
    x = dense(5, 3)
    with torch.no_grad():
        assert not sparsenn.einsum("ij,jk->ik", a.with_values(leaf(a)), x).requires_grad
    with torch.inference_mode():
        assert not sparsenn.einsum("ij,jk->ik", a, x).requires_grad
    y = sparsenn.einsum("ij,jk->ik", a, x)  # only x requires grad
    y.sum().backward()
    torch.testing.assert_close(x.grad, a.to_dense().T @ torch.ones(6, 3, dtype=torch.float64))


def test_sparse_gradient_never_densifies():
    n, nnz = 100_000, 1_000_000
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, n, (2, nnz), generator=g)
    a = sparsenn.from_coo(idx, torch.randn(nnz, generator=g), (n, n), format="csr")
    v = a.values.clone().requires_grad_()
    x = torch.randn(n, 8, generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    y = sparsenn.einsum("ij,jk->ik", a.with_values(v), x)
    y.square().sum().backward()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert v.grad.shape == (a.nnz,)
    assert grown_kib * 1024 < 2 * 1024**3  # n^2 * 4 bytes would be 40 GB
    row, col = a.coords()[0][:, :5]
    expected = (2 * y.detach()[row] * x[col]).sum(-1)
    torch.testing.assert_close(v.grad[:5], expected, rtol=1e-4, atol=1e-4)


def test_training_a_model_with_a_sparse_weight_reduces_the_loss():
    torch.manual_seed(0)
    w_dense = torch.randn(32, 20) * (torch.rand(32, 20) < 0.2)
    w = sparsenn.from_dense(w_dense, format="csr")
    w_values = torch.nn.Parameter(w.values.clone())
    head = torch.nn.Linear(32, 1)
    params = [w_values, *head.parameters()]
    opt = torch.optim.Adam(params, lr=0.05)
    x = torch.randn(64, 20)
    target = torch.sin(x[:, :1] * 2)
    losses = []
    for _ in range(60):
        hidden = torch.relu(sparsenn.einsum("bi,oi->bo", x, w.with_values(w_values)))
        loss = torch.nn.functional.mse_loss(head(hidden), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
