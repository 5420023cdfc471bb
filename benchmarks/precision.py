"""Mixed-precision benchmark: SpMM and SparseLinear with bfloat16 and float16 values
(float32 arithmetic in the kernels) against float32.

    python benchmarks/precision.py [--quick] [--threads 1 2] [--out DIR]

1. SpMM ``A @ X``: A N x N CSR with 16 uniformly random entries per row (N = 2^16; 2^14
   with --quick), X N x K for K = 64 and 256, A's values, X and the result all in one
   dtype: sparsenn in float32, bfloat16 and float16, torch.sparse CSR in float32 (and in
   bfloat16 where this torch has the kernel). Also timed in the same rounds: rounding a
   float32 N x K array to bfloat16 (``Tensor.to``), which a 16-bit kernel that
   accumulates in its output pays after it (``compiler/backend/precision.py``).
2. SparseLinear(4096, 4096, sparsity=0.9) at batch 256 and SparseLinear(784, 256,
   sparsity=0.9) at batch 10000 (CSR weights): the layer in float32, the layer converted
   with ``.to(torch.bfloat16)`` (and float16) on an input of that dtype, and the float32
   layer under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (casts included); a dense
   nn.Linear in float32 and under the same autocast. Forward under no_grad, and
   forward+backward (``out.sum().backward()``: gradients of input, weight and bias).

``traffic MB``: what each variant must at least move, every operand read and the result
written once in its dtype (index arrays int32); ``GB/s`` that over the median time.
``fp32 / x``: float32 time over the variant's (> 1: the variant is faster). Medians of
round-robin rounds after warm-up (``structured.median_times``); threads through
torch.set_num_threads, which sparsenn's kernels follow. First build: the first call of
the float32 and the bfloat16 SpMM in a fresh process with an empty SPARSENN_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import torch
from torch import nn

import sparsenn
from structured import error_text, first_build, machine_info, median_times, write_report

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks are implicitly disabled.*")
PER_ROW = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def uniform_csr(n: int, seed: int = 0) -> torch.Tensor:
    """n x n float32 CSR (torch) with PER_ROW random columns per row, values in (0, 1]."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n).repeat_interleave(PER_ROW)
    cols = torch.randint(0, n, (n * PER_ROW,), generator=g)
    values = 1 - torch.rand(n * PER_ROW, generator=g)
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (n, n)).coalesce().to_sparse_csr()


def check(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, terms: int) -> str:
    """'ok' when got is within a few roundings of its dtype (plus float32 summation) of reference."""
    diff = float((got.detach().float() - reference).abs().max())
    scale = float(reference.abs().max())
    bound = (2 * UNIT[dtype] + terms * 2.0**-23) * scale
    return "ok" if diff <= bound else f"WRONG (max diff {diff:.3g}, bound {bound:.3g})"


def spmm_case(n: int, k: int) -> dict:
    """sparsenn A @ X per dtype, torch.sparse, and the rounding of a float32 result."""
    a = uniform_csr(n)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, k, generator=g)
    nnz = a.values().numel()
    variants, traffic, checks = {}, {}, {}
    reference = a @ x
    for name, dtype in DTYPES.items():
        a_ours = sparsenn.from_torch(a).to(dtype)
        x_ours = x.to(dtype)
        variants[f"sparsenn {name}"] = lambda a_ours=a_ours, x_ours=x_ours: sparsenn.einsum("ij,jk->ik", a_ours,
                                                                                            x_ours)
        size = dtype.itemsize
        traffic[f"sparsenn {name}"] = nnz * (4 + size) + (n + 1) * 4 + 2 * n * k * size
        exact = a_ours.to(torch.float32).to_torch() @ x_ours.float()  # the same rounded inputs
        checks[f"sparsenn {name}"] = check(variants[f"sparsenn {name}"](), exact, dtype, PER_ROW)
    variants["torch.sparse float32"] = lambda: a @ x
    traffic["torch.sparse float32"] = traffic["sparsenn float32"]
    try:
        a16, x16 = a.to(torch.bfloat16), x.to(torch.bfloat16)
        checks["torch.sparse bfloat16"] = check(a16 @ x16, reference, torch.bfloat16, PER_ROW)
        variants["torch.sparse bfloat16"] = lambda: a16 @ x16
        traffic["torch.sparse bfloat16"] = traffic["sparsenn bfloat16"]
    except Exception as error:  # noqa: BLE001 - a torch without the kernel: reported, not timed
        checks["torch.sparse bfloat16"] = f"unavailable: {error_text(error)}"
    result32 = torch.randn(n, k, generator=g)
    variants["round a float32 result to bfloat16"] = lambda: result32.to(torch.bfloat16)
    traffic["round a float32 result to bfloat16"] = n * k * 6
    return {"variants": variants, "traffic": traffic, "checks": checks, "base": "sparsenn float32"}


