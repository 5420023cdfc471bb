"""A program (:mod:`.frontend.program`) recorded for autograd as one node.

Forward runs the stages in the planner's groups (:func:`.runtime.programs.run_program`),
keeping the results the gradients read. Backward is reverse mode through the stages:
with ``dR_k`` the gradient reaching stage ``k``'s result ``R_k = f_k(inputs)``, from the
last stage to the first,

    d(input n of stage k) += dR_k · ∂f_k/∂(input n)

each product being the compiler's gradient einsum of that stage (reading the stage's
saved result where its derivative is its value): an input is a caller's operand (its
gradient is the node's) or an earlier result (its gradient flows on). Only the stages
whose result moves with an operand that requires grad (:func:`.derivatives.differentiated`:
a factor under ``detach`` does not move it) are differentiated, and only the results
reaching a returned one. Those einsums form a program of their own, which the planner
fuses (:mod:`.gradient_program`); one by one (:func:`.autograd.operand_gradients`) when
an operand or result is stored in a dense format.

Stage by stage instead, each stage its own :func:`.autograd.differentiable_evaluate`:

* under torch.func transforms (``grad``, ``vmap``, ``jvp``: their rules are each call's);
* while traced (each stage is one ``sparsenn::evaluate`` op with its own gradient);
* a program with an epilogue stage: that stage's gradient reads its sum before the
  epilogue, which its kernel does not keep; apart, the epilogue is a second call over
  the saved sum (:func:`.plan.bias.split_epilogue`).

A backward with ``create_graph=True`` (double backward) runs the stages again from the
saved operands, each recorded, and differentiates them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor

from .autograd import _operand, differentiable_evaluate, operand_gradients, recorded
from .derivatives import differentiated, gradient_assignment, reduced_value
from .frontend.functions import factors_of
from .frontend.notation import Access, Assignment, Term
from .frontend.program import Program, Stage, StageResult, UserOperand, stage_inputs
from .gradient_program import Rebuilt, gradient_program, gradient_values, moves, rebuilt_results
from .runtime.evaluate import evaluate
from .runtime.programs import run_program
from .runtime.tracing import tracing, transforming

__all__ = ["run", "run_all"]


def run(program: Program, operands: Sequence):
    """The last stage's result (see :func:`run_all`)."""
    return run_all(program, operands)[-1]


def run_all(program: Program, operands: Sequence, kept: frozenset[int] = frozenset()) -> list:
    """Every stage's result (those of the last stage and of ``kept`` stages; the others
    may have been overwritten in place): the stages in the planner's groups, recorded
    for autograd as one node when a gradient needs them (see the module doc)."""
    if len(program.stages) > 1 and not transforming():
        if not recorded(operands):
            return run_program(program, operands, kept)
        if _one_node(program, operands):
            return _recorded(program, operands, kept)
    return _stagewise(program, operands, kept)


def _stagewise(program: Program, operands: Sequence, kept: frozenset[int] = frozenset()) -> list:
    """Every stage's result, each stage recorded for autograd on its own, except those
    only read under ``detach`` (:func:`_constant_stages`): computed from detached
    operands, with no derivative to define (a softmax's max has none in forward mode)."""
    results: list = []
    constant = _constant_stages(program, kept)
    for k, step in enumerate(program.stages):
        inputs = stage_inputs(step, operands, results)
        if k in constant:
            inputs = [_detached(x) for x in inputs]
        results.append(differentiable_evaluate(evaluate, step.assignment, inputs, step.out_format))
    return results


@functools.lru_cache(maxsize=256)
def _constant_stages(program: Program, kept: frozenset[int]) -> frozenset[int]:
    """The stages, neither the last nor ``kept``, whose results no stage is
    differentiated in (each reads them under ``detach``, or for their patterns only)."""
    read = {step.inputs[n].stage for step in program.stages for n in differentiated(step.assignment)
            if isinstance(step.inputs[n], StageResult)}
    last = len(program.stages) - 1
    return frozenset(k for k in range(last) if k not in read and k not in kept)


def _detached(operand):
    if isinstance(operand, SparseTensor):
        return operand.with_values(operand.values.detach())
    return operand.detach() if isinstance(operand, torch.Tensor) else operand


def _one_node(program: Program, operands: Sequence) -> bool:
    return (not tracing() and all(isinstance(op, (torch.Tensor, SparseTensor)) for op in operands)
            and all(step.assignment.epilogue is None for step in program.stages))


@dataclass(frozen=True)
class _Reverse:
    """What a program's backward runs, for the caller's operands that require grad:
    per stage, whether its result moves with them; the results it reads, kept by the
    forward; those it rebuilds from others (:func:`.gradient_program.rebuilt_results`)."""

    moving: tuple[bool, ...]
    read: frozenset[int]
    rebuilt: dict[int, Rebuilt]
    ties: bool  # a max (or min) a gradient reaches: its gradient counts ties in the call's values


