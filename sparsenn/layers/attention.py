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
* ``P = softmax(S)`` over stored entries, dropout on ``P``'s values (the scores and the
  softmax run as one fused kernel when their steps fuse: each block row's scores are
  computed, normalised and written once, ``compiler/runtime/fused.py``);
* ``O = P V`` (block SpMM), heads merged, ``out = O W_o + b_o``. Without dropout and
  without gradients (inference), the SpMM is one more step of the fused kernel: each
  block row's ``P`` is multiplied by ``V`` while still in cache.

Backward: softmax's gradient ``dS``, then ``dQ = dS K`` and ``dK = dSᵀ Q`` as compiled
products over the mask's pattern. A query row with no unpadded key in its blocks is
empty: its output is zero.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import has_static_value

from sparsenn.compiler import CompiledExpression, compile_expression, einsum
from sparsenn.compiler.program import stage
from sparsenn.compiler.runtime.fused import Result, Step, run_steps
from sparsenn.compiler.runtime.ops import register_kernels, traced_evaluate, tracing, transforming
from sparsenn.formats import Format, SparseTensor, from_coo, from_dense, parse_format
from sparsenn.functional import softmax, softmax_gradient, softmax_steps
from sparsenn.layers.arguments import checked_int

__all__ = ["BlockSparseAttention", "BlockPattern", "bigbird_pattern"]

@functools.lru_cache(maxsize=None)
def _scores(scale: float, padded: bool) -> CompiledExpression:
    """The scores on ``M``'s pattern (the mask read for its positions only), plus a key
    bias (``-inf`` at padded keys) in the same kernel when ``padded``. (Adding the bias in
    a second masked expression has a sampled gradient assembled element-wise and re-packed
    by a sort of every stored entry: 25 s at batch 64, L 1024.)"""
    bias = " + bias[b,j]" if padded else ""
    return compile_expression(f"S<M>[b,h,i,j] = {scale!r} * Q[b,h,i,d] * K[b,h,j,d]{bias}")


# The scores' gradients without the scale (dense results); built at import, as traced
# code calls existing compiled expressions.
_QUERY_GRADIENT = compile_expression("dQ[b,h,i,d] = dS[b,h,i,j] * K[b,h,j,d]", "dense")
_KEY_GRADIENT = compile_expression("dK[b,h,j,d] = dS[b,h,i,j] * Q[b,h,i,d]", "dense")
# The output's block SpMM as a step of the fused inference kernel.
_OUTPUT = compile_expression("O[b,h,i,d] = P[b,h,i,j] * V[b,h,j,d]", "dense")


def _mask_format(block_size: int) -> Format:
    """The attention mask's format: batch, heads and block rows dense, blocks compressed."""
    return parse_format(f"dddc(1,1,{block_size},{block_size})", 4)


def _step(expression: CompiledExpression, block_size: int, sources: tuple[int | Result, ...],
          on: int | None = None) -> Step:
    """``expression``'s one assignment when its operand 0 has the mask's format and the
    others are dense, as a step reading its operand ``n`` from ``sources[n]`` (values on
    the pattern of its operand ``on``, if given)."""
    formats = (_mask_format(block_size),) + (None,) * (len(expression.operand_names) - 1)
    (staged,) = stage(expression.statement, formats, None).stages
    operands = tuple(sources[source.n] for source in staged.inputs)
    return Step(staged.assignment, operands, on=None if on is None else operands.index(sources[on]))


@functools.lru_cache(maxsize=None)
def _probability_steps(scale: float, padded: bool, block_size: int) -> tuple[Step, ...]:
    """``P = softmax(S)`` of the scores :func:`_scores` over ``(M, Q, K[, bias])`` as fused
    steps: the scores' one assignment for these formats, then softmax's steps over its
    result, in place (:func:`sparsenn.functional.softmax_steps`)."""
    scores = _step(_scores(scale, padded), block_size, (0, 1, 2, 3), on=0)
    return softmax_steps(4, 3, scores)


