"""The kernel ABI (backend/abi.py) against the generated C++, the runtime headers and
kernels called by hand through it."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.backend import abi, jit
from sparsenn.compiler.backend.c import array_name
from sparsenn.compiler.backend.codegen import ASSEMBLY_HEADER, KERNEL_HEADER, generate_source
from sparsenn.compiler.loops import ir
from sparsenn.compiler import api

pytestmark = pytest.mark.usefixtures("avx2_host")

SIZES = {"i": 30, "j": 20, "k": 25}


def matrix(rows: int, cols: int, seed: int, fmt: str = "csr") -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return sparsenn.from_dense(dense * (torch.rand(rows, cols, generator=g) < 0.2), fmt)


def spgemm_plan():
    """A kernel that assembles a sparse (csr) output."""
    return api.plan("ij,jk->ik", matrix(30, 20, 0), matrix(20, 25, 1))


def spmm_plan():
    """A kernel that writes a dense output."""
    return api.plan("ij,jk->ik", matrix(30, 20, 0), torch.randn(20, 25, dtype=torch.float64))


def header(name: str) -> str:
    return (jit.RUNTIME_HEADERS / name).read_text()


def test_source_includes_the_headers_instead_of_inlining_them():
    dense, sparse = spmm_plan().source, spgemm_plan().source
    assert f'#include "{KERNEL_HEADER}"' in dense and f'#include "{ASSEMBLY_HEADER}"' not in dense
    assert f'#include "{KERNEL_HEADER}"' in sparse and f'#include "{ASSEMBLY_HEADER}"' in sparse
    definitions = [
        m.group(0)
        for name in (KERNEL_HEADER, ASSEMBLY_HEADER)
        for m in re.finditer(r"^(struct \w+|static (inline )?[\w:]+ \w+\(|typedef [^;]+;)", header(name), re.M)
    ]
    assert {"struct Chunk", "static inline V sn_hsum(", "static inline void sn_prefetch(", "typedef SN_VALUE V;"} <= set(
        definitions)
    for source in (dense, sparse):
        assert "#define SN_VALUE double" in source and "#define SN_INDEX int32_t" in source
        for definition in definitions:  # the unit uses the runtime, never repeats it
            assert definition not in source, definition


def test_vector_width_is_a_parameter():
    kernel = spmm_plan().kernel
    for width in (16, 64):
        source = generate_source(dataclasses.replace(kernel, vector_bytes=width), "float32", "int64")
        assert f"#define SN_VECTOR_BYTES {width}\n" in source


def test_entry_points_are_spelled_as_abi_defines_them():
    """Each entry point is defined once, with abi's signature: sn_run and sn_finish in
    the generated unit, sn_sizes and sn_free in the assembly header."""
    dense, sparse, assembly = spmm_plan().source, spgemm_plan().source, header(ASSEMBLY_HEADER)
    for text, defined in [(dense, [abi.RUN]), (sparse, [abi.RUN, abi.FINISH]), (assembly, [abi.SIZES, abi.FREE])]:
        for entry in (abi.RUN, abi.SIZES, abi.FINISH, abi.FREE):
            assert text.count(entry.declaration + " {") == (entry in defined), entry.name
        assert len(re.findall(r'extern "C"', text)) == len(defined)
    assert abi.RUN.declaration == 'extern "C" int sn_run(void* const* arrays, const int64_t* dims, int nthreads, void** handle)'
    assert [e.name for e in abi.entry_points(False)] == ["sn_run"]
    assert [e.name for e in abi.entry_points(True)] == ["sn_run", "sn_sizes", "sn_finish", "sn_free"]


def test_bind_sets_the_ctypes_signatures():
    plan = spgemm_plan()
    entry = abi.bind(jit.load_library(plan.source, "abi"), assembles_sparse_output=True)
    assert entry.run.argtypes == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    assert entry.run.restype is ctypes.c_int and entry.finish.restype is ctypes.c_int
    assert entry.finish.argtypes == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    assert entry.sizes.argtypes == [ctypes.c_void_p, ctypes.c_void_p] and entry.sizes.restype is None
    assert entry.free.argtypes == [ctypes.c_void_p] and entry.free.restype is None
    dense = abi.bind(jit.load_library(spmm_plan().source, "abi"), assembles_sparse_output=False)
    assert dense.sizes is dense.finish is dense.free is None
    with pytest.raises(AttributeError):  # a dense-output kernel exports sn_run only
        abi.bind(jit.load_library(spmm_plan().source, "abi"), assembles_sparse_output=True)


def test_arrays_and_names():
    csr, dense = spgemm_plan().kernel.slots[0], spmm_plan().kernel.slots[1]
    assert abi.slot_arrays(csr) == [("pos", 1), ("crd", 1), ("val", -1)]
    assert abi.slot_arrays(dense) == [("dense", -1)]
    names = [array_name(ir.Array(kind, 2, level)) for kind, level in [("pos", 1), ("crd", 1), ("val", -1), ("dense", -1)]]
    assert names == ["s2_pos1", "s2_crd1", "s2_val", "d2"]
    assert abi.finish_arrays(3, 1) == [("pos", 1), ("crd", 1), ("pos", 2), ("crd", 2), ("val", -1)]
    sizes = abi.OutputSizes.decode([0, 0, 7, 30, 7], 2)
    assert sizes == abi.OutputSizes(coordinates=(0, 7), counts=(0, 30), values=7)
    assert abi.OutputSizes.length(2) == 5 and sizes.positions(1) == 31 and sizes.positions(0) == 2


def kernel_arrays(plan, operands) -> tuple[list[torch.Tensor], ctypes.Array]:
    """The kernel's input arrays in abi order, and its dims."""
    arrays = []
    for slot in plan.kernel.slots:
        op = operands[slot.operand]
        if slot.fmt is None:
            op = (op if slot.layout is None else op.permute(slot.layout)).contiguous()
        elif op.format != slot.fmt:
            op = op.asformat(slot.fmt)
        for kind, level in abi.slot_arrays(slot):
            arrays.append(op if kind == "dense" else op.values if kind == "val" else getattr(op, kind)[level])
    dims = (ctypes.c_int64 * len(plan.kernel.indices))(*[SIZES[i] for i in plan.kernel.indices])
    return arrays, dims


