"""Tests of the n:m format ``nm(n,m)``: at most n of every m consecutive entries along
the last dimension, stored as dense levels and a last ``Grouped`` level of offsets."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from sparsenn.formats import Dense, Format, Grouped, SparseTensor, from_coo, from_dense, from_torch, parse_format
from sparsenn.formats.level import LEVEL_KINDS

pytestmark = pytest.mark.filterwarnings("ignore:Sparse (BSR|CSR|BSC|CSC) tensor support is in beta")

DTYPES = [torch.float32, torch.float64]
SHAPES = [(8,), (3, 8), (2, 3, 12)]


def reference_nm(t: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``t`` with all but the ``n`` largest ``|t|`` of every group of ``m`` zeroed (no ties)."""
    groups = t.reshape(*t.shape[:-1], t.shape[-1] // m, m)
    largest = torch.topk(groups.abs(), n, dim=-1).indices
    kept = torch.zeros_like(groups).scatter(-1, largest, groups.gather(-1, largest))
    return kept.reshape(t.shape)


def rebuild(t: SparseTensor, crd_last: torch.Tensor | None = None, values: torch.Tensor | None = None) -> SparseTensor:
    """The validating constructor on ``t``'s arrays, with the grouped level's crd replaced."""
    crd = t.crd[:-1] + (t.crd[-1] if crd_last is None else crd_last,)
    return SparseTensor(t.shape, t.format, t.pos, crd, t.values if values is None else values)


class RecordingBuilder:
    """An IndexBuilder that builds nested tuples."""

    def pos(self, at):
        return ("pos", at)

    def crd(self, at):
        return ("crd", at)

    def add(self, a, b):
        return ("add", a, b)

    def mul(self, a, b):
        return ("mul", a, b)


# ------------------------------------------------------------------ format
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("n, m", [(1, 1), (2, 4), (1, 4), (4, 4), (3, 8)])
def test_parse_layout_and_str_round_trip(rank, n, m):
    fmt = parse_format(f"nm({n},{m})", rank)
    assert str(fmt) == f"nm({n},{m})"
    assert parse_format(str(fmt), rank) == fmt
    assert fmt.block == (1,) * (rank - 1) + (m,)
    assert fmt.mode_order == tuple(range(rank))
    assert all(isinstance(level, Dense) for level in fmt.levels[:-1])
    assert fmt.levels[-1] == Grouped(count=n)
    assert len(fmt.levels) == 2 * rank
    assert fmt.nm == (n, m) and not fmt.is_dense
    assert fmt.letters == "d" * (2 * rank - 1) + "n"


def test_parse_is_case_and_whitespace_tolerant():
    assert parse_format(" NM( 2 , 4 ) ", 2) == parse_format("nm(2,4)", 2)


def test_storage_levels_of_a_matrix():
    fmt = parse_format("nm(2,4)", 2)
    assert fmt.storage_levels((3, 8)) == ((0, 3, False), (1, 2, False), (0, 1, True), (1, 4, True))


def test_other_formats_have_no_nm():
    assert parse_format("csr", 2).nm is None and parse_format("bsr(2,2)", 2).nm is None


@pytest.mark.parametrize("spec, rank, reason", [
    ("nm(5,4)", 2, r"n <= m, got n=5 > m=4"),
    ("nm(0,4)", 2, r"n >= 1, got n=0"),
    ("nm(1,0)", 2, r"m >= 1, got m=0"),
    ("nm(2,4)", 0, r"needs rank >= 1"),
    ("nm(2)", 2, r"unknown format"),
    ("nm(2,4,1)", 2, r"unknown format"),
    ("dn", 2, r"unknown format"),
    ("dddn(1,4)", 2, r"unknown format"),
])
def test_bad_nm_strings(spec, rank, reason):
    with pytest.raises(ValueError, match=reason):
        parse_format(spec, rank)


def test_grouped_letter_is_not_in_the_general_grammar():
    assert LEVEL_KINDS["n"] is Grouped
    with pytest.raises(ValueError, match="unknown format"):
        parse_format("n", 1)


def test_grouped_level_checks_count():
    with pytest.raises(ValueError, match="count >= 1"):
        Grouped(count=0)
    with pytest.raises(TypeError):
        Grouped()


def test_an_unblocked_format_may_end_in_a_grouped_level():
    # What an nm tensor is over split indices (rows, groups, offsets): the compiler reads it so.
    fmt = Format((Dense(), Dense(), Grouped(count=2)), (0, 1, 2), None)
    assert fmt.nm is None and not fmt.is_dense


@pytest.mark.parametrize("levels, order, block, reason", [
    ((Dense(), Dense(), Dense(), Grouped(count=2)), (1, 0), (1, 4), "last level of an nm"),
    ((Dense(), Dense(), Dense(), Grouped(count=2)), (0, 1), (2, 4), "last level of an nm"),
    ((Grouped(count=1), Dense(), Dense(), Grouped(count=2)), (0, 1), (1, 4), "must be the last level"),
    ((Dense(), Dense(), Dense(), Grouped(count=5)), (0, 1), (1, 4), r"n <= m, got n=5 > m=4"),
])
def test_format_rejects_misplaced_grouped_levels(levels, order, block, reason):
    with pytest.raises(ValueError, match=reason):
        Format(levels, order, block)


def test_format_keeps_count_and_pickles():
    fmt = parse_format("nm(3,8)", 2)
    assert fmt.levels[-1].count == 3
    assert pickle.loads(pickle.dumps(fmt)) == fmt
    assert hash(pickle.loads(pickle.dumps(fmt))) == hash(fmt)
    assert fmt != parse_format("nm(2,8)", 2)


def test_grouped_capabilities_and_index_expressions():
    level = Grouped(count=3)
    assert (level.locatable, level.has_pos, level.has_crd, level.full, level.branchless, level.ordered,
            level.assembly) == (False, False, True, False, False, True, "append")
    b = RecordingBuilder()
    assert level.position_bounds(b, "p") == (("mul", "p", 3), ("add", ("mul", "p", 3), 3))
    assert level.positions(b, "P", 8) == ("mul", "P", 3)
    assert level.num_positions(5, 8, None) == 15
    assert level.estimate_positions(5.0, 7, 40.0, 8) == 15.0


# ------------------------------------------------------------------ from_dense
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 4), (4, 4)])
def test_from_dense_keeps_the_n_largest_per_group(dtype, shape, n, m):
    t = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(len(shape) + n))
    s = from_dense(t, f"nm({n},{m})")
    assert s.dtype == dtype and str(s.format) == f"nm({n},{m})"
    assert s.nnz == t.numel() // m * n
    assert torch.equal(s.to_dense(), reference_nm(t, n, m))


