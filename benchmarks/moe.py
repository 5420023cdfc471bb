"""Mixture-of-experts benchmark: sparsenn.SparseMoE against a dense all-experts einsum, a
per-expert loop in plain PyTorch and torch._grouped_mm, fp32.

    python benchmarks/moe.py [--quick] [--threads 1 2] [--out DIR]

d_model 512, d_hidden 2048, 4096 tokens, E in {8, 64} experts, top-k in {1, 2}, gelu, no
bias, dropless. Every implementation runs the same SparseMoEGate (router, softmax, top-k)
and then the experts:

* sparsenn: SparseMoE.forward (dispatch into expert panels, then the gather, the two expert
  products and the weighted scatter as compiled kernels);
* dense all-experts: every expert on every token, ``einsum("td,edh->eth")``, gelu, ``bmm``,
  then weighted by the dense gate (``einsum("te,etd->td")``);
* per-expert loop: HF Mixtral's eager path (one-hot expert mask, ``torch.where`` per expert
  hit, ``mm`` with the stacked weights indexed per expert, weight, ``index_add``);
* loop, unbind: the same with the stacked weights split once per call (``unbind``), whose
  backward does not add a full-size zero gradient per expert;
* torch._grouped_mm: tokens sorted by expert, two grouped GEMMs with ``offs``, weight,
  ``index_add``.

fwd runs under no_grad; fwd+bwd = zero_grad, forward, backward of a fixed output gradient
(gradients of the input, router and expert weights). Every alternative runs round-robin in
the same rounds (medians after warm-up); ratio = alternative time / sparsenn time (> 1:
sparsenn faster). GFLOP/s counts the routed pairs only: 4·T·k·d·h per forward, 3x that for
fwd+bwd. Targets: dense all-experts >= 0.8·E/k, each loop >= 1.2. The forward
breakdown times each stage of sparsenn's forward alone (same rounds scheme).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import torch
import torch.nn.functional as F

import sparsenn
from sparsenn.compiler import einsum
from sparsenn.layers.moe import dispatch
from structured import compare, error_text, fmt_targets, machine_info, median_times, target, write_report

D_MODEL, D_HIDDEN, TOKENS = 512, 2048, 4096
FIRST_PRODUCT = sparsenn.compile("A[e,c,h] = gelu(R[e,c] * X[e,c,d] * W[e,d,h])", out_format="dense")
Forward = Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------- implementations
def dense_gates(gates: sparsenn.SparseTensor) -> torch.Tensor:
    """The gate as a dense (T, E) tensor, differentiable w.r.t. its values."""
    rows = torch.repeat_interleave(torch.arange(gates.shape[0]), gates.pos[1].long().diff())
    return gates.values.new_zeros(gates.shape).index_put((rows, gates.crd[1].long()), gates.values)


def dense_all(layer: sparsenn.SparseMoE) -> Forward:
    """Every expert on every token, weighted by the gate."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        g = dense_gates(layer.gate(x).gates)
        hidden = F.gelu(torch.einsum("td,edh->eth", x, layer.w1))
        return torch.einsum("te,etd->td", g, torch.bmm(hidden, layer.w2))
    return forward


def routing(layer: sparsenn.SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), both (T, k), of a dropless gate."""
    gates = layer.gate(x).gates
    return gates.values.view(-1, layer.k), gates.crd[1].long().view(-1, layer.k)


def expert_loop(layer: sparsenn.SparseMoE, unbind: bool) -> Forward:
    """HF Mixtral's eager MoE: a loop over the experts that received tokens, indexing the
    stacked weights per expert (``unbind``: split them once per call instead, so the
    backward stacks the experts' gradients once rather than adding a full-size zero
    gradient per expert)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, experts = routing(layer, x)
        w1, w2 = (layer.w1.unbind(0), layer.w2.unbind(0)) if unbind else (layer.w1, layer.w2)
        mask = F.one_hot(experts, layer.num_experts).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
            slot, token = torch.where(mask[e])
            y = F.gelu(x[token] @ w1[e]) @ w2[e] * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out
    return forward


