"""The dense path of a sampled product: BLAS computes the whole product, then it is
sampled at the result's pattern, when the cost model says that beats the sampled kernel.

A sampled product ``G<W>[o, i] = Σ_b dY[b, o] X[b, i]`` (SDDMM; a weight's gradient)
computes one dot product per stored entry of ``W``. Its kernel does ``nnz / (o i)`` of
the dense product's multiply-adds, but each entry is a dot product of its own, at a
fraction of a BLAS micro-kernel's rate (a register tile reuses each load for a tile of
entries; the sampled kernel's loads serve one entry each). At moderate sparsity and on
dense-ish patterns (an ``nm(2,4)`` weight's gradient: half the entries, about 1.7x
slower than the whole GEMM on a Zen 3) the whole product by BLAS and a pass reading it
at the stored positions are faster; at high sparsity the sampled kernel is. Both are
costed in cycles on the :class:`~.target.Target`:

* the sampled kernel: its schedule's cost in cycles, scaled from the fill it was planned
  for to the pattern's, or, when more, the time to stream its operands and write one
  value per stored entry (:func:`~.dense_path.stream_cycles`), plus copying dense
  operands into its loop order (:func:`~.dense_path.relayout_cycles`);
* the dense path: the product of the multiplied factors by BLAS
  (:func:`~.dense_path.dense_product_cycles`), reading it at the ``nnz`` stored
  positions (:func:`~.dense_path.sampling_cycles`), and ``python_call_cycles`` for
  each of the BLAS call and the sampling call made from Python (both paths launch one
  kernel: the sampled one, or the sampling).

It applies to a sum of products whose result is anchored (written at a sparse
operand's positions, :mod:`.anchor`), every multiplied factor dense and every other
factor read for its positions only (the pattern as a mask), whose whole dense product
fits ``budget`` bytes. BLAS and the sampled kernel form the same products and sums at
the stored positions, so the results agree to rounding, infinities and NaNs included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..frontend.notation import Assignment, Term
from .cost import OperandInfo
from .dense_path import (dense_product_cycles, gather_cycles, relayout_cycles, sampling_cycles, schedule_cycles,
                         stream_cycles)
from .schedule import Schedule
from .target import Target

__all__ = ["SampledDensePath", "sampled_dense_path", "sampled_kernel_cycles", "unmasked_product"]


@dataclass(frozen=True)
class SampledDensePath:
    """A sampled product computed whole by BLAS (``product``: its multiplied factors,
    :func:`unmasked_product`), then sampled at operand ``anchor``'s pattern, weighed
    against the sampled kernel; costs in cycles, ``taken`` when cheaper."""

    product: Assignment
    anchor: int
    kernel_cycles: float
    product_cycles: float
    sampling_cycles: float
    call_cycles: float

    @property
    def dense_cycles(self) -> float:
        return self.product_cycles + self.sampling_cycles + self.call_cycles

    @property
    def taken(self) -> bool:
        return self.dense_cycles < self.kernel_cycles

    def describe(self) -> str:
        dense = (f"the whole product by BLAS ({self.product_cycles:.3g} cycles), then sampled at operand "
                 f"{self.anchor}'s pattern ({self.sampling_cycles:.3g} cycles): {self.dense_cycles:.3g} cycles")
        kernel = f"the sampled kernel ({self.kernel_cycles:.3g} cycles)"
        if self.taken:
            return f"dense path: {dense}, against {kernel}"
        return f"sampled kernel kept: {kernel}, against {dense}"


def unmasked_product(assignment: Assignment, infos: Sequence[OperandInfo]) -> Assignment | None:
    """``assignment`` without the factors its terms read for their positions only, as a
    plain sum of products of dense operands; None unless every term's value is a product
    of two or more distinct factors (:attr:`~.frontend.notation.Term.multiplied`) of
    dense operands reading every output index (no broadcast), its other factors sparse
    (the masks), and there is no epilogue (the sampling of a dense tensor itself, a copy,
    runs its kernel)."""
    if assignment.reduction != "sum" or assignment.epilogue is not None:
        return None
    terms = []
    for term in assignment.terms:
        multiplied = term.multiplied
        if multiplied is None or len(multiplied) < 2:  # a sampled copy: nothing for BLAS to multiply
            return None
        factors = tuple(term.factors[k] for k in multiplied)
        masks = [a for k, a in enumerate(term.factors) if k not in multiplied]
        if any(infos[a.operand].format is not None for a in factors) or \
                any(infos[a.operand].format is None for a in masks) or \
                not set(assignment.output) <= {i for a in factors for i in a.indices}:
            return None
        terms.append(Term(term.coefficient, factors))
    return Assignment(assignment.output, tuple(terms), assignment.operand_names, extents=assignment.extents)


def sampled_kernel_cycles(assignment: Assignment, sched: Schedule, infos: Sequence[OperandInfo],
                          stored: Sequence[int], anchor: int, itemsize: int, target: Target) -> float:
    """Cycles of the sampled kernel of ``sched`` writing at operand ``anchor``'s
    ``stored[anchor]`` positions (see the module doc)."""
    scale = stored[anchor] / max(infos[anchor].nnz, 1)
    shapes = [info.shape for info in infos]
    kernel = max(scale * max(schedule_cycles(sched, target),
                             gather_cycles(assignment, sched, shapes, anchor, itemsize, target)),
                 stream_cycles(assignment, infos, stored, itemsize, target, stored[anchor]))
    return kernel + relayout_cycles(assignment, sched, infos, itemsize, target)


def sampled_dense_path(assignment: Assignment, infos: Sequence[OperandInfo], stored: Sequence[int], sched: Schedule,
                       anchor: int, itemsize: int, target: Target, budget: int) -> SampledDensePath | None:
    """The dense path of a call whose result is sampled at operand ``anchor``'s pattern,
    weighed against its sampled kernel ``sched`` (see the module doc); None where it
    does not apply. ``stored``: each operand's stored entries (the infos' are rounded
    to a power of two); ``budget``: the most bytes the whole product may take."""
    product = unmasked_product(assignment, infos)
    if product is None:
        return None
    sizes = {i: infos[a.operand].shape[m] for t in assignment.terms for a in t.factors for m, i in enumerate(a.indices)}
    dense_bytes = math.prod(sizes[i] for i in assignment.output) * itemsize
    if dense_bytes > budget:
        return None
    shapes = [info.shape for info in infos]
    return SampledDensePath(product, anchor,
                            sampled_kernel_cycles(assignment, sched, infos, stored, anchor, itemsize, target),
                            dense_product_cycles(product, shapes, itemsize, target),
                            sampling_cycles(stored[anchor], dense_bytes, itemsize, target),
                            2 * target.python_call_cycles)
