"""Cold start: what ``import sparsenn`` and ``sparsenn --help`` load, the notice of a slow
kernel build, parallel builds, and precompiling the reference models."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "torch_geometric", "matplotlib", "jsonargparse")


def run_python(code: str, env: dict[str, str] | None = None, *args: str) -> subprocess.CompletedProcess:
    """``code`` (with ``args``) in a fresh interpreter importing this checkout's sparsenn."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], env=environment, capture_output=True, text=True,
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
    # The module sparsenn.convert imported first: the attribute stays the function.
    done = run_python("import sparsenn, torch\n"
                      "from sparsenn.convert import ConversionReport\n"
                      "assert callable(sparsenn.convert) and callable(sparsenn.precompile)\n"
                      "a = sparsenn.from_dense(torch.eye(2), 'csr')\n"
                      "print((a + a).to_dense().sum().item(), sparsenn.compiler.einsum is sparsenn.einsum)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4.0", "True"]


# ------------------------------------------------------------------------- build notice
BUILD_TWO = textwrap.dedent("""
    import logging, sys
    from sparsenn.compiler.backend import jit
    if "--logger-error" in sys.argv:
        logging.getLogger("sparsenn").setLevel(logging.ERROR)
    sources = ['extern "C" int one() { return 1; }', 'extern "C" int two() { return 2; }']
    libraries = jit.load_libraries([jit.KernelRequest(s, "notice") for s in sources], "the notice test")
    print(libraries[0].one() + libraries[1].two(), jit.builds)
""")


@pytest.fixture
def slow_compiler(tmp_path: Path) -> str:
    """A C++ compiler that takes over a second per kernel: the system's, after a pause."""
    wrapper = tmp_path / "slow-c++"
    real = next(p for p in (Path(d) / c for c in ("c++", "g++", "clang++") for d in os.environ["PATH"].split(":"))
                if p.is_file())
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) sleep 1.5 ;; esac\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def notices(cache: Path, compiler: str, *args: str, **env: str) -> list[str]:
    """The build notices on stderr of a fresh process loading two kernels; checks the kernels."""
    done = subprocess.run([sys.executable, "-c", BUILD_TWO, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "SPARSENN_CACHE_DIR": str(cache),
                                         "CXX": compiler, **env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "3"
    return [line for line in done.stderr.splitlines() if "sparsenn: building" in line]


def test_a_slow_build_says_so_once_and_a_cache_hit_says_nothing(tmp_path, slow_compiler):
    cache = tmp_path / "cache"
    assert notices(cache, slow_compiler) == [f"sparsenn: building 2 kernels for the notice test (cached in {cache})..."]
    assert notices(cache, slow_compiler) == []


@pytest.mark.parametrize("args, env", [(("--logger-error",), {}), ((), {"SPARSENN_QUIET_BUILDS": "1"})],
                         ids=["logger level", "environment"])
def test_the_build_notice_can_be_silenced(tmp_path, slow_compiler, args, env):
    assert notices(tmp_path / "cache", slow_compiler, *args, **env) == []


# ------------------------------------------------------------------------- parallel builds
def numbered_sources(count: int) -> list[str]:
    return [f'extern "C" int number() {{ return {n}; }}\n' for n in range(count)]


def test_parallel_builds_make_the_same_kernels_as_serial_ones(tmp_path, monkeypatch):
    from sparsenn.compiler.backend import jit

    sources = [f"// {tmp_path}\n" + s for s in numbered_sources(4)]  # new to this process's loaded libraries
    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(tmp_path / "parallel"))
    before = jit.builds
    parallel = jit.load_libraries([jit.KernelRequest(source, f"k{n}") for n, source in enumerate(sources)])
    assert jit.builds - before == 4
    assert [lib.number() for lib in parallel] == [0, 1, 2, 3]
    serially = run_python("import json, sys\nfrom sparsenn.compiler.backend import jit\n"
                          "sources = json.loads(sys.argv[1])\n"
                          "print([jit.load_library(s, f'k{n}').number() for n, s in enumerate(sources)])",
                          {"SPARSENN_CACHE_DIR": str(tmp_path / "serial")}, json.dumps(sources))
    assert serially.returncode == 0, serially.stderr
    assert serially.stdout.split() == ["[0,", "1,", "2,", "3]"]
    for n in range(4):
        (made_serially,) = (tmp_path / "serial").glob(f"k{n}_*.so")
        assert (tmp_path / "parallel" / made_serially.name).read_bytes() == made_serially.read_bytes()


def test_failed_parallel_builds_raise_one_error_naming_each_and_keep_the_others(tmp_path, monkeypatch):
    from sparsenn.compiler.backend import jit

    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(tmp_path))
    good = [f"// {tmp_path}\n" + s for s in numbered_sources(2)]
    requests = [jit.KernelRequest(good[0], "good0"), jit.KernelRequest("int broken(", "broken_a"),
                jit.KernelRequest(good[1], "good1"), jit.KernelRequest("not C++", "broken_b")]
    with pytest.raises(jit.KernelBuildError, match=r"(?s)2 of 4 kernels failed to compile.*broken_a.*broken_b"):
        jit.load_libraries(requests)
    with pytest.raises(jit.KernelBuildError, match="failed to compile kernel broken_a") as one:
        jit.load_libraries(requests[:2])
    assert "kernels failed" not in str(one.value)
    before = jit.builds
    assert [lib.number() for lib in jit.load_libraries([requests[0], requests[2]])] == [0, 1]
    assert jit.builds == before  # built by the failed request


