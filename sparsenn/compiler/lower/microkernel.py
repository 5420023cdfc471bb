"""Micro-kernels of dense-output nests (``plan/microkernel.py``): register blocks with
their interleaved sums and dot tiles; register tiles are lowered by
:mod:`.register_tile`, grouped tiles by :mod:`.grouped_tile`, a register block's packs
by :mod:`.packed_block`.

A register-blocked nest ``P + R + (k,)`` runs::

    for P: for kb in whole blocks of k: acc[0:B] = 0
               for R: acc[:] += scalar factors * vector factors[kb : kb + B]
               out[P, kb : kb + B] (+)= coef * outside vectors[kb : kb + B] * acc
           the last, partial block the same way, its vectors' lanes past k masked

with ``acc`` ``B / lanes`` SIMD vectors kept in registers; the *outside* vectors hold
``k`` but no index of ``R`` (a sampled output's anchor, whose positions the stores
take). With ``S`` interleaved sums (``R`` one sparse loop), the stored positions
``q .. q + S - 1`` of each whole group add into ``S`` sets of accumulators, summed
into ``acc`` after the groups (a block of one vector would wait on every add).
"""

from __future__ import annotations

import dataclasses

from ..loops import ir
from ..plan.decisions import reductions_from
from ..plan.schedule import Nest
from .context import Lowering, counted, product_of
from .epilogue import fuse_epilogue, vector_epilogue
from .iterators import locate
from .order import NestWalk, emit_order
from .reductions import enter
from .grouped_tile import grouped_tile
from .packed_block import BlockPacks
from .register_tile import RegisterTileLowering
from .tile_access import OUT, blocks_of_k, held, located, shifted_pos, shifted_value, vector_at

__all__ = ["register_blocked", "dot_tile"]


