"""benchmarks/sweep.py in its quick mode on one tiny cell of each section: the JSON's schema,
the heat map, and a redraw and summary from the JSON alone."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "sweep.py"
TOP = {"machine", "cpu", "torch", "commit", "date", "command", "loadavg", "cells", "spmm", "models"}
CELL = {"shape", "sparsity", "batch", "dtype", "threads", "pass", "sparsenn_ms", "dense_ms", "torch_sparse_ms", "build_s"}
SPMM = {"graph", "rows", "nnz", "columns", "threads", "sparsenn_ms", "torch_sparse_ms"}
MODEL = {"model", "threads", "sparsenn_ms", "dense_ms", "torch_sparse_ms", "pyg_ms"}


def positive(row: dict, keys: tuple[str, ...]) -> bool:
    return all(isinstance(row[key], (int, float)) and row[key] > 0 for key in keys)


def test_quick_sweep_writes_its_schema(tmp_path):
    command = [sys.executable, str(SWEEP), "--quick", "--shapes", "64x32", "--sparsities", "0.9", "--batches", "1",
               "--dtypes", "float32", "--threads", "1", "--repeats", "2", "--graphs", "Cora", "--columns", "4",
               "--models", "gcn_cora", "--machine", "test", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "test-quick.json").read_text())

    assert set(data) == TOP
    assert data["machine"] == "test" and data["torch"] and data["commit"] and "--quick" in data["command"]
    assert time.strptime(data["date"], "%Y-%m-%d %H:%M")
    assert {"model", "avx512f", "l2"} <= set(data["cpu"])
    assert all(len(data["loadavg"][key]) == 3 for key in ("start", "end"))

    assert [c["pass"] for c in data["cells"]] == ["forward", "forward+backward"]
    for cell in data["cells"]:
        assert set(cell) == CELL
        assert (cell["shape"], cell["sparsity"], cell["batch"], cell["dtype"], cell["threads"]) == (
            "64x32", 0.9, 1, "float32", 1)
        assert positive(cell, ("sparsenn_ms", "dense_ms", "torch_sparse_ms", "build_s"))
    [spmm] = data["spmm"]
    assert set(spmm) == SPMM and (spmm["graph"], spmm["columns"], spmm["rows"]) == ("Cora", 4, 2708)
    assert positive(spmm, ("nnz", "sparsenn_ms", "torch_sparse_ms"))
    [model] = data["models"]
    assert set(model) == MODEL and model["model"] == "gcn_cora"
    assert positive(model, ("sparsenn_ms", "dense_ms", "torch_sparse_ms", "pyg_ms"))
    assert (tmp_path / "heatmap-quick.png").stat().st_size > 0

    spec = importlib.util.spec_from_file_location("sweep_plot", ROOT / "benchmarks" / "sweep_plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    [figure] = plot.write_heatmaps(data, tmp_path / "redrawn")
    assert figure.name == "heatmap.png" and figure.stat().st_size > 0
    text = plot.summary(data)
    assert "worst 10 cells, float32, 1 thread(s)" in text and "spmm" in text and "gcn_cora" in text
