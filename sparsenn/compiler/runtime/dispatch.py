"""Dispatch: validate operands, find or build a plan, run its kernel.

``einsum(equation, *operands)`` and :func:`compile_expression` share one path:

1. parse (cached per equation), validate every operand once in Python (type, dtype,
   device, rank, index sizes) with errors naming the operand;
2. all-dense expressions go straight to ``torch.einsum``;
3. otherwise look up a :class:`Plan` keyed by the expression, operand formats, shapes,
   per-level fill (rounded to powers of two), dtype and index width; on a miss, infer the
   output format, schedule, lower, generate C++ and load it through the JIT cache;
4. re-store operands the schedule wants in another mode order, call the kernel with the
   GIL released (ctypes), and assemble a dense tensor or a :class:`SparseTensor`.

A call whose signature was seen before skips steps 1 and 3; when its operands need no
re-store and the kernel writes a dense array, step 4 is a closure built after its first
run (:func:`_direct_launcher`).
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor, parse_format
from sparsenn.formats.tensor import array_version

from ..backend import jit
from ..autograd import differentiable_evaluate
from ..backend.codegen import generate_source, slot_arrays
from ..equation import broadcast_size_one, normalise
from ..plan.contract import Step, best_path
from ..plan.infer import infer_output_format, refine_by_fill
from ..lower.kernel import LoweredKernel, lower
from ..notation import Access, Assignment, Term, parse_einsum, parse_expression
from ..plan.schedule import OperandInfo, Schedule, schedule

__all__ = ["einsum", "compile_expression", "explain", "plan", "Plan", "CompiledExpression"]

_FLOAT_DTYPES = (torch.float32, torch.float64)
# Below this many innermost iterations (the schedule's estimate) a kernel runs on one
# thread: waking an OpenMP team costs more than the work.
PARALLEL_MIN_WORK = 1 << 15
_MAX_OUTPUT_RANK = 8


@dataclass
class Plan:
    assignment: Assignment
    operand_formats: tuple[Format | None, ...]
    output_format: Format | None  # native format the kernel assembles
    schedule: Schedule
    kernel: LoweredKernel
    source: str
    anchor: int | None = None  # the output has this operand's pattern (see lower.lower)
    library: ctypes.CDLL | None = None
    # Fixed by the plan's key (shapes included), so built once: the dims argument, each
    # array argument as (slot, "pos"|"crd"|"val"|"dense", level), the dense output's
    # allocation shape and the permutation back to the output's index order (None: identity).
    # ``direct``: every slot reads its operand as given (no re-store, no re-layout).
    dims: ctypes.Array | None = None
    arguments: tuple[tuple[int, str, int], ...] = ()
    dense_shape: tuple[int, ...] = ()
    output_permutation: tuple[int, ...] | None = None
    direct: bool = False
    pointer_array: type | None = None  # ctypes array type of the kernel's array arguments

    def load(self) -> ctypes.CDLL:
        if self.library is None:
            library = jit.load_library(self.source, "sparse_einsum")
            library.sn_run.restype = ctypes.c_int
            library.sn_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            if not self.kernel.dense_output:  # the kernel assembles its sparse output
                library.sn_finish.restype = ctypes.c_int
            self.library = library
        return self.library


_plans: dict[tuple, Plan] = {}
_paths: dict[tuple, list[Step] | None] = {}
_RESTORED_LIMIT = 16
_restored: OrderedDict[tuple, tuple] = OrderedDict()  # see _restored_as
_plans_lock = threading.Lock()


# ----------------------------------------------------------------------------- validation


def _describe(assignment: Assignment, n: int) -> str:
    name = assignment.operand_names[n]
    return f"operand {n}" if name == f"operand{n}" else f"operand {n} ({name})"


def _check_out_format(out_format, out_shape: tuple[int, ...]) -> None:
    """``out_format`` is None, ``"dense"``, or a format (name or :class:`Format`) of the
    result's rank whose blocks divide ``out_shape``."""
    if out_format is None or (isinstance(out_format, str) and out_format.strip().lower() == "dense"):
        return
    if not isinstance(out_format, (str, Format)):
        raise TypeError(f"out_format must be None, 'dense', a format name or a Format, got {type(out_format).__name__}")
    rank = len(out_shape)
    if rank == 0:
        raise ValueError(f"out_format={out_format!r} requested for a scalar (rank-0) result; use None or 'dense'")
    try:
        parse_format(out_format, rank).storage_levels(out_shape)
    except ValueError as error:
        raise ValueError(f"out_format={str(out_format)!r} does not fit the rank-{rank} result of shape "
                         f"{out_shape}: {error}") from None


