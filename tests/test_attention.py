"""BlockSparseAttention against scaled_dot_product_attention given the dense boolean
version of the exact mask used: forward and gradients (fp32 to 1e-5, fp64 gradcheck),
with and without key padding, lengths that are and are not multiples of the block size;
the BigBird pattern itself, training-mode redraw, dropout, need_weights, the dense
fallback and bad input. Shapes are few and small (4-8 blocks of 4), so kernels are reused."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd import gradcheck
from torch.nn.functional import scaled_dot_product_attention as sdpa

import sparsenn
from sparsenn.layers.attention import bigbird_pattern

EMBED, HEADS, BLOCK, BATCH = 16, 2, 4, 3


def layer(dtype=torch.float32, **kwargs) -> sparsenn.BlockSparseAttention:
    kwargs = {"block_size": BLOCK, "num_global_blocks": 2, "num_window_blocks": 3, "num_random_blocks": 1,
              "seed": 1, "batch_first": True, **kwargs}
    return sparsenn.BlockSparseAttention(EMBED, HEADS, **kwargs).to(dtype).eval()


def padding_mask(length: int, seed: int = 0) -> torch.Tensor:
    """Random padded keys; batch 1 wholly padded, batch 2 padded over its first 3 blocks."""
    pad = torch.rand(BATCH, length, generator=torch.Generator().manual_seed(seed)) < 0.3
    pad[1] = True
    pad[2, :3 * BLOCK] = True
    return pad


def reference(m: sparsenn.BlockSparseAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention's computation with SDPA under ``mask`` (B or 1, 1, L, L)."""
    q, k, v = m._project(x, None, None)
    out = sdpa(q, k, v, attn_mask=mask)
    return m.out_proj(out.transpose(1, 2).reshape(x.shape))


def rows_with_a_key(mask: torch.Tensor, length: int) -> torch.Tensor:
    """(batch, L) True where the query row has a key (SDPA gives NaN elsewhere)."""
    return mask.any(-1)[:, 0].expand(BATCH, length)


