"""Constructors of SparseTensor from dense tensors, torch, scipy, PyG and COO data.

They never mutate their inputs: sorting, coalescing and summing duplicates
work on copies. ``index_dtype=None`` picks int32 when every size fits, else int64.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

import torch
from torch import Tensor

from sparsenn.formats.format import Format, parse_format
from sparsenn.formats.pack import Duplicates, pack
from sparsenn.formats.validate import (
    VALUE_DTYPE_NAMES,
    VALUE_DTYPES,
    check_arrays,
    check_levels,
    choose_index_dtype,
    same_fiber,
)

if TYPE_CHECKING:
    import scipy.sparse

_COMPRESSED_LAYOUTS = {
    torch.sparse_csr: "csr",
    torch.sparse_csc: "csc",
    torch.sparse_bsr: "bsr",
    torch.sparse_bsc: "bsc",
}


def _check_float(name: str, t: object) -> Tensor:
    """Check a strided CPU tensor of a value dtype (``VALUE_DTYPES``)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a strided tensor, got layout {t.layout} (use from_torch)")
    if t.dtype not in VALUE_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; SparseTensor values must be {VALUE_DTYPE_NAMES}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device {t.device}; SparseTensor supports the CPU only")
    return t


def _check_index_tensor(name: str, indices: object, rank: int) -> Tensor:
    """Check a ``(rank, nnz)`` integer CPU tensor; return it as int64."""
    if not isinstance(indices, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {indices.dtype}")
    if indices.device.type != "cpu" or indices.layout != torch.strided:
        raise ValueError(f"{name} must be a strided CPU tensor, got {indices.layout} on {indices.device}")
    if indices.dim() != 2 or indices.shape[0] != rank:
        raise ValueError(f"{name} must have shape ({rank}, nnz), got {tuple(indices.shape)}")
    return indices.long()


def _check_range(name: str, indices: Tensor, shape: tuple[int, ...]) -> None:
    """Check ``0 <= indices[m] < shape[m]`` for every mode ``m``."""
    for mode, size in enumerate(shape):
        outside = (indices[mode] < 0) | (indices[mode] >= size)
        if bool(outside.any()):
            entry = int(torch.nonzero(outside)[0])
            raise ValueError(f"{name}[{mode}] has value {int(indices[mode, entry])} out of range "
                             f"[0, {size}) for dimension {mode} at entry {entry}")


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (TypeError/ValueError naming it otherwise)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence | torch.Size):
        raise TypeError(f"shape must be a sequence of ints, got {type(shape).__name__}")
    checked = []
    for mode, n in enumerate(shape):
        try:
            checked.append(operator.index(n))
        except TypeError:
            raise TypeError(f"shape must be a sequence of ints, got {n!r} for dimension {mode}") from None
    shape = tuple(checked)
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    return shape


def _largest_per_group(t: Tensor, n: int, m: int) -> Tensor:
    """Mask of the ``n`` largest ``|t|`` of every ``m`` consecutive entries along the
    last dimension, ties broken towards the lower offset (a stable descending sort)."""
    groups = t.detach().abs().reshape(*t.shape[:-1], t.shape[-1] // m, m)
    largest = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :n]
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, largest, True).reshape(t.shape)


