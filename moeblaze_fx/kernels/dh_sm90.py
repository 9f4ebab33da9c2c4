"""The backward dH' kernel for sm_90 in Gluon: the ``"activations"`` policy with SwiGLU, 16-bit operands.

Same contract as ``expert_bwd._expert_dh_kernel`` with ``RECOMPUTE=False``, ``ACT=swiglu`` (it writes the
same dA|dB, w*H and routing-weight partials), written in Gluon so that the layouts are ours:

* the main loop is a hand-pipelined cp.async / wgmma loop: dy rows gathered through the token index
  (16-byte cp.async per thread), W_down tiles from the expert's table pointer, ``STAGES`` shared buffers
  of which ``STAGES - 2`` are in flight ahead of the MMA, and one wgmma group kept in flight;
* the epilogue works in the accumulator's own (wgmma) layout: A|B are loaded straight into it and dA|dB,
  w*H are stored from it. The Triton kernel converts six times between a blocked layout and the
  accumulator's, and its registers (254) are those of that epilogue (benchmarks/NOTES-kernels.md).

``SPLIT_N`` accumulators of ``BLOCK_M x BLOCK_N`` sit side by side (one program covers ``SPLIT_N *
BLOCK_N`` hidden columns); the epilogue runs one accumulator at a time.

Only for the GPU: Gluon has no interpreter, so the CPU tests cannot run it. :func:`supported` says when
``expert_bwd`` may use it; everything else takes the Triton kernel. ``MOEBLAZE_GLUON_DH=0`` turns it off.
"""
from __future__ import annotations

import os

import torch
import triton

try:  # Gluon is experimental: its import (and API) may be missing from a Triton build
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    _GLUON = False

__all__ = ["ENV_VAR", "supported", "dh_sm90", "DhConfig", "DEFAULT"]

ENV_VAR = "MOEBLAZE_GLUON_DH"


class DhConfig(tuple):
    """(BLOCK_N, SPLIT_N, BLOCK_K, STAGES, GROUP_M, num_warps, PREFETCH, BLOCK_M)."""

    def __new__(cls, block_n=128, split_n=2, block_k=64, stages=4, group_m=8, num_warps=8, prefetch=False,
                block_m=128):
        return super().__new__(cls, (block_n, split_n, block_k, stages, group_m, num_warps, prefetch, block_m))


DEFAULT = DhConfig()


