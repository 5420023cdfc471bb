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

Backward, on ``S``'s pattern, programs too: ``G[r] = sum[j](dP[r,j] * P[r,j]);
dS<P>[r,j] = P[r,j] * (dP[r,j] - G[r])`` for softmax (fused per row) and
``G[r] = sum[j](dL[r,j]); dS<L>[r,j] = dL[r,j] - exp(L[r,j]) * G[r]`` for log-softmax.
While traced, each program is one ``sparsenn::evaluate`` op. A slice with no stored
entry stays empty (its ``M`` is ``-inf`` and ``Z`` is 0, but no kernel reads them there).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

from sparsenn.compiler import CompiledExpression, compile_expression
from sparsenn.compiler.batching import batched_format
from sparsenn.compiler.runtime.tracing import tracing
from sparsenn.formats import SparseTensor

__all__ = ["softmax", "log_softmax", "softmax_program", "softmax_gradient"]


@dataclass(frozen=True)
class _Programs:
    """Softmax's programs along one mode of tensors of one rank (operands in the order
    written)."""

    softmax: CompiledExpression            # (S) -> P
    log_softmax: CompiledExpression        # (S) -> L
    softmax_grad: CompiledExpression       # (dP, P) -> dS
    log_softmax_grad: CompiledExpression   # (dL, L) -> dS
    log_softmax_tangent: CompiledExpression  # (dS, L) -> dL = dS - sum_j exp(L) dS


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


@functools.lru_cache(maxsize=None)
def _programs(rank: int, dim: int) -> _Programs:
    full, rows, j = _indices(rank, dim)
    return _Programs(
        softmax=compile_expression(softmax_program(rank, dim)),
        log_softmax=compile_expression(
            f"M[{rows}] = max[{j}](S[{full}]); Z[{rows}] = sum[{j}](exp(S[{full}] - detach(M[{rows}]))); "
            f"W[{rows}] = log(Z[{rows}]); L<S>[{full}] = S[{full}] - detach(M[{rows}]) - W[{rows}]"),
        softmax_grad=compile_expression(
            f"G[{rows}] = sum[{j}](dP[{full}] * P[{full}]); dS<P>[{full}] = P[{full}] * (dP[{full}] - G[{rows}])"),
        log_softmax_grad=compile_expression(
            f"G[{rows}] = sum[{j}](dL[{full}]); dS<L>[{full}] = dL[{full}] - exp(L[{full}]) * G[{rows}]"),
        log_softmax_tangent=compile_expression(
            f"G[{rows}] = sum[{j}](T[{full}] * exp(L[{full}])); dL<L>[{full}] = T[{full}] - G[{rows}]"),
    )


class _Softmax(torch.autograd.Function):
    """``values`` of ``pattern`` -> values of softmax (or log-softmax) along ``dim``, with
    torch.func's ``vmap`` rule: the batched values as a dense level below ``pattern``'s,
    softmax along ``dim + 1`` (one call; a blocked or n:m pattern runs once per batch
    element). Traced by torch.compile as it is; eagerly, :class:`_SoftmaxWithJvp`."""

    @staticmethod
    def forward(values: torch.Tensor, pattern: SparseTensor, dim: int, log: bool) -> torch.Tensor:
        programs = _programs(pattern.ndim, dim)
        return (programs.log_softmax if log else programs.softmax)(_on_pattern(pattern, values)).values

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, pattern, dim, log = inputs
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)
        ctx.pattern, ctx.dim, ctx.log = pattern, dim, log

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        if not ctx.log:
            return softmax_gradient(ctx.pattern, ctx.dim, out, grad), None, None, None
        d_out, result = _on_pattern(ctx.pattern, grad.contiguous()), _on_pattern(ctx.pattern, out)
        return _programs(ctx.pattern.ndim, ctx.dim).log_softmax_grad(d_out, result).values, None, None, None

    @staticmethod
    def vmap(info, in_dims, values: torch.Tensor, pattern: SparseTensor, dim: int, log: bool):
        fmt = batched_format(pattern.format)
        if fmt is None:
            function = _softmax_function()
            out = [function.apply(values.select(in_dims[0], k), pattern, dim, log) for k in range(info.batch_size)]
            return torch.stack(out), 0
        batched = SparseTensor((info.batch_size, *pattern.shape), fmt, pattern.pos + (None,), pattern.crd + (None,),
                               values.movedim(in_dims[0], -1).contiguous().reshape(-1), check=False,
                               index_dtype=pattern.index_dtype)
        return _softmax_function().apply(batched.values, batched, dim + 1, log).view(-1, info.batch_size), 1


class _SoftmaxWithJvp(_Softmax):
    """:class:`_Softmax` with forward mode (``jvp``, ``jacfwd``), which torch.compile
    cannot trace: softmax's Jacobian is symmetric, so its tangent is its gradient's
    expression; log-softmax's is ``dL = dS - sum_j P dS`` with ``P = exp(L)``."""

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_):
        (out,) = ctx.saved_tensors
        pattern, dim = ctx.pattern, ctx.dim
        if not ctx.log:
            return softmax_gradient(pattern, dim, out, tangent)
        d_in, result = _on_pattern(pattern, tangent.contiguous()), _on_pattern(pattern, out)
        return _programs(pattern.ndim, dim).log_softmax_tangent(d_in, result).values


def _softmax_function() -> type[_Softmax]:
    return _Softmax if tracing() else _SoftmaxWithJvp


def softmax_gradient(pattern: SparseTensor, dim: int, probabilities: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``dS = P * (dP - sum_j dP * P)`` along ``dim``: the values on ``pattern`` of the
    gradient of ``P = softmax(S)`` (values ``probabilities``) given ``dP`` (``grad``)."""
    d_out, result = _on_pattern(pattern, grad.contiguous()), _on_pattern(pattern, probabilities)
    return _programs(pattern.ndim, dim).softmax_grad(d_out, result).values


def _on_pattern(pattern: SparseTensor, values: torch.Tensor) -> SparseTensor:
    """``values`` on ``pattern``: ``_share``, not ``with_values``, as a traced backward may
    not inspect tensors as with_values' checks do."""
    return pattern._share(pattern.shape, pattern.format, values)


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
    return S.with_values(_softmax_function().apply(S.values, S, d, False))


def log_softmax(S: SparseTensor, dim: int = -1) -> SparseTensor:
    """``L = S - max - log(sum exp(S - max))`` along ``dim`` over ``S``'s stored entries
    (as ``torch.sparse.log_softmax``), on ``S``'s pattern. Differentiable with respect
    to ``S.values``."""
    d = _normalised_dim(S, dim, "log_softmax")
    return S.with_values(_softmax_function().apply(S.values, S, d, True))
