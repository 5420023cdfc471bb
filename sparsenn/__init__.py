"""sparsenn: sparse deep learning for PyTorch through one sparse einsum compiler."""

from dataclasses import replace

from sparsenn.compiler import (
    CompiledExpression,
    CompilerNotFoundError,
    KernelBuildError,
    NotationError,
    einsum,
    explain,
)
from sparsenn.compiler import compile_expression as compile
from sparsenn.formats import (
    Format,
    SparseTensor,
    cat,
    from_coo,
    from_dense,
    from_edge_index,
    from_scipy,
    from_torch,
    parse_format,
    stack,
)
from sparsenn.formats.arithmetic import install_arithmetic
from sparsenn.compiler.operators import ARITHMETIC
from sparsenn.layers import BlockSparseAttention, GateOutput, SparseGCNConv, SparseLinear, SparseMoE, SparseMoEGate
from sparsenn.convert import ConversionReport, convert
from sparsenn.functional import log_softmax, softmax
from sparsenn.precompile import Precompiled, precompile

install_arithmetic(replace(ARITHMETIC, einsum=einsum))  # SparseTensor's + - * @ and sum run through the compiler

__version__ = "0.1.0"

__all__ = [
    "SparseTensor",
    "Format",
    "parse_format",
    "from_dense",
    "from_torch",
    "from_scipy",
    "from_edge_index",
    "from_coo",
    "stack",
    "cat",
    "einsum",
    "compile",
    "explain",
    "CompiledExpression",
    "NotationError",
    "KernelBuildError",
    "CompilerNotFoundError",
    "SparseLinear",
    "SparseGCNConv",
    "BlockSparseAttention",
    "SparseMoEGate",
    "SparseMoE",
    "GateOutput",
    "convert",
    "ConversionReport",
    "softmax",
    "log_softmax",
    "precompile",
    "Precompiled",
]
