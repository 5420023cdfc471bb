"""Contraction paths: the search's answers, its cost in ``schedule`` calls (the "pair
schedules" cache's misses), and every equation's result against torch.einsum on dense
copies."""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

import pytest
import torch

import sparsenn
from sparsenn import SparseTensor
from sparsenn.compiler import cache_stats, clear_caches
from sparsenn.compiler.frontend.notation import Access, Assignment, Term, parse_einsum
from sparsenn.compiler.plan import contract
from sparsenn.compiler.plan.contract import Step, best_path, pairwise_path
from sparsenn.compiler.plan.infer import infer_output_format
from sparsenn.compiler.plan.schedule import OperandInfo, schedule
from sparsenn.compiler.plan.target import Target
from sparsenn.formats import parse_format

# opt_einsum's tests/test_contract.py and tests/test_paths.py, numpy's test_einsum.py:
# the equations of three or more operands without an index repeated within one operand.
OPT_EINSUM = [
    "a,ab,abc->abc",
    "a,b,ab->ab",
    "ea,fb,gc,hd,abcd->efgh",
    "ea,fb,abcd,gc,hd->efgh",
    "abcd,ea,fb,gc,hd->efgh",
    "cd,bdhe,aidb,hgca,gc,hgibcd,hgac",
    "abhe,hidj,jgba,hiab,gab",
    "bde,cdh,agdb,hica,ibd,hgicd,hiac",
    "chd,bde,agbc,hiad,hgc,hgi,hiad",
    "chd,bde,agbc,hiad,bdi,cgh,agdb",
    "ab,ab,c->",
    "ab,ab,c->c",
    "ab,ab,cd,cd->",
    "ab,ab,cd,cd->ac",
    "ab,ab,cd,cd->cd",
    "ab,ab,cd,cd,ef,ef->",
    "ab,cd,ef->abcdef",
    "ab,cd,ef->acdf",
    "ab,cd,de->abcde",
    "ab,cd,de->be",
    "ab,bcd,cd->abcd",
    "ab,bcd,cd->abd",
    "eb,cb,fb->cef",
    "bca,cdb,dbf,afc->",
    "bd,db,eac->ace",
    "efc,dbc,acf,fd->abe",
    "dba,ead,cad->bce",
    "aef,fbc,dca->bde",
    "abc,bdef,fghj,cem,mhk,ljk->adgl",
    "a,ac,ab,ad,cd,bd,bc->",
    "abc,cfd,dbe,efa",
    "ab,cd,ef,fg",
    "hbc,bdef,cdkj,ji,ikeh,lfo",
    "ijab,acd,bce,df,ef->ji",
    "ab,cd,ad,cb",
    "a,b,abc->c",
]
NUMPY = [
    "ijk,kl,jl,i->i",
    "abjk,kl,jl,ab->ab",
    "a,b,c->abc",
    "ab,bc,cd,de->ae",
]
# Eight operands: the chain of opt_einsum's test_large_path, a ring, its index
# transformation widened, two of its seven-operand products with one more operand,
# and two disconnected chains.
EIGHT = [
    "ab,bc,cd,de,ef,fg,gh,hi",
    "ab,bc,cd,de,ef,fg,gh,ha->",
    "ea,fb,gc,hd,abcd,ie,jf,kg->ijkh",
    "cd,bdhe,aidb,hgca,gc,hgibcd,hgac,ie->ae",
    "bde,cdh,agdb,hica,ibd,hgicd,hiac,ef->f",
    "ab,bc,cd,de,ij,jk,kl,lm->aeim",
]
# Every pair shares an index: any pairwise path forms an intermediate of rank 12, more
# than a kernel produces, so it is planned (greedily) as one fused product.
COMPLETE_EIGHT = "abcdefg,ahijklm,bhnopqr,cinstuv,djoswxy,ekptwzA,flquxzB,gmrvyAB->"
SMALL = [2, 3, 4, 5, 4, 3, 2, 6, 5, 4]  # numpy's test sizes, cycled over the indices
REALISTIC = [64, 16, 128, 32, 256, 8]


