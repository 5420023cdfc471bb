"""Operand validation: every check a call needs before planning, with errors naming the
operand and what is wrong, and the key under which a checked call is cached.

:func:`check_call` checks types, dtypes, devices, ranks, index sizes, that sparse
operands' index arrays are unedited, and ``out_format``; it returns the operands as the
kernels read them (a dense-format SparseTensor as a tensor; blocked ones as they are, for
:mod:`..blocks` to split). :func:`call_key` is the cache key of a call whose operands need no such
conversion: everything :func:`check_call` checks follows from the key, except what it
checks itself on every call (CPU, strided, contiguous sparse values, unedited index
arrays). :func:`call_guard` tests that a call has a given key without building it: a
repeated call is recognised by its guard alone.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor, parse_format
from sparsenn.formats.validate import VALUE_DTYPE_NAMES, VALUE_DTYPES

from ..frontend.notation import Assignment
from ..plan.planner import AUTO, DENSE, Request, shared_patterns
from .cache import Guard

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without them: the exact guards alone
    _TensorGuards = None

__all__ = ["Checked", "describe_operand", "output_request", "check_call", "call_key", "call_guard", "strict_test",
           "tensor_guards"]


@dataclass(frozen=True)
class Checked:
    """A validated call: its operands as kernels read them, their dtype, the size of
    every index, the index width of the kernel's index arrays and the output request."""

    operands: tuple
    dtype: torch.dtype
    sizes: dict[str, int]
    index_dtype: torch.dtype
    request: Request

    @property
    def all_dense(self) -> bool:
        return all(isinstance(op, torch.Tensor) for op in self.operands)


def describe_operand(assignment: Assignment, n: int) -> str:
    """``operand 1`` or, for a named operand, ``operand 1 (B)``."""
    name = assignment.operand_names[n]
    return f"operand {n}" if name == f"operand{n}" else f"operand {n} ({name})"


def output_request(out_format, out_shape: tuple[int, ...]) -> Request:
    """``out_format`` checked against the result's shape: None, :data:`DENSE`,
    :data:`AUTO`, or a :class:`Format` of the result's rank whose blocks divide it."""
    if out_format is None:
        return None
    if isinstance(out_format, str) and out_format.strip().lower() in (DENSE, AUTO):
        return out_format.strip().lower()
    if not isinstance(out_format, (str, Format)):
        raise TypeError("out_format must be None, 'dense', a format name or a Format (or 'auto'), "
                        f"got {type(out_format).__name__}")
    rank = len(out_shape)
    if rank == 0:
        raise ValueError(f"out_format={out_format!r} requested for a scalar (rank-0) result; use None or 'dense'")
    try:
        fmt = parse_format(out_format, rank)
        fmt.storage_levels(out_shape)
    except ValueError as error:
        raise ValueError(f"out_format={str(out_format)!r} does not fit the rank-{rank} result of shape "
                         f"{out_shape}: {error}") from None
    return fmt


def _checked_operand(assignment: Assignment, n: int, op, first: tuple[int, torch.dtype] | None):
    """Operand ``n`` checked, as kernels read it. Every operand has the dtype of the
    first (``first``: its number and dtype), as ``torch.matmul`` requires; under
    autocast the entry point (``runtime/autocast.py``) has cast them to one."""
    if isinstance(op, SparseTensor):
        values = op.values
        try:
            op.check_unmodified()
        except ValueError as error:
            raise ValueError(f"{describe_operand(assignment, n)}: {error}") from None
    elif isinstance(op, torch.Tensor):
        values = op
        if op.layout != torch.strided:
            raise TypeError(f"{describe_operand(assignment, n)} is a torch sparse tensor ({op.layout}); wrap it "
                            "with sparsenn.SparseTensor.from_torch(...)")
    else:
        raise TypeError(f"{describe_operand(assignment, n)} must be a torch.Tensor or SparseTensor, "
                        f"got {type(op).__name__}")
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(f"{describe_operand(assignment, n)} has dtype {values.dtype}; sparsenn supports "
                        f"{VALUE_DTYPE_NAMES}")
    if values.device.type != "cpu":
        raise ValueError(f"{describe_operand(assignment, n)} is on device {values.device}; sparsenn kernels run "
                         "on the CPU")
    if first is not None and values.dtype != first[1]:
        raise TypeError(f"{describe_operand(assignment, n)} has dtype {values.dtype} but earlier operands have "
                        f"{first[1]} ({describe_operand(assignment, first[0])} first); operands must have one dtype: "
                        "convert them, or run under torch.autocast")
    if isinstance(op, SparseTensor) and op.format.is_dense:
        return op.to_dense()
    return op


