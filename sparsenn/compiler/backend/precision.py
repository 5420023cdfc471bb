"""Value precision: the dtype a kernel stores values in and the dtype it computes in.

float32 and float64 kernels store and compute in their dtype. bfloat16 and float16
kernels *store* values in 16 bits (the operands' values, dense operands, the output)
and *compute* in float32: every load widens a value to float32 (exactly), scalars,
vectors, register tiles, workspaces, reductions and functions are float32, and a value
is rounded to 16 bits (to nearest, ties to even, as ``Tensor.to`` rounds) only when it
is written to a value array (``runtime/sparsenn_kernel.h``: ``SN_STORAGE``). A product
of ``n`` terms is then within the float32 summation error ``n * 2^-24 * sum |terms|`` of
the exact value of the 16-bit inputs before its one final rounding (relative error
``2^-8`` for bfloat16, ``2^-11`` for float16).

A dense output that a kernel *accumulates in* (``out += ...`` across a reduction loop,
a max, an epilogue or remainder loop reading it back) would be rounded at every step;
such a kernel writes a float32 array instead, which the launcher rounds once at the
end (:func:`output_dtype`). A kernel that only stores finished values writes 16 bits.
A product of three or more factors that runs as pairwise contractions
(``plan/contract.py``) stores each intermediate in the operands' dtype, as
``torch.einsum`` does: one more rounding per intermediate.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..loops import ir

if TYPE_CHECKING:
    from ..lower.kernel import LoweredKernel

__all__ = ["HALF_DTYPES", "compute_dtype", "c_types", "reads_output", "output_dtype", "stored_arrays"]

# Value dtypes stored in 16 bits and computed in float32, with their C++ storage type.
_STORAGE_CTYPES = {torch.bfloat16: "sn_bf16", torch.float16: "sn_f16"}
HALF_DTYPES = tuple(_STORAGE_CTYPES)
_COMPUTE_CTYPES = {torch.float32: "float", torch.float64: "double"}
# Arrays of values, by kind (``ir.Array.kind``): the operands' and an assembled output's.
_VALUE_ARRAYS = frozenset({"val", "dense", "out_val"})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels over values of ``dtype`` compute in."""
    return torch.float32 if dtype in _STORAGE_CTYPES else dtype


def c_types(dtype: torch.dtype) -> tuple[str, str | None]:
    """(the C++ compute type, the C++ storage type or None when it is the compute type)."""
    compute = compute_dtype(dtype)
    if compute not in _COMPUTE_CTYPES:
        raise TypeError(f"sparsenn kernels have no value type for {dtype}")
    return _COMPUTE_CTYPES[compute], _STORAGE_CTYPES.get(dtype)


def reads_output(loops: ir.Block) -> bool:
    """Whether the statements read the dense output ``out`` (accumulate in it, combine
    with it, or load it), rather than only store finished values into it."""

    def reads(node) -> bool:
        if isinstance(node, ir.Assign) and isinstance(node.target, ir.Load) and node.target.array.kind == "out":
            return node.op != "=" or reads(node.target.index) or reads(node.value)
        if isinstance(node, (ir.Load, ir.VectorLoad)) and node.array.kind == "out":
            return True
        if isinstance(node, tuple):
            return any(reads(item) for item in node)
        if isinstance(node, (ir.Expr, ir.Stmt)):
            return any(reads(getattr(node, f.name)) for f in dataclasses.fields(node))
        return False

    return reads(loops)


def output_dtype(kernel: LoweredKernel, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the dense array ``kernel`` writes for values of ``dtype``: ``dtype``,
    or float32 when a 16-bit kernel reads its output back (the caller rounds it after)."""
    if dtype in _STORAGE_CTYPES and kernel.dense_output and reads_output(kernel.loops):
        return compute_dtype(dtype)
    return dtype


def stored_arrays(kernel: LoweredKernel, dtype: torch.dtype) -> frozenset[str]:
    """The kinds of the arrays ``kernel`` keeps in 16 bits for values of ``dtype``: none
    for float32 and float64; else the operands' values, an assembled output's values and
    a dense output of :func:`output_dtype` ``dtype``."""
    if dtype not in _STORAGE_CTYPES:
        return frozenset()
    if kernel.dense_output and output_dtype(kernel, dtype) == dtype:
        return _VALUE_ARRAYS | {"out"}
    return _VALUE_ARRAYS
