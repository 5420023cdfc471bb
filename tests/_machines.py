"""Explicit machine models for tests that plan: tiles, register blocks and vector widths
depend on the Target, so these tests never read the host's."""

import dataclasses

from sparsenn.compiler.plan.target import Target

AVX2 = Target(vector_bytes=32, vector_registers=16, l2_bytes=1 << 20, llc_bytes=32 << 20)
AVX512 = Target(vector_bytes=32, widest_vector_bytes=64, vector_registers=32, l2_bytes=1 << 20, llc_bytes=32 << 20)
# 16 float lanes in every vector (AVX-512 at full width): masked loads and stores of both
# widths run on any host when a test pins AVX2 and this.
WIDE = Target(vector_bytes=64, widest_vector_bytes=64, vector_registers=32, l2_bytes=1 << 20, llc_bytes=32 << 20)
LANES = {"8 lanes": AVX2, "16 lanes": WIDE}


def relaying(machine: Target) -> Target:
    """``machine`` with copies so cheap (free torch calls, fast caches, the L2 five times
    faster than the last-level cache) that a kernel re-lays a batch-major input out
    rather than packing it in the kernel (``plan/block_pack.py``)."""
    return dataclasses.replace(machine, l2_bytes_per_cycle=1e6, llc_bytes_per_cycle=2e5, dram_bytes_per_cycle=2e5,
                               relayout_cycles=1.0)
