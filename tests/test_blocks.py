"""Blocked operands computed over split indices (sparsenn/compiler/frontend/blocks.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _machines import AVX2, AVX512, relaying

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.frontend.blocks import split_call
from sparsenn.compiler.frontend.notation import parse_einsum
from sparsenn.compiler.plan.anchor import sampled_operand
from sparsenn.compiler.plan.planner import operand_info
from sparsenn.compiler.plan.schedule import DotTile, RegisterTile, schedule
from sparsenn.compiler.plan.target import Target
from sparsenn.formats import parse_format

pytestmark = pytest.mark.usefixtures("avx2_host")


def block_sparse(shape, block, density=0.4, dtype=torch.float64, seed=0):
    """A dense tensor whose nonzeros fill random whole blocks."""
    g = torch.Generator().manual_seed(seed)
    grid = [n // b for n, b in zip(shape, block)]
    mask = torch.rand(grid, generator=g) < density
    for m, b in enumerate(block):
        mask = mask.repeat_interleave(b, m)
    return torch.randn(shape, generator=g, dtype=dtype) * mask


def split_of(equation, formats, shapes, request=None):
    parsed = [None if f is None else parse_format(f, len(s)) for f, s in zip(formats, shapes)]
    return split_call(parse_einsum(equation, len(formats)), parsed, shapes, request)


def test_blocked_spmm_splits_both_indices_and_reads_blocks_as_unblocked_levels():
    split = split_of("ij,jk->ik", ["bsr(4,2)", None], [(8, 6), (6, 5)])
    assert dict(split.sizes) == {"i": 4, "j": 2}
    assert str(split.assignment) == "Out[i,i',k] = sum_{j,j'} operand0[i,i',j,j'] * operand1[j,j',k]"
    assert split.layouts[0].shape == (2, 4, 3, 2) and str(split.layouts[0].format) == "dcdd[0,2,1,3]"
    assert split.converted == (None, None)


def test_the_in_block_extents_of_split_indices_are_constants_of_the_kernel():
    """A split index's in-block coordinate has its block's extent whatever the shapes: the
    split expression fixes it, and its kernel declares it as a constant (the compiler then
    drops the partial-tile code that never runs), the other extents read from ``dims``."""
    split = split_of("ij,jk->ik", ["bsr(4,2)", None], [(8, 6), (6, 5)])
    assert split.assignment.extents == (("i'", 4), ("j'", 2))
    a = SparseTensor.from_dense(block_sparse((6, 10), (3, 5), dtype=torch.float32), format="bsr(3,5)")
    text = sparsenn.explain("ij,jk->ik", a, torch.ones(10, 7))
    assert "const int64_t N1 = 3;" in text and "const int64_t N3 = 5;" in text
    assert "const int64_t N0 = dims[0];" in text and "const int64_t N4 = dims[4];" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("columns", [0, 1, 7])
def test_blocks_of_other_sizes_run_their_own_kernels(dtype, columns):
    """Calls whose split expressions and split formats are alike but whose blocks differ
    (their constants) do not share a plan or a kernel; every one matches torch."""
    g = torch.Generator().manual_seed(0)  # the global generator untouched: later tests draw from it
    x = torch.randn(30, columns, dtype=dtype, generator=g)
    for block in [(3, 5), (2, 5), (3, 3), (6, 10), (1, 5), (5, 1), (1, 1)]:
        for rows in (0, 30):
            dense = block_sparse((rows, 30), block, density=0.5, dtype=dtype, seed=sum(block))
            a = SparseTensor.from_dense(dense, format=f"bsr({block[0]},{block[1]})")
            y = torch.randn(rows, columns, dtype=dtype, generator=g)
            torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x, out_format="dense"), dense @ x)
            torch.testing.assert_close(sparsenn.einsum("ij,ik->jk", a, y, out_format="dense"), dense.T @ y)


def test_a_compressed_reader_keeps_the_index_whole_and_the_blocked_operand_is_converted():
    split = split_of("ij,jk->ik", ["bsr(2,2)", "csc"], [(4, 4), (4, 4)])  # csc stores j compressed
    assert "j" not in dict(split.sizes)
    assert str(split.converted[0]) == "csr"


def test_disagreeing_block_sizes_keep_the_index_whole():
    split = split_of("ij,jk->ik", ["bsr(2,2)", "bsr(4,2)"], [(8, 8), (8, 8)])
    assert dict(split.sizes) == {}  # j disagrees, so neither operand can keep its blocks
    assert [str(f) for f in split.converted] == ["csr", "csr"]


def test_a_dense_level_of_an_unblocked_operand_splits_in_two():
    split = split_of("ij,jk->ik", ["bsr(2,2)", "csr"], [(4, 4), (4, 6)])  # csr stores j densely
    assert dict(split.sizes) == {"i": 2, "j": 2}
    assert str(split.layouts[1].format) == "ddc" and split.layouts[1].shape == (2, 2, 6)


@pytest.mark.parametrize("fmt", ["bsr(2,3)", "bsc(2,3)", "dc(1,3)", "cc[1,0](2,1)"])
@pytest.mark.parametrize("equation", ["ij,jk->ik", "ij,ik->jk", "ij,j->i", "ij->ji"])
def test_products_match_torch(fmt, equation):
    dense = block_sparse((8, 12), (2, 3))
    a = SparseTensor.from_dense(dense, format=fmt)
    others = {"ij,jk->ik": [torch.randn(12, 5, dtype=torch.float64)],
              "ij,ik->jk": [torch.randn(8, 5, dtype=torch.float64)],
              "ij,j->i": [torch.randn(12, dtype=torch.float64)], "ij->ji": []}[equation]
    out = sparsenn.einsum(equation, a, *others)
    out = out.to_dense() if isinstance(out, SparseTensor) else out
    torch.testing.assert_close(out, torch.einsum(equation, dense, *others))


def test_block_sddmm_keeps_the_block_pattern_and_writes_in_place():
    dense = block_sparse((8, 12), (4, 4), dtype=torch.float32)
    mask = SparseTensor.from_dense(dense, format="bsr(4,4)")
    q, k = torch.randn(8, 6), torch.randn(12, 6)
    out = sparsenn.einsum("ij,ik,jk->ij", mask, q, k)
    assert out.format == mask.format and out.pos == mask.pos and out.crd == mask.crd
    torch.testing.assert_close(out.to_dense(), dense * (q @ k.T))
    text = sparsenn.explain("ij,ik,jk->ij", mask, q, k)
    assert "indices split i -> (i, i') by 4, j -> (j, j') by 4" in text
    assert "values are written at its positions" in text


def test_elementwise_product_of_blocked_operands_is_blocked():
    dense = block_sparse((6, 6), (3, 2))
    a = SparseTensor.from_dense(dense, format="bsr(3,2)")
    out = sparsenn.einsum("ij,ij->ij", a, a)
    assert str(out.format) == "bsr(3,2)"
    torch.testing.assert_close(out.to_dense(), dense * dense)


@pytest.mark.parametrize("out_format", ["csr", "bsr(2,3)", "dense", "auto"])
def test_requested_output_formats(out_format):
    dense = block_sparse((8, 12), (2, 3))
    a = SparseTensor.from_dense(dense, format="bsr(2,3)")
    out = sparsenn.einsum("ij,ij->ij", a, a, out_format=out_format)
    if out_format == "dense":
        assert isinstance(out, torch.Tensor)
    else:
        assert str(out.format) == ("bsr(2,3)" if out_format == "auto" else out_format)
        out = out.to_dense()
    torch.testing.assert_close(out, dense * dense)


def test_rank3_blocks_with_a_dense_batch_mode():
    dense = block_sparse((3, 8, 8), (1, 4, 4))
    s = SparseTensor.from_dense(dense, format="ddc(1,4,4)")
    v = torch.randn(3, 8, 5, dtype=torch.float64)
    torch.testing.assert_close(sparsenn.einsum("hij,hjd->hid", s, v), dense @ v)
    split = split_of("hij,hjd->hid", ["ddc(1,4,4)", None], [(3, 8, 8), (3, 8, 5)])
    assert dict(split.sizes) == {"i": 4, "j": 4}  # blocks of 1 leave h whole
    scores = sparsenn.einsum("hij,hid,hjd->hij", s, v, v)
    assert scores.format == s.format
    torch.testing.assert_close(scores.to_dense(), dense * (v @ v.transpose(1, 2)))


def test_rank4_blocks():
    dense = block_sparse((2, 2, 8, 6), (1, 1, 2, 3))
    s = SparseTensor.from_dense(dense, format="dddc(1,1,2,3)")
    v = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    torch.testing.assert_close(sparsenn.einsum("bhij,bhjd->bhid", s, v), dense @ v)


@pytest.mark.parametrize("fmt", ["bsr(2,3)", "bsc(2,3)"])
def test_gradients_of_blocked_values_are_sampled_on_the_block_pattern(fmt):
    dense = block_sparse((4, 6), (2, 3), density=0.6)
    a = SparseTensor.from_dense(dense, format=fmt)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    values = a.values.detach().clone().requires_grad_(True)

    def run(v, x):
        return sparsenn.einsum("ij,jk->ik", a.with_values(v), x, out_format="dense")

    assert torch.autograd.gradcheck(run, (values, x))
    run(values, x).sum().backward()
    stored = a.with_values(torch.ones_like(a.values)).to_dense().bool()
    expected = torch.ones(4, 3, dtype=torch.float64) @ x.detach().T
    torch.testing.assert_close(a.with_values(values.grad).to_dense(), expected * stored)


def test_gradients_through_a_block_sddmm():
    dense = block_sparse((4, 4), (2, 2), density=0.7)
    mask = SparseTensor.from_dense(dense, format="bsr(2,2)")
    q = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    values = mask.values.detach().clone().requires_grad_(True)

    def run(v, q, k):
        return sparsenn.einsum("ij,ik,jk->ij", mask.with_values(v), q, k).values

    assert torch.autograd.gradcheck(run, (values, q, k))


# ----------------------------------------------------------------------------- register tiles


def split_schedule(equation, operands, target):
    """The schedule of ``equation``'s split form (blocked operands) on ``target``."""
    formats = [op.format if isinstance(op, SparseTensor) else None for op in operands]
    split = split_call(parse_einsum(equation, len(operands)), formats, [tuple(op.shape) for op in operands], "dense")
    views = split.operands(operands)
    return schedule(split.assignment, [operand_info(op) for op in views], None, 4, target)


