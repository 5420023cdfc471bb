"""The runtime: bounded caches, frozen plans shared across shapes, one launcher, and a
result type that depends on formats only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sparsenn
from sparsenn import SparseLinear, SparseTensor
from sparsenn.compiler import cache_stats, clear_caches
from sparsenn.compiler.plan.planner import decisions, operand_info, path_request
from sparsenn.compiler import api
from sparsenn.compiler.runtime import launcher, memory
from sparsenn.compiler.runtime.cache import LRUCache
from sparsenn.compiler.runtime.evaluate import resolve
from sparsenn.compiler.runtime.launcher import Launch
from sparsenn.compiler.runtime.validate import check_call

from _machines import AVX2, relaying


def sp(shape, fmt, density=0.3, seed=0, dtype=torch.float64, index_dtype=None):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < density)
    return sparsenn.from_dense(dense, format=fmt, index_dtype=index_dtype)


def to_dense(x):
    return x.to_dense() if isinstance(x, SparseTensor) else x


def launch_of(equation, *operands, out_format=None) -> Launch:
    """What ``einsum(equation, *operands)`` runs, bound to these operands."""
    assignment = api.parse(equation, len(operands))
    launch = resolve(assignment, check_call(assignment, operands, out_format))
    assert isinstance(launch, Launch)
    return launch


# ----------------------------------------------------------------------------- the cache class


def test_lru_cache_evicts_the_least_recently_used_and_counts():
    cache = LRUCache("test: lru", 2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("b") is None
    assert cache.get("a") == 1 and cache.get("c") == 3
    stats = cache.stats()
    assert (stats.size, stats.maxsize, stats.hits, stats.misses, stats.evictions) == (2, 2, 3, 1, 1)
    cache.clear()
    assert len(cache) == 0 and cache.stats().hits == 0


def test_lru_cache_rejects_bad_limits_and_duplicate_names():
    with pytest.raises(ValueError, match="maxsize must be at least 1"):
        LRUCache("test: empty", 0)
    LRUCache("test: named", 1)
    with pytest.raises(ValueError, match="already exists"):
        LRUCache("test: named", 1)


def test_clear_caches_empties_every_compiler_cache():
    a = sp((6, 5), "csr")
    sparsenn.einsum("ij,jk->ik", a, torch.randn(5, 3, dtype=torch.float64))
    stats = cache_stats()
    assert {"equations", "calls", "shape plans", "plans", "contraction paths", "re-stored patterns"} <= set(stats)
    assert stats["calls"].size >= 1 and stats["plans"].size >= 1
    clear_caches()
    assert all(s.size == 0 and s.hits == 0 and s.misses == 0 for s in cache_stats().values())
    x = torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)


# ----------------------------------------------------------------------------- plans


def test_plans_are_frozen_and_complete_before_the_first_run():
    a = sp((9, 7), "csr")
    plan = api.plan("ij,jk->ki", a, torch.randn(7, 4, dtype=torch.float64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.source = ""
    assert [(x.slot, x.kind) for x in plan.arguments] == [(0, "pos"), (0, "crd"), (0, "val"), (1, "dense")]
    assert set(plan.kernel.indices) == {"i", "j", "k"}
    # The kernel writes the output in loop order (i, k); the result is its (k, i) view.
    assert plan.schedule.output_order == ("i", "k") and plan.output_permutation == (1, 0)


def test_batch_sizes_with_the_same_decisions_share_a_plan():
    w = sp((24, 40), "csr")
    p48, p56 = (api.plan("bi,oi->bo", torch.randn(b, 40, dtype=torch.float64), w) for b in (48, 56))
    assert decisions(p48.schedule) == decisions(p56.schedule)
    assert p48.source == p56.source
    before = cache_stats()["plans"]
    for b in (48, 56):
        x = torch.randn(b, 40, dtype=torch.float64)
        torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, w), x @ w.to_dense().T)
    after = cache_stats()["plans"]
    assert after.misses == before.misses  # both shapes ran the plan built for the first


def test_a_thousand_batch_sizes_keep_every_cache_bounded():
    torch.manual_seed(0)
    layer = SparseLinear(16, 8, sparsity=0.5, dtype=torch.float64)
    dense = layer.to_dense()
    clear_caches()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # larger batches would wake a thread team per call
    try:
        with torch.no_grad():
            for batch in range(1, 1001):
                x = torch.randn(batch, 16, dtype=torch.float64)
                torch.testing.assert_close(layer(x), dense(x), rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(threads)
    stats = cache_stats()
    assert all(s.size <= s.maxsize for s in stats.values()), stats
    # Register blocks (a few widths) and loop orders vary with the batch size; a handful
    # of kernels serve all of them (kernels read extents at run time).
    assert stats["plans"].size <= 16, stats["plans"]
    assert stats["shape plans"].evictions > 0 and stats["shape plans"].size == stats["shape plans"].maxsize


# ----------------------------------------------------------------------------- the launcher


def test_repeated_calls_run_their_cached_launch_with_operands_as_given():
    a = sp((23, 19), "csr")
    b, x, y = (torch.randn(19, 6, dtype=torch.float64), torch.randn(23, 8, dtype=torch.float64),
               torch.randn(19, 8, dtype=torch.float64))
    c = sp((19, 7), "csr", seed=1)
    cases = [("ij,jk->ik", [a, b]), ("ij,jk->ki", [a, b]), ("ij,ik,jk->ij", [a, x, y]), ("ij->", [a]),
             ("ij,jk->ik", [a, c])]
    for equation, operands in cases:
        assert launch_of(equation, *operands).stages == (), equation
        first = sparsenn.einsum(equation, *operands)
        hits = cache_stats()["calls"].hits
        operands = [op.with_values(op.values * 2) if isinstance(op, SparseTensor) else op for op in operands]
        again = sparsenn.einsum(equation, *operands)
        assert cache_stats()["calls"].hits == hits + 1, equation
        factor = 2 ** sum(isinstance(op, SparseTensor) for op in operands)
        torch.testing.assert_close(to_dense(again), factor * to_dense(first))


def test_narrow_index_arrays_are_widened_per_call():
    wide = sp((23, 19), "csr", index_dtype=torch.int64)
    narrow = sp((19, 7), "csr", seed=1, index_dtype=torch.int32)
    assert len(launch_of("ij,jk->ik", wide, narrow, out_format="dense").stages) == 2  # narrow's pos and crd
    for _ in range(2):
        result = sparsenn.einsum("ij,jk->ik", wide, narrow, out_format="dense")
        torch.testing.assert_close(result, wide.to_dense() @ narrow.to_dense())


def test_strided_dense_operands_are_copied_only_when_needed(avx2_host, host_target):
    host_target(relaying(AVX2))  # copies cheaper than the kernel packing the input
    # The forward `bi,oi->bo` reads x as (i, b): b is the vectorised innermost loop.
    # The output of such a product (the kernel writes (o, b)) already has those
    # strides, so a following product reads it as given; a batch-major x is copied
    # (worth it from a few rows of work: tiny products read x as it is).
    w = sp((32, 64), "csr")
    plan = api.plan("bi,oi->bo", torch.randn(16, 64, dtype=torch.float64), w)
    assert [slot.layout for slot in plan.kernel.slots if slot.fmt is None] == [(1, 0)]
    x = torch.randn(64, 16, dtype=torch.float64).t()  # shape (16, 64), strides (1, 16)
    for operand, copies in ((x, 0), (x.contiguous(), 1)):
        assert len(launch_of("bi,oi->bo", operand, w).stages) == copies
        for _ in range(2):
            torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", operand, w), operand @ w.to_dense().T)
    out = sparsenn.einsum("ij,jk->ik", w, torch.randn(64, 4, dtype=torch.float64)).t()  # non-contiguous
    torch.testing.assert_close(sparsenn.einsum("ki,ij->kj", out, w, out_format="dense"), out @ w.to_dense())


def copies_made(forward, calls: int) -> tuple[list, int]:
    """``forward()``'s results over ``calls`` calls, and the tensor copies (``aten::copy_``,
    as torch's profiler records them) those calls made."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        results = [forward() for _ in range(calls)]
    return results, sum(event.name == "aten::copy_" for event in profiled.events())


