"""Tests for building, caching and loading generated C++ kernels."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import zipfile

import pytest
import torch

from sparsenn.compiler.backend import jit

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 10_000
EXPECTED_SUM = N * (N - 1) / 2

# Child process: optionally waits at a file barrier (argv: dir, count), loads the kernel
# read from stdin and prints "<sum> <inode of the mapped kernel file>".
CHILD = textwrap.dedent(
    """
    import ctypes, os, pathlib, sys, time
    import torch
    from sparsenn.compiler.backend import jit

    source = sys.stdin.read()
    if len(sys.argv) > 1:
        ready, count = pathlib.Path(sys.argv[1]), int(sys.argv[2])
        (ready / str(os.getpid())).touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(ready)) < count and time.monotonic() < deadline:
            time.sleep(0.002)
    lib = jit.load_library(source, "sum")
    lib.sum.restype = ctypes.c_double
    lib.sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    x = torch.arange(%d, dtype=torch.float64)
    total = lib.sum(x.data_ptr(), x.numel(), 2)
    root = str(jit.cache_dir())
    inodes = {line.split()[4] for line in open("/proc/self/maps") if root in line}
    print(total, *inodes)
    """
    % N
)


def sum_source() -> str:
    """A new (never cached) kernel summing a double array with OpenMP."""
    return textwrap.dedent(
        f"""\
        // test kernel {uuid.uuid4().hex}
        #include <cstdint>
        extern "C" double sum(const double* x, std::int64_t n, int num_threads) {{
            double total = 0.0;
            #pragma omp parallel for reduction(+ : total) num_threads(num_threads)
            for (std::int64_t i = 0; i < n; ++i) total += x[i];
            return total;
        }}
        """
    )


def call_sum(lib: ctypes.CDLL, num_threads: int = 2) -> float:
    lib.sum.restype = ctypes.c_double
    lib.sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    x = torch.arange(N, dtype=torch.float64)
    return lib.sum(x.data_ptr(), x.numel(), num_threads)


def child_env(cache: pathlib.Path, package_root: pathlib.Path = REPO_ROOT, **env: str) -> dict[str, str]:
    """The environment of a child process importing the ``sparsenn`` in ``package_root``,
    caching kernels in ``cache``, with ``env`` added."""
    environ = dict(os.environ, SPARSENN_CACHE_DIR=str(cache), **env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), os.environ.get("PYTHONPATH")]))
    return environ


def run_child(source: str, cache: pathlib.Path, *args: str, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(cache, **env),
    )
    proc.stdin.write(source)
    proc.stdin.close()
    return proc


def run_python(code: str, source: str, cache: pathlib.Path, package_root: pathlib.Path = REPO_ROOT,
               **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh process (no kernel loaded yet) started in ``package_root``,
    ``source`` on its stdin; fails the test if it fails."""
    done = subprocess.run([sys.executable, "-c", code], input=source, capture_output=True, text=True,
                          cwd=package_root, env=child_env(cache, package_root, **env), timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def child_result(proc: subprocess.Popen) -> tuple[float, int, str]:
    """(sum, inode of the kernel file the child mapped, stderr) of a finished child."""
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    total, inode = stdout.split()
    return float(total), int(inode), stderr


def only_so(cache: pathlib.Path) -> pathlib.Path:
    (so_path,) = cache.glob("*.so")
    return so_path


@pytest.fixture
def cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(path))
    return path


def test_build_load_and_call(cache: pathlib.Path) -> None:
    lib = jit.load_library(sum_source(), "sum")
    assert call_sum(lib, num_threads=1) == call_sum(lib, num_threads=4) == EXPECTED_SUM
    so_path = only_so(cache)
    assert re.fullmatch(r"sum_[0-9a-f]{24}\.so", so_path.name)
    checksum = (cache / (so_path.name + ".sha256")).read_text().strip()
    assert checksum == hashlib.sha256(so_path.read_bytes()).hexdigest()
    assert so_path.with_suffix(".cpp").is_file()
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert not list(cache.glob(".build-*"))
    assert "++" in jit.compiler_info() or "clang" in jit.compiler_info()