def bsr_spmm_operands(block=32, n=256, k=128):
    dense = block_sparse((n, n), (block, block), density=0.2, dtype=torch.float32)
    return [SparseTensor.from_dense(dense, format=f"bsr({block},{block})"), torch.randn(n, k)], dense


@pytest.mark.parametrize("target, rows, vectors, width", [(AVX2, 6, 2, 32), (AVX512, 6, 4, 64)])
def test_a_stored_block_times_a_dense_panel_gets_a_register_tile_sized_from_the_target(target, rows, vectors,
                                                                                         width):
    operands, _ = bsr_spmm_operands(block=24, n=240)
    sched = split_schedule("ij,jk->ik", operands, target)
    (nest,) = sched.nests
    assert nest.order == ("i", "j", "i'", "j'", "k")
    assert nest.register_tile == RegisterTile("i'", rows, vectors)
    assert nest.register_block.size == vectors * width // 4
    assert sched.target.vector_bytes == width  # a tiled kernel is written for the widest vectors


def test_rows_prefer_a_divisor_of_the_block():
    operands, _ = bsr_spmm_operands(block=32)
    assert split_schedule("ij,jk->ik", operands, AVX2).nests[0].register_tile.rows == 4  # not 6


def test_no_register_tile_over_compressed_rows():
    a = SparseTensor.from_dense(block_sparse((64, 64), (1, 1), density=0.1, dtype=torch.float32), format="csr")
    sched = schedule(parse_einsum("ij,jk->ik", 2), [operand_info(a), operand_info(torch.randn(64, 64))], None, 4,
                     AVX512)
    assert sched.nests[0].register_block is not None and sched.nests[0].register_tile is None


