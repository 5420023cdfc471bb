"""PyTorch conventions on every layer: BlockSparseAttention as a drop-in for
nn.MultiheadAttention (layouts, attn_mask, is_causal, weights), device=/dtype= and the meta
device with to_empty + reset_parameters, a cached GCN moved to another dtype, an optimizer
across a pattern-changing load_state_dict, and the refusals of torch.jit.script and
torch.onnx.export."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import BlockSparseAttention, SparseGCNConv, SparseLinear, SparseMoE, SparseMoEGate

EMBED, HEADS, BLOCK, BATCH = 16, 2, 4, 3
SPARSE_L, DENSE_L = 32, 16  # 8 blocks of 4 (the pattern stores 5 per row); dense up to 5 blocks = 20 tokens


def attention(**kwargs) -> BlockSparseAttention:
    return BlockSparseAttention(EMBED, HEADS, block_size=BLOCK, num_global_blocks=1, num_window_blocks=3,
                                num_random_blocks=1, seed=1, **kwargs).eval()


def mha_like(layer: BlockSparseAttention) -> nn.MultiheadAttention:
    mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=layer.batch_first).eval()
    mha.load_state_dict(layer.state_dict())
    return mha


def user_mask(kind: str, length: int, generator: torch.Generator) -> torch.Tensor | None:
    """An attn_mask as nn.MultiheadAttention takes it; no row wholly masked."""
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.rand(length, length, generator=generator) < 0.3
        return mask.fill_diagonal_(False)
    return torch.randn(BATCH * HEADS, length, length, generator=generator)  # float, per (batch, head)


def reference_mask(layer: BlockSparseAttention, mask: torch.Tensor | None, length: int,
                   causal: bool) -> torch.Tensor:
    """The float (batch * heads, L, L) mask nn.MultiheadAttention needs for the same result:
    -inf outside the layer's pattern (and above the diagonal if causal), the user mask inside."""
    allowed = layer.attention_mask(length, is_causal=causal)[0, 0]
    if mask is None:
        bias = torch.zeros(length, length)
    elif mask.dtype == torch.bool:
        bias = torch.zeros(length, length).masked_fill(mask, float("-inf"))
    else:
        bias = mask
    return torch.where(allowed, bias, float("-inf")).expand(BATCH * HEADS, length, length)


# ----------------------------------------------------------------------------- nn.MultiheadAttention
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("length", [DENSE_L, SPARSE_L], ids=["dense-fallback", "sparse"])
@pytest.mark.parametrize("mask_kind, causal", [("none", False), ("bool", False), ("float", False), ("none", True),
                                               ("bool", True)])
