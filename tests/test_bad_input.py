"""Bad input: every case raises a clear ValueError/TypeError naming the operand or array.

``test_bad_input_is_rejected`` is the catalogue (one parametrised test): malformed
einsum strings and expressions, shape mismatches, mixed and unsupported dtypes,
non-CPU (meta) tensors, out-of-range, negative, unsorted and duplicate coordinates,
broken pos arrays, index widths too narrow for the shape, SparseTensors mutated after
construction, absurd ``out_format``s and ``sparsity`` outside [0, 1). Each case asserts
the exception type and a pattern that names the culprit.

The rest checks inputs that look odd but must work: non-contiguous, broadcast
(stride-0), overlapping and flipped dense inputs; NaN/Inf propagation like torch;
shapes beyond int32 switching to int64 index arrays without allocating anything large.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import sparsenn
from sparsenn import SparseTensor
from sparsenn.formats.validate import choose_index_dtype

pytestmark = pytest.mark.filterwarnings("ignore:Sparse (BSR|CSR|BSC|CSC) tensor support is in beta")

F64 = torch.float64


def i32(*items: int) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.int32)


def matrix() -> SparseTensor:
    """A 3x4 float64 CSR matrix with entries in rows 0 and 2."""
    dense = torch.tensor([[1.0, 0, 2, 0], [0, 0, 0, 0], [0, 3, 0, 4]], dtype=F64)
    return sparsenn.from_dense(dense, "csr")


def x(*shape: int, dtype: torch.dtype = F64, **kwargs) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype, **kwargs)


def spmm(a: object, b: object, equation: str = "ij,jk->ik", **kwargs) -> Callable[[], object]:
    return lambda: sparsenn.einsum(equation, a, b, **kwargs)


def csr_parts() -> tuple[tuple[int, int], list, list, torch.Tensor]:
    """A valid 3x5 CSR: row 0 has columns 1 and 3, row 1 is empty, row 2 has column 4."""
    return (3, 5), [None, i32(0, 2, 2, 3)], [None, i32(1, 3, 4)], torch.tensor([1.0, 2.0, 3.0])


def build_csr(pos1: object = None, crd1: object = None, values: object = None) -> Callable[[], object]:
    shape, pos, crd, vals = csr_parts()
    pos[1] = pos[1] if pos1 is None else pos1
    crd[1] = crd[1] if crd1 is None else crd1
    return lambda: SparseTensor(shape, "csr", pos, crd, vals if values is None else values)


def build_coo(rows: torch.Tensor, cols: torch.Tensor, pos0: torch.Tensor | None = None) -> Callable[[], object]:
    pos0 = i32(0, len(rows)) if pos0 is None else pos0
    return lambda: SparseTensor((2, 3), "coo", [pos0, None], [rows, cols], torch.ones(len(rows)))


def mutated(edit: Callable[[SparseTensor], None]) -> Callable[[], object]:
    """einsum on a CSR operand edited by ``edit`` after construction."""
    a = matrix()
    edit(a)
    return spmm(a, x(4, 2))


def compiled(text: str, *args: object, **kwargs: object) -> Callable[[], object]:
    return lambda: sparsenn.compile(text)(*args, **kwargs)


NOTATION = sparsenn.NotationError  # a ValueError

BAD_INPUTS = [
    # ------------------------------------------------------------ einsum strings
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk->ik->i"), NOTATION, r"einsum equation .* more than one '->'",
                 id="two-arrows"),
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk-ik"), NOTATION, r"einsum equation 'ij,jk-ik' .*invalid characters",
                 id="half-arrow"),
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk>ik"), NOTATION, r"einsum equation .*invalid characters \['>'\]",
                 id="arrow-without-dash"),
    pytest.param(spmm(matrix(), x(4, 2), "i1,jk->ik"), NOTATION, r"einsum equation .*invalid characters \['1'\]",
                 id="digit-index"),
    pytest.param(spmm(matrix(), x(4, 2), "iä,äk->ik"), NOTATION, r"einsum equation .*invalid characters \['ä'\]",
                 id="non-ascii-index"),
    pytest.param(spmm(matrix(), x(4, 2), "..ij,jk->ik"), NOTATION, r"einsum equation .*not part of an ellipsis",
                 id="broken-ellipsis"),
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk,kl->il"), NOTATION, r"einsum equation .* names 3 operand.* 2 were given",
                 id="too-few-operands-for-string"),
    pytest.param(spmm(matrix(), x(4, 2), "ij->ij"), NOTATION, r"einsum equation .* names 1 operand.* 2 were given",
                 id="too-many-operands-for-string"),
    pytest.param(spmm(matrix(), x(4, 2), "ii,jk->ik"), NOTATION, r"index 'i' appears twice in operand 0",
                 id="repeated-index-in-operand"),
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk->iik"), NOTATION, r"index 'i' appears twice in the output",
                 id="repeated-output-index"),
    pytest.param(spmm(matrix(), x(4, 2), "ij,jk->iz"), NOTATION, r"output index 'z' .* does not appear",
                 id="unknown-output-index"),
    pytest.param(lambda: sparsenn.einsum(b"ij->ij", matrix()), TypeError, r"einsum equation must be a str",
                 id="equation-not-str"),
    pytest.param(spmm(matrix(), x(5, 2)), ValueError, r"index 'j' has size 5 in operand 1 but size 4 in operand 0",
                 id="index-reused-with-different-sizes"),
    pytest.param(spmm(matrix(), matrix().T, "ij,ij->ij"), ValueError, r"index 'i' has size 4 in operand 1",
                 id="sparse-sparse-size-mismatch"),
    pytest.param(spmm(matrix(), x(4, 2, 1)), ValueError, r"operand 1 has 3 dimension\(s\) .* indexes it with 2",
                 id="rank-mismatch"),
    pytest.param(lambda: sparsenn.einsum("", matrix()), ValueError, r"operand 0 has 2 dimension\(s\) .* with 0",
                 id="empty-equation"),
    # ------------------------------------------------------------ index-notation expressions
    pytest.param(lambda: sparsenn.compile("D[i,j] = A[i,k] * B[k,j] +"), NOTATION, r"unexpected end of expression at column 26:\n    D\[i,j\]",
                 id="expression-dangling-plus"),
    pytest.param(lambda: sparsenn.compile("D[i] = A[i]; import os"), NOTATION, r"expected '\[' but found 'os' at column 20",
                 id="expression-code-injection"),
    pytest.param(lambda: sparsenn.compile("D[i] = (A[i] + B[i]"), NOTATION, r"'\(' is never closed at column 7", id="expression-paren"),
    pytest.param(lambda: sparsenn.compile("D[i,j] = A[i,k] * * B[k,j]"), NOTATION, r"expected a tensor, number, function call or '\(' but found '\*'",
                 id="expression-double-star"),
    pytest.param(lambda: sparsenn.compile("D[i,j] A[i,j]"), NOTATION, r"expected '=' but found 'A'",
                 id="expression-missing-equals"),
    pytest.param(lambda: sparsenn.compile("D[i,j] = A[i,i]"), NOTATION, r"index 'i' appears twice in A\[i,i\]",
                 id="expression-repeated-index"),
    pytest.param(lambda: sparsenn.compile("D[i] = 2 $ A[i]"), NOTATION, r"unexpected character '\$' at column 9",
                 id="expression-stray-character"),
    pytest.param(lambda: sparsenn.compile("D[i] = D[i]"), NOTATION, r"output tensor 'D' also appears",
                 id="expression-output-on-rhs"),
    pytest.param(lambda: sparsenn.compile("D[i] = A[i] + A[i,j]"), NOTATION, r"tensor 'A' is used with 1 and 2 indices",
                 id="expression-operand-rank-changes"),
    pytest.param(lambda: sparsenn.compile("D[i,j] = A[i,k]"), NOTATION, r"output index 'j' does not appear",
                 id="expression-unknown-output-index"),
    pytest.param(lambda: sparsenn.compile(None), TypeError, r"expression must be a str", id="expression-not-str"),
    pytest.param(compiled("D[i] = A[i] + B[i]", x(3)), TypeError, r"missing operand\(s\) \['B'\]",
                 id="expression-missing-operand"),
    pytest.param(compiled("D[i] = A[i]", Z=x(3)), TypeError, r"no operand named 'Z'", id="expression-unknown-operand"),
    pytest.param(compiled("D[i] = A[i]", x(3), A=x(3)), TypeError, r"operand 'A' given twice",
                 id="expression-operand-twice"),
    pytest.param(compiled("D[i] = A[i] * B[i]", x(3), x(4)), ValueError, r"size 4 in operand 1 \(B\)",
                 id="expression-size-mismatch"),
    # ------------------------------------------------------------ dtypes, devices, types
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.float32)), TypeError,
                 r"operand 1 has dtype torch.float32 but earlier operands have torch.float64", id="mixed-dtypes"),
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.int64)), TypeError, r"operand 1 has dtype torch.int64",
                 id="int-values"),
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.complex128)), TypeError, r"operand 1 has dtype torch.complex128",
                 id="complex-values"),
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.bfloat16)), TypeError,
                 r"operand 1 has dtype torch.bfloat16 but earlier operands have torch.float64", id="mixed-bfloat16"),
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.float8_e4m3fn)), TypeError,
                 r"operand 1 has dtype torch.float8_e4m3fn; sparsenn supports float32, float64, bfloat16 or float16",
                 id="float8-values"),
    pytest.param(spmm(matrix(), x(4, 2, dtype=torch.bool)), TypeError, r"operand 1 has dtype torch.bool",
                 id="bool-values"),
    pytest.param(spmm(x(3, 4, dtype=torch.int32), x(4, 2, dtype=torch.int32)), TypeError,
                 r"operand 0 has dtype torch.int32", id="all-dense-int"),
    pytest.param(spmm(matrix(), x(4, 2, device="meta")), ValueError, r"operand 1 is on device meta", id="meta-dense"),
    pytest.param(lambda: matrix().with_values(torch.empty(4, dtype=F64, device="meta")), ValueError,
                 r"values is on device meta", id="with-values-meta"),
    pytest.param(spmm(matrix(), x(4, 2).to_sparse()), TypeError, r"operand 1 is a torch sparse tensor",
                 id="torch-sparse-operand"),
    pytest.param(spmm(matrix(), np.ones((4, 2))), TypeError, r"operand 1 must be a torch.Tensor or SparseTensor, got ndarray",
                 id="numpy-operand"),
    pytest.param(spmm(matrix(), np.ones((2, 4))[::-1].T), TypeError, r"operand 1 must be a torch.Tensor",
                 id="negative-stride-numpy-operand"),
    pytest.param(spmm([[1.0]], x(4, 2)), TypeError, r"operand 0 must be a torch.Tensor or SparseTensor, got list",
                 id="list-operand"),
    pytest.param(lambda: sparsenn.from_dense(x(2, 2, dtype=torch.int32)), TypeError, r"t has dtype torch.int32",
                 id="from-dense-int32"),
    pytest.param(lambda: sparsenn.from_dense(x(2, 2, device="meta")), ValueError, r"t is on device meta",
                 id="from-dense-meta"),
    pytest.param(lambda: sparsenn.from_dense(x(2, 2).to_sparse()), TypeError, r"t must be a strided tensor",
                 id="from-dense-sparse-layout"),
    pytest.param(lambda: sparsenn.from_dense(x(2, 2), index_dtype=torch.int16), TypeError,
                 r"index_dtype must be torch.int32, torch.int64 or None", id="index-dtype-int16"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 1, dtype=torch.long), x(1, dtype=torch.complex64), (2, 3)),
                 TypeError, r"values has dtype torch.complex64", id="from-coo-complex"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 1, dtype=torch.long), x(1, dtype=torch.int64), (2, 3)),
                 TypeError, r"values has dtype torch.int64", id="from-coo-int-values"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 1), x(1), (2, 3)), TypeError,
                 r"indices must be an integer tensor", id="from-coo-float-indices"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(3, 1, dtype=torch.long), x(1), (2, 3)), ValueError,
                 r"indices must have shape \(2, nnz\)", id="from-coo-indices-shape"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 1, dtype=torch.long), x(2), (2, 3)), ValueError,
                 r"values must have shape \(1,\)", id="from-coo-values-shape"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 0, dtype=torch.long), x(0), (2.5, 3)), TypeError,
                 r"shape must be a sequence of ints, got 2.5 for dimension 0", id="from-coo-float-shape"),
    pytest.param(lambda: sparsenn.from_coo(torch.zeros(2, 0, dtype=torch.long), x(0), (-1, 3)), ValueError,
                 r"shape \(-1, 3\) has a negative dimension", id="from-coo-negative-shape"),
    pytest.param(build_csr(values=torch.tensor([1, 2, 3])), TypeError, r"values has dtype torch.int64",
                 id="int-values-array"),
    pytest.param(build_csr(values=x(3, dtype=torch.complex64)), TypeError, r"values has dtype torch.complex64",
                 id="complex-values-array"),
    pytest.param(build_csr(crd1=torch.tensor([1, 3, 4], dtype=torch.int16)), TypeError, r"crd\[1\] .* dtype torch.int16",
                 id="int16-crd"),
    pytest.param(build_csr(crd1=torch.tensor([1, 3, 4])), TypeError, r"crd\[1\] .* all index arrays must share one dtype",
                 id="mixed-index-dtypes"),
    pytest.param(build_csr(crd1=i32(1, 3, 4).reshape(3, 1)), ValueError, r"crd\[1\] .* must be 1-D", id="2d-crd"),
    pytest.param(build_csr(crd1=torch.empty(3, dtype=torch.int32, device="meta")), ValueError,
                 r"crd\[1\] .* on device meta", id="meta-crd"),
    pytest.param(build_csr(values=x(3, device="meta")), ValueError, r"values is on device meta", id="meta-values-array"),
    pytest.param(build_csr(crd1=i32(1, 9, 3, 9, 4)[::2]), ValueError, r"crd\[1\] .* must be contiguous",
                 id="non-contiguous-crd"),
    pytest.param(build_csr(crd1=[1, 3, 4]), TypeError, r"crd\[1\] .* must be a torch.Tensor", id="list-crd"),
    # ------------------------------------------------------------ coordinates and pos arrays
    pytest.param(build_csr(crd1=i32(1, 3, 7)), ValueError,
                 r"crd\[1\] \(level 1, compressed\) has coordinate 7 out of range \[0, 5\) at position 2",
                 id="out-of-range-crd"),
    pytest.param(build_csr(crd1=i32(1, 3, -2)), ValueError, r"crd\[1\] .* coordinate -2 out of range",
                 id="negative-crd"),
    pytest.param(lambda: sparsenn.from_coo(torch.tensor([[0, 1], [0, 3]]), x(2), (2, 3)), ValueError,
                 r"indices\[1\] has value 3 out of range \[0, 3\)", id="from-coo-out-of-range"),
    pytest.param(lambda: sparsenn.from_coo(torch.tensor([[0, -1], [0, 2]]), x(2), (2, 3)), ValueError,
                 r"indices\[0\] has value -1 out of range", id="from-coo-negative"),
    pytest.param(lambda: sparsenn.from_edge_index(torch.tensor([[0], [3]]), num_nodes=3), ValueError,
                 r"edge_index\[1\] has value 3 out of range \[0, 3\)", id="edge-index-out-of-range"),
    pytest.param(lambda: sparsenn.from_edge_index(torch.tensor([[0, -1], [1, 0]])), ValueError,
                 r"edge_index\[0\] has value -1", id="edge-index-negative"),
    pytest.param(build_csr(crd1=i32(3, 1, 4)), ValueError, r"crd\[1\] .* not sorted within a fiber", id="unsorted-crd"),
    pytest.param(build_csr(crd1=i32(3, 3, 4)), ValueError, r"crd\[1\] .* duplicate coordinate 3 at positions 0 and 1",
                 id="duplicate-crd"),
    pytest.param(build_coo(i32(0, 1, 1), i32(2, 0, 0)), ValueError,
                 r"crd\[0\.\.1\] .* duplicate coordinate \(1, 0\) at positions 1 and 2", id="coo-duplicate"),
    pytest.param(build_coo(i32(1, 0, 1), i32(2, 0, 0)), ValueError, r"crd\[0\] \(level 0, compressed\) is not sorted",
                 id="coo-unsorted-rows"),
    pytest.param(build_coo(i32(0, 1, 1), i32(2, 2, 0)), ValueError, r"crd\[1\] \(level 1, singleton\) is not sorted",
                 id="coo-unsorted-columns"),
    pytest.param(build_coo(i32(0, 1, 1), i32(0, 1)), ValueError, r"crd\[1\] \(level 1, singleton\) has length 2, expected 3",
                 id="coo-short-crd"),
    pytest.param(lambda: sparsenn.from_coo(torch.tensor([[1, 0, 1], [2, 0, 2]]), x(3), (2, 3), duplicates="error"),
                 ValueError, r"indices contain the duplicate coordinate \(1, 2\)", id="from-coo-duplicates-error"),
    pytest.param(build_csr(pos1=i32(0, 2, 1, 3)), ValueError, r"pos\[1\] .* not non-decreasing: pos\[1\]\[1\] = 2",
                 id="pos-not-monotone"),
    pytest.param(build_csr(pos1=i32(0, 2, 2, 2)), ValueError, r"pos\[1\] .* ends at 2 but crd\[1\] has length 3",
                 id="pos-not-ending-at-nnz"),
    pytest.param(build_csr(pos1=i32(1, 2, 2, 3)), ValueError, r"pos\[1\] .* must start at 0", id="pos-not-starting-at-0"),
    pytest.param(build_csr(pos1=i32(0, 2, 3)), ValueError, r"pos\[1\] .* has length 3, expected 4", id="pos-too-short"),
    pytest.param(build_csr(values=x(4)), ValueError, r"values has length 4, expected 3", id="values-too-long"),
    pytest.param(lambda: SparseTensor((2, 3), "coo", [None, None], [i32(0), i32(0)], x(1)), ValueError,
                 r"pos\[0\] .* missing", id="pos-missing"),
    pytest.param(lambda: SparseTensor((2, 3), "coo", [i32(0, 1), i32(0)], [i32(0), i32(0)], x(1)), ValueError,
                 r"pos\[1\] .* must be None", id="pos-not-expected"),
    pytest.param(lambda: SparseTensor((2, 2**31), "coo", [i32(0, 0), None], [i32(), i32()], x(0)), ValueError,
                 r"int32 index arrays cannot address shape \(2, 2147483648\)", id="int32-arrays-for-huge-shape"),
    pytest.param(lambda: sparsenn.from_coo(torch.tensor([[0], [0]]), x(1), (2, 2**31 + 5), index_dtype=torch.int32),
                 ValueError, r"index_dtype torch.int32 cannot hold the size 2147483653", id="int32-requested-for-huge-shape"),
    pytest.param(lambda: sparsenn.from_dense(x(2, 2), format="cxs"), ValueError, r"invalid format 'cxs'",
                 id="unknown-format"),
    pytest.param(lambda: SparseTensor((2, 3), "csx", [None, None], [None, None], x(6)), ValueError,
                 r"invalid format 'csx'", id="constructor-unknown-format"),
    pytest.param(lambda: SparseTensor((-1, 3), "dense", [None, None], [None, None], x(0)), ValueError,
                 r"shape \(-1, 3\) has a negative dimension", id="constructor-negative-shape"),
    # ------------------------------------------------------------ SparseTensor mutated after construction
    pytest.param(mutated(lambda a: a.crd[1].__setitem__(0, 3)), ValueError,
                 r"operand 0: index arrays .* modified in place", id="crd-edited-in-place"),
    pytest.param(mutated(lambda a: a.pos[1].add_(0)), ValueError, r"operand 0: index arrays .* modified in place",
                 id="pos-edited-in-place"),
    pytest.param(mutated(lambda a: a.crd[1].resize_(2)), ValueError, r"operand 0: index arrays .* modified in place",
                 id="crd-resized"),
    pytest.param(mutated(lambda a: a.values.resize_(2)), ValueError,
                 r"operand 0: values has shape \(2,\), expected \(4,\)", id="values-resized"),
    pytest.param(mutated(lambda a: setattr(a.values, "data", x(4, 1))), ValueError,
                 r"operand 0: values has shape \(4, 1\), expected \(4,\)", id="values-data-replaced-by-2d"),
    pytest.param(mutated(lambda a: setattr(a.crd[1], "data", a.crd[1].clone())), ValueError,
                 r"operand 0: index arrays .* replaced", id="crd-data-replaced"),
    # ------------------------------------------------------------ out_format
    pytest.param(spmm(matrix(), matrix().T, out_format="xyz"), ValueError,
                 r"out_format='xyz' does not fit the rank-2 result .*invalid format", id="out-format-unknown"),
    pytest.param(spmm(matrix(), matrix().T, out_format=42), TypeError, r"out_format must be None, 'dense', a format",
                 id="out-format-int"),
    pytest.param(spmm(matrix(), matrix().T, out_format=["csr"]), TypeError, r"out_format must be .* got list",
                 id="out-format-list"),
    pytest.param(spmm(matrix(), matrix().T, "ij,jk->ijk", out_format="csr"), ValueError,
                 r"out_format='csr' does not fit the rank-3 result", id="out-format-wrong-rank"),
    pytest.param(spmm(matrix(), matrix().T, out_format=sparsenn.parse_format("csf", 3)), ValueError,
                 r"out_format='csf' does not fit the rank-2 result", id="out-format-object-wrong-rank"),
    pytest.param(spmm(matrix(), matrix(), "ij,ij->", out_format="coo"), ValueError,
                 r"out_format='coo' requested for a scalar \(rank-0\) result", id="out-format-for-scalar"),
    pytest.param(spmm(matrix(), matrix().T, out_format="bsr(2,2)"), ValueError,
                 r"out_format='bsr\(2,2\)' .* shape \(3, 3\) is not divisible by the block", id="out-format-block"),
    pytest.param(spmm(x(3, 4), x(4, 2), out_format="  "), ValueError, r"out_format='  ' does not fit",
                 id="out-format-blank-all-dense"),
    # ------------------------------------------------------------ sparsity of layers and convert
    pytest.param(lambda: sparsenn.SparseLinear(4, 3, sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\)",
                 id="sparsity-one"),
    pytest.param(lambda: sparsenn.SparseLinear(4, 3, sparsity=-0.1), ValueError, r"sparsity must be in \[0, 1\)",
                 id="sparsity-negative"),
    pytest.param(lambda: sparsenn.SparseLinear(4, 3, sparsity=float("nan")), ValueError, r"sparsity must be in \[0, 1\)",
                 id="sparsity-nan"),
    pytest.param(lambda: sparsenn.SparseLinear(4, 3, sparsity="0.5"), TypeError, r"sparsity must be a number",
                 id="sparsity-str"),
    pytest.param(lambda: sparsenn.convert(nn.Sequential(nn.Linear(4, 3)), sparsity=1.5), ValueError,
                 r"sparsity must be in \[0, 1\)", id="convert-sparsity-above-one"),
]


@pytest.mark.parametrize("call, error, names", BAD_INPUTS)
def test_bad_input_is_rejected(call: Callable[[], object], error: type[Exception], names: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert re.search(names, str(info.value)), str(info.value)


def test_catalogue_size() -> None:
    assert len(BAD_INPUTS) >= 40
    assert len({p.id for p in BAD_INPUTS}) == len(BAD_INPUTS)


def test_unedited_inputs_are_valid() -> None:
    """The catalogue's starting points pass: each bad case differs from a valid input by its one edit."""
    build_csr()()
    valid_coo = build_coo(i32(0, 1, 1), i32(2, 0, 1))()
    assert torch.equal(valid_coo.to_dense(), torch.tensor([[0.0, 0, 1], [1, 1, 0]]))
    mutated(lambda a: None)()
    spmm(matrix(), x(4, 2))()
    compiled("D[i] = A[i] * B[i]", x(3), x(3))()


