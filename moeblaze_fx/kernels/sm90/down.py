"""The down kernel for sm_90 (Hopper) in Gluon: persistent and warp-specialized, both operands through TMA.

Same contract as ``triton.down._expert_down_kernel`` for one slot window: for every routed slot of the window,
``out[slot] = a[slot, :k] @ B0[e] (+ a[slot, k:2k] @ B1[e]) (+ bias[e])``; forward Y = H @ W_down[e].T, backward
dX = dA @ W_gate[e] + dB @ W_up[e]. The two kernels compute each output element with the same tile (128 x 256),
the same 64-wide contraction steps in the same order and the same fp32 bias add, so their outputs are bitwise
equal (checked on the H100 by the cuda tests; docs/down.md).

Why: the down kernel is the one GEMM here whose operands are both plain row blocks (A: the window's slot rows;
B: an expert's weight matrix), so both can be copied by TMA, issued by one producer warp. The Triton kernel runs one
program per tile, and each tile's pipeline fill and epilogue run with no tensor-core work beside them. Here one
program per SM walks its tiles:

* a producer warp fills a ring of ``STAGES`` (A, B) shared buffers through TMA, running ahead into the next tile
  while the consumers finish the current one;
* the default partition (8 warps: two warpgroups of 64 rows) multiplies, then stores the tile: a full tile through
  shared memory and an asynchronous TMA store (waited for only before the next tile's store), a ragged one (an
  expert's last rows, or a tile cut by the window) through masked pointer stores.

H100, raw launches, same process (2026-11-22): Y / dX 10 % / 10 % faster at config C, 7 % / 6 % at D, 3 % / 10 %
at A (docs/down.md).

B is read through 2-D descriptors over each table's storage: expert e's matrix is rows ``e * e_rows ..`` of
``[rows, cols]`` with unit column stride, where ``[E, rows, cols]`` is the table's ``[E, k, n]`` view (n contiguous,
``kmajor`` False) or ``[E, n, k]`` view (k contiguous, ``kmajor`` True). Rows past an expert's own belong to the
next expert: with rows = n they only reach output columns past n, which are never stored; with rows = k they
would be summed in, so that layout needs k % 64 == 0. :func:`weights` says when a launch qualifies; everything
else takes the Triton kernel. Gluon has no interpreter, so the CPU tests cannot run this kernel; the cuda tests
compare it with the Triton kernel bit for bit. The kernel option ``gluon=False`` (``config.KernelOptions``) turns it
off, with the other Gluon kernels.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..launch import launch, sized
from ..program import Counter, bump
from . import common
from .common import GLUON

if GLUON:  # the Gluon names as common imported them
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

__all__ = ["Sm90Weights", "weights", "usable", "down_sm90", "launches"]

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64  # BLOCK_M is the plan's row tile
STAGES = 3  # 48 KB a stage; with the 64 KB output tile, 208 KB of shared memory
GROUP_M = 8  # row tiles sharing weight columns, as the Triton kernel
_PRODUCER_REGS = 40
_LAUNCHES = Counter()


if GLUON:
    @gluon.jit
    def _load_step(a_desc, b_desc, a_col, b_row, b_col, a_row, bar, a_buf, b_buf):
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [a_row, a_col], bar, a_buf)
        tma.async_copy_global_to_shared(b_desc, [b_row, b_col], bar, b_buf)

    @gluon.jit
    def _producer(a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, tile0_ptr, tile_expert_ptr, tile_start_ptr,
                  offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, e_rows0, e_rows1,
                  TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  BN: gl.constexpr, BK: gl.constexpr):
        tile0 = gl.load(tile0_ptr)
        n_k = gl.cdiv(k_dim, BK)
        g = 0  # steps issued so far, over all of this program's tiles
        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            e, start, first, end, pid_n = common.tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr,
                                                      tile_start_ptr, offsets_ptr, slot0, slot1, GROUP_M)
            if e >= 0:
                row = start - slot0  # negative for a tile cut by the window's start: TMA reads zeros there
                n0 = pid_n * BN
                for k in range(n_k):
                    s = g % STAGES
                    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the MMA that read it is done
                    if B_KMAJOR:
                        _load_step(a_desc, b0_desc, k * BK, e * e_rows0 + n0, k * BK, row, ready.index(s),
                                   a_bufs.index(s), b_bufs.index(s))
                    else:
                        _load_step(a_desc, b0_desc, k * BK, e * e_rows0 + k * BK, n0, row, ready.index(s),
                                   a_bufs.index(s), b_bufs.index(s))
                    g += 1
                if TWO_B:  # dX: A's second k columns against B1 (n contiguous only)
                    for k in range(n_k):
                        s = g % STAGES
                        mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
                        _load_step(a_desc, b1_desc, k_dim + k * BK, e * e_rows1 + k * BK, n0, row, ready.index(s),
                                   a_bufs.index(s), b_bufs.index(s))
                        g += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, c_smem, ready, empty, c_desc, c_ptr, bias_ptr, tile0_ptr, tile_expert_ptr,
                  tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, stride_c,
                  TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
        st: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # 16 bytes a thread along a row
        tile0 = gl.load(tile0_ptr)
        n_k = gl.cdiv(k_dim, BK)
        if TWO_B:
            steps = 2 * n_k
        else:
            steps = n_k
        g = 0  # steps consumed so far, over all of this program's tiles
        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            e, start, first, end, pid_n = common.tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr,
                                                      tile_start_ptr, offsets_ptr, slot0, slot1, GROUP_M)
            if e >= 0:
                # Without the fact, ptxas serializes every wgmma (H100; docs/kernels.md).
                gl.assume(steps > 0)
                acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                for k in range(steps):
                    s = g % STAGES
                    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                    if B_KMAJOR:
                        b = b_bufs.index(s).permute((1, 0))
                    else:
                        b = b_bufs.index(s)
                    acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=k > 0, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=k > 0)  # step k - 1's MMA is done
                    g += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES))
                if HAS_BIAS:
                    cols_b = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
                    bias = gl.load(bias_ptr + e.to(gl.int64) * n_dim + cols_b, mask=cols_b < n_dim, other=0.0)
                    acc += bias.to(gl.float32)[None, :]
                out = acc.to(c_smem.dtype)
                tma.store_wait(0)  # the previous tile's store has read c_smem
                c_smem.store(out)
                fence_async_shared()
                if (first == start) & (end - start == BM):
                    tma.async_copy_shared_to_global(c_desc, [start - slot0, pid_n * BN], c_smem)
                else:
                    v = c_smem.load(st)
                    rows = start + gl.arange(0, BM, layout=gl.SliceLayout(1, st))
                    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, st))
                    mask = ((rows >= first) & (rows < end))[:, None] & (cols < n_dim)[None, :]
                    gl.store(c_ptr + (rows - slot0).to(gl.int64)[:, None] * stride_c + cols[None, :], v, mask=mask)
        tma.store_wait(0)

    @sized(gluon.jit)
    def _expert_down_sm90_kernel(
        a_desc,  # [slot1 - slot0, k] (or [.., 2k] when TWO_B): the window's slot rows, block [BM, BK]
        b0_desc, b1_desc,  # B0 / B1 of every expert as 2-D row blocks (see the module doc); B1 = B0 unless TWO_B
        c_desc,  # [slot1 - slot0, n] out, block [BM, BN]
        c_ptr, bias_ptr,  # out (for ragged tiles); bias [E, n] contiguous when HAS_BIAS
        tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
        num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, e_rows0, e_rows1, stride_c,
        TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """grid = (min(SMs, num_m * num_n),), num_warps=8 (consumers) + 1 producer warp."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b0_desc.block_type.shape, b0_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        # Integer arguments equal to 1 arrive as Python ints, which a partition cannot take: make them tensors.
        num_m, num_n, tiles_total = gl.to_tensor(num_m), gl.to_tensor(num_n), gl.to_tensor(tiles_total)
        slot0, slot1 = gl.to_tensor(slot0), gl.to_tensor(slot1)
        k_dim, n_dim, stride_c = gl.to_tensor(k_dim), gl.to_tensor(n_dim), gl.to_tensor(stride_c)
        e_rows0, e_rows1 = gl.to_tensor(e_rows0), gl.to_tensor(e_rows1)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, c_smem, ready, empty, c_desc, c_ptr, bias_ptr, tile0_ptr, tile_expert_ptr,
                         tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, stride_c,
                         TWO_B, B_KMAJOR, HAS_BIAS, GROUP_M, STAGES, BM, BN, BK)),
            (_producer, (a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, tile0_ptr, tile_expert_ptr,
                         tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, e_rows0, e_rows1,
                         TWO_B, B_KMAJOR, GROUP_M, STAGES, BN, BK)),
        ], [1], [PRODUCER_REGS])


