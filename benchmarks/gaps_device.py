"""Where a timed layer step spends device time that no kernel accounts for, in one call.

    PYTHONPATH=. python3 benchmarks/gaps_device.py OUTDIR [--configs A,C] [--provider moeblaze-activations]

For each config: the layer bench's timer (CUDA events, L2 flushed before each step, steps enqueued back to back)
with every step's time listed, so a trend over the steps shows; the caching allocator's device allocations, frees
and retries during those steps; then --trace-steps steps the same way under torch.profiler, whose trace gives the
device time inside kernels against the span of the steps, and the largest idle gaps between kernels with their
neighbours' names, and the device time per kernel name summed over those steps (the L2 flushes
included). Start ``nvidia-smi ... -lms 50`` beside it to see clocks and power (the markers printed here carry
``time.time()``). Writes OUTDIR/gaps.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, _grads, cuda_step_times, free_memory, make_inputs


def mark(msg: str) -> None:
    t = time.time()
    print(f"[{time.strftime('%Y/%m/%d %H:%M:%S', time.localtime(t))}.{int(t % 1 * 1000):03d}] {msg}", flush=True)


def timed_steps(layer, inputs, dev, reps: int) -> list[float]:
    return cuda_step_times(lambda i: _grads(layer, inputs, i), dev, reps)


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def alloc_counts(dev) -> dict[str, int]:
    st = torch.cuda.memory_stats(dev)
    return {k: int(st.get(k, -1)) for k in ALLOC_KEYS}


def trace_gaps(path: str, top: int) -> dict:
    """Busy time (union of device events), span, and the largest gaps between device events of a chrome trace."""
    with open(path) as f:
        tr = json.load(f)
    evs = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    evs.sort(key=lambda e: e["ts"])
    if not evs:
        return {}
    busy, gaps, end, prev = 0.0, [], evs[0]["ts"], None
    cur0 = evs[0]["ts"]
    for e in evs:
        s, d = float(e["ts"]), float(e.get("dur", 0))
        if s > end:
            busy += end - cur0
            gaps.append((s - end, prev["name"][:60] if prev else "", e["name"][:60]))
            cur0 = s
        if s + d >= end:
            end, prev = s + d, e
    busy += end - cur0
    span = end - evs[0]["ts"]
    gaps.sort(key=lambda g: -g[0])
    per_name: dict[str, float] = {}
    for e in evs:
        per_name[e["name"][:70]] = per_name.get(e["name"][:70], 0.0) + float(e.get("dur", 0)) / 1e3
    kernels_ms = dict(sorted(((k, round(v, 3)) for k, v in per_name.items()), key=lambda kv: -kv[1])[:top])
    return dict(kernels_ms_all_steps=kernels_ms, events=len(evs), span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
                gaps_over_20us=sum(1 for g in gaps if g[0] > 20), idle_in_gaps_over_20us_ms=sum(g[0] for g in gaps
                                                                                              if g[0] > 20) / 1e3,
                top=[dict(us=round(g[0], 1), after=g[1], before=g[2]) for g in gaps[:top]])


def dense_rates(dev, n: int = 8192, counts=(10, 100, 400)) -> dict[str, float]:
    """TFLOP/s of back-to-back bf16 n^3 GEMMs, after 3 warm-ups and 1 s idle, over runs of each count: the layer
    bench's ceiling times 10; the longer runs show the rate once the power limit holds the clocks down."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = {}
    for c in counts:
        for _ in range(3):
            a @ b
        torch.cuda.synchronize(dev)
        time.sleep(1.0)
        mark(f"dense x{c} start")
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(c):
            a @ b
        e.record()
        torch.cuda.synchronize(dev)
        mark(f"dense x{c} end")
        out[str(c)] = 2 * n ** 3 * c / (s.elapsed_time(e) / 1e3) / 1e12
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="A,C")
    p.add_argument("--provider", default="moeblaze-activations")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--dense", action="store_true", help="first the dense GEMM rate by run length")
    p.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    dense = dense_rates(dev) if args.dense else None
    print(f"dense bf16 8192^3 GEMM TFLOP/s by run length: {dense}", flush=True)
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
        layer, note = PROVIDERS[args.provider].build(dev, torch.bfloat16)
        for i in range(2):
            _grads(layer, inputs, i)
        torch.cuda.synchronize(dev)
        a0 = alloc_counts(dev)
        mark(f"{name}: timed steps start")
        times = timed_steps(layer, inputs, dev, args.reps)
        mark(f"{name}: timed steps end")
        a1 = alloc_counts(dev)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # untimed: the profiler's start-up
            _grads(layer, inputs, 0)
            torch.cuda.synchronize(dev)
        mark(f"{name}: traced steps start")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = timed_steps(layer, inputs, dev, args.trace_steps)
        mark(f"{name}: traced steps end")
        path = os.path.join(args.outdir, f"trace_{name}.json")
        prof.export_chrome_trace(path)
        g = trace_gaps(path, args.top)
        os.remove(path)  # large; the summary is what comes back
        row = dict(config=name, provider=args.provider, step_ms=times, median_ms=statistics.median(times),
                   alloc_delta={k: a1[k] - a0[k] for k in ALLOC_KEYS}, traced_step_ms=got, trace=g)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
        del layer, inputs
        free_memory(dev)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               commit=args.commit, date=time.strftime("%Y-%m-%d"), dense_tflops_by_run_length=dense, rows=rows)
    with open(os.path.join(args.outdir, "gaps.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
