"""Which functions compute ``SparseTensor``'s operators (``+``, ``-``, ``*``, ``@``) and
reductions (``sum``).

Storage does not compute: the sparse einsum compiler (a layer above ``formats``)
supplies the operations when it is imported (``import sparsenn`` and any use of its
API, or ``import sparsenn.compiler``), through
:func:`install_arithmetic`. ``formats`` never imports the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Arithmetic", "install_arithmetic", "arithmetic"]

Binary = Callable[[object, object], object]


@dataclass(frozen=True)
class Arithmetic:
    """``add(a, b) = a + b``, ``subtract(a, b) = a - b``, ``multiply(a, b) = a * b``
    (elementwise, or scaling by a number), ``matmul(a, b) = a @ b`` and
    ``einsum(equation, *operands, out_format=None)``, the compiler's einsum (None until
    installed)."""

    add: Binary
    subtract: Binary
    multiply: Binary
    matmul: Binary
    einsum: Callable[..., Any] | None = None


_installed: list[Arithmetic] = []


def install_arithmetic(operations: Arithmetic) -> None:
    """Make ``operations`` compute SparseTensor's operators (replacing any earlier ones)."""
    if not isinstance(operations, Arithmetic):
        raise TypeError(f"expected an Arithmetic, got {type(operations).__name__}")
    _installed[:] = [operations]


def arithmetic(need_einsum: bool = False) -> Arithmetic:
    """The installed operations; RuntimeError if none were installed (or, with
    ``need_einsum``, none with an einsum)."""
    if not _installed or (need_einsum and _installed[0].einsum is None):
        raise RuntimeError(
            "SparseTensor arithmetic (+, -, *, @) is computed by the sparse einsum compiler (sum too), which "
            "installs it when it is imported; none is installed (import sparsenn.compiler first)"
        )
    return _installed[0]
