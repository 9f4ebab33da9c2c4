#!/usr/bin/env python3
"""Device check and timing of the fused expert kernels (issue 4), in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/expert_device.py OUTDIR

1. ceilings: dense bf16 GEMM (8192^3) and a device-to-device copy, measured here;
2. correctness in bf16 on small ragged shapes (vs ``moe_ffn_reference`` in fp32, autograd): SwiGLU on
   Hugging Face's fused ``[E, 2h, d]`` weight, and GeGLU, gpt-oss's clamped SwiGLU with biases, ReLU
   (plain), a ModuleList of per-expert tensors, transposed and interleaved views, float32 gradient
   tables and accumulation into existing gradients; then the BENCHMARKS.md configs A-D (SwiGLU, vs the
   fp32 torch path ``moe_ffn_forward_torch``/``_backward_torch``), both memory policies, the caching
   allocator poisoned with NaN first; bitwise determinism;
3. timing (``triton.testing.do_bench``, median) of dispatch + forward + backward at A-D, both policies
   (router excluded), forward and backward alone, per-kernel breakdown from the profiler, saved
   activation bytes (``saved_tensors_hooks``, parameters excluded) and peak memory.
Writes OUTDIR/expert_device.json and OUTDIR/expert_device.md; prints a short table last.

Environment: MB_PARTS (default ``small,features,accumulate,configs``), MB_FEATURES_PIN (the kernel config the
``features`` part runs under; empty: autotuned), MB_BUDGET_S (no new config A-D past this), MB_CONFIGS (which of A-D,
in that order; default all), MB_MICRO=A,C (raw kernel variants at those configs), MB_MICRO_KFRACS=1,0.5,0.25 (with MB_MICRO:
one variant of up, down and dh at shortened contractions, see KFRACS), MB_MICRO_GM=8,16,32 (with MB_MICRO: named
variants of up, down and dW at each GROUP_M, see GROUPS), MB_DRYRUN=1 (a CPU smoke test of this script under
the Triton interpreter).

Weights are read and weight gradients written through per-expert pointer tables (``kernels.tables``);
the tables' byte alignment is what lets the kernels use 16-byte loads, and is logged (``table_align``).
"""
from __future__ import annotations

import contextlib
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
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

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
    from moeblaze_fx.kernels import autotune, expert_bwd, expert_fwd, reference, tables
    return autotune, expert_fwd, expert_bwd, reference, tables


autotune, expert_fwd, expert_bwd, reference, tables_mod = _import_kernels()
expert_forward, expert_backward, plan_block_m = expert_fwd.expert_forward, expert_bwd.expert_backward, expert_fwd.plan_block_m
DispatchPlan, ExpertParams, parse_activation = reference.DispatchPlan, reference.ExpertParams, reference.parse_activation
ExpertTables = tables_mod.ExpertTables

CONFIGS = {  # BENCHMARKS.md: (T, d, h, E, K), SwiGLU on a fused [E, 2h, d] weight
    "A": (32768, 2048, 8192, 16, 4),
    "B": (16384, 4096, 14336, 8, 2),
    "C": (16384, 2048, 768, 128, 8),
    "D": (16384, 2048, 1024, 64, 8),
}
OAI = "swiglu_oai(alpha=1.702,limit=7.0)"
SMALL = [  # (T, d, h, E, K, ids_mode, activation, biases, layout): SwiGLU, autotuned like the configs
    (1000, 320, 200, 8, 4, "empty_expert", "swiglu", False, "hf_fused"),
    (513, 256, 512, 6, 2, "sentinel", "swiglu", False, "hf_fused"),
    (700, 128, 192, 4, 2, "one_expert", "swiglu", False, "hf_fused"),
    (1, 64, 64, 3, 2, "random", "swiglu", False, "hf_fused"),
    (4099, 1024, 768, 32, 8, "random", "swiglu", False, "hf_fused"),
]
FEATURES = [  # the same, for the other activations, biases and weight layouts (under FEATURES_PIN)
    (1000, 320, 200, 8, 4, "empty_expert", "geglu", False, "dense"),
    (900, 256, 384, 8, 2, "random", OAI, True, "hf_fused"),
    (1000, 320, 200, 8, 4, "sentinel", OAI, True, "transposed"),
    (700, 192, 256, 6, 2, "random", "relu", True, "dense"),
    (800, 256, 192, 8, 2, "empty_expert", "gelu", False, "transposed"),
    (900, 256, 384, 8, 2, "random", "swiglu", True, "list"),
    (600, 192, 320, 8, 2, "one_expert", "silu", True, "list"),
    (700, 256, 256, 6, 2, "random", "swiglu", True, "interleaved"),
]
# One pinned configuration for FEATURES: each new (activation, bias) variant would otherwise cost an
# autotuning round (a compile and a benchmark per candidate and kernel), a few minutes in all. Its tile
# shapes are those of the tuned candidates (dh: 2 x 64 columns); MB_FEATURES_PIN="" autotunes them too.
FEATURES_PIN = os.environ.get("MB_FEATURES_PIN",
                              "block_m=128,block_n=64,block_k=64,num_warps=8,num_stages=3,group_m=8,split_n=2")