def test_from_dense_breaks_ties_towards_the_lower_offset():
    t = torch.tensor([[1.0, -3.0, 3.0, 3.0, 2.0, -2.0, 2.0, 5.0]])
    s = from_dense(t, "nm(2,4)")
    assert s.crd[-1].tolist() == [1, 2, 0, 3]
    assert s.values.tolist() == [-3.0, 3.0, 2.0, 5.0]


def test_sparse_groups_are_padded_with_explicit_zeros_at_the_smallest_free_offsets():
    t = torch.tensor([[0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0],
                      [0.0, 4.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0]])
    s = from_dense(t, "nm(2,4)")
    assert s.crd[-1].tolist() == [0, 3, 0, 1, 0, 1, 0, 2]
    assert s.values.tolist() == [0.0, 7.0, 0.0, 0.0, 0.0, 4.0, 1.0, 2.0]
    assert s.nnz == 8 and s.density == 0.5
    assert torch.equal(s.to_dense(), t)


def test_from_dense_gradient_reaches_the_kept_entries():
    t = torch.tensor([[4.0, -1.0, 0.5, 3.0]], requires_grad=True)
    from_dense(t, "nm(2,4)").values.sum().backward()
    assert t.grad.tolist() == [[1.0, 0.0, 0.0, 1.0]]


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0,), (2, 0, 4)])
def test_empty_shapes(shape):
    s = from_dense(torch.zeros(shape), "nm(2,4)")
    assert s.to_dense().shape == shape
    assert s.nnz == 0


def test_all_zero_tensor_stores_n_padding_zeros_per_group():
    s = from_dense(torch.zeros(2, 8, dtype=torch.float64), "nm(2,4)")
    assert s.nnz == 8 and s.crd[-1].tolist() == [0, 1] * 4
    assert not s.values.any()


