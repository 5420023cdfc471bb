"""A traced call's description (:class:`CallSpec`) and its stable text, the ``call``
argument of ``sparsenn::evaluate``.

A traced or exported program stores the text, and a later sparsenn reads it again, so the
text holds what the call is in the notation's own printed forms, never Python objects::

    sparsenn-call 1
    einsum 2: "ij,jk->ik"
    operands: csr/2 int32; dense
    out_format: none
    anchor: none

* line 1, the format's version (:data:`VERSION`): a text of another version raises an
  error naming both;
* line 2, what runs, as written: ``einsum <operands>: <equation>`` (the core equation
  :func:`..frontend.equation.normalise` gives), ``statement: <text>`` or ``script: <text>`` (a
  compiled expression's text), or ``assignment: <text>`` (an assignment the library
  built, in :mod:`..frontend.notation_text`'s form); texts are JSON strings;
* ``operands``: per operand ``dense``, or ``<format>/<rank> <index dtype>`` and
  ``shares <n>`` when it uses operand ``n``'s index arrays (its values alone are passed);
* ``out_format``: ``none``, ``dense``, ``auto``, ``name <JSON string>`` (a format name
  as the caller wrote it) or ``format <format>/<rank>``;
* ``anchor``: the operand whose pattern a sparse result has, or ``none`` (dense result).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, parse_format

from ..frontend.equation import core_assignment
from ..frontend.expression import Script, Statement, parse_script
from ..frontend.notation import Assignment
from ..frontend.notation_text import read_assignment, write_assignment
from ..plan.anchor import sampled_operand
from ..plan.bias import split_epilogue
from ..plan.infer import result_format
from ..frontend.program import Program, UserOperand
from ..frontend.staging import stage
from .cache import LRUCache

__all__ = ["VERSION", "CallSpec", "Layout", "SpecVersionError", "anchor_of", "decode", "derived", "read_spec",
           "remember_spec"]

VERSION = 1
_MAGIC = "sparsenn-call"
_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


class SpecVersionError(ValueError):
    """A call string written by a sparsenn whose format version this one cannot read."""


@dataclass(frozen=True)
class Layout:
    """A sparse operand's structure, all but its shape and arrays: ``shares`` is the
    earlier operand whose index arrays it uses (then only its values are passed), or None."""

    format: Format
    index_dtype: torch.dtype
    shares: int | None = None

    @property
    def num_arrays(self) -> int:
        """Index arrays passed for it: one per ``pos``/``crd`` its levels store."""
        if self.shares is not None:
            return 0
        return sum(int(level.has_pos) + int(level.has_crd) for level in self.format.levels)


@dataclass(frozen=True)
class CallSpec:
    """One traced evaluation: ``assignment`` (or a compiled expression's ``Statement`` or
    ``Script``, run as its staged program, fused as the planner groups it) over operands
    of ``layouts`` (None: dense), ``out_format`` requested; the result is dense when
    ``anchor`` is None, else values on operand ``anchor``'s pattern. ``written``: how
    line 2 of the text names it (``("einsum", equation, n)``, ``("statement", text)``,
    ``("script", text)`` or ``("assignment",)``)."""

    assignment: Assignment | Statement | Script
    layouts: tuple[Layout | None, ...]
    out_format: object
    anchor: int | None
    written: tuple = ("assignment",)

    def program(self) -> Program:
        """The stages of a statement for these layouts' formats."""
        return stage(self.assignment, tuple(None if lay is None else lay.format for lay in self.layouts),
                     self.out_format)

    def encode(self) -> str:
        """The text of the module docstring."""
        kind = self.written[0]
        if kind == "einsum":
            what = f"einsum {self.written[2]}: {json.dumps(self.written[1])}"
        elif kind in ("statement", "script"):
            what = f"{kind}: {json.dumps(self.written[1])}"
        else:
            what = f"assignment: {json.dumps(write_assignment(self.assignment))}"
        operands = "; ".join(_write_layout(layout) for layout in self.layouts)
        anchor = "none" if self.anchor is None else str(self.anchor)
        return "\n".join([f"{_MAGIC} {VERSION}", what, f"operands: {operands}",
                          f"out_format: {_write_request(self.out_format)}", f"anchor: {anchor}"])


