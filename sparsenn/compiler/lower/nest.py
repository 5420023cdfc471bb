"""Lowering: a scheduled assignment to C++ loop nests that co-iterate level formats.

The lowerer never asks "is this CSR?". It walks each factor's storage levels in loop
order and uses only the level capabilities (TACO's format abstraction):

* a *locatable* (dense) level under parent position ``p`` has child ``p * N + i``;
* a *compressed* level iterates ``crd[pos[p] .. pos[p+1])``;
* a *singleton* level has exactly one coordinate per parent position, or, under a
  non-unique parent, iterates the parent's segment of equal coordinates;
* a *non-unique* level (followed by a singleton) groups equal coordinates into a
  segment ``[q, qe)`` that its child iterates.

At each loop the factors whose next level is indexed by the loop variable are
co-iterated: no sparse level gives a dense loop (locating dense levels), one sparse
level a loop over its positions, several sparse levels a merge that visits only their
intersection (a product is zero elsewhere). Sums of terms with a sparse output are
co-iterated as a *union* of the terms' streams at the shared output loops; below them a
workspace absorbs scattered writes. The outermost loop is split into coordinate chunks
(``lower_bound`` into sparse levels) that OpenMP threads take dynamically.

Inner loops: an innermost reduction over one compressed level sums into several
independent accumulators, and a loop over a compressed level's positions prefetches the
dense rows (``d[..., crd[q + D], :]``) that position ``q + D`` will gather, when they
are likely to miss the caches (see :meth:`_Lowerer.prefetcher`). A loop over a
compressed level whose body is a dense vector reduction runs blocks of ROW_BLOCK
positions whose reductions share the loads of the factors not indexed by the level
(SDDMM's ``X[i, :]`` for four ``Y[j, :]``) and one transpose-and-add of their sums.

Dense outputs are added into, except by a first nest that stores each element exactly
once (its output loops are outermost and visit every coordinate): it stores with ``=``
and the caller skips zeroing the output, which saves a pass over it (SpMM k=32 on a
2·10^6-nonzero matrix: 1.1-1.25x).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sparsenn.formats import Format

from ..notation import Assignment, Term
from ..plan.schedule import Nest, Schedule
from .context import Slot

__all__ = ["Slot", "LoweredKernel", "lower"]

# Independent sums of an innermost sparse reduction. 8 (tried for fibers of 16+ entries)
# was up to 5 % faster on cache-resident rows but 1.75x slower on uniform 2^19's SpMV
# (20 entries per row, x in the last-level cache).
SPARSE_ACCUMULATORS = 4
ROW_BLOCK = 4  # stored entries whose dense reductions share loads of their common factors
ROW_BLOCK_VECTORS = 1  # SIMD accumulators per entry of a row block (its self.s.target.row_block sums interleave)
PREFETCH_AHEAD_BYTES = 4096  # gathered bytes in flight ahead of the current position
PREFETCH_MAX_DISTANCE = 64  # positions ahead, at most
PREFETCH_MAX_BYTES = 1024  # of one gathered span; the hardware streams the rest
# Whether a loop over a fiber prefetches its gathers (decided per fiber, see
# _Lowerer.prefetcher): never when the gathered dense operands fit the L2; when they take
# self.s.target.prefetch_min_footprint of the last-level cache or more, if the coordinate D positions
# ahead is self.s.target.prefetch_min_jump or more from the first (near ones, as in banded patterns,
# are streamed by the hardware); in between, only for fibers whose coordinates spread
# over half the range (random patterns; local ones reuse what neighbouring fibers
# loaded). Prefetching where it was not needed cost 10-40 % (SpMM, SDDMM).
PREFETCH_MIN_FOOTPRINT = 0.25
PREFETCH_MIN_JUMP = 8


@dataclass(frozen=True)
class _State:
    """A factor during lowering: which storage level it reads next and where it is."""

    slot: int
    levels: tuple[tuple[str, str, bool], ...]  # (index, letter, unique); () if dense tensor
    dense_indices: tuple[str, ...]  # for a dense tensor: its indices, row-major
    depth: int = 0
    pos: str = "0"
    seg_end: str | None = None

    @property
    def sparse(self) -> bool:
        return bool(self.levels)

    def next_index(self) -> str | None:
        return self.levels[self.depth][0] if self.depth < len(self.levels) else None


class _Writer:
    def __init__(self, depth: int = 2):
        self.lines: list[str] = []
        self.depth = depth
        self.counter = 0

    def line(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def open(self, text: str) -> None:
        self.line(text + " {")
        self.depth += 1

    def close(self, text: str = "}") -> None:
        self.depth -= 1
        self.line(text)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"


class _Lowerer:
    def __init__(self, assignment: Assignment, sched: Schedule, formats: Sequence[Format | None]):
        self.a = assignment
        self.s = sched
        self.w = _Writer()
        self.indices = tuple(sorted({i for t in assignment.terms for i in t.indices} | set(assignment.output)))
        self.slots: list[Slot] = []
        self.formats = formats
        # (loop position, index, block start, block end) while a register block is open
        self.block: tuple[int, str, str, str] | None = None
        # Set while lowering a dense output: an innermost loop over an output index then
        # writes a different element per iteration (see emit_loop's ``independent``).
        self.dense_output = False

    # -- names ---------------------------------------------------------------
    def var(self, index: str) -> str:
        return f"i{self.indices.index(index)}"

    def dim(self, index: str) -> str:
        return f"N{self.indices.index(index)}"

    def slot_of(self, slot: Slot) -> int:
        if slot not in self.slots:
            self.slots.append(slot)
        return self.slots.index(slot)

    def initial_states(self, t: int, term: Term) -> list[_State]:
        states = []
        for k, access in enumerate(term.factors):
            fmt = self.formats[access.operand]
            order = self.s.factor_mode_order(t, k)
            if fmt is None:
                n = self.slot_of(Slot(access.operand, None, order))
                indices = access.indices if order is None else tuple(access.indices[m] for m in order)
                states.append(_State(n, (), indices))
                continue
            if order is not None and order != fmt.mode_order:
                fmt = Format(fmt.levels, order, None)
            n = self.slot_of(Slot(access.operand, fmt))
            levels = tuple(
                (access.indices[m], lvl.letter, lvl.unique) for m, lvl in zip(fmt.mode_order, fmt.levels)
            )
            states.append(_State(n, levels, ()))
        return states

    def declare_dims(self) -> None:
        for n, _ in enumerate(self.indices):
            self.w.line(f"const int64_t N{n} = dims[{n}]; (void)N{n};")

    def offset(self, indices: Sequence[str], at: dict[str, str] | None = None) -> str:
        """Row-major linear offset of ``indices`` (Horner form), at the current values
        of the index variables or at the expressions ``at`` gives."""
        if not indices:
            return "0"
        value = (at or {}).get
        expr = value(indices[0], self.var(indices[0]))
        for index in indices[1:]:
            expr = f"({expr}) * {self.dim(index)} + {value(index, self.var(index))}"
        return expr

    def level_size(self, st: _State, depth: int) -> str:
        """Number of positions of ``st``'s storage level ``depth`` (a compressed level's
        ``crd`` length): parents times N for a dense level, ``pos[parents]`` for a
        compressed one, the parents for a singleton."""
        if depth < 0:
            return "1"
        index, letter, _ = st.levels[depth]
        parents = self.level_size(st, depth - 1)
        if letter == "d":
            return f"({parents}) * {self.dim(index)}"
        if letter == "c":
            return f"(int64_t)s{st.slot}_pos{depth}[{parents}]"
        return parents

    def product(
        self, states: Sequence[_State], only: Sequence[int] | None = None, at: dict[str, str] | None = None
    ) -> str:
        """The product of the factors' values at their current positions (of the
        factors numbered in ``only``, if given; dense tensors at ``at``, see :meth:`offset`)."""
        parts = []
        for k, st in enumerate(states):
            if only is not None and k not in only:
                continue
            if st.sparse:
                parts.append(f"s{st.slot}_val[{st.pos}]")
            else:
                parts.append(f"d{st.slot}[{self.offset(st.dense_indices, at)}]")
        return " * ".join(parts) if parts else "V(1)"

    # -- one loop of an intersection -----------------------------------------------
    def level_range(self, st: _State) -> tuple[str, str]:
        _, letter, _ = st.levels[st.depth]
        arr = f"s{st.slot}"
        if letter == "c":
            return f"{arr}_pos{st.depth}[{st.pos}]", f"{arr}_pos{st.depth}[{st.pos} + 1]"
        if st.seg_end is not None:
            return st.pos, st.seg_end
        return st.pos, f"{st.pos} + 1"

    def crd(self, st: _State) -> str:
        return f"s{st.slot}_crd{st.depth}"

    def open_cursor(
        self, st: _State, bounds: tuple[str, str] | None, active: str = "true"
    ) -> tuple[str, str, str]:
        """Declare ``q``/``h`` spanning ``st``'s next (sparse) level: its whole range, or
        only coordinates in ``bounds``; empty unless the C++ condition ``active``."""
        w = self.w
        lo, hi = self.level_range(st)
        q, h, crd = w.fresh("q"), w.fresh("h"), self.crd(st)
        guard = (lambda expr: expr) if active == "true" else (lambda expr: f"{active} ? (I)({expr}) : (I)0")
        if bounds is not None:
            w.line(f"const I {h}_0 = {guard(hi)};")
            w.line(f"I {q} = {guard(f'std::lower_bound({crd} + {lo}, {crd} + {h}_0, (I)({bounds[0]})) - {crd}')};")
            w.line(f"const I {h} = {guard(f'std::lower_bound({crd} + {q}, {crd} + {h}_0, (I)({bounds[1]})) - {crd}')};")
        else:
            w.line(f"I {q} = {guard(lo)};")
            w.line(f"const I {h} = {guard(hi)};")
        return q, h, crd

    def emit_loop(
        self,
        index: str,
        states: list[_State],
        body: Callable[[list[_State]], None],
        bounds: tuple[str, str] | None = None,
        reduction: str | None = None,
        gathers: Sequence[tuple[int, dict[str, str], str]] = (),
        blocked: Callable[[str, str, str, Callable[[str, str], None] | None], None] | None = None,
        independent: bool = False,
    ) -> None:
        """Co-iterate ``index`` over the factors in ``states`` (intersection).

        ``reduction`` names a scalar the body sums into; an innermost dense loop then
        carries ``omp simd reduction`` so the sum vectorises (IEEE order is otherwise
        kept, which forbids it). ``independent``: the body writes a different output
        element per iteration, so a dense loop carries ``omp simd`` (the vectoriser's
        cost model would leave a loop of runtime length scalar). ``gathers`` (see
        :meth:`gathered_spans`) are prefetched ahead when a single sparse level drives
        the loop. ``blocked(q, h, crd, prefetch)``, given, emits a loop over whole
        blocks of a single unique sparse level's positions first; the plain loop then
        takes the rest."""
        w, var, n = self.w, self.var(index), self.dim(index)
        sparse = self.sparse_at(index, states)
        new = list(states)

        def locate_dense():
            self.locate_dense(index, states, new)

        if not sparse:
            lo, hi = bounds or ("0", n)
            if bounds is not None:
                end = w.fresh("end")
                w.line(f"const int64_t {end} = {hi};")
                hi = end
            if reduction is not None:
                w.line(f"#pragma omp simd reduction(+:{reduction})")
            elif independent:
                w.line("#pragma omp simd")
            w.open(f"for (int64_t {var} = {lo}; {var} < {hi}; ++{var})")
            locate_dense()
            body(new)
            w.close()
            return

        ranges = [(k, *self.open_cursor(states[k], bounds)) for k in sparse]

        def advance_end(k, q, h, crd):
            """Segment end of the coordinate at q (q + 1 for a unique level)."""
            unique = states[k].levels[states[k].depth][2]
            if unique:
                return f"({q} + 1)", None
            e = w.fresh("e")
            w.line(f"I {e} = {q} + 1;")
            w.line(f"while ({e} < {h} && {crd}[{e}] == {crd}[{q}]) ++{e};")
            return e, e

        if len(ranges) == 1:
            k, q, h, crd = ranges[0]
            unique = states[k].levels[states[k].depth][2]

            def fiber(prefetch: Callable[[str, str], None] | None) -> None:
                if blocked is not None and unique:
                    blocked(q, h, crd, prefetch)
                w.open(f"while ({q} < {h})" if not unique else f"for (; {q} < {h}; ++{q})")
                w.line(f"const int64_t {var} = {crd}[{q}];")
                if prefetch:
                    prefetch(q, crd)
                end, seg = advance_end(k, q, h, crd)
                new[k] = replace(states[k], depth=states[k].depth + 1, pos=q, seg_end=seg)
                locate_dense()
                body(new)
                if not unique:
                    w.line(f"{q} = {end};")
                w.close()

            if not gathers:
                fiber(None)
                return
            flag, prefetch = self.prefetcher(states, states[k], gathers, q, h, crd)
            w.open(f"if ({flag})")
            fiber(prefetch)
            w.close()
            w.open("else")
            fiber(None)
            w.close()
            return

        cond = " && ".join(f"{q} < {h}" for _, q, h, _ in ranges)
        w.open(f"while ({cond})")
        coords = []
        for k, q, h, crd in ranges:
            c = w.fresh("c")
            w.line(f"const int64_t {c} = {crd}[{q}];")
            coords.append(c)
        w.line(f"const int64_t {var} = std::min({{{', '.join(coords)}}});")
        ends = []
        for (k, q, h, crd), c in zip(ranges, coords):
            unique = states[k].levels[states[k].depth][2]
            if unique:
                ends.append(f"({q} + 1)")
                new[k] = replace(states[k], depth=states[k].depth + 1, pos=q, seg_end=None)
            else:
                e = w.fresh("e")
                w.line(f"I {e} = {q} + 1;")
                w.line(f"if ({c} == {var}) while ({e} < {h} && {crd}[{e}] == {c}) ++{e};")
                ends.append(e)
                new[k] = replace(states[k], depth=states[k].depth + 1, pos=q, seg_end=e)
        w.open(f"if ({' && '.join(f'{c} == {var}' for c in coords)})")
        locate_dense()
        body(new)
        w.close()
        for (k, q, h, crd), c, e in zip(ranges, coords, ends):
            w.line(f"if ({c} == {var}) {q} = {e};")
        w.close()

    def gathered_spans(
        self, order: Sequence[str], position: int, states: Sequence[_State], bounds: dict[str, tuple[str, str]]
    ) -> list[tuple[int, dict[str, str], str]]:
        """Dense factors ``d[P, index, T]`` that each iteration of loop ``order[position]``
        reads a contiguous span of: ``P`` bound by enclosing loops, ``T`` non-empty and
        swept by the loops inside (whole rows, a tile of one index, or the open register
        block). Returns (factor, start of ``T``, span length in elements)."""
        index, inner, bound = order[position], order[position + 1:], set(order[:position])
        spans = []
        for k, st in enumerate(states):
            if st.sparse or index not in st.dense_indices:
                continue
            n = st.dense_indices.index(index)
            prefix, trailing = st.dense_indices[:n], st.dense_indices[n + 1:]
            if not trailing or not set(prefix) <= bound:
                continue
            last = trailing[-1]
            if trailing == (last,) and last in inner and last in bounds:
                start, end = bounds[last]
            elif trailing == (last,) and self.block is not None and self.block[1] == last and position >= self.block[0]:
                start, end = self.block[2:]
            elif all(t in inner and t not in bounds for t in trailing):
                start, end = "0", " * ".join(self.dim(t) for t in trailing)
            else:
                continue
            spans.append((k, {t: "0" for t in trailing} | {last: start}, f"({end}) - ({start})"))
        return spans

    def prefetcher(
        self, states: Sequence[_State], driver: _State, gathers: Sequence[tuple[int, dict[str, str], str]],
        q: str, h: str, crd: str,
    ) -> tuple[str, Callable[[str, str], None]]:
        """For a loop over ``driver``'s positions ``[q, h)``: declare whether to prefetch
        in it, and return that flag and the emitter of the per-iteration prefetch of the
        spans ``gathers`` at coordinate ``crd[min(q + D, last position)]`` (running on
        into the next segment, never past the array). ``D`` keeps about
        self.s.target.prefetch_ahead_bytes in flight. The flag follows the rule above
        PREFETCH_MIN_FOOTPRINT; the caller emits the loop once with prefetches and once
        without."""
        w = self.w
        size, dist, last, on = w.fresh("pfbytes"), w.fresh("pfdist"), w.fresh("pflast"), w.fresh("pfon")
        spans = ", ".join(f"(int64_t)sizeof(V) * ({n})" for _, _, n in gathers)
        w.line(f"const int64_t {size}[{len(gathers)}] = {{{spans}}};")
        total = " + ".join(f"{size}[{g}]" for g in range(len(gathers)))
        w.line(
            f"const int64_t {dist} = std::min<int64_t>({self.s.target.prefetch_max_distance}, "
            f"{self.s.target.prefetch_ahead_bytes} / std::max<int64_t>({total}, 1) + 1);"
        )
        w.line(f"const int64_t {last} = {self.level_size(driver, driver.depth)} - 1;")
        footprint, bytes_ = w.fresh("pfsize"), " + ".join(
            f"(int64_t)sizeof(V) * {' * '.join(self.dim(i) for i in states[k].dense_indices)}" for k, _, _ in gathers
        )
        l2, llc = self.s.target.l2_bytes, self.s.target.llc_bytes
        first, extent = f"(int64_t){crd}[{q}]", self.dim(driver.levels[driver.depth][0])
        w.line(f"const int64_t {footprint} = {bytes_};")
        w.line(
            f"const bool {on} = {q} < {h} && {footprint} > (int64_t){l2} && ({footprint} >= "
            f"(int64_t){int(llc * PREFETCH_MIN_FOOTPRINT)} ? std::abs((int64_t){crd}[std::min<int64_t>({q} + {dist}, "
            f"{last})] - {first}) >= {self.s.target.prefetch_min_jump} : 2 * ((int64_t){crd}[{h} - 1] - {first}) >= {extent});"
        )

        def emit(q: str, crd: str) -> None:
            ahead = w.fresh("ahead")
            w.line(f"const int64_t {ahead} = {crd}[std::min<int64_t>({q} + {dist}, {last})];")
            index = driver.levels[driver.depth][0]
            for g, (k, at, _) in enumerate(gathers):
                st = states[k]
                w.line(
                    f"sn_prefetch(d{st.slot} + {self.offset(st.dense_indices, {**at, index: ahead})}, "
                    f"std::min<int64_t>({size}[{g}], {self.s.target.prefetch_max_bytes}));"
                )

        return on, emit

    def emit_order(
        self,
        order: Sequence[str],
        states: list[_State],
        leaf: Callable[[list[_State]], None],
        bounds: dict[str, tuple[str, str]],
        around: dict[int, tuple[Callable[[list[_State]], None], Callable[[list[_State]], None]]] | None = None,
        position: int = 0,
        accumulator: str | None = None,
        summed: tuple[str, Sequence[int]] | None = None,
    ) -> None:
        """Emit ``order[position:]`` as nested loops, ``around[j]`` wrapping loop j;
        the leaf sums into ``accumulator`` (if given) over the loops inside it.

        ``summed = (coefficient, factors)`` says the leaf is ``accumulator +=
        coefficient * product(factors)``; an innermost loop that qualifies is then
        emitted as a multi-accumulator SIMD reduction (:meth:`emit_vector_reduction`)."""
        if position == len(order):
            leaf(states)
            return
        before, after = (around or {}).get(position, (None, None))
        if before:
            before(states)
        innermost = position == len(order) - 1
        vector = summed is not None and innermost and self.unit_stride_factors(order[position], states, summed[1])
        driver = self.sparse_driver(order[position], states) if summed is not None else None
        blocked = None
        if driver is not None and position == len(order) - 2:
            blocked = self.row_blocker(order, position, states, driver, around or {}, accumulator, summed, bounds)
        if vector:
            self.emit_vector_reduction(order[position], states, accumulator, summed, vector, bounds.get(order[position]))
        elif driver is not None and innermost:
            self.emit_sparse_reduction(order[position], states, driver, accumulator, summed, bounds.get(order[position]))
        else:
            self.emit_loop(
                order[position],
                states,
                lambda st: self.emit_order(order, st, leaf, bounds, around, position + 1, accumulator, summed),
                bounds.get(order[position]),
                accumulator if innermost else None,
                self.gathered_spans(order, position, states, bounds),
                blocked,
                innermost and accumulator is None and self.dense_output and order[position] in self.a.output,
            )
        if after:
            after(states)

    def sparse_at(self, index: str, states: Sequence[_State]) -> list[int]:
        """The factors whose next storage level, over ``index``, is sparse."""
        return [k for k, st in enumerate(states) if st.next_index() == index and st.levels[st.depth][1] != "d"]

    def locate_dense(self, index: str, states: Sequence[_State], new: list[_State]) -> None:
        """Into ``new``: the factors whose next level, over ``index``, is dense, located
        at the current coordinate (position = parent position * N + coordinate)."""
        for k, st in enumerate(states):
            if st.next_index() == index and st.levels[st.depth][1] == "d":
                p = self.w.fresh("p")
                self.w.line(f"const int64_t {p} = (int64_t){st.pos} * {self.dim(index)} + {self.var(index)};")
                new[k] = replace(st, depth=st.depth + 1, pos=p, seg_end=None)

    def sparse_driver(self, index: str, states: Sequence[_State]) -> int | None:
        """The factor whose unique compressed level alone drives loop ``index`` (the
        other factors indexed there locate dense levels or are dense tensors), if any."""
        sparse = self.sparse_at(index, states)
        if len(sparse) != 1:
            return None
        _, letter, unique = states[sparse[0]].levels[states[sparse[0]].depth]
        return sparse[0] if letter == "c" and unique else None

    def emit_sparse_reduction(
        self, index: str, states: list[_State], driver: int, accumulator: str,
        summed: tuple[str, Sequence[int]], bounds: tuple[str, str] | None,
    ) -> None:
        """``accumulator += coef * sum_q prod(factors at crd[q])`` over the driver's
        positions, into self.s.target.sparse_accumulators independent sums (position q feeds sum
        ``q mod SPARSE_ACCUMULATORS`` of the unrolled loop), so that consecutive adds do
        not wait on each other's latency; a scalar tail takes the last positions."""
        w = self.w
        coef, factors = summed
        st = states[driver]
        acc = w.fresh("sacc")
        w.open("")
        q, h, crd = self.open_cursor(st, bounds)

        def step(position: str, target: str) -> None:
            new = self.enter(index, states, driver, position, crd)
            w.line(f"{target} += {self.product(new, factors)};")

        n = SPARSE_ACCUMULATORS
        w.line(f"V {acc}[{n}] = {{}};")
        w.open(f"for (; {q} + {n} <= {h}; {q} += {n})")
        w.line("#pragma GCC unroll 16")
        w.open(f"for (int u = 0; u < {n}; ++u)")
        step(f"{q} + u", f"{acc}[u]")
        w.close()
        w.close()
        w.open(f"for (; {q} < {h}; ++{q})")
        step(q, f"{acc}[0]")
        w.close()
        w.line(f"for (int u = 1; u < {n}; ++u) {acc}[0] += {acc}[u];")
        w.line(f"{accumulator} += {coef} * {acc}[0];")
        w.close()

    def enter(self, index: str, states: Sequence[_State], driver: int, position: str, crd: str) -> list[_State]:
        """Bind ``index`` to the coordinate at ``position`` of the driver's unique
        sparse level (which ``crd`` names) and locate the dense levels indexed by it."""
        w, var = self.w, self.var(index)
        w.line(f"const int64_t {var} = {crd}[{position}]; (void){var};")
        new = list(states)
        new[driver] = replace(states[driver], depth=states[driver].depth + 1, pos=position, seg_end=None)
        self.locate_dense(index, states, new)
        return new

    def row_blocker(
        self, order: Sequence[str], position: int, states: list[_State], driver: int,
        around: dict[int, tuple[Callable[[list[_State]], None], Callable[[list[_State]], None]]],
        accumulator: str, summed: tuple[str, Sequence[int]], bounds: dict[str, tuple[str, str]],
    ) -> Callable[[str, str, str, Callable[[str, str], None] | None], None] | None:
        """Blocks of self.s.target.row_block positions for loop ``order[position]`` over ``driver``'s
        unique sparse level ``j`` whose body is an innermost unit-stride vector reduction
        over ``k`` with some factors ``s`` not indexed by ``j`` (SDDMM's ``X[i, k]``) and
        some ``g`` that are (``Y[j, k]``):

            for q in blocks: t[r] = sum_k prod s[k] * prod g[crd[q + r], k]  (r < ROW_BLOCK)

        loads each vector of ``prod s`` once per block instead of once per position.
        Each ``r`` then runs the loop body's epilogue with ``accumulator += coef * t[r]``.
        None if the loop does not qualify."""
        index, inner = order[position], order[position + 1]
        vectors = self.unit_stride_factors(inner, states, summed[1])
        shared = [k for k in vectors if index not in states[k].dense_indices]
        if self.s.target.row_block < 2 or not shared or len(shared) == len(vectors):
            return None
        before, after = around.get(position + 1, (None, None))
        coef, factors = summed
        scalars = [k for k in factors if k not in vectors]
        w = self.w

        def emit(q: str, h: str, crd: str, prefetch: Callable[[str, str], None] | None) -> None:
            w.open(f"for (; {q} + {self.s.target.row_block} <= {h}; {q} += {self.s.target.row_block})")
            rows = w.fresh("rows")
            w.line(f"const int64_t {rows}[{self.s.target.row_block}] = {{{', '.join(f'{crd}[{q} + {r}]' for r in range(ROW_BLOCK))}}};")
            if prefetch:
                for r in range(ROW_BLOCK):
                    prefetch(f"{q} + {r}", crd)
            totals = self.emit_row_block_reduction(inner, states, vectors, shared, f"{rows}[r]", index, bounds.get(inner))
            for r in range(ROW_BLOCK):
                w.open("")
                new = self.enter(index, states, driver, f"{q} + {r}", crd)
                if before:
                    before(new)
                w.line(f"{accumulator} += {' * '.join([coef, *([self.product(new, scalars)] if scalars else []), f'{totals}[{r}]'])};")
                if after:
                    after(new)
                w.close()
            w.close()

        return emit

    def emit_row_block_reduction(
        self, index: str, states: list[_State], vectors: Sequence[int], shared: Sequence[int],
        row: str, row_index: str, bounds: tuple[str, str] | None,
    ) -> str:
        """Declare ``t[ROW_BLOCK]``, ``t[r] = sum_index prod(vectors)`` with ``row_index``
        at ``row`` (an expression of ``r``); see :meth:`row_blocker`. The ``shared``
        factors' product is loaded once per vector for all ``r``; each ``r`` sums into
        self.s.target.row_block_vectors SIMD accumulators (then single vectors, if several), then
        scalars."""
        w, var, n = self.w, self.var(index), self.dim(index)
        lo, hi = bounds or ("0", n)
        acc, end, total, x = w.fresh("rsum"), w.fresh("end"), w.fresh("rtot"), w.fresh("x")
        at = {row_index: row}
        own = [k for k in vectors if k not in shared]
        R, A = ROW_BLOCK, ROW_BLOCK_VECTORS

        def fma(v: str, lane: str) -> None:
            w.line(f"const VV {x} = {' * '.join(self.vector_load(states[k], lane=lane) for k in shared)};")
            w.line("#pragma GCC unroll 16")
            loads = " * ".join(self.vector_load(states[k], at, lane) for k in own)
            w.line(f"for (int r = 0; r < {R}; ++r) {acc}[r][{v}] += {x} * {loads};")

        w.line(f"V {total}[{R}];")
        w.open("")
        w.line(f"const int64_t {end} = {hi};")
        w.line(f"VV {acc}[{R}][{A}] = {{}};")
        w.line(f"int64_t {var} = {lo};")
        w.open(f"for (; {var} + {A} * SN_W <= {end}; {var} += {A} * SN_W)")
        w.line("#pragma GCC unroll 16")
        w.open(f"for (int v = 0; v < {A}; ++v)")
        fma("v", "v * SN_W")
        w.close()
        w.close()
        if A > 1:
            w.open(f"for (; {var} + SN_W <= {end}; {var} += SN_W)")
            fma("0", "0")
            w.close()
        w.line(f"sn_hsums({acc}, {total});")
        w.open(f"for (; {var} < {end}; ++{var})")
        w.line("#pragma GCC unroll 16")
        w.line(f"for (int r = 0; r < {R}; ++r) {total}[r] += {self.product(states, vectors, at)};")
        w.close()
        w.close()
        return total

    def unit_stride_factors(self, index: str, states: Sequence[_State], factors: Sequence[int]) -> list[int]:
        """The factors (of ``factors``) indexed by ``index`` if every one of them is a
        dense tensor with ``index`` last (unit stride) and no sparse factor has it; else []."""
        if any(st.sparse and any(level[0] == index for level in st.levels) for st in states):
            return []
        with_index = [k for k in factors if index in states[k].dense_indices]
        if not with_index or any(states[k].dense_indices[-1] != index for k in with_index):
            return []
        return with_index

    def vector_load(self, st: _State, at: dict[str, str] | None = None, lane: str = "v * SN_W") -> str:
        """SIMD vector of a unit-stride dense factor ``lane`` elements past the current
        position (or past ``at``, see :meth:`offset`)."""
        return f"sn_load(d{st.slot} + {self.offset(st.dense_indices, at)} + {lane})"

    def emit_vector_reduction(
        self, index: str, states: list[_State], accumulator: str, summed: tuple[str, Sequence[int]],
        vectors: Sequence[int], bounds: tuple[str, str] | None,
    ) -> None:
        """``accumulator += coef * scalars * sum_index prod(vectors)`` with
        self.s.target.register_block_vectors independent SIMD accumulators (a single one would wait on
        each add's latency), then single vectors, a tree sum of the lanes, and a scalar
        tail."""
        w, var, n = self.w, self.var(index), self.dim(index)
        coef, factors = summed
        scalars = [k for k in factors if k not in vectors]
        lo, hi = bounds or ("0", n)
        acc, end, total = w.fresh("vsum"), w.fresh("end"), w.fresh("tot")
        block = f"{self.s.target.register_block_vectors} * SN_W"
        w.open("")
        w.line(f"const int64_t {end} = {hi};")
        w.line(f"VV {acc}[{self.s.target.register_block_vectors}] = {{}};")
        w.line(f"int64_t {var} = {lo};")
        w.open(f"for (; {var} + {block} <= {end}; {var} += {block})")
        loads = [self.vector_load(states[k]) for k in vectors]
        w.line("#pragma GCC unroll 16")
        w.line(f"for (int v = 0; v < {self.s.target.register_block_vectors}; ++v) {acc}[v] += {' * '.join(loads)};")
        w.close()
        w.open(f"for (; {var} + SN_W <= {end}; {var} += SN_W)")
        w.line(f"{acc}[0] += {' * '.join(self.vector_load(states[k], lane='0') for k in vectors)};")
        w.close()
        w.line(f"for (int v = 1; v < {self.s.target.register_block_vectors}; ++v) {acc}[0] += {acc}[v];")
        w.line(f"V {total} = sn_hsum({acc}[0]);")
        w.line(f"for (; {var} < {end}; ++{var}) {total} += {self.product(states, vectors)};")
        w.line(f"{accumulator} += {' * '.join([coef, *([self.product(states, scalars)] if scalars else []), total])};")
        w.close()


