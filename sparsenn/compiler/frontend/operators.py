"""Arithmetic on ``SparseTensor`` through the compiler: ``+``, ``-``, ``*``, ``@``.

Each operator is an index-notation expression (``C[a,b] = A[a,b] + B[a,b]``,
``einsum("ij,jk->ik")``), so its kernel, output format and schedule come from the
same pipeline as every other expression. ``SparseTensor``'s operators call them through
:data:`ARITHMETIC`, which the compiler installs into ``formats`` when it is imported
(storage never imports the compiler).
"""

from __future__ import annotations

from functools import lru_cache
from numbers import Number

import torch

from sparsenn.formats import SparseTensor
from sparsenn.formats.arithmetic import Arithmetic

from ..api import CompiledExpression, compile_expression, einsum

__all__ = ["add", "subtract", "multiply", "matmul", "ARITHMETIC"]

_LETTERS = "abcdefgh"


@lru_cache(maxsize=None)
def _elementwise(rank: int, op: str) -> CompiledExpression:
    idx = ",".join(_LETTERS[:rank])
    return compile_expression(f"C[{idx}] = A[{idx}] {op} B[{idx}]")


def _check_operand(x, name: str) -> None:
    if not isinstance(x, (SparseTensor, torch.Tensor)):
        raise TypeError(f"{name} must be a SparseTensor or torch.Tensor, got {type(x).__name__}")


def _same_shape(a, b, op: str) -> None:
    _check_operand(a, "left operand")
    _check_operand(b, "right operand")
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(
            f"{op} needs operands of the same shape, got {tuple(a.shape)} and {tuple(b.shape)} "
            "(sparsenn does not broadcast)"
        )


def add(a, b):
    """``a + b``: union of the patterns (sparse + sparse stays sparse)."""
    _same_shape(a, b, "+")
    return _elementwise(len(a.shape), "+")(a, b)


def subtract(a, b):
    _same_shape(a, b, "-")
    return _elementwise(len(a.shape), "-")(a, b)


def multiply(a, b):
    """Elementwise product (intersection of the patterns), or scaling by a number."""
    if isinstance(b, Number) and not isinstance(b, bool):
        return a.with_values(a.values * b)
    _same_shape(a, b, "*")
    return _elementwise(len(a.shape), "*")(a, b)


_MATMUL = {(2, 2): "ij,jk->ik", (2, 1): "ij,j->i", (1, 2): "j,jk->k", (1, 1): "i,i->",
           (3, 3): "bij,bjk->bik"}


def matmul(a, b):
    """``a @ b`` for vectors, matrices and equally batched rank-3 tensors."""
    _check_operand(a, "left operand")
    _check_operand(b, "right operand")
    equation = _MATMUL.get((len(a.shape), len(b.shape)))
    if equation is None:
        raise ValueError(f"@ is not supported between shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return einsum(equation, a, b)


ARITHMETIC = Arithmetic(add=add, subtract=subtract, multiply=multiply, matmul=matmul)
