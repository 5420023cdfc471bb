"""Register blocks over outputs narrower than a block: the vectors that cover a row, the
last masked, and sums interleaved over a row's stored entries (``plan/microkernel.py``,
``lower/microkernel.py``).

Each case runs on two pinned machine models (8 and 16 float lanes per register block
vector), so the masked loads and stores of both widths run whatever the host is, and is
compared with torch on float64 copies: extents 0, 1, odd, one past a vector, and rows
with enough stored entries to fill whole groups of interleaved sums and leave a rest.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512, LANES
from _strategies import close, irregular_matrix

import sparsenn
from sparsenn.compiler import use_target

COLUMNS = (0, 1, 3, 7, 9, 17, 33)



@pytest.mark.parametrize("machine", LANES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["csr", "dcsr"])
def test_spmm_with_narrow_and_odd_rows(machine, dtype, fmt):
    a = irregular_matrix(40, 50, 0.3, dtype)
    sparse_a = sparsenn.from_dense(a, format=fmt)
    with use_target(LANES[machine]):
        for k in COLUMNS:
            x = torch.randn(50, k, dtype=torch.float64).to(dtype)
            got = sparsenn.einsum("ij,jk->ik", sparse_a, x, out_format="dense")
            torch.testing.assert_close(got.double(), a.double() @ x.double(), **close(dtype), msg=f"k={k}")


@pytest.mark.parametrize("machine", LANES)
@pytest.mark.parametrize("threads", [1, 2])
def test_two_terms_and_an_epilogue_accumulate_into_masked_rows(machine, threads):
    """The second term adds into what the first stored; a bias and ReLU follow."""
    a, b = irregular_matrix(30, 20, 0.4, torch.float32, 1), irregular_matrix(30, 20, 0.4, torch.float32, 2)
    sa, sb = sparsenn.from_dense(a, format="csr"), sparsenn.from_dense(b, format="csr")
    program = sparsenn.compile("O[i,k] = relu(A[i,j] * X[j,k] + B[i,j] * Y[j,k] + c[k])")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with use_target(LANES[machine]):
            for k in (1, 5, 11, 19):
                x, y, c = torch.randn(20, k), torch.randn(20, k), torch.randn(k)
                expected = torch.relu(a @ x + b @ y + c)
                torch.testing.assert_close(program(sa, x, sb, y, c), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("machine", LANES)
def test_sparse_linear_small_batches_forward_and_backward(machine):
    """A layer's batch rows are the narrow output (``bi,oi->bo`` runs ``o, i, b``), and
    its gradients run the same kernels transposed."""
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(37, 23, sparsity=0.7).double()
    dense_w = layer.weight.to_dense().detach()
    with use_target(LANES[machine]):
        for batch in (1, 2, 3, 5, 7, 9, 17):
            x = torch.randn(batch, 37, dtype=torch.float64, requires_grad=True)
            y = layer(x)
            torch.testing.assert_close(y, x @ dense_w.T + layer.bias)
            (g,) = torch.autograd.grad(y.square().sum(), x)
            torch.testing.assert_close(g, 2 * y.detach() @ dense_w)


def test_interleaved_sums_leave_every_rest_of_a_group():
    """Rows of 0-9 stored entries: whole groups of the interleaved sums and every rest."""
    rows = [torch.cat([torch.ones(n), torch.zeros(12 - n)]) for n in range(10)]
    a = torch.stack(rows) * torch.arange(1, 13, dtype=torch.float32)
    sparse_a = sparsenn.from_dense(a, format="csr")
    for machine in (AVX2, AVX512):
        with use_target(machine):
            x = torch.randn(12, 3)
            torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", sparse_a, x), a @ x)
