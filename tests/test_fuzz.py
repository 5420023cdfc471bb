"""Fuzzing the compiler against torch (marker ``fuzz``; runs in every default test run).

Random einsum calls (1-4 operands of rank 1-4, random formats and mode orders,
float32/float64, int32/int64 index arrays, empty / single-element / random / fully
dense operands, zero-size dimensions, strided and broadcast dense inputs, random
``out_format``) and random sums of products are compared with ``torch.einsum`` on
float64 dense copies; sparse results must also pass full validation. The same
skeletons made nonlinear (a random tree of functions over the factors, a sum, max or min
reduction, an epilogue with a bias) are compared with a reference written from the
semantics (a term counts where all its sparse factors store an entry). A float64
sample of these expressions goes through ``torch.autograd.gradcheck``.

The number of cases follows the hypothesis profile (tests/conftest.py): the default
"ci" profile runs a fixed-seed handful; ``pytest -m fuzz --hypothesis-profile=long``
runs 10,000 einsum cases plus the sums of products and gradchecks (see TESTING.md).
Skeletons (what decides the generated kernel) come from a bounded pool so a long run
is not compile-bound; the data is drawn freely.
"""

from __future__ import annotations

import pytest
import torch
from _strategies import (
    EinsumCase,
    NonlinearCase,
    SumCase,
    assert_valid_result,
    einsum_cases,
    nonlinear_cases,
    nonlinear_reference,
    reduction_length,
    sum_cases,
    to_dense,
    tolerance,
)
from hypothesis import given, settings

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.autograd import differentiable_evaluate
from sparsenn.compiler.runtime.evaluate import evaluate

pytestmark = pytest.mark.fuzz

