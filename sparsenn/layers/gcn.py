"""SparseGCNConv: the graph convolution of Kipf & Welling with PyG's conventions,
propagated through a compiled sparse-times-dense einsum."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from sparsenn.compiler import compile_expression, einsum
from sparsenn.compiler.runtime.autocast import autocast_dtype
from sparsenn.compiler.runtime.tracing import transforming
from sparsenn.formats import SparseTensor, parse_format
from sparsenn.layers.conventions import factory_kwargs, refuse_torchscript

__all__ = ["SparseGCNConv", "gcn_norm"]

_PROPAGATE = compile_expression("Y[t,o] = A[t,s] * H[s,o] + bias[o]", out_format="dense")

_CSR = parse_format("csr", 2)  # parsed here: traced code must not build formats


def gcn_norm(edge_index: Tensor, edge_weight: Tensor | None, num_nodes: int, improved: bool = False,
             add_self_loops: bool = True, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    r"""Symmetric GCN normalisation of a graph given as ``(source, target)`` edges.

    .. math::
        \hat{A} = \hat{D}^{-1/2} (A + f I) \hat{D}^{-1/2}, \qquad
        \hat{D}_{tt} = \sum_s (A + f I)_{st}

    with :math:`f = 2` when ``improved`` else 1. As in PyG, ``add_self_loops`` adds a loop
    of weight ``f`` to every node that has none; a node's existing self-loop keeps its
    weight. Degrees are summed on the target side, and nodes of degree 0 get 0, not inf.
    Returns ``(edge_index, weight)`` with edge ``e`` weighted
    ``deg(s)^{-1/2} w_e deg(t)^{-1/2}``; the weights stay differentiable with respect to
    ``edge_weight``.
    """
    source, target = edge_index[0], edge_index[1]
    weight = torch.ones(source.shape[0], dtype=dtype) if edge_weight is None else edge_weight
    if add_self_loops:
        is_loop = source == target
        loop_weight = torch.full((num_nodes,), 2.0 if improved else 1.0, dtype=weight.dtype)
        loop_weight = loop_weight.index_put((source[is_loop],), weight[is_loop])
        nodes = torch.arange(num_nodes, dtype=source.dtype)
        keep = ~is_loop
        source, target = torch.cat([source[keep], nodes]), torch.cat([target[keep], nodes])
        weight = torch.cat([weight[keep], loop_weight])
    degree = weight.new_zeros(num_nodes).index_add(0, target, weight)
    inv_sqrt = degree.pow(-0.5)
    inv_sqrt = inv_sqrt.masked_fill(torch.isinf(inv_sqrt), 0.0)
    return torch.stack([source, target]), inv_sqrt[source] * weight * inv_sqrt[target]


def _adjacency(source: Tensor, target: Tensor, weight: Tensor | None, num_nodes: int, improved: bool,
               add_self_loops: bool, normalize: bool, dtype: torch.dtype) -> SparseTensor:
    """The CSR propagation matrix ``Â[target, source]`` of validated edges."""
    edges = torch.stack([source, target])
    if normalize:
        edges, weight = gcn_norm(edges, weight, num_nodes, improved, add_self_loops, dtype)
    elif weight is None:
        weight = torch.ones(edges.shape[1], dtype=dtype)
    return SparseTensor.from_coo(edges.flip(0), weight, (num_nodes, num_nodes), format="csr",
                                 index_dtype=_adjacency_index_dtype(edges.shape[1], num_nodes))


def _adjacency_index_dtype(num_edges: int, num_nodes: int) -> torch.dtype:
    """int32 unless the nodes or the stored entries (at most the edges plus a self-loop
    per node) could reach 2**31: known before the entries are."""
    return torch.int32 if num_edges + 2 * num_nodes < 2**31 - 1 else torch.int64


@torch.library.custom_op("sparsenn::gcn_adjacency", mutates_args=())
def _adjacency_op(edge_index: Tensor, edge_weight: Tensor | None, num_nodes: int, improved: bool,
                  add_self_loops: bool, normalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(pos, crd, values)`` of :func:`_adjacency` for a traced :class:`SparseGCNConv`."""
    source, target, weight = SparseGCNConv._edges(edge_index, edge_weight, num_nodes, dtype)
    adjacency = _adjacency(source, target, weight, num_nodes, improved, add_self_loops, normalize, dtype)
    return adjacency.pos[1].clone(), adjacency.crd[1].clone(), adjacency.values.clone()


