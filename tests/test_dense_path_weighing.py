"""The dense path's weighing in cycles: the sparse kernel at least streams its operands,
a dense operand's re-layout runs at a blocked copy's rate, gathers from the share of
their rows the L2 holds at its gather rate, BLAS at the machine's ``gemm_efficiency``
over whole register tiles, the dense path's own work per call; ``explain`` shows both
costs whichever wins."""

import dataclasses
import math

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512, relaying
from sparsenn.compiler.api import parse
from sparsenn.compiler.plan.dense_path import (dense_product_cycles, gather_cycles_per_byte, relayout_cycles,
                                               schedule_cycles, stream_cycles)
from sparsenn.compiler.plan.planner import operand_infos
from sparsenn.compiler.runtime.evaluate import DensifiedCall, route, weighed_dense_path
from sparsenn.compiler.runtime.validate import check_call

LAYER = parse("bi,oi->bo", 2)


def weight(rows, cols, density, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < density)
    return sparsenn.from_dense(dense, format="csr")


def weighed(x, w):
    """(what the call runs, the dense path weighed against its kernel)."""
    checked = check_call(LAYER, [x, w], "dense")
    routed = route(LAYER, checked)
    if isinstance(routed, DensifiedCall):
        return routed, routed.dense
    return routed, weighed_dense_path(LAYER, checked, routed)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_half_sparse_matrix_vector_product_costs_at_least_streaming_its_weight(target):
    # 1024² at half its entries, batch 1: 2 MiB of values and 2 MiB of int32 coordinates
    # read from the last-level cache, more than the cost model's steps; BLAS reads the
    # dense 4 MiB and the copy's check 4 MiB more, so the kernel stays.
    w, x = weight(1024, 1024, 0.5), torch.randn(1, 1024)
    with sparsenn.compiler.use_target(target):
        routed, dense = weighed(x, w)
        infos = operand_infos([x, w])
        streamed = stream_cycles(LAYER, infos, [0, w.nnz], 4, target)
        nbytes = w.nnz * 8 + (1024 + 1) * 4
        assert streamed == pytest.approx(nbytes / target.llc_bytes_per_cycle + 2 * 1024 * 4 / target.l2_bytes_per_cycle)
        assert not isinstance(routed, DensifiedCall) and not dense.taken
        assert dense.sparse_cycles == pytest.approx(streamed)
        assert streamed > schedule_cycles(routed.schedule, target) * w.nnz / infos[1].nnz
        text = sparsenn.explain("bi,oi->bo", x, w, out_format="dense")
    assert f"sparse kernel kept: the sparse kernel ({dense.sparse_cycles:.3g} cycles)" in text
    assert f"then BLAS ({dense.dense_cycles:.3g} cycles)" in text and "dense path" not in text


@pytest.mark.parametrize("target, rows, cols, density, batch", [
    (AVX2, 128, 3703, 0.3, 256), (AVX512, 256, 784, 0.3, 64)], ids=["avx2", "avx512"])
