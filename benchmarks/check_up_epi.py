"""Throwaway: the up kernel's epilogue variants (MOEBLAZE_GLUON_UP_EPI) give bitwise the same forward and backward."""
import os
import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_expert import make_case, run_kernels  # noqa: E402

for T, d, h, E, K, mode, layout, dt, win, policy in [
        (12000, 320, 200, 8, 4, "empty_expert", "dense", torch.bfloat16, 0, "activations"),
        (8000, 256, 512, 8, 2, "random", "hf_fused", torch.bfloat16, 12000, "activations"),
        (9000, 512, 256, 4, 2, "one_expert", "hf_fused", torch.float16, 0, "activations"),
        (8000, 256, 384, 3, 2, "sentinel", "transposed", torch.bfloat16, 0, "recompute")]:
    case = make_case(T, d, h, E, K, act="swiglu", layout=layout, device="cuda", dtype=dt, ids_mode=mode, seed=T + 13)
    out = {}
    for v in ("after", "next", "regs4x5", "regs5x4", "regs4x3"):
        os.environ["MOEBLAZE_GLUON_UP_EPI"] = v
        torch.full((64 * 2 ** 20,), float("nan"), device="cuda")
        out[v] = run_kernels(case, policy, window_slots=win)
    y0, o0 = out["after"]
    for v, (y, o) in out.items():
        same = (torch.equal(y, y0) and torch.equal(o["x"], o0["x"]) and torch.equal(o["weights"], o0["weights"])
                and all(torch.equal(a, b) for a, b in zip(o["storage"], o0["storage"])))
        print(f"T={T} h={h} {layout} {policy} {v}: bitwise {'equal' if same else 'DIFFERENT'}, finite {bool(torch.isfinite(y).all())}")
os.environ.pop("MOEBLAZE_GLUON_UP_EPI")
