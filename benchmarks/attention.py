"""Attention benchmark: BlockSparseAttention's attention (BigBird, 2 global + 3 window +
2 random blocks) against dense and block-sparse alternatives, fp32.

    python benchmarks/attention.py [--quick] [--threads 1 2] [--out DIR]
        [--lengths 1024 2048 4096 8192] [--batches 1 4] [--blocks 64 16]

The attention alone on projected heads (4 heads of 64; ``layer.attend(q, k, v)``), one
pattern for all heads and batch elements, against:

* dense ``scaled_dot_product_attention`` without a mask (PyTorch's fused CPU kernel);
* SDPA with the dense boolean BigBird mask (built outside the timing);
* a gather-based block-sparse attention in plain PyTorch, as HF's
  ``BigBirdBlockSparseAttention`` computes it: each non-global block row gathers its key
  and value blocks (padded to the row maximum, the padding masked), batched matmuls,
  softmax, matmul; the global rows are dense attention over every key;
* FlexAttention with a ``BlockMask`` (inference, where it runs on this torch).

Forward under no_grad, and forward+backward (``out.backward(g)`` with a fixed ``g``, the
gradients of q, k, v). Peak memory: the peak resident set of one call in a fresh
subprocess above its resident set before the call (Linux ``/proc/self/status`` VmHWM,
reset through ``/proc/self/clear_refs``), after the inputs exist and a call at the
smallest length has loaded the kernels (so it counts the call's own allocations). Timing, ratios (alternative time /
sparsenn time, > 1: sparsenn faster), machine information and first-build times as in
``structured.py``, whose helpers this script uses.

The timing process fixes glibc's mmap threshold (``structured.pin_heap_allocator``): the
gather version's time had moved between 29 and 56 ms from run to run with the allocator's
mode (its temporaries are ~28 MB at L = 4096).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: this tree's sparsenn on sys.path)

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import sparsenn
from structured import (compare, error_text, machine_info, pin_heap_allocator, run_case, sections_markdown, target,
                        write_report)

HEADS, HEAD_DIM = 4, 64
GLOBAL, WINDOW, RANDOM = 2, 3, 2
alts_missing: dict[str, str] = {}  # alternative -> why it did not run
SECTIONS = {"fwd": "Forward (inference, no_grad)", "fwdbwd": "Forward + backward (gradients of q, k, v)"}


# ----------------------------------------------------------------------------------- implementations
def make_layer(block: int) -> sparsenn.BlockSparseAttention:
    return sparsenn.BlockSparseAttention(HEADS * HEAD_DIM, HEADS, block_size=block, num_global_blocks=GLOBAL,
                                         num_window_blocks=WINDOW, num_random_blocks=RANDOM, seed=0).eval()


def inputs(batch: int, length: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, HEADS, length, HEAD_DIM, generator=g).requires_grad_(grad) for _ in range(3))


def gather_attention(pattern, block: int) -> Callable:
    """HF-style block-sparse attention in plain PyTorch for ``pattern`` (a BlockPattern)."""
    n = pattern.num_blocks
    counts = pattern.rows.diff()
    dense_rows = (counts == n).nonzero().flatten()
    sparse_rows = (counts < n).nonzero().flatten()
    width = int(counts[sparse_rows].max())
    index = torch.zeros(len(sparse_rows), width, dtype=torch.long)
    valid = torch.arange(width) < counts[sparse_rows, None]
    for i, r in enumerate(sparse_rows.tolist()):
        index[i, :counts[r]] = pattern.cols[pattern.rows[r]:pattern.rows[r + 1]]
    key_valid = valid.repeat_interleave(block, 1)[:, None, :]  # (rows, 1, width·block)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, length, d = q.shape
        blocks = lambda t: t.view(b, h, n, block, d)  # noqa: E731
        gathered = lambda t: blocks(t)[:, :, index].reshape(b, h, len(sparse_rows), width * block, d)  # noqa: E731
        qs = blocks(q)[:, :, sparse_rows] * (1 / math.sqrt(d))
        scores = (qs @ gathered(k).transpose(-1, -2)).masked_fill(~key_valid, float("-inf"))
        sparse_out = torch.softmax(scores, -1) @ gathered(v)
        dense_q = blocks(q)[:, :, dense_rows].reshape(b, h, -1, d)
        dense_out = sdpa(dense_q, k, v).view(b, h, len(dense_rows), block, d)
        out = torch.empty(b, h, n, block, d, dtype=q.dtype)
        out = out.index_copy(2, sparse_rows, sparse_out).index_copy(2, dense_rows, dense_out)
        return out.view(b, h, length, d)

    return attend


def flex_attention(block_mask: torch.Tensor, block: int, batch: int, length: int) -> Callable:
    """FlexAttention (compiled) with a BlockMask built from the block pattern."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex

    def mask_mod(b, h, q_idx, kv_idx):
        return block_mask[q_idx // block, kv_idx // block]

    mask = create_block_mask(mask_mod, None, None, length, length, device="cpu", BLOCK_SIZE=block)
    torch._dynamo.reset()  # one compiled flex per case: past Dynamo's recompile limit flex runs unfused
    compiled = torch.compile(flex)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


# ----------------------------------------------------------------------------------- cases
def step(fn: Callable, args: tuple, backward: bool) -> Callable[[], object]:
    """One call under no_grad, or forward then backward of a fixed gradient."""
    if not backward:
        def forward() -> object:
            with torch.no_grad():
                return fn(*args)
        return forward
    grad = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(1))

    def forward_backward() -> None:
        for t in args:
            t.grad = None
        fn(*args).backward(grad)
    return forward_backward


