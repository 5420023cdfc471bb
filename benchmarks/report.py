"""Generate the result tables of BENCHMARKS.md from the raw results in benchmarks/results.

    python benchmarks/report.py            # rewrite BENCHMARKS.md's generated sections
    python benchmarks/report.py --check    # exit 1 if they differ from what the results give

A generated section sits between ``<!-- table:NAME -->`` and ``<!-- /table -->``; the text
around it is written by hand. :data:`SOURCES` names, per benchmark, the files its runs
write; a section shows the most recent of them (by recorded date; a full run before a
``--quick`` one), with its machine, torch version, commit and the command that reproduces it.

Each script's own JSON format is read as it is. New writers (``benchmarks/overhead.py``)
and results transcribed from an older BENCHMARKS.md use one common schema::

    {"benchmark": "overhead", "cpu": "AMD EPYC", "machine": "2 cores, L2 1 MiB",
     "torch": "2.13.0+cpu", "commit": "752d473", "date": "2026-11-23 06:24",
     "command": "python benchmarks/overhead.py",
     "columns": ["matrix (nnz)", "kernel", "sparsenn µs", "torch µs"],
     "rows": [["karate (156)", "SpMV", 7.5, 4.6], ...],
     optional: "load": 0.9, "quick": false, "note": "where the numbers came from",
               "notes": ["a sentence after the provenance, such as first-build times", ...]}

The sweep section reads ``sweep/*.json`` (schema in :func:`sweep_section`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "BENCHMARKS.md"
REFERENCE_CPU = "AMD EPYC"  # the machine of the latest runs; results from another CPU are flagged
MARKER = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
NUMERIC = re.compile(r"[-+]?[\d.]+x?( / [-+]?[\d.]+x?)*")


@dataclass
class Run:
    """One recorded run, ready to render: where it came from and one table."""

    path: Path
    cpu: str = ""
    machine: str = ""
    torch: str = ""
    commit: str = ""
    date: str = ""
    command: str = ""
    load: float | None = None
    quick: bool = False
    note: str = ""
    columns: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------- cells
def number(value: float) -> str:
    """Three significant digits; whole numbers from 100 on."""
    for decimals, limit in ((0, 99.95), (1, 9.995), (2, 0.9995)):
        if abs(value) >= limit:
            return f"{value:.{decimals}f}"
    return f"{value:#.3g}"


def cell(value: object) -> str:
    """A table cell: numbers as :func:`number`, None empty, '|' escaped."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return number(value)
    return str(value).replace("|", "\\|")