def _prepare_operands(
    assignment: Assignment, operands: Sequence, out_format=None
) -> tuple[list, torch.dtype, dict[str, int]]:
    """Check types, dtypes, devices, ranks, index sizes, that sparse operands' index arrays
    were not edited since construction (O(levels)) and ``out_format``. Returns the
    operands (dense-format SparseTensors as tensors; dense tensors keep their strides,
    see :func:`_slot_operands`), their dtype and the size of every index."""
    if len(operands) != assignment.num_operands:
        raise ValueError(f"expected {assignment.num_operands} operands, got {len(operands)}")
    prepared = []
    dtype = None
    for n, op in enumerate(operands):
        if isinstance(op, SparseTensor):
            values = op.values
            try:
                op.check_unmodified()
            except ValueError as error:
                raise ValueError(f"{_describe(assignment, n)}: {error}") from None
        elif isinstance(op, torch.Tensor):
            values = op
            if op.layout != torch.strided:
                raise TypeError(
                    f"{_describe(assignment, n)} is a torch sparse tensor ({op.layout}); wrap it with "
                    "sparsenn.SparseTensor.from_torch(...)"
                )
        else:
            raise TypeError(f"{_describe(assignment, n)} must be a torch.Tensor or SparseTensor, got {type(op).__name__}")
        if values.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{_describe(assignment, n)} has dtype {values.dtype}; sparsenn supports float32 and float64")
        if values.device.type != "cpu":
            raise ValueError(f"{_describe(assignment, n)} is on device {values.device}; sparsenn kernels run on the CPU")
        if dtype is None:
            dtype = values.dtype
        elif values.dtype != dtype:
            raise TypeError(
                f"{_describe(assignment, n)} has dtype {values.dtype} but earlier operands have {dtype}; "
                "convert them to one dtype first"
            )
        if isinstance(op, SparseTensor):
            if op.format.block is not None:
                unblocked = Format(op.format.levels[: op.ndim], op.format.mode_order, None)
                op = op.asformat(unblocked)
            elif op.format.is_dense:
                op = op.to_dense()
        prepared.append(op)
    sizes: dict[str, tuple[int, int]] = {}
    for term in assignment.terms:
        for access in term.factors:
            op = prepared[access.operand]
            shape = tuple(op.shape)
            if len(shape) != len(access.indices):
                raise ValueError(
                    f"{_describe(assignment, access.operand)} has {len(shape)} dimension(s) but the expression indexes it with "
                    f"{len(access.indices)} ({''.join(access.indices)})"
                )
            for index, size in zip(access.indices, shape):
                if index in sizes and sizes[index][0] != size:
                    other = _describe(assignment, sizes[index][1])
                    raise ValueError(
                        f"index '{index}' has size {size} in {_describe(assignment, access.operand)} but size {sizes[index][0]} in {other}"
                    )
                sizes.setdefault(index, (size, access.operand))
    _check_out_format(out_format, tuple(sizes[i][0] for i in assignment.output))
    return prepared, dtype, {index: size for index, (size, _) in sizes.items()}


def infos_size(assignment: Assignment, infos: Sequence[OperandInfo]) -> list[int]:
    """The output's shape, from the operands' shapes."""
    sizes = {i: infos[a.operand].shape[m] for t in assignment.terms for a in t.factors for m, i in enumerate(a.indices)}
    return [sizes[i] for i in assignment.output]


def _bucket(n: int) -> int:
    return 0 if n <= 0 else 1 << round(math.log2(n))


def _info(op) -> OperandInfo:
    if isinstance(op, SparseTensor):
        _, shape, positions, _ = op.signature
        return OperandInfo(op.format, shape, tuple(_bucket(p) for p in positions))
    return OperandInfo(None, tuple(op.shape))


def _native_output(requested: Format) -> Format:
    """The kernel-assembled format closest to ``requested``: its dense prefix, then
    compressed levels, in the same mode order."""
    dense = min(requested.dense_prefix, requested.rank)
    native = parse_format("d" * dense + "c" * (requested.rank - dense), requested.rank)
    return Format(native.levels, requested.mode_order, None)


# ----------------------------------------------------------------------------- planning


