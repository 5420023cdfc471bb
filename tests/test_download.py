"""Data sets the repository does not ship: the data cache directory, downloads, the IMDB
archive and SuiteSparse matrices, fetched through ``file://`` URLs from archives built here
(from the repository's sample, from matrices written here, and from the copies in
``../shared/data`` when that folder exists)."""

from __future__ import annotations

import csv
import gzip
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sps

from models.download import data_dir, download, suitesparse_matrix
from models.imdb import IMDB_SAMPLE_DIR, IMDBDataModule, default_data_dir, download_imdb, read_imdb_csv

SHARED_SUITESPARSE = Path(__file__).resolve().parents[2] / "shared" / "data" / "suitesparse"


def _tarball(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _sample_rows(split: str) -> list[dict[str, str]]:
    with gzip.open(IMDB_SAMPLE_DIR / f"{split}.csv.gz", "rt", newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def test_data_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSENN_DATA_DIR", str(tmp_path / "data"))
    assert data_dir() == tmp_path / "data" and default_data_dir() == tmp_path / "data" / "imdb"
    monkeypatch.delenv("SPARSENN_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert data_dir() == tmp_path / "cache" / "sparsenn" / "data"


def test_a_failed_download_names_the_url_and_leaves_nothing(tmp_path):
    url = (tmp_path / "absent.tar.gz").as_uri()
    with pytest.raises(FileNotFoundError, match=r"downloading file://.*absent\.tar\.gz failed.*Try this"):
        download(url, tmp_path / "out" / "file.tar.gz", "Try this.")
    assert not list((tmp_path / "out").iterdir())


def test_imdb_archive_becomes_the_csv_files(tmp_path):
    """The aclImdb archive's labelled reviews (unlabelled ones and other files skipped) are
    written as train.csv.gz and test.csv.gz, byte for byte what the shipped sample holds."""
    members = {"aclImdb/README": b"readme", "aclImdb/train/unsup/0_0.txt": b"unlabelled"}
    for split in ("train", "test"):
        for row in reversed(_sample_rows(split)):  # the writer orders them by class, then id
            members[f"aclImdb/{row['file']}"] = row["text"].encode()
    archive = _tarball(tmp_path / "aclImdb_v1.tar.gz", members)
    download_imdb(tmp_path / "imdb", url=archive.as_uri())
    assert sorted(p.name for p in (tmp_path / "imdb").iterdir()) == ["test.csv.gz", "train.csv.gz"]
    for split in ("train", "test"):
        written = gzip.decompress((tmp_path / "imdb" / f"{split}.csv.gz").read_bytes())
        assert written == gzip.decompress((IMDB_SAMPLE_DIR / f"{split}.csv.gz").read_bytes())
    texts, labels = read_imdb_csv(tmp_path / "imdb" / "train.csv.gz")
    assert len(texts) == 256 and labels.count(1) == 128


def test_an_imdb_archive_without_reviews_is_an_error(tmp_path):
    archive = _tarball(tmp_path / "aclImdb_v1.tar.gz", {"aclImdb/README": b"readme"})
    with pytest.raises(ValueError, match="no train reviews found"):
        download_imdb(tmp_path / "imdb", url=archive.as_uri())
    assert not list((tmp_path / "imdb").iterdir())


def test_imdb_data_module_reads_the_data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSENN_DATA_DIR", str(tmp_path))
    (tmp_path / "imdb").mkdir()
    for split in ("train", "test"):
        (tmp_path / "imdb" / f"{split}.csv.gz").write_bytes((IMDB_SAMPLE_DIR / f"{split}.csv.gz").read_bytes())
    data = IMDBDataModule(max_length=32, val_size=64, batch_size=8)
    data.prepare_data()  # present: nothing to download
    data.setup()
    assert data.data_dir == tmp_path / "imdb"
    assert [len(data.datasets[split]) for split in ("train", "val", "test")] == [192, 64, 64]


def _mtx_bytes(matrix: sps.sparray) -> bytes:
    out = io.BytesIO()
    scipy.io.mmwrite(out, matrix)
    return out.getvalue()


def _fetch(tmp_path: Path, group: str, name: str, mtx: bytes) -> Path:
    server = tmp_path / "server" / group
    server.mkdir(parents=True)
    _tarball(server / f"{name}.tar.gz", {f"{name}/{name}.mtx": mtx, f"{name}/{name}_b.mtx": b"%%MatrixMarket"})
    return suitesparse_matrix(group, name, root=tmp_path / "cache", url=(tmp_path / "server").as_uri())


def test_suitesparse_matrix_is_fetched_once(tmp_path):
    matrix = sps.random_array((30, 20), density=0.1, random_state=np.random.default_rng(0), format="coo")
    path = _fetch(tmp_path, "Test", "random30", _mtx_bytes(matrix))
    assert path == tmp_path / "cache" / "Test" / "random30.mtx"
    assert (scipy.io.mmread(path) != matrix).nnz == 0
    (tmp_path / "server" / "Test" / "random30.tar.gz").unlink()
    assert suitesparse_matrix("Test", "random30", root=tmp_path / "cache", url="file:///nowhere") == path
    assert sorted(p.name for p in path.parent.iterdir()) == ["random30.mtx"]


def test_suitesparse_archive_without_the_matrix_is_an_error(tmp_path):
    (tmp_path / "server" / "G").mkdir(parents=True)
    _tarball(tmp_path / "server" / "G" / "m.tar.gz", {"m/other.mtx": b""})
    with pytest.raises(ValueError, match=r"holds no file m/m\.mtx"):
        suitesparse_matrix("G", "m", root=tmp_path / "cache", url=(tmp_path / "server").as_uri())
    assert not (tmp_path / "cache" / "G" / "m.mtx").exists()


@pytest.mark.parametrize("group, name", [("Newman", "karate"), ("HB", "494_bus")])
def test_suitesparse_copies_of_shared_data(tmp_path, group, name):
    source = SHARED_SUITESPARSE / f"{name}.mtx"
    if not source.is_file():
        pytest.skip(f"no local copy of {group}/{name} ({source})")
    path = _fetch(tmp_path, group, name, source.read_bytes())
    assert path.read_bytes() == source.read_bytes()
    assert scipy.io.mmread(path).shape[0] > 0
