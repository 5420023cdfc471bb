"""The text of :func:`sparsenn.compile`: index notation with functions, explicit
reductions and an output mask, parsed into an expression tree.

The grammar (EBNF) is in :func:`~..api.compile_expression`'s docstring, the
users' reference; the parser below has one method per rule.

``function`` is one of :data:`~.functions.PUBLIC_FUNCTIONS`; those names and the
reductions' cannot name tensors. Products are distributed over sums, so a parsed
right-hand side is a :class:`Sum` of :class:`Product` s whose factors are tensors,
calls and reductions; ``a / b`` is the call ``div(a, b)`` unless ``b`` is a number.

The tree keeps the text's names; :mod:`.staging` turns it into kernel assignments.
Every error is a :class:`~.notation.NotationError` quoting the text with a caret under
the offending character (columns count from 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .functions import FUNCTIONS, PUBLIC_FUNCTIONS
from .notation import REDUCTIONS, Access, Assignment, NotationError, Term

__all__ = ["Tensor", "Call", "Reduction", "Product", "Sum", "Statement", "Script", "parse_statement",
           "parse_script", "parse_expression", "plain_assignment", "mentioned", "product_indices", "tensors_in"]


@dataclass(frozen=True)
class Tensor:
    """``name[indices]``; ``column`` (where it is written) only locates errors."""

    name: str
    indices: tuple[str, ...]
    column: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Call:
    """``function(args)``: a function of the table (``div`` for ``/``) over sums."""

    function: str
    args: tuple[Sum, ...]


@dataclass(frozen=True)
class Reduction:
    """``op[indices](body)``: ``body`` combined by ``op`` over ``indices``."""

    op: str
    indices: tuple[str, ...]
    body: Sum


Part = Tensor | Call | Reduction


@dataclass(frozen=True)
class Product:
    """``coefficient * prod(factors)``; no factors: the constant ``coefficient``."""

    coefficient: float
    factors: tuple[Part, ...]


@dataclass(frozen=True)
class Sum:
    products: tuple[Product, ...]


@dataclass(frozen=True)
class Statement:
    """``output<mask>[indices] = body``; ``operands`` are the input names in order of
    first appearance in the text (the mask's included)."""

    output: str
    indices: tuple[str, ...]
    mask: str | None
    body: Sum
    operands: tuple[str, ...]

    def __hash__(self) -> int:
        """Computed once: statements key the program cache on every call."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.output, self.indices, self.mask, self.body, self.operands))
            object.__setattr__(self, "_hash", value)
            return value


@dataclass(frozen=True)
class Script:
    """Statements run in order, a later one reading an earlier one's result by its name
    (``M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i])``); the last one's result
    is the script's. ``operands`` are the names read before any statement writes them,
    in order of first appearance (the caller's operands)."""

    statements: tuple[Statement, ...]
    operands: tuple[str, ...]

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.statements, self.operands))
            object.__setattr__(self, "_hash", value)
            return value

    @property
    def output(self) -> str:
        return self.statements[-1].output

    @property
    def indices(self) -> tuple[str, ...]:
        return self.statements[-1].indices

    def __str__(self) -> str:
        return "; ".join(f"{s.output}{'' if s.mask is None else f'<{s.mask}>'}[{','.join(s.indices)}] = ..."
                         for s in self.statements)


def mentioned(node: Part | Product | Sum) -> frozenset[str]:
    """Indices written in ``node`` and not bound by a reduction inside it."""
    if isinstance(node, Tensor):
        return frozenset(node.indices)
    if isinstance(node, Reduction):
        return mentioned(node.body) - set(node.indices)
    children = node.args if isinstance(node, Call) else node.factors if isinstance(node, Product) else node.products
    return frozenset().union(*(mentioned(c) for c in children))


def tensors_in(node: Part | Product | Sum) -> list[Tensor]:
    """Every tensor read in ``node``."""
    if isinstance(node, Tensor):
        return [node]
    if isinstance(node, Reduction):
        return tensors_in(node.body)
    children = node.args if isinstance(node, Call) else node.factors if isinstance(node, Product) else node.products
    return [t for child in children for t in tensors_in(child)]


def context_of(product: Product, n: int, context: frozenset[str]) -> frozenset[str]:
    """The indices in scope for factor ``n`` of ``product``: the enclosing ``context``
    and every index the other factors write (those the product sums itself)."""
    return context.union(*(mentioned(f) for m, f in enumerate(product.factors) if m != n))


