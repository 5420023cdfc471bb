"""The machine model: what the scheduler and lowerer may assume about the CPU.

A :class:`Target` is read once from the host (:meth:`Target.host`) and passed
explicitly to the stages that depend on the machine. Plans are made for
:meth:`Target.current`: the host's, or one given with ``sparsenn.compiler.use_target``
(tests construct one, e.g. ``Target(l2_bytes=512 << 10)``, so that a schedule never
depends on where the suite runs).

* **Vectors.** ``vector_bytes`` is the SIMD width the kernels are written for: 32 bytes
  on x86-64 with AVX2 (also on AVX-512 hosts, where GCC's ``-march=native`` prefers
  256-bit vectors too), 16 on SSE-only x86-64 and on aarch64 (NEON).
  ``widest_vector_bytes`` is the widest the CPU has (64 with AVX-512): kernels with a
  register tile, or a register block wider than one ``vector_bytes`` vector, which are
  bound by their multiply-adds and loads, are written for it.
* **Caches.** ``l1_bytes`` is one core's L1 data cache: a packed register tile's rows
  over one pack's depth of the reduction stay in half of it. ``l2_bytes`` is one
  core's private L2, the budget for tiles (half of it) and the size under which
  gathered operands are not prefetched; ``llc_bytes`` the shared last-level cache.
* **Register blocks.** An output row strip-mined into registers takes
  ``wide_register_block_vectors`` SIMD vectors when they divide it, else
  ``register_block_vectors``; independent accumulators of a vector reduction:
  ``register_block_vectors``. ``vector_registers`` (16 with AVX2, 32 with AVX-512's
  VL registers and on aarch64) bounds a 2-D register tile: ``rows x vectors``
  accumulators plus ``vectors`` loads and one broadcast, with at most
  :attr:`~Target.register_tile_vectors` vectors and ``register_tile_rows`` rows; a dot
  tile of sums is :attr:`~Target.dot_tile` rows x columns.
* **Reductions over stored entries.** ``sparse_accumulators`` interleaved sums (also
  the independent chains of adds a register block of few vectors over a fiber makes); a
  row block of ``row_block`` stored entries shares the loads of the factors they have
  in common, with ``row_block_vectors`` SIMD accumulators per entry; a reduction that
  gathers its dense factors at the stored coordinates keeps ``gathered_vectors`` SIMD
  sums (a gather's latency is long).
* **Cache lines.** ``cache_line_bytes``: a cache tile spans at least two lines; a
  reduction stepped through a fiber reads one line of each row per step. A packed
  panel's copy prefetches the strip's row ``pack_prefetch_rows`` ahead (a row length
  apart: too far for the hardware's stride prefetcher).
* **Prefetch.** A loop over a fiber whose gathered dense operands exceed the L2
  prefetches ``prefetch_ahead_bytes`` ahead (at most ``prefetch_max_distance``
  positions, ``prefetch_max_bytes`` of each span): always when the operands take
  ``prefetch_min_footprint`` of the last-level cache and the coordinate ahead is at
  least ``prefetch_min_jump`` away, else only for fibers spread over half the range.
* **Threads.** Nests with fewer than ``parallel_min_work`` expected innermost
  iterations run on one thread: waking an OpenMP team costs more than the work. A
  parallel loop is cut into ``chunks_per_thread`` chunks of equal work per thread, or
  ``even_range_chunks_per_thread`` of equal coordinate ranges; a team shares leading
  output loops until they span ``team_coordinates`` coordinates.
* **Cycles.** What the dense path (``plan/dense_path.py``) weighs a sparse schedule
  against: ``fma_per_cycle`` vector multiply-adds issued per cycle, of which a BLAS
  product reaches ``gemm_efficiency`` (the host's measured from torch's GEMM:
  ``plan/calibrate.py``) over whole register tiles of ``blas_tile_vectors`` widest
  vectors along its result's rows; ``l2_bytes_per_cycle``, ``llc_bytes_per_cycle``
  and ``dram_bytes_per_cycle`` one core streams from its L2, the last-level cache (of
  which it can count on ``llc_share``: the rest belongs to other cores, and on a VM to
  other tenants) and memory, ``gather_bytes_per_cycle`` it gathers rows at random
  coordinates from its L2 at (no stream for the prefetcher to follow: 17-20 for rows of
  256 B to 1 KiB on a Zen 3, which streams 32); ``cycles_per_cost_unit``
  the cycles of one unit of the scheduler's cost model (``plan/cost.py``: an SpMV costs
  about 6 units per stored entry, 1.5 cycles), in which a vectorised loop does
  ``cost_vector_lanes`` values a step (the calibration's fp32 on 32-byte vectors, kept
  for every dtype and width: the costs it weighs against, BLAS and contraction paths,
  do not see the width either); ``python_call_cycles`` the cycles of a torch call
  made from Python (its dispatch and checks: an autograd node's forward or backward, a
  BLAS call in place of a fused kernel) beyond a kernel's launch, ``dense_call_cycles``
  those of the per-call dense path's own work beyond a kernel's launch (finding the
  kept copy and comparing its snapshot, the BLAS call, the result checked finite, the
  Python around them: 27-37 µs against a kernel's launch on a Zen 3, measured on a
  layer of 8 inputs and 2 outputs; the upper value, as the cost of checking a large
  kept copy is counted low), ``launch_cycles`` those of a kernel's launch beyond a torch op's
  (the call's guard, the launcher: what a sparse layer pays over ``F.linear``), and
  ``relayout_cycles`` those of copying a dense operand into a kernel's layout beyond
  its elements (an allocation and a torch copy call, or finding a parameter's kept
  copy): the fixed costs the scheduler weighs against work on small problems.
"""

