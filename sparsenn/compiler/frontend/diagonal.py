"""Operands through diagonals and dropped size-1 modes, for torch's einsum grammar.

``view(op, groups)`` is the tensor ``V`` whose mode ``k`` walks the modes ``groups[k]``
of ``op`` together: ``V[i_0, .., i_{K-1}] = op[c]`` with ``c_m = i_k`` for every ``m``
in ``groups[k]``. Modes in no group must have size 1 and are read at coordinate 0
(dropped). So ``T[i,i] -> V[i]`` is ``groups = ((0, 1),)`` and a broadcast ``T[i,0]``
is ``groups = ((0,),)``.

* dense operand: a strided view; mode ``k`` has the sum of the strides of ``groups[k]``;
* sparse operand: the stored entries whose coordinates agree within every group, packed
  in a format derived from the operand's (:func:`view_format`), values gathered from
  ``op.values`` so gradients reach them. A view whose levels would all be dense is
  returned as a dense tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.level import Compressed, Dense, Level
from sparsenn.formats.pack import pack

__all__ = ["Groups", "view", "view_format"]

Groups = tuple[tuple[int, ...], ...]


def view(op: Tensor | SparseTensor, groups: Groups) -> Tensor | SparseTensor:
    """``op`` through ``groups`` (see the module docstring); sizes within a group must agree."""
    if isinstance(op, SparseTensor):
        return _dense_view(op.to_dense(), groups) if op.format.is_dense else _sparse_view(op, groups)
    return _dense_view(op, groups)


def _dense_view(t: Tensor, groups: Groups) -> Tensor:
    sizes = [t.shape[g[0]] for g in groups]
    strides = [sum(t.stride(m) for m in g) for g in groups]
    return t.as_strided(sizes, strides, t.storage_offset())


def view_format(fmt: Format, groups: Groups) -> Format | None:
    """The format of a sparse view: the levels of the kept modes in their storage order.

    A group sits at the storage level of its first-stored mode; it is dense when all its
    modes' levels are full, else that level's kind (compressed if it was full). A
    branchless level (a singleton) left without a coordinate-carrying level above it
    becomes compressed. None when every level is full (the view is stored densely)."""
    level_of = {mode: level for level, mode in enumerate(fmt.mode_order)}
    placed = []
    for k, group in enumerate(groups):
        levels = sorted(level_of[m] for m in group)
        first = fmt.levels[levels[0]]
        if all(fmt.levels[level].full for level in levels):
            kind: Level = Dense()
        else:
            kind = Compressed() if first.full else type(first)()
        placed.append((levels[0], kind, k))
    placed.sort(key=lambda entry: entry[0])
    kept: list[Level] = []
    for _, level, _ in placed:
        if level.branchless and not (kept and kept[-1].has_crd):
            level = Compressed()
        kept.append(level)
    if all(level.full for level in kept):
        return None
    return Format(tuple(kept), tuple(k for _, _, k in placed), None)


def _sparse_view(op: SparseTensor, groups: Groups) -> Tensor | SparseTensor:
    indices, values = op.coords()
    agree = torch.ones(indices.shape[1], dtype=torch.bool)
    for group in groups:
        for mode in group[1:]:
            agree &= indices[group[0]] == indices[mode]
    kept = agree.nonzero().squeeze(1)
    if not groups:
        return values[kept].sum()  # rank 0: at most one stored entry
    coords = indices[[g[0] for g in groups]][:, kept]
    shape = tuple(op.shape[g[0]] for g in groups)
    fmt = view_format(op.format, groups)
    if fmt is None:
        return values.new_zeros(shape).index_put(tuple(coords), values[kept])
    # Pack entry numbers (from 1) to learn where each kept entry lands; 0 marks explicit
    # zeros that dense levels below a sparse one store.
    index_dtype = torch.int64 if op.index_dtype == torch.int64 else None
    packed = pack(fmt, shape, coords, kept + 1, index_dtype=index_dtype)
    order = packed.values
    if bool((order == 0).any()):
        gathered = torch.cat([values.new_zeros(1), values])[order]
    else:
        gathered = values[order - 1]
    return SparseTensor(shape, fmt, packed.pos, packed.crd, gathered, check=False, index_dtype=packed.index_dtype)