def plural(count: int, noun: str) -> str:
    """'1 thread', '2 threads'."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def joined(values: list) -> str:
    """Values of one quantity at several thread counts, as 'a / b'."""
    return " / ".join(cell(v) for v in values)


def markdown_table(columns: list[str], rows: list[list]) -> list[str]:
    """A markdown table; columns whose cells are all numbers (or 'a / b' of numbers) align right."""
    cells = [[cell(v) for v in row] + [""] * (len(columns) - len(row)) for row in rows]
    right = [any(r[i] for r in cells) and all(NUMERIC.fullmatch(r[i]) for r in cells if r[i])
             for i in range(len(columns))]
    return (["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
            + ["| " + " | ".join(r) + " |" for r in cells])


# ----------------------------------------------------------------------------------- provenance
def command_line(argv: list[str] | None, script: str, quick: bool) -> str:
    """The command a run was made with, as run from the repository root; an ``--out`` outside
    benchmarks/results is dropped (the default writes where this report reads)."""
    if not argv:
        return f"python benchmarks/{script}.py" + (" --quick" if quick else "")
    args, rest = [], list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "--out" and rest and not rest[0].startswith("benchmarks/results"):
            rest.pop(0)
            continue
        args.append(arg)
    return " ".join(["python", f"benchmarks/{Path(argv[0]).name}", *args])


def scripted_run(data: dict, path: Path, script: str) -> Run:
    """Provenance of a run written by one of the benchmark scripts (their machine records differ)."""
    info = data.get("machine", {})
    parts = [f"{info['cores']} cores" if "cores" in info else "", "AVX-512" if info.get("avx512") else "",
             f"L2 {info['l2']}" if "l2" in info else ""]
    load = info.get("loadavg") or info.get("loadavg_start")
    quick = bool(data.get("quick", "quick" in path.stem or "--quick" in (data.get("command") or [])))
    return Run(path=path, cpu=info.get("cpu", ""), machine=", ".join(p for p in parts if p),
               torch=info.get("torch", ""), commit=info.get("git") or info.get("git_start", ""),
               date=info.get("date", ""), command=command_line(data.get("command"), script, quick),
               load=load[0] if load else None, quick=quick)


def provenance(run: Run) -> str:
    """One line: date, commit, machine, versions, load, command and raw file of a run."""
    when = " ".join(p for p in [run.date, f"at `{run.commit}`" if run.commit else "(commit not recorded)"] if p)
    machine = (run.cpu or "a CPU not recorded") + (f" ({run.machine})" if run.machine else "")
    load = f", load average {run.load:.1f} at the start" if run.load is not None else ""
    line = f"Run {when} on {machine}, torch {run.torch or 'not recorded'}{load}."
    if run.cpu and REFERENCE_CPU not in run.cpu:
        line += f" **Not the {REFERENCE_CPU} of the latest runs: not re-run there yet.**"
    if run.quick:
        line += " A `--quick` run (fewer rounds and cases)."
    if run.note:
        line += f" {run.note}"
    raw = run.path.relative_to(ROOT) if run.path.is_relative_to(ROOT) else run.path
    return line + f" Command: `{run.command}`. Raw: `{raw.as_posix()}`."


def first_build_note(builds: dict) -> str:
    """The first call(s) in a fresh process with an empty kernel cache, as one line."""
    if "first_ms" in builds or "error" in builds:
        builds = {"": builds}
    parts = [(f"{name}: " if name else "") + (f"error {b['error']}" if "error" in b else
                                              f"{b['first_ms'] / 1e3:.1f} s (second call {cell(b['second_ms'])} ms)")
             for name, b in builds.items()]
    return "First call in a fresh process with an empty kernel cache: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------------- readers
def read_common(data: dict, path: Path) -> Run:
    """A run in the common schema (module doc)."""
    return Run(path=path, cpu=data.get("cpu", ""), machine=data.get("machine", ""), torch=data.get("torch", ""),
               commit=data.get("commit", ""), date=data.get("date", ""), command=data.get("command", ""),
               load=data.get("load"), quick=bool(data.get("quick", False)), note=data.get("note", ""),
               columns=data["columns"], rows=data["rows"], notes=data.get("notes", []))


def ratio(row: dict, lib: str) -> float | None:
    """kernels.py: alternative time / sparsenn time, when both were measured."""
    a, b = row.get(lib), row.get("sparsenn")
    return a / b if isinstance(a, float) and isinstance(b, float) else None


def median_range(values: list[float]) -> str:
    """'median (min–max)', empty for no values."""
    return f"{cell(statistics.median(values))} ({cell(min(values))}–{cell(max(values))})" if values else ""


def read_kernels(data: dict, path: Path) -> Run:
    """kernels.py: per kernel and thread count, ratios over the matrix set (small: nnz < 10^4, large: >= 2·10^5)."""
    run = scripted_run(data, path, "kernels")
    run.columns = ["kernel", "threads", "matrices", "torch / sparsenn: median (range)", "nnz < 10^4: median (worst)",
                   "nnz ≥ 2·10^5: median", "scipy / sparsenn", "dense-then-mask / sparsenn"]
    rows = data["rows"]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for threads in sorted({r["threads"] for r in rows}):
            group = [r for r in rows if r["kernel"] == kernel and r["threads"] == threads]
            torch_ratios = [(r["nnz"], v) for r in group if (v := ratio(r, "torch")) is not None]
            small = [v for nnz, v in torch_ratios if nnz < 10_000]
            large = [v for nnz, v in torch_ratios if nnz >= 200_000]
            run.rows.append([kernel, threads, len(group), median_range([v for _, v in torch_ratios]),
                             f"{cell(statistics.median(small))} ({cell(min(small))})" if small else "",
                             statistics.median(large) if large else None,
                             median_range([v for r in group if (v := ratio(r, "scipy")) is not None]),
                             median_range([v for r in group if (v := ratio(r, "dense-mask")) is not None])])
    correct = sum(bool(r.get("correct")) for r in rows)
    builds = [f"{kind} {b['first_build_ms']:.0f} / {b['warm_load_ms']:.1f} ms" if "error" not in b
              else f"{kind} error {b['error']}" for kind, b in data.get("compile", {}).items()]
    run.notes = [f"sparsenn's result within 1e-3 × max |ref| of scipy's (torch's for SDDMM): {correct} of "
                 f"{len(rows)} rows.",
                 "First call in a fresh process (median of 3), empty kernel cache / warm disk cache: "
                 + ", ".join(builds) + "."]
    return run


def timing_cells(timings: list[dict], threads: int, methods: list[str]) -> list[str]:
    """autograd.py / layers.py: sparsenn's 'fwd / fwd+bwd' in ms, then each method's ratios to it."""
    at = {t["method"]: t for t in timings if t["threads"] == threads and "error" not in t}
    ours = at.get("sparsenn")
    cells = [joined([ours["fwd_ms"], ours["fwdbwd_ms"]]) if ours else "error"]
    for method in methods:
        t = at.get(method)
        cells.append(joined([t["fwd_ms"] / ours["fwd_ms"], t["fwdbwd_ms"] / ours["fwdbwd_ms"]]) if t and ours else "")
    return cells


def read_autograd(data: dict, path: Path) -> Run:
    """autograd.py: per case and thread count, sparsenn's times and each method's ratios."""
    run = scripted_run(data, path, "autograd")
    results = data["results"]
    methods = list(dict.fromkeys(t["method"] for r in results for t in r["timings"] if t["method"] != "sparsenn"))
    run.columns = (["case", "threads", "sparsenn ms, fwd / fwd+bwd"]
                   + [f"{m} / sparsenn, fwd / fwd+bwd" for m in methods])
    for r in results:
        for threads in sorted({t["threads"] for t in r["timings"]}):
            run.rows.append([r["case"], threads, *timing_cells(r["timings"], threads, methods)])
    failed = [f"{r['case']}: {name}" for r in results for name, c in r["check"].items() if not c.get("ok")]
    firsts = {r["case"]: r["first_call"] for r in results}
    run.notes = ["Output and gradients against a float64 reference (within 1e-3 × max |ref|): "
                 + (f"failed for {', '.join(failed)}." if failed else "every method ok."),
                 first_build_note(firsts)]
    return run


LAYER_METHODS = {"dense nn.Linear": "dense", "torch.sparse CSR F.linear": "torch.sparse CSR",
                 "torch.sparse CSR": "torch.sparse CSR", "PyG GCNConv": "PyG", "PyG propagate": "PyG",
                 "sparsenn 3-operand einsum": "3-operand einsum"}
LAYER_SPARSITY = 0.9  # the linear layers the table shows (the targets' sparsity)
SPARSE_FEATURES = {"sparsenn, X sparse": "sparsenn", "torch.sparse CSR, X sparse": "torch.sparse CSR",
                   "PyG GCNConv": "PyG"}


def read_layers(data: dict, path: Path) -> Run:
    """layers.py at its fewest threads: times and ratios of the linear layers at LAYER_SPARSITY
    and of every graph case; GCNs with sparse features (against torch.sparse with sparse
    features too) as rows of their own."""
    run = scripted_run(data, path, "layers")
    cases = [c for c in data["cases"] if c["kind"] != "linear" or c["spec"][2] == LAYER_SPARSITY]
    threads = min(t["threads"] for c in cases for t in c["timings"])
    columns = list(dict.fromkeys(LAYER_METHODS.values()))
    run.columns = (["case", "sparsenn ms, fwd / fwd+bwd"]
                   + [f"{c} / sparsenn, fwd / fwd+bwd" for c in columns])
    for case in cases:
        timings = [t for t in case["timings"] if t["threads"] == threads]
        views = [(case["name"], [dict(t, method=LAYER_METHODS.get(t["method"], t["method"])) for t in timings])]
        if any(t["method"] == "sparsenn, X sparse" for t in timings):
            views.append((f"{case['name']}, X sparse", [dict(t, method=SPARSE_FEATURES[t["method"]]) for t in timings
                                                        if t["method"] in SPARSE_FEATURES]))
        for name, view in views:
            run.rows.append([name, *timing_cells(view, threads, columns)])
    cal, firsts = data.get("calibration"), data.get("first_call", {})
    run.notes = [f"Times at {plural(threads, 'thread')}, linear layers at {LAYER_SPARSITY:.0%} sparsity; the "
                 "others are in the raw file and its `.md`. Output and gradients against a float64 reference: "
                 + ("every method ok." if all(c["ok"] for case in data["cases"] for c in case["check"].values())
                    else "see the raw file (not all ok).")]
    if cal:
        run.notes.append(f"Break-even fit, forward+backward at batch 64, {plural(cal['threads'], 'thread')}: sparsenn "
                         f"{cal['sparse_overhead_us']:.0f} µs + {cal['sparse_ns_per_mac']:.3f} ns per stored MAC, "
                         f"nn.Linear {cal['dense_overhead_us']:.0f} µs + {cal['dense_ns_per_mac']:.3f} ns per MAC.")
    if firsts:
        run.notes.append(first_build_note({f["case"]: f for f in firsts.values() if "case" in f}))
    return run


def target_text(rows: list[dict]) -> str:
    """A case's targets over its thread counts: 'all met', or each missed one with the threads it missed at."""
    missed = {}
    for row in rows:
        for t in row.get("targets", []):
            label = f"rate ≥ {t['min']:.0%} of dense" if t["vs"] == "rate" else f"{t['vs']} ≥ {t['min']:.3g}x"
            missed.setdefault(label, [])
            if not t["met"]:
                missed[label].append(str(row["threads"]))
    if not missed:
        return ""
    parts = [f"{label} ({'/'.join(threads)} t)" for label, threads in missed.items() if threads]
    return "missed: " + "; ".join(parts) if parts else "all met"


