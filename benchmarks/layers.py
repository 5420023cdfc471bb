"""Layer benchmark: SparseLinear against dense nn.Linear and torch.sparse CSR F.linear, and
SparseGCNConv against PyG GCNConv and plain torch.sparse, forward and forward+backward.

    python benchmarks/layers.py [--quick] [--threads 1 2] [--out benchmarks/results]

Linear: 784->256 and 4096->4096 at sparsity 0.5/0.9/0.95/0.99, batch 64 and 1024.
GCN: Cora, CiteSeer (shipped in models/data/planetoid) and a synthetic power-law graph with
169,343 nodes and 1,166,243 edges (the size of ogbn-arxiv). Every method of a case runs
round-robin in each repeat (so background load hits all alike); medians after warm-up;
ratio = other method's time / sparsenn time, from the same run. First-call time (kernel
builds included) is measured in a subprocess with an empty SPARSENN_CACHE_DIR. The
calibration sweep fits a break-even line to the measured steps, to compare with the
planner's costs that ``convert(skip_slower=True)`` uses (``sparsenn.convert.predicted_speedup``).
``--quick`` is a smoke run (small sizes, Cora only, few repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from checkout import ROOT  # noqa: E402  (first: this tree's sparsenn on sys.path)
import sparsenn  # noqa: E402
from models.planetoid import load_planetoid  # noqa: E402
from sparsenn import SparseGCNConv, SparseLinear  # noqa: E402

CHECK_RTOL = 1e-4
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")

# A method builds its state for a case and returns (step(backward: bool) -> output, check() -> list of
# tensors compared with the reference: output and gradients).
Method = Callable[[], tuple[Callable[[bool], torch.Tensor], Callable[[], list[torch.Tensor]]]]


# ----------------------------------------------------------------------------------- linear
def linear_case(in_features: int, out_features: int, sparsity: float, batch: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    layer = SparseLinear(in_features, out_features, sparsity=sparsity)
    x = torch.randn(batch, in_features)
    return {"kind": "linear", "name": f"linear {in_features}->{out_features} s={sparsity} b={batch}",
            "in": in_features, "out": out_features, "sparsity": sparsity, "batch": batch, "nnz": layer.nnz,
            "layer": layer, "x": x}


def _zero_grads(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


def _run(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[bool], torch.Tensor]:
    """step(backward): forward under no_grad, or forward + out.square().mean().backward()."""
    def step(backward: bool) -> torch.Tensor:
        _zero_grads(*leaves)
        if not backward:
            with torch.no_grad():
                return forward()
        out = forward()
        out.square().mean().backward()
        return out
    return step


def linear_methods(c: dict) -> dict[str, Method]:
    layer: SparseLinear = c["layer"]
    mask = layer.mask()

    def sparsenn_() -> tuple:
        x = c["x"].clone().requires_grad_()
        step = _run(lambda: layer(x), [x, layer.weight_values, layer.bias])
        rows, cols = layer.weight.coords()[0]
        order = torch.argsort(rows * layer.in_features + cols)  # row-major, as the references report
        return step, lambda: [x.grad, layer.weight_values.grad[order], layer.bias.grad]

    def dense() -> tuple:
        linear = layer.to_dense()
        x = c["x"].clone().requires_grad_()
        step = _run(lambda: linear(x), [x, linear.weight, linear.bias])
        return step, lambda: [x.grad, linear.weight.grad[mask], linear.bias.grad]

    def torch_csr() -> tuple:
        weight = layer.to_dense().weight.detach().to_sparse_csr().requires_grad_()
        bias = layer.bias.detach().clone().requires_grad_()
        x = c["x"].clone().requires_grad_()
        step = _run(lambda: F.linear(x, weight, bias), [x, weight, bias])
        return step, lambda: [x.grad, weight.grad.to_dense()[mask], bias.grad]

    return {"sparsenn": sparsenn_, "dense nn.Linear": dense, "torch.sparse CSR F.linear": torch_csr}


def linear_reference(c: dict) -> list[torch.Tensor]:
    """float64 masked-dense output and gradients (x, kept weights row-major, bias)."""
    linear = c["layer"].to_dense().double()
    x = c["x"].double().requires_grad_()
    out = linear(x)
    out.square().mean().backward()
    return [out.detach(), x.grad, linear.weight.grad[c["layer"].mask()], linear.bias.grad]


# ----------------------------------------------------------------------------------- GCN
def planetoid(name: str):
    data = load_planetoid(name, normalize_features=False)
    return data.x, data.edge_index


def power_law_graph(num_nodes: int = 169_343, num_edges: int = 1_166_243, seed: int = 0):
    """Directed Chung-Lu graph: endpoints drawn with probability ∝ (rank + 1)^-0.75 (degrees follow a
    power law), self-loops and duplicates dropped, node ids shuffled."""
    rng = np.random.default_rng(seed)
    p = (np.arange(num_nodes) + 1.0) ** -0.75
    p /= p.sum()
    keys = np.empty(0, np.int64)
    while keys.size < num_edges:
        m = num_edges - keys.size + num_edges // 10
        s, t = rng.choice(num_nodes, m, p=p), rng.choice(num_nodes, m, p=p)
        keys = np.unique(np.concatenate([keys, (s * num_nodes + t)[s != t]]))
    keys = rng.permutation(keys)[:num_edges]
    relabel = rng.permutation(num_nodes)
    edge_index = torch.from_numpy(np.stack([relabel[keys // num_nodes], relabel[keys % num_nodes]]))
    x = torch.randn(num_nodes, 128, generator=torch.Generator().manual_seed(seed))
    return x, edge_index


def gcn_case(graph: str, quick: bool) -> dict:
    if graph == "synthetic":
        x, edge_index = power_law_graph(*((20_000, 140_000) if quick else ()))
        out_channels = 64
    else:
        x, edge_index = planetoid(graph)
        out_channels = 16
    density = float((x != 0).float().mean())
    return {"kind": "gcn", "name": f"GCN {graph} n={x.shape[0]} E={edge_index.shape[1]} {x.shape[1]}->{out_channels}",
            "x": x, "edge_index": edge_index, "in": x.shape[1], "out": out_channels, "feature_density": density}


def gcn_methods(c: dict) -> dict[str, Method]:
    from torch_geometric.nn import GCNConv

    x, edge_index = c["x"], c["edge_index"]
    torch.manual_seed(1)
    base = SparseGCNConv(c["in"], c["out"], cached=True)
    with torch.no_grad():
        base.bias.normal_()
    adjacency = base.adjacency(edge_index, None, x.shape[0], x.dtype)  # Â[target, source], CSR

    def sparsenn_() -> tuple:
        conv = SparseGCNConv(c["in"], c["out"], cached=True)
        conv.load_state_dict(base.state_dict())
        step = _run(lambda: conv(x, edge_index), [conv.weight, conv.bias])
        return step, lambda: [conv.weight.grad, conv.bias.grad]

    def sparsenn_fused() -> tuple:  # one 3-operand einsum; the contraction path picks the order
        weight = base.weight.detach().clone().requires_grad_()
        bias = base.bias.detach().clone().requires_grad_()
        step = _run(lambda: sparsenn.einsum("ts,si,oi->to", adjacency, x, weight) + bias, [weight, bias])
        return step, lambda: [weight.grad, bias.grad]

    def pyg() -> tuple:
        conv = GCNConv(c["in"], c["out"], cached=True)
        with torch.no_grad():
            conv.lin.weight.copy_(base.weight)
            conv.bias.copy_(base.bias)
        step = _run(lambda: conv(x, edge_index), [conv.lin.weight, conv.bias])
        return step, lambda: [conv.lin.weight.grad, conv.bias.grad]

    def torch_sparse() -> tuple:
        csr = adjacency.to_torch()
        weight = base.weight.detach().clone().requires_grad_()
        bias = base.bias.detach().clone().requires_grad_()
        step = _run(lambda: torch.sparse.mm(csr, x @ weight.T) + bias, [weight, bias])
        return step, lambda: [weight.grad, bias.grad]

    def sparsenn_sparse_x() -> tuple:  # bag-of-words features stored as CSR
        conv = SparseGCNConv(c["in"], c["out"], cached=True)
        conv.load_state_dict(base.state_dict())
        features = sparsenn.from_dense(x, "csr")
        step = _run(lambda: conv(features, edge_index), [conv.weight, conv.bias])
        return step, lambda: [conv.weight.grad, conv.bias.grad]

    def torch_sparse_x() -> tuple:
        csr, features = adjacency.to_torch(), x.to_sparse_csr()
        weight = base.weight.detach().clone().requires_grad_()
        bias = base.bias.detach().clone().requires_grad_()
        step = _run(lambda: torch.sparse.mm(csr, torch.sparse.mm(features, weight.T)) + bias, [weight, bias])
        return step, lambda: [weight.grad, bias.grad]

    c["reference"] = (adjacency, base)
    methods = {"sparsenn": sparsenn_, "PyG GCNConv": pyg, "torch.sparse CSR": torch_sparse,
               "sparsenn 3-operand einsum": sparsenn_fused}
    if c["feature_density"] < 0.1:
        methods.update({"sparsenn, X sparse": sparsenn_sparse_x, "torch.sparse CSR, X sparse": torch_sparse_x})
    return methods


def gcn_reference(c: dict) -> list[torch.Tensor]:
    """float64 torch.sparse COO Â (X Wᵀ) + b: output and gradients (weight, bias)."""
    adjacency, base = c["reference"]
    coo = adjacency.to_torch(torch.sparse_coo).double()
    weight = base.weight.detach().double().requires_grad_()
    bias = base.bias.detach().double().requires_grad_()
    out = torch.sparse.mm(coo, c["x"].double() @ weight.T) + bias
    out.square().mean().backward()
    return [out.detach(), weight.grad, bias.grad]


def propagation_methods(c: dict) -> dict[str, Method]:
    """The propagation step alone, ``Â H`` with ``H = X Wᵀ`` given (gradient with respect to H)."""
    from torch_geometric.nn import GCNConv

    x, edge_index = c["x"], c["edge_index"]
    torch.manual_seed(1)
    conv = SparseGCNConv(c["in"], c["out"], cached=True)
    adjacency = conv.adjacency(edge_index, None, x.shape[0], x.dtype)
    hidden = (x @ conv.weight.detach().T).contiguous()
    indices, norm = adjacency.coords()  # rows are targets, columns sources
    pyg = GCNConv(c["in"], c["out"], normalize=False)
    source_target = indices.flip(0)

    def method(propagate: Callable[[torch.Tensor], torch.Tensor]) -> Method:
        def build() -> tuple:
            h = hidden.clone().requires_grad_()
            return _run(lambda: propagate(h), [h]), lambda: [h.grad]
        return build

    csr = adjacency.to_torch()
    c["reference"] = (adjacency, hidden)
    return {"sparsenn": method(lambda h: sparsenn.einsum("ts,so->to", adjacency, h)),
            "PyG propagate": method(lambda h: pyg.propagate(source_target, x=h, edge_weight=norm)),
            "torch.sparse CSR": method(lambda h: torch.sparse.mm(csr, h))}


def propagation_reference(c: dict) -> list[torch.Tensor]:
    adjacency, hidden = c["reference"]
    h = hidden.double().requires_grad_()
    out = torch.sparse.mm(adjacency.to_torch(torch.sparse_coo).double(), h)
    out.square().mean().backward()
    return [out.detach(), h.grad]


# ----------------------------------------------------------------------------------- timing
def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def check(methods: dict[str, Method], reference: list[torch.Tensor]) -> dict[str, dict]:
    """Per method: max |got - ref| of output and gradients; ok when each <= CHECK_RTOL * max|ref|."""
    rows = {}
    for name, build in methods.items():
        step, grads = build()
        got = [step(True).detach()] + grads()
        diffs = [float((g.double() - r).abs().max()) if r.numel() else 0.0 for g, r in zip(got, reference)]
        ok = all(d <= CHECK_RTOL * (float(r.abs().max()) if r.numel() else 0.0) + 1e-12
                 for d, r in zip(diffs, reference))
        rows[name] = {"max_abs_diff": diffs, "ok": ok}
    return rows


def bench(methods: dict[str, Method], threads: list[int], repeats: int, budget_s: float) -> list[dict]:
    """Median fwd and fwd+bwd ms per (threads, method): one warm-up fwd and fwd+bwd each, then
    rounds in which every method runs once, until ``repeats`` rounds or ``budget_s`` seconds
    (at least 3 rounds)."""
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        steps = {name: build()[0] for name, build in methods.items()}
        for step in steps.values():
            for backward in (False, True):
                step(backward)
        samples = {name: ([], []) for name in steps}
        start, rounds = time.perf_counter(), 0
        while rounds < repeats and (rounds < 3 or time.perf_counter() - start < budget_s):
            for name, step in steps.items():
                samples[name][0].append(timed_ms(lambda: step(False)))
                samples[name][1].append(timed_ms(lambda: step(True)))
            rounds += 1
        for name, (fwd, fwdbwd) in samples.items():
            rows.append({"threads": nt, "method": name, "fwd_ms": statistics.median(fwd),
                         "fwdbwd_ms": statistics.median(fwdbwd), "rounds": rounds})
            print(f"    {nt}T {name:28s} fwd {rows[-1]['fwd_ms']:10.3f} ms  fwd+bwd {rows[-1]['fwdbwd_ms']:10.3f} ms",
                  flush=True)
    return rows


def first_call(kind: str) -> dict:
    """First and second fwd+bwd (ms) in a fresh process with an empty kernel cache."""
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, __file__, "--first-call", kind]
        done = subprocess.run(cmd, env={**os.environ, "SPARSENN_CACHE_DIR": cache}, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_first_call(kind: str) -> None:
    if kind == "linear":
        c = linear_case(784, 256, 0.9, 64)
        build = linear_methods(c)["sparsenn"]
    else:
        c = gcn_case("Cora", quick=True)
        build = gcn_methods(c)["sparsenn"]
    step, _ = build()
    first = timed_ms(lambda: step(True))
    second = timed_ms(lambda: step(True))
    print(json.dumps({"case": c["name"], "first_ms": first, "second_ms": second}))


# ----------------------------------------------------------------------------------- calibration
CALIBRATION_SIZES = [(64, 64), (256, 256), (784, 256), (1024, 1024), (2048, 2048)]
CALIBRATION_SPARSITIES = [0.5, 0.8, 0.9, 0.95, 0.99]


def calibrate(threads: int, repeats: int, quick: bool) -> dict:
    """Fit time = overhead + ns_per_mac * 3 * work * batch (fwd+bwd, batch 64) for dense and sparse,
    minimising relative error; work is out*in (dense) or nnz (sparse)."""
    torch.set_num_threads(threads)
    sizes = CALIBRATION_SIZES[:3] if quick else CALIBRATION_SIZES
    points = []
    for in_features, out_features in sizes:
        for sparsity in CALIBRATION_SPARSITIES:
            c = linear_case(in_features, out_features, sparsity, 64)
            methods = linear_methods(c)
            rows = bench({k: methods[k] for k in ("sparsenn", "dense nn.Linear")}, [threads], repeats, 2.0)
            t = {r["method"]: r["fwdbwd_ms"] for r in rows}
            points.append({"in": in_features, "out": out_features, "sparsity": sparsity, "nnz": c["nnz"],
                           "sparse_ms": t["sparsenn"], "dense_ms": t["dense nn.Linear"]})

    def fit(work: list[float], ms: list[float]) -> tuple[float, float]:
        """Non-negative (overhead, slope) minimising the squared relative error."""
        from scipy.optimize import nnls

        a = np.array([[1.0, w] for w in work]) / np.array(ms)[:, None]
        (overhead_ms, ms_per_mac), _ = nnls(a, np.ones(len(ms)))
        return overhead_ms * 1e3, ms_per_mac * 1e6

    dense = {(p["in"], p["out"]): p["dense_ms"] for p in points}
    d_over, d_ns = fit([3 * 64 * i * o for i, o in dense], list(dense.values()))
    s_over, s_ns = fit([3 * 64 * p["nnz"] for p in points], [p["sparse_ms"] for p in points])
    return {"threads": threads, "batch": 64, "points": points, "dense_overhead_us": d_over, "dense_ns_per_mac": d_ns,
            "sparse_overhead_us": s_over, "sparse_ns_per_mac": s_ns}


# ----------------------------------------------------------------------------------- report
def git_rev() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    import torch_geometric
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__, "sparsenn": sparsenn.__version__,
            "git_start": git_rev(), "loadavg_start": os.getloadavg()}


def markdown(info: dict, cases: list[dict], firsts: dict, calibration: dict | None, quick: bool) -> str:
    out = [f"# Layer benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores); Python {info['python']}, torch {info['torch']}, "
           f"torch-geometric {info['torch_geometric']}, sparsenn {info['sparsenn']} at {info['git_start']} "
           f"(end {info['git_end']}); load average at start {info['loadavg_start']}, at end {info['loadavg_end']}.",
           "fp32. fwd = forward under no_grad; fwd+bwd = forward, out.square().mean(), backward (linear: grads of x, "
           "weight, bias; GCN: weight, bias). Medians of interleaved rounds after warm-up. "
           "ratio = method time / sparsenn time (> 1: sparsenn faster).", "",
           "| case | threads | method | fwd ms | fwd+bwd ms | fwd ratio | fwd+bwd ratio |", "|---" * 7 + "|"]
    for c in cases:
        base = {r["threads"]: r for r in c["timings"] if r["method"] == "sparsenn"}
        for r in c["timings"]:
            b = base[r["threads"]]
            out.append(f"| {c['name']} | {r['threads']} | {r['method']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
                       f"{r['fwd_ms'] / b['fwd_ms']:.2f} | {r['fwdbwd_ms'] / b['fwdbwd_ms']:.2f} |")
    out += ["", f"Correctness against a float64 reference (masked dense linear; torch.sparse Â (X Wᵀ) + b): max abs "
            f"difference of output and gradients, ok when each is <= {CHECK_RTOL:g} x max|ref|.", "",
            "| case | method | max abs diffs | ok |", "|---" * 4 + "|"]
    for c in cases:
        for name, r in c["check"].items():
            out.append(f"| {c['name']} | {name} | {', '.join(f'{d:.1e}' for d in r['max_abs_diff'])} | {r['ok']} |")
    out += ["", "First call in a fresh process with an empty SPARSENN_CACHE_DIR (kernel builds included), fwd+bwd:", "",
            "| layer | case | first call ms | second call ms |", "|---|---|---|---|"]
    for kind, f in firsts.items():
        if "error" in f:
            out.append(f"| {kind} | error: {f['error']} | | |")
        else:
            out.append(f"| {kind} | {f['case']} | {f['first_ms']:.0f} | {f['second_ms']:.2f} |")
    if calibration is not None:
        cal = calibration
        out += ["", f"Break-even calibration (fwd+bwd, batch 64, {cal['threads']} threads): time = overhead + "
                "ns_per_mac x 3 x 64 x work (work = out x in dense, nnz sparse).", "",
                f"- dense: overhead {cal['dense_overhead_us']:.1f} µs, {cal['dense_ns_per_mac']:.4f} ns/MAC",
                f"- sparse: overhead {cal['sparse_overhead_us']:.1f} µs, {cal['sparse_ns_per_mac']:.4f} ns/MAC", "",
                "| in | out | sparsity | nnz | sparsenn ms | dense ms | dense/sparse |", "|---" * 7 + "|"]
        for p in cal["points"]:
            out.append(f"| {p['in']} | {p['out']} | {p['sparsity']} | {p['nnz']} | {p['sparse_ms']:.3f} | "
                       f"{p['dense_ms']:.3f} | {p['dense_ms'] / p['sparse_ms']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, Cora only, few repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10, help="rounds per case (fewer when over the time budget)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--no-calibration", action="store_true", help="skip the break-even sweep")
    parser.add_argument("--calibration-threads", type=int, default=1,
                        help="threads for the break-even sweep (default 1: steadier on a loaded machine)")
    parser.add_argument("--first-call", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call:
        return run_first_call(args.first_call)
    info = machine()
    print(json.dumps(info), flush=True)
    repeats = 3 if args.quick else args.repeats
    budget = 1.0 if args.quick else 20.0
    specs = [("linear", (i, o, s, b)) for i, o in ([(784, 256), (1024, 1024)] if args.quick else
                                                   [(784, 256), (4096, 4096)])
             for s in ((0.9,) if args.quick else (0.5, 0.9, 0.95, 0.99)) for b in (64, 1024)]
    graphs = ["Cora"] if args.quick else ["Cora", "CiteSeer", "synthetic"]
    specs += [(kind, g) for g in graphs for kind in ("gcn", "propagation")]
    cases = []
    for kind, spec in specs:
        if kind == "linear":
            c = linear_case(*spec)
            methods, reference = linear_methods(c), linear_reference(c)
        elif kind == "gcn":
            c = gcn_case(spec, args.quick)
            methods = gcn_methods(c)
            reference = gcn_reference(c)
        else:
            c = gcn_case(spec, args.quick)
            c["name"] = c["name"].replace("GCN", "propagation Â·H,", 1)
            methods = propagation_methods(c)
            reference = propagation_reference(c)
        print(c["name"], flush=True)
        torch.set_num_threads(max(args.threads))
        checked = check(methods, reference)
        print("    check:", {k: v["ok"] for k, v in checked.items()}, flush=True)
        cases.append({"name": c["name"], "kind": kind, "spec": spec, "check": checked,
                      "timings": bench(methods, args.threads, repeats, budget)})
    firsts = {kind: first_call(kind) for kind in ("linear", "gcn")}
    print("first call:", firsts, flush=True)
    calibration = None if args.no_calibration else calibrate(args.calibration_threads, repeats, args.quick)
    if calibration is not None:
        print("calibration:", {k: v for k, v in calibration.items() if k != "points"}, flush=True)
    info["git_end"], info["loadavg_end"] = git_rev(), os.getloadavg()
    stem = "layers_quick" if args.quick else "layers"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(markdown(info, cases, firsts, calibration, args.quick))
    (args.out / f"{stem}.json").write_text(json.dumps({"machine": info, "quick": args.quick, "cases": cases,
                                                       "first_call": firsts, "calibration": calibration}, indent=1))
    print(f"wrote {args.out / stem}.md and .json")


if __name__ == "__main__":
    main()
