"""A layer's call site (``compiler/call_site.py``) runs a repeated call by the guard of
the signature it holds, and a recorded call's backward by the gradient calls it holds:
every change between two calls (in-place and ``.data`` edits of the parameters, pattern
edits, another input shape, layout or dtype, another thread count, grad mode, autocast,
another Target) and between a forward and its backward is either read by the held launch
or sends the call through the expression, checked in full."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading

import pytest
import torch

import sparsenn
from sparsenn import SparseLinear
from sparsenn.compiler import compile_expression, use_target
from sparsenn.compiler.call_site import CallSite

from _machines import AVX2, AVX512


def reference(layer: SparseLinear, x: torch.Tensor) -> torch.Tensor:
    dense = layer.weight.to_dense()
    return x @ dense.T + (0 if layer.bias is None else layer.bias)


def layer_and_input(bias: bool = True, batch: int = 3):
    torch.manual_seed(0)
    layer = SparseLinear(16, 8, sparsity=0.5, bias=bias, dtype=torch.float64)
    return layer, torch.randn(batch, 16, dtype=torch.float64)


def held(layer: SparseLinear) -> bool:
    return layer._call_sites[layer.bias is not None].holds_signature


@pytest.mark.parametrize("bias", [True, False])
def test_a_repeated_call_runs_by_the_held_signature_and_reads_edited_parameters(bias):
    layer, x = layer_and_input(bias)
    with torch.no_grad():
        layer(x)
        assert held(layer)
        layer.weight_values.mul_(2)  # in place: the same arrays, new values
        torch.testing.assert_close(layer(x), reference(layer, x))
        layer.weight_values.data.add_(1)  # through .data: no version counter sees it
        torch.testing.assert_close(layer(x), reference(layer, x))
        if bias:
            layer.bias.data = torch.randn(8, dtype=torch.float64)  # another tensor at the same object
            torch.testing.assert_close(layer(x), reference(layer, x))
        x.mul_(-1)
        torch.testing.assert_close(layer(x), reference(layer, x))


def test_a_resized_parameter_fails_the_guard_and_is_checked_in_full():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
        layer.bias.data = torch.randn(9, dtype=torch.float64)
        with pytest.raises(ValueError, match="size 9"):
            layer(x)
        layer.bias.data = torch.randn(8, dtype=torch.float64).expand(2, 8)[0]  # same shape, another stride
        torch.testing.assert_close(layer(x), reference(layer, x))


def moved_entry(layer: SparseLinear) -> tuple[int, int]:
    """(position, column): the last entry of a row moved to column 15, a valid new pattern."""
    pos, crd = layer.weight_pos1, layer.weight_crd1
    row = next(r for r in range(layer.out_features) if pos[r + 1] > pos[r] and crd[pos[r + 1] - 1] < 15)
    return int(pos[row + 1]) - 1, 15


def test_an_edited_pattern_is_validated_and_adopted_by_the_next_call():
    layer, x = layer_and_input()
    with torch.no_grad():
        before = layer(x)
        position, column = moved_entry(layer)
        layer.weight_crd1[position] = column  # in place: still sorted and in range
        after = layer(x)
        torch.testing.assert_close(after, reference(layer, x))
        assert not torch.equal(after, before)
        layer.weight_crd1[0] = 99  # out of range: named, not read
        with pytest.raises(ValueError, match="weight_crd1"):
            layer(x)


def test_a_replaced_pattern_buffer_or_values_parameter_is_read_by_the_next_call():
    layer, x = layer_and_input()
    with torch.no_grad():
        before = layer(x)
        position, column = moved_entry(layer)
        crd = layer.weight_crd1.clone()
        crd[position] = column
        layer.weight_crd1 = crd  # a new tensor: the held weight's arrays are unedited, but no longer the layer's
        after = layer(x)
        torch.testing.assert_close(after, reference(layer, x))
        assert not torch.equal(after, before)
        layer.weight_values = torch.nn.Parameter(torch.randn(layer.nnz, dtype=torch.float64))
        torch.testing.assert_close(layer(x), reference(layer, x))
        layer.weight_crd1 = torch.full_like(crd, 99)
        with pytest.raises(ValueError, match="weight_crd1"):
            layer(x)


def test_another_input_shape_layout_or_rank_goes_through_the_expression():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
        for other in (torch.randn(5, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64).T,
                      torch.randn(2, 3, 16, dtype=torch.float64), x[:, None, :].expand(3, 2, 16)):
            torch.testing.assert_close(layer(other), reference(layer, other))
        torch.testing.assert_close(layer(x), reference(layer, x))
        with pytest.raises(ValueError, match=r"shape \(\.\.\., 16\)"):
            layer(torch.randn(3, 15, dtype=torch.float64))
        with pytest.raises(TypeError, match="dtype"):
            layer(x.float())


def test_a_dtype_change_of_the_layer_fails_the_guard():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
        layer.float()
        torch.testing.assert_close(layer(x.float()), reference(layer, x.float()))
        with pytest.raises(TypeError, match="dtype"):
            layer(x)


def test_the_thread_count_is_read_at_every_call():
    torch.manual_seed(0)
    layer = SparseLinear(512, 256, sparsity=0.5, dtype=torch.float64)  # enough work for a team of threads
    x = torch.randn(64, 512, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for count in (1, 2, 1):
                torch.set_num_threads(count)
                torch.testing.assert_close(layer(x), reference(layer, x))
    finally:
        torch.set_num_threads(threads)


def test_a_recorded_call_after_plain_ones_records_its_gradients():
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
    x = x.clone().requires_grad_()
    out = layer(x)
    assert out.grad_fn is not None
    out.sum().backward()
    dense = layer.weight.to_dense()
    torch.testing.assert_close(x.grad, torch.ones(3, 8, dtype=torch.float64) @ dense)
    assert layer.weight_values.grad is not None and layer.bias.grad is not None


def test_a_call_under_autocast_is_not_run_by_the_held_signature():
    torch.manual_seed(0)
    layer, x = SparseLinear(16, 8, sparsity=0.5), torch.randn(3, 16)
    with torch.no_grad():
        layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16
        assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_another_target_empties_the_sites(target):
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
        with use_target(target):
            assert not held(layer)
            torch.testing.assert_close(layer(x), reference(layer, x))
            assert held(layer)
        assert not held(layer)


def test_copied_and_pickled_layers_hold_no_signature_and_compute_the_same():
    layer, x = layer_and_input()
    with torch.no_grad():
        expected = layer(x)
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert not held(other)
            torch.testing.assert_close(other(x), expected)
            assert held(other)


def test_a_call_site_needs_one_statement():
    with pytest.raises(ValueError, match="one statement"):
        CallSite(compile_expression("M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i])"))
    site = CallSite(compile_expression("Y[i] = A[i,j] * x[j]"))
    a = sparsenn.from_dense(torch.eye(4, dtype=torch.float64), format="csr")
    v = torch.arange(4.0, dtype=torch.float64)
    torch.testing.assert_close(site(a, v), v)
    torch.testing.assert_close(site(a, v * 2), v * 2)


def test_threads_calling_one_layer_with_other_shapes_get_their_own_results():
    layer, _ = layer_and_input()
    inputs = [torch.randn(batch, 16, dtype=torch.float64) for batch in (1, 2, 5)]
    expected = [reference(layer, x) for x in inputs]
    failures = []

    def work(k: int) -> None:
        with torch.no_grad():
            for _ in range(300):
                if not torch.allclose(layer(inputs[k]), expected[k], rtol=1e-12, atol=1e-12):
                    failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def reference_gradients(layer: SparseLinear, x: torch.Tensor, g: torch.Tensor):
    """(dx, dW values, db) of ``(x W^T + b) . g`` from the dense weight."""
    dense = layer.weight.to_dense()
    rows, cols = layer.weight.coords()[0]
    return g @ dense, (g.T @ x)[rows, cols], g.sum(0)


def training_step(layer: SparseLinear, x: torch.Tensor, g: torch.Tensor):
    layer.zero_grad()
    x = x.detach().requires_grad_()
    layer(x).backward(g)
    return x.grad, layer.weight_values.grad, layer.bias.grad


def test_training_steps_run_by_the_held_signature_and_its_gradient_calls(host_target):
    # a machine whose Python calls cost far more than any kernel: the step runs sparse
    # (at this size the planner otherwise runs it densely, test_dense_step.py)
    host_target(dataclasses.replace(AVX2, python_call_cycles=1e9))
    layer, x = layer_and_input()
    g = torch.randn(3, 8, dtype=torch.float64)
    for step in range(4):
        with torch.no_grad():
            layer.weight_values.mul_(-1.5)  # an optimizer's in-place update
        for got, expected in zip(training_step(layer, x, g), reference_gradients(layer, x, g)):
            torch.testing.assert_close(got, expected)
        assert held(layer)
    assert set(layer._call_sites[1]._gradients) == {0, 1, 2}  # x, the weight's values and the bias


def test_alternating_batch_sizes_and_wanted_gradients_are_computed_for_their_own_signature():
    layer, x = layer_and_input()
    other = torch.randn(5, 16, dtype=torch.float64)
    for inputs in (x, other, x, other, x):
        g = torch.randn(inputs.shape[0], 8, dtype=torch.float64)
        for got, expected in zip(training_step(layer, inputs, g), reference_gradients(layer, inputs, g)):
            torch.testing.assert_close(got, expected)
        layer.zero_grad()
        layer(inputs).backward(g)  # x needs no gradient: the weight's and the bias's only
        torch.testing.assert_close(layer.weight_values.grad, reference_gradients(layer, inputs, g)[1])


def test_a_pattern_replaced_between_forward_and_backward_differentiates_the_forward_s_pattern():
    layer, x = layer_and_input()
    g = torch.randn(3, 8, dtype=torch.float64)
    for _ in range(3):
        training_step(layer, x, g)
    expected = reference_gradients(layer, x, g)[1]
    out = layer(x)
    position, column = moved_entry(layer)
    crd = layer.weight_crd1.clone()
    crd[position] = column
    layer.weight_crd1 = crd
    layer.zero_grad()
    out.backward(g)
    torch.testing.assert_close(layer.weight_values.grad, expected)


def test_a_pattern_edited_in_place_between_forward_and_backward_is_refused():
    layer, x = layer_and_input()
    g = torch.randn(3, 8, dtype=torch.float64)
    for _ in range(3):
        training_step(layer, x, g)
    out = layer(x)
    position, column = moved_entry(layer)
    layer.weight_crd1[position] = column
    with pytest.raises(ValueError, match="modified"):
        out.backward(g)


def test_a_backward_that_records_its_graph_is_not_run_by_held_gradient_calls():
    layer, x = layer_and_input()
    g = torch.randn(3, 8, dtype=torch.float64)
    for _ in range(3):
        training_step(layer, x, g)
    x = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(layer(x), x, g, create_graph=True)
    (ddw,) = torch.autograd.grad(dx.pow(2).sum(), layer.weight_values)
    dense = layer.weight.to_dense().requires_grad_()
    (dx_dense,) = torch.autograd.grad(x @ dense.T, x, g, create_graph=True)
    (ddw_dense,) = torch.autograd.grad(dx_dense.pow(2).sum(), dense)
    rows, cols = layer.weight.coords()[0]
    torch.testing.assert_close(ddw, ddw_dense[rows, cols])


def test_a_pattern_replaced_between_training_steps_is_differentiated_on_the_new_pattern():
    layer, x = layer_and_input()
    g = torch.randn(3, 8, dtype=torch.float64)
    for _ in range(3):
        training_step(layer, x, g)
    position, column = moved_entry(layer)
    crd = layer.weight_crd1.clone()
    crd[position] = column
    layer.weight_crd1 = crd  # the same signature (shape, nnz): the held forward still matches
    for got, expected in zip(training_step(layer, x, g), reference_gradients(layer, x, g)):
        torch.testing.assert_close(got, expected)
