"""BigBird's block patterns (Zaheer et al. 2020, ITC variant) and the attention masks
built from them for :class:`~sparsenn.layers.attention.BlockSparseAttention`.

* :func:`bigbird_pattern`: each block row holds the global blocks, a window around it
  and random blocks drawn from a generator; global block rows hold every block;
* :func:`block_mask`: a blocked ``(batch, H, L', L')`` pattern of ones in
  ``dddc(1,1,s,s)``, wholly padded key blocks left out, its values views of one buffer
  of ones (:func:`shared_ones`); :func:`entry_mask`: the same with
  an additive bias on each stored entry (an ``attn_mask``, the causal diagonal blocks,
  padded keys), and the rows with no allowed key;
* ``sparsenn::bigbird_mask``: the mask drawn from a seed, as a traced module builds it;
* :class:`BigBirdMasks`: a layer's patterns (fixed, or redrawn in training) and the
  mask of each call, the last one kept for the next call that can reuse it;
* :func:`head_mean`: per-head attention weights averaged over heads; :func:`trimmed`:
  weights over the padded length cut to the sequence's.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import has_static_value

from sparsenn.compiler import einsum
from sparsenn.compiler.runtime.tracing import transforming
from sparsenn.formats import Format, SparseTensor, from_coo, parse_format

__all__ = ["BlockPattern", "bigbird_pattern", "causal_pattern", "block_mask", "entry_mask", "mask_format",
           "head_mean", "bigbird_mask_constant", "at_key_blocks", "shared_ones", "BigBirdMasks",
           "trimmed"]


def mask_format(block_size: int) -> Format:
    """The attention mask's format: batch, heads and block rows dense, blocks compressed."""
    return parse_format(f"dddc(1,1,{block_size},{block_size})", 4)


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


def at_key_blocks(array: Tensor) -> tuple[Tensor | None, ...]:
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
        stored = pattern.cols.numel()
        cols = pattern.cols.expand(batch, heads, stored)[keep[:, None].expand(batch, heads, stored)]
        per_row = torch.zeros(batch, n, dtype=torch.long).index_add_(1, row_of, keep.long())
        counts = per_row.repeat_interleave(heads, 0).flatten()
    index = _mask_index_dtype(batch, heads, n)
    pos = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(index)
    length = n * s
    return SparseTensor((batch, heads, length, length), f"dddc(1,1,{s},{s})", at_key_blocks(pos),
                        at_key_blocks(cols.to(index)), shared_ones(cols.numel() * s * s, dtype), check=False)


_ones: dict[torch.dtype, weakref.ref] = {}  # dtype -> the buffer of shared_ones
_ones_lock = threading.Lock()


def shared_ones(n: int, dtype: torch.dtype) -> Tensor:
    """``n`` ones of ``dtype``, as a view of one buffer per dtype (kept while a view of it
    lives, replaced by a longer one when too short): a mask's values, which nothing
    writes, cost no fill and no fresh pages per call. Never write into the result. While
    traced, fresh ones."""
    if torch.compiler.is_compiling():
        return torch.ones(n, dtype=dtype)
    with _ones_lock, torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
        buffer = _ones[dtype]() if dtype in _ones else None
        if buffer is None or buffer.numel() < n:
            buffer = torch.ones(n, dtype=dtype)
            _ones[dtype] = weakref.ref(buffer)
        return buffer[:n]


def causal_pattern(pattern: BlockPattern) -> BlockPattern:
    """``pattern`` without its blocks above the diagonal (key block after the query block)."""
    n = pattern.num_blocks
    row_of = torch.repeat_interleave(torch.arange(n), pattern.rows.diff())
    keep = pattern.cols <= row_of
    counts = torch.bincount(row_of[keep], minlength=n)
    return BlockPattern(n, torch.cat([counts.new_zeros(1), counts.cumsum(0)]), pattern.cols[keep])


