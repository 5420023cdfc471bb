"""The planner: from checked operands to a frozen :class:`Plan` the launcher runs.

For a call it

1. describes each operand to the scheduler (:func:`operand_info`: format, shape, stored
   positions per level rounded to powers of two);
2. decides the result's format from the operands' formats and ``out_format`` alone
   (:func:`plan.infer.result_format`; fill only on ``out_format="auto"``), finds an
   operand whose pattern the result has (an *anchor*: SDDMM writes values in place) and
   schedules the expression;
3. looks the plan up by the schedule's *decisions* (:func:`decisions`: orders, tiles,
   register blocks, workspace, transposes, output format and order; not the cost
   estimates), so every shape with the same decisions shares one plan and one kernel
   (kernels read extents at run time), else lowers and builds it. :func:`build_kernel`
   is the one function that calls the back end: for a plan's kernel and for the kernel
   of a program's fused stages (:func:`fused_kernel`).

:func:`plan_call` returns a :class:`ShapePlan`: the shared plan and this shape's
schedule (which also decides the thread count, :func:`runs_parallel`). Expressions
of three or more factors may instead run as pairwise contractions
(:func:`contraction_path`).
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from sparsenn.formats import Format, SparseTensor, parse_format

from ..backend import abi, jit
from ..backend.codegen import generate_fused_source, generate_source
from ..backend.precision import compute_dtype
from ..lower.fuse import FusedLowering, FusedStage, lower_fused
from ..lower.kernel import LoweredKernel, lower
from ..frontend.notation import Assignment
from ..runtime.cache import LRUCache
from .anchor import find_anchor
from .contract import Step, best_path
from .infer import densify_by_fill, result_format
from .schedule import OperandInfo, Schedule, schedule

__all__ = ["Argument", "Built", "Plan", "ShapePlan", "Request", "DENSE", "AUTO",
           "operand_info", "plan_call", "build_kernel", "fused_kernel", "build_plans", "runs_parallel", "decisions",
           "contraction_path", "path_request"]

DENSE = "dense"  # out_format: a dense torch.Tensor
AUTO = "auto"  # out_format: the inferred format, dense when its estimated fill is high

Request = Format | str | None  # None (inferred), DENSE, AUTO or a requested format
KERNEL_NAME = "sparse_einsum"  # the kernels' file-name hints in the kernel cache
FUSED_KERNEL_NAME = "fused_einsum"


@dataclass(frozen=True)
class Argument:
    """One array argument of a kernel: slot ``slot``'s ``kind`` array ("pos", "crd" or
    "val" of storage level ``level``, or "dense" for a dense slot)."""

    slot: int
    kind: str
    level: int


@dataclass(frozen=True)
class Plan:
    """A compiled expression for every shape whose schedule makes the same decisions.

    ``schedule`` holds those decisions (its estimates are zero, see :func:`decisions`).
    ``output_format`` is the format the kernel produces: None for a dense array, the
    anchor's format when values are written at operand ``anchor``'s positions, else the
    sparse format it assembles. ``arguments`` lists the kernel's array arguments in
    order (then the output array, for dense-writing kernels); ``kernel.indices`` the
    order of its extents (``dims``); the dense output is laid out in
    ``schedule.output_order`` and ``output_permutation`` (None: identity) permutes it
    back to the expression's index order; an assembled output's arrays are filled by
    ``sn_finish`` in ``finish_order`` (("pos"|"crd"|"val", level), empty otherwise).
    ``load()`` returns the entry points (built or loaded through the kernel cache)."""

    assignment: Assignment
    operand_formats: tuple[Format | None, ...]
    output_format: Format | None
    anchor: int | None
    schedule: Schedule
    kernel: LoweredKernel
    source: str
    arguments: tuple[Argument, ...]
    output_permutation: tuple[int, ...] | None
    finish_order: tuple[tuple[str, int], ...]
    load: Callable[[], abi.EntryPoints] = field(compare=False, repr=False)

    @property
    def assembles(self) -> bool:
        """The kernel assembles a sparse output (else it fills a dense array)."""
        return self.output_format is not None and self.anchor is None


@dataclass(frozen=True)
class ShapePlan:
    """A call's plan for its shapes: this shape's schedule (with its estimates), the
    kernel's output format and anchor, the format the result is converted to (a
    requested format the kernel does not produce natively), if any, and the shared
    :class:`Plan`, built on first use (a call the runtime computes otherwise, on the
    dense path, never builds its kernel)."""

    schedule: Schedule
    output_format: Format | None
    anchor: int | None
    final_format: Format | None
    build: Callable[[], Plan] = field(compare=False, repr=False)

    @functools.cached_property
    def plan(self) -> Plan:
        return self.build()


_shape_plans: LRUCache[ShapePlan] = LRUCache("shape plans", 512)
_plans: LRUCache[Plan] = LRUCache("plans", 256)
_fused_kernels: LRUCache[Built] = LRUCache("fused kernels", 64)
_paths: LRUCache[tuple] = LRUCache("contraction paths", 256)


def operand_info(op: torch.Tensor | SparseTensor) -> OperandInfo:
    """What the scheduler knows about an operand: its format (None: dense), shape and,
    if sparse, the stored positions per level rounded to a power of two (so plans are
    shared by operands of similar fill)."""
    if isinstance(op, SparseTensor):
        _, shape, positions, _ = op.signature
        return OperandInfo(op.format, shape, tuple(0 if p <= 0 else 1 << round(math.log2(p)) for p in positions))
    return OperandInfo(None, tuple(op.shape), layout=memory_order(op.shape, op.stride()))


def memory_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The modes of a dense tensor of ``shape`` and ``stride`` in memory order, outermost
    first, when it is a permutation of a contiguous tensor other than the identity (a
    transpose); None when it is contiguous, or strided otherwise (read through a copy
    whatever the order). Extents of one are left out of the comparison, as torch's
    ``is_contiguous`` leaves them."""

    def packed(order: Sequence[int]) -> bool:
        step = 1
        for d in reversed(order):
            if shape[d] != 1 and stride[d] != step:
                return False
            step *= shape[d]
        return True

    if math.prod(shape) == 0 or packed(range(len(shape))):
        return None
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    return order if packed(order) else None


