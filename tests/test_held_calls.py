"""Held calls (``compiler/held.py``): a repeated ``einsum`` of one equation and a layer's
repeated forward run one function holding the signature's guard and launch, and a
compiled ``SparseLinear`` traces its op without the entry point. Every situation the
guards cover still re-plans or raises through the shortcut: another shape, stride,
layout or dtype, an edited, replaced or reloaded pattern, an optimizer's step, grad
mode switched, autocast, ``vmap`` and ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sparsenn
from _machines import AVX2, AVX512, relaying
from sparsenn import SparseLinear
from sparsenn.compiler import api, cache_stats

WRITTEN = "<sparsenn held call>"


@pytest.fixture(autouse=True, params=[AVX2, AVX512], ids=["avx2", "avx512"])
def machine(request, host_target):
    """Every test plans for an explicit machine (a launch's kind, hence whether its run
    is written out, follows the plan), on both vector widths."""
    host_target(request.param)
    return request.param


def sp(shape, fmt="csr", density=0.4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < density)
    return sparsenn.from_dense(dense, format=fmt)


def held_einsum(equation: str, *operands):
    """``einsum(equation, *operands)`` three times: the third runs by the held call."""
    for _ in range(3):
        result = sparsenn.einsum(equation, *operands)
    return result


def test_a_repeated_einsum_runs_one_written_function_and_counts_its_hits():
    a, x = sp((7, 5)), torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(held_einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    out_format, call = api._PLAIN.held["ij,jk->ik"]
    assert out_format is None and call.__code__.co_filename == WRITTEN
    hits = cache_stats()["calls"].hits
    for _ in range(3):
        torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    assert cache_stats()["calls"].hits == hits + 3


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "values dtype", "out_format"])
def test_a_held_einsum_call_follows_another_signature(change):
    a, x = sp((7, 5)), torch.randn(5, 3, dtype=torch.float64)
    held_einsum("ij,jk->ik", a, x)
    out_format = None
    if change == "shape":
        x = torch.randn(5, 4, dtype=torch.float64)
    elif change == "stride":
        x.data = torch.randn(3, 5, dtype=torch.float64).T
    elif change == "dtype":
        a, x = a.to(torch.float32), x.float()
    elif change == "values dtype":
        a.values.data = a.values.data.float()
        x = x.float()
    else:
        out_format = "dense"
    result = sparsenn.einsum("ij,jk->ik", a, x, out_format=out_format)
    torch.testing.assert_close(result, a.to_dense() @ x)
    assert result.dtype == x.dtype


def test_a_held_einsum_call_is_recorded_when_grad_mode_is_switched_on():
    a, x = sp((6, 5)), torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        held_einsum("ij,jk->ik", a, x)
    result = sparsenn.einsum("ij,jk->ik", a, x)
    assert result.grad_fn is not None
    result.sum().backward()
    torch.testing.assert_close(x.grad, a.to_dense().sum(0)[:, None].expand(5, 2))


def test_a_held_einsum_call_under_autocast_vmap_and_compile():
    a, x = sp((6, 5), dtype=torch.float32), torch.randn(5, 3)
    held_einsum("ij,jk->ik", a, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sparsenn.einsum("ij,jk->ik", a, x).dtype == torch.bfloat16
    xs = torch.randn(4, 5, 3)
    batched = torch.func.vmap(lambda v: sparsenn.einsum("ij,jk->ik", a, v))(xs)
    torch.testing.assert_close(batched, torch.stack([a.to_dense() @ v for v in xs]))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda v: sparsenn.einsum("ij,jk->ik", a, v), fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), a.to_dense() @ x)
    assert any("sparsenn.evaluate" in str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_held_einsum_calls_over_inference_index_arrays():
    with torch.inference_mode():
        a = sp((6, 5))
    x = torch.randn(5, 2, dtype=torch.float64)
    torch.testing.assert_close(held_einsum("ij,jk->ik", a, x), a.to_dense() @ x)


def layer_and_input(**kwargs):
    torch.manual_seed(0)
    layer = SparseLinear(16, 8, sparsity=0.5, dtype=torch.float64, **kwargs)
    return layer, torch.randn(3, 16, dtype=torch.float64)


def reference(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    return x @ layer.weight.to_dense().T + (0 if layer.bias is None else layer.bias)


def test_a_layer_s_repeated_forward_is_one_written_function():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
        layer(x)
    assert layer._call_sites[1]._run_held.__code__.co_filename == WRITTEN


def test_a_layer_s_held_call_follows_grad_mode_a_reload_and_an_optimizer():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x), layer(x)
    out = layer(x)  # grad mode on: recorded
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((8,), 3.0, dtype=torch.float64))
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(layer, x))
        other = SparseLinear(16, 8, sparsity=0.8, dtype=torch.float64)
        layer.load_state_dict(other.state_dict())  # another pattern and nnz
        torch.testing.assert_close(layer(x), reference(other, x))
        torch.testing.assert_close(layer(x), reference(other, x))


def test_a_layer_s_held_call_under_vmap_and_autocast():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x), layer(x)
        xs = torch.randn(4, 3, 16, dtype=torch.float64)
        torch.testing.assert_close(torch.func.vmap(layer)(xs), torch.stack([reference(layer, v) for v in xs]))
    layer, x = layer.float(), x.float()
    with torch.no_grad():
        layer(x), layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16


def test_a_relaid_input_is_copied_whether_a_tensor_or_a_parameter(machine, host_target):
    host_target(relaying(machine))  # copies cheaper than the kernel packing the input itself
    torch.manual_seed(0)
    layer = SparseLinear(128, 7, sparsity=0.5)
    x = torch.randn(64, 128)
    with torch.no_grad():
        for given in (x, x, nn.Parameter(x.clone()), x.T.contiguous().T, x):
            torch.testing.assert_close(layer(given), reference(layer, given))


@pytest.mark.parametrize("fmt", ["csr", "bsr(2,2)", "nm(2,4)"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_compiled_layer_traces_its_op_alone_and_computes_as_eager(fmt, bias):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    layer = SparseLinear(16, 8, format=fmt, bias=bias, sparsity=None if fmt.startswith("nm") else 0.5)
    x = torch.randn(4, 16, requires_grad=True)

    def forward(v):
        return layer(v)

    torch._dynamo.reset()
    expected = layer(x)
    actual = torch.compile(forward, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(actual, expected)
    (entry,) = _debug_get_cache_entry_list(forward.__code__)
    guards = str(entry.guard_manager)
    assert "formats_dot_tensor" not in guards and "_call_sites" not in guards  # no SparseTensor, no site traced
    grads = torch.autograd.grad(actual.sum(), [x, layer.weight_values])
    expected_grads = torch.autograd.grad(expected.sum(), [x, layer.weight_values])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_a_compiled_layer_takes_the_expression_for_other_inputs():
    torch.manual_seed(0)
    layer = SparseLinear(16, 8, sparsity=0.5)
    sparse = sparsenn.from_dense(torch.randn(4, 16) * (torch.rand(4, 16) < 0.3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: layer(v), backend="aot_eager")
    with torch.no_grad():
        for given in (torch.randn(2, 4, 16), sparse):
            torch.testing.assert_close(compiled(given), layer(given))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert compiled(torch.randn(4, 16)).dtype == torch.bfloat16
        with pytest.raises(Exception, match=r"shape \(\.\.\., 16\)"):
            compiled(torch.randn(4, 15))


def test_a_compiled_einsum_does_not_guard_on_the_held_calls():
    """Eager calls between compiled ones replace the equation's held call; the compiled
    graph does not read it, so it is not compiled again."""
    from torch._dynamo.utils import counters

    a, x = sp((6, 5), dtype=torch.float32), torch.randn(5, 3)
    held_einsum("ij,jk->ik", a, x)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda v: sparsenn.einsum("ij,jk->ik", a, v), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), a.to_dense() @ x)
    held_einsum("ij,jk->ik", sp((6, 5), "coo", dtype=torch.float32), torch.randn(5, 4))  # another kind held
    torch.testing.assert_close(compiled(x), a.to_dense() @ x)
    assert counters["stats"]["unique_graphs"] == 1
