"""Sparse ``nn.Module`` layers. Each holds parameters and calls :func:`sparsenn.einsum`;
forward and backward run as compiled sparse einsums (no per-layer kernels)."""

from .attention import BlockPattern, BlockSparseAttention, bigbird_pattern
from .gcn import SparseGCNConv, gcn_norm
from .linear import SparseLinear
from .moe import GateOutput, SparseMoE, SparseMoEGate

__all__ = ["SparseLinear", "SparseGCNConv", "gcn_norm", "BlockSparseAttention", "BlockPattern", "bigbird_pattern",
           "SparseMoEGate", "SparseMoE", "GateOutput"]
