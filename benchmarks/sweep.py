"""Sweep that maps where sparsenn wins and where it loses (issue 33, part 1).

    python benchmarks/sweep.py [--quick] [--suitesparse-dir DIR] [grid flags]
    python benchmarks/sweep.py --plot benchmarks/results/sweep/<machine>.json

Three sections, each against the alternatives a user would otherwise run:

* linear: ``SparseLinear`` (csr, random pattern, bias) forward and forward+backward over
  shapes (in x out) x sparsity x batch x dtype x threads, against dense ``F.linear`` on the
  densified weight and torch.sparse CSR. The torch.sparse forward is the faster of
  ``torch.sparse.addmm(b, W, x.T).T`` and ``F.linear(x, W_csr, b)`` (probed per cell);
  its forward+backward is ``addmm`` with the CSR weight requiring grad (its gradient stays
  on the pattern; ``F.linear``'s is a dense matrix). torch.sparse CSR has no bfloat16
  kernel: those cells hold null. Forward+backward is ``out.backward(g)`` for a fixed ``g``,
  with gradients of the input, the weight and the bias, all set to None before each call.
  Forward runs under ``no_grad``.
* spmm: ``sparsenn.einsum("ij,jk->ik", A, X)`` with A a csr SparseTensor against
  ``torch.sparse.mm`` with the same CSR arrays, for 1 to 256 dense columns: the
  GCN-normalised adjacency of Cora and CiteSeer and every ``*.mtx`` of ``--suitesparse-dir``
  (none given: those rows are skipped).
* models: the reference GCN (Cora, CiteSeer) and the sparse autoencoder (MNIST), with their
  initial weights, timed by the main job's bench protocol (``models.bench.run_bench``).

Timing: every alternative of a cell runs round-robin in the same rounds (so background load
hits all alike), after an untimed warm-up call of each, until the cell's timed calls add up
to ``--budget`` seconds (at least 3 rounds, at most ``--repeats``); medians. ``build_s`` is
the cell's first sparsenn call (before its warm-up call), never in the medians: the run
starts with an empty kernel cache, so it includes building the kernels no earlier cell
built. The load average is recorded at the start and the end.

The default grid is the full one: 7 shapes x 6 sparsities x 6 batches x fp32, bf16 x 1, 2
threads x 2 passes (2016 cells), 14 graphs x 8 column counts x 2 threads, 3 models x 2
threads: 17 to 26 minutes on the 2-core EPYC, at load averages of 1.4-4.4 and 2.4-7.8 from
other runs (which also make the 2-thread cells noisy: re-run ``--threads 2`` on a quiet
machine before trusting them). ``--skip-backward bfloat16:2`` drops 252 cells if a run must
be shorter. ``--quick`` is a smoke run of a few cells (about 20 s).
Writes ``<out>/<machine>.json`` (``<machine>-quick.json`` for ``--quick``) and the heat maps
(:mod:`sweep_plot`), then prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout import ROOT  # noqa: E402  (first: this tree's sparsenn on sys.path)
import sparsenn  # noqa: E402
from structured import machine_info  # noqa: E402
from sweep_plot import summary, write_heatmaps  # noqa: E402

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")

FULL = {"shapes": ["1024x1024", "4096x4096", "1024x4096", "4096x1024", "3703x128", "128x7", "784x256"],
        "sparsities": [0.5, 0.7, 0.8, 0.9, 0.95, 0.99], "batches": [1, 2, 7, 8, 64, 512],
        "dtypes": ["float32", "bfloat16"], "threads": [1, 2], "passes": ["forward", "forward+backward"],
        "columns": [1, 2, 4, 7, 16, 64, 128, 256], "models": ["gcn_cora", "gcn_citeseer", "autoencoder_mnist"],
        "repeats": 100, "budget": 0.2}
QUICK = {"shapes": ["1024x1024", "128x7"], "sparsities": [0.5, 0.9, 0.99], "batches": [1, 8, 64],
         "dtypes": ["float32", "bfloat16"], "threads": [1], "passes": ["forward", "forward+backward"],
         "columns": [1, 16, 128], "models": ["gcn_cora"], "repeats": 10, "budget": 0.02}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PASSES = ("forward", "forward+backward")
PLANETOID = ("Cora", "CiteSeer")
MODELS = {"gcn_cora": ("configs/gcn_cora.yaml", ()),
          "gcn_citeseer": ("configs/gcn_citeseer.yaml", ()),
          # a fixed random 90 % pattern from the start (dense_epochs 1 would leave the untrained encoder dense)
          "autoencoder_mnist": ("configs/autoencoder_mnist.yaml", ("--model.init_args.dense_epochs=0",))}
MODEL_VARIANTS = {"sparsenn_ms": "sparsenn", "dense_ms": "dense", "torch_sparse_ms": "torch.sparse",
                  "pyg_ms": "PyG GCNConv"}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to max |output|


# ----------------------------------------------------------------------------------- timing
def round_robin_ms(calls: dict[str, Callable[[], object]], budget: float, max_repeats: int) -> dict[str, float]:
    """Median ms of each (already warmed-up) call, in rounds of one call each until the timed
    calls add up to ``budget`` s (at least 3 rounds unless ``max_repeats`` is lower)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    spent, rounds = 0.0, 0
    while rounds < max_repeats and (rounds < 3 or spent < budget):
        for name, call in calls.items():
            elapsed = seconds(call)
            samples[name].append(elapsed * 1e3)
            spent += elapsed
        rounds += 1
    return {name: statistics.median(times) for name, times in samples.items()}


