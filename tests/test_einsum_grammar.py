"""torch.einsum's whole grammar through sparsenn.einsum, with sparse operands.

The equations are those of PyTorch's ``test_einsum``, ``test_einsum_sublist_format`` and
``test_einsum_corner_cases`` (test/test_linalg.py) and numpy's ``test_einsum.py``, copied
as literals. Each runs all-dense (torch.einsum's path) and, for equations of up to four
operands, with each operand that has dimensions stored sparse in turn (CSR/COO/CSF by
position); results are compared with torch.einsum on dense copies. Equations of five or
more operands run all-dense only: planning their contraction paths with a sparse operand
takes seconds each (exhaustive search), which is not the grammar's concern.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler.frontend import equation as grammar
from sparsenn.compiler.frontend.diagonal import view, view_format
from sparsenn.formats import parse_format

F64 = torch.float64

# PyTorch test_einsum's operands: x, y, A .. I.
x, y, A, B, C, D = (5,), (7,), (3, 5), (2, 5), (2, 3, 5), (2, 5, 7)
E, F, G, H, I = (7, 9), (2, 3, 3, 5), (5, 4, 6), (4, 4), (2, 3, 2)

PYTORCH = [
    ("i->", [x]), ("i,i->", [x, x]), ("i,i->i", [x, x]), ("i,j->ij", [x, y]),
    ("ij->ji", [A]), ("ij->j", [A]), ("ij->i", [A]), ("ij,ij->ij", [A, A]), ("ij,j->i", [A, x]),
    ("ij,kj->ik", [A, B]), ("ij,ab->ijab", [A, E]),
    ("Aij,Ajk->Aik", [C, D]), ("ijk,jk->i", [C, A]), ("aij,jk->aik", [D, E]), ("abCd,dFg->abCFg", [F, G]),
    ("ijk,jk->ik", [C, A]), ("ijk,jk->ij", [C, A]), ("ijk,ik->j", [C, B]), ("ijk,ik->jk", [C, B]),
    ("ii", [H]), ("ii->i", [H]), ("iji->j", [I]), ("ngrg...->nrg...", [(2, 1, 3, 1, 4)]),
    ("i...->...", [H]), ("ki,...k->i...", [(5, 3), B]), ("k...,jk->...", [(5, 3), B]),
    ("...ik, ...j -> ...ij", [C, x]), ("Bik,k...j->i...j", [C, (5, 3)]),
    ("i...j, ij... -> ...ij", [C, (2, 5, 2, 3)]),
    ("bn,anm,bm->ba", [(5, 10), (15, 10, 20), (5, 20)]),
    # test_einsum_corner_cases
    (" ", [()]), (" -> ", [()]), (" , ", [(), ()]), (" , , ", [(), (), ()]), (" , -> ", [(), ()]),
    (" i ", [(1,)]), (" i -> ", [(1,)]), (" i -> i ", [(1,)]), (" i , i ", [(1,), (1,)]),
    (" i , i -> i ", [(1,), (1,)]), ("i", [(0,)]), (" i j -> j", [(2, 0)]), ("ij->i", [(2, 0)]),
    (" i j k  ,  k  -> i j ", [(3, 0, 6), (6,)]), ("i,j", [(1,), (2,)]), ("i,ij->ij", [(2,), (2, 3)]),
    ("...", [()]), ("...->", [()]), ("...->...", [()]), ("...", [(1,)]), ("...->", [(1,)]),
    ("z...->z", [(1,)]), ("Z...->...Z", [(1,)]), ("...a->", [(2, 1)]), ("a...b->ab", [(2, 2, 1)]),
]

# numpy's sizes for its letter-only equations (test_einsum.py: chars 'abcdefghij').
SIZES = dict(zip("abcdefghij", (2, 3, 4, 5, 4, 3, 2, 6, 5, 4)))
SIZES |= dict(zip("klmnopqrstuvwxyz", (3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 3, 2, 4)))


def letter_shapes(equation: str) -> list[tuple[int, ...]]:
    lhs = equation.partition("->")[0].replace(" ", "")
    return [tuple(SIZES[c] for c in spec) for spec in lhs.split(",")]


NUMPY_LETTERS = [
    "", "->", ",i->", ",i->i", "i,->", "i,->i", "i, i", "i,i", "i,i,i->i", "i,i->i", "i,ij->", "i,j", "i->",
    "ii", "ii->i", "iii->i", "ij", "ij, j", "ij,i->", "ij,j", "ij,jk", "ij,jk,kl", "ijk, jil -> kl", "ijk,jil->kl",
    "ijk->jik", "ji", "ji,i->", "ji,j", "jii->ij", "a", "a,a,a->a", "a,ab,abc->abc", "a,b,ab->ab", "a,b,c->abc",
    "aab,fa,df,ecc->bde", "aabb->ab", "aabcb,abc", "ab,ab", "ab,ab,c->", "ab,ab,c->c", "ab,ab,cd,cd->",
    "ab,ab,cd,cd->ac", "ab,ab,cd,cd->cd", "ab,ba", "ab,bc,cd,de->ae", "ab,bcd,cd->abcd", "ab,bcd,cd->abd",
    "ab,cd,de->abcde", "ab,cd,de->be", "ab,cd,ef->abcdef", "ab,cd,ef->acdf", "abc,abc", "abc,bac", "abc,cba",
    "abcd,ad", "abjk,kl,jl", "abjk,kl,jl,ab->ab", "acdf,jbje,gihb,hfac", "adb,bc,fa,cfc->d", "aef,fbc,dca->bde",
    "afd,ba,cc,dc->bf", "ba,ac,da->bcd", "baa,dcf,af,cde->be", "bb,ff,be->e", "bbcdc->d", "bbd,bda,fc,db->acf",
    "bca,cdb,dbf,afc->", "bcb,bb,fc,fff->", "bcf,bbb,fbf,fc->", "bd,db,eac->ace", "cab,cdd->ab", "cl, cpx->lpx",
    "cl, cpxy->lpxy", "dba,ead,cad->bce", "dcc,fce,ea,dbf->ab", "dd,fb,be,cdb->cef", "eb,cb,fb->cef",
    "ecb,fef,bad,ed->ac", "ed,fcd,ff,bcf->be", "efc,dbc,acf,fd->abe", "fbb,dfd,fc,fc->", "fdf,cdd,ccd,afe->ae",
    "fff,fae,bef,def->abd", "i,i,i,i->", "i,i,i->", "i,i->", "ij,ij->j", "ij,jk->ik", "ij->j", "ijij->",
    "ijk,j->ijk", "ijk,kl,jl", "ijk,kl,jl,i->i", "ijkl,k", "ijkl,k->ijl", "ijklm,ijn,ijn->", "ijklm,ijn->",
    "ik,kj->ij", "im,im,im->m", "mi,mi,mi->m", "obk,ijk->ioj", "x,yx,zx->xzy", "z,mz,zm->",
    # five operands and more
    "abcd,ea,fb,gc,hd->efgh", "ea,fb,abcd,gc,hd->efgh", "ea,fb,gc,hd,abcd->efgh", "ab,ab,cd,cd,ef,ef->",
    "abhe,hidj,jgba,hiab,gab", "bdhe,acad,hiab,agac,hibd", "a,ac,ab,ad,cd,bd,bc->",
    "acdf,jbje,gihb,hfac,gfac,gifabc,hfac", "cd,bdhe,aidb,hgca,gc,hgibcd,hgac",
    "bde,cdh,agdb,hica,ibd,hgicd,hiac", "chd,bde,agbc,hiad,hgc,hgi,hiad", "chd,bde,agbc,hiad,bdi,cgh,agdb",
]

NUMPY_ELLIPSIS = [
    ("...", [(2, 3)]), ("..., ...", [(2, 3), (3,)]), ("...,...", [(4,), (4,)]), ("...i, ...i", [(2, 3), (3,)]),
    ("...i->...", [(2, 3)]), ("...ii->...i", [(3, 3, 3)]), ("...ii->i...", [(3, 3, 3)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]), ("i..., i...", [(3, 2), (3,)]), ("i...->...", [(3, 2)]),
    ("i...i->...i", [(3, 2, 3)]), ("i...i->i...", [(3, 2, 3)]), ("ii...->...i", [(3, 3, 2)]),
    ("ii...->i...", [(3, 3, 2)]), ("...ft,mf->...mt", [(2, 3, 5), (4, 3)]), ("...i,...i", [(3,), (3,)]),
    ("...k,kj", [(4, 3), (3, 2)]), ("...kl,k", [(2, 3, 4, 5), (4,)]), ("...kl,k...", [(2, 3, 4, 5), (4,)]),
    ("...lmn,...lmno->...o", [(1, 1, 1, 3, 2, 2), (3, 2, 2, 3)]),
    ("...lmn,lmno->...o", [(1, 1, 1, 3, 2, 2), (3, 2, 2, 3)]),
    ("ij...,...j->ij...", [(2, 3, 4), (3,)]), ("ij...,j->ij...", [(2, 3, 4), (3,)]),
    ("ij...,j...->i...", [(1, 2), (2, 2, 1)]), ("ij...,j...->ij...", [(2, 3, 4), (3,)]),
    ("ik,k...->i...", [(4, 3), (3, 2)]), ("ik...,...kj->i...j", [(4, 3), (3, 2)]),
    ("ik...,k...->i...", [(4, 3), (3, 2)]),
    (" ...a  ->  ...a ", [(2, 3)]),
]

CASES = PYTORCH + [(eq, letter_shapes(eq)) for eq in NUMPY_LETTERS] + NUMPY_ELLIPSIS


def random_dense(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g) < 0.6)


def stored(t: torch.Tensor, turn: int) -> SparseTensor:
    """``t`` as CSR/COO (rank 2), COO/CSF (rank 3 and more) or COO (rank 1), by ``turn``."""
    if t.dim() == 2:
        return sparsenn.from_dense(t, ("csr", "coo")[turn % 2])
    return sparsenn.from_dense(t, ("coo", "csf")[turn % 2] if t.dim() > 2 else "coo")


def dense(result) -> torch.Tensor:
    return result.to_dense() if isinstance(result, SparseTensor) else result


def assert_matches(equation: str, operands: list, tensors: list[torch.Tensor]) -> None:
    want = torch.einsum(equation, *tensors)
    got = dense(sparsenn.einsum(equation, *operands))
    assert got.shape == want.shape, equation
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def sparse_turns() -> list:
    params = []
    for n, (equation, shapes) in enumerate(CASES):
        if len(shapes) > 4:
            continue
        for k in [k for k, s in enumerate(shapes) if len(s) > 0 and 0 not in s]:
            params.append(pytest.param(equation, shapes, k, id=f"{equation.strip() or 'blank'}|{k}"))
    return params


@pytest.mark.parametrize(("equation", "shapes"), [pytest.param(e, s, id=e.strip() or "blank") for e, s in CASES])
def test_all_dense_matches_torch(equation: str, shapes: list) -> None:
    tensors = [random_dense(s, seed) for seed, s in enumerate(shapes)]
    assert_matches(equation, tensors, tensors)


@pytest.mark.parametrize(("equation", "shapes", "k"), sparse_turns())
def test_one_sparse_operand_matches_torch(equation: str, shapes: list, k: int) -> None:
    tensors = [random_dense(s, seed) for seed, s in enumerate(shapes)]
    operands = list(tensors)
    operands[k] = stored(tensors[k], k + len(equation))
    assert_matches(equation, operands, tensors)


def test_two_sparse_operands_with_ellipsis_and_diagonal() -> None:
    a, b = random_dense((2, 3, 3, 4), 0), random_dense((4, 3, 5), 1)
    assert_matches("...ii j, j i k -> ...ik", [stored(a, 1), stored(b, 0)], [a, b])


def test_strided_dense_operands_around_a_sparse_one() -> None:
    """PyTorch's torch.bilinear case "with strided tensors"."""
    l, w, r = random_dense((5, 10), 0), random_dense((15, 10, 20), 1), random_dense((5, 20), 2)
    ls, ws, rs = l[:, ::2], w[:, ::2, ::2], r[:, ::2]
    assert_matches("bn,Anm,bm->bA", [ls, stored(ws.contiguous(), 1), rs], [ls, ws, rs])


