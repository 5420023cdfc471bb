"""Memory for kernel outputs: reused from call to call, and poisoned on request.

A large output (a sampled product's values: ``nnz`` of them, tens of MiB for attention
scores) would be fresh memory from the system on every call, and a kernel writing it
first takes one page fault per 4 KiB page: about 1.5 µs each, as long as the arithmetic
for a sampled dot product, and far longer when two threads fault at once. So
:data:`OUTPUTS` keeps the storages of recent large outputs and hands one out again once
nothing else holds it: no tensor, view or saved-for-backward reference shares it (the
pool's own reference is the only one). Storages come in size classes (``m · 2^k`` bytes,
``m`` in 4..7), so calls whose sizes differ a little (varying batch sizes) share them.
Repeated calls then write into memory already mapped.

What the pool may keep unasked is bounded: at most :data:`POOL_BUFFERS` storages, of
which the idle ones (held by nothing but the pool) take at most :data:`POOL_BYTES`
(``$SPARSENN_OUTPUT_POOL_BYTES``, or :func:`set_output_pool_limit`).
:func:`~.cache.clear_caches` releases them all.

Poisoning (``$SPARSENN_POISON_OUTPUTS=1`` or :func:`poison_outputs`) fills every
allocation made here with NaN (integers: their largest value) before a kernel writes
it, so an element a kernel should store and skips shows in the result instead of
reading as the zero a fresh page happens to hold. The test suite turns it on.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable

import torch

from .cache import CacheStats, register

__all__ = ["empty", "empty_permuted", "filled", "allocator", "poison_outputs", "set_output_pool_limit", "OutputPool", "OUTPUTS",
           "MIN_POOLED_BYTES", "POOL_BUFFERS", "POOL_BYTES"]

MIN_POOLED_BYTES = 1 << 20  # smaller outputs come from the allocator's own free lists
POOL_BUFFERS = 16
POOL_BYTES = int(os.environ.get("SPARSENN_OUTPUT_POOL_BYTES", 64 << 20))

_poisoned = os.environ.get("SPARSENN_POISON_OUTPUTS", "") not in ("", "0")


def poison_outputs(enabled: bool = True) -> bool:
    """Turn poisoning of fresh output memory on or off (see the module doc); returns
    the previous setting."""
    global _poisoned
    previous, _poisoned = _poisoned, bool(enabled)
    return previous


def set_output_pool_limit(max_bytes: int) -> None:
    """Keep at most ``max_bytes`` of idle output memory for reuse (0: keep none)."""
    if max_bytes < 0:
        raise ValueError(f"the output pool's limit must be at least 0 bytes, got {max_bytes}")
    OUTPUTS.max_bytes = int(max_bytes)
    OUTPUTS.trim()


def size_class(nbytes: int) -> int:
    """The smallest ``m · 2^k`` (``m`` in 4..7) of at least ``nbytes``: at most 25 % over."""
    shift = max(nbytes.bit_length() - 3, 0)
    return -(-nbytes >> shift) << shift


class OutputPool:
    """Storages of recent large outputs, reused once the pool holds the only reference
    (see the module doc); least recently handed out first to go."""

    def __init__(self, name: str, max_buffers: int, max_bytes: int) -> None:
        self.name, self.max_buffers, self.max_bytes = name, max_buffers, max_bytes
        self.hits = self.misses = self.evictions = 0
        self._storages: list[torch.UntypedStorage] = []  # most recently handed out last
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty(shape, dtype=dtype)``, in a free pooled storage of its size class if any."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES or _use_count is None or self.max_bytes == 0:
            return torch.empty(shape, dtype=dtype)
        wanted = size_class(nbytes)
        with self._lock:
            for n, storage in enumerate(self._storages):
                if storage.nbytes() == wanted and _only_reference(storage):
                    del self._storages[n]
                    self._storages.append(storage)
                    self.hits += 1
                    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            self.misses += 1
            storage = torch.empty(wanted, dtype=torch.uint8).untyped_storage()
            self._storages.append(storage)
            self._evict()
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _evict(self) -> None:
        """Forget storages beyond the bounds, least recently handed out first: any beyond
        ``max_buffers`` (one still in use lives on with its tensors), and idle ones
        beyond ``max_bytes``."""
        while len(self._storages) > self.max_buffers:
            self._storages.pop(0)
            self.evictions += 1
        idle = [s for s in self._storages if _only_reference(s)]
        held = sum(s.nbytes() for s in idle)
        for storage in idle:
            if held <= self.max_bytes:
                break
            held -= storage.nbytes()
            self._storages.remove(storage)
            self.evictions += 1

    def trim(self) -> None:
        """Apply the bounds now (after they changed)."""
        with self._lock:
            self._evict()

    def idle_bytes(self) -> int:
        """Bytes of the storages nothing but the pool holds."""
        with self._lock:
            return sum(s.nbytes() for s in self._storages if _only_reference(s))

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()
            self.hits = self.misses = self.evictions = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._storages), self.max_buffers, self.hits, self.misses, self.evictions)


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # without it (another torch), no pooling


def _only_reference(storage: torch.UntypedStorage) -> bool:
    """Whether no tensor shares ``storage`` (the pool's list holds its only reference)."""
    return _use_count(storage._cdata) == 1


OUTPUTS = register(OutputPool("output buffers", POOL_BUFFERS, POOL_BYTES))


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` for a kernel to overwrite: from :data:`OUTPUTS`
    when large, poisoned when poisoning is on (see the module doc)."""
    t = OUTPUTS.empty(shape, dtype)
    return _poison(t) if _poisoned else t


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(torch.iinfo(t.dtype).max if _is_integer(t.dtype) else math.nan)


def allocator(shape: tuple[int, ...], dtype: torch.dtype, fill: float | None = None,
              layout: tuple[int, ...] | None = None) -> Callable[[], torch.Tensor]:
    """:func:`empty` (``fill`` None) or :func:`filled` of a fixed shape and dtype, as a
    function of no arguments (a launch's output). With ``layout`` (a permutation: the
    tensor's dimensions from outermost to innermost in memory, as
    ``torch.empty_permuted``'s) the memory is laid out in that order, so a kernel that
    writes in storage order returns the tensor as it is, no permuted view made per call.
    A small output never comes from the pool, so its allocator skips the pool's test and
    asks a CPU tensor of the dtype for a new one with the sizes (and strides) one by one
    (``new_empty``, ``new_empty_strided``): torch parses neither a shape tuple nor a dtype
    argument then (about 40 % of a small call's allocation)."""
    small = bool(shape) and math.prod(shape) * dtype.itemsize < MIN_POOLED_BYTES
    if layout is not None:
        if small and fill is None:
            return _strided_allocator(_template(dtype), shape, _permuted_strides(shape, layout))
        return functools.partial(empty_permuted, shape, layout, dtype) if fill is None else \
            functools.partial(_filled_permuted, fill, shape, layout, dtype)
    if not small:
        return functools.partial(empty, shape, dtype) if fill is None else functools.partial(filled, fill, shape, dtype)
    template = _template(dtype)
    if fill is None:
        new_empty = template.new_empty

        def allocate() -> torch.Tensor:
            t = new_empty(*shape)
            return _poison(t) if _poisoned else t

        return allocate
    if fill == 0:
        return functools.partial(template.new_zeros, *shape)
    return functools.partial(template.new_full, shape, fill)


@functools.lru_cache(maxsize=None)
def _template(dtype: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor of ``dtype``, whose ``new_*`` methods allocate outputs."""
    return torch.empty(0, dtype=dtype, device="cpu")


def _strided_allocator(template: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]
                       ) -> Callable[[], torch.Tensor]:
    new_empty_strided = template.new_empty_strided

    def allocate() -> torch.Tensor:
        t = new_empty_strided(shape, strides)
        return _poison(t) if _poisoned else t

    return allocate


def _permuted_strides(shape: tuple[int, ...], layout: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of ``torch.empty_permuted(shape, layout)``: dense, ``layout[-1]`` innermost."""
    strides, step = [0] * len(shape), 1
    for d in reversed(layout):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def empty_permuted(shape: tuple[int, ...], layout: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty` of ``shape`` whose dimensions lie in memory in ``layout`` order
    (outermost first): ``empty`` of the permuted shape, viewed back in ``shape``'s order."""
    if math.prod(shape) * dtype.itemsize < MIN_POOLED_BYTES:
        t = torch.empty_permuted(shape, layout, dtype=dtype)
        return _poison(t) if _poisoned else t
    inverse = [0] * len(layout)
    for k, d in enumerate(layout):
        inverse[d] = k
    return empty(tuple(shape[d] for d in layout), dtype).permute(inverse)


def _filled_permuted(value: float, shape: tuple[int, ...], layout: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty_permuted(shape, layout, dtype).fill_(value)


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def filled(value: float, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(shape, value, dtype=dtype)``, from :data:`OUTPUTS` when large."""
    return OUTPUTS.empty(shape, dtype).fill_(value)
