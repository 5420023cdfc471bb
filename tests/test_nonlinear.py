"""The kernel IR beyond sums of products, run by the back end: term values (functions of
the factors), max/min reductions and epilogues, on every format, against a reference
written from the semantics (a term counts only where all its sparse factors store an
entry), and their gradients. The text front end that produces these assignments is
tested in test_expressions.py."""

from __future__ import annotations

import math

import pytest
import torch
from _strategies import nonlinear_reference

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.autograd import differentiable_evaluate
from sparsenn.compiler.frontend.functions import FUNCTIONS, PUBLIC_FUNCTIONS, apply
from sparsenn.compiler.frontend.notation import Access, Assignment, Constant, Epilogue, Factor, Reduced, Term
from sparsenn.compiler.api import _plan
from sparsenn.compiler.runtime.evaluate import evaluate
from sparsenn.compiler.runtime.validate import check_call

pytestmark = pytest.mark.usefixtures("avx2_host")

FORMATS = ("csr", "csc", "coo", "dcsr", "bsr(2,3)", "nm(2,3)", "dense-tensor")
UNARY = tuple(name for name in PUBLIC_FUNCTIONS if FUNCTIONS[name].arity == 1)


def operand(shape, fmt: str, dtype=torch.float64, seed=0, empty_rows=(1,)):
    """Random values with about half the entries zero and some rows empty, as ``fmt``
    (``"dense-tensor"``: a plain tensor)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    if fmt.startswith("nm"):  # at most 2 of each group of 3 along the last mode
        values = values.reshape(-1, 3)
        values[:, 2] = 0
        values = values.reshape(shape)
    else:
        values *= torch.rand(shape, generator=g) < 0.5
    for row in empty_rows:
        values[row] = 0
    values = values.to(dtype)
    return values if fmt == "dense-tensor" else sparsenn.from_dense(values, format=fmt)


def assert_matches(got, assignment, operands, dtype):
    expected = nonlinear_reference(assignment, operands)
    dense = got.to_dense() if isinstance(got, SparseTensor) else got
    assert dense.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(dense.double(), expected, rtol=tol, atol=tol, equal_nan=True)


def unary(name: str, t: int = 0):
    """A safe argument for ``name``: log and sqrt read ``1 + |x|``."""
    x = Factor(t)
    if name in ("log", "sqrt"):
        x = apply("add", Constant(1.0), apply("abs", x))
    return apply(name, x)


SPMM = ((("i", "j"), ("j", "k")), ("i", "k"))


def spmm(value=None, reduction="sum", epilogue=None, coefficient=1.0) -> Assignment:
    (a, x), out = SPMM
    names = ("A", "X") if epilogue is None else ("A", "X", "b")
    return Assignment(out, (Term(coefficient, (Access(0, a), Access(1, x)), value),), names, reduction, epilogue)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", UNARY)
def test_function_of_a_sparse_factor_times_dense(name, fmt):
    """``sum_j f(A[i,j]) * X[j,k]``: f on A's stored entries (an f(0) != 0 counts there only)."""
    A, X = operand((6, 9), fmt), operand((9, 4), "dense-tensor", seed=1)
    assignment = spmm(apply("mul", unary(name), Factor(1)))
    assert_matches(evaluate(assignment, [A, X], None), assignment, [A, X], torch.float64)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("fmt", ("csr", "coo", "bsr(2,3)"))
def test_elementwise_value_keeps_the_pattern(fmt, dtype):
    """``Out[i,j] = max(tanh(S) , S / d[i])``: a sparse result on S's pattern, f(0) != 0
    parts included only at stored entries."""
    S, d = operand((6, 9), fmt, dtype), operand((6,), "dense-tensor", dtype, seed=2).abs() + 1
    value = apply("max", apply("sigmoid", Factor(0)), apply("div", Factor(0), Factor(1)))
    assignment = Assignment(("i", "j"), (Term(1.0, (Access(0, ("i", "j")), Access(1, ("i",))), value),), ("S", "d"))
    got = evaluate(assignment, [S, d], None)
    assert isinstance(got, SparseTensor) and got.nnz == S.nnz
    assert_matches(got, assignment, [S, d], dtype)


