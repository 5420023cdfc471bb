"""Autograd benchmark: sparsenn vs torch.sparse vs dense / PyG, forward and forward+backward, on a
90 %-sparse linear layer (x @ W^T) and GCN propagation A @ (X W) (Cora, synthetic R-MAT graph).
Usage: ``python benchmarks/autograd.py [--quick]``."""
import argparse, json, os, platform, statistics, subprocess, sys, tempfile, time  # noqa: E401

import numpy as np
import torch
import torch.nn.functional as F

from checkout import ROOT  # noqa: E402  (first: this tree's sparsenn on sys.path)
import sparsenn  # noqa: E402
from models.planetoid import load_planetoid  # noqa: E402

SEED, RTOL = 0, 1e-3


# ------------------------------------------------------------------------- cases
def linear_case(quick):
    """Dense-with-zeros W (n x n, 90 % zeros) and input x (b x n)."""
    n, b = (1024, 64) if quick else (4096, 256)
    g = torch.Generator().manual_seed(SEED)
    wd = torch.randn(n, n, generator=g) * (torch.rand(n, n, generator=g) >= 0.9)
    return {"name": f"linear {n}x{n} 90% sparse, batch {b}", "kind": "linear",
            "wd": wd, "x": torch.randn(b, n, generator=g)}


def rmat(scale, m, seed=SEED, p=(0.45, 0.22, 0.22, 0.11)):
    """Symmetric R-MAT edge_index without self loops or isolated nodes: (num_nodes, edge_index)."""
    rng = np.random.default_rng(seed)
    src, dst = np.zeros(m, np.int64), np.zeros(m, np.int64)
    for _ in range(scale):
        q = rng.choice(4, size=m, p=p)
        src, dst = 2 * src + (q >> 1), 2 * dst + (q & 1)
    keep = src != dst
    s, d = np.concatenate([src[keep], dst[keep]]), np.concatenate([dst[keep], src[keep]])
    key = np.unique(s * (1 << scale) + d)
    ids, inv = np.unique(np.concatenate([key >> scale, key & ((1 << scale) - 1)]), return_inverse=True)
    return len(ids), torch.from_numpy(inv.reshape(2, -1))


def gcn_case(graph):
    """Normalised adjacency D^-1/2 (A+I) D^-1/2 as (row, col, norm), features X and W shape."""
    if graph == "cora":
        data = load_planetoid("Cora", normalize_features=False)
        n, ei, x, hidden = data.num_nodes, data.edge_index, data.x, 16
    else:
        n, ei = rmat(17, 520_000)
        x, hidden = torch.randn(n, 128, generator=torch.Generator().manual_seed(SEED)), 64
    loops = torch.arange(n).repeat(2, 1)
    ei = torch.sparse_coo_tensor(torch.cat([ei, loops], 1), torch.ones(ei.shape[1] + n), (n, n)).coalesce()
    row, col = ei.indices()
    dinv = torch.bincount(row, minlength=n).float().pow(-0.5)
    return {"name": f"GCN {graph} n={n} nnz={row.numel()} X {n}x{x.shape[1]} W {x.shape[1]}x{hidden}",
            "kind": "gcn", "n": n, "row": row, "col": col, "norm": dinv[row] * dinv[col], "x": x,
            "w": torch.randn(x.shape[1], hidden, generator=torch.Generator().manual_seed(SEED + 1)) * 0.1}


# ------------------------------------------------------------------------- methods
# Each builder returns (forward(), leaves, grad_of_leaves()) with leaves fresh parameters.
def leaf(t, dtype=torch.float32):
    """A fresh leaf copy of t that requires grad."""
    return t.detach().to(dtype, copy=True).requires_grad_()


def linear_methods(c):
    wd, mask = c["wd"], c["wd"] != 0

    def sparsenn_(_):
        W = sparsenn.from_dense(wd, format="csr")
        x, v = leaf(c["x"]), torch.nn.Parameter(W.values.clone())
        return lambda: sparsenn.einsum("bi,oi->bo", x, W.with_values(v)), [x, v], lambda: [x.grad, v.grad]

    def torch_sparse(layout):
        def build(_):
            W = (wd.to_sparse().coalesce() if layout == "coo" else wd.to_sparse_csr()).requires_grad_()
            x = leaf(c["x"])
            return lambda: torch.sparse.mm(W, x.T).T, [x, W], lambda: [x.grad, W.grad.to_dense()[mask]]
        return build

    def dense(dtype):
        def build(_):
            x, W = leaf(c["x"], dtype), leaf(wd, dtype)
            return lambda: F.linear(x, W), [x, W], lambda: [x.grad, W.grad[mask]]
        return build

    return {"sparsenn": sparsenn_, "torch.sparse COO": torch_sparse("coo"),
            "torch.sparse CSR": torch_sparse("csr"), "dense F.linear": dense(torch.float32)}, dense(torch.float64)