# ----------------------------------------------------------------------------- odd but valid


def dense_layouts() -> dict[str, torch.Tensor]:
    """4x2 float64 tensors stored in unusual ways (torch has no negative strides; a
    flipped tensor is a copy)."""
    base = torch.arange(8, dtype=F64).reshape(4, 2) - 3
    wide = torch.zeros(4, 6, dtype=F64)
    wide[:, ::3] = base
    tall = torch.zeros(8, 2, dtype=F64)
    tall[::2] = base
    return {
        "transposed": base.T.contiguous().T,
        "column-step": wide[:, ::3],
        "row-step": tall[::2],
        "broadcast-stride-0": base[:1].expand(4, 2),
        "overlapping-as-strided": torch.arange(10, dtype=F64).as_strided((4, 2), (1, 1)),
        "flipped": base.flip(0),
        "requires-grad": base.clone().requires_grad_(True),
    }


@pytest.mark.parametrize("layout", list(dense_layouts()))
@pytest.mark.parametrize("equation", ["ij,jk->ik", "ij,jk->ki", "jk,ij->ik"])
def test_unusual_dense_layouts_work(layout: str, equation: str) -> None:
    a = matrix()
    dense = dense_layouts()[layout]
    ops = [a, dense] if equation.startswith("ij") else [dense, a]
    expected = torch.einsum(equation, *[op.to_dense() if isinstance(op, SparseTensor) else op.detach() for op in ops])
    torch.testing.assert_close(sparsenn.einsum(equation, *ops), expected, rtol=0, atol=0)


