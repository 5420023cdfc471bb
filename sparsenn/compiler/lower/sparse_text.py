"""C++ text of sparse-output loop nests (used by :mod:`.assemble` only).

Sparse-output assembly is not yet on the loop IR: this writer emits its loops as C++
lines, co-iterating levels as :mod:`.merge` does for dense outputs (locate locatable
levels, walk the positions of one iterated level, merge several), and prefetching the
gathers of single-level loops under the schedule's
:class:`~..plan.decisions.PrefetchPolicy`. Nothing here post-processes emitted text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sparsenn.formats import Format
from sparsenn.formats.level import Level

from ..notation import Assignment, Term
from ..plan.schedule import Schedule
from .context import Slot

__all__ = ["TextLowerer", "State", "chunk_prologue", "balancing_pos", "chunk_bounds"]


@dataclass(frozen=True)
class State:
    """A factor during lowering: which storage level it reads next and where it is."""

    slot: int
    levels: tuple[tuple[str, Level], ...]  # (index, level) in loop order; () if dense tensor
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


class TextLowerer:
    def __init__(self, assignment: Assignment, sched: Schedule, formats: Sequence[Format | None]):
        self.a = assignment
        self.s = sched
        self.w = _Writer()
        self.indices = tuple(sorted({i for t in assignment.terms for i in t.indices} | set(assignment.output)))
        self.slots: list[Slot] = []
        self.formats = formats

    # -- names ---------------------------------------------------------------
    def var(self, index: str) -> str:
        return f"i{self.indices.index(index)}"

    def dim(self, index: str) -> str:
        return f"N{self.indices.index(index)}"

    def slot_of(self, slot: Slot) -> int:
        if slot not in self.slots:
            self.slots.append(slot)
        return self.slots.index(slot)

    def initial_states(self, t: int, term: Term) -> list[State]:
        states = []
        for k, access in enumerate(term.factors):
            fmt = self.formats[access.operand]
            order = self.s.factor_mode_order(t, k)
            if fmt is None:
                n = self.slot_of(Slot(access.operand, None, order))
                indices = access.indices if order is None else tuple(access.indices[m] for m in order)
                states.append(State(n, (), indices))
                continue
            if order is not None and order != fmt.mode_order:
                fmt = Format(fmt.levels, order, None)
            n = self.slot_of(Slot(access.operand, fmt))
            levels = tuple(
                (access.indices[m], lvl) for m, lvl in zip(fmt.mode_order, fmt.levels)
            )
            states.append(State(n, levels, ()))
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

    def level_size(self, st: State, depth: int) -> str:
        """Number of positions of ``st``'s storage level ``depth`` (a compressed level's
        ``crd`` length): parents times N for a dense level, ``pos[parents]`` for a
        compressed one, the parents for a singleton."""
        if depth < 0:
            return "1"
        index, level = st.levels[depth]
        parents = self.level_size(st, depth - 1)
        if level.locatable:
            return f"({parents}) * {self.dim(index)}"
        if level.has_pos:
            return f"(int64_t)s{st.slot}_pos{depth}[{parents}]"
        return parents

    def product(
        self, states: Sequence[State], only: Sequence[int] | None = None, at: dict[str, str] | None = None
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
    def level_range(self, st: State) -> tuple[str, str]:
        _, level = st.levels[st.depth]
        arr = f"s{st.slot}"
        if level.has_pos:
            return f"{arr}_pos{st.depth}[{st.pos}]", f"{arr}_pos{st.depth}[{st.pos} + 1]"
        if st.seg_end is not None:
            return st.pos, st.seg_end
        return st.pos, f"{st.pos} + 1"

    def crd(self, st: State) -> str:
        return f"s{st.slot}_crd{st.depth}"

    def open_cursor(
        self, st: State, bounds: tuple[str, str] | None, active: str = "true"
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
        states: list[State],
        body: Callable[[list[State]], None],
        bounds: tuple[str, str] | None = None,
        reduction: str | None = None,
        gathers: Sequence[tuple[int, dict[str, str], str]] = (),
    ) -> None:
        """Co-iterate ``index`` over the factors in ``states`` (intersection).

        ``reduction`` names a scalar the body sums into; an innermost dense loop then
        carries ``omp simd reduction`` so the sum vectorises (IEEE order is otherwise
        kept, which forbids it). ``gathers`` (see :meth:`gathered_spans`) are
        prefetched ahead when a single sparse level drives the loop."""
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
            w.open(f"for (int64_t {var} = {lo}; {var} < {hi}; ++{var})")
            locate_dense()
            body(new)
            w.close()
            return

        ranges = [(k, *self.open_cursor(states[k], bounds)) for k in sparse]

        def advance_end(k, q, h, crd):
            """Segment end of the coordinate at q (q + 1 for a unique level)."""
            unique = states[k].levels[states[k].depth][1].unique
            if unique:
                return f"({q} + 1)", None
            e = w.fresh("e")
            w.line(f"I {e} = {q} + 1;")
            w.line(f"while ({e} < {h} && {crd}[{e}] == {crd}[{q}]) ++{e};")
            return e, e

        if len(ranges) == 1:
            k, q, h, crd = ranges[0]
            unique = states[k].levels[states[k].depth][1].unique

            def fiber(prefetch: Callable[[str, str], None] | None) -> None:
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
            unique = states[k].levels[states[k].depth][1].unique
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
        self, order: Sequence[str], position: int, states: Sequence[State], bounds: dict[str, tuple[str, str]]
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
            elif all(t in inner and t not in bounds for t in trailing):
                start, end = "0", " * ".join(self.dim(t) for t in trailing)
            else:
                continue
            spans.append((k, {t: "0" for t in trailing} | {last: start}, f"({end}) - ({start})"))
        return spans

    def prefetcher(
        self, states: Sequence[State], driver: State, gathers: Sequence[tuple[int, dict[str, str], str]],
        q: str, h: str, crd: str,
    ) -> tuple[str, Callable[[str, str], None]]:
        """For a loop over ``driver``'s positions ``[q, h)``: declare whether to prefetch
        in it, and return that flag and the emitter of the per-iteration prefetch of the
        spans ``gathers`` at coordinate ``crd[min(q + D, last position)]`` (running on
        into the next segment, never past the array). ``D`` keeps the policy's
        ``ahead_bytes`` in flight; the flag is the policy's test. The caller emits the
        loop once with prefetches and once without."""
        w, policy = self.w, self.s.prefetch_policy
        size, dist, last, on = w.fresh("pfbytes"), w.fresh("pfdist"), w.fresh("pflast"), w.fresh("pfon")
        spans = ", ".join(f"(int64_t)sizeof(V) * ({n})" for _, _, n in gathers)
        w.line(f"const int64_t {size}[{len(gathers)}] = {{{spans}}};")
        total = " + ".join(f"{size}[{g}]" for g in range(len(gathers)))
        w.line(
            f"const int64_t {dist} = std::min<int64_t>({policy.max_distance}, "
            f"{policy.ahead_bytes} / std::max<int64_t>({total}, 1) + 1);"
        )
        w.line(f"const int64_t {last} = {self.level_size(driver, driver.depth)} - 1;")
        footprint, bytes_ = w.fresh("pfsize"), " + ".join(
            f"(int64_t)sizeof(V) * {' * '.join(self.dim(i) for i in states[k].dense_indices)}" for k, _, _ in gathers
        )
        first, extent = f"(int64_t){crd}[{q}]", self.dim(driver.levels[driver.depth][0])
        w.line(f"const int64_t {footprint} = {bytes_};")
        w.line(
            f"const bool {on} = {q} < {h} && {footprint} > (int64_t){policy.min_bytes} && ({footprint} >= "
            f"(int64_t){policy.large_bytes} ? std::abs((int64_t){crd}[std::min<int64_t>({q} + {dist}, "
            f"{last})] - {first}) >= {policy.min_jump} : 2 * ((int64_t){crd}[{h} - 1] - {first}) >= {extent});"
        )

        def emit(q: str, crd: str) -> None:
            ahead = w.fresh("ahead")
            w.line(f"const int64_t {ahead} = {crd}[std::min<int64_t>({q} + {dist}, {last})];")
            index = driver.levels[driver.depth][0]
            for g, (k, at, _) in enumerate(gathers):
                st = states[k]
                w.line(
                    f"sn_prefetch(d{st.slot} + {self.offset(st.dense_indices, {**at, index: ahead})}, "
                    f"std::min<int64_t>({size}[{g}], {policy.max_bytes}));"
                )

        return on, emit

    def emit_order(
        self,
        order: Sequence[str],
        states: list[State],
        leaf: Callable[[list[State]], None],
        bounds: dict[str, tuple[str, str]],
        around: dict[int, tuple[Callable[[list[State]], None], Callable[[list[State]], None]]] | None = None,
        position: int = 0,
        accumulator: str | None = None,
    ) -> None:
        """Emit ``order[position:]`` as nested loops, ``around[j]`` wrapping loop j;
        the leaf sums into ``accumulator`` (if given) over the loops inside it."""
        if position == len(order):
            leaf(states)
            return
        before, after = (around or {}).get(position, (None, None))
        if before:
            before(states)
        innermost = position == len(order) - 1
        self.emit_loop(
            order[position],
            states,
            lambda st: self.emit_order(order, st, leaf, bounds, around, position + 1, accumulator),
            bounds.get(order[position]),
            accumulator if innermost else None,
            self.gathered_spans(order, position, states, bounds),
        )
        if after:
            after(states)

    def sparse_at(self, index: str, states: Sequence[State]) -> list[int]:
        """The factors whose next storage level, over ``index``, is sparse."""
        return [k for k, st in enumerate(states) if st.next_index() == index and not st.levels[st.depth][1].locatable]

    def locate_dense(self, index: str, states: Sequence[State], new: list[State]) -> None:
        """Into ``new``: the factors whose next level, over ``index``, is dense, located
        at the current coordinate (position = parent position * N + coordinate)."""
        for k, st in enumerate(states):
            if st.next_index() == index and st.levels[st.depth][1].locatable:
                p = self.w.fresh("p")
                self.w.line(f"const int64_t {p} = (int64_t){st.pos} * {self.dim(index)} + {self.var(index)};")
                new[k] = replace(st, depth=st.depth + 1, pos=p, seg_end=None)


def chunk_prologue(w: _Writer, extent: str) -> None:
    w.line(f"const int64_t sn_extent = {extent};")
    w.line("const int64_t sn_nchunks = std::min<int64_t>(sn_extent, (int64_t)nthreads * 8);")


def balancing_pos(lo: TextLowerer, states: Sequence[State], index: str) -> str | None:
    """A ``pos`` array counting each outer coordinate's stored children, if a factor
    has one: its first level is dense over ``index`` and its second is compressed."""
    for st in states:
        if (
            len(st.levels) >= 2 and st.depth == 0 and st.pos == "0"
            and st.levels[0][0] == index and st.levels[0][1].locatable and st.levels[1][1].has_pos
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
