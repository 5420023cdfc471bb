"""The host's BLAS efficiency: a recorded measurement is read back deterministically,
per host and peak, and the override wins; nothing here times anything (the conftest
pins the override for every other test)."""

import json
import os

import pytest

from sparsenn.compiler.backend.jit import cache_dir
from sparsenn.compiler.plan.calibrate import (EFFICIENCY_ENV, GemmMeasurement, host_gemm_efficiency, host_key,
                                              measurement_path, read_measurement)

HOST = "cpu 0123abcd, torch 2.13.0+cpu"
RECORDED = {"host": HOST, "flops": 134217728.0, "seconds": 0.002, "clock_hz": 3.0e9, "peak_flops_per_cycle": 32}


def record(path, **fields):
    path.write_text(json.dumps({**RECORDED, **fields}))
    return path


def test_a_recorded_measurement_reads_back_as_its_fraction_of_the_peak(tmp_path):
    path = record(measurement_path(tmp_path, HOST))
    measurement = read_measurement(path, HOST, 32)
    assert measurement == GemmMeasurement(HOST, 134217728.0, 0.002, 3.0e9, 32)
    assert measurement.efficiency == pytest.approx(134217728.0 / (0.002 * 3.0e9 * 32))
    assert read_measurement(path, HOST, 32) == measurement  # the same file, the same answer


def test_a_measurement_above_the_peak_counts_as_the_peak(tmp_path):
    path = record(tmp_path / "fast.json", seconds=0.0001)
    assert read_measurement(path, HOST, 32).efficiency == 1.0


def test_the_path_is_named_by_the_host_alone(tmp_path):
    path = measurement_path(tmp_path, HOST)
    assert path == measurement_path(tmp_path, HOST) and path.parent == tmp_path
    assert path.name.startswith("gemm-") and path.suffix == ".json"
    assert measurement_path(tmp_path, HOST.replace("2.13.0", "2.14.0")) != path


@pytest.mark.parametrize("fields", [
    {"host": "cpu ffff, torch 2.13.0+cpu"}, {"peak_flops_per_cycle": 64}, {"seconds": 0.0}, {"seconds": -1.0},
    {"clock_hz": float("inf")}, {"flops": "many"}, {"seconds": None},
], ids=["other-host", "other-peak", "zero-time", "negative-time", "infinite-clock", "text", "null"])
def test_a_measurement_of_another_host_or_peak_or_with_bad_numbers_is_not_read(tmp_path, fields):
    assert read_measurement(record(tmp_path / "m.json", **fields), HOST, 32) is None


def test_a_missing_or_broken_file_is_not_read(tmp_path):
    assert read_measurement(tmp_path / "absent.json", HOST, 32) is None
    (tmp_path / "broken.json").write_text("{not json")
    assert read_measurement(tmp_path / "broken.json", HOST, 32) is None
    (tmp_path / "partial.json").write_text(json.dumps({"host": HOST, "flops": 1.0}))
    assert read_measurement(tmp_path / "partial.json", HOST, 32) is None


def test_the_host_reads_its_recorded_measurement(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(directory))
    monkeypatch.delenv(EFFICIENCY_ENV)
    host = host_key()
    record(measurement_path(cache_dir(), host), host=host, seconds=0.0025)
    expected = 134217728.0 / (0.0025 * 3.0e9 * 32)
    assert host_gemm_efficiency(32, 0.5) == pytest.approx(expected)
    assert os.listdir(directory) == [measurement_path(directory, host).name]  # read, nothing measured or added


@pytest.mark.parametrize("text, expected", [("0.625", 0.625), ("1", 1.0), ("1.5", 0.5), ("0", 0.5), ("fast", 0.5)])
def test_the_override_wins_when_it_is_a_fraction(monkeypatch, text, expected):
    monkeypatch.setenv(EFFICIENCY_ENV, text)
    assert host_gemm_efficiency(32, 0.5) == expected
