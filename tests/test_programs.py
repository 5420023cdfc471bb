"""Programs: several statements compiled from one text (expression.py's Script,
program.py's staging), the planner's fusion of their stages into one kernel
(plan/fusion.py, runtime/programs.py) with its reasons, terms that visit the same points
merged (plan/terms.py), and gradients through a program."""

from __future__ import annotations

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.frontend.expression import parse_script
from sparsenn.compiler.frontend.notation import NotationError
from sparsenn.compiler.plan.planner import operand_infos
from sparsenn.compiler.runtime.cache import cache_stats
from sparsenn.compiler.plan.terms import merge_terms
from sparsenn.compiler.frontend.program import StageResult, UserOperand
from sparsenn.compiler.frontend.staging import stage

pytestmark = pytest.mark.usefixtures("avx2_host")

SOFTMAX = ("M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i]); Z[i] = sum[j](E[i,j]); "
           "P<E>[i,j] = E[i,j] * (1 / Z[i])")


def random_sparse(shape, fmt, dtype=torch.float64, seed=0) -> SparseTensor:
    """About 40 % of the entries stored, slice 1 along mode 0 empty."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < 0.4)
    dense[1] = 0
    return sparsenn.from_dense(dense, format=fmt)


# ---------------------------------------------------------------------- text


def test_statements_separate_by_semicolons_and_newlines_outside_brackets() -> None:
    script = parse_script("M[i] = max[j](S[i,j]);\n E<S>[i,j] = exp(S[i,j]\n   - M[i])\n\n"
                          "Y[i] = sum[j](E[i,j] * x[j]);")
    assert [s.output for s in script.statements] == ["M", "E", "Y"]
    assert script.operands == ("S", "x"), "names written by a statement are not the caller's operands"
    assert script.statements[1].operands == ("S", "M")


@pytest.mark.parametrize(("text", "message"), [
    ("M[i] = A[i]; M[i] = B[i]", "'M' is already written by an earlier statement"),
    ("Y[i] = A[i] * 2; A[i] = B[i]", "'A' is already read by an earlier statement"),
    ("M[i] = sum[j](S[i,j]); Y[i] = M[i,j]", "tensor 'M' has 1 indices earlier but 2 here"),
    ("Y[i] = A[i]; Z[i] = B[i,j]; W[i] = B[i]", "tensor 'B' has 2 indices earlier but 1 here"),
    (" ; ", "no statement"),
])
def test_script_errors_name_the_statement(text: str, message: str) -> None:
    with pytest.raises(NotationError, match=message):
        sparsenn.compile(text)


def test_an_error_on_a_later_line_quotes_that_line() -> None:
    with pytest.raises(NotationError) as info:
        sparsenn.compile("Y[i] = A[i]\nZ[i] = foo(Y[i])")
    first, quoted, caret = str(info.value).split("\n")
    assert first.endswith("at column 7 of line 2:")
    assert quoted == "    Z[i] = foo(Y[i])" and caret == "    " + " " * 7 + "^"


def test_a_script_stages_each_statement_reading_earlier_results() -> None:
    csr = sparsenn.parse_format("csr", 2)
    program = stage(parse_script(SOFTMAX), (csr,), None)
    assert program.names == ("M", "E", "Z", "P")
    m, e, z, p = program.stages
    assert m.inputs == (UserOperand(0),) and e.inputs == (UserOperand(0), StageResult(0))
    assert z.inputs == (StageResult(1),) and p.inputs == (StageResult(1), StageResult(2))
    # a term that reads the mask at the output's indices is not sampled by it again, nor padded by 0 * mask
    assert str(e.assignment) == "Out[i,j] = exp((S[i,j] - M[i]))" and e.out_format == csr
    assert len(p.assignment.terms) == 1 and p.out_format == csr


# ---------------------------------------------------------------------- fusion


@pytest.mark.parametrize("fmt, shape", [("csr", (40, 70)), ("bsr(4,8)", (40, 64)), ("dddc(1,1,4,4)", (2, 3, 16, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_softmax_written_as_statements_fuses_and_equals_sparsenn_softmax(fmt, shape, dtype) -> None:
    S = random_sparse(shape, fmt, dtype)
    rows, full = ",".join(f"i{m}" for m in range(S.ndim - 1)), ",".join(f"i{m}" for m in range(S.ndim))
    j = f"i{S.ndim - 1}"
    program = sparsenn.compile(f"M[{rows}] = max[{j}](S[{full}]); E<S>[{full}] = exp(S[{full}] - M[{rows}]); "
                               f"Z[{rows}] = sum[{j}](E[{full}]); P<E>[{full}] = E[{full}] * (1 / Z[{rows}])")
    explained = program.explain(S)
    assert "fused kernel of stages 0, 1, 2, 3:" in explained and "not fused" not in explained
    assert "P (stage 3) writes into the array of E (stage 1), dead after it" in explained
    expected = sparsenn.softmax(S, -1).to_dense()
    for _ in range(2):  # the first call plans the fusion, the second runs the fused kernel
        got = program(S)
        assert got.format == S.format and got.nnz == S.nnz
        torch.testing.assert_close(got.to_dense(), expected)


def test_a_stage_reading_an_earlier_result_at_other_coordinates_is_not_fused() -> None:
    S = random_sparse((30, 30), "csr")
    program = sparsenn.compile("Y[i] = sum[j](S[i,j]); P<S>[i,j] = S[i,j] * Y[j]")
    explained = program.explain(S)
    assert "P (stage 1) not fused with Y (stage 0): it reads Y (stage 0) at other coordinates" in explained
    dense = S.to_dense()
    for _ in range(2):
        torch.testing.assert_close(program(S).to_dense(), dense * dense.sum(1)[None, :])


def test_fused_stages_compute_the_same_on_one_thread_and_on_two() -> None:
    """Every row is computed by one thread, in the same order: bit for bit equal."""
    S = random_sparse((300, 257), "csr", torch.float32, seed=3)
    program = sparsenn.compile(SOFTMAX)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        program(S)
        one = program(S).values.clone()
        torch.set_num_threads(2)
        two = program(S).values
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
def test_patterns_whose_stages_make_the_same_decisions_share_one_fused_kernel(machine) -> None:
    """Two patterns, one with twice the stored entries of the other (another signature,
    planned again): the second plan's fused stages are the first's, not lowered again."""
    import _machines

    program = sparsenn.compile(SOFTMAX)
    with sparsenn.compiler.use_target(getattr(_machines, machine)):
        fused = cache_stats()["fused kernels"]
        for density, seed in ((0.1, 5), (0.2, 6)):
            g = torch.Generator().manual_seed(seed)
            dense = torch.randn(250, 250, generator=g, dtype=torch.float64) * (torch.rand(250, 250, generator=g)
                                                                                < density)
            S = sparsenn.from_dense(dense, format="csr")
            torch.testing.assert_close(program(S).to_dense(), torch.where(dense != 0, dense, -torch.inf).softmax(1)
                                       .nan_to_num(0.0) * (dense != 0))
        after = cache_stats()["fused kernels"]
    assert after.hits - fused.hits >= 1 and (after.hits + after.misses) - (fused.hits + fused.misses) == 2


def test_explain_says_why_a_stage_is_not_fused() -> None:
    S = random_sparse((20, 20), "csr")
    x = torch.randn(20, 4, dtype=torch.float64)
    explained = sparsenn.compile("Y[i,k] = S[i,j] * X[j,k]; Z[i] = max[k](Y[i,k])").explain(S, x)
    assert "fusion:" in explained and "Z (stage 1)" in explained


# ---------------------------------------------------------------------- terms and gradients


def test_terms_over_one_shared_pattern_merge_into_one() -> None:
    P = random_sparse((10, 12), "csr")
    dP = P.with_values(torch.randn_like(P.values))
    g = torch.randn(10, dtype=torch.float64)
    program = stage(parse_script("dS<P>[i,j] = P[i,j] * (dP[i,j] - G[i])"),
                    (P.format, P.format, None), None)
    (only,) = program.stages
    assert len(only.assignment.terms) == 3  # P dP, -P G, and 0 P: dP's pattern is unknown when staging
    operands = [P, dP, g]
    merged = merge_terms(only.assignment, operand_infos(operands))
    assert len(merged.terms) == 1, "dP shares P's index arrays: every term visits P's positions"
    got = sparsenn.compile("dS<P>[i,j] = P[i,j] * (dP[i,j] - G[i])")(P, dP, g)
    torch.testing.assert_close(got.values, P.values * (dP.values - g[P.coords()[0][0]]))


def test_a_program_is_differentiable_through_its_statements() -> None:
    S = random_sparse((6, 7), "csr")
    values = S.values.clone().requires_grad_(True)
    program = sparsenn.compile(SOFTMAX)
    torch.autograd.gradcheck(lambda v: program(S.with_values(v)).values, (values,))
    out = program(S.with_values(values)).values
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, values, grad)
    (want,) = torch.autograd.grad(sparsenn.softmax(S.with_values(values)).values, values, grad)
    torch.testing.assert_close(got, want)


def test_results_asked_for_are_kept_and_not_overwritten() -> None:
    S = random_sparse((30, 40), "csr")
    program = sparsenn.compile(SOFTMAX, returns=("E", "P"))
    assert "writes into" not in program.explain(S), "E is returned: P has an array of its own"
    dense = S.to_dense()
    stored = S.with_values(torch.ones_like(S.values)).to_dense() != 0
    for _ in range(2):
        e, p = program(S)
        shifted = torch.where(stored, dense - dense.masked_fill(~stored, float("-inf")).amax(1, keepdim=True), 0)
        torch.testing.assert_close(e.to_dense(), torch.where(stored, shifted.exp(), 0).nan_to_num(0.0))
        torch.testing.assert_close(p.to_dense(), sparsenn.softmax(S).to_dense())
    with pytest.raises(ValueError, match="returns names results the statements write"):
        sparsenn.compile(SOFTMAX, returns="Q")



def test_a_repeated_program_call_finds_its_runner_by_its_signature() -> None:
    """Each call finds the runner of its own signature (another shape, other results kept
    are other signatures) and computes what softmax does; a pattern edited in place is
    refused, not run over."""
    program = sparsenn.compile(SOFTMAX, returns=("E", "P"))
    plain = sparsenn.compile(SOFTMAX)
    small, large = random_sparse((30, 40), "csr"), random_sparse((31, 40), "csr", seed=1)
    expected = {id(S): sparsenn.softmax(S).to_dense() for S in (small, large)}

    def runners() -> tuple[int, int]:
        stats = cache_stats()["program runners"]
        return stats.hits, stats.misses

    for S in (small, large, small, large):
        for _ in range(2):
            torch.testing.assert_close(program(S)[1].to_dense(), expected[id(S)])
            torch.testing.assert_close(plain(S).to_dense(), expected[id(S)])
    hits, misses = runners()
    torch.testing.assert_close(program(small)[1].to_dense(), expected[id(small)])
    torch.testing.assert_close(plain(large).to_dense(), expected[id(large)])
    assert runners() == (hits + 2, misses)
    small.crd[1].zero_()  # an index array edited in place
    with pytest.raises(ValueError):
        plain(small)

# ---------------------------------------------------------------------- epilogues and dense stages

GCN_LAYER = "H[t,o] = relu(A[t,s] * XW[s,o] + b[o]); Z[t,c] = H[t,o] * W[c,o]"


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, hidden, classes", [(300, 29, 7), (257, 128, 3), (301, 9, 1)])
def test_a_propagation_with_its_epilogue_fuses_with_the_next_narrow_product(machine, dtype, threads, rows, hidden,
                                                                            classes) -> None:
    """relu(Â XW + b) runs on each row as its propagation finishes it, and the next
    layer's product over that row (a dense stage, BLAS when apart) runs right after it
    in the same kernel: its output row is narrower than a vector, which BLAS fills badly.
    (Rows beyond the target's ``team_coordinates``: with fewer, the product's threads
    would share its (t, c) coordinates, not the propagation's rows.)"""
    import _machines

    A = random_sparse((rows, rows), "csr", dtype)
    xw, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)
    w = torch.randn(classes, hidden, dtype=dtype)
    before = torch.get_num_threads()
    with sparsenn.compiler.use_target(getattr(_machines, machine)):
        program = sparsenn.compile(GCN_LAYER)
        explained = program.explain(A, xw, b, w)
        assert "Z (stage 1) fused with H (stage 0)" in explained
        try:
            torch.set_num_threads(threads)
            for _ in range(2):
                got = program(A, xw, b, w)
        finally:
            torch.set_num_threads(before)
    want = torch.relu(A.to_dense() @ xw + b) @ w.T
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10  # sums of products of order 10 cancel
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_a_wide_dense_product_stays_in_blas_and_says_why() -> None:
    """64 outputs per row fill BLAS's vectors: the stage runs apart, in torch."""
    import _machines

    A = random_sparse((50, 50), "csr", torch.float32)
    xw, b, w = torch.randn(50, 128), torch.randn(128), torch.randn(64, 128)
    with sparsenn.compiler.use_target(_machines.AVX512):
        program = sparsenn.compile(GCN_LAYER)
        explained = program.explain(A, xw, b, w)
        assert "Z (stage 1) not fused with H (stage 0): Z (stage 1) runs in torch: BLAS" in explained
        for _ in range(2):
            torch.testing.assert_close(program(A, xw, b, w), torch.relu(A.to_dense() @ xw + b) @ w.T)


def test_an_epilogue_run_after_every_nest_is_not_fused() -> None:
    """Y's epilogue needs all of Y's terms (two nests): it runs after them, so a stage
    reading Y cannot run per row inside the same kernel."""
    S, T = random_sparse((30, 30), "csr"), random_sparse((30, 30), "csr", seed=1)
    x = torch.randn(30, 4, dtype=torch.float64)
    program = sparsenn.compile("Y[i,k] = relu(S[i,j] * X[j,k] + T[i,j] * X[j,k]); Z[i] = sum[k](Y[i,k])")
    explained = program.explain(S, x, T)
    assert "Z (stage 1) not fused with Y (stage 0): Y (stage 0) has an epilogue run after its loops" in explained
    want = torch.relu(S.to_dense() @ x + T.to_dense() @ x).sum(1)
    for _ in range(2):
        torch.testing.assert_close(program(S, x, T), want)
