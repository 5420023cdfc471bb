"""What torch.compile records for sparsenn layers, read from the graphs a recording
backend is handed: chained SparseLinears hand each other the kernel's layout (no
transpose or copy between the ops), and a traced BlockSparseAttention in eval keeps one
mask."""

from __future__ import annotations

import pytest
import torch
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


def test_compiled_mlp_passes_the_kernels_layout_between_layers():
    torch.manual_seed(0)
    model = nn.Sequential(sparsenn.SparseLinear(48, 32, sparsity=0.8), nn.ReLU(),
                          sparsenn.SparseLinear(32, 40, sparsity=0.8)).eval()
    x = torch.randn(64, 48)
    graphs: list = []
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(x)
    torch.testing.assert_close(actual, expected)
    assert actual.stride() == expected.stride()
    (graph,) = graphs
    targets = _targets(graph)
    evaluations = [node for node in graph.graph.nodes if "sparsenn.evaluate" in str(node.target)]
    assert len(evaluations) == 2
    assert all(node.args[3] for node in evaluations)  # each op is told the layout its kernel writes
    moved = [t for t in targets if t.split(".")[1] in _COPIES]
    assert not moved, f"re-layouts between the layers: {moved}"


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
