"""Lowering entry point: a scheduled assignment to a kernel's loop IR.

``lower`` builds the IR of the dense- or sampled-output nests (:mod:`.dense_output`)
or of a sparse output's loops and assembly (:mod:`.sparse_output`), simplifies it
(:mod:`..loops.simplify`) and prints it once (:mod:`..backend.c`); the
:class:`LoweredKernel` keeps both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsenn.formats import Format

from ..backend.c import print_block
from ..loops import ir
from ..loops.simplify import simplify
from ..frontend.notation import Assignment
from ..plan.schedule import Schedule
from .context import Lowering, Slot
from .dense_output import lower_dense_output
from .sparse_output import lower_sparse_output

__all__ = ["Slot", "LoweredKernel", "lower"]


@dataclass(frozen=True)
class LoweredKernel:
    """A kernel: its statements as IR (``loops``) and printed (``body``, the
    statements of ``sn_run``'s try-block), the slots and index variables it reads, and
    the machine parameters its runtime helpers are built for. A two-phase sparse output
    (see :class:`~..plan.decisions.OutputAssembly`) has a second phase, run by
    ``sn_finish``: ``fill_loops``, printed as ``fill``."""

    body: str
    slots: tuple[Slot, ...]
    indices: tuple[str, ...]  # index variables, in the order of the dims array
    dense_output: bool
    fill: str | None = None
    # The kernel stores every element of its dense output (or every anchor value) once,
    # with ``=``: the caller may pass uninitialised memory.
    overwrites_output: bool = False
    loops: ir.Block | None = None
    vector_bytes: int = 32  # the Target's SIMD width, which the runtime header is built for
    fill_loops: ir.Block | None = None


def lower(
    assignment: Assignment, sched: Schedule, formats: Sequence[Format | None], anchor: int | None = None,
) -> LoweredKernel:
    """The kernel computing ``assignment`` per ``sched``.

    With ``anchor``, the output has the pattern of that sparse operand (which every
    term reads at the output's indices): the kernel writes values at the anchor's
    positions into a dense values array, and no output assembly is needed."""
    if sched.output_format is not None:
        return _sparse_output(assignment, sched, formats)
    lo = Lowering(assignment, sched, formats)
    lo.declare_dims()
    overwrites = lower_dense_output(lo, anchor)
    loops = simplify(lo.take())
    return LoweredKernel(print_block(loops), tuple(lo.slots), lo.indices, True, None, overwrites, loops, sched.target.vector_bytes)


def _sparse_output(assignment: Assignment, sched: Schedule, formats: Sequence[Format | None]) -> LoweredKernel:
    """The kernel assembling a sparse output, with its second phase if it has one."""
    def phase(second: bool) -> Lowering:
        lo = Lowering(assignment, sched, formats)
        lo.declare_dims()
        lower_sparse_output(lo, second)
        return lo

    lo = phase(False)
    loops, fill = simplify(lo.take()), None
    if sched.assembly.two_phase:
        second = phase(True)
        assert second.slots == lo.slots, "both phases read the operands through the same slots"
        fill = simplify(second.take())
    return LoweredKernel(print_block(loops), tuple(lo.slots), lo.indices, False, fill and print_block(fill),
                         loops=loops, vector_bytes=sched.target.vector_bytes, fill_loops=fill)
