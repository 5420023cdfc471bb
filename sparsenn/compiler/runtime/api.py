"""The public entry points: :func:`einsum`, :func:`compile_expression`, :func:`explain`
and :func:`plan`. Each parses its expression (equations are cached), records the call
for autograd when gradients are needed (``compiler.autograd``) and evaluates it
(:mod:`runtime.evaluate`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from sparsenn.formats import SparseTensor

from ..autograd import differentiable_evaluate
from ..equation import broadcast_size_one, normalise
from ..notation import Assignment, parse_einsum, parse_expression
from ..plan.planner import Plan, operand_infos, plan_call
from ..plan.schedule import Schedule
from .cache import LRUCache
from .evaluate import evaluate, split_of
from .validate import Checked, check_call, describe_operand

__all__ = ["einsum", "compile_expression", "explain", "plan", "parse", "describe_schedule", "CompiledExpression"]

_equations: LRUCache[Assignment] = LRUCache("equations", 1024)


def parse(equation: str, num_operands: int) -> Assignment:
    """``parse_einsum(equation, num_operands)``, cached."""
    key = (equation, num_operands)
    assignment = _equations.get(key)
    if assignment is None:
        assignment = parse_einsum(equation, num_operands)
        _equations.put(key, assignment)
    return assignment


def einsum(equation: str, *operands, out_format=None):
    """Einstein summation over dense ``torch.Tensor`` and :class:`SparseTensor` operands.

    The result is a dense ``torch.Tensor`` or a :class:`SparseTensor`, decided by the
    operands' formats and ``out_format`` alone (never by their values or number of
    nonzeros): ``None`` infers the format per output mode (a product is sparse where a
    factor is, a sum where every term is; A·Aᵀ-like products of sparse operands are
    sparse), ``"dense"`` asks for a tensor, a format name or :class:`Format` for that
    format, and ``"auto"`` infers, then returns a tensor when the inferred sparse result
    is estimated to be at least 1/8 full (a result type that depends on the data).
    The equation follows torch.einsum's grammar (see :mod:`sparsenn.compiler.equation`).
    """
    equation, operands = normalise(equation, operands)
    try:
        return differentiable_evaluate(evaluate, parse(equation, len(operands)), operands, out_format)
    except ValueError:
        broadcast = broadcast_size_one(equation, operands)  # sizes 1 that torch broadcasts
        if broadcast is None:
            raise
    equation, operands = broadcast
    return differentiable_evaluate(evaluate, parse(equation, len(operands)), operands, out_format)


class CompiledExpression:
    """A parsed sum-of-products expression, callable on operands (positional in order
    of first appearance, or by name)."""

    def __init__(self, text: str, out_format=None):
        self.assignment = parse_expression(text)
        self.out_format = out_format
        self.text = text

    @property
    def operand_names(self) -> tuple[str, ...]:
        return self.assignment.operand_names

    def _bind(self, args, kwargs) -> list:
        names = self.assignment.operand_names
        if len(args) > len(names):
            raise TypeError(f"{self.text!r} takes {len(names)} operands, got {len(args)}")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{self.text!r} has no operand named {name!r}")
            if name in bound:
                raise TypeError(f"operand {name!r} given twice")
            bound[name] = value
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{self.text!r} is missing operand(s) {missing}")
        return [bound[n] for n in names]

    def __call__(self, *args, **kwargs):
        return differentiable_evaluate(evaluate, self.assignment, self._bind(args, kwargs), self.out_format)

    def explain(self, *args, **kwargs) -> str:
        return _explain(self.assignment, self._bind(args, kwargs), self.out_format)

    def __repr__(self) -> str:
        return f"CompiledExpression({self.text!r})"


def compile_expression(text: str, out_format=None) -> CompiledExpression:
    """Compile ``"D[i,j] = A[i,k] * B[k,j] + C[i,j]"`` into a callable."""
    return CompiledExpression(text, out_format)


def plan(equation: str, *operands, out_format=None) -> Plan:
    """The plan (schedule, generated source) ``einsum`` would run, with these operands'
    schedule; for tools and tests."""
    assignment = parse(equation, len(operands))
    checked = check_call(assignment, operands, out_format)
    split = split_of(assignment, checked)
    if split is not None:
        checked = check_call(split.assignment, split.operands(checked.operands), split.request)
        assignment = split.assignment
    if checked.all_dense:
        raise ValueError("all operands are dense: the expression runs in torch.einsum, not a plan")
    return _plan(assignment, checked)


def _plan(assignment: Assignment, checked: Checked) -> Plan:
    """The plan of a checked call with sparse operands, carrying this call's schedule."""
    infos = operand_infos(checked.operands)
    shaped = plan_call(assignment, infos, checked.request, checked.dtype, checked.index_dtype)
    return replace(shaped.plan, schedule=shaped.schedule)


def explain(equation: str, *operands, out_format=None) -> str:
    """The parsed notation, output format, loop orders with reasons, workspace, tiles
    and generated C++ for ``einsum(equation, *operands)``."""
    equation, operands = normalise(equation, operands)
    return _explain(parse(equation, len(operands)), operands, out_format)


def _explain(assignment: Assignment, operands: Sequence, out_format) -> str:
    checked = check_call(assignment, operands, out_format)
    lines = [f"expression: {assignment}"]
    for n, op in enumerate(checked.operands):
        if isinstance(op, SparseTensor):
            desc = f"{op.format} {tuple(op.shape)} nnz={op.nnz}"
        else:
            desc = f"dense {tuple(op.shape)}"
        lines.append(f"  {describe_operand(assignment, n)}: {desc}")
    split = split_of(assignment, checked)
    if split is not None:
        lines.append(split.describe())
        return "\n".join(lines + [_explain(split.assignment, split.operands(checked.operands), split.request)])
    if checked.all_dense:
        lines.append("all operands dense: dispatched to torch.einsum")
        return "\n".join(lines)
    shown = _plan(assignment, checked)
    lines.append(f"output format: {'dense' if shown.output_format is None else shown.output_format}")
    if shown.anchor is not None:
        lines.append(
            f"output pattern: that of {describe_operand(assignment, shown.anchor)} (every term samples it); "
            "values are written at its positions, nothing is assembled"
        )
    lines += describe_schedule(shown.schedule)
    lines.append("generated C++:")
    lines.append(shown.source)
    return "\n".join(lines)


def describe_schedule(s: Schedule) -> list[str]:
    """The schedule's decisions and the reasons for them, one line each."""
    lines = s.describe().splitlines()
    lines.append("why:")
    lines += [f"  {r}" for r in s.reasons]
    return lines
