"""Evaluate a call: find what its signature resolves to (cached), then run it.

A call resolves to one of these runnable objects:

* a :class:`SplitCall` when an operand is blocked: the call over split indices
  (:mod:`..blocks`), itself evaluated here;
* a :class:`launcher.Launch` (a planned kernel bound to the call's shapes and layouts);
* a :class:`PathCall`, a sequence of pairwise contractions (``plan.contract``), each
  itself evaluated here;
* a :class:`DenseCall` when every operand is dense and the call a plain sum of
  products: ``torch.einsum`` per term, or a large product of two factors as one
  ``torch.bmm`` into pooled memory (values, max/min reductions and epilogues over dense
  operands run as kernels: one pass, where torch would run an op per function);
* a :class:`DensifiedCall` when the planner finds BLAS on a dense copy of the one
  sparse operand cheaper than its kernel (``plan/dense_path.py``);
* a :class:`SampledDenseCall` when it finds the whole product by BLAS, sampled at the
  result's pattern, cheaper than a sampled kernel (``plan/sampled_path.py``).

Calls whose operands kernels read as given are cached by :func:`validate.call_key`, and
the last few signatures of each expression also by their guards
(:func:`validate.call_guard`), so a repeated call costs its guard and the launch; other
calls are checked, converted and resolved each time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparsenn.formats import Format, SparseTensor

from ..frontend import functions
from ..frontend.blocks import Split, split_call
from ..backend.precision import compute_dtype
from ..frontend.notation import Access, Assignment, Factor, Term, parse_einsum
from ..plan.bias import fold_bias, hoist_invariant, split_epilogue
from ..plan.contract import Step
from ..plan.dense_path import DensePath, dense_path
from ..plan.sampled_path import SampledDensePath, sampled_dense_path
from ..plan.terms import merge_terms
from ..plan.planner import (DENSE, Request, ShapePlan, build_plans, contraction_path, operand_infos, path_request,
                             plan_call)
from . import memory
from .cache import Guard, GuardedCache
from .dense_product import blas_form
from .densified import COPIES
from .launcher import Launch, bind
from .validate import Checked, call_guard, call_key, check_call

__all__ = ["CALLS", "evaluate", "build_together", "guarded_run", "resolve", "resolved", "route", "split_of", "SplitCall",
           "PathCall", "DenseCall", "DensifiedCall", "SampledDenseCall", "weighed_dense_path", "weighed_sampled_path"]

Run = Callable[[Sequence], torch.Tensor | SparseTensor]

# call key -> the run function; a held call found without it counts its hit here too (``compiler/held.py``)
CALLS: GuardedCache[Run] = GuardedCache("calls", 1024, per_expression=4)
_BLAS_DTYPES = (torch.float32, torch.float64)  # the dtypes BLAS runs at its speed (the sampled dense path's)


def evaluate(assignment: Assignment, operands: Sequence, out_format) -> torch.Tensor | SparseTensor:
    """``assignment`` over ``operands``: a dense tensor, or a SparseTensor when the
    result's format (from the operands' formats and ``out_format``) is sparse."""
    run = CALLS.find(assignment, operands, out_format)
    if run is not None:
        return run(operands)
    key = call_key(assignment, operands, out_format)
    if key is not None:
        run = CALLS.lookup(assignment, key)
        if run is not None:
            return run(operands)
    checked = check_call(assignment, operands, out_format)
    run = resolve(assignment, checked).run
    if key is not None:
        CALLS.store(assignment, key, call_guard(assignment, operands, out_format), run)
    return run(checked.operands)


def resolved(assignment: Assignment, operands: Sequence, out_format) -> Run | None:
    """The run function of a call evaluated last with operands of this call's key (its
    cached resolution), None when such calls are checked in full every time."""
    return CALLS.find(assignment, operands, out_format)


def guarded_run(assignment: Assignment, operands: Sequence, out_format) -> tuple[Guard, Run] | None:
    """The guard and run function of the cached resolution of this call's signature (as
    :func:`resolved`), for a caller that keeps them (:class:`~.site.CallSite`)."""
    return CALLS.find_entry(assignment, operands, out_format)


def build_together(calls: Sequence[tuple[Assignment, Sequence, Request]]) -> None:
    """Plan each ``(assignment, operands, out_format)`` call and build the kernels they
    run together (concurrently), so that evaluating them one by one only loads them.
    Calls computed otherwise (torch, a contraction path, the dense path) build nothing here."""
    plans = []
    for assignment, operands, out_format in calls:
        checked = check_call(assignment, operands, out_format)
        routed = route(assignment, checked)
        if isinstance(routed, SplitCall):
            split = routed.split
            routed = route(split.assignment, check_call(split.assignment, split.operands(checked.operands),
                                                        split.request))
        if isinstance(routed, ShapePlan):
            plans.append(routed.plan)
    build_plans(plans)


def split_of(assignment: Assignment, checked: Checked) -> Split | None:
    """The checked call over split indices, if an operand is blocked."""
    formats = [op.format if isinstance(op, SparseTensor) else None for op in checked.operands]
    return split_call(assignment, formats, [tuple(op.shape) for op in checked.operands], checked.request)


def resolve(assignment: Assignment, checked: Checked
            ) -> Launch | SplitCall | PathCall | EpiloguePathCall | DenseCall | DensifiedCall | SampledDenseCall:
    """What a checked call runs (its ``run(operands)``)."""
    routed = route(assignment, checked)
    if isinstance(routed, ShapePlan):
        return bind(routed, checked.operands, checked.sizes, checked.dtype, checked.index_dtype)
    return routed


def route(assignment: Assignment, checked: Checked
          ) -> ShapePlan | SplitCall | PathCall | EpiloguePathCall | DenseCall | DensifiedCall | SampledDenseCall:
    """How a checked call is computed: over split indices, in torch, as a contraction
    path, as one planned kernel (its :class:`ShapePlan`, not yet bound), or densely
    when the planner finds that cheaper than the kernel (``plan/dense_path.py``,
    ``plan/sampled_path.py``)."""
    split = split_of(assignment, checked)
    if split is not None:
        return SplitCall(split)
    if checked.all_dense and assignment.is_product_sum:
        return DenseCall(assignment, tuple(checked.sizes[i] for i in assignment.output), checked.request)
    infos = operand_infos(checked.operands)
    formats = [i.format for i in infos]
    folded = merge_terms(hoist_invariant(fold_bias(assignment, formats, checked.request), formats, checked.request),
                         infos)
    path = path_call(folded, infos, checked)
    if path is not None:
        return path
    shaped = plan_call(folded, infos, checked.request, checked.dtype, checked.index_dtype)
    dense = weighed_dense_path(assignment, checked, shaped)
    if dense is not None and dense.taken:
        return DensifiedCall(assignment, tuple(checked.sizes[i] for i in assignment.output), dense, shaped,
                             (checked.sizes, checked.dtype, checked.index_dtype))
    sampled = weighed_sampled_path(assignment, checked, shaped)
    if sampled is not None and sampled.taken:
        return SampledDenseCall(assignment, checked, sampled, shaped)
    return shaped


def weighed_dense_path(assignment: Assignment, checked: Checked, shaped: ShapePlan) -> DensePath | None:
    """The dense path of a call planned as ``shaped`` weighed against its kernel
    (``plan/dense_path.py``), None where it does not apply."""
    if shaped.output_format is not None or shaped.anchor is not None or shaped.final_format is not None:
        return None
    stored = [op.nnz if isinstance(op, SparseTensor) else 0 for op in checked.operands]
    return dense_path(assignment, operand_infos(checked.operands), stored, shaped.schedule,
                      compute_dtype(checked.dtype).itemsize, shaped.schedule.target, COPIES.max_bytes)


def weighed_sampled_path(assignment: Assignment, checked: Checked, shaped: ShapePlan) -> SampledDensePath | None:
    """The dense path of a sampled call planned as ``shaped`` weighed against its
    kernel (``plan/sampled_path.py``), None where it does not apply: a result not
    sampled at an operand's pattern, not in float32 or float64 (BLAS's fast types), or
    whose whole product would not fit the output pool (:data:`.memory.POOL_BYTES`)."""
    if shaped.anchor is None or shaped.final_format is not None or checked.dtype not in _BLAS_DTYPES:
        return None
    stored = [op.nnz if isinstance(op, SparseTensor) else 0 for op in checked.operands]
    return sampled_dense_path(assignment, operand_infos(checked.operands), stored, shaped.schedule, shaped.anchor,
                              checked.dtype.itemsize, shaped.schedule.target, memory.POOL_BYTES)


def path_call(assignment: Assignment, infos, checked: Checked) -> PathCall | EpiloguePathCall | None:
    """The pairwise contractions a call runs instead of one fused kernel, if cheaper
    (``assignment``: its biases folded); with an epilogue, over the reduction alone."""
    path = contraction_path(assignment, infos, checked.dtype, checked.request)
    if path is not None:
        last = path_request(assignment, [i.format for i in infos], checked.request)
        return PathCall(assignment, tuple(path), last)
    if assignment.epilogue is not None and checked.request == DENSE:
        reduced, epilogue, read = split_epilogue(assignment)
        path = contraction_path(reduced, infos, checked.dtype, checked.request)
        if path is not None:
            return EpiloguePathCall(PathCall(reduced, tuple(path), DENSE), epilogue, read)
    return None


@dataclass(frozen=True)
class SplitCall:
    """Blocked operands: the call over split indices, its result turned back."""

    split: Split

    def run(self, operands: Sequence) -> torch.Tensor | SparseTensor:
        split = self.split
        return split.result(evaluate(split.assignment, split.operands(operands), split.request))


@dataclass(frozen=True)
class PathCall:
    """A single-term product evaluated as pairwise contractions; the last one produces
    the result in ``last`` (the whole expression's output request)."""

    assignment: Assignment
    steps: tuple[Step, ...]
    last: Request

    def run(self, operands: Sequence) -> torch.Tensor | SparseTensor:
        (term,) = self.assignment.terms
        items = [(a.indices, operands[a.operand]) for a in term.factors]
        for n, step in enumerate(self.steps):
            (left, x), (right, y) = items[step.left], items[step.right]
            pair = Assignment(step.indices, (Term(1.0, (Access(0, left), Access(1, right))),), ("left", "right"))
            request = self.last if n == len(self.steps) - 1 else "dense" if step.dense else None
            result = evaluate(pair, [x, y], request)
            items = [items[k] for k in range(len(items)) if k not in (step.left, step.right)]
            items.append((step.indices, result))
        ((_, result),) = items
        if term.coefficient != 1.0:
            if isinstance(result, torch.Tensor):
                return result * term.coefficient
            return result.with_values(result.values * term.coefficient)
        return result


@dataclass(frozen=True)
class EpiloguePathCall:
    """A product with an epilogue whose sum a contraction path computes faster than one
    fused kernel: the path, then the epilogue as one elementwise call over its dense
    result (:func:`~..plan.bias.split_epilogue`)."""

    path: PathCall
    epilogue: Assignment  # over the path's result (operand 0) and ``read``
    read: tuple[int, ...]

    def run(self, operands: Sequence) -> torch.Tensor:
        operands = [self.path.run(operands), *(operands[n] for n in self.read)]
        result = _in_place_epilogue(self.epilogue, operands)
        return evaluate(self.epilogue, operands, DENSE) if result is None else result


def _in_place_epilogue(epilogue: Assignment, operands: Sequence) -> torch.Tensor | None:
    """The elementwise ``epilogue`` written over its operand 0, the path's result (memory
    of this call alone: a path's dense result never shares an operand's), when its
    functions allow (:func:`~..frontend.functions.evaluate_in_place`); else None."""
    (term,) = epilogue.terms
    factors = [_spread(operands[a.operand], a.indices, epilogue.output) for a in term.factors]
    result = factors[0]
    if (term.coefficient != 1.0 or result.dtype not in (torch.float32, torch.float64)
            or any(f.dtype != result.dtype for f in factors)
            or any(stride == 0 and size > 1 for stride, size in zip(result.stride(), result.shape))):
        return None  # an expanded result would write one element many times
    return functions.evaluate_in_place(term.value, factors)


@dataclass(frozen=True)
class DenseCall:
    """A sum of products of dense operands: torch computes each term (broadcast over
    output indices the term lacks); a sparse ``request`` stores the result with every
    entry. The result never shares an operand's storage (``torch.einsum`` may return a
    view of one)."""

    assignment: Assignment
    out_shape: tuple[int, ...]
    request: Request

    def run(self, operands: Sequence) -> torch.Tensor | SparseTensor:
        out = _summed_products(self.assignment, operands, self.out_shape)
        if any(out.untyped_storage().data_ptr() == op.untyped_storage().data_ptr() for op in operands):
            out = out.clone()
        return _stored_densely(out, self.request) if isinstance(self.request, Format) else out


class DensifiedCall:
    """A product run densely on a dense copy of its sparse operand, kept while the
    operand is unchanged (:mod:`.densified`), as one BLAS call when it has that form
    (:mod:`.dense_product`); ``shaped`` is the sparse kernel the planner weighed it
    against (built only if it runs). A call whose result holds an infinity or a NaN runs
    that kernel instead: an operand holding one would have been multiplied by the copy's
    zeros (``0 · inf = nan``), where an entry that is not stored forms no product. Every
    value of every operand enters some product, so such an operand leaves a value that
    is not finite in the result: checking the result's sum (one pass over the smallest
    tensor, 1.5 µs) replaces checking every dense operand (6 µs each)."""

    def __init__(self, assignment: Assignment, out_shape: tuple[int, ...], dense: DensePath, shaped: ShapePlan,
                 binding: tuple[dict[str, int], torch.dtype, torch.dtype]) -> None:
        self.assignment, self.out_shape, self.dense, self.shaped = assignment, out_shape, dense, shaped
        self._form = blas_form(assignment)
        self._binding = binding  # the call's sizes, dtype and index dtype, to bind the kernel on first use
        self._launch: Launch | None = None

    def run(self, operands: Sequence) -> torch.Tensor:
        k = self.dense.operand
        copy = COPIES.copy_for(operands[k], _made_dense)
        dense = list(operands)
        dense[k] = copy
        form = self._form
        if form is not None:
            out = form.run(dense)  # a new tensor: BLAS writes its own output
        else:
            out = _summed_products(self.assignment, dense, self.out_shape)
            if out.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr():
                out = out.clone()
        if not math.isfinite(float(out.sum())):
            if self._launch is None:
                self._launch = bind(self.shaped, operands, *self._binding)
            return self._launch.run(operands)
        return out


class SampledDenseCall:
    """A sampled product run densely: the whole product of its multiplied factors (one
    BLAS call, into pooled memory when large), then sampled at the anchor's pattern by a
    compiled call; ``shaped`` is the sampled kernel the planner weighed it against."""

    def __init__(self, assignment: Assignment, checked: Checked, sampled: SampledDensePath,
                 shaped: ShapePlan) -> None:
        self.sampled, self.shaped = sampled, shaped
        self._out_shape = tuple(checked.sizes[i] for i in assignment.output)
        self._request = checked.operands[sampled.anchor].format
        letters = tuple(_LETTERS[: len(assignment.output)])  # Out<pattern>[...] = product[...]
        self._sampling = Assignment(letters, (Term(1.0, (Access(0, letters), Access(1, letters)), Factor(0)),),
                                    ("product", "pattern"))

    def run(self, operands: Sequence) -> SparseTensor:
        whole = _summed_products(self.sampled.product, operands, self._out_shape)
        return evaluate(self._sampling, [whole, operands[self.sampled.anchor]], self._request)


def _made_dense(operand: SparseTensor) -> torch.Tensor:
    """``operand`` as a strided tensor, by a compiled kernel (a scatter of its entries)."""
    letters = _LETTERS[: operand.ndim]
    with torch.no_grad():
        return evaluate(parse_einsum(f"{letters}->{letters}", 1), [operand.detach()], DENSE)


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _summed_products(assignment: Assignment, operands: Sequence, out_shape: tuple[int, ...]) -> torch.Tensor:
    """A sum of products, one ``torch.einsum`` per term (a term lacking output indices
    is broadcast over them)."""
    out = None
    for term, equation in zip(assignment.terms, _term_equations(assignment)):
        value = _pooled_product(term, operands, assignment.output, out_shape)
        if value is not None:
            if term.coefficient != 1.0:
                value.mul_(term.coefficient)
        else:
            value = torch.einsum(equation, *[operands[a.operand] for a in term.factors])
            if term.coefficient != 1.0:
                value = term.coefficient * value
        if value.dim() != len(out_shape):
            view = [size if i in term.indices else 1 for i, size in zip(assignment.output, out_shape)]
            value = value.reshape(view)
            if out is None:
                value = value.expand(out_shape).clone()
        out = value if out is None else out + value
    return out


@functools.lru_cache(maxsize=256)
def _term_equations(assignment: Assignment) -> tuple[str, ...]:
    """Each term of ``assignment`` as a ``torch.einsum`` equation over the output
    indices it has."""
    letters: dict[str, str] = {}
    for i in sorted({i for t in assignment.terms for i in t.indices} | set(assignment.output)):
        letters[i] = _LETTERS[len(letters)]
    equations = []
    for term in assignment.terms:
        lhs = ",".join("".join(letters[i] for i in a.indices) for a in term.factors)
        equations.append(f"{lhs}->{''.join(letters[i] for i in assignment.output if i in term.indices)}")
    return tuple(equations)


def _pooled_product(term: Term, operands: Sequence, output: tuple[str, ...],
                    out_shape: tuple[int, ...]) -> torch.Tensor | None:
    """A large product of two dense factors as one batched GEMM written into pooled memory
    (:mod:`.memory`: an output of many MiB then reuses pages already mapped instead of
    faulting in fresh ones at every call, e.g. an expert layer's weight gradients), when
    the output lists its batch indices (in both factors) first, then one factor's free
    indices, then the other's, and every other index is contracted (in both factors);
    None otherwise (``torch.einsum`` computes it)."""
    if len(term.factors) != 2 or math.prod(out_shape) * operands[0].dtype.itemsize < memory.MIN_POOLED_BYTES:
        return None
    (a, b), (x, y) = term.factors, (operands[f.operand] for f in term.factors)
    if x.dtype != y.dtype or len(set(a.indices)) != len(a.indices) or len(set(b.indices)) != len(b.indices):
        return None
    batch = [i for i in output if i in a.indices and i in b.indices]
    rest = output[len(batch):]
    if tuple(output[:len(batch)]) != tuple(batch):
        return None
    if rest and rest[0] in b.indices:
        (a, b), (x, y) = (b, a), (y, x)
    left = [i for i in rest if i in a.indices]
    right = [i for i in rest if i in b.indices]
    contracted = [i for i in a.indices if i in b.indices and i not in output]
    if (tuple(left + right) != tuple(rest) or len(a.indices) != len(batch) + len(left) + len(contracted)
            or len(b.indices) != len(batch) + len(right) + len(contracted)):
        return None
    size = {i: n for indices, t in ((a.indices, x), (b.indices, y)) for i, n in zip(indices, t.shape)}
    if any(size[i] != y.shape[b.indices.index(i)] for i in batch + contracted):
        return None
    counts = [math.prod(size[i] for i in group) for group in (batch, left, contracted, right)]
    lhs = x.permute([a.indices.index(i) for i in batch + left + contracted]).reshape(counts[0], counts[1], counts[2])
    rhs = y.permute([b.indices.index(i) for i in batch + contracted + right]).reshape(counts[0], counts[2], counts[3])
    out = memory.empty((counts[0], counts[1], counts[3]), dtype=x.dtype)
    return torch.bmm(lhs, rhs, out=out).view(out_shape)


def _spread(tensor: torch.Tensor, indices: Sequence[str], space: Sequence[str]) -> torch.Tensor:
    """``tensor`` over ``indices`` viewed over ``space`` (size 1 along the others)."""
    ordered = sorted(range(len(indices)), key=lambda m: space.index(indices[m]))
    moved = tensor.permute(ordered)
    shape = [tensor.shape[indices.index(i)] if i in indices else 1 for i in space]
    return moved.reshape(shape)


def _stored_densely(result: torch.Tensor, fmt: Format) -> SparseTensor:
    """A dense result in the sparse ``fmt`` with every entry stored, zeros too: its
    pattern is structural (what the expression can produce), not the values that
    happen to vanish, so gradients reach every entry."""
    indices = torch.ones(result.shape, dtype=torch.bool).nonzero().T
    return SparseTensor.from_coo(indices, result.reshape(-1), result.shape, format=fmt)
