"""Sampled results: the operand whose pattern a result has.

A result whose pattern is exactly a sparse operand's (its *anchor*) is computed as that
operand's values, written in place at its positions: nothing is assembled (SDDMM,
sampled gradients, element-wise products of tensors on one pattern).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsenn.formats import Format

from ..frontend.notation import Assignment
from .cost import OperandInfo
from .infer import result_format

__all__ = ["find_anchor", "sampled_operand"]


def find_anchor(assignment: Assignment, infos: Sequence[OperandInfo], requested: Format | None,
                 output: Format | None) -> int | None:
    """A sparse operand whose pattern is exactly the output's, if any.

    That holds when every term reads the operand at the output's indices and no other
    factor is sparse at an output index (so nothing narrows the pattern further), but
    for operands sharing the anchor's pattern read at the same indices: SDDMM, sampled
    gradients, ``P * (dP - G)`` of a softmax's backward. Values are then written in
    place and nothing is assembled. Only for a sparse ``output``, and when a format is
    ``requested``, an operand of that format."""
    return _anchor(assignment, [i.format for i in infos], [i.pattern for i in infos], requested, output, False)


def sampled_operand(assignment: Assignment, formats: Sequence[Format | None], patterns: Sequence[int | None],
                    request: Format | str | None) -> int | None:
    """:func:`find_anchor` from the operands' formats and the output request alone, as a
    traced call decides it before any data exists: the output the planner starts from is
    dense for ``"dense"``, the requested format, or the one inferred from the formats
    (``"auto"`` included: its fill is known only when the call runs). A blocked operand
    may anchor: the call runs over split indices (:mod:`..frontend.blocks`), where the
    planner sees it unblocked, its outer levels deciding as here."""
    if request == "dense":
        return None
    requested = request if isinstance(request, Format) else None
    output = request if requested is not None else result_format(assignment, list(formats))
    return _anchor(assignment, formats, patterns, requested, output, True)


def _anchor(assignment: Assignment, formats: Sequence[Format | None], patterns: Sequence[int | None],
            requested: Format | None, output: Format | None, blocked: bool) -> int | None:
    if output is None:
        return None
    out = assignment.output

    def root(operand: int) -> int:
        """The first operand with ``operand``'s index arrays."""
        return operand if patterns[operand] is None else patterns[operand]

    def narrows(factor, anchor: int) -> bool:
        fmt = formats[factor.operand]
        if factor.operand == anchor or fmt is None:
            return False
        if root(factor.operand) == root(anchor) and factor.indices == out:
            return False  # the anchor's own pattern, read at the same positions
        return any(not fmt.mode_full(m) for m, i in enumerate(factor.indices) if i in out)

    for n, fmt in enumerate(formats):
        if fmt is None or (fmt.block is not None and not blocked) or (requested is not None and requested != fmt):
            continue
        if all(
            any(f.operand == n and f.indices == out for f in t.factors) and not any(narrows(f, n) for f in t.factors)
            for t in assignment.terms
        ):
            return n
    return None
