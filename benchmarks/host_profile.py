"""Host against device time of one layer step, and where the host's time goes (Python's cProfile).

    python benchmarks/host_profile.py OUTDIR [--configs C,D] [--shape T,d,h,E,K ...]
        [--providers moeblaze-activations]
        [--steps 6] [--top 35]

For each config and provider: three untimed steps (compilation, autotuning), then

* ``eager_ms``: the layer bench's timer (CUDA events, L2 flushed before each step, steps enqueued back to back);
* ``host_ms`` / ``device_ms``: the same steps enqueued behind a GPU sleep long enough that the host never waits
  for the device: the host's time to enqueue a step (``host_fwd_ms`` of it up to the forward's output), and the
  device's time to run it with no host in the way (the events around the steps, after the sleep; it includes the
  L2 flush before each step, which ``eager_ms`` leaves out);
* ``kernels``: kernel launches in one step (torch.profiler);
* the same blocked enqueue under cProfile: OUTDIR/host_<config>_<provider>.txt, top functions by own and by
  cumulative time;
* ``breakdown``: the same blocked enqueue again with the functions of :data:`TIMED` wrapped in timers: per
  function, calls and inclusive host milliseconds a step (cProfile cannot see inside the custom operators, which
  run under a dynamo-disabled frame, and inflates call-heavy code).

Writes OUTDIR/host.json and prints one line per config and provider. ``eager_ms`` near ``host_ms`` and above
``device_ms`` means the step is bound by its launches.

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import L2_FLUSH_BYTES, PROVIDERS, _grads, cuda_step_times, free_memory, \
    make_inputs, parse_config, parse_configs


# (module, attribute): the functions timed for the breakdown, inclusive of what they call
TIMED = [
    ("moeblaze_fx.bench.layer", "route"),
    ("moeblaze_fx.ops", "moe_ffn"), ("moeblaze_fx.ops", "layout_of"), ("moeblaze_fx.ops", "_check_inputs"),
    ("moeblaze_fx.kernels.reference", "check_ids"), ("moeblaze_fx.ops", "_expert_weights"), ("moeblaze_fx.ops", "_make_plan"),
    ("moeblaze_fx.ops", "_grad_buffers"), ("moeblaze_fx.ops", "_kernel_backward"),
    ("moeblaze_fx.kernels.forward", "expert_forward"), ("moeblaze_fx.kernels.forward", "check_expert_inputs"),
    ("moeblaze_fx.kernels.forward", "forward_plan"), ("moeblaze_fx.kernels.plan", "slot_windows"),
    ("moeblaze_fx.kernels.triton.down", "down_operand"), ("moeblaze_fx.kernels.triton.down", "down_project"),
    ("moeblaze_fx.kernels.forward", "combine"), ("moeblaze_fx.kernels.plan", "up_sm90_weights"),
    ("moeblaze_fx.kernels.backward", "expert_backward"), ("moeblaze_fx.kernels.backward", "_weight_grad"),
    ("moeblaze_fx.kernels.backward", "backward_plan"), ("moeblaze_fx.kernels.backward", "check_grad_tables"),
    ("moeblaze_fx.kernels.plan", "_dh_sm90_weights"),
    ("moeblaze_fx.kernels.sm90.gather", "_launch"), ("moeblaze_fx.kernels.sm90.down", "down_sm90"),
    ("moeblaze_fx.kernels.sm90.common", "row_block_descs"), ("moeblaze_fx.kernels.sm90.dw", "dw_sm90"),
    ("moeblaze_fx.kernels.dispatch", "dispatch"), ("moeblaze_fx.kernels.tables", "table_of"),
    ("moeblaze_fx.kernels.tables", "tables_of"), ("moeblaze_fx.kernels.autotune", "launch"),
]


def install_timers(stats: dict):
    """Wrap :data:`TIMED`, the operators as called (``torch.ops.moeblaze.*``), Triton's kernel launches and Gluon's
    descriptor constructor in timers adding into ``stats[name] = [calls, seconds]``; returns a function that undoes it."""
    import importlib

    import triton.runtime.jit as jit

    undo = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                s = stats.setdefault(name, [0, 0.0])
                s[0] += 1
                s[1] += time.perf_counter() - t0
        return wrapper

    def patch(owner, attr, name):
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(orig, classmethod):
            setattr(owner, attr, classmethod(timed(name, orig.__func__)))
        else:
            setattr(owner, attr, timed(name, orig))
        undo.append(lambda: setattr(owner, attr, orig))

    for module, attr in TIMED:
        patch(importlib.import_module(module), attr, f"{module.rsplit('.', 1)[-1]}.{attr}")
    patch(jit.JITFunction, "run", "triton JITFunction.run")
    # inside JITFunction.run: the cache key, the launcher (C argument packing, the launch) and, within the
    # launcher, the tensor map encoded per descriptor argument; the rest of run is the binder's
    patch(jit, "compute_cache_key", "triton compute_cache_key")
    try:
        from triton.backends.nvidia import driver as nv_driver
        patch(nv_driver.CudaLauncher, "__call__", "triton CudaLauncher.__call__")
        patch(nv_driver, "make_tensordesc_arg", "triton make_tensordesc_arg")
    except (ImportError, KeyError, AttributeError):
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        patch(TensorDescriptor, "from_tensor", "gluon TensorDescriptor.from_tensor")
    except ImportError:
        pass
    namespace = torch.ops.moeblaze  # the operators as called (the dispatcher's part and their implementation)
    for name in ("moe_ffn", "moe_ffn_backward", "moe_ffn_backward_act", "moe_ffn_backward_dx", "moe_ffn_backward_dw"):
        orig = getattr(namespace, name)
        setattr(namespace, name, timed(f"op {name}", orig))
        undo.append(lambda name=name, orig=orig: setattr(namespace, name, orig))

    def restore():
        for u in reversed(undo):
            u()
    return restore


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def blocked(layer, inputs, steps: int, first: int, cycles_per_ms: float, profile: cProfile.Profile | None = None):
    """Enqueue ``steps`` steps behind a GPU sleep; (host ms a step, host ms a forward, device ms a step)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cycles_per_ms * 60 * steps))  # a step's host time is well under 60 ms
    start.record()
    host, fwd = [], []
    if profile is not None:
        profile.enable()
    for i in range(steps):
        flush.zero_()
        t0 = time.perf_counter()
        x, grad_y = inputs.pool[(first + i) % len(inputs.pool)]
        y, _ = layer(x, *inputs.params, inputs.K)
        t1 = time.perf_counter()
        torch.autograd.grad(y, (x, *inputs.params), grad_y)
        t2 = time.perf_counter()
        host.append((t2 - t0) * 1e3)
        fwd.append((t1 - t0) * 1e3)
    if profile is not None:
        profile.disable()
    end.record()
    if end.query():
        raise RuntimeError("the GPU finished before the host had enqueued the steps: lengthen the sleep")
    torch.cuda.synchronize()
    return statistics.median(host), statistics.median(fwd), start.elapsed_time(end) / steps