def register_blocked(lo, nest, walk, states, term, offset, coef, once, k_anchor) -> None:
    """The register-blocked nest (see the module doc); ``k_anchor``: the factor whose
    positions a sampled output's values take (None for a dense output)."""
    order, output = nest.order, lo.a.output
    size = nest.register_block.size
    k = order[-1]
    r = reductions_from(order, output, len(order) - 1)
    summed = set(order[r:-1])
    outside = [n for n, st in enumerate(states) if k in held(st) and not summed & set(held(st))]
    with_k = [n for n, st in enumerate(states) if not st.sparse and k in st.dense_indices and n not in outside]
    scalars = [n for n in range(len(term.factors)) if n not in with_k and n not in outside]
    kb, acc, mask = lo.fresh("kb"), lo.fresh("vacc"), lo.fresh("kmask")
    var_k, v = lo.var(k), ir.Var("v")
    k_lo, n_k = walk.bounds.get(k, (ir.Const(0), lo.dim(k)))
    if k in walk.bounds:
        end = lo.fresh("kend")
        lo.emit(ir.Decl(end, "index", n_k, const=True))
        n_k = end
    vectors = ir.Bin("/", ir.Const(size), ir.Lanes())
    lane = ir.mul(v, ir.Lanes())
    k_span = [k_lo, n_k]  # the blocks' range of k: all of it, or a packed block's open panel
    packs = BlockPacks(lo, nest, k_span) if nest.packed_block is not None else None
    # The epilogue on the accumulators before the store: its slice is the block's span
    # of k (fused right after the block's reductions), its functions have vector forms.
    in_registers = (lo.a.epilogue is not None and nest.epilogue_at == r and nest.register_tile is None
                    and k_anchor is None and vector_epilogue(lo, k, lane, None) is not None)
    # Whether the pass being emitted is the last, partial block: vector v then holds
    # the lanes ``mask[v]`` of its span.
    partial = [False]

    def count() -> ir.Expr | None:
        return ir.Elem(mask, (v,)) if partial[0] else None

    # The block's sums: ``acc``, and with interleaved sums, ``sums[u]`` for the position
    # ``u`` of each whole group of the sparse loop's positions (``sums[0]`` is ``acc``).
    sums = [acc, *(lo.fresh("vacc") for _ in range(nest.block_sums - 1))]
    into = [acc]  # the sums the leaf adds into

    def vector_leaf(st):
        lo.emit(ir.Decl(var_k, "index", kb, const=True))
        loads = [packs.load(kb, count()) if packs is not None and n == nest.packed_block.factor
                 else lo.vector_load(st[n], count=count()) for n in with_k]
        lo.emit(counted(v, vectors, ir.Assign(ir.Elem(into[0], (v,)), product_of([lo.product(st, scalars), *loads]),
                                              "+=")))

    def interleaved(states_at_r):
        """Whole groups of ``len(sums)`` positions of the sparse loop ``order[r]``, each
        position into its own sums, added into ``acc`` after the groups."""
        def emit(cursor, prefetch):
            q, group = cursor.q, len(sums)

            def at_position(u: int):
                if prefetch:
                    prefetch(ir.add(q, u))
                into[0] = sums[u]
                emit_order(lo, plain, enter(lo, order[r], states_at_r, cursor, ir.add(q, u)), r + 1)
                into[0] = acc

            lo.emit(ir.For(None, ir.le(ir.add(q, group), cursor.h), ir.Assign(q, ir.Const(group), "+="),
                           ir.Block(tuple(lo.block(lambda u=u: at_position(u)) for u in range(group)))))
            lo.emit(counted(v, vectors, *(ir.Assign(ir.Elem(acc, (v,)), ir.Elem(other, (v,)), "+=")
                                          for other in sums[1:])))
        return emit

    def one_pass(st, inner):
        """One pass over the reductions: the block's sums in registers, then stored."""
        for each in sums:
            lo.emit(ir.Decl(each, "VV", None, shape=(vectors,)))
            lo.emit(counted(v, vectors, ir.Assign(ir.Elem(each, (v,)), ir.VectorZero())))
        inner()

        def store():
            lo.emit(ir.Decl(var_k, "index", kb, const=True))
            at_k = located(lo, k, st)
            scaled = product_of([coef, ir.Elem(acc, (v,)), *(vector_at(lo, at_k[n], lane, count=count())
                                                            for n in outside)])
            value = scaled if once else ir.add(ir.VectorLoad(OUT, ir.add(offset(at_k), lane), count()), scaled)
            if in_registers:
                value = vector_epilogue(lo, k, lane, count())(value)
            lo.emit(counted(v, vectors, ir.VectorStore(OUT, ir.add(offset(at_k), lane), value, count())))

        lo.emit(lo.block(store))

    def blocks(st, inner):
        """Loop ``r`` and those inside it, wrapped in whole blocks of k, then in the
        last, partial block, masked."""
        def one_block(last: bool):
            partial[0], plain.block = last, (k, kb, k_span[1] if last else ir.add(kb, size))
            one_pass(st, inner)
            partial[0], plain.block = False, (k, kb, ir.add(kb, size))

        blocks_of_k(lo, kb, mask, size, tuple(k_span), one_block)

    wrap = {r: blocks}
    plain = NestWalk(nest, order[:-1], vector_leaf, dict(walk.bounds), block=(k, kb, ir.add(kb, size)),
                     block_from=r, wrap=wrap, blocked={r: interleaved} if len(sums) > 1 else {})
    if nest.register_tile is not None and nest.register_tile.grouped_by is not None:
        wrap[r - 1] = grouped_tile(lo, nest, plain, coef, once, (k_lo, n_k), with_k, scalars)
    elif nest.register_tile is not None:
        wrap[r - 1] = RegisterTileLowering(lo, nest, plain, coef, once, (k_lo, n_k), with_k, scalars, outside,
                                           k_anchor, offset)
    elif packs is not None:
        wrap[0] = packs.wrapper(plain.bounds)
        lo.packed_rows[nest.packed_block.factor] = lambda step: packs.row(kb, step)
    if not in_registers and lo.a.epilogue is not None and nest.epilogue_at is not None:
        fuse_epilogue(lo, wrap, plain.bounds, order, nest.epilogue_at)
    emit_order(lo, plain, states)
    lo.packed_rows.clear()


ROW_T, COL_T = ir.Var("t"), ir.Var("u")


