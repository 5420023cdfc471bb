"""Loop ordering, workspace insertion and tiling (Scorch Algorithms 1 and 3).

The scheduler sees each operand through :class:`OperandInfo`: its format (``None`` for
a dense ``torch.Tensor``), its shape and the number of stored positions per storage
level. It returns a :class:`Schedule`:

* **Dense output.** Each term is its own loop nest accumulating into the output. The
  loop order is chosen by a cost model over all orders of the term's indices (a greedy
  search beyond :data:`EXHAUSTIVE_LIMIT` indices). The cost of an order is the expected
  work of the nest: at each loop, co-iterating the sparse levels indexed there
  (``sum`` of fiber lengths, with an expected intersection of ``N * prod(f_k / N)``) or
  ``N`` for a dense loop, times the iterations of the enclosing loops; a sparse operand
  whose storage order disagrees with the loop order is re-stored in that order first
  (a transpose costing ``TRANSPOSE_COST * nnz``); a nest whose outermost loop is a
  reduction cannot run in parallel and pays :data:`SERIAL_PENALTY`.
* **Sparse output.** The output is assembled level by level, so its first ``p`` storage
  levels are *shared* loops common to all terms (co-iterated as a union of the terms);
  the remaining output levels, if any, are scattered into a **workspace** (dense for
  rows of moderate size, a sorted sparse accumulator otherwise) that is drained in
  order. ``p`` and every term's order are chosen by the same cost model plus the
  workspace's cost. SpGEMM gets Gustavson's ``i,k,j`` with a row workspace; SDDMM
  iterates its sampling pattern with an inner dense reduction.
* **Tiling** (Algorithm 3, dense outputs): a dense loop is tiled when some access is
  reused across another loop, the index is dense in every operand, it is an output
  index (a tiled reduction would split every sum into per-tile partial sums, each a
  pass over the sparse operand) and it is not the parent of a sparse loop; the tile
  makes the reused data fit in half of a core's
  private L2 (the last-level cache is shared with the other core and, on a VM, with
  other tenants, so it is not a dependable target).
* **Panels** (dense outputs): a dense operand the nest re-lays out anyway (its own
  layout is not the loop order) whose unit-stride index is tiled is laid out in panels
  of the tile: ``[tile][other modes][offset in tile]``, the last panel as wide as the
  remainder. A tile then reads one contiguous block instead of a strip of every row,
  which rows whose length is a multiple of a cache way's size (a batch of 256 floats)
  map onto a fraction of the cache's sets.
* **Micro-kernels** (dense outputs): register blocks, register tiles (gathered,
  packed, grouped), dot tiles and interleaved block sums: see :mod:`.microkernel`; a
  register block's vector factor packed per thread instead of copied: :mod:`.block_pack`.
* **Code decisions** inside each nest (vector and sparse reductions, row blocks,
  prefetching loops, store-once) and the thread policy: see :mod:`.decisions`. Every
  machine parameter comes from the :class:`~.target.Target` passed in; the constants
  below are cost-model weights, not machine facts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from sparsenn.formats import Format

from ..frontend import notation
from ..frontend.notation import Assignment, Term
from . import block_pack, decisions
from . import microkernel
from .block_pack import PackedBlock
from .cost import Factor, NestCosts, OperandInfo, estimate_positions, nest_cost
from .decisions import PrefetchPolicy
from .microkernel import DotTile, RegisterTile, Tile
from .nest import Nest, Schedule, Workspace
from .target import Target

__all__ = ["OperandInfo", "Tile", "RegisterTile", "DotTile", "Nest", "Workspace", "Schedule", "schedule",
           "estimate_positions"]

EXHAUSTIVE_LIMIT = 6
SERIAL_PENALTY = 2.0
DENSE_WORKSPACE_LIMIT = 1 << 22
SPARSE_ACCUMULATOR_COST = 4.0
# How much faster BLAS (or a packed register tile) runs a dense product than the cost
# model's accounting (in which vectorised loops already count 1/8) predicts.
GEMM_SPEEDUP = 8.0
# The narrowest SIMD vectors (SSE, NEON): the width of a schedule whose register blocks
# cover rows this narrow (:func:`_narrow_rows`).
NARROW_VECTOR_BYTES = 16


def _orders(indices: Sequence[str], cost_of, leads: Sequence[Sequence[str]] = ()) -> list[tuple[str, ...]]:
    """Candidate orders: all permutations up to EXHAUSTIVE_LIMIT, else a greedy build
    and, for each of ``leads`` (the sparse operands' storage orders), that order first
    and the rest as the greedy build has them: a greedy choice of the first loops can
    miss the order that reads every sparse operand as it is stored."""
    if len(indices) <= EXHAUSTIVE_LIMIT:
        return list(itertools.permutations(indices))
    order: list[str] = []
    rest = list(indices)
    while rest:
        best = min(rest, key=lambda i: cost_of(tuple(order + [i] + [r for r in rest if r != i])))
        order.append(best)
        rest.remove(best)
    candidates = [tuple(order)]
    for lead in leads:
        lead = [i for i in lead if i in indices]
        candidate = tuple(lead) + tuple(i for i in order if i not in lead)
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def _storage_orders(term: Term, infos: Sequence[OperandInfo]) -> list[tuple[str, ...]]:
    """Each sparse factor's indices in its storage order."""
    return [tuple(a.indices[m] for m in infos[a.operand].format.mode_order)
            for a in term.factors if infos[a.operand].format is not None]


# ----------------------------------------------------------------------------- tiling


def _tiles(
    term: Term,
    output: tuple[str, ...],
    order: Sequence[str],
    factors: list[Factor],
    infos: Sequence[OperandInfo],
    dims: dict[str, int],
    itemsize: int,
    target: Target,
) -> tuple[Tile, ...]:
    """Algorithm 3: tile dense, reused loops that are not parents of a sparse loop."""
    all_indices = set(order)
    accesses = [set(a.indices) for a in term.factors] + [set(output)]
    working = set().union(*(s for s in accesses if s < all_indices))
    sparse_indices = {i for f in factors for i, level in f.levels if not level.locatable}
    working -= sparse_indices
    last_sparse = max((order.index(i) for i in sparse_indices if i in order), default=-1)
    # A tiled reduction index would split every sum into one partial sum per tile, each
    # added to the output in its own pass over the sparse operand: only output indices.
    working = {i for i in working if order.index(i) > last_sparse and i in output}
    l2 = target.l2_bytes
    tiles = []
    for index in sorted(working, key=order.index):
        # Data reused across the other loops: each dense operand holding `index`.
        footprint = 0
        for access in term.factors:
            if infos[access.operand].format is None and index in access.indices:
                footprint += math.prod(dims[i] for i in access.indices if i != index)
        if footprint == 0:
            continue
        fits = (l2 // 2) // (footprint * itemsize)
        size = 1 << max(fits, 1).bit_length() - 1
        # A tile narrower than a few cache lines re-reads the sparse operand for little
        # reuse; one narrower than a wide register block also splits that block, which
        # pays only when the operand exceeds twice the L2 (below that, most of its rows
        # stay in the L2 between reuses and the last-level cache serves the rest).
        least = 2 * target.cache_line_bytes // itemsize
        if footprint * dims[index] * itemsize < 2 * l2:
            least = max(least, target.wide_register_block_vectors * target.lanes(itemsize))
        if least <= size and fits < dims[index]:
            tiles.append(Tile(index, size))
    return tuple(tiles)


def _panels(order: Sequence[str], tiles: Sequence[Tile], factors: list[Factor]) -> tuple[tuple[int, int], ...]:
    """(factor, tile size) of the dense factors re-laid out whose last index is tiled
    (see the module doc); not the outermost loop's tile, which is chunked instead."""
    sizes = {t.index: t.size for t in tiles if t.index != order[0]}
    return tuple((k, sizes[f.levels[-1][0]]) for k, f in enumerate(factors)
                 if not f.sparse and not f.in_place and f.levels and f.levels[-1][0] in sizes)



# ----------------------------------------------------------------------------- search


def _transposes(t: int, factors: list[Factor], term: Term) -> list:
    """((term, factor), mode order) for each factor read in other than its own order."""
    out = []
    for k, (f, access) in enumerate(zip(factors, term.factors)):
        if not f.natural:
            out.append(((t, k), tuple(access.indices.index(i) for i, _ in f.levels)))
    return out


def _nest_indices(term: Term, output: tuple[str, ...]) -> list[str]:
    return list(term.indices) + [i for i in output if i not in term.indices]


def schedule(
    assignment: Assignment,
    infos: Sequence[OperandInfo],
    output_format: Format | None,
    itemsize: int = 4,
    target: Target | None = None,
    anchor: int | None = None,
) -> Schedule:
    """Choose loop orders, workspace, tiles and every code decision for ``assignment``
    on ``target`` (the host by default; see module doc). ``anchor``: for a dense
    schedule whose values are written at that operand's positions, the operand: its
    storage order is the output's layout, and it is read in that order, never
    re-stored (its positions are the output's)."""
    target = Target.current() if target is None else target
    dims: dict[str, int] = {}
    for access in assignment.accesses:  # an output index may be the epilogue's only
        for m, index in enumerate(access.indices):
            dims[index] = infos[access.operand].shape[m]
    if output_format is None:
        sched = _schedule_dense(assignment, infos, dims, itemsize, target, anchor)
        bound = _bound_by_multiply_adds(sched, itemsize, target)
        if bound and target.widest_vector_bytes > target.vector_bytes:
            narrow, target = target.vector_bytes, replace(target, vector_bytes=target.widest_vector_bytes)
            sched = _schedule_dense(assignment, infos, dims, itemsize, target, anchor)
            sched = replace(sched, reasons=(*sched.reasons, f"vectors of {target.vector_bytes} bytes (the target's "
                                            f"widest, not {narrow}): {bound}"))
        elif narrow := _narrow_rows(sched, dims, itemsize, target):
            wide, target = target.vector_bytes, replace(target, vector_bytes=NARROW_VECTOR_BYTES)
            sched = _schedule_dense(assignment, infos, dims, itemsize, target, anchor)
            sched = replace(sched, reasons=(*sched.reasons, f"vectors of {NARROW_VECTOR_BYTES} bytes (not {wide}): "
                                            f"{narrow}"))
    else:
        sched = _schedule_sparse(assignment, infos, dims, output_format, target)
    return replace(sched, serial=sched.leaves < target.parallel_min_work, prefetch_policy=PrefetchPolicy.of(target),
                   target=target, patterns=tuple(info.pattern for info in infos))


def _bound_by_multiply_adds(sched: Schedule, itemsize: int, target: Target) -> str:
    """Why ``sched`` is made for the target's widest vectors (:mod:`.microkernel`), or
    "": a register or dot tile, or a register block wider than one of ``target``'s
    vectors, which wider vectors hold in fewer registers, loads and multiply-adds (and
    in fewer passes over the sparse rows when the block no longer splits the row)."""
    lanes = target.vector_bytes // itemsize
    for nest in sched.nests:
        if nest.register_tile or nest.dot_tile:
            return "a register tile, bound by its multiply-adds"
        if nest.register_block is not None and nest.register_block.size > lanes:
            return f"a register block of {nest.register_block.size} values, wider than one vector"
    return ""


def _narrow_rows(sched: Schedule, dims: dict[str, int], itemsize: int, target: Target) -> str:
    """Why ``sched`` is made for :data:`NARROW_VECTOR_BYTES`-byte vectors, or "": its
    register blocks (and no register or dot tile) cover rows of at most that many bytes,
    narrower than the target's vectors (SpMM with 1 to 4 float columns, a graph's last
    layer). One narrow vector then holds a row whole, unmasked when it fills the vector,
    where a wide one would load and store it through a mask over lanes that carry
    nothing (AVX2's masked moves cost several operations each)."""
    if target.vector_bytes <= NARROW_VECTOR_BYTES:
        return ""
    blocks = [nest.register_block for nest in sched.nests if nest.register_block is not None]
    if not blocks or any(nest.register_tile or nest.dot_tile for nest in sched.nests):
        return ""
    widest = max(dims[block.index] * itemsize for block in blocks)
    if widest > NARROW_VECTOR_BYTES:
        return ""
    return f"register blocks over rows of at most {widest} bytes, which one such vector holds"


def _dense_decisions(nest: Nest, n: int, factors: list[Factor], assignment: Assignment, target: Target,
                     patterns: Sequence[int | None], units: frozenset[str] = frozenset()) -> Nest:
    """``nest`` (the ``n``-th) of a dense output with its code decisions; ``patterns``:
    per operand, the operand whose index arrays it shares (None: its own); ``units``:
    reduction indices of extent 1: a loop over one that no factor filters runs once, so
    it makes no element stored twice (nor skipped) wherever it is."""
    output = assignment.output
    order, f = nest.order, [x.nest_factor() for x in factors]
    stored = tuple(i for i in order if i not in units or any(x.filters(i) for x in f))
    block = nest.register_block
    bounded = {t.index for t in nest.tiles if not order or t.index != order[0]}
    fields = {"prefetch": decisions.prefetch_loops(
        order, f, bounded, block and block.index, decisions.reductions_from(order, output, len(order) - 1)),
        "simd": decisions.simd_loop(order, output, f)}
    if block is None and order and not _scalar(assignment, nest.term):  # no loops (a scalar): no micro-kernel
        fields |= {
            "vector_reduction": decisions.vector_reduction(order, output, f, target),
            "sparse_reduction": decisions.sparse_reduction(order, output, f, target, _fiber(order[-1], factors)),
            "row_block": decisions.row_block(order, output, f, target),
        }
        fields["dot_tile"] = microkernel.dot_tile(order, output, factors, fields["vector_reduction"], nest.tiles, target)
    elif assignment.reduction != "sum" and assignment.terms[nest.term].value == notation.Factor(0):
        fields["vector_reduction"] = decisions.extremum_reduction(order, output, f, target)
    layered = nest.register_tile is not None and nest.register_tile.depth > 0  # its layers add partial sums
    if n == 0 and not layered:
        tiles = [t.index for t in nest.tiles]
        fields["stores_once"] = decisions.stores_once(stored, output, f, tiles, block is not None)
        term = assignment.terms[nest.term]
        fields["stores_once_anchors"] = tuple(sorted({
            a.operand for k, a in enumerate(term.factors)
            if a.indices == output and f[k].sparse
            and k == next(j for j, b in enumerate(term.factors) if b.operand == a.operand and b.indices == output)
            and decisions.stores_once(stored, output, f, tiles, block is not None,
                                      _followers(term, factors, output, patterns, k))
        }))
    return replace(nest, **fields)


def _followers(term, factors: list[Factor], output: tuple[str, ...], patterns: Sequence[int | None],
               anchor: int) -> frozenset[int]:
    """Factor ``anchor`` of ``term`` and the factors read where it is (their operands share
    its index arrays, read as stored at the output indices: the lowering's followers),
    which visit no point the anchor does not."""
    def leader(operand: int) -> int:
        shared = patterns[operand] if patterns else None
        return operand if shared is None else shared

    home = leader(term.factors[anchor].operand)
    return frozenset(k for k, a in enumerate(term.factors)
                     if k == anchor or (factors[k].sparse and factors[k].in_place and a.indices == output
                                        and leader(a.operand) == home))


def _fiber(index: str, factors: list[Factor]) -> float:
    """The mean positions of a fiber of the first sparse factor with a level over ``index``."""
    for factor in factors:
        held = [i for i, _ in factor.levels]
        if factor.sparse and index in held:
            return factor.fibers[held.index(index)]
    return 0.0


def _team_loops(nest: Nest, factors: list[Factor], output: tuple[str, ...], dims: dict[str, int],
                target: Target) -> int:
    """:func:`decisions.team_loops` of a parallel dense-output nest, every code decision made."""
    held = {t.index for t in nest.tiles} | {loop.index for loop in nest.prefetch}
    held |= {i for i in (nest.register_block and nest.register_block.index,
                         nest.register_tile and nest.register_tile.index,
                         *((nest.dot_tile.rows, nest.dot_tile.cols) if nest.dot_tile else ())) if i is not None}
    if nest.epilogue_at is not None:
        held |= set(nest.order[nest.epilogue_at:])
    return decisions.team_loops(nest.order, output, [x.nest_factor() for x in factors], dims, held, target)


def _scalar(assignment: Assignment, t: int) -> bool:
    """Term ``t`` runs without micro-kernels (register blocks and tiles, vector and
    sparse reductions, row blocks): its value is not a product of factors (some of them
    may count for their patterns only, :attr:`~..frontend.notation.Term.multiplied`), or the
    reduction is not a sum."""
    return assignment.terms[t].multiplied is None or assignment.reduction != "sum"


def _epilogue_at(nest: Nest, output: tuple[str, ...], factors: list[Factor]) -> int | None:
    """Where a single nest fuses the epilogue (see :mod:`..lower.epilogue`): after its
    leading output loops, each visiting every coordinate, and outside any register or
    dot tile; None if there are no such loops."""
    order, f = nest.order, [x.nest_factor() for x in factors]
    p = 0
    while p < len(order) and order[p] in output and not any(x.filters(order[p]) for x in f):
        p += 1
    for tiled in (nest.register_tile and nest.register_tile.index, nest.dot_tile and nest.dot_tile.rows):
        if tiled is not None:
            p = min(p, order.index(tiled))
    return p if p > 0 else None


def _anchored_orders(nests: NestCosts, candidates: list[tuple[str, ...]], anchor: int,
                     layout: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The candidates reading the anchor in its storage order; if none does (a greedy
    search), the best one with the anchor's indices moved to its front in that order."""
    kept = [o for o in candidates if nests.reads_anchor_as_stored(o, anchor)]
    if kept:
        return kept
    held = layout  # the anchor's indices in its storage order
    return [tuple(held) + tuple(i for i in candidates[0] if i not in held)]


def _schedule_dense(assignment, infos, dims, itemsize, target: Target, anchor: int | None) -> Schedule:
    nests, transposes, reasons, total, leaf_total = [], [], [], 0.0, 0.0
    nest_factors = []
    output_order, costliest = assignment.output, -1.0
    layout = assignment.output
    if anchor is not None:
        layout = tuple(assignment.output[m] for m in infos[anchor].format.mode_order)
    for t, term in enumerate(assignment.terms):
        indices = _nest_indices(term, assignment.output)
        nests_of_term = NestCosts(term, infos, dims, target, layout, target.lanes(itemsize))

        def cost_of(order, nests_of_term=nests_of_term):
            cost = nests_of_term(order)[0]
            parallel = bool(order) and order[0] in assignment.output
            return cost if parallel else cost * SERIAL_PENALTY

        candidates = _orders(indices, cost_of, _storage_orders(term, infos))
        if anchor is not None:
            candidates = _anchored_orders(nests_of_term, candidates, anchor, layout)
        costs = {o: cost_of(o) for o in candidates}
        best = min(candidates, key=lambda o: costs[o])
        if assignment.epilogue is None and best and not _scalar(assignment, t):
            tiled = microkernel.register_tiled_order(best, costs, assignment.output, nests_of_term, anchor, itemsize,
                                                     target)
            if tiled is not None:
                costs[tiled] = cost_of(tiled)
                best = tiled
        _, leaves, factors = nests_of_term(best)
        leaf_total += leaves
        tiles = _tiles(term, assignment.output, best, factors, infos, dims, itemsize, target)
        parallel = bool(best) and best[0] in assignment.output
        nests.append(Nest(t, best, tiles, parallel, costs[best], panels=_panels(best, tiles, factors)))
        nest_factors.append(factors)
        transposes += _transposes(t, factors, term)
        total += costs[best]
        reasons.append(_explain_choice(t, best, costs, factors, parallel))
        if costs[best] > costliest:  # the output is laid out in its costliest nest's loop order
            output_order, costliest = tuple(sorted(assignment.output, key=best.index)), costs[best]
    # Register blocks need the output's layout, known once every nest is chosen.
    blocked = []
    for nest, factors in zip(nests, nest_factors):
        if _scalar(assignment, nest.term):
            blocked.append(nest)
            continue
        block, tile, tiles = microkernel.registers(nest.order, nest.parallel, nest.tiles, output_order,
                                                   assignment.output, factors, dims, itemsize, target)
        if tiles != nest.tiles:
            nest = replace(nest, tiles=tiles, panels=_panels(nest.order, tiles, factors))
        cost = nest.cost
        if tile is not None:
            reasons.append(f"term {nest.term}: register tile of {tile.rows} rows of {tile.index} x {tile.vectors} "
                           f"vectors of {block.index} ({target.vector_registers} vector registers)")
            if tile.packed and tile.grouped_by is not None:  # the panels replace a tile of k
                tile, in_place, change = _grouped_pack_sources(nest, tile, factors, assignment.terms[nest.term],
                                                               infos, dims, itemsize, target, reasons)
                transposes = [((t, k), mode_order) for (t, k), mode_order in transposes
                              if t != nest.term or k not in in_place]
                cost += change
                total += change
                tiles = tuple(t for t in nest.tiles if t.index != block.index)
                nest = replace(nest, tiles=tiles, panels=_panels(nest.order, tiles, factors))
            elif tile.packed:  # the panels replace a tile of k; the pack, and scalar loads, read any layout
                in_place = {n for n, f in enumerate(factors)
                            if not f.sparse and (n in tile.packed or block.index not in (i for i, _ in f.levels))}
                transposes = [((t, k), mode_order) for (t, k), mode_order in transposes
                              if t != nest.term or k not in in_place]
                tiles = tuple(t for t in nest.tiles if t.index != block.index)
                nest = replace(nest, tiles=tiles, panels=_panels(nest.order, tiles, factors))
                cost /= GEMM_SPEEDUP
                total -= nest.cost - cost
                reasons.append(f"term {nest.term}: factor(s) {list(tile.packed)} packed per thread: costed as a "
                               f"dense GEMM (cost / {GEMM_SPEEDUP:g})")
        packed = None
        if tile is None:
            nest, packed, in_place, change = _packed_block(nest, block, factors, assignment.terms[nest.term], infos,
                                                           assignment.output, dims, itemsize, target, reasons)
            transposes = [((t, k), mode_order) for (t, k), mode_order in transposes
                          if t != nest.term or k not in in_place]
            cost += change
            total += change
        sums = microkernel.block_sums(nest.order, assignment.output, factors, block, tile, itemsize, target)
        blocked.append(replace(nest, register_block=block, register_tile=tile, block_sums=sums, cost=cost,
                               packed_block=packed))
    patterns = tuple(info.pattern for info in infos)
    units = frozenset(i for i, size in dims.items() if size == 1 and i not in assignment.output)
    nests = [_dense_decisions(nest, n, factors, assignment, target, patterns, units)
             for n, (nest, factors) in enumerate(zip(blocked, nest_factors))]
    if assignment.epilogue is not None and len(nests) == 1:
        nests[0] = replace(nests[0], epilogue_at=_epilogue_at(nests[0], assignment.output, nest_factors[0]))
    nests = [replace(nest, team_loops=_team_loops(nest, factors, assignment.output, dims, target))
             if nest.parallel else nest for nest, factors in zip(nests, nest_factors)]
    wide = target.wide_register_block_vectors
    for nest in nests:
        if nest.register_block is not None and nest.register_tile is None:
            block = nest.register_block
            vectors = block.size // target.lanes(itemsize)
            why = "tile" if vectors == wide else "do not tile"
            masked = "; the last, partial block masked" if dims[block.index] % block.size else ""
            sums = f"; {nest.block_sums} interleaved sums" if nest.block_sums > 1 else ""
            reasons.append(
                f"term {nest.term}: register block of {block.size} over {block.index} ({vectors} vectors: "
                f"{wide}-vector blocks {why} {block.index} exactly{masked}{sums})"
            )
    return Schedule(
        None, output_order, (), tuple(nests), None, tuple(transposes), total, tuple(reasons), leaf_total
    )


def _grouped_pack_sources(nest: Nest, tile: RegisterTile, factors: list[Factor], term: Term,
                          infos: Sequence[OperandInfo], dims: dict[str, int], itemsize: int, target: Target,
                          reasons: list[str]) -> tuple[RegisterTile, tuple[int, ...], float]:
    """(tile, factors read in place, change of the nest's cost) of a packed grouped tile
    whose packs may read a copied vector factor where it is (``microkernel.grouped_pack_sources``):
    each factor packed in place is read in its memory order, its copy's cost replaced by
    its transposing packs'; ``reasons`` gets each choice."""
    layouts = {n: term.factors[n].indices for n in tile.packed
               if not factors[n].in_place and infos[term.factors[n].operand].layout is None}
    sources = microkernel.grouped_pack_sources(tile, nest.order, layouts, dims, itemsize, target)
    change = 0.0
    for source in sources:
        reasons.append(f"term {nest.term}: {source.describe()}")
        if source.in_place:
            f = factors[source.factor]
            change += source.transposing_cycles / target.cycles_per_cost_unit - f.transpose_cost \
                - target.relayout_cycles / target.cycles_per_cost_unit
            memory = layouts[source.factor]
            factors[source.factor] = replace(f, levels=sorted(f.levels, key=lambda level: memory.index(level[0])),
                                             natural=True, in_place=True)
    in_place = tuple(source.factor for source in sources if source.in_place)
    return replace(tile, transposed=in_place), in_place, change


def _packed_block(nest: Nest, block: Tile | None, factors: list[Factor], term: Term,
                  infos: Sequence[OperandInfo], output: tuple[str, ...], dims: dict[str, int], itemsize: int,
                  target: Target, reasons: list[str]) -> tuple[Nest, PackedBlock | None, tuple[int, ...], float]:
    """(nest, packed block, factors read in place, change of the nest's cost) of a
    register block whose copied vector factor may be packed where it is
    (``block_pack.packed_block``): the factor is then read from its packs, laid out in
    loop order, its copy's cost replaced by theirs, and the panels replace the nest's
    cache tile of the block's loop; ``reasons`` gets the choice."""
    layouts = {n: _memory_order(term.factors[n].indices, infos[term.factors[n].operand].layout)
               for n, f in enumerate(factors) if not f.sparse}
    packed, source = block_pack.packed_block(nest.order, output, factors, block, nest.tiles, layouts, dims, itemsize,
                                             target)
    if source is None or packed is None:
        if source is not None:
            reasons.append(f"term {nest.term}: register block's {source.describe()}")
        return nest, None, (), 0.0
    reasons.append(f"term {nest.term}: register block's {source.describe()}")
    tiles = tuple(t for t in nest.tiles if t.index != block.index)
    nest = replace(nest, tiles=tiles, panels=_panels(nest.order, tiles, factors))
    f = factors[source.factor]
    change = source.transposing_cycles / target.cycles_per_cost_unit - f.transpose_cost \
        - target.relayout_cycles / target.cycles_per_cost_unit
    factors[source.factor] = replace(f, in_place=True)  # its pack is laid out in loop order
    return nest, packed, (source.factor,), change


def _memory_order(indices: tuple[str, ...], layout: tuple[int, ...] | None) -> tuple[str, ...]:
    """A dense factor's indices in its operand's memory order (``layout``: its modes, outermost first)."""
    return tuple(indices) if layout is None else tuple(indices[m] for m in layout)


def _schedule_sparse(assignment, infos, dims, output_format: Format, target: Target) -> Schedule:
    out_order = tuple(assignment.output[m] for m in output_format.mode_order)
    best = None
    for p in range(decisions.inserted_levels(output_format), len(out_order) + 1):
        shared = out_order[:p]
        rest = out_order[p:]
        nests, transposes, reasons, total = [], [], [], 0.0
        leaf_total = 0.0
        for t, term in enumerate(assignment.terms):
            local = [i for i in _nest_indices(term, assignment.output) if i not in shared]
            candidates = _orders(local, lambda o, term=term: nest_cost(term, shared + o, infos, dims, target)[0],
                                 _storage_orders(term, infos))
            costs = {o: nest_cost(term, shared + o, infos, dims, target)[0] for o in candidates}
            order = min(candidates, key=lambda o: costs[o])
            _, leaves, factors = nest_cost(term, shared + order, infos, dims, target)
            prefetch = decisions.prefetch_loops(order, [f.nest_factor() for f in factors], set(), None, 0)
            nests.append(Nest(t, order, (), p > 0, costs[order], prefetch=prefetch))
            transposes += _transposes(t, factors, term)
            reasons.append(_explain_choice(t, shared + order, {shared + o: c for o, c in costs.items()}, factors, p > 0))
            total += costs[order]
            leaf_total += leaves
        workspace = None
        if rest:
            size = math.prod(dims[i] for i in rest)
            kind = "dense" if size <= DENSE_WORKSPACE_LIMIT else "sparse"
            outer = max(math.prod(dims[i] for i in shared), 1)
            per_row = max(min(leaf_total / outer, size), 1.0)
            drain = leaf_total * math.log2(per_row + 2)
            if kind == "sparse":
                drain *= SPARSE_ACCUMULATOR_COST
            total += drain + leaf_total
            workspace = Workspace(kind, rest, size)
        if p == 0:
            total *= SERIAL_PENALTY
        reasons.append(
            f"shared output loops {list(shared)}"
            + (f", {workspace.kind} workspace over {list(rest)}" if workspace else ", no workspace")
            + f": cost {total:.3g}"
        )
        assembly = decisions.output_assembly(output_format, None if workspace is None else workspace.kind)
        candidate = Schedule(
            output_format, out_order, shared, tuple(nests), workspace, tuple(transposes), total,
            tuple(reasons), leaf_total, assembly=assembly,
            union_by_points=decisions.union_by_points(len(assignment.terms)),
        )
        if best is None or candidate.cost < best.cost:
            best = candidate
    return best


def _explain_choice(t, best, costs, factors, parallel) -> str:
    ranked = sorted(costs.items(), key=lambda kv: kv[1])
    runner = f"; next best {','.join(ranked[1][0])} (cost {ranked[1][1]:.3g})" if len(ranked) > 1 else ""
    filters = [
        f"{i}: {sum(1 for f in factors if f.nest_factor().filters(i))} sparse level(s)"
        for i in best
    ]
    moved = [f.operand for f in factors if f.sparse and not f.natural]
    copied = [f.operand for f in factors if not f.sparse and not f.in_place]
    in_place = [f.operand for f in factors if not f.sparse and f.in_place and not f.natural]
    text = (
        f"term {t}: order {','.join(best)} (cost {costs[best]:.3g}{runner}); "
        f"filters {'; '.join(filters)}; {'parallel' if parallel else 'serial'} outer loop"
    )
    if moved:
        text += f"; re-stores operand(s) {moved} in loop order (transpose)"
    if copied:
        text += f"; copies dense operand(s) {copied} into loop order"
    if in_place:
        text += f"; reads dense operand(s) {in_place} in place (memory already in loop order)"
    return text
