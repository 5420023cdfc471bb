"""convert(): replace the ``nn.Linear`` layers of a model by :class:`SparseLinear`.

Like ``torch.ao.quantization.convert`` it returns the model (``return_report=True``:
``(model, report)``). Each converted layer keeps ``round((1 - sparsity) * out * in)`` of
its weights (largest magnitude, or random; whole blocks for ``bsr``/``bsc``, n of every m
inputs for ``nm(n,m)``) and its bias, so the converted model computes what the *masked*
dense model computes, and trains through compiled sparse einsums.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, overload

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparsenn.compiler import Target, use_target
from sparsenn.compiler.frontend.notation import parse_einsum
from sparsenn.compiler.plan.dense_path import dense_product_cycles, kernel_cycles, restore_cycles
from sparsenn.compiler.plan.planner import operand_info, operand_infos
from sparsenn.compiler.api import kernel_schedule
from sparsenn.formats import Format, SparseTensor
from sparsenn.layers.linear import SparseLinear, check_weight_format, layer_nnz, resolve_sparsity, shape_problem

__all__ = ["convert", "ConversionReport", "LayerDecision", "Converted", "predicted_speedup"]

Exclude = Iterable[str] | Callable[[str, nn.Module], bool] | None

STEP_BATCH = 64  # the batch skip_slower weighs a training step at


def predicted_speedup(weight: SparseTensor, batch: int = STEP_BATCH, target: Target | None = None) -> float:
    """``dense time / sparse time`` of one forward+backward step of a linear layer whose
    sparse weight is ``weight`` (``out x in``), at ``batch``, as the planner costs them on
    ``target`` (the current one by default: :meth:`Target.current`), in cycles:

    * dense: three BLAS products, ``Y = X Wᵀ``, ``dX = dY W`` and ``dW = dYᵀ X``
      (:func:`~sparsenn.compiler.plan.dense_path.dense_product_cycles`);
    * sparse: the kernels the planner schedules for ``Y``, ``dX`` and ``dW`` sampled on
      the weight's pattern (the cost of their schedules or the arrival of their gathers,
      :func:`~sparsenn.compiler.plan.dense_path.kernel_cycles`, scaled from the fill they
      were planned for to the weight's, at least the time their operands take to stream, plus re-storing the weight's values at every call when
      a kernel reads it in another mode order, ``dX``'s ``W[o, i]`` over ``i``:
      :func:`~sparsenn.compiler.plan.dense_path.restore_cycles`; one the planner runs as
      a contraction path, as its dense product), each call paying the target's
      ``launch_cycles`` over a torch op.

    The comparison the planner's dense path makes per call (``plan/dense_path.py``),
    made here per layer."""
    if not isinstance(weight, SparseTensor) or weight.ndim != 2:
        raise TypeError("predicted_speedup needs the layer's 2-D SparseTensor weight")
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    with contextlib.ExitStack() as stack:
        if target is not None:
            stack.enter_context(use_target(target))
        current = Target.current()
        out_features, in_features = weight.shape
        itemsize = weight.values.element_size()
        x = torch.empty(batch, in_features, dtype=weight.dtype)
        dy = torch.empty(batch, out_features, dtype=weight.dtype)
        scale = weight.nnz / max(operand_info(weight).nnz, 1)
        w = tuple(weight.shape)
        steps = (("bi,oi->bo", (x, weight), "dense", "bi,oi->bo", (x.shape, w)),
                 ("bo,oi->bi", (dy, weight), "dense", "bo,oi->bi", (dy.shape, w)),
                 ("oi,bo,bi->oi", (weight, dy, x), weight.format, "bo,bi->oi", (dy.shape, x.shape)))
        dense = sparse = 0.0
        for equation, operands, out_format, blas, shapes in steps:
            product = dense_product_cycles(parse_einsum(blas, 2), [tuple(s) for s in shapes], itemsize, current)
            sched = kernel_schedule(equation, *operands, out_format=out_format)
            # a call without a kernel runs pairwise products, the largest as BLAS would
            if sched is None:
                sparse += product
            else:
                stored = [op.nnz if isinstance(op, SparseTensor) else 0 for op in operands]
                # the kernel's terms and factors are the equation's (over split indices for n:m)
                called = parse_einsum(equation, len(operands))
                sparse += (kernel_cycles(called, sched, operand_infos(operands),
                                         [op is weight for op in operands].index(True), scale, itemsize, current)
                           + restore_cycles(called, sched, stored, itemsize, current))
            sparse += current.launch_cycles
            dense += product
    return dense / sparse


@dataclass(frozen=True)
class LayerDecision:
    """What convert() did with one matching layer."""

    name: str
    in_features: int
    out_features: int
    nnz: int  # weights the layer stores after conversion (all of them when kept dense)
    format: str  # the sparse format, or "dense"
    converted: bool
    reason: str

    @property
    def sparsity(self) -> float:
        return 1.0 - self.nnz / (self.in_features * self.out_features)


@dataclass(frozen=True)
class ConversionReport:
    """Per-layer decisions of :func:`convert`, in module order."""

    layers: tuple[LayerDecision, ...]

    @property
    def converted(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if d.converted)

    @property
    def kept_dense(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if not d.converted)

    def __getitem__(self, name: str) -> LayerDecision:
        for decision in self.layers:
            if decision.name == name:
                return decision
        raise KeyError(f"no layer named {name!r} in the report")

    def __len__(self) -> int:
        return len(self.layers)

    def __str__(self) -> str:
        rows = [("layer", "shape (out, in)", "kept nnz", "sparsity", "format", "decision")]
        for d in self.layers:
            rows.append((d.name, f"({d.out_features}, {d.in_features})", str(d.nnz), f"{d.sparsity:.3f}", d.format,
                         ("sparse: " if d.converted else "dense: ") + d.reason))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


class Converted(NamedTuple):
    """``(model, report)`` returned by :func:`convert` with ``return_report=True``."""

    model: nn.Module
    report: ConversionReport


def _check_include(include: object) -> tuple[type, ...]:
    types = (include,) if isinstance(include, type) else include
    try:
        types = tuple(types)
    except TypeError:
        raise TypeError(f"include must be a module type or a tuple of them, got {type(include).__name__}") from None
    if not types:
        raise ValueError("include is empty: nothing would be converted")
    for t in types:
        if not isinstance(t, type) or not issubclass(t, nn.Module):
            raise TypeError(f"include must contain nn.Module types, got {t!r}")
        if not issubclass(t, nn.Linear):
            raise ValueError(f"include may only contain nn.Linear and its subclasses (the only layers with a "
                             f"sparse version), got {t.__name__}")
    return types


def _exclusion(model: nn.Module, exclude: Exclude) -> Callable[[str, nn.Module], str | None]:
    """A function giving why a layer is excluded (or None)."""
    if exclude is None:
        return lambda name, module: None
    if callable(exclude):
        return lambda name, module: "excluded by the exclude predicate" if exclude(name, module) else None
    if isinstance(exclude, str):
        exclude = (exclude,)
    patterns = tuple(exclude)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError("exclude must be module names (glob patterns allowed), or a predicate(name, module)")
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(f"exclude pattern {pattern!r} matches no submodule of the model")

    def excluded(name: str, module: nn.Module) -> str | None:
        parts = name.split(".")
        for depth in range(len(parts), 0, -1):
            prefix = ".".join(parts[:depth])
            for pattern in patterns:
                if fnmatch.fnmatchcase(prefix, pattern):
                    return f"excluded by {pattern!r}" + ("" if prefix == name else f" (matches {prefix})")
        return None

    return excluded


def _disable_fused_encoder_path(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook on ``nn.TransformerEncoderLayer``: a layer with hooks skips torch's
    fused inference kernel, which reads ``linear1.weight`` / ``linear2.weight`` as dense
    tensors instead of calling the (now sparse) linear layers. Changes nothing else."""


