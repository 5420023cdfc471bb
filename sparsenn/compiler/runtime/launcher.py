"""The launcher: a plan bound to one call's shapes and operand layouts, run per call.

:func:`bind` does once, for a call signature, everything that does not change between
calls with that signature: the extents array (``dims``), the output's allocation, the
thread policy, and for every kernel argument how to find its array. Most operands are
read as given; the others go through a *stage* each call: a dense operand whose strides
are not the loop order's is copied in that order, a sparse one the schedule reads in
another mode order is re-stored (:func:`restore.restored_as`), index arrays narrower
than the kernel's are widened. ``Launch.run`` then runs the stages (usually
none), packs the data pointers, calls ``sn_run`` with the GIL released, and returns
the dense result (allocated in the expression's index order, its memory in the kernel's
output order), the anchor's pattern with the computed values, or the sparse result the
kernel assembled. A 16-bit kernel that
accumulates in its dense output writes float32, rounded to the values' dtype after it
(``backend/precision.py``). A program's fused stages (``runtime/programs.py``) run as a
:class:`FusedLaunch`: each stage's launch, bound without its own kernel, supplies its
arguments and output to the one ``sn_run`` of the group.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sparsenn.formats import Format, SparseTensor

from ..backend.abi import EntryPoints
from ..backend.precision import output_dtype
from ..frontend.functions import IDENTITY
from ..plan.planner import Plan, ShapePlan, runs_parallel
from . import memory
from .densified import RELAID
from .restore import restored_as

__all__ = ["Launch", "FusedLaunch", "Member", "Assembly", "argument_packer", "bind", "output_allocator", "output_fill",
           "run_source", "run_stages"]

Stage = Callable[[Sequence, list], object]  # (operands, earlier stages' results) -> a tensor for the kernel
Pointers = Callable[[Sequence, list | None], list[int]]  # (operands, stages' results) -> the arguments' data pointers
_OUT_OF_MEMORY = "sparsenn kernel ran out of memory"


def output_fill(reduction: str, overwrites: bool) -> float | None:
    """What a dense output holds before the kernel runs: nothing (None) when the kernel
    stores every element, else the reduction's identity (0 for a sum, -inf for a max)."""
    return None if overwrites else IDENTITY[reduction]


