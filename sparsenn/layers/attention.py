"""BlockSparseAttention: BigBird's block-sparse multi-head attention (Zaheer et al. 2020,
ITC variant), computed by compiled sparse einsums.

With ``x`` of shape ``(batch, L, E)``, ``H`` heads of ``d = E / H`` and blocks of ``s``
(the sequence padded to ``L' = ceil(L / s) * s``):

* ``Q, K, V = x W_q + b_q, x W_k + b_k, x W_v + b_v``, split into heads (einops);
* ``M`` is a blocked ``(batch, H, L', L')`` pattern of ones (``dddc(1,1,s,s)``): block
  row ``r`` holds the global blocks, the window around ``r`` and random blocks, a global
  block row holds every block; key blocks that are wholly padding are left out;
* ``S<M> = Q Kᵀ / sqrt(d)`` (block SDDMM on ``M``'s pattern, ``M``'s values never read;
  the scale multiplies each stored score once), plus ``-inf`` at padded keys inside stored
  blocks (in the same kernel);
* ``P = softmax(S)`` over stored entries, dropout on ``P``'s values: the scores and the
  softmax are one program (``sparsenn.functional.softmax_program``), which the planner
  fuses into one kernel (``compiler/plan/fusion.py``): each block row's scores are
  computed, normalised and written once;
* ``O = P V`` (block SpMM), heads merged, ``out = O W_o + b_o``. Without dropout and
  without gradients (inference), the SpMM is one more statement of the program, fused
  too: each block row's ``P`` is multiplied by ``V`` while still in cache.

Backward: the program's gradient (``compiler/program_autograd.py``), a program too:
softmax's gradient ``dS`` on the mask's pattern (from ``P``, which the forward keeps),
then ``dQ = scale · dS K`` and ``dK = scale · dSᵀ Q``. A query row with no unpadded key in its blocks is
empty: its output is zero.
"""

from __future__ import annotations

import math
import warnings

import torch
from einops import rearrange
from torch import Tensor, nn

from sparsenn.compiler import CompiledExpression, compile_expression, compiled_once, einsum
from sparsenn.compiler.runtime.tracing import tracing
from sparsenn.formats import SparseTensor, from_dense
from sparsenn.functional import softmax_program
from sparsenn.layers.arguments import checked_int
from sparsenn.layers.attention_inputs import attn_mask_bias, check_heads, check_inputs, check_padding
from sparsenn.layers.bigbird import BigBirdMasks, BlockPattern, bigbird_pattern, head_mean, trimmed
from sparsenn.layers.conventions import factory_kwargs, refuse_torchscript
from sparsenn.layers.dense_attention import dense_attention

__all__ = ["BlockSparseAttention", "BlockPattern", "bigbird_pattern"]


def _scores(scale: float, padded: bool, entries: bool = False) -> str:
    """The scores on ``M``'s pattern, plus a key bias (``-inf`` at padded keys) when
    ``padded``, or plus ``M``'s values (an additive bias on each stored entry: an
    attention mask) when ``entries``, in the same kernel; else ``M`` is read for its
    positions only. (Adding a bias in a second masked expression has a sampled gradient
    assembled element-wise and re-packed by a sort of every stored entry: 25 s at batch
    64, L 1024.)"""
    bias = " + bias[i0,i3]" if padded else " + Mask[i0,i1,i2,i3]" if entries else ""
    return f"S<Mask>[i0,i1,i2,i3] = {scale!r} * Q[i0,i1,i2,d] * K[i0,i1,i3,d]{bias}"


@compiled_once
def _probabilities(scale: float, padded: bool, entries: bool = False) -> CompiledExpression:
    """``P = softmax(S)`` of the scores :func:`_scores`, over ``(M, Q, K[, bias])``: one
    program, whose statements the planner fuses into one kernel (per block row: its
    scores, their maxima, exponentials, sums and scaling, while the row is in cache)."""
    return compile_expression(softmax_program(4, 3, _scores(scale, padded, entries)))


