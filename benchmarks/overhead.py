"""Per-call overhead: sparsenn against torch on tiny operands, 1 thread.

    python benchmarks/overhead.py [--data DIR] [--batches 40] [--calls 200] [--out DIR]

(``--data``: a directory holding ``karate.mtx`` and ``494_bus.mtx``; by default they are
taken from ``$SPARSENN_DATA_DIR/suitesparse``, downloaded on first use.)

Each call is timed in batches of ``calls`` back-to-back calls (a Python loop, as user
code would make them), sparsenn's batch and torch's batch alternating, after a warm-up
batch of each, in CPU time of the calling thread (on a host shared with other jobs, wall
time counts the time the thread waits for a core, mostly in the longer batches); the
table gives the median per-call time of each and their ratio, so
the figures are the cost of a call whose kernel, Python objects and operands are warm:
dispatch plus kernel. The cases: SpMV on a 4×4 CSR matrix (the call is all overhead),
SpMV, SpMM and SpGEMM on the two smallest SuiteSparse matrices, a
``SparseLinear(16, 8, sparsity=0.5)`` forward on one input row against ``F.linear``
with its dense weight, under ``torch.no_grad()``, recording autograd (the layer's
parameters require grad) and with its backward pass (a training step's gradients of
the weight and the bias, accumulated), and a ``SparseLinear(128, 7, sparsity=0.9)`` forward on 8
rows under ``no_grad`` (its kernel reads the input feature-major: a copy per call). The table is printed and written to ``DIR/overhead.json``
in the common schema of ``report.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import numpy as np
import scipy.io
import scipy.sparse as sps
import torch
import torch.nn.functional as F

import sparsenn
from kernels import suitesparse_matrix, torch_csr
from structured import machine_info

MATRICES = (("Newman", "karate"), ("HB", "494_bus"))  # SuiteSparse (group, name)
COLUMNS = ["operands", "call", "sparsenn µs", "torch µs", "sparsenn / torch"]

Case = tuple[Callable[[], object], Callable[[], object], Callable[[], AbstractContextManager]]


def matrix_cases(m: sps.csr_array) -> dict[str, Case]:
    """call name -> (sparsenn call, torch call, grad mode) on ``m``, under no_grad."""
    a, at = sparsenn.from_scipy(m, format="csr"), torch_csr(m)
    att = at.t().to_sparse_csr()
    x, b = torch.randn(m.shape[1]), torch.randn(m.shape[1], 32)
    return {
        "SpMV": (lambda: sparsenn.einsum("ij,j->i", a, x), lambda: at @ x, torch.no_grad),
        "SpMM k=32": (lambda: sparsenn.einsum("ij,jk->ik", a, b), lambda: torch.sparse.mm(at, b), torch.no_grad),
        "SpGEMM A·Aᵀ": (lambda: sparsenn.einsum("ij,kj->ik", a, a), lambda: at @ att, torch.no_grad),
    }


def layer_cases(in_features: int = 16, out_features: int = 8, sparsity: float = 0.5, batch: int = 1,
                autograd: bool = True) -> dict[str, Case]:
    """``SparseLinear(in_features, out_features, sparsity)`` on a ``(batch, in_features)``
    input against ``F.linear`` with its dense weight, without and (``autograd``) with
    autograd recording."""
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(in_features, out_features, sparsity=sparsity)
    weight = layer.to_dense().weight.detach().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    x = torch.randn(batch, in_features)
    ours, theirs = (lambda: layer(x)), (lambda: F.linear(x, weight, bias))
    cases = {"forward, no_grad": (ours, theirs, torch.no_grad)}
    if autograd:
        cases["forward, autograd"] = (ours, theirs, torch.enable_grad)
        grad = torch.randn(batch, out_features)
        cases["forward+backward"] = ((lambda: layer(x).backward(grad)),
                                     (lambda: F.linear(x, weight, bias).backward(grad)), torch.enable_grad)
    return cases


def per_call_us(ours: Callable, theirs: Callable, batches: int, calls_per_batch: int) -> tuple[float, float]:
    """Median per-call µs of ``ours`` and ``theirs``, their batches alternating after one warm-up each."""
    times: tuple[list[float], list[float]] = ([], [])
    for n in range(batches + 1):
        for fn, recorded in zip((ours, theirs), times):
            seconds = timeit.Timer(fn, timer=time.thread_time).timeit(number=calls_per_batch)
            if n:
                recorded.append(seconds / calls_per_batch * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def write_results(out: Path, rows: list[list]) -> None:
    """``out/overhead.json``: the table with the machine, versions, commit and command."""
    info = machine_info()
    record = {"benchmark": "overhead", "cpu": info["cpu"], "machine": f"{info['cores']} cores, L2 {info['l2']}",
              "torch": info["torch"], "commit": info["git"], "date": info["date"], "load": info["loadavg"][0],
              "command": " ".join(["python", *sys.argv]), "columns": COLUMNS, "rows": rows,
              "notes": ["Medians of alternating batches, in thread CPU time. The layer's torch column is F.linear with the "
                        "dense weight; with autograd, both record the forward for a backward pass (not run); "
                        "forward+backward runs it."]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="directory of SuiteSparse .mtx files")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tiny = sps.csr_array(sps.random(4, 4, density=0.5, random_state=0, dtype=np.float32))
    groups = {f"4×4 ({tiny.nnz})": {"SpMV": matrix_cases(tiny)["SpMV"]}}
    for group, name in MATRICES:
        path = suitesparse_matrix(group, name) if args.data is None else args.data / f"{name}.mtx"
        m = sps.csr_array(scipy.io.mmread(path), dtype=np.float32)
        groups[f"{name} ({m.nnz})"] = matrix_cases(m)
    groups["SparseLinear(16, 8, 50 %), batch 1"] = layer_cases()
    groups["SparseLinear(128, 7, 90 %), batch 8"] = layer_cases(128, 7, 0.9, 8, autograd=False)
    print("| operands | call | sparsenn | torch | sparsenn / torch |\n|---|---|---:|---:|---:|")
    rows = []
    for operands, cases in groups.items():
        for call, (ours, theirs, mode) in cases.items():
            with mode():
                us, them = per_call_us(ours, theirs, args.batches, args.calls)
            rows.append([operands, call, round(us, 2), round(them, 2), round(us / them, 2)])
            print(f"| {operands} | {call} | {us:.2f} µs | {them:.2f} µs | {us / them:.2f} |", flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
