"""Where a Triton launch's host time goes, stage by stage, in the layer step (Triton 3.6's ``JITFunction.run``).

    PYTHONPATH=. python3 benchmarks/launch_profile.py OUTDIR [--configs C] [--shape T,d,h,E,K ...] [--steps 8]

``JITFunction.run`` is replaced by a copy of Triton 3.6's with a timer between its stages (options from the knobs,
device and stream, the binder, the cache key, the cache lookup, the check of the kernel's global values, the
launch metadata, the launcher). Steps are enqueued behind a GPU sleep so the host never waits. Prints and writes
OUTDIR/launch.json: per kernel and stage, microseconds a launch. The copy only runs launches of kernels already
compiled (the untimed steps compile them); anything else falls back to Triton's own ``run``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_profile import blocked, shapes_of, sleep_cycles_per_ms, warm_layer  # noqa: E402

from moeblaze_fx.bench.layer import free_memory  # noqa: E402

STAGES = ("options", "device_stream", "binder", "cache_key", "lookup", "globals", "launch_metadata", "launcher")


def install(stats: dict):
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.runtime.driver import driver

    orig = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        t = [time.perf_counter()]
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        t.append(time.perf_counter())
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        for hook in self.pre_run_hooks:
            hook(*args, **kwargs)
        t.append(time.perf_counter())
        kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[device]
        bound_args, specialization, options = binder(*args, **kwargs)
        t.append(time.perf_counter())
        key = jit.compute_cache_key(kernel_key_cache, specialization, options)
        t.append(time.perf_counter())
        kernel = kernel_cache.get(key, None)
        if kernel is None:  # not compiled yet: Triton's own path
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        t.append(time.perf_counter())
        not_present = object()
        for (name, _), (val, globals_dict) in self.used_global_vals.items():
            if (new_val := globals_dict.get(name, not_present)) != val:
                raise RuntimeError(f"Global variable {name} has changed since we compiled this kernel, from {val} "
                                   f"to {new_val}")
        t.append(time.perf_counter())
        if callable(grid):
            grid = grid(bound_args)
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())
        t.append(time.perf_counter())
        kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())
        t.append(time.perf_counter())
        row = stats.setdefault(self.__name__, {"calls": 0, "args": len(args) + len(kwargs),
                                               "globals": len(self.used_global_vals), **{s: 0.0 for s in STAGES}})
        row["calls"] += 1
        for s, a, b in zip(STAGES, t, t[1:]):
            row[s] += b - a
        return kernel

    jit.JITFunction.run = run
    return lambda: setattr(jit.JITFunction, "run", orig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C")
    p.add_argument("--shape", action="append", default=[], metavar="T,d,h,E,K")
    p.add_argument("--provider", default="moeblaze-activations")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    cycles_per_ms = sleep_cycles_per_ms()
    out = {}
    for cfg in shapes_of(args.configs, args.shape):
        inputs, layer = warm_layer(cfg, args.provider, dev)
        base_host, _, device = blocked(layer, inputs, args.steps, 3, cycles_per_ms)
        stats: dict = {}
        restore = install(stats)
        try:
            host, _, _ = blocked(layer, inputs, args.steps, 3, cycles_per_ms)
        finally:
            restore()
        rows = {name: {"calls_a_step": r["calls"] / args.steps, "args": r["args"], "globals": r["globals"],
                       **{s: round(r[s] * 1e6 / r["calls"], 1) for s in STAGES}} for name, r in stats.items()}
        total = {s: round(sum(r[s] for r in stats.values()) * 1e3 / args.steps, 3) for s in STAGES}
        out[cfg.name] = {"host_ms": round(base_host, 3), "host_ms_instrumented": round(host, 3),
                         "device_ms": round(device, 3), "ms_a_step_by_stage": total, "us_a_launch": rows}
        print(cfg.name, json.dumps({k: v for k, v in out[cfg.name].items() if k != "us_a_launch"}), flush=True)
        for name, r in rows.items():
            print(f"    {name:40s} " + " ".join(f"{s} {r[s]:6.1f}" for s in STAGES)
                  + f"  ({r['calls_a_step']:.0f}/step, {r['args']} args, {r['globals']} globals)", flush=True)
        del inputs, layer
        free_memory(dev)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("MOEBLAZE_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.outdir, "launch.json"), "w") as f:
        json.dump({"meta": meta, "configs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
