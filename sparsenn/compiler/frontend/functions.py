"""The scalar functions of index notation: what each computes (in C++ and in torch),
whether it keeps zeros, and its derivatives.

A :class:`~.notation.Value` tree applies them to a term's factor values. The same tree
is printed into kernels (each function is an inline helper of ``sparsenn_kernel.h``,
named ``sn_<name>``), evaluated on tensors by :func:`evaluate` (dense operands, and the
reference of the tests) and differentiated by :func:`derivative` (autograd compiles the
derivative trees like any other value).

``zero_preserving``: ``f(0, ..., 0) == 0``. A function that keeps zeros applied to a
product stays on the product's pattern; one that does not (``exp``, ``sigmoid``) gives
values at unstored entries too, which the front end makes explicit (see
:mod:`.staging`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .notation import Apply, Constant, Factor, Reduced, Value

__all__ = ["Function", "FUNCTIONS", "PUBLIC_FUNCTIONS", "evaluate", "evaluate_in_place", "derivative", "factors_of",
           "product", "renumbered", "vanishes_with", "apply", "IDENTITY"]


@dataclass(frozen=True)
class Function:
    """``name(x, ...)``: its arity, whether users may write it, whether it keeps zeros,
    its torch reference, its partial derivatives ``derivatives(args, result)`` (one
    Value per argument, over the argument Values and the result) and, if torch has one,
    its form writing the result over its first argument (``in_place(x, ...)``, returns ``x``)."""

    name: str
    arity: int
    public: bool
    zero_preserving: bool
    torch: Callable[..., torch.Tensor]
    derivatives: Callable[[tuple[Value, ...], Value], tuple[Value, ...]]
    in_place: Callable[..., torch.Tensor] | None = None


def apply(name: str, *args: Value) -> Value:
    """``name(*args)``, with products and sums by 0 and 1 folded."""
    if name == "mul":
        a, b = args
        if Constant(0.0) in args:
            return Constant(0.0)
        if a == Constant(1.0):
            return b
        if b == Constant(1.0):
            return a
    if name in ("add", "sub") and args[1] == Constant(0.0):
        return args[0]
    if name == "add" and args[0] == Constant(0.0):
        return args[1]
    if name == "div" and args[1] == Constant(1.0):
        return args[0]
    if all(isinstance(a, Constant) for a in args):
        return Constant(float(FUNCTIONS[name].torch(*(torch.tensor(a.value, dtype=torch.float64) for a in args))))
    return Apply(name, tuple(args))


_ONE, _HALF, _ZERO = Constant(1.0), Constant(0.5), Constant(0.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """d max(a, b) / da as torch.maximum's backward: 1 where a > b, 1/2 at ties."""
    return (a > b).to(a.dtype) + 0.5 * (a == b).to(a.dtype)


def _sigmoid_derivative(args, out):
    return (apply("mul", out, apply("sub", _ONE, out)),)


def _silu_derivative(args, out):
    (x,) = args
    s = apply("sigmoid", x)
    return (apply("add", s, apply("mul", apply("mul", x, s), apply("sub", _ONE, s))),)


_TABLE = [
    # name, arity, public, keeps zero, torch, derivatives(args, out)[, in place]
    Function("add", 2, False, True, torch.add, lambda a, out: (_ONE, _ONE), torch.Tensor.add_),
    Function("sub", 2, False, True, torch.sub, lambda a, out: (_ONE, Constant(-1.0)), torch.Tensor.sub_),
    Function("mul", 2, False, True, torch.mul, lambda a, out: (a[1], a[0]), torch.Tensor.mul_),
    Function("div", 2, False, False, torch.div, lambda a, out: (apply("div", _ONE, a[1]), apply("neg", (
        apply("mul", out, out) if a[0] == _ONE else apply("div", out, a[1])))), torch.Tensor.div_),
    Function("max", 2, True, True, torch.maximum,
             lambda a, out: (apply("pick", a[0], a[1]), apply("pick", a[1], a[0]))),
    Function("min", 2, True, True, torch.minimum,
             lambda a, out: (apply("pick", a[1], a[0]), apply("pick", a[0], a[1]))),
    Function("neg", 1, True, True, torch.neg, lambda a, out: (Constant(-1.0),), torch.neg_),
    Function("abs", 1, True, True, torch.abs, lambda a, out: (apply("sign", a[0]),), torch.abs_),
    Function("relu", 1, True, True, torch.relu, lambda a, out: (apply("step", a[0]),), torch.relu_),
    Function("gelu", 1, True, True, torch.nn.functional.gelu,
             lambda a, out: (apply("add", apply("normal_cdf", a[0]), apply("mul", a[0], apply("normal_pdf", a[0]))),),
             torch.ops.aten.gelu_),
    Function("silu", 1, True, True, torch.nn.functional.silu, _silu_derivative,
             lambda x: torch.nn.functional.silu(x, inplace=True)),
    Function("tanh", 1, True, True, torch.tanh, lambda a, out: (apply("sub", _ONE, apply("mul", out, out)),),
             torch.tanh_),
    Function("sqrt", 1, True, True, torch.sqrt, lambda a, out: (apply("div", _HALF, out),), torch.sqrt_),
    Function("sigmoid", 1, True, False, torch.sigmoid, _sigmoid_derivative, torch.sigmoid_),
    Function("exp", 1, True, False, torch.exp, lambda a, out: (out,), torch.exp_),
    Function("log", 1, True, False, torch.log, lambda a, out: (apply("div", _ONE, a[0]),), torch.log_),
    # detach(x) = x with d/dx = 0: a shift that cancels (softmax's max) needs no derivative
    Function("detach", 1, True, True, torch.detach, lambda a, out: (_ZERO,), lambda x: x),
    # Derivatives of the above; not for users.
    Function("step", 1, False, True, lambda x: (x > 0).to(x.dtype), lambda a, out: (_ZERO,)),
    Function("sign", 1, False, True, torch.sign, lambda a, out: (_ZERO,)),
    Function("pick", 2, False, False, _pick, lambda a, out: (_ZERO, _ZERO)),
    Function("equal", 2, False, False, lambda a, b: (a == b).to(a.dtype), lambda a, out: (_ZERO, _ZERO)),
    Function("normal_cdf", 1, False, False, _normal_cdf, lambda a, out: (apply("normal_pdf", a[0]),)),
    Function("normal_pdf", 1, False, False, _normal_pdf,
             lambda a, out: (apply("neg", apply("mul", a[0], out)),)),
]
FUNCTIONS: dict[str, Function] = {f.name: f for f in _TABLE}
PUBLIC_FUNCTIONS = tuple(f.name for f in _TABLE if f.public)

