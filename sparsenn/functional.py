"""Softmax and log-softmax over the stored entries of a SparseTensor, forward and
backward as compiled kernels.

Along mode ``d``, with ``r`` the other indices and ``j`` the index of ``d``, over the
entries of ``S`` that are stored (unstored ones count as ``-inf``, as in
``torch.sparse.softmax``):

* ``M[r] = max_j S[r,j]``  (no gradient: the result does not depend on the shift);
* ``Z[r] = sum_j exp(S[r,j] - M[r])``;
* softmax: ``P[r,j] = exp(S[r,j] - M[r]) * (1 / Z[r])`` on ``S``'s pattern (a division per
  row, not per entry). When the steps fuse (``compiler/runtime/fused.py``: ``S``'s rows,
  or block rows, lead its storage over dense levels), one kernel computes per row
  ``M``, then ``E = exp(S - M)`` into ``P``'s values, ``Z = sum_j E`` and ``P = E * (1 / Z)``
  in place: ``exp`` once, ``S`` read once from memory. Otherwise three kernels compute
  ``M``, ``Z`` and ``P``, evaluating ``exp`` twice (cheaper than writing ``E`` to memory
  and reading it back);
* log-softmax: ``L[r,j] = (S[r,j] - M[r]) - log Z[r]`` (``S - M`` first: exact near the
  max however large ``|S|`` is).

Backward, on ``S``'s pattern: ``dS = P * (dP - sum_j dP * P)`` for softmax (the two
steps fused per row when they fuse) and ``dS = dL - exp(L) * sum_j dL`` for
log-softmax; the sums are compiled sum-reductions, the element-wise products sampled
assignments. While traced, the fused steps are one ``sparsenn::evaluate`` op each way
(run one by one inside it when they do not fuse), as eager mode runs them. A slice with
no stored entry stays empty (its ``M`` is ``-inf`` and ``Z`` is 0, but no kernel reads
them there).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

from sparsenn.compiler.autograd import differentiable_evaluate, recorded
from sparsenn.compiler.batching import batched_format
from sparsenn.compiler.functions import apply
from sparsenn.compiler.notation import Access, Assignment, Constant, Factor, Term
from sparsenn.compiler.runtime.evaluate import evaluate
from sparsenn.compiler.runtime.fused import Result, Step, run_steps
from sparsenn.compiler.runtime.ops import register_kernels, traced_evaluate, tracing, transforming
from sparsenn.formats import SparseTensor

__all__ = ["softmax", "log_softmax", "softmax_steps", "softmax_gradient"]


@dataclass(frozen=True)
class _Kernels:
    """The assignments of one (rank, dim); pattern operands are read at every index,
    row vectors (``M``, ``Z``, ``R = 1 / Z``, ``log Z``, ``G``) at every index but ``dim``'s."""

    max: Assignment               # M = max_j S
    sum_exp: Assignment           # Z = sum_j exp(S - M)
    softmax: Assignment           # P = exp(S - M) * R with R = 1 / Z, on S's pattern
    exp_shifted: Assignment       # E = exp(S - M), on S's pattern
    normalised: Assignment        # P = E * (1 / Z), on E's pattern
    row_sum: Assignment           # sum_j X
    shift: Assignment             # L = (S - M) - log Z, on the pattern
    dot: Assignment               # G = sum_j dP * P
    softmax_grad: Assignment      # dS = P * (dP - G), on the pattern
    log_softmax_grad: Assignment  # dS = dL - exp(L) * G, on the pattern


@functools.lru_cache(maxsize=None)
def _kernels(rank: int, dim: int) -> _Kernels:
    full = tuple(f"i{m}" for m in range(rank))
    rows = full[:dim] + full[dim + 1:]
    x, y, row1, row2 = Access(0, full), Access(1, full), Access(1, rows), Access(2, rows)

    def assignment(output, factors, value, names, reduction="sum"):
        return Assignment(output, (Term(1.0, factors, value),), names, reduction)

    f0, f1, f2 = Factor(0), Factor(1), Factor(2)
    exp_shifted = apply("exp", apply("sub", f0, f1))
    return _Kernels(
        max=assignment(rows, (x,), f0, ("S",), "max"),
        sum_exp=assignment(rows, (x, row1), exp_shifted, ("S", "M")),
        softmax=assignment(full, (x, row1, row2), apply("mul", exp_shifted, f2), ("S", "M", "R")),
        exp_shifted=assignment(full, (x, row1), exp_shifted, ("S", "M")),
        normalised=assignment(full, (x, row1), apply("mul", f0, apply("div", Constant(1.0), f1)), ("E", "Z")),
        row_sum=assignment(rows, (x,), None, ("X",)),
        shift=assignment(full, (x, row1, row2), apply("sub", apply("sub", f0, f1), f2), ("S", "M", "logZ")),
        dot=assignment(rows, (x, y), None, ("dP", "P")),
        softmax_grad=assignment(full, (x, y, row2), apply("mul", f1, apply("sub", f0, f2)), ("dP", "P", "G")),
        log_softmax_grad=assignment(full, (x, y, row2), apply("sub", f0, apply("mul", apply("exp", f1), f2)),
                                    ("dL", "L", "G")),
    )


def _kernel(rank: int, dim: int, name: str) -> Assignment | tuple[Step, ...]:
    """A kernel of softmax along ``dim`` of rank-``rank`` tensors, or the fused steps
    ``"forward"`` and ``"backward"``."""
    if name == "forward":
        return softmax_steps(rank, dim)
    if name == "backward":
        return _fused_softmax_grad(rank, dim)
    return getattr(_kernels(rank, dim), name)