@overload
def convert(model: nn.Module, *, sparsity: float | None = ..., method: str = ..., format: str | Format = ...,
            include: type | tuple[type, ...] = ..., exclude: Exclude = ..., min_features: int = ...,
            inplace: bool = ..., skip_slower: bool = ..., return_report: Literal[False] = ...) -> nn.Module: ...


@overload
def convert(model: nn.Module, *, sparsity: float | None = ..., method: str = ..., format: str | Format = ...,
            include: type | tuple[type, ...] = ..., exclude: Exclude = ..., min_features: int = ...,
            inplace: bool = ..., skip_slower: bool = ..., return_report: Literal[True]) -> Converted: ...


def convert(model: nn.Module, *, sparsity: float | None = None, method: str = "magnitude",
            format: str | Format = "csr", include: type | tuple[type, ...] = (nn.Linear,), exclude: Exclude = None,
            min_features: int = 0, inplace: bool = True, skip_slower: bool = False,
            return_report: bool = False) -> nn.Module | Converted:
    """Replace matching ``nn.Linear`` submodules of ``model`` by :class:`SparseLinear`.

    Args:
        model: any module; nested ``Sequential``/``ModuleList``/``ModuleDict`` are walked.
        sparsity: fraction of each layer's weights removed, in [0, 1) (default 0.9);
            ``nm(n,m)`` implies ``1 - n/m`` (None, or that value).
        method: ``"magnitude"`` (keep the largest ``|w|`` per layer, the blocks of largest
            Frobenius norm, or the n largest of each group of m) or ``"random"``.
        format: storage format of the sparse weights (see :class:`SparseLinear`), e.g.
            ``"csr"``, ``"bsr(32,32)"`` or ``"nm(2,4)"``; a layer whose shape the block
            (or group) does not divide is kept dense.
        include: the layer types to convert: ``nn.Linear`` or subclasses of it.
        exclude: names of submodules to leave alone (glob patterns; excluding a
            container excludes everything in it), or a predicate ``(name, module) -> bool``.
        min_features: keep dense any layer with ``min(in, out) < min_features``.
        inplace: modify ``model``; otherwise convert a deep copy.
        skip_slower: keep dense a layer whose forward+backward step at batch 64 the
            planner's cost model (:func:`predicted_speedup`, on the current
            :class:`~sparsenn.compiler.Target`: pass another with
            ``sparsenn.compiler.use_target``) finds slower sparse than dense.
        return_report: return ``Converted(model, report)`` instead of the model alone.

    Returns the converted model (``model`` itself when ``inplace``), or with
    ``return_report`` a ``Converted(model, report)``; ``report`` lists every matching layer
    with its shape, kept nnz, format and the decision with its reason. Kept dense: linear
    layers whose parent reads their weight directly instead of calling them
    (``nn.MultiheadAttention.out_proj``), layers whose weight or bias is tied to another
    module's parameter (an LM head sharing its embedding's weight: a sparse copy would
    untie them) and parametrized weights (``torch.nn.utils.parametrize``). A converted
    ``nn.TransformerEncoderLayer`` gets a no-op forward pre-hook and
    ``nn.TransformerEncoder.use_nested_tensor`` is set False, so that torch's fused
    inference path, which reads the dense ``linear1``/``linear2`` weights, is not taken.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    fmt = check_weight_format(format)
    sparsity = resolve_sparsity(fmt, sparsity)
    if method not in ("magnitude", "random"):
        raise ValueError(f"method must be 'magnitude' or 'random', got {method!r}")
    types = _check_include(include)
    if isinstance(min_features, bool) or not isinstance(min_features, numbers.Integral) or min_features < 0:
        raise ValueError(f"min_features must be a non-negative int, got {min_features!r}")
    excluded = _exclusion(model, exclude)
    if not inplace:
        model = copy.deepcopy(model)

    decisions: list[LayerDecision] = []
    sparse_versions: dict[int, nn.Module] = {}  # id of a converted Linear -> its SparseLinear
    references: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, Linear), shared ones repeated
    decided: set[int] = set()
    owners = _parameter_owners(model)
    parents = dict(model.named_modules(remove_duplicate=False))
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or not isinstance(module, types):
            continue
        parent_name, _, attr = name.rpartition(".")
        references.append((parents[parent_name], attr, module))
        if id(module) in decided:
            continue  # a shared layer: decided under its first name
        decided.add(id(module))
        decision = _decide(name, module, parents[parent_name], owners, sparsity, method, fmt, excluded,
                           min_features)
        if decision.converted:
            layer = SparseLinear.from_dense(module, sparsity, method, fmt)
            if skip_slower:
                decision = _weighed(decision, layer)
            if decision.converted:
                sparse_versions[id(module)] = layer
        decisions.append(decision)

    for parent, attr, module in references:
        if id(module) in sparse_versions:
            setattr(parent, attr, sparse_versions[id(module)])
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and _has_sparse(module):
            if _disable_fused_encoder_path not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_disable_fused_encoder_path)
        if isinstance(module, nn.TransformerEncoder) and _has_sparse(module):
            module.use_nested_tensor = False
    if return_report:
        return Converted(model, ConversionReport(tuple(decisions)))
    return model


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """For every parameter (by id): the ``(module, qualified name)`` of each of its places."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((module, f"{module_name}.{param_name}".lstrip(".")))
    return owners


