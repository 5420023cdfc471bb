"""The two-layer GCN of Kipf & Welling (ICLR 2017) as a LightningModule built from
:class:`sparsenn.SparseGCNConv`, trained full-batch on a Planetoid graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data

import sparsenn
from sparsenn import SparseTensor

__all__ = ["GCN", "accuracy", "feature_dropout"]

# The two layers as one program: relu and the bias run on each row of H as its
# propagation finishes it, and the planner fuses the next layer's product with it
# (HW's row t is computed while H's row t is in cache) when the cost model says so.
_TWO_LAYERS = sparsenn.compile("XW[s,h] = X[s,i] * W1[h,i]; H[t,h] = relu(A1[t,s] * XW[s,h] + b1[h]); "
                               "HW[t,c] = H[t,h] * W2t[h,c]; Z[t,c] = A2[t,s] * HW[s,c] + b2[c]")


class GCN(L.LightningModule):
    r"""Two-layer graph convolutional network for node classification.

    .. math::
        Z = \hat{A}\, \mathrm{drop}\big(\mathrm{ReLU}(\hat{A}\, \mathrm{drop}(X) W_1^\top + b_1)\big) W_2^\top + b_2,
        \qquad \hat{A} = \hat{D}^{-1/2} (A + I) \hat{D}^{-1/2}

    Both propagations run through :class:`sparsenn.SparseGCNConv` (compiled sparse einsums);
    the node features ``X`` may be dense or a :class:`sparsenn.SparseTensor` (bag-of-words),
    and the input dropout is :func:`feature_dropout`, which only draws for the stored features.
    Training minimises the cross-entropy of ``Z`` on ``train_mask`` with Adam; the L2 penalty
    ``weight_decay`` applies to the first layer only, as in the paper. Validation and test
    log the accuracy on ``val_mask`` / ``test_mask``; ``predict`` returns the class of every node.

    Args:
        in_channels: node feature size (1433 for Cora, 3703 for CiteSeer).
        out_channels: number of classes (7 for Cora, 6 for CiteSeer).
        hidden_channels: width of the hidden layer (16 in Kipf & Welling, 128 in Scorch's Table 1).
        dropout: dropout probability on the input and hidden features (0.5).
        lr: Adam learning rate (0.01).
        weight_decay: L2 penalty on the first layer's parameters (5e-4).
        cached: normalise the adjacency once and reuse it (one fixed graph, transductive).
    """

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 16, dropout: float = 0.5,
                 lr: float = 0.01, weight_decay: float = 5e-4, cached: bool = True) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.save_hyperparameters()
        self.conv1 = sparsenn.SparseGCNConv(in_channels, hidden_channels, cached=cached)
        self.conv2 = sparsenn.SparseGCNConv(hidden_channels, out_channels, cached=cached)
        self.dropout, self.lr, self.weight_decay = float(dropout), float(lr), float(weight_decay)

    def forward(self, x: Tensor | SparseTensor, edge_index: Tensor) -> Tensor:
        """Class logits ``Z`` of every node, shape ``(num_nodes, out_channels)``: without
        dropout one program (see :data:`_TWO_LAYERS`), else layer by layer."""
        if not (self.training and self.dropout > 0) and self._one_program(x):
            conv1, conv2 = self.conv1, self.conv2
            nodes = conv1.checked_features(x)
            a1 = conv1.adjacency(edge_index, None, nodes, conv1.weight.dtype)
            a2 = conv2.adjacency(edge_index, None, nodes, conv2.weight.dtype)
            return _TWO_LAYERS(x, conv1.weight, a1, conv1.bias, conv2.weight.t(), a2, conv2.bias)
        x = feature_dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)

    def _one_program(self, x: Tensor | SparseTensor) -> bool:
        """Whether the program computes what the layers do: both with a bias, each
        propagating the narrower dense matrix (``Â (X Wᵀ)``, as the layers choose for
        sparse features or fewer outputs than inputs)."""
        conv1, conv2 = self.conv1, self.conv2
        if conv1.bias is None or conv2.bias is None or conv2.out_channels > conv2.in_channels:
            return False
        return conv1.out_channels <= conv1.in_channels or isinstance(x, SparseTensor)

    def training_step(self, batch: Data, batch_idx: int) -> Tensor:
        logits = self(batch.x, batch.edge_index)
        loss = F.cross_entropy(logits[batch.train_mask], batch.y[batch.train_mask])
        self.log("train_loss", loss, batch_size=1, prog_bar=True)
        return loss

    def validation_step(self, batch: Data, batch_idx: int) -> None:
        self._log_accuracy("val", batch, batch.val_mask)

    def test_step(self, batch: Data, batch_idx: int) -> None:
        self._log_accuracy("test", batch, batch.test_mask)

    def predict_step(self, batch: Data, batch_idx: int) -> Tensor:
        """The predicted class of every node."""
        return self(batch.x, batch.edge_index).argmax(dim=1)

    def _log_accuracy(self, split: str, batch: Data, mask: Tensor) -> None:
        logits = self(batch.x, batch.edge_index)
        self.log(f"{split}_loss", F.cross_entropy(logits[mask], batch.y[mask]), batch_size=1)
        self.log(f"{split}_acc", accuracy(logits, batch.y, mask), batch_size=1, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([
            {"params": self.conv1.parameters(), "weight_decay": self.weight_decay},
            {"params": self.conv2.parameters(), "weight_decay": 0.0},
        ], lr=self.lr)

    # ------------------------------------------------------------------ bench protocol
    def bench_batch(self, datamodule: Any) -> tuple[tuple[Tensor | SparseTensor, Tensor], Tensor]:
        """``((x, edge_index), target)``: the whole graph, and the labels of the test nodes
        (-1 elsewhere)."""
        graph = datamodule.graph
        return (graph.x, graph.edge_index), torch.where(graph.test_mask, graph.y, -1)

    def inference_variants(self) -> dict[str, Callable[..., Tensor]]:
        """sparsenn, then the same weights in torch.sparse (CSR features when ours are sparse),
        dense PyTorch and PyG's ``GCNConv``; every variant normalises the adjacency once, and
        converts the features to the layout it needs once (:func:`models.bench.memoized_conversion`)."""
        from .bench import memoized_conversion
        from .gcn_reference import DenseGCN, PyGGCN, TorchCSRGCN

        dense = memoized_conversion(_dense_features)
        pyg, dense_model, torch_sparse = PyGGCN(self), DenseGCN(self), TorchCSRGCN(self)
        torch_features = memoized_conversion(_torch_features)
        return {
            "sparsenn": self,
            "torch.sparse": lambda x, edge_index: torch_sparse(torch_features(x), edge_index),
            "dense": lambda x, edge_index: dense_model(dense(x), edge_index),
            "PyG GCNConv": lambda x, edge_index: pyg(dense(x), edge_index),
        }

    def bench_metric(self, output: Tensor, target: Tensor) -> tuple[str, float]:
        """Test accuracy: the nodes whose ``target`` is not -1."""
        return "accuracy", float(accuracy(output, target, target >= 0))


def _dense_features(x: Tensor | SparseTensor) -> Tensor:
    return x.to_dense() if isinstance(x, SparseTensor) else x


def _torch_features(x: Tensor | SparseTensor) -> Tensor:
    """Sparse features as a torch CSR tensor, dense ones as they are."""
    return x.to_torch(torch.sparse_csr) if isinstance(x, SparseTensor) else x


def feature_dropout(x: Tensor | SparseTensor, p: float, training: bool = True) -> Tensor | SparseTensor:
    r"""Dropout that draws random numbers for the stored (nonzero) features only.

    .. math:: y_{ij} = x_{ij}\, m_{ij} / (1 - p), \qquad m_{ij} \sim \mathrm{Bernoulli}(1 - p)

    For every entry this has the distribution of :func:`torch.nn.functional.dropout` (a zero stays
    zero whatever its mask), but it costs one draw per stored feature instead of one per entry:
    Planetoid's bag-of-words features are about 1 % nonzero. Kipf & Welling's implementation
    drops out its sparse feature matrix the same way. A :class:`sparsenn.SparseTensor` keeps its
    pattern (dropped features become stored zeros). Identity when not ``training`` or ``p == 0``.
    """
    if not training or p == 0.0:
        return x
    if isinstance(x, SparseTensor):
        return x.with_values(F.dropout(x.values, p=p))
    rows, cols = x.nonzero(as_tuple=True)
    keep = torch.rand(rows.shape[0], device=x.device) >= p
    rows, cols = rows[keep], cols[keep]
    out = torch.zeros_like(x)
    out[rows, cols] = x[rows, cols] / (1.0 - p)
    return out


def accuracy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the nodes in ``mask`` whose arg-max logit is their label."""
    return (logits[mask].argmax(dim=1) == labels[mask]).float().mean()
