"""The backward of a program, itself a program the planner fuses.

Reverse mode through a program's stages (:mod:`.program_autograd`) computes, from the
last stage to the first, ``d(input n of stage k) += dR_k · ∂f_k/∂(input n)``: one
gradient einsum per moving input (:func:`.autograd.gradient_call`). Instead of running
them one by one, :func:`gradient_program` writes them down as the stages of a second
program over the incoming gradients, the forward's operands and saved results and the
gradients' extra inputs (all-ones tensors, patterns), with one stage summing the
contributions to a result that several stages read (``dE = dE_P + dE_Z`` in a softmax).
:func:`~.runtime.programs.run_program` then fuses its consecutive row-wise stages as it
fuses a forward's: a softmax's gradient is one kernel passing over each row.

An operand or result stored in a dense format (its values in storage order, not on a
pattern) has its gradient laid out apart: :func:`gradient_program` returns None, and the
stages' gradients run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor

from .autograd import differentiated, gradient_call
from .frontend.notation import Access, Assignment, Term
from .frontend.program import Program, Source, Stage, StageResult, UserOperand, stage_inputs

__all__ = ["GradientProgram", "gradient_program", "gradient_values"]


@dataclass(frozen=True)
class GradientProgram:
    """A program whose operands are ``inputs`` and whose stage ``outputs[n]`` computes the
    gradient of the caller's operand ``n`` (None: no gradient flows to it)."""

    program: Program
    inputs: tuple
    outputs: tuple[int | None, ...]


class _Builder:
    """The stages and operands of a gradient program as they are written down."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []
        self.inputs: list = []
        self.results: list = []  # per stage: a stand-in with its result's kind, format and pattern
        self._slots: dict[int, int] = {}

    def operand(self, value) -> UserOperand:
        """``value`` as an operand of the program (each object once)."""
        slot = self._slots.get(id(value))
        if slot is None:
            slot = self._slots[id(value)] = len(self.inputs)
            self.inputs.append(value)
        return UserOperand(slot)

    def value(self, source: Source):
        """The input, or the stand-in of the stage result, ``source`` names."""
        return self.inputs[source.n] if isinstance(source, UserOperand) else self.results[source.stage]

    def add(self, assignment: Assignment, out_format, inputs: Sequence[Source], stand_in) -> StageResult:
        self.stages.append(Stage(assignment, out_format, tuple(inputs)))
        self.results.append(stand_in)
        return StageResult(len(self.stages) - 1)

    def total(self, sources: list[Source]) -> Source:
        """One source for the sum of ``sources`` (a stage adding them when there are several)."""
        if len(sources) == 1:
            return sources[0]
        first = self.value(sources[0])
        indices = tuple(f"@{m}" for m in range(len(first.shape)))
        terms = tuple(Term(1.0, (Access(j, indices),)) for j in range(len(sources)))
        names = tuple(f"d{j}" for j in range(len(sources)))
        out_format = first.format if isinstance(first, SparseTensor) else "dense"
        return self.add(Assignment(indices, terms, names), out_format, sources, first)


def gradient_program(program: Program, moving: Sequence[bool], operands: Sequence, results: dict,
                     flowing: dict, needed: Sequence[bool]) -> GradientProgram | None:
    """The gradients of the caller's ``operands`` that are ``needed``, as a program (see
    the module doc): ``results`` the forward's results the gradients read (stage ->
    result), ``flowing`` the incoming gradients (stage -> gradient of its result, laid
    out as the result), ``moving`` per stage whether its result moves with the operands
    needing gradients. None when an operand or result is stored in a dense format."""
    if any(isinstance(x, SparseTensor) and x.format.is_dense for x in (*operands, *results.values())):
        return None
    build = _Builder()
    contributions: dict[Source, list[Source]] = {StageResult(k): [build.operand(g)] for k, g in flowing.items()}
    for k in reversed(range(len(program.stages))):
        sources = contributions.pop(StageResult(k), None)
        if sources is None or not moving[k]:
            continue
        grad_out = build.total(sources)
        step = program.stages[k]
        inputs = stage_inputs(step, operands, results)
        for n in sorted(differentiated(step.assignment)):
            source = step.inputs[n]
            if isinstance(source, UserOperand) and not needed[source.n] or (
                    isinstance(source, StageResult) and not moving[source.stage]):
                continue
            assignment, extras, out_format = gradient_call(step.assignment, n, inputs, build.value(grad_out),
                                                           results[k])
            stand_in = _stand_in(inputs[n], out_format)
            stage_sources = [grad_out] + [_forward(build, s, operands, results) for s in step.inputs]
            stage_sources += [build.operand(extra) for extra in extras]
            made = build.add(assignment, out_format, stage_sources, stand_in)
            contributions.setdefault(source if isinstance(source, StageResult) else UserOperand(source.n),
                                     []).append(made)
    outputs = []
    for n in range(len(operands)):
        sources = contributions.get(UserOperand(n))
        if sources is None:
            outputs.append(None)
            continue
        outputs.append(build.total(sources).stage)  # contributions are stage results
    return GradientProgram(Program(tuple(build.stages)), tuple(build.inputs), tuple(outputs))


def _stand_in(operand, out_format):
    """What the gradient stage of ``operand`` stands for while the program is written:
    values on its pattern (the pattern alone), or a dense tensor (its shape alone)."""
    if isinstance(out_format, Format):
        return operand._share(operand.shape, operand.format, torch.empty(0, dtype=operand.values.dtype))
    dtype = operand.values.dtype if isinstance(operand, SparseTensor) else operand.dtype
    return torch.empty(operand.shape, dtype=dtype, device="meta")


def _forward(build: _Builder, source: Source, operands: Sequence, results: dict) -> UserOperand:
    """A forward stage's input as an operand of the gradient program."""
    return build.operand(operands[source.n] if isinstance(source, UserOperand) else results[source.stage])


def gradient_values(gradient: torch.Tensor | SparseTensor, template: SparseTensor | None) -> torch.Tensor:
    """A computed gradient as autograd takes it for an operand laid out as ``template``
    (None: dense): the values on its pattern, or a dense-format operand's values in
    storage order."""
    if isinstance(gradient, SparseTensor):
        return gradient.values
    if template is not None:
        return gradient.permute(template.format.mode_order).reshape(-1)
    return gradient
