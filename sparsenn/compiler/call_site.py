"""A call site: one place in code (a layer's forward) calling a compiled expression.

Such a site mostly sees one signature of operands from call to call (the same weight,
inputs of one shape). :class:`CallSite` keeps the guard and run function of the
signature it saw last (:func:`.runtime.evaluate.guarded_run`), so a repeated plain call costs
that guard (every per-call check of :func:`.runtime.validate.call_guard`: types, shapes,
strides, dtypes, unedited index arrays) and the run, without the entry point's dispatch
or the shared cache's search among the expression's recent signatures (which several
layers of one expression would take turns evicting). A call is plain when nothing but
the kernel has to see it: no autograd recording, autocast, torch.func transform or
tracer; any other call, and a call whose guard fails, goes through the expression as
usual and leaves the site holding its signature. :func:`~.runtime.cache.clear_caches` (and
``use_target``) empties every site.
"""

from __future__ import annotations

import torch
from torch import is_autocast_enabled

from .api import CompiledExpression, compile_expression
from .autograd import recorded
from .runtime.cache import Guard, forget_with_caches
from .runtime.evaluate import Run, guarded_run
from .runtime.tracing import tracing

__all__ = ["CallSite"]

_CPU = "cpu"


class CallSite:
    """``site(*operands)`` is ``expression(*operands)`` (see the module doc); the
    expression is a single-statement sum of products (:attr:`CompiledExpression.assignment`)."""

    __slots__ = ("expression", "assignment", "out_format", "_held", "__weakref__")

    def __init__(self, expression: CompiledExpression) -> None:
        if expression.assignment is None or expression.returns is not None:
            raise ValueError(f"a call site needs an expression of one statement, got {expression.text!r}")
        self.expression, self.assignment, self.out_format = expression, expression.assignment, expression.out_format
        self._held: tuple[Guard, Run] | None = None  # one object: a thread reads a guard with its own run
        forget_with_caches(self)

    @property
    def holds_signature(self) -> bool:
        """Whether the site holds a signature (:meth:`cached` can find the call)."""
        return self._held is not None

    def cached(self, operands: tuple):
        """The result of a plain call over ``operands`` of the signature held, else None
        (nothing is run: call the site)."""
        held = self._held
        if held is not None and _plain(operands) and held[0](operands, self.out_format):
            return held[1](operands)
        return None

    def __call__(self, *operands):
        result = self.cached(operands)
        return self.call(operands) if result is None else result

    def call(self, operands: tuple):
        """The call through the expression (no guard tried), the site then holding its
        signature if it is plain."""
        result = self.expression(*operands)
        if _plain(operands):
            self._held = guarded_run(self.assignment, operands, self.out_format)
        return result

    def clear(self) -> None:
        """Forget the signature held (the caches it came from were cleared)."""
        self._held = None

    def __reduce__(self):  # the guard and run are code made for this process: rebuilt on first call
        return _site, (self.expression.text, self.out_format)

    def __deepcopy__(self, memo: dict) -> CallSite:
        return CallSite(self.expression)


def _site(text: str, out_format) -> CallSite:
    return CallSite(compile_expression(text, out_format))


def _plain(operands: tuple) -> bool:
    """Whether only the kernel needs to see a call over ``operands`` (see the module doc)."""
    return (not recorded(operands) and not is_autocast_enabled(_CPU) and not tracing()
            and torch._C._functorch.peek_interpreter_stack() is None)
