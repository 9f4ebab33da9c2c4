#!/usr/bin/env python3
"""Device check and timing of the fused expert kernels (issue 4), in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/expert_device.py OUTDIR

1. ceilings: dense bf16 GEMM (8192^3) and a device-to-device copy, measured here;
2. correctness in bf16 on small ragged shapes (vs ``moe_ffn_reference`` in fp32, autograd) and on the
   BENCHMARKS.md configs A-D (vs the fp32 torch path ``moe_ffn_forward_torch``/``_backward_torch``),
   both memory policies, the caching allocator poisoned with NaN first; bitwise determinism;
3. timing (``triton.testing.do_bench``, median) of dispatch + forward + backward at A-D, both policies
   (router excluded), forward and backward alone, per-kernel breakdown from the profiler, saved
   activation bytes (``saved_tensors_hooks``, parameters excluded) and peak memory.
Writes OUTDIR/expert_device.json and OUTDIR/expert_device.md; prints a short table last.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import types

# MB_DRYRUN=1: a CPU smoke test of this script itself (Triton interpreter, tiny shapes, wall-clock timer).
DRY = os.environ.get("MB_DRYRUN") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

T0 = time.time()
DEVICE = "cpu" if DRY else "cuda"
DTYPE = torch.float16 if DRY else torch.bfloat16  # the interpreter's bf16 dot is wrong; fp16 is not
BUDGET_S = float(os.environ.get("MB_BUDGET_S", "540"))  # stop starting new work past this


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _import_kernels():
    """Import the kernels; if the package __init__ is broken by unrelated in-progress work, import the
    kernels subpackage without it."""
    try:
        import moeblaze_fx  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        log(f"package __init__ failed ({type(exc).__name__}: {exc}); importing moeblaze_fx.kernels directly")
        for name in [m for m in sys.modules if m == "moeblaze_fx" or m.startswith("moeblaze_fx.")]:
            del sys.modules[name]
        pkg = types.ModuleType("moeblaze_fx")
        pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moeblaze_fx")]
        sys.modules["moeblaze_fx"] = pkg
    from moeblaze_fx.kernels import autotune, expert_bwd, expert_fwd, reference
    return autotune, expert_fwd, expert_bwd, reference


autotune, expert_fwd, expert_bwd, reference = _import_kernels()
expert_forward, expert_backward, plan_block_m = expert_fwd.expert_forward, expert_bwd.expert_backward, expert_fwd.plan_block_m
DispatchPlan = reference.DispatchPlan

CONFIGS = {  # BENCHMARKS.md: (T, d, h, E, K)
    "A": (32768, 2048, 8192, 16, 4),
    "B": (16384, 4096, 14336, 8, 2),
    "C": (16384, 2048, 768, 128, 8),
    "D": (16384, 2048, 1024, 64, 8),
}
SMALL = [  # (T, d, h, E, K, ids_mode)
    (1000, 320, 200, 8, 4, "empty_expert"),
    (513, 256, 512, 6, 2, "sentinel"),
    (700, 128, 192, 4, 2, "one_expert"),
    (1, 64, 64, 3, 2, "random"),
    (4099, 1024, 768, 32, 8, "random"),
]
POLICIES = ("activations", "recompute")
if DRY:
    CONFIGS = {"A": (64, 32, 48, 4, 2), "C": (50, 16, 24, 8, 3)}
    SMALL = SMALL[:1] + [(5, 16, 16, 3, 2, "one_expert")]
    SMALL[0] = (60, 40, 24, 8, 4, "empty_expert")


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def bench(fn, warmup, rep, return_mode="median"):
    if not DRY:
        return do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def pick_dispatch():
    """The Triton dispatch kernel when present and bitwise equal to the reference here; else the reference."""
    try:
        from moeblaze_fx.kernels.dispatch import dispatch
    except Exception as exc:  # noqa: BLE001
        return reference.dispatch_reference, f"dispatch_reference (kernels.dispatch unavailable: {type(exc).__name__})"
    try:
        ids = torch.randint(0, 9, (777, 4), device=DEVICE)
        a, b = dispatch(ids, 8, block_m=plan_block_m()), reference.dispatch_reference(ids, 8, block_m=plan_block_m())
        if all(torch.equal(x, y) for x, y in zip(a, b)):
            return dispatch, "kernels.dispatch.dispatch (checked bitwise against dispatch_reference)"
        return reference.dispatch_reference, "dispatch_reference (kernels.dispatch differs from the reference)"
    except Exception as exc:  # noqa: BLE001
        return reference.dispatch_reference, f"dispatch_reference (kernels.dispatch failed: {type(exc).__name__}: {exc})"


DISPATCH, DISPATCH_NOTE = None, None


def dispatch_with_fallback(ids, E, block_m):
    """The chosen dispatch; if it raises (another engineer's kernel, in progress), the reference from then on."""
    global DISPATCH, DISPATCH_NOTE
    if DISPATCH is not reference.dispatch_reference:
        try:
            return DISPATCH(ids, E, block_m=block_m)
        except Exception as exc:  # noqa: BLE001
            DISPATCH_NOTE = f"dispatch_reference (kernels.dispatch failed at T={ids.shape[0]}: {type(exc).__name__})"
            log(DISPATCH_NOTE)
            DISPATCH = reference.dispatch_reference
    return reference.dispatch_reference(ids, E, block_m=block_m)


class KernelMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, policy):
        plan = dispatch_with_fallback(ids, w_gate_up.shape[0], plan_block_m())
        y, preact = expert_forward(x, weights, w_gate_up, w_down, plan, "swiglu", policy == "activations")
        ctx.save_for_backward(x, weights, w_gate_up, w_down, preact, *plan)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weights, w_gate_up, w_down, preact, *plan = ctx.saved_tensors
        dx, dw, dgu, dd = expert_backward(grad_y, x, weights, w_gate_up, w_down, preact, DispatchPlan(*plan), "swiglu")
        return dx, None, dw, dgu, dd, None


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def poison_allocator(gib: float = 8.0) -> None:
    """Fill free cached memory with NaN so that an unwritten output shows up."""
    if DRY:
        return
    try:
        n = int(gib * 2**30) // 4
        t = torch.empty(n, dtype=torch.float32, device=DEVICE).fill_(float("nan"))
        del t
    except torch.OutOfMemoryError:
        pass


