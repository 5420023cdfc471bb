"""The notation's printable form that parses back: an :class:`~.notation.Assignment` as one
line of text, and that line read into an equal assignment.

``str(assignment)`` is for people (``explain``); this form is exact, for what must be
stored and read again (a traced call, :mod:`..runtime.callspec`)::

    assignment = "(" names ")" "[" [indices] "]" "=" reduction "{" term {";" term} "}" [epilogue]
    term       = number "{" [access {"," access}] "}" [":" value]
    epilogue   = "then" "{" [access {"," access}] "}" ":" value
    access     = name "[" [indices] "]"            (name: an operand's; "$n" when names repeat)
    value      = "#" k | "R" | number | function "(" value {"," value} ")"

``#k`` is the term's (or the epilogue's) factor ``k``, ``R`` the reduced value an
epilogue reads; numbers print as Python's ``repr`` of the float (exact); a name or an
index is any run of characters other than spaces and ``()[]{},;:=#``. For example
``Y[b,o] = relu(X[b,i] * W[o,i] + bias[o])``'s kernel assignment reads
``(X, W, bias)[b,o] = sum{1.0 {X[b,i], W[o,i]}} then {bias[o]}: relu(add(R, #0))``.
"""

from __future__ import annotations

import re

from .functions import FUNCTIONS
from .notation import REDUCTIONS, Access, Apply, Assignment, Constant, Epilogue, Factor, NotationError, Reduced, \
    Term, Value

__all__ = ["write_assignment", "read_assignment"]

_WORD = re.compile(r"[^\s()\[\]{},;:=#]+")
_TOKEN = re.compile(r"\s*(?:(?P<word>[^\s()\[\]{},;:=#]+)|(?P<sym>[()\[\]{},;:=#]))")


def write_assignment(assignment: Assignment) -> str:
    """``assignment`` in the exact form of the module docstring."""
    names = assignment.operand_names
    for word in (*names, *assignment.output, *(i for a in assignment.accesses for i in a.indices)):
        if not _WORD.fullmatch(word) or word.startswith("$"):
            raise ValueError(f"cannot write {word!r} in an assignment's text: names and indices are runs of "
                             "characters other than spaces, ()[]{},;:=# and do not start with $")
    unique = len(set(names)) == len(names)

    def access(a: Access) -> str:
        return f"{names[a.operand] if unique else f'${a.operand}'}[{','.join(a.indices)}]"

    def accesses(factors: tuple[Access, ...]) -> str:
        return "{" + ", ".join(access(a) for a in factors) + "}"

    terms = [f"{float(t.coefficient)!r} {accesses(t.factors)}" + ("" if t.value is None else f": {_value(t.value)}")
             for t in assignment.terms]
    text = f"({', '.join(names)})[{','.join(assignment.output)}] = {assignment.reduction}{{{'; '.join(terms)}}}"
    if assignment.epilogue is not None:
        text += f" then {accesses(assignment.epilogue.factors)}: {_value(assignment.epilogue.value)}"
    return text


def _value(value: Value) -> str:
    if isinstance(value, Factor):
        return f"#{value.k}"
    if isinstance(value, Reduced):
        return "R"
    if isinstance(value, Constant):
        return repr(float(value.value))
    return f"{value.function}({', '.join(_value(a) for a in value.args)})"


def read_assignment(text: str) -> Assignment:
    """The assignment ``write_assignment`` wrote as ``text``; a :class:`NotationError`
    naming the place when ``text`` is not of that form."""
    if not isinstance(text, str):
        raise TypeError(f"an assignment's text must be a str, got {type(text).__name__}")
    return _Reader(text).assignment()


