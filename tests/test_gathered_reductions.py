"""Gathered sparse reductions (``plan/decisions.py``, ``lower/reductions.py``): an SpMV's
stored entries taken a vector at a time, the dense operand gathered at their
coordinates, then the rest of the fiber as one masked vector (fibers of a few entries
or more, by cost) or the interleaved scalar sums.

Rows of every length from 0 to past two vectors of 16 lanes, both index widths, fp32,
fp64 and bf16, a strided dense operand, rows of at most two entries, extents 0, 1 and
odd, one and two threads, compared with torch on float64 copies.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512, WIDE

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


def rows_of_at_most(longest: int, rows: int = 300, cols: int = 61, dtype=torch.float64) -> torch.Tensor:
    """Rows of 0 to ``longest`` entries, in turn."""
    g = torch.Generator().manual_seed(1)
    dense = torch.zeros(rows, cols, dtype=dtype)
    for r in range(rows):
        n = r % (longest + 1)
        dense[r, torch.randperm(cols, generator=g)[:n]] = torch.randn(n, generator=g, dtype=dtype)
    return dense


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_long_fibers_take_their_rest_as_one_masked_vector(machine):
    """Rows of 35 entries on average: the rest after the whole vectors (about half a
    vector) costs more as scalar steps than as one masked vector step."""
    a = sparsenn.from_dense(rows_of_every_length(), format="csr")
    with use_target(machine):
        (nest,) = plan("ij,j->i", a, torch.randn(80, dtype=torch.float64)).schedule.nests
    r = nest.sparse_reduction
    assert r.gathered and r.masked_rest and r.accumulators == machine.sparse_accumulators
    assert "then the rest as one masked vector" in nest.describe()


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_fibers_of_one_or_two_entries_keep_scalar_steps(machine):
    """Rows of one entry on average: a masked vector step would test every lane for
    what one scalar step does."""
    a = sparsenn.from_dense(rows_of_at_most(2), format="csr")
    with use_target(machine):
        (nest,) = plan("ij,j->i", a, torch.randn(61, dtype=torch.float64)).schedule.nests
    r = nest.sparse_reduction
    assert r.gathered and not r.masked_rest
    assert "masked" not in nest.describe()


def test_a_two_sparse_product_has_no_masked_rest():
    a = sparsenn.from_dense(rows_of_every_length(), format="csr")
    b = sparsenn.from_dense(rows_of_every_length(), format="csr")
    with use_target(AVX2):
        nests = plan("ij,ij->i", a, b).schedule.nests
    assert all(n.sparse_reduction is None or not n.sparse_reduction.masked_rest for n in nests)


@pytest.mark.parametrize("machine", [AVX2, AVX512, WIDE], ids=["avx2", "avx512", "16 lanes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("longest", [2, 11, 40])
def test_short_fibers_match_torch(machine, dtype, longest):
    """Rows of at most 2 entries (scalar steps), of at most 11 and 40 (vectors and a
    masked rest, or only a masked one), on 8 and 16 lanes, against torch."""
    dense = rows_of_at_most(longest).to(dtype)
    a = sparsenn.from_dense(dense, format="csr")
    tol = dict(atol=0.1, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    x = torch.randn(61, dtype=torch.float64).to(dtype)
    with use_target(machine):
        torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, x).double(), dense.double() @ x.double(), **tol)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1), (7, 13), (1, 9)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extents_zero_one_and_odd_match_torch(shape, dtype):
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    dense[torch.rand(shape, generator=g) < 0.3] = 0
    a = sparsenn.from_dense(dense.to(dtype), format="csr")
    x = torch.randn(shape[1], generator=g, dtype=torch.float64).to(dtype)
    with use_target(AVX2):
        torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, x).double(), dense.to(dtype).double() @ x.double(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 7])
def test_a_sparse_linear_layer_matches_torch_on_one_and_two_threads(threads, batch):
    """A weight of 90 % zeros, 300 inputs: rows of 30 entries, a masked rest each."""
    torch.manual_seed(3)
    layer = sparsenn.SparseLinear(300, 67, sparsity=0.9)
    x = torch.randn(batch, 300)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), use_target(AVX2):
            out = layer(x)
    finally:
        torch.set_num_threads(before)
    reference = torch.nn.functional.linear(x.double(), layer.weight.to_dense().double(), layer.bias.double())
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)
