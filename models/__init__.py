"""Reference models trained and benchmarked by the ``sparsenn`` command (see ``configs/``)."""

from .gcn import GCN, accuracy, feature_dropout
from .gcn_reference import PyGGCN, TorchCSRGCN, normalized_adjacency_csr
from .planetoid import PLANETOID_NAMES, PLANETOID_ROOT, PlanetoidDataModule, load_planetoid

__all__ = [
    "GCN",
    "accuracy",
    "feature_dropout",
    "PyGGCN",
    "TorchCSRGCN",
    "normalized_adjacency_csr",
    "PlanetoidDataModule",
    "load_planetoid",
    "PLANETOID_ROOT",
    "PLANETOID_NAMES",
]
