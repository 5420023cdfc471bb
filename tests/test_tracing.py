"""torch.compile, torch.export and torch.jit.trace of sparsenn layers: each compiled
assignment is one ``sparsenn::evaluate`` custom op (``compiler/runtime/tracing.py``, ``compiler/runtime/ops.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import sparsenn
from sparsenn.compiler import cache_stats
from sparsenn.compiler.runtime import callspec, ops, traced_operands, tracing
from sparsenn.layers.linear import _AFFINE

pytestmark = pytest.mark.usefixtures("avx2_host")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))


def _gradients(model: nn.Module, output: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(output.square().sum(), params))


def _compiled_matches(model: nn.Module, *inputs, backend: str = "inductor", **kwargs) -> None:
    """``torch.compile(model, fullgraph=True)`` gives eager's outputs and gradients
    (``backend="aot_eager"``: traced and differentiated the same way, without inductor's
    code generation, to keep the suite fast)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    expected, actual = model(*inputs, **kwargs), compiled(*inputs, **kwargs)
    if isinstance(expected, tuple):
        expected, actual = expected[0], actual[0]
    _assert_close(actual, expected)
    for got, want in zip(_gradients(model, actual), _gradients(model, expected)):
        _assert_close(got, want)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(sparsenn.SparseLinear(48, 32, sparsity=0.8), nn.ReLU(),
                         sparsenn.SparseLinear(32, 8, sparsity=0.8, format="bsr(8,8)"))


class _GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = sparsenn.SparseGCNConv(12, 16), sparsenn.SparseGCNConv(16, 4)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)


def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(30, 12), torch.randint(0, 30, (2, 90))


def test_compile_fullgraph_sparse_linear_forward_and_backward():
    _compiled_matches(_mlp(), torch.randn(5, 48))


def test_compile_fullgraph_gcn_forward_and_backward():
    torch.manual_seed(2)
    _compiled_matches(_GCN(), *_graph())


def test_compile_reads_an_adjacency_cached_by_an_eager_call():
    torch.manual_seed(3)
    conv = sparsenn.SparseGCNConv(12, 4, cached=True)
    x, edge_index = _graph()
    expected = conv(x, edge_index)  # fills the cache
    torch._dynamo.reset()
    _assert_close(torch.compile(conv, fullgraph=True)(x, edge_index), expected)


@pytest.mark.parametrize("training, length, padded", [(False, 128, False), (False, 120, True), (True, 128, False)])
def test_compile_fullgraph_block_sparse_attention(training, length, padded):
    torch.manual_seed(4)
    attention = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_window_blocks=3, num_random_blocks=1,
                                              seed=0, fixed_pattern=training).train(training)
    x = torch.randn(2, length, 32)
    padding = None
    if padded:
        padding = torch.zeros(2, length, dtype=torch.bool)
        padding[1, 70:] = True
    _compiled_matches(attention, x, backend="inductor" if padded else "aot_eager", key_padding_mask=padding,
                      need_weights=False)


def test_compiled_attention_redraws_random_blocks_in_training():
    torch.manual_seed(5)
    attention = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_random_blocks=2, seed=0).train()
    x = torch.randn(1, 256, 32)
    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    first, second = (compiled(x, average_attn_weights=False)[1] for _ in range(2))
    assert first.nnz == second.nnz
    assert not torch.equal(first.crd[3], second.crd[3])


@pytest.mark.parametrize("training, padded, drawn_per_call", [(False, False, False), (True, False, False),
                                                               (False, True, True)])
def test_compiled_attention_keeps_a_fixed_mask(training, padded, drawn_per_call):
    """Eval mode (or a fixed pattern) without padding: the mask is drawn once while
    tracing and the same arrays reach the kernels every call (the traced ops find their
    pattern validated: no "traced patterns" miss); padding still draws it per call."""
    torch.manual_seed(9)
    layer = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_random_blocks=1, seed=0,
                                          fixed_pattern=training).train(training)
    x = torch.randn(2, 128, 32)
    padding = torch.zeros(2, 128, dtype=torch.bool) if padded else None
    if padded:
        padding[0, 100:] = True
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(x, key_padding_mask=padding, need_weights=False)
    before = cache_stats()["traced patterns"]
    outputs = [compiled(x, key_padding_mask=padding, need_weights=False)[0] for _ in range(3)]
    after = cache_stats()["traced patterns"]
    assert after.misses - before.misses == (3 if drawn_per_call else 0)
    assert after.hits > before.hits
    expected = layer(x, key_padding_mask=padding)[0]
    for out in outputs:
        _assert_close(out, expected)


