"""Blocked operands as unblocked ones over split indices.

A blocked tensor ``A[i, j]`` with blocks ``(b_i, b_j)`` stores ``A[I b_i + i', J b_j + j']``
in outer levels over the block coordinates ``I, J`` and inner levels over the in-block
coordinates ``i', j'``. With the same arrays it *is* an unblocked tensor
``A'[I, J, i', j']`` (TACO's index splitting, applied once to the expression). So a call
with blocked operands runs as the expression over split indices: an index ``i`` that a
blocked operand splits by ``b`` becomes the pair ``(i, i')`` of extents ``(N / b, b)``
wherever it occurs. Dense operands are viewed with that dimension unflattened, a dense
level of an unblocked sparse operand splits into two dense levels (position
``p N + i = (p N/b + I) b + i'``), and inner levels of size 1 are dropped. The kernels then
co-iterate blocks and schedule the loops inside a block like any dense loops (tiles,
vectors, register tiles). An n:m operand is the same thing: its last index splits into
groups and in-group offsets, and the offsets' level iterates the stored ``n`` of ``m``.

An index stays whole where some operand stores it in a level that is neither dense nor
blocked by the same size (a compressed level of a CSR operand), or where blocked
operands disagree on its block size; a blocked operand that needs such an index split
is read as its unblocked levels instead (converted). A sparse result over split output
indices is the blocked format with those block sizes (``bsr`` from ``bsr`` operands); a
requested unblocked format that stores them in dense levels is split like an operand
(so a sampled gradient keeps its pattern's positions), any other is converted to after
the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.level import Compressed, Dense, Level

from .notation import Access, Assignment, Epilogue, Term
from ..plan.infer import result_format
from ..plan.planner import AUTO, DENSE

__all__ = ["Split", "split_call", "inner_name"]

def inner_name(index: str) -> str:
    """The in-block coordinate of split index ``index`` (``i`` keeps the block coordinate)."""
    return index + "'"


@dataclass(frozen=True)
class _Layout:
    """A tensor over split modes: its shape, and per storage level of the split format
    the level kind, the split mode it stores and the original storage level whose arrays
    it reads (None for the inner half of a split dense level)."""

    shape: tuple[int, ...]
    levels: tuple[Level, ...]
    modes: tuple[int, ...]
    sources: tuple[int | None, ...]

    @functools.cached_property
    def format(self) -> Format:
        """The split format (made once: views are made on every call)."""
        return Format(self.levels, self.modes, None)


def _layout(fmt: Format, shape: tuple[int, ...], indices: Sequence[str], sizes: dict[str, int]) -> _Layout:
    """``fmt`` over ``shape`` read with ``indices``, each index in ``sizes`` split by its size."""
    first: list[int] = []  # split mode of each original mode (its block coordinate)
    split_shape: list[int] = []
    for m, n in enumerate(shape):
        first.append(len(split_shape))
        s = sizes.get(indices[m])
        split_shape += [n] if s is None else [n // s, s]
    levels, modes, sources = [], [], []
    for level, (m, _, inner) in enumerate(fmt.storage_levels(shape)):
        split = indices[m] in sizes
        blocked = fmt.block is not None and fmt.block[m] > 1
        if inner:
            if blocked:
                levels.append(fmt.levels[level]), modes.append(first[m] + 1), sources.append(level)
            continue  # a size-1 dense level: no positions to add
        levels.append(fmt.levels[level]), modes.append(first[m]), sources.append(level)
        if split and not blocked:  # a dense level split by another operand's blocks
            levels.append(Dense()), modes.append(first[m] + 1), sources.append(None)
    return _Layout(tuple(split_shape), tuple(levels), tuple(modes), tuple(sources))


def _with_block(fmt: Format, block: tuple[int, ...]) -> Format:
    """``fmt``'s outer levels (:func:`_unblocked`) with dense blocks of shape ``block``
    (unblocked if all 1)."""
    outer = _unblocked(fmt).levels
    if all(b == 1 for b in block):
        return Format(outer, fmt.mode_order, None)
    return Format(outer + (Dense(),) * fmt.rank, fmt.mode_order, block)


def _splits_densely(fmt: Format, indices: Sequence[str], sizes: dict[str, int]) -> bool:
    """Whether unblocked ``fmt`` stores every index of ``sizes`` in a dense level (which splits in two)."""
    return fmt.block is None and all(fmt.mode_level(m).full and fmt.mode_level(m).locatable
                                     for m, i in enumerate(indices) if i in sizes)


def _inferred(assignment: Assignment, formats: Sequence[Format | None]) -> Format | None:
    """The result's format when none is requested: that of the operand whose pattern it
    samples (read at exactly the output indices by every term, no other factor sparse),
    else the inference over the operands' outer levels, a mode sparse where its block's
    inner level is (n:m offsets)."""
    out = assignment.output
    for n, fmt in enumerate(formats):
        if fmt is not None and all(any(f.operand == n and f.indices == out for f in t.factors)
                                   and all(f.operand == n or formats[f.operand] is None for f in t.factors)
                                   for t in assignment.terms):
            return fmt
    return result_format(assignment, [None if f is None else _unblocked(f) for f in formats])


def _unblocked(fmt: Format) -> Format:
    """``fmt``'s outer levels as an unblocked format, compressed where a mode's inner
    level is not full (an n:m format reads as CSR)."""
    if fmt.block is None:
        return fmt
    inner = fmt.levels[fmt.rank:]  # the in-block levels, in mode order
    levels = tuple(level if inner[m].full else Compressed() for level, m in zip(fmt.levels, fmt.mode_order))
    return Format(levels, fmt.mode_order, None)


def _split_indices(assignment: Assignment, formats: Sequence[Format | None]) -> tuple[dict[str, int], set[int]]:
    """The indices to split with their sizes, and the blocked operands read split (the
    others are converted). Shrinks both until every reader of a split index stores it
    blocked by that size or in a dense level, and each operand splits each mode alike in
    all its accesses."""
    accesses = [a for t in assignment.terms for a in t.factors]
    kept = {n for n, f in enumerate(formats) if f is not None and f.block is not None}
    while True:
        wanted: dict[str, set[int]] = {}
        for a in accesses:
            if a.operand in kept:
                for m, i in enumerate(a.indices):
                    if formats[a.operand].block[m] > 1:
                        wanted.setdefault(i, set()).add(formats[a.operand].block[m])
        sizes = {i: next(iter(bs)) for i, bs in wanted.items() if len(bs) == 1}
        for a in accesses:
            fmt = formats[a.operand]
            if fmt is None:
                continue
            blocks = fmt.block if a.operand in kept else (1,) * fmt.rank
            storing = fmt if a.operand in kept else _unblocked(fmt)
            for m, i in enumerate(a.indices):
                if i in sizes and blocks[m] != sizes[i]:
                    level = storing.mode_level(m)
                    if blocks[m] != 1 or not (level.full and level.locatable):
                        del sizes[i]
        per_mode: dict[tuple[int, int], set[int | None]] = {}
        for a in accesses:
            for m, i in enumerate(a.indices):
                per_mode.setdefault((a.operand, m), set()).add(sizes.get(i))
        for a in accesses:
            for i in a.indices:
                if i in sizes and any(len(per_mode[a.operand, m]) > 1 for m in range(len(a.indices))):
                    del sizes[i]
        demoted = {a.operand for a in accesses if a.operand in kept
                   and any(formats[a.operand].block[m] != sizes.get(i, 1) and formats[a.operand].block[m] > 1
                           for m, i in enumerate(a.indices))}
        if not demoted:
            return sizes, kept
        kept -= demoted


@dataclass(frozen=True)
class Split:
    """A call with blocked operands as a call over split indices (see the module doc).

    ``original`` is the call's expression, ``assignment`` and ``request`` the split
    call's; :meth:`operands` views a call's operands for it and :meth:`result` turns
    its result back: a dense result is reshaped, a sparse one (over split modes)
    rebuilt in ``stored`` and converted to ``final`` if that differs."""

    original: Assignment
    assignment: Assignment
    sizes: tuple[tuple[str, int], ...]
    layouts: tuple[_Layout | None, ...]  # per operand: its split layout, or None
    converted: tuple[Format | None, ...]  # per operand: the unblocked format it is read in
    dense_indices: dict[int, tuple[str, ...]]  # per dense operand read: its indices
    request: Format | str | None
    out_shape: tuple[int, ...]
    stored: Format | None  # the sparse result's format before ``final``
    stored_layout: _Layout | None  # ... over split modes
    final: Format | None

    def operands(self, operands: Sequence) -> list:
        sizes = dict(self.sizes)
        out = []
        for n, op in enumerate(operands):
            if self.converted[n] is not None:
                op = op.asformat(self.converted[n])
            if self.layouts[n] is not None:
                out.append(_view(op, self.layouts[n]))
            elif isinstance(op, torch.Tensor) and n in self.dense_indices:
                out.append(_dense_view(op, self.dense_indices[n], sizes))
            else:
                out.append(op)  # unsplit sparse, or not read
        return out

    def result(self, result: torch.Tensor | SparseTensor) -> torch.Tensor | SparseTensor:
        if isinstance(result, torch.Tensor) and self.stored is None:
            return result.reshape(self.out_shape)
        if self.stored is None:  # "auto" over whole output indices
            return result
        layout = self.stored_layout
        pos, crd = [None] * len(self.stored.levels), [None] * len(self.stored.levels)
        if isinstance(result, torch.Tensor):  # every level dense: the values in storage order
            rebuilt = SparseTensor(self.out_shape, self.stored, pos, crd, result.permute(layout.modes).reshape(-1),
                                   check=False)
        else:
            for level, source in enumerate(layout.sources):
                if source is not None:
                    pos[source], crd[source] = result.pos[level], result.crd[level]
            rebuilt = SparseTensor(self.out_shape, self.stored, pos, crd, result.values, check=False,
                                   index_dtype=result.index_dtype)
        return rebuilt if self.final is None else rebuilt.asformat(self.final)

    def describe(self) -> str:
        sizes = ", ".join(f"{i} -> ({i}, {inner_name(i)}) by {s}" for i, s in self.sizes) or "none"
        lines = [f"blocked operands: indices split {sizes}"]
        for n, fmt in enumerate(self.converted):
            if fmt is not None:
                lines.append(f"  operand {n} read as {fmt} (its blocks do not split the indices the others share)")
        lines.append(f"split expression: {self.assignment}")
        return "\n".join(lines)


def _view(op: SparseTensor, layout: _Layout) -> SparseTensor:
    """``op`` over split modes, sharing its arrays and values."""
    pos = tuple(None if s is None else op.pos[s] for s in layout.sources)
    crd = tuple(None if s is None else op.crd[s] for s in layout.sources)
    return SparseTensor(layout.shape, layout.format, pos, crd, op.values, check=False, index_dtype=op.index_dtype)


def _dense_view(t: torch.Tensor, indices: Sequence[str], sizes: dict[str, int]) -> torch.Tensor:
    for m in reversed(range(len(indices))):
        if indices[m] in sizes:
            s = sizes[indices[m]]
            t = t.unflatten(m, (t.shape[m] // s, s))
    return t


def _split_access(indices: Sequence[str], sizes: dict[str, int]) -> tuple[str, ...]:
    return tuple(j for i in indices for j in ((i, inner_name(i)) if i in sizes else (i,)))


def split_call(assignment: Assignment, formats: Sequence[Format | None], shapes: Sequence[tuple[int, ...]],
               request: Format | str | None) -> Split | None:
    """How to run a call whose operands have ``formats`` (None: dense) and ``shapes``
    over split indices; None without blocked operands. ``request``: the checked
    ``out_format`` (None, ``"dense"``, ``"auto"`` or a Format)."""
    indices: dict[int, tuple[str, ...]] = {}  # each read operand's indices (its accesses split alike)
    for a in assignment.accesses:
        indices.setdefault(a.operand, a.indices)
    if not any(formats[n] is not None and formats[n].block is not None for n in indices):
        return None
    sizes, kept = _split_indices(assignment, formats)
    converted = tuple(_unblocked(f) if f is not None and f.block is not None and n not in kept else None
                      for n, f in enumerate(formats))
    reading = [c if c is not None else f for c, f in zip(converted, formats)]
    layouts = tuple(
        None if fmt is None or n not in indices or not (set(indices[n]) & set(sizes) or fmt.block is not None)
        else _layout(fmt, tuple(shapes[n]), indices[n], sizes)
        for n, fmt in enumerate(reading)
    )
    def split_accesses(accesses: Sequence[Access]) -> tuple[Access, ...]:
        return tuple(Access(a.operand, _split_access(a.indices, sizes)) for a in accesses)

    terms = tuple(Term(t.coefficient, split_accesses(t.factors), t.value) for t in assignment.terms)
    epilogue = assignment.epilogue
    if epilogue is not None:
        epilogue = Epilogue(split_accesses(epilogue.factors), epilogue.value)
    split = Assignment(_split_access(assignment.output, sizes), terms, assignment.operand_names,
                       assignment.reduction, epilogue, tuple(sorted((inner_name(i), s) for i, s in sizes.items())))
    out_sizes = {}
    for a in assignment.accesses:
        for m, i in enumerate(a.indices):
            out_sizes[i] = shapes[a.operand][m]
    out_shape = tuple(out_sizes[i] for i in assignment.output)
    out_blocks = tuple(sizes.get(i, 1) for i in assignment.output)
    stored, stored_layout, final, split_request = None, None, None, request
    if request != DENSE and not (request == AUTO and out_blocks == (1,) * len(out_blocks)):
        target = request if isinstance(request, Format) else _inferred(assignment, reading)
        if target is not None:
            if (target.block or (1,) * target.rank) == out_blocks or _splits_densely(target, assignment.output, sizes):
                stored = target  # split as it is: a requested pattern keeps its positions (sampled gradients)
            else:
                stored = _with_block(target, out_blocks)
            final = request if isinstance(request, Format) and request != stored else None
            stored_layout = _layout(stored, out_shape, assignment.output, sizes)
            split_request = stored_layout.format
            if split_request.is_dense:  # blocks of dense levels: a dense result, laid out after
                split_request = DENSE
        else:
            split_request = DENSE
    dense = {n: ix for n, ix in indices.items() if formats[n] is None}
    return Split(assignment, split, tuple(sorted(sizes.items())), layouts, converted, dense, split_request,
                 out_shape, stored, stored_layout, final)