def make_inputs(T, d, h, E, K, ids_mode="router", seed=0, dtype=DTYPE):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, d, device=DEVICE, generator=g).to(dtype)
    if ids_mode == "router":  # softmax -> top-k -> renormalize, random logits
        logits = torch.randn(T, E, device=DEVICE, generator=g)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        weights = (w / w.sum(-1, keepdim=True)).to(dtype)
    else:
        ids = torch.randint(0, E, (T, K), device=DEVICE, generator=g)
        if ids_mode == "empty_expert":
            ids = torch.where(ids == 1, 0, ids)
        elif ids_mode == "one_expert":
            ids[:, 0] = 2
            ids[:, 1:] = torch.where(ids[:, 1:] == 2, 0, ids[:, 1:])
        elif ids_mode == "sentinel":
            ids = torch.where(torch.rand(T, K, device=DEVICE, generator=g) < 0.3, E + 1, ids)
            ids[0] = E
        weights = (torch.rand(T, K, device=DEVICE, generator=g) + 0.1).to(dtype)
    w_gate_up = (torch.randn(E, 2 * h, d, device=DEVICE, generator=g) / d**0.5).to(dtype)
    w_down = (torch.randn(E, d, h, device=DEVICE, generator=g) / h**0.5).to(dtype)
    grad_y = torch.randn(T, d, device=DEVICE, generator=g).to(dtype)
    return dict(x=x, ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down, grad_y=grad_y)


def run_kernels(inp, policy):
    leaves = {k: inp[k].detach().clone().requires_grad_(True) for k in ("x", "weights", "w_gate_up", "w_down")}
    y = KernelMoE.apply(leaves["x"], inp["ids"], leaves["weights"], leaves["w_gate_up"], leaves["w_down"], policy)
    y.backward(inp["grad_y"])
    return [y.detach()] + [leaves[k].grad for k in ("x", "weights", "w_gate_up", "w_down")]