NAN, INF = float("nan"), float("inf")


def special_matrix() -> SparseTensor:
    """A 3x4 CSR whose stored values include NaN, +Inf and -Inf."""
    return matrix().with_values(torch.tensor([NAN, 1.0, INF, -INF], dtype=F64))


def torch_coo(a: SparseTensor) -> torch.Tensor:
    return a.to_torch(torch.sparse_coo)


def sampled_reference(a: SparseTensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SDDMM by hand: ``a[i,j] * (x @ y.T)[i,j]`` at a's stored entries only."""
    (rows, cols), values = a.coords()
    return torch.zeros(a.shape, dtype=F64).index_put((rows, cols), values * (x @ y.T)[rows, cols])


def dense(result: SparseTensor | torch.Tensor) -> torch.Tensor:
    """A strided copy of a SparseTensor or a torch sparse tensor (strided input as is)."""
    return result.to_dense() if isinstance(result, SparseTensor) or result.layout != torch.strided else result


# NaN/Inf follow torch's sparse semantics: every product of stored values (and dense
# values they meet) is formed and propagates NaN/Inf; an implicit zero forms no product,
# so it never turns 0 * Inf into NaN (torch.einsum on dense copies would).
SPECIAL_CASES = {
    "spmm": lambda a, y, z: (sparsenn.einsum("ij,jk->ik", a, y), torch.sparse.mm(torch_coo(a), y)),
    "spmm-transposed": lambda a, y, z: (sparsenn.einsum("ji,jk->ik", a, z), torch.sparse.mm(torch_coo(a).t(), z)),
    "sddmm": lambda a, y, z: (sparsenn.einsum("ij,ik,jk->ij", a, z, y), sampled_reference(a, z, y)),
    "spgemm": lambda a, y, z: (sparsenn.einsum("ij,kj->ik", a, matrix()),
                               torch.sparse.mm(torch_coo(a), torch_coo(matrix()).t())),
    "product": lambda a, y, z: (sparsenn.einsum("ij,ij->ij", a, a), torch.mul(torch_coo(a), torch_coo(a))),
    "sum": lambda a, y, z: (a + a.T.asformat("csc").T, torch_coo(a) + torch_coo(a)),
    "row-sums": lambda a, y, z: (sparsenn.einsum("ij->i", a), torch.sparse.sum(torch_coo(a), dim=1)),
}


@pytest.mark.parametrize("case", list(SPECIAL_CASES))
def test_nan_and_inf_propagate_like_torch_sparse(case: str) -> None:
    a = special_matrix()
    y = torch.randn(4, 2, dtype=F64)
    y[1, 0], y[3, 1] = NAN, INF  # column 1 of ``a`` is stored in row 2 only
    z = torch.randn(3, 2, dtype=F64)
    z[1, 0] = -INF  # row 1 of ``a`` stores nothing
    got, expected = SPECIAL_CASES[case](a, y, z)
    got, expected = dense(got), dense(expected)
    assert bool((~got.isfinite()).any())
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-12, atol=0)


