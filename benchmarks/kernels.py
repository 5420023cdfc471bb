"""Kernel benchmark: SpMV, SpMM, SDDMM and SpGEMM, sparsenn vs torch.sparse and scipy.

    python benchmarks/kernels.py [--quick] [--threads 1 2] [--out benchmarks/results]

Matrices: every SuiteSparse ``.mtx`` in ``../shared/data/suitesparse`` plus synthetic
uniform, banded and R-MAT (power-law) ones. fp32. Each case is timed for all libraries
in the same run (median after a warm-up) and reported as ratios: alternative time /
sparsenn time (> 1: sparsenn is faster). First-build compile time is measured in a
fresh process with an empty kernel cache, separately from the steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sps
import torch

import sparsenn

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "suitesparse"
BANDWIDTH = {1: 21e9, 2: 28e9}  # bytes/s measured on this machine (STREAM-style triad)


def median_time(fn, min_time: float = 0.3, max_reps: int = 30) -> float:
    fn(), fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rmat(scale: int, edge_factor: int, seed: int) -> sps.csr_array:
    """R-MAT graph (a, b, c) = (0.57, 0.19, 0.19), duplicates merged."""
    rng = np.random.default_rng(seed)
    n, m = 1 << scale, edge_factor << scale
    rows = np.zeros(m, dtype=np.int64)
    cols = np.zeros(m, dtype=np.int64)
    for bit in range(scale):
        r = rng.random(m)
        down = r >= 0.57 + 0.19  # quadrants c or d
        right = ((r >= 0.57) & (r < 0.76)) | (r >= 0.95)
        rows |= down.astype(np.int64) << bit
        cols |= right.astype(np.int64) << bit
    a = sps.coo_array((np.ones(m, dtype=np.float32), (rows, cols)), shape=(n, n)).tocsr()
    a.sum_duplicates()
    return a


def matrices(quick: bool):
    for path in sorted(DATA.glob("*.mtx")):
        m = sps.csr_array(scipy.io.mmread(path)).astype(np.float32)
        if quick and m.nnz > 100_000:
            continue
        yield path.stem, m
    rng = np.random.default_rng(0)
    yield "uniform 2^14", sps.random_array((1 << 14, 1 << 14), density=16 / (1 << 14), format="csr", dtype=np.float32, rng=rng)
    if quick:
        return
    yield "uniform 2^17", sps.random_array((1 << 17, 1 << 17), density=16 / (1 << 17), format="csr", dtype=np.float32, rng=rng)
    n = 1 << 16
    yield "banded 2^16", sps.diags_array([np.ones(n - abs(k), dtype=np.float32) for k in range(-8, 9)], offsets=range(-8, 9), format="csr")
    yield "rmat 16", rmat(16, 16, 1)
    yield "rmat 18", rmat(18, 16, 2)
    yield "uniform 2^19 (1e7)", sps.random_array((1 << 19, 1 << 19), density=20 / (1 << 19), format="csr", dtype=np.float32, rng=rng)


def cases(name: str, m: sps.csr_array, quick: bool):
    """(kernel, sparsenn fn, {alternative: fn}, bytes moved or None, check)."""
    a = sparsenn.from_scipy(m, format="csr")
    at = torch.sparse_csr_tensor(torch.from_numpy(m.indptr).long(), torch.from_numpy(m.indices).long(),
                                 torch.from_numpy(m.data), m.shape)
    rows, cols = m.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cols, generator=g)
    yield ("SpMV", lambda: sparsenn.einsum("ij,j->i", a, x),
           {"torch": lambda: at @ x, "scipy": lambda: m @ x.numpy()},
           m.nnz * 8 + (rows + 1) * 4 + cols * 4 + rows * 4)
    for k in (32,) if quick else (32, 128):
        b = torch.randn(cols, k, generator=g)
        yield (f"SpMM k={k}", lambda b=b: sparsenn.einsum("ij,jk->ik", a, b),
               {"torch": lambda b=b: torch.sparse.mm(at, b), "scipy": lambda b=b: m @ b.numpy()},
               m.nnz * 8 + (rows + 1) * 4 + cols * k * 4 + rows * k * 4)
    p, q = torch.randn(rows, 64, generator=g), torch.randn(cols, 64, generator=g)
    alts = {"torch": lambda: torch.sparse.sampled_addmm(at, p, q.T, beta=0.0)}
    if rows * cols * 4 <= 2 << 30:
        mask = torch.from_numpy(m.toarray())
        alts["dense-then-mask"] = lambda: (p @ q.T) * mask
    yield "SDDMM k=64", lambda: sparsenn.einsum("ij,ik,jk->ij", a, p, q), alts, None
    if m.nnz <= 600_000 and rows == cols:  # power-law A·Aᵀ beyond this takes seconds per call
        att = at.to_sparse_coo().t().coalesce().to_sparse_csr()
        yield ("SpGEMM A·Aᵀ", lambda: sparsenn.einsum("ij,kj->ik", a, a),
               {"torch": lambda: at @ att, "scipy": lambda: m @ m.T}, None)


def first_build_times() -> dict[str, tuple[float, float]]:
    """Cold (empty cache) and warm (disk cache) first-call times, in fresh processes."""
    code = (
        "import time, torch, sparsenn;"
        "d = torch.rand(500, 500); d[d < 0.95] = 0; a = sparsenn.from_dense(d);"
        "x = torch.randn(500, 32); eq = {!r};"
        "ops = {{'ij,j->i': (a, x[:, 0]), 'ij,jk->ik': (a, x), 'ij,ik,jk->ij': (a, x, x), 'ij,kj->ik': (a, a)}}[eq];"
        "t = time.perf_counter(); sparsenn.einsum(eq, *ops); print(time.perf_counter() - t)"
    )
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, SPARSENN_CACHE_DIR=cache)
        for eq in ("ij,j->i", "ij,jk->ik", "ij,ik,jk->ij", "ij,kj->ik"):
            run = lambda: float(subprocess.run([sys.executable, "-c", code.format(eq)], env=env,  # noqa: E731
                                               capture_output=True, text=True, check=True).stdout)
            out[eq] = (run(), run())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    header = (f"CPU {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; scipy {scipy.__version__}; "
              f"python {platform.python_version()}; {time.strftime('%Y-%m-%d')}; scipy is single-threaded")
    print(header)
    rows_out = []
    for name, m in matrices(args.quick):
        for kernel, ours, alts, nbytes in cases(name, m, args.quick):
            for threads in args.threads:
                torch.set_num_threads(threads)
                t_ours = median_time(ours)
                row = {"matrix": name, "n": m.shape[0], "nnz": int(m.nnz), "kernel": kernel,
                       "threads": threads, "sparsenn_ms": t_ours * 1e3}
                for alt, fn in alts.items():
                    try:
                        row[f"{alt}_ms"] = median_time(fn) * 1e3
                    except RuntimeError as error:  # e.g. an op torch lacks for this layout
                        row[f"{alt}_ms"] = float("nan")
                        row["note"] = str(error).splitlines()[0][:60]
                if nbytes and m.nnz >= 1_000_000:
                    row["bw_fraction"] = nbytes / BANDWIDTH[threads] / t_ours
                rows_out.append(row)
                ratios = "  ".join(f"{k[:-3]}/sn {row[k] / row['sparsenn_ms']:.2f}" for k in row if k.endswith("_ms") and k != "sparsenn_ms")
                print(f"{name:22s} nnz {m.nnz:>9d} {kernel:12s} t={threads} sparsenn {t_ours * 1e3:9.3f} ms  {ratios}", flush=True)
    builds = first_build_times()
    (args.out / "kernels.json").write_text(json.dumps({"machine": header, "rows": rows_out, "first_build_s": builds}, indent=1))
    lines = [f"Machine: {header}", "", "| matrix | nnz | kernel | threads | sparsenn ms | torch/sparsenn | scipy/sparsenn | dense-mask/sparsenn | bw fraction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        ratio = lambda k: f"{r[k] / r['sparsenn_ms']:.2f}" if k in r else ""  # noqa: E731
        bw = f"{r['bw_fraction']:.0%}" if "bw_fraction" in r else ""
        lines.append(f"| {r['matrix']} | {r['nnz']} | {r['kernel']} | {r['threads']} | {r['sparsenn_ms']:.3f} | "
                     f"{ratio('torch_ms')} | {ratio('scipy_ms')} | {ratio('dense-then-mask_ms')} | {bw} |")
    lines += ["", "Median ratio over the matrix set (torch time / sparsenn time):", ""]
    for kernel in dict.fromkeys(r["kernel"] for r in rows_out):
        for threads in args.threads:
            vals = [r["torch_ms"] / r["sparsenn_ms"] for r in rows_out
                    if r["kernel"] == kernel and r["threads"] == threads and not np.isnan(r.get("torch_ms", np.nan))]
            if vals:
                lines.append(f"- {kernel}, {threads} thread(s): {statistics.median(vals):.2f}x (range {min(vals):.2f}-{max(vals):.2f})")
    lines += ["", "First call in a fresh process (s): empty cache (compile) / warm disk cache:", ""]
    lines += [f"- `{eq}`: {cold:.3f} / {warm:.3f}" for eq, (cold, warm) in builds.items()]
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(builds) + 12):]))


if __name__ == "__main__":
    main()