@_adjacency_op.register_fake
def _(edge_index: Tensor, edge_weight: Tensor | None, num_nodes: int, improved: bool, add_self_loops: bool,
      normalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    stored = torch.library.get_ctx().new_dynamic_size()
    index = _adjacency_index_dtype(edge_index.shape[1], num_nodes)
    return (edge_index.new_empty(num_nodes + 1, dtype=index), edge_index.new_empty(stored, dtype=index),
            edge_index.new_empty(stored, dtype=dtype))


def _input_major(weight: Tensor) -> Tensor:
    """``weight`` ``(out, in)`` with its memory input-major (``Wᵀ`` contiguous, strides
    ``(1, out)``): the layout in which ``X Wᵀ`` over sparse ``X`` reads it, a row of
    ``Wᵀ`` per stored feature, so the planner reads it in place (a weight stored
    output-major is re-laid out, and the copy checked against it on every call)."""
    return weight.t().contiguous().t()


class SparseGCNConv(nn.Module):
    r"""Graph convolution (Kipf & Welling, ICLR 2017) with PyG's ``GCNConv`` conventions.

    .. math::
        X' = \hat{D}^{-1/2} \hat{A} \hat{D}^{-1/2} X W^\top + b, \qquad
        \hat{A} = A + I \ (A + 2I \text{ if improved})

    Messages flow from source to target: ``out[t] = sum_s Â[t, s] (X W^T)[s] + b`` over
    edges ``(s, t)`` of ``edge_index`` (row 0 sources, row 1 targets), with edge weights
    ``edge_weight`` (default 1). The normalised adjacency is built once per call as a CSR
    :class:`~sparsenn.SparseTensor` indexed ``[target, source]`` (once per layer when
    ``cached=True``). The product runs as ``Â (X Wᵀ)`` when ``out_channels <= in_channels``
    or ``X`` is sparse, else as ``(Â X) Wᵀ``, so the sparse-times-dense einsum runs on the
    narrower of the two dense matrices; a dense ``X`` times ``Wᵀ`` is the dense GEMM
    ``F.linear``: einsum's all-dense path would hand it to torch too, and torch's own GEMM
    backward is faster than einsum's. The weight ``(out_channels, in_channels)`` is stored
    input-major (``weight.t()`` contiguous), the layout in which ``X Wᵀ`` over sparse ``X``
    reads it: a row of ``Wᵀ`` per stored feature, read in place (BLAS takes either).

    Args:
        in_channels, out_channels: feature sizes; ``in_channels=-1`` (as in PyG) leaves the
            weight uninitialised (``nn.parameter.UninitializedParameter``) until the first
            forward sets ``in_channels`` from ``x`` and initialises it; run one forward
            before building the optimizer. Every later argument is keyword-only.
        improved: self-loop weight 2 instead of 1.
        cached: normalise on the first call and reuse that adjacency afterwards (for a
            fixed graph, transductive learning); :meth:`reset_cache` forgets it, and so
            does moving the layer (``.to()``, ``.double()``, ``to_empty``): the next call
            normalises again, in the parameters' dtype.
        add_self_loops: add self-loops before normalising (default: ``normalize``).
        normalize: apply the symmetric normalisation; when False the adjacency is used as
            given and self-loops cannot be added.
        bias: learn an additive bias.
        device, dtype: of the parameters, as ``nn.Linear`` takes them (``"cpu"`` or
            ``"meta"``; float32, float64, bfloat16 or float16; defaults: torch's).

    ``forward(x, edge_index, edge_weight=None)``: ``x`` is a dense ``(N, in_channels)``
    tensor or a SparseTensor (sparse features such as bag-of-words: ``X Wᵀ`` is then a
    sparse-times-dense product too). The graph is one of

    * an ``edge_index`` ``(2, E)`` integer tensor, with optional ``edge_weight`` ``(E,)``;
    * PyG's ``adj_t``: a torch ``sparse_csr`` or ``sparse_coo`` ``(N, N)`` tensor holding
      the *transposed* adjacency ``adj_t[target, source]`` (what
      ``torch_geometric.transforms.ToSparseTensor`` produces), values the edge weights;
    * an ``(N, N)`` SparseTensor adjacency ``A[source, target]`` (as built by
      ``sparsenn.from_edge_index``), values the edge weights.

    Self-loops are added as for ``edge_index`` in every case: a node's existing loop keeps
    its weight (PyG's ``adj_t`` path instead adds the fill value to it, so the two differ
    on graphs with self-loops). Gradients flow to ``x``, the parameters, and
    ``edge_weight`` (or the adjacency's values) when they require grad.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(self, in_channels: int, out_channels: int, *, improved: bool = False, cached: bool = False,
                 add_self_loops: bool | None = None, normalize: bool = True, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0 and not (name == "in_channels" and value == -1):
                raise ValueError(f"{name} must be positive{' or -1 (lazy)' if name == 'in_channels' else ''}, "
                                 f"got {value}")
        for name, flag in (("improved", improved), ("cached", cached), ("add_self_loops", add_self_loops),
                           ("normalize", normalize), ("bias", bias)):
            if not isinstance(flag, bool) and not (name == "add_self_loops" and flag is None):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ValueError("add_self_loops=True needs normalize=True (self-loops are added during normalisation)")
        kwargs = factory_kwargs(device, dtype)
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.improved, self.cached = bool(improved), bool(cached)
        self.add_self_loops, self.normalize = bool(add_self_loops), bool(normalize)
        if self.in_channels == -1:
            self.weight = nn.parameter.UninitializedParameter(**kwargs)
        else:
            self.weight = nn.Parameter(_input_major(torch.empty(self.out_channels, self.in_channels, **kwargs)))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_channels, **kwargs))
        else:
            self.register_parameter("bias", None)
        self._cached_adjacency: SparseTensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weight (once initialised) and zero bias (as PyG), and forget the
        cached adjacency."""
        if not is_lazy(self.weight):
            nn.init.xavier_uniform_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Forget the normalised adjacency cached by ``cached=True``."""
        self._cached_adjacency = None

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to()``, ``.double()``, ``to_empty``, ...), forgetting the
        cached adjacency, which ``fn`` would make stale (another dtype) or garbage (``to_empty``)."""
        self.reset_cache()
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, improved={self.improved}, cached={self.cached}, "
                f"add_self_loops={self.add_self_loops}, normalize={self.normalize}, bias={self.bias is not None}")

    def forward(self, x: Tensor | SparseTensor, edge_index: Tensor | SparseTensor,
                edge_weight: Tensor | None = None) -> Tensor:
        """``Â X Wᵀ + b`` with ``Â`` the (normalised) adjacency of the graph; see the class docstring."""
        num_nodes = self.checked_features(x)
        adjacency = self.adjacency(edge_index, edge_weight, num_nodes, self.weight.dtype)
        if isinstance(x, SparseTensor):
            # X Wᵀ dense whatever X's format (one storing s compressed would make it sparse).
            return self._propagate(adjacency, einsum("si,oi->so", x, self.weight, out_format="dense"))
        if self.out_channels <= self.in_channels:
            return self._propagate(adjacency, F.linear(x, self.weight))
        return F.linear(einsum("ts,si->ti", adjacency, x), self.weight, self.bias)

    def checked_features(self, x: object) -> int:
        """The number of nodes of valid features ``x`` (raises a clear error otherwise);
        initialises a lazy weight."""
        if isinstance(x, SparseTensor):
            shape, dtype = x.shape, x.dtype
        elif isinstance(x, Tensor) and x.layout == torch.strided:
            shape, dtype = tuple(x.shape), x.dtype
        else:
            raise TypeError(f"x must be a dense torch.Tensor or a SparseTensor of node features, got "
                            f"{type(x).__name__}{'' if not isinstance(x, Tensor) else f' with layout {x.layout}'}")
        if len(shape) != 2:
            raise ValueError(f"x must have shape (num_nodes, in_channels), got {shape}")
        if self.in_channels == -1:  # lazy (a plain int test: tracers take it as a constant)
            self._initialise(shape[1])
        if shape[1] != self.in_channels:
            raise ValueError(f"x must have shape (num_nodes, {self.in_channels}), got {shape}")
        weight_dtype = self.weight.dtype
        if dtype != weight_dtype and autocast_dtype(dtype) != autocast_dtype(weight_dtype):
            raise TypeError(f"x has dtype {dtype} but the layer's weight has {weight_dtype}")
        return shape[0]

    def _initialise(self, in_channels: int) -> None:
        """Materialise a lazy weight for ``in_channels`` inputs and initialise it."""
        if in_channels <= 0:
            raise ValueError(f"x must have at least one feature to initialise in_channels=-1, got {in_channels}")
        self.in_channels = in_channels
        with torch.no_grad():
            self.weight.materialize((self.out_channels, in_channels))
            self.weight.data = _input_major(self.weight.data)
            nn.init.xavier_uniform_(self.weight)

    # ------------------------------------------------------------------ state_dict of a lazy layer
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """An uninitialised weight is saved uninitialised (as torch's and PyG's lazy layers
        do), as a new object unless ``keep_vars``: initialising the layer later must not
        change a state dict taken before."""
        if not is_lazy(self.weight):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        destination[prefix + "weight"] = (self.weight if keep_vars
                                          else nn.parameter.UninitializedParameter(dtype=self.weight.dtype))
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """A saved initialised weight initialises a lazy layer (``in_channels`` from its
        shape); a saved uninitialised one makes this layer lazy again (as PyG)."""
        key = prefix + "weight"
        saved = state_dict.get(key)
        if isinstance(saved, Tensor) and is_lazy(saved):
            self.in_channels = -1
            self.weight = nn.parameter.UninitializedParameter(device=self.weight.device, dtype=self.weight.dtype)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            missing_keys.remove(key)
            return
        if isinstance(saved, Tensor) and saved.dim() == 2 and is_lazy(self.weight):
            if saved.shape[0] != self.out_channels:
                error_msgs.append(f"size mismatch for {key}: the saved weight has shape {tuple(saved.shape)}, "
                                  f"this layer has out_channels={self.out_channels}")
                return
            self.in_channels = saved.shape[1]
            self.weight.materialize((self.out_channels, self.in_channels))
            self.weight.data = _input_major(self.weight.data)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _propagate(self, adjacency: SparseTensor, h: Tensor) -> Tensor:
        """``Â H (+ b)``: the bias is added to each output row by the kernel that
        finishes it (an epilogue), not in a second pass."""
        if self.bias is None:
            return einsum("ts,so->to", adjacency, h)
        return _PROPAGATE(adjacency, h, self.bias)

    def adjacency(self, edge_index: Tensor | SparseTensor, edge_weight: Tensor | None, num_nodes: int,
                  dtype: torch.dtype) -> SparseTensor:
        """The ``(num_nodes, num_nodes)`` CSR propagation matrix ``Â[target, source]``
        (normalised if ``normalize``); from the cache when ``cached`` and already built."""
        if self._cached_adjacency is not None:
            cached = self._cached_adjacency
            if cached.shape[0] != num_nodes:
                raise ValueError(f"the cached adjacency has {cached.shape[0]} nodes but x has {num_nodes} rows; "
                                 "call reset_cache() before using another graph")
            return cached
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            # Its size depends on the data: one opaque op, computed per call (an eager
            # call before tracing fills the cache, which the traced program then reads).
            if not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided:
                raise NotImplementedError("a traced SparseGCNConv takes the graph as an edge_index tensor (a "
                                          "sparse adj_t or SparseTensor adjacency only in eager mode)")
            pos, crd, values = torch.ops.sparsenn.gcn_adjacency(
                edge_index, edge_weight, num_nodes, self.improved, self.add_self_loops, self.normalize, dtype)
            return SparseTensor((num_nodes, num_nodes), _CSR, (None, pos), (None, crd), values, check=False)
        source, target, weight = self._edges(edge_index, edge_weight, num_nodes, dtype)
        if self.cached and weight is not None and weight.requires_grad:
            raise ValueError("cached=True cannot cache an adjacency whose edge weights require grad "
                             "(the cache would hold a stale autograd graph); use cached=False")
        adjacency = _adjacency(source, target, weight, num_nodes, self.improved, self.add_self_loops,
                               self.normalize, dtype)
        if self.cached and not transforming():  # a torch.func transform's tensors must not outlive it
            self._cached_adjacency = adjacency
        return adjacency

    @staticmethod
    def _edges(edge_index: Tensor | SparseTensor, edge_weight: Tensor | None, num_nodes: int,
               dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        """Validated ``(source, target, weight or None)`` of the graph."""
        if isinstance(edge_index, SparseTensor):
            if edge_weight is not None:
                raise ValueError("edge_weight must be None when the graph is a SparseTensor adjacency "
                                 "(its values are the edge weights)")
            if edge_index.shape != (num_nodes, num_nodes):
                raise ValueError(f"adjacency has shape {edge_index.shape}, expected ({num_nodes}, {num_nodes}) "
                                 "for x with that many rows")
            if edge_index.dtype != dtype:
                raise TypeError(f"adjacency values have dtype {edge_index.dtype} but x has {dtype}")
            indices, values = edge_index.coords()
            return indices[0], indices[1], values
        if isinstance(edge_index, Tensor) and edge_index.layout != torch.strided:
            return SparseGCNConv._transposed_adjacency(edge_index, edge_weight, num_nodes, dtype)
        if type(edge_index).__module__.startswith("torch_sparse"):
            raise TypeError("a torch_sparse.SparseTensor adj_t is not supported; pass "
                            "adj_t.to_torch_sparse_csr_tensor() (PyG's torch.sparse layout) instead")
        if not isinstance(edge_index, Tensor):
            raise TypeError(f"edge_index must be a (2, E) integer tensor or a SparseTensor, "
                            f"got {type(edge_index).__name__}")
        if edge_index.layout != torch.strided or edge_index.device.type != "cpu":
            raise ValueError(f"edge_index must be a strided CPU tensor, got {edge_index.layout} on "
                             f"{edge_index.device}")
        if edge_index.dtype == torch.bool or edge_index.is_floating_point() or edge_index.is_complex():
            raise TypeError(f"edge_index must be an integer tensor, got dtype {edge_index.dtype}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, num_edges), got {tuple(edge_index.shape)}")
        edge_index = edge_index.long()
        if edge_index.numel():
            low, high = int(edge_index.min()), int(edge_index.max())
            if low < 0 or high >= num_nodes:
                bad = low if low < 0 else high
                raise ValueError(f"edge_index has node {bad} out of range [0, {num_nodes}) (x has {num_nodes} rows)")
        if edge_weight is not None:
            if not isinstance(edge_weight, Tensor) or edge_weight.layout != torch.strided:
                raise TypeError(f"edge_weight must be a dense tensor, got {type(edge_weight).__name__}")
            if edge_weight.shape != (edge_index.shape[1],):
                raise ValueError(f"edge_weight must have shape ({edge_index.shape[1]},), one weight per edge, "
                                 f"got {tuple(edge_weight.shape)}")
            if edge_weight.dtype != dtype:
                raise TypeError(f"edge_weight has dtype {edge_weight.dtype} but x has {dtype}")
        return edge_index[0], edge_index[1], edge_weight

    @staticmethod
    def _transposed_adjacency(adj_t: Tensor, edge_weight: Tensor | None, num_nodes: int,
                              dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """``(source, target, weight)`` of PyG's ``adj_t[target, source]`` (torch CSR or COO)."""
        if adj_t.layout not in (torch.sparse_csr, torch.sparse_coo):
            raise TypeError(f"a torch sparse adj_t must have layout torch.sparse_csr or torch.sparse_coo (PyG's "
                            f"transposed adjacency), got {adj_t.layout}")
        if edge_weight is not None:
            raise ValueError("edge_weight must be None when the graph is a sparse adj_t (its values are the "
                             "edge weights)")
        if tuple(adj_t.shape) != (num_nodes, num_nodes):
            raise ValueError(f"adj_t has shape {tuple(adj_t.shape)}, expected ({num_nodes}, {num_nodes}) for x with "
                             "that many rows")
        if adj_t.dtype != dtype:
            raise TypeError(f"adj_t values have dtype {adj_t.dtype} but x has {dtype}")
        indices, values = SparseTensor.from_torch(adj_t).coords()
        return indices[1], indices[0], values
