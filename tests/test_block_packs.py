"""Packed register blocks (``plan/block_pack.py``, ``lower/packed_block.py``): an
unstructured sparse weight's SpMM ``Y[b, o] = sum_i X[b, i] W[o, i]`` in order
``o, i, b`` packs the batch-major input per thread, by blocks transposed in registers,
instead of re-laying it out by a copy before the kernel, when that costs fewer cycles.

Decisions are asserted on pinned machine models (and on ones with copies so cheap that
the copy wins); results are compared with torch for float32, float64 and bfloat16,
batches of 0, 1, odd and past a panel, odd inputs, one and two threads, and the
backward pass that packs the output's gradient.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512, relaying
from _reference import assert_layer_matches_dense

import sparsenn
from sparsenn.compiler import use_target
from sparsenn.compiler.api import kernel_schedule
from sparsenn.compiler.plan.block_pack import pack_cycles
from sparsenn.compiler.plan.target import Target

MACHINES = {"avx2": AVX2, "avx512": AVX512}
# An L2 of 64 KiB: 300 inputs by blocks of 64 take one block a panel, so a batch of 200
# runs in several panels, the last one partial.
SMALL = Target(vector_bytes=32, vector_registers=16, l1_bytes=8 << 10, l2_bytes=64 << 10, llc_bytes=1 << 20)


def csr_weight(rows: int, cols: int, dtype=torch.float32, density: float = 0.3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    dense = dense * (torch.rand(rows, cols, generator=g, dtype=torch.float64) < density)
    return sparsenn.from_dense(dense.to(dtype), format="csr")


def plan_of(x, w, machine):
    with use_target(machine):
        return kernel_schedule("bi,oi->bo", x, w, out_format="dense")


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
@pytest.mark.parametrize("shape", [(128, 7, 64, 0.5), (784, 256, 64, 0.1), (4096, 1024, 512, 0.1)])
def test_a_batch_major_input_is_packed_in_the_kernel(machine, shape):
    inputs, outputs, batch, density = shape
    x, w = torch.randn(batch, inputs), csr_weight(outputs, inputs, density=density)
    sched = plan_of(x, w, machine)
    (nest,) = sched.nests
    assert nest.order == ("o", "i", "b") and nest.register_tile is None, nest
    packed = nest.packed_block
    assert packed is not None and packed.factor == 0, nest
    # no copy of the input before the kernel, no cache tile of the batch (the panels
    # replace it); a panel is whole register blocks, a quarter of the L2 unless one
    # block alone is more
    assert not sched.transposes and not nest.tiles and not nest.panels
    width = nest.register_block.size
    assert packed.panel % width == 0
    assert packed.panel == width or inputs * packed.panel * 4 <= machine.l2_bytes // 4
    # the gathered rows are prefetched from the pack
    assert any(loop.index == "i" and loop.factors == (0,) for loop in nest.prefetch)
    with use_target(machine):
        text = sparsenn.explain("bi,oi->bo", x, w)
    assert "register block's factor 0 packed where it is, not copied into loop order: transposing blocks" in text
    assert "re-stored in mode order" not in text and "packed per thread from its own layout" in text


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_a_cheaper_copy_re_lays_the_input_out(machine):
    x, w = torch.randn(64, 784), csr_weight(256, 784, density=0.1)
    sched = plan_of(x, w, relaying(machine))
    (nest,) = sched.nests
    assert nest.packed_block is None and sched.transposes == (((0, 0), (1, 0)),), nest
    with use_target(relaying(machine)):
        assert "factor 0 re-laid out: re-laying it out at every call" in sparsenn.explain("bi,oi->bo", x, w)


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_inputs_in_loop_order_or_a_batch_of_one_are_not_packed(machine):
    w = csr_weight(256, 784, density=0.1)
    # stored feature-major: already laid out [i][b], nothing to transpose
    sched = plan_of(torch.randn(784, 64).T, w, machine)
    assert sched.nests[0].packed_block is None
    # a batch of 1 needs no re-layout
    sched = plan_of(torch.randn(1, 784), w, machine)
    assert sched.nests[0].packed_block is None and not sched.transposes


def test_packing_costs_its_shuffles_or_its_bytes():
    # 8 lanes: 3 shuffles per 8 elements in whole 8 x 8 blocks
    assert pack_cycles(64, 64, 64, 4, AVX2) == pytest.approx(64 * 64 * 3 / 8)
    # 7 columns in a block of 8: all copied one by one, the lane past them too
    assert pack_cycles(64, 7, 8, 4, AVX2) == pytest.approx(64 * 8)
    # a strip from beyond the L2 streams at the last-level cache's rate
    big = 4096 * 512
    assert pack_cycles(4096, 512, 64, 4, AVX2) == pytest.approx(2 * big * 4 / AVX2.bytes_per_cycle(big * 4))


def _matches_torch(x, w, machine, dtype):
    with use_target(machine):
        got = sparsenn.einsum("bi,oi->bo", x, w, out_format="dense")
    expected = torch.einsum("bi,oi->bo", x.double(), w.to_dense().double())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance * 4)


@pytest.mark.parametrize("machine", [AVX2, AVX512, SMALL], ids=["avx2", "avx512", "small-l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_packed_blocks_match_torch(machine, dtype):
    # 301 inputs (rows past the last whole 8 x 8 block); batches of 0, 1, 7 (a partial
    # block only), 64, 131 and 200 (whole blocks and a partial one, several panels on
    # the small L2); 37 rows of the weight
    w = csr_weight(37, 301, dtype)
    g = torch.Generator().manual_seed(1)
    for batch in (0, 1, 7, 64, 131, 200):
        x = torch.randn(batch, 301, generator=g).to(dtype)
        if batch == 200:
            nest = plan_of(x, w, machine).nests[0]
            assert nest.packed_block is not None, nest
            if machine is SMALL:
                assert nest.packed_block.panel < 200
        _matches_torch(x, w, machine, dtype)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_blocks_on_threads_forward_and_backward(threads):
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(301, 45, sparsity=0.7)
    x = torch.randn(67, 301, requires_grad=True)
    assert plan_of(x.detach(), layer.weight, AVX2).nests[0].packed_block is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with use_target(AVX2):
            y = layer(x)
            y.square().sum().backward()
    finally:
        torch.set_num_threads(before)
    assert_layer_matches_dense(layer, x, y)


@pytest.mark.parametrize("machine", MACHINES.values(), ids=MACHINES.keys())
def test_the_input_gradient_packs_the_output_gradient(machine):
    # dX[b, i] = sum_o dY[b, o] W[o, i]: the weight re-stored by columns, the
    # batch-major dY packed
    dy, w = torch.randn(64, 256), csr_weight(256, 784, density=0.1)
    with use_target(machine):
        sched = kernel_schedule("bo,oi->bi", dy, w, out_format="dense")
        got = sparsenn.einsum("bo,oi->bi", dy, w, out_format="dense")
    assert sched.nests[0].packed_block is not None, sched.nests[0]
    torch.testing.assert_close(got, torch.einsum("bo,oi->bi", dy, w.to_dense()), rtol=1e-4, atol=1e-4)
