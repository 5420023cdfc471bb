"""Staging: an expression tree (:mod:`.expression`) and its operands' formats become a
:class:`~.program.Program`, kernel assignments run one after another, each reading user
operands and earlier stages' results.

A kernel term is visited where all its sparse factors store an entry. Staging makes
that exact where the text means the dense math, and keeps it where it means the
stored entries:

* **Dense math** (outside explicit reductions and masks). A term whose value vanishes
  with each sparse factor (``vanishes_with``: ``relu(S[i,j]) * X[j,k]``, ``S[i,j] / d[i]``)
  is exact. A function call that does not vanish gets its argument computed first, as
  a stage of its own (``relu(S[i,j] - M[i])``, ``relu(S[i,j] + T[i,j])``: a sum is
  exact on the union of its terms' patterns); if the call still does not vanish with a
  sparse factor (``exp``, ``sigmoid``, ``log``, or ``max(S, T)``), that factor is read
  densely (a copy stage ``D[...] = S[...]`` with a dense result). An implicit sum
  inside an argument (``relu(A[i,k] * B[k,j])``) is always staged first.
* **Stored entries** (inside ``op[j](body)`` and under a mask ``Out<M>[...]``). Each
  product of the body ranges over its own sparse operands' stored entries, its
  functions applied there (``sum[j](exp(S[i,j] - M[i]))`` sums over ``S``'s stored
  ``j``; a product of dense operands ranges over everything). A max/min takes one
  term: a body of several products, or with an implicit inner sum, is staged into a
  temporary over the output and reduced indices, stored fully compressed when it reads
  a sparse operand (its entries: the points some product reaches, whatever the
  operands' formats), and reduced over that temporary's stored entries; the identity
  (``-inf``/``+inf``) where there are none. The same staging applies to a sum whose
  body has a product missing a reduced index (``sum[j](A[i] + B[i,j])`` counts
  ``A[i]`` once per ``j``). Argument sums with implicit inner sums are staged.
* **Epilogues**. ``Y[i,k] = c * f(A[i,j] * X[j,k] + b[k])``, a unary function of a sum
  with an implicit reduction, is one assignment whose epilogue applies ``f`` to the
  reduced value plus the terms that are dense, without reduction indices (a bias
  ``b[k]``) and constants. When the sum's result is sparse for these formats (``A``,
  ``X`` both CSR), ``f`` keeps zeros and no dense ``out_format`` is asked for, or a
  sparse one is, the sum is staged and ``f`` applied to it as a term value instead,
  keeping it sparse.
  Constants added at the top level (``A[i,j] + 1``) also make an epilogue.
* **Denominators** must be dense: a sparse operand written in one (outside an
  explicit reduction) is a ValueError; a reduction or staged sum in one is computed
  densely.

A plain sum of products is one stage, independent of the formats (:func:`plain`).
Other statements are staged per formats signature (:func:`stage`, cached).

A :class:`~.expression.Script` (statements separated by ``;`` or newlines) is staged
statement by statement into one program: a statement reads the caller's operands and
earlier statements' results, whose formats the earlier stages decide: a masked result
has its mask's pattern; an earlier statement whose output indices one sparse operand
stores in dense levels (a row max, a row sum), or that a later statement reads densely
(in a denominator, under ``exp``), is dense; others have the format inferred from their
operands. Which
consecutive stages run as one kernel is the planner's decision (``plan/fusion.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sparsenn.formats import Format, parse_format

from .expression import Call, Product, Reduction, Script, Statement, Sum, Tensor, context_of, plain_assignment, \
    product_indices, tensors_in
from .functions import FUNCTIONS, apply, factors_of, renumbered, vanishes_with
from .notation import Access, Apply, Assignment, Constant, Epilogue, Factor, Reduced, Term, Value
from .program import Program, Source, Stage, StageResult, UserOperand
from ..plan.infer import result_format
from ..runtime.cache import LRUCache

__all__ = ["plain", "stage", "stage_format"]


def plain(statement: Statement, out_format) -> Program | None:
    """The one-stage program of a plain sum of products, else None."""
    assignment = plain_assignment(statement)
    if assignment is None:
        return None
    return Program((Stage(assignment, out_format, tuple(UserOperand(n) for n in range(assignment.num_operands))),),
                   (statement.output,))


_programs: LRUCache[Program] = LRUCache("programs", 1024)


def stage(statement: Statement | Script, formats: tuple[Format | None, ...], out_format) -> Program:
    """The program of ``statement`` (or of a script's statements) for operands of
    ``formats`` (cached)."""
    key = (statement, formats, out_format)
    program = _programs.get(key)
    if program is None:
        if isinstance(statement, Script):
            program = _script(statement, formats, out_format)
        else:
            program = _Builder(statement, formats).build(out_format)
            program = replace(program, names=(None,) * (len(program.stages) - 1) + (statement.output,))
        _programs.put(key, program)
    return program


def _script(script: Script, formats: tuple[Format | None, ...], out_format) -> Program:
    """The statements' programs, one after another; a statement's operand named like an
    earlier result reads that statement's last stage."""
    dense: set[str] = set()
    while True:
        try:
            return _script_with(script, formats, out_format, frozenset(dense))
        except _ReadDensely as read:
            dense.add(read.name)


class _ReadDensely(Exception):
    """A statement reads an earlier statement's sparse result densely (in a denominator,
    or in a function that does not vanish with it): that result is computed dense."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _script_with(script: Script, formats: tuple[Format | None, ...], out_format, dense: frozenset[str]) -> Program:
    """:func:`_script` with the results named in ``dense`` computed dense."""
    sources: dict[str, Source] = {name: UserOperand(n) for n, name in enumerate(script.operands)}
    known: dict[str, Format | None] = dict(zip(script.operands, formats))
    stages: list[Stage] = []
    names: list[str | None] = []
    stored: list[Format | None] = []  # each stage's result format
    for k, statement in enumerate(script.statements):
        last = k == len(script.statements) - 1
        given = tuple(known[name] for name in statement.operands)
        request = out_format if last else "dense" if (
            statement.output in dense or _within_dense_levels(statement, given)) else None
        part = _Builder(statement, given, frozenset(statement.operands) - set(script.operands)).build(request)
        offset = len(stages)
        for step in part.stages:
            inputs = tuple(sources[statement.operands[s.n]] if isinstance(s, UserOperand)
                           else StageResult(s.stage + offset) for s in step.inputs)
            stages.append(Stage(step.assignment, step.out_format, inputs))
            names.append(None)
            stored.append(stage_format(stages[-1], [_sparse(formats[s.n]) if isinstance(s, UserOperand)
                                                    else stored[s.stage] for s in inputs]))
        names[-1] = statement.output
        sources[statement.output] = StageResult(len(stages) - 1)
        known[statement.output] = stored[-1]
    return Program(tuple(stages), tuple(names))


def _within_dense_levels(statement: Statement, formats: tuple[Format | None, ...]) -> bool:
    """Whether ``statement`` is unmasked and one sparse operand stores all its output
    indices in dense levels: its result has a value at every position of that
    operand's dense levels, so it is stored dense (a row max or sum of a blocked
    pattern), never larger than the operand."""
    if statement.mask is not None:
        return False
    number = {name: n for n, name in enumerate(statement.operands)}
    for access in tensors_in(statement.body):
        fmt = _sparse(formats[number[access.name]])
        if fmt is not None and all(i in access.indices and fmt.mode_level(access.indices.index(i)).full
                                   for i in statement.indices):
            return True
    return False


def stage_format(step: Stage, formats: Sequence[Format | None]) -> Format | None:
    """The format of ``step``'s result over inputs of ``formats`` (None: dense)."""
    if step.out_format == "dense" or step.assignment.dense_result:
        return None
    if isinstance(step.out_format, Format):
        return step.out_format
    return result_format(step.assignment, list(formats))