@dataclass(frozen=True)
class Assembly:
    """The layout of an assembled sparse output, fixed by its format and shape: its
    extents in storage order, how many leading levels are dense, and the order of the
    arrays ``sn_finish`` fills (``Plan.finish_order``)."""

    fmt: Format
    level_dims: tuple[int, ...]
    dense_prefix: int
    finish_order: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Launch:
    """A :class:`Plan` bound to a call signature (see the module doc); ``run(operands)``
    launches it. A launch bound without its kernel (``entry`` None: a fused kernel's
    stage, which only needs the layouts) has no ``run``. ``run`` follows a check that the
    sparse operands' index arrays are those their records name (a call's guard,
    ``validate.check_call`` or ``call_key``), so it reads their data addresses from the
    records (``SparseTensor._versions``: no ``data_ptr()`` call each)."""

    plan: Plan
    entry: EntryPoints | None
    dims: ctypes.Array
    parallel: bool
    stages: tuple[Stage, ...]
    pointers: Pointers
    terms: tuple[str, ...]  # per argument, the expression of its data pointer over ``ops`` and ``made``
    run_terms: tuple[str, ...]  # the same for ``run``: an operand's index arrays' from its record
    pack: Callable[..., bytes]  # the kernel's array arguments (and a dense output) as sn_run's void* array
    allocation: tuple[int, ...]  # shape of the dense output (or the anchor's values)
    assembly: Assembly | None  # a sparse output the kernel assembles
    out_shape: tuple[int, ...]
    dtype: torch.dtype  # of the values, and of the result
    out_dtype: torch.dtype  # of the dense array the kernel writes: dtype, or float32 to round after
    index_dtype: torch.dtype
    final_format: Format | None
    run: Callable[[Sequence], torch.Tensor | SparseTensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.entry is not None:
            object.__setattr__(self, "run", _runner(self))


def run_stages(stages: Sequence[Stage], operands: Sequence) -> list | None:
    """Each stage's tensor in order (a stage may read the earlier ones), or None without stages."""
    if not stages:
        return None
    made: list = []
    for stage in stages:
        made.append(stage(operands, made))
    return made


def _runner(launch: Launch) -> Callable[[Sequence], torch.Tensor | SparseTensor]:
    """The per-call work of ``launch``: run the stages, pack the data pointers, call the
    kernel, wrap its output. A plain dense output (the kernel writes the result itself:
    no anchor, no rounding, no conversion) is allocated in the expression's index order
    with its memory in the kernel's (:func:`memory.allocator`'s ``layout``) and returned
    as it is, by a function written out for this launch (:func:`_direct_runner`)."""
    if not (launch.plan.assembles or launch.plan.anchor is not None or launch.final_format is not None
            or launch.out_dtype != launch.dtype):
        return _direct_runner(launch)
    stages, pointers, dims, parallel = launch.stages, launch.pointers, launch.dims, launch.parallel
    kernel_run, dtype, num_threads = _unconverted(launch.entry.run), launch.dtype, torch.get_num_threads
    rounded = launch.out_dtype != dtype
    plan, final = launch.plan, launch.final_format
    assembles, anchor = plan.assembles, plan.anchor
    packed = None if assembles else _packed(launch.pack, launch.run_terms)
    allocate = None if assembles else output_allocator(launch)

    def run(operands: Sequence) -> torch.Tensor | SparseTensor:
        made = run_stages(stages, operands) if stages else None  # held until the kernel has read the staged copies
        threads = num_threads() if parallel else 1
        if assembles:
            result = _assembled(launch, pointers(operands, made), threads)
        else:
            out = allocate()
            if kernel_run(packed(operands, made, out.data_ptr()), dims, threads, None) != 0:
                raise MemoryError(_OUT_OF_MEMORY)
            if rounded:
                out = out.to(dtype)  # keeps the strides
            if anchor is None:
                return out
            pattern = operands[anchor]
            result = pattern._share(pattern.shape, pattern.format, out)  # sized by its nnz when bound
        return result if final is None else result.asformat(final)

    return run


def _direct_runner(launch: Launch) -> Callable[[Sequence], torch.Tensor]:
    """``run(ops)`` of a launch whose kernel writes the dense result itself, written out
    for it (as :func:`_pointers` is): the stages (if any) in order, the output
    allocated, every data pointer packed in one call, the kernel called; no test of the
    launch's kind per call."""
    constants = {"allocate": output_allocator(launch), "kernel_run": _unconverted(launch.entry.run),
                 "pack": launch.pack, "dims": launch.dims, "num_threads": torch.get_num_threads,
                 "MemoryError": MemoryError, "message": _OUT_OF_MEMORY}
    lines = ["def run(ops):"]
    for n, stage in enumerate(launch.stages):  # made lives until the kernel has read the staged copies
        constants[f"stage{n}"] = stage
        lines.append(f"    made.append(stage{n}(ops, made))" if n else f"    made = [stage0(ops, [])]")
    threads = "num_threads()" if launch.parallel else "1"
    lines += ["    out = allocate()",
              f"    if kernel_run(pack({''.join(term + ', ' for term in launch.run_terms)}out.data_ptr()), dims, "
              f"{threads}, None) != 0:",
              "        raise MemoryError(message)",
              "    return out"]
    shared = dict(constants)
    exec(_compiled_runner("\n".join(lines)), constants)
    run = constants.pop("run")
    _RUN_SOURCES[run] = (tuple(lines[1:]), shared)
    return run


# Each direct runner's body (lines indented once, over ``ops``) and its constants.
_RUN_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_source(run: Callable) -> tuple[tuple[str, ...], dict[str, object]] | None:
    """The body of ``run`` when it is a launch's direct runner (:func:`_direct_runner`),
    for a caller writing it into its own function (lines indented by four spaces, over
    ``ops``, ending in a return), and the constants it reads; else None."""
    return _RUN_SOURCES.get(run)


@functools.lru_cache(maxsize=256)
def _compiled_runner(source: str):
    """``source`` compiled once per text (the text depends on the argument layout only)."""
    return compile(source, "<sparsenn launch>", "exec")


@dataclass(frozen=True)
class Member:
    """A stage of a fused kernel as :class:`FusedLaunch` runs it: its launch (bound
    without a kernel), its operands (``inputs(operands, results)``: from the program's
    operands and the results so far), its result from the values it writes
    (``result(operands, written)``), the arguments of its launch the kernel takes (the
    others are earlier members' outputs, read in place) and the earlier member whose
    array it writes into (None: its own)."""

    launch: Launch
    inputs: Callable[[Sequence, list], Sequence]
    result: Callable[[Sequence, torch.Tensor], object]
    kept: tuple[int, ...]
    into: int | None


class FusedLaunch:
    """Stages that one fused kernel runs (``lower/fuse.py``): ``run(operands, results)``
    allocates each member's output (or takes the array of the member it writes into),
    appends its result to ``results`` before the next member reads it, collects every
    member's kept argument pointers, then the outputs of the members that write their
    own, and calls ``sn_run`` once. ``source``: the kernel's C++."""

    def __init__(self, members: Sequence[Member], entry: EntryPoints, source: str):
        self.members, self.entry, self.source = tuple(members), entry, source
        self.parallel = any(m.launch.parallel for m in members)
        dims = [d for m in members for d in m.launch.dims]
        self.dims = (ctypes.c_int64 * len(dims))(*dims)
        self.allocators = [output_allocator(m.launch) if m.into is None else None for m in members]
        self.pack = argument_packer(sum(len(m.kept) + (m.into is None) for m in members))
        self.kernel_run = _unconverted(entry.run)

    def run(self, operands: Sequence, results: list) -> None:
        pointers, written, outputs, staged = [], [], [], []
        for member, allocate in zip(self.members, self.allocators):
            inputs = member.inputs(operands, results)
            if allocate is None:
                out = written[member.into]
            else:
                out = allocate()
                outputs.append(out)
            written.append(out)
            results.append(member.result(inputs, out))
            made = run_stages(member.launch.stages, inputs)
            staged.append(made)  # the staged copies live until the kernel has read them
            every = member.launch.pointers(inputs, made)
            pointers += [every[n] for n in member.kept]
        pointers += [out.data_ptr() for out in outputs]
        threads = torch.get_num_threads() if self.parallel else 1
        if self.kernel_run(self.pack(*pointers), self.dims, threads, None) != 0:
            raise MemoryError(_OUT_OF_MEMORY)


def _unconverted(function) -> Callable[..., int]:
    """``sn_run`` (a ctypes function with ``argtypes``) as a function pointer without
    them, for callers passing exactly the C types (the packed ``bytes`` as ``void* const*``,
    the ``dims`` array, an ``int``, None as a null handle): ctypes then passes each as it is
    instead of converting it through its argtype (0.35 µs of a 0.8 µs call). It still
    releases the GIL. ``function`` keeps its library loaded; the launch holds it."""
    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(function, ctypes.c_void_p).value)