def _chunk_prologue(w: _Writer, extent: str) -> None:
    w.line(f"const int64_t sn_extent = {extent};")
    w.line("const int64_t sn_nchunks = std::min<int64_t>(sn_extent, (int64_t)nthreads * 8);")


def balancing_pos(lo: _Lowerer, states: Sequence[_State], index: str) -> str | None:
    """A ``pos`` array counting each outer coordinate's stored children, if a factor
    has one: its first level is dense over ``index`` and its second is compressed."""
    for st in states:
        if (
            len(st.levels) >= 2 and st.depth == 0 and st.pos == "0"
            and st.levels[0][0] == index and st.levels[0][1] == "d" and st.levels[1][1] == "c"
        ):
            return f"s{st.slot}_pos1"
    return None


def chunk_bounds(w: _Writer, chunk: str, nchunks: str, pos: str | None) -> None:
    """``sn_lo``/``sn_hi`` of chunk ``chunk`` of the outermost loop: equal coordinate
    ranges, or, given ``pos``, ranges with equal stored children plus coordinates
    (power-law rows then spread over the threads instead of landing on one)."""
    if pos is None:
        w.line(f"const int64_t sn_lo = sn_extent * {chunk} / {nchunks};")
        w.line(f"const int64_t sn_hi = sn_extent * ({chunk} + 1) / {nchunks};")
        return
    w.line(f"const int64_t sn_work = (int64_t){pos}[sn_extent] + sn_extent;")
    w.line(f"const int64_t sn_lo = sn_balanced_bound({pos}, sn_extent, sn_work * {chunk} / {nchunks});")
    w.line(
        f"const int64_t sn_hi = {chunk} + 1 == {nchunks} ? sn_extent : "
        f"sn_balanced_bound({pos}, sn_extent, sn_work * ({chunk} + 1) / {nchunks});"
    )