def test_sparse_linear_repeated_forward_hits_its_launch_and_chains_without_copies(avx2_host, host_target):
    host_target(relaying(AVX2))  # copies cheaper than the kernel packing the input
    torch.manual_seed(0)
    first, second = SparseLinear(64, 48, dtype=torch.float64), SparseLinear(48, 32, dtype=torch.float64)
    x = torch.randn(32, 64, dtype=torch.float64)
    hidden = torch.relu(first(x))  # laid out (features, batch): what the next forward reads
    assert hidden.stride() == (1, 32)
    with torch.no_grad():
        assert launch_of("bi,oi->bo", hidden, second.weight, out_format="dense").stages == ()
    reference = second.to_dense()(hidden)
    second(hidden)
    before = cache_stats()
    results, copies = copies_made(lambda: second(hidden), 3)
    assert copies == 0
    after = cache_stats()
    for result in results:
        torch.testing.assert_close(result, reference)
    assert after["calls"].hits == before["calls"].hits  # run by the layer's held signature, recorded
    assert after["calls"].misses == before["calls"].misses
    assert all(r.grad_fn is not None for r in results)
    assert after["shape plans"].misses == before["shape plans"].misses
    batch_major = hidden.clone(memory_format=torch.contiguous_format)
    second(batch_major)
    results, copies = copies_made(lambda: second(batch_major), 2)
    for result in results:
        torch.testing.assert_close(result, reference)
    assert copies == 2  # a batch-major input: the scheduled transpose, once per call