register_kernels("softmax", _kernel)


@functools.lru_cache(maxsize=None)
def softmax_steps(rank: int, dim: int, scores: Step | None = None) -> tuple[Step, ...]:
    """Softmax along ``dim`` of rank-``rank`` tensors as the steps of one fused kernel:
    ``M``, ``E = exp(S - M)``, ``Z = sum_j E``, ``P = E * (1 / Z)`` written over ``E``.
    ``S`` is the caller's operand 0, or the result of the step ``scores`` (values on an
    operand's pattern), which then comes first and whose values ``E`` overwrites."""
    k = _kernels(rank, dim)
    head = () if scores is None else (scores,)
    s = 0 if scores is None else Result(0)
    m, e, z = (Result(len(head) + n) for n in range(3))
    return head + (Step(k.max, (s,)), Step(k.exp_shifted, (s, m), on=0, into=None if scores is None else 0),
                   Step(k.row_sum, (e,)), Step(k.normalised, (e, z), on=0, into=e.step))


@functools.lru_cache(maxsize=None)
def _fused_softmax_grad(rank: int, dim: int) -> tuple[Step, ...]:
    """Softmax's backward as the steps of one fused kernel: ``G = sum_j dP * P``, then
    ``dS = P * (dP - G)``, row by row."""
    k = _kernels(rank, dim)
    return Step(k.dot, (0, 1)), Step(k.softmax_grad, (0, 1, Result(0)), on=0)


def _steps(name: str, pattern: SparseTensor, dim: int, operands: list) -> torch.Tensor | None:
    """The values of the last of the fused steps ``name``, or None when they do not fuse
    (always a traced ``sparsenn::evaluate`` op while traced: it runs them one by one then)
    or autograd records them (a backward with ``create_graph=True``: the steps then run
    one by one, each differentiable)."""
    if tracing():
        return traced_evaluate(None, operands, None, ("kernel", "softmax", pattern.ndim, dim, name)).values
    if recorded(operands):
        return None
    results = run_steps(_kernel(pattern.ndim, dim, name), operands)
    return None if results is None else results[-1].values


def _run(kernel: str, pattern: SparseTensor, dim: int, operands: list, out_format) -> torch.Tensor | SparseTensor:
    """Kernel ``kernel`` of softmax along ``dim`` of tensors shaped like ``pattern``; while
    traced, a ``sparsenn::evaluate`` op naming it (``compiler/runtime/ops.py``); under a
    torch.func transform, through the einsum's rules (a backward's operands are the
    transform's tensors)."""
    if tracing():
        return traced_evaluate(None, operands, out_format, ("kernel", "softmax", pattern.ndim, dim, kernel))
    if transforming() or recorded(operands):
        return differentiable_evaluate(evaluate, _kernel(pattern.ndim, dim, kernel), operands, out_format)
    return evaluate(_kernel(pattern.ndim, dim, kernel), operands, out_format)


def _sampled(kernel: str, pattern: SparseTensor, dim: int, operands: list) -> torch.Tensor:
    """Values of kernel ``kernel`` on ``pattern``'s stored positions, in storage order."""
    return _run(kernel, pattern, dim, operands, pattern.format).values


class _Softmax(torch.autograd.Function):
    """``values`` of ``pattern`` -> values of softmax (or log-softmax) along ``dim``, with
    torch.func's ``vmap`` rule: the batched values as a dense level below ``pattern``'s,
    softmax along ``dim + 1`` (one call; a blocked or n:m pattern runs once per batch
    element). Traced by torch.compile as it is; eagerly, :class:`_SoftmaxWithJvp`."""

    @staticmethod
    def forward(values: torch.Tensor, pattern: SparseTensor, dim: int, log: bool) -> torch.Tensor:
        s = _on_pattern(pattern, values)
        out = None if log else _steps("forward", s, dim, [s])
        if out is None:
            m = _run("max", s, dim, [s], "dense")
            z = _run("sum_exp", s, dim, [s, m], "dense")
            if log:
                out = _sampled("shift", s, dim, [s, m, torch.log(z)])
            else:
                out = _sampled("softmax", s, dim, [s, m, torch.reciprocal(z)])
        return out

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
        pattern, dim = ctx.pattern, ctx.dim
        d_out, result = _on_pattern(pattern, grad.contiguous()), _on_pattern(pattern, out)
        g = _run("row_sum", pattern, dim, [d_out], "dense")
        return _sampled("log_softmax_grad", pattern, dim, [d_out, result, g]), None, None, None

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
        d_in, probabilities = _on_pattern(pattern, tangent.contiguous()), _on_pattern(pattern, torch.exp(out))
        g = _run("dot", pattern, dim, [d_in, probabilities], "dense")
        return _sampled("shift", pattern, dim, [d_in, g, torch.zeros_like(g)])


def _softmax_function() -> type[_Softmax]:
    return _Softmax if tracing() else _SoftmaxWithJvp


def softmax_gradient(pattern: SparseTensor, dim: int, probabilities: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``dS = P * (dP - sum_j dP * P)`` along ``dim``: the values on ``pattern`` of the
    gradient of ``P = softmax(S)`` (values ``probabilities``) given ``dP`` (``grad``)."""
    d_out, result = _on_pattern(pattern, grad.contiguous()), _on_pattern(pattern, probabilities)
    d_values = _steps("backward", pattern, dim, [d_out, result])
    if d_values is None:
        g = _run("dot", pattern, dim, [d_out, result], "dense")
        d_values = _sampled("softmax_grad", pattern, dim, [d_out, result, g])
    return d_values


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
