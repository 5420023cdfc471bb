r"""SparseMoEGate and SparseMoE: a top-k mixture of experts as compiled sparse einsums.

The gate is a sparse (tokens × experts) matrix ``G`` with at most ``k`` entries per row;
the layer computes only where ``G[t, e] != 0``:

.. math::
    y_t = \sum_e G_{te} \, f(x_t W^1_e + b^1_e) \, W^2_e + G_{te} \, b^2_e

Tokens are grouped by expert into padded panels ``(E, C, ·)`` (``C``: the most tokens any
expert received): slot ``c < n_e`` of expert ``e`` holds its ``c``-th token, in token
order. With ``R`` the ``E × C`` CSR matrix of occupied slots, ``S`` the ``(E·C) × T``
one-hot gather of tokens into slots and ``K`` the ``T × (E·C)`` combine matrix (``G``'s
values at the slots), the forward pass is four compiled kernels::

    X[s,d]   = S[s,t] x[t,d]                      gather tokens into panels
    A[e,c,h] = f(R[e,c] X[e,c,d] W1[e,d,h] + b1)  per expert, over its occupied slots
    Z[e,c,d] = R[e,c] A[e,c,h] W2[e,h,d]
    y[t,d]   = K[t,s] Z[s,d]  (+ G[t,e] b2[e,d])  weighted scatter back to tokens

``f`` is the first product's epilogue (under autograd the compiler keeps the product,
which ``f``'s derivative reads, and applies ``f`` as a kernel of its own). Each expert
product is one kernel or a contraction path, as the planner costs them (``explain()``
shows which): with many tokens per expert, a register tile over the slots stored in
``R``'s row ``e`` against the expert's weights packed per thread (unoccupied slots are
never read); with few, ``R ⊙ X`` and then BLAS's batched GEMM over the panels. Experts
without tokens cost nothing, and there is no Python loop over experts. Gradients are
the compiler's (dense gradients of dense weights: an expert without tokens gets zeros,
not None); ``dX = dH W1ᵀ`` and ``dA = dZ W2ᵀ`` pack the weights across their layout,
and the weight gradients pack ``dH`` / ``dZ`` at each expert's stored slots when they
are few enough (else BLAS). The routing's index work whose sizes depend on the routing (``C``, the
choices a capacity limit keeps) is custom ops (:mod:`.routing`), so ``torch.compile``
traces the layer whole, ``C`` an unbacked symbolic size.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from sparsenn.compiler import compile_expression, einsum, explain
from sparsenn.compiler.runtime.autocast import autocast_dtype
from sparsenn.formats import SparseTensor, parse_format
from sparsenn.layers.conventions import factory_kwargs, refuse_onnx_export, refuse_torchscript

from .routing import dispatch_arrays, kept_choices, occurrences

__all__ = ["GateOutput", "Dispatch", "SparseMoEGate", "SparseMoE", "dispatch", "capacity"]

Noise = Literal["none", "jitter", "gumbel"]
NOISES = ("none", "jitter", "gumbel")
JITTER = 1e-2
ACTIVATIONS = ("gelu", "relu", "silu")  # functions of the compiler's index notation
CSR = parse_format("csr", 2)


class GateOutput(NamedTuple):
    """What :class:`SparseMoEGate` returns.

    ``gates``: ``T × E`` CSR, at most ``k`` experts per token (sorted), values the routing
    weights (differentiable w.r.t. the router). ``aux_loss``: ``E Σᵢ fᵢ Pᵢ`` with ``fᵢ`` the
    fraction of the ``T·k`` routing choices that picked expert ``i`` (before capacity
    dropping; 1 at perfect balance) and ``Pᵢ`` the mean full-softmax probability of
    ``i``. ``z_loss``: ``mean_t (logsumexp_e logits[t, e])²``. ``dropped``: the number of
    routing choices removed by the capacity limit (an int64 scalar tensor).
    """

    gates: SparseTensor
    aux_loss: Tensor
    z_loss: Tensor
    dropped: Tensor


@dataclass(frozen=True)
class Dispatch:
    """Index structures moving tokens into expert panels and back (see module doc).

    ``slots``: ``E × C`` CSR of occupied slots (values 1); ``gather``: ``(E·C) × T``
    CSR with one token per occupied slot (values 1); ``combine``: ``T × (E·C)`` CSR
    with the gate's values at each token's slots; ``capacity``: ``C``.
    """

    slots: SparseTensor
    gather: SparseTensor
    combine: SparseTensor
    capacity: int


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _check_input(x: object, d_model: int, dtype: torch.dtype) -> Tensor:
    """``x`` as ``(T, d_model)`` tokens; TypeError/ValueError naming the problem."""
    if not isinstance(x, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if autocast_dtype(x.dtype) != autocast_dtype(dtype):
        raise TypeError(f"input has dtype {x.dtype}, the layer's parameters {dtype}")
    if x.dim() < 1 or x.shape[-1] != d_model:
        raise ValueError(f"input must have shape (..., d_model={d_model}), got {tuple(x.shape)}")
    return x.reshape(-1, d_model)


def capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert under a capacity factor: ``ceil(T / E · cf · k)``."""
    return math.ceil(tokens / num_experts * capacity_factor * k)