NAMES = ("y", "dx", "dweights", "dw_gate_up", "dw_down")


def ref_autograd_fp32(inp):
    leaves = {k: inp[k].detach().float().requires_grad_(True) for k in ("x", "weights", "w_gate_up", "w_down")}
    y = reference.moe_ffn_reference(leaves["x"], inp["ids"], leaves["weights"], leaves["w_gate_up"], leaves["w_down"])
    y.backward(inp["grad_y"].float())
    return [y.detach()] + [leaves[k].grad for k in ("x", "weights", "w_gate_up", "w_down")]


def ref_torch_path_fp32(inp):
    f = {k: inp[k].float() for k in ("x", "weights", "w_gate_up", "w_down", "grad_y")}
    y, preact, plan = reference.moe_ffn_forward_torch(f["x"], inp["ids"], f["weights"], f["w_gate_up"], f["w_down"],
                                                      "swiglu", False)
    grads = reference.moe_ffn_backward_torch(f["grad_y"], f["x"], inp["ids"], f["weights"], f["w_gate_up"],
                                             f["w_down"], preact, plan, "swiglu")
    return [y, *grads]


def dweights_scale(inp):
    """sum_n |dH'_n| |H_n| per pair (fp32): dweights = <dH', H> is judged against the size of its summands
    (see tests/kernels/test_expert.py: a cancelling dot product over bf16-rounded A|B)."""
    x, gy, wgu, wd = (inp[k].float() for k in ("x", "grad_y", "w_gate_up", "w_down"))
    ids = inp["ids"]
    h = wgu.shape[1] // 2
    scale = torch.zeros(ids.shape, dtype=torch.float32, device=x.device)
    for e in range(wgu.shape[0]):
        t, k = torch.where(ids == e)
        pre = x[t] @ wgu[e].t()
        scale[t, k] = ((gy[t] @ wd[e]).abs() * (torch.nn.functional.silu(pre[:, :h]) * pre[:, h:]).abs()).sum(1)
    return scale


def check(inp, ref, policy):
    poison_allocator()
    out1 = run_kernels(inp, policy)
    errs = {n: rel_err(o, r) for n, o, r in zip(NAMES, out1, ref)}
    out2 = run_kernels(inp, policy)
    bitwise = all(torch.equal(a, b) for a, b in zip(out1, out2))
    return errs, bitwise


