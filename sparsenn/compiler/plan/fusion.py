"""Fusion: which consecutive stages of a program run as one kernel, and why the others
do not.

A fused kernel (``lower/fuse.py``) cuts the *team coordinates* that every stage's nests
share (their leading parallel loops: a softmax's rows, an attention's block rows) into
chunks, and runs every stage at each coordinate in turn::

    for c in team coordinates: stage a at c; stage b at c; ...

so a stage reads what an earlier stage of its group wrote at ``c`` while it is in cache.
That is exact when, for every stage of the group,

* it is one planned kernel writing a dense array (or values on an operand's pattern) in
  its own dtype, laid out in the expression's order, every nest parallel over the
  same team loops, an epilogue (``relu(... + b)``) run on each slice below them, its sparse operands with team indices storing
  those first over locatable levels;
* its team loops have the group's extents (and a register-blocked stage the group's
  vector width: the group is compiled at its register-blocked stages' width, else at
  its widest, :func:`group_vector_bytes`);
* it reads an earlier result of its group only at its own team coordinates (that
  operand's leading indices in storage order are the team loops, and the writer lays
  its result out with its team loops leading), and in place: a dense result in the
  writer's layout, a result on a pattern in the format it is stored in.

:func:`fuse` groups the stages greedily from the first, from their plans and extents
alone (nothing is bound), and says for each boundary why it is one. Inside a group, a
stage writing values on a pattern writes them *into* an earlier stage's array of the
same pattern when that result is dead after it (no later stage reads it and the caller
does not keep it), the stage reads it at most where it writes, and its kernel stores
every value (softmax's ``E`` over the scores ``S``, ``P`` over ``E``): one array of
values instead of three, written once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..frontend.notation import Assignment
from .dense_path import dense_product_cycles
from .target import Target

if TYPE_CHECKING:
    from .planner import Plan

__all__ = ["Candidate", "DenseStage", "Fusion", "dense_stage", "fuse", "group_vector_bytes", "team_of"]


@dataclass(frozen=True)
class DenseStage:
    """A sum of products over dense operands that runs in BLAS when apart, with the
    cycles of each way: BLAS apart (its call included), and its planned kernel inside a
    fused group (its operands from cache)."""

    blas_cycles: float
    kernel_cycles: float

    def pays(self) -> bool:
        return self.kernel_cycles < self.blas_cycles


def dense_stage(assignment: Assignment, shapes: Sequence[tuple[int, ...]], itemsize: int,
                target: Target) -> DenseStage:
    r"""The costs of a dense product stage (see :class:`DenseStage`), in cycles.

    BLAS: :func:`.dense_path.dense_product_cycles` scaled by the lanes a
    narrow output row leaves idle in the micro-kernel's widest vectors (a row of
    :math:`n` outputs fills :math:`n / (L \lceil n / L \rceil)` of them), plus the
    target's ``python_call_cycles``. The fused kernel: its flops at the same efficiency
    over the kernel's vectors, reading what an earlier stage of the group has just
    written from cache (no bandwidth term)."""
    sizes = {i: shapes[a.operand][m] for t in assignment.terms for a in t.factors for m, i in enumerate(a.indices)}
    flops = sum(2 * math.prod(sizes[i] for i in term.indices) for term in assignment.terms)
    row = sizes[assignment.output[-1]] if assignment.output else 1
    widest = max(target.widest_vector_bytes // itemsize, 1)
    idle = widest * math.ceil(row / widest) / max(row, 1)
    blas = dense_product_cycles(assignment, shapes, itemsize, target) * idle + target.python_call_cycles
    kernel = flops / (2 * target.lanes(itemsize) * target.fma_per_cycle * target.gemm_efficiency)
    return DenseStage(blas, kernel)


@dataclass(frozen=True)
class Candidate:
    """A stage as fusion sees it: ``plan`` (None when it runs no single kernel:
    ``runs`` says what it runs; a dense product, ``dense``, has both a plan and BLAS), ``dims`` the extents of its kernel's indices, per slot
    of its kernel the earlier stage whose result the slot reads (``reads``), and whether
    the kernel's output is converted after it runs (a requested format, a 16-bit
    dtype: ``converts``)."""

    name: str
    plan: Plan | None
    runs: str
    dims: tuple[int, ...] = ()
    reads: tuple[int | None, ...] = ()
    converts: str | None = None
    pattern: object = None  # what identifies the pattern its values are on (None: dense)
    dense: DenseStage | None = None  # a dense product that runs in BLAS when apart


@dataclass(frozen=True)
class Fusion:
    """Consecutive stage numbers per kernel (a group of one runs as its own call), per
    boundary between groups, or inside one, a line saying why, and per stage the earlier
    stage of its group whose array it writes into (None: its own)."""

    groups: tuple[tuple[int, ...], ...]
    reasons: tuple[str, ...]
    into: tuple[int | None, ...] = ()


def team_of(plan: Plan) -> tuple[str, ...] | None:
    """The team loops every nest of ``plan`` shares, or None if they differ or a nest is
    not parallel."""
    teams = {nest.order[:nest.team_loops] if nest.parallel else None for nest in plan.schedule.nests}
    return teams.pop() if len(teams) == 1 else None


def fuse(stages: Sequence[Candidate], kept: frozenset[int] = frozenset()) -> Fusion:
    """The stages grouped into kernels (see the module doc); ``kept``: the stages whose
    results the caller keeps (the last one's always)."""
    groups: list[list[int]] = []
    reasons: list[str] = []
    alone = [_alone(stage) for stage in stages]
    for k, stage in enumerate(stages):
        if not groups:
            groups.append([k])
            continue
        group = groups[-1]
        why = alone[group[0]] or alone[k] or _joins(stages, group, k)
        if why is None:
            team = ", ".join(team_of(stage.plan))
            reasons.append(f"{stage.name} fused with {stages[k - 1].name}: one pass over the shared loops ({team})")
            group.append(k)
        else:
            reasons.append(f"{stage.name} not fused with {stages[k - 1].name}: {why}")
            groups.append([k])
    kept = kept | {len(stages) - 1}
    into: list[int | None] = [None] * len(stages)
    for group in groups:
        for k in group[1:]:
            into[k] = _written_into(stages, group, k, kept, into)
            if into[k] is not None:
                reasons.append(f"{stages[k].name} writes into the array of {stages[into[k]].name}, dead after it")
    return Fusion(tuple(tuple(g) for g in groups), tuple(reasons), tuple(into))


def _written_into(stages: Sequence[Candidate], group: Sequence[int], k: int, kept: frozenset[int],
                  into: Sequence[int | None]) -> int | None:
    """The latest earlier stage of ``group`` whose array stage ``k`` can overwrite (see
    the module doc), or None."""
    plan = stages[k].plan
    if plan.anchor is None or not plan.kernel.overwrites_output or stages[k].pattern is None:
        return None
    homes: dict[int, int] = {}  # stage -> the stage whose array holds its values
    for m in group:
        if m < k:
            homes[m] = m if into[m] is None else homes[into[m]]
    latest = {home: m for m, home in homes.items()}  # array -> the stage whose values it holds now
    for j in reversed([m for m in group if m < k]):
        if j in kept or latest[homes[j]] != j or stages[j].pattern != stages[k].pattern:
            continue
        if any(j in stages[m].reads for m in range(k + 1, len(stages))):
            continue
        reads_j = [slot.operand for slot, source in zip(plan.kernel.slots, stages[k].reads) if source == j]
        if all(access.indices == plan.assignment.output for term in plan.assignment.terms
               for access in term.factors if access.operand in reads_j):
            return j
    return None


def _alone(stage: Candidate) -> str | None:
    """Why ``stage`` cannot be a stage of a fused kernel, or None."""
    plan, name = stage.plan, stage.name
    if plan is None:
        return f"{name} {stage.runs}"
    if stage.dense is not None and not stage.dense.pays():
        return (f"{name} runs in torch: BLAS ({stage.dense.blas_cycles:.3g} cycles) is cheaper than its kernel "
                f"({stage.dense.kernel_cycles:.3g})")
    if stage.converts is not None:
        return f"{name} {stage.converts}"
    if not plan.kernel.dense_output:
        return f"{name} assembles a sparse result"
    if plan.output_permutation is not None and plan.anchor is None:
        return f"{name} writes its result in another order than its indices'"
    team = team_of(plan)
    if team is None:
        return f"{name}'s loop nests do not share parallel outer loops"
    if any(nest.packed_block is not None for nest in plan.schedule.nests):
        return f"{name} packs a factor once per chunk of its parallel loop, not per coordinate"
    if plan.assignment.epilogue is not None and not _epilogue_per_coordinate(plan, team):
        return f"{name} has an epilogue run after its loops, not per coordinate of {', '.join(team)}"
    for slot in plan.kernel.slots:
        if slot.fmt is not None and _touches(plan, slot.operand, team) and not _leads(plan, slot.operand, team):
            return (f"{name} reads a sparse operand whose stored order does not start with its outer loops "
                    f"({', '.join(team)})")
    return None


def _epilogue_per_coordinate(plan: Plan, team: tuple[str, ...]) -> bool:
    """Whether ``plan``'s one nest runs its epilogue on each slice it finishes below its
    team loops (so each team coordinate's outputs are final when its stage returns)."""
    nests = plan.schedule.nests
    return len(nests) == 1 and nests[0].epilogue_at is not None and nests[0].epilogue_at >= len(team)


def _joins(stages: Sequence[Candidate], group: Sequence[int], k: int) -> str | None:
    """Why stage ``k`` cannot join ``group`` (its stages fuse), or None."""
    stage, first = stages[k], stages[group[0]]
    team, lead = team_of(stage.plan), team_of(first.plan)
    if _extents(stage, team) != _extents(first, lead):
        return (f"its outer loops ({', '.join(team)}) run over {_extents(stage, team)} coordinates, the group's "
                f"over {_extents(first, lead)}")
    widths = {stages[j].plan.kernel.vector_bytes for j in (*group, k) if _blocked(stages[j].plan)}
    if len(widths) > 1:
        return "its register blocks are sized for another vector width"
    plan = stage.plan
    for slot, source in zip(plan.kernel.slots, stage.reads):
        if source is None or source not in group:
            continue
        writer = stages[source].plan
        if not _leads(plan, slot.operand, team) or not _written_at_team(writer, team_of(writer)):
            return f"it reads {stages[source].name} at other coordinates than its outer loops ({', '.join(team)})"
        if not _in_place(plan, slot, writer):
            return f"it reads {stages[source].name} re-laid out (another storage order or format)"
    return None


def _extents(stage: Candidate, team: tuple[str, ...]) -> tuple[int, ...]:
    indices = stage.plan.kernel.indices
    return tuple(stage.dims[indices.index(i)] for i in team)


def _blocked(plan: Plan) -> bool:
    """Whether ``plan`` has a register block, sized for its vector width; the loops of
    other plans work at any width."""
    return any(nest.register_block is not None for nest in plan.schedule.nests)


def group_vector_bytes(plans: Sequence[Plan]) -> int:
    """The vector width a fused group of ``plans`` is compiled at: that of its
    register-blocked plans (one width, :func:`_joins`), else the widest: a block of 4
    float lanes planned for 16-byte vectors (SpMM over rows of 16 bytes) stays 4 lanes
    beside stages planned for wider ones."""
    blocked = {plan.kernel.vector_bytes for plan in plans if _blocked(plan)}
    return blocked.pop() if blocked else max(plan.kernel.vector_bytes for plan in plans)


def _orders(plan: Plan, operand: int, slot) -> list[list[str]]:
    """The indices of each read of ``operand`` in ``plan``, in the order ``slot`` stores them."""
    orders = []
    for term in plan.assignment.terms:
        for access in term.factors:
            if access.operand == operand:
                modes = (slot.layout or range(len(access.indices))) if slot.fmt is None else slot.fmt.mode_order
                orders.append([access.indices[m] for m in modes])
    return orders


def _leads(plan: Plan, operand: int, team: tuple[str, ...]) -> bool:
    """Whether every read of ``operand`` in ``plan`` has the team loops as its leading
    indices in the order it is stored (a sparse operand: over locatable levels)."""
    slots = [slot for slot in plan.kernel.slots if slot.operand == operand]
    for slot in slots:
        if slot.fmt is not None and not all(level.locatable for level in slot.fmt.levels[:len(team)]):
            return False
        if any(tuple(order[:len(team)]) != team for order in _orders(plan, operand, slot)):
            return False
    return bool(slots)


def _written_at_team(plan: Plan, team: tuple[str, ...]) -> bool:
    """Whether ``plan``'s result is laid out with its team loops leading."""
    if plan.anchor is None:
        return tuple(plan.schedule.output_order[:len(team)]) == team
    return _leads(plan, plan.anchor, team)


def _in_place(reader: Plan, slot, writer: Plan) -> bool:
    """Whether ``reader``'s ``slot`` reads ``writer``'s result as it is stored: a dense
    result in the writer's memory order, one on a pattern in its format, unpanelled."""
    if writer.anchor is not None:
        return slot.fmt is not None and slot.fmt == writer.output_format
    if slot.fmt is not None or slot.panel is not None:
        return False
    stored = [writer.assignment.output.index(i) for i in writer.schedule.output_order]
    return list(slot.layout or range(len(stored))) == stored


def _touches(plan: Plan, operand: int, team: tuple[str, ...]) -> bool:
    """Whether some read of ``operand`` in ``plan`` has a team index."""
    return any(access.operand == operand and set(access.indices) & set(team)
               for term in plan.assignment.terms for access in term.factors)
