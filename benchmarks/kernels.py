"""Kernel benchmark: SpMV, SpMM, SDDMM and SpGEMM, sparsenn vs torch.sparse and scipy.

    python benchmarks/kernels.py [--quick] [--threads 1 2] [--out benchmarks/results] [--data DIR]

Matrices: the SuiteSparse matrices of ``SUITESPARSE`` (downloaded once from sparse.tamu.edu
into ``$SPARSENN_DATA_DIR/suitesparse``, see ``models/download.py``), or every ``.mtx`` in
``--data DIR``, plus synthetic uniform, banded and R-MAT (power-law) ones, all fp32 CSR.
Every library is timed on the same case in the same run, round-robin (medians after warm-up
rounds); the figures that matter are the ratios alternative time / sparsenn time (> 1:
sparsenn is faster).
First-build compile time and warm-cache load time are measured in fresh processes.
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

import matplotlib
import numpy as np
import scipy
import scipy.io
import scipy.sparse as sps
import torch

from checkout import ROOT  # noqa: E402  (first: this tree's sparsenn on sys.path)
import sparsenn  # noqa: E402
from models.download import suitesparse_matrix  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
SUITESPARSE = (("Newman", "karate"), ("HB", "494_bus"), ("HB", "west0479"), ("LPnetlib", "lp_ship04l"),
               ("SNAP", "ca-GrQc"), ("AG-Monien", "crack"), ("Rajat", "rajat01"), ("HB", "bcsstk13"), ("FIDAP", "ex6"),
               ("DIMACS10", "luxembourg_osm"), ("Grund", "bayer10"), ("HB", "bcsstk33"))
"""(group, name) of the SuiteSparse matrices benchmarked by default: 156 to 592k nonzeros."""
BANDWIDTH = {1: 21e9, 2: 28e9}  # bytes/s on this machine, by thread count
MAX_SPGEMM_NNZ = 5e7
MAX_DENSE_BYTES = 2 << 30
RTOL = 1e-3
KINDS = {"SpMV": "ij,j->i", "SpMM": "ij,jk->ik", "SDDMM": "ij,ik,jk->ij", "SpGEMM": "ij,kj->ik"}


def median_times(fns: dict, min_time: float = 0.3, max_reps: int = 30, min_reps: int = 5) -> dict:
    """Median seconds per call of each function, measured round-robin (one call of each
    per round, starting with a different one each round, so load from other jobs and the
    previous call's cache footprint hit them alike) after 2 warm-up rounds, for at least
    min_reps rounds and until min_time or max_reps. A function that raises gets its
    error text instead."""
    times: dict = {name: [] for name in fns}
    live = dict(fns)
    rounds, begin = -2, None
    while live and (rounds < min_reps or (time.perf_counter() - begin < min_time and rounds < max_reps)):
        if rounds == 0:
            begin = time.perf_counter()
        names = list(live)
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            fn = live[name]
            t = time.perf_counter()
            try:
                fn()
            except Exception as error:  # noqa: BLE001 - recorded in the table
                times[name] = error_text(error)
                del live[name]
                continue
            if rounds >= 0:
                times[name].append(time.perf_counter() - t)
        rounds += 1
    return {name: statistics.median(v) if isinstance(v, list) else v for name, v in times.items()}


def machine_info() -> dict:
    """CPU model, core count, library versions and date."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "scipy": scipy.__version__, "numpy": np.__version__,
            "sparsenn": sparsenn.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "note": "scipy is single-threaded; sparsenn and torch follow torch.set_num_threads"}


def uniform(n: int, per_row: int, rng: np.random.Generator) -> sps.csr_array:
    """n x n, per_row random columns in every row (duplicates merged)."""
    rows = np.repeat(np.arange(n), per_row)
    cols = rng.integers(0, n, size=n * per_row)
    return coo_to_csr(rows, cols, n, rng)