def rows_reader(script: str, subject: str = "sparsenn", extra: tuple[tuple[str, str], ...] = (),
                targeted: bool = False) -> Callable:
    """Reader of the scripts built on structured.py's run_case (one row per case and thread count,
    times in ``ms``, ``ratios`` to sparsenn's time, ``targets``): one row per case, thread counts as
    'a / b'. ``subject``: what the script times as "sparsenn" (tracing.py: the compiled model);
    ``targeted``: only the cases with targets (every case is in the run's own ``.md``)."""
    def read(data: dict, path: Path) -> Run:
        run = scripted_run(data, path, script)
        rows = data["rows"]
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            if not targeted or r.get("targets") or "unavailable" in r:
                groups.setdefault((r.get("section", ""), r["case"]), []).append(r)
        if targeted:
            every = path.with_suffix(".md")
            every = every.relative_to(ROOT) if every.is_relative_to(ROOT) else every
            run.notes.append(f"The cases with targets; every case: `{every.as_posix()}`.")
        alts = [list(r.get("ratios", {})) for r in rows if "unavailable" not in r]
        uniform = all(a == alts[0] for a in alts)
        sections = len({s for s, _ in groups}) > 1
        run.columns = (["case", "threads", f"{subject} ms"]
                       + ([f"{a} / {subject}" for a in alts[0]] if uniform else [f"alternative / {subject}"])
                       + [name for name, _ in extra] + ["targets"])
        for (section, case), group in groups.items():
            label = f"{section}: {case}" if sections else case
            if "unavailable" in group[0]:
                run.rows.append([label, "", f"unavailable: {group[0]['unavailable']}"])
                continue
            ratios = ([joined([r["ratios"][a] for r in group]) for a in alts[0]] if uniform else
                      [", ".join(f"{a} {joined([r['ratios'].get(a) for r in group])}" for a in group[0]["ratios"])])
            run.rows.append([label, joined([r["threads"] for r in group]), joined([r["ms"]["sparsenn"] for r in group]),
                             *ratios, *(joined([r.get(key) for r in group]) for _, key in extra),
                             target_text(group)])
        if "first_build" in data:
            run.notes.append(first_build_note(data["first_build"]))
        if "compile_ms" in data:
            run.notes.append("First compiled call (Dynamo, AOTAutograd, inductor; kernels already built): "
                             + ", ".join(f"{name} {ms / 1e3:.1f} s" for name, ms in data["compile_ms"].items()) + ".")
        for m in data.get("memory", []):
            run.notes.append(f"Peak memory of one {'forward+backward' if m['backward'] else 'forward'} call above the "
                             f"resident set, L={m['length']} b={m['batch']} block={m['block']}: "
                             + ", ".join(f"{name} {cell(mib)} MiB" for name, mib in m["mib"].items()) + ".")
        return run
    return read