def seconds(call: Callable[[], object]) -> float:
    """Wall time of one call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def probe(call: Callable[[], object]) -> float:
    """Wall time of one call, inf when torch has no kernel for it (torch.sparse in bfloat16)."""
    try:
        return seconds(call)
    except (RuntimeError, NotImplementedError):
        return math.inf


# ----------------------------------------------------------------------------------- linear
def parse_shape(text: str) -> tuple[int, int]:
    """``"1024x4096"`` -> (in_features, out_features)."""
    try:
        in_features, out_features = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be INxOUT, e.g. 1024x4096, got {text!r}") from None
    return in_features, out_features


def forward_calls(layer: sparsenn.SparseLinear, weight: torch.Tensor, csr: torch.Tensor,
                  x: torch.Tensor) -> dict[str, Callable[[], object] | None]:
    """sparsenn, dense and the faster torch.sparse form (None if unsupported), for ``no_grad``;
    the torch.sparse forms are called once here."""
    bias = layer.bias.detach()
    forms = (lambda: torch.sparse.addmm(bias[:, None], csr, x.T).T, lambda: F.linear(x, csr, bias))
    time_s, _, fastest = min((probe(form), index, form) for index, form in enumerate(forms))
    return {"sparsenn": lambda: layer(x), "dense": lambda: F.linear(x, weight, bias),
            "torch.sparse": fastest if time_s < math.inf else None}


def backward_step(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor],
                  grad: torch.Tensor) -> Callable[[], None]:
    """One forward+backward call: the leaves' gradients cleared, then ``forward().backward(grad)``."""
    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad)
    return step


def backward_calls(layer: sparsenn.SparseLinear, weight: torch.Tensor, csr: torch.Tensor,
                   x: torch.Tensor) -> dict[str, Callable[[], object] | None]:
    """sparsenn, dense and torch.sparse forward+backward steps (torch.sparse None if
    unsupported); the torch.sparse step is called once here."""
    grad = torch.randn(x.shape[0], layer.out_features).to(x.dtype)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    xs, xd, xt = leaf(x), leaf(x), leaf(x)
    wd, bd, wt, bt = leaf(weight), leaf(layer.bias), leaf(csr), leaf(layer.bias)
    ours = backward_step(lambda: layer(xs), [xs, layer.weight_values, layer.bias], grad)
    dense = backward_step(lambda: F.linear(xd, wd, bd), [xd, wd, bd], grad)
    torch_sparse = backward_step(lambda: torch.sparse.addmm(bt[:, None], wt, xt.T).T, [xt, wt, bt], grad)
    return {"sparsenn": ours, "dense": dense, "torch.sparse": torch_sparse if probe(torch_sparse) < math.inf else None}