def test_value_terms_in_a_sparse_sum():
    """A union of two sparse terms, one a function of its factor (the sparse assembly)."""
    S, T = operand((5, 7), "csr", seed=3), operand((5, 7), "csr", seed=4, empty_rows=(2,))
    terms = (Term(1.0, (Access(0, ("i", "j")),), apply("relu", Factor(0))),
             Term(-2.0, (Access(1, ("i", "j")),), apply("tanh", Factor(0))))
    assignment = Assignment(("i", "j"), terms, ("S", "T"))
    got = evaluate(assignment, [S, T], None)
    assert isinstance(got, SparseTensor)
    assert_matches(got, assignment, [S, T], torch.float64)


# ----------------------------------------------------------------------------- max and min


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reduction", ("max", "min"))
def test_max_min_over_stored_entries(reduction, fmt):
    """A row with no entries gives the identity (-inf for max); unstored entries never
    count, stored zeros (of blocks and n:m groups) do."""
    S = operand((6, 9), fmt)
    assignment = Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), Factor(0)),), ("S",), reduction)
    got = evaluate(assignment, [S], None)
    assert_matches(got, assignment, [S], torch.float64)
    if fmt in ("csr", "csc", "coo", "dcsr"):
        assert got[1] == (-math.inf if reduction == "max" else math.inf)


@pytest.mark.parametrize("fmt", ("csr", "csc", "bsr(2,3)"))
def test_max_over_the_outer_mode_and_of_a_product(fmt):
    """``max_i`` of a CSR (the reduction moves inside: the pattern is re-stored), and
    ``max_j`` of ``-2 * S[i,j] * w[j]`` (the coefficient scales before the max)."""
    S, w = operand((6, 9), fmt), operand((9,), "dense-tensor", seed=5)
    columns = Assignment(("j",), (Term(1.0, (Access(0, ("i", "j")),), Factor(0)),), ("S",), "max")
    assert_matches(evaluate(columns, [S], None), columns, [S], torch.float64)
    product = apply("mul", Factor(0), Factor(1))
    scaled = Assignment(("i",), (Term(-2.0, (Access(0, ("i", "j")), Access(1, ("j",))), product),), ("S", "w"), "max")
    assert_matches(evaluate(scaled, [S, w], None), scaled, [S, w], torch.float64)


@pytest.mark.parametrize("reduction", ("max", "min"))
@pytest.mark.parametrize("fmt", ("dense-tensor", "bsr(4,8)", "bsr(4,40)"))
@pytest.mark.parametrize("value", ("S", "abs(S)"))
def test_vectorised_max_min_keep_nan_in_every_lane(reduction, fmt, value):
    """A dense innermost reduction runs vectorised: ``max_j S`` over SIMD accumulators
    combined by ``sn_vmax`` and a tree over the lanes, a value tree as an ``omp simd``
    reduction. A NaN in any lane (first, middle, last, the scalar tail) gives NaN, as
    torch.amax / torch.amin."""
    dense = operand((8, 40), "dense-tensor", seed=3)
    for row, col in enumerate((0, 5, 15, 16, 31, 39)):
        dense[row, col] = math.nan
    S = dense if fmt == "dense-tensor" else sparsenn.from_dense(dense, format=fmt)
    tree = Factor(0) if value == "S" else apply("abs", Factor(0))
    assignment = Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), tree),), ("S",), reduction)
    if fmt == "dense-tensor":
        source = _plan(assignment, check_call(assignment, [S], None)).source
        assert (f"sn_v{reduction}(" if value == "S" else f"reduction(sn_{reduction}_reduction:") in source
    got = evaluate(assignment, [S], None)
    reference = dense if value == "S" else dense.abs()
    expected = (torch.amax if reduction == "max" else torch.amin)(reference, 1)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)


