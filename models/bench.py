"""Inference benchmark of a trained reference model against the same weights in other libraries.

A model takes part by implementing the bench protocol (:class:`Benchmarkable`)::

    def bench_batch(self, datamodule) -> tuple[tuple[Tensor, ...], Tensor]:
        '''(inputs, target) of one inference call, e.g. ((x, edge_index), labels).'''
    def inference_variants(self) -> dict[str, Callable[..., Tensor]]:
        '''Name -> eval-mode callable(*inputs) computing this model's output with the same weights;
        "sparsenn" first, then the alternatives (e.g. "torch.sparse", "dense", "PyG GCNConv").'''
    def bench_metric(self, output: Tensor, target: Tensor) -> tuple[str, float]:
        '''The task metric of one output, e.g. ("accuracy", 0.81) or ("mse", 0.012).'''

and optionally ``bench_baselines() -> frozenset[str]``: variants that compute a different
function (e.g. full dense attention beside BigBird's), timed as speed baselines but exempt from
the agreement check.

:func:`run_bench` calls every variant on the same inputs, checks that each output agrees with
sparsenn's, scores each with the task metric, then times them: ``warmup`` untimed calls, then
the median of ``repeats`` calls per variant, round-robin, at each torch thread count, reading the
machine's load average before and after each thread count's timing (a busy machine inflates the
times: :func:`busy_warning`). The first call of the sparsenn variant (planning and building every
kernel) is timed separately in a fresh process with an empty kernel cache. The model and its data
module must have saved their init arguments (``save_hyperparameters()``) so that process can
rebuild them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Benchmarkable", "BenchSettings", "BenchResult", "VariantResult", "FirstCall", "check_benchmarkable",
           "run_bench", "format_table", "busy_warning", "write_chart", "chart", "memoized_conversion", "RTOL", "ATOL",
           "BUSY_MARGIN"]

RTOL, ATOL = 1e-4, 1e-5
"""A variant agrees with sparsenn when ``|ref - ours| <= ATOL * max|ours| + RTOL * |ours|`` elementwise."""

REFERENCE = "sparsenn"
"""The variant every other one is compared with and timed against."""

BUSY_MARGIN = 0.5
"""The machine was busy during a timing at ``t`` threads when its 1-minute load average, at the
start or the end of it, exceeded ``t + BUSY_MARGIN``: other processes then shared the cores."""


@runtime_checkable
class Benchmarkable(Protocol):
    """A LightningModule that :func:`run_bench` can benchmark (see the module docstring)."""

    def bench_batch(self, datamodule: Any) -> tuple[tuple[Tensor, ...], Tensor]: ...

    def inference_variants(self) -> dict[str, Callable[..., Tensor]]: ...

    def bench_metric(self, output: Tensor, target: Tensor) -> tuple[str, float]: ...


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """How :func:`run_bench` times: ``warmup`` untimed calls, then the median of ``repeats``
    timed calls per variant at each torch thread count of ``threads``; ``first_call`` also
    times the first sparsenn call in a fresh process with an empty kernel cache."""

    threads: tuple[int, ...] = (1, 2)
    warmup: int = 10
    repeats: int = 50
    first_call: bool = True

    def __post_init__(self) -> None:
        threads = tuple(self.threads)
        if not threads or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in threads):
            raise ValueError(f"threads must be a non-empty list of positive ints, got {list(threads)}")
        if len(set(threads)) != len(threads):
            raise ValueError(f"threads must be distinct, got {list(threads)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        object.__setattr__(self, "threads", threads)


@dataclasses.dataclass(frozen=True)
class VariantResult:
    """One variant: median time (ms) per thread count, its task metric, and how far its output
    is from sparsenn's (``max_abs_diff`` 0 and ``agrees`` True for sparsenn itself); a
    ``baseline`` computes another function and need not agree."""

    name: str
    median_ms: dict[int, float]
    metric: float
    max_abs_diff: float
    agrees: bool
    baseline: bool = False


@dataclasses.dataclass(frozen=True)
class FirstCall:
    """The first sparsenn call in a fresh process with an empty kernel cache."""

    threads: int
    ms: float
    kernels_built: int


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Everything one :func:`run_bench` measured; ``load_average`` maps each thread count to the
    1-minute load average at the start and the end of its timing."""

    name: str
    inputs: str
    metric_name: str
    settings: BenchSettings
    variants: tuple[VariantResult, ...]
    first_call: FirstCall | None
    load_average: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every variant's output, baselines aside, agrees with sparsenn's."""
        return all(v.agrees or v.baseline for v in self.variants)

    @property
    def busy_threads(self) -> tuple[int, ...]:
        """The thread counts whose timing ran on a busy machine (see :data:`BUSY_MARGIN`)."""
        return tuple(threads for threads, loads in self.load_average.items() if max(loads) > threads + BUSY_MARGIN)

    def speedup(self, variant: str, threads: int) -> float:
        """``variant``'s time over sparsenn's at ``threads``: above 1 means sparsenn is faster."""
        times = {v.name: v.median_ms[threads] for v in self.variants}
        return times[variant] / times[REFERENCE]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for variant in out["variants"]:
            variant["median_ms"] = {str(t): ms for t, ms in variant["median_ms"].items()}
        out["load_average"] = {str(t): list(loads) for t, loads in self.load_average.items()}
        out["busy_threads"] = list(self.busy_threads)
        out["ok"] = self.ok
        return out


def check_benchmarkable(model: object) -> None:
    """TypeError naming the bench-protocol methods ``model`` lacks."""
    missing = [name for name in ("bench_batch", "inference_variants", "bench_metric")
               if not callable(getattr(model, name, None))]
    if missing:
        raise TypeError(f"{type(model).__name__} cannot be benchmarked: it has no {', '.join(missing)} "
                        "(the bench protocol of models/bench.py)")


def memoized_conversion(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert`` applied once per input object: a variant that needs the inputs in another
    layout (dense features, a torch sparse tensor) converts them on the first call and reuses
    the result while it is called with the very same object, as the bench does."""
    last: list[Any] = []

    def converted(value: Any) -> Any:
        if not last or last[0] is not value:
            last[:] = [value, convert(value)]
        return last[1]

    return converted


