"""Packed grouped tiles (``plan/microkernel.py``, ``lower/microkernel.py``): an n:m weight's
grouped tile whose inputs overflow half the L2 packs them by layers of groups into
per-thread panels and runs its tiles in row blocks over one block of the batch.

Decisions are asserted on pinned machine models; results are compared with torch on
machines with small caches (so that small problems take several layers, panels and row
blocks), including rows past the last whole tile, a partial (masked) block of the batch,
a batch of 1 and of 0, float64 and two threads. A batch-major input is packed where it
is, by blocks transposed in registers, unless re-laying it out costs fewer cycles.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _machines import AVX2, AVX512
from _reference import assert_layer_matches_dense

import sparsenn
from sparsenn.compiler import use_target
from sparsenn.compiler.api import kernel_schedule
from sparsenn.compiler.plan.microkernel import MIN_PACKED_ROWS, PACKED_CHUNKS_PER_THREAD
from sparsenn.compiler.plan.target import Target

# Caches small enough that a 512-input layer at a batch of 37 is packed in 16 layers.
SMALL = Target(vector_bytes=32, vector_registers=16, l1_bytes=4 << 10, l2_bytes=64 << 10, llc_bytes=1 << 20)
SMALL_WIDE = Target(vector_bytes=32, widest_vector_bytes=64, vector_registers=32, l1_bytes=8 << 10,
                    l2_bytes=64 << 10, llc_bytes=1 << 20)


def cheap_copies(machine: Target) -> Target:
    """``machine`` with copies (and reads past the L2) so cheap that re-laying the input
    out costs fewer cycles than transposing it in the packs."""
    return dataclasses.replace(machine, llc_bytes_per_cycle=1e4, dram_bytes_per_cycle=1e4, relayout_cycles=1.0)


def nm_weight(rows: int, cols: int, fmt: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return sparsenn.from_dense(torch.randn(rows, cols, generator=g, dtype=dtype), format=fmt)


def nest_of(x, w, machine):
    """The kernel's nest (its design, whether or not the dense path runs BLAS instead)."""
    with use_target(machine):
        (nest,) = kernel_schedule("bi,oi->bo", x, w, out_format="dense").nests
    return nest


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)"])
def test_inputs_past_half_the_l2_are_packed_by_layers(machine, fmt):
    # 4096 inputs at a batch of 256: 4 MiB of inputs, every tile would read them from
    # the last-level cache
    nest = nest_of(torch.randn(256, 4096), nm_weight(256, 4096, fmt), machine)
    tile = nest.register_tile
    assert tile is not None and tile.grouped_by == 1 and tile.packed == (0,), nest
    assert nest.order == ("o", "i", "i'", "b") and tile.index == "o"
    lanes = machine.widest_vector_bytes // 4  # a tile bound by multiply-adds takes the widest vectors
    width = nest.register_block.size
    assert width == tile.vectors * lanes and tile.vectors == 2 * machine.register_tile_vectors
    assert tile.rows >= 2 and tile.rows * tile.vectors < machine.vector_registers
    # a layer's strip for one block fills at most the L1, a panel at most a quarter of
    # the L2, and the layers split the 1024 groups evenly
    assert 0 < tile.depth < 1024 and tile.depth * 4 * width * 4 <= machine.l1_bytes
    assert tile.panel % width == 0 and tile.depth * 4 * tile.panel * 4 <= machine.l2_bytes // 4
    assert tile.row_block % tile.rows == 0 and tile.row_block >= tile.rows
    # the panels replace a tile of the batch; the layers add partial sums
    assert not any(t.index == "b" for t in nest.tiles) and not nest.stores_once


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_inputs_in_half_the_l2_or_few_rows_are_not_packed(machine):
    # a batch of 16 over 4096 inputs: 256 KiB, read from the L2 by every tile
    nest = nest_of(torch.randn(16, 4096), nm_weight(256, 4096, "nm(2,4)"), machine)
    assert nest.register_tile is not None and nest.register_tile.grouped_by == 1
    assert not nest.register_tile.packed
    # too few rows for a pack to serve MIN_PACKED_ROWS of them in each chunk of a thread
    rows = MIN_PACKED_ROWS * PACKED_CHUNKS_PER_THREAD - 2
    nest = nest_of(torch.randn(256, 4096), nm_weight(rows, 4096, "nm(2,4)"), machine)
    assert nest.register_tile is not None and nest.register_tile.grouped_by == 1
    assert not nest.register_tile.packed


