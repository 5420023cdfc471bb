"""The ``sparsenn`` command: train a reference model from a YAML config, then benchmark its
CPU inference against PyG and plain ``torch.sparse``.

``sparsenn train --config configs/gcn_cora.yaml`` trains the two-layer GCN of ``models/`` with
Lightning and saves its ``state_dict``; ``sparsenn bench --config ...`` loads those weights,
checks that sparsenn, PyG's ``GCNConv`` and a ``torch.sparse`` CSR model give the same
logits, and prints median inference times with 1 and 2 threads and the first-call (compile)
time; ``sparsenn run`` does both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch_geometric.data import Data

    from models import GCN

__all__ = ["main", "train", "bench", "GCNConfig", "BenchConfig", "CommandError", "load_config"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/gcn_cora.yaml"
WEIGHTS_FILE, METRICS_FILE, BENCH_FILE = "model.pt", "metrics.json", "bench.json"
RTOL, ATOL = 1e-4, 1e-5
"""Outputs agree when ``|ours - ref| <= ATOL * max|ref| + RTOL * |ref|`` elementwise (float32)."""


class CommandError(ValueError):
    """A bad config, argument or missing input file: reported as a usage error, without a traceback."""


# ------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """How ``bench`` times inference: ``warmup`` untimed calls, then the median of ``repeats``
    timed calls per model, for each thread count in ``threads``."""

    threads: tuple[int, ...] = (1, 2)
    warmup: int = 10
    repeats: int = 50
    cold_start: bool = True
    """Also time the first call in a fresh process with an empty kernel cache."""


@dataclasses.dataclass(frozen=True)
class GCNConfig:
    """Hyperparameters of the reference GCN run (keys of ``configs/gcn_*.yaml``)."""

    dataset: str = "Cora"
    data_root: str | None = None
    normalize_features: bool = True
    seed: int = 0
    hidden_channels: int = 16
    dropout: float = 0.5
    cached: bool = True
    lr: float = 0.01
    weight_decay: float = 5e-4
    max_epochs: int = 200
    train_threads: int | None = 1
    output_dir: str = "runs/gcn_cora"
    bench: BenchConfig = BenchConfig()


MODEL_NAMES = ("gcn",)
"""Values of a config's ``model`` key that the command knows."""


