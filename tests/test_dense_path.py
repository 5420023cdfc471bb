"""The planner's dense path: BLAS on a dense copy of the sparse operand where the cost
model says it beats the sparse kernel; the copy is kept while the operand is unchanged."""

import dataclasses

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512, relaying
from sparsenn.compiler import cache_stats, clear_caches
from sparsenn.compiler.runtime.densified import DenseCopies
from sparsenn.compiler.runtime.evaluate import DensifiedCall, SplitCall, resolve, route, weighed_dense_path
from sparsenn.compiler.runtime.validate import check_call
from sparsenn.compiler.api import parse


TOL = {"rtol": 1e-4, "atol": 1e-4}


def weight(rows, cols, density, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g, dtype=dtype) * (torch.rand(rows, cols, generator=g) < density)
    return sparsenn.from_dense(dense, format="csr")


def as_dense(result):
    return result if isinstance(result, torch.Tensor) else result.to_dense()


def routed(equation, *operands):
    assignment = parse(equation, len(operands))
    return resolve(assignment, check_call(assignment, operands, "dense"))


@pytest.fixture
def avx512_host(host_target):
    """Plans made while this is active are for :data:`_machines.AVX512`, on which BLAS
    runs 64-byte vectors where a kernel without a register tile runs 32-byte ones."""
    host_target(AVX512)


def test_moderate_sparsity_at_a_large_batch_runs_densely_and_high_sparsity_does_not(avx512_host):
    moderate = weight(1024, 1024, 0.9)
    tenth = weight(1024, 1024, 0.1)
    assert isinstance(routed("bi,oi->bo", torch.randn(64, 1024), moderate), DensifiedCall)
    assert not isinstance(routed("bi,oi->bo", torch.randn(64, 1024), tenth), DensifiedCall)
    text = sparsenn.explain("bi,oi->bo", torch.randn(64, 1024), moderate, out_format="dense")
    assert "dense path" in text and "against the sparse kernel" in text
    with pytest.raises(ValueError, match="runs densely"):
        sparsenn.compiler.api.plan("bi,oi->bo", torch.randn(64, 1024), moderate, out_format="dense")


@pytest.mark.parametrize("target, dense", [(AVX2, False), (AVX512, True)], ids=["avx2", "avx512"])
def test_the_dense_path_pays_where_blas_runs_wider_vectors_than_the_kernel(target, dense):
    # half of a 1024 x 1024 weight stored, batch 64: the kernel's register block of 64
    # runs 32-byte vectors; BLAS runs 64-byte ones on AVX-512 (the copy and its check
    # are then paid for), the same width on AVX2 (they are not).
    with sparsenn.compiler.use_target(target):
        assert isinstance(routed("bi,oi->bo", torch.randn(64, 1024), weight(1024, 1024, 0.5)), DensifiedCall) == dense


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_half_sparse_layer_at_batch_one_runs_its_gathered_kernel(target):
    # SparseLinear(784 -> 256, sparsity 0.5) at batch 1: the kernel (a dot product per
    # output in registers, x gathered a vector of stored entries at a time) reads half
    # the bytes BLAS would, and the dense path adds checking the copy's 100k values.
    w = weight(256, 784, 0.5)
    bias, x = torch.randn(256), torch.randn(1, 784)
    with sparsenn.compiler.use_target(target):
        affine = sparsenn.compile("Y[b,o] = X[b,i] * W[o,i] + bias[o]", out_format="dense")
        assert "dense path" not in affine.explain(x, w, bias)
        assert not isinstance(routed("bi,oi->bo", x, w), DensifiedCall)
        (nest,) = sparsenn.compiler.api.plan("bi,oi->bo", x, w, out_format="dense").schedule.nests
        assert nest.order[-1] == "i" and nest.sparse_reduction is not None and nest.sparse_reduction.gathered


def test_the_copy_is_kept_while_the_values_stay_and_made_again_when_they_change(avx512_host):
    w = weight(1024, 1024, 0.9)
    values = torch.nn.Parameter(w.values.clone())
    layer_weight = w.with_values(values)
    x = torch.randn(64, 1024)
    clear_caches()
    expected = x @ layer_weight.to_dense().detach().T
    for n in range(3):
        with torch.no_grad():
            torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, layer_weight, out_format="dense"), expected,
                                       **TOL)
        assert (cache_stats()["dense copies"].hits, cache_stats()["dense copies"].misses) == (n, 1)
    with torch.no_grad():
        values.mul_(2)  # an optimizer step: same tensor, new version
        torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, layer_weight, out_format="dense"), 2 * expected,
                                   **TOL)
        other = layer_weight.with_values(values.detach().clone().neg())
        torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, other, out_format="dense"), -2 * expected, **TOL)
    assert cache_stats()["dense copies"].misses == 3


