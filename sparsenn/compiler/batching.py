"""``torch.func.vmap`` over one assignment: the vmapped dimension becomes an index.

For ``Out[o] = sum_t c_t prod_f T_f[x_f]`` with some operands batched along ``b``,
the batched call is the single assignment ``Out[b,o] = sum_t c_t prod_f T_f[b?,x_f]``,
in which the access of every batched operand gains ``b``: one compiled kernel for the
whole batch, not a loop. ``"ij,j->i"`` with ``x`` batched is ``"ij,bj->bi"``.

* A dense operand batched at ``d`` is read with ``b`` first (``movedim(d, 0)``, a view).
* A :class:`SparseTensor` whose values are batched (``(B, nnz)``: patterns are never
  batched, only values) becomes the rank ``r + 1`` tensor ``[b, x]`` whose format stores
  the original levels, then ``b`` in one more dense level below them
  (:func:`batched_format`): it shares the index arrays and its values are ``(nnz, B)``
  row-major, each stored entry's ``B`` values side by side.
* A dense result is ``Out[b, o]`` (batched at 0). A sparse result has the unbatched
  pattern for every ``b`` (a result's pattern depends on its operands' patterns only):
  when an operand of the result's format is read at the output's indices (a sampled
  product, such as a sparse weight's gradient), that operand is batched too and the
  result asked for in its batched format, so the kernel writes the values at its
  positions as it does unbatched; they come back as ``(nnz, B)``, batched at 1. An
  unbatched operand batched so is expanded, its values copied ``B`` times, unless the
  assignment reads it for its stored positions only (a sampled gradient's mask): then
  its batched values are never read and are left uninitialised (pooled memory).
  Otherwise the result is asked for with ``b`` in a dense level above its format's
  levels (:func:`stacked_format`, a layout kernels assemble: ``csr`` becomes ``ddc``),
  its values ``(B, nnz)``, batched at 0, and the pattern returned is the first element's.
* A reduction index of extent 1 read by dense operands only (a per-sample call's batch
  of one, ``x.unsqueeze(0)``) is dropped and those operands read at its element 0:
  ``sum_{c} f(c)`` over ``c = 0`` alone is ``f(0)``, and the kernel need not accumulate.

Blocked and ``nm(n,m)`` formats cannot take a dense level below their in-block levels,
``out_format="auto"`` decides the result's type by its estimated fill, and a sparse
result over batched operands with repeated coordinates in a level (COO) is assembled
with duplicates: those calls run once per batch element (:func:`looped_call`) and their
results are stacked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor, parse_format
from sparsenn.formats.level import Dense

from .frontend.functions import factors_of
from .frontend.notation import Access, Assignment, Epilogue, Term
from .plan.infer import result_format
from .runtime import memory
from .runtime.tracing import transforming

__all__ = ["BatchedResult", "batched_call", "batched_format", "looped_call", "stacked_format"]

Run = Callable[[Assignment, list, object], object]  # evaluate(assignment, operands, out_format)


@dataclass(frozen=True)
class BatchedResult:
    """A vmapped call's physical result: ``tensor`` batched at ``out_dim`` (a dense result,
    or a sparse result's values), and for a sparse result its unbatched ``pattern``."""

    tensor: torch.Tensor
    out_dim: int | None  # None: the same for every element (no operand read is batched)
    pattern: SparseTensor | None


@functools.lru_cache(maxsize=256)
def batched_format(fmt: Format) -> Format | None:
    """``fmt`` of a tensor ``[b, x]``: ``x``'s levels, then ``b`` in a dense level below them
    (``csr`` becomes ``dcd[1,2,0]``); None for a blocked or ``nm(n,m)`` format."""
    if fmt.block is not None:
        return None
    return Format(fmt.levels + (Dense(),), tuple(m + 1 for m in fmt.mode_order) + (0,))


@functools.lru_cache(maxsize=256)
def stacked_format(fmt: Format) -> Format | None:
    """``fmt`` of a tensor ``[b, x]`` stored as ``B`` copies of ``x``: ``b`` in a dense
    level above ``x``'s levels (``csr`` becomes ``ddc``); None for a blocked or
    ``nm(n,m)`` format."""
    if fmt.block is not None:
        return None
    return Format((Dense(),) + fmt.levels, (0,) + tuple(m + 1 for m in fmt.mode_order))


