"""The transient_budget trade-off: one MoE layer (router included), forward + backward, bf16, at the
BENCHMARKS.md configs, with the slots processed whole and in windows that fit each budget.

    PYTHONPATH=. python3 benchmarks/chunk_device.py OUTDIR [--configs A,B] [--budgets-mib 0,2048,256]

Per config, policy and budget (0: everything at once): median ms of 5 steps after one warm-up (CUDA
events) and the peak allocation above the step's start. Writes OUTDIR/chunk.json and prints a markdown
table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from moeblaze_fx.bench.layer import CONFIGS, route
from moeblaze_fx.ops import default_chunk_tokens, moe_ffn


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--configs", default="A,B")
    p.add_argument("--budgets-mib", default="0,2048,512,256")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(c.T, c.d, device=dev, dtype=dt, generator=g).requires_grad_()
        gy = torch.randn(c.T, c.d, device=dev, dtype=dt, generator=g)
        wr = (torch.randn(c.E, c.d, device=dev, generator=g) / c.d**0.5).to(dt).requires_grad_()
        wgu = (torch.randn(c.E, 2 * c.h, c.d, device=dev, generator=g) / c.d**0.5).to(dt).requires_grad_()
        wd = (torch.randn(c.E, c.d, c.h, device=dev, generator=g) / c.h**0.5).to(dt).requires_grad_()
        for policy in ("activations", "recompute"):
            for mib in [int(b) for b in args.budgets_mib.split(",")]:
                chunk = default_chunk_tokens(c.K, c.d, c.h, True, 2, mib << 20)
                chunk = chunk if chunk < c.T else 0
                def step():
                    for t in (x, wr, wgu, wd):
                        t.grad = None
                    ids, w = route(x, wr, c.K)
                    moe_ffn(x, ids, w, (wgu, wd), checkpoint=policy, chunk_tokens=chunk).backward(gy)
                step()
                torch.cuda.synchronize()
                for t in (x, wr, wgu, wd):
                    t.grad = None
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    step()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b))
                rows.append(dict(config=name, policy=policy, budget_mib=mib, chunk_tokens=chunk or c.T,
                                 windows=-(-c.T // chunk) if chunk else 1, ms=round(statistics.median(times), 2),
                                 peak_mb=round((torch.cuda.max_memory_allocated() - start) / 1e6)))
                print(rows[-1], flush=True)
        del x, gy, wr, wgu, wd
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                commit=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    with open(os.path.join(args.out, "chunk.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    print("| config | policy | budget MiB | slots per window / K | windows | ms | peak MB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['policy']} | {r['budget_mib']} | {r['chunk_tokens']} | {r['windows']} | {r['ms']} "
              f"| {r['peak_mb']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