def check_call(assignment: Assignment, operands: Sequence, out_format) -> Checked:
    """Validate a call (see the module doc)."""
    if len(operands) != assignment.num_operands:
        raise ValueError(f"expected {assignment.num_operands} operands, got {len(operands)}")
    prepared, first = [], None
    for n, op in enumerate(operands):
        op = _checked_operand(assignment, n, op, first)
        first = first or (n, op.values.dtype if isinstance(op, SparseTensor) else op.dtype)
        prepared.append(op)
    sizes: dict[str, tuple[int, int]] = {}
    for access in assignment.accesses:
        shape = tuple(prepared[access.operand].shape)
        if len(shape) != len(access.indices):
            raise ValueError(
                f"{describe_operand(assignment, access.operand)} has {len(shape)} dimension(s) but the "
                f"expression indexes it with {len(access.indices)} ({''.join(access.indices)})"
            )
        for index, size in zip(access.indices, shape):
            if index in sizes and sizes[index][0] != size:
                other = describe_operand(assignment, sizes[index][1])
                raise ValueError(f"index '{index}' has size {size} in "
                                 f"{describe_operand(assignment, access.operand)} but size {sizes[index][0]} "
                                 f"in {other}")
            sizes.setdefault(index, (size, access.operand))
    if assignment.epilogue is not None:
        for access in assignment.epilogue.factors:
            if isinstance(prepared[access.operand], SparseTensor):
                raise ValueError(f"{describe_operand(assignment, access.operand)} is read after the reduction "
                                 "(in the epilogue) and must be a dense tensor")
    request = output_request(out_format, tuple(sizes[i][0] for i in assignment.output))
    if isinstance(request, Format) and assignment.dense_result:
        what = "an epilogue" if assignment.epilogue is not None else f"a {assignment.reduction}-reduction"
        raise ValueError(f"out_format={str(out_format)!r}: the result of {what} is dense (every element gets a "
                         "value); use None or 'dense'")
    widths = {op.index_dtype for op in prepared if isinstance(op, SparseTensor)}
    index_dtype = torch.int64 if torch.int64 in widths else torch.int32
    dtype = first[1] if first else None
    return Checked(tuple(prepared), dtype, {index: size for index, (size, _) in sizes.items()}, index_dtype, request)


def call_key(assignment: Assignment, operands: Sequence, out_format) -> tuple | None:
    """The cache key of a call whose operands kernels read as they are: the expression,
    ``out_format``, per operand its dtype, shape and strides (dense) or
    :attr:`SparseTensor.signature`, and which operands share index arrays. None when the call must be checked in full: an
    operand needs a conversion (dense-format, non-contiguous values) or fails a
    per-call check."""
    if out_format is not None and not isinstance(out_format, (str, Format)):
        return None
    key = [assignment, out_format]
    for op in operands:
        if isinstance(op, SparseTensor):
            values, fmt = op.values, op.format
            if fmt.is_dense or not (values.is_cpu and values.is_contiguous()):
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
    key.append(shared_patterns(operands))
    return tuple(key)


