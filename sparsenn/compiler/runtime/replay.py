"""Repeated calls of the traced op, replayed without rebuilding the call.

A compiled graph calls ``sparsenn::evaluate`` with the same call string, and tensors of
the same signature, every time it runs. The first call is decoded, rebuilt and evaluated
in full (:func:`.ops.evaluate_op`); :func:`remember` then keeps, per call string, a
guard over the op's flat arguments and a run:

* the guard holds when every index array is the very tensor validated then (same
  object, data address and in-place version: the pattern is the one checked), every
  other tensor has that call's shape, dtype and strides on the CPU, and the shapes and
  ``order`` arguments are equal — exactly the calls whose operands have the evaluation
  key (:func:`.validate.call_key`) of the first;
* the run rebuilds the operands as views of the validated patterns with the new values
  and calls the run function evaluation resolved for that key
  (:func:`.evaluate.resolved`), returning the kernel's result when it already has the
  announced layout.

The other tensors are tested together by one call of torch's C++ tensor guards
(:func:`.validate.tensor_guards`, as :func:`.validate.call_guard` uses: type, dispatch keys, dtype,
device, sizes, strides, requires_grad), made at the first replay, in the dispatch state
the op's calls run in; when that fails, one by one in Python as above. So a repeated
call costs one guard, a SparseTensor view per sparse operand and the launch. Python
runs cache-cold inside a compiled graph (between Dynamo's and inductor's work), which
is why this path makes few calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from sparsenn.formats import SparseTensor

from .cache import Guard, LRUCache
from .validate import tensor_guards

__all__ = ["remember", "replay"]

Replay = Callable[[list[Tensor]], Tensor]
Finish = Callable[[Sequence, object], Tensor]  # (operands, evaluation result) -> the op's output

# Call string -> its last PER_CALL (guard, replay) pairs, newest first. Keyed by the
# string's value: the dispatcher hands the op a new str object on every call.
_replays: LRUCache[tuple[tuple[Guard, Replay], ...]] = LRUCache("traced calls", 256)
PER_CALL = 4

_NO_VALUES = torch.empty(0)


def replay(call: str, tensors: list[Tensor], shapes: list, order: list[int]) -> Tensor | None:
    """The op's output for a call :func:`remember` recorded a run for, else None."""
    for guard, run in _replays.get(call) or ():
        if guard(tensors, (shapes, order)):
            return run(tensors)
    return None


def remember(call: str, tensors: list[Tensor], shapes: list, order: list[int], operands: Sequence,
             slots: Sequence[int], run: Callable[[Sequence], object] | None, finish: Finish,
             strides: tuple[int, ...] | None) -> None:
    """Record how to replay a call just evaluated: ``operands`` were rebuilt from
    ``tensors`` (operand ``n``'s dense tensor or values at ``slots[n]``), ``run`` is the
    run function its evaluation resolved (None: the call is checked in full every time,
    nothing is recorded) and ``finish`` turned its result into the op's output, a dense
    tensor of ``strides`` (None: values on a pattern, always finished)."""
    if run is None:
        return
    arrays = set(range(len(tensors))) - set(slots)
    if any(tensors[k].is_inference() for k in arrays):
        return  # no version counter: such arrays are validated at every call
    constants: dict[str, object] = {"run": run, "finish": finish, "strides": strides}
    terms = []
    for n, (op, slot) in enumerate(zip(operands, slots)):
        if isinstance(op, SparseTensor):
            pattern = op._share(op.shape, op.format, _NO_VALUES)  # without this call's values
            constants[f"share{n}"] = functools.partial(pattern._share, op.shape, op.format)
            terms.append(f"share{n}(ts[{slot}])")
        else:
            terms.append(f"ts[{slot}]")
    build = f"(ops := [{', '.join(terms)}])"
    if strides is None:
        body = f"finish({build}, run(ops))"
    else:  # the kernel's result as it is when it has the announced layout
        body = f"out if (out := run({build})).stride() == strides else finish(ops, out)"
    replayed: Replay = eval(f"lambda ts: {body}", constants)
    older = _replays.get(call) or ()
    _replays.put(call, ((_guard(tensors, arrays, shapes, order), replayed), *older[:PER_CALL - 1]))


def _guard(tensors: Sequence[Tensor], arrays: set[int], shapes: list, order: list[int]) -> Callable:
    """``guard(ts, (shapes, order))``: the module doc's test, written out for these
    tensors as one expression (as :func:`.validate.call_guard` is): the index arrays by
    identity and version, the others by torch's tensor guards, else in Python (a pass
    there makes the tensor guards if none are made yet)."""
    constants: dict[str, object] = {"strided": torch.strided, "shapes": list(shapes), "order": list(order)}
    tests = [f"len(ts) == {len(tensors)}", "detail[0] == shapes", "detail[1] == order"]
    exact = []
    for k, t in enumerate(tensors):
        if k in arrays:
            constants[f"a{k}"], constants[f"p{k}"], constants[f"v{k}"] = t, t.data_ptr(), t._version
            tests.append(f"ts[{k}] is a{k} and a{k}.data_ptr() == p{k} and a{k}._version == v{k}")
        else:
            constants[f"s{k}"], constants[f"d{k}"], constants[f"st{k}"] = t.shape, t.dtype, t.stride()
            exact.append(f"(t{k} := ts[{k}]).shape == s{k} and t{k}.dtype is d{k} and t{k}.stride() == st{k} "
                         f"and t{k}.is_cpu and t{k}.layout is strided")
    checked = ", ".join(f"ts[{k}]" for k in range(len(tensors)) if k not in arrays)
    if not checked:
        return eval(f"lambda ts, detail: {' and '.join(tests + exact)}", constants)
    layouts = constants["layouts"] = _TensorLayouts()
    return eval(f"lambda ts, detail: {' and '.join(tests)} and (layouts.check({checked}) "
                f"or ({' and '.join(exact)} and layouts.make({checked})))", constants)


class _TensorLayouts:
    """torch's C++ guards of some tensors' type, dispatch keys, dtype, device, sizes,
    strides and requires_grad, made once from tensors that passed the exact test (a
    TensorGuards checks dispatch keys against the state it was made in)."""

    __slots__ = ("check", "made")

    def __init__(self) -> None:
        self.check: Callable[..., bool] = _never
        self.made = False

    def make(self, *tensors: Tensor) -> bool:
        """Make the guards from ``tensors`` unless made already (or they cannot be); True."""
        if not self.made:
            self.made = True
            self.check = tensor_guards(tensors) or _never  # none: the exact test alone
        return True


def _never(*tensors: Tensor) -> bool:
    return False
