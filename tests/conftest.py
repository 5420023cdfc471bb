"""Hypothesis profiles: "ci" (default, fixed seed, quick) and "long" (10,000 cases),
e.g. ``pytest -m fuzz --hypothesis-profile=long``; every test sees NaN in uninitialised
kernel outputs; the Cora graph shared by the GCN tests; the host's BLAS efficiency is the
machine model's default, never measured (``plan/calibrate.py``: timing has no place in a
test, and a plan must not hang on one)."""

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ["SPARSENN_GEMM_EFFICIENCY"] = "0.5"  # before sparsenn plans for the host: see the module doc

import sparsenn  # noqa: E402
from _machines import AVX2  # noqa: E402
from models.planetoid import load_planetoid  # noqa: E402

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _poisoned_outputs():
    """Kernels that overwrite their output get NaN-filled memory (the production
    allocator's debug switch) instead of whatever torch.empty returns (often zeros), so
    a skipped element fails the test."""
    previous = sparsenn.compiler.poison_outputs(True)
    yield
    sparsenn.compiler.poison_outputs(previous)


@pytest.fixture(scope="session")
def cora():
    """Cora as PyG loads it (raw features), from the files shipped in models/data."""
    return load_planetoid("Cora", normalize_features=False)


@pytest.fixture
def host_target():
    """``host_target(target)``: plans made from then on, within the test, are scheduled
    for ``target`` (its caches, say), whatever the host is."""
    with contextlib.ExitStack() as stack:
        yield lambda target: stack.enter_context(sparsenn.compiler.use_target(target))


@pytest.fixture
def avx2_host(host_target):
    """Plans made while this is active are scheduled for :data:`_machines.AVX2`, whatever
    the host is (tiles and register blocks depend on the machine model)."""
    host_target(AVX2)
