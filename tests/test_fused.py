"""Fused kernels (compiler/plan/fusion.py decides, compiler/lower/fuse.py lowers,
compiler/runtime/programs.py runs): the statements of sparsenn's softmax, its gradient
and BlockSparseAttention, which read earlier results at their own team coordinates, run
as one kernel and equal the statements run one by one; statements that would read a
result elsewhere, or operands not stored row first, do not fuse."""

from __future__ import annotations

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler import cache_stats
from sparsenn.compiler.frontend.program import stage_inputs
from sparsenn.compiler.runtime.evaluate import evaluate
from sparsenn.functional import _softmax


def random_sparse(shape, fmt, dtype=torch.float64, seed=0) -> SparseTensor:
    """About 40 % of the entries stored, slice 1 along mode 0 empty."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < 0.4)
    dense[1] = 0
    return sparsenn.from_dense(dense, format=fmt)


def one_by_one(expression, operands) -> list:
    """The program's stages evaluated separately."""
    results = []
    for step in expression.program(operands).stages:
        results.append(evaluate(step.assignment, stage_inputs(step, operands, results), step.out_format))
    return results


def fused_stages(explained: str) -> list[str]:
    """The groups of stages ``explain()`` lists as fused kernels."""
    return [line.removeprefix("fused kernel of stages ").removesuffix(":") for line in explained.splitlines()
            if line.startswith("fused kernel of stages ")]


