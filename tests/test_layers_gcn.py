"""SparseGCNConv against torch_geometric.nn.GCNConv (Cora) and dense references."""

import pytest
import torch

import sparsenn
from _gcn import assert_close_scaled, pair

from sparsenn import SparseGCNConv
from sparsenn.layers import gcn_norm


def run_both(ref, mine, x, edge_index, edge_weight=None):
    """Outputs and gradients (x, weight, bias, edge_weight) of both layers for one random loss."""
    results = []
    grad = None
    for layer, weight_of in ((ref, lambda m: m.lin.weight), (mine, lambda m: m.weight)):
        xx = x.clone().requires_grad_()
        ew = None if edge_weight is None else edge_weight.clone().requires_grad_()
        out = layer(xx, edge_index, ew)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
        results.append((out.detach(), xx.grad, weight_of(layer).grad, layer.bias.grad,
                         None if ew is None else ew.grad))
    return results


def test_cora_forward_and_gradients_match_pyg(cora):
    ref, mine = pair(cora.num_features, 16)
    (o1, gx1, gw1, gb1, _), (o2, gx2, gw2, gb2, _) = run_both(ref, mine, cora.x, cora.edge_index)
    assert_close_scaled(o2, o1)
    assert_close_scaled(gx2, gx1)
    assert_close_scaled(gw2, gw1)
    assert_close_scaled(gb2, gb1)


def test_cora_edge_weight_improved_and_wide_output_match_pyg(cora):
    """improved=True with edge weights, edge-weight gradients, and the (Â X) Wᵀ order
    taken when out_channels > in_channels (features cut to 24 columns)."""
    weight = torch.rand(cora.edge_index.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5
    x = cora.x[:, :24].contiguous()
    for in_channels, out_channels, inputs in ((cora.num_features, 16, cora.x), (24, 40, x)):
        ref, mine = pair(in_channels, out_channels, improved=True)
        first, second = run_both(ref, mine, inputs, cora.edge_index, weight)
        for a, b in zip(second, first):
            assert_close_scaled(a, b)


def test_cora_cached_and_sparse_adjacency(cora):
    ref, mine = pair(cora.num_features, 7, cached=True)
    adjacency = sparsenn.from_edge_index(cora.edge_index, num_nodes=cora.num_nodes)
    first = mine(cora.x, adjacency)
    assert_close_scaled(first, ref(cora.x, cora.edge_index))
    cached = mine._cached_adjacency
    assert cached is not None and cached.format == sparsenn.parse_format("csr", 2)
    second = mine(cora.x, cora.edge_index[:, :10])  # like PyG: the cached graph is used
    torch.testing.assert_close(second, first)
    assert mine._cached_adjacency is cached
    mine.reset_cache()
    assert mine._cached_adjacency is None


def test_cora_sparse_features_match_pyg(cora):
    """Bag-of-words features as a CSR SparseTensor: same output and weight gradient as PyG
    with dense features; gradients reach the stored feature values."""
    ref, mine = pair(cora.num_features, 16)
    x = sparsenn.from_dense(cora.x, "csr")
    values = x.values.clone().requires_grad_()
    out = mine(x.with_values(values), cora.edge_index)
    xd = cora.x.clone().requires_grad_()
    expected = ref(xd, cora.edge_index)
    assert_close_scaled(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert_close_scaled(mine.weight.grad, ref.lin.weight.grad)
    rows, cols = x.coords()[0]
    assert_close_scaled(values.grad, xd.grad[rows, cols])


def test_normalize_false_matches_pyg(cora):
    ref, mine = pair(cora.num_features, 8, normalize=False)
    weight = torch.rand(cora.edge_index.shape[1], generator=torch.Generator().manual_seed(2))
    for a, b in zip(*reversed(run_both(ref, mine, cora.x, cora.edge_index, weight))):
        assert_close_scaled(a, b)


def test_existing_self_loops_duplicates_and_isolated_nodes_match_pyg():
    """Nodes 0 and 3 have self-loops (kept with their weights), edge (1, 2) appears twice,
    node 5 is isolated; directed edges (messages flow source -> target)."""
    edge_index = torch.tensor([[0, 0, 1, 1, 2, 3, 4, 1], [0, 1, 2, 2, 4, 3, 0, 4]])
    weight = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.5, 3.0, 0.75, 1.25], dtype=torch.float64)
    x = torch.randn(6, 5, dtype=torch.float64)
    for improved in (False, True):
        ref, mine = pair(5, 3, improved=improved)
        ref, mine = ref.double(), mine.double()
        for ew in (weight, None):
            if ew is None and improved:
                continue  # PyG ignores improved's fill value 2 when edge_weight is None
            results = run_both(ref, mine, x, edge_index, ew)
            for a, b in zip(results[1], results[0]):
                if a is not None:
                    torch.testing.assert_close(a, b)
            assert torch.isfinite(results[1][0]).all()


