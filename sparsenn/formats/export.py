"""Conversion of a SparseTensor to torch and scipy tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparsenn.formats.format import Format, parse_format

if TYPE_CHECKING:
    import scipy.sparse

    from sparsenn.formats.tensor import SparseTensor

_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def compressed_layout(fmt: Format) -> torch.layout | None:
    """The torch layout whose arrays are exactly this format's (csr, csc, bsr, bsc), else None."""
    if fmt.rank != 2 or fmt.letters[:2] != "dc":
        return None
    row_major = fmt.mode_order == (0, 1)
    if fmt.block is None:
        return torch.sparse_csr if row_major else torch.sparse_csc
    return torch.sparse_bsr if row_major else torch.sparse_bsc


def natural_layout(fmt: Format) -> torch.layout:
    """Default torch layout: csr/csc/bsr/bsc as such, dense formats strided, all others COO."""
    layout = compressed_layout(fmt)
    if layout is not None:
        return layout
    return torch.strided if fmt.is_dense else torch.sparse_coo


def to_torch(tensor: SparseTensor, layout: torch.layout | None = None,
             blocksize: tuple[int, int] | None = None) -> Tensor:
    """Convert to a torch tensor of ``layout`` (default ``natural_layout(tensor.format)``).

    Stored entries stay stored (explicit zeros included); a dense-format
    source keeps only its nonzeros in a sparse layout. The compressed
    layouts share this tensor's arrays when its format already matches.
    ``blocksize`` is needed for BSR/BSC unless the tensor is blocked.
    """
    fmt = tensor.format
    layout = natural_layout(fmt) if layout is None else layout
    if layout == torch.strided:
        return tensor.to_dense()
    if layout == torch.sparse_coo:
        if fmt.is_dense:
            return tensor.to_dense().to_sparse()
        sorted_source = fmt.block is None and fmt.mode_order == tuple(range(fmt.rank))
        indices, values = (tensor if sorted_source else tensor.asformat("coo")).coords()
        return torch.sparse_coo_tensor(indices, values, tensor.shape, is_coalesced=True, check_invariants=False)
    if layout not in _COMPRESSED:
        raise ValueError(f"unsupported layout {layout}; expected torch.strided, sparse_coo, "
                         f"sparse_csr, sparse_csc, sparse_bsr or sparse_bsc")
    if tensor.ndim != 2:
        raise ValueError(f"layout {layout} needs a rank-2 tensor, got shape {tensor.shape}")
    name = {torch.sparse_csr: "csr", torch.sparse_csc: "csc",
            torch.sparse_bsr: "bsr", torch.sparse_bsc: "bsc"}[layout]
    block = None
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        block = tuple(blocksize) if blocksize is not None else fmt.block
        if block is None:
            raise ValueError(f"layout {layout} needs blocksize=(bh, bw) for a tensor in format {fmt}")
        name += f"({block[0]},{block[1]})"
    source = tensor.asformat(name)
    values = source.values if block is None else source.values.view(-1, *block)
    return torch.sparse_compressed_tensor(source.pos[1], source.crd[1], values, size=tensor.shape,
                                          layout=layout, check_invariants=False)


def to_scipy(tensor: SparseTensor) -> scipy.sparse.sparray:
    """Convert a rank-2 tensor to a scipy sparse array (arrays are copied).

    csr, csc, coo and bsr(bh,bw) map to ``csr_array``, ``csc_array``,
    ``coo_array`` and ``bsr_array``; every other format becomes ``csr_array``.
    """
    import scipy.sparse as sp

    if tensor.ndim != 2:
        raise ValueError(f"to_scipy needs a rank-2 tensor, got shape {tensor.shape}")
    fmt = tensor.format
    layout = compressed_layout(fmt)
    if fmt == parse_format("coo", 2):
        indices, values = tensor.coords()
        row, col = indices.numpy()
        return sp.coo_array((_numpy(values), (row, col)), shape=tensor.shape)
    if layout not in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr):
        tensor, layout = tensor.asformat("csr"), torch.sparse_csr
    data = _numpy(tensor.values)
    indptr, indices = _numpy(tensor.pos[1]), _numpy(tensor.crd[1])
    if layout == torch.sparse_bsr:
        return sp.bsr_array((data.reshape(-1, *fmt.block), indices, indptr), shape=tensor.shape)
    array_type = sp.csr_array if layout == torch.sparse_csr else sp.csc_array
    return array_type((data, indices, indptr), shape=tensor.shape)


def _numpy(t: Tensor):
    """A NumPy copy of ``t`` (detached from autograd)."""
    return t.detach().numpy().copy()
