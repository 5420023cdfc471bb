"""A program's backward written as a program (compiler/gradient_program.py): pointwise
gradients substituted into the einsums that read them, so a softmax's backward is two
stages (the row sums, then the pattern) that the planner fuses into one kernel."""

from __future__ import annotations

import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.frontend.program import stage_inputs
from sparsenn.compiler.frontend.program import StageResult
from sparsenn.compiler.gradient_program import Rebuilt, gradient_program, rebuilt_results
from sparsenn.compiler.runtime.programs import describe_program
from sparsenn.compiler.runtime.evaluate import evaluate

SOFTMAX = ("M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - detach(M[i])); Z[i] = sum[j](E[i,j]); "
           "P<E>[i,j] = E[i,j] / Z[i]")


def softmax_backward(fmt: str, rebuild: bool = False):
    """The gradient program of SOFTMAX's stages on a random pattern, and its operands;
    ``rebuild``: ``E`` is not kept but rebuilt from ``P`` and ``Z``."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(8, 12, generator=g, dtype=torch.float64)
    S = sparsenn.from_dense(dense * (torch.rand(8, 12, generator=g) < 0.5), format=fmt)
    program = sparsenn.compile(SOFTMAX).program([S])
    results: list = []
    with torch.no_grad():
        for stage in program.stages:
            results.append(evaluate(stage.assignment, stage_inputs(stage, [S], results), stage.out_format))
    last = len(program.stages) - 1
    incoming = results[last].with_values(torch.randn(S.nnz, dtype=torch.float64, generator=g))
    moving = (False,) + (True,) * last  # the max is detached
    read = dict(enumerate(results))
    rebuilt = rebuilt_results(program, frozenset(range(1, last)), frozenset({last})) if rebuild else {}
    for k in rebuilt:  # its pattern only
        read[k] = results[k]._share(S.shape, S.format, torch.empty(0, dtype=torch.float64))
    backward = gradient_program(program, moving, [S], read, {last: incoming}, [True], rebuilt, False)
    return S, results, incoming, backward


def test_a_softmax_backward_is_two_stages_fused_into_one_kernel():
    S, results, incoming, backward = softmax_backward("csr")
    assert len(backward.program.stages) == 2
    reduction, pattern = backward.program.stages
    assert len(reduction.assignment.output) == 1 and len(pattern.assignment.terms) == 1
    assert backward.outputs == (1,)
    lines = describe_program(backward.program, list(backward.inputs), frozenset({1}))
    assert "fused kernel of stages 0, 1:" in lines


def test_a_normalised_result_is_rebuilt_from_the_normalisation_not_kept():
    program = sparsenn.compile(SOFTMAX).program([sparsenn.from_dense(torch.eye(3), format="csr")])
    # E (stage 1) = P (stage 3) * Z (stage 2); M (stage 0) is a max, whose gradient compares values
    assert rebuilt_results(program, frozenset({0, 1, 2}), frozenset({3})) == {1: Rebuilt(3, StageResult(2), (0,))}
    assert rebuilt_results(program, frozenset({0, 1, 2}), frozenset()) == {}  # P is not kept either
    maxed = sparsenn.compile("E<S>[i,j] = exp(S[i,j]); M[i] = max[j](E[i,j]); Z[i] = sum[j](E[i,j]); "
                             "P<E>[i,j] = E[i,j] / Z[i]").program([sparsenn.from_dense(torch.eye(3), format="csr")])
    assert rebuilt_results(maxed, frozenset({0, 1, 2}), frozenset({3})) == {}


def test_the_gradient_program_computes_softmax_s_gradient():
    for fmt, rebuild in (("csr", False), ("bsr(4,4)", False), ("csr", True), ("bsr(4,4)", True)):
        S, results, incoming, backward = softmax_backward(fmt, rebuild)
        assert all(x is not results[1] for x in backward.inputs) or not rebuild
        with torch.no_grad():
            computed = []
            for stage in backward.program.stages:
                computed.append(evaluate(stage.assignment, stage_inputs(stage, list(backward.inputs), computed),
                                         stage.out_format))
        P = results[-1].to_dense()
        dP = incoming.to_dense()
        expected = P * (dP - (dP * P).sum(1, keepdim=True))
        torch.testing.assert_close(computed[backward.outputs[0]].to_dense(), expected, rtol=1e-12, atol=1e-13)
        assert isinstance(computed[backward.outputs[0]], SparseTensor)


def test_factors_a_sum_does_not_vary_along_are_moved_into_its_epilogue():
    g = torch.Generator().manual_seed(3)
    A = sparsenn.from_dense(torch.randn(6, 9, generator=g, dtype=torch.float64).relu(), format="csr")
    B = A.with_values(torch.randn(A.nnz, generator=g, dtype=torch.float64))
    z = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    expression = sparsenn.compile("Y[i] = sum[j](A[i,j] * B[i,j] * exp(z[i]) / z[i])")
    expected = (A.to_dense() * B.to_dense()).sum(1) * z.exp() / z
    torch.testing.assert_close(expression(A, B, z), expected)
    text = expression.explain(A, B, z)
    planned = next(line for line in text.splitlines() if "moved into the epilogue" in line)
    assert "(sum_{j} (A[i,j] * B[i,j])) * (exp(z[i]) * (1 / z[i]))" in planned and "epilogue fused after loop" in text


def test_a_written_gradient_program_is_reused_only_for_the_same_operands():
    """Written once per call signature: one object passed twice is one operand of the
    program, so a later call with two objects on one pattern needs a program of its own."""
    g = torch.Generator().manual_seed(5)
    A = sparsenn.from_dense(torch.randn(6, 7, generator=g, dtype=torch.float64).relu(), format="csr")
    product = sparsenn.compile("T[i] = sum[j](A[i,j] * B[i,j]); Out[i] = exp(T[i])")
    rows, cols = A.coords()[0]
    a = A.values.clone().requires_grad_()
    X = A.with_values(a)
    product(X, X).sum().backward()
    square = A.to_dense().clone().requires_grad_()
    (square * square).sum(1).exp().sum().backward()
    torch.testing.assert_close(a.grad, square.grad[rows, cols])
    a.grad = None
    b = torch.randn(A.nnz, generator=g, dtype=torch.float64).requires_grad_()
    product(X, A.with_values(b)).sum().backward()
    left, right = A.to_dense().clone().requires_grad_(), A.with_values(b.detach()).to_dense().requires_grad_()
    (left * right).sum(1).exp().sum().backward()
    torch.testing.assert_close(a.grad, left.grad[rows, cols])
    torch.testing.assert_close(b.grad, right.grad[rows, cols])


def test_a_rebuilt_result_is_computed_when_the_gradients_run_stage_by_stage():
    """An operand stored in a dense format sends the backward stage by stage; the
    normalised result the forward did not keep is then computed as ``R · Y``."""
    g = torch.Generator().manual_seed(6)
    S = sparsenn.from_dense(torch.randn(5, 8, generator=g, dtype=torch.float64)
                            * (torch.rand(5, 8, generator=g) < 0.5), format="csr")
    W = sparsenn.from_dense(torch.randn(5, 8, generator=g, dtype=torch.float64), format="dd")
    weighted = sparsenn.compile(SOFTMAX + "; Q<P>[i,j] = P[i,j] * W[i,j]")
    values = S.values.clone().requires_grad_()
    d_out = torch.randn(S.nnz, generator=g, dtype=torch.float64)
    computed, = torch.autograd.grad(weighted(S.with_values(values), W).values, values, d_out)
    dense = S.with_values(values).to_dense().masked_fill(S.with_values(torch.ones_like(values)).to_dense() == 0,
                                                          float("-inf"))
    rows, cols = S.coords()[0]
    weights = W.to_dense()[rows, cols]
    expected, = torch.autograd.grad((torch.softmax(dense, 1)[rows, cols] * weights), values, d_out)
    torch.testing.assert_close(computed, expected)