def _keep_within_capacity(experts: Tensor, probs: Tensor, num_experts: int, limit: int) -> Tensor:
    """Mask of the routing choices kept when each expert takes at most ``limit``: those
    of highest probability (ties: lower token first)."""
    by_prob = torch.sort(probs, descending=True, stable=True).indices
    order = by_prob[torch.sort(experts[by_prob], stable=True).indices]
    sorted_experts = experts[order]
    counts = occurrences(sorted_experts, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(experts.numel()) - starts[sorted_experts]
    keep = torch.empty_like(experts, dtype=torch.bool)
    keep[order] = rank < limit
    return keep


# The first expert product with the activation as its epilogue: f applied to each
# panel slice of H once its sums are complete (and the bias added), in the same kernel.
_HIDDEN = {name: compile_expression(f"A[e,c,h] = {name}(R[e,c] * X[e,c,d] * W[e,d,h])", out_format="dense")
           for name in ACTIVATIONS}
_HIDDEN_BIASED = {name: compile_expression(f"A[e,c,h] = {name}(R[e,c] * X[e,c,d] * W[e,d,h] + b[e,h])",
                                           out_format="dense") for name in ACTIVATIONS}

def dispatch(gates: SparseTensor) -> Dispatch:
    """The expert-major panels of a ``T × E`` CSR gate (see module doc); O(T·k) index work."""
    if not isinstance(gates, SparseTensor):
        raise TypeError(f"gates must be a SparseTensor, got {type(gates).__name__}")
    if gates.ndim != 2 or gates.format != CSR:
        raise ValueError(f"gates must be a T × E csr SparseTensor, got {gates.format} of shape {gates.shape}")
    tokens, experts = gates.shape
    wide = gates.index_dtype == torch.int64 or max(experts * tokens, tokens) >= 2**31
    slot_pos, slot_crd, gather_pos, gather_crd, combine_crd, cap = dispatch_arrays(gates.pos[1], gates.crd[1],
                                                                                    experts, wide)
    ones = gates.values.new_ones(slot_crd.shape[0]).detach()
    return Dispatch(
        slots=SparseTensor((experts, cap), CSR, (None, slot_pos), (None, slot_crd), ones, check=False),
        gather=SparseTensor((experts * cap, tokens), CSR, (None, gather_pos), (None, gather_crd), ones, check=False),
        combine=SparseTensor((tokens, experts * cap), CSR, (None, gates.pos[1].to(slot_pos.dtype)),
                             (None, combine_crd), gates.values, check=False),
        capacity=cap)


class SparseMoEGate(nn.Module):
    r"""Top-k router: ``logits = x Wᵀ``, ``p = softmax(logits)``, each token's ``k`` most
    probable experts with weights ``p[t, e]`` (divided by their sum over the chosen ``k``
    when ``normalize``).

    ``noise`` (training mode only): ``"jitter"`` multiplies the input by
    ``U(1 - 10⁻², 1 + 10⁻²)`` (Switch); ``"gumbel"`` picks the experts by
    ``logits + Gumbel(0, 1)`` while the weights stay ``p``. ``capacity_factor=None``
    drops nothing; a factor limits each expert to ``ceil(T/E · cf · k)`` choices and
    drops the others, lowest probability first (weights are normalised before dropping).
    ``device``, ``dtype``: of the router, as ``nn.Linear`` takes them. Returns a
    :class:`GateOutput`.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, d_model: int, num_experts: int, *, k: int = 2, noise: Noise = "none",
                 capacity_factor: float | None = None, normalize: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.d_model = _check_int("d_model", d_model, 1)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        self.k = _check_int("k", k, 1)
        if self.k > self.num_experts:
            raise ValueError(f"k = {k} exceeds num_experts = {num_experts}")
        if noise not in NOISES:
            raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
        if capacity_factor is not None:
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
                raise TypeError(f"capacity_factor must be a number or None, got {type(capacity_factor).__name__}")
            if not capacity_factor > 0:
                raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        kwargs = factory_kwargs(device, dtype)
        self.noise, self.capacity_factor, self.normalize = noise, capacity_factor, bool(normalize)
        self.router = nn.Linear(self.d_model, self.num_experts, bias=False, **kwargs)

    def reset_parameters(self) -> None:
        """The router's ``nn.Linear`` initialisation."""
        self.router.reset_parameters()

    def forward(self, x: Tensor) -> GateOutput:
        tokens = _check_input(x, self.d_model, self.router.weight.dtype)
        if self.training and self.noise == "jitter":
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - JITTER, 1.0 + JITTER)
        logits = self.router(tokens)
        probs = logits.softmax(-1)
        scores = probs
        if self.training and self.noise == "gumbel":
            scores = logits.detach() - torch.empty_like(logits).exponential_().log()
        chosen = torch.topk(scores, self.k, dim=-1).indices.sort(-1).values
        weights = probs.gather(1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        num_tokens, experts = tokens.shape[0], chosen.reshape(-1)
        count = max(num_tokens, 1)  # no tokens: both losses 0
        fraction = occurrences(experts, self.num_experts).to(probs.dtype) / (count * self.k)
        aux_loss = self.num_experts * (fraction * probs.sum(0) / count).sum()
        z_loss = torch.logsumexp(logits, -1).square().sum() / count
        index = torch.int32 if max(num_tokens, self.num_experts) * self.k < 2**31 else torch.int64
        values = weights.reshape(-1)
        if self.capacity_factor is None:
            pos = torch.arange(0, num_tokens * self.k + 1, self.k, dtype=index)
            dropped = torch.zeros((), dtype=torch.int64)
        else:
            limit = capacity(num_tokens, self.num_experts, self.k, self.capacity_factor)
            keep = _keep_within_capacity(experts, probs.detach().gather(1, chosen).reshape(-1),
                                         self.num_experts, limit)
            counts = keep.view(num_tokens, self.k).sum(-1)
            pos = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(index)
            kept = kept_choices(keep)
            experts, values, dropped = experts[kept], values[kept], (~keep).sum()
        gates = SparseTensor((num_tokens, self.num_experts), CSR, (None, pos), (None, experts.to(index)), values,
                             check=False)
        return GateOutput(gates, aux_loss, z_loss, dropped)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, noise={self.noise!r}, "
                f"capacity_factor={self.capacity_factor}, normalize={self.normalize}")


