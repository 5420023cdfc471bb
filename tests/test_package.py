"""The distribution: the library imports and runs without the ``models`` extra (Lightning,
jsonargparse, PyG, matplotlib), and the ``sparsenn`` command says what it needs when the extra
or the checkout is missing. Each case runs in a fresh process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ("lightning", "jsonargparse", "torch_geometric", "matplotlib")

# Absent modules, as Python marks them: importing one raises ModuleNotFoundError and
# importlib.util.find_spec finds nothing.
WITHOUT_EXTRA = f"import sys\nfor name in {EXTRA!r}:\n    sys.modules[name] = None\n"

LIBRARY_EXAMPLE = """
import torch
from torch import nn
import sparsenn

layer = sparsenn.SparseLinear(784, 256, sparsity=0.9)
layer(torch.randn(64, 784)).square().mean().backward()
assert layer.weight_values.grad is not None

model = sparsenn.convert(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), sparsity=0.9)
model(torch.randn(8, 64)).sum().backward()
assert isinstance(model[0], sparsenn.SparseLinear)

# PyG's conventions need no PyG: edge_index graphs and adj_t tensors are plain torch tensors.
edge_index = torch.randint(0, 100, (2, 400))
conv = sparsenn.SparseGCNConv(32, 16)
h = conv(torch.randn(100, 32), edge_index)
adjacency = sparsenn.from_edge_index(edge_index, num_nodes=100)
assert h.shape == (100, 16) and adjacency.shape == (100, 100)

dense = torch.rand(200, 200)
dense[dense < 0.95] = 0
A = sparsenn.from_dense(dense, format="csr")
X, Y = torch.randn(200, 16), torch.randn(200, 16)
torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", A, X), dense @ X)
S = sparsenn.einsum("ij,ik,jk->ij", A, X, Y)
D = sparsenn.compile("D[i,j] = A[i,k] * B[k,j] + C[i,j]")(A, X @ X.T, A)
torch.testing.assert_close(D, dense @ X @ X.T + dense, rtol=1e-4, atol=1e-4)
P = sparsenn.softmax(S, dim=-1)
assert P.nnz == S.nnz

assert not [name for name, module in sys.modules.items() if module is not None and name.split(".")[0] in EXTRA]
print("library example ok")
"""


def _python(code: str, cwd: Path, pythonpath: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_library_runs_without_the_models_extra(tmp_path):
    done = _python(WITHOUT_EXTRA + f"EXTRA = {EXTRA!r}\n" + LIBRARY_EXAMPLE, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "library example ok" in done.stdout


def test_the_command_names_the_extra_it_needs(tmp_path):
    code = WITHOUT_EXTRA + textwrap.dedent("""
        from sparsenn.cli import main
        assert main(["--help"]) == 0
        assert main(["fit", "--config", "configs/gcn_cora.yaml"]) == 2
        assert main(["run"]) == 2
        try:
            from sparsenn.cli import TorchThreads
        except ModuleNotFoundError as exc:
            print(exc, file=sys.stderr)
        else:
            raise AssertionError("TorchThreads imported without Lightning")
        """)
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "{fit,validate,test,predict,bench,run}" in done.stdout
    needs = "the sparsenn command needs the models extra (missing: " + ", ".join(EXTRA) + ")"
    assert done.stderr.count(needs) == 2
    assert "need the models extra" in done.stderr and 'pip install "sparsenn-torch[models]"' in done.stderr


def test_help_imports_neither_lightning_nor_the_models(tmp_path):
    code = textwrap.dedent("""
        import sys
        from sparsenn.cli import main
        assert main(["--help"]) == 0
        print(sorted(name for name in sys.modules if name.split(".")[0] in ("lightning", "jsonargparse", "models")))
        """)
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("[]")


def test_an_installed_copy_without_the_checkout_says_how_to_get_one(tmp_path):
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "sparsenn", site / "sparsenn", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    code = textwrap.dedent("""
        from sparsenn.cli import checkout, main
        assert checkout() is None
        assert main(["run"]) == 2
        assert main(["fit", "--config", "configs/gcn_cora.yaml"]) == 2
        """)
    done = _python(code, work, pythonpath=site)
    assert done.returncode == 0, done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and all("source checkout" in line and 'pip install -e ".[models]"' in line
                                    for line in errors), done.stderr
    assert errors[0].startswith("sparsenn: error: sparsenn run needs")
    assert "config configs/gcn_cora.yaml is not in the working directory" in errors[1]
