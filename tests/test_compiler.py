"""Every compiled kernel checked against torch.einsum on dense copies."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
import torch
from _machines import AVX2

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler import clear_caches
from sparsenn.compiler.loops import ir
from sparsenn.compiler.lower.merge import lattice
from sparsenn.compiler.plan.decisions import PrefetchLoop, PrefetchPolicy
from sparsenn.compiler.plan.planner import operand_info, plan_call
from sparsenn.compiler.plan.target import Target
from sparsenn.compiler import api

MATRIX_FORMATS = ["csr", "csc", "coo", "dcsr", "dcsc"]


def random_dense(shape, density, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=dtype)
    mask = torch.rand(shape, generator=g) < density
    return values * mask


def to_dense(x):
    return x.to_dense() if isinstance(x, SparseTensor) else x


def check(equation, operands, out_format=None, atol=1e-10):
    """Run sparsenn.einsum and compare with torch.einsum on dense copies."""
    dense = [to_dense(op) for op in operands]
    expected = torch.einsum(equation, *dense)
    result = sparsenn.einsum(equation, *operands, out_format=out_format)
    got = to_dense(result)
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-6)
    return result


def sp(shape, fmt, density=0.3, seed=0, dtype=torch.float64, index_dtype=None):
    return sparsenn.from_dense(random_dense(shape, density, dtype, seed), format=fmt, index_dtype=index_dtype)


@pytest.mark.parametrize("fmt", MATRIX_FORMATS)
def test_spmv(fmt):
    check("ij,j->i", [sp((7, 9), fmt), torch.randn(9, dtype=torch.float64)])


@pytest.mark.parametrize("fmt", MATRIX_FORMATS)
@pytest.mark.parametrize("k", [1, 5, 33])
def test_spmm(fmt, k):
    check("ij,jk->ik", [sp((11, 13), fmt), torch.randn(13, k, dtype=torch.float64)])


@pytest.mark.parametrize("fmt", ["bsr(2,3)", "bsc(3,2)", "nm(2,3)", "nm(1,3)", "dc[1,0](3,1)"])
def test_structured_formats_in_the_basic_kernels(fmt):
    a = sp((12, 18), fmt)
    check("ij,j->i", [a, torch.randn(18, dtype=torch.float64)])
    check("ij,jk->ik", [a, torch.randn(18, 5, dtype=torch.float64)])
    check("ij,jk->ik", [torch.randn(4, 12, dtype=torch.float64), a])
    check("ij,ik,jk->ij", [a, torch.randn(12, 7, dtype=torch.float64), torch.randn(18, 7, dtype=torch.float64)])
    check("ij,ij->ij", [a, sp((12, 18), fmt, seed=1)])
    check("ij,jk->ik", [a, sp((18, 6), "csr", seed=2)], out_format="csr")


@pytest.mark.parametrize("fmt", MATRIX_FORMATS)
def test_dense_times_sparse(fmt):
    check("ij,jk->ik", [torch.randn(4, 11, dtype=torch.float64), sp((11, 6), fmt)])


@pytest.mark.parametrize("fa,fb", list(itertools.product(MATRIX_FORMATS, repeat=2)))
def test_spgemm_sparse_output(fa, fb):
    result = check("ij,jk->ik", [sp((9, 8), fa, seed=1), sp((8, 10), fb, seed=2)], out_format="csr")
    assert isinstance(result, SparseTensor)


def test_spgemm_inferred_formats():
    """Algorithm 4 per output mode: k is sparse iff B stores k in a sparse level. CSR
    times CSC stores both i and k in dense levels, but only sparse operands carry them:
    the product is sparse (CSR), even for these small, 40 %-dense operands."""
    a = sp((9, 8), "csr", seed=1)
    assert str(sparsenn.einsum("ij,jk->ik", a, sp((8, 10), "csr")).format) == "csr"
    assert str(sparsenn.einsum("ij,jk->ik", sp((9, 8), "dcsr"), sp((8, 10), "dcsr")).format) == "dcsr"
    assert str(check("ij,jk->ik", [a, sp((8, 10), "csc")]).format) == "csr"


@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("csc", "coo"), ("dcsr", "csc")])
def test_spgemm_dense_output(fa, fb):
    result = check("ij,jk->ik", [sp((9, 8), fa, seed=1), sp((8, 10), fb, seed=2)], out_format="dense")
    assert isinstance(result, torch.Tensor)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "dcsr"])
@pytest.mark.parametrize("equation", ["ij,ik,jk->ij", "ij,ik,kj->ij"])
def test_sddmm(fmt, equation):
    a = sp((10, 12), fmt, density=0.2)
    b = torch.randn(10, 7, dtype=torch.float64)
    c = torch.randn(12, 7, dtype=torch.float64) if equation.endswith("jk->ij") else torch.randn(7, 12, dtype=torch.float64)
    result = check(equation, [a, b, c])
    assert isinstance(result, SparseTensor)
    assert result.nnz <= a.nnz


@pytest.mark.parametrize("fa,fb", list(itertools.product(MATRIX_FORMATS + ["dense"], repeat=2)))
def test_elementwise(fa, fb):
    a = sp((6, 7), fa, seed=3) if fa != "dense" else random_dense((6, 7), 0.5, seed=3)
    b = sp((6, 7), fb, seed=4) if fb != "dense" else random_dense((6, 7), 0.5, seed=4)
    check("ij,ij->ij", [a, b])
    add = sparsenn.compile("C[i,j] = A[i,j] + B[i,j]")
    expected = to_dense(a) + to_dense(b)
    torch.testing.assert_close(to_dense(add(a, b)), expected)
    sub = sparsenn.compile("C[i,j] = A[i,j] - B[i,j]")
    torch.testing.assert_close(to_dense(sub(A=a, B=b)), to_dense(a) - to_dense(b))


@pytest.mark.parametrize("equation", ["i,i->i", "i,j->ij", "i,i->", "i->"])
def test_sparse_vectors(equation):
    ops = [sp((9,), "coo", 0.4, seed=n) for n in range(equation.count(",") + 1)]
    if equation == "i,j->ij":
        ops[1] = torch.randn(5, dtype=torch.float64)
    check(equation, ops)


@pytest.mark.parametrize("fmt", ["dcc", "csf", "coo", "ddc"])
def test_batched_matmul(fmt):
    check("bij,bjk->bik", [sp((3, 5, 6), fmt), torch.randn(3, 6, 4, dtype=torch.float64)])


@pytest.mark.parametrize("fmt", ["csf", "coo", "dcc"])
def test_ttm(fmt):
    check("ijk,km->ijm", [sp((4, 5, 6), fmt, 0.2), torch.randn(6, 3, dtype=torch.float64)])


@pytest.mark.parametrize("fmt", ["csf", "coo"])
def test_mttkrp(fmt):
    ops = [sp((5, 6, 7), fmt, 0.2), torch.randn(6, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)]
    check("ijk,jm,km->im", ops)


def test_rank4():
    a = sp((3, 4, 2, 5), "cccc", 0.3)
    check("abcd,cdk->abk", [a, torch.randn(2, 5, 3, dtype=torch.float64)])
    check("abcd,abcd->abcd", [a, sp((3, 4, 2, 5), "coo", 0.5, seed=9)])


def test_fused_three_operand_touches_only_pattern():
    bn = sp((6, 40), "csr", 0.1)
    check("bn,bd,ndh->bh", [bn, torch.randn(6, 3, dtype=torch.float64), torch.randn(40, 3, 4, dtype=torch.float64)])


def test_sums_of_products():
    a, b, c = sp((5, 6), "csr", seed=1), torch.randn(6, 7, dtype=torch.float64), sp((5, 7), "csr", seed=2)
    f = sparsenn.compile("D[i,j] = A[i,k] * B[k,j] + C[i,j]")
    torch.testing.assert_close(to_dense(f(a, b, c)), to_dense(a) @ b + to_dense(c))
    g = sparsenn.compile("D[i,j] = A[i,j] * (B[i,j] - C[i,j]) + E[i]")
    x, y, z = sp((5, 6), "csr", seed=3), sp((5, 6), "coo", seed=4), sp((5, 6), "dcsr", seed=5)
    e = torch.randn(5, dtype=torch.float64)
    expected = to_dense(x) * (to_dense(y) - to_dense(z)) + e[:, None]
    torch.testing.assert_close(to_dense(g(x, y, z, e)), expected)


@pytest.mark.parametrize("density", [0.01, 0.5])
def test_sparse_gram_matrix_is_stored_sparse(density):
    """A·Aᵀ of CSR operands: Algorithm 4 sees two dense levels, but only sparse operands
    carry the output's indices, so the result is CSR (Gustavson), not an n² array, even
    when the product count suggests it fills in (the count can exceed the true nonzeros
    many times over, as on banded matrices)."""
    a = sp((400, 300), "csr", density=density)
    result = check("ij,kj->ik", [a, a])
    assert isinstance(result, SparseTensor) and str(result.format) == "csr"
    assert isinstance(sparsenn.einsum("ij,kj->ik", a, torch.randn(400, 300, dtype=torch.float64)), torch.Tensor)


def test_transposed_product_with_dense_operand_is_sparse_whatever_its_fill():
    """Aᵀ·B with dense B: Algorithm 4 makes j sparse (A stores it compressed) and k
    compressed because it follows j; the result is a SparseTensor however full it is.
    ``out_format="auto"`` asks for the fill-based choice: dense once the estimated
    fill reaches 1/8, sparse with few stored j."""
    a, b = sp((300, 200), "csr", density=0.05), torch.randn(300, 16, dtype=torch.float64)
    few = sparsenn.from_coo(torch.tensor([[0, 5], [3, 150]]), torch.ones(2, dtype=torch.float64), (300, 200), format="csr")
    for operand in (a, few):
        result = check("ij,ik->jk", [operand, b])
        assert isinstance(result, SparseTensor) and str(result.format) == "dcsr"
    assert isinstance(check("ij,ik->jk", [a, b], out_format="auto"), torch.Tensor)
    result = check("ij,ik->jk", [few, b], out_format="auto")
    assert isinstance(result, SparseTensor) and result.nnz == 2 * 16


def test_sparse_plus_sparse_union_is_sparse():
    a, b = sp((20, 30), "csr", 0.1, seed=1), sp((20, 30), "csr", 0.1, seed=2)
    result = sparsenn.compile("C[i,j] = A[i,j] + B[i,j]")(a, b)
    assert isinstance(result, SparseTensor)
    union = ((to_dense(a) != 0) | (to_dense(b) != 0)).sum().item()
    assert result.nnz == union


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr"])
def test_empty_and_all_zero(fmt):
    zero = sparsenn.from_dense(torch.zeros(5, 4, dtype=torch.float64), format=fmt)
    assert zero.nnz == 0
    check("ij,jk->ik", [zero, torch.randn(4, 3, dtype=torch.float64)])
    check("ij,jk->ik", [zero, zero.T])
    empty = sparsenn.from_dense(torch.zeros(0, 4, dtype=torch.float64), format=fmt)
    check("ij,jk->ik", [empty, torch.randn(4, 3, dtype=torch.float64)])
    check("ij,ij->ij", [empty, empty])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dtypes_and_index_widths(dtype, index_dtype):
    a = sp((12, 9), "csr", dtype=dtype, index_dtype=index_dtype)
    b = sp((9, 7), "csr", seed=2, dtype=dtype, index_dtype=index_dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    check("ij,jk->ik", [a, torch.randn(9, 4, dtype=dtype)], atol=atol)
    result = check("ij,jk->ik", [a, b], atol=atol)
    assert result.index_dtype == index_dtype


@pytest.mark.parametrize("out_format", ["csr", "csc", "coo", "dcsr", "csf", "dense"])
def test_out_format_override(out_format):
    result = check("ij,jk->ik", [sp((6, 7), "csr"), sp((7, 5), "csr", seed=1)], out_format=out_format)
    if out_format == "dense":
        assert isinstance(result, torch.Tensor)
    else:
        assert result.format == sparsenn.parse_format(out_format, 2)


def test_implicit_output_and_scalar():
    a = sp((4, 5), "csr")
    check("ij,jk", [a, torch.randn(5, 3, dtype=torch.float64)])
    check("ij,ij", [a, torch.randn(4, 5, dtype=torch.float64)])
    check("ij->", [a])
    check("ij->ji", [a])


def test_all_dense_goes_to_torch():
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", x, y), x @ y)


def test_blocked_operand():
    dense = random_dense((8, 6), 0.3)
    a = sparsenn.from_dense(dense, format="bsr(2,3)")
    check("ij,jk->ik", [a, torch.randn(6, 4, dtype=torch.float64)])


def test_explain_shows_the_plan():
    text = sparsenn.explain("ij,jk->ik", sp((6, 7), "csr"), sp((7, 5), "csr"))
    for needle in ["output format: csr", "loop order i,j,k", "workspace: dense over k", "extern \"C\""]:
        assert needle in text, needle


def test_operators_map_to_the_compiler():
    a, b = sp((5, 6), "csr", seed=1), sp((5, 6), "coo", seed=2)
    x = torch.randn(6, 3, dtype=torch.float64)
    da, db = a.to_dense(), b.to_dense()
    torch.testing.assert_close((a + b).to_dense(), da + db)
    torch.testing.assert_close((a - b).to_dense(), da - db)
    torch.testing.assert_close((a * b).to_dense(), da * db)
    torch.testing.assert_close((2.5 * a).to_dense(), 2.5 * da)
    torch.testing.assert_close((-a).to_dense(), -da)
    torch.testing.assert_close(a @ x, da @ x)
    torch.testing.assert_close(x.T @ a.T, x.T @ da.T)
    torch.testing.assert_close(a @ x[:, 0], da @ x[:, 0])
    torch.testing.assert_close((a @ b.T).to_dense(), da @ db.T)
    with pytest.raises(ValueError, match="same shape"):
        a + sp((6, 5), "csr")


def test_restored_patterns_are_cached_but_values_follow():
    a = sp((30, 20), "csc", seed=3)
    x = torch.randn(20, 16, dtype=torch.float64)
    first = sparsenn.einsum("ij,jk->ik", a, x, out_format="dense")
    for scale in (2.0, -1.0):  # same pattern, new values: the cached transpose must not go stale
        b = a.with_values(a.values * scale)
        torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", b, x, out_format="dense"), scale * first)
    other = sp((30, 20), "csc", seed=4)  # a different pattern of the same shape and format
    check("ij,jk->ik", [other, x], out_format="dense")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [4, 8, 12, 16, 20, 32, 45, 96])
def test_register_blocked_spmm_with_partial_blocks(dtype, k):
    # Whole register blocks plus a remainder handled by the plain loop.
    a = sp((37, 29), "csr", dtype=dtype)
    check("ij,jk->ik", [a, torch.randn(29, k, dtype=dtype)], atol=1e-4 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7, 9])
def test_spmm_of_narrow_rows(dtype, k, avx2_host):
    # Rows of at most 16 bytes run 16-byte vectors (masked below 4 floats or 2 doubles),
    # wider ones the target's; rows 0 and 2 of the matrix are empty, 37 rows are odd.
    dense = random_dense((37, 29), 0.3, torch.float64, 5)
    dense[[0, 2]] = 0
    a = sparsenn.from_dense(dense.to(dtype), format="csr")
    b = torch.randn(29, k, dtype=torch.float64).to(dtype)
    expected = torch.einsum("ij,jk->ik", dense.to(dtype).double(), b.double())
    result = sparsenn.einsum("ij,jk->ik", a, b)
    assert result.dtype == dtype and result.shape == (37, k)
    atol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(result.double(), expected, atol=atol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    if 1 < k and k * torch.finfo(dtype).bits <= 128 and dtype != torch.bfloat16:  # (one column: a dot product)
        assert api.plan("ij,jk->ik", a, b).kernel.vector_bytes == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_narrow_dense_loops_stay_vectorised(dtype, avx2_host):
    # GCC vectorises only what the code asks for (jit.GCC_FLAGS): the last, partial
    # block of a register-blocked SpMM runs masked vectors, and a dot product steps
    # single vectors before its scalar tail. Sparse outputs, whose loops append to
    # workspaces, never carry a plain omp simd.
    atol = 1e-4 if dtype == torch.float32 else 1e-10
    a = sp((37, 29), "csr", dtype=dtype)
    b = torch.randn(29, 45, dtype=dtype)
    check("ij,jk->ik", [a, b], atol=atol)
    loops = list(walk(api.plan("ij,jk->ik", a, b).kernel.loops))
    assert any(isinstance(n, ir.VectorStore) and n.lanes is not None for n in loops)
    assert any(isinstance(n, ir.VectorLoad) and n.lanes is not None for n in loops)
    x, y = torch.randn(37, 20, dtype=dtype), torch.randn(29, 20, dtype=dtype)
    check("ij,ik,jk->ij", [a, x, y], atol=atol)
    single_vectors = ir.Assign(ir.Var("i2"), ir.Lanes(), "+=")
    assert api.plan("ij,ik,jk->ij", a, x, y).schedule.nests[0].vector_reduction.index == "k"
    assert any(isinstance(n, ir.For) and n.step == single_vectors
               for n in walk(api.plan("ij,ik,jk->ij", a, x, y).kernel.loops))
    assert "#pragma omp simd\n" not in kernel_body("ij,kj->ik", a, a)


def test_register_blocked_products_and_sums():
    a = sp((21, 6, 7), "csf")
    b = torch.randn(6, 7, 40, dtype=torch.float64)
    check("ijl,jlk->ik", [a, b])  # two reduction loops above the blocked loop
    c = torch.randn(21, 40, dtype=torch.float64)
    check("ij,jk,ik->ik", [sp((21, 6), "csr"), torch.randn(6, 40, dtype=torch.float64), c])  # two vector factors
    a2, b2 = sp((21, 6), "csr"), torch.randn(6, 40, dtype=torch.float64)
    result = sparsenn.compile("D[i,k] = A[i,j] * B[j,k] - C[i,k]")(a2, b2, c)
    torch.testing.assert_close(result, a2.to_dense() @ b2 - c)
    v = torch.randn(6, dtype=torch.float64)  # a term that broadcasts over the blocked index
    result = sparsenn.compile("D[i,k] = A[i,j] * V[j] + C[i,k]")(a2, v, c)
    torch.testing.assert_close(result, (a2.to_dense() @ v)[:, None] + c)


def test_outputs_stored_once_skip_zeroing():
    # A kernel that stores every output element once gets uninitialised memory (NaN
    # here, see conftest): dense loops over every output index, reductions inside.
    a = sp((23, 19), "csr", density=0.2)
    empty_rows = sparsenn.from_dense(torch.cat([a.to_dense()[:10], torch.zeros(13, 19, dtype=torch.float64)]), "dcsr")
    stored_once = {
        "ij,j->i": [a, torch.randn(19, dtype=torch.float64)],
        "ij,jk->ik": [a, torch.randn(19, 45, dtype=torch.float64)],  # register blocks and a scalar tail
        "ij,ik,jk->ij": [a, torch.randn(23, 8, dtype=torch.float64), torch.randn(19, 8, dtype=torch.float64)],
        "ij->": [a],
    }
    for equation, operands in stored_once.items():
        assert api.plan(equation, *operands).kernel.overwrites_output, equation
        check(equation, operands)
    added = {
        "ij,j->i": [empty_rows, torch.randn(19, dtype=torch.float64)],  # rows without entries are never visited
        "ij,j->j": [a, torch.randn(19, dtype=torch.float64)],  # a reduction outside the output loop
        "ij,j->ij": [a, torch.randn(19, dtype=torch.float64)],
    }
    for equation, operands in added.items():
        assert not api.plan(equation, *operands, out_format="dense").kernel.overwrites_output, equation
        check(equation, operands, out_format="dense")
    # A sum's first term stores, the second adds.
    x, c = torch.randn(19, dtype=torch.float64), torch.randn(23, 19, dtype=torch.float64)
    expression = sparsenn.compile("y[i] = A[i,j] * x[j] + C[i,j] * x[j]")
    stores = re.findall(r"out\[i\d+\] (\+?=) ", expression.explain(a, x, c))
    assert stores == ["=", "=", "+=", "+="]  # each nest twice: for a team and for one thread
    torch.testing.assert_close(expression(a, x, c), a.to_dense() @ x + c @ x)


@pytest.mark.parametrize("out_format", ["csr", "dc", "dcsr"])
def test_dense_output_level_over_a_sparse_loop_counts_every_row(out_format):
    # Row 1 of the outer product has no stored entry, but a dense output level must
    # still give it a (zero) count. Found by the fuzz suite.
    a = sparsenn.from_dense(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), "coo")
    b = sparsenn.from_dense(torch.tensor([1.0, 0.0], dtype=torch.float64), "coo")
    check("a,b->ab", [a, b], out_format=out_format)
    check("ab,c->abc", [sp((3, 4), "csr"), b], out_format="dcs[0,2,1]")
    # Below a row of a that stores nothing, the dense level over b still records each
    # (a, b) row, appended or counted.
    c = sparsenn.from_dense(torch.tensor([0.0, 1.0, 0.0, 5.0], dtype=torch.float64), "coo")
    dense_b = torch.tensor([1.0, 3.0], dtype=torch.float64)
    check("a,b,c,d->abcd", [a, dense_b, c, b], out_format="ddcc")
    check("a,b,c->abc", [a, dense_b, c], out_format="ddc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [3, 32, 64, 77])
def test_vectorised_inner_reductions(dtype, k):
    # SDDMM's inner dot product: multi-accumulator SIMD blocks plus a scalar tail.
    a = sp((23, 19), "csr", dtype=dtype)
    x, y = torch.randn(23, k, dtype=dtype), torch.randn(19, k, dtype=dtype)
    atol = 1e-4 if dtype == torch.float32 else 1e-10
    check("ij,ik,jk->ij", [a, x, y], atol=atol)
    check("ij,ijk,jk->i", [a, torch.randn(23, 19, k, dtype=dtype), y], atol=atol)


def test_restored_operand_with_dense_level_below_sparse_gathers_zeros():
    # Re-storing "cd" as "cd[1,0]" stores explicit zeros where the source has no entry;
    # they must read 0, not the first stored value. Found by the fuzz suite.
    x = torch.tensor([1.0, 0.0], dtype=torch.float64)
    y = sparsenn.from_dense(torch.tensor([[0.0], [2.0]], dtype=torch.float64), "cd")
    check("b,ba->ab", [x, y])


def test_one_operand_read_in_two_orders_by_two_terms():
    # Each term reads its own re-stored copy / layout. Found by the fuzz suite.
    g = torch.Generator().manual_seed(0)
    bd = torch.randn(3, 3, dtype=torch.float64, generator=g)
    c = torch.randn(3, dtype=torch.float64, generator=g)
    b = sparsenn.from_dense(bd, "coo")
    got = sparsenn.compile("Out[i] = B[i,k] * C[k] + B[k,i] * C[k]")(b, c)
    torch.testing.assert_close(to_dense(got), bd @ c + bd.T @ c)
    c3 = torch.randn(3, 3, 3, dtype=torch.float64, generator=g)
    got = sparsenn.compile("Out[l,i] = B[k,l] * C[l,i,k] + C[j,l,i]")(b, c3)
    torch.testing.assert_close(to_dense(got), torch.einsum("kl,lik->li", bd, c3) + torch.einsum("jli->li", c3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiled_and_register_blocked_batch_loop(dtype):
    # x @ W.T with a long reduction: the batch loop is tiled to fit L2 (on most
    # machines) and register-blocked inside each tile, with partial tiles and blocks.
    w = sp((30, 3000), "csr", density=0.05, dtype=dtype)
    x = torch.randn(83, 3000, dtype=dtype)
    check("bi,oi->bo", [x, w], out_format="dense", atol=1e-3 if dtype == torch.float32 else 1e-9)


def test_replaced_index_arrays_are_rejected_not_trusted():
    # A same-length replacement has a fresh version counter; its address gives it away.
    x = torch.randn(3, 2, dtype=torch.float64)
    a = sparsenn.from_dense(torch.eye(3, dtype=torch.float64), "csr")
    sparsenn.einsum("ij,jk->ik", a, x)  # the call signature is cached: the check must still run
    a.crd[1].data = torch.tensor([100_000_000, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="operand 0: index arrays .* replaced"):
        sparsenn.einsum("ij,jk->ik", a, x)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copied_sparse_tensors_are_usable(how, tmp_path):
    a = sp((6, 5), "csr", density=0.4)
    if how == "deepcopy":
        b = copy.deepcopy(a)
    else:
        torch.save(a, tmp_path / "a.pt")
        b = torch.load(tmp_path / "a.pt", weights_only=False)
    assert b.pos[1] is not a.pos[1] and b.signature == a.signature
    x = torch.randn(5, 3, dtype=a.dtype)
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", b, x), sparsenn.einsum("ij,jk->ik", a, x))


def test_dense_expression_with_sparse_out_format_keeps_every_entry():
    # The pattern is structural: an entry that happens to be 0 still gets its gradient.
    x = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    result = sparsenn.einsum("ij,jk->ik", x, w, out_format="coo")
    assert result.nnz == 4
    torch.testing.assert_close(result.to_dense(), (x @ w).detach())
    assert torch.autograd.gradcheck(
        lambda a: sparsenn.einsum("ij,jk->ik", a, w, out_format="csr").values, (x.detach().requires_grad_(),)
    )


@pytest.mark.parametrize("equation", ["ij,jk->ik", "ij,j->i", "ij,ik,jk->ij"])
def test_one_thread_and_a_team_run_the_same_nest(equation, avx2_host):
    # A short parallel nest is emitted twice: inside an OpenMP team, and bare for one
    # thread (no team start-up); a long one once, in a team of one thread for one thread.
    # Both must compute the same thing.
    a = sp((400, 300), "csr", density=0.5)
    dense = [torch.randn(300, 40, dtype=torch.float64)] if equation == "ij,jk->ik" else (
        [torch.randn(300, dtype=torch.float64)] if equation == "ij,j->i"
        else [torch.randn(400, 40, dtype=torch.float64), torch.randn(300, 40, dtype=torch.float64)])
    source = api.plan(equation, a, *dense).source
    copies = 2 if "if (nthreads > 1)" in source else 1
    assert source.count("#pragma omp for") == copies
    assert copies == 2 or "#pragma omp parallel num_threads(nthreads) if(nthreads > 1)" in source
    assert api.plan(equation, a, *dense).schedule.serial is False
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(to_dense(check(equation, [a, *dense])))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], results[1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("equation", ["bhij,bhjd->bhid", "bhij,bhid,bhjd->bhij"])
@pytest.mark.parametrize("fmt", ["dddc", "dddc(1,1,4,4)"])
def test_team_loops_run_as_one_thread_does(equation, fmt, avx2_host):
    # One batch element of 3 heads: the team shares b, h and the (block) rows as one
    # range of flattened coordinates, chunks ending mid-head.
    # whole 4 x 4 blocks, 30 % of them: sparse enough for one kernel, not a contraction path
    blocks = (random_dense((1, 3, 24, 24), 0.3) != 0).repeat_interleave(4, 2).repeat_interleave(4, 3)
    mask = sparsenn.from_dense(torch.randn(1, 3, 96, 96, dtype=torch.float64) * blocks, format=fmt)
    q, k = torch.randn(1, 3, 96, 16, dtype=torch.float64), torch.randn(1, 3, 96, 16, dtype=torch.float64)
    operands = [mask, k] if equation == "bhij,bhjd->bhid" else [mask, q, k]
    plan = api.plan(equation, *operands)
    assert not plan.schedule.serial and plan.schedule.nests[0].team_loops == 3
    assert "flat" in plan.source
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(to_dense(check(equation, operands)))
            results.append(sparsenn.softmax(mask, -1).to_dense())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], results[2], atol=1e-12, rtol=0)
    torch.testing.assert_close(results[1], results[3], atol=1e-12, rtol=0)
    stored = mask.with_values(torch.ones_like(mask.values)).to_dense() != 0  # blocks store zeros too
    expected = torch.softmax(mask.to_dense().masked_fill(~stored, -math.inf), -1).nan_to_num(0.0) * stored
    torch.testing.assert_close(results[1], expected, atol=1e-12, rtol=1e-9)


def rows_of_lengths(lengths, cols, dtype, seed=0):
    """Dense matrix whose row r stores lengths[r] entries (rows shorter and longer than
    the unrolled and prefetched distances, empty rows, a full last row)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.zeros(len(lengths), cols, dtype=dtype)
    for r, n in enumerate(lengths):
        d[r, torch.randperm(cols, generator=g)[:n]] = torch.randn(n, generator=g, dtype=dtype)
    return d


