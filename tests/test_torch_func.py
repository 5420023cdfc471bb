"""torch.func transforms through sparsenn (grad, vjp, jacrev, jacfwd, jvp, vmap,
functional_call, hessian) against dense torch references, loops over samples and finite
differences, in fp64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler import cache_stats
from _graphs import autograd_nodes

DT = torch.float64


def _sparse(shape: tuple[int, ...], fmt: str, seed: int, density: float = 0.5) -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=DT) * (torch.rand(shape, generator=g) < density)
    return sparsenn.from_dense(dense, fmt)


def _dense(A: SparseTensor, values: torch.Tensor) -> torch.Tensor:
    """``A``'s pattern with ``values`` as a dense tensor, differentiably (the reference)."""
    indices = A.coords()[0]
    return torch.zeros(A.shape, dtype=values.dtype).index_put(tuple(indices), values, accumulate=True)


def _calls() -> int:
    """Evaluations so far (hits and misses of the compiler's call cache)."""
    stats = cache_stats()["calls"]
    return stats.hits + stats.misses


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_reverse_and_forward_mode_of_a_sparse_product(fmt):
    A = _sparse((5, 4), fmt, seed=0)
    v, x, u = A.values.clone(), _x(4), _x(5, seed=2)

    def ours(v, x):
        return sparsenn.einsum("ij,j->i", A.with_values(v), x, out_format="dense")

    def ref(v, x):
        return _dense(A, v) @ x

    loss = lambda f: lambda v, x: (f(v, x) ** 2).sum()  # noqa: E731
    for a, b in zip(grad(loss(ours), argnums=(0, 1))(v, x), grad(loss(ref), argnums=(0, 1))(v, x)):
        torch.testing.assert_close(a, b)
    (out, pullback), (ref_out, ref_pullback) = vjp(ours, v, x), vjp(ref, v, x)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(pullback(u), ref_pullback(u)):
        torch.testing.assert_close(a, b)
    for transform in (jacrev, jacfwd):
        for a, b in zip(transform(ours, argnums=(0, 1))(v, x), transform(ref, argnums=(0, 1))(v, x)):
            torch.testing.assert_close(a, b)
    tangents = (_x(A.nnz, seed=3), _x(4, seed=4))
    for a, b in zip(jvp(ours, (v, x), tangents), jvp(ref, (v, x), tangents)):
        torch.testing.assert_close(a, b)


