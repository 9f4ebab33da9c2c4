"""dh's activation pass (the split's second launch) under other launch configurations, in one call.

    PYTHONPATH=. python3 benchmarks/dhact_device.py OUTDIR [--configs C,D,A] [--variants 64x2w8,64x1w4,...]

For each layer config (moeblaze-activations) and variant: one untimed step (compiles), then --steps profiled steps;
the variant's time is the smallest device time of ``_expert_dh_kernel`` over them (under the Gluon dh GEMM that
name is the activation pass alone). A variant is ``{block_n}x{split_n}w{num_warps}[g{group_m}]`` (group_m 8 when
left out). Also the device's copy rate (read + write, 1 GiB) for the floor. Writes OUTDIR/dhact.json.

The thirteenth session's first runs also had a trailing ``s``: the partial sums stored by slot, through a switch
on a throwaway branch; that layout is now the only one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ab_device import kernel_times  # (benchmarks/, this script's directory)
from moeblaze_fx.bench.layer import CONFIGS, PROVIDERS, _grads, free_memory, make_inputs
from moeblaze_fx.kernels import autotune

_ORIG = autotune.kernel_configs


def use(variant: str) -> None:
    bn, rest = variant.split("x")
    split, rest = rest.split("w")
    warps, gm = rest.split("g") if "g" in rest else (rest, 8)
    cfg = autotune.KernelConfig(block_n=int(bn), block_k=64, num_warps=int(warps), num_stages=1, split_n=int(split),
                                group_m=int(gm))
    autotune.kernel_configs = lambda kind: [cfg] if kind == "dh_act" else _ORIG(kind)
    autotune._only_config.cache_clear()  # (cached: the launches look it up on the hot path)


def dh_act_ms(layer, inputs, dev, steps: int) -> float:
    """The smallest device time of the activation pass over ``steps`` profiled steps."""
    return min(kernel_times(lambda: _grads(layer, inputs, 0), dev).get("_expert_dh_kernel", [0.0])[0]
               for _ in range(steps))


def copy_rate(dev) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize(dev)
    return 2 * 20 * a.numel() / (s.elapsed_time(e) / 1e3) / 1e12


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C,D,A")
    p.add_argument("--variants", default="64x1w16g1,64x2w8g1,64x2w16g1,64x1w8g1,64x2w8")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--commit", default=os.environ.get("MOEBLAZE_COMMIT", "unknown"))
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    rate = copy_rate(dev)
    print(f"copy: {rate:.2f} TB/s (read + write)", flush=True)
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        T, d, h, E, K = cfg.shape
        N = T * K
        moved = N * h * 2 * 6  # dH' and A|B read, dA|dB and w*H written, 2 bytes each
        inputs = make_inputs(cfg, dev, torch.bfloat16, seed=0)
        layer, _ = PROVIDERS["moeblaze-activations"].build(dev, torch.bfloat16)
        for v in args.variants.split(","):
            use(v)
            try:
                _grads(layer, inputs, 0)
                ms = dh_act_ms(layer, inputs, dev, args.steps)
                row = dict(config=name, variant=v, ms=ms, tb_s=moved / (ms / 1e3) / 1e12)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile must not stop the rest
                row = dict(config=name, variant=v, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        del layer, inputs
        free_memory(dev)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               commit=args.commit, date=time.strftime("%Y-%m-%d"), copy_tb_s=rate, rows=rows)
    with open(os.path.join(args.outdir, "dhact.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