def random_equation(rng: random.Random) -> tuple[str, list[tuple[int, ...]]]:
    """In the spirit of PyTorch's test_einsum_random: random labels (repeats allowed),
    an ellipsis with broadcast size-1 dimensions, size-1 labelled dimensions."""
    labels = rng.sample("abcdeABC", 4)
    sizes = {c: rng.randint(1, 4) for c in labels}
    ellipsis = [rng.choice((1, 2, 3)) for _ in range(2)]
    specs, shapes = [], []
    for _ in range(rng.randint(1, 3)):
        spec = rng.choices(labels, k=rng.randint(1, 3))
        shape = [1 if rng.random() < 0.15 else sizes[c] for c in spec]
        shape = [sizes[c] if spec.count(c) > 1 else s for c, s in zip(spec, shape)]
        if rng.random() < 0.5:
            count, at = rng.randint(0, 2), rng.randint(0, len(spec))
            spec.insert(at, "...")
            shape[at:at] = [1 if rng.random() < 0.2 else s for s in ellipsis[2 - count:]]
        specs.append("".join(spec))
        shapes.append(tuple(shape))
    equation = ",".join(specs)
    if rng.random() < 0.5:
        used = sorted({c for s in specs for c in s if c != "."})
        out = rng.sample(used, rng.randint(0, min(2, len(used))))
        out.insert(rng.randint(0, len(out)), "...")
        equation += "->" + "".join(out)
    return equation, shapes


