"""The backward of a program, itself a program the planner fuses.

Reverse mode through a program's stages (:mod:`.program_autograd`) computes, from the
last stage to the first, ``d(input n of stage k) += dR_k · ∂f_k/∂(input n)``: one
gradient einsum per moving input (:func:`.autograd.gradient_call`). Instead of running
them one by one, :func:`gradient_program` writes them down as the stages of a second
program over the incoming gradients, the forward's operands and saved results and the
gradients' extra inputs (all-ones tensors, patterns), which
:func:`~.runtime.programs.run_program` then fuses as it fuses a forward.

Gradients are kept as sums of *parts* (an assignment over sources, not yet a stage) as
long as they are pointwise: a part that reduces nothing is substituted into the
gradient einsums that read it (its terms multiply theirs), and only a part that reduces
(a softmax's ``dZ[i] = sum_j dP E ...``), a gradient several einsums read, or a caller's
operand's gradient becomes a stage. A softmax's backward is then two stages, the row
sums and ``dS = (dP / Z + dZ) E`` on the pattern, which fuse into one pass per row.

A result only the gradients read need not be kept when a later stage normalised it:
``R<X> = X / Y`` (or ``X · (1 / Y)``) on ``X``'s pattern, with ``R`` kept, gives
``X = R · Y`` (:func:`rebuilt_results`). The forward then writes ``R`` over ``X``'s array,
and each gradient reading ``X``'s values reads ``R · Y`` instead (:func:`_rebuild_reads`):
a softmax ``P<E> = E · (1 / Z)``'s backward reads ``P``, as one written by hand would.
Exact wherever ``Y`` is finite and nonzero; elsewhere ``R`` is not finite, or 0 where
``X`` is not.

An operand or result stored in a dense format (its values in storage order, not on a
pattern) has its gradient laid out apart: :func:`gradient_program` returns None, and the
stages' gradients run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor

from .autograd import gradient_call
from .derivatives import differentiated
from .frontend.functions import factors_of, product, renumbered
from .frontend.notation import Access, Apply, Assignment, Constant, Factor, Term, Value
from .frontend.program import Program, Source, Stage, StageResult, UserOperand, stage_inputs
from .plan.planner import shared_patterns
from .runtime.cache import LRUCache

__all__ = ["GradientProgram", "Rebuilt", "gradient_program", "gradient_values", "moves", "rebuilt_results"]


@dataclass(frozen=True)
class GradientProgram:
    """A program whose operands are ``inputs`` and whose stage ``outputs[n]`` computes the
    gradient of the caller's operand ``n`` (None: no gradient flows to it)."""

    program: Program
    inputs: tuple
    outputs: tuple[int | None, ...]


@dataclass(frozen=True)
class Rebuilt:
    """A stage's result the backward computes as ``R · Y`` instead of the forward keeping
    it: ``R`` the result of stage ``stage``, ``Y`` read at ``positions`` of its indices."""

    stage: int
    divisor: StageResult
    positions: tuple[int, ...]


def rebuilt_results(program: Program, read: frozenset[int], kept: frozenset[int]) -> dict[int, Rebuilt]:
    """The results among ``read`` (results the gradients read, none of ``kept``) that a
    later stage normalised (see the module doc): its result ``R<X> = X / Y`` on ``X``'s
    pattern, in ``read`` or ``kept``, ``Y`` a dense earlier result. Not a result a max's
    (or min's) gradient reads, which compares its values."""
    rebuilt = {}
    for k in sorted(read - kept):
        step = program.stages[k]
        if not isinstance(step.out_format, Format) or step.out_format.is_dense:
            continue
        readers = [j for j, s in enumerate(program.stages) if j == k or StageResult(k) in s.inputs]
        if any(program.stages[j].assignment.reduction != "sum" for j in readers):
            continue
        for m in readers:
            found = _normalisation(program, k, m)
            if found is not None and (m in read or m in kept):
                rebuilt[k] = found
                break
    return rebuilt


