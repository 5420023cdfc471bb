"""A repeated call is recognised by its guard (``validate.call_guard``) and runs its
cached launch at once: every way an operand can change between two calls (in-place
edits, ``.data`` reassignment, a new shape, dtype or layout at the same object) either
passes the guard with the launch still valid or fails it and is checked in full."""

from __future__ import annotations

import pytest
import torch
from _machines import AVX2, relaying

import sparsenn
from sparsenn import SparseLinear
from sparsenn.compiler import cache_stats, clear_caches
from sparsenn.compiler import api
from sparsenn.compiler.runtime import memory
from sparsenn.compiler.runtime.cache import GuardedCache
from sparsenn.compiler.runtime.evaluate import resolve
from sparsenn.compiler.runtime.launcher import Launch
from sparsenn.compiler.runtime.validate import check_call


def sp(shape, fmt="csr", density=0.4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g, dtype=dtype) * (torch.rand(shape, generator=g) < density)
    return sparsenn.from_dense(dense, format=fmt)


def launch_of(equation, *operands) -> Launch:
    """What ``einsum(equation, *operands)`` runs, bound to these operands."""
    assignment = api.parse(equation, len(operands))
    launch = resolve(assignment, check_call(assignment, operands, None))
    assert isinstance(launch, Launch)
    return launch


def guard_hits() -> int:
    return cache_stats()["calls"].hits


def test_in_place_edits_of_values_and_dense_operands_are_read_by_the_cached_launch():
    a, x = sp((6, 5)), torch.randn(5, dtype=torch.float64)
    sparsenn.einsum("ij,j->i", a, x)
    a.values.mul_(3)
    x.add_(1)
    hits = guard_hits()
    torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, x), a.to_dense() @ x)
    assert guard_hits() == hits + 1


def test_data_reassignment_at_the_same_object_changes_shape_layout_or_dtype_safely():
    a = sp((23, 19))
    x = torch.randn(19, 6, dtype=torch.float64)  # read as given: no copy to the kernel's layout
    assert launch_of("ij,jk->ik", a, x).stages == ()
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    x.data = torch.randn(6, 19, dtype=torch.float64).t()  # same shape, transposed strides
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    x.data = torch.randn(19, 7, dtype=torch.float64)  # a new shape
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    x.data = torch.randn(4, 7, dtype=torch.float64)  # a shape that does not fit
    with pytest.raises(ValueError, match="index 'j' has size 4"):
        sparsenn.einsum("ij,jk->ik", a, x)
    x.data = torch.randn(19, 7, dtype=torch.float32)  # a dtype that does not match
    with pytest.raises(TypeError, match="dtype"):
        sparsenn.einsum("ij,jk->ik", a, x)
    a.values.data = a.values.data.float()
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)


def test_a_resized_dense_operand_fails_the_guard():
    a, x = sp((6, 5)), torch.randn(5, dtype=torch.float64)
    sparsenn.einsum("ij,j->i", a, x)
    x.resize_(4)
    with pytest.raises(ValueError, match="index 'j' has size 4"):
        sparsenn.einsum("ij,j->i", a, x)


@pytest.mark.parametrize("calls", [1, 3])  # the third call runs by the held call (compiler/held.py)
@pytest.mark.parametrize("edit", ["in place", ".data", "values resized"])
def test_an_edited_sparse_operand_is_rejected_after_a_cached_call(edit, calls):
    a, x = sp((6, 5)), torch.randn(5, dtype=torch.float64)
    for _ in range(calls):
        sparsenn.einsum("ij,j->i", a, x)
    if edit == "in place":
        a.crd[1][0] = 4
    elif edit == ".data":
        a.crd[1].data = a.crd[1].clone()
    else:
        a.values.data = torch.randn(a.nnz + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="modified in place or replaced|resized after construction"):
        sparsenn.einsum("ij,j->i", a, x)


def test_values_made_non_contiguous_after_a_cached_call_are_copied():
    a, x = sp((6, 5)), torch.randn(5, dtype=torch.float64)
    sparsenn.einsum("ij,j->i", a, x)
    a.values.data = torch.randn(2 * a.nnz, dtype=torch.float64)[::2]
    assert not a.values.is_contiguous()
    torch.testing.assert_close(sparsenn.einsum("ij,j->i", a, x), a.to_dense() @ x)


def test_shared_and_separate_patterns_of_one_signature_are_told_apart():
    s = sp((6, 5))
    t = sparsenn.from_dense(s.to_dense() * 2, format="csr")  # s's pattern in arrays of its own
    other = s.with_values(torch.randn(s.nnz, dtype=torch.float64))
    for u, v in ((s, other), (s, t), (s, other)):
        torch.testing.assert_close(sparsenn.einsum("ij,ij->ij", u, v, out_format="dense"),
                                   u.to_dense() * v.to_dense())


def test_more_signatures_than_an_expression_keeps_alternate_correctly():
    clear_caches()
    a = sp((6, 5))
    xs = [torch.randn(5, k, dtype=torch.float64) for k in range(1, 8)]
    for _ in range(3):
        for x in xs:
            torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), a.to_dense() @ x)
    for request in (None, "dense", "csr"):
        result = sparsenn.einsum("ij,kj->ik", a, a, out_format=request)
        assert isinstance(result, torch.Tensor) == (request == "dense")
    stats = cache_stats()["calls"]
    assert stats.size <= stats.maxsize