@pytest.mark.parametrize("block, n, k", [(32, 256, 128), (24, 240, 40), (7, 63, 19), (6, 36, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_register_tiled_kernels_match_torch_with_partial_tiles(block, n, k, dtype):
    dense = block_sparse((n, n), (block, block), density=0.3, dtype=dtype)
    a = SparseTensor.from_dense(dense, format=f"bsr({block},{block})")
    x = torch.randn(n, k, dtype=dtype)
    text = sparsenn.explain("ij,jk->ik", a, x)
    assert "register tile" in text or block < 8  # tiles need a reduction and a panel of whole vectors
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}  # sums of up to 256 products
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), dense @ x, **tol)
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x, out_format="dense"), dense @ x, **tol)


def test_register_tiled_sum_of_two_products():
    dense = block_sparse((64, 64), (16, 16), density=0.4)
    a = SparseTensor.from_dense(dense, format="bsr(16,16)")
    x, y = torch.randn(64, 48, dtype=torch.float64), torch.randn(64, 48, dtype=torch.float64)
    out = sparsenn.compile("Y[i,k] = A[i,j] * X[j,k] - A[i,j] * Z[j,k]")(a, x, y)
    torch.testing.assert_close(out, dense @ x - dense @ y)


# ----------------------------------------------------------------------------- n:m operands


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 8)])
def test_nm_operands_split_their_last_index_into_groups_and_offsets(n, m):
    weight = SparseTensor.from_dense(torch.randn(6, 16, dtype=torch.float64), format=f"nm({n},{m})")
    x = torch.randn(5, 16, dtype=torch.float64)
    text = sparsenn.explain("bi,oi->bo", x, weight)
    assert f"indices split i -> (i, i') by {m}" in text
    torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, weight), x @ weight.to_dense().T)
    values = weight.values.detach().clone().requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v, xg: sparsenn.einsum("bi,oi->bo", xg, weight.with_values(v)),
                                    (values, xg))


def test_an_nm_operand_read_in_another_mode_order_is_re_stored_with_compressed_offsets():
    weight = SparseTensor.from_dense(torch.randn(512, 512, dtype=torch.float64), format="nm(2,4)")
    grad = torch.randn(64, 512, dtype=torch.float64)
    plan = sparsenn.compiler.api.plan("bo,oi->bi", grad, weight, out_format="dense")
    assert plan.schedule.nests[0].order[0] != "o"  # the reduction outermost would run on one thread
    assert any(slot.fmt is not None and slot.fmt.levels[-1].letter == "c" for slot in plan.kernel.slots)
    torch.testing.assert_close(sparsenn.einsum("bo,oi->bi", grad, weight, out_format="dense"),
                               grad @ weight.to_dense())


# ----------------------------------------------------------------------------- panels

SMALL_L2 = Target(vector_bytes=32, vector_registers=16, l2_bytes=16 << 10, llc_bytes=1 << 20)


@pytest.fixture
def small_l2_host(host_target):
    """Plans made while this is active are scheduled for :data:`SMALL_L2` (tiles on small shapes)."""
    host_target(SMALL_L2)


@pytest.mark.parametrize("batch", [64, 90, 100])  # whole panels of 16, and a partial last one
@pytest.mark.parametrize("fmt", ["csr", "nm(2,4)", "bsr(8,8)"])
def test_a_batch_major_input_is_read_in_panels_of_the_batch_tile(batch, fmt, small_l2_host, host_target):
    if fmt == "csr":  # else its kernel packs the input itself (test_block_packs.py)
        host_target(relaying(SMALL_L2))
    weight = SparseTensor.from_dense(block_sparse((48, 64), (8, 8), density=0.5, dtype=torch.float64), format=fmt)
    x = torch.randn(batch, 64, dtype=torch.float64)
    sched = sparsenn.compiler.api.plan("bi,oi->bo", x, weight, out_format="dense").schedule
    (nest,) = sched.nests
    (tile,) = [t for t in nest.tiles if t.index == "b"]
    assert nest.panels == ((0, tile.size),)
    torch.testing.assert_close(sparsenn.einsum("bi,oi->bo", x, weight, out_format="dense"),
                               x @ weight.to_dense().T)


def test_no_panels_for_an_operand_read_in_its_own_layout(small_l2_host):
    weight = SparseTensor.from_dense(block_sparse((48, 64), (1, 1), density=0.2, dtype=torch.float64), format="csr")
    xt = torch.randn(64, 100, dtype=torch.float64)
    (nest,) = sparsenn.compiler.api.plan("oi,ib->ob", weight, xt, out_format="dense").schedule.nests
    assert any(t.index == "b" for t in nest.tiles) and nest.panels == ()


def test_blocked_formats_whose_levels_are_all_dense_store_every_entry():
    dense = torch.randn(1, 2, 4, dtype=torch.float64)
    s = SparseTensor.from_dense(dense, format="ddd[1,2,0](1,2,2)")
    grad = torch.randn(1, 2, 4, dtype=torch.float64)
    out = sparsenn.einsum("bac,bac->bac", grad, s, out_format=s.format)
    assert out.format == s.format and out.nnz == s.nnz
    torch.testing.assert_close(out.to_dense(), grad * dense)


