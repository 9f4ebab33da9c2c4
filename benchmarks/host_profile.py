"""Where the host's time goes in one layer step (Python's cProfile), for steps bound by their launches.

    PYTHONPATH=. python3 benchmarks/host_profile.py OUTDIR [--config C] [--provider moeblaze-lowmem] [--steps 5]

Two untimed steps (compilation, autotuning), then --steps steps under cProfile with one synchronisation at
the end. Writes OUTDIR/host_<config>_<provider>.txt (top functions by own time and by cumulative time) and
prints the first lines of each, with the host and device milliseconds per step.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, _grads, make_inputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--config", default="C")
    p.add_argument("--provider", default="moeblaze-lowmem")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    inputs = make_inputs(CONFIGS[args.config], dev, torch.bfloat16, seed=0)
    layer, _ = PROVIDERS[args.provider].build(dev, torch.bfloat16)
    for i in range(2):
        _grads(layer, inputs, i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = cProfile.Profile()
    start.record()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(args.steps):
        _grads(layer, inputs, i)
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    end.record()
    torch.cuda.synchronize()
    device_ms = start.elapsed_time(end) / args.steps
    text = [f"{args.config} {args.provider}: host {host_ms:.2f} ms per step under cProfile (enqueue), "
            f"events {device_ms:.2f} ms per step"]
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        text.append(f"--- by {key}\n" + buf.getvalue())
    path = os.path.join(args.outdir, f"host_{args.config}_{args.provider}.txt")
    with open(path, "w") as f:
        f.write("\n".join(text))
    print(text[0])
    for block in text[1:]:
        lines = [ln for ln in block.splitlines() if ln.strip()]
        print("\n".join(lines[:8 + min(args.top, 25)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
