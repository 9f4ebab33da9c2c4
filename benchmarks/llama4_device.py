"""Llama 4's MoE block (transformers' ``Llama4TextMoe``, its own code) forward + backward, bf16: eager, under
default torch.compile, and under ``backend="moeblaze"``, which rewrites its dense all-experts computation into the
operator on the weighted tokens (one expert's work a token instead of E's).

    python benchmarks/llama4_device.py OUT [--tokens 8192] [--d 2048] [--h 4096] [--experts 16] [--reps 10]

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots). transformers with Llama 4 (``pip install
"transformers>=5"``).

Times with CUDA events (median of ``--reps`` steps after 3 warm-up steps); the output and the input's gradient of
each variant against eager's (relative error in the 2-norm). The block includes the shared expert and the router,
as the model runs them. Writes OUT/llama4.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import moeblaze_fx  # noqa: E402,F401  (registers the backend)
from moeblaze_fx.bench import layer as L  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import transformers
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    cfg = transformers.Llama4TextConfig(hidden_size=args.d, intermediate_size=args.h, intermediate_size_mlp=args.h,
                                        num_local_experts=args.experts, num_experts_per_tok=1, num_hidden_layers=1,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=args.d // 16)
    torch.manual_seed(0)
    moe = Llama4TextMoe(cfg)
    with torch.no_grad():
        for p in moe.parameters():  # the experts' parameters are created empty
            p.normal_(0, p.shape[-2] ** -0.5 if p.dim() == 3 else p.shape[-1] ** -0.5)
    moe = moe.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    gy = torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16, generator=g)

    def run(fn):
        x.grad = None
        for p in moe.parameters():
            p.grad = None
        out, _ = fn(x)
        out.backward(gy.view_as(out))
        return out.detach().float(), x.grad.detach().float()

    rows, want = [], None
    for name in ("eager", "compiled", "moeblaze"):
        torch._dynamo.reset()
        fn = {"eager": moe, "compiled": torch.compile(moe),
              "moeblaze": torch.compile(moe, backend="moeblaze")}[name]
        for _ in range(3):
            got = run(fn)
        if name == "eager":
            want = got
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(fn)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)]
        row = dict(variant=name, ms=statistics.median(times), out_rel_err=errs[0], dx_rel_err=errs[1])
        if name == "moeblaze":
            row["report"] = [f"{r.status}: {r.layout or r.reason}" for r in moeblaze_fx.last_report()]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = L.environment(torch.device("cuda"))
    meta.update(tokens=args.tokens, d=args.d, h=args.h, experts=args.experts)
    with open(os.path.join(args.out, "llama4.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
