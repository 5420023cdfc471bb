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

__all__ = [
    "SparseTensor",
    "Format",
    "parse_format",
    "from_dense",
    "from_torch",
    "from_scipy",
    "from_edge_index",
    "from_coo",
    "stack",
    "cat",
    "einsum",
    "compile",
    "explain",
    "CompiledExpression",
    "NotationError",
    "KernelBuildError",
    "CompilerNotFoundError",
    "SparseLinear",
    "SparseGCNConv",
    "BlockSparseAttention",
    "SparseMoEGate",
    "SparseMoE",
    "GateOutput",
    "convert",
    "ConversionReport",
    "softmax",
    "log_softmax",
    "precompile",
    "Precompiled",
]

_SUBPACKAGES = ("compiler", "formats", "layers", "functional", "cli")
# Public functions named like the module defining them: importing the module must not
# replace the function as the package's attribute.
_SHADOWED_BY_MODULES = ("convert", "precompile")


def _public_api() -> dict[str, Any]:
    """Every name of ``__all__``, importing the library (and so the compiler, which
    installs SparseTensor's arithmetic)."""
    from sparsenn.compiler import (
        CompiledExpression,
        CompilerNotFoundError,
        KernelBuildError,
        NotationError,
        einsum,
        explain,
    )
    from sparsenn.compiler import compile_expression as compile
    from sparsenn.convert import ConversionReport, convert
    from sparsenn.formats import (
        Format,
        SparseTensor,
        cat,
        from_coo,
        from_dense,
        from_edge_index,
        from_scipy,
        from_torch,
        parse_format,
        stack,
    )
    from sparsenn.functional import log_softmax, softmax
    from sparsenn.layers import (
        BlockSparseAttention,
        GateOutput,
        SparseGCNConv,
        SparseLinear,
        SparseMoE,
        SparseMoEGate,
    )
    from sparsenn.precompile import Precompiled, precompile

    names = locals()
    return {name: names[name] for name in __all__}


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