def _checked(value: Any, kind: type | tuple[type, ...], key: str, where: str) -> Any:
    """``value`` if it is a ``kind`` (ints pass as floats; bools never pass as numbers)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise TypeError(f"{where}: {key} must be {' or '.join(k.__name__ for k in kinds)}, got a bool")
    if not isinstance(value, kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise TypeError(f"{where}: {key} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _bench_config(raw: Any, where: str) -> BenchConfig:
    if not isinstance(raw, Mapping):
        raise TypeError(f"{where}: bench must be a mapping, got {type(raw).__name__}")
    _reject_unknown(raw, BenchConfig, f"{where}: bench")
    values = dataclasses.asdict(BenchConfig())
    for key in ("warmup", "repeats"):
        if key in raw:
            values[key] = _checked(raw[key], int, f"bench.{key}", where)
    if "cold_start" in raw:
        values["cold_start"] = _checked(raw["cold_start"], bool, "bench.cold_start", where)
    if "threads" in raw:
        threads = _checked(raw["threads"], list, "bench.threads", where)
        values["threads"] = tuple(_checked(t, int, "bench.threads[]", where) for t in threads)
    return _validated_bench(BenchConfig(**values), where)


def _validated_bench(config: BenchConfig, where: str) -> BenchConfig:
    if not config.threads or any(t < 1 for t in config.threads) or len(set(config.threads)) < len(config.threads):
        raise ValueError(f"{where}: bench.threads must be a non-empty list of distinct positive ints, "
                         f"got {list(config.threads)}")
    if config.warmup < 0:
        raise ValueError(f"{where}: bench.warmup must be >= 0, got {config.warmup}")
    if config.repeats < 1:
        raise ValueError(f"{where}: bench.repeats must be >= 1, got {config.repeats}")
    return config


def _reject_unknown(raw: Mapping, cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def config_from_mapping(raw: Any, where: str = "config") -> GCNConfig:
    """A validated :class:`GCNConfig` from a parsed YAML mapping (``model: gcn`` plus any fields)."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"{where}: expected a mapping of settings, got {type(raw).__name__}")
    raw = dict(raw)
    model = raw.pop("model", None)
    if not isinstance(model, str) or model not in MODEL_NAMES:
        raise ValueError(f"{where}: model must be one of {', '.join(MODEL_NAMES)}, got {model!r}")
    _reject_unknown(raw, GCNConfig, where)
    values: dict[str, Any] = {}
    types: dict[str, type | tuple[type, ...]] = {
        "dataset": str, "data_root": (str, type(None)), "normalize_features": bool, "seed": int,
        "hidden_channels": int, "dropout": float, "cached": bool, "lr": float, "weight_decay": float,
        "max_epochs": int, "train_threads": (int, type(None)), "output_dir": str,
    }
    for key, kind in types.items():
        if key in raw:
            values[key] = _checked(raw[key], kind, key, where)
    if "bench" in raw:
        values["bench"] = _bench_config(raw["bench"], where)
    config = GCNConfig(**values)
    if config.hidden_channels < 1:
        raise ValueError(f"{where}: hidden_channels must be positive, got {config.hidden_channels}")
    if config.max_epochs < 1:
        raise ValueError(f"{where}: max_epochs must be positive, got {config.max_epochs}")
    if config.train_threads is not None and config.train_threads < 1:
        raise ValueError(f"{where}: train_threads must be positive or null, got {config.train_threads}")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"{where}: dropout must be in [0, 1), got {config.dropout}")
    if config.lr <= 0 or config.weight_decay < 0:
        raise ValueError(f"{where}: need lr > 0 and weight_decay >= 0, got lr={config.lr}, "
                         f"weight_decay={config.weight_decay}")
    return config


def resolve_config_path(path: str | os.PathLike) -> Path:
    """``path`` as given if it exists, else relative to the repository root (so the default
    ``configs/gcn_cora.yaml`` is found from any working directory)."""
    given = Path(path)
    for candidate in (given, REPO_ROOT / given):
        if candidate.is_file():
            return candidate
    raise CommandError(f"config file {str(path)!r} not found (looked in {Path.cwd()} and {REPO_ROOT})")


def load_config(path: str | os.PathLike) -> GCNConfig:
    """Read and validate a YAML config such as ``configs/gcn_cora.yaml``."""
    import yaml

    resolved = resolve_config_path(path)
    try:
        raw = yaml.safe_load(resolved.read_text())
    except yaml.YAMLError as exc:
        raise CommandError(f"config {resolved} is not valid YAML: {exc}") from exc
    return config_from_mapping(raw, where=str(resolved))


# ------------------------------------------------------------------------------------- train
def _models():
    """The repository's ``models`` package (reference models and data)."""
    try:
        import models
    except ModuleNotFoundError as exc:
        if exc.name != "models":
            raise
        raise CommandError(
            f"the reference models are the repository's models/ package ({REPO_ROOT / 'models'}), which is not "
            "importable here: run sparsenn from the repository root or put the repository on PYTHONPATH"
        ) from exc
    return models


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's start-up banner and its hints about data loader workers."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
            yield
    finally:
        logger.setLevel(level)


def _load_data(config: GCNConfig) -> Data:
    try:
        return _models().load_planetoid(config.dataset, config.data_root, config.normalize_features)
    except ValueError as exc:  # missing raw files: a bad dataset name or data_root
        raise CommandError(str(exc)) from exc


