"""Compile generated C++ kernels to shared libraries, cache them on disk and load them.

Kernels are C++17 sources with ``extern "C"`` entry points that may include the runtime
headers shipped in ``runtime/`` (:data:`RUNTIME_HEADERS`); a long one may come in parts
(:data:`PART_BREAK`), translation units compiled at once and linked. Each is built once per
(source, runtime headers, CPU) into a private cache directory, with a checksum beside
it, and loaded with :class:`ctypes.CDLL` (which releases the GIL during calls). Loading
a cached kernel never runs the compiler, so a cache warmed on a build machine (e.g. by
:func:`sparsenn.precompile`) serves one without a compiler; after changing compilers,
clear the cache to rebuild with the new one. When the cache directory cannot be created or
written, kernels go to a temporary directory of the process, removed when it exits.

:func:`load_libraries` builds the kernels a caller needs together: one compiler process
per kernel, as many at once as the process may use cores, or ``$SPARSENN_BUILD_WORKERS``
(1 also compiles a long kernel's parts as one unit). A request whose builds run past
:data:`NOTICE_AFTER_S` says so once, on the ``sparsenn`` logger at WARNING (shown by
Python's last-resort handler when logging is not configured): "sparsenn: building N
kernel(s) for <what> (cached in DIR)". ``SPARSENN_QUIET_BUILDS=1`` or a logger level above
WARNING silences it; each build is also logged at INFO.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.resources
import logging
import os
import pathlib
import platform
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

# Imported for its side effect: torch loads its bundled libgomp.so.1 first, so kernels
# (which link against the same soname) share torch's OpenMP runtime instead of a second one.
import torch  # noqa: F401

# No -ffast-math: results must match torch bit for bit up to summation order.
# -fno-trapping-math: kernels never unmask floating-point exceptions, so GCC may vectorise
# loops with comparisons (a row's max, a relu) and move loop-invariant divisions out of
# loops; every operation rounds as before (a vectorised sum adds in another order).
CXX_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
)
# GCC only (clang rejects the option): the generated code vectorises where the schedule
# says so (vector register blocks, ``omp simd`` reductions, which GCC vectorises whatever
# the cost model), so GCC's own loop vectoriser only takes loops it can vectorise
# without runtime checks or remainder loops; its default model turns loops over stored
# entries into gathers and short dense loops into versioned vector loops, both slower.
GCC_FLAGS = ("-fvect-cost-model=very-cheap",)
# Bump when the cache layout or build procedure changes, to invalidate old entries.
FORMAT_VERSION = "4"
PART_BREAK = "// sparsenn: next translation unit\n"
"""Between the parts of a source that holds several translation units (each with its
own includes; together they are one valid unit too)."""
BUILD_TIMEOUT_S = 600
NOTICE_AFTER_S = 1.0
"""A request still building after this long says so (see the module doc)."""
QUIET_ENV = "SPARSENN_QUIET_BUILDS"
WORKERS_ENV = "SPARSENN_BUILD_WORKERS"
# The runtime headers (``*.h``) kernels may include, e.g. ``#include "sparsenn_kernel.h"``.
RUNTIME_HEADERS = importlib.resources.files(__package__) / "runtime"
_MAX_NAME_LEN = 40
_MAX_LOG_CHARS = 4000


_log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """The C++ compiler rejected a generated kernel."""


class CompilerNotFoundError(RuntimeError):
    """No usable C++ compiler was found."""


_libraries: dict[str, ctypes.CDLL] = {}  # source text -> loaded library
_loading: dict[str, Future] = {}  # source text -> its load or build in progress, in some thread
builds = 0  # kernels this process compiled (not loaded from the cache)
_state_lock = threading.Lock()  # guards the three above
_dir_lock = threading.Lock()
_resolved_dir: tuple[str | None, pathlib.Path] | None = None  # ($SPARSENN_CACHE_DIR, dir)
_fallback_dir: pathlib.Path | None = None


@dataclass(frozen=True)
class KernelRequest:
    """A kernel to load: its C++ ``source`` and a readable ``name`` hint for file names."""

    source: str
    name: str = "kernel"


def load_library(source: str, name: str = "kernel", what: str | None = None) -> ctypes.CDLL:
    """Return the compiled, loaded library for ``source``, building it if needed.

    ``name`` is only a readable hint used in file names; ``what`` says what the kernel
    computes, for the build notice."""
    return load_libraries([KernelRequest(source, name)], what)[0]


def load_libraries(requests: Sequence[KernelRequest], what: str | None = None) -> list[ctypes.CDLL]:
    """The loaded library of each request, in order: those neither loaded nor in the disk
    cache are compiled concurrently, at most :func:`build_workers` at a time.

    Every request is attempted; if any build fails, :class:`KernelBuildError` names each
    failed kernel after the others finished. ``what`` describes the kernels for the build
    notice (default: their names)."""
    found = [_libraries.get(r.source) for r in requests]
    if all(lib is not None for lib in found):
        return found  # type: ignore[return-value]
    futures, mine = [], {}
    with _state_lock:
        for request in requests:
            source = request.source
            future = _loading.get(source) or mine.get(source)
            if source in _libraries:
                future = Future()
                future.set_result(_libraries[source])
            elif future is None:
                future = mine[source] = _loading[source] = Future()
            futures.append((request, future))
    if mine:
        _run(mine, {r.source: _sanitise(r.name) for r in requests}, what)
    return _results(futures)


def build_workers() -> int:
    """How many compiler processes run at once: ``$SPARSENN_BUILD_WORKERS`` when set, else
    the cores this process may run on."""
    workers = os.environ.get(WORKERS_ENV, "").strip()
    if workers:
        if not workers.isdigit() or int(workers) < 1:
            raise ValueError(f"${WORKERS_ENV} must be a positive integer, got {workers!r}")
        return int(workers)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _run(mine: dict[str, Future], names: dict[str, str], what: str | None) -> None:
    """Load or build each source of ``mine`` (its file-name hint in ``names``), completing
    its future and publishing the library to every thread."""

    def settle(source: str, lib: ctypes.CDLL | None, error: BaseException | None) -> None:
        with _state_lock:
            _loading.pop(source, None)
            if lib is not None:
                _libraries[source] = lib
        if error is None:
            mine[source].set_result(lib)
        else:
            mine[source].set_exception(error)

    try:
        targets = {source: _Target.of(source, names[source]) for source in mine}
    except BaseException as exc:  # e.g. an unusable cache directory: every request fails with it
        for source in mine:
            settle(source, None, exc)
        return
    missing = sum(not target.so_path.exists() for target in targets.values())
    notice = _BuildNotice(missing, what or ", ".join(sorted(set(names[s] for s in mine))))

    def load(source: str) -> None:
        try:
            lib = _load_or_build(source, targets[source], notice)
        except BaseException as exc:
            settle(source, None, exc)
        else:
            settle(source, lib, None)

    try:
        if len(mine) == 1:
            load(next(iter(mine)))
        else:
            with ThreadPoolExecutor(min(len(mine), build_workers()), thread_name_prefix="sparsenn-build") as pool:
                list(pool.map(load, mine))
    finally:
        notice.finish()


def _results(futures: list[tuple[KernelRequest, Future]]) -> list[ctypes.CDLL]:
    """Each future's library. A failure raises its error; several failed builds raise one
    :class:`KernelBuildError` with each one's message."""
    failures = [f.exception() for _, f in futures if f.exception() is not None]
    if not failures:
        return [f.result() for _, f in futures]
    other = [e for e in failures if not isinstance(e, KernelBuildError)]
    if other or len(failures) == 1:
        raise (other or failures)[0]
    raise KernelBuildError(f"{len(failures)} of {len(futures)} kernels failed to compile:\n\n"
                           + "\n\n".join(str(e) for e in failures))


