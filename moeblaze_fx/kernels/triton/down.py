"""The down kernel: per row tile of one expert of a slot window, C[rows] = A[rows, :k] @ B0[e]
(+ A[rows, k:2k] @ B1[e]) (+ bias[e]). The forward's Y = H @ W_down[e].T (+ b_down[e]) and the backward's
dX = dA @ W_gate[e] + dB @ W_up[e] (two K loops into one accumulator) are this kernel.

B is resolved once per call (:func:`down_operand`, a :class:`DownOperand`): its tables and strides, their proven
alignment and descriptor mode (:func:`.common.weight_tma_mode`), and, where one tensor holds every expert's B, one
host-built descriptor over all of them (:func:`host_weight_desc`). With interleaved gate and up weights (gpt-oss),
dA|dB are interleaved alike and dX is one B of 2h rows (:func:`..tables.interleaved_table`), one K loop over 2h.

On sm_90 the per-call plan (:class:`..plan.DownUnit`) hands a window to the Gluon kernel of :mod:`..sm90.down`
instead (bitwise equal results) when the weights are row blocks of one tensor and the window's rows are 16-byte
aligned; it reads the weights through the views :func:`down_operand` found (``DownOperand.views``).
"""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..autotune import plan_block_m
from ..launch import sized
from ..reference import DispatchPlan
from ..tables import WeightTable
from .common import (
    SlotWindow,
    desc_view,
    dot_precision,
    grouped_tile_ids,
    table_align,
    table_ptr,
    w_desc,
    w_tile,
    weight_tma_mode,
    window_tile,
)

__all__ = ["DownOperand", "down_operand", "down_project", "host_weight_desc"]


@triton.jit
def _w_tile_of(desc, e, k0, n0, MODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B[e] at (k0, n0) through a host descriptor from :func:`host_weight_desc`
    (over [E, k, n] for MODE 1, [E, n, k] for MODE 2)."""
    if MODE == 1:
        return desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        return desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T


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
):
    """grid = (num_tiles * cdiv(n_dim, BLOCK_N),): for one row tile of expert e in the slot window
    [slot0, slot1), C[rows] = A[rows, :k_dim] @ B0[e] (+ A[rows, k_dim:2*k_dim] @ B1[e] when TWO_B) (+ bias[e]);
    rows index the window's buffers from slot0."""
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


_expert_down_tuned = autotune.tuned(_expert_down_kernel, "down",
                                    key=["n_dim", "k_dim", "TWO_B", "B_TMA"])


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
    views: tuple  # with ``host``: the [E, k, n] / [E, n, k] views of B0 (and B1) the descriptors are built over


def down_operand(b0: WeightTable, b1: WeightTable | None, k_is_rows: bool, k_dim: int, x: Tensor) -> DownOperand:
    """Resolve the down kernel's B operand (see :class:`DownOperand`) for inputs like ``x``."""
    tables = [b0, b1] if b1 is not None else [b0, b0]
    kn = [(t.stride_r, t.stride_c) if k_is_rows else (t.stride_c, t.stride_r) for t in tables]
    align = table_align(b0, b1)
    mode = weight_tma_mode(kn[:1] if b1 is None else kn, align, x.element_size(), x.device) if k_dim > 0 else 0
    # the [E, k, n] / [E, n, k] views a descriptor of every expert's B is built over (None: no such view)
    views = [desc_view(t, k_is_rows, mode) for t in ([b0] if b1 is None else [b0, b1])] if mode else [None]
    whole = all(v is not None for v in views)
    host = whole  # one descriptor over every expert's B, built here (see host_weight_desc)
    descs = tuple(host_weight_desc(v, mode) for v in views) if host else (b0.ptrs,)
    return DownOperand((tables[0].ptrs, tables[1].ptrs), (*kn[0], *kn[1]), b1 is not None, align, mode,
                       (descs[0], descs[-1]), host, tuple(views) if host else ())


def down_project(a: Tensor, k_dim: int, b: DownOperand, n_dim: int, plan: DispatchPlan, out: Tensor,
                 bias: Tensor | None, window: SlotWindow) -> Tensor:
    """out[slot] = a[slot, :k_dim] @ B0[e] (+ a[slot, k_dim:2k_dim] @ B1[e]) (+ bias[e]) for every routed slot
    of ``window``, ``a`` and ``out`` holding the window's rows from its first slot; ``b`` from
    :func:`down_operand`."""
    num_tiles = window.num_tiles
    if num_tiles == 0 or out.numel() == 0:
        return out

    def grid(meta):
        return (num_tiles * triton.cdiv(n_dim, meta["BLOCK_N"]),)

    autotune.launch(
        _expert_down_kernel, _expert_down_tuned, "down", grid,
        a, *b.ptrs, *b.descs, bias if bias is not None else a, out, plan.offsets,
        plan.tile_expert, plan.tile_start, window.tile0, num_tiles, plan.tile_expert.numel(), window.slot0,
        window.slot1, n_dim, k_dim, a.stride(0), a.stride(1), *b.strides, out.stride(0), out.stride(1),
        TWO_B=b.two_b, HAS_BIAS=bias is not None, B_ALIGN=b.align, B_TMA=b.mode, B_HOST=b.host,
        DOT_PRECISION=dot_precision(a.dtype), BLOCK_M=plan_block_m(),
    )
    return out


def host_weight_desc(view: Tensor, mode: int):
    """A tensor descriptor over every expert's B[e][k, n], given as the table's ``view`` from :func:`.common.desc_view`
    for ``mode`` (:func:`weight_tma_mode`, which has proven the unit stride, the other stride's and the base's
    alignment): over [E, k, n] (1, n contiguous) or [E, n, k] (2). Its block follows the launch's configuration.

    The down kernel reads a table of one [E, r, c] tensor through this one host-built descriptor, a table of
    separate tensors through one built by every program. H100, layer step, device time of the down launches (Y and
    dX) host / per-program descriptors: C 2.28 / 2.38 ms, D 2.68 / 2.82, A 17.18 / 17.49 (docs/down.md). The up
    kernel keeps its per-program descriptors: through the host's it was 5 % slower at C (3 % faster at D)."""
    if mode == 1:
        return autotune.fitted_descriptor(view, lambda meta: [1, meta["BLOCK_K"], meta["BLOCK_N"]])
    return autotune.fitted_descriptor(view, lambda meta: [1, meta["BLOCK_N"], meta["BLOCK_K"]])
