"""The dense path of a sampled product (``plan/sampled_path.py``): the whole product by
BLAS, sampled at the result's pattern, where the cost model says that beats the sampled
kernel (a weight gradient at moderate sparsity), the kernel elsewhere."""

import dataclasses

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512
from sparsenn.compiler.frontend.program import stage_inputs
from sparsenn.compiler.runtime.evaluate import SampledDenseCall, SplitCall, route
from sparsenn.compiler.runtime.validate import check_call

GRADIENT = "G<W>[o,i] = dY[b,o] * X[b,i]"
TARGETS = pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
# A machine on which BLAS runs at its peak, a torch call costs nothing and a kernel's
# steps are slow: the dense path wins on every shape, so the tests below run it at
# extents where it would not pay.
BLAS_FRIENDLY = dataclasses.replace(AVX2, gemm_efficiency=1.0, python_call_cycles=1.0, cycles_per_cost_unit=10.0)


def sampled_route(text, operands):
    """What the one statement of ``text`` runs over ``operands`` (over split indices for a blocked operand)."""
    [step] = sparsenn.compile(text).program(operands).stages
    assignment = step.assignment
    checked = check_call(assignment, stage_inputs(step, operands, []), step.out_format)
    routed = route(assignment, checked)
    while isinstance(routed, SplitCall):
        split = routed.split
        checked = check_call(split.assignment, split.operands(checked.operands), split.request)
        routed = route(split.assignment, checked)
    return routed


def pattern(rows, cols, density, dtype=torch.float32, seed=0, fmt="csr"):
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(rows, cols, generator=g, dtype=dtype) + 3) * (torch.rand(rows, cols, generator=g) < density)
    return sparsenn.from_dense(dense, format=fmt)


def at_stored(w, full):
    """``full`` at ``w``'s stored positions, in its storage order."""
    rows, cols = w.coords()[0]
    return full[rows, cols]


@TARGETS
def test_a_half_full_pattern_samples_blas_and_a_sparse_one_runs_its_kernel(target):
    # X read across for every row of the gradient: 2 MiB, past the L2 of either machine
    x, dy = torch.randn(256, 2048), torch.randn(256, 2048)
    half = sparsenn.SparseLinear(2048, 2048, format="nm(2,4)").weight.detach()
    sparse = pattern(2048, 2048, 0.01)
    with sparsenn.compiler.use_target(target):
        assert isinstance(sampled_route(GRADIENT, [half, dy, x]), SampledDenseCall)
        assert not isinstance(sampled_route(GRADIENT, [sparse, dy, x]), SampledDenseCall)
        text = sparsenn.compile(GRADIENT).explain(half, dy, x)
        assert "dense path: the whole product by BLAS" in text and "against the sampled kernel" in text
        assert "sampled kernel kept" in sparsenn.compile(GRADIENT).explain(sparse, dy, x)


@TARGETS
def test_a_small_batch_keeps_the_kernel(target):
    # four rows of dY and X: the whole product costs as many passes over the output as
    # the kernel does over the stored entries, and the sampling pass comes on top.
    w = pattern(256, 784, 0.5)
    with sparsenn.compiler.use_target(target):
        assert not isinstance(sampled_route(GRADIENT, [w, torch.randn(4, 256), torch.randn(4, 784)]), SampledDenseCall)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, cols, batch", [(7, 9, 5), (1, 1, 1), (6, 5, 0), (0, 4, 3), (33, 17, 2)])
def test_the_sampled_dense_path_matches_torch(dtype, rows, cols, batch):
    w = pattern(rows, cols, 0.5, dtype)
    dy, x = torch.randn(batch, rows, dtype=dtype), torch.randn(batch, cols, dtype=dtype)
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        if w.nnz:
            assert isinstance(sampled_route(GRADIENT, [w, dy, x]), SampledDenseCall)
        out = sparsenn.compile(GRADIENT)(w, dy, x)
    assert out.format == w.format and out.nnz == w.nnz
    torch.testing.assert_close(out.values, at_stored(w, dy.T @ x))


