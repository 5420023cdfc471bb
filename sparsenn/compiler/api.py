"""The public entry points: :func:`einsum`, :func:`compile_expression`, :func:`explain`
and :func:`plan`. Each parses its expression (equations are cached), records the call
for autograd when gradients are needed (``compiler.autograd``) and evaluates it
(:mod:`.runtime.evaluate`); a compiled expression runs the stages of its program
(:mod:`.frontend.program`, :mod:`.runtime.programs`). Under ``torch.autocast`` the
operands are cast first (:mod:`.runtime.autocast`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.compiler import is_compiling

from sparsenn.formats import SparseTensor

from .autograd import differentiable_evaluate, recorded, unobserved_call
from .dense_step import plan_step
from .frontend.equation import broadcast_size_one, normalise
from .frontend.equation import core_assignment as parse
from .frontend.expression import Script, parse_script
from .frontend.notation import Assignment
from .frontend.program import Program, signature, stage_inputs
from .frontend.staging import plain, stage
from .held import RECORDED, held_call
from .plan.contract import describe_path
from .plan.planner import Plan, ShapePlan
from .plan.schedule import Schedule
from .plan.target import ACTIVE_TARGET, Target
from .program_autograd import run, run_all
from .runtime.autocast import autocast_operands
from .runtime.cache import clear_caches, forget_with_caches
from .runtime.evaluate import (CALLS, DenseCall, DensifiedCall, EpiloguePathCall, PathCall, SampledDenseCall,
                               SplitCall, evaluate, guarded_run, route, weighed_dense_path, weighed_sampled_path)
from .runtime.programs import describe_program
from .runtime.tracing import traced_evaluate, tracing
from .runtime.validate import Checked, check_call, describe_operand

__all__ = ["einsum", "compile_expression", "compiled_once", "explain", "plan", "kernel_schedule", "use_target",
           "parse", "describe_schedule", "CompiledExpression"]

def einsum(equation: str, *operands, out_format=None):
    """Einstein summation over dense ``torch.Tensor`` and :class:`SparseTensor` operands.

    The result is a dense ``torch.Tensor`` or a :class:`SparseTensor`, decided by the
    operands' formats and ``out_format`` alone (never by their values or number of
    nonzeros): ``None`` infers the format per output mode (a product is sparse where a
    factor is, a sum where every term is; A·Aᵀ-like products of sparse operands are
    sparse), ``"dense"`` asks for a tensor, a format name or :class:`Format` for that
    format, and ``"auto"`` infers, then returns a tensor when the inferred sparse result
    is estimated to be at least 1/8 full (a result type that depends on the data).
    The equation follows torch.einsum's grammar (see :mod:`sparsenn.compiler.frontend.equation`).
    Operands share one dtype (float32, float64, bfloat16 or float16; 16-bit values are
    computed in float32); under ``torch.autocast`` they are cast to its dtype.
    """
    if type(equation) is str and not is_compiling():  # (Dynamo would guard on the dict of held calls)
        held = _PLAIN.held.get(equation)  # (out_format, held call) of the equation's last cached signature
        if held is not None and held[0] is out_format:
            result = held[1](operands)  # its guard counts the operands; None under a tracer, transform, autocast
            if result is not None and result is not RECORDED:
                return result
        if unobserved_call(operands):  # (a tracer's graph reads no cache)
            plain = _PLAIN.get(equation)
            entry = None if plain is None else guarded_run(plain, operands, out_format)
            if entry is not None:
                _PLAIN.held[equation] = (out_format, held_call(*entry, out_format, CALLS))
                return entry[1](operands)
    traced = tracing()
    given = equation
    equation, operands = normalise(equation, operands, remember=not traced)
    operands = autocast_operands(operands)
    if traced:  # parsed by the op's call string, not in traced code
        return traced_evaluate(None, operands, out_format, ("einsum", equation, len(operands)))
    assignment = parse(equation, len(operands))
    try:
        result = differentiable_evaluate(evaluate, assignment, operands, out_format)
    except ValueError:
        broadcast = broadcast_size_one(equation, operands)  # sizes 1 that torch broadcasts
        if broadcast is None:
            raise
    else:
        if equation is given:
            _PLAIN.add(equation, assignment)
        return result
    equation, operands = broadcast
    return differentiable_evaluate(evaluate, parse(equation, len(operands)), operands, out_format)


class _PlainEquations:
    """Equations :func:`einsum` ran as given (core form, no rewriting), with their
    parsed assignments: a repeated call of one finds its assignment in one dictionary
    read and, when no tracer, transform, autocast or autograd sees it, runs the cached
    resolution its guard finds (:func:`.runtime.evaluate.guarded_run`) at once; ``held``
    keeps that resolution per equation as one function (:func:`.held.held_call`), tried
    first by the next call with the same ``out_format`` object. At most ``limit``
    equations are kept (all forgotten beyond it); :func:`clear_caches` empties it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._assignments: dict[str, Assignment] = {}
        self.get = self._assignments.get
        self.held: dict[str, tuple[object, Callable]] = {}  # equation -> (out_format, its last signature's held call)
        forget_with_caches(self)

    def add(self, equation: str, assignment: Assignment) -> None:
        if len(self._assignments) >= self.limit:
            self.clear()
        self._assignments[equation] = assignment

    def clear(self) -> None:
        self._assignments.clear()
        self.held.clear()