def derived(assignment: Assignment | None, derive: tuple) -> tuple[Assignment | Statement | Script, tuple]:
    """What a traced call runs, named by constants, and how its text names it:

    * ``()``: ``assignment``;
    * ``("einsum", equation, num_operands)``: the parsed core equation;
    * ``("statement", text)``, ``("script", text)``: a compiled expression's statement
      or statements;
    * ``("reduced",)``, ``("epilogue",)``: the reduction or the epilogue of ``assignment``,
      run apart when training (:func:`~..plan.bias.split_epilogue`)."""
    kind = derive[0] if derive else None
    if kind == "einsum":
        return core_assignment(*derive[1:]), derive
    if kind == "statement":
        return _script(derive[1]).statements[0], derive
    if kind == "script":
        return _script(derive[1]), derive
    if kind == "reduced":
        return split_epilogue(assignment)[0], ("assignment",)
    if kind == "epilogue":
        return split_epilogue(assignment)[1], ("assignment",)
    return assignment, ("assignment",)


@functools.lru_cache(maxsize=256)
def _script(text: str) -> Script:
    """``parse_script(text)``, one object per text (the compiler's caches key on it)."""
    return parse_script(text)


@functools.lru_cache(maxsize=256)
def _assignment(text: str) -> Assignment:
    """``read_assignment(text)``, one object per text."""
    return read_assignment(text)


# Call string -> spec; a string traced in this process maps to the spec it was encoded
# from, whose assignment is the very object eager calls use (the compiler's caches then
# compare keys by identity).
_specs: LRUCache[CallSpec] = LRUCache("call strings", 1024)


def remember_spec(spec: CallSpec) -> str:
    """``spec``'s text, remembered so that :func:`decode` returns ``spec`` itself."""
    call = spec.encode()
    _specs.put(call, spec)
    return call


def decode(call: str) -> CallSpec:
    """The :class:`CallSpec` a ``sparsenn::evaluate`` call string describes."""
    spec = _specs.get(call)
    if spec is None:
        spec = read_spec(call)
        _specs.put(call, spec)
    return spec


def read_spec(call: str) -> CallSpec:
    """Parse a call string (the module docstring's text). A ValueError names what is
    wrong; a :class:`SpecVersionError` names the text's version and this one's."""
    if not isinstance(call, str) or not call.startswith(_MAGIC):
        raise ValueError(f"not a sparsenn call string: {call!r:.60}")
    lines = call.split("\n")
    header = lines[0].split(" ")
    if call.startswith(_MAGIC + ":") or len(header) != 2 or header[0] != _MAGIC or not header[1].isdigit():
        found = "0 (a pickle, before the text format)" if call.startswith(_MAGIC + ":") else repr(lines[0][:40])
        raise SpecVersionError(f"sparsenn call string of format version {found}: this sparsenn reads version "
                               f"{VERSION} only; trace or export the program again with this sparsenn")
    if int(header[1]) != VERSION:
        raise SpecVersionError(f"sparsenn call string of format version {header[1]}: this sparsenn reads version "
                               f"{VERSION} only; trace or export the program again with a sparsenn that writes it")
    if len(lines) != 5:
        raise ValueError(f"a sparsenn call string of version {VERSION} has 5 lines, got {len(lines)}")
    fields = dict(_field(line) for line in lines[2:])
    if sorted(fields) != ["anchor", "operands", "out_format"]:
        raise ValueError(f"a sparsenn call string needs the lines operands, out_format, anchor; got {sorted(fields)}")
    layouts = tuple(_read_layout(text) for text in fields["operands"].split("; ")) if fields["operands"] else ()
    kind, _, value = lines[1].partition(": ")
    if kind.startswith("einsum "):
        written: tuple = ("einsum", _string(value), int(kind.removeprefix("einsum ")))
    elif kind in ("statement", "script"):
        written = (kind, _string(value))
    elif kind == "assignment":
        written = ("assignment",)
    else:
        raise ValueError(f"a sparsenn call string's line 2 names an einsum, statement, script or assignment, "
                         f"got {lines[1]!r:.60}")
    target = _assignment(_string(value)) if kind == "assignment" else derived(None, written)[0]
    anchor = None if fields["anchor"] == "none" else int(fields["anchor"])
    return CallSpec(target, layouts, _read_request(fields["out_format"]), anchor, written)


def _field(line: str) -> tuple[str, str]:
    key, separator, value = line.partition(": ")
    if not separator:
        key, value = line.removesuffix(":"), ""
    return key, value