def _lhs(equation: str) -> list[str]:
    return equation.split("->")[0].split(",")


def _dims(equation: str, sizes: list[int]) -> dict[str, int]:
    letters = sorted(set("".join(_lhs(equation))))
    return {i: sizes[n % len(sizes)] for n, i in enumerate(letters)}


def _sparse_info(shape: tuple[int, ...], density: float) -> OperandInfo:
    """A ``d c ... c`` operand with ``density`` of its entries stored."""
    fmt = parse_format("d" + "c" * (len(shape) - 1) if len(shape) > 1 else "c", len(shape))
    nnz = max(1, int(density * math.prod(shape)))
    positions, parent, full = [], 1, 1
    for letter, size in zip(fmt.letters, shape):
        full *= size
        parent = parent * size if letter == "d" else min(nnz, full)
        positions.append(parent)
    return OperandInfo(fmt, shape, tuple(positions))


def _infos(equation: str, sizes: list[int], sparse_every: int = 2, density: float = 0.01) -> list[OperandInfo]:
    dims = _dims(equation, sizes)
    infos = []
    for n, spec in enumerate(_lhs(equation)):
        shape = tuple(dims[i] for i in spec)
        infos.append(_sparse_info(shape, density) if n % sparse_every == 0 and spec else OperandInfo(None, shape))
    return infos


def _run_steps(equation: str, steps: list[Step], tensors: list[torch.Tensor]) -> torch.Tensor:
    """Evaluate ``steps`` with torch.einsum, one pair at a time."""
    items = list(zip(_lhs(equation), tensors))
    for step in steps:
        (a, x), (b, y) = items[step.left], items[step.right]
        result = torch.einsum(f"{a},{b}->{''.join(step.indices)}", x, y)
        items = [item for k, item in enumerate(items) if k not in (step.left, step.right)]
        items.append(("".join(step.indices), result))
    ((_, result),) = items
    return result


def _to_dense(x):
    return x.to_dense() if isinstance(x, SparseTensor) else x


@pytest.mark.parametrize("equation", OPT_EINSUM + NUMPY + EIGHT)
def test_result_matches_torch(equation):
    dims = _dims(equation, SMALL)
    g = torch.Generator().manual_seed(0)
    dense, operands = [], []
    for n, spec in enumerate(_lhs(equation)):
        values = torch.randn([dims[i] for i in spec], generator=g, dtype=torch.float64)
        if n % 2 == 0:
            values = values * (torch.rand(values.shape, generator=g) < 0.5)
            fmt = "d" + "c" * (len(spec) - 1) if len(spec) > 1 else "c"
            operands.append(sparsenn.from_dense(values, format=fmt))
        else:
            operands.append(values)
        dense.append(values)
    expected = torch.einsum(equation, *dense)
    got = _to_dense(sparsenn.einsum(equation, *operands))
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("equation", OPT_EINSUM + NUMPY + EIGHT)
def test_path_steps_compute_the_product(equation):
    # Planned at realistic sizes, run on small tensors: the steps only name indices.
    n = len(_lhs(equation))
    assignment = parse_einsum(equation, n)
    steps = best_path(assignment, _infos(equation, REALISTIC), 4)
    if steps is None:
        return
    assert len(steps) == n - 1
    assert all(step.left < step.right for step in steps)
    dims = _dims(equation, SMALL)
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn([dims[i] for i in spec], generator=g, dtype=torch.float64) for spec in _lhs(equation)]
    expected = torch.einsum(equation, *tensors)
    torch.testing.assert_close(_run_steps(equation, steps, tensors), expected, atol=1e-9, rtol=1e-7)
    assert steps[-1].indices == assignment.output and not steps[-1].dense


SEVEN_OR_EIGHT = [e for e in OPT_EINSUM + EIGHT if len(_lhs(e)) >= 7] + [COMPLETE_EIGHT]


