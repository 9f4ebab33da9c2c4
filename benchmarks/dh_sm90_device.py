#!/usr/bin/env python3
"""Device check and timing of the Gluon dH' kernel (``moeblaze_fx/kernels/dh_sm90.py``), in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/dh_sm90_device.py OUTDIR

1. correctness, bf16: forward + backward through the kernels with the Gluon dH' kernel (the default where
   it applies) against the fp32 reference, and against the same step with the Triton dH' kernel
   (``MOEBLAZE_GLUON_DH=0``); ragged shapes (an empty expert, one expert with every token, T not a multiple
   of the tile), both weight orientations, slot windows, and configs C and D; two runs bitwise equal;
2. raw launches (``do_bench`` median) at MB_DH_CONFIGS (default C,D,A,B): the Triton dh kernel at its tuned
   candidates against Gluon variants (BLOCK_N, SPLIT_N, BLOCK_K, STAGES, GROUP_M, warps).
Writes OUTDIR/dh_sm90.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import expert_device as xd  # noqa: E402  (the helpers: inputs, tables, reference, timer)

from moeblaze_fx.kernels import dh_sm90  # noqa: E402

log = xd.log
SHAPES = [  # (T, d, h, E, K, ids_mode, layout, window_slots)
    (1000, 256, 512, 8, 4, "empty_expert", "hf_fused", 0),
    (700, 128, 256, 4, 2, "one_expert", "hf_fused", 0),
    (4099, 1024, 768, 32, 8, "random", "hf_fused", 0),
    (4099, 1024, 768, 32, 8, "random", "transposed", 0),
    (3001, 512, 1024, 16, 4, "sentinel", "hf_fused", 2000),
]
VARIANTS = [  # (BLOCK_N, SPLIT_N, BLOCK_K, STAGES, GROUP_M, warps, PREFETCH, BLOCK_M)
    (128, 1, 64, 5, 8, 8, True, 128), (128, 1, 64, 4, 8, 4, False, 64), (128, 1, 64, 3, 8, 4, False, 64),
    (128, 1, 64, 3, 8, 4, True, 64), (128, 1, 64, 3, 16, 4, True, 64), (64, 2, 64, 4, 8, 4, False, 64),
    (64, 2, 64, 3, 8, 4, False, 64), (64, 2, 64, 3, 8, 4, True, 64)]
TRITON = [(64, 64, 8, 4, 2, 16), (64, 128, 8, 3, 2, 8)]  # the tuned candidates: (BLOCK_N, BLOCK_K, warps, stages, SPLIT_N, GROUP_M)


CALLS = {"gluon": 0}
_launch = dh_sm90.dh_sm90


def _counted(*args, **kw):
    CALLS["gluon"] += 1
    return _launch(*args, **kw)


if hasattr(xd.expert_bwd, "dh_sm90"):  # the checks need expert_bwd to take the Gluon kernel
    xd.expert_bwd.dh_sm90.dh_sm90 = _counted


def run_step(inp, window_slots, gluon: bool):
    os.environ[dh_sm90.ENV_VAR] = "1" if gluon else "0"
    act = xd.parse_activation(inp["act"])
    plan = xd.dispatch_with_fallback(inp["ids"], inp["E"], xd.plan_block_m())
    w = xd.weight_tables(inp)
    y, preact = xd.expert_forward(inp["x"], inp["weights"], w, plan, act, True)
    grads = [torch.empty_like(s) for s in inp["storage"]]
    gw = xd.tables_of(xd.role_views(inp["layout"], grads, act.gated, inp["E"]))
    dx, dweights, *_ = xd.expert_backward(inp["grad_y"], inp["x"], inp["weights"], w, preact, plan, act,
                                          grads=gw, window_slots=window_slots)
    return [y, dx, dweights] + grads


def correctness(rows):
    names = ["y", "dx", "dweights", "dW_gate_up", "dW_down"]
    for T, d, h, E, K, mode, layout, win in SHAPES + [(*xd.CONFIGS["C"], "router", "hf_fused", 0),
                                                     (*xd.CONFIGS["D"], "router", "hf_fused", 0)]:
        inp = xd.make_inputs(T, d, h, E, K, ids_mode=mode, seed=3, layout=layout)
        ref = xd.ref_autograd_fp32(inp) if T * h < 2**24 else xd.ref_torch_path_fp32(inp)
        xd.poison_allocator()
        CALLS["gluon"] = 0
        g1 = run_step(inp, win, True)
        gluon_launches = CALLS["gluon"]
        g2 = run_step(inp, win, True)
        t1 = run_step(inp, win, False)
        row = dict(kind="check", shape=(T, d, h, E, K, mode, layout, win), gluon_launches=gluon_launches,
                   bitwise_rerun=all(torch.equal(a, b) for a, b in zip(g1, g2)),
                   rel_err_vs_fp32={n: xd.rel_err(o, r) for n, o, r in zip(names, g1, ref)},
                   triton_rel_err_vs_fp32={n: xd.rel_err(o, r) for n, o, r in zip(names, t1, ref)},
                   rel_diff_vs_triton={n: xd.rel_err(o, r) for n, o, r in zip(names, g1, t1)})
        if "dweights" in names:  # routing-weight gradient: judged against the size of its summands
            scale = xd.dweights_scale(inp) if T * h < 2**24 else None
            if scale is not None:
                row["dweights_max_err_over_scale"] = float(((g1[2].float() - ref[2]).abs() / scale.clamp_min(1e-6)).max())
        rows.append(row)
        log(f"check {row}")
        del inp, ref, g1, g2, t1
    os.environ.pop(dh_sm90.ENV_VAR, None)


def timing(rows, name):
    T, d, h, E, K = xd.CONFIGS[name]
    N = T * K
    inp = xd.make_inputs(T, d, h, E, K, seed=2)
    plan = xd.dispatch_with_fallback(inp["ids"], E, xd.plan_block_m())
    x, gy, w = inp["x"], inp["grad_y"], inp["weights"]
    wt = xd.weight_tables(inp)
    g_t, u_t, d_t = wt
    _, preact = xd.expert_forward(x, w, wt, plan, "swiglu", True)
    dpre = torch.empty(N, 2 * h, device="cuda", dtype=x.dtype)
    hw = torch.empty(N, h, device="cuda", dtype=x.dtype)
    part = torch.zeros(h // 64 + 8, N, device="cuda", dtype=torch.float32)
    num_tiles = plan.tile_expert.numel()
    tile0 = torch.zeros(1, dtype=torch.int32, device="cuda")
    flops = 2 * N * d * h
    outs = {}
    for bn, bk, nw, ns, split, gm in TRITON:
        grid = (num_tiles * triton.cdiv(h, bn * split),)
        ms = xd.bench(lambda: xd.expert_bwd._expert_dh_kernel[grid](
            gy, x, g_t.ptrs, u_t.ptrs, d_t.ptrs, x, x, w, preact, dpre, hw, part, plan.token_index, plan.offsets,
            plan.tile_expert, plan.tile_start, tile0, num_tiles, num_tiles, 0, N, d, h, K, gy.stride(0), gy.stride(1),
            x.stride(0), x.stride(1), g_t.stride_r, g_t.stride_c, u_t.stride_r, u_t.stride_c, d_t.stride_r,
            d_t.stride_c, w.stride(0), w.stride(1), preact.stride(0), preact.stride(1), dpre.stride(0),
            dpre.stride(1), hw.stride(0), hw.stride(1), part.stride(0), 1.0, 0.0,
            ACT=xd.expert_fwd.ACT_CODES["swiglu"], GATED=True, HAS_GATE_BIAS=False, HAS_UP_BIAS=False,
            W_ALIGN=xd.expert_fwd.table_align(d_t), RECOMPUTE=False, DOT_PRECISION="tf32", CHUNK_N=64,
            SPLIT_N=split, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns),
            warmup=50, rep=200)
        outs.setdefault("triton", (dpre.clone(), hw.clone(), part.clone()))
        rows.append(dict(kind="time", config=name, kernel="triton dh", variant=(bn, bk, nw, ns, split, gm), ms=ms,
                         tflops=flops / ms / 1e9))
        log(f"time {rows[-1]}")
    win = xd.expert_fwd.slot_windows(plan, 0)[0]
    for v in VARIANTS:
        cfg = dh_sm90.DhConfig(*v)
        if h % (cfg[0] * cfg[1]):
            continue
        try:
            ms = xd.bench(lambda: dh_sm90.dh_sm90(gy, d_t.ptrs, (d_t.stride_r, d_t.stride_c),
                                                 xd.expert_fwd.table_align(d_t), w, preact, dpre, hw, part, plan, win,
                                                 0, N, d, h, K, 64, cfg), warmup=50, rep=200)
            ref = outs["triton"]
            rows.append(dict(kind="time", config=name, kernel="gluon dh", variant=v, ms=ms, tflops=flops / ms / 1e9,
                             rel_diff_vs_triton=[xd.rel_err(a, b) for a, b in zip((dpre, hw, part), ref)]))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(kind="time", config=name, kernel="gluon dh", variant=v,
                             error=f"{type(exc).__name__}: {str(exc)[:600]}"))
        log(f"time {rows[-1]}")
    del inp, preact, dpre, hw, part


def main(outdir: str) -> None:
    os.makedirs(outdir, exist_ok=True)
    rows: list = []
    commit = os.environ.get("MB_COMMIT") or subprocess.run(["git", "rev-parse", "--short=12", "HEAD"],
                                                           capture_output=True, text=True).stdout.strip()
    head = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit)
    log(f"{head}")
    try:
        if os.environ.get("MB_DH_CHECK", "1") == "1":
            correctness(rows)
        for name in [c for c in os.environ.get("MB_DH_CONFIGS", "C,D,A,B").split(",") if c]:
            timing(rows, name)
    finally:
        with open(os.path.join(outdir, "dh_sm90.json"), "w") as f:
            json.dump(dict(head, rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
