"""The text of a traced call (``compiler/runtime/callspec.py``) and the assignment form it
holds (``compiler/notation_text.py``): every kind of call the library traces reads back
as the call it was written from, a saved ``torch.export`` program runs after loading, and
a text of another format version is refused by naming both versions."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import sparsenn
from sparsenn.compiler import clear_caches
from sparsenn.compiler.frontend.expression import parse_statement
from sparsenn.compiler.frontend.notation import NotationError, parse_einsum
from sparsenn.compiler.frontend.notation_text import read_assignment, write_assignment
from sparsenn.compiler.plan.bias import split_epilogue
from sparsenn.compiler.frontend.staging import stage
from sparsenn.compiler.runtime.callspec import SpecVersionError, decode, read_spec
from sparsenn.formats import parse_format

pytestmark = pytest.mark.usefixtures("avx2_host")

CSR = parse_format("csr", 2)
SOFTMAX = "M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i]); Z[i] = sum[j](E[i,j]); P<S>[i,j] = E[i,j] / Z[i]"


def _assignments() -> list:
    """Assignments of every shape the front end builds: plain sums with coefficients,
    epilogues and their split parts, max reductions, values over factors, masks."""
    found = [parse_einsum("ij,jk->ik", 2), parse_einsum("ij->i", 1)]
    for text, formats in [("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])", (CSR, None, None)),
                          ("D[i,j] = -A[i,j] - 0.125 * (B[i,j] - A[i,j]) * C[i,j]", (None, None, None)),
                          ("y[i] = gelu(A[i,j] * x[j]) / 3 + 1e-8", (CSR, None))]:
        program = stage(parse_statement(text), formats, None)
        found += [s.assignment for s in program.stages]
        found += [part for s in program.stages if s.assignment.epilogue for part in split_epilogue(s.assignment)[:2]]
    script = sparsenn.compile(SOFTMAX).statement
    found += [s.assignment for s in stage(script, (CSR,), None).stages]
    return found


@pytest.mark.parametrize("n", range(len(_assignments())))
def test_an_assignment_reads_back_from_its_text(n: int) -> None:
    assignment = _assignments()[n]
    text = write_assignment(assignment)
    assert read_assignment(text) == assignment
    assert write_assignment(read_assignment(text)) == text


def test_an_assignment_with_repeated_operand_names_is_written_by_position() -> None:
    assignment = parse_einsum("ij,jk->ik", 2)
    twice = type(assignment)(assignment.output, assignment.terms, ("A", "A"))
    text = write_assignment(twice)
    assert "$0[i,j]" in text and read_assignment(text) == twice


@pytest.mark.parametrize("text, problem", [
    ("(A)[i] = sum{1.0 {B[i]}}", "'B' names no operand"),
    ("(A)[i] = prod{1.0 {A[i]}}", "unknown reduction 'prod'"),
    ("(A)[i] = sum{1.0 {A[i]}: frob(#0)}", "unknown function 'frob'"),
    ("(A)[i] = sum{x {A[i]}}", "'x' is not a number"),
    ("(A)[i] = sum{1.0 {A[i]}} extra", "unexpected 'extra'"),
])
def test_a_malformed_assignment_text_names_the_problem(text: str, problem: str) -> None:
    with pytest.raises(NotationError, match=problem):
        read_assignment(text)


def _traced_calls(function, *inputs) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(op, call string)`` of every sparsenn op in the forward graphs and in the backward
    graphs of ``torch.compile(function)`` (AOT autograd, no code generation)."""
    forward: list[tuple[str, str]] = []
    backward: list[tuple[str, str]] = []

    def recorder(found: list):
        def record(graph: torch.fx.GraphModule, _inputs):
            found.extend((str(node.target), node.args[0]) for node in graph.graph.nodes
                         if node.op == "call_function" and str(node.target).startswith("sparsenn.evaluate"))
            return graph
        return record

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder(forward), bw_compiler=recorder(backward))
    out = torch.compile(function, fullgraph=True, backend=backend)(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    (out.values if isinstance(out, sparsenn.SparseTensor) else out).square().sum().backward()
    return forward, backward


def _csr(rows: int, cols: int, seed: int) -> sparsenn.SparseTensor:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=generator) * (torch.rand(rows, cols, generator=generator) < 0.4)
    return sparsenn.from_dense(dense, "csr")


def _bsr() -> sparsenn.SparseTensor:
    generator = torch.Generator().manual_seed(5)
    dense = torch.randn(32, 32, generator=generator) * (torch.rand(32, 32, generator=generator) < 0.3)
    return sparsenn.from_dense(dense, "bsr(8,8)")


