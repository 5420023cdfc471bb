"""SparseMoEGate and SparseMoE against dense references computing every expert."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sparsenn
from sparsenn import SparseMoE, SparseMoEGate, SparseTensor
from sparsenn.compiler.plan.target import Target
from sparsenn.layers.moe import capacity, dispatch

FP32 = {"rtol": 1e-5, "atol": 1e-5}
ROOT = Path(__file__).resolve().parents[1]


def dense_gates(gates: SparseTensor) -> torch.Tensor:
    """The gate as a dense (T, E) tensor, differentiable w.r.t. its values."""
    rows = torch.repeat_interleave(torch.arange(gates.shape[0]), gates.pos[1].long().diff())
    return gates.values.new_zeros(gates.shape).index_put((rows, gates.crd[1].long()), gates.values)


def dense_moe(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the gate."""
    tokens = x.reshape(-1, layer.d_model)
    g = dense_gates(layer.gate(x).gates)
    hidden = torch.einsum("td,edh->eth", tokens, layer.w1)
    if layer.b1 is not None:
        hidden = hidden + layer.b1[:, None, :]
    act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[layer.activation](hidden)
    y = torch.einsum("te,eth,ehd->td", g, act, layer.w2)
    if layer.b2 is not None:
        y = y + g @ layer.b2
    return y.view(x.shape)