def output_allocator(launch: Launch) -> Callable[[], torch.Tensor]:
    """The allocation of ``launch``'s dense output (or its anchor's values): in the
    expression's index order, laid out in memory in the kernel's ``output_order``."""
    plan = launch.plan
    fill = output_fill(plan.assignment.reduction, plan.kernel.overwrites_output)
    permutation = plan.output_permutation
    if plan.anchor is not None or permutation is None:
        return memory.allocator(launch.allocation, launch.out_dtype, fill)
    layout = [0] * len(permutation)  # result dim d is allocation dim permutation[d]
    for d, k in enumerate(permutation):
        layout[k] = d
    return memory.allocator(launch.out_shape, launch.out_dtype, fill, tuple(layout))


def _assembled(launch: Launch, pointers: list[int], threads: int) -> SparseTensor:
    """Run a kernel that assembles a sparse output, then copy it into tensors. A
    two-phase output's ``sn_finish`` reads the argument array and the operands again:
    ``arguments`` lives until it returns, the caller keeps the operands (and the
    stages' tensors) alive."""
    entry, layout, rank = launch.entry, launch.assembly, len(launch.out_shape)
    handle = ctypes.c_void_p()
    arguments = launch.pack(*pointers)
    if entry.run(arguments, launch.dims, threads, ctypes.byref(handle)) != 0:
        if handle.value:
            entry.free(handle)
        raise MemoryError(_OUT_OF_MEMORY)
    sizes = entry.output_sizes(handle, rank)
    wide = launch.index_dtype == torch.int64 or max([sizes.values, *layout.level_dims, 0]) >= 2**31 - 1
    idx = torch.int64 if wide else torch.int32
    pos: list = [None] * rank
    crd: list = [None] * rank
    parents = math.prod(layout.level_dims[: layout.dense_prefix])
    for level in range(layout.dense_prefix, rank):
        if level > 0 and sizes.counts[level] != parents:
            entry.free(handle)
            raise RuntimeError(f"internal error: output level {level} has {sizes.counts[level]} counts, "
                               f"expected {parents}")
        pos[level] = torch.empty(sizes.positions(level), dtype=idx)
        crd[level] = torch.empty(sizes.coordinates[level], dtype=idx)
        parents = sizes.coordinates[level]
    values = memory.empty((sizes.values,), dtype=launch.dtype)
    arrays = [values if kind == "val" else (pos if kind == "pos" else crd)[level]
              for kind, level in layout.finish_order]
    if entry.finish(handle, (ctypes.c_void_p * len(arrays))(*[a.data_ptr() for a in arrays]), int(wide),
                    threads) != 0:
        raise MemoryError("sparsenn kernel ran out of memory while assembling its output")
    return SparseTensor(launch.out_shape, layout.fmt, tuple(pos), tuple(crd), values, check=False)


