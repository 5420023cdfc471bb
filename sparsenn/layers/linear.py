"""SparseLinear: a linear layer whose weight is a fixed-pattern SparseTensor.

The pattern (the per-level ``pos``/``crd`` index arrays) lives in buffers, the stored
values in one ``nn.Parameter``; forward and backward are compiled sparse einsums.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, is_autocast_enabled, nn
from torch.compiler import is_compiling

from sparsenn.compiler import CompiledExpression, compile_expression
from sparsenn.compiler.runtime.autocast import autocast_dtype
from sparsenn.compiler.call_site import CallSite, traced_site_call
from sparsenn.compiler.runtime.tracing import traced_op
from sparsenn.formats import Format, SparseTensor, parse_format
from sparsenn.formats.tensor import is_sparse
from sparsenn.layers.conventions import FLOAT_DTYPES, factory_kwargs, refuse_onnx_export, refuse_torchscript
from sparsenn.layers.pattern import PatternBuffers

__all__ = ["SparseLinear", "check_sparsity", "check_weight_format", "kept_count", "layer_nnz", "resolve_sparsity",
           "shape_problem"]

_AFFINE_TEXT = "Y[b,o] = X[b,i] * W[o,i] + bias[o]"
_LINEAR_TEXT = "Y[b,o] = X[b,i] * W[o,i]"
_DENSE = "dense"
_AFFINE = compile_expression(_AFFINE_TEXT, out_format=_DENSE)
_LINEAR = compile_expression(_LINEAR_TEXT, out_format=_DENSE)
_STRIDED = torch.strided  # bare names: the traced forward reads no attribute of torch
_CPU = "cpu"

Method = Literal["magnitude", "random"]


def check_sparsity(sparsity: object, name: str = "sparsity") -> float:
    """``sparsity`` as a float in [0, 1); TypeError/ValueError otherwise."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(sparsity).__name__}")
    value = float(sparsity)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction of weights removed), got {sparsity}")
    return value


def check_weight_format(format: str | Format) -> Format:
    """Parse a rank-2 weight format; formats storing every entry (all levels dense) are rejected."""
    if not isinstance(format, (str, Format)):
        raise TypeError(f"format must be a format name such as 'csr', got {type(format).__name__}")
    try:
        fmt = parse_format(format, 2)
    except ValueError as exc:
        raise ValueError(f"unknown weight format {format!r}: {exc}") from None
    if all(level.locatable for level in fmt.levels):
        raise ValueError(f"weight format {format!r} is dense; use nn.Linear for a dense weight")
    return fmt


def shape_problem(fmt: Format, out_features: int, in_features: int) -> str | None:
    """Why ``fmt`` cannot store an ``out_features × in_features`` weight, or None."""
    nm = fmt.nm
    if nm is not None:
        if in_features % nm[1]:
            return f"groups of {nm[1]} inputs ({fmt}) do not divide in_features = {in_features}"
    elif fmt.block is not None and (out_features % fmt.block[0] or in_features % fmt.block[1]):
        return f"block ({fmt.block[0]},{fmt.block[1]}) does not divide {out_features}×{in_features}"
    return None


def resolve_sparsity(fmt: Format, sparsity: object, default: float = 0.9) -> float:
    """The sparsity a layer of format ``fmt`` gets: ``nm(n,m)`` implies ``1 - n/m``
    (``sparsity`` must then be None or equal to it), other formats take ``sparsity``
    (``default`` when None)."""
    nm = fmt.nm
    if nm is None:
        return check_sparsity(default if sparsity is None else sparsity)
    implied = 1.0 - nm[0] / nm[1]
    if sparsity is not None and abs(check_sparsity(sparsity) - implied) > 1e-9:
        raise ValueError(f"format {fmt} fixes the sparsity at 1 - n/m = 1 - {nm[0]}/{nm[1]} = {implied:g}, got "
                         f"sparsity={sparsity}; pass sparsity=None (or {implied:g})")
    return implied


def kept_count(numel: int, sparsity: float) -> int:
    """Entries kept out of ``numel`` at ``sparsity``: ``round((1 - sparsity) * numel)``."""
    return round((1.0 - sparsity) * numel)