_PLAIN = _PlainEquations(1024)


class CompiledExpression:
    """A parsed expression (:func:`compile_expression`), callable on operands
    (positional in order of first appearance in the text, or by name)."""

    def __init__(self, text: str, out_format=None, returns: str | Sequence[str] | None = None):
        script = parse_script(text)
        self.statement = script.statements[0] if len(script.statements) == 1 else script
        if script.statements[-1].mask is not None and out_format is not None:
            raise ValueError(f"{text!r} has an output mask, which decides the result's format: out_format must be None")
        self.out_format = out_format
        self.text = text
        self._plain = None if isinstance(self.statement, Script) else plain(self.statement, out_format)
        self.returns = _returned(script, returns)

    @property
    def assignment(self) -> Assignment | None:
        """The single assignment of a plain sum of products (else None: staged per call)."""
        return None if self._plain is None else self._plain.stages[0].assignment

    @property
    def operand_names(self) -> tuple[str, ...]:
        return self.statement.operands

    def _bind(self, args, kwargs) -> list:
        names = self.statement.operands
        if len(args) > len(names):
            raise TypeError(f"{self.text!r} takes {len(names)} operands, got {len(args)}")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{self.text!r} has no operand named {name!r}")
            if name in bound:
                raise TypeError(f"operand {name!r} given twice")
            bound[name] = value
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{self.text!r} is missing operand(s) {missing}")
        return [bound[n] for n in names]

    def program(self, operands: Sequence) -> Program:
        """The stages these operands run (their formats decide them)."""
        if self._plain is not None:
            return self._plain
        return stage(self.statement, signature(operands), self.out_format)

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != len(self.statement.operands):
            operands = self._bind(args, kwargs)
        else:
            operands = list(args)
        operands = autocast_operands(operands)
        if self.returns is not None:
            if tracing():
                raise NotImplementedError(f"sparsenn: a traced compiled expression returns one result; "
                                          f"{self.text!r} was compiled with returns={self.returns}")
            program = self.program(operands)
            stages = [program.names.index(name) for name in self.returns]
            results = run_all(program, operands, frozenset(stages))
            return tuple(results[k] for k in stages)
        if self._plain is not None:  # one stage over the operands as given
            return differentiable_evaluate(evaluate, self._plain.stages[0].assignment, operands, self.out_format)
        if tracing():  # the whole program as one op (a script named by its text: traced code passes constants)
            if isinstance(self.statement, Script):
                return traced_evaluate(None, operands, self.out_format, ("script", self.text))
            return traced_evaluate(None, operands, self.out_format, ("statement", self.text))
        return run(self.program(operands), operands)

    def explain(self, *args, **kwargs) -> str:
        """Each stage's explanation (a stage's inputs from the earlier ones are
        computed), then which stages the planner fuses into one kernel and why the others
        are not."""
        operands = self._bind(args, kwargs)
        program = self.program(operands)
        stages = program.stages
        if len(stages) == 1:
            return _explain(stages[0].assignment, stage_inputs(stages[0], operands, []), stages[0].out_format)
        lines, results = [f"{self.text}: {len(stages)} stages"], []
        with torch.no_grad():
            for n, step in enumerate(stages):
                inputs = stage_inputs(step, operands, results)
                name = "" if not program.names or program.names[n] is None else f" ({program.names[n]})"
                lines.append(f"stage %{n}{name}:")
                lines.append(_explain(step.assignment, inputs, step.out_format))
                results.append(evaluate(step.assignment, inputs, step.out_format))
        kept = frozenset(program.names.index(name) for name in self.returns or ())
        return "\n".join(lines + describe_program(program, operands, kept))

    def __repr__(self) -> str:
        return f"CompiledExpression({self.text!r})"


