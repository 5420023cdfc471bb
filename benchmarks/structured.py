"""Structured-sparsity benchmark: block-sparse (BSR) SpMM and SDDMM, and SparseLinear with
block, N:M and unstructured weights, sparsenn against torch and dense, fp32.

    python benchmarks/structured.py [--quick] [--threads 1 2] [--out DIR]

1. BSR SpMM: A 4096x4096 with square blocks of 16, 32 and 64, 90 % of the blocks empty
   (seeded random block mask), times X 4096x256: sparsenn BSR against sparsenn CSR of the
   same pattern, torch BSR and dense torch.mm.
2. Block SDDMM on the same patterns, (Q Kᵀ) sampled on the blocks, Q and K 4096x64:
   sparsenn against torch.sparse.sampled_addmm with the element-wise CSR mask.
3. SparseLinear(4096, 4096, sparsity=0.9, format="bsr(32,32)") at batch 256.
4. SparseLinear(4096, 4096, format="nm(2,4)") and "nm(1,4)" at batch 256.
5. SparseLinear(784, 256, sparsity=0.9) (CSR) at batch 10000.
Layers run forward (under no_grad) and forward+backward (out.sum().backward(), gradients of
input, weight and bias), against a dense nn.Linear of the same shape.

Every alternative of a case runs round-robin in the same rounds (medians after warm-up
rounds); ratio = alternative time / sparsenn time (> 1: sparsenn faster). FLOP rates count
the stored entries (blocks included whole) for sparsenn and the full product for dense
GEMM, timed in the same rounds. Threads are set with torch.set_num_threads, which sparsenn's
kernels read too. A case that fails (e.g. a format this tree lacks) is reported as
unavailable and the others go on. First-build time is the first call in a fresh process
with an empty SPARSENN_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import torch
from torch import nn

import sparsenn

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
warnings.filterwarnings("ignore", message=".*Sparse BSR tensor support is in beta.*")
N = 4096
SPMM_COLS = 256
SDDMM_K = 64
BLOCK_DENSITY = 0.1
RTOL = 1e-3
SECTIONS = {"spmm": "1. BSR SpMM (4096x4096, 90 % of blocks empty) x 4096x256",
            "sddmm": "2. Block SDDMM (Q Kᵀ sampled on the block pattern, k = 64)",
            "bsr-linear": "3. SparseLinear 4096->4096, bsr(32,32), sparsity 0.9, batch 256",
            "nm-linear": "4. SparseLinear 4096->4096, N:M, batch 256",
            "csr-linear": "5. SparseLinear 784->256, CSR, sparsity 0.9, batch 10000"}


# ----------------------------------------------------------------------------------- timing
def median_times(fns: dict[str, Callable[[], object]], min_time: float, max_reps: int,
                 min_reps: int) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin (one call of each per
    round, starting with a different one each round) after 2 warm-up rounds, for at least
    min_reps rounds and until min_time seconds or max_reps rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    rounds, begin = -2, time.perf_counter()
    while rounds < min_reps or (time.perf_counter() - begin < min_time and rounds < max_reps):
        if rounds == 0:
            begin = time.perf_counter()
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            if rounds >= 0:
                times[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: statistics.median(v) for name, v in times.items()}


def error_text(error: BaseException) -> str:
    """Type and first line of an error's message."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:160]}"


