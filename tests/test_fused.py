"""Fused kernels (compiler/lower/fuse.py, compiler/runtime/fused.py): steps whose later
assignments read earlier results at their own team coordinates run as one kernel, and
equal the steps run one by one; steps that would read a result elsewhere do not fuse."""

from __future__ import annotations

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler import cache_stats
from sparsenn.compiler.functions import apply
from sparsenn.compiler.notation import Access, Assignment, Constant, Factor, Term
from sparsenn.compiler.runtime.evaluate import evaluate
from sparsenn.compiler.runtime.fused import Result, Step, run_steps
from sparsenn.functional import _fused_softmax_grad, softmax_steps


def random_sparse(shape, fmt, dtype=torch.float64, seed=0) -> SparseTensor:
    """About 40 % of the entries stored, slice 1 along mode 0 empty."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < 0.4)
    dense[1] = 0
    return sparsenn.from_dense(dense, format=fmt)


def one_by_one(steps, operands) -> list:
    """The steps' results evaluated separately (``into`` ignored: a fresh result)."""
    results = []
    for step in steps:
        ops = [operands[s] if isinstance(s, int) else results[s.step] for s in step.operands]
        results.append(evaluate(step.assignment, ops, step.out_format(ops)))
    return results


def assignment(output, factors, value, reduction="sum") -> Assignment:
    return Assignment(output, (Term(1.0, factors, value),), tuple(f"T{n}" for n in range(len(factors))), reduction)


ROWS, FULL = ("i",), ("i", "j")
ROW_SUM = assignment(ROWS, (Access(0, FULL),), None)
# P = S * (1 / N[i]) on S's pattern, and the same reading N at j (another row's sum).
SCALE = apply("mul", Factor(0), apply("div", Constant(1.0), Factor(1)))
SCALED = assignment(FULL, (Access(0, FULL), Access(1, ROWS)), SCALE)
SCALED_ACROSS = assignment(FULL, (Access(0, FULL), Access(1, ("j",))), SCALE)


