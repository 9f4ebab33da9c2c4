"""Token scaling of one MoE layer (router included), forward + backward, bf16, under "recompute": how many tokens
one GPU trains in one step, and at what rate. The scale point (d, h, E, K) = (1024, 4096, 8, 2) at T = 2,097,152,
then T grown until the step runs out of memory (benchmarks/RESULTS.md, "Token scaling and the largest T").

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots).

    python benchmarks/scale_device.py OUTDIR [--tokens 2097152] [--max-tokens N] [--policy recompute]
        [--sweep T1,T2,...] [--bisect LO,HI,STEP] [--name scale]

Per T: median step time of 3 (after 1 warm-up), peak memory above the step's start (parameters, their
gradients' first allocation and the inputs are allocated before), TFLOP/s (18·T·K·d·h). ``--sweep``: exactly these
T, in order, stopping at the first that runs out of memory. ``--bisect LO,HI,STEP``: the largest T that fits,
LO fitting and HI not, to within STEP tokens (T a multiple of STEP); each probe runs in a fresh process, so an
earlier probe's out-of-memory leaves no fragments in the allocator. Writes OUTDIR/NAME.json and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import route
from moeblaze_fx.ops import moe_ffn


def step_fn(T, d, h, E, K, policy, dev, dt):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, d, device=dev, dtype=dt, generator=g).requires_grad_()
    gy = torch.randn(T, d, device=dev, dtype=dt, generator=g)
    wr = (torch.randn(E, d, device=dev, generator=g) / d**0.5).to(dt).requires_grad_()
    wgu = (torch.randn(E, 2 * h, d, device=dev, generator=g) / d**0.5).to(dt).requires_grad_()
    wd = (torch.randn(E, d, h, device=dev, generator=g) / h**0.5).to(dt).requires_grad_()
    leaves = [x, wr, wgu, wd]

    def step():
        for t in leaves:
            t.grad = None
        ids, w = route(x, wr, K)
        y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=policy)
        y.backward(gy)

    return step, leaves


def measure(T, d, h, E, K, policy, dev, dt):
    step, leaves = step_fn(T, d, h, E, K, policy, dev, dt)
    t0 = time.time()
    step()  # warm-up (autotuning at the first call of a shape)
    torch.cuda.synchronize()
    first = time.time() - t0
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    peak = torch.cuda.max_memory_allocated() - start
    ms = statistics.median(times)
    return dict(T=T, ms=round(ms, 2), tflops=round(18 * T * K * d * h / ms / 1e9, 1), peak_gb=round(peak / 1e9, 2),
                first_step_s=round(first, 1), status="ok")


def bisect(args) -> int:
    """The largest T in [LO, HI) that fits, to within STEP: each probe is this script with ``--sweep T`` in a fresh
    process; writes OUTDIR/NAME.json with every probe's row."""
    import subprocess

    lo, hi, step = (int(v) for v in args.bisect.split(","))
    rows = []

    def probe(T):
        name = f"{args.name}_probe_{T}"
        cmd = [sys.executable, os.path.abspath(__file__), args.out, "--sweep", str(T), "--name", name,
               "--policy", args.policy, "--shape", args.shape]
        if args.token_major_combine:
            cmd.append("--token-major-combine")
        subprocess.run(cmd, check=True)
        with open(os.path.join(args.out, f"{name}.json")) as f:
            got = json.load(f)
        rows.extend(got["rows"])
        return got["meta"], got["rows"][0]["status"] == "ok"

    meta, ok = probe(lo)
    if not ok:
        raise SystemExit(f"--bisect: LO = {lo} does not fit")
    _, ok = probe(hi)
    if ok:
        raise SystemExit(f"--bisect: HI = {hi} fits")
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        _, ok = probe(mid)
        lo, hi = (mid, hi) if ok else (lo, mid)
    meta = dict(meta, bisect=dict(largest_fitting=lo, smallest_failing=hi, step=step))
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta["bisect"]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=2_097_152)
    p.add_argument("--max-tokens", type=int, default=1 << 26)
    p.add_argument("--policy", default="recompute")
    p.add_argument("--shape", default="1024,4096,8,2", help="d,h,E,K")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--sweep", default="", help="T1,T2,...: these T instead of the doubling sweep")
    p.add_argument("--bisect", default="", help="LO,HI,STEP: the largest T that fits, each probe a fresh process")
    p.add_argument("--name", default="scale")
    args = p.parse_args()
    sweep = [int(v) for v in args.sweep.split(",") if v]
    os.makedirs(args.out, exist_ok=True)
    if args.bisect:
        return bisect(args)
    d, h, E, K = (int(v) for v in args.shape.split(","))
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    T = sweep.pop(0) if sweep else args.tokens
    began = time.time()
    while T and T <= args.max_tokens and time.time() - began < args.budget_s:
        try:
            rows.append(measure(T, d, h, E, K, args.policy, dev, dt))
        except torch.OutOfMemoryError as exc:
            rows.append(dict(T=T, status="out of memory", error=str(exc).splitlines()[0][:200]))
            break
        finally:
            torch.cuda.empty_cache()
        print(rows[-1], flush=True)
        if args.sweep:
            T = sweep.pop(0) if sweep else 0
        else:
            T = T * 2 if T < args.tokens * 4 else T + args.tokens * 2
    meta = dict(device=torch.cuda.get_device_name(), memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1),
                torch=torch.__version__, commit=os.environ.get("MOEBLAZE_COMMIT", "unknown"), policy=args.policy,
                shape=dict(d=d, h=h, E=E, K=K),
                env={k: v for k, v in os.environ.items() if k.startswith("MOEBLAZE_")})
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    print("| T | status | ms | TFLOP/s | peak GB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['status']} | {r.get('ms', '')} | {r.get('tflops', '')} | {r.get('peak_gb', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
