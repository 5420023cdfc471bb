"""The GCN's last propagation with its bias, ``Z[t,c] = A[t,s] * H[s,c] + b[c]`` (and
``relu(...)``), on the normalised adjacency of Cora and CiteSeer with narrow outputs,
against the bare SpMM and torch.sparse (``addmm``, ``mm``) in the same run: medians of
round-robin timed calls after warm-up, 1 and 2 threads (issue 33, narrow dense outputs).

    python benchmarks/narrow_epilogue.py --graphs Cora --columns 7 16
"""

from __future__ import annotations

import argparse

import torch

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)
import sparsenn
from sweep import PLANETOID, planetoid_adjacency, round_robin_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=list(PLANETOID), choices=PLANETOID)
    parser.add_argument("--columns", nargs="+", type=int, default=[3, 7, 16])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per cell")
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args()
    bias = sparsenn.compile("Z[t,c] = A[t,s] * H[s,c] + b[c]")
    relu = sparsenn.compile("Z[t,c] = relu(A[t,s] * H[s,c] + b[c])")
    for name in args.graphs:
        a = planetoid_adjacency(name)
        csr = a.to_torch(torch.sparse_csr)
        for columns in args.columns:
            h, b = torch.randn(a.shape[1], columns), torch.randn(columns)
            calls = {"spmm": lambda: sparsenn.einsum("ij,jk->ik", a, h),
                     "bias": lambda: bias(a, h, b),
                     "relu(+bias)": lambda: relu(a, h, b),
                     "torch mm": lambda: torch.sparse.mm(csr, h),
                     "torch addmm": lambda: torch.addmm(b, csr, h),
                     "torch relu(addmm)": lambda: torch.relu(torch.addmm(b, csr, h))}
            for threads in args.threads:
                torch.set_num_threads(threads)
                with torch.no_grad():
                    for call in calls.values():
                        call()
                    ms = round_robin_ms(calls, args.budget, args.repeats)
                us = {k: 1000 * v for k, v in ms.items()}
                print(f"{name:>8} k={columns:<3} t={threads}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
                      + f" | bias/addmm {ms['torch addmm'] / ms['bias']:.2f}x, relu {ms['torch relu(addmm)'] / ms['relu(+bias)']:.2f}x,"
                      f" bias/spmm {ms['bias'] / ms['spmm']:.2f}", flush=True)


if __name__ == "__main__":
    main()
