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