# ----------------------------------------------------------------------------- dense output


def anchor_factor(term: Term, output: tuple[str, ...], anchor: int) -> int:
    """The factor of ``term`` that reads operand ``anchor`` at exactly the output indices."""
    return next(k for k, f in enumerate(term.factors) if f.operand == anchor and f.indices == output)


def _output_offset(lo: _Lowerer, term: Term, anchor: int | None) -> Callable[[list[_State]], str]:
    """Where the leaf writes: the row-major output offset, or the anchor's position."""
    if anchor is None:
        dense = lo.offset(lo.s.output_order)
        return lambda states: dense
    k = anchor_factor(term, lo.a.output, anchor)
    return lambda states: states[k].pos


def _close_team(w: _Writer, body: int) -> None:
    """Close the parallel region whose body starts at line ``body``, and emit the same
    body again for one thread, where its ``omp for`` runs every chunk: starting a
    one-thread OpenMP team costs about a microsecond, more than a small kernel."""
    w.close()
    w.close()
    lines = w.lines[body:-2]
    w.open("else")
    w.lines += [line[2:] for line in lines]
    w.close()


def _reductions_from(order: Sequence[str], output: Sequence[str], end: int) -> int:
    """Where the run of reduction (non-output) loops just before ``order[end]`` starts
    (``end`` itself when ``order[end - 1]`` is an output loop)."""
    while end > 0 and order[end - 1] not in output:
        end -= 1
    return end


