"""Per-call overhead: sparsenn against torch on the small SuiteSparse matrices, 1 thread.

    python benchmarks/overhead.py [--data DIR] [--batches 40] [--calls 100]

Each call is timed as the fastest of ``batches`` batches of ``calls`` back-to-back calls
(a Python loop, as user code would make them), so the figures are the cost of a call
whose kernel, Python objects and operands are warm: dispatch plus kernel.
"""

from __future__ import annotations

import argparse
import timeit
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sps
import torch

import sparsenn
from kernels import DATA, torch_csr

MATRICES = ("karate", "494_bus")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="directory of SuiteSparse .mtx files")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| matrix (nnz) | kernel | sparsenn | torch |\n|---|---|---:|---:|")
    for name in MATRICES:
        m = sps.csr_array(scipy.io.mmread(args.data / f"{name}.mtx"), dtype=np.float32)
        for kernel, (ours, theirs) in calls(m).items():
            print(f"| {name} ({m.nnz}) | {kernel} | {per_call_us(ours, args.batches, args.calls):.1f} µs "
                  f"| {per_call_us(theirs, args.batches, args.calls):.1f} µs |", flush=True)


if __name__ == "__main__":
    main()
