"""benchmarks/report.py: BENCHMARKS.md matches the stored results, and the tables render as documented."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
RESULT = {"benchmark": "overhead", "cpu": "AMD EPYC", "machine": "2 cores", "torch": "2.13.0+cpu",
          "commit": "abc1234", "date": "2026-11-26 10:00", "command": "python benchmarks/overhead.py",
          "columns": ["matrix (nnz)", "kernel", "sparsenn µs", "torch µs"],
          "rows": [["karate (156)", "SpMV", 7.5, 4.6], ["494_bus (1666)", "SpGEMM A·Aᵀ", 92.24, None]],
          "notes": ["One note."]}


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_benchmarks_md_is_up_to_date_with_the_results():
    done = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_a_common_schema_result_renders_as_one_provenance_line_and_a_table(tmp_path):
    write(tmp_path / "overhead" / "overhead.json", RESULT)
    doc = "# Doc\n<!-- table:overhead -->\nold\n<!-- /table -->\ntext\n"
    rendered = report.render(doc, tmp_path)
    raw = (tmp_path / "overhead" / "overhead.json").as_posix()
    assert rendered == (
        "# Doc\n<!-- table:overhead -->\n"
        "Run 2026-11-26 10:00 at `abc1234` on AMD EPYC (2 cores), torch 2.13.0+cpu. Command: "
        f"`python benchmarks/overhead.py`. Raw: `{raw}`. One note.\n\n"
        "| matrix (nnz) | kernel | sparsenn µs | torch µs |\n"
        "|---|---|---:|---:|\n"
        "| karate (156) | SpMV | 7.50 | 4.60 |\n"
        "| 494_bus (1666) | SpGEMM A·Aᵀ | 92.2 |  |\n"
        "<!-- /table -->\ntext\n")
    assert report.stale_sections(rendered, tmp_path) == []
    assert report.stale_sections(doc, tmp_path) == ["overhead"]


def test_the_newest_run_wins_and_another_machine_is_flagged(tmp_path):
    write(tmp_path / "overhead" / "old.json", {**RESULT, "date": "2026-11-20 10:00", "commit": "old0000"})
    write(tmp_path / "overhead" / "overhead.json", {**RESULT, "cpu": "Intel Xeon"})
    line = report.benchmark_section("overhead", tmp_path)[0]
    assert "`abc1234`" in line and "Not the AMD EPYC" in line
    assert report.benchmark_section("kernels", tmp_path)[0].startswith("No results recorded yet")


def test_the_sweep_lists_the_worst_cells_and_the_geometric_mean_per_band(tmp_path):
    assert report.sweep_section(tmp_path) == ["Not yet run."]
    cell = {"shape": "1024x1024", "dtype": "float32", "threads": 1, "pass": "forward", "torch_sparse_ms": None}
    cells = [{**cell, "sparsity": 0.9, "batch": 1, "sparsenn_ms": 2.0, "dense_ms": 1.0},
             {**cell, "sparsity": 0.9, "batch": 1, "sparsenn_ms": 1.0, "dense_ms": 8.0, "torch_sparse_ms": 2.0},
             {**cell, "sparsity": 0.99, "batch": 128, "sparsenn_ms": 1.0, "dense_ms": 3.0},
             {**cell, "sparsity": 0.9, "batch": 4, "sparsenn_ms": 1.0, "dense_ms": None}]  # no alternative: left out
    write(tmp_path / "sweep" / "sweep.json", {"cpu": "AMD EPYC", "commit": "abc1234", "torch": "2.13.0+cpu",
                                              "command": "python benchmarks/sweep.py", "cells": cells})
    lines = report.sweep_section(tmp_path)
    worst = [line for line in lines if line.startswith("| 1024x1024")]
    assert [row.split(" | ")[-1] for row in worst] == ["0.50 |", "2.00 |", "3.00 |"]
    assert "| 80–90 % | 1.00 (2) | — | — | — |" in lines
    assert "| ≥ 95 % | — | — | — | 3.00 (1) |" in lines
    targets = {line.split(" | ")[0]: line.split(" | ")[1:] for line in lines if "target ≥" in line}
    assert targets["| worst cell, every pass: faster / sparsenn (target ≥ 0.9)"] == ["0.50 |"]
    assert targets["| sparsity ≥ 80 %, batch ≥ 8, forward: dense / sparsenn (target ≥ 2.65)"] == ["3.00 |"]
    assert targets["| the same cells: torch.sparse / sparsenn (target ≥ 1.7)"] == ["— |"]
    assert targets["| batch 1 at 90 %, 1024 wide and wider, forward: dense / sparsenn (target ≥ 3)"] == ["2.00 |"]
    assert lines[-1].startswith("No heat map yet")