class _Reader:
    """Recursive descent over the grammar of the module docstring."""

    def __init__(self, text: str):
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, column)
        pos, stripped = 0, text.rstrip()
        while pos < len(stripped):
            match = _TOKEN.match(stripped, pos)
            if match is None:
                raise self.error("unexpected character", pos)
            kind = match.lastgroup
            self.tokens.append((match.group(kind) if kind == "sym" else "word", match.group(kind), match.start(kind)))
            pos = match.end()
        self.tokens.append(("end", "", len(stripped)))
        self.at = 0
        self.names: tuple[str, ...] = ()

    def error(self, problem: str, column: int) -> NotationError:
        return NotationError(f"{problem} at column {column} of the assignment text:\n    {self.text}\n"
                             f"    {' ' * column}^")

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.at]

    def take(self, kind: str) -> str:
        found, text, column = self.tokens[self.at]
        if found != kind:
            raise self.error(f"expected {'a name or number' if kind == 'word' else repr(kind)}, found {text!r}",
                             column)
        self.at += 1
        return text

    def words(self, closer: str) -> tuple[str, ...]:
        found: list[str] = []
        if self.peek()[0] != closer:
            found.append(self.take("word"))
            while self.peek()[0] == ",":
                self.take(",")
                found.append(self.take("word"))
        self.take(closer)
        return tuple(found)

    def number(self) -> float:
        column = self.peek()[2]
        word = self.take("word")
        try:
            return float(word)
        except ValueError:
            raise self.error(f"{word!r} is not a number", column) from None

    def assignment(self) -> Assignment:
        self.take("(")
        self.names = self.words(")")
        self.take("[")
        output = self.words("]")
        self.take("=")
        column = self.peek()[2]
        reduction = self.take("word")
        if reduction not in REDUCTIONS:
            raise self.error(f"unknown reduction {reduction!r} (known: {', '.join(REDUCTIONS)})", column)
        self.take("{")
        terms = [self.term()]
        while self.peek()[0] == ";":
            self.take(";")
            terms.append(self.term())
        self.take("}")
        epilogue = None
        if self.peek()[0] == "word" and self.peek()[1] == "then":
            self.take("word")
            factors = self.accesses()
            self.take(":")
            epilogue = Epilogue(factors, self.value())
        end = self.peek()
        if end[0] != "end":
            raise self.error(f"unexpected {end[1]!r} after the assignment", end[2])
        try:
            return Assignment(output, tuple(terms), self.names, reduction, epilogue)
        except ValueError as error:
            raise self.error(str(error), column) from None

    def term(self) -> Term:
        coefficient = self.number()
        factors = self.accesses()
        value = None
        if self.peek()[0] == ":":
            self.take(":")
            value = self.value()
        return Term(coefficient, factors, value)

    def accesses(self) -> tuple[Access, ...]:
        self.take("{")
        found: list[Access] = []
        while self.peek()[0] != "}":
            if found:
                self.take(",")
            found.append(self.access())
        self.take("}")
        return tuple(found)

    def access(self) -> Access:
        column = self.peek()[2]
        name = self.take("word")
        if name.startswith("$") and name[1:].isdigit() and int(name[1:]) < len(self.names):
            operand = int(name[1:])
        elif name in self.names and self.names.count(name) == 1:
            operand = self.names.index(name)
        else:
            raise self.error(f"{name!r} names no operand of ({', '.join(self.names)})", column)
        self.take("[")
        return Access(operand, self.words("]"))

    def value(self) -> Value:
        kind, word, column = self.peek()
        if kind == "#":
            self.take("#")
            index = self.take("word")
            if not index.isdigit():
                raise self.error(f"#{index} is not a factor number", column)
            return Factor(int(index))
        if kind == "word" and word == "R":
            self.take("word")
            return Reduced()
        if kind == "word" and self.tokens[self.at + 1][0] == "(":
            if word not in FUNCTIONS:
                raise self.error(f"unknown function {word!r}", column)
            self.take("word")
            self.take("(")
            args = [self.value()]
            while self.peek()[0] == ",":
                self.take(",")
                args.append(self.value())
            self.take(")")
            if len(args) != FUNCTIONS[word].arity:
                raise self.error(f"{word} takes {FUNCTIONS[word].arity} argument(s), got {len(args)}", column)
            return Apply(word, tuple(args))
        return Constant(self.number())
