"""Fused expert forward: gather-on-the-fly up projection, down projection, deterministic combine.

Notation: T tokens, K choices per token, N = T*K pairs, E experts, d model width, h expert width.
A *pair* p = t*K + k is one entry of ``ids``; a *slot* is its row in the expert-major order of the
:class:`~moeblaze_fx.kernels.reference.DispatchPlan` (``token_index[slot] = p``, ``slot_of[p] = slot``).

Expert weights are read only through per-expert pointer tables (:class:`~moeblaze_fx.kernels.tables.WeightTable`):
each program loads ``ptrs[e]`` once and indexes the matrix with the table's two strides, so a fused
``[E, 2h, d]`` parameter, its transposed or interleaved views and E separate ``nn.Linear`` weights are all
read in place. The activation is a constexpr (``ACT``, its arithmetic in :mod:`.act`): gated ones (swiglu, geglu,
geglu_tanh, swiglu_oai, swiglu_clamp, swiglu_softcap) have a gate and an up projection, plain ones (silu, gelu,
gelu_tanh, relu, relu2) only the gate projection.

Data flow (three launches)::

    x [T, d] ──(token_index: slot -> pair p -> token p // K, read while loading tiles)──┐
    W_gate[e], W_up[e] [h, d] (tables), gate/up biases [E, h] (optional) ──────────────┤
        _expert_up_kernel      per row tile of one expert: A = x_rows @ Wg.T + bg, B = x_rows @ Wu.T + bu in
                               one pass over d (B only for gated activations); epilogue rounds A|B, writes
                               them (when saving) and H = act(A, B)
        ──▶ preact [N, 2h] or [N, h] (saved, "activations" policy)   H [N, h] (transient)
    W_down[e] [d, h] (table), down bias [E, d] (optional) ───────────────────────────┐
        _expert_down_kernel    per row tile: Y = H @ W_down[e].T + bd   ──▶ Y [N, d] (transient, slot order)
        _expert_combine_kernel out[t] = sum_k w[t, k] * Y[slot_of[t*K + k]], fp32 accumulation in a fixed
                               k order, unrouted pairs (slot -1) skipped   ──▶ y [T, d]

No gathered [N, d] copy of x is ever built; the transients H and Y are freed when the launcher
returns. With ``window_slots`` the three launches run once per *slot window* (:class:`SlotWindow`, a
range of the expert-sorted slots), H and Y holding only the window's rows and the combine adding each
window's pairs onto y (:func:`combine`: a window of fewer slots than T runs over its own slots, touching only
their tokens' rows). Saved for backward (by the caller): x, the plan, the routing weights and, under the
"activations" policy, preact (biases included). Nothing is reduced with atomics, so two runs with the same
configuration are bitwise identical.

Row tiles come from the plan: ``tile_expert[i]`` / ``tile_start[i]`` describe ``plan_block_m()`` rows
of one expert; a tile may be ragged (masked against ``offsets[e+1]``), tiles past the last one hold
-1 and their programs exit at once, so grids are sized by the static bound ``max_tiles`` and no host
synchronisation is needed. A window's launches start at its first tile (found on the device) and clip
each tile's rows to the window, so a tile cut by a window boundary is computed by both windows, each
storing its own rows.

Alignment: an address loaded from a table carries no alignment the compiler can see, and without one
every weight load becomes a 2-byte access (no cp.async, no 16-byte vectors). The host passes the
tables' proven alignment as a constexpr (``W_ALIGN``, from ``WeightTable.align`` when the table has that
field; 1 otherwise) and the kernels assert it with ``tl.multiple_of``.

Tensor descriptors: where a weight matrix has a unit stride, a 16-byte aligned other stride and a proven
16-byte aligned base, the up and down kernels read its tiles through a descriptor built in the kernel
from ``ptrs[e]`` (TMA on sm_90; :func:`weight_tma_mode` picks the orientation, ``W_TMA`` / ``B_TMA``), and
the backward's dW kernel does the same for its slot-ordered operand. Tiles past a bound read as zeros,
where the pointer loads mask or wrap; both feed only outputs that are dropped at the store or zero
terms, so the stored results of the two paths are bitwise equal. Pointer loads remain for weights a descriptor
cannot describe (a stride or base that is not 16-byte aligned: odd widths, offsets into a parameter) and devices
before sm_90.

On sm_90, :func:`down_project` hands its launches to the Gluon kernel of :mod:`.down_sm90` (persistent,
warp-specialized, both operands through TMA; bitwise equal results) when the weights are row blocks of one
tensor and the window's rows are 16-byte aligned. The gated up projection without biases goes to
:mod:`.gather_sm90` (the same structure with a producer that gathers x's rows; bitwise equal results) when
d % 64 == 0 and the weights are row blocks of one tensor. The kernel option ``gluon=False``
(``config.KernelOptions``) keeps the Triton kernels.

Interleaved gate and up (gpt-oss's ``gate_up_proj [E, d, 2h]``: gate = columns 0::2, up = 1::2;
:func:`.tables.interleaved_gate_up` decides from the tables): each role alone is strided by 2 along h, which only
element-wise loads can read (no descriptor; the Gluon kernels never take them). The up kernel's INTERLEAVED path reads
each expert's [d, 2h] instead as one matrix, contiguous along 2h (a descriptor over it where its rows are 16-byte
aligned), into one [BLOCK_M, 2 * BLOCK_N] accumulator whose adjacent columns it splits into A and B; the down kernel's
INTERLEAVED path (the backward's dX) contracts over 2h with dA and dB joined column by column in registers against
contiguous [2 * BLOCK_K, BLOCK_N] tiles of it. Saved A|B and the rest of the data flow are the same.

Dtypes: bf16 and fp16 run on the tensor cores (fp32 accumulation), autotuned. fp32 is computed with IEEE fp32 dots
(no tf32), which is what the interpreter tests use; on CUDA the operator runs it with one fixed configuration
(``autotune.FLOAT32_CONFIG``), never on the Gluon kernels.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import autotune, down_sm90, gather_sm90
from .act import ACT_CODES, act_forward
from .autotune import plan_block_m
from .launch import launch, sized
from .reference import Activation, DispatchPlan
from .tables import ExpertTables, WeightTable, interleaved_gate_up
from .triton.common import (
    SlotWindow,
    check_expert_inputs,
    desc_view,
    dot_precision,
    grouped_tile_ids,
    slot_windows,
    table_align,
    table_ptr,
    w_desc,
    w_tile,
    weight_tma_mode,
    window_tile,
)

__all__ = ["expert_forward", "down_operand", "down_project", "combine", "combine_tokens"]


# ---------------------------------------------------------------------------------------------
# Shared device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def _w_tile_of(desc, e, k0, n0, MODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B[e] at (k0, n0) through a host descriptor from :func:`host_weight_desc`
    (over [E, k, n] for MODE 1, [E, n, k] for MODE 2)."""
    if MODE == 1:
        return desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        return desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T


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


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
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
    if SAVE_PREACT:
        pre_ptrs = preact_ptr + rows64[:, None] * stride_pre_s + offs_n[None, :] * stride_pre_n
        tl.store(pre_ptrs, a, mask=mask)
    # H from the rounded A|B: the same values the backward recomputes from the saved preact.
    if GATED:
        b = acc_b.to(out_ty)
        if SAVE_PREACT:
            tl.store(pre_ptrs + h * stride_pre_n, b, mask=mask)
        hid = act_forward(a.to(tl.float32), b.to(tl.float32), alpha, limit, ACT)
    else:
        af = a.to(tl.float32)
        hid = act_forward(af, af, alpha, limit, ACT)
    tl.store(hid_ptr + rows64[:, None] * stride_hid_s + offs_n[None, :] * stride_hid_n, hid.to(out_ty), mask=mask)


