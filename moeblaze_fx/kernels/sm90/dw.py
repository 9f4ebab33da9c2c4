"""The weight-gradient kernel for sm_90 (Hopper) in Gluon: persistent and warp-specialized, the down kernel's structure
(:mod:`.down`) with a gathering producer.

Same contract as ``triton.dw._expert_dw_kernel`` for 16-bit operands and a 16-bit output: for one slot window,
``dW[e] (+)= sum over e's slots s in the window of a[token(s)].T @ b[s - slot0]``, written through a table. An expert
whose slots start in this window (or one with no slots that is this window's to write) gets the contribution (zeros
when it has no slots here); one whose slots started in an earlier window, or every expert with slots when
accumulating, starts from its stored value. Each output element sums the same products in the same order as the
Triton kernel (one fp32 accumulator, 64 slots a step, starting from the stored value when adding), so the two are
bitwise equal (checked on the H100 by the cuda tests; docs/dw.md).

One program per SM walks the output tiles (128 rows of ``a``'s columns x 256 of ``b``'s), expert by expert:

* one producer warpgroup fills two rings: ``A_STAGES`` of ``a``'s 64 token rows, gathered with cp.async (zeros past
  the expert's end; the token indices loaded one step ahead), and ``B_STAGES`` of ``b``'s 64 slot rows through TMA.
  A step's rows are gathered as soon as their stage is free, before the producer waits for ``b``'s stage, so the
  gather runs one step further ahead than the TMA copies. Each producer thread arrives on the A stage's barrier when
  its copies land, the TMA copy completes the B stage's;
* the default partition (8 warps, two warpgroups of 64 rows) multiplies, then writes the tile to shared memory and
  from there to the output. Where the table addresses one ``[E, r, c]`` tensor whose experts are row blocks of one
  2-D view (``STORE_TMA``: Hugging Face's and every stacked layout), the tile leaves through an asynchronous TMA
  store, waited for only before the next tile's, and so overlaps the next tile's contraction; for a transposed table
  (``O_COL``, as dW_gate and dW_up are) the shared tile is [n, m], written with transposing stmatrix. Otherwise (a
  table of separate tensors: ``ModuleList`` experts) it is read back and stored with 16-byte pointer stores along the
  output's contiguous axis.

An expert's last step, when ragged, copies ``b``'s rows with cp.async too, as zeros past the expert's end (the
rows there belong to the next expert, or are unrouted slots that nothing writes), as the Triton kernel masks them;
those copies land under the A stage's barrier.

H100, raw launches, same process (2026-11-22): 10-12 % faster at config C, 6-7 % at D, 1-3 % at A
(docs/dw.md). :func:`usable` says when a launch qualifies; everything else takes the
Triton kernel. Gluon has no interpreter, so the CPU tests cannot run this kernel. The kernel option ``gluon=False``
turns it off (``common.enabled``).
"""
from __future__ import annotations

import torch

from ..launch import launch, sized
from ..program import Counter, bump
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

__all__ = ["usable", "dw_sm90", "launches", "store_launches"]

TILE = (128, 256, 64)  # (rows of a's columns, columns of b, slots a step)
# a's 16 KB and b's 32 KB stages: with the 64 KB output tile, 224 KB of shared memory (a fourth stage of the
# gathered operand, as in gather)
A_STAGES, B_STAGES = 4, 3
GROUP_M = 8
_PRODUCER_REGS = 96
_LAUNCHES = Counter()
_STORE_LAUNCHES = Counter()  # launches whose tiles left through TMA stores