def test_compiled_attention_with_dynamic_shapes_draws_its_mask():
    torch.manual_seed(10)
    layer = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_random_blocks=1, seed=0).eval()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch, length in ((2, 128), (3, 160)):
        x = torch.randn(batch, length, 32)
        _assert_close(compiled(x, need_weights=False)[0], layer(x)[0])


def _lookups() -> tuple[int, int]:
    """Lookups so far of the program runners (one per program call) and of the calls (one
    per evaluation outside a fused kernel), from ``cache_stats()``."""
    stats = cache_stats()
    return tuple(stats[name].hits + stats[name].misses for name in ("program runners", "calls"))


@pytest.mark.parametrize("padded, dynamic", [(False, False), (True, False), (False, True)])
def test_compiled_attention_inference_runs_the_fused_output_steps(padded, dynamic):
    """Without gradients, the scores, softmax and SpMM are one ``sparsenn::evaluate`` op
    over the fused steps ending in the dense output (one fused call, nothing evaluated
    apart; its fake shape derived step by step, also under symbolic sizes), equal to
    eager mode."""
    torch.manual_seed(11)
    layer = sparsenn.BlockSparseAttention(32, 2, block_size=16, batch_first=True, num_random_blocks=1, seed=0).eval()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    with torch.no_grad():
        for batch, length in ((2, 128), (3, 160)) if dynamic else ((2, 120 if padded else 128),):
            x = torch.randn(batch, length, 32)
            padding = None
            if padded:
                padding = torch.zeros(batch, length, dtype=torch.bool)
                padding[1, 70:] = True
            fused, calls = _lookups()
            out = compiled(x, key_padding_mask=padding, need_weights=False)[0]
            assert _lookups() == (fused + 1, calls)
            _assert_close(out, layer(x, key_padding_mask=padding)[0])


