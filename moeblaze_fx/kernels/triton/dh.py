"""dh: per row tile of one expert of a slot window, one pass over d (dy's rows gathered on the fly):

    dH' = dy[tok] @ W_down[e]                (the GEMM)
    A|B = x[tok] @ W_{gate|up}[e].T + b      (RECOMPUTE only, in the same pass over d)

then the epilogue, the activation recomputed in registers (constexpr ACT): H = act(A, B); the routing-weight
gradient's partial <dH', H> over the program's columns, by slot; dH = w * dH'; dA, dB = act'(A, B) dH.
Out: dA|dB [N, 2h] (dA [N, h] plain), w*H [N, h], partials [h/chunk, N] fp32 by slot. A|B and dA|dB are A's h
columns then B's, or interleaved column by column where the gate and up weights are (PAIRS, gpt-oss's).

Under "activations" the kernel runs as two launches (:data:`DH_SPLIT`, PHASE 1 then 2): the GEMM, dH' stored into
the w*H buffer, then the epilogue reading it back. :func:`dh_launch` runs one launch of one kind (``"dh"``,
``"dh_recompute"``, ``"dh_gemm"``, ``"dh_act"``: each its own autotuner).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..act import ACT_CODES, act_backward
from ..autotune import plan_block_m
from ..launch import sized
from ..reference import Activation, DispatchPlan
from ..tables import ExpertTables
from .common import SlotWindow, dot_precision, grouped_tile_ids, table_align, table_ptr, window_tile

__all__ = ["MAX_BLOCK_N", "DH_SPLIT", "dh_launch"]

# Upper bound on the dh kernels' BLOCK_N (any config): the partial buffer gets this many spare columns'
# worth of chunks, so a program's chunk index never runs past it.
MAX_BLOCK_N = 256


@triton.jit
def _dh_epilogue(
    acc_dh, acc_a, acc_b,  # [BLOCK_M, BLOCK_N] fp32: dH', and A, B (biases added) when RECOMPUTE
    col0, start, first, end, slot0, wt, h, alpha, limit,
    preact_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype (the window's rows), read unless RECOMPUTE
    dpre_ptr,  # [slot1 - slot0, 2h] or [.., h] x.dtype, out
    hw_ptr,  # [slot1 - slot0, h] x.dtype, out
    part_ptr,  # [num_chunks, N] fp32, out: by slot
    stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
    ACT: tl.constexpr, GATED: tl.constexpr,
    RECOMPUTE: tl.constexpr, CHUNK_N: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Activation backward for hidden columns [col0, col0 + BLOCK_N) of rows [first, end) of the tile starting
    at slot ``start`` (buffers hold the window's rows from slot0), the activation recomputed here. Addresses
    are a scalar 64-bit base per tile plus int32 offsets inside it: per-element 64-bit pointers cost two
    registers each and made this epilogue spill. PAIRS: A|B and dA|dB interleaved column by column (A's column j at
    2j, B's at 2j + 1), read and written as one contiguous [BLOCK_M, 2 * BLOCK_N] tile split into (joined from) A
    and B in registers: loads and stores of every other element made the split dh's epilogue 5x slower (1.73 against
    0.33 ms at gpt-oss's shape, H100)."""
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
        if PAIRS:  # (2h is even: a wrapped pair is still a pair)
            offs_ab = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
            if not EVEN_N:
                offs_ab = offs_ab % (2 * h)
            ab = tl.load(pre_base + local_ld[:, None] * stride_pre_s + offs_ab[None, :] * stride_pre_n)
            a, b = tl.split(tl.reshape(ab.to(tl.float32), [BLOCK_M, BLOCK_N, 2]))
        else:
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
    if PAIRS:
        offs_ab = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
        d_ab = tl.reshape(tl.join(d_a.to(io_ty), d_b.to(io_ty)), [BLOCK_M, 2 * BLOCK_N])
        if EVEN_N:
            mask_ab = row_mask[:, None]
        else:
            mask_ab = row_mask[:, None] & (offs_ab < 2 * h)[None, :]
        tl.store(dpre_base + local[:, None] * stride_dpre_s + offs_ab[None, :] * stride_dpre_n, d_ab, mask=mask_ab)
    else:
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
    part_ptr,  # [num_chunks, N] fp32, out: <dH', H> over each chunk of CHUNK_N columns, by slot
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
    PAIRS: tl.constexpr = False,  # A|B, dA|dB interleaved column by column (see _dh_epilogue)
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
                 ACT, GATED, RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N, PAIRS)
    if SPLIT_N == 2:
        _dh_epilogue(acc_dh1, acc_a, acc_b, col0 + BLOCK_N, start, first, end, slot0, wt, h, alpha, limit,
                     preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                     stride_pre_s, stride_pre_n, stride_dpre_s, stride_dpre_n, stride_hw_s, stride_hw_n, stride_part_c,
                     ACT, GATED, RECOMPUTE, CHUNK_N, BLOCK_N, EVEN_N, PAIRS)


