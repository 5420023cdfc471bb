"""Grouped tiles (``plan/microkernel.py``, ``lower/microkernel.py``): a tile of output rows
over a weight whose last level holds a fixed number of entries per group (n:m), each
row stepping through its own group's entries while the group's input rows stay in L1.

Decisions are asserted on pinned machine models; results are compared with torch on
float64 copies, including rows past the last whole tile, a batch that leaves a partial
(masked) block, two threads, and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512

import sparsenn
from sparsenn.compiler import use_target
from sparsenn.compiler.api import plan
from sparsenn.compiler.plan.microkernel import Tile


def nm_weight(rows: int, cols: int, fmt: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return sparsenn.from_dense(torch.randn(rows, cols, generator=g, dtype=dtype), format=fmt)


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)", "nm(2,8)"])
def test_an_nm_weight_gets_a_grouped_tile_of_rows(machine, fmt):
    w = nm_weight(96, 64, fmt)
    with use_target(machine):
        split = plan("bi,oi->bo", torch.randn(64, 64), w, out_format="dense")
        (nest,) = split.schedule.nests
        tile = nest.register_tile
        assert tile is not None and tile.grouped_by is not None and tile.index == "o", nest
        assert nest.order[-1] == "b" and tile.rows >= 2
        # the accumulators fit the registers, with one left for the loads
        assert tile.rows * tile.vectors < machine.vector_registers


def test_no_grouped_tile_without_a_grouped_level():
    csr = sparsenn.from_dense(torch.randn(96, 64).where(torch.rand(96, 64) < 0.5, 0), format="csr")
    with use_target(AVX512):
        (nest,) = plan("bi,oi->bo", torch.randn(64, 64), csr, out_format="dense").schedule.nests
    assert nest.register_tile is None or nest.register_tile.grouped_by is None


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_tiles_match_torch(machine, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with use_target(machine):
            for fmt, rows, cols, batch in (("nm(2,4)", 37, 64, 70), ("nm(1,4)", 30, 128, 33), ("nm(2,8)", 9, 40, 16),
                                           ("nm(2,4)", 8, 16, 1)):
                w = nm_weight(rows, cols, fmt, torch.float64)
                x = torch.randn(batch, cols, dtype=torch.float64)
                got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
                torch.testing.assert_close(got, x @ w.to_dense().T, msg=f"{fmt} {rows}x{cols} batch {batch}")
    finally:
        torch.set_num_threads(previous)


def test_grouped_tiles_in_bfloat16_and_in_a_layer():
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(64, 45, format="nm(2,4)")
    x = torch.randn(40, 64)
    with use_target(AVX512):
        expected = x @ layer.weight.to_dense().T + layer.bias
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        bf16 = layer.to(torch.bfloat16)
        torch.testing.assert_close(bf16(x.bfloat16()).float(), expected, atol=0.25, rtol=0.05)


@pytest.mark.parametrize("machine, batch_tile, tile_shape", [(AVX2, 32, (4, 2)), (AVX512, 64, (4, 4))],
                         ids=["avx2", "avx512"])
def test_the_batch_tile_widens_to_the_widest_register_tile(machine, batch_tile, tile_shape):
    # rows of 4096 inputs: half the L2 holds 32 of them. On AVX512 a grouped tile of
    # 4 vectors (64 lanes) takes a batch tile of 64; on AVX2 two vectors fit in 32.
    w = nm_weight(64, 4096, "nm(2,4)")
    with use_target(machine):
        (nest,) = plan("bi,oi->bo", torch.randn(256, 4096), w, out_format="dense").schedule.nests
    assert [(t.index, t.size) for t in nest.tiles] == [("b", batch_tile)]
    tile = nest.register_tile
    assert tile.grouped_by is not None and (tile.rows, tile.vectors) == tile_shape
    assert nest.register_block.size == tile.vectors * machine.widest_vector_bytes // 4


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_widened_batch_tile_matches_torch(machine):
    # float64 rows of 4096 inputs: a batch tile of 16, widened to 32 on AVX512; a batch
    # of 100 leaves a partial tile and a partial block
    w = nm_weight(24, 4096, "nm(2,4)", torch.float64)
    x = torch.randn(100, 4096, dtype=torch.float64)
    with use_target(machine):
        (nest,) = plan("bi,oi->bo", x, w, out_format="dense").schedule.nests
        assert nest.tiles == (Tile("b", 32 if machine is AVX512 else 16),)
        got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    torch.testing.assert_close(got, x @ w.to_dense().T)
