"""What torch.compile records for sparsenn layers, read from the graphs a recording
backend is handed: chained SparseLinears hand each other the kernel's layout (no
transpose or copy between the ops), and a traced BlockSparseAttention in eval keeps one
mask."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _machines import AVX2, relaying
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import sparsenn

pytestmark = pytest.mark.usefixtures("avx2_host")

# ATen ops that would move or re-lay out a layer's result between two kernels.
_COPIES = {"clone", "copy", "copy_", "contiguous", "permute", "transpose", "t", "as_strided", "_to_copy"}


def _recording_backend(graphs: list) -> object:
    """An AOTAutograd backend that keeps each forward graph (ATen level, after
    functionalisation: where re-layouts would appear) and runs it as it is."""
    def record(gm: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(gm)
        return gm.forward
    return aot_autograd(fw_compiler=record)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]


def _compiled_mlp_graph(batch: int) -> tuple[torch.fx.GraphModule, torch.Tensor, torch.Tensor]:
    """The forward graph of a compiled two-layer sparse MLP, its result and eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(sparsenn.SparseLinear(48, 32, sparsity=0.8), nn.ReLU(),
                          sparsenn.SparseLinear(32, 40, sparsity=0.8)).eval()
    x = torch.randn(batch, 48)
    graphs: list = []
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(x)
    (graph,) = graphs
    return graph, actual, expected


def _evaluations(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [node for node in gm.graph.nodes if "sparsenn.evaluate" in str(node.target)]


def test_compiled_mlp_passes_the_kernels_layout_between_layers():
    graph, actual, expected = _compiled_mlp_graph(64)
    torch.testing.assert_close(actual, expected)
    assert actual.stride() == expected.stride()
    evaluations = _evaluations(graph)
    assert len(evaluations) == 2
    assert all(node.args[3] for node in evaluations)  # each op is told the layout its kernel writes
    nodes = list(graph.graph.nodes)
    moved = [node for node in nodes if node.op == "call_function" and str(node.target).split(".")[1] in _COPIES]
    between = [str(node.target) for node in moved if nodes.index(node) > nodes.index(evaluations[0])]
    assert not between, f"re-layouts between the layers: {between}"


def test_compiled_layer_reads_its_input_as_the_kernel_does(host_target):
    """The first kernel reads the batch-major input feature-major (it vectorises over the
    batch): the graph re-lays it out (a copy inductor writes as a tiled transpose) and the
    op receives it so, instead of copying it as it runs (on a machine whose copies cost
    less than the kernel packing the input itself)."""
    host_target(relaying(AVX2))
    graph, actual, expected = _compiled_mlp_graph(64)
    torch.testing.assert_close(actual, expected)
    first = _evaluations(graph)[0]
    x = first.args[1][0].meta["val"]
    assert x.shape == (64, 48) and x.stride() == (1, 64)
    assert "aten.clone.default" in _targets(graph)


def test_traced_attention_in_eval_returns_the_same_output_every_call():
    torch.manual_seed(1)
    layer = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_random_blocks=1, seed=0).eval()
    x = torch.randn(2, 128, 32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        first, second = compiled(x, need_weights=False)[0], compiled(x, need_weights=False)[0]
        expected = layer(x, need_weights=False)[0]
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected)


def test_repeated_traced_calls_are_replayed_and_follow_edits():
    """A compiled graph's repeated op calls skip rebuilding the call (runtime/replay.py),
    yet read the current values and notice an edited pattern."""
    from sparsenn.compiler.runtime.cache import cache_stats

    torch.manual_seed(3)
    layer = sparsenn.SparseLinear(16, 8, sparsity=0.5).eval()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        compiled(torch.randn(3, 16))
        hits = cache_stats()["traced calls"].hits
        x = torch.randn(3, 16)
        torch.testing.assert_close(compiled(x), layer(x))
        assert cache_stats()["traced calls"].hits == hits + 1
        layer.weight_values.mul_(2)
        torch.testing.assert_close(compiled(x), layer(x))
        pos, crd = layer.weight_pos1, layer.weight_crd1
        row = next(r for r in range(8) if pos[r + 1] > pos[r] and crd[pos[r]] > 0)
        crd[pos[row]] = 0  # still a valid pattern (sorted, unique): adopted
        torch.testing.assert_close(compiled(x), layer(x))
        assert layer.weight.to_dense()[row, 0] != 0
        crd[pos[row]] = 10**6
        with pytest.raises(ValueError, match="crd"):
            compiled(x)


