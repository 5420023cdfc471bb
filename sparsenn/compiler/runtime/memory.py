"""Memory for kernel outputs, reused from call to call.

A large output (a sampled product's values: ``nnz`` of them, tens of MiB for attention
scores) would be fresh memory from the system on every call, and a kernel writing it
first takes one page fault per 4 KiB page: about 1.5 µs each, as long as the arithmetic
for a sampled dot product, and far longer when two threads fault at once. So
:data:`OUTPUTS` keeps the memory of the last large outputs (at most
:data:`POOL_BUFFERS` buffers, :data:`POOL_BYTES` bytes) and hands a buffer out again,
for an output of exactly its size, once nothing else holds it: no tensor, view or
saved-for-backward reference shares its storage (the pool's own reference is the only
one). Repeated calls of one shape (a layer's forward and backward, step after step)
then write into memory already mapped. :func:`~.cache.clear_caches` releases it.
"""

from __future__ import annotations

import math
import threading

import torch

from .cache import CacheStats, register

__all__ = ["empty", "filled", "OutputPool", "OUTPUTS", "MIN_POOLED_BYTES", "POOL_BUFFERS", "POOL_BYTES"]

MIN_POOLED_BYTES = 1 << 20  # smaller outputs come from the allocator's own free lists
POOL_BUFFERS = 16
POOL_BYTES = 1 << 30


class OutputPool:
    """Storages of recent large outputs, reused once the pool holds the only reference
    (see the module doc); least recently handed out first to go."""

    def __init__(self, name: str, max_buffers: int, max_bytes: int) -> None:
        self.name, self.max_buffers, self.max_bytes = name, max_buffers, max_bytes
        self.hits = self.misses = self.evictions = 0
        self._storages: list[torch.UntypedStorage] = []  # most recently handed out last
        self._lock = threading.Lock()

    def empty(self, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty(size, dtype=dtype)``, in a free pooled storage of its size if any."""
        nbytes = math.prod(size) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES or _use_count is None:
            return torch.empty(size, dtype=dtype)
        with self._lock:
            for n, storage in enumerate(self._storages):
                if storage.nbytes() == nbytes and _only_reference(storage):
                    del self._storages[n]
                    self._storages.append(storage)
                    self.hits += 1
                    return torch.empty(0, dtype=dtype).set_(storage, 0, size)
            self.misses += 1
            t = torch.empty(size, dtype=dtype)
            self._storages.append(t.untyped_storage())
            self._evict()
            return t

    def _evict(self) -> None:
        """Forget storages beyond the bounds, least recently handed out first (one still
        in use lives on with its tensors)."""
        held = sum(s.nbytes() for s in self._storages)
        while len(self._storages) > self.max_buffers or held > self.max_bytes:
            held -= self._storages.pop(0).nbytes()
            self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()
            self.hits = self.misses = self.evictions = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._storages), self.max_buffers, self.hits, self.misses, self.evictions)


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # without it (another torch), no pooling


def _only_reference(storage: torch.UntypedStorage) -> bool:
    """Whether no tensor shares ``storage`` (the pool's own reference is its only one)."""
    return _use_count(storage._cdata) == 1


OUTPUTS = register(OutputPool("output buffers", POOL_BUFFERS, POOL_BYTES))


def empty(*size: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype)``, from :data:`OUTPUTS` when large (see the module doc)."""
    return OUTPUTS.empty(size, dtype)


def filled(value: float, *size: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(size, value, dtype=dtype)``, from :data:`OUTPUTS` when large."""
    return empty(*size, dtype=dtype).fill_(value)