def gcn_methods(c):
    n, row, col, norm, x = c["n"], c["row"], c["col"], c["norm"], c["x"]

    def make(spmm):
        def build(dtype):
            w, xx = leaf(c["w"], dtype), x.to(dtype)
            return lambda: spmm(xx @ w, dtype), [w], lambda: [w.grad]
        return build

    A = sparsenn.from_edge_index(torch.stack([row, col]), num_nodes=n, values=norm, format="csr")
    coo = torch.sparse_coo_tensor(torch.stack([row, col]), norm, (n, n)).coalesce()
    csr = coo.to_sparse_csr()
    from torch_geometric.utils import scatter
    ref = (lambda xw, d: coo.to_dense().to(d) @ xw) if n <= 20_000 else (lambda xw, d: coo.to(d) @ xw)
    return {"sparsenn": make(lambda xw, d: sparsenn.einsum("ij,jk->ik", A, xw)),
            "torch.sparse COO": make(lambda xw, d: torch.sparse.mm(coo, xw)),
            "torch.sparse CSR": make(lambda xw, d: torch.sparse.mm(csr, xw)),
            "PyG scatter": make(lambda xw, d: scatter(norm.to(d)[:, None] * xw[col], row, 0, dim_size=n)),
            }, make(ref)


def build_methods(c):
    return linear_methods(c) if c["kind"] == "linear" else gcn_methods(c)


def step(fwd, leaves, backward):
    """One timed iteration: forward (no_grad if not backward) or forward+backward."""
    for t in leaves:
        t.grad = None
    if not backward:
        with torch.no_grad():
            return fwd()
    out = fwd()
    (out ** 2).mean().backward()
    return out


def err(exc):
    return f"{type(exc).__name__}: {exc}"[:300]


def timed_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def check(c, methods, ref_builder):
    """Max abs diff of out and grads of each method vs a float64 reference; ok if <= RTOL * max|ref|."""
    fwd, leaves, grads = ref_builder(torch.float64)
    ref = [step(fwd, leaves, True).detach()] + grads()
    rows = {}
    for name, builder in methods.items():
        try:
            fwd, leaves, grads = builder(torch.float32)
            got = [step(fwd, leaves, True).detach()] + grads()
            diffs = [float((g.double() - r).abs().max()) for g, r in zip(got, ref)]
            ok = all(d <= RTOL * float(r.abs().max()) for d, r in zip(diffs, ref))
            rows[name] = {"max_abs_diff": diffs, "ok": ok}
        except Exception as exc:  # record and continue
            rows[name] = {"error": err(exc)}
    return rows


def bench_case(c, threads, repeats):
    """Median fwd and fwd+bwd times; methods run round-robin per repeat so background load hits all alike."""
    methods, ref_builder = build_methods(c)
    res = {"case": c["name"], "check": check(c, methods, ref_builder), "timings": []}
    for nt in threads:
        torch.set_num_threads(nt)
        runs, rows = {}, {name: {"threads": nt, "method": name, "fwd_samples_ms": [], "fwdbwd_samples_ms": []}
                          for name in methods}
        for name, builder in methods.items():
            try:
                fwd, leaves, _ = builder(torch.float32)
                for _ in range(2):  # warm-up (builds sparsenn kernels on first use)
                    step(fwd, leaves, False), step(fwd, leaves, True)
                runs[name] = (fwd, leaves)
            except Exception as exc:
                rows[name]["error"] = err(exc)
        for _ in range(repeats):
            for name, (fwd, leaves) in list(runs.items()):
                try:
                    rows[name]["fwd_samples_ms"].append(timed_ms(lambda: step(fwd, leaves, False)))
                    rows[name]["fwdbwd_samples_ms"].append(timed_ms(lambda: step(fwd, leaves, True)))
                except Exception as exc:
                    rows[name]["error"] = err(exc)
                    del runs[name]
        for name, row in rows.items():
            if "error" not in row:
                row["fwd_ms"] = statistics.median(row["fwd_samples_ms"])
                row["fwdbwd_ms"] = statistics.median(row["fwdbwd_samples_ms"])
            res["timings"].append(row)
            print(f"  {nt}T {name:18s} " + (f"fwd {row['fwd_ms']:9.2f} ms  fwd+bwd {row['fwdbwd_ms']:9.2f} ms"
                                             if "error" not in row else row["error"]), flush=True)
    return res