def call_guard(assignment: Assignment, operands: Sequence, out_format, fixed: frozenset[int] = frozenset()) -> Guard:
    """A test of ``(operands, out_format)`` that is true exactly when a call of
    ``assignment`` with them has the :func:`call_key` of this call (not None) and passes
    its per-call checks. The caller matches ``assignment`` by identity. ``fixed``:
    operands the caller vouches are those of this call's signature (the same kinds,
    shapes, strides, dtypes and shared patterns); of these only a sparse operand's
    unedited index arrays are tested.

    Two tests, each written out for these operands' kinds as one expression (as
    :func:`launcher._pointers` is), so a match costs attribute reads and comparisons
    only, no tuple built or hashed: first one that is stricter than the key, its tensors
    (dense operands, sparse operands' values) checked together by one call of torch's
    C++ tensor guards (``TensorGuards``, the check ``torch.compile`` runs before a
    compiled graph: type, dispatch keys, dtype, device, sizes, strides, requires_grad;
    0.3 µs for two tensors against 0.6 µs each in Python), then, when that fails, the
    exact one (a tensor that now requires grad, a Parameter where a tensor was, a
    different stride on a size-1 dimension)."""
    exact = _exact_guard(operands, out_format, fixed)
    strict = _strict_guard(operands, out_format, fixed, exact)
    return exact if strict is None else strict


def _request_test(out_format) -> str:
    return "out_format is None" if out_format is None else "type(out_format) is request_type and out_format == request"


def _exact_guard(operands: Sequence, out_format, fixed: frozenset[int]) -> Guard:
    """The exact test of :func:`call_guard`."""
    constants: dict[str, object] = {"SparseTensor": SparseTensor, "Tensor": torch.Tensor, "strided": torch.strided,
                                    "shared_patterns": shared_patterns, "request": out_format,
                                    "request_type": type(out_format)}
    tests = [f"len(ops) == {len(operands)}", _request_test(out_format)]
    for n, op in enumerate(operands):
        if n in fixed:
            if isinstance(op, SparseTensor):
                tests.append(f"type(op{n} := ops[{n}]) is SparseTensor and {_unmodified(f'op{n}', len(op._index_arrays))}")
        elif isinstance(op, SparseTensor):
            constants[f"signature{n}"], constants[f"dtype{n}"] = op.signature, op.values.dtype
            constants[f"values{n}"] = op.values.shape
            tests.append(f"type(op{n} := ops[{n}]) is SparseTensor and op{n}.signature == signature{n} "
                         f"and (values{n}_ := op{n}.values).shape == values{n} and values{n}_.dtype is dtype{n} "
                         f"and values{n}_.is_cpu and values{n}_.is_contiguous() "
                         f"and {_unmodified(f'op{n}', len(op._index_arrays))}")
        else:
            constants[f"shape{n}"], constants[f"dtype{n}"], constants[f"stride{n}"] = op.shape, op.dtype, op.stride()
            tests.append(f"isinstance(op{n} := ops[{n}], Tensor) and op{n}.layout is strided "
                         f"and op{n}.shape == shape{n} and op{n}.dtype is dtype{n} and op{n}.is_cpu "
                         f"and op{n}.stride() == stride{n}")
    sparse = [n for n, op in enumerate(operands) if isinstance(op, SparseTensor)]
    if len(sparse) >= 2 and not fixed.issuperset(sparse):
        constants["shared"] = shared_patterns(operands)
        tests.append("shared_patterns(ops) == shared")
    return _guard(f"def guard(ops, out_format):\n    return {' and '.join(tests)}\n", constants)