def test_dimension_beyond_int32_switches_to_int64() -> None:
    n = 2**31 + 5
    assert choose_index_dtype([3, n]) == torch.int64 and choose_index_dtype([3, 2**31 - 1]) == torch.int32
    idx = torch.tensor([[0, 1, 2, 2], [5, n - 1, 7, n - 2]])
    a = sparsenn.from_coo(idx, torch.tensor([1.0, 2.0, 3.0, 4.0]), (3, n), format="csr")
    b = sparsenn.from_coo(idx[:, :3], torch.tensor([1.0, 1.0, 1.0]), (3, n), format="csr")
    assert a.index_dtype == torch.int64
    product = sparsenn.einsum("ij,ij->ij", a, b)
    assert product.index_dtype == torch.int64
    torch.testing.assert_close(product.coords()[0], idx[:, :3])
    total = a + b
    assert total.index_dtype == torch.int64
    torch.testing.assert_close(total.coords()[1], torch.tensor([2.0, 3.0, 4.0, 4.0]))
    gram = sparsenn.einsum("ij,kj->ik", a, b)  # reduces over the huge j without densifying
    torch.testing.assert_close(dense(gram), torch.diag(torch.tensor([1.0, 2.0, 3.0])))
    coo = sparsenn.from_coo(idx, torch.ones(4), (3, n), format="coo")
    torch.testing.assert_close(dense(sparsenn.einsum("ij,ij->i", coo, a)), torch.tensor([1.0, 2.0, 7.0]))