@pytest.mark.parametrize("machine", [SMALL, SMALL_WIDE], ids=["avx2", "avx512"])
def test_small_caches_pack_in_layers_panels_and_row_blocks(machine):
    nest = nest_of(torch.randn(37, 512), nm_weight(258, 512, "nm(2,4)"), machine)
    tile = nest.register_tile
    assert tile.packed == (0,) and tile.depth and tile.depth < 128
    assert tile.row_block < 258


@pytest.mark.parametrize("machine", [SMALL, SMALL_WIDE], ids=["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)"])
@pytest.mark.parametrize("batch", [37, 64, 1, 0])
def test_packed_grouped_tiles_match_torch(machine, dtype, fmt, batch):
    # 259 rows: whole tiles, then a row left; a batch of 37: whole blocks, then a
    # masked one; batches of 1 and 0 take no pack
    w = nm_weight(259, 512, fmt, dtype)
    x = torch.randn(batch, 512, dtype=dtype)
    with use_target(machine):
        got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    expected = torch.einsum("bi,oi->bo", x.double(), w.to_dense().double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_packed_grouped_tiles_on_two_threads_and_in_a_layer():
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(512, 300, format="nm(2,4)")
    x = torch.randn(45, 512, requires_grad=True)
    with use_target(SMALL):
        nest = nest_of(x.detach(), layer.weight, SMALL)
        assert nest.register_tile.packed
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            y = layer(x)
        finally:
            torch.set_num_threads(threads)
        y.square().sum().backward()
    assert_layer_matches_dense(layer, x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_layer_of_packs_stores_once_and_matches_torch(dtype):
    # 32 inputs: every group's strip for a block fits the L1, so one layer; 300 rows of
    # the batch overflow half the L2 and leave a partial block
    w = nm_weight(259, 32, "nm(2,4)", dtype)
    x = torch.randn(300, 32, dtype=dtype)
    nest = nest_of(x, w, SMALL)
    assert nest.register_tile.packed and nest.register_tile.depth == 0 and nest.stores_once
    with use_target(SMALL):
        got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    torch.testing.assert_close(got, torch.einsum("bi,oi->bo", x, w.to_dense()))


def plan_of(x, w, machine):
    with use_target(machine):
        return kernel_schedule("bi,oi->bo", x, w, out_format="dense")


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)"])
def test_a_batch_major_input_is_packed_where_it_is(machine, fmt):
    # X[b, i] (4 MiB at a batch of 256) split into groups is laid out [b][i][i']: the
    # packs transpose blocks of it in registers instead of a copy re-laid out
    # [i][i'][b] at every call (a cache line per element, read across its rows)
    x, w = torch.randn(256, 4096), nm_weight(256, 4096, fmt)
    sched = plan_of(x, w, machine)
    (nest,) = sched.nests
    tile = nest.register_tile
    assert tile.packed == (0,) and tile.transposed == (0,), nest
    assert not sched.transposes
    with use_target(machine):
        text = sparsenn.explain("bi,oi->bo", x, w)
    assert "factor 0 packed where it is, not copied into loop order: transposing blocks in its packs" in text
    assert "re-stored in mode order" not in text


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_cheaper_copy_re_lays_the_input_out(machine):
    x, w = torch.randn(256, 4096), nm_weight(256, 4096, "nm(2,4)")
    sched = plan_of(x, w, cheap_copies(machine))
    (nest,) = sched.nests
    assert nest.register_tile.packed == (0,) and nest.register_tile.transposed == ()
    assert sched.transposes == (((0, 0), (1, 2, 0)),)
    with use_target(cheap_copies(machine)):
        assert "factor 0 re-laid out: re-laying it out at every call" in sparsenn.explain("bi,oi->bo", x, w)


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_feature_major_input_is_packed_by_rows_in_place(machine):
    # X stored [i][b] (the output of a layer laid out o,b): its split view is [i][i'][b],
    # the packs' own order, read in place a row at a time
    x, w = torch.randn(4096, 256).T, nm_weight(256, 4096, "nm(2,4)")
    (nest,) = plan_of(x, w, machine).nests
    assert nest.register_tile.packed == (0,) and nest.register_tile.transposed == ()
    with use_target(machine):
        assert "reads dense operand(s) [0] in place" in sparsenn.explain("bi,oi->bo", x, w)


SOURCES = {"batch-major": lambda machine: machine, "copied": cheap_copies}


@pytest.mark.parametrize("machine", [SMALL, SMALL_WIDE], ids=["avx2", "avx512"])
@pytest.mark.parametrize("source", ["batch-major", "copied", "feature-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)"])
def test_packs_from_every_source_match_torch(machine, source, dtype, fmt):
    # 259 rows (whole tiles and a row left per chunk), 129 groups (an uneven last
    # layer); batches of 0, 1, 3 (a partial block only), 64 and 257 (whole blocks and a
    # partial one), each packed from the input where it is, from a re-laid-out copy, or
    # from an input stored feature-major
    w = nm_weight(259, 516, fmt, dtype)
    planned = SOURCES.get(source, lambda m: m)(machine)
    g = torch.Generator().manual_seed(1)
    for batch in (0, 1, 3, 64, 257):
        x = torch.randn(batch, 516, generator=g).to(dtype)
        if source == "feature-major":
            x = x.T.contiguous().T
        if batch == 257:
            tile = plan_of(x, w, planned).nests[0].register_tile
            assert tile.packed == (0,) and tile.transposed == ((0,) if source == "batch-major" else ())
        with use_target(planned):
            got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
        expected = torch.einsum("bi,oi->bo", x.double(), w.to_dense().double())
        tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance * 4)


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("fmt", ["nm(2,4)", "nm(1,4)", "nm(2,8)"])
def test_tiles_streaming_past_the_l2_prefetch_the_next_tile(machine, fmt):
    # 4096 rows: their stored entries over a layer and their output rows (2 MiB and
    # more per block of the batch) overflow half the L2, read again at every layer
    x, w = torch.randn(256, 4096), nm_weight(4096, 4096, fmt)
    nest = nest_of(x, w, machine)
    tile = nest.register_tile
    assert tile.packed == (0,) and tile.depth and tile.prefetch_next, nest
    with use_target(machine):
        text = sparsenn.explain("bi,oi->bo", x, w)
    assert "prefetching the next tile's stored entries and output rows" in text
    assert "sn_prefetch(out + " in text and "sn_prefetch(s1_val + " in text and "sn_prefetch(s1_crd2 + " in text


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_tiles_streaming_within_half_the_l2_do_not_prefetch(machine):
    # 128 rows over a layer: at most 256 KiB of entries and output rows per block
    rows = MIN_PACKED_ROWS * PACKED_CHUNKS_PER_THREAD
    x, w = torch.randn(256, 4096), nm_weight(rows, 4096, "nm(2,4)")
    tile = nest_of(x, w, machine).register_tile
    assert tile.packed == (0,) and not tile.prefetch_next
    with use_target(machine):
        assert "sn_prefetch" not in sparsenn.explain("bi,oi->bo", x, w)


