"""Heat maps and the text summary of a sweep's JSON (``benchmarks/sweep.py``), redrawable
without re-running it: ``python benchmarks/sweep.py --plot <json>``.

A cell's ratio is the faster of dense and torch.sparse's time over sparsenn's: above 1,
sparsenn is faster than both.
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.report import band_matrix, geometric_mean, speedup, target_rows

LOG2_LIMIT = 5  # the colour scale saturates at 32x either way


def groups(cells: list[dict]) -> list[tuple[str, int]]:
    """(dtype, threads) pairs in the cells, fp32 at 1 thread first."""
    return sorted({(c["dtype"], c["threads"]) for c in cells}, key=lambda g: (g[0] != "float32", g[1]))


# ------------------------------------------------------------------------------------ heat maps
def write_heatmaps(data: dict, out_dir: Path, stem: str = "heatmap") -> list[Path]:
    """One PNG per (dtype, threads): ``<stem>.png`` for the first (fp32, 1 thread when
    measured), ``<stem>-<dtype>-<threads>t.png`` for the others; a panel per shape x pass,
    batch across, sparsity down, colour log2 of the ratio, each cell annotated with it."""
    paths = []
    for index, (dtype, threads) in enumerate(groups(data["cells"])):
        cells = [c for c in data["cells"] if (c["dtype"], c["threads"]) == (dtype, threads)]
        path = out_dir / (f"{stem}.png" if index == 0 else f"{stem}-{dtype}-{threads}t.png")
        paths.append(heatmap(cells, data, f"{dtype}, {threads} thread{'s' if threads > 1 else ''}", path))
    return paths


def heatmap(cells: list[dict], data: dict, label: str, path: Path) -> Path:
    """The panels of one (dtype, threads) group (see :func:`write_heatmaps`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    passes = list(dict.fromkeys(c["pass"] for c in cells))
    batches = sorted({c["batch"] for c in cells})
    sparsities = sorted({c["sparsity"] for c in cells})
    ratios = {(c["shape"], c["pass"], c["sparsity"], c["batch"]): speedup(c) for c in cells}
    figure, axes = plt.subplots(len(passes), len(shapes), figsize=(max(2.4 * len(shapes) + 1.4, 9), 2.6 * len(passes) + 1.1),
                                squeeze=False, layout="constrained")
    norm = TwoSlopeNorm(vmin=-LOG2_LIMIT, vcenter=0, vmax=LOG2_LIMIT)
    image = None
    for row, pass_ in enumerate(passes):
        for col, shape in enumerate(shapes):
            axis = axes[row][col]
            grid = [[ratios.get((shape, pass_, s, b), math.nan) for b in batches] for s in sparsities]
            logs = [[math.log2(r) if r == r else math.nan for r in line] for line in grid]
            image = axis.imshow(logs, cmap="RdBu", norm=norm, aspect="auto", origin="lower")
            for y, line in enumerate(grid):
                for x, r in enumerate(line):
                    if r == r:
                        axis.text(x, y, f"{r:.2f}" if r < 9.95 else f"{r:.0f}", ha="center", va="center", fontsize=6.5,
                                  color="white" if abs(math.log2(r)) > 0.6 * LOG2_LIMIT else "black")
            axis.set_xticks(range(len(batches)), [str(b) for b in batches], fontsize=7)
            axis.set_yticks(range(len(sparsities)), [f"{s:.0%}" for s in sparsities], fontsize=7)
            axis.set_title(f"{shape} (in x out)\n{pass_}", fontsize=8)
            if row == len(passes) - 1:
                axis.set_xlabel("batch", fontsize=7)
            if col == 0:
                axis.set_ylabel("sparsity", fontsize=7)
    bar = figure.colorbar(image, ax=axes, shrink=0.9)
    ticks = range(-LOG2_LIMIT, LOG2_LIMIT + 1)
    bar.set_ticks(list(ticks), labels=[f"{2 ** t}x" if t >= 0 else f"1/{2 ** -t}x" for t in ticks], fontsize=7)
    bar.set_label("faster of dense / torch.sparse time over sparsenn's", fontsize=7)
    figure.suptitle(f"SparseLinear (csr, bias), {label}: {data['machine']} at {data['commit']}, torch {data['torch']}\n"
                    "sparsenn's speed-up over the faster of dense F.linear and torch.sparse CSR (blue: faster, red: "
                    "slower)", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ------------------------------------------------------------------------------------ summary
def summary(data: dict, worst: int = 10) -> str:
    """Worst cells, geomeans per sparsity band x batch band, the issue's targets, SpMM and model ratios."""
    lines = [f"sweep on {data['machine']} ({data['cpu']['model']}), torch {data['torch']}, commit {data['commit']}, "
             f"load {data['loadavg']['start']} -> {data['loadavg']['end']}"]
    cells = data["cells"]
    if cells:
        fp32 = [c for c in cells if c["dtype"] == "float32"]
        lines += worst_cells(cells, worst) + band_tables(cells)
        lines += ["", "issue 33 targets:", *target_rows(fp32)] if fp32 else []
    if data["spmm"]:
        lines += spmm_table(data["spmm"])
    if data["models"]:
        lines += ["", "models: other variant's time / sparsenn's (> 1: sparsenn faster)"]
        for row in data["models"]:
            parts = [f"{name} {row[key] / row['sparsenn_ms']:.2f}x" for key, name in
                     (("dense_ms", "dense"), ("torch_sparse_ms", "torch.sparse"), ("pyg_ms", "PyG")) if row[key]]
            lines.append(f"  {row['model']:<18} t={row['threads']}: sparsenn {row['sparsenn_ms']:.3f} ms; "
                         + ", ".join(parts))
    return "\n".join(lines)


def times(value: float | None) -> str:
    """``1.23x``, or ``-`` for no value (None or nan)."""
    return f"{value:.2f}x" if value is not None and value == value else "-"


def ratio_text(cell: dict) -> str:
    sparse = cell["torch_sparse_ms"]
    versus_sparse = "-" if sparse is None else f"{sparse / cell['sparsenn_ms']:.2f}x"
    return f"vs dense {cell['dense_ms'] / cell['sparsenn_ms']:.2f}x, vs torch.sparse {versus_sparse}"


def worst_cells(cells: list[dict], count: int) -> list[str]:
    """The ``count`` worst cells of each dtype and thread count."""
    lines = []
    for dtype, threads in groups(cells):
        mine = sorted((c for c in cells if (c["dtype"], c["threads"]) == (dtype, threads)), key=speedup)
        lines += ["", f"worst {count} cells, {dtype}, {threads} thread(s) (ratio to the faster alternative; < 1: "
                      "sparsenn slower)"]
        lines += [f"  {speedup(c):5.2f}x  {c['shape']:>9} s={c['sparsity']:<4} b={c['batch']:<3} {c['pass']:<16} "
                  f"sparsenn {c['sparsenn_ms']:.4g} ms ({ratio_text(c)})" for c in mine[:count]]
    return lines


def band_tables(cells: list[dict]) -> list[str]:
    """Per pass, dtype and threads: geomean ratio to the faster alternative per band (as in BENCHMARKS.md)."""
    lines = ["", "geomean ratio to the faster alternative, sparsity band x batch band (cells in brackets)"]
    for pass_ in dict.fromkeys(c["pass"] for c in cells):
        for dtype, threads in groups(cells):
            selected = [c for c in cells if (c["pass"], c["dtype"], c["threads"]) == (pass_, dtype, threads)]
            if selected:
                lines += ["", f"{pass_}, {dtype}, {threads} thread(s)", *band_matrix(selected)]
    return lines


def spmm_table(rows: list[dict]) -> list[str]:
    """torch.sparse's time over sparsenn's per graph (rows) and column count, per thread count."""
    columns = sorted({r["columns"] for r in rows})
    lines = ["", "spmm: torch.sparse time / sparsenn's (> 1: sparsenn faster)"]
    for threads in sorted({r["threads"] for r in rows}):
        lines.append(f"  {threads} thread(s)      {'nnz':>8}" + "".join(f"{f'k={k}':>8}" for k in columns))
        for graph in dict.fromkeys(r["graph"] for r in rows):
            mine = {r["columns"]: r for r in rows if (r["graph"], r["threads"]) == (graph, threads)}
            if not mine:
                continue
            nnz = next(iter(mine.values()))["nnz"]
            cells = [f"{times(mine[k]['torch_sparse_ms'] / mine[k]['sparsenn_ms'] if k in mine else math.nan):>8}"
                     for k in columns]
            lines.append(f"  {graph:<16}{nnz:>9}" + "".join(cells))
        ratios = [r["torch_sparse_ms"] / r["sparsenn_ms"] for r in rows if r["threads"] == threads]
        narrow = [r["torch_sparse_ms"] / r["sparsenn_ms"] for r in rows if r["threads"] == threads and r["columns"] <= 16]
        wide = [r["torch_sparse_ms"] / r["sparsenn_ms"] for r in rows if r["threads"] == threads and r["columns"] >= 64]
        lines.append(f"  geomean {times(geometric_mean(ratios))}; 1-16 columns {times(geometric_mean(narrow))} "
                     f"(target 1), 64-256 columns {times(geometric_mean(wide))} (target 1.5)")
    return lines