def test_a_requested_unblocked_format_storing_split_indices_densely_is_split_like_an_operand():
    csr = parse_format("csr", 2)
    split = split_of("ij,ij->ij", ["bsr(2,1)", "csr"], [(4, 3), (4, 3)], csr)
    assert dict(split.sizes) == {"i": 2} and split.stored == csr and split.final is None
    assert split.request == split.layouts[1].format  # the csr operand can anchor the result


def test_a_requested_unblocked_pattern_over_split_indices_keeps_its_positions():
    # Found by the long fuzz run: the sampled gradient of the dcdc operand, whose indices a
    # blocked operand splits, was computed as whole blocks and lost its pattern.
    b = SparseTensor.from_dense(torch.zeros(1, 1, dtype=torch.float64), format="coo")
    single = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    single[0, 1, 0, 0] = 1.5
    e = SparseTensor.from_dense(single, format="dcdc[1,2,3,0]")
    s = SparseTensor.from_dense(torch.zeros(1, 2, 2, dtype=torch.float64), format="ddd[1,2,0](1,2,2)")
    leaves = [op.values.clone().requires_grad_(True) for op in (b, e, s)]

    def run(*values):
        ops = [op.with_values(v) for op, v in zip((b, e, s), values)]
        return sparsenn.einsum("bd,eadc,bac->ebda", *ops).to_dense()

    assert torch.autograd.gradcheck(run, tuple(leaves))


# ----------------------------------------------------------------------------- dot tiles


def _block_sddmm_schedule(block: int, target: Target):
    dense = block_sparse((4 * block, 4 * block), (block, block), density=0.3, dtype=torch.float32)
    mask = SparseTensor.from_dense(dense, format=f"bsr({block},{block})")
    operands = [mask, torch.randn(4 * block, 32), torch.randn(4 * block, 32)]
    formats = [op.format if isinstance(op, SparseTensor) else None for op in operands]
    split = split_call(parse_einsum("ij,ik,jk->ij", 3), formats, [tuple(op.shape) for op in operands], mask.format)
    views = split.operands(operands)
    # values are written at the mask's positions (operand 0), read in its storage order i, j, i', j'
    return schedule(split.assignment, [operand_info(op) for op in views], None, 4, target, anchor=0)


@pytest.mark.parametrize("target, cols", [(AVX2, 2), (AVX512, 4)])
def test_block_sddmm_of_narrow_blocks_gets_a_dot_tile_sized_from_the_target(target, cols):
    (nest,) = _block_sddmm_schedule(6, target).nests  # j' narrower than a vector
    assert nest.order[-3:] == ("i'", "j'", "k")
    assert nest.dot_tile == DotTile("i'", "j'", 4, cols)


@pytest.mark.parametrize("target, tile", [(AVX2, RegisterTile("i'", 4, 2)), (AVX512, RegisterTile("i'", 8, 1))])
def test_block_sddmm_of_wide_blocks_keeps_its_sums_in_a_register_tile(target, tile):
    # S = M * (Q K^T) per 16 x 16 block: k moves above j', K is re-laid out with j' last,
    # and a tile of rows i' x vectors of j' sums over k; the mask scales the stored sums.
    sched = _block_sddmm_schedule(16, target)
    (nest,) = sched.nests
    assert nest.order[-3:] == ("i'", "k", "j'")
    assert nest.register_tile == tile and nest.dot_tile is None and nest.stores_once_anchors == (0,)
    assert [key for key, _ in sched.transposes] == [(0, 2)]


@pytest.mark.parametrize("block", [16, 5])
def test_a_masked_product_reads_its_mask_for_the_pattern_and_gets_micro_kernels(block):
    """``S<M> = c Q Kᵀ``: the mask's values are never read (any values give the same
    result) and its one term of dense factors is a product with the mask filtering, so
    it gets the SDDMM's register or dot tile and no ``0 * M`` term."""
    dense = block_sparse((4 * block, 4 * block), (block, block), density=0.3, dtype=torch.float64)
    mask = SparseTensor.from_dense(dense, format=f"bsr({block},{block})")
    mask = mask.with_values(torch.randn(mask.nnz, dtype=torch.float64))  # values that must not matter
    q = torch.randn(4 * block, 24, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4 * block, 24, dtype=torch.float64, requires_grad=True)
    scores = sparsenn.compile("S<M>[i,j] = 0.5 * Q[i,d] * K[j,d]")
    out = scores(mask, q, k)
    torch.testing.assert_close(out.to_dense(), 0.5 * (q @ k.T).detach() * (dense != 0))
    shown = scores.explain(mask, q, k)
    assert ("register tile" in shown or "dot tile" in shown) and "0 * M" not in shown
    assert torch.autograd.gradcheck(lambda q, k: scores(mask, q, k).values, (q, k))


def test_no_dot_tile_over_a_compressed_loop():
    mask = SparseTensor.from_dense(block_sparse((64, 64), (1, 1), density=0.2, dtype=torch.float32), format="csr")
    (nest,) = sparsenn.compiler.api.plan("ij,ik,jk->ij", mask, torch.randn(64, 32), torch.randn(64, 32)
                                                 ).schedule.nests
    assert nest.dot_tile is None


