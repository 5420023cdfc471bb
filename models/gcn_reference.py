"""The same two-layer GCN for inference, computed by other libraries from a trained
:class:`models.gcn.GCN`'s weights: PyG's ``GCNConv``, plain ``torch.sparse`` CSR products
and dense PyTorch. Used to check sparsenn's outputs and to benchmark against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GCNConv

from .gcn import GCN

__all__ = ["PyGGCN", "TorchCSRGCN", "DenseGCN", "normalized_adjacency_csr"]


class PyGGCN(nn.Module):
    """``conv2(relu(conv1(x)))`` with :class:`torch_geometric.nn.GCNConv` layers (inference only)."""

    def __init__(self, trained: GCN) -> None:
        super().__init__()
        convs = []
        for layer in (trained.conv1, trained.conv2):
            conv = GCNConv(layer.in_channels, layer.out_channels, improved=layer.improved, cached=layer.cached,
                           add_self_loops=layer.add_self_loops, normalize=layer.normalize,
                           bias=layer.bias is not None)
            with torch.no_grad():
                conv.lin.weight.copy_(layer.weight)
                if layer.bias is not None:
                    conv.bias.copy_(layer.bias)
            convs.append(conv)
        self.conv1, self.conv2 = convs
        self.eval()

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def normalized_adjacency_csr(edge_index: Tensor, num_nodes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    r"""``Â = D̂^{-1/2} (A + I) D̂^{-1/2}`` as a ``torch.sparse_csr`` matrix indexed ``[target, source]``.

    ``A`` has a 1 for every edge ``(source, target)`` of ``edge_index``; existing self-loops
    are replaced by the added ones and ``D̂`` is the in-degree of ``A + I``.
    """
    source, target = edge_index
    keep = source != target
    nodes = torch.arange(num_nodes, dtype=edge_index.dtype)
    source, target = torch.cat([source[keep], nodes]), torch.cat([target[keep], nodes])
    degree = torch.zeros(num_nodes, dtype=dtype).index_add_(0, target, torch.ones(target.shape[0], dtype=dtype))
    inv_sqrt = degree.rsqrt()
    coo = torch.sparse_coo_tensor(torch.stack([target, source]), inv_sqrt[source] * inv_sqrt[target],
                                  (num_nodes, num_nodes), check_invariants=False)  # valid by construction
    return coo.coalesce().to_sparse_csr()


def _frozen_weights(trained: GCN) -> list[Tensor]:
    """``[W_1, b_1, W_2, b_2]`` of a GCN with the default normalisation and biases, detached
    contiguous copies (``nn.Linear``'s layout, whatever the layers' own)."""
    for layer in (trained.conv1, trained.conv2):
        if layer.improved or not layer.normalize or not layer.add_self_loops or layer.bias is None:
            raise ValueError(f"only GCN layers with the default normalisation and a bias are supported, got {layer}")
    return [t.detach().clone(memory_format=torch.contiguous_format) for t in (trained.conv1.weight, trained.conv1.bias,
                                         trained.conv2.weight, trained.conv2.bias)]


class _FrozenGCN(nn.Module):
    """A trained GCN's weights, detached, and its normalised adjacency: built per call, or
    once when the trained model used ``cached=True``; :meth:`_layout` gives its storage."""

    def __init__(self, trained: GCN) -> None:
        super().__init__()
        self.weight1, self.bias1, self.weight2, self.bias2 = _frozen_weights(trained)
        self.cached = trained.conv1.cached
        self._adjacency: Tensor | None = None

    def _layout(self, adjacency: Tensor) -> Tensor:
        return adjacency

    def adjacency(self, edge_index: Tensor, num_nodes: int, dtype: torch.dtype) -> Tensor:
        adjacency = self._adjacency
        if adjacency is None:
            adjacency = self._layout(normalized_adjacency_csr(edge_index, num_nodes, dtype))
            if self.cached:
                self._adjacency = adjacency
        return adjacency


class TorchCSRGCN(_FrozenGCN):
    r"""The same GCN written directly with ``torch.sparse.mm`` on a CSR ``Â`` (inference only):
    ``Â relu(Â X W_1ᵀ + b_1) W_2ᵀ + b_2``, where ``X W_1ᵀ`` is ``torch.sparse.mm`` too when the
    features ``X`` are a torch sparse CSR tensor. The adjacency is built on each call, or once when
    the trained model used ``cached=True``. Only unweighted graphs with self-loops added and
    symmetric normalisation (the GCN defaults) are supported.
    """

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        adjacency = self.adjacency(edge_index, x.shape[0], x.dtype)
        projected = torch.sparse.mm(x, self.weight1.T) if x.layout == torch.sparse_csr else x @ self.weight1.T
        hidden = F.relu(torch.sparse.mm(adjacency, projected) + self.bias1)
        return torch.sparse.mm(adjacency, hidden @ self.weight2.T) + self.bias2


class DenseGCN(_FrozenGCN):
    r"""The same GCN in dense PyTorch (inference only): ``Â relu(Â X W_1ᵀ + b_1) W_2ᵀ + b_2``
    with ``Â`` a dense ``(N, N)`` matrix (built on each call, or once when the trained model
    used ``cached=True``) and dense features."""

    def _layout(self, adjacency: Tensor) -> Tensor:
        return adjacency.to_dense()

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        adjacency = self.adjacency(edge_index, x.shape[0], x.dtype)
        hidden = F.relu(torch.addmm(self.bias1, adjacency, x @ self.weight1.T))
        return torch.addmm(self.bias2, adjacency, hidden @ self.weight2.T)
