"""SparseLinear: a linear layer whose weight is a fixed-pattern SparseTensor.

The pattern (the per-level ``pos``/``crd`` index arrays) lives in buffers, the stored
values in one ``nn.Parameter``; forward and backward are compiled sparse einsums.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sparsenn.compiler import einsum
from sparsenn.formats import Format, SparseTensor, parse_format

__all__ = ["SparseLinear", "check_sparsity", "check_weight_format", "kept_count"]

Method = Literal["magnitude", "random"]
_VALUE_DTYPES = (torch.float32, torch.float64)


def check_sparsity(sparsity: object, name: str = "sparsity") -> float:
    """``sparsity`` as a float in [0, 1); TypeError/ValueError otherwise."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(sparsity).__name__}")
    value = float(sparsity)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction of weights removed), got {sparsity}")
    return value


def _wraps(pattern: SparseTensor | None, fmt: Format, arrays: tuple[Tensor | None, ...]) -> bool:
    """Whether ``pattern`` is ``fmt`` over exactly these (unedited) index arrays."""
    if pattern is None or pattern.format != fmt:
        return False
    if any(a is not b for a, b in zip(pattern.pos + pattern.crd, arrays)):
        return False
    try:
        pattern.check_unmodified()
    except ValueError:
        return False
    return True


def check_weight_format(format: str | Format) -> Format:
    """Parse a rank-2 weight format; blocked and all-dense formats are rejected."""
    if not isinstance(format, (str, Format)):
        raise TypeError(f"format must be a format name such as 'csr', got {type(format).__name__}")
    try:
        fmt = parse_format(format, 2)
    except ValueError as exc:
        raise ValueError(f"unknown weight format {format!r}: {exc}") from None
    if fmt.block is not None:
        raise ValueError(f"weight format {format!r} is blocked; sparse weights need an unblocked format "
                         "(gradients through blocked operands are not supported): use 'csr', 'csc', 'coo', "
                         "'dcsr' or 'dcsc'")
    if fmt.is_dense:
        raise ValueError(f"weight format {format!r} is dense; use nn.Linear for a dense weight")
    return fmt


