"""Build a model's kernels ahead of time (e.g. in a Docker build step), so that its first
real call, or a machine without a C++ compiler sharing the cache, only loads them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from sparsenn.compiler.backend import jit

__all__ = ["Precompiled", "precompile"]


@dataclass(frozen=True)
class Precompiled:
    """What :func:`precompile` did: kernels compiled (others were in the cache) and the
    time it took."""

    kernels_built: int
    seconds: float


def precompile(module: nn.Module, *example_inputs, backward: bool = True, **example_kwargs) -> Precompiled:
    """Run ``module(*example_inputs, **example_kwargs)`` in eval mode without gradients
    (inference kernels), then, when ``backward`` and a parameter requires grad, in
    training mode with gradients and its backward pass (training kernels: a training
    forward may take another path, e.g. with dropout, a differentiable call may run other
    kernels, and the gradients' kernels build concurrently), so every kernel they need is
    built into the kernel cache (``$SPARSENN_CACHE_DIR``).

    Kernels depend on the operands' formats, dtypes and shapes up to the schedule's
    decisions: give inputs of the sizes the model will see. Nothing observable changes:
    the module's mode and buffers (batch-norm statistics) are restored after, the random
    generators are forked, and gradients are computed with ``torch.autograd.grad`` (no
    ``.grad`` is written)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"precompile takes an nn.Module, got {type(module).__name__}")
    built, started = jit.builds, time.perf_counter()
    training = module.training
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng():
            module.eval()
            with torch.no_grad():
                module(*example_inputs, **example_kwargs)
            if backward and params:
                module.train()
                with torch.enable_grad():
                    outputs = module(*example_inputs, **example_kwargs)
                    tensors = [t for t in _tensors(outputs) if t.requires_grad]
                    if tensors:
                        torch.autograd.grad(tensors, params, [torch.ones_like(t) for t in tensors],
                                            allow_unused=True)
    finally:
        module.train(training)
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)
    return Precompiled(jit.builds - built, time.perf_counter() - started)


def _tensors(outputs) -> list[torch.Tensor]:
    """The tensors in a module's outputs (a tensor, a SparseTensor's values, or nested
    tuples, lists and dicts of them)."""
    from sparsenn.formats import SparseTensor

    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, SparseTensor):
        return [outputs.values]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in _tensors(item)]
    return []