def compare(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'ok' when max |got - ref| <= RTOL * max |ref|, else 'WRONG' with the difference."""
    diff, scale = float((got - ref).abs().max()), float(ref.abs().max())
    return "ok" if diff <= RTOL * max(scale, 1e-30) else f"WRONG (max diff {diff:.3g}, max |ref| {scale:.3g})"


# ----------------------------------------------------------------------------------- kernels
def block_pattern(block: int, seed: int = 0) -> torch.Tensor:
    """N x N bool mask made of block x block tiles, BLOCK_DENSITY of them kept at random."""
    tiles = N // block
    g = torch.Generator().manual_seed(seed)
    keep = torch.randperm(tiles * tiles, generator=g)[:round(BLOCK_DENSITY * tiles * tiles)]
    blocks = torch.zeros(tiles * tiles, dtype=torch.bool)
    blocks[keep] = True
    return blocks.view(tiles, tiles).repeat_interleave(block, 0).repeat_interleave(block, 1)


def target(alternative: str, minimum: float) -> dict:
    """Target: alternative time / sparsenn time >= minimum."""
    return {"vs": alternative, "min": minimum}


def rate_target(minimum: float) -> dict:
    """Target: sparsenn GFLOP/s on stored entries >= minimum x the dense GEMM's GFLOP/s."""
    return {"vs": "rate", "min": minimum}


def spmm_case(block: int) -> dict:
    """sparsenn BSR A @ X against sparsenn CSR, torch BSR and dense torch.mm."""
    mask = block_pattern(block)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(N, N, generator=g) * mask
    x = torch.randn(N, SPMM_COLS, generator=g)
    a_bsr = sparsenn.SparseTensor.from_dense(dense, format=f"bsr({block},{block})")
    a_csr = sparsenn.SparseTensor.from_dense(dense, format="csr")
    torch_bsr = dense.to_sparse_bsr((block, block))
    return {"ours": lambda: sparsenn.einsum("ij,jk->ik", a_bsr, x),
            "alts": {"sparsenn CSR": lambda: sparsenn.einsum("ij,jk->ik", a_csr, x),
                     "torch BSR": lambda: torch_bsr @ x, "dense mm": lambda: torch.mm(dense, x)},
            "check": lambda: compare(sparsenn.einsum("ij,jk->ik", a_bsr, x), dense @ x),
            "nnz": a_bsr.nnz, "numel": N * N, "flops": 2.0 * a_bsr.nnz * SPMM_COLS, "dense": ("dense mm", 2.0 * N * N * SPMM_COLS),
            "targets": [target("torch BSR", 2), target("dense mm", 5), target("sparsenn CSR", 2), rate_target(0.6)]}


def sddmm_case(block: int) -> dict:
    """sparsenn (Q Kᵀ) on a BSR mask of ones against torch.sparse.sampled_addmm with the CSR mask."""
    mask = block_pattern(block).float()
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(N, SDDMM_K, generator=g), torch.randn(N, SDDMM_K, generator=g)
    mask_bsr = sparsenn.SparseTensor.from_dense(mask, format=f"bsr({block},{block})")
    mask_csr = mask.to_sparse_csr()
    ours = lambda: sparsenn.einsum("ij,ik,jk->ij", mask_bsr, q, k)  # noqa: E731
    sampled = lambda: torch.sparse.sampled_addmm(mask_csr, q, k.T, beta=0.0)  # noqa: E731

    def check() -> str:
        result = ours()
        return (compare(result.to_dense(), sampled().to_dense())
                + f"; result {getattr(result, 'format', type(result).__name__)}")

    return {"ours": ours, "alts": {"torch sampled_addmm": sampled, "dense Q@Kᵀ": lambda: q @ k.T}, "check": check,
            "nnz": mask_bsr.nnz, "numel": N * N, "flops": 2.0 * mask_bsr.nnz * SDDMM_K, "dense": ("dense Q@Kᵀ", 2.0 * N * N * SDDMM_K),
            "targets": [target("torch sampled_addmm", 3), rate_target(0.5)]}


# ----------------------------------------------------------------------------------- layers
def linear_step(layer: nn.Module, x: torch.Tensor, backward: bool) -> Callable[[], object]:
    """One forward under no_grad, or zero_grad + forward + out.sum().backward()."""
    if not backward:
        def forward() -> torch.Tensor:
            with torch.no_grad():
                return layer(x)
        return forward
    x = x.clone().requires_grad_()

    def forward_backward() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).sum().backward()
    return forward_backward


def linear_case(in_features: int, out_features: int, batch: int, sparsity: float | None, fmt: str,
                backward: bool, minimum: float | None) -> dict:
    """SparseLinear against a dense nn.Linear of the same shape, forward or forward+backward."""
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(in_features, out_features, sparsity=sparsity, format=fmt)
    dense = nn.Linear(in_features, out_features)
    x = torch.randn(batch, in_features)

    def check() -> str:
        with torch.no_grad():
            return compare(layer(x), nn.functional.linear(x, layer.weight.to_dense(), layer.bias))

    return {"ours": linear_step(layer, x, backward), "alts": {"dense nn.Linear": linear_step(dense, x, backward)},
            "check": check, "nnz": layer.nnz, "numel": in_features * out_features,
            "targets": [] if minimum is None else [target("dense nn.Linear", minimum)]}


