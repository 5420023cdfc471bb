"""Public data sets the repository does not ship, fetched from their source into a cache
directory: ``$SPARSENN_DATA_DIR``, by default ``~/.cache/sparsenn/data`` (under
``$XDG_CACHE_HOME`` when set). A download goes to a temporary file renamed once complete,
so an interrupted one leaves nothing half-written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "SUITESPARSE_URL", "data_dir", "download", "suitesparse_matrix"]

DATA_DIR_ENV = "SPARSENN_DATA_DIR"
SUITESPARSE_URL = "https://sparse.tamu.edu/MM"
"""The SuiteSparse Matrix Collection's Matrix Market archives: ``<url>/<group>/<name>.tar.gz``."""

_TIMEOUT_S = 60


def data_dir() -> Path:
    """The cache directory of downloaded data sets (see the module docstring)."""
    configured = os.environ.get(DATA_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "sparsenn" / "data"


def download(url: str, path: str | Path, hint: str = "") -> Path:
    """Fetch ``url`` into ``path``; FileNotFoundError naming the URL (and ``hint``: what else
    the user can do) when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {url}", file=sys.stderr, flush=True)
    descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as out, urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            shutil.copyfileobj(response, out, 1 << 20)
        os.replace(partial, path)
    except OSError as exc:
        raise FileNotFoundError(f"downloading {url} failed ({exc}). {hint}".strip()) from exc
    finally:
        Path(partial).unlink(missing_ok=True)
    return path


def suitesparse_matrix(group: str, name: str, root: str | Path | None = None, url: str = SUITESPARSE_URL) -> Path:
    """The Matrix Market file of SuiteSparse matrix ``group/name`` (e.g. ``"HB", "494_bus"``):
    ``<root>/<group>/<name>.mtx`` (default root ``data_dir() / "suitesparse"``), taken on first
    use from ``<url>/<group>/<name>.tar.gz`` (its member ``<name>/<name>.mtx``)."""
    path = (data_dir() / "suitesparse" if root is None else Path(root)) / group / f"{name}.mtx"
    if path.is_file():
        return path
    hint = f"Or put the collection's {name}.mtx at {path} yourself."
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as workdir:
        archive = download(f"{url}/{group}/{name}.tar.gz", Path(workdir) / f"{name}.tar.gz", hint)
        matrix = Path(workdir) / f"{name}.mtx"
        with tarfile.open(archive, "r:gz") as tar:
            try:
                member = tar.extractfile(f"{name}/{name}.mtx")
            except KeyError:
                member = None
            if member is None:
                raise ValueError(f"{archive.name} from {url}/{group} holds no file {name}/{name}.mtx")
            with member, open(matrix, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        os.replace(matrix, path)
    return path
