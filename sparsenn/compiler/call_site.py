"""A call site: one place in code (a layer's forward) calling a compiled expression.

Such a site mostly sees one signature of operands from call to call (the same weight,
inputs of one shape). :class:`CallSite` keeps the guard and run function of the
signature it saw last (:func:`.runtime.evaluate.guarded_run`), so a repeated call costs
that guard (every per-call check of :func:`.runtime.validate.call_guard`: types, shapes,
strides, dtypes, unedited index arrays) and the run, without the entry point's dispatch
or the shared cache's search among the expression's recent signatures (which several
layers of one expression would take turns evicting). A call autograd records runs the
same way inside the recorded node (:func:`.autograd.held_evaluate`), and the site holds
the gradient calls of its backward too, unless the planner finds the training step
cheaper dense (:mod:`.dense_step`): the site then holds that decision and runs the step
through torch's autograd. Calls under autocast, a torch.func transform or
a tracer, and a call whose guard fails, go through the expression as usual and leave the
site holding the signature of the last call that has none of these.
:func:`~.runtime.cache.clear_caches` (and ``use_target``) empties every site.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsenn.formats import Format, SparseTensor

from .api import CompiledExpression, compile_expression
from .autograd import HeldGradient, held_evaluate, recorded, unobserved
from .dense_step import DenseStep, dense_step
from .runtime.cache import Guard, forget_with_caches
from .runtime.evaluate import Run, guarded_run
from .runtime.tracing import encoded_call
from .held import RECORDED, held_call, nothing_held

__all__ = ["CallSite", "traced_site_call"]

# The expression of each (text, out_format) that sites call: several layers of one
# expression (each site holding it) then reach it through one name when traced, where a
# reach through each site's attribute costs a Python guard, on every compiled call, that
# the objects are one.
_EXPRESSIONS: dict[tuple[str, str], CompiledExpression] = {}


class CallSite:
    """``site(*operands)`` is ``expression(*operands)`` (see the module doc); the
    expression is a single-statement sum of products (:attr:`CompiledExpression.assignment`)."""

    __slots__ = ("expression", "key", "assignment", "out_format", "_held", "_run_held", "_gradients", "_records",
                 "_step", "__weakref__")

    def __init__(self, expression: CompiledExpression) -> None:
        if expression.assignment is None or expression.returns is not None:
            raise ValueError(f"a call site needs an expression of one statement, got {expression.text!r}")
        self.key = (expression.text, repr(expression.out_format))
        expression = _EXPRESSIONS.setdefault(self.key, expression)
        self.expression, self.assignment, self.out_format = expression, expression.assignment, expression.out_format
        self._held: tuple[Guard, Run] | None = None  # one object: a thread reads a guard with its own run
        self._run_held: Callable[[tuple], object] = nothing_held  # the held signature's unrecorded call
        self._gradients: dict[int, HeldGradient] = {}
        self._step: tuple[tuple[bool, ...], DenseStep | None] | None = None  # (operands requiring grad, the step)
        self._records = self.assignment.epilogue is None  # an epilogue is recorded as two calls
        forget_with_caches(self)

    @property
    def holds_signature(self) -> bool:
        """Whether the site holds a signature (:meth:`cached` can find the call)."""
        return self._held is not None

    def cached(self, operands: tuple):
        """The result of a call over ``operands`` of the signature held, else None
        (nothing is run: call the site)."""
        result = self._run_held(operands)
        if result is not RECORDED:
            return result
        held = self._held
        if held is None or not self._records:
            return None
        step = self._dense_step(operands)
        result = None if step is None else step.run(operands)
        if result is not None:
            return result
        return held_evaluate(self.assignment, operands, self.out_format, held[1], self._gradients)

    def _dense_step(self, operands: tuple) -> DenseStep | None:
        """The dense step of the held signature with these operands requiring grad
        (decided once for them, :func:`.dense_step.dense_step`), else None."""
        requires = tuple((op.values if isinstance(op, SparseTensor) else op).requires_grad for op in operands)
        decided = self._step
        if decided is None or decided[0] != requires:
            decided = self._step = (requires, dense_step(self.assignment, operands, self.out_format))
        return decided[1]

    def __call__(self, *operands):
        result = self.cached(operands)
        return self.call(operands) if result is None else result

    def call(self, operands: tuple):
        """The call through the expression (no guard tried), the site then holding its
        signature unless autocast, a transform or a tracer saw it."""
        result = _EXPRESSIONS[self.key](*operands)
        if unobserved():
            held = self._held = guarded_run(self.assignment, operands, self.out_format)
            self._run_held = nothing_held if held is None else held_call(*held, self.out_format)
            self._gradients = {}  # the gradient calls of the signature held
            self._step = None
            if self._held is not None and self._records and recorded(operands):
                self._dense_step(operands)  # decided with the signature, not at its next call
        return result

    def clear(self) -> None:
        """Forget the signatures held (the caches they came from were cleared)."""
        self._held = None
        self._run_held = nothing_held
        self._gradients = {}
        self._step = None

    def __reduce__(self):  # the guard and run are code made for this process: rebuilt on first call
        return _site, (self.expression.text, self.out_format)

    def __deepcopy__(self, memo: dict) -> CallSite:
        return CallSite(self.expression)


@torch.compiler.assume_constant_result
def traced_site_call(text: str, out_format: str, fmt: Format, index_dtype: torch.dtype) -> str:
    """The call string (:mod:`.runtime.callspec`) of the sites' expression ``text`` with
    ``out_format`` over a dense operand, a sparse one of format ``fmt`` (index arrays of
    ``index_dtype``) and dense ones after it, as a traced call of a site's expression
    writes it (a layer's traced forward passes its operands' tensors to
    :func:`.runtime.tracing.traced_op` with it). A constant for the tracer, which runs it
    once: nothing read here is guarded."""
    assignment = _EXPRESSIONS[(text, repr(out_format))].assignment
    fields = [(None, None, None)] * assignment.num_operands
    fields[1] = (fmt, index_dtype, None)
    call, anchor = encoded_call(assignment, (), out_format, *(field for three in fields for field in three))
    if anchor is not None:
        raise ValueError(f"sparsenn: {text!r} over a {fmt} operand has a sparse result; a traced site call is dense")
    return call


def _site(text: str, out_format) -> CallSite:
    return CallSite(compile_expression(text, out_format))
