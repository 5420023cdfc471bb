"""C++ generation: wraps a lowered loop nest into a translation unit (a long fused
kernel into two, which the JIT may compile at once).

The unit defines the kernel's value type, storage type (16-bit values: see
:mod:`.precision`), index type and vector width, includes the runtime headers
(``runtime/sparsenn_kernel.h``, and ``runtime/sparsenn_assembly.h`` when it assembles a
sparse output; the JIT puts them on the include path) and defines the ``extern "C"``
entry points of :mod:`.abi` around the lowered body.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..loops import ir
from ..loops.simplify import simplify
from .abi import FINISH, RUN, slot_arrays
from .c import array_name, print_block
from .jit import PART_BREAK
from .precision import c_types, stored_arrays

if TYPE_CHECKING:
    from ..lower.fuse import FusedLowering
    from ..lower.kernel import LoweredKernel

__all__ = ["generate_source", "generate_fused_source", "KERNEL_HEADER", "ASSEMBLY_HEADER"]

KERNEL_HEADER = "sparsenn_kernel.h"
ASSEMBLY_HEADER = "sparsenn_assembly.h"
_INDEX_CTYPES = {"int32": "int32_t", "int64": "int64_t"}
SPLIT_LINES = 250
"""A fused kernel longer than this (lines of C++; ``$SPARSENN_SPLIT_LINES`` when set) is
printed as two translation units: about 1.5 ms a line at -O3, so each half then builds in
about half the time."""
SPLIT_LINES_ENV = "SPARSENN_SPLIT_LINES"


def split_lines() -> int:
    """The length from which a fused kernel is two translation units (:data:`SPLIT_LINES`)."""
    value = os.environ.get(SPLIT_LINES_ENV, "").strip()
    if not value:
        return SPLIT_LINES
    if not value.isdigit():
        raise ValueError(f"${SPLIT_LINES_ENV} must be a number of lines, got {value!r}")
    return int(value)


def generate_source(kernel: LoweredKernel, value_dtype: str, index_dtype: str) -> str:
    """The complete C++ translation unit for ``kernel``, with values of ``value_dtype`` and
    indices of ``index_dtype`` (``"float32"``, ``"bfloat16"``, ``"int64"``, ...); its SIMD
    vectors are ``kernel.vector_bytes`` wide (the Target's)."""
    dtype = getattr(torch, value_dtype)
    compute, storage = c_types(dtype)
    stored = stored_arrays(kernel, dtype)
    body, fill = kernel.body, kernel.fill
    if stored:  # printed again, converting where 16-bit arrays are read and written
        body = print_block(kernel.loops, stored=stored)
        fill = None if kernel.fill_loops is None else print_block(kernel.fill_loops, stored=stored)
    headers = [KERNEL_HEADER] if kernel.dense_output else [KERNEL_HEADER, ASSEMBLY_HEADER]
    inputs, n = [], 0
    for s, slot in enumerate(kernel.slots):
        for kind, level in slot_arrays(slot):
            ctype = "I" if kind in ("pos", "crd") else "S" if stored else "V"
            name = array_name(ir.Array(kind, s, level))
            inputs.append(f"    const {ctype}* __restrict__ {name} = (const {ctype}*)arrays[{n}];")
            n += 1
    unpack = list(inputs)
    if kernel.dense_output:
        out = "S" if "out" in stored else "V"
        unpack.append(f"    {out}* __restrict__ out = ({out}*)arrays[{n}];")
        unpack.append("    (void)handle;")
    code = _run(unpack, body) + ("" if kernel.dense_output else _finish(fill, inputs))
    return _prelude(compute, storage, index_dtype, kernel.vector_bytes, headers, code) + code


def generate_fused_source(fused: FusedLowering, value_dtype: str, index_dtype: str) -> str:
    """The C++ of a fused kernel (``lower/fuse.py``): ``sn_run`` over its parameters in
    order, values of ``value_dtype`` (32 or 64 bits), vectors of ``fused.vector_bytes``.
    A kernel of more than :func:`split_lines` lines in several stages is two translation
    units (the JIT's ``PART_BREAK`` between them, so it may compile them at once): its
    stages as functions ``sn_stage<k>``, in two groups of about equal length, and
    ``sn_run`` calling them at each team coordinate; else one unit, the stages inline."""
    compute, storage = c_types(getattr(torch, value_dtype))
    assert storage is None, "fused kernels compute in their values' own type"
    unpack = []
    for n, parameter in enumerate(fused.parameters):
        array = parameter.array
        if array.kind == "out":
            unpack.append(f"    V* __restrict__ {array_name(array)} = (V*)arrays[{n}];")
        else:
            ctype = "I" if array.kind in ("pos", "crd") else "V"
            unpack.append(f"    const {ctype}* __restrict__ {array_name(array)} = (const {ctype}*)arrays[{n}];")
    inline = print_block(fused.loops)
    if len(fused.stages) < 2 or inline.count("\n") < split_lines():
        code = _run([*unpack, "    (void)handle;"], inline)
        return _prelude(compute, None, index_dtype, fused.vector_bytes, [KERNEL_HEADER], code) + code
    bodies = [print_block(simplify(ir.Block((*fused.dims, stage)))) for stage in fused.stages]
    cut = _balanced_cut([body.count("\n") for body in bodies])  # the unpacking, alike in each, builds fast
    stages = [_stage_function(k, unpack, body) for k, body in enumerate(bodies)]
    declarations = "".join(f"{_stage_declaration(k)};\n" for k in range(len(stages)))
    calls = ir.Block(tuple(ir.Effect("run_stage", (ir.Const(k),)) for k in range(len(stages))))
    run = _run(["    (void)handle;"], print_block(fused.team_loops(calls)))
    prelude = _prelude(compute, None, index_dtype, fused.vector_bytes, [KERNEL_HEADER], "".join(stages))
    return (prelude + "".join(stages[:cut]) + PART_BREAK
            + prelude + "".join(stages[cut:]) + "\n" + declarations + run)


def _stage_declaration(k: int) -> str:
    return f"SN_STAGE void sn_stage{k}(const int64_t sn_at, void* const* arrays, const int64_t* dims, int nthreads)"


def _stage_function(k: int, unpack: list[str], body: str) -> str:
    """Stage ``k`` of a fused kernel at team coordinate ``sn_at``, its arrays unpacked."""
    return f"\n{_stage_declaration(k)} {{\n" + "\n".join(unpack) + "\n    (void)nthreads;\n" + body + "\n}\n"


def _balanced_cut(lengths: list[int]) -> int:
    """Where to cut the stages (of these lengths) into two groups, each of at least one,
    so that the longer group is as short as can be."""
    return min(range(1, len(lengths)), key=lambda cut: max(sum(lengths[:cut]), sum(lengths[cut:])))


def _prelude(compute: str, storage: str | None, index_dtype: str, vector_bytes: int, headers: list[str],
             code: str) -> str:
    """The unit's definitions and includes; ``SN_LANE_MASKS`` when ``code`` uses the
    header's lane masks (which need the intrinsics headers, costly to parse)."""
    masks = any(name in code for name in _LANE_MASK_NAMES)
    return (
        f"#define SN_VALUE {compute}\n"
        + ("" if storage is None else f"#define SN_STORAGE {storage}\n")
        + f"#define SN_INDEX {_INDEX_CTYPES[index_dtype]}\n"
        f"#define SN_VECTOR_BYTES {vector_bytes}\n"
        + ("#define SN_LANE_MASKS 1\n" if masks else "")
        + "".join(f'#include "{header}"\n' for header in headers)
    )


_LANE_MASK_NAMES = ("sn_lane_mask", "sn_first_lanes", "sn_lane_on", "sn_load_first", "sn_store_first")


def _run(unpack: list[str], body: str) -> str:
    """``sn_run``: the arrays unpacked, then ``body``; an allocation failure returns 1."""
    return (
        f"\n{RUN.declaration} {{\n"
        + "  try {\n"
        + "\n".join(unpack)
        + "\n"
        + body
        + "\n    return 0;\n"
        + "  } catch (const std::bad_alloc&) {\n    return 1;\n  }\n}\n"
    )


def _finish(fill: str | None, inputs: list[str]) -> str:
    """``sn_finish``: copies the chunks' buffers out, or runs a two-phase output's fill
    (``sn_sizes`` and ``sn_free`` are defined in the assembly header)."""
    source, call = "", "sn_fill(r, out, wide, nthreads)"
    if fill is not None:
        call = "sn_fill_phase(r, out, wide, nthreads)"
        source = (
            "\nstatic int sn_fill_phase(Result* res, void* const* out, int wide, int nthreads) {\n"
            "    void* const* arrays = res->arrays;\n    const int64_t* dims = res->dims;\n"
            + "\n".join(inputs) + "\n" + fill + "\n    return 0;\n}\n"
        )
    return source + (
        f"\n{FINISH.declaration} {{\n"
        "  Result* r = (Result*)handle;\n  int code = 0;\n  try {\n"
        f"    code = {call};\n"
        "  } catch (const std::bad_alloc&) {\n    code = 1;\n  }\n  delete r;\n  return code;\n}\n"
    )