def test_a_blas_nearer_its_peak_takes_a_moderately_sparse_product(target, rows, cols, density, batch):
    w, x = weight(rows, cols, density), torch.randn(batch, cols)
    for efficiency, dense in ((0.5, False), (0.9, True)):
        with sparsenn.compiler.use_target(dataclasses.replace(target, gemm_efficiency=efficiency)):
            routed, weighing = weighed(x, w)
            assert isinstance(routed, DensifiedCall) == dense == weighing.taken
            text = sparsenn.explain("bi,oi->bo", x, w, out_format="dense")
            assert ("dense path: operand 1 made dense" in text) == dense
            assert ("sparse kernel kept" in text) == (not dense)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_an_input_copied_into_the_loop_order_costs_a_blocked_copy(target):
    # 128 x 3703 inputs (1.9 MB, past the L2) read feature-major, not in panels: torch's
    # blocked copy reads a line per element at the L2's rate, not the last-level cache's
    # (on the machine itself the kernel packs them instead of a copy)
    w, x = weight(128, 3703, 0.1), torch.randn(128, 3703)
    with sparsenn.compiler.use_target(target):
        packing = weighed(x, w)[0]
        packing = packing.shaped if isinstance(packing, DensifiedCall) else packing
        assert packing.schedule.nests[0].packed_block is not None and not packing.schedule.transposes
    target = relaying(target)
    with sparsenn.compiler.use_target(target):
        routed, dense = weighed(x, w)
        kernel = routed.shaped if isinstance(routed, DensifiedCall) else routed
        assert 0 in [k for (_, k), _ in kernel.schedule.transposes]  # x, copied
        copied = relayout_cycles(LAYER, kernel.schedule, operand_infos([x, w]), 4, target)
    assert copied == pytest.approx(128 * 3703 * (target.cache_line_bytes + 4) / target.l2_bytes_per_cycle)
    assert dense.relayout_cycles == pytest.approx(copied)
    assert math.prod(x.shape) * 4 > target.l2_bytes


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_narrow_blas_product_costs_whole_register_tiles_of_its_rows(target):
    # Out[b, o] of 64 x 1024 inputs: BLAS computes its rows of o two widest vectors at a
    # time, so 7 outputs cost as many flops as a whole tile (16 floats on AVX2, 32 on AVX-512)
    tile = target.blas_tile_vectors * target.widest_vector_bytes // 4

    def cycles(outputs):
        return dense_product_cycles(LAYER, [(64, 1024), (outputs, 1024)], 4, target)

    assert cycles(7) == cycles(1) == cycles(tile)
    assert cycles(tile + 1) == pytest.approx(2 * cycles(tile))
    assert cycles(4 * tile) == pytest.approx(4 * cycles(tile))


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("density", [0.5, 0.3])
def test_the_dense_paths_own_work_keeps_a_narrow_layer_on_its_kernel(target, density):
    # 128 -> 7 at batch 64: a BLAS near its peak computes it in a few thousand cycles,
    # but the dense path's own work per call (finding and checking its copy, the BLAS
    # call, the finite check) costs far more than the kernel
    w, x = weight(7, 128, density), torch.randn(64, 128)
    with sparsenn.compiler.use_target(dataclasses.replace(target, gemm_efficiency=0.9)):
        routed, dense = weighed(x, w)
    assert not isinstance(routed, DensifiedCall) and not dense.taken
    assert dense.dense_cycles > target.dense_call_cycles > dense.sparse_cycles


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_gathers_are_costed_by_the_share_of_their_rows_the_l2_holds(target):
    l2 = target.l2_bytes
    assert gather_cycles_per_byte(target.l1_bytes, target) == 1 / target.l2_bytes_per_cycle
    assert gather_cycles_per_byte(l2, target) == 1 / target.gather_bytes_per_cycle
    assert gather_cycles_per_byte(4 * l2, target) == pytest.approx(
        0.25 / target.gather_bytes_per_cycle + 0.75 / target.llc_bytes_per_cycle)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("inputs, outputs, dense", [(1024, 4096, False), (4096, 1024, True)],
                         ids=["half-held", "past-the-l2"])
def test_a_blas_near_its_peak_takes_a_layer_whose_gathered_input_the_l2_does_not_hold(target, inputs, outputs,
                                                                                         dense):
    # batch 256, 30 % of the weight stored, an L2 of 512 KiB, BLAS at 25.6 flops a cycle:
    # the kernel gathers 1 KiB rows of X (inputs x 256 floats), half of them from the L2
    # at 1024 inputs (the kernel is kept), an eighth at 4096 (BLAS takes it)
    machine = dataclasses.replace(target, l2_bytes=512 << 10, gemm_efficiency=0.8 * 32 / target.widest_vector_bytes)
    w, x = weight(outputs, inputs, 0.3), torch.randn(256, inputs)
    with sparsenn.compiler.use_target(machine):
        routed, weighing = weighed(x, w)
    kernel = routed.shaped if isinstance(routed, DensifiedCall) else routed
    assert "".join(kernel.schedule.nests[0].order) == "oib"
    assert isinstance(routed, DensifiedCall) == dense == weighing.taken
