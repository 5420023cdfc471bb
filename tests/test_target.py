"""The machine model: explicit construction, validation and the host reading."""

import pytest

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
