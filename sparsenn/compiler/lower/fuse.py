"""Fused kernels: several planned assignments (stages) run as one kernel that shares
their team loops.

Each stage is a parallel dense-output (or sampled) plan whose nests share their leading
loops among the team (the *team coordinates*, e.g. a softmax's rows or block rows, the
same count in every stage). The fused kernel cuts those coordinates into chunks, and
for each coordinate runs the stages in order::

    for chunk: for c in chunk: stage 0 at c; stage 1 at c; ...

so what stage ``k`` reads of an earlier stage's result at ``c`` was written at ``c``
just before, while it is still in cache. The planner guarantees that: a stage reads an
earlier result only at its own team coordinates, and writes into an earlier result only
one that no later stage reads (:mod:`..plan.fusion` decides both).
A stage reading an earlier result reads that stage's output array itself (one C
variable, so ``__restrict__`` holds); a stage may write its values *into* an earlier
sampled result of the same pattern (in place).

Names: stage ``k``'s locals and extents get the prefix ``st<k>_``, its slots follow
the earlier stages', its extents are ``dims[offset_k + n]``; its output is ``out<k>``, or, written in place,
the array of the stage it writes into (which may itself be another's).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..loops import ir
from ..loops.simplify import simplify
from ..plan.fusion import group_vector_bytes, team_of
from .chunks import EVEN_RANGE_CHUNKS_PER_THREAD, HI, LO, NCHUNKS, chunk_bounds
from .context import Lowering
from .dense_output import lower_dense_output

if TYPE_CHECKING:
    from ..plan.planner import Plan

__all__ = ["FusedStage", "Parameter", "FusedLowering", "lower_fused"]

AT = ir.Var("sn_at")  # the team coordinate every stage runs at
_SHARED = frozenset({"nthreads", AT.name})


@dataclass(frozen=True)
class FusedStage:
    """A stage of a fused kernel: its plan, per slot of ``plan.kernel.slots`` the stage
    whose output that slot's values are (None: an operand's own), and the earlier stage
    whose output array it writes in place (None: its own)."""

    plan: Plan
    reads: tuple[int | None, ...]
    into: int | None = None


@dataclass(frozen=True)
class Parameter:
    """An array parameter of a fused kernel: stage ``stage``'s argument number
    ``argument`` of its plan, or (``argument`` None) its output, as ``array``."""

    array: ir.Array
    stage: int
    argument: int | None


@dataclass(frozen=True)
class FusedLowering:
    """A fused kernel: its statements (``loops``: every stage inline at each team
    coordinate) and its array parameters in order (every operand array a stage reads that
    is not an earlier stage's output, stage by stage, then the outputs of the stages that
    write their own). For printing the stages apart: the extents every stage reads
    (``dims``), each stage's statements at team coordinate ``sn_at`` (``stages``) and
    :meth:`team_loops`. Its vectors (``vector_bytes``) are those of its register-blocked
    stages, else the widest of its stages' (:func:`~..plan.fusion.group_vector_bytes`)."""

    loops: ir.Block
    parameters: tuple[Parameter, ...]
    dims: tuple[ir.Decl, ...]
    stages: tuple[ir.Block, ...]
    extent: ir.Expr  # of the team coordinates
    vector_bytes: int

    def team_loops(self, body: ir.Block) -> ir.Block:
        """The kernel's statements with ``body`` in place of the stages at each team coordinate."""
        return simplify(_team_loops(self.dims, self.extent, body))


