"""Prefetching the dense rows a loop over a fiber will gather.

The schedule names the loops that may prefetch and the dense factors ``d[P, j, T]``
they gather (:class:`~..plan.decisions.PrefetchLoop`); here each becomes a span
``d + offset(P, crd[q + D], T_start)`` of ``T_end - T_start`` elements (a factor read
from a per-thread pack: the pack's row ``crd[q + D]`` of the open block), and the loop
a run-time test (:class:`~..plan.decisions.PrefetchPolicy`) choosing between a copy of
the loop with prefetches and one without. ``D`` keeps ``ahead_bytes`` in flight,
clamped to the level's last position (running on into the next fibers).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..loops import ir
from ..plan.decisions import PrefetchPolicy
from .context import Lowering, product_of
from .iterators import Cursor, level_size

__all__ = ["Span", "spans", "prefetcher"]

Span = tuple[int, dict, ir.Expr]  # (factor, start of T per index, length in elements)


def spans(lo: Lowering, factors: Sequence[int], index: str, states, bounds: dict, block) -> list[Span]:
    """The spans of ``factors`` (dense operands) gathered per position of loop ``index``:
    ``T`` from a tile or chunk bound, the open register block ``block = (k, start,
    end)``, or whole rows; a factor read from a pack (``lo.packed_rows``): the block."""
    out = []
    for k in factors:
        st = states[k]
        if k in lo.packed_rows:
            out.append((k, {}, ir.sub(block[2], block[1])))
            continue
        n = st.dense_indices.index(index)
        trailing = st.dense_indices[n + 1:]
        last = trailing[-1]
        if len(trailing) == 1 and last in bounds:
            start, end = bounds[last]
        elif len(trailing) == 1 and block is not None and block[0] == last:
            start, end = block[1], block[2]
        else:
            start, end = ir.Const(0), product_of([lo.dim(t) for t in trailing])
        at = {t: ir.Const(0) for t in trailing} | {last: start}
        out.append((k, at, ir.sub(end, start)))
    return out


def prefetcher(lo: Lowering, policy: PrefetchPolicy, states, gathers: Sequence[Span], index: str):
    """For ``co_iterate``: given the loop's cursor and driving state, declare the
    run-time flag and return it with the per-position prefetch emitter."""

    def declare(cursor: Cursor, driver):
        q, h, crd = cursor.q, cursor.h, cursor.crd
        size, dist, last, on, footprint = (lo.fresh(p) for p in ("pfbytes", "pfdist", "pflast", "pfon", "pfsize"))
        value = ir.Call("value_size", ())
        lo.emit(ir.Decl(size, "index", tuple(ir.mul(value, n) for _, _, n in gathers), const=True,
                        shape=(len(gathers),)))
        total = _sum([ir.Elem(size, (ir.Const(g),)) for g in range(len(gathers))])
        lo.emit(ir.Decl(dist, "index", ir.min_(policy.max_distance, ir.add(
            ir.Bin("/", ir.Const(policy.ahead_bytes), ir.max_(total, 1)), 1)), const=True))
        lo.emit(ir.Decl(last, "index", ir.sub(ir.Cast("index", level_size(lo, driver, driver.depth)), 1), const=True))
        lo.emit(ir.Decl(footprint, "index", _sum([  # what the loop may gather: every row's span
            product_of([value, n, *(lo.dim(i) for i in _rows(states[k].dense_indices, index,
                                                              k in lo.packed_rows))])
            for k, _, n in gathers]), const=True))
        first = ir.Cast("index", ir.Load(crd, q))
        ahead = ir.Cast("index", ir.Load(crd, ir.min_(ir.add(q, dist), last)))
        jump = ir.le(ir.Const(policy.min_jump), ir.Call("abs", (ir.sub(ahead, first),)))
        spread = ir.le(lo.dim(index), ir.mul(2, ir.sub(ir.Cast("index", ir.Load(crd, ir.sub(h, 1))), first)))
        large = ir.le(ir.Const(policy.large_bytes), footprint)
        lo.emit(ir.Decl(on, "bool", ir.and_(
            ir.lt(q, h), ir.lt(ir.Const(policy.min_bytes), footprint), ir.Select(large, jump, spread)), const=True))

        def emit(position: ir.Expr) -> None:
            target = lo.fresh("ahead")
            lo.emit(ir.Decl(target, "index", ir.Load(crd, ir.min_(ir.add(position, dist), last)), const=True))
            for g, (k, at, _) in enumerate(gathers):
                st = states[k]
                if k in lo.packed_rows:
                    array, offset = lo.packed_rows[k](target)
                else:
                    array, offset = ir.Array("dense", st.slot), lo.dense_offset(st, {**at, index: target})
                lo.emit(ir.Prefetch(array, offset, ir.min_(ir.Elem(size, (ir.Const(g),)), policy.max_bytes)))

        return on, emit

    return declare


def _rows(indices: Sequence[str], index: str, packed: bool) -> Sequence[str]:
    """The indices of a gathered factor up to and including the gathering ``index``
    (``packed``: read from a pack, whose rows are ``index``'s alone)."""
    return (index,) if packed else indices[: indices.index(index) + 1]


def _sum(parts):
    out = parts[0]
    for p in parts[1:]:
        out = ir.add(out, p)
    return out
