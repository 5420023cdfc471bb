"""Dense copies of sparse operands, for the dense path (``plan/dense_path.py``).

A copy is kept while the operand is unchanged: the same values tensor at the same
version (an in-place update, such as an optimizer step, bumps it) over the same index
arrays. Each operand's uses are counted, and its copy is made at the use by which
making it would have paid off (``uses · saved ≥ cost``: never more than twice the
cheaper of always and never copying, as in ski rental): at once when one use repays
it, at a later use when the values stay (inference), never when they change at every
step. Entries hold weak references, so a copy never keeps its operand alive and a
tensor allocated where a freed one was is never mistaken for it. At most
:data:`COPY_BYTES` of copies (``$SPARSENN_DENSE_COPY_BYTES``) and
:data:`MAX_OPERANDS` operands are kept, least recently used first to go;
:func:`~.cache.clear_caches` drops them.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsenn.formats import SparseTensor

from .cache import CacheStats, register

__all__ = ["DenseCopies", "COPIES", "COPY_BYTES", "MAX_OPERANDS"]

COPY_BYTES = int(os.environ.get("SPARSENN_DENSE_COPY_BYTES", 256 << 20))
MAX_OPERANDS = 256


@dataclass
class _Operand:
    arrays: tuple  # (weak reference, version) of each array defining the operand
    uses: int
    copy: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.copy is None else self.copy.numel() * self.copy.element_size()


class DenseCopies:
    """Dense copies of unchanged sparse operands (see the module doc)."""

    def __init__(self, name: str, max_bytes: int, max_operands: int) -> None:
        self.name, self.max_bytes, self.max_operands = name, max_bytes, max_operands
        self.hits = self.misses = self.evictions = 0
        self._operands: OrderedDict[tuple[int, ...], _Operand] = OrderedDict()
        self._lock = threading.Lock()

    def copy_for(self, operand: SparseTensor, pays: Callable[[int], bool],
                 make: Callable[[SparseTensor], torch.Tensor]) -> torch.Tensor | None:
        """The dense copy of ``operand``: the kept one if it is unchanged since, else
        ``make(operand)`` (then kept) if ``pays(uses)`` for its uses so far, else None."""
        key, arrays = _identity(operand)
        with self._lock:
            known = self._operands.get(key)
            if known is not None and _same(known.arrays, arrays):
                self._operands.move_to_end(key)
                if known.copy is not None:
                    self.hits += 1
                    return known.copy
                known.uses += 1
            else:
                known = self._operands[key] = _Operand(tuple((weakref.ref(a), a._version) for a in arrays), 1)
                self._evict()
            self.misses += 1
            if not pays(known.uses):
                return None
        copy = make(operand)
        if copy.numel() * copy.element_size() <= self.max_bytes:
            with self._lock:
                known.copy = copy
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


def _identity(operand: SparseTensor) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """(a key, the arrays whose identity and version define ``operand``)."""
    arrays = [operand.values, *(a for a in (*operand.pos, *operand.crd) if a is not None)]
    return tuple(id(a) for a in arrays), arrays


def _same(kept: tuple, arrays: list[torch.Tensor]) -> bool:
    return len(kept) == len(arrays) and all(ref() is a and version == a._version
                                            for (ref, version), a in zip(kept, arrays))


COPIES = register(DenseCopies("dense copies", COPY_BYTES, MAX_OPERANDS))
