"""A training step run densely (``compiler/dense_step.py``): the planner weighs a call
and its gradient calls as sparse kernels against one dense copy per step and BLAS, and
a layer's call site runs the cheaper; gradients match torch's either way."""

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512
from sparsenn.compiler.api import parse
from sparsenn.compiler.dense_step import plan_step
from sparsenn.layers.linear import _AFFINE, _LINEAR

TARGETS = pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])


def step_of(layer, batch):
    x = torch.randn(batch, layer.in_features, dtype=layer.weight_values.dtype, requires_grad=True)
    if layer.bias is None:
        return plan_step(_LINEAR.assignment, [x, layer.weight], "dense")
    return plan_step(_AFFINE.assignment, [x, layer.weight, layer.bias], "dense")


@TARGETS
@pytest.mark.parametrize("sparsity, batch", [(0.5, 64), (0.7, 64)])
def test_a_small_layer_trains_densely(host_target, target, sparsity, batch):
    # 128 -> 7: each sparse call is a few µs of work behind a launch (from batch 256 the
    # sparse step, its input packed in the kernels and its weight gradient by BLAS, costs
    # about what the dense step does: within 5 % of it on a Zen 3 at batch 512)
    host_target(target)
    step = step_of(sparsenn.SparseLinear(128, 7, sparsity=sparsity), batch)
    assert step is not None and step.dense and step.dense_cycles < step.sparse_cycles


@TARGETS
@pytest.mark.parametrize("size, batch", [(1024, 1), (1024, 64), (4096, 64)])
def test_a_sparse_layer_at_high_sparsity_trains_sparse(host_target, target, size, batch):
    host_target(target)
    step = step_of(sparsenn.SparseLinear(size, size, sparsity=0.9), batch)
    assert step is not None and not step.dense


def test_no_step_without_a_gradient_of_the_sparse_values(avx2_host):
    w = sparsenn.SparseLinear(128, 7, sparsity=0.5).weight.detach()
    x = torch.randn(64, 128, requires_grad=True)
    assert plan_step(parse("bi,oi->bo", 2), [x, w], "dense") is None


def test_explain_shows_the_step_and_both_costs(avx2_host):
    # 30 % sparse, both gradients wanted: the sparse kernels do 70 % of BLAS's work at a
    # fraction of its rate
    layer = sparsenn.SparseLinear(256, 256, sparsity=0.3)
    text = sparsenn.explain("bi,oi->bo", torch.randn(64, 256, requires_grad=True), layer.weight)
    assert "training step (at a layer's call site): dense, through torch's autograd" in text
    assert "against the sparse kernels of the call and its gradients" in text
    assert "training step" not in sparsenn.explain("bi,oi->bo", torch.randn(64, 256), layer.weight.detach())


def reference(layer, x, grad):
    """The layer's output and gradients by torch on its dense weight, masked."""
    mask = layer.mask()
    w = layer.to_dense().weight.detach().clone().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y = torch.nn.functional.linear(xr, w, b)
    y.backward(grad)
    return y.detach(), xr.grad, w.grad[mask], None if b is None else b.grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("in_features, out_features, batch", [(128, 7, 64), (13, 5, 1), (13, 5, 0), (9, 1, 3)])
def test_dense_steps_match_torch_over_optimizer_steps(avx2_host, dtype, in_features, out_features, batch, bias):
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(in_features, out_features, sparsity=0.5, dtype=dtype, bias=bias)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert step_of(layer, max(batch, 1)) is not None
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for _ in range(4):  # the first call holds the signature, later ones run its step; values change each step
        x = torch.randn(batch, in_features, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, out_features, dtype=dtype)
        expected = reference(layer, x, grad)
        opt.zero_grad()
        y = layer(x)
        y.backward(grad)
        torch.testing.assert_close(y.detach(), expected[0], **tol)
        torch.testing.assert_close(x.grad, expected[1], **tol)
        torch.testing.assert_close(layer.weight_values.grad, expected[2], **tol)
        if bias:
            torch.testing.assert_close(layer.bias.grad, expected[3], **tol)
        opt.step()


def test_the_step_runs_densely_at_the_call_site(avx2_host):
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.5)
    x = torch.randn(64, 128, requires_grad=True)
    for _ in range(3):
        layer(x).sum().backward()
    site = layer._call_sites[1]
    assert site._step is not None and site._step[1] is not None
    assert not site._gradients  # no sparse gradient call was run and held


