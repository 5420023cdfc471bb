"""Sparse tensor storage: level kinds, formats and SparseTensor.

Importing it registers the classes a saved SparseTensor is rebuilt from as safe globals
(``torch.serialization.add_safe_globals``), so ``torch.load(path, weights_only=True)`` loads
one; the rebuild runs the validating constructor.
"""

import torch

from sparsenn.formats.format import Format, parse_format
from sparsenn.formats.indexing import cat, stack
from sparsenn.formats.level import Compressed, Dense, Grouped, Level, Singleton
from sparsenn.formats.tensor import (
    SparseTensor,
    from_coo,
    from_dense,
    from_edge_index,
    from_scipy,
    from_torch,
)
from sparsenn.formats.validate import VALUE_DTYPES

torch.serialization.add_safe_globals([SparseTensor, Format, Dense, Compressed, Singleton, Grouped])

__all__ = [
    "Compressed",
    "Dense",
    "Format",
    "Grouped",
    "Level",
    "Singleton",
    "SparseTensor",
    "VALUE_DTYPES",
    "cat",
    "from_coo",
    "from_dense",
    "from_edge_index",
    "from_scipy",
    "from_torch",
    "parse_format",
    "stack",
]