def layer_specs(section: str, shape: tuple[int, int, int], sparsity: float | None, fmt: str,
                fwd_target: float | None, fwdbwd_target: float | None) -> list[tuple]:
    """(section, case name, builder) for the forward and the forward+backward runs of one layer."""
    out = []
    for backward, minimum in ((False, fwd_target), (True, fwdbwd_target)):
        mode = "fwd+bwd" if backward else "fwd"
        out.append((section, f"{fmt} {shape[0]}->{shape[1]} b={shape[2]} {mode}",
                    lambda backward=backward, minimum=minimum: linear_case(*shape, sparsity, fmt, backward, minimum)))
    return out


def specs(quick: bool) -> list[tuple[str, str, Callable[[], dict]]]:
    """(section, case name, builder) of every case, in report order."""
    blocks = (32,) if quick else (16, 32, 64)
    out = [("spmm", f"bsr({b},{b})", lambda b=b: spmm_case(b)) for b in blocks]
    out += [("sddmm", f"bsr({b},{b})", lambda b=b: sddmm_case(b)) for b in blocks]
    out += layer_specs("bsr-linear", (4096, 4096, 256), 0.9, "bsr(32,32)", None, 4)
    out += layer_specs("nm-linear", (4096, 4096, 256), None, "nm(2,4)", 1.2, None)
    out += layer_specs("nm-linear", (4096, 4096, 256), None, "nm(1,4)", 2, None)
    out += layer_specs("csr-linear", (784, 256, 10000), 0.9, "csr", 2, None)
    return out


# ----------------------------------------------------------------------------------- running
def evaluate(case: dict, ms: dict[str, float]) -> dict:
    """Ratios, FLOP rates and target outcomes of one timed case (times in ms)."""
    ours = ms["sparsenn"]
    row: dict = {"ratios": {alt: ms[alt] / ours for alt in case["alts"]}}
    if "flops" in case:
        dense_name, dense_flops = case["dense"]
        row["gflops"] = case["flops"] / ours * 1e-6
        row["dense_gflops"] = dense_flops / ms[dense_name] * 1e-6
        row["rate_fraction"] = row["gflops"] / row["dense_gflops"]
    row["targets"] = [dict(t, value=(v := row["rate_fraction"] if t["vs"] == "rate" else row["ratios"][t["vs"]]),
                           met=v >= t["min"]) for t in case["targets"]]
    return row