def linear_step(layer: nn.Module, x: torch.Tensor, backward: bool, autocast: torch.dtype | None) -> Callable:
    """One forward (no_grad) or forward+backward of ``layer`` on ``x``, under autocast if given."""
    params = list(layer.parameters())

    def step():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            if not backward:
                with torch.no_grad():
                    return layer(x)
            for p in params:
                p.grad = None
            x.grad = None
            out = layer(x)
        out.float().sum().backward()
        return out

    return step


def linear_case(in_features: int, out_features: int, batch: int, backward: bool) -> dict:
    """SparseLinear in float32, converted to 16 bits, and under autocast; dense nn.Linear."""
    torch.manual_seed(0)
    sparse32 = sparsenn.SparseLinear(in_features, out_features, sparsity=0.9)
    dense32 = nn.Linear(in_features, out_features)
    x = torch.randn(batch, in_features).requires_grad_(backward)
    nnz = sparse32.nnz
    variants, traffic, checks = {}, {}, {}
    for name, layer, dtype, autocast in [
        ("SparseLinear float32", sparse32, torch.float32, None),
        ("SparseLinear bfloat16", copy.deepcopy(sparse32).to(torch.bfloat16), torch.bfloat16, None),
        ("SparseLinear float16", copy.deepcopy(sparse32).to(torch.float16), torch.float16, None),
        ("SparseLinear float32, autocast bfloat16", sparse32, torch.bfloat16, torch.bfloat16),
        ("nn.Linear float32", dense32, torch.float32, None),
        ("nn.Linear float32, autocast bfloat16", dense32, torch.bfloat16, torch.bfloat16),
    ]:
        inputs = x if autocast is not None or dtype == torch.float32 else x.detach().to(dtype).requires_grad_(backward)
        variants[name] = linear_step(layer, inputs, backward, autocast)
        sparse = isinstance(layer, sparsenn.SparseLinear)
        weights = nnz * (4 + dtype.itemsize) if sparse else in_features * out_features * dtype.itemsize
        traffic[name] = (weights + batch * (in_features + out_features) * dtype.itemsize) * (3 if backward else 1)
        checks[name] = "—"
        if sparse:  # against float32 on the same rounded inputs
            rounded = [t.detach().to(dtype).float() for t in (x, sparse32.weight.to_dense(), sparse32.bias)]
            checks[name] = check(variants[name](), nn.functional.linear(*rounded), dtype, in_features // 10)
    return {"variants": variants, "traffic": traffic, "checks": checks, "base": "SparseLinear float32"}


def cases(quick: bool) -> list[tuple[str, Callable[[], dict]]]:
    n = 1 << (14 if quick else 16)
    out = [(f"SpMM {n}x{n} ({PER_ROW}/row) @ {n}x{k}", lambda k=k: spmm_case(n, k)) for k in (64, 256)]
    layers = [(4096, 4096, 256), (784, 256, 10000)] if not quick else [(1024, 1024, 64)]
    for shape in layers:
        for backward in (False, True):
            label = f"SparseLinear {shape[0]}->{shape[1]} b={shape[2]} {'fwd+bwd' if backward else 'fwd'}"
            out.append((label, lambda shape=shape, backward=backward: linear_case(*shape, backward)))
    return out


def run(threads: list[int], quick: bool) -> list[dict]:
    rows = []
    for label, build in cases(quick):
        try:
            case = build()
        except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
            print(f"{label}: unavailable: {error_text(error)}", flush=True)
            rows.append({"case": label, "unavailable": error_text(error)})
            continue
        for t in threads:
            torch.set_num_threads(t)
            seconds = median_times(case["variants"], *((0.2, 5, 3) if quick else (1.5, 40, 9)))
            ms = {name: s * 1e3 for name, s in seconds.items()}
            traffic = {name: size / 1e6 for name, size in case["traffic"].items()}
            row = {"case": label, "threads": t, "ms": ms, "traffic_mb": traffic, "checks": case["checks"],
                   "base": case["base"]}
            rows.append(row)
            print(f"{label} t={t}: " + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = []
    for label in dict.fromkeys(r["case"] for r in rows):
        lines += ["", f"### {label}", ""]
        group = [r for r in rows if r["case"] == label]
        if "unavailable" in group[0]:
            lines.append(f"unavailable: {group[0]['unavailable']}")
            continue
        lines += ["| variant | threads | ms | fp32 / x | traffic MB | GB/s | check |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in group:
            base = r["ms"][r["base"]]
            for name, ms in r["ms"].items():
                mb = r["traffic_mb"].get(name)
                rate = f"{mb / ms:.1f}" if mb else ""
                lines.append(f"| {name} | {r['threads']} | {ms:.3f} | {base / ms:.2f} | {mb:.0f} | {rate} | "
                             f"{r['checks'].get(name, '—')} |")
    return lines


def run_first_build(dtype: str) -> None:
    a = sparsenn.from_torch(uniform_csr(4096)).to(DTYPES[dtype])
    x = torch.randn(4096, 64).to(DTYPES[dtype])
    times = []
    for _ in range(2):
        start = time.perf_counter()
        sparsenn.einsum("ij,jk->ik", a, x)
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"first_ms": times[0], "second_ms": times[1]}))