def implementations(batch: int, length: int, block: int, backward: bool) -> tuple[dict[str, Callable], tuple]:
    """Name -> attention function on (q, k, v), and the inputs."""
    layer = make_layer(block)
    pattern = layer.pattern(length)
    mask = layer.attention_mask(length)
    fns = {"sparsenn": lambda q, k, v: layer.attend(q, k, v)[0],
           "dense SDPA": lambda q, k, v: sdpa(q, k, v),
           "SDPA + bool mask": lambda q, k, v: sdpa(q, k, v, attn_mask=mask),
           "gather (HF-style)": gather_attention(pattern, block)}
    if not backward:
        fns["FlexAttention"] = flex_attention(pattern.to_dense(), block, batch, length)
    return fns, inputs(batch, length, backward)


def attention_case(batch: int, length: int, block: int, backward: bool) -> dict:
    fns, args = implementations(batch, length, block, backward)
    alts = {}
    for name, fn in list(fns.items())[1:]:
        try:
            with torch.no_grad():
                fn(*args)  # FlexAttention may not run (or compile) on this torch
            alts[name] = step(fn, args, backward)
        except Exception as error:  # noqa: BLE001 - reported in the check column
            print(f"  {name} unavailable: {error_text(error)}", flush=True)
            alts_missing[name] = error_text(error)

    def check() -> str:
        with torch.no_grad():
            ours = fns["sparsenn"](*args)
            return "; ".join(f"{n}: {compare(fns[n](*args), ours)}" for n in ("SDPA + bool mask", "gather (HF-style)"))

    layer = make_layer(block)
    nnz = layer.pattern(length).nnz * block * block * HEADS * batch
    targets = []
    if length == 4096:
        targets = [target("dense SDPA", 2)] if backward else [target("dense SDPA", 3), target("gather (HF-style)", 2)]
    return {"ours": step(fns["sparsenn"], args, backward), "alts": alts, "check": check, "nnz": nnz,
            "numel": batch * HEADS * length * length, "targets": targets}



def specs(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], dict]]]:
    out = []
    for backward in (False, True):
        for block in args.blocks:
            for batch in args.batches:
                for length in args.lengths:
                    name = f"L={length} b={batch} block={block}"
                    out.append(("fwdbwd" if backward else "fwd", name,
                                lambda L=length, B=batch, s=block, bw=backward: attention_case(B, L, s, bw)))
    return out


# ----------------------------------------------------------------------------------- memory
def peak_memory(name: str, batch: int, length: int, block: int, backward: bool, threads: int) -> float | str:
    """MiB of ru_maxrss growth of one call of ``name`` in a fresh process (see the module doc)."""
    spec = json.dumps([name, batch, length, block, backward, threads])
    done = subprocess.run([sys.executable, __file__, "--memory", spec], capture_output=True, text=True)
    if done.returncode:
        return "error: " + ((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:120])
    return float(done.stdout.strip().splitlines()[-1])


