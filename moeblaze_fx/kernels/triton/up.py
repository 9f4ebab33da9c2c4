"""The up projection, gathering x's rows on the fly: per row tile of one expert of a slot window,
A = x_rows @ W_gate[e].T + b_gate, B = x_rows @ W_up[e].T + b_up in one pass over d (B only for gated activations);
the epilogue rounds A|B, writes them when they are saved, and H = act(A, B) (:mod:`..act`).

Interleaved gate and up (gpt-oss's ``gate_up_proj [E, d, 2h]``: gate = columns 0::2, up = 1::2;
:func:`..tables.interleaved_gate_up` decides from the tables): each role alone is strided by 2 along h, which only
element-wise loads can read. The INTERLEAVED path reads each expert's [d, 2h] instead as one matrix, contiguous along
2h (a descriptor over it where its rows are 16-byte aligned), into one [BLOCK_M, 2 * BLOCK_N] accumulator whose
adjacent columns it splits into A and B; a saved A|B is interleaved alike (column 2j A's column j, 2j + 1 B's), one
contiguous [BLOCK_M, 2 * BLOCK_N] tile per program: its two halves stored apart, every other element, made the
kernel 2.1x slower at gpt-oss's shape (H100).

The forward's orchestration (:mod:`..forward`) and the backward's "recompute" with interleaved weights
(:mod:`..backward`) launch it through :func:`up_project`.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..act import ACT_CODES, act_forward
from ..autotune import plan_block_m
from ..launch import sized
from ..reference import Activation, DispatchPlan
from ..tables import ExpertTables, interleaved_gate_up
from .common import (
    SlotWindow,
    dot_precision,
    grouped_tile_ids,
    table_align,
    table_ptr,
    w_desc,
    w_tile,
    weight_tma_mode,
    window_tile,
)

__all__ = ["up_weight_mode", "up_project"]


@triton.jit
def _interleaved_up_loop(x_ptrs, w_base, pid_n, d, h, stride_x_d, stride_w_d, W_TMA: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """(A, B) [BLOCK_M, BLOCK_N] fp32 of gate and up columns [pid_n * BLOCK_N, +BLOCK_N) from interleaved weights:
    B'[k, c] = W[e][c, k] over the expert's [2h, d] matrix of unit row stride at ``w_base`` (column c = 2j is gate's
    row j, 2j + 1 up's), read one contiguous [BLOCK_K, 2 * BLOCK_N] tile per K step into one accumulator; its
    adjacent columns are split into A and B at the end. Columns past 2h read as zeros (descriptor) or wrap
    (pointers; an even number of columns, so a wrapped pair stays a gate/up pair): only dropped outputs see them."""
    offs_k = tl.arange(0, BLOCK_K)
    c0 = pid_n * (2 * BLOCK_N)
    # a descriptor's block spans at most 256 elements a dimension (TMA): wider tiles load through pointers
    DESC: tl.constexpr = W_TMA if 2 * BLOCK_N <= 256 else 0
    if DESC:
        tl.static_assert(DESC == 1)  # the 2h columns are the contiguous axis
        wt_desc = w_desc(w_base, d, 2 * h, stride_w_d, 1, DESC, BLOCK_K, 2 * BLOCK_N)
    else:
        offs_c = c0 + tl.arange(0, 2 * BLOCK_N)
        if not EVEN_N:
            offs_c = offs_c % (2 * h)
        w_ptrs = w_base + offs_c[None, :].to(tl.int64) + offs_k[:, None] * stride_w_d  # [BLOCK_K, 2 * BLOCK_N]
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs)
        else:
            k_mask = offs_k < d - k0
            xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        if DESC:
            w = w_tile(wt_desc, k0, c0, DESC)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(xa, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_x_d
        if not DESC:
            w_ptrs += BLOCK_K * stride_w_d
    acc_a, acc_b = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    return acc_a, acc_b


@triton.heuristics({
    "EVEN_K": lambda a: a["d"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["h"] % a["BLOCK_N"] == 0,
})
@sized(triton.jit)
def _expert_up_kernel(
    x_ptr,  # [T, d] x.dtype: tokens, rows read through token_index
    gate_table_ptr,  # [E] int64: byte address of W_gate[e] [h, d] (x.dtype), strides (stride_wg_n, stride_wg_d)
    up_table_ptr,  # [E] int64: W_up[e] [h, d], read when GATED
    gate_bias_ptr,  # [E, h] x.dtype contiguous, read when HAS_GATE_BIAS
    up_bias_ptr,  # [E, h] x.dtype contiguous, read when HAS_UP_BIAS
    hid_ptr,  # [slot1 - slot0, h] x.dtype, out: H = act(A, B), the window's slots
    preact_ptr,  # [slot1 - slot0, 2h] (gated) or [.., h] x.dtype, out when SAVE_PREACT: A|B, the window's slots
    token_index_ptr,  # [N] int32: pair of each slot
    offsets_ptr,  # [E+1] int32: first slot of each expert
    tile_expert_ptr,  # [tiles_total] int32: expert of each row tile, -1 past the last
    tile_start_ptr,  # [tiles_total] int32: first slot of each row tile
    tile0_ptr,  # [1] int32: the window's first row tile
    num_tiles, tiles_total, slot0, slot1, d, h, K,
    stride_x_t, stride_x_d,
    stride_wg_n, stride_wg_d,
    stride_wu_n, stride_wu_d,
    stride_hid_s, stride_hid_n,
    stride_pre_s, stride_pre_n,
    alpha, limit,  # fp32: the clamped SwiGLUs' parameters (unused otherwise)
    ACT: tl.constexpr, GATED: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr,
    W_ALIGN: tl.constexpr,
    W_TMA: tl.constexpr,  # 0: weight tiles through pointers; else through descriptors (see weight_tma_mode)
    SAVE_PREACT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,  # gate and up interleaved column by column (tables.interleaved_gate_up)
):
    """grid = (num_tiles * cdiv(h, BLOCK_N),): one BLOCK_M x BLOCK_N tile of A (and of B) per program, over
    the row tiles of the slot window [slot0, slot1) (num_tiles: a bound on their count).

    INTERLEAVED: gate's row j and up's row j are rows 2j and 2j + 1 of one [2h, d] matrix per expert with unit row
    stride (gpt-oss's gate_up_proj [E, d, 2h], read in place through the gate table; stride_wg_n is 2). The
    program multiplies by one contiguous [BLOCK_K, 2 * BLOCK_N] tile of its transpose per K step (a descriptor
    when W_TMA, which is then 1) into one [BLOCK_M, 2 * BLOCK_N] accumulator, and splits its adjacent columns into
    A and B; the epilogue is the same."""
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(h, BLOCK_N), GROUP_M)
    e, start, first, end = window_tile(pid_m, tile0_ptr, tiles_total, tile_expert_ptr, tile_start_ptr,
                                       offsets_ptr, slot0, slot1)
    if e < 0:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = (rows >= first) & (rows < end)
    # Rows outside [first, end) re-read a row of the tile: loads need no row mask, stores keep one.
    pair = tl.load(token_index_ptr + tl.minimum(tl.maximum(rows, first), end - 1))
    tok = (pair // K).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % h  # wrapped columns are computed and dropped at the store
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_x_t + offs_k[None, :] * stride_x_d  # [BLOCK_M, BLOCK_K]
    w_ty = x_ptr.dtype.element_ty
    wg_base = table_ptr(gate_table_ptr, e, w_ty, W_ALIGN)
    if INTERLEAVED:
        acc_a, acc_b = _interleaved_up_loop(x_ptrs, wg_base, pid_n, d, h, stride_x_d, stride_wg_d, W_TMA,
                                            DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N)
    else:
        if GATED:
            wu_base = table_ptr(up_table_ptr, e, w_ty, W_ALIGN)
        if W_TMA:  # B[k, n] = W[e][n, k]; columns past h and k past d read as zeros
            wg_desc = w_desc(wg_base, d, h, stride_wg_d, stride_wg_n, W_TMA, BLOCK_K, BLOCK_N)
            if GATED:
                wu_desc = w_desc(wu_base, d, h, stride_wu_d, stride_wu_n, W_TMA, BLOCK_K, BLOCK_N)
        else:
            wg_ptrs = (wg_base + offs_n_ld[None, :].to(tl.int64) * stride_wg_n
                       + offs_k[:, None] * stride_wg_d)  # [BLOCK_K, BLOCK_N]
            if GATED:
                wu_ptrs = wu_base + offs_n_ld[None, :].to(tl.int64) * stride_wu_n + offs_k[:, None] * stride_wu_d

        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_K):
            if EVEN_K:
                xa = tl.load(x_ptrs)
            else:
                k_mask = offs_k < d - k0
                xa = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            if W_TMA:
                wg = w_tile(wg_desc, k0, pid_n * BLOCK_N, W_TMA)
                if GATED:
                    wu = w_tile(wu_desc, k0, pid_n * BLOCK_N, W_TMA)
            elif EVEN_K:
                wg = tl.load(wg_ptrs)
                if GATED:
                    wu = tl.load(wu_ptrs)
            else:
                wg = tl.load(wg_ptrs, mask=k_mask[:, None], other=0.0)
                if GATED:
                    wu = tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0)
            acc_a = tl.dot(xa, wg, acc_a, input_precision=DOT_PRECISION)
            if GATED:
                acc_b = tl.dot(xa, wu, acc_b, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_d
            if not W_TMA:
                wg_ptrs += BLOCK_K * stride_wg_d
                if GATED:
                    wu_ptrs += BLOCK_K * stride_wu_d

    e64 = e.to(tl.int64)
    if HAS_GATE_BIAS:
        acc_a += tl.load(gate_bias_ptr + e64 * h + offs_n_ld).to(tl.float32)[None, :]
    if HAS_UP_BIAS:
        acc_b += tl.load(up_bias_ptr + e64 * h + offs_n_ld).to(tl.float32)[None, :]
    out_ty = hid_ptr.dtype.element_ty
    a = acc_a.to(out_ty)
    rows64 = (rows - slot0).to(tl.int64)  # row in the window's buffers
    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < h)[None, :]
    if SAVE_PREACT and not INTERLEAVED:
        pre_ptrs = preact_ptr + rows64[:, None] * stride_pre_s + offs_n[None, :] * stride_pre_n
        tl.store(pre_ptrs, a, mask=mask)
    # H from the rounded A|B: the same values the backward recomputes from the saved preact.
    if GATED:
        b = acc_b.to(out_ty)
        if SAVE_PREACT and INTERLEAVED:  # A|B interleaved as the weights: one contiguous [BLOCK_M, 2 BLOCK_N] tile
            offs_ab = 2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            if EVEN_N:
                mask_ab = row_mask[:, None]
            else:
                mask_ab = row_mask[:, None] & (offs_ab < 2 * h)[None, :]
            tl.store(preact_ptr + rows64[:, None] * stride_pre_s + offs_ab[None, :] * stride_pre_n,
                     tl.reshape(tl.join(a, b), [BLOCK_M, 2 * BLOCK_N]), mask=mask_ab)
        elif SAVE_PREACT:
            tl.store(pre_ptrs + h * stride_pre_n, b, mask=mask)
        hid = act_forward(a.to(tl.float32), b.to(tl.float32), alpha, limit, ACT)
    else:
        af = a.to(tl.float32)
        hid = act_forward(af, af, alpha, limit, ACT)
    tl.store(hid_ptr + rows64[:, None] * stride_hid_s + offs_n[None, :] * stride_hid_n, hid.to(out_ty), mask=mask)


_expert_up_tuned = autotune.tuned(_expert_up_kernel, "up",
                                  key=["d", "h", "SAVE_PREACT", "ACT", "W_TMA", "INTERLEAVED"])


def up_weight_mode(w: ExpertTables, x: Tensor) -> tuple[int, int]:
    """The up projection's weights' proven alignment and descriptor mode (:func:`weight_tma_mode`): W_gate and W_up,
    W_gate alone when not gated; with interleaved gate and up (:func:`.tables.interleaved_gate_up`), those of the
    [2h, d] matrices through the gate table (mode 1, the 2h columns contiguous, or 0)."""
    if interleaved_gate_up(w.gate, w.up):
        align = table_align(w.gate)
        mode = weight_tma_mode([(w.gate.stride_c, 1)], align, x.element_size(), x.device)
        return align, mode if mode == 1 else 0
    align = table_align(w.gate, w.up)
    tables = (w.gate, w.up if w.up is not None else w.gate)
    return align, weight_tma_mode([(t.stride_c, t.stride_r) for t in tables], align, x.element_size(), x.device)


def up_project(x: Tensor, w: ExpertTables, gate_bias: Tensor | None, up_bias: Tensor | None, hid: Tensor,
               pre: Tensor, plan: DispatchPlan, win: SlotWindow, d: int, h: int, K: int, act: Activation,
               save_preact: bool, align: int, w_tma: int) -> None:
    """One window's up projection through ``_expert_up_kernel``: H into ``hid``, A|B into ``pre`` when
    ``save_preact`` (else ``pre`` is a placeholder, never written), interleaved where the weights are;
    ``align``, ``w_tma`` from :func:`up_weight_mode`."""
    up = w.up if w.up is not None else w.gate  # placeholder table when not gated, never read
    interleaved = interleaved_gate_up(w.gate, w.up)

    def grid(meta, num_tiles=win.num_tiles):
        return (num_tiles * triton.cdiv(h, meta["BLOCK_N"]),)

    autotune.launch(
        _expert_up_kernel, _expert_up_tuned, "up", grid,
        x, w.gate.ptrs, up.ptrs,
        gate_bias if gate_bias is not None else x, up_bias if up_bias is not None else x,
        hid, pre, plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start, win.tile0,
        win.num_tiles, plan.tile_expert.numel(), win.slot0, win.slot1, d, h, K,
        x.stride(0), x.stride(1),
        w.gate.stride_r, w.gate.stride_c, up.stride_r, up.stride_c,
        hid.stride(0), hid.stride(1),
        pre.stride(0) if save_preact else 0, pre.stride(1) if save_preact else 0,
        float(act.alpha), float(act.limit),
        ACT=ACT_CODES[act.name], GATED=act.gated,
        HAS_GATE_BIAS=gate_bias is not None, HAS_UP_BIAS=up_bias is not None,
        W_ALIGN=align, W_TMA=w_tma,
        SAVE_PREACT=save_preact, DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=plan_block_m(),
        INTERLEAVED=interleaved,
    )