def kernel_body(equation, *operands, out_format=None):
    """The generated sn_run of the plan for ``operands`` (the prelude left out)."""
    text = sparsenn.explain(equation, *operands, out_format=out_format)
    return text[text.index('extern "C" int sn_run'):]


LENGTHS = [0, 1, 3, 4, 5, 0, 8, 13, 40, 2, 0, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sparse_reduction_into_several_accumulators(dtype, index_dtype, avx2_host):
    # SpMV's row dot product runs as interleaved sums (one per 8 positions of a mean row,
    # up to the target's 4) plus a scalar tail; full rows make the mean row long.
    lengths = LENGTHS + [64] * len(LENGTHS)
    a = sparsenn.from_dense(rows_of_lengths(lengths, 64, dtype), "csr", index_dtype=index_dtype)
    x = torch.randn(64, dtype=dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    check("ij,j->i", [a, x], atol=atol)
    assert api.plan("ij,j->i", a, x).schedule.nests[0].sparse_reduction.accumulators == AVX2.sparse_accumulators
    # A dense-level operand located by the same loop, and a dense matrix factor.
    b = sparsenn.from_dense(torch.randn(len(lengths), 64, dtype=dtype), "dd")
    check("ij,ij->i", [a, b], atol=atol)
    check("ij,ij,j->i", [a, torch.randn(len(lengths), 64, dtype=dtype), x], atol=atol)
    # Not for a singleton level (COO) nor for an intersection of two sparse levels.
    coo = sparsenn.from_dense(a.to_dense(), "coo")
    check("ij,j->i", [coo, x], atol=atol)
    assert api.plan("ij,j->i", coo, x).schedule.nests[0].sparse_reduction is None
    other = sparsenn.from_dense(rows_of_lengths(lengths[::-1], 64, dtype, seed=1), "csr")
    check("ij,ij->i", [a, other], atol=atol)
    assert api.plan("ij,ij->i", a, other).schedule.nests[0].sparse_reduction is None


@pytest.fixture
def always_prefetch(host_target):
    """Kernels built while this is active prefetch every gather, whatever the operand's
    size and the pattern's locality (the test operands are far smaller than a cache).
    Memory is as fast as the L2, so that the dense path does not take the kernels'
    place (gathers from memory would make BLAS on a dense copy cheaper)."""
    host_target(dataclasses.replace(AVX2, l2_bytes=1, llc_bytes=1, prefetch_min_footprint=0.0, prefetch_min_jump=0,
                                    llc_bytes_per_cycle=AVX2.l2_bytes_per_cycle,
                                    dram_bytes_per_cycle=AVX2.l2_bytes_per_cycle))


def test_prefetch_only_when_gathers_miss_the_caches(avx2_host):
    # The schedule names the loops that may prefetch and the policy of the run-time test
    # (see plan.decisions): each such loop decides once per fiber, then runs its copy
    # with prefetches or the plain one.
    a = sparsenn.from_dense(rows_of_lengths(LENGTHS, 70, torch.float32), "csr")
    plan = api.plan("ij,jk->ik", a, torch.randn(70, 32))
    (nest,) = plan.schedule.nests
    assert nest.prefetch == (PrefetchLoop("j", (1,)),)  # the loop over A's row gathers rows of B
    assert plan.schedule.prefetch_policy == PrefetchPolicy.of(AVX2)
    tests = [n for n in walk(plan.kernel.loops) if isinstance(n, ir.If) and isinstance(n.cond, ir.Var)
             and any(isinstance(p, ir.Prefetch) for p in walk(n.then))]
    assert len(tests) >= 2  # the register block and the remainder's loops
    assert all(n.other is not None and not any(isinstance(p, ir.Prefetch) for p in walk(n.other)) for n in tests)
    assert not api.plan("ij,j->i", a, torch.randn(70)).schedule.nests[0].prefetch  # single elements


def walk(node):
    """Every IR node under ``node``."""
    if isinstance(node, tuple):
        for x in node:
            yield from walk(x)
        return
    if not dataclasses.is_dataclass(node):
        return
    yield node
    for f in dataclasses.fields(node):
        yield from walk(getattr(node, f.name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [1, 7, 32, 45, 160])
def test_prefetched_gathers(dtype, index_dtype, k, always_prefetch):
    # SpMM and SDDMM prefetch the row of the dense operand that the position D ahead
    # gathers (D up to 64 positions, running into later rows, never past the last one).
    a = sparsenn.from_dense(rows_of_lengths(LENGTHS, 70, dtype), "csr", index_dtype=index_dtype)
    b = torch.randn(70, k, dtype=dtype)
    x = torch.randn(len(LENGTHS), k, dtype=dtype)
    atol = 1e-4 if dtype == torch.float32 else 1e-10
    check("ij,jk->ik", [a, b], atol=atol)
    check("ij,ik,jk->ij", [a, x, b], atol=atol)
    spmm = api.plan("ij,jk->ik", a, b).schedule.nests[0]
    if k == 1:  # one column: the SpMV form, a sum in registers over each row's gathered elements
        assert spmm.order == ("i", "k", "j") and spmm.sparse_reduction and not spmm.prefetch
    else:
        assert spmm.prefetch
        assert api.plan("ij,ik,jk->ij", a, x, b).schedule.nests[0].prefetch
    # Transposed B (k before j) is read with a stride, and SpMV gathers single elements.
    check("ij,kj->ik", [a, b.T.contiguous()], atol=atol)
    assert not api.plan("ij,j->i", a, b[:, 0].contiguous()).schedule.nests[0].prefetch
    # The last row is the longest, so the distance is clamped at the end of crd.
    check("ij,jk->ik", [sparsenn.from_dense(rows_of_lengths([0, 2, 70], 70, dtype), "csr"), b], atol=atol)


def test_prefetch_through_a_lower_level(always_prefetch):
    # A CSF tensor's innermost compressed level gathers rows of B: its crd length is
    # pos[pos[N]] of the levels above.
    a = sp((9, 8, 30), "csf", density=0.4)
    b = torch.randn(30, 33, dtype=torch.float64)
    check("ijl,lk->ijk", [a, b], out_format="dense")
    loops = api.plan("ijl,lk->ijk", a, b, out_format="dense").kernel.loops
    pos = [ir.Array("pos", 0, level) for level in range(3)]
    crd_length = ir.Load(pos[2], ir.Load(pos[1], ir.Load(pos[0], ir.Const(1))))
    last = [d.init for d in walk(loops) if isinstance(d, ir.Decl) and d.var.name.startswith("pflast")]
    assert last and all(init == ir.sub(ir.Cast("index", crd_length), 1) for init in last)


# ----------------------------------------------------------------------------- two-phase sparse outputs


def two_phase_plan(equation, operands, out_format=None):
    """The plan, asserting its output is assembled in two phases (count, then fill)."""
    plan = api.plan(equation, *operands, out_format=out_format)
    assert plan.kernel.fill is not None, plan.output_format
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_two_phase_spgemm_with_empty_rows(dtype, index_dtype):
    dense = random_dense((40, 30), 0.15, dtype)
    dense[::3] = 0  # every third row empty, so are those rows of A·Aᵀ
    a = sparsenn.from_dense(dense, format="csr", index_dtype=index_dtype)
    two_phase_plan("ij,kj->ik", [a, a], out_format="csr")
    atol = 1e-5 if dtype == torch.float32 else 1e-10
    result = check("ij,kj->ik", [a, a], out_format="csr", atol=atol)
    assert result.index_dtype == index_dtype and result.values.dtype == dtype
    assert (result.pos[1][1::3] == result.pos[1][::3][: len(result.pos[1][1::3])]).all()  # empty rows
    check("ij,jk->ik", [a, sp((30, 20), "csr", 0.2, seed=3, dtype=dtype, index_dtype=index_dtype)], atol=atol)


def test_two_phase_empty_result():
    # Non-empty operands whose product has no entry: A only uses column 0, B's row 0 is empty.
    a = sparsenn.from_dense(torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 0.0]], dtype=torch.float64), "csr")
    b = sparsenn.from_dense(torch.tensor([[0.0, 0.0, 0.0], [0.0, 3.0, 4.0]], dtype=torch.float64), "csr")
    two_phase_plan("ij,jk->ik", [a, b])
    result = check("ij,jk->ik", [a, b])
    assert result.nnz == 0 and result.pos[1].tolist() == [0, 0, 0, 0]


