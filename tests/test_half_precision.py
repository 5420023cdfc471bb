"""bfloat16 and float16 values: 16-bit storage, float32 arithmetic (compiler/backend/precision.py),
autograd in 16 bits and autocast at the compiler's entry (compiler/runtime/autocast.py).

Every kernel kind is compared with torch computing in float32 on the same (already
rounded) 16-bit inputs. The bound: a kernel sums the ``n`` products of an output
element in float32 (error at most ``(n + 2) 2^-24 * sum |products|``, the ``+ 2`` for
the roundings inside a product of three factors) and rounds the sum once to the storage
type (relative error at most ``u``: 2^-8 for bfloat16, 2^-11 for float16, plus 2^-25
absolute below float16's normal range). torch's float32 result ``r`` has the same
summation error, so ``|got - r| <= u |r| + 3 (n + 2) 2^-24 sum |products|``. Summing
in 16 bits would break it (see :func:`test_long_sums_accumulate_in_float32`), and so
would a second rounding.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.backend.precision import output_dtype
from sparsenn.compiler import api
from sparsenn.compiler.runtime.evaluate import PathCall, resolve, split_of
from sparsenn.compiler.runtime.validate import check_call

HALF = [torch.bfloat16, torch.float16]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FLOOR = {torch.bfloat16: 0.0, torch.float16: 2.0**-25}  # float16's subnormal spacing / 2
F32_UNIT = 2.0**-24


def rounded(*shape, dtype, density=None, seed=0):
    """Random values rounded to ``dtype`` (a tensor; zeros outside ``density``)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g)
    if density is not None:
        values = values * (torch.rand(shape, generator=g) < density)
    return values.to(dtype)


def sparse(shape, fmt, dtype, density=0.3, seed=0):
    return sparsenn.from_dense(rounded(*shape, dtype=dtype, density=density, seed=seed), format=fmt)


def dense_of(x) -> torch.Tensor:
    return x.to_dense() if isinstance(x, SparseTensor) else x


def assert_within_bound(got, reference, magnitude, terms, dtype, roundings=1):
    """``got`` (16-bit) against ``reference`` (float32 from the same inputs), with the
    module doc's bound; ``magnitude``: the sums of |products|, ``terms``: how many;
    ``roundings``: to the storage type, on the way."""
    got = dense_of(got)
    assert got.dtype == dtype and got.shape == reference.shape
    error = (got.float() - reference).abs()
    bound = (roundings * UNIT[dtype] * reference.abs() + 3 * (terms + 2) * F32_UNIT * magnitude
             + roundings * FLOOR[dtype])
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (f"error {error.flatten()[worst]} above bound {bound.flatten()[worst]} "
                                          f"at {worst} (got {got.flatten()[worst]}, expected "
                                          f"{reference.flatten()[worst]})")


def check_einsum(equation, operands, dtype, out_format=None, roundings=1):
    """``sparsenn.einsum`` over 16-bit operands against torch.einsum in float32."""
    dense = [dense_of(op).float() for op in operands]
    reference = torch.einsum(equation, *dense)
    magnitude = torch.einsum(equation, *[d.abs() for d in dense])
    inputs, output = equation.split("->")
    sizes = {i: n for spec, d in zip(inputs.split(","), dense) for i, n in zip(spec, d.shape)}
    terms = math.prod(n for i, n in sizes.items() if i not in output)  # products summed per element
    got = sparsenn.einsum(equation, *operands, out_format=out_format)
    assert_within_bound(got, reference, magnitude, terms, dtype, roundings)
    return got


def nest(equation, *operands, out_format=None):
    (first, *_) = api.plan(equation, *operands, out_format=out_format).schedule.nests
    return first