def _first_element(stacked: SparseTensor, fmt: Format) -> SparseTensor:
    """Element 0 of a tensor of :func:`stacked_format` as a tensor of ``fmt``, sharing the
    first segment of each array."""
    parent = 1
    pos, crd = [], []
    for level, size, p, c in zip(fmt.levels, stacked.level_sizes[1:], stacked.pos[1:], stacked.crd[1:]):
        p = None if p is None else p[:parent + 1]
        parent = level.num_positions(parent, size, p)
        pos.append(p)
        crd.append(None if c is None else c[:parent])
    return SparseTensor(stacked.shape[1:], fmt, pos, crd, stacked.values[:parent], check=False,
                        index_dtype=stacked.index_dtype)


def _batch_index(assignment: Assignment) -> str:
    """An index name the assignment does not use (``@`` cannot start a user's index)."""
    used = set(assignment.output).union(*(a.indices for a in assignment.accesses))
    n = 0
    while f"@v{n}" in used:
        n += 1
    return f"@v{n}"


@functools.lru_cache(maxsize=1024)
def batched_assignment(assignment: Assignment, batched: tuple[bool, ...]) -> Assignment:
    """``assignment`` with a new first output index read by every operand in ``batched``
    (as its first index). Cached: a vmapped call site builds the same object each call."""
    b = _batch_index(assignment)

    def access(a: Access) -> Access:
        return Access(a.operand, (b, *a.indices)) if batched[a.operand] else a

    terms = tuple(Term(t.coefficient, tuple(map(access, t.factors)), t.value) for t in assignment.terms)
    epilogue = assignment.epilogue
    if epilogue is not None:
        epilogue = Epilogue(tuple(map(access, epilogue.factors)), epilogue.value)
    return Assignment((b, *assignment.output), terms, assignment.operand_names, assignment.reduction, epilogue)


def _batched_operand(template: SparseTensor | None, tensor: torch.Tensor, dim: int | None):
    """One operand of the batched call: ``tensor`` (a dense operand, or the values on
    ``template``'s pattern) with its batch dimension ``dim`` first, or as it is if None."""
    if dim is None:
        if template is None:
            return tensor
        return template._share(template.shape, template.format, tensor if transforming() else tensor.contiguous())
    if template is None:
        return tensor.movedim(dim, 0)
    template.check_unmodified()  # the batched view takes the arrays' versions as they are now
    values = _interleaved(tensor.movedim(dim, -1))
    return SparseTensor((values.shape[-1], *template.shape), batched_format(template.format),
                        template.pos + (None,), template.crd + (None,), values.reshape(-1), check=False,
                        index_dtype=template.index_dtype)


def _interleaved(values: torch.Tensor) -> torch.Tensor:
    """``values`` (``(nnz, B)``) contiguous. A copy of plain tensors goes to memory reused
    from call to call (:mod:`.runtime.memory`): the batch's values of a large pattern
    (an expanded mask: ``B · nnz`` repeated ones) are megabytes, each fresh page a fault."""
    if values.is_contiguous():
        return values
    if values.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(values):
        return values.contiguous()  # recorded by autograd or an outer transform
    return memory.empty(tuple(values.shape), values.dtype).copy_(values)


@functools.lru_cache(maxsize=1024)
def _unbatched_result_format(assignment: Assignment, formats: tuple[Format | None, ...], out_format):
    """The format the unbatched call's result takes (None: dense), or ``"loop"`` when the
    batched call cannot ask for it (``"auto"``, a blocked result)."""
    if isinstance(out_format, str):
        name = out_format.strip().lower()
        if name == "dense":
            return None
        try:
            out_format = parse_format(name, len(assignment.output)) if name != "auto" else name
        except ValueError:
            return "loop"  # each element's call reports what is wrong
    if out_format is None:
        out_format = result_format(assignment, formats)
        if out_format is None:
            return None
    if isinstance(out_format, Format) and stacked_format(out_format) is not None:
        return out_format
    return "loop"


