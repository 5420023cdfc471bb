"""torch.einsum's whole grammar, rewritten into the compiler's core notation.

The core (:func:`~sparsenn.compiler.frontend.notation.parse_einsum`) takes one letter per
dimension, no letter twice within an operand, and one size per letter. torch.einsum
also takes

* an ellipsis ``...`` for the dimensions no letter names, broadcast across operands
  right-aligned (``...ij,...jk->...ik``); without ``->`` the output is the ellipsis
  dimensions, then the letters used exactly once, sorted;
* a letter repeated within an operand, which reads its diagonal: ``iji->j`` is
  ``sum_i T[i,j,i]``;
* a dimension of size 1 whose letter has another size elsewhere, broadcast: the operand
  does not depend on that index (``T[i,0]`` for every ``j``);
* the sublist form ``einsum(A, [0, 1], B, [1, 2], [0, 2])`` and operands given as one
  list, ``einsum("ij,jk", [A, B])``.

:func:`normalise` rewrites a call into the core form: fresh letters for the ellipsis
dimensions, each operand with repeated letters or broadcast dimensions replaced by its
:func:`~sparsenn.compiler.frontend.diagonal.view`, and an explicit output; what to do is worked
out once per equation and operand shapes (:class:`Rewrite`). An equation that needs
none of this (no ``.``, no letter twice within an operand) is recognised once per
string and passed on as it is; size-1 broadcasting in such an equation is handled by
:func:`broadcast_size_one` only after the plain call has failed, so it costs nothing
when shapes agree.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import SparseTensor

from .diagonal import Groups, view
from .notation import Assignment, NotationError, parse_einsum
from ..runtime.cache import LRUCache

__all__ = ["Equation", "Rewrite", "parse", "normalise", "broadcast_size_one", "core_assignment"]

ELLIPSIS = "..."
_LETTERS = string.ascii_letters
_ALLOWED = frozenset(_LETTERS + " ,.")
_PLAIN_LIMIT = 4096
_plain: set[str] = set()  # equations known to be in the core form already


@dataclass(frozen=True)
class Equation:
    """A parsed einsum equation: each operand's labels (letters, or :data:`ELLIPSIS`)
    and the output's (None when implicit)."""

    text: str
    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...] | None

    def spec(self, n: int) -> str:
        """Operand ``n``'s subscripts as written, without spaces."""
        return "".join(self.inputs[n])


def _is_plain(equation: str) -> bool:
    """True when ``equation`` is already in the core form (no ``.``, no letter twice in
    an operand); the core parser then reports anything else wrong with it."""
    if "." in equation:
        return False
    lhs = equation.partition("->")[0].replace(" ", "")
    return all(len(set(spec)) == len(spec) for spec in lhs.split(","))


def _labels(equation: str, start: int, end: int, where: str) -> tuple[str, ...]:
    """The labels of ``equation[start:end]`` (one operand, or the output), whose
    characters are letters, spaces and dots."""
    labels: list[str] = []
    column = start
    while column < end:
        char = equation[column]
        if char in _LETTERS:
            labels.append(char)
        elif char == ".":
            if equation[column:column + 3] != ELLIPSIS or column + 3 > end:
                raise NotationError(
                    f"einsum equation {equation!r}: '.' at column {column} in {where} is not part of an "
                    "ellipsis '...'"
                )
            if ELLIPSIS in labels:
                raise NotationError(f"einsum equation {equation!r}: {where} has a second ellipsis at column {column}")
            labels.append(ELLIPSIS)
            column += 2
        column += 1
    return tuple(labels)


@functools.lru_cache(maxsize=1024)
def parse(equation: str) -> Equation:
    """Parse any equation torch.einsum accepts; NotationError naming the column otherwise."""
    if not isinstance(equation, str):
        raise TypeError(f"einsum equation must be a str, got {type(equation).__name__}")
    arrow = equation.find("->")
    if arrow >= 0 and equation.find("->", arrow + 2) >= 0:
        raise NotationError(f"einsum equation {equation!r} has more than one '->'")
    bad = [(column, char) for column, char in enumerate(equation.replace("->", "  ", 1)) if char not in _ALLOWED]
    if bad:
        raise NotationError(
            f"einsum equation {equation!r} contains invalid characters {sorted({c for _, c in bad})} (the first at "
            f"column {bad[0][0]}); indices must be letters a-z, A-Z"
        )
    lhs_end = len(equation) if arrow < 0 else arrow
    inputs, start = [], 0
    for end in [column for column in range(lhs_end) if equation[column] == ","] + [lhs_end]:
        inputs.append(_labels(equation, start, end, f"operand {len(inputs)}"))
        start = end + 1
    if arrow < 0:
        return Equation(equation, tuple(inputs), None)
    output = _labels(equation, arrow + 2, len(equation), "the output")
    used = {label for labels in inputs for label in labels}
    for n, label in enumerate(output):
        if label in output[:n]:
            raise NotationError(f"index '{label}' appears twice in the output of {equation!r}")
        if label != ELLIPSIS and label not in used:
            raise NotationError(f"output index '{label}' of {equation!r} does not appear in any operand")
    return Equation(equation, tuple(inputs), output)