def launches() -> int:
    """How many times this process has launched the kernel (for tests)."""
    return _LAUNCHES.n


class Sm90Weights(NamedTuple):
    """The down kernel's B operand as this kernel reads it (:func:`weights`), resolved once per call."""

    descs: tuple  # Gluon descriptors of B0 and B1 (B0's again for one table)
    e_rows: tuple[int, int]  # rows from one expert's matrix to the next, in each descriptor
    kmajor: bool  # the descriptors' rows are n (k contiguous); else they are k (n contiguous)
    two_b: bool


def weights(b0: torch.Tensor, b1: torch.Tensor | None, kmajor: bool, k_dim: int) -> Sm90Weights | None:
    """This kernel's view of B0 (and B1 for dX), given as the ``[E, k, n]`` (``kmajor`` False) or ``[E, n, k]``
    (``kmajor`` True) views over which the host's tensor descriptors were built (unit last stride, 16-byte aligned
    base and strides: ``triton.common.weight_tma_mode``). None when the kernel cannot take them: Gluon missing or
    switched off, not an sm_90 device, not 16-bit, two tables with k contiguous, k % 64 with n contiguous, or
    experts that are not row blocks of one view."""
    if not common.takes(b0):
        return None
    if b0.dtype not in (torch.bfloat16, torch.float16) or (b1 is not None and (b1.dtype != b0.dtype or kmajor)):
        return None
    if k_dim <= 0 or (not kmajor and k_dim % BLOCK_K):
        return None
    block = [BLOCK_N, BLOCK_K] if kmajor else [BLOCK_K, BLOCK_N]
    got = common.row_block_descs([b0, b1 if b1 is not None else b0], block)
    return None if got is None else Sm90Weights(*got, kmajor, b1 is not None)


