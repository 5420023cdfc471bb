"""PyTorch module conventions shared by the layers: ``device=``/``dtype=`` keyword
arguments resolved as torch's modules resolve them (``factory_kwargs``), and the refusal
of ``torch.jit.script``, which cannot compile a forward that calls compiled sparse
kernels, and of ``torch.onnx.export``, which has no ONNX operator for them."""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__all__ = ["FLOAT_DTYPES", "factory_kwargs", "refuse_onnx_export", "refuse_torchscript"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cpu", "meta")


def factory_kwargs(device: object, dtype: object) -> dict[str, Any]:
    """``{"device": ..., "dtype": ...}`` for a layer's parameters, as ``nn.Linear`` takes
    them: ``dtype`` defaults to torch's default dtype and ``device`` to torch's default
    device (``with torch.device("meta")`` included). Layers run on the CPU; the meta device
    builds them without memory (then ``to_empty(device="cpu")`` and ``reset_parameters()``).
    TypeError/ValueError naming the argument otherwise."""
    if dtype is None:
        dtype = torch.get_default_dtype()
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.float32, float64, bfloat16 or float16, got {dtype}")
    if device is None:
        device = torch.get_default_device()
    else:
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"device must be a torch.device or a device name, got {device!r}: {exc}") from None
    if device.type not in _DEVICE_TYPES:
        raise ValueError(f"device must be 'cpu' or 'meta' (sparsenn's kernels run on the CPU), got {device}")
    return {"device": device, "dtype": dtype}


def refuse_torchscript(module: torch.nn.Module) -> NoReturn:
    """A layer's ``__prepare_scriptable__``: ``torch.jit.script`` calls it on every
    submodule before compiling, so scripting a model holding the layer raises this
    error instead of TorchScript's on sparsenn's Python."""
    raise TypeError(f"torch.jit.script cannot compile sparsenn.{type(module).__name__}: its forward runs sparsenn's "
                    "compiled sparse kernels from Python, which TorchScript cannot compile. Use torch.compile(model) "
                    "or torch.export.export(model, args) (both trace the kernels as sparsenn's custom ops), or "
                    "torch.jit.trace")


def refuse_onnx_export(module: torch.nn.Module) -> None:
    """RuntimeError while ``torch.onnx.export`` runs (sparsenn's kernels have no ONNX
    equivalent); the traced kernels refuse it too (``compiler/runtime/ops.py``)."""
    if torch.onnx.is_in_onnx_export():
        raise RuntimeError(f"torch.onnx.export cannot export sparsenn.{type(module).__name__}: its compiled sparse "
                           "kernels have no ONNX equivalent. Use torch.export.export(model, args) (the ExportedProgram "
                           "keeps sparsenn's ops, and runs where sparsenn is installed) or torch.compile(model)")
