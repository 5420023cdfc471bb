"""Level kinds: how one storage level of a sparse tensor is laid out, and what the
compiler may ask of it.

A sparse tensor is stored as a tree of levels (TACO's format abstraction,
Chou, Kjolstad and Amarasinghe, OOPSLA 2018). The root has one position, 0.
Each level maps a parent position ``p`` and a coordinate ``i`` to a child
position:

* ``Dense`` (``d``) of size ``N``: every coordinate is present and the child
  position is ``p * N + i`` (it can *locate* a coordinate in O(1)).
* ``Compressed`` (``c``): the children of ``p`` are the positions
  ``pos[p] .. pos[p+1] - 1`` and their coordinates are ``crd[q]``.
* ``Singleton`` (``s``): exactly one child per parent, at the parent's own
  position, with coordinate ``crd[p]`` (the column array of COO).
* ``Grouped`` (``n``) with ``count = n``: exactly ``n`` children per parent, at
  positions ``p * n .. p * n + n - 1``, coordinates ``crd[q]`` strictly increasing
  within each parent (the in-group offsets of the n:m format).

Code that iterates, locates or assembles levels asks these capabilities and
never tests for a named format such as "CSR" or for a level's letter.

**Capabilities.** Properties: ``locatable``, ``full`` (every coordinate present),
``ordered``, ``unique`` (per instance), ``branchless`` (one child per parent),
:meth:`Level.restored` (the kind it takes when a tensor is re-stored in another mode order),
``has_pos``/``has_crd`` (its arrays) and ``assembly`` (how a kernel writes it: a
located level is *inserted* at ``p * N + i``, others are *appended*). Methods build the
index expressions of iteration and location. ``formats`` must not depend on the
compiler, so they build through an :class:`IndexBuilder` the compiler passes in
(dependency inversion): the builder knows which tensor and level it reads and makes
the compiler's IR; a level only says how its positions relate:

* :meth:`Level.locate` the child position of coordinate ``i`` under ``p`` (locatable
  levels only);
* :meth:`Level.position_bounds` the positions ``[lo, hi)`` under ``p`` (the others);
  a singleton under a non-unique parent takes that parent's segment ``[p, end)``;
* :meth:`Level.positions` the level's position count (its ``crd`` length);
* :meth:`Level.estimate_positions` that count estimated for the scheduler.

Segment ends of non-unique levels (runs of equal coordinates) are not a level's
business: any non-unique level's segment is found the same way, by the compiler.
A new level kind is one subclass answering these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from torch import Tensor


class IndexBuilder(Protocol):
    """Index expressions over one storage level of one tensor, as the compiler's IR:
    ``pos(at)``/``crd(at)`` load this level's arrays, ``add``/``mul`` combine, and plain
    ints are constants."""

    def pos(self, at: Any) -> Any: ...

    def crd(self, at: Any) -> Any: ...

    def add(self, a: Any, b: Any) -> Any: ...

    def mul(self, a: Any, b: Any) -> Any: ...


@dataclass(frozen=True)
class Level(ABC):
    """One storage level; subclasses fix the capabilities of each kind.

    ``unique`` is False exactly when the next level is a ``Singleton``: then a
    coordinate may repeat within a fiber (COO rows), and uniqueness holds only
    for the whole tuple of coordinates down the singleton chain.
    """

    unique: bool = True

    letter: ClassVar[str]
    locatable: ClassVar[bool]
    has_pos: ClassVar[bool]
    has_crd: ClassVar[bool]
    full: ClassVar[bool]
    branchless: ClassVar[bool] = False
    # Every fiber holds the same number of positions, the parent's position times that
    # number onwards: positions affine in the parent's, coordinates stored.
    affine_fibers: ClassVar[bool] = False
    assembly: ClassVar[str]  # "insert" (located) or "append"
    ordered: ClassVar[bool] = True

    @abstractmethod
    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        """Number of positions of this level given its parent's position count."""

    def restored(self) -> Level:
        """The kind this level takes in a copy of its tensor re-stored in another mode
        order: itself, unless its layout depends on its place (a grouped level)."""
        return self

    def locate(self, b: IndexBuilder, parent: Any, coordinate: Any, size: Any) -> Any:
        """The child position of ``coordinate`` under ``parent`` (locatable levels)."""
        raise TypeError(f"{type(self).__name__} levels are not locatable (check Level.locatable first)")

    def position_bounds(self, b: IndexBuilder, parent: Any, segment_end: Any = None) -> tuple[Any, Any]:
        """Positions ``[lo, hi)`` under ``parent``, or under a non-unique parent's
        segment ``[parent, segment_end)``; their coordinates are ``crd[q]``."""
        raise TypeError(f"{type(self).__name__} levels are located, not iterated (check Level.locatable first)")

    @abstractmethod
    def positions(self, b: IndexBuilder, parent_positions: Any, size: Any) -> Any:
        """This level's position count given its parent's (``crd``'s length)."""

    @abstractmethod
    def estimate_positions(self, parent_positions: float, nnz: int, full: float, size: int) -> float:
        """Expected position count: ``full`` is the product of the sizes of this and
        the enclosing levels, ``nnz`` the tensor's stored entries."""

    def index_entries(self, parent_positions: float, positions: float) -> float:
        """Stored index entries (``pos`` and ``crd``) for these position counts."""
        return (parent_positions + 1 if self.has_pos else 0.0) + (positions if self.has_crd else 0.0)


