"""sparsenn.compile's text: the grammar and its errors (expression.py), the stages each
statement becomes for given operand formats (program.py, checked on the IR), and the
values of those programs against torch on dense copies."""

from __future__ import annotations

import math
import re

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.frontend.expression import Call, Product, Reduction, Sum, Tensor, parse_expression, parse_statement
from sparsenn.compiler.frontend.functions import FUNCTIONS, PUBLIC_FUNCTIONS
from sparsenn.compiler.frontend.notation import NotationError
from sparsenn.compiler.frontend.program import StageResult, UserOperand
from sparsenn.compiler.frontend.staging import plain, stage

pytestmark = pytest.mark.usefixtures("avx2_host")

CSR = sparsenn.parse_format("csr", 2)


# ---------------------------------------------------------------------- grammar


def product(coefficient, *factors) -> Product:
    return Product(coefficient, tuple(factors))


def test_numbers_signs_and_division_by_numbers_are_coefficients() -> None:
    s = parse_statement("Y[i,j] = 0.125 * A[i,j] - 2 * B[i,j] / 4 + 1e-3 + -(A[i,j])")
    a, b = Tensor("A", ("i", "j")), Tensor("B", ("i", "j"))
    assert s.body == Sum((product(0.125, a), product(-0.5, b), product(1e-3), product(-1.0, a)))
    assert s.operands == ("A", "B") and s.mask is None


def test_calls_divisions_and_reductions_parse_into_the_tree() -> None:
    s = parse_statement("Y[i] = relu(max[j,k](S[i,j,k]) / d[i]) + min(A[i], sum[j](exp(B[i,j])))")
    relu, minimum = (p.factors[0] for p in s.body.products)
    assert isinstance(relu, Call) and relu.function == "relu"
    (div,) = relu.args[0].products[0].factors
    assert div.function == "div"
    (numerator,), (denominator,) = (a.products[0].factors for a in div.args)
    assert numerator == Reduction("max", ("j", "k"), Sum((product(1.0, Tensor("S", ("i", "j", "k"))),)))
    assert denominator == Tensor("d", ("i",))
    assert minimum.function == "min" and isinstance(minimum.args[1].products[0].factors[0], Reduction)
    assert s.operands == ("S", "d", "A", "B")


def test_products_distribute_over_sums() -> None:
    s = parse_statement("Y[i] = (A[i] + B[i]) * (C[i] - 2)")
    assert [(p.coefficient, [f.name for f in p.factors]) for p in s.body.products] == [
        (1.0, ["A", "C"]), (-2.0, ["A"]), (1.0, ["B", "C"]), (-2.0, ["B"])]


def test_mask_is_an_operand_indexed_like_the_output() -> None:
    s = parse_statement("P<S>[i,j] = Q[i,d] * K[j,d]")
    assert s.mask == "S" and s.operands == ("S", "Q", "K")
    assert parse_statement("P<S>[i,j] = x[i]").operands == ("S", "x")  # the mask ranges j


@pytest.mark.parametrize("text", [
    "D[i,j] = A[i,k] * B[k,j] + C[i,j]",
    "D[i,j] = -A[i,j] - (B[i,j] - A[i,j]) * C[i,j]",
    "y[i] = 0.5 * A[i,j] * x[j] + b[i] / 4",
])
def test_plain_sums_of_products_are_one_assignment(text: str) -> None:
    statement = parse_statement(text)
    (only,) = plain(statement, None).stages
    assert only.assignment == parse_expression(text) and only.inputs == tuple(
        UserOperand(n) for n in range(len(statement.operands)))
    assert sparsenn.compile(text).assignment == parse_expression(text)


def test_parse_expression_points_staged_statements_to_compile() -> None:
    with pytest.raises(NotationError, match="compile it with sparsenn.compile"):
        parse_expression("Y[i] = relu(A[i])")
    assert sparsenn.compile("Y[i] = relu(A[i])").assignment is None


