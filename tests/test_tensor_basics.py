"""SparseTensor basics a PyTorch user reaches for: size/dim, clone/detach, to(), sum (compiled),
first-dimension indexing, cat/stack (in a DataLoader), and weights_only loading."""

import io

import pytest
import torch
from torch.utils.data import DataLoader

import sparsenn
from sparsenn import SparseTensor
from sparsenn.formats import VALUE_DTYPES


def sparse_dense(shape, density=0.4, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=dtype)
    return values * (torch.rand(shape, generator=generator) < density)


FORMATS_2D = ["csr", "csc", "coo", "dcsr", "dcsc", "dense", "bsr(2,2)", "bsc(2,2)", "nm(2,4)", "cd"]


def make(format, shape=(6, 8), seed=0):
    dense = sparse_dense(shape, seed=seed)
    return dense, sparsenn.from_dense(dense, format)


def test_size_and_dim():
    _, S = make("csr")
    assert S.size() == torch.Size([6, 8]) and isinstance(S.size(), torch.Size)
    assert S.size(0) == 6 and S.size(-1) == 8 and S.dim() == 2
    with pytest.raises(IndexError, match="Dimension out of range"):
        S.size(2)
    with pytest.raises(TypeError, match="dim must be an int"):
        S.size(1.0)


def test_clone_owns_its_arrays_and_detach_shares_them():
    _, S = make("csr")
    values = S.values.clone().requires_grad_()
    S = S.with_values(values)
    copy = S.clone()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copy._index_arrays, S._index_arrays))
    assert copy.values.requires_grad and torch.equal(copy.to_dense(), S.to_dense())
    copy.values.sum().backward()
    assert torch.equal(values.grad, torch.ones_like(values))
    copy.crd[1][0] = 7  # the original is untouched
    S.check_unmodified()
    detached = S.detach()
    assert not detached.values.requires_grad and detached.crd[1] is S.crd[1]
    assert detached.values.data_ptr() == S.values.data_ptr()


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_to_follows_torch_signatures_and_the_value_dtypes(dtype):
    _, S = make("csr")
    converted = S.to(dtype)
    assert converted.dtype == dtype and converted.crd[1] is S.crd[1]
    assert S.to(device="cpu", dtype=dtype).dtype == dtype
    assert S.to("cpu", dtype).dtype == dtype
    assert S.to(torch.zeros(1, dtype=dtype)).dtype == dtype
    assert S.to(S.to(dtype)).dtype == dtype
    assert S.to(dtype, non_blocking=True).dtype == dtype
    assert S.to("cpu") is S and S.to(S.dtype) is S
    copied = S.to(S.dtype, copy=True)
    assert copied is not S and copied.crd[1] is not S.crd[1] and torch.equal(copied.to_dense(), S.to_dense())


def test_to_is_differentiable_and_rejects_what_it_cannot_do():
    _, S = make("coo")
    values = S.values.clone().requires_grad_()
    S.with_values(values).to(torch.float32).values.sum().backward()
    assert values.grad.dtype == torch.float64 and torch.equal(values.grad, torch.ones_like(values))
    for device in ("cuda", "cuda:1", "meta", torch.device("mps")):
        with pytest.raises(ValueError, match="live on the CPU only; cannot move to"):
            S.to(device)
    with pytest.raises(TypeError, match="SparseTensor values must be float32, float64, bfloat16 or float16, got torch.int32"):
        S.to(torch.int32)
    with pytest.raises(TypeError, match="takes torch.Tensor.to's arguments"):
        S.to("nonsense")
    with pytest.raises(TypeError, match="memory_format"):
        S.to(memory_format=torch.contiguous_format)


@pytest.mark.parametrize("format", FORMATS_2D)
def test_sum_matches_dense_and_is_differentiable(format):
    dense, S = make(format, seed=1)
    stored = S.to_dense()  # nm keeps the 2 largest of every 4
    for dim, keepdim in ((None, False), (0, False), (1, False), (-1, True), ((0, 1), False), ((1, 0), True)):
        torch.testing.assert_close(S.sum(dim, keepdim=keepdim),
                                   stored.sum() if dim is None else stored.sum(dim, keepdim=keepdim))
    values = S.values.clone().requires_grad_()
    grad = torch.randn(6, dtype=torch.float64)
    S.with_values(values).sum(1).backward(grad)
    indices = S.coords()[0]
    torch.testing.assert_close(values.grad, grad[indices[0]])