@pytest.mark.parametrize("seed", range(24))
def test_random_equations(seed: int) -> None:
    rng = random.Random(seed)
    equation, shapes = random_equation(rng)
    tensors = [random_dense(s, n) for n, s in enumerate(shapes)]
    k = max(range(len(shapes)), key=lambda n: len(shapes[n]))
    operands = list(tensors)
    operands[k] = stored(tensors[k], seed)
    assert_matches(equation, operands, tensors)


# ----------------------------------------------------------------------------- call forms

SUBLISTS = [  # PyTorch test_einsum_sublist_format
    lambda x, y, A, B, C: (x, [0]),
    lambda x, y, A, B, C: (x, [0], []),
    lambda x, y, A, B, C: (x, [0], y, [1], [0, 1]),
    lambda x, y, A, B, C: (A, [0, 1], [1, 0]),
    lambda x, y, A, B, C: (A, [0, 1], x, [1], [0]),
    lambda x, y, A, B, C: (A, [0, 1], B, [2, 1]),
    lambda x, y, A, B, C: (A, [0, 1], B, [2, 1], [0, 2]),
    lambda x, y, A, B, C: (C, [0, 1, 2, 1, Ellipsis], [0, 2, 1, Ellipsis]),
    lambda x, y, A, B, C: (A.T, [0, 1], B, [Ellipsis, 0]),
    lambda x, y, A, B, C: (A.T, [0, 1], B, [Ellipsis, 0], [1, Ellipsis]),
    lambda x, y, A, B, C: (A.T, [0, Ellipsis], B, [1, 0], [Ellipsis]),
]


