"""PyG conventions: SparseGCNConv takes PyG's torch sparse ``adj_t`` (CSR and COO, the
transposed adjacency) and a lazy ``in_channels=-1``; SparseLinear takes torch sparse inputs."""

import io

import pytest
import torch
import torch_geometric.transforms as T
from torch import nn
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv

from _gcn import assert_close_scaled, pair

from sparsenn import SparseGCNConv, SparseLinear


def adj_t_of(edge_index, num_nodes, weight=None, layout=torch.sparse_csr):
    """PyG's transposed adjacency ``adj_t[target, source]`` as a torch sparse tensor."""
    weight = torch.ones(edge_index.shape[1]) if weight is None else weight
    adj_t = torch.sparse_coo_tensor(edge_index.flip(0), weight, (num_nodes, num_nodes)).coalesce()
    return adj_t if layout == torch.sparse_coo else adj_t.to_sparse_csr()


def test_cora_adj_t_from_to_sparse_tensor_matches_pyg_and_edge_index(cora):
    data = T.ToSparseTensor()(Data(x=cora.x, edge_index=cora.edge_index, num_nodes=cora.num_nodes))
    assert data.adj_t.layout == torch.sparse_csr
    ref, mine = pair(cora.num_features, 16)
    expected = mine(cora.x, cora.edge_index)
    for adj_t in (data.adj_t, data.adj_t.to_sparse_coo()):
        out = mine(cora.x, adj_t)
        assert_close_scaled(out, ref(cora.x, adj_t))
        assert_close_scaled(out, expected)


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo])
def test_adj_t_weights_and_their_gradients_match_the_edge_index_path(layout):
    """A directed weighted graph without self-loops: PyG's adj_t path agrees too; the
    gradient reaches the edge weights through adj_t's values."""
    torch.manual_seed(1)
    edge_index = torch.tensor([[0, 1, 1, 2, 3, 4, 4], [1, 0, 2, 3, 1, 0, 2]])
    weight = torch.rand(7, dtype=torch.float64) + 0.5
    x = torch.randn(5, 4, dtype=torch.float64)
    ref, mine = pair(4, 3, improved=True)
    ref, mine = ref.double(), mine.double()
    assert_close_scaled(mine(x, adj_t_of(edge_index, 5, weight, layout)), ref(x, adj_t_of(edge_index, 5, weight, layout)))
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    out = mine(x, adj_t_of(edge_index, 5, w1, layout))
    expected = mine(x, edge_index, w2)
    assert_close_scaled(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert_close_scaled(w1.grad, w2.grad)


def test_adj_t_with_self_loops_follows_the_edge_index_semantics():
    """An existing self-loop keeps its weight, as on the edge_index path (PyG's own adj_t
    path adds the fill value to it instead)."""
    edge_index = torch.tensor([[0, 1, 2, 2, 3], [1, 2, 2, 0, 3]])
    weight = torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0])
    x = torch.randn(4, 3)
    _, mine = pair(3, 2)
    assert_close_scaled(mine(x, adj_t_of(edge_index, 4, weight)), mine(x, edge_index, weight))


def test_cached_adj_t():
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    _, mine = pair(3, 2, cached=True)
    x = torch.randn(3, 3)
    first = mine(x, adj_t_of(edge_index, 3))
    assert mine._cached_adjacency is not None
    torch.testing.assert_close(mine(x, adj_t_of(edge_index[:, :1], 3)), first)


def test_bad_adj_t_is_named():
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    conv, x = SparseGCNConv(3, 2), torch.randn(3, 3)
    adj_t = adj_t_of(edge_index, 3)
    with pytest.raises(TypeError, match="sparse_csr or torch.sparse_coo .* got torch.sparse_csc"):
        conv(x, adj_t.to_sparse_csc())
    with pytest.raises(TypeError, match="got torch.sparse_bsr"):
        conv(x, adj_t.to_sparse_bsr((1, 1)))
    with pytest.raises(ValueError, match="edge_weight must be None when the graph is a sparse adj_t"):
        conv(x, adj_t, torch.ones(3))
    with pytest.raises(ValueError, match=r"adj_t has shape \(4, 4\), expected \(3, 3\)"):
        conv(x, adj_t_of(edge_index, 4))
    with pytest.raises(TypeError, match="adj_t values have dtype torch.float64"):
        conv(x, adj_t.double())


