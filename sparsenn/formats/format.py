"""Format: level kinds + mode order (+ block shape), and the format-name parser.

Storage level ``l`` of an unblocked format stores logical mode
``mode_order[l]``. A blocked format with ``block = (b_0, ..., b_{r-1})`` has
``2 r`` storage levels: level ``l < r`` stores the block coordinate
``i_m // b_m`` of mode ``m = mode_order[l]`` and dense level ``r + m`` stores
the in-block coordinate ``i_m % b_m``, modes in natural order. So each block is
stored row-major, exactly torch's BSR/BSC ``values`` of shape ``(nnzb, bh, bw)``.

The n:m format ``nm(n,m)`` (at most ``n`` of every ``m`` consecutive entries
along the last dimension) is the blocked format with ``block = (1, ..., 1, m)``,
natural mode order, dense levels and a last level ``Grouped(count=n)``: group
``g = i_{r-1} // m`` of every leading index stores exactly ``n`` in-group
offsets ``i_{r-1} % m``, padded with explicit zeros.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from sparsenn.formats.level import LEVEL_KINDS, Compressed, Dense, Grouped, Level, Singleton

ACCEPTED_FORMS = (
    "'dense', 'csr', 'csc', 'coo', 'dcsr', 'dcsc', 'csf', 'bsr(bh,bw)', 'bsc(bh,bw)' "
    "(bsr/bsc for rank 2 only), 'nm(n,m)' (at most n of every m consecutive entries "
    "along the last dimension, 1 <= n <= m), or one letter per dimension from d (dense), "
    "c (compressed), s (singleton; only after c or s), optionally followed by a "
    "mode order such as '[1,0]' and a block shape such as '(2,2)'"
)

_NAMED_RANK2 = {
    ("dc", (0, 1)): "csr",
    ("dc", (1, 0)): "csc",
    ("cc", (0, 1)): "dcsr",
    ("cc", (1, 0)): "dcsc",
}

_INTS = r"\d+(?:,\d+)*"
_GENERAL = re.compile(rf"([dcs]+)(?:\[({_INTS})\])?(?:\(({_INTS})\))?")
_BLOCKED = re.compile(rf"(bsr|bsc)\(({_INTS})\)")
_NM = re.compile(r"nm\((\d+),(\d+)\)")


@dataclass(frozen=True)
class Format:
    """How a tensor is stored: one level kind per storage level.

    ``levels``: the level kinds, ``rank`` of them (``2 * rank`` if blocked, the
    last ``rank`` dense; in ``nm(n,m)`` all dense but the last, ``Grouped``).
    ``mode_order``: storage level ``l < rank`` stores logical mode ``mode_order[l]``.
    ``block``: block shape or None. The ``unique`` flag of each level is derived
    here: False iff the next level is a singleton.
    """

    levels: tuple[Level, ...]
    mode_order: tuple[int, ...]
    block: tuple[int, ...] | None = None

    def __hash__(self) -> int:
        """Computed once: formats key the compiler's plan caches on every call."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.levels, self.mode_order, self.block))
            object.__setattr__(self, "_hash", value)
            return value

    def __reduce__(self):
        """Pickle the fields only: the cached hash is per process (str hashes are salted)."""
        return type(self), (self.levels, self.mode_order, self.block)

    def __post_init__(self) -> None:
        levels = tuple(self.levels)
        mode_order = tuple(int(m) for m in self.mode_order)
        block = None if self.block is None else tuple(self.block)
        rank = len(mode_order)
        if not all(isinstance(level, Level) for level in levels):
            raise TypeError(f"Format levels must be Level instances, got {levels!r}")
        if sorted(mode_order) != list(range(rank)):
            raise ValueError(f"mode_order {mode_order} is not a permutation of range({rank})")
        if block is None:
            if len(levels) != rank:
                raise ValueError(f"{len(levels)} levels for mode_order of rank {rank}")
        else:
            if rank == 0 or len(block) != rank:
                raise ValueError(f"block {block} must have one size per mode (rank {rank})")
            if not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"block sizes must be positive ints, got {block}")
            inner_dense = levels[rank:-1] if levels and isinstance(levels[-1], Grouped) else levels[rank:]
            if len(levels) != 2 * rank or not all(isinstance(lv, Dense) for lv in inner_dense):
                raise ValueError("a blocked format needs rank outer levels followed by rank dense levels "
                                 "(the last may be Grouped in an nm(n,m) format)")
        if any(isinstance(level, Grouped) for level in levels[:-1]):
            raise ValueError(f"a Grouped level must be the last level, got levels {levels}")
        if block is not None and isinstance(levels[-1], Grouped):
            _check_nm(levels, mode_order, block)
        for index, level in enumerate(levels):
            if isinstance(level, Singleton) and (index == 0 or not levels[index - 1].has_crd):
                raise ValueError("a singleton level must directly follow a compressed or singleton level")
        next_singleton = [isinstance(level, Singleton) for level in levels[1:]] + [False]
        levels = tuple(replace(level, unique=not nxt) for level, nxt in zip(levels, next_singleton))
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "mode_order", mode_order)
        object.__setattr__(self, "block", block)
        # Derived once, here rather than lazily: traced code (torch.compile) reads them.
        last = levels[-1] if levels else None
        object.__setattr__(self, "_nm", (last.count, block[-1]) if isinstance(last, Grouped) and block else None)
        object.__setattr__(self, "_is_dense", block is None and all(level.locatable for level in levels))

    @property
    def rank(self) -> int:
        """Number of logical modes."""
        return len(self.mode_order)

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(n, m)`` of an ``nm(n,m)`` format, else None."""
        return self._nm

    @property
    def is_dense(self) -> bool:
        """True when every level is dense and there is no block."""
        return self._is_dense

    def in_mode_order(self, order: tuple[int, ...], exact: bool = False) -> Format:
        """The (unblocked) format a copy re-stored in mode order ``order`` takes: the same
        level kinds in the same places (see :meth:`Level.restored`), so a dense level
        may come to lie below a sparse one and store zeros where the tensor has no
        entry. ``exact``: such dense levels are compressed instead, so the copy stores
        exactly the tensor's entries (its pattern)."""
        return Format(self.restored_levels(exact), order, None)

    def restored_levels(self, exact: bool = False) -> tuple[Level, ...]:
        """The levels of :meth:`in_mode_order`'s format, which do not depend on the order
        (made once per format: the scheduler asks for them for every loop order it costs)."""
        return _restored_levels(self, exact)

    def mode_level(self, mode: int) -> Level:
        """The storage level that stores mode ``mode`` (its block coordinate, if blocked)."""
        return self.levels[self.mode_order.index(mode)]

    def mode_full(self, mode: int) -> bool:
        """Whether every coordinate of mode ``mode`` is stored under each parent: its level
        is full and, if blocked, so is its in-block level (an n:m group's is not)."""
        return self.mode_level(mode).full and (self.block is None or self.levels[self.rank + mode].full)

    @property
    def letters(self) -> str:
        """Level letters of every storage level, e.g. ``"dc"`` (``"dcdd"`` for BSR)."""
        return "".join(level.letter for level in self.levels)

    @property
    def dense_prefix(self) -> int:
        """Number of leading dense storage levels (1 for CSR, 0 for DCSR and COO)."""
        letters = self.letters
        return len(letters) - len(letters.lstrip("d"))

    def storage_levels(self, shape: tuple[int, ...]) -> tuple[tuple[int, int, bool], ...]:
        """``(mode, size, is_block_inner)`` of each storage level for a tensor of ``shape``."""
        shape = tuple(shape)
        if len(shape) != self.rank:
            raise ValueError(f"format {self} has rank {self.rank} but shape {shape} has rank {len(shape)}")
        if self.block is None:
            return tuple((m, shape[m], False) for m in self.mode_order)
        if self.nm is not None and shape[-1] % self.block[-1]:
            raise ValueError(f"the last dimension of shape {shape} is not divisible by the group size "
                             f"m={self.block[-1]} of format {self}")
        if any(n % b for n, b in zip(shape, self.block)):
            raise ValueError(f"shape {shape} is not divisible by the block {self.block} of format {self}")
        outer = tuple((m, shape[m] // self.block[m], False) for m in self.mode_order)
        inner = tuple((m, self.block[m], True) for m in range(self.rank))
        return outer + inner

    def __str__(self) -> str:
        rank = self.rank
        outer = self.letters[:rank]
        identity = self.mode_order == tuple(range(rank))
        if self.nm is not None:
            return "nm({},{})".format(*self.nm)
        if self.block is not None:
            sizes = ",".join(map(str, self.block))
            if rank == 2 and outer == "dc":
                return f"{'bsr' if identity else 'bsc'}({sizes})"
            order = "" if identity else f"[{','.join(map(str, self.mode_order))}]"
            return f"{outer}{order}({sizes})"
        if (outer, self.mode_order) in _NAMED_RANK2:
            return _NAMED_RANK2[outer, self.mode_order]
        if identity:
            if self.is_dense:
                return "dense"
            if rank >= 1 and outer == "c" + "s" * (rank - 1):
                return "coo"
            if rank >= 3 and outer == "c" * rank:
                return "csf"
            return outer
        return f"{outer}[{','.join(map(str, self.mode_order))}]"


@functools.lru_cache(maxsize=1024)
def _restored_levels(fmt: Format, exact: bool) -> tuple[Level, ...]:
    levels, sparse_above = [], False
    for level in fmt.levels:
        level = level.restored()
        if exact and sparse_above and level.full:
            level = Compressed()
        sparse_above |= not level.full
        levels.append(level)
    return Format(tuple(levels), tuple(range(len(levels))), None).levels  # with their unique flags


def _from_letters(letters: str, mode_order: tuple[int, ...] | None = None,
                  block: tuple[int, ...] | None = None) -> Format:
    rank = len(letters)
    levels = [LEVEL_KINDS[letter]() for letter in letters]
    if block is not None:
        levels += [Dense()] * rank
    order = tuple(range(rank)) if mode_order is None else mode_order
    return Format(tuple(levels), order, block)


def _check_nm(levels: tuple[Level, ...], mode_order: tuple[int, ...], block: tuple[int, ...] | None) -> None:
    """Check the nm(n,m) layout: block ``(1, ..., 1, m)``, natural mode order, dense
    levels and a last ``Grouped(count=n)`` level with ``n <= m``."""
    rank = len(mode_order)
    if (block is None or not isinstance(levels[-1], Grouped) or mode_order != tuple(range(rank))
            or block[:-1] != (1,) * (rank - 1) or not all(isinstance(lv, Dense) for lv in levels[:-1])):
        raise ValueError("a Grouped level must be the last level of an nm(n,m) format: block (1, ..., 1, m), "
                         f"mode order (0, ..., rank - 1) and dense levels otherwise; got levels {levels}, "
                         f"mode_order {mode_order}, block {block}")
    if levels[-1].count > block[-1]:
        raise ValueError(f"nm(n,m) needs n <= m, got n={levels[-1].count} > m={block[-1]}")


def _nm_format(n: int, m: int, rank: int) -> Format:
    """The ``nm(n,m)`` format of rank ``rank``: groups of ``m`` along the last dimension."""
    if rank < 1:
        raise ValueError("'nm(n,m)' needs rank >= 1")
    if m < 1:
        raise ValueError(f"nm(n,m) needs m >= 1, got m={m}")
    if n < 1:
        raise ValueError(f"nm(n,m) needs n >= 1, got n={n}")
    if n > m:
        raise ValueError(f"nm(n,m) needs n <= m, got n={n} > m={m}")
    levels = (Dense(),) * (2 * rank - 1) + (Grouped(count=n),)
    return Format(levels, tuple(range(rank)), (1,) * (rank - 1) + (m,))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _parse_string(spec: str, rank: int) -> Format:
    """Parse a lower-case, whitespace-free format name; raise ValueError with a reason."""
    if spec == "dense":
        return _from_letters("d" * rank)
    if spec in ("csr", "csc", "dcsr", "dcsc"):
        if rank != 2:
            raise ValueError(f"{spec!r} is a rank-2 format")
        letters = "dc" if spec in ("csr", "csc") else "cc"
        return _from_letters(letters, (0, 1) if spec.endswith("r") else (1, 0))
    if spec in ("coo", "csf"):
        if rank < 1:
            raise ValueError(f"{spec!r} needs rank >= 1")
        return _from_letters("c" + ("s" if spec == "coo" else "c") * (rank - 1))
    match = _BLOCKED.fullmatch(spec)
    if match:
        if rank != 2:
            raise ValueError(f"{match[1]!r} is a rank-2 format")
        block = _ints(match[2])
        if len(block) != 2:
            raise ValueError("a block shape needs two sizes (bh,bw)")
        return _from_letters("dc", (0, 1) if match[1] == "bsr" else (1, 0), block)
    match = _NM.fullmatch(spec)
    if match:
        return _nm_format(int(match[1]), int(match[2]), rank)
    match = _GENERAL.fullmatch(spec)
    if match is None:
        raise ValueError("unknown format")
    letters = match[1]
    if len(letters) != rank:
        raise ValueError(f"{len(letters)} level letters for a rank-{rank} tensor")
    mode_order = None if match[2] is None else _ints(match[2])
    block = None if match[3] is None else _ints(match[3])
    return _from_letters(letters, mode_order, block)


def parse_format(spec: str | Format, rank: int) -> Format:
    """Return the ``Format`` named by ``spec`` for a tensor of rank ``rank``.

    ``spec`` is a ``Format`` (checked against ``rank``) or a case-insensitive,
    whitespace-tolerant name: ``dense``, ``csr`` (``dc``), ``csc`` (``dc[1,0]``),
    ``coo`` (``cs...s``), ``dcsr`` (``cc``), ``dcsc`` (``cc[1,0]``), ``csf``
    (``c...c``), ``bsr(bh,bw)`` / ``bsc(bh,bw)``, ``nm(n,m)``, or a level string such as
    ``dcc``, optionally with a mode order ``[2,0,1]`` and a block ``(2,2)``.
    ``str(fmt)`` is always accepted back. Raises ValueError otherwise.
    """
    if isinstance(spec, Format):
        if spec.rank != rank:
            raise ValueError(f"format {spec} has rank {spec.rank}, expected rank {rank}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"format must be a str or Format, got {type(spec).__name__}")
    if rank < 0:
        raise ValueError(f"rank must be non-negative, got {rank}")
    try:
        return _parse_string(re.sub(r"\s+", "", spec).lower(), rank)
    except ValueError as error:
        raise ValueError(f"invalid format {spec!r} for a rank-{rank} tensor ({error}); "
                         f"accepted: {ACCEPTED_FORMS}") from None