def first_call(case_key, quick):
    """In a subprocess with an empty SPARSENN_CACHE_DIR: sparsenn first and second fwd+bwd (ms)."""
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, __file__, "--first-call", case_key] + (["--quick"] if quick else [])
        p = subprocess.run(cmd, env={**os.environ, "SPARSENN_CACHE_DIR": cache}, capture_output=True, text=True)
        if p.returncode:
            return {"error": p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else f"rc {p.returncode}"}
        return json.loads(p.stdout.strip().splitlines()[-1])


def make_case(key, quick):
    return linear_case(quick) if key == "linear" else gcn_case(key)


def run_first_call(key, quick):
    fwd, leaves, _ = build_methods(make_case(key, quick))[0]["sparsenn"](torch.float32)
    first, second = (timed_ms(lambda: step(fwd, leaves, True)) for _ in range(2))
    print(json.dumps({"first_ms": first, "second_ms": second}))


# ------------------------------------------------------------------------- report
def git_rev():
    """Current sparsenn checkout (commit, '-dirty' if the tree has changes)."""
    cmd = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or "unknown"


def machine_info():
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "sparsenn": sparsenn.__version__, "loadavg_start": os.getloadavg(), "git_start": git_rev()}


def fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def markdown(info, results, quick):
    out = [f"# Autograd benchmark{' (--quick)' if quick else ''}", "",
           f"CPU: {info['cpu']}, {info['cores']} cores; torch {info['torch']}; python {info['python']}; load average "
           f"(1/5/15 min) at start {info['loadavg_start']}, at end {info['loadavg_end']}.",
           f"sparsenn checkout at start {info['git_start']}, at end {info['git_end']} (first-call subprocesses "
           "import the checkout of their time).",
           "Median of repeats (methods interleaved round-robin) after 2 warm-up iterations; fwd = forward under "
           "no_grad; fwd+bwd = forward, (out**2).mean(), backward. Ratio = alternative time / sparsenn time "
           "(> 1: sparsenn faster).", "",
           "| case | threads | method | fwd ms | fwd+bwd ms | fwd ratio | fwd+bwd ratio |", "|---" * 7 + "|"]
    for r in results:
        base = {t["threads"]: t for t in r["timings"] if t["method"] == "sparsenn" and "error" not in t}
        for t in r["timings"]:
            if "error" in t:
                out.append(f"| {r['case']} | {t['threads']} | {t['method']} | error: {t['error']} | | | |")
                continue
            b = base.get(t["threads"])
            ratio = lambda k: fmt(t[k] / b[k]) if b else "—"  # noqa: E731
            out.append(f"| {r['case']} | {t['threads']} | {t['method']} | {fmt(t['fwd_ms'])} | "
                       f"{fmt(t['fwdbwd_ms'])} | {ratio('fwd_ms')} | {ratio('fwdbwd_ms')} |")
    out += ["", "Correctness vs float64 reference (dense; torch.sparse float64 for graphs > 20k nodes): "
            f"max abs diff of [out, grads...]; ok if each <= {RTOL:g} x max|ref|.", "",
            "| case | method | max abs diffs | ok |", "|---" * 4 + "|"]
    for r in results:
        for name, c in r["check"].items():
            cell = c.get("error") or ", ".join(f"{d:.2e}" for d in c["max_abs_diff"])
            out.append(f"| {r['case']} | {name} | {cell} | {c.get('ok', False)} |")
    out += ["", "sparsenn first call (fresh empty SPARSENN_CACHE_DIR, subprocess, compile included), fwd+bwd:", "",
            "| case | first call ms | second call ms |", "|---|---|---|"]
    for r in results:
        f = r["first_call"]
        out.append(f"| {r['case']} | {f.get('error') or fmt(f.get('first_ms'), '.0f')} | {fmt(f.get('second_ms'))} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, Cora only (smoke run)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats (>= 10 recommended)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--first-call", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_call:
        return run_first_call(args.first_call, args.quick)
    repeats = max(args.repeats, 1)
    info = machine_info()
    print(json.dumps(info))
    results = []
    for key in ["linear", "cora"] + ([] if args.quick else ["synthetic"]):
        c = make_case(key, args.quick)
        print(c["name"], flush=True)
        res = bench_case(c, [int(t) for t in args.threads.split(",")], repeats)
        res["first_call"] = first_call(key, args.quick)
        print("  first call:", res["first_call"], flush=True)
        results.append(res)
    info["loadavg_end"], info["git_end"] = os.getloadavg(), git_rev()
    text = markdown(info, results, args.quick)
    print(text)
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "autograd_quick" if args.quick else "autograd"
    (out_dir / f"{stem}.md").write_text(text)
    raw = {"machine": info, "quick": args.quick, "repeats": repeats, "results": results}
    (out_dir / f"{stem}.json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