def test_two_phase_many_chunks_per_thread_short_and_long_rows():
    """Enough work to run in parallel (several chunks per thread), keys spanning several
    4096-key summary words, rows with few keys (sorted) and many (bitmap walk)."""
    import scipy.sparse as sps

    rng = np.random.default_rng(0)
    a = sps.random(1500, 9000, density=0.0002, format="csr", random_state=rng)
    a = sps.vstack([sps.random(100, 9000, density=0.02, format="csr", random_state=rng), a[100:]]).tocsr()
    keep = np.ones(1500)
    keep[7] = 0
    a = (sps.diags(keep) @ a).tocsr()
    a.eliminate_zeros()
    b = sps.random(9000, 9000, density=0.0005, format="csr", random_state=rng)
    x, y = sparsenn.from_scipy(a, format="csr"), sparsenn.from_scipy(b, format="csr")
    plan = two_phase_plan("ij,jk->ik", [x, y], out_format="csr")
    assert plan.schedule.serial is False
    expected = (a @ b).toarray()
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            result = sparsenn.einsum("ij,jk->ik", x, y, out_format="csr")
        finally:
            torch.set_num_threads(previous)
        np.testing.assert_allclose(result.to_scipy().toarray(), expected, rtol=1e-12, atol=1e-12)
        counts = result.pos[1].diff()
        assert counts[7] == 0 and counts.max() > 16 and 0 < counts[counts > 0].min() <= 16