def linear_cell(layer: sparsenn.SparseLinear, weight: torch.Tensor, csr: torch.Tensor, batch: int, pass_: str,
                budget: float, max_repeats: int) -> dict:
    """One cell's times (the caller sets the threads and adds the cell's identity): the first
    sparsenn call is ``build_s``, then one warm-up call of sparsenn and dense (whose forward
    outputs are compared), then the rounds."""
    x = torch.randn(batch, layer.in_features).to(layer.weight_values.dtype)
    forward = pass_ == "forward"
    with torch.no_grad() if forward else contextlib.nullcontext():
        calls = (forward_calls if forward else backward_calls)(layer, weight, csr, x)
        build_s = seconds(calls["sparsenn"])
        outputs = calls["sparsenn"](), calls["dense"]()
        if forward:
            check_output(*outputs)
        ms = round_robin_ms({k: c for k, c in calls.items() if c is not None}, budget, max_repeats)
    return {"sparsenn_ms": ms["sparsenn"], "dense_ms": ms["dense"], "torch_sparse_ms": ms.get("torch.sparse"),
            "build_s": build_s}


def check_output(ours: torch.Tensor, dense: torch.Tensor) -> None:
    """Warn when sparsenn's output is off dense's by more than the dtype's tolerance."""
    scale = float(dense.abs().max()) if dense.numel() else 0.0
    error = float((ours.float() - dense.float()).abs().max()) if dense.numel() else 0.0
    if error > TOLERANCE[dense.dtype] * max(scale, 1e-30):
        print(f"  WARNING: sparsenn's output differs from dense's by {error:.3g} (max |out| {scale:.3g})", flush=True)


def linear_cells(args: argparse.Namespace) -> Iterator[dict]:
    """Every cell of the linear grid, as it is measured."""
    for shape in args.shapes:
        in_features, out_features = parse_shape(shape)
        for sparsity in args.sparsities:
            torch.manual_seed(0)
            base = sparsenn.SparseLinear(in_features, out_features, sparsity=sparsity)
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                layer = copy.deepcopy(base).to(dtype)
                weight = layer.to_dense().weight.detach()
                csr = weight.to_sparse_csr()
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for batch in args.batches:
                        for pass_ in args.passes:
                            if pass_ != "forward" and dtype_name in args.skip_backward.get(threads, ()):
                                continue
                            cell = {"shape": shape, "sparsity": sparsity, "batch": batch, "dtype": dtype_name,
                                    "threads": threads, "pass": pass_}
                            cell |= linear_cell(layer, weight, csr, batch, pass_, args.budget, args.repeats)
                            print(cell_line(cell), flush=True)
                            yield cell


def cell_line(cell: dict) -> str:
    """One progress line: the cell, its times and sparsenn's ratio to the faster alternative."""
    alternatives = [t for t in (cell["dense_ms"], cell["torch_sparse_ms"]) if t is not None]
    sparse = "-" if cell["torch_sparse_ms"] is None else f"{cell['torch_sparse_ms']:.4g}"
    return (f"{cell['shape']:>9} s={cell['sparsity']:<4} b={cell['batch']:<3} {cell['dtype']:<8} "
            f"t={cell['threads']} {cell['pass']:<16} sparsenn {cell['sparsenn_ms']:.4g} ms, dense "
            f"{cell['dense_ms']:.4g}, torch.sparse {sparse}, build {cell['build_s']:.2f} s: "
            f"{min(alternatives) / cell['sparsenn_ms']:.2f}x")


# ------------------------------------------------------------------------------------ spmm
def planetoid_adjacency(name: str) -> sparsenn.SparseTensor:
    """The GCN-normalised adjacency (self-loops added) of a shipped Planetoid graph, csr."""
    from models.planetoid import load_planetoid
    from sparsenn.layers.gcn import gcn_norm

    graph = load_planetoid(name)
    edge_index, weight = gcn_norm(graph.edge_index, None, graph.num_nodes)
    return sparsenn.from_coo(edge_index.flip(0), weight, (graph.num_nodes, graph.num_nodes), "csr")