# ------------------------------------------------------------------------- precompile
PRECOMPILE_EACH_MODEL = textwrap.dedent("""
    import torch
    import sparsenn
    from sparsenn.compiler.backend import jit
    from models import GCN, PlanetoidDataModule, SparseAutoencoder
    from models.bigbird import BigBirdClassifier

    torch.manual_seed(0)
    cora = PlanetoidDataModule("Cora")
    cora.setup("fit")
    tokens = torch.randint(1, 64, (4, 48))
    padding = torch.arange(48).expand(4, 48) >= torch.tensor([[48], [30], [17], [9]])
    models = [
        ("gcn", GCN(1433, 7, hidden_channels=8), (cora.graph.x, cora.graph.edge_index)),
        ("autoencoder", SparseAutoencoder(784, 32, "csr", sparsity=0.9, dense_epochs=0), (torch.rand(16, 784),)),
        ("bigbird", BigBirdClassifier(vocab_size=64, max_length=48, embed_dim=16, ffn_dim=32, num_heads=2,
                                      block_size=4, num_random_blocks=1), (tokens, padding)),
    ]
    for name, model, inputs in models:
        built = sparsenn.precompile(model, *inputs).kernels_built
        before = jit.builds
        model.train()
        model(*inputs).float().square().mean().backward()  # a training step
        with torch.no_grad():
            model.eval()(*inputs)  # inference
        print(name, built, jit.builds - before)
""")


def test_precompile_builds_every_kernel_of_each_reference_models_training_step_and_inference(tmp_path):
    done = run_python(PRECOMPILE_EACH_MODEL, {"SPARSENN_CACHE_DIR": str(tmp_path), "SPARSENN_QUIET_BUILDS": "1"})
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    built = {name: (int(precompiled), int(after)) for name, precompiled, after in lines}
    assert set(built) == {"gcn", "autoencoder", "bigbird"}
    assert all(precompiled > 0 and after == 0 for precompiled, after in built.values()), built


def _included_headers(source: str) -> set[str]:
    """File names of every header ``source`` includes, as the JIT's compiler preprocesses
    it with the kernels' flags and the runtime headers."""
    from sparsenn.compiler.backend import jit

    compiler = jit._compiler()
    flags = [f for f in jit.compiler_flags(jit._compiler_version(compiler)) if f != "-shared"]
    done = subprocess.run([*compiler, *flags, "-E", "-I", str(jit.RUNTIME_HEADERS), "-x", "c++", "-"], input=source,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {Path(line.split('"')[1]).name for line in done.stdout.splitlines() if line.startswith("# ") and '"' in line}


def test_float_kernels_parse_no_intrinsics_header_under_gcc():
    """Parsing standard headers was most of a small kernel's build: the runtime header
    includes neither <algorithm> nor <vector>; lane masks (SN_LANE_MASKS) are defined only
    for a kernel that reads or writes a vector's first lanes, through GCC's builtins
    (other compilers include <immintrin.h> for them)."""
    import torch

    import sparsenn
    from sparsenn.compiler.backend import jit
    from sparsenn.compiler.api import plan

    gcc = "clang" not in jit.compiler_info().lower()
    torch.manual_seed(0)
    weight = sparsenn.from_dense(torch.randn(32, 64) * (torch.rand(32, 64) < 0.2), "csr")
    for batch in (1, 5, 64):
        source = plan("bi,oi->bo", torch.randn(batch, 64), weight, out_format="dense").source
        headers = _included_headers(source)
        assert not headers & {"algorithm", "vector"}
        body = source.split('#include "sparsenn_kernel.h"')[1]
        masks = "SN_LANE_MASKS" in source
        assert masks == any(name in body for name in ("sn_first_lanes", "sn_load_first", "sn_store_first",
                                                     "sn_lane_mask"))
        if gcc or not masks:
            assert "immintrin.h" not in headers


def test_planning_and_lowering_run_no_garbage_collection():
    """Compiling a new call allocates many short-lived objects: with the cyclic collector
    set to run at every allocation, it runs during the call but never while the planner
    schedules or lowers (no scheduler or lowering frame on the stack of a collection)."""
    done = run_python(textwrap.dedent("""
        import gc, sys, torch, sparsenn
        from sparsenn.compiler.api import plan
        S = sparsenn.from_dense(torch.randn(40, 30).relu(), format="csr")
        X = torch.randn(30, 5)
        compiling = ("/compiler/plan/schedule.py", "/compiler/lower/")
        inside, outside = [], []

        def seen(phase, info):
            if phase == "start":
                frame, files = sys._getframe(1), []
                while frame is not None:
                    files.append(frame.f_code.co_filename)
                    frame = frame.f_back
                (inside if any(part in f for f in files for part in compiling) else outside).append(1)

        gc.callbacks.append(seen)
        gc.set_threshold(1, 1, 1)
        source = plan("ij,jk->ik", S, X).source
        gc.set_threshold(700, 10, 10)
        print(len(inside), len(outside) > 0, gc.isenabled(), "sn_run" in source)
    """))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True", "True", "True"]