def test_a_step_whose_result_is_not_finite_runs_sparse(avx2_host):
    mask = torch.rand(7, 128, generator=torch.Generator().manual_seed(0)) < 0.5
    mask[:, 0] = False  # input feature 0 is read by no stored weight
    layer = sparsenn.SparseLinear(128, 7, pattern=mask)
    x = torch.randn(64, 128)
    assert step_of(layer, 64).dense
    for _ in range(2):
        layer(x.requires_grad_()).sum().backward()
    x = x.detach().clone()
    x[:, 0] = float("inf")  # the sparse result stays finite; BLAS on the copy would make 0 * inf = nan
    y = layer(x.requires_grad_())
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(layer.weight_values.grad).all()


def test_second_order_gradients_through_a_dense_step(avx2_host):
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.3, dtype=torch.float64)  # as above: a step clearly dense
    x = torch.randn(64, 128, dtype=torch.float64, requires_grad=True)
    assert step_of(layer, 64).dense
    for _ in range(2):  # the second call runs the held step
        (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), [x], create_graph=True)
        (gv,) = torch.autograd.grad(gx.pow(2).sum(), [layer.weight_values])
    mask = layer.mask()
    w = layer.to_dense().weight.detach().clone().requires_grad_()
    b = layer.bias.detach()
    (rx,) = torch.autograd.grad(torch.nn.functional.linear(x, w, b).pow(2).sum(), [x], create_graph=True)
    (rw,) = torch.autograd.grad(rx.pow(2).sum(), [w])
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gv, rw[mask])


def held_dense_step(layer, batch):
    """A layer whose call site holds its signature and runs the dense step."""
    x = torch.randn(batch, layer.in_features, dtype=layer.weight_values.dtype, requires_grad=True)
    for _ in range(2):
        layer(x).sum().backward()
    site = layer._call_sites[layer.bias is not None]
    assert site._step is not None and site._step[1] is not None
    return x


def test_a_dense_step_is_one_autograd_node_over_the_leaves(avx2_host):
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.5)
    x = held_dense_step(layer, 64)
    node = layer(x).grad_fn
    leaves = {next_node.variable for next_node, _ in node.next_functions if next_node is not None}
    assert {id(t) for t in leaves} == {id(x), id(layer.weight_values), id(layer.bias)}


@pytest.mark.parametrize("how", ["in place", "through .data"])
def test_values_edited_between_steps_are_read_again(avx2_host, how):
    torch.manual_seed(0)
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.5, dtype=torch.float64)
    held_dense_step(layer, 16)
    for _ in range(3):  # an edit the version counter sees, then steps without one (the kept copy), again
        with torch.no_grad():
            (layer.weight_values if how == "in place" else layer.weight_values.data).mul_(-1.5)
        for _ in range(2):
            x = torch.randn(16, 128, dtype=torch.float64, requires_grad=True)
            grad = torch.randn(16, 7, dtype=torch.float64)
            expected = reference(layer, x, grad)
            layer.zero_grad()
            y = layer(x)
            y.backward(grad)
            torch.testing.assert_close(y.detach(), expected[0])
            torch.testing.assert_close(x.grad, expected[1])
            torch.testing.assert_close(layer.weight_values.grad, expected[2])


def test_values_edited_before_the_backward_raise_as_torch(avx2_host):
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.5)
    x = held_dense_step(layer, 64)
    y = layer(x)
    with torch.no_grad():
        layer.weight_values.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_dense_step_leaves_forward_mode_to_the_sparse_call(avx2_host):
    import torch.autograd.forward_ad as fwad
    layer = sparsenn.SparseLinear(128, 7, sparsity=0.5, dtype=torch.float64)
    held_dense_step(layer, 8)
    x, tangent = torch.randn(8, 128, dtype=torch.float64), torch.randn(8, 128, dtype=torch.float64)
    w = layer.to_dense().weight.detach()
    with fwad.dual_level():
        out = layer(fwad.make_dual(x, tangent))
        primal, jvp = fwad.unpack_dual(out)
    torch.testing.assert_close(primal.detach(), torch.nn.functional.linear(x, w, layer.bias.detach()))
    torch.testing.assert_close(jvp, tangent @ w.T)