def dot_tile(lo: Lowering, nest: Nest, walk: NestWalk, inside, outside, coef, store: str, anchor_k: int | None):
    """The wrapper of loop ``a`` that runs whole ``rows x cols`` tiles of sums over the
    innermost ``d`` (the nest's dot tile), then the plain nest over the rows and columns
    left::

        for ab in whole tiles of a: a = ab; locate a
            for bb in whole tiles of b: b = bb; locate b
                acc[t][u] = 0
                for d in whole vectors: x[t] = a-factors at (ab + t, d); y[u] = b-factors at (bb + u, d)
                                        acc[t][u] += x[t] * y[u] * common factors at d
                s[t][u] = lanes of acc[t][u] summed (one transpose-and-add)
                for d in the rest: s[t][u] += the product at (ab + t, bb + u, d)
                out[ab + t, bb + u] (+)= coef * outside factors at (ab + t, bb + u) * s[t][u]
        the plain nest over rows [a_lo, a_rest) x columns [b_rest, b_hi), then rows [a_rest, a_hi)
    """
    tile, order = nest.dot_tile, nest.order
    a, b, d = tile.rows, tile.cols, order[-1]
    rows, cols = tile.row_count, tile.col_count
    position = order.index(a)
    vectors = nest.vector_reduction.vectors
    ab, bb, a_rest, b_rest, acc, sums, xa, xb, end = (
        lo.fresh(n) for n in ("ab", "bb", "arest", "brest", "dacc", "dsum", "xa", "xb", "dend"))
    var_d, var_a, var_b = lo.var(d), lo.var(a), lo.var(b)
    sum_at = ir.add(ir.mul(ROW_T, cols), COL_T)

    def tile_body(st) -> None:
        by_row = [k for k in vectors if a in held(st[k])]
        by_col = [k for k in vectors if b in held(st[k])]
        common = [k for k in vectors if k not in by_row and k not in by_col]
        d_lo, d_hi = walk.bounds.get(d, (ir.Const(0), lo.dim(d)))
        lane0 = ir.Const(0)

        def loads(ks, shift) -> ir.Expr:
            return product_of([lo.vector_load(st[k], {i: ir.add(lo.var(i), s) for i, s in shift.items()}, lane0)
                               for k in ks])

        lo.emit(ir.Decl(acc, "VV", "zero", shape=(rows * cols, 1)))
        lo.emit(ir.Decl(end, "index", d_hi, const=True), ir.Decl(var_d, "index", d_lo))
        step = [ir.Decl(xa, "VV", None, shape=(rows,)), ir.Decl(xb, "VV", None, shape=(cols,)),
                counted(ROW_T, rows, ir.Assign(ir.Elem(xa, (ROW_T,)), loads(by_row, {a: ROW_T}))),
                counted(COL_T, cols, ir.Assign(ir.Elem(xb, (COL_T,)), loads(by_col, {b: COL_T})))]
        term = ir.mul(ir.Elem(xa, (ROW_T,)), ir.Elem(xb, (COL_T,)))
        if common:
            term = ir.mul(term, loads(common, {}))
        step.append(counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Elem(acc, (sum_at, ir.Const(0))), term,
                                                                        "+="))))
        lo.emit(ir.For(None, ir.le(ir.add(var_d, ir.Lanes()), end), ir.Assign(var_d, ir.Lanes(), "+="),
                       ir.Block(tuple(step))))
        lo.emit(ir.Decl(sums, "V", None, shape=(rows * cols,)))
        lo.emit(ir.Effect("hsums", (acc, sums)))
        shift = {a: ROW_T, b: COL_T}
        tail = product_of([shifted_value(lo, st[k], shift) for k in inside])
        lo.emit(ir.For(None, ir.lt(var_d, end), ir.Incr(var_d), ir.Block((
            counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Elem(sums, (sum_at,)), tail, "+="))),))))
        if anchor_k is None:
            target = lo.offset(lo.s.output_order, {a: ir.add(var_a, ROW_T), b: ir.add(var_b, COL_T)})
        else:
            target = shifted_pos(lo, st[anchor_k], shift)
        value = product_of([coef, *(shifted_value(lo, st[k], shift) for k in outside), ir.Elem(sums, (sum_at,))])
        lo.emit(counted(ROW_T, rows, counted(COL_T, cols, ir.Assign(ir.Load(OUT, target), value, store))))

    def wrapper(st, inner) -> None:
        a_lo, a_hi = walk.bounds.get(a, (ir.Const(0), lo.dim(a)))
        b_lo, b_hi = walk.bounds.get(b, (ir.Const(0), lo.dim(b)))
        lo.emit(ir.Decl(a_rest, "index", ir.sub(a_hi, ir.Bin("%", ir.sub(a_hi, a_lo), ir.Const(rows))), const=True))
        lo.emit(ir.Decl(b_rest, "index", ir.sub(b_hi, ir.Bin("%", ir.sub(b_hi, b_lo), ir.Const(cols))), const=True))

        def row_tile():
            lo.emit(ir.Decl(var_a, "index", ab, const=True))
            at_a = list(st)
            locate(lo, a, st, at_a)

            def col_tile():
                lo.emit(ir.Decl(var_b, "index", bb, const=True))
                at_b = list(at_a)
                locate(lo, b, at_a, at_b)
                tile_body(at_b)

            lo.emit(ir.For(ir.Decl(bb, "index", b_lo), ir.lt(bb, b_rest), ir.Assign(bb, ir.Const(cols), "+="),
                           lo.block(col_tile)))

        lo.emit(ir.For(ir.Decl(ab, "index", a_lo), ir.lt(ab, a_rest), ir.Assign(ab, ir.Const(rows), "+="),
                       lo.block(row_tile)))
        for bounds in ({a: (a_lo, a_rest), b: (b_rest, b_hi)}, {a: (a_rest, a_hi)}):
            rest = dataclasses.replace(walk, bounds={**walk.bounds, **bounds})
            lo.emit(lo.block(lambda rest=rest: emit_order(lo, rest, st, position, True)))

    return wrapper
