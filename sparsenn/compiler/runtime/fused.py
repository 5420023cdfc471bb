"""Steps run as one fused kernel (``lower/fuse.py``): assignments whose later steps read
earlier results, each at the team coordinates that computed it.

``run_steps(steps, operands)`` plans every step as :func:`evaluate` would (through a
blocked operand's split call), allocates the results, and when the steps fuse, runs
them as one kernel; otherwise it returns None and the caller runs them one by one.
Steps fuse when every one is a single planned kernel writing a dense array or values
on an operand's pattern, whose nests share their team loops over the same number of
coordinates (its leading output loops), and every read of an earlier result (and
every write into one) is at those loops: the reader's leading indices of that operand
are its team loops, the result's leading storage levels (dense) are the writer's. An
earlier result is read in place; the caller's operands go through the launch's stages
as in :mod:`.launcher` (a dense operand re-laid out first). What is fused is cached by
the steps and the operands' signature (the :func:`validate.call_key` of the first step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format

from ..backend import abi, jit
from ..backend.codegen import generate_fused_source
from ..blocks import Split
from ..lower.fuse import FusedStage, lower_fused
from ..plan.fusion import team_of
from ..notation import Assignment
from ..plan.planner import Plan, ShapePlan, runs_parallel
from .cache import LRUCache
from .evaluate import SplitCall, evaluate, route
from .launcher import Launch, bind, output_allocator, run_stages
from .validate import Checked, call_key, check_call

__all__ = ["Result", "Step", "run_steps", "evaluate_steps"]


@dataclass(frozen=True)
class Result:
    """Step ``step``'s result, as an operand of a later step."""

    step: int


@dataclass(frozen=True)
class Step:
    """``assignment`` over ``operands`` (the caller's operand ``n``, or an earlier
    step's :class:`Result`); its result is dense, or with ``on``, values on the pattern
    of its operand number ``on``; with ``into``, those values overwrite that earlier
    step's result, of the same pattern, in place."""

    assignment: Assignment
    operands: tuple[int | Result, ...]
    on: int | None = None
    into: int | None = None

    def out_format(self, operands: Sequence) -> str | Format:
        """The ``out_format`` this step is evaluated with, over ``operands`` (its own)."""
        return "dense" if self.on is None else operands[self.on].format


@dataclass(frozen=True)
class _Part:
    """One step as the fused call runs it: its launch, the split it goes through (if
    any) and the kernel arguments it passes (numbers into its launch's pointers)."""

    step: Step
    launch: Launch
    split: Split | None
    kept: tuple[int, ...]


class _Bound:
    """The steps' results over one call's operands, part by part: each step's result
    (allocated), the output arrays by step, each part's argument pointers (all of its
    launch's) and the staged copies they point into (a re-laid-out dense operand)."""

    def __init__(self) -> None:
        self.results: list = []
        self.outputs: dict[int, torch.Tensor] = {}
        self.pointers: list[list[int]] = []
        self.staged: list = []

    def add(self, part: _Part, operands: Sequence) -> None:
        """Bind the next part (the ``k``-th, ``k = len(self.results)``)."""
        k, step, launch = len(self.results), part.step, part.launch
        ops = _step_operands(step, operands, self.results)
        inner = part.split.operands(ops) if part.split is not None else ops
        if step.into is None:
            plan = launch.plan
            self.outputs[k] = output_allocator(plan.assignment.reduction, plan.kernel.overwrites_output)(
                launch.allocation, dtype=launch.dtype)
        else:
            self.outputs[k] = self.outputs[step.into]
        anchor = launch.plan.anchor
        result = self.outputs[k]
        if anchor is not None:  # values of the anchor's length, allocated above: no checks
            pattern = inner[anchor]
            result = pattern._share(pattern.shape, pattern.format, result)
        self.results.append(part.split.result(result) if part.split is not None else result)
        made = run_stages(launch.stages, inner)
        self.staged.append(made)
        self.pointers.append(launch.pointers(inner, made))


