"""Lowering of sparse outputs: shared output loops, workspaces and level assembly.

The output's storage levels are appended in order by the *shared* loops (a union of
the terms' streams when there are several terms); output levels below them are
scattered into a per-thread workspace and drained in sorted order.

* **Two-phase** (dense levels, then one compressed level: CSR, and its analogues of
  any rank ``d...dc``). ``sn_run`` runs the loops once for the pattern only and
  counts each parent's children, ``cnt[p + 1]``; ``pos = prefix sums of cnt`` then
  gives the exact output size, and ``sn_finish`` runs the loops again with values,
  writing parent ``p``'s children straight into ``crd/val[pos[p] .. pos[p + 1])`` of
  the caller's arrays, in parallel and without intermediate buffers.
* **Appended** (any other level structure). Each chunk of the outermost loop appends
  into its own buffers (per compressed level: coordinates, and per parent position
  the number of children); ``sn_finish`` turns the counts into ``pos`` arrays by
  prefix sums and copies the chunks in parallel.
"""

from __future__ import annotations

from dataclasses import replace

from .sparse_text import State as _State, TextLowerer as _Lowerer, balancing_pos, chunk_bounds, chunk_prologue
from ..notation import Term
from ..plan.schedule import Nest, Schedule

__all__ = ["lower_sparse_output", "two_phase"]


def two_phase(s: Schedule) -> bool:
    """Whether the output is assembled in two phases: one or more dense levels, then one
    compressed level (each row fits in one chunk), any workspace a dense one."""
    num_dense = s.output_format.dense_prefix
    return num_dense >= 1 and len(s.output_order) == num_dense + 1 and (
        s.workspace is None or s.workspace.kind == "dense"
    )


class _Output:
    """How :func:`_emit`'s shared loops assemble the output: each hook emits C++ at one
    point of the kernel; a hook a strategy does not need emits nothing."""

    values = True  # whether the loops compute values (else only the pattern)
    workspace: str | None = None  # the C++ workspace type, if the schedule has one

    def __init__(self, lo: _Lowerer):
        self.rank = len(lo.s.output_order)
        self.num_dense = lo.s.output_format.dense_prefix

    def start(self, lo: _Lowerer) -> None:
        """Before the chunks are laid out."""

    def chunks(self, lo: _Lowerer) -> None:
        """Once their number, ``sn_chunks``, is known."""

    def chunk(self, lo: _Lowerer) -> None:
        """At the start of chunk ``sn_chunk``."""

    def finish(self, lo: _Lowerer) -> None:
        """After the parallel region."""

    def open(self, lo: _Lowerer, level: int, coord: str) -> str | None:
        """Before visiting the children of output level ``level`` at ``coord``; returns
        the mark :meth:`close` gets."""
        return None

    def close(self, lo: _Lowerer, level: int, mark: str | None) -> None:
        """After visiting them."""

    def store(self, lo: _Lowerer, value: str) -> None:
        """One entry of the last output level, with ``value``."""

    def scatter(self, lo: _Lowerer, key: str, value: str) -> None:
        """Add ``value`` at workspace ``key``."""

    def drain(self, lo: _Lowerer, level: int) -> None:
        """The workspace's entries become output levels ``level`` and below."""


