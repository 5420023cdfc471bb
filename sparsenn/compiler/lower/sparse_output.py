"""Sparse outputs: the shared output loops, their workspace, and the output's assembly.

The output's storage levels are written in order by the *shared* loops, common to all
terms: one term's loops co-iterate its factors (:func:`~.merge.co_iterate`), several
terms' loops their union (:func:`~.merge.merge`), where ``active[t]`` says whether
term ``t`` is present under the enclosing coordinates. Output levels below the shared
loops are scattered into a per-thread workspace and drained in key order. The first
shared loop runs in chunks that the threads of a team take (:mod:`.chunks`); what the
loops write is the schedule's :class:`~..plan.decisions.OutputAssembly`, carried out
by an :mod:`.assembly` strategy. A two-phase output is lowered twice: the kernel
counts, its second phase writes.
"""

from __future__ import annotations

from ..loops import ir
from .assembly import Assembler, assembler
from .chunks import HI, LO, NCHUNKS, balancing_pos, chunk_bounds, chunk_prologue
from .context import Lowering
from .iterators import filtering, initial_states, open_cursor
from .merge import co_iterate, merge
from .order import NestWalk, emit_order

__all__ = ["lower_sparse_output"]

ERROR = ir.Var("sn_error")  # set by a thread that ran out of memory
CHUNKS = ir.Var("sn_chunks")


def lower_sparse_output(lo: Lowering, second_phase: bool = False) -> None:
    """Emit the kernel writing the schedule's sparse output into ``lo`` (or, with
    ``second_phase``, a two-phase output's second phase)."""
    out = assembler(lo, second_phase)
    shared = lo.s.shared
    out.start(lo)
    chunk_prologue(lo, lo.dim(shared[0]) if shared else ir.Const(1), lo.s.target.chunks_per_thread)
    lo.emit(ir.Decl(CHUNKS, "index", ir.max_(NCHUNKS, 1), const=True))
    out.chunks(lo, CHUNKS)
    lo.emit(ir.Decl(ERROR, "int", ir.Const(0)))
    lo.emit(ir.Team(lo.block(lambda: _team(lo, out)), ir.Var("nthreads") if shared else ir.Const(1)))
    lo.emit(ir.If(ERROR, ir.Block((ir.Return(ERROR),))))
    out.finish(lo)


def _team(lo: Lowering, out: Assembler) -> None:
    """One thread's work: its workspace, then the chunks it takes."""
    s, chunk = lo.s, ir.Var("sn_chunk")
    if s.workspace is not None:
        out.declare_workspace(lo, [lo.dim(i) for i in s.workspace.indices], ERROR)

    def attempt():
        out.chunk(lo, chunk)
        terms = [n.term for n in s.nests]
        states = {t: initial_states(lo, t, lo.a.terms[t]) for t in terms}
        balance = balancing_pos(states[terms[0]], s.shared[0]) if s.shared and len(terms) == 1 else None
        chunk_bounds(lo, chunk, CHUNKS, balance)
        _shared(lo, out, states, {t: None for t in terms}, 0)

    body = ir.Block((ir.If(ERROR, ir.Block((ir.Continue(),))), ir.Guarded(lo.block(attempt), ERROR)))
    lo.emit(ir.For(ir.Decl(chunk, "index", ir.Const(0)), ir.lt(chunk, CHUNKS), ir.Incr(chunk), body, "omp_for"))


def _shared(lo: Lowering, out: Assembler, states: dict, active: dict, level: int) -> None:
    """Shared loop ``level`` and those inside it. ``states[t]``: term ``t``'s factors;
    ``active[t]``: whether it is present here (None: it is)."""
    s = lo.s
    if level == len(s.shared):
        _leaf(lo, out, states, active, level)
        return
    index = s.shared[level]
    bounds = (LO, HI) if level == 0 else None
    every = out.levels[level].full  # a full output level records every coordinate, stored or not
    terms = list(states)

    def visit(new: dict, present: dict) -> None:
        mark = out.open(lo, level, lo.var(index))
        _shared(lo, out, new, present, level + 1)
        out.close(lo, level, mark)

    if len(terms) == 1:
        (t,) = terms
        if active[t] is not None and not every:  # the term is absent, or present throughout
            lo.emit(ir.If(active[t], lo.block(lambda: _shared(lo, out, states, {t: None}, level))))
            return
        if active[t] is None and not (every and filtering(index, states[t])):
            co_iterate(lo, index, states[t], lambda new: visit({t: new}, {t: None}), bounds)
            return
    cursors = [[open_cursor(lo, k, states[t][k], bounds, active[t]) for k in filtering(index, states[t])]
               for t in terms]
    merge(lo, index, [states[t] for t in terms], cursors,
          lambda present: visit({terms[n]: st for n, (st, _) in present.items()},
                                {terms[n]: p for n, (_, p) in present.items()}),
          bounds, [active[t] for t in terms], every, s.union_by_points)


def _leaf(lo: Lowering, out: Assembler, states: dict, active: dict, level: int) -> None:
    """Below the shared loops: the terms scatter into the workspace, which is then
    drained into output levels ``level`` and below; or their sum is one entry."""
    s = lo.s
    if s.workspace is not None:
        key = lo.offset(s.workspace.indices)
        _each_term(lo, states, active, lambda value: out.scatter(lo, key, value if out.values else None))
        out.drain(lo, level)
        return
    if not out.values:
        out.store(lo, None)
        return
    value = lo.fresh("val")
    lo.emit(ir.Decl(value, "V", ir.Const(0)))
    _each_term(lo, states, active, lambda term_value: lo.emit(ir.Assign(value, term_value, "+=")), value)
    out.store(lo, value)


def _each_term(lo: Lowering, states: dict, active: dict, leaf, accumulator: ir.Var | None = None) -> None:
    """Each active term's own loops (its nest), ``leaf(coefficient * value)`` innermost;
    ``accumulator``: the scalar the leaves sum into."""
    nests = {n.term: n for n in lo.s.nests}
    for t, st in states.items():
        term = lo.a.terms[t]
        coef = ir.Const(float(term.coefficient))
        walk = NestWalk(nests[t], nests[t].order, lambda new, term=term, coef=coef: leaf(
            ir.mul(coef, lo.term_value(term, new))), accumulator=accumulator)
        loops = lo.block(lambda walk=walk, st=st: emit_order(lo, walk, st))
        lo.emit(loops if active[t] is None else ir.If(active[t], loops))