def banded(n: int, half_width: int, rng: np.random.Generator) -> sps.csr_array:
    """n x n with every diagonal from -half_width to +half_width stored."""
    offsets = np.arange(-half_width, half_width + 1)
    rows = np.repeat(np.arange(n), len(offsets))
    cols = rows + np.tile(offsets, n)
    keep = (cols >= 0) & (cols < n)
    return coo_to_csr(rows[keep], cols[keep], n, rng)


def rmat(scale: int, edge_factor: int, rng: np.random.Generator,
         a: float = 0.57, b: float = 0.19, c: float = 0.19) -> sps.csr_array:
    """R-MAT power-law graph with 2^scale vertices and edge_factor * 2^scale edges (deduplicated)."""
    m = edge_factor << scale
    rows, cols = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    for bit in range(scale):
        r = rng.random(m)
        rows |= (r >= a + b).astype(np.int64) << bit
        cols |= (((r >= a) & (r < a + b)) | (r >= a + b + c)).astype(np.int64) << bit
    return coo_to_csr(rows, cols, 1 << scale, rng)


def coo_to_csr(rows, cols, n: int, rng: np.random.Generator) -> sps.csr_array:
    """Deduplicated n x n CSR pattern with uniform (0, 1] fp32 values."""
    pattern = sps.coo_array((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(n, n)).tocsr()
    pattern.sum_duplicates()
    pattern.data = (1 - rng.random(pattern.nnz, dtype=np.float32))
    return pattern


def matrices(data: Path | None, quick: bool):
    """(name, fp32 CSR) for the SuiteSparse files (every .mtx in ``data``, else ``SUITESPARSE``),
    then the synthetic matrices."""
    paths = sorted(data.glob("*.mtx")) if data is not None else [suitesparse_matrix(*m) for m in SUITESPARSE]
    for path in paths:
        m = sps.csr_array(scipy.io.mmread(path), dtype=np.float32)
        if not quick or (m.nnz < 100_000 and m.shape[0] <= 10_000):
            yield path.stem, m
    rng = np.random.default_rng(0)
    yield "uniform 2^14", uniform(1 << 14, 16, rng)
    if quick:
        return
    yield "uniform 2^17", uniform(1 << 17, 16, rng)
    yield "banded 2^16", banded(1 << 16, 8, rng)
    yield "rmat 16", rmat(16, 16, rng)
    yield "rmat 18", rmat(18, 16, rng)
    yield "uniform 2^19", uniform(1 << 19, 20, rng)


def spgemm_nnz_estimate(m: sps.csr_array, sample: int = 2048) -> float:
    """nnz of m·mᵀ, extrapolated from a random sample of rows (exact for small m)."""
    n = m.shape[0]
    if n <= sample:
        return float((m @ m.T).nnz)
    rows = np.random.default_rng(0).choice(n, sample, replace=False)
    return (m[rows] @ m.T).nnz * n / sample


def torch_csr(m: sps.csr_array) -> torch.Tensor:
    """torch CSR copy of m (int64 indices, torch's default)."""
    return torch.sparse_csr_tensor(torch.from_numpy(m.indptr).long(), torch.from_numpy(m.indices).long(),
                                   torch.from_numpy(m.data), m.shape, check_invariants=False)


def torch_spgemm(at: torch.Tensor):
    """torch A·Aᵀ: CSR @ CSR if torch supports it, else COO @ COO; returns (fn, description)."""
    att = at.t().to_sparse_csr()
    try:
        (at @ att)
        return (lambda: at @ att), "CSR @ CSR"
    except RuntimeError:
        coo, coot = at.to_sparse_coo(), at.to_sparse_coo().t().coalesce()
        return (lambda: coo @ coot), "COO @ COO"


def cases(m: sps.csr_array, quick: bool):
    """Yield dicts: kernel, sparsenn fn, alternatives (name -> fn or skip reason), bytes, reference fn."""
    a, at = sparsenn.from_scipy(m, format="csr"), torch_csr(m)
    rows, cols = m.shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cols, generator=g)
    yield dict(kernel="SpMV", ours=lambda: sparsenn.einsum("ij,j->i", a, x),
               alts={"torch": lambda: at @ x, "scipy": lambda: m @ x.numpy()},
               nbytes=m.nnz * 8 + (rows + 1) * 4 + cols * 4 + rows * 4, ref=lambda: m @ x.numpy())
    for k in (32,) if quick else (32, 128):
        b = torch.randn(cols, k, generator=g)
        yield dict(kernel=f"SpMM k={k}", ours=lambda b=b: sparsenn.einsum("ij,jk->ik", a, b),
                   alts={"torch": lambda b=b: torch.sparse.mm(at, b), "scipy": lambda b=b: m @ b.numpy()},
                   nbytes=m.nnz * 8 + (rows + 1) * 4 + cols * k * 4 + rows * k * 4,
                   ref=lambda b=b: m @ b.numpy())
    p, q = torch.randn(rows, 64, generator=g), torch.randn(cols, 64, generator=g)
    sampled = lambda: torch.sparse.sampled_addmm(at, p, q.T, beta=0.0, alpha=1.0)  # noqa: E731
    alts = {"torch": sampled, "dense-mask": "skipped (n² too large)"}
    if rows * cols * 4 <= (MAX_DENSE_BYTES >> 3 if quick else MAX_DENSE_BYTES):
        dense_a = torch.from_numpy(m.toarray())  # A's values: (X Yᵀ) * A is exactly the SDDMM
        alts["dense-mask"] = lambda: (p @ q.T) * dense_a
    yield dict(kernel="SDDMM k=64", ours=lambda: sparsenn.einsum("ij,ik,jk->ij", a, p, q), alts=alts,
               nbytes=None, ref=lambda: sps.csr_array((sampled().values().numpy() * m.data, m.indices, m.indptr),
                                                      shape=m.shape))
    estimate = spgemm_nnz_estimate(m)
    if estimate > MAX_SPGEMM_NNZ:
        print(f"  SpGEMM skipped: A·Aᵀ would hold ~{estimate:.2g} nonzeros", flush=True)
        return
    fn, how = torch_spgemm(at)
    yield dict(kernel="SpGEMM A·Aᵀ", ours=lambda: sparsenn.einsum("ij,kj->ik", a, a),
               alts={"torch": fn, "scipy": lambda: m @ m.T}, nbytes=None, ref=lambda: m @ m.T,
               note=f"torch {how}")