def markdown(info: dict, rows: list[dict], builds: dict, quick: bool) -> str:
    out = [f"# Mixed-precision benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX2 {'yes' if info['avx2'] else 'no'}, AVX-512 "
           f"{', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; Python {info['python']}, torch {info['torch']}, "
           f"sparsenn {info['sparsenn']} from {info['sparsenn_tree']} at {info['git']}; {info['date']}; "
           f"load average at start {info['loadavg']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           __doc__.split("\n\n", 2)[2].strip(), *table(rows), "",
           "## First build (SpMM 4096x4096 @ 4096x64, fresh process, empty kernel cache)", "",
           "| dtype | first call ms | second call ms |", "|---|---:|---:|"]
    for dtype, b in builds.items():
        out.append(f"| {dtype} | error: {b['error']} | |" if "error" in b
                   else f"| {dtype} | {b['first_ms']:.0f} | {b['second_ms']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, few repetitions")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--first-build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_build:
        return run_first_build(args.first_build)
    info = machine_info()
    print(json.dumps(info), flush=True)
    rows = run(args.threads, args.quick)
    builds = {dtype: first_build(dtype, __file__) for dtype in ("float32", "bfloat16")}
    print(json.dumps(builds), flush=True)
    stem = "precision_quick" if args.quick else "precision"
    write_report(args.out, stem, markdown(info, rows, builds, args.quick),
                 {"machine": info, "command": sys.argv, "quick": args.quick, "rows": rows, "first_build": builds})


if __name__ == "__main__":
    main()
