"""The scheduler's choices (Scorch Algorithm 1 and 3), asserted on the schedule itself."""

from __future__ import annotations

import pytest
import scipy.sparse
import torch

import sparsenn
from sparsenn.formats import parse_format
from sparsenn.compiler.frontend.expression import parse_expression
from sparsenn.compiler.frontend.notation import parse_einsum
from sparsenn.compiler.plan.cost import OperandInfo
from sparsenn.compiler.plan.schedule import schedule
from sparsenn.compiler.plan.target import Target
from sparsenn.compiler.plan.planner import memory_order, operand_info
from sparsenn.compiler.api import plan

from _machines import AVX512

# An AVX2 core with a 1 MiB L2: schedules below do not depend on the host.
AVX2 = Target(vector_bytes=32, l2_bytes=1 << 20, llc_bytes=32 << 20)


def dense_schedule(equation, *operands, target=AVX2):
    """The schedule of ``equation`` with a dense output on ``target``."""
    itemsize = operands[0].dtype.itemsize if hasattr(operands[0], "dtype") else 4
    return schedule(parse_einsum(equation, len(operands)), [operand_info(o) for o in operands], None, itemsize, target)


def sparse(shape, fmt, density=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(shape, generator=g)
    dense[dense > density] = 0
    return sparsenn.from_dense(dense, format=fmt)


N = 2000


def test_spmm_csr_is_row_wise():
    p = plan("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, 64))
    (nest,) = p.schedule.nests
    assert p.schedule.output_format is None
    assert nest.order == ("i", "j", "k")
    assert nest.parallel
    assert p.schedule.transposes == ()


def test_spgemm_is_gustavson_with_row_workspace():
    p = plan("ij,jk->ik", sparse((N, N), "csr"), sparse((N, N), "csr", seed=1))
    s = p.schedule
    assert str(s.output_format) == "csr"
    assert s.shared == ("i",)
    assert s.nests[0].order == ("j", "k")
    assert s.workspace is not None and s.workspace.indices == ("k",) and s.workspace.kind == "dense"


def test_sddmm_iterates_the_pattern():
    p = plan("ij,ik,jk->ij", sparse((N, N), "csr"), torch.randn(N, 64), torch.randn(N, 64))
    s = p.schedule
    assert str(p.output_format) == "csr"
    assert p.anchor == 0  # the result takes A's pattern: values written in place, no assembly
    assert s.nests[0].order == ("i", "j", "k")  # (i, j) from A's pattern, k the inner reduction
    assert s.nests[0].parallel
    assert s.workspace is None and s.transposes == ()
    assert len(s.nests) == 1  # one fused kernel, no dense intermediate


def test_sparse_times_sparse_avoids_inner_product():
    # A(i,j) CSR times B(k,j) CSR: the inner product order i,k,j would need a dense
    # i x k iteration; the scheduler must not take it.
    p = plan("ij,kj->ik", sparse((N, N), "csr"), sparse((N, N), "csr", seed=1))
    s = p.schedule
    full = s.shared + s.nests[0].order
    assert full != ("i", "k", "j")
    assert full.index("j") < full.index("k")


def test_csc_spmm_is_column_wise_or_transposed():
    a = sparse((N, N), "csc")
    p = plan("ij,jk->ik", a, torch.randn(N, 64), out_format="dense")
    (nest,) = p.schedule.nests
    transposed = p.schedule.transposes != ()
    column_wise = nest.order[0] == "j"
    assert transposed != column_wise  # exactly one of the two strategies
    if transposed:
        assert nest.order == ("i", "j", "k")


def test_tiles_only_dense_loops_not_parents_of_sparse():
    s = dense_schedule("ij,jk->ik", sparse((N, 2_000), "csr", density=1e-3), torch.empty(2_000, 4096))
    (nest,) = s.nests
    tiled = {t.index for t in nest.tiles}
    assert "j" not in tiled and "i" not in tiled
    assert tiled == {"k"}
    (tile,) = nest.tiles
    assert 32 <= tile.size < 4096
    assert 2_000 * tile.size * 4 <= AVX2.l2_bytes // 2  # the reused tile of B fits in half of L2
    assert nest.register_block is not None and tile.size % nest.register_block.size == 0


def test_reduction_indices_are_not_tiled():
    # SDDMM's k is dense and its rows of X and Y are reused, but tiling it would split
    # each dot product into partial sums added in separate passes over the pattern.
    # SpMM's k is an output index: tiled under the same cache size.
    n, k = 1_000, 256
    a = sparse((n, n), "csr", density=0.01)
    (nest,) = dense_schedule("ij,ik,jk->ij", a, torch.randn(n, k), torch.randn(n, k)).nests
    assert nest.order[-1] == "k" and nest.tiles == ()
    spmm = dense_schedule("ij,jk->ik", a, torch.randn(n, k))
    assert [t.index for t in spmm.nests[0].tiles] == ["k"]


def test_small_dense_loops_are_not_tiled():
    p = plan("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, 32))
    assert p.schedule.nests[0].tiles == ()


def test_three_operand_fusion_touches_only_nonzero_pairs():
    bn = sparse((64, 500), "csr", density=0.02)
    p = plan("bn,bd,ndh->bh", bn, torch.randn(64, 16), torch.randn(500, 16, 8))
    s = p.schedule
    (nest,) = s.nests
    order = nest.order
    assert order[:2] == ("b", "n")  # n iterates bn's pattern under b


def test_chain_with_dense_tail_uses_a_contraction_path():
    from sparsenn.compiler.plan.contract import best_path
    from sparsenn.compiler.frontend.notation import parse_einsum

    a = sparse((N, N), "csr", density=0.01)
    b, c = torch.randn(N, 64), torch.randn(64, 64)
    assignment = parse_einsum("ij,jk,kl->il", 3)
    path = best_path(assignment, [operand_info(a), operand_info(b), operand_info(c)], 4)
    assert path is not None  # fusing would iterate nnz(A) * 64 * 64 points
    first = path[0]
    assert {first.left, first.right} == {0, 1}  # A @ B first, then the dense product
    result = sparsenn.einsum("ij,jk,kl->il", a, b, c)
    torch.testing.assert_close(result, a.to_dense() @ b @ c, rtol=1e-4, atol=1e-3)


def test_sddmm_and_attention_stay_fused():
    from sparsenn.compiler.plan.contract import best_path
    from sparsenn.compiler.frontend.notation import parse_einsum

    a = sparse((N, N), "csr")
    x, y = torch.randn(N, 64), torch.randn(N, 64)
    assert best_path(parse_einsum("ij,ik,jk->ij", 3), [operand_info(a), operand_info(x), operand_info(y)], 4) is None
    bn = sparse((64, 500), "csr", density=0.02)
    infos = [operand_info(bn), operand_info(torch.randn(64, 16)), operand_info(torch.randn(500, 16, 8))]
    assert best_path(parse_einsum("bn,bd,ndh->bh", 3), infos, 4) is None


def test_spmm_register_blocks_the_dense_output_row():
    s = dense_schedule("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, 64))
    (nest,) = s.nests
    assert nest.register_block is not None and nest.register_block.index == "k"
    assert nest.register_block.size == 64  # 8 AVX2 vectors of float32 tile k exactly
    assert "register block of 64 over k (8 vectors: 8-vector blocks tile k exactly)" in "\n".join(s.reasons)
    assert "register block: k by 64" in s.describe()
    # 8 vectors would leave a partial block (run by the plain loop): 4 vectors instead.
    for k in (32, 96):
        assert dense_schedule("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, k)).nests[0].register_block.size == 32
    a64 = sparse((N, N), "csr").to(torch.float64)
    b64 = torch.randn(N, 64, dtype=torch.float64)
    assert dense_schedule("ij,jk->ik", a64, b64).nests[0].register_block.size == 32
    s48 = dense_schedule("ij,jk->ik", a64, torch.randn(N, 48, dtype=torch.float64))
    assert s48.nests[0].register_block.size == 16
    assert "do not tile k exactly" in "\n".join(s48.reasons)
    # 16-byte vectors (SSE, NEON): blocks of 8 vectors of 4 floats.
    sse = Target(vector_bytes=16)
    assert dense_schedule("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, 64), target=sse).nests[0].register_block.size == 32


def test_narrow_rows_get_masked_vectors_and_interleaved_sums():
    a = sparse((N, N), "csr")
    # k narrower than a block: the vectors that cover it, the last masked (float32: 8
    # lanes on AVX2 vectors, 4 of a 16-byte vector for rows of at most 16 bytes;
    # AVX-512's 16 once the row needs more than one 8-lane vector), their sums interleaved over the stored entries of a row until they make
    # the target's independent chains of adds.
    for k, target, size, sums in ((3, AVX2, 4, 4), (7, AVX512, 8, 4), (16, AVX2, 16, 2), (20, AVX2, 24, 2),
                                  (20, AVX512, 32, 2), (40, AVX2, 32, 1)):
        s = dense_schedule("ij,jk->ik", a, torch.randn(N, k), target=target)
        (nest,) = s.nests
        assert (nest.register_block.size, nest.block_sums) == (size, sums), (k, target)
        assert ("partial block masked" in "\n".join(s.reasons)) == (k % size != 0)
    # A dense reduction: no stored entries to interleave (its rows make a register tile).
    (nest,) = dense_schedule("ij,jk->ik", torch.randn(64, 64), torch.randn(64, 3)).nests
    assert nest.block_sums == 1


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
def test_rows_of_at_most_16_bytes_take_16_byte_vectors(machine):
    """SpMM with 1 to 4 float columns (1 or 2 doubles), a graph's last layer: one 16-byte
    vector covers a row, unmasked when the row fills it, instead of a 32-byte vector
    masked down to the row; wider rows keep the target's vectors."""
    import _machines

    target = getattr(_machines, machine)
    for dtype, k, lanes in ((torch.float32, 2, 4), (torch.float32, 3, 4), (torch.float32, 4, 4),
                            (torch.float64, 2, 2)):
        a = sparse((N, N), "csr").to(dtype)
        s = dense_schedule("ij,jk->ik", a, torch.randn(N, k, dtype=dtype), target=target)
        (nest,) = s.nests
        assert s.target.vector_bytes == 16 and nest.register_block.size == lanes, (dtype, k)
        assert f"vectors of 16 bytes (not 32): register blocks over rows of at most {k * dtype.itemsize} bytes" \
            in s.reasons[-1]
        assert ("partial block masked" in "\n".join(s.reasons)) == (k != lanes)
    for dtype, k in ((torch.float32, 5), (torch.float32, 7), (torch.float32, 9), (torch.float64, 3)):
        a = sparse((N, N), "csr").to(dtype)
        s = dense_schedule("ij,jk->ik", a, torch.randn(N, k, dtype=dtype), target=target)
        assert s.target.vector_bytes >= 32 and not any("vectors of 16 bytes" in r for r in s.reasons), (dtype, k)
    # Already 16-byte vectors (SSE, NEON): nothing to narrow.
    sse = Target(vector_bytes=16)
    s = dense_schedule("ij,jk->ik", sparse((N, N), "csr"), torch.randn(N, 3), target=sse)
    assert s.nests[0].register_block.size == 4 and not any("not 16" in r for r in s.reasons)


def test_no_register_block_without_a_reduction_or_over_a_sparse_index():
    a = sparse((N, N), "csr")
    assert dense_schedule("ij,ij->ij", a, torch.randn(N, N)).nests[0].register_block is None  # k sparse
    assert dense_schedule("ij,jk->ijk", a, torch.randn(N, 3)).nests[0].register_block is None  # no reduction


def test_three_operand_sampled_product_is_fused():
    # bo,bi,oi->oi samples g^T x on M's pattern: fused, values written in place; the
    # dense 2048 x 2048 product must not be formed.
    from sparsenn.compiler.plan.planner import contraction_path as _contraction_path
    from sparsenn.compiler.api import parse as _parse_cached

    m = sparse((2048, 2048), "csr", density=0.1)
    g, x = torch.randn(64, 2048), torch.randn(64, 2048)
    infos = tuple(operand_info(o) for o in (g, x, m))
    assert _contraction_path(_parse_cached("bo,bi,oi->oi", 3), infos, torch.float32, None) is None


def test_gcn_weight_gradient_contracts_the_narrow_side_first_and_stays_dense():
    # to,ts,si->oi with 16 output channels and 1433 input features: G^T A (nnz * 16) as
    # a dense intermediate, then a dense product; not A X (nnz * 1433).
    from sparsenn.compiler.plan.planner import contraction_path as _contraction_path
    from sparsenn.compiler.api import parse as _parse_cached

    a = sparse((2708, 2708), "csr", density=0.002)
    g, x = torch.randn(2708, 16), torch.randn(2708, 1433)
    path = _contraction_path(_parse_cached("to,ts,si->oi", 3), tuple(operand_info(o) for o in (g, a, x)), torch.float32, None)
    first = path[0]
    assert {first.left, first.right} == {0, 1} and first.dense
    result = sparsenn.einsum("to,ts,si->oi", g, a, x)
    torch.testing.assert_close(result, g.T @ a.to_dense() @ x, rtol=1e-4, atol=1e-3)


def sparse_schedule(equation, *operands, out_format, target=AVX2):
    """The schedule of ``equation`` with the sparse output ``out_format`` on ``target``."""
    assignment = parse_einsum(equation, len(operands))
    fmt = parse_format(out_format, len(assignment.output))
    return schedule(assignment, [operand_info(o) for o in operands], fmt, 4, target)


def test_output_assembly_is_in_the_schedule():
    a, b = sparse((N, N), "csr"), sparse((N, N), "csr", seed=1)
    csr = sparse_schedule("ij,jk->ik", a, b, out_format="csr")
    assert csr.assembly.two_phase and csr.assembly.inserted == 1
    assert "output assembly: two phases" in csr.describe()
    dcsr = sparse_schedule("ij,jk->ik", a, b, out_format="dcsr")
    assert not dcsr.assembly.two_phase and dcsr.assembly.inserted == 0
    assert "output assembly: appended per chunk" in dcsr.describe()
    # A sparse workspace (its rows too long for a dense one) appends, whatever the format.
    wide = sparsenn.from_scipy(scipy.sparse.random(64, 1 << 23, density=1e-6, format="csr", random_state=0))
    spa = sparse_schedule("ij,jk->ik", sparse((64, 64), "csr", density=0.1), wide, out_format="csr")
    assert spa.workspace.kind == "sparse" and not spa.assembly.two_phase
    assert "workspace: sparse over k" in spa.describe()
    assert not sparse_schedule("ijk,ijk->ijk", *[sparse((20, 20, 20), "csf", seed=s) for s in (0, 1)],
                               out_format="dcc").assembly.two_phase
    assert dense_schedule("ij,jk->ik", a, torch.randn(N, 4)).assembly is None


def test_unions_loop_per_lattice_point_up_to_two_terms():
    csr = OperandInfo(parse_format("csr", 2), (N, N), (N, 20 * N))
    for terms, by_points, line in ((2, True, "one loop per lattice point (3)"), (3, False, "one merge loop")):
        text = "D[i,j] = " + " + ".join(f"X{n}[i,j]" for n in range(terms))
        s = schedule(parse_expression(text), [csr] * terms, parse_format("csr", 2), 4, AVX2)
        assert s.union_by_points == by_points and f"union of {terms} terms at each shared loop: {line}" in s.describe()


def test_independent_innermost_loops_are_marked_simd():
    # SpMM's k writes a different output element per iteration; SDDMM's innermost k is
    # a reduction, and a sparse output's loops append: neither is marked.
    a = sparse((N, N), "csr")
    spmm = dense_schedule("ij,jk->ik", a, torch.randn(N, 45))
    assert spmm.nests[0].simd == "k" and "loop k: omp simd" in spmm.describe()
    assert dense_schedule("ij,ik,jk->ij", a, torch.randn(N, 64), torch.randn(N, 64)).nests[0].simd is None
    assert dense_schedule("ij,ij->ij", a, torch.randn(N, N)).nests[0].simd is None  # j filtered by A
    spgemm = sparse_schedule("ij,jk->ik", a, sparse((N, N), "csr", seed=1), out_format="csr")
    assert all(nest.simd is None for nest in spgemm.nests)


def test_a_short_outer_loop_shares_the_team_with_the_loops_inside():
    # Batch 1 of 3 heads: the team shares b, h and the rows i (output loops over dense
    # levels), not the compressed j; with 300 batch elements b alone is enough.
    for batch, shared in ((1, ("b", "h", "i")), (300, ("b",))):
        mask = sparse((batch, 3, 40, 40), "dddc", density=0.2)
        s = dense_schedule("bhij,bhjd->bhid", mask, torch.randn(batch, 3, 40, 16))
        (nest,) = s.nests
        assert nest.order[:4] == ("b", "h", "i", "j")
        assert nest.order[:nest.team_loops] == shared
    assert "parallel over b,h,i" in dense_schedule("bhij,bhjd->bhid", sparse((1, 3, 40, 40), "dddc"),
                                                   torch.randn(1, 3, 40, 16)).describe()


def test_team_loops_stop_at_a_held_loop():
    # Dense rows i of a 1 x 2 x 8 x 64 sampled product: i is the dot tile's row loop,
    # held by the tile, so the team shares b and h only.
    mask = sparse((1, 2, 8, 64), "dddc", density=0.5)
    q, k = torch.randn(1, 2, 8, 32), torch.randn(1, 2, 64, 32)
    (nest,) = dense_schedule("bhij,bhid,bhjd->bhij", mask, q, k).nests
    held = {nest.dot_tile and nest.dot_tile.rows, nest.register_tile and nest.register_tile.index}
    assert nest.team_loops == nest.order.index(next(i for i in nest.order if i in held or i == "j"))


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_batches_sum_each_weight_row_in_registers(machine, dtype):
    """``Y = X Wᵀ`` with a csr ``W``: with one batch row the nest keeps each output's
    sum over the stored weights of its row in registers (the SpMV form). With two rows
    laid out batch-major, it does so per row too, reading ``X`` where it is (a copy
    into another layout costs more than two rows' work); laid out feature-major (the
    output of another such layer), and from a vector's rows up in any layout, the batch
    rows are the innermost loop, held in a register block across the row's stored
    weights (one masked vector below a vector's lanes, its sums interleaved over the
    stored weights)."""
    import _machines

    # sparse enough that the planner never runs it densely
    weight = sparsenn.from_dense(torch.rand(256, 300, dtype=dtype).where(torch.rand(256, 300) < 0.02, 0), "csr")
    target = getattr(_machines, machine)
    lanes = target.lanes(dtype.itemsize)
    with sparsenn.compiler.use_target(target):
        for batch, feature_major in ((1, False), (1, True), (2, False), (2, True), (3, True), (lanes, False),
                                     (lanes, True), (64, False)):
            x = torch.randn(300, batch, dtype=dtype).T if feature_major else torch.randn(batch, 300, dtype=dtype)
            scheduled = plan("bi,oi->bo", x, weight, out_format="dense").schedule
            (nest,) = scheduled.nests
            if batch == 1 or (batch == 2 and not feature_major):
                assert nest.order[-1] == "i" and nest.sparse_reduction is not None, (batch, nest.order)
                assert not scheduled.transposes, (batch, scheduled.transposes)
            else:
                assert nest.order == ("o", "i", "b") and nest.register_block is not None, (batch, nest.order)
                assert nest.block_sums > 1 or batch == 64, (batch, nest.block_sums)
                read = "reads dense operand(s) [0] in place" if feature_major else "copies dense operand(s) [0]"
                assert read in scheduled.reasons[0], scheduled.reasons
            torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, weight, out_format="dense"),
                                       x @ weight.to_dense().T)


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
def test_a_tile_splitting_a_wide_register_block_only_over_twice_the_l2(machine):
    """SpMM ``Â H`` over a Cora-sized graph: ``H`` with 128 columns (1.4 MB) is under
    twice the 1 MiB L2, so its columns are not cut into tiles (that would split the
    register block and re-read ``Â`` per tile); with 256 columns (2.8 MB) they are. The
    block takes the widest vectors (16 lanes on AVX-512): 128 columns in one pass there."""
    import _machines

    target = getattr(_machines, machine)
    a = sparse((2708, 2708), "csr", density=2e-3)
    lanes = target.widest_vector_bytes // 4
    near_schedule = dense_schedule("ts,so->to", a, torch.empty(2708, 128), target=target)
    (near,) = near_schedule.nests
    assert near.tiles == () and near.register_block.size == min(target.wide_register_block_vectors * lanes, 128)
    widened = [r for r in near_schedule.reasons if r.startswith("vectors of 64 bytes")]
    assert len(widened) == (machine == "AVX512")
    (far,) = dense_schedule("ts,so->to", a, torch.empty(2708, 256), target=target).nests
    assert [t.index for t in far.tiles] == ["o"] and far.tiles[0].size == 32


@pytest.mark.parametrize("machine", ["AVX2", "AVX512"])
def test_interleaved_sums_of_a_sparse_reduction_follow_its_fiber_length(machine):
    """An SpMV over rows of about 5 stored entries (a graph's adjacency) sums each row
    in one chain, which overlaps the next row's; rows of about 100 get the target's
    interleaved sums."""
    import _machines

    target = getattr(_machines, machine)
    x = torch.randn(2000)
    short = dense_schedule("ij,j->i", sparse((2000, 2000), "csr", density=2.5e-3), x, target=target)
    long = dense_schedule("ij,j->i", sparse((2000, 2000), "csr", density=5e-2), x, target=target)
    assert short.nests[0].sparse_reduction.accumulators == 1
    assert long.nests[0].sparse_reduction.accumulators == target.sparse_accumulators


def test_the_memory_order_of_a_dense_operand():
    """The planner reads a transposed (permuted contiguous) operand's memory order; a
    contiguous one, or one strided otherwise (a slice, a broadcast), is planned as
    indexed (the launch copies the latter whatever the loop order)."""
    def order(t: torch.Tensor):
        return memory_order(t.shape, t.stride())

    x = torch.randn(4, 5)
    assert order(x) is None and order(x.T) == (1, 0)
    assert order(torch.randn(2, 3, 4).permute(2, 0, 1)) == (1, 2, 0)
    assert order(torch.randn(5, 1).T) is None  # extents of one: contiguous
    assert order(torch.randn(4, 10)[:, ::2]) is None
    assert order(torch.randn(4, 1).expand(4, 5)) is None
    assert operand_info(x.T).layout == (1, 0) and operand_info(x).layout is None