@pytest.mark.parametrize("machine", [SMALL, SMALL_WIDE], ids=["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt, inputs", [("nm(2,4)", 516), ("nm(1,4)", 516), ("nm(2,8)", 520)])
def test_prefetching_tiles_match_torch(machine, dtype, fmt, inputs):
    # 259 rows (whole tiles, then a row left: the last tile's prefetch stays on the last
    # row), an odd number of groups (an uneven last layer), batches of 0, 1 and 37 (a
    # partial block)
    w = nm_weight(259, inputs, fmt, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    for batch in (0, 1, 37):
        x = torch.randn(batch, inputs, generator=g, dtype=dtype)
        if batch == 37:
            tile = nest_of(x, w, machine).register_tile
            assert tile.packed == (0,) and tile.depth and tile.prefetch_next
        with use_target(machine):
            got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
            bias = torch.randn(259, generator=g, dtype=dtype)
            affine = sparsenn.compile("Y[b,o] = X[b,i] * W[o,i] + bias[o]")(x, w, bias)
        expected = torch.einsum("bi,oi->bo", x.double(), w.to_dense().double())
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
        linear = torch.nn.functional.linear(x.double(), w.to_dense().double(), bias.double())
        torch.testing.assert_close(affine.double(), linear, rtol=1e-4, atol=1e-4)
