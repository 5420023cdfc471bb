"""A held call: the guard and run function of one call signature (a call site's, or an
equation's last) written as one function, so a repeated call costs one Python frame.

:func:`held_call` returns ``call(operands)``: the run's result when no tracer, transform
or autocast sees the call (``autograd.unobserved``'s four thread-state queries, made
here) and the guard passes; :data:`RECORDED` when autograd records the call (the caller
runs it recorded); None otherwise (the caller takes the full path). A guard's first test
(:func:`.runtime.validate.strict_test`) and a launch's direct run
(:func:`.runtime.launcher.run_source`)
are written out into the function's text; other guards and runs are called from a closure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import is_grad_enabled
from torch._C import _are_functorch_transforms_active, _is_any_autocast_enabled, _is_tracing
from torch.compiler import is_compiling

from .autograd import recorded
from .runtime.cache import Guard
from .runtime.launcher import run_source
from .runtime.validate import strict_test

__all__ = ["RECORDED", "held_call", "nothing_held"]

Run = Callable

RECORDED = object()  # what a held call returns when autograd records it: the site runs it


def nothing_held(operands: tuple) -> None:
    return None


def held_call(guard: Guard, run: Run, out_format, counted: object = None) -> Callable[[tuple], object]:
    """``call(operands)``: the held signature's run over ``operands`` when no tracer,
    transform or autocast sees the call (:func:`.autograd.unobserved`'s four queries,
    made here) and ``guard`` passes; :data:`RECORDED` when autograd then records it;
    else None. ``counted``: a cache (``hits``) counting each call run here as its hit, as
    if the call had been found there. A guard's first test and a launch's direct run are
    written out into one function (:func:`_written_call`); otherwise one closure over both."""
    written = _written_call(guard, run, out_format, counted)
    if written is not None:
        return written

    def call(operands: tuple):
        if (is_compiling() or _is_tracing() or _is_any_autocast_enabled() or _are_functorch_transforms_active()
                or not guard(operands, out_format)):
            return None
        if is_grad_enabled() and recorded(operands):
            return RECORDED
        if counted is not None:
            counted.hits += 1
        return run(operands)

    return call


def _written_call(guard: Guard, run: Run, out_format, counted: object) -> Callable[[tuple], object] | None:
    """:func:`held_call`'s function as one function: the thread-state queries, ``guard``'s
    first test (:func:`.runtime.validate.strict_test`; when it fails or raises, ``guard``
    decides), then ``run``'s body (:func:`.runtime.launcher.run_source`): one Python
    frame for the whole call. None when ``guard`` or ``run`` has no such text."""
    test, body = strict_test(guard), run_source(run)
    if test is None or body is None:
        return None
    (expression, tested), (lines, ran) = test, body
    own = {"out_format": out_format, "guard": guard, "run": run, "recorded": recorded, "RECORDED": RECORDED,
           "is_compiling": is_compiling, "is_grad_enabled": is_grad_enabled, "tracing": _is_tracing,
           "autocast": _is_any_autocast_enabled, "transforms": _are_functorch_transforms_active, "counted": counted}
    if set(tested) & set(ran) or (set(tested) | set(ran)) & set(own):
        return None  # a name read by two texts
    constants = {**tested, **ran, **own}
    source = "\n".join([
        "def call(ops):",
        "    if is_compiling() or tracing() or autocast() or transforms():",
        "        return None",
        "    try:",
        f"        passed = {expression}",
        "    except RuntimeError:  # an inference tensor's version read",
        "        passed = False",
        "    if not passed:",
        "        if not guard(ops, out_format):",
        "            return None",
        "        if is_grad_enabled() and recorded(ops):",
        "            return RECORDED",
        *(["        counted.hits += 1"] if counted is not None else []),
        "        return run(ops)",
        "    if is_grad_enabled() and recorded(ops):",
        "        return RECORDED",
        *(["    counted.hits += 1"] if counted is not None else []),
        *lines])
    exec(_compiled(source), constants)
    return constants.pop("call")


@functools.lru_cache(maxsize=256)
def _compiled(source: str):
    """``source`` compiled once per text (it depends on the operands' kinds and the argument layout only)."""
    return compile(source, "<sparsenn held call>", "exec")