def _normalisation(program: Program, k: int, m: int) -> Rebuilt | None:
    """Stage ``m`` as ``R<X> = X / Y`` (or ``X · (1 / Y)``) of stage ``k``'s result ``X``,
    ``Y`` an earlier dense result read at some of ``X``'s indices; else None."""
    step = program.stages[m]
    a = step.assignment
    if m <= k or step.out_format != program.stages[k].out_format or a.reduction != "sum" or len(a.terms) != 1:
        return None
    (term,) = a.terms
    if term.coefficient != 1.0 or len(term.factors) != 2:
        return None
    x, y = (0, 1) if step.inputs[term.factors[0].operand] == StageResult(k) else (1, 0)
    ax, ay = term.factors[x], term.factors[y]
    source = step.inputs[ay.operand]
    if (step.inputs[ax.operand] != StageResult(k) or ax.indices != a.output or not set(ay.indices) <= set(a.output)
            or not isinstance(source, StageResult) or program.stages[source.stage].out_format != "dense"
            or source == StageResult(k)):
        return None
    fx, fy = Factor(x), Factor(y)
    reciprocal = Apply("div", (Constant(1.0), fy))
    if term.value not in (Apply("mul", (fx, reciprocal)), Apply("mul", (reciprocal, fx)), Apply("div", (fx, fy))):
        return None
    return Rebuilt(m, source, tuple(a.output.index(i) for i in ay.indices))


@dataclass(frozen=True)
class _Part:
    """A term of a gradient not computed yet: ``assignment`` over ``sources``; its result
    would be ``out_format``, standing in as ``like`` (pattern or shape only)."""

    assignment: Assignment
    sources: tuple[Source, ...]
    out_format: object
    like: object

    @property
    def pointwise(self) -> bool:
        """Whether it reduces nothing (every index of every term is an output index)."""
        output = set(self.assignment.output)
        return self.assignment.reduction == "sum" and all(
            set(a.indices) <= output for t in self.assignment.terms for a in t.factors)


class _Builder:
    """The stages and operands of a gradient program as they are written down."""

    def __init__(self, rebuilt: dict[int, tuple]) -> None:
        self.stages: list[Stage] = []
        self.likes: list = []  # per stage, what its result stands for
        self.inputs: list = []
        self._slots: dict[int, int] = {}
        self.rebuilt = rebuilt  # id of a rebuilt result's stand-in -> (R, Y, positions)

    def value(self, source: Source):
        """The operand, or the stand-in of the stage's result, that ``source`` names."""
        return self.inputs[source.n] if isinstance(source, UserOperand) else self.likes[source.stage]

    def operand(self, value) -> UserOperand:
        """``value`` as an operand of the program (each object once)."""
        slot = self._slots.get(id(value))
        if slot is None:
            slot = self._slots[id(value)] = len(self.inputs)
            self.inputs.append(value)
        return UserOperand(slot)

    def program(self) -> tuple[Program, tuple]:
        """The stages written down, over the operands they read (a rebuilt result's
        stand-in is read no more)."""
        used = sorted({s.n for stage in self.stages for s in stage.inputs if isinstance(s, UserOperand)})
        number = {n: m for m, n in enumerate(used)}
        stages = tuple(Stage(stage.assignment, stage.out_format, tuple(
            UserOperand(number[s.n]) if isinstance(s, UserOperand) else s for s in stage.inputs))
            for stage in self.stages)
        return Program(stages), tuple(self.inputs[n] for n in used)

    def identity(self, source: Source, like) -> _Part:
        """The part that is ``source`` as it is."""
        indices = tuple(f"@{m}" for m in range(len(like.shape)))
        assignment = Assignment(indices, (Term(1.0, (Access(0, indices),)),), ("d",))
        return _Part(assignment, (source,), _format_of(like), like)

    def stage(self, parts: Sequence[_Part]) -> _Part:
        """The sum of ``parts`` computed by a stage, as the part reading its result."""
        if len(parts) == 1 and _is_identity(parts[0]) and isinstance(parts[0].sources[0], StageResult):
            return parts[0]
        assignment, sources = _summed(parts)
        self.stages.append(Stage(assignment, parts[0].out_format, sources))
        self.likes.append(parts[0].like)
        return self.identity(StageResult(len(self.stages) - 1), parts[0].like)


