"""sparsenn.softmax and sparsenn.log_softmax against torch.sparse.softmax/log_softmax
(on COO copies), over stored entries of every format, with compiled gradients."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import sparsenn
from sparsenn import SparseTensor

FUNCTIONS = {"softmax": (sparsenn.softmax, torch.sparse.softmax),
             "log_softmax": (sparsenn.log_softmax, torch.sparse.log_softmax)}

# (format, shape, dim): rank 2 in the plain and blocked formats along both modes,
# rank 3 and 4 with blocks (the attention layout (batch, heads, L, L)).
CASES = [
    ("csr", (9, 11), 1), ("csr", (9, 11), 0), ("csc", (9, 11), 1), ("csc", (9, 11), 0),
    ("coo", (9, 11), -1), ("coo", (9, 11), 0), ("dcsr", (9, 11), 1),
    ("bsr(4,4)", (12, 16), 1), ("bsr(4,4)", (12, 16), 0),
    ("coo", (3, 5, 6), 1), ("ddc(1,4,4)", (2, 8, 12), -1),
    ("dddc(1,1,4,4)", (2, 2, 8, 8), -1), ("dddc(1,1,4,4)", (2, 2, 8, 8), 2),
]


def random_sparse(shape, fmt, dtype=torch.float64, density=0.35, seed=0, empty_slices=True) -> SparseTensor:
    """Random values on a random pattern; with ``empty_slices``, the first slice along
    mode 0 has no stored entry."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype)
    dense[torch.rand(shape, generator=g) > density] = 0
    if empty_slices:
        dense[0] = 0
    return sparsenn.from_dense(dense, format=fmt)


def reference(name: str, S: SparseTensor, dim: int) -> torch.Tensor:
    """torch's result on a COO copy (explicit zeros stay stored), coalesced; the dim is
    passed non-negative, as torch's backward mishandles a negative one."""
    coo = S.to_torch(torch.sparse_coo)
    return FUNCTIONS[name][1](coo, dim % S.ndim).coalesce()