def test_jacobian_of_a_sampled_product_matches_finite_differences():
    """``Out<M>[i,k] = M[i,k] * sum_j X[i,j] Y[k,j]`` (an SDDMM) with respect to X, by
    jacrev and jacfwd, against central differences."""
    M = _sparse((4, 5), "csr", seed=5)
    Y = _x(5, 3, seed=6)

    def f(X):
        return sparsenn.einsum("ik,ij,kj->ik", M, X, Y).values

    X = _x(4, 3, seed=7)
    eps = 1e-6
    numeric = torch.stack([(f(X + eps * e) - f(X - eps * e)) / (2 * eps)
                           for e in torch.eye(X.numel(), dtype=DT).view(-1, *X.shape)], -1).view(M.nnz, *X.shape)
    torch.testing.assert_close(jacrev(f)(X), numeric, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(jacfwd(f)(X), numeric, atol=1e-8, rtol=1e-6)


def test_vmap_over_a_dense_operand_is_one_call():
    A = _sparse((6, 5), "csr", seed=8)
    X = _x(7, 5)
    f = lambda x: sparsenn.einsum("ij,j->i", A, x)  # noqa: E731
    expected = torch.stack([f(x) for x in X])
    before = _calls()
    torch.testing.assert_close(vmap(f)(X), expected)
    assert _calls() - before == 1
    torch.testing.assert_close(vmap(f, in_dims=1)(X.t()), expected)


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr"])
def test_vmap_over_sparse_values_is_one_call(fmt):
    """Batched values become a dense level below the pattern's: one call, whether the
    result is dense or sparse (written on the sampled operand's pattern, or assembled);
    a sparse result over COO's repeated row coordinates runs per element."""
    A = _sparse((6, 5), fmt, seed=9)
    V = _x(4, A.nnz, seed=10)
    x, Y = _x(5), _x(6, 5, seed=11)
    product = lambda v: sparsenn.einsum("ij,j->i", A.with_values(v), x, out_format="dense")  # noqa: E731
    sampled = lambda v: sparsenn.einsum("ij,ij->ij", A.with_values(v), Y).values  # noqa: E731

    def inferred(v):  # sparse in i where A stores i compressed (coo, dcsr): assembled per element
        out = sparsenn.einsum("ij,j->i", A.with_values(v), x)
        return out.values if isinstance(out, SparseTensor) else out

    for f in (product, sampled, inferred):
        expected = torch.stack([f(v) for v in V])
        before = _calls()
        torch.testing.assert_close(vmap(f)(V), expected)
        assert _calls() - before == (len(V) if fmt == "coo" and f is not product else 1)
        torch.testing.assert_close(vmap(f, in_dims=1)(V.t().contiguous()), expected)


def test_vmap_of_a_sparse_result_sampling_an_unbatched_pattern():
    """``dW<W>[o,i] = sum_b dY[b,o] X[b,i]`` with dY and X batched: a sparse result on W's
    pattern per batch element (a per-sample weight gradient)."""
    W = _sparse((6, 5), "csr", seed=12)
    mask = W.with_values(torch.ones_like(W.values))
    dY, X = _x(3, 2, 6, seed=13), _x(3, 2, 5, seed=14)
    f = lambda dy, x: sparsenn.einsum("bo,bi,oi->oi", dy, x, mask).values  # noqa: E731
    expected = torch.stack([f(dy, x) for dy, x in zip(dY, X)])
    before = _calls()
    torch.testing.assert_close(vmap(f)(dY, X), expected)
    assert _calls() - before == 1
    # The batch dimension read last by the dense operands, wherever it is given:
    torch.testing.assert_close(vmap(f, in_dims=(2, 1))(dY.permute(1, 2, 0), X.transpose(0, 1)), expected)
    unbatched_x = torch.stack([f(dy, X[0]) for dy in dY])
    torch.testing.assert_close(vmap(f, in_dims=(0, None))(dY, X[0]), unbatched_x)
    V = _x(3, W.nnz, seed=15)  # the sampled pattern's values batched too
    g = lambda dy, v: sparsenn.einsum("bo,bi,oi->oi", dy, X[0], W.with_values(v)).values  # noqa: E731
    torch.testing.assert_close(vmap(g, in_dims=(1, 0))(dY.transpose(0, 1), V),
                               torch.stack([g(dy, v) for dy, v in zip(dY, V)]))


def test_vmap_of_blocked_values_runs_per_element():
    """A blocked format takes no batch level: the call runs once per element, correctly."""
    A = _sparse((4, 6), "bsr(2,2)", seed=15, density=0.6)
    V, x = _x(3, A.nnz, seed=16), _x(6)
    f = lambda v: sparsenn.einsum("ij,j->i", A.with_values(v), x)  # noqa: E731
    torch.testing.assert_close(vmap(f)(V), torch.stack([f(v) for v in V]))


def test_nested_vmap_and_vmap_of_jacrev():
    A = _sparse((5, 4), "csr", seed=17)
    X = _x(2, 3, 4)
    f = lambda x: torch.tanh(sparsenn.einsum("ij,j->i", A, x))  # noqa: E731
    torch.testing.assert_close(vmap(vmap(f))(X), torch.stack([torch.stack([f(x) for x in row]) for row in X]))
    torch.testing.assert_close(vmap(jacrev(f))(X[0]), torch.stack([jacrev(f)(x) for x in X[0]]))


def test_per_sample_gradients_of_a_sparse_mlp():
    """vmap(grad(loss)) with functional_call: each sample's gradients, as a loop computes them.
    The weight gradients' batched mask is read for its positions only: its values are
    uninitialised memory, NaN under the tests' poisoning, so a read would show."""
    torch.manual_seed(0)
    model = nn.Sequential(sparsenn.SparseLinear(784, 256, sparsity=0.9), nn.ReLU(),
                          sparsenn.SparseLinear(256, 10, sparsity=0.9)).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, x, y):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, y.unsqueeze(0))

    X, Y = _x(6, 784), torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(0))
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, Y)
    for n in range(len(X)):
        model.zero_grad()
        nn.functional.cross_entropy(model(X[n:n + 1]), Y[n:n + 1]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][n], p.grad)