def test_second_load_is_served_from_memory(
    cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = sum_source()
    lib = jit.load_library(source)
    # Neither a reload (the cached files are gone) nor a rebuild (no compiler) could succeed.
    for path in cache.iterdir():
        if path.is_file():
            path.unlink()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    start = time.perf_counter()
    for _ in range(1000):
        assert jit.load_library(source) is lib
    assert (time.perf_counter() - start) / 1000 < 1e-4
    assert call_sum(lib) == EXPECTED_SUM


def test_concurrent_threads_share_one_library(cache: pathlib.Path) -> None:
    source = sum_source()
    libs: list[ctypes.CDLL] = []
    def load() -> None:
        libs.append(jit.load_library(source))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(libs) == 8 and all(lib is libs[0] for lib in libs)
    assert call_sum(libs[0]) == EXPECTED_SUM


def test_fresh_process_loads_from_disk_without_rebuilding(cache: pathlib.Path) -> None:
    source = sum_source()
    jit.load_library(source, "sum")
    before = only_so(cache).stat()
    total, inode, stderr = child_result(run_child(source, cache))
    after = only_so(cache).stat()
    assert total == EXPECTED_SUM
    assert inode == before.st_ino == after.st_ino
    assert after.st_mtime_ns == before.st_mtime_ns
    assert "Warning" not in stderr


def test_concurrent_processes_build_one_entry(cache: pathlib.Path, tmp_path: pathlib.Path) -> None:
    source, count = sum_source(), 8
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [run_child(source, cache, str(ready), str(count)) for _ in range(count)]
    results = [child_result(proc) for proc in procs]
    so_path = only_so(cache)
    # Every process mapped the one file that is in the cache: it was built exactly once.
    expected = (EXPECTED_SUM, so_path.stat().st_ino)
    assert {(total, inode) for total, inode, _ in results} == {expected}
    assert not list(cache.glob(".build-*"))
    assert not (cache / "failed").exists()


@pytest.mark.parametrize("damage", ["truncate", "remove_checksum", "garbage_with_valid_checksum"])
def test_corrupt_cache_entry_is_rebuilt(cache: pathlib.Path, damage: str) -> None:
    source = sum_source()
    jit.load_library(source, "sum")
    so_path = only_so(cache)
    checksum_path = cache / (so_path.name + ".sha256")
    # Replace (not rewrite) the file: this process still has the original mapped.
    damaged = {
        "truncate": so_path.read_bytes()[:1000],
        "remove_checksum": so_path.read_bytes(),
        "garbage_with_valid_checksum": b"\x7fELF garbage",
    }[damage]
    tmp = cache / "damaged.tmp"
    tmp.write_bytes(damaged)
    os.replace(tmp, so_path)
    if damage == "remove_checksum":
        checksum_path.unlink()
    elif damage == "garbage_with_valid_checksum":
        checksum_path.write_text(hashlib.sha256(damaged).hexdigest())

    total, inode, stderr = child_result(run_child(source, cache))
    assert total == EXPECTED_SUM
    assert "RuntimeWarning" in stderr and str(so_path) in stderr and "rebuilding" in stderr
    assert only_so(cache) == so_path and inode == so_path.stat().st_ino
    assert checksum_path.read_text().strip() == hashlib.sha256(so_path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o703])
def test_shared_writable_cache_dir_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("SPARSENN_CACHE_DIR", str(shared))
    with pytest.raises(PermissionError, match=r"writable by group or others.*chmod go-w") as info:
        jit.load_library(sum_source())
    assert str(shared) in str(info.value) and "SPARSENN_CACHE_DIR" in str(info.value)
    assert not list(shared.iterdir())


def test_unusable_cache_location_falls_back_to_a_temp_dir_removed_at_exit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    blocker = tmp_path / "regular-file"
    blocker.write_text("")
    total, inode, stderr = child_result(run_child(sum_source(), blocker / "cache"))
    assert total == EXPECTED_SUM and inode > 0  # built into and loaded from the fallback dir
    fallback = pathlib.Path(re.search(r"caching compiled kernels in (\S+) for this process only", stderr).group(1))
    assert fallback.parent == temp and fallback.name.startswith("sparsenn-")
    assert not fallback.exists() and not list(temp.glob("sparsenn-*"))  # removed when the child exited
    assert blocker.read_text() == ""


@pytest.mark.parametrize(
    ("cxx", "message"),
    [
        ("/nonexistent/c++", "CXX is set to '/nonexistent/c\\+\\+'"),
        (None, "no C\\+\\+ compiler found"),
    ],
)
def test_missing_compiler_is_reported(
    cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch, cxx: str | None, message: str
) -> None:
    if cxx is None:
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(jit.CompilerNotFoundError, match=message) as info:
        jit.load_library(sum_source())
    assert "apt-get install g++" in str(info.value) and "set CXX" in str(info.value)


def test_build_failure_reports_saved_source(cache: pathlib.Path) -> None:
    source = sum_source() + "\nthis is not C++;\n"
    with pytest.raises(jit.KernelBuildError, match="error") as info:
        jit.load_library(source, "broken")
    saved = re.search(r"source saved to (\S+\.cpp)", str(info.value))
    assert saved is not None
    saved_path = pathlib.Path(saved.group(1))
    assert saved_path.parent == cache / "failed"
    assert saved_path.read_text() == source
    assert not list(cache.glob("*.so")) and not list(cache.glob(".build-*"))


