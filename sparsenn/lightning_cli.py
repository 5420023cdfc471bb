"""The Lightning side of the ``sparsenn`` command (:mod:`sparsenn.cli`): ``LightningCLI`` over
any LightningModule and LightningDataModule, a Trainer with a ``bench`` entry point, and the
callbacks the configs use. Needs the ``models`` extra."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sparsenn.cli import DESCRIPTION, INSTALL_EXTRA, checkout, no_checkout_error

try:
    import lightning as L
    from lightning.pytorch.callbacks import BasePredictionWriter, Callback
    from lightning.pytorch.cli import LightningCLI
except ModuleNotFoundError as exc:
    raise ModuleNotFoundError(f"the sparsenn command's Lightning classes need the models extra ({exc}): "
                              f"{INSTALL_EXTRA}", name=exc.name) from exc

if TYPE_CHECKING:
    from models.bench import BenchResult

__all__ = ["SparsennCLI", "SparsennTrainer", "SavePredictions", "TorchThreads", "BENCH_JSON", "BENCH_PNG"]

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
        kwargs.setdefault("parser_kwargs", {"description": DESCRIPTION})
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
    but does from the checkout replaced by the latter."""
    out = list(args)
    for index, item in enumerate(out):
        prefix = next((p for p in ("--config=", "-c=") if item.startswith(p)), None)
        if prefix is not None:
            out[index] = prefix + _config_path(item[len(prefix):])
        elif item in ("--config", "-c") and index + 1 < len(out):
            out[index + 1] = _config_path(out[index + 1])
    return out


def _config_path(value: str) -> str:
    """``value`` as found from the working directory, else from the checkout."""
    if Path(value).exists():
        return value
    root = checkout()
    if root is None:
        raise no_checkout_error(f"config {value} is not in the working directory; looking it up")
    return str(root / value) if (root / value).is_file() else value