# ----------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", HALF)
def test_each_written_value_is_rounded_once_as_torch_rounds(dtype, avx2_host):
    # A product of two 16-bit values is exact in float32: one rounding gives torch's bits,
    # through a scalar store (sampled output), a vector store (register block of a dense
    # output) and an assembled sparse output. Ties, subnormals, overflow to inf, NaN.
    a = torch.randn(64, 64).to(dtype)
    b = torch.randn(64, 64).to(dtype)
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 300.0, 1e-4, 2**-20, -(1 + 2**-8),
                            float("inf"), float("nan")]).to(dtype)
    a[0, :10], b[0, :10] = special, special.flip(0)
    exact = a.float() * b.float()  # float32 products of 16-bit values are exact
    identity = sparsenn.from_dense(torch.eye(64).to(dtype), format="csr")
    sampled = sparsenn.einsum("ij,ij->ij", sparsenn.from_dense(a, format="csr"), b)
    blocked = sparsenn.einsum("ij,jk->ik", identity, a) * 1  # one product per element: a copy
    assert nest("ij,jk->ik", identity, a).register_block is not None
    assembled = sparsenn.einsum("ij,jk->ik", identity, sparsenn.from_dense(a, format="csr"))
    for got, want in [(sampled.to_dense(), exact.to(dtype) * (a != 0)), (blocked, a), (assembled.to_dense(), a)]:
        assert got.dtype == dtype
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("equation", ["ij,j->i", "ij,i->j", "ij,jk->ik"])
def test_long_sums_accumulate_in_float32(dtype, equation, avx2_host):
    # Sums of up to 3000 ones: 16-bit partial sums would stall at 256 (bfloat16) or 2048
    # (float16); float32 sums them exactly, then one rounding gives torch's rounding of
    # the exact sum (3008 for 3000 in bfloat16).
    # (ones in every 8th column: sparse enough for a kernel rather than the dense path)
    lengths = 24000 - 320 * torch.arange(64)
    columns = torch.arange(24000)[None, :]
    rows = ((columns < lengths[:, None]) & (columns % 8 == 0)).to(dtype)
    matrix = sparsenn.from_dense(rows.T if equation == "ij,i->j" else rows, format="csr")
    operand = torch.ones(24000, 40, dtype=dtype) if equation == "ij,jk->ik" else torch.ones(24000, dtype=dtype)
    got = sparsenn.einsum(equation, matrix, operand, out_format="dense")
    reference = torch.einsum(equation, matrix.to_dense().float(), operand.float())
    assert torch.equal(got, reference.to(dtype)) and reference.max() == 3000
    if equation == "ij,i->j":  # the reduction runs outside the output loop: the kernel writes float32
        assert output_dtype(api.plan(equation, matrix, operand, out_format="dense").kernel, dtype) == torch.float32


# ----------------------------------------------------------------------------- kernel kinds


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("equation, fmt", [
    ("ij,j->i", "csr"), ("ij,i->j", "csr"), ("ij,jk->ik", "coo"), ("ij,jk->ik", "csc"), ("ij->", "dcsr"),
    ("ij,ij->ij", "csr"), ("ijk,jk->i", "csf"),
])
def test_scalar_nests(dtype, equation, fmt):
    a = sparse((37, 29) if fmt != "csf" else (13, 7, 9), fmt, dtype)
    dense_shapes = {"ij,j->i": [(29,)], "ij,i->j": [(37,)], "ij,jk->ik": [(29, 5)], "ij->": [],
                    "ij,ij->ij": [(37, 29)], "ijk,jk->i": [(7, 9)]}[equation]
    check_einsum(equation, [a, *(rounded(*s, dtype=dtype, seed=1) for s in dense_shapes)], dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [8, 45, 64])
def test_register_blocked_spmm(dtype, k, avx2_host):
    a, x = sparse((37, 29), "csr", dtype), rounded(29, k, dtype=dtype, seed=1)
    assert nest("ij,jk->ik", a, x).register_block is not None
    check_einsum("ij,jk->ik", [a, x], dtype)
    weight = sparse((30, 300), "csr", dtype, density=0.1)  # SparseLinear's product, batch-vectorised
    check_einsum("bi,oi->bo", [rounded(50, 300, dtype=dtype, seed=2), weight], dtype, out_format="dense")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("block, n, k", [(16, 64, 40), (8, 40, 24), (6, 36, 19)])
