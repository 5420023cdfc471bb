"""Loop ordering, workspace insertion and tiling (Scorch Algorithms 1 and 3).

The scheduler sees each operand through :class:`OperandInfo`: its format (``None`` for
a dense ``torch.Tensor``), its shape and the number of stored positions per storage
level. It returns a :class:`Schedule`:

* **Dense output.** Each term is its own loop nest accumulating into the output. The
  loop order is chosen by a cost model over all orders of the term's indices (a greedy
  search beyond :data:`EXHAUSTIVE_LIMIT` indices). The cost of an order is the expected
  work of the nest: at each loop, co-iterating the sparse levels indexed there
  (``sum`` of fiber lengths, with an expected intersection of ``N * prod(f_k / N)``) or
  ``N`` for a dense loop, times the iterations of the enclosing loops; a sparse operand
  whose storage order disagrees with the loop order is re-stored in that order first
  (a transpose costing ``TRANSPOSE_COST * nnz``); a nest whose outermost loop is a
  reduction cannot run in parallel and pays :data:`SERIAL_PENALTY`.
* **Sparse output.** The output is assembled level by level, so its first ``p`` storage
  levels are *shared* loops common to all terms (co-iterated as a union of the terms);
  the remaining output levels, if any, are scattered into a **workspace** (dense for
  rows of moderate size, a sorted sparse accumulator otherwise) that is drained in
  order. ``p`` and every term's order are chosen by the same cost model plus the
  workspace's cost. SpGEMM gets Gustavson's ``i,k,j`` with a row workspace; SDDMM
  iterates its sampling pattern with an inner dense reduction.
* **Tiling** (Algorithm 3, dense outputs): a dense loop is tiled when some access is
  reused across another loop, the index is dense in every operand, it is an output
  index (a tiled reduction would split every sum into per-tile partial sums, each a
  pass over the sparse operand) and it is not the parent of a sparse loop; the tile
  makes the reused data fit in half of a core's
  private L2 (the last-level cache is shared with the other core and, on a VM, with
  other tenants, so it is not a dependable target).
* **Panels** (dense outputs): a dense operand the nest re-lays out anyway (its own
  layout is not the loop order) whose unit-stride index is tiled is laid out in panels
  of the tile: ``[tile][other modes][offset in tile]``, the last panel as wide as the
  remainder. A tile then reads one contiguous block instead of a strip of every row,
  which rows whose length is a multiple of a cache way's size (a batch of 256 floats)
  map onto a fraction of the cache's sets.
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
  last whole tile run the plain register block. Bound by multiply-adds, a schedule with a tile is made for the
  target's widest vectors (AVX-512 rather than AVX2). A factor holding ``k`` (as its
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
* **Code decisions** inside each nest (vector and sparse reductions, row blocks,
  prefetching loops, store-once) and the thread policy: see :mod:`.decisions`. Every
  machine parameter comes from the :class:`~.target.Target` passed in; the constants
  below are cost-model weights, not machine facts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sparsenn.formats import Format

from .. import notation
from ..notation import Assignment, Term
from . import decisions
from .cost import Factor, OperandInfo, estimate_positions, nest_cost, outside_vector, register_blockable
from .decisions import OutputAssembly, PrefetchLoop, PrefetchPolicy, RowBlock, SparseReduction, VectorReduction
from .target import Target

__all__ = ["OperandInfo", "Tile", "RegisterTile", "DotTile", "Nest", "Workspace", "Schedule", "schedule",
           "estimate_positions"]

EXHAUSTIVE_LIMIT = 6
SERIAL_PENALTY = 2.0
DENSE_WORKSPACE_LIMIT = 1 << 22
SPARSE_ACCUMULATOR_COST = 4.0
CACHE_LINE_BYTES = 64
MIN_TILE_BYTES = 2 * CACHE_LINE_BYTES  # one register block of float32
REGISTER_TILE_MARGIN = 1.5  # a register-tiled order may cost this much more than the cheapest (see below)
MIN_PACKED_REDUCTION = 16  # fewer steps of d: the strip's rows fit in the L1 sets they share
# Fewer rows per pack: copying the strip costs more than the aliasing it avoids (measured
# on an expert's weights, in layers: from 64 rows the packed tiles beat BLAS on the
# padded panels by about 10 %).
MIN_PACKED_ROWS = 64
# How much faster BLAS (or a packed register tile) runs a dense product than the cost
# model's accounting (in which vectorised loops already count 1/8) predicts.
GEMM_SPEEDUP = 8.0


@dataclass(frozen=True)
class Tile:
    index: str
    size: int


@dataclass(frozen=True)
class RegisterTile:
    """Loop ``index`` unrolled by ``rows`` into the nest's register block (``vectors``
    SIMD vectors per row); ``gathered_by``: the factor whose stored coordinates the rows
    are (rows gathered by a sparse level), None for a dense range of rows;
    ``stepped_by``: the factor whose stored coordinates a packed tile's reduction steps
    through, None for a dense reduction."""

    index: str
    rows: int
    vectors: int
    gathered_by: int | None = None
    packed: tuple[int, ...] = ()  # vector factors copied into per-thread panels (see the module doc)
    panel: int = 0  # ... each panel spanning this much of the register block's index
    depth: int = 0  # ... and this much of the reduction (0: all of it)
    stepped_by: int | None = None


@dataclass(frozen=True)
class DotTile:
    """Loops ``rows`` and ``cols`` (above the innermost vector reduction) unrolled by
    ``row_count`` and ``col_count`` into a tile of vector sums."""

    rows: str
    cols: str
    row_count: int
    col_count: int


@dataclass(frozen=True)
class Nest:
    """One term's loop nest, below the shared loops, with every code decision the
    lowerer carries out (see :mod:`.decisions`)."""

    term: int
    order: tuple[str, ...]
    tiles: tuple[Tile, ...] = ()
    parallel: bool = False
    cost: float = 0.0
    team_loops: int = 1  # a parallel nest's threads share the coordinates of order[:team_loops]
    register_block: Tile | None = None  # innermost output loop blocked into registers
    # ... its sums interleaved over this many consecutive positions of the sparse loop
    # above it (independent chains of adds: a block of one vector would wait on each).
    block_sums: int = 1
    register_tile: RegisterTile | None = None  # ... and a second output loop with it
    dot_tile: DotTile | None = None  # two output loops around a vector reduction
    vector_reduction: VectorReduction | None = None
    sparse_reduction: SparseReduction | None = None
    row_block: RowBlock | None = None
    prefetch: tuple[PrefetchLoop, ...] = ()
    simd: str | None = None  # the innermost loop, when its iterations write different output elements
    stores_once: bool = False  # the first nest of a dense output stores with "="
    stores_once_anchors: tuple[int, ...] = ()  # ... or of an output sampled by one of these operands
    panels: tuple[tuple[int, int], ...] = ()  # (factor, tile size): read in panels of its last index's tile
    # The assignment's epilogue runs over each output slice once loops order[:epilogue_at]
    # are fixed (None: over the whole output after every nest).
    epilogue_at: int | None = None

    def describe(self, shared: tuple[str, ...] = ()) -> str:
        parallel = "parallel" if self.team_loops == 1 else f"parallel over {','.join(self.order[:self.team_loops])}"
        parts = [f"term {self.term}: loop order {','.join(shared + self.order)}",
                 parallel if self.parallel else "serial",
                 "tiles: " + (", ".join(f"{t.index} by {t.size}" for t in self.tiles) or "none")]
        if self.register_block:
            sums = f" ({self.block_sums} interleaved sums)" if self.block_sums > 1 else ""
            parts.append(f"register block: {self.register_block.index} by {self.register_block.size}{sums}")
        if self.register_tile:
            t = self.register_tile
            rows = f"{t.rows} rows" if t.gathered_by is None else f"{t.rows} stored rows of factor {t.gathered_by}"
            parts.append(f"register tile: {t.rows} x {t.vectors} vectors ({t.index} by {rows})")
            if t.packed:
                depth = f" x {t.depth} {self.order[self.order.index(t.index) + 1]}" if t.depth else ""
                stepped = "" if t.stepped_by is None else f" over the stored coordinates of factor {t.stepped_by}"
                parts.append(f"factor(s) {list(t.packed)} packed per thread in panels of {t.panel} "
                             f"{self.register_block.index}{depth}{stepped}")
        if self.vector_reduction:
            v = self.vector_reduction
            parts.append(f"vector reduction over {v.index} ({v.accumulators} accumulators)")
        if self.dot_tile:
            t = self.dot_tile
            parts.append(f"dot tile: {t.row_count} x {t.col_count} sums ({t.rows} by {t.row_count}, {t.cols} by "
                         f"{t.col_count})")
        if self.sparse_reduction:
            r = self.sparse_reduction
            parts.append(f"sparse reduction over {r.index} ({r.accumulators} accumulators)")
        if self.row_block:
            b = self.row_block
            parts.append(f"row block: {b.size} entries of {b.index} share {b.inner} loads ({b.vectors} vector(s) each)")
        for loop in self.prefetch:
            parts.append(f"loop {loop.index} may prefetch factor(s) {list(loop.factors)}")
        if self.simd:
            parts.append(f"loop {self.simd}: omp simd (independent iterations)")
        if self.stores_once:
            parts.append("stores each output element once (=)")
        for k, size in self.panels:
            parts.append(f"factor {k} laid out in panels of {size}")
        if self.epilogue_at is not None:
            parts.append(f"epilogue fused after loop {self.order[self.epilogue_at]} (per slice)")
        if self.stores_once_anchors:
            parts.append(f"stores each sampled value once if operand(s) {list(self.stores_once_anchors)} anchor the output")
        return "; ".join(parts)


@dataclass(frozen=True)
class Workspace:
    """A per-thread accumulator over the output levels below the shared loops."""

    kind: str  # "dense" or "sparse"
    indices: tuple[str, ...]
    size: int


@dataclass(frozen=True)
class Schedule:
    output_format: Format | None
    output_order: tuple[str, ...]  # output indices in storage (or dense layout) order
    shared: tuple[str, ...]  # shared output loops (sparse output only)
    nests: tuple[Nest, ...]
    workspace: Workspace | None
    # storage mode order each factor must be read in: ((term, factor), mode_order)
    transposes: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]
    cost: float
    reasons: tuple[str, ...] = field(default=(), compare=False)
    leaves: float = 0.0  # expected innermost iterations: an upper bound on output nonzeros
    serial: bool = False  # too little work to wake a team of threads (target.parallel_min_work)
    prefetch_policy: PrefetchPolicy | None = None
    target: Target = field(default_factory=Target)
    assembly: OutputAssembly | None = None  # how a sparse output is written
    union_by_points: bool = True  # a sum's shared loops: one per lattice point, or one loop


    def describe(self) -> str:
        """Every decision of the schedule, one per line."""
        lines = [f"output: {'dense' if self.output_format is None else self.output_format}, "
                 f"laid out as {','.join(self.output_order)}"]
        if self.shared:
            lines.append(f"shared output loops: {','.join(self.shared)}")
        lines += [nest.describe(self.shared) for nest in self.nests]
        if self.workspace is not None:
            ws = self.workspace
            lines.append(f"workspace: {ws.kind} over {','.join(ws.indices)} ({ws.size} entries)")
        else:
            lines.append("workspace: none")
        if self.assembly is not None:
            lines.append(self.assembly.describe())
            if len(self.nests) > 1:
                k = len(self.nests)
                how = f"one loop per lattice point ({2 ** k - 1})" if self.union_by_points else "one merge loop"
                lines.append(f"union of {k} terms at each shared loop: {how}")
        lines += [f"transpose: term {t} factor {k} re-stored in mode order {order}" for (t, k), order in self.transposes]
        threads = "one thread" if self.serial else "a team of threads"
        lines.append(f"threads: {threads} (expected {self.leaves:.3g} innermost iterations, "
                     f"team from {self.target.parallel_min_work})")
        if self.prefetch_policy is not None and any(n.prefetch for n in self.nests):
            p = self.prefetch_policy
            lines.append(f"prefetch: {p.ahead_bytes} bytes ahead (at most {p.max_distance} positions, {p.max_bytes} "
                         f"bytes per span) when gathered operands exceed {p.min_bytes} bytes; from {p.large_bytes} "
                         f"bytes if the coordinate ahead is {p.min_jump}+ away, else for fibers over half the range")
        return "\n".join(lines)

    def factor_mode_order(self, term: int, factor: int) -> tuple[int, ...] | None:
        for key, order in self.transposes:
            if key == (term, factor):
                return order
        return None


def _orders(indices: Sequence[str], cost_of, leads: Sequence[Sequence[str]] = ()) -> list[tuple[str, ...]]:
    """Candidate orders: all permutations up to EXHAUSTIVE_LIMIT, else a greedy build
    and, for each of ``leads`` (the sparse operands' storage orders), that order first
    and the rest as the greedy build has them: a greedy choice of the first loops can
    miss the order that reads every sparse operand as it is stored."""
    if len(indices) <= EXHAUSTIVE_LIMIT:
        return list(itertools.permutations(indices))
    order: list[str] = []
    rest = list(indices)
    while rest:
        best = min(rest, key=lambda i: cost_of(tuple(order + [i] + [r for r in rest if r != i])))
        order.append(best)
        rest.remove(best)
    candidates = [tuple(order)]
    for lead in leads:
        lead = [i for i in lead if i in indices]
        candidate = tuple(lead) + tuple(i for i in order if i not in lead)
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def _storage_orders(term: Term, infos: Sequence[OperandInfo]) -> list[tuple[str, ...]]:
    """Each sparse factor's indices in its storage order."""
    return [tuple(a.indices[m] for m in infos[a.operand].format.mode_order)
            for a in term.factors if infos[a.operand].format is not None]


# ----------------------------------------------------------------------------- tiling


def _tiles(
    term: Term,
    output: tuple[str, ...],
    order: Sequence[str],
    factors: list[Factor],
    infos: Sequence[OperandInfo],
    dims: dict[str, int],
    itemsize: int,
    target: Target,
) -> tuple[Tile, ...]:
    """Algorithm 3: tile dense, reused loops that are not parents of a sparse loop."""
    all_indices = set(order)
    accesses = [set(a.indices) for a in term.factors] + [set(output)]
    working = set().union(*(s for s in accesses if s < all_indices))
    sparse_indices = {i for f in factors for i, level in f.levels if not level.locatable}
    working -= sparse_indices
    last_sparse = max((order.index(i) for i in sparse_indices if i in order), default=-1)
    # A tiled reduction index would split every sum into one partial sum per tile, each
    # added to the output in its own pass over the sparse operand: only output indices.
    working = {i for i in working if order.index(i) > last_sparse and i in output}
    l2 = target.l2_bytes
    tiles = []
    for index in sorted(working, key=order.index):
        # Data reused across the other loops: each dense operand holding `index`.
        footprint = 0
        for access in term.factors:
            if infos[access.operand].format is None and index in access.indices:
                footprint += math.prod(dims[i] for i in access.indices if i != index)
        if footprint == 0:
            continue
        fits = (l2 // 2) // (footprint * itemsize)
        size = 1 << max(fits, 1).bit_length() - 1
        # A tile narrower than a few cache lines re-reads the sparse operand for little reuse.
        if MIN_TILE_BYTES // itemsize <= size and fits < dims[index]:
            tiles.append(Tile(index, size))
    return tuple(tiles)


def _panels(order: Sequence[str], tiles: Sequence[Tile], factors: list[Factor]) -> tuple[tuple[int, int], ...]:
    """(factor, tile size) of the dense factors re-laid out whose last index is tiled
    (see the module doc); not the outermost loop's tile, which is chunked instead."""
    sizes = {t.index: t.size for t in tiles if t.index != order[0]}
    return tuple((k, sizes[f.levels[-1][0]]) for k, f in enumerate(factors)
                 if not f.sparse and not f.natural and f.levels and f.levels[-1][0] in sizes)


def _register_tiled_order(
    order: tuple[str, ...], candidates: dict[tuple[str, ...], float], output: tuple[str, ...], term: Term, infos,
    dims: dict[str, int], layout: tuple[str, ...], anchor: int | None, itemsize: int, target: Target,
) -> tuple[str, ...] | None:
    """An order to run instead of the cheapest, ``order``, because it gets a register
    tile (see the module doc), or None: ``order`` with its innermost reduction ``d``
    and the output loop ``k`` above it swapped (the sums over ``d`` then stay in
    registers for a block of ``k`` instead of being summed across SIMD lanes, one dot
    product at a time: SDDMM's ``Q Kᵀ`` on a blocked pattern); else, when ``order``
    itself gets none, the cheapest of the ``candidates`` (order: cost) that does and
    costs at most :data:`REGISTER_TILE_MARGIN` times as much (a weight gradient
    ``Xᵀ dH`` over an expert's stored rows: ``e, d, c, h`` instead of ``e, c, d, h``)."""
    def tiled(o: tuple[str, ...]) -> bool:
        factors = nest_cost(term, o, infos, dims, layout)[2]
        if anchor is not None and not all(f.natural for f in factors if f.operand == anchor):
            return False
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


def _registers(
    nest: Nest, tiles: Sequence[Tile], output_order: tuple[str, ...], output: tuple[str, ...], factors: list[Factor],
    dims: dict[str, int], itemsize: int, target: Target,
) -> tuple[Tile | None, RegisterTile | None]:
    """The register block and register tile of ``nest``'s order under cache ``tiles``."""
    block = _register_block(output_order, nest.order, factors, tiles, dims, itemsize, target)
    return block, _register_tile(nest.order, output, factors, block, tiles, nest.parallel, dims, itemsize, target)


def _register_tile_over_cache_tiles(
    nest: Nest, output_order: tuple[str, ...], output: tuple[str, ...], factors: list[Factor], dims: dict[str, int],
    itemsize: int, target: Target, found: tuple[Tile | None, RegisterTile | None],
) -> tuple[Nest, Tile | None, RegisterTile | None]:
    """``nest`` without its cache tiles on a register tile's loops, with that register
    block and tile, when those cache tiles were what prevented it (a tile narrower than a
    register block splits it: e.g. 32 of the 64 rows and columns of a block SDDMM's
    blocks); else ``nest`` and ``found``. Values kept in registers across a reduction
    are worth more than an L2 tile of the same loops."""
    context = (output_order, output, factors, dims, itemsize, target)
    block, tile = _registers(nest, (), *context)
    if tile is None:
        return (nest, *found)
    kept = tuple(t for t in nest.tiles if t.index not in (block.index, tile.index))
    block, tile = _registers(nest, kept, *context)
    if tile is None:
        return (nest, *found)
    return replace(nest, tiles=kept, panels=_panels(nest.order, kept, factors)), block, tile


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


def _block_sums(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], block: Tile | None,
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
    lanes = target.lanes(itemsize)
    whole = min(block.size, dims[k] // lanes * lanes)  # a tile's blocks are whole vectors
    vectors = min(4 if target.vector_registers >= 32 else 2, whole // lanes)
    if vectors < 1:
        return None
    most = min(8, (target.vector_registers - 1 - vectors) // vectors)
    if most < 2:
        return None
    width = vectors * lanes
    if gathered_by is None:
        expected_rows = dims[a]
    else:
        gathering = factors[gathered_by]
        expected_rows = gathering.fibers[[i for i, _ in gathering.levels].index(a)]
    packed, panel, depth, stepped_by = _packed(order, r, factors, width, most, expected_rows, dims, itemsize, target)
    rows = most
    if gathered_by is None and not packed:  # packed, the rows past the last whole tile run from the panels
        rows = min(next((n for n in range(most, max(most // 2, 2) - 1, -1) if dims[a] % n == 0), most), dims[a])
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
    if steps < MIN_PACKED_REDUCTION or (stepping is not None and steps * CACHE_LINE_BYTES > target.l1_bytes // 2):
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


def _dot_tile(order: Sequence[str], output: tuple[str, ...], factors: list[Factor], reduction: VectorReduction | None,
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
    return DotTile(a, b, 4, 4 if target.vector_registers >= 32 else 2)


# ----------------------------------------------------------------------------- search


def _transposes(t: int, factors: list[Factor], term: Term) -> list:
    """((term, factor), mode order) for each factor read in other than its own order."""
    out = []
    for k, (f, access) in enumerate(zip(factors, term.factors)):
        if not f.natural:
            out.append(((t, k), tuple(access.indices.index(i) for i, _ in f.levels)))
    return out


def _nest_indices(term: Term, output: tuple[str, ...]) -> list[str]:
    return list(term.indices) + [i for i in output if i not in term.indices]


def schedule(
    assignment: Assignment,
    infos: Sequence[OperandInfo],
    output_format: Format | None,
    itemsize: int = 4,
    target: Target | None = None,
    anchor: int | None = None,
) -> Schedule:
    """Choose loop orders, workspace, tiles and every code decision for ``assignment``
    on ``target`` (the host by default; see module doc). ``anchor``: for a dense
    schedule whose values are written at that operand's positions, the operand: its
    storage order is the output's layout, and it is read in that order, never
    re-stored (its positions are the output's)."""
    target = Target.current() if target is None else target
    dims: dict[str, int] = {}
    for access in assignment.accesses:  # an output index may be the epilogue's only
        for m, index in enumerate(access.indices):
            dims[index] = infos[access.operand].shape[m]
    if output_format is None:
        sched = _schedule_dense(assignment, infos, dims, itemsize, target, anchor)
        tiled = any(n.register_tile or n.dot_tile for n in sched.nests)
        if tiled and target.widest_vector_bytes > target.vector_bytes:
            target = replace(target, vector_bytes=target.widest_vector_bytes)  # see the module doc
            sched = _schedule_dense(assignment, infos, dims, itemsize, target, anchor)
    else:
        sched = _schedule_sparse(assignment, infos, dims, output_format, target)
    return replace(sched, serial=sched.leaves < target.parallel_min_work, prefetch_policy=PrefetchPolicy.of(target),
                   target=target)


def _dense_decisions(nest: Nest, n: int, factors: list[Factor], assignment: Assignment, target: Target) -> Nest:
    """``nest`` (the ``n``-th) of a dense output with its code decisions."""
    output = assignment.output
    order, f = nest.order, [x.nest_factor() for x in factors]
    block = nest.register_block
    bounded = {t.index for t in nest.tiles if not order or t.index != order[0]}
    fields = {"prefetch": decisions.prefetch_loops(
        order, f, bounded, block and block.index, decisions.reductions_from(order, output, len(order) - 1)),
        "simd": decisions.simd_loop(order, output, f)}
    if block is None and not _scalar(assignment, nest.term):
        fields |= {
            "vector_reduction": decisions.vector_reduction(order, output, f, target),
            "sparse_reduction": decisions.sparse_reduction(order, output, f, target),
            "row_block": decisions.row_block(order, output, f, target),
        }
        fields["dot_tile"] = _dot_tile(order, output, factors, fields["vector_reduction"], nest.tiles, target)
    elif assignment.reduction != "sum" and assignment.terms[nest.term].value == notation.Factor(0):
        fields["vector_reduction"] = decisions.extremum_reduction(order, output, f, target)
    layered = nest.register_tile is not None and nest.register_tile.depth > 0  # its layers add partial sums
    if n == 0 and not layered:
        tiles = [t.index for t in nest.tiles]
        fields["stores_once"] = decisions.stores_once(order, output, f, tiles, block is not None, None)
        term = assignment.terms[nest.term]
        fields["stores_once_anchors"] = tuple(sorted({
            a.operand for k, a in enumerate(term.factors)
            if a.indices == output and f[k].sparse
            and k == next(j for j, b in enumerate(term.factors) if b.operand == a.operand and b.indices == output)
            and decisions.stores_once(order, output, f, tiles, block is not None, k)
        }))
    return replace(nest, **fields)


def _team_loops(nest: Nest, factors: list[Factor], output: tuple[str, ...], dims: dict[str, int]) -> int:
    """:func:`decisions.team_loops` of a parallel dense-output nest, every code decision made."""
    held = {t.index for t in nest.tiles} | {loop.index for loop in nest.prefetch}
    held |= {i for i in (nest.register_block and nest.register_block.index,
                         nest.register_tile and nest.register_tile.index,
                         *((nest.dot_tile.rows, nest.dot_tile.cols) if nest.dot_tile else ())) if i is not None}
    if nest.epilogue_at is not None:
        held |= set(nest.order[nest.epilogue_at:])
    return decisions.team_loops(nest.order, output, [x.nest_factor() for x in factors], dims, held)


def _scalar(assignment: Assignment, t: int) -> bool:
    """Term ``t`` runs without micro-kernels (register blocks and tiles, vector and
    sparse reductions, row blocks): its value is not a product of factors (some of them
    may count for their patterns only, :attr:`~..notation.Term.multiplied`), or the
    reduction is not a sum."""
    return assignment.terms[t].multiplied is None or assignment.reduction != "sum"


def _epilogue_at(nest: Nest, output: tuple[str, ...], factors: list[Factor]) -> int | None:
    """Where a single nest fuses the epilogue (see :mod:`..lower.epilogue`): after its
    leading output loops, each visiting every coordinate, and outside any register or
    dot tile; None if there are no such loops."""
    order, f = nest.order, [x.nest_factor() for x in factors]
    p = 0
    while p < len(order) and order[p] in output and not any(x.filters(order[p]) for x in f):
        p += 1
    for tiled in (nest.register_tile and nest.register_tile.index, nest.dot_tile and nest.dot_tile.rows):
        if tiled is not None:
            p = min(p, order.index(tiled))
    return p if p > 0 else None


def _anchored_orders(term: Term, candidates: list[tuple[str, ...]], anchor: int, infos, dims,
                     layout: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The candidates reading the anchor in its storage order; if none does (a greedy
    search), the best one with the anchor's indices moved to its front in that order."""
    def natural(order) -> bool:
        return all(f.natural for f in nest_cost(term, order, infos, dims, layout)[2] if f.operand == anchor)

    kept = [o for o in candidates if natural(o)]
    if kept:
        return kept
    held = layout  # the anchor's indices in its storage order
    return [tuple(held) + tuple(i for i in candidates[0] if i not in held)]


def _schedule_dense(assignment, infos, dims, itemsize, target: Target, anchor: int | None) -> Schedule:
    nests, transposes, reasons, total, leaf_total = [], [], [], 0.0, 0.0
    nest_factors = []
    output_order, costliest = assignment.output, -1.0
    layout = assignment.output
    if anchor is not None:
        layout = tuple(assignment.output[m] for m in infos[anchor].format.mode_order)
    for t, term in enumerate(assignment.terms):
        indices = _nest_indices(term, assignment.output)

        def cost_of(order, term=term):
            cost = nest_cost(term, order, infos, dims, layout, target.lanes(itemsize))[0]
            parallel = bool(order) and order[0] in assignment.output
            return cost if parallel else cost * SERIAL_PENALTY

        candidates = _orders(indices, cost_of, _storage_orders(term, infos))
        if anchor is not None:
            candidates = _anchored_orders(term, candidates, anchor, infos, dims, layout)
        costs = {o: cost_of(o) for o in candidates}
        best = min(candidates, key=lambda o: costs[o])
        if assignment.epilogue is None and not _scalar(assignment, t):
            tiled = _register_tiled_order(best, costs, assignment.output, term, infos, dims, layout, anchor, itemsize,
                                          target)
            if tiled is not None:
                costs[tiled] = cost_of(tiled)
                best = tiled
        _, leaves, factors = nest_cost(term, best, infos, dims, layout)
        leaf_total += leaves
        tiles = _tiles(term, assignment.output, best, factors, infos, dims, itemsize, target)
        parallel = bool(best) and best[0] in assignment.output
        nests.append(Nest(t, best, tiles, parallel, costs[best], panels=_panels(best, tiles, factors)))
        nest_factors.append(factors)
        transposes += _transposes(t, factors, term)
        total += costs[best]
        reasons.append(_explain_choice(t, best, costs, factors, parallel))
        if costs[best] > costliest:  # the output is laid out in its costliest nest's loop order
            output_order, costliest = tuple(sorted(assignment.output, key=best.index)), costs[best]
    # Register blocks need the output's layout, known once every nest is chosen.
    blocked = []
    for nest, factors in zip(nests, nest_factors):
        if _scalar(assignment, nest.term):
            blocked.append(nest)
            continue
        context = (output_order, assignment.output, factors, dims, itemsize, target)
        block, tile = _registers(nest, nest.tiles, *context)
        if tile is None and nest.tiles:
            nest, block, tile = _register_tile_over_cache_tiles(nest, *context, (block, tile))
        if tile is not None and tile.packed and any(t.index == block.index for t in nest.tiles):
            # The panels replace the cache tile of k: the register block need not fit in it.
            wider = _registers(nest, tuple(t for t in nest.tiles if t.index != block.index), *context)
            if wider[1] is not None and wider[1].packed:
                block, tile = wider
        cost = nest.cost
        if tile is not None:
            block = Tile(block.index, tile.vectors * target.lanes(itemsize))
            reasons.append(f"term {nest.term}: register tile of {tile.rows} rows of {tile.index} x {tile.vectors} "
                           f"vectors of {block.index} ({target.vector_registers} vector registers)")
            if tile.packed:  # the panels replace a tile of k; the pack, and scalar loads, read any layout
                in_place = {n for n, f in enumerate(factors)
                            if not f.sparse and (n in tile.packed or block.index not in (i for i, _ in f.levels))}
                transposes = [((t, k), mode_order) for (t, k), mode_order in transposes
                              if t != nest.term or k not in in_place]
                tiles = tuple(t for t in nest.tiles if t.index != block.index)
                nest = replace(nest, tiles=tiles, panels=_panels(nest.order, tiles, factors))
                cost /= GEMM_SPEEDUP
                total -= nest.cost - cost
                reasons.append(f"term {nest.term}: factor(s) {list(tile.packed)} packed per thread: costed as a "
                               f"dense GEMM (cost / {GEMM_SPEEDUP:g})")
        sums = _block_sums(nest.order, assignment.output, factors, block, tile, itemsize, target)
        blocked.append(replace(nest, register_block=block, register_tile=tile, block_sums=sums, cost=cost))
    nests = [_dense_decisions(nest, n, factors, assignment, target)
             for n, (nest, factors) in enumerate(zip(blocked, nest_factors))]
    if assignment.epilogue is not None and len(nests) == 1:
        nests[0] = replace(nests[0], epilogue_at=_epilogue_at(nests[0], assignment.output, nest_factors[0]))
    nests = [replace(nest, team_loops=_team_loops(nest, factors, assignment.output, dims)) if nest.parallel else nest
             for nest, factors in zip(nests, nest_factors)]
    wide = target.wide_register_block_vectors
    for nest in nests:
        if nest.register_block is not None and nest.register_tile is None:
            block = nest.register_block
            vectors = block.size // target.lanes(itemsize)
            why = "tile" if vectors == wide else "do not tile"
            masked = "; the last, partial block masked" if dims[block.index] % block.size else ""
            sums = f"; {nest.block_sums} interleaved sums" if nest.block_sums > 1 else ""
            reasons.append(
                f"term {nest.term}: register block of {block.size} over {block.index} ({vectors} vectors: "
                f"{wide}-vector blocks {why} {block.index} exactly{masked}{sums})"
            )
    return Schedule(
        None, output_order, (), tuple(nests), None, tuple(transposes), total, tuple(reasons), leaf_total
    )


def _schedule_sparse(assignment, infos, dims, output_format: Format, target: Target) -> Schedule:
    out_order = tuple(assignment.output[m] for m in output_format.mode_order)
    best = None
    for p in range(decisions.inserted_levels(output_format), len(out_order) + 1):
        shared = out_order[:p]
        rest = out_order[p:]
        nests, transposes, reasons, total = [], [], [], 0.0
        leaf_total = 0.0
        for t, term in enumerate(assignment.terms):
            local = [i for i in _nest_indices(term, assignment.output) if i not in shared]
            candidates = _orders(local, lambda o, term=term: nest_cost(term, shared + o, infos, dims)[0],
                                 _storage_orders(term, infos))
            costs = {o: nest_cost(term, shared + o, infos, dims)[0] for o in candidates}
            order = min(candidates, key=lambda o: costs[o])
            _, leaves, factors = nest_cost(term, shared + order, infos, dims)
            prefetch = decisions.prefetch_loops(order, [f.nest_factor() for f in factors], set(), None, 0)
            nests.append(Nest(t, order, (), p > 0, costs[order], prefetch=prefetch))
            transposes += _transposes(t, factors, term)
            reasons.append(_explain_choice(t, shared + order, {shared + o: c for o, c in costs.items()}, factors, p > 0))
            total += costs[order]
            leaf_total += leaves
        workspace = None
        if rest:
            size = math.prod(dims[i] for i in rest)
            kind = "dense" if size <= DENSE_WORKSPACE_LIMIT else "sparse"
            outer = max(math.prod(dims[i] for i in shared), 1)
            per_row = max(min(leaf_total / outer, size), 1.0)
            drain = leaf_total * math.log2(per_row + 2)
            if kind == "sparse":
                drain *= SPARSE_ACCUMULATOR_COST
            total += drain + leaf_total
            workspace = Workspace(kind, rest, size)
        if p == 0:
            total *= SERIAL_PENALTY
        reasons.append(
            f"shared output loops {list(shared)}"
            + (f", {workspace.kind} workspace over {list(rest)}" if workspace else ", no workspace")
            + f": cost {total:.3g}"
        )
        assembly = decisions.output_assembly(output_format, None if workspace is None else workspace.kind)
        candidate = Schedule(
            output_format, out_order, shared, tuple(nests), workspace, tuple(transposes), total,
            tuple(reasons), leaf_total, assembly=assembly,
            union_by_points=decisions.union_by_points(len(assignment.terms)),
        )
        if best is None or candidate.cost < best.cost:
            best = candidate
    return best


def _explain_choice(t, best, costs, factors, parallel) -> str:
    ranked = sorted(costs.items(), key=lambda kv: kv[1])
    runner = f"; next best {','.join(ranked[1][0])} (cost {ranked[1][1]:.3g})" if len(ranked) > 1 else ""
    filters = [
        f"{i}: {sum(1 for f in factors if f.nest_factor().filters(i))} sparse level(s)"
        for i in best
    ]
    moved = [f.operand for f in factors if f.sparse and not f.natural]
    text = (
        f"term {t}: order {','.join(best)} (cost {costs[best]:.3g}{runner}); "
        f"filters {'; '.join(filters)}; {'parallel' if parallel else 'serial'} outer loop"
    )
    if moved:
        text += f"; re-stores operand(s) {moved} in loop order (transpose)"
    return text
