"""What the scheduler decides (:mod:`.schedule`): a :class:`Schedule` of loop nests,
each :class:`Nest` with its loop order, tiles, micro-kernel (:mod:`.microkernel`) and
code decisions (:mod:`.decisions`), and the workspace of a sparse output; each says
what it decided with :meth:`describe`."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsenn.formats import Format

from .decisions import OutputAssembly, PrefetchLoop, PrefetchPolicy, RowBlock, SparseReduction, VectorReduction
from .block_pack import PackedBlock
from .microkernel import DotTile, RegisterTile, Tile
from .target import Target

__all__ = ["Nest", "Workspace", "Schedule"]


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
    packed_block: PackedBlock | None = None  # ... or its vector factor packed per thread (plan/block_pack.py)
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
            grouped = "" if t.grouped_by is None else f", each row through its own groups of factor {t.grouped_by}"
            parts.append(f"register tile: {t.rows} x {t.vectors} vectors ({t.index} by {rows}{grouped})")
            if t.packed:
                depth = f" x {t.depth} {self.order[self.order.index(t.index) + 1]}" if t.depth else ""
                stepped = "" if t.stepped_by is None else f" over the stored coordinates of factor {t.stepped_by}"
                rows = f", {t.row_block} rows of {t.index} per block" if t.row_block else ""
                transposed = f" ({list(t.transposed)} from its own layout)" if t.transposed else ""
                ahead = "; prefetching the next tile's stored entries and output rows" if t.prefetch_next else ""
                parts.append(f"factor(s) {list(t.packed)} packed per thread{transposed} in panels of {t.panel} "
                             f"{self.register_block.index}{depth}{stepped}{rows}{ahead}")
        if self.packed_block:
            p = self.packed_block
            parts.append(f"factor {p.factor} packed per thread from its own layout in panels of {p.panel} "
                         f"{self.register_block.index}")
        if self.vector_reduction:
            v = self.vector_reduction
            parts.append(f"vector reduction over {v.index} ({v.accumulators} accumulators)")
        if self.dot_tile:
            t = self.dot_tile
            parts.append(f"dot tile: {t.row_count} x {t.col_count} sums ({t.rows} by {t.row_count}, {t.cols} by "
                         f"{t.col_count})")
        if self.sparse_reduction:
            r = self.sparse_reduction
            gathered = ", whole vectors of entries first, gathered" if r.gathered else ""
            parts.append(f"sparse reduction over {r.index} ({r.accumulators} accumulators{gathered})")
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
    patterns: tuple[int | None, ...] = ()  # per operand, the earlier one whose index arrays it shares


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