def _returned(script: Script, returns: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """The names of the results a call returns (None: the last statement's alone)."""
    if returns is None:
        return None
    names = (returns,) if isinstance(returns, str) else tuple(returns)
    written = [s.output for s in script.statements]
    unknown = [name for name in names if name not in written]
    if unknown or not names:
        raise ValueError(f"returns names results the statements write ({', '.join(written)}), got {names}")
    return names


def compile_expression(text: str, out_format=None, returns: str | Sequence[str] | None = None) -> CompiledExpression:
    """Compile an index-notation expression into a callable.

    ``"Y[i,k] = relu(A[i,j] * X[j,k] + b[k])"``: operands are tensors or
    :class:`SparseTensor` s, passed in order of first appearance in the text or by name;
    ``out_format`` as for :func:`einsum` (None with a mask), for the last statement.

    Statements separated by ``;`` or newlines form a program: each reads the caller's
    operands and the results of the statements before it by their names
    (``M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i]); ...``). The call returns
    the last statement's result, or with ``returns`` (a name or names of results) those
    results, a tuple. The planner runs consecutive statements that read earlier results
    only at their shared outer coordinates as one kernel (:func:`explain` says which and
    why); gradients flow through every statement.

    Grammar (``{}``: repeated, ``[]``: optional; names are ``[A-Za-z_][A-Za-z0-9_]*``)::

        program   = statement { (";" | newline) statement }
        statement = name [ "<" name ">" ] "[" [ indices ] "]" "=" sum
        sum       = product { ("+" | "-") product }
        product   = unary { ("*" | "/") unary }
        unary     = ("-" | "+") unary | atom
        atom      = number | access | call | reduction | "(" sum ")"
        access    = name "[" [ indices ] "]"
        call      = function "(" sum { "," sum } ")"
        reduction = ("sum" | "max" | "min") "[" indices "]" "(" sum ")"
        indices   = name { "," name }

    * functions: ``relu gelu silu sigmoid tanh exp log abs sqrt neg`` and the binary
      ``max(a, b)``, ``min(a, b)``; numbers as ``2``, ``0.125``, ``1e-3``;
      ``detach(x)`` is ``x`` with gradient 0 (``exp(S[i,j] - detach(M[i]))``: a shift that
      cancels in the result, such as softmax's row max, needs no derivative);
    * a product sums over its indices absent from its context (the output's, the
      enclosing reductions', and those the product's other factors write): Einstein's
      convention, so ``A[i,j] * X[j,k]`` sums over ``j`` and ``relu(A[i,k] * B[k,j])``
      sums over ``k`` inside the ``relu``;
    * ``sum[j](body)``, ``max[j,k](body)``, ``min[j](body)``: explicit reductions; their
      indices must appear in the body and cannot be output indices;
    * ``P<S>[i,j] = body``: an output mask (GraphBLAS's ``C<M>``), ``S`` indexed like the
      output: the body is computed only at ``S``'s stored entries (``S``'s values are not
      read) and the result has exactly ``S``'s pattern and format;
    * ``a / b``: ``b`` must be dense at run time (a sparse operand there is a ValueError).

    Semantics with sparse operands (the stages are in :mod:`sparsenn.compiler.frontend.program`):

    * a term (a product, possibly of function calls) is evaluated where all its sparse
      operands store entries; that is exact when its value vanishes with each of them
      (``relu(S[i,j]) * X[j,k]``, ``S[i,j] / d[i]``);
    * outside explicit reductions and masks the result is the dense math: a function
      whose argument does not vanish with a sparse operand (``relu(S[i,j] - M[i])``,
      ``relu(S[i,j] + T[i,j])``) gets the argument computed first, and a function that
      still does not vanish (``exp``, ``sigmoid``, ``log``) reads the operand densely:
      ``exp(S[i,j])`` equals ``torch.exp(S.to_dense())``;
    * inside ``op[j](...)`` and under a mask, terms range over stored entries only (as
      ``torch.sparse.softmax``): ``sum[j](exp(S[i,j] - M[i]))`` sums over ``S``'s stored
      ``j``; ``max[j](S[i,j])`` is the max over stored entries, ``-inf`` for an empty
      row; a product of dense operands ranges over everything;
    * ``Y[i,k] = relu(A[i,j] * X[j,k] + b[k])`` is one kernel whose epilogue adds the
      bias and applies ``relu`` per output element; a plain sum of products is one
      kernel as :func:`einsum` runs it.

    Errors in the text are :class:`NotationError` s with the column and a caret.
    """
    return CompiledExpression(text, out_format, returns)


def compiled_once(build: Callable[..., CompiledExpression]) -> Callable[..., CompiledExpression]:
    """``build`` (arguments -> a :class:`CompiledExpression`) run once per arguments,
    kept in a plain dict. A traced call builds its own: Dynamo would guard on the dict
    lacking the arguments while it traces the first call, and compile the model again
    on its second (a ``functools.lru_cache`` wrapper it traces through, warning that it
    does); the expression's plans and kernels are cached by its text either way."""
    built: dict[tuple, CompiledExpression] = {}

    @functools.wraps(build)
    def once(*args) -> CompiledExpression:
        if tracing():
            return build(*args)
        expression = built.get(args)
        if expression is None:
            expression = built[args] = build(*args)
        return expression
    return once


def plan(equation: str, *operands, out_format=None) -> Plan:
    """The plan (schedule, generated source) of the kernel ``einsum`` would run for
    these operands, with their schedule; for tools and tests. A ValueError when the
    call runs no single kernel (all operands dense, or a contraction path)."""
    assignment = parse(equation, len(operands))
    return _plan(assignment, check_call(assignment, operands, out_format))


def _plan(assignment: Assignment, checked: Checked) -> Plan:
    """The plan of the kernel a checked call runs, routed as :func:`.evaluate.evaluate`
    routes it, carrying this call's schedule."""
    routed = route(assignment, checked)
    if isinstance(routed, SplitCall):
        split = routed.split
        inner = check_call(split.assignment, split.operands(checked.operands), split.request)
        return _plan(split.assignment, inner)
    if isinstance(routed, DensifiedCall):
        raise ValueError("the call runs densely, BLAS on a dense copy of its sparse operand, not a kernel "
                         "(explain() shows why)")
    if isinstance(routed, SampledDenseCall):
        raise ValueError("the call runs densely, the whole product by BLAS sampled at its pattern, not a kernel "
                         "(explain() shows why)")
    if isinstance(routed, ShapePlan):
        return replace(routed.plan, schedule=routed.schedule)
    if isinstance(routed, DenseCall):
        raise ValueError("all operands are dense: the expression runs in torch.einsum, not a plan")
    raise ValueError("the call runs as a contraction path of pairwise products, not one kernel "
                     "(explain() shows the path)")


def kernel_schedule(equation: str, *operands, out_format=None) -> Schedule | None:
    """The schedule of the sparse kernel ``einsum`` would run, or weigh its dense path
    against, for these operands (over split indices for blocked ones); None when the call
    runs no kernel (all operands dense, or a contraction path). Plans, builds nothing."""
    assignment = parse(equation, len(operands))
    checked = check_call(assignment, operands, out_format)
    routed = route(assignment, checked)
    while isinstance(routed, SplitCall):
        split = routed.split
        assignment = split.assignment
        routed = route(assignment, check_call(assignment, split.operands(checked.operands), split.request))
    if isinstance(routed, (DensifiedCall, SampledDenseCall)):
        routed = routed.shaped
    return routed.schedule if isinstance(routed, ShapePlan) else None


def explain(equation: str, *operands, out_format=None) -> str:
    """The parsed notation, output format, loop orders with reasons, workspace, tiles
    and generated C++ for ``einsum(equation, *operands)``."""
    equation, operands = normalise(equation, operands)
    return _explain(parse(equation, len(operands)), operands, out_format)


def _explain(assignment: Assignment, operands: Sequence, out_format) -> str:
    checked = check_call(assignment, operands, out_format)
    lines = [f"expression: {assignment}"]
    for n, op in enumerate(checked.operands):
        if isinstance(op, SparseTensor):
            desc = f"{op.format} {tuple(op.shape)} nnz={op.nnz}"
        else:
            desc = f"dense {tuple(op.shape)}"
        lines.append(f"  {describe_operand(assignment, n)}: {desc}")
    step = plan_step(assignment, checked.operands, out_format) if recorded(checked.operands) else None
    if step is not None:
        lines.append(step.describe())
    routed = route(assignment, checked)
    if isinstance(routed, SplitCall):
        split = routed.split
        lines.append(split.describe())
        return "\n".join(lines + [_explain(split.assignment, split.operands(checked.operands), split.request)])
    if isinstance(routed, DenseCall):
        lines.append("all operands dense: dispatched to torch.einsum")
        return "\n".join(lines)
    if isinstance(routed, (PathCall, EpiloguePathCall)):
        lines.append("contraction path: cheaper than one fused kernel, each step its own kernel (BLAS when both "
                     "operands are dense):")
        if isinstance(routed, EpiloguePathCall):
            steps = describe_path(routed.path.assignment, routed.path.steps)
            return "\n".join(lines + steps + ["  then the epilogue, elementwise over the result"])
        return "\n".join(lines + describe_path(routed.assignment, routed.steps))
    if isinstance(routed, DensifiedCall):
        lines.append(routed.dense.describe())
        lines.append("the sparse kernel it was weighed against:")
        routed = routed.shaped
    elif isinstance(routed, SampledDenseCall):
        lines.append(routed.sampled.describe())
        lines.append("the sampled kernel it was weighed against:")
        routed = routed.shaped
    else:
        weighed = weighed_dense_path(assignment, checked, routed) or weighed_sampled_path(assignment, checked, routed)
        if weighed is not None:
            lines.append(weighed.describe())
    shown = replace(routed.plan, schedule=routed.schedule)
    if shown.assignment != assignment:
        lines.append(f"as planned (biases and factors the sums do not vary along moved into the epilogue, terms "
                     f"visiting the same points merged): {shown.assignment}")
    lines.append(f"output format: {'dense' if shown.output_format is None else shown.output_format}")
    if shown.anchor is not None:
        lines.append(
            f"output pattern: that of {describe_operand(assignment, shown.anchor)} (every term samples it); "
            "values are written at its positions, nothing is assembled"
        )
    lines += describe_schedule(shown.schedule)
    lines.append("generated C++:")
    lines.append(shown.source)
    return "\n".join(lines)


def describe_schedule(s: Schedule) -> list[str]:
    """The schedule's decisions and the reasons for them, one line each."""
    lines = s.describe().splitlines()
    lines.append("why:")
    lines += [f"  {r}" for r in s.reasons]
    return lines


@contextmanager
def use_target(target: Target) -> Iterator[Target]:
    """Plan for ``target`` instead of the host within the ``with`` block (in this
    thread), e.g. to see the schedule another machine would get. The compiler's caches
    are cleared on entry and exit, so no plan made for one machine serves the other."""
    if not isinstance(target, Target):
        raise TypeError(f"use_target needs a sparsenn.compiler.Target, got {type(target).__name__}")
    clear_caches()
    token = ACTIVE_TARGET.set(target)
    try:
        yield target
    finally:
        ACTIVE_TARGET.reset(token)
        clear_caches()
