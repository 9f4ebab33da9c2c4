"""What ragged row tiles cost: the layer step with the router's top-k against a routing that gives every expert
exactly T*K/E rows (a multiple of the 128-row tile at C and D), same process, same weights.

    PYTHONPATH=. python3 benchmarks/ragged_device.py OUTDIR [--configs C,D] [--providers moeblaze-activations,...]

"balanced": token t (in a random order pi) takes experts (pi(t)*K + k) mod E, k < K, weighted by its softmax
probabilities at those experts, renormalized; the router's gradient flows through that gather as through top-k's.
Every expert then gets T*K/E rows, so no row tile is ragged, where top-k of random logits leaves about half a tile
of padding per expert and column block. Rounds alternate the two routings (layer bench's timer: CUDA events,
median of --reps steps, L2 flushed before each); then one profiled step each, device time per kernel name.
Writes OUTDIR/ragged.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import moeblaze_fx.bench.layer as layer_mod
from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, _grads, free_memory, layer_flops, make_inputs, time_steps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_device import kernel_times, print_kernels  # noqa: E402

_ROUTE = layer_mod.route
_IDS: dict[tuple, torch.Tensor] = {}


def balanced_route(x: torch.Tensor, w_router: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = x.shape[0], w_router.shape[0]
    key = (T, K, E, x.device)
    if key not in _IDS:
        if (T * K) % E:
            raise ValueError(f"T*K = {T * K} is not a multiple of E = {E}: no routing gives every expert as many rows")
        gen = torch.Generator(device="cpu").manual_seed(1)
        pi = torch.randperm(T, generator=gen)
        _IDS[key] = ((pi[:, None] * K + torch.arange(K)) % E).to(x.device)
    ids = _IDS[key]
    probs = F.softmax(F.linear(x, w_router), dim=-1, dtype=torch.float32)
    w = probs.gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(x.dtype)


ROUTES = {"topk": _ROUTE, "balanced": balanced_route}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C,D")
    p.add_argument("--providers", default="moeblaze-activations,hf-grouped-mm-compiled")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    rows, t_start = [], time.time()
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
        counts = torch.bincount(balanced_route(inputs.pool[0][0], inputs.w_router, cfg.K)[0].flatten(),
                                minlength=cfg.E)
        assert int(counts.min()) == int(counts.max()) == cfg.T * cfg.K // cfg.E, counts
        for prov in args.providers.split(","):
            torch._dynamo.reset()  # the compiled peer: each routing compiles its own graph, static sizes
            layer, note = PROVIDERS[prov].build(dev, torch.bfloat16)
            if layer is None:
                print(f"{name} {prov}: not available ({note})", flush=True)
                continue
            times: dict[str, list[float]] = {r: [] for r in ROUTES}
            kernels: dict[str, dict] = {}
            for rnd in range(args.rounds):
                for route_name, route in ROUTES.items():
                    layer_mod.route = route
                    if rnd == 0:
                        _grads(layer, inputs, 0)  # compile, autotune, allocate
                    ms, how = time_steps(lambda i: _grads(layer, inputs, i), dev, 1, args.reps)
                    times[route_name].append(ms)
            for route_name, route in ROUTES.items():
                layer_mod.route = route
                kernel_times(lambda: _grads(layer, inputs, 0), dev)  # the profiler's slow first step
                kernels[route_name] = kernel_times(lambda: _grads(layer, inputs, 0), dev)
            layer_mod.route = _ROUTE
            print_kernels(kernels, args.top)
            row = dict(config=name, shape=cfg.shape, provider=prov, times=times, timer=how, kernels=kernels,
                       tflops={r: layer_flops(cfg) / statistics.median(t) / 1e9 for r, t in times.items()})
            rows.append(row)
            print(f"{name} {prov}: " + "; ".join(f"{r}: {', '.join(f'{t:.3f}' for t in ts)} ms"
                                               for r, ts in times.items()), flush=True)
            del layer
            free_memory(dev)
        del inputs
        free_memory(dev)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, commit=args.commit, date=time.strftime("%Y-%m-%d"),
                  seconds=round(time.time() - t_start, 1), rows=rows)
    with open(os.path.join(args.outdir, "ragged.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, commit {args.commit}; {rows[0]['timer'] if rows else ''}\n")
    print("| config | provider | top-k routing ms (min-max) | balanced ms (min-max) | balanced / top-k |")
    print("|---|---|---|---|---|")
    for row in rows:
        a, b = (statistics.median(row["times"][r]) for r in ROUTES)
        cells = [f"{statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})" for ts in row["times"].values()]
        print(f"| {row['config']} | {row['provider']} | " + " | ".join(cells) + f" | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
