"""Exact dense attention, :class:`~sparsenn.layers.attention.BlockSparseAttention`'s
computation for sequences too short for a sparse BigBird pattern:
``P = dropout(softmax(Q Kᵀ · scale + bias))`` with ``-inf`` above the diagonal when
causal and at padded keys, ``O = P V``. A query row with no allowed key gets zero
attention, as on the sparse path (``torch.softmax`` would give NaN)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["dense_attention"]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None, bias: Tensor | None, is_causal: bool,
                    scale: float, dropout: float, training: bool) -> tuple[Tensor, Tensor]:
    """``(O, P)`` for ``q, k, v`` of shape ``(batch, heads, L, d)``; ``padding``: bool
    ``(batch, L)``, True at keys to ignore; ``bias``: additive, ``(1 or batch, 1 or
    heads, L, L)``; dropout of probability ``dropout`` on ``P`` when ``training``."""
    length = q.shape[2]
    scores = (q * scale) @ k.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    if padding is not None or bias is not None:  # rows whose every key is masked: zero attention
        closed = scores.amax(-1, keepdim=True) == float("-inf")
        probs = torch.softmax(scores.masked_fill(closed, 0.0), -1).masked_fill(closed, 0.0)
    else:
        probs = torch.softmax(scores, -1)
    probs = nn.functional.dropout(probs, dropout, training)
    return probs @ v, probs