class _BuildNotice:
    """The one notice of a request whose builds take longer than :data:`NOTICE_AFTER_S`:
    ``count`` kernels (those not in the disk cache when it started) for ``what``."""

    def __init__(self, count: int, what: str) -> None:
        self.count, self.what, self.lock = count, what, threading.Lock()
        self.timer: threading.Timer | None = None

    def compile_started(self) -> None:
        with self.lock:
            if self.timer is None and os.environ.get(QUIET_ENV, "") in ("", "0"):
                self.timer = threading.Timer(NOTICE_AFTER_S, self._say)
                self.timer.daemon = True
                self.timer.start()

    def _say(self) -> None:
        count = max(self.count, 1)
        _log.warning("sparsenn: building %d kernel%s for %s (cached in %s)...", count, "" if count == 1 else "s",
                     self.what, cache_dir())

    def finish(self) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()


def cache_dir() -> pathlib.Path:
    """The directory holding compiled kernels (resolved once per $SPARSENN_CACHE_DIR value)."""
    global _resolved_dir
    env = os.environ.get("SPARSENN_CACHE_DIR")
    with _dir_lock:
        if _resolved_dir is None or _resolved_dir[0] != env:
            _resolved_dir = (env, _resolve_cache_dir(_preferred_cache_dir(env)))
        return _resolved_dir[1]