def _shape(n: int, op: object) -> tuple[int, ...]:
    if isinstance(op, SparseTensor):
        return op.shape
    if not isinstance(op, torch.Tensor):
        raise TypeError(f"operand {n} must be a torch.Tensor or SparseTensor, got {type(op).__name__}")
    if op.layout != torch.strided:
        raise TypeError(
            f"operand {n} is a torch sparse tensor ({op.layout}); wrap it with sparsenn.SparseTensor.from_torch(...)"
        )
    return tuple(op.shape)


def _dimension_labels(eq: Equation, shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[str, ...]], int]:
    """Each operand's label per dimension, its ellipsis dimensions labelled ``.0`` ..
    ``.{E-1}`` right-aligned (``E``: the most any operand has), and ``E``."""
    named = [len(labels) - (ELLIPSIS in labels) for labels in eq.inputs]
    for n, (labels, shape) in enumerate(zip(eq.inputs, shapes)):
        if ELLIPSIS in labels and len(shape) < named[n]:
            raise ValueError(
                f"operand {n} has {len(shape)} dimension(s) but {eq.spec(n)!r} names {named[n]} besides '...'"
            )
        if ELLIPSIS not in labels and len(shape) != named[n]:
            raise ValueError(
                f"operand {n} has {len(shape)} dimension(s) but the expression indexes it with {named[n]} "
                f"({eq.spec(n)}) and no '...'"
            )
    extra = [len(shape) - named[n] for n, shape in enumerate(shapes) if ELLIPSIS in eq.inputs[n]]
    width = max(extra, default=0)
    expanded = []
    for n, (labels, shape) in enumerate(zip(eq.inputs, shapes)):
        if ELLIPSIS in labels:
            at, count = labels.index(ELLIPSIS), len(shape) - named[n]
            dots = tuple(f".{width - count + d}" for d in range(count))
            labels = labels[:at] + dots + labels[at + 1:]
        expanded.append(labels)
    return expanded, width


def _describe(label: str) -> str:
    return f"index '{label}'" if label in _LETTERS else f"'...' dimension {label[1:]} (counted from the left)"


def _broadcast_sizes(eq: Equation, labels: list[tuple[str, ...]], shapes: Sequence[tuple[int, ...]]) -> dict[str, int]:
    """The size of every label after broadcasting; a repeated letter within an operand
    must have one size there, and sizes other than 1 must agree across operands."""
    sizes: dict[str, tuple[int, int]] = {}
    for n, (names, shape) in enumerate(zip(labels, shapes)):
        own: dict[str, int] = {}
        for label, size in zip(names, shape):
            if own.setdefault(label, size) != size:
                times = names.count(label)
                raise NotationError(
                    f"index '{label}' appears {'twice' if times == 2 else f'{times} times'} in operand {n} "
                    f"({eq.spec(n)!r}) with sizes {own[label]} and {size}; a repeated index reads a diagonal, "
                    "which needs equal sizes"
                )
        for label, size in own.items():
            known = sizes.get(label)
            if known is None or (known[0] == 1 and size != 1):
                sizes[label] = (size, n)
            elif size not in (1, known[0]):
                raise ValueError(
                    f"{_describe(label)} has size {size} in operand {n} but size {known[0]} in operand {known[1]} "
                    "(only sizes 1 broadcast)"
                )
    return {label: size for label, (size, _) in sizes.items()}


def _output(eq: Equation, width: int) -> tuple[str, ...]:
    dots = tuple(f".{d}" for d in range(width))
    if eq.output is None:  # torch's rule: ellipsis dimensions, then letters used once, sorted
        counts: dict[str, int] = {}
        for labels in eq.inputs:
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
        return dots + tuple(sorted(x for x, c in counts.items() if c == 1 and x != ELLIPSIS))
    out: list[str] = []
    for label in eq.output:
        out += dots if label == ELLIPSIS else (label,)
    return tuple(out)


@dataclass(frozen=True)
class Rewrite:
    """One equation's core form for operands of given shapes: the core equation, and per
    operand the groups of modes its :func:`~sparsenn.compiler.frontend.diagonal.view` walks
    together (None: the operand is used as it is)."""

    equation: str
    groups: tuple[Groups | None, ...]


