"""Epilogues: ``out[o] = value(out[o], factors at o)`` once ``out[o]`` is complete.

Fused into a nest, the epilogue runs over each *slice* of the output the nest has just
finished: after loop ``order[p]`` closes, every element with the coordinates of the
loops above it is final, and the slice (the output indices of ``order[p:]``, within
their tile or chunk bounds) is still in cache::

    for i (chunked): for j in row i: for k: out[i, k] += A[i, j] * X[j, k]
                     for k: out[i, k] = relu(out[i, k] + b[k])        # the slice i

The schedule fuses only where the loops above ``p`` visit every coordinate (else
elements it never visits would miss the epilogue); otherwise :func:`epilogue_pass`
runs it over the whole output after every nest.

A register block whose slice is its own span of ``k`` (the output's innermost index)
applies the epilogue to its accumulators before the store (:func:`vector_epilogue`)
when every function of the epilogue has a vector form and every factor is either
unit-stride in ``k`` (a vector, masked in the partial block) or free of ``k`` (one
value for every lane)::

    out[i, kb : kb + B] = relu(acc + b[kb : kb + B])      # no store, reload and scalar loop
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..frontend.notation import Apply, Value
from ..loops import ir
from .context import Lowering, Slot, lower_value
from .iterators import FactorState

__all__ = ["fuse_epilogue", "epilogue_pass", "vector_epilogue", "VECTOR_FUNCTIONS"]

OUT = ir.Array("out")

# The functions of index notation the kernel header defines on SIMD vectors too, besides
# the arithmetic operators.
VECTOR_FUNCTIONS = frozenset({"add", "sub", "mul", "div", "neg", "relu", "max", "min"})


def _apply(lo: Lowering) -> None:
    """``out[o] = epilogue`` at the index variables' current values."""
    epilogue = lo.a.epilogue
    states = [FactorState(lo.slot_of(Slot(a.operand, None)), (), a.indices) for a in epilogue.factors]
    at = ir.Load(OUT, lo.offset(lo.s.output_order))
    lo.emit(ir.Assign(at, lower_value(epilogue.value, lo.values(states), reduced=at)))


def _slice(lo: Lowering, indices: Sequence[str], bounds: dict) -> None:
    """Loops over ``indices`` (within ``bounds``) around the epilogue, the innermost
    ``omp simd``."""
    def loops(depth: int) -> None:
        if depth == len(indices):
            _apply(lo)
            return
        index = indices[depth]
        var = lo.var(index)
        first, last = bounds.get(index, (ir.Const(0), lo.dim(index)))
        end = lo.fresh("end")
        lo.emit(ir.Decl(end, "index", last, const=True))
        pragma = "simd" if depth == len(indices) - 1 else None
        lo.emit(ir.For(ir.Decl(var, "index", first), ir.lt(var, end), ir.Incr(var),
                       lo.block(lambda: loops(depth + 1)), pragma))

    lo.emit(lo.block(lambda: loops(0)))


def fuse_epilogue(lo: Lowering, wrap: dict, bounds: dict, order: Sequence[str], position: int) -> None:
    """Run the epilogue over each slice after loop ``order[position]`` (and whatever
    ``wrap`` already puts around it) closes; ``bounds``: the walk's loop bounds, read as
    they are when the loop is entered."""
    slice_indices = [i for i in order[position:] if i in lo.a.output]
    inner = wrap.get(position)

    def wrapper(states, emit_loop) -> None:
        entered = dict(bounds)
        if inner is None:
            emit_loop()
        else:
            inner(states, emit_loop)
        _slice(lo, slice_indices, entered)

    wrap[position] = wrapper


def epilogue_pass(lo: Lowering) -> None:
    """The epilogue over the whole output, after every nest (in parallel unless the
    schedule is serial)."""
    order = lo.s.output_order
    if not order:
        _apply(lo)
        return
    first, rest = order[0], order[1:]
    var, end = lo.var(first), lo.fresh("end")
    lo.emit(ir.Decl(end, "index", lo.dim(first), const=True))
    pragma = None if lo.s.serial else "omp_parallel_for"
    body = lo.block(lambda: _slice(lo, rest, {}) if rest else _apply(lo))
    lo.emit(ir.For(ir.Decl(var, "index", ir.Const(0)), ir.lt(var, end), ir.Incr(var), body, pragma))


def _vectorisable(value: Value) -> bool:
    """Whether every function in ``value`` has a vector form."""
    if not isinstance(value, Apply):
        return True
    return value.function in VECTOR_FUNCTIONS and all(_vectorisable(a) for a in value.args)


def vector_epilogue(lo: Lowering, k: str, lane: ir.Expr,
                    count: ir.Expr | None) -> Callable[[ir.Expr], ir.Expr] | None:
    """The epilogue as a function of a finished vector of the output (lanes ``lane ..``
    past ``k``'s current value, the first ``count`` of them valid), or None where it has
    no vector form: a function without one, or a factor along ``k`` not unit-stride."""
    epilogue = lo.a.epilogue
    if not _vectorisable(epilogue.value):
        return None
    factors = []
    for a in epilogue.factors:
        st = FactorState(lo.slot_of(Slot(a.operand, None)), (), a.indices)
        if k not in a.indices:
            factors.append(lo.values([st])[0])
        elif a.indices[-1] == k and lo.slots[st.slot].panel is None:
            factors.append(lo.vector_load(st, lane=lane, count=count))
        else:
            return None
    return lambda reduced: lower_value(epilogue.value, factors, reduced=reduced)
