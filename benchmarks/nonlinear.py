"""Nonlinear benchmark: sparse softmax over stored entries and a fused ``relu(A @ X + b)``
epilogue, sparsenn against torch.sparse and the unfused paths, fp32.

    python benchmarks/nonlinear.py [--quick] [--threads 1 2] [--out DIR]

1. Softmax on graph patterns: ``sparsenn.softmax`` (and ``log_softmax``) of a CSR matrix
   along rows against ``torch.sparse.softmax`` on the same pattern in COO (torch rejects
   CSR input), forward and forward+backward: the real road graph luxembourg_osm
   (SuiteSparse DIMACS10, 114,599 rows, ~2 entries per row; downloaded once into
   ``$SPARSENN_DATA_DIR/suitesparse``, see ``models/download.py``) and a seeded synthetic
   graph of 10^5 rows with power-law degrees (mean 10) and uniform random columns.
2. Softmax on a BigBird block pattern: sequence 4096, blocks of 64; each block row
   attends to 2 global blocks, a window of 3 and 2 random blocks, and the 2 global block
   rows attend to every block. As ``bsr(64,64)`` (one head) and as a rank-4
   ``(1, 4, 4096, 4096)`` tensor in ``dddc(1,1,64,64)`` (4 heads, own random blocks).
   Rows marked "written": ``sparsenn.softmax`` against the same softmax a user writes in
   index notation (``M[i] = max[j](S[i,j]); E<S>[i,j] = exp(S[i,j] - M[i]); Z[i] =
   sum[j](E[i,j]); P<E>[i,j] = E[i,j] * (1 / Z[i])``, fused by the planner): parity is 1.
3. ``relu(A @ X + b)`` with A a graph adjacency, X 128 columns, b a bias:
   ``sparsenn.compile("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])")``, one kernel whose
   epilogue adds ``b[k]`` and applies relu per output slice, against the
   unfused sparsenn path (``sparsenn.einsum`` then ``+ b`` then ``torch.relu``) and against
   ``torch.sparse.mm`` (CSR) then the same torch ops.

Timing, ratios, machine information and first-build times (first call in a fresh process
with an empty SPARSENN_CACHE_DIR) work as in ``structured.py``, whose helpers this script
uses: alternatives run round-robin after warm-up rounds, medians are reported, ratio =
alternative time / sparsenn time (> 1: sparsenn faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import scipy.io
import torch

from checkout import ROOT  # noqa: E402  (first: this tree's sparsenn on sys.path)
import sparsenn  # noqa: E402
from models.download import suitesparse_matrix  # noqa: E402
from structured import (compare, error_text, first_build, first_build_table, machine_info, run_case,  # noqa: E402
                        run_first_build, sections_markdown, target, write_report)

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks are implicitly disabled.*")
ROWS, MEAN_DEGREE = 100_000, 10
SEQUENCE, BLOCK, HEADS = 4096, 64, 4
FEATURES = 128
SECTIONS = {"softmax-graph": "1. Softmax along rows of a graph pattern (CSR) vs torch.sparse.softmax (COO)",
            "softmax-bigbird": "2. Softmax on a BigBird block pattern (L = 4096, blocks of 64) vs torch.sparse.softmax",
            "epilogue": "3. Fused relu(A @ X + b), X with 128 columns"}
RELU_BIAS = sparsenn.compile("Y[i,k] = relu(A[i,j] * X[j,k] + b[k])")


# ----------------------------------------------------------------------------------- inputs
def power_law_graph(seed: int = 0) -> sparsenn.SparseTensor:
    """ROWS x ROWS CSR with Pareto(1.5) row degrees scaled to MEAN_DEGREE (at least 1, at
    most 2000) and uniform random columns (duplicates merged), values N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    pareto = (1.0 - torch.rand(ROWS, generator=g, dtype=torch.float64)) ** (-1 / 1.5)
    degrees = (pareto * MEAN_DEGREE / pareto.mean()).round().clamp(1, 2000).long()
    rows = torch.repeat_interleave(torch.arange(ROWS), degrees)
    cols = torch.randint(0, ROWS, (rows.numel(),), generator=g)
    values = torch.randn(rows.numel(), generator=g)
    return sparsenn.from_coo(torch.stack([rows, cols]), values, (ROWS, ROWS), format="csr")


def matrix_market(group: str, name: str, seed: int = 0) -> sparsenn.SparseTensor:
    """A SuiteSparse matrix's pattern in CSR with values N(0, 1)."""
    pattern = sparsenn.from_scipy(scipy.io.mmread(suitesparse_matrix(group, name)).tocsr(), format="csr")
    g = torch.Generator().manual_seed(seed)
    return pattern.with_values(torch.randn(pattern.nnz, generator=g))


def bigbird_blocks(g: torch.Generator) -> torch.Tensor:
    """(L/BLOCK)² bool block mask: 2 global, a window of 3 and 2 random blocks per block
    row, the 2 global block rows full."""
    n = SEQUENCE // BLOCK
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, :2] = mask[:2, :] = True
    for r in range(n):
        mask[r, max(r - 1, 0):r + 2] = True
        free = (~mask[r]).nonzero().flatten()
        mask[r, free[torch.randperm(free.numel(), generator=g)[:2]]] = True
    return mask