def test_two_phase_outputs_of_other_shapes():
    # Two dense levels then a compressed one; sums of products with and without a workspace.
    x = sp((3, 5, 6), "dcc", 0.3, seed=1)
    y = sp((3, 6, 4), "dcc", 0.3, seed=2)
    two_phase_plan("bij,bjk->bik", [x, y], out_format="ddc")
    check("bij,bjk->bik", [x, y], out_format="ddc")
    a, b, c = sp((8, 9), "csr", 0.2, seed=3), sp((9, 7), "csr", 0.2, seed=4), sp((8, 7), "csr", 0.2, seed=5)
    f = sparsenn.compile("D[i,k] = A[i,j] * B[j,k] - C[i,k]")
    plan = plan_call(f.assignment, tuple(operand_info(o) for o in (a, b, c)), None, torch.float64, torch.int32).plan
    assert plan.kernel.fill is not None
    torch.testing.assert_close(to_dense(f(a, b, c)), to_dense(a) @ to_dense(b) - to_dense(c))
    union = two_phase_plan("ij,ij->ij", [a, sp((8, 9), "csr", 0.2, seed=6)])
    assert union.schedule.workspace is None
    check("ij,ij->ij", [a, sp((8, 9), "csr", 0.2, seed=6)])


def test_deeper_sparse_outputs_keep_the_appended_assembly():
    plan = api.plan("ij,jk->ik", sp((6, 7), "csr"), sp((7, 5), "csr", seed=1), out_format="dcsr")
    assert plan.kernel.fill is None and not plan.schedule.assembly.two_phase
    effects = {e.name for e in walk(plan.kernel.loops) if isinstance(e, ir.Effect)}
    assert {"new_result", "open_chunk", "append_crd", "ws_add", "ws_drain"} <= effects


