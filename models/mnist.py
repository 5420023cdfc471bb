"""MNIST from its idx files (parsed here, no torchvision), as a LightningDataModule.

The four original gzipped files ship in ``models/data/mnist`` (see its SOURCES.md).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

__all__ = ["MNIST_ROOT", "MNIST_FILES", "read_idx", "MNISTDataModule"]

MNIST_ROOT = Path(__file__).resolve().parent / "data" / "mnist"
"""Folder holding the shipped MNIST files."""

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
"""idx type codes -> big-endian numpy dtypes (LeCun's format description)."""


def read_idx(path: str | Path) -> Tensor:
    """The array stored in an idx file (gzipped when its name ends in ``.gz``).

    Layout: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), the number of dimensions ``d``, ``d`` big-endian uint32
    sizes, then the values in row-major order, big-endian. ValueError names the file and
    what is wrong with it.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            raw = stream.read()
    except (OSError, EOFError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read it as an idx file{' (gzip)' if opener is gzip.open else ''}: "
                         f"{exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (magic bytes {raw[:4].hex() or 'missing'}; expected "
                         "00 00 <type code> <dimensions>)")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes, {ndim} dimension sizes expected)")
    shape = tuple(int(n) for n in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, but an idx file of shape {shape} and type {dtype.str} has "
                         f"{expected}")
    values = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(values.astype(dtype.newbyteorder("="), copy=True))


class MNISTDataModule(L.LightningDataModule):
    """MNIST images as ``(batch, 784)`` float32 pixels in [0, 1] with their labels.

    Args:
        data_dir: folder with the four idx files (default: the copies shipped in
            ``models/data/mnist``); each may be gzipped (``.gz``) or not.
        batch_size: images per batch of every loader (64 in the Scorch paper).
        val_size: training images held out for validation (a fixed random split).
        seed: seed of that split.

    Batches are ``(images, labels)``; training batches are shuffled.
    """

    def __init__(self, data_dir: str | None = None, batch_size: int = 64, val_size: int = 5000,
                 seed: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if val_size < 1:
            raise ValueError(f"val_size must be >= 1 (training images held out for validation), got {val_size}")
        self.save_hyperparameters()
        self.data_dir = MNIST_ROOT if data_dir is None else Path(data_dir)
        self.batch_size, self.val_size, self.seed = int(batch_size), int(val_size), int(seed)
        self._splits: dict[str, Dataset] = {}

    def _file(self, key: str) -> Path:
        name = MNIST_FILES[key]
        for candidate in (self.data_dir / name, self.data_dir / name.removesuffix(".gz")):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(
            f"MNIST file {self.data_dir / name} not found (nor uncompressed). Copies ship in {MNIST_ROOT}; "
            f"otherwise download {', '.join(MNIST_FILES.values())} from http://yann.lecun.com/exdb/mnist/ "
            "(or a mirror such as https://ossci-datasets.s3.amazonaws.com/mnist/) into that folder, or set the "
            "data module's data_dir")

    def _load(self, split: str) -> TensorDataset:
        images = read_idx(self._file(f"{split}_images"))
        labels = read_idx(self._file(f"{split}_labels"))
        if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"MNIST {split} files in {self.data_dir} do not match: images {tuple(images.shape)}, "
                             f"labels {tuple(labels.shape)} (expected (n, rows, cols) and (n,))")
        pixels = images.reshape(images.shape[0], -1).to(torch.float32) / 255.0
        return TensorDataset(pixels, labels.long())

    def setup(self, stage: str | None = None) -> None:
        """Read the files needed by ``stage`` (all when None) once."""
        if stage in (None, "fit", "validate") and "train" not in self._splits:
            full = self._load("train")
            if self.val_size >= len(full):
                raise ValueError(f"val_size {self.val_size} leaves no training images (the split has {len(full)})")
            generator = torch.Generator().manual_seed(self.seed)
            train, val = random_split(full, [len(full) - self.val_size, self.val_size], generator=generator)
            self._splits["train"], self._splits["val"] = train, val
        if stage in (None, "test", "predict") and "test" not in self._splits:
            self._splits["test"] = self._load("test")

    def _split(self, name: str) -> Dataset:
        if name not in self._splits:
            self.setup("fit" if name in ("train", "val") else "test")
        return self._splits[name]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._split("train"), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._split("val"), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._split("test"), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
