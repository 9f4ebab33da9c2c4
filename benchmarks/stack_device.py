"""What ModuleList experts would cost if the operator took stacked [E, ...] weights, and what they cost
as the operator reads them (per-expert pointer tables), at configs A-D of BENCHMARKS.md.

    PYTHONPATH=. python3 benchmarks/stack_device.py OUTDIR [--configs A,B,C,D] [--commit SHA]

For each config, bf16, weights as 3·E separate nn.Linear-style tensors (gate, up [h, d]; down [d, h]):
* stack: ``torch.stack`` of each role (forward) and its backward (the gradient of the stack delivered to
  the E leaves), per step: milliseconds (CUDA events, median) and the extra bytes the stacked copies
  and their gradient hold;
* op-3d / op-list: the operator's forward + backward (router outputs given) with the weights as one
  [E, ...] tensor per role, and as the E separate tensors read through pointer tables: same kernels,
  so equal up to noise, and no copy of the weights.
Writes OUTDIR/stack.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from moeblaze_fx.bench.layer import CONFIGS
from moeblaze_fx.ops import RoleView, encode_layout


def _time(fn, warmup=2, reps=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--configs", default="A,B,C,D")
    parser.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        T, d, h, E, K = cfg.T, cfg.d, cfg.h, cfg.E, cfg.K
        g = torch.Generator(device=dev).manual_seed(0)
        roles = {"gate": (h, d), "up": (h, d), "down": (d, h)}
        ws = {r: [(torch.randn(*s, device=dev, generator=g) / s[1] ** 0.5).to(dt).requires_grad_() for _ in range(E)]
              for r, s in roles.items()}
        weight_bytes = sum(t.numel() * t.element_size() for v in ws.values() for t in v)

        def stack_step():
            for v in ws.values():
                for t in v:
                    t.grad = None
            stacked = [torch.stack(v) for v in ws.values()]
            torch.autograd.backward(stacked, [torch.ones_like(s) for s in stacked])

        torch.cuda.synchronize()
        stack_ms = _time(stack_step)
        for v in ws.values():
            for t in v:
                t.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stack_step()
        torch.cuda.synchronize()
        stack_peak = torch.cuda.max_memory_allocated() - base - weight_bytes  # beyond the leaves' own grads

        x = torch.randn(T, d, device=dev, generator=g).to(dt).requires_grad_()
        ids = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :K]
        w = torch.rand(T, K, device=dev, generator=g).to(dt).requires_grad_()
        gy = torch.randn(T, d, device=dev, generator=g).to(dt)
        listed = ws["gate"] + ws["up"] + ws["down"]
        list_layout = encode_layout(E, [RoleView(0, E, 0, 0, d, 1, h, d), RoleView(E, E, 0, 0, d, 1, h, d),
                                        RoleView(2 * E, E, 0, 0, h, 1, d, h), None, None, None])
        three = [torch.stack(v).detach().requires_grad_() for v in ws.values()]
        three_layout = encode_layout(E, [RoleView(0, 1, 0, h * d, d, 1, h, d), RoleView(1, 1, 0, h * d, d, 1, h, d),
                                         RoleView(2, 1, 0, d * h, h, 1, d, h), None, None, None])
        result = {}
        for label, params, layout in (("op-3d", three, three_layout), ("op-list", listed, list_layout)):
            def step():
                for t in params + [x, w]:
                    t.grad = None
                y = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)[0]
                y.backward(gy)
            result[label] = _time(step)
            host = []
            for _ in range(5):  # host time of one step (launches, Python): no synchronisation inside
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
            result[label + "-host"] = statistics.median(host)
            grads = [t.grad for t in params]
            result[label + "-grads"] = grads
        same = all(torch.equal(torch.stack(result["op-list-grads"][i * E:(i + 1) * E]), result["op-3d-grads"][i])
                   for i in range(3))
        rows.append(dict(config=name, T=T, d=d, h=h, E=E, K=K, stack_ms=round(stack_ms, 3),
                         stack_extra_mb=round(stack_peak / 1e6, 1), weight_mb=round(weight_bytes / 1e6, 1),
                         op_3d_ms=round(result["op-3d"], 3), op_list_ms=round(result["op-list"], 3),
                         op_3d_host_ms=round(result["op-3d-host"], 3), op_list_host_ms=round(result["op-list-host"], 3),
                         grads_bitwise_equal=same))
        del ws, three, listed, x, w, gy, result
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit)
    with open(os.path.join(args.out, "stack.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    print("| config | weights MB | stack fwd+bwd ms | stack extra MB | op 3-D weights ms (host) | op per-expert tables ms (host) | grads bitwise equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['weight_mb']} | {r['stack_ms']} | {r['stack_extra_mb']} | {r['op_3d_ms']} ({r['op_3d_host_ms']}) | "
              f"{r['op_list_ms']} ({r['op_list_host_ms']}) | {r['grads_bitwise_equal']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