# (T, d, h, E, K, activation, layout): float32 gradient tables, accumulate=True into random float32 gradients,
# autotuned: a shape of its own each, so that the accumulating launch is the first dw launch of its key (the
# autotuner then times it on a scratch buffer).
ACCUMULATE = [(777, 224, 160, 8, 2, "swiglu", "hf_fused"), (555, 160, 224, 8, 2, OAI, "list")]
# Parts to run, in this order: small (SwiGLU), features, accumulate, configs (A-D: correctness, timing).
PARTS = os.environ.get("MB_PARTS", "small,features,accumulate,configs").split(",")
MICRO_KERNELS = os.environ.get("MB_MICRO_KERNELS", "dw,up,dh").split(",")  # "up" covers up and down
# MB_MICRO_KFRACS=1,0.5,0.25: time only one variant of up, down and dh (the one named by index below), with the
# contraction cut to these fractions of its length (d for up and dh, h for down). Outputs are then partial
# sums: only the times mean anything. A straight-line fit t = a + b * k gives the part of a launch that does not
# grow with k: the tiles' prologues and epilogues (what overlapping them could save at most).
KFRACS = [float(f) for f in os.environ.get("MB_MICRO_KFRACS", "1").split(",")]
# MB_MICRO_GM=8,16,32: time only the named variants of up, down and dW, each with these GROUP_M values (how many
# row tiles the programs running together share; larger groups re-read each weight column fewer times).
GROUPS = [int(g) for g in os.environ.get("MB_MICRO_GM", "").split(",") if g]
if GROUPS and KFRACS != [1.0]:
    raise SystemExit("MB_MICRO_GM and MB_MICRO_KFRACS each pick the variants to time: set one of them")


def _k_sweep(variants, index):
    """(variant, fraction of the contraction) pairs: every variant at its full length, or one at KFRACS."""
    if KFRACS == [1.0]:
        return [(v, 1.0) for v in variants]
    return [(variants[index], f) for f in KFRACS]


def _gm_sweep(variants, picks, gm_field):
    """The variants at ``picks`` with GROUP_M (field ``gm_field``) set to each of GROUPS; all variants without it."""
    if not GROUPS:
        return variants
    return [variants[i][:gm_field] + (g,) + variants[i][gm_field + 1:] for i in picks for g in GROUPS]


POLICIES = ("activations", "recompute")
if DRY:
    CONFIGS = {"A": (64, 32, 48, 4, 2), "C": (50, 16, 24, 8, 3)}
    SMALL = [(60, 40, 24, 8, 4, "empty_expert", "swiglu", False, "hf_fused"), (5, 16, 16, 3, 2, "one_expert", "swiglu", False, "hf_fused")]
    FEATURES = [(30, 24, 20, 4, 2, "random", OAI.replace("7.0", "0.6"), True, "hf_fused"),
                (30, 24, 20, 4, 2, "random", "relu", True, "list"), (30, 24, 20, 4, 2, "random", "geglu", False, "interleaved")]
    FEATURES_PIN = os.environ.get("MB_FEATURES_PIN", "block_m=16,block_n=16,block_k=16,num_warps=4,num_stages=1,split_n=2")
    ACCUMULATE = [(33, 32, 16, 4, 2, "swiglu", "hf_fused")]


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def bench(fn, warmup, rep, return_mode="median"):
    if not DRY:
        return do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


@contextlib.contextmanager
def pinned(spec):
    """MOEBLAZE_KERNEL_CONFIG set to ``spec`` inside (read at every launch); None or "": left as it is."""
    if not spec:
        yield
        return
    old = os.environ.get(autotune.ENV_VAR)
    os.environ[autotune.ENV_VAR] = spec
    try:
        yield
    finally:
        if old is None:
            del os.environ[autotune.ENV_VAR]
        else:
            os.environ[autotune.ENV_VAR] = old


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


# ---------------------------------------------------------------------------------------------
# Weight layouts and their pointer tables
# ---------------------------------------------------------------------------------------------
_HAS_ALIGN_FIELD = "align" in tables_mod.WeightTable._fields
_AlignedTable = None if _HAS_ALIGN_FIELD else \
    __import__("collections").namedtuple("AlignedTable", tables_mod.WeightTable._fields + ("align",))


def _alignment(view) -> int:
    """Largest power of two <= 16 dividing every expert's byte address of this role."""
    import math
    if isinstance(view, list):
        return math.gcd(16, *(t.data_ptr() for t in view))
    return math.gcd(16, view.data_ptr(), view.stride(0) * view.element_size())


def table(view):
    """``table_of`` / ``table_of_list``, with the byte alignment attached when kernels.tables does not
    record it itself (without it the kernels cannot use 16-byte loads on the weights)."""
    if view is None:
        return None
    t = tables_mod.table_of_list(view) if isinstance(view, list) else tables_mod.table_of(view)
    return t if _HAS_ALIGN_FIELD else _AlignedTable(*t, _alignment(view))


def tables_of(views) -> "ExpertTables":
    return ExpertTables(*(table(v) for v in views))


def make_storage(layout, gated, E, d, h, g, dtype):
    def rnd(*shape, fan_in):
        return (torch.randn(*shape, device=DEVICE, generator=g) / fan_in ** 0.5).to(dtype)

    if layout == "dense":
        return [rnd(E, h, d, fan_in=d)] + ([rnd(E, h, d, fan_in=d)] if gated else []) + [rnd(E, d, h, fan_in=h)]
    if layout == "transposed":
        return [rnd(E, d, h, fan_in=d)] + ([rnd(E, d, h, fan_in=d)] if gated else []) + [rnd(E, h, d, fan_in=h)]
    if layout in ("hf_fused", "interleaved"):
        return [rnd(E, 2 * h, d, fan_in=d), rnd(E, d, h, fan_in=h)]
    if layout == "list":  # a ModuleList of per-expert nn.Linear weights
        return ([rnd(h, d, fan_in=d) for _ in range(E)] + ([rnd(h, d, fan_in=d) for _ in range(E)] if gated else [])
                + [rnd(d, h, fan_in=h) for _ in range(E)])
    raise ValueError(layout)


