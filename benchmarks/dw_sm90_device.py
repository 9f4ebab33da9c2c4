#!/usr/bin/env python3
"""Device check and timing of the warp-specialized Gluon dW kernel (``kernels/dw_sm90.py``) against the Triton
dW kernel, in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/dw_sm90_device.py OUTDIR

1. correctness, bf16: ragged shapes (an expert with no slots, one expert with most slots, T not a multiple of
   anything), both operand roles (dW_down: dy gathered; dW_gate: x gathered), bf16 and fp32 outputs, a first
   slot window (experts past it untouched); against a float32 torch reference and the Triton kernel; two runs
   bitwise equal; counts the Gluon launches.
2. timing (``triton.testing.do_bench``, median, raw launches) of dW_down and dW_gate at configs C, D, A
   (``MB_DW_CONFIGS``): the Triton kernel's three tuned tiles, and the Gluon kernel's ``MB_DW_VARIANTS``
   (``stages,block_k,maxnreg,consumer regs,producer regs``, separated by ``;``), each with and without the
   token rows loaded a step ahead and with both operands pre-gathered (``MB_DW_AHEAD_PRE``).
Writes OUTDIR/dw_sm90.json; prints the table last.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import expert_device as ed  # noqa: E402  (inputs, plans and tables, as the kernel bench builds them)

from moeblaze_fx.kernels import dw_sm90, expert_bwd, expert_fwd  # noqa: E402

T0 = time.time()
CONFIGS = os.environ.get("MB_DW_CONFIGS", "C,D,A").split(",")
# Gluon variants: "stages,block_k,maxnreg,consumer regs,producer regs" separated by ";"
VARIANTS = [(v[0], v[1], tuple(v[2:])) for v in (tuple(int(x) for x in spec.split(","))
            for spec in os.environ.get("MB_DW_VARIANTS", "6,64,168,216,72;4,64,168,216,72").split(";"))]
# (token rows loaded one step ahead, operands pre-gathered into copies: what the gather costs)
AHEAD_PRE = [(a == "1", p == "1") for a, p in (x.split(",") for x in
                                               os.environ.get("MB_DW_AHEAD_PRE", "0,0;1,0;1,1").split(";"))]
# (T, d, h, E, K, ids_mode): m and n are multiples of 128 (the Gluon kernel's tile)
SHAPES = [(1000, 256, 384, 8, 4, "empty_expert"), (700, 384, 128, 4, 2, "one_expert"),
          (4099, 1024, 768, 32, 8, "random"), (513, 128, 256, 6, 2, "sentinel"), (3, 128, 128, 5, 2, "random")]


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def operands(T, d, h, E, K, ids_mode, seed=0):
    inp = ed.make_inputs(T, d, h, E, K, ids_mode=ids_mode, seed=seed)
    plan = ed.dispatch_with_fallback(inp["ids"], E, expert_fwd.plan_block_m())
    N = plan.token_index.numel()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dpre = torch.randn(N, 2 * h, device="cuda", generator=g).to(torch.bfloat16)
    hw = torch.randn(N, h, device="cuda", generator=g).to(torch.bfloat16)
    return inp, plan, dpre, hw


def reference(a, b, gather_a, plan, K, E, m, n, slot1):
    """fp32 [E, m, n]: per expert, its slots below slot1."""
    out = torch.zeros(E, m, n, device="cuda")
    tok = plan.token_index.long() // K
    off = plan.offsets.tolist()
    for e in range(E):
        lo, hi = off[e], min(off[e + 1], slot1)
        if hi <= lo:
            continue
        ra = tok[lo:hi] if gather_a else torch.arange(lo, hi, device="cuda")
        rb = torch.arange(lo, hi, device="cuda") if gather_a else tok[lo:hi]
        out[e] = a[ra].float().t() @ b[rb].float()
    return out


def cases(inp, dpre, hw, h):
    x, gy = inp["x"], inp["grad_y"]
    E, d = inp["E"], x.shape[1]
    return [("dW_down", gy, hw, True, (E, d, h)), ("dW_gate", dpre[:, :h], x, False, (E, h, d)),
            ("dW_up", dpre[:, h:], x, False, (E, h, d))]


def gluon(a, b, gather_a, out, plan, K, window, stages=dw_sm90.DEFAULT_STAGES, regs=None, **kw):
    t = ed.table(out)
    if regs is not None:
        kw["regs"] = regs
    dw_sm90.dw_sm90(a, b, gather_a, t, plan.token_index, plan.offsets, K, window, expert_fwd.table_align(t),
                    stages=stages, **kw)


def triton_dw(a, b, gather_a, out, plan, K, window, v=None):
    """The Triton kernel: autotuned through expert_bwd._weight_grad (v None), or one raw variant
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    t = ed.table(out)
    if v is None:
        os.environ[dw_sm90.ENV_VAR] = "0"
        try:
            expert_bwd._weight_grad(a, b, gather_a, t, plan, K, False, window)
        finally:
            os.environ.pop(dw_sm90.ENV_VAR)
        return
    bm, bn, bk, nw, ns = v
    E = t.ptrs.numel()
    grid = (E * triton.cdiv(t.rows, bm) * triton.cdiv(t.cols, bn),)
    expert_fwd.ensure_tma_allocator()
    expert_bwd._expert_dw_kernel[grid](
        a, b, t.ptrs, plan.token_index, plan.offsets, t.rows, t.cols, K, *window, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), t.stride_r, t.stride_c, GATHER_A=gather_a, GATHER_B=not gather_a,
        OUT_FP32=out.dtype == torch.float32, ACCUMULATE=False, MAY_ADD=False, TMA=True,
        O_ALIGN=expert_fwd.table_align(t), DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=nw, num_stages=ns)