class _Append(_Output):
    """Appended assembly: per-chunk level buffers (``Chunk``), any level structure."""

    def __init__(self, lo: _Lowerer):
        super().__init__(lo)
        self.workspace = None if lo.s.workspace is None else "DenseWS" if lo.s.workspace.kind == "dense" else "SparseWS"

    def start(self, lo: _Lowerer) -> None:
        lo.w.line(f"Result* res = new Result({self.rank}, {self.num_dense});")
        lo.w.line("*handle = res;")

    def chunks(self, lo: _Lowerer) -> None:
        lo.w.line("res->chunks.resize(sn_chunks);")

    def chunk(self, lo: _Lowerer) -> None:
        lo.w.line("Chunk& C = res->chunks[sn_chunk];")
        lo.w.line("C.init(res->rank);")

    def open(self, lo: _Lowerer, level: int, coord: str) -> str | None:
        w, rank, num_dense = lo.w, self.rank, self.num_dense
        if level >= num_dense:
            w.line(f"C.crd[{level}].push_back({coord});")
        if level + 1 >= rank:
            return None
        mark = w.fresh("m")
        child = f"C.crd[{level + 1}].size()"
        if level >= num_dense or level + 1 == num_dense:
            w.line(f"const size_t {mark} = {child};")
            return mark
        return None

    def close(self, lo: _Lowerer, level: int, mark: str | None) -> None:
        if mark is None:
            return
        child = f"C.crd[{level + 1}].size()"
        if level >= self.num_dense:
            lo.w.line(f"if ({child} == {mark}) C.crd[{level}].pop_back(); "
                      f"else C.cnt[{level + 1}].push_back((int64_t)({child} - {mark}));")
        else:
            lo.w.line(f"C.cnt[{level + 1}].push_back((int64_t)({child} - {mark}));")

    def store(self, lo: _Lowerer, value: str) -> None:
        lo.w.line(f"C.val.push_back({value});")

    def scatter(self, lo: _Lowerer, key: str, value: str) -> None:
        lo.w.line(f"ws.add({key}, {value});")

    def drain(self, lo: _Lowerer, level: int) -> None:
        lo.w.line(f"ws.drain(C, {level}, {self.rank}, ws_dims);")


class _TwoPhase(_Output):
    """Both phases of a two-phase output: ``parent`` is the linear position of the
    current dense parent (a row), ``parents`` their number."""

    def __init__(self, lo: _Lowerer):
        super().__init__(lo)
        self.parent = lo.offset(lo.s.output_order[: self.num_dense])
        self.parents = " * ".join(lo.dim(i) for i in lo.s.output_order[: self.num_dense])


class _Count(_TwoPhase):
    """Phase 1: ``sn_cnt[p + 1]`` = children of dense parent ``p`` (pattern only: no
    values computed); then ``sn_cnt`` becomes ``pos`` by prefix sums."""

    values = False
    workspace = "CountWS"

    def start(self, lo: _Lowerer) -> None:
        w = lo.w
        w.line(f"Result* res = new Result({self.rank}, {self.num_dense});")
        w.line("*handle = res;")
        w.line("res->arrays = arrays;")
        w.line("res->dims = dims;")
        w.line(f"const int64_t sn_parents = {self.parents};")
        w.line("res->pos.assign(sn_parents + 1, 0);")
        w.line("int64_t* __restrict__ sn_cnt = res->pos.data();")

    def finish(self, lo: _Lowerer) -> None:
        lo.w.line("for (int64_t p = 0; p < sn_parents; ++p) sn_cnt[p + 1] += sn_cnt[p];")

    def open(self, lo: _Lowerer, level: int, coord: str) -> str | None:
        if level == self.num_dense - 1:
            lo.w.line("int64_t sn_n = 0;")
            return "sn_n"
        return None

    def close(self, lo: _Lowerer, level: int, mark: str | None) -> None:
        if mark is not None:
            lo.w.line(f"sn_cnt[{self.parent} + 1] = sn_n;")

    def store(self, lo: _Lowerer, value: str) -> None:
        lo.w.line("++sn_n;")

    def scatter(self, lo: _Lowerer, key: str, value: str) -> None:
        lo.w.line(f"ws.mark({key});")

    def drain(self, lo: _Lowerer, level: int) -> None:
        lo.w.line("sn_n = ws.count();")