@pytest.mark.parametrize("form", range(len(SUBLISTS)))
def test_sublist_form(form: int) -> None:
    shapes = [(5,), (7,), (3, 5), (2, 5), (2, 1, 3, 1, 4)]
    tensors = [random_dense(s, n) for n, s in enumerate(shapes)]
    operands = [stored(t, n) for n, t in enumerate(tensors)]
    want = torch.einsum(*SUBLISTS[form](*tensors))
    got = dense(sparsenn.einsum(*SUBLISTS[form](*operands)))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_bilinear_sublists_with_large_labels() -> None:
    l, w, r = random_dense((5, 10), 0), random_dense((15, 10, 20), 1), random_dense((5, 20), 2)
    want = torch.einsum(l, [40, 41], w, [2, 41, 50], r, [40, 50], [40, 2])
    got = sparsenn.einsum(l, [40, 41], stored(w, 0), [2, 41, 50], r, [40, 50], [40, 2])
    torch.testing.assert_close(dense(got), want)


def test_operands_as_one_list() -> None:
    a, b = random_dense((3, 4), 0), random_dense((4, 2), 1)
    torch.testing.assert_close(dense(sparsenn.einsum("ij,jk", [stored(a, 0), b])), a @ b)
    torch.testing.assert_close(sparsenn.einsum(" , -> ", (torch.tensor(2.0, dtype=F64), torch.tensor(3.0, dtype=F64))),
                               torch.tensor(6.0, dtype=F64))