@pytest.mark.parametrize("sparse_every", [2, 3])
@pytest.mark.parametrize("equation", SEVEN_OR_EIGHT)
def test_planning_cost_is_bounded(equation, sparse_every):
    """Each pair is scheduled once, and far fewer pairs are costed than the exhaustive
    search over pair sequences did (over 100,000 schedule calls, minutes of CPU, for the
    seven operands of ``a,ac,ab,ad,cd,bd,bc->``). Typically under 0.6 s of CPU and under
    100 schedule calls per equation here."""
    n = len(_lhs(equation))
    assignment = parse_einsum(equation, n)
    infos = _infos(equation, REALISTIC, sparse_every)
    clear_caches()
    start = time.process_time()
    steps = best_path(assignment, infos, 4)
    assert time.process_time() - start < 5.0
    scheduled = cache_stats()["pair schedules"]
    assert scheduled.evictions == 0 and scheduled.misses == scheduled.size  # no pair scheduled twice
    assert scheduled.misses + 1 <= 300  # with the fused schedule
    assert best_path(assignment, infos, 4) == steps  # planned again: every pair's schedule from the cache
    again = cache_stats()["pair schedules"]
    assert again.misses == scheduled.misses and again.hits >= scheduled.misses


def _exhaustive_tree(assignment: Assignment, infos: list[OperandInfo], itemsize: int) -> tuple[float, list[Step]]:
    """(cost, steps) of the cheapest of every sequence of pairwise contractions, each pair
    costed as best_path does."""
    (term,) = assignment.terms
    output = assignment.output
    pairs = contract._Pairs(term, output, infos, itemsize)
    def search(items):
        if len(items) == 1:
            return 0.0, []
        best = (math.inf, [])
        for x, y in itertools.combinations(range(len(items)), 2):
            (a, info_a), (b, info_b) = items[x], items[y]
            rest = [items[k] for k in range(len(items)) if k not in (x, y)]
            needed = set(output).union(*(set(indices) for indices, _ in rest))
            seen = dict.fromkeys(a + b)
            keep = tuple(i for i in output if i in seen) + tuple(i for i in seen if i in needed and i not in output)
            held = tuple(i for i in seen if i in needed)  # kept by an in-place (anchored) intermediate
            term = Term(1.0, (Access(0, a), Access(1, b)))
            cost, info, anchor = pairs.result(Assignment(held, (term,), ("left", "right")), (info_a, info_b))
            indices = held
            if anchor is None or not rest:
                indices = keep
                cost, info, _ = pairs.result(Assignment(keep, (term,), ("left", "right")), (info_a, info_b))
            sub_cost, sub_steps = search(rest + [(indices, info)])
            if cost + sub_cost < best[0]:
                best = (cost + sub_cost, [Step(x, y, indices, bool(rest) and info.format is None)] + sub_steps)
        return best

    return search([(a.indices, infos[a.operand]) for a in term.factors])


def _exhaustive(assignment: Assignment, infos: list[OperandInfo], itemsize: int, anchored: bool) -> list[Step] | None:
    """The exhaustive tree if it costs less than the fused schedule, else None."""
    fmt = None if anchored else infer_output_format(assignment, [i.format for i in infos])
    fused = schedule(assignment, infos, fmt, itemsize).cost + contract.launch_cost(Target.current())
    cost, steps = _exhaustive_tree(assignment, infos, itemsize)
    return steps if cost < fused else None


def test_three_operand_paths_are_the_exhaustive_search():
    rng = random.Random(3)
    compared = 0
    while compared < 80:
        specs = ["".join(rng.sample("ijklmn"[: rng.randint(3, 6)], rng.randint(1, 3))) for _ in range(3)]
        used = sorted(set("".join(specs)))
        equation = ",".join(specs) + "->" + "".join(rng.sample(used, rng.randint(0, min(3, len(used)))))
        dims = {i: rng.choice([4, 32, 256, 2000]) for i in used}
        infos = []
        for spec in specs:
            shape = tuple(dims[i] for i in spec)
            sparse = rng.random() < 0.5
            density = rng.choice([0.001, 0.01, 0.1, 0.5])
            infos.append(_sparse_info(shape, density) if sparse else OperandInfo(None, shape))
        if all(i.format is None for i in infos):
            continue
        anchored = rng.random() < 0.2
        assignment = parse_einsum(equation, 3)
        assert best_path(assignment, infos, 4, anchored) == _exhaustive(assignment, infos, 4, anchored), equation
        compared += 1


