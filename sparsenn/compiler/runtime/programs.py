"""Run a program (:mod:`..frontend.program`): its stages grouped into kernels as the planner
decides (:mod:`..plan.fusion`).

The first call of a signature (:func:`validate.call_key` of the program and its
operands) plans each stage as :func:`evaluate` does (through a blocked operand's split
call) on stand-ins of the earlier results, binding its layouts without building its
kernel; :func:`~..plan.fusion.fuse` then groups the stages from those plans, and each
group of several is lowered into one kernel (``lower/fuse.py``) that runs its stages
per team coordinate. A stage over dense operands alone, which runs in torch apart, is
offered to fusion with its planned kernel and both costs (:func:`..plan.fusion.dense_stage`).
Every call runs the groups: a group of one through :func:`evaluate`, a fused group as
the launcher's :class:`~.launcher.FusedLaunch` of its kernel (built through
``planner.build_kernel`` like any other), each stage's operands taken from the results
so far. Recording a program for autograd is
:mod:`..program_autograd`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..frontend.blocks import Split
from ..lower.fuse import FusedStage
from ..backend.precision import compute_dtype
from ..frontend.program import Program, Stage, StageResult, stage_inputs
from ..plan.fusion import Candidate, Fusion, dense_stage, fuse
from ..plan.planner import DENSE, ShapePlan, fused_kernel, operand_infos, plan_call
from ..plan.target import Target
from .cache import GuardedCache
from .evaluate import (DenseCall, DensifiedCall, EpiloguePathCall, PathCall, SampledDenseCall, SplitCall, evaluate,
                       route)
from .launcher import FusedLaunch, Launch, Member, bind
from .validate import call_guard, call_key, check_call

__all__ = ["run_program", "describe_program"]


class _Single:
    """A stage run as its own call."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def run(self, operands: Sequence, results: list) -> None:
        step = self.stage
        results.append(evaluate(step.assignment, stage_inputs(step, operands, results), step.out_format))


class _Runner:
    """A program's groups for one call signature."""

    def __init__(self, units: list, fusion: Fusion):
        self.units, self.fusion = units, fusion

    def run(self, operands: Sequence) -> list:
        results: list = []
        for unit in self.units:
            unit.run(operands, results)
        return results


# A repeated call finds its runner by the guard of its signature (no key built or hashed).
_runners: GuardedCache[_Runner] = GuardedCache("program runners", 256, per_expression=4)


def run_program(program: Program, operands: Sequence, kept: frozenset[int] = frozenset()) -> list:
    """Every stage's result, the stages run in the planner's groups, nothing recorded for
    autograd: those of the last stage and of ``kept`` stages (the others may have been
    overwritten in place)."""
    runner = _runners.find(program, operands, kept)
    if runner is not None:
        return runner.run(operands)
    key = call_key((program, kept), operands, None)
    if key is None:  # operands checked and converted per call: stage by stage
        return _Runner([_Single(stage) for stage in program.stages], Fusion((), ())).run(operands)
    runner = _runners.lookup(program, key)
    if runner is None:
        runner = _planned(program, operands, kept)
        _runners.store(program, key, call_guard(program, operands, kept), runner)
    return runner.run(operands)


def describe_program(program: Program, operands: Sequence, kept: frozenset[int] = frozenset()) -> list[str]:
    """The planner's fusion decisions for these operands, and each fused kernel's C++."""
    runner = _planned(program, operands, kept)
    lines = ["fusion:"] + [f"  {reason}" for reason in runner.fusion.reasons]
    for group, unit in zip(runner.fusion.groups, runner.units):
        if isinstance(unit, FusedLaunch):
            lines.append(f"fused kernel of stages {', '.join(str(k) for k in group)}:")
            lines.append(unit.source)
    return lines


_UNKNOWN = object()  # a result whose layout only running the stage tells


def _planned(program: Program, operands: Sequence, kept: frozenset[int]) -> _Runner:
    """The runner of ``program`` for these operands' signature. Each stage is planned on
    stand-ins of the earlier results, laid out as their kernels write them (nothing
    runs); a result another kind of call computes (torch, a contraction path, an
    assembled sparse result) is known only by running, so stages reading it run apart."""
    results: list = []
    candidates: list[Candidate] = []
    parts: list[tuple[Launch, Split | None] | None] = []
    for k, step in enumerate(program.stages):
        inputs = stage_inputs(step, operands, results)
        name = f"stage {k}" if not program.names or program.names[k] is None else f"{program.names[k]} (stage {k})"
        if any(x is _UNKNOWN for x in inputs):
            candidate, part, result = Candidate(name, None, "reads a result computed apart"), None, _UNKNOWN
        else:
            candidate, part, result = _candidate(step, name, inputs)
            if part is not None and part[0].plan.anchor is not None:
                source = step.inputs[part[0].plan.anchor]
                pattern = candidates[source.stage].pattern if isinstance(source, StageResult) else source
                candidate = replace(candidate, pattern=pattern)
        candidates.append(candidate)
        parts.append(part)
        results.append(result)
    fusion = fuse(candidates, kept)
    units = [_Single(program.stages[group[0]]) if len(group) == 1
             else _fused(program, group, candidates, parts, fusion.into) for group in fusion.groups]
    return _Runner(units, fusion)