def _describe(inputs: Sequence[object]) -> str:
    parts = []
    for item in inputs:
        shape = tuple(getattr(item, "shape", ()))
        kind = type(item).__name__
        density = getattr(item, "density", None)
        extra = f", {density:.2%} stored" if isinstance(density, float) else ""
        parts.append(f"{kind}{list(shape)}{extra}")
    return ", ".join(parts)


def median_ms(calls: Sequence[Callable[[], object]], warmup: int, repeats: int) -> list[float]:
    """Median wall time (ms) of each call, after ``warmup`` untimed calls each; timed
    round-robin so that background load hits every call alike."""
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


def _agreement(ours: Tensor, other: Tensor) -> tuple[float, bool]:
    if other.shape != ours.shape:
        return float("inf"), False
    diff = float((ours - other).abs().max()) if ours.numel() else 0.0
    scale = float(ours.abs().max()) if ours.numel() else 0.0
    return diff, torch.allclose(other, ours, rtol=RTOL, atol=ATOL * scale)


def run_bench(model: Any, datamodule: Any, settings: BenchSettings, name: str | None = None) -> BenchResult:
    """Benchmark ``model``'s inference variants on its bench batch (see the module docstring).

    The model is put in eval mode; torch's thread count is restored afterwards."""
    check_benchmarkable(model)
    model.eval()
    inputs, target = model.bench_batch(datamodule)
    variants = model.inference_variants()
    if not variants or next(iter(variants)) != REFERENCE:
        raise ValueError(f"{type(model).__name__}.inference_variants() must list {REFERENCE!r} first, "
                         f"got {list(variants)}")
    threads_before = torch.get_num_threads()
    with torch.no_grad(), warnings.catch_warnings():  # no_grad, not inference_mode: SparseTensors need version counters
        warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
        outputs = {label: call(*inputs) for label, call in variants.items()}
        metric_name = model.bench_metric(outputs[REFERENCE], target)[0]
        metrics = {label: model.bench_metric(out, target)[1] for label, out in outputs.items()}
        try:
            timings: dict[int, list[float]] = {}
            load: dict[int, tuple[float, float]] = {}
            for threads in settings.threads:
                torch.set_num_threads(threads)
                calls = [lambda call=call: call(*inputs) for call in variants.values()]
                before = os.getloadavg()[0]
                timings[threads] = median_ms(calls, settings.warmup, settings.repeats)
                load[threads] = (before, os.getloadavg()[0])
        finally:
            torch.set_num_threads(threads_before)
    baselines = model.bench_baselines() if hasattr(model, "bench_baselines") else frozenset()
    results = []
    for index, (label, out) in enumerate(outputs.items()):
        diff, agrees = _agreement(outputs[REFERENCE], out)
        results.append(VariantResult(label, {t: row[index] for t, row in timings.items()}, float(metrics[label]),
                                     diff, agrees, label in baselines))
    first = first_call(model, datamodule, settings.threads[0]) if settings.first_call else None
    title = name or f"{type(model).__name__} on {type(datamodule).__name__}"
    return BenchResult(title, _describe(inputs), metric_name, settings, tuple(results), first, load)


