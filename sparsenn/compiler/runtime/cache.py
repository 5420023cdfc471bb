"""Bounded least-recently-used caches, one class for every cache of the compiler.

Each :class:`LRUCache` registers itself by name; :func:`clear_caches` empties them all
and :func:`cache_stats` reports each one's size, limit, hits, misses and evictions.

Entries are stored under their key's hash, with the key beside the value: a lookup
hashes its key once (keys are tuples of shapes, formats and expressions, rehashed on
every hash) and compares it with the stored key, usually by identity of its parts. Two
keys with one hash share a slot, the later replacing the earlier. Lookups take no lock
(a dictionary read and a move to the end, atomic under the GIL; an entry evicted by
another thread in between reads as a miss), insertions do; hit and miss counts are
exact in one thread and approximate under concurrent calls.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["LRUCache", "CacheStats", "clear_caches", "cache_stats", "register"]

V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    """A cache's counters since it was created or last cleared."""

    size: int
    maxsize: int
    hits: int
    misses: int
    evictions: int


class LRUCache(Generic[V]):
    """A mapping of at most ``maxsize`` entries that evicts the least recently used."""

    __slots__ = ("name", "maxsize", "hits", "misses", "evictions", "_data", "_lock")

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"cache {name!r}: maxsize must be at least 1, got {maxsize}")
        if name in _registry:
            raise ValueError(f"a cache named {name!r} already exists")
        self.name = name
        self.maxsize = maxsize
        self.hits = self.misses = self.evictions = 0
        self._data: OrderedDict[int, tuple[Hashable, V]] = OrderedDict()  # hash -> (key, value)
        self._lock = threading.Lock()
        _registry[name] = self

    def get(self, key: Hashable) -> V | None:
        """The entry for ``key`` (now the most recently used), or None."""
        slot = hash(key)
        try:
            entry = self._data[slot]
            self._data.move_to_end(slot)
        except KeyError:
            entry = None
        if entry is None or entry[0] != key:
            self.misses += 1
            return None
        self.hits += 1
        return entry[1]

    def put(self, key: Hashable, value: V) -> None:
        """Store ``value`` under ``key``, evicting the least recently used entries beyond ``maxsize``."""
        slot = hash(key)
        with self._lock:
            self._data[slot] = (key, value)
            self._data.move_to_end(slot)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
                self.evictions += 1

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._data.clear()
            self.hits = self.misses = self.evictions = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._data), self.maxsize, self.hits, self.misses, self.evictions)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        stored = self._data.get(hash(key))
        return stored is not None and stored[0] == key

    def __repr__(self) -> str:
        s = self.stats()
        return f"LRUCache({self.name!r}, {s.size}/{s.maxsize}, hits={s.hits}, misses={s.misses})"


_registry: dict[str, LRUCache] = {}

Cache = TypeVar("Cache")


def register(cache: Cache) -> Cache:
    """Add another kind of cache (one with ``name``, ``clear()`` and ``stats()``, such as
    :class:`~.memory.OutputPool`) to those :func:`clear_caches` empties and
    :func:`cache_stats` reports."""
    if cache.name in _registry:
        raise ValueError(f"a cache named {cache.name!r} already exists")
    _registry[cache.name] = cache
    return cache


def clear_caches() -> None:
    """Empty every compiler cache (parsed equations, calls, plans, contraction paths and
    their pair schedules, re-stored patterns) and release the memory kept for kernel
    outputs. Compiled kernels stay loaded and on disk; the next call of each expression
    plans it again."""
    for cache in _registry.values():
        cache.clear()


def cache_stats() -> dict[str, CacheStats]:
    """Each compiler cache's :class:`CacheStats`, by name."""
    return {name: cache.stats() for name, cache in _registry.items()}