def role_views(layout, st, gated, E):
    """(gate, up or None, down) as [E, r, c] views of the storage, or lists of E [r, c] tensors."""
    if layout == "dense":
        return st[0], st[1] if gated else None, st[-1]
    if layout == "transposed":
        return st[0].transpose(1, 2), st[1].transpose(1, 2) if gated else None, st[-1].transpose(1, 2)
    if layout == "hf_fused":
        return (*reference.split_gate_up(st[0]), st[1])
    if layout == "interleaved":
        return st[0][:, 0::2], st[0][:, 1::2], st[1]
    if layout == "list":
        return st[:E], st[E:2 * E] if gated else None, st[-E:]
    raise ValueError(layout)


def dense(views):
    return [None if v is None else torch.stack(v) if isinstance(v, list) else v for v in views]


def make_inputs(T, d, h, E, K, ids_mode="router", seed=0, dtype=DTYPE, act="swiglu", bias=False, layout="hf_fused"):
    gated = parse_activation(act).gated
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
    storage = make_storage(layout, gated, E, d, h, g, dtype)
    biases = [None, None, None]
    if bias:
        biases = [(0.5 * torch.randn(E, n, device=DEVICE, generator=g)).to(dtype) if use else None
                  for n, use in ((h, True), (h, gated), (d, True))]
    grad_y = torch.randn(T, d, device=DEVICE, generator=g).to(dtype)
    return dict(x=x, ids=ids, weights=weights, grad_y=grad_y, storage=storage, biases=biases, act=act,
                layout=layout, E=E)


def weight_tables(inp):
    return tables_of(role_views(inp["layout"], inp["storage"], parse_activation(inp["act"]).gated, inp["E"]))


class KernelMoE(torch.autograd.Function):
    """SwiGLU on Hugging Face's fused [E, 2h, d] weight behind autograd, saving what the operator saves;
    the weight gradients are written through tables into [E, 2h, d] / [E, d, h] storage (for timing)."""

    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, policy):
        E = w_gate_up.shape[0]
        plan = dispatch_with_fallback(ids, E, plan_block_m())
        w = tables_of((*reference.split_gate_up(w_gate_up), w_down))
        y, preact = expert_forward(x, weights, w, plan, "swiglu", policy == "activations")
        ctx.save_for_backward(x, weights, w_gate_up, w_down, preact, *plan)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weights, w_gate_up, w_down, preact, *plan = ctx.saved_tensors
        dgu, dd = torch.empty_like(w_gate_up), torch.empty_like(w_down)
        w = tables_of((*reference.split_gate_up(w_gate_up), w_down))
        grads = tables_of((*reference.split_gate_up(dgu), dd))
        dx, dw, *_ = expert_backward(grad_y, x, weights, w, preact, DispatchPlan(*plan), "swiglu", grads=grads)
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


def run_kernels(inp, policy, grads_dtype=None, grads_init=None, accumulate=False):
    """Forward + backward through the kernels: [y, dx, dweights, *weight-gradient storage, *bias gradients]."""
    act = parse_activation(inp["act"])
    plan = dispatch_with_fallback(inp["ids"], inp["E"], plan_block_m())
    w = weight_tables(inp)
    y, preact = expert_forward(inp["x"], inp["weights"], w, plan, act, policy == "activations", *inp["biases"])
    grads = ([g.clone() for g in grads_init] if grads_init is not None
             else [torch.empty_like(s, dtype=grads_dtype or s.dtype) for s in inp["storage"]])
    gw = tables_of(role_views(inp["layout"], grads, act.gated, inp["E"]))
    dx, dweights, *dbias = expert_backward(inp["grad_y"], inp["x"], inp["weights"], w, preact, plan, act,
                                           *inp["biases"], grads=gw, accumulate=accumulate)
    return [y, dx, dweights] + grads + [b for b in dbias if b is not None]


def names_of(inp):
    n_bias = sum(b is not None for b in inp["biases"])
    return ["y", "dx", "dweights"] + [f"dW[{i}]" for i in range(len(inp["storage"]))] + \
        [f"dbias[{i}]" for i in range(n_bias)]


def ref_autograd_fp32(inp):
    """The same outputs from ``moe_ffn_reference`` in fp32, by autograd (weight gradients in storage layout)."""
    act = parse_activation(inp["act"])

    def leaf(t):
        return None if t is None else t.detach().float().requires_grad_(True)
    x, weights = leaf(inp["x"]), leaf(inp["weights"])
    storage = [leaf(s) for s in inp["storage"]]
    biases = [leaf(b) for b in inp["biases"]]
    p = ExpertParams(*dense(role_views(inp["layout"], storage, act.gated, inp["E"])), *biases)
    y = reference.moe_ffn_reference(x, inp["ids"], weights, p, act)
    y.backward(inp["grad_y"].float())

    def grad(t):
        return t.grad if t.grad is not None else torch.zeros_like(t)
    return [y.detach(), grad(x), grad(weights)] + [grad(s) for s in storage] + [grad(b) for b in biases if b is not None]


def ref_torch_path_fp32(inp):
    """The fp32 plain-PyTorch operator path (configs A-D: SwiGLU on a fused weight, no biases)."""
    f = {k: inp[k].float() for k in ("x", "weights", "grad_y")}
    w_gate_up, w_down = (s.float() for s in inp["storage"])
    p = ExpertParams(*reference.split_gate_up(w_gate_up), w_down)
    y, preact, plan = reference.moe_ffn_forward_torch(f["x"], inp["ids"], f["weights"], p, "swiglu", False)
    dx, dw, grads = reference.moe_ffn_backward_torch(f["grad_y"], f["x"], inp["ids"], f["weights"], p, preact, plan,
                                                     "swiglu")
    return [y, dx, dw, torch.cat([grads.gate, grads.up], dim=1), grads.down]


