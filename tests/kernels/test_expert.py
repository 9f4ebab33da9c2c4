"""Fused expert kernels (moeblaze_fx/kernels/expert_fwd.py, expert_bwd.py) against the references.

CPU: the kernels run under the Triton interpreter (tests/conftest.py) in float32 with the interpreter's
tiny tiles (16 rows), on shapes chosen to hit every ragged path; forward output, saved pre-activations and
all four gradients are compared with ``moe_ffn_reference`` differentiated by autograd in float64.
GPU (``cuda`` marker): bf16 against the same reference in float32, relative error <= 1e-2, and two runs
bitwise identical.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeblaze_fx.kernels import autotune
from moeblaze_fx.kernels.expert_bwd import expert_backward
from moeblaze_fx.kernels.expert_fwd import expert_forward, plan_block_m
from moeblaze_fx.kernels.reference import (
    DispatchPlan,
    dispatch_reference,
    moe_ffn_forward_torch,
    moe_ffn_reference,
)

POLICIES = ("activations", "recompute")


class _KernelMoE(torch.autograd.Function):
    """The expert kernels behind autograd, saving what the operator saves (x, plan, weights, A|B)."""

    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, policy):
        plan = dispatch_reference(ids, w_gate_up.shape[0], block_m=plan_block_m())
        y, preact = expert_forward(x, weights, w_gate_up, w_down, plan, "swiglu", policy == "activations")
        ctx.save_for_backward(x, weights, w_gate_up, w_down, preact, *plan)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weights, w_gate_up, w_down, preact, *plan = ctx.saved_tensors
        dx, dw, dgu, dd = expert_backward(grad_y, x, weights, w_gate_up, w_down, preact, DispatchPlan(*plan), "swiglu")
        return dx, None, dw, dgu, dd, None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    denom = ref.norm()
    return float((out - ref).norm() / denom) if denom > 0 else float(out.norm())


def make_case(T, d, h, E, K, *, device="cpu", dtype=torch.float32, ids_mode="random", seed=0,
              transposed_gate_up=False, weights_dtype=None):
    """Random inputs; ids_mode shapes the routing (each mode documents the path it exercises)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    if ids_mode == "empty_expert":  # expert 1 gets no token: zero weight gradients, no tiles
        ids = torch.where(ids == 1, 0, ids)
    elif ids_mode == "one_expert":  # every token's first choice is expert 2: one long ragged group
        ids[:, 0] = 2
        if K > 1:
            ids[:, 1:] = torch.where(ids[:, 1:] == 2, 0, ids[:, 1:])
    elif ids_mode == "sentinel":  # ids >= E mean "no expert"; token 0 is routed nowhere at all
        ids = torch.where(torch.rand(T, K, generator=g) < 0.3, E + torch.randint(0, 3, (T, K), generator=g), ids)
        ids[0] = E
    elif ids_mode == "all_experts":  # K == E: every token visits every expert
        ids = torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    weights = torch.rand(T, K, generator=g) + 0.1
    w_gate_up = torch.randn(E, 2 * h, d, generator=g) / d ** 0.5
    w_down = torch.randn(E, d, h, generator=g) / h ** 0.5
    grad_y = torch.randn(T, d, generator=g)
    wdt = weights_dtype or dtype
    out = dict(x=x.to(device, dtype), ids=ids.to(device), weights=weights.to(device, wdt),
               w_gate_up=w_gate_up.to(device, dtype), w_down=w_down.to(device, dtype), grad_y=grad_y.to(device, dtype))
    if transposed_gate_up:  # stored [E, d, 2h], handed over as the [E, 2h, d] view
        out["w_gate_up"] = out["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
    return out


def run_kernels(case, policy):
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("x", "weights", "w_gate_up", "w_down")}
    y = _KernelMoE.apply(leaves["x"], case["ids"], leaves["weights"], leaves["w_gate_up"], leaves["w_down"], policy)
    y.backward(case["grad_y"])
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def run_reference(case, dtype):
    leaves = {k: case[k].detach().to(dtype).requires_grad_(True) for k in ("x", "weights", "w_gate_up", "w_down")}
    y = moe_ffn_reference(leaves["x"], case["ids"], leaves["weights"], leaves["w_gate_up"], leaves["w_down"])
    y.backward(case["grad_y"].to(dtype))
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def dweights_scale(case) -> torch.Tensor:
    """sum_n |dH'_n| * |H_n| per pair, in float64: the size of the summands of dweights = <dH', H>.

    dweights is a dot product that can cancel: with A|B rounded to bf16 (as the operator saves them) its error
    is bounded by eps * this scale, not by eps * |dweights|; with a handful of pairs (T = 1) ||dweights|| alone
    is no yardstick (the bf16 torch path misses by 9% there). Routed pairs only; unrouted pairs get 0."""
    x, gy = case["x"].double(), case["grad_y"].double()
    wgu, wd, ids = case["w_gate_up"].double(), case["w_down"].double(), case["ids"]
    E, two_h, _ = wgu.shape
    h = two_h // 2
    scale = torch.zeros(ids.shape, dtype=torch.float64, device=x.device)
    for e in range(E):
        t, k = torch.where(ids == e)
        pre = x[t] @ wgu[e].t()
        hid = F.silu(pre[:, :h]) * pre[:, h:]
        scale[t, k] = ((gy[t] @ wd[e]).abs() * hid.abs()).sum(1)
    return scale


