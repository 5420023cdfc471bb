"""The sparse einsum compiler: notation -> format inference -> schedule -> lower ->
C++ -> JIT, behind :func:`einsum`, :func:`compile_expression` and :func:`explain`."""

from .runtime.dispatch import CompiledExpression, compile_expression, einsum, explain
from .backend.jit import CompilerNotFoundError, KernelBuildError
from .notation import NotationError

__all__ = [
    "einsum",
    "compile_expression",
    "explain",
    "CompiledExpression",
    "NotationError",
    "KernelBuildError",
    "CompilerNotFoundError",
]
