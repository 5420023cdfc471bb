"""sparsenn: sparse deep learning for PyTorch through one sparse einsum compiler.

``import sparsenn`` loads nothing heavy: the public names below (and the subpackages) are
imported on first use, all at once (PEP 562 module ``__getattr__``), so that the ``sparsenn``
command answers ``--help`` without importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# Each public name: the module defining it (and its name there, where it differs).
_ORIGINS: dict[str, tuple[str, str] | str] = {
    "SparseTensor": "sparsenn.formats",
    "Format": "sparsenn.formats",
    "parse_format": "sparsenn.formats",
    "from_dense": "sparsenn.formats",
    "from_torch": "sparsenn.formats",
    "from_scipy": "sparsenn.formats",
    "from_edge_index": "sparsenn.formats",
    "from_coo": "sparsenn.formats",
    "stack": "sparsenn.formats",
    "cat": "sparsenn.formats",
    "einsum": "sparsenn.compiler",
    "compile": ("sparsenn.compiler", "compile_expression"),
    "explain": "sparsenn.compiler",
    "CompiledExpression": "sparsenn.compiler",
    "NotationError": "sparsenn.compiler",
    "KernelBuildError": "sparsenn.compiler",
    "CompilerNotFoundError": "sparsenn.compiler",
    "SparseLinear": "sparsenn.layers",
    "SparseGCNConv": "sparsenn.layers",
    "BlockSparseAttention": "sparsenn.layers",
    "SparseMoEGate": "sparsenn.layers",
    "SparseMoE": "sparsenn.layers",
    "GateOutput": "sparsenn.layers",
    "convert": "sparsenn.convert",
    "ConversionReport": "sparsenn.convert",
    "softmax": "sparsenn.functional",
    "log_softmax": "sparsenn.functional",
    "precompile": "sparsenn.precompile",
    "Precompiled": "sparsenn.precompile",
}

__all__ = list(_ORIGINS)

_SUBPACKAGES = ("compiler", "formats", "layers", "functional", "cli")
# Public functions named like the module defining them: importing the module must not
# replace the function as the package's attribute.
_SHADOWED_BY_MODULES = ("convert", "precompile")


def _public_api() -> dict[str, Any]:
    """Every name of ``__all__``, importing the library (the compiler among it, which
    installs SparseTensor's arithmetic)."""
    api = {}
    for name, origin in _ORIGINS.items():
        module, attribute = origin if isinstance(origin, tuple) else (origin, name)
        api[name] = getattr(importlib.import_module(module), attribute)
    return api


def __getattr__(name: str) -> Any:
    if name in __all__:
        globals().update(_public_api())
        return globals()[name]
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


class _Package(types.ModuleType):
    """The package's module type: keeps ``sparsenn.convert`` and ``sparsenn.precompile``
    the functions when their modules are imported first (the import system sets a loaded
    submodule as an attribute of its package)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED_BY_MODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