def test_guarded_cache_finds_recent_entries_by_guard_and_bounds_them():
    cache = GuardedCache("test: guarded", 2, per_expression=2)
    expression = object()
    for n in range(3):
        cache.store(expression, ("key", n), lambda ops, detail, n=n: ops == n, f"value {n}")
    assert cache.find(expression, 2, None) == "value 2" and cache.find(expression, 1, None) == "value 1"
    assert cache.find(expression, 0, None) is None  # beyond per_expression: found by key only
    assert cache.lookup(expression, ("key", 0)) is None  # evicted from the LRU of 2 as well
    assert cache.lookup(expression, ("key", 2)) == "value 2"
    cache.clear()
    assert cache.find(expression, 2, None) is None and cache.stats().size == 0


def test_a_bound_allocator_poisons_when_poisoning_is_turned_on_later():
    allocate, filled = memory.allocator((3, 2), torch.float32), memory.allocator((3, 2), torch.float64, float("-inf"))
    previous = memory.poison_outputs(False)
    try:
        memory.poison_outputs(True)
        assert allocate().isnan().all() and allocate().shape == (3, 2)
        assert (filled() == float("-inf")).all() and filled().dtype == torch.float64
    finally:
        memory.poison_outputs(previous)


def test_sparse_linear_reads_its_parameter_as_it_is_now():
    torch.manual_seed(0)
    layer, x = SparseLinear(16, 8, sparsity=0.5, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    layer(x)
    with torch.no_grad():
        layer.weight_values.mul_(2)
    torch.testing.assert_close(layer(x), layer.to_dense()(x))
    layer.weight_values.data = torch.randn_like(layer.weight_values)
    torch.testing.assert_close(layer(x), layer.to_dense()(x))
    layer.float()
    torch.testing.assert_close(layer(x.float()), layer.to_dense()(x.float()))
    out = layer(x.float())
    out.sum().backward()
    assert layer.weight_values.grad is not None and layer.weight_values.grad.dtype == torch.float32


def relaid() -> tuple[int, int]:
    stats = cache_stats()["re-laid parameters"]
    return stats.hits, stats.misses


def test_a_parameter_read_transposed_is_copied_once_while_unchanged(avx2_host, host_target):
    host_target(relaying(AVX2))  # copies cheaper than the kernel packing the input
    x = sp((200, 300), density=0.1)
    w = torch.nn.Parameter(torch.randn(64, 300, dtype=torch.float64))
    assert launch_of("ik,jk->ij", x, w).stages  # the kernel reads w k-major: a re-laid copy
    clear_caches()

    def check(hits: int, misses: int) -> None:
        with torch.no_grad():
            torch.testing.assert_close(sparsenn.einsum("ik,jk->ij", x, w), x.to_dense() @ w.T)
        assert relaid() == (hits, misses)

    for n in range(3):
        check(n, 1)
    with torch.no_grad():
        w.mul_(2)  # an optimizer step: the copy is made, and not kept
    check(2, 2)
    w.data[3, 4] = 7.0  # an edit no version counter sees: the bits tell
    check(2, 3)
    check(3, 3)
    for step in range(3):  # training: the first forward reads the kept copy, the next the stepped weight
        y = sparsenn.einsum("ik,jk->ij", x, w)
        y.sum().backward()
        torch.testing.assert_close(w.grad, (step + 1) * x.to_dense().sum(0).expand(64, 300))
        torch.testing.assert_close(y, x.to_dense() @ w.detach().T)
        with torch.no_grad():
            w -= 0.1 * w.grad
        assert relaid() == (4, 3 + step)
    check(4, 6)  # evaluation after training: the stepped weight,
    check(4, 7)  # unchanged since: kept,
    check(5, 7)  # and read
    with torch.no_grad():  # a tensor that is not a parameter is not kept
        sparsenn.einsum("ik,jk->ij", x, w.detach().clone())
    assert relaid() == (5, 7)


def test_a_guard_answers_as_the_key_whatever_its_tensor_check_sees():
    """A call's guard checks its tensors through torch's tensor guards, which are stricter
    than the key (requires_grad, a Parameter's type, inference tensors): such a call still passes by the exact test, and a call of
    another key fails both."""
    from sparsenn.compiler.runtime.validate import call_guard, call_key

    a, x = sp((6, 5)), torch.randn(5, 3, dtype=torch.float64)
    assignment = api.parse("ij,jk->ik", 2)
    guard = call_guard(assignment, [a, x], None)

    def same_key(*ops):
        return call_key(assignment, list(ops), None) == call_key(assignment, [a, x], None)

    with torch.inference_mode():
        frozen = sparsenn.from_dense(a.to_dense(), format="csr")  # index arrays without version counters
    cases = [(a, x), (a, x.clone().requires_grad_()), (a, torch.nn.Parameter(x.clone())), (frozen, x),
             (a.with_values(a.values.clone().requires_grad_()), x),
             (a, x.t().contiguous().t()), (a, x.float()), (a, torch.randn(5, 4, dtype=torch.float64)),
             (sp((6, 5), seed=1), x), (a, x[:, :1]), (a, "x"), (a,)]
    for ops in cases:
        assert guard(ops, None) == same_key(*ops), ops
    assert guard((a, x), "dense") is False
    a.crd[1].add_(0)  # an in-place edit of an index array: the operand is rejected
    assert not guard((a, x), None)