def test_max_of_a_rank3_tensor_over_two_indices():
    S = sparsenn.from_dense(operand((3, 4, 5), "dense-tensor", empty_rows=(0,)), format="csf")
    assignment = Assignment(("b",), (Term(1.0, (Access(0, ("b", "i", "j")),), apply("abs", Factor(0))),), ("S",),
                            "max")
    got = evaluate(assignment, [S], None)
    assert got[0] == -math.inf
    assert_matches(got, assignment, [S], torch.float64)


def test_max_takes_one_term_with_a_value():
    with pytest.raises(ValueError, match="one term with a value"):
        Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),)),), ("S",), "max")
    with pytest.raises(ValueError, match="reduction must be one of"):
        Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), Factor(0)),), ("S",), "mean")


def test_value_terms_read_exact_patterns_when_re_stored():
    """A factor re-stored in another mode order must not gain entries: ``cd`` read as
    ``(a, b)`` would store zeros under a dense ``b``, where ``sigmoid(0) != 0``."""
    S = sparsenn.from_dense(torch.tensor([[0.0], [1.5]], dtype=torch.float64), format="cd")
    x = torch.tensor([[0.3], [0.7]], dtype=torch.float64)
    value = apply("mul", apply("sigmoid", Factor(0)), Factor(1))
    term = Term(1.0, (Access(0, ("b", "c")), Access(1, ("b", "a"))), value)
    assignment = Assignment(("a", "b", "c"), (term,), ("x", "S"))
    got = evaluate(assignment, [x, S], None)
    assert got.nnz == 1
    assert_matches(got, assignment, [x, S], torch.float64)


def test_max_result_is_dense_only():
    S = operand((4, 5), "csr")
    assignment = Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), Factor(0)),), ("S",), "max")
    with pytest.raises(ValueError, match="max-reduction is dense"):
        evaluate(assignment, [S], "c")


# ----------------------------------------------------------------------------- epilogues


def bias_relu() -> Epilogue:
    return Epilogue((Access(2, ("k",)),), apply("relu", apply("add", Reduced(), Factor(0))))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("fmt", FORMATS)
def test_epilogue_bias_and_activation(fmt, dtype):
    """``relu(A @ X + b)`` in one kernel, every format (blocked ones split)."""
    A, X = operand((6, 9), fmt, dtype), operand((9, 40), "dense-tensor", dtype, seed=1)
    b = operand((40,), "dense-tensor", dtype, seed=2, empty_rows=())
    assignment = spmm(epilogue=bias_relu())
    assert_matches(evaluate(assignment, [A, X, b], None), assignment, [A, X, b], dtype)


def schedule_of(assignment, operands):
    checked = check_call(assignment, operands, None)
    return _plan(assignment, checked)


def test_epilogue_fuses_after_the_row_loop():
    """CSR rows visit every row: the epilogue runs per row, right after its reduction
    (register-blocked k); a DCSR's rows are filtered, so it runs after the nest."""
    A, X, b = operand((6, 9), "csr"), operand((9, 64), "dense-tensor"), operand((64,), "dense-tensor", empty_rows=())
    fused = schedule_of(spmm(epilogue=bias_relu()), [A, X, b])
    (nest,) = fused.schedule.nests
    assert nest.order[0] == "i" and nest.epilogue_at == 1 and nest.register_block is not None
    assert "sn_relu" in fused.source
    D = sparsenn.from_dense(A.to_dense(), format="dcsr")
    (nest,) = schedule_of(spmm(epilogue=bias_relu()), [D, X, b]).schedule.nests
    assert nest.epilogue_at is None
    assignment = spmm(epilogue=bias_relu())
    assert_matches(evaluate(assignment, [D, X, b], None), assignment, [D, X, b], torch.float64)