def test_register_tiled_block_spmm(dtype, block, n, k, avx2_host):
    mask = torch.rand(n // block, n // block, generator=torch.Generator().manual_seed(0)) < 0.4
    dense = rounded(n, n, dtype=dtype) * mask.repeat_interleave(block, 0).repeat_interleave(block, 1)
    a, x = sparsenn.from_dense(dense, format=f"bsr({block},{block})"), rounded(n, k, dtype=dtype, seed=1)
    assert nest("ij,jk->ik", a, x).register_tile is not None
    check_einsum("ij,jk->ik", [a, x], dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_gathered_register_tiles(dtype, avx2_host):
    gate = torch.zeros(6, 37)
    gate[torch.randint(0, 6, (37,), generator=torch.Generator().manual_seed(0)), torch.arange(37)] = 1.0
    g = sparsenn.from_dense((gate * torch.rand(6, 37)).to(dtype), format="csr")
    x, w = rounded(37, 16, dtype=dtype, seed=1), rounded(6, 16, 40, dtype=dtype, seed=2)
    assert nest("et,td,edh->eth", g, x, w, out_format="dense").register_tile.gathered_by == 0
    check_einsum("et,td,edh->eth", [g, x, w], dtype, out_format="dense")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("weights", ["edh", "ehd"])
def test_packed_panels_from_either_layout(dtype, weights, avx2_host):
    # 130 rows per stored e pack the weights (widened to float once, in the panels);
    # "ehd" packs them across their layout, by blocks transposed in registers.
    scale = torch.zeros(6)
    scale[[1, 4]] = torch.tensor([0.5, -1.0])
    s = sparsenn.from_dense(scale.to(dtype), format="c")
    x, w = rounded(6, 130, 40, dtype=dtype, seed=1), rounded(6, 40, 72, dtype=dtype, seed=2)
    w = w.permute(*("edh".index(i) for i in weights)).contiguous()
    equation = f"e,ecd,{weights}->ech"
    assert nest(equation, s, x, w, out_format="dense").register_tile.packed == (2,)
    check_einsum(equation, [s, x, w], dtype, out_format="dense")


def block_sddmm_operands(dtype, width=19, size=64):
    blocks = size // 16
    mask = torch.rand(blocks, blocks, generator=torch.Generator().manual_seed(0)) < 0.5
    dense = rounded(size, size, dtype=dtype) * mask.repeat_interleave(16, 0).repeat_interleave(16, 1)
    return sparsenn.from_dense(dense, format="bsr(16,16)"), rounded(size, width, dtype=dtype, seed=1), \
        rounded(size, width, dtype=dtype, seed=2)


@pytest.mark.parametrize("dtype", HALF)
def test_sampled_tiles_and_vector_reductions(dtype, avx2_host):
    # Blocks of 16 keep the sums in a register tile, blocks of 4 (narrower than a
    # vector) in a dot tile.
    blocked, q, k = block_sddmm_operands(dtype)
    assert nest("ij,ik,jk->ij", blocked, q, k).register_tile is not None
    check_einsum("ij,ik,jk->ij", [blocked, q, k], dtype)
    narrow = sparsenn.from_dense(blocked.to_dense(), format="bsr(4,4)")
    assert nest("ij,ik,jk->ij", narrow, q, k).dot_tile is not None
    check_einsum("ij,ik,jk->ij", [narrow, q, k], dtype)
    a = sparse((23, 19), "csr", dtype)
    x, y = rounded(23, 77, dtype=dtype, seed=3), rounded(19, 77, dtype=dtype, seed=4)
    assert nest("ij,ik,jk->ij", a, x, y).vector_reduction is not None
    check_einsum("ij,ik,jk->ij", [a, x, y], dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_pairwise_contractions_round_their_intermediates(dtype, avx2_host):
    # A dense block SDDMM of half its blocks with 64 columns runs as (Q Kᵀ) first (once
    # the work outweighs a second launch), a dense intermediate stored in the operands'
    # dtype as torch.einsum stores it, then the product with the mask: two roundings.
    blocked, q, k = block_sddmm_operands(dtype, width=64, size=256)
    assignment = api.parse("ij,ik,jk->ij", 3)
    checked = check_call(assignment, [blocked, q, k], "dense")
    split = split_of(assignment, checked)
    assert isinstance(resolve(split.assignment, check_call(split.assignment, split.operands(checked.operands),
                                                            split.request)), PathCall)
    check_einsum("ij,ik,jk->ij", [blocked, q, k], dtype, out_format="dense", roundings=2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("equation, formats, out_format", [
    ("ij,jk->ik", ("csr", "csr"), None),  # Gustavson, two phases (count, then fill)
    ("ij,kj->ik", ("csr", "csr"), "csr"),
    ("ij,jk->ik", ("csr", "csr"), "dcsr"),  # chunks appended through a dense workspace
    ("ij,ij->ij", ("csr", "csr"), None),  # a union of patterns, no workspace
])
def test_sparse_outputs(dtype, equation, formats, out_format):
    a = sparse((40, 30), formats[0], dtype, density=0.15)
    b = sparse((30, 20) if equation == "ij,jk->ik" else (40, 30), formats[1], dtype, density=0.15, seed=1)
    got = check_einsum(equation, [a, b], dtype, out_format=out_format)
    assert isinstance(got, SparseTensor) and got.values.dtype == dtype


@pytest.mark.parametrize("dtype", HALF)
def test_max_and_min_reductions(dtype):
    a = sparse((30, 25), "csr", dtype)
    x = rounded(25, dtype=dtype, seed=1)
    stored = a.to_dense() != 0
    values = a.to_dense().float()
    got = sparsenn.compile("M[i] = max[j](A[i,j])")(a)
    expected = values.masked_fill(~stored, -math.inf).amax(1)
    assert got.dtype == dtype and torch.equal(got.float(), expected)  # exact: a max rounds nothing
    got = sparsenn.compile("M[i] = min[j](A[i,j] * x[j])")(a, x)
    expected = (values * x.float()).masked_fill(~stored, math.inf).amin(1)
    assert_within_bound(got, expected, expected.abs(), 1, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("function", ["relu", "gelu", "sigmoid"])
def test_epilogues(dtype, function):
    # The bias and function applied per output row after the product: the kernel reads
    # its output back, so writes float32 and is rounded once after.
    a, x, b = sparse((37, 29), "csr", dtype), rounded(29, 40, dtype=dtype, seed=1), rounded(40, dtype=dtype, seed=2)
    got = sparsenn.compile(f"H[i,k] = {function}(A[i,j] * X[j,k] + b[k])")(a, x, b)
    product = a.to_dense().float() @ x.float()
    expected = getattr(torch.nn.functional, function)(product + b.float())
    magnitude = a.to_dense().float().abs() @ x.float().abs() + b.float().abs()
    # relu, gelu and sigmoid change an error by at most 1.2 times; float32's erf and exp add ulps
    assert_within_bound(got, expected, 1.2 * magnitude + 8 * expected.abs(), 29, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_nm_weights(dtype):
    weight = sparsenn.from_dense(rounded(12, 32, dtype=dtype), format="nm(2,4)")
    check_einsum("bi,oi->bo", [rounded(9, 32, dtype=dtype, seed=1), weight], dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_softmax_over_stored_entries(dtype):
    # Max, exp, sum and divide are separate kernels, each rounding its result: about one
    # rounding of the storage type per stage (4 u, relative).
    s = sparse((20, 30), "csr", dtype, density=0.4)
    got = sparsenn.softmax(s, dim=-1)
    stored = s.to_dense() != 0
    reference = torch.softmax(s.to_dense().float().masked_fill(~stored, -math.inf), -1).nan_to_num() * stored
    assert got.values.dtype == dtype
    error = (got.to_dense().float() - reference).abs()
    assert bool((error <= 4 * UNIT[dtype] * reference + FLOOR[dtype]).all())


@pytest.mark.parametrize("dtype", HALF)
def test_the_storage_type_is_part_of_the_kernel(dtype):
    # The source (the kernel cache's key) names the storage type; float32 kernels keep
    # their source, without conversions.
    a, x = sparse((9, 7), "csr", torch.float32), torch.randn(7, 40)
    single = api.plan("ij,jk->ik", a, x).source
    half = api.plan("ij,jk->ik", a.to(dtype), x.to(dtype)).source
    storage = {torch.bfloat16: "sn_bf16", torch.float16: "sn_f16"}[dtype]
    assert f"#define SN_STORAGE {storage}\n" in half and "sn_widen(" in half
    assert "SN_STORAGE" not in single and "sn_widen" not in single and "sn_narrow" not in single


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("dtype", HALF)
def test_gradients_come_out_in_the_operands_dtype(dtype):
    a, x = sparse((30, 20), "csr", dtype), rounded(20, 12, dtype=dtype, seed=1)
    weights = a.values.clone().requires_grad_(True)
    x16 = x.clone().requires_grad_(True)
    grad = rounded(30, 12, dtype=dtype, seed=2)
    sparsenn.einsum("ij,jk->ik", a.with_values(weights), x16).backward(grad)
    assert weights.grad.dtype == dtype and x16.grad.dtype == dtype
    w32, x32 = a.values.float().requires_grad_(True), x.float().requires_grad_(True)
    sparsenn.einsum("ij,jk->ik", a.with_values(w32), x32).backward(grad.float())
    rows, cols = a.coords()[0]
    dw_magnitude = (grad.float().abs()[rows] * x.float().abs()[cols]).sum(1)
    assert_within_bound(weights.grad, w32.grad, dw_magnitude, 12, dtype)
    assert_within_bound(x16.grad, x32.grad, a.to_dense().float().abs().T @ grad.float().abs(), 30, dtype)


def test_a_bfloat16_sparse_linear_trains():
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(48, 16, sparsity=0.7).to(torch.bfloat16)
    x = torch.randn(32, 48).to(torch.bfloat16)
    target = torch.randn(32, 16).to(torch.bfloat16)
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        optimiser.zero_grad()
        loss = (layer(x).float() - target.float()).square().mean()
        loss.backward()
        assert layer.weight_values.grad.dtype == torch.bfloat16 and layer.bias.grad.dtype == torch.bfloat16
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("dtype", HALF)
def test_a_dense_layer_feeding_a_sparse_layer_under_autocast(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), sparsenn.SparseLinear(64, 16, sparsity=0.8))
    x = torch.randn(8, 32)
    expected = model(x)
    with torch.autocast("cpu", dtype=dtype):
        got = model(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=8 * UNIT[dtype], atol=8 * UNIT[dtype])
    got.float().square().sum().backward()
    sparse_layer = model[2]
    assert sparse_layer.weight_values.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32


def test_gcn_conv_under_autocast():
    torch.manual_seed(0)
    conv1, conv2 = sparsenn.SparseGCNConv(16, 32), sparsenn.SparseGCNConv(32, 4, cached=True)
    x, edges = torch.randn(50, 16), torch.randint(0, 50, (2, 300))
    expected = conv2(conv1(x, edges).relu(), edges)
    conv2.reset_cache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = conv1(x, edges)  # a float32 input
        got = conv2(hidden.relu(), edges)  # a bfloat16 input, float32 parameters
    assert hidden.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05)
    assert conv2.adjacency(edges, None, 50, torch.float32).values.dtype == torch.float32  # the cache stays float32
    torch.testing.assert_close(conv2(conv1(x, edges).relu(), edges), expected)  # and serves float32 calls after


def test_lightning_bf16_mixed_trains_the_reference_gcn(tmp_path):
    import lightning

    from models import GCN, PlanetoidDataModule

    class Losses(lightning.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(outputs["loss"]))

    lightning.seed_everything(0, verbose=False)
    model, losses = GCN(1433, 7), Losses()
    trainer = lightning.Trainer(precision="bf16-mixed", accelerator="cpu", max_epochs=15, limit_val_batches=0,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=tmp_path, callbacks=[losses])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, PlanetoidDataModule("Cora"))
    assert losses.values[-1] < losses.values[0] - 0.1  # float32 training: 1.945 -> 1.79
    assert model.conv1.weight.dtype == torch.float32


def test_autocast_casts_floating_operands_but_float64():
    a32 = sparse((9, 7), "csr", torch.float32)
    x16 = rounded(7, 5, dtype=torch.bfloat16, seed=1)
    with pytest.raises(TypeError, match=r"operand 1 has dtype torch.bfloat16 but earlier operands have "
                                        r"torch.float32 \(operand 0 first\)"):
        sparsenn.einsum("ij,jk->ik", a32, x16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = sparsenn.einsum("ij,jk->ik", a32, x16)
        compiled = sparsenn.compile("Y[i,k] = A[i,j] * X[j,k]")(a32, x16.float())
        product = a32 @ a32.T  # operators go through the same entry
        with torch.autocast("cpu", enabled=False):
            kept = sparsenn.einsum("ij,jk->ik", a32, x16.float())
        with pytest.raises(TypeError, match="operand 1 has dtype torch.float64"):  # as torch.matmul under autocast
            sparsenn.einsum("ij,jk->ik", a32, x16.double())
        with pytest.raises(TypeError, match="operand 1 has dtype torch.int32"):
            sparsenn.einsum("ij,jk->ik", a32, torch.ones(7, 5, dtype=torch.int32))
    assert mixed.dtype == compiled.dtype == product.dtype == torch.bfloat16 and kept.dtype == torch.float32
    check_einsum("ij,jk->ik", [a32.to(torch.bfloat16), x16], torch.bfloat16)
    torch.testing.assert_close(mixed, compiled)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn, torch.bool])
def test_unsupported_value_dtypes_are_named(dtype):
    a = sparse((3, 4), "csr", torch.float32)
    with pytest.raises(TypeError, match=f"operand 1 has dtype {dtype}; sparsenn supports float32, float64, "
                                        "bfloat16 or float16"):
        sparsenn.einsum("ij,jk->ik", a, torch.ones(4, 2).to(dtype))
    with pytest.raises(TypeError, match=f"has dtype {dtype}; .*float32, float64, bfloat16 or float16"):
        sparsenn.from_dense(torch.ones(3, 4).to(dtype), format="csr")
    with pytest.raises(TypeError, match=str(dtype)):
        a.to(dtype)
