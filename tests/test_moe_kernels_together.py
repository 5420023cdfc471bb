"""SparseMoE's first inference call builds its expert products' kernels together, on
stand-ins of the intermediate panels: the forward then only loads them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import torch
import sparsenn
from sparsenn.compiler.backend import jit
from sparsenn.layers.moe import dispatch

torch.manual_seed(0)
moe = sparsenn.SparseMoE(128, 256, 4, k=2, bias={bias}, activation="silu").eval()
x = torch.randn(512, 128)
with torch.no_grad():
    gates = moe.gate(x).gates
    moe._build_kernels_together(x, gates, dispatch(gates))
    together = jit.builds
    y = moe(x)
    print(together, jit.builds - together)
"""


@pytest.mark.parametrize("bias", [False, True])
def test_the_first_inference_call_builds_the_expert_kernels_together(tmp_path, bias):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSENN_CACHE_DIR": str(tmp_path), "SPARSENN_QUIET_BUILDS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(bias=bias)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    together, during_forward = map(int, done.stdout.split()[-2:])
    assert together > 0 and during_forward == 0
