"""A program: kernel assignments (stages) run one after another, each reading the
caller's operands and earlier stages' results (:mod:`.staging` makes one from an
expression; ``plan/fusion.py`` decides which consecutive stages run as one kernel)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsenn.formats import Format, SparseTensor

from .notation import Assignment

__all__ = ["UserOperand", "StageResult", "Source", "Stage", "Program", "signature", "stage_inputs"]


@dataclass(frozen=True)
class UserOperand:
    """The caller's operand ``n``."""

    n: int


@dataclass(frozen=True)
class StageResult:
    """The result of stage ``stage`` of the same program."""

    stage: int


Source = UserOperand | StageResult


@dataclass(frozen=True)
class Stage:
    """One kernel call: ``assignment`` over ``inputs`` (one per operand), ``out_format``
    as for :func:`sparsenn.einsum`."""

    assignment: Assignment
    out_format: object
    inputs: tuple[Source, ...]


@dataclass(frozen=True)
class Program:
    """Stages in order; the last one's result is the program's. ``names``: per stage,
    the name of the statement whose result it computes (None for a stage inside one)."""

    stages: tuple[Stage, ...]
    names: tuple[str | None, ...] = ()


def signature(operands: Sequence) -> tuple[Format | None, ...]:
    """What staging depends on: each operand's format, None for a tensor."""
    return tuple(op.format if isinstance(op, SparseTensor) else None for op in operands)


def stage_inputs(stage: Stage, operands: Sequence, results: Sequence) -> list:
    """``stage``'s operands: the caller's, or earlier stages' ``results``."""
    return [operands[s.n] if isinstance(s, UserOperand) else results[s.stage] for s in stage.inputs]