def test_block_sparse_attention_equals_multihead_attention(batch_first, length, mask_kind, causal):
    g = torch.Generator().manual_seed(length + 7 * causal)
    torch.manual_seed(0)
    layer = attention(batch_first=batch_first)
    mha = mha_like(layer)
    shape = (BATCH, length, EMBED) if batch_first else (length, BATCH, EMBED)
    x = torch.randn(shape, generator=g, requires_grad=True)
    mask = user_mask(mask_kind, length, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dense fallback's one-time warning
        out, weights = layer(x, x, x, attn_mask=mask, is_causal=causal)
        _, per_head = layer(x, x, x, attn_mask=mask, is_causal=causal, average_attn_weights=False)
    ref_mask = reference_mask(layer, mask, length, causal)
    expected, expected_weights = mha(x, x, x, attn_mask=ref_mask)
    _, expected_per_head = mha(x, x, x, attn_mask=ref_mask, average_attn_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert weights.shape == (BATCH, length, length) and per_head.shape == (BATCH, HEADS, length, length)
    torch.testing.assert_close(weights.to_dense(), expected_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_head.to_dense(), expected_per_head, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, layer.in_proj_weight), grad)
    theirs = torch.autograd.grad(expected, (x, mha.in_proj_weight), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_masks_restrict_the_pattern_and_a_wholly_masked_row_gets_zero_attention():
    layer = attention(batch_first=True)
    x = torch.randn(BATCH, SPARSE_L, EMBED)
    full, _ = layer(x, need_weights=False)
    blocked = torch.zeros(SPARSE_L, SPARSE_L, dtype=torch.bool)
    blocked[:, :BLOCK] = True  # the global key block, wholly masked: left out of the pattern
    blocked[:BLOCK] = False
    _, weights = layer(x, attn_mask=blocked, average_attn_weights=False)
    _, unmasked = layer(x, average_attn_weights=False)
    assert weights.nnz < unmasked.nnz
    row = torch.zeros(SPARSE_L, SPARSE_L, dtype=torch.bool)
    row[9] = True  # every key of query 9
    out, weights = layer(x, attn_mask=row)
    torch.testing.assert_close(out[:, 9], layer.out_proj.bias.expand(BATCH, -1))
    assert not out.isnan().any() and not weights.values.isnan().any()
    others = torch.arange(SPARSE_L) != 9
    torch.testing.assert_close(out[:, others], full[:, others], rtol=1e-5, atol=1e-5)


def test_causal_drops_the_blocks_above_the_diagonal():
    layer = attention(batch_first=True)
    x = torch.randn(1, SPARSE_L, EMBED)
    _, weights = layer(x, is_causal=True, average_attn_weights=False)
    dense = weights.to_dense()[0, 0]
    assert (dense.triu(1) == 0).all()
    _, plain = layer(x, average_attn_weights=False)
    assert weights.nnz < plain.nnz


def test_the_default_layout_is_sequence_first():
    layer = BlockSparseAttention(EMBED, HEADS, block_size=BLOCK)
    assert layer.batch_first is False


@pytest.mark.parametrize("batch_first", [False, True])
def test_inputs_contradicting_the_layout_raise(batch_first):
    layer = attention(batch_first=batch_first)
    x = torch.randn((BATCH, SPARSE_L, EMBED) if batch_first else (SPARSE_L, BATCH, EMBED))
    other = torch.randn((BATCH + 1, SPARSE_L, EMBED) if batch_first else (SPARSE_L, BATCH + 1, EMBED))
    with pytest.raises(ValueError, match=f"query's batch and length .*batch_first={batch_first}"):
        layer(x, other, other)
    with pytest.raises(ValueError, match=f"key_padding_mask must have shape .*batch_first={batch_first}"):
        layer(x, key_padding_mask=torch.zeros(SPARSE_L, BATCH, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        layer(x, attn_mask=torch.zeros(BATCH, SPARSE_L, SPARSE_L, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor .* or a float tensor"):
        layer(x, attn_mask=torch.zeros(SPARSE_L, SPARSE_L, dtype=torch.long))
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        layer(x, is_causal=1)


# ----------------------------------------------------------------------------- device, dtype, meta
def build(kind: str, **kwargs) -> nn.Module:
    if kind == "linear":
        return SparseLinear(16, 8, sparsity=0.5, **kwargs)
    if kind == "linear-given":
        return SparseLinear(8, 4, pattern=torch.eye(4, 8, dtype=torch.bool, device="cpu"), **kwargs)
    if kind == "linear-bsr":
        return SparseLinear(16, 8, format="bsr(2,2)", sparsity=0.5, **kwargs)
    if kind == "gcn":
        return SparseGCNConv(16, 8, **kwargs)
    if kind == "gate":
        return SparseMoEGate(16, 4, **kwargs)
    if kind == "moe":
        return SparseMoE(16, 8, 4, bias=True, **kwargs)
    return BlockSparseAttention(EMBED, HEADS, block_size=BLOCK, num_global_blocks=1, num_window_blocks=3,
                                num_random_blocks=1, batch_first=True, seed=0, **kwargs)


KINDS = ["linear", "linear-given", "linear-bsr", "gcn", "gate", "moe", "attention"]


def run(kind: str, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A forward of ``layer`` in ``dtype``; its (first) dense output."""
    g = torch.Generator().manual_seed(0)
    if kind.startswith("linear"):
        return layer(torch.randn(5, layer.in_features, generator=g).to(dtype))
    if kind == "gcn":
        return layer(torch.randn(6, 16, generator=g).to(dtype), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]))
    if kind == "gate":
        return layer(torch.randn(5, 16, generator=g).to(dtype)).gates.values
    if kind == "moe":
        return layer(torch.randn(5, 16, generator=g).to(dtype))
    return layer(torch.randn(2, SPARSE_L, EMBED, generator=g).to(dtype), need_weights=False)[0]


@pytest.mark.parametrize("context", [False, True], ids=["device=meta", "with-torch.device-meta"])
@pytest.mark.parametrize("kind", KINDS)
def test_meta_construction_to_empty_and_reset_parameters_give_a_working_layer(kind, context):
    torch.manual_seed(0)
    if context:
        with torch.device("meta"):
            layer = build(kind)
    else:
        layer = build(kind, device="meta")
    assert all(t.device.type == "meta" for t in layer.parameters())
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert all(t.device.type == "cpu" for t in list(layer.parameters()) + list(layer.buffers()))
    out = run(kind, layer)
    assert out.isfinite().all()
    if kind == "linear-given":
        assert torch.equal(layer.mask(), torch.eye(4, 8, dtype=torch.bool))


def test_a_meta_built_sparse_linear_refuses_to_run_before_it_has_a_pattern_and_loads_one():
    layer = SparseLinear(16, 8, device="meta")
    layer.to_empty(device="cpu")
    with pytest.raises(ValueError, match="built on the meta device .* reset_parameters"):
        layer(torch.randn(2, 16))
    source = SparseLinear(16, 8, format="csc", sparsity=0.7)
    layer.load_state_dict(source.state_dict())
    x = torch.randn(2, 16)
    torch.testing.assert_close(layer(x), source(x))
    layer.reset_parameters()  # keeps the loaded pattern
    assert torch.equal(layer.mask(), source.mask())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_dtype_and_device_arguments(kind, dtype):
    torch.manual_seed(0)
    layer = build(kind, device="cpu", dtype=dtype).eval()
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in layer.parameters())
    out = run(kind, layer, dtype)
    assert out.dtype == dtype and out.isfinite().all()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_device_and_dtype_arguments(kind):
    with pytest.raises(ValueError, match="device must be 'cpu' or 'meta'"):
        build(kind, device="cuda")
    with pytest.raises(TypeError, match="dtype must be torch.float32, float64, bfloat16 or float16"):
        build(kind, dtype=torch.int32)


# ----------------------------------------------------------------------------- cached GCN
def test_a_cached_gcn_moved_to_another_dtype_recomputes_its_adjacency():
    torch.manual_seed(0)
    conv = SparseGCNConv(16, 8, cached=True)
    x, edges = torch.randn(6, 16), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    conv(x, edges)
    fresh = SparseGCNConv(16, 8, dtype=torch.float64)
    fresh.load_state_dict(conv.state_dict())
    conv.double()
    torch.testing.assert_close(conv(x.double(), edges), fresh(x.double(), edges))
    assert conv._cached_adjacency.dtype == torch.float64


# ----------------------------------------------------------------------------- optimizer across a load
def models() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    return nn.Sequential(SparseLinear(16, 8, sparsity=0.5)), nn.Sequential(SparseLinear(16, 8, sparsity=0.8))


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()


def test_a_pattern_changing_load_keeps_the_parameter_and_a_stale_optimizer_state_raises():
    model, other = models()
    optimizer = torch.optim.Adam(model.parameters())
    step(model, optimizer)
    values = model[0].weight_values
    model.load_state_dict(other.state_dict())
    assert model[0].weight_values is values and values.shape == other[0].weight_values.shape
    assert values.grad is None  # the old pattern's gradient is dropped
    with pytest.raises(RuntimeError, match=r"Adam holds state 'exp_avg' .* parameter '0.weight_values', which "
                                           r"load_state_dict resized .*optimizer.load_state_dict"):
        step(model, optimizer)
    optimizer.state.pop(values)  # the remedy the message gives: restart its state
    step(model, optimizer)
    assert optimizer.state[values]["exp_avg"].shape == values.shape


def test_resuming_model_and_optimizer_state_dicts_across_patterns():
    model, other = models()
    other_optimizer = torch.optim.Adam(other.parameters())
    step(other, other_optimizer)
    optimizer = torch.optim.Adam(model.parameters())  # built before the load, never stepped or stepped
    step(model, optimizer)
    model.load_state_dict(other.state_dict())
    optimizer.load_state_dict(other_optimizer.state_dict())
    step(model, optimizer)
    fresh_model, _ = models()
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=0.1)  # no state: fits any shape
    fresh_model.load_state_dict(other.state_dict())
    step(fresh_model, fresh)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", KINDS)
def test_torch_jit_script_is_refused_with_a_clear_error(kind):
    layer = build(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="torch.jit.script cannot compile sparsenn.* torch.compile"):
            torch.jit.script(layer)
        with pytest.raises(TypeError, match="torch.jit.script cannot compile sparsenn"):
            torch.jit.script(nn.Sequential(layer))


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "gate"])  # the gate runs torch's ops only
def test_torch_onnx_export_is_refused_with_a_clear_error(kind):
    layer = build(kind).eval()
    g = torch.Generator().manual_seed(0)
    if kind.startswith("linear"):
        args = (torch.randn(5, layer.in_features, generator=g),)
    elif kind == "gcn":
        args = (torch.randn(6, 16, generator=g), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]))
    elif kind == "moe":
        args = (torch.randn(5, 16, generator=g),)
    else:
        args = (torch.randn(2, SPARSE_L, EMBED, generator=g),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="torch.onnx.export cannot export sparsenn.* torch.export"):
            torch.onnx.export(layer, args, io.BytesIO(), dynamo=False)