def test_sum_of_a_rank_3_tensor_and_bad_dims():
    dense = sparse_dense((3, 4, 5), seed=2)
    S = sparsenn.from_dense(dense, "csf")
    torch.testing.assert_close(S.sum((0, 2)), dense.sum((0, 2)))
    torch.testing.assert_close(S.sum(1, keepdim=True), dense.sum(1, keepdim=True))
    torch.testing.assert_close(S.sum(torch.tensor(2)), dense.sum(2))  # any integer-like dim
    with pytest.raises(ValueError, match="repeats a dimension"):
        S.sum((1, -2))
    with pytest.raises(IndexError, match="Dimension out of range"):
        S.sum(3)


ROW_FORMATS = {"csr": "coo", "csc": "coo", "coo": "coo", "dcsr": "coo", "dcsc": "coo", "dense": "dense",
               "nm(2,4)": "nm(2,4)", "cd": "coo", "bsr(1,4)": "c(4)"}


@pytest.mark.parametrize("format", ROW_FORMATS)
def test_rows_are_exact_and_keep_the_format_family(format):
    dense, S = make(format, seed=3)
    stored = S.to_dense()
    for i in (0, 3, -1):
        row = S[i]
        assert isinstance(row, SparseTensor) and str(row.format) == ROW_FORMATS[format]
        assert torch.equal(row.to_dense(), stored[i])
        if format not in ("dense", "cd", "nm(2,4)", "bsr(1,4)"):  # no explicit zeros: exactly the entries
            assert row.nnz == int((stored[i] != 0).sum())
    assert str(sparsenn.from_dense(sparse_dense((3, 4, 5)), "csf")[1].format) == "dcsr"


@pytest.mark.parametrize("format", FORMATS_2D + ["bsr(1,4)"])
def test_slices_are_exact_and_keep_the_format(format):
    dense, S = make(format, seed=4)
    stored = S.to_dense()
    block_rows = format.startswith(("bsr(2", "bsc(2"))
    keys = [slice(2, 6), slice(None, 4), slice(0, 0), slice(-4, None)]
    if not block_rows:
        keys += [slice(1, 5), slice(None, None, 2), slice(None, None, -1), slice(5, 0, -2)]
    rows = S.coords()[0][0]
    for key in keys:
        chosen = list(range(6)[key])
        part = S[key]
        assert part.format == S.format and part.shape == (len(chosen), 8)
        assert torch.equal(part.to_dense(), stored[chosen]), key
        assert part.nnz == sum(int((rows == r).sum()) for r in chosen)  # every stored entry, zeros included


def test_slices_carry_gradients_and_keep_int64_indices():
    _, S = make("csr", seed=5)
    S = S.asformat("csr", index_dtype=torch.int64)
    values = S.values.clone().requires_grad_()
    part = S.with_values(values)[1:4]
    assert part.index_dtype == torch.int64
    part.values.sum().backward()
    rows = S.coords()[0][0]
    torch.testing.assert_close(values.grad, ((rows >= 1) & (rows < 4)).double())


def test_bad_indices():
    _, S = make("csr")
    with pytest.raises(TypeError, match="an int or a slice along the first dimension, got float"):
        S[1.0]
    with pytest.raises(TypeError, match="got tuple"):
        S[1, 2]
    with pytest.raises(IndexError, match="index 6 is out of range for dimension 0 of size 6"):
        S[6]
    with pytest.raises(ValueError, match="would be a scalar"):
        S[0][1]
    _, B = make("bsr(2,2)")
    with pytest.raises(ValueError, match=r"S\[i\] would cut the blocks of bsr\(2,2\)"):
        B[1]
    with pytest.raises(ValueError, match="slice 1:5:1 cuts the blocks of bsr"):
        B[1:5]