# The active profile's example count (60 for "ci", 10,000 for "long") sets every budget.
EXAMPLES = settings.default.max_examples
EINSUM_EXAMPLES = EXAMPLES
SUM_EXAMPLES = max(20, EXAMPLES // 4)
GRADCHECK_EXAMPLES = max(6, EXAMPLES // 20)
SUM_GRADCHECK_EXAMPLES = max(4, EXAMPLES // 40)
# Skeleton pools: about 16 cases per skeleton, at least 20 skeletons.
EINSUM_POOL = max(20, EINSUM_EXAMPLES // 16)
SUM_POOL = max(10, SUM_EXAMPLES // 16)
GRADCHECK_POOL = max(6, GRADCHECK_EXAMPLES // 4)
NONLINEAR_EXAMPLES = max(30, EXAMPLES // 2)
NONLINEAR_POOL = max(12, NONLINEAR_EXAMPLES // 16)


def check_against_torch(got, expected: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype, terms: int) -> None:
    dense = to_dense(got)
    assert tuple(dense.shape) == tuple(expected.shape), (tuple(dense.shape), tuple(expected.shape))
    error = (dense.double() - expected).abs()
    allowed = tolerance(bound, dtype, terms)
    bad = error > allowed
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} elements differ; worst error {float(error.max()):.3g} "
        f"(allowed {float(allowed[bad].min()):.3g} there)"
    )


@settings(max_examples=EINSUM_EXAMPLES)
@given(einsum_cases(pool_size=EINSUM_POOL))
def test_einsum_matches_torch(case: EinsumCase) -> None:
    skeleton = case.skeleton
    dense = case.dense_operands()
    expected = torch.einsum(case.equation, *dense)
    bound = torch.einsum(case.equation, *[d.abs() for d in dense])
    result = sparsenn.einsum(case.equation, *case.operands, out_format=skeleton.out_format)
    assert_valid_result(result, skeleton.dtype, skeleton.out_format, expected.dim())
    terms = reduction_length(case.sizes, skeleton.output_indices)
    check_against_torch(result, expected, bound, skeleton.dtype, terms)


@settings(max_examples=SUM_EXAMPLES)
@given(sum_cases(pool_size=SUM_POOL))
def test_sums_of_products_match_torch(case: SumCase) -> None:
    skeleton = case.skeleton
    expression = sparsenn.compile(skeleton.text)
    assert expression.operand_names == skeleton.names
    result = expression(**case.operands)
    expected, bound = case.expected()
    assert_valid_result(result, skeleton.dtype, None, len(skeleton.output))
    terms = len(skeleton.terms) * reduction_length(case.sizes, skeleton.output)
    check_against_torch(result, expected, bound, skeleton.dtype, terms)
    positional = expression(*[case.operands[name] for name in skeleton.names])
    torch.testing.assert_close(to_dense(positional), to_dense(result), rtol=0, atol=0)


def differentiable_inputs(operands) -> tuple[list[torch.Tensor], list]:
    """Leaves for gradcheck (dense operands, sparse operands' values) and a rebuild map."""
    leaves = []
    for op in operands:
        tensor = op.values if isinstance(op, SparseTensor) else op
        leaves.append(tensor.detach().clone().requires_grad_(True))
    return leaves, [op if isinstance(op, SparseTensor) else None for op in operands]


def rebuild(templates: list, leaves: tuple[torch.Tensor, ...]) -> list:
    return [leaf if tpl is None else tpl.with_values(leaf) for tpl, leaf in zip(templates, leaves)]


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(einsum_cases(pool_size=GRADCHECK_POOL, max_size=3, dtype=torch.float64))
def test_einsum_gradcheck(case: EinsumCase) -> None:
    leaves, templates = differentiable_inputs(case.operands)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        ops = rebuild(templates, tensors)
        return to_dense(sparsenn.einsum(case.equation, *ops, out_format=case.skeleton.out_format))

    assert torch.autograd.gradcheck(run, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@settings(max_examples=SUM_GRADCHECK_EXAMPLES)
@given(sum_cases(pool_size=max(4, SUM_GRADCHECK_EXAMPLES // 4), max_size=3, dtype=torch.float64))
def test_sums_of_products_gradcheck(case: SumCase) -> None:
    names = case.skeleton.names
    leaves, templates = differentiable_inputs([case.operands[n] for n in names])
    expression = sparsenn.compile(case.skeleton.text)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return to_dense(expression(*rebuild(templates, tensors)))

    assert torch.autograd.gradcheck(run, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


def check_nonlinear(got, case: NonlinearCase) -> None:
    """Against :func:`nonlinear_reference`: a sum within the rounding bound of its
    magnitude (scaled by ``1 + |result|`` through an epilogue), a max or min within a
    few roundings of the magnitudes its value trees compute, infinities (empty maxima)
    exactly."""
    assignment, dtype = case.skeleton.assignment, case.skeleton.einsum.dtype
    expected = nonlinear_reference(assignment, case.operands)
    dense = to_dense(got).double()
    assert tuple(dense.shape) == tuple(expected.shape), (tuple(dense.shape), tuple(expected.shape))
    infinite = torch.isinf(expected)
    assert torch.equal(dense[infinite], expected[infinite]), "an empty max or min differs"
    eps = torch.finfo(dtype).eps
    bound = nonlinear_reference(assignment, case.operands, magnitude=True)
    if assignment.reduction == "sum":
        allowed = tolerance(bound, dtype, reduction_length(case.sizes, "".join(assignment.output)) + 8)
        if assignment.epilogue is not None:
            allowed = allowed * (1 + expected.abs()) + 8 * eps * expected.abs()
    else:  # the extreme value itself, computed once: a few roundings of its magnitudes
        allowed = 16 * eps * bound + torch.finfo(dtype).tiny
    finite = ~infinite
    error = (dense[finite] - expected[finite]).abs()
    bad = error > allowed[finite]
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} elements differ; worst {float(error.max()):.3g}"


@settings(max_examples=NONLINEAR_EXAMPLES)
@given(nonlinear_cases(pool_size=NONLINEAR_POOL))
def test_nonlinear_matches_reference(case: NonlinearCase) -> None:
    skeleton = case.skeleton
    result = evaluate(skeleton.assignment, case.operands, skeleton.out_format)
    assert_valid_result(result, skeleton.einsum.dtype, skeleton.out_format, len(skeleton.assignment.output))
    check_nonlinear(result, case)


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(nonlinear_cases(pool_size=GRADCHECK_POOL, max_size=3, dtype=torch.float64, smooth=True))
def test_nonlinear_gradcheck(case: NonlinearCase) -> None:
    leaves, templates = differentiable_inputs(case.operands)
    skeleton = case.skeleton

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        ops = rebuild(templates, tensors)
        return to_dense(differentiable_evaluate(evaluate, skeleton.assignment, ops, skeleton.out_format))

    assert torch.autograd.gradcheck(run, tuple(leaves), eps=1e-6, atol=1e-6, rtol=1e-5)