def test_two_phase_second_phase_is_loop_ir():
    plan = two_phase_plan("ij,jk->ik", [sp((6, 7), "csr"), sp((7, 5), "csr", seed=1)])
    assert plan.schedule.assembly.two_phase
    first = {e.name for e in walk(plan.kernel.loops) if isinstance(e, ir.Effect)}
    second = {e.name for e in walk(plan.kernel.fill_loops) if isinstance(e, ir.Effect)}
    assert {"count_rows", "ws_mark"} <= first and not {"ws_add", "read_rows"} & first
    assert {"read_rows", "ws_add"} <= second and not {"ws_mark", "count_rows"} & second
    assert not any(isinstance(c, ir.Load) and c.array.kind == "val" for c in walk(plan.kernel.loops))  # pattern only


def merge_loops(loops):
    """The merge loops of a kernel: its while-loops over two or more cursors (their
    condition and'ed tests ``q < h``)."""
    def live_tests(e):
        if isinstance(e, ir.Bin) and e.op == "&&":
            return live_tests(e.left) + live_tests(e.right)
        return [e.op == "<" and all(isinstance(x, ir.Var) for x in (e.left, e.right))]

    return [w for w in walk(loops) if isinstance(w, ir.While) and w.cond.op == "&&" and all(live_tests(w.cond))]


