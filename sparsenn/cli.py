"""The ``sparsenn`` command: Lightning's ``LightningCLI`` over the reference models, plus
an inference benchmark and the README's main job.

``sparsenn fit | validate | test | predict --config configs/<model>.yaml`` trains or evaluates
the ``model:`` and ``data:`` of a config (``class_path`` + ``init_args``: any LightningModule
and LightningDataModule, e.g. ``models.gcn.GCN`` with ``models.planetoid.PlanetoidDataModule``)
with the ``trainer:`` settings; ``sparsenn bench --config ... [--ckpt_path ...]`` times CPU
inference of the model against the same weights in torch.sparse, dense PyTorch and PyG
(``models/bench.py``); ``sparsenn run`` is the main job (:data:`MAIN_JOB`). Any setting can be
overridden on the command line (``--trainer.max_epochs 5``, ``--model.init_args.hidden_channels 16``);
``--print_config`` prints the resolved config. Config paths are looked up in the working
directory, then in the repository. Kernel builds are logged on the ``sparsenn`` logger.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from lightning.pytorch.cli import LightningCLI

if TYPE_CHECKING:
    from models.bench import BenchResult

__all__ = ["main", "SparsennCLI", "SparsennTrainer", "SavePredictions", "TorchThreads", "MainJobStep", "MAIN_JOB",
           "run_main_job"]

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_JSON, BENCH_PNG = "bench.json", "bench.png"


class SparsennTrainer(L.Trainer):
    """Lightning's Trainer with one more entry point, :meth:`bench`."""

    def bench(self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None,
              ckpt_path: str | None = None, threads: tuple[int, ...] = (1, 2), warmup: int = 10, repeats: int = 50,
              first_call: bool = True, name: str | None = None, output_dir: str | None = None) -> BenchResult:
        """Benchmark CPU inference against torch.sparse, dense PyTorch (and PyG for GCN) with the same weights.

        Args:
            model: a LightningModule implementing the bench protocol of ``models/bench.py``.
            datamodule: the data its bench batch comes from.
            ckpt_path: checkpoint whose weights are benchmarked (default: the model as built, untrained).
            threads: torch thread counts to time at.
            warmup: untimed calls per variant before timing.
            repeats: timed calls per variant; the median is reported.
            first_call: also time the first sparsenn call in a fresh process with an empty kernel cache.
            name: title of the table and chart (default: the model's and data module's class names).
            output_dir: where bench.json and bench.png go (default: the trainer's default_root_dir).
        """
        from models.bench import BenchSettings, format_table, run_bench, write_chart

        if datamodule is None:
            raise ValueError("bench needs a data module: give one under data: in the config")
        settings = BenchSettings(tuple(threads), warmup, repeats, first_call)
        if ckpt_path is not None:
            _load_weights(model, ckpt_path)
        elif self.global_step == 0:
            print(f"bench: no ckpt_path given: {type(model).__name__} is benchmarked with its initial, untrained "
                  "weights")
        datamodule.prepare_data()
        datamodule.setup("test")
        result = run_bench(model, datamodule, settings, name)
        print(format_table(result))
        out = Path(self.default_root_dir if output_dir is None else output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / BENCH_JSON).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {out / BENCH_JSON} and {write_chart([result], out / BENCH_PNG)}")
        return result


