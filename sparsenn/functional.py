"""Softmax and log-softmax over the stored entries of a SparseTensor, forward and
backward as compiled programs (index notation, ``sparsenn.compile``).

Along mode ``d``, with ``r`` the other indices and ``j`` the index of ``d``, over the
entries of ``S`` that are stored (unstored ones count as ``-inf``, as in
``torch.sparse.softmax``)::

    softmax:      M[r] = max[j](S[r,j]); E<S>[r,j] = exp(S[r,j] - detach(M[r]))
                  Z[r] = sum[j](E[r,j]); P<E>[r,j] = E[r,j] * (1 / Z[r])
    log-softmax:  M[r] = max[j](S[r,j]); Z[r] = sum[j](exp(S[r,j] - detach(M[r])))
                  W[r] = log(Z[r]); L<S>[r,j] = S[r,j] - detach(M[r]) - W[r]

(``detach(M)``: the result does not depend on the shift, so ``M`` needs no gradient and
a program's gradient never differentiates the max; ``S - M`` first keeps
log-softmax exact near the max however large ``|S|`` is; one division, one log per row). The
planner fuses the statements when ``S``'s rows (or block rows) lead its storage over
dense levels (``compiler/plan/fusion.py``): one kernel computes per row ``M``, ``E``,
``Z`` and ``P`` while the row is in cache.

Backward: the programs' gradients (``compiler/program_autograd.py``), programs too, fused
per row as well. Softmax's reads ``P``, not ``E``: ``E = P · Z`` is rebuilt
(``compiler/gradient_program.py``), so the forward keeps ``P`` and ``Z`` only, and
``dS = (dP / Z + dZ) · P · Z`` with ``dZ = -(1/Z)² · Z · sum[j](dP · P)``. While traced,
each statement is one ``sparsenn::evaluate`` op. A slice with no stored entry stays
empty (its ``M`` is ``-inf`` and ``Z`` is 0, but no kernel reads them there).
"""

from __future__ import annotations

import operator

import torch

from sparsenn.compiler import CompiledExpression, compile_expression, compiled_once
from sparsenn.formats import SparseTensor

__all__ = ["softmax", "log_softmax", "softmax_program"]


def softmax_program(rank: int, dim: int, scores: str = "") -> str:
    """Softmax along ``dim`` of rank-``rank`` ``S`` as statements, its result ``P``;
    ``scores``: a statement computing ``S`` first (statements use ``M``, ``E``, ``Z``)."""
    full, rows, j = _indices(rank, dim)
    scores = f"{scores}; " if scores else ""
    return (f"{scores}M[{rows}] = max[{j}](S[{full}]); E<S>[{full}] = exp(S[{full}] - detach(M[{rows}])); "
            f"Z[{rows}] = sum[{j}](E[{full}]); P<E>[{full}] = E[{full}] * (1 / Z[{rows}])")


def _indices(rank: int, dim: int) -> tuple[str, str, str]:
    """(every index, every index but ``dim``'s, ``dim``'s index), comma-separated."""
    full = [f"i{m}" for m in range(rank)]
    return ",".join(full), ",".join(full[:dim] + full[dim + 1:]), full[dim]


@compiled_once
def _softmax(rank: int, dim: int) -> CompiledExpression:
    return compile_expression(softmax_program(rank, dim))


@compiled_once
def _log_softmax(rank: int, dim: int) -> CompiledExpression:
    full, rows, j = _indices(rank, dim)
    return compile_expression(
        f"M[{rows}] = max[{j}](S[{full}]); Z[{rows}] = sum[{j}](exp(S[{full}] - detach(M[{rows}]))); "
        f"W[{rows}] = log(Z[{rows}]); L<S>[{full}] = S[{full}] - detach(M[{rows}]) - W[{rows}]")


def _normalised_dim(S: object, dim: object, name: str) -> int:
    """``dim`` of the SparseTensor ``S`` as a non-negative int; TypeError/ValueError otherwise."""
    if not isinstance(S, SparseTensor):
        if isinstance(S, torch.Tensor) and S.layout == torch.strided:
            raise TypeError(f"sparsenn.{name} takes a SparseTensor; for a dense tensor use torch.{name} "
                            f"(or convert it with sparsenn.from_dense)")
        if isinstance(S, torch.Tensor):
            raise TypeError(f"sparsenn.{name} takes a SparseTensor; convert the torch {S.layout} tensor with "
                            f"sparsenn.from_torch, or use torch.sparse.{name}")
        raise TypeError(f"sparsenn.{name} takes a SparseTensor, got {type(S).__name__}")
    if isinstance(dim, bool):
        raise TypeError(f"sparsenn.{name}: dim must be an int, got bool")
    try:
        d = operator.index(dim)
    except TypeError:
        raise TypeError(f"sparsenn.{name}: dim must be an int, got {type(dim).__name__}") from None
    if not -S.ndim <= d < S.ndim:
        raise ValueError(f"sparsenn.{name}: dim {d} is out of range for a rank-{S.ndim} tensor "
                         f"(expected {-S.ndim} <= dim < {S.ndim})")
    return d % S.ndim


def softmax(S: SparseTensor, dim: int = -1) -> SparseTensor:
    """``P = exp(S - max) / sum exp(S - max)`` along ``dim`` over ``S``'s stored entries
    (unstored entries are ``-inf``, as ``torch.sparse.softmax``), on ``S``'s pattern.
    Differentiable with respect to ``S.values``."""
    d = _normalised_dim(S, dim, "softmax")
    return S.with_values(_softmax(S.ndim, d)(S).values)


def log_softmax(S: SparseTensor, dim: int = -1) -> SparseTensor:
    """``L = S - max - log(sum exp(S - max))`` along ``dim`` over ``S``'s stored entries
    (as ``torch.sparse.log_softmax``), on ``S``'s pattern. Differentiable with respect
    to ``S.values``."""
    d = _normalised_dim(S, dim, "log_softmax")
    return S.with_values(_log_softmax(S.ndim, d)(S).values)