@pytest.mark.parametrize("shape", [(3, 6), (6,), (2, 2, 5)])
def test_last_dimension_not_divisible_by_m(shape):
    with pytest.raises(ValueError, match=r"last dimension of shape .* not divisible by the group size m=4"):
        from_dense(torch.randn(shape), "nm(2,4)")
    with pytest.raises(ValueError, match=r"last dimension of shape .* not divisible by the group size m=4"):
        from_coo(torch.zeros((len(shape), 0), dtype=torch.int64), torch.zeros(0), shape, "nm(2,4)")


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trips_through_dense_and_csr_and_coo(dtype, shape):
    t = reference_nm(torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(3)), 2, 4)
    s = from_dense(t, "nm(2,4)")
    assert torch.equal(s.to_dense(), t)
    assert torch.equal(from_dense(s.to_dense(), "nm(2,4)").values, s.values)
    other = "csr" if len(shape) == 2 else "coo"
    converted = s.asformat(other)
    assert converted.nnz == s.nnz  # explicit padding zeros stay stored
    assert torch.equal(converted.to_dense(), t)
    back = converted.asformat("nm(2,4)")
    assert torch.equal(back.crd[-1], s.crd[-1]) and torch.equal(back.values, s.values)
    assert torch.equal(from_dense(t, other).asformat("nm(2,4)").to_dense(), t)


def test_asformat_between_nm_shapes_and_to_itself():
    t = reference_nm(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)), 1, 4)
    s = from_dense(t, "nm(1,4)")
    assert s.asformat("nm(1,4)") is s
    wider = s.asformat("nm(2,4)")
    assert wider.nnz == 16 and torch.equal(wider.to_dense(), t)
    assert torch.equal(s.asformat("nm(2,8)").to_dense(), t)


def test_dense_format_source_converts_losslessly():
    t = reference_nm(torch.randn(3, 8, generator=torch.Generator().manual_seed(6)), 2, 4)
    s = from_dense(t, "dense").asformat("nm(2,4)")
    assert str(s.format) == "nm(2,4)" and torch.equal(s.to_dense(), t)


def test_from_coo_sums_duplicates_then_pads():
    indices = torch.tensor([[0, 0, 1], [5, 5, 2]])
    s = from_coo(indices, torch.tensor([1.0, 2.0, 4.0]), (2, 8), "nm(2,4)")
    expected = torch.zeros(2, 8)
    expected[0, 5], expected[1, 2] = 3.0, 4.0
    assert torch.equal(s.to_dense(), expected)
    assert s.crd[-1].tolist() == [0, 1, 0, 1, 0, 2, 0, 1]


def test_to_torch_and_scipy():
    t = reference_nm(torch.randn(3, 8, generator=torch.Generator().manual_seed(7)), 2, 4)
    s = from_dense(t, "nm(2,4)")
    coo = s.to_torch()
    assert coo.layout == torch.sparse_coo and coo._nnz() == s.nnz
    assert torch.equal(coo.to_dense(), t)
    assert torch.equal(s.to_torch(torch.sparse_csr).to_dense(), t)
    assert torch.equal(s.to_torch(torch.strided), t)
    assert torch.equal(torch.from_numpy(s.to_scipy().toarray()), t)
    assert torch.equal(from_torch(t.to_sparse_csr(), "nm(2,4)").to_dense(), t)


def test_permute_only_by_identity():
    s = from_dense(torch.randn(2, 8), "nm(2,4)")
    assert s.permute(0, 1) is s
    with pytest.raises(ValueError, match=r"nm\(2,4\) groups its last dimension and cannot be permuted"):
        s.T


# ------------------------------------------------------------------ over-full groups
def test_from_coo_rejects_a_group_with_more_than_n_entries():
    indices = torch.tensor([[0, 1, 1, 1], [0, 4, 5, 7]])
    with pytest.raises(ValueError, match=r"group 1 of row 1 \(last-dimension indices 4\.\.7 of shape \(2, 8\)\) "
                                         r"holds 3 entries, but nm\(2,4\) allows at most 2 per group of 4"):
        from_coo(indices, torch.ones(4), (2, 8), "nm(2,4)")