def read_precision(data: dict, path: Path) -> Run:
    """precision.py: per case, the float32 time and each 16-bit variant's time and speed-up
    over it, other variants' times; thread counts as 'a / b'."""
    run = scripted_run(data, path, "precision")
    run.columns = ["case", "threads", "float32 ms", "bfloat16 ms (fp32 / x)", "float16 ms (fp32 / x)",
                   "other variants, ms"]
    groups: dict[str, list[dict]] = {}
    for r in data["rows"]:
        groups.setdefault(r["case"], []).append(r)
    for case, group in groups.items():
        if "unavailable" in group[0]:
            run.rows.append([case, "", f"unavailable: {group[0]['unavailable']}"])
            continue
        base = group[0]["base"]
        halves = [base.replace("float32", dtype) for dtype in ("bfloat16", "float16")]
        others = [name for name in group[0]["ms"] if name != base and name not in halves]
        def times(name: str) -> str:
            return joined([r["ms"][name] for r in group])

        def with_speedup(name: str) -> str:
            return f"{times(name)} ({joined([r['ms'][base] / r['ms'][name] for r in group])})"

        run.rows.append([case, joined([r["threads"] for r in group]), times(base),
                         *(with_speedup(h) if h in group[0]["ms"] else "" for h in halves),
                         "; ".join(f"{name} {times(name)}" for name in others)])
    run.notes.append(first_build_note(data.get("first_build", {})))
    return run