def lower_fused(stages: Sequence[FusedStage]) -> FusedLowering:
    """The fused kernel of ``stages`` (see the module doc)."""
    parameters: list[Parameter] = []
    bodies, dims_decls = [], []
    slot_base = dims_base = 0
    homes: list[int] = []  # per stage, the stage whose output array holds its result
    for k, stage in enumerate(stages):
        homes.append(k if stage.into is None else homes[stage.into])
        plan = stage.plan
        lo = Lowering(plan.assignment, plan.schedule, plan.operand_formats)
        lo.team_coordinate = AT
        lo.declare_dims()
        lower_dense_output(lo, plan.anchor)
        assert tuple(lo.slots) == plan.kernel.slots, "a stage lowers to the slots of its plan"
        rename = _renamer(k, stage, homes, slot_base, dims_base)
        if k == 0:  # the team coordinates every stage shares, flattened
            extent = functools.reduce(ir.mul, [rename(lo.dim(i)) for i in team_of(plan)])
        block = _rewritten(lo.take(), rename)
        dims_decls.extend(s for s in block.stmts if isinstance(s, ir.Decl))
        bodies.append(ir.Block(tuple(s for s in block.stmts if not isinstance(s, ir.Decl))))
        parameters += [Parameter(rename(ir.Array(a.kind, a.slot, a.level if a.kind in ("pos", "crd") else -1)), k, n)
                       for n, a in enumerate(plan.arguments)
                       if stage.reads[a.slot] is None or a.kind not in ("val", "dense")]
        slot_base += len(plan.kernel.slots)
        dims_base += len(lo.indices)
    parameters += [Parameter(ir.Array("out", k), k, None) for k, stage in enumerate(stages) if stage.into is None]
    loops = simplify(_team_loops(dims_decls, extent, ir.Block(tuple(bodies))))
    return FusedLowering(loops, tuple(parameters), tuple(dims_decls), tuple(bodies), extent,
                         group_vector_bytes([stage.plan for stage in stages]))


def _team_loops(dims: Sequence[ir.Decl], extent: ir.Expr, body: ir.Block) -> ir.Block:
    """The extents, then a team sharing chunks of the ``extent`` team coordinates, running
    ``body`` at each coordinate ``sn_at``."""
    chunk = ir.Var("sn_chunk")
    per_coordinate = ir.For(ir.Decl(AT, "index", LO), ir.lt(AT, HI), ir.Incr(AT), body)
    chunks = ir.For(ir.Decl(chunk, "index", ir.Const(0)), ir.lt(chunk, NCHUNKS), ir.Incr(chunk),
                    ir.Block((*_bounds(chunk), per_coordinate)), "omp_for")
    extent_decl = ir.Decl(ir.Var("sn_extent"), "index", extent, const=True)
    nchunks = ir.Decl(NCHUNKS, "index", ir.min_(ir.Var("sn_extent"), ir.mul(
        ir.Cast("index", ir.Var("nthreads")), EVEN_RANGE_CHUNKS_PER_THREAD)), const=True)
    return ir.Block((*dims, ir.Parallel(ir.Block((extent_decl, nchunks, chunks)))), scoped=False)


def _bounds(chunk: ir.Var) -> tuple[ir.Stmt, ...]:
    """``sn_lo``/``sn_hi`` of chunk ``chunk``: equal coordinate ranges."""
    builder = _Builder()
    chunk_bounds(builder, chunk, NCHUNKS, None)
    return tuple(builder.statements)


class _Builder:
    """What :func:`chunks.chunk_bounds` emits into, outside a :class:`Lowering`."""

    def __init__(self) -> None:
        self.statements: list[ir.Stmt] = []

    def emit(self, *stmts: ir.Stmt) -> None:
        self.statements.extend(stmts)


def _renamer(k: int, stage: FusedStage, homes: Sequence[int], slot_base: int,
             dims_base: int) -> Callable[[object], object]:
    """Stage ``k``'s names in the fused kernel (see the module doc); ``homes``: per
    stage so far, the stage whose output array holds its result."""
    own_out = ir.Array("out", homes[k])

    def rename(node):
        if isinstance(node, ir.Var):
            return node if node.name in _SHARED else ir.Var(f"st{k}_{node.name}")
        if isinstance(node, ir.Load) and node.array == ir.Array("dims"):
            return ir.Load(node.array, ir.Const(node.index.value + dims_base))
        if isinstance(node, ir.Array):
            if node.kind == "out":
                return own_out
            if node.kind in ("val", "dense") and stage.reads[node.slot] is not None:
                return ir.Array("out", homes[stage.reads[node.slot]])
            if node.slot >= 0:
                return ir.Array(node.kind, node.slot + slot_base, node.level)
        return node

    return rename


def _rewritten(node, rename: Callable[[object], object]):
    """``node`` with ``rename`` applied to every node below it, then to itself."""
    if isinstance(node, tuple):
        return tuple(_rewritten(x, rename) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        if isinstance(node, ir.Load) and node.array == ir.Array("dims"):
            return rename(node)
        changes = {f.name: _rewritten(getattr(node, f.name), rename) for f in dataclasses.fields(node)}
        return rename(dataclasses.replace(node, **changes))
    return node
