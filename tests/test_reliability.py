"""Resources: no leak across many kernel calls, peak memory linear in inputs + output,
the GIL released during kernels."""

from __future__ import annotations

import os
import pathlib
import resource
import subprocess
import sys
import textwrap
import threading
import time

import torch

import sparsenn

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_repeated_cached_calls_keep_memory_flat():
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(200, 200, generator=g)
    dense[dense < 0.98] = 0  # sparse enough that A·Aᵀ is stored sparse (about 8 % full)
    a = sparsenn.from_dense(dense, format="csr")
    x = torch.randn(200, 8, generator=g)
    assert isinstance(sparsenn.einsum("ij,kj->ik", a, a), sparsenn.SparseTensor)
    for _ in range(200):  # warm up: plans, kernels, allocator pools
        sparsenn.einsum("ij,jk->ik", a, x)
        sparsenn.einsum("ij,kj->ik", a, a)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(10_000):
        sparsenn.einsum("ij,jk->ik", a, x)
        sparsenn.einsum("ij,kj->ik", a, a)  # sparse output: assembled, handed over, freed
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 8 * 1024, f"peak RSS grew by {grown_kib} KiB over 10,000 calls"


def test_python_threads_run_while_a_kernel_runs():
    g = torch.Generator().manual_seed(0)
    n = 4000
    dense = torch.rand(n, n, generator=g)
    dense[dense < 0.9] = 0
    a = sparsenn.from_dense(dense, format="csr")
    x = torch.randn(n, 256, generator=g)
    sparsenn.einsum("ij,jk->ik", a, x)  # build the kernel first
    ticks, running = [0], threading.Event()

    def count():
        while running.is_set():
            ticks[0] += 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        running.set()
        counter = threading.Thread(target=count)
        counter.start()
        start, t0 = ticks[0], time.perf_counter()
        time.sleep(0.1)  # sleeping releases the GIL: the counter's free-running rate
        rate = (ticks[0] - start) / (time.perf_counter() - t0)
        start, t0 = ticks[0], time.perf_counter()
        sparsenn.einsum("ij,jk->ik", a, x)
        elapsed = time.perf_counter() - t0
        during = ticks[0] - start
    finally:
        running.clear()
        counter.join()
        torch.set_num_threads(threads)
    assert elapsed > 0.03, "kernel too short to tell"
    # Holding the GIL, the counter would advance only in a switch interval or two
    # (~5 ms each) around the call; released, it counts through the whole kernel.
    assert during > 0.3 * rate * elapsed, (during, rate * elapsed)


# Child process for the peak-memory test: builds a large CSR matrix A (n x n, ``per_row``
# entries per row) and dense factors, warms each kernel up on a small matrix of the same
# formats, then for each product resets the peak-RSS mark (/proc/self/clear_refs), runs it
# once and prints "<name> <input bytes> <output bytes> <peak growth bytes>".
PEAK_CHILD = textwrap.dedent(
    """
    import re, sys
    import torch
    import sparsenn
    from sparsenn import SparseTensor

    n, per_row, k = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    def csr(rows, cols_per_row, seed):
        g = torch.Generator().manual_seed(seed)
        stride = rows // cols_per_row  # one column per bucket: sorted and unique in every row
        crd = torch.randint(stride, (rows, cols_per_row), generator=g) + torch.arange(cols_per_row) * stride
        pos = torch.arange(0, rows * cols_per_row + 1, cols_per_row, dtype=torch.int32)
        values = torch.rand(rows * cols_per_row, generator=g)
        return SparseTensor((rows, rows), "csr", [None, pos], [None, crd.view(-1).to(torch.int32)], values)

    def nbytes(x):
        if isinstance(x, SparseTensor):
            return sum(a.numel() * a.element_size() for a in (*x.pos, *x.crd, x.values) if a is not None)
        return x.numel() * x.element_size()

    cases = {
        "spmm": ("ij,jk->ik", lambda a, x, y: (a, x)),
        "sddmm": ("ij,ik,jk->ij", lambda a, x, y: (a, x, y)),
        "spgemm": ("ij,jk->ik", lambda a, x, y: (a, a)),
    }
    small = csr(64, 4, 1), torch.rand(64, k), torch.rand(64, k)
    for equation, operands in cases.values():  # build and load every kernel first
        sparsenn.einsum(equation, *operands(*small))
    big = csr(n, per_row, 2), torch.rand(n, k), torch.rand(n, k)
    for name, (equation, operands) in cases.items():
        ops = operands(*big)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = kib("VmRSS")
        out = sparsenn.einsum(equation, *ops)
        growth = (kib("VmHWM") - before) * 1024
        distinct = {id(op): op for op in ops}.values()  # SpGEMM reads A twice
        print(name, sum(map(nbytes, distinct)), nbytes(out), growth, flush=True)
        del out
    """
)


def test_peak_memory_is_linear_in_inputs_and_output() -> None:
    """SpMM, SDDMM and SpGEMM on a 100,000 x 100,000 CSR matrix (1M entries; dense it
    would be 40 GB): the peak RSS during each call grows by at most a small multiple of
    the bytes of its inputs plus its output (workspaces, per-thread chunks, re-stored
    operands), never by anything of size n x n or nnz x k."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD, "100000", "10", "32"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[0] for line in lines] == ["spmm", "sddmm", "spgemm"], proc.stdout
    for name, inputs, output, growth in lines:
        inputs, output, growth = int(inputs), int(output), int(growth)
        assert output > 0 and growth >= 0
        allowed = 4 * output + 2 * inputs + (64 << 20)
        assert growth <= allowed, f"{name}: peak grew {growth >> 20} MiB for {inputs >> 20} MiB in, {output >> 20} MiB out"