def presence_flags(loop):
    return [d for d in loop.body.stmts if isinstance(d, ir.Decl) and d.type == "bool"]


@pytest.mark.parametrize("fa, fb, merges", [("coo", "coo", 2), ("dcsr", "coo", 2), ("csr", "dcsr", 1)])
def test_sums_and_products_share_one_merge(fa, fb, merges):
    # A + B: the union's lattice at each shared level where both are stored: one merge
    # loop while both are live (each term's presence a flag), then each term's own
    # fiber loop; A * B: the intersection, one merge loop.
    a, b = sp((9, 8), fa, seed=1), sp((9, 8), fb, seed=2)
    union = sparsenn.compile("C[i,j] = A[i,j] + B[i,j]")
    plan = plan_call(union.assignment, tuple(operand_info(o) for o in (a, b,)), None, torch.float64, torch.int32).plan
    torch.testing.assert_close(to_dense(union(a, b)), to_dense(a) + to_dense(b))
    merged = merge_loops(plan.kernel.loops)
    assert len(merged) == merges and all(len(presence_flags(w)) == 2 for w in merged)
    assert lattice(2) == [(0, 1), (0,), (1,)] and lattice(1) == [(0,)]
    product = api.plan("ij,ij->ij", a, b)
    check("ij,ij->ij", [a, b])
    assert merge_loops(product.kernel.loops) and not any(presence_flags(w) for w in merge_loops(product.kernel.loops))