def as_numpy_or_scipy(out):
    """sparsenn/torch result as a NumPy array or scipy sparse array."""
    if isinstance(out, sparsenn.SparseTensor):
        return out.to_scipy()
    return out.numpy() if isinstance(out, torch.Tensor) else out


def check(out, ref) -> tuple[float, bool]:
    """(max abs difference, within RTOL of the reference's largest magnitude)."""
    out, ref = as_numpy_or_scipy(out), as_numpy_or_scipy(ref)
    if sps.issparse(ref) and not sps.issparse(out):
        ref = ref.toarray()
    diff = abs(out - ref).max() if ref.size else 0.0
    scale = abs(ref).max() if ref.size else 0.0
    return float(diff), bool(diff <= RTOL * max(scale, 1e-30))


def error_text(error: Exception) -> str:
    """Table cell for a call that raised: type and first line of the message."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first_line[:80]}"


def run_case(name: str, m: sps.csr_array, case: dict, threads: list[int]) -> list[dict]:
    """Time one case at every thread count; check sparsenn's result once."""
    base = {"matrix": name, "n": m.shape[0], "nnz": int(m.nnz), "kernel": case["kernel"]}
    if "note" in case:
        base["note"] = case["note"]
    try:
        diff, ok = check(case["ours"](), case["ref"]())
        base.update(max_abs_diff=diff, correct=ok)
    except Exception as error:  # noqa: BLE001 - recorded in the table
        base.update(check=error_text(error), correct=False)
    out = []
    for t in threads:
        torch.set_num_threads(t)
        row = dict(base, threads=t)
        fns = {lib: fn for lib, fn in [("sparsenn", case["ours"]), *case["alts"].items()] if callable(fn)}
        row.update({lib: fn for lib, fn in case["alts"].items() if not callable(fn)})  # skip notes
        # The dense baseline writes n² floats per call, evicting everything: timed on its own.
        alone = {lib: fns.pop(lib) for lib in list(fns) if lib == "dense-mask"}
        for group in (fns, alone):
            row.update({lib: v * 1e3 if isinstance(v, float) else v for lib, v in median_times(group).items()})
        if case["nbytes"] and m.nnz >= 1_000_000 and isinstance(row["sparsenn"], float):
            row["bw_fraction"] = case["nbytes"] / BANDWIDTH[t] / (row["sparsenn"] * 1e-3)
        out.append(row)
        print(f"{name:16s} {m.nnz:>9d} {case['kernel']:12s} t={t} " + "  ".join(
            f"{lib} {fmt_ms(row.get(lib))}" for lib in ("sparsenn", "torch", "scipy", "dense-mask") if lib in row)
            + f"  {fmt_check(row)}", flush=True)
    return out