class Constructors:
    """Class-method constructors of SparseTensor (also exported as module functions)."""

    @classmethod
    def from_dense(cls, t: Tensor, format: str | Format = "csr",
                   index_dtype: torch.dtype | None = None) -> Self:
        """Store the nonzeros of the strided tensor ``t`` in ``format``.

        Dense levels below a sparse one (e.g. BSR blocks) store every element
        under a stored position, zeros included; an all-dense format stores
        everything. Values are gathered from ``t`` (differentiable, a copy).

        ``nm(n,m)`` is lossy: of every ``m`` consecutive entries along the last
        dimension it keeps the ``n`` largest in magnitude (ties: lower offset
        first) and drops the rest; a group with fewer than ``n`` nonzeros stores
        explicit zeros at its smallest unused offsets.
        """
        t = _check_float("t", t)
        fmt = parse_format(format, t.dim())
        shape = tuple(t.shape)
        none = (None,) * len(fmt.levels)
        if fmt.is_dense:
            values = t.permute(fmt.mode_order).clone(memory_format=torch.contiguous_format).view(-1)
            return cls(shape, fmt, none, none, values, check=False, index_dtype=index_dtype)
        mask = t != 0
        if fmt.nm is not None:
            fmt.storage_levels(shape)  # the last dimension must be divisible by m
            mask &= _largest_per_group(t, *fmt.nm)
        packed = pack(fmt, shape, torch.nonzero(mask).T, t[mask], index_dtype=index_dtype)
        tensor = cls(shape, fmt, packed.pos, packed.crd, packed.values, check=False,
                     index_dtype=packed.index_dtype)
        if tensor.nnz == int(mask.sum()):
            return tensor
        indices, _ = tensor.coords()
        return tensor.with_values(t[tuple(indices)])

    @classmethod
    def from_coo(cls, indices: Tensor, values: Tensor, shape: Sequence[int], format: str | Format = "coo",
                 duplicates: Duplicates = "sum", index_dtype: torch.dtype | None = None) -> Self:
        """Build from coordinates ``indices`` ``(rank, nnz)`` and ``values`` ``(nnz,)``.

        Entries may come in any order. Repeated coordinates are summed
        (``duplicates="sum"``) or rejected (``duplicates="error"``).
        """
        shape = _check_shape(shape)
        fmt = parse_format(format, len(shape))
        indices = _check_index_tensor("indices", indices, len(shape))
        _check_range("indices", indices, shape)
        values = _check_float("values", values)
        if values.dim() != 1 or values.shape[0] != indices.shape[1]:
            raise ValueError(f"values must have shape ({indices.shape[1]},) to match indices, "
                             f"got {tuple(values.shape)}")
        if duplicates not in ("sum", "error"):
            raise ValueError(f"duplicates must be 'sum' or 'error', got {duplicates!r}")
        packed = pack(fmt, shape, indices, values, duplicates, index_dtype)
        return cls(shape, fmt, packed.pos, packed.crd, packed.values, check=False,
                   index_dtype=packed.index_dtype)

    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int | None = None, values: Tensor | None = None,
                        format: str | Format = "csr", index_dtype: torch.dtype | None = None) -> Self:
        """Adjacency matrix of a PyG graph: ``A[src, dst] = value`` for each edge.

        ``edge_index[0]`` holds sources (rows) and ``edge_index[1]`` targets
        (columns). ``values`` default to float32 ones; duplicate edges are
        summed; ``num_nodes`` defaults to ``edge_index.max() + 1``.
        """
        edge_index = _check_index_tensor("edge_index", edge_index, 2)
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        num_nodes = operator.index(num_nodes)
        _check_range("edge_index", edge_index, (num_nodes, num_nodes))
        if values is None:
            values = torch.ones(edge_index.shape[1], dtype=torch.float32)
        return cls.from_coo(edge_index, values, (num_nodes, num_nodes), format, "sum", index_dtype)

    @classmethod
    def from_torch(cls, t: Tensor, format: str | Format | None = None,
                   index_dtype: torch.dtype | None = None) -> Self:
        """Build from a torch tensor of layout COO, CSR, CSC, BSR, BSC or strided.

        ``format=None`` keeps the natural format (``coo``, ``csr``, ``csc``,
        ``bsr(bh,bw)``, ``bsc(bh,bw)``, ``dense``); otherwise converts. An
        uncoalesced COO tensor is coalesced on a copy. Compressed layouts share
        ``values`` (and the index arrays when their dtype matches) with ``t``.
        """
        if not isinstance(t, Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        if t.layout == torch.strided:
            return cls.from_dense(t, "dense" if format is None else format, index_dtype)
        if t.device.type != "cpu":
            raise ValueError(f"t is on device {t.device}; SparseTensor supports the CPU only")
        if t.dense_dim():
            raise ValueError(f"hybrid sparse tensors (dense_dim={t.dense_dim()}) are not supported")
        if t.layout == torch.sparse_coo:
            t = t if t.is_coalesced() else t.coalesce()
            return cls.from_coo(t.indices(), t.values(), t.shape, "coo" if format is None else format,
                                index_dtype=index_dtype)
        if t.layout not in _COMPRESSED_LAYOUTS:
            raise TypeError(f"unsupported torch layout {t.layout}")
        if t.dim() != 2:
            raise ValueError(f"batched {t.layout} tensors are not supported (shape {tuple(t.shape)})")
        name = _COMPRESSED_LAYOUTS[t.layout]
        if t.layout in (torch.sparse_csr, torch.sparse_bsr):
            compressed, plain = t.crow_indices(), t.col_indices()
        else:
            compressed, plain = t.ccol_indices(), t.row_indices()
        values = t.values()
        if values.dim() == 3:
            name += f"({values.shape[1]},{values.shape[2]})"
        shape = tuple(t.shape)
        values = values.reshape(-1)
        dtype = choose_index_dtype((*shape, values.numel()), index_dtype)
        tensor = cls._from_compressed(shape, parse_format(name, 2), compressed.to(dtype), plain.to(dtype), values)
        return tensor if format is None else tensor.asformat(format, index_dtype)

    @classmethod
    def from_scipy(cls, m: scipy.sparse.sparray | scipy.sparse.spmatrix, format: str | Format | None = None,
                   index_dtype: torch.dtype | None = None) -> Self:
        """Build from any scipy sparse array or matrix (arrays are copied).

        Duplicates are summed and indices sorted (on a copy). ``format=None``
        keeps csr, csc, coo and bsr(bh,bw); other scipy formats become csr.
        """
        import numpy as np
        import scipy.sparse as sp

        if not sp.issparse(m):
            raise TypeError(f"m must be a scipy sparse array or matrix, got {type(m).__name__}")
        if m.format not in ("csr", "csc", "bsr", "coo") or (m.format != "coo" and m.ndim != 2):
            m = m.tocsr() if m.ndim == 2 else m.tocoo()
        shape = tuple(m.shape)
        if m.format == "coo":
            indices = torch.from_numpy(np.stack(m.coords).astype(np.int64, copy=False).reshape(len(shape), -1))
            values = torch.tensor(m.data)
            return cls.from_coo(indices, values, shape, "coo" if format is None else format,
                                index_dtype=index_dtype)
        if not m.has_canonical_format:
            m = m.copy()
            m.sum_duplicates()
        name = m.format if m.format != "bsr" else f"bsr({m.blocksize[0]},{m.blocksize[1]})"
        values = torch.tensor(m.data).reshape(-1)
        dtype = choose_index_dtype((*shape, values.numel()), index_dtype)
        tensor = cls._from_compressed(shape, parse_format(name, 2), torch.tensor(m.indptr, dtype=dtype),
                                      torch.tensor(m.indices, dtype=dtype), values)
        return tensor if format is None else tensor.asformat(format, index_dtype)

    @classmethod
    def _from_compressed(cls, shape: tuple[int, ...], fmt: Format, compressed: Tensor, plain: Tensor,
                         values: Tensor) -> Self:
        """Build csr/csc/bsr/bsc from compressed and plain index arrays (level 1 of ``fmt``).

        Canonical input (sorted, unique within each fiber) is used as is;
        otherwise entries are re-sorted and duplicates summed.
        """
        none = (None,) * len(fmt.levels)
        pos = none[:1] + (compressed,) + none[2:]
        crd = none[:1] + (plain,) + none[2:]
        canonical = not bool((same_fiber(compressed, len(plain)) & (plain[1:] <= plain[:-1])).any())
        if canonical:
            return cls(shape, fmt, pos, crd, values)
        check_arrays(fmt, pos, crd, values)
        check_levels(fmt, tuple(size for _, size, _ in fmt.storage_levels(shape)), pos, crd, values)
        indices, _ = cls(shape, fmt, pos, crd, values, check=False).coords()
        return cls.from_coo(indices, values, shape, fmt, index_dtype=compressed.dtype)
