"""Optimizer state left behind by a ``load_state_dict`` that changed a layer's pattern.

A loaded pattern with another number of stored weights resizes the layer's values
parameter in place (its ``.data``), keeping the object: an optimizer built before holds it
and steps the new entries. State the optimizer kept for it (Adam's moments, SGD's momentum)
has the old pattern's shape and describes entries that are gone. From the first such
resize on, a global optimizer step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``) checks the resized parameters before each
``optimizer.step()`` and raises a RuntimeError naming the parameter if the optimizer still
holds state of an old shape for it. The remedies: load the optimizer state saved with the
model (``optimizer.load_state_dict``), which fits, or drop the parameter's state
(``optimizer.state.pop(parameter)``), which restarts it. The check costs O(resized
parameters) per step, nothing before the first resize.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["watch_resized"]

_OLD_SHAPES = WeakIdKeyDictionary()  # parameter -> (its name, the shapes it had)
_hook: Any = None


def watch_resized(parameter: Tensor, name: str, old_shape: torch.Size) -> None:
    """Record that ``parameter`` (called ``name`` in the loaded model) is about to be
    resized from ``old_shape``; registers the step pre-hook on first use."""
    global _hook
    _, shapes = _OLD_SHAPES.get(parameter, (name, frozenset()))
    _OLD_SHAPES[parameter] = (name, shapes | {torch.Size(old_shape)})
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_state)


def _check_state(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The step pre-hook: RuntimeError when ``optimizer`` holds state of an old shape for a
    resized parameter."""
    state = optimizer.state
    for parameter, (name, old_shapes) in list(_OLD_SHAPES.items()):
        if parameter not in state:
            continue
        for key, value in state[parameter].items():
            if isinstance(value, Tensor) and value.dim() and value.shape != parameter.shape \
                    and value.shape in old_shapes:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds state {key!r} of shape {tuple(value.shape)} for the parameter "
                    f"{name!r}, which load_state_dict resized to {tuple(parameter.shape)} (a new sparsity pattern): "
                    "the state describes the old pattern's entries. Load the optimizer state saved with the model "
                    "(optimizer.load_state_dict), or drop this parameter's state (optimizer.state.pop(parameter)) "
                    "to restart it")
