"""Hypothesis profiles: "ci" (default, fixed seed, quick) and "long" (10,000 cases),
e.g. ``pytest -m fuzz --hypothesis-profile=long``."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci")
