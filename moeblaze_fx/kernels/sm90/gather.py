"""The gathering GEMMs for sm_90 (Hopper) in Gluon: the up projection and dh's GEMM, persistent and
warp-specialized, the structure of :mod:`.down` with a producer that gathers token rows.

Both multiply rows gathered through the token index by one expert's weights, tile by tile over a slot window's row
tiles (the plan's 128-slot tiles):

* the forward up projection (``triton.up._expert_up_kernel``, a gated activation of :data:`ACTIVATIONS`: SwiGLU,
  its clamped and soft-capped forms and the GeGLUs, no biases): ``A|B = x[tok(s)] @ W_{gate|up}[e].T``, rounded
  to x's dtype; the epilogue stores A|B (when the policy keeps them) and H (``silu(A) * B`` for SwiGLU) computed
  from the rounded values;
* the GEMM of the backward's dh (``triton.dh._expert_dh_kernel`` with PHASE 1): ``dH' = dy[tok(s)] @ W_down[e]``,
  rounded to x's dtype and stored;
* the same GEMM with the activation's backward of ``_expert_dh_kernel``'s PHASE 2 fused (``_dh_act_sm90_kernel``,
  where A|B are kept and h % 16 == 0): the rounded dH' stays in shared memory, and the next tile's K loop computes
  dA|dB, w*H and the routing-weight partials from it block by block (32 rows x 64 columns, one block per n_k / 16
  steps) after each step's MMA wait, so the tensor cores keep working; the last tile's blocks run after the loop.
  Each block's A|B is copied into shared memory with cp.async a block ahead (the launch has one gathered-row stage
  less for it). dH' never goes to memory. H100, fused / two launches, ms (docs/dh.md): C 0.91
  / 1.09, D 1.15 / 1.42, A 9.3 / 11.1. With A|B and dA|dB interleaved column by column (PAIRS, gpt-oss's layout) a
  block's 128 interleaved columns are staged as two halves of 32 pairs; each half's pairs and dH' columns are split
  in registers (layouts that keep a pair, and dH's two halves, in one thread: no data moves) and dA|dB is joined
  back into pairs: at gpt-oss's shape 0.69 ms against 0.56 + 0.32 for the two launches (H100, 2026-11-28).

Each output element sums the same products in the same order as the Triton kernels (one fp32 accumulator, 64-wide
contraction steps, the activation functions of :mod:`.act` themselves), so the results are bitwise equal; the cuda
tests compare them. One exception: the fused dh sums each row's 64 products of <dH', H> in its own layout's order
(PAIRS: over each half of 32, then the two halves), which can round differently from the Triton epilogue's where
h % 64 != 0 (that kernel then loads through wrapped columns, and Triton lays its tile out otherwise) and with PAIRS.

One program per SM walks the output tiles in the Triton kernels' grouped order (``common.tile``):

* one producer warpgroup fills two rings of shared buffers: ``A_STAGES`` of the tile's 128 token rows, 64 columns a
  step, gathered with cp.async (the token indices loaded once a tile; rows outside the tile's own read a row it owns),
  and ``B_STAGES`` of the weight tiles through TMA over 2-D descriptors of the tables' storage
  (``down.weights``' views). A step's rows are issued as soon as their stage is free, before the producer waits
  for the weights' stage, so the gather runs one step further ahead than the TMA copies. Each producer thread
  arrives on the A stage's barrier when its copies land, the TMA copies complete the B stage's;
* the default partition (8 warps, two warpgroups of 64 rows) multiplies into one 128 x 256 fp32 accumulator: for
  the up projection 128 columns of A beside the same 128 columns of B (the producer copies W_gate's and W_up's tiles
  side by side into one shared buffer, so one pass over x computes both), for dh 256 columns of dH'. The tile goes
  to shared memory rounded; a full tile leaves through asynchronous TMA stores, a ragged one (an expert's last rows,
  a tile cut by the window, columns past h) through masked pointer stores. The up projection's H is computed from
  the rounded A|B read back from shared memory during the next tile's K loop, in blocks of 32 x 64 after a step's
  MMA wait as the fused dh's epilogue, and stored through pointers (computed right after the tile's own K loop
  instead, H was slower: docs/up.md).

:func:`up_usable`, :func:`dh_usable` and :func:`dh_act_usable` say when a launch qualifies; everything else takes
the Triton kernels (dh where the fused kernel does not apply: its GEMM here, its epilogue as a Triton launch).
Gluon has no interpreter, so the CPU tests cannot run these kernels. The kernel option ``gluon=False``
(``config.KernelOptions``) turns them off (``common.enabled``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import act as act_math
from ..launch import launch, sized
from ..program import Counter, bump
from ..reference import GATED_ACTIVATIONS
from . import common
from .common import GLUON

if GLUON:  # the Gluon names as common imported them, and cp.async
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from .common import (
        GluonDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["GatherWeights", "up_weights", "dh_weights", "up_usable", "dh_usable", "up_sm90", "dh_sm90", "launches",
           "act_launches", "dh_act_usable", "dh_act_sm90"]

BLOCK_M, BLOCK_K = 128, 64  # BLOCK_M is the plan's row tile
UP_BLOCK_N = 128  # columns of h a tile covers: A's and B's side by side, one 128 x 256 product
DH_BLOCK_N = 256
# x's 16 KB and the weights' 32 KB stages: with the 64 KB output tile, 224 KB of shared memory. The fourth x stage
# made up and dh's GEMM 2-4 % faster at C and D, and no faster at A (H100; docs/up.md).
A_STAGES, B_STAGES = 4, 3  # (the fused dh: 3 and 3, its A|B blocks in the fourth A stage's 16 KB)
GROUP_M = 8  # row tiles sharing weight columns, as the Triton kernels
_PRODUCER_REGS = 96
_LAUNCHES = Counter()
_ACT_LAUNCHES = Counter()
# The activations the up kernel's and the fused dh's epilogues take: every gated one (the plain ones, without an up
# projection, take the Triton kernels). The epilogues call the Triton kernels' own functions (``act.act_forward``,
# ``act.act_backward``) with their ACT code.
ACTIVATIONS = frozenset(GATED_ACTIVATIONS)


if GLUON:
    BM: gl.constexpr = gl.constexpr(BLOCK_M)
    BK: gl.constexpr = gl.constexpr(BLOCK_K)

    @gluon.jit
    def _load_b(desc, e_rows, e, n0, k, bar, buf, B_KMAJOR: gl.constexpr):
        if B_KMAJOR:  # rows are n: expert e's n0.. at rows e * e_rows + n0 ..
            tma.async_copy_global_to_shared(desc, [e * e_rows + n0, k * BK], bar, buf)
        else:  # rows are k
            tma.async_copy_global_to_shared(desc, [e * e_rows + k * BK, n0], bar, buf)

    @gluon.jit
    def _producer(a_ptr, b0_desc, b1_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty_a, empty_b,
                  tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1,
                  k_dim, K: gl.constexpr, stride_a, e_rows0, e_rows1, BNH: gl.constexpr, SWIGLU: gl.constexpr,
                  B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, SA: gl.constexpr, SB: gl.constexpr):
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [BM, BK]: 16 bytes a thread
        rs = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        cs = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
        if SWIGLU:
            nbytes: gl.constexpr = 2 * b0_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = b0_desc.block_type.nbytes
        if B_KMAJOR:
            n_axis: gl.constexpr = 0
        else:
            n_axis: gl.constexpr = 1
        tile0 = gl.load(tile0_ptr)
        n_k = k_dim // BK  # k_dim % BK == 0 (usable)
        g = 0  # steps issued so far, over all of this program's tiles
        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            e, start, first, end, pid_n = common.tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr,
                                                      tile_start_ptr, offsets_ptr, slot0, slot1, GROUP_M)
            if e >= 0:
                # rows outside [first, end) re-read one the tile owns: no masks, the stores drop them
                tok = gl.load(token_index_ptr + gl.minimum(gl.maximum(start + rs, first), end - 1)) // K
                rows = a_ptr + tok.to(gl.int64)[:, None] * stride_a + cs[None, :]
                n0 = pid_n * BNH
                for k in range(n_k):
                    sa = g % SA
                    mbarrier.wait(empty_a.index(sa), ((g // SA) & 1) ^ 1)  # the MMA that read the stage is done
                    cp.async_copy_global_to_shared(a_bufs.index(sa), rows + k * BK)
                    cp.mbarrier_arrive(ready_a.index(sa), increment_count=False)
                    sb = g % SB
                    mbarrier.wait(empty_b.index(sb), ((g // SB) & 1) ^ 1)
                    mbarrier.expect(ready_b.index(sb), nbytes)
                    if SWIGLU:  # gate's BNH columns, then up's: one 2 BNH-wide product
                        _load_b(b0_desc, e_rows0, e, n0, k, ready_b.index(sb),
                                b_bufs.index(sb).slice(0, BNH, dim=n_axis), B_KMAJOR)
                        _load_b(b1_desc, e_rows1, e, n0, k, ready_b.index(sb),
                                b_bufs.index(sb).slice(BNH, BNH, dim=n_axis), B_KMAJOR)
                    else:
                        _load_b(b0_desc, e_rows0, e, n0, k, ready_b.index(sb), b_bufs.index(sb), B_KMAJOR)
                    g += 1

    @gluon.constexpr_function
    def _st_layout(W):
        """Registers of a [BM, W] tile for 16-byte accesses along its rows, a warp's columns spanning W."""
        W = int(W)
        return gl.BlockedLayout([1, 8], [256 // W, W // 8], [8, 1], [1, 0])

    @gluon.jit
    def _store(buf, c_desc, c_ptr, row, col, start, first, end, slot0, n_lim, stride_c, full):
        """Store the tile in shared memory ``buf`` at (row, col) of the window's buffer: through TMA when ``full``,
        else its rows [first, end) and columns below ``n_lim`` through pointers."""
        if full:
            tma.async_copy_shared_to_global(c_desc, [row, col], buf)
        else:
            W: gl.constexpr = buf.shape[1]
            st: gl.constexpr = _st_layout(W)
            v = buf.load(st)
            # offsets built from the tile's indices here: hoisted loop invariants stay live through the loop and spill
            rows = start + gl.arange(0, BM, layout=gl.SliceLayout(1, st))
            cols = col + gl.arange(0, W, layout=gl.SliceLayout(0, st))
            mask = ((rows >= first) & (rows < end))[:, None] & (cols < n_lim)[None, :]
            gl.store(c_ptr + (rows - slot0).to(gl.int64)[:, None] * stride_c + cols[None, :], v, mask=mask)

    @gluon.jit
    def _block_at(s, start, n0, NR: gl.constexpr, RB: gl.constexpr, st: gl.constexpr):
        """Block ``s`` of the epilogue of the tile at slot ``start``, column ``n0``: its slots start + (s % NR) * RB
        .. (RB of them) and columns n0 + (s // NR) * 64 .. (64), in ``st``'s row and column slices."""
        rows = start + (s % NR) * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, st))
        cols = n0 + (s // NR) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, st))
        return rows, cols

    @gluon.jit
    def _dh_act_weights(epi, start, r0, first, end, K: gl.constexpr, RB: gl.constexpr, wl: gl.constexpr):
        """The routing weights (fp32) of rows [r0, r0 + RB) of the tile starting at slot ``start``, rows clamped into
        [first, end), read through the token index."""
        rows = gl.minimum(gl.maximum(start + r0 + gl.arange(0, RB, layout=wl), first), end - 1)
        pair = gl.load(epi[4] + rows)
        return gl.load(epi[3] + (pair // K).to(gl.int64) * epi[8] + (pair % K) * epi[9]).to(gl.float32)

    @gluon.jit
    def _dh_act_stage(ab_smem, p, epi, s, start, first, end, n0, slot0, n_dim, NR: gl.constexpr, RB: gl.constexpr,
                      st: gl.constexpr, PAIRS: gl.constexpr):
        """Copies A and B (the saved pre-activations) of block ``s`` of the tile starting at slot ``start`` into
        buffers 2p and 2p + 1 of ``ab_smem`` ([4, RB, 64]) with cp.async, one commit group; rows clamped into
        [first, end), 0 past ``n_dim``. PAIRS (A|B interleaved column by column): the block's 64 columns are 128
        interleaved ones, their first 64 (32 pairs) into 2p, the next 64 into 2p + 1. In shared memory, nothing waits
        for the copy until the block's turn (loaded into registers, the values were repacked into the loop's registers
        at once, which waited for them)."""
        rows, cols = _block_at(s, start, n0, NR, RB, st)
        rows = gl.minimum(gl.maximum(rows, first), end - 1)
        if PAIRS:
            cols = 2 * (n0 + (s // NR) * 64) + gl.arange(0, 64, layout=gl.SliceLayout(0, st))
            pre = epi[0] + (rows - slot0).to(gl.int64)[:, None] * epi[5] + cols[None, :]
            cp.async_copy_global_to_shared(ab_smem.index(2 * p), pre,
                                           mask=(rows >= 0)[:, None] & (cols < 2 * n_dim)[None, :])
            cp.async_copy_global_to_shared(ab_smem.index(2 * p + 1), pre + 64,
                                           mask=(rows >= 0)[:, None] & (cols + 64 < 2 * n_dim)[None, :])
        else:
            ld_mask = (rows >= 0)[:, None] & (cols < n_dim)[None, :]
            pre = epi[0] + (rows - slot0).to(gl.int64)[:, None] * epi[5] + cols[None, :]
            cp.async_copy_global_to_shared(ab_smem.index(2 * p), pre, mask=ld_mask)
            cp.async_copy_global_to_shared(ab_smem.index(2 * p + 1), pre + n_dim, mask=ld_mask)
        cp.commit_group()

    @gluon.jit
    def _dh_act_half(dh, ab, wt, rows, col0, row_ok, epi, hw_ptr, stride_hw, slot0, n_dim, q: gl.constexpr,
                     PL: gl.constexpr, AL: gl.constexpr, ACT: gl.constexpr):
        """PAIRS: the activation's backward on 32 of a block's columns (its half ``q``): ``dh`` their dH' and ``ab``
        their 32 (A, B) pairs ([RB, 64] in ``AL``), both split in registers into ``PL``; dA|dB joined back into pairs
        and stored, w*H stored; returns <dH', H> over the 32 columns by row (columns past ``n_dim`` count 0)."""
        RB: gl.constexpr = ab.shape[0]
        dtype: gl.constexpr = ab.dtype
        a, b = gl.split(gl.reshape(ab.to(gl.float32), [RB, 32, 2]))
        a = gl.convert_layout(a, PL)
        b = gl.convert_layout(b, PL)
        hcols = col0 + q * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, PL))  # H's columns
        col_ok = hcols < n_dim
        hid, d_a, d_b = act_math.act_backward(a, b, dh * wt[:, None], epi[10], epi[11], ACT)
        mask = row_ok[:, None] & col_ok[None, :]
        local = (rows - slot0).to(gl.int64)[:, None]
        gl.store(hw_ptr + local * stride_hw + hcols[None, :], (hid * wt[:, None]).to(dtype), mask=mask)
        d_ab = gl.convert_layout(gl.reshape(gl.join(d_a.to(dtype), d_b.to(dtype)), [RB, 64]), AL)
        acols = 2 * (col0 + q * 32) + gl.arange(0, 64, layout=gl.SliceLayout(0, AL))  # dA|dB's interleaved columns
        arows = gl.convert_layout(rows, gl.SliceLayout(1, AL))
        amask = gl.convert_layout(row_ok, gl.SliceLayout(1, AL))[:, None] & (acols < 2 * n_dim)[None, :]
        gl.store(epi[1] + (arows - slot0).to(gl.int64)[:, None] * epi[6] + acols[None, :], d_ab, mask=amask)
        return gl.sum(gl.where(col_ok[None, :], dh * hid, 0.0), axis=1)

    @gluon.jit
    def _dh_act_block(blocks, w_blocks, epi, hw_ptr, stride_hw, s, start, first, end, n0, slot0, n_dim, ab_smem, p,
                      NR: gl.constexpr, RB: gl.constexpr, st: gl.constexpr, ACT: gl.constexpr, PAIRS: gl.constexpr):
        """The activation's backward on block ``s`` of the tile's rounded dH' (``blocks.index(s)``, [RB, 64]), as
        ``triton.dh._dh_epilogue`` computes it: dA|dB and w*H stored through pointers (rows in [first, end), columns
        below ``n_dim``), <dH', H> over the 64 columns into that chunk's row of the partials, by slot. ``ab_smem``
        buffers 2p, 2p + 1: the block's A and B, staged by :func:`_dh_act_stage` (zeros past ``n_dim``, whose columns
        are masked anyway); ``w_blocks``: the tile's routing weights (fp32) by row block. PAIRS: A|B and dA|dB
        interleaved (see :func:`_dh_act_stage`), each half of the block's columns in :func:`_dh_act_half`."""
        dpre_ptr, part_ptr, stride_dpre, stride_part = epi[1], epi[2], epi[6], epi[7]
        dtype: gl.constexpr = blocks.dtype
        col0 = n0 + (s // NR) * 64  # the block's first column: its chunk of the partials
        if PAIRS:
            # dH' with each thread's 4 + 4 columns 32 apart: [RB, 2, 32] splits into the two halves in registers;
            # A|B with each thread's 4 pairs adjacent: [RB, 32, 2] splits into A and B; both then in PL
            PL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
            AL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
            rows = start + (s % NR) * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, PL))
            row_ok = (rows >= first) & (rows < end)
            wt = w_blocks.index(s % NR).load(gl.SliceLayout(1, PL))
            dh = gl.reshape(blocks.index(s).load(PL).to(gl.float32), [RB, 2, 32])
            dh0, dh1 = gl.split(gl.permute(dh, (0, 2, 1)))
            part = _dh_act_half(gl.convert_layout(dh0, PL), ab_smem.index(2 * p).load(AL), wt, rows, col0, row_ok,
                                epi, hw_ptr, stride_hw, slot0, n_dim, 0, PL, AL, ACT)
            part += _dh_act_half(gl.convert_layout(dh1, PL), ab_smem.index(2 * p + 1).load(AL), wt, rows, col0,
                                 row_ok, epi, hw_ptr, stride_hw, slot0, n_dim, 1, PL, AL, ACT)
            gl.store(part_ptr + (col0 // 64).to(gl.int64) * stride_part + rows, part, mask=row_ok & (col0 < n_dim))
        else:
            rows, cols = _block_at(s, start, n0, NR, RB, st)
            row_ok = (rows >= first) & (rows < end)
            col_ok = cols < n_dim
            wt = w_blocks.index(s % NR).load(gl.SliceLayout(1, st))
            dh = blocks.index(s).load(st).to(gl.float32)
            a = ab_smem.index(2 * p).load(st).to(gl.float32)
            b = ab_smem.index(2 * p + 1).load(st).to(gl.float32)
            d_hid = dh * wt[:, None]
            hid, d_a, d_b = act_math.act_backward(a, b, d_hid, epi[10], epi[11], ACT)
            part = gl.sum(gl.where(col_ok[None, :], dh * hid, 0.0), axis=1)
            mask = row_ok[:, None] & col_ok[None, :]
            local = (rows - slot0).to(gl.int64)[:, None]
            dpre = dpre_ptr + local * stride_dpre + cols[None, :]
            gl.store(dpre, d_a.to(dtype), mask=mask)
            gl.store(dpre + n_dim, d_b.to(dtype), mask=mask)
            gl.store(hw_ptr + local * stride_hw + cols[None, :], (hid * wt[:, None]).to(dtype), mask=mask)
            gl.store(part_ptr + (col0 // 64).to(gl.int64) * stride_part + rows, part,
                     mask=row_ok & (col0 < n_dim))  # (chunks x N may pass 2^31)

    @gluon.jit
    def _dh_act_run(blocks, w_smem, ab_smem, epi, hw_ptr, stride_hw, done, target, start, first, end, n0, slot0,
                    n_dim, NR: gl.constexpr, RB: gl.constexpr, st: gl.constexpr, ACT: gl.constexpr,
                    PAIRS: gl.constexpr):
        """Runs the pending tile's epilogue blocks from ``done`` up to ``target`` (:func:`_dh_act_block`), each once
        its A|B copy has landed, staging the next block's (none past the last: that copy would land on the buffer
        the next tile's first block uses); returns the blocks done."""
        NB: gl.constexpr = blocks.shape[0]
        while done < target:
            cp.wait_group(0)  # this block's A|B, copied a block ago
            _dh_act_block(blocks, w_smem, epi, hw_ptr, stride_hw, done, start, first, end, n0, slot0, n_dim, ab_smem,
                          done % 2, NR, RB, st, ACT, PAIRS)
            if done + 1 < NB:
                _dh_act_stage(ab_smem, (done + 1) % 2, epi, done + 1, start, first, end, n0, slot0, n_dim, NR, RB, st,
                              PAIRS)
            done += 1
        return done

    @gluon.jit
    def _up_h_run(blocks, c0_ptr, stride_c0, done, target, start, first, end, n0, slot0, n_dim, alpha, limit,
                  NR: gl.constexpr, RB: gl.constexpr, st: gl.constexpr, ACT: gl.constexpr):
        """H (``act.act_forward``, e.g. silu(A) * B) of the pending tile's blocks from ``done`` up to ``target``, each
        RB rows x 64 columns of H: A and B read back rounded from the tile in shared memory (``blocks``: A's column
        blocks, then B's), H stored through pointers (rows in [first, end), columns below ``n_dim``); returns the
        blocks done."""
        NH: gl.constexpr = blocks.shape[0] // 2  # H's blocks: A's half of the tile
        dtype: gl.constexpr = blocks.dtype
        while done < target:
            rows, cols = _block_at(done, start, n0, NR, RB, st)
            a = blocks.index(done).load(st).to(gl.float32)
            b = blocks.index(done + NH).load(st).to(gl.float32)
            hid = act_math.act_forward(a, b, alpha, limit, ACT).to(dtype)
            mask = ((rows >= first) & (rows < end))[:, None] & (cols < n_dim)[None, :]
            gl.store(c0_ptr + (rows - slot0).to(gl.int64)[:, None] * stride_c0 + cols[None, :], hid, mask=mask)
            done += 1
        return done

    @gluon.jit
    def _consumer(a_bufs, b_bufs, c_smem, ready_a, ready_b, empty_a, empty_b, c0_desc, c1_desc, c0_ptr, c1_ptr,
                  tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1,
                  k_dim, n_dim, stride_c0, stride_c1, epi, w_smem, ab_smem, BNH: gl.constexpr, SWIGLU: gl.constexpr,
                  SAVE_AB: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, SA: gl.constexpr,
                  SB: gl.constexpr, K: gl.constexpr, ACT_EPI: gl.constexpr, ACT: gl.constexpr, PAIRS: gl.constexpr):
        """SWIGLU: A|B into c1 (columns n0 and n_dim + n0) when SAVE_AB, H into c0; else the product into c0, or with
        ACT_EPI (dh) the activation's backward on it.

        ACT_EPI: a tile's rounded dH' stays in ``c_smem`` and its routing weights in ``w_smem`` while the next tile's
        K loop runs. That loop computes the epilogue block by block (:func:`_dh_act_block`: dA|dB and w*H into c0's
        buffers, the partials; ``epi`` holds their pointers and strides, then the activation's alpha and limit), each
        after a step's wait for the previous step's MMA, while that step's own MMA runs. Each block's A|B is copied into
        ``ab_smem`` a block ahead (cp.async). The last tile's blocks run after the loop.

        SWIGLU: H the same way. A tile's rounded A|B stays in ``c_smem`` (A|B's TMA stores read it
        meanwhile), and the next tile's K loop computes H from it in blocks of 32 x 64 (:func:`_up_h_run`), stored
        through pointers; the last tile's blocks run after the loop."""
        BN: gl.constexpr = c_smem.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
        dtype: gl.constexpr = c_smem.dtype
        tile0 = gl.load(tile0_ptr)
        n_k = k_dim // BK
        g = 0  # steps consumed so far, over all of this program's tiles
        # ACT_EPI: the epilogue's blocks of RB x 64, 8 elements (16 bytes) a thread
        RB: gl.constexpr = 32
        NR: gl.constexpr = BM // RB
        NB: gl.constexpr = NR * (BN // 64)
        ep: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        wl: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])  # [RB]: routing weights
        # c_smem [BM, BN] with 128-byte swizzling is BN / 64 column blocks of [BM, 64], one after the other, each
        # 8-row group swizzled alike: as [NB, RB, 64], block s (rows (s % NR) * RB .. of column block s // NR) can
        # be indexed at run time
        blocks = c_smem._reinterpret(dtype, [NB, RB, 64], gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                                                element_bitwidth=16))
        if SWIGLU:
            NP: gl.constexpr = NB // 2  # blocks of H a tile has
        else:
            NP: gl.constexpr = NB
        done = gl.to_tensor(NP)  # blocks of the pending tile done (NP: nothing pending)
        p_start = gl.to_tensor(0)  # the pending tile's start, first, end, first column
        p_first = gl.to_tensor(0)
        p_end = gl.to_tensor(1)
        p_n0 = gl.to_tensor(0)

        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            e, start, first, end, pid_n = common.tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr,
                                                      tile_start_ptr, offsets_ptr, slot0, slot1, GROUP_M)
            if e >= 0:
                gl.assume(n_k > 0)  # else ptxas serializes every wgmma (H100; docs/kernels.md)
                if ACT_EPI:  # this tile's routing weights, loaded while its K loop runs
                    gl.static_assert(NR == 4)
                    w0 = _dh_act_weights(epi, start, 0, first, end, K, RB, wl)
                    w1 = _dh_act_weights(epi, start, RB, first, end, K, RB, wl)
                    w2 = _dh_act_weights(epi, start, 2 * RB, first, end, K, RB, wl)
                    w3 = _dh_act_weights(epi, start, 3 * RB, first, end, K, RB, wl)
                acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                for k in range(n_k):
                    sa = g % SA
                    sb = g % SB
                    mbarrier.wait(ready_a.index(sa), (g // SA) & 1)
                    mbarrier.wait(ready_b.index(sb), (g // SB) & 1)
                    fence_async_shared()  # cp.async wrote A through the generic proxy; wgmma reads the async one
                    if B_KMAJOR:
                        b = b_bufs.index(sb).permute((1, 0))
                    else:
                        b = b_bufs.index(sb)
                    acc = warpgroup_mma(a_bufs.index(sa), b, acc, use_acc=k > 0, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    common.release(empty_a, empty_b, g - 1, SA, SB, k > 0)  # step k - 1's MMA is done
                    g += 1
                    if ACT_EPI:  # the pending tile's blocks up to this step's share, beside step k's MMA
                        done = _dh_act_run(blocks, w_smem, ab_smem, epi, c0_ptr, stride_c0, done, ((k + 1) * NB) // n_k,
                                           p_start, p_first, p_end, p_n0, slot0, n_dim, NR, RB, ep, ACT, PAIRS)
                    if SWIGLU:  # the pending tile's H blocks up to this step's share
                        done = _up_h_run(blocks, c0_ptr, stride_c0, done, ((k + 1) * NP) // n_k, p_start, p_first,
                                         p_end, p_n0, slot0, n_dim, epi[10], epi[11], NR, RB, ep, ACT)
                n0 = pid_n * BNH
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                common.release(empty_a, empty_b, g - 1, SA, SB, True)
                row = start - slot0
                full = (first == start) & (end - start == BM) & (n0 + BNH <= n_dim)
                if ACT_EPI:  # this tile's epilogue is pending: it runs during the next tile's K loop
                    c_smem.store(acc.to(dtype))
                    w_smem.index(0).store(w0)
                    w_smem.index(1).store(w1)
                    w_smem.index(2).store(w2)
                    w_smem.index(3).store(w3)
                    p_start, p_first, p_end, p_n0 = start, first, end, n0
                    done = gl.to_tensor(0)
                    _dh_act_stage(ab_smem, 0, epi, 0, start, first, end, n0, slot0, n_dim, NR, RB, ep, PAIRS)
                else:
                    tma.store_wait(0)  # the previous tile's stores have read c_smem
                    c_smem.store(acc.to(dtype))
                    fence_async_shared()
                if SWIGLU:  # columns [0, BNH) hold A, [BNH, 2 BNH) hold B
                    a_smem = c_smem.slice(0, BNH, dim=1)
                    b_smem = c_smem.slice(BNH, BNH, dim=1)
                    if SAVE_AB:
                        _store(a_smem, c1_desc, c1_ptr, row, n0, start, first, end, slot0, n_dim, stride_c1, full)
                        _store(b_smem, c1_desc, c1_ptr, row, n_dim + n0, start, first, end, slot0, 2 * n_dim,
                               stride_c1, full)
                if SWIGLU:  # H is pending: it runs during the next tile's K loop
                    p_start, p_first, p_end, p_n0 = start, first, end, n0
                    done = gl.to_tensor(0)
                elif not ACT_EPI:
                    _store(c_smem, c0_desc, c0_ptr, row, n0, start, first, end, slot0, n_dim, stride_c0, full)
        if ACT_EPI:  # the last tile's epilogue
            done = _dh_act_run(blocks, w_smem, ab_smem, epi, c0_ptr, stride_c0, done, NB, p_start, p_first, p_end,
                               p_n0, slot0, n_dim, NR, RB, ep, ACT, PAIRS)
            cp.wait_group(0)
        if SWIGLU:  # the last tile's H
            done = _up_h_run(blocks, c0_ptr, stride_c0, done, NP, p_start, p_first, p_end, p_n0, slot0, n_dim,
                             epi[10], epi[11], NR, RB, ep, ACT)
        tma.store_wait(0)

    @gluon.jit
    def _gather_gemm(
        a_ptr,  # [T, k_dim] x or dy, read at row token(s); unit column stride, 16-byte aligned rows
        b0_desc, b1_desc,  # every expert's W_gate (dh: W_down) / W_up as 2-D row blocks (b1 = b0 unless SWIGLU)
        c0_desc, c1_desc,  # [slot1 - slot0, n]: H (dh: dH'); [.., 2n]: A|B when SAVE_AB (else c0's again)
        c0_ptr, c1_ptr,  # the same buffers, for ragged tiles
        token_index_ptr, tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
        num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim,
        K: gl.constexpr,  # a compile-time constant, as in dw (a runtime division costs dozens of instructions)
        stride_a, e_rows0, e_rows1, stride_c0, stride_c1,
        pre_ptr, dpre_ptr, part_ptr, weights_ptr,  # ACT_EPI: A|B, dA|dB [.., 2n], partials, routing weights
        stride_pre, stride_dpre, stride_part, stride_wt_t, stride_wt_k,
        alpha, limit,  # fp32: the activation's parameters (Activation.alpha, .limit; unused by most)
        SWIGLU: gl.constexpr, SAVE_AB: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr,
        A_STAGES: gl.constexpr, B_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACT_EPI: gl.constexpr,
        ACT: gl.constexpr,  # SWIGLU or ACT_EPI: the activation's code (act.ACT_CODES), one of ACTIVATIONS
        PAIRS: gl.constexpr,  # ACT_EPI: A|B and dA|dB interleaved column by column (gpt-oss's layout)
    ):
        """The body of the three kernels below: grid = (min(SMs, num_m * num_n),), num_warps=8 (consumers) + a 4-warp
        producer."""
        BNH: gl.constexpr = c0_desc.block_type.shape[1]  # columns of h a tile covers
        if SWIGLU:  # A's and B's side by side
            BN: gl.constexpr = 2 * BNH
        else:
            BN: gl.constexpr = BNH
        dtype: gl.constexpr = b0_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [A_STAGES, BM, BK],
                                           gl.NVMMASharedLayout.get_default_for([BM, BK], dtype))
        if B_KMAJOR:
            b_block: gl.constexpr = [BN, BK]
        else:
            b_block: gl.constexpr = [BK, BN]
        b_bufs = gl.allocate_shared_memory(dtype, [B_STAGES] + b_block,
                                           gl.NVMMASharedLayout.get_default_for(b_block, dtype))
        c_smem = gl.allocate_shared_memory(dtype, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], dtype))
        ready_a, empty_a = common.ring_barriers(A_STAGES, 128)  # ready: one arrival a producer thread
        ready_b, empty_b = common.ring_barriers(B_STAGES, 1)  # ready: completed by the TMA copies
        # Integer arguments equal to 1 arrive as Python ints, which a partition cannot take: make them tensors.
        num_m, num_n, tiles_total = gl.to_tensor(num_m), gl.to_tensor(num_n), gl.to_tensor(tiles_total)
        slot0, slot1 = gl.to_tensor(slot0), gl.to_tensor(slot1)
        k_dim, n_dim, stride_a = gl.to_tensor(k_dim), gl.to_tensor(n_dim), gl.to_tensor(stride_a)
        e_rows0, e_rows1 = gl.to_tensor(e_rows0), gl.to_tensor(e_rows1)
        stride_c0, stride_c1 = gl.to_tensor(stride_c0), gl.to_tensor(stride_c1)
        # ACT_EPI: the pending tile's routing weights, [row blocks of 32, 32] (else one unused row)
        w_smem = gl.allocate_shared_memory(gl.float32, [BM // 32 if ACT_EPI else 1, 32],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # ACT_EPI: two blocks' A|B ([2 blocks x 2, 32, 64], 16 KB: the launch takes one gathered-row stage less)
        ab_smem = gl.allocate_shared_memory(dtype, [4 if ACT_EPI else 1, 32 if ACT_EPI else 8, 64],
                                            gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
        epi = (pre_ptr, dpre_ptr, part_ptr, weights_ptr, token_index_ptr, gl.to_tensor(stride_pre),
               gl.to_tensor(stride_dpre), gl.to_tensor(stride_part), gl.to_tensor(stride_wt_t),
               gl.to_tensor(stride_wt_k), gl.to_tensor(alpha), gl.to_tensor(limit))
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, c_smem, ready_a, ready_b, empty_a, empty_b, c0_desc, c1_desc, c0_ptr,
                         c1_ptr, tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total,
                         slot0, slot1, k_dim, n_dim, stride_c0, stride_c1, epi, w_smem, ab_smem, BNH, SWIGLU, SAVE_AB,
                         B_KMAJOR, GROUP_M, A_STAGES, B_STAGES, K, ACT_EPI, ACT, PAIRS)),
            (_producer, (a_ptr, b0_desc, b1_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty_a,
                         empty_b, tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total,
                         slot0, slot1, k_dim, K, stride_a, e_rows0, e_rows1, BNH, SWIGLU, B_KMAJOR, GROUP_M, A_STAGES,
                         B_STAGES)),
        ], [4], [PRODUCER_REGS])

    # Three names for one kernel, so that profiles tell the up projection, dh's GEMM and the fused dh apart.
    @sized(gluon.jit)
    def _up_sm90_kernel(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                        tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim,
                        n_dim, K: gl.constexpr, stride_a, e_rows0, e_rows1, stride_c0, stride_c1,
                        pre_ptr, dpre_ptr, part_ptr, weights_ptr, stride_pre, stride_dpre, stride_part, stride_wt_t,
                        stride_wt_k, alpha, limit, SAVE_AB: gl.constexpr, B_KMAJOR: gl.constexpr,
                        GROUP_M: gl.constexpr, A_STAGES: gl.constexpr, B_STAGES: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, ACT: gl.constexpr, PAIRS: gl.constexpr):
        _gather_gemm(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                     tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim,
                     n_dim, K, stride_a, e_rows0, e_rows1, stride_c0, stride_c1, pre_ptr, dpre_ptr, part_ptr,
                     weights_ptr, stride_pre, stride_dpre, stride_part, stride_wt_t, stride_wt_k, alpha, limit,
                     True, SAVE_AB, B_KMAJOR, GROUP_M, A_STAGES, B_STAGES, PRODUCER_REGS, False, ACT, PAIRS)

    @sized(gluon.jit)
    def _dh_sm90_kernel(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                        tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim,
                        n_dim, K: gl.constexpr, stride_a, e_rows0, e_rows1, stride_c0, stride_c1,
                        pre_ptr, dpre_ptr, part_ptr, weights_ptr, stride_pre, stride_dpre, stride_part, stride_wt_t,
                        stride_wt_k, alpha, limit, SAVE_AB: gl.constexpr, B_KMAJOR: gl.constexpr,
                        GROUP_M: gl.constexpr, A_STAGES: gl.constexpr, B_STAGES: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, ACT: gl.constexpr, PAIRS: gl.constexpr):
        _gather_gemm(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                     tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim,
                     n_dim, K, stride_a, e_rows0, e_rows1, stride_c0, stride_c1, pre_ptr, dpre_ptr, part_ptr,
                     weights_ptr, stride_pre, stride_dpre, stride_part, stride_wt_t, stride_wt_k, alpha, limit,
                     False, SAVE_AB, B_KMAJOR, GROUP_M, A_STAGES, B_STAGES, PRODUCER_REGS, False, ACT, PAIRS)

    @sized(gluon.jit)
    def _dh_act_sm90_kernel(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                            tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1,
                            k_dim, n_dim, K: gl.constexpr, stride_a, e_rows0, e_rows1, stride_c0, stride_c1,
                            pre_ptr, dpre_ptr, part_ptr, weights_ptr, stride_pre, stride_dpre, stride_part,
                            stride_wt_t, stride_wt_k, alpha, limit, SAVE_AB: gl.constexpr,
                            B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, A_STAGES: gl.constexpr,
                            B_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACT: gl.constexpr,
                            PAIRS: gl.constexpr):
        _gather_gemm(a_ptr, b0_desc, b1_desc, c0_desc, c1_desc, c0_ptr, c1_ptr, token_index_ptr, tile0_ptr,
                     tile_expert_ptr, tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim,
                     n_dim, K, stride_a, e_rows0, e_rows1, stride_c0, stride_c1, pre_ptr, dpre_ptr, part_ptr,
                     weights_ptr, stride_pre, stride_dpre, stride_part, stride_wt_t, stride_wt_k, alpha, limit,
                     False, SAVE_AB, B_KMAJOR, GROUP_M, A_STAGES, B_STAGES, PRODUCER_REGS, True, ACT, PAIRS)


def launches() -> int:
    """How many times this process has launched the kernel (for tests)."""
    return _LAUNCHES.n


class GatherWeights(NamedTuple):
    """The weights of one gathering GEMM as this kernel reads them, resolved once per call."""

    descs: tuple  # Gluon descriptors of W_gate and W_up (up), or W_down twice (dh)
    e_rows: tuple[int, int]  # rows from one expert's matrix to the next, in each descriptor
    kmajor: bool  # the descriptors' rows are n (k contiguous); else they are k (n contiguous)


def _weights(views: list, kmajor: bool, k_dim: int, block_n: int) -> GatherWeights | None:
    """Descriptors with blocks of ``block_n`` x 64 over each view's row blocks (see :func:`up_weights`)."""
    if not common.takes(views[0]):
        return None
    if views[0].dtype not in (torch.bfloat16, torch.float16) or any(v.dtype != views[0].dtype for v in views):
        return None
    if k_dim <= 0 or k_dim % BLOCK_K:  # (with rows = k, the next expert's rows would be summed in)
        return None
    block = [block_n, BLOCK_K] if kmajor else [BLOCK_K, block_n]
    got = common.row_block_descs(views, block)
    if got is None:
        return None
    descs, e_rows = got
    if len(descs) == 1:  # dh: W_down in both places
        descs, e_rows = descs * 2, e_rows * 2
    return GatherWeights(descs, e_rows, kmajor)


def up_weights(gate, up, kmajor: bool, d: int) -> GatherWeights | None:
    """The up kernel's view of W_gate and W_up, given as the ``[E, d, h]`` (``kmajor`` False) or ``[E, h, d]``
    (``kmajor`` True) views over which ``triton.common`` builds descriptors (unit last stride, 16-byte aligned base
    and strides: ``triton.common.weight_tma_mode``). None when this kernel cannot take them: Gluon missing or switched
    off, not an sm_90 device, not 16-bit, d % 64, or experts that are not row blocks of one view."""
    if gate is None or up is None:
        return None
    return _weights([gate, up], kmajor, d, UP_BLOCK_N)


def dh_weights(down, kmajor: bool, d: int) -> GatherWeights | None:
    """dh's GEMM view of W_down (B[e][k, n] = W_down[e][k, n], k = d): as :func:`up_weights`."""
    if down is None:
        return None
    return _weights([down], kmajor, d, DH_BLOCK_N)


def _gather_ok(a: torch.Tensor, outs: list[torch.Tensor], block_m: int) -> bool:
    return (block_m == BLOCK_M and a.dtype in (torch.bfloat16, torch.float16) and common.rows_ok(a)
            and all(o.dtype == a.dtype and common.rows_ok(o) for o in outs))


def up_usable(x: torch.Tensor, hid: torch.Tensor, pre: torch.Tensor | None, act_name: str, biased: bool,
              block_m: int) -> bool:
    """Whether the up kernel may take a window: an activation of :data:`ACTIVATIONS` without biases, plan row
    tiles of ``BLOCK_M``, and x, H and A|B (``pre``, None when not kept) of one 16-bit dtype with unit column strides
    and 16-byte aligned bases and rows."""
    return (act_name in ACTIVATIONS and not biased
            and _gather_ok(x, [hid] if pre is None else [hid, pre], block_m))


def dh_usable(dy: torch.Tensor, out: torch.Tensor, block_m: int) -> bool:
    """Whether dh's GEMM may take a window: as :func:`up_usable` for dy and dH'."""
    return _gather_ok(dy, [out], block_m)


def _launch(kernel, a: torch.Tensor, w: GatherWeights, c0: torch.Tensor, c1: torch.Tensor | None, plan, K: int,
            k_dim: int, n_dim: int, window, block_n: int, act=None, epi: tuple | None = None,
            pairs: bool = False) -> None:
    """Launch ``kernel`` over the window: c0 ``[.., n_dim]`` out, and c1 ``[.., 2 n_dim]`` (A|B) when not None;
    ``act``: the activation (an ``Activation`` named in :data:`ACTIVATIONS`) of the up kernel and the fused dh;
    ``epi`` = (pre, dpre, part, weights) for the fused dh (:func:`dh_act_sm90`), A|B and dA|dB interleaved where
    ``pairs``."""
    block = [BLOCK_M, block_n]
    c0_desc = GluonDescriptor.from_tensor(c0, block, common.layout(block, c0.dtype))
    c1 = c1 if c1 is not None else c0  # (never written unless SAVE_AB)
    c1_desc = GluonDescriptor.from_tensor(c1, block, common.layout(block, c1.dtype)) if c1 is not c0 else c0_desc
    if epi is None:  # placeholders, never read
        pre, dpre, part, weights = c0, c0, c0, c0
        epi_strides = (0, 0, 0, 0, 0)
    else:
        pre, dpre, part, weights = epi
        epi_strides = (pre.stride(0), dpre.stride(0), part.stride(0), weights.stride(0), weights.stride(1))
    num_n = -(-n_dim // block_n)
    grid = (min(common.sm_count(a.device), window.num_tiles * num_n),)
    launch(
        kernel, grid,
        a, *w.descs, c0_desc, c1_desc, c0, c1, plan.token_index, window.tile0, plan.tile_expert, plan.tile_start,
        plan.offsets, window.num_tiles, num_n, plan.tile_expert.numel(), window.slot0, window.slot1, k_dim, n_dim, K,
        a.stride(0), *w.e_rows, c0.stride(0), c1.stride(0), pre, dpre, part, weights, *epi_strides,
        float(act.alpha) if act is not None else 1.0, float(act.limit) if act is not None else 0.0,
        ACT=act_math.ACT_CODES[act.name] if act is not None else 0,
        SAVE_AB=c1 is not c0, B_KMAJOR=w.kmajor, GROUP_M=GROUP_M,
        A_STAGES=A_STAGES if epi is None else A_STAGES - 1,  # the fused dh's A|B blocks take one stage's 16 KB
        B_STAGES=B_STAGES, PRODUCER_REGS=_PRODUCER_REGS, PAIRS=pairs,
        num_warps=8,
    )
    bump(_LAUNCHES)
    if epi is not None:
        bump(_ACT_LAUNCHES)


def up_sm90(x: torch.Tensor, w: GatherWeights, plan, K: int, d: int, h: int, window, hid: torch.Tensor,
            pre: torch.Tensor | None, act) -> None:
    """The forward up projection of one window through this kernel (:func:`up_usable` true): H into ``hid``
    ``[slot1 - slot0, h]``, A|B into ``pre`` ``[slot1 - slot0, 2h]`` when not None."""
    _launch(_up_sm90_kernel, x, w, hid, pre[:, :2 * h] if pre is not None else None, plan, K, d, h, window,
            UP_BLOCK_N, act)


def dh_sm90(dy: torch.Tensor, w: GatherWeights, plan, K: int, d: int, h: int, window, out: torch.Tensor) -> None:
    """dh's GEMM of one window through this kernel (:func:`dh_usable` true): dH' into ``out`` ``[.., h]``."""
    _launch(_dh_sm90_kernel, dy, w, out, None, plan, K, d, h, window, DH_BLOCK_N)


def act_launches() -> int:
    """How many times this process has launched the fused dh kernel (for tests)."""
    return _ACT_LAUNCHES.n


def dh_act_usable(dy: torch.Tensor, hw: torch.Tensor, pre: torch.Tensor, dpre: torch.Tensor, weights: torch.Tensor,
                  act_name: str, chunk: int, block_m: int) -> bool:
    """Whether the fused dh may take a window: :func:`dh_usable`, an activation of :data:`ACTIVATIONS`, the partials
    in chunks of 64 columns, h % 16 == 0 (B's half of the saved A|B then starts 16-byte aligned, which its 16-byte
    cp.async copies need the compiler to know), and the saved A|B and dA|dB of dy's dtype with unit column strides and
    16-byte aligned rows."""
    return (act_name in ACTIVATIONS and chunk == 64 and weights.is_floating_point()
            and hw.shape[1] % 16 == 0 and _gather_ok(dy, [hw, pre, dpre], block_m))


def dh_act_sm90(dy: torch.Tensor, w: GatherWeights, plan, K: int, d: int, h: int, window, hw: torch.Tensor,
                pre: torch.Tensor, dpre: torch.Tensor, part: torch.Tensor, weights: torch.Tensor, act,
                pairs: bool = False) -> None:
    """dh's GEMM and its activation's epilogue in one launch (:func:`dh_act_usable` true), the results of the split's
    two launches (``triton.dh._expert_dh_kernel`` PHASE 1 then 2): dA|dB into ``dpre`` ``[.., 2h]``, w*H into ``hw``
    ``[.., h]`` (both the window's rows), ``<dH', H>`` over each 64 columns into ``part`` (``[chunks, N]``, by
    slot); ``pre`` is the saved A|B from the window's first slot; ``pairs``: A|B and dA|dB interleaved column by
    column (``BackwardPlan.pairs``)."""
    _launch(_dh_act_sm90_kernel, dy, w, hw, None, plan, K, d, h, window, DH_BLOCK_N, act, (pre, dpre, part, weights),
            pairs)