class _Fill(_TwoPhase):
    """Phase 2 (``sn_finish``): parent ``p``'s children go to ``crd/val[pos[p] ..]`` of
    the caller's arrays (``out``: pos, crd, values)."""

    workspace = "FillWS"

    def __init__(self, lo: _Lowerer):
        super().__init__(lo)
        self.last = lo.var(lo.s.output_order[-1])

    def start(self, lo: _Lowerer) -> None:
        w = lo.w
        w.line("const int64_t* __restrict__ sn_pos = r->pos.data();")
        w.line("const IndexOut sn_out_pos{out[0], wide};")
        w.line("const IndexOut sn_out_crd{out[1], wide};")
        w.line("V* __restrict__ sn_out_val = (V*)out[2];")
        w.line("#pragma omp parallel for num_threads(nthreads)")
        w.line("for (int64_t p = 0; p < (int64_t)r->pos.size(); ++p) sn_out_pos.put(p, sn_pos[p]);")

    def open(self, lo: _Lowerer, level: int, coord: str) -> str | None:
        if level == self.num_dense - 1:
            lo.w.line(f"int64_t sn_q = sn_pos[{self.parent}];")
        return None

    def store(self, lo: _Lowerer, value: str) -> None:
        lo.w.line(f"sn_out_crd.put(sn_q, {self.last});")
        lo.w.line(f"sn_out_val[sn_q++] = {value};")

    def scatter(self, lo: _Lowerer, key: str, value: str) -> None:
        lo.w.line(f"ws.add({key}, {value});")

    def drain(self, lo: _Lowerer, level: int) -> None:
        lo.w.line("sn_q += ws.drain(sn_out_crd, sn_q, sn_out_val + sn_q);")


def lower_sparse_output(assignment, sched: Schedule, formats):
    """The sparse-output kernel's body, slots, index variables and, for a two-phase
    output, the body of its second phase (``sn_finish``'s fill), else None."""
    lo = _Lowerer(assignment, sched, formats)
    lo.declare_dims()
    if not two_phase(lo.s):
        _emit(lo, _Append(lo))
        return "\n".join(lo.w.lines), tuple(lo.slots), lo.indices, None
    _emit(lo, _Count(lo))
    fill = _Lowerer(lo.a, lo.s, lo.formats)
    fill.declare_dims()
    _emit(fill, _Fill(fill))
    assert fill.slots == lo.slots, "both phases read the operands through the same slots"
    return "\n".join(lo.w.lines), tuple(lo.slots), lo.indices, "\n".join(fill.w.lines)


def _emit(lo: _Lowerer, out: _Output) -> None:
    """Chunks of the first shared loop run the shared loops, assembling through ``out``."""
    a, s, w = lo.a, lo.s, lo.w
    shared = s.shared
    out.start(lo)
    chunk_prologue(w, lo.dim(shared[0]) if shared else "1")
    w.line("const int64_t sn_chunks = std::max<int64_t>(sn_nchunks, 1);")
    out.chunks(lo)
    w.line("int sn_error = 0;")
    w.line(f"#pragma omp parallel num_threads({'nthreads' if shared else '1'})")
    w.open("")
    if s.workspace is not None:
        ws = s.workspace
        w.line(f"{out.workspace} ws;")
        dims = ", ".join(lo.dim(i) for i in ws.indices)
        w.line(f"const int64_t ws_dims[] = {{{dims}}}; (void)ws_dims;")
        w.line(f"try {{ ws.init({' * '.join(lo.dim(i) for i in ws.indices)}); }} catch (const std::bad_alloc&) {{ sn_fail(sn_error); }}")
    w.line("#pragma omp for schedule(dynamic, 1)")
    w.open("for (int64_t sn_chunk = 0; sn_chunk < sn_chunks; ++sn_chunk)")
    w.line("if (sn_error) continue;")
    w.open("try")
    out.chunk(lo)
    terms = [(n.term, a.terms[n.term], n) for n in s.nests]
    states = {t: lo.initial_states(t, term) for t, term, _ in terms}
    balance = balancing_pos(lo, states[terms[0][0]], shared[0]) if shared and len(terms) == 1 else None
    chunk_bounds(w, "sn_chunk", "sn_chunks", balance)
    if len(terms) == 1:
        _shared_single(lo, out, terms[0], states[terms[0][0]], 0)
    else:
        _shared_union(lo, out, terms, states, {t: "true" for t, _, _ in terms}, 0)
    w.close("} catch (const std::bad_alloc&) { sn_fail(sn_error); }")
    w.close()  # chunk loop
    w.close()  # parallel region
    w.line("if (sn_error) return sn_error;")
    out.finish(lo)