def kept_count(numel: int, sparsity: float) -> int:
    """Entries kept out of ``numel`` at ``sparsity``: ``round((1 - sparsity) * numel)``."""
    return round((1.0 - sparsity) * numel)


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
        bias: learn an additive bias.
        sparsity: fraction of weights removed for ``pattern="random"`` (default 0.9); must
            be None for a given pattern, whose size fixes the sparsity.
        format: storage format of the weight (``"csr"``, ``"csc"``, ``"coo"``, ``"dcsr"``,
            ``"dcsc"`` or level letters); blocked and dense formats are rejected.
        pattern: ``"random"`` (a uniformly random set of ``round((1 - sparsity) * out * in)``
            positions, drawn from torch's global RNG), a bool mask of shape ``(out, in)`` or a
            ``(2, nnz)`` integer tensor of ``(output, input)`` coordinates without duplicates.
        dtype: float32 or float64 (default: torch's default dtype).

    Values are initialised like ``nn.Linear`` for the kept fan-in: uniform in
    :math:`\pm 1/\sqrt{f}` with :math:`f = \mathrm{nnz} / \mathrm{out}`, the mean number of
    inputs each output keeps; the bias uses the same bound.

    Inputs: a dense tensor ``(..., in_features)`` (leading dims flattened and restored), or a
    rank-2 SparseTensor ``(batch, in_features)`` (sparse activations); the output is always a
    dense tensor ``(..., out_features)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, sparsity: float | None = None,
                 format: str | Format = "csr", pattern: str | Tensor = "random",
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = _check_features("in_features", in_features)
        self.out_features = _check_features("out_features", out_features)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _VALUE_DTYPES:
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        fmt = check_weight_format(format)
        shape = (self.out_features, self.in_features)
        if isinstance(pattern, str):
            if pattern != "random":
                raise ValueError(f"pattern must be 'random', a bool mask or a (2, nnz) index tensor, got {pattern!r}")
            keep = kept_count(math.prod(shape), check_sparsity(0.9 if sparsity is None else sparsity))
            chosen = torch.randperm(math.prod(shape))[:keep]
            indices = torch.stack([chosen // self.in_features, chosen % self.in_features])
        else:
            if sparsity is not None:
                raise ValueError("sparsity must be None when a pattern is given (the pattern fixes the sparsity)")
            indices = _pattern_indices(pattern, shape)
        try:
            tensor = SparseTensor.from_coo(indices, torch.zeros(indices.shape[1], dtype=dtype), shape, fmt,
                                           duplicates="error")
        except ValueError as exc:
            raise ValueError(f"invalid pattern: {exc}") from None
        if tensor.nnz != indices.shape[1]:
            raise ValueError(f"format {fmt} stores {tensor.nnz} positions for a pattern of {indices.shape[1]} "
                             "entries (a dense level below a sparse one stores explicit zeros); use 'csr', 'csc', "
                             "'coo', 'dcsr' or 'dcsc'")
        self.weight_values = nn.Parameter(tensor.values)
        self._set_pattern(tensor.format, tensor.pos, tensor.crd)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # ------------------------------------------------------------------ pattern storage
    def _set_pattern(self, fmt: Format, pos: tuple[Tensor | None, ...], crd: tuple[Tensor | None, ...]) -> None:
        """Store ``fmt`` and register its index arrays as buffers (replacing earlier ones)."""
        for name in getattr(self, "_pattern_names", ()):
            delattr(self, name)
        names = []
        for kind, arrays in (("pos", pos), ("crd", crd)):
            for level, array in enumerate(arrays):
                if array is not None:
                    name = f"weight_{kind}{level}"
                    self.register_buffer(name, array)
                    names.append(name)
        self._format = fmt
        self._pattern_names = tuple(names)

    def _arrays(self, kind: str) -> tuple[Tensor | None, ...]:
        return tuple(self._buffers.get(f"weight_{kind}{level}") for level in range(len(self._format.levels)))

    @property
    def format(self) -> Format:
        """Storage format of the weight."""
        return self._format

    @property
    def weight(self) -> SparseTensor:
        """The ``(out_features, in_features)`` weight; its ``values`` are ``weight_values``.

        The pattern is wrapped once and reused while the buffers are the same, unedited
        tensors (``load_state_dict`` and ``.to()`` edit or replace them)."""
        pos, crd = self._arrays("pos"), self._arrays("crd")
        pattern = self.__dict__.get("_pattern")
        if not _wraps(pattern, self._format, pos + crd):
            pattern = SparseTensor((self.out_features, self.in_features), self._format, pos, crd,
                                   self.weight_values.detach(), check=False)
            self.__dict__["_pattern"] = pattern
        return pattern.with_values(self.weight_values)

    @property
    def nnz(self) -> int:
        """Number of stored weights."""
        return self.weight_values.numel()

    @property
    def sparsity(self) -> float:
        """Fraction of the dense weight's entries that are not stored."""
        return 1.0 - self.nnz / (self.in_features * self.out_features)

    def reset_parameters(self) -> None:
        """Uniform init in ±1/sqrt(kept fan-in) for the values and the bias (pattern kept)."""
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
        dtype = self.weight_values.dtype
        if isinstance(x, SparseTensor):
            if x.ndim != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"sparse input must have shape (batch, {self.in_features}), got {x.shape}")
            if x.dtype != dtype:
                raise TypeError(f"input has dtype {x.dtype} but the weight has {dtype}; convert one of them")
            # Dense whatever the formats: a product of two sparse operands is sparse.
            out = einsum("bi,oi->bo", x, self.weight, out_format="dense")
        elif isinstance(x, Tensor):
            if x.dim() == 0 or x.shape[-1] != self.in_features:
                raise ValueError(f"input must have shape (..., {self.in_features}), got {tuple(x.shape)}")
            if x.dtype != dtype:
                raise TypeError(f"input has dtype {x.dtype} but the weight has {dtype}; convert one of them")
            flat = x.reshape(-1, self.in_features)
            # Dense whatever the weight's format: one that stores o in a compressed level
            # (csc, coo, dcsr, dcsc) makes the product sparse in o.
            out = einsum("bi,oi->bo", flat, self.weight, out_format="dense").reshape(*x.shape[:-1], self.out_features)
        else:
            raise TypeError(f"input must be a torch.Tensor or a SparseTensor, got {type(x).__name__}")
        return out if self.bias is None else out + self.bias

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_dense(cls, linear: nn.Linear, sparsity: float = 0.9, method: Method = "magnitude",
                   format: str | Format = "csr") -> SparseLinear:
        """A SparseLinear keeping ``round((1 - sparsity) * out * in)`` weights of ``linear``.

        ``method="magnitude"`` keeps the largest ``|W|`` over the whole layer (ties broken
        by torch.topk), ``"random"`` a uniformly random subset; the kept values and the
        bias are copied.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        sparsity = check_sparsity(sparsity)
        method = _check_method(method)
        dense = linear.weight.detach()
        if dense.dtype not in _VALUE_DTYPES:
            raise TypeError(f"linear has dtype {dense.dtype}; SparseLinear supports float32 and float64")
        out_features, in_features = dense.shape
        keep = kept_count(dense.numel(), sparsity)
        if method == "magnitude":
            chosen = torch.topk(dense.abs().reshape(-1), keep, sorted=False).indices
        else:
            chosen = torch.randperm(dense.numel())[:keep]
        pattern = torch.stack([chosen // in_features, chosen % in_features])
        layer = cls(in_features, out_features, bias=linear.bias is not None, format=format, pattern=pattern,
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
                f"nnz={self.nnz}, format={self._format}, bias={self.bias is not None}")

    # ------------------------------------------------------------------ state_dict
    def get_extra_state(self) -> dict[str, Any]:
        """The weight's format and shape, saved beside the pattern buffers."""
        return {"format": str(self._format), "shape": (self.out_features, self.in_features)}

    def set_extra_state(self, state: Any) -> None:
        """Checked and applied in ``_load_from_state_dict`` (the pattern must change with it)."""

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Adopt the saved pattern (its format and nnz may differ from this layer's), validated
        in full before anything is copied; then load values and bias as usual."""
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, Mapping) and "format" in extra:
            problem = self._adopt_pattern(extra, state_dict, prefix)
            if problem is not None:
                error_msgs.append(f"{prefix or 'SparseLinear'}: {problem}")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _adopt_pattern(self, extra: Mapping[str, Any], state_dict: Mapping[str, Any], prefix: str) -> str | None:
        """Re-register pattern buffers (and resize ``weight_values``) to the saved ones.

        Returns a description of what is wrong, or None. Leaves the layer unchanged when
        keys are missing (the usual missing-key report follows)."""
        shape = (self.out_features, self.in_features)
        if tuple(extra.get("shape", ())) != shape:
            return f"saved weight shape {tuple(extra.get('shape', ()))} differs from this layer's {shape}"
        try:
            fmt = parse_format(extra["format"], 2)
        except ValueError as exc:
            return f"saved weight format is invalid: {exc}"
        arrays: dict[str, Tensor] = {}
        for kind in ("pos", "crd"):
            for level, lvl in enumerate(fmt.levels):
                needed = lvl.has_pos if kind == "pos" else lvl.has_crd
                key = f"{prefix}weight_{kind}{level}"
                if needed:
                    if key not in state_dict:
                        return None
                    arrays[f"weight_{kind}{level}"] = state_dict[key]
        values = state_dict.get(prefix + "weight_values")
        if values is None:
            return None
        pos = tuple(arrays.get(f"weight_pos{level}") for level in range(len(fmt.levels)))
        crd = tuple(arrays.get(f"weight_crd{level}") for level in range(len(fmt.levels)))
        try:
            check_weight_format(fmt)
            SparseTensor(shape, fmt, pos, crd, values.detach(), check=True)
        except (TypeError, ValueError) as exc:
            return f"saved weight pattern is invalid: {exc}"
        self._set_pattern(fmt, tuple(None if p is None else torch.empty_like(p) for p in pos),
                          tuple(None if c is None else torch.empty_like(c) for c in crd))
        if self.weight_values.shape != values.shape:
            self.weight_values.data = self.weight_values.new_empty(values.shape)
        return None