def test_an_ensemble_by_vmap_over_parameters():
    """Models sharing a pattern, their values stacked: one vmapped call per layer."""
    torch.manual_seed(1)
    models = [sparsenn.SparseLinear(8, 6, sparsity=0.5).double()]
    for _ in range(2):
        models.append(copy.deepcopy(models[0]))
        with torch.no_grad():
            models[-1].weight_values.normal_()
            models[-1].bias.normal_()
    params, _ = stack_module_state(models)
    buffers = dict(models[0].named_buffers())
    x = _x(4, 8)
    out = vmap(lambda p: functional_call(models[0], (p, buffers), (x,)))(params)
    torch.testing.assert_close(out, torch.stack([m(x) for m in models]).detach())


def test_vmap_cannot_batch_a_pattern():
    torch.manual_seed(2)
    models = [sparsenn.SparseLinear(8, 6, sparsity=0.5).double() for _ in range(2)]
    params, buffers = stack_module_state(models)
    x = _x(4, 8)
    with pytest.raises(ValueError, match="index arrays"):
        vmap(lambda p, b: functional_call(models[0], (p, b), (x,)))(params, buffers)


def _layers():
    g = torch.Generator().manual_seed(0)
    edges = torch.randint(0, 10, (2, 30), generator=g)
    # eval: one pattern for every call
    attention = sparsenn.BlockSparseAttention(16, 2, block_size=4, batch_first=True, seed=0).double().eval()
    return {
        "linear": (sparsenn.SparseLinear(8, 6, sparsity=0.5).double(), (_x(3, 8),), lambda out: out),
        "gcn": (sparsenn.SparseGCNConv(4, 3).double(), (_x(10, 4), edges), lambda out: out),
        "gate": (sparsenn.SparseMoEGate(8, 4, k=2, dtype=DT), (_x(12, 8),), lambda out: out.gates.values),
        "moe": (sparsenn.SparseMoE(8, 16, 4, k=2, dtype=DT), (_x(12, 8),), lambda out: out),
        "attention": (attention, (_x(1, 64, 16),), lambda out: out[0]),
    }


@pytest.mark.parametrize("name", ["linear", "gcn", "gate", "moe", "attention"])
def test_grad_of_functional_call_of_every_layer(name):
    torch.manual_seed(3)
    layer, inputs, output = _layers()[name]
    params = {k: v.detach() for k, v in layer.named_parameters()}
    buffers = dict(layer.named_buffers())
    grads = grad(lambda p: output(functional_call(layer, (p, buffers), inputs)).pow(2).sum())(params)
    layer.zero_grad()
    output(layer(*inputs)).pow(2).sum().backward()
    for key, p in layer.named_parameters():
        if p.grad is None:
            assert grads[key].abs().max() == 0
        else:
            torch.testing.assert_close(grads[key], p.grad)


def test_vmap_over_a_layers_input():
    torch.manual_seed(4)
    linear = sparsenn.SparseLinear(8, 6, sparsity=0.5).double()
    X = _x(5, 3, 8)
    torch.testing.assert_close(vmap(linear)(X), torch.stack([linear(x) for x in X]).detach())
    gcn = sparsenn.SparseGCNConv(4, 3).double()
    edges = torch.randint(0, 10, (2, 30), generator=torch.Generator().manual_seed(0))
    H = _x(3, 10, 4)
    torch.testing.assert_close(vmap(lambda h: gcn(h, edges))(H), torch.stack([gcn(h, edges) for h in H]).detach())


def test_transforms_leave_layer_caches_empty():
    """A cache filled inside a transform would hold its tensors after it ends."""
    gcn = sparsenn.SparseGCNConv(4, 3, cached=True).double()
    edges = torch.randint(0, 10, (2, 30), generator=torch.Generator().manual_seed(0))
    x = _x(10, 4)
    params = {k: v.detach() for k, v in gcn.named_parameters()}
    grad(lambda p: functional_call(gcn, p, (x, edges)).sum())(params)
    attention = sparsenn.BlockSparseAttention(16, 2, block_size=4, batch_first=True, seed=0).double().eval()
    y = _x(1, 64, 16)
    grad(lambda p: functional_call(attention, p, (y,))[0].sum())(dict(attention.named_parameters()))
    with torch.no_grad():
        torch.testing.assert_close(gcn(x, edges), functional_call(gcn, params, (x, edges)))
        assert torch.isfinite(attention(y)[0]).all()