@compiled_once
def _attention(scale: float, padded: bool, entries: bool = False, weights: bool = False) -> CompiledExpression:
    """``O = P V`` over ``(M, Q, K[, bias], V)``: :func:`_probabilities`, then the block
    SpMM of each block row of ``P`` by ``V``, fused with them; ``(O, P)`` with ``weights``."""
    text = softmax_program(4, 3, _scores(scale, padded, entries))
    return compile_expression(f"{text}; O[i0,i1,i2,d] = P[i0,i1,i2,i3] * V[i0,i1,i3,d]", "dense",
                              ("O", "P") if weights else None)


class BlockSparseAttention(nn.Module):
    """Multi-head attention on BigBird's block-sparse pattern, shaped like
    ``nn.MultiheadAttention`` (same projection parameters: ``in_proj_weight``,
    ``in_proj_bias``, ``out_proj``).

    ``forward(query, key=None, value=None, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False)`` takes
    ``nn.MultiheadAttention``'s arguments and defaults: inputs ``(L, batch, E)``, or
    ``(batch, L, E)`` with ``batch_first=True``; self-attention when key and value are
    omitted; key and value must have the query's length (the pattern is square).

    * ``key_padding_mask``: bool ``(batch, L)``, True at keys to ignore.
    * ``attn_mask``: ``(L, L)`` or ``(batch * num_heads, L, L)``, bool (True = not
      allowed to attend, as ``nn.MultiheadAttention``) or float (added to the scores).
      It is read at the pattern's stored entries only (restricted to the pattern): an
      additive bias on the stored blocks, inside the scores' kernel; blocks it masks
      wholly are left out of the pattern.
    * ``is_causal``: query ``i`` attends to keys ``j <= i`` only (decoder BigBird): the
      blocks above the diagonal leave the pattern and the diagonal blocks get the
      element mask. Unlike ``nn.MultiheadAttention`` it needs no ``attn_mask``; one given
      is applied as well.
    * ``need_weights``: also return the attention probabilities after dropout, as a
      SparseTensor: ``(batch, L, L)`` averaged over heads (``average_attn_weights``) or
      ``(batch, heads, L, L)`` per head (blocked ``dddc(1,1,s,s)`` when ``L`` is a
      multiple of ``block_size``, else element-wise ``dddc`` trimmed to ``L``). Computing
      them costs time: pass ``need_weights=False`` unless they are used.

    Returns ``(output, weights or None)``. A query row with no allowed key in the pattern
    gets zero attention (``nn.MultiheadAttention`` gives NaN).

    The random blocks come from ``seed`` (drawn from torch's generator when None): the
    same pattern in eval mode, redrawn at every forward in training unless
    ``fixed_pattern``. A sequence of at most ``(g + w + r) · block_size`` tokens has no
    sparse pattern; it gets exact dense attention (with a one-time warning). ``device``,
    ``dtype``: of the parameters, as ``nn.MultiheadAttention`` takes them.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, embed_dim: int, num_heads: int, *, block_size: int = 64, num_global_blocks: int = 2,
                 num_window_blocks: int = 3, num_random_blocks: int = 2, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, seed: int | None = None, fixed_pattern: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kwargs = factory_kwargs(device, dtype)
        self.embed_dim = checked_int("embed_dim", embed_dim, 1)
        self.num_heads = checked_int("num_heads", num_heads, 1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.block_size = checked_int("block_size", block_size, 1)
        self.num_global_blocks = checked_int("num_global_blocks", num_global_blocks, 0)
        self.num_window_blocks = checked_int("num_window_blocks", num_window_blocks, 1)
        self.num_random_blocks = checked_int("num_random_blocks", num_random_blocks, 0)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a float, got {type(dropout).__name__}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        self.fixed_pattern = bool(fixed_pattern)
        self.seed = int(torch.randint(2**62, (), device="cpu")) if seed is None else checked_int("seed", seed, 0)
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kwargs))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **kwargs)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kwargs)
        self._reset_projections()
        self._masks = BigBirdMasks(num_heads, block_size, num_global_blocks, num_window_blocks, num_random_blocks,
                                   self.seed)
        self._warned_dense = False

    def reset_parameters(self) -> None:
        """``out_proj``'s ``nn.Linear`` initialisation, then :meth:`_reset_projections`."""
        self.out_proj.reset_parameters()
        self._reset_projections()

    def _reset_projections(self) -> None:
        """``nn.MultiheadAttention``'s: Xavier-uniform ``in_proj_weight``, zero biases."""
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @property
    def dense_up_to(self) -> int:
        """Longest sequence computed as dense attention (its pattern would hold every block)."""
        return (self.num_global_blocks + self.num_window_blocks + self.num_random_blocks) * self.block_size

    @property
    def _score_scale(self) -> float:
        """``1 / sqrt(head_dim)``, the scale of the scores ``Q Kᵀ``."""
        return 1.0 / math.sqrt(self.head_dim)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, block_size={self.block_size}, "
                f"global={self.num_global_blocks}, window={self.num_window_blocks}, random={self.num_random_blocks}, "
                f"dropout={self.dropout}, seed={self.seed}, fixed_pattern={self.fixed_pattern}, "
                f"dense attention for L <= {self.dense_up_to}")

    def pattern(self, seq_len: int) -> BlockPattern:
        """The fixed (eval-mode) block pattern for ``seq_len`` tokens, drawn from ``seed``."""
        return self._masks.pattern(-(-checked_int("seq_len", seq_len, self.dense_up_to + 1) // self.block_size))

    def attention_mask(self, seq_len: int, key_padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Dense bool mask, True where a query may attend, of the eval-mode computation
        (without an ``attn_mask``): ``(1, 1, L, L)``, or ``(batch, 1, L, L)`` with a key
        padding mask. Quadratic in ``L``: for inspection and tests (e.g. as
        ``scaled_dot_product_attention``'s ``attn_mask``)."""
        if seq_len <= self.dense_up_to:
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool)
        else:
            s = self.block_size
            mask = self.pattern(seq_len).to_dense().repeat_interleave(s, 0).repeat_interleave(s, 1)
            mask = mask[:seq_len, :seq_len]
        if is_causal:
            mask = mask.tril()
        if key_padding_mask is None:
            return mask[None, None]
        padding = check_padding(key_padding_mask, key_padding_mask.shape[0] if key_padding_mask.dim() else 0,
                                seq_len, self.batch_first)
        return mask[None, None] & ~padding[:, None, None, :]

    def _project(self, query: Tensor, key: Tensor | None, value: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V as (batch, heads, L, head_dim)."""
        if key is None:
            q, k, v = nn.functional.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        else:
            w = self.in_proj_weight.chunk(3)
            b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
            q, k, v = (nn.functional.linear(x, w_, b_) for x, w_, b_ in zip((query, key, value), w, b))
        return tuple(rearrange(t, "b l (h d) -> b h l d", h=self.num_heads) for t in (q, k, v))

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, SparseTensor | None]:
        query, key, value = check_inputs(query, key, value, self.embed_dim, self.batch_first)
        q, k, v = self._project(query, key, value)
        out, weights = self._attend(q, k, v, key_padding_mask, need_weights, attn_mask, is_causal,
                                    bool(average_attn_weights))
        out = self.out_proj(rearrange(out, "b h l d -> b l (h d)"))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
               need_weights: bool = False, attn_mask: Tensor | None = None,
               is_causal: bool = False) -> tuple[Tensor, SparseTensor | None]:
        """The attention alone, on projected heads: ``q, k, v`` of shape
        ``(batch, heads, L, head_dim)`` -> ``(output of that shape, per-head weights or None)``;
        the masks as :meth:`forward` takes them."""
        return self._attend(q, k, v, key_padding_mask, need_weights, attn_mask, is_causal, False)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, need_weights: bool,
                attn_mask: Tensor | None, is_causal: bool, average: bool) -> tuple[Tensor, SparseTensor | None]:
        """:meth:`attend`, the weights averaged over heads if ``average``."""
        is_causal = check_heads(q, k, v, self.num_heads, is_causal)
        batch, _, length, _ = q.shape
        padding = None if key_padding_mask is None else check_padding(key_padding_mask, batch, length,
                                                                      self.batch_first)
        bias = None if attn_mask is None else attn_mask_bias(attn_mask, batch, self.num_heads, length, q.dtype,
                                                             self.batch_first)
        if length <= self.dense_up_to:
            if not self._warned_dense:
                warnings.warn(f"BlockSparseAttention: a sequence of {length} tokens (at most {self.dense_up_to}) "
                              f"has no sparse BigBird pattern; computing exact dense attention", stacklevel=3)
                self._warned_dense = True
            out, probs = dense_attention(q, k, v, padding, bias, is_causal, self._score_scale, self.dropout,
                                         self.training)
            return out, (from_dense(probs.mean(1) if average else probs, format="ddc" if average else "dddc")
                         if need_weights else None)
        return self._sparse(q, k, v, padding, bias, is_causal, need_weights, average)

    def _sparse(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None, bias: Tensor | None, is_causal: bool,
                need_weights: bool, average: bool) -> tuple[Tensor, SparseTensor | None]:
        """Block SDDMM, sparse softmax, dropout, block SpMM over the padded length, on the
        mask of :class:`BigBirdMasks`. An ``attn_mask`` (``bias``) or ``is_causal`` makes
        the mask's values an additive bias on its stored entries, the key padding included."""
        batch, _, length, _ = q.shape
        traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
        entries = bias is not None or is_causal
        if traced and entries:
            raise NotImplementedError(f"a traced BlockSparseAttention takes no attn_mask or is_causal on its sparse "
                                      f"path (sequences of more than {self.dense_up_to} tokens); call it eagerly")
        if traced and need_weights and average and padding is not None:
            raise NotImplementedError("a traced BlockSparseAttention with a key_padding_mask returns per-head weights "
                                      "only: pass average_attn_weights=False, or need_weights=False")
        uniform = padding is None  # every batch element stores as many blocks
        n = -(-length // self.block_size)
        extra = n * self.block_size - length
        if extra:
            q, k, v = (nn.functional.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
            tail = torch.ones(batch, extra, dtype=torch.bool)
            padding = torch.cat([torch.zeros(batch, length, dtype=torch.bool) if padding is None else padding, tail], 1)
            if bias is not None:
                bias = nn.functional.pad(bias, (0, extra, 0, extra))
        redrawn = self.training and not self.fixed_pattern
        if traced:
            if need_weights and extra:
                raise NotImplementedError("a traced BlockSparseAttention returns weights only for lengths that are "
                                          f"multiples of block_size ({self.block_size}), got {length}")
            mask, rows = self._masks.traced(n, batch, padding, q.dtype, redrawn), None
        else:
            mask, rows = self._masks.mask(n, batch, padding, bias, is_causal, q.dtype, redrawn)
        padded = padding is not None and not entries  # a key bias: -inf at padded keys
        key_bias = [torch.zeros(padding.shape, dtype=q.dtype).masked_fill_(padding, float("-inf"))] if padded else []
        out, probs = (None, None) if rows is not None else self._fused_output(q, k, v, key_bias, mask, padded,
                                                                              entries, need_weights)
        if out is None:
            probs = _probabilities(self._score_scale, padded, entries)(mask, q, k, *key_bias)
            if rows is not None:  # rows whose every key is masked: zero attention
                probs = probs.with_values(probs.values * rows)
            probs = probs.with_values(nn.functional.dropout(probs.values, self.dropout, self.training))
            out = einsum("bhij,bhjd->bhid", probs, v)
        out = out[:, :, :length]
        if not need_weights:
            return out, None
        if average:
            probs = head_mean(probs, bias is None or bias.shape[1] == 1, uniform)
        return out, (trimmed(probs, length) if extra else probs)

    def _fused_output(self, q: Tensor, k: Tensor, v: Tensor, bias: list[Tensor], mask: SparseTensor, padded: bool,
                      entries: bool, need_weights: bool) -> tuple[Tensor | None, SparseTensor | None]:
        """``(O, P or None)`` by :func:`_attention` when nothing needs ``P`` apart (no dropout,
        no gradient; while traced, no weights either), else ``(None, None)``; ``bias``: the
        key bias if ``padded``, as :func:`_probabilities` takes it."""
        if (need_weights and tracing()) or (self.training and self.dropout > 0.0) or (
                torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return None, None
        operands = [mask, q, k, *bias, v]
        result = _attention(self._score_scale, padded, entries, need_weights)(*operands)
        return result if need_weights else (result, None)
