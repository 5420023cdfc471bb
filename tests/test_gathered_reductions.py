"""Gathered sparse reductions (``plan/decisions.py``, ``lower/reductions.py``): an SpMV's
stored entries taken a vector at a time, the dense operand gathered at their
coordinates, then the interleaved scalar sums over the rest of the fiber.

Rows of every length from 0 to past two vectors of 16 lanes, both index widths, fp32,
fp64 and bf16, a strided dense operand, compared with torch on float64 copies.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512

import sparsenn
from sparsenn.compiler import use_target
from sparsenn.compiler.api import plan


def rows_of_every_length(cols: int = 80, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lengths = list(range(0, 70))
    dense = torch.zeros(len(lengths), cols, dtype=dtype)
    for r, n in enumerate(lengths):
        dense[r, torch.randperm(cols, generator=g)[:n]] = torch.randn(n, generator=g, dtype=dtype)
    return dense


def test_an_spmv_gathers_and_a_two_sparse_product_does_not():
    a = sparsenn.from_dense(rows_of_every_length(), format="csr")
    (nest,) = plan("ij,j->i", a, torch.randn(80, dtype=torch.float64)).schedule.nests
    assert nest.sparse_reduction is not None and nest.sparse_reduction.gathered
    b = sparsenn.from_dense(rows_of_every_length(), format="csr")
    nests = plan("ij,ij->i", a, b).schedule.nests
    assert all(n.sparse_reduction is None or not n.sparse_reduction.gathered for n in nests)


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gathered_sums_match_torch(machine, dtype, index_dtype):
    dense = rows_of_every_length().to(dtype)
    a = sparsenn.from_dense(dense, format="csr", index_dtype=index_dtype)
    tol = dict(atol=0.1, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    with use_target(machine):
        x = torch.randn(80, dtype=torch.float64).to(dtype)
        torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, x).double(), dense.double() @ x.double(), **tol)
        xs = torch.randn(3, 80, dtype=torch.float64).to(dtype)[1]  # a row of a larger tensor
        torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, xs).double(), dense.double() @ xs.double(), **tol)
        xt = torch.randn(80, 3, dtype=torch.float64).to(dtype)  # the coordinate strided: X[j, b], b outer
        torch.testing.assert_close(sparsenn.einsum("ij,jb->bi", a, xt, out_format="dense").double(),
                                   (dense.double() @ xt.double()).T, **tol)
