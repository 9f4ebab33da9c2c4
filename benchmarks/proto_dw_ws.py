#!/usr/bin/env python3
"""Prototype, not wired in: the weight-gradient kernel (``expert_bwd._expert_dw_kernel``) as a persistent,
warp-specialized Gluon kernel for sm_90 with the down kernel's structure (``kernels/down_sm90.py``), checked and
timed against the Triton kernel in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/proto_dw_ws.py OUTDIR

dW[e] = sum over e's slots s of a[token(s)].T @ b[s]: a gathered (dy or x rows), b in slot order (w*H, dA or dB).
One cooperative 128x256 tile per step of 64 slots, as the down kernel, with two producers:

* one producer warpgroup: TMA copies b's 64 slot rows (rows past the expert's end belong to the next expert; the
  matching rows of a are zero, so they add nothing while they are finite), and cp.async gathers a's 64 token rows,
  the token indices loaded one step ahead, zeros past the expert's end; each thread arrives on the stage's A
  barrier when its copies land.

Scope of the prototype: the first window's launch (no adding into the output), 16-bit output, m and n multiples of
the tile. Output stored through shared memory, row-major or column-major (``O_COL``).

Writes OUTDIR/proto_dw_ws.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc

TILE = (128, 256, 64)  # host side
BM, BN, BK = (gl.constexpr(v) for v in TILE)  # inside kernels


@gluon.jit
def _tile(t, num_m, num_n, offsets_ptr, slot0, slot1, own_end, GROUP_M: gl.constexpr):
    per_e = num_m * num_n
    e = t // per_e
    r = t % per_e
    in_group = GROUP_M * num_n
    first_m = (r // in_group) * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (r % in_group) % size
    pid_n = (r % in_group) // size
    lo = gl.load(offsets_ptr + e)
    hi = gl.load(offsets_ptr + e + 1)
    seg_lo = gl.maximum(lo, slot0)
    seg_hi = gl.minimum(hi, slot1)
    n_k = gl.cdiv(gl.maximum(seg_hi - seg_lo, 0), BK)
    write = (n_k > 0) | (lo < own_end)
    return e, pid_m, pid_n, seg_lo, seg_hi, n_k, write


@gluon.jit
def _producer(a_ptr, b_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty, offsets_ptr, num_tiles, num_m,
              num_n, slot0, slot1, own_end, K, stride_a, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: b's slot rows through TMA (one thread issues), a's token rows gathered with cp.async (every
    thread, each arriving on ready_a when its copies land); token indices loaded one step ahead."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BK, BM]: 16 B per thread
    ks = gl.arange(0, BK, layout=gl.SliceLayout(1, ld))
    cs = gl.arange(0, BM, layout=gl.SliceLayout(0, ld))
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, pid_m, pid_n, seg_lo, seg_hi, n_k, write = _tile(t, num_m, num_n, offsets_ptr, slot0, slot1, own_end,
                                                            GROUP_M)
        cols = a_ptr + (pid_m * BM + cs)[None, :]
        last = gl.maximum(seg_hi - 1, 0)
        nxt = gl.load(token_index_ptr + gl.minimum(seg_lo + ks, last)) // K
        for k in range(n_k):
            slots = seg_lo + k * BK + ks
            rows = nxt
            nxt = gl.load(token_index_ptr + gl.minimum(slots + BK, last)) // K  # the next step's, ahead
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready_b.index(s), b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [seg_lo - slot0 + k * BK, pid_n * BN], ready_b.index(s),
                                            b_bufs.index(s))
            cp.async_copy_global_to_shared(a_bufs.index(s), cols + rows.to(gl.int64)[:, None] * stride_a,
                                           mask=(slots < seg_hi)[:, None])
            cp.mbarrier_arrive(ready_a.index(s), increment_count=False)
            g += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, c_smem, ready_a, ready_b, empty, out_table_ptr, offsets_ptr, num_tiles, num_m, num_n,
              slot0, slot1, own_end, stride_o_m, stride_o_n, O_COL: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
    if O_COL:  # m contiguous in the output: 16 B a thread down a column
        st: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 8], [0, 1])
    else:
        st: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    dtype: gl.constexpr = c_smem.dtype
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, st))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, st))
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, pid_m, pid_n, seg_lo, seg_hi, n_k, write = _tile(t, num_m, num_n, offsets_ptr, slot0, slot1, own_end,
                                                            GROUP_M)
        if write:
            out_e = gl.load(out_table_ptr + e).to(gl.pointer_type(dtype))
            out_e = gl.multiple_of(out_e, 16)
            if n_k > 0:
                gl.assume(n_k > 0)  # else ptxas serializes every wgmma
                acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                for k in range(n_k):
                    s = g % STAGES
                    mbarrier.wait(ready_a.index(s), (g // STAGES) & 1)
                    mbarrier.wait(ready_b.index(s), (g // STAGES) & 1)
                    fence_async_shared()  # cp.async wrote A through the generic proxy; wgmma reads the async one
                    acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, use_acc=k > 0,
                                        is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=k > 0)
                    g += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES))
                c_smem.store(acc.to(dtype))
                # int32 offsets inside the expert's matrix, built from the tile's indices here: loop-invariant ones
                # are hoisted out of the tile loop, stay live through it and spill (as 64-bit ones do)
                offs = (pid_m * BM + rows)[:, None] * stride_o_m + (pid_n * BN + cols)[None, :] * stride_o_n
                gl.store(out_e + offs, c_smem.load(st))
            else:  # no slots here: this window writes the expert's zeros
                offs = (pid_m * BM + rows)[:, None] * stride_o_m + (pid_n * BN + cols)[None, :] * stride_o_n
                gl.store(out_e + offs, gl.zeros([BM, BN], dtype, layout=st))


@gluon.jit
def _dw_ws_kernel(a_ptr, b_desc, out_table_ptr, token_index_ptr, offsets_ptr, num_tiles, num_m, num_n, K, slot0,
                  slot1, own_end, stride_a, stride_o_m, stride_o_n, O_COL: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = b_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BM], dtype)
    if O_COL:  # m contiguous in shared memory too, so the column-major store reads 16 B vectors along m
        c_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])
    else:
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BM], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], c_layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_a.index(i), count=128)  # one arrival per gathering thread
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    num_tiles, num_m, num_n, K = gl.to_tensor(num_tiles), gl.to_tensor(num_m), gl.to_tensor(num_n), gl.to_tensor(K)
    slot0, slot1, own_end = gl.to_tensor(slot0), gl.to_tensor(slot1), gl.to_tensor(own_end)
    stride_a, stride_o_m, stride_o_n = gl.to_tensor(stride_a), gl.to_tensor(stride_o_m), gl.to_tensor(stride_o_n)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, c_smem, ready_a, ready_b, empty, out_table_ptr, offsets_ptr, num_tiles, num_m,
                     num_n, slot0, slot1, own_end, stride_o_m, stride_o_n, O_COL, GROUP_M, STAGES)),
        (_producer, (a_ptr, b_desc, token_index_ptr, a_bufs, b_bufs, ready_a, ready_b, empty, offsets_ptr, num_tiles,
                     num_m, num_n, slot0, slot1, own_end, K, stride_a, GROUP_M, STAGES)),
    ], [4], [PRODUCER_REGS])


_SMS = {}


def dw_ws(a, b, out_table, m_dim, n_dim, plan, K, window, stages=3, group_m=8, producer_regs=96):
    """dW[e] = sum over e's slots in window (slot0 == 0 only) of a[token].T @ b[slot - slot0], through the table."""
    slot0, slot1, own_end = window
    assert slot0 == 0 and m_dim % TILE[0] == 0 and n_dim % TILE[1] == 0
    E = out_table.ptrs.numel()
    dt = gl.bfloat16 if b.dtype == torch.bfloat16 else gl.float16
    b_desc = GluonDesc.from_tensor(b, [TILE[2], TILE[1]], gl.NVMMASharedLayout.get_default_for([TILE[2], TILE[1]], dt))
    num_m, num_n = m_dim // TILE[0], n_dim // TILE[1]
    num_tiles = E * num_m * num_n
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    sms = _SMS.setdefault(dev, torch.cuda.get_device_properties(dev).multi_processor_count)
    o_col = out_table.stride_r == 1
    _dw_ws_kernel[(min(sms, num_tiles),)](
        a, b_desc, out_table.ptrs, plan.token_index, plan.offsets, num_tiles, num_m, num_n, K, slot0, slot1, own_end,
        a.stride(0), out_table.stride_r, out_table.stride_c, O_COL=o_col, GROUP_M=group_m, STAGES=stages,
        PRODUCER_REGS=producer_regs, num_warps=8)