def _kept_blocks(blocks: int, sparsity: float) -> int:
    """Blocks kept out of ``blocks``: ``round((1 - sparsity) * blocks)``, at least one."""
    return max(kept_count(blocks, sparsity), 1)


def layer_nnz(fmt: Format, out_features: int, in_features: int, sparsity: float) -> int:
    """Weights a chosen (random or magnitude) pattern of ``fmt`` stores at ``sparsity``:
    ``n`` of every ``m`` for ``nm(n,m)``, whole blocks for blocked formats."""
    nm = fmt.nm
    if nm is not None:
        return out_features * (in_features // nm[1]) * nm[0]
    if fmt.block is not None:
        bh, bw = fmt.block
        return _kept_blocks((out_features // bh) * (in_features // bw), sparsity) * bh * bw
    return kept_count(out_features * in_features, sparsity)


def _chosen(count: int, keep: int, scores: Tensor | None, first: bool) -> Tensor:
    """Indices of ``keep`` of ``count`` units: the top ``scores``, the first ``keep`` if
    ``first``, or random."""
    if first:
        return torch.arange(keep)
    if scores is None:
        return torch.randperm(count)[:keep]
    return torch.topk(scores.reshape(-1), keep, sorted=False).indices


def _kept_indices(fmt: Format, shape: tuple[int, int], sparsity: float, magnitudes: Tensor | None,
                  first: bool = False) -> Tensor:
    """(2, nnz) coordinates of a chosen pattern: the largest ``magnitudes`` (entries,
    block Frobenius norms, or within each group of m for nm), random when None, or the
    first units in row-major order if ``first`` (a placeholder with the same nnz)."""
    out_features, in_features = shape
    nm = fmt.nm
    if nm is not None:
        n, m = nm
        groups = in_features // m
        if first:
            offsets = torch.arange(n).expand(out_features, groups, n)
        else:
            scores = torch.rand(out_features, groups, m) if magnitudes is None else magnitudes.reshape(-1, groups, m)
            offsets = torch.topk(scores, n, dim=-1, sorted=False).indices
        rows = torch.arange(out_features)[:, None, None].expand_as(offsets)
        cols = torch.arange(0, in_features, m)[None, :, None] + offsets
        return torch.stack([rows.reshape(-1), cols.reshape(-1)])
    if fmt.block is not None:
        bh, bw = fmt.block
        row_blocks, col_blocks = out_features // bh, in_features // bw
        norms = None if magnitudes is None else magnitudes.reshape(row_blocks, bh, col_blocks, bw).square().sum((1, 3))
        chosen = _chosen(row_blocks * col_blocks, _kept_blocks(row_blocks * col_blocks, sparsity), norms, first)
        rows = (chosen // col_blocks)[:, None, None] * bh + torch.arange(bh)[None, :, None]
        cols = (chosen % col_blocks)[:, None, None] * bw + torch.arange(bw)[None, None, :]
        return torch.stack([rows.expand(-1, bh, bw).reshape(-1), cols.expand(-1, bh, bw).reshape(-1)])
    chosen = _chosen(out_features * in_features, kept_count(out_features * in_features, sparsity), magnitudes, first)
    return torch.stack([chosen // in_features, chosen % in_features])


def _check_structure(fmt: Format, indices: Tensor, shape: tuple[int, int]) -> None:
    """A given pattern must be a union of whole blocks (blocked formats) or keep exactly
    n of every group of m inputs (``nm(n,m)``, which pads fewer with stored zeros);
    ValueError naming an offending block or group."""
    if fmt.block is None:
        return
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[indices[0], indices[1]] = True
    if fmt.nm is not None:
        n, m = fmt.nm
        counts = mask.view(shape[0], -1, m).sum(-1)
        if bool((counts != n).any()):
            row, group = (int(k) for k in torch.nonzero(counts != n)[0])
            first = group * m
            raise ValueError(f"pattern keeps {int(counts[row, group])} of the {m} inputs {first}..{first + m - 1} "
                             f"of output {row}; format {fmt} stores exactly {n} of every {m} (fewer would be "
                             "padded with stored zeros)")
        return
    bh, bw = fmt.block
    blocks = mask.view(shape[0] // bh, bh, shape[1] // bw, bw)
    partial = blocks.any(3).any(1) & ~blocks.all(3).all(1)
    if bool(partial.any()):
        br, bc = (int(k) for k in torch.nonzero(partial)[0])
        raise ValueError(f"pattern is not block-aligned for format {fmt}: the block of outputs "
                         f"{br * bh}..{br * bh + bh - 1} and inputs {bc * bw}..{bc * bw + bw - 1} is partly set; "
                         "a blocked weight stores whole blocks")


def _check_method(method: object) -> Method:
    if method not in ("magnitude", "random"):
        raise ValueError(f"method must be 'magnitude' or 'random', got {method!r}")
    return method


def _check_features(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def _pattern_indices(pattern: object, shape: tuple[int, int]) -> Tensor:
    """(2, nnz) int64 coordinates of a given pattern: a bool mask or an index tensor."""
    if not isinstance(pattern, Tensor):
        raise TypeError(f"pattern must be 'random', a bool mask of shape {shape} or a (2, nnz) index tensor, "
                        f"got {type(pattern).__name__}")
    if pattern.layout != torch.strided or pattern.device.type != "cpu":
        raise ValueError(f"pattern must be a strided CPU tensor, got {pattern.layout} on {pattern.device}")
    if pattern.dtype == torch.bool:
        if tuple(pattern.shape) != shape:
            raise ValueError(f"pattern mask has shape {tuple(pattern.shape)}, expected (out_features, in_features) "
                             f"= {shape}")
        return torch.nonzero(pattern).T
    if pattern.is_floating_point() or pattern.is_complex():
        raise TypeError(f"pattern must be a bool mask or an integer (2, nnz) index tensor, got dtype {pattern.dtype}")
    if pattern.dim() != 2 or pattern.shape[0] != 2:
        raise ValueError(f"pattern indices must have shape (2, nnz) (rows = output, input), got {tuple(pattern.shape)}")
    indices = pattern.long()
    for row, (name, size) in enumerate((("output", shape[0]), ("input", shape[1]))):
        bad = (indices[row] < 0) | (indices[row] >= size)
        if bool(bad.any()):
            entry = int(torch.nonzero(bad)[0])
            raise ValueError(f"pattern indices[{row}] ({name} feature) has value {int(indices[row, entry])} "
                             f"out of range [0, {size}) at entry {entry}")
    return indices


@dataclass(frozen=True)
class _PendingPattern:
    """The pattern a layer built on the meta device gets in ``reset_parameters``: the
    given ``(2, nnz)`` indices, or a random one of ``sparsity`` when None."""

    indices: Tensor | None
    sparsity: float | None


def _pattern_tensor(fmt: Format, shape: tuple[int, int], indices: Tensor) -> SparseTensor:
    """The ``fmt`` SparseTensor (zero values) storing exactly the ``(2, nnz)`` ``indices``."""
    try:
        tensor = SparseTensor.from_coo(indices, torch.zeros(indices.shape[1]), shape, fmt, duplicates="error")
    except ValueError as exc:
        raise ValueError(f"invalid pattern: {exc}") from None
    if tensor.nnz != indices.shape[1]:
        raise ValueError(f"format {fmt} stores {tensor.nnz} positions for a pattern of {indices.shape[1]} "
                         "entries (a dense level below a sparse one stores explicit zeros); use 'csr', 'csc', "
                         "'coo', 'dcsr', 'dcsc', 'bsr(bh,bw)', 'bsc(bh,bw)' or 'nm(n,m)'")
    return tensor


class SparseLinear(nn.Module):
    r"""Linear layer with a sparse weight of fixed pattern: :math:`y = x W^\top + b`.

    .. math::
        y_{\ldots, o} = \sum_{i : (o, i) \in P} x_{\ldots, i} \, W_{o, i} + b_o

    where :math:`P` is the stored pattern of the ``(out_features, in_features)`` weight.
    The pattern is kept in buffers (``weight_pos*``/``weight_crd*``) and the stored values
    in the parameter ``weight_values``; :attr:`weight` assembles them into a
    :class:`~sparsenn.SparseTensor`. Forward is ``einsum("bi,oi->bo", x, W)`` and the
    backward pass consists of the compiled einsums autograd derives from it: ``dX = dY W``
    and ``dW = (dYᵀ X)`` sampled on :math:`P`.

    Args:
        in_features, out_features: sizes of the input and output features.
        bias: learn an additive bias (keyword-only, as every argument after the sizes).
        sparsity: fraction of weights removed for ``pattern="random"`` (default 0.9; for
            ``nm(n,m)`` None or ``1 - n/m``); must be None for a given pattern, whose size
            fixes the sparsity.
        format: storage format of the weight (``"csr"``, ``"csc"``, ``"coo"``, ``"dcsr"``,
            ``"dcsc"``, level letters, ``"bsr(bh,bw)"``/``"bsc(bh,bw)"`` whose blocks must
            divide ``(out, in)``, or ``"nm(n,m)"``: n of every m consecutive inputs, m
            dividing ``in``); dense formats are rejected.
        pattern: ``"random"`` (drawn from torch's global RNG: a uniformly random set of
            ``round((1 - sparsity) * out * in)`` positions; for blocked formats of
            ``round((1 - sparsity) * blocks)`` whole blocks, at least one; for ``nm(n,m)``
            n random offsets in every group), a bool mask of shape ``(out, in)`` or a
            ``(2, nnz)`` integer tensor of ``(output, input)`` coordinates without duplicates
            (for blocked formats a union of whole blocks, for ``nm(n,m)`` exactly n per group).
        device: ``"cpu"`` or ``"meta"`` (default: torch's default device). On the meta
            device nothing is allocated nor drawn; ``to_empty(device="cpu")`` and then
            ``reset_parameters()`` (a new random pattern, or the given one) or
            ``load_state_dict`` make a working layer.
        dtype: float32, float64, bfloat16 or float16 (default: torch's default dtype).

    Values are initialised like ``nn.Linear`` for the kept fan-in: uniform in
    :math:`\pm 1/\sqrt{f}` with :math:`f = \mathrm{nnz} / \mathrm{out}`, the mean number of
    inputs each output keeps; the bias uses the same bound.

    Inputs: a dense tensor ``(..., in_features)`` (leading dims flattened and restored), or a
    rank-2 SparseTensor or torch sparse tensor (COO, CSR, CSC, BSR, BSC; converted by
    ``sparsenn.from_torch``) ``(batch, in_features)`` of sparse activations; the output is
    always a dense tensor ``(..., out_features)``.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, sparsity: float | None = None,
                 format: str | Format = "csr", pattern: str | Tensor = "random", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = _check_features("in_features", in_features)
        self.out_features = _check_features("out_features", out_features)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        kwargs = factory_kwargs(device, dtype)
        on_meta = kwargs["device"].type == "meta"
        fmt = check_weight_format(format)
        shape = (self.out_features, self.in_features)
        problem = shape_problem(fmt, *shape)
        if problem is not None:
            raise ValueError(f"format {fmt} does not fit this layer's (out_features, in_features) = {shape} "
                             f"weight: {problem}")
        with torch.device("cpu"):  # the pattern is built on the CPU whatever the default device
            if isinstance(pattern, str):
                if pattern != "random":
                    raise ValueError(f"pattern must be 'random', a bool mask or a (2, nnz) index tensor, "
                                     f"got {pattern!r}")
                sparsity = resolve_sparsity(fmt, sparsity)
                given = None
                indices = _kept_indices(fmt, shape, sparsity, None, first=on_meta)
            else:
                if sparsity is not None:
                    raise ValueError("sparsity must be None when a pattern is given (the pattern fixes the sparsity)")
                given = indices = _pattern_indices(pattern, shape)
                _check_structure(fmt, indices, shape)
            tensor = _pattern_tensor(fmt, shape, indices)
        self._pending_pattern = _PendingPattern(given, sparsity) if on_meta else None
        self.weight_values = nn.Parameter(torch.empty(tensor.nnz, **kwargs))
        if on_meta:
            self._set_pattern(tensor.format, *(tuple(None if a is None else a.to("meta") for a in arrays)
                                               for arrays in (tensor.pos, tensor.crd)))
            self._weight_pattern.deferred = ("it was built on the meta device and holds no pattern yet; call "
                                             "to_empty(device='cpu') and then reset_parameters() or load_state_dict()")
        else:
            self._set_pattern(tensor.format, tensor.pos, tensor.crd)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, **kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._new_call_sites()  # here, not first in a traced forward (whose guards would then see them created)

    # ------------------------------------------------------------------ pattern storage
    def _set_pattern(self, fmt: Format, pos: tuple[Tensor | None, ...], crd: tuple[Tensor | None, ...]) -> None:
        """Register ``fmt``'s index arrays as the pattern buffers (replacing earlier ones)."""
        if "_weight_pattern" not in self.__dict__:
            self._weight_pattern = PatternBuffers("weight", (self.out_features, self.in_features), fmt)
        self._weight_pattern.register(self, fmt, pos, crd)

    @property
    def format(self) -> Format:
        """Storage format of the weight."""
        return self._weight_pattern.format

    @property
    def weight(self) -> SparseTensor:
        """The ``(out_features, in_features)`` weight; its ``values`` are ``weight_values``.

        Its pattern is checked in O(levels) while the buffers are unchanged, and in full
        (ValueError naming the buffer) after they were edited, replaced, emptied or partly
        loaded (see :mod:`sparsenn.layers.pattern`)."""
        return self._weight_pattern.tensor(self)

    @property
    def nnz(self) -> int:
        """Number of stored weights."""
        return self.weight_values.numel()

    @property
    def sparsity(self) -> float:
        """Fraction of the dense weight's entries that are not stored."""
        return 1.0 - self.nnz / (self.in_features * self.out_features)

    def reset_parameters(self) -> None:
        """Uniform init in ±1/sqrt(kept fan-in) for the values and the bias (pattern kept).
        A layer built on the meta device and then moved by ``to_empty`` gets its pattern
        here: the given one, or a random one of the layer's sparsity."""
        pending = self._pending_pattern
        if pending is not None and self.weight_values.device.type != "meta":
            shape = (self.out_features, self.in_features)
            with torch.device("cpu"):
                indices = (_kept_indices(self.format, shape, pending.sparsity, None) if pending.indices is None
                           else pending.indices)
                tensor = _pattern_tensor(self.format, shape, indices)
            self._set_pattern(tensor.format, tensor.pos, tensor.crd)
            self._pending_pattern = None
        fan_in = max(self.nnz / self.out_features, 1.0)
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            self.weight_values.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    # ------------------------------------------------------------------ compute
    def forward(self, x: Tensor | SparseTensor) -> Tensor:
        """``x W^T + b`` for dense ``(..., in)`` or sparse ``(batch, in)`` input; returns a dense tensor.

        The schedule usually vectorises over the batch (``sparsenn.explain`` shows it):
        the kernel then reads ``x`` feature-major and writes its result that way (strides
        ``(1, batch)``), so a batch-major input is transposed once per call while the
        output of another SparseLinear (or of elementwise ops on it, which keep its
        strides) is read as it is."""
        if is_compiling():  # Dynamo traces past the held signature (eager state its guards would otherwise check)
            traced = self._traced(x)
            return self._through_expression(x) if traced is None else traced
        bias = self._parameters["bias"]  # as self.bias, without Module.__getattr__
        site = (self.__dict__.get("_call_sites") or self._new_call_sites())[bias is not None]
        weight = self._weight_pattern.held(self._buffers, self._parameters)
        if weight is not None:  # the signature's guard checks the inputs and the weight's arrays (a miss: None)
            result = site.cached((x, weight) if bias is None else (x, weight, bias))
            if result is not None:
                return result
        return self._through_expression(x)

    def _through_expression(self, x: object) -> Tensor:
        """The forward through the call site's expression, the input checked first."""
        bias = self._parameters["bias"]
        site = (self.__dict__.get("_call_sites") or self._new_call_sites())[bias is not None]
        x = self._checked_input(x)
        if is_sparse(x) or x.dim() == 2:
            return self._affine(site, x, bias)
        return self._affine(site, x.reshape(-1, self.in_features), bias).reshape(*x.shape[:-1], self.out_features)

    def _traced(self, x: object) -> Tensor | None:
        """The forward as ``torch.compile`` traces it for a dense 2-D input of the
        weight's dtype outside autocast: the call's ``sparsenn::evaluate`` op
        (:func:`~sparsenn.compiler.runtime.tracing.traced_op`) over the input, the
        pattern buffers, the values and the bias read directly, its call string a
        constant of the format and index dtype (:func:`traced_site_call`). The same op as
        through the site's expression, with no SparseTensor built and no entry point
        traced, so Dynamo guards little more than those tensors. None for any other
        input (the forward then goes through the expression, which checks it)."""
        parameters = self._parameters
        values, bias = parameters["weight_values"], parameters["bias"]
        if (not isinstance(x, Tensor) or x.layout != _STRIDED or x.dim() != 2 or x.shape[1] != self.in_features
                or x.dtype != values.dtype or is_autocast_enabled(_CPU)):
            return None
        pattern, buffers = self._weight_pattern, self._buffers
        arrays = [buffers[name] for name in pattern.names]
        call = traced_site_call(_LINEAR_TEXT if bias is None else _AFFINE_TEXT, _DENSE, pattern.format, arrays[0].dtype)
        tensors = [x, *arrays, values] if bias is None else [x, *arrays, values, bias]
        return traced_op(call, tensors, [self.out_features, self.in_features])

    def _new_call_sites(self) -> tuple[CallSite, CallSite]:
        """This layer's :class:`CallSite` s of ``x W^T`` and ``x W^T + b``."""
        sites = self.__dict__["_call_sites"] = (CallSite(_LINEAR), CallSite(_AFFINE))
        return sites

    def _checked_input(self, x: object) -> Tensor | SparseTensor:
        """``x`` validated against the layer; a torch sparse tensor (COO, CSR, CSC, BSR,
        BSC) becomes a SparseTensor of its natural format (``sparsenn.from_torch``)."""
        dtype = self._parameters["weight_values"].dtype  # as self.weight_values, without Module.__getattr__
        if isinstance(x, Tensor) and x.layout != _STRIDED:
            if x.dim() != 2:
                raise ValueError(f"a torch sparse input must have shape (batch, {self.in_features}), got "
                                 f"{tuple(x.shape)} ({x.layout})")
            try:
                x = SparseTensor.from_torch(x)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"torch sparse input ({x.layout}) cannot be converted: {exc}") from None
        if is_sparse(x):
            if x.ndim != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"sparse input must have shape (batch, {self.in_features}), got {x.shape}")
        elif isinstance(x, Tensor):
            if x.dim() == 0 or x.shape[-1] != self.in_features:
                raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        else:
            raise TypeError(f"input must be a torch.Tensor or a SparseTensor, got {type(x).__name__}")
        if x.dtype != dtype and autocast_dtype(x.dtype) != autocast_dtype(dtype):  # under autocast, both become its dtype
            raise TypeError(f"input has dtype {x.dtype} but the weight has {dtype}; convert one of them")
        return x

    def _affine(self, site: CallSite, x: Tensor | SparseTensor, bias: Tensor | None) -> Tensor:
        """``x W^T (+ b)`` for a 2-D input, dense whatever the formats (a product of two
        sparse operands, or with a weight that stores o in a compressed level, is sparse):
        the bias is added to each output slice by the kernel that finishes it (an
        epilogue), not in a second pass."""
        return site.call((x, self.weight) if bias is None else (x, self.weight, bias))

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_dense(cls, linear: nn.Linear, sparsity: float | None = None, method: Method = "magnitude",
                   format: str | Format = "csr") -> SparseLinear:
        """A SparseLinear keeping the largest (or random) weights of ``linear``, with its bias.

        ``sparsity`` (default 0.9) sets how many are kept: ``round((1 - sparsity) * out * in)``
        weights for unblocked formats, ``round((1 - sparsity) * blocks)`` whole blocks (at
        least one) for ``bsr``/``bsc``; ``nm(n,m)`` keeps n of every m consecutive inputs
        and implies ``sparsity = 1 - n/m`` (None, or that value).
        ``method="magnitude"`` keeps the largest ``|W|`` over the whole layer, the blocks of
        largest Frobenius norm, or the n largest ``|W|`` of each group (ties broken by
        torch.topk); ``"random"`` a uniformly random choice of the same units.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        fmt = check_weight_format(format)
        sparsity = resolve_sparsity(fmt, sparsity)
        method = _check_method(method)
        dense = linear.weight.detach()
        if dense.dtype not in FLOAT_DTYPES:
            raise TypeError(f"linear has dtype {dense.dtype}; SparseLinear supports float32, float64, bfloat16 and "
                            "float16")
        out_features, in_features = dense.shape
        problem = shape_problem(fmt, out_features, in_features)
        if problem is not None:
            raise ValueError(f"format {fmt} does not fit the (out_features, in_features) = "
                             f"{(out_features, in_features)} weight of linear: {problem}")
        magnitudes = dense.abs() if method == "magnitude" else None
        pattern = _kept_indices(fmt, (out_features, in_features), sparsity, magnitudes)
        layer = cls(in_features, out_features, bias=linear.bias is not None, format=fmt, pattern=pattern,
                    dtype=dense.dtype)
        with torch.no_grad():
            rows, cols = layer.weight.coords()[0]
            layer.weight_values.copy_(dense[rows, cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` computing the same function (zeros outside the pattern)."""
        dtype = self.weight_values.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def mask(self) -> Tensor:
        """Bool ``(out_features, in_features)`` tensor, True at stored positions."""
        mask = torch.zeros(self.out_features, self.in_features, dtype=torch.bool)
        rows, cols = self.weight.coords()[0]
        mask[rows, cols] = True
        return mask

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, sparsity={self.sparsity:.3f}, "
                f"nnz={self.nnz}, format={self.format}, bias={self.bias is not None}")

    # ------------------------------------------------------------------ state_dict
    def get_extra_state(self) -> dict[str, Any]:
        """The weight's format and shape, saved beside the pattern buffers. ``torch.onnx.export``
        reads the state dict before tracing: refused here (:func:`refuse_onnx_export`)."""
        refuse_onnx_export(self)
        return {"format": str(self.format), "shape": (self.out_features, self.in_features)}

    def set_extra_state(self, state: Any) -> None:
        """Checked and applied in ``_load_from_state_dict`` (the pattern must change with it)."""

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Adopt a whole saved pattern (its format and nnz may differ from this layer's),
        validated in full before anything is copied; then load values and bias as usual.
        A state dict holding part of the pattern (``strict=False`` with a buffer left out)
        is loaded as torch would, and the next forward raises naming the missing buffer."""
        pattern = self._weight_pattern
        errors = len(error_msgs)
        saved = pattern.saved_format(state_dict, prefix)
        if isinstance(saved, str):
            error_msgs.append(f"{prefix or 'SparseLinear'}: {saved}")
            return
        if saved is not None:
            try:
                check_weight_format(saved)
            except ValueError as exc:
                error_msgs.append(f"{prefix or 'SparseLinear'}: saved weight format is invalid: {exc}")
                return
        present, missing = pattern.split_keys(state_dict, prefix, saved)
        if saved is not None and not missing:
            problem = pattern.adopt(self, state_dict, prefix, saved)
            if problem is not None:
                error_msgs.append(f"{prefix or 'SparseLinear'}: {problem}")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if pattern.is_partial(present, missing):
            pattern.mark_unloaded(self, missing, present, saved)
        elif not missing and len(error_msgs) == errors:  # a whole pattern: a meta-built layer has one now
            self._pending_pattern = pattern.deferred = None