def bind(shaped: ShapePlan, operands: Sequence, sizes: dict[str, int], dtype: torch.dtype,
         index_dtype: torch.dtype, load: bool = True) -> Launch:
    """``shaped``'s plan bound to ``operands``' shapes and layouts. Valid for every call
    whose :func:`validate.call_key` is theirs (the key fixes shapes, strides, formats,
    stored positions and index widths), or for this call only. Without ``load``, the
    kernel is neither built nor loaded (the launch has no ``run``)."""
    plan = shaped.plan
    stages: list[Stage] = []
    sources: list[tuple[bool, int]] = []  # per slot: (read from a stage, operand or stage number)
    for slot in plan.kernel.slots:
        n, op = slot.operand, operands[slot.operand]
        if slot.fmt is None:
            view = op if slot.layout is None else op.permute(slot.layout)
            if slot.panel is not None:
                stages.append(_panelled(n, slot.layout, slot.panel))
                sources.append((True, len(stages) - 1))
            elif view.is_contiguous():
                sources.append((False, n))
            else:
                stages.append(_relaid(n, slot.layout, op))
                sources.append((True, len(stages) - 1))
        elif op.format != slot.fmt:
            stages.append(_restored(n, slot.fmt))
            sources.append((True, len(stages) - 1))
        else:
            sources.append((False, n))
    terms = []  # per argument, the expression of its data pointer
    run_terms = []  # the same, an operand's index array's read from its record (see Launch)
    for argument in plan.arguments:
        staged, i = sources[argument.slot]
        op = operands[plan.kernel.slots[argument.slot].operand]
        if argument.kind == "val" and not staged and not op.values.is_contiguous():
            stages.append(_contiguous_values(i))
            staged, i, kind = True, len(stages) - 1, "data"
        elif argument.kind in ("pos", "crd") and op.index_dtype != index_dtype:
            stages.append(_widened(staged, i, argument.kind, argument.level, index_dtype))
            staged, i, kind = True, len(stages) - 1, "data"
        else:
            kind = argument.kind
        source = f"made[{i}]" if staged else f"ops[{i}]"
        if kind in ("dense", "data"):
            terms.append(f"{source}.data_ptr()")
        elif kind == "val":
            terms.append(f"{source}.values.data_ptr()")
        else:
            terms.append(f"{source}.{kind}[{argument.level}].data_ptr()")
        if kind in ("pos", "crd") and not staged:
            array = getattr(op, kind)[argument.level]
            recorded = next(j for j, a in enumerate(op._index_arrays) if a is array)
            run_terms.append(f"ops[{i}]._versions[{recorded}][0]")
        else:
            run_terms.append(terms[-1])
    entry = plan.load() if load else None
    kernel = plan.kernel
    out_shape = tuple(sizes[i] for i in plan.assignment.output)
    assembly = None
    if plan.assembles:
        fmt = plan.output_format
        allocation = ()
        assembly = Assembly(fmt, tuple(out_shape[m] for m in fmt.mode_order), fmt.dense_prefix, plan.finish_order)
    elif plan.anchor is not None:
        allocation = (operands[plan.anchor].values.shape[0],)
    else:
        allocation = tuple(sizes[i] for i in plan.schedule.output_order)
    return Launch(
        plan, entry, (ctypes.c_int64 * max(len(kernel.indices), 1))(*[sizes[i] for i in kernel.indices]),
        runs_parallel(shaped.schedule), tuple(stages), _pointers(terms), tuple(terms), tuple(run_terms),
        argument_packer(len(plan.arguments) + int(kernel.dense_output)), allocation, assembly, out_shape, dtype,
        output_dtype(kernel, dtype), index_dtype, shaped.final_format,
    )