def batched_call(run: Run, assignment: Assignment, templates: Sequence[SparseTensor | None],
                 tensors: Sequence[torch.Tensor], in_dims: Sequence[int | None], batch_size: int,
                 out_format) -> BatchedResult:
    """``run(assignment, operands, out_format)`` for each of ``batch_size`` elements, as
    one call of the batched assignment where it can be one (see the module's docs).
    ``templates[n]``: operand ``n``'s pattern (its values are ``tensors[n]``), or None if
    dense; ``in_dims[n]``: the batch dimension of ``tensors[n]``, or None."""
    read = {a.operand for a in assignment.accesses}
    if all(d is None or n not in read for n, d in enumerate(in_dims)):  # the same result for every element
        elements = [x if d is None else x.select(d, 0) for x, d in zip(tensors, in_dims)]  # unread when batched
        result = run(assignment, [_batched_operand(t, x, None) for t, x in zip(templates, elements)], out_format)
        if isinstance(result, SparseTensor):
            return BatchedResult(result.values, None, result)
        return BatchedResult(result, None, None)
    fmt = _unbatched_result_format(assignment, tuple(None if t is None else t.format for t in templates), out_format)
    if fmt == "loop" or any(t is not None and (batched_format(t.format) is None or fmt is not None and not _unique(t))
                            for t, d in zip(templates, in_dims) if d is not None):
        return looped_call(run, assignment, templates, tensors, in_dims, batch_size, out_format)
    in_dims, tensors = list(in_dims), list(tensors)
    sampled = None if fmt is None else _sampled_operand(assignment, templates, fmt)
    if sampled is not None and in_dims[sampled] is None:  # batched too, so the result is written on it
        values = tensors[sampled]
        if _pattern_only(assignment, sampled):
            tensors[sampled] = memory.empty((values.numel() * batch_size,), values.dtype).view(-1, batch_size)
            in_dims[sampled] = 1
        else:
            tensors[sampled] = values.expand(batch_size, *values.shape)
            in_dims[sampled] = 0
    operands = [_batched_operand(t, x, d) for t, x, d in zip(templates, tensors, in_dims)]
    units = _unit_reductions(assignment, templates, tensors, in_dims)
    if units:
        assignment, operands = _without(assignment, units), _selected(operands, units, assignment, in_dims)
    batched = batched_assignment(assignment, tuple(d is not None for d in in_dims))
    if fmt is None:
        return BatchedResult(run(batched, operands, "dense"), 0, None)
    if sampled is None:
        result = run(batched, operands, stacked_format(fmt))
        return BatchedResult(result.values.view(batch_size, -1), 0, _first_element(result, fmt))
    result = run(batched, operands, batched_format(fmt))
    values = result.values.view(-1, batch_size)
    pattern = SparseTensor(result.shape[1:], fmt, result.pos[:-1], result.crd[:-1], values[:, 0], check=False,
                           index_dtype=result.index_dtype)
    return BatchedResult(values, 1, pattern)


@functools.lru_cache(maxsize=1024)
def _unit_candidates(assignment: Assignment, dense: tuple[bool, ...]) -> tuple[tuple[str, int, int], ...]:
    """Reduction indices the batched call may drop where their extent is 1, each as
    ``(index, operand, dimension)`` of its first access: read by dense operands only,
    once per access, at the same dimension of every access of an operand."""
    reduced = {i for a in assignment.accesses for i in a.indices} - set(assignment.output)
    candidates = []
    for index in sorted(reduced):
        where: dict[int, int | None] = {}
        for a in assignment.accesses:
            at = a.indices.index(index) if a.indices.count(index) == 1 else None
            unusable = index in a.indices and (not dense[a.operand] or at is None)
            if unusable or where.setdefault(a.operand, at) != at:  # an operand reads it at one dimension or none
                break
        else:
            operand, at = next((n, k) for n, k in where.items() if k is not None)
            candidates.append((index, operand, at))
    return tuple(candidates)