def shared_patterns(operands: Sequence) -> tuple[int | None, ...]:
    """Per operand, the first operand whose index arrays it shares (the same pattern,
    e.g. ``S.with_values(dS)`` beside ``S``), or None; part of a call's key."""
    if sum(isinstance(op, SparseTensor) for op in operands) < 2:
        return (None,) * len(operands)
    first: dict[tuple, int] = {}
    shared = []
    for n, op in enumerate(operands):
        if not isinstance(op, SparseTensor):
            shared.append(None)
            continue
        arrays = tuple(None if a is None else (a.data_ptr(), a.shape[0]) for a in op.pos + op.crd)
        key = (op.format, op.shape, arrays)
        shared.append(first.get(key))
        first.setdefault(key, n)
    return tuple(shared)


def operand_infos(operands: Sequence) -> tuple[OperandInfo, ...]:
    """:func:`operand_info` of each operand, with the pattern it shares with an earlier one."""
    infos = [operand_info(op) for op in operands]
    for n, m in enumerate(shared_patterns(operands)):
        if m is not None:
            infos[n] = replace(infos[n], pattern=m)
    return tuple(infos)


def runs_parallel(sched: Schedule) -> bool:
    """Whether the kernel runs on a team of threads (the schedule's ``serial`` decision:
    fewer expected innermost iterations than the Target's ``parallel_min_work``)."""
    return not sched.serial


def decisions(sched: Schedule) -> Schedule:
    """``sched`` without its estimates (costs, leaves, reasons): what the generated
    source depends on, besides the expression, formats, anchor and dtypes."""
    return replace(sched, cost=0.0, leaves=0.0, reasons=(), nests=tuple(replace(n, cost=0.0) for n in sched.nests))


def _native_output(requested: Format) -> Format:
    """The kernel-assembled format closest to ``requested``: its dense prefix, then
    compressed levels, in the same mode order."""
    dense = min(requested.dense_prefix, requested.rank)
    native = parse_format("d" * dense + "c" * (requested.rank - dense), requested.rank)
    return Format(native.levels, requested.mode_order, None)


def _requested(assignment: Assignment, formats: Sequence[Format | None],
               request: Request) -> tuple[Format | None, Format | None]:
    """(the output format before anchoring and fill, the requested sparse format or None)."""
    if request == DENSE:
        return None, None
    if isinstance(request, Format):
        return _native_output(request), request
    return result_format(assignment, formats), None