class _Fused:
    """The fused kernel of some steps, bound to their operands' signature."""

    def __init__(self, parts: list[_Part], entry: abi.EntryPoints, dims: list[int], parallel: bool,
                 own_outputs: tuple[int, ...]):
        self.parts, self.entry, self.parallel, self.own_outputs = parts, entry, parallel, own_outputs
        self.dims = (ctypes.c_int64 * len(dims))(*dims)
        arguments = sum(len(p.kept) for p in parts) + len(own_outputs)
        self.array_type = ctypes.c_void_p * arguments

    def run(self, operands: Sequence) -> list:
        bound = _Bound()
        for part in self.parts:
            bound.add(part, operands)
        pointers = [every[n] for part, every in zip(self.parts, bound.pointers) for n in part.kept]
        pointers += [bound.outputs[k].data_ptr() for k in self.own_outputs]
        threads = torch.get_num_threads() if self.parallel else 1
        if self.entry.run(self.array_type(*pointers), self.dims, threads, None) != 0:
            raise MemoryError("sparsenn kernel ran out of memory")
        return bound.results  # the staged copies lived in ``bound`` until the kernel had read them


_UNFUSED = object()
_fused: LRUCache[object] = LRUCache("fused steps", 256)


def run_steps(steps: tuple[Step, ...], operands: Sequence) -> list | None:
    """Every step's result by one fused kernel, or None if the steps do not fuse (or a
    torch.func transform runs: its tensors reach kernels through autograd Functions' rules)."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    key = call_key(steps[0].assignment, operands, None)
    if key is None:
        return None
    key = (steps, key)
    fused = _fused.get(key)
    if fused is None:
        fused = _build(steps, operands) or _UNFUSED
        _fused.put(key, fused)
    return None if fused is _UNFUSED else fused.run(operands)


def evaluate_steps(steps: tuple[Step, ...], operands: Sequence) -> list:
    """Every step's result: by one fused kernel when the steps fuse, else one by one
    (each step's values then in memory of its own, ``into`` or not)."""
    fused = run_steps(steps, operands)
    if fused is not None:
        return fused
    results: list = []
    for step in steps:
        ops = _step_operands(step, operands, results)
        results.append(evaluate(step.assignment, ops, step.out_format(ops)))
    return results


def _step_operands(step: Step, operands: Sequence, results: Sequence) -> list:
    """``step``'s operands: the caller's, or earlier steps' ``results``."""
    return [operands[s] if isinstance(s, int) else results[s.step] for s in step.operands]


def _build(steps: tuple[Step, ...], operands: Sequence) -> _Fused | None:
    """The fused call of ``steps`` over these operands, or None if they do not fuse."""
    parts: list[_Part] = []
    stages: list[FusedStage] = []
    bound = _Bound()  # each step's result, for the next steps' planning
    for step in steps:
        ops = _step_operands(step, operands, bound.results)
        checked = check_call(step.assignment, ops, step.out_format(ops))
        if checked.dtype not in (torch.float32, torch.float64):
            return None
        runnable, split = _stage(step.assignment, checked), None
        if isinstance(runnable, SplitCall):
            split = runnable.split
            runnable = _stage(split.assignment, check_call(split.assignment, split.operands(checked.operands),
                                                           split.request))
        if not _plain(runnable):
            return None
        plan = runnable.plan
        reads = tuple(_source(step, slot.operand) for slot in plan.kernel.slots)
        if step.into is not None and (plan.anchor is None or step.operands[plan.anchor] != Result(step.into)):
            return None
        kept = tuple(n for n, a in enumerate(plan.arguments) if reads[a.slot] is None or a.kind not in ("val", "dense"))
        parts.append(_Part(step, runnable, split, kept))
        stages.append(FusedStage(plan, reads, step.into))
        bound.add(parts[-1], operands)
    if not _aligned(stages, parts) or not _reads_outputs(stages, parts, bound):
        return None
    lowered = lower_fused(stages)
    vector_bytes = max(stage.plan.kernel.vector_bytes for stage in stages)
    source = generate_fused_source(lowered, str(parts[0].launch.dtype).removeprefix("torch."),
                                   str(parts[0].launch.index_dtype).removeprefix("torch."), vector_bytes)
    what = f"{steps[0].assignment} and {len(steps) - 1} more fused step{'s' if len(steps) > 2 else ''}"
    entry = abi.bind(jit.load_library(source, "fused_einsum", what), assembles_sparse_output=False)
    dims = [d for part in parts for d in part.launch.dims]
    own = tuple(k for k, step in enumerate(steps) if step.into is None)
    return _Fused(parts, entry, dims, any(runs_parallel(p.launch.plan.schedule) for p in parts), own)


def _stage(assignment: Assignment, checked: Checked) -> object:
    """What a checked call runs, as :func:`evaluate.resolve` finds it, except that a
    kernel's launch is bound without building the kernel: the fused kernel runs instead."""
    routed = route(assignment, checked)
    if isinstance(routed, ShapePlan):
        return bind(routed, checked.operands, checked.sizes, checked.dtype, checked.index_dtype, load=False)
    return routed


def _aligned(stages: Sequence[FusedStage], parts: Sequence[_Part]) -> bool:
    """Whether the stages share their team coordinates and read (and write) earlier
    results only at their own (see the module doc)."""
    teams = [team_of(stage.plan) for stage in stages]
    extents = {tuple(part.launch.dims[part.launch.plan.kernel.indices.index(i)] for i in team)
               for part, team in zip(parts, teams)}
    if len(extents) != 1 or len({stage.plan.kernel.vector_bytes for stage in stages if _blocked(stage.plan)}) > 1:
        return False
    for stage, team in zip(stages, teams):
        plan = stage.plan
        for slot, source in zip(plan.kernel.slots, stage.reads):
            if source is None:
                continue
            if not _leads(plan, slot.operand, team) or not _written_at_team(stages[source].plan, teams[source]):
                return False
        if stage.into is not None and not _leads(plan, plan.anchor, team):
            return False
    return True


def _blocked(plan: Plan) -> bool:
    """Whether ``plan`` has a register block, sized for its vector width; the loops of
    other plans work at any width (the fused kernel takes the widest)."""
    return any(nest.register_block is not None for nest in plan.schedule.nests)


def _leads(plan: Plan, operand: int, team: tuple[str, ...]) -> bool:
    """Whether every read of ``operand`` in ``plan`` has the team loops as its leading
    indices in the order it is stored (a sparse operand: over dense levels)."""
    slots = [slot for slot in plan.kernel.slots if slot.operand == operand]
    for slot in slots:
        for term in plan.assignment.terms:
            for access in term.factors:
                if access.operand != operand:
                    continue
                if slot.fmt is None:
                    order = [access.indices[m] for m in (slot.layout or range(len(access.indices)))]
                else:
                    order = [access.indices[m] for m in slot.fmt.mode_order]
                    if not all(level.locatable for level in slot.fmt.levels[:len(team)]):
                        return False
                if tuple(order[:len(team)]) != team:
                    return False
    return bool(slots)


def _written_at_team(plan: Plan, team: tuple[str, ...]) -> bool:
    """Whether ``plan``'s result is laid out with its team loops leading."""
    if plan.anchor is None:
        return tuple(plan.schedule.output_order[:len(team)]) == team
    return _leads(plan, plan.anchor, team)


def _reads_outputs(stages: Sequence[FusedStage], parts: Sequence[_Part], bound: _Bound) -> bool:
    """Whether each stage's arguments that the fused kernel replaces by an earlier
    output point at that output (no copy was made on the way)."""
    for stage, part, every in zip(stages, parts, bound.pointers):
        for n, argument in enumerate(part.launch.plan.arguments):
            source = stage.reads[argument.slot]
            if source is not None and argument.kind in ("val", "dense") and every[n] != bound.outputs[source].data_ptr():
                return False
    return True


def _source(step: Step, operand: int) -> int | None:
    """The step whose result is ``step``'s operand ``operand``, if one is."""
    source = step.operands[operand]
    return source.step if isinstance(source, Result) else None


def _plain(runnable: object) -> bool:
    """Whether ``runnable`` is one kernel a fused kernel can run as a stage: a launch
    writing a dense array (or values on an operand's pattern) in its own dtype, laid
    out in the expression's order, every nest parallel over the same team loops, no
    epilogue, and the sparse operands that have team indices storing them first, over
    dense levels."""
    if not isinstance(runnable, Launch):
        return False
    plan = runnable.plan
    team = team_of(plan)
    return (plan.kernel.dense_output and runnable.final_format is None
            and (plan.output_permutation is None or plan.anchor is not None) and runnable.out_dtype == runnable.dtype
            and plan.assignment.epilogue is None and team is not None
            and all(_leads(plan, slot.operand, team) for slot in plan.kernel.slots if slot.fmt is not None
                    and _touches(plan, slot.operand, team)))


def _touches(plan: Plan, operand: int, team: tuple[str, ...]) -> bool:
    """Whether some read of ``operand`` in ``plan`` has a team index."""
    return any(access.operand == operand and set(access.indices) & set(team)
               for term in plan.assignment.terms for access in term.factors)
