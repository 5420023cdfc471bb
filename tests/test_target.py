"""The machine model: explicit construction, validation and the host reading."""

import dataclasses
import re

import pytest
import torch

import sparsenn
from _machines import AVX2
from sparsenn.compiler.plan.target import Target


def test_host_is_read_once_and_plausible():
    host = Target.host()
    assert host is Target.host()
    assert host.vector_bytes in (16, 32)
    assert 8 << 10 <= host.l1_bytes <= host.l2_bytes and host.l2_bytes >= 64 << 10
    assert host.llc_bytes >= host.l2_bytes // 2


def test_explicit_targets_compare_by_value():
    small = Target(l2_bytes=512 << 10)
    assert small == Target(l2_bytes=512 << 10) and small != Target(l2_bytes=1 << 20)
    assert hash(small) == hash(Target(l2_bytes=512 << 10))


@pytest.mark.parametrize("vector_bytes, itemsize, lanes", [(32, 4, 8), (32, 8, 4), (16, 4, 4), (64, 8, 8)])
def test_lanes(vector_bytes, itemsize, lanes):
    assert Target(vector_bytes=vector_bytes).lanes(itemsize) == lanes


@pytest.mark.parametrize("field, value", [
    ("vector_bytes", 24), ("vector_bytes", 0), ("l1_bytes", 0), ("l2_bytes", -1), ("row_block", 3),
    ("sparse_accumulators", 1.5),
])
def test_invalid_fields_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        Target(**{field: value})


@pytest.mark.parametrize("field, value", [("fma_per_cycle", 0), ("gemm_efficiency", 1.5), ("llc_share", -0.1),
                                          ("cycles_per_cost_unit", float("inf")), ("dram_bytes_per_cycle", "4")])
def test_cycle_model_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=f"Target.{field}"):
        Target(**{field: value})


@pytest.mark.parametrize("field, value", [("cache_line_bytes", 0), ("gathered_vectors", 0), ("pack_prefetch_rows", -1),
                                          ("chunks_per_thread", 0), ("team_coordinates", 1.5),
                                          ("python_call_cycles", 0)])
def test_machine_facts_are_checked(field, value):
    with pytest.raises(ValueError, match=f"Target.{field}"):
        Target(**{field: value})


@pytest.mark.parametrize("registers, vectors, dot", [(16, 2, (4, 2)), (32, 4, (4, 4))])
def test_tile_shapes_follow_the_vector_registers(registers, vectors, dot):
    target = Target(vector_registers=registers)
    assert (target.register_tile_vectors, target.dot_tile) == (vectors, dot)
    assert dataclasses.replace(Target(), vector_registers=registers).register_tile_vectors == vectors


def test_use_target_wants_a_target():
    with pytest.raises(TypeError, match="Target"):
        with sparsenn.compiler.use_target("avx2"):
            pass


def source(target: Target, *operands) -> str:
    with sparsenn.compiler.use_target(target):
        return sparsenn.compiler.api.plan("ij,jk->ik", *operands, out_format="dense").source


def test_the_kernels_take_their_machine_facts_from_the_target():
    # SpMM with one column: a reduction gathering the dense column at the stored
    # coordinates, in a loop cut into chunks per thread.
    w = sparsenn.from_dense(torch.randn(300, 200) * (torch.rand(300, 200) < 0.2), format="csr")
    operands = (w, torch.randn(200, 1))
    plain = source(AVX2, *operands)
    assert re.search(r"VV gsum\d+\[2\]", plain) and "nthreads * 8)" in plain
    changed = source(dataclasses.replace(AVX2, gathered_vectors=3, chunks_per_thread=5), *operands)
    assert re.search(r"VV gsum\d+\[3\]", changed) and "nthreads * 5)" in changed
