"""The per-expert weight-gradient GEMM for sm_90 in Gluon: persistent and warp-specialized ("ping-pong").

Same contract as ``expert_bwd._expert_dw_kernel`` for a launch that does not add into its output
(``ACCUMULATE=False`` and the window starting at slot 0): dW[e] = sum over e's slots s in [slot0, slot1) of
a[row_a(s)].T @ b[row_b(s)], one operand gathered through the token index (x or dy rows), the other in slot
order (dA, dB or w*H); experts with no slots there get zeros when they are this window's to write.

Why (benchmarks/NOTES-kernels.md): the Triton kernel runs one 8-warp CTA per SM, and each output tile's
pipeline fill and epilogue overlap no tensor-core work. At config C a dW launch is 1.05 ms against a 0.52 ms
floor, and an expert's contraction is only about 1024 slots (16 steps of 64). Here one program per SM walks
the output tiles with three partitions:

* a producer warpgroup gathers both operands' rows with cp.async into a ring of ``STAGES`` shared buffers
  (rows past the expert's segment are zero-filled), each thread arriving on the stage's "ready" barrier when
  its own copies land (``cp.async.mbarrier.arrive.noinc``: the barrier counts producer threads);
* two consumer warpgroups take the program's tiles in turn, each with one 128x128 fp32 accumulator. The ring
  is consumed in tile order, so one consumer's K loop runs while the other stores its tile: the epilogue
  and the next tile's fill overlap the MMA instead of following it.

Only for the GPU: Gluon has no interpreter, so the CPU tests cannot run it; :func:`supported` says when
``expert_bwd`` may use it. ``MOEBLAZE_GLUON_DW=0`` turns it off.
"""
from __future__ import annotations

import os

import torch

try:  # Gluon is experimental: its import (and API) may be missing from a Triton build
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    _GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    _GLUON = False

__all__ = ["ENV_VAR", "supported", "dw_sm90", "DEFAULT_STAGES"]

ENV_VAR = "MOEBLAZE_GLUON_DW"
BLOCK = 128  # output tile: BLOCK x BLOCK per consumer warpgroup
BLOCK_K = 64  # slots per pipeline stage
DEFAULT_STAGES = 6  # 32 KB a stage
_PRODUCER_THREADS = 128


