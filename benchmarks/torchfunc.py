"""torch.func benchmark: per-sample gradients with ``vmap(grad(loss))`` and
``functional_call`` (every sparse einsum batched into one compiled kernel) against a loop
over the samples (one forward and backward each), fp32.

    python benchmarks/torchfunc.py [--quick] [--threads 1 2] [--out DIR]

1. Per-sample gradients of an MLP ``SparseLinear(784, 256)`` at 90 %, ReLU,
   ``SparseLinear(256, 10)`` at 90 % (csr), cross-entropy, batch 64 and 256: the
   gradients of both weights' values and biases for each sample. The loop is what
   Opacus-style code does without vmap: per sample, ``model(x).backward()``, keeping the
   ``.grad`` tensors it wrote. Each side is timed producing the gradients in its own form
   (vmap: a dict of per-sample tensors; the loop: each sample's ``.grad`` tensors); they
   are laid out as one matrix only to check that they agree.
2. The same MLP of dense ``nn.Linear`` layers, torch alone: what torch.func's vmap gains
   over the loop on a model torch batches natively (the reference).

Target (#36): vmap >= 5x the per-sample loop at batch 64. Timing as in ``structured.py``:
round-robin rounds after warm-up, medians, ratio = loop time / vmap time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import sparsenn
from structured import compare, machine_info, run_case, sections_markdown, target, write_report

SECTIONS = {"sparse": "1. Sparse MLP 784 -> 256 -> 10 (csr, 90 %), per-sample gradients",
            "dense": "2. Dense nn.Linear MLP, same sizes (torch only)"}


def _mlp(sparse: bool) -> nn.Module:
    torch.manual_seed(0)
    if sparse:
        return nn.Sequential(sparsenn.SparseLinear(784, 256, sparsity=0.9), nn.ReLU(),
                             sparsenn.SparseLinear(256, 10, sparsity=0.9))
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def _case(sparse: bool, batch: int, minimum: float | None) -> dict:
    """vmap(grad) of the MLP's loss against the per-sample loop, on one batch."""
    model = _mlp(sparse)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    names = list(params)

    def vmapped() -> dict[str, torch.Tensor]:
        return per_sample(params, x, y)

    def loop() -> list[list[torch.Tensor]]:
        rows = []
        for n in range(batch):
            model.zero_grad(set_to_none=True)  # each sample's backward writes fresh .grad tensors
            nn.functional.cross_entropy(model(x[n:n + 1]), y[n:n + 1]).backward()
            rows.append([p.grad for p in model.parameters()])
        return rows

    def matrix(per_parameter: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(batch, -1) for g in per_parameter], 1)

    def check() -> str:
        grads = vmapped()
        return compare(matrix([grads[k] for k in names]), matrix([torch.stack(g) for g in zip(*loop())]))

    return {"ours": vmapped, "alts": {"loop": loop}, "check": check,
            "nnz": 1, "numel": 1, "targets": [] if minimum is None else [target("loop", minimum)]}


def specs(quick: bool) -> list[tuple[str, str, Callable[[], dict]]]:
    out = [("sparse", "batch 64", lambda: _case(True, 64, 5.0)),
           ("dense", "batch 64 (torch only)", lambda: _case(False, 64, None))]
    if not quick:
        out += [("sparse", "batch 256", lambda: _case(True, 256, None)),
                ("dense", "batch 256 (torch only)", lambda: _case(False, 256, None))]
    return out


def markdown(info: dict, rows: list[dict], quick: bool) -> str:
    out = [f"# torch.func benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX-512 {', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; "
           f"Python {info['python']}, torch {info['torch']}, sparsenn {info['sparsenn']} at {info['git']}; "
           f"{info['date']}; load average at start {info['loadavg']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           "fp32. 'sparsenn' is vmap(grad(loss)) with functional_call (per-sample gradients of every parameter); "
           "'loop' one forward and backward per sample; ratio = loop / vmap."]
    out += sections_markdown(rows, SECTIONS)
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 64 only")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "torchfunc")
    args = parser.parse_args()
    info = machine_info()
    print(json.dumps(info), flush=True)
    rows = [row for section, name, build in specs(args.quick)
            for row in run_case(section, name, build, args.threads, args.quick)]
    stem = "torchfunc_quick" if args.quick else "torchfunc"
    write_report(args.out, stem, markdown(info, rows, args.quick), {"machine": info, "command": sys.argv, "rows": rows})


if __name__ == "__main__":
    main()
