"""Planetoid citation graphs (Cora, CiteSeer) read from local raw files, full-batch.

The raw ``ind.<name>.*`` files of Yang et al. (2016) ship in ``models/data/planetoid/<Name>/raw``.
PyG's :class:`~torch_geometric.datasets.Planetoid` writes a ``processed/`` folder next to
``raw/``, so the raw files are copied into a temporary directory, processed there, and the
temporary directory is removed: nothing is written into the repository and nothing is fetched
from the network.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import lightning as L
import torch_geometric.transforms as T
from torch.utils.data import DataLoader
from torch_geometric.data import Data
from torch_geometric.datasets import Planetoid

import sparsenn

__all__ = ["PLANETOID_ROOT", "PLANETOID_NAMES", "load_planetoid", "PlanetoidDataModule"]

PLANETOID_ROOT = Path(__file__).resolve().parent / "data" / "planetoid"
"""Folder holding ``<Name>/raw/ind.<name>.*`` for the shipped datasets."""

PLANETOID_NAMES = ("Cora", "CiteSeer")
"""The Planetoid datasets whose raw files ship with the repository."""

_RAW_SUFFIXES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def load_planetoid(name: str, root: str | Path | None = None, normalize_features: bool = True) -> Data:
    """One Planetoid graph with the standard public split (Kipf & Welling; Yang et al.).

    ``root`` holds ``<name>/raw/ind.<name lowercase>.*`` (default: the files shipped in
    ``models/data/planetoid``). With ``normalize_features`` each node's feature row is
    divided by its sum (PyG's ``NormalizeFeatures``), as in the GCN paper. The returned
    :class:`~torch_geometric.data.Data` has ``x``, ``edge_index`` (both directions of every
    citation), ``y`` and boolean ``train_mask`` / ``val_mask`` / ``test_mask``.
    """
    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a str, got {type(name).__name__}")
    raw_root = PLANETOID_ROOT if root is None else Path(root)
    raw_dir = raw_root / name / "raw"
    missing = [f"ind.{name.lower()}.{suffix}" for suffix in _RAW_SUFFIXES
               if not (raw_dir / f"ind.{name.lower()}.{suffix}").is_file()]
    if missing:
        shipped = f" (shipped here: {', '.join(PLANETOID_NAMES)})" if root is None else ""
        raise FileNotFoundError(
            f"Planetoid dataset {name!r}: raw files missing in {raw_dir}: {', '.join(missing)}{shipped}. "
            f"Obtain them from https://github.com/kimiyoung/planetoid/tree/master/data (folder data/) and put them "
            f"in {raw_dir}, or set the data module's root to the folder holding {name}/raw/")
    transform = T.NormalizeFeatures() if normalize_features else None
    with tempfile.TemporaryDirectory(prefix="sparsenn-planetoid-") as workdir:
        shutil.copytree(raw_dir, Path(workdir) / name / "raw")
        dataset = Planetoid(root=workdir, name=name, split="public", transform=transform)
        return dataset[0]


def _single_graph(batch: Data) -> Data:
    """Collate for ``batch_size=None``: the graph itself is the batch (full-batch training)."""
    return batch


class PlanetoidDataModule(L.LightningDataModule):
    """Full-batch Lightning data for a Planetoid graph: every loader yields the one graph.

    Training, validation and testing see the same graph and differ only in which mask the
    model reads (``train_mask``, ``val_mask``, ``test_mask``).

    Args:
        name: ``"Cora"`` or ``"CiteSeer"`` (shipped), or another Planetoid graph under ``root``.
        root: folder holding ``<name>/raw/ind.<name>.*`` (default: the shipped files).
        normalize_features: divide each node's features by their sum.
        sparse_features: serve the node features ``x`` as a CSR :class:`sparsenn.SparseTensor`
            (bag-of-words: 1.3 % of Cora's entries are nonzero) instead of a dense tensor.
    """

    def __init__(self, name: str = "Cora", root: str | None = None, normalize_features: bool = True,
                 sparse_features: bool = True) -> None:
        super().__init__()
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        self.save_hyperparameters()
        self.name, self.root = name, root
        self.normalize_features, self.sparse_features = bool(normalize_features), bool(sparse_features)
        self._data: Data | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the graph once (later stages reuse it)."""
        self._load()

    @property
    def graph(self) -> Data:
        """The graph: ``x`` (a SparseTensor when ``sparse_features``), ``edge_index``, ``y`` and the masks."""
        return self._load()

    def _load(self) -> Data:
        if self._data is None:
            data = load_planetoid(self.name, self.root, self.normalize_features)
            if self.sparse_features:
                data.x = sparsenn.from_dense(data.x, format="csr")
            self._data = data
        return self._data

    @property
    def num_features(self) -> int:
        return int(self.graph.x.shape[1])

    @property
    def num_classes(self) -> int:
        return int(self.graph.y.max()) + 1

    def _loader(self) -> DataLoader:
        return DataLoader([self.graph], batch_size=None, collate_fn=_single_graph)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()