if _GLUON:
    @gluon.jit
    def _dw_tile(tile, num_m, num_n, offsets_ptr, slot0, slot1, own_end, BLOCK_K: gl.constexpr):
        """(e, pid_m, pid_n, seg_lo, n_k, write) of one output tile; tiles run expert by expert, then by
        output row block, then column block."""
        per_e = num_m * num_n
        e = tile // per_e
        r = tile % per_e
        lo = gl.load(offsets_ptr + e)
        hi = gl.load(offsets_ptr + e + 1)
        seg_lo = gl.maximum(lo, slot0)
        seg_hi = gl.minimum(hi, slot1)
        n_k = gl.cdiv(gl.maximum(seg_hi - seg_lo, 0), BLOCK_K)
        write = (n_k > 0) | (lo < own_end)
        return e, r // num_n, r % num_n, seg_lo, seg_hi, n_k, write

    @gluon.jit
    def _dw_rows(token_index_ptr, slots, seg_hi, slot0, K, GATHER: gl.constexpr):
        """Row of each slot in its operand: the token (gathered) or the window's row; clamped past the end."""
        s = gl.minimum(slots, seg_hi - 1)
        if GATHER:
            return (gl.load(token_index_ptr + s) // K).to(gl.int64)
        return (s - slot0).to(gl.int64)

    @gluon.jit
    def _dw_producer(a_ptr, b_ptr, token_index_ptr, offsets_ptr, a_bufs, b_bufs, ready, empty,
                     num_tiles, num_m, num_n, K, slot0, slot1, own_end, stride_a_r, stride_b_r,
                     GATHER_A: gl.constexpr, GATHER_B: gl.constexpr, IDX_AHEAD: gl.constexpr,
                     BLOCK: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BLOCK_K, 128], 16 B per thread
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld))
        cs = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, ld))
        g = 0  # pipeline steps issued so far (all tiles of this program)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e, pid_m, pid_n, seg_lo, seg_hi, n_k, write = _dw_tile(tile, num_m, num_n, offsets_ptr, slot0, slot1,
                                                                    own_end, BLOCK_K)
            a_cols = a_ptr + (pid_m * BLOCK + cs)[None, :]
            b_cols = b_ptr + (pid_n * BLOCK + cs)[None, :]
            ra_next = _dw_rows(token_index_ptr, seg_lo + ks, seg_hi, slot0, K, GATHER_A)
            rb_next = _dw_rows(token_index_ptr, seg_lo + ks, seg_hi, slot0, K, GATHER_B)
            for k in range(n_k):
                slots = seg_lo + k * BLOCK_K + ks
                mask = (slots < seg_hi)[:, None]
                if IDX_AHEAD:  # this step's rows were loaded one step earlier; load the next step's now
                    ra = ra_next
                    rb = rb_next
                    ra_next = _dw_rows(token_index_ptr, slots + BLOCK_K, seg_hi, slot0, K, GATHER_A)
                    rb_next = _dw_rows(token_index_ptr, slots + BLOCK_K, seg_hi, slot0, K, GATHER_B)
                else:
                    ra = _dw_rows(token_index_ptr, slots, seg_hi, slot0, K, GATHER_A)
                    rb = _dw_rows(token_index_ptr, slots, seg_hi, slot0, K, GATHER_B)
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # the MMA that read it has finished
                cp.async_copy_global_to_shared(a_bufs.index(s), a_cols + ra[:, None] * stride_a_r, mask=mask)
                cp.async_copy_global_to_shared(b_bufs.index(s), b_cols + rb[:, None] * stride_b_r, mask=mask)
                cp.mbarrier_arrive(ready.index(s), increment_count=False)
                g += 1

    @gluon.jit
    def _dw_consumer(out_table_ptr, offsets_ptr, a_bufs, b_bufs, ready, empty, turn,
                     num_tiles, num_m, num_n, slot0, slot1, own_end, stride_o_m,
                     WHICH: gl.constexpr, OUT_FP32: gl.constexpr, O_ALIGN: gl.constexpr,
                     BLOCK: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK, 16])
        if OUT_FP32:
            out_ty: gl.constexpr = gl.float32
        else:
            out_ty: gl.constexpr = a_bufs.dtype
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma))
        g = 0  # pipeline steps of this program's tiles before the current one (both consumers')
        j = 0  # the current tile's index among this program's tiles
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            e, pid_m, pid_n, seg_lo, seg_hi, n_k, write = _dw_tile(tile, num_m, num_n, offsets_ptr, slot0, slot1,
                                                                    own_end, BLOCK_K)
            if j % 2 == WHICH:
                # Take turns: this tile's K loop starts once the other consumer's K loop of tile j - 1 has seen
                # all its stages. A waiter more than one phase ahead of an mbarrier reads its parity wrongly,
                # so without the turn this consumer could run ahead of the ring; with it, the two K loops
                # alternate and each epilogue runs beside the other consumer's K loop.
                mbarrier.wait(turn.index(1 - WHICH), ((j - 1) // 2) & 1, pred=j > 0)
                if write:
                    out_e = gl.load(out_table_ptr + e).to(gl.pointer_type(out_ty))
                    if O_ALIGN > 1:
                        out_e = gl.multiple_of(out_e, O_ALIGN)
                    if n_k > 0:
                        # Without the fact, the path that skips the loop joins the final wait with a zero-initialised
                        # accumulator, and ptxas serializes every wgmma (C7515; benchmarks/NOTES-kernels.md).
                        gl.assume(n_k > 0)
                        acc = gl.zeros([BLOCK, BLOCK], gl.float32, layout=mma)
                        for k in range(n_k):
                            s = (g + k) % STAGES
                            mbarrier.wait(ready.index(s), ((g + k) // STAGES) & 1)
                            fence_async_shared()  # cp.async wrote through the generic proxy, wgmma reads the async one
                            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, use_acc=k > 0,
                                                is_async=True)
                            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                            # the MMA of step k - 1 is done: its stage may be refilled
                            mbarrier.arrive(empty.index((g + k + STAGES - 1) % STAGES), pred=k > 0)
                        mbarrier.arrive(turn.index(WHICH))
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        mbarrier.arrive(empty.index((g + n_k - 1) % STAGES))
                        # offsets built from the tile's own indices here: hoisted out of the tile loop, the 128 of
                        # each thread stay live through it and spill
                        offs = (pid_m * BLOCK + rows)[:, None] * stride_o_m + (pid_n * BLOCK + cols)[None, :]
                        gl.store(out_e + offs, acc.to(out_ty))
                    else:  # no slots here: this window writes the expert's zeros
                        mbarrier.arrive(turn.index(WHICH))
                        offs = (pid_m * BLOCK + rows)[:, None] * stride_o_m + (pid_n * BLOCK + cols)[None, :]
                        gl.store(out_e + offs, gl.zeros([BLOCK, BLOCK], out_ty, layout=mma))
                else:
                    mbarrier.arrive(turn.index(WHICH))
            g += n_k
            j += 1

    @gluon.jit
    def _expert_dw_sm90_kernel(
        a_ptr,  # GATHER_A: [T, m_dim] at token rows (dy); else [slot1 - slot0, m_dim] slot rows (dA, dB)
        b_ptr,  # GATHER_A: [slot1 - slot0, n_dim] slot rows (w*H); else [T, n_dim] at token rows (x)
        out_table_ptr,  # [E] int64: dW[e] [m_dim, n_dim], row stride stride_o_m, unit column stride
        token_index_ptr, offsets_ptr,
        num_tiles, num_m, num_n, K, slot0, slot1, own_end,
        stride_a_r, stride_b_r, stride_o_m,
        GATHER_A: gl.constexpr, GATHER_B: gl.constexpr, IDX_AHEAD: gl.constexpr,
        OUT_FP32: gl.constexpr, O_ALIGN: gl.constexpr, BLOCK: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
    ):
        """grid = (min(SMs, num_tiles),), num_warps=4 (consumer 0) + 4 (consumer 1) + 4 (producer);
        m_dim = num_m * BLOCK, n_dim = num_n * BLOCK; unit column strides in a, b and dW[e]."""
        dtype: gl.constexpr = a_ptr.dtype.element_ty
        sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK], sl)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK], sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # consumer c's K loop done
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=128)  # one arrival per producer thread
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # Integer arguments equal to 1 arrive as Python ints, which a partition cannot take: make them tensors.
        num_tiles, num_m, num_n, K = gl.to_tensor(num_tiles), gl.to_tensor(num_m), gl.to_tensor(num_n), gl.to_tensor(K)
        slot0, slot1, own_end = gl.to_tensor(slot0), gl.to_tensor(slot1), gl.to_tensor(own_end)
        stride_a_r, stride_b_r, stride_o_m = gl.to_tensor(stride_a_r), gl.to_tensor(stride_b_r), gl.to_tensor(stride_o_m)
        gl.warp_specialize([
            (_dw_consumer, (out_table_ptr, offsets_ptr, a_bufs, b_bufs, ready, empty, turn, num_tiles, num_m, num_n, slot0,
                            slot1, own_end, stride_o_m, 0, OUT_FP32, O_ALIGN, BLOCK, BLOCK_K, STAGES)),
            (_dw_consumer, (out_table_ptr, offsets_ptr, a_bufs, b_bufs, ready, empty, turn, num_tiles, num_m, num_n, slot0,
                            slot1, own_end, stride_o_m, 1, OUT_FP32, O_ALIGN, BLOCK, BLOCK_K, STAGES)),
            (_dw_producer, (a_ptr, b_ptr, token_index_ptr, offsets_ptr, a_bufs, b_bufs, ready, empty, num_tiles,
                            num_m, num_n, K, slot0, slot1, own_end, stride_a_r, stride_b_r, GATHER_A, GATHER_B, IDX_AHEAD,
                            BLOCK, BLOCK_K, STAGES)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") not in ("", "0")


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def supported(a: torch.Tensor, b: torch.Tensor, m_dim: int, n_dim: int, out_dtype: torch.dtype,
              out_col_stride: int, adds: bool) -> bool:
    """Whether :func:`dw_sm90` takes this launch: Gluon present and switched on, an sm_90 device, 16-bit
    operands with unit column strides and 16-byte aligned rows, output sides multiples of 128 with unit
    column stride, and a launch
    that does not add into its output."""
    if adds or not (_GLUON and enabled() and a.is_cuda):
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return False
    if out_dtype not in (a.dtype, torch.float32) or m_dim % BLOCK or n_dim % BLOCK or out_col_stride != 1:
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def dw_sm90(a: torch.Tensor, b: torch.Tensor, gather_a: bool, out, token_index: torch.Tensor,
            offsets: torch.Tensor, K: int, window: tuple[int, int, int], out_align: int,
            stages: int = DEFAULT_STAGES, regs: tuple[int, int, int] = (168, 216, 72), idx_ahead: bool = True,
            gather_b: bool | None = None, block_k: int = BLOCK_K) -> None:
    """Launch over every output tile (``out``: a :class:`~.tables.WeightTable`); ``window`` = (slot0 == 0,
    slot1, own_end) as for the Triton kernel. ``regs`` = (kernel maxnreg, consumers, producer)."""
    slot0, slot1, own_end = window
    assert slot0 == 0, "the Gluon dW kernel never adds: windows after the first take the Triton kernel"
    E = out.ptrs.numel()
    num_m, num_n = out.rows // BLOCK, out.cols // BLOCK
    num_tiles = E * num_m * num_n
    if num_tiles == 0:
        return
    grid = (min(_sm_count(a.device), num_tiles),)
    maxnreg, consumer_regs, producer_regs = regs
    _expert_dw_sm90_kernel[grid](
        a, b, out.ptrs, token_index, offsets, num_tiles, num_m, num_n, K, slot0, slot1, own_end,
        a.stride(0), b.stride(0), out.stride_r,
        GATHER_A=gather_a, GATHER_B=(not gather_a) if gather_b is None else gather_b, IDX_AHEAD=idx_ahead,
        OUT_FP32=out.dtype == torch.float32 and a.dtype != torch.float32, O_ALIGN=out_align,
        BLOCK=BLOCK, BLOCK_K=block_k, STAGES=stages, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=maxnreg,
    )