# ------------------------------------------------------------------------------- first call
def _qualified(obj: object) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def _init_args(obj: object) -> dict[str, Any]:
    """The init arguments ``obj`` saved with ``save_hyperparameters()`` (Lightning's own keys dropped)."""
    hparams = getattr(obj, "hparams", None)
    if hparams is None:
        raise TypeError(f"{type(obj).__name__} has no hparams: call self.save_hyperparameters() in its __init__ "
                        "so the first-call benchmark can rebuild it in a fresh process")
    return {key: value for key, value in dict(hparams).items() if not key.startswith("_")}


def first_call(model: Any, datamodule: Any, threads: int) -> FirstCall:
    """Time the first sparsenn call of ``model`` (rebuilt from its init arguments and
    state) in a fresh process with an empty kernel cache and ``threads`` torch threads."""
    spec = {"model": (_qualified(model), _init_args(model)), "data": (_qualified(datamodule), _init_args(datamodule)),
            "state_dict": model.state_dict(), "threads": threads}
    repository = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repository, os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="sparsenn-first-call-") as workdir:
        torch.save(spec, Path(workdir) / "spec.pt")
        cache = Path(workdir) / "kernels"
        env = {**os.environ, "SPARSENN_CACHE_DIR": str(cache), "PYTHONPATH": path}
        code = "import sys, models.bench as b; b._first_call_child(sys.argv[1])"
        done = subprocess.run([sys.executable, "-c", code, str(Path(workdir) / "spec.pt")], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the first-call measurement failed in its fresh process:\n{done.stderr.strip()}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    return FirstCall(threads, result["ms"], result["kernels_built"])


def _load_class(qualified: str) -> type:
    module, _, name = qualified.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _first_call_child(spec_path: str) -> None:
    """Child side of :func:`first_call`: prints one JSON line."""
    spec = torch.load(spec_path, weights_only=False)
    torch.set_num_threads(spec["threads"])
    model_class, model_args = spec["model"]
    data_class, data_args = spec["data"]
    model = _load_class(model_class)(**model_args)
    model.load_state_dict(spec["state_dict"])
    datamodule = _load_class(data_class)(**data_args)
    datamodule.setup("test")
    model.eval()
    inputs, _ = model.bench_batch(datamodule)
    call = model.inference_variants()[REFERENCE]
    with torch.no_grad():
        start = time.perf_counter()
        call(*inputs)
        ms = (time.perf_counter() - start) * 1e3
    kernels = sum(1 for _ in Path(os.environ["SPARSENN_CACHE_DIR"]).rglob("*.so"))
    print(json.dumps({"ms": ms, "kernels_built": kernels}))


# ------------------------------------------------------------------------------------ report
def format_table(result: BenchResult) -> str:
    """The result as a text table: one row per variant, its median time and the ratio to
    sparsenn's at each thread count, its difference from sparsenn's output, its metric."""
    s = result.settings
    lines = [f"{result.name}: inference on {result.inputs}",
             f"median of {s.repeats} calls after {s.warmup} warm-up; (Nx) = that time / sparsenn's: above 1 means "
             "sparsenn is faster"]
    header = f"{'variant':<18}" + "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>22}" for t in s.threads)
    header += f"{'max |diff|':>20}{result.metric_name:>10}"
    lines.append(header)
    for v in result.variants:
        cells = "".join(f"{f'{v.median_ms[t]:.3f} ms ({result.speedup(v.name, t):.2f}x)':>22}" for t in s.threads)
        diff = "-" if v.name == REFERENCE else f"{v.max_abs_diff:.1e}" + (
            "" if v.agrees else " (baseline)" if v.baseline else " !")
        lines.append(f"{v.name:<18}{cells}{diff:>20}{v.metric:>10.4f}")
    if result.load_average:
        loads = ", ".join(f"{t} thread{'s' if t > 1 else ''} {start:.2f} / {end:.2f}"
                          for t, (start, end) in result.load_average.items())
        lines.append(f"load average (1 min) at the start / end of each timing: {loads}")
    warning = busy_warning(result)
    if warning:
        lines.append(f"WARNING: {warning}")
    verdict = "agree" if result.ok else "DISAGREE (marked !)"
    baselines = "; (baseline): another function, timed for comparison" if any(v.baseline for v in result.variants) else ""
    lines.append(f"outputs {verdict} with sparsenn's (rtol {RTOL:g}, atol {ATOL:g} * max|sparsenn|){baselines}")
    if result.first_call is not None:
        f = result.first_call
        warm = next(v for v in result.variants if v.name == REFERENCE).median_ms.get(f.threads)
        warm_text = f"; a warm call {warm:.3f} ms" if warm is not None else ""
        lines.append(f"first sparsenn call in a fresh process with an empty kernel cache, {f.threads} thread(s): "
                     f"{f.ms:.0f} ms ({f.kernels_built} kernel(s) built{warm_text})")
    return "\n".join(lines)