@dataclass(frozen=True)
class Dense(Level):
    """All ``size`` coordinates under every parent: position ``p * size + i``."""

    letter: ClassVar[str] = "d"
    locatable: ClassVar[bool] = True
    has_pos: ClassVar[bool] = False
    has_crd: ClassVar[bool] = False
    full: ClassVar[bool] = True
    assembly: ClassVar[str] = "insert"

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        return parent_positions * size

    def locate(self, b: IndexBuilder, parent: Any, coordinate: Any, size: Any) -> Any:
        return b.add(b.mul(parent, size), coordinate)

    def positions(self, b: IndexBuilder, parent_positions: Any, size: Any) -> Any:
        return b.mul(parent_positions, size)

    def estimate_positions(self, parent_positions: float, nnz: int, full: float, size: int) -> float:
        return parent_positions * size


@dataclass(frozen=True)
class Compressed(Level):
    """Children of ``p`` at ``pos[p] .. pos[p+1] - 1`` with coordinates ``crd[q]``."""

    letter: ClassVar[str] = "c"
    locatable: ClassVar[bool] = False
    has_pos: ClassVar[bool] = True
    has_crd: ClassVar[bool] = True
    full: ClassVar[bool] = False
    assembly: ClassVar[str] = "append"

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        assert pos is not None
        return int(pos[-1])

    def position_bounds(self, b: IndexBuilder, parent: Any, segment_end: Any = None) -> tuple[Any, Any]:
        return b.pos(parent), b.pos(b.add(parent, 1))

    def positions(self, b: IndexBuilder, parent_positions: Any, size: Any) -> Any:
        return b.pos(parent_positions)

    def estimate_positions(self, parent_positions: float, nnz: int, full: float, size: int) -> float:
        return float(min(nnz, full))


@dataclass(frozen=True)
class Singleton(Level):
    """One child per parent, at the parent's position, coordinate ``crd[p]``."""

    letter: ClassVar[str] = "s"
    locatable: ClassVar[bool] = False
    has_pos: ClassVar[bool] = False
    has_crd: ClassVar[bool] = True
    full: ClassVar[bool] = False
    branchless: ClassVar[bool] = True
    assembly: ClassVar[str] = "append"

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        return parent_positions

    def position_bounds(self, b: IndexBuilder, parent: Any, segment_end: Any = None) -> tuple[Any, Any]:
        return parent, (b.add(parent, 1) if segment_end is None else segment_end)

    def positions(self, b: IndexBuilder, parent_positions: Any, size: Any) -> Any:
        return parent_positions

    def estimate_positions(self, parent_positions: float, nnz: int, full: float, size: int) -> float:
        return parent_positions


@dataclass(frozen=True)
class Grouped(Level):
    """Exactly ``count`` children per parent: positions ``[p * count, p * count + count)``
    with coordinates ``crd[q]``, strictly increasing within a parent."""

    count: int = field(kw_only=True)

    letter: ClassVar[str] = "n"
    locatable: ClassVar[bool] = False
    has_pos: ClassVar[bool] = False
    has_crd: ClassVar[bool] = True
    full: ClassVar[bool] = False
    affine_fibers: ClassVar[bool] = True
    assembly: ClassVar[str] = "append"

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"a Grouped level needs an int count >= 1, got {self.count!r}")

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        return parent_positions * self.count

    def restored(self) -> Level:
        """Offsets within a group of the last mode: in another mode order, a compressed level."""
        return Compressed()

    def position_bounds(self, b: IndexBuilder, parent: Any, segment_end: Any = None) -> tuple[Any, Any]:
        return b.mul(parent, self.count), b.add(b.mul(parent, self.count), self.count)

    def positions(self, b: IndexBuilder, parent_positions: Any, size: Any) -> Any:
        return b.mul(parent_positions, self.count)

    def estimate_positions(self, parent_positions: float, nnz: int, full: float, size: int) -> float:
        return parent_positions * self.count


LEVEL_KINDS: dict[str, type[Level]] = {kind.letter: kind for kind in (Dense, Compressed, Singleton, Grouped)}
