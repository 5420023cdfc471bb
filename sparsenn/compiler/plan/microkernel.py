"""Micro-kernels of dense-output nests: the register-level design the lowerer carries
out (:mod:`..lower.microkernel`, :mod:`..lower.register_tile`). Each is decided from
the nest's loop order, its factors' levels and the :class:`~.target.Target`'s
registers and caches, never from an operation's or a format's name.

* **Register blocking** (dense outputs): when the innermost loop ``k`` is a unit-stride
  output index, dense in every factor, below reduction loops ``R`` (SpMM's ``i,j,k``),
  ``k`` is strip-mined into blocks of the target's ``wide_register_block_vectors`` SIMD
  vectors when they divide ``k`` (each block is one pass over ``R``), else of
  ``register_block_vectors`` (or of the whole vectors that fit, when ``k`` is
  narrower), and the block loop is hoisted above ``R``:
  ``out[i, kb:kb+B]`` then stays in registers while ``R`` (the sparse row) streams
  past, and is stored once per block instead of once per nonzero. Blocks that do not
  fill a whole register block run the plain loop.
* **Register tiles** (a micro-kernel): when the loop ``a`` directly above ``R`` is a
  dense output index that the vector factors do not read, and every factor reading it
  does so through dense levels down to its values (the position is affine in ``a``: a
  stored block, a dense panel), ``a`` is unrolled by ``rows`` into the register block,
  a ``rows x vectors`` tile of accumulators: each step of ``R`` loads ``vectors`` SIMD
  vectors once and broadcasts one scalar per row into them (``rows x vectors`` FMAs
  for ``rows + vectors`` loads instead of one row's ``vectors`` FMAs for ``1 + vectors``).
  The loop ``a`` may also be driven by one factor's last, compressed level whose other
  readers are dense (rows gathered by a sparse level: a gate's tokens times an expert's
  weights): the tile then takes ``rows`` consecutive stored positions, their
  coordinates as the rows. The tile fills the target's vector registers (see
  :class:`~.target.Target`); ``rows`` prefers a divisor of ``a``'s extent, rows past the
  last whole tile run the plain register block. Bound by multiply-adds, a schedule with a tile, or
  with a register block wider than one vector, is made for the target's widest vectors
  (AVX-512 rather than AVX2): the same block in half the registers, loads and
  multiply-adds, and an output row of 128 floats in one pass over the sparse row instead
  of two. A factor holding ``k`` (as its
  dense last level) and no index of ``R`` is outside the sums: it scales each block of
  sums where it is stored, and it may read ``a`` too (a sampled output's anchor).
* **Packed panels.** When ``R`` is one dense reduction ``d`` and a dense vector factor
  holds only ``d``, ``k`` and indices fixed above ``a`` (an expert's weights
  ``W[e, d, h]``), the tiles of rows run one *panel* of ``k`` at a time: the factor's
  strip ``[d, panel]`` is copied once per iteration above ``a`` into a per-thread
  buffer laid out ``[block][d][block offset]``, and every row tile reads it from there
  (GotoBLAS's packed ``B``), the rows past the last whole tile one at a time. In place,
  the strip's rows are a row length apart, which for lengths of a multiple of 4 KiB
  all map onto the same few L1 sets. The copy reads the factor in its own layout (a
  weight read across it, ``W[e, h, d]`` in a backward pass, is transposed by blocks
  in registers, instead of re-laid out whole before the kernel). A
  panel holds whole register blocks and fills at most a quarter of the L2; it replaces
  a tile of ``k`` (the tile loop would sit above ``a``'s parents, re-reading every row
  once per tile). When a tile's rows over all of ``d`` would overflow half the L1
  (rows of 2048 values broadcast from L2 or beyond at every step), ``d`` is split into
  equal *layers* (BLIS's ``k_c``): each layer packs its own panels, the tiles add their
  partial sums into the output (so it is zeroed first, never stored once), and the
  epilogue runs after the last. ``d`` may instead step through one sparse factor's
  last level (a weight gradient ``sum_c R[e,c] X[e,c,d] dH[e,c,h]`` over an expert's
  stored slots ``c``): the pack's rows are then the strips at the fiber's stored
  coordinates, and the rows' scalars are read in place (``X[e, c, d : d + 6]``, one
  cache line a step), so the fiber is not layered and must fit half the L1 a line a
  step. Dense factors a packed tile reads only as scalars are not re-laid out either.
  Packing needs ``d`` to span at least :data:`MIN_PACKED_REDUCTION` steps and a pack to
  serve :data:`MIN_PACKED_ROWS` rows on average. A nest with a packed tile runs at the
  speed of a dense GEMM and is costed as BLAS is (``cost / GEMM_SPEEDUP``), which
  decides between it and a contraction path.
* **Grouped tiles.** When no register tile applies because the one sparse factor ``W``
  reads ``a`` and ``R`` through dense levels down to an innermost reduction ``e`` over
  its last level, whose fibers are affine in their parent (``count`` entries per
  group: an n:m weight), and the other factors are the block's vectors, not reading
  ``a``: ``a`` is unrolled by ``rows`` as in a register tile, but each row steps through
  its own group of ``e``, reading the vectors at its own coordinates. The rows of a
  group then read the same few vectors (``dims[e]`` of them per block, at most a
  quarter of the L1): loaded once from the L2 for the tile instead of once per row. A
  cache tile of ``k`` narrower than the widest register tile (``register_tile_vectors``
  vectors) is widened to it: on AVX-512 a batch tile of 64 with 4 x 4 vectors instead
  of 32 with 8 x 2, each group entry loaded for twice the multiply-adds and the weight
  read half as often. When the vector factors (laid out ``[d][e][k]`` under the one
  dense reduction ``d`` above ``e``) overflow half the L2, every tile would read them
  from the last-level cache: they are then *packed* by layers of ``d`` (GotoBLAS's
  ``k_c``) into per-thread panels ``[block of k][d][e][lanes]``, and the tiles run in
  *row blocks*: for each block of ``k``, every tile of a row block reads the same strip
  (``depth x dims[e]`` vectors per block, filling the L1) while the row block's stored
  entries of ``W`` over the layer stay in the L2. Layers add their partial sums into
  the output. A row's vectors are loaded by its multiply-adds (one broadcast per
  entry, no vector shared by rows), so a packed tile takes twice the
  ``register_tile_vectors`` and the rows the other registers leave: 2 x 4 with AVX2.
  Each chunk of the parallel loop copies its packs: the loop runs in
  :data:`PACKED_CHUNKS_PER_THREAD` chunks per thread. The packs cover the last, partial
  block of ``k`` (lanes past ``k`` zero) and the rows past the last whole tile run as
  tiles of one row, so the tiles read the vector factors only from their packs. A vector
  factor laid out ``[k][d][e]`` (the batch-major input ``X[b, i]`` split into groups) is
  either re-laid out ``[d][e][k]`` at every call, or packed from where it is by blocks of
  ``lanes x lanes`` transposed in registers, whichever costs fewer cycles
  (:func:`grouped_pack_sources`): the copy reads a cache line for each element across the
  rows, ``E (line + itemsize) / bw`` plus the target's ``relayout_cycles``; the
  transposing packs take ``log2(lanes)`` shuffles per vector of each chunk's packs,
  ``PACKED_CHUNKS_PER_THREAD E log2(lanes) / lanes`` (one shuffle a cycle; both read the
  same lines for the packs). A packed tile whose rows' stored entries of ``W`` over a
  layer and output rows, ``dims[a] (depth count (itemsize + index) + dims[k] itemsize)``
  bytes per pass of a block of ``k``, overflow half the L2 *prefetches the next tile's*
  (:attr:`RegisterTile.prefetch_next`): its rows' entries over the layer (the first
  block of ``k`` reads them from memory, short runs of a few lines per row that the
  hardware's stream prefetcher does not catch in time) and its output rows (read and
  written once per layer, from beyond the L2), while the tile's multiply-adds run.
* **Register tiles for sampled products.** A nest whose innermost loop is a reduction
  ``d`` under an output loop ``k`` (SDDMM ``S[i,j] = M[i,j] sum_d Q[i,d] K[j,d]`` on a
  blocked pattern: ``k`` is ``j`` within a block) swaps the two when the swapped order
  gets a register tile: ``K`` is re-laid out with ``j`` last, the sums stay in
  registers across ``d`` and no sum crosses SIMD lanes (a dot tile would add them up).
  A cheapest order that gets no register tile gives way to the cheapest one that does,
  if it costs at most :data:`REGISTER_TILE_MARGIN` times as much (the cost model counts
  loop iterations, not the registers a tile saves).
* **Dot tiles** (a micro-kernel for sampled products, block SDDMM): when the innermost
  loop ``d`` is a vector reduction and the two loops above it, ``a`` and ``b``, are
  output indices, each vector factor reads at most one of them, some read ``a`` and some
  ``b``, and every other factor reading them does so through dense levels down to its
  values, ``a`` and ``b`` are unrolled into a ``rows x cols`` tile of vector sums over
  ``d``: each step loads ``rows + cols`` vectors for ``rows x cols`` FMAs (the plain
  reduction loads two per FMA), and one transpose-and-add ends all the sums. Rows and
  columns past the last whole tile run the plain nest.
* **Interleaved block sums.** A register block without a tile whose reductions are one
  loop driven by a single sparse level sums ``S`` consecutive stored positions into
  ``S`` sets of accumulators, enough that its vectors make the target's
  ``sparse_accumulators`` independent chains of adds (a block of one vector would wait
  on every add).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import decisions
from .cost import Factor, NestCosts, outside_vector, register_blockable
from .decisions import VectorReduction
from .target import Target

__all__ = ["Tile", "RegisterTile", "DotTile", "PackSource", "register_tiled_order", "registers", "block_sums",
           "dot_tile", "grouped_pack_sources", "REGISTER_TILE_MARGIN", "MIN_PACKED_REDUCTION", "MIN_PACKED_ROWS",
           "PACKED_CHUNKS_PER_THREAD"]

REGISTER_TILE_MARGIN = 1.5  # a register-tiled order may cost this much more than the cheapest (module doc)
MIN_PACKED_REDUCTION = 16  # fewer steps of d: the strip's rows fit in the L1 sets they share
# Fewer rows per pack: copying the strip costs more than the aliasing it avoids (measured
# on an expert's weights, in layers: from 64 rows the packed tiles beat BLAS on the
# padded panels by about 10 %).
MIN_PACKED_ROWS = 64
INDEX_BYTES = 4  # a stored coordinate (``SN_INDEX``)
# A packed grouped tile copies its packs once per chunk of the parallel loop: few chunks
# (the rows of an n:m weight all hold the same work).
PACKED_CHUNKS_PER_THREAD = 2


@dataclass(frozen=True)
class Tile:
    """Loop ``index`` taken ``size`` coordinates at a time: a cache tile, or a register block."""

    index: str
    size: int


@dataclass(frozen=True)
class RegisterTile:
    """Loop ``index`` unrolled by ``rows`` into the nest's register block (``vectors``
    SIMD vectors per row); ``gathered_by``: the factor whose stored coordinates the rows
    are (rows gathered by a sparse level), None for a dense range of rows;
    ``stepped_by``: the factor whose stored coordinates a packed tile's reduction steps
    through, None for a dense reduction; ``grouped_by``: the factor whose innermost
    reduction each row steps through on its own (a *grouped tile*, see the module doc)."""

    index: str
    rows: int
    vectors: int
    gathered_by: int | None = None
    packed: tuple[int, ...] = ()  # vector factors copied into per-thread panels (see the module doc)
    panel: int = 0  # ... each panel spanning this much of the register block's index
    depth: int = 0  # ... and this much of the reduction (0: all of it)
    stepped_by: int | None = None
    grouped_by: int | None = None
    row_block: int = 0  # a packed grouped tile's rows of ``a`` per pass over one block of ``k`` (see the module doc)
    transposed: tuple[int, ...] = ()  # packed factors read in place, laid out ``[k][d][e]`` (see the module doc)
    prefetch_next: bool = False  # a packed grouped tile prefetches the next tile's entries and output rows (module doc)


@dataclass(frozen=True)
class PackSource:
    """Where a packed grouped tile's packs of vector factor ``factor`` (laid out
    ``[k][d][e]``) come from: the factor in place, blocks transposed in registers
    (``in_place``), else a copy re-laid out ``[d][e][k]`` at every call; the cycles of
    each way per call (see the module doc)."""

    factor: int
    in_place: bool
    transposing_cycles: float
    relayout_cycles: float

    def describe(self) -> str:
        transposing = f"transposing blocks in its packs ({self.transposing_cycles:.3g} cycles)"
        relayout = f"re-laying it out at every call ({self.relayout_cycles:.3g} cycles)"
        if self.in_place:
            return (f"factor {self.factor} packed where it is, not copied into loop order: {transposing} "
                    f"rather than {relayout}")
        return f"factor {self.factor} re-laid out: {relayout} rather than {transposing}"


@dataclass(frozen=True)
class DotTile:
    """Loops ``rows`` and ``cols`` (above the innermost vector reduction) unrolled by
    ``row_count`` and ``col_count`` into a tile of vector sums."""

    rows: str
    cols: str
    row_count: int
    col_count: int


def register_tiled_order(
    order: tuple[str, ...], candidates: dict[tuple[str, ...], float], output: tuple[str, ...], nests: NestCosts,
    anchor: int | None, itemsize: int, target: Target,
) -> tuple[str, ...] | None:
    """An order to run instead of the cheapest, ``order``, because it gets a register
    tile (see the module doc), or None: ``order`` with its innermost reduction ``d``
    and the output loop ``k`` above it swapped (the sums over ``d`` then stay in
    registers for a block of ``k`` instead of being summed across SIMD lanes, one dot
    product at a time: SDDMM's ``Q Kᵀ`` on a blocked pattern); else, when ``order``
    itself gets none, the cheapest of the ``candidates`` (order: cost) that does and
    costs at most :data:`REGISTER_TILE_MARGIN` times as much (a weight gradient
    ``Xᵀ dH`` over an expert's stored rows: ``e, d, c, h`` instead of ``e, c, d, h``)."""
    dims = nests.dims

    def tiled(o: tuple[str, ...]) -> bool:
        if anchor is not None and not nests.reads_anchor_as_stored(o, anchor):
            return False
        factors = nests(o)[2]
        output_order = tuple(sorted(output, key=o.index))
        block = _register_block(output_order, o, factors, (), dims, itemsize, target)
        return _register_tile(o, output, factors, block, (), o[0] in output, dims, itemsize, target) is not None

    if len(order) >= 3 and order[-1] not in output and order[-2] in output:
        swapped = (*order[:-2], order[-1], order[-2])
        if tiled(swapped):
            return swapped
    if tiled(order):
        return None
    bound = candidates[order] * REGISTER_TILE_MARGIN
    return next((o for o in sorted(candidates, key=candidates.get) if candidates[o] <= bound and tiled(o)), None)


def registers(
    order: Sequence[str], parallel: bool, tiles: tuple[Tile, ...], output_order: tuple[str, ...],
    output: tuple[str, ...], factors: list[Factor], dims: dict[str, int], itemsize: int, target: Target,
) -> tuple[Tile | None, RegisterTile | None, tuple[Tile, ...]]:
    """(register block, register tile, the cache ``tiles`` kept) of a nest running in
    ``order`` under cache ``tiles``. The cache tiles on a register tile's loops are
    dropped when they are what prevented it (a tile narrower than a register block
    splits it: e.g. 32 of the 64 rows and columns of a block SDDMM's blocks): values
    kept in registers across a reduction are worth more than an L2 tile of the same
    loops. A packed tile's panels replace the cache tile of ``k``, so its register block
    need not fit in that tile (the caller drops it); a tile's block is its vectors."""
    context = (output_order, output, factors, dims, itemsize, target)
    block, tile = _registers(order, parallel, tiles, *context)
    if tile is None and tiles:
        over = _registers(order, parallel, (), *context)
        if over[1] is not None:
            kept = tuple(t for t in tiles if t.index not in (over[0].index, over[1].index))
            found = _registers(order, parallel, kept, *context)
            if found[1] is not None:
                (block, tile), tiles = found, kept
    if tile is not None and tile.packed and any(t.index == block.index for t in tiles):
        wider = _registers(order, parallel, tuple(t for t in tiles if t.index != block.index), *context)
        if wider[1] is not None and wider[1].packed:
            block, tile = wider
    if tile is not None and tile.grouped_by is not None:
        block, tile, tiles = _widest_grouped(order, parallel, block, tile, tiles, context)
    if tile is not None:
        block = Tile(block.index, tile.vectors * target.lanes(itemsize))
    return block, tile, tiles


def _widest_grouped(order: Sequence[str], parallel: bool, block: Tile, tile: RegisterTile, tiles: tuple[Tile, ...],
                    context: tuple) -> tuple[Tile, RegisterTile, tuple[Tile, ...]]:
    """A grouped tile's (block, tile, cache tiles) with the cache tile of the block's
    loop ``k`` widened to the widest register tile, ``register_tile_vectors`` vectors,
    where it was narrower: each row's group entries then scale that many vectors (with
    32 registers, 4 x 4 vectors instead of 8 x 2: half the passes over the weight per
    row of ``k``); a group's vectors stay in the L1 (:func:`_grouped_tile`)."""
    dims, itemsize, target = context[3:]
    k = block.index
    widest = target.register_tile_vectors * target.lanes(itemsize)
    if tile.vectors == target.register_tile_vectors or dims[k] < widest:
        return block, tile, tiles
    wider_tiles = tuple(Tile(t.index, max(t.size, widest)) if t.index == k else t for t in tiles)
    wider = _registers(order, parallel, wider_tiles, *context)
    if wider[1] is None or wider[1].grouped_by is None or wider[1].vectors <= tile.vectors:
        return block, tile, tiles
    return wider[0], wider[1], wider_tiles


def _registers(
    order: Sequence[str], parallel: bool, tiles: Sequence[Tile], output_order: tuple[str, ...],
    output: tuple[str, ...], factors: list[Factor], dims: dict[str, int], itemsize: int, target: Target,
) -> tuple[Tile | None, RegisterTile | None]:
    """The register block and register tile of ``order`` under cache ``tiles``."""
    block = _register_block(output_order, order, factors, tiles, dims, itemsize, target)
    tile = _register_tile(order, output, factors, block, tiles, parallel, dims, itemsize, target)
    return block, tile or _grouped_tile(order, output, factors, block, tiles, dims, itemsize, target)


def _tile_shape(k: str, block: Tile, dims: dict[str, int], itemsize: int, target: Target) -> tuple[int, int] | None:
    """(vectors, most rows) of a register tile over ``block``: whole vectors of ``k``
    (at most the target's ``register_tile_vectors``), and the rows their accumulators
    leave room for (at most ``register_tile_rows``)."""
    lanes = target.lanes(itemsize)
    whole = min(block.size, dims[k] // lanes * lanes)  # a tile's blocks are whole vectors
    vectors = min(target.register_tile_vectors, whole // lanes)
    if vectors < 1:
        return None
    most = min(target.register_tile_rows, (target.vector_registers - 1 - vectors) // vectors)
    return (vectors, most) if most >= 2 else None


def _grouped_tile(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], block: Tile | None,
                  tiles: Sequence[Tile], dims: dict[str, int], itemsize: int, target: Target) -> RegisterTile | None:
    """A grouped tile over the output loop ``a`` above the register block's reductions
    (see the module doc), or None: one sparse factor reads ``a`` and the reductions
    through dense levels down to an innermost reduction ``e`` over its last level,
    whose fibers are affine in their parent (an n:m weight's groups); the others are
    the vectors of the block, dense, not reading ``a``; a group's vectors over all of
    ``e`` fit a quarter of the L1."""
    if block is None or len(order) < 3:
        return None
    r = decisions.reductions_from(order, output, len(order) - 1)
    a, e, k = order[r - 1], order[-2], order[-1]
    if r < 1 or r == len(order) - 1 or a not in output or any(t.index == a for t in tiles) or dims[a] < 2:
        return None
    sparse = [n for n, f in enumerate(factors) if f.sparse]
    if len(sparse) != 1:
        return None
    (w,) = sparse
    held = [i for i, _ in factors[w].levels]
    if a not in held or held[-1] != e or k in held:
        return None
    above, (_, last) = factors[w].levels[held.index(a):-1], factors[w].levels[-1]
    if not last.affine_fibers or not all(level.full and level.locatable for _, level in above):
        return None
    if any(a in (i for i, _ in f.levels) or k not in (i for i, _ in f.levels)
           for n, f in enumerate(factors) if n != w):
        return None
    lanes = target.lanes(itemsize)
    vectors = min(2 * target.register_tile_vectors, dims[k] // lanes)
    most = min(target.register_tile_rows, (target.vector_registers - 1) // max(vectors, 1))
    if vectors >= 1 and most >= 2:  # packed: any width of k; the vectors are loaded by the FMAs
        rows = _rows(most, dims[a])
        packed, panel, depth, row_block = _grouped_blocking(order, r, factors, w, rows, vectors * lanes, dims,
                                                            itemsize, target)
        if packed:
            prefetch = _streams_past_l2(dims[a], depth or dims[order[r]], factors[w].fibers[-1], dims[k], itemsize,
                                        target)
            return RegisterTile(a, rows, vectors, packed=packed, panel=panel, depth=depth, grouped_by=w,
                                row_block=row_block, prefetch_next=prefetch)
    shape = _tile_shape(k, block, dims, itemsize, target)
    if shape is None or dims[e] * shape[0] * lanes * itemsize > target.l1_bytes // 4:
        return None
    vectors, most = shape
    return RegisterTile(a, _rows(most, dims[a]), vectors, grouped_by=w)


def _grouped_blocking(order: Sequence[str], r: int, factors: list[Factor], w: int, rows: int, width: int,
                      dims: dict[str, int], itemsize: int, target: Target) -> tuple[tuple[int, ...], int, int, int]:
    """(packed factors, panel along ``k``, depth along ``d`` (0: all of it), row block
    along ``a``) of a grouped tile over ``order = P' + (a, d, e, k)`` of at least
    :data:`MIN_PACKED_ROWS` rows per chunk whose vector factors overflow half the L2
    (see the module doc), else ``((), 0, 0, 0)``: the vector factors, dense and laid
    out ``[d][e][k]``, are packed by layers of ``d`` whose strip for one block of ``k``
    (``depth x dims[e] x width`` values per factor) fills at most the L1; a panel holds
    whole blocks and fills at most a quarter of the L2; a row block's stored entries of
    ``W`` over one layer fill at most a quarter of the L2."""
    none = (), 0, 0, 0
    if len(order) - r != 3 or dims[order[r - 1]] < MIN_PACKED_ROWS * PACKED_CHUNKS_PER_THREAD:
        return none
    d, e, k = order[r:]
    vectors = tuple(n for n in range(len(factors)) if n != w)
    if not vectors or any([i for i, _ in factors[n].levels] != [d, e, k] for n in vectors):
        return none
    if len(vectors) * dims[d] * dims[e] * dims[k] * itemsize <= target.l2_bytes // 2:
        return none  # every tile reads the vectors from the L2
    strip = len(vectors) * dims[e] * width * itemsize  # one group's vectors for one block of k
    layers = -(-dims[d] // max(target.l1_bytes // strip, 1))
    depth = -(-dims[d] // layers)
    panel = width * min(max(target.l2_bytes // 4 // (depth * strip), 1), -(-dims[k] // width))
    entries = depth * max(factors[w].fibers[-1], 1) * (itemsize + INDEX_BYTES)  # one row's over a layer
    row_block = rows * max(target.l2_bytes // 4 // (rows * entries), 1)
    return vectors, panel, depth if layers > 1 else 0, int(row_block)


def _streams_past_l2(rows: int, depth: int, count: float, width: int, itemsize: int, target: Target) -> bool:
    """Whether a packed grouped tile's ``rows`` stream their stored entries over a layer
    of ``depth`` groups of ``count`` entries and their output rows of ``width`` values
    through more than half the L2 per pass of a block of ``k``: the next tile's are then
    read from beyond it, and are prefetched (see the module doc)."""
    entries = depth * max(count, 1) * (itemsize + INDEX_BYTES)
    return rows * (entries + width * itemsize) > target.l2_bytes // 2


def grouped_pack_sources(tile: RegisterTile, order: Sequence[str], layouts: dict[int, tuple[str, ...]],
                         dims: dict[str, int], itemsize: int, target: Target) -> tuple[PackSource, ...]:
    """How a packed grouped tile over ``order = P' + (a, d, e, k)`` reads each packed
    factor whose memory order (``layouts``) is ``[k][d][e]``: in place, or from a copy
    re-laid out ``[d][e][k]``, whichever costs fewer cycles (see the module doc)."""
    d, e, k = order[-3:]
    lanes = target.lanes(itemsize)
    sources = []
    for n in tile.packed:
        if layouts.get(n) != (k, d, e):
            continue
        elements = dims[d] * dims[e] * dims[k]
        transposing = PACKED_CHUNKS_PER_THREAD * elements * math.log2(lanes) / lanes
        relayout = target.across_rows_cycles(elements, itemsize) + target.relayout_cycles
        sources.append(PackSource(n, transposing < relayout, transposing, relayout))
    return tuple(sources)


def _rows(most: int, extent: int) -> int:
    """A tile's rows: a divisor of the rows' ``extent`` down to half of ``most``, else ``most``."""
    return min(next((n for n in range(most, max(most // 2, 2) - 1, -1) if extent % n == 0), most), extent)


def _register_block(
    output_order: tuple[str, ...], order: Sequence[str], factors: list[Factor],
    tiles: Sequence[Tile], dims: dict[str, int], itemsize: int, target: Target,
) -> Tile | None:
    """A register block for the innermost loop (see the module doc), or None.

    Requires the nest's structure to allow one (:func:`.cost.register_blockable`) and
    the innermost index to be the output's unit-stride (last) index."""
    if not output_order or order[-1] != output_order[-1] or not register_blockable(order, output_order, factors):
        return None
    k = order[-1]
    spans = [dims[k], *(t.size for t in tiles if t.index == k)]  # the extent and its tile
    span = min(spans)
    lanes = target.lanes(itemsize)
    wide = target.wide_register_block_vectors * lanes
    if span >= wide and all(s % wide == 0 for s in spans):
        return Tile(k, wide)
    # Other extents take the vectors that cover them, up to a register block; the last,
    # partial block is masked. Left to a plain loop, a k loop narrower than a block would
    # run scalar (the vectoriser's cost model skips loops that need a remainder).
    return Tile(k, min(target.register_block_vectors * lanes, max(math.ceil(span / lanes), 1) * lanes))


def block_sums(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], block: Tile | None,
                tile: RegisterTile | None, itemsize: int, target: Target) -> int:
    """Interleaved sums of a register block without a tile whose reductions are one
    loop driven by a single sparse level: enough that its vectors make the target's
    ``sparse_accumulators`` independent chains of adds (1: none)."""
    if block is None or tile is not None:
        return 1
    r = decisions.reductions_from(order, output, len(order) - 1)
    if len(order) - 1 - r != 1 or decisions.driver(order[r], [f.nest_factor() for f in factors]) is None:
        return 1
    vectors = block.size // target.lanes(itemsize)
    return max(1, math.ceil(target.sparse_accumulators / vectors))


def _register_tile(
    order: Sequence[str], output: tuple[str, ...], factors: list[Factor], block: Tile | None,
    tiles: Sequence[Tile], parallel: bool, dims: dict[str, int], itemsize: int, target: Target,
) -> RegisterTile | None:
    """A register tile over the loop above the register block's reductions (see the
    module doc), or None."""
    if block is None:
        return None
    r = decisions.reductions_from(order, output, len(order) - 1)
    if r < 1 or r == len(order) - 1 or (r == 1 and parallel):
        return None  # no reduction to keep the tile across, or ``a`` runs in chunks
    a, k = order[r - 1], order[-1]
    if a not in output or any(t.index == a for t in tiles) or dims[a] < 2:
        return None
    readers, gathered_by, outside = 0, None, False
    reductions = set(order[r:-1])
    for n, f in enumerate(factors):
        held = [i for i, _ in f.levels]
        if a not in held:
            continue
        if k in held:
            if not outside_vector(f, k, reductions, a):
                return None  # a vector factor
            outside = True
            continue
        level = f.levels[held.index(a)][1]
        if f.sparse and held[-1] == a and not level.locatable and level.unique and gathered_by is None:
            gathered_by = n  # its last level's stored coordinates are the rows
        elif not all(lv.full and lv.locatable for _, lv in f.levels[held.index(a):]):
            return None  # a position not affine in ``a``
        readers += 1
    if not readers or (gathered_by is not None and (outside or any(
            f.sparse for n, f in enumerate(factors) if n != gathered_by and a in (i for i, _ in f.levels)))):
        return None
    shape = _tile_shape(k, block, dims, itemsize, target)
    if shape is None:
        return None
    vectors, most = shape
    width = vectors * target.lanes(itemsize)
    if gathered_by is None:
        expected_rows = dims[a]
    else:
        gathering = factors[gathered_by]
        expected_rows = gathering.fibers[[i for i, _ in gathering.levels].index(a)]
    packed, panel, depth, stepped_by = _packed(order, r, factors, width, most, expected_rows, dims, itemsize, target)
    rows = most
    if gathered_by is None and not packed:  # packed, the rows past the last whole tile run from the panels
        rows = _rows(most, dims[a])
    return RegisterTile(a, rows, vectors, gathered_by, packed, panel, depth, stepped_by)


def _packed(order: Sequence[str], r: int, factors: list[Factor], width: int, rows: int, expected_rows: float,
            dims: dict[str, int], itemsize: int, target: Target) -> tuple[tuple[int, ...], int, int, int | None]:
    """(the vector factors of a register tile over ``order[r - 1]`` whose strips are
    packed, the panel's extent along ``k``, its depth along ``d`` (0: all of ``d``), the
    sparse factor ``d`` steps through; see the module doc): ``R = order[r:-1]`` is one
    reduction ``d``, dense in every factor but at most one, whose last level over ``d``
    (compressed, unique) it steps through (no layers, at most half the L1 of cache
    lines; the packed factors then laid out with ``k`` last); a packed factor, dense in
    any layout, holds ``d``, ``k`` and loops above the tile only. A tile's ``rows`` over
    one pack's depth fill at most half of the L1 (the depth splits ``d`` evenly); a
    panel holds whole register blocks (``width``) and fills at most a quarter of the L2
    per packed factor. ``expected_rows``: the rows of the tile per iteration above it
    (per pack), at least :data:`MIN_PACKED_ROWS`."""
    none = (), 0, 0, None
    if len(order) - r != 2 or expected_rows < MIN_PACKED_ROWS:
        return none
    d, k = order[r], order[-1]
    holders = [n for n, f in enumerate(factors) if f.sparse and d in (i for i, _ in f.levels)]
    stepping = holders[0] if holders else None
    if len(holders) > 1 or (stepping is not None and not _last_level_steps(factors[stepping], d)):
        return none
    steps = dims[d] if stepping is None else factors[stepping].fibers[-1]
    lines = steps * target.cache_line_bytes
    if steps < MIN_PACKED_REDUCTION or (stepping is not None and lines > target.l1_bytes // 2):
        return none  # a stepped reduction is not layered: the rows' line per step must stay in L1
    above = set(order[:r - 1])
    packed = tuple(n for n, f in enumerate(factors) if not f.sparse
                   and {i for i, _ in f.levels} >= {d, k} and {i for i, _ in f.levels} - {d, k} <= above
                   and (stepping is None or f.levels[-1][0] == k))
    if not packed:
        return none
    deepest = max(target.l1_bytes // 2 // (rows * itemsize), MIN_PACKED_REDUCTION)
    layers = 1 if stepping is not None else -(-dims[d] // deepest)
    depth = -(-steps // layers)
    blocks = target.l2_bytes // 4 // len(packed) // (depth * width * itemsize)
    if blocks < 1:
        return none
    return packed, width * min(blocks, -(-dims[k] // width)), depth if layers > 1 else 0, stepping


def _last_level_steps(f: Factor, d: str) -> bool:
    """Whether ``f``'s last level is over ``d``, compressed and unique: a reduction can
    step through its stored coordinates."""
    index, level = f.levels[-1]
    return index == d and not level.locatable and level.unique


def dot_tile(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], reduction: VectorReduction | None,
              tiles: Sequence[Tile], target: Target) -> DotTile | None:
    """A dot tile around the innermost vector reduction (see the module doc), or None."""
    if reduction is None or len(order) < 4 or reduction.index != order[-1]:
        return None  # ``a`` is not the outermost loop: that one runs in chunks
    if decisions.reductions_from(order, output, len(order)) != len(order) - 1:
        return None
    a, b, d = order[-3], order[-2], order[-1]
    if a not in output or b not in output or {a, b} & {t.index for t in tiles}:
        return None
    readers = {a: 0, b: 0}
    for k, f in enumerate(factors):
        held = [i for i, _ in f.levels]
        shifted = [i for i in (a, b) if i in held]
        if f.sparse and d in held:
            return None
        if k in reduction.vectors:
            if len(shifted) > 1:
                return None
            for i in shifted:
                readers[i] += 1
        elif f.sparse and shifted:
            first = min(held.index(i) for i in shifted)
            if not all(level.full and level.locatable for _, level in f.levels[first:]):
                return None  # a position not affine in ``a`` and ``b``
    if not (readers[a] and readers[b]):
        return None
    return DotTile(a, b, *target.dot_tile)

