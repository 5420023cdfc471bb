"""Copies of operands kept while the operand is unchanged: dense copies of sparse
operands for the dense path (``plan/dense_path.py``, :data:`COPIES`), and the re-laid-out
copies a kernel reads of dense parameters (a transposed or panelled weight, :data:`RELAID`).

A copy is reused only while the operand is unchanged: the same values tensor (a dense
operand is its own values), of the same dtype, holding the same values (compared with a
snapshot at every use: an edit through ``.data`` or of an inference tensor changes no
version counter) over the same index arrays, unedited (their versions, or their contents
when they have none). Entries hold weak references, so a copy never keeps its operand
alive and a tensor allocated where a freed one was is never mistaken for it; a view of
the same arrays in another shape, format or strides (a transpose), or a copy made another
way (``how``), is kept apart. At most :data:`COPY_BYTES` of copies and snapshots per cache
(``$SPARSENN_DENSE_COPY_BYTES``) and :data:`MAX_OPERANDS` operands are kept, least
recently used first to go; :func:`~.cache.clear_caches` drops them.

An operand whose values were edited in place since its last call (their version moved:
an optimizer step) is being trained: its copy is made for the call and not kept (no
snapshot either), until a call finds it as the previous call left it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsenn.formats import SparseTensor

from .cache import CacheStats, register

__all__ = ["DenseCopies", "COPIES", "RELAID", "COPY_BYTES", "MAX_OPERANDS"]

try:  # the C library's memcmp: a snapshot compared at memory speed (torch.equal is about 8x slower)
    _memcmp = ctypes.CDLL(None).memcmp
    _memcmp.restype, _memcmp.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
except (OSError, AttributeError):
    _memcmp = None


def _same_bits(kept: torch.Tensor, current: torch.Tensor) -> bool:
    """Whether ``current`` holds exactly the bits of ``kept`` (a contiguous snapshot)."""
    if kept.dtype != current.dtype or kept.shape != current.shape:
        return False
    if _memcmp is None or not current.is_contiguous():
        return torch.equal(kept.view(torch.uint8), current.contiguous().view(torch.uint8)) if kept.numel() else True
    return _memcmp(kept.data_ptr(), current.data_ptr(), kept.numel() * kept.element_size()) == 0

COPY_BYTES = int(os.environ.get("SPARSENN_DENSE_COPY_BYTES", 256 << 20))
MAX_OPERANDS = 256


@dataclass
class _Operand:
    arrays: tuple  # weak references to the values and index arrays defining the operand
    index_state: tuple  # per index array its version, or (no version counter) a copy
    version: int | None  # the values' version when last seen (None: an inference tensor has none)
    snapshot: torch.Tensor | None  # the values the copy was made from; None while the operand is trained
    copy: torch.Tensor | None

    def defines(self, arrays: list[torch.Tensor]) -> bool:
        """Whether ``arrays`` (values, then index arrays) are this operand's, the index
        arrays unedited since."""
        for ref, a in zip(self.arrays, arrays):
            if ref() is not a:
                return False
        for state, a in zip(self.index_state, arrays[1:]):
            if not (_same_bits(state, a) if isinstance(state, torch.Tensor) else state == a._version):
                return False
        return True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.copy, self.snapshot) if t is not None)


class DenseCopies:
    """Copies of unchanged operands (see the module doc)."""

    def __init__(self, name: str, max_bytes: int, max_operands: int) -> None:
        self.name, self.max_bytes, self.max_operands = name, max_bytes, max_operands
        self.hits = self.misses = self.evictions = 0
        self._operands: OrderedDict[tuple, _Operand] = OrderedDict()
        self._lock = threading.Lock()

    def copy_for(self, operand: SparseTensor | torch.Tensor, make: Callable[[SparseTensor | torch.Tensor], torch.Tensor],
                 how: object = None) -> torch.Tensor:
        """The copy ``make(operand)`` made the way ``how`` names: the kept one if the
        operand is unchanged since, else made now, then kept. An operand whose values'
        version moved since its last call (trained) gets a copy made now and not kept:
        one test of its version, before its snapshot is compared."""
        key, arrays = _identity(operand, how)
        values = arrays[0]
        version = None if values.is_inference() else values._version
        with self._lock:
            known = self._operands.get(key)
            defined = known is not None and known.defines(arrays)
            trained = defined and known.version != version  # edited in place since its last call
            if trained:
                known.version, known.snapshot, known.copy = version, None, None
            elif defined and known.copy is not None and _same_bits(known.snapshot, values):
                self._operands.move_to_end(key)
                self.hits += 1
                return known.copy
            self.misses += 1
        copy = make(operand)
        if trained:
            return copy
        kept = _Operand(tuple(weakref.ref(a) for a in arrays), tuple(_index_state(a) for a in arrays[1:]), version,
                        values.detach().clone(memory_format=torch.contiguous_format), copy)
        if kept.nbytes <= self.max_bytes:
            with self._lock:
                self._operands[key] = kept
                self._operands.move_to_end(key)
                self._evict()
        return copy

    def _evict(self) -> None:
        held = sum(o.nbytes for o in self._operands.values())
        while self._operands and (held > self.max_bytes or len(self._operands) > self.max_operands):
            _, dropped = self._operands.popitem(last=False)
            held -= dropped.nbytes
            self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._operands.clear()
            self.hits = self.misses = self.evictions = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._operands), self.max_operands, self.hits, self.misses, self.evictions)


def _identity(operand: SparseTensor | torch.Tensor, how: object) -> tuple[tuple, list[torch.Tensor]]:
    """(a key, the arrays defining ``operand``: its values, then its index arrays). The
    key holds the shape and format (strides) too: a transposed view shares every array."""
    if isinstance(operand, torch.Tensor):
        return (tuple(operand.shape), operand.stride(), operand.storage_offset(), operand.dtype, how,
                id(operand)), [operand]
    arrays = [operand.values, *(a for a in (*operand.pos, *operand.crd) if a is not None)]
    return (tuple(operand.shape), operand.format, operand.values.dtype, how, *(id(a) for a in arrays)), arrays


def _index_state(t: torch.Tensor) -> int | torch.Tensor:
    """What tells an index array's later edits: its version, or a copy of its contents."""
    return t.clone(memory_format=torch.contiguous_format) if t.is_inference() else t._version


COPIES = register(DenseCopies("dense copies", COPY_BYTES, MAX_OPERANDS))
RELAID = register(DenseCopies("re-laid parameters", COPY_BYTES, MAX_OPERANDS))