def ratio(row: dict, lib: str) -> float | None:
    """alternative time / sparsenn time, when both were measured."""
    a, b = row.get(lib), row.get("sparsenn")
    return a / b if isinstance(a, float) and isinstance(b, float) else None


def fmt_ms(v) -> str:
    """Milliseconds to 3 decimals; error and skip messages as they are."""
    return f"{v:.3f}" if isinstance(v, float) else (v or "")


def fmt_check(row: dict) -> str:
    """Outcome of the correctness check of sparsenn's result."""
    if "check" in row:
        return row["check"]
    return "ok" if row["correct"] else f"WRONG (max diff {row['max_abs_diff']:.3g})"


def build_times(reps: int) -> dict[str, dict[str, float]]:
    """Per kernel kind: median first-call ms in a fresh process with an empty cache, and with a warm one."""
    code = ("import time, torch, sparsenn\n"
            "d = torch.rand(500, 500); d[d < 0.95] = 0; a = sparsenn.from_dense(d, format='csr')\n"
            "x = torch.randn(500, 32)\n"
            "ops = {'ij,j->i': (a, x[:, 0]), 'ij,jk->ik': (a, x), 'ij,ik,jk->ij': (a, x, x), 'ij,kj->ik': (a, a)}\n"
            "eq = EQ; t = time.perf_counter(); sparsenn.einsum(eq, *ops[eq]); print(time.perf_counter() - t)\n")
    out = {}
    for kind, eq in KINDS.items():
        cold, warm = [], []
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, SPARSENN_CACHE_DIR=cache)
                run = lambda: 1e3 * float(subprocess.run(  # noqa: E731
                    [sys.executable, "-c", code.replace("EQ", repr(eq))], env=env, capture_output=True, text=True,
                    check=True).stdout)
                try:
                    cold.append(run())
                    warm.append(run())
                except subprocess.CalledProcessError as error:
                    out[kind] = {"error": error.stderr.strip().splitlines()[-1][:120]}
                    break
        else:
            out[kind] = {"first_build_ms": statistics.median(cold), "warm_load_ms": statistics.median(warm)}
        print(f"compile {kind}: {out[kind]}", flush=True)
    return out


SMALL_NNZ = 10_000  # the call-overhead target's "small problems"
LARGE_NNZ = 200_000