def test_every_term_and_coefficient_is_summed_before_sampling():
    w = pattern(9, 11, 0.4, torch.float64)
    a, b = torch.randn(3, 9, dtype=torch.float64), torch.randn(3, 11, dtype=torch.float64)
    c, d = torch.randn(9, 5, dtype=torch.float64), torch.randn(5, 11, dtype=torch.float64)
    text = "G<W>[o,i] = 2 * A[b,o] * B[b,i] - C[o,k] * D[k,i]"
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        assert isinstance(sampled_route(text, [w, a, b, c, d]), SampledDenseCall)
        out = sparsenn.compile(text)(w, a, b, c, d)
    torch.testing.assert_close(out.values, at_stored(w, 2 * a.T @ b - c @ d))


def test_stored_zeros_and_infinities_come_out_as_the_kernel_computes_them():
    w = sparsenn.SparseTensor.from_coo(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([0.0, 2.0, 3.0]),
                                        (2, 2), format="csr")  # a stored zero at (0, 0)
    dy = torch.tensor([[1.0, float("inf")]])
    x = torch.tensor([[2.0, 0.0]])
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        assert isinstance(sampled_route(GRADIENT, [w, dy, x]), SampledDenseCall)
        dense_path = sparsenn.compile(GRADIENT)(w, dy, x).values
    with sparsenn.compiler.use_target(AVX2):  # at this size, the sampled kernel
        assert not isinstance(sampled_route(GRADIENT, [w, dy, x]), SampledDenseCall)
        kernel = sparsenn.compile(GRADIENT)(w, dy, x).values
    torch.testing.assert_close(dense_path, kernel, equal_nan=True)


def test_bfloat16_keeps_the_kernel():
    w = pattern(64, 64, 0.5)
    dy, x = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        assert not isinstance(sampled_route(GRADIENT, [w.with_values(w.values.bfloat16()), dy, x]), SampledDenseCall)


@pytest.mark.parametrize("fmt", ["nm(2,4)", "csr"])
def test_a_weight_gradient_through_the_sampled_dense_path_matches_dense_autograd(fmt):
    # einsum's gradient calls (a layer's call site may run its whole step densely instead)
    torch.manual_seed(0)
    w = (sparsenn.SparseLinear(16, 12, format=fmt).weight.detach() if fmt != "csr" else pattern(12, 16, 0.5))
    w = w.with_values(w.values.double().requires_grad_(True))
    x = torch.randn(10, 16, dtype=torch.float64)
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        sparsenn.einsum("bi,oi->bo", x, w).square().sum().backward()
    dense = w.detach().to_dense().requires_grad_(True)
    torch.nn.functional.linear(x, dense).square().sum().backward()
    torch.testing.assert_close(w.values.grad, at_stored(w, dense.grad))


def test_a_gradient_broadcast_over_an_index_of_the_pattern_keeps_its_kernel():
    # d(Σ_j W[i,j]) / dW = dY[i] at every stored (i, j): no product reads j, so no BLAS form
    w = pattern(6, 5, 0.5, torch.float64)
    w = w.with_values(w.values.clone().requires_grad_(True))
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        assert not isinstance(sampled_route("G<W>[i,j] = dY[i]", [w, torch.randn(6, dtype=torch.float64)]),
                              SampledDenseCall)
        grad = torch.randn(6, dtype=torch.float64)
        sparsenn.einsum("ij->i", w).backward(grad)
    torch.testing.assert_close(w.values.grad, grad[w.coords()[0][0]])


def test_sampling_a_dense_tensor_keeps_its_kernel():
    # nothing to multiply: the dense path's own sampling pass is this call
    w, d = pattern(9, 7, 0.5), torch.randn(9, 7)
    with sparsenn.compiler.use_target(BLAS_FRIENDLY):
        assert not isinstance(sampled_route("G<W>[o,i] = D[o,i]", [w, d]), SampledDenseCall)
        torch.testing.assert_close(sparsenn.compile("G<W>[o,i] = D[o,i]")(w, d).values, at_stored(w, d))
