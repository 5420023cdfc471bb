"""Simplification of loop IR: constant folding, hoisting of loop invariants and
removal of unused declarations.

* **Folding** (integers only; floating-point expressions keep their operations, so the
  kernels round as written): ``a op b`` of two constants, ``x + 0``, ``0 + x``,
  ``x - 0``, ``x * 1``, ``1 * x``, ``x * 0``, ``0 * x`` (``x`` not calling the runtime),
  so that locating a dense level under the root, ``0 * N + i``, is ``i``.
* **Hoisting**: a constant declaration in a loop's body whose initialiser is integer
  arithmetic (``+ - *``, comparisons, ``min``/``max``, casts, selections; no load, no
  division, so it cannot fault even where the loop runs no iteration) of variables the
  loop neither declares nor changes moves before the loop, and on out of enclosing
  loops while it stays invariant; not where the enclosing block mentions its name
  elsewhere (index variables are declared again in sibling scopes).
* **Unused declarations**: a declaration whose variable no other node mentions is
  dropped, unless its initialiser calls the assembly runtime (every other expression
  is pure), repeatedly, since dropping one can leave another unused. Names are unique
  within a kernel, so one count over the kernel suffices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

from . import ir

__all__ = ["simplify", "fold", "hoist"]


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    """The field names of an IR node class (none for anything else)."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()


def _children(node) -> tuple:
    return tuple(getattr(node, name) for name in _fields(type(node)))


def _map_blocks(node, transform):
    """``node`` with ``transform`` applied to each block it holds (loop bodies, branches,
    parallel regions); other nodes unchanged."""
    if not isinstance(node, (ir.If, ir.For, ir.While, ir.Parallel, ir.Team, ir.Guarded)):
        return node
    changes = {name: transform(getattr(node, name))
               for name in _fields(type(node)) if isinstance(getattr(node, name), ir.Block)}
    return dataclasses.replace(node, **changes)

_INT_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def _int(e) -> int | None:
    return e.value if isinstance(e, ir.Const) and isinstance(e.value, int) and not isinstance(e.value, bool) else None


def _fold_bin(e: ir.Bin) -> ir.Expr:
    a, b = _int(e.left), _int(e.right)
    if a is not None and b is not None and e.op in _INT_OPS:
        return ir.Const(_INT_OPS[e.op](a, b))
    if e.op == "+":
        if a == 0:
            return e.right
        if b == 0:
            return e.left
    elif e.op == "-" and b == 0:
        return e.left
    elif e.op == "*":
        if a == 1:
            return e.right
        if b == 1:
            return e.left
        if (a == 0 or b == 0) and not _calls_runtime(e):
            return ir.Const(0)
    return e


def fold(node):
    """``node`` with every integer constant sub-expression folded (see module doc)."""
    if isinstance(node, tuple):
        return tuple(fold(x) for x in node)
    if not _fields(type(node)) or isinstance(node, ir.Array):
        return node
    changes = {}
    for name in _fields(type(node)):
        value = getattr(node, name)
        new = fold(value)
        if new is not value:
            changes[name] = new
    if changes:
        node = dataclasses.replace(node, **changes)
    if isinstance(node, ir.Bin):
        return _fold_bin(node)
    if isinstance(node, ir.Cast) and isinstance(node.operand, ir.Const) and node.type in ("index", "I", "int"):
        return node.operand
    return node


def _count_uses(node, counts: Counter) -> None:
    if isinstance(node, tuple):
        for x in node:
            _count_uses(x, counts)
        return
    if isinstance(node, ir.Var):
        counts[node.name] += 1
        return
    if not _fields(type(node)) or isinstance(node, ir.Array):
        return
    for name in _fields(type(node)):
        if isinstance(node, ir.Decl) and name == "var":
            continue
        _count_uses(getattr(node, name), counts)


def _calls_runtime(node) -> bool:
    if isinstance(node, ir.RuntimeCall):
        return True
    if isinstance(node, tuple):
        return any(_calls_runtime(x) for x in node)
    if not _fields(type(node)) or isinstance(node, ir.Array):
        return False
    return any(_calls_runtime(child) for child in _children(node))


def _unused(s: ir.Stmt, used: Counter) -> bool:
    return isinstance(s, ir.Decl) and not used[s.var.name] and not _calls_runtime(s.init)