def dweights_scale(inp):
    """sum_n |dH'_n| |H_n| + sum_j |dy_j| |b_down_j| per pair (fp32): dweights = <dH', H> + <dy, b_down> is
    judged against the size of its summands (see tests/kernels/test_expert.py: a cancelling dot product
    over bf16-rounded A|B)."""
    act = parse_activation(inp["act"])
    x, gy, ids = inp["x"].float(), inp["grad_y"].float(), inp["ids"]
    p = ExpertParams(*[None if t is None else t.float() for t in
                       dense(role_views(inp["layout"], inp["storage"], act.gated, inp["E"])) + inp["biases"]])
    scale = torch.zeros(ids.shape, dtype=torch.float32, device=x.device)
    for e in range(inp["E"]):
        t, k = torch.where(ids == e)
        gate = x[t] @ p.gate[e].t() + (0 if p.gate_bias is None else p.gate_bias[e])
        up = None if p.up is None else x[t] @ p.up[e].t() + (0 if p.up_bias is None else p.up_bias[e])
        sc = ((gy[t] @ p.down[e]).abs() * reference.activation_forward(act, gate, up).abs()).sum(1)
        if p.down_bias is not None:
            sc = sc + (gy[t].abs() * p.down_bias[e].float().abs()).sum(1)
        scale[t, k] = sc
    return scale


def check(inp, ref, policy, names, **kw):
    poison_allocator()
    out1 = run_kernels(inp, policy, **kw)
    errs = {n: rel_err(o, r) for n, o, r in zip(names, out1, ref)}
    out2 = run_kernels(inp, policy, **kw)
    bitwise = all(torch.equal(a, b) for a, b in zip(out1, out2))
    return errs, bitwise, out1


