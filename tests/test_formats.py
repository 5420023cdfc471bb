"""Tests of sparsenn.formats: levels, formats, SparseTensor layout, conversion and validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsenn.formats import (
    Compressed,
    Dense,
    Format,
    Singleton,
    SparseTensor,
    from_coo,
    from_dense,
    from_edge_index,
    from_scipy,
    from_torch,
    parse_format,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse (BSR|CSR|BSC|CSC) tensor support is in beta")

DTYPES = [torch.float32, torch.float64]
INDEX_DTYPES = [torch.int32, torch.int64]

FORMATS_BY_RANK = {
    1: ["dense", "coo", "csf", "d", "c"],
    2: ["dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "cd", "cs[1,0]", "dd[1,0]", "bsr", "bsc"],
    3: ["dense", "coo", "csf", "dcs", "csd", "dcc", "ccd[2,0,1]", "css[1,2,0]", "ddc[2,1,0]"],
    4: ["dense", "coo", "csf", "dcss", "cdcs", "cccc[3,1,0,2]"],
}

SHAPES_BY_RANK = {
    1: [(7,), (0,), (1,)],
    2: [(4, 6), (0, 6), (4, 0), (1, 1)],
    3: [(3, 4, 2), (0, 2, 3), (1, 1, 1)],
    4: [(2, 3, 2, 2), (2, 0, 1, 3), (1, 1, 1, 1)],
}


def named(spec: str, shape: tuple[int, ...]) -> str:
    """Resolve 'bsr'/'bsc' to a block shape that divides ``shape``."""
    if spec in ("bsr", "bsc"):
        bh = 2 if shape[0] % 2 == 0 else 1
        bw = 3 if shape[1] % 3 == 0 else 1
        return f"{spec}({bh},{bw})"
    return spec


def patterns(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Random, all-zero, single-element and fully dense tensors of ``shape``."""
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    numel = int(np.prod(shape))
    dense = torch.randn(shape, generator=gen, dtype=dtype)
    random = dense * (torch.rand(shape, generator=gen) < 0.4)
    single = torch.zeros(shape, dtype=dtype)
    if numel:
        single.view(-1)[numel // 2] = 2.5
    full = dense.abs() + 1
    return [random, torch.zeros(shape, dtype=dtype), single, full]


def assert_valid(t: SparseTensor) -> None:
    """Rebuild ``t`` with full validation: its arrays satisfy the layout contract."""
    SparseTensor(t.shape, t.format, t.pos, t.crd, t.values, check=True, index_dtype=t.index_dtype)
    arrays = [a for a in t.pos + t.crd if a is not None]
    assert all(a.dtype == t.index_dtype and a.is_contiguous() and a.dim() == 1 for a in arrays)
    assert t.values.dim() == 1 and t.values.is_contiguous()


# ------------------------------------------------------------------------ levels and formats
def test_level_capabilities() -> None:
    d, c, s = Dense(), Compressed(), Singleton()
    assert (d.letter, c.letter, s.letter) == ("d", "c", "s")
    assert (d.locatable, c.locatable, s.locatable) == (True, False, False)
    assert (d.has_pos, c.has_pos, s.has_pos) == (False, True, False)
    assert (d.has_crd, c.has_crd, s.has_crd) == (False, True, True)
    assert (d.full, c.full, s.full) == (True, False, False)
    assert d.ordered and c.ordered and s.ordered
    assert Compressed() == Compressed(unique=True) != Compressed(unique=False)
    assert Dense() != Compressed()
    assert len({Dense(), Dense(), Compressed(), Compressed(unique=False)}) == 3
    with pytest.raises(AttributeError):
        d.unique = False  # type: ignore[misc]


@pytest.mark.parametrize("spec, rank, letters, mode_order, block, name", [
    ("dense", 0, "", (), None, "dense"),
    ("dense", 3, "ddd", (0, 1, 2), None, "dense"),
    ("csr", 2, "dc", (0, 1), None, "csr"),
    ("csc", 2, "dc", (1, 0), None, "csc"),
    ("coo", 1, "c", (0,), None, "coo"),
    ("coo", 2, "cs", (0, 1), None, "coo"),
    ("coo", 4, "csss", (0, 1, 2, 3), None, "coo"),
    ("dcsr", 2, "cc", (0, 1), None, "dcsr"),
    ("dcsc", 2, "cc", (1, 0), None, "dcsc"),
    ("csf", 3, "ccc", (0, 1, 2), None, "csf"),
    ("bsr(2,3)", 2, "dcdd", (0, 1), (2, 3), "bsr(2,3)"),
    (" BSC( 4 , 1 ) ", 2, "dcdd", (1, 0), (4, 1), "bsc(4,1)"),
    ("DC", 2, "dc", (0, 1), None, "csr"),
    ("dcc", 3, "dcc", (0, 1, 2), None, "dcc"),
    ("dc[1,0]", 2, "dc", (1, 0), None, "csc"),
    ("cs[1,0]", 2, "cs", (1, 0), None, "cs[1,0]"),
    ("ccd[2,0,1]", 3, "ccd", (2, 0, 1), None, "ccd[2,0,1]"),
    ("cc(2,2)", 2, "ccdd", (0, 1), (2, 2), "cc(2,2)"),
])
def test_parse_format(spec: str, rank: int, letters: str, mode_order: tuple[int, ...],
                      block: tuple[int, ...] | None, name: str) -> None:
    fmt = parse_format(spec, rank)
    assert (fmt.letters, fmt.mode_order, fmt.block, fmt.rank, str(fmt)) == (letters, mode_order, block, rank, name)
    assert parse_format(str(fmt), rank) == fmt
    assert parse_format(fmt, rank) is fmt
    assert hash(fmt) == hash(parse_format(spec, rank))


def test_unique_is_derived() -> None:
    fmt = parse_format("css", 3)
    assert [level.unique for level in fmt.levels] == [False, False, True]
    assert [level.unique for level in parse_format("dcs", 3).levels] == [True, False, True]
    direct = Format((Compressed(), Singleton()), (0, 1))
    assert direct == parse_format("coo", 2)
    assert parse_format("dense", 2).is_dense and not parse_format("bsr(1,1)", 2).is_dense
    assert parse_format("dd[1,0]", 2).is_dense


@pytest.mark.parametrize("spec, rank", [
    ("csx", 2), ("bsr(0,2)", 2), ("sc", 2), ("ds", 2), ("csr", 3), ("dcc", 2), ("bsr(2)", 2),
    ("bsr(2,2)", 3), ("dc[0,0]", 2), ("dc[1,0,2]", 2), ("coo", 0), ("csf", 0), ("", 1), ("c(0)", 1),
    ("bsr(-1,2)", 2), ("d s", 2),
])
def test_parse_format_rejects(spec: str, rank: int) -> None:
    with pytest.raises(ValueError, match="invalid format") as info:
        parse_format(spec, rank)
    assert repr(spec) in str(info.value) and "accepted" in str(info.value)


def test_parse_format_wrong_rank_format_object_and_type() -> None:
    with pytest.raises(ValueError, match="format csr has rank 2, expected rank 3"):
        parse_format(parse_format("csr", 2), 3)
    with pytest.raises(TypeError):
        parse_format(3, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="singleton"):
        Format((Dense(), Singleton()), (0, 1))


def test_storage_levels() -> None:
    assert parse_format("bsr(2,3)", 2).storage_levels((4, 9)) == ((0, 2, False), (1, 3, False),
                                                                    (0, 2, True), (1, 3, True))
    assert parse_format("bsc(2,3)", 2).storage_levels((4, 9)) == ((1, 3, False), (0, 2, False),
                                                                    (0, 2, True), (1, 3, True))
    assert parse_format("csc", 2).storage_levels((4, 9)) == ((1, 9, False), (0, 4, False))
    with pytest.raises(ValueError, match="not divisible"):
        parse_format("bsr(2,3)", 2).storage_levels((4, 8))
    with pytest.raises(ValueError, match="not divisible"):
        from_dense(torch.ones(3, 3), "bsr(2,1)")


# ------------------------------------------------------------------------ round trips
RANK_FORMATS = [(rank, spec) for rank, specs in FORMATS_BY_RANK.items() for spec in specs]


@pytest.mark.parametrize("rank, spec", RANK_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_dense_round_trip(rank: int, spec: str, dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    for shape in SHAPES_BY_RANK[rank]:
        fmt = named(spec, shape)
        for dense in patterns(shape, dtype):
            t = from_dense(dense, fmt, index_dtype=index_dtype)
            assert_valid(t)
            assert t.shape == shape and t.dtype == dtype and t.index_dtype == index_dtype
            assert str(t.format) == str(parse_format(fmt, rank))
            assert torch.equal(t.to_dense(), dense)
            indices, values = t.coords()
            assert indices.shape == (rank, t.nnz) and values is t.values
            rebuilt = from_coo(indices, values, shape, fmt, duplicates="error", index_dtype=index_dtype)
            assert torch.equal(rebuilt.to_dense(), dense)
            if t.format.levels and not t.format.levels[-1].locatable:
                assert t.nnz == int((dense != 0).sum())


def test_rank0_dense() -> None:
    t = from_dense(torch.tensor(2.5, dtype=torch.float64), "dense")
    assert t.shape == () and t.nnz == 1 and t.format.rank == 0
    assert torch.equal(t.to_dense(), torch.tensor(2.5, dtype=torch.float64))
    assert t.to_torch().shape == () and torch.equal(t.to_torch(torch.sparse_coo).to_dense(), t.to_dense())


def test_default_index_dtype_and_forcing() -> None:
    dense = torch.eye(3)
    assert from_dense(dense).index_dtype == torch.int32
    assert from_dense(dense, index_dtype=torch.int64).asformat("coo").index_dtype == torch.int64
    assert from_dense(dense, "dense").index_dtype == torch.int32
    with pytest.raises(TypeError, match="index_dtype"):
        from_dense(dense, index_dtype=torch.int16)


@pytest.mark.parametrize("source, target", list(itertools.product(FORMATS_BY_RANK[2], repeat=2)))
def test_asformat_all_pairs_rank2(source: str, target: str) -> None:
    dense = patterns((4, 6), torch.float64)[0]
    dense[1] = 0
    dense[:, 4] = 0
    t = from_dense(dense, named(source, (4, 6))).asformat(named(target, (4, 6)))
    assert_valid(t)
    assert t.format == parse_format(named(target, (4, 6)), 2)
    assert torch.equal(t.to_dense(), dense)


@pytest.mark.parametrize("source, target", list(itertools.product(FORMATS_BY_RANK[3], repeat=2)))
def test_asformat_all_pairs_rank3(source: str, target: str) -> None:
    dense = patterns((3, 4, 2), torch.float32)[0]
    t = from_dense(dense, source).asformat(target, index_dtype=torch.int64)
    assert_valid(t)
    assert t.index_dtype == torch.int64
    assert torch.equal(t.to_dense(), dense)


def test_asformat_keeps_stored_zeros_and_same_format() -> None:
    dense = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    bsr = from_dense(dense, "bsr(2,2)")
    assert bsr.nnz == 4 and bsr.asformat("csr").nnz == 4
    assert bsr.asformat("bsr(2,2)") is bsr
    assert from_dense(dense, "dense").asformat("csr").nnz == 1


# ------------------------------------------------------------------------ torch interop
def sample_matrix(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    dense = torch.zeros(4, 6, dtype=dtype)
    dense[0, 1], dense[0, 5], dense[2, 0], dense[3, 3], dense[3, 4] = 1, 2, 3, 4, 5
    return dense


@pytest.mark.parametrize("make, name", [
    (lambda d: d.to_sparse(), "coo"),
    (lambda d: d.to_sparse_csr(), "csr"),
    (lambda d: d.to_sparse_csc(), "csc"),
    (lambda d: d.to_sparse_bsr((2, 3)), "bsr(2,3)"),
    (lambda d: d.to_sparse_bsc((2, 3)), "bsc(2,3)"),
    (lambda d: d, "dense"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_natural_and_back(make, name: str, dtype: torch.dtype) -> None:
    dense = sample_matrix(dtype)
    source = make(dense)
    t = from_torch(source)
    assert_valid(t)
    assert str(t.format) == name and torch.equal(t.to_dense(), dense)
    back = t.to_torch()
    assert back.layout == source.layout and torch.equal(back.to_dense(), dense)
    assert torch.equal(from_torch(source, format="dcsc").to_dense(), dense)


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                                    torch.sparse_bsr, torch.sparse_bsc])
@pytest.mark.parametrize("spec", ["csr", "coo", "dcsc", "dense", "bsc(2,3)", "cs[1,0]"])
def test_to_torch_layouts(layout: torch.layout, spec: str) -> None:
    dense = sample_matrix()
    out = from_dense(dense, spec).to_torch(layout, blocksize=(2, 1))
    assert out.layout == layout and torch.equal(out.to_dense(), dense)


def test_to_torch_defaults_and_errors() -> None:
    dense = sample_matrix()
    assert from_dense(dense, "dcsr").to_torch().layout == torch.sparse_coo
    assert from_dense(dense, "dense").to_torch().layout == torch.strided
    csr = from_dense(dense, "csr")
    out = csr.to_torch()
    assert out.crow_indices().data_ptr() == csr.pos[1].data_ptr()
    assert out.values().data_ptr() == csr.values.data_ptr()
    coo3 = from_dense(torch.ones(2, 2, 2), "csf").to_torch()
    assert coo3.layout == torch.sparse_coo and coo3.is_coalesced()
    with pytest.raises(ValueError, match="blocksize"):
        csr.to_torch(torch.sparse_bsr)
    with pytest.raises(ValueError, match="rank-2"):
        from_dense(torch.ones(2, 2, 2), "csf").to_torch(torch.sparse_csr)


def test_from_torch_uncoalesced_coo_is_not_mutated() -> None:
    indices = torch.tensor([[2, 0, 2], [1, 3, 1]])
    source = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (3, 4), check_invariants=True)
    t = from_torch(source)
    assert not source.is_coalesced()
    assert torch.equal(source._indices(), indices)
    assert t.nnz == 2 and t.to_dense()[2, 1] == 4.0


def test_from_torch_noncanonical_csr_is_sorted_and_summed() -> None:
    source = torch.sparse_csr_tensor(torch.tensor([0, 3, 3]), torch.tensor([2, 0, 2]),
                                     torch.tensor([1.0, 2.0, 3.0]), (2, 3), check_invariants=False)
    t = from_torch(source)
    assert_valid(t)
    assert t.crd[1].tolist() == [0, 2] and t.values.tolist() == [2.0, 4.0]
    assert source.col_indices().tolist() == [2, 0, 2]


def test_from_torch_shares_csr_values_and_rejects_hybrid() -> None:
    source = sample_matrix().to_sparse_csr()
    assert from_torch(source).values.data_ptr() == source.values().data_ptr()
    hybrid = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 2), (2, 2), check_invariants=True)
    with pytest.raises(ValueError, match="hybrid"):
        from_torch(hybrid)


# ------------------------------------------------------------------------ scipy interop
@pytest.mark.parametrize("kind, name, scipy_format", [
    ("csr", "csr", "csr"), ("csc", "csc", "csc"), ("coo", "coo", "coo"), ("bsr", "bsr(2,3)", "bsr"),
    ("dia", "csr", "csr"), ("lil", "csr", "csr"), ("dok", "csr", "csr"),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scipy_round_trip(kind: str, name: str, scipy_format: str, dtype: type) -> None:
    dense = sample_matrix().numpy().astype(dtype)
    m = sp.csr_array(dense).asformat(kind, copy=True) if kind != "bsr" else sp.bsr_array(dense, blocksize=(2, 3))
    t = from_scipy(m)
    assert_valid(t)
    assert str(t.format) == name and t.dtype == torch.from_numpy(dense).dtype
    assert np.array_equal(t.to_dense().numpy(), dense)
    out = t.to_scipy()
    assert out.format == scipy_format and np.array_equal(out.toarray(), dense)
    assert np.array_equal(from_scipy(sp.csr_matrix(dense), format="csc").to_dense().numpy(), dense)


def test_from_scipy_sums_duplicates_without_mutation() -> None:
    m = sp.csr_array((np.array([1.0, 2.0, 3.0]), np.array([2, 0, 2]), np.array([0, 3, 3])), shape=(2, 3))
    t = from_scipy(m)
    assert t.crd[1].tolist() == [0, 2] and t.values.tolist() == [2.0, 4.0]
    assert m.indices.tolist() == [2, 0, 2] and m.nnz == 3
    coo = sp.coo_array((np.array([1.0, 1.0]), (np.array([1, 1]), np.array([0, 0]))), shape=(2, 2))
    assert from_scipy(coo).to_dense().tolist() == [[0.0, 0.0], [2.0, 0.0]]
    with pytest.raises(TypeError, match="values has dtype torch.int64"):
        from_scipy(sp.csr_array(np.eye(2, dtype=np.int64)))
    with pytest.raises(TypeError):
        from_scipy(np.eye(2))


def test_to_scipy_other_formats_and_rank() -> None:
    dense = sample_matrix()
    for spec in ["dcsr", "bsc(2,3)", "dense"]:
        out = from_dense(dense, spec).to_scipy()
        assert out.format == "csr" and np.array_equal(out.toarray(), dense.numpy())
    with pytest.raises(ValueError, match="rank-2"):
        from_dense(torch.ones(2), "coo").to_scipy()


# ------------------------------------------------------------------------ PyG and COO input
def test_from_edge_index_orientation_matches_pyg() -> None:
    from torch_geometric.utils import to_dense_adj

    edge_index = torch.tensor([[0, 1, 1, 3, 0], [1, 2, 2, 0, 1]])
    t = from_edge_index(edge_index)
    expected = to_dense_adj(edge_index)[0]
    assert t.shape == (4, 4) and str(t.format) == "csr" and t.dtype == torch.float32
    assert torch.equal(t.to_dense(), expected)
    assert t.to_dense()[0, 1] == 2.0 and t.to_dense()[1, 0] == 0.0
    weighted = from_edge_index(edge_index, num_nodes=5, values=torch.arange(5.0), format="coo")
    assert weighted.shape == (5, 5) and weighted.to_dense()[0, 1] == 0.0 + 4.0
    empty = from_edge_index(torch.empty(2, 0, dtype=torch.long))
    assert empty.shape == (0, 0) and empty.nnz == 0
    with pytest.raises(ValueError, match=r"edge_index\[1\] has value 3 out of range \[0, 3\)"):
        from_edge_index(torch.tensor([[0], [3]]), num_nodes=3)


def test_from_coo_duplicates() -> None:
    indices = torch.tensor([[1, 0, 1], [2, 0, 2]], dtype=torch.int32)
    values = torch.tensor([1.0, 2.0, 3.0])
    t = from_coo(indices, values, (2, 3))
    assert str(t.format) == "coo" and t.nnz == 2 and t.to_dense()[1, 2] == 4.0
    assert indices.tolist() == [[1, 0, 1], [2, 0, 2]]
    with pytest.raises(ValueError, match=r"duplicate coordinate \(1, 2\)"):
        from_coo(indices, values, (2, 3), duplicates="error")
    with pytest.raises(ValueError, match="duplicates"):
        from_coo(indices, values, (2, 3), duplicates="last")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ views
def shares_storage(a: SparseTensor, b: SparseTensor, values: bool = True) -> bool:
    pairs = list(zip(a.pos + a.crd, b.pos + b.crd))
    same = all((x is None and y is None) or x.data_ptr() == y.data_ptr() for x, y in pairs)
    return same and (not values or a.values.data_ptr() == b.values.data_ptr())


@pytest.mark.parametrize("spec", ["csr", "csc", "coo", "dcsr", "dense", "cd"])
def test_transpose_shares_storage(spec: str) -> None:
    dense = sample_matrix()
    t = from_dense(dense, spec)
    for view, expected in [(t.T, dense.T), (t.transpose(), dense.T), (t.transpose(1, 0), dense.T),
                           (t.permute(1, 0), dense.T), (t.permute(0, 1), dense)]:
        assert shares_storage(t, view) and torch.equal(view.to_dense(), expected)
    assert str(from_dense(dense, "csr").T.format) == "csc"


def test_permute_rank3_and_blocked() -> None:
    dense = patterns((2, 3, 4), torch.float64)[0]
    t = from_dense(dense, "csf")
    view = t.permute(2, 0, 1)
    assert shares_storage(t, view) and torch.equal(view.to_dense(), dense.permute(2, 0, 1))
    assert torch.equal(t.T.to_dense(), dense.permute(2, 1, 0))
    assert torch.equal(view.asformat("coo").to_dense(), dense.permute(2, 0, 1))
    bsr = from_dense(sample_matrix(), "bsr(2,3)")
    bsc = bsr.T
    assert str(bsc.format) == "bsc(3,2)" and shares_storage(bsr, bsc, values=False)
    assert torch.equal(bsc.to_dense(), sample_matrix().T)
    with pytest.raises(ValueError, match="permutation"):
        t.permute(0, 0, 1)


# ------------------------------------------------------------------------ validation
# (the catalogue of rejected arrays is tests/test_bad_input.py)
def csr_parts() -> tuple[tuple[int, int], list, list, torch.Tensor]:
    """A valid 3x5 CSR: rows [0: cols 1,3], [1: empty], [2: col 4]."""
    pos = [None, torch.tensor([0, 2, 2, 3], dtype=torch.int32)]
    crd = [None, torch.tensor([1, 3, 4], dtype=torch.int32)]
    return (3, 5), pos, crd, torch.tensor([1.0, 2.0, 3.0])


def i32(*items: int) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.int32)


def test_check_false_skips_validation() -> None:
    shape, pos, crd, values = csr_parts()
    crd[1] = i32(9, 9, 9)
    t = SparseTensor(shape, "csr", pos, crd, values, check=False)
    assert t.nnz == 3


def test_check_unmodified() -> None:
    t = from_dense(sample_matrix(), "csr")
    view = t.T
    t.check_unmodified()
    t.values.mul_(2)
    t.check_unmodified()
    t.crd[1][0] = 4
    with pytest.raises(ValueError, match="modified in place"):
        t.check_unmodified()
    with pytest.raises(ValueError, match="modified in place"):
        view.check_unmodified()


# ------------------------------------------------------------------------ values and metadata
def test_with_values_to_and_autograd() -> None:
    dense = sample_matrix().requires_grad_(True)
    t = from_dense(dense, "csr")
    t.to_dense().sum().backward()
    assert torch.equal(dense.grad, (sample_matrix() != 0).float())
    weights = torch.ones(t.nnz, requires_grad=True)
    w = t.with_values(weights)
    assert w.values is weights and shares_storage(t, w, values=False)
    (w.to_dense() * 3).sum().backward()
    assert torch.equal(weights.grad, torch.full((t.nnz,), 3.0))
    assert w.to(torch.float64).dtype == torch.float64 and w.to(torch.float32) is w
    with pytest.raises(ValueError, match="length"):
        t.with_values(torch.ones(t.nnz + 1))
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16, got torch.int32"):
        t.to(torch.int32)


def test_metadata() -> None:
    dense = sample_matrix()
    dense[2, 0] = 0
    t = from_dense(dense, "bsr(2,3)")
    assert t.ndim == 2 and t.numel() == 24 and t.nnz == 18 and t.density == 0.75
    assert t.level_sizes == (2, 2, 2, 3) and [t.num_positions(level) for level in range(4)] == [2, 3, 6, 18]
    assert t.num_positions(-1) == 18 and t.device.type == "cpu"
    assert repr(t) == ("SparseTensor(shape=(4, 6), format=bsr(2,3), nnz=18, dtype=torch.float32, "
                       "index_dtype=torch.int32)")
    assert from_dense(torch.zeros(0, 3), "csr").density == 0.0


def test_large_dimension_uses_int64() -> None:
    n = 2**31 + 5
    indices = torch.tensor([[2, 0, 2, 1], [5, n - 1, 0, 7]])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for spec in ["csr", "coo"]:
        t = from_coo(indices, values, (3, n), spec)
        assert t.index_dtype == torch.int64
        assert_valid(t)
        for target in ["coo", "csr", "dcsr", "dcsc", "cs[1,0]"]:
            coords, vals = t.asformat(target).coords()
            entries = sorted(zip(coords.T.tolist(), vals.tolist()))
            assert entries == [([0, n - 1], 2.0), ([1, 7], 4.0), ([2, 0], 3.0), ([2, 5], 1.0)]
        coo = t.to_torch(torch.sparse_coo)
        assert coo.shape == (3, n) and coo._nnz() == 4
    with pytest.raises(ValueError, match="int32"):
        from_coo(indices, values, (3, n), "coo", index_dtype=torch.int32)


# ------------------------------------------------------------------------ property-based
@st.composite
def formats(draw: st.DrawFn, shape: tuple[int, ...]) -> str:
    """A random valid format name for ``shape``: level letters, mode order, sometimes a block."""
    rank = len(shape)
    letters = draw(st.sampled_from("dc"))
    for _ in range(rank - 1):
        letters += draw(st.sampled_from("dcs" if letters[-1] != "d" else "dc"))
    order = draw(st.permutations(range(rank)))
    spec = f"{letters}[{','.join(map(str, order))}]"
    if draw(st.booleans()):
        divisors = [draw(st.sampled_from([b for b in range(1, 4) if n % b == 0])) for n in shape]
        spec += f"({','.join(map(str, divisors))})"
    return spec


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    density = draw(st.sampled_from([0.0, 0.2, 0.6, 1.0]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from(DTYPES))
    values = torch.randn(shape, generator=gen, dtype=dtype)
    return torch.where(torch.rand(shape, generator=gen) < density, values, torch.zeros((), dtype=dtype))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_round_trips(data: st.DataObject) -> None:
    dense = data.draw(tensors())
    shape = tuple(dense.shape)
    first, second = data.draw(formats(shape)), data.draw(formats(shape))
    index_dtype = data.draw(st.sampled_from(INDEX_DTYPES))
    t = from_dense(dense, first, index_dtype=index_dtype)
    assert_valid(t)
    assert torch.equal(t.to_dense(), dense)
    converted = t.asformat(second)
    assert_valid(converted)
    assert converted.index_dtype == index_dtype and torch.equal(converted.to_dense(), dense)
    order = data.draw(st.permutations(range(len(shape))))
    assert torch.equal(converted.permute(order).to_dense(), dense.permute(order))
    coo = t.to_torch(torch.sparse_coo)
    assert coo.is_coalesced() and torch.equal(coo.to_dense(), dense)


def test_sparse_tensors_build_and_compute_under_inference_mode():
    from sparsenn import einsum

    with torch.inference_mode():
        a = SparseTensor.from_dense(torch.eye(3), format="csr")
        y = einsum("ij,jk->ik", a.asformat("csc"), torch.ones(3, 2), out_format="dense")
    torch.testing.assert_close(y, torch.ones(3, 2))


def test_pickled_formats_hash_like_fresh_ones_across_processes():
    # Formats cache their hash; a pickle made in another process (other str-hash salt)
    # must not carry that hash along, or it would miss every dict lookup here.
    import os
    import pickle
    import subprocess
    import sys

    code = "import pickle, sys, sparsenn; f = sparsenn.parse_format('csr', 2); hash(f); sys.stdout.buffer.write(pickle.dumps(f))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # this process: random or another seed
    data = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env).stdout
    assert {parse_format("csr", 2): "found"}[pickle.loads(data)] == "found"
