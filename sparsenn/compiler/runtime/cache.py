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
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["LRUCache", "GuardedCache", "CacheStats", "clear_caches", "cache_stats", "register",
           "forget_with_caches"]

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


Guard = Callable[[object, object], bool]  # (operands, detail) -> whether a call has an entry's key


class GuardedCache(LRUCache[tuple[Guard, V]]):
    """An :class:`LRUCache` of call keys whose entries carry a guard, a test of
    ``(operands, detail)`` true exactly for the calls with the entry's key; per
    expression (an object matched by identity, and held) the entries of its last
    ``per_expression`` call signatures are also found by their guards, newest first, so a
    repeated call is found without building and hashing its key (:meth:`find`). Hits and
    misses count calls: one per call found by guard or looked up by key."""

    __slots__ = ("per_expression", "_recent")

    def __init__(self, name: str, maxsize: int, per_expression: int) -> None:
        super().__init__(name, maxsize)
        self.per_expression = per_expression
        # id(expression) -> (expression, ((guard, value), ...)): holding it keeps the id unique.
        self._recent: dict[int, tuple[object, tuple[tuple[Guard, V], ...]]] = {}

    def find(self, expression: object, operands: object, detail: object) -> V | None:
        """The value of ``expression``'s first recent entry whose guard passes, or None
        (uncounted: look the key up next)."""
        entry = self.find_entry(expression, operands, detail)
        return None if entry is None else entry[1]

    def find_entry(self, expression: object, operands: object, detail: object) -> tuple[Guard, V] | None:
        """``expression``'s first recent entry ``(guard, value)`` whose guard passes, or None."""
        slot = self._recent.get(id(expression))
        if slot is not None:
            for entry in slot[1]:
                if entry[0](operands, detail):
                    self.hits += 1
                    return entry
        return None

    def lookup(self, expression: object, key: Hashable) -> V | None:
        """The value stored under ``key`` (now ``expression``'s newest recent entry), or None."""
        entry = self.get(key)
        if entry is None:
            return None
        self._remember(expression, entry)
        return entry[1]

    def store(self, expression: object, key: Hashable, guard: Guard, value: V) -> None:
        """Store ``value`` under ``key`` with its guard, as ``expression``'s newest recent entry."""
        self.put(key, (guard, value))
        self._remember(expression, (guard, value))

    def _remember(self, expression: object, entry: tuple[Guard, V]) -> None:
        with self._lock:
            slot = self._recent.pop(id(expression), None)
            older = tuple(e for e in slot[1] if e is not entry)[: self.per_expression - 1] if slot else ()
            self._recent[id(expression)] = (expression, (entry, *older))
            while len(self._recent) > self.maxsize:
                del self._recent[next(iter(self._recent))]

    def clear(self) -> None:
        super().clear()
        with self._lock:
            self._recent.clear()


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


_holders: weakref.WeakSet = weakref.WeakSet()


def forget_with_caches(holder: object) -> None:
    """Have :func:`clear_caches` also call ``holder.clear()`` (an object holding what the
    caches resolved, such as a :class:`~.site.CallSite`), for as long as it lives."""
    _holders.add(holder)


def clear_caches() -> None:
    """Empty every compiler cache (parsed equations, calls, plans, contraction paths and
    their pair schedules, re-stored patterns), what call sites hold of them, and release
    the memory kept for kernel outputs. Compiled kernels stay loaded and on disk; the next
    call of each expression plans it again."""
    for cache in _registry.values():
        cache.clear()
    for holder in list(_holders):
        holder.clear()


def cache_stats() -> dict[str, CacheStats]:
    """Each compiler cache's :class:`CacheStats`, by name."""
    return {name: cache.stats() for name, cache in _registry.items()}
