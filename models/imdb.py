"""IMDB movie reviews (Maas et al., ACL 2011) for sentiment classification: a word-level
tokenizer built from the training split and a Lightning data module of padded token ids.

The data are ``{data_dir}/train.csv.gz`` and ``{data_dir}/test.csv.gz`` with the columns
``label`` (0 negative, 1 positive), ``rating``, ``file`` and ``text``, one review per row.
:func:`download_imdb` makes them from the dataset's archive (:data:`IMDB_URL`), which
:class:`IMDBDataModule` fetches into the data cache (``models.download.data_dir()``) when no
``data_dir`` is given; :func:`write_imdb_csv` makes them from an unpacked ``aclImdb`` folder.
The repository ships a sample of 320 real reviews (:data:`IMDB_SAMPLE_DIR`).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import itertools
import json
import os
import re
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from models.download import data_dir, download
from sparsenn.layers.arguments import checked_int

__all__ = ["IMDB_URL", "IMDB_SAMPLE_DIR", "IMDBDataModule", "WordTokenizer", "default_data_dir", "download_imdb",
           "read_imdb_csv", "write_imdb_csv"]

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
"""The Large Movie Review Dataset v1.0 archive (84 MB), its authors' canonical source."""

IMDB_SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "imdb_sample"
"""The shipped sample: 256 training and 64 test reviews (see its SOURCES.md)."""

_SPLITS = ("train", "test")
_REVIEW = re.compile(r"(train|test)/(neg|pos)/(\d+)_(\d+)\.txt")


def default_data_dir() -> Path:
    """Where :class:`IMDBDataModule` keeps the downloaded data set: ``<data cache>/imdb``."""
    return data_dir() / "imdb"


def _missing_file_error(path: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"IMDB file not found: {path}. Leave data_dir unset to download {IMDB_URL} into {default_data_dir()}, "
        f"or write the csv.gz files from the unpacked archive with `python -c \"from models.imdb import "
        f"write_imdb_csv; write_imdb_csv('aclImdb', '{path.parent}')\"` (a data_dir holds train.csv.gz and "
        f"test.csv.gz: label,rating,file,text)")


