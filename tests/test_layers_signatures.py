"""Layer constructors: the arguments after the sizes are keyword-only, so a positional value
meant for another argument (``SparseLinear(16, 8, 0.5)``: sparsity, not bias) is an error."""

import inspect

import pytest

import sparsenn

LAYERS = {
    sparsenn.SparseLinear: ((16, 8, 0.5), ("in_features", "out_features")),
    sparsenn.SparseGCNConv: ((16, 8, True), ("in_channels", "out_channels")),
    sparsenn.SparseMoEGate: ((16, 4, 2), ("d_model", "num_experts")),
    sparsenn.SparseMoE: ((16, 32, 4, 2), ("d_model", "d_hidden", "num_experts")),
    sparsenn.BlockSparseAttention: ((16, 2, 0.1), ("embed_dim", "num_heads")),  # nn.MultiheadAttention's dropout
}


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.__name__)
def test_arguments_after_the_sizes_are_keyword_only(layer):
    args, sizes = LAYERS[layer]
    parameters = list(inspect.signature(layer).parameters.values())
    positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == sizes
    assert all(p.kind == p.KEYWORD_ONLY for p in parameters[len(sizes):])
    with pytest.raises(TypeError, match="positional argument"):
        layer(*args)


def test_flags_must_be_bools():
    with pytest.raises(TypeError, match="bias must be a bool, got float"):
        sparsenn.SparseLinear(16, 8, bias=0.5)
    with pytest.raises(TypeError, match="improved must be a bool, got str"):
        sparsenn.SparseGCNConv(16, 8, improved="yes")