@functools.lru_cache(maxsize=256)
def _reverse(program: Program, needed: tuple[bool, ...], outputs: tuple[int, ...]) -> _Reverse:
    """A stage moves when an input it is differentiated in does. The gradients of a
    moving stage that a gradient reaches read the stage results :func:`_read_by` names,
    except those they can rebuild from the others and ``outputs``; a sparse result read
    for its pattern only is not kept (its pattern is)."""
    moving: list[bool] = []
    for step in program.stages:
        moving.append(any(moves(step.inputs[n], needed, moving) for n in differentiated(step.assignment)))
    reached = set(outputs)
    read: set[int] = set()
    for k in reversed(range(len(program.stages))):
        if k not in reached or not moving[k]:
            continue
        step = program.stages[k]
        wanted = [n for n in differentiated(step.assignment) if moves(step.inputs[n], needed, moving)]
        reached.update(step.inputs[n].stage for n in wanted if isinstance(step.inputs[n], StageResult))
        read |= _read_by(program, k, tuple(wanted))
    rebuilt = rebuilt_results(program, frozenset(read), frozenset(outputs))
    read = (read - set(rebuilt)) | {r.divisor.stage for r in rebuilt.values()}
    ties = any(moving[k] and program.stages[k].assignment.reduction != "sum" for k in reached)
    return _Reverse(tuple(moving), frozenset(read), rebuilt, ties)


def _read_by(program: Program, k: int, wanted: tuple[int, ...]) -> set[int]:
    """The stage results the gradients of stage ``k``'s operands ``wanted`` read: its
    result where a derivative is its value, and its inputs that are earlier results,
    except sparse ones a gradient reads for their stored positions only (or not at
    all). A max's (or min's) reads them all (it compares values with the result)."""
    step = program.stages[k]
    assignment = step.assignment
    earlier = [s.stage for s in step.inputs if isinstance(s, StageResult)]
    if assignment.reduction != "sum":
        return {k, *earlier}
    read = {j for j in earlier if not _sparse(program.stages[j])}
    for n in wanted:
        rank = len(next(a for a in assignment.accesses if a.operand == n).indices)
        gradient, extras = gradient_assignment(assignment, n, rank, False, True)
        if ("result",) in extras:
            read.add(k)
        for term in gradient.terms:
            values = factors_of(reduced_value(term))
            for f, access in enumerate(term.factors):
                source = step.inputs[access.operand - 1] if 1 <= access.operand <= len(step.inputs) else None
                if isinstance(source, StageResult) and f in values and term.coefficient != 0.0:
                    read.add(source.stage)
    return read


def _sparse(step: Stage) -> bool:
    """Whether ``step`` asks for a sparse result (its pattern is kept with the call)."""
    return isinstance(step.out_format, Format) and not step.out_format.is_dense


@dataclass
class _Call:
    """A recorded program call: everything but the tensors autograd tracks."""

    program: Program
    templates: list  # per caller's operand: its SparseTensor, or None if dense
    outputs: tuple[int, ...]  # the stages whose results are the node's outputs
    reverse: _Reverse
    patterns: dict[int, SparseTensor] | None = None  # stage -> its sparse result's pattern (no values)
    counts: dict[int, int] | None = None  # stage -> its sparse result's number of values
    results: list | None = None  # the forward's results, until the caller takes them

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> list:
        return [_operand(tpl, t) for tpl, t in zip(self.templates, tensors)]


def _recorded(program: Program, operands: Sequence, kept: frozenset[int]) -> list:
    templates = [op if isinstance(op, SparseTensor) else None for op in operands]
    tensors = [op.values if isinstance(op, SparseTensor) else op for op in operands]
    outputs = tuple(sorted(kept | {len(program.stages) - 1}))
    reverse = _reverse(program, tuple(t.requires_grad for t in tensors), outputs)
    call = _Call(program, templates, outputs, reverse)
    values = _ProgramFunction.apply(call, *tensors)
    results, call.results = call.results, None  # the node keeps no reference to its outputs
    returned = {k: _operand(call.patterns.get(k), v) for k, v in zip(outputs, values)}
    return [returned.get(k, r) for k, r in enumerate(results)]