def argument_packer(count: int) -> Callable[..., bytes]:
    """``pack(*addresses)``: ``count`` data addresses as a C array of ``void*``, passed to
    ``sn_run`` as its ``arrays`` (ctypes passes a bytes object as a pointer to its
    contents; packing them costs half of building a ctypes array)."""
    return struct.Struct(f"{count}P").pack


def _relaid(n: int, layout: tuple[int, ...] | None, operand: torch.Tensor) -> Stage:
    """Dense operand ``n`` (shaped, strided and typed as ``operand``: the launch's call key
    fixes them) copied, contiguous with its modes in ``layout`` order: a parameter's
    copy kept while it is unchanged (:func:`_copied`), any other operand copied at every
    call (:func:`_relaid_copier`, decided here for the key's layout)."""

    def copy(t: torch.Tensor, allocate: Callable[..., torch.Tensor]) -> torch.Tensor:
        view = t if layout is None else t.permute(layout)
        return allocate(view.shape, dtype=view.dtype).copy_(view)

    kept = _copied(n, copy, ("contiguous", layout))
    relaid = _relaid_copier(operand, layout)

    def stage(ops, made):
        op = ops[n]
        if type(op) is not torch.Tensor and isinstance(op, torch.nn.Parameter):  # a plain tensor skips the
            return kept(ops, made)                                                # metaclass's instance check
        return relaid(op)

    return stage


BLOCKED_TRANSPOSE_ELEMENTS = 1 << 14
ALIASING_ROW_BYTES = 512