@pytest.mark.parametrize("formats", [("csr", "csr", "csr"), ("coo", "dcsr", "coo"), ("csr", "coo", "dcsr")])
def test_sums_of_three_collapse_the_lattice_into_one_loop(formats):
    # Seven lattice points per shared level would multiply the body: one loop runs until
    # every cursor is exhausted (an exhausted cursor's coordinate is past all others).
    a, b, e = (sp((9, 8), fmt, seed=n) for n, fmt in enumerate(formats))
    f = sparsenn.compile("D[i,j] = A[i,j] + B[i,j] - E[i,j]")
    plan = plan_call(f.assignment, tuple(operand_info(o) for o in (a, b, e,)), None, torch.float64, torch.int32).plan
    assert not plan.schedule.union_by_points and "one merge loop" in plan.schedule.describe()
    collapsed = [w for w in walk(plan.kernel.loops) if isinstance(w, ir.While) and w.cond == ir.Const(1)]
    assert collapsed and all(any(isinstance(x, ir.Break) for x in walk(w.body)) for w in collapsed)
    assert all(len(presence_flags(w)) == 3 for w in collapsed)
    torch.testing.assert_close(to_dense(f(a, b, e)), to_dense(a) + to_dense(b) - to_dense(e))


def test_a_dense_term_in_a_sum_walks_every_coordinate():
    # A dense term is present everywhere: the sum's loops visit every coordinate and
    # advance the sparse cursors sitting on it, with no merge loop.
    a, b, x = sp((9, 8), "coo", seed=1), sp((9, 8), "dcsr", seed=2), random_dense((9, 8), 1.0, seed=3)
    f = sparsenn.compile("C[i,j] = A[i,j] + B[i,j] - X[i,j]", out_format="csr")
    plan = plan_call(f.assignment, tuple(operand_info(o) for o in (a, b, x,)), sparsenn.parse_format("csr", 2), torch.float64, torch.int32).plan
    assert not merge_loops(plan.kernel.loops) and plan.schedule.assembly.two_phase
    torch.testing.assert_close(to_dense(f(a, b, x)), to_dense(a) + to_dense(b) - x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [1, 7, 16, 45, 64])