ERRORS = [
    ("Y[i] = foo(A[i])", "unknown function 'foo'", 7),
    ("Y[i] = relu(A[i], B[i])", r"relu takes 1 argument\(s\), got 2", 7),
    ("Y[i] = max(A[i])", r"max takes 2 argument\(s\), got 1", 7),
    ("Y[i] = (A[i] + B[i]", r"'\(' is never closed", 7),
    ("Y[i] = relu(A[i]", r"'\(' is never closed", 11),
    ("Y[i] = A[i", r"'\[' is never closed", 8),
    ("Y[i] = A[i])", r"unexpected '\)' after the expression", 11),
    ("Y[i,j] = A[i]", "output index 'j' does not appear on the right-hand side", 4),
    ("Y[i] = sum[i](A[i])", "index 'i' is an output index and cannot be reduced", 11),
    ("Y[i] = max[j,i](A[i,j])", "index 'i' is an output index and cannot be reduced", 13),
    ("Y[i] = sum[j](max[j](A[i,j]))", "index 'j' is already reduced here", 18),
    ("Y[i] = sum[](A[i])", r"sum\[\] reduces over no index", 11),
    ("Y[i] = sum[j](A[i])", "reduction index 'j' does not appear in the reduction's body", 11),
    ("Y[i] = A[i] + A[i,j]", "tensor 'A' is used with 1 and 2 indices", 14),
    ("Y<S>[i] = S[i,j]", "tensor 'S' is used with 1 and 2 indices", 10),
    ("Y[i] = A[i] * Y[i]", "output tensor 'Y' also appears on the right-hand side", 14),
    ("Y<Y>[i] = A[i]", "output tensor 'Y' cannot mask itself", 2),
    ("Y[i] = A[i] ; B[i]", "unexpected end of expression", 18),
    ("Y[i] = A[i] $", r"unexpected character '\$'", 12),
    ("Y[i] = A[i] * * B[i]", "expected a tensor, number, function call or '\\(' but found '\\*'", 14),
    ("Y[i] = A[i] +", "unexpected end of expression", 13),
    ("Y[i] = A[i] / 0", "division by zero", 12),
    ("Y[i] = A[i,i]", "index 'i' appears twice in A\\[i,i\\]", 11),
    ("Y[i,i] = A[i]", "index 'i' appears twice in the output", 4),
    ("Y[i] = exp[i] * A[i]", "'exp' names a function or reduction, not a tensor", 7),
    ("Y[] = 2", "the right-hand side reads no tensor", 6),
    ("Y[i] A[i]", "expected '=' but found 'A'", 5),
]