def test_explain_takes_the_whole_grammar() -> None:
    text = sparsenn.explain("...ii->...i", stored(random_dense((2, 3, 3), 0), 0))
    assert re.search(r"expression: Out\[\w,\w\] = ", text)


# ----------------------------------------------------------------------------- gradients

GRADIENTS = [
    ("ii->i", [(4, 4)], 0, "csr"),
    ("bii,bi->b", [(2, 3, 3), (2, 3)], 0, "coo"),
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)], 1, "csr"),
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)], 0, "dcc"),
    ("ij,jk->ik", [(3, 1), (4, 2)], 0, "csr"),
    ("iji->j", [(3, 2, 3)], 0, "csf"),
    ("ij,jj->ij", [(3, 4), (4, 4)], 1, "csc"),
]


@pytest.mark.parametrize(("equation", "shapes", "k", "fmt"), GRADIENTS)
def test_gradients_reach_sparse_values_and_dense_operands(equation: str, shapes: list, k: int, fmt: str) -> None:
    tensors = [random_dense(s, n) for n, s in enumerate(shapes)]
    pattern = sparsenn.from_dense(tensors[k], fmt)
    others = [t.clone().requires_grad_(True) for n, t in enumerate(tensors) if n != k]

    def f(values: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        operands = list(rest)
        operands.insert(k, pattern.with_values(values))
        out = sparsenn.einsum(equation, *operands)
        return out.values if isinstance(out, SparseTensor) else out

    values = pattern.values.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (values, *others), atol=1e-8)


def test_gradient_through_a_diagonal_of_a_strided_dense_operand() -> None:
    mask = sparsenn.from_dense(random_dense((4,), 0), "coo")

    def diagonal_times_mask(matrix: torch.Tensor) -> torch.Tensor:
        return sparsenn.einsum("ii,i->i", matrix, mask, out_format="dense")

    base = torch.randn(4, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda b: diagonal_times_mask(b.T), (base,))
    row = torch.randn(4, dtype=F64, requires_grad=True)  # stride-0 rows: the diagonal overlaps them
    assert torch.autograd.gradcheck(lambda r: diagonal_times_mask(r.expand(4, 4)), (row,))


# ----------------------------------------------------------------------------- sparse views


@pytest.mark.parametrize(("fmt", "rank", "groups", "expected"), [
    ("csr", 2, ((0, 1),), "c"),  # the diagonal of a CSR matrix stays sparse
    ("dense", 2, ((0, 1),), None),
    ("coo", 2, ((1,),), "c"),  # a singleton left at the top becomes compressed
    ("dcs", 3, ((0,), (2,)), "dc"),  # ... and so does one left under a dense level
    ("coo", 3, ((0,), (2,)), "cs"),
    ("dcc", 3, ((0, 2), (1,)), "cc"),
    ("dcc[2,0,1]", 3, ((1,), (0, 2)), "cc[1,0]"),
    ("bsr(2,2)", 2, ((0, 1),), "c"),
])
def test_view_format(fmt: str, rank: int, groups: tuple, expected: str | None) -> None:
    got = view_format(parse_format(fmt, rank), groups)
    assert got == (None if expected is None else parse_format(expected, len(groups)))


def test_sparse_diagonal_keeps_only_stored_diagonal_entries() -> None:
    t = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0], [4.0, 0.0, 5.0]], dtype=F64)
    d = view(sparsenn.from_dense(t, "csr"), ((0, 1),))
    assert isinstance(d, SparseTensor) and d.nnz == 2
    assert torch.equal(d.to_dense(), torch.tensor([1.0, 0.0, 5.0], dtype=F64))


# ----------------------------------------------------------------------------- plain equations


def test_plain_equations_pass_through_untouched() -> None:
    """No '.' and no letter twice in an operand: decided once per string (then known),
    and the call is returned as it is without parsing; other equations are parsed."""
    a, b = torch.ones(2, 3, dtype=F64), torch.ones(3, 4, dtype=F64)
    operands = (a, b)
    assert grammar.normalise("ij,jk->ik", operands) == ("ij,jk->ik", operands)
    assert "ij,jk->ik" in grammar._plain
    parsed = grammar.parse.cache_info()
    equation, ops = grammar.normalise("ij,jk->ik", operands)
    assert equation == "ij,jk->ik" and ops is operands
    assert grammar.parse.cache_info() == parsed  # not parsed
    grammar.normalise("ii->i", (torch.ones(2, 2, dtype=F64),))
    after = grammar.parse.cache_info()
    assert after.hits + after.misses == parsed.hits + parsed.misses + 1


