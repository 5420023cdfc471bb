"""Packing coordinate lists into levels and unpacking levels into coordinates.

All conversions go through a sorted coordinate list: logical coordinates
``(rank, n)`` are mapped to storage coordinates ``(L, n)`` (one row per
storage level, block and in-block coordinates for blocked formats), sorted
lexicographically in storage order, and packed level by level. Every step is
a vectorised torch op; nothing loops over entries in Python.

A grouped level (``nm(n,m)``) gives every parent exactly ``n`` positions: the
entries under a parent plus, if fewer than ``n``, its smallest unused offsets
as explicit zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from sparsenn.formats.format import Format
from sparsenn.formats.level import Grouped
from sparsenn.formats.validate import choose_index_dtype

Duplicates = Literal["sum", "error"]


@dataclass(frozen=True)
class Packed:
    """Level arrays of a packed tensor (``values`` hold one entry per leaf position)."""

    pos: tuple[Tensor | None, ...]
    crd: tuple[Tensor | None, ...]
    values: Tensor
    index_dtype: torch.dtype


def storage_coords(fmt: Format, shape: tuple[int, ...], indices: Tensor) -> Tensor:
    """Map logical coordinates ``(rank, n)`` to storage coordinates ``(L, n)``."""
    rows = []
    for mode, _, inner in fmt.storage_levels(shape):
        coord = indices[mode]
        if fmt.block is not None:
            coord = coord % fmt.block[mode] if inner else coord // fmt.block[mode]
        rows.append(coord)
    return torch.stack(rows) if rows else indices.new_empty((0, indices.shape[1]))


def logical_coords(fmt: Format, shape: tuple[int, ...], keys: Tensor) -> Tensor:
    """Map storage coordinates ``(L, n)`` back to logical coordinates ``(rank, n)``."""
    indices = keys.new_zeros((fmt.rank, keys.shape[1]))
    for level, (mode, _, inner) in enumerate(fmt.storage_levels(shape)):
        if fmt.block is not None and not inner:
            indices[mode] += keys[level] * fmt.block[mode]
        else:
            indices[mode] += keys[level]
    return indices


def lexsort(keys: Tensor) -> Tensor:
    """Permutation sorting the columns of ``keys`` lexicographically (row 0 most significant)."""
    perm = torch.arange(keys.shape[1])
    for key in reversed(keys):
        perm = perm[torch.argsort(key[perm], stable=True)]
    return perm


def _run_starts(keys: Tensor) -> Tensor:
    """Boolean mask of columns that differ from the previous column (column 0 is a start)."""
    starts = torch.ones(keys.shape[1], dtype=torch.bool)
    starts[1:] = (keys[:, 1:] != keys[:, :-1]).any(dim=0)
    return starts


def pack(fmt: Format, shape: tuple[int, ...], indices: Tensor, values: Tensor,
         duplicates: Duplicates | None = None, index_dtype: torch.dtype | None = None) -> Packed:
    """Pack entries given by logical ``indices`` (rank, n) int64 and ``values`` (n,).

    ``duplicates=None`` promises unique coordinates; ``"sum"`` adds repeated
    coordinates, ``"error"`` rejects them. Positions of dense levels that no
    entry reaches hold explicit zeros.
    """
    keys = storage_coords(fmt, shape, indices)
    perm = lexsort(keys)
    keys, values = keys[:, perm], values[perm]
    if duplicates is not None and keys.shape[1] > 1:
        starts = _run_starts(keys)
        if not bool(starts.all()):
            if duplicates == "error":
                entry = int(torch.nonzero(~starts)[0])
                coord = tuple(indices[:, perm[entry]].tolist())
                raise ValueError(f"indices contain the duplicate coordinate {coord} "
                                 f"(entries {int(perm[entry - 1])} and {int(perm[entry])})")
            group = torch.cumsum(starts, 0) - 1
            keys = keys[:, starts]
            values = values.new_zeros(keys.shape[1]).index_add(0, group, values)
    pos, crd, leaf, counts = pack_levels(fmt, shape, keys)
    leaves = counts[-1] if counts else 1
    if leaves != keys.shape[1]:
        values = values.new_zeros(leaves).index_copy(0, leaf, values)
    dims = (*shape, *(size for _, size, _ in fmt.storage_levels(shape)), *counts)
    dtype = choose_index_dtype(dims, index_dtype)
    return Packed(tuple(None if p is None else p.to(dtype) for p in pos),
                  tuple(None if c is None else c.to(dtype) for c in crd), values, dtype)


def pack_levels(fmt: Format, shape: tuple[int, ...], keys: Tensor
                ) -> tuple[list[Tensor | None], list[Tensor | None], Tensor, list[int]]:
    """Build pos/crd (int64) of each level from sorted, unique storage coordinates.

    Returns ``(pos, crd, leaf, counts)``: ``leaf[k]`` is the position of entry
    ``k`` at the last level and ``counts[l]`` the number of positions of level ``l``.
    A grouped level holding more than ``count`` entries under one parent is a ValueError.
    """
    levels = fmt.levels
    sizes = [size for _, size, _ in fmt.storage_levels(shape)]
    n = keys.shape[1]
    parent = torch.zeros(n, dtype=torch.int64)
    parents = 1
    pos: list[Tensor | None] = [None] * len(levels)
    crd: list[Tensor | None] = [None] * len(levels)
    counts: list[int] = []
    for index, (level, size) in enumerate(zip(levels, sizes)):
        if level.locatable:
            parent = parent * size + keys[index]
            parents *= size
        elif level.has_pos:
            chain_end = index
            while not levels[chain_end].unique:
                chain_end += 1
            starts = _run_starts(torch.cat([parent[None], keys[index:chain_end + 1]]))
            pos[index] = torch.cat([torch.zeros(1, dtype=torch.int64),
                                    torch.bincount(parent[starts], minlength=parents).cumsum(0)])
            crd[index] = keys[index][starts]
            parent = torch.cumsum(starts, 0) - 1
            parents = int(starts.sum())
        elif isinstance(level, Grouped):
            crd[index], parent = _pack_grouped(fmt, shape, keys, parent, parents, size)
            parents *= level.count
        else:
            crd[index] = keys[index][_run_starts(parent[None])]
        counts.append(parents)
    return pos, crd, parent, counts


def _pack_grouped(fmt: Format, shape: tuple[int, ...], keys: Tensor, parent: Tensor, parents: int,
                  size: int) -> tuple[Tensor, Tensor]:
    """``(crd, leaf)`` of the last (grouped) level of an nm format.

    Parent ``p`` keeps the offsets ``keys[-1]`` of its entries plus its
    ``n - c_p`` smallest unused offsets; ``crd`` lists them sorted, ``p * n`` first.
    """
    n = fmt.levels[-1].count
    filled = torch.bincount(parent, minlength=parents)
    over = filled > n
    if bool(over.any()):
        group = int(torch.nonzero(over)[0])
        lead = tuple(keys[:fmt.rank, int(torch.searchsorted(parent, group))].tolist())
        where = "" if fmt.rank == 1 else f" of row {lead[0]}" if fmt.rank == 2 else f" at index {lead[:-1]}"
        first = lead[-1] * size
        raise ValueError(f"group {lead[-1]}{where} (last-dimension indices {first}..{first + size - 1} of "
                         f"shape {shape}) holds {int(filled[group])} entries, but {fmt} allows at most {n} "
                         f"per group of {size}")
    used = torch.zeros((parents, size), dtype=torch.bool)
    used[parent, keys[-1]] = True
    unused_rank = torch.cumsum(~used, dim=1, dtype=torch.int32)
    kept = used | (~used & (unused_rank <= (n - filled)[:, None]))
    crd = torch.nonzero(kept)[:, 1]
    leaf = torch.nonzero(used[kept]).squeeze(1)
    return crd, leaf


def unpack(fmt: Format, shape: tuple[int, ...], pos: tuple[Tensor | None, ...],
           crd: tuple[Tensor | None, ...]) -> Tensor:
    """Storage coordinates ``(L, P)`` (int64) of every position ``P`` of the last level."""
    keys = torch.zeros((0, 1), dtype=torch.int64)
    for index, (level, (_, size, _)) in enumerate(zip(fmt.levels, fmt.storage_levels(shape))):
        parents = keys.shape[1]
        if level.locatable:
            coord = torch.arange(size).repeat(parents)
            keys = keys.repeat_interleave(size, dim=1)
        elif level.has_pos:
            coord = crd[index].long()
            fiber = torch.diff(pos[index].long())
            keys = keys[:, torch.repeat_interleave(torch.arange(parents), fiber, output_size=len(coord))]
        else:
            coord = crd[index].long()
            keys = keys.repeat_interleave(len(coord) // parents if parents else 0, dim=1)
        keys = torch.cat([keys, coord[None]])
    return keys