def _anchor(assignment: Assignment, formats, out_format, inferred: Format | None) -> int | None:
    """A sparse operand whose pattern is exactly the output's, if any.

    That holds when every term reads the operand at the output's indices and no other
    factor is sparse at an output index (so nothing narrows the pattern further): SDDMM,
    sampled gradients. Values are then written in place and nothing is assembled. Used
    when the output is sparse and no other format was requested."""
    if inferred is None:
        return None
    output = assignment.output

    def narrows(factor, anchor: int) -> bool:
        fmt = formats[factor.operand]
        if factor.operand == anchor or fmt is None:
            return False
        return any(fmt.letters[fmt.mode_order.index(m)] != "d" for m, i in enumerate(factor.indices) if i in output)

    for n, fmt in enumerate(formats):
        if fmt is None or fmt.block is not None:
            continue
        if out_format is not None and parse_format(out_format, len(output)) != fmt:
            continue
        if all(
            any(f.operand == n and f.indices == output for f in t.factors)
            and not any(narrows(f, n) for f in t.factors)
            for t in assignment.terms
        ):
            return n
    return None


def _plan(assignment: Assignment, prepared: list, out_format, dtype: torch.dtype, index_dtype,
          infos: tuple[OperandInfo, ...] | None = None) -> Plan:
    if infos is None:
        infos = tuple(_info(op) for op in prepared)
    formats = tuple(i.format for i in infos)
    key = (assignment, infos, out_format, dtype, index_dtype)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    rank = len(assignment.output)
    if rank > _MAX_OUTPUT_RANK:
        raise ValueError(f"output rank {rank} exceeds the supported maximum {_MAX_OUTPUT_RANK}")
    if out_format is None:
        output = infer_output_format(assignment, formats)
    elif isinstance(out_format, str) and out_format.strip().lower() == "dense":
        output = None
    else:
        if rank == 0:
            raise ValueError(f"out_format={out_format!r} requested for a scalar (rank-0) result")
        output = _native_output(parse_format(out_format, rank))
    itemsize = torch.empty((), dtype=dtype).element_size()
    schedules: dict[Format | None, Schedule] = {}

    def scheduled(fmt: Format | None) -> Schedule:  # each output format scheduled once
        if fmt not in schedules:
            schedules[fmt] = schedule(assignment, infos, fmt, itemsize)
        return schedules[fmt]

    if out_format is None:
        inferred = output
        output = refine_by_fill(
            assignment, formats, inferred, lambda: scheduled(inferred).leaves, math.prod(infos_size(assignment, infos))
        )
    anchor = _anchor(assignment, formats, out_format, output)
    sched = scheduled(None if anchor is not None else output)
    if anchor is not None and any(
        assignment.terms[t].factors[k].operand == anchor for (t, k), _ in sched.transposes
    ):  # the anchor would be re-stored: its positions are not the output's
        anchor = None
        sched = scheduled(output)
    if anchor is not None:
        output = formats[anchor]
    lowered = lower(assignment, sched, formats, anchor)
    source = generate_source(lowered, str(dtype).removeprefix("torch."), str(index_dtype).removeprefix("torch."))
    plan = Plan(assignment, formats, output, sched, lowered, source, anchor)
    with _plans_lock:
        _plans[key] = plan
    return plan


# ----------------------------------------------------------------------------- running


def _restored_as(op: SparseTensor, fmt: Format) -> SparseTensor:
    """``op`` re-stored in ``fmt`` (a transpose the schedule asked for).

    Patterns are usually fixed while values change (weights, graphs), so the re-stored
    index arrays and the permutation of the values are cached per pattern: later calls
    only gather the values. The cache keeps the source index arrays alive, so their
    addresses identify them, and checks their version counters."""
    arrays = tuple(a for a in op.pos + op.crd if a is not None)
    key = (tuple(a.data_ptr() for a in arrays), op.shape, op.format, fmt)
    versions = tuple(array_version(a) for a in arrays)
    hit = _restored.get(key)
    if hit is None or hit[0] != versions:
        # Number the stored values from 1: a dense level below a sparse one in ``fmt``
        # stores explicit zeros where ``op`` has no entry, and those must gather 0.
        numbered = op.with_values(torch.arange(1, op.values.shape[0] + 1, dtype=torch.float64))
        moved = numbered.asformat(fmt)
        permutation = moved.values.to(torch.int64)
        padded = bool((permutation == 0).any())  # else a pure permutation: gather from values
        hit = (versions, moved, permutation if padded else permutation - 1, padded, arrays)
        with _plans_lock:
            _restored[key] = hit
            while len(_restored) > _RESTORED_LIMIT:
                _restored.popitem(last=False)
    _, moved, permutation, padded, _ = hit
    values = op.values.detach()
    if padded:
        values = torch.cat([values.new_zeros(1), values])
    return moved.with_values(torch.index_select(values, 0, permutation))