def test_lazy_in_channels_initialise_at_the_first_forward(cora):
    torch.manual_seed(2)
    conv = SparseGCNConv(-1, 16)
    assert nn.parameter.is_lazy(conv.weight) and "-1, 16" in repr(conv)
    out = conv(cora.x, cora.edge_index)
    assert conv.in_channels == cora.num_features and conv.weight.shape == (16, cora.num_features)
    assert type(conv.weight) is nn.Parameter and "1433, 16" in repr(conv)
    ref, mine = pair(cora.num_features, 16)
    with torch.no_grad():
        ref.lin.weight.copy_(conv.weight)
        ref.bias.copy_(conv.bias)
    assert_close_scaled(out, ref(cora.x, cora.edge_index))
    lazy_pyg = GCNConv(-1, 16)
    assert lazy_pyg(cora.x, cora.edge_index).shape == out.shape
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)  # initialised: an optimizer can take it
    conv(cora.x, cora.edge_index).square().mean().backward()
    opt.step()


def test_lazy_state_dict_round_trips():
    x, edge_index = torch.randn(4, 5), torch.tensor([[0, 1, 2], [1, 2, 3]])
    source = SparseGCNConv(-1, 3)
    lazy_state = source.state_dict()
    assert nn.parameter.is_lazy(lazy_state["weight"])
    other = SparseGCNConv(-1, 3)
    other.load_state_dict(lazy_state)  # lazy into lazy: still lazy
    assert nn.parameter.is_lazy(other.weight)
    source(x, edge_index)
    state = source.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer, weights_only=True))  # initialised into lazy: materialised
    assert other.in_channels == 5
    torch.testing.assert_close(other(x, edge_index), source(x, edge_index))
    eager = SparseGCNConv(5, 3)
    eager.load_state_dict(state)
    torch.testing.assert_close(eager(x, edge_index), source(x, edge_index))
    eager.load_state_dict(lazy_state)  # a lazy state makes the layer lazy again (as PyG)
    assert nn.parameter.is_lazy(eager.weight) and eager.in_channels == -1
    with pytest.raises(RuntimeError, match="out_channels=4"):
        SparseGCNConv(-1, 4).load_state_dict(state)


def test_lazy_bad_arguments():
    with pytest.raises(ValueError, match=r"in_channels must be positive or -1 \(lazy\), got -2"):
        SparseGCNConv(-2, 3)
    with pytest.raises(ValueError, match="out_channels must be positive, got -1"):
        SparseGCNConv(3, -1)
    with pytest.raises(ValueError, match=r"x must have shape \(num_nodes, in_channels\)"):
        SparseGCNConv(-1, 3)(torch.randn(4), torch.tensor([[0], [1]]))


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc])
def test_sparse_linear_takes_torch_sparse_inputs(layout):
    torch.manual_seed(3)
    layer = SparseLinear(12, 5, sparsity=0.5, dtype=torch.float64)
    dense = torch.randn(6, 12, dtype=torch.float64) * (torch.rand(6, 12) < 0.3)
    sparse = dense.to_sparse(layout=layout)
    torch.testing.assert_close(layer(sparse), layer(dense))
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0], [3, 3]]), torch.tensor([1.0, 2.0]), (2, 12),
                                          dtype=torch.float64)
    torch.testing.assert_close(layer(uncoalesced), layer(uncoalesced.to_dense()))


def test_sparse_linear_gradient_reaches_torch_sparse_values():
    torch.manual_seed(4)
    layer = SparseLinear(8, 3, sparsity=0.5, dtype=torch.float64)
    dense = torch.randn(4, 8, dtype=torch.float64) * (torch.rand(4, 8) < 0.5)
    sparse = dense.to_sparse().requires_grad_()
    layer(sparse).sum().backward()
    reference = dense.clone().requires_grad_()
    layer(reference).sum().backward()
    mask = dense != 0
    torch.testing.assert_close(sparse.grad.to_dense()[mask], reference.grad[mask])


def test_sparse_linear_bad_torch_sparse_inputs():
    layer = SparseLinear(8, 3)
    with pytest.raises(ValueError, match=r"torch sparse input must have shape \(batch, 8\), got \(2, 2, 8\)"):
        layer(torch.zeros(2, 2, 8).to_sparse())
    with pytest.raises(TypeError, match=r"torch sparse input \(torch.sparse_coo\) cannot be converted: .*int32"):
        layer(torch.zeros(2, 8, dtype=torch.int32).to_sparse())
    with pytest.raises(ValueError, match=r"sparse input must have shape \(batch, 8\)"):
        layer(torch.zeros(2, 7).to_sparse_csr())
    with pytest.raises(TypeError, match="input has dtype torch.float64 but the weight has torch.float32"):
        layer(torch.zeros(2, 8, dtype=torch.float64).to_sparse_csr())