def _candidate(step: Stage, name: str, inputs: Sequence) -> tuple[Candidate, tuple | None, object]:
    """The stage over ``inputs`` as fusion sees it, its launch and split, and a stand-in
    of its result (:data:`_UNKNOWN` when only running it tells its layout)."""
    checked = check_call(step.assignment, inputs, step.out_format)
    if checked.dtype not in (torch.float32, torch.float64):
        return Candidate(name, None, f"computes in {checked.dtype} (fused kernels: float32, float64)"), None, _UNKNOWN
    runnable, split = route(step.assignment, checked), None
    if isinstance(runnable, SplitCall):
        split = runnable.split
        checked = check_call(split.assignment, split.operands(checked.operands), split.request)
        runnable = route(split.assignment, checked)
    if isinstance(runnable, SampledDenseCall):  # a stage is planned as its kernel: fusing it may pay more
        runnable = runnable.shaped
    dense = None
    if isinstance(runnable, DenseCall) and checked.request in (None, DENSE) and runnable.assignment.epilogue is None:
        # BLAS when it runs apart; its kernel if the planner fuses it, which pays when that kernel is cheaper
        assignment = runnable.assignment
        dense = dense_stage(assignment, [tuple(op.shape) for op in checked.operands],
                            compute_dtype(checked.dtype).itemsize, Target.current())
        runnable = plan_call(assignment, operand_infos(checked.operands), checked.request, checked.dtype,
                             checked.index_dtype)
    if not isinstance(runnable, ShapePlan):
        return Candidate(name, None, _runs(runnable)), None, _UNKNOWN
    launch = bind(runnable, checked.operands, checked.sizes, checked.dtype, checked.index_dtype, load=False)
    converts = None
    if launch.final_format is not None:
        converts = f"converts its result to {launch.final_format}"
    elif launch.out_dtype != launch.dtype:
        converts = "rounds its result after the kernel"
    reads = tuple(_source(step, slot.operand) for slot in launch.plan.kernel.slots)
    candidate = Candidate(name, launch.plan, "one kernel", tuple(launch.dims), reads, converts, dense=dense)
    return candidate, (launch, split), _stand_in(launch, split, checked.operands)


def _stand_in(launch: Launch, split: Split | None, operands: Sequence) -> object:
    """An uncomputed result laid out as ``launch`` writes it (as :func:`evaluate` returns it)."""
    plan = launch.plan
    if plan.assembles or launch.final_format is not None:
        return _UNKNOWN
    out = torch.empty(launch.allocation, dtype=launch.dtype)
    if plan.anchor is not None:
        pattern = operands[plan.anchor]
        result = pattern._share(pattern.shape, pattern.format, out)
    else:
        result = out if plan.output_permutation is None else out.permute(plan.output_permutation)
    return split.result(result) if split is not None else result


def _runs(runnable: object) -> str:
    """What a stage that is not one kernel runs, for fusion's reasons."""
    if isinstance(runnable, (PathCall, EpiloguePathCall)):
        return "runs as pairwise contractions"
    if isinstance(runnable, DenseCall):
        return "runs in torch (every operand dense)"
    if isinstance(runnable, DensifiedCall):
        return "runs densely (BLAS on a dense copy)"
    return "runs no single kernel"


def _source(step: Stage, operand: int) -> int | None:
    """The stage whose result is ``step``'s operand ``operand``, if one is."""
    source = step.inputs[operand]
    return source.stage if isinstance(source, StageResult) else None


def _fused(program: Program, group: tuple[int, ...], candidates: Sequence[Candidate], parts: Sequence,
           into: Sequence[int | None]) -> FusedLaunch:
    """The kernel running the stages of ``group`` at each team coordinate, as the launcher runs it."""
    stages: list[FusedStage] = []
    members: list[Member] = []
    for k in group:
        launch, split = parts[k]
        plan = launch.plan
        reads = tuple(None if source is None or source not in group else group.index(source)
                      for source in candidates[k].reads)
        kept = tuple(n for n, a in enumerate(plan.arguments) if reads[a.slot] is None or a.kind not in ("val", "dense"))
        local = None if into[k] is None else group.index(into[k])
        stages.append(FusedStage(plan, reads, local))
        members.append(Member(launch, _member_inputs(program.stages[k], split),
                              functools.partial(_member_result, plan.anchor, split), kept, local))
    first = members[0].launch
    what = f"{program.stages[group[0]].assignment} and {len(group) - 1} more fused stage(s)"
    kernel = fused_kernel(stages, first.dtype, first.index_dtype, what)
    return FusedLaunch(members, kernel.load(), kernel.source)


def _member_inputs(stage: Stage, split: Split | None) -> Callable[[Sequence, list], Sequence]:
    """A fused stage's kernel operands from the program's operands and the results so far."""
    if split is None:
        return functools.partial(stage_inputs, stage)
    return lambda operands, results: split.operands(stage_inputs(stage, operands, results))


def _member_result(anchor: int | None, split: Split | None, inputs: Sequence, written: torch.Tensor) -> object:
    """A fused stage's result from the array it writes: the anchor's pattern with those
    values (allocated at its length: no checks), through its split if it has one."""
    result = written
    if anchor is not None:
        pattern = inputs[anchor]
        result = pattern._share(pattern.shape, pattern.format, written)
    return split.result(result) if split is not None else result
