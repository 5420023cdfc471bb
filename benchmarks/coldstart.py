"""Cold start: each reference model's first forward with an empty kernel cache, a single
kernel's build, ``import sparsenn`` and ``sparsenn --help``.

    PYTHONPATH=<worktree> python benchmarks/coldstart.py [--repeats 3] [--before DIR] [--out DIR]

Every measurement runs in a fresh process with a fresh ``SPARSENN_CACHE_DIR``:

* first forward: the reference models at their configs' sizes (GCN on Cora, hidden 128; the
  sparse autoencoder, 784-256 CSR at 90 % sparsity, batch 64; BigBird, batch 64 of 1024
  tokens) and a SparseMoE layer (d_model 512, d_hidden 2048, 8 experts, top-2, 4096
  tokens), eval mode, no grad; the model and its input are built first (not timed); the
  second forward is timed too (what the first costs beyond building kernels and planning),
  and the compilers' CPU time (user and system, every compiler process of the first
  forward) and the calling thread's CPU time of the first forward minus the second's
  (planning, lowering and printing the kernels): what the first call costs whatever the load;
* single kernel: every kernel those forwards built, each loaded into its own empty cache
  (``jit.load_library``, the compiler run included, Python imports not) by the checkout
  whose forwards generated it;
* ``import sparsenn``, its full API (``sparsenn.einsum``: torch and the compiler) and
  ``python -m sparsenn --help`` wall times (``import torch`` alone for scale).

With ``--before DIR`` every process also runs against the checkout in DIR (e.g. the main
branch), interleaved, and the table gives both. Medians of ``--repeats`` runs. Targets:
every reference model's first forward <= 2 s, a single kernel <= 0.5 s (median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "gcn": "GCN (Cora, hidden 128)",
    "autoencoder": "sparse autoencoder (784-256 CSR, batch 64)",
    "bigbird": "BigBird (batch 64, 1024 tokens)",
    "moe": "SparseMoE layer (512-2048, 8 experts, top-2, 4096 tokens)",
}
REFERENCE_MODELS = ("gcn", "autoencoder", "bigbird")
FIRST_FORWARD_TARGET_S, KERNEL_TARGET_S = 2.0, 0.5
COLUMNS = ["measure", "this tree", "kernels built", "before", "before / this", "target"]


# ----------------------------------------------------------------------------------- workers
def model_and_inputs(case: str):
    """The model of ``case`` in eval mode and its input batch."""
    import torch

    torch.manual_seed(0)
    if case == "moe":
        import sparsenn

        return sparsenn.SparseMoE(512, 2048, 8, k=2).eval(), (torch.randn(4096, 512),)
    if case == "gcn":
        from models.gcn import GCN
        from models.planetoid import PlanetoidDataModule

        cora = PlanetoidDataModule("Cora")
        cora.setup("fit")
        return GCN(1433, 7, hidden_channels=128).eval(), (cora.graph.x, cora.graph.edge_index)
    if case == "autoencoder":
        from models.autoencoder import SparseAutoencoder

        return SparseAutoencoder(784, 256, "csr", sparsity=0.9, dense_epochs=0).eval(), (torch.rand(64, 784),)
    from models.bigbird import BigBirdClassifier

    lengths = torch.randint(64, 1024, (64, 1))
    return BigBirdClassifier().eval(), (torch.randint(1, 20000, (64, 1024)), torch.arange(1024) >= lengths)


def forward_worker(case: str) -> dict:
    """First and second forward of ``case`` (this process has an empty kernel cache)."""
    import torch

    from sparsenn.compiler.backend import jit

    model, inputs = model_and_inputs(case)
    with torch.no_grad():
        started, compilers, thread = time.perf_counter(), _children_cpu(), time.thread_time()
        model(*inputs)
        first, thread = time.perf_counter() - started, time.thread_time() - thread
        compilers = _children_cpu() - compilers
        started, again = time.perf_counter(), time.thread_time()
        model(*inputs)
        second, again = time.perf_counter() - started, time.thread_time() - again
    return {"first_s": first, "second_s": second, "builds": jit.builds, "compiler_cpu_s": compilers,
            "first_cpu_extra_s": thread - again,
            "sources": [str(p) for p in Path(os.environ["SPARSENN_CACHE_DIR"]).glob("*.cpp")]}


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's finished child processes: the compilers."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kernel_worker(source: str) -> dict:
    """One kernel built into an empty cache."""
    from sparsenn.compiler.backend import jit

    started = time.perf_counter()
    jit.load_library(source, "coldstart")
    return {"build_s": time.perf_counter() - started, "builds": jit.builds}


# ----------------------------------------------------------------------------------- driver
def in_fresh_process(tree: Path, args: list[str], stdin: str = "") -> dict:
    """This script's worker ``args`` in a fresh process importing ``tree``'s sparsenn, with an empty cache."""
    with tempfile.TemporaryDirectory(prefix="coldstart-") as cache:
        env = {**os.environ, "PYTHONPATH": str(tree), "SPARSENN_CACHE_DIR": cache, "COLDSTART_TREE": str(tree),
               "SPARSENN_QUIET_BUILDS": "1"}
        done = subprocess.run([sys.executable, __file__, *args], env=env, input=stdin, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"worker {args} on {tree} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.splitlines()[-1])
        if "sources" in result:  # the kernels' sources, read before the cache goes
            result["sources"] = [Path(path).read_text() for path in result["sources"]]
        return result


def wall_time(tree: Path, command: list[str]) -> float:
    """Seconds ``command`` takes in a fresh process importing ``tree``'s sparsenn."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    subprocess.run(command, env=env, capture_output=True, check=True, timeout=600, cwd=tree)
    return time.perf_counter() - started


