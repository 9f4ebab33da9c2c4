"""Fused expert backward: never needs the expert outputs Y, never builds a gathered copy of x or dy.

Inputs: dy = grad_y [T, d], x [T, d], routing weights w [T, K], the weight tables (W_gate, W_up [h, d] per
expert, W_up absent for a plain activation; W_down [d, h]), the optional biases, the plan, and preact =
A|B [N, 2h] (or A [N, h], plain activation) in slot order, biases included (saved by the forward,
"activations" policy) or an empty tensor (``"recompute"`` policy: A|B are recomputed, one extra up GEMM,
inside the first kernel or, on sm_90, by the forward's up kernel; see below). Weight gradients are written
through the ``grads`` tables (x.dtype or float32; overwritten, or added to with ``accumulate=True``); bias
gradients are returned in float32.

Data flow (six launches, seven under "activations", + one small reduction, plus one small launch per bias)::

    _expert_dh_kernel   per row tile of one expert, one pass over d (under "activations" two launches: the
                        GEMM, dH' stored into the w*H buffer, then the epilogue reading it back; DH_SPLIT):
                          dH' = dy[tok] @ W_down[e]                (dy rows gathered on the fly)
                          A|B = x[tok] @ W_{gate|up}[e].T + b      (RECOMPUTE only, same pass over d)
                        epilogue, the activation recomputed in registers (constexpr ACT):
                          H = act(A, B)
                          dw partial = <dH', H> over this program's columns   (routing-weight gradient)
                          dH = w * dH';  dA, dB = act'(A, B) dH
                        ──▶ dA|dB [N, 2h] (dA [N, h] plain), w*H [N, h], partials [h/chunk, N+1] fp32 by slot
    _expert_bias_grad_kernel (down bias only), per expert and column block of d:
                          d_down_bias[e] = sum_{s in e} w_s dy[tok_s];  <dy[tok_s], b_down[e]> partials by slot
    dweights = partials.sum(0)[slot_of]                                 (fixed order: deterministic)
    _expert_dw_kernel   dW_down[e]    = sum_{s in e} dy[tok_s].T (w*H)[s]  (dy gathered, slots = contraction)
    _expert_down_kernel dX[s]         = dA[s] @ W_gate[e] + dB[s] @ W_up[e]  (row tiles; two K loops, one acc)
    _expert_dw_kernel   dW_gate[e].T  = sum_{s in e} x[tok_s].T dA[s]      (x gathered); dW_up likewise from dB;
                        one launch for both, [dW_gate | dW_up][e].T from dA|dB, where up's rows follow gate's
                        in one [E, 2h, d] tensor (Hugging Face's fused gate_up)
                        (interleaved gate and up, gpt-oss: one launch writing the [d, 2h] gradient of the stored
                        gate_up_proj contiguously along 2h, dA and dB joined column by column in registers; the dX
                        above then runs as one contraction over 2h, see expert_fwd; and "recompute" computes A|B
                        again with the forward's up kernel into the dA|dB buffer, dh then running as under
                        "activations" in place over it, instead of inside the dh kernel through strided loads)
    _expert_bias_grad_kernel (gate/up biases): d_gate_bias[e] = sum_{s in e} dA[s]; d_up_bias from dB
    _expert_combine_kernel dx[t]      = sum_k dX[slot_of[t*K + k]]           (fp32, fixed k order; a window of fewer
                        slots than T over its own tokens only: expert_fwd.combine)

With ``window_slots`` everything but the down-bias pass and the final reduction runs once per slot
window (see ``expert_fwd.SlotWindow``): the transients hold the window's rows; the dW kernels contract
over the part of each expert's slots inside the window, writing the experts whose slots start there and
adding onto those that started earlier; dx and the bias gradients add up across windows.

On sm_90 the dW launches with 16-bit operands and output go to the Gluon kernel of :mod:`.dw_sm90` when the
shapes allow (d % 128 == 0, h % 256 == 0, 16-byte aligned rows); its results are bitwise the Triton kernel's.
Likewise dh's GEMM (the split's first launch) goes to the gathering kernel of :mod:`.gather_sm90` when d % 64 == 0
and W_down is row blocks of one tensor; for a gated activation of ``gather_sm90.ACTIVATIONS`` with h % 16 == 0 both
launches are one there, dH' never stored (elsewhere the epilogue stays a Triton launch). The kernel option
``gluon=False`` (``config.KernelOptions``) keeps the Triton kernels everywhere. Under "recompute"
with an activation of ``gather_sm90.ACTIVATIONS``, no biases and h % 16 == 0, the forward's Gluon up kernel computes
the window's A|B again into the dA|dB buffer and the fused dh runs in place over it (each element read before it is
written, by the program that writes it): the same kernels on the same A|B as "activations", so bitwise its results,
with no more memory than the Triton dh kernel that recomputes A|B inside its own pass.

Each output element is written by exactly one program per window with a fixed reduction order, so there
are no atomics and two runs with the same configuration are bitwise identical. Experts with no slots get
zero weight gradients (or an unchanged one when accumulating). Transients (dA|dB, w*H, per-slot dX,
partials) are freed on return.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import autotune, dw_sm90, gather_sm90
from .act import ACT_CODES, act_backward
from .autotune import plan_block_m
from .expert_fwd import (
    _up_sm90_weights,
    _up_triton,
    _up_weight_mode,
    combine,
    down_operand,
    down_project,
)
from .launch import launch, sized
from .reference import Activation, DispatchPlan
from .tables import ExpertTables, WeightTable, interleaved_gate_up, table_of
from .triton.common import (
    check_expert_inputs,
    check_table,
    desc_view,
    dot_precision,
    grouped_tile_ids,
    slot_windows,
    table_align,
    table_ptr,
    tma_available,
    weight_tma_mode,
    window_tile,
)

__all__ = ["expert_backward"]

# Upper bound on the dh kernels' BLOCK_N (any config): the partial buffer gets this many spare columns'
# worth of chunks, so a program's chunk index never runs past it.
_MAX_DH_BLOCK_N = 256


@triton.jit
def _dh_epilogue(
    acc_dh, acc_a, acc_b,  # [BLOCK_M, BLOCK_N] fp32: dH', and A, B (biases added) when RECOMPUTE
    col0, start, first, end, slot0, wt, h, alpha, limit,
    preact_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype (the window's rows), read unless RECOMPUTE
    dpre_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype, out
    hw_ptr,  # [slot1 - slot0, h] x.dtype, out
    part_ptr,  # [num_chunks, N + 1] fp32, out: by slot
    stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
    ACT: tl.constexpr, GATED: tl.constexpr,
    RECOMPUTE: tl.constexpr, CHUNK_N: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Activation backward for hidden columns [col0, col0 + BLOCK_N) of rows [first, end) of the tile starting
    at slot ``start`` (buffers hold the window's rows from slot0), the activation recomputed here. Addresses
    are a scalar 64-bit base per tile plus int32 offsets inside it: per-element 64-bit pointers cost two
    registers each and made this epilogue spill."""
    io_ty = dpre_ptr.dtype.element_ty
    BLOCK_M: tl.constexpr = wt.shape[0]
    local = tl.arange(0, BLOCK_M)
    row_mask = (local >= first - start) & (local < end - start)
    local_ld = tl.minimum(tl.maximum(local, first - start), end - 1 - start)
    start64 = (start - slot0).to(tl.int64)  # the tile's first row in the window's buffers (may be < 0)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    if RECOMPUTE:  # round as the forward did, so both policies see the same A|B
        a = acc_a.to(io_ty).to(tl.float32)
        if GATED:
            b = acc_b.to(io_ty).to(tl.float32)
        else:
            b = a  # unused
    else:
        if EVEN_N:
            offs_n_ld = offs_n
        else:
            offs_n_ld = offs_n % h
        pre_base = preact_ptr + start64 * stride_pre_s
        pre_offs = local_ld[:, None] * stride_pre_s + offs_n_ld[None, :] * stride_pre_n  # int32 inside the tile
        a = tl.load(pre_base + pre_offs).to(tl.float32)
        if GATED:
            b = tl.load(pre_base + h * stride_pre_n + pre_offs).to(tl.float32)
        else:
            b = a  # unused
    d_hid = acc_dh * wt[:, None]
    hid, d_a, d_b = act_backward(a, b, d_hid, alpha, limit, ACT)
    # <dH', H> over these columns; wrapped columns (offs_n >= h) must not count.
    prod = acc_dh * hid
    if not EVEN_N:
        prod = tl.where((offs_n < h)[None, :], prod, 0.0)
    part = tl.sum(prod, axis=1)  # [BLOCK_M]

    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < h)[None, :]
    dpre_base = dpre_ptr + start64 * stride_dpre_s
    dpre_offs = local[:, None] * stride_dpre_s + offs_n[None, :] * stride_dpre_n
    tl.store(dpre_base + dpre_offs, d_a.to(io_ty), mask=mask)
    if GATED:
        tl.store(dpre_base + h * stride_dpre_n + dpre_offs, d_b.to(io_ty), mask=mask)
    hw_ptrs, _ = _dh_tile(hw_ptr, col0, start, first, end, slot0, h, stride_hw_s, stride_hw_n, BLOCK_M, BLOCK_N, EVEN_N)
    tl.store(hw_ptrs, (hid * wt[:, None]).to(io_ty), mask=mask)
    # Partial sums live in chunks of CHUNK_N columns: these columns own chunks
    # [col0 / CHUNK_N, (col0 + BLOCK_N) / CHUNK_N): the first gets the sum, the rest 0. Stored by slot (the tile's
    # rows, one contiguous run): by pair they were scattered 4-byte stores, 5-10 % of the split's second launch
    # (H100; docs/dh.md).
    part_ptrs = part_ptr + (col0 // CHUNK_N).to(tl.int64) * stride_part_c + (start + local).to(tl.int64)
    tl.store(part_ptrs, part, mask=row_mask)
    for j in tl.static_range(1, BLOCK_N // CHUNK_N):
        tl.store(part_ptrs + j * stride_part_c, tl.zeros_like(part), mask=row_mask)


@triton.jit
def _dh_tile(hw_ptr, col0, start, first, end, slot0, h, stride_hw_s, stride_hw_n,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """(pointers, mask) of hidden columns [col0, col0 + BLOCK_N) of rows [first, end) of the tile starting at slot
    ``start`` in the window's [slot1 - slot0, h] buffer ``hw``: where the split dh phases pass dH' (PHASE 1, 2)."""
    local = tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = ((local >= first - start) & (local < end - start))[:, None]
    if not EVEN_N:
        mask = mask & (offs_n < h)[None, :]
    ptrs = hw_ptr + (start - slot0).to(tl.int64) * stride_hw_s + (local[:, None] * stride_hw_s
                                                                  + offs_n[None, :] * stride_hw_n)
    return ptrs, mask


@triton.heuristics({
    "EVEN_K": lambda a: a["d"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["h"] % (a["BLOCK_N"] * a["SPLIT_N"]) == 0,
})
@sized(triton.jit)
def _expert_dh_kernel(
    grad_y_ptr,  # [T, d] x.dtype: dL/dy, rows read through token_index
    x_ptr,  # [T, d] x.dtype: read when RECOMPUTE
    gate_table_ptr,  # [E] int64: W_gate[e] [h, d] via (stride_wg_n, stride_wg_d), read when RECOMPUTE
    up_table_ptr,  # [E] int64: W_up[e] [h, d] via (stride_wu_n, stride_wu_d), read when RECOMPUTE and GATED
    down_table_ptr,  # [E] int64: W_down[e] [d, h] via (stride_wd_d, stride_wd_n)
    gate_bias_ptr,  # [E, h] x.dtype contiguous, read when RECOMPUTE and HAS_GATE_BIAS
    up_bias_ptr,  # [E, h] x.dtype contiguous, read when RECOMPUTE and HAS_UP_BIAS
    weights_ptr,  # [T, K] any float dtype: routing weights
    preact_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype: saved A|B of the window's slots, read unless RECOMPUTE
    dpre_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype, out: dA|dB of the window's slots
    hw_ptr,  # [slot1 - slot0, h] x.dtype, out: w * H of the window's slots
    part_ptr,  # [num_chunks, N + 1] fp32, out: <dH', H> over each chunk of CHUNK_N columns, by slot
    token_index_ptr,  # [N] int32
    offsets_ptr,  # [E+1] int32
    tile_expert_ptr,  # [tiles_total] int32
    tile_start_ptr,  # [tiles_total] int32
    tile0_ptr,  # [1] int32: the window's first row tile
    num_tiles, tiles_total, slot0, slot1, d, h, K,
    stride_g_t, stride_g_d,
    stride_x_t, stride_x_d,
    stride_wg_n, stride_wg_d,
    stride_wu_n, stride_wu_d,
    stride_wd_d, stride_wd_n,
    stride_wt_t, stride_wt_k,
    stride_pre_s, stride_pre_n,
    stride_dpre_s, stride_dpre_n,
    stride_hw_s, stride_hw_n,
    stride_part_c,
    alpha, limit,  # fp32: the clamped SwiGLUs' parameters (unused otherwise)
    ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr,
    W_ALIGN: tl.constexpr,
    RECOMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PHASE: tl.constexpr = 0,  # 0: GEMM and epilogue; 1: the GEMM only; 2: the epilogue only (see below)
):
    """grid = (num_tiles * cdiv(h, SPLIT_N * BLOCK_N),), over the row tiles of the slot window [slot0, slot1):
    SPLIT_N side-by-side BLOCK_M x BLOCK_N tiles of dH' per program (SPLIT_N = 2: a 128-wide tile for the
    GEMM, whose epilogue runs 64 columns at a time so its registers fit), or one tile of dH', A and B
    (RECOMPUTE, SPLIT_N = 1).

    Split in two launches (not RECOMPUTE): PHASE 1 stores dH' (x.dtype) into hw and stops, so its tile is not
    bound by the epilogue's registers; PHASE 2 reads dH' back from hw instead of multiplying and runs the
    epilogue, which overwrites it with w * H (each element read and written by the same program)."""
    tl.static_assert(SPLIT_N == 1 or (SPLIT_N == 2 and not RECOMPUTE))
    tl.static_assert(PHASE == 0 or not RECOMPUTE)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(h, SPLIT_N * BLOCK_N), GROUP_M)
    e, start, first, end = window_tile(pid_m, tile0_ptr, tiles_total, tile_expert_ptr, tile_start_ptr,
                                        offsets_ptr, slot0, slot1)
    if e < 0:
        return
    rows = start + tl.arange(0, BLOCK_M)
    rows_ld = tl.minimum(tl.maximum(rows, first), end - 1)
    pair = tl.load(token_index_ptr + rows_ld)
    tok = (pair // K).to(tl.int64)
    w_ty = grad_y_ptr.dtype.element_ty

    col0 = pid_n * (SPLIT_N * BLOCK_N)
    offs_n0 = col0 + tl.arange(0, BLOCK_N)
    offs_n1 = offs_n0 + BLOCK_N
    if not EVEN_N:
        offs_n0 = offs_n0 % h
        offs_n1 = offs_n1 % h
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = grad_y_ptr + tok[:, None] * stride_g_t + offs_k[None, :] * stride_g_d  # [BLOCK_M, BLOCK_K]
    wd_e = table_ptr(down_table_ptr, e, w_ty, W_ALIGN)
    wd0_ptrs = wd_e + offs_k[:, None] * stride_wd_d + offs_n0[None, :].to(tl.int64) * stride_wd_n  # [BLOCK_K, BLOCK_N]
    wd1_ptrs = wd_e + offs_k[:, None] * stride_wd_d + offs_n1[None, :].to(tl.int64) * stride_wd_n  # [BLOCK_K, BLOCK_N]
    if RECOMPUTE:
        x_ptrs = x_ptr + tok[:, None] * stride_x_t + offs_k[None, :] * stride_x_d  # [BLOCK_M, BLOCK_K]
        wg_ptrs = (table_ptr(gate_table_ptr, e, w_ty, W_ALIGN)
                   + offs_n0[None, :].to(tl.int64) * stride_wg_n + offs_k[:, None] * stride_wg_d)  # [BLOCK_K, BLOCK_N]
        if GATED:
            wu_ptrs = (table_ptr(up_table_ptr, e, w_ty, W_ALIGN)
                       + offs_n0[None, :].to(tl.int64) * stride_wu_n + offs_k[:, None] * stride_wu_d)
    wt = tl.load(weights_ptr + (pair // K).to(tl.int64) * stride_wt_t + (pair % K) * stride_wt_k).to(tl.float32)

    acc_dh0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_dh1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PHASE != 2:  # PHASE 2 reads dH' instead
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
                    if GATED:
                        wu = tl.load(wu_ptrs)
                else:
                    xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                    wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
                    if GATED:
                        wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
                acc_a = tl.dot(xa, wg, acc_a, input_precision=DOT_PRECISION)
                if GATED:
                    acc_b = tl.dot(xa, wu, acc_b, input_precision=DOT_PRECISION)
                x_ptrs += BLOCK_K * stride_x_d
                wg_ptrs += BLOCK_K * stride_wg_d
                if GATED:
                    wu_ptrs += BLOCK_K * stride_wu_d

    if PHASE == 1:
        io_ty = hw_ptr.dtype.element_ty
        ptrs, mask = _dh_tile(hw_ptr, col0, start, first, end, slot0, h, stride_hw_s, stride_hw_n, BLOCK_M, BLOCK_N,
                              EVEN_N)
        tl.store(ptrs, acc_dh0.to(io_ty), mask=mask)
        if SPLIT_N == 2:
            ptrs, mask = _dh_tile(hw_ptr, col0 + BLOCK_N, start, first, end, slot0, h, stride_hw_s, stride_hw_n,
                                  BLOCK_M, BLOCK_N, EVEN_N)
            tl.store(ptrs, acc_dh1.to(io_ty), mask=mask)
        return
    if PHASE == 2:  # both tiles read before the epilogues overwrite them
        ptrs, mask = _dh_tile(hw_ptr, col0, start, first, end, slot0, h, stride_hw_s, stride_hw_n, BLOCK_M, BLOCK_N,
                              EVEN_N)
        acc_dh0 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if SPLIT_N == 2:
            ptrs, mask = _dh_tile(hw_ptr, col0 + BLOCK_N, start, first, end, slot0, h, stride_hw_s, stride_hw_n,
                                  BLOCK_M, BLOCK_N, EVEN_N)
            acc_dh1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if RECOMPUTE:  # the biases enter A|B before rounding, as in the forward
        if HAS_GATE_BIAS:
            acc_a += tl.load(gate_bias_ptr + e.to(tl.int64) * h + offs_n0).to(tl.float32)[None, :]
        if HAS_UP_BIAS:
            acc_b += tl.load(up_bias_ptr + e.to(tl.int64) * h + offs_n0).to(tl.float32)[None, :]
    _dh_epilogue(acc_dh0, acc_a, acc_b, col0, start, first, end, slot0, wt, h, alpha, limit,
                 preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                 stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
                 ACT, GATED, RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N)
    if SPLIT_N == 2:
        _dh_epilogue(acc_dh1, acc_a, acc_b, col0 + BLOCK_N, start, first, end, slot0, wt, h, alpha, limit,
                     preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                     stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
                     ACT, GATED, RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N)


def _offsets_fit_int32(*tensors: Tensor) -> bool:
    """Every element offset of these 2-D tensors (rows x row stride + columns x column stride) is below 2**31."""
    return all(sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) < 2 ** 31 for t in tensors)


@triton.jit
def _token_rows(token_index_ptr, s, seg_hi, K, IDX: tl.constexpr):
    """Token row of each slot in ``s`` (0 past the segment's end)."""
    return (tl.load(token_index_ptr + s, mask=s < seg_hi, other=0) // K).to(IDX)


@triton.heuristics({
    "EVEN_M": lambda a: a["m_dim"] % a["BLOCK_M"] == 0,
    "EVEN_N": lambda a: a["n_dim"] % a["BLOCK_N"] == 0,
    "ROWS32": lambda a: _offsets_fit_int32(a["a_ptr"], a["b_ptr"]),
})
@sized(triton.jit)
def _expert_dw_kernel(
    a_ptr,  # [T, m_dim], read at row token(s): dy (dW_down) or x (dW_gate, dW_up)
    b_ptr,  # [slot1 - slot0, n_dim]: the window's slots of w*H (dW_down) or dA, dB (dW_gate, dW_up)
    b_desc,  # TMA: a host tensor descriptor of b, block [BLOCK_K, BLOCK_N]; else b_ptr again (unused)
    out_table_ptr,  # [E] int64: dW[e] [m_dim, n_dim] via (stride_o_m, stride_o_n), x.dtype or fp32 (OUT_FP32)
    token_index_ptr,  # [N] int32
    offsets_ptr,  # [E+1] int32
    m_dim, n_dim, K,
    slot0, slot1,  # the slot window whose contribution this launch computes
    own_end,  # experts starting in [slot0, own_end) are written by this window (own_end = slot1, N + 1 for the last)
    stride_a_r, stride_a_m,
    stride_b_r, stride_b_n,
    stride_o_m, stride_o_n,
    OUT_FP32: tl.constexpr, ACCUMULATE: tl.constexpr, O_ALIGN: tl.constexpr,
    MAY_ADD: tl.constexpr,  # ACCUMULATE or slot0 > 0: some program may start from C (else no C load at all)
    TMA: tl.constexpr,  # the slot-ordered operand's full chunks through b_desc (its ragged tail through pointers)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    ROWS32: tl.constexpr,  # every element offset of a and b fits in int32: 32-bit row arithmetic
    INTERLEAVED: tl.constexpr = False,  # b is dA|dB [.., n_dim]; C's columns interleave them (below)
):
    """grid = (E * cdiv(m_dim, BLOCK_M) * cdiv(n_dim, BLOCK_N),): one output tile of one expert per program,
    dW[e] = sum over e's slots s in the window of a[token(s)].T @ b[s], the contraction running over the
    slots BLOCK_K at a time (full chunks unmasked, then one masked tail). An expert whose slots start in this
    window (or an expert with no slots placed here) gets dW[e] = contribution (zeros for no slots); one whose
    slots started in an earlier window gets dW[e] + contribution (loaded in its dtype, summed in fp32); the
    rest are not touched. With ACCUMULATE every expert with slots in the window gets dW[e] + contribution,
    the others are not touched.

    The gathered operand is always A (tokens' columns along the tile's rows) and the slot-ordered one B:
    a weight gradient whose natural form has the gathered operand on the right (dW_gate = dA.T @ x[tok]) is
    computed transposed, through a transposed output table. With the gathered operand on the right instead, the
    best tile of that form ran 6-11 % slower (H100, raw launches; docs/dw.md).

    INTERLEAVED (gate and up interleaved column by column, tables.interleaved_gate_up): C[e] is the [d, 2h] =
    [m_dim, n_dim] gradient of the stored gate_up matrix, written with unit column stride, and b the window's dA|dB
    [.., n_dim] (gate first): C's column 2j is dA's column j, 2j + 1 dB's. A program's BLOCK_N columns take
    BLOCK_N / 2 columns of dA and of dB (two loads, through b_desc of block [BLOCK_K, BLOCK_N / 2] when TMA),
    joined in registers."""
    num_m = tl.cdiv(m_dim, BLOCK_M)
    num_n = tl.cdiv(n_dim, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // (num_m * num_n)
    pid_m, pid_n = grouped_tile_ids(pid % (num_m * num_n), num_m, num_n, GROUP_M)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    seg_lo = tl.maximum(lo, slot0)
    seg_hi = tl.minimum(hi, slot1)
    if ACCUMULATE:
        if seg_hi <= seg_lo:
            return
        add_rows = m_dim
    else:
        add = lo < slot0  # e's slots started in an earlier window: add to what that one wrote
        if (seg_hi <= seg_lo) & (add | (lo >= own_end)):  # nothing here, and not this window's to zero
            return
        add_rows = tl.where(add, m_dim, 0)  # rows of C to start from (a row bound: a block mask the
        # interpreter accepts, where a scalar flag broadcast into the mask is not)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_M:
        offs_m_ld = offs_m
    else:
        offs_m_ld = offs_m % m_dim
    HALF_N: tl.constexpr = BLOCK_N // 2
    half = n_dim // 2  # INTERLEAVED: h, the columns of dA (and of dB, which follow)
    if INTERLEAVED:  # columns of dA (and, h further, of dB) whose pairs are this tile's; wrapped ones are dropped
        offs_n_ld = pid_n * HALF_N + tl.arange(0, HALF_N)
        if not EVEN_N:
            offs_n_ld = offs_n_ld % half
    elif EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % n_dim
    offs_s = tl.arange(0, BLOCK_K)
    add_mask = offs_m[:, None] < add_rows
    if EVEN_M and EVEN_N:
        out_mask = None
    else:
        out_mask = (offs_m < m_dim)[:, None] & (offs_n < n_dim)[None, :]
        add_mask = add_mask & (offs_n < n_dim)[None, :]
    if OUT_FP32:
        out_e = table_ptr(out_table_ptr, e, tl.float32, O_ALIGN)
    else:
        out_e = table_ptr(out_table_ptr, e, a_ptr.dtype.element_ty, O_ALIGN)
    out_ptrs = out_e + offs_m[:, None].to(tl.int64) * stride_o_m + offs_n[None, :].to(tl.int64) * stride_o_n
    # The accumulator starts from C when adding (fp32; a predicated load, so zeros otherwise): loaded here,
    # while no accumulator is live yet; loading it after the loop needs a second 128x256 fp32 tile in
    # registers and spilled (sm_90 SASS).
    if MAY_ADD:
        acc = tl.load(out_ptrs, mask=add_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    IDX: tl.constexpr = tl.int32 if ROWS32 else tl.int64
    # The token rows are loaded in the chunk's own iteration: the pipeliner treats that as an indirect load
    # and copies them into shared memory a stage ahead of the tile copy needing them (a stage more: 5 stages
    # hold 3 tile buffers). A register prefetch one chunk ahead is worse: the pipeliner re-issues it in the
    # iteration of the copy that needs it, which then waits on it (TTGIR, sm_90; docs/dw.md).
    # Slot-ordered rows are the window's: row = slot - slot0.
    s = seg_lo + offs_s
    n_full = tl.maximum(seg_hi - seg_lo, 0) // BLOCK_K
    if TMA:
        # A descriptor built by the host, over the whole window: full chunks never cross the segment's end, and
        # a program builds no descriptor of its own. One bounded by the segment, built here, cost the three dW
        # launches 4.9 % at C and 2.6 % at D in the layer step: a global write and a proxy fence on the way to
        # the first load (H100; docs/dw.md).
        if INTERLEAVED:
            tl.static_assert((b_desc.block_shape[0] == BLOCK_K) & (b_desc.block_shape[1] == HALF_N))
        else:
            tl.static_assert((b_desc.block_shape[0] == BLOCK_K) & (b_desc.block_shape[1] == BLOCK_N))
    for i in range(0, n_full):
        tok = _token_rows(token_index_ptr, s, seg_hi, K, IDX)
        a = tl.load(a_ptr + tok[None, :] * stride_a_r + offs_m_ld[:, None] * stride_a_m)  # [BLOCK_M, BLOCK_K]
        if INTERLEAVED:
            if TMA:
                b0 = b_desc.load([seg_lo - slot0 + i * BLOCK_K, pid_n * HALF_N])
                b1 = b_desc.load([seg_lo - slot0 + i * BLOCK_K, half + pid_n * HALF_N])
            else:
                b_ptrs = b_ptr + (s - slot0).to(IDX)[:, None] * stride_b_r + offs_n_ld[None, :] * stride_b_n
                b0 = tl.load(b_ptrs)
                b1 = tl.load(b_ptrs + half * stride_b_n)
            b = tl.reshape(tl.join(b0, b1), [BLOCK_K, BLOCK_N])  # column 2j: dA's column j, 2j + 1: dB's
        elif TMA:
            b = b_desc.load([seg_lo - slot0 + i * BLOCK_K, pid_n * BLOCK_N])
        else:
            b = tl.load(b_ptr + (s - slot0).to(IDX)[:, None] * stride_b_r + offs_n_ld[None, :] * stride_b_n)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        s += BLOCK_K
    if seg_lo + n_full * BLOCK_K < seg_hi:  # ragged tail of this expert's slots
        s_mask = s < seg_hi
        tok = _token_rows(token_index_ptr, s, seg_hi, K, IDX)
        a = tl.load(a_ptr + tok[None, :] * stride_a_r + offs_m_ld[:, None] * stride_a_m, mask=s_mask[None, :],
                    other=0.0)
        s_ld = (tl.minimum(s, seg_hi - 1) - slot0).to(IDX)
        b_ptrs = b_ptr + s_ld[:, None] * stride_b_r + offs_n_ld[None, :] * stride_b_n
        if INTERLEAVED:
            b0 = tl.load(b_ptrs, mask=s_mask[:, None], other=0.0)
            b1 = tl.load(b_ptrs + half * stride_b_n, mask=s_mask[:, None], other=0.0)
            b = tl.reshape(tl.join(b0, b1), [BLOCK_K, BLOCK_N])
        else:
            b = tl.load(b_ptrs, mask=s_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    tl.store(out_ptrs, acc.to(out_e.dtype.element_ty), mask=out_mask)


@triton.heuristics({"EVEN_N": lambda a: a["n_dim"] % a["BLOCK_N"] == 0})
@sized(triton.jit)
def _expert_bias_grad_kernel(
    src_ptr,  # GATHER: [T, n_dim] read at token rows (dy); else [slot1 - slot0, n_dim], the window's slots (dA, dB)
    weights_ptr,  # [T, K] any float dtype: scales each row when SCALE
    bias_ptr,  # [E, n_dim] contiguous: when DOT, <row, bias[e]> of each slot goes to part
    out_ptr,  # [E, n_dim] fp32 contiguous, out: sum over e's slots in the window of (w *) row
    part_ptr,  # [cdiv(n_dim, BLOCK_N), N + 1] fp32, out when DOT: by slot, one row per column block
    token_index_ptr,  # [N] int32
    offsets_ptr,  # [E+1] int32
    n_dim, K, slot0, slot1,
    stride_src_r, stride_src_n,
    stride_wt_t, stride_wt_k,
    stride_part_c,
    GATHER: tl.constexpr, SCALE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """grid = (E, cdiv(n_dim, BLOCK_N)): a segment sum over one expert's slots in the window [slot0, slot1),
    BLOCK_S rows at a time into a [BLOCK_S, BLOCK_N] fp32 accumulator reduced once at the end (fixed order:
    deterministic, no atomics). Experts with no slots there write zeros."""
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    lo = tl.maximum(tl.load(offsets_ptr + e), slot0)
    hi = tl.minimum(tl.load(offsets_ptr + e + 1), slot1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_dim
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % n_dim
    if DOT:
        bias = tl.load(bias_ptr + e.to(tl.int64) * n_dim + offs_n_ld).to(tl.float32)
        if not EVEN_N:
            bias = tl.where(n_mask, bias, 0.0)
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < hi
        if GATHER or SCALE or DOT:
            pair = tl.load(token_index_ptr + s, mask=s_mask, other=0)
        if GATHER:
            r = (pair // K).to(tl.int64)
        else:
            r = (s - slot0).to(tl.int64)
        v = tl.load(src_ptr + r[:, None] * stride_src_r + offs_n_ld[None, :] * stride_src_n,
                    mask=s_mask[:, None], other=0.0).to(tl.float32)
        if DOT:
            tl.store(part_ptr + pid_n.to(tl.int64) * stride_part_c + s.to(tl.int64), tl.sum(v * bias[None, :], axis=1),
                     mask=s_mask)
        if SCALE:
            wt = tl.load(weights_ptr + (pair // K).to(tl.int64) * stride_wt_t + (pair % K) * stride_wt_k,
                         mask=s_mask, other=0.0).to(tl.float32)
            v = v * wt[:, None]
        acc += v
    tl.store(out_ptr + e.to(tl.int64) * n_dim + offs_n, tl.sum(acc, axis=0), mask=n_mask)


_expert_dh_tuned = autotune.tuned(_expert_dh_kernel, "dh", key=["d", "h", "ACT"])
_expert_dh_recompute_tuned = autotune.tuned(_expert_dh_kernel, "dh_recompute", key=["d", "h", "ACT"])
_expert_dh_gemm_tuned = autotune.tuned(_expert_dh_kernel, "dh_gemm", key=["d", "h", "ACT"])
_expert_dh_act_tuned = autotune.tuned(_expert_dh_kernel, "dh_act", key=["d", "h", "ACT"])

# Under "activations" the dh kernel runs as two launches: its GEMM alone, storing dH' into the w*H buffer, with
# the wide tiles that the epilogue's registers rule out; then its epilogue, reading dH' back and overwriting it
# with w*H. One more round trip of dH' through memory in x.dtype, and no more memory. H100, raw launches,
# fused / split (docs/dh.md): C 1.47 / 1.27 ms, D 1.89 / 1.65-1.73, A 13.19 / 12.87, B 9.38 / 8.59.
# False: one fused launch (kept for comparisons; the tests keep it right).
DH_SPLIT = True

_expert_dw_tuned = autotune.tuned(_expert_dw_kernel, "dw", key=["m_dim", "n_dim", "TMA", "INTERLEAVED"])
# Keys (m_dim, n_dim, descriptor or not, operand dtypes, out dtype) whose autotuning has been done by a
# non-accumulating launch: see _weight_grad.
_DW_TUNED_KEYS: set[tuple] = set()


def _dw_tma(slots: Tensor) -> bool:
    """Whether the dW kernel reads the slot-ordered operand (dA, dB or w*H) through a tensor descriptor
    (TMA on the GPU) rather than through pointers: where a descriptor can describe it (unit column stride,
    16-byte aligned base and row stride) and the device has TMA (sm_90+; the Triton interpreter runs
    descriptors too). H100, 2026-11-21 (docs/dw.md): dW_down at config A 10.03 -> 8.61 ms
    with 128x256x64 tiles and 4 stages."""
    item = slots.element_size()
    if slots.numel() == 0 or slots.stride(1) != 1 or (slots.stride(0) * item) % 16 or slots.data_ptr() % 16:
        return False  # (a descriptor's shape must be positive)
    return tma_available(slots.device)


def _transposed(t: WeightTable) -> WeightTable:
    """The same E matrices read as their transposes."""
    return t._replace(rows=t.cols, cols=t.rows, stride_r=t.stride_c, stride_c=t.stride_r,
                      dense=None if t.dense is None else t.dense.transpose(1, 2))


def _gate_up_table(gate: WeightTable, up: WeightTable | None) -> WeightTable | None:
    """One table of the ``[E, 2h, c]`` view that holds gate's rows and then up's, where up's matrices are gate's
    shifted by h rows (Hugging Face's fused ``gate_up``, its gradient likewise): then dW_gate and dW_up are one dW
    launch over dA|dB's 2h columns, each output element summed as in two launches. None otherwise."""
    if up is None or gate.dense is None or up.dense is None or gate.dtype != up.dtype:
        return None
    g, u = gate.dense, up.dense
    E, h, c = g.shape
    if u.shape != g.shape or u.stride() != g.stride() or g.stride(1) == 0 or h == 0 or \
            u.data_ptr() != g.data_ptr() + h * g.stride(1) * g.element_size():
        return None
    return table_of(g.as_strided((E, 2 * h, c), g.stride()))


def _interleaved_grad_table(gate: WeightTable, up: WeightTable | None) -> WeightTable | None:
    """Where gate's and up's gradients are interleaved column by column (:func:`.tables.interleaved_gate_up`):
    one table of their [cols, 2h] matrices (gpt-oss's gate_up_proj [E, d, 2h] per expert), unit column stride,
    through gate's addresses: dW_gate and dW_up are then one dW launch whose output tiles are contiguous along 2h.
    None otherwise."""
    if not interleaved_gate_up(gate, up):
        return None
    g = gate.dense  # [E, h, c] with strides (., 2, stride_c)
    E, h, c = g.shape
    return table_of(g.as_strided((E, c, 2 * h), (g.stride(0), g.stride(2), 1)))


def _weight_grad(tokens: Tensor, slots: Tensor, out: WeightTable, plan: DispatchPlan, K: int,
                 accumulate: bool, window: tuple[int, int, int], interleaved: bool = False) -> None:
    """dW[e] (+)= sum over e's slots s in the window of tokens[token(s)].T @ slots[s - slot0], written through
    the table ``out`` ([tokens' columns, slots' columns]). ``window`` = (slot0, slot1, own_end): see the kernel.
    ``interleaved``: ``slots`` is dA|dB [.., 2h] and ``out`` the [d, 2h] matrices of interleaved gate and up
    gradients (:func:`_interleaved_grad_table`), whose column 2j is dA's column j and 2j + 1 dB's."""
    E, m_dim, n_dim = out.ptrs.numel(), out.rows, out.cols
    if E == 0 or m_dim == 0 or n_dim == 0:
        return
    if not interleaved and dw_sm90.usable(tokens, slots, out, table_align(out)):
        return dw_sm90.dw_sm90(tokens, slots, out, plan, K, accumulate, window)  # sm_90: Gluon (bitwise the same)
    out_fp32 = out.dtype == torch.float32 and tokens.dtype != torch.float32

    def grid(meta):
        return (E * triton.cdiv(m_dim, meta["BLOCK_M"]) * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    tma = _dw_tma(slots)
    if interleaved:  # two loads of BLOCK_N / 2 columns (dA's, dB's) per chunk
        b_desc = autotune.fitted_descriptor(slots, lambda meta: [meta["BLOCK_K"], meta["BLOCK_N"] // 2]) \
            if tma else slots
    else:
        b_desc = autotune.fitted_descriptor(slots, lambda meta: [meta["BLOCK_K"], meta["BLOCK_N"]]) if tma else slots

    def go(table: WeightTable, acc: bool) -> None:
        autotune.launch(
            _expert_dw_kernel, _expert_dw_tuned, "dw", grid,
            tokens, slots, b_desc, table.ptrs, plan.token_index, plan.offsets, m_dim, n_dim, K, *window,
            tokens.stride(0), tokens.stride(1), slots.stride(0), slots.stride(1), table.stride_r, table.stride_c,
            OUT_FP32=out_fp32, ACCUMULATE=acc, MAY_ADD=acc or window[0] > 0,
            TMA=tma, O_ALIGN=table_align(table), DOT_PRECISION=dot_precision(tokens.dtype), INTERLEAVED=interleaved,
        )

    # At least as fine as the autotuner's key (m_dim, n_dim, TMA, INTERLEAVED and the operand dtypes): a key
    # coarser than the tuner's would let an adding launch be the first of a new tuner key, and be timed.
    key = (m_dim, n_dim, tma, interleaved, tokens.dtype, slots.dtype, out.dtype)
    adds = accumulate or window[0] > 0  # windows after the first add onto experts started earlier
    if adds and autotune.autotuning() and key not in _DW_TUNED_KEYS:
        # The autotuner runs a kernel many times while timing it: an accumulating launch would add its
        # contribution once per run. Tune on a scratch output first (every expert writes the same
        # [m, n] buffer with the real table's strides: garbage, never read); ACCUMULATE and the window are
        # not part of the tuning key, so the real launch below reuses the chosen configuration untimed.
        scratch = torch.empty(((m_dim - 1) * out.stride_r + (n_dim - 1) * out.stride_c + 1,), dtype=out.dtype,
                              device=tokens.device)
        ptrs = torch.full((E,), scratch.data_ptr(), dtype=torch.int64, device=tokens.device)
        go(out._replace(ptrs=ptrs), False)
        del scratch
    _DW_TUNED_KEYS.add(key)
    go(out, accumulate)


def _bias_grad(src: Tensor, gather: bool, weights: Tensor | None, plan: DispatchPlan, K: int, E: int,
               dot_bias: Tensor | None = None, part: Tensor | None = None,
               window: tuple[int, int] | None = None) -> Tensor:
    """fp32 [E, n]: per expert, the sum over its slots in ``window`` (default: all) of (w *) src[row] (rows:
    tokens when ``gather``, else the window's slots); with ``dot_bias``, also <src[row], dot_bias[e]> per
    slot into ``part`` (one row per column block)."""
    slot0, slot1 = window if window is not None else (0, plan.token_index.numel())
    n_dim = src.shape[1]
    out = torch.empty((E, n_dim), dtype=torch.float32, device=src.device)
    if E == 0 or n_dim == 0:
        return out
    block_n = _bias_grad_block_n(n_dim)
    w = weights if weights is not None else src  # placeholder pointer, never read
    sw = (weights.stride(0), weights.stride(1)) if weights is not None else (0, 0)
    grid = (E, triton.cdiv(n_dim, block_n))
    launch(
        _expert_bias_grad_kernel, grid,
        src, w, dot_bias if dot_bias is not None else src, out, part if part is not None else out,
        plan.token_index, plan.offsets, n_dim, K, slot0, slot1,
        src.stride(0), src.stride(1), *sw, part.stride(0) if part is not None else 0,
        GATHER=gather, SCALE=weights is not None, DOT=dot_bias is not None,
        BLOCK_S=16 if autotune.interpreting() else 32, BLOCK_N=block_n, num_warps=4,
    )
    return out


def _bias_grad_block_n(n_dim: int) -> int:
    return min(32 if autotune.interpreting() else 128, triton.next_power_of_2(max(n_dim, 1)))


def _dh_sm90_weights(w: ExpertTables, d: int, x: Tensor) -> "gather_sm90.GatherWeights | None":
    """The Gluon kernel's view of W_down for dh's GEMM (B[e][k, n] = W_down[e][k, n]), or None where it cannot
    take it (see :func:`.gather_sm90.dh_weights`)."""
    mode = weight_tma_mode([(w.down.stride_r, w.down.stride_c)], table_align(w.down), x.element_size(), x.device)
    if not (x.is_cuda and mode):
        return None
    return gather_sm90.dh_weights(desc_view(w.down, True, mode), mode == 2, d)


def _recompute_on_gluon(grad_y: Tensor, x: Tensor, hw: Tensor, dpre: Tensor, weights: Tensor, act: Activation,
                        biased: bool, chunk: int) -> bool:
    """Whether a "recompute" window may run the Gluon up kernel into dpre and the fused dh in place over it."""
    bm = plan_block_m()
    return (gather_sm90.up_usable(x, hw, dpre, act.name, biased, bm)
            and gather_sm90.dh_act_usable(grad_y, hw, dpre, dpre, weights, act.name, chunk, bm))


def check_grad_tables(grads: ExpertTables, w: ExpertTables, x: Tensor, roles=("gate", "up", "down")) -> None:
    """The gradient tables of ``roles`` mirror the weight tables: same shapes and E, dtype x.dtype or float32; up's
    exactly when w has one (a gated activation). The other roles' entries are not read (they may be None)."""
    if not isinstance(grads, ExpertTables):
        raise TypeError(f"grads must be an ExpertTables (see kernels.tables), got {type(grads).__name__}")
    if "up" in roles and (grads.up is None) != (w.up is None):
        raise ValueError("grads.up must be given exactly when w.up is (a gated activation)")
    E = w.gate.ptrs.numel()
    dtypes = tuple(dict.fromkeys((x.dtype, torch.float32)))
    for name in roles:
        g, t = getattr(grads, name), getattr(w, name)
        if g is None and name != "up":
            raise ValueError(f"grads.{name} is missing: this call writes the {name} weight's gradient")
        if g is not None:
            check_table(f"grads.{name}", g, t.rows, t.cols, E, x, dtypes)


# The roles whose weight gradients each phase of expert_backward writes
PHASE_ROLES = {"all": ("gate", "up", "down"), "act": ("down",), "dx": (), "dw": ("gate", "up")}


def expert_backward(grad_y: Tensor, x: Tensor, weights: Tensor, w: ExpertTables, preact: Tensor,
                    plan: DispatchPlan, activation: "Activation | str",
                    gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                    *, grads: ExpertTables | None, recompute: bool, accumulate: bool = False, window_slots: int = 0,
                    phase: str = "all", dpre: Tensor | None = None,
                    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx [T, d] x.dtype, dweights [T, K] weights.dtype, d_gate_bias, d_up_bias, d_down_bias).

    Weight gradients go through ``grads`` (tables of the same shapes as ``w``, x.dtype or float32):
    overwritten, or added to when ``accumulate`` (experts with no slots: zeros, or left as they are). ``grads`` may
    be a function returning those tables, called once just before the first weight-gradient kernel: the caller then
    allocates the gradients after the transients freed before it (the per-slot dX, w*H). Bias
    gradients are float32 ``[E, h]``, ``[E, h]``, ``[E, d]``, None where the bias is None.
    ``recompute``: the memory policy. True ("recompute"): A|B are computed again and ``preact`` is the empty
    tensor the forward returned; False ("activations"): ``preact`` is the forward's slot-order ``[T*K, 2h]``
    (``[T*K, h]`` for a plain activation).

    ``window_slots`` > 0 runs the slots in windows of at most that many (:func:`~.expert_fwd.slot_windows`),
    bounding the transients dA|dB, w*H and dX to that many rows. An expert whose slots span several windows
    gets its weight gradient added to in place (one rounding to the gradient's dtype per window it spans),
    and dx accumulates across windows in x's dtype (one rounding per window a token's slots fall in).

    ``phase`` cuts the work of one window (``window_slots`` 0, or not below T*K) into three calls, so that what
    the first reads can be freed before the others allocate, and the gate|up gradients need not exist before dx
    (the operator's split backward, ``ops.py``): ``"act"`` runs dh with its activation epilogue, dW_down and the
    down bias and returns (dA|dB [T*K, width], dweights, None, None, d_down_bias); ``"dx"`` takes that dA|dB as
    ``dpre`` and runs dX and its combine, returning (dx, None, None, None, None) (``grads`` is not used: it may be
    None); ``"dw"`` takes the same ``dpre`` and runs dW_gate|up and the gate/up biases, returning (None, None,
    d_gate_bias, d_up_bias, None). Each writes only its roles' gradient tables (:data:`PHASE_ROLES`); together
    they compute bitwise what ``"all"`` does."""
    T, d, K, E, h, act = check_expert_inputs(x, weights, w, plan, activation, gate_bias, up_bias, down_bias)
    if phase not in PHASE_ROLES:
        raise ValueError(f"phase must be one of {tuple(PHASE_ROLES)}, got {phase!r}")
    make_grads = grads if callable(grads) else None  # made just before the first weight-gradient kernel
    if make_grads is None and PHASE_ROLES[phase]:
        check_grad_tables(grads, w, x, PHASE_ROLES[phase])
    act_phase, dx_phase, dw_phase = phase in ("all", "act"), phase in ("all", "dx"), phase in ("all", "dw")
    N = T * K
    width = 2 * h if act.gated else h
    if act_phase:  # (the "dx" and "dw" phases never read grad_y: it may be None)
        if tuple(grad_y.shape) != (T, d):
            raise ValueError(f"grad_y must be [T, d] = {(T, d)}, got shape {tuple(grad_y.shape)}")
        if grad_y.device != x.device:
            raise ValueError(f"grad_y is on {grad_y.device}, x on {x.device}")
        grad_y = grad_y.to(x.dtype)
    if act_phase and recompute and preact.numel() != 0:
        raise ValueError(f"recompute=True takes the forward's empty preact, got shape {tuple(preact.shape)}")
    if act_phase and not recompute and (tuple(preact.shape) != (N, width) or preact.dtype != x.dtype):
        raise ValueError(f"preact must be [T*K, {'2h' if act.gated else 'h'}] = {(N, width)} of {x.dtype} "
                         f"(recompute=False), got {tuple(preact.shape)} of {preact.dtype}")
    if not act_phase and (dpre is None or tuple(dpre.shape) != (N, width) or dpre.dtype != x.dtype):
        raise ValueError(f"phase {phase!r} takes the 'act' phase's dA|dB [T*K, width] = {(N, width)} of {x.dtype} "
                         f"as dpre, got {None if dpre is None else (tuple(dpre.shape), dpre.dtype)}")

    busy = N > 0 and h > 0 and d > 0  # some GEMM has work
    dx = (x.new_empty((T, d)) if busy else x.new_zeros((T, d))) if dx_phase else None
    chunk = autotune.dweights_chunk()
    num_chunks = triton.cdiv(h, chunk)
    # Rows of the routing-weight partials: first the <dy, b_down> ones (one per column block of d), then the
    # <dH', H> chunks, then spare chunks a program's columns may run into.
    bias_rows = triton.cdiv(d, _bias_grad_block_n(d)) if down_bias is not None and d > 0 else 0
    # The routing-weight gradient's partial sums, by slot; column N stays 0, for the unrouted pairs (slot_of -1)
    part = torch.zeros((bias_rows + num_chunks + _MAX_DH_BLOCK_N // chunk, N + 1), dtype=torch.float32,
                       device=x.device) if act_phase else None
    up = w.up if w.up is not None else w.gate  # placeholder table when not gated, never read
    d_down_bias = None
    if down_bias is not None and act_phase:  # d_down_bias[e] = sum_s w_s dy[tok_s]; <dy[tok_s], b_down[e]> in part
        d_down_bias = _bias_grad(grad_y, True, weights, plan, K, E, dot_bias=down_bias, part=part)
    skip = accumulate and N == 0  # nothing to add
    d_gate_bias = torch.zeros((E, h), dtype=torch.float32, device=x.device) if gate_bias is not None and dw_phase \
        else None
    d_up_bias = torch.zeros((E, h), dtype=torch.float32, device=x.device) if up_bias is not None and dw_phase \
        else None

    windows = slot_windows(plan, window_slots)
    if phase != "all" and len(windows) != 1:
        raise ValueError(f"phase {phase!r} runs one window: window_slots must be 0 or at least T*K = {N}, got "
                         f"{window_slots}")
    # dX = dA @ W_gate[e] (+ dB @ W_up[e]): B[e][k, n] = W[e][k, n]
    w_dx = down_operand(w.gate, w.up, True, h, x) if dx_phase else None
    dh_sm90 = _dh_sm90_weights(w, d, x) if DH_SPLIT and act_phase else None
    # "recompute" on sm_90: A|B recomputed by the forward's Gluon up kernel, then the fused dh (see the module doc)
    up_sm90 = _up_sm90_weights(w, d, _up_weight_mode(w, x)[1], x) if recompute and dh_sm90 is not None else None
    biased = gate_bias is not None or up_bias is not None
    # "recompute" with interleaved gate/up weights (gpt-oss): the dh kernel's own recomputation would read them with
    # a 2-element stride (element-wise gathers); instead the forward's interleaved up kernel computes the window's
    # A|B again into the dA|dB buffer and dh runs as under "activations", in place over it (as the Gluon path above
    # does: each A|B element read before it is written, by the program that writes it). Only split: the epilogue
    # launch (dh_act) has one configuration, never re-run by the tuner over its own output.
    recompute_up = recompute and DH_SPLIT and up_sm90 is None and interleaved_gate_up(w.gate, w.up)

    def grad_tables():  # (the gradient tables, dW_gate|up in one launch, likewise interleaved (gpt-oss's)), made once
        nonlocal grads, made
        if made is None:
            if make_grads is not None:
                grads = make_grads()
                check_grad_tables(grads, w, x, PHASE_ROLES[phase])
            made = (grads, _gate_up_table(grads.gate, grads.up) if dw_phase else None,
                    _interleaved_grad_table(grads.gate, grads.up) if dw_phase else None)
        return made

    made = None
    dpre_in, dpre = dpre, None
    for i, win in enumerate(windows):
        s0, s1 = win.slot0, win.slot1
        n = s1 - s0
        dw_window = (s0, s1, s1 if i + 1 < len(windows) else N + 1)
        if not act_phase:
            dpre = dpre_in
        else:
            dpre = x.new_empty((n, width))  # transients: the window's dA|dB, w*H
            hw = x.new_empty((n, h))
        if busy and act_phase:
            pre = dpre if recompute else preact[s0:]  # placeholder pointer when recomputing, never read

            def grid(meta, num_tiles=win.num_tiles):
                width_n = meta["BLOCK_N"] * meta["SPLIT_N"]
                assert width_n <= _MAX_DH_BLOCK_N and meta["BLOCK_N"] % chunk == 0
                return (num_tiles * triton.cdiv(h, width_n),)

            if up_sm90 is not None and _recompute_on_gluon(grad_y, x, hw, dpre, weights, act, biased, chunk):
                # A|B into the dA|dB buffer (H into hw, which the fused dh overwrites with w*H), exactly as the
                # forward computed them; the fused dh then reads each A|B element before it writes its dA|dB there
                gather_sm90.up_sm90(x, up_sm90, plan, K, d, h, win, hw, dpre, act)
                gather_sm90.dh_act_sm90(grad_y, dh_sm90, plan, K, d, h, win, hw, dpre, dpre, part[bias_rows:],
                                        weights, act)
                phases = []
            elif recompute_up:
                _up_triton(x, w, up, gate_bias, up_bias, hw, dpre, plan, win, d, h, K, act, True,
                           *_up_weight_mode(w, x))
                phases = [(_expert_dh_gemm_tuned, "dh_gemm", 1), (_expert_dh_act_tuned, "dh_act", 2)]
            elif recompute:
                phases = [(_expert_dh_recompute_tuned, "dh_recompute", 0)]
            elif DH_SPLIT:
                phases = [(_expert_dh_gemm_tuned, "dh_gemm", 1), (_expert_dh_act_tuned, "dh_act", 2)]
            else:
                phases = [(_expert_dh_tuned, "dh", 0)]
            in_dh = recompute and not recompute_up  # A|B recomputed inside the dh kernel
            for tuned_kernel, kind, dh_phase in phases:
                if dh_phase == 1 and dh_sm90 is not None and gather_sm90.dh_usable(grad_y, hw, plan_block_m()):
                    if gather_sm90.dh_act_usable(grad_y, hw, pre, dpre, weights, act.name, chunk, plan_block_m()):
                        # both phases in one launch: the same dA|dB and w*H, bitwise
                        gather_sm90.dh_act_sm90(grad_y, dh_sm90, plan, K, d, h, win, hw, pre, dpre,
                                                part[bias_rows:], weights, act)
                        break
                    gather_sm90.dh_sm90(grad_y, dh_sm90, plan, K, d, h, win, hw)  # the same dH', bitwise
                    continue
                autotune.launch(
                    _expert_dh_kernel, tuned_kernel, kind, grid,
                    grad_y, x, w.gate.ptrs, up.ptrs, w.down.ptrs,
                    gate_bias if gate_bias is not None else x, up_bias if up_bias is not None else x,
                    weights, pre, dpre, hw, part[bias_rows:],
                    plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start, win.tile0,
                    win.num_tiles, plan.tile_expert.numel(), s0, s1, d, h, K,
                    grad_y.stride(0), grad_y.stride(1), x.stride(0), x.stride(1),
                    w.gate.stride_r, w.gate.stride_c, up.stride_r, up.stride_c, w.down.stride_r, w.down.stride_c,
                    weights.stride(0), weights.stride(1),
                    pre.stride(0), pre.stride(1), dpre.stride(0), dpre.stride(1), hw.stride(0), hw.stride(1),
                    part.stride(0),
                    float(act.alpha), float(act.limit),
                    ACT=ACT_CODES[act.name], GATED=act.gated,
                    HAS_GATE_BIAS=gate_bias is not None, HAS_UP_BIAS=up_bias is not None,
                    W_ALIGN=table_align(w.down, w.gate, w.up) if in_dh else table_align(w.down),
                    RECOMPUTE=in_dh, DOT_PRECISION=dot_precision(x.dtype), CHUNK_N=chunk, BLOCK_M=plan_block_m(),
                    PHASE=dh_phase,
                )
            del pre  # may alias dpre: it must not outlive the window
        if act_phase:
            if not skip:
                _weight_grad(grad_y, hw, grad_tables()[0].down, plan, K, accumulate, dw_window)  # [E, d, h]
            del hw
        if busy and dx_phase:  # dX, combined into dx at once: its slots are freed before dW_gate|up
            dx_slots = x.new_empty((n, d))
            down_project(dpre, h, w_dx, d, plan, dx_slots, None, win)
            combine(dx_slots, None, plan, T, K, dx, (s0, s1), accumulate=i > 0)
            del dx_slots
        if not dw_phase:  # "act" or "dx": one window
            break
        if not skip:
            grads, grads_gate_up, grads_interleaved = grad_tables()
            # [E, h, d], computed as its transpose: the gathered operand goes on A's side (see the kernel)
            # On a GPU the interleaved dW runs only where dA|dB's rows take a descriptor: its pointer form crashes
            # Triton 3.6's TritonGPUOptimizeDotOperands pass on sm_90 (h = 90, H100, 2026-11-27); the interpreter
            # runs that form (the CPU tests' path), and elsewhere gate and up take the strided launches below.
            if grads_interleaved is not None and (_dw_tma(dpre) or not dpre.is_cuda):
                _weight_grad(x, dpre, grads_interleaved, plan, K, accumulate, dw_window, True)  # interleaved
            elif grads_gate_up is not None:
                _weight_grad(x, dpre, _transposed(grads_gate_up), plan, K, accumulate, dw_window)
            else:
                _weight_grad(x, dpre[:, :h], _transposed(grads.gate), plan, K, accumulate, dw_window)
                if act.gated:
                    _weight_grad(x, dpre[:, h:], _transposed(grads.up), plan, K, accumulate, dw_window)
        if gate_bias is not None:
            d_gate_bias += _bias_grad(dpre[:, :h], False, None, plan, K, E, window=(s0, s1))
        if up_bias is not None:
            d_up_bias += _bias_grad(dpre[:, h:], False, None, plan, K, E, window=(s0, s1))
        del dpre
    if phase == "dx":
        return dx, None, None, None, None
    if phase == "dw":
        return None, None, d_gate_bias, d_up_bias, None
    dweights = part[:bias_rows + num_chunks].sum(0)[plan.slot_of].view(T, K).to(weights.dtype)  # (-1: column N)
    if phase == "act":
        return dpre, dweights, None, None, d_down_bias
    return dx, dweights, d_gate_bias, d_up_bias, d_down_bias
