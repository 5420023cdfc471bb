"""Sparse tensor storage: level kinds, formats and SparseTensor."""

from sparsenn.formats.format import Format, parse_format
from sparsenn.formats.level import Compressed, Dense, Grouped, Level, Singleton
from sparsenn.formats.tensor import (
    SparseTensor,
    from_coo,
    from_dense,
    from_edge_index,
    from_scipy,
    from_torch,
)

__all__ = [
    "Compressed",
    "Dense",
    "Format",
    "Grouped",
    "Level",
    "Singleton",
    "SparseTensor",
    "from_coo",
    "from_dense",
    "from_edge_index",
    "from_scipy",
    "from_torch",
    "parse_format",
]
