"""Results of every rank 0-4 from an operand of every format family, as einsum's and
with gradients: a scalar or a rank-4 result runs the same allocator, launcher and
backward as a matrix does."""

import pytest
import torch

import sparsenn

FAMILIES = ["dense", "csr", "coo", "dcsr", "csc", "bsr(2,2)", "nm(2,4)"]
OUTPUTS = ["", "i", "ik", "ikl", "iklm"]
SIZES = {"i": 4, "j": 8, "k": 2, "l": 3, "m": 2}


def operands(family: str, dtype=torch.float64):
    g = torch.Generator().manual_seed(len(family))
    a = torch.randn(SIZES["i"], SIZES["j"], generator=g, dtype=dtype)
    if family == "nm(2,4)":
        keep = torch.rand(a.shape, generator=g).view(4, 2, 4).argsort(-1).argsort(-1) < 2
        a = a * keep.view(a.shape)
    elif family.startswith("bsr"):
        a = a * (torch.rand(2, 4, generator=g) < 0.5).repeat_interleave(2, 0).repeat_interleave(2, 1)
    else:
        a = a * (torch.rand(a.shape, generator=g) < 0.5)
    x = torch.randn(SIZES["j"], SIZES["k"], SIZES["l"], SIZES["m"], generator=g, dtype=dtype)
    stored = a if family == "dense" else sparsenn.from_dense(a, format=family)
    return a, stored, x


def dense(result):
    return result if isinstance(result, torch.Tensor) else result.to_dense()


def values_of(stored):
    return stored if isinstance(stored, torch.Tensor) else stored.values


def with_values(stored, v):
    return v if isinstance(stored, torch.Tensor) else stored.with_values(v)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("output", OUTPUTS)
def test_every_result_rank_from_every_format_family(family, output):
    a, stored, x = operands(family)
    equation = f"ij,jklm->{output}"
    expected = torch.einsum(equation, a, x)
    for out_format in (None, "dense"):  # None: the result's format inferred from the operands'
        result = dense(sparsenn.einsum(equation, stored, x, out_format=out_format))
        assert result.shape == expected.shape
        torch.testing.assert_close(result, expected)
    if family != "dense":  # a sum of the sparse operand alone
        reduced = sparsenn.einsum(f"ij->{output[:1]}", stored)
        torch.testing.assert_close(dense(reduced), torch.einsum(f"ij->{output[:1]}", a))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("output", ["", "i", "ikl", "iklm"])
def test_every_result_rank_is_differentiable(family, output):
    _, stored, x = operands(family)
    v = values_of(stored).detach().requires_grad_()
    x.requires_grad_()
    equation = f"ij,jklm->{output}"
    for out_format in (None, "dense"):
        assert torch.autograd.gradcheck(
            lambda v, x: dense(sparsenn.einsum(equation, with_values(stored, v), x, out_format=out_format)), (v, x))


@pytest.mark.parametrize("family", ["csr", "coo", "bsr(2,2)", "nm(2,4)"])
def test_scalar_results_of_sparse_operands(family):
    a, stored, _ = operands(family)
    torch.testing.assert_close(stored.sum(), a.sum())
    torch.testing.assert_close(sparsenn.einsum("ij,ij->", stored, stored), (a * a).sum())
    v = stored.values.detach().requires_grad_()
    sparsenn.einsum("ij->", stored.with_values(v)).backward()
    torch.testing.assert_close(v.grad, torch.ones_like(v))


def test_a_scalar_epilogue_over_a_sum_of_stored_entries():
    # the epilogue runs over the scalar sum alone: a nest with no loops
    s = sparsenn.from_dense(torch.zeros(1, 1, 1, dtype=torch.float64), format="coo")
    x = torch.randn(1, dtype=torch.float64, requires_grad=True)
    y = sparsenn.compile("Y[] = exp(sum[a,b,c](S[a,b,c] * tanh(X[b])))")(s, x)
    torch.testing.assert_close(y, torch.tensor(1.0, dtype=torch.float64))
    y.backward()
    torch.testing.assert_close(x.grad, torch.zeros(1, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x: sparsenn.compile("Y[] = exp(sum[i](X[i] * X[i]))")(x), (x,))
