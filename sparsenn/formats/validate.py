"""Validation of the arrays of a SparseTensor against its format.

Every check is vectorised and every error names the offending array, e.g.
``crd[1] (level 1, compressed) has coordinate 7 out of range [0, 5) at position 3``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from sparsenn.formats.format import Format
from sparsenn.formats.level import Grouped

INDEX_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# How errors list them: "float32, float64, bfloat16 or float16".
VALUE_DTYPE_NAMES = " or ".join(
    (", ".join(str(d).removeprefix("torch.") for d in VALUE_DTYPES[:-1]), str(VALUE_DTYPES[-1]).removeprefix("torch.")))
INT32_LIMIT = 2**31


def choose_index_dtype(sizes: Iterable[int], requested: torch.dtype | None = None) -> torch.dtype:
    """int32 if every size (dimension, level size, position count) is < 2**31, else int64.

    ``requested`` forces a width; forcing int32 when a size does not fit is a ValueError.
    """
    largest = max(sizes, default=0)
    if requested is None:
        return torch.int32 if largest < INT32_LIMIT else torch.int64
    if requested not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32, torch.int64 or None, got {requested}")
    if requested == torch.int32 and largest >= INT32_LIMIT:
        raise ValueError(f"index_dtype torch.int32 cannot hold the size {largest}; use torch.int64")
    return requested


def validate(fmt: Format, shape: tuple[int, ...], sizes: tuple[int, ...], pos: tuple[Tensor | None, ...],
             crd: tuple[Tensor | None, ...], values: Tensor, index_dtype: torch.dtype | None) -> None:
    """Check every array of a tensor of ``shape`` stored in ``fmt`` (level sizes ``sizes``)."""
    array_dtype = check_arrays(fmt, pos, crd, values)
    if array_dtype is not None and index_dtype not in (None, array_dtype):
        raise TypeError(f"index_dtype {index_dtype} differs from the index arrays' dtype {array_dtype}")
    narrow = array_dtype == torch.int32
    if narrow and max(shape + sizes, default=0) >= INT32_LIMIT:
        raise ValueError(f"int32 index arrays cannot address shape {shape}; use torch.int64")
    counts = check_levels(fmt, sizes, pos, crd, values)
    if narrow and max(counts, default=0) >= INT32_LIMIT:
        raise ValueError(f"int32 index arrays cannot address {max(counts)} positions; use torch.int64")
    check_order(fmt, pos, crd)


def _transformed(array: Tensor) -> bool:
    """Whether ``array`` is a torch.func transform's tensor, whose rules lay it out for
    the kernels (never while torch.compile traces)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(array)