def test_epilogue_after_a_sum_of_terms():
    """Two terms (two nests): the epilogue runs once over the output after both."""
    A, B = operand((6, 9), "csr"), operand((6, 9), "csc", seed=7)
    X, b = operand((9, 5), "dense-tensor", seed=1), operand((5,), "dense-tensor", empty_rows=())
    terms = (Term(1.0, (Access(0, ("i", "j")), Access(2, ("j", "k")))),
             Term(0.5, (Access(1, ("i", "j")), Access(2, ("j", "k")))))
    epilogue = Epilogue((Access(3, ("k",)),), apply("gelu", apply("add", Reduced(), Factor(0))))
    assignment = Assignment(("i", "k"), terms, ("A", "B", "X", "b"), "sum", epilogue)
    assert all(n.epilogue_at is None for n in schedule_of(assignment, [A, B, X, b]).schedule.nests)
    assert_matches(evaluate(assignment, [A, B, X, b], None), assignment, [A, B, X, b], torch.float64)


def test_epilogue_reads_dense_operands_only():
    A, X = operand((6, 9), "csr"), operand((9, 5), "dense-tensor")
    b = sparsenn.from_dense(operand((5,), "dense-tensor", empty_rows=()), format="c")
    with pytest.raises(ValueError, match="epilogue.*dense"):
        evaluate(spmm(epilogue=bias_relu()), [A, X, b], None)
    with pytest.raises(ValueError, match="epilogue is dense"):
        evaluate(spmm(epilogue=bias_relu()), [A, X, b.to_dense()], "csr")


@pytest.mark.parametrize("value, in_place", [
    (apply("gelu", apply("add", Factor(0), Factor(1))), True),
    (apply("mul", apply("relu", Factor(0)), Constant(2.0)), True),
    (apply("silu", Factor(0)), True),
    (apply("sub", Factor(1), Factor(0)), False),  # factor 0 is not the first argument
    (apply("mul", Factor(0), Factor(0)), False),  # factor 0 read twice
    (apply("normal_cdf", Factor(0)), False),  # no in-place form
], ids=["gelu-bias", "relu-scaled", "silu", "sub-reversed", "square", "no-in-place-form"])
def test_an_epilogue_over_a_path_result_is_written_in_place_when_its_functions_allow(value, in_place):
    """What :class:`EpiloguePathCall` applies over the path's own result: in its memory,
    equal to the out-of-place value; otherwise nothing is written."""
    from sparsenn.compiler.frontend.functions import evaluate as evaluate_value, evaluate_in_place

    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(4, 5, generator=g), torch.randn(5, generator=g)
    target = x.clone()
    got = evaluate_in_place(value, [target, b])
    if in_place:
        assert got.data_ptr() == target.data_ptr()
        torch.testing.assert_close(got, evaluate_value(value, [x, b]))
    else:
        assert got is None and torch.equal(target, x)


# ----------------------------------------------------------------------------- gradients


