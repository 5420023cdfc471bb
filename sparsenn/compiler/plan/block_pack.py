"""Packed register blocks: a register block without a tile (``plan/microkernel.py``)
whose vector factor is laid out across the loop order, packed per thread inside the
kernel instead of re-laid out by a copy before it.

A nest ``a, d, k`` (an unstructured sparse weight's SpMM ``Y[b, o] = sum_i X[b, i]
W[o, i]`` in order ``o, i, b``: ``d`` steps through the weight's stored coordinates,
``k`` is the register block) reads the vector factor ``X`` as rows ``X[d, kb : kb +
B]``. Laid out ``[k][d]`` (a batch-major input), it is either copied into ``[d][k]``
at every call (a torch copy before the kernel), or *packed* where it is: each chunk
of the parallel loop over ``a`` copies the strip of one *panel* of ``k`` into a
per-thread buffer laid out ``[block of k][d][lanes of the block]`` by blocks of
``lanes x lanes`` transposed in registers (GotoBLAS's packed ``B``, as a packed grouped
tile's packs), and every row of ``a`` reads its gathered rows from there::

    for panels [pk, pe) of whole register blocks of k:
        pack[(kb - pk) / B][d][0:B] = X[kb : kb + B, d]   (lanes past k zero)
        for a in the chunk: for kb in [pk, pe) step B: the register block, reading pack

A panel fills at most a quarter of the L2 (at least one register block: 4096 inputs
by 64 columns take 1 MiB a panel), so the rows' gathers stay in the L2; it replaces
a cache tile of ``k`` (and the copy in panels of that tile); the panel is
contiguous where the copy's rows a multiple of 4 KiB apart would share a few cache
sets. Which way costs fewer cycles decides (:func:`packed_block`): the copy, as the
dense path costs it (:func:`.dense_path.relayout_cycles`), ``blocked_copy_cycles(E)``
plus the target's ``relayout_cycles`` (torch's call and allocation); the packs, per
thread, ``PACKED_BLOCK_CHUNKS_PER_THREAD`` times ``E_t log2(lanes) / lanes`` shuffles
for the elements in whole transposed blocks plus one cycle an element for the rest (the
lanes past ``k`` of the last block included), or ``2 E itemsize / bw`` read and written
when the strip streams from beyond the L2 (:func:`pack_cycles`). The parallel loop
runs in :data:`PACKED_BLOCK_CHUNKS_PER_THREAD` chunk per thread (an unstructured
weight's chunks are balanced by their stored entries): each thread packs each panel
once. Packed, the schedule's cost holds the packs' cycles instead of the copy's, and
the dense path's weighing counts no copy of the factor; the loop over ``d`` prefetches
the gathered rows of the pack as it would those of the copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import decisions
from .cost import Factor
from .microkernel import PackSource, Tile
from .target import Target

__all__ = ["PackedBlock", "packed_block", "pack_cycles", "PACKED_BLOCK_CHUNKS_PER_THREAD"]

PACKED_BLOCK_CHUNKS_PER_THREAD = 1


@dataclass(frozen=True)
class PackedBlock:
    """The register block's vector factor ``factor`` (laid out ``[k][d]``) packed per
    thread, ``panel`` values of ``k`` (whole register blocks) at a time (see the module doc)."""

    factor: int
    panel: int


def packed_block(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], block: Tile | None,
                 tiles: Sequence[Tile], layouts: dict[int, tuple[str, ...]], dims: dict[str, int], itemsize: int,
                 target: Target) -> tuple[PackedBlock | None, PackSource | None]:
    """(the packed block, how its factor is read) of a nest ``a, d, k`` with a register
    block over ``k`` and no register tile, no cache tile but of ``k`` (the panels
    replace it), ``d`` driven by one sparse level,
    and one copied dense factor holding just ``d`` and ``k`` whose memory order
    (``layouts``) is ``[k][d]`` (see the module doc); the block is None when the copy
    costs fewer cycles, both None when no pack applies."""
    none = None, None
    if block is None or len(order) != 3:
        return none
    a, d, k = order
    if a not in output or d in output or block.index != k or any(t.index != k for t in tiles):
        return none
    if decisions.driver(d, [f.nest_factor() for f in factors]) is None:
        return none
    readers = [n for n, f in enumerate(factors) if not f.sparse and layouts.get(n) == (k, d)
               and not f.in_place and sorted(i for i, _ in f.levels) == sorted((d, k))]
    if len(readers) != 1:
        return none
    (n,) = readers
    elements = dims[d] * dims[k]
    packing = PACKED_BLOCK_CHUNKS_PER_THREAD * pack_cycles(dims[d], dims[k], block.size, itemsize, target)
    relayout = target.blocked_copy_cycles(elements, itemsize) + target.relayout_cycles
    source = PackSource(n, packing < relayout, packing, relayout)
    if not source.in_place:
        return None, source
    panel = block.size * max(target.l2_bytes // 4 // (dims[d] * block.size * itemsize), 1)
    return PackedBlock(n, panel), source


def pack_cycles(depth: int, width: int, block: int, itemsize: int, target: Target) -> float:
    """Cycles of packing a ``[width][depth]`` strip into blocks of ``block`` columns
    (see the module doc): ``log2(lanes) / lanes`` a transposed element and one a copied
    one (padding included), or its bytes read and written at the rate of their level
    when that takes longer (as the copy's, :meth:`.Target.blocked_copy_cycles`)."""
    lanes = target.lanes(itemsize)
    transposed = (depth - depth % lanes) * (width - width % lanes)
    padded = depth * -(-width // block) * block
    nbytes = depth * width * itemsize
    shuffles = transposed * math.log2(lanes) / lanes + (padded - transposed)
    return max(shuffles, 2 * nbytes / target.bytes_per_cycle(nbytes))