def graphs(names: list[str] | None, suitesparse_dir: Path | None) -> Iterator[tuple[str, sparsenn.SparseTensor]]:
    """(name, csr matrix) of Cora, CiteSeer and each ``*.mtx`` in ``suitesparse_dir``
    (by nnz), restricted to ``names`` when given."""
    import scipy.io

    files = {} if suitesparse_dir is None else {p.stem: p for p in sorted(suitesparse_dir.glob("*.mtx"))}
    unknown = set(names or ()) - set(PLANETOID) - set(files)
    if unknown:
        raise SystemExit(f"unknown graph(s) {sorted(unknown)}: Cora, CiteSeer or a .mtx stem of --suitesparse-dir")
    matrices = [(name, planetoid_adjacency(name)) for name in PLANETOID if names is None or name in names]
    suite = [(stem, sparsenn.from_scipy(scipy.io.mmread(path).tocsr().astype("float32"), format="csr"))
             for stem, path in files.items() if names is None or stem in names]
    yield from matrices + sorted(suite, key=lambda item: item[1].nnz)


def spmm_rows(args: argparse.Namespace) -> Iterator[dict]:
    """sparsenn against torch.sparse.mm per graph, column count and thread count."""
    if args.suitesparse_dir is None:
        print("spmm: no --suitesparse-dir: the SuiteSparse rows are skipped", flush=True)
    for name, matrix in graphs(args.graphs, args.suitesparse_dir):
        csr = matrix.to_torch(torch.sparse_csr)
        for columns in args.columns:
            x = torch.randn(matrix.shape[1], columns)
            calls = {"sparsenn": lambda: sparsenn.einsum("ij,jk->ik", matrix, x),
                     "torch.sparse": lambda: torch.sparse.mm(csr, x)}
            for threads in args.threads:
                torch.set_num_threads(threads)
                with torch.no_grad():
                    for call in calls.values():
                        call()
                    ms = round_robin_ms(calls, args.budget, args.repeats)
                row = {"graph": name, "rows": matrix.shape[0], "nnz": matrix.nnz, "columns": columns,
                       "threads": threads, "sparsenn_ms": ms["sparsenn"], "torch_sparse_ms": ms["torch.sparse"]}
                print(f"spmm {name:>16} k={columns:<3} t={threads}: sparsenn {ms['sparsenn']:.4g} ms, torch.sparse "
                      f"{ms['torch.sparse']:.4g} ms: {ms['torch.sparse'] / ms['sparsenn']:.2f}x", flush=True)
                yield row


# ----------------------------------------------------------------------------------- models
def model_rows(args: argparse.Namespace) -> Iterator[dict]:
    """Each reference model's variants timed by the main job's bench protocol (untrained weights)."""
    from models.bench import BenchSettings, format_table, run_bench
    from sparsenn.cli import SparsennCLI

    settings = BenchSettings(tuple(args.threads), warmup=min(10, args.repeats), repeats=min(50, args.repeats),
                             first_call=False)
    for name in args.models:
        config, overrides = MODELS[name]
        with tempfile.TemporaryDirectory(prefix="sparsenn-sweep-") as root:
            cli = SparsennCLI(["--config", str(ROOT / config), f"--trainer.default_root_dir={root}", *overrides],
                              run=False)
            cli.datamodule.prepare_data()
            cli.datamodule.setup("test")
            result = run_bench(cli.model, cli.datamodule, settings, name)
        print(format_table(result), flush=True)
        times = {variant.name: variant.median_ms for variant in result.variants}
        for threads in settings.threads:
            yield {"model": name, "threads": threads} | {
                key: times[variant][threads] if variant in times else None for key, variant in MODEL_VARIANTS.items()}


# ------------------------------------------------------------------------------------ run
def cpu_summary() -> dict:
    """CPU model, core count, the vector extensions that matter here and the L2 size."""
    info = machine_info()
    return {"model": info["cpu"], "cores": info["cores"], "avx2": info["avx2"],
            "avx512f": "avx512f" in info["avx512"], "avx512_bf16": "avx512_bf16" in info["avx512"], "l2": info["l2"]}


def commit() -> str:
    """The worktree's short commit hash, ``-dirty`` when tracked files changed."""
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                  else "")