def gradcheck(assignment, operands, out_format=None):
    leaves = [(op.values if isinstance(op, SparseTensor) else op).detach().clone().requires_grad_()
              for op in operands]

    def run(*tensors):
        ops = [tpl.with_values(t) if isinstance(tpl, SparseTensor) else t for tpl, t in zip(operands, tensors)]
        out = differentiable_evaluate(evaluate, assignment, ops, out_format)
        out = out.values if isinstance(out, SparseTensor) else out
        return torch.where(torch.isinf(out), torch.zeros_like(out), out)

    assert torch.autograd.gradcheck(run, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", tuple(name for name in UNARY if name != "detach") + ("max", "min"))
def test_gradients_of_each_function(name):
    """d/dA and d/dX of ``sum_j f(A[i,j], X[j,k])`` (binary) or ``f(A[i,j]) * X[j,k]``
    against finite differences (``detach``'s gradient is 0 by definition, not its finite
    difference: ``tests/test_program_autograd.py``)."""
    A = operand((4, 5), "csr")
    A = A.with_values(A.values + 0.1 * torch.sign(A.values))  # keep relu/abs away from their kinks
    X = operand((5, 3), "dense-tensor", seed=1)
    value = (apply(name, Factor(0), Factor(1)) if FUNCTIONS[name].arity == 2
             else apply("mul", unary(name), Factor(1)))
    gradcheck(spmm(value), [A, X])


@pytest.mark.parametrize("reduction", ("max", "min"))
def test_gradients_of_max_and_min_with_ties(reduction):
    """The gradient goes to the arg-max entries, split equally between ties as torch.amax."""
    T = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    S = sparsenn.from_dense(T, format="csr")
    assignment = Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), Factor(0)),), ("S",), reduction)
    values = S.values.clone().requires_grad_()
    out = differentiable_evaluate(evaluate, assignment, [S.with_values(values)], None)
    weights = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    torch.where(torch.isinf(out), 0.0, out).mul(weights).sum().backward()
    dense = T.clone().requires_grad_()
    masked = torch.where(T != 0, dense, torch.tensor(-math.inf if reduction == "max" else math.inf))
    combine = torch.amax if reduction == "max" else torch.amin
    expected = torch.where(torch.isinf(combine(masked, 1)), 0.0, combine(masked, 1))
    (grad,) = torch.autograd.grad(expected.mul(weights).sum(), dense)
    torch.testing.assert_close(S.with_values(values.grad).to_dense(), grad)
    gradcheck(Assignment(("i",), (Term(1.0, (Access(0, ("i", "j")),), apply("tanh", Factor(0))),), ("S",), reduction),
              [operand((5, 6), "csr")])


@pytest.mark.parametrize("fmt", ("csr", "bsr(2,3)", "dense-tensor"))
def test_gradients_through_an_epilogue(fmt):
    A, X = operand((4, 6), fmt), operand((6, 5), "dense-tensor", seed=1)
    b = operand((5,), "dense-tensor", seed=2, empty_rows=())
    gelu = Epilogue((Access(2, ("k",)),), apply("gelu", apply("add", Reduced(), Factor(0))))
    gradcheck(spmm(epilogue=gelu), [A, X, b])


def test_gradients_of_a_sampled_value():
    """``P[i,j] = exp(S[i,j] - M[i]) / Z[i]`` on S's pattern (softmax's last step)."""
    S = operand((5, 6), "csr")
    M, Z = operand((5,), "dense-tensor", seed=1, empty_rows=()), operand((5,), "dense-tensor", seed=2).abs() + 1
    value = apply("div", apply("exp", apply("sub", Factor(0), Factor(1))), Factor(2))
    assignment = Assignment(("i", "j"), (Term(1.0, (Access(0, ("i", "j")), Access(1, ("i",)), Access(2, ("i",))),
                                              value),), ("S", "M", "Z"))
    gradcheck(assignment, [S, M, Z])


def test_operands_sharing_a_pattern_anchor_a_sampled_result():
    """``P * (dP - G)`` with ``dP`` on P's index arrays writes on the pattern in place
    (no assembly), blocked too; a copy of the pattern with new arrays is another pattern."""
    for fmt in ("csr", "bsr(2,3)"):
        P = operand((6, 9), fmt)
        dP = P.with_values(torch.randn(P.values.shape, dtype=torch.float64))
        G = operand((6,), "dense-tensor", seed=3, empty_rows=())
        value = apply("mul", Factor(1), apply("sub", Factor(0), Factor(2)))
        term = Term(1.0, (Access(0, ("i", "j")), Access(1, ("i", "j")), Access(2, ("i",))), value)
        assignment = Assignment(("i", "j"), (term,), ("dP", "P", "G"))
        got = evaluate(assignment, [dP, P, G], P.format)
        assert got.format == P.format and all(a is b for a, b in zip(got.pos + got.crd, P.pos + P.crd))
        assert_matches(got, assignment, [dP, P, G], torch.float64)
    P = operand((6, 9), "csr")
    copy = sparsenn.from_dense(P.to_dense(), format="csr")
    shared = sparsenn.compiler.plan.planner.shared_patterns
    assert shared([P, P.with_values(P.values * 2), copy, G]) == (None, 0, None, None)
    checked = check_call(assignment, [P.with_values(P.values * 2), P, G], "csr")
    assert _plan(assignment, checked).anchor == 0
    assert _plan(assignment, check_call(assignment, [copy, P, G], "csr")).anchor is None