def read_models(data: dict, path: Path) -> Run:
    """A run of ``sparsenn bench`` over the reference models: ``run.json`` (provenance and the
    result files) beside each model's result; times at the fewest threads."""
    run = read_common({**data, "columns": [], "rows": []}, path)
    results = [json.loads((path.parent / name).read_text()) for name in data["results"]]
    threads = min(min(r["settings"]["threads"]) for r in results)
    variants = list(dict.fromkeys(v["name"] for r in results for v in r["variants"] if v["name"] != "sparsenn"))
    run.columns = ["model", "sparsenn ms", *(f"{v} ms (x / sparsenn)" for v in variants), "metric", "first call"]
    for r in results:
        ms = {v["name"]: v["median_ms"][str(threads)] for v in r["variants"]}
        metric = next(v["metric"] for v in r["variants"] if v["name"] == "sparsenn")
        first = r.get("first_call")
        run.rows.append([r["name"], ms["sparsenn"],
                         *(f"{cell(ms[v])} ({cell(ms[v] / ms['sparsenn'])})" if v in ms else "" for v in variants),
                         f"{r['metric_name']} {cell(metric)}",
                         f"{first['ms'] / 1e3:.1f} s, {plural(first['kernels_built'], 'kernel')}" if first else ""])
    agree = all(v["agrees"] for r in results for v in r["variants"])
    run.notes.insert(0, f"Times at {plural(threads, 'thread')}. "
                        + ("Every variant's output agrees with sparsenn's." if agree else
                           "Not every variant's output agrees with sparsenn's: see the raw files."))
    return run