def check_array(name: str, array: object, dtypes: tuple[torch.dtype, ...], contiguous: bool = True) -> Tensor:
    """Check that ``array`` is a 1-D (``contiguous``) strided CPU tensor with a dtype in ``dtypes``."""
    if not isinstance(array, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(array).__name__}")
    if array.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {array.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if array.device.type != "cpu":
        raise ValueError(f"{name} is on device {array.device}; SparseTensor arrays must be on the CPU")
    if array.layout != torch.strided:
        raise ValueError(f"{name} has layout {array.layout}; expected a strided tensor")
    if array.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    if contiguous and not array.is_contiguous() and not _transformed(array):
        raise ValueError(f"{name} must be contiguous")
    return array


def check_arrays(fmt: Format, pos: tuple[Tensor | None, ...], crd: tuple[Tensor | None, ...],
                 values: Tensor) -> torch.dtype | None:
    """Check presence, dtype, device and shape of every array; return the common index dtype."""
    count = len(fmt.levels)
    if len(pos) != count or len(crd) != count:
        raise ValueError(f"pos and crd need one entry per storage level ({count} for format {fmt}), "
                         f"got {len(pos)} and {len(crd)}")
    index_dtype = None
    for kind, arrays, needed in (("pos", pos, "has_pos"), ("crd", crd, "has_crd")):
        for index, (level, array) in enumerate(zip(fmt.levels, arrays)):
            name = f"{kind}[{index}] ({describe(fmt, index)})"
            if not getattr(level, needed):
                if array is not None:
                    raise ValueError(f"{name} must be None: this level has no {kind} array")
                continue
            if array is None:
                raise ValueError(f"{name} is missing")
            check_array(name, array, INDEX_DTYPES)
            if index_dtype is not None and array.dtype != index_dtype:
                raise TypeError(f"{name} has dtype {array.dtype} but earlier index arrays have "
                                f"{index_dtype}; all index arrays must share one dtype")
            index_dtype = array.dtype
    check_array("values", values, VALUE_DTYPES)
    return index_dtype


def describe(fmt: Format, index: int) -> str:
    """Human-readable name of storage level ``index``, e.g. ``level 1, compressed``."""
    return f"level {index}, {type(fmt.levels[index]).__name__.lower()}"


def _first(mask: Tensor) -> int:
    return int(torch.nonzero(mask)[0])


def check_levels(fmt: Format, sizes: tuple[int, ...], pos: tuple[Tensor | None, ...],
                 crd: tuple[Tensor | None, ...], values: Tensor) -> list[int]:
    """Check lengths, pos arrays and coordinate ranges; return the position count of each level."""
    counts = []
    parents = 1
    for index, (level, size) in enumerate(zip(fmt.levels, sizes)):
        where = describe(fmt, index)
        if level.has_pos:
            p, c = pos[index], crd[index]
            name = f"pos[{index}]"
            if len(p) != parents + 1:
                raise ValueError(f"{name} ({where}) has length {len(p)}, expected {parents + 1} "
                                 f"(number of parent positions + 1)")
            if int(p[0]) != 0:
                raise ValueError(f"{name} ({where}) must start at 0, got {int(p[0])}")
            drops = p[1:] < p[:-1]
            if bool(drops.any()):
                q = _first(drops)
                raise ValueError(f"{name} ({where}) is not non-decreasing: {name}[{q}] = {int(p[q])} "
                                 f"> {name}[{q + 1}] = {int(p[q + 1])}")
            if int(p[-1]) != len(c):
                raise ValueError(f"{name} ({where}) ends at {int(p[-1])} but crd[{index}] has length {len(c)}")
        elif level.has_crd:
            expected = level.num_positions(parents, size, None)
            if len(crd[index]) != expected:
                raise ValueError(f"crd[{index}] ({where}) has length {len(crd[index])}, expected {expected} "
                                 f"({level.num_positions(1, size, None)} per parent position, "
                                 f"{parents} parent positions)")
        if level.has_crd:
            c = crd[index]
            outside = (c < 0) | (c >= size)
            if bool(outside.any()):
                q = _first(outside)
                raise ValueError(f"crd[{index}] ({where}) has coordinate {int(c[q])} out of range "
                                 f"[0, {size}) at position {q}")
        parents = level.num_positions(parents, size, pos[index])
        counts.append(parents)
    if len(values) != parents:
        raise ValueError(f"values has length {len(values)}, expected {parents} "
                         f"(the number of positions of the last storage level)")
    return counts


def same_fiber(pos: Tensor, count: int) -> Tensor:
    """Mask over adjacent position pairs ``(q, q+1)``, ``q < count - 1``: True if in one fiber."""
    starts = torch.zeros(count, dtype=torch.bool)
    fiber_starts = pos[:-1]
    starts[fiber_starts[(fiber_starts >= 0) & (fiber_starts < count)].long()] = True
    return ~starts[1:]


def _check_group_order(fmt: Format, index: int, crd: Tensor, count: int) -> None:
    """Check ``crd[q] < crd[q + 1]`` whenever ``q`` and ``q + 1`` are in one group of ``count``."""
    steps = crd.view(-1, count).diff(dim=1) <= 0
    if bool(steps.any()):
        group, offset = (int(x) for x in torch.nonzero(steps)[0])
        q = group * count + offset
        raise ValueError(f"crd[{index}] ({describe(fmt, index)}) is not strictly increasing within group {group}: "
                         f"offset {int(crd[q])} at position {q} is followed by {int(crd[q + 1])}")


def check_order(fmt: Format, pos: tuple[Tensor | None, ...], crd: tuple[Tensor | None, ...]) -> None:
    """Check that stored coordinates are sorted and unique within every fiber.

    A unique compressed level needs strictly increasing ``crd`` per fiber. A
    non-unique one (followed by singletons) needs the coordinate tuples down the
    singleton chain to increase strictly, lexicographically, per fiber. A grouped
    level needs strictly increasing ``crd`` within each group of ``count`` positions.
    """
    levels = fmt.levels
    for index, level in enumerate(levels):
        if isinstance(level, Grouped):
            _check_group_order(fmt, index, crd[index], level.count)
            continue
        if not level.has_pos or len(crd[index]) < 2:
            continue
        equal = same_fiber(pos[index], len(crd[index]))
        chain_end = index
        while not levels[chain_end].unique:
            chain_end += 1
        for depth in range(index, chain_end + 1):
            before, after = crd[depth][:-1], crd[depth][1:]
            unsorted = equal & (after < before)
            if bool(unsorted.any()):
                q = _first(unsorted)
                raise ValueError(f"crd[{depth}] ({describe(fmt, depth)}) is not sorted within a fiber: "
                                 f"coordinate {int(before[q])} at position {q} is followed by {int(after[q])}")
            equal &= after == before
        if bool(equal.any()):
            q = _first(equal)
            names = f"crd[{index}]" if chain_end == index else f"crd[{index}..{chain_end}]"
            duplicate = tuple(int(crd[depth][q]) for depth in range(index, chain_end + 1))
            raise ValueError(f"{names} ({describe(fmt, index)}) holds the duplicate coordinate "
                             f"{duplicate if len(duplicate) > 1 else duplicate[0]} at positions {q} and {q + 1}")