def test_dense_reference_and_gcn_norm():
    """Â X Wᵀ + b with Â = D^-1/2 (A + I) D^-1/2 built densely, A[target, source]."""
    edge_index = torch.tensor([[0, 1, 2, 2, 3], [1, 2, 0, 3, 1]])
    n = 4
    dense = torch.zeros(n, n, dtype=torch.float64)
    dense[edge_index[1], edge_index[0]] = 1.0
    dense += torch.eye(n, dtype=torch.float64)
    d = dense.sum(1).pow(-0.5)
    a_hat = d[:, None] * dense * d[None, :]
    edges, norm = gcn_norm(edge_index, None, n, dtype=torch.float64)
    rebuilt = torch.zeros(n, n, dtype=torch.float64)
    rebuilt.index_put_((edges[1], edges[0]), norm, accumulate=True)
    torch.testing.assert_close(rebuilt, a_hat)
    conv = SparseGCNConv(3, 2, dtype=torch.float64)
    x = torch.randn(n, 3, dtype=torch.float64)
    torch.testing.assert_close(conv(x, edge_index), a_hat @ x @ conv.weight.detach().T + conv.bias.detach())


def test_gradcheck_small_graph():
    edge_index = torch.tensor([[0, 1, 2, 3, 3, 1], [1, 2, 3, 0, 3, 0]])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    for out_channels in (2, 5):  # Â (X Wᵀ) and (Â X) Wᵀ
        conv = SparseGCNConv(3, out_channels, dtype=torch.float64)
        params = {"weight": conv.weight.detach().clone().requires_grad_(),
                  "bias": conv.bias.detach().clone().requires_grad_()}

        def run(x, edge_weight, w, b):
            return torch.func.functional_call(conv, {"weight": w, "bias": b}, (x, edge_index, edge_weight))

        assert torch.autograd.gradcheck(run, (x, weight, params["weight"], params["bias"]))
    sparse_x = sparsenn.from_dense(x.detach() * (torch.rand(4, 3) < 0.5), "csr")
    conv = SparseGCNConv(3, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v: conv(sparse_x.with_values(v), edge_index),
                                    (sparse_x.values.clone().requires_grad_(),))


def test_trains_on_a_small_graph():
    torch.manual_seed(3)
    edge_index = torch.randint(0, 30, (2, 120))
    x, y = torch.randn(30, 8), torch.randint(0, 3, (30,))
    conv = SparseGCNConv(8, 3, cached=True)
    opt = torch.optim.Adam(conv.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(conv(x, edge_index), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="add_self_loops=True needs normalize=True"):
        SparseGCNConv(4, 2, add_self_loops=True, normalize=False)
    with pytest.raises(ValueError, match="in_channels must be positive"):
        SparseGCNConv(0, 2)
    with pytest.raises(TypeError, match="dtype must be"):
        SparseGCNConv(4, 2, dtype=torch.int64)
    conv = SparseGCNConv(4, 2)
    x = torch.randn(5, 4)
    ei = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"x must have shape \(num_nodes, 4\)"):
        conv(torch.randn(5, 3), ei)
    with pytest.raises(ValueError, match=r"x must have shape \(num_nodes, 4\)"):
        conv(sparsenn.from_dense(torch.eye(5), "csr"), ei)
    with pytest.raises(TypeError, match="x must be a dense torch.Tensor or a SparseTensor"):
        conv(x.to_sparse(), ei)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        conv(x.double(), ei)
    with pytest.raises(ValueError, match=r"edge_index must have shape \(2, num_edges\)"):
        conv(x, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="edge_index must be an integer tensor"):
        conv(x, ei.float())
    with pytest.raises(ValueError, match=r"node 7 out of range \[0, 5\)"):
        conv(x, torch.tensor([[0, 7], [1, 2]]))
    with pytest.raises(ValueError, match=r"edge_weight must have shape \(2,\)"):
        conv(x, ei, torch.ones(3))
    with pytest.raises(TypeError, match="edge_weight has dtype torch.float64"):
        conv(x, ei, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"adjacency has shape \(4, 4\)"):
        conv(x, sparsenn.from_edge_index(ei, num_nodes=4))
    with pytest.raises(ValueError, match="edge_weight must be None"):
        conv(x, sparsenn.from_edge_index(ei, num_nodes=5), torch.ones(2))
    with pytest.raises(TypeError, match="edge_index must be a"):
        conv(x, [[0, 1], [1, 2]])
    cached = SparseGCNConv(4, 2, cached=True)
    with pytest.raises(ValueError, match="cached=True cannot cache"):
        cached(x, ei, torch.ones(2, requires_grad=True))
    cached(x, ei)
    with pytest.raises(ValueError, match="call reset_cache"):
        cached(torch.randn(6, 4), ei)