def tensor_guards(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """torch's C++ guards of ``tensors`` (type, dispatch keys as they are now, dtype,
    device, sizes, strides, requires_grad) as one check over tensors passed in the same
    order; None where torch has none or cannot describe a tensor."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    except (TypeError, RuntimeError):
        return None


def _strict_guard(operands: Sequence, out_format, fixed: frozenset[int], exact: Guard) -> Guard | None:
    """The first test of :func:`call_guard`, falling back to ``exact``; None when torch
    has no tensor guards or no operand is checked by one."""
    tensors = [op.values if isinstance(op, SparseTensor) else op for n, op in enumerate(operands) if n not in fixed]
    layouts = tensor_guards(tensors) if tensors else None
    if layouts is None:
        return None
    constants: dict[str, object] = {"SparseTensor": SparseTensor, "shared_patterns": shared_patterns,
                                    "request": out_format, "request_type": type(out_format),
                                    "layouts": layouts, "exact": exact}
    tests, checked, unmodified = [f"len(ops) == {len(operands)}", _request_test(out_format)], [], []
    for n, op in enumerate(operands):
        if isinstance(op, SparseTensor):
            tests.append(f"type(op{n} := ops[{n}]) is SparseTensor")
            if n not in fixed:
                constants[f"signature{n}"] = op.signature
                tests.append(f"op{n}.signature == signature{n}")
                checked.append(f"op{n}.values")
            unmodified.append(_unmodified(f"op{n}", len(op._index_arrays), versioned=_versioned(op)))
        elif n not in fixed:
            checked.append(f"ops[{n}]")
    tests += [f"layouts({', '.join(checked)})", *unmodified]
    sparse = [n for n, op in enumerate(operands) if isinstance(op, SparseTensor)]
    if len(sparse) >= 2 and not fixed.issuperset(sparse):
        constants["shared"] = shared_patterns(operands)
        tests.append("shared_patterns(ops) == shared")
    test = " and ".join(tests)
    shared = dict(constants)
    guard = _guard(f"def guard(ops, out_format):\n"
                   f"    try:\n"
                   f"        return ({test}) or exact(ops, out_format)\n"
                   f"    except RuntimeError:  # an inference tensor's version read\n"
                   f"        return exact(ops, out_format)\n", constants)
    _STRICT_TESTS[guard] = (test, shared)
    return guard


# Each strict guard's first test, as text over ``ops`` and ``out_format`` and its constants.
_STRICT_TESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def strict_test(guard: Guard) -> tuple[str, dict[str, object]] | None:
    """The first test of ``guard`` (made by :func:`call_guard`), for a caller writing it
    into its own function: an expression over ``ops`` and ``out_format`` that is true
    only for calls ``guard`` passes (it may raise RuntimeError, or be false where
    ``guard`` is true: ask ``guard`` then), and the constants it reads. None when
    ``guard`` has no such test."""
    return _STRICT_TESTS.get(guard)


def _guard(source: str, constants: dict[str, object]) -> Guard:
    """The function ``guard`` that ``source`` defines over ``constants``. The source
    depends on the operands' kinds only (their shapes, strides and signatures are
    constants), so signatures of one kind share its compiled code."""
    exec(_compiled(source), constants)
    return constants.pop("guard")


@functools.lru_cache(maxsize=256)
def _compiled(source: str):
    return compile(source, "<sparsenn call guard>", "exec")


def _versioned(op: SparseTensor) -> bool:
    """Whether every index array of ``op`` has a version counter (none is an inference tensor)."""
    return all(version[1] is not None for version in op._versions)


def _unmodified(name: str, count: int, versioned: bool = False) -> str:
    """:meth:`SparseTensor.index_arrays_unmodified` of the operand ``name`` with ``count``
    index arrays (its signature fixes how many), written out: each array's data address
    and version counter (None for an inference tensor) against those recorded when the
    operand was built. ``versioned``: read every array's counter without asking whether
    it has one (reading an inference tensor's raises RuntimeError)."""
    arrays = f"{name}_arrays"
    current = ", ".join(f"({arrays}[{j}].data_ptr(), {arrays}[{j}]._version)" if versioned else
                        f"({arrays}[{j}].data_ptr(), None if {arrays}[{j}].is_inference() else {arrays}[{j}]._version)"
                        for j in range(count))
    return f"({arrays} := {name}._index_arrays) is not None and {name}._versions == ({current}{',' if count == 1 else ''})"