def _operand_indices(equation: str) -> list[set[str]]:
    return [set(spec) for spec in _lhs(equation)]


def test_exact_search_splits():
    # Up to five operands, every split: (3^n - 2^(n+1) + 1) / 2 of them.
    for equation in ("ab,cd,ef", "ab,cd,ef,fg", "ab,bc,cd,de,ef"):
        n = len(_lhs(equation))
        splits = contract._splits(_operand_indices(equation))
        assert sum(map(len, splits.values())) == (3**n - 2 ** (n + 1) + 1) // 2
    # Beyond: a chain of eight splits each of its C(8, 2) intervals at each inner point.
    splits = contract._splits(_operand_indices("ab,bc,cd,de,ef,fg,gh,hi"))
    assert sum(map(len, splits.values())) == math.comb(9, 3)
    indices = _operand_indices("ab,bc,cd,de,ef,fg,gh,hi")
    for parts in splits.values():
        for a, b in parts:
            left = set().union(*(s for k, s in enumerate(indices) if a >> k & 1))
            right = set().union(*(s for k, s in enumerate(indices) if b >> k & 1))
            assert left & right
    # Two components: their union is split between them, with no other outer product.
    splits = contract._splits(_operand_indices("ab,bc,cd,ij,jk,kl"))
    assert splits[0b111111] == [(0b111000, 0b000111)]
    assert 0b001001 not in splits
    # Too many candidate splits (the complete graph) or operands: greedy only.
    assert contract._splits(_operand_indices(COMPLETE_EIGHT)) is None
    chain = ",".join(f"{a}{b}" for a, b in zip("abcdefghijkl", "bcdefghijklm"))
    assert contract._splits(_operand_indices(chain)) is None


def test_long_chains_are_planned_greedily():
    letters = "abcdefghijklmnop"
    equation = ",".join(f"{a}{b}" for a, b in zip(letters, letters[1:])) + "->ap"
    n = len(_lhs(equation))
    infos = _infos(equation, REALISTIC, sparse_every=3)
    start = time.process_time()
    steps = best_path(parse_einsum(equation, n), infos, 4)
    assert time.process_time() - start < 5.0
    assert steps is not None and len(steps) == n - 1
    tensors = [torch.randn(2, 2, dtype=torch.float64) for _ in range(n)]
    torch.testing.assert_close(_run_steps(equation, steps, tensors), torch.einsum(equation, *tensors))


def test_outer_products_of_small_sparse_operands_are_searched():
    # Five operands: the cheapest tree starts with ea x gc, both sparse (an outer product
    # of their nonzeros), as the exhaustive search finds too. The tree search is tested
    # whatever the fused kernel would cost (its order search, over 8 indices, finds
    # an order cheaper than every tree here).
    equation = "ea,fb,gc,hd,abcd->efgh"
    assignment = parse_einsum(equation, 5)
    infos = _infos(equation, [64, 64, 8, 32, 128])
    cost, steps = pairwise_path(assignment, infos, 4)
    assert (steps[0].left, steps[0].right) == (0, 2)
    exhaustive_cost, exhaustive_steps = _exhaustive_tree(assignment, infos, 4)
    assert steps == exhaustive_steps and cost == pytest.approx(exhaustive_cost, rel=1e-12)


def test_intermediates_stay_within_the_kernels_rank():
    # The complete graph: every pairwise path forms an intermediate of rank 12.
    assert best_path(parse_einsum(COMPLETE_EIGHT, 8), _infos(COMPLETE_EIGHT, [2]), 4) is None
    assert pairwise_path(parse_einsum(COMPLETE_EIGHT, 8), _infos(COMPLETE_EIGHT, [2]), 4) is None
    paths = 0
    for equation in OPT_EINSUM + NUMPY:
        n = len(_lhs(equation))
        assignment = parse_einsum(equation, n)
        if n > 6 or len(assignment.output) > 3:
            continue
        found = pairwise_path(assignment, _infos(equation, REALISTIC), 4, max_rank=3)
        if found is not None:
            paths += 1
            assert max(len(step.indices) for step in found[1]) <= 3, equation
    assert paths >= 5


