"""Reference models run by the ``sparsenn`` command (see ``configs/``): each a LightningModule
with a LightningDataModule, and the inference benchmark they share (``models.bench``).

The names below are imported from their modules on first use (PEP 562), so that importing
one model (or ``models.bench``) does not import the others' dependencies (PyG for the GCN).
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "SparseAutoencoder": "autoencoder",
    "GCN": "gcn",
    "accuracy": "gcn",
    "feature_dropout": "gcn",
    "DenseGCN": "gcn_reference",
    "PyGGCN": "gcn_reference",
    "TorchCSRGCN": "gcn_reference",
    "normalized_adjacency_csr": "gcn_reference",
    "MNIST_ROOT": "mnist",
    "MNISTDataModule": "mnist",
    "read_idx": "mnist",
    "PLANETOID_NAMES": "planetoid",
    "PLANETOID_ROOT": "planetoid",
    "PlanetoidDataModule": "planetoid",
    "load_planetoid": "planetoid",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