def _sparse(fmt: Format | None) -> Format | None:
    """``fmt`` as staging reads it: None for a dense operand (or a dense format)."""
    return None if fmt is None or fmt.is_dense else fmt


@dataclass
class _Term:
    """A term being built: factors over the builder's operands (user operands, then
    stage results) and its value over them (explicit, even for a plain product)."""

    coefficient: float
    factors: list[Access]
    value: Value

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for a in self.factors for i in a.indices))


class _Builder:
    """Lowers one statement for one formats signature into stages."""

    def __init__(self, statement: Statement, formats: tuple[Format | None, ...], results: frozenset[str] = frozenset()):
        self.statement = statement
        self.results = results  # operands that are earlier statements' results (of a script)
        self.given = formats
        self.names = list(statement.operands)
        self.number = {name: n for n, name in enumerate(self.names)}
        self.sources: list[Source] = [UserOperand(n) for n in range(len(self.names))]
        self.sparse: list[Format | None] = [None if f is None or f.is_dense else f for f in formats]
        self.stages: list[list] = []  # [assignment over the builder's operands, out_format]
        self.copies: dict[int, int] = {}  # operand -> its dense copy

    def build(self, out_format) -> Program:
        statement = self.statement
        context = frozenset(statement.indices)
        if statement.mask is not None:
            self.masked(context)
        else:
            self.top(context, out_format)
        stages = []
        for assignment, fmt in self.stages:
            local, ids = self.localise(assignment)
            stages.append(Stage(local, fmt, tuple(self.sources[v] for v in ids)))
        return Program(tuple(stages))

    # ------------------------------------------------------------------ the statement

    def masked(self, context: frozenset[str]) -> None:
        """``Out<M>[o] = body``: every term sampled by ``M[o]`` (read for its pattern only,
        unless the term reads it there itself), plus ``0 * M[o]`` so the result has exactly
        ``M``'s stored positions, unless a term of dense operands already visits them all
        or every term visits them all (it reads ``M[o]``, its other operands dense)."""
        output = self.statement.indices
        m = self.number[self.statement.mask]
        mask = Access(m, output)
        body = self.terms(self.statement.body, context, dense_math=False)
        terms = [Term(t.coefficient, tuple(t.factors) if mask in t.factors else (*t.factors, mask), t.value)
                 for t in body]
        if not any(all(self.sparse[a.operand] is None for a in t.factors) for t in body) and not all(
                mask in t.factors and all(self.sparse[a.operand] is None for a in t.factors if a != mask)
                for t in body):
            terms.append(Term(0.0, (mask,)))
        fmt = self.given[m]
        self.emit(Assignment(output, tuple(terms), tuple(self.names)), "dense" if fmt is None else fmt)

    def top(self, context: frozenset[str], out_format) -> None:
        output = self.statement.indices
        products = self.statement.body.products
        if len(products) == 1 and len(products[0].factors) == 1:
            (call,) = products[0].factors
            if isinstance(call, Call) and FUNCTIONS[call.function].arity == 1 and any(
                product_indices(p, context) - context for p in call.args[0].products
            ):
                self.epilogue(call, products[0].coefficient, context, out_format)
                return
        self.final(self.assemble(output, self.terms(self.statement.body, context, dense_math=True)), out_format)

    def epilogue(self, call: Call, coefficient: float, context: frozenset[str], out_format) -> None:
        """``c * f(sum)`` with a reduction in the sum: ``f`` as the sum's epilogue, or,
        when the result should stay sparse, applied to the staged sum."""
        output = self.statement.indices
        terms = self.terms(call.args[0], context, dense_math=True)
        function = FUNCTIONS[call.function]
        asked = out_format.strip().lower() if isinstance(out_format, str) else out_format
        asked_sparse = asked not in (None, "dense", "auto")
        if all(t.factors for t in terms) and function.zero_preserving and asked != "dense":
            local, ids = self.localise(Assignment(output, tuple(self.term(t) for t in terms), tuple(self.names)))
            sparse_sum = result_format(local, [self.sparse[v] for v in ids]) is not None
        else:
            sparse_sum = False
        if not (sparse_sum or asked_sparse):
            self.final(self.assemble(output, terms, call.function, coefficient), out_format)
            return
        total = self.emit(self.assemble(output, terms), None)
        factors = [Access(total, output)]
        value = _scaled(coefficient, self.fixed(apply(call.function, Factor(0)), factors))
        self.final(Assignment(output, (self.term(_Term(1.0, factors, value)),), tuple(self.names)), out_format)

    def final(self, assignment: Assignment, out_format) -> None:
        """The last stage; a copy of the previous stage's result is that stage instead."""
        (term, *rest) = assignment.terms
        if (not rest and assignment.is_product_sum and term.coefficient == 1.0 and len(term.factors) == 1
                and term.factors[0].indices == assignment.output
                and term.factors[0].operand == len(self.names) - 1 and self.stages):
            self.stages[-1][1] = out_format if out_format is not None else self.stages[-1][1]
            return
        self.emit(assignment, out_format)

    # ------------------------------------------------------------------ lowering

    def terms(self, body: Sum, context: frozenset[str], dense_math: bool, denominator: bool = False) -> list[_Term]:
        """One term per product of ``body``, the indices of ``context`` in scope."""
        return [self.product(p, context, dense_math, denominator) for p in body.products]

    def product(self, product: Product, context: frozenset[str], dense_math: bool, denominator: bool) -> _Term:
        factors: list[Access] = []
        value: Value = Constant(1.0)
        for n, part in enumerate(product.factors):
            scope = context_of(product, n, context)
            if isinstance(part, Tensor):
                part_value = self.factor(Access(self.number[part.name], part.indices), factors, denominator)
            elif isinstance(part, Reduction):
                reduced = self.reduction(part, scope)
                part_value = self.factor(self.densify(reduced) if denominator else reduced, factors, denominator)
            else:
                part_value = self.call(part, scope, factors, dense_math, denominator)
            value = apply("mul", value, part_value)
        return _Term(product.coefficient, factors, value)

    def factor(self, access: Access, factors: list[Access], denominator: bool) -> Value:
        if denominator and self.sparse[access.operand] is not None:
            name = self.names[access.operand]
            if name in self.results:
                raise _ReadDensely(name)
            raise ValueError(f"operand {access.operand} ({name}) is sparse but is in a denominator of "
                             f"{self.statement_text()}: unstored entries would divide by zero; pass a dense tensor")
        factors.append(access)
        return Factor(len(factors) - 1)

    def call(self, call: Call, scope: frozenset[str], factors: list[Access], dense_math: bool,
             denominator: bool) -> Value:
        args = [self.argument(arg, scope, factors, dense_math, denominator or (call.function == "div" and n == 1))
                for n, arg in enumerate(call.args)]
        value = apply(call.function, *args)
        return self.fixed(value, factors) if dense_math else value

    def fixed(self, value: Value, factors: list[Access]) -> Value:
        """Reads densely each sparse factor ``value`` does not vanish with."""
        for k in sorted(factors_of(value)):
            if self.sparse[factors[k].operand] is not None and not vanishes_with(value, k):
                factors[k] = self.densify(factors[k])
        return value

    def argument(self, arg: Sum, scope: frozenset[str], factors: list[Access], dense_math: bool,
                 denominator: bool) -> Value:
        """A call's argument, inline in the call's term, or staged (an implicit sum
        inside it; in dense math, a value inexact on its term's visited points)."""
        terms = self.terms(arg, scope, dense_math, denominator)
        local: list[Access] = []
        value: Value = Constant(0.0)
        for t in terms:
            value = _plus(value, t.coefficient, renumbered(t.value, lambda k: Factor(k + len(local))))
            local += t.factors
        inner = any(set(t.indices) - scope for t in terms)
        exact = all(vanishes_with(value, k) for k, a in enumerate(local) if self.sparse[a.operand] is not None)
        if inner or (dense_math and not exact):
            output = tuple(i for i in _ordered(terms) if i in scope)
            staged = Access(self.emit(self.assemble(output, terms), None), output)
            return self.factor(self.densify(staged) if denominator else staged, factors, denominator)
        shifted = renumbered(value, lambda k: Factor(k + len(factors)))
        factors += local
        return shifted

    def reduction(self, reduction: Reduction, scope: frozenset[str]) -> Access:
        """``op[J](body)`` as a stage; its result's access (over the body's indices in
        scope)."""
        bound = frozenset(reduction.indices)
        terms = self.terms(reduction.body, scope | bound, dense_math=False)
        output = tuple(i for i in _ordered(terms) if i in scope - bound)
        covered = all(bound <= set(t.indices) for t in terms)
        names = tuple(self.names)
        if reduction.op == "sum" and covered:
            assignment = self.assemble(output, terms)
        elif reduction.op != "sum" and covered and len(terms) == 1 and set(terms[0].indices) <= set(output) | bound:
            (t,) = terms
            value = _scaled(t.coefficient, t.value)  # a max/min term's value is explicit, a stored 0 an entry
            assignment = Assignment(output, (Term(1.0, tuple(t.factors), value),), names, reduction.op)
        else:
            inner = tuple(i for i in _ordered(terms) if i in scope | bound)
            body = self.assemble(inner, terms)
            reached = not body.dense_result and any(self.sparse[a.operand] is not None for a in body.accesses)
            body = self.emit(body, parse_format("c" * len(inner), len(inner)) if reached else None)
            assignment = Assignment(output, (Term(1.0, (Access(body, inner),), Factor(0)),), names, reduction.op)
        return Access(self.emit(assignment, None), output)

    # ------------------------------------------------------------------ assignments

    def assemble(self, output: tuple[str, ...], terms: list[_Term], function: str | None = None,
                 scale: float = 1.0) -> Assignment:
        """``sum(terms)`` over ``output``, or ``scale * function(sum(terms))``. Constants
        and a function need an epilogue; the terms that are dense and have no reduction
        index (a bias) then move into it."""
        names = tuple(self.names)
        if function is None and all(t.factors for t in terms):
            return Assignment(output, tuple(self.term(t) for t in terms), names)
        bias = [t for t in terms if all(self.sparse[a.operand] is None for a in t.factors)
                and set(t.indices) <= set(output)]
        kept = [t for t in terms if not any(t is b for b in bias)]
        if not kept:
            kept, bias = [bias[0]], bias[1:]
        factors: list[Access] = []
        value: Value = Reduced()
        for t in bias:
            value = _plus(value, t.coefficient, renumbered(t.value, lambda k: Factor(k + len(factors))))
            factors += t.factors
        if function is not None:
            value = _scaled(scale, apply(function, value))
        return Assignment(output, tuple(self.term(t) for t in kept), names, epilogue=Epilogue(tuple(factors), value))

    def term(self, t: _Term) -> Term:
        plain = _product(len(t.factors))
        return Term(t.coefficient, tuple(t.factors), None if t.value == plain else t.value)

    def emit(self, assignment: Assignment, out_format) -> int:
        """Append a stage; its result as a new operand."""
        local, ids = self.localise(assignment)
        if out_format == "dense" or local.dense_result:
            fmt = None
        elif isinstance(out_format, Format):
            fmt = out_format
        else:
            fmt = result_format(local, [self.sparse[v] for v in ids])
        self.sparse.append(fmt)
        self.sources.append(StageResult(len(self.stages)))
        self.names.append(f"%{len(self.stages)}")
        self.stages.append([assignment, out_format])
        return len(self.names) - 1

    def densify(self, access: Access) -> Access:
        """``access`` read from a dense copy: a stage result is asked dense itself
        (each is read once), a user operand copied once."""
        operand = access.operand
        source = self.sources[operand]
        if isinstance(source, StageResult):
            self.stages[source.stage][1] = "dense"
            self.sparse[operand] = None
            return access
        if self.names[operand] in self.results:
            raise _ReadDensely(self.names[operand])
        if operand not in self.copies:
            copy = Assignment(access.indices, (Term(1.0, (access,)),), tuple(self.names))
            self.copies[operand] = self.emit(copy, "dense")
        return Access(self.copies[operand], access.indices)

    def localise(self, assignment: Assignment) -> tuple[Assignment, tuple[int, ...]]:
        """``assignment`` over its own operands, numbered by first use; the builder's
        operand of each."""
        ids = tuple(dict.fromkeys(a.operand for a in assignment.accesses))
        number = {v: n for n, v in enumerate(ids)}

        def local(accesses):
            return tuple(Access(number[a.operand], a.indices) for a in accesses)

        terms = tuple(replace(t, factors=local(t.factors)) for t in assignment.terms)
        epilogue = assignment.epilogue
        if epilogue is not None:
            epilogue = replace(epilogue, factors=local(epilogue.factors))
        return Assignment(assignment.output, terms, tuple(self.names[v] for v in ids), assignment.reduction,
                          epilogue), ids

    def statement_text(self) -> str:
        s = self.statement
        mask = f"<{s.mask}>" if s.mask is not None else ""
        return f"{s.output}{mask}[{','.join(s.indices)}] = ..."


def _ordered(terms: list[_Term]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for t in terms for i in t.indices))


def _product(n: int) -> Value:
    """``Factor(0) * ... * Factor(n-1)``, built as :meth:`_Builder.product` builds it."""
    value: Value = Constant(1.0)
    for k in range(n):
        value = apply("mul", value, Factor(k))
    return value


def _scaled(coefficient: float, value: Value) -> Value:
    if coefficient == -1.0:
        return apply("neg", value)
    return apply("mul", Constant(coefficient), value)


def _plus(total: Value, coefficient: float, value: Value) -> Value:
    """``total + coefficient * value``, as a subtraction for a negative coefficient."""
    if coefficient < 0 and total != Constant(0.0):
        return apply("sub", total, _scaled(-coefficient, value))
    return apply("add", total, _scaled(coefficient, value))