@pytest.mark.parametrize(("text", "message", "column"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_errors_quote_the_text_with_a_caret_at_the_column(text: str, message: str, column: int) -> None:
    with pytest.raises(NotationError) as info:
        sparsenn.compile(text)
    first, quoted, caret = str(info.value).split("\n")
    assert re.search(message, first), first
    assert first.endswith(f"at column {column}:")
    assert quoted == f"    {text}" and caret == "    " + " " * column + "^"


def test_a_mask_fixes_the_format() -> None:
    with pytest.raises(ValueError, match="output mask.*out_format must be None"):
        sparsenn.compile("P<S>[i,j] = A[i,j]", out_format="csr")


# ---------------------------------------------------------------------- staging


def stages_of(text: str, *formats, out_format=None):
    return stage(parse_statement(text), tuple(formats), out_format).stages


def test_relu_of_a_product_plus_bias_is_one_epilogue() -> None:
    (only,) = stages_of("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])", CSR, None, None)
    a = only.assignment
    assert str(a) == "Out[i,k] = relu(((sum_{j} A[i,j] * X[j,k]) + b[k]))"
    assert a.epilogue.factors[0].operand == 2 and len(a.terms) == 1 and only.out_format is None


def test_a_sparse_bias_stays_a_term_under_the_epilogue() -> None:
    (only,) = stages_of("Y[i,k] = 2 * relu(A[i,j] * X[j,k] + b[i,k])", CSR, None, CSR)
    assert len(only.assignment.terms) == 2 and not only.assignment.epilogue.factors
    assert str(only.assignment).startswith("Out[i,k] = (2 * relu(")


def test_relu_of_a_sparse_product_is_staged_and_stays_sparse() -> None:
    first, second = stages_of("Y[i,k] = relu(A[i,j] * B[j,k])", CSR, CSR)
    assert first.assignment.is_product_sum and first.out_format is None
    assert str(second.assignment) == "Out[i,k] = relu(%0[i,k])" and second.inputs == (StageResult(0),)
    first, second = stages_of("Y[i,k] = relu(A[i,j] * X[j,k])", CSR, None, out_format="csr")
    assert second.out_format == "csr"


def test_a_function_not_keeping_zeros_reads_sparse_operands_densely() -> None:
    copy, value = stages_of("Y[i,j] = exp(S[i,j])", CSR)
    assert copy.out_format == "dense" and copy.assignment.is_product_sum
    assert str(value.assignment) == "Out[i,j] = exp(%0[i,j])"
    (only,) = stages_of("Y[i,j] = exp(S[i,j])", None)
    assert str(only.assignment) == "Out[i,j] = exp(S[i,j])"


def test_arguments_that_do_not_vanish_are_computed_first() -> None:
    total, value = stages_of("Y[i,j] = relu(S[i,j] + T[i,j])", CSR, CSR)
    assert str(total.assignment) == "Out[i,j] = S[i,j] + T[i,j]" and total.out_format is None
    total, value = stages_of("Y[i,j] = sigmoid(S[i,j] + T[i,j])", CSR, CSR)
    assert total.out_format == "dense"  # sigmoid(0) != 0: the sum is asked dense at once
    difference, value = stages_of("Y[i,j] = relu(S[i,j] - M[i])", CSR, None)
    assert str(difference.assignment) == "Out[i,j] = S[i,j] - M[i]"


def test_terms_that_vanish_with_their_sparse_factors_are_one_stage() -> None:
    (only,) = stages_of("Y[i,k] = relu(S[i,j]) * X[j,k] + S[i,k] / d[i]", CSR, None, None)
    assert str(only.assignment) == "Out[i,k] = sum_{j} (relu(S[i,j]) * X[j,k]) + (S[i,k] / d[i])"


def test_implicit_sums_inside_arguments_are_staged() -> None:
    inner, outer = stages_of("Y[i,j] = relu(A[i,k] * B[k,j]) * C[i,j]", None, None, None)
    assert inner.assignment.output == ("i", "j") and str(outer.assignment) == "Out[i,j] = (relu(%0[i,j]) * C[i,j])"
    (only,) = stages_of("Y[i] = A[i,j] * relu(B[j])", CSR, None)  # j is the product's: not inside relu
    assert str(only.assignment) == "Out[i] = sum_{j} (A[i,j] * relu(B[j]))"


def test_reductions() -> None:
    (only,) = stages_of("M[i] = max[j](S[i,j])", CSR)
    assert only.assignment.reduction == "max" and str(only.assignment) == "Out[i] = max_{j} S[i,j]"
    (only,) = stages_of("M[i] = min[j](-2 * S[i,j])", CSR)
    assert only.assignment.terms[0].coefficient == 1.0 and str(only.assignment) == "Out[i] = min_{j} (-2 * S[i,j])"
    (only,) = stages_of("Z[i] = sum[j](exp(S[i,j] - M[i]))", CSR, None)
    assert str(only.assignment) == "Out[i] = sum_{j} exp((S[i,j] - M[i]))"
    body, top = stages_of("M[i] = max[j](S[i,j] + T[i,j])", CSR, CSR)
    assert body.assignment.output == ("i", "j") and top.assignment.reduction == "max"
    body, top = stages_of("M[i] = max[j](A[i,j,k] * x[k])", None, None)
    assert body.assignment.output == ("i", "j")
    body, top = stages_of("Y[i] = sum[j](a[i] + B[i,j])", None, CSR)
    assert body.assignment.output == ("i", "j") and str(top.assignment) == "Out[i] = sum_{j} %0[i,j]"


def test_masked_statements_sample_every_term() -> None:
    (only,) = stages_of("P<S>[i,j] = Q[i,d] * K[j,d] + 1", CSR, None, None)
    # dense terms visit all of S's positions: no "0 * S" term to give the result its pattern
    assert str(only.assignment) == "Out[i,j] = sum_{d} (Q[i,d] * K[j,d]) + 1"
    assert only.out_format == CSR and all(t.factors[-1].operand == 2 for t in only.assignment.terms)
    (only,) = stages_of("P<S>[i,j] = exp(S[i,j] - M[i])", CSR, None)
    # the term reads S where the mask samples it, its other operand dense: it visits every stored position
    assert str(only.assignment) == "Out[i,j] = exp((S[i,j] - M[i]))"
    (only,) = stages_of("P<S>[i,j] = exp(T[i,j] - M[i])", CSR, CSR, None)
    assert str(only.assignment) == "Out[i,j] = exp((T[i,j] - M[i])) + 0 * S[i,j]"


def test_constants_make_an_epilogue_that_takes_the_bias() -> None:
    (only,) = stages_of("Y[i,j] = S[i,j] + b[j] + 1", CSR, None)
    assert str(only.assignment) == "Out[i,j] = (((S[i,j]) + b[j]) + 1)"


def test_sparse_denominators_are_rejected_when_binding() -> None:
    f = sparsenn.compile("Y[i,j] = A[i,j] / d[i,j]")
    dense = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"operand 1 \(d\) is sparse but is in a denominator"):
        f(dense, sparsenn.from_dense(dense, format="csr"))
    sparsenn.compile("Y[i,j] = S[i,j] / sum[k](S[i,k])")(sparsenn.from_dense(dense, format="csr"))


def test_programs_are_cached_per_formats() -> None:
    statement = parse_statement("Y[i,j] = exp(S[i,j])")
    assert stage(statement, (CSR,), None) is stage(statement, (CSR,), None)
    assert len(stage(statement, (None,), None).stages) == 1


# ---------------------------------------------------------------------- values


def operand(shape, fmt: str, dtype=torch.float64, seed=0, positive=False):
    """About half the entries zero and row 1 empty; ``fmt`` "dense": a tensor."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    if positive:
        values = values.abs() + 0.1
    values = values * (torch.rand(shape, generator=g) < 0.5)
    values[1] = 0
    values = values.to(dtype)
    return values if fmt == "dense" else sparsenn.from_dense(values, format=fmt)


def dense(x) -> torch.Tensor:
    return x.to_dense() if isinstance(x, SparseTensor) else x


def stored(x) -> torch.Tensor:
    if isinstance(x, SparseTensor):
        return x.with_values(torch.ones_like(x.values)).to_dense() != 0
    return torch.ones(x.shape, dtype=torch.bool)


def close(got, want: torch.Tensor) -> None:
    got = dense(got)
    assert got.dtype == want.dtype
    tol = 1e-5 if want.dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


FORMATS = ("csr", "coo", "dense")
DTYPES = (torch.float32, torch.float64)
UNARY = tuple(name for name in PUBLIC_FUNCTIONS if FUNCTIONS[name].arity == 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", UNARY)
def test_each_function_is_the_dense_math(name: str, fmt: str, dtype: torch.dtype) -> None:
    s = operand((5, 6), fmt, dtype, positive=name in ("log", "sqrt"))
    x = operand((6, 3), "dense", dtype, seed=1)
    f = FUNCTIONS[name].torch
    close(sparsenn.compile(f"Y[i,j] = {name}(S[i,j])")(s), f(dense(s)))
    close(sparsenn.compile(f"Y[i,k] = {name}(S[i,j]) * X[j,k]")(s, x), f(dense(s)) @ x)


def test_float_gelu_keeps_its_digits_in_both_tails() -> None:
    # Phi through erfc: relative error within a few float ulps of the float64 value from
    # -5.5 to 6 (torch's float32 gelu, through 1 + erf, loses them below -3).
    x = torch.linspace(-5.5, 6.0, 4001)
    got = sparsenn.compile("Y[i] = gelu(S[i])", out_format="dense")(SparseTensor.from_dense(x, format="c"))
    want = torch.nn.functional.gelu(x.double())
    assert ((got.double() - want).abs() / want.abs().clamp_min(1e-300)).max() < 2e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ("max", "min"))
def test_binary_functions_over_two_patterns(name: str, fmt: str, dtype: torch.dtype) -> None:
    s, t = operand((5, 6), fmt, dtype), operand((5, 6), fmt, dtype, seed=2)
    f = FUNCTIONS[name].torch
    close(sparsenn.compile(f"Y[i,j] = {name}(S[i,j], T[i,j])")(s, t), f(dense(s), dense(t)))
    close(sparsenn.compile(f"Y[i,j] = {name}(S[i,j], 0.5)")(s), f(dense(s), torch.tensor(0.5, dtype=dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_relu_of_product_plus_bias(fmt: str, dtype: torch.dtype) -> None:
    a, x = operand((5, 6), fmt, dtype), operand((6, 3), "dense", dtype, seed=1)
    b = torch.randn(3, dtype=dtype)
    close(sparsenn.compile("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])")(a, x, b), torch.relu(dense(a) @ x + b))
    close(sparsenn.compile("Y[i,k] = gelu(A[i,j] * X[j,k] - 2 * b[k] + 0.5)")(a, x, b),
          torch.nn.functional.gelu(dense(a) @ x - 2 * b + 0.5))
    y = sparsenn.compile("Y[i,k] = A[i,j] * X[j,k] + b[k]")(a, x, b)
    close(y, dense(a) @ x + b)


@pytest.mark.parametrize("fmt", ("csr", "coo"))
def test_relu_of_a_sparse_product_stays_sparse(fmt: str) -> None:
    a, b = operand((5, 6), fmt), operand((6, 4), fmt, seed=3)
    y = sparsenn.compile("Y[i,k] = relu(A[i,j] * B[j,k])")(a, b)
    assert isinstance(y, SparseTensor)
    close(y, torch.relu(dense(a) @ dense(b)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_functions_of_sums_and_differences(fmt: str, dtype: torch.dtype) -> None:
    s, t = operand((5, 6), fmt, dtype), operand((5, 6), fmt, dtype, seed=2)
    m = torch.randn(5, dtype=dtype)
    ds, dt = dense(s), dense(t)
    close(sparsenn.compile("Y[i,j] = relu(S[i,j] - M[i])")(s, m), torch.relu(ds - m[:, None]))
    close(sparsenn.compile("Y[i,j] = exp(S[i,j] - M[i])")(s, m), torch.exp(ds - m[:, None]))
    close(sparsenn.compile("Y[i,j] = relu(S[i,j] + T[i,j])")(s, t), torch.relu(ds + dt))
    close(sparsenn.compile("Y[i,j] = sigmoid(S[i,j] - T[i,j]) * 3")(s, t), 3 * torch.sigmoid(ds - dt))
    close(sparsenn.compile("Y[i,j] = S[i,j] * exp(T[i,j]) + 1")(s, t), ds * torch.exp(dt) + 1)


def masked_max(values: torch.Tensor, where: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    fill = -math.inf if op == "max" else math.inf
    filled = torch.where(where, values, torch.tensor(fill, dtype=values.dtype))
    return filled.amax(dim) if op == "max" else filled.amin(dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("op", ("max", "min"))
def test_max_min_reductions_over_stored_entries(op: str, fmt: str, dtype: torch.dtype) -> None:
    s, t = operand((5, 6), fmt, dtype), operand((5, 6), fmt, dtype, seed=2)
    got = sparsenn.compile(f"M[i] = {op}[j](S[i,j])")(s)
    close(got, masked_max(dense(s), stored(s), 1, op))
    if fmt != "dense":
        assert got[1] == (-math.inf if op == "max" else math.inf)  # an empty row: the identity
    close(sparsenn.compile(f"M[j] = {op}[i](-2 * S[i,j])")(s), masked_max(-2 * dense(s), stored(s), 0, op))
    everything = masked_max(dense(s).reshape(-1), stored(s).reshape(-1), 0, op)
    close(sparsenn.compile(f"M[] = {op}[i,j](S[i,j])")(s), everything)
    close(sparsenn.compile(f"M[i] = {op}[j](S[i,j] + T[i,j])")(s, t),
          masked_max(dense(s) + dense(t), stored(s) | stored(t), 1, op))
    x = torch.randn(6, 4, dtype=dtype)  # the product reaches every k of a row with an entry
    reached = stored(s).any(1, keepdim=True).expand(5, 4)
    close(sparsenn.compile(f"M[i] = {op}[k](S[i,j] * X[j,k])")(s, x), masked_max(dense(s) @ x, reached, 1, op))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_sum_reductions_and_sparse_softmax(fmt: str, dtype: torch.dtype) -> None:
    s = operand((5, 6), fmt, dtype)
    ds, where = dense(s), stored(s)
    m = sparsenn.compile("M[i] = max[j](S[i,j])")(s)
    z = dense(sparsenn.compile("Z[i] = sum[j](exp(S[i,j] - M[i]))")(s, m.clamp(min=-1e30)))
    expected_z = torch.where(where, torch.exp(ds - m.clamp(min=-1e30)[:, None]), 0).sum(1)
    close(z, expected_z)
    close(sparsenn.compile("Y[i] = sum[j](a[i] + S[i,j])")(torch.arange(5, dtype=dtype), s),
          6 * torch.arange(5, dtype=dtype) + ds.sum(1))
    p = sparsenn.compile("P<S>[i,j] = exp(S[i,j] - M[i]) / Z[i]")(s, m.clamp(min=-1e30), z.clamp(min=1e-30))
    if fmt != "dense":
        assert isinstance(p, SparseTensor) and p.nnz == s.nnz
        safe = m.clamp(min=-1e30)[:, None]
        close(p, torch.where(where, torch.exp(ds - safe) / z.clamp(min=1e-30)[:, None], 0))
    else:
        close(p, torch.softmax(ds, 1))
    one = sparsenn.compile("P[i,j] = S[i,j] / sum[k](S[i,k] * S[i,k])")(s)  # the sum is read densely
    close(one, torch.where(where, ds / (ds * ds).sum(1, keepdim=True), 0))  # 0/0 unvisited: the empty row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ("csr", "coo"))
def test_masks_compute_at_the_mask_only(fmt: str, dtype: torch.dtype) -> None:
    mask = operand((5, 4), fmt, dtype, seed=4)
    q, k = torch.randn(5, 3, dtype=dtype), torch.randn(4, 3, dtype=dtype)
    got = sparsenn.compile("P<S>[i,j] = Q[i,d] * K[j,d]")(mask, q, k)
    assert isinstance(got, SparseTensor) and got.nnz == mask.nnz and got.format == mask.format
    close(got, (q @ k.T) * stored(mask))
    got = sparsenn.compile("P<S>[i,j] = sigmoid(x[i]) + 1")(mask, q[:, 0])
    close(got, (torch.sigmoid(q[:, 0])[:, None] + 1).expand(5, 4) * stored(mask))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_division_by_dense(fmt: str, dtype: torch.dtype) -> None:
    s = operand((5, 6), fmt, dtype)
    d = torch.rand(5, dtype=dtype) + 0.5
    y = sparsenn.compile("Y[i,j] = S[i,j] / d[i]")(s, d)
    assert isinstance(y, SparseTensor) == (fmt != "dense")
    close(y, dense(s) / d[:, None])
    close(sparsenn.compile("Y[i,j] = (S[i,j] + 1) / (d[i] + d[i])")(s, d), (dense(s) + 1) / (2 * d[:, None]))
    ones = torch.ones(5, 6, dtype=dtype)
    close(sparsenn.compile("Y[i,j] = 1 / (D[i,j] + 1)")(ones), ones / 2)


def test_programs_are_differentiable() -> None:
    s = operand((5, 6), "csr")
    values = s.values.clone().requires_grad_(True)
    m = torch.randn(5, dtype=torch.float64, requires_grad=True)
    f = sparsenn.compile("Y[i,j] = relu(S[i,j] - M[i]) * 0.5")
    torch.autograd.gradcheck(lambda v, m: f(s.with_values(v), m), (values, m))
