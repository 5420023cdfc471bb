"""``python -m sparsenn``: a small end-to-end demo of the sparse einsum compiler.

Builds a random 90 %-sparse weight and a power-law graph, runs SpMM, SDDMM and SpGEMM
through generated kernels, checks each against torch, and prints timing ratios.
"""

from __future__ import annotations

import time
import warnings

import torch

import sparsenn


def _median_time(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
    torch.manual_seed(0)
    n, k = 4096, 64
    dense = torch.rand(n, n)
    dense[dense < 0.99] = 0
    A = sparsenn.from_dense(dense, format="csr")
    A_torch = dense.to_sparse_csr()
    X = torch.randn(n, k)
    Y = torch.randn(n, k)
    print(f"A: {A}")
    cases = [
        ("SpMM  A @ X", lambda: sparsenn.einsum("ij,jk->ik", A, X), lambda: A_torch @ X,
         lambda r: r, dense @ X),
        ("SDDMM A * (X Y^T)", lambda: sparsenn.einsum("ij,ik,jk->ij", A, X, Y),
         lambda: torch.sparse.sampled_addmm(A_torch, X, Y.T, beta=0.0),
         lambda r: r.to_dense(), dense * (X @ Y.T)),
        ("SpGEMM A @ A", lambda: sparsenn.einsum("ij,jk->ik", A, A),
         lambda: A_torch @ A_torch, lambda r: r.to_dense(), dense @ dense),
    ]
    for name, ours, theirs, to_dense, expected in cases:
        start = time.perf_counter()
        result = ours()
        first = time.perf_counter() - start
        error = (to_dense(result) - expected).abs().max().item()
        t_ours, t_torch = _median_time(ours), _median_time(theirs)
        print(
            f"{name:20s} max|err| {error:.1e}  first call (incl. compile) {first * 1e3:7.1f} ms  "
            f"sparsenn {t_ours * 1e3:7.3f} ms  torch {t_torch * 1e3:7.3f} ms  "
            f"speedup {t_torch / t_ours:5.2f}x"
        )
    print()
    print(sparsenn.explain("ij,jk->ik", A, A).split("generated C++:")[0])


if __name__ == "__main__":
    main()
