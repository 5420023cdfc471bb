"""sparsenn.precompile: a model's kernels built ahead of its first call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn.compiler.backend import jit

pytestmark = pytest.mark.usefixtures("avx2_host")


def test_precompile_builds_forward_and_backward_kernels_without_side_effects(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(sparsenn.SparseLinear(40, 24, sparsity=0.75), nn.BatchNorm1d(24), nn.Dropout(0.5),
                          sparsenn.SparseLinear(24, 6, sparsity=0.75)).train()
    x = torch.randn(7, 40)
    rng = torch.get_rng_state()
    statistics = {name: b.clone() for name, b in model.named_buffers()}
    done = sparsenn.precompile(model, x)
    assert done.kernels_built > 0 and done.seconds > 0
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, statistics[name]) for name, b in model.named_buffers())  # a training forward ran
    assert all(p.grad is None for p in model.parameters())
    before = jit.builds
    model(x).square().sum().backward()  # the training step only loads kernels
    assert jit.builds == before
    assert sparsenn.precompile(model, x).kernels_built == 0


def test_precompile_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        sparsenn.precompile(lambda x: x, torch.ones(1))