def product_indices(product: Product, context: frozenset[str]) -> frozenset[str]:
    """The indices of ``product`` as a term in ``context``: a tensor's, and those of
    a call or reduction that are in its scope (others are summed inside it)."""
    seen: set[str] = set()
    for n, factor in enumerate(product.factors):
        inner = mentioned(factor)
        seen |= inner if isinstance(factor, Tensor) else inner & context_of(product, n, context)
    return frozenset(seen)


@dataclass(frozen=True)
class _Token:
    kind: str  # "name", "number", a symbol, or "end"
    text: str
    column: int


_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
                    r"|(?P<sym>[\[\],=+\-*/()<>;]))")


class _Parser:
    """Recursive descent over the grammar of the module docstring."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = self._tokenize()
        self.pos = 0
        self.ranks: dict[str, tuple[int, int]] = {}  # name -> (rank, column of first use)
        self.output: list[str] = []  # the output's indices
        self.bound: list[str] = []  # indices of the enclosing reductions

    def error(self, problem: str, column: int) -> NotationError:
        start = self.text.rfind("\n", 0, column) + 1
        end = self.text.find("\n", column)
        line = self.text[start:] if end < 0 else self.text[start:end]
        line_number = self.text.count("\n", 0, column) + 1
        where = f"column {column}" if start == 0 else f"column {column - start} of line {line_number}"
        return NotationError(f"{problem} at {where}:\n    {line}\n    {' ' * (column - start)}^")

    def _tokenize(self) -> list[_Token]:
        """The tokens; a newline outside brackets separates statements as ``;`` does."""
        tokens, pos, text, depth = [], 0, self.text.rstrip(), 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                column = len(text) - len(text[pos:].lstrip())
                raise self.error(f"unexpected character {text[column]!r}", column)
            kind = match.lastgroup
            if depth == 0 and "\n" in text[pos:match.start(kind)]:
                tokens.append(_Token(";", "\n", text.index("\n", pos)))
            token = _Token(match.group(kind) if kind == "sym" else kind, match.group(kind), match.start(kind))
            depth += 1 if token.kind in ("(", "[") else -1 if token.kind in (")", "]") else 0
            tokens.append(token)
            pos = match.end()
        tokens.append(_Token("end", "", len(text)))
        return tokens

    def peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.pos + ahead, len(self.tokens) - 1)]

    def take(self, kind: str | None = None, what: str | None = None) -> _Token:
        token = self.peek()
        if token.kind == "end" and kind != "end":
            raise self.error("unexpected end of expression", token.column)
        if kind is not None and token.kind != kind:
            raise self.error(f"expected {what or repr(kind)} but found {token.text!r}", token.column)
        self.pos += 1
        return token

    def closing(self, opening: _Token, kind: str) -> None:
        """The ``kind`` bracket closing ``opening``."""
        token = self.peek()
        if token.kind == "end":
            raise self.error(f"{opening.text!r} is never closed", opening.column)
        self.take(kind)

    def indices(self, closer: str) -> list[_Token]:
        names: list[_Token] = []
        if self.peek().kind != closer:
            names.append(self.take("name", "an index name"))
            while self.peek().kind == ",":
                self.take(",")
                names.append(self.take("name", "an index name"))
        return names

    def tensor_name(self) -> _Token:
        token = self.take("name", "a tensor name")
        if token.text in PUBLIC_FUNCTIONS or token.text in REDUCTIONS:
            raise self.error(f"{token.text!r} names a function or reduction, not a tensor", token.column)
        return token

    def access(self, name: _Token) -> Tensor:
        opening = self.take("[")
        tokens = self.indices("]")
        self.closing(opening, "]")
        indices = tuple(t.text for t in tokens)
        for n, token in enumerate(tokens):
            if token.text in indices[:n]:
                raise self.error(f"index '{token.text}' appears twice in {name.text}[{','.join(indices)}]; repeated "
                                 "indices within one operand (diagonals) are not supported — take the diagonal first",
                                 token.column)
        rank, first = self.ranks.setdefault(name.text, (len(indices), name.column))
        if rank != len(indices):
            raise self.error(f"tensor {name.text!r} is used with {rank} and {len(indices)} indices "
                             f"(first at column {first})", name.column)
        return Tensor(name.text, indices, name.column)

    def sum(self) -> Sum:
        products = list(self.product().products)
        while self.peek().kind in ("+", "-"):
            sign = -1.0 if self.take().kind == "-" else 1.0
            products += [Product(sign * p.coefficient, p.factors) for p in self.product().products]
        return Sum(tuple(products))

    def product(self) -> Sum:
        left = self.unary()
        while self.peek().kind in ("*", "/"):
            operator = self.take()
            right = self.unary()
            if operator.kind == "*":
                left = Sum(tuple(Product(a.coefficient * b.coefficient, a.factors + b.factors)
                                 for a in left.products for b in right.products))
            elif _constant(right) == 0.0:
                raise self.error("division by zero", operator.column)
            elif _constant(right) is not None:
                left = Sum(tuple(Product(p.coefficient / _constant(right), p.factors) for p in left.products))
            else:
                left = Sum((Product(1.0, (Call("div", (left, right)),)),))
        return left

    def unary(self) -> Sum:
        if self.peek().kind in ("-", "+"):
            sign = -1.0 if self.take().kind == "-" else 1.0
            return Sum(tuple(Product(sign * p.coefficient, p.factors) for p in self.unary().products))
        return self.atom()

    def atom(self) -> Sum:
        token = self.peek()
        if token.kind == "number":
            self.take()
            return Sum((Product(float(token.text), ()),))
        if token.kind == "(":
            self.take()
            inner = self.sum()
            self.closing(token, ")")
            return inner
        if token.kind == "end":
            raise self.error("unexpected end of expression", token.column)
        if token.kind != "name":
            raise self.error(f"expected a tensor, number, function call or '(' but found {token.text!r}",
                             token.column)
        following = self.peek(1).kind
        if token.text in REDUCTIONS and following == "[":
            part: Part = self.reduction()
        elif following == "(":
            part = self.call()
        else:
            part = self.access(self.tensor_name())
        return Sum((Product(1.0, (part,)),))

    def call(self) -> Call:
        name = self.take()
        if name.text not in PUBLIC_FUNCTIONS:
            raise self.error(f"unknown function {name.text!r} (known: {', '.join(PUBLIC_FUNCTIONS)})", name.column)
        opening = self.take("(")
        args = [self.sum()]
        while self.peek().kind == ",":
            self.take(",")
            args.append(self.sum())
        self.closing(opening, ")")
        arity = FUNCTIONS[name.text].arity
        if len(args) != arity:
            raise self.error(f"{name.text} takes {arity} argument(s), got {len(args)}", name.column)
        return Call(name.text, tuple(args))

    def reduction(self) -> Reduction:
        op = self.take()
        opening = self.take("[")
        tokens = self.indices("]")
        if not tokens:
            raise self.error(f"{op.text}[] reduces over no index; name at least one", self.peek().column)
        self.closing(opening, "]")
        for n, token in enumerate(tokens):
            if token.text in self.output:
                raise self.error(f"index '{token.text}' is an output index and cannot be reduced", token.column)
            if token.text in self.bound or token.text in [t.text for t in tokens[:n]]:
                raise self.error(f"index '{token.text}' is already reduced here", token.column)
        indices = tuple(t.text for t in tokens)
        self.bound += indices
        body_start = self.take("(", "'(' and the reduction's body")
        body = self.sum()
        self.closing(body_start, ")")
        del self.bound[-len(indices):]
        present = _all_indices(body)
        for token in tokens:
            if token.text not in present:
                raise self.error(f"reduction index '{token.text}' does not appear in the reduction's body",
                                 token.column)
        return Reduction(op.text, indices, body)

    def statement(self) -> Statement:
        out = self.tensor_name()
        mask = None
        if self.peek().kind == "<":
            self.take("<")
            mask = self.tensor_name()
            if mask.text == out.text:
                raise self.error(f"output tensor {out.text!r} cannot mask itself", mask.column)
            self.take(">")
        opening = self.take("[")
        out_indices = self.indices("]")
        self.closing(opening, "]")
        self.output = [t.text for t in out_indices]
        for n, token in enumerate(out_indices):
            if token.text in self.output[:n]:
                raise self.error(f"index '{token.text}' appears twice in the output", token.column)
        if mask is not None:
            self.ranks[mask.text] = (len(out_indices), mask.column)
        self.take("=", "'='")
        start = self.peek().column
        body = self.sum()
        end = self.peek()
        if end.kind not in ("end", ";"):
            raise self.error(f"unexpected {end.text!r} after the expression", end.column)
        if out.text in self.ranks:
            raise self.error(f"output tensor {out.text!r} also appears on the right-hand side",
                             self.ranks[out.text][1])
        if mask is None:  # a mask gives the output's indices their range
            if not self.ranks:
                raise self.error("the right-hand side reads no tensor", start)
            written = _all_indices(body)
            for token in out_indices:
                if token.text not in written:
                    raise self.error(f"output index '{token.text}' does not appear on the right-hand side",
                                     token.column)
        return Statement(out.text, tuple(self.output), None if mask is None else mask.text, body,
                         tuple(self.ranks))


    def script(self) -> Script:
        """Statements separated by ``;`` or newlines; each reads the caller's operands and
        the results of the statements before it."""
        statements: list[Statement] = []
        written: dict[str, int] = {}  # result name -> its rank
        read: dict[str, tuple[int, int]] = {}  # caller's operand -> (rank, column of first use)
        while True:
            while self.peek().kind == ";":
                self.take()
            if self.peek().kind == "end":
                break
            self.ranks, self.output, self.bound = {}, [], []
            out = self.peek()
            statement = self.statement()
            if statement.output in written or statement.output in read:
                raise self.error(f"{statement.output!r} is already "
                                 f"{'written' if statement.output in written else 'read'} by an earlier statement; "
                                 "name each result once", out.column)
            for name, (rank, column) in self.ranks.items():
                known = written[name] if name in written else read[name][0] if name in read else None
                if known is not None and known != rank:
                    raise self.error(f"tensor {name!r} has {known} indices earlier but {rank} here", column)
                if name not in written:
                    read.setdefault(name, (rank, column))
            written[statement.output] = len(statement.indices)
            statements.append(statement)
        if not statements:
            raise self.error("no statement", 0)
        return Script(tuple(statements), tuple(read))


def _constant(node: Sum) -> float | None:
    """The value of a sum of one product without factors (a number), else None."""
    if len(node.products) == 1 and not node.products[0].factors:
        return node.products[0].coefficient
    return None


def _all_indices(node: Part | Product | Sum) -> set[str]:
    """Every index written in ``node``, bound or not."""
    if isinstance(node, Tensor):
        return set(node.indices)
    if isinstance(node, Reduction):
        return _all_indices(node.body) | set(node.indices)
    children = node.args if isinstance(node, Call) else node.factors if isinstance(node, Product) else node.products
    return set().union(*(_all_indices(c) for c in children))


def parse_statement(text: str) -> Statement:
    """Parse ``"Y[i,k] = relu(A[i,j] * X[j,k] + b[k])"`` (grammar: module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"expression must be a str, got {type(text).__name__}")
    parser = _Parser(text)
    statement = parser.statement()
    if parser.peek().kind != "end":
        raise parser.error("several statements: compile them with sparsenn.compile", parser.peek().column)
    return statement


