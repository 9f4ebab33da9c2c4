"""Fused expert forward: gather-on-the-fly up projection, down projection, deterministic combine.

Notation: T tokens, K choices per token, N = T*K pairs, E experts, d model width, h expert width.
A *pair* p = t*K + k is one entry of ``ids``; a *slot* is its row in the expert-major order of the
:class:`~moeblaze_fx.kernels.reference.DispatchPlan` (``token_index[slot] = p``, ``slot_of[p] = slot``).

Data flow (three launches)::

    x [T, d] ──(token_index: slot -> pair p -> token p // K, read while loading tiles)──┐
    w_gate_up [E, 2h, d] ──────────────────────────────────────────────────────────────┤
        _expert_up_kernel      per row tile of one expert: A = x_rows @ Wg.T, B = x_rows @ Wu.T in one
                               pass over d; epilogue writes A|B (when saving) and H = silu(A) * B
        ──▶ preact [N, 2h] (saved, "activations" policy)   H [N, h] (transient)
    w_down [E, d, h] ─────────────────────────────────────────────────────────────────┐
        _expert_down_kernel    per row tile: Y = H @ W_down[e].T      ──▶ Y [N, d] (transient, slot order)
        _expert_combine_kernel out[t] = sum_k w[t, k] * Y[slot_of[t*K + k]], fp32 accumulation in a fixed
                               k order, unrouted pairs (slot -1) skipped   ──▶ y [T, d]

No gathered [N, d] copy of x is ever built; the transients H and Y are freed when the launcher
returns. Saved for backward (by the caller): x, the plan, the routing weights and, under the
"activations" policy, preact (2*T*K*h elements). Nothing is reduced with atomics, so two runs with
the same configuration are bitwise identical.

Row tiles come from the plan: ``tile_expert[i]`` / ``tile_start[i]`` describe ``plan_block_m()`` rows
of one expert; a tile may be ragged (masked against ``offsets[e+1]``), tiles past the last one hold
-1 and their programs exit at once, so grids are sized by the static bound ``max_tiles`` and no host
synchronisation is needed.

Dtypes: bf16 and fp16 run on the tensor cores (fp32 accumulation). fp32 is accepted and computed
with IEEE fp32 dots (no tf32), which is what the interpreter tests use; on CUDA it is correct but
untuned, so the operator may prefer the plain-PyTorch path for fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import autotune
from .autotune import plan_block_m
from .reference import GATED_ACTIVATIONS, DispatchPlan, max_tiles

__all__ = ["expert_forward", "plan_block_m", "check_expert_inputs"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _grouped_tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (row tile, column block), GROUP_M row tiles at a time, so the
    programs running together share weight columns (and row tiles) in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pid_in_group) % group_size
    pid_n = (pid % num_pid_in_group) // group_size
    return pid_m, pid_n


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.heuristics({
    "EVEN_K": lambda a: a["d"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["h"] % a["BLOCK_N"] == 0,
})
@triton.jit
def _expert_up_kernel(
    x_ptr,  # [T, d] x.dtype: tokens, rows read through token_index
    w_ptr,  # [E, 2h, d] x.dtype: rows [:h] gate, [h:] up; any strides
    hid_ptr,  # [N, h] x.dtype, out: H = silu(A) * B, slot order
    preact_ptr,  # [N, 2h] x.dtype, out when SAVE_PREACT: A|B, slot order
    token_index_ptr,  # [N] int32: pair of each slot
    offsets_ptr,  # [E+1] int32: first slot of each expert
    tile_expert_ptr,  # [num_tiles] int32: expert of each row tile, -1 past the last
    tile_start_ptr,  # [num_tiles] int32: first slot of each row tile
    num_tiles, d, h, K,
    stride_x_t, stride_x_d,
    stride_w_e, stride_w_n, stride_w_d,
    stride_hid_s, stride_hid_n,
    stride_pre_s, stride_pre_n,
    SAVE_PREACT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grid = (num_tiles * cdiv(h, BLOCK_N),): one BLOCK_M x BLOCK_N tile of A and of B per program."""
    pid_m, pid_n = _grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(h, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(offsets_ptr + e + 1)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    # Rows past the tile's end re-read the tile's last row: loads need no row mask, stores keep one.
    pair = tl.load(token_index_ptr + tl.minimum(rows, end - 1))
    tok = (pair // K).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % h  # wrapped columns are computed and dropped at the store
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_x_t + offs_k[None, :] * stride_x_d  # [BLOCK_M, BLOCK_K]
    w_e = w_ptr + e.to(tl.int64) * stride_w_e
    wg_ptrs = w_e + offs_n_ld[None, :].to(tl.int64) * stride_w_n + offs_k[:, None] * stride_w_d  # [BLOCK_K, BLOCK_N]
    wu_ptrs = wg_ptrs + h * stride_w_n  # h * stride stays far below 2**31

    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs)
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
        else:
            k_mask = offs_k < d - k0
            xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
        acc_a = tl.dot(xa, wg, acc_a, input_precision=DOT_PRECISION)
        acc_b = tl.dot(xa, wu, acc_b, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_x_d
        wg_ptrs += BLOCK_K * stride_w_d
        wu_ptrs += BLOCK_K * stride_w_d

    out_ty = hid_ptr.dtype.element_ty
    a = acc_a.to(out_ty)
    b = acc_b.to(out_ty)
    rows64 = rows.to(tl.int64)
    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < h)[None, :]
    if SAVE_PREACT:
        pre_ptrs = preact_ptr + rows64[:, None] * stride_pre_s + offs_n[None, :] * stride_pre_n
        tl.store(pre_ptrs, a, mask=mask)
        tl.store(pre_ptrs + h * stride_pre_n, b, mask=mask)
    # H from the rounded A|B: the same values the backward recomputes from the saved preact.
    af = a.to(tl.float32)
    hid = af * tl.sigmoid(af) * b.to(tl.float32)
    tl.store(hid_ptr + rows64[:, None] * stride_hid_s + offs_n[None, :] * stride_hid_n, hid.to(out_ty), mask=mask)


@triton.heuristics({
    "EVEN_K": lambda a: a["k_dim"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["n_dim"] % a["BLOCK_N"] == 0,
})
@triton.jit
def _expert_down_kernel(
    a_ptr,  # [N, k_dim] slot order: H (forward down projection) or dA|dB (backward dX)
    b_ptr,  # [E, k_dim, n_dim] through strides: W_down[e].T (forward) or W_gate_up[e] (backward)
    c_ptr,  # [N, n_dim] out, slot order: Y (forward) or dX per slot (backward)
    offsets_ptr,  # [E+1] int32
    tile_expert_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32
    num_tiles, n_dim, k_dim,
    stride_a_s, stride_a_k,
    stride_b_e, stride_b_k, stride_b_n,
    stride_c_s, stride_c_n,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grid = (num_tiles * cdiv(n_dim, BLOCK_N),): C[rows] = A[rows] @ B[e] for one row tile of expert e."""
    pid_m, pid_n = _grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(n_dim, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(offsets_ptr + e + 1)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    rows_ld = tl.minimum(rows, end - 1).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % n_dim
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_ld[:, None] * stride_a_s + offs_k[None, :] * stride_a_k  # [BLOCK_M, BLOCK_K]
    b_ptrs = (b_ptr + e.to(tl.int64) * stride_b_e
              + offs_k[:, None] * stride_b_k + offs_n_ld[None, :].to(tl.int64) * stride_b_n)  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < k_dim - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k

    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < n_dim)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_c_s + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.heuristics({"EVEN_D": lambda a: a["d"] % a["BLOCK_D"] == 0})
@triton.jit
def _expert_combine_kernel(
    y_ptr,  # [N, d] slot order: per-slot expert outputs (or per-slot dX in the backward)
    weights_ptr,  # [T, K] any float dtype, read when HAS_WEIGHTS
    slot_of_ptr,  # [N] int32: slot of each pair, -1 when unrouted
    out_ptr,  # [T, d] out
    T, d, K,
    stride_y_s, stride_y_d,
    stride_wt_t, stride_wt_k,
    stride_o_t, stride_o_d,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """grid = (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D)): out[t] = sum_k w[t, k] * y[slot_of[t*K + k]] in fp32,
    k in ascending order (deterministic, no atomics)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in range(0, K):
        slot = tl.load(slot_of_ptr + offs_t64 * K + k, mask=t_mask, other=-1)
        valid = slot >= 0
        if EVEN_D:
            mask = valid[:, None]
        else:
            mask = valid[:, None] & (offs_d < d)[None, :]
        y = tl.load(y_ptr + slot.to(tl.int64)[:, None] * stride_y_s + offs_d[None, :] * stride_y_d,
                    mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            wk = tl.load(weights_ptr + offs_t64 * stride_wt_t + k * stride_wt_k, mask=valid, other=0.0)
            y = y * wk.to(tl.float32)[:, None]
        acc += y
    if EVEN_D:
        mask = t_mask[:, None]
    else:
        mask = t_mask[:, None] & (offs_d < d)[None, :]
    tl.store(out_ptr + offs_t64[:, None] * stride_o_t + offs_d[None, :] * stride_o_d,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


_expert_up_tuned = autotune.tuned(_expert_up_kernel, "up", key=["d", "h", "SAVE_PREACT"])
_expert_down_tuned = autotune.tuned(_expert_down_kernel, "down", key=["n_dim", "k_dim"])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def check_expert_inputs(x: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                        plan: DispatchPlan, activation: str) -> tuple[int, int, int, int, int]:
    """Validate shapes, dtypes, devices and the plan's tile height; return (T, d, K, E, h)."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; the Triton expert kernels implement {GATED_ACTIVATIONS}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    if weights.dim() != 2 or weights.shape[0] != T:
        raise ValueError(f"weights must be [T, K] with T={T}, got shape {tuple(weights.shape)}")
    K = weights.shape[1]
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != d or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2h, {d}], got shape {tuple(w_gate_up.shape)}")
    E, two_h, _ = w_gate_up.shape
    h = two_h // 2
    if tuple(w_down.shape) != (E, d, h):
        raise ValueError(f"w_down must be [E, d, h] = {(E, d, h)}, got shape {tuple(w_down.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; the expert kernels support {SUPPORTED_DTYPES}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(f"expert weights must have x's dtype {x.dtype}, got w_gate_up {w_gate_up.dtype}, "
                        f"w_down {w_down.dtype}; cast them (or run under autocast) before calling")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"routing weights must be a float tensor, got {weights.dtype}")
    tensors = (x, weights, w_gate_up, w_down) + tuple(plan)
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, weights, expert weights and the plan must live on one device; got "
                         + ", ".join(str(t.device) for t in tensors))
    if plan.offsets.numel() != E + 1 or plan.token_index.numel() != T * K or plan.slot_of.numel() != T * K:
        raise ValueError(f"plan does not match the inputs (E={E}, T*K={T * K}): offsets {plan.offsets.numel()}, "
                         f"token_index {plan.token_index.numel()}, slot_of {plan.slot_of.numel()}")
    bm = plan_block_m()
    if plan.tile_expert.numel() != max_tiles(T * K, E, bm) or plan.tile_start.numel() != plan.tile_expert.numel():
        raise ValueError(f"plan has {plan.tile_expert.numel()} row tiles, the kernels expect "
                         f"{max_tiles(T * K, E, bm)}: build it with block_m=plan_block_m() (= {bm})")
    return T, d, K, E, h


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: IEEE products (torch's default for fp32 matmul is no tf32); 16-bit: tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def down_project(a: Tensor, b: Tensor, stride_b: tuple[int, int, int], n_dim: int, plan: DispatchPlan,
                 out: Tensor) -> Tensor:
    """out[slot] = a[slot] @ B[e] for every routed slot, B[e][k, n] at ``b + e*s_e + k*s_k + n*s_n``."""
    num_tiles = plan.tile_expert.numel()
    k_dim = a.shape[1]
    if num_tiles == 0 or out.numel() == 0:
        return out

    def grid(meta):
        return (num_tiles * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    autotune.launch(
        _expert_down_kernel, _expert_down_tuned, "down", grid,
        a, b, out, plan.offsets, plan.tile_expert, plan.tile_start,
        num_tiles, n_dim, k_dim,
        a.stride(0), a.stride(1), *stride_b, out.stride(0), out.stride(1),
        DOT_PRECISION=dot_precision(a.dtype), BLOCK_M=plan_block_m(),
    )
    return out


def combine(y_slots: Tensor, weights: Tensor | None, slot_of: Tensor, T: int, K: int, out: Tensor) -> Tensor:
    """out[t] = sum_k w[t, k] * y_slots[slot_of[t*K + k]] (w = 1 when weights is None), fp32 accumulation."""
    d = out.shape[1]
    if T == 0 or d == 0:
        return out
    block_d = min(64 if autotune.interpreting() else 256, triton.next_power_of_2(d))
    block_t = 16
    w = weights if weights is not None else y_slots  # placeholder pointer, never read
    sw = (weights.stride(0), weights.stride(1)) if weights is not None else (0, 0)
    grid = (triton.cdiv(T, block_t), triton.cdiv(d, block_d))
    _expert_combine_kernel[grid](
        y_slots, w, slot_of, out, T, d, K,
        y_slots.stride(0), y_slots.stride(1), *sw, out.stride(0), out.stride(1),
        HAS_WEIGHTS=weights is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
    return out


def expert_forward(x: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, plan: DispatchPlan,
                   activation: str = "swiglu", save_preact: bool = True) -> tuple[Tensor, Tensor]:
    """y [T, d] (x.dtype) and preact [T*K, 2h] in slot order (x.dtype; ``[0]`` unless save_preact).

    ``plan`` must come from ``dispatch(ids, E, block_m=plan_block_m())`` (or ``dispatch_reference``)."""
    T, d, K, E, h = check_expert_inputs(x, weights, w_gate_up, w_down, plan, activation)
    N = T * K
    preact = x.new_empty((N, 2 * h) if save_preact else (0,))
    out = x.new_empty((T, d))
    if N == 0 or d == 0:
        return out.zero_(), preact
    num_tiles = plan.tile_expert.numel()
    hid = x.new_empty((N, h))  # transient, freed on return
    pre = preact if save_preact else hid  # placeholder pointer when not saving, never written

    def grid(meta):
        return (num_tiles * triton.cdiv(h, meta["BLOCK_N"]),)

    if h > 0:
        autotune.launch(
            _expert_up_kernel, _expert_up_tuned, "up", grid,
            x, w_gate_up, hid, pre, plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start,
            num_tiles, d, h, K,
            x.stride(0), x.stride(1),
            w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2),
            hid.stride(0), hid.stride(1),
            pre.stride(0) if save_preact else 0, pre.stride(1) if save_preact else 0,
            SAVE_PREACT=save_preact, DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=plan_block_m(),
        )
        y_slots = x.new_empty((N, d))  # transient, slot order
        # Y = H @ W_down[e].T: B[e][k, n] = w_down[e, n, k]
        down_project(hid, w_down, (w_down.stride(0), w_down.stride(2), w_down.stride(1)), d, plan, y_slots)
        del hid
    else:  # h == 0: every expert maps to zero
        y_slots = x.new_zeros((N, d))
    combine(y_slots, weights, plan.slot_of, T, K, out)
    return out, preact