def test_row_blocked_inner_reductions(dtype, index_dtype, k, avx2_host):
    # Rows of 0..9 stored entries: whole blocks of 4 share X[i, :] loads and one
    # transpose-and-add of their sums; the rest take the one-entry path.
    lengths = [*range(10), 0, 17]
    a = sparsenn.from_dense(rows_of_lengths(lengths, 30, dtype), "csr", index_dtype=index_dtype)
    x = torch.randn(len(lengths), k, dtype=dtype)
    y = torch.randn(30, k, dtype=dtype)
    atol = 1e-4 if dtype == torch.float32 else 1e-10
    for equation in ["ij,ik,jk->ij", "ij,ik,jk->i", "ij,ik,jk->j", "ij,ik,jk->"]:
        check(equation, [a, x, y], atol=atol)
    check("ij,ik,jk->ij", [a, x, y], out_format="dense", atol=atol)
    if k == 1:  # a loop of one trip innermost is overhead: k goes outside, j's sums stay in registers
        assert api.plan("ij,ik,jk->i", a, x, y).schedule.nests[0].sparse_reduction is not None
        return
    assert api.plan("ij,ik,jk->ij", a, x, y).schedule.nests[0].row_block is not None
    assert api.plan("ij,ik,jk->i", a, x, y).schedule.nests[0].row_block is not None
    # A factor of the entry's own (Z[i, j]) and two shared ones (X, W): still blocked.
    z = torch.randn(len(lengths), 30, dtype=dtype)
    check("ij,ij,ik,ik,jk->ij", [a, z, x, x.flip(0).contiguous(), y], atol=atol)
    assert api.plan("ij,ij,ik,ik,jk->ij", a, z, x, x.flip(0).contiguous(), y).schedule.nests[0].row_block
    # No factor shared by the block's entries (every vector factor indexed by j): no block.
    w = torch.randn(len(lengths), 30, k, dtype=dtype)
    check("ij,ijk,jk->ij", [a, w, y], atol=atol)
    assert api.plan("ij,ijk,jk->ij", a, w, y).schedule.nests[0].row_block is None


HSUM_ROWS, HSUM_VECTORS = (1, 2, 4, 8, 16, 32), (1, 2, 3)


def hsum_reference(lanes: np.ndarray, group: int) -> np.ndarray:
    """The runtime header's horizontal sums in its order: the vectors ``lanes`` paired
    level by level (in a vector holding s rows lane l holds row l mod s; the pair's lanes
    l and l + s of each block of 2s add up), then halves folded until ``group`` lanes
    remain; returns those lanes, one per row."""
    w = lanes.shape[1]
    level, s = list(lanes), 1
    while len(level) > 1:
        # Lane l of the pair's low pick: lane l of a, or lane l - s of b, within its block.
        low = [l - l % (2 * s) + (l % (2 * s) if l % (2 * s) < s else w + l % (2 * s) - s) for l in range(w)]
        high = [i + s for i in low]
        level = [np.concatenate([a, b])[low] + np.concatenate([a, b])[high] for a, b in zip(level[::2], level[1::2])]
        s *= 2
    v, live = level[0], w
    while live > group:
        live //= 2
        v = v + v[[l + live if l < live else l for l in range(w)]]
    return v[:group]


@pytest.mark.parametrize("vector_bytes", [8, 16, 32, 64])
@pytest.mark.parametrize("value", ["float", "double"])
def test_hsums_transpose_and_add(value, vector_bytes):
    """sn_hsum and sn_hsums of the kernel header, for every vector width and row count,
    summed bit for bit in the documented order (vectors of any width compile on any host)."""
    from sparsenn.compiler.backend import jit

    dtype = np.float32 if value == "float" else np.float64
    cases = "\n".join(f"  if (rows == {r} && vectors == {a}) return run<{r}, {a}>(in, out);"
                       for r in HSUM_ROWS for a in HSUM_VECTORS)
    lib = jit.load_library(f"""#define SN_VALUE {value}
#define SN_INDEX int32_t
#define SN_VECTOR_BYTES {vector_bytes}
#include "sparsenn_kernel.h"
template <int R, int A> static void run(const V* in, V* out) {{
  VV acc[R][A];
  std::memcpy(acc, in, sizeof acc);
  sn_hsums(acc, out);
}}
extern "C" void hsums(int rows, int vectors, const V* in, V* out) {{
{cases}
}}
extern "C" V hsum(const V* in) {{ return sn_hsum(sn_load(in)); }}
""", "hsums")
    ctype = ctypes.c_float if value == "float" else ctypes.c_double
    lib.hsum.restype, lib.hsum.argtypes = ctype, [ctypes.c_void_p]
    lib.hsums.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    w = vector_bytes // dtype().itemsize
    rng = np.random.default_rng(vector_bytes)
    for rows in HSUM_ROWS:
        for vectors in HSUM_VECTORS:
            acc = rng.standard_normal((rows, vectors, w)).astype(dtype)
            out = np.full(rows, np.nan, dtype=dtype)
            lib.hsums(rows, vectors, acc.ctypes.data, out.ctypes.data)
            sums = acc[:, 0]
            for v in range(1, vectors):
                sums = sums + acc[:, v]
            group = min(rows, w)
            expected = np.concatenate([hsum_reference(sums[g : g + group], group) for g in range(0, rows, group)])
            np.testing.assert_array_equal(out, expected, err_msg=f"rows={rows} vectors={vectors}")
            np.testing.assert_allclose(out, acc.sum(axis=(1, 2)), rtol=1e-4, atol=1e-4)
    v = rng.standard_normal(w).astype(dtype)
    assert lib.hsum(v.ctypes.data) == hsum_reference(v[None], 1)[0]


def test_prefetches_go_to_l2():
    # prefetcht1: prefetcht0's lines would wait for the L1's few miss buffers.
    from sparsenn.compiler.backend import jit

    a = sparsenn.from_dense(rows_of_lengths(LENGTHS, 70, torch.float32), "csr")
    assert "sn_prefetch(d" in sparsenn.explain("ij,jk->ik", a, torch.randn(70, 32))
    header = (jit.RUNTIME_HEADERS / "sparsenn_kernel.h").read_text()
    assert "__builtin_prefetch((const char*)p + b, 0, 2)" in header