def test_a_new_einsum_equation_is_compiled_once():
    """Traced code neither reads nor grows the set of known plain equations, so the
    graph holds no guard on it: calling it again, also after an eager call of the same
    equation, does not compile it again."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, inputs) -> object:
        graphs.append(graph)
        return graph.forward

    a = sparsenn.from_dense(torch.randn(6, 5) * (torch.rand(6, 5) < 0.5), "csr")
    x = torch.randn(5, 3)
    torch._dynamo.reset()
    product = torch.compile(lambda x: sparsenn.einsum("Zq,qY->ZY", a, x), fullgraph=True, backend=backend)
    first = product(x)
    eager = sparsenn.einsum("Zq,qY->ZY", a, x)
    _assert_close(product(x), eager)
    _assert_close(first, eager)
    assert len(graphs) == 1


def test_compile_fullgraph_einsum_and_softmax():
    torch.manual_seed(6)
    dense = torch.randn(20, 30) * (torch.rand(20, 30) < 0.3)
    A = sparsenn.from_dense(dense, format="csr")

    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A, self.w = A, nn.Parameter(torch.randn(30, 6))
            self.scale = nn.Parameter(torch.ones(A.nnz))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = sparsenn.einsum("ij,jk->ik", self.A, self.w * x)
            return h.sum() + sparsenn.softmax(self.A.with_values(self.A.values * self.scale), dim=-1).values

    _compiled_matches(Scores(), torch.randn(30, 6), backend="aot_eager")


def test_compile_fullgraph_expression_with_epilogue_trains():
    torch.manual_seed(7)
    relu_affine = sparsenn.compile("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])")
    A = sparsenn.from_dense(torch.randn(16, 24) * (torch.rand(16, 24) < 0.3), format="csr")

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A, self.values, self.b = A, nn.Parameter(A.values.clone()), nn.Parameter(torch.randn(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return relu_affine(self.A.with_values(self.values), x, self.b)

    _compiled_matches(Layer(), torch.randn(24, 5), backend="aot_eager")


def test_no_graph_break_without_fullgraph():
    """A graph normalised per call is an op with a data-dependent size (Dynamo breaks
    there unless fullgraph=True); a cached adjacency is read as a constant."""
    from torch._dynamo.utils import counters

    gcn = _GCN()
    gcn.conv1.cached = gcn.conv2.cached = True
    x, edge_index = _graph()
    for model, inputs in ((_mlp(), (torch.randn(5, 48),)), (gcn, (x, edge_index))):
        expected = model(*inputs)
        torch._dynamo.reset()
        counters.clear()
        _assert_close(torch.compile(model)(*inputs), expected)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1


def test_compiled_mlp_recompiles_only_for_a_new_shape_or_dtype():
    """A second call of the same shapes reuses the compiled graph (its guards pass); a new
    batch size or dtype compiles again."""
    from torch._dynamo.utils import counters

    mlp = _mlp().eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        for x in (torch.randn(5, 48), torch.randn(5, 48)):
            _assert_close(compiled(x), mlp(x))
        assert counters["stats"]["unique_graphs"] == 1
        x = torch.randn(7, 48)
        _assert_close(compiled(x), mlp(x))
        assert counters["stats"]["unique_graphs"] == 2
        mlp.double()
        x = torch.randn(5, 48, dtype=torch.float64)
        _assert_close(compiled(x), mlp(x))
        assert counters["stats"]["unique_graphs"] == 3


def test_export_sparse_linear_mlp_and_gcn():
    mlp, x = _mlp().eval(), torch.randn(5, 48)
    with torch.no_grad():
        program = torch.export.export(mlp, (x,))
        _assert_close(program.module()(x), mlp(x))
        gcn, inputs = _GCN().eval(), _graph()
        program = torch.export.export(gcn, inputs)
        _assert_close(program.module()(*inputs), gcn(*inputs))
    assert "sparsenn.evaluate" in str(program.graph)


def test_jit_trace_records_the_ops_and_generalises_over_values():
    mlp = _mlp().eval()
    with torch.no_grad(), pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(mlp, (torch.randn(5, 48),))
    assert "sparsenn::evaluate" in str(traced.inlined_graph)
    other = torch.randn(5, 48)
    with torch.no_grad():
        _assert_close(traced(other), mlp(other))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_compile_fullgraph_moe_at_routing_dependent_sizes(capacity_factor):
    """The routing's index ops give the panels' capacity (and, with a capacity limit, the
    kept choices) as unbacked sizes: one graph serves calls routed differently."""
    torch.manual_seed(8)
    gate = sparsenn.SparseMoEGate(16, 4, k=2, capacity_factor=capacity_factor)
    moe = sparsenn.SparseMoE(16, 32, 4, k=2, gate=gate, bias=True)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    for tokens in (10, 10, 37):
        x = torch.randn(tokens, 16)
        actual = compiled(x)
        compiled_losses = moe.aux_loss, moe.z_loss, moe.dropped
        expected = moe(x)
        _assert_close(actual, expected)
        for got, want in zip(compiled_losses, (moe.aux_loss, moe.z_loss, moe.dropped)):
            torch.testing.assert_close(got, want)
        for got, want in zip(_gradients(moe, actual + compiled_losses[0]), _gradients(moe, expected + moe.aux_loss)):
            _assert_close(got, want)
        assert capacity_factor is None or int(moe.dropped) > 0


def test_compiled_moe_breaks_only_at_the_routing_ops():
    """Without fullgraph, Dynamo breaks at ops whose output sizes depend on data (as at
    torch.nonzero) and nowhere else in the layer."""
    torch.manual_seed(8)
    moe = sparsenn.SparseMoE(16, 32, 4, k=2, gate=sparsenn.SparseMoEGate(16, 4, k=2, capacity_factor=1.0))
    torch._dynamo.reset()
    report = torch._dynamo.explain(moe)(torch.randn(10, 16))
    reasons = {str(r.reason).splitlines()[0] for r in report.break_reasons}
    assert reasons == {"Dynamic shape operator"}, reasons
    assert {str(r.reason).splitlines()[1].split("`")[1] for r in report.break_reasons} == {
        "sparsenn.kept_choices.default", "sparsenn.moe_dispatch.default"}


def test_opcheck_routing_ops():
    from sparsenn.layers.routing import dispatch_arrays, kept_choices

    keep = torch.tensor([True, False, True, True, False])
    torch.library.opcheck(kept_choices, (keep,))
    assert kept_choices(keep).tolist() == [0, 2, 3]
    # tokens 0: experts {0, 2}, 1: {1, 2}, 2: {2}; expert 2 takes three tokens
    pos, crd = torch.tensor([0, 2, 4, 5], dtype=torch.int32), torch.tensor([0, 2, 1, 2, 2], dtype=torch.int32)
    torch.library.opcheck(dispatch_arrays, (pos, crd, 3, False))
    slot_pos, slot_crd, gather_pos, gather_crd, combine_crd, capacity = dispatch_arrays(pos, crd, 3, False)
    assert capacity == 3 and slot_pos.dtype == torch.int32
    assert slot_pos.tolist() == [0, 1, 2, 5] and slot_crd.tolist() == [0, 0, 0, 1, 2]
    assert gather_pos.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 4, 5] and gather_crd.tolist() == [0, 1, 0, 1, 2]
    assert combine_crd.tolist() == [0, 6, 3, 7, 8]


def test_jit_trace_refuses_moe():
    torch.manual_seed(8)
    moe = sparsenn.SparseMoE(16, 32, 4, k=2)
    with pytest.raises(RuntimeError, match="cannot record SparseMoE"):
        torch.jit.trace(moe, (torch.randn(10, 16),))


def test_opcheck_evaluate_and_its_gradient():
    layer = _mlp()[0]
    x, weight, bias = torch.randn(4, 48), layer.weight, layer.bias
    weight = weight.with_values(weight.values.detach().requires_grad_())
    operands = [x.requires_grad_(), weight, bias.detach().requires_grad_()]
    fields = traced_operands.describe(operands)
    call, anchor = tracing.encoded_call(_AFFINE._plain.stages[0].assignment, (), "dense", *fields)
    assert anchor is None
    torch.library.opcheck(torch.ops.sparsenn.evaluate.default,
                          (call, traced_operands.flatten(operands, fields[2::3]), traced_operands.sparse_shapes(operands), []))


def _layer_calls() -> nn.Module:
    """Two SparseLinear layers (csr, then bsr: a kernel over split indices) whose
    results a kernel writes feature-major when its schedule vectorises over the batch."""

    class Layers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = sparsenn.SparseLinear(64, 32, sparsity=0.8)
            self.second = sparsenn.SparseLinear(32, 32, sparsity=0.5, format="bsr(8,8)")

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.first(x)
            return h, self.second(torch.relu(h))

    torch.manual_seed(11)
    return Layers().eval()


def test_compiled_results_have_the_layouts_of_eager_results():
    """The op returns a dense result as the kernel wrote it (inductor checks that every
    op's result has the strides its fake implementation announced)."""
    layers, x = _layer_calls(), torch.randn(16, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        expected, actual = layers(x), torch.compile(layers, fullgraph=True)(x)
    for got, want in zip(actual, expected):
        _assert_close(got, want)
        assert got.stride() == want.stride()


def test_compiled_results_with_dynamic_shapes_are_contiguous():
    layers = _layer_calls()
    torch._dynamo.reset()
    compiled = torch.compile(layers, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for batch in (16, 24):
            x = torch.randn(batch, 64)
            for got, want in zip(compiled(x), layers(x)):
                _assert_close(got, want)
                assert got.is_contiguous()


def _layer_call(layer: sparsenn.SparseLinear, x: torch.Tensor) -> tuple[str, list, list[int]]:
    operands = [x, layer.weight, layer.bias]
    fields = traced_operands.describe(operands)
    call, _ = tracing.encoded_call(_AFFINE._plain.stages[0].assignment, (), "dense", *fields)
    return call, traced_operands.flatten(operands, fields[2::3]), traced_operands.sparse_shapes(operands)


def test_planned_layout_is_the_eager_results_layout():
    layer, x = _layer_calls().first, torch.randn(16, 64)
    call, tensors, shapes = _layer_call(layer, x)
    order, _ = tracing.planned_layouts(call, tuple(t.dtype for t in tensors), tuple(tuple(t.shape) for t in tensors),
                                   tuple(shapes))
    with torch.no_grad():
        expected = layer(x)
        result = torch.ops.sparsenn.evaluate(call, tensors, shapes, list(order))
    assert result.stride() == expected.stride()
    _assert_close(result, expected)


def test_opcheck_evaluate_with_a_strided_result():
    layer, x = _layer_calls().first, torch.randn(16, 64)
    call, tensors, shapes = _layer_call(layer, x)
    for order in ([1, 0], [0, 1]):
        torch.library.opcheck(torch.ops.sparsenn.evaluate.default, (call, tensors, shapes, order))
    with pytest.raises(ValueError, match="not a permutation"):
        torch.ops.sparsenn.evaluate(call, tensors, shapes, [1, 1])


def test_laid_out_copies_only_a_result_of_another_layout():
    written = torch.randn(5, 3).t()  # strides (1, 3): order [1, 0]
    assert ops._laid_out(written, [1, 0]) is written
    copied = ops._laid_out(written, [0, 1])
    assert copied.stride() == (5, 1) and torch.equal(copied, written)
    row = torch.randn(1, 4)  # a size-1 dimension's stride does not matter: a view with the announced strides
    viewed = ops._laid_out(row, [1, 0])
    assert viewed.stride() == torch.empty(4, 1).t().stride() and viewed.data_ptr() == row.data_ptr()
    assert torch.equal(viewed, row)
    assert ops._laid_out(written, []).is_contiguous()


def test_traced_einsum_of_dense_operands_returns_a_tensor_of_its_own():
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    y = torch.compile(lambda t: sparsenn.einsum("ij->ij", t), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    call, _ = tracing.encoded_call(None, ("einsum", "ij->ij", 1), None, *traced_operands.describe([x]))
    torch.library.opcheck(torch.ops.sparsenn.evaluate.default, (call, [x], [], []))


def test_operands_sharing_index_arrays_at_other_shapes():
    """Two operands with the same arrays but different shapes are passed apart."""
    A = sparsenn.from_dense(torch.randn(3, 4) * (torch.rand(3, 4) < 0.5), format="csr")
    B = sparsenn.SparseTensor((3, 6), "csr", A.pos, A.crd, torch.randn(A.nnz))
    x, y = torch.randn(4, 2), torch.randn(6, 2)
    f = lambda x, y: sparsenn.einsum("ij,jk->ik", A, x) + sparsenn.einsum("ij,jk->ik", B, y)  # noqa: E731
    torch._dynamo.reset()
    _assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, y), f(x, y))
    fields = traced_operands.describe([A, B])
    assert fields[2::3] == [None, None]


def test_a_call_string_cannot_load_arbitrary_objects():
    """A call string is text parsed by the notation's readers: the pickles of the format
    before it (version 0) are refused by their version, whatever they hold."""
    import base64
    import pickle

    evil = "sparsenn-call:" + base64.b64encode(pickle.dumps(print)).decode()
    with pytest.raises(callspec.SpecVersionError, match="format version 0 .* reads version 1"):
        callspec.decode(evil)
    with pytest.raises(ValueError, match="not a sparsenn call string"):
        callspec.decode("garbage")


def test_traced_op_validates_the_buffers_it_is_given():
    layer = sparsenn.SparseLinear(16, 8, sparsity=0.5).eval()
    x = torch.randn(3, 16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        compiled(x)
        crd = next(b for name, b in layer.named_buffers() if "crd" in name)
        crd[0] = 10**6
        with pytest.raises(ValueError, match="crd"):
            compiled(x)


def test_compile_in_a_fresh_process():
    """The first call in a new process is traced before any eager call (caches empty)."""
    script = textwrap.dedent("""
        import torch, sparsenn
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(sparsenn.SparseLinear(24, 16, sparsity=0.8), nn.ReLU(), sparsenn.SparseLinear(16, 4))
        conv = sparsenn.SparseGCNConv(4, 3)
        moe = sparsenn.SparseMoE(3, 8, 4, k=2)
        x, edges = torch.randn(6, 24), torch.randint(0, 6, (2, 12))
        run = torch.compile(lambda x, e: moe(conv(model(x), e)), fullgraph=True)
        out = run(x, edges)
        torch.testing.assert_close(out, moe(conv(model(x), edges)))
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_a_call_string_cannot_call_sparsenn_functions():
    import base64
    import pickle

    from sparsenn.compiler.backend import jit

    class Build:
        def __reduce__(self):
            return jit.load_library, ("int main() { return 0; }",)

    evil = "sparsenn-call:" + base64.b64encode(pickle.dumps(Build())).decode()
    with pytest.raises(callspec.SpecVersionError, match="format version 0"):
        callspec.decode(evil)


def test_stand_ins_have_the_traced_tensors_memory_order():
    """``planned_layouts`` plans on stand-ins laid out as the traced tensors are: a
    permuted contiguous tensor in its order, anything else as one expanded element."""
    transposed = tracing._stand_in(torch.float32, (4, 2, 3), (1, 12, 4))
    assert transposed.shape == (4, 2, 3) and transposed.stride() == (1, 12, 4)
    for stride in ((), (5, 1), (10, 2)):
        stand_in = tracing._stand_in(torch.float32, (4, 5), stride)
        assert stand_in.shape == (4, 5) and stand_in.stride() == (0, 0)