class SparseMoE(nn.Module):
    r"""Mixture of ``num_experts`` two-layer FFN experts, ``k`` per token (see module doc).

    ``y_t = Σ_e G[t,e] (f(x_t W1[e] + b1[e]) W2[e] + b2[e])`` with ``W1: (E, d_model,
    d_hidden)``, ``W2: (E, d_hidden, d_model)``, ``G`` from ``gate`` (a
    :class:`SparseMoEGate`, default top-``k`` dropless). ``activation``: "gelu", "relu" or
    "silu". Input ``(..., d_model)``, output of the same shape; after each forward,
    ``aux_loss``, ``z_loss`` and ``dropped`` hold the gate's :class:`GateOutput` fields.
    Under DDP every expert weight gets a gradient (zeros for experts without tokens), so
    ``find_unused_parameters`` is not needed. ``device``, ``dtype``: of the parameters (and
    of the default gate), as ``nn.Linear`` takes them.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, k: int = 2, activation: str = "gelu",
                 gate: SparseMoEGate | None = None, bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.d_model = _check_int("d_model", d_model, 1)
        self.d_hidden = _check_int("d_hidden", d_hidden, 1)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        kwargs = factory_kwargs(device, dtype)
        if gate is None:
            gate = SparseMoEGate(d_model, num_experts, k=k, **kwargs)
        elif not isinstance(gate, SparseMoEGate):
            raise TypeError(f"gate must be a SparseMoEGate or None, got {type(gate).__name__}")
        elif (gate.d_model, gate.num_experts, gate.k) != (self.d_model, self.num_experts, k):
            raise ValueError(f"gate has (d_model, num_experts, k) = {(gate.d_model, gate.num_experts, gate.k)}, "
                             f"the layer {(self.d_model, self.num_experts, k)}")
        self.k, self.activation, self.gate = gate.k, activation, gate
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden, **kwargs))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model, **kwargs))
        self.b1 = nn.Parameter(torch.empty(num_experts, d_hidden, **kwargs)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model, **kwargs)) if bias else None
        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.dropped: Tensor | None = None
        self._reset_experts()  # a given gate keeps its weights

    def reset_parameters(self) -> None:
        """The experts' parameters (:meth:`_reset_experts`) and the gate's
        (:meth:`SparseMoEGate.reset_parameters`)."""
        self._reset_experts()
        self.gate.reset_parameters()

    def _reset_experts(self) -> None:
        """Each expert's weights as ``nn.Linear``'s, ``U(-1/√fan_in, 1/√fan_in)``; zero biases."""
        nn.init.uniform_(self.w1, -self.d_model ** -0.5, self.d_model ** -0.5)
        nn.init.uniform_(self.w2, -self.d_hidden ** -0.5, self.d_hidden ** -0.5)
        for bias in (self.b1, self.b2):
            if bias is not None:
                nn.init.zeros_(bias)

    def experts(self, x: Tensor, gates: SparseTensor) -> Tensor:
        """``Σ_e gates[t,e] FFN_e(x_t)`` for tokens ``x`` ``(T, d_model)`` and a ``T × E`` csr gate."""
        if gates.shape != (x.shape[0], self.num_experts):
            raise ValueError(f"gates must have shape (T, E) = {(x.shape[0], self.num_experts)}, got {gates.shape}")
        plan = dispatch(gates)
        panels = einsum("st,td->sd", plan.gather, x).view(self.num_experts, plan.capacity, self.d_model)
        if self.b1 is None:
            act = _HIDDEN[self.activation](plan.slots, panels, self.w1)
        else:
            act = _HIDDEN_BIASED[self.activation](plan.slots, panels, self.w1, self.b1)
        out = einsum("ec,ech,ehd->ecd", plan.slots, act, self.w2, out_format="dense")
        y = einsum("ts,sd->td", plan.combine, out.view(-1, self.d_model))
        if self.b2 is not None:
            y = y + einsum("te,ed->td", gates, self.b2)
        return y

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_tracing():
            refuse_onnx_export(self)
            raise RuntimeError("torch.jit.trace cannot record SparseMoE: the routing decides the sizes of the expert "
                               "panels, which a trace would fix to the example's; torch.compile traces them")
        routed = self.gate(x)
        self.aux_loss, self.z_loss, self.dropped = routed.aux_loss, routed.z_loss, routed.dropped
        return self.experts(x.reshape(-1, self.d_model), routed.gates).view(x.shape)

    def explain(self, x: Tensor) -> str:
        """The compiler's schedules of the two expert products for input ``x`` (as
        inference runs them)."""
        with torch.no_grad():
            tokens = _check_input(x, self.d_model, self.w1.dtype)
            plan = dispatch(self.gate(tokens).gates)
            panels = torch.zeros(self.num_experts, plan.capacity, self.d_model, dtype=x.dtype)
            hidden = torch.zeros(self.num_experts, plan.capacity, self.d_hidden, dtype=x.dtype)
            first = (_HIDDEN[self.activation].explain(plan.slots, panels, self.w1) if self.b1 is None
                     else _HIDDEN_BIASED[self.activation].explain(plan.slots, panels, self.w1, self.b1))
            return "\n".join([first, explain("ec,ech,ehd->ecd", plan.slots, hidden, self.w2, out_format="dense")])

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_hidden={self.d_hidden}, num_experts={self.num_experts}, k={self.k}, "
                f"activation={self.activation!r}, bias={self.b1 is not None}")