def gradient_program(program: Program, moving: Sequence[bool], operands: Sequence, results: dict,
                     flowing: dict, needed: Sequence[bool], rebuilt: dict[int, Rebuilt],
                     per_call: bool) -> GradientProgram | None:
    """The gradients of the caller's ``operands`` that are ``needed``, as a program (see
    the module doc): ``results`` the forward's results the gradients read (stage ->
    result; a ``rebuilt`` one's pattern alone), ``flowing`` the incoming gradients
    (stage -> gradient of its result, laid out as the result), ``moving`` per stage
    whether its result moves with the operands needing gradients. None when an operand
    or result is stored in a dense format.

    Written once per signature of the call (formats, shapes, dtypes, shared index
    arrays): its operands are then the call's own, found where they were found when it
    was written, or constants (all-ones tensors); ``per_call``: a max's gradient reads tie
    counts computed from the call's values, so the program is written for this call only."""
    if any(isinstance(x, SparseTensor) and x.format.is_dense for x in (*operands, *results.values())):
        return None
    sources = {("operand", n): x for n, x in enumerate(operands)}
    sources.update((("result", k), x) for k, x in results.items())
    sources.update((("flowing", k), x) for k, x in flowing.items())
    key = None if per_call else (program, tuple(moving), tuple(needed), tuple(rebuilt.items()), _signature(sources))
    written = None if key is None else _written.get(key)
    if written is None:
        written = _write(program, moving, operands, results, flowing, needed, rebuilt, sources)
        if key is not None:
            _written.put(key, written)
    program, places, outputs = written
    return GradientProgram(program, tuple(sources[p] if isinstance(p, tuple) else p.value for p in places), outputs)


@dataclass(frozen=True)
class _Constant:
    """An operand of a written gradient program that every call shares."""

    value: object


_written: LRUCache[tuple] = LRUCache("gradient programs", 256)


def _signature(sources: dict) -> tuple:
    """What writing a gradient program depends on besides the program: each source's
    layout (format, shape, dtype), which of them are one object (read as one operand),
    and which share index arrays."""
    values = list(sources.values())
    layouts = tuple((place, x.format if isinstance(x, SparseTensor) else None, tuple(x.shape),
                     x.values.dtype if isinstance(x, SparseTensor) else x.dtype) for place, x in sources.items())
    first: dict[int, int] = {}
    objects = tuple(first.setdefault(id(x), n) for n, x in enumerate(values))
    return layouts + (objects, shared_patterns(values))


def _write(program: Program, moving: Sequence[bool], operands: Sequence, results: dict, flowing: dict,
           needed: Sequence[bool], rebuilt: dict[int, Rebuilt], sources: dict) -> tuple:
    """:func:`gradient_program`'s program, each of its operands' place in ``sources``
    (or a :class:`_Constant`), and its outputs."""
    build = _Builder({id(results[k]): (results[r.stage], results[r.divisor.stage], r.positions)
                      for k, r in rebuilt.items()})
    gradients: dict[Source, list[_Part]] = {
        StageResult(k): [build.identity(build.operand(g), g)] for k, g in flowing.items()}
    for k in reversed(range(len(program.stages))):
        parts = gradients.pop(StageResult(k), None)
        if parts is None or not moving[k]:
            continue
        step = program.stages[k]
        wanted = [n for n in sorted(differentiated(step.assignment)) if moves(step.inputs[n], needed, moving)]
        parts = [p if p.pointwise else build.stage([p]) for p in parts]
        if len(wanted) > 1 and not (len(parts) == 1 and _is_identity(parts[0])):
            parts = [build.stage(parts)]  # read by several gradients: computed once
        inputs = stage_inputs(step, operands, results)
        forward = tuple(build.operand(x) for x in inputs)
        one = _on_pattern(build, parts, parts[0].like)
        for n in wanted:
            gradient, extras, out_format = gradient_call(step.assignment, n, inputs, parts[0].like, results[k])
            sources_n = (None, *forward, *(build.operand(x) for x in extras))
            part = _substituted(gradient, sources_n, parts, out_format, _like(inputs[n], out_format), one)
            part = _pruned(_rebuild_reads(build, part))
            source = step.inputs[n]
            gradients.setdefault(source if isinstance(source, StageResult) else UserOperand(source.n), []).append(part)
    outputs = []
    for n in range(len(operands)):
        parts = gradients.get(UserOperand(n))
        outputs.append(None if parts is None else build.stage(parts).sources[0].stage)
    written, inputs = build.program()
    place = {id(x): p for p, x in sources.items()}
    return written, tuple(place.get(id(x), _Constant(x)) for x in inputs), tuple(outputs)