def grouped_mm(layer: sparsenn.SparseMoE) -> Forward:
    """Tokens sorted by expert, two torch._grouped_mm calls."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weights, experts = routing(layer, x)
        order = torch.sort(experts.flatten(), stable=True).indices
        token = order // layer.k
        offs = torch.cumsum(torch.bincount(experts.flatten(), minlength=layer.num_experts), 0).int()
        hidden = F.gelu(torch._grouped_mm(x[token], layer.w1, offs=offs))
        y = torch._grouped_mm(hidden, layer.w2, offs=offs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, token, y)
    return forward


def step(layer: sparsenn.SparseMoE, forward: Forward, x: torch.Tensor,
         grad: torch.Tensor | None) -> Callable[[], object]:
    """One forward under no_grad (grad None), or zero_grad + forward + backward of grad."""
    if grad is None:
        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return forward(x)
        return fwd
    x = x.clone().requires_grad_()

    def fwd_bwd() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        forward(x).backward(grad)
    return fwd_bwd


def breakdown(layer: sparsenn.SparseMoE, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each stage of SparseMoE's forward, on the stage inputs computed once; the first
    product with the gelu as its epilogue (as the layer runs it without autograd), and
    for reference the product and torch's gelu apart."""
    with torch.no_grad():
        gates = layer.gate(x).gates
        plan = dispatch(gates)
        shape = (layer.num_experts, plan.capacity)
        panels = einsum("st,td->sd", plan.gather, x).view(*shape, D_MODEL)
        hidden = einsum("ec,ecd,edh->ech", plan.slots, panels, layer.w1, out_format="dense")
        act = F.gelu(hidden)
        out = einsum("ec,ech,ehd->ecd", plan.slots, act, layer.w2, out_format="dense").view(-1, D_MODEL)
    stages = {"gate": lambda: layer.gate(x), "dispatch": lambda: dispatch(gates),
              "gather": lambda: einsum("st,td->sd", plan.gather, x),
              "W1 product": lambda: einsum("ec,ecd,edh->ech", plan.slots, panels, layer.w1, out_format="dense"),
              "gelu": lambda: F.gelu(hidden),
              "W1 product + gelu": lambda: FIRST_PRODUCT(plan.slots, panels, layer.w1),
              "W2 product": lambda: einsum("ec,ech,ehd->ecd", plan.slots, act, layer.w2, out_format="dense"),
              "combine": lambda: einsum("ts,sd->td", plan.combine, out)}
    return {name: (lambda f=f: torch.no_grad()(f)()) for name, f in stages.items()}


# ----------------------------------------------------------------------------------- cases
def build(experts: int, k: int, backward: bool) -> dict:
    torch.manual_seed(0)
    layer = sparsenn.SparseMoE(D_MODEL, D_HIDDEN, experts, k=k)
    x = torch.randn(TOKENS, D_MODEL)
    grad = torch.randn(TOKENS, D_MODEL) if backward else None
    impls = {"sparsenn": layer.forward, "dense all-experts": dense_all(layer),
             "per-expert loop": expert_loop(layer, unbind=False), "loop, unbind": expert_loop(layer, unbind=True),
             "torch._grouped_mm": grouped_mm(layer)}
    with torch.no_grad():
        capacity = dispatch(layer.gate(x).gates).capacity
    return {"layer": layer, "x": x, "fns": {name: step(layer, f, x, grad) for name, f in impls.items()},
            "impls": impls, "flops": 4.0 * TOKENS * k * D_MODEL * D_HIDDEN * (3 if backward else 1),
            "padding": experts * capacity / (TOKENS * k),
            "targets": [target("dense all-experts", 0.8 * experts / k), target("per-expert loop", 1.2),
                        target("loop, unbind", 1.2)]}


