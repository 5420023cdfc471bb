"""The dense path: a product computed by BLAS on the sparse operand made dense, when
the cost model says that beats the sparse schedule.

At moderate sparsity, or on small problems, a sparse kernel does fewer multiply-adds
than a dense product but at a far lower rate: an indirect load per stored entry against
a BLAS micro-kernel at the FMA peak. Both are costed in cycles on the :class:`Target`:

* the sparse schedule: its cost (``plan/cost.py``) times ``cycles_per_cost_unit``,
  scaled from the fill it was planned for (stored positions rounded to a power of two,
  so that plans are shared) to the operand's, or, when more, the time its gathers take
  to arrive (:func:`gather_cycles`): every leaf iteration reads an element of each dense
  factor at the sparse operand's stored coordinates (``X[b, crd]``), the working set
  being what the nest reads of the factor between two reads of one element: its
  extents inside the innermost loop it does not index (``o, i, b`` over ``X[b, i]``:
  all of ``X``, read again for every row; ``b, o, i``: one row of ``X``; a sampled
  ``o, i, i', b`` over ``X[b, i, i']``: all of ``X`` for every ``o``).
  Rows gathered at random coordinates give the prefetcher no stream to follow: the L2
  delivers them at ``gather_bytes_per_cycle`` (17-20 bytes a cycle for rows of 256 B to
  1 KiB on a Zen 3, where it streams 32), and of a working set past the L2 it holds the
  share ``L2 / working set``, the rest coming from the level the working set fits in
  (:func:`gather_cycles_per_byte`; measured on a Zen 3 at 1 KiB rows: 17-20 bytes a
  cycle from a 1 MiB ``X``, 12 from 4 MiB). The cost model counts steps, not where
  their operands come from. Nor does it count the bytes a kernel streams once: the kernel takes at least
  the time to read the sparse operand's values and index arrays, the dense operands,
  and to write the result, each from the level it fits in (:func:`stream_cycles`; a
  1024² weight at half its entries, 4 MiB with its int32 coordinates, read from the
  last-level cache at batch 1, where the cost counts its steps only);
* the dense product: ``max(F / (2 · lanes · fma_per_cycle · gemm_efficiency), B / bw)``
  for ``F`` flops over ``B`` bytes of operands and result, ``bw`` the bandwidth of the
  level they fit in (the L2, a core's share of the last-level cache, else memory):
  compute-bound with many rows, bound by reading the dense weight with few (a
  matrix-vector product); the host's ``gemm_efficiency`` is measured from torch's GEMM
  (``plan/calibrate.py``). BLAS computes the result's rows (its innermost extent, as
  BLAS sees it) in register tiles of ``blas_tile_vectors`` widest vectors, so ``F``
  counts whole tiles: 7 outputs cost as many flops as 16 on AVX2 (``64 x 128 -> 7``
  takes 11.5 µs, ``-> 16`` 9.9 µs on a Zen 3);
* the dense path's own work per call beyond a kernel's launch: the target's
  ``dense_call_cycles`` (finding the copy and comparing its snapshot, one BLAS call
  with the bias as its ``C`` input, the result's sum checked finite, the Python around
  them: 27-37 µs, more than a small kernel takes);
* making the operand dense: writing its ``B_d`` bytes and scattering its ``nnz``
  entries, ``B_d / bw + nnz · SPARSE_ITERATION_COST · cycles_per_cost_unit``. The runtime
  keeps the dense copy while the values are unchanged (inference), so this is paid once
  per new set of values (a training step); the dense product's cost includes checking
  that they are (reading them and their snapshot, ``2 · nnz`` values);
* re-storing, at every call, a sparse operand the schedule reads in another mode order
  (an n:m weight read across its rows, ``W[o, i]`` in ``dX = dY · W``): its pattern is
  cached, its values are gathered through a permutation of ``nnz`` int64 positions. Read
  across the storage order, consecutive values are a row apart, so each costs a cache
  line of its own (rows a power of two apart alias in the cache, which then keeps none):
  ``nnz · (line + 8 + itemsize) / bw``, ``bw`` for the values' bytes. The scheduler
  counts a transpose in its relative units (``TRANSPOSE_COST`` per entry) to compare loop
  orders; in cycles it is bound by these reads, and it is part of the sparse schedule's
  cost here. A dense operand the schedule copies into its loop order in another mode
  order (``X[b, i]`` read feature-major) is read across its rows too, but by torch's
  blocked copy, which uses every line it reads while a block of rows is in the L1: a
  line per element at the L2's rate wherever the operand lives, at least its bytes read
  and written at its own level's, ``max(elements · (line + itemsize) / bw_L2,
  2 · bytes / bw)`` per call (:func:`relayout_cycles`; about 2.2 cycles per fp32 element
  from 32 KiB to 4 MiB on a Zen 3); the scheduler's ``DENSE_COPY_COST`` compares loop
  orders and is far below this.

The dense path is taken (:attr:`DensePath.taken`, both costs shown by ``explain``)
when the dense product and half the copy cost less than the sparse kernel: every set of
values is used at least twice (a training step's forward and
its input gradient, or repeated inference), and at worst, with new values at every call,
the dense path costs under twice the kernel. It is taken for every call of its signature,
so a call gives the same result whether or not its copy was kept. It applies to a plain
sum of products of one sparse operand, unblocked and whose copy (with the snapshot of its
values the runtime checks it by) fits the runtime's budget for copies, and dense ones,
with a dense result.

**A training step.** A call whose sparse operand's values require a gradient runs the
call and its gradient calls: the sparse step costs each of them as routed (a kernel:
:func:`call_cycles` plus ``launch_cycles``; a per-call dense path: its product and a
copy, the values being new at every step). The dense step (:class:`StepPath`) makes the
operand dense once per step (its values are new), runs every product by BLAS on it
(:func:`dense_product_cycles` of the call and of each gradient, the sparse operand's
gradient as the dense product ``dOut · X``), and samples that gradient at the stored
positions (:func:`sampling_cycles`), two kernel launches (the copy, the sampling) and
``python_call_cycles`` for each of the forward and backward of the autograd node
holding the copy. The cheaper one runs the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..frontend.notation import Assignment
from .cost import SPARSE_ITERATION_COST, OperandInfo
from .schedule import Schedule
from .target import Target

__all__ = ["DensePath", "StepPath", "call_cycles", "dense_path", "dense_product_cycles", "densify_cycles",
           "gather_cycles", "gather_cycles_per_byte", "kernel_cycles", "relayout_cycles", "restore_cycles",
           "sampling_cycles", "schedule_cycles", "step_path", "stream_cycles"]

_POSITION_BYTES = 8  # an int64 entry of a re-store's permutation
_INDEX_BYTES = 4  # an entry of a sparse operand's index arrays (int32, the formats' default)


@dataclass(frozen=True)
class DensePath:
    """The product run densely, the sparse ``operand`` made dense, weighed against the
    sparse kernel; costs in cycles. ``taken`` when cheaper (see the module doc)."""

    operand: int
    sparse_cycles: float
    dense_cycles: float
    densify_cycles: float
    restore_cycles: float = 0.0  # of sparse_cycles: re-storing operands in the schedule's mode order
    relayout_cycles: float = 0.0  # of sparse_cycles: copying dense operands into the schedule's mode order

    @property
    def taken(self) -> bool:
        return self.dense_cycles + self.densify_cycles / 2 < self.sparse_cycles

    def describe(self) -> str:
        restore = (f", of which {self.restore_cycles:.3g} re-storing operands in its loop order"
                   if self.restore_cycles else "")
        if self.relayout_cycles:
            restore += f", {self.relayout_cycles:.3g} copying dense operands into it"
        dense = (f"operand {self.operand} made dense ({self.densify_cycles:.3g} cycles, kept while its values are "
                 f"unchanged), then BLAS ({self.dense_cycles:.3g} cycles)")
        sparse = f"the sparse kernel ({self.sparse_cycles:.3g} cycles{restore})"
        if self.taken:
            return f"dense path: {dense}, against {sparse}"
        return (f"sparse kernel kept: {sparse}, against BLAS on a dense copy ({dense}; with half the copy "
                f"{self.dense_cycles + self.densify_cycles / 2:.3g} cycles)")


def dense_path(assignment: Assignment, infos: Sequence[OperandInfo], stored: Sequence[int], sched: Schedule,
               itemsize: int, target: Target, copy_budget: int) -> DensePath | None:
    """The dense path of a dense-result call weighed against the sparse kernel of
    ``sched`` (see the module doc), None where it does not apply; ``stored``: each
    operand's stored entries (the infos' are rounded to a power of two, and so is the
    schedule's cost: it is scaled to them); ``copy_budget``: the bytes the runtime may
    keep for the copy and its snapshot."""
    if not assignment.is_product_sum or sched.output_format is not None or len(infos) < 2:
        return None
    sparse = [n for n, info in enumerate(infos) if info.format is not None]
    if len(sparse) != 1 or infos[sparse[0]].format.block is not None:
        return None
    (k,) = sparse
    nnz = stored[k]
    dense_bytes = math.prod(infos[k].shape) * itemsize
    if dense_bytes + nnz * itemsize > copy_budget:
        return None
    checked = 2 * nnz * itemsize
    dense_cycles = (dense_product_cycles(assignment, [info.shape for info in infos], itemsize, target)
                    + checked / target.bytes_per_cycle(checked) + target.dense_call_cycles)
    densify = densify_cycles(dense_bytes, nnz, target)
    kernel, restore, relayout = _call_parts(assignment, sched, infos, stored, itemsize, target)
    return DensePath(k, kernel + restore + relayout, dense_cycles, densify, restore, relayout)


def call_cycles(assignment: Assignment, sched: Schedule, infos: Sequence[OperandInfo], stored: Sequence[int],
                itemsize: int, target: Target) -> float:
    """Cycles of a call of one sparse operand by the sparse kernel of ``sched``: the
    kernel (:func:`kernel_cycles`, scaled to the operand's stored entries), re-storing
    sparse operands (:func:`restore_cycles`) and copying dense ones
    (:func:`relayout_cycles`) into its mode order."""
    return sum(_call_parts(assignment, sched, infos, stored, itemsize, target))


def _call_parts(assignment: Assignment, sched: Schedule, infos: Sequence[OperandInfo], stored: Sequence[int],
                itemsize: int, target: Target) -> tuple[float, float, float]:
    """(kernel, re-stores, dense copies) of :func:`call_cycles`."""
    (k,) = [n for n, info in enumerate(infos) if info.format is not None]
    kernel = kernel_cycles(assignment, sched, infos, k, stored[k] / max(infos[k].nnz, 1), itemsize, target)
    return (kernel, restore_cycles(assignment, sched, stored, itemsize, target),
            relayout_cycles(assignment, sched, infos, itemsize, target))


def densify_cycles(dense_bytes: int, nnz: int, target: Target) -> float:
    """Cycles of making a sparse operand of ``nnz`` entries dense (``dense_bytes``):
    writing the dense array and scattering the entries into it."""
    return dense_bytes / target.bytes_per_cycle(dense_bytes) + nnz * SPARSE_ITERATION_COST * target.cycles_per_cost_unit


def sampling_cycles(nnz: int, dense_bytes: int, itemsize: int, target: Target) -> float:
    """Cycles of reading a dense array of ``dense_bytes`` at ``nnz`` stored positions in
    storage order (a gradient sampled at a pattern): a cache line per entry, at most the
    whole array, its index and value written, one iteration step each."""
    read = min(nnz * target.cache_line_bytes, dense_bytes)
    return ((read + nnz * (itemsize + _INDEX_BYTES)) / target.bytes_per_cycle(dense_bytes)
            + nnz * SPARSE_ITERATION_COST * target.cycles_per_cost_unit)


@dataclass(frozen=True)
class StepPath:
    """A training step of a call with sparse ``operand`` (the call and its gradient
    calls, see the module doc) weighed sparse against dense, in cycles: ``dense`` when
    the dense step is cheaper."""

    operand: int
    sparse_cycles: float
    dense_cycles: float
    densify_cycles: float
    sampling_cycles: float

    @property
    def dense(self) -> bool:
        return self.dense_cycles < self.sparse_cycles

    def describe(self) -> str:
        dense = (f"operand {self.operand} made dense once per step ({self.densify_cycles:.3g} cycles), every product "
                 f"by BLAS, its gradient sampled at its pattern ({self.sampling_cycles:.3g} cycles): "
                 f"{self.dense_cycles:.3g} cycles")
        sparse = f"the sparse kernels of the call and its gradients: {self.sparse_cycles:.3g} cycles"
        if self.dense:
            return f"training step (at a layer's call site): dense, through torch's autograd ({dense}), against {sparse}"
        return f"training step (at a layer's call site): sparse ({sparse}), against dense ({dense})"


def step_path(operand: int, sparse_calls: Sequence[float], dense_products: Sequence[float], nnz: int,
              dense_bytes: int, itemsize: int, target: Target) -> StepPath:
    """The training step of a call over sparse ``operand`` (``nnz`` entries, ``dense_bytes``
    dense): ``sparse_calls`` the cycles of the call and its gradient calls as routed
    (each with ``launch_cycles``), ``dense_products`` those of the same products by BLAS
    (:func:`dense_product_cycles`); see the module doc."""
    densify = densify_cycles(dense_bytes, nnz, target)
    sampling = sampling_cycles(nnz, dense_bytes, itemsize, target)
    dense = densify + sum(dense_products) + sampling + 2 * (target.launch_cycles + target.python_call_cycles)
    return StepPath(operand, sum(sparse_calls), dense, densify, sampling)


def dense_product_cycles(assignment: Assignment, shapes: Sequence[tuple[int, ...]], itemsize: int,
                         target: Target) -> float:
    """Cycles of BLAS computing the sum of products ``assignment`` over dense operands of
    ``shapes`` (see the module doc: compute- or bandwidth-bound; the flops over whole
    register tiles of the result's rows; the bytes of the operands its factors read and
    of its result)."""
    sizes = {i: shapes[a.operand][m] for t in assignment.terms for a in t.factors for m, i in enumerate(a.indices)}
    lanes = target.widest_vector_bytes // itemsize
    row = _result_row(assignment)
    extent = math.prod(sizes[i] for i in row)
    tile = target.blas_tile_vectors * lanes
    padded = -(-extent // tile) * tile / max(extent, 1)
    flops = sum(2 * math.prod(sizes[i] for i in term.indices) * (padded if set(row) <= set(term.indices) else 1.0)
                for term in assignment.terms)
    read = {a.operand for t in assignment.terms for a in t.factors}
    touched = (sum(math.prod(shapes[n]) for n in read) + math.prod(sizes[i] for i in assignment.output)) * itemsize
    compute = flops / (2 * lanes * target.fma_per_cycle * target.gemm_efficiency)
    return max(compute, touched / target.bytes_per_cycle(touched))


def _result_row(assignment: Assignment) -> tuple[str, ...]:
    """The result's innermost indices BLAS sees as one extent: the last output index and
    those before it read by the same factors of every term (``Out[b, i, i']`` of
    ``dY[b, o] · W[o, i, i']``: ``i, i'``, one row of ``W``)."""
    if not assignment.output:
        return ()

    def readers(i: str) -> tuple:
        return tuple(tuple(n for n, a in enumerate(t.factors) if i in a.indices) for t in assignment.terms)

    last = readers(assignment.output[-1])
    row = 0
    while row < len(assignment.output) and readers(assignment.output[-1 - row]) == last:
        row += 1
    return tuple(assignment.output[len(assignment.output) - row:])


def restore_cycles(assignment: Assignment, sched: Schedule, stored: Sequence[int], itemsize: int,
                   target: Target) -> float:
    """Cycles of gathering, at every call, the values of each sparse operand ``sched``
    re-stores in another mode order: ``nnz · (line + 8 + itemsize) / bw`` (a cache line
    per value read across its rows, its int64 position, the value written; see the
    module doc); ``stored``: each operand's stored entries (0: dense, copied at
    ``DENSE_COPY_COST`` in the schedule's cost)."""
    restored = {assignment.terms[t].factors[f].operand for (t, f), _ in sched.transposes}
    per_value = target.cache_line_bytes + _POSITION_BYTES + itemsize
    return sum(stored[n] * per_value / target.bytes_per_cycle(stored[n] * itemsize) for n in restored)


def relayout_cycles(assignment: Assignment, sched: Schedule, infos: Sequence[OperandInfo], itemsize: int,
                    target: Target) -> float:
    """Cycles of copying, at every call, each dense operand ``sched`` reads in another
    mode order into that order: ``max(elements · (line + itemsize) / bw_L2, 2 · bytes /
    bw)``, ``bw`` for its bytes (a blocked copy, see the module doc). An operand laid out
    in panels reads its rows a panel's width at a time, streaming at the rate of the
    scheduler's ``DENSE_COPY_COST``: its copy is in the schedule's cost already. An
    operand whose memory is in that mode order already (``Wᵀ`` contiguous read as
    ``W[h, i]`` in order ``i, h``) is read where it is: no copy."""
    copied = {assignment.terms[t].factors[f].operand for (t, f), order in sched.transposes
              if not _in_memory_order(infos[assignment.terms[t].factors[f].operand], order)}
    panelled = {assignment.terms[nest.term].factors[k].operand for nest in sched.nests for k, _ in nest.panels}
    return sum(target.blocked_copy_cycles(math.prod(infos[n].shape), itemsize)
               for n in copied - panelled if infos[n].format is None)


def _in_memory_order(info: OperandInfo, order: Sequence[int]) -> bool:
    """Whether a dense operand's memory runs in mode ``order`` (outermost first), modes of
    extent one aside (the launcher then reads it in place)."""
    layout = info.layout if info.layout is not None else tuple(range(len(info.shape)))
    wide = [m for m in order if info.shape[m] != 1]
    return info.format is None and wide == [m for m in layout if info.shape[m] != 1]


def schedule_cycles(sched: Schedule, target: Target) -> float:
    """Cycles of a sparse schedule's kernel: its cost in the cost model's units."""
    return sched.cost * target.cycles_per_cost_unit


def kernel_cycles(assignment: Assignment, sched: Schedule, infos: Sequence[OperandInfo], sparse: int,
                  scale: float, itemsize: int, target: Target) -> float:
    """Cycles of the kernel of ``sched`` over ``infos``, operand ``sparse`` the sparse one:
    its cost, or the arrival of its gathers when slower, both scaled by ``scale`` (the
    operand's fill over the fill planned for), and at least the time its operands and
    result (dense, or sampled at the operand's pattern) take to stream
    (:func:`stream_cycles`; see the module doc)."""
    shapes = [info.shape for info in infos]
    stored = [scale * info.nnz if n == sparse else 0 for n, info in enumerate(infos)]
    result = None if sched.output_format is None else stored[sparse]  # a sparse result: sampled at its pattern
    return max(scale * max(schedule_cycles(sched, target),
                           gather_cycles(assignment, sched, shapes, sparse, itemsize, target)),
               stream_cycles(assignment, infos, stored, itemsize, target, result))


def stream_cycles(assignment: Assignment, infos: Sequence[OperandInfo], stored: Sequence[float], itemsize: int,
                  target: Target, result_entries: float | None = None) -> float:
    """Cycles of reading once every operand ``assignment`` reads and writing its result,
    each from the level it fits in: a sparse operand's ``stored`` values and index arrays
    (its planned positions scaled to them, int32 entries; an operand sharing an earlier
    one's pattern: its values), a dense one's elements, and ``result_entries`` values of
    the result (None: a dense result)."""
    sizes = {i: infos[a.operand].shape[m] for t in assignment.terms for a in t.factors for m, i in enumerate(a.indices)}
    if result_entries is None:
        result_entries = math.prod(sizes[i] for i in assignment.output)
    parts = [result_entries * itemsize]
    for n in sorted({a.operand for t in assignment.terms for a in t.factors}):
        info = infos[n]
        if info.format is None:
            parts.append(math.prod(info.shape) * itemsize)
            continue
        entries, parent = 0.0, 1.0
        for level, positions in zip(info.format.levels, info.positions):
            entries += level.index_entries(parent, positions)
            parent = positions
        shared = info.pattern is not None
        parts.append(stored[n] * itemsize + (0.0 if shared else entries * stored[n] / max(info.nnz, 1) * _INDEX_BYTES))
    return sum(nbytes / target.bytes_per_cycle(nbytes) for nbytes in parts)


def gather_cycles(assignment: Assignment, sched: Schedule, shapes: Sequence[tuple[int, ...]], sparse: int,
                  itemsize: int, target: Target) -> float:
    """Cycles for the dense factors a one-nest schedule gathers at operand ``sparse``'s
    stored coordinates to arrive: its leaf iterations times ``itemsize`` per gathered
    factor (one holding the innermost loop over the sparse operand's indices and not
    read from a register tile's packs; a tile's rows share each vector it loads), at
    :func:`gather_cycles_per_byte` of what the nest reads of the factor between two
    reads of an element (see the module doc); 0 without such a factor."""
    if len(sched.nests) != 1:
        return 0.0
    nest = sched.nests[0]
    term = assignment.terms[nest.term]
    sizes = {i: shapes[a.operand][m] for a in term.factors for m, i in enumerate(a.indices)}
    held = {i for a in term.factors if a.operand == sparse for i in a.indices}
    gathering = max((nest.order.index(i) for i in held if i in nest.order), default=None)
    if gathering is None:
        return 0.0
    tile = nest.register_tile
    packed, rows = (set(tile.packed), tile.rows) if tile is not None else (set(), 1)
    cycles = 0.0
    for k, access in enumerate(term.factors):
        if access.operand == sparse or nest.order[gathering] not in access.indices or k in packed:
            continue
        per_byte = gather_cycles_per_byte(_reuse_bytes(access, nest.order, sizes, itemsize), target)
        cycles += sched.leaves * itemsize / rows * per_byte
    return cycles


def _reuse_bytes(access, order: Sequence[str], sizes: dict[str, int], itemsize: int) -> float:
    """The bytes of ``access``'s factor a nest of loop ``order`` reads between two reads
    of one element: its extents over the loops inside the innermost loop it does not
    index (each of that loop's iterations reads them all again); all of it when it
    indexes every loop."""
    outside = [d for d, i in enumerate(order) if i not in access.indices]
    inner = set(order[outside[-1] + 1:] if outside else order)
    return math.prod(sizes[i] for i in access.indices if i in inner) * itemsize


def gather_cycles_per_byte(working_set: float, target: Target) -> float:
    """Cycles per byte of rows gathered at random coordinates from ``working_set``
    bytes: within the L1, at the L2's streaming rate (the schedule's cost bounds such a
    kernel); past it, the share ``h = min(1, L2 / working_set)`` the L2 holds at
    ``gather_bytes_per_cycle``, the rest at the rate of the level the working set fits
    in: ``h / bw_gather + (1 - h) / bw``."""
    if working_set <= target.l1_bytes:
        return 1 / target.l2_bytes_per_cycle
    held = min(1.0, target.l2_bytes / working_set)
    return held / target.gather_bytes_per_cycle + (1 - held) / target.bytes_per_cycle(working_set)
