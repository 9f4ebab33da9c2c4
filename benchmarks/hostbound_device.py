"""Is the layer bench's step bound by the host? The bench's timer (CUDA events around each step, the L2 flushed
before each, steps enqueued back to back) with the host's clock read at every step's start beside it.

    PYTHONPATH=. python3 benchmarks/hostbound_device.py OUTDIR [--configs C,D] [--providers ...] [--reps 30]

Per provider and config, in one process, rounds of:
* ``events``: the bench's timer, median step ms;
* ``host``: the host's time between two steps' starts in the same loop (it includes the wait for nothing: no step
  synchronizes), median;
* ``gc off``: the same with Python's garbage collector disabled during the loop;
then ``kernels``: device ms summed over one profiled step (torch.profiler). Where events ~ host > kernels, the host
enqueues slower than the device runs and the device waits for it; where events ~ kernels > host, the device is the
bound. Writes OUTDIR/hostbound.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, _grads, cuda_step_times, free_memory, make_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_device import kernel_times  # noqa: E402


def timed(step, dev, reps: int, gc_off: bool) -> tuple[list[float], list[float]]:
    """(event ms per step, host ms between step starts) over ``reps`` steps enqueued back to back."""
    torch.cuda.synchronize(dev)
    host: list[float] = []
    if gc_off:
        gc.disable()
    try:
        return cuda_step_times(step, dev, reps, host_ms=host), host
    finally:
        gc.enable()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C,D")
    p.add_argument("--providers", default="moeblaze-activations,hf-grouped-mm-compiled")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
        for prov in args.providers.split(","):
            torch._dynamo.reset()
            layer, note = PROVIDERS[prov].build(dev, torch.bfloat16)
            if layer is None:
                continue
            step = lambda i: _grads(layer, inputs, i)  # noqa: E731
            for i in range(3):
                step(i)  # compile, autotune, allocate
            row = dict(config=name, provider=prov, events={}, host={})
            for _ in range(args.rounds):
                for gc_off in (False, True):
                    ev, host = timed(step, dev, args.reps, gc_off)
                    key = "gc off" if gc_off else "gc on"
                    row["events"].setdefault(key, []).append(ev)
                    row["host"].setdefault(key, []).append(host)
            kernel_times(lambda: step(0), dev)
            row["kernels_ms"] = round(sum(v[0] for v in kernel_times(lambda: step(0), dev).values()), 3)
            rows.append(row)
            for key in row["events"]:
                ev = [x for r in row["events"][key] for x in r]
                host = [x for r in row["host"][key] for x in r]
                print(f"{name} {prov} {key}: events median {statistics.median(ev):.3f} ms (min {min(ev):.3f}, "
                      f"max {max(ev):.3f}); host median {statistics.median(host):.3f} ms (min {min(host):.3f}, "
                      f"max {max(host):.3f}); kernels {row['kernels_ms']:.3f} ms", flush=True)
            del layer, step
            free_memory(dev)
        del inputs
        free_memory(dev)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit,
                  date=time.strftime("%Y-%m-%d"), reps=args.reps, rows=rows)
    with open(os.path.join(args.outdir, "hostbound.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