@pytest.mark.parametrize(
    "name",
    ["x; rm -rf / #", "../../evil", "/etc/passwd", "$(touch pwned)", "", "ü" * 3, "a" * 500],
)
def test_hostile_names_are_sanitised(
    tmp_path: pathlib.Path, cache: pathlib.Path, name: str
) -> None:
    lib = jit.load_library(sum_source(), name)
    assert call_sum(lib) == EXPECTED_SUM
    so_path = only_so(cache)
    assert so_path.parent == cache
    assert re.fullmatch(r"[A-Za-z0-9_]{1,40}_[0-9a-f]{24}\.so", so_path.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert not pathlib.Path("pwned").exists()


def test_kernels_share_torchs_openmp_runtime(cache: pathlib.Path) -> None:
    lib = jit.load_library(sum_source())
    assert call_sum(lib, num_threads=4) == EXPECTED_SUM
    torch.ones(1 << 20).add_(1)  # run one of torch's OpenMP-parallel ops as well
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_gcc_only_flags_are_not_passed_to_clang() -> None:
    assert set(jit.GCC_FLAGS) <= set(jit.compiler_flags("g++ (Debian 12.2.0-14) 12.2.0"))
    assert not set(jit.GCC_FLAGS) & set(jit.compiler_flags("Ubuntu clang version 17.0.6"))
    assert set(jit.CXX_FLAGS) <= set(jit.compiler_flags("Apple clang version 15.0.0"))


def header_source() -> str:
    """A new kernel that includes a runtime header and returns ``ANSWER`` from it."""
    return f'// {uuid.uuid4().hex}\n#include "answer.h"\nextern "C" int answer() {{ return ANSWER; }}\n'


ANSWER_CHILD = textwrap.dedent(
    """
    import sys
    from sparsenn.compiler.backend import jit

    print(jit.__file__, jit.load_library(sys.stdin.read(), "answer").answer())
    """
)


def test_runtime_headers_are_on_the_include_path_and_in_the_key(
    cache: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """An installed copy of the package with a header of its own, each load in a fresh process."""
    install = tmp_path / "install"
    shutil.copytree(REPO_ROOT / "sparsenn", install / "sparsenn", ignore=shutil.ignore_patterns("__pycache__"))
    header = install / "sparsenn" / "compiler" / "backend" / "runtime" / "answer.h"
    source = header_source()

    def answer() -> int:
        module, value = run_python(ANSWER_CHILD, source, cache, install).stdout.split()
        assert pathlib.Path(module).is_relative_to(install)
        return int(value)

    header.write_text("#define ANSWER 41\n")
    assert answer() == 41
    # Editing a header gives the same source a new cache entry, built with the new header.
    header.write_text("#define ANSWER 42\n")
    assert answer() == 42
    assert len(list(cache.glob("answer_*.so"))) == 2
    header.write_text("#define ANSWER 41\n")
    mtimes = {p: p.stat().st_mtime_ns for p in cache.glob("*.so")}
    assert answer() == 41  # served from the cache
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.so")} == mtimes


def test_kernels_build_against_the_shipped_headers(cache: pathlib.Path) -> None:
    names = sorted(f.name for f in jit.RUNTIME_HEADERS.iterdir() if f.name.endswith(".h"))
    assert names == ["sparsenn_assembly.h", "sparsenn_kernel.h"]
    source = (
        "#define SN_VALUE double\n#define SN_INDEX int64_t\n#define SN_VECTOR_BYTES 32\n"
        '#include "sparsenn_kernel.h"\n#include "sparsenn_assembly.h"\n'
        'extern "C" int lanes() { return SN_W; }\n'
    )
    assert jit.load_library(source, "headers").lanes() == 4


@pytest.mark.parametrize("value, vector_bytes", [("float", 32), ("double", 32), ("float", 16), ("double", 16)])
@pytest.mark.parametrize("masks", ["native", "AVX vectors"])
def test_masked_stores_write_exactly_the_first_lanes(value: str, vector_bytes: int, masks: str,
                                                     cache: pathlib.Path) -> None:
    """``sn_store_first(p, v, sn_first_lanes(n))`` writes lanes ``[0, n)`` and nothing else,
    for every ``n``: through mask registers (AVX-512VL hosts), and through AVX's mask
    vectors (stored by halves, quarters, ...; forced here by hiding AVX-512VL)."""
    hide = "#undef __AVX512VL__\n#undef __AVX512F__\n" if masks == "AVX vectors" else ""
    source = (
        f"{hide}#define SN_VALUE {value}\n#define SN_INDEX int64_t\n#define SN_VECTOR_BYTES {vector_bytes}\n"
        '#define SN_LANE_MASKS 1\n#include "sparsenn_kernel.h"\n'
        'extern "C" int lanes() { return SN_W; }\n'
        'extern "C" void store_first(V* p, int64_t n) {\n'
        "  VV v; for (int l = 0; l < SN_W; ++l) v[l] = V(l + 1);\n"
        "  sn_store_first(p, v, sn_first_lanes(n));\n}\n"
    )
    lib = jit.load_library(source, "masked_stores")
    lanes = lib.lanes()
    assert lanes == vector_bytes // (4 if value == "float" else 8)
    dtype = torch.float32 if value == "float" else torch.float64
    for n in range(lanes + 1):
        buffer = torch.full((3 * lanes,), -7.0, dtype=dtype)
        lib.store_first(ctypes.c_void_p(buffer[lanes:].data_ptr()), ctypes.c_int64(n))
        expected = torch.full((3 * lanes,), -7.0, dtype=dtype)
        expected[lanes:lanes + n] = torch.arange(1, n + 1, dtype=dtype)
        assert torch.equal(buffer, expected), (n, buffer)


def test_wheel_ships_the_runtime_headers(tmp_path: pathlib.Path) -> None:
    """A non-editable install has every header the JIT reads (package data), the typing
    marker and the license."""
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "sparsenn", source / "sparsenn", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("sparsenn_torch-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    headers = [f.name for f in jit.RUNTIME_HEADERS.iterdir() if f.name.endswith(".h")]
    assert headers and {f"sparsenn/compiler/backend/runtime/{name}" for name in headers} <= shipped
    assert "sparsenn/py.typed" in shipped
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in shipped)


# Loads the kernel read from stdin, then a new one, logging at INFO to stderr.
LOGGED_CHILD = textwrap.dedent(
    """
    import logging, sys, uuid
    from sparsenn.compiler.backend import jit

    logging.basicConfig(level=logging.INFO)
    jit.load_library(sys.stdin.read(), "logged")
    jit.load_library(f'// {uuid.uuid4().hex}\\nextern "C" int one() {{ return 1; }}\\n', "fresh")
    """
)


def test_each_build_is_logged(cache: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    source = sum_source()
    with caplog.at_level(logging.INFO, logger="sparsenn"):
        jit.load_library(source, "logged")
    built = [r for r in caplog.records if "built kernel logged" in r.getMessage()]
    assert len(built) == 1 and built[0].name.startswith("sparsenn.")
    logged = run_python(LOGGED_CHILD, source, cache).stderr  # a new process: loaded from the cache, not built
    assert "built kernel fresh" in logged and "built kernel logged" not in logged


def test_a_warm_cache_needs_no_compiler(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = sum_source()
    jit.load_library(source, "sum")
    total, _, _ = child_result(run_child(source, cache, CXX="/nonexistent/c++", PATH=""))  # a new process
    assert total == EXPECTED_SUM
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(jit.CompilerNotFoundError):
        jit.load_library(sum_source(), "cold")


def parts_source() -> str:
    """A new kernel in two translation units: the sum's loop in the first, its entry
    point in the second (each includes what it needs; together they are one unit too)."""
    tag = uuid.uuid4().hex
    first = textwrap.dedent(
        f"""\
        // test kernel {tag}, part 1
        #include <cstdint>
        __attribute__((visibility("hidden"))) double partial_sum(const double* x, std::int64_t n, int num_threads) {{
            double total = 0.0;
            #pragma omp parallel for reduction(+ : total) num_threads(num_threads)
            for (std::int64_t i = 0; i < n; ++i) total += x[i];
            return total;
        }}
        """
    )
    second = textwrap.dedent(
        """\
        #include <cstdint>
        __attribute__((visibility("hidden"))) double partial_sum(const double* x, std::int64_t n, int num_threads);
        extern "C" double sum(const double* x, std::int64_t n, int num_threads) { return partial_sum(x, n, num_threads); }
        """
    )
    return first + jit.PART_BREAK + second


@pytest.mark.parametrize("workers", [1, 2])
def test_a_source_in_parts_builds_into_one_library(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                   workers: int) -> None:
    """With several cores its parts compile at once and link; with one, whole."""
    monkeypatch.setenv(jit.WORKERS_ENV, str(workers))
    source = parts_source()
    lib = jit.load_library(source, "sum")
    assert call_sum(lib) == EXPECTED_SUM
    assert only_so(cache).with_suffix(".cpp").read_text() == source
    assert not list(cache.glob(".build-*"))


def test_a_failing_part_reports_its_error(cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.WORKERS_ENV, "2")
    source = parts_source() + "this is not C++;\n"
    with pytest.raises(jit.KernelBuildError, match="part1.cpp.*error"):
        jit.load_library(source, "broken")
    assert not list(cache.glob("*.so"))


def test_a_bad_build_workers_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.WORKERS_ENV, "two")
    with pytest.raises(ValueError, match="SPARSENN_BUILD_WORKERS"):
        jit.build_workers()
    monkeypatch.setenv(jit.WORKERS_ENV, "3")
    assert jit.build_workers() == 3