def _term_value(lo: _Lowerer, t: int, term: Term, nest: Nest, states: list[_State], target: str) -> None:
    """Emit ``target += coef * sum_{local loops} product`` (no output index left)."""
    w = lo.w
    coef = repr(float(term.coefficient))

    def leaf(st):
        w.line(f"{target} += V({coef}) * {lo.product(st)};")

    lo.emit_order(nest.order, states, leaf, {}, accumulator=target)


def _workspace_fill_and_drain(lo, out, terms, states_of, active, level: int) -> None:
    """Each active term scatters into the workspace; then drain it into levels >= level."""
    w, s = lo.w, lo.s
    ws = s.workspace
    for t, term, nest in terms:
        coef = repr(float(term.coefficient))

        def leaf(st, coef=coef):
            out.scatter(lo, lo.offset(ws.indices), f"V({coef}) * {lo.product(st)}" if out.values else "")

        w.open(f"if ({active[t]})")
        lo.emit_order(nest.order, states_of[t], leaf, {})
        w.close()
    out.drain(lo, level)


def _shared_single(lo: _Lowerer, out: _Output, term_info, states, level) -> None:
    """Shared output loops for a single term: plain intersection co-iteration."""
    w, s = lo.w, lo.s
    t, term, nest = term_info
    if level == len(s.shared):
        if s.workspace is not None:
            _workspace_fill_and_drain(lo, out, [term_info], {t: states}, {t: "true"}, level)
            return
        if out.values:
            w.line("V sn_val = 0;")
            _term_value(lo, t, term, nest, states, "sn_val")
        out.store(lo, "sn_val")
        return
    index = s.shared[level]
    if level < out.num_dense and any(st.next_index() == index and not st.levels[st.depth][1].locatable for st in states):
        # A dense output level needs every coordinate (each gets a count), but the
        # term's stream visits only the stored ones: walk them all as a union does.
        _shared_union(lo, out, [term_info], {t: states}, {t: "true"}, level)
        return
    bounds = ("sn_lo", "sn_hi") if level == 0 else None

    def body(st):
        mark = out.open(lo, level, lo.var(index))
        _shared_single(lo, out, term_info, st, level + 1)
        out.close(lo, level, mark)

    lo.emit_loop(index, states, body, bounds)