def read_imdb_csv(path: str | Path) -> tuple[list[str], list[int]]:
    """The ``text`` and ``label`` columns of one IMDB csv.gz file (labels must be 0 or 1)."""
    path = Path(path)
    if not path.is_file():
        raise _missing_file_error(path)
    texts, labels = [], []
    with gzip.open(path, "rt", newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        missing = {"label", "text"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected a header label,rating,file,text")
        for row_number, row in enumerate(reader, start=2):
            if row["label"] not in ("0", "1"):
                raise ValueError(f"{path}, line {row_number}: label must be 0 or 1, got {row['label']!r}")
            texts.append(row["text"])
            labels.append(int(row["label"]))
    if not texts:
        raise ValueError(f"{path} holds no reviews")
    return texts, labels


def write_imdb_csv(source: str | Path, data_dir: str | Path) -> None:
    """Write ``train.csv.gz`` and ``test.csv.gz`` into ``data_dir`` from an unpacked
    ``aclImdb`` folder (``{train,test}/{neg,pos}/<id>_<rating>.txt``)."""
    source = Path(source)
    folders = [source / split / polarity for split in _SPLITS for polarity in ("neg", "pos")]
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} not found: expected the unpacked aclImdb folder of {IMDB_URL}")
    _write_reviews(data_dir, ((review.relative_to(source).as_posix(), review.read_text(encoding="utf-8"))
                              for folder in folders for review in folder.glob("*.txt")))


def download_imdb(data_dir: str | Path, url: str = IMDB_URL) -> None:
    """Download the dataset's archive from ``url`` and write ``train.csv.gz`` and
    ``test.csv.gz`` into ``data_dir`` (the archive is not kept)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as workdir:
        hint = f"Or write train.csv.gz and test.csv.gz into {data_dir} from an unpacked copy with write_imdb_csv."
        archive = download(url, Path(workdir) / "aclImdb_v1.tar.gz", hint)
        _write_reviews(data_dir, _archived_reviews(archive))


def _archived_reviews(archive: Path) -> Iterator[tuple[str, str]]:
    """``(path under aclImdb/, text)`` of every labelled review in the archive."""
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            name = member.name.removeprefix("aclImdb/")
            if member.isfile() and _REVIEW.fullmatch(name):
                with tar.extractfile(member) as file:
                    yield name, file.read().decode("utf-8")


def _write_reviews(data_dir: str | Path, reviews: Iterable[tuple[str, str]]) -> None:
    """``train.csv.gz`` and ``test.csv.gz`` in ``data_dir`` from ``(path, text)`` pairs, the
    path ``<split>/<neg|pos>/<id>_<rating>.txt``; rows ordered by class, then id. Each file
    is written under a temporary name and renamed when complete."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[tuple[int, int, str, str, str]]] = {split: [] for split in _SPLITS}
    for path, text in reviews:
        match = _REVIEW.fullmatch(path)
        if match is None:
            raise ValueError(f"{path} is not a review file: expected <split>/<neg|pos>/<id>_<rating>.txt")
        split, polarity, number, rating = match.groups()
        rows[split].append((int(polarity == "pos"), int(number), rating, path, text))
    for split, entries in rows.items():
        if not entries:
            raise ValueError(f"no {split} reviews found: expected files {split}/{{neg,pos}}/<id>_<rating>.txt")
    for split, entries in rows.items():
        descriptor, partial = tempfile.mkstemp(dir=data_dir, prefix=f".{split}.", suffix=".partial")
        os.close(descriptor)
        try:
            with gzip.open(partial, "wt", newline="", encoding="utf-8") as file:
                writer = csv.writer(file, lineterminator="\n")
                writer.writerow(("label", "rating", "file", "text"))
                writer.writerows((label, rating, path, text) for label, _, rating, path, text in sorted(entries))
            os.replace(partial, data_dir / f"{split}.csv.gz")
        finally:
            Path(partial).unlink(missing_ok=True)


class WordTokenizer:
    """Lower-cased words (letters and digits, with an inner apostrophe: ``don't``) and the
    marks ``!`` and ``?``; HTML line breaks (``<br />``) are spaces. Id 0 is ``<pad>``,
    1 is ``<unk>``, then the words of the fitted texts by decreasing count (ties in order
    of first appearance), at most ``vocab_size`` ids in all, each word seen ``min_freq``
    times or more."""

    PAD, UNK = "<pad>", "<unk>"
    PAD_ID, UNK_ID = 0, 1
    _WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?|[!?]")

    def __init__(self, words: Sequence[str]) -> None:
        words = list(words)
        if words[:2] != [self.PAD, self.UNK]:
            raise ValueError(f"a vocabulary starts with {self.PAD!r}, {self.UNK!r}; got {words[:2]}")
        if len(set(words)) != len(words):
            raise ValueError("the vocabulary holds a word twice")
        self.words = words
        self.ids = {word: i for i, word in enumerate(words)}

    @classmethod
    def split(cls, text: str) -> list[str]:
        """The tokens of ``text``."""
        return cls._WORD.findall(text.lower().replace("<br />", " "))

    @classmethod
    def fit(cls, texts: Iterable[str], vocab_size: int = 20000, min_freq: int = 2) -> WordTokenizer:
        """The vocabulary of ``texts`` (see the class doc)."""
        vocab_size = checked_int("vocab_size", vocab_size, 3)
        min_freq = checked_int("min_freq", min_freq, 1)
        counts = Counter(itertools.chain.from_iterable(map(cls.split, texts)))
        common = [word for word, count in counts.most_common(vocab_size - 2) if count >= min_freq]
        return cls([cls.PAD, cls.UNK, *common])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, texts: Sequence[str], max_length: int) -> tuple[Tensor, Tensor]:
        """``(token_ids, padding_mask)``, both ``(len(texts), max_length)``: the first
        ``max_length`` tokens of each text, then ``<pad>``; the mask is True at padding. A
        text without tokens is one ``<unk>``, so every row has an unpadded position."""
        max_length = checked_int("max_length", max_length, 1)
        get, unk = self.ids.get, self.UNK_ID
        rows = [[get(token, unk) for token in self.split(text)[:max_length]] or [unk] for text in texts]
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        padding = torch.arange(max_length) >= lengths[:, None]
        ids = torch.full((len(rows), max_length), self.PAD_ID, dtype=torch.long)
        ids[~padding] = torch.from_numpy(flat)
        return ids, padding


