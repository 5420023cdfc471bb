"""Operands sharing a pattern (the same index arrays: ``S`` and ``S.with_values(v)``, or
one operand read twice) are read at one position instead of being co-iterated
(``lower/merge.py``), and a term of coefficient 0 (a pattern kept in a result) reads
no values, so a gradient's mask may be its operand itself."""

from __future__ import annotations

import re

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor


def random_sparse(shape, fmt, seed=0, density=0.4) -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    return sparsenn.from_dense(dense * (torch.rand(shape, generator=g) < density), format=fmt)


MERGE = re.compile(r"sn_imin\((\w+_)?c\d+")  # a merge's step: the least of its cursors' coordinates


def merges(equation: str, *operands) -> bool:
    """Whether the kernel of the call co-iterates cursors (a merge of coordinates)."""
    text = sparsenn.explain(equation, *operands)
    return MERGE.search(text[text.index("generated C++"):]) is not None


@pytest.mark.parametrize("fmt", ["csr", "coo", "csf", "bsr(2,4)"])
def test_operands_sharing_a_pattern_are_read_at_one_position(fmt):
    shape = (8, 12) if fmt != "csf" else (6, 4, 5)
    indices = "ij" if fmt != "csf" else "ijk"
    A = random_sparse(shape, fmt)
    B = A.with_values(torch.randn(A.nnz, dtype=torch.float64))
    equation = f"{indices},{indices}->{indices}"
    torch.testing.assert_close(sparsenn.einsum(equation, A, B).to_dense(), A.to_dense() * B.to_dense())
    torch.testing.assert_close(sparsenn.einsum(equation, A, A).to_dense(), A.to_dense() ** 2)
    for operands in ((A, B), (A, A)):
        assert not merges(equation, *operands)


def test_operands_with_equal_but_distinct_patterns_are_still_co_iterated():
    A = random_sparse((8, 12), "csr")
    C = sparsenn.from_dense(A.to_dense(), format="csr")  # the same positions in arrays of its own
    torch.testing.assert_close(sparsenn.einsum("ij,ij->ij", A, C).to_dense(), A.to_dense() ** 2)
    assert merges("ij,ij->ij", A, C)


def test_a_sampled_gradient_reads_no_value_of_its_operand():
    A = random_sparse((6, 9), "csr", seed=1)
    values = A.values.clone()
    values[::3] = float("inf")
    values[1::3] = float("nan")
    values.requires_grad_()
    X = torch.randn(9, 4, dtype=torch.float64)
    g = torch.randn(6, 4, dtype=torch.float64)
    sparsenn.einsum("ij,jk->ik", A.with_values(values), X).backward(g)
    rows, cols = A.coords()[0]
    torch.testing.assert_close(values.grad, (g @ X.T)[rows, cols])


@pytest.mark.parametrize("fmt", ["csr", "bsr(2,4)"])
def test_a_result_sampled_by_operands_sharing_its_pattern_is_stored_once(fmt):
    """``Out<P> = P * dP - P * g`` with ``dP`` on ``P``'s index arrays: each stored value
    is written once (``=``), so the output is not filled first (poisoned memory shows it)."""
    P = random_sparse((8, 12), fmt, seed=2)
    dP = P.with_values(torch.randn(P.nnz, dtype=torch.float64))
    g = torch.randn(8, dtype=torch.float64)
    expression = sparsenn.compile("Out<P>[i,j] = P[i,j] * (dP[i,j] - g[i])")
    assert "stores each sampled value once if operand(s) [0, 1] anchor the output" in expression.explain(P, dP, g)
    previous = sparsenn.compiler.poison_outputs(True)
    try:
        result = expression(P, dP, g)
    finally:
        sparsenn.compiler.poison_outputs(previous)
    expected = P.to_dense() * (dP.to_dense() - g[:, None])
    torch.testing.assert_close(result.to_dense(), expected)