_expert_dh_tuned = autotune.tuned(_expert_dh_kernel, "dh", key=["d", "h", "ACT"])
_expert_dh_recompute_tuned = autotune.tuned(_expert_dh_kernel, "dh_recompute", key=["d", "h", "ACT"])
_expert_dh_gemm_tuned = autotune.tuned(_expert_dh_kernel, "dh_gemm", key=["d", "h", "ACT"])
_expert_dh_act_tuned = autotune.tuned(_expert_dh_kernel, "dh_act", key=["d", "h", "ACT"])
_TUNED = {"dh": _expert_dh_tuned, "dh_recompute": _expert_dh_recompute_tuned, "dh_gemm": _expert_dh_gemm_tuned,
          "dh_act": _expert_dh_act_tuned}

# Under "activations" the dh kernel runs as two launches: its GEMM alone, storing dH' into the w*H buffer, with
# the wide tiles that the epilogue's registers rule out; then its epilogue, reading dH' back and overwriting it
# with w*H. One more round trip of dH' through memory in x.dtype, and no more memory. H100, raw launches,
# fused / split (docs/dh.md): C 1.47 / 1.27 ms, D 1.89 / 1.65-1.73, A 13.19 / 12.87, B 9.38 / 8.59.
# False: one fused launch (kept for comparisons; the tests keep it right).
DH_SPLIT = True


def dh_launch(kind: str, phase: int, grad_y: Tensor, x: Tensor, w: ExpertTables, gate_bias: Tensor | None,
              up_bias: Tensor | None, weights: Tensor, pre: Tensor, dpre: Tensor, hw: Tensor, part: Tensor,
              plan: DispatchPlan, win: SlotWindow, d: int, h: int, K: int, act: Activation, chunk: int,
              recompute: bool, pairs: bool) -> None:
    """One launch of the dh kernel over the window ``win``: ``kind`` names its autotuner, ``phase`` its PHASE (0 both,
    1 the GEMM, 2 the epilogue); ``recompute``: A|B recomputed inside the kernel (``pre`` then a placeholder, never
    read), else read from ``pre``; ``part``: the <dH', H> partials' rows, by slot; ``chunk``: their column width;
    ``pairs``: A|B and dA|dB interleaved column by column (the plan's, ``BackwardPlan.pairs``)."""
    up = w.up if w.up is not None else w.gate  # placeholder table when not gated, never read

    def grid(meta, num_tiles=win.num_tiles):
        width_n = meta["BLOCK_N"] * meta["SPLIT_N"]
        assert width_n <= MAX_BLOCK_N and meta["BLOCK_N"] % chunk == 0
        return (num_tiles * triton.cdiv(h, width_n),)

    autotune.launch(
        _expert_dh_kernel, _TUNED[kind], kind, grid,
        grad_y, x, w.gate.ptrs, up.ptrs, w.down.ptrs,
        gate_bias if gate_bias is not None else x, up_bias if up_bias is not None else x,
        weights, pre, dpre, hw, part,
        plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start, win.tile0,
        win.num_tiles, plan.tile_expert.numel(), win.slot0, win.slot1, d, h, K,
        grad_y.stride(0), grad_y.stride(1), x.stride(0), x.stride(1),
        w.gate.stride_r, w.gate.stride_c, up.stride_r, up.stride_c, w.down.stride_r, w.down.stride_c,
        weights.stride(0), weights.stride(1),
        pre.stride(0), pre.stride(1), dpre.stride(0), dpre.stride(1), hw.stride(0), hw.stride(1),
        part.stride(0),
        float(act.alpha), float(act.limit),
        ACT=ACT_CODES[act.name], GATED=act.gated,
        HAS_GATE_BIAS=gate_bias is not None, HAS_UP_BIAS=up_bias is not None,
        W_ALIGN=table_align(w.down, w.gate, w.up) if recompute else table_align(w.down),
        RECOMPUTE=recompute, DOT_PRECISION=dot_precision(x.dtype), CHUNK_N=chunk, BLOCK_M=plan_block_m(),
        PHASE=phase, PAIRS=pairs,
    )
