"""The dense path's weighing in cycles: the sparse kernel at least streams its operands,
a dense operand's re-layout runs at a blocked copy's rate, BLAS at the machine's
``gemm_efficiency``; ``explain`` shows both costs whichever wins."""

import dataclasses
import math

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512
from sparsenn.compiler.api import parse
from sparsenn.compiler.plan.dense_path import relayout_cycles, schedule_cycles, stream_cycles
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
    w, x = weight(128, 3703, 0.1), torch.randn(128, 3703)
    with sparsenn.compiler.use_target(target):
        routed, dense = weighed(x, w)
        kernel = routed.shaped if isinstance(routed, DensifiedCall) else routed
        assert 0 in [k for (_, k), _ in kernel.schedule.transposes]  # x, copied
        copied = relayout_cycles(LAYER, kernel.schedule, operand_infos([x, w]), 4, target)
    assert copied == pytest.approx(128 * 3703 * (target.cache_line_bytes + 4) / target.l2_bytes_per_cycle)
    assert dense.relayout_cycles == pytest.approx(copied)
    assert math.prod(x.shape) * 4 > target.l2_bytes
