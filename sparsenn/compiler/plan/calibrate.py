"""The host's BLAS efficiency, measured once: :attr:`Target.gemm_efficiency` of
:meth:`Target.host`.

The dense path (``plan/dense_path.py``) costs a BLAS product at ``gemm_efficiency`` of the
FMA peak, ``2 · lanes · fma_per_cycle`` flops a cycle. On the host that fraction is
measured rather than assumed: torch's own product in a linear layer's form,
``x @ wᵀ`` with ``x`` of :data:`GEMM_SHAPE` ``(rows, inner)`` and ``w`` of ``(outer,
inner)`` (a weight past the L2, as the dense path's are; a cube that fits the L2 runs
faster than any layer does), fp32 on one thread, the fastest of :data:`REPEATS` runs in
the thread's CPU time after a warm-up (about 10 ms in all), gives

    gemm_efficiency = flops / (seconds · clock_hz · peak_flops_per_cycle)

clamped to ``(0, 1]``, ``clock_hz`` the core's highest clock from sysfs (``cpufreq``),
else :data:`NOMINAL_CLOCK_HZ`, the clock the model's cycle counts are written for (its
``python_call_cycles`` of 20,000 being about 7 µs). The measurement is recorded per host
(CPU model and flags, torch version) as a JSON file in the kernel cache directory
(``backend/jit.py``'s :func:`cache_dir`) and read from there afterwards; a file that
cannot be read or written is measured again. ``$SPARSENN_GEMM_EFFICIENCY`` overrides it
(the tests' conftest sets it, so a suite never measures); targets given explicitly
(``use_target``) are never calibrated.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import time
from dataclasses import asdict, dataclass

import torch

from ..backend.jit import cache_dir, cpu_identity

__all__ = ["GemmMeasurement", "host_gemm_efficiency", "host_key", "measure_gemm", "read_measurement", "measurement_path",
           "EFFICIENCY_ENV", "GEMM_SHAPE", "REPEATS", "NOMINAL_CLOCK_HZ"]

EFFICIENCY_ENV = "SPARSENN_GEMM_EFFICIENCY"
GEMM_SHAPE = (64, 1024, 1024)  # (rows, inner, outer): 134 Mflop, about 2 ms
REPEATS = 5
NOMINAL_CLOCK_HZ = 3.0e9
_MAX_FREQ = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"  # kHz


@dataclass(frozen=True)
class GemmMeasurement:
    """One timed sgemm: ``flops`` in ``seconds`` on a core of ``clock_hz`` whose peak is
    ``peak_flops_per_cycle``; ``host`` the CPU and torch it was measured on."""

    host: str
    flops: float
    seconds: float
    clock_hz: float
    peak_flops_per_cycle: float

    @property
    def efficiency(self) -> float:
        """The fraction of the FMA peak the product reached, in ``(0, 1]``."""
        return min(1.0, self.flops / (self.seconds * self.clock_hz * self.peak_flops_per_cycle))


def host_gemm_efficiency(peak_flops_per_cycle: float, default: float) -> float:
    """The host's ``gemm_efficiency``: ``$SPARSENN_GEMM_EFFICIENCY``, else the recorded
    measurement for this host and peak, else a new one (recorded); ``default`` when the
    override is not a fraction or torch's GEMM cannot be timed."""
    override = os.environ.get(EFFICIENCY_ENV)
    if override is not None:
        try:
            value = float(override)
        except ValueError:
            return default
        return value if 0 < value <= 1 else default
    host = host_key()
    try:
        path = measurement_path(cache_dir(), host)
    except OSError:
        path = None
    recorded = read_measurement(path, host, peak_flops_per_cycle) if path is not None else None
    if recorded is not None:
        return recorded.efficiency
    try:
        measured = measure_gemm(host, peak_flops_per_cycle)
    except RuntimeError:
        return default
    if path is not None:
        _record(path, measured)
    return measured.efficiency


def measurement_path(directory: pathlib.Path, host: str) -> pathlib.Path:
    """Where the measurement of ``host`` (:func:`host_key`'s text) is recorded."""
    return directory / f"gemm-{hashlib.sha256(host.encode()).hexdigest()[:16]}.json"


def read_measurement(path: pathlib.Path, host: str, peak_flops_per_cycle: float) -> GemmMeasurement | None:
    """The measurement recorded at ``path`` if it is one of ``host`` at this peak, with
    positive finite numbers; else None."""
    try:
        fields = json.loads(path.read_text())
        measurement = GemmMeasurement(host=str(fields["host"]), flops=float(fields["flops"]),
                                      seconds=float(fields["seconds"]), clock_hz=float(fields["clock_hz"]),
                                      peak_flops_per_cycle=float(fields["peak_flops_per_cycle"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    numbers = (measurement.flops, measurement.seconds, measurement.clock_hz, measurement.peak_flops_per_cycle)
    if (measurement.host != host or measurement.peak_flops_per_cycle != peak_flops_per_cycle
            or not all(math.isfinite(x) and x > 0 for x in numbers)):
        return None
    return measurement


def measure_gemm(host: str, peak_flops_per_cycle: float) -> GemmMeasurement:
    """Time torch's fp32 ``x @ wᵀ`` of :data:`GEMM_SHAPE` on one thread, in the thread's
    CPU time (other processes on the core do not count): the fastest of :data:`REPEATS`
    runs after one warm-up. RuntimeError while a tracer records torch's
    ops or they make stand-ins (fake tensors): the host is then modelled by default."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        raise RuntimeError("a tracer records torch's ops: nothing to time")
    rows, inner, outer = GEMM_SHAPE
    generator = torch.Generator().manual_seed(0)
    x, w = torch.rand(rows, inner, generator=generator), torch.rand(outer, inner, generator=generator)
    out = torch.empty(rows, outer)
    if type(out) is not torch.Tensor:  # a mode (fake tensors) makes stand-ins that take no time
        raise RuntimeError("torch's ops make stand-ins here: nothing to time")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            torch.mm(x, w.t(), out=out)
            best = math.inf
            for _ in range(REPEATS):
                start = time.thread_time()
                torch.mm(x, w.t(), out=out)
                best = min(best, time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    if not 0 < best < math.inf:
        raise RuntimeError("the GEMM could not be timed")
    return GemmMeasurement(host, 2.0 * rows * inner * outer, best, _clock_hz(), peak_flops_per_cycle)


def _record(path: pathlib.Path, measurement: GemmMeasurement) -> None:
    """Write ``measurement`` to ``path`` (atomically; an unwritable directory records nothing)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(asdict(measurement), indent=1))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def host_key() -> str:
    """The CPU (model and flags, hashed) and torch version a measurement holds for."""
    return f"cpu {cpu_identity()}, torch {torch.__version__}"


def _clock_hz() -> float:
    """The core's highest clock from sysfs, else :data:`NOMINAL_CLOCK_HZ`."""
    try:
        with open(_MAX_FREQ) as f:
            khz = float(f.read())
    except (OSError, ValueError):
        return NOMINAL_CLOCK_HZ
    return khz * 1e3 if khz > 0 else NOMINAL_CLOCK_HZ