def saved_bytes(inp, policy) -> int:
    w_gate_up, w_down = inp["storage"]
    params = {w_gate_up.untyped_storage().data_ptr(), w_down.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = inp["x"].detach().requires_grad_(True)
    w = inp["weights"].detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = KernelMoE.apply(x, inp["ids"], w, w_gate_up, w_down, policy)
    del y
    return sum(seen.values())


def time_config(name, inp, policy):
    T, d = inp["x"].shape
    K = inp["ids"].shape[1]
    w_gate_up, w_down = inp["storage"]
    E, two_h, _ = w_gate_up.shape
    h = two_h // 2
    wgu = w_gate_up.detach().requires_grad_(True)
    wd = w_down.detach().requires_grad_(True)
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
            tabs = tables_of((*reference.split_gate_up(wgu), wd))
            return expert_forward(x, w, tabs, plan, "swiglu", policy == "activations"), plan

    (y0, preact), plan = fwd()
    grad_bufs = [torch.empty_like(wgu), torch.empty_like(wd)]  # what the operator allocates per backward

    def bwd():
        tabs = tables_of((*reference.split_gate_up(wgu), wd))
        grads = tables_of((*reference.split_gate_up(grad_bufs[0]), grad_bufs[1]))
        return expert_backward(gy, x, w, tabs, preact, plan, "swiglu", grads=grads)

    step()
    step()  # autotuning and compilation happen here, outside the timed region
    sync()
    est = bench(step, warmup=1, rep=1, return_mode="median")
    rep = max(200.0, min(1500.0, 12 * est))
    ms = bench(step, warmup=2 * est, rep=rep, return_mode="median")
    ms_fwd = bench(lambda: fwd(), warmup=est, rep=rep / 2, return_mode="median")
    ms_bwd = bench(bwd, warmup=est, rep=rep / 2, return_mode="median")
    del y0
    grad_bufs.clear()
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


def micro(result, name="A") -> None:
    """Variants of the backward kernels at one config, raw launches (no autotuner), to see what limits them.
    dW variants: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, TMA for the slot-ordered operand, 32-bit
    row offsets); the others are listed where they are timed."""
    T, d, h, E, K = CONFIGS[name]
    N = T * K
    inp = make_inputs(T, d, h, E, K, seed=2)
    plan = dispatch_with_fallback(inp["ids"], E, plan_block_m())
    x, gy, w = inp["x"], inp["grad_y"], inp["weights"]
    wgu, wd = inp["storage"]
    wtabs = weight_tables(inp)
    _, preact = expert_forward(x, w, wtabs, plan, "swiglu", True)
    dpre = torch.randn(N, 2 * h, device=DEVICE, dtype=DTYPE)
    hw = torch.randn(N, h, device=DEVICE, dtype=DTYPE)
    tok = (plan.token_index.long() // K)
    gy_slots, x_slots = gy[tok], x[tok]  # pre-gathered copies: only to measure what the gather costs
    # read through this index, the copies' rows are the slots themselves: the same kernel, the same index loads,
    # contiguous rows
    ident = torch.arange(N, device=DEVICE, dtype=torch.int32) * K
    out_dd = torch.empty_like(wd)
    out_dg = torch.empty(E, h, d, device=DEVICE, dtype=DTYPE)
    t_dd, t_dg = table(out_dd), table(out_dg)
    t_dg_t = t_dg._replace(rows=t_dg.cols, cols=t_dg.rows, stride_r=t_dg.stride_c, stride_c=t_dg.stride_r)
    rows = []
    kern = expert_bwd._expert_dw_kernel
    log(f"micro at config {name}")
    off = plan.offsets

    def dw_launch(a, b, out, bm, bn, bk, nw, ns, gm, tma=False, rows32=None, index=None):
        m_dim, n_dim = out.rows, out.cols
        grid = (E * triton.cdiv(m_dim, bm) * triton.cdiv(n_dim, bn),)
        # rows32 None: the heuristics decide (ROWS32 when the offsets fit); 0/1: the jit function, pinned
        k, extra = (kern, {}) if rows32 is None else (kern.fn, dict(
            EVEN_M=m_dim % bm == 0, EVEN_N=n_dim % bn == 0, ROWS32=rows32))
        b_desc = TensorDescriptor.from_tensor(b, [bk, bn]) if tma else b
        k[grid](a, b, b_desc, out.ptrs, plan.token_index if index is None else index, off, m_dim, n_dim, K, 0, N, N + 1,
                a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride_r, out.stride_c,
                OUT_FP32=False, ACCUMULATE=False, MAY_ADD=False, TMA=tma, O_ALIGN=expert_fwd.table_align(out),
                DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns,
                **extra)

    flops_dd, flops_dg = 2 * N * d * h, 2 * N * d * h
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M, descriptor for the slot operand, 32-bit row offsets
    # (None: the heuristic)). The gathered rows' indices take a stage: 7 and 5 stages hold 4 and 3 tile buffers.
    # dW_gate runs transposed, (x[tok].T @ dA).T, as the operator does.
    variants = _gm_sweep([(128, 256, 64, 8, 7, 8, True, None), (128, 256, 64, 8, 5, 8, True, None),
                          (128, 256, 64, 8, 5, 8, False, None)], [0], 5)
    if "dw" in MICRO_KERNELS:
        base = None
        for v in variants:
            try:
                ms1 = bench(lambda: dw_launch(gy, hw, t_dd, *v), warmup=50, rep=200)
                ms2 = bench(lambda: dw_launch(x, dpre[:, :h], t_dg_t, *v), warmup=50, rep=200)
                if base is None:
                    base = (out_dd.clone(), out_dg.clone())
                same = bool(torch.equal(out_dd, base[0]) and torch.equal(out_dg, base[1]))
                rows.append(dict(kernel="dw", variant=str(v), dW_down_ms=ms1, dW_down_tflops=flops_dd / ms1 / 1e9,
                                 dW_gate_ms=ms2, dW_gate_tflops=flops_dg / ms2 / 1e9, bitwise_equal_to_first=same,
                                 max_abs_diff=max(float((out_dd.float() - base[0].float()).abs().max()),
                                                  float((out_dg.float() - base[1].float()).abs().max()))))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="dw", variant=str(v), error=f"{type(exc).__name__}: {str(exc)[:400]}"))
            log(f"micro {rows[-1]}")
        v = variants[0]
        ms1 = bench(lambda: dw_launch(gy_slots, hw, t_dd, *v, index=ident), warmup=50, rep=200)
        ms2 = bench(lambda: dw_launch(x_slots, dpre[:, :h], t_dg_t, *v, index=ident), warmup=50, rep=200)
        rows.append(dict(kernel="dw no gather (pre-gathered copies)", variant=str(v), dW_down_ms=ms1,
                         dW_down_tflops=flops_dd / ms1 / 1e9, dW_gate_ms=ms2, dW_gate_tflops=flops_dg / ms2 / 1e9))
        log(f"micro {rows[-1]}")
        bounds = off.tolist()

        def cublas(a, b, out):
            for e in range(E):
                lo, hi = bounds[e], bounds[e + 1]
                torch.mm(a[lo:hi].t(), b[lo:hi], out=out[e])
        ms1 = bench(lambda: cublas(gy_slots, hw, out_dd), warmup=50, rep=200)
        ms2 = bench(lambda: cublas(dpre[:, :h], x_slots, out_dg), warmup=50, rep=200)
        rows.append(dict(kernel="cuBLAS per-expert mm (pre-gathered)", dW_down_ms=ms1, dW_down_tflops=flops_dd / ms1 / 1e9,
                         dW_gate_ms=ms2, dW_gate_tflops=flops_dg / ms2 / 1e9))
        log(f"micro {rows[-1]}")

    part = torch.zeros(h // 64 + 8, N, device=DEVICE, dtype=torch.float32)
    num_tiles = plan.tile_expert.numel()
    g_t, u_t, d_t = wtabs
    tile0 = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bm = plan_block_m()
    hid = torch.empty(N, h, device=DEVICE, dtype=DTYPE)
    pre_out = torch.empty(N, 2 * h, device=DEVICE, dtype=DTYPE)
    up_ref = None
    # up: (BLOCK_N, BLOCK_K, warps, stages, GROUP_M); the first two are the tuned candidates
    if "up" in MICRO_KERNELS:
        up_mode = expert_fwd.weight_tma_mode([(t.stride_c, t.stride_r) for t in (g_t, u_t)],
                                             expert_fwd.table_align(g_t, u_t), 2, x.device)
        down_mode = expert_fwd.weight_tma_mode([(d_t.stride_c, d_t.stride_r)], expert_fwd.table_align(d_t), 2, x.device)
        dx_mode = expert_fwd.weight_tma_mode([(t.stride_r, t.stride_c) for t in (g_t, u_t)],
                                             expert_fwd.table_align(g_t, u_t), 2, x.device)
        log(f"descriptor modes: up {up_mode}, down {down_mode}, dX {dx_mode}")
        # (BLOCK_N, BLOCK_K, warps, stages, GROUP_M, descriptors for the weights)
        for (bn, bk, nw, ns, gm, tma), kf in _k_sweep(_gm_sweep(
                [(128, 64, 8, 3, 8, False), (128, 64, 8, 3, 8, True), (128, 64, 8, 4, 8, False), (128, 64, 8, 4, 8, True),
                 (64, 64, 4, 4, 8, True), (128, 128, 8, 2, 8, True)], [1, 3], 4), 3):
            grid = (num_tiles * triton.cdiv(h, bn),)
            dk = max(bk, int(d * kf) // bk * bk)
            try:
                ms = bench(lambda: expert_fwd._expert_up_kernel[grid](
                    x, g_t.ptrs, u_t.ptrs, x, x, hid, pre_out, plan.token_index, off, plan.tile_expert, plan.tile_start,
                    tile0, num_tiles, num_tiles, 0, N, dk, h, K, x.stride(0), x.stride(1), g_t.stride_r, g_t.stride_c,
                    u_t.stride_r, u_t.stride_c, hid.stride(0), hid.stride(1), pre_out.stride(0), pre_out.stride(1),
                    1.0, 0.0, ACT=expert_fwd.ACT_CODES["swiglu"], GATED=True, HAS_GATE_BIAS=False, HAS_UP_BIAS=False,
                    W_ALIGN=expert_fwd.table_align(g_t, u_t), W_TMA=up_mode if tma else 0, SAVE_PREACT=True, DOT_PRECISION="tf32", BLOCK_M=bm,
                    BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw, num_stages=ns), warmup=50, rep=200)
                up_ref = hid.clone() if up_ref is None else up_ref
                rows.append(dict(kernel="up", variant=str((bn, bk, nw, ns, gm, tma)), k=dk, ms=ms, tflops=4 * N * dk * h / ms / 1e9,
                                 bitwise_equal_to_first=bool(torch.equal(hid, up_ref))))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="up", variant=str((bn, bk, nw, ns, gm, tma)), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"micro {rows[-1]}")
        del up_ref
        y_slots = torch.empty(N, d, device=DEVICE, dtype=DTYPE)
        # down: forward Y = H @ W_down.T (k = h), backward dX = dA @ W_gate + dB @ W_up (k = 2 x h)
        down_ref = None
        for (bn, bk, nw, ns, gm, tma), kf in _k_sweep(_gm_sweep(
                [(256, 64, 8, 3, 8, False), (256, 64, 8, 3, 8, True), (256, 64, 8, 4, 8, False), (256, 64, 8, 4, 8, True),
                 (128, 64, 8, 4, 8, True), (128, 128, 8, 3, 8, True)], [1], 4), 1):
            grid = (num_tiles * triton.cdiv(d, bn),)
            hk = max(bk, int(h * kf) // bk * bk)
            meta = dict(HAS_BIAS=False, DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                        num_warps=nw, num_stages=ns)
            try:
                ms_y = bench(lambda: expert_fwd._expert_down_kernel[grid](
                    hid, d_t.ptrs, d_t.ptrs, d_t.ptrs, d_t.ptrs, hid, y_slots, off, plan.tile_expert, plan.tile_start, tile0, num_tiles,
                    num_tiles, 0, N, d, hk, hid.stride(0), hid.stride(1), d_t.stride_c, d_t.stride_r, d_t.stride_c,
                    d_t.stride_r, y_slots.stride(0), y_slots.stride(1), TWO_B=False,
                    B_ALIGN=expert_fwd.table_align(d_t), B_TMA=down_mode if tma else 0, **meta), warmup=50, rep=200)
                down_ref = y_slots.clone() if down_ref is None else down_ref
                same_y = bool(torch.equal(y_slots, down_ref))
                ms_dx = bench(lambda: expert_fwd._expert_down_kernel[grid](
                    dpre, g_t.ptrs, u_t.ptrs, g_t.ptrs, u_t.ptrs, dpre, y_slots, off, plan.tile_expert, plan.tile_start, tile0, num_tiles,
                    num_tiles, 0, N, d, hk, dpre.stride(0), dpre.stride(1), g_t.stride_r, g_t.stride_c, u_t.stride_r,
                    u_t.stride_c, y_slots.stride(0), y_slots.stride(1), TWO_B=True,
                    B_ALIGN=expert_fwd.table_align(g_t, u_t), B_TMA=dx_mode if tma else 0, **meta), warmup=50, rep=200)
                rows.append(dict(kernel="down", variant=str((bn, bk, nw, ns, gm, tma)), k=hk, y_ms=ms_y,
                                 y_tflops=2 * N * d * hk / ms_y / 1e9, dx_ms=ms_dx, dx_tflops=4 * N * d * hk / ms_dx / 1e9,
                                 y_bitwise_equal_to_first=same_y))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="down", variant=str((bn, bk, nw, ns, gm, tma)), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"micro {rows[-1]}")
        del y_slots, pre_out, down_ref
    if "dh" in MICRO_KERNELS:
        for (bn, bk, nw, ns, split, gm), kf in _k_sweep(
                [(64, 64, 8, 4, 2, 16), (64, 128, 8, 3, 2, 8), (64, 64, 4, 4, 2, 16), (64, 64, 8, 3, 2, 16),
                 (64, 64, 8, 4, 1, 8)], 0):
            grid = (num_tiles * triton.cdiv(h, bn * split),)
            dk = max(bk, int(d * kf) // bk * bk)
            try:
                ms = bench(lambda: expert_bwd._expert_dh_kernel[grid](
                    gy, x, g_t.ptrs, u_t.ptrs, d_t.ptrs, x, x, w, preact, dpre, hw, part, plan.token_index, off,
                    plan.tile_expert, plan.tile_start, tile0, num_tiles, num_tiles, 0, N, dk, h, K, gy.stride(0), gy.stride(1), x.stride(0),
                    x.stride(1), g_t.stride_r, g_t.stride_c, u_t.stride_r, u_t.stride_c, d_t.stride_r, d_t.stride_c,
                    w.stride(0), w.stride(1), preact.stride(0), preact.stride(1), dpre.stride(0), dpre.stride(1),
                    hw.stride(0), hw.stride(1), part.stride(0), 1.0, 0.0,
                    ACT=expert_fwd.ACT_CODES["swiglu"], GATED=True, HAS_GATE_BIAS=False, HAS_UP_BIAS=False,
                    W_ALIGN=expert_fwd.table_align(d_t), RECOMPUTE=False, DOT_PRECISION="tf32", CHUNK_N=64,
                    SPLIT_N=split, BLOCK_M=plan_block_m(), BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw,
                    num_stages=ns), warmup=50, rep=200)
                rows.append(dict(kernel="dh", variant=str((bn, bk, nw, ns, split, gm)), k=dk, ms=ms,
                                 tflops=2 * N * dk * h / ms / 1e9))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="dh", variant=str((bn, bk, nw, ns, split, gm)), error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            log(f"micro {rows[-1]}")
    if "dhsplit" in MICRO_KERNELS:
        # dh in one launch (PHASE 0, the tuned candidates) against its GEMM (PHASE 1: dH' into hw) followed by
        # its epilogue (PHASE 2: dH' read back from hw); outputs compared with the first PHASE 0 variant
        part_ref = torch.zeros_like(part)

        def dh_launch(phase, bn, bk, nw, ns, split, gm, out_part):
            grid = (num_tiles * triton.cdiv(h, bn * split),)
            expert_bwd._expert_dh_kernel[grid](
                gy, x, g_t.ptrs, u_t.ptrs, d_t.ptrs, x, x, w, preact, dpre, hw, out_part, plan.token_index, off,
                plan.tile_expert, plan.tile_start, tile0, num_tiles, num_tiles, 0, N, d, h, K, gy.stride(0),
                gy.stride(1), x.stride(0), x.stride(1), g_t.stride_r, g_t.stride_c, u_t.stride_r, u_t.stride_c,
                d_t.stride_r, d_t.stride_c, w.stride(0), w.stride(1), preact.stride(0), preact.stride(1),
                dpre.stride(0), dpre.stride(1), hw.stride(0), hw.stride(1), out_part.stride(0), 1.0, 0.0,
                ACT=expert_fwd.ACT_CODES["swiglu"], GATED=True, HAS_GATE_BIAS=False, HAS_UP_BIAS=False,
                W_ALIGN=expert_fwd.table_align(d_t), RECOMPUTE=False, DOT_PRECISION="tf32", CHUNK_N=64,
                SPLIT_N=split, BLOCK_M=plan_block_m(), BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw,
                num_stages=ns, PHASE=phase)

        ref = None
        for v in [(64, 64, 8, 4, 2, 16), (64, 128, 8, 3, 2, 8)]:
            try:
                ms = bench(lambda: dh_launch(0, *v, part_ref), warmup=50, rep=200)
                if ref is None:
                    ref = (dpre.clone(), hw.clone(), part_ref[:h // 64].sum(0))
                rows.append(dict(kernel="dh", variant=str(v), phase=0, ms=ms, tflops=2 * N * d * h / ms / 1e9))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="dh", variant=str(v), phase=0, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"micro {rows[-1]}")
        gemm_ms = {}
        for v in [(256, 64, 8, 3, 1, 8), (128, 64, 8, 4, 2, 8)]:
            try:
                gemm_ms[v] = bench(lambda: dh_launch(1, *v, part), warmup=50, rep=200)
                rows.append(dict(kernel="dh split: GEMM", variant=str(v), ms=gemm_ms[v],
                                 tflops=2 * N * d * h / gemm_ms[v] / 1e9))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="dh split: GEMM", variant=str(v), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"micro {rows[-1]}")
        gv = min(gemm_ms, key=gemm_ms.get) if gemm_ms else (256, 64, 8, 3, 1, 8)
        moved = 12 * N * h  # bytes: dH', A, B read; dA, dB, w*H written (bf16)
        # the epilogue overwrites its input, so it is timed after the GEMM: (GEMM + epilogue) - GEMM
        for v in [(64, 64, 8, 1, 2, 8), (64, 64, 4, 1, 2, 8), (64, 64, 4, 1, 1, 8), (128, 64, 8, 1, 1, 8),
                  (128, 64, 8, 1, 2, 8), (64, 64, 8, 2, 2, 8)]:
            try:
                def both():
                    dh_launch(1, *gv, part)
                    dh_launch(2, *v, part)
                ms12 = bench(both, warmup=20, rep=100)
                both()
                errs = {}
                if ref is not None:
                    for nm, got, want in (("dpre", dpre, ref[0]), ("hw", hw, ref[1]),
                                          ("dweights", part[:h // 64].sum(0), ref[2])):
                        errs[nm] = float((got.float() - want.float()).norm() / want.float().norm())
                act = ms12 - gemm_ms.get(gv, 0.0)
                rows.append(dict(kernel="dh split: epilogue", variant=str(v), gemm=str(gv), both_ms=ms12, act_ms=act,
                                 act_tb_s=moved / act / 1e9 if act > 0 else None, rel_diff_to_phase0=errs))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(kernel="dh split: epilogue", variant=str(v), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"micro {rows[-1]}")
    for r in rows:
        r["config"] = name
    result.setdefault("micro", []).extend(rows)


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
    commit = os.environ.get("MOEBLAZE_COMMIT", commit)
    meta = dict(device="cpu (dry run)" if DRY else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), commit=commit, kernels_dirty=bool(dirty),
                block_m=plan_block_m(), pinned=os.environ.get(autotune.ENV_VAR, ""),
                table_align_field=_HAS_ALIGN_FIELD, parts=PARTS, features_pin=FEATURES_PIN)
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

    # 2a. small ragged shapes vs the fp32 autograd reference: SwiGLU, then activations, biases, weight layouts
    for part, cases in (("small", SMALL), ("features", FEATURES)):
        if part not in PARTS:
            continue
        t_part = time.time()
        with pinned(FEATURES_PIN if part == "features" else None):
            for T, d, h, E, K, mode, act, bias, layout in cases:
                inp = make_inputs(T, d, h, E, K, ids_mode=mode, seed=T, act=act, bias=bias, layout=layout)
                ref = ref_autograd_fp32(inp)
                names = names_of(inp)
                scale = float(dweights_scale(inp).norm())
                for policy in POLICIES:
                    errs, bitwise, _ = check(inp, ref, policy, names)
                    errs["dweights"] = errs["dweights"] * float(ref[2].float().norm()) / max(scale, 1e-30)  # vs summands
                    rec = dict(shape=(T, d, h, E, K), ids=mode, act=act, bias=bias, layout=layout, policy=policy,
                               errs=errs, bitwise=bitwise, pinned=FEATURES_PIN if part == "features" else "")
                    result["small"].append(rec)
                    log(f"{part} {rec}")
                del inp, ref
        log(f"part {part}: {time.time() - t_part:.0f} s")

    # 2b. float32 gradient tables, accumulate=True onto random float32 gradients (the autotuner's probe runs
    # on a scratch buffer first: the result must still be C_before + the gradient)
    t_part = time.time()
    for T, d, h, E, K, act, layout in ACCUMULATE if "accumulate" in PARTS else []:
        inp = make_inputs(T, d, h, E, K, ids_mode="empty_expert", seed=T, act=act, bias=True, layout=layout)
        ref = ref_autograd_fp32(inp)
        names = names_of(inp)
        g = torch.Generator(device=DEVICE).manual_seed(5)
        before = [torch.randn(s.shape, device=DEVICE, generator=g) for s in inp["storage"]]
        n_st = len(before)
        for policy in POLICIES:
            errs, bitwise, out = check(inp, ref, policy, names, grads_init=before, accumulate=True)
            for i in range(n_st):  # the weight gradients: what was added
                errs[names[3 + i]] = rel_err(out[3 + i] - before[i], ref[3 + i])
            untouched = all(torch.equal(o[1], b[1]) for o, b in zip(out[3:3 + n_st], before)) \
                if layout != "list" else all(torch.equal(out[3 + i], before[i]) for i in range(1, n_st, E))
            rec = dict(shape=(T, d, h, E, K), act=act, layout=layout, policy=policy, grads="float32, accumulate",
                       errs=errs, bitwise=bitwise, empty_expert_untouched=untouched)
            result["small"].append(rec)
            log(f"accumulate {rec}")
        del inp, ref, before
    log(f"part accumulate: {time.time() - t_part:.0f} s")

    for name in [c for c in os.environ.get("MB_MICRO", "").split(",") if c in CONFIGS]:
        micro(result, name)
        if not DRY:
            torch.cuda.empty_cache()

    # 2c + 3. configs A-D: correctness vs the fp32 torch path, then timing
    chosen = os.environ.get("MB_CONFIGS", ",".join(CONFIGS)).split(",")
    for name, (T, d, h, E, K) in [(c, CONFIGS[c]) for c in chosen] if "configs" in PARTS else []:
        if time.time() - T0 > BUDGET_S:
            log(f"budget reached: skipping config {name}")
            continue
        inp = make_inputs(T, d, h, E, K, seed=1)
        ref = ref_torch_path_fp32(inp)
        for policy in POLICIES:
            errs, bitwise, _ = check(inp, ref, policy, names_of(inp))
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
    worst_small = max((max(r["errs"].values()) for r in result["small"]), default=float("nan"))
    all_bitwise = all(r["bitwise"] for r in result["small"] + result["configs"])
    untouched = all(r.get("empty_expert_untouched", True) for r in result["small"])
    lines.append(f"small ragged shapes ({len(result['small'])} runs: activations, biases, layouts, fp32/accumulated "
                 f"gradients): worst rel err {worst_small:.2e} (dweights against its summands' size); "
                 f"bitwise deterministic everywhere: {all_bitwise}; accumulate leaves empty experts untouched: {untouched}")
    if not _HAS_ALIGN_FIELD:
        lines.append("note: kernels.tables.WeightTable has no `align` field; this script attached the alignment itself")
    worst = sorted(result["small"], key=lambda r: -max(r["errs"].values()))[:3]
    lines += ["worst small runs: " + "; ".join(f"{r.get('act')} {r.get('layout')} {r['shape']} {r['policy']}: "
                                                 f"{max(r['errs'], key=r['errs'].get)}={max(r['errs'].values()):.1e}"
                                                 for r in worst)]
    lines += ["", "| config | policy | max rel err (y, dx, dw, dW_gate_up, dW_down) | bitwise |", "|---|---|---|---|"]
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