def _kinds() -> dict:
    """Per kind of traced call, a function and its inputs (something requiring grad)."""
    torch.manual_seed(0)
    a = _csr(12, 10, 1)
    weights = a.with_values(a.values.clone().requires_grad_())
    x = torch.randn(10, 4, requires_grad=True)
    affine = sparsenn.compile("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])")
    bias = torch.randn(4, requires_grad=True)
    softmax = sparsenn.compile(SOFTMAX)
    linear = nn.Sequential(sparsenn.SparseLinear(10, 8, sparsity=0.7), nn.ReLU(),
                           sparsenn.SparseLinear(8, 4, sparsity=0.5, format="bsr(4,4)"))
    conv = sparsenn.SparseGCNConv(10, 3)
    attention = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_window_blocks=3,
                                              num_random_blocks=1, seed=0, fixed_pattern=True)
    edges = torch.randint(0, 12, (2, 40))
    blocks = _bsr()
    return {
        "einsum": (lambda w, v: sparsenn.einsum("ij,jk->ik", w, v), weights, x),
        "einsum sampled on a pattern": (lambda w, u, v: sparsenn.einsum("ij,ik,jk->ij", w, u, v), weights,
                                        torch.randn(12, 3, requires_grad=True), torch.randn(10, 3, requires_grad=True)),
        "einsum sampled on a block pattern": (lambda u, v: sparsenn.einsum("ij,ik,jk->ij", blocks, u, v),
                                             torch.randn(32, 3, requires_grad=True),
                                             torch.randn(32, 3, requires_grad=True)),
        "compiled expression with an epilogue": (lambda w, v, b: affine(w, v, b), weights, x, bias),
        "compiled program": (lambda w: softmax(w), weights),
        "softmax": (lambda w: sparsenn.softmax(w, dim=1), weights),
        "layers": (linear, torch.randn(5, 10)),
        "graph convolution": (conv, torch.randn(12, 10, requires_grad=True), edges),
        "attention": (lambda t: attention(t, need_weights=False)[0], torch.randn(1, 128, 32, requires_grad=True)),
    }


@pytest.mark.parametrize("kind", list(_kinds()))
def test_every_traced_call_reads_back_from_its_text(kind: str) -> None:
    """Forward calls and their derived gradients (``evaluate_backward`` names the forward's
    call; softmax's gradient is a program of its own): the text read afresh is the spec it
    was written from, and writes the same text."""
    function, *inputs = _kinds()[kind]
    forward, backward = _traced_calls(function, *inputs)
    assert forward and backward
    assert kind == "softmax" or any(op.startswith("sparsenn.evaluate_backward") for op, _ in backward)
    for _, call in forward + backward:
        assert call.startswith("sparsenn-call 1\n")
        spec = read_spec(call)
        assert spec == decode(call)
        assert spec.encode() == call


@pytest.mark.parametrize("pattern", [_bsr(), _csr(32, 32, 6)], ids=["bsr", "csr"])
def test_a_traced_sampled_product_has_the_eager_results_pattern(pattern: sparsenn.SparseTensor) -> None:
    """One anchor rule (plan/anchor.py): the traced call returns values on the pattern
    eager evaluation gives the result, a blocked one included (run over split indices)."""
    u, v = torch.randn(32, 3), torch.randn(32, 3)
    f = lambda u, v: sparsenn.einsum("ij,ik,jk->ij", pattern, u, v)  # noqa: E731
    expected = f(u, v)
    torch._dynamo.reset()
    actual = torch.compile(f, fullgraph=True, backend="aot_eager")(u, v)
    assert actual.format == expected.format == pattern.format
    assert all(a is b for a, b in zip(actual.crd, pattern.crd))
    torch.testing.assert_close(actual.values, expected.values)


def test_a_saved_exported_program_runs_after_loading(tmp_path) -> None:
    """torch.export.save writes the call strings into the file; loaded, with every cache
    empty, they are parsed again and the program gives eager's results."""
    torch.manual_seed(3)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = sparsenn.SparseLinear(10, 12, sparsity=0.6)
            self.pattern = _csr(12, 12, 4)
            self.softmax = sparsenn.compile(SOFTMAX)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)  # (batch, 12)
            scores = sparsenn.einsum("ij,bi,bj->ij", self.pattern, h, h)  # sampled on the pattern
            return sparsenn.einsum("ij,bj->bi", self.softmax(scores), h)

    model = Model().eval()
    x = torch.randn(6, 10)
    with torch.no_grad():
        expected = model(x)
        exported = torch.export.export(model, (x,))
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    clear_caches()
    loaded = torch.export.load(path)
    calls = [node.args[0] for node in loaded.graph.nodes if str(node.target).startswith("sparsenn.evaluate")]
    assert len(calls) == 4 and all(c.startswith("sparsenn-call 1\n") for c in calls)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(x), expected, rtol=1e-5, atol=1e-5)


def test_a_call_string_of_another_version_names_both_versions() -> None:
    call = _traced_calls(lambda w: sparsenn.einsum("ij->i", w), _values_requiring_grad())[0][0][1]
    newer = call.replace("sparsenn-call 1\n", "sparsenn-call 2\n", 1)
    with pytest.raises(SpecVersionError, match="format version 2: this sparsenn reads version 1 only"):
        read_spec(newer)
    with pytest.raises(SpecVersionError, match="format version 0 .*reads version 1 only"):
        read_spec("sparsenn-call:gASVBQAAAAAAAACMAWGULg==")


def _values_requiring_grad() -> sparsenn.SparseTensor:
    a = _csr(6, 5, 7)
    return a.with_values(a.values.clone().requires_grad_())


@pytest.mark.parametrize("edit, problem", [
    (lambda c: c.replace("operands: csr/2 int32", "operands: csr/2 int16"), "an operand of a sparsenn call string"),
    (lambda c: c.replace("out_format: none", "out_format: maybe"), "out_format of a sparsenn call string"),
    (lambda c: "\n".join(c.split("\n")[:4]), "has 5 lines"),
    (lambda c: c.replace("einsum 1:", "kernel:"), "names an einsum, statement, script or assignment"),
])
def test_a_damaged_call_string_names_what_is_wrong(edit, problem: str) -> None:
    call = _traced_calls(lambda w: sparsenn.einsum("ij->i", w), _values_requiring_grad())[0][0][1]
    damaged = edit(call)
    assert damaged != call
    with pytest.raises(ValueError, match=problem):
        read_spec(damaged)
