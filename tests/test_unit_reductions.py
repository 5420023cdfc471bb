"""A reduction over an index of extent 1 (a batch of one) stores every output element
once wherever its loop is, unless a factor filters it: the weight gradient of a layer at
batch 1 (``bo,bi->oi`` sampled at the weight's pattern) then writes its values with
``=``, without zeroing them first."""

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512
from sparsenn.compiler.api import plan


def csr(rows, cols, density, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g, dtype=dtype) * (torch.rand(rows, cols, generator=g) < density)
    return sparsenn.from_dense(dense, format="csr")


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("density", [0.5, 0.1])
def test_a_sampled_weight_gradient_at_batch_one_stores_once(host_target, target, density):
    host_target(target)
    w = csr(1024, 1024, density)
    one = plan("bo,bi,oi->oi", torch.randn(1, 1024), torch.randn(1, 1024), w, out_format=w.format)
    (nest,) = one.schedule.nests
    assert nest.order.index("b") < nest.order.index("i") and nest.stores_once_anchors == (2,)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("columns", [1, 3, 33])
def test_a_unit_reduction_a_factor_filters_is_still_accumulated(host_target, target, columns):
    # A[o, b] with b of extent 1 and empty rows: a row without its entry must still be zero
    host_target(target)
    a = csr(40, 1, 0.5)
    x = torch.randn(1, columns)
    torch.testing.assert_close(sparsenn.einsum("ob,bi->oi", a, x, out_format="dense"), a.to_dense() @ x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, cols, batch", [(37, 53, 1), (37, 53, 0), (1, 1, 1), (37, 53, 3)])
def test_sampled_products_match_torch_at_small_batches(dtype, rows, cols, batch):
    w = csr(rows, cols, 0.5, dtype)
    g, x = torch.randn(batch, rows, dtype=dtype), torch.randn(batch, cols, dtype=dtype)
    got = sparsenn.einsum("bo,bi,oi->oi", g, x, w, out_format=w.format)
    expected = (g.T @ x) * w.to_dense()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got.to_dense(), expected, **tol)
    layer = sparsenn.SparseLinear(cols, rows, sparsity=0.5, dtype=dtype)
    for _ in range(2):
        layer.zero_grad()
        xs = torch.randn(batch, cols, dtype=dtype)
        grad = torch.randn(batch, rows, dtype=dtype)
        layer(xs).backward(grad)
        torch.testing.assert_close(layer.weight_values.grad, (grad.T @ xs)[layer.mask()], **tol)
