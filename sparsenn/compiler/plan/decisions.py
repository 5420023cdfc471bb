"""Per-nest code decisions: what the lowerer does inside a chosen loop order.

Given a nest's loop order and its factors read in that order (:class:`NestFactor`),
these functions decide, from the :class:`~.target.Target` and level capabilities only:

* **Vector reduction.** A nest's innermost reduction loop over an index that every
  summed factor holding it reads with unit stride (dense operands laid out with it
  last, sparse ones whose last level, over it, is dense: a block's columns) runs
  ``register_block_vectors`` independent SIMD accumulators (one would wait on each
  add's latency), then single vectors, a tree over the lanes, then scalars.
* **Max and min over a factor.** ``max_k X`` (or ``min``) whose innermost reduction
  loop reads ``X`` with unit stride (a dense operand laid out with ``k`` last, or a
  last level over ``k`` that is dense) runs as a vector reduction too, each lane
  combining as ``sn_max`` does (a NaN wins), then a tree over the lanes.
* **Sparse reduction.** An innermost reduction loop driven by one unique, branching
  sparse level (a compressed fiber; the other factors indexed there locate dense
  levels) sums into up to ``sparse_accumulators`` interleaved sums, as many as its fibers
  are long: position ``q`` feeds sum ``q mod A``. When the level is the driving factor's last and the other factors are
  dense, whole vectors of positions go first: the values loaded as a vector, the dense
  factors gathered at the vector of coordinates (an SpMV's ``x[crd[q]]``).
* **Row block.** A loop over such a fiber whose body is an innermost vector reduction
  with some factors not indexed by the fiber (SDDMM's ``X[i, :]`` for each ``Y[j, :]``)
  takes ``row_block`` positions at a time: the common factors are loaded once per
  block, each position sums into ``row_block_vectors`` SIMD accumulators and one
  transpose-and-add gives the block's sums.
* **Prefetch.** A loop driven by one sparse level may prefetch the spans of dense
  operands ``d[P, j, T]`` its next positions will gather (``P`` bound by enclosing
  loops, ``T`` swept by the loops inside: whole rows, a tile or the open register
  block). Whether it does is decided per fiber at run time (see :class:`PrefetchPolicy`).
* **Store once.** The first nest of a dense output stores each element exactly once
  when the loops outside its trailing reductions are all of the output's indices (for
  a register block: and the blocked index), each visits every coordinate (no factor
  but a sampled output's anchor has a non-locatable level over an output index) and no
  tile splits a reduction; it then stores with ``=`` and the output needs no zeroing.
* **Team loops.** A parallel nest's threads share the coordinates of its outermost
  loop, cut into chunks. When that loop has fewer than the target's
  ``team_coordinates`` coordinates (one batch, a few heads), the next loops join it
  while they are output loops over locatable levels only (every coordinate visited,
  none filtered) that no tile, register or dot tile, prefetch or fused epilogue holds:
  the team then shares their flattened coordinates, each iteration decomposing its own.
* **Independent iterations.** A dense output's innermost loop over an output index
  that no stored level filters writes a different output element per iteration: its
  dense loop carries ``omp simd`` (the compiler vectorises only what the code asks for).
* **Union loops** (sparse outputs of several terms). The shared loops co-iterate the
  terms' union along its merge lattice, one loop per point (per set of terms still
  live: ``2^k - 1`` loops of ``k`` terms, each testing only its own cursors) up to
  :data:`MAX_LATTICE_TERMS` terms; beyond, the points are collapsed into one loop that
  tests every cursor for exhaustion (fewer, shorter loops than multiplying the body).
* **Output assembly** (sparse outputs). The output's leading levels that are inserted
  (located: every coordinate present, no arrays) come first, the rest are appended.
  With one or more inserted levels then one appended level (CSR and its analogues of
  any rank, each row of which one chunk of work writes) and no sparse workspace, the
  output is written in **two phases**: the loops run once for the pattern, counting
  each row's entries (their prefix sums are the row offsets and the exact output
  size), then again with values, writing each row straight into the caller's arrays.
  Otherwise each chunk **appends** its coordinates, per-parent counts and values into
  its own buffers, which are copied out in parallel afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsenn.formats import Format
from sparsenn.formats.level import Level

from .target import Target

__all__ = [
    "NestFactor", "VectorReduction", "SparseReduction", "RowBlock", "PrefetchLoop", "PrefetchPolicy",
    "reductions_from", "driver", "unit_stride_factors", "vector_reduction", "extremum_reduction", "sparse_reduction",
    "gathered_reduction", "row_block",
    "prefetch_loops", "stores_once", "team_loops", "contiguous_factors", "simd_loop",
    "union_by_points",
    "MAX_LATTICE_TERMS", "OutputAssembly", "inserted_levels", "output_assembly",
]


@dataclass(frozen=True)
class NestFactor:
    """A factor read in loop order: its storage levels as (index, level) for a sparse
    operand, or its indices in layout order for a dense one (``sparse`` False)."""

    operand: int
    sparse: bool
    levels: tuple[tuple[str, Level], ...]

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(i for i, _ in self.levels)

    def level_at(self, index: str) -> Level | None:
        return next((lvl for i, lvl in self.levels if i == index), None)

    def filters(self, index: str) -> bool:
        """Whether a stored (non-locatable) level of this factor is over ``index``."""
        level = self.level_at(index)
        return self.sparse and level is not None and not level.locatable


@dataclass(frozen=True)
class VectorReduction:
    index: str
    accumulators: int
    vectors: tuple[int, ...]  # the factors loaded as SIMD vectors


@dataclass(frozen=True)
class SparseReduction:
    index: str
    accumulators: int
    gathered: bool = False  # positions SIMD lanes at a time, the dense factors gathered


@dataclass(frozen=True)
class RowBlock:
    index: str  # the loop over stored entries taken ``size`` at a time
    inner: str  # the vector reduction inside
    size: int
    vectors: int  # SIMD accumulators per entry
    loads: tuple[int, ...]  # the factors loaded as SIMD vectors in the inner loop


@dataclass(frozen=True)
class PrefetchLoop:
    """Loop ``index`` may prefetch the rows of these factors (term-local numbers)."""

    index: str
    factors: tuple[int, ...]


@dataclass(frozen=True)
class PrefetchPolicy:
    """The run-time test of a prefetching loop: gathered operands larger than
    ``min_bytes`` (the L2) are prefetched ``ahead_bytes`` ahead (at most
    ``max_distance`` positions, ``max_bytes`` of each span); from ``large_bytes`` when
    the coordinate ``D`` positions ahead is ``min_jump`` or more away (near ones are
    streamed by the hardware), below it only for fibers spread over half the range."""

    min_bytes: int
    large_bytes: int
    min_jump: int
    ahead_bytes: int
    max_distance: int
    max_bytes: int

    @staticmethod
    def of(target: Target) -> PrefetchPolicy:
        return PrefetchPolicy(
            target.l2_bytes, int(target.llc_bytes * target.prefetch_min_footprint), target.prefetch_min_jump,
            target.prefetch_ahead_bytes, target.prefetch_max_distance, target.prefetch_max_bytes,
        )


def reductions_from(order: Sequence[str], output: Sequence[str], end: int) -> int:
    """Where the run of reduction (non-output) loops just before ``order[end]`` starts."""
    while end > 0 and order[end - 1] not in output:
        end -= 1
    return end


def driver(index: str, factors: Sequence[NestFactor]) -> int | None:
    """The factor whose unique, branching sparse level alone drives loop ``index``."""
    sparse = [k for k, f in enumerate(factors) if f.filters(index)]
    if len(sparse) != 1:
        return None
    level = factors[sparse[0]].level_at(index)
    return sparse[0] if level.unique and not level.branchless else None


def unit_stride_factors(index: str, factors: Sequence[NestFactor], among: Sequence[int]) -> list[int]:
    """The factors of ``among`` indexed by ``index`` if every one is a dense operand
    with ``index`` last and no sparse factor has it; else []."""
    if any(f.sparse and index in f.indices for f in factors):
        return []
    holding = [k for k in among if index in factors[k].indices]
    if not holding or any(factors[k].indices[-1] != index for k in holding):
        return []
    return holding


def summed_factors(order: Sequence[str], output: Sequence[str], factors: Sequence[NestFactor]) -> list[int]:
    """The factors varying inside the trailing reduction loops (empty if there are none)."""
    inner = set(order[reductions_from(order, output, len(order)):])
    return [k for k, f in enumerate(factors) if inner & set(f.indices)] if inner else []


def vector_reduction(order, output, factors, target: Target) -> VectorReduction | None:
    summed = summed_factors(order, output, factors)
    vectors = contiguous_factors(order[-1], factors, summed) if summed else []
    return VectorReduction(order[-1], target.register_block_vectors, tuple(vectors)) if vectors else None


def contiguous_factors(index: str, factors: Sequence[NestFactor], among: Sequence[int]) -> list[int]:
    """The factors of ``among`` indexed by ``index`` if each one reads contiguous values
    along it: a dense operand with ``index`` last, or a sparse one whose last level,
    over ``index``, is dense (a block's columns); and no other sparse factor has it;
    else []."""
    def contiguous(f: NestFactor) -> bool:
        if not f.sparse:
            return f.indices[-1] == index
        index_last, level = f.levels[-1]
        return index_last == index and level.full and level.locatable

    holding = [k for k in among if index in factors[k].indices]
    if any(f.sparse and index in f.indices and k not in holding for k, f in enumerate(factors)):
        return []
    return holding if holding and all(contiguous(factors[k]) for k in holding) else []


def extremum_reduction(order, output, factors, target: Target) -> VectorReduction | None:
    """The vector reduction of ``max_k X`` / ``min_k X`` (one factor; see the module doc)."""
    if len(factors) != 1 or not order or order[-1] in output:
        return None
    k = order[-1]
    return VectorReduction(k, target.register_block_vectors, (0,)) if contiguous_factors(k, factors, [0]) else None


def sparse_reduction(order, output, factors, target: Target, fiber: float) -> SparseReduction | None:
    """The sparse reduction of the innermost loop (see the module doc), over fibers of
    ``fiber`` positions on average: one interleaved sum per ``cost_vector_lanes``
    positions, at least one and at most the target's ``sparse_accumulators`` (a shorter
    chain of adds overlaps the next fiber's in the out-of-order window; more sums would
    only cost their setup and combining)."""
    summed = summed_factors(order, output, factors)
    k = driver(order[-1], factors) if summed else None
    if k is None:
        return None
    sums = max(1, min(target.sparse_accumulators, int(fiber // target.cost_vector_lanes)))
    return SparseReduction(order[-1], sums, gathered_reduction(order, output, factors))


def gathered_reduction(order, output, factors) -> bool:
    """Whether the innermost loop is a sparse reduction run SIMD lanes of positions at a
    time (see the module doc): one sparse factor drives it by its last level, every
    other factor summed is dense (gathered at the coordinates)."""
    summed = summed_factors(order, output, factors)
    k = driver(order[-1], factors) if summed else None
    return k is not None and factors[k].indices[-1] == order[-1] and all(
        not factors[n].sparse for n in summed if n != k)


def row_block(order, output, factors, target: Target) -> RowBlock | None:
    summed = summed_factors(order, output, factors)
    if len(order) < 2 or not summed or target.row_block < 2 or driver(order[-2], factors) is None:
        return None
    vectors = unit_stride_factors(order[-1], factors, summed)
    common = [k for k in vectors if order[-2] not in factors[k].indices]
    if not common or len(common) == len(vectors):
        return None
    return RowBlock(order[-2], order[-1], target.row_block, target.row_block_vectors, tuple(vectors))


def prefetch_loops(
    order: Sequence[str], factors: Sequence[NestFactor], bounded: set[str], block: str | None, block_from: int,
) -> tuple[PrefetchLoop, ...]:
    """Loops driven by one sparse level and the dense factors whose spans they gather
    (see the module doc). ``bounded``: tiled indices; ``block``: the register-blocked
    index, open in loops from position ``block_from``."""
    loops = []
    for position, index in enumerate(order):
        if sum(f.filters(index) for f in factors) != 1:
            continue
        enclosing, inner = set(order[:position]), order[position + 1:]
        gathered = []
        for k, f in enumerate(factors):
            if f.sparse or index not in f.indices:
                continue
            n = f.indices.index(index)
            prefix, trailing = f.indices[:n], f.indices[n + 1:]
            if not trailing or not set(prefix) <= enclosing:
                continue
            last = trailing[-1]
            spans = (
                len(trailing) == 1 and last in inner
                and (last in bounded or (last == block and position >= block_from))
            ) or (all(t in inner for t in trailing) and not set(trailing) & (bounded | {block}))
            if spans:
                gathered.append(k)
        if gathered:
            loops.append(PrefetchLoop(index, tuple(gathered)))
    return tuple(loops)


def team_loops(order: Sequence[str], output: Sequence[str], factors: Sequence[NestFactor], dims: dict[str, int],
               held: set[str], target: Target) -> int:
    """How many leading loops of a parallel nest the team shares (see the module doc);
    ``held``: the indices a tile, register or dot tile, prefetch or epilogue holds."""
    def joins(index: str) -> bool:
        return index in output and index not in held and not any(f.filters(index) for f in factors)

    if not order or not joins(order[0]):
        return 1
    count, extent = 1, dims[order[0]]
    while count < len(order) and extent < target.team_coordinates and joins(order[count]):
        extent *= dims[order[count]]
        count += 1
    return count


def simd_loop(order: Sequence[str], output: Sequence[str], factors: Sequence[NestFactor]) -> str | None:
    """The innermost loop of a dense output's nest if its iterations are independent
    (see the module doc), else None."""
    index = order[-1] if order else None
    if index is None or index not in output or any(f.filters(index) for f in factors):
        return None
    return index


def stores_once(
    order: Sequence[str], output: Sequence[str], factors: Sequence[NestFactor], tiles: Sequence[str],
    blocked: bool, anchors: frozenset[int] = frozenset(),
) -> bool:
    """Whether the nest stores every output element once (see the module doc), with
    the factors ``anchors`` (if any) sampling the output at the same points."""
    if blocked:
        loops = (*order[: reductions_from(order, output, len(order) - 1)], order[-1])
    else:
        loops = order[: reductions_from(order, output, len(order))]
    if set(loops) != set(output) or any(t not in output for t in tiles):
        return False
    return not any(f.filters(i) for k, f in enumerate(factors) if k not in anchors for i in output)


MAX_LATTICE_TERMS = 2


def union_by_points(terms: int) -> bool:
    """Whether a union of ``terms`` terms loops per lattice point (see the module doc)."""
    return terms <= MAX_LATTICE_TERMS


@dataclass(frozen=True)
class OutputAssembly:
    """How a sparse output is written (see the module doc): ``inserted`` leading levels,
    then appended ones, in two phases or by appending chunks."""

    inserted: int
    two_phase: bool

    def describe(self) -> str:
        if self.two_phase:
            return (f"output assembly: two phases (count each row's entries, then write rows in place), "
                    f"{self.inserted} inserted level(s)")
        return f"output assembly: appended per chunk, copied out after; {self.inserted} inserted level(s)"


def inserted_levels(output_format: Format) -> int:
    """The number of leading levels of ``output_format`` written by insertion."""
    levels = output_format.levels
    return next((n for n, level in enumerate(levels) if level.assembly != "insert"), len(levels))


def output_assembly(output_format: Format, workspace_kind: str | None) -> OutputAssembly:
    """The assembly of ``output_format`` with a workspace of ``workspace_kind`` (or none)."""
    inserted = inserted_levels(output_format)
    appended = output_format.levels[inserted:]
    if not all(level.assembly == "append" and level.has_pos for level in appended):
        raise ValueError(f"kernels assemble inserted levels then compressed ones, not {output_format}: "
                         "the planner asks for the closest such format and converts the result")
    two_phase = inserted >= 1 and len(appended) == 1 and workspace_kind in (None, "dense")
    return OutputAssembly(inserted, two_phase)