def test_biases_fold_into_the_epilogue_of_a_dense_result():
    """``A X + b``: the bias term becomes the epilogue (one nest, fused per row); not
    when the result is sparse or every term is a bias."""
    A, X = operand((6, 9), "csr"), operand((9, 40), "dense-tensor", seed=1)
    b = operand((40,), "dense-tensor", seed=2, empty_rows=())
    affine = sparsenn.compile("Y[i,k] = A[i,j] * X[j,k] + 2 * b[k]")
    text = affine.explain(A, X, b)
    assert "moved into the epilogue" in text and "epilogue fused after loop j" in text
    torch.testing.assert_close(affine(A, X, b), A.to_dense() @ X + 2 * b)
    S = operand((6, 40), "csr", seed=3)
    sparse_sum = sparsenn.compile("Y[i,k] = A[i,j] * B[j,k] + S[i,k]")
    assert "folded" not in sparse_sum.explain(A, operand((9, 40), "csr"), S)
    assert "folded" not in sparsenn.compile("Y[i,k] = C[i,k] + b[k]").explain(X, b)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("fmt", ("csr", "bsr(1,64)"))
def test_exp_is_within_two_ulps_with_the_special_values_exact(dtype, fmt):
    """The kernels' own (vectorisable) exp against torch's over the whole range, scalar
    (csr rows) and vectorised (dense block rows): overflow to inf, underflow to 0,
    subnormal results, NaN and infinities."""
    special = [0.0, -0.0, 1e-30, 1.0, -1.0, 88.72, 88.73, 89.0, -87.5, -103.9, -104.0, 709.7, 709.8, -744.0,
               -745.2, 1e4, -1e4, math.inf, -math.inf, math.nan]
    x = torch.cat([torch.linspace(-110, 95, 20000, dtype=torch.float64),
                   torch.linspace(-750, 715, 20000, dtype=torch.float64), torch.tensor(special + [0.0] * 44)])
    x = x.to(dtype).reshape(-1, 64)
    everywhere = torch.ones(x.shape, dtype=torch.bool).nonzero().T
    S = SparseTensor.from_coo(everywhere, x.reshape(-1), x.shape, format=fmt)
    exp = Assignment(("i", "j"), (Term(1.0, (Access(0, ("i", "j")),), apply("exp", Factor(0))),), ("S",))
    got = evaluate(exp, [S], None).to_dense().reshape(-1)
    exact = torch.exp(x.reshape(-1).double())
    rounded = exact.to(dtype)
    info = torch.finfo(dtype)
    normal = torch.isfinite(rounded) & (rounded.abs() >= info.tiny)
    assert ((got.double() - exact).abs() <= 2 * info.eps * exact.abs())[normal].all()
    tiny = (rounded.abs() < info.tiny) & (rounded != 0)
    assert ((got.double() - exact).abs() <= info.tiny * info.eps)[tiny].all()  # subnormal: one of its ulps
    other = ~normal & ~tiny
    assert torch.equal(got[other].isnan(), rounded[other].isnan())
    assert torch.equal(got[other & ~rounded.isnan()], rounded[other & ~rounded.isnan()])


def test_functions_of_dense_operands_run_as_one_kernel():
    # One compiled pass (torch would run an op per function, each a pass over memory),
    # and so does the gradient: d/dH = 2 gelu'(2 H + b), d/db its sum over i.
    H = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    f = sparsenn.compile("A[i,j] = gelu(2 * H[i,j] + b[j])", out_format="dense")
    assert "sn_run" in f.explain(H, b)
    torch.testing.assert_close(f(H, b), torch.nn.functional.gelu(2 * H + b))
    assert torch.autograd.gradcheck(f, (H, b), eps=1e-6, atol=1e-7, rtol=1e-5)