@pytest.mark.parametrize("log", [False, True])
def test_softmax_transforms(log):
    A = _sparse((4, 5), "csr", seed=18, density=0.6)
    indices = A.coords()[0]
    w = _x(A.nnz, seed=19)
    ours_fn, ref_fn = (sparsenn.log_softmax, torch.log_softmax) if log else (sparsenn.softmax, torch.softmax)

    def ours(v):
        return ours_fn(A.with_values(v), -1).values

    def ref(v):
        full = torch.full(A.shape, float("-inf"), dtype=DT).index_put(tuple(indices), v)
        return ref_fn(full, -1)[tuple(indices)]

    v = A.values.clone()
    torch.testing.assert_close(jacrev(ours)(v), jacrev(ref)(v))
    torch.testing.assert_close(jacfwd(ours)(v), jacrev(ref)(v))
    torch.testing.assert_close(hessian(lambda v: ours(v) @ w)(v), hessian(lambda v: ref(v) @ w)(v))
    V = _x(3, A.nnz, seed=20)
    torch.testing.assert_close(vmap(ours)(V), torch.stack([ref(v) for v in V]))


def test_higher_order_gradients():
    """Backward passes are recorded einsums: create_graph=True differentiates them again."""
    A = _sparse((5, 5), "csr", seed=21, density=0.6)
    x = _x(5, seed=22)
    quadratic = lambda x: sparsenn.einsum("i,ij,j->", x, A, x)  # noqa: E731
    dense = A.to_dense()
    torch.testing.assert_close(torch.autograd.functional.hessian(quadratic, x), dense + dense.T)
    squares = lambda v: sparsenn.einsum("ij,j->i", A.with_values(v), x).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(torch.autograd.functional.hessian(squares, A.values),
                               torch.autograd.functional.hessian(lambda v: (_dense(A, v) @ x).pow(2).sum(), A.values))
    w = _x(A.nnz, seed=23)
    weights = lambda v: sparsenn.softmax(A.with_values(v)).values @ w  # noqa: E731
    full = lambda v: torch.full(A.shape, float("-inf"), dtype=DT).index_put(tuple(A.coords()[0]), v)  # noqa: E731
    reference = lambda v: torch.softmax(full(v), -1)[tuple(A.coords()[0])] @ w  # noqa: E731
    torch.testing.assert_close(torch.autograd.functional.hessian(weights, A.values),
                               torch.autograd.functional.hessian(reference, A.values))


def test_forward_mode_of_a_max_reduction_is_refused():
    A = _sparse((4, 5), "csr", seed=23)
    row_max = sparsenn.compile("M[i] = max[j](A[i,j])")
    f = lambda v: row_max(A.with_values(v))  # noqa: E731
    full = lambda v: torch.full(A.shape, float("-inf"), dtype=DT).index_put(tuple(A.coords()[0]), v)  # noqa: E731
    torch.testing.assert_close(jacrev(f)(A.values), jacrev(lambda v: full(v).amax(1))(A.values))
    with pytest.raises(NotImplementedError, match="reverse mode"):
        jacfwd(f)(A.values)


def test_second_derivatives_of_gradients_computed_together():
    """Under a transform a backward's gradient einsums run as one function
    (compiler/gradients.py), differentiated by its own rules: its jvp (jvp of grad) and
    its backward (grad of grad), here of a product whose two operands both move."""
    A = _sparse((5, 4), "csr", seed=31, density=0.6)
    x, t, u = _x(4, seed=32), _x(A.nnz, seed=33), _x(4, seed=34)
    ours = lambda v, x: sparsenn.einsum("ij,j->i", A.with_values(v), x).sin().sum()  # noqa: E731
    ref = lambda v, x: (_dense(A, v) @ x).sin().sum()  # noqa: E731

    def forward_over_reverse(f):
        return jvp(grad(f, argnums=(0, 1)), (A.values, x), (t, u))[1]

    def reverse_over_reverse(f):
        def directional(v, x):
            return sum((g * d).sum() for g, d in zip(grad(f, argnums=(0, 1))(v, x), (t, u)))
        return grad(directional, argnums=(0, 1))(A.values, x)

    torch.testing.assert_close(forward_over_reverse(ours), forward_over_reverse(ref))
    torch.testing.assert_close(reverse_over_reverse(ours), reverse_over_reverse(ref))