def run_memory(spec: str) -> None:
    name, batch, length, block, backward, threads = json.loads(spec)
    torch.set_num_threads(threads)
    small = (GLOBAL + WINDOW + RANDOM + 2) * block  # the shortest sparse length
    fns, args = implementations(1, small, block, backward)
    step(fns[name], args, backward)()  # load kernels and libraries
    fns, args = implementations(batch, length, block, backward)
    call = step(fns[name], args, backward)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    call()
    print((_status_kib("VmHWM") - before) / 1024)


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_table(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    rows, lines = [], []
    names = ["sparsenn", "dense SDPA", "SDPA + bool mask", "gather (HF-style)"]
    for backward in (False, True):
        block, batch = args.blocks[0], args.batches[0]
        lines += ["", f"Peak memory, {'forward+backward' if backward else 'forward'}, batch {batch}, block {block} "
                  f"(MiB of peak resident set growth in one call)", "",
                  "| L | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for length in args.lengths:
            values = {n: peak_memory(n, batch, length, block, backward, args.threads[-1]) for n in names}
            rows.append({"backward": backward, "length": length, "batch": batch, "block": block, "mib": values})
            print(f"memory {'fwd+bwd' if backward else 'fwd'} L={length}: {values}", flush=True)
            lines.append(f"| {length} | " + " | ".join(v if isinstance(v, str) else f"{v:.0f}"
                                                       for v in values.values()) + " |")
    return rows, lines


# ----------------------------------------------------------------------------------- first build
def first_build(block: int) -> dict:
    """First and second forward+backward (ms) at L = 4096, batch 1 in a fresh process with an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run([sys.executable, __file__, "--first-build", str(block)], capture_output=True,
                              text=True, env={**os.environ, "SPARSENN_CACHE_DIR": cache})
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_first_build(block: int) -> None:
    layer = make_layer(block)
    call = step(lambda q, k, v: layer.attend(q, k, v)[0], inputs(1, 4096, True), True)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"first_ms": times[0], "second_ms": times[1], "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------------- report
def markdown(info: dict, rows: list[dict], memory_lines: list[str], builds: dict, quick: bool) -> str:
    out = [f"# Attention benchmark{' (--quick)' if quick else ''}", "",
           f"CPU {info['cpu']} ({info['cores']} cores), AVX2 {'yes' if info['avx2'] else 'no'}, AVX-512 "
           f"{', '.join(info['avx512']) or 'no'}, L2 {info['l2']}; Python {info['python']}, torch {info['torch']}, "
           f"sparsenn {info['sparsenn']} from {info['sparsenn_tree']} at {info['git']}; {info['date']}; "
           f"load average at start {info['loadavg']}, at end {[round(v, 2) for v in os.getloadavg()]}; "
           f"{info['allocator']}.", "",
           f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
           f"fp32, {HEADS} heads of {HEAD_DIM}, BigBird {GLOBAL} global + {WINDOW} window + {RANDOM} random blocks. "
           "Medians of round-robin rounds after warm-up; ratio = alternative time / sparsenn time (> 1: sparsenn "
           "faster). density = stored entries (whole blocks) / L². check: sparsenn against SDPA with the same "
           "boolean mask and against the gather version, max |diff| <= 1e-3 x max |ref|."]
    if alts_missing:
        out += ["", "Unavailable: " + "; ".join(f"{k}: {v}" for k, v in alts_missing.items())]
    out += sections_markdown(rows, SECTIONS)
    out += ["", "## Peak memory", *memory_lines]
    out += ["", "## First build (fwd+bwd, L = 4096, batch 1, fresh process, empty SPARSENN_CACHE_DIR)", "",
            "| block | threads | first call ms | second call ms |", "|---|---:|---:|---:|"]
    for block, b in builds.items():
        cells = (f"| error: {b['error']} | " if "error" in b
                 else f"{b['threads']:.0f} | {b['first_ms']:.0f} | {b['second_ms']:.1f}")
        out.append(f"| {block} | {cells} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions; unless given, L 1024 and 4096, batch 1, block 64")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--blocks", type=int, nargs="+")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "attention")
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    parser.add_argument("--first-build", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        return run_memory(args.memory)
    if args.first_build:
        return run_first_build(args.first_build)
    defaults = ([1024, 4096], [1], [64]) if args.quick else ([1024, 2048, 4096, 8192], [1, 4], [64, 16])
    args.lengths, args.batches, args.blocks = (given or default for given, default in
                                               zip((args.lengths, args.batches, args.blocks), defaults))
    info = machine_info() | {"allocator": pin_heap_allocator()}
    print(json.dumps(info), flush=True)
    rows = [row for section, name, build in specs(args)
            for row in run_case(section, name, build, args.threads, args.quick)]
    memory_rows, memory_lines = memory_table(args)
    builds = {}
    for block in args.blocks:
        runs = [first_build(block) for _ in range(1 if args.quick else 2)]
        errors = [r for r in runs if "error" in r]
        builds[block] = errors[0] if errors else {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"first build block {block}: {builds[block]}", flush=True)
    stem = "attention_quick" if args.quick else "attention"  # --quick with explicit sizes: still _quick
    write_report(args.out, stem, markdown(info, rows, memory_lines, builds, args.quick),
                 {"machine": info, "command": sys.argv, "rows": rows, "memory": memory_rows, "first_build": builds,
                  "unavailable": alts_missing})


if __name__ == "__main__":
    main()