if _GLUON:
    @gluon.constexpr_function
    def _load_layout(cols, num_warps):
        """A blocked layout for [rows, cols] 16-bit tiles: 8 contiguous elements (16 bytes) per thread."""
        tpc = min(cols // 8, 32)
        return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [num_warps, 1], [1, 0])

    @gluon.jit
    def _dh_epilogue_sm90(acc, col0, start, first, end, slot0, h, K,
                          token_index_ptr, weights_ptr, preact_ptr, dpre_ptr, hw_ptr, part_ptr,
                          stride_wt_t, stride_wt_k, stride_pre_s, stride_dpre_s, stride_hw_s, stride_part_c,
                          a_smem, b_smem,
                          CHUNK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          layout: gl.constexpr, PREFETCH: gl.constexpr):
        """SwiGLU backward for hidden columns [col0, col0 + BLOCK_N), in ``layout`` (the accumulator's)."""
        io_ty: gl.constexpr = dpre_ptr.dtype.element_ty
        local = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        row_mask = (local >= first - start) & (local < end - start)
        local_ld = gl.minimum(gl.maximum(local, first - start), end - 1 - start)
        pair = gl.load(token_index_ptr + start + local_ld)
        wt = gl.load(weights_ptr + (pair // K).to(gl.int64) * stride_wt_t + (pair % K) * stride_wt_k).to(gl.float32)
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        start64 = (start - slot0).to(gl.int64)  # the tile's first row in the window's buffers (may be < 0)
        pre_base = preact_ptr + start64 * stride_pre_s
        pre_offs = local_ld[:, None] * stride_pre_s + cols[None, :]
        if PREFETCH:  # copied into shared memory during the K loop
            a = a_smem.load(layout).to(gl.float32)
            b = b_smem.load(layout).to(gl.float32)
        else:
            a = gl.load(pre_base + pre_offs).to(gl.float32)
            b = gl.load(pre_base + h + pre_offs).to(gl.float32)
        sig = 1.0 / (1.0 + gl.exp(-a))
        silu = a * sig
        hid = silu * b
        d_hid = acc * wt[:, None]
        d_a = d_hid * b * (sig * (1.0 + a * (1.0 - sig)))
        d_b = d_hid * silu
        part = gl.sum(acc * hid, axis=1)  # <dH', H> over these columns
        mask = row_mask[:, None]
        dpre_base = dpre_ptr + start64 * stride_dpre_s
        dpre_offs = local[:, None] * stride_dpre_s + cols[None, :]
        gl.store(dpre_base + dpre_offs, d_a.to(io_ty), mask=mask)
        gl.store(dpre_base + h + dpre_offs, d_b.to(io_ty), mask=mask)
        gl.store(hw_ptr + start64 * stride_hw_s + (local[:, None] * stride_hw_s + cols[None, :]),
                 (hid * wt[:, None]).to(io_ty), mask=mask)
        # these columns own chunks [col0 / CHUNK_N, (col0 + BLOCK_N) / CHUNK_N): the first gets the sum
        part_ptrs = part_ptr + (col0 // CHUNK_N) * stride_part_c + pair.to(gl.int64)
        gl.store(part_ptrs, part, mask=row_mask)
        for j in gl.static_range(1, BLOCK_N // CHUNK_N):
            gl.store(part_ptrs + j * stride_part_c, gl.zeros_like(part), mask=row_mask)

    @gluon.jit
    def _expert_dh_sm90_kernel(
        grad_y_ptr,  # [T, d], unit column stride
        down_table_ptr,  # [E] int64: W_down[e] [d, h] via (stride_wd_d, stride_wd_n); one of them is 1
        weights_ptr,  # [T, K] routing weights
        preact_ptr,  # [slot1 - slot0, 2h] saved A|B, unit column stride
        dpre_ptr,  # [slot1 - slot0, 2h] out: dA|dB, unit column stride
        hw_ptr,  # [slot1 - slot0, h] out: w * H, unit column stride
        part_ptr,  # [num_chunks, N] fp32 out
        token_index_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr, tile0_ptr,
        num_tiles, tiles_total, slot0, slot1, d, h, K,
        stride_g_t, stride_wd_d, stride_wd_n, stride_wt_t, stride_wt_k,
        stride_pre_s, stride_dpre_s, stride_hw_s, stride_part_c,
        W_ALIGN: gl.constexpr, B_K_CONTIG: gl.constexpr, CHUNK_N: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_N: gl.constexpr, BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr, GROUP_M: gl.constexpr, PREFETCH: gl.constexpr, PLAN_M: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """grid = (num_tiles * h // (SPLIT_N * BLOCK_N),); d % BLOCK_K == 0 and h % (SPLIT_N * BLOCK_N) == 0."""
        gl.static_assert(SPLIT_N == 1 or SPLIT_N == 2)
        gl.static_assert(STAGES >= 3)
        NW: gl.constexpr = num_warps
        dtype: gl.constexpr = grad_y_ptr.dtype.element_ty
        # program -> (row tile, column block), GROUP_M row tiles at a time (as expert_fwd._grouped_tile_ids)
        num_pid_n = h // (SPLIT_N * BLOCK_N)
        pid = gl.program_id(0)
        SUB: gl.constexpr = PLAN_M // BLOCK_M  # programs per row tile of the plan (BLOCK_M rows each)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        group_size = gl.minimum(num_tiles * SUB - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_size
        pid_n = (pid % in_group) // group_size
        # the window's row tile (as expert_fwd._window_tile)
        t = pid_m // SUB + gl.load(tile0_ptr)
        if t >= tiles_total:
            return
        e = gl.load(tile_expert_ptr + t)
        start = gl.load(tile_start_ptr + t) + (pid_m % SUB) * BLOCK_M
        end = gl.minimum(gl.minimum(gl.load(offsets_ptr + gl.maximum(e, 0) + 1), slot1), start + BLOCK_M)
        first = gl.maximum(start, slot0)
        if e < 0 or first >= end:
            return

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        ld_a: gl.constexpr = _load_layout(BLOCK_K, NW)
        a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_sl)
        if B_K_CONTIG:  # B tiles stored [BLOCK_N, BLOCK_K], fed to the MMA transposed
            ld_b: gl.constexpr = _load_layout(BLOCK_K, NW)
            b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
            b0_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_sl)
            b1_smem = gl.allocate_shared_memory(dtype, [STAGES if SPLIT_N == 2 else 1, BLOCK_N, BLOCK_K], b_sl)
        else:  # [BLOCK_K, BLOCK_N], hidden columns contiguous
            ld_b: gl.constexpr = _load_layout(BLOCK_N, NW)
            b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
            b0_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_sl)
            b1_smem = gl.allocate_shared_memory(dtype, [STAGES if SPLIT_N == 2 else 1, BLOCK_K, BLOCK_N], b_sl)

        # dy rows gathered through the token index (rows past the tile's clip re-read its last row)
        rows = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_a))
        rows = gl.minimum(gl.maximum(rows, first), end - 1)
        tok = (gl.load(token_index_ptr + rows) // K).to(gl.int64)
        offs_ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld_a))
        a_ptrs = grad_y_ptr + tok[:, None] * stride_g_t + offs_ka[None, :]
        wd_e = gl.load(down_table_ptr + e).to(gl.pointer_type(dtype))
        if W_ALIGN > 1:
            wd_e = gl.multiple_of(wd_e, W_ALIGN)
        col0 = pid_n * (SPLIT_N * BLOCK_N)
        if B_K_CONTIG:
            offs_nb = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_b))
            offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld_b))
            b_ptrs = wd_e + offs_nb[:, None].to(gl.int64) * stride_wd_n + offs_kb[None, :]
            b_next = BLOCK_N * stride_wd_n
            b_step = BLOCK_K
        else:
            offs_kb = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld_b))
            offs_nb = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ld_b))
            b_ptrs = wd_e + offs_kb[:, None].to(gl.int64) * stride_wd_d + offs_nb[None, :]
            b_next = BLOCK_N
            b_step = BLOCK_K * stride_wd_d

        n_k = d // BLOCK_K
        if PREFETCH:  # the epilogue's A|B tiles, copied with the first K step (their own buffer)
            ld_p: gl.constexpr = _load_layout(BLOCK_N, NW)
            p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
            pre_smem = gl.allocate_shared_memory(dtype, [2 * SPLIT_N, BLOCK_M, BLOCK_N], p_sl)
            prow = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_p))
            prow = gl.minimum(gl.maximum(prow, first - start), end - 1 - start)
            pcol = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ld_p))
            p_ptrs = preact_ptr + (start - slot0).to(gl.int64) * stride_pre_s + (prow[:, None] * stride_pre_s + pcol[None, :])
            for j in gl.static_range(SPLIT_N):
                cp.async_copy_global_to_shared(pre_smem.index(2 * j), p_ptrs + j * BLOCK_N)
                cp.async_copy_global_to_shared(pre_smem.index(2 * j + 1), p_ptrs + h + j * BLOCK_N)
        else:
            pre_smem = a_smem  # unused
        # The host guarantees d >= BLOCK_K. Without the fact, the path that skips the loop joins the final
        # wgmma wait with zero-initialised accumulators, and ptxas serializes every wgmma (C7515).
        gl.assume(n_k > 0)
        AHEAD: gl.constexpr = STAGES - 2  # loads in flight ahead of the MMA; one more buffer feeds the MMA in flight
        for i in gl.static_range(AHEAD):
            if i < n_k:
                cp.async_copy_global_to_shared(a_smem.index(i), a_ptrs + i * BLOCK_K)
                cp.async_copy_global_to_shared(b0_smem.index(i), b_ptrs + i * b_step)
                if SPLIT_N == 2:
                    cp.async_copy_global_to_shared(b1_smem.index(i), b_ptrs + b_next + i * b_step)
            cp.commit_group()

        acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        for k in range(n_k):
            cp.wait_group(AHEAD - 1)  # this thread's copies of step k have landed
            gl.thread_barrier()  # everyone's have; and every warpgroup has retired the MMA of step k - 2
            fence_async_shared()  # cp.async wrote through the generic proxy, wgmma reads through the async one
            # step k + AHEAD's tiles, into the buffer the MMA of step k - 2 read. Predicated, not branched:
            # a branch between a wgmma and its wait makes ptxas serialize every wgmma (seen in the SASS).
            s = (k + AHEAD) % STAGES
            more = k + AHEAD < n_k
            kn = gl.minimum(k + AHEAD, n_k - 1)  # a valid address even where nothing is copied
            cp.async_copy_global_to_shared(a_smem.index(s), a_ptrs + kn * BLOCK_K, mask=more)
            cp.async_copy_global_to_shared(b0_smem.index(s), b_ptrs + kn * b_step, mask=more)
            if SPLIT_N == 2:
                cp.async_copy_global_to_shared(b1_smem.index(s), b_ptrs + b_next + kn * b_step, mask=more)
            cp.commit_group()
            s = k % STAGES
            if B_K_CONTIG:
                b0 = b0_smem.index(s).permute((1, 0))
            else:
                b0 = b0_smem.index(s)
            acc0 = warpgroup_mma(a_smem.index(s), b0, acc0, is_async=True)
            if SPLIT_N == 2:
                if B_K_CONTIG:
                    b1 = b1_smem.index(s).permute((1, 0))
                else:
                    b1 = b1_smem.index(s)
                acc1 = warpgroup_mma(a_smem.index(s), b1, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            else:
                acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
        if SPLIT_N == 2:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
        cp.wait_group(0)
        if PREFETCH:
            gl.thread_barrier()  # every thread's A|B copies have landed

        if SPLIT_N == 2 and BLOCK_N >= 128:  # park the second accumulator in shared memory during the first epilogue
            gl.thread_barrier()
            acc1_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N],
                                                  gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float32),
                                                  acc1)
        _dh_epilogue_sm90(acc0, col0, start, first, end, slot0, h, K, token_index_ptr, weights_ptr, preact_ptr,
                          dpre_ptr, hw_ptr, part_ptr, stride_wt_t, stride_wt_k, stride_pre_s, stride_dpre_s,
                          stride_hw_s, stride_part_c, pre_smem.index(0), pre_smem.index(1),
                          CHUNK_N, BLOCK_M, BLOCK_N, mma, PREFETCH)
        if SPLIT_N == 2:
            if BLOCK_N >= 128:
                gl.thread_barrier()  # keeps the reload after the first epilogue (ptxas would hoist it)
                acc1 = acc1_smem.load(mma)
            _dh_epilogue_sm90(acc1, col0 + BLOCK_N, start, first, end, slot0, h, K, token_index_ptr, weights_ptr,
                              preact_ptr, dpre_ptr, hw_ptr, part_ptr, stride_wt_t, stride_wt_k, stride_pre_s,
                              stride_dpre_s, stride_hw_s, stride_part_c, pre_smem.index(2 if PREFETCH else 0),
                              pre_smem.index(3 if PREFETCH else 1), CHUNK_N, BLOCK_M, BLOCK_N, mma, PREFETCH)


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") not in ("", "0")