SOURCES: dict[str, tuple[Callable[[dict, Path], Run], tuple[str, ...]]] = {
    "kernels": (read_kernels, ("kernels.json",)),
    "overhead": (read_common, ("overhead/*.json",)),
    "autograd": (read_autograd, ("autograd.json", "autograd_quick.json")),
    "layers": (read_layers, ("layers.json", "layers_quick.json")),
    "structured": (rows_reader("structured"), ("structured/*.json",)),
    "attention": (rows_reader("attention", targeted=True), ("attention/*.json", "attention/l4096/*.json")),
    "nonlinear": (rows_reader("nonlinear"), ("nonlinear/*.json",)),
    "precision": (read_precision, ("precision.json", "precision_quick.json")),
    "tracing": (rows_reader("tracing", subject="compiled"), ("tracing/*.json",)),
    "torchfunc": (rows_reader("torchfunc", subject="vmap"), ("torchfunc/*.json",)),
    "moe": (rows_reader("moe", extra=(("GFLOP/s (routed pairs)", "gflops"),)), ("moe/*.json", "moe/*/*.json")),
    "models": (read_models, ("models/run.json",)),
    "coldstart": (read_common, ("coldstart/*.json",)),
}


def latest_run(name: str, results: Path) -> Run | None:
    """The most recent run of a benchmark among its SOURCES files (None if there is none)."""
    reader, patterns = SOURCES[name]
    runs = []
    for path in sorted({p for pattern in patterns for p in results.glob(pattern)}):
        data = json.loads(path.read_text())
        runs.append((read_common if "columns" in data else reader)(data, path))
    return max(runs, key=lambda r: (r.date or "", not r.quick), default=None)


def benchmark_section(name: str, results: Path) -> list[str]:
    """The generated lines of one benchmark's section."""
    run = latest_run(name, results)
    if run is None:
        return [f"No results recorded yet (`benchmarks/results/`, {', '.join(SOURCES[name][1])})."]
    return [" ".join([provenance(run), *run.notes]), "", *markdown_table(run.columns, run.rows)]


# ----------------------------------------------------------------------------------- sweep
SPARSITY_BANDS = (("50–70 %", 0.5, 0.7), ("80–90 %", 0.8, 0.9), ("≥ 95 %", 0.95, 1.0))
BATCH_BANDS = (("1", 1, 1), ("2–7", 2, 7), ("8–63", 8, 63), ("≥ 64", 64, math.inf))
HEATMAP = "benchmarks/results/sweep/heatmap.png"  # as linked from BENCHMARKS.md


def sparsity_fraction(value: float) -> float:
    """A cell's sparsity as a fraction (the sweep may record 0.9 or 90)."""
    return value / 100 if value > 1 else value


def speedup(c: dict) -> float | None:
    """The faster alternative's time over sparsenn's (> 1: sparsenn faster); None if unmeasured."""
    alternatives = [t for t in (c.get("dense_ms"), c.get("torch_sparse_ms")) if isinstance(t, (int, float)) and t > 0]
    ours = c.get("sparsenn_ms")
    return min(alternatives) / ours if alternatives and isinstance(ours, (int, float)) and ours > 0 else None