def _load_weights(model: L.LightningModule, ckpt_path: str) -> None:
    """Load a Lightning checkpoint's weights into ``model`` as ``Trainer.test(ckpt_path=...)`` does."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found; train one with `sparsenn fit --config ...` "
                                "(the config's ModelCheckpoint callback says where it goes)")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint (it has no 'state_dict')")
    model.on_load_checkpoint(checkpoint)
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as exc:
        raise ValueError(f"the weights in {path} do not fit the config's model: {exc}") from exc


class SavePredictions(BasePredictionWriter):
    """Saves the predictions of ``sparsenn predict`` with ``torch.save`` to ``path`` (default:
    ``<trainer.default_root_dir>/predictions.pt``) as a list with one entry per batch; under
    several processes, rank ``r`` writes ``<path>.rank<r>``."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.path = None if path is None else Path(path)

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        path = Path(trainer.default_root_dir) / "predictions.pt" if self.path is None else self.path
        if trainer.world_size > 1:
            path = path.with_name(f"{path.name}.rank{trainer.global_rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(list(predictions), path)
        print(f"saved {len(predictions)} batch(es) of predictions to {path}")


class TorchThreads(Callback):
    """Runs fit / validate / test / predict with ``threads`` torch (OpenMP) threads and restores
    the previous count afterwards: on a small or shared machine one thread per process avoids
    OpenMP contention, which costs small models like these far more than it gains."""

    def __init__(self, threads: int = 1) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.threads = threads
        self._before: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._before = torch.get_num_threads()
        torch.set_num_threads(self.threads)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._before is not None:
            torch.set_num_threads(self._before)
            self._before = None


class SparsennCLI(LightningCLI):
    """LightningCLI over any LightningModule and LightningDataModule (``class_path`` in the
    config), with :class:`SparsennTrainer` and its ``bench`` subcommand."""

    def __init__(self, args: Sequence[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"description": __doc__.split("\n\n")[0].replace("\n", " ")})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # config.yaml, like model.ckpt, is the last run's
        super().__init__(model_class=None, datamodule_class=None, trainer_class=SparsennTrainer,
                         args=None if args is None else _resolved_config_args(args), run=run, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {**LightningCLI.subcommands(), "bench": {"model", "datamodule"}}

    def instantiate_classes(self) -> None:
        """Build model, data and trainer; a bad setting they reject is a usage error (exit 2)."""
        try:
            super().instantiate_classes()
        except (TypeError, ValueError) as exc:
            self._parser(self.subcommand).error(f"invalid config: {exc}")

    def bench(self, **kwargs: Any) -> None:
        """The ``bench`` subcommand: :meth:`SparsennTrainer.bench`, its result kept in ``bench_result``;
        a model without the bench protocol is a usage error."""
        from models.bench import check_benchmarkable

        try:
            check_benchmarkable(self.model)
        except TypeError as exc:
            self._parser("bench").error(str(exc))
        self.bench_result = self.trainer.bench(**kwargs)


def _resolved_config_args(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--config``/``-c`` file that does not exist from the working directory
    but does from the repository root replaced by the latter."""
    out = list(args)
    for index, item in enumerate(out):
        prefix = next((p for p in ("--config=", "-c=") if item.startswith(p)), None)
        if prefix is not None:
            out[index] = prefix + _config_path(item[len(prefix):])
        elif item in ("--config", "-c") and index + 1 < len(out):
            out[index + 1] = _config_path(out[index + 1])
    return out


def _config_path(value: str) -> str:
    if Path(value).exists() or not (REPO_ROOT / value).is_file():
        return value
    return str(REPO_ROOT / value)


def _show_sparsenn_logs() -> None:
    """Kernel builds are logged on ``sparsenn`` at INFO: print them unless logging is already set up."""
    logger = logging.getLogger("sparsenn")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _quiet_lightning_hints() -> None:
    """Hide warnings that are noise here: data-loader worker hints (the data sits in memory),
    a deprecation inside Lightning, and LightningCLI's note on ``args`` (which :func:`main`
    passes with config paths resolved)."""
    for message in (".*does not have many workers.*", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
                    ".*LightningCLI's args parameter is intended to run from within Python.*"):
        warnings.filterwarnings("ignore", message=message)


def _importable_models() -> None:
    """The reference models are the repository's ``models/`` package: make it importable from
    any working directory when sparsenn runs from a source checkout (editable install)."""
    if (REPO_ROOT / "models" / "__init__.py").is_file() and str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


# ------------------------------------------------------------------------------- main job
@dataclasses.dataclass(frozen=True)
class MainJobStep:
    """One model of the main job: its ``config`` with command-line style ``overrides``,
    trained first when ``train`` (else benchmarked with its initial weights), then benchmarked
    with the ``bench`` settings of :meth:`SparsennTrainer.bench`."""

    config: str
    overrides: tuple[str, ...] = ()
    train: bool = True
    bench: dict[str, Any] = dataclasses.field(default_factory=dict)


MAIN_JOB = (
    MainJobStep("configs/gcn_cora.yaml"),
    MainJobStep("configs/autoencoder_mnist.yaml", overrides=("--trainer.max_epochs=2",)),  # dense, then pruned
    # BigBird at sequence 4096 with its initial weights (training takes hours on 2 cores): IMDB reviews from
    # ../shared/data/imdb, else the repository's small fixture; 4 reviews per call keep dense attention in memory,
    # and few calls keep its ~9 s per call within the job's minutes.
    MainJobStep("configs/bigbird_imdb.yaml", train=False, bench={"warmup": 1, "repeats": 3}, overrides=(
        "--model.init_args.max_length=4096", "--data.init_args.max_length=4096", "--data.init_args.batch_size=4",
        *(() if (REPO_ROOT.parent / "shared" / "data" / "imdb").is_dir()
          else ("--data.init_args.data_dir=models/data/imdb_tiny",)))),
)
"""The models ``sparsenn run`` trains and benchmarks, in order (a few minutes on 2 cores)."""


def run_main_job(output_dir: str | Path = "runs/main", steps: Sequence[MainJobStep] = MAIN_JOB,
                 bench: dict[str, Any] | None = None) -> list[BenchResult]:
    """Train and benchmark each step's model, print every table and write one chart of all
    (``<output_dir>/bench.png``) and their results (``bench.json``). ``bench`` overrides the
    bench settings of every step (e.g. ``{"repeats": 5}``)."""
    from models.bench import format_table, write_chart

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
        settings = {**step.bench, **(bench or {})}
        results.append(cli.trainer.bench(cli.model, cli.datamodule, name=name, output_dir=str(root), **settings))
    print("\n" + "\n\n".join(format_table(result) for result in results))
    (output_dir / BENCH_JSON).write_text(json.dumps([r.to_json() for r in results], indent=1))
    print(f"\nwrote {output_dir / BENCH_JSON} and {write_chart(results, output_dir / BENCH_PNG)}")
    return results


def _main_job_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="sparsenn run", description="The main job: train the reference models "
                                     "(GCN on Cora, the sparse autoencoder on MNIST, short schedules) and benchmark "
                                     "their CPU inference; prints the tables, writes bench.png and bench.json.")
    parser.add_argument("--output_dir", default="runs/main", help="where checkpoints and results go")
    parser.add_argument("--repeats", type=int, help="timed calls per variant (default: bench's)")
    parser.add_argument("--warmup", type=int, help="untimed calls per variant (default: bench's)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    overrides = {key: value for key, value in (("repeats", args.repeats), ("warmup", args.warmup))
                 if value is not None}
    results = run_main_job(args.output_dir, bench=overrides)
    return 0 if all(result.ok for result in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sparsenn`` / ``python -m sparsenn``: ``run`` is the main job, anything
    else goes to :class:`SparsennCLI`. Returns the exit status (1 when a benchmarked variant's
    output disagrees with sparsenn's; usage errors exit with 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _importable_models()
    _show_sparsenn_logs()
    _quiet_lightning_hints()
    try:
        if argv[:1] == ["run"]:
            return _main_job_command(argv[1:])
        cli = SparsennCLI(argv)
    except FileNotFoundError as exc:  # a data file or checkpoint: the message says where and how to get it
        print(f"sparsenn: error: {exc}", file=sys.stderr)
        return 2
    return 1 if cli.subcommand == "bench" and not cli.bench_result.ok else 0