@pytest.mark.parametrize("source", ["csr", "coo", "dense"])
def test_asformat_rejects_a_group_with_more_than_n_entries(source):
    t = torch.zeros(2, 8)
    t[1, :3] = 1.0
    with pytest.raises(ValueError, match=r"group 0 of row 1 .* holds 3 entries, but nm\(2,4\) allows at most 2"):
        from_dense(t, source).asformat("nm(2,4)")


@pytest.mark.parametrize("shape, index, where", [
    ((8,), (5, 6), r"group 1 \(last"),
    ((2, 3, 8), (1, 2, 1, 2), r"group 0 at index \(1, 2\) \(last"),
])
def test_over_full_group_error_names_the_group_in_any_rank(shape, index, where):
    lead = torch.tensor(index[:-2]).repeat(2, 1).T if len(shape) > 1 else torch.zeros((0, 2), dtype=torch.int64)
    indices = torch.cat([lead, torch.tensor([index[-2:]])]).long()
    with pytest.raises(ValueError, match=where + r".* holds 2 entries, but nm\(1,4\) allows at most 1"):
        from_coo(indices, torch.ones(2), shape, "nm(1,4)")


# ------------------------------------------------------------------ validation
def test_validating_constructor_accepts_valid_arrays():
    s = from_dense(torch.randn(3, 8, dtype=torch.float64), "nm(2,4)")
    assert torch.equal(rebuild(s).to_dense(), s.to_dense())
    assert torch.equal(rebuild(s, s.crd[-1].long()).to_dense(), s.to_dense())


@pytest.mark.parametrize("edit, reason", [
    (lambda c: c[:-1], r"crd\[3\] \(level 3, grouped\) has length 11, expected 12 "
                       r"\(2 per parent position, 6 parent positions\)"),
    (lambda c: torch.cat([c, c[:2]]), r"has length 14, expected 12"),
    (lambda c: c.index_fill(0, torch.tensor([3]), 4), r"coordinate 4 out of range \[0, 4\) at position 3"),
    (lambda c: c.index_fill(0, torch.tensor([3]), -1), r"coordinate -1 out of range \[0, 4\) at position 3"),
    (lambda c: c.flip(0), r"not strictly increasing within group 0: offset \d at position 0 is followed by \d"),
    (lambda c: c.index_fill(0, torch.tensor([2, 3]), 1),
     r"not strictly increasing within group 1: offset 1 at position 2 is followed by 1"),
])
def test_validating_constructor_rejects_bad_crd(edit, reason):
    s = from_dense(torch.randn(3, 8), "nm(2,4)")
    crd = edit(s.crd[-1].clone()).to(s.crd[-1].dtype)
    values = torch.zeros(len(crd))
    with pytest.raises(ValueError, match=reason):
        rebuild(s, crd, values)


def test_validating_constructor_rejects_wrong_values_length():
    s = from_dense(torch.randn(3, 8), "nm(2,4)")
    with pytest.raises(ValueError, match=r"values has length 11, expected 12"):
        rebuild(s, values=s.values[:-1])


def test_validating_constructor_rejects_arrays_of_dense_levels():
    s = from_dense(torch.randn(3, 8), "nm(2,4)")
    with pytest.raises(ValueError, match=r"crd\[0\] \(level 0, dense\) must be None"):
        SparseTensor(s.shape, s.format, s.pos, (s.crd[-1],) + s.crd[1:], s.values)


# ------------------------------------------------------------------ persistence, counts
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_pickle_torch_save_and_deepcopy(dtype, shape):
    s = from_dense(torch.randn(shape, dtype=dtype), "nm(2,4)")
    buffer = io.BytesIO()
    torch.save(s, buffer)
    buffer.seek(0)
    for copied in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), torch.load(buffer, weights_only=False)):
        assert copied.format == s.format and copied.shape == s.shape and copied.dtype == dtype
        assert torch.equal(copied.crd[-1], s.crd[-1]) and torch.equal(copied.values, s.values)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtype_and_counts(index_dtype):
    s = from_dense(torch.randn(4, 16), "nm(1,4)", index_dtype=index_dtype)
    assert s.index_dtype == index_dtype and s.crd[-1].dtype == index_dtype
    assert s.nnz == 16 and s.density == 0.25
    assert [s.num_positions(level) for level in range(4)] == [4, 16, 16, 16]