def run_check(check: Callable[[], str]) -> str:
    """The check's outcome, or its error (a failing check does not stop the timing)."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - recorded in the table
        return f"check failed: {error_text(error)}"


def run_case(section: str, name: str, build: Callable[[], dict], threads: list[int], quick: bool) -> list[dict]:
    """Build one case, check sparsenn's result once and time it at every thread count;
    one 'unavailable' row if any step fails."""
    base = {"section": section, "case": name}
    try:
        case = build()
        base.update(nnz=case["nnz"], density=case["nnz"] / case["numel"], check=run_check(case["check"]))
        rows = []
        for t in threads:
            torch.set_num_threads(t)
            fns = {"sparsenn": case["ours"], **case["alts"]}
            secs = median_times(fns, *((0.2, 5, 3) if quick else (1.0, 30, 7)))
            ms = {k: v * 1e3 for k, v in secs.items()}
            rows.append({**base, "threads": torch.get_num_threads(), "ms": ms, **evaluate(case, ms)})
            print(f"{section:10s} {name:36s} t={t} " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
                  + f"  check {base['check']}  {fmt_targets(rows[-1])}", flush=True)
        return rows
    except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
        print(f"{section:10s} {name:36s} unavailable: {error_text(error)}", flush=True)
        return [{**base, "unavailable": error_text(error)}]


def first_build(spec: str, script: str = __file__) -> dict:
    """First and second call (ms) of a case's sparsenn function, run by ``script``'s
    ``--first-build`` in a fresh process with an empty kernel cache."""
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run([sys.executable, script, "--first-build", spec], capture_output=True, text=True,
                              env={**os.environ, "SPARSENN_CACHE_DIR": cache})
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_first_build(spec: str, cases: Callable[..., list] | None = None) -> None:
    """Subprocess side of first_build: print the first/second call times of one case of
    ``cases(quick=False)`` (this script's :func:`specs` by default) as JSON."""
    section, name = spec.split("/", 1)
    build = next(b for s, n, b in (cases or specs)(quick=False) if (s, n) == (section, name))
    ours = build()["ours"]
    times = []
    for _ in range(2):
        start = time.perf_counter()
        ours()
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"first_ms": times[0], "second_ms": times[1], "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------------- report
def fmt_targets(row: dict) -> str:
    """Each target as 'alternative >= min: value yes/no' (rate targets as fractions)."""
    parts = []
    for t in row.get("targets", []):
        if t["vs"] == "rate":
            parts.append(f"rate ≥{t['min']:.0%} of dense: {t['value']:.0%} {'yes' if t['met'] else 'no'}")
        else:
            parts.append(f"{t['vs']} ≥{t['min']:g}x: {t['value']:.2f}x {'yes' if t['met'] else 'no'}")
    return "; ".join(parts)


def git_commit(tree: Path) -> str:
    """`git describe --always --dirty` of the tree sparsenn was imported from."""
    done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def pin_heap_allocator() -> str:
    """Fix glibc's mmap and trim thresholds (1 GiB, 2 GiB) for this process, so that every
    implementation's large temporaries come from the heap at every call, as with the
    jemalloc/tcmalloc that PyTorch's CPU tuning guide recommends. By default glibc serves
    blocks above a dynamic threshold (up to 32 MiB) by fresh ``mmap`` s whose pages fault
    in on every call, and raises that threshold after such a block is freed, so a call's
    time depends on what ran before it. Returns what was done, for the report."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        pinned = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    except (OSError, AttributeError):
        pinned = False
    return ("glibc mmap threshold fixed at 1 GiB (blocks below it come from the heap)" if pinned
            else "default allocator (mallopt unavailable)")


def machine_info() -> dict:
    """CPU model, vector extensions, L2 size, core count, versions, commit, date and load."""
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read().splitlines()
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith(key)), "")  # noqa: E731
    flags = field("flags").split()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    l2 = next((ln.split(":", 1)[1].strip() for ln in lscpu if ln.startswith("L2")), "unknown")
    tree = Path(sparsenn.__file__).resolve().parents[1]
    return {"cpu": field("model name") or platform.processor(), "cores": os.cpu_count(),
            "avx2": "avx2" in flags, "avx512": sorted(f for f in flags if f.startswith("avx512")), "l2": l2,
            "python": platform.python_version(), "torch": torch.__version__, "sparsenn": sparsenn.__version__,
            "sparsenn_tree": str(tree), "git": git_commit(tree), "date": time.strftime("%Y-%m-%d %H:%M"),
            "loadavg": [round(v, 2) for v in os.getloadavg()]}


def sections_markdown(rows: list[dict], sections: dict[str, str]) -> list[str]:
    """A heading and :func:`section_table` per section (key: title) that has rows."""
    out = []
    for section, title in sections.items():
        rows_of = [r for r in rows if r["section"] == section]
        if rows_of:
            out += ["", f"## {title}", "", *section_table(rows_of)]
    return out


def section_table(rows: list[dict]) -> list[str]:
    """Markdown table of one section: times, ratios, FLOP rates (kernels) and targets."""
    alts = list(dict.fromkeys(a for r in rows for a in r.get("ms", {}) if a != "sparsenn"))
    rates = any("gflops" in r for r in rows)
    head = (["case", "threads", "density", "sparsenn ms"] + [f"{a} ms" for a in alts] + [f"{a} / sparsenn" for a in alts]
            + (["sparsenn GFLOP/s", "dense GFLOP/s", "fraction of dense rate"] if rates else [])
            + ["target", "met", "check"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 4) + "---|---|---|"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['case']} | | | unavailable: {r['unavailable']} |" + " |" * (len(head) - 4))
            continue
        cells = [r["case"], str(r["threads"]), f"{r['density']:.3f}", f"{r['ms']['sparsenn']:.3f}"]
        cells += [f"{r['ms'][a]:.3f}" if a in r["ms"] else "" for a in alts]
        cells += [f"{r['ratios'][a]:.2f}" if a in r["ratios"] else "" for a in alts]
        if rates:
            cells += [f"{r['gflops']:.1f}", f"{r['dense_gflops']:.1f}", f"{r['rate_fraction']:.0%}"]
        met = [t["met"] for t in r["targets"]]
        cells += [fmt_targets(r) or "—", ("yes" if all(met) else "no") if met else "—", r["check"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(info: dict, rows: list[dict], builds: dict, quick: bool) -> str:
    """The whole report: machine, one table per section, first-build times."""
    out = [f"# Structured-sparsity benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX2 {'yes' if info['avx2'] else 'no'}, AVX-512 "
           f"{', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; Python {info['python']}, torch {info['torch']}, "
           f"sparsenn {info['sparsenn']} from {info['sparsenn_tree']} at {info['git']}; {info['date']}; "
           f"load average at start {info['loadavg']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           "fp32. Medians of round-robin rounds after warm-up; ratio = alternative time / sparsenn time "
           "(> 1: sparsenn faster). Threads via torch.set_num_threads (sparsenn's kernels use "
           "torch.get_num_threads()). GFLOP/s: sparsenn counts stored entries (2·nnz·cols, whole blocks), "
           "dense GEMM the full product, both from the same rounds. Layers: fwd under no_grad; fwd+bwd = "
           "zero_grad, forward, out.sum().backward() (gradients of input, weight and bias). "
           f"check: sparsenn's result against torch, max |diff| <= {RTOL:g} x max |ref|."]
    out += sections_markdown(rows, SECTIONS)
    return "\n".join(out + first_build_table(builds)) + "\n"


def first_build_table(builds: dict[str, dict]) -> list[str]:
    """The report's first-build section: per case, threads and first/second call ms."""
    out = ["", "## First build (first call in a fresh process, empty SPARSENN_CACHE_DIR)", "",
           "| case | threads | first call ms | second call ms |", "|---|---:|---:|---:|"]
    for spec, b in builds.items():
        cells = (f"| error: {b['error']} | " if "error" in b
                 else f"{b['threads']:.0f} | {b['first_ms']:.0f} | {b['second_ms']:.2f}")
        out.append(f"| {spec} | {cells} |")
    return out


BUILD_SPECS = ["spmm/bsr(32,32)", "sddmm/bsr(32,32)", "bsr-linear/bsr(32,32) 4096->4096 b=256 fwd+bwd",
               "nm-linear/nm(2,4) 4096->4096 b=256 fwd+bwd", "nm-linear/nm(1,4) 4096->4096 b=256 fwd+bwd",
               "csr-linear/csr 784->256 b=10000 fwd+bwd"]


def build_times(reps: int) -> dict[str, dict]:
    """Median first/second call ms of each BUILD_SPECS case over reps fresh processes."""
    out = {}
    for spec in BUILD_SPECS:
        runs = [first_build(spec) for _ in range(reps)]
        errors = [r for r in runs if "error" in r]
        out[spec] = errors[0] if errors else {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"first build {spec}: {out[spec]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: block size 32 only, few repetitions")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "structured")
    parser.add_argument("--first-build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_build:
        return run_first_build(args.first_build)
    info = machine_info()
    print(json.dumps(info), flush=True)
    rows = [row for section, name, build in specs(args.quick)
            for row in run_case(section, name, build, args.threads, args.quick)]
    builds = build_times(reps=1 if args.quick else 3)
    stem = "structured_quick" if args.quick else "structured"
    write_report(args.out, stem, markdown(info, rows, builds, args.quick),
                 {"machine": info, "command": sys.argv, "quick": args.quick, "rows": rows, "first_build": builds})


def write_report(out: Path, stem: str, text: str, raw: dict) -> None:
    """``out/stem.md`` (the report) and ``out/stem.json`` (its raw data)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(raw, indent=1))
    print(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