class IMDBDataModule(L.LightningDataModule):
    """IMDB sentiment data as ``(token_ids, padding_mask, labels)`` batches.

    The training file's reviews are shuffled (``seed``) and the first ``val_size`` of them
    held out for validation; the tokenizer (:class:`WordTokenizer`) is fitted on the rest.
    The test reviews are shuffled too (the files are grouped by class), so any prefix of
    the test loader mixes both classes. Every sequence is truncated or padded to
    ``max_length`` tokens; ``padding_mask`` is True at padding. With ``cache_dir`` the
    encoded tensors and the vocabulary are saved there, keyed by the files' sizes and
    modification times and by every setting that changes them.

    Args:
        data_dir: folder with ``train.csv.gz`` and ``test.csv.gz``; None: :func:`default_data_dir`,
            where :meth:`prepare_data` downloads the data set (84 MB) when it is not there yet.
        max_length: tokens per sequence.
        vocab_size: most ids of the tokenizer, ``<pad>`` and ``<unk>`` included.
        min_freq: fewest occurrences in the training reviews of a word in the vocabulary.
        batch_size: reviews per batch.
        val_size: training reviews held out for validation.
        seed: seed of both shuffles (and of the training loader's order).
        num_workers: data loader worker processes.
        cache_dir: folder for the encoded tensors (None: encode at every ``setup``).
    """

    num_classes = 2

    def __init__(self, data_dir: str | None = None, max_length: int = 1024, vocab_size: int = 20000,
                 min_freq: int = 2, batch_size: int = 64, val_size: int = 2500, seed: int = 0,
                 num_workers: int = 0, cache_dir: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()  # the first-call benchmark rebuilds the module from them
        self.downloads = data_dir is None
        self.data_dir = default_data_dir() if data_dir is None else Path(data_dir)
        self.max_length = checked_int("max_length", max_length, 1)
        self.vocab_size_limit = checked_int("vocab_size", vocab_size, 3)
        self.min_freq = checked_int("min_freq", min_freq, 1)
        self.batch_size = checked_int("batch_size", batch_size, 1)
        self.val_size = checked_int("val_size", val_size, 1)
        self.seed = checked_int("seed", seed, 0)
        self.num_workers = checked_int("num_workers", num_workers, 0)
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.tokenizer: WordTokenizer | None = None
        self.datasets: dict[str, TensorDataset] = {}

    @property
    def vocab_size(self) -> int:
        """Ids of the fitted tokenizer (after :meth:`setup`)."""
        if self.tokenizer is None:
            raise RuntimeError("IMDBDataModule.setup() has not run: the vocabulary is built from the training split")
        return len(self.tokenizer)

    def prepare_data(self) -> None:
        """Download the data set into :func:`default_data_dir` when no ``data_dir`` was given
        and it is not there yet."""
        if self.downloads and not all((self.data_dir / f"{split}.csv.gz").is_file() for split in _SPLITS):
            download_imdb(self.data_dir)

    def _paths(self) -> dict[str, Path]:
        paths = {split: self.data_dir / f"{split}.csv.gz" for split in _SPLITS}
        for path in paths.values():
            if not path.is_file():
                raise _missing_file_error(path)
        return paths

    def _cache_file(self, paths: dict[str, Path]) -> Path | None:
        if self.cache_dir is None:
            return None
        files = {split: [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
                 for split, path in paths.items()}
        key = {"files": files,
               "settings": [self.max_length, self.vocab_size_limit, self.min_freq, self.val_size, self.seed],
               "tokenizer": WordTokenizer._WORD.pattern}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.cache_dir / f"imdb-{digest}.pt"

    def setup(self, stage: str | None = None) -> None:
        """Read, split, fit the tokenizer and encode, once (later stages reuse it)."""
        if self.datasets:
            return
        self.prepare_data()
        paths = self._paths()
        cache = self._cache_file(paths)
        if cache is not None and cache.is_file():
            saved = torch.load(cache, weights_only=True)
            self.tokenizer = WordTokenizer(saved["words"])
            self.datasets = {split: TensorDataset(*saved[split]) for split in ("train", "val", "test")}
            return
        texts, labels = read_imdb_csv(paths["train"])
        if self.val_size >= len(texts):
            raise ValueError(f"val_size ({self.val_size}) must be smaller than the {len(texts)} training reviews "
                             f"of {paths['train']}")
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(texts), generator=generator).tolist()
        val, train = order[:self.val_size], order[self.val_size:]
        self.tokenizer = WordTokenizer.fit((texts[i] for i in train), self.vocab_size_limit, self.min_freq)
        encoded = {"train": self._encode([texts[i] for i in train], [labels[i] for i in train]),
                   "val": self._encode([texts[i] for i in val], [labels[i] for i in val])}
        texts, labels = read_imdb_csv(paths["test"])
        order = torch.randperm(len(texts), generator=generator).tolist()
        encoded["test"] = self._encode([texts[i] for i in order], [labels[i] for i in order])
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            descriptor, partial = tempfile.mkstemp(dir=cache.parent, prefix=cache.stem, suffix=".partial")
            os.close(descriptor)
            torch.save({"words": self.tokenizer.words, **encoded}, partial)
            os.replace(partial, cache)  # atomic: concurrent runs each write their own file
        self.datasets = {split: TensorDataset(*tensors) for split, tensors in encoded.items()}

    def _encode(self, texts: list[str], labels: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        ids, padding = self.tokenizer.encode(texts, self.max_length)
        return ids, padding, torch.tensor(labels, dtype=torch.long)

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        if not self.datasets:
            self.setup()
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(self.datasets[split], batch_size=self.batch_size, shuffle=shuffle, generator=generator,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