STARTUP = {
    "import torch": ["-c", "import torch"],
    "import sparsenn": ["-c", "import sparsenn"],
    "import sparsenn; sparsenn.einsum (torch and the compiler)": ["-c", "import sparsenn; sparsenn.einsum"],
    "sparsenn --help (python -m sparsenn --help)": ["-m", "sparsenn", "--help"],
}


def measure(trees: dict[str, Path], repeats: int) -> dict:
    """Every measurement for every tree, interleaved: name -> tree label -> list of results."""
    runs: dict[str, dict[str, list]] = {}
    for _ in range(repeats):
        for case in CASES:
            for label, tree in trees.items():
                runs.setdefault(case, {}).setdefault(label, []).append(in_fresh_process(tree, ["--worker", case]))
                print(f"{case} {label}: {runs[case][label][-1]['first_s']:.2f} s", flush=True)
        for name, args in STARTUP.items():
            for label, tree in trees.items():
                runs.setdefault(name, {}).setdefault(label, []).append(wall_time(tree, [sys.executable, *args]))
    # Each tree builds the kernels its own forwards generated (another tree's runtime
    # headers need not compile them), interleaved.
    own = {label: sorted({s for case in CASES for run in runs[case][label] for s in run["sources"]}) for label in trees}
    for n in range(max(map(len, own.values()))):
        for label, tree in trees.items():
            if n < len(own[label]):
                result = in_fresh_process(tree, ["--kernel"], own[label][n])
                runs.setdefault("kernel", {}).setdefault(label, []).append(result["build_s"])
    print(f"{len(own['this'])} kernels built singly", flush=True)
    for case in CASES:
        for results in runs[case].values():
            for result in results:
                result["sources"] = len(result["sources"])
    return runs


def rows_of(runs: dict, before: bool) -> tuple[list[list], list[str]]:
    """The table rows and the targets' notes."""
    rows, notes = [], []

    def compare(this: float, runs_before: list | None) -> list:
        if not before or not runs_before:
            return ["", ""]
        value = statistics.median(runs_before)
        return [round(value, 3), round(value / this, 2) if this else ""]

    for case, title in CASES.items():
        this = runs[case]["this"]
        first = statistics.median(r["first_s"] for r in this)
        target = f"≤ {FIRST_FORWARD_TARGET_S:g} s" if case in REFERENCE_MODELS else ""
        earlier = [r["first_s"] for r in runs[case].get("before", [])]
        built = f"{this[0]['builds']}" + (f" (before: {runs[case]['before'][0]['builds']})" if before else "")
        rows.append([f"{title}: first forward, empty cache (s)", round(first, 3), built, *compare(first, earlier),
                     target])
        second = statistics.median(r["second_s"] for r in this)
        rows.append([f"{title}: second forward (s)", round(second, 3), "", "", "", ""])
        for key, what in (("compiler_cpu_s", "compilers' CPU time in the first forward"),
                          ("first_cpu_extra_s", "calling thread's CPU time, first forward minus second")):
            value = statistics.median(r[key] for r in this)
            rows.append([f"{title}: {what} (s)", round(value, 3), "",
                         *compare(value, [r[key] for r in runs[case].get("before", [])]), ""])
        if case in REFERENCE_MODELS and first > FIRST_FORWARD_TARGET_S:
            notes.append(f"{title}: first forward {first:.2f} s, {first - FIRST_FORWARD_TARGET_S:.2f} s over the "
                         f"{FIRST_FORWARD_TARGET_S:g} s target (its second forward alone takes {second:.2f} s).")
    kernels = runs["kernel"]["this"]
    kernel = statistics.median(kernels)
    rows.append([f"single kernel build, median of {len(kernels)} (s)", round(kernel, 3), "",
                 *compare(kernel, runs["kernel"].get("before")), f"≤ {KERNEL_TARGET_S:g} s"])
    rows.append([f"single kernel build, slowest of {len(kernels)} (s)", round(max(kernels), 3), "", "", "", ""])
    if kernel > KERNEL_TARGET_S:
        notes.append(f"Single kernel: median {kernel:.2f} s, {kernel - KERNEL_TARGET_S:.2f} s over the target.")
    for name in STARTUP:
        value = statistics.median(runs[name]["this"])
        rows.append([f"{name}: wall time (s)", round(value, 3), "", *compare(value, runs[name].get("before")),
                     "well under 1 s" if "--help" in name else ""])
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout to measure interleaved (e.g. main)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "coldstart")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--kernel", action="store_true", help=argparse.SUPPRESS)  # source on stdin
    args = parser.parse_args()
    if args.worker or args.kernel:
        print(json.dumps(forward_worker(args.worker) if args.worker else kernel_worker(sys.stdin.read())))
        return
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    trees = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    runs = measure(trees, args.repeats)
    rows, notes = rows_of(runs, args.before is not None)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from structured import git_commit, machine_info

    info = machine_info()
    if info["loadavg"][0] > info["cores"]:
        notes.insert(0, f"Load average {info['loadavg'][0]:.1f} on {info['cores']} cores at the end: other processes "
                        "shared the cores, so absolute times are inflated; the interleaved ratios are the comparison.")
    if args.before:
        notes.insert(0, f"'before' is the checkout at `{git_commit(args.before.resolve())}`, measured in the same "
                        "run, interleaved.")
    record = {"benchmark": "coldstart", "cpu": info["cpu"], "machine": f"{info['cores']} cores, L2 {info['l2']}",
              "torch": info["torch"], "commit": info["git"], "date": info["date"], "load": info["loadavg"][0],
              "command": " ".join(["python", "benchmarks/coldstart.py", *sys.argv[1:]]), "columns": COLUMNS,
              "rows": rows, "notes": notes, "raw": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coldstart.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    for row in rows:
        print(" | ".join(str(c) for c in row))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