@triton.jit
def _row_tile_k_loop(acc, a_ptrs, b_base, b_host, e, offs_n_ld, n0, k_dim, n_dim, stride_a_k, stride_b_k, stride_b_n,
                     B_TMA: tl.constexpr, B_HOST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += A[:, :k_dim] @ B[:k_dim, n0:n0 + BLOCK_N], BLOCK_K at a time (the tail masked unless EVEN_K);
    B's tiles through pointers (columns ``offs_n_ld``) or, with B_TMA, a descriptor over B [k_dim, n_dim]: the
    host's ``b_host`` over every expert when B_HOST, else one built here."""
    offs_k = tl.arange(0, BLOCK_K)
    if B_HOST:
        b_desc = b_host
    elif B_TMA:
        b_desc = w_desc(b_base, k_dim, n_dim, stride_b_k, stride_b_n, B_TMA, BLOCK_K, BLOCK_N)
    else:
        b_ptrs = b_base + offs_k[:, None] * stride_b_k + offs_n_ld[None, :].to(tl.int64) * stride_b_n  # [BK, BN]
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            k_mask = offs_k < k_dim - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        if B_HOST:
            b = _w_tile_of(b_desc, e, k0, n0, B_TMA, BLOCK_K, BLOCK_N)
        elif B_TMA:
            b = w_tile(b_desc, k0, n0, B_TMA)
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_b_k
    return acc


@triton.jit
def _interleaved_k_loop(acc, a_ptrs, b_base, offs_n_ld, n0, k_dim, n_dim, stride_a_k, stride_b_n,
                        B_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += A0 @ B0 + A1 @ B1 with A0 = A[:, :k_dim], A1 = A[:, k_dim:2k_dim] and B0, B1 the even and odd rows
    of one [2 k_dim, n_dim] matrix B of unit row stride at ``b_base`` (interleaved gate and up weights): per K
    step one contiguous [2 BLOCK_K, BLOCK_N] tile of B against A0's and A1's [BLOCK_M, BLOCK_K] tiles joined
    column by column into [BLOCK_M, 2 BLOCK_K]. B's tiles through pointers (columns ``offs_n_ld``) or, with
    B_TMA (then 2: k contiguous), a descriptor built here; rows past 2 k_dim read as zeros or are masked."""
    BLOCK_M: tl.constexpr = a_ptrs.shape[0]
    offs_k = tl.arange(0, BLOCK_K)
    # a descriptor's block spans at most 256 elements a dimension (TMA): deeper tiles load through pointers
    DESC: tl.constexpr = B_TMA if 2 * BLOCK_K <= 256 else 0
    if DESC:
        tl.static_assert(DESC == 2)
        b_desc = w_desc(b_base, 2 * k_dim, n_dim, 1, stride_b_n, DESC, 2 * BLOCK_K, BLOCK_N)
    else:
        offs_kk = tl.arange(0, 2 * BLOCK_K)
        b_ptrs = b_base + offs_kk[:, None] + offs_n_ld[None, :].to(tl.int64) * stride_b_n  # [2 BK, BN]
    a1_ptrs = a_ptrs + k_dim * stride_a_k
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a0 = tl.load(a_ptrs)
            a1 = tl.load(a1_ptrs)
        else:
            k_mask = offs_k < k_dim - k0
            a0 = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            a1 = tl.load(a1_ptrs, mask=k_mask[None, :], other=0.0)
        a = tl.reshape(tl.join(a0, a1), [BLOCK_M, 2 * BLOCK_K])  # column 2j: A0's j, 2j + 1: A1's j
        if DESC:
            b = w_tile(b_desc, 2 * k0, n0, DESC)
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=(offs_kk < 2 * (k_dim - k0))[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        a1_ptrs += BLOCK_K * stride_a_k
        if not DESC:
            b_ptrs += 2 * BLOCK_K
    return acc


@triton.heuristics({
    "EVEN_K": lambda a: a["k_dim"] % a["BLOCK_K"] == 0,
    "EVEN_N": lambda a: a["n_dim"] % a["BLOCK_N"] == 0,
})
@sized(triton.jit)
def _expert_down_kernel(
    a_ptr,  # [slot1 - slot0, k_dim] (or [.., 2*k_dim] when TWO_B), the window's slots: H or dA|dB (for dX)
    b0_table_ptr,  # [E] int64: B0[e] [k_dim, n_dim] via (stride_b0_k, stride_b0_n): W_down[e].T or W_gate[e]
    b1_table_ptr,  # [E] int64: B1[e] [k_dim, n_dim] via (stride_b1_k, stride_b1_n): W_up[e], read when TWO_B
    b0_desc, b1_desc,  # B_HOST: host tensor descriptors of every expert's B0, B1 (else placeholders)
    bias_ptr,  # [E, n_dim] contiguous, a_ptr's dtype: added to C when HAS_BIAS (the down bias)
    c_ptr,  # [slot1 - slot0, n_dim] out, the window's slots: Y (forward) or dX per slot (backward)
    offsets_ptr,  # [E+1] int32
    tile_expert_ptr,  # [tiles_total] int32
    tile_start_ptr,  # [tiles_total] int32
    tile0_ptr,  # [1] int32: the window's first row tile
    num_tiles, tiles_total, slot0, slot1, n_dim, k_dim,
    stride_a_s, stride_a_k,
    stride_b0_k, stride_b0_n,
    stride_b1_k, stride_b1_n,
    stride_c_s, stride_c_n,
    TWO_B: tl.constexpr, HAS_BIAS: tl.constexpr, B_ALIGN: tl.constexpr,
    B_TMA: tl.constexpr,  # 0: B tiles through pointers; else through descriptors (see weight_tma_mode)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    B_HOST: tl.constexpr = False,  # B_TMA through b0_desc / b1_desc, not descriptors built per program
    INTERLEAVED: tl.constexpr = False,  # B0, B1: the even and odd rows of one [2 k_dim, n_dim] matrix (below)
):
    """grid = (num_tiles * cdiv(n_dim, BLOCK_N),): for one row tile of expert e in the slot window
    [slot0, slot1), C[rows] = A[rows, :k_dim] @ B0[e] (+ A[rows, k_dim:2*k_dim] @ B1[e] when TWO_B) (+ bias[e]);
    rows index the window's buffers from slot0.

    INTERLEAVED (dX through interleaved gate and up weights, tables.interleaved_gate_up; TWO_B is then False and
    B_HOST too): B0[e] and B1[e] are rows 0::2 and 1::2 of one [2 k_dim, n_dim] matrix of unit row stride at
    b0_table_ptr's address (stride_b0_n along n), contracted in one K loop (:func:`_interleaved_k_loop`)."""
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_tiles, tl.cdiv(n_dim, BLOCK_N), GROUP_M)
    e, start, first, end = window_tile(pid_m, tile0_ptr, tiles_total, tile_expert_ptr, tile_start_ptr,
                                        offsets_ptr, slot0, slot1)
    if e < 0:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = (rows >= first) & (rows < end)
    rows_ld = (tl.minimum(tl.maximum(rows, first), end - 1) - slot0).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = offs_n % n_dim
    offs_k = tl.arange(0, BLOCK_K)
    b_ty = a_ptr.dtype.element_ty
    a_ptrs = a_ptr + rows_ld[:, None] * stride_a_s + offs_k[None, :] * stride_a_k  # [BLOCK_M, BLOCK_K]
    n0 = pid_n * BLOCK_N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERLEAVED:
        tl.static_assert(not TWO_B and not B_HOST)
        acc = _interleaved_k_loop(acc, a_ptrs, table_ptr(b0_table_ptr, e, b_ty, B_ALIGN), offs_n_ld, n0, k_dim,
                                  n_dim, stride_a_k, stride_b0_n, B_TMA, DOT_PRECISION, BLOCK_K, BLOCK_N, EVEN_K)
    else:
        acc = _row_tile_k_loop(acc, a_ptrs, table_ptr(b0_table_ptr, e, b_ty, B_ALIGN), b0_desc, e, offs_n_ld, n0,
                               k_dim, n_dim, stride_a_k, stride_b0_k, stride_b0_n, B_TMA, B_HOST, DOT_PRECISION,
                               BLOCK_K, BLOCK_N, EVEN_K)
    if TWO_B:  # dX = dA @ W_gate + dB @ W_up: a second K loop into the same accumulator
        acc = _row_tile_k_loop(acc, a_ptrs + k_dim * stride_a_k, table_ptr(b1_table_ptr, e, b_ty, B_ALIGN), b1_desc,
                               e, offs_n_ld, n0, k_dim, n_dim, stride_a_k, stride_b1_k, stride_b1_n, B_TMA, B_HOST,
                               DOT_PRECISION, BLOCK_K, BLOCK_N, EVEN_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e.to(tl.int64) * n_dim + offs_n_ld).to(tl.float32)[None, :]

    if EVEN_N:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_n < n_dim)[None, :]
    c_ptrs = c_ptr + (rows - slot0).to(tl.int64)[:, None] * stride_c_s + offs_n[None, :] * stride_c_n
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_pairs(acc, y_ptr, weights_ptr, slot_of_ptr, t64, rows, offs_d, d, K, slot0, slot1,
               stride_y_s, stride_y_d, stride_wt_t, stride_wt_k,
               HAS_WEIGHTS: tl.constexpr, EVEN_D: tl.constexpr):
    """acc [rows, BLOCK_D] + sum_k w[t, k] * y[slot_of[t*K + k] - slot0] for the tokens t64 of the ``rows`` set,
    over their pairs whose slot lies in [slot0, slot1) (unrouted pairs, slot -1, never do), in fp32, k ascending:
    the one order both combine kernels sum in."""
    for k in range(0, K):
        slot = tl.load(slot_of_ptr + t64 * K + k, mask=rows, other=-1)
        valid = rows & (slot >= slot0) & (slot < slot1)
        if EVEN_D:
            mask = valid[:, None]
        else:
            mask = valid[:, None] & (offs_d < d)[None, :]
        y = tl.load(y_ptr + (slot - slot0).to(tl.int64)[:, None] * stride_y_s + offs_d[None, :] * stride_y_d,
                    mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            wk = tl.load(weights_ptr + t64 * stride_wt_t + k * stride_wt_k, mask=valid, other=0.0)
            y = y * wk.to(tl.float32)[:, None]
        acc += y
    return acc


@triton.heuristics({"EVEN_D": lambda a: a["d"] % a["BLOCK_D"] == 0})
@sized(triton.jit)
def _expert_combine_kernel(
    y_ptr,  # [slot1 - slot0, d], the window's slots: per-slot expert outputs (or per-slot dX in the backward)
    weights_ptr,  # [T, K] any float dtype, read when HAS_WEIGHTS
    slot_of_ptr,  # [N] int32: slot of each pair, -1 when unrouted
    out_ptr,  # [T, d] out (added to when ACCUMULATE)
    T, d, K, slot0, slot1,
    stride_y_s, stride_y_d,
    stride_wt_t, stride_wt_k,
    stride_o_t, stride_o_d,
    HAS_WEIGHTS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """grid = (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D)): out[t] (+)= sum_k w[t, k] * y[slot_of[t*K + k] - slot0]
    over the pairs whose slot lies in [slot0, slot1), in fp32, k in ascending order (deterministic, no
    atomics); with ACCUMULATE the sum starts from out[t] (read in its dtype, one rounding per window)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    if EVEN_D:
        out_mask = t_mask[:, None]
    else:
        out_mask = t_mask[:, None] & (offs_d < d)[None, :]
    out_ptrs = out_ptr + offs_t64[:, None] * stride_o_t + offs_d[None, :] * stride_o_d
    if ACCUMULATE:
        acc = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    acc = _add_pairs(acc, y_ptr, weights_ptr, slot_of_ptr, offs_t64, t_mask, offs_d, d, K, slot0, slot1,
                     stride_y_s, stride_y_d, stride_wt_t, stride_wt_k, HAS_WEIGHTS, EVEN_D)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.heuristics({"EVEN_D": lambda a: a["d"] % a["BLOCK_D"] == 0})
@sized(triton.jit)
def _expert_combine_window_kernel(
    y_ptr,  # [slot1 - slot0, d], the window's slots: per-slot expert outputs (or per-slot dX in the backward)
    weights_ptr,  # [T, K] any float dtype, read when HAS_WEIGHTS
    token_index_ptr,  # [N] int32: pair of each slot
    slot_of_ptr,  # [N] int32: slot of each pair, -1 when unrouted
    out_ptr,  # [T, d], added to
    d, K, slot0, slot1,
    stride_y_s, stride_y_d,
    stride_wt_t, stride_wt_k,
    stride_o_t, stride_o_d,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """grid = (cdiv(slot1 - slot0, BLOCK_S), cdiv(d, BLOCK_D)): the same sum as :func:`_expert_combine_kernel`
    with ACCUMULATE, over the window's tokens only. The program holding a token's first slot in [slot0, slot1)
    adds all of that token's pairs in the window onto out[t] (fp32, k ascending, the same operations in the same
    order, so the results are bitwise those of the token-major kernel); every other token's row is not touched.
    Work and traffic follow the window's size, not T: over many windows the token-major kernel would read and
    write all of out once per window."""
    offs_s = slot0 + tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = offs_s < slot1
    t64 = (tl.load(token_index_ptr + offs_s, mask=s_mask, other=0) // K).to(tl.int64)
    first = tl.full((BLOCK_S,), -1, tl.int32)  # the token's first slot in the window (-1: none yet)
    for k in range(0, K):
        slot = tl.load(slot_of_ptr + t64 * K + k, mask=s_mask, other=-1)
        valid = (slot >= slot0) & (slot < slot1)
        first = tl.where(valid & ((first < 0) | (slot < first)), slot, first)
    own = s_mask & (first == offs_s)  # an unrouted slot is no pair's slot: never owns
    if EVEN_D:
        out_mask = own[:, None]
    else:
        out_mask = own[:, None] & (offs_d < d)[None, :]
    out_ptrs = out_ptr + t64[:, None] * stride_o_t + offs_d[None, :] * stride_o_d
    acc = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    acc = _add_pairs(acc, y_ptr, weights_ptr, slot_of_ptr, t64, own, offs_d, d, K, slot0, slot1,
                     stride_y_s, stride_y_d, stride_wt_t, stride_wt_k, HAS_WEIGHTS, EVEN_D)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_expert_up_tuned = autotune.tuned(_expert_up_kernel, "up",
                                  key=["d", "h", "SAVE_PREACT", "ACT", "W_TMA", "INTERLEAVED"])
_expert_down_tuned = autotune.tuned(_expert_down_kernel, "down",
                                    key=["n_dim", "k_dim", "TWO_B", "B_TMA", "INTERLEAVED"])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
class DownOperand(NamedTuple):
    """The B operand of the down kernel, resolved once per forward or backward call (not per window):
    B0[e] (and B1[e] for dX) [k, n], the tables' matrices (``k_is_rows``) or their transposes."""

    ptrs: tuple[Tensor, Tensor]  # B0's and B1's pointer tables (B0's again for one table)
    strides: tuple[int, int, int, int]  # (stride_k, stride_n) of B0, then of B1
    two_b: bool
    align: int  # table_align of the tables
    mode: int  # weight_tma_mode: 0 pointers, 1 / 2 descriptors
    descs: tuple  # host tensor descriptors of B0, B1 when ``host``, else placeholders
    host: bool
    sm90: "down_sm90.Sm90Weights | None"  # the Gluon kernel's view of B0, B1 when it may take the launches
    # B0, B1 interleaved (tables.interleaved_gate_up): one [2k, n] matrix of unit row stride through B0's table
    interleaved: bool = False


def down_operand(b0: WeightTable, b1: WeightTable | None, k_is_rows: bool, k_dim: int, x: Tensor) -> DownOperand:
    """Resolve the down kernel's B operand (see :class:`DownOperand`) for inputs like ``x``."""
    if b1 is not None and k_is_rows and interleaved_gate_up(b0, b1):
        # dX through gpt-oss's gate_up_proj: one contraction over 2k (k contiguous: descriptor mode 2 or pointers)
        align = table_align(b0)
        mode = weight_tma_mode([(1, b0.stride_c)], align, x.element_size(), x.device) if k_dim > 0 else 0
        mode = mode if mode == 2 else 0
        return DownOperand((b0.ptrs, b0.ptrs), (1, b0.stride_c, 1, b0.stride_c), False, align, mode,
                           (b0.ptrs, b0.ptrs), False, None, True)
    tables = [b0, b1] if b1 is not None else [b0, b0]
    kn = [(t.stride_r, t.stride_c) if k_is_rows else (t.stride_c, t.stride_r) for t in tables]
    align = table_align(b0, b1)
    mode = weight_tma_mode(kn[:1] if b1 is None else kn, align, x.element_size(), x.device) if k_dim > 0 else 0
    # the [E, k, n] / [E, n, k] views a descriptor of every expert's B is built over (None: no such view)
    views = [desc_view(t, k_is_rows, mode) for t in ([b0] if b1 is None else [b0, b1])] if mode else [None]
    whole = all(v is not None for v in views)
    host = whole  # one descriptor over every expert's B, built here (see host_weight_desc)
    descs = tuple(host_weight_desc(v, mode) for v in views) if host else (b0.ptrs,)
    sm90 = down_sm90.weights(views[0], views[1] if b1 is not None else None, mode == 2, k_dim) \
        if whole and x.is_cuda else None
    return DownOperand((tables[0].ptrs, tables[1].ptrs), (*kn[0], *kn[1]), b1 is not None, align, mode,
                       (descs[0], descs[-1]), host, sm90)


def down_project(a: Tensor, k_dim: int, b: DownOperand, n_dim: int, plan: DispatchPlan, out: Tensor,
                 bias: Tensor | None, window: SlotWindow) -> Tensor:
    """out[slot] = a[slot, :k_dim] @ B0[e] (+ a[slot, k_dim:2k_dim] @ B1[e]) (+ bias[e]) for every routed slot
    of ``window``, ``a`` and ``out`` holding the window's rows from its first slot; ``b`` from
    :func:`down_operand`."""
    num_tiles = window.num_tiles
    if num_tiles == 0 or out.numel() == 0:
        return out
    if b.sm90 is not None and down_sm90.usable(a, out, plan_block_m()):
        return down_sm90.down_sm90(a, b.sm90, k_dim, n_dim, plan, out, bias, window)

    def grid(meta):
        return (num_tiles * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    autotune.launch(
        _expert_down_kernel, _expert_down_tuned, "down", grid,
        a, *b.ptrs, *b.descs, bias if bias is not None else a, out, plan.offsets,
        plan.tile_expert, plan.tile_start, window.tile0, num_tiles, plan.tile_expert.numel(), window.slot0,
        window.slot1, n_dim, k_dim, a.stride(0), a.stride(1), *b.strides, out.stride(0), out.stride(1),
        TWO_B=b.two_b, HAS_BIAS=bias is not None, B_ALIGN=b.align, B_TMA=b.mode, B_HOST=b.host,
        DOT_PRECISION=dot_precision(a.dtype), BLOCK_M=plan_block_m(), INTERLEAVED=b.interleaved,
    )
    return out


def host_weight_desc(view: Tensor, mode: int):
    """A tensor descriptor over every expert's B[e][k, n], given as the table's ``view`` from :func:`.triton.common.desc_view`
    for ``mode`` (:func:`weight_tma_mode`, which has proven the unit stride, the other stride's and the base's
    alignment): over [E, k, n] (1, n contiguous) or [E, n, k] (2). Its block follows the launch's configuration.

    The down kernel reads a table of one [E, r, c] tensor through this one host-built descriptor, a table of
    separate tensors through one built by every program. H100, layer step, device time of the down launches (Y and
    dX) host / per-program descriptors: C 2.28 / 2.38 ms, D 2.68 / 2.82, A 17.18 / 17.49 (docs/down.md). The up
    kernel keeps its per-program descriptors: through the host's it was 5 % slower at C (3 % faster at D)."""
    if mode == 1:
        return autotune.fitted_descriptor(view, lambda meta: [1, meta["BLOCK_K"], meta["BLOCK_N"]])
    return autotune.fitted_descriptor(view, lambda meta: [1, meta["BLOCK_N"], meta["BLOCK_K"]])


def combine(y_slots: Tensor, weights: Tensor | None, plan: DispatchPlan, T: int, K: int, out: Tensor,
            window: tuple[int, int], accumulate: bool) -> Tensor:
    """out[t] (+)= sum_k w[t, k] * y_slots[slot_of[t*K + k] - slot0] over the pairs whose slot lies in
    ``window`` = (slot0, slot1) (w = 1 when weights is None), fp32 accumulation. ``accumulate``: add onto
    ``out`` (one rounding to out's dtype per call).

    A window of at least T slots (the one window of every slot among them) runs token-major over all T tokens
    (:func:`combine_tokens`): it may reach every token. A smaller window runs over its own slots
    (:func:`_expert_combine_window_kernel`, bitwise the same sums) and touches only its tokens' rows, out zeroed
    first unless ``accumulate``: a token-major pass per window would read and write all of out once per window,
    T * d * windows in all (at 2M tokens of the issue's scale shape, 49 windows: a fifth of the step). Where a window
    reaches most tokens anyway, the token-major pass's coalesced rows cost a little less (config C of
    docs/benchmarks.md with 128 MiB of transients: 1.21 against 1.28 ms of combines a step;
    docs/combine-and-windows.md)."""
    slot0, slot1 = window
    if slot1 - slot0 >= T:
        return combine_tokens(y_slots, weights, plan.slot_of, T, K, out, window, accumulate)
    d = out.shape[1]
    if not accumulate:
        out.zero_()
    if T == 0 or d == 0 or slot1 <= slot0:
        return out
    block_d, w, strides = _combine_args(y_slots, weights, out)
    block_s = 16
    grid = (triton.cdiv(slot1 - slot0, block_s), triton.cdiv(d, block_d))
    launch(
        _expert_combine_window_kernel, grid,
        y_slots, w, plan.token_index, plan.slot_of, out, d, K, slot0, slot1, *strides,
        HAS_WEIGHTS=weights is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
    )
    return out


def combine_tokens(y_slots: Tensor, weights: Tensor | None, slot_of: Tensor, T: int, K: int, out: Tensor,
                   window: tuple[int, int], accumulate: bool) -> Tensor:
    """:func:`combine` as one token-major pass over all T tokens (:func:`_expert_combine_kernel`), whatever the
    window: every row of out is written."""
    slot0, slot1 = window
    d = out.shape[1]
    if T == 0 or d == 0:
        return out
    block_d, w, strides = _combine_args(y_slots, weights, out)
    block_t = 16
    grid = (triton.cdiv(T, block_t), triton.cdiv(d, block_d))
    launch(
        _expert_combine_kernel, grid,
        y_slots, w, slot_of, out, T, d, K, slot0, slot1, *strides,
        HAS_WEIGHTS=weights is not None, ACCUMULATE=accumulate, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
    return out


def _combine_args(y_slots: Tensor, weights: Tensor | None, out: Tensor) -> tuple[int, Tensor, tuple]:
    """The combine kernels' column block, weights pointer (a placeholder, never read, when None) and strides."""
    block_d = min(64 if autotune.interpreting() else 256, triton.next_power_of_2(out.shape[1]))
    sw = (weights.stride(0), weights.stride(1)) if weights is not None else (0, 0)
    w = weights if weights is not None else y_slots
    return block_d, w, (y_slots.stride(0), y_slots.stride(1), *sw, out.stride(0), out.stride(1))


def expert_forward(x: Tensor, weights: Tensor, w: ExpertTables, plan: DispatchPlan,
                   activation: "Activation | str", save_preact: bool,
                   gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                   *, out: Tensor | None = None, preact_out: Tensor | None = None,
                   window_slots: int = 0) -> tuple[Tensor, Tensor]:
    """y [T, d] (x.dtype) and preact in slot order (x.dtype): ``[T*K, 2h]`` (gate|up) for a gated activation,
    ``[T*K, h]`` for a plain one, biases included; ``[0]`` unless save_preact.

    ``w`` holds the weight tables (``w.up`` None exactly for a plain activation); biases are optional
    contiguous ``[E, h]``, ``[E, h]``, ``[E, d]`` tensors of x's dtype. ``plan`` must come from
    ``dispatch(ids, E, block_m=plan_block_m())`` (or ``dispatch_reference``). ``out`` / ``preact_out``:
    storage to write y / preact into (any strides). ``window_slots`` > 0 runs the slots in windows of at
    most that many (:func:`slot_windows`), bounding the transients H and Y to that many rows; y then
    accumulates across windows in its own dtype (a token whose slots fall in several windows is rounded
    once per window)."""
    T, d, K, E, h, act = check_expert_inputs(x, weights, w, plan, activation, gate_bias, up_bias, down_bias)
    N = T * K
    width = 2 * h if act.gated else h
    for name, given, shape in (("out", out, (T, d)), ("preact_out", preact_out, (N, width))):
        if given is not None and (tuple(given.shape) != shape or given.dtype != x.dtype or given.device != x.device):
            raise ValueError(f"{name} must be {shape} of {x.dtype} on {x.device}, got {tuple(given.shape)} of "
                             f"{given.dtype} on {given.device}")
    preact = (preact_out if preact_out is not None else x.new_empty((N, width))) if save_preact else x.new_empty((0,))
    out = out if out is not None else x.new_empty((T, d))
    if N == 0 or d == 0:
        return out.zero_(), preact
    if h == 0 and down_bias is None:  # every expert maps to zero
        return out.zero_(), preact
    up = w.up if w.up is not None else w.gate  # placeholder table when not gated, never read
    align, w_tma = _up_weight_mode(w, x)
    up_sm90 = _up_sm90_weights(w, d, w_tma, x)
    biased = gate_bias is not None or up_bias is not None
    w_down = down_operand(w.down, None, False, h, x)  # Y = H @ W_down[e].T: B[e][k, n] = W_down[e][n, k]
    for i, win in enumerate(slot_windows(plan, window_slots)):
        n = win.slot1 - win.slot0
        hid = x.new_empty((n, h))  # transient: the window's H
        if h > 0:
            pre = preact[win.slot0:] if save_preact else hid  # placeholder pointer when not saving, never written
            if up_sm90 is not None and gather_sm90.up_usable(x, hid, pre if save_preact else None, act.name, biased,
                                                             plan_block_m()):
                gather_sm90.up_sm90(x, up_sm90, plan, K, d, h, win, hid, pre if save_preact else None, act)
            else:
                _up_triton(x, w, up, gate_bias, up_bias, hid, pre, plan, win, d, h, K, act, save_preact, align, w_tma)
            del pre  # may alias hid: it must not outlive the window
        y_slots = x.new_empty((n, d))  # transient: the window's Y
        # Y = H @ W_down[e].T (+ b_down[e])
        down_project(hid, h, w_down, d, plan, y_slots, down_bias, win)
        del hid
        combine(y_slots, weights, plan, T, K, out, (win.slot0, win.slot1), accumulate=i > 0)
        del y_slots
    return out, preact


def _up_weight_mode(w: ExpertTables, x: Tensor) -> tuple[int, int]:
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


def _up_sm90_weights(w: ExpertTables, d: int, mode: int, x: Tensor) -> "gather_sm90.GatherWeights | None":
    """The Gluon up kernel's view of W_gate and W_up (B[e][k, n] = W[e][n, k]), or None where it cannot take
    them (see :func:`.gather_sm90.up_weights`)."""
    if not (x.is_cuda and mode and w.up is not None) or interleaved_gate_up(w.gate, w.up):
        return None  # (the Gluon kernel reads two [h, d] matrices, not one interleaved [2h, d])
    return gather_sm90.up_weights(desc_view(w.gate, False, mode), desc_view(w.up, False, mode), mode == 2, d)


def _up_triton(x: Tensor, w: ExpertTables, up: WeightTable, gate_bias: Tensor | None, up_bias: Tensor | None,
               hid: Tensor, pre: Tensor, plan: DispatchPlan, win: SlotWindow, d: int, h: int, K: int,
               act: Activation, save_preact: bool, align: int, w_tma: int) -> None:
    """One window's up projection through ``_expert_up_kernel``."""
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
        INTERLEAVED=interleaved_gate_up(w.gate, w.up),
    )