@functools.lru_cache(maxsize=1024)
def _rewrite_for(eq: Equation, shapes: tuple[tuple[int, ...], ...]) -> Rewrite:
    labels, width = _dimension_labels(eq, shapes)
    sizes = _broadcast_sizes(eq, labels, shapes)
    fresh = [x for x in _LETTERS if not any(x in names for names in eq.inputs)]
    if width > len(fresh):
        raise NotationError(f"einsum equation {eq.text!r} needs {width} letters for '...' but {len(fresh)} are unused")
    letter = {f".{d}": fresh[d] for d in range(width)} | {x: x for x in _LETTERS}
    specs, views = [], []
    for names, shape in zip(labels, shapes):
        groups: dict[str, list[int]] = {}
        for mode, (label, size) in enumerate(zip(names, shape)):
            if size != 1 or sizes[label] == 1:  # a broadcast size-1 dimension is dropped
                groups.setdefault(label, []).append(mode)
        as_is = list(groups.values()) == [[mode] for mode in range(len(shape))]
        views.append(None if as_is else tuple(tuple(g) for g in groups.values()))
        specs.append("".join(letter[label] for label in groups))
    output = "".join(letter[label] for label in _output(eq, width))
    return Rewrite(",".join(specs) + "->" + output, tuple(views))


def _rewrite(eq: Equation, operands: Sequence) -> tuple[str, tuple]:
    """``eq`` on ``operands`` in the core form (see the module docstring)."""
    if len(operands) != len(eq.inputs):
        raise NotationError(
            f"einsum equation {eq.text!r} names {len(eq.inputs)} operand(s) but {len(operands)} were given"
        )
    rewrite = _rewrite_for(eq, tuple(_shape(n, op) for n, op in enumerate(operands)))
    return rewrite.equation, tuple(op if g is None else view(op, g) for op, g in zip(operands, rewrite.groups))


def _subscript(label: object, where: str) -> str:
    if label is Ellipsis:
        return ELLIPSIS
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < 52:
        return chr(ord("A") + label) if label < 26 else chr(ord("a") + label - 26)
    raise ValueError(f"einsum sublist of {where}: subscript {label!r} is not Ellipsis or an int within [0, 52)")


def _from_sublists(args: tuple) -> tuple[str, tuple]:
    """``(A, [0, 1], B, [1, 2], [0, 2])`` -> ``("AB,BC->AC", (A, B))``, as torch maps
    0-25 to A-Z and 26-51 to a-z."""
    pairs = len(args) // 2
    sublists = [(args[2 * n + 1], f"operand {n}") for n in range(pairs)]
    if len(args) % 2:
        sublists.append((args[-1], "the output"))
    specs = []
    for sublist, where in sublists:
        if not isinstance(sublist, (list, tuple)):
            raise TypeError(f"einsum sublist of {where} must be a list of ints, got {type(sublist).__name__}")
        specs.append("".join(_subscript(label, where) for label in sublist))
    equation = ",".join(specs[:pairs]) + ("->" + specs[-1] if len(args) % 2 else "")
    return equation, tuple(args[0:2 * pairs:2])


def normalise(equation: object, operands: tuple, remember: bool = True) -> tuple[object, tuple]:
    """``(equation, operands)`` of an ``einsum`` call in the core form. Plain equations
    return at once; a non-str equation other than an operand (sublist form) is returned
    as it is for the core parser to reject. ``remember=False`` (traced code) neither
    reads nor adds to the set of known plain equations: a compiled graph would guard on
    its contents, and be compiled again when it grows."""
    listed = len(operands) == 1 and isinstance(operands[0], (list, tuple))
    if remember and type(equation) is str and equation in _plain and not listed:
        return equation, operands
    if isinstance(equation, (torch.Tensor, SparseTensor)):
        equation, operands = _from_sublists((equation, *operands))
    elif listed:
        operands = tuple(operands[0])
    if not isinstance(equation, str):
        return equation, operands
    if _is_plain(equation):
        if remember:
            if len(_plain) >= _PLAIN_LIMIT:
                _plain.clear()
            _plain.add(equation)
        return equation, operands
    return _rewrite(parse(equation), operands)


def broadcast_size_one(equation: str, operands: tuple) -> tuple[str, tuple] | None:
    """After a call of a core-form equation failed: the call with its size-1 dimensions
    broadcast, when that is what it lacked; None when broadcasting changes nothing (or
    does not apply), so the original error stands."""
    try:
        rewritten, ops = _rewrite(parse(equation), operands)
    except (ValueError, TypeError):
        return None
    return None if all(a is b for a, b in zip(ops, operands)) else (rewritten, ops)


_equations: LRUCache[Assignment] = LRUCache("equations", 1024)


def core_assignment(equation: str, num_operands: int) -> Assignment:
    """``parse_einsum(equation, num_operands)`` of a core equation (:func:`normalise`'s),
    cached."""
    key = (equation, num_operands)
    assignment = _equations.get(key)
    if assignment is None:
        assignment = parse_einsum(equation, num_operands)
        _equations.put(key, assignment)
    return assignment