class _ProgramFunction(torch.autograd.Function):
    """The program as a function of its dense operands and sparse operands' values (the
    patterns are constants of the call), returning the values of ``call.outputs``."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        results = run_program(call.program, call.rebuild(tensors), call.reverse.read | set(call.outputs))
        call.patterns = {k: _bare(r) for k, r in enumerate(results) if isinstance(r, SparseTensor)}
        call.counts = {k: r.values.shape[0] for k, r in enumerate(results) if isinstance(r, SparseTensor)}
        call.results = results
        values = tuple(_values(results[k]) for k in call.outputs)
        ctx.call = call
        ctx.read = {k: results[k] for k in call.reverse.read if k not in call.outputs}
        ctx.save_for_backward(*tensors, *values)
        ctx.set_materialize_grads(False)
        return values

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        tensors, values = saved[:len(call.templates)], saved[len(call.templates):]
        needed = ctx.needs_input_grad[1:]
        if torch.is_grad_enabled():
            return (None, *_recomputed(call, tensors, grads, needed))
        results = dict(ctx.read)
        results.update((k, _operand(call.patterns.get(k), v)) for k, v in zip(call.outputs, values))
        for k, pattern in call.patterns.items():  # results not kept: rebuilt, or read for their patterns
            if k not in results:
                results[k] = pattern if k in call.reverse.rebuilt else _unread(pattern, call.counts[k])
        return (None, *_backward(call, call.rebuild(tensors), results, dict(zip(call.outputs, grads)), needed))


def _backward(call: _Call, operands: list, results: dict, flowing: dict, needed: Sequence[bool]) -> list:
    """The gradients of the caller's operands given ``flowing`` (stage -> the gradient of
    its result): the gradient program, fused as the planner decides
    (:mod:`.gradient_program`), or else the stages' gradients in reverse, one by one."""
    incoming = {k: _operand(call.patterns.get(k), g.contiguous()) for k, g in flowing.items() if g is not None}
    rebuilt = call.reverse.rebuilt
    backward = gradient_program(call.program, call.reverse.moving, operands, results, incoming, needed, rebuilt,
                                call.reverse.ties)
    if backward is None:
        results.update((k, _rebuilt_value(r, results)) for k, r in rebuilt.items())
        return _stage_by_stage(call, operands, results, flowing, needed)
    outputs = backward.outputs
    computed = run_program(backward.program, backward.inputs, frozenset(o for o in outputs if o is not None))
    return [None if o is None else gradient_values(computed[o], tpl) for o, tpl in zip(outputs, call.templates)]


def _rebuilt_value(rebuilt: Rebuilt, results: dict):
    """The result ``X = R · Y`` that ``rebuilt`` describes, computed."""
    normalised, divisor = results[rebuilt.stage], results[rebuilt.divisor.stage]
    output = tuple(f"i{m}" for m in range(normalised.ndim))
    indices = tuple(output[p] for p in rebuilt.positions)
    term = Term(1.0, (Access(0, output), Access(1, indices)))
    return evaluate(Assignment(output, (term,), ("R", "Y")), [normalised, divisor], normalised.format)


def _stage_by_stage(call: _Call, operands: list, results: dict, flowing: dict, needed: Sequence[bool]) -> list:
    """:func:`_backward`'s gradients, each stage's gradient einsums run in reverse."""
    grads: list = [None] * len(operands)
    moving = call.reverse.moving
    for k in reversed(range(len(call.program.stages))):
        grad = flowing.pop(k, None)
        if grad is None or not moving[k]:
            continue
        step = call.program.stages[k]
        wanted = [n for n in sorted(differentiated(step.assignment)) if moves(step.inputs[n], needed, moving)]
        inputs = stage_inputs(step, operands, results)
        grad_out = _operand(call.patterns.get(k), grad.contiguous())
        computed = operand_gradients(step.assignment, inputs, step.out_format, grad_out, results[k], wanted,
                                     read_result=True)
        for n, g in zip(wanted, computed):
            source = step.inputs[n]
            if isinstance(source, UserOperand):
                grads[source.n] = g if grads[source.n] is None else grads[source.n] + g
            else:
                flowing[source.stage] = g if source.stage not in flowing else flowing[source.stage] + g
    return grads


def _recomputed(call: _Call, tensors: Sequence[torch.Tensor], grads: Sequence, needed: Sequence[bool]) -> list:
    """The gradients as a differentiable graph (``create_graph=True``): the stages run
    again from ``tensors``, each recorded, and differentiated by torch's autograd."""
    results = _stagewise(call.program, call.rebuild(tensors), frozenset(call.outputs))
    pairs = [(_values(results[k]), g) for k, g in zip(call.outputs, grads) if g is not None]
    wanted = [t for t, need in zip(tensors, needed) if need]
    computed = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                        allow_unused=True))
    return [next(computed) if need else None for need in needed]


def _values(result) -> torch.Tensor:
    return result.values if isinstance(result, SparseTensor) else result


def _bare(result: SparseTensor) -> SparseTensor:
    """``result``'s pattern, without its values."""
    return result._share(result.shape, result.format, torch.empty(0, dtype=result.values.dtype))


def _unread(pattern: SparseTensor, count: int) -> SparseTensor:
    """``pattern`` with ``count`` values never written (memory not touched): what a
    gradient reading its stored positions only takes."""
    return pattern._share(pattern.shape, pattern.format, torch.empty(count, dtype=pattern.values.dtype))