def check(rows):
    for T, d, h, E, K, mode in SHAPES:
        inp, plan, dpre, hw = operands(T, d, h, E, K, mode)
        N = plan.token_index.numel()
        for name, a, b, gather_a, shape in cases(inp, dpre, hw, h):
            for out_dtype, slot1 in ((torch.bfloat16, N), (torch.float32, N), (torch.bfloat16, max(N // 2, 1))):
                if True:
                    own_end = N + 1 if slot1 == N else slot1
                    ref = reference(a, b, gather_a, plan, K, E, shape[1], shape[2], slot1)
                    row = dict(part="check", shape=[T, d, h, E, K, mode], kernel=name, out=str(out_dtype),
                               window=[0, slot1, own_end])
                    if len(rows) < 3:
                        log(f"start {row}")
                    try:
                        sentinel = 7.0
                        outs = []
                        for _ in range(2):
                            out = torch.full(shape, sentinel, device="cuda", dtype=out_dtype)
                            gluon(a, b, gather_a, out, plan, K, (0, slot1, own_end))
                            outs.append(out)
                        tri = torch.full(shape, sentinel, device="cuda", dtype=out_dtype)
                        # one raw variant: autotuning every new shape here would take minutes
                        triton_dw(a, b, gather_a, tri, plan, K, (0, slot1, own_end), (128, 256, 64, 8, 3))
                        torch.cuda.synchronize()
                        # experts whose slots start past the window's end are left as they were
                        off = plan.offsets.tolist()
                        untouched = [e for e in range(E) if off[e] >= own_end]
                        expect = ref.clone()
                        for e in untouched:
                            expect[e] = sentinel
                        scale = max(float(expect.abs().max()), 1e-6)
                        row.update(rel_err_vs_fp32=float((outs[0].float() - expect).abs().max()) / scale,
                                   rel_err_vs_triton=float((outs[0].float() - tri.float()).abs().max()) / scale,
                                   bitwise_equal_to_triton=bool(torch.equal(outs[0], tri)),
                                   deterministic=bool(torch.equal(outs[0], outs[1])),
                                   untouched_experts=len(untouched),
                                   untouched_kept=all(bool((outs[0][e] == sentinel).all()) for e in untouched))
                        row["ok"] = bool(row["rel_err_vs_fp32"] < 1e-2 and row["deterministic"] and row["untouched_kept"])
                    except Exception as exc:  # noqa: BLE001
                        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:1500]}")
                    rows.append(row)
                    dump(rows)
                    log(json.dumps(row) if not row["ok"] else
                        f"ok {name} {row['shape']} {row['out']} window {row['window']} err {row['rel_err_vs_fp32']:.2e}"
                        f" bitwise_triton {row['bitwise_equal_to_triton']}")


def timing(rows):
    variants = [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]
    for name in CONFIGS:
        T, d, h, E, K = ed.CONFIGS[name]
        inp, plan, dpre, hw = operands(T, d, h, E, K, "router", seed=2)
        N = plan.token_index.numel()
        window = (0, N, N + 1)
        for kname, a, b, gather_a, shape in cases(inp, dpre, hw, h)[:2]:
            flops = 2 * N * shape[1] * shape[2]
            out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
            ref = None
            for v in variants:
                ms = do_bench(lambda: triton_dw(a, b, gather_a, out, plan, K, window, v), warmup=25, rep=100)
                if ref is None:
                    ref = out.clone()
                rows.append(dict(part="time", config=name, kernel=kname, impl="triton", variant=list(v), ms=ms,
                                 tflops=flops / ms / 1e9))
                dump(rows)
                log(json.dumps(rows[-1]))
            # (stages, registers, index loads one step ahead, both operands pre-gathered: what the gather costs)
            tok = plan.token_index.long() // K
            pre = (a[tok], b, False) if gather_a else (a, b[tok], False)  # copies, only to measure the gather
            for stages, block_k, regs in VARIANTS:
                for ahead, pregathered in AHEAD_PRE:
                    row = dict(part="time", config=name, kernel=kname, impl="gluon",
                               variant=[stages, block_k, *regs, "ahead" if ahead else "",
                                        "pregathered" if pregathered else ""])
                    aa, bb, ga = pre if pregathered else (a, b, gather_a)
                    try:
                        ms = do_bench(lambda: gluon(aa, bb, ga, out, plan, K, window, stages, regs, idx_ahead=ahead,
                                                    gather_b=False if pregathered else None, block_k=block_k),
                                      warmup=25, rep=100)
                        scale = float(ref.float().abs().max())
                        row.update(ms=ms, tflops=flops / ms / 1e9,
                                   rel_diff_vs_triton=float((out.float() - ref.float()).abs().max()) / scale)
                    except Exception as exc:  # noqa: BLE001
                        row.update(error=f"{type(exc).__name__}: {str(exc)[:1500]}")
                    rows.append(row)
                    dump(rows)
                    log(json.dumps(row))
            del pre


META = {}
OUTDIR = "."


def dump(rows):
    """Rewritten after every row: a run cut off by its time limit keeps what it measured."""
    with open(os.path.join(OUTDIR, "dw_sm90.json"), "w") as f:
        json.dump(dict(meta=META, rows=rows), f, indent=1)


def main(outdir):
    global OUTDIR
    OUTDIR = outdir
    os.makedirs(outdir, exist_ok=True)
    ed.DISPATCH, ed.DISPATCH_NOTE = ed.pick_dispatch()
    rows = []
    META.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("MB_COMMIT", "?"), date=time.strftime("%Y-%m-%d"))
    log(json.dumps(META))
    if os.environ.get("MB_DW_CHECK", "1") == "1":
        check(rows)
    if os.environ.get("MB_DW_TIME", "1") == "1":
        timing(rows)
    bad = [r for r in rows if r["part"] == "check" and not r.get("ok")]
    log(f"checks: {sum(r['part'] == 'check' for r in rows)} rows, {len(bad)} failed")
    for r in rows:
        if r["part"] == "time":
            print(f"{r['config']} {r['kernel']:8s} {r['impl']:6s} {str(r['variant']):24s} "
                  f"{r.get('ms', float('nan')):8.3f} ms {r.get('tflops', float('nan')):6.1f} TFLOP/s "
                  f"{r.get('rel_diff_vs_triton', '')} {r.get('error', '')[:200]}")


if __name__ == "__main__":
    main(sys.argv[1])