def test_a_call_gives_the_same_bits_with_and_without_its_copy(avx512_host):
    w = weight(1024, 1024, 0.9)
    x = torch.randn(64, 1024)
    assert isinstance(routed("bi,oi->bo", x, w), DensifiedCall)
    first = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")  # makes the copy
    assert torch.equal(sparsenn.einsum("bi,oi->bo", x, w, out_format="dense"), first)  # reads it


def test_a_result_never_aliases_the_kept_copy(avx512_host):
    w = weight(1024, 1024, 0.9)
    x = torch.randn(64, 1024)
    for _ in range(4):
        first = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    first.zero_()  # a user writing into a result must not change the next one
    torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, w, out_format="dense"), x @ w.to_dense().T, **TOL)


def test_gradients_through_the_dense_path(avx512_host):
    w = weight(1024, 1024, 0.9)
    values = w.values.detach().clone().requires_grad_()
    x = torch.randn(64, 1024, requires_grad=True)
    assert isinstance(routed("bi,oi->bo", x.detach(), w), DensifiedCall)
    for _ in range(3):
        out = sparsenn.einsum("bi,oi->bo", x, w.with_values(values), out_format="dense")
    grad = torch.randn_like(out)
    out.backward(grad)
    dense = w.to_dense()
    torch.testing.assert_close(x.grad, grad @ dense, **TOL)
    torch.testing.assert_close(values.grad, (grad.T @ x.detach())[dense != 0], **TOL)  # stored in row-major order


def test_a_transposed_view_gets_its_own_copy(avx512_host):
    w = weight(64, 48, 0.5, dtype=torch.float64)
    x, y = torch.randn(48, 3, dtype=torch.float64), torch.randn(3, 64, dtype=torch.float64)
    for _ in range(3):  # views of the same arrays, alternately
        torch.testing.assert_close(as_dense(w @ x), w.to_dense() @ x)
        torch.testing.assert_close(as_dense(y @ w), y @ w.to_dense())
        torch.testing.assert_close(as_dense(x.T @ w.T), x.T @ w.to_dense().T)


def test_values_edited_without_a_version_change_are_seen(avx512_host):
    # gradcheck and pruning code write through ``.data``, which bumps no version counter
    w = weight(1024, 1024, 0.9)
    x = torch.randn(64, 1024)
    for _ in range(6):
        sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    w.values.data.mul_(-1)
    torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, w, out_format="dense"), x @ w.to_dense().T, **TOL)
    with torch.inference_mode():
        frozen = weight(1024, 1024, 0.5, seed=1)
        for _ in range(6):
            sparsenn.einsum("bi,oi->bo", x, frozen, out_format="dense")
        frozen.values.mul_(3)  # an inference tensor has no version counter at all
        torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, frozen, out_format="dense"),
                                   x @ frozen.to_dense().T, **TOL)


def test_infinities_in_a_dense_operand_meet_no_unstored_zero(avx512_host):
    # an entry that is not stored forms no product: inf in x where W stores nothing stays out
    w = weight(1024, 1024, 0.9)
    x = torch.randn(64, 1024)
    assert isinstance(routed("bi,oi->bo", x, w), DensifiedCall)
    x[0, 0] = torch.inf
    out = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    stores = w.to_dense()[:, 0] != 0
    assert torch.isinf(out[0, stores]).all() and torch.isfinite(out[0, ~stores]).all()
    torch.testing.assert_close(out[1:], x[1:] @ w.to_dense().T, **TOL)


def test_the_kernel_a_dense_call_was_weighed_against_is_built_only_when_it_runs(avx512_host):
    w = weight(1024, 1024, 0.9)
    x = torch.randn(64, 1024)
    clear_caches()
    sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    assert cache_stats()["plans"].size == 1  # the kernel making the copy, not the product's
    x[0, 0] = torch.nan  # the kernel runs: now it is built
    assert sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")[0].isnan().any()
    assert cache_stats()["plans"].size == 2


@pytest.mark.parametrize("equation, shapes", [
    ("Y[b,o] = X[b,i] * W[o,i] + bias[o]", [(5, 40), (30, 40), (30,)]),
    ("Y[o,b] = 2 * W[o,i] * X[b,i] + bias[o] - 0.5 * C[o,b]", [(30, 40), (5, 40), (30,), (30, 5)]),
    ("Y[b,o] = W[o,i] * X[i,b] + bias[b]", [(30, 40), (40, 5), (5,)]),
])
def test_the_dense_path_is_one_blas_call_with_its_biases(host_target, equation, shapes):
    # a Target whose kernels cost far more than BLAS: every call here runs densely
    host_target(dataclasses.replace(AVX512, cycles_per_cost_unit=1000.0))
    g = torch.Generator().manual_seed(3)
    w = weight(30, 40, 0.5, dtype=torch.float64)
    operands = [w if shape == (30, 40) else torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]
    compiled = sparsenn.compile(equation, out_format="dense")
    assert "dense path" in compiled.explain(*operands)
    dense = [w.to_dense() if op is w else op for op in operands]
    reference = sparsenn.compile(equation, out_format="dense")(*dense)  # all dense: torch
    for _ in range(2):  # the copy made, then kept
        torch.testing.assert_close(compiled(*operands), reference)


