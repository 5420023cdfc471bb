"""Hypothesis profiles: "ci" (default, fixed seed, quick) and "long" (10,000 cases),
e.g. ``pytest -m fuzz --hypothesis-profile=long``; every test sees NaN in uninitialised
kernel outputs; the Cora graph shared by the GCN tests."""

import math

import pytest
import torch
from hypothesis import HealthCheck, settings

import sparsenn
from _machines import AVX2
from models.planetoid import load_planetoid
from sparsenn.compiler.plan.target import Target
from sparsenn.compiler.runtime import launcher

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _poisoned_outputs():
    """Kernels that overwrite their dense output get NaN-filled memory instead of
    whatever torch.empty returns (often zeros), so a skipped element fails the test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "uninitialised", lambda *size, dtype: torch.empty(*size, dtype=dtype).fill_(math.nan))
        yield


@pytest.fixture(scope="session")
def cora():
    """Cora as PyG loads it (raw features), from the files shipped in models/data."""
    return load_planetoid("Cora", normalize_features=False)


@pytest.fixture
def host_target(monkeypatch):
    """``host_target(target)``: plans made from then on, within the test, are scheduled
    for ``target`` (its caches, say), whatever the host is."""
    def use(target: Target) -> None:
        monkeypatch.setattr(Target, "host", staticmethod(lambda: target))
        sparsenn.compiler.clear_caches()
    yield use
    sparsenn.compiler.clear_caches()


@pytest.fixture
def avx2_host(host_target):
    """Plans made while this is active are scheduled for :data:`_machines.AVX2`, whatever
    the host is (tiles and register blocks depend on the machine model)."""
    host_target(AVX2)