def _drop_unused(node, used: Counter):
    if isinstance(node, ir.Block):
        kept = tuple(_drop_unused(s, used) for s in node.stmts if not _unused(s, used))
        return dataclasses.replace(node, stmts=kept)
    return _map_blocks(node, lambda block: _drop_unused(block, used))


_ARITHMETIC = {"+", "-", "*", "<", "<=", ">", ">=", "==", "!=", "&&", "||"}


def _arithmetic(e) -> bool:
    """Whether ``e`` is integer arithmetic that cannot fault (see the module doc)."""
    if isinstance(e, (ir.Var, ir.Const)):
        return not isinstance(e, ir.Const) or isinstance(e.value, int)
    if isinstance(e, ir.Bin):
        return e.op in _ARITHMETIC and _arithmetic(e.left) and _arithmetic(e.right)
    if isinstance(e, ir.Cast):
        return e.type in ("index", "int", "I") and _arithmetic(e.operand)
    if isinstance(e, ir.Select):
        return all(_arithmetic(x) for x in (e.cond, e.then, e.other))
    if isinstance(e, ir.Call):
        return e.name in ("min", "max") and all(_arithmetic(x) for x in e.args)
    return False


class _Names:
    """The variables each node mentions and those it declares or changes, computed once
    per node: nodes are keyed by identity (and kept alive) for one hoisting pass."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[object, frozenset[str], frozenset[str]]] = {}

    def of(self, node) -> tuple[frozenset[str], frozenset[str]]:
        """(every variable ``node`` mentions, those it declares or changes)."""
        hit = self._memo.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1], hit[2]
        mentioned: set[str] = set()
        changed: set[str] = set()
        if isinstance(node, ir.Var):
            mentioned.add(node.name)
        elif isinstance(node, ir.Decl):
            changed.add(node.var.name)
        elif isinstance(node, ir.Incr):
            changed.add(node.var.name)
        elif isinstance(node, ir.Assign) and isinstance(node.target, (ir.Var, ir.Elem)):
            target = node.target
            changed.add(target.name if isinstance(target, ir.Var) else target.base.name)
        children = node if isinstance(node, tuple) else () if isinstance(node, ir.Array) else _children(node)
        for child in children:
            child_mentioned, child_changed = self.of(child)
            mentioned |= child_mentioned
            changed |= child_changed
        result = frozenset(mentioned | changed), frozenset(changed)
        self._memo[id(node)] = (node, *result)
        return result

    def all(self, node) -> frozenset[str]:
        return self.of(node)[0]

    def changed(self, node) -> frozenset[str]:
        return self.of(node)[1]


def _hoist_loop(loop, taken: set[str], names: _Names) -> tuple[list[ir.Stmt], ir.Stmt]:
    """The invariant declarations of ``loop``'s body whose names ``taken`` (the rest of
    the enclosing block) does not hold, and the loop without them."""
    changed = names.changed(loop)
    moved, kept = [], []
    for s in loop.body.stmts:
        if (isinstance(s, ir.Decl) and s.const and not s.shape and s.var.name not in taken
                and _arithmetic(s.init) and not names.all(s.init) & changed):
            moved.append(s)
            taken.add(s.var.name)
        else:
            kept.append(s)
    return moved, dataclasses.replace(loop, body=dataclasses.replace(loop.body, stmts=tuple(kept)))


def hoist(node, names: _Names | None = None):
    """``node`` with loop invariants moved out of their loops (see the module doc)."""
    names = _Names() if names is None else names
    if isinstance(node, ir.Block):
        stmts = [hoist(s, names) for s in node.stmts]
        held = [names.all(s) for s in stmts]  # hoisting moves declarations, never renames
        out = []
        for n, s in enumerate(stmts):
            if isinstance(s, (ir.For, ir.While)):
                moved, s = _hoist_loop(s, set().union(*held[:n], *held[n + 1:]), names)
                out += moved
            out.append(s)
        return dataclasses.replace(node, stmts=tuple(out))
    return _map_blocks(node, lambda block: hoist(block, names))


def simplify(block: ir.Block) -> ir.Block:
    """Fold constants and hoist invariants, then drop unused declarations until none is
    left."""
    block = hoist(fold(block))
    while True:
        used: Counter = Counter()
        _count_uses(block, used)
        pruned = _drop_unused(block, used)
        if pruned == block:
            return block
        block = pruned