def shapes_of(configs: str, shapes: list[str]) -> list:
    """The layer shapes of ``--configs`` (built-in names and named sets, comma-separated) and ``--shape`` (T,d,h,E,K each)."""
    return parse_configs(configs) + [parse_config(s) for s in shapes]


def warm_layer(cfg, provider: str, dev: torch.device):
    """(inputs, layer) of ``provider`` at ``cfg`` in bfloat16, after three untimed steps (compilation,
    autotuning)."""
    # a fresh, static-shape compile per shape, as the layer bench does: else a compiled provider's second shape is
    # a recompile with dynamic sizes, whose generic kernels are slower
    torch._dynamo.reset()
    inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
    layer, _ = PROVIDERS[provider].build(dev, torch.bfloat16)
    for i in range(3):
        _grads(layer, inputs, i)
    torch.cuda.synchronize()
    return inputs, layer


def kernel_count(layer, inputs) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _grads(layer, inputs, 0)
        torch.cuda.synchronize()
    return sum(ev.count for ev in prof.key_averages() if ev.device_type.name == "CUDA" and "Memset" not in ev.key
               and "Memcpy" not in ev.key)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C,D")
    p.add_argument("--shape", action="append", default=[], metavar="T,d,h,E,K")
    p.add_argument("--providers", default="moeblaze-activations")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    cycles_per_ms = sleep_cycles_per_ms()
    rows = []
    for cfg in shapes_of(args.configs, args.shape):
        cfg_name = cfg.name
        for name in args.providers.split(","):
            inputs, layer = warm_layer(cfg, name, dev)
            eager = statistics.median(cuda_step_times(lambda i: _grads(layer, inputs, i), dev, 10, 3))
            host, fwd, device = blocked(layer, inputs, args.steps, 3, cycles_per_ms)
            prof = cProfile.Profile()
            p_host, _, _ = blocked(layer, inputs, args.steps, 3, cycles_per_ms, prof)
            row = {"config": cfg_name, "provider": name, "eager_ms": round(eager, 3), "host_ms": round(host, 3),
                   "host_fwd_ms": round(fwd, 3), "device_ms": round(device, 3),
                   "kernels": kernel_count(layer, inputs), "host_ms_under_cprofile": round(p_host, 3)}
            del layer  # rebuilt with the timers in place (the layer binds moe_ffn when built)
            stats: dict = {}
            restore = install_timers(stats)
            try:
                layer, _ = PROVIDERS[name].build(dev, torch.bfloat16)
                _grads(layer, inputs, 0)
                torch.cuda.synchronize()
                stats.clear()
                t_host, _, _ = blocked(layer, inputs, args.steps, 3, cycles_per_ms)
            finally:
                restore()
            row["host_ms_with_timers"] = round(t_host, 3)
            row["breakdown"] = {k: [v[0] / args.steps, round(v[1] * 1e3 / args.steps, 3)]
                                for k, v in sorted(stats.items(), key=lambda kv: -kv[1][1])}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "breakdown"}), flush=True)
            for k, (calls, ms) in row["breakdown"].items():
                print(f"    {k:45s} {calls:6.1f} calls {ms:8.3f} ms a step", flush=True)
            text = [json.dumps(row)]
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
                text.append(f"--- by {key}\n" + buf.getvalue())
            with open(os.path.join(args.outdir, f"host_{cfg_name}_{name}.txt"), "w") as f:
                f.write("\n".join(text))
            del inputs, layer
            free_memory(dev)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("MOEBLAZE_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "steps": args.steps}
    with open(os.path.join(args.outdir, "host.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
