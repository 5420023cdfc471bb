"""Selections and combinations of SparseTensors along the first dimension: ``S[i]``,
``S[a:b:c]``, :func:`cat` and :func:`stack`.

Each re-packs exactly the stored entries it keeps (explicit zeros included, nothing added
but the padding a format itself stores) through the sorted-coordinate path of
:mod:`~sparsenn.formats.pack`: vectorised, O(nnz log nnz), differentiable with respect to
``values`` (a gather). Formats stay in their family:

* ``S[a:b:c]`` and ``cat`` keep the format; a blocked format needs whole block rows
  (``c == 1`` and ``a``, ``b`` multiples of the block height, unless it is 1).
* ``S[i]`` drops the storage level of mode 0 (csr -> ``c``, coo -> coo, csf -> dcsr,
  ``nm(n,m)`` -> ``nm(n,m)``); when that level was sparse, the dense levels left are
  compressed, so the row stores only its entries (csc -> ``c``). Blocked formats need
  a block height of 1.
* ``stack`` adds a dense level for the new first mode (csr -> ``ddc``, a batch of CSR
  matrices; ``bsr(bh,bw)`` -> ``ddc(1,bh,bw)``; ``nm(n,m)`` -> ``nm(n,m)``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparsenn.formats.format import Format
from sparsenn.formats.level import Compressed, Dense, Singleton
from sparsenn.formats.pack import pack

if TYPE_CHECKING:
    from sparsenn.formats.tensor import SparseTensor

__all__ = ["select", "cat", "stack"]


def _repack(like: SparseTensor, fmt: Format, shape: tuple[int, ...], indices: Tensor, values: Tensor,
            wide: bool) -> SparseTensor:
    """A tensor of ``fmt`` holding these unique entries (int64 indices if ``wide``)."""
    packed = pack(fmt, shape, indices, values, index_dtype=torch.int64 if wide else None)
    return type(like)(shape, fmt, packed.pos, packed.crd, packed.values, check=False,
                      index_dtype=packed.index_dtype)


def _block_height(fmt: Format) -> int:
    return 1 if fmt.block is None else fmt.block[0]


def row_format(fmt: Format) -> Format:
    """The format of ``S[i]`` for ``S`` of format ``fmt`` (see the module doc)."""
    rank = fmt.rank
    if _block_height(fmt) != 1:
        raise ValueError(f"S[i] would cut the blocks of {fmt} (block height {fmt.block[0]}); take whole block "
                         f"rows with S[a:b] or convert with asformat first")
    removed = fmt.mode_order.index(0)
    sparse_removed = not fmt.levels[removed].full
    outer = []
    for index, level in enumerate(fmt.levels[:rank]):
        if index == removed:
            continue
        if (isinstance(level, Singleton) and not outer) or (sparse_removed and isinstance(level, Dense)):
            level = Compressed()
        outer.append(level)
    inner = fmt.levels[rank + 1:] if fmt.block is not None else ()
    mode_order = tuple(m - 1 for m in fmt.mode_order if m != 0)
    return Format(tuple(outer) + tuple(inner), mode_order, None if fmt.block is None else fmt.block[1:])


def select(tensor: SparseTensor, key: object) -> SparseTensor:
    """``tensor[key]`` for an int or a slice along the first dimension."""
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    if tensor.ndim == 0:
        raise IndexError("a rank-0 SparseTensor cannot be indexed")
    n = tensor.shape[0]
    indices, values = tensor.coords()
    rows = indices[0]
    wide = tensor.index_dtype == torch.int64
    if isinstance(key, slice):
        start, stop, step = key.indices(n)
        chosen = torch.arange(start, stop, step)
        height = _block_height(tensor.format)
        if height != 1 and chosen.numel() and (step != 1 or start % height or stop % height):
            raise ValueError(f"slice {start}:{stop}:{step} cuts the blocks of {tensor.format}: rows must be taken in "
                             f"whole blocks (step 1, start and stop multiples of {height})")
        lookup = torch.full((n,), -1, dtype=torch.int64)
        lookup[chosen] = torch.arange(chosen.numel())
        new_rows = lookup[rows]
        kept = new_rows >= 0
        kept_indices = torch.cat([new_rows[kept][None], indices[1:, kept]])
        shape = (chosen.numel(), *tensor.shape[1:])
        return _repack(tensor, tensor.format, shape, kept_indices, values[kept], wide)
    if isinstance(key, bool) or not hasattr(type(key), "__index__"):
        raise TypeError(f"SparseTensor indexing takes an int or a slice along the first dimension, got "
                        f"{type(key).__name__}")
    index = operator.index(key)
    if not -n <= index < n:
        raise IndexError(f"index {index} is out of range for dimension 0 of size {n}")
    if tensor.ndim == 1:
        raise ValueError("S[i] of a rank-1 SparseTensor would be a scalar; use S.to_dense()[i]")
    fmt = row_format(tensor.format)
    kept = rows == index % n
    return _repack(tensor, fmt, tensor.shape[1:], indices[1:, kept], values[kept], wide)


def _check_same(tensors: Sequence[SparseTensor], name: str, same_shape: bool) -> None:
    from sparsenn.formats.tensor import SparseTensor

    if isinstance(tensors, SparseTensor) or not isinstance(tensors, Sequence) or not tensors:
        raise TypeError(f"{name} takes a non-empty sequence of SparseTensors")
    first = tensors[0]
    for k, t in enumerate(tensors):
        if not isinstance(t, SparseTensor):
            raise TypeError(f"{name}: tensors[{k}] is a {type(t).__name__}, not a SparseTensor")
        if t.format != first.format:
            raise ValueError(f"{name}: tensors[{k}] has format {t.format}, tensors[0] {first.format}; convert them "
                             "with asformat first")
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: tensors[{k}] has dtype {t.dtype}, tensors[0] {first.dtype}")
        if (t.shape if same_shape else t.shape[1:]) != (first.shape if same_shape else first.shape[1:]):
            what = "shape" if same_shape else "shape after dimension 0"
            raise ValueError(f"{name}: tensors[{k}] has shape {t.shape}, tensors[0] {first.shape} (the {what} "
                             "must match)")


def cat(tensors: Sequence[SparseTensor]) -> SparseTensor:
    """The SparseTensors concatenated along the first dimension, in their common format."""
    _check_same(tensors, "cat", same_shape=False)
    if tensors[0].ndim == 0:
        raise ValueError("cat: rank-0 SparseTensors have no dimension to concatenate; use stack")
    parts, offset = [], 0
    for t in tensors:
        indices, values = t.coords()
        parts.append((torch.cat([indices[:1] + offset, indices[1:]]), values))
        offset += t.shape[0]
    shape = (offset, *tensors[0].shape[1:])
    wide = any(t.index_dtype == torch.int64 for t in tensors)
    return _repack(tensors[0], tensors[0].format, shape, torch.cat([i for i, _ in parts], 1),
                   torch.cat([v for _, v in parts]), wide)


def batch_format(fmt: Format) -> Format:
    """The format of ``stack`` of tensors of format ``fmt``: a dense level for the new mode 0."""
    rank = fmt.rank
    mode_order = (0,) + tuple(m + 1 for m in fmt.mode_order)
    if fmt.block is None:
        return Format((Dense(),) + fmt.levels, mode_order)
    levels = (Dense(),) + fmt.levels[:rank] + (Dense(),) + fmt.levels[rank:]
    return Format(levels, mode_order, (1,) + fmt.block)


def stack(tensors: Sequence[SparseTensor]) -> SparseTensor:
    """The SparseTensors (one format, shape and dtype) stacked along a new first dimension."""
    _check_same(tensors, "stack", same_shape=True)
    parts = []
    for k, t in enumerate(tensors):
        indices, values = t.coords()
        parts.append((torch.cat([indices.new_full((1, indices.shape[1]), k), indices]), values))
    shape = (len(tensors), *tensors[0].shape)
    wide = any(t.index_dtype == torch.int64 for t in tensors)
    return _repack(tensors[0], batch_format(tensors[0].format), shape, torch.cat([i for i, _ in parts], 1),
                   torch.cat([v for _, v in parts]), wide)