def _rebuild_reads(build: _Builder, part: _Part) -> _Part:
    """``part`` reading ``R`` in place of each rebuilt result ``X`` it reads, times ``Y``
    where a term reads ``X``'s value (``X = R · Y``; ``R`` has ``X``'s pattern, so a
    factor read for its positions only reads ``R``'s)."""
    slots = {n: build.rebuilt[id(build.value(source))] for n, source in enumerate(part.sources)
             if isinstance(source, UserOperand) and id(build.value(source)) in build.rebuilt}
    if not slots:
        return part
    sources = list(part.sources)
    terms = []
    for term in part.assignment.terms:
        factors, value = list(term.factors), term.value
        read = factors_of(_value(term)) if term.coefficient != 0.0 else set()
        for f, access in enumerate(term.factors):
            if access.operand not in slots:
                continue
            normalised, divisor, positions = slots[access.operand]
            factors[f] = Access(_slot(sources, build.operand(normalised)), access.indices)
            if f in read:
                factors.append(Access(_slot(sources, build.operand(divisor)), tuple(access.indices[p] for p in positions)))
                value = renumbered(_value(Term(1.0, term.factors, value)), lambda k, f=f, y=len(factors) - 1: (
                    Apply("mul", (Factor(k), Factor(y))) if k == f else Factor(k)))
        terms.append(Term(term.coefficient, tuple(factors), value))
    assignment = Assignment(part.assignment.output, tuple(terms), part.assignment.operand_names,
                            part.assignment.reduction)
    return _Part(assignment, tuple(sources), part.out_format, part.like)


def _pruned(part: _Part) -> _Part:
    """``part`` over the sources its terms access (a forward result a gradient does not
    read, or reads as rebuilt, may be its pattern alone: it must not reach a kernel)."""
    used = sorted({a.operand for t in part.assignment.terms for a in t.factors})
    if len(used) == len(part.sources):
        return part
    number = {n: m for m, n in enumerate(used)}
    terms = tuple(Term(t.coefficient, tuple(Access(number[a.operand], a.indices) for a in t.factors), t.value)
                  for t in part.assignment.terms)
    names = tuple(f"operand{n}" for n in range(len(used)))
    assignment = Assignment(part.assignment.output, terms, names, part.assignment.reduction)
    return _Part(assignment, tuple(part.sources[n] for n in used), part.out_format, part.like)


def _slot(sources: list, source: Source) -> int:
    """The operand number of ``source`` among ``sources`` (appended if new)."""
    if source not in sources:
        sources.append(source)
    return sources.index(source)


def moves(source: Source, needed: Sequence[bool], moving: Sequence[bool]) -> bool:
    """Whether ``source`` moves with the caller's operands that are ``needed``: the operand
    is one of them, or the stage result moves (``moving``)."""
    return needed[source.n] if isinstance(source, UserOperand) else moving[source.stage]


def _format_of(like) -> Format | str:
    return like.format if isinstance(like, SparseTensor) else "dense"


def _like(operand, out_format):
    """What the gradient of ``operand`` stands for while the program is written: values
    on its pattern (the pattern alone), or a dense tensor (its shape alone)."""
    if isinstance(out_format, Format):
        return operand._share(operand.shape, operand.format, torch.empty(0, dtype=operand.values.dtype))
    dtype = operand.values.dtype if isinstance(operand, SparseTensor) else operand.dtype
    return torch.empty(operand.shape, dtype=dtype, device="meta")


def _is_identity(part: _Part) -> bool:
    """Whether ``part`` is its one source as it is."""
    if len(part.assignment.terms) != 1:
        return False
    (term,) = part.assignment.terms
    return (term.coefficient == 1.0 and term.value is None and len(term.factors) == 1
            and term.factors[0].indices == part.assignment.output)


def _value(term: Term) -> Value:
    """``term``'s value as a tree (a plain product of every factor when it has none)."""
    return term.value if term.value is not None else product(len(term.factors))


def _on_pattern(build: _Builder, parts: Sequence[_Part], like) -> bool:
    """Whether every sparse operand of ``parts`` has the pattern of ``like`` (the
    gradient they sum; dense: none is sparse), so that their sum is nonzero where each
    term of a product reading it is visited anyway."""
    sparse = [x for part in parts for x in map(build.value, part.sources) if isinstance(x, SparseTensor)]
    if not isinstance(like, SparseTensor):
        return not sparse
    return all(shared == 0 for shared in shared_patterns([like, *sparse])[1:])