def _stores_each_output_once(lo: _Lowerer, nest: Nest, states: Sequence[_State], anchor: int | None) -> bool:
    """Whether ``nest`` stores every output element exactly once: the loops outside its
    trailing reductions (for a register block, ``P`` and ``k``, see
    :func:`_emit_register_blocked`, which anchored outputs do not take) are all of the
    output's indices, each visits every coordinate (no factor but the anchor has a
    sparse level over an output index), and no tile splits a reduction."""
    order, output = nest.order, set(lo.a.output)
    if nest.register_block is not None:
        if anchor is not None:
            return False
        output_loops = (*order[: _reductions_from(order, lo.a.output, len(order) - 1)], order[-1])
    else:
        output_loops = order[: _reductions_from(order, lo.a.output, len(order))]
    if set(output_loops) != output or any(tile.index not in output for tile in nest.tiles):
        return False
    anchor_k = None if anchor is None else anchor_factor(lo.a.terms[nest.term], lo.a.output, anchor)
    return all(
        letter == "d"
        for k, st in enumerate(states) if k != anchor_k
        for index, letter, _ in st.levels if index in output
    )


def _lower_dense_output(lo: _Lowerer, anchor: int | None) -> bool:
    """Emit every term's nest, adding into ``out``; the first nest stores with ``=``
    when it writes each output element once. Returns whether it does (the caller then
    need not zero the output)."""
    a, w = lo.a, lo.w
    lo.dense_output = True
    overwrites = False
    for n_nest, nest in enumerate(lo.s.nests):
        term = a.terms[nest.term]
        states = lo.initial_states(nest.term, term)
        offset = _output_offset(lo, term, anchor)
        coef = repr(float(term.coefficient))
        order = nest.order
        # Trailing reduction loops accumulate in a register, then add to the output once.
        split = _reductions_from(order, a.output, len(order))
        once = n_nest == 0 and _stores_each_output_once(lo, nest, states, anchor)
        if once:
            overwrites = True
        store = "=" if once else "+="
        around = {}
        acc = w.fresh("acc")
        summed = None  # the leaf's sum, for a vectorised innermost reduction
        if split < len(order):
            # Factors constant across the reduction loops multiply the sum once.
            inner = set(order[split:])
            outside = [k for k, f in enumerate(term.factors) if not inner & set(f.indices)]
            inside = [k for k in range(len(term.factors)) if k not in outside]
            summed = ("V(1)", inside)

            def after(st, acc=acc, offset=offset, outside=outside, store=store):
                scale = " * ".join([f"V({coef})", *([lo.product(st, outside)] if outside else [])])
                w.line(f"out[{offset(st)}] {store} {scale} * {acc};")

            around[split] = (lambda st, acc=acc: w.line(f"V {acc} = 0;"), after)

            def leaf(st, acc=acc, inside=inside):
                w.line(f"{acc} += {lo.product(st, inside)};")
        else:

            def leaf(st, offset=offset, store=store):
                w.line(f"out[{offset(st)}] {store} V({coef}) * {lo.product(st)};")

        tiles = [t for t in nest.tiles if t.index != order[0]]
        w.open("")
        if nest.parallel:
            w.open("if (nthreads > 1)")
            w.line("#pragma omp parallel num_threads(nthreads)")
            w.open("")
            team_body = len(w.lines)
        bounds = {}
        for tile in tiles:
            tv = f"T{lo.indices.index(tile.index)}"
            n = lo.dim(tile.index)
            w.open(f"for (int64_t {tv} = 0; {tv} < {n}; {tv} += {tile.size})")
            bounds[tile.index] = (tv, f"std::min<int64_t>({tv} + {tile.size}, {n})")
        if nest.parallel:
            _chunk_prologue(w, lo.dim(order[0]))
            w.line("#pragma omp for schedule(dynamic, 1)")
            w.open("for (int64_t sn_chunk = 0; sn_chunk < sn_nchunks; ++sn_chunk)")
            chunk_bounds(w, "sn_chunk", "sn_nchunks", balancing_pos(lo, states, order[0]))
            bounds[order[0]] = ("sn_lo", "sn_hi")
        if nest.register_block is not None:
            _emit_register_blocked(lo, term, order, states, offset, coef, bounds, nest.register_block.size, once)
        else:
            lo.emit_order(
                order, states, leaf, bounds, around,
                accumulator=acc if split < len(order) else None,
                summed=summed,
            )
        if nest.parallel:
            w.close()
        for _ in tiles:
            w.close()
        if nest.parallel:
            _close_team(w, team_body)
        w.close()
    return overwrites


