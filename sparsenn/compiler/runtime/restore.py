"""Sparse operands re-stored in the mode order a schedule reads them in (a transpose).

Patterns are usually fixed while values change (weights, graphs), so the re-stored index
arrays and the permutation of the values are cached per pattern: later calls only
gather the values.
"""

from __future__ import annotations

import torch

from sparsenn.formats import Format, SparseTensor
from sparsenn.formats.tensor import array_version

from .cache import LRUCache

__all__ = ["restored_as"]

# (source index arrays' addresses, shape, format, target format) ->
# (their versions, the re-stored pattern, value permutation, padded, the source arrays)
_restored: LRUCache[tuple] = LRUCache("re-stored patterns", 16)


def restored_as(op: SparseTensor, fmt: Format) -> SparseTensor:
    """``op`` stored in ``fmt``. The cache keeps the source index arrays alive, so their
    addresses identify them, and checks their version counters."""
    arrays = tuple(a for a in op.pos + op.crd if a is not None)
    key = (tuple(a.data_ptr() for a in arrays), op.shape, op.format, fmt)
    versions = tuple(array_version(a) for a in arrays)
    hit = _restored.get(key)
    if hit is None or hit[0] != versions:
        # Number the stored values from 1: a dense level below a sparse one in ``fmt``
        # stores explicit zeros where ``op`` has no entry, and those must gather 0.
        numbered = op.with_values(torch.arange(1, op.values.shape[0] + 1, dtype=torch.float64))
        moved = numbered.asformat(fmt)
        permutation = moved.values.to(torch.int64)
        padded = bool((permutation == 0).any())  # else a pure permutation: gather from values
        hit = (versions, moved, permutation if padded else permutation - 1, padded, arrays)
        _restored.put(key, hit)
    _, moved, permutation, padded, _ = hit
    values = op.values.detach()
    if padded:
        values = torch.cat([values.new_zeros(1), values])
    return moved.with_values(torch.index_select(values, 0, permutation))