def innermost_route(equation, *operands):
    """What a call runs, followed through the split of blocked (n:m) operands."""
    assignment = parse(equation, len(operands))
    checked = check_call(assignment, operands, "dense")
    routed = route(assignment, checked)
    while isinstance(routed, SplitCall):
        split = routed.split
        assignment = split.assignment
        checked = check_call(assignment, split.operands(checked.operands), split.request)
        routed = route(assignment, checked)
    return routed


@pytest.mark.parametrize("target, size, batch, dense", [
    (AVX2, 1024, 64, True), (AVX2, 4096, 256, True), (AVX512, 1024, 64, True), (AVX512, 4096, 256, True),
], ids=["avx2-1024-64", "avx2-4096-256", "avx512-1024-64", "avx512-4096-256"])
def test_an_nm_input_gradient_weighs_re_storing_the_weight(target, size, batch, dense):
    # dX = dY · W reads the n:m weight across its rows: the kernel gathers W's values
    # into the transposed order at every call, a cache line per value, and gathers the
    # rows of dY at the L2's gather rate at best. With those costs BLAS beats the kernel
    # on 64-byte vectors and on 32-byte ones (1024², batch 64, on a Zen 3: the kernel
    # 4.3 ms, the dense path 2.1-2.4 ms).
    g = torch.Generator().manual_seed(0)
    w = sparsenn.from_dense(torch.randn(size, size, generator=g), format="nm(2,4)")
    dy = torch.randn(batch, size, generator=g)
    with sparsenn.compiler.use_target(target):
        routed = innermost_route("bo,oi->bi", dy, w)
        assert isinstance(routed, DensifiedCall) == dense
        kernel = routed.shaped if dense else routed
        assert 1 in [k for (_, k), _ in kernel.schedule.transposes]  # the weight, re-stored
        if dense:
            assert routed.dense.restore_cycles > 0 and "re-storing operands" in routed.dense.describe()
            assert routed.dense.dense_cycles < routed.dense.sparse_cycles
        assert not isinstance(innermost_route("bi,oi->bo", dy, w), DensifiedCall)  # read in its own order


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_an_nm_layer_backward_matches_torch(target):
    # at this size the input gradient runs densely on AVX512, as a kernel on AVX2
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(1024, 1024, format="nm(2,4)").double()
    x = torch.randn(64, 1024, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(64, 1024, dtype=torch.float64)
    with sparsenn.compiler.use_target(target):
        layer(x).backward(grad)
    weight = layer.weight.to_dense().detach()
    torch.testing.assert_close(x.grad, grad @ weight)
    torch.testing.assert_close(layer.weight_values.grad, (grad.T @ x.detach())[weight != 0])  # row-major order
    torch.testing.assert_close(layer.bias.grad, grad.sum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_trained_operand_gets_a_new_copy_at_every_step_and_is_kept_once_its_values_rest(dtype):
    copies = DenseCopies("test copies", 1 << 30, 8)
    w = weight(33, 17, 0.5, dtype=dtype)
    made = []

    def make(operand):
        made.append(operand)
        return operand.to_dense()

    def check(expected_made):
        torch.testing.assert_close(copies.copy_for(w, make), w.to_dense(), rtol=0, atol=0)
        assert len(made) == expected_made

    check(1)
    check(1)  # unchanged: the kept copy
    for step in range(3):  # an optimizer step between calls: a copy made at each
        with torch.no_grad():
            w.values.add_(0.5)
        check(2 + step)
    check(5)  # the first call finding the values as the last left them: made, then kept
    check(5)
    w.values.data.mul_(-1)  # an edit no version counter sees: the snapshot tells
    check(6)
    with torch.no_grad():
        w.values.copy_(torch.randn_like(w.values))  # as load_state_dict writes
    check(7)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_dense_operand_already_in_the_kernels_order_costs_no_copy(target):
    """``X Wᵀ`` over sparse ``X`` reads ``W`` input-major: a weight stored so is read in
    place (no copy costed), one stored output-major is copied into that order (on a
    machine whose copies cost less than the kernel packing the weight itself)."""
    x = weight(300, 500, 0.02)
    w = torch.randn(64, 500)
    with sparsenn.compiler.use_target(relaying(target)):
        assignment = parse("si,oi->so", 2)
        costs = {}
        for name, operand in (("output-major", w), ("input-major", w.t().contiguous().t())):
            checked = check_call(assignment, [x, operand], "dense")
            shaped = route(assignment, checked)
            shaped = shaped.shaped if isinstance(shaped, DensifiedCall) else shaped
            costs[name] = weighed_dense_path(assignment, checked, shaped)
        assert costs["output-major"].relayout_cycles > 0 and "copying dense operands" in costs["output-major"].describe()
        assert costs["input-major"].relayout_cycles == 0
        assert costs["input-major"].sparse_cycles < costs["output-major"].sparse_cycles