def layer(d=12, h=20, experts=4, k=2, bias=False, dtype=torch.float32, seed=0, **gate):
    torch.manual_seed(seed)
    gate_module = SparseMoEGate(d, experts, k=k, dtype=dtype, **gate) if gate else None
    moe = SparseMoE(d, h, experts, k=k, gate=gate_module, bias=bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            moe.b1.normal_()
            moe.b2.normal_()
    return moe


def grads(moe: SparseMoE, x: torch.Tensor, forward) -> list[torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = forward(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [x.grad] + [p.grad for p in moe.parameters()]


@pytest.mark.parametrize("experts, k", [(4, 1), (4, 2), (3, 3), (8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_match_the_dense_reference(experts, k, bias):
    moe = layer(experts=experts, k=k, bias=bias)
    x = torch.randn(2, 9, 12)
    torch.testing.assert_close(moe(x), dense_moe(moe, x), **FP32)
    ours, ref = grads(moe, x, moe), grads(moe, x, lambda t: dense_moe(moe, t))
    assert moe.gate.router.weight.grad.abs().sum() > 0  # the router is trained through the gate's values
    for name, a, b in zip(["x"] + [n for n, _ in moe.named_parameters()], ours, ref):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_other_activations(activation):
    torch.manual_seed(1)
    moe = SparseMoE(8, 16, 4, activation=activation)
    x = torch.randn(10, 8)
    torch.testing.assert_close(moe(x), dense_moe(moe, x), **FP32)


def test_gradcheck_fp64_including_the_router():
    moe = layer(d=4, h=6, experts=3, k=2, bias=True, dtype=torch.float64)
    names = ("w1", "w2", "b1", "b2", "gate.router.weight")
    weights = tuple(dict(moe.named_parameters())[n].detach().clone().requires_grad_() for n in names)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def f(x, *weights):
        return torch.func.functional_call(moe, dict(zip(names, weights)), (x,))

    assert torch.autograd.gradcheck(f, (x, *weights))


def test_gate_rows_hold_k_distinct_sorted_experts_with_normalised_weights():
    gate = SparseMoEGate(6, 5, k=3)
    x = torch.randn(40, 6)
    out = gate(x)
    gates = out.gates
    SparseTensor(gates.shape, gates.format, gates.pos, gates.crd, gates.values.detach(), check=True)  # sorted, unique
    assert torch.equal(gates.pos[1].diff(), torch.full((40,), 3, dtype=gates.index_dtype))
    torch.testing.assert_close(gates.to_dense().sum(-1), torch.ones(40))
    probs = gate.router(x).softmax(-1)
    top = probs.topk(3, -1).indices.sort(-1).values
    assert torch.equal(gates.crd[1].long().view(40, 3), top)


def test_unnormalised_weights_are_the_softmax():
    gate = SparseMoEGate(6, 5, k=2, normalize=False)
    x = torch.randn(7, 6)
    probs = gate.router(x).softmax(-1)
    g = gate(x).gates.to_dense()
    torch.testing.assert_close(g, probs * (g != 0))


def test_k_equal_to_num_experts_is_the_dense_mixture():
    moe = layer(experts=3, k=3)
    x = torch.randn(6, 12)
    probs = moe.gate.router(x).softmax(-1)
    ffn = torch.einsum("eth,ehd->etd", F.gelu(torch.einsum("td,edh->eth", x, moe.w1)), moe.w2)
    torch.testing.assert_close(moe(x), torch.einsum("te,etd->td", probs, ffn), **FP32)


def test_an_expert_without_tokens_gets_zero_gradients_not_none():
    moe = layer(experts=4, k=1)
    with torch.no_grad():
        moe.gate.router.weight.zero_()
        moe.gate.router.weight[0, 0], moe.gate.router.weight[1, 0] = -5.0, 5.0  # sign of x[:, 0]: expert 0 or 1
    x = torch.randn(16, 12)
    x[:, 0] = x[:, 0].abs() + 0.1
    x[:8, 0] *= -1
    y = moe(x)
    assert set(moe.gate(x).gates.crd[1].tolist()) == {0, 1}
    torch.testing.assert_close(y, dense_moe(moe, x), **FP32)
    y.sum().backward()
    for p in (moe.w1, moe.w2):
        assert p.grad is not None
        assert torch.count_nonzero(p.grad[2:]) == 0 and torch.count_nonzero(p.grad[:2]) > 0


def test_no_python_loop_over_experts_and_explain_shows_the_gathered_tile(avx2_host):
    # ~300 tokens per expert: each product is one kernel, the expert's weights packed.
    moe = layer(d=16, h=64, experts=2, k=1)
    text = moe.explain(torch.randn(600, 16))
    assert text.count("stored rows of factor 0") == 2 and text.count("packed per thread in panels") == 2
    y = moe(torch.randn(600, 16))
    assert y.shape == (600, 16)


DDP_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sparsenn import SparseMoE

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/rendezvous", rank=0, world_size=1)
try:
    torch.manual_seed(0)
    moe = SparseMoE(12, 20, 4, k=1, bias=True)
    with torch.no_grad():
        moe.gate.router.weight.zero_()
        moe.gate.router.weight[0, 0], moe.gate.router.weight[1, 0] = -5.0, 5.0
    model = DistributedDataParallel(moe, find_unused_parameters=False)
    x = torch.randn(16, 12)
    for _ in range(2):  # DDP raises on the second step if a parameter got no gradient in the first
        model.zero_grad()
        model(x).square().sum().backward()
    assert all(p.grad is not None for p in moe.parameters())
    assert torch.count_nonzero(moe.w1.grad[2:]) == 0 and torch.count_nonzero(moe.b2.grad[2:]) == 0
finally:
    dist.destroy_process_group()
"""


def test_ddp_without_find_unused_parameters_trains_with_an_empty_expert(tmp_path):
    """In a process of its own, with a time limit: a gloo process group that outlives
    a test can stall the test process when it is destroyed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", DDP_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def reference_capacity(probs_chosen: torch.Tensor, experts: torch.Tensor, limit: int) -> torch.Tensor:
    """Per expert, keep the `limit` routing choices of highest probability (ties: lower token)."""
    keep = torch.zeros(experts.numel(), dtype=torch.bool)
    for e in experts.unique().tolist():
        mine = [j for j in range(experts.numel()) if experts[j] == e]
        mine.sort(key=lambda j: (-float(probs_chosen[j]), j))
        keep[mine[:limit]] = True
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_dropping_matches_a_reference(factor):
    torch.manual_seed(3)
    gate = SparseMoEGate(6, 4, k=2, capacity_factor=factor)
    with torch.no_grad():
        gate.router.weight[0] += 1.0  # crowd expert 0
    x = torch.randn(30, 6).abs()
    probs = gate.router(x).softmax(-1)
    chosen = probs.topk(2, -1).indices.sort(-1).values
    chosen_probs = probs.detach().gather(1, chosen).reshape(-1)
    keep = reference_capacity(chosen_probs, chosen.reshape(-1), capacity(30, 4, 2, factor))
    out = gate(x)
    assert out.dropped == int((~keep).sum())
    assert factor == 1.25 or out.dropped > 0
    expected = (probs.gather(1, chosen) / probs.gather(1, chosen).sum(-1, keepdim=True)).reshape(-1) * keep
    want = torch.zeros(30, 4).scatter(1, chosen, expected.view(30, 2))
    torch.testing.assert_close(out.gates.to_dense(), want)
    moe = SparseMoE(6, 10, 4, gate=gate)
    torch.testing.assert_close(moe(x), dense_moe(moe, x), **FP32)


def test_capacity_formula():
    assert capacity(4096, 8, 2, 1.0) == 1024
    assert capacity(10, 3, 1, 1.0) == math.ceil(10 / 3)


def test_aux_and_z_losses_match_their_formulas():
    gate = SparseMoEGate(6, 5, k=2)
    x = torch.randn(23, 6)
    out = gate(x)
    logits = gate.router(x)
    probs = logits.softmax(-1)
    chosen = probs.topk(2, -1).indices
    f = torch.stack([(chosen == i).sum() for i in range(5)]).float() / (23 * 2)
    torch.testing.assert_close(out.aux_loss, 5 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(out.z_loss, (torch.logsumexp(logits, -1) ** 2).mean())
    (out.aux_loss + out.z_loss).backward()
    assert gate.router.weight.grad.abs().sum() > 0


def test_no_tokens():
    moe = SparseMoE(8, 16, 4)
    y = moe(torch.randn(0, 8))
    assert y.shape == (0, 8) and moe.aux_loss == 0 and moe.z_loss == 0


def test_noise_only_in_training_and_gumbel_keeps_softmax_weights():
    x = torch.randn(50, 6)
    for noise in ("jitter", "gumbel"):
        torch.manual_seed(0)
        gate = SparseMoEGate(6, 4, k=1, noise=noise, normalize=False)
        clean = SparseMoEGate(6, 4, k=1, normalize=False)
        clean.load_state_dict(gate.state_dict())
        gate.eval()
        torch.testing.assert_close(gate(x).gates.to_dense(), clean(x).gates.to_dense())
        gate.train()
        noisy = gate(x).gates
        if noise == "jitter":  # 1 % on the input: the weights move, rarely the choices
            assert not torch.equal(noisy.to_dense(), clean(x).gates.to_dense())
        else:
            assert not torch.equal(noisy.crd[1], clean(x).gates.crd[1])
            probs = gate.router(x).softmax(-1)
            torch.testing.assert_close(noisy.values, probs.gather(1, noisy.crd[1].long()[:, None]).squeeze(1))


def test_dispatch_panels():
    gates = SparseTensor.from_dense(torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0], [0.3, 0.0, 0.7]]), "csr")
    plan = dispatch(gates)
    assert plan.capacity == 3  # expert 2 takes all three tokens; expert 1 none
    assert plan.slots.to_dense().tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert plan.gather.to_dense().nonzero().tolist() == [[0, 0], [1, 2], [6, 0], [7, 1], [8, 2]]
    assert plan.combine.to_dense().nonzero().tolist() == [[0, 0], [0, 6], [1, 7], [2, 1], [2, 8]]


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="exceeds num_experts"):
        SparseMoEGate(8, 4, k=5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        SparseMoE(8, 16, 4, k=0)
    with pytest.raises(TypeError, match="k must be an int"):
        SparseMoEGate(8, 4, k=1.5)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        SparseMoEGate(8, 4, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="noise must be one of"):
        SparseMoEGate(8, 4, noise="gaussian")
    with pytest.raises(ValueError, match="activation must be one of"):
        SparseMoE(8, 16, 4, activation="tanh")
    with pytest.raises(ValueError, match="gate has"):
        SparseMoE(8, 16, 4, gate=SparseMoEGate(8, 6))
    moe = SparseMoE(8, 16, 4)
    with pytest.raises(ValueError, match="d_model=8"):
        moe(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype"):
        moe(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        moe([[0.0] * 8])
    with pytest.raises(ValueError, match="csr"):
        dispatch(SparseTensor.from_dense(torch.eye(3), "coo"))


def test_drop_in_ffn_trains():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(8), SparseMoE(8, 16, 4, k=2))
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    x, target = torch.randn(32, 8), torch.randn(32, 8)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        moe = block[1]
        loss = F.mse_loss(block(x), target) + 0.01 * moe.aux_loss + 1e-3 * moe.z_loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