@pytest.mark.parametrize("block, n, k", [(16, 64, 64), (20, 60, 33), (12, 48, 9), (6, 36, 19), (5, 35, 8), (3, 9, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_format", [None, "dense"])
def test_dot_tiled_kernels_match_torch_with_partial_tiles(block, n, k, dtype, out_format, avx2_host):
    # sparse enough that the sampled product is one kernel, not a dense product sampled after
    dense = block_sparse((n, n), (block, block), density=0.3, dtype=dtype)
    mask = SparseTensor.from_dense(dense, format=f"bsr({block},{block})")
    q, kk = torch.randn(n, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out = sparsenn.einsum("ij,ik,jk->ij", mask, q, kk, out_format=out_format)
    (nest,) = sparsenn.compiler.api.plan("ij,ik,jk->ij", mask, q, kk, out_format=out_format).schedule.nests
    assert nest.register_tile or nest.dot_tile  # a register tile when a block row spans a vector
    out = out.to_dense() if isinstance(out, SparseTensor) else out
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, dense * (q @ kk.T), **tol)


def test_a_blocked_weight_is_not_streamed_once_per_batch_row():
    # dX = dY W for a bsr weight: with b outermost every batch row would traverse all of
    # W (the cost model charges each extra full pass over a sparse operand).
    weight = SparseTensor.from_dense(block_sparse((512, 512), (32, 32), density=0.1, dtype=torch.float32),
                                     format="bsr(32,32)")
    operands = [torch.randn(256, 512), weight]
    formats = [None, weight.format]
    split = split_call(parse_einsum("bo,oi->bi", 2), formats, [(256, 512), (512, 512)], "dense")
    views = split.operands(operands)
    (nest,) = schedule(split.assignment, [operand_info(op) for op in views], None, 4, AVX2).nests
    assert nest.order[0] != "b"
    torch.testing.assert_close(sparsenn.einsum("bo,oi->bi", *operands, out_format="dense"),
                               operands[0] @ weight.to_dense(), rtol=1e-4, atol=1e-4)


def test_an_nm_operand_read_unsplit_keeps_its_pattern():
    # Found by the long fuzz run: a bsc operand's blocks of 2 and the nm groups of 4 disagree
    # on index a, so the nm operand is read as CSR; its sampled gradient must still come
    # back as nm(2,4) with the pattern's positions.
    a = SparseTensor.from_dense(torch.randn(2, 4, dtype=torch.float64), format="nm(2,4)")
    b = SparseTensor.from_dense(torch.randn(4, 2, dtype=torch.float64), format="bsc(2,2)")
    c = torch.randn(4, dtype=torch.float64)
    split = split_of("ba,ab,a->", ["nm(2,4)", "bsc(2,2)", None], [(2, 4), (4, 2), (4,)])
    assert str(split.converted[0]) == "csr"
    leaves = [op.values.clone().requires_grad_(True) for op in (a, b)]

    def run(va, vb):
        return sparsenn.einsum("ba,ab,a->", a.with_values(va), b.with_values(vb), c)

    assert torch.autograd.gradcheck(run, tuple(leaves))


@pytest.mark.parametrize("seed", [26, 33, 41])
def test_an_nm_factor_narrows_a_sampled_gradient(seed):
    # An n:m operand's groups are sparse inside its blocks: a gradient sampled on b's full
    # bsc pattern that multiplies by it keeps b's pattern, not the product's (these seeds
    # store no entry in a's last two columns, so the product alone loses half of b's).
    gen = torch.Generator().manual_seed(seed)
    a = SparseTensor.from_dense(torch.randn(2, 4, dtype=torch.float64, generator=gen), format="nm(2,4)")
    b = SparseTensor.from_dense(torch.randn(4, 2, dtype=torch.float64, generator=gen), format="bsc(2,2)")
    c = torch.randn(4, dtype=torch.float64, generator=gen)
    leaves = [op.values.clone().requires_grad_(True) for op in (a, b)]

    def run(va, vb):
        return sparsenn.einsum("ba,ab,a->", a.with_values(va), b.with_values(vb), c)

    assert torch.autograd.gradcheck(run, tuple(leaves))


def test_a_product_with_an_nm_factor_is_not_anchored_on_a_full_pattern():
    full = parse_format("bsc(2,2)", 2)
    product = parse_einsum("ab,ba->ab", 2)  # the second factor is n:m, read transposed
    assert sampled_operand(product, (full, parse_format("nm(2,4)", 2)), (None, None), full) is None
    assert sampled_operand(product, (full, parse_format("csr", 2)), (None, None), full) is None
    assert sampled_operand(product, (full, None), (None, None), full) == 0


def test_a_converted_operand_is_viewed_over_the_indices_the_others_split():
    # Found by the long fuzz run: a's blocks of 2 on b meet b's compressed level in c, so
    # a is converted, and must then be read with its index a split by c's blocks.
    a = SparseTensor.from_dense(block_sparse((2, 4), (2, 1), density=0.7), format="bsc(2,1)")
    c = SparseTensor.from_dense(block_sparse((4, 2), (2, 1), density=0.7, seed=1), format="cd[1,0](2,1)")
    split = split_of("ba,ab->", ["bsc(2,1)", "cd[1,0](2,1)"], [(2, 4), (4, 2)], "dense")
    assert dict(split.sizes) == {"a": 2} and split.converted[0] is not None and split.layouts[0] is not None
    torch.testing.assert_close(sparsenn.einsum("ba,ab->", a, c, out_format="dense"),
                               torch.einsum("ba,ab->", a.to_dense(), c.to_dense()))


# ----------------------------------------------------------------------------- gathered rows


def routed(experts, tokens, k=2, dtype=torch.float64, seed=0, empty=()):
    """A (experts x tokens) CSR gate with k experts per token, none routed to ``empty``."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.zeros(experts, tokens, dtype=dtype)
    for t in range(tokens):
        chosen = [e for e in torch.randperm(experts, generator=g).tolist() if e not in empty][:k]
        gate[chosen, t] = torch.rand(len(chosen), generator=g, dtype=dtype) + 0.1
    return gate


@pytest.mark.parametrize("target, rows, vectors", [(AVX2, 6, 2), (AVX512, 6, 4)])
def test_rows_gathered_by_a_sparse_level_times_a_dense_panel_get_a_register_tile(target, rows, vectors):
    gate = SparseTensor.from_dense(routed(8, 128, dtype=torch.float32), format="csr")
    x, w = torch.randn(128, 64), torch.randn(8, 64, 128)
    infos = [operand_info(op) for op in (gate, x, w)]
    (nest,) = schedule(parse_einsum("et,td,edh->eth", 3), infos, None, 4, target).nests
    assert nest.order == ("e", "t", "d", "h")
    assert nest.register_tile == RegisterTile("t", rows, vectors, gathered_by=0)


def test_the_weights_of_experts_with_many_tokens_are_packed():
    # 1024 tokens, 2 of 8 experts each: 256 rows per expert share each pack. 256 KiB (a
    # quarter of the L2) holds the whole h = 128 in blocks of 64 d x one tile width.
    gate = SparseTensor.from_dense(routed(8, 1024, dtype=torch.float32), format="csr")
    infos = [operand_info(op) for op in (gate, torch.randn(1024, 64), torch.randn(8, 64, 128))]
    (nest,) = schedule(parse_einsum("et,td,edh->eth", 3), infos, None, 4, AVX512).nests
    assert nest.register_tile == RegisterTile("t", 6, 4, gathered_by=0, packed=(2,), panel=128)
    assert nest.tiles == ()  # the panels replace the tile of h


def test_weights_across_their_layout_are_packed_from_where_they_are():
    # W[e, h, d] with h the vector index: the pack copies it a column of h at a time,
    # instead of a re-laid out copy of all of W (a transpose before the kernel).
    gate = SparseTensor.from_dense(routed(8, 1024, dtype=torch.float32), format="csr")
    infos = [operand_info(op) for op in (gate, torch.randn(1024, 64), torch.randn(8, 128, 64))]
    sched = schedule(parse_einsum("et,td,ehd->eth", 3), infos, None, 4, AVX512)
    assert sched.nests[0].register_tile == RegisterTile("t", 6, 4, gathered_by=0, packed=(2,), panel=128)
    assert sched.transposes == ()


@pytest.mark.parametrize("tokens, equation, shapes, why", [
    (1024, "et,td,edh->eth", [(1024, 8), (8, 8, 128)], "too short a reduction to alias in L1"),
    (128, "et,td,edh->eth", [(128, 64), (8, 64, 128)], "too few rows per expert to pay for the copy"),
])
def test_weights_are_not_packed(tokens, equation, shapes, why):
    gate = SparseTensor.from_dense(routed(8, tokens, dtype=torch.float32), format="csr")
    infos = [operand_info(op) for op in (gate, *(torch.randn(s) for s in shapes))]
    (nest,) = schedule(parse_einsum(equation, 3), infos, None, 4, AVX512).nests
    assert nest.register_tile is not None and nest.register_tile.packed == (), why


def test_a_quarter_of_the_l2_bounds_the_packed_panel():
    gate = SparseTensor.from_dense(routed(8, 1024, dtype=torch.float32), format="csr")
    infos = [operand_info(op) for op in (gate, torch.randn(1024, 512), torch.randn(8, 512, 2048))]
    small = Target(vector_bytes=32, widest_vector_bytes=64, vector_registers=32, l2_bytes=512 << 10,
                   llc_bytes=32 << 20)
    panels = {target.l2_bytes: schedule(parse_einsum("et,td,edh->eth", 3), infos, None, 4, target)
              .nests[0].register_tile.panel for target in (AVX512, small)}
    assert panels == {1 << 20: 128, 512 << 10: 64}  # 512 d x 64 floats x 4 bytes = 128 KiB a block


def test_a_tiles_rows_over_the_reduction_bound_the_packs_depth():
    # A tile's 6 rows over one pack's depth of d fill at most half the L1: d = 2048 runs
    # in 4 layers of 512 under a 32 KiB L1, 2 of 1024 under 48 KiB; d = 512 stays whole.
    gate = SparseTensor.from_dense(routed(8, 1024, dtype=torch.float32), format="csr")

    def tile(d: int, l1: int) -> RegisterTile:
        infos = [operand_info(op) for op in (gate, torch.randn(1024, d), torch.randn(8, d, 512))]
        target = dataclasses.replace(AVX512, l1_bytes=l1)
        return schedule(parse_einsum("et,td,edh->eth", 3), infos, None, 4, target).nests[0].register_tile

    assert [tile(2048, 32 << 10).depth, tile(2048, 48 << 10).depth, tile(512, 32 << 10).depth] == [512, 1024, 0]
    # The panel fills a quarter of the L2 at the layer's depth: 256 KiB / (512 d x 64 floats x 4 bytes).
    assert tile(2048, 32 << 10).panel == 128 and tile(2048, 48 << 10).panel == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", ["W[e,d,h]", "W[e,h,d]"])
def test_layered_packs_match_torch_with_the_epilogue_after_the_last_layer(host_target, dtype, threads, weights):
    # A 1 KiB L1 splits d = 100 into layers (5 of 20 in fp32; 7, the last of 10, in
    # fp64); a 64 KiB L2 splits h = 300 into panels (192 and 64 wide in fp32, 128 in
    # fp64) and a partial block; the gelu applies once, after the last layer. The
    # weights are packed from either layout.
    host_target(dataclasses.replace(AVX512, l1_bytes=1 << 10, l2_bytes=64 << 10))
    gate = routed(6, 1301, dtype=dtype, empty=(4,))
    sparse = SparseTensor.from_dense(gate, format="csr")
    x, w = torch.randn(1301, 100, dtype=dtype), torch.randn(6, 100, 300, dtype=dtype)
    hidden = sparsenn.compiler.compile_expression(f"A[e,t,h] = gelu(R[e,t] * X[t,d] * {weights})", out_format="dense")
    if weights == "W[e,h,d]":
        w = w.transpose(1, 2).contiguous()
    panel, depth = (192, 20) if dtype == torch.float32 else (128, 15)
    assert f"panels of {panel} h x {depth} d;" in hidden.explain(sparse, x, w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = hidden(sparse, x, w)
    finally:
        torch.set_num_threads(before)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {}
    reference = torch.einsum(f"et,td,{weights[2:-1].replace(',', '')}->eth", gate, x, w)
    torch.testing.assert_close(out, torch.nn.functional.gelu(reference), **tol)


def test_layered_packs_over_dense_rows_match_torch(host_target):
    # Dense rows c of each stored e (a 1 KiB L1: layers of 16 of d = 64, the floor).
    host_target(dataclasses.replace(AVX512, l1_bytes=1 << 10))
    scale = torch.zeros(20, dtype=torch.float64)
    scale[[3, 11]] = torch.tensor([1.5, -2.0], dtype=torch.float64)
    x, w = torch.randn(20, 260, 64, dtype=torch.float64), torch.randn(20, 64, 72, dtype=torch.float64)
    sparse = SparseTensor.from_dense(scale, format="c")
    assert "packed per thread in panels of 96 h x 16 d;" in sparsenn.explain("e,ecd,edh->ech", sparse, x, w,
                                                                              out_format="dense")
    out = sparsenn.einsum("e,ecd,edh->ech", sparse, x, w, out_format="dense")
    torch.testing.assert_close(out, torch.einsum("e,ecd,edh->ech", scale, x, w))


@pytest.mark.parametrize("tokens, d, h", [(64, 32, 64), (37, 5, 19), (9, 16, 40), (1, 3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gathered_register_tiles_match_torch(tokens, d, h, dtype):
    gate = routed(6, tokens, dtype=dtype, empty=(2,))  # an expert without tokens
    x, w = torch.randn(tokens, d, dtype=dtype), torch.randn(6, d, h, dtype=dtype)
    sparse = SparseTensor.from_dense(gate, format="csr")
    out = sparsenn.einsum("et,td,edh->eth", sparse, x, w, out_format="dense")
    text = sparsenn.explain("et,td,edh->eth", sparse, x, w, out_format="dense")
    assert ("stored rows of factor 0" in text) == (tokens > 1)  # one token: nothing to tile
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, torch.einsum("et,td,edh->eth", gate, x, w), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", ["edh", "ehd"])
def test_packed_panels_match_torch_across_panels_and_partial_blocks(dtype, threads, weights):
    # d = 512 fills a quarter of the (AVX2 host's) 1 MiB L2 with 128 of h (64 in fp64):
    # h = 300 runs several panels, a last narrower one and a partial block; 1301 tokens
    # over 5 experts leave partial tiles of rows, which run from the panels too.
    gate = routed(6, 1301, dtype=dtype, empty=(4,))
    x, w = torch.randn(1301, 512, dtype=dtype), torch.randn(6, 512, 300, dtype=dtype)
    if weights == "ehd":
        w = w.transpose(1, 2).contiguous()
    equation = f"et,td,{weights}->eth"
    sparse = SparseTensor.from_dense(gate, format="csr")
    plan = sparsenn.compiler.api.plan(equation, sparse, x, w, out_format="dense")
    assert plan.schedule.nests[0].register_tile.panel < 300
    assert "packed per thread in panels" in sparsenn.explain(equation, sparse, x, w, out_format="dense")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = sparsenn.einsum(equation, sparse, x, w, out_format="dense")
    finally:
        torch.set_num_threads(before)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, torch.einsum(equation, gate, x, w), **tol)


@pytest.mark.parametrize("weights", ["edh", "ehd", "hde"])
def test_packed_panels_over_dense_rows_match_torch(weights):
    # A compressed vector over e: the rows c of each stored e are a dense range (260: a
    # partial tile; untiled, as x holds 20 x 256 values per row), the weights of e
    # packed once for all of them, from any layout: h last (rows of the strip), d last
    # (blocks transposed in registers), neither (element by element).
    scale = torch.zeros(20, dtype=torch.float64)
    scale[[3, 11]] = torch.tensor([1.5, -2.0], dtype=torch.float64)
    x, w = torch.randn(20, 260, 256, dtype=torch.float64), torch.randn(20, 256, 72, dtype=torch.float64)
    w = w.permute(*("edh".index(i) for i in weights)).contiguous()
    equation = f"e,ecd,{weights}->ech"
    sparse = SparseTensor.from_dense(scale, format="c")
    text = sparsenn.explain(equation, sparse, x, w, out_format="dense")
    assert "packed per thread in panels" in text and "transpose:" not in text
    out = sparsenn.einsum(equation, sparse, x, w, out_format="dense")
    torch.testing.assert_close(out, torch.einsum(equation, scale, x, w))


def slots(counts, capacity, dtype):
    """An experts x capacity CSR of occupied slots: expert e holds slots 0 .. counts[e] - 1."""
    mask = torch.zeros(len(counts), capacity, dtype=dtype)
    for e, n in enumerate(counts):
        mask[e, :n] = torch.rand(n, generator=torch.Generator().manual_seed(e), dtype=dtype) + 0.5
    return mask


def test_weight_gradients_pack_the_rows_their_sparse_reduction_steps_through():
    # dW[e,d,h] = sum_c R[e,c] X[e,c,d] dH[e,c,h] over each expert's stored slots c: tiles
    # of 6 rows of d, dH's rows at the stored c packed per expert (a 256 KiB quarter of
    # the L2 holds 4 blocks of 64 h x 256 slots), X read in place by the rows' scalar
    # loads (no re-laid out copy). 256 slots fill a 32 KiB L1's half a line each; 512
    # do not (the tiles would read X's lines from L2 and beyond): not packed.
    def tile(count: int):
        r = SparseTensor.from_dense(slots([count] * 8, count, torch.float32), format="csr")
        infos = [operand_info(op) for op in (r, torch.randn(8, count, 100), torch.randn(8, count, 512))]
        sched = schedule(parse_einsum("ec,ecd,ech->edh", 3), infos, None, 4, AVX512)
        assert sched.nests[0].order == ("e", "d", "c", "h")
        return sched.nests[0].register_tile, sched.transposes

    assert tile(256) == (RegisterTile("d", 6, 4, packed=(2,), panel=256, stepped_by=0), ())
    assert tile(512)[0].packed == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_packs_over_a_sparse_reduction_match_torch(dtype, threads):
    # Experts with 200, 0, 77, 150, 5 and 160 slots; 100 rows of d (whole tiles and 4
    # rows left), h = 200 (several panels and a partial block).
    counts = [200, 0, 77, 150, 5, 160]
    gate = slots(counts, 200, dtype)
    r = SparseTensor.from_dense(gate, format="csr")
    x, dh = torch.randn(6, 200, 100, dtype=dtype), torch.randn(6, 200, 200, dtype=dtype)
    text = sparsenn.explain("ec,ecd,ech->edh", r, x, dh, out_format="dense")
    assert "packed per thread" in text and "transpose:" not in text
    assert "over the stored coordinates of factor 0" in text
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = sparsenn.einsum("ec,ecd,ech->edh", r, x, dh, out_format="dense")
    finally:
        torch.set_num_threads(before)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, torch.einsum("ec,ecd,ech->edh", gate, x, dh), **tol)


def test_tiled_kernels_written_for_the_widest_vectors_are_correct_on_any_host(host_target):
    # 64-byte vectors (AVX-512); on a narrower host GCC splits them, still correct.
    host_target(AVX512)
    dense = block_sparse((48, 48), (16, 16), density=0.5)
    a = SparseTensor.from_dense(dense, format="bsr(16,16)")
    x, q = torch.randn(48, 70, dtype=torch.float64), torch.randn(48, 21, dtype=torch.float64)
    assert sparsenn.compiler.api.plan("ij,jk->ik", a, x).schedule.target.vector_bytes == 64
    torch.testing.assert_close(sparsenn.einsum("ij,jk->ik", a, x), dense @ x)
    torch.testing.assert_close(sparsenn.einsum("ij,ik,jk->ij", a, q, q).to_dense(), dense * (q @ q.T))
    gate = routed(4, 30)
    w = torch.randn(4, 21, 40, dtype=torch.float64)
    torch.testing.assert_close(sparsenn.einsum("et,td,edh->eth", SparseTensor.from_dense(gate, format="csr"), q[:30], w,
                                               out_format="dense"), torch.einsum("et,td,edh->eth", gate, q[:30], w))


# ----------------------------------------------------------------------------- seven-index orders


def attention_blocks(length: int, density: float, seed: int = 0) -> SparseTensor:
    """A (1, 1, L, L) pattern of 64x64 blocks, ones as values, as BigBird's scores."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(1, 1, length // 64, length // 64, generator=g) < density
    dense = blocks.repeat_interleave(64, -2).repeat_interleave(64, -1).float()
    return SparseTensor.from_dense(dense, format="dddc(1,1,64,64)")


@pytest.mark.parametrize("length, density", [(1024, 0.5), (2048, 0.06)])
def test_seven_index_block_products_read_the_blocks_as_stored(length, density):
    """Split rank-4 block products have seven indices, past the exhaustive search: the
    candidates include the sparse operand's storage order, so the block SpMM keeps
    ``b,h,i,j,i',j',d`` with its register tile instead of re-storing the scores every
    call, and the block SDDMM writes in place on its mask (never re-stored; the keys are
    re-laid out with ``j'`` last for its register tile)."""
    mask = attention_blocks(length, density)
    v = torch.randn(1, 1, length, 64)
    for equation, operands, out_format, order in [
        ("bhij,bhjd->bhid", [mask, v], None, ("b", "h", "i", "j", "i'", "j'", "d")),
        ("bhij,bhid,bhjd->bhij", [mask, v, v], mask.format, ("b", "h", "i", "j", "i'", "d", "j'")),
    ]:
        plan = sparsenn.compiler.api.plan(equation, *operands, out_format=out_format)
        (nest,) = plan.schedule.nests
        assert nest.order == order and all(k != 0 for (_, k), _ in plan.schedule.transposes)
        assert nest.register_tile is not None
        if out_format is not None:
            assert plan.anchor == 0


def test_cache_tiles_give_way_to_a_register_tile_on_the_same_loops():
    """A block SDDMM (BigBird's scores) whose in-block loops Algorithm 3 would tile by 32
    on this target (half of each 64-block, splitting the register block) is register-tiled
    over whole blocks instead, as at every other length."""
    from sparsenn.layers.attention import _scores

    layer = sparsenn.BlockSparseAttention(64, 1, block_size=64, num_random_blocks=1, seed=0)
    mask = layer._masks.mask(4096 // 64, 1, None, None, False, torch.float32, True)[0]
    q = torch.randn(1, 1, 4096, 64)
    text = sparsenn.compile(_scores(layer._score_scale, False)).explain(mask, q, q)
    assert "tiles: none" in text and "register tile: " in text


@pytest.mark.parametrize("fmt", ["csr", "bsr(4,4)", "bsr(2,4)", "bsr(4,1)"])
def test_a_factor_read_for_its_pattern_only_is_not_multiplied_in_a_block(fmt):
    """``L<S>[i,j] = S[i,j] - w[i]``: ``w``'s gradient sums ``dL`` over ``S``'s stored
    positions, ``S`` read for its pattern only; inside a block the sum over the block's
    columns runs on vectors, which must not load ``S``'s values."""
    g = torch.Generator().manual_seed(7)
    dense = torch.randn(12, 16, generator=g, dtype=torch.float64) * (torch.rand(12, 16, generator=g) < 0.4)
    S = sparsenn.from_dense(dense, format=fmt)
    w = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)
    L = sparsenn.compile("L<S>[i,j] = S[i,j] - w[i]")(S, w)
    grad = torch.randn(L.values.shape, dtype=torch.float64, generator=g)
    L.values.backward(grad)
    torch.testing.assert_close(w.grad, -L.with_values(grad).to_dense().sum(1))
