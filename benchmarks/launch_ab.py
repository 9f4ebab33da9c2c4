"""Host time of a layer step with and without ``kernels.launch``'s direct launches, interleaved in one process.

    PYTHONPATH=. python3 benchmarks/launch_ab.py OUTDIR [--configs C] [--shape T,d,h,E,K ...] [--rounds 12]
        [--steps 10]

Each round enqueues ``--steps`` steps behind a GPU sleep (host_profile's ``blocked``) with ``MOEBLAZE_FAST_LAUNCH``
0, then 1 (the order alternates by round), so drift in the host's speed falls on both alike. Prints and writes
OUTDIR/launch_ab.json: per config, the median host ms a step of each setting over the rounds, and the device ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_profile import blocked, shapes_of, sleep_cycles_per_ms, warm_layer  # noqa: E402

from moeblaze_fx.bench.layer import free_memory  # noqa: E402
from moeblaze_fx.kernels import launch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--configs", default="C")
    p.add_argument("--shape", action="append", default=[], metavar="T,d,h,E,K")
    p.add_argument("--provider", default="moeblaze-activations")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    dev = torch.device("cuda")
    cycles_per_ms = sleep_cycles_per_ms()
    out = {}
    for cfg in shapes_of(args.configs, args.shape):
        inputs, layer = warm_layer(cfg, args.provider, dev)
        host = {"0": [], "1": []}
        device = []
        for r in range(args.rounds):
            for v in ("0", "1") if r % 2 == 0 else ("1", "0"):
                os.environ[launch.ENV_VAR] = v
                before = launch.stats()["fast"]
                h, _, dv = blocked(layer, inputs, args.steps, 3, cycles_per_ms)
                took_fast = launch.stats()["fast"] > before
                if took_fast != (v == "1"):
                    raise RuntimeError(f"{launch.ENV_VAR}={v} but direct launches taken: {took_fast}")
                host[v].append(h)
                device.append(dv)
        os.environ.pop(launch.ENV_VAR, None)
        row = {"host_ms_triton": round(statistics.median(host["0"]), 3),
               "host_ms_direct": round(statistics.median(host["1"]), 3),
               "host_ms_triton_all": [round(v, 3) for v in host["0"]],
               "host_ms_direct_all": [round(v, 3) for v in host["1"]],
               "device_ms": round(statistics.median(device), 3)}
        out[cfg.name] = row
        print(cfg.name, json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        del inputs, layer
        free_memory(dev)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("MOEBLAZE_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "rounds": args.rounds, "steps": args.steps}
    with open(os.path.join(args.outdir, "launch_ab.json"), "w") as f:
        json.dump({"meta": meta, "configs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