def check(case: dict) -> str:
    """sparsenn's forward against each alternative's."""
    with torch.no_grad():
        ours = case["impls"]["sparsenn"](case["x"])
        parts = []
        for name, f in case["impls"].items():
            if name != "sparsenn":
                try:
                    parts.append(f"{name} {compare(ours, f(case['x']))}")
                except Exception as error:  # noqa: BLE001 - recorded in the table
                    parts.append(f"{name} failed: {error_text(error)}")
    return "; ".join(parts)


def specs(quick: bool) -> list[tuple[int, int, bool]]:
    """(experts, k, backward) of every case, in report order."""
    if quick:
        return [(8, 2, False), (8, 2, True)]
    return [(e, k, b) for e in (8, 64) for k in (1, 2) for b in (False, True)]


def case_name(experts: int, k: int, backward: bool) -> str:
    return f"E={experts} k={k} {'fwd+bwd' if backward else 'fwd'}"


def run(experts: int, k: int, backward: bool, threads: list[int], quick: bool) -> list[dict]:
    """Time one case at every thread count (plus the forward breakdown); one 'unavailable'
    row if building it fails."""
    base = {"case": case_name(experts, k, backward), "experts": experts, "k": k, "backward": backward}
    try:
        case = build(experts, k, backward)
    except Exception as error:  # noqa: BLE001 - one failing case must not stop the others
        print(f"{base['case']}: unavailable: {error_text(error)}", flush=True)
        return [{**base, "unavailable": error_text(error)}]
    base.update(check=check(case), padding=case["padding"])
    reps = (0.2, 3, 2) if quick else (1.0, 10, 3 if experts > 8 else 5)
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        ms = {name: v * 1e3 for name, v in median_times(case["fns"], *reps).items()}
        stages = {} if backward else {n: v * 1e3 for n, v in median_times(breakdown(case["layer"], case["x"]),
                                                                              *reps).items()}
        ratios = {name: v / ms["sparsenn"] for name, v in ms.items() if name != "sparsenn"}
        row = {**base, "threads": torch.get_num_threads(), "ms": ms, "ratios": ratios, "stages_ms": stages,
               "gflops": case["flops"] / ms["sparsenn"] * 1e-6,
               "targets": [dict(tg, value=ratios[tg["vs"]], met=ratios[tg["vs"]] >= tg["min"])
                           for tg in case["targets"]]}
        rows.append(row)
        print(f"{base['case']:18s} t={t} " + "  ".join(f"{n} {v:.1f}" for n, v in ms.items())
              + f"  {fmt_targets(row)}  check {base['check']}", flush=True)
    return rows


# ----------------------------------------------------------------------------------- first build
BUILD_SPEC = (8, 2, True)