def assert_matches(result: SparseTensor, ref: torch.Tensor, S: SparseTensor) -> None:
    """Same pattern as ``S`` (index arrays shared), same values as torch's at it."""
    assert all(a is b for a, b in zip(result.pos + result.crd, S.pos + S.crd)) and result.nnz == S.nnz
    ours = result.to_torch(torch.sparse_coo)
    assert torch.equal(ours.indices(), ref.indices())
    tolerance = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}
    torch.testing.assert_close(ours.values(), ref.values(), **tolerance[S.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("fmt, shape, dim", CASES, ids=[f"{f}-{len(s)}d-dim{d}" for f, s, d in CASES])
def test_matches_torch(fmt, shape, dim, name, dtype):
    S = random_sparse(shape, fmt, dtype)
    assert_matches(FUNCTIONS[name][0](S, dim), reference(name, S, dim), S)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(4,4)"])
def test_gradients_match_torch(fmt, name):
    S = random_sparse((12, 8), fmt, seed=3)
    grad = torch.randn(S.nnz, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for dim in (-1, 0):
        values = S.values.clone().requires_grad_()
        FUNCTIONS[name][0](S.with_values(values), dim).values.backward(grad)
        coo = S.to_torch(torch.sparse_coo).detach().requires_grad_()
        ref = FUNCTIONS[name][1](coo, dim % S.ndim)
        ref.backward(S.with_values(grad).to_torch(torch.sparse_coo))
        ours = S.with_values(values.grad).to_torch(torch.sparse_coo)
        torch.testing.assert_close(ours.values(), coo.grad.coalesce().values(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("fmt, shape, dim", [("csr", (5, 6), 1), ("csc", (5, 6), 0), ("bsr(2,3)", (4, 6), 1),
                                             ("ddc(1,2,2)", (2, 4, 4), -1)])
def test_gradcheck(fmt, shape, dim, name):
    S = random_sparse(shape, fmt, density=0.6, seed=5)
    function = FUNCTIONS[name][0]
    assert gradcheck(lambda v: function(S.with_values(v), dim).values, (S.values.clone().requires_grad_(),))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_single_entry_and_empty_rows(name):
    dense = torch.zeros(5, 6, dtype=torch.float64)
    dense[1, 3] = 2.5  # a single entry: probability 1, log-probability 0
    dense[3, [0, 4]] = torch.tensor([1.0, -1.0], dtype=torch.float64)
    S = sparsenn.from_dense(dense, format="csr")  # rows 0, 2 and 4 are empty
    result = FUNCTIONS[name][0](S)
    assert not result.values.isnan().any()
    assert result.values[0].item() == (1.0 if name == "softmax" else 0.0)
    assert_matches(result, reference(name, S, 1), S)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("fmt", ["csr", "bsr(4,4)"])
def test_all_empty(fmt, name):
    S = sparsenn.from_dense(torch.zeros(8, 8), format=fmt)
    if S.format.block is None:
        assert S.nnz == 0
    result = FUNCTIONS[name][0](S, 0)
    assert result.nnz == S.nnz and not result.values.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("offset", [-1e4, 1e4])
@pytest.mark.parametrize("dim", [0, 1])
def test_stable_far_from_zero(dim, offset, name, dtype):
    """exp(±1e4) under- or overflows in both precisions: only the max shift keeps it finite.
    The reference is torch's on the values shifted back (exact: they are within a factor 2
    of the offset), so it is accurate to the result's precision, not only the input's."""
    S = random_sparse((10, 12), "csr", dtype, seed=6)
    S = S.with_values(S.values + offset)
    result = FUNCTIONS[name][0](S, dim)
    assert torch.isfinite(result.values).all()
    assert_matches(result, reference(name, S.with_values(S.values - offset), dim), S)


@pytest.mark.parametrize("fmt, shape, dim", [("bsr(4,4)", (12, 16), 1), ("bsr(4,4)", (12, 16), 0),
                                             ("dddc(1,1,4,4)", (1, 2, 16, 16), -1)])
def test_stable_far_from_zero_blocked(fmt, shape, dim):
    g = torch.Generator().manual_seed(6)
    blocks = torch.rand(*shape[:-2], shape[-2] // 4, shape[-1] // 4, generator=g) < 0.5
    mask = blocks.repeat_interleave(4, -2).repeat_interleave(4, -1)
    S = sparsenn.from_dense(torch.where(mask, torch.rand(shape, generator=g, dtype=torch.float64) - 1e4, 0), fmt)
    result = sparsenn.softmax(S, dim)
    assert torch.isfinite(result.values).all()
    assert_matches(result, reference("softmax", S.with_values(S.values + 1e4), dim), S)


def test_softmax_sums_to_one_along_dim():
    S = random_sparse((2, 2, 8, 8), "dddc(1,1,4,4)", seed=7)
    sums = sparsenn.softmax(S, 2).to_dense().sum(2)
    counts = S.with_values(torch.ones_like(S.values)).to_dense().sum(2)
    assert (counts == 0).any() and (counts > 0).any()
    torch.testing.assert_close(sums, (counts > 0).to(sums.dtype))


def test_dense_format_is_torch_softmax():
    x = torch.randn(4, 5, dtype=torch.float64)
    S = sparsenn.from_dense(x, format="dense")
    torch.testing.assert_close(sparsenn.softmax(S, 0).to_dense(), torch.softmax(x, 0))
    torch.testing.assert_close(sparsenn.log_softmax(S, 1).to_dense(), torch.log_softmax(x, 1))


def test_without_grad_and_no_grad_mode():
    S = random_sparse((6, 7), "csr", seed=8)
    assert not sparsenn.softmax(S).values.requires_grad
    values = S.values.clone().requires_grad_()
    with torch.no_grad():
        assert not sparsenn.softmax(S.with_values(values)).values.requires_grad
    assert sparsenn.softmax(S.with_values(values)).values.requires_grad


@pytest.mark.parametrize("name", FUNCTIONS)
def test_bad_input(name):
    function = FUNCTIONS[name][0]
    S = random_sparse((4, 5), "csr")
    with pytest.raises(TypeError, match=f"torch.{name}"):
        function(torch.randn(4, 5))
    with pytest.raises(TypeError, match="from_torch"):
        function(torch.randn(4, 5).to_sparse())
    with pytest.raises(TypeError, match="SparseTensor"):
        function([[1.0, 2.0]])
    for dim in (2, -3):
        with pytest.raises(ValueError, match=f"dim {dim} is out of range for a rank-2"):
            function(S, dim)
    for dim in (1.0, True, "1"):
        with pytest.raises(TypeError, match="dim must be an int"):
            function(S, dim)
