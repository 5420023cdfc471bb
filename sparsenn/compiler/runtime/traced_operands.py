"""A traced call's operands as the op's flat arguments, and back.

``sparsenn::evaluate`` takes tensors, not :class:`SparseTensor` s: per operand its dense
tensor, or a sparse operand's index arrays (unless it shares an earlier operand's) and
values; the sparse operands' shapes are a list of sizes (symbolic under dynamic shapes).
:func:`describe` gives the constant fields of the call string (:mod:`.callspec`),
:func:`flatten` and :func:`sparse_shapes` the arguments, :func:`rebuild` the operands again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.tensor import array_version, is_sparse

from .cache import LRUCache
from .callspec import CallSpec, Layout

__all__ = ["describe", "flatten", "sparse_shapes", "differentiable_slots", "split_shapes", "rebuild", "unchecked_pattern"]


def describe(operands: Sequence) -> list:
    """The operands' fields of the call string (constants only: traced code reads the
    layout of a SparseTensor, never its arrays' contents)."""
    parts: list[tuple] = []
    for n, op in enumerate(operands):
        if not is_sparse(op):
            parts.append((None, None, None))
            continue
        shares = None
        for m in range(n):
            other = operands[m]
            if is_sparse(other) and other.format == op.format and other.shape == op.shape and all(
                    (a is None and b is None) or a is b for a, b in zip(op.pos + op.crd, other.pos + other.crd)):
                shares = m if parts[m][2] is None else parts[m][2]
                break
        parts.append((op.format, op.index_dtype, shares))
    return [field for part in parts for field in part]


def flatten(operands: Sequence, shares: Sequence[int | None]) -> list[Tensor]:
    """A dense operand; a sparse one's index arrays (unless it ``shares`` an earlier
    one's) and values."""
    tensors: list[Tensor] = []
    for op, shared in zip(operands, shares):
        if not is_sparse(op):
            tensors.append(op)
            continue
        if shared is None:
            tensors += [a for a in op.pos + op.crd if a is not None]
        tensors.append(op.values)
    return tensors


def differentiable_slots(spec: CallSpec) -> list[int]:
    """Position in the flattened tensors of each operand's values or dense tensor."""
    slots, at = [], 0
    for layout in spec.layouts:
        at += 0 if layout is None else layout.num_arrays
        slots.append(at)
        at += 1
    return slots


_patterns: LRUCache[SparseTensor] = LRUCache("traced patterns", 256)


def sparse_shapes(operands: Sequence) -> list[int]:
    """The sparse operands' shapes, concatenated."""
    return [n for op in operands if is_sparse(op) for n in op.shape]


def split_shapes(spec: CallSpec, shapes: Sequence[int]) -> list[tuple[int, ...] | None]:
    """Per operand, its shape from ``shapes`` if sparse, else None."""
    split, at = [], 0
    for layout in spec.layouts:
        rank = None if layout is None else layout.format.rank
        split.append(None if rank is None else tuple(shapes[at:at + rank]))
        at += rank or 0
    return split


def _validated_pattern(layout: Layout, shape: tuple[int, ...], arrays: Sequence[Tensor],
                       values: Tensor) -> SparseTensor:
    """The pattern of these index arrays, validated the first time their identity and
    version are seen; the cache keeps those arrays alive, so an address cannot be reused
    by other contents while the entry exists."""
    key = (layout.format, shape, tuple(map(array_version, arrays)), tuple([a.dtype for a in arrays]))
    pattern = _patterns.get(key)
    if pattern is None:
        pos, crd = _levels(layout.format, arrays)
        pattern = SparseTensor(shape, layout.format, pos, crd, values)
        _patterns.put(key, pattern)
    return pattern


def unchecked_pattern(layout: Layout, shape: tuple[int, ...], arrays: Sequence[Tensor],
                       values: Tensor) -> SparseTensor:
    """The pattern of arrays known to be shaped right (stand-ins for planning)."""
    pos, crd = _levels(layout.format, arrays)
    return SparseTensor(shape, layout.format, pos, crd, values, check=False)


def rebuild(spec: CallSpec, tensors: Sequence[Tensor], shapes: Sequence[int],
             pattern_of: Callable[..., SparseTensor] = _validated_pattern) -> list:
    """The operands of a call from its flattened tensors. The values are not checked
    here: evaluation checks that they fit the pattern (``SparseTensor.check_unmodified``)."""
    operands: list = []
    at = 0
    for layout, shape in zip(spec.layouts, split_shapes(spec, shapes)):
        if layout is None:
            operands.append(tensors[at])
            at += 1
            continue
        if layout.shares is None:
            count = layout.num_arrays
            pattern = pattern_of(layout, shape, tensors[at:at + count], tensors[at + count])
        else:
            count, pattern = 0, operands[layout.shares]
            if pattern.shape != shape:
                raise ValueError(f"sparsenn call: operand {len(operands)} shares the index arrays of operand "
                                 f"{layout.shares} of shape {pattern.shape} but has shape {shape}")
        operands.append(pattern._share(shape, layout.format, tensors[at + count]))
        at += count + 1
    return operands


def _levels(fmt: Format, arrays: Sequence[Tensor]) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
    """``pos`` and ``crd`` per storage level from the arrays :func:`flatten` passed."""
    present = iter(arrays)
    pos = tuple(next(present) if level.has_pos else None for level in fmt.levels)
    crd = tuple(next(present) if level.has_crd else None for level in fmt.levels)
    return pos, crd