def first_build() -> dict:
    """First and second fwd+bwd call (ms) of sparsenn in a fresh process with an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run([sys.executable, __file__, "--first-build"], capture_output=True, text=True,
                              env={**os.environ, "SPARSENN_CACHE_DIR": cache})
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_first_build() -> None:
    """Subprocess side of first_build: print the first/second call times as JSON."""
    ours = build(*BUILD_SPEC)["fns"]["sparsenn"]
    times = []
    for _ in range(2):
        start = time.perf_counter()
        ours()
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"first_ms": times[0], "second_ms": times[1], "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------------- report
ALTS = ["dense all-experts", "per-expert loop", "loop, unbind", "torch._grouped_mm"]
STAGES = ["gate", "dispatch", "gather", "W1 product", "gelu", "W1 product + gelu", "W2 product", "combine"]
LAYER_STAGES = ["gate", "dispatch", "gather", "W1 product + gelu", "W2 product", "combine"]  # what forward runs


def table(rows: list[dict]) -> list[str]:
    head = (["case", "threads", "sparsenn ms"] + [f"{a} ms" for a in ALTS] + [f"{a} / sparsenn" for a in ALTS]
            + ["sparsenn GFLOP/s", "panel padding", "targets", "met"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 3) + "---|---|"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['case']} | | unavailable: {r['unavailable']} |" + " |" * (len(head) - 3))
            continue
        met = all(t["met"] for t in r["targets"])
        cells = ([r["case"], str(r["threads"]), f"{r['ms']['sparsenn']:.1f}"] + [f"{r['ms'][a]:.1f}" for a in ALTS]
                 + [f"{r['ratios'][a]:.2f}" for a in ALTS]
                 + [f"{r['gflops']:.1f}", f"{r['padding']:.2f}", fmt_targets(r), "yes" if met else "no"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def stage_table(rows: list[dict]) -> list[str]:
    lines = ["| case | threads | " + " | ".join(f"{s} ms" for s in STAGES) + " | sum ms | W1 GFLOP/s | W2 GFLOP/s |",
             "|---|" + "---:|" * (len(STAGES) + 4)]
    for r in rows:
        if not r.get("stages_ms"):
            continue
        s, flops = r["stages_ms"], 2.0 * TOKENS * r["k"] * D_MODEL * D_HIDDEN
        lines.append(f"| {r['case']} | {r['threads']} | " + " | ".join(f"{s[n]:.1f}" for n in STAGES)
                     + f" | {sum(s[n] for n in LAYER_STAGES):.1f} | {flops / s['W1 product'] * 1e-6:.1f} | "
                       f"{flops / s['W2 product'] * 1e-6:.1f} |")
    return lines


def markdown(info: dict, rows: list[dict], build_ms: dict, quick: bool) -> str:
    checks = dict.fromkeys(f"{r['case']}: {r['check']}" for r in rows if "check" in r)
    out = [f"# MoE benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX2 {'yes' if info['avx2'] else 'no'}, AVX-512 "
           f"{', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; Python {info['python']}, torch {info['torch']}, "
           f"sparsenn {info['sparsenn']} from {info['sparsenn_tree']} at {info['git']}; {info['date']}; "
           f"load average at start {info['loadavg']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           f"fp32, d_model {D_MODEL}, d_hidden {D_HIDDEN}, {TOKENS} tokens, gelu, dropless. Medians of round-robin "
           "rounds after warm-up; ratio = alternative time / sparsenn time (> 1: sparsenn faster). GFLOP/s over "
           "the routed pairs only. Panel padding: E·C / (T·k), the allocated panel rows per routed pair "
           "(C: the most tokens of one expert).", "", "## Times", "", *table(rows), "",
           "## sparsenn forward by stage (each stage alone)", "",
           "The layer's forward (no autograd) runs the W1 product with the gelu as its epilogue; the product and "
           "torch's gelu apart are for reference. Sum: the stages the forward runs.", "", *stage_table(rows), "",
           "## Checks (sparsenn's forward against each alternative, max |diff| <= 1e-3 x max |ref|)", "",
           *[f"- {c}" for c in checks], "",
           "## First build (fwd+bwd E=8 k=2, fresh process, empty SPARSENN_CACHE_DIR)", ""]
    out.append(f"error: {build_ms['error']}" if "error" in build_ms else
               f"first call {build_ms['first_ms']:.0f} ms, second {build_ms['second_ms']:.0f} ms "
               f"({build_ms['threads']} threads)")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: E=8, k=2 only, few repetitions")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "moe")
    parser.add_argument("--first-build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_build:
        return run_first_build()
    info = machine_info()
    print(json.dumps(info), flush=True)
    rows = [row for spec in specs(args.quick) for row in run(*spec, args.threads, args.quick)]
    build_ms = first_build()
    print(f"first build: {build_ms}", flush=True)
    stem = "moe_quick" if args.quick else "moe"
    write_report(args.out, stem, markdown(info, rows, build_ms, args.quick),
                 {"machine": info, "command": sys.argv, "quick": args.quick, "rows": rows, "first_build": build_ms})


if __name__ == "__main__":
    main()