def busy_warning(result: BenchResult) -> str | None:
    """What to say when the machine was busy during some of ``result``'s timings, else None."""
    busy = result.busy_threads
    if not busy:
        return None
    counts = ", ".join(f"{t} thread{'s' if t > 1 else ''} (load average up to {max(result.load_average[t]):.1f})"
                       for t in busy)
    return (f"the machine was busy while timing at {counts}: other processes shared the cores, so those times are "
            f"inflated and their ratios unreliable (busy: load average above threads + {BUSY_MARGIN:g})")


def chart(results: Sequence[BenchResult]) -> Figure:
    """A matplotlib figure: one panel per result, the variants' median times grouped by thread
    count on a log scale (times 100x apart stay readable), each bar labelled with its ratio to
    sparsenn's time. Needs matplotlib (the ``models`` extra)."""
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("a chart needs at least one result")
    figure = Figure(figsize=(5.5 * len(results), 5.2))
    axes = figure.subplots(1, len(results), squeeze=False)
    for axis, result in zip(axes[0], results):
        threads = result.settings.threads
        width = 0.8 / len(result.variants)
        for index, variant in enumerate(result.variants):
            positions = [t_index + (index - (len(result.variants) - 1) / 2) * width for t_index in range(len(threads))]
            times = [variant.median_ms[t] for t in threads]
            bars = axis.bar(positions, times, width, label=variant.name)
            axis.bar_label(bars, [f"{result.speedup(variant.name, t):.2f}x" for t in threads], fontsize=7)
        times = [ms for variant in result.variants for ms in variant.median_ms.values()]
        axis.set_yscale("log")
        axis.set_ylim(min(times) / 10, max(times) * 2)  # bars start a decade below the fastest: alike in every panel
        labels = [f"{t} thread{'s' if t > 1 else ''}" + (" (busy)" if t in result.busy_threads else "")
                  for t in threads]
        axis.set_xticks(range(len(threads)), labels)
        axis.set_ylabel("median inference time (ms, log scale)")
        axis.set_title(result.name, fontsize=9)
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    figure.suptitle("CPU inference: time of each variant (label: time / sparsenn's time)", fontsize=10)
    figure.tight_layout()
    return figure


def write_chart(results: Sequence[BenchResult], path: str | Path) -> Path:
    """Save :func:`chart` of ``results`` as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chart(results).savefig(path, dpi=110)
    return path