def parse_script(text: str) -> Script:
    """Parse statements separated by ``;`` or newlines (one statement: a script of one)."""
    if not isinstance(text, str):
        raise TypeError(f"expression must be a str, got {type(text).__name__}")
    return _Parser(text).script()


def plain_assignment(statement: Statement) -> Assignment | None:
    """The statement as one :class:`Assignment` if it is a sum of products of tensors
    (no function, explicit reduction or mask), else None. Operands are numbered by
    first appearance."""
    products = statement.body.products
    if statement.mask is not None or any(
        not p.factors or not all(isinstance(f, Tensor) for f in p.factors) for p in products
    ):
        return None
    number = {name: n for n, name in enumerate(statement.operands)}
    terms = tuple(Term(p.coefficient, tuple(Access(number[f.name], f.indices) for f in p.factors))
                  for p in products)
    return Assignment(statement.indices, terms, statement.operands)


def parse_expression(text: str) -> Assignment:
    """Parse a sum of products, ``"Out[i,j] = A[i,k] * B[k,j] + 0.5 * C[i,j]"``, into
    one :class:`Assignment` (grammar: :mod:`.expression`).

    Operands are numbered by first appearance on the right-hand side; a name used twice
    refers to the same operand. Functions, explicit reductions and masks may need
    several kernels: :func:`sparsenn.compile` stages those.
    """
    assignment = plain_assignment(parse_statement(text))
    if assignment is None:
        raise NotationError(f"{text!r} is not a sum of products of tensors (it has a function, an explicit "
                            "reduction, a division or a mask): compile it with sparsenn.compile, which stages it")
    return assignment