def usable(a: torch.Tensor, out: torch.Tensor, block_m: int) -> bool:
    """Whether the window's ``a`` (slot rows) and ``out`` can be read and written through TMA here: unit column
    strides, 16-byte aligned bases and row strides, out of a's dtype, and plan row tiles of ``BLOCK_M``."""
    return block_m == BLOCK_M and out.dtype == a.dtype and common.rows_ok(a) and common.rows_ok(out)


def down_sm90(a: torch.Tensor, w: Sm90Weights, k_dim: int, n_dim: int, plan, out: torch.Tensor,
              bias: torch.Tensor | None, window) -> torch.Tensor:
    """``triton.down.down_project`` through this kernel (``w`` from :func:`weights`, ``usable(a, out, ..)`` true)."""
    a_view = a[:, :2 * k_dim] if w.two_b else a[:, :k_dim]  # columns past the view read as zeros
    a_desc = GluonDescriptor.from_tensor(a_view, [BLOCK_M, BLOCK_K], common.layout([BLOCK_M, BLOCK_K], a.dtype))
    c_desc = GluonDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N], common.layout([BLOCK_M, BLOCK_N], out.dtype))
    num_n = -(-n_dim // BLOCK_N)
    grid = (min(common.sm_count(a.device), window.num_tiles * num_n),)
    launch(
        _expert_down_sm90_kernel, grid,
        a_desc, *w.descs, c_desc, out, bias if bias is not None else out, window.tile0, plan.tile_expert,
        plan.tile_start, plan.offsets, window.num_tiles, num_n, plan.tile_expert.numel(), window.slot0, window.slot1,
        k_dim, n_dim, *w.e_rows, out.stride(0),
        TWO_B=w.two_b, B_KMAJOR=w.kmajor, HAS_BIAS=bias is not None, GROUP_M=GROUP_M, STAGES=STAGES,
        PRODUCER_REGS=_PRODUCER_REGS, num_warps=8,
    )
    bump(_LAUNCHES)
    return out