def _tie(module: nn.Linear, owners: dict[int, list[tuple[nn.Module, str]]]) -> str | None:
    """Why ``module``'s parameters are tied to another module's, or None. The same Linear
    reached under two names is not a tie: it is replaced by one SparseLinear everywhere."""
    for param_name in ("weight", "bias"):
        param = module._parameters.get(param_name)
        if param is None:
            continue
        others = sorted({name for owner, name in owners.get(id(param), ()) if owner is not module})
        if others:
            return (f"{param_name} is tied to {', '.join(others)} (a sparse copy would untie them); "
                    "exclude the layer or untie the parameters to convert it")
    return None


def _decide(name: str, module: nn.Linear, parent: nn.Module, owners: dict[int, list[tuple[nn.Module, str]]],
            sparsity: float, method: str, fmt: Format, excluded: Callable[[str, nn.Module], str | None],
            min_features: int) -> LayerDecision:
    """Whether (and why) one Linear layer is converted, before weighing its speed."""
    out_features, in_features = module.weight.shape
    reason = excluded(name, module)
    if reason is None and isinstance(parent, nn.MultiheadAttention):
        reason = "nn.MultiheadAttention reads out_proj.weight directly instead of calling out_proj"
    if reason is None and parametrize.is_parametrized(module):
        reason = "its parameters are parametrized (torch.nn.utils.parametrize); a sparse copy would drop that"
    if reason is None:
        reason = _tie(module, owners)
    if reason is None and module.weight.dtype not in (torch.float32, torch.float64):
        reason = f"dtype {module.weight.dtype} (sparse layers support float32 and float64)"
    if reason is None and module.weight.device.type != "cpu":
        reason = f"on device {module.weight.device} (sparse layers run on the CPU)"
    if reason is None and min(in_features, out_features) < min_features:
        reason = f"min(in, out) = {min(in_features, out_features)} < min_features = {min_features}"
    if reason is None:
        reason = shape_problem(fmt, out_features, in_features)
    keep = layer_nnz(fmt, out_features, in_features, sparsity) if reason is None else in_features * out_features
    if reason is not None:
        return LayerDecision(name, in_features, out_features, in_features * out_features, "dense", False, reason)
    return LayerDecision(name, in_features, out_features, keep, str(fmt), True, method)


def _weighed(decision: LayerDecision, layer: SparseLinear) -> LayerDecision:
    """``decision`` (to convert) kept or turned down by the planner's costs of the layer's
    training step (:func:`predicted_speedup`)."""
    speedup = predicted_speedup(layer.weight)
    if speedup < 1.0:
        reason = f"planned sparse speedup {speedup:.2f}x < 1 (skip_slower)"
        n = decision.in_features * decision.out_features
        return replace(decision, nnz=n, format="dense", converted=False, reason=reason)
    return replace(decision, reason=f"{decision.reason}; planned sparse speedup {speedup:.2f}x")


def _has_sparse(module: nn.Module) -> bool:
    return any(isinstance(m, SparseLinear) for m in module.modules())