register_kernels("attention", _probability_steps)


@functools.lru_cache(maxsize=None)
def _output_steps(scale: float, padded: bool, block_size: int) -> tuple[Step, ...]:
    """``O = P V`` over ``(M, Q, K[, bias], V)`` as fused steps: :func:`_probability_steps`,
    then the block SpMM of each block row of ``P`` (read in place) by ``V``."""
    probabilities = _probability_steps(scale, padded, block_size)
    return probabilities + (_step(_OUTPUT, block_size, (Result(len(probabilities) - 1), 4 if padded else 3)),)


register_kernels("attention_output", _output_steps)


class _Probabilities(torch.autograd.Function):
    """The values on ``M``'s pattern of ``P = softmax(S)``, ``S<M> = scale * Q Kᵀ (+ bias)``:
    one fused kernel (per block row: its scores, their maxima, exponentials, sums and
    scaling, while the row is in cache, written once) when the steps fuse, else the
    scores' and softmax's kernels; while traced, one ``sparsenn::evaluate`` op running the steps. Backward:
    softmax's gradient ``dS``, then ``dQ = scale * dS K`` and ``dK = scale * dSᵀ Q`` (the
    bias is a constant). Under ``torch.func.vmap``, once per batch element; forward mode
    (``jvp``) is not defined."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, bias: Tensor | None, mask_values: Tensor, mask: SparseTensor, scale: float,
                block_size: int) -> Tensor:
        padded = bias is not None
        mask = mask._share(mask.shape, mask.format, mask_values)  # a tensor input: torch.func unwraps it
        operands = [mask, q, k] + ([bias] if padded else [])
        if tracing():
            return traced_evaluate(None, operands, None, ("kernel", "attention", scale, padded, block_size)).values
        results = run_steps(_probability_steps(scale, padded, block_size), operands)
        return softmax(_scores(scale, padded)(*operands), -1).values if results is None else results[-1].values

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, _, _, mask, scale, _ = inputs
        ctx.save_for_backward(q, k, output)
        ctx.mask, ctx.scale = mask, scale

    @staticmethod
    def backward(ctx, d_values: Tensor):
        q, k, values = ctx.saved_tensors
        mask = ctx.mask
        d_scores = mask._share(mask.shape, mask.format, softmax_gradient(mask, 3, values, d_values))
        dq = _QUERY_GRADIENT(d_scores, k) * ctx.scale if ctx.needs_input_grad[0] else None
        dk = _KEY_GRADIENT(d_scores, q) * ctx.scale if ctx.needs_input_grad[1] else None
        return dq, dk, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q: Tensor, k: Tensor, bias: Tensor | None, mask_values: Tensor, mask: SparseTensor,
             scale: float, block_size: int):
        """Once per batch element (the mask's block format takes no batch level)."""
        def element(t: Tensor | None, dim: int | None, n: int) -> Tensor | None:
            return t if dim is None else t.select(dim, n)

        out = [_Probabilities.apply(element(q, in_dims[0], n), element(k, in_dims[1], n),
                                    element(bias, in_dims[2], n), element(mask_values, in_dims[3], n), mask, scale,
                                    block_size)
               for n in range(info.batch_size)]
        return torch.stack(out), 0


@dataclass(frozen=True)
class BlockPattern:
    """Block-level sparsity of attention: query block ``r`` attends to the key blocks
    ``cols[rows[r]:rows[r + 1]]`` (sorted, int64), for ``num_blocks`` blocks."""

    num_blocks: int
    rows: Tensor
    cols: Tensor

    @property
    def nnz(self) -> int:
        """Number of stored blocks."""
        return self.cols.numel()

    def to_dense(self) -> Tensor:
        """``(num_blocks, num_blocks)`` bool block mask (quadratic: for inspection and tests)."""
        mask = torch.zeros(self.num_blocks, self.num_blocks, dtype=torch.bool)
        row_of = torch.repeat_interleave(torch.arange(self.num_blocks), self.rows.diff())
        mask[row_of, self.cols] = True
        return mask


def _global_blocks(num_blocks: int, num_global: int) -> Tensor:
    """The first ``ceil(g / 2)`` and the last ``floor(g / 2)`` blocks (ITC: first and last)."""
    first = torch.arange((num_global + 1) // 2)
    return torch.cat([first, torch.arange(num_blocks - num_global // 2, num_blocks)])


def bigbird_pattern(num_blocks: int, num_global: int, num_window: int, num_random: int,
                    generator: torch.Generator) -> BlockPattern:
    """BigBird's block pattern in O(num_blocks · (g + w + r)) time and memory.

    Block row ``r`` holds the global blocks, the window ``r - w//2 .. r - w//2 + w - 1``
    (clipped) and ``num_random`` distinct blocks drawn uniformly from the rest (Floyd's
    sampling, vectorised over rows); a global block row holds every block. Requires
    ``num_blocks > g + w + r`` (else the pattern is dense)."""
    if num_blocks <= num_global + num_window + num_random:
        raise ValueError(f"{num_blocks} blocks are too few for a sparse pattern with {num_global} global, "
                         f"{num_window} window and {num_random} random blocks")
    n = num_blocks
    glob = _global_blocks(n, num_global)
    window = (torch.arange(n)[:, None] - num_window // 2 + torch.arange(num_window)).clamp(0, n - 1)
    fixed = torch.cat([glob.expand(n, -1), window], 1).sort(1).values
    duplicate = torch.cat([torch.zeros(n, 1, dtype=torch.bool), fixed[:, 1:] == fixed[:, :-1]], 1)
    fixed = fixed.masked_fill(duplicate, n)  # n: past every block, never counted as taken
    free = n - (fixed < n).sum(1)
    # Floyd: ranks among the free blocks, distinct per row, then mapped past the taken ones.
    ranks = torch.empty(n, num_random, dtype=torch.long)
    for t in range(num_random):
        top = free - num_random + t
        draw = (torch.rand(n, generator=generator, dtype=torch.float64) * (top + 1)).long().clamp(max=top)
        taken = (ranks[:, :t] == draw[:, None]).any(1)
        ranks[:, t] = torch.where(taken, top, draw)
    randoms = ranks
    for c in range(fixed.shape[1]):  # fixed is sorted: skip the taken blocks in increasing order
        randoms = randoms + (randoms >= fixed[:, c:c + 1]).long()
    row_cols = torch.cat([fixed, randoms], 1)
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[glob] = True
    keep = (row_cols < n) & ~is_global[:, None]
    keys = torch.cat([(torch.arange(n)[:, None] * n + row_cols)[keep],
                      (glob[:, None] * n + torch.arange(n)).flatten()]).sort().values
    counts = torch.bincount(keys // n, minlength=n)
    cols = keys % n
    return BlockPattern(n, torch.cat([counts.new_zeros(1), counts.cumsum(0)]), cols)


def _at_key_blocks(array: Tensor) -> tuple[Tensor | None, ...]:
    """Per storage level of ``dddc(1,1,s,s)``: ``array`` at the key-block level (3)."""
    return (None, None, None, array, None, None, None, None)


def block_mask(pattern: BlockPattern, batch: int, heads: int, block_size: int, padding: Tensor | None,
               dtype: torch.dtype) -> SparseTensor:
    """Ones on ``pattern`` for every (batch, head) as ``dddc(1,1,s,s)`` over the padded
    length; key blocks that are wholly padding (per batch element) left out."""
    n, s = pattern.num_blocks, block_size
    row_of = torch.repeat_interleave(torch.arange(n), pattern.rows.diff())
    if padding is None:
        cols = pattern.cols.repeat(batch * heads)
        counts = pattern.rows.diff().repeat(batch * heads)
    else:
        keep = ~padding.view(batch, n, s).all(2)[:, pattern.cols]  # (batch, stored blocks)
        cols = torch.cat([pattern.cols[keep[b]].repeat(heads) for b in range(batch)])
        per_row = torch.zeros(batch, n, dtype=torch.long).index_add_(1, row_of, keep.long())
        counts = per_row.repeat_interleave(heads, 0).flatten()
    index = _mask_index_dtype(batch, heads, n)
    pos = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(index)
    length = n * s
    return SparseTensor((batch, heads, length, length), f"dddc(1,1,{s},{s})", _at_key_blocks(pos),
                        _at_key_blocks(cols.to(index)), torch.ones(cols.numel() * s * s, dtype=dtype), check=False)


def _mask_index_dtype(batch: int, heads: int, num_blocks: int) -> torch.dtype:
    return torch.int32 if batch * heads * num_blocks * num_blocks < 2**31 else torch.int64


def _pattern_blocks(num_blocks: int, num_global: int, num_window: int, num_random: int) -> int:
    """Blocks :func:`bigbird_pattern` stores, whatever the random draw: every block in a
    global row, else the distinct global and window blocks plus ``num_random``."""
    glob = set(range((num_global + 1) // 2)) | set(range(num_blocks - num_global // 2, num_blocks))
    total = len(glob) * num_blocks
    for r in range(num_blocks):
        if r not in glob:
            window = {min(max(r - num_window // 2 + c, 0), num_blocks - 1) for c in range(num_window)}
            total += len(glob | window) + num_random
    return total


@torch.library.custom_op("sparsenn::bigbird_mask", mutates_args=())
def _bigbird_mask_op(num_blocks: int, num_global: int, num_window: int, num_random: int, seed: Tensor, batch: int,
                     heads: int, block_size: int, padding: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(pos, crd, values)`` of :func:`block_mask` of the pattern drawn from ``seed``,
    for a traced :class:`BlockSparseAttention`."""
    generator = torch.Generator().manual_seed(int(seed))
    pattern = bigbird_pattern(num_blocks, num_global, num_window, num_random, generator)
    mask = block_mask(pattern, batch, heads, block_size, padding, dtype)
    return mask.pos[3], mask.crd[3], mask.values


@_bigbird_mask_op.register_fake
def _(num_blocks: int, num_global: int, num_window: int, num_random: int, seed: Tensor, batch: int, heads: int,
      block_size: int, padding: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    if padding is None:  # every (batch, head) stores the whole pattern
        blocks = batch * heads * _pattern_blocks(num_blocks, num_global, num_window, num_random)
    else:  # wholly padded key blocks are left out
        blocks = torch.library.get_ctx().new_dynamic_size()
    index = _mask_index_dtype(batch, heads, num_blocks)
    return (seed.new_empty(batch * heads * num_blocks + 1, dtype=index), seed.new_empty(blocks, dtype=index),
            seed.new_empty(blocks * block_size * block_size, dtype=dtype))


@torch.compiler.assume_constant_result
def _bigbird_mask_constant(num_blocks: int, num_global: int, num_window: int, num_random: int, seed: int, batch: int,
                           heads: int, block_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsenn::bigbird_mask`` without padding, run once while tracing: the traced
    program keeps the arrays as constants, so every call hands the same ones on and the
    kernels find their plans, validations and re-stored copies cached (as eager mode
    keeps its last mask)."""
    return _bigbird_mask_op(num_blocks, num_global, num_window, num_random, torch.tensor(seed), batch, heads,
                            block_size, None, dtype)


class BlockSparseAttention(nn.Module):
    """Multi-head attention on BigBird's block-sparse pattern, shaped like
    ``nn.MultiheadAttention`` (same projection parameters: ``in_proj_weight``,
    ``in_proj_bias``, ``out_proj``).

    ``forward(query, key=None, value=None, key_padding_mask=None, need_weights=False)``:
    self-attention when key and value are omitted; key and value must have the query's
    length (the pattern is square). ``key_padding_mask``: bool ``(batch, L)``, True at
    keys to ignore. Returns ``(output, weights)``; ``weights`` is None, or with
    ``need_weights`` the attention probabilities after dropout, per head, as a
    ``(batch, heads, L, L)`` SparseTensor (blocked ``dddc(1,1,s,s)`` when ``L`` is a
    multiple of ``block_size``, else element-wise ``dddc`` trimmed to ``L``).

    The random blocks come from ``seed`` (drawn from torch's generator when None): the
    same pattern in eval mode, redrawn at every forward in training unless
    ``fixed_pattern``. A sequence of at most ``(g + w + r) · block_size`` tokens has no
    sparse pattern; it gets exact dense attention (with a one-time warning).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, block_size: int = 64, num_global_blocks: int = 2,
                 num_window_blocks: int = 3, num_random_blocks: int = 2, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = True, seed: int | None = None, fixed_pattern: bool = False) -> None:
        super().__init__()
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
        self.seed = int(torch.randint(2**62, ())) if seed is None else checked_int("seed", seed, 0)
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)
        self._training_generator = torch.Generator().manual_seed(self.seed)
        self._patterns: dict[int, BlockPattern] = {}
        self._mask_format = _mask_format(block_size)  # traced code reads it
        self._last_mask: tuple | None = None  # (pattern, batch, dtype, mask) of the last unpadded call
        self._warned_dense = False

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

    # ------------------------------------------------------------------ pattern
    def pattern(self, seq_len: int) -> BlockPattern:
        """The fixed (eval-mode) block pattern for ``seq_len`` tokens, drawn from ``seed``."""
        n = -(-checked_int("seq_len", seq_len, self.dense_up_to + 1) // self.block_size)
        if n not in self._patterns:
            generator = torch.Generator().manual_seed(self.seed)
            self._patterns[n] = bigbird_pattern(n, self.num_global_blocks, self.num_window_blocks,
                                                self.num_random_blocks, generator)
        return self._patterns[n]

    def _forward_pattern(self, seq_len: int) -> BlockPattern:
        """Redrawn in training (unless ``fixed_pattern``), else :meth:`pattern`."""
        if self.training and not self.fixed_pattern:
            n = -(-seq_len // self.block_size)
            return bigbird_pattern(n, self.num_global_blocks, self.num_window_blocks, self.num_random_blocks,
                                   self._training_generator)
        return self.pattern(seq_len)

    def attention_mask(self, seq_len: int, key_padding_mask: Tensor | None = None) -> Tensor:
        """Dense bool mask, True where a query may attend, of the eval-mode computation:
        ``(1, 1, L, L)``, or ``(batch, 1, L, L)`` with a key padding mask. Quadratic in
        ``L``: for inspection and tests (e.g. as ``scaled_dot_product_attention``'s
        ``attn_mask``)."""
        if seq_len <= self.dense_up_to:
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool)
        else:
            s = self.block_size
            mask = self.pattern(seq_len).to_dense().repeat_interleave(s, 0).repeat_interleave(s, 1)
            mask = mask[:seq_len, :seq_len]
        if key_padding_mask is None:
            return mask[None, None]
        padding = self._check_padding(key_padding_mask, key_padding_mask.shape[0] if key_padding_mask.dim() else 0,
                                      seq_len)
        return mask[None, None] & ~padding[:, None, None, :]

    def _mask_for(self, pattern: BlockPattern, batch: int, padding: Tensor | None, dtype: torch.dtype) -> SparseTensor:
        """:meth:`_mask`, kept from the last call without padding when the pattern (the
        eval-mode one, or a fixed one) and shapes repeat: the kernels then also find its
        index arrays' plans and re-stored copies cached."""
        if padding is not None or transforming():  # a transform's tensors must not outlive it
            return self._mask(pattern, batch, padding, dtype)
        last = self._last_mask
        if last is not None and last[0] is pattern and last[1:3] == (batch, dtype):
            return last[3]
        mask = self._mask(pattern, batch, None, dtype)
        self._last_mask = (pattern, batch, dtype, mask)
        return mask

    def _mask(self, pattern: BlockPattern, batch: int, padding: Tensor | None, dtype: torch.dtype) -> SparseTensor:
        """:func:`block_mask` of ``pattern`` for this layer's heads and blocks."""
        return block_mask(pattern, batch, self.num_heads, self.block_size, padding, dtype)

    def _traced_mask(self, length: int, batch: int, padding: Tensor | None, dtype: torch.dtype) -> SparseTensor:
        """The mask of :meth:`_mask_for` while traced: a ``sparsenn::bigbird_mask`` op
        drawing the pattern from ``seed`` per call (from a fresh seed when random blocks
        are redrawn in training), or, for a fixed pattern without padding at static sizes,
        constants computed once while tracing (:func:`_bigbird_mask_constant`; an
        exported program keeps the op)."""
        n = -(-length // self.block_size)
        config = (n, self.num_global_blocks, self.num_window_blocks, self.num_random_blocks)
        redrawn = self.training and not self.fixed_pattern
        static = all(not isinstance(k, Tensor) and has_static_value(k) for k in (n, batch))  # jit: sizes are tensors
        if not redrawn and padding is None and static and not torch.compiler.is_exporting():
            pos, crd, values = _bigbird_mask_constant(*(int(k) for k in config), self.seed, int(batch),
                                                      self.num_heads, self.block_size, dtype)
        else:
            seed = torch.randint(2**62, ()) if redrawn else torch.tensor(self.seed)
            pos, crd, values = torch.ops.sparsenn.bigbird_mask(*config, seed, batch, self.num_heads, self.block_size,
                                                               padding, dtype)
        length = n * self.block_size
        return SparseTensor((batch, self.num_heads, length, length), self._mask_format, _at_key_blocks(pos),
                            _at_key_blocks(crd), values, check=False)

    # ------------------------------------------------------------------ forward
    def _check_padding(self, key_padding_mask: object, batch: int, seq_len: int) -> Tensor:
        """The (batch, L) bool key padding mask (TypeError/ValueError otherwise)."""
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = ignore the key), "
                            f"got dtype {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (batch, seq_len):
            raise ValueError(f"key_padding_mask must have shape (batch, L) = {(batch, seq_len)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        return key_padding_mask

    def _check_input(self, name: str, x: object) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            layout = "(batch, L, embed_dim)" if self.batch_first else "(L, batch, embed_dim)"
            raise ValueError(f"{name} must have shape {layout} with embed_dim={self.embed_dim}, "
                             f"got {tuple(x.shape)}")
        return x if self.batch_first else x.transpose(0, 1)

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
                key_padding_mask: Tensor | None = None,
                need_weights: bool = False) -> tuple[Tensor, SparseTensor | None]:
        query = self._check_input("query", query)
        if (key is None) != (value is None):
            raise ValueError("give both key and value, or neither (self-attention)")
        if key is not None:
            key, value = self._check_input("key", key), self._check_input("value", value)
            if key.shape[:2] != value.shape[:2]:
                raise ValueError(f"key and value must have the same batch and length, got key "
                                 f"{tuple(key.shape)} and value {tuple(value.shape)}")
            if key.shape[:2] != query.shape[:2]:
                raise ValueError(f"key and value must have the query's batch and length (BigBird's pattern "
                                 f"is square), got query {tuple(query.shape)} and key {tuple(key.shape)}")
        out, weights = self.attend(*self._project(query, key, value), key_padding_mask, need_weights)
        out = self.out_proj(rearrange(out, "b h l d -> b l (h d)"))
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None,
               need_weights: bool = False) -> tuple[Tensor, SparseTensor | None]:
        """The attention alone, on projected heads: ``q, k, v`` of shape
        ``(batch, heads, L, head_dim)`` -> ``(output of that shape, weights or None)``."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape != q.shape or t.shape[1] != self.num_heads:
                raise ValueError(f"q, k and v must be tensors of one shape (batch, {self.num_heads}, L, head_dim); "
                                 f"{name} is {tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        batch, _, length, _ = q.shape
        padding = None if key_padding_mask is None else self._check_padding(key_padding_mask, batch, length)
        if length <= self.dense_up_to:
            return self._dense(q, k, v, padding, need_weights)
        return self._sparse(q, k, v, padding, need_weights)

    def _sparse(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None,
                need_weights: bool) -> tuple[Tensor, SparseTensor | None]:
        """Block SDDMM, sparse softmax, dropout, block SpMM over the padded length."""
        batch, _, length, _ = q.shape
        traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
        extra = -(-length // self.block_size) * self.block_size - length
        if extra:
            q, k, v = (nn.functional.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
            tail = torch.ones(batch, extra, dtype=torch.bool)
            padding = torch.cat([torch.zeros(batch, length, dtype=torch.bool) if padding is None else padding, tail], 1)
        if traced:
            if need_weights and extra:
                raise NotImplementedError("a traced BlockSparseAttention returns weights only for lengths that are "
                                          f"multiples of block_size ({self.block_size}), got {length}")
            mask = self._traced_mask(length, batch, padding, q.dtype)
        else:
            mask = self._mask_for(self._forward_pattern(length), batch, padding, q.dtype)
        bias = None
        if padding is not None:
            bias = torch.zeros(padding.shape, dtype=q.dtype).masked_fill_(padding, float("-inf"))
        out, probs = self._fused_output(q, k, v, bias, mask, need_weights, traced)
        if out is None:
            probs = mask.with_values(
                _Probabilities.apply(q, k, bias, mask.values, mask, self._score_scale, self.block_size))
            probs = probs.with_values(nn.functional.dropout(probs.values, self.dropout, self.training))
            out = einsum("bhij,bhjd->bhid", probs, v)
        out = out[:, :, :length]
        if not need_weights:
            return out, None
        if not extra:
            return out, probs
        indices, values = probs.coords()
        inside = (indices[2] < length) & (indices[3] < length)
        return out, from_coo(indices[:, inside], values[inside], (batch, self.num_heads, length, length),
                             format="dddc")

    def _fused_output(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: SparseTensor,
                      need_weights: bool, traced: bool) -> tuple[Tensor | None, SparseTensor | None]:
        """``(O, P)`` by the fused kernel of :func:`_output_steps` when nothing needs ``P``
        apart (no dropout, no gradient; while traced, no weights either), else ``(None, None)``."""
        if (self.training and self.dropout > 0.0) or (
                torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return None, None
        operands = [mask, q, k] + ([] if bias is None else [bias]) + [v]
        key = (self._score_scale, bias is not None, self.block_size)
        if traced:
            if need_weights:
                return None, None
            return traced_evaluate(None, operands, None, ("kernel", "attention_output", *key)), None
        results = run_steps(_output_steps(*key), operands)
        return (None, None) if results is None else (results[-1], results[-2])

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None,
               need_weights: bool) -> tuple[Tensor, SparseTensor | None]:
        """Exact dense attention, for sequences too short for a sparse pattern; a row with
        no unpadded key gives zero, as in the sparse path."""
        if not self._warned_dense:
            warnings.warn(f"BlockSparseAttention: a sequence of {q.shape[2]} tokens (at most {self.dense_up_to}) "
                          f"has no sparse BigBird pattern; computing exact dense attention", stacklevel=4)
            self._warned_dense = True
        scores = (q * self._score_scale) @ k.transpose(-1, -2)
        if padding is not None:
            scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, -1)
        if padding is not None:
            probs = probs.masked_fill(padding.all(1)[:, None, None, None], 0.0)
        probs = nn.functional.dropout(probs, self.dropout, self.training)
        return probs @ v, (from_dense(probs, format="dddc") if need_weights else None)