def summary(rows: list[dict], threads: list[int]) -> list[str]:
    """Per kernel and thread count: median of each ratio over the matrix set, and torch's
    ratio over the small (call overhead) and large matrices."""
    lines = ["| kernel | threads | matrices | torch/sparsenn | scipy/sparsenn | dense-mask/sparsenn | "
             f"torch/sparsenn, nnz < 10^4: median (worst) | torch/sparsenn, nnz ≥ 2·10^5 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for t in sorted(threads, reverse=True):
            group = [r for r in rows if r["kernel"] == kernel and r["threads"] == t]
            cells = []
            for lib in ("torch", "scipy", "dense-mask"):
                vals = [v for v in (ratio(r, lib) for r in group) if v is not None]
                cells.append(f"{statistics.median(vals):.2f}x ({min(vals):.2f}–{max(vals):.2f})" if vals else "")
            small = [v for r in group if r["nnz"] < SMALL_NNZ and (v := ratio(r, "torch")) is not None]
            large = [v for r in group if r["nnz"] >= LARGE_NNZ and (v := ratio(r, "torch")) is not None]
            cells.append(f"{statistics.median(small):.2f}x ({min(small):.2f})" if small else "")
            cells.append(f"{statistics.median(large):.2f}x" if large else "")
            lines.append(f"| {kernel} | {t} | {len(group)} | " + " | ".join(cells) + " |")
    return lines


def table(rows: list[dict]) -> list[str]:
    """Markdown table of every measured case."""
    lines = ["| matrix | n | nnz | kernel | threads | sparsenn ms | torch ms | scipy ms | dense-mask ms | "
             "torch/sparsenn | scipy/sparsenn | dense-mask/sparsenn | bw fraction | check | note |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ratios = [f"{v:.2f}" if (v := ratio(r, lib)) is not None else "" for lib in ("torch", "scipy", "dense-mask")]
        bw = f"{r['bw_fraction']:.0%}" if "bw_fraction" in r else ""
        lines.append(f"| {r['matrix']} | {r['n']} | {r['nnz']} | {r['kernel']} | {r['threads']} | "
                     + " | ".join(fmt_ms(r.get(lib)) for lib in ("sparsenn", "torch", "scipy", "dense-mask"))
                     + f" | {' | '.join(ratios)} | {bw} | {fmt_check(r)} | {r.get('note', '')} |")
    return lines


def plot(rows: list[dict], threads: int, path: Path) -> None:
    """torch time / sparsenn time against nnz (log-log), one series per kernel."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for kernel, marker in zip(dict.fromkeys(r["kernel"] for r in rows), "osD^vP*"):
        pts = [(r["nnz"], v) for r in rows if r["kernel"] == kernel and r["threads"] == threads
               and (v := ratio(r, "torch")) is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=kernel, alpha=0.8)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="nnz", ylabel="torch time / sparsenn time (> 1: sparsenn faster)",
           title=f"sparsenn speed-up over torch.sparse, {threads} threads, fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: small matrices, one size per kernel, dense n² <= 256 MB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--data", type=Path, help="directory of .mtx files to use instead of the SuiteSparse set")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    head = [f"Machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, torch {info['torch']}, "
            f"scipy {info['scipy']}, numpy {info['numpy']}, sparsenn {info['sparsenn']}; {info['date']}",
            f"Command: python {' '.join(sys.argv)}", f"Note: {info['note']}."]
    print("\n".join(head), flush=True)

    rows = []
    for name, m in matrices(args.data, args.quick):
        for case in cases(m, args.quick):
            rows += run_case(name, m, case, args.threads)
    builds = build_times(reps=1 if args.quick else 3)

    plot_threads = max(args.threads)
    plot(rows, plot_threads, args.out / "speedup_vs_nnz.png")
    lines = [*head, "", "## Summary (median over the matrix set; range in brackets)", "", *summary(rows, args.threads),
             "", "## Compile time (first call in a fresh process)", "",
             "| kernel | expression | first build, empty cache (ms) | warm disk cache (ms) |", "|---|---|---:|---:|"]
    for kind, b in builds.items():
        cells = f"error: {b['error']} |" if "error" in b else f"{b['first_build_ms']:.0f} | {b['warm_load_ms']:.1f}"
        lines.append(f"| {kind} | `{KINDS[kind]}` | {cells} |")
    lines += ["", "## All cases", "", *table(rows)]
    text = "\n".join(lines) + "\n"
    (args.out / "kernels.md").write_text(text)
    (args.out / "kernels.json").write_text(json.dumps({"machine": info, "command": sys.argv, "rows": rows,
                                                       "compile": builds}, indent=1))
    print("\n" + text)


if __name__ == "__main__":
    main()