@pytest.mark.parametrize("fmt, shape", [("csr", (40, 70)), ("bsr(4,8)", (40, 64)), ("dddc(1,1,4,4)", (2, 3, 16, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_softmax_steps_fuse_and_equal_the_steps_one_by_one(fmt, shape, dtype):
    S = random_sparse(shape, fmt, dtype)
    steps = softmax_steps(S.ndim, S.ndim - 1)
    fused = run_steps(steps, [S])
    assert fused is not None, "rows over dense levels fuse"
    separate = one_by_one(steps, [S])
    torch.testing.assert_close(fused[0], separate[0], rtol=0, atol=0)  # the max is exact
    for k in (2, 3):  # Z, then P written over E
        torch.testing.assert_close(fused[k].to_dense() if k == 3 else fused[k],
                                   separate[k].to_dense() if k == 3 else separate[k])
    assert fused[1].values.data_ptr() == fused[3].values.data_ptr(), "P overwrites E in place"
    torch.testing.assert_close(fused[3].to_dense(), sparsenn.softmax(S, -1).to_dense())
    d_out, P = S.with_values(torch.randn_like(S.values)), fused[3]
    grad_steps = _fused_softmax_grad(S.ndim, S.ndim - 1)
    fused_grad = run_steps(grad_steps, [d_out, P])
    assert fused_grad is not None
    torch.testing.assert_close(fused_grad[1].values, one_by_one(grad_steps, [d_out, P])[1].values)


def test_a_fused_kernel_computes_the_same_on_one_thread_and_on_two():
    """Every row is computed by one thread, in the same order: bit for bit equal."""
    S = random_sparse((300, 257), "csr", torch.float32, seed=3)
    S = S.with_values(S.values.abs() + 0.5)  # row sums far from 0
    steps = (Step(ROW_SUM, (0,)), Step(SCALED, (0, Result(0)), on=0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_steps(steps, [S])[1].values.clone()
        torch.set_num_threads(2)
        two = run_steps(steps, [S])[1].values
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    rows = S.to_dense().sum(1, keepdim=True)
    expected = torch.where(S.to_dense() != 0, S.to_dense() / rows, 0.0)
    torch.testing.assert_close(S.with_values(two).to_dense(), expected)


def test_steps_reading_a_result_at_another_coordinate_do_not_fuse():
    """``N[j]`` is the sum of row ``j``, which the row ``i`` being scaled need not have
    computed yet: run_steps declines, and the steps one by one are right."""
    S = random_sparse((30, 30), "csr")
    steps = (Step(ROW_SUM, (0,)), Step(SCALED_ACROSS, (0, Result(0)), on=0))
    assert run_steps(steps, [S]) is None
    scaled = one_by_one(steps, [S])[1].to_dense()
    dense = S.to_dense()
    torch.testing.assert_close(scaled, torch.where(dense != 0, dense / dense.sum(1)[None, :], 0.0))


@pytest.mark.parametrize("fmt", ["dcsr", "coo", "csc"])
def test_rows_not_stored_first_over_dense_levels_do_not_fuse(fmt):
    S = random_sparse((20, 30), fmt)
    assert run_steps(softmax_steps(2, 1), [S]) is None


def test_sixteen_bit_values_and_a_wrong_in_place_write_do_not_fuse():
    S = random_sparse((20, 30), "csr", torch.float32)
    assert run_steps(softmax_steps(2, 1), [S.with_values(S.values.bfloat16())]) is None
    into_dense = (Step(ROW_SUM, (0,)), Step(SCALED, (0, Result(0)), on=0, into=0))
    assert run_steps(into_dense, [S]) is None


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("block, head_dim", [(4, 16), (16, 32)], ids=["dot-tile", "register-tile"])
def test_attention_scores_and_softmax_fuse_and_equal_them_apart(block, head_dim, padded, avx2_host):
    """BlockSparseAttention's block SDDMM (a dot tile, or a register tile with ``K``
    re-laid out first) and softmax's steps run as one kernel per block row, the softmax
    written over the scores."""
    from sparsenn.layers.attention import _probability_steps, _scores

    layer = sparsenn.BlockSparseAttention(2 * head_dim, 2, block_size=block, seed=0)
    mask = layer._mask_for(layer._forward_pattern(8 * block), 2, None, torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 8 * block, head_dim, generator=g) for _ in range(2))
    operands = [mask, q, k]
    if padded:
        operands.append(torch.zeros(2, 8 * block).masked_fill_(torch.arange(8 * block) >= 7 * block + 1, float("-inf")))
    tile = "dot tile" if block == 4 else "register tile"
    assert tile in _scores(layer._score_scale, False).explain(*operands[:3])
    steps = _probability_steps(layer._score_scale, padded, block)
    fused = run_steps(steps, operands)
    assert fused is not None
    scores = fused[0]
    assert all(r.values.data_ptr() == scores.values.data_ptr() for r in (fused[2], fused[4])), "in place"
    expected = sparsenn.softmax(_scores(layer._score_scale, padded)(*operands), -1)
    torch.testing.assert_close(fused[4].values, expected.values)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_traced_softmax_runs_the_steps_as_eager_does(fmt):
    """Under torch.compile the forward and backward steps are ``sparsenn::evaluate`` ops:
    fused as in eager mode for CSR (equal bit for bit), one by one for COO."""
    S = random_sparse((12, 20), fmt, torch.float32, seed=5)

    def loss(values: torch.Tensor) -> torch.Tensor:
        return (sparsenn.softmax(S.with_values(values), -1).values * torch.arange(values.numel())).sum()

    eager_values = S.values.clone().requires_grad_()
    traced_values = S.values.clone().requires_grad_()
    eager, traced = loss(eager_values), torch.compile(loss, fullgraph=True, backend="aot_eager")(traced_values)
    eager.backward()
    traced.backward()
    exact = dict(rtol=0, atol=0) if fmt == "csr" else {}
    torch.testing.assert_close(traced, eager, **exact)
    torch.testing.assert_close(traced_values.grad, eager_values.grad, **exact)


def lookups() -> tuple[int, int]:
    """Lookups so far of the fused steps (one per ``run_steps``) and of the calls (one
    per evaluation outside a fused kernel), from ``cache_stats()``."""
    stats = cache_stats()
    return tuple(stats[name].hits + stats[name].misses for name in ("fused steps", "calls"))


@pytest.mark.parametrize("length", [32, 29], ids=["whole-blocks", "padded-tail"])
@pytest.mark.parametrize("block, head_dim", [(4, 16), (16, 32)], ids=["dot-tile", "register-tile"])
def test_attention_inference_runs_its_spmm_in_the_fused_kernel(block, head_dim, length, avx2_host):
    """Without gradients or dropout, ``O = P V`` is the last step of the attention's fused
    kernel (one fused call, nothing evaluated apart: steps that did not fuse would be run
    again without the SpMM, then the SpMM on its own); it gives what the separate SpMM
    gives when a gradient is needed, and the weights it returns are the probabilities
    the SpMM read."""
    layer = sparsenn.BlockSparseAttention(2 * head_dim, 2, block_size=block, num_window_blocks=3,
                                          num_random_blocks=1, seed=0).eval()
    length *= block // 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, length, head_dim, generator=g) for _ in range(3))
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, length // 2:] = True
    fused, calls = lookups()
    with torch.no_grad():
        out, weights = layer.attend(q, k, v, padding, need_weights=True)
    assert lookups() == (fused + 1, calls)
    fused, calls = lookups()
    expected, expected_weights = layer.attend(q, k, v.requires_grad_(), padding, need_weights=True)
    after_fused, after_calls = lookups()
    assert after_fused == fused + 1 and after_calls > calls  # the scores and softmax fused, the SpMM apart
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights.to_dense(), expected_weights.to_dense())


def test_traced_steps_name_values_put_on_a_dense_result():
    """A step whose values would sit on the pattern of an earlier dense result has no
    pattern to take: a ValueError while tracing, not a crash."""
    from sparsenn.compiler.runtime.ops import Layout, _steps_anchor

    steps = (Step(ROW_SUM, (0,)), Step(SCALED, (0, Result(0)), on=1))
    with pytest.raises(ValueError, match="step 0's result is dense"):
        _steps_anchor(steps, (Layout(sparsenn.parse_format("csr", 2), torch.int64),))
