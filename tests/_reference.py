"""Reference checks shared by tests: a sparse layer's results against torch on its dense weight."""

import torch


def assert_layer_matches_dense(layer, x: torch.Tensor, y: torch.Tensor) -> None:
    """``y = layer(x)`` and the input gradient of ``y.square().sum()`` (already run
    backward into ``x.grad``) against ``F.linear`` on the layer's weight made dense."""
    dense = layer.weight.to_dense().detach().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    expected = torch.nn.functional.linear(x2, dense, layer.bias)
    expected.square().sum().backward()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-3)
