"""Per-call overhead: sparsenn against torch on the small SuiteSparse matrices, 1 thread.

    python benchmarks/overhead.py [--data DIR] [--batches 40] [--calls 100] [--out DIR]

Each call is timed as the fastest of ``batches`` batches of ``calls`` back-to-back calls
(a Python loop, as user code would make them), so the figures are the cost of a call
whose kernel, Python objects and operands are warm: dispatch plus kernel. The table is
printed and written to ``DIR/overhead.json`` in the common schema of ``report.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sps
import torch

import sparsenn
from kernels import DATA, torch_csr
from structured import machine_info

MATRICES = ("karate", "494_bus")
COLUMNS = ["matrix (nnz)", "kernel", "sparsenn µs", "torch µs"]


def calls(m: sps.csr_array) -> dict[str, tuple]:
    """kernel name -> (sparsenn call, torch call) on ``m``."""
    a, at = sparsenn.from_scipy(m, format="csr"), torch_csr(m)
    att = at.t().to_sparse_csr()
    x, b = torch.randn(m.shape[1]), torch.randn(m.shape[1], 32)
    return {
        "SpMV": (lambda: sparsenn.einsum("ij,j->i", a, x), lambda: at @ x),
        "SpMM k=32": (lambda: sparsenn.einsum("ij,jk->ik", a, b), lambda: torch.sparse.mm(at, b)),
        "SpGEMM A·Aᵀ": (lambda: sparsenn.einsum("ij,kj->ik", a, a), lambda: at @ att),
    }


def per_call_us(fn, batches: int, calls_per_batch: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=calls_per_batch, repeat=batches)) / calls_per_batch * 1e6


def write_results(out: Path, rows: list[list]) -> None:
    """``out/overhead.json``: the table with the machine, versions, commit and command."""
    info = machine_info()
    record = {"benchmark": "overhead", "cpu": info["cpu"], "machine": f"{info['cores']} cores, L2 {info['l2']}",
              "torch": info["torch"], "commit": info["git"], "date": info["date"], "load": info["loadavg"][0],
              "command": " ".join(["python", *sys.argv]), "columns": COLUMNS, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="directory of SuiteSparse .mtx files")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| matrix (nnz) | kernel | sparsenn | torch |\n|---|---|---:|---:|")
    rows = []
    for name in MATRICES:
        m = sps.csr_array(scipy.io.mmread(args.data / f"{name}.mtx"), dtype=np.float32)
        for kernel, (ours, theirs) in calls(m).items():
            row = [f"{name} ({m.nnz})", kernel, round(per_call_us(ours, args.batches, args.calls), 1),
                   round(per_call_us(theirs, args.batches, args.calls), 1)]
            rows.append(row)
            print(f"| {row[0]} | {kernel} | {row[2]:.1f} µs | {row[3]:.1f} µs |", flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
