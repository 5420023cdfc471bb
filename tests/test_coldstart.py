"""Cold start: what ``import sparsenn`` and ``sparsenn --help`` load, the notice of a slow
kernel build, parallel builds, and precompiling the reference models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "torch_geometric", "matplotlib", "jsonargparse")


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout's sparsenn."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def loaded_after(statements: str) -> set[str]:
    """The heavy top-level packages loaded after ``statements`` in a fresh interpreter."""
    done = run_python(f"{statements}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))")
    assert done.returncode == 0, done.stderr
    return set(eval(done.stdout.splitlines()[-1])) & set(HEAVY)


def test_help_imports_neither_torch_nor_the_models_extra():
    assert loaded_after("import sparsenn.cli, contextlib, io\n"
                        "with contextlib.redirect_stdout(io.StringIO()): sparsenn.cli.main(['--help'])") == set()


def test_import_sparsenn_is_lazy_and_any_public_name_loads_the_library():
    assert loaded_after("import sparsenn") == set()
    done = run_python("import sparsenn, torch\n"
                      "from sparsenn.convert import ConversionReport\n"  # the module first: sparsenn.convert stays the function
                      "assert callable(sparsenn.convert) and callable(sparsenn.precompile)\n"
                      "a = sparsenn.from_dense(torch.eye(2), 'csr')\n"
                      "print((a + a).to_dense().sum().item(), sparsenn.compiler.einsum is sparsenn.einsum)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4.0", "True"]


# ------------------------------------------------------------------------- precompile
def reference_models():
    """Each reference model (small sizes) with an input batch: (name, model, inputs)."""
    import torch

    from models import GCN, PlanetoidDataModule, SparseAutoencoder
    from models.bigbird import BigBirdClassifier

    torch.manual_seed(0)
    cora = PlanetoidDataModule("Cora")
    cora.setup("fit")
    tokens = torch.randint(1, 64, (4, 48))
    padding = torch.arange(48).expand(4, 48) >= torch.tensor([[48], [30], [17], [9]])
    return [
        ("gcn", GCN(1433, 7, hidden_channels=8), (cora.graph.x, cora.graph.edge_index)),
        ("autoencoder", SparseAutoencoder(784, 32, "csr", sparsity=0.9, dense_epochs=0), (torch.rand(16, 784),)),
        ("bigbird", BigBirdClassifier(vocab_size=64, max_length=48, embed_dim=16, ffn_dim=32, num_heads=2,
                                      block_size=4, num_random_blocks=1), (tokens, padding)),
    ]


def test_precompile_builds_every_kernel_of_each_reference_models_training_step(tmp_path, monkeypatch):
    import torch

    import sparsenn
    from sparsenn.compiler.backend import jit

    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(tmp_path))
    for name, model, inputs in reference_models():
        done = sparsenn.precompile(model, *inputs)
        assert done.kernels_built > 0, name
        before = jit.builds
        model.train()
        output = model(*inputs)
        output.float().square().mean().backward()
        with torch.no_grad():
            model.eval()(*inputs)
        assert jit.builds == before, f"{name}: the first real step built {jit.builds - before} kernel(s)"
