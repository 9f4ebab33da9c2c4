"""Fused expert backward: never needs the expert outputs Y, never builds a gathered copy of x or dy.

Inputs: dy = grad_y [T, d], x [T, d], routing weights w [T, K], w_gate_up [E, 2h, d], w_down [E, d, h],
the plan, and preact = A|B [N, 2h] in slot order (saved by the forward, "activations" policy) or an
empty tensor (``"recompute"`` policy: A|B are recomputed inside the first kernel, one extra up GEMM).

Data flow (five launches + one small reduction)::

    _expert_dh_kernel   per row tile of one expert, one pass over d:
                          dH' = dy[tok] @ W_down[e]                (dy rows gathered on the fly)
                          A|B = x[tok] @ W_gate_up[e].T            (RECOMPUTE only, same pass over d)
                        epilogue, silu recomputed in registers:
                          H = silu(A) * B
                          dw partial = <dH', H> over this program's columns   (routing-weight gradient)
                          dH = w * dH';  dA = dH * B * silu'(A);  dB = dH * silu(A)
                        ──▶ dA|dB [N, 2h], w*H [N, h], partials [h/64, N] fp32   (all transient)
    dweights = partials.sum(0)                                          (fixed order: deterministic)
    _expert_dw_kernel   dW_down[e]    = sum_{s in e} dy[tok_s].T (w*H)[s]  (dy gathered, slots = contraction)
    _expert_down_kernel dX[s]         = dA|dB[s] @ W_gate_up[e]             (row tiles, as the forward)
    _expert_dw_kernel   dW_gate_up[e] = sum_{s in e} dA|dB[s].T x[tok_s]    (x gathered)
    _expert_combine_kernel dx[t]      = sum_k dX[slot_of[t*K + k]]           (fp32, fixed k order)

Each output element is written by exactly one program with a fixed reduction order, so there are no
atomics and two runs with the same configuration are bitwise identical. Experts with no slots get
zero weight gradients. Transients (dA|dB, w*H, per-slot dX, partials) are freed on return.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import autotune
from .autotune import plan_block_m
from .expert_fwd import _grouped_tile_ids, check_expert_inputs, combine, dot_precision, down_project
from .reference import DispatchPlan

__all__ = ["expert_backward"]

# Upper bound on the dh kernels' BLOCK_N (any config): the partial buffer gets this many spare columns'
# worth of chunks, so a program's chunk index never runs past it.
_MAX_DH_BLOCK_N = 256


@triton.jit
def _dh_epilogue(
    acc_dh, acc_a, acc_b,  # [BLOCK_M, BLOCK_N] fp32: dH', and A, B when RECOMPUTE
    col0, start, end, pair, wt, h,
    preact_ptr,  # [N, 2h] x.dtype, read unless RECOMPUTE
    dpre_ptr,  # [N, 2h] x.dtype, out
    hw_ptr,  # [N, h] x.dtype, out
    part_ptr,  # [num_chunks, N] fp32, out
    stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
    RECOMPUTE: tl.constexpr, CHUNK_N: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """SwiGLU backward for hidden columns [col0, col0 + BLOCK_N) of rows [start, end) (at most BLOCK_M), silu
    recomputed here. Addresses are a scalar 64-bit base per tile plus int32 offsets inside it: per-element
    64-bit pointers cost two registers each and made this epilogue spill."""
    io_ty = dpre_ptr.dtype.element_ty
    BLOCK_M: tl.constexpr = wt.shape[0]
    local = tl.arange(0, BLOCK_M)
    row_mask = local < end - start
    local_ld = tl.minimum(local, end - 1 - start)
    start64 = start.to(tl.int64)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    if RECOMPUTE:  # round as the forward did, so both policies see the same A|B
        a = acc_a.to(io_ty).to(tl.float32)
        b = acc_b.to(io_ty).to(tl.float32)
    else:
        if EVEN_N:
            offs_n_ld = offs_n
        else:
            offs_n_ld = offs_n % h
        pre_base = preact_ptr + start64 * stride_pre_s
        pre_offs = local_ld[:, None] * stride_pre_s + offs_n_ld[None, :] * stride_pre_n  # int32 inside the tile
        a = tl.load(pre_base + pre_offs).to(tl.float32)
        b = tl.load(pre_base + h * stride_pre_n + pre_offs).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    hid = silu * b
    # <dH', H> over these columns; wrapped columns (offs_n >= h) must not count.
    prod = acc_dh * hid
    if not EVEN_N:
        prod = tl.where((offs_n < h)[None, :], prod, 0.0)
    part = tl.sum(prod, axis=1)  # [BLOCK_M]
    d_hid = acc_dh * wt[:, None]
    d_a = d_hid * b * (sig * (1.0 + a * (1.0 - sig)))
    d_b = d_hid * silu

    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < h)[None, :]
    dpre_base = dpre_ptr + start64 * stride_dpre_s
    dpre_offs = local[:, None] * stride_dpre_s + offs_n[None, :] * stride_dpre_n
    tl.store(dpre_base + dpre_offs, d_a.to(io_ty), mask=mask)
    tl.store(dpre_base + h * stride_dpre_n + dpre_offs, d_b.to(io_ty), mask=mask)
    tl.store(hw_ptr + start64 * stride_hw_s + (local[:, None] * stride_hw_s + offs_n[None, :] * stride_hw_n),
             (hid * wt[:, None]).to(io_ty), mask=mask)
    # Partial sums live in chunks of CHUNK_N columns: these columns own chunks
    # [col0 / CHUNK_N, (col0 + BLOCK_N) / CHUNK_N): the first gets the sum, the rest 0.
    part_ptrs = part_ptr + (col0 // CHUNK_N) * stride_part_c + pair.to(tl.int64)
    tl.store(part_ptrs, part, mask=row_mask)
    for j in tl.static_range(1, BLOCK_N // CHUNK_N):
        tl.store(part_ptrs + j * stride_part_c, tl.zeros_like(part), mask=row_mask)


@triton.heuristics({
    "EVEN_K": lambda a: a["d"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["h"] % (a["BLOCK_N"] * a["SPLIT_N"]) == 0,
})
@triton.jit
def _expert_dh_kernel(
    grad_y_ptr,  # [T, d] x.dtype: dL/dy, rows read through token_index
    x_ptr,  # [T, d] x.dtype: read when RECOMPUTE
    w_gu_ptr,  # [E, 2h, d] x.dtype: read when RECOMPUTE
    w_down_ptr,  # [E, d, h] x.dtype
    weights_ptr,  # [T, K] any float dtype: routing weights
    preact_ptr,  # [N, 2h] x.dtype: saved A|B in slot order, read unless RECOMPUTE
    dpre_ptr,  # [N, 2h] x.dtype, out: dA|dB in slot order
    hw_ptr,  # [N, h] x.dtype, out: w * H in slot order
    part_ptr,  # [num_chunks, N] fp32, out: <dH', H> over each chunk of CHUNK_N columns, by pair
    token_index_ptr,  # [N] int32
    offsets_ptr,  # [E+1] int32
    tile_expert_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32
    num_tiles, d, h, K,
    stride_g_t, stride_g_d,
    stride_x_t, stride_x_d,
    stride_wgu_e, stride_wgu_n, stride_wgu_d,
    stride_wd_e, stride_wd_d, stride_wd_n,
    stride_wt_t, stride_wt_k,
    stride_pre_s, stride_pre_n,
    stride_dpre_s, stride_dpre_n,
    stride_hw_s, stride_hw_n,
    stride_part_c,
    RECOMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grid = (num_tiles * cdiv(h, SPLIT_N * BLOCK_N),): SPLIT_N side-by-side BLOCK_M x BLOCK_N tiles of dH'
    per program (SPLIT_N = 2: a 128-wide tile for the GEMM, whose epilogue runs 64 columns at a time so its
    registers fit), or one tile of dH', A and B (RECOMPUTE, SPLIT_N = 1)."""
    tl.static_assert(SPLIT_N == 1 or (SPLIT_N == 2 and not RECOMPUTE))
    pid_m, pid_n = _grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(h, SPLIT_N * BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    start = tl.load(tile_start_ptr + pid_m)
    end = tl.load(offsets_ptr + e + 1)
    rows = start + tl.arange(0, BLOCK_M)
    rows_ld = tl.minimum(rows, end - 1)
    pair = tl.load(token_index_ptr + rows_ld)
    tok = (pair // K).to(tl.int64)
    e64 = e.to(tl.int64)

    col0 = pid_n * (SPLIT_N * BLOCK_N)
    offs_n0 = col0 + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    if not EVEN_N:
        offs_n0 = offs_n0 % h
        offs_n1 = offs_n1 % h
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = grad_y_ptr + tok[:, None] * stride_g_t + offs_k[None, :] * stride_g_d  # [BLOCK_M, BLOCK_K]
    wd_e = w_down_ptr + e64 * stride_wd_e
    wd0_ptrs = wd_e + offs_k[:, None] * stride_wd_d + offs_n0[None, :] * stride_wd_n  # [BLOCK_K, BLOCK_N]
    wd1_ptrs = wd_e + offs_k[:, None] * stride_wd_d + offs_n1[None, :] * stride_wd_n  # [BLOCK_K, BLOCK_N]
    x_ptrs = x_ptr + tok[:, None] * stride_x_t + offs_k[None, :] * stride_x_d  # [BLOCK_M, BLOCK_K]
    wg_ptrs = (w_gu_ptr + e64 * stride_wgu_e
               + offs_n0[None, :].to(tl.int64) * stride_wgu_n + offs_k[:, None] * stride_wgu_d)  # [BLOCK_K, BLOCK_N]
    wu_ptrs = wg_ptrs + h * stride_wgu_n
    wt = tl.load(weights_ptr + (pair // K).to(tl.int64) * stride_wt_t + (pair % K) * stride_wt_k).to(tl.float32)

    acc_dh0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_dh1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        if EVEN_K:
            g = tl.load(g_ptrs)
            wd0 = tl.load(wd0_ptrs)
        else:
            k_mask = offs_k < d - k0
            g = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0)
            wd0 = tl.load(wd0_ptrs, mask=k_mask[:, None], other=0.0)
        acc_dh0 = tl.dot(g, wd0, acc_dh0, input_precision=DOT_PRECISION)
        g_ptrs += BLOCK_K * stride_g_d
        wd0_ptrs += BLOCK_K * stride_wd_d
        if SPLIT_N == 2:
            if EVEN_K:
                wd1 = tl.load(wd1_ptrs)
            else:
                wd1 = tl.load(wd1_ptrs, mask=k_mask[:, None], other=0.0)
            acc_dh1 = tl.dot(g, wd1, acc_dh1, input_precision=DOT_PRECISION)
            wd1_ptrs += BLOCK_K * stride_wd_d
        if RECOMPUTE:
            if EVEN_K:
                xa = tl.load(x_ptrs)
                wg = tl.load(wg_ptrs)
                wu = tl.load(wu_ptrs)
            else:
                xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
            acc_a = tl.dot(xa, wg, acc_a, input_precision=DOT_PRECISION)
            acc_b = tl.dot(xa, wu, acc_b, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
            wg_ptrs += BLOCK_K * stride_wgu_d
            wu_ptrs += BLOCK_K * stride_wgu_d

    _dh_epilogue(acc_dh0, acc_a, acc_b, col0, start, end, pair, wt, h,
                 preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                 stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
                 RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N)
    if SPLIT_N == 2:
        _dh_epilogue(acc_dh1, acc_a, acc_b, col0 + BLOCK_N, start, end, pair, wt, h,
                     preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                     stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
                     RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N)


@triton.heuristics({
    "EVEN_M": lambda a: a["m_dim"] % a["BLOCK_M"] == 0,
    "EVEN_N": lambda a: a["n_dim"] % a["BLOCK_N"] == 0,
})
@triton.jit
def _expert_dw_kernel(
    a_ptr,  # GATHER_A: [T, m_dim] read at row token(s) (dy); else [N, m_dim] slot order (dA|dB)
    b_ptr,  # GATHER_B: [T, n_dim] read at row token(s) (x);  else [N, n_dim] slot order (w*H)
    out_ptr,  # [E, m_dim, n_dim] any strides, out: dW[e] = sum_{s in e} a[row(s)].T b[row(s)]
    token_index_ptr,  # [N] int32
    offsets_ptr,  # [E+1] int32
    m_dim, n_dim, K,
    stride_a_r, stride_a_m,
    stride_b_r, stride_b_n,
    stride_o_e, stride_o_m, stride_o_n,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grid = (E * cdiv(m_dim, BLOCK_M) * cdiv(n_dim, BLOCK_N),): one output tile of one expert per program,
    the contraction running over that expert's slots BLOCK_K at a time (full chunks unmasked, then one
    masked tail). Experts with no slots write zeros."""
    num_m = tl.cdiv(m_dim, BLOCK_M)
    num_n = tl.cdiv(n_dim, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // (num_m * num_n)
    pid_m, pid_n = _grouped_tile_ids(pid % (num_m * num_n), num_m, num_n, GROUP_M)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_M:
        offs_m_ld = offs_m
    else:
        offs_m_ld = offs_m % m_dim
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % n_dim
    offs_s = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # Token rows of the gathered operand are loaded one chunk ahead (a loop-carried register prefetch):
    # the tile loads then depend on a loop-carried value, not on a load of the same iteration, so the
    # pipeliner can keep several chunks in flight.
    s = lo + offs_s
    if GATHER_A or GATHER_B:
        tok = (tl.load(token_index_ptr + s, mask=s < hi, other=0) // K).to(tl.int64)
    else:
        tok = s.to(tl.int64)
    n_full = (hi - lo) // BLOCK_K
    for i in range(0, n_full):
        s_next = s + BLOCK_K
        if GATHER_A or GATHER_B:
            tok_next = (tl.load(token_index_ptr + s_next, mask=s_next < hi, other=0) // K).to(tl.int64)
        else:
            tok_next = s_next.to(tl.int64)
        if GATHER_A:
            ra = tok
        else:
            ra = s.to(tl.int64)
        if GATHER_B:
            rb = tok
        else:
            rb = s.to(tl.int64)
        a = tl.load(a_ptr + ra[None, :] * stride_a_r + offs_m_ld[:, None] * stride_a_m)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + rb[:, None] * stride_b_r + offs_n_ld[None, :] * stride_b_n)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        s = s_next
        tok = tok_next
    if lo + n_full * BLOCK_K < hi:  # ragged tail of this expert's slots (its rows are already in tok)
        s_mask = s < hi
        s_ld = tl.minimum(s, hi - 1).to(tl.int64)
        if GATHER_A:
            ra = tok
        else:
            ra = s_ld
        if GATHER_B:
            rb = tok
        else:
            rb = s_ld
        a = tl.load(a_ptr + ra[None, :] * stride_a_r + offs_m_ld[:, None] * stride_a_m, mask=s_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_b_r + offs_n_ld[None, :] * stride_b_n, mask=s_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    if EVEN_M and EVEN_N:
        out_mask = None
    else:
        out_mask = (offs_m < m_dim)[:, None] & (offs_n < n_dim)[None, :]
    out_ptrs = (out_ptr + e.to(tl.int64) * stride_o_e
                + offs_m[:, None].to(tl.int64) * stride_o_m + offs_n[None, :].to(tl.int64) * stride_o_n)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_expert_dh_tuned = autotune.tuned(_expert_dh_kernel, "dh", key=["d", "h"])
_expert_dh_recompute_tuned = autotune.tuned(_expert_dh_kernel, "dh_recompute", key=["d", "h"])
_expert_dw_tuned = autotune.tuned(_expert_dw_kernel, "dw", key=["m_dim", "n_dim", "GATHER_A"])


def _weight_grad(a: Tensor, b: Tensor, gather_a: bool, out: Tensor, plan: DispatchPlan, K: int) -> Tensor:
    """out[e] = sum over e's slots of a[row].T @ b[row]; rows are tokens (gathered) or slots."""
    E, m_dim, n_dim = out.shape
    if out.numel() == 0:
        return out

    def grid(meta):
        return (E * triton.cdiv(m_dim, meta["BLOCK_M"]) * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    autotune.launch(
        _expert_dw_kernel, _expert_dw_tuned, "dw", grid,
        a, b, out, plan.token_index, plan.offsets, m_dim, n_dim, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GATHER_A=gather_a, GATHER_B=not gather_a, DOT_PRECISION=dot_precision(a.dtype),
    )
    return out


def expert_backward(grad_y: Tensor, x: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                    preact: Tensor, plan: DispatchPlan, activation: str = "swiglu"
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx [T, d] x.dtype, dweights [T, K] weights.dtype, dw_gate_up like w_gate_up, dw_down like w_down).

    ``preact.numel() == 0`` means recompute A|B (the "recompute" policy); otherwise it is the forward's
    [T*K, 2h] slot-order A|B. Weight gradients keep the weights' strides (``empty_like``)."""
    T, d, K, E, h = check_expert_inputs(x, weights, w_gate_up, w_down, plan, activation)
    N = T * K
    if tuple(grad_y.shape) != (T, d):
        raise ValueError(f"grad_y must be [T, d] = {(T, d)}, got shape {tuple(grad_y.shape)}")
    if grad_y.device != x.device:
        raise ValueError(f"grad_y is on {grad_y.device}, x on {x.device}")
    grad_y = grad_y.to(x.dtype)
    recompute = preact.numel() == 0
    if not recompute and (tuple(preact.shape) != (N, 2 * h) or preact.dtype != x.dtype):
        raise ValueError(f"preact must be empty (recompute) or [T*K, 2h] = {(N, 2 * h)} of {x.dtype}, "
                         f"got {tuple(preact.shape)} of {preact.dtype}")

    dx = x.new_empty((T, d))
    dw_gate_up = torch.empty_like(w_gate_up)
    dw_down = torch.empty_like(w_down)
    if N == 0 or h == 0 or d == 0:
        return dx.zero_(), torch.zeros_like(weights), dw_gate_up.zero_(), dw_down.zero_()

    num_tiles = plan.tile_expert.numel()
    chunk = autotune.dweights_chunk()
    num_chunks = triton.cdiv(h, chunk)
    part = torch.zeros((num_chunks + _MAX_DH_BLOCK_N // chunk, N), dtype=torch.float32, device=x.device)
    dpre = x.new_empty((N, 2 * h))
    hw = x.new_empty((N, h))
    pre = dpre if recompute else preact  # placeholder pointer when recomputing, never read

    def grid(meta):
        width = meta["BLOCK_N"] * meta["SPLIT_N"]
        assert width <= _MAX_DH_BLOCK_N and meta["BLOCK_N"] % chunk == 0
        return (num_tiles * triton.cdiv(h, width),)

    autotune.launch(
        _expert_dh_kernel, _expert_dh_recompute_tuned if recompute else _expert_dh_tuned,
        "dh_recompute" if recompute else "dh", grid,
        grad_y, x, w_gate_up, w_down, weights, pre, dpre, hw, part,
        plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start,
        num_tiles, d, h, K,
        grad_y.stride(0), grad_y.stride(1), x.stride(0), x.stride(1),
        w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2),
        w_down.stride(0), w_down.stride(1), w_down.stride(2),
        weights.stride(0), weights.stride(1),
        pre.stride(0), pre.stride(1), dpre.stride(0), dpre.stride(1), hw.stride(0), hw.stride(1),
        part.stride(0),
        RECOMPUTE=recompute, DOT_PRECISION=dot_precision(x.dtype), CHUNK_N=chunk, BLOCK_M=plan_block_m(),
    )
    dweights = part[:num_chunks].sum(0).view(T, K).to(weights.dtype)
    del part
    _weight_grad(grad_y, hw, True, dw_down, plan, K)  # [E, d, h]
    del hw
    dx_slots = x.new_empty((N, d))
    down_project(dpre, w_gate_up, (w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2)), d, plan, dx_slots)
    _weight_grad(dpre, x, False, dw_gate_up, plan, K)  # [E, 2h, d]
    del dpre
    combine(dx_slots, None, plan.slot_of, T, K, dx)
    return dx, dweights, dw_gate_up, dw_down