def test_sparse_outputs_and_anchored_outputs_take_the_same_launcher():
    a, b = sp((8, 9), "csr", seed=1), sp((9, 7), "csr", seed=2)
    launch = launch_of("ij,jk->ik", a, b, out_format="coo")  # assembled as "cc", then converted
    assert launch.plan.assembles and launch.final_format == sparsenn.parse_format("coo", 2)
    result = sparsenn.einsum("ij,jk->ik", a, b, out_format="coo")
    assert result.format == sparsenn.parse_format("coo", 2)
    torch.testing.assert_close(result.to_dense(), a.to_dense() @ b.to_dense())
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    assert launch_of("ij,ik,jk->ij", a, x, y).plan.anchor == 0
    sampled = sparsenn.einsum("ij,ik,jk->ij", a, x, y)
    assert sampled.pos[1] is a.pos[1]
    torch.testing.assert_close(sampled.to_dense(), a.to_dense() * (x @ y.T))


# ----------------------------------------------------------------------------- result type


def with_nnz(nnz: int, shape=(300, 200), seed=0) -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(shape[0] * shape[1], generator=g)[:nnz]
    indices = torch.stack([flat // shape[1], flat % shape[1]])
    return sparsenn.from_coo(indices, torch.randn(nnz, generator=g, dtype=torch.float64), shape, format="csr")


@pytest.mark.parametrize("equation", ["ij,ik->jk", "ij,kj->ik", "ij,jk->ik", "ij,ij->ij"])
def test_result_type_depends_on_formats_not_on_fill(equation):
    b = torch.randn(300, 16, dtype=torch.float64) if equation == "ij,ik->jk" else None
    results = []
    for nnz in (53, 649):
        a = with_nnz(nnz)
        if equation == "ij,ik->jk":
            operands = [a, b]
        elif equation == "ij,jk->ik":
            operands = [a, torch.randn(200, 5, dtype=torch.float64)]
        else:
            operands = [a, a]
        result = sparsenn.einsum(equation, *operands)
        expected = torch.einsum(equation, *[to_dense(op) for op in operands])
        torch.testing.assert_close(to_dense(result), expected)
        results.append(result)
    assert type(results[0]) is type(results[1])
    if isinstance(results[0], SparseTensor):
        assert results[0].format == results[1].format


def test_auto_out_format_densifies_by_estimated_fill_on_request():
    b = torch.randn(300, 16, dtype=torch.float64)
    few, many = with_nnz(5), with_nnz(649)
    assert isinstance(sparsenn.einsum("ij,ik->jk", few, b, out_format="auto"), SparseTensor)
    full = sparsenn.einsum("ij,ik->jk", many, b, out_format="auto")
    assert isinstance(full, torch.Tensor)
    torch.testing.assert_close(full, many.to_dense().T @ b)
    assert isinstance(sparsenn.einsum("ij,jk->ik", torch.randn(3, 4), torch.randn(4, 2), out_format="AUTO"),
                      torch.Tensor)


def test_a_contraction_path_returns_the_expression_s_result_type():
    # The intermediates' formats follow their estimated fill; the last contraction is
    # asked for the whole expression's format.
    a = sp((400, 400), "csr", density=0.01)
    b, c = torch.randn(400, 64, dtype=torch.float64), torch.randn(64, 64, dtype=torch.float64)
    infos = [operand_info(op) for op in (a, b, c)]
    assignment = api.parse("ij,jk,kl->il", 3)
    assert path_request(assignment, [i.format for i in infos], None) == "dense"
    result = sparsenn.einsum("ij,jk,kl->il", a, b, c)
    assert isinstance(result, torch.Tensor)
    torch.testing.assert_close(result, a.to_dense() @ b @ c)
    d = sp((400, 64), "csr", density=0.05, seed=3)
    sparse_last = path_request(assignment, [a.format, d.format, sparsenn.parse_format("csr", 2)], None)
    assert sparse_last == sparsenn.parse_format("dc", 2)


def test_bad_out_format_names_what_is_wrong():
    a = sp((4, 4), "csr")
    with pytest.raises(TypeError, match=r"out_format must be None, 'dense', a format name or a Format \(or 'auto'\)"):
        sparsenn.einsum("ij,jk->ik", a, a, out_format=3.5)


def test_large_outputs_reuse_memory_nothing_else_holds():
    pool = memory.OutputPool("test outputs", max_buffers=3, max_bytes=1 << 30)
    size = (memory.MIN_POOLED_BYTES // 4,)
    first = pool.empty(size, torch.float32)
    address = first.data_ptr()
    view = first.view(-1, 4)[1:]
    del first
    other = pool.empty(size, torch.float32)
    assert other.data_ptr() != address  # a view still holds the first buffer
    del view
    again = pool.empty(size, torch.int32)  # free now: handed out again, any dtype of its size
    assert again.data_ptr() == address and again.shape == size and again.dtype == torch.int32
    assert pool.empty((size[0] + 1,), torch.float32).data_ptr() not in (address, other.data_ptr())
    busy = [pool.empty(size, torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in busy + [again, other]}) == 5  # buffers in use are never shared
    assert pool.stats().size == 3 and pool.stats().evictions == 3  # at most max_buffers kept
    small = pool.empty((10,), torch.float32)
    assert small.shape == (10,) and pool.stats().misses == 6  # small outputs are not pooled


@pytest.mark.parametrize("equation, shapes", [
    ("ecd,ech->edh", [(3, 70, 64), (3, 70, 2000)]),  # an expert weight's gradient: batch e, contracted c
    ("bij,bjk->bik", [(2, 400, 30), (2, 30, 400)]),
    ("ij,kj->ki", [(300, 50), (1000, 50)]),  # the second factor's free index first
    ("bij,bjk->ibk", [(2, 400, 30), (2, 30, 400)]),  # batch not leading: torch.einsum, not pooled
])
def test_large_dense_products_write_into_reused_memory(equation, shapes):
    """A pairwise product of dense operands whose output is large is a batched GEMM into
    the output pool (memory already mapped on the next call), equal to torch.einsum."""
    g = torch.Generator().manual_seed(0)
    operands = [torch.randn(shape, generator=g) for shape in shapes]
    first = sparsenn.einsum(equation, *operands)
    torch.testing.assert_close(first, torch.einsum(equation, *operands))
    address = first.data_ptr()
    del first
    if equation != "bij,bjk->ibk":
        assert sparsenn.einsum(equation, *operands).data_ptr() == address
    if equation == "ecd,ech->edh":  # a coefficient scales the pooled result in place
        scaled = sparsenn.compile("Y[e,d,h] = 0.5 * X[e,c,d] * G[e,c,h]")
        torch.testing.assert_close(scaled(*operands), 0.5 * torch.einsum(equation, *operands))


def test_saved_for_backward_outputs_are_not_reused():
    # A layer's output saved by autograd must not be overwritten by the next call's.
    lin = SparseLinear(2048, 2048, sparsity=0.5)
    x = torch.randn(256, 2048, requires_grad=True)
    y1 = lin(x)
    y2 = lin(x * 2)
    assert y1.data_ptr() != y2.data_ptr()
    torch.testing.assert_close(y2, lin(x * 2))
    (y1.sum() + y2.sum()).backward()
    assert x.grad is not None


def test_outputs_of_nearby_sizes_share_a_size_class_and_idle_memory_is_bounded():
    pool = memory.OutputPool("bounded outputs", max_buffers=16, max_bytes=4 * memory.MIN_POOLED_BYTES)
    n = memory.MIN_POOLED_BYTES // 4
    first = pool.empty((n + 10,), torch.float32)
    address = first.data_ptr()
    del first
    again = pool.empty((n + 1000, 1), torch.float32)  # within the same class of m * 2^k bytes
    assert again.data_ptr() == address and again.shape == (n + 1000, 1)
    del again
    assert all(memory.size_class(b) >= b and memory.size_class(b) <= 1.25 * b for b in range(1, 5000))
    for k in range(8):  # eight idle buffers of distinct classes, 2.5 MiB and more each
        pool.empty((n * (5 + 2 * k) // 2,), torch.float32)
    assert pool.idle_bytes() <= pool.max_bytes and pool.stats().evictions > 0


def test_memory_stays_flat_over_calls_of_varying_batch_sizes():
    """1,000 forward and backward calls of a layer with batch sizes from 1 to 512: the
    pool keeps a few buffers, and the process hardly grows."""
    import random

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    clear_caches()
    layer = SparseLinear(256, 1024, sparsity=0.9)  # outputs up to 2 MiB: pooled
    rng = random.Random(0)

    def step():
        x = torch.randn(rng.randint(1, 512), 256, requires_grad=True)
        layer(x).sum().backward()

    for _ in range(100):
        step()
    before = resident_mib()
    for _ in range(1000):
        step()
    # outputs of 1-2 MiB fall in 5 size classes: 7.5 MiB idle, whatever the batch sizes
    assert memory.OUTPUTS.stats().size <= 6 and memory.OUTPUTS.idle_bytes() <= 8 << 20
    assert resident_mib() - before < 16
    memory.set_output_pool_limit(0)
    try:
        assert memory.OUTPUTS.idle_bytes() == 0
    finally:
        memory.set_output_pool_limit(memory.POOL_BYTES)
    with pytest.raises(ValueError, match="at least 0 bytes"):
        memory.set_output_pool_limit(-1)


def test_clear_caches_releases_the_kept_outputs():
    memory.empty((memory.MIN_POOLED_BYTES // 4,), dtype=torch.float32)
    assert cache_stats()["output buffers"].size >= 1
    clear_caches()
    assert cache_stats()["output buffers"].size == 0


@pytest.mark.parametrize("shape, layout", [((160, 129), (1, 0)), ((160, 128), (1, 0)), ((129, 256), (1, 0)),
                                           ((7, 3), (1, 0)), ((1, 1), (1, 0)), ((0, 5), (1, 0)),
                                           ((200, 97), (0, 1)), ((3, 5, 4), (2, 0, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_relaid_copy_holds_the_operand_in_its_layout_order(shape, layout, dtype):
    x = torch.randn(shape, dtype=dtype)
    copy = launcher._relaid_copy(x, layout)
    assert copy.is_contiguous() or copy.permute(layout).is_contiguous()  # memory in layout order
    flat = torch.empty(copy.numel(), dtype=dtype).set_(copy.untyped_storage(), copy.storage_offset(), (copy.numel(),))
    torch.testing.assert_close(flat, x.permute(layout).reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("batch", [129, 160, 1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_batch_major_input_copied_by_blocks_gives_torchs_product(batch, dtype, host_target):
    # the kernel, never the dense path; copies cheaper than the kernel packing the input
    host_target(dataclasses.replace(relaying(AVX2), python_call_cycles=1e12))
    w = sp((7, 128), "csr", density=0.5, seed=3, dtype=dtype)
    x = torch.randn(batch, 128, dtype=dtype)  # rows 512 or 1024 bytes apart
    if batch >= 129:  # a copy of at least BLOCKED_TRANSPOSE_ELEMENTS, read feature-major by the kernel
        assert x.numel() >= launcher.BLOCKED_TRANSPOSE_ELEMENTS
        assert launch_of("bi,oi->bo", x, w, out_format="dense").stages != ()
    with torch.no_grad():
        result = sparsenn.einsum("bi,oi->bo", x, w)
    torch.testing.assert_close(result, torch.einsum("bi,oi->bo", x, w.to_dense()))