if GLUON:
    BM: gl.constexpr = gl.constexpr(TILE[0])
    BN: gl.constexpr = gl.constexpr(TILE[1])
    BK: gl.constexpr = gl.constexpr(TILE[2])

    @gluon.jit
    def _tile(t, num_m, num_n, offsets_ptr, slot0, slot1, own_end, ACCUMULATE: gl.constexpr,
              GROUP_M: gl.constexpr):
        """(e, pid_m, pid_n, seg_lo, seg_hi, n_k, write, add) of output tile ``t``: expert by expert, then in the
        Triton kernel's grouped order; ``write``: this launch stores the tile; ``add``: it starts from the stored
        value."""
        per_e = num_m * num_n
        e = t // per_e
        pid_m, pid_n = common.grouped_ids(t % per_e, num_m, num_n, GROUP_M)
        lo = gl.load(offsets_ptr + e)
        hi = gl.load(offsets_ptr + e + 1)
        seg_lo = gl.maximum(lo, slot0)
        seg_hi = gl.minimum(hi, slot1)
        n_k = gl.cdiv(gl.maximum(seg_hi - seg_lo, 0), BK)
        if ACCUMULATE:
            write = n_k > 0
            add = write
        else:
            add = lo < slot0  # e's slots started in an earlier window
            write = (n_k > 0) | ((lo >= slot0) & (lo < own_end))
        return e, pid_m, pid_n, seg_lo, seg_hi, n_k, write, add

    @gluon.jit
    def _producer(a_ptr, b_ptr, b_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty_a, empty_b,
                  offsets_ptr, num_tiles, num_m, num_n, m_dim, n_dim, slot0, slot1, own_end, K: gl.constexpr,
                  stride_a, stride_b, ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr, SA: gl.constexpr,
                  SB: gl.constexpr):
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BK, BM]: 16 bytes a thread
        ks = gl.arange(0, BK, layout=gl.SliceLayout(1, ld))
        cs = gl.arange(0, BM, layout=gl.SliceLayout(0, ld))
        ldb: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [BK, BN]
        ksb = gl.arange(0, BK, layout=gl.SliceLayout(1, ldb))
        csb = gl.arange(0, BN, layout=gl.SliceLayout(0, ldb))
        g = 0  # steps issued so far, over all of this program's tiles
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e, pid_m, pid_n, seg_lo, seg_hi, n_k, write, add = _tile(t, num_m, num_n, offsets_ptr, slot0, slot1,
                                                                     own_end, ACCUMULATE, GROUP_M)
            cols = a_ptr + (pid_m * BM + cs)[None, :]
            in_m = (pid_m * BM + cs < m_dim)[None, :]  # a's columns past m_dim: zeros (and no read past a's end)
            last = gl.maximum(seg_hi - 1, 0)
            nxt = gl.load(token_index_ptr + gl.minimum(seg_lo + ks, last)) // K
            for k in range(n_k):
                slots = seg_lo + k * BK + ks
                rows = nxt
                nxt = gl.load(token_index_ptr + gl.minimum(slots + BK, last)) // K  # the next step's, ahead
                sa = g % SA
                sb = g % SB
                mbarrier.wait(empty_a.index(sa), ((g // SA) & 1) ^ 1)  # the MMA that read the stage is done
                if seg_lo + (k + 1) * BK <= seg_hi:
                    cp.async_copy_global_to_shared(a_bufs.index(sa), cols + rows.to(gl.int64)[:, None] * stride_a,
                                                   mask=(slots < seg_hi)[:, None] & in_m)
                    cp.mbarrier_arrive(ready_a.index(sa), increment_count=False)
                    mbarrier.wait(empty_b.index(sb), ((g // SB) & 1) ^ 1)
                    # (b's columns past n_dim: zeros, the descriptor's bounds)
                    mbarrier.expect(ready_b.index(sb), b_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(b_desc, [seg_lo - slot0 + k * BK, pid_n * BN], ready_b.index(sb),
                                                    b_bufs.index(sb))
                else:  # the expert's ragged last step: b's rows past its end may be anything (unrouted slots are
                    # never written), so they are copied as zeros too, with a's, under ready_a
                    mbarrier.wait(empty_b.index(sb), ((g // SB) & 1) ^ 1)
                    mbarrier.arrive(ready_b.index(sb))
                    rb = seg_lo + k * BK + ksb
                    cb = pid_n * BN + csb
                    cp.async_copy_global_to_shared(
                        b_bufs.index(sb), b_ptr + (rb - slot0).to(gl.int64)[:, None] * stride_b + cb[None, :],
                        mask=(rb < seg_hi)[:, None] & (cb < n_dim)[None, :])
                    cp.async_copy_global_to_shared(a_bufs.index(sa), cols + rows.to(gl.int64)[:, None] * stride_a,
                                                   mask=(slots < seg_hi)[:, None] & in_m)
                    cp.mbarrier_arrive(ready_a.index(sa), increment_count=False)
                g += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, c_smem, ready_a, ready_b, empty_a, empty_b, out_table_ptr, c_desc, e_rows,
                  offsets_ptr, num_tiles, num_m, num_n, m_dim, n_dim, slot0, slot1, own_end, stride_o_m, stride_o_n,
                  ACCUMULATE: gl.constexpr, MAY_ADD: gl.constexpr, O_COL: gl.constexpr, STORE_TMA: gl.constexpr,
                  GROUP_M: gl.constexpr, SA: gl.constexpr, SB: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
        if O_COL:  # 16 bytes a thread down a column
            st: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 8], [0, 1])
        else:  # 16 bytes a thread along a row
            st: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        dtype: gl.constexpr = c_smem.dtype
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, st))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, st))
        g = 0  # steps consumed so far, over all of this program's tiles
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e, pid_m, pid_n, seg_lo, seg_hi, n_k, write, add = _tile(t, num_m, num_n, offsets_ptr, slot0, slot1,
                                                                     own_end, ACCUMULATE, GROUP_M)
            if write:
                out_e = gl.multiple_of(gl.load(out_table_ptr + e).to(gl.pointer_type(dtype)), 16)
                if n_k > 0:
                    gl.assume(n_k > 0)  # else ptxas serializes every wgmma (H100; docs/kernels.md)
                    if MAY_ADD:  # start from the stored value where adding (zeros elsewhere), as the Triton kernel
                        rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
                        cn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
                        ok = ((rm < m_dim)[:, None] & (cn < n_dim)[None, :]) & add
                        acc = gl.load(out_e + (rm[:, None] * stride_o_m + cn[None, :] * stride_o_n), mask=ok,
                                      other=0.0).to(gl.float32)
                    else:
                        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                    for k in range(n_k):
                        sa = g % SA
                        sb = g % SB
                        mbarrier.wait(ready_a.index(sa), (g // SA) & 1)
                        mbarrier.wait(ready_b.index(sb), (g // SB) & 1)
                        fence_async_shared()  # cp.async wrote A through the generic proxy; wgmma reads the async one
                        acc = warpgroup_mma(a_bufs.index(sa).permute((1, 0)), b_bufs.index(sb), acc,
                                            use_acc=(k > 0) | MAY_ADD, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                        common.release(empty_a, empty_b, g - 1, SA, SB, k > 0)  # step k - 1's MMA is done
                        g += 1
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    common.release(empty_a, empty_b, g - 1, SA, SB, True)
                    tile = acc.to(dtype)
                else:  # no slots here: this window writes the expert's zeros
                    tile = gl.zeros([BM, BN], dtype, layout=mma)
                if STORE_TMA:  # the tile leaves through an asynchronous TMA store, waited for before the next tile's
                    tma.store_wait(0)  # the previous tile's store has read c_smem
                    if O_COL:  # c_smem is [BN, BM], m contiguous as in the output
                        c_smem.permute((1, 0)).store(tile)
                        fence_async_shared()
                        tma.async_copy_shared_to_global(c_desc, [e * e_rows + pid_n * BN, pid_m * BM], c_smem)
                    else:
                        c_smem.store(tile)
                        fence_async_shared()
                        tma.async_copy_shared_to_global(c_desc, [e * e_rows + pid_m * BM, pid_n * BN], c_smem)
                else:
                    c_smem.store(tile)
                    v = c_smem.load(st)
                    # int32 offsets inside the expert's matrix, built from the tile's indices here: loop-invariant
                    # ones are hoisted out of the tile loop, stay live through it and spill (as 64-bit ones do)
                    r = pid_m * BM + rows
                    c = pid_n * BN + cols
                    gl.store(out_e + (r[:, None] * stride_o_m + c[None, :] * stride_o_n), v,
                             mask=(r < m_dim)[:, None] & (c < n_dim)[None, :])
        tma.store_wait(0)

    @sized(gluon.jit)
    def _expert_dw_sm90_kernel(
        a_ptr,  # [T, m_dim] read at row token(s): dy or x; unit column stride
        b_ptr, b_desc,  # [slot1 - slot0, n_dim]: the window's slot rows of w*H, dA or dB; descriptor, block [BK, BN]
        out_table_ptr,  # [E] int64: dW[e] [m_dim, n_dim] via (stride_o_m, stride_o_n), a's dtype, 16-byte aligned
        c_desc,  # with STORE_TMA: dW as 2-D row blocks, expert e's [m, n] (or, O_COL, [n, m]) at rows e * e_rows ..;
        # block [BM, BN] (O_COL: [BN, BM]); else out_table_ptr again, unused
        e_rows,
        token_index_ptr, offsets_ptr,
        num_tiles, num_m, num_n, m_dim, n_dim,
        K: gl.constexpr,  # a compile-time constant: the producer divides 64 pairs by it every step
        slot0, slot1, own_end, stride_a, stride_b, stride_o_m, stride_o_n,
        ACCUMULATE: gl.constexpr, MAY_ADD: gl.constexpr, O_COL: gl.constexpr, STORE_TMA: gl.constexpr,
        GROUP_M: gl.constexpr, A_STAGES: gl.constexpr, B_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """grid = (min(SMs, num_tiles),), num_warps=8 (consumers) + a 4-warp producer."""
        dtype: gl.constexpr = b_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [A_STAGES, BK, BM],
                                           gl.NVMMASharedLayout.get_default_for([BK, BM], dtype))
        b_bufs = gl.allocate_shared_memory(dtype, [B_STAGES] + b_desc.block_type.shape, b_desc.layout)
        if STORE_TMA:
            c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        else:
            if O_COL:  # m contiguous in shared memory too: the stores read 16-byte vectors along m
                c_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])
            else:
                c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
            c_smem = gl.allocate_shared_memory(dtype, [BM, BN], c_layout)
        ready_a, empty_a = common.ring_barriers(A_STAGES, 128)
        ready_b, empty_b = common.ring_barriers(B_STAGES, 1)
        # Integer arguments equal to 1 arrive as Python ints, which a partition cannot take: make them tensors.
        num_tiles, num_m, num_n = gl.to_tensor(num_tiles), gl.to_tensor(num_m), gl.to_tensor(num_n)
        m_dim, n_dim = gl.to_tensor(m_dim), gl.to_tensor(n_dim)
        slot0, slot1, own_end = gl.to_tensor(slot0), gl.to_tensor(slot1), gl.to_tensor(own_end)
        stride_a, stride_b = gl.to_tensor(stride_a), gl.to_tensor(stride_b)
        stride_o_m, stride_o_n, e_rows = gl.to_tensor(stride_o_m), gl.to_tensor(stride_o_n), gl.to_tensor(e_rows)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, c_smem, ready_a, ready_b, empty_a, empty_b, out_table_ptr, c_desc, e_rows,
                         offsets_ptr, num_tiles, num_m, num_n, m_dim, n_dim, slot0, slot1, own_end, stride_o_m,
                         stride_o_n, ACCUMULATE, MAY_ADD, O_COL, STORE_TMA, GROUP_M, A_STAGES, B_STAGES)),
            (_producer, (a_ptr, b_ptr, b_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty_a, empty_b,
                         offsets_ptr, num_tiles, num_m, num_n, m_dim, n_dim, slot0, slot1, own_end, K, stride_a,
                         stride_b, ACCUMULATE, GROUP_M, A_STAGES, B_STAGES)),
        ], [4], [PRODUCER_REGS])


def launches() -> int:
    """How many times this process has launched the kernel (for tests)."""
    return _LAUNCHES.n


def store_launches() -> int:
    """How many of those launches stored their tiles through TMA (for tests)."""
    return _STORE_LAUNCHES.n


def usable(tokens: torch.Tensor, slots: torch.Tensor, out, out_align: int) -> bool:
    """Whether this kernel may take a dW launch: Gluon present and switched on, an sm_90 device, 16-bit operands and
    output of one dtype, 16-byte aligned rows with unit column strides in both operands, and an output table
    (``out``, a :class:`~.tables.WeightTable`) of [rows, cols] multiples of 16, with one unit stride, the other a
    multiple of 16 bytes, and 16-byte aligned matrices. Tiles past the matrix's rows or columns read zeros and store
    only what is inside it."""
    if not common.takes(tokens):
        return False
    if tokens.dtype not in (torch.bfloat16, torch.float16) or slots.dtype != tokens.dtype or out.dtype != tokens.dtype:
        return False
    if slots.numel() == 0 or not (common.rows_ok(tokens) and common.rows_ok(slots)) or out_align < 16:
        return False
    return table_ok(out)


def table_ok(out) -> bool:
    """:func:`usable`'s conditions on the output table: [rows, cols] multiples of 16 (the compiler then knows that
    the masks of the copies past them are whole 16-byte vectors: at d = 200 the 2-byte copies they would need failed
    Triton 3.6's lowering, H100), one unit stride, the other a multiple of 16 bytes, and every element's offset inside
    an expert's matrix below 2**31 (the kernel computes them in 32 bits: a table over a ``[d, E * 2h]`` weight, viewed
    ``[E, 2h, d]``, has a row stride of E * 2h and can pass it; the Triton kernel, in 64 bits, takes those)."""
    if out.rows % 16 or out.cols % 16:
        return False
    if (out.rows - 1) * abs(out.stride_r) + (out.cols - 1) * abs(out.stride_c) >= 2 ** 31:
        return False
    item = out.dtype.itemsize
    return (out.stride_c == 1 and (out.stride_r * item) % 16 == 0) or (out.stride_r == 1 and
                                                                       (out.stride_c * item) % 16 == 0)


def _store_desc(out):
    """(descriptor, e_rows) through which the kernel stores dW tiles with TMA, or None: the output table must address
    one ``[E, m, n]`` tensor (``out.dense``) whose experts are row blocks of one 2-D view, rows along m (n contiguous)
    or, for a transposed table (``O_COL``), along n (m contiguous), a whole number of tiles along them (a store
    clips at the view's columns, which are the matrix's, but a tile past an expert's last row would land in the next
    expert's). Alignment is :func:`usable`'s."""
    col = out.stride_c != 1
    if out.dense is None or (out.cols % TILE[1] if col else out.rows % TILE[0]):
        return None
    rv = common.rows_view(out.dense.transpose(1, 2) if col else out.dense)
    if rv is None:
        return None
    block = [TILE[1], TILE[0]] if col else [TILE[0], TILE[1]]
    return GluonDescriptor.from_tensor(rv[0], block, common.layout(block, out.dtype)), rv[1]


def dw_sm90(tokens: torch.Tensor, slots: torch.Tensor, out, plan, K: int, accumulate: bool,
            window: tuple[int, int, int]) -> None:
    """``triton.dw.weight_grad`` through this kernel (:func:`usable` true)."""
    slot0, slot1, own_end = window
    E, m_dim, n_dim = out.ptrs.numel(), out.rows, out.cols
    layout = common.layout([TILE[2], TILE[1]], slots.dtype)
    b_desc = GluonDescriptor.from_tensor(slots, [TILE[2], TILE[1]], layout)
    store = _store_desc(out)
    c_desc, e_rows = store if store is not None else (out.ptrs, 0)
    num_m, num_n = -(-m_dim // TILE[0]), -(-n_dim // TILE[1])
    num_tiles = E * num_m * num_n
    launch(
        _expert_dw_sm90_kernel, (min(common.sm_count(tokens.device), num_tiles),),
        tokens, slots, b_desc, out.ptrs, c_desc, e_rows, plan.token_index, plan.offsets, num_tiles, num_m, num_n,
        m_dim, n_dim, K, slot0, slot1, own_end, tokens.stride(0), slots.stride(0), out.stride_r, out.stride_c,
        ACCUMULATE=accumulate, MAY_ADD=accumulate or slot0 > 0, O_COL=out.stride_c != 1, STORE_TMA=store is not None,
        GROUP_M=GROUP_M, A_STAGES=A_STAGES, B_STAGES=B_STAGES, PRODUCER_REGS=_PRODUCER_REGS, num_warps=8,
    )
    bump(_LAUNCHES)
    bump(_STORE_LAUNCHES, int(store is not None))