def check_against_reference(case, policy, tol, ref_dtype, tol_overrides=None):
    y, grads = run_kernels(case, policy)
    y_ref, grads_ref = run_reference(case, ref_dtype)
    errs = {"y": rel_err(y, y_ref)}
    errs.update({f"d{k}": rel_err(grads[k], grads_ref[k]) for k in grads})
    # dweights against the size of its summands (see dweights_scale); never looser than the plain check by
    # more than that ratio, and still O(1) for a wrong kernel.
    scale = dweights_scale(case).norm()
    if scale > 0:
        errs["dweights"] = float((grads["weights"].double() - grads_ref["weights"].double()).norm() / scale)
    assert y.dtype == case["x"].dtype and grads["weights"].dtype == case["weights"].dtype
    assert grads["w_gate_up"].stride() == case["w_gate_up"].stride()
    tols = {k: (tol_overrides or {}).get(k, tol) for k in errs}
    bad = {k: v for k, v in errs.items() if not v <= tols[k]}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"
    return y, grads


# (T, d, h, E, K, ids_mode, why)
CPU_CASES = [
    (37, 40, 24, 5, 3, "empty_expert", "T, d, h not multiples of the tile; an expert with no token"),
    (33, 32, 32, 4, 2, "one_expert", "every token on one expert; d, h multiples of the tile (mask-free path)"),
    (29, 24, 40, 3, 2, "sentinel", "ids >= E (no expert), a token routed nowhere"),
    (1, 20, 12, 3, 2, "random", "T = 1: one token, two one-row tiles"),
    (9, 16, 16, 4, 4, "all_experts", "K = E"),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,why", CPU_CASES, ids=[c[5] + f"-T{c[0]}" for c in CPU_CASES])
def test_expert_kernels_fp32_match_reference(T, d, h, E, K, ids_mode, why, policy):
    case = make_case(T, d, h, E, K, ids_mode=ids_mode)
    check_against_reference(case, policy, tol=1e-5, ref_dtype=torch.float64)


def test_preact_matches_torch_path_in_slot_order():
    # The saved A|B must be the torch path's, row for row, in slot order (routed slots only: the rest
    # are never read).
    case = make_case(37, 40, 24, 5, 3, ids_mode="sentinel", seed=3)
    plan = dispatch_reference(case["ids"], 5, block_m=plan_block_m())
    _, preact = expert_forward(case["x"], case["weights"], case["w_gate_up"], case["w_down"], plan, "swiglu", True)
    _, preact_ref, plan_ref = moe_ffn_forward_torch(case["x"], case["ids"], case["weights"], case["w_gate_up"],
                                                    case["w_down"], "swiglu", True)
    routed = int(plan.offsets[-1])
    assert preact.shape == (37 * 3, 48)
    assert torch.equal(plan.token_index, plan_ref.token_index)
    assert rel_err(preact[:routed], preact_ref[:routed]) < 1e-6
    _, empty = expert_forward(case["x"], case["weights"], case["w_gate_up"], case["w_down"], plan, "swiglu", False)
    assert empty.shape == (0,)


def test_any_strides_and_routing_weight_dtype():
    # w_gate_up as a transposed storage view, routing weights in float16 while x is float32.
    case = make_case(21, 24, 20, 3, 2, transposed_gate_up=True, weights_dtype=torch.float16, seed=5)
    assert not case["w_gate_up"].is_contiguous()
    # dweights comes back in float16: its rounding (2**-11 relative) bounds the error.
    check_against_reference(case, "activations", tol=1e-5, ref_dtype=torch.float64, tol_overrides={"dweights": 1e-3})


def test_fp16_under_interpreter():
    case = make_case(19, 32, 16, 3, 2, dtype=torch.float16, seed=7)
    check_against_reference(case, "recompute", tol=1e-2, ref_dtype=torch.float64)


def test_empty_batch():
    # T = 0: no launch, empty outputs, zero weight gradients.
    case = make_case(0, 16, 16, 3, 2)
    y, grads = run_kernels(case, "activations")
    assert y.shape == (0, 16)
    assert torch.count_nonzero(grads["w_gate_up"]) == 0 and torch.count_nonzero(grads["w_down"]) == 0


def test_deterministic_under_interpreter():
    case = make_case(37, 40, 24, 5, 3, ids_mode="sentinel", seed=11)
    y1, g1 = run_kernels(case, "recompute")
    y2, g2 = run_kernels(case, "recompute")
    assert torch.equal(y1, y2) and all(torch.equal(g1[k], g2[k]) for k in g1)


def test_pinned_config(monkeypatch):
    # MOEBLAZE_KERNEL_CONFIG pins one configuration: plan_block_m follows it, and results still match.
    # split_n=2: the dh kernel's two side-by-side tiles (the interpreter default runs split_n=1).
    monkeypatch.setenv(autotune.ENV_VAR, "block_m=32,block_n=16,block_k=16,num_warps=4,num_stages=1,group_m=1,split_n=2")
    assert plan_block_m() == 32
    case = make_case(45, 40, 36, 3, 2, ids_mode="empty_expert", seed=13)  # h=36: a half-empty second tile
    check_against_reference(case, "activations", tol=1e-5, ref_dtype=torch.float64)
    case = make_case(40, 32, 64, 3, 2, ids_mode="sentinel", seed=17)  # h a multiple of 2 x block_n
    check_against_reference(case, "activations", tol=1e-5, ref_dtype=torch.float64)


@pytest.mark.parametrize("spec", ["block_m=12", "block_m", "blockm=16", "block_n=x", "split_n=3"])
def test_pinned_config_rejects_bad_specs(monkeypatch, spec):
    monkeypatch.setenv(autotune.ENV_VAR, spec)
    with pytest.raises(ValueError, match=autotune.ENV_VAR):
        plan_block_m()


def test_plan_with_wrong_block_m_is_rejected():
    case = make_case(70, 16, 16, 2, 2)
    plan = dispatch_reference(case["ids"], 2, block_m=4 * plan_block_m())
    with pytest.raises(ValueError, match="plan_block_m"):
        expert_forward(case["x"], case["weights"], case["w_gate_up"], case["w_down"], plan, "swiglu", True)


def test_bad_inputs_raise_clear_errors():
    case = make_case(8, 16, 16, 2, 2)
    plan = dispatch_reference(case["ids"], 2, block_m=plan_block_m())
    with pytest.raises(ValueError, match="activation"):
        expert_forward(case["x"], case["weights"], case["w_gate_up"], case["w_down"], plan, "gelu", True)
    with pytest.raises(TypeError, match="dtype"):
        expert_forward(case["x"], case["weights"], case["w_gate_up"].double(), case["w_down"], plan, "swiglu", True)
    with pytest.raises(ValueError, match="w_down"):
        expert_forward(case["x"], case["weights"], case["w_gate_up"], case["w_down"][:, :, :8], plan, "swiglu", True)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 against the float32 reference, determinism.
# ---------------------------------------------------------------------------------------------
# (T, d, h, E, K, ids_mode, why)
CUDA_CASES = [
    (1000, 320, 200, 8, 4, "empty_expert", "ragged tiles, d and h not multiples of 64, an empty expert"),
    (513, 256, 512, 6, 2, "sentinel", "tile-multiple d, h (mask-free fast paths); unrouted pairs"),
    (700, 128, 192, 4, 2, "one_expert", "one expert holds every token"),
    (1, 64, 64, 3, 2, "random", "T = 1"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,why", CUDA_CASES, ids=[c[5] + f"-T{c[0]}" for c in CUDA_CASES])
def test_expert_kernels_bf16_cuda(T, d, h, E, K, ids_mode, why, policy):
    case = make_case(T, d, h, E, K, device="cuda", dtype=torch.bfloat16, ids_mode=ids_mode, seed=T)
    y1, g1 = check_against_reference(case, policy, tol=1e-2, ref_dtype=torch.float32)
    y2, g2 = run_kernels(case, policy)
    assert torch.equal(y1, y2), "forward is not bitwise deterministic"
    for k in g1:
        assert torch.equal(g1[k], g2[k]), f"gradient of {k} is not bitwise deterministic"