# ----------------------------------------------------------------------------- pattern
@pytest.mark.parametrize("n, g, w, r", [(8, 2, 3, 1), (9, 1, 3, 2), (12, 3, 4, 3), (6, 0, 1, 4)])
def test_bigbird_pattern(n, g, w, r):
    pattern = bigbird_pattern(n, g, w, r, torch.Generator().manual_seed(3))
    dense = pattern.to_dense()
    assert pattern.rows[-1] == pattern.nnz and (pattern.rows.diff() == dense.sum(1)).all()
    globals_ = list(range((g + 1) // 2)) + list(range(n - g // 2, n))
    assert dense[globals_].all() and dense[:, globals_].all()
    for row in range(n):
        window = set(range(max(row - w // 2, 0), min(row - w // 2 + w, n)))
        assert all(dense[row, c] for c in window)
        if row not in globals_:
            assert dense[row].sum() == len(window | set(globals_)) + r  # r random blocks outside them
    assert ((pattern.cols >= 0) & (pattern.cols < n)).all()


def test_pattern_is_seeded_and_random_blocks_vary():
    one = bigbird_pattern(16, 2, 3, 2, torch.Generator().manual_seed(5)).to_dense()
    assert torch.equal(one, bigbird_pattern(16, 2, 3, 2, torch.Generator().manual_seed(5)).to_dense())
    others = [bigbird_pattern(16, 2, 3, 2, torch.Generator().manual_seed(s)).to_dense() for s in range(6, 10)]
    assert any(not torch.equal(one, o) for o in others)


def test_too_few_blocks_for_a_pattern():
    with pytest.raises(ValueError, match="too few"):
        bigbird_pattern(6, 2, 3, 1, torch.Generator())


# ----------------------------------------------------------------------------- forward/backward
CASES = [(32, False), (30, False), (32, True), (27, True)]  # 8 blocks of 4; 30 and 27: padded tail


@pytest.mark.parametrize("length, padded", CASES, ids=[f"L{n}-{'kpm' if p else 'nokpm'}" for n, p in CASES])
def test_forward_and_gradients_match_sdpa(length, padded):
    torch.manual_seed(0)
    m = layer()
    x = torch.randn(BATCH, length, EMBED, requires_grad=True)
    pad = padding_mask(length) if padded else None
    mask = m.attention_mask(length, pad)
    has_key = rows_with_a_key(mask, length)
    out, _ = m(x, key_padding_mask=pad)
    ref = reference(m, x, mask)
    torch.testing.assert_close(out[has_key], ref[has_key], rtol=1e-5, atol=1e-5)
    if padded:  # a query row with no unpadded key: zero attention, so the output is out_proj's bias
        assert not has_key.all()
        torch.testing.assert_close(out[~has_key], m.out_proj.bias.expand(int((~has_key).sum()), -1))
    grad = torch.randn_like(out) * has_key[..., None]
    params = [x, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight]
    ours = torch.autograd.grad(out, params, grad)
    theirs = torch.autograd.grad(ref, params, grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, padded", [(24, False), (22, True)])
def test_gradcheck_fp64(length, padded):
    m = sparsenn.BlockSparseAttention(4, 2, block_size=4, num_global_blocks=1, num_window_blocks=1, batch_first=True,
                                      num_random_blocks=1, seed=2).double().eval()
    x = torch.randn(2, length, 4, dtype=torch.float64, requires_grad=True)
    pad = None
    if padded:
        pad = torch.zeros(2, length, dtype=torch.bool)
        pad[0, 5:9] = pad[1, -3:] = True
    assert gradcheck(lambda t: m(t, key_padding_mask=pad)[0], (x,))


def test_cross_attention_and_sequence_first():
    torch.manual_seed(1)
    m = layer(batch_first=False)
    q, kv = torch.randn(32, BATCH, EMBED), torch.randn(32, BATCH, EMBED)
    out, _ = m(q, kv, kv)
    w_q, w_k, w_v = m.in_proj_weight.chunk(3)
    b_q, b_k, b_v = m.in_proj_bias.chunk(3)
    split = lambda t: t.transpose(0, 1).unflatten(-1, (HEADS, -1)).transpose(1, 2)  # noqa: E731
    ref = sdpa(split(q @ w_q.T + b_q), split(kv @ w_k.T + b_k), split(kv @ w_v.T + b_v),
               attn_mask=m.attention_mask(32))
    ref = m.out_proj(ref.transpose(1, 2).reshape(BATCH, 32, EMBED)).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- training, dropout, weights
def pattern_of(weights: sparsenn.SparseTensor) -> torch.Tensor:
    return weights.with_values(torch.ones_like(weights.values)).to_dense() > 0


def test_training_redraws_the_pattern_and_eval_keeps_it():
    m = layer().train()
    x = torch.randn(1, 64, EMBED)
    drawn = [pattern_of(m(x, need_weights=True, average_attn_weights=False)[1]) for _ in range(4)]
    assert any(not torch.equal(drawn[0], d) for d in drawn[1:])
    m.eval()
    fixed = [pattern_of(m(x, need_weights=True, average_attn_weights=False)[1]) for _ in range(2)]
    assert torch.equal(fixed[0], fixed[1]) and torch.equal(fixed[0][0, 0], m.attention_mask(64)[0, 0])
    m = layer(fixed_pattern=True).train()
    assert torch.equal(pattern_of(m(x, need_weights=True, average_attn_weights=False)[1]), fixed[0])


def test_a_fixed_pattern_keeps_its_mask_between_calls():
    """The eval-mode mask is built once per pattern and shape (its index arrays then find
    their plans cached); a redrawn pattern gets a new one."""
    m = layer().eval()
    x = torch.randn(1, 64, EMBED)
    first = m(x, need_weights=True, average_attn_weights=False)[1]
    second = m(x, need_weights=True, average_attn_weights=False)[1]
    assert all(a is b for a, b in zip(first.pos + first.crd, second.pos + second.crd))
    m.train()
    third = m(x, need_weights=True, average_attn_weights=False)[1]
    assert not all(a is b for a, b in zip(first.pos + first.crd, third.pos + third.crd))


def test_a_padded_mask_is_kept_while_its_wholly_padded_key_blocks_repeat():
    """With a key padding mask, the eval-mode mask is kept for the next call whose padding
    leaves out the same key blocks (padding inside a block is the scores' bias): a new
    padding gets a new mask, each matching SDPA under its own padding."""
    torch.manual_seed(0)
    m = layer().eval()
    x = torch.randn(BATCH, 32, EMBED)
    pad = padding_mask(32)
    within = pad.clone()
    within[0, 4 * BLOCK] = ~within[0, 4 * BLOCK]  # batch 0 has unpadded keys in every block either way
    other = pad.clone()
    other[0, :2 * BLOCK] = True  # batch 0's first two key blocks wholly padded
    weights = {}
    for name, p in (("pad", pad), ("again", pad.clone()), ("within", within), ("other", other), ("back", pad)):
        out, weights[name] = m(x, key_padding_mask=p, need_weights=True, average_attn_weights=False)
        mask = m.attention_mask(32, p)
        has_key = rows_with_a_key(mask, 32)
        torch.testing.assert_close(out[has_key], reference(m, x, mask)[has_key], rtol=1e-5, atol=1e-5)

    def same(a, b):
        return all(s is t for s, t in zip(a.pos + a.crd, b.pos + b.crd))

    assert same(weights["pad"], weights["again"]) and same(weights["pad"], weights["within"])
    assert not same(weights["pad"], weights["other"]) and not same(weights["other"], weights["back"])
    assert weights["other"].nnz < weights["pad"].nnz


def test_masks_share_one_buffer_of_ones():
    """block_mask's values are ones, views of one buffer per dtype that a longer request
    replaces; a traced mask op returns its own copy."""
    from sparsenn.layers.bigbird import block_mask, shared_ones

    pattern = bigbird_pattern(8, 2, 3, 1, torch.Generator().manual_seed(0))
    pad = padding_mask(32)
    masks = [block_mask(pattern, BATCH, HEADS, BLOCK, p, torch.float32) for p in (None, pad)]
    for mask in masks:
        assert torch.equal(mask.values, torch.ones(mask.nnz))
    assert masks[0].values._base is masks[1].values._base is not None
    keep = ~pad.view(BATCH, 8, BLOCK).all(2)[:, pattern.cols]
    cols = torch.cat([pattern.cols[keep[b]].repeat(HEADS) for b in range(BATCH)])
    assert torch.equal(masks[1].crd[3].long(), cols)
    n = masks[0].values._base.numel() + 1
    longer = shared_ones(n, torch.float32)
    assert longer._base is not masks[0].values._base and torch.equal(longer, torch.ones(n))
    assert shared_ones(3, torch.float64).dtype == torch.float64
    op = torch.ops.sparsenn.bigbird_mask(8, 2, 3, 1, torch.tensor(0), BATCH, HEADS, BLOCK, None, torch.float32)
    assert torch.equal(op[2], masks[0].values) and op[2]._base is None


def test_training_pattern_matches_sdpa():
    m = layer().train()
    x = torch.randn(BATCH, 32, EMBED)
    out, weights = m(x, average_attn_weights=False)
    mask = pattern_of(weights)[:, :1]
    torch.testing.assert_close(out, reference(m, x, mask), rtol=1e-5, atol=1e-5)


def test_dropout_on_stored_probabilities():
    torch.manual_seed(3)
    m = layer(dropout=0.5).train()
    x = torch.randn(BATCH, 32, EMBED)
    _, weights = m(x, average_attn_weights=False)
    values = weights.values
    dropped = (values == 0).float().mean().item()
    assert 0.4 < dropped < 0.6  # of ~10^4 stored probabilities, half dropped
    kept = values[values != 0]
    assert kept.max() <= 2.0 + 1e-6  # survivors scaled by 1 / (1 - p)
    sums = weights.to_dense().sum(-1)
    assert 0.8 < sums.mean().item() < 1.2 and not torch.allclose(sums, torch.ones_like(sums))
    m.eval()
    _, weights = m(x, average_attn_weights=False)
    torch.testing.assert_close(weights.to_dense().sum(-1), torch.ones(BATCH, HEADS, 32))


def test_need_weights_are_the_probabilities():
    m = layer()
    x = torch.randn(BATCH, 30, EMBED)
    pad = padding_mask(30, seed=4)
    out, weights = m(x, key_padding_mask=pad, average_attn_weights=False)
    assert isinstance(weights, sparsenn.SparseTensor) and weights.shape == (BATCH, HEADS, 30, 30)
    q, k, _ = m._project(x, None, None)
    mask = m.attention_mask(30, pad)
    scores = (q @ k.transpose(-1, -2) / (EMBED // HEADS) ** 0.5).masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, -1).nan_to_num(0.0)
    torch.testing.assert_close(weights.to_dense(), expected, rtol=1e-5, atol=1e-6)
    assert m(x, need_weights=False)[1] is None


# ----------------------------------------------------------------------------- dense fallback
def test_short_sequence_is_dense_attention_with_one_warning():
    torch.manual_seed(4)
    m = layer()  # 2 + 3 + 1 blocks of 4: dense up to 24 tokens
    assert m.dense_up_to == 24 and "dense attention for L <= 24" in repr(m)
    mha = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=True).eval()
    mha.load_state_dict(m.state_dict())
    x = torch.randn(BATCH, 20, EMBED)
    pad = torch.zeros(BATCH, 20, dtype=torch.bool)
    pad[0, 3:] = True
    with pytest.warns(UserWarning, match="exact dense attention"):
        out, weights = m(x, key_padding_mask=pad, average_attn_weights=False)
    ref, ref_weights = mha(x, x, x, key_padding_mask=pad, average_attn_weights=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.to_dense(), ref_weights, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x)
    pad[1] = True  # every key padded: zero attention, where nn.MultiheadAttention gives NaN
    out, _ = m(x, key_padding_mask=pad)
    torch.testing.assert_close(out[1], m.out_proj.bias.expand(20, -1))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, error, match", [
    ({"embed_dim": 10, "num_heads": 3}, ValueError, "divisible"),
    ({"num_heads": 0}, ValueError, "num_heads must be >= 1"),
    ({"block_size": 0}, ValueError, "block_size must be >= 1"),
    ({"num_global_blocks": -1}, ValueError, "num_global_blocks must be >= 0"),
    ({"num_window_blocks": 0}, ValueError, "num_window_blocks must be >= 1"),
    ({"num_random_blocks": -2}, ValueError, "num_random_blocks must be >= 0"),
    ({"num_random_blocks": 1.5}, TypeError, "num_random_blocks must be an int"),
    ({"block_size": True}, TypeError, "block_size must be an int, got bool"),
    ({"dropout": 1.0}, ValueError, "dropout must be in"),
    ({"dropout": "0.1"}, TypeError, "dropout must be a float"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
])
def test_bad_construction(kwargs, error, match):
    kwargs = {"embed_dim": EMBED, "num_heads": HEADS, **kwargs}
    with pytest.raises(error, match=match):
        sparsenn.BlockSparseAttention(**kwargs)


def test_bad_forward_input():
    m = layer()
    x = torch.randn(BATCH, 32, EMBED)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        m(x, key_padding_mask=torch.zeros(BATCH, 32))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, L\) = \(3, 32\)"):
        m(x, key_padding_mask=torch.zeros(BATCH, 31, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a torch.Tensor"):
        m(x, key_padding_mask=[[False] * 32] * BATCH)
    with pytest.raises(ValueError, match="same batch and length"):
        m(x, x, x[:, :28])
    with pytest.raises(ValueError, match="query's batch and length"):
        m(x, x[:, :28], x[:, :28])
    with pytest.raises(ValueError, match="both key and value"):
        m(x, x)
    with pytest.raises(ValueError, match="embed_dim=16"):
        m(torch.randn(BATCH, 32, 8))
    with pytest.raises(TypeError, match="float tensor"):
        m(torch.ones(BATCH, 32, EMBED, dtype=torch.long))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        m("x")
