"""Resources: no leak across many kernel calls; the GIL is released during kernels."""

from __future__ import annotations

import resource
import threading
import time

import torch

import sparsenn


def test_repeated_cached_calls_keep_memory_flat():
    dense = torch.rand(200, 200)
    dense[dense < 0.9] = 0
    a = sparsenn.from_dense(dense, format="csr")
    x = torch.randn(200, 8)
    for _ in range(200):  # warm up: plans, kernels, allocator pools
        sparsenn.einsum("ij,jk->ik", a, x)
        sparsenn.einsum("ij,kj->ik", a, a)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(10_000):
        sparsenn.einsum("ij,jk->ik", a, x)
        sparsenn.einsum("ij,kj->ik", a, a)  # sparse output: assembled, handed over, freed
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 20 * 1024, f"peak RSS grew by {grown_kib} KiB over 10,000 calls"


def test_python_threads_run_while_a_kernel_runs():
    g = torch.Generator().manual_seed(0)
    n = 4000
    dense = torch.rand(n, n, generator=g)
    dense[dense < 0.95] = 0
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