def _unit_reductions(assignment: Assignment, templates: Sequence[SparseTensor | None],
                     tensors: Sequence[torch.Tensor], in_dims: Sequence[int | None]) -> tuple[str, ...]:
    """The reduction indices of extent 1 the batched call drops (:func:`_without`): a
    per-sample call often sums over a batch of one (``x.unsqueeze(0)``), which the batched
    kernel would otherwise loop over, accumulating into its output. None if that would
    leave an access without indices."""
    units = []
    for index, n, at in _unit_candidates(assignment, tuple(t is None for t in templates)):
        d = in_dims[n]
        if tensors[n].shape[at if d is None or at < d else at + 1] == 1:
            units.append(index)
    if units and any(a.indices and set(a.indices) <= set(units) for a in assignment.accesses):
        return ()
    return tuple(units)


@functools.lru_cache(maxsize=1024)
def _without(assignment: Assignment, indices: tuple[str, ...]) -> Assignment:
    """``assignment`` with the reduction ``indices`` (each of extent 1) read nowhere:
    ``sum_{b} f(b)`` over ``b = 0`` alone is ``f(0)``."""
    def access(a: Access) -> Access:
        return Access(a.operand, tuple(i for i in a.indices if i not in indices))

    terms = tuple(Term(t.coefficient, tuple(map(access, t.factors)), t.value) for t in assignment.terms)
    return Assignment(assignment.output, terms, assignment.operand_names, assignment.reduction, assignment.epilogue)


def _selected(operands: list, indices: tuple[str, ...], assignment: Assignment,
              in_dims: Sequence[int | None]) -> list:
    """The batched call's dense operands at element 0 of each dimension reading one of
    ``indices`` (their batch dimension first, :func:`_batched_operand`; every access of
    an operand reads them at the same dimensions, :func:`_unit_candidates`)."""
    operands = list(operands)
    done = set()
    for a in assignment.accesses:
        dims = [k for k, i in enumerate(a.indices) if i in indices]
        if dims and a.operand not in done:
            done.add(a.operand)
            op, shift = operands[a.operand], in_dims[a.operand] is not None
            for k in reversed(dims):
                op = op.select(k + shift, 0)
            operands[a.operand] = op
    return operands


def _unique(template: SparseTensor) -> bool:
    """Whether every level of its format stores a coordinate once per parent (not COO's
    rows): a sparse result over batched operands of such a format runs per element."""
    return all(level.unique for level in template.format.levels)


@functools.lru_cache(maxsize=1024)
def _pattern_only(assignment: Assignment, operand: int) -> bool:
    """Whether ``assignment`` reads ``operand`` for its stored positions only: no term's
    value (its product when it has none) nor the epilogue reads its values."""
    if assignment.epilogue is not None and any(a.operand == operand for a in assignment.epilogue.factors):
        return False
    for term in assignment.terms:
        read = range(len(term.factors)) if term.value is None else factors_of(term.value)
        if any(term.factors[k].operand == operand for k in read):
            return False
    return True


def _sampled_operand(assignment: Assignment, templates: Sequence[SparseTensor | None], fmt: Format) -> int | None:
    """A sparse operand of format ``fmt`` read at exactly the output's indices, whose
    pattern the batched result can then be written on (as the unbatched one is): the
    first, or None."""
    for access in assignment.accesses:
        template = templates[access.operand]
        if (template is not None and template.format == fmt and access.indices == assignment.output
                and _unique(template)):
            return access.operand
    return None


def looped_call(run: Run, assignment: Assignment, templates: Sequence[SparseTensor | None],
                tensors: Sequence[torch.Tensor], in_dims: Sequence[int | None], batch_size: int,
                out_format) -> BatchedResult:
    """``run`` once per batch element, the results stacked (dense) or their values stacked
    on the first one's pattern (sparse: every element's pattern is the same)."""
    results = []
    for k in range(batch_size):
        operands = [_batched_operand(t, x if d is None else x.select(d, k), None)
                    for t, x, d in zip(templates, tensors, in_dims)]
        results.append(run(assignment, operands, out_format))
    if not isinstance(results[0], SparseTensor):
        return BatchedResult(torch.stack(results), 0, None)
    return BatchedResult(torch.stack([r.values for r in results]), 0, results[0])
