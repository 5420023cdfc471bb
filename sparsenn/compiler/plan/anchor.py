"""Sampled results: the operand whose pattern a result has.

A result whose pattern is exactly a sparse operand's (its *anchor*) is computed as that
operand's values, written in place at its positions: nothing is assembled (SDDMM,
sampled gradients, element-wise products of tensors on one pattern).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsenn.formats import Format

from ..notation import Assignment
from .cost import OperandInfo

__all__ = ["find_anchor"]


def find_anchor(assignment: Assignment, infos: Sequence[OperandInfo], requested: Format | None,
                 output: Format | None) -> int | None:
    """A sparse operand whose pattern is exactly the output's, if any.

    That holds when every term reads the operand at the output's indices and no other
    factor is sparse at an output index (so nothing narrows the pattern further), but
    for operands sharing the anchor's pattern read at the same indices: SDDMM, sampled
    gradients, ``P * (dP - G)`` of a softmax's backward. Values are then written in
    place and nothing is assembled. Only for a sparse ``output``, and when a format is
    ``requested``, an operand of that format."""
    if output is None:
        return None
    out = assignment.output
    formats = [i.format for i in infos]
    patterns = [i.pattern for i in infos]

    def root(operand: int) -> int:
        """The first operand with ``operand``'s index arrays."""
        return operand if patterns[operand] is None else patterns[operand]

    def narrows(factor, anchor: int) -> bool:
        fmt = formats[factor.operand]
        if factor.operand == anchor or fmt is None:
            return False
        if root(factor.operand) == root(anchor) and factor.indices == out:
            return False  # the anchor's own pattern, read at the same positions
        return any(not fmt.mode_level(m).full for m, i in enumerate(factor.indices) if i in out)

    for n, fmt in enumerate(formats):
        if fmt is None or fmt.block is not None or (requested is not None and requested != fmt):
            continue
        if all(
            any(f.operand == n and f.indices == out for f in t.factors) and not any(narrows(f, n) for f in t.factors)
            for t in assignment.terms
        ):
            return n
    return None
