"""Same-process A/B of an environment switch on the layer step, with the layer bench's timer.

    PYTHONPATH=. python3 benchmarks/ab_device.py OUTDIR [--var MOEBLAZE_TMA] [--values 1,0] [--rounds 3]
        [--configs C,D] [--providers moeblaze-recompute,moeblaze-lowmem] [--shape T,d,h,E,K ...]

For each shape and provider, the rounds alternate the variable's values (A B A B ...), each round timing
the forward + backward of one layer (router included) as ``moeblaze bench`` does: CUDA events, median of
--reps steps, L2 flushed before each, inputs rotated; then the host's time to enqueue a step (median).
Autotuning and compilation happen in the first, untimed steps of every value. The spread between rounds
of the same value says what a difference between values must exceed. Writes OUTDIR/ab.json and prints a
markdown table (median over rounds, min-max).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, LayerConfig, _grads, free_memory, layer_flops, make_inputs, \
    parse_config, time_steps


def host_ms(step, dev, reps: int) -> float:
    """Median host time to enqueue one step (no synchronisation inside it): near the device time, the
    step is bound by the host's launches, and the device waits between kernels."""
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t0) * 1e3)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(ts)


def kernel_times(step, dev) -> dict[str, list]:
    """{kernel name: [device ms summed over one step, launches]} from torch.profiler, largest first."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    out = {}
    for ev in prof.key_averages():
        t_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
        if t_us > 0 and (dev.type != "cuda" or ev.device_type.name == "CUDA"):
            out[ev.key[:70]] = [round(t_us / 1e3, 3), ev.count]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def print_kernels(per_value: dict[str, dict[str, list]], top: int = 14) -> None:
    names = list(dict.fromkeys(n for k in per_value.values() for n in list(k)[:top]))
    for v, k in per_value.items():
        launches = sum(c for _, c in k.values())
        print(f"  value {v}: total {sum(t for t, _ in k.values()):.2f} ms over {launches} launches")
    for n in names:
        cells = ", ".join(f"{per_value[v].get(n, [0.0, 0])[0]:.3f} ms x{per_value[v].get(n, [0.0, 0])[1]}"
                          for v in per_value)
        print(f"    {n[:60]:60s} {cells}")


def print_spread(samples: dict[str, dict[str, list]], names: list[str]) -> None:
    """Median (min-max) of each value's profiled samples for the kernels ``names``."""
    for n in names:
        cells = ", ".join(f"{statistics.median(s[n]):.3f} ({min(s[n]):.3f}-{max(s[n]):.3f})" if n in s else "-"
                          for s in samples.values())
        print(f"    median (min-max) {n[:43]:43s} {cells}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--var", default="MOEBLAZE_TMA")
    p.add_argument("--values", default="1,0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="C,D")
    p.add_argument("--shape", action="append", default=[], metavar="T,d,h,E,K")
    p.add_argument("--providers", default="moeblaze-recompute,moeblaze-lowmem")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true",
                   help="then steps under torch.profiler, values in turn: device time per kernel name")
    p.add_argument("--profile-rounds", type=int, default=2,
                   help="profiled steps per value with --profile (the kept time is the smallest; every sample is "
                        "written to the JSON's kernel_samples and the spread printed)")
    p.add_argument("--top", type=int, default=14, help="kernel names printed per value with --profile")
    p.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device(args.device)
    values = args.values.split(",")
    shapes: list[LayerConfig] = [CONFIGS[c] for c in args.configs.split(",") if c]
    shapes += [parse_config(s) for s in args.shape]
    rows = []
    t_start = time.time()
    for cfg in shapes:
        inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
        for prov in args.providers.split(","):
            layer, note = PROVIDERS[prov].build(dev, torch.bfloat16)
            if layer is None:
                print(f"{cfg.name} {prov}: not available ({note})", flush=True)
                continue
            times: dict[str, list[float]] = {v: [] for v in values}
            host: dict[str, list[float]] = {v: [] for v in values}
            for r in range(args.rounds):
                for v in values:
                    os.environ[args.var] = v
                    if r == 0:
                        _grads(layer, inputs, 0)  # compile / autotune this value's kernels untimed
                    ms, how = time_steps(lambda i: _grads(layer, inputs, i), dev, 1, args.reps)
                    times[v].append(ms)
                    host[v].append(host_ms(lambda: _grads(layer, inputs, 0), dev, args.reps))
            row = dict(config=cfg.name, shape=cfg.shape, provider=prov, var=args.var, times=times, host_ms=host,
                       timer=how,
                       tflops={v: layer_flops(cfg) / statistics.median(t) / 1e9 for v, t in times.items()})
            if args.profile:
                # The profiler's first step runs slow (its start-up): one untimed profile first, then the values
                # in turn, --profile-rounds times; per kernel name the smallest, and every sample.
                kernel_times(lambda: _grads(layer, inputs, 0), dev)
                row["kernels"], row["kernel_samples"] = {}, {v: {} for v in values}
                for _ in range(args.profile_rounds):
                    for v in values:
                        os.environ[args.var] = v
                        got = kernel_times(lambda: _grads(layer, inputs, 0), dev)
                        prev = row["kernels"].get(v, got)
                        row["kernels"][v] = {k: min(got[k], prev.get(k, got[k])) for k in got}
                        for k, (ms, _) in got.items():
                            row["kernel_samples"][v].setdefault(k, []).append(ms)
                print_kernels(row["kernels"], args.top)
                if args.profile_rounds > 2:
                    print_spread(row["kernel_samples"], list(row["kernels"][values[0]])[:6])
            rows.append(row)
            print(f"{cfg.name} {prov}: " + ", ".join(f"{args.var}={v}: {', '.join(f'{t:.2f}' for t in ts)} ms "
                                                     f"(host {', '.join(f'{t:.2f}' for t in host[v])})"
                                                     for v, ts in times.items()), flush=True)
            del layer
            free_memory(dev)
        del inputs
        free_memory(dev)
    os.environ.pop(args.var, None)
    from moeblaze_fx.kernels import autotune

    def name(k):
        while hasattr(k, "fn"):
            k = k.fn
        return getattr(k, "__name__", str(k))
    chosen = sorted({(name(k[0]), str(k[1]), str(v)) for k, v in autotune._CHOSEN.items()})
    print("autotuned choices (kernel, key, config):")
    for c in chosen:
        print("  ", *c)
    result = dict(chosen=chosen, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                  triton=__import__("triton").__version__, commit=args.commit,
                  date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t_start, 1), rows=rows)
    with open(os.path.join(args.outdir, "ab.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, commit {args.commit}; "
          f"{rows[0]['timer'] if rows else ''}; {args.rounds} rounds, alternating\n")
    print("| config | provider | " + " | ".join(f"{args.var}={v} ms (min-max)" for v in values) + " |")
    print("|---|---|" + "---|" * len(values))
    for row in rows:
        cells = [f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})" for ts in row["times"].values()]
        print(f"| {row['config']} | {row['provider']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