def _prepare_launch(plan: Plan, sizes: dict[str, int]) -> None:
    """Fill the plan's per-call constants (see :class:`Plan`) on its first run."""
    plan.arguments = tuple(
        (n, "dense" if slot.fmt is None else kind, level)
        for n, slot in enumerate(plan.kernel.slots)
        for kind, level in slot_arrays(slot)
    )
    plan.dense_shape = tuple(sizes[i] for i in plan.schedule.output_order)
    order = plan.schedule.output_order
    permutation = tuple(order.index(i) for i in plan.assignment.output)
    plan.output_permutation = None if permutation == tuple(range(len(permutation))) else permutation
    plan.direct = all(slot.layout is None if slot.fmt is None else slot.fmt == plan.operand_formats[slot.operand]
                      for slot in plan.kernel.slots)
    plan.dims = (ctypes.c_int64 * max(len(plan.kernel.indices), 1))(*[sizes[i] for i in plan.kernel.indices])
    plan.pointer_array = ctypes.c_void_p * (len(plan.arguments) + int(plan.kernel.dense_output))


def _slot_operands(plan: Plan, prepared: list) -> list:
    """Each slot's operand as the kernel reads it: a dense one contiguous in loop order
    (copied only when its strides are not already that order's: the transposed output of
    a previous product often is), a sparse one re-stored in the slot's mode order where
    the schedule asked for it. One operand may fill several slots (read in different
    orders by different terms)."""
    operands = []
    for slot in plan.kernel.slots:
        op = prepared[slot.operand]
        if slot.fmt is None:
            op = (op if slot.layout is None else op.permute(slot.layout)).contiguous()
        elif op.format != slot.fmt:
            op = _restored_as(op, slot.fmt)
        operands.append(op)
    return operands


def _argument_pointers(plan: Plan, slot_operands: list, index_dtype: torch.dtype) -> tuple[list[int], list]:
    """Data pointers of the kernel's array arguments, and the tensors made here for the
    call (index arrays widened to the plan's index dtype, contiguous values), which
    must stay alive until the kernel returns."""
    pointers, owners = [], []
    for slot, kind, level in plan.arguments:
        op = slot_operands[slot]
        if kind == "dense":
            array = op
        elif kind == "val":
            array = op.values
            if not array.is_contiguous():
                array = array.contiguous()
                owners.append(array)
        else:
            array = (op.pos if kind == "pos" else op.crd)[level]
            if array.dtype != index_dtype:
                array = array.to(index_dtype)
                owners.append(array)
        pointers.append(array.data_ptr())
    return pointers, owners


def _run(plan: Plan, prepared: list, sizes: dict[str, int], dtype: torch.dtype, index_dtype: torch.dtype):
    lib = plan.load()
    if plan.dims is None:
        _prepare_launch(plan, sizes)
    slot_operands = _slot_operands(plan, prepared)
    pointers, owners = _argument_pointers(plan, slot_operands, index_dtype)
    nthreads = torch.get_num_threads() if plan.schedule.leaves >= PARALLEL_MIN_WORK else 1
    if plan.output_format is not None and plan.anchor is None:  # the kernel assembles a sparse result
        handle = ctypes.c_void_p()
        arrays = plan.pointer_array(*pointers)
        code = lib.sn_run(arrays, plan.dims, nthreads, ctypes.byref(handle))
        if code != 0:
            if handle.value:
                lib.sn_free(handle)
            raise MemoryError("sparsenn kernel ran out of memory")
        out_shape = tuple(sizes[i] for i in plan.assignment.output)
        # A two-phase output's sn_finish reads the operands again: arrays and owners live on.
        result = _assemble(plan, lib, handle, out_shape, dtype, index_dtype, nthreads)
        del arrays, owners, slot_operands
        return result
    out = _output_array(plan, prepared, dtype)
    code = lib.sn_run(plan.pointer_array(*pointers, out.data_ptr()), plan.dims, nthreads, None)
    del owners, slot_operands
    if code != 0:
        raise MemoryError("sparsenn kernel ran out of memory")
    return _dense_result(plan, out, prepared)