def bigbird(heads: int | None, seed: int = 0) -> sparsenn.SparseTensor:
    """BigBird scores: bsr(BLOCK,BLOCK) for heads=None, else (1, heads, L, L) in
    dddc(1,1,BLOCK,BLOCK), every head with its own random blocks; values N(0, 1) (blocks
    are stored whole)."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.stack([bigbird_blocks(g) for _ in range(heads or 1)])
    dense = masks.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2) * torch.randn(
        masks.shape[0], SEQUENCE, SEQUENCE, generator=g)
    if heads is None:
        return sparsenn.from_dense(dense[0], format=f"bsr({BLOCK},{BLOCK})")
    return sparsenn.from_dense(dense[None], format=f"dddc(1,1,{BLOCK},{BLOCK})")


# ----------------------------------------------------------------------------------- cases
def softmax_case(S: sparsenn.SparseTensor, log: bool, backward: bool, minimum: float | None) -> dict:
    """sparsenn.(log_)softmax along the last mode against torch.sparse.(log_)softmax on a
    COO copy; forward, or forward+backward with a fixed output gradient."""
    ours_fn = sparsenn.log_softmax if log else sparsenn.softmax
    torch_fn = torch.sparse.log_softmax if log else torch.sparse.softmax
    dim = S.ndim - 1
    coo = S.to_torch(torch.sparse_coo)
    if not backward:
        ours, theirs = (lambda: ours_fn(S, dim)), (lambda: torch_fn(coo, dim))
    else:
        grad = torch.randn(S.nnz, generator=torch.Generator().manual_seed(1))
        values, leaf = S.values.clone().requires_grad_(), coo.detach().requires_grad_()
        torch_grad = S.with_values(grad).to_torch(torch.sparse_coo)

        def ours() -> None:
            values.grad = None
            ours_fn(S.with_values(values), dim).values.backward(grad)

        def theirs() -> None:
            leaf.grad = None
            torch_fn(leaf, dim).backward(torch_grad)
    check = lambda: compare(ours_fn(S, dim).to_torch(torch.sparse_coo).values(),  # noqa: E731
                            torch_fn(coo, dim).coalesce().values())
    name = "torch.sparse." + ("log_softmax" if log else "softmax")
    return {"ours": ours, "alts": {name: theirs}, "check": check, "nnz": S.nnz, "numel": S.numel(),
            "targets": [] if minimum is None else [target(name, minimum)]}


def written_softmax(rank: int) -> sparsenn.CompiledExpression:
    """Softmax along the last mode as a user writes it in index notation."""
    full, rows = ",".join(f"i{m}" for m in range(rank)), ",".join(f"i{m}" for m in range(rank - 1))
    j = f"i{rank - 1}"
    return sparsenn.compile(f"M[{rows}] = max[{j}](S[{full}]); E<S>[{full}] = exp(S[{full}] - M[{rows}]); "
                            f"Z[{rows}] = sum[{j}](E[{full}]); P<E>[{full}] = E[{full}] * (1 / Z[{rows}])")


def written_softmax_case(S: sparsenn.SparseTensor) -> dict:
    """sparsenn.softmax against the same softmax written in index notation by a user
    (four statements the planner fuses into one kernel): a ratio near 1 is parity."""
    written = written_softmax(S.ndim)
    dim = S.ndim - 1
    check = lambda: compare(written(S).values, sparsenn.softmax(S, dim).values)  # noqa: E731
    return {"ours": lambda: sparsenn.softmax(S, dim), "alts": {"index notation": lambda: written(S)},
            "check": check, "nnz": S.nnz, "numel": S.numel(), "targets": [target("index notation", 0.9)]}


def epilogue_case(A: sparsenn.SparseTensor) -> dict:
    """relu(A @ X + b) compiled (one kernel: an epilogue adds b and applies relu), against
    the unfused sparsenn path and torch.sparse.mm (CSR) with torch ops."""
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(A.shape[1], FEATURES, generator=g), torch.randn(FEATURES, generator=g)
    csr = A.to_torch()

    def fused() -> torch.Tensor:
        with torch.no_grad():
            return RELU_BIAS(A, x, b)

    def unfused() -> torch.Tensor:
        with torch.no_grad():
            return torch.relu(sparsenn.einsum("ij,jk->ik", A, x) + b)

    def torch_path() -> torch.Tensor:
        return torch.relu(torch.sparse.mm(csr, x) + b)

    return {"ours": fused, "alts": {"sparsenn unfused": unfused, "torch.sparse.mm + ops": torch_path},
            "check": lambda: compare(fused(), torch_path()), "nnz": A.nnz, "numel": A.numel(),
            "targets": [target("sparsenn unfused", 1.3)]}


GRAPHS: dict[str, Callable[[], sparsenn.SparseTensor]] = {
    "luxembourg_osm": lambda: matrix_market("DIMACS10", "luxembourg_osm"),
    "power-law 1e5 x ~10/row": power_law_graph,
}


def specs(quick: bool) -> list[tuple[str, str, Callable[[], dict]]]:
    """(section, case name, builder) of every case, in report order."""
    out = []
    for graph, build in GRAPHS.items():
        out.append(("softmax-graph", f"{graph} softmax fwd", lambda b=build: softmax_case(b(), False, False, 3)))
        out.append(("softmax-graph", f"{graph} log_softmax fwd", lambda b=build: softmax_case(b(), True, False, 3)))
        if not quick:
            out.append(("softmax-graph", f"{graph} softmax fwd+bwd",
                        lambda b=build: softmax_case(b(), False, True, None)))
        out.append(("softmax-graph", f"{graph} softmax fwd, written", lambda b=build: written_softmax_case(b())))
    out.append(("softmax-bigbird", "bsr(64,64) 4096² softmax fwd", lambda: softmax_case(bigbird(None), False, False, 3)))
    if not quick:
        out.append(("softmax-bigbird", "bsr(64,64) 4096² softmax fwd+bwd",
                    lambda: softmax_case(bigbird(None), False, True, None)))
    out.append(("softmax-bigbird", f"dddc(1,1,64,64) 1x{HEADS}x4096² softmax fwd",
                lambda: softmax_case(bigbird(HEADS), False, False, 3)))
    out.append(("softmax-bigbird", f"dddc(1,1,64,64) 1x{HEADS}x4096² softmax fwd, written",
                lambda: written_softmax_case(bigbird(HEADS))))
    for graph, build in GRAPHS.items():
        out.append(("epilogue", f"{graph} relu(A@X+b)", lambda b=build: epilogue_case(b())))
    return out


def torch_csr_note() -> str:
    """What torch.sparse.softmax does with a CSR input."""
    csr = torch.eye(3).to_sparse_csr()
    try:
        torch.sparse.softmax(csr, 1)
    except Exception as error:  # noqa: BLE001 - reported as found
        return f"rejects it ({error_text(error)[:90]}...)"
    return "accepts it"


# ----------------------------------------------------------------------------------- first build
BUILD_SPECS = ["softmax-graph/power-law 1e5 x ~10/row softmax fwd",
               "softmax-graph/power-law 1e5 x ~10/row softmax fwd+bwd",
               "softmax-bigbird/bsr(64,64) 4096² softmax fwd",
               f"softmax-bigbird/dddc(1,1,64,64) 1x{HEADS}x4096² softmax fwd",
               "epilogue/power-law 1e5 x ~10/row relu(A@X+b)"]


def build_times(reps: int) -> dict[str, dict]:
    """Median first/second call ms of each BUILD_SPECS case over reps fresh processes."""
    out = {}
    for spec in BUILD_SPECS:
        runs = [first_build(spec, __file__) for _ in range(reps)]
        errors = [r for r in runs if "error" in r]
        out[spec] = errors[0] if errors else {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"first build {spec}: {out[spec]}", flush=True)
    return out


# ----------------------------------------------------------------------------------- report
def markdown(info: dict, rows: list[dict], builds: dict, csr_note: str, quick: bool) -> str:
    """The whole report: machine, one table per section, first-build times."""
    out = [f"# Nonlinear benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX2 {'yes' if info['avx2'] else 'no'}, AVX-512 "
           f"{', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; Python {info['python']}, torch {info['torch']}, "
           f"sparsenn {info['sparsenn']} from {info['sparsenn_tree']} at {info['git']}; {info['date']}; "
           f"load average at start {info['loadavg']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           "fp32. Medians of round-robin rounds after warm-up; ratio = alternative time / sparsenn time "
           "(> 1: sparsenn faster). Threads via torch.set_num_threads (sparsenn's kernels use "
           "torch.get_num_threads()). Softmax runs along the last mode over stored entries; torch gets the "
           "same pattern as a coalesced COO tensor. fwd+bwd = forward, then backward of a fixed output "
           f"gradient (torch: a COO gradient). torch.sparse.softmax given a CSR tensor: {csr_note}. "
           "check: sparsenn's result against torch, max |diff| <= 1e-3 x max |ref|."]
    out += sections_markdown(rows, SECTIONS)
    return "\n".join(out + first_build_table(builds)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: forward cases only, few repetitions")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "nonlinear")
    parser.add_argument("--first-build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_build:
        return run_first_build(args.first_build, specs)
    info = machine_info()
    print(json.dumps(info), flush=True)
    csr_note = torch_csr_note()
    rows = [row for section, name, build in specs(args.quick)
            for row in run_case(section, name, build, args.threads, args.quick)]
    builds = build_times(reps=1 if args.quick else 3)
    stem = "nonlinear_quick" if args.quick else "nonlinear"
    write_report(args.out, stem, markdown(info, rows, builds, csr_note, args.quick),
                 {"machine": info, "command": sys.argv, "quick": args.quick, "torch_csr_softmax": csr_note,
                  "rows": rows, "first_build": builds})


if __name__ == "__main__":
    main()