def test_a_product_on_one_pattern_stays_where_it_is_stored():
    # dK[j,d] = sum_i M[i,j] dS[i,j] Q[i,d] with dS on M's pattern (a sampled gradient):
    # M * dS is computed in place, in the pattern's (i, j) order, not assembled as (j, i).
    mask = _sparse_info((4096, 4096), 0.1)
    shared = [mask, replace(mask, pattern=0), OperandInfo(None, (4096, 64))]
    assignment = parse_einsum("ij,ij,id->jd", 3)
    assert best_path(assignment, shared, 4)[0] == Step(0, 1, ("i", "j"))
    pairs = contract._Pairs(assignment.terms[0], assignment.output, shared, 4)
    factors = assignment.terms[0].factors
    _, tree = pairs.join(*(contract._Tree(1 << k, factors[k].indices, shared[k], pattern=0) for k in (0, 1)))
    assert tree.info.format == mask.format and tree.pattern == 0


def test_explain_shows_the_contraction_path_a_call_runs():
    g = torch.Generator().manual_seed(0)
    a = SparseTensor.from_dense(torch.randn(50, 60, dtype=torch.float64, generator=g)
                                * (torch.rand(50, 60, generator=g) < 0.1), format="csr")
    x, w = torch.randn(60, 70, dtype=torch.float64), torch.randn(70, 80, dtype=torch.float64)
    text = sparsenn.explain("ij,jk,kl->il", a, x, w)
    assert "contraction path" in text and "generated C++" not in text
    assert "step 1: T1[i,k] = operand0[i,j] * operand1[j,k] (dense)" in text
    assert "step 2: Out[i,l] = operand2[k,l] * T1[i,k] (the result)" in text


def test_an_epilogue_after_a_cheaper_contraction_path():
    # The sum A X W runs as its path (BLAS for the dense step), then relu(· + b) over it.
    g = torch.Generator().manual_seed(1)
    a = SparseTensor.from_dense(torch.randn(50, 60, dtype=torch.float64, generator=g)
                                * (torch.rand(50, 60, generator=g) < 0.1), format="csr")
    x, w = torch.randn(60, 70, dtype=torch.float64), torch.randn(70, 80, dtype=torch.float64)
    b = torch.randn(80, dtype=torch.float64)
    expression = sparsenn.compile("Y[i,l] = relu(A[i,j] * X[j,k] * W[k,l] + b[l])", out_format="dense")
    text = expression.explain(a, x, w, b)
    assert "contraction path" in text and "then the epilogue" in text and "generated C++" not in text
    y = expression(a, x, w, b)
    torch.testing.assert_close(y, torch.relu(a.to_dense() @ x @ w + b))
    assert y.data_ptr() not in (x.data_ptr(), w.data_ptr(), b.data_ptr())
    small = [torch.randn(60, 7, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64),
             torch.randn(5, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *p: expression(a, *p), [t.requires_grad_() for t in small])


def test_a_path_pays_a_launch_per_step():
    """Each pairwise step is a launch of its own, the fused nest one: ``A B C`` with a
    sparse ``A`` contracts ``(A B) C`` once its work saves more than a second launch
    (64 x 64 on the default machine), and fuses at 16 x 16, where a machine whose
    launches cost nothing would contract in steps too."""
    assignment = parse_einsum("ij,jk,kl->il", 3)

    def infos(n: int) -> list[OperandInfo]:
        return [_sparse_info((n, n), 0.1), OperandInfo(None, (n, n)), OperandInfo(None, (n, n))]

    with sparsenn.compiler.use_target(Target()):
        assert best_path(assignment, infos(16), 4) is None
        assert best_path(assignment, infos(64), 4) is not None
    with sparsenn.compiler.use_target(Target(launch_cycles=1.0)):
        assert best_path(assignment, infos(16), 4) is not None