def _collector_paused(compile_step: Callable) -> Callable:
    """``compile_step`` run with Python's cyclic garbage collector paused. Planning and
    lowering allocate many short-lived objects without cycles (freed by reference
    counting); collected as they go, they would survive into the oldest generation and
    start full collections of the whole heap (0.2 s with torch and a model loaded) in
    the middle of a first call."""
    @functools.wraps(compile_step)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return compile_step(*args, **kwargs)
        gc.disable()
        try:
            return compile_step(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_collector_paused
def _shape_plan(assignment: Assignment, infos: tuple[OperandInfo, ...], request: Request, dtype: torch.dtype,
                index_dtype: torch.dtype) -> ShapePlan:
    formats = tuple(i.format for i in infos)
    itemsize = compute_dtype(dtype).itemsize  # what the kernels' vectors hold
    schedules: dict[tuple[Format | None, int | None], Schedule] = {}

    def scheduled(fmt: Format | None, anchor: int | None = None) -> Schedule:  # each output scheduled once
        if (fmt, anchor) not in schedules:
            schedules[fmt, anchor] = schedule(assignment, infos, fmt, itemsize, anchor=anchor)
        return schedules[fmt, anchor]

    output, requested = _requested(assignment, formats, request)
    if request == AUTO:
        sizes = {i: infos[a.operand].shape[m] for t in assignment.terms for a in t.factors
                 for m, i in enumerate(a.indices)}
        inferred = output
        output = densify_by_fill(assignment, formats, inferred, lambda: scheduled(inferred).leaves,
                                 math.prod(sizes[i] for i in assignment.output))
    anchor = find_anchor(assignment, infos, requested, output)
    sched = scheduled(None, anchor) if anchor is not None else scheduled(output)
    if anchor is not None and any(assignment.terms[t].factors[k].operand == anchor for (t, k), _ in sched.transposes):
        anchor, sched = None, scheduled(output)  # the anchor would be re-stored: its positions are not the output's
    if anchor is not None:
        output = formats[anchor]
    key = (assignment, formats, output, anchor, dtype, index_dtype, decisions(sched))

    def build() -> Plan:
        plan = _plans.get(key)
        if plan is None:
            plan = _build_plan(assignment, formats, output, anchor, decisions(sched), dtype, index_dtype)
            _plans.put(key, plan)
        return plan

    final = requested if output is not None and requested is not None and requested != output else None
    return ShapePlan(sched, output, anchor, final, build)


def plan_call(assignment: Assignment, infos: tuple[OperandInfo, ...], request: Request, dtype: torch.dtype,
              index_dtype: torch.dtype) -> ShapePlan:
    """The plan for operands described by ``infos`` (see the module doc)."""
    key = (assignment, infos, request, dtype, index_dtype)
    shaped = _shape_plans.get(key)
    if shaped is None:
        if len(assignment.output) > abi.MAX_OUTPUT_RANK:
            raise ValueError(f"output rank {len(assignment.output)} exceeds the supported maximum {abi.MAX_OUTPUT_RANK}")
        shaped = _shape_plan(assignment, infos, request, dtype, index_dtype)
        _shape_plans.put(key, shaped)
    return shaped


@_collector_paused
def _build_plan(assignment: Assignment, formats: tuple[Format | None, ...], output: Format | None,
                anchor: int | None, sched: Schedule, dtype: torch.dtype, index_dtype: torch.dtype) -> Plan:
    """The plan of one assignment: its kernel lowered (``lower/kernel.py``), its array
    arguments and (for an assembled output) ``sn_finish``'s arrays in the ABI's order
    (``backend/abi.py``), and the kernel built through :func:`build_kernel`."""
    kernel = lower(assignment, sched, formats, anchor)
    arguments = tuple(
        Argument(n, "dense" if slot.fmt is None else kind, level)
        for n, slot in enumerate(kernel.slots)
        for kind, level in abi.slot_arrays(slot)
    )
    finish_order = ()
    if not kernel.dense_output:
        fmt = sched.output_format
        finish_order = tuple(abi.finish_arrays(fmt.rank, fmt.dense_prefix))
    built = build_kernel(kernel, dtype, index_dtype, str(assignment))
    permutation = tuple(sched.output_order.index(i) for i in assignment.output)
    identity = permutation == tuple(range(len(permutation)))
    return Plan(assignment, formats, output, anchor, sched, kernel, built.source, arguments,
                None if identity else permutation, finish_order, built.load)


@dataclass(frozen=True)
class Built:
    """What :func:`build_kernel` returns: the kernel's C++ and a loader of its entry points."""

    source: str
    load: Callable[[], abi.EntryPoints]


def build_kernel(lowered: LoweredKernel | FusedLowering, dtype: torch.dtype, index_dtype: torch.dtype,
                 what: str) -> Built:
    """The one function that calls the back end, for a plan's kernel and for a fused
    group's alike: print ``lowered``'s C++ with values of ``dtype`` and indices of
    ``index_dtype`` (``backend/codegen.py``), and a loader that builds it (or finds it in
    the kernel cache, ``backend/jit.py``) and binds the entry points of
    ``backend/abi.py`` with their C signatures. ``what`` says what the kernel computes,
    for the build notice."""
    value, index = str(dtype).removeprefix("torch."), str(index_dtype).removeprefix("torch.")
    if isinstance(lowered, FusedLowering):
        source, name, assembles = generate_fused_source(lowered, value, index), FUSED_KERNEL_NAME, False
    else:
        source, name, assembles = generate_source(lowered, value, index), KERNEL_NAME, not lowered.dense_output

    def load() -> abi.EntryPoints:
        return abi.bind(jit.load_library(source, name, what), assembles_sparse_output=assembles)

    return Built(source, load)


def fused_kernel(stages: Sequence[FusedStage], dtype: torch.dtype, index_dtype: torch.dtype, what: str) -> Built:
    """The kernel of stages the planner fused (``plan/fusion.py``), lowered into one
    (``lower/fuse.py``) and built through :func:`build_kernel`; ``sn_run`` takes every
    stage's arguments that are not an earlier stage's output, stage by stage, then the
    outputs of the stages that write their own (``FusedLowering.parameters``). Stages
    whose plans make the same decisions share one kernel: lowered and printed once."""
    key = (tuple((s.plan.assignment, s.plan.operand_formats, s.plan.output_format, s.plan.anchor, s.plan.schedule,
                  s.reads, s.into) for s in stages), dtype, index_dtype)
    built = _fused_kernels.get(key)
    if built is None:
        built = _build_fused(stages, dtype, index_dtype, what)
        _fused_kernels.put(key, built)
    return built


@_collector_paused
def _build_fused(stages: Sequence[FusedStage], dtype: torch.dtype, index_dtype: torch.dtype, what: str) -> Built:
    return build_kernel(lower_fused(stages), dtype, index_dtype, what)


def build_plans(plans: Sequence[Plan]) -> None:
    """Build the kernels of ``plans`` concurrently (into the kernel cache and loaded), so
    that each ``plan.load()`` then finds its library."""
    assignments = list(dict.fromkeys(str(p.assignment) for p in plans))
    what = assignments[0] + (f" and {len(assignments) - 1} more" if len(assignments) > 1 else "") if plans else ""
    jit.load_libraries([jit.KernelRequest(p.source, KERNEL_NAME) for p in plans], what)


# ----------------------------------------------------------------------------- contraction paths


def contraction_path(assignment: Assignment, infos: tuple[OperandInfo, ...], dtype: torch.dtype,
                     request: Request) -> list[Step] | None:
    """Pairwise contractions cheaper than one fused kernel, for single-term products of
    three or more factors (see :mod:`plan.contract`), or None to fuse (always for values,
    max/min reductions and epilogues, which only a fused kernel computes)."""
    if len(assignment.terms) != 1 or len(assignment.terms[0].factors) < 3 or not assignment.is_product_sum:
        return None
    key = (assignment, infos, dtype, request)
    hit = _paths.get(key)
    if hit is None:
        itemsize = compute_dtype(dtype).itemsize  # what the kernels' vectors hold
        formats = tuple(i.format for i in infos)
        output, requested = _requested(assignment, formats, request)
        anchored = find_anchor(assignment, infos, requested, output) is not None
        hit = (best_path(assignment, infos, itemsize, anchored, dense=output is None),)
        _paths.put(key, hit)
    return hit[0]


def path_request(assignment: Assignment, formats: Sequence[Format | None], request: Request) -> Request:
    """``out_format`` for a path's last contraction: the whole expression's result
    format, so that the intermediates' formats (chosen by estimated fill) do not decide
    whether the result is dense."""
    if request is not None:
        return request
    output = result_format(assignment, formats)
    return DENSE if output is None else output