def _emit_register_blocked(
    lo: _Lowerer, term: Term, order: Sequence[str], states: list[_State],
    offset: Callable[[list[_State]], str], coef: str, bounds: dict[str, tuple[str, str]], size: int,
    overwrite: bool = False,
) -> None:
    """``order = P + R + (k,)`` with ``k`` register-blocked (see schedule's module doc):

        for P: for kb in whole blocks of k: acc[0:size] = 0
                   for R: acc[:] += scalar factors * vector factors[kb : kb + size]
                   out[P, kb : kb + size] += coef * acc
               for R: for k in the last, partial block: out[P, k] += coef * product

    ``acc`` is ``size / SN_W`` SIMD vectors that the C++ compiler keeps in registers.
    With ``overwrite`` the blocks store ``coef * acc`` and the partial block's elements
    are zeroed before its loops add to them."""
    w, output = lo.w, lo.a.output
    k = order[-1]
    r = _reductions_from(order, output, len(order) - 1)
    with_k = lo.unit_stride_factors(k, states, range(len(term.factors)))
    if not with_k:
        raise AssertionError(f"register block over {k!r} needs unit-stride dense factors")
    scalars = [n for n in range(len(term.factors)) if n not in with_k]
    kb, acc, rest = w.fresh("kb"), w.fresh("vacc"), w.fresh("krest")
    var_k = lo.var(k)
    k_lo, n_k = bounds.get(k, ("0", lo.dim(k)))  # within a tile of k, if tiled
    if k in bounds:
        end = w.fresh("kend")
        w.line(f"const int64_t {end} = {n_k};")
        n_k = end

    def open_block(st: list[_State]) -> None:
        w.open(f"for (int64_t {kb} = {k_lo}; {kb} + {size} <= {n_k}; {kb} += {size})")
        w.line(f"VV {acc}[{size} / SN_W];")
        w.line("#pragma GCC unroll 16")
        w.line(f"for (int v = 0; v < {size} / SN_W; ++v) {acc}[v] = VV{{}};")

    def vector_leaf(st: list[_State]) -> None:
        w.line(f"const int64_t {var_k} = {kb};")
        loads = [lo.vector_load(st[n]) for n in with_k]
        w.line("#pragma GCC unroll 16")
        w.line(f"for (int v = 0; v < {size} / SN_W; ++v) {acc}[v] += {' * '.join([lo.product(st, scalars), *loads])};")

    def close_block(st: list[_State]) -> None:
        w.open("")
        w.line(f"const int64_t {var_k} = {kb};")
        w.line(f"V* const sn_row = out + {offset(st)};")
        w.line("#pragma GCC unroll 16")
        old = "" if overwrite else "sn_load(sn_row + v * SN_W) + "
        w.line(f"for (int v = 0; v < {size} / SN_W; ++v) sn_store(sn_row + v * SN_W, {old}V({coef}) * {acc}[v]);")
        w.close()
        w.close()
        w.line(f"const int64_t {rest} = {n_k} - ({n_k} - {k_lo}) % {size};")
        w.open(f"if ({rest} < {n_k})")
        if overwrite:
            w.line(f"for (int64_t {var_k} = {rest}; {var_k} < {n_k}; ++{var_k}) out[{offset(st)}] = 0;")

        def scalar_leaf(inner: list[_State]) -> None:
            w.line(f"out[{offset(inner)}] += V({coef}) * {lo.product(inner)};")

        lo.emit_order(order, st, scalar_leaf, {**bounds, k: (rest, n_k)}, None, position=r)
        w.close()

    lo.block = (r, k, kb, f"{kb} + {size}")
    lo.emit_order(order[:-1], states, vector_leaf, bounds, {r: (open_block, close_block)})
    lo.block = None