def compiler_info() -> str:
    """First line of the compiler's ``--version`` output, e.g. ``g++ (Debian 12.2.0-14) 12.2.0``."""
    return _compiler_version(_compiler())


# ---------------------------------------------------------------------------- cache dir


def _preferred_cache_dir(env: str | None) -> pathlib.Path:
    if env:
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return pathlib.Path(base).expanduser() / "sparsenn"


def _resolve_cache_dir(path: pathlib.Path) -> pathlib.Path:
    """Create ``path`` privately and check it is safe; fall back to a temp dir if unusable."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return _use_fallback_dir(path, str(exc))
    _check_private(path)
    if not os.access(path, os.W_OK | os.X_OK):
        return _use_fallback_dir(path, "not writable")
    return path


def _check_private(path: pathlib.Path) -> None:
    """Refuse directories others could plant libraries in: loading a library runs its code."""
    st = path.stat()
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    if problems:
        raise PermissionError(
            f"refusing to use kernel cache directory {path}: it is {' and '.join(problems)}. "
            "Loading a cached kernel executes its code, so the directory must be private. "
            f"Fix it with `chmod go-w {shlex.quote(str(path))}` (and chown it to yourself), "
            "or set SPARSENN_CACHE_DIR to a private directory."
        )


def _use_fallback_dir(path: pathlib.Path, reason: str) -> pathlib.Path:
    global _fallback_dir
    if _fallback_dir is None:
        _fallback_dir = pathlib.Path(tempfile.mkdtemp(prefix="sparsenn-"))
        atexit.register(_remove_fallback_dir, _fallback_dir, os.getpid())
    warnings.warn(
        f"cannot use kernel cache directory {path} ({reason}); caching compiled kernels in "
        f"{_fallback_dir} for this process only. Set SPARSENN_CACHE_DIR to a writable directory.",
        RuntimeWarning,
    )
    return _fallback_dir


def _remove_fallback_dir(path: pathlib.Path, owner: int) -> None:
    """At exit of the process that made it (not of a forked child): remove the fallback dir."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ compiler and cache key


def _compiler() -> tuple[str, ...]:
    return _find_compiler(os.environ.get("CXX"), os.environ.get("PATH"))