def test_per_sample_hessian_vector_products_of_a_sparse_layer():
    """vmap over jvp of grad: the gradients computed together are batched by their vmap
    rule and differentiated forward by their jvp."""
    A = _sparse((6, 5), "csr", seed=33, density=0.5)
    X, T = _x(3, 5, seed=34), _x(3, A.nnz, seed=35)

    def hvp(f):
        gradient = grad(f, argnums=0)
        return vmap(lambda x, t: jvp(lambda v: gradient(v, x), (A.values,), (t,))[1])(X, T)

    ours = lambda v, x: sparsenn.einsum("ij,j->i", A.with_values(v), x).tanh().sum()  # noqa: E731
    ref = lambda v, x: (_dense(A, v) @ x).tanh().sum()  # noqa: E731
    torch.testing.assert_close(hvp(ours), hvp(ref))


def test_a_vmapped_sparse_mlp_records_one_node_per_layer():
    """A SparseLinear's product and bias are one recorded call under vmap, as outside it."""
    torch.manual_seed(5)
    model = nn.Sequential(sparsenn.SparseLinear(8, 6, sparsity=0.5), nn.ReLU(),
                          sparsenn.SparseLinear(6, 3, sparsity=0.5)).double()
    X = _x(4, 2, 8)
    out = vmap(model)(X)
    assert autograd_nodes(out).count("_SparseEinsumBackward") == 2
    torch.testing.assert_close(out, torch.stack([model(x) for x in X]))
    out.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model(X).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad)


@pytest.mark.parametrize("other", ["dense", "sparse"])
def test_gradient_of_a_sparse_operand_keeps_every_stored_position(other):
    """d/dA of ``A[i,j] * B[i,j]`` lies on A's pattern: B's values where B is dense (A's
    pattern alone bounds the product), and zeros where a sparse B stores nothing."""
    A = _sparse((5, 6), "csr", seed=40)
    B = _sparse((5, 6), "csr", seed=41) if other == "sparse" else _x(5, 6, seed=41)
    dense_b = B.to_dense() if other == "sparse" else B
    v = A.values.clone().requires_grad_()
    out = sparsenn.einsum("ij,ij->ij", A.with_values(v), B)
    (out.values if isinstance(out, SparseTensor) else out).sum().backward()
    torch.testing.assert_close(v.grad, dense_b[tuple(A.coords()[0])])


def test_per_sample_weight_gradients_over_a_batch_of_one():
    """Per-sample calls sum over a batch of one (``x.unsqueeze(0)``): the batched call
    drops that index, wherever the batch dimension is and whichever operand is batched."""
    W = _sparse((6, 5), "csr", seed=42)
    mask = W.with_values(torch.ones_like(W.values))
    dY, X = _x(4, 1, 6, seed=43), _x(4, 1, 5, seed=44)
    f = lambda dy, x: sparsenn.einsum("bo,bi,oi->oi", dy, x, mask).values  # noqa: E731
    expected = torch.stack([f(dy, x) for dy, x in zip(dY, X)])
    before = _calls()
    torch.testing.assert_close(vmap(f)(dY, X), expected)
    assert _calls() - before == 1
    torch.testing.assert_close(vmap(f, in_dims=(1, 1))(dY.transpose(0, 1), X.transpose(0, 1)), expected)
    torch.testing.assert_close(vmap(f, in_dims=(0, None))(dY, X[0]), torch.stack([f(dy, X[0]) for dy in dY]))
    V = _x(3, W.nnz, seed=45)
    g = lambda v: sparsenn.einsum("bi,oi->o", X[0], W.with_values(v))  # noqa: E731
    torch.testing.assert_close(vmap(g)(V), torch.stack([g(v) for v in V]))

    def loss(v, x):
        return sparsenn.einsum("bi,oi->bo", x.unsqueeze(0), W.with_values(v)).tanh().sum()

    reference = lambda v, x: (_dense(W, v) @ x).tanh().sum()  # noqa: E731
    torch.testing.assert_close(vmap(grad(loss), in_dims=(None, 0))(W.values, X[:, 0]),
                               vmap(grad(reference), in_dims=(None, 0))(W.values, X[:, 0]))