def test_result_with_more_elements_than_int32_stays_sparse_and_exact() -> None:
    """A 70,000 x 70,000 product (4.9e9 elements > 2**31) of int32-indexed operands: any
    linearised index computed in 32 bits would overflow; the result is never dense."""
    n = 70_000
    rows = torch.tensor([0, 1, n - 1, n - 1, n - 2])
    cols = torch.tensor([n - 1, 3, 0, n - 1, n - 1])
    a = sparsenn.from_coo(torch.stack([rows, cols]), torch.arange(1.0, 6.0, dtype=F64), (n, n), format="csr")
    assert a.index_dtype == torch.int32
    result = sparsenn.einsum("ij,kj->ik", a, a)
    assert isinstance(result, SparseTensor) and result.nnz <= 16
    expected = (a.to_scipy() @ a.to_scipy().T).tocoo()
    entries = sorted(zip(expected.row.tolist(), expected.col.tolist(), expected.data.tolist()))
    indices, values = result.coords()
    assert sorted(zip(*indices.tolist(), values.tolist())) == entries


def test_hostile_operand_names_are_only_names() -> None:
    """Names in an expression are display labels: they never reach the generated C++."""
    f = sparsenn.compile("D[i] = __import__[i] * system[i]")
    a = sparsenn.from_dense(torch.tensor([1.0, 0.0, 2.0]), "coo")
    b = torch.tensor([3.0, 4.0, 5.0])
    torch.testing.assert_close(dense(f(a, b)), torch.tensor([3.0, 0.0, 10.0]))
    source = f.explain(a, b).split("generated C++:")[1]
    assert "__import__" not in source and "system" not in source


@pytest.mark.parametrize("name", ["shape", "format", "pos", "crd", "values", "level_sizes", "index_dtype",
                                  "signature", "anything_new"])
def test_sparse_tensor_attributes_cannot_be_reassigned(name: str) -> None:
    """Its structure is checked once, at construction, so it cannot change afterwards."""
    a = matrix()
    with pytest.raises(AttributeError, match=f"SparseTensor is immutable: cannot set '{name}'"):
        setattr(a, name, None)
    with pytest.raises(AttributeError, match="SparseTensor is immutable"):
        delattr(a, "values")
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x(4, 2)), a.to_dense() @ x(4, 2))