@functools.lru_cache(maxsize=None)
def _find_compiler(cxx_env: str | None, path_env: str | None) -> tuple[str, ...]:
    """The compiler command: ``$CXX`` if set, else the first of c++, g++, clang++ on PATH."""
    hint = (
        "sparsenn compiles its sparse kernels at runtime and needs a C++17 compiler with "
        "OpenMP: install one (e.g. `apt-get install g++`, `dnf install gcc-c++` or "
        "`conda install -c conda-forge gxx`) or set CXX to the compiler's path."
    )
    if cxx_env:
        command = shlex.split(cxx_env)
        found = shutil.which(command[0], path=path_env) if command else None
        if found is None:
            raise CompilerNotFoundError(f"CXX is set to {cxx_env!r}, which was not found. {hint}")
        return (found, *command[1:])
    for candidate in ("c++", "g++", "clang++"):
        found = shutil.which(candidate, path=path_env)
        if found is not None:
            return (found,)
    raise CompilerNotFoundError(
        f"no C++ compiler found (looked for c++, g++ and clang++ on PATH). {hint}"
    )


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: tuple[str, ...]) -> str:
    result = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise CompilerNotFoundError(
            f"`{shlex.join(compiler)} --version` failed: {result.stderr.strip()}"
        )
    return lines[0]


@functools.lru_cache(maxsize=None)
def cpu_identity() -> str:
    """Hash of the CPU model and feature flags, since kernels are built with -march=native."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    identity = model + "\n" + flags if model or flags else platform.processor() + platform.machine()
    return hashlib.sha256(identity.encode()).hexdigest()


def compiler_flags(version: str) -> tuple[str, ...]:
    """The flags kernels are built with by the compiler whose ``--version`` line is ``version``."""
    return CXX_FLAGS if "clang" in version.lower() else CXX_FLAGS + GCC_FLAGS


def _runtime_headers() -> dict[str, bytes]:
    """Name and contents of each runtime header, by name: what a build compiles against."""
    files = sorted((f for f in RUNTIME_HEADERS.iterdir() if f.name.endswith(".h")), key=lambda f: f.name)
    return {f.name: f.read_bytes() for f in files}


def _cache_key(source: str, headers: dict[str, bytes]) -> str:
    """What a built kernel depends on (the cache format, the CPU, the flags, the source and
    its headers), all known without a compiler."""
    digest = hashlib.sha256()
    texts = [FORMAT_VERSION, cpu_identity(), " ".join(CXX_FLAGS + GCC_FLAGS), source]
    parts = [text.encode() for text in texts]
    for name, contents in headers.items():
        parts += [name.encode(), contents]
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()


def _sanitise(name: str) -> str:
    """Reduce a name hint to a short, safe file-name stem."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")[:_MAX_NAME_LEN] or "kernel"


# ------------------------------------------------------------------------- load / build


@dataclass(frozen=True)
class _Target:
    """Where a source's library goes in the cache: ``so_path``, named by ``key``, which
    covers the source and the runtime ``headers`` it is compiled against."""

    so_path: pathlib.Path
    key: str
    headers: dict[str, bytes]

    @staticmethod
    def of(source: str, name: str) -> _Target:
        headers = _runtime_headers()
        key = _cache_key(source, headers)
        return _Target(cache_dir() / f"{name}_{key[:24]}.so", key, headers)