@pytest.mark.parametrize("format", ["csr", "csc", "coo", "dense", "bsr(2,2)", "nm(2,4)"])
def test_cat_and_stack_match_torch(format):
    parts = [make(format, shape=(n, 8), seed=n) for n in (2, 4, 6)]
    stored = [S.to_dense() for _, S in parts]
    joined = sparsenn.cat([S for _, S in parts])
    assert joined.format == parts[0][1].format and torch.equal(joined.to_dense(), torch.cat(stored))
    same = [make(format, seed=k) for k in range(3)]
    stacked = sparsenn.stack([S for _, S in same])
    assert stacked.shape == (3, 6, 8) and torch.equal(stacked.to_dense(), torch.stack([S.to_dense() for _, S in same]))
    assert torch.equal(stacked[1].to_dense(), same[1][1].to_dense())


def test_stack_formats_and_gradients():
    _, S = make("csr")
    assert str(sparsenn.stack([S, S]).format) == "ddc"
    assert str(sparsenn.stack([S.asformat("bsr(2,2)")] * 2).format) == "ddc(1,2,2)"
    assert str(sparsenn.stack([sparsenn.from_dense(S.to_dense(), "nm(2,4)")] * 2).format) == "nm(2,4)"
    values = S.values.clone().requires_grad_()
    stacked = sparsenn.stack([S.with_values(values), S.with_values(values * 2)])
    stacked.values.sum().backward()
    torch.testing.assert_close(values.grad, torch.full_like(values, 3.0))


def test_cat_and_stack_reject_mismatches():
    _, S = make("csr")
    with pytest.raises(TypeError, match="non-empty sequence"):
        sparsenn.stack([])
    with pytest.raises(TypeError, match="non-empty sequence"):
        sparsenn.cat(S)
    with pytest.raises(ValueError, match="tensors\\[1\\] has format csc"):
        sparsenn.stack([S, S.asformat("csc")])
    with pytest.raises(TypeError, match="tensors\\[1\\] has dtype torch.float32"):
        sparsenn.cat([S, S.to(torch.float32)])
    with pytest.raises(ValueError, match="the shape after dimension 0 must match"):
        sparsenn.cat([S, sparsenn.from_dense(torch.zeros(6, 7, dtype=torch.float64))])
    with pytest.raises(ValueError, match="the shape must match"):
        sparsenn.stack([S, S[:3]])
    with pytest.raises(TypeError, match="tensors\\[1\\] is a Tensor"):
        sparsenn.stack([S, S.to_dense()])


class Documents(torch.utils.data.Dataset):
    """Bag-of-words rows as csr SparseTensors of one row, with a label."""

    def __init__(self):
        self.rows = [sparse_dense((1, 16), density=0.2, seed=k, dtype=torch.float32) for k in range(10)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, k):
        return sparsenn.from_dense(self.rows[k], "csr"), torch.tensor(k % 2)


def collate(batch):
    return sparsenn.cat([x for x, _ in batch]), torch.stack([y for _, y in batch])


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_batches_sparse_rows_into_a_sparse_linear(workers):
    data = Documents()
    loader = DataLoader(data, batch_size=4, collate_fn=collate, num_workers=workers)
    layer = sparsenn.SparseLinear(16, 3, sparsity=0.5)
    seen = 0
    for x, y in loader:
        assert isinstance(x, SparseTensor) and x.shape == (len(y), 16) and str(x.format) == "csr"
        expected = torch.cat(data.rows[seen:seen + len(y)])
        assert torch.equal(x.to_dense(), expected)
        torch.testing.assert_close(layer(x), layer(expected))
        seen += len(y)
    assert seen == 10


@pytest.mark.parametrize("format", ["csr", "coo", "dense", "bsr(2,2)", "nm(2,4)", "cs[1,0]"])
def test_weights_only_load_without_allow_listing(format):
    _, S = make(format)
    buffer = io.BytesIO()
    torch.save({"adjacency": S, "int64": S.asformat(S.format, index_dtype=torch.int64)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["adjacency"].format == S.format and torch.equal(loaded["adjacency"].to_dense(), S.to_dense())
    assert loaded["int64"].index_dtype == torch.int64


def test_weights_only_load_validates_the_arrays():
    _, S = make("csr")
    crd = S.crd[1].clone()
    crd[0] = 100
    broken = SparseTensor(S.shape, S.format, S.pos, (None, crd), S.values, check=False)
    buffer = io.BytesIO()
    torch.save(broken, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="out of range"):
        torch.load(buffer, weights_only=True)
