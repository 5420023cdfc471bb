"""SparseGCNConv keeps its weight input-major (``Wᵀ`` contiguous): the layout in which
``X Wᵀ`` over sparse features reads it, so the planner reads it in place, with no re-laid
copy to check on every call. The layout survives what a module's life does to its
parameters, and every path computes what torch computes."""

import pytest
import torch

import sparsenn
from _machines import AVX2, AVX512, relaying
from sparsenn import SparseGCNConv, SparseTensor
from sparsenn.compiler import api, cache_stats, clear_caches, use_target
from sparsenn.compiler.runtime.evaluate import resolve
from sparsenn.compiler.runtime.launcher import Launch
from sparsenn.compiler.runtime.validate import check_call
from sparsenn.layers import gcn_norm


def _features(nodes: int, channels: int, dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, SparseTensor]:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.rand(nodes, channels, generator=generator, dtype=dtype)
    dense = torch.where(dense < 0.05, dense, torch.zeros((), dtype=dtype))
    return dense, SparseTensor.from_dense(dense, format="csr")


def _graph(nodes: int, edges: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, nodes, (2, edges), generator=generator)


def _reference(x: torch.Tensor, edge_index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               edge_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``Â X Wᵀ + b`` in dense torch, ``Â`` from :func:`gcn_norm`."""
    nodes = x.shape[0]
    (source, target), values = gcn_norm(edge_index, edge_weight, nodes, dtype=x.dtype)
    adjacency = torch.zeros(nodes, nodes, dtype=x.dtype).index_put((target, source), values, accumulate=True)
    return adjacency @ (x @ weight.T) + bias


def _launch(equation: str, *operands) -> Launch:
    assignment = api.parse(equation, len(operands))
    launch = resolve(assignment, check_call(assignment, operands, "dense"))
    assert isinstance(launch, Launch)
    return launch


def _input_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_the_product_over_sparse_features_reads_the_layers_weight_in_place(target):
    conv = SparseGCNConv(300, 64)
    assert _input_major(conv.weight)
    _, x = _features(50, 300)
    with use_target(target):
        assert not _launch("si,oi->so", x, conv.weight.detach()).stages  # read where it is
    with use_target(relaying(target)):  # copies cheaper than the kernel packing the weight itself
        assert not _launch("si,oi->so", x, conv.weight.detach()).stages
        # the same weight stored output-major: the kernel reads a copy of it in its loop order
        assert _launch("si,oi->so", x, conv.weight.detach().contiguous()).stages


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_no_relaid_copy_is_kept_or_checked_for_the_layers_weight(target, host_target):
    host_target(target)
    torch.manual_seed(0)
    conv = SparseGCNConv(300, 64, cached=True).eval()
    dense, x = _features(50, 300)
    edge_index = _graph(50, 200)
    clear_caches()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(conv(x, edge_index), _reference(dense, edge_index, conv.weight, conv.bias),
                                       rtol=1e-5, atol=1e-6)
    stats = cache_stats()["re-laid parameters"]
    assert (stats.hits, stats.misses, stats.size) == (0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cached", [False, True])
def test_forward_and_training_match_torch_with_sparse_features_and_edge_weights(dtype, cached):
    torch.manual_seed(0)
    conv = SparseGCNConv(40, 9, cached=cached, dtype=dtype)
    torch.nn.init.normal_(conv.bias)
    dense, x = _features(30, 40, dtype)
    edge_index = _graph(30, 90)
    edge_weight = torch.rand(90, dtype=dtype) + 0.5
    if cached:
        edge_weight = None  # normalised once, from the graph alone
    weight = conv.weight.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
    bias = conv.bias.detach().clone().requires_grad_()
    optimizer = torch.optim.Adam(conv.parameters(), lr=0.05)
    mirror = torch.optim.Adam([weight, bias], lr=0.05)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    for _ in range(3):  # training steps: the stepped weight is read, never a stale copy
        out, want = conv(x, edge_index, edge_weight), _reference(dense, edge_index, weight, bias, edge_weight)
        torch.testing.assert_close(out, want, **tolerance)
        out.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(conv.weight.grad, weight.grad, **tolerance)
        torch.testing.assert_close(conv.bias.grad, bias.grad, **tolerance)
        for opt in (optimizer, mirror):
            opt.step()
            opt.zero_grad()
        assert _input_major(conv.weight)
    conv.eval()
    with torch.no_grad():
        torch.testing.assert_close(conv(x, edge_index, edge_weight),
                                   _reference(dense, edge_index, weight, bias, edge_weight), **tolerance)


def test_the_layout_survives_state_dicts_dtype_moves_and_lazy_initialisation():
    torch.manual_seed(0)
    conv = SparseGCNConv(20, 6)
    saved = {k: v.contiguous() for k, v in SparseGCNConv(20, 6).state_dict().items()}  # output-major checkpoint
    conv.load_state_dict(saved)
    assert _input_major(conv.weight) and torch.equal(conv.weight, saved["weight"])
    assert _input_major(conv.double().weight) and conv.weight.dtype == torch.float64
    lazy = SparseGCNConv(-1, 6)
    _, x = _features(10, 20)
    lazy(x, _graph(10, 30))
    assert _input_major(lazy.weight) and lazy.weight.shape == (6, 20)
    reloaded = SparseGCNConv(-1, 6)
    reloaded.load_state_dict(saved)
    assert _input_major(reloaded.weight) and torch.equal(reloaded.weight, saved["weight"])


def test_edits_of_the_weight_are_read_by_the_next_call():
    """An edit through ``.data`` (no version counter sees it), ``copy_`` under no_grad and a
    state dict loaded are all read: the weight is read where it is, and an output-major
    weight put in its place goes through the re-laid copies, checked by their bits."""
    torch.manual_seed(0)
    conv = SparseGCNConv(30, 8, cached=True).eval()
    dense, x = _features(20, 30)
    edge_index = _graph(20, 60)

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(conv(x, edge_index), _reference(dense, edge_index, conv.weight, conv.bias),
                                       rtol=1e-5, atol=1e-6)

    check()
    conv.weight.data[2, 5] += 3.0
    check()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(8, 30))
    check()
    conv.load_state_dict({"weight": torch.randn(8, 30), "bias": torch.randn(8)})
    check()
    conv.weight = torch.nn.Parameter(torch.randn(8, 30))  # output-major: read through a re-laid copy
    check()
    conv.weight.data[0, 0] = 7.0
    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gcn_program_matches_torch_whatever_the_weights_layout(dtype):
    from models.gcn import GCN
    from models.gcn_reference import TorchCSRGCN

    torch.manual_seed(0)
    model = GCN(40, 5, hidden_channels=16, dropout=0.0).to(dtype).eval()
    torch.nn.init.normal_(model.conv1.bias)
    torch.nn.init.normal_(model.conv2.bias)
    dense, x = _features(30, 40, dtype)
    edge_index = _graph(30, 90)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    with torch.no_grad():
        want = TorchCSRGCN(model)(x.to_torch(torch.sparse_csr), edge_index)
        torch.testing.assert_close(model(x, edge_index), want, **tolerance)
        for conv in (model.conv1, model.conv2):  # output-major weights (a user's own parameters)
            conv.weight = torch.nn.Parameter(conv.weight.detach().contiguous())
        torch.testing.assert_close(model(x, edge_index), want, **tolerance)
        torch.testing.assert_close(model(dense, edge_index), want, **tolerance)