# The identity of each reduction: a max over no entries is -inf (torch.sparse.softmax's
# unspecified entries), a min +inf.
IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def evaluate(value: Value, factors: Sequence[torch.Tensor], reduced: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` on tensors (broadcast together): ``Factor(k)`` reads ``factors[k]``."""
    if isinstance(value, Factor):
        return factors[value.k]
    if isinstance(value, Constant):
        like = factors[0] if factors else reduced
        return torch.tensor(value.value, dtype=like.dtype)
    if isinstance(value, Reduced):
        return reduced
    args = [evaluate(a, factors, reduced) for a in value.args]
    return FUNCTIONS[value.function].torch(*args)


def evaluate_in_place(value: Value, factors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``value`` computed in the memory of ``factors[0]`` (overwritten; the others
    broadcast to it), when every function from the root down to ``Factor(0)`` along
    first arguments has an in-place form and no other argument reads ``Factor(0)``;
    None, with nothing written, otherwise."""
    if not _in_place(value):
        return None
    return _into(value, factors)


def _in_place(value: Value) -> bool:
    if value == Factor(0):
        return True
    if not isinstance(value, Apply) or FUNCTIONS[value.function].in_place is None:
        return False
    first, *rest = value.args
    return _in_place(first) and all(0 not in factors_of(a) for a in rest)


def _into(value: Value, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(value, Factor):
        return factors[0]
    first, *rest = value.args
    return FUNCTIONS[value.function].in_place(_into(first, factors), *(evaluate(a, factors) for a in rest))


def derivative(value: Value, wrt: Value) -> Value:
    """d value / d ``wrt`` (a :class:`Factor` or :class:`Reduced`), by the chain rule."""
    if value == wrt:
        return _ONE
    if not isinstance(value, Apply):
        return _ZERO
    partials = FUNCTIONS[value.function].derivatives(value.args, value)
    total: Value = _ZERO
    for arg, partial in zip(value.args, partials):
        inner = derivative(arg, wrt)
        if inner != _ZERO:
            total = apply("add", total, apply("mul", partial, inner))
    return total


def product(count: int) -> Value:
    """``Factor(0) * ... * Factor(count - 1)``: a term's value when it has no tree."""
    value: Value = Factor(0)
    for k in range(1, count):
        value = apply("mul", value, Factor(k))
    return value


def renumbered(value: Value, mapping: Callable[[int], Value]) -> Value:
    """``value`` with each ``Factor(k)`` replaced by ``mapping(k)``."""
    if isinstance(value, Factor):
        return mapping(value.k)
    if isinstance(value, Apply):
        return Apply(value.function, tuple(renumbered(a, mapping) for a in value.args))
    return value


def factors_of(value: Value) -> set[int]:
    """The factor numbers ``value`` reads."""
    if isinstance(value, Factor):
        return {value.k}
    if isinstance(value, Apply):
        return set().union(*(factors_of(a) for a in value.args))
    return set()


def vanishes_with(value: Value, k: int) -> bool:
    """Whether ``value`` is 0 wherever factor ``k`` is 0 (whatever the others are): a
    term whose value vanishes with each of its sparse factors is exact on their
    intersection, the entries it visits."""
    if isinstance(value, Factor):
        return value.k == k
    if isinstance(value, Constant):
        return value.value == 0.0
    if isinstance(value, Reduced):
        return False
    args = value.args
    if value.function == "mul":
        return any(vanishes_with(a, k) for a in args)
    if value.function == "div":
        return vanishes_with(args[0], k)
    return FUNCTIONS[value.function].zero_preserving and all(vanishes_with(a, k) for a in args)