def pointers(arrays: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(arrays))(*[a.data_ptr() for a in arrays])


def test_a_sparse_output_assembled_by_hand_through_the_abi():
    a, b = matrix(30, 20, 0), matrix(20, 25, 1)
    plan = api.plan("ij,jk->ik", a, b)
    entry = abi.bind(jit.load_library(plan.source, "abi"), assembles_sparse_output=True)
    arrays, dims = kernel_arrays(plan, [a, b])
    handle = ctypes.c_void_p()
    inputs = pointers(arrays)
    assert entry.run(inputs, dims, 2, ctypes.byref(handle)) == 0
    fmt, rank = plan.output_format, 2
    sizes = entry.output_sizes(handle, rank)
    out: dict[tuple[str, int], torch.Tensor] = {}
    for kind, level in abi.finish_arrays(rank, fmt.dense_prefix):
        n = sizes.positions(level) if kind == "pos" else sizes.coordinates[level] if kind == "crd" else sizes.values
        out[kind, level] = torch.empty(n, dtype=torch.float64 if kind == "val" else torch.int32)
    assert entry.finish(handle, pointers(list(out.values())), 0, 2) == 0
    levels = range(rank)
    result = SparseTensor((30, 25), fmt, [out.get(("pos", l)) for l in levels], [out.get(("crd", l)) for l in levels],
                          out["val", -1])
    torch.testing.assert_close(result.to_dense(), a.to_dense() @ b.to_dense())


def test_a_dense_output_written_by_hand_through_the_abi():
    a, x = matrix(30, 20, 0), torch.randn(20, 25, dtype=torch.float64)
    plan = api.plan("ij,jk->ik", a, x)
    entry = abi.bind(jit.load_library(plan.source, "abi"), assembles_sparse_output=False)
    arrays, dims = kernel_arrays(plan, [a, x])
    assert plan.schedule.output_order == ("i", "k")
    out = torch.zeros(30, 25, dtype=torch.float64)
    assert entry.run(pointers([*arrays, out]), dims, 1, None) == 0
    torch.testing.assert_close(out, a.to_dense() @ x)
