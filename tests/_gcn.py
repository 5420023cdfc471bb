"""Helpers of the tests comparing SparseGCNConv with PyG's GCNConv."""

import torch
from torch_geometric.nn import GCNConv

from sparsenn import SparseGCNConv


def pair(in_channels, out_channels, seed=0, **kwargs):
    """A PyG GCNConv and a SparseGCNConv with the same weights (random bias)."""
    torch.manual_seed(seed)
    ref = GCNConv(in_channels, out_channels, **kwargs)
    mine = SparseGCNConv(in_channels, out_channels, **kwargs)
    with torch.no_grad():
        if ref.bias is not None:
            ref.bias.normal_()
            mine.bias.copy_(ref.bias)
        mine.weight.copy_(ref.lin.weight)
    return ref, mine


def assert_close_scaled(actual, expected, rtol=1e-5):
    """Equal to ``rtol`` relative to the largest magnitude of ``expected``."""
    scale = float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30))
