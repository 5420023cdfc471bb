"""Chunks of an outermost loop, the unit of OpenMP work sharing.

The outermost loop's coordinates ``[0, extent)`` are cut into ``min(extent, c *
threads)`` chunks that threads take dynamically: when a factor has a ``pos`` array
counting each outer coordinate's stored children (a locatable first level with a
``pos``-indexed level below), ranges of equal stored children plus coordinates, so
power-law rows spread over the threads (``c`` the target's ``chunks_per_thread``);
otherwise equal coordinate ranges, ``c`` its ``even_range_chunks_per_thread``, so that
uneven work per coordinate (BigBird's global block rows, 10x the others) still evens
out.
"""

from __future__ import annotations

from ..loops import ir
from ..plan.target import Target
from .context import Lowering

__all__ = ["EXTENT", "NCHUNKS", "LO", "HI", "EVEN_RANGE_CHUNKS_PER_THREAD", "chunk_prologue", "balancing_pos",
           "chunk_bounds"]

# The default target's, for the fused lowering (``fuse.py``), which is given no Target.
EVEN_RANGE_CHUNKS_PER_THREAD = Target().even_range_chunks_per_thread

EXTENT, NCHUNKS = ir.Var("sn_extent"), ir.Var("sn_nchunks")
LO, HI = ir.Var("sn_lo"), ir.Var("sn_hi")


def chunk_prologue(lo: Lowering, extent: ir.Expr, per_thread: int) -> None:
    """Declare ``sn_extent`` and ``sn_nchunks``: ``min(extent, per_thread * threads)``."""
    chunks = ir.mul(ir.Cast("index", ir.Var("nthreads")), per_thread)
    lo.emit(ir.Decl(EXTENT, "index", extent, const=True), ir.Decl(NCHUNKS, "index", ir.min_(EXTENT, chunks), const=True))


def balancing_pos(states, index: str) -> ir.Array | None:
    """The ``pos`` array counting each ``index`` coordinate's stored children, if a
    factor has one (see the module doc)."""
    for st in states:
        if (
            len(st.levels) >= 2 and st.depth == 0 and st.pos == ir.Const(0)
            and st.levels[0][0] == index and st.levels[0][1].locatable and st.levels[1][1].has_pos
        ):
            return ir.Array("pos", st.slot, 1)
    return None


def chunk_bounds(lo: Lowering, chunk: ir.Expr, nchunks: ir.Expr, pos: ir.Array | None) -> None:
    """Declare ``sn_lo``/``sn_hi``: the coordinate range of chunk ``chunk``."""
    if pos is None:
        lo.emit(ir.Decl(LO, "index", ir.Bin("/", ir.mul(EXTENT, chunk), nchunks), const=True),
                ir.Decl(HI, "index", ir.Bin("/", ir.mul(EXTENT, ir.add(chunk, 1)), nchunks), const=True))
        return
    work = ir.Var("sn_work")
    lo.emit(ir.Decl(work, "index", ir.add(ir.Cast("index", ir.Load(pos, EXTENT)), EXTENT), const=True))

    def bound(k: ir.Expr) -> ir.Expr:
        return ir.Call("balanced_bound", (pos, EXTENT, ir.Bin("/", ir.mul(work, k), nchunks)))

    lo.emit(ir.Decl(LO, "index", bound(chunk), const=True),
            ir.Decl(HI, "index", ir.Select(ir.eq(ir.add(chunk, 1), nchunks), EXTENT, bound(ir.add(chunk, 1))),
                    const=True))
