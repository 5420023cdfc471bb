"""Autograd graphs as tests inspect them."""

from __future__ import annotations

import torch


def autograd_nodes(tensor: torch.Tensor) -> list[str]:
    """The names of the autograd nodes ``tensor`` was computed through, each once."""
    seen, pending, names = set(), [tensor.grad_fn], []
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names