def saved_bytes(inp, policy) -> int:
    params = {inp["w_gate_up"].untyped_storage().data_ptr(), inp["w_down"].untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = inp["x"].detach().requires_grad_(True)
    w = inp["weights"].detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = KernelMoE.apply(x, inp["ids"], w, inp["w_gate_up"], inp["w_down"], policy)
    del y
    return sum(seen.values())


def time_config(name, inp, policy):
    T, d = inp["x"].shape
    K = inp["ids"].shape[1]
    E, two_h, _ = inp["w_gate_up"].shape
    h = two_h // 2
    wgu = inp["w_gate_up"].detach().requires_grad_(True)
    wd = inp["w_down"].detach().requires_grad_(True)
    x = inp["x"].detach().requires_grad_(True)
    w = inp["weights"].detach().requires_grad_(True)
    gy = inp["grad_y"]

    def step():
        y = KernelMoE.apply(x, inp["ids"], w, wgu, wd, policy)
        y.backward(gy)
        x.grad = w.grad = wgu.grad = wd.grad = None

    def fwd():
        with torch.no_grad():
            plan = dispatch_with_fallback(inp["ids"], E, plan_block_m())
            return expert_forward(x, w, wgu, wd, plan, "swiglu", policy == "activations"), plan

    (y0, preact), plan = fwd()

    def bwd():
        return expert_backward(gy, x, w, wgu, wd, preact, plan, "swiglu")

    step()
    step()  # autotuning and compilation happen here, outside the timed region
    sync()
    est = bench(step, warmup=1, rep=1, return_mode="median")
    rep = max(200.0, min(1500.0, 12 * est))
    ms = bench(step, warmup=2 * est, rep=rep, return_mode="median")
    ms_fwd = bench(lambda: fwd(), warmup=est, rep=rep / 2, return_mode="median")
    ms_bwd = bench(bwd, warmup=est, rep=rep / 2, return_mode="median")
    del y0
    sync()
    peak = 0
    if not DRY:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    flops = 18 * T * K * d * h
    breakdown = {}
    if policy == "activations" and not DRY:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        for ev in prof.key_averages():
            t_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t_us > 0:
                breakdown[ev.key[:60]] = round(t_us / 1e3, 3)
    return dict(config=name, policy=policy, T=T, d=d, h=h, E=E, K=K, ms=ms, ms_fwd=ms_fwd, ms_bwd=ms_bwd,
                tflops=flops / ms / 1e9, saved_mb=saved_bytes(inp, policy) / 1e6, peak_mb=peak / 1e6,
                kernels_ms=dict(sorted(breakdown.items(), key=lambda kv: -kv[1])))


def micro(result) -> None:
    """Variants of the backward kernels at config A, raw launches (no autotuner), to see what limits them."""
    T, d, h, E, K = CONFIGS["A"]
    N = T * K
    inp = make_inputs(T, d, h, E, K, seed=2)
    plan = dispatch_with_fallback(inp["ids"], E, plan_block_m())
    x, gy, w, wgu, wd = inp["x"], inp["grad_y"], inp["weights"], inp["w_gate_up"], inp["w_down"]
    _, preact = expert_forward(x, w, wgu, wd, plan, "swiglu", True)
    dpre = torch.randn(N, 2 * h, device=DEVICE, dtype=DTYPE)
    hw = torch.randn(N, h, device=DEVICE, dtype=DTYPE)
    tok = (plan.token_index.long() // K)
    gy_slots, x_slots = gy[tok], x[tok]  # pre-gathered copies: only to measure what the gather costs
    out_dd = torch.empty_like(wd)
    out_dgu = torch.empty_like(wgu)
    rows = []
    kern = expert_bwd._expert_dw_kernel
    off = plan.offsets

    def dw_launch(a, b, gather_a, gather_b, out, bm, bn, bk, nw, ns, gm):
        m_dim, n_dim = out.shape[1], out.shape[2]
        grid = (E * triton.cdiv(m_dim, bm) * triton.cdiv(n_dim, bn),)
        kern[grid](a, b, out, plan.token_index, off, m_dim, n_dim, K, a.stride(0), a.stride(1), b.stride(0),
                   b.stride(1), out.stride(0), out.stride(1), out.stride(2), GATHER_A=gather_a, GATHER_B=gather_b,
                   DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns)

    flops_dd, flops_dgu = 2 * N * d * h, 4 * N * d * h
    variants = [(128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 1),
                (128, 128, 128, 8, 3, 8), (128, 256, 32, 8, 5, 8)]
    for v in variants:
        try:
            ms1 = bench(lambda: dw_launch(gy, hw, True, False, out_dd, *v), warmup=50, rep=200)
            ms2 = bench(lambda: dw_launch(dpre, x, False, True, out_dgu, *v), warmup=50, rep=200)
            rows.append(dict(kernel="dw", variant=str(v), dW_down_ms=ms1, dW_down_tflops=flops_dd / ms1 / 1e9,
                             dW_gu_ms=ms2, dW_gu_tflops=flops_dgu / ms2 / 1e9))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(kernel="dw", variant=str(v), error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        log(f"micro {rows[-1]}")
    v = variants[0]
    ms1 = bench(lambda: dw_launch(gy_slots, hw, False, False, out_dd, *v), warmup=50, rep=200)
    ms2 = bench(lambda: dw_launch(dpre, x_slots, False, False, out_dgu, *v), warmup=50, rep=200)
    rows.append(dict(kernel="dw no gather (pre-gathered copies)", variant=str(v), dW_down_ms=ms1,
                     dW_down_tflops=flops_dd / ms1 / 1e9, dW_gu_ms=ms2, dW_gu_tflops=flops_dgu / ms2 / 1e9))
    log(f"micro {rows[-1]}")
    bounds = off.tolist()

    def cublas(a, b, out):
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            torch.mm(a[lo:hi].t(), b[lo:hi], out=out[e])
    ms1 = bench(lambda: cublas(gy_slots, hw, out_dd), warmup=50, rep=200)
    ms2 = bench(lambda: cublas(dpre, x_slots, out_dgu), warmup=50, rep=200)
    rows.append(dict(kernel="cuBLAS per-expert mm (pre-gathered)", dW_down_ms=ms1, dW_down_tflops=flops_dd / ms1 / 1e9,
                     dW_gu_ms=ms2, dW_gu_tflops=flops_dgu / ms2 / 1e9))
    log(f"micro {rows[-1]}")

    part = torch.zeros(h // 64 + 8, N, device=DEVICE, dtype=torch.float32)
    num_tiles = plan.tile_expert.numel()
    for bn, bk, nw, ns, split, gm in [(64, 64, 8, 4, 1, 8), (64, 64, 8, 4, 2, 8), (64, 64, 8, 3, 2, 8),
                                      (64, 128, 8, 3, 2, 8), (64, 64, 8, 4, 2, 16), (128, 64, 8, 3, 1, 8)]:
        grid = (num_tiles * triton.cdiv(h, bn * split),)
        try:
            ms = bench(lambda: expert_bwd._expert_dh_kernel[grid](
                gy, x, wgu, wd, w, preact, dpre, hw, part, plan.token_index, off, plan.tile_expert, plan.tile_start,
                num_tiles, d, h, K, gy.stride(0), gy.stride(1), x.stride(0), x.stride(1), wgu.stride(0), wgu.stride(1),
                wgu.stride(2), wd.stride(0), wd.stride(1), wd.stride(2), w.stride(0), w.stride(1), preact.stride(0),
                preact.stride(1), dpre.stride(0), dpre.stride(1), hw.stride(0), hw.stride(1), part.stride(0),
                RECOMPUTE=False, DOT_PRECISION="tf32", CHUNK_N=64, SPLIT_N=split, BLOCK_M=plan_block_m(),
                BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns), warmup=50, rep=200)
            rows.append(dict(kernel="dh", variant=str((bn, bk, nw, ns, split, gm)), ms=ms, tflops=2 * N * d * h / ms / 1e9))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(kernel="dh", variant=str((bn, bk, nw, ns, split, gm)), error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        log(f"micro {rows[-1]}")
    result["micro"] = rows
    del inp, preact, dpre, hw, gy_slots, x_slots, out_dd, out_dgu, part
    if not DRY:
        torch.cuda.empty_cache()


def tuned_choices():
    out = {}
    mods = (expert_fwd, expert_bwd)
    for mod in mods:
        for attr in dir(mod):
            obj = getattr(mod, attr)
            if attr.endswith("_tuned") and hasattr(obj, "cache"):
                out[attr] = {str(k): str(v) for k, v in obj.cache.items()}
    return out


def main(outdir: str) -> None:
    global DISPATCH, DISPATCH_NOTE
    os.makedirs(outdir, exist_ok=True)
    torch.manual_seed(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "moeblaze_fx/kernels", "benchmarks"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit, dirty = "unknown", ""
    commit = os.environ.get("MB_COMMIT", commit)
    meta = dict(device="cpu (dry run)" if DRY else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), commit=commit, kernels_dirty=bool(dirty),
                block_m=plan_block_m(), pinned=os.environ.get(autotune.ENV_VAR, ""))
    DISPATCH, DISPATCH_NOTE = pick_dispatch()
    meta["dispatch"] = DISPATCH_NOTE
    log(f"{meta}")
    result = dict(meta=meta, ceilings={}, small=[], configs=[], timing=[])

    # 1. ceilings
    n = 256 if DRY else 8192
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    ms = bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    result["ceilings"]["gemm_bf16_tflops"] = 2 * n**3 / ms / 1e9
    src = torch.empty(2**20 if DRY else 2**30 // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    result["ceilings"]["copy_tb_s"] = 2 * src.numel() * 2 / ms / 1e9
    del a, b, src, dst
    log(f"ceilings {result['ceilings']}")

    # 2a. small ragged shapes vs the fp32 autograd reference
    for T, d, h, E, K, mode in SMALL:
        inp = make_inputs(T, d, h, E, K, ids_mode=mode, seed=T)
        ref = ref_autograd_fp32(inp)
        scale = float(dweights_scale(inp).norm())
        for policy in POLICIES:
            errs, bitwise = check(inp, ref, policy)
            errs["dweights_vs_summands"] = errs["dweights"] * float(ref[2].float().norm()) / max(scale, 1e-30)
            rec = dict(shape=(T, d, h, E, K), ids=mode, policy=policy, errs=errs, bitwise=bitwise)
            result["small"].append(rec)
            log(f"small {rec}")

    if os.environ.get("MB_MICRO") == "1":
        micro(result)

    # 2b + 3. configs A-D: correctness vs the fp32 torch path, then timing
    for name, (T, d, h, E, K) in CONFIGS.items():
        if time.time() - T0 > BUDGET_S:
            log(f"budget reached: skipping config {name}")
            continue
        inp = make_inputs(T, d, h, E, K, seed=1)
        ref = ref_torch_path_fp32(inp)
        for policy in POLICIES:
            errs, bitwise = check(inp, ref, policy)
            rec = dict(config=name, policy=policy, errs=errs, bitwise=bitwise)
            result["configs"].append(rec)
            log(f"config {rec}")
        del ref
        if not DRY:
            torch.cuda.empty_cache()
        for policy in POLICIES:
            if time.time() - T0 > BUDGET_S:
                log(f"budget reached: skipping timing {name} {policy}")
                continue
            rec = time_config(name, inp, policy)
            result["timing"].append(rec)
            log(f"timing {json.dumps(rec)}")
        del inp
        if not DRY:
            torch.cuda.empty_cache()
        with open(os.path.join(outdir, "expert_device.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)

    result["autotune"] = tuned_choices()
    with open(os.path.join(outdir, "expert_device.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)

    meta["dispatch"] = DISPATCH_NOTE
    lines = [f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
             f"commit {meta['commit']}{' (+local kernel changes)' if meta['kernels_dirty'] else ''}; "
             f"dispatch: {meta['dispatch']}; router excluded",
             f"ceilings: bf16 GEMM {result['ceilings']['gemm_bf16_tflops']:.0f} TFLOP/s, "
             f"copy {result['ceilings']['copy_tb_s']:.2f} TB/s", ""]
    worst_small = max((max(v for k, v in r["errs"].items() if k != "dweights") for r in result["small"]),
                      default=float("nan"))
    all_bitwise = all(r["bitwise"] for r in result["small"] + result["configs"])
    lines.append(f"small ragged shapes: worst rel err {worst_small:.2e} (dweights against its summands' size); "
                 f"bitwise deterministic everywhere: {all_bitwise}")
    lines += ["", "| config | policy | max rel err (y, dx, dw, dWgu, dWd) | bitwise |", "|---|---|---|---|"]
    for r in result["configs"]:
        e = r["errs"]
        lines.append(f"| {r['config']} | {r['policy']} | {max(e.values()):.2e} ("
                     + ", ".join(f"{v:.1e}" for v in e.values()) + f") | {r['bitwise']} |")
    lines += ["", "| config | policy | fwd ms | bwd ms | fwd+bwd ms | TFLOP/s | saved MB | peak MB |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["timing"]:
        lines.append(f"| {r['config']} | {r['policy']} | {r['ms_fwd']:.2f} | {r['ms_bwd']:.2f} | {r['ms']:.2f} | "
                     f"{r['tflops']:.0f} | {r['saved_mb']:.0f} | {r['peak_mb']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(outdir, "expert_device.md"), "w") as f:
        f.write(table + "\n")
    for r in result["timing"]:
        if r["kernels_ms"]:
            print(f"{r['config']} kernels (ms): " + ", ".join(f"{k.split('(')[0]}={v}" for k, v in list(r["kernels_ms"].items())[:9]))
    for r in result.get("micro", []):
        print("micro", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})
    print(table)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