def _string(text: str) -> str:
    value = json.loads(text)
    if not isinstance(value, str):
        raise ValueError(f"expected a JSON string in a sparsenn call string, got {text!r:.60}")
    return value


def _write_format(fmt: Format) -> str:
    if parse_format(str(fmt), fmt.rank) != fmt:
        raise ValueError(f"format {fmt} does not read back from its name")
    return f"{fmt}/{fmt.rank}"


def _read_format(text: str) -> Format:
    name, _, rank = text.rpartition("/")
    return parse_format(name, int(rank))


def _write_layout(layout: Layout | None) -> str:
    if layout is None:
        return "dense"
    text = f"{_write_format(layout.format)} {str(layout.index_dtype).removeprefix('torch.')}"
    return text if layout.shares is None else f"{text} shares {layout.shares}"


def _read_layout(text: str) -> Layout | None:
    if text == "dense":
        return None
    parts = text.split(" ")
    if len(parts) not in (2, 4) or parts[1] not in _INDEX_DTYPES or (len(parts) == 4 and parts[2] != "shares"):
        raise ValueError(f"an operand of a sparsenn call string is 'dense' or '<format>/<rank> <int32|int64>"
                         f"[ shares <n>]', got {text!r}")
    return Layout(_read_format(parts[0]), _INDEX_DTYPES[parts[1]], None if len(parts) == 2 else int(parts[3]))


def _write_request(out_format) -> str:
    if out_format is None:
        return "none"
    if isinstance(out_format, Format):
        return f"format {_write_format(out_format)}"
    if out_format in ("dense", "auto"):
        return out_format
    if isinstance(out_format, str):
        return f"name {json.dumps(out_format)}"
    raise TypeError(f"out_format must be None, 'dense', 'auto', a format name or a Format, got "
                    f"{type(out_format).__name__}")


def _read_request(text: str):
    if text in ("none", "dense", "auto"):
        return None if text == "none" else text
    kind, _, value = text.partition(" ")
    if kind == "name":
        return _string(value)
    if kind == "format":
        return _read_format(value)
    raise ValueError(f"out_format of a sparsenn call string: none, dense, auto, name or format, got {text!r:.60}")


def anchor_of(target: Assignment | Statement | Script, layouts: Sequence[Layout | None], out_format) -> int | None:
    """The operand whose pattern the result has (None: dense). An assignment's is the
    planner's (:func:`~..plan.anchor.sampled_operand`) from the formats, the patterns
    shared and the request; a compiled statement's is its output mask's (a script's: its
    last statement's mask, or that mask's own mask when an earlier statement wrote it),
    and a statement without one must have a dense result."""
    formats = [None if lay is None else lay.format for lay in layouts]
    if isinstance(target, Assignment):
        request = out_format
        if isinstance(out_format, str) and out_format not in ("dense", "auto"):
            try:
                request = parse_format(out_format, len(target.output))
            except ValueError:
                return None  # the call itself reports the request
        return sampled_operand(target, formats, [None if lay is None else lay.shares for lay in layouts], request)
    mask = _mask_operand(target)
    if mask is not None:
        return target.operands.index(mask)
    if _result_format(stage(target, tuple(formats), out_format), formats) is not None:
        raise NotImplementedError(
            "sparsenn: a traced compiled expression must have a dense result or an output mask (P<S>[...] = ...); "
            f"{target.output}[...] would be sparse with a pattern computed from the data")
    return None


def _mask_operand(statement: Statement | Script) -> str | None:
    """The caller's operand whose pattern a masked result has, or None."""
    if isinstance(statement, Statement):
        return statement.mask
    masks = {s.output: s.mask for s in statement.statements}
    mask = masks[statement.output]
    while mask in masks and masks[mask] is not None:
        mask = masks[mask]
    return None if mask in masks else mask


def _result_format(program: Program, formats: list[Format | None]) -> Format | None:
    """The format of a program's result (None: dense), stage by stage as evaluation
    decides it: the requested ``out_format``, else inferred from the inputs' formats."""
    results: list[Format | None] = []
    for step in program.stages:
        inputs = [formats[s.n] if isinstance(s, UserOperand) else results[s.stage] for s in step.inputs]
        if step.out_format == "dense":
            results.append(None)
        elif isinstance(step.out_format, Format):
            results.append(step.out_format)
        else:
            results.append(result_format(step.assignment, inputs))
    return results[-1]