@pytest.mark.parametrize("fmt, shape", [("csr", (40, 70)), ("bsr(4,8)", (40, 64)), ("dddc(1,1,4,4)", (2, 3, 16, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_softmax_and_its_gradient_fuse_and_equal_the_statements_one_by_one(fmt, shape, dtype):
    S = random_sparse(shape, fmt, dtype)
    softmax = _softmax(S.ndim, S.ndim - 1)
    assert fused_stages(softmax.explain(S)) == ["0, 1, 2, 3"], "rows over dense levels fuse"
    separate = one_by_one(softmax, [S])
    for _ in range(2):
        torch.testing.assert_close(softmax(S).to_dense(), separate[-1].to_dense())
    torch.testing.assert_close(separate[-1].to_dense(), sparsenn.softmax(S, -1).to_dense())
    values = S.values.clone().requires_grad_()
    d_out = torch.randn_like(values)
    dense = S.with_values(values).to_dense().masked_fill(S.with_values(torch.ones_like(values)).to_dense() == 0,
                                                          float("-inf"))
    expected, = torch.autograd.grad(torch.softmax(dense, -1).nan_to_num(0.0), dense, S.with_values(d_out).to_dense())
    for _ in range(2):
        computed, = torch.autograd.grad(sparsenn.softmax(S.with_values(values), -1).values, values, d_out)
        torch.testing.assert_close(S.with_values(computed).to_dense(), expected.nan_to_num(0.0))


@pytest.mark.parametrize("fmt", ["dcsr", "coo", "csc"])
def test_rows_not_stored_first_over_dense_levels_do_not_fuse(fmt):
    S = random_sparse((20, 30), fmt)
    softmax = _softmax(2, 1)
    explained = softmax.explain(S)
    assert not fused_stages(explained) and "not fused" in explained
    for _ in range(2):
        torch.testing.assert_close(softmax(S).to_dense(), torch.softmax(S.to_dense().masked_fill(
            S.with_values(torch.ones_like(S.values)).to_dense() == 0, float("-inf")), 1).nan_to_num(0.0))


def test_sixteen_bit_values_do_not_fuse():
    S = random_sparse((20, 30), "csr", torch.float32)
    explained = _softmax(2, 1).explain(S.with_values(S.values.bfloat16()))
    assert not fused_stages(explained) and "computes in torch.bfloat16" in explained


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("block, head_dim", [(4, 16), (16, 32)], ids=["dot-tile", "register-tile"])
def test_attention_scores_and_softmax_fuse_and_equal_them_apart(block, head_dim, padded, avx2_host):
    """BlockSparseAttention's block SDDMM (a dot tile, or a register tile with ``K``
    re-laid out first) and softmax's statements run as one kernel per block row."""
    from sparsenn.layers.attention import _probabilities, _scores

    layer = sparsenn.BlockSparseAttention(2 * head_dim, 2, block_size=block, seed=0)
    mask = layer._masks.mask(8, 2, None, None, False, torch.float32, True)[0]
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 8 * block, head_dim, generator=g) for _ in range(2))
    operands = [mask, q, k]
    if padded:
        operands.append(torch.zeros(2, 8 * block).masked_fill_(torch.arange(8 * block) >= 7 * block + 1, float("-inf")))
    tile = "dot tile" if block == 4 else "register tile"
    scores = sparsenn.compile(_scores(layer._score_scale, padded))
    assert tile in sparsenn.compile(_scores(layer._score_scale, False)).explain(*operands[:3])
    program = _probabilities(layer._score_scale, padded)
    assert fused_stages(program.explain(*operands)) == ["0, 1, 2, 3, 4"]
    expected = sparsenn.softmax(scores(*operands), -1)
    for _ in range(2):
        torch.testing.assert_close(program(*operands).values, expected.values)


def fused_vector_bytes(explained: str) -> list[int]:
    """The vector width each fused kernel ``explain()`` prints is compiled at."""
    widths = []
    for part in explained.split("fused kernel of stages ")[1:]:
        define = next(line for line in part.splitlines() if line.startswith("#define SN_VECTOR_BYTES "))
        widths.append(int(define.split()[-1]))
    return widths


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 4), (torch.float64, 2)], ids=["fp32", "fp64"])
def test_a_stage_on_16_byte_vectors_fuses_only_at_its_width(machine, dtype, head_dim, host_target):
    """Attention over heads of 16 bytes: ``O = P V``'s register blocks hold a row of ``V``
    in one 16-byte vector. Fused after statements without register blocks (their loops
    work at any width) the group is compiled at 16 bytes; after a register tile of wider
    vectors (the fp64 scores' on AVX2) it stays apart. Either way it gives what the
    statements give one by one."""
    import _machines
    from sparsenn.layers.attention import _attention

    host_target(getattr(_machines, machine))
    layer = sparsenn.BlockSparseAttention(2 * head_dim, 2, block_size=4, num_window_blocks=3, num_random_blocks=1,
                                          seed=0).eval()
    mask = layer._masks.mask(8, 2, None, None, False, dtype, True)[0]
    g = torch.Generator().manual_seed(0)
    operands = [mask, *(torch.randn(2, 2, 32, head_dim, generator=g, dtype=dtype) for _ in range(3))]
    program = _attention(layer._score_scale, False, False, False)
    explained = program.explain(*operands)
    assert "vectors of 16 bytes (not 32): register blocks over rows of at most 16 bytes" in explained
    if fused_stages(explained) == ["0, 1, 2, 3, 4, 5"]:
        assert fused_vector_bytes(explained) == [16]
    else:
        assert fused_stages(explained) == ["0, 1, 2, 3, 4"] and fused_vector_bytes(explained) == [32]
        assert "O (stage 5) not fused with P (stage 4): its register blocks are sized for another vector width" \
            in explained
    if dtype == torch.float32:
        assert fused_stages(explained) == ["0, 1, 2, 3, 4, 5"]
    if machine == "AVX2":  # runs on any host
        torch.testing.assert_close(program(*operands), one_by_one(program, operands)[-1])


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
    """Lookups so far of the program runners (one per program call) and of the calls (one
    per evaluation outside a fused kernel), from ``cache_stats()``."""
    stats = cache_stats()
    return tuple(stats[name].hits + stats[name].misses for name in ("program runners", "calls"))