def supported(x: torch.Tensor, grad_y: torch.Tensor, preact: torch.Tensor, dpre: torch.Tensor, hw: torch.Tensor,
              down_strides: tuple[int, int], d: int, h: int, block_m: int, chunk: int,
              cfg: DhConfig = DEFAULT) -> bool:
    """Whether :func:`dh_sm90` takes this launch: Gluon present and switched on, an sm_90 device, 16-bit
    data, unit column strides, 16-byte aligned rows, sizes that tile evenly."""
    block_n, split_n, block_k = cfg[0], cfg[1], cfg[2]
    if not (_GLUON and enabled() and x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or block_m != 128:
        return False
    if d % block_k or h % (block_n * split_n) or block_n % chunk or min(down_strides) != 1:
        return False
    for t in (grad_y, preact, dpre, hw):
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return False
    return max(down_strides) % 8 == 0 and h % 8 == 0


def dh_sm90(grad_y, down_table, down_strides, w_align, weights, preact, dpre, hw, part, plan, win, slot0, slot1,
            d, h, K, chunk, cfg: DhConfig = DEFAULT) -> None:
    """Launch the Gluon dH' kernel over the row tiles of one slot window (arguments as ``expert_bwd``'s)."""
    block_n, split_n, block_k, stages, group_m, num_warps, prefetch, block_m = cfg
    stride_wd_d, stride_wd_n = down_strides
    grid = (win.num_tiles * (128 // block_m) * (h // (block_n * split_n)),)
    _expert_dh_sm90_kernel[grid](
        grad_y, down_table, weights, preact, dpre, hw, part,
        plan.token_index, plan.offsets, plan.tile_expert, plan.tile_start, win.tile0,
        win.num_tiles, plan.tile_expert.numel(), slot0, slot1, d, h, K,
        grad_y.stride(0), stride_wd_d, stride_wd_n, weights.stride(0), weights.stride(1),
        preact.stride(0), dpre.stride(0), hw.stride(0), part.stride(0),
        W_ALIGN=w_align, B_K_CONTIG=stride_wd_d == 1, CHUNK_N=chunk,
        BLOCK_M=block_m, PLAN_M=128, BLOCK_N=block_n, SPLIT_N=split_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m, PREFETCH=prefetch,
        num_warps=num_warps,
    )