def _output_array(plan: Plan, operands: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """The array a dense-writing kernel fills: the output in loop order, or the anchor's
    values; uninitialised when the kernel stores every element (see lower)."""
    size = (plan.dense_shape or ((),)) if plan.anchor is None else (operands[plan.anchor].values.shape[0],)
    return (uninitialised if plan.kernel.overwrites_output else torch.zeros)(*size, dtype=dtype)


def _dense_result(plan: Plan, out: torch.Tensor, operands: Sequence) -> torch.Tensor | SparseTensor:
    """The call's result from the array the kernel filled: the anchor's pattern with those
    values, or the output in the expression's index order (a view)."""
    if plan.anchor is not None:
        return operands[plan.anchor].with_values(out)
    return out if plan.output_permutation is None else out.permute(plan.output_permutation)


def _direct_launcher(call: _Call, prepared: list) -> Callable[[Sequence], torch.Tensor | SparseTensor] | None:
    """What :func:`_run` does for ``call``'s operands, cut to the per-call work, when they
    need no preparation: each slot reads its operand as given (dense ones contiguous),
    index arrays already have the plan's width, and the kernel writes a dense array
    (output or anchor values). For cached calls only, whose signature fixes the dense
    operands' strides and vouches for contiguous sparse values. Built after the call's
    first run (which fills the plan's launch constants)."""
    plan = call.plan
    if (
        call.final_format is not None or not plan.direct
        or (plan.output_format is not None and plan.anchor is None)
        or any(isinstance(op, SparseTensor) and op.index_dtype != call.index_dtype for op in prepared)
        or any(isinstance(op, torch.Tensor) and not op.is_contiguous() for op in prepared)
    ):
        return None
    pointers = []
    for slot, kind, level in plan.arguments:
        n = plan.kernel.slots[slot].operand
        if kind == "dense":
            pointers.append(lambda ops, n=n: ops[n].data_ptr())
        elif kind == "val":
            pointers.append(lambda ops, n=n: ops[n].values.data_ptr())
        else:
            pointers.append(lambda ops, n=n, kind=kind, level=level: getattr(ops[n], kind)[level].data_ptr())
    run, dims, array_type, dtype = plan.load().sn_run, plan.dims, plan.pointer_array, call.dtype
    serial = plan.schedule.leaves < PARALLEL_MIN_WORK

    def launch(ops: Sequence) -> torch.Tensor | SparseTensor:
        out = _output_array(plan, ops, dtype)
        arrays = array_type(*[pointer(ops) for pointer in pointers], out.data_ptr())
        if run(arrays, dims, 1 if serial else torch.get_num_threads(), None) != 0:
            raise MemoryError("sparsenn kernel ran out of memory")
        return _dense_result(plan, out, ops)

    return launch


def uninitialised(*size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(*size)`` (sizes as arguments: parsed faster than a shape tuple):
    memory for a kernel that stores every element of its output (the test suite fills
    it with NaN, so an element a kernel skips shows)."""
    return torch.empty(*size, dtype=dtype)


def _assemble(plan, lib, handle, out_shape, dtype, index_dtype, nthreads) -> SparseTensor:
    fmt = plan.output_format
    rank = len(out_shape)
    counts = (ctypes.c_int64 * (2 * rank + 1))()
    lib.sn_sizes(handle, counts)
    level_dims = [out_shape[m] for m in fmt.mode_order]
    num_dense = fmt.dense_prefix
    wide = index_dtype == torch.int64 or max([counts[2 * rank], *level_dims, 0]) >= 2**31 - 1
    idx = torch.int64 if wide else torch.int32
    pos: list = [None] * rank
    crd: list = [None] * rank
    arrays = []
    parents = math.prod(level_dims[:num_dense])
    for level in range(num_dense, rank):
        n_crd, n_cnt = counts[2 * level], counts[2 * level + 1]
        expected = parents if level > 0 else 0
        if level > 0 and n_cnt != expected:
            lib.sn_free(handle)
            raise RuntimeError(f"internal error: output level {level} has {n_cnt} counts, expected {expected}")
        pos[level] = torch.empty(parents + 1, dtype=idx)  # the root has one position
        crd[level] = torch.empty(n_crd, dtype=idx)
        arrays += [pos[level], crd[level]]
        parents = n_crd
    values = torch.empty(counts[2 * rank], dtype=dtype)
    arrays.append(values)
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.data_ptr() for a in arrays])
    if lib.sn_finish(handle, ptrs, int(wide), nthreads) != 0:
        raise MemoryError("sparsenn kernel ran out of memory while assembling its output")
    return SparseTensor(out_shape, fmt, tuple(pos), tuple(crd), values, check=False)


def _index_dtype(prepared: list) -> torch.dtype:
    widths = [op.index_dtype for op in prepared if isinstance(op, SparseTensor)]
    return torch.int64 if torch.int64 in widths else torch.int32


@dataclass
class _Call:
    """What a validated call signature resolves to (see :func:`_call_signature`): the
    plan to run, or the pairwise path, or neither when every operand is dense."""

    dtype: torch.dtype
    sizes: dict[str, int]
    index_dtype: torch.dtype | None = None
    plan: Plan | None = None
    path: list[Step] | None = None
    final_format: Format | None = None  # a requested sparse format the kernel's result converts to
    # After the first run of a cached call: its fast path (see _direct_launcher), or
    # False when the general path (_run) is needed.
    launch: Callable[[Sequence], torch.Tensor | SparseTensor] | bool | None = None


_CALLS_LIMIT = 4096
_calls: dict[tuple, _Call] = {}


def _call_signature(assignment: Assignment, operands: Sequence, out_format) -> tuple | None:
    """The key of a call whose operands the kernels read as they are: the expression,
    ``out_format`` and per operand its dtype, shape and strides (dense) or
    :attr:`SparseTensor.signature`. Every check :func:`_prepare_operands` makes follows
    from the key, except the per-call ones made here (CPU, strided, contiguous sparse
    values, index arrays unedited). None sends the call through the full checks: an
    operand needing a conversion (blocked, dense-format, non-contiguous values) or
    failing a check."""
    if out_format is not None and not isinstance(out_format, (str, Format)):
        return None
    key = [assignment, out_format]
    for op in operands:
        if isinstance(op, SparseTensor):
            values = op.values
            if op.format.block is not None or op.format.is_dense or not (values.is_cpu and values.is_contiguous()):
                return None
            try:
                op.check_unmodified()
            except ValueError:
                return None
            key += (op.signature, values.dtype)
        elif isinstance(op, torch.Tensor):
            if op.layout != torch.strided or not op.is_cpu:
                return None
            key += (op.shape, op.dtype, op.stride())
        else:
            return None
    return tuple(key)


def _resolve(assignment: Assignment, prepared: list, dtype: torch.dtype, sizes: dict[str, int], out_format) -> _Call:
    """Plan (or path) for checked operands."""
    if all(isinstance(op, torch.Tensor) for op in prepared):
        return _Call(dtype, sizes)
    index_dtype = _index_dtype(prepared)
    infos = tuple(_info(op) for op in prepared)
    path = _contraction_path(assignment, infos, dtype, out_format)
    if path is not None:
        return _Call(dtype, sizes, index_dtype, path=path)
    plan = _plan(assignment, prepared, out_format, dtype, index_dtype, infos)
    final = None
    if plan.output_format is not None and out_format is not None:
        final = parse_format(out_format, len(assignment.output))
        if final == plan.output_format:
            final = None
    return _Call(dtype, sizes, index_dtype, plan=plan, final_format=final)


def _evaluate(assignment: Assignment, operands: Sequence, out_format):
    signature = _call_signature(assignment, operands, out_format)
    call = None if signature is None else _calls.get(signature)
    if call is None:
        prepared, dtype, sizes = _prepare_operands(assignment, operands, out_format)
        call = _resolve(assignment, prepared, dtype, sizes, out_format)
        if signature is not None:
            with _plans_lock:
                if len(_calls) >= _CALLS_LIMIT:
                    del _calls[next(iter(_calls))]
                _calls[signature] = call
    else:
        if call.launch:
            return call.launch(operands)
        prepared = list(operands)
    if call.plan is not None:
        result = _run(call.plan, prepared, call.sizes, call.dtype, call.index_dtype)
        if signature is not None and call.launch is None:
            call.launch = _direct_launcher(call, prepared) or False
        return result if call.final_format is None else result.asformat(call.final_format)
    if call.path is not None:
        return _run_path(assignment, prepared, call.path, out_format)
    result = _dense_fallback(assignment, prepared, call.sizes)
    if out_format is not None and not (isinstance(out_format, str) and out_format.strip().lower() == "dense"):
        return _stored_densely(result, out_format)
    return result


def _contraction_path(assignment: Assignment, infos: tuple[OperandInfo, ...], dtype, out_format) -> list[Step] | None:
    if len(assignment.terms) != 1 or len(assignment.terms[0].factors) < 3:
        return None
    key = (assignment, infos, dtype, out_format)
    if key not in _paths:
        itemsize = torch.empty((), dtype=dtype).element_size()
        formats = [i.format for i in infos]
        anchored = _anchor(assignment, formats, out_format, infer_output_format(assignment, formats)) is not None
        _paths[key] = best_path(assignment, infos, itemsize, anchored)
    return _paths[key]


def _run_path(assignment: Assignment, prepared: list, path: list[Step], out_format):
    """Evaluate a single-term product as a sequence of pairwise contractions."""
    (term,) = assignment.terms
    items = [(a.indices, prepared[a.operand]) for a in term.factors]
    for n, step in enumerate(path):
        (left, x), (right, y) = items[step.left], items[step.right]
        pair = Assignment(step.indices, (Term(1.0, (Access(0, left), Access(1, right))),), ("left", "right"))
        last = n == len(path) - 1
        result = _evaluate(pair, [x, y], out_format if last else "dense" if step.dense else None)
        items = [items[k] for k in range(len(items)) if k not in (step.left, step.right)]
        items.append((step.indices, result))
    (_, result), = items
    if term.coefficient != 1.0:
        result = result * term.coefficient if isinstance(result, torch.Tensor) else result.with_values(result.values * term.coefficient)
    return result


def _stored_densely(result: torch.Tensor, out_format) -> SparseTensor:
    """A dense result in the sparse ``out_format`` with every entry stored, zeros too:
    its pattern is structural (what the expression can produce), not the values that
    happen to vanish, so gradients reach every entry."""
    indices = torch.ones(result.shape, dtype=torch.bool).nonzero().T
    return SparseTensor.from_coo(indices, result.reshape(-1), result.shape, format=out_format)


def _dense_fallback(assignment: Assignment, prepared: list, sizes: dict[str, int]) -> torch.Tensor:
    """All operands dense: torch computes each term (broadcast over missing outputs)."""
    letters = {}
    for i in sorted({i for t in assignment.terms for i in t.indices} | set(assignment.output)):
        letters[i] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[len(letters)]
    out = None
    for term in assignment.terms:
        present = [i for i in assignment.output if i in term.indices]
        lhs = ",".join("".join(letters[i] for i in a.indices) for a in term.factors)
        value = torch.einsum(f"{lhs}->{''.join(letters[i] for i in present)}", *[prepared[a.operand] for a in term.factors])
        if term.coefficient != 1.0:
            value = term.coefficient * value
        if len(present) != len(assignment.output):  # broadcast over output indices the term lacks
            view = [sizes[i] if i in term.indices else 1 for i in assignment.output]
            value = value.reshape(view).expand(tuple(sizes[i] for i in assignment.output)).clone()
        out = value if out is None else out + value
    return out


# ----------------------------------------------------------------------------- public API


_einsum_cache: dict[tuple[str, int], Assignment] = {}


def _parse_cached(equation: str, n: int) -> Assignment:
    key = (equation, n)
    assignment = _einsum_cache.get(key)
    if assignment is None:
        assignment = parse_einsum(equation, n)
        _einsum_cache[key] = assignment
    return assignment


def einsum(equation: str, *operands, out_format=None):
    """Einstein summation over dense ``torch.Tensor`` and :class:`SparseTensor` operands.

    ``out_format`` overrides the inferred output format (``"dense"`` for a tensor).
    Returns a dense ``torch.Tensor`` when the output is dense, else a ``SparseTensor``.
    The equation follows torch.einsum's grammar (see :mod:`sparsenn.compiler.equation`).
    """
    equation, operands = normalise(equation, operands)
    try:
        return differentiable_evaluate(_evaluate, _parse_cached(equation, len(operands)), operands, out_format)
    except ValueError:
        broadcast = broadcast_size_one(equation, operands)  # sizes 1 that torch broadcasts
        if broadcast is None:
            raise
    equation, operands = broadcast
    return differentiable_evaluate(_evaluate, _parse_cached(equation, len(operands)), operands, out_format)


class CompiledExpression:
    """A parsed sum-of-products expression, callable on operands (positional in order
    of first appearance, or by name)."""

    def __init__(self, text: str, out_format=None):
        self.assignment = parse_expression(text)
        self.out_format = out_format
        self.text = text

    @property
    def operand_names(self) -> tuple[str, ...]:
        return self.assignment.operand_names

    def _bind(self, args, kwargs) -> list:
        names = self.assignment.operand_names
        if len(args) > len(names):
            raise TypeError(f"{self.text!r} takes {len(names)} operands, got {len(args)}")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{self.text!r} has no operand named {name!r}")
            if name in bound:
                raise TypeError(f"operand {name!r} given twice")
            bound[name] = value
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{self.text!r} is missing operand(s) {missing}")
        return [bound[n] for n in names]

    def __call__(self, *args, **kwargs):
        return differentiable_evaluate(_evaluate, self.assignment, self._bind(args, kwargs), self.out_format)

    def explain(self, *args, **kwargs) -> str:
        return _explain(self.assignment, self._bind(args, kwargs), self.out_format)

    def __repr__(self) -> str:
        return f"CompiledExpression({self.text!r})"


def compile_expression(text: str, out_format=None) -> CompiledExpression:
    """Compile ``"D[i,j] = A[i,k] * B[k,j] + C[i,j]"`` into a callable."""
    return CompiledExpression(text, out_format)


def _explain(assignment: Assignment, operands: Sequence, out_format) -> str:
    prepared, dtype, _ = _prepare_operands(assignment, operands, out_format)
    lines = [f"expression: {assignment}"]
    for n, (op, given) in enumerate(zip(prepared, operands)):
        desc = f"{op.format} {tuple(op.shape)} nnz={op.nnz}" if isinstance(op, SparseTensor) else f"dense {tuple(op.shape)}"
        if isinstance(given, SparseTensor) and given.format.block is not None:
            desc += f" (given as {given.format}: kernels iterate blocked operands as their unblocked levels)"
        lines.append(f"  {_describe(assignment, n)}: {desc}")
    if all(isinstance(op, torch.Tensor) for op in prepared):
        lines.append("all operands dense: dispatched to torch.einsum")
        return "\n".join(lines)
    plan = _plan(assignment, prepared, out_format, dtype, _index_dtype(prepared))
    s = plan.schedule
    lines.append(f"output format: {'dense' if plan.output_format is None else plan.output_format}")
    if plan.anchor is not None:
        lines.append(
            f"output pattern: that of {_describe(assignment, plan.anchor)} (every term samples it); "
            "values are written at its positions, nothing is assembled"
        )
    if s.shared:
        lines.append(f"shared output loops: {','.join(s.shared)}")
    for nest in s.nests:
        tiles = ", ".join(f"{t.index} by {t.size}" for t in nest.tiles) or "none"
        block = nest.register_block
        lines.append(
            f"term {nest.term}: loop order {','.join(s.shared + nest.order)}; "
            f"{'parallel' if nest.parallel else 'serial'}; tiles: {tiles}"
            + (f"; register block: {block.index} by {block.size}" if block else "")
        )
    if s.workspace is not None:
        lines.append(f"workspace: {s.workspace.kind} over {','.join(s.workspace.indices)} ({s.workspace.size} entries)")
    else:
        lines.append("workspace: none")
    for (t, k), order in s.transposes:
        lines.append(f"transpose: term {t} factor {k} re-stored in mode order {order}")
    lines.append("why:")
    lines += [f"  {r}" for r in s.reasons]
    lines.append("generated C++:")
    lines.append(plan.source)
    return "\n".join(lines)


def plan(equation: str, *operands, out_format=None) -> Plan:
    """The plan (schedule, generated source) ``einsum`` would run; for tools and tests."""
    assignment = _parse_cached(equation, len(operands))
    prepared, dtype, _ = _prepare_operands(assignment, operands, out_format)
    if all(isinstance(op, torch.Tensor) for op in prepared):
        raise ValueError("all operands are dense: the expression runs in torch.einsum, not a plan")
    return _plan(assignment, prepared, out_format, dtype, _index_dtype(prepared))


def explain(equation: str, *operands, out_format=None) -> str:
    """The parsed notation, output format, loop orders with reasons, workspace, tiles
    and generated C++ for ``einsum(equation, *operands)``."""
    equation, operands = normalise(equation, operands)
    return _explain(_parse_cached(equation, len(operands)), operands, out_format)