def _shared_union(lo: _Lowerer, out: _Output, terms, states, active, level) -> None:
    """Shared output loops for a sum: co-iterate the union of the terms' streams.

    Each term's stream at this loop is the intersection of its sparse levels (or every
    coordinate, if it has none); ``active[t]`` is the C++ condition that term ``t``
    contributes under the enclosing coordinates.
    """
    w, s = lo.w, lo.s
    if level == len(s.shared):
        if s.workspace is not None:
            _workspace_fill_and_drain(lo, out, terms, states, active, level)
            return
        if out.values:
            w.line("V sn_val = 0;")
            for t, term, nest in terms:
                w.open(f"if ({active[t]})")
                _term_value(lo, t, term, nest, states[t], "sn_val")
                w.close()
        out.store(lo, "sn_val")
        return
    index = s.shared[level]
    var, n = lo.var(index), lo.dim(index)
    bounds = ("sn_lo", "sn_hi") if level == 0 else None
    dense_level = level < out.num_dense
    # Per term: cursors over its sparse levels at this index.
    cursors = {}
    any_dense_term = False
    for t, _, _ in terms:
        its = []
        for k, st in enumerate(states[t]):
            if st.next_index() == index and not st.levels[st.depth][1].locatable:
                q, h, crd = lo.open_cursor(st, bounds, active[t])
                its.append((k, q, h, crd))
        cursors[t] = its
        any_dense_term |= not its
    lo_b, hi_b = bounds or ("0", n)
    if dense_level or any_dense_term:
        # Every coordinate may be present: walk them all, advancing sparse cursors.
        w.open(f"for (int64_t {var} = {lo_b}; {var} < {hi_b}; ++{var})")
        coord_of = {}
        for t, _, _ in terms:
            if not cursors[t]:
                coord_of[t] = None
                continue
            for k, q, h, crd in cursors[t]:
                w.line(f"while ({q} < {h} && {crd}[{q}] < {var}) ++{q};")
            coord_of[t] = " && ".join(f"{q} < {h} && {crd}[{q}] == {var}" for _, q, h, crd in cursors[t])
        hit = {t: (active[t] if c is None else f"({c})") for t, c in coord_of.items()}
    else:
        # All terms sparse here: step to the smallest next coordinate of any term.
        w.open("for (;;)")
        cts = {}
        for t, _, _ in terms:
            ct = w.fresh("ct")
            cts[t] = ct
            its = cursors[t]
            w.line(f"int64_t {ct} = INT64_MAX;")
            w.open("for (;;)")
            w.line(f"if ({' || '.join(f'{q} >= {h}' for _, q, h, _ in its)}) break;")
            w.line(f"const int64_t mx = std::max({{(int64_t){', (int64_t)'.join(f'{crd}[{q}]' for _, q, _, crd in its)}}});")
            for _, q, h, crd in its:
                w.line(f"while ({q} < {h} && {crd}[{q}] < mx) ++{q};")
            w.line(f"if ({' || '.join(f'{q} >= {h}' for _, q, h, _ in its)}) break;")
            w.line(f"if ({' && '.join(f'{crd}[{q}] == mx' for _, q, _, crd in its)}) {{ {ct} = mx; break; }}")
            w.close()
        w.line(f"const int64_t {var} = std::min({{{', '.join(cts.values())}}});")
        w.line(f"if ({var} == INT64_MAX) break;")
        hit = {t: f"({cts[t]} == {var})" for t, _, _ in terms}
    # Segment ends and new positions for the terms present at this coordinate.
    new_states, new_active, advances = {}, {}, []
    for t, _, _ in terms:
        flag = w.fresh("a")
        w.line(f"const bool {flag} = {hit[t]};")
        new_active[t] = flag
        st_list = list(states[t])
        for k, q, h, crd in cursors[t]:
            st = st_list[k]
            if st.levels[st.depth][1].unique:
                st_list[k] = replace(st, depth=st.depth + 1, pos=q, seg_end=None)
                advances.append((flag, q, f"{q} + 1"))
            else:
                e = w.fresh("e")
                w.line(f"I {e} = {q} + 1;")
                w.line(f"if ({flag}) while ({e} < {h} && {crd}[{e}] == {crd}[{q}]) ++{e};")
                st_list[k] = replace(st, depth=st.depth + 1, pos=q, seg_end=e)
                advances.append((flag, q, e))
        for k, st in enumerate(st_list):
            if st.next_index() == index and st.levels[st.depth][1].locatable:
                p = w.fresh("p")
                w.line(f"const int64_t {p} = (int64_t){st.pos} * {n} + {var};")
                st_list[k] = replace(st, depth=st.depth + 1, pos=p, seg_end=None)
        new_states[t] = st_list
    any_active = " || ".join(new_active.values())
    w.open(f"if ({any_active})" if not dense_level else "")
    mark = out.open(lo, level, var)
    _shared_union(lo, out, terms, new_states, new_active, level + 1)
    out.close(lo, level, mark)
    w.close()
    for flag, q, end in advances:
        w.line(f"if ({flag}) {q} = {end};")
    w.close()

