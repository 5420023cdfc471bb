"""Hypothesis profiles: "ci" (default, fixed seed, quick) and "long" (10,000 cases),
e.g. ``pytest -m fuzz --hypothesis-profile=long``; every test sees NaN in uninitialised
kernel outputs."""

import math

import pytest
import torch
from hypothesis import HealthCheck, settings

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