def test_size_one_broadcast_in_a_plain_equation() -> None:
    a, b = random_dense((2, 1), 0), random_dense((3, 4), 1)
    assert_matches("ij,jk->ik", [stored(a, 0), b], [a, b])
    assert_matches("ij,jk->ik", [a, stored(b, 0)], [a, b])


@pytest.mark.parametrize(("equation", "shapes", "error", "pattern"), [
    ("i.j", [(3, 3)], sparsenn.NotationError, r"'\.' at column 1 in operand 0 is not part of an ellipsis"),
    (". ..", [(2,)], sparsenn.NotationError, r"'\.' at column 0 in operand 0 is not part of an ellipsis"),
    ("... ...", [(2,)], sparsenn.NotationError, r"operand 0 has a second ellipsis at column 4"),
    ("a->... .", [(2,)], sparsenn.NotationError, r"the output has a second ellipsis|column 7 in the output"),
    ("a->..", [(2,)], sparsenn.NotationError, r"column 3 in the output is not part of an ellipsis"),
    ("...i->...i->i", [(2,)], sparsenn.NotationError, r"more than one '->'"),
    ("i...%", [(2,)], sparsenn.NotationError, r"invalid characters \['%'\] \(the first at column 4\)"),
    ("...a->aa", [(2,)], sparsenn.NotationError, r"index 'a' appears twice in the output"),
    ("...a->i", [(2,)], sparsenn.NotationError, r"output index 'i' of '\.\.\.a->i' does not appear"),
    ("aa", [(2, 3)], sparsenn.NotationError, r"index 'a' appears twice in operand 0 \('aa'\) with sizes 2 and 3"),
    ("aaa->a", [(2, 2, 3)], sparsenn.NotationError, r"index 'a' appears 3 times in operand 0"),
    ("ai...", [(2,)], ValueError, r"operand 0 has 1 dimension\(s\) but 'ai\.\.\.' names 2 besides '\.\.\.'"),
    ("ii,j", [(2, 2), (2, 3)], ValueError, r"operand 1 has 2 dimension\(s\) .* with 1 \(j\) and no '\.\.\.'"),
    ("...i,...i", [(2, 3), (4, 3)], ValueError,
     r"'\.\.\.' dimension 0 \(counted from the left\) has size 4 in operand 1 but size 2 in operand 0"),
    ("...,...", [(2, 3), (3, 2)], ValueError, r"'\.\.\.' dimension 0 .* has size 3 in operand 1 but size 2"),
    ("ii,i", [(3, 3), (4,)], ValueError, r"index 'i' has size 4 in operand 1 but size 3 in operand 0"),
    ("...,...", [(2,)], sparsenn.NotationError, r"names 2 operand\(s\) but 1 were given"),
])
def test_bad_equations_name_the_problem(equation: str, shapes: list, error: type, pattern: str) -> None:
    operands = [stored(random_dense(s, 0), 0) if s else random_dense(s, 0) for s in shapes]
    with pytest.raises(error, match=pattern):
        sparsenn.einsum(equation, *operands)


def test_bad_sublists() -> None:
    x = torch.ones(2, dtype=F64)
    for label in (-1, 52, "a", True):
        with pytest.raises(ValueError, match=r"subscript .* is not Ellipsis or an int within \[0, 52\)"):
            sparsenn.einsum(x, [label])
    with pytest.raises(TypeError, match="sublist of operand 0 must be a list of ints, got int"):
        sparsenn.einsum(x, 0)


def test_too_many_ellipsis_dimensions_for_the_alphabet() -> None:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"  # 51 named, one letter left
    t = torch.ones((1,) * 53, dtype=F64)
    with pytest.raises(sparsenn.NotationError, match=r"needs 2 letters for '\.\.\.' but 1 are unused"):
        sparsenn.einsum(letters + "...", t)