def _build_model(config: GCNConfig, data: Data) -> GCN:
    return _models().GCN(int(data.num_features), int(data.y.max()) + 1, hidden_channels=config.hidden_channels,
                         dropout=config.dropout, lr=config.lr, weight_decay=config.weight_decay,
                         cached=config.cached)


def train(config: GCNConfig, output_dir: Path, data: Data | None = None) -> dict[str, Any]:
    """Train the GCN full-batch with Lightning on CPU with ``train_threads`` threads; save
    ``model.pt`` (the state_dict) and ``metrics.json`` (per-epoch training loss, final
    validation and test accuracy) in ``output_dir``."""
    import lightning as L

    models = _models()
    data = _load_data(config) if data is None else data
    torch.manual_seed(config.seed)
    model = _build_model(config, data)
    datamodule = models.PlanetoidDataModule.from_data(config.dataset, data)
    threads_before = torch.get_num_threads()
    threads = threads_before if config.train_threads is None else config.train_threads
    try:
        torch.set_num_threads(threads)
        with _quiet_lightning():
            trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=config.max_epochs, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, log_every_n_steps=1)
            start = time.perf_counter()
            trainer.fit(model, datamodule=datamodule)
            seconds = time.perf_counter() - start
            val_acc = float(trainer.callback_metrics["val_acc"])
            test_acc = float(trainer.test(model, datamodule=datamodule, verbose=False)[0]["test_acc"])
    finally:
        torch.set_num_threads(threads_before)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), output_dir / WEIGHTS_FILE)
    metrics = {"dataset": config.dataset, "epochs": config.max_epochs, "seed": config.seed, "threads": threads,
               "train_seconds": seconds, "train_loss": model.train_losses, "val_acc": val_acc, "test_acc": test_acc}
    (output_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1))
    losses = model.train_losses
    print(f"trained a 2-layer GCN (sparsenn.SparseGCNConv) on {config.dataset}: {config.max_epochs} epochs in "
          f"{seconds:.1f} s on {threads} thread(s), train loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"val acc {val_acc:.3f}, test acc {test_acc:.3f}")
    print(f"saved weights to {output_dir / WEIGHTS_FILE}")
    return metrics


# ------------------------------------------------------------------------------------- bench
def _load_trained(config: GCNConfig, output_dir: Path, data: Data) -> GCN:
    path = output_dir / WEIGHTS_FILE
    if not path.is_file():
        raise CommandError(f"no trained weights at {path}; run `sparsenn train --config ...` first")
    model = _build_model(config, data)
    try:
        model.load_state_dict(torch.load(path, weights_only=True))
    except RuntimeError as exc:
        raise CommandError(f"weights in {path} do not fit the config's model: {exc}") from exc
    return model.eval()


def _median_ms(calls: list[Callable[[], Any]], warmup: int, repeats: int) -> list[float]:
    """Median wall time (ms) of each call; timed round-robin so background load hits all alike."""
    for call in calls:
        for _ in range(warmup):
            call()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, samples):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(times) for times in samples]


