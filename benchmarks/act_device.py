"""The layer (router + experts, forward + backward, bf16) with SwiGLU and with DeepSeek-V4's clamped SwiGLU
(``swiglu_clamp(limit=10.0)``), MoEBlaze against Hugging Face's grouped_mm experts under torch.compile computing
the same activation, each checked against the float32 reference of its own activation.

    python benchmarks/act_device.py OUT [--configs C,D,B] [--acts "swiglu;swiglu_clamp(limit=10.0)"]

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots).

Writes OUT/act.json and prints one line a row. The Gluon launch counts tell which up-projection and dh kernels ran
(the Gluon up kernel and fused dh take the SwiGLUs, plain and clamped; other activations run the Triton kernels).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moeblaze_fx.bench import layer as L  # noqa: E402
from moeblaze_fx.kernels.sm90 import gather as sm90_gather  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--configs", default="C,D,B")
    ap.add_argument("--acts", default="swiglu;swiglu_clamp(limit=10.0)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    dense = L.dense_gemm_rate(device, dtype)
    rows = []
    meta = L.environment(device)
    meta["dense_gemm"] = dense
    for name in args.configs.split(","):
        cfg = L.CONFIGS[name]
        inputs = L.make_inputs(cfg, device, dtype, seed=0)
        with torch.no_grad():
            ids, _ = L.route(inputs.pool[0][0], inputs.w_router, cfg.K)
        for act in args.acts.split(";"):
            ref = L.compute_reference(inputs, ids, L._reference_chunk(cfg, device), act)
            L.free_memory(device)
            for provider in ("moeblaze-activations", "hf-grouped-mm-compiled"):
                torch._dynamo.reset()
                if provider.startswith("moeblaze"):
                    fn = L._moeblaze_layer("activations", activation=act)
                else:
                    fn = torch.compile(L._hf_grouped_layer(True, activation=act))
                up0, act0 = sm90_gather.launches(), sm90_gather.act_launches()
                fields, status = L._run_one(fn, cfg, inputs, ref, device, 2, args.reps, dense["tflops"])
                row = dict(config=name, activation=act, provider=provider, status=status,
                           gluon_gather_launches=sm90_gather.launches() - up0,
                           gluon_dh_act_launches=sm90_gather.act_launches() - act0,
                           **{k: fields.get(k) for k in ("ms", "tflops", "peak_bytes", "max_rel_err", "rel_err",
                                                         "error")})
                rows.append(row)
                err = row["max_rel_err"]
                print(f"{name} {act:26s} {provider:24s} {status:6s} ms={row['ms'] and round(row['ms'], 3)} "
                      f"TFLOP/s={row['tflops'] and round(row['tflops'])} err={err if err is None else f'{err:.2e}'} "
                      f"gluon gather/dh_act={row['gluon_gather_launches']}/{row['gluon_dh_act_launches']} "
                      f"{row.get('error') or ''}", flush=True)
                del fn
                L.free_memory(device)
            del ref
        del inputs
        L.free_memory(device)
    with open(os.path.join(args.out, "act.json"), "w") as f:
        json.dump(L._jsonable({"meta": meta, "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
