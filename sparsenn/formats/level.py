"""Level kinds: how one storage level of a sparse tensor is laid out.

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

Code that iterates, locates or assembles levels asks these capabilities and
never tests for a named format such as "CSR".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor


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
    ordered: ClassVar[bool] = True

    @abstractmethod
    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        """Number of positions of this level given its parent's position count."""


@dataclass(frozen=True)
class Dense(Level):
    """All ``size`` coordinates under every parent: position ``p * size + i``."""

    letter: ClassVar[str] = "d"
    locatable: ClassVar[bool] = True
    has_pos: ClassVar[bool] = False
    has_crd: ClassVar[bool] = False
    full: ClassVar[bool] = True

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        return parent_positions * size


@dataclass(frozen=True)
class Compressed(Level):
    """Children of ``p`` at ``pos[p] .. pos[p+1] - 1`` with coordinates ``crd[q]``."""

    letter: ClassVar[str] = "c"
    locatable: ClassVar[bool] = False
    has_pos: ClassVar[bool] = True
    has_crd: ClassVar[bool] = True
    full: ClassVar[bool] = False

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        assert pos is not None
        return int(pos[-1])


@dataclass(frozen=True)
class Singleton(Level):
    """One child per parent, at the parent's position, coordinate ``crd[p]``."""

    letter: ClassVar[str] = "s"
    locatable: ClassVar[bool] = False
    has_pos: ClassVar[bool] = False
    has_crd: ClassVar[bool] = True
    full: ClassVar[bool] = False

    def num_positions(self, parent_positions: int, size: int, pos: Tensor | None) -> int:
        return parent_positions


LEVEL_KINDS: dict[str, type[Level]] = {kind.letter: kind for kind in (Dense, Compressed, Singleton)}