def _first_call_ms(config_path: str, output_dir: Path, threads: int) -> dict[str, float | int]:
    """The first inference call of the sparsenn GCN in a fresh process whose kernel cache is
    empty, so it includes planning and compiling every kernel; torch runs ``threads`` threads."""
    paths = [str(Path(_models().__file__).resolve().parents[1]), str(REPO_ROOT)]
    output_dir = output_dir.resolve()
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    with tempfile.TemporaryDirectory(prefix="sparsenn-cold-cache-") as cache:
        env = {**os.environ, "SPARSENN_CACHE_DIR": cache, "PYTHONPATH": os.pathsep.join(paths)}
        code = ("import sys; from sparsenn.cli import _report_first_call; "
                "_report_first_call(sys.argv[1], sys.argv[2], int(sys.argv[3]))")
        done = subprocess.run([sys.executable, "-c", code, config_path, str(output_dir), str(threads)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"first-call measurement failed:\n{done.stderr.strip()}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def _report_first_call(config_path: str, output_dir: str, threads: int) -> None:
    """Child side of :func:`_first_call_ms`: prints one JSON line."""
    torch.set_num_threads(threads)
    config = load_config(config_path)
    data = _load_data(config)
    model = _load_trained(config, Path(output_dir), data)
    with torch.no_grad():  # not inference_mode: SparseTensor cannot be built from inference tensors yet
        start = time.perf_counter()
        model(data.x, data.edge_index)
        first = (time.perf_counter() - start) * 1e3
    kernels = sum(1 for _ in Path(os.environ["SPARSENN_CACHE_DIR"]).rglob("*.so"))
    print(json.dumps({"threads": threads, "first_ms": first, "kernels_built": kernels}))


def _agreement(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, bool]:
    scale = float(reference.abs().max())
    return float((ours - reference).abs().max()), torch.allclose(ours, reference, rtol=RTOL, atol=ATOL * scale)


def bench(config: GCNConfig, output_dir: Path, config_path: str, data: Data | None = None) -> dict[str, Any]:
    """Time inference of the trained GCN: sparsenn vs the same weights in PyG's ``GCNConv`` and
    in ``torch.sparse.mm`` on CSR; check that all three give the same logits. Writes
    ``bench.json`` in ``output_dir``; ``result["ok"]`` is False when outputs disagree."""
    models = _models()
    data = _load_data(config) if data is None else data
    ours = _load_trained(config, output_dir, data)
    named = {"sparsenn": ours, "PyG GCNConv": models.PyGGCN(ours), "torch.sparse CSR": models.TorchCSRGCN(ours)}
    x, edge_index = data.x, data.edge_index
    threads_before = torch.get_num_threads()
    timings: dict[int, dict[str, float]] = {}
    with warnings.catch_warnings(), torch.no_grad():  # see _report_first_call on inference_mode
        warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
        logits = {name: model(x, edge_index) for name, model in named.items()}
        try:
            for threads in config.bench.threads:
                torch.set_num_threads(threads)
                calls = [lambda m=model: m(x, edge_index) for model in named.values()]
                timings[threads] = dict(zip(named, _median_ms(calls, config.bench.warmup, config.bench.repeats)))
        finally:
            torch.set_num_threads(threads_before)
    agreement = {name: _agreement(logits["sparsenn"], out) for name, out in logits.items() if name != "sparsenn"}
    test_acc = {name: float(models.accuracy(out, data.y, data.test_mask)) for name, out in logits.items()}
    first = _first_call_ms(config_path, output_dir, config.bench.threads[0]) if config.bench.cold_start else None
    result = {"dataset": config.dataset, "num_nodes": int(data.num_nodes), "num_edges": int(data.num_edges),
              "timings_ms": {str(t): row for t, row in timings.items()}, "test_acc": test_acc,
              "max_abs_diff": {name: diff for name, (diff, _) in agreement.items()},
              "ok": all(ok for _, ok in agreement.values()), "first_call": first}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / BENCH_FILE).write_text(json.dumps(result, indent=1))
    _print_bench(config, data, result)
    return result


def _print_bench(config: GCNConfig, data: Data, result: dict[str, Any]) -> None:
    layers = f"{int(data.num_features)} -> {config.hidden_channels} -> {int(data.y.max()) + 1}"
    print(f"\nGCN inference on {config.dataset} ({result['num_nodes']} nodes, {result['num_edges']} edges, "
          f"{layers}); median of {config.bench.repeats} calls after {config.bench.warmup} warm-up, "
          f"{'cached' if config.cached else 'per-call'} adjacency normalisation")
    names = list(result["test_acc"])
    print(f"{'threads':>7}  {names[0]:>12}" + "".join(f"  {n:>20}" for n in names[1:]))
    for threads, row in result["timings_ms"].items():
        ours = row["sparsenn"]
        cells = "".join(f"  {f'{row[n]:.3f} ms ({row[n] / ours:.2f}x)':>20}" for n in names[1:])
        print(f"{threads:>7}  {f'{ours:.3f} ms':>12}" + cells)
    print("(Nx) = that time / sparsenn's time: above 1 means sparsenn is faster")
    diffs = ", ".join(f"max |sparsenn - {n}| {d:.1e}" for n, d in result["max_abs_diff"].items())
    print(f"outputs {'agree' if result['ok'] else 'DISAGREE'} (rtol {RTOL:g}, atol {ATOL:g}*max|ref|): {diffs}")
    print("test accuracy: " + ", ".join(f"{n} {a:.3f}" for n, a in result["test_acc"].items()))
    first = result["first_call"]
    if first is not None:
        warm = result["timings_ms"][str(first["threads"])]["sparsenn"]
        print(f"first call in a fresh process with an empty kernel cache, {first['threads']} thread(s): "
              f"{first['first_ms']:.0f} ms ({first['kernels_built']} kernel(s) built; a warm call: {warm:.3f} ms)")


# ------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsenn", description="Train a reference model from a YAML config, "
                                     "then benchmark its CPU inference against PyG and torch.sparse.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,bench,run}")
    helps = {"train": "train the reference model of a config and save its weights",
             "bench": "time CPU inference of the trained model against PyG and torch.sparse",
             "run": "train, then bench (the README's main command)"}
    for name, help_text in helps.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--config", default=DEFAULT_CONFIG,
                             help=f"YAML config (default {DEFAULT_CONFIG}, also looked up in the repository)")
        command.add_argument("--output-dir", help="where weights and results go (default: the config's output_dir)")
        if name in ("train", "run"):
            command.add_argument("--max-epochs", type=int, help="override the config's max_epochs")
        if name in ("bench", "run"):
            command.add_argument("--threads", type=int, nargs="+", help="torch thread counts to time (override bench.threads)")
            command.add_argument("--warmup", type=int, help="override bench.warmup")
            command.add_argument("--repeats", type=int, help="override bench.repeats")
            command.add_argument("--no-cold-start", action="store_true",
                                 help="skip timing the first call in a fresh process with an empty kernel cache")
    return parser


