"""Random expressions (hypothesis): ranks 1-3, 1-3 operands, random formats, mode
orders, dtypes, index widths and densities, compared with torch.einsum on dense
copies. The "long" hypothesis profile (tests/conftest.py) runs 10,000 cases."""

from __future__ import annotations

import string

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparsenn
from sparsenn import SparseTensor
from sparsenn.formats import Compressed, Dense, Singleton


def level_strings(rank: int):
    """Valid level strings of a rank: 's' only after 'c' or 's'."""
    def valid(letters: str) -> bool:
        return all(b != "s" or a in "cs" for a, b in zip(" " + letters, letters))
    return st.text("dcs", min_size=rank, max_size=rank).filter(valid)


@st.composite
def operands_and_equation(draw):
    letters = string.ascii_lowercase[:5]
    sizes = {i: draw(st.integers(0 if draw(st.booleans()) and i == "e" else 1, 5)) for i in letters}
    n_ops = draw(st.integers(1, 3))
    specs = []
    for _ in range(n_ops):
        rank = draw(st.integers(1, 3))
        specs.append("".join(draw(st.permutations(letters))[:rank]))
    used = sorted(set("".join(specs)))
    output = draw(st.lists(st.sampled_from(used), unique=True, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    ops = []
    for n, spec in enumerate(specs):
        shape = tuple(sizes[i] for i in spec)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
        dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < density)
        kind = draw(st.sampled_from(["dense", "sparse", "sparse"]))
        if kind == "dense":
            ops.append(dense)
            continue
        letters_ = draw(level_strings(len(spec)))
        order = tuple(draw(st.permutations(range(len(spec)))))
        levels = tuple({"d": Dense, "c": Compressed, "s": Singleton}[c]() for c in letters_)
        fmt = sparsenn.Format(levels, order)
        ops.append(SparseTensor.from_dense(dense, format=fmt, index_dtype=index_dtype))
    equation = ",".join(specs) + "->" + "".join(output)
    return equation, ops


@pytest.mark.fuzz
@given(operands_and_equation())
def test_random_einsum_matches_torch(case):
    equation, ops = case
    dense = [op.to_dense() if isinstance(op, SparseTensor) else op for op in ops]
    expected = torch.einsum(equation, *dense)
    result = sparsenn.einsum(equation, *ops)
    got = result.to_dense() if isinstance(result, SparseTensor) else result
    tol = 1e-4 if expected.dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@st.composite
def sum_of_products(draw):
    """A random "Out[...] = +-T1 +- T2 ..." over shared index sizes, and its operands."""
    letters = "ijk"
    sizes = {i: draw(st.integers(1, 4)) for i in letters}
    names = iter("ABCDEFGH")
    terms, operands = [], {}
    for _ in range(draw(st.integers(1, 3))):
        factors = []
        for _ in range(draw(st.integers(1, 2))):
            spec = draw(st.lists(st.sampled_from(letters), unique=True, min_size=1, max_size=2))
            name = next(names)
            shape = tuple(sizes[i] for i in spec)
            g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
            dense = torch.randn(shape, generator=g, dtype=torch.float64) * (torch.rand(shape, generator=g) < 0.5)
            fmt = draw(st.sampled_from(["dense", "coo", "csf"]))
            operands[name] = dense if fmt == "dense" else SparseTensor.from_dense(dense, format=fmt)
            factors.append(f"{name}[{','.join(spec)}]")
        terms.append((draw(st.sampled_from(["+", "-"])), " * ".join(factors)))
    used = sorted({i for _, t in terms for i in t if i in letters})
    output = draw(st.lists(st.sampled_from(used), unique=True, min_size=1, max_size=2))
    text = f"Out[{','.join(output)}] = " + " ".join(f"{s} {t}" for s, t in terms)
    return text, operands, output, sizes


@pytest.mark.fuzz
@given(sum_of_products())
def test_random_sums_of_products_match_torch(case):
    text, operands, output, sizes = case
    expression = sparsenn.compile(text)
    dense = {n: op.to_dense() if isinstance(op, SparseTensor) else op for n, op in operands.items()}
    expected = torch.zeros(tuple(sizes[i] for i in output), dtype=torch.float64)
    for term in text.split("=")[1].replace("- ", "+ -").split("+")[1:]:
        sign = -1.0 if term.strip().startswith("-") else 1.0
        factors = [f.strip(" -") for f in term.split("*")]
        specs = [f[f.index("[") + 1 : -1].replace(",", "") for f in factors]
        value = torch.einsum(",".join(specs) + "->" + "".join(i for i in output if any(i in s for s in specs)),
                             *[dense[f[0]] for f in factors])
        view = [sizes[i] if any(i in s for s in specs) else 1 for i in output]
        expected = expected + sign * value.reshape(view)
    got = expression(**operands)
    got = got.to_dense() if isinstance(got, SparseTensor) else got
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
