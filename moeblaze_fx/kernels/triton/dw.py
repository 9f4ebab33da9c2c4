"""The weight and bias gradients: per expert, sums over its slots in a slot window, the gathered operand's rows read
through token_index (no gathered copy is built).

    _expert_dw_kernel        dW[e] (+)= sum_{s in e} a[tok_s].T b[s]: dW_down from dy and w*H; dW_gate, dW_up (as their
                             transposes) from x and dA, dB; one launch for both where up's rows follow gate's in one
                             [E, 2h, d] tensor (:func:`gate_up_table`), or the interleaved [d, 2h] gradient of
                             gpt-oss's gate_up_proj from dA|dB interleaved alike (:func:`interleaved_grad_table`)
    _expert_bias_grad_kernel per expert and column block: sum_{s in e} (w_s) src[row_s]; for the down bias also
                             <dy[tok_s], b_down[e]> partials by slot (the routing-weight gradient)

The window's contributions start the experts whose slots start in it and add onto those that started earlier
(``window`` = (slot0, slot1, own_end), see the kernel). Each output element is written by exactly one program per
window with a fixed reduction order: no atomics. On sm_90 the per-call plan (:meth:`..plan.BackwardPlan.dw_on_sm90`)
hands 16-bit dW launches to the Gluon kernel of :mod:`..sm90.dw` instead when the shapes allow (bitwise the same
results).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..launch import launch, sized
from ..reference import DispatchPlan
from ..tables import WeightTable, interleaved_gate_up, interleaved_table, table_of
from .common import dot_precision, grouped_tile_ids, table_align, table_ptr, tma_available

__all__ = ["dw_tma", "transposed", "gate_up_table", "interleaved_grad_table", "weight_grad", "bias_grad",
           "bias_grad_block_n"]


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
    best tile of that form ran 6-11 % slower (H100, raw launches; docs/dw.md)."""
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
    if EVEN_N:
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
        tl.static_assert((b_desc.block_shape[0] == BLOCK_K) & (b_desc.block_shape[1] == BLOCK_N))
    for i in range(0, n_full):
        tok = _token_rows(token_index_ptr, s, seg_hi, K, IDX)
        a = tl.load(a_ptr + tok[None, :] * stride_a_r + offs_m_ld[:, None] * stride_a_m)  # [BLOCK_M, BLOCK_K]
        if TMA:
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
    part_ptr,  # [cdiv(n_dim, BLOCK_N), N] fp32, out when DOT: by slot, one row per column block
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


_expert_dw_tuned = autotune.tuned(_expert_dw_kernel, "dw", key=["m_dim", "n_dim", "TMA"])
# Keys (m_dim, n_dim, descriptor or not, operand dtypes, out dtype) whose autotuning has been done by a
# non-accumulating launch: see weight_grad.
_DW_TUNED_KEYS: set[tuple] = set()


def dw_tma(slots: Tensor) -> bool:
    """Whether the dW kernel reads the slot-ordered operand (dA, dB or w*H) through a tensor descriptor
    (TMA on the GPU) rather than through pointers: where a descriptor can describe it (unit column stride,
    16-byte aligned base and row stride) and the device has TMA (sm_90+; the Triton interpreter runs
    descriptors too). H100, 2026-11-21 (docs/dw.md): dW_down at config A 10.03 -> 8.61 ms
    with 128x256x64 tiles and 4 stages."""
    item = slots.element_size()
    if slots.numel() == 0 or slots.stride(1) != 1 or (slots.stride(0) * item) % 16 or slots.data_ptr() % 16:
        return False  # (a descriptor's shape must be positive)
    return tma_available(slots.device)


def transposed(t: WeightTable) -> WeightTable:
    """The same E matrices read as their transposes."""
    return t._replace(rows=t.cols, cols=t.rows, stride_r=t.stride_c, stride_c=t.stride_r,
                      dense=None if t.dense is None else t.dense.transpose(1, 2))


def gate_up_table(gate: WeightTable, up: WeightTable | None) -> WeightTable | None:
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


def interleaved_grad_table(gate: WeightTable, up: WeightTable | None) -> WeightTable | None:
    """Where gate's and up's gradients are interleaved column by column (:func:`.tables.interleaved_gate_up`):
    one table of their [cols, 2h] matrices (gpt-oss's gate_up_proj [E, d, 2h] per expert), unit column stride,
    through gate's addresses: with dA|dB interleaved the same way, dW_gate and dW_up are one plain dW launch over
    its 2h columns. None otherwise."""
    return transposed(interleaved_table(gate, up)) if interleaved_gate_up(gate, up) else None


def weight_grad(tokens: Tensor, slots: Tensor, out: WeightTable, plan: DispatchPlan, K: int,
                accumulate: bool, window: tuple[int, int, int]) -> None:
    """dW[e] (+)= sum over e's slots s in the window of tokens[token(s)].T @ slots[s - slot0], written through
    the table ``out`` ([tokens' columns, slots' columns]). ``window`` = (slot0, slot1, own_end): see the kernel."""
    E, m_dim, n_dim = out.ptrs.numel(), out.rows, out.cols
    if E == 0 or m_dim == 0 or n_dim == 0:
        return
    out_fp32 = out.dtype == torch.float32 and tokens.dtype != torch.float32

    def grid(meta):
        return (E * triton.cdiv(m_dim, meta["BLOCK_M"]) * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    tma = dw_tma(slots)
    b_desc = autotune.fitted_descriptor(slots, lambda meta: [meta["BLOCK_K"], meta["BLOCK_N"]]) if tma else slots

    def go(table: WeightTable, acc: bool) -> None:
        autotune.launch(
            _expert_dw_kernel, _expert_dw_tuned, "dw", grid,
            tokens, slots, b_desc, table.ptrs, plan.token_index, plan.offsets, m_dim, n_dim, K, *window,
            tokens.stride(0), tokens.stride(1), slots.stride(0), slots.stride(1), table.stride_r, table.stride_c,
            OUT_FP32=out_fp32, ACCUMULATE=acc, MAY_ADD=acc or window[0] > 0,
            TMA=tma, O_ALIGN=table_align(table), DOT_PRECISION=dot_precision(tokens.dtype),
        )

    # At least as fine as the autotuner's key (m_dim, n_dim, TMA and the operand dtypes): a key coarser than the
    # tuner's would let an adding launch be the first of a new tuner key, and be timed.
    key = (m_dim, n_dim, tma, tokens.dtype, slots.dtype, out.dtype)
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


def bias_grad(src: Tensor, gather: bool, weights: Tensor | None, plan: DispatchPlan, K: int, E: int,
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
    block_n = bias_grad_block_n(n_dim)
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


def bias_grad_block_n(n_dim: int) -> int:
    return min(32 if autotune.interpreting() else 128, triton.next_power_of_2(max(n_dim, 1)))