from __future__ import annotations

import os
import platform
from contextvars import ContextVar
from dataclasses import dataclass, replace
from functools import lru_cache

__all__ = ["Target"]

_SYSFS_CACHES = "/sys/devices/system/cpu/cpu0/cache"


@dataclass(frozen=True)
class Target:
    """A CPU as the compiler models it (see the module docstring for each field)."""

    vector_bytes: int = 32
    widest_vector_bytes: int | None = None  # None: vector_bytes
    l1_bytes: int = 32 << 10
    l2_bytes: int = 1 << 20
    llc_bytes: int = 8 << 20
    register_block_vectors: int = 4
    wide_register_block_vectors: int = 8
    vector_registers: int = 16
    sparse_accumulators: int = 4
    row_block: int = 4
    row_block_vectors: int = 1
    prefetch_ahead_bytes: int = 4096
    prefetch_max_distance: int = 64
    prefetch_max_bytes: int = 1024
    prefetch_min_footprint: float = 0.25
    prefetch_min_jump: int = 8
    parallel_min_work: int = 1 << 15
    fma_per_cycle: int = 2
    gemm_efficiency: float = 0.5
    l2_bytes_per_cycle: float = 32.0
    llc_bytes_per_cycle: float = 12.0
    llc_share: float = 0.25
    dram_bytes_per_cycle: float = 4.0
    cycles_per_cost_unit: float = 0.25
    gather_bytes_per_cycle: float = 19.0
    python_call_cycles: float = 20_000.0
    dense_call_cycles: float = 110_000.0
    launch_cycles: float = 16_000.0
    relayout_cycles: float = 5_000.0
    cost_vector_lanes: int = 8
    cache_line_bytes: int = 64
    register_tile_rows: int = 8
    gathered_vectors: int = 2
    blas_tile_vectors: int = 2
    pack_prefetch_rows: int = 8
    chunks_per_thread: int = 8
    even_range_chunks_per_thread: int = 32
    team_coordinates: int = 256

    def __post_init__(self) -> None:
        if self.widest_vector_bytes is None:
            object.__setattr__(self, "widest_vector_bytes", self.vector_bytes)
        for name in ("vector_bytes", "widest_vector_bytes", "l1_bytes", "l2_bytes", "llc_bytes",
                     "register_block_vectors", "wide_register_block_vectors", "vector_registers",
                     "sparse_accumulators", "row_block", "row_block_vectors", "cache_line_bytes",
                     "register_tile_rows", "gathered_vectors", "blas_tile_vectors", "cost_vector_lanes",
                     "pack_prefetch_rows", "chunks_per_thread", "even_range_chunks_per_thread", "team_coordinates"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Target.{name} must be a positive int, got {value!r}")
        for name in ("vector_bytes", "widest_vector_bytes"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"Target.{name} must be a power of two, got {value}")
        for name in ("fma_per_cycle", "gemm_efficiency", "l2_bytes_per_cycle", "llc_bytes_per_cycle", "llc_share",
                     "dram_bytes_per_cycle", "gather_bytes_per_cycle", "cycles_per_cost_unit",
                     "python_call_cycles", "dense_call_cycles", "launch_cycles", "relayout_cycles"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"Target.{name} must be a positive number, got {value!r}")
        for name in ("gemm_efficiency", "llc_share"):
            if getattr(self, name) > 1:
                raise ValueError(f"Target.{name} is a fraction, at most 1, got {getattr(self, name)!r}")
        if self.widest_vector_bytes < self.vector_bytes:
            raise ValueError(f"Target.widest_vector_bytes ({self.widest_vector_bytes}) is below vector_bytes "
                             f"({self.vector_bytes})")
        if self.row_block & (self.row_block - 1):
            raise ValueError(f"Target.row_block must be a power of two, got {self.row_block}")

    @property
    def register_tile_vectors(self) -> int:
        """Most SIMD vectors of a register tile's row: 4 with 32 vector registers, else 2."""
        return 4 if self.vector_registers >= 32 else 2

    @property
    def dot_tile(self) -> tuple[int, int]:
        """(rows, columns) of a dot tile's sums: 4 x 4 with 32 vector registers, else 4 x 2."""
        return 4, self.register_tile_vectors

    def bytes_per_cycle(self, nbytes: float) -> float:
        """Bytes per cycle one core reads ``nbytes`` at, from the nearest level they fit in."""
        if nbytes <= self.l2_bytes:
            return self.l2_bytes_per_cycle
        in_llc = nbytes <= self.llc_share * self.llc_bytes
        return self.llc_bytes_per_cycle if in_llc else self.dram_bytes_per_cycle

    def across_rows_cycles(self, elements: float, itemsize: int) -> float:
        """Cycles of copying ``elements`` read across their rows (into another mode
        order): a cache line per element, at the rate of the level their bytes fit in."""
        return elements * (self.cache_line_bytes + itemsize) / self.bytes_per_cycle(elements * itemsize)

    def blocked_copy_cycles(self, elements: float, itemsize: int) -> float:
        """Cycles of torch's blocked copy of ``elements`` read across their rows, which
        uses every line it reads while a block of rows is in the L1: ``max(elements ·
        (line + itemsize) / bw_L2, 2 · bytes / bw)``, a line per element at the L2's rate
        wherever they live, at least their bytes read and written at the rate of the
        level they fit in."""
        nbytes = elements * itemsize
        return max(elements * (self.cache_line_bytes + itemsize) / self.l2_bytes_per_cycle,
                   2 * nbytes / self.bytes_per_cycle(nbytes))

    def lanes(self, itemsize: int) -> int:
        """Elements of ``itemsize`` bytes per SIMD vector."""
        return max(self.vector_bytes // itemsize, 1)

    @staticmethod
    def current() -> Target:
        """The machine plans are made for: the one given to ``use_target``, else the host."""
        return ACTIVE_TARGET.get() or Target.host()

    @staticmethod
    @lru_cache(maxsize=1)
    def host() -> Target:
        """The machine this process runs on: vector width from the architecture and
        CPU flags, cache sizes from sysfs (defaults where they cannot be read), BLAS's
        efficiency measured once per host (``plan/calibrate.py``)."""
        from .calibrate import host_gemm_efficiency  # imports torch and the back end: only when asked

        l1, l2, llc = _cache_sizes()
        vector_bytes, widest, registers = _host_vectors()
        target = Target(vector_bytes=vector_bytes, widest_vector_bytes=widest, vector_registers=registers,
                        l1_bytes=l1, l2_bytes=l2, llc_bytes=llc)
        peak = 2 * (widest // 4) * target.fma_per_cycle  # fp32 flops a cycle, as dense_product_cycles counts them
        return replace(target, gemm_efficiency=host_gemm_efficiency(peak, target.gemm_efficiency))


ACTIVE_TARGET: ContextVar[Target | None] = ContextVar("sparsenn_target", default=None)


def _host_vectors() -> tuple[int, int, int]:
    """(SIMD width in bytes, widest SIMD width, number of vector registers) of the host."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            flags = []
        width = 32 if "avx2" in flags else 16
        wide = "avx512f" in flags and "avx512vl" in flags
        return width, (64 if wide else width), (32 if wide else 16)
    return 16, 16, (32 if machine in ("aarch64", "arm64") else 16)


def _cache_sizes() -> tuple[int, int, int]:
    """(L1 data and L2 per core, last-level cache) in bytes, read from sysfs."""
    sizes: dict[int, int] = {}
    try:
        entries = os.listdir(_SYSFS_CACHES)
    except OSError:
        entries = []
    for entry in entries:
        try:
            with open(f"{_SYSFS_CACHES}/{entry}/level") as f:
                level = int(f.read())
            with open(f"{_SYSFS_CACHES}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{_SYSFS_CACHES}/{entry}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        try:
            sizes[level] = int(text.rstrip("KM")) * scale
        except ValueError:
            continue
    l2 = sizes.get(2, 1 << 20)
    return sizes.get(1, 32 << 10), l2, sizes.get(3, max(l2, 8 << 20))