def _with_overrides(config: GCNConfig, args: argparse.Namespace) -> GCNConfig:
    where = "command line"
    if getattr(args, "max_epochs", None) is not None:
        if args.max_epochs < 1:
            raise ValueError(f"{where}: --max-epochs must be positive, got {args.max_epochs}")
        config = dataclasses.replace(config, max_epochs=args.max_epochs)
    bench_overrides = {key: getattr(args, key, None) for key in ("warmup", "repeats")}
    bench_overrides = {key: value for key, value in bench_overrides.items() if value is not None}
    if getattr(args, "threads", None):
        bench_overrides["threads"] = tuple(args.threads)
    if getattr(args, "no_cold_start", False):
        bench_overrides["cold_start"] = False
    if bench_overrides:
        bench_config = _validated_bench(dataclasses.replace(config.bench, **bench_overrides), where)
        config = dataclasses.replace(config, bench=bench_config)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sparsenn`` / ``python -m sparsenn``; returns the exit status
    (0 on success, 1 when bench finds outputs that disagree, 2 on a bad config or arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run_command(args)
    except CommandError as exc:
        parser.error(f"{args.command}: {exc}")


def _run_command(args: argparse.Namespace) -> int:
    try:
        config = _with_overrides(load_config(args.config), args)
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from exc
    output_dir = Path(args.output_dir if args.output_dir is not None else config.output_dir)
    config_path = str(resolve_config_path(args.config))
    if args.command == "train":
        train(config, output_dir)
        return 0
    if args.command == "bench":
        return 0 if bench(config, output_dir, config_path)["ok"] else 1
    data = _load_data(config)
    train(config, output_dir, data)
    return 0 if bench(config, output_dir, config_path, data)["ok"] else 1
