"""Reference models run by the ``sparsenn`` command (see ``configs/``): each a LightningModule
with a LightningDataModule, and the inference benchmark they share (``models.bench``)."""

from .autoencoder import SparseAutoencoder
from .gcn import GCN, accuracy, feature_dropout
from .gcn_reference import DenseGCN, PyGGCN, TorchCSRGCN, normalized_adjacency_csr
from .mnist import MNIST_ROOT, MNISTDataModule, read_idx
from .planetoid import PLANETOID_NAMES, PLANETOID_ROOT, PlanetoidDataModule, load_planetoid

__all__ = [
    "GCN",
    "accuracy",
    "feature_dropout",
    "PyGGCN",
    "TorchCSRGCN",
    "DenseGCN",
    "normalized_adjacency_csr",
    "PlanetoidDataModule",
    "load_planetoid",
    "PLANETOID_ROOT",
    "PLANETOID_NAMES",
    "SparseAutoencoder",
    "MNISTDataModule",
    "MNIST_ROOT",
    "read_idx",
]
