"""Epilogues applied to a register block before its store (``lower/epilogue.py``
``vector_epilogue``, ``lower/microkernel.py``): a bias, ``relu(x + b)`` and a maximum
with a scalar run on the accumulators of each block of the output row; an epilogue
with a function without a vector form (``gelu``) keeps the scalar loop over the stored
row. Compared with torch on float64 copies on two pinned machine models (8 and 16
float lanes per register block vector), for narrow, odd and wide rows.
"""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, AVX512, LANES
from _strategies import close, irregular_matrix

import sparsenn
from sparsenn.compiler import use_target

COLUMNS = (1, 3, 7, 9, 17, 33, 128)
EPILOGUES = {
    "bias": ("Z[t,c] = A[t,s] * H[s,c] + b[c]", lambda z, b: z + b),
    "relu of bias": ("Z[t,c] = relu(A[t,s] * H[s,c] + b[c])", lambda z, b: torch.relu(z + b)),
    "max with a scalar": ("Z[t,c] = max(A[t,s] * H[s,c] * b[c], 0.25)", lambda z, b: torch.clamp(z * b, min=0.25)),
    "gelu (no vector form)": ("Z[t,c] = gelu(A[t,s] * H[s,c] + b[c])",
                              lambda z, b: torch.nn.functional.gelu(z + b)),
}



@pytest.mark.parametrize("machine", LANES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["csr", "dcsr"])
def test_epilogues_on_register_blocks_match_torch(machine, dtype, fmt):
    a = irregular_matrix(37, 37, 0.2, dtype)
    sparse_a = sparsenn.from_dense(a, format=fmt)
    previous = torch.get_num_threads()
    try:
        with use_target(LANES[machine]):
            for name, (text, reference) in EPILOGUES.items():
                program = sparsenn.compile(text)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for k in COLUMNS:
                        h = torch.randn(37, k, dtype=torch.float64).to(dtype)
                        b = torch.randn(k, dtype=torch.float64).to(dtype)
                        got = program(sparse_a, h, b)
                        expected = reference(a.double() @ h.double(), b.double())
                        torch.testing.assert_close(got.double(), expected, **close(dtype),
                                                   msg=f"{name}, k={k}, {threads} threads")
    finally:
        torch.set_num_threads(previous)


def _store_lines(source: str) -> list[str]:
    return [line for line in source.splitlines() if "sn_store" in line and "(out +" in line]


@pytest.mark.parametrize("machine", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_narrow_spmm_adds_its_bias_before_the_store(machine):
    a = sparsenn.from_dense(irregular_matrix(40, 40, 0.2, torch.float32), format="csr")
    h, b = torch.randn(40, 7), torch.randn(7)
    with use_target(machine):
        source = sparsenn.compile("Z[t,c] = A[t,s] * H[s,c] + b[c]").explain(a, h, b)
        relu = sparsenn.compile("Z[t,c] = relu(A[t,s] * H[s,c] + b[c])").explain(a, h, b)
        gelu = sparsenn.compile("Z[t,c] = gelu(A[t,s] * H[s,c] + b[c])").explain(a, h, b)
    stores = _store_lines(source)
    assert stores and all("vacc" in line and "+ sn_load" in line for line in stores), stores  # acc + b's lanes
    assert "out[" not in source  # no scalar pass re-reading the stored row
    assert all("sn_relu(" in line for line in _store_lines(relu)), _store_lines(relu)
    assert "out[" not in relu
    assert not any("sn_gelu(" in line for line in _store_lines(gelu))
    assert any("sn_gelu(" in line and "out[" in line for line in gelu.splitlines())