def _relaid_copier(t: torch.Tensor, layout: tuple[int, ...] | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``copy(u)``: a tensor ``u`` of ``t``'s shape, strides and dtype copied into memory
    with its modes in ``layout`` order (None: as indexed), its allocation bound
    (:func:`memory.allocator`). Through the permuted destination (one copy, no permuted
    view) torch reads ``u`` down its columns. A matrix whose rows lie a multiple of
    :data:`ALIASING_ROW_BYTES` apart would be read from a fraction of the cache's sets
    that way (its rows map onto the same ones), so one of at least
    :data:`BLOCKED_TRANSPOSE_ELEMENTS` is written in the copy's own order from its
    transposed view, which torch transposes in cache blocks: 512 x 128 floats in 56
    against 98 us, 64 x 1024 in 57 against 220 us (784 or 3703 columns: 10 % slower
    blocked; below 128 x 128 the blocks' set-up costs more than they save)."""
    shape = tuple(t.shape)
    if (layout == (1, 0) and t.numel() >= BLOCKED_TRANSPOSE_ELEMENTS and t.stride(1) == 1
            and t.stride(0) * t.element_size() % ALIASING_ROW_BYTES == 0):
        allocate = memory.allocator((shape[1], shape[0]), t.dtype)
        return lambda u: allocate().copy_(u.T)
    allocate = memory.allocator(shape, t.dtype, layout=tuple(range(t.dim())) if layout is None else layout)
    return lambda u: allocate().copy_(u)


def _relaid_copy(t: torch.Tensor, layout: tuple[int, ...] | None) -> torch.Tensor:
    """``t`` copied as :func:`_relaid_copier` copies it."""
    return _relaid_copier(t, layout)(t)


def _panelled(n: int, layout: tuple[int, ...] | None, size: int) -> Stage:
    """Dense operand ``n`` with its modes in ``layout`` order, in panels of ``size``
    along the last: ``[panel][other modes][offset]``, the last panel the remainder."""

    def copy(t: torch.Tensor, allocate: Callable[..., torch.Tensor]) -> torch.Tensor:
        t = t if layout is None else t.permute(layout)
        whole = t.shape[-1] // size * size
        out = allocate((t.numel(),), dtype=t.dtype)
        split = t.numel() // max(t.shape[-1], 1) * whole
        out[:split].view(whole // size, *t.shape[:-1], size).copy_(
            t[..., :whole].unflatten(-1, (-1, size)).movedim(-2, 0))
        out[split:].view(*t.shape[:-1], t.shape[-1] - whole).copy_(t[..., whole:])
        return out

    return _copied(n, copy, ("panels", layout, size))


def _copied(n: int, copy: Callable[[torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor], how: tuple) -> Stage:
    """The stage copying dense operand ``n`` with ``copy(operand, allocate)``: a parameter's
    copy is kept while the parameter is unchanged (:data:`.densified.RELAID`: the next call,
    in inference, most likely reads it so); any other operand's goes to memory reused from
    call to call (a stage's copy lives for one kernel call, see :mod:`.memory`)."""

    def stage(ops, made):
        op = ops[n]
        if type(op) is not torch.Tensor and isinstance(op, torch.nn.Parameter):
            return RELAID.copy_for(op, lambda t: copy(t.detach(), torch.empty), how)
        return copy(op, memory.empty)

    return stage


def _restored(n: int, fmt: Format) -> Stage:
    return lambda ops, made: restored_as(ops[n], fmt)


def _contiguous_values(n: int) -> Stage:
    return lambda ops, made: ops[n].values.contiguous()


def _widened(staged: bool, i: int, kind: str, level: int, index_dtype: torch.dtype) -> Stage:
    """An index array converted to the kernel's index width."""
    if staged:
        return lambda ops, made: getattr(made[i], kind)[level].to(index_dtype)
    return lambda ops, made: getattr(ops[i], kind)[level].to(index_dtype)


def _pointers(terms: list[str]) -> Pointers:
    """One function computing every argument's data pointer, written out for this
    argument layout (as ``dataclasses`` writes ``__init__``): one Python call per launch
    instead of one per argument. ``terms`` are expressions over ``ops`` (the operands)
    and ``made`` (the stages' tensors) built by :func:`bind` from integers and fixed
    attribute names only."""
    return eval(f"lambda ops, made: [{', '.join(terms)}]", {})


def _packed(pack: Callable[..., bytes], terms: Sequence[str]) -> Callable[[Sequence, list | None, int], bytes]:
    """``packed(ops, made, out)``: the kernel's argument array, every argument's data
    pointer (``terms``, as :func:`_pointers` writes them) then the output's address
    ``out``, packed in one call: no list of pointers is built per launch."""
    return eval(f"lambda ops, made, out: pack({''.join(term + ', ' for term in terms)}out)", {"pack": pack})