def entry_mask(pattern: BlockPattern, batch: int, heads: int, block_size: int, padding: Tensor | None,
               bias: Tensor | None, causal: bool, dtype: torch.dtype) -> tuple[SparseTensor, Tensor | None]:
    """``pattern`` for every (batch, head) as ``dddc(1,1,s,s)`` over the padded length
    ``L'``, its values an additive bias on each stored entry: ``bias`` (``(batch or 1,
    heads or 1, L', L')``, read at the stored entries only), ``-inf`` above the diagonal of
    the diagonal blocks when ``causal``, ``-inf`` at padded keys. A block whose every
    entry is ``-inf`` (for that batch element and head) is left out. O(stored entries).

    With the mask, the rows to keep: None, or where a query row has stored entries that
    are all ``-inf`` (its softmax would be NaN), 0 on its entries and 1 elsewhere (that
    row's bias is then 0, and its probabilities are to be multiplied by 0)."""
    n, s = pattern.num_blocks, block_size
    row_of = torch.repeat_interleave(torch.arange(n), pattern.rows.diff())
    cols = pattern.cols
    stored = cols.numel()
    values = torch.zeros(1, 1, stored, s, s, dtype=dtype)
    if bias is not None:
        values = values + bias.reshape(*bias.shape[:2], n, s, n, s).transpose(3, 4)[:, :, row_of, cols]
    if causal:
        above = (row_of == cols)[:, None, None] & torch.ones(s, s, dtype=torch.bool).triu(1)
        values = torch.where(above, float("-inf"), values)
    if padding is not None:
        values = torch.where(padding.view(batch, n, s)[:, None, cols, None, :], float("-inf"), values)
    allowed = ~torch.isneginf(values)  # (batch or 1, heads or 1, stored, s, s)
    keep = allowed.flatten(3).any(3).expand(batch, heads, stored)
    # A stored row with no allowed key (in any block of its block row): its softmax would be NaN.
    open_rows = torch.zeros(*allowed.shape[:2], n, s, dtype=torch.long).index_add_(2, row_of, allowed.any(4).long())
    closed = (open_rows == 0)[:, :, row_of, :, None]  # (batch or 1, heads or 1, stored, s, 1)
    rows = None
    if bool(closed.any()):
        values = values.masked_fill(closed, 0.0)
        rows = (~closed).to(dtype).expand(batch, heads, stored, s, s)[keep].flatten()
    counts = torch.zeros(batch, heads, n, dtype=torch.long).index_add_(2, row_of, keep.long())
    index = _mask_index_dtype(batch, heads, n)
    pos = torch.cat([counts.new_zeros(1), counts.flatten().cumsum(0)]).to(index)
    crd = cols.expand(batch, heads, stored)[keep].to(index)
    length = n * s
    mask = SparseTensor((batch, heads, length, length), f"dddc(1,1,{s},{s})", at_key_blocks(pos),
                        at_key_blocks(crd), values.expand(batch, heads, stored, s, s)[keep].flatten(), check=False)
    return mask, rows


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
    return mask.pos[3], mask.crd[3], mask.values.clone()  # an op's outputs are its own


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
def bigbird_mask_constant(num_blocks: int, num_global: int, num_window: int, num_random: int, seed: int, batch: int,
                           heads: int, block_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsenn::bigbird_mask`` without padding, run once while tracing: the traced
    program keeps the arrays as constants, so every call hands the same ones on and the
    kernels find their plans, validations and re-stored copies cached (as eager mode
    keeps its last mask)."""
    return _bigbird_mask_op(num_blocks, num_global, num_window, num_random, torch.tensor(seed), batch, heads,
                            block_size, None, dtype)


class BigBirdMasks:
    """The patterns and masks of a layer with ``heads`` heads and blocks of ``block_size``:
    the eval-mode pattern per number of blocks, drawn from ``seed``; patterns redrawn in
    training from a generator seeded by ``seed``; the causal part of the last pattern; the
    last mask, kept while its pattern, shapes and wholly padded key blocks (which decide
    the stored blocks) repeat, so that the kernels also find its index arrays' plans and
    re-stored copies cached."""

    def __init__(self, heads: int, block_size: int, num_global: int, num_window: int, num_random: int,
                 seed: int) -> None:
        self.heads, self.block_size, self.seed = heads, block_size, seed
        self.config = (num_global, num_window, num_random)
        self.format = mask_format(block_size)  # traced code reads it
        self._generator = torch.Generator().manual_seed(seed)
        self._patterns: dict[int, BlockPattern] = {}
        self._causal: tuple[BlockPattern, BlockPattern] | None = None  # (a pattern, its causal part)
        self._last: tuple | None = None  # (pattern, batch, dtype, causal, padded key blocks, mask)

    def pattern(self, num_blocks: int) -> BlockPattern:
        """The eval-mode pattern of ``num_blocks`` blocks, drawn from ``seed``."""
        if num_blocks not in self._patterns:
            generator = torch.Generator().manual_seed(self.seed)
            self._patterns[num_blocks] = bigbird_pattern(num_blocks, *self.config, generator)
        return self._patterns[num_blocks]

    def _call_pattern(self, num_blocks: int, redrawn: bool, causal: bool) -> BlockPattern:
        """A redrawn pattern or :meth:`pattern`; without the blocks above the diagonal if
        ``causal`` (kept for the last pattern)."""
        pattern = bigbird_pattern(num_blocks, *self.config, self._generator) if redrawn else self.pattern(num_blocks)
        if not causal:
            return pattern
        if self._causal is None or self._causal[0] is not pattern:
            self._causal = (pattern, causal_pattern(pattern))
        return self._causal[1]

    def mask(self, num_blocks: int, batch: int, padding: Tensor | None, bias: Tensor | None, causal: bool,
             dtype: torch.dtype, redrawn: bool) -> tuple[SparseTensor, Tensor | None]:
        """The mask of an eager call over ``num_blocks`` blocks and the rows to keep, as
        :func:`entry_mask` gives them: an :func:`entry_mask` with an ``attn_mask``
        ``bias`` or with ``padding`` and ``causal``; else a :func:`block_mask` (causal:
        the diagonal blocks' element mask as the values), kept for the next call."""
        pattern = self._call_pattern(num_blocks, redrawn, causal)
        if bias is not None or (causal and padding is not None):
            return entry_mask(pattern, batch, self.heads, self.block_size, padding, bias, causal, dtype)
        padded = None if padding is None else padding.view(batch, num_blocks, self.block_size).all(2)
        last = self._last
        if (last is not None and last[0] is pattern and last[1:4] == (batch, dtype, causal)
                and (last[4] is None) == (padded is None) and (padded is None or torch.equal(last[4], padded))):
            return last[5], None
        if causal:  # without padding, every row keeps its diagonal: no closed rows
            mask = entry_mask(pattern, batch, self.heads, self.block_size, None, None, True, dtype)[0]
        else:
            mask = block_mask(pattern, batch, self.heads, self.block_size, padding, dtype)
        if not transforming():  # a torch.func transform's tensors must not outlive it
            self._last = (pattern, batch, dtype, causal, padded, mask)
        return mask, None

    def traced(self, num_blocks: int, batch: int, padding: Tensor | None, dtype: torch.dtype,
               redrawn: bool) -> SparseTensor:
        """The mask while traced: a ``sparsenn::bigbird_mask`` op drawing the pattern from
        ``seed`` per call (from a fresh seed when ``redrawn``), or, for a fixed pattern
        without padding at static sizes, constants computed once while tracing
        (:func:`bigbird_mask_constant`; an exported program keeps the op)."""
        config = (num_blocks, *self.config)
        static = all(not isinstance(k, Tensor) and has_static_value(k) for k in (num_blocks, batch))  # jit: tensors
        if not redrawn and padding is None and static and not torch.compiler.is_exporting():
            pos, crd, values = bigbird_mask_constant(*(int(k) for k in config), self.seed, int(batch), self.heads,
                                                     self.block_size, dtype)
        else:
            seed = torch.randint(2**62, ()) if redrawn else torch.tensor(self.seed)
            pos, crd, values = torch.ops.sparsenn.bigbird_mask(*config, seed, batch, self.heads, self.block_size,
                                                               padding, dtype)
        length = num_blocks * self.block_size
        return SparseTensor((batch, self.heads, length, length), self.format, at_key_blocks(pos), at_key_blocks(crd),
                            values, check=False)


def head_mean(weights: SparseTensor, shared: bool, uniform: bool) -> SparseTensor:
    """``(batch, L', L')`` mean over heads of ``(batch, heads, L', L')`` blocked attention
    weights, when the heads ``shared`` one pattern: their values' mean, O(stored entries)
    (by views when every batch element stores as many blocks, ``uniform``); else the
    compiled sum over heads, divided."""
    batch, heads = weights.shape[:2]
    if not shared:
        total = einsum("bhij->bij", weights)
        return total.with_values(total.values / heads)
    s = weights.format.block[-1]
    pos, crd = weights.pos[3], weights.crd[3]
    counts = pos.diff().view(batch, heads, -1)  # stored blocks per (batch, head, block row)
    if uniform:
        first_crd, mean = crd.view(batch, heads, -1)[:, 0].flatten(), weights.values.view(batch, heads, -1).mean(1)
    else:
        per_head = counts[:, 0].sum(1)  # stored blocks of each head of a batch element
        starts = torch.cat([per_head.new_zeros(1), (per_head * heads).cumsum(0)[:-1]])
        offsets = torch.cat([per_head.new_zeros(1), per_head.cumsum(0)[:-1]])
        total = int(per_head.sum())
        first = torch.repeat_interleave(starts - offsets, per_head, output_size=total) + torch.arange(total)
        stride = torch.repeat_interleave(per_head, per_head, output_size=total)  # to the next head's block
        blocks = weights.values.view(-1, s * s)
        first_crd, mean = crd[first], sum(blocks[first + h * stride] for h in range(heads)) / heads
    return SparseTensor((batch,) + weights.shape[2:], f"ddc(1,{s},{s})",
                        (None, None, torch.cat([pos.new_zeros(1), counts[:, 0].flatten().cumsum(0).to(pos.dtype)]),
                         None, None, None),
                        (None, None, first_crd, None, None, None), mean.flatten(), check=False)


def trimmed(weights: SparseTensor, length: int) -> SparseTensor:
    """Attention weights over the padded length ``L'``, element-wise ``d…dc`` trimmed to
    ``(…, length, length)``."""
    indices, values = weights.coords()
    inside = (indices[-2] < length) & (indices[-1] < length)
    return from_coo(indices[:, inside], values[inside], weights.shape[:-2] + (length, length),
                    format="d" * (weights.ndim - 1) + "c")