def _substituted(gradient: Assignment, sources: tuple, parts: Sequence[_Part], out_format, like,
                 one_term: bool) -> _Part:
    """``gradient`` (over ``sources``, whose operand 0, the output gradient, is the sum of
    ``parts``, each pointwise) as one part: in each term reading operand 0, the parts'
    factors in place of that access, and the sum of their terms' values in place of its
    value. ``one_term``: the parts' terms are visited wherever the term is (they store
    the gradient's pattern), so the term stays one term over all their factors; else it
    becomes one term per term of the parts."""
    if len(parts) == 1 and _is_identity(parts[0]):
        return _Part(gradient, (parts[0].sources[0], *sources[1:]), out_format, like)
    operands = list(sources[1:])  # the gradient's operand j >= 1 is operand j - 1 here
    inner_terms = []  # (factors, value) of each term of the parts, numbered from 0
    for part in parts:
        offset = len(operands)
        operands += part.sources
        for inner in part.assignment.terms:
            if inner.coefficient != 0.0:  # a zero term keeps a pattern: the gradient's own terms keep it
                rename = dict(zip(part.assignment.output, range(len(part.assignment.output))))
                factors = tuple((a.operand + offset, tuple(rename[i] for i in a.indices)) for a in inner.factors)
                value = _value(inner)
                if inner.coefficient != 1.0:
                    value = Apply("mul", (Constant(inner.coefficient), value))
                inner_terms.append((factors, value))
    terms = []
    for term in gradient.terms:
        reads = [f for f, a in enumerate(term.factors) if a.operand == 0]
        kept = [Access(a.operand - 1, a.indices) for a in term.factors if a.operand != 0]
        if not reads:
            terms.append(Term(term.coefficient, tuple(kept), term.value))
            continue
        (f0,) = reads
        names = term.factors[f0].indices
        outer = renumbered(_value(term), lambda k: Factor(k if k < f0 else k - 1) if k != f0 else Factor(-1))
        groups = [inner_terms] if one_term else [[t] for t in inner_terms]
        for group in groups:
            factors, total = list(kept), None
            for inner_factors, value in group:
                shift = len(factors)
                factors += [Access(n, tuple(names[m] for m in modes)) for n, modes in inner_factors]
                value = renumbered(value, lambda j, shift=shift: Factor(j + shift))
                total = value if total is None else Apply("add", (total, value))
            terms.append(Term(term.coefficient, tuple(factors),
                              renumbered(outer, lambda k, total=total: total if k == -1 else Factor(k))))
    names = tuple(f"operand{n}" for n in range(len(operands)))
    return _Part(Assignment(gradient.output, tuple(terms), names), tuple(operands), out_format, like)


def _summed(parts: Sequence[_Part]) -> tuple[Assignment, tuple[Source, ...]]:
    """One assignment (and its sources) summing the terms of ``parts``, over the first's output indices."""
    output = parts[0].assignment.output
    terms, sources = [], []
    for p, part in enumerate(parts):
        offset = len(sources)
        sources += part.sources
        rename = dict(zip(part.assignment.output, output))
        rename.update((i, f"{i}#{p}") for t in part.assignment.terms for a in t.factors for i in a.indices
                      if i not in rename)  # each part's summed indices its own
        for term in part.assignment.terms:
            factors = tuple(Access(a.operand + offset, tuple(rename[i] for i in a.indices)) for a in term.factors)
            terms.append(Term(term.coefficient, factors, term.value))
    names = tuple(f"operand{n}" for n in range(len(sources)))
    return Assignment(output, tuple(terms), names), tuple(sources)


def gradient_values(gradient: torch.Tensor | SparseTensor, template: SparseTensor | None) -> torch.Tensor:
    """A computed gradient as autograd takes it for an operand laid out as ``template``
    (None: dense): the values on its pattern, or a dense-format operand's values in
    storage order."""
    if isinstance(gradient, SparseTensor):
        return gradient.values
    if template is not None:
        return gradient.permute(template.format.mode_order).reshape(-1)
    return gradient