T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def main(outdir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expert_device as ed
    from moeblaze_fx.kernels import expert_bwd, expert_fwd
    ed.DISPATCH, ed.DISPATCH_NOTE = ed.pick_dispatch()

    os.makedirs(outdir, exist_ok=True)
    rows = []
    path = os.path.join(outdir, "proto_dw_ws.json")

    def dump():
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           commit=os.environ.get("MB_COMMIT", ""), rows=rows), f, indent=1)

    def setup(T, d, h, E, K, ids_mode, seed=0):
        inp = ed.make_inputs(T, d, h, E, K, ids_mode=ids_mode, seed=seed)
        plan = ed.dispatch_with_fallback(inp["ids"], E, expert_fwd.plan_block_m())
        N = T * K
        g = torch.Generator(device="cuda").manual_seed(seed + 7)
        hw = torch.randn(N, h, device="cuda", generator=g).to(torch.bfloat16)
        dab = torch.randn(N, 2 * h, device="cuda", generator=g).to(torch.bfloat16)
        return inp, plan, hw, dab

    def cases(inp, hw, dab):
        """(name, gathered, slots, out [E, m, n] storage view maker): dW_down = dy[tok].T @ w*H into [E, d, h];
        dW_gate.T = x[tok].T @ dA into the transpose of [E, h, d] (column-major)."""
        x, gy = inp["x"], inp["grad_y"]
        E, d = inp["E"], x.shape[1]
        h = hw.shape[1]
        return [("dW_down", gy, hw, lambda: torch.empty(E, d, h, device="cuda", dtype=x.dtype), False),
                ("dW_gate", x, dab[:, :h], lambda: torch.empty(E, h, d, device="cuda", dtype=x.dtype), True)]

    def table_for(store, transposed):
        t = ed.table(store)
        if transposed:  # [E, h, d] storage read as [E, d, h]
            t = t._replace(rows=t.cols, cols=t.rows, stride_r=t.stride_c, stride_c=t.stride_r)
        return t

    def triton_dw(a, b, table, plan, K):
        N = b.shape[0]
        expert_bwd._weight_grad(a, b, table, plan, K, False, (0, N, N + 1))

    shapes = [(1000, 256, 256, 8, 4, "empty_expert"), (700, 256, 512, 4, 2, "one_expert"),
              (4099, 1024, 768, 32, 8, "random"), (3, 128, 256, 5, 2, "random")]
    for T, d, h, E, K, mode in shapes:
        try:
            inp, plan, hw, dab = setup(T, d, h, E, K, mode)
            for name, a, b, make, transposed in cases(inp, hw, dab):
                s1, s2 = make(), make()
                s1.fill_(float("nan"))
                s2.fill_(float("nan"))
                t1, t2 = table_for(s1, transposed), table_for(s2, transposed)
                N = T * K
                triton_dw(a, b, t1, plan, K)
                dw_ws(a, b, t2, t1.rows, t1.cols, plan, K, (0, N, N + 1))
                torch.cuda.synchronize()
                rows.append(dict(part="check", shape=[T, d, h, E, K, mode], kernel=name,
                                 equal=bool(torch.equal(s1, s2)), nan=bool(s2.isnan().any()),
                                 maxdiff=float((s1.float() - s2.float()).abs().max())))
                log(rows[-1])
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(part="check", shape=[T, d, h, E, K, mode], error=f"{type(exc).__name__}: {str(exc)[:800]}"))
            log(rows[-1])
        dump()

    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda")
    stage_list = [int(s) for s in os.environ.get("MB_STAGES", "3").split(",")]
    for cname in os.environ.get("MB_CONFIGS", "C,D,A").split(","):
        T, d, h, E, K = ed.CONFIGS[cname]
        try:
            inp, plan, hw, dab = setup(T, d, h, E, K, "router", seed=2)
            N = T * K

            def timed(fn):
                def run():
                    flush.zero_()
                    fn()
                fl = triton.testing.do_bench(lambda: flush.zero_(), warmup=10, rep=100)
                return triton.testing.do_bench(run, warmup=20, rep=200) - fl

            for name, a, b, make, transposed in cases(inp, hw, dab):
                s1, s2 = make(), make()
                t1, t2 = table_for(s1, transposed), table_for(s2, transposed)
                flops = 2 * N * d * h
                fns = [("triton", lambda: triton_dw(a, b, t1, plan, K))]
                for stg in stage_list:
                    fns.append((f"gluon-ws s{stg}", lambda s=stg: dw_ws(a, b, t2, t1.rows, t1.cols, plan, K,
                                                                         (0, N, N + 1), stages=s)))
                for rnd in range(2):
                    for vname, fn in fns:
                        fn()
                        ms = timed(fn)
                        rows.append(dict(part="time", config=cname, kernel=name, variant=vname, round=rnd, ms=ms,
                                         tflops=flops / ms / 1e9))
                        log(rows[-1])
                        dump()
                rows.append(dict(part="time-check", config=cname, kernel=name, equal=bool(torch.equal(s1, s2))))
                log(rows[-1])
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(part="time", config=cname, error=f"{type(exc).__name__}: {str(exc)[:800]}"))
            log(rows[-1])
        dump()


if __name__ == "__main__":
    main(sys.argv[1])