def _load_or_build(source: str, target: _Target, notice: _BuildNotice) -> ctypes.CDLL:
    """Load the cached library for ``source`` from disk, (re)building it under a file lock."""
    global builds
    so_path = target.so_path
    with _file_lock(so_path.parent / f"{target.key}.lock"):
        lib = _load_cached(so_path)
        if lib is None:
            notice.compile_started()
            started = time.perf_counter()
            _build(source, target.headers, so_path, _compiler(), target.key)
            lib = ctypes.CDLL(str(so_path))
            with _state_lock:
                builds += 1
            _log.info("built kernel %s in %.2f s (%s)", so_path.stem.rsplit("_", 1)[0], time.perf_counter() - started,
                      so_path)
    return lib


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_cached(so_path: pathlib.Path) -> ctypes.CDLL | None:
    """The library at ``so_path`` if present and intact; warns and returns None if damaged."""
    if not so_path.exists():
        return None
    checksum_path = _checksum_path(so_path)
    try:
        expected = checksum_path.read_text().strip()
    except OSError:
        expected = None
    if expected != hashlib.sha256(so_path.read_bytes()).hexdigest():
        warnings.warn(
            f"cached kernel {so_path} is corrupt or has no valid {checksum_path.name}; rebuilding",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    try:
        return ctypes.CDLL(str(so_path))
    except OSError as exc:
        warnings.warn(
            f"cannot load cached kernel {so_path} ({exc}); rebuilding", RuntimeWarning, stacklevel=4
        )
        return None


def _checksum_path(so_path: pathlib.Path) -> pathlib.Path:
    return so_path.with_name(so_path.name + ".sha256")


def _build(
    source: str, headers: dict[str, bytes], so_path: pathlib.Path, compiler: tuple[str, ...], key: str
) -> None:
    """Compile ``source`` in a private temp dir, with a copy of the ``headers`` its key
    covers on the include path, and atomically move the result to ``so_path``."""
    root = so_path.parent
    build_dir = pathlib.Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        src, out = build_dir / "kernel.cpp", build_dir / "kernel.so"
        src.write_text(source)
        (build_dir / "include").mkdir()
        for name, text in headers.items():
            (build_dir / "include" / name).write_bytes(text)
        ok, log = _compile(compiler, build_dir, src.name, out.name)
        if not ok:
            failed = root / "failed" / f"{key}.cpp"
            failed.parent.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(src, failed)
            raise KernelBuildError(
                f"failed to compile kernel {so_path.stem} (source saved to {failed}):\n{_trim(log)}"
            )
        checksum = build_dir / "kernel.so.sha256"
        checksum.write_text(hashlib.sha256(out.read_bytes()).hexdigest() + "\n")
        os.replace(src, so_path.with_suffix(".cpp"))
        os.replace(checksum, _checksum_path(so_path))
        os.replace(out, so_path)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def _compile(
    compiler: tuple[str, ...], build_dir: pathlib.Path, src: str, out: str
) -> tuple[bool, str]:
    """Compile ``build_dir/src`` to the library ``build_dir/out``; returns (success,
    compiler output). A source of several parts (:data:`PART_BREAK`) has them compiled
    at once, one compiler process each, and linked, when the process may use several
    cores; else it is compiled whole."""
    flags = (*compiler_flags(_compiler_version(compiler)), "-I", str(build_dir / "include"))
    parts = (build_dir / src).read_text().split(PART_BREAK)
    if len(parts) == 1 or build_workers() == 1:
        return _run_compiler([*compiler, *flags, src, "-o", out], build_dir)
    objects = []
    for n, part in enumerate(parts):
        (build_dir / f"part{n}.cpp").write_text(part)
        objects.append(f"part{n}.o")
    unit_flags = [f for f in flags if f != "-shared"]
    with ThreadPoolExecutor(len(parts), thread_name_prefix="sparsenn-compile") as pool:
        done = list(pool.map(lambda n: _run_compiler([*compiler, *unit_flags, "-c", f"part{n}.cpp", "-o", objects[n]],
                                                     build_dir), range(len(parts))))
    if not all(ok for ok, _ in done):
        return False, "\n".join(log for _, log in done)
    return _run_compiler([*compiler, *flags, *objects, "-o", out], build_dir)


def _run_compiler(command: list[str], build_dir: pathlib.Path) -> tuple[bool, str]:
    """Run the compiler ``command`` in ``build_dir``; returns (success, its output)."""
    try:
        result = subprocess.run(command, cwd=build_dir, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"compilation timed out after {BUILD_TIMEOUT_S} s"
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def _trim(log: str) -> str:
    return log if len(log) <= _MAX_LOG_CHARS else log[:_MAX_LOG_CHARS] + "\n... (output truncated)"