def readable_json(path: Path) -> object:
    """The JSON in ``path``, or None if it does not parse (a sweep still being written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def usable_cell(c: object) -> bool:
    """A sweep cell with every key the summary reads, numeric where it computes."""
    keys = ("shape", "sparsity", "batch", "dtype", "threads", "pass")
    return (isinstance(c, dict) and all(k in c for k in keys) and isinstance(c["sparsity"], (int, float))
            and isinstance(c["batch"], (int, float)) and speedup(c) is not None)


def in_band(value: float, low: float, high: float) -> bool:
    """low <= value <= high, up to rounding."""
    return low - 1e-9 <= value <= high + 1e-9


def band_matrix(cells: list[dict]) -> list[str]:
    """Geometric mean of the speed-up per sparsity band (rows) and batch band (columns)."""
    rows = []
    for label, low, high in SPARSITY_BANDS:
        row = [label]
        for _, first, last in BATCH_BANDS:
            values = [speedup(c) for c in cells if in_band(sparsity_fraction(c["sparsity"]), low, high)
                      and first <= c["batch"] <= last]
            row.append(f"{geometric_mean(values):.2f} ({len(values)})" if values else "—")
        rows.append(row)
    return markdown_table(["sparsity \\ batch", *(label for label, _, _ in BATCH_BANDS)], rows)


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(map(math.log, values))) if values else None


def ratio_over(cells: list[dict], alternative: str) -> float | None:
    """Geometric mean of ``alternative``'s time over sparsenn's, over the cells measuring it."""
    return geometric_mean([c[alternative] / c["sparsenn_ms"] for c in cells
                           if isinstance(c.get(alternative), (int, float)) and c[alternative] > 0])


def target_rows(cells: list[dict]) -> list[str]:
    """Issue #33's targets over the fp32 cells, one column per thread count: the worst
    cell (no cell below 0.9x the faster alternative), and forward geometric means for
    sparsity >= 80 % at batch >= 8 and for batch 1 at 90 % on layers 1024 wide and wider."""
    threads = sorted({c["threads"] for c in cells})

    def row(label: str, value) -> list:
        values = [value([c for c in cells if c["threads"] == t]) for t in threads]
        return [label, *(f"{v:.2f}" if v is not None else "—" for v in values)]

    def forward(mine: list[dict], sparsity: float, batch) -> list[dict]:
        return [c for c in mine if c["pass"] == "forward" and batch(c["batch"])
                and sparsity_fraction(c["sparsity"]) >= sparsity - 1e-9]

    def wide_b1(mine: list[dict]) -> list[dict]:
        return [c for c in forward(mine, 0.9, lambda b: b == 1) if in_band(sparsity_fraction(c["sparsity"]), 0.9, 0.9)
                and min(int(n) for n in c["shape"].split("x")) >= 1024]

    rows = [row("worst cell, every pass: faster / sparsenn (target ≥ 0.9)",
                lambda mine: min(map(speedup, mine), default=None)),
            row("sparsity ≥ 80 %, batch ≥ 8, forward: dense / sparsenn (target ≥ 2.65)",
                lambda mine: ratio_over(forward(mine, 0.8, lambda b: b >= 8), "dense_ms")),
            row("the same cells: torch.sparse / sparsenn (target ≥ 1.7)",
                lambda mine: ratio_over(forward(mine, 0.8, lambda b: b >= 8), "torch_sparse_ms")),
            row("batch 1 at 90 %, 1024 wide and wider, forward: dense / sparsenn (target ≥ 3)",
                lambda mine: ratio_over(wide_b1(mine), "dense_ms"))]
    return markdown_table(["fp32 target", *(f"{t} thread{'s' if t > 1 else ''}" for t in threads)],
                          rows)


def sweep_section(results: Path) -> list[str]:
    """The sweep's summary from ``sweep/*.json`` (the newest file by its ``date``, then name): a JSON
    with ``machine``, ``cpu``, ``torch``, ``commit``, ``command`` and ``cells``, each cell with
    ``shape`` ("1024x1024"), ``sparsity``, ``batch``, ``dtype``, ``threads``, ``pass``
    ("forward" / "forward+backward"), ``sparsenn_ms``, ``dense_ms`` and ``torch_sparse_ms``
    (may be null). Cells without a sparsenn time or any alternative's are left out."""
    sweeps = [(path, data) for path in sorted((results / "sweep").glob("*.json"))
              if isinstance(data := readable_json(path), dict)]
    if not sweeps:
        return ["Not yet run."]
    path, data = max(sweeps, key=lambda pair: (str(pair[1].get("date") or ""), pair[0].name))
    cpu = data.get("cpu") or ""
    if isinstance(cpu, dict):  # sweep.py records the model and its vector units and caches
        units = ", ".join(k for k in ("avx2", "avx512f", "avx512_bf16") if cpu.get(k))
        cpu = f"{cpu.get('model', 'a CPU')} ({units}; L2 {cpu.get('l2', '?')})"
    load = (data.get("loadavg") or {}).get("start")
    run = Run(path=path, cpu=cpu, machine=data.get("machine") or "", torch=data.get("torch") or "",
              commit=data.get("commit") or "", date=str(data.get("date") or ""), command=data.get("command") or "",
              load=load[0] if load else None)
    everything = [c for c in data.get("cells") or [] if usable_cell(c)]
    cells = [c for c in everything if c.get("dtype") == "float32" and c.get("threads") == 1]
    if not cells:
        return [provenance(run), "", "The sweep recorded no cell with both sparsenn's and an alternative's time."]
    worst = sorted(cells, key=speedup)[:10]
    lines = [provenance(run), "",
             f"fp32 at 1 thread ({len(cells)} of the {len(everything)} cells; the others are in the raw file and "
             "the heat maps beside it): the 10 cells where sparsenn does worst against the faster of dense and "
             "torch.sparse (faster / sparsenn > 1: sparsenn faster):", "",
             *markdown_table(["shape", "sparsity", "batch", "dtype", "threads", "pass", "sparsenn ms", "dense ms",
                              "torch.sparse ms", "faster / sparsenn"],
                             [[c["shape"], f"{sparsity_fraction(c['sparsity']):.0%}", c["batch"], c["dtype"],
                               c["threads"], c["pass"], float(c["sparsenn_ms"]), c.get("dense_ms"),
                               c.get("torch_sparse_ms"), f"{speedup(c):.2f}"] for c in worst]),
             "", "Geometric mean of faster / sparsenn over every cell of a band (cells in brackets):", "",
             *band_matrix(cells), "", "Issue #33's targets:", "",
             *target_rows([c for c in everything if c.get("dtype") == "float32"])]
    heatmap = (results / "sweep" / "heatmap.png").exists()
    return lines + ["", f"![faster alternative / sparsenn over the sweep]({HEATMAP})" if heatmap
                    else "No heat map yet (`benchmarks/results/sweep/heatmap.png`)."]


# ----------------------------------------------------------------------------------- document
def section(name: str, results: Path) -> list[str]:
    """The generated lines of the section a marker names."""
    if name == "sweep":
        return sweep_section(results)
    if name not in SOURCES:
        raise ValueError(f"BENCHMARKS.md has a marker for an unknown table: {name!r}")
    return benchmark_section(name, results)


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every generated section rewritten from ``results``."""
    return MARKER.sub(lambda m: m.group(1) + "\n".join(section(m.group(2), results)) + "\n" + m.group(4), text)


def stale_sections(text: str, results: Path = RESULTS) -> list[str]:
    """Names of the generated sections of ``text`` that differ from what ``results`` give."""
    return [m.group(2) for m in MARKER.finditer(text) if m.group(3) != "\n".join(section(m.group(2), results)) + "\n"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md is out of date")
    args = parser.parse_args()
    text = DOC.read_text()
    if args.check:
        stale = stale_sections(text)
        if stale:
            print(f"BENCHMARKS.md is out of date in: {', '.join(stale)}; run python benchmarks/report.py",
                  file=sys.stderr)
        return 1 if stale else 0
    DOC.write_text(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