@pytest.mark.parametrize("length", [32, 29], ids=["whole-blocks", "padded-tail"])
@pytest.mark.parametrize("block, head_dim", [(4, 16), (16, 32)], ids=["dot-tile", "register-tile"])
def test_attention_inference_runs_its_spmm_in_the_fused_kernel(block, head_dim, length, avx2_host):
    """Without gradients or dropout, ``O = P V`` is the last statement of the attention's fused
    kernel (one program call, nothing evaluated apart); it gives what the separate SpMM
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


@pytest.mark.parametrize("workers", [1, 2])
def test_a_long_fused_kernel_is_two_translation_units_computing_the_same(monkeypatch, workers, avx2_host):
    """A fused kernel longer than ``$SPARSENN_SPLIT_LINES`` prints its stages as functions in two
    translation units (compiled at once with several cores, whole with one): the same
    results, bit for bit, as with the stages inline."""
    from sparsenn.compiler.backend import codegen, jit
    from sparsenn.compiler.runtime.cache import clear_caches
    from sparsenn.layers.attention import _attention

    layer = sparsenn.BlockSparseAttention(64, 2, block_size=16, num_window_blocks=3, num_random_blocks=1, seed=0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 128, 32, generator=g) for _ in range(3))
    padding = torch.zeros(2, 128, dtype=torch.bool)
    padding[1, 70:] = True
    mask = layer._masks.mask(8, 2, padding, None, False, torch.float32, True)[0]
    bias = torch.zeros(2, 128).masked_fill_(padding, float("-inf"))
    monkeypatch.setenv(jit.WORKERS_ENV, str(workers))
    results = {}
    for lines in (10**9, 0):
        monkeypatch.setenv(codegen.SPLIT_LINES_ENV, str(lines))
        clear_caches()
        program = _attention(layer._score_scale, True)
        explained = program.explain(mask, q, k, bias, v)
        assert (jit.PART_BREAK in explained) == (lines == 0)
        assert ("sn_stage5(sn_at, arrays, dims, nthreads);" in explained) == (lines == 0)
        with torch.no_grad():
            results[lines] = program(mask, q, k, bias, v)
    assert torch.equal(results[0], results[10**9])


def test_each_stage_of_a_long_fused_kernel_is_compiled_once(tmp_path):
    """The stages printed as functions are neither inlined into ``sn_run``'s team and
    single-thread loops nor cloned by the compiler's constant propagation: the library
    holds one copy of each (what its build costs grows with the copies), whether its two
    units are compiled whole (one worker) or apart. Fresh processes: the kernel is built."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from sparsenn.compiler.backend import codegen, jit

    nm = shutil.which("nm") or shutil.which("llvm-nm")  # the toolchain that links kernels ships one
    assert nm is not None, "no nm (binutils or LLVM) on PATH beside the kernels' compiler"
    script = """if True:
        import torch, sparsenn
        from sparsenn.layers.attention import _attention
        layer = sparsenn.BlockSparseAttention(64, 2, block_size=16, num_window_blocks=3, num_random_blocks=1, seed=0)
        padding = torch.zeros(2, 128, dtype=torch.bool)
        padding[1, 70:] = True
        q, k, v = (torch.randn(2, 2, 128, 32) for _ in range(3))
        mask = layer._masks.mask(8, 2, padding, None, False, torch.float32, True)[0]
        bias = torch.zeros(2, 128).masked_fill_(padding, float("-inf"))
        with torch.no_grad():
            _attention(layer._score_scale, True)(mask, q, k, bias, v)
    """
    root = Path(__file__).resolve().parents[1]
    for workers in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(root), "SPARSENN_CACHE_DIR": str(tmp_path / workers),
               codegen.SPLIT_LINES_ENV: "0", jit.WORKERS_ENV: workers, jit.QUIET_ENV: "1"}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
        (library,) = (tmp_path / workers).glob("fused_einsum_*.so")
        symbols = subprocess.run([nm, str(library)], capture_output=True, text=True, check=True).stdout.split()
        stages = sorted(symbol for symbol in symbols if "sn_stage" in symbol)
        assert len(stages) >= 2 and stages == sorted(f"_Z9sn_stage{k}lPKPvPKli" for k in range(len(stages))), stages