def default_machine() -> str:
    """A short tag from the CPU model, e.g. ``amd-epyc``."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1] for line in f if line.startswith("model name")), "unknown")
    words = "".join(c if c.isalnum() else " " for c in model.lower()).split()
    return "-".join(w for w in words if w not in ("processor", "cpu", "core", "tm", "r"))[:24] or "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a few cells of each section")
    parser.add_argument("--shapes", nargs="+", help="INxOUT, e.g. 1024x4096")
    parser.add_argument("--sparsities", nargs="+", type=float)
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES))
    parser.add_argument("--threads", nargs="+", type=int)
    parser.add_argument("--passes", nargs="+", choices=PASSES)
    parser.add_argument("--repeats", type=int, help="most timed rounds per cell (default 100; quick 10)")
    parser.add_argument("--budget", type=float, help="seconds of timed calls per cell (default 0.2; quick 0.02)")
    parser.add_argument("--skip-backward", nargs="*", default=[], metavar="DTYPE:THREADS",
                        help="forward+backward cells to leave out, e.g. bfloat16:2")
    parser.add_argument("--sections", nargs="+", choices=("linear", "spmm", "models"),
                        default=["linear", "spmm", "models"])
    parser.add_argument("--graphs", nargs="+", help="Cora, CiteSeer, .mtx stems (default: all)")
    parser.add_argument("--columns", nargs="+", type=int, help="dense columns of the SpMM")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--suitesparse-dir", type=Path, help="folder of SuiteSparse .mtx files (default: none)")
    parser.add_argument("--machine", default=default_machine(), help="short machine tag naming the JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sweep")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only redraw the heat maps of a sweep's JSON "
                        "and print its summary")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for shape in args.shapes:
        parse_shape(shape)
    if args.repeats < 1 or args.budget < 0 or min(args.threads) < 1 or min(args.batches) < 1:
        parser.error("--repeats, --threads and --batches must be >= 1 and --budget >= 0")
    if args.suitesparse_dir is not None and not args.suitesparse_dir.is_dir():
        parser.error(f"--suitesparse-dir {args.suitesparse_dir} is not a folder")
    skip: dict = {}
    for item in args.skip_backward:
        dtype, _, threads = item.partition(":")
        if dtype not in DTYPES or not threads.isdigit():
            parser.error(f"--skip-backward takes DTYPE:THREADS, e.g. bfloat16:2, got {item!r}")
        skip.setdefault(int(threads), set()).add(dtype)
    args.skip_backward = skip
    return args


def dumps(data: dict) -> str:
    """The sweep's JSON, one list item (cell, spmm or model row) a line, times to 4 digits."""
    rounded = lambda v: float(f"{v:.4g}") if isinstance(v, float) else v  # noqa: E731
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps({k: rounded(v) for k, v in item.items()}) for item in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]" if value else f" {json.dumps(key)}: []")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def run(args: argparse.Namespace) -> Path:
    """Measure the sections, writing the JSON after each group of cells; return its path."""
    path = args.out / f"{args.machine}{'-quick' if args.quick else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"machine": args.machine, "cpu": cpu_summary(), "torch": torch.__version__, "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "command": shlex.join(["python", *sys.argv]), "loadavg": {"start": list(os.getloadavg()), "end": None},
            "cells": [], "spmm": [], "models": []}
    print(json.dumps({k: data[k] for k in ("machine", "cpu", "torch", "commit", "loadavg")}), flush=True)
    sections = {"linear": ("cells", linear_cells), "spmm": ("spmm", spmm_rows), "models": ("models", model_rows)}
    threads_before = torch.get_num_threads()
    try:
        for section in args.sections:
            key, rows = sections[section]
            for row in rows(args):
                data[key].append(row)
                if len(data[key]) % 50 == 0:
                    path.write_text(dumps(data))
    finally:
        torch.set_num_threads(threads_before)
        data["loadavg"]["end"] = list(os.getloadavg())
        path.write_text(dumps(data))
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot is not None:
        path = args.plot
    else:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="sparsenn-sweep-cache-") as cache:
            os.environ["SPARSENN_CACHE_DIR"] = cache  # an empty kernel cache: build_s includes the builds
            path = run(args)
        print(f"\nsweep done in {(time.perf_counter() - start) / 60:.1f} min: wrote {path}", flush=True)
    data = json.loads(path.read_text())
    for figure in write_heatmaps(data, path.parent, "heatmap-quick" if path.stem.endswith("-quick") else "heatmap"):
        print(f"wrote {figure}")
    print(summary(data))


if __name__ == "__main__":
    main()
