"""The main job's data on a user's machine: every ``MAIN_JOB`` step's config, data module and
bench batch, from a copy of the checkout with no ``shared`` folder beside it, an empty data
cache and no network, in a process that refuses to open files of the original checkout or
its ``../shared``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = ("sparsenn", "models", "configs", "pyproject.toml")

CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    forbidden = [Path(path) for path in sys.argv[1:]]

    def refuse(event, args):
        if event in ("socket.connect", "socket.getaddrinfo"):
            raise PermissionError(f"network use: {args}")
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = Path(os.path.realpath(os.fsdecode(args[0])))
            if any(path.is_relative_to(root) for root in forbidden):
                raise PermissionError(f"read outside the checkout: {path}")

    sys.addaudithook(refuse)

    from sparsenn.lightning_cli import SparsennCLI
    from sparsenn.main_job import MAIN_JOB

    for step in MAIN_JOB:
        cli = SparsennCLI(["--config", step.config, *step.overrides], run=False)
        cli.datamodule.prepare_data()
        cli.datamodule.setup("test")
        inputs, _ = cli.model.bench_batch(cli.datamodule)
        print(json.dumps([step.config, [list(item.shape) for item in inputs]]))
    """)


def test_main_job_data_comes_from_the_checkout_alone(tmp_path):
    checkout = tmp_path / "clone"
    for name in CHECKOUT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, checkout / name)
    assert not (tmp_path / "shared").exists()
    env = {**os.environ, "PYTHONPATH": str(checkout), "SPARSENN_DATA_DIR": str(tmp_path / "empty-data-cache")}
    forbidden = [str(ROOT.resolve()), str((ROOT.parent / "shared").resolve())]
    done = subprocess.run([sys.executable, "-c", CHILD, *forbidden], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert shapes["configs/gcn_cora.yaml"] == [[2708, 1433], [2, 10556]]
    assert shapes["configs/autoencoder_mnist.yaml"][0][1] == 784
    assert shapes["configs/bigbird_imdb.yaml"] == [[4, 4096], [4, 4096]]
    assert not (tmp_path / "empty-data-cache").exists()  # nothing was downloaded