def test_compiled_call_with_a_dense_format_sparse_operand():
    """Only dense operands are re-laid out for their kernel: a SparseTensor stored in a
    dense format (its values a flat array, converted by the op) is passed as it is."""
    torch.manual_seed(0)
    a = sparsenn.SparseTensor.from_dense(torch.randn(6, 5) * (torch.rand(6, 5) > 0.5), "csr")
    b = sparsenn.SparseTensor.from_dense(torch.randn(5, 7), "dense")
    torch._dynamo.reset()
    product = torch.compile(lambda a, b: sparsenn.einsum("ij,jk->ik", a, b, out_format="dense"), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(product(a, b), a.to_dense() @ b.to_dense())


_TRACED_PROGRAMS = textwrap.dedent("""
    import warnings
    import torch
    import sparsenn
    warnings.simplefilter("always")
    layer = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, seed=0).eval()
    S = sparsenn.from_dense(torch.randn(8, 8) * (torch.rand(8, 8) < 0.5), format="csr")
    softmax = lambda v: sparsenn.softmax(S.with_values(v), -1).values
    from torch._dynamo.utils import counters
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        attend = torch.compile(layer, fullgraph=True, backend="aot_eager")
        compiled_softmax = torch.compile(softmax, fullgraph=True, backend="aot_eager")
        x = torch.randn(2, 128, 32)
        for _ in range(2):
            out = attend(x, need_weights=False)[0]
            probs = compiled_softmax(S.values)
    assert out.shape == (2, 128, 32) and probs.shape == S.values.shape
    print(counters["stats"]["unique_graphs"], sum("lru_cache" in str(w.message) for w in caught))
""")


def test_traced_attention_and_softmax_find_their_programs_without_warnings():
    """The programs of BlockSparseAttention and sparsenn.softmax are kept per
    configuration in plain dicts (``compiled_once``), which a traced call reads: Dynamo
    traces through an ``lru_cache`` wrapper instead and warns that it does (once per
    process: hence a fresh one). A traced call builds its own program, so that the
    second call finds the graph of the first (no guard on the dict)."""
    done = subprocess.run([sys.executable, "-c", _TRACED_PROGRAMS], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["2", "0"], done.stdout + done.stderr[-3000:]  # one graph each, no warning



def test_compiled_layers_of_one_expression_leave_no_python_guards():
    """Two SparseLinears reach SparseTensor, Tensor and their shared expression through
    one name each (``formats.tensor.is_sparse``, ``call_site._EXPRESSIONS``): Dynamo
    guards them in C++, without the Python aliasing guards it otherwise evaluates on
    every compiled call (``G[linear].SparseTensor is G[pattern].SparseTensor``, ...)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    model = nn.Sequential(sparsenn.SparseLinear(48, 32, sparsity=0.8), nn.ReLU(),
                          sparsenn.SparseLinear(32, 40, sparsity=0.8)).eval()
    x = torch.randn(8, 48)

    def forward(x):
        return model(x)

    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(torch.compile(forward, fullgraph=True, backend="eager")(x), expected)
    (entry,) = _debug_get_cache_entry_list(forward.__code__)
    guards = str(entry.guard_manager)
    assert "TENSOR_MATCH" in guards
    aliasing = [line.strip() for line in guards.splitlines() if "LAMBDA_GUARD" in line and " is " in line]
    assert not aliasing, aliasing
