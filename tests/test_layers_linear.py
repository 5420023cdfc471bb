"""SparseLinear: forward against masked dense references, gradients, patterns, state_dict."""

import io
import math

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import SparseLinear, SparseTensor


def masked_reference(layer: SparseLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense weight with zeros outside the pattern, and the bias (detached)."""
    dense = torch.zeros(layer.out_features, layer.in_features, dtype=layer.weight_values.dtype)
    rows, cols = layer.weight.coords()[0]
    dense[rows, cols] = layer.weight_values.detach()
    return dense, None if layer.bias is None else layer.bias.detach()


@pytest.mark.parametrize("format", ["csr", "csc", "coo", "dcsr", "dcsc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_matches_masked_dense(format, dtype):
    torch.manual_seed(0)
    layer = SparseLinear(23, 17, sparsity=0.7, format=format, dtype=dtype)
    weight, bias = masked_reference(layer)
    x = torch.randn(4, 5, 23, dtype=dtype)
    out = layer(x)
    assert out.shape == (4, 5, 17) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=tol, atol=tol)
    torch.testing.assert_close(layer(x[0, 0]), torch.nn.functional.linear(x[0, 0], weight, bias), rtol=tol, atol=tol)


def test_sparse_input_batch_gives_dense_output_and_gradients():
    torch.manual_seed(1)
    layer = SparseLinear(30, 12, sparsity=0.8, dtype=torch.float64)
    xd = torch.randn(9, 30, dtype=torch.float64) * (torch.rand(9, 30) < 0.2)
    x = sparsenn.from_dense(xd, "csr")
    x_values = x.values.clone().requires_grad_()
    out = layer(x.with_values(x_values))
    assert isinstance(out, torch.Tensor) and out.shape == (9, 12)
    weight, bias = masked_reference(layer)
    torch.testing.assert_close(out, xd @ weight.T + bias)
    grad = torch.randn(9, 12, dtype=torch.float64)
    out.backward(grad)
    rows, cols = layer.weight.coords()[0]
    torch.testing.assert_close(layer.weight_values.grad, (grad.T @ xd)[rows, cols])
    xr, xc = x.coords()[0]
    torch.testing.assert_close(x_values.grad, (grad @ weight)[xr, xc])
    torch.testing.assert_close(layer.bias.grad, grad.sum(0))


@pytest.mark.parametrize("format", ["csr", "csc", "coo"])
def test_gradcheck_dense_input_and_parameters(format):
    torch.manual_seed(2)
    layer = SparseLinear(7, 5, sparsity=0.6, format=format, dtype=torch.float64)
    x = torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True)
    values = layer.weight_values.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()

    def run(x, values, bias):
        return torch.func.functional_call(layer, {"weight_values": values, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(run, (x, values, bias))


def test_gradcheck_sparse_input():
    torch.manual_seed(4)
    layer = SparseLinear(6, 4, sparsity=0.5, dtype=torch.float64)
    x = sparsenn.from_dense(torch.randn(5, 6, dtype=torch.float64) * (torch.rand(5, 6) < 0.5), "csr")
    values = x.values.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: layer(x.with_values(v)), (values,))


def test_random_pattern_size_and_init_bound():
    torch.manual_seed(5)
    layer = SparseLinear(200, 50, sparsity=0.9)
    assert layer.nnz == round(0.1 * 200 * 50) == 1000
    assert layer.sparsity == pytest.approx(0.9)
    bound = 1 / math.sqrt(layer.nnz / 50)
    assert layer.weight_values.abs().max() <= bound
    assert layer.weight_values.abs().max() > 0.9 * bound  # uses the range, not a smaller one
    assert layer.bias.abs().max() <= bound
    assert SparseLinear(10, 10).nnz == 10  # default sparsity 0.9
    assert SparseLinear(10, 10, sparsity=0.0).nnz == 100


def test_given_mask_and_indices():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = mask[2, 0] = True
    layer = SparseLinear(4, 3, pattern=mask, bias=False)
    assert torch.equal(layer.mask(), mask) and layer.nnz == 3
    indices = torch.tensor([[2, 0, 2], [3, 1, 0]])
    other = SparseLinear(4, 3, pattern=indices, format="coo")
    assert torch.equal(other.mask(), mask)
    assert other.bias is not None and other.format == sparsenn.parse_format("coo", 2)


def test_layer_with_no_stored_weights_outputs_the_bias():
    layer = SparseLinear(5, 3, pattern=torch.zeros(3, 5, dtype=torch.bool))
    x = torch.randn(4, 5)
    torch.testing.assert_close(layer(x), layer.bias.detach().expand(4, 3))


def test_from_dense_keeps_largest_magnitudes_and_bias():
    torch.manual_seed(6)
    linear = nn.Linear(12, 8)
    layer = SparseLinear.from_dense(linear, sparsity=0.75)
    weight = linear.weight.detach()
    threshold = weight.abs().reshape(-1).topk(24).values.min()
    assert torch.equal(layer.mask(), weight.abs() >= threshold)
    dense, bias = masked_reference(layer)
    torch.testing.assert_close(dense, weight * layer.mask())
    torch.testing.assert_close(bias, linear.bias.detach())
    x = torch.randn(6, 12)
    torch.testing.assert_close(layer(x), layer.to_dense()(x))


def test_from_dense_random_and_formats():
    torch.manual_seed(7)
    linear = nn.Linear(10, 6, bias=False, dtype=torch.float64)
    layer = SparseLinear.from_dense(linear, sparsity=0.5, method="random", format="csc")
    assert layer.nnz == 30 and layer.bias is None and layer.weight_values.dtype == torch.float64
    torch.testing.assert_close(masked_reference(layer)[0], linear.weight.detach() * layer.mask())


def test_to_dense_and_repr():
    layer = SparseLinear(9, 4, sparsity=0.5, format="csc")
    dense = layer.to_dense()
    assert isinstance(dense, nn.Linear) and dense.weight.shape == (4, 9)
    x = torch.randn(3, 9)
    torch.testing.assert_close(dense(x), layer(x))
    text = repr(layer)
    for part in ("in_features=9", "out_features=4", "sparsity=0.5", "format=csc"):
        assert part in text


def test_state_dict_round_trip_adopts_pattern_and_format():
    torch.manual_seed(8)
    source = SparseLinear(15, 7, sparsity=0.6, format="csc")
    state = source.state_dict()
    assert "weight_values" in state and "weight_crd1" in state and "_extra_state" in state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    target = SparseLinear(15, 7, sparsity=0.9, format="coo")
    target.load_state_dict(torch.load(buffer))  # weights_only=True (the default) suffices
    assert target.format == source.format and target.nnz == source.nnz
    assert torch.equal(target.mask(), source.mask())
    x = torch.randn(4, 15)
    torch.testing.assert_close(target(x), source(x))
    assert {n for n, _ in target.named_buffers()} == {n for n, _ in source.named_buffers()}


def test_state_dict_inside_a_model_and_optimizer_still_tracks_values():
    torch.manual_seed(9)
    model = nn.Sequential(SparseLinear(8, 8, sparsity=0.5), nn.ReLU(), SparseLinear(8, 2, sparsity=0.5))
    clone = nn.Sequential(SparseLinear(8, 8, sparsity=0.8), nn.ReLU(), SparseLinear(8, 2, sparsity=0.8))
    values = clone[0].weight_values
    clone.load_state_dict(model.state_dict())
    assert clone[0].weight_values is values  # the Parameter object is kept (optimizers hold it)
    x = torch.randn(3, 8)
    torch.testing.assert_close(clone(x), model(x))


def test_load_state_dict_rejects_bad_patterns():
    layer = SparseLinear(6, 4, sparsity=0.5)
    state = layer.state_dict()
    bad = dict(state, weight_crd1=state["weight_crd1"].clone())
    bad["weight_crd1"][0] = 99
    fresh = SparseLinear(6, 4, sparsity=0.5)
    before = fresh.mask()
    with pytest.raises(RuntimeError, match="saved weight pattern is invalid"):
        fresh.load_state_dict(bad)
    assert torch.equal(fresh.mask(), before)
    with pytest.raises(RuntimeError, match="saved weight shape"):
        SparseLinear(7, 4).load_state_dict(state)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "weight_values"})


def test_dtype_conversion_and_training_keeps_pattern():
    torch.manual_seed(10)
    layer = SparseLinear(16, 4, sparsity=0.75).double()
    assert layer.weight_values.dtype == torch.float64 and layer.weight_crd1.dtype in (torch.int32, torch.int64)
    mask = layer.mask()
    x, y = torch.randn(64, 16, dtype=torch.float64), torch.randn(64, 4, dtype=torch.float64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = (layer(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert torch.equal(layer.mask(), mask)


def test_weight_is_a_sparse_tensor_sharing_the_parameter():
    layer = SparseLinear(5, 3, sparsity=0.4)
    weight = layer.weight
    assert isinstance(weight, SparseTensor) and weight.shape == (3, 5)
    assert weight.values is layer.weight_values


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(sparsity=-0.1), ValueError, r"sparsity must be in \[0, 1\)"),
        (dict(sparsity="0.5"), TypeError, "sparsity must be a number"),
        (dict(format="nope"), ValueError, "unknown weight format 'nope'"),
        (dict(format="bsr(3,2)"), ValueError, r"block \(3,2\) does not divide 4×6"),
        (dict(format="bsr(2,2)", pattern=torch.eye(4, 6, dtype=torch.bool)), ValueError, "not block-aligned"),
        (dict(format="dd(2,2)"), ValueError, "dense"),
        (dict(format="dense"), ValueError, "dense"),
        (dict(format="cd"), ValueError, "explicit zeros"),
        (dict(dtype=torch.int32), TypeError, "dtype must be"),
        (dict(pattern="banded"), ValueError, "pattern must be 'random'"),
        (dict(pattern=torch.ones(3, 3, dtype=torch.bool)), ValueError, "pattern mask has shape"),
        (dict(pattern=torch.tensor([[0, 0], [1, 1]])), ValueError, "duplicate"),
        (dict(pattern=torch.tensor([[0, 4], [1, 1]])), ValueError, r"indices\[0\].*out of range"),
        (dict(pattern=torch.tensor([[0.0], [1.0]])), TypeError, "integer"),
        (dict(pattern=torch.tensor([[0], [1]]), sparsity=0.5), ValueError, "sparsity must be None"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        SparseLinear(6, 4, **kwargs)


def test_bad_sizes_and_inputs():
    with pytest.raises(ValueError, match="in_features must be positive"):
        SparseLinear(0, 4)
    with pytest.raises(TypeError, match="out_features must be an int"):
        SparseLinear(4, 2.5)
    layer = SparseLinear(6, 4)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 6\)"):
        layer(torch.randn(3, 5))
    with pytest.raises(TypeError, match="dtype torch.float64 but the weight has torch.float32"):
        layer(torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sparse input must have shape \(batch, 6\)"):
        layer(sparsenn.from_dense(torch.eye(6)[:, :5].contiguous(), "csr"))
    with pytest.raises(TypeError, match="torch.Tensor or a SparseTensor"):
        layer([1.0] * 6)
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        SparseLinear.from_dense(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="method must be"):
        SparseLinear.from_dense(nn.Linear(3, 3), method="largest")


def test_a_new_pattern_of_the_same_size_is_picked_up_after_a_forward():
    # The wrapped pattern is reused between calls; loading another pattern with the
    # same format and nnz copies into the same buffers, and the next call must see it.
    torch.manual_seed(10)
    source, target = SparseLinear(12, 6, sparsity=0.5), SparseLinear(12, 6, sparsity=0.5)
    assert not torch.equal(source.mask(), target.mask())
    x = torch.randn(5, 12)
    target(x)
    target.load_state_dict(source.state_dict())  # new buffers
    torch.testing.assert_close(target(x), source(x))
    other = SparseLinear(12, 6, sparsity=0.5)
    with torch.no_grad():  # the same buffers, edited in place
        for name, buffer in target.named_buffers():
            buffer.copy_(other.get_buffer(name))
        target.weight_values.copy_(other.weight_values)
        target.bias.copy_(other.bias)
    torch.testing.assert_close(target(x), other(x))
    target.double()  # .to() replaces the buffers
    torch.testing.assert_close(target(x.double()), other.double()(x.double()))


# ---------------------------------------------------------------- blocked and nm weights
STRUCTURED = ["bsr(2,3)", "bsc(4,2)", "nm(2,4)", "nm(1,3)"]


def blocks_of(mask: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """Per block of ``mask``: 1 if fully set, 0 if empty, 0.5 if partly set."""
    view = mask.view(mask.shape[0] // bh, bh, mask.shape[1] // bw, bw)
    return (view.all(3).all(1).double() + view.any(3).any(1).double()) / 2


def test_blocked_random_pattern_keeps_whole_blocks():
    torch.manual_seed(11)
    layer = SparseLinear(12, 8, sparsity=0.5, format="bsr(2,3)")
    assert str(layer.format) == "bsr(2,3)" and layer.nnz == 8 * 6  # 8 of the 16 blocks of 2×3
    blocks = blocks_of(layer.mask(), 2, 3)
    assert set(blocks.unique().tolist()) == {0.0, 1.0} and int(blocks.sum()) == 8
    bound = 1 / math.sqrt(layer.nnz / 8)
    assert 0.9 * bound < layer.weight_values.abs().max() <= bound
    column = SparseLinear(12, 8, sparsity=0.75, format="bsc(4,2)")
    assert str(column.format) == "bsc(4,2)" and column.nnz == 3 * 8  # round(0.25 * 12) blocks of 4×2
    assert set(blocks_of(column.mask(), 4, 2).unique().tolist()) == {0.0, 1.0}
    assert SparseLinear(4, 4, sparsity=0.99, format="bsr(2,2)").nnz == 4  # at least one block
    assert SparseLinear(4, 4, sparsity=0.0, format="bsr(2,2)").nnz == 16


def test_blocked_given_pattern_must_be_block_aligned():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[2:4, 0:2] = mask[0:2, 4:6] = True
    layer = SparseLinear(6, 4, format="bsr(2,2)", pattern=mask)
    assert torch.equal(layer.mask(), mask) and layer.nnz == 8
    other = SparseLinear(6, 4, format="bsc(2,2)", pattern=torch.nonzero(mask).T)
    assert torch.equal(other.mask(), mask)
    mask[3, 1] = False
    with pytest.raises(ValueError, match="not block-aligned.*outputs 2..3 and inputs 0..1 is partly set"):
        SparseLinear(6, 4, format="bsr(2,2)", pattern=mask)


def test_block_not_dividing_the_weight_names_shape_and_block():
    with pytest.raises(ValueError, match=r"\(out_features, in_features\) = \(100, 50\).*block \(32,32\) does not "
                                         r"divide 100×50"):
        SparseLinear(50, 100, format="bsr(32,32)")
    with pytest.raises(ValueError, match=r"block \(32,32\) does not divide 100×50"):
        SparseLinear.from_dense(nn.Linear(50, 100), format="bsr(32,32)")


def test_nm_random_pattern_keeps_n_of_every_m():
    torch.manual_seed(12)
    layer = SparseLinear(12, 5, format="nm(2,4)")
    assert str(layer.format) == "nm(2,4)" and layer.nnz == 5 * 3 * 2
    assert layer.sparsity == pytest.approx(0.5)
    assert torch.equal(layer.mask().view(5, 3, 4).sum(-1), torch.full((5, 3), 2))
    bound = 1 / math.sqrt(6)  # kept fan-in: 2 of every 4 of the 12 inputs
    assert 0.9 * bound < layer.weight_values.abs().max() <= bound
    assert SparseLinear(12, 5, format="nm(2,4)", sparsity=0.5).nnz == 30
    assert SparseLinear(9, 2, format="nm(1,3)", sparsity=2 / 3).nnz == 6
    patterns = {tuple(SparseLinear(12, 5, format="nm(2,4)").mask().reshape(-1).tolist()) for _ in range(3)}
    assert len(patterns) == 3  # random offsets, not a fixed choice


def test_nm_sparsity_is_fixed_by_n_and_m():
    with pytest.raises(ValueError, match=r"nm\(2,4\) fixes the sparsity at 1 - n/m = 1 - 2/4 = 0.5.*sparsity=0.9"):
        SparseLinear(8, 4, format="nm(2,4)", sparsity=0.9)
    with pytest.raises(ValueError, match="fixes the sparsity"):
        SparseLinear.from_dense(nn.Linear(8, 4), sparsity=0.75, format="nm(2,4)")
    with pytest.raises(ValueError, match=r"groups of 4 inputs \(nm\(2,4\)\) do not divide in_features = 6"):
        SparseLinear(6, 4, format="nm(2,4)")


def test_nm_given_pattern_keeps_exactly_n_per_group():
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, [0, 3, 5, 6]] = True
    layer = SparseLinear(8, 3, format="nm(2,4)", pattern=mask)
    assert torch.equal(layer.mask(), mask) and layer.nnz == 12
    assert torch.equal(SparseLinear(8, 3, format="nm(2,4)", pattern=torch.nonzero(mask).T).mask(), mask)
    mask[1, 4] = True
    with pytest.raises(ValueError, match=r"pattern keeps 3 of the 4 inputs 4..7 of output 1; format nm\(2,4\) "
                                         "stores exactly 2 of every 4"):
        SparseLinear(8, 3, format="nm(2,4)", pattern=mask)
    mask[1, 4:] = False
    with pytest.raises(ValueError, match="pattern keeps 0 of the 4 inputs 4..7 of output 1"):
        SparseLinear(8, 3, format="nm(2,4)", pattern=mask)


@pytest.mark.parametrize("format", STRUCTURED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_structured_forward_matches_masked_dense(format, dtype):
    torch.manual_seed(13)
    layer = SparseLinear(24, 8, sparsity=None if format.startswith("nm") else 0.5, format=format, dtype=dtype)
    weight, bias = masked_reference(layer)
    x = torch.randn(3, 5, 24, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    with torch.no_grad():  # inference only: the gradient test below covers training
        out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=tol, atol=tol)


@pytest.mark.parametrize("format", STRUCTURED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_structured_gradients_match_dense_linear(format, dtype):
    torch.manual_seed(14)
    layer = SparseLinear(24, 8, sparsity=None if format.startswith("nm") else 0.5, format=format, dtype=dtype)
    dense = layer.to_dense()
    x = torch.randn(6, 24, dtype=dtype)
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(6, 8, dtype=dtype)
    out = layer(xs)
    expected = dense(xd)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    out.backward(grad)
    expected.backward(grad)
    rows, cols = layer.weight.coords()[0]
    torch.testing.assert_close(layer.weight_values.grad, dense.weight.grad[rows, cols], rtol=tol, atol=tol)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(xs.grad, xd.grad, rtol=tol, atol=tol)


def test_from_dense_blocked_keeps_the_blocks_of_largest_norm():
    torch.manual_seed(15)
    linear = nn.Linear(12, 8, dtype=torch.float64)
    layer = SparseLinear.from_dense(linear, sparsity=0.75, format="bsr(2,3)")
    weight = linear.weight.detach()
    norms = weight.view(4, 2, 4, 3).square().sum((1, 3))
    kept = blocks_of(layer.mask(), 2, 3).bool()
    assert int(kept.sum()) == 4 and norms[kept].min() > norms[~kept].max()
    torch.testing.assert_close(masked_reference(layer)[0], weight * layer.mask(), rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.detach(), linear.bias.detach(), rtol=0, atol=0)
    random = SparseLinear.from_dense(linear, sparsity=0.5, method="random", format="bsc(4,4)")
    assert random.nnz == 3 * 16 and set(blocks_of(random.mask(), 4, 4).unique().tolist()) == {0.0, 1.0}


def test_from_dense_nm_keeps_the_largest_of_each_group():
    torch.manual_seed(16)
    linear = nn.Linear(12, 5, bias=False)
    layer = SparseLinear.from_dense(linear, format="nm(2,4)")
    groups = linear.weight.detach().abs().view(5, 3, 4)
    kept = layer.mask().view(5, 3, 4)
    assert torch.equal(kept.sum(-1), torch.full((5, 3), 2))
    assert bool((groups.masked_fill(~kept, math.inf).amin(-1) > groups.masked_fill(kept, -math.inf).amax(-1)).all())
    torch.testing.assert_close(masked_reference(layer)[0], linear.weight.detach() * layer.mask(), rtol=0, atol=0)
    random = SparseLinear.from_dense(linear, sparsity=0.5, method="random", format="nm(2,4)")
    assert torch.equal(random.mask().view(5, 3, 4).sum(-1), torch.full((5, 3), 2))


@pytest.mark.parametrize("format", STRUCTURED)
def test_structured_state_dict_round_trip_repr_and_to_dense(format):
    torch.manual_seed(17)
    source = SparseLinear(24, 8, sparsity=None if format.startswith("nm") else 0.5, format=format)
    assert f"format={format}" in repr(source)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target = SparseLinear(24, 8, sparsity=0.9, format="csr")
    target.load_state_dict(torch.load(buffer))
    assert target.format == source.format and str(target.format) == format
    assert torch.equal(target.mask(), source.mask())
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert torch.equal(target(x), source(x))
        torch.testing.assert_close(source.to_dense()(x), source(x))
    assert torch.equal(source.to_dense().weight != 0, source.mask())
