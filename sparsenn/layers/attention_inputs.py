"""Validation of :class:`~sparsenn.layers.attention.BlockSparseAttention`'s arguments, with
``nn.MultiheadAttention``'s conventions: inputs ``(L, batch, E)`` or, with
``batch_first``, ``(batch, L, E)``; a bool key padding mask ``(batch, L)``; an
``attn_mask`` ``(L, L)`` or ``(batch * heads, L, L)``, bool (True = not allowed to
attend) or float (added to the scores). TypeError/ValueError naming the argument
otherwise; shape errors name the layout the inputs are read in."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_inputs", "check_heads", "check_padding", "attn_mask_bias"]


def _layout(batch_first: bool) -> str:
    """The inputs' declared layout, for error messages."""
    return f"{'(batch, L, E)' if batch_first else '(L, batch, E)'} (batch_first={batch_first})"


def _check_input(name: str, x: object, embed_dim: int, batch_first: bool) -> Tensor:
    """``x`` as ``(batch, L, embed_dim)``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got dtype {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        shape = "(batch, L, embed_dim)" if batch_first else "(L, batch, embed_dim)"
        raise ValueError(f"{name} must have shape {shape} with embed_dim={embed_dim}, got {tuple(x.shape)}")
    return x if batch_first else x.transpose(0, 1)


def check_inputs(query: object, key: object, value: object, embed_dim: int,
                 batch_first: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``forward``'s query, key and value as ``(batch, L, embed_dim)`` (key and value
    None for self-attention), all of one batch and length (the pattern is square)."""
    query = _check_input("query", query, embed_dim, batch_first)
    if (key is None) != (value is None):
        raise ValueError("give both key and value, or neither (self-attention)")
    if key is None:
        return query, None, None
    key, value = _check_input("key", key, embed_dim, batch_first), _check_input("value", value, embed_dim, batch_first)
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"key and value must have the same batch and length, got key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)} (read as {_layout(batch_first)})")
    if key.shape[:2] != query.shape[:2]:
        raise ValueError(f"key and value must have the query's batch and length (BigBird's pattern is "
                         f"square), got (batch, L) = {tuple(query.shape[:2])} for the query and "
                         f"{tuple(key.shape[:2])} for the key, read as {_layout(batch_first)}")
    return query, key, value


def check_heads(q: object, k: object, v: object, num_heads: int, is_causal: object) -> bool:
    """``attend``'s projected heads, tensors of one shape ``(batch, num_heads, L, d)``;
    returns ``is_causal`` as a bool."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape != q.shape or t.shape[1] != num_heads:
            raise ValueError(f"q, k and v must be tensors of one shape (batch, {num_heads}, L, head_dim); "
                             f"{name} is {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if isinstance(is_causal, Tensor) and is_causal.dtype == torch.bool and is_causal.numel() == 1:
        is_causal = bool(is_causal)  # torch.onnx.export hands default arguments on as tensors
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return is_causal


def check_padding(key_padding_mask: object, batch: int, seq_len: int, batch_first: bool) -> Tensor:
    """The ``(batch, L)`` bool key padding mask, True at keys to ignore."""
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = ignore the key), "
                        f"got dtype {key_padding_mask.dtype}")
    if tuple(key_padding_mask.shape) != (batch, seq_len):
        raise ValueError(f"key_padding_mask must have shape (batch, L) = {(batch, seq_len)}, got "
                         f"{tuple(key_padding_mask.shape)}; the inputs are read as {_layout(batch_first)}")
    return key_padding_mask


def attn_mask_bias(attn_mask: object, batch: int, heads: int, seq_len: int, dtype: torch.dtype,
                   batch_first: bool) -> Tensor:
    """``attn_mask`` as an additive float bias ``(1, 1, L, L)`` or ``(batch, heads, L, L)``:
    ``-inf`` where a bool mask is True, a float mask as it is."""
    if not isinstance(attn_mask, Tensor) or attn_mask.layout != torch.strided:
        raise TypeError(f"attn_mask must be a dense torch.Tensor, got "
                        f"{attn_mask.layout if isinstance(attn_mask, Tensor) else type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be a bool tensor (True = not allowed to attend) or a float tensor "
                        f"(added to the scores), got dtype {attn_mask.dtype}")
    if tuple(attn_mask.shape) == (seq_len, seq_len):
        mask = attn_mask[None, None]
    elif tuple(attn_mask.shape) == (batch * heads, seq_len, seq_len):
        mask = attn_mask.view(batch, heads, seq_len, seq_len)
    else:
        raise ValueError(f"attn_mask must have shape (L, L) = {(seq_len, seq_len)} or (batch * num_heads, L, L) "
                         f"= {(batch * heads, seq_len, seq_len)}, got {tuple(attn_mask.shape)}; the inputs are "
                         f"read as {_layout(batch_first)}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)
