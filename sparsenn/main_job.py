"""The main job, ``sparsenn run``: train and benchmark the reference models of the checkout,
print their tables and write one chart of all (:data:`MAIN_JOB` lists them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparsenn.cli import REPO_ROOT, checkout, no_checkout_error

if TYPE_CHECKING:
    from models.bench import BenchResult

__all__ = ["MainJobStep", "MAIN_JOB", "IMDB_SAMPLE", "run_main_job", "main_job_command"]

IMDB_SAMPLE = REPO_ROOT / "models" / "data" / "imdb_sample"
"""Real IMDB reviews the checkout ships (256 training, 64 test): enough for BigBird's bench batch."""


@dataclasses.dataclass(frozen=True)
class MainJobStep:
    """One model of the main job: its ``config`` with command-line style ``overrides``,
    trained first when ``train`` (else benchmarked with its initial weights), then benchmarked
    with the ``bench`` settings of :meth:`sparsenn.lightning_cli.SparsennTrainer.bench`."""

    config: str
    overrides: tuple[str, ...] = ()
    train: bool = True
    bench: dict[str, Any] = dataclasses.field(default_factory=dict)


MAIN_JOB = (
    MainJobStep("configs/gcn_cora.yaml"),
    MainJobStep("configs/autoencoder_mnist.yaml", overrides=("--trainer.max_epochs=2",)),  # dense, then pruned
    # BigBird at sequence 4096 with its initial weights (training takes hours on 2 cores), on the shipped sample of
    # real reviews; 4 reviews per call keep dense attention in memory, and few calls keep its ~9 s per call within
    # the job's minutes.
    MainJobStep("configs/bigbird_imdb.yaml", train=False, bench={"warmup": 1, "repeats": 3}, overrides=(
        "--model.init_args.max_length=4096", "--data.init_args.max_length=4096", "--data.init_args.batch_size=4",
        f"--data.init_args.data_dir={IMDB_SAMPLE}", "--data.init_args.val_size=64")),
)
"""The models ``sparsenn run`` trains and benchmarks, in order (a few minutes on 2 cores)."""


def run_main_job(output_dir: str | Path = "runs/main", steps: Sequence[MainJobStep] = MAIN_JOB,
                 bench: dict[str, Any] | None = None) -> list[BenchResult]:
    """Train and benchmark each step's model, print every table and write one chart of all
    (``<output_dir>/bench.png``) and their results (``bench.json``). ``bench`` overrides the
    bench settings of every step (e.g. ``{"repeats": 5}``). Each model's kernels are built
    (:func:`sparsenn.precompile` on its bench batch) before it is timed."""
    from models.bench import busy_warning, format_table, write_chart
    from sparsenn.precompile import precompile
    from sparsenn.lightning_cli import BENCH_JSON, BENCH_PNG, SparsennCLI

    output_dir = Path(output_dir)
    results = []
    for step in steps:
        name = Path(step.config).stem
        root = output_dir / name
        cli = SparsennCLI(["--config", step.config, f"--trainer.default_root_dir={root}", *step.overrides], run=False)
        if step.train:
            start = time.perf_counter()
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            print(f"{name}: trained in {time.perf_counter() - start:.1f} s")
        cli.datamodule.prepare_data()
        cli.datamodule.setup("test")
        inputs, _ = cli.model.bench_batch(cli.datamodule)
        done = precompile(cli.model, *inputs, backward=False)
        print(f"{name}: built {done.kernels_built} kernel(s) in {done.seconds:.1f} s before timing")
        settings = {**step.bench, **(bench or {})}
        results.append(cli.trainer.bench(cli.model, cli.datamodule, name=name, output_dir=str(root), **settings))
    print("\n" + "\n\n".join(format_table(result) for result in results))
    (output_dir / BENCH_JSON).write_text(json.dumps([r.to_json() for r in results], indent=1))
    print(f"\nwrote {output_dir / BENCH_JSON} and {write_chart(results, output_dir / BENCH_PNG)}")
    for result in results:
        warning = busy_warning(result)
        if warning:
            print(f"sparsenn run: warning: {result.name}: {warning}", file=sys.stderr)
    return results


def main_job_command(argv: Sequence[str]) -> int:
    """``sparsenn run [--output_dir ...] [--repeats N] [--warmup N]``: the exit status."""
    parser = argparse.ArgumentParser(prog="sparsenn run", description="The main job: train the reference models "
                                     "(GCN on Cora, the sparse autoencoder on MNIST, short schedules) and benchmark "
                                     "their CPU inference, and BigBird's at sequence 4096; prints the tables, writes "
                                     "bench.png and bench.json.")
    parser.add_argument("--output_dir", default="runs/main", help="where checkpoints and results go")
    parser.add_argument("--repeats", type=int, help="timed calls per variant (default: bench's)")
    parser.add_argument("--warmup", type=int, help="untimed calls per variant (default: bench's)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if checkout() is None:
        raise no_checkout_error("sparsenn run")
    overrides = {key: value for key, value in (("repeats", args.repeats), ("warmup", args.warmup))
                 if value is not None}
    results = run_main_job(args.output_dir, bench=overrides)
    return 0 if all(result.ok for result in results) else 1
