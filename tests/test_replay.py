"""The replay of repeated ``sparsenn::evaluate`` calls (``compiler/runtime/replay.py``):
a recorded run is replayed exactly for the calls its guard admits — the same index
arrays, unedited, and other tensors of the recorded shape, dtype and strides — whether
the C++ tensor guards made at the first replay or the Python test decides."""

from __future__ import annotations

import torch

from sparsenn.compiler.runtime.replay import remember, replay


def _recorded(call: str) -> tuple[list[torch.Tensor], list]:
    """Record a call over a dense operand (slot 0) and an index array (slot 1) whose
    run returns the dense operand plus one."""
    x, array = torch.randn(4, 3), torch.arange(5, dtype=torch.int32)
    finish = lambda operands, out: out  # noqa: E731
    remember(call, [x, array], [5], [1, 0], [x], [0], lambda ops: ops[0] + 1, finish, None)
    return [x, array], [5]


def test_replays_the_recorded_run_with_the_new_values():
    tensors, shapes = _recorded("replay test: new values")
    for _ in range(3):  # the first replay makes the C++ guards, the next ones use them
        x = torch.randn(4, 3)
        torch.testing.assert_close(replay("replay test: new values", [x, tensors[1]], shapes, [1, 0]), x + 1)


def test_refuses_other_layouts_dtypes_arrays_and_arguments():
    call = "replay test: refusals"
    tensors, shapes = _recorded(call)
    array = tensors[1]
    assert replay(call, [torch.randn(4, 3), array], shapes, [1, 0]) is not None
    for x in (torch.randn(3, 4).t(), torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3)):
        assert replay(call, [x, array], shapes, [1, 0]) is None
    assert replay(call, [torch.randn(4, 3), array.clone()], shapes, [1, 0]) is None  # another array object
    assert replay(call, [torch.randn(4, 3), array], [6], [1, 0]) is None
    assert replay(call, [torch.randn(4, 3), array], shapes, [0, 1]) is None
    array.add_(0)  # an in-place edit: the pattern must be validated again
    assert replay(call, [torch.randn(4, 3), array], shapes, [1, 0]) is None


def test_a_tensor_that_now_requires_grad_passes_the_python_test():
    call = "replay test: requires grad"
    tensors, shapes = _recorded(call)
    assert replay(call, [torch.randn(4, 3), tensors[1]], shapes, [1, 0]) is not None
    x = torch.randn(4, 3, requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(replay(call, [x, tensors[1]], shapes, [1, 0]), x + 1)
