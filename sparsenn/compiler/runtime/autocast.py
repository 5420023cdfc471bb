"""Autocast at the compiler's entry points.

Under ``torch.autocast("cpu", dtype=d)`` (and Lightning's ``precision="bf16-mixed"``,
which enters it) every ``einsum`` and compiled expression — sums of products, so all of
them are treated alike — follows autocast's policy for ``torch.matmul`` and
``nn.Linear``, its lower-precision list: every floating operand on the CPU (a dense
tensor, or a :class:`SparseTensor`'s values) is cast to ``d``, float64 ones excepted
(torch leaves them as they are), so the result is in ``d`` and the kernels run on 16-bit
values with float32 arithmetic (``backend/precision.py``). ``sparsenn.softmax`` keeps
its input's dtype, as ``torch.softmax`` does on the CPU. The casts are
differentiable: a float32 parameter gets a float32 gradient. Self-contained, so that it
can become a custom op's ``torch.library.register_autocast`` rule.
"""

from __future__ import annotations

import torch
from torch import is_autocast_enabled

from sparsenn.formats import SparseTensor

__all__ = ["autocast_operands", "autocast_dtype"]

_DEVICE = "cpu"  # sparsenn kernels run on the CPU


def autocast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an operand of ``dtype`` is computed in: the autocast dtype for a
    floating dtype other than float64 while autocast is enabled, else ``dtype``."""
    if torch.is_autocast_enabled(_DEVICE) and dtype.is_floating_point and dtype != torch.float64:
        return torch.get_autocast_dtype(_DEVICE)
    return dtype


def autocast_operands(operands: list | tuple) -> list | tuple:
    """``operands`` (a list or tuple, returned as one) with autocast's casts applied
    (see the module doc); the same object when autocast is disabled."""
    if not is_autocast_enabled(_DEVICE):
        return operands
    return type(operands)(_cast(op) for op in operands)


def _cast(op):
    values = op.values if isinstance(op, SparseTensor) else op
    if not isinstance(values, torch.Tensor) or values.device.type != _DEVICE:
        return op  # not ours to cast: validation names what is wrong
    dtype = autocast_dtype(values.dtype)
    if dtype == values.dtype:
        return op
    return op.with_values(values.to(dtype)) if isinstance(op, SparseTensor) else values.to(dtype)
