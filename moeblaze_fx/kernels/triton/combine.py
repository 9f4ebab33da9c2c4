"""The deterministic combine: out[t] (+)= sum_k w[t, k] * y[slot_of[t*K + k]] over the pairs whose slot lies in
a slot window, fp32 accumulation in a fixed k order, unrouted pairs (slot -1) skipped. The forward combines Y into
y, the backward the per-slot dX into dx. Nothing is reduced with atomics: two runs are bitwise identical.

The routing weights' gradient goes back to pair order the same way (:func:`routing_weight_grad`): the backward's
kernels leave its partial sums by slot, and dweights[p] is the sum of those at slot_of[p].
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..launch import launch, sized
from ..reference import DispatchPlan

__all__ = ["combine", "combine_tokens", "routing_weight_grad"]


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


@sized(triton.jit)
def _routing_weight_grad_kernel(
    part_ptr,  # [>= rows, N] fp32: the partial sums by slot, unit column stride
    token_index_ptr,  # [N] int32: the pair of each slot
    slot_of_ptr,  # [N] int32: the slot of each pair, -1 when unrouted
    offsets_ptr,  # [E + 1] int32: offsets[E] = the routed slots
    out_ptr,  # [N] pairs (t*K + k), the weights' dtype
    N, E, rows, stride_part,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """grid (cdiv(N, BLOCK),). Program i sums slots [i*BLOCK, (i+1)*BLOCK)'s partials over r < rows, in r order
    (fp32; ROWS rows' loads issued together, each a coalesced row segment), and stores each routed slot's sum at its
    pair; it also writes 0 at the unrouted pairs among pairs [i*BLOCK, (i+1)*BLOCK). Every pair is written once:
    token_index is a permutation whose first offsets[E] slots hold the routed pairs."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < N
    routed = i < tl.load(offsets_ptr + E)  # (implies live)
    acc = tl.zeros([BLOCK], tl.float32)
    ptrs = part_ptr + i
    rows_b = tl.full([BLOCK], rows, tl.int32)  # (a mask of a scalar comparison: Triton's interpreter refuses it)
    for r0 in range(0, rows, ROWS):
        for j in tl.static_range(ROWS):  # a row past ``rows`` adds 0.0: acc (never -0.0) is left as it is
            acc += tl.load(ptrs + j * stride_part, mask=routed & (r0 + j < rows_b), other=0.0)
        ptrs += ROWS * stride_part  # (a pointer: rows x N may pass 2^31)
    pair = tl.load(token_index_ptr + i, mask=routed, other=0)
    tl.store(out_ptr + pair, acc.to(out_ptr.dtype.element_ty), mask=routed)
    slot = tl.load(slot_of_ptr + i, mask=live, other=0)
    tl.store(out_ptr + i, tl.zeros([BLOCK], out_ptr.dtype.element_ty), mask=live & (slot < 0))


def routing_weight_grad(part: Tensor, rows: int, plan: DispatchPlan, T: int, K: int, dtype) -> Tensor:
    """dweights ``[T, K]`` of ``dtype``: ``dweights[t, k] = sum_{r < rows} part[r, plan.slot_of[t*K + k]]`` (fp32,
    rows in order), 0 where the pair is unrouted (slot -1). ``part``: the backward's fp32 partial sums by slot, rows
    of unit column stride. One launch over the slots, reading ``part`` in slot order and 32 rows at once: gathered by
    pair, one row after the other, its 32 programs at Mixtral's (4096, 4096, 14336, 8, 2) waited 224 times in turn
    for scattered loads (0.13 ms a launch in the model's step, H200, 2026-12-03; 15 us now, 2026-12-04)."""
    out = part.new_empty((T, K), dtype=dtype)
    N = T * K
    if N == 0:
        return out
    if rows == 0:
        return out.zero_()
    block = 64
    launch(_routing_weight_grad_kernel, (triton.cdiv(N, block),), part, plan.token_index, plan.slot_of,
           plan.offsets, out, N, plan.offsets.numel() - 1, rows, part.stride(0), BLOCK=block, ROWS=32, num_warps=2)
    return out
