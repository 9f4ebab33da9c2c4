#!/usr/bin/env python3
"""Prototype, not wired in: the down kernel (``expert_fwd._expert_down_kernel``) as a persistent, warp-specialized
Gluon kernel for sm_90, checked and timed against the Triton kernel in one call.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/proto_down_ws.py OUTDIR

Why (benchmarks/NOTES-kernels.md, tenth session): what separates our GEMMs from the dense ceiling is the main loop
and the per-tile fill and epilogue of a one-consumer, non-specialized Triton kernel. The down kernel is the one GEMM
whose operands are both plain row blocks: A is the window's slot rows (H, or dA|dB), B an expert's weight matrix.
So both can come through TMA, issued by one producer warp, and the 128x256 tile keeps Triton's bytes per FLOP:

* one producer warp walks the program's tiles and fills a ring of ``STAGES`` (A, B) buffers through TMA, running
  ahead into the next tile while the consumers finish the current one;
* the default partition (8 warps, two warpgroups, 64 rows each) multiplies, then stores the tile: full tiles
  through shared memory and an asynchronous TMA store (waited for only before the next tile's store), ragged tiles
  (an expert's last rows, or a tile cut by the window) through masked pointer stores.

B through 2-D descriptors over each table's storage: rows ``e * e_rows + r`` (mode 1: r = k, n contiguous; mode 2:
r = n, k contiguous). Mode 1 needs k_dim % BLOCK_K == 0 (a k tile must not run into the next expert's rows).

Writes OUTDIR/proto_down_ws.json.
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
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64


@gluon.jit
def _tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr, tile_start_ptr, offsets_ptr, slot0, slot1,
          GROUP_M: gl.constexpr):
    """Tile ``t`` of the launch (grouped order, as ``_grouped_tile_ids``): (expert or -1, start, first, end, pid_n)
    as ``_window_tile``."""
    in_group = GROUP_M * num_n
    first_m = (t // in_group) * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % in_group) % size
    pid_n = (t % in_group) // size
    i = pid_m + tile0
    inside = i < tiles_total
    i = gl.minimum(i, tiles_total - 1)
    e = gl.load(tile_expert_ptr + i)
    start = gl.load(tile_start_ptr + i)
    end = gl.minimum(gl.load(offsets_ptr + gl.maximum(e, 0) + 1), slot1)
    first = gl.maximum(start, slot0)
    e = gl.where(inside & (e >= 0) & (first < end), e, -1)
    return e, start, first, end, pid_n


@gluon.jit
def _producer(a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, tile0_ptr, tile_expert_ptr, tile_start_ptr,
              offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, e_rows0, e_rows1,
              TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b0_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b0_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b0_desc.block_type.nbytes
    tile0 = gl.load(tile0_ptr)
    n_k = gl.cdiv(k_dim, BK)
    g = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, start, first, end, pid_n = _tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr, tile_start_ptr,
                                            offsets_ptr, slot0, slot1, GROUP_M)
        if e >= 0:
            row = start - slot0  # may be negative (a tile cut by the window's start): TMA fills zeros there
            n0 = pid_n * BN
            for k in range(n_k):
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row, k * BK], ready.index(s), a_bufs.index(s))
                if B_KMAJOR:
                    tma.async_copy_global_to_shared(b0_desc, [e * e_rows0 + n0, k * BK], ready.index(s),
                                                    b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(b0_desc, [e * e_rows0 + k * BK, n0], ready.index(s),
                                                    b_bufs.index(s))
                g += 1
            if TWO_B:  # dX: the second half of A's columns against B1 (mode 1 only)
                for k in range(n_k):
                    s = g % STAGES
                    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), nbytes)
                    tma.async_copy_global_to_shared(a_desc, [row, k_dim + k * BK], ready.index(s), a_bufs.index(s))
                    tma.async_copy_global_to_shared(b1_desc, [e * e_rows1 + k * BK, n0], ready.index(s),
                                                    b_bufs.index(s))
                    g += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, c_smem, ready, empty, c_desc, c_ptr, tile0_ptr, tile_expert_ptr, tile_start_ptr,
              offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, stride_c,
              TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
    st: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # 16 B per thread along a row
    dtype: gl.constexpr = c_smem.dtype
    tile0 = gl.load(tile0_ptr)
    n_k = gl.cdiv(k_dim, BK)
    if TWO_B:
        steps = 2 * n_k
    else:
        steps = n_k
    g = 0
    for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        e, start, first, end, pid_n = _tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr, tile_start_ptr,
                                            offsets_ptr, slot0, slot1, GROUP_M)
        if e >= 0:
            gl.assume(steps > 0)  # else ptxas serializes every wgmma (NOTES-kernels.md, sixth session)
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
            out = acc.to(dtype)
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


@gluon.jit
def _down_ws_kernel(a_desc, b0_desc, b1_desc, c_desc, c_ptr, tile0_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
                    num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, e_rows0, e_rows1, stride_c,
                    TWO_B: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
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
    # integer arguments equal to 1 arrive as Python ints, which a partition cannot take
    num_m, num_n, tiles_total = gl.to_tensor(num_m), gl.to_tensor(num_n), gl.to_tensor(tiles_total)
    slot0, slot1, k_dim, n_dim = gl.to_tensor(slot0), gl.to_tensor(slot1), gl.to_tensor(k_dim), gl.to_tensor(n_dim)
    e_rows0, e_rows1, stride_c = gl.to_tensor(e_rows0), gl.to_tensor(e_rows1), gl.to_tensor(stride_c)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, c_smem, ready, empty, c_desc, c_ptr, tile0_ptr, tile_expert_ptr, tile_start_ptr,
                     offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, n_dim, stride_c, TWO_B, B_KMAJOR,
                     GROUP_M, STAGES, BM, BN, BK)),
        (_producer, (a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, tile0_ptr, tile_expert_ptr,
                     tile_start_ptr, offsets_ptr, num_m, num_n, tiles_total, slot0, slot1, k_dim, e_rows0, e_rows1,
                     TWO_B, B_KMAJOR, GROUP_M, STAGES)),
    ], [1], [PRODUCER_REGS])


def _gl_dtype(t: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t]


def _rows_2d(v: torch.Tensor, kmajor: bool):
    """(2-D view of the storage under the [E, r, c] view ``v``, e_rows): rows e * e_rows + r, unit column stride."""
    E, r, c = v.shape
    assert v.stride(2) == 1 and v.stride(0) % v.stride(1) == 0, v.stride()
    e_rows = v.stride(0) // v.stride(1)
    return torch.as_strided(v, ((E - 1) * e_rows + r, c), (v.stride(1), 1)), e_rows


_SMS = {}


def down_ws(a, b0, b1, kmajor, k_dim, n_dim, plan, out, window, stages=3, group_m=8, producer_regs=40):
    """out[slot] = a[slot, :k_dim] @ B0[e] (+ a[slot, k_dim:] @ B1[e]); b0/b1: [E, k, n] views (kmajor False:
    n contiguous) or [E, n, k] views (kmajor True: k contiguous)."""
    slot0, slot1, tile0, num_tiles = window
    dt = _gl_dtype(a.dtype)
    lay = gl.NVMMASharedLayout.get_default_for
    a_desc = GluonDesc.from_tensor(a, [BLOCK_M, BLOCK_K], lay([BLOCK_M, BLOCK_K], dt))
    bblock = [BLOCK_N, BLOCK_K] if kmajor else [BLOCK_K, BLOCK_N]
    b0_2d, e0 = _rows_2d(b0, kmajor)
    b0_desc = GluonDesc.from_tensor(b0_2d, bblock, lay(bblock, dt))
    if b1 is not None:
        assert not kmajor and k_dim % BLOCK_K == 0
        b1_2d, e1 = _rows_2d(b1, kmajor)
        b1_desc = GluonDesc.from_tensor(b1_2d, bblock, lay(bblock, dt))
    else:
        b1_desc, e1 = b0_desc, e0
    if not kmajor:
        assert k_dim % BLOCK_K == 0, "mode 1 needs k_dim % BLOCK_K == 0"
    c_desc = GluonDesc.from_tensor(out, [BLOCK_M, BLOCK_N], lay([BLOCK_M, BLOCK_N], dt))
    num_n = triton.cdiv(n_dim, BLOCK_N)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    sms = _SMS.setdefault(dev, torch.cuda.get_device_properties(dev).multi_processor_count)
    grid = (min(sms, num_tiles * num_n),)
    _down_ws_kernel[grid](a_desc, b0_desc, b1_desc, c_desc, out, tile0, plan.tile_expert, plan.tile_start,
                          plan.offsets, num_tiles, num_n, plan.tile_expert.numel(), slot0, slot1, k_dim, n_dim, e0, e1,
                          out.stride(0), TWO_B=b1 is not None, B_KMAJOR=kmajor, GROUP_M=group_m, STAGES=stages,
                          PRODUCER_REGS=producer_regs, num_warps=8)
    return out


# ---------------------------------------------------------------------------------------------
# Device check and timing
# ---------------------------------------------------------------------------------------------
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def main(outdir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expert_device as ed
    from moeblaze_fx.kernels import expert_fwd

    os.makedirs(outdir, exist_ok=True)
    rows = []
    path = os.path.join(outdir, "proto_down_ws.json")

    def dump():
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           commit=os.environ.get("MB_COMMIT", ""), rows=rows), f, indent=1)

    def setup(T, d, h, E, K, ids_mode, seed=0):
        inp = ed.make_inputs(T, d, h, E, K, ids_mode=ids_mode, seed=seed)
        plan = ed.dispatch_with_fallback(inp["ids"], E, expert_fwd.plan_block_m())
        N = T * K
        g = torch.Generator(device="cuda").manual_seed(seed + 7)
        hid = torch.randn(N, h, device="cuda", generator=g).to(torch.bfloat16)
        dab = torch.randn(N, 2 * h, device="cuda", generator=g).to(torch.bfloat16)
        gate, up, down = ed.role_views(inp["layout"], inp["storage"], True, E)
        return inp, plan, hid, dab, gate, up, down

    def triton_down(a, k_dim, tabs, kis_rows, b1, n_dim, plan, out, win, x):
        op = expert_fwd.down_operand(tabs, b1, kis_rows, k_dim, x)
        return expert_fwd.down_project(a, k_dim, op, n_dim, plan, out, None, win)

    def both(inp, plan, hid, dab, gate, up, down, win):
        """(Y, dX) by Triton (the operator's own launch) and by the Gluon prototype, for window ``win``."""
        x = inp["x"]
        gt, ut, dtab = ed.weight_tables(inp)
        n = win.slot1 - win.slot0
        d, h = x.shape[1], hid.shape[1]
        hw, dw = hid[win.slot0:win.slot1], dab[win.slot0:win.slot1]
        y_t = torch.full((n, d), float("nan"), device="cuda", dtype=x.dtype)
        y_g = torch.full_like(y_t, float("nan"))
        dx_t, dx_g = torch.full_like(y_t, float("nan")), torch.full_like(y_t, float("nan"))
        triton_down(hw, h, dtab, False, None, d, plan, y_t, win, x)
        triton_down(dw, h, gt, True, ut, d, plan, dx_t, win, x)
        wtuple = (win.slot0, win.slot1, win.tile0, win.num_tiles)
        down_ws(hw, down, None, True, h, d, plan, y_g, wtuple)  # W_down [E, d, h]: [E, n, k], k contiguous
        down_ws(dw, gate, up, False, h, d, plan, dx_g, wtuple)  # W_gate [E, h, d]: [E, k, n]
        return y_t, y_g, dx_t, dx_g

    def ref(inp, plan, hid, dab, gate, up, down, win):
        tok_e = torch.searchsorted(plan.offsets[1:].long(), torch.arange(win.slot0, win.slot1, device="cuda"),
                                   right=True)
        hw, dw = hid[win.slot0:win.slot1].float(), dab[win.slot0:win.slot1].float()
        h = hid.shape[1]
        y = torch.einsum("sk,snk->sn", hw, down.float()[tok_e])
        dx = (torch.einsum("sk,skn->sn", dw[:, :h], gate.float()[tok_e])
              + torch.einsum("sk,skn->sn", dw[:, h:], up.float()[tok_e]))
        return y, dx

    # 1. correctness on ragged shapes and windows
    shapes = [(1000, 256, 384, 8, 4, "empty_expert", 0), (700, 512, 128, 4, 2, "one_expert", 0),
              (4099, 1024, 768, 32, 8, "random", 0), (513, 256, 200, 6, 2, "sentinel", 0),
              (3, 256, 128, 5, 2, "random", 0), (4099, 1024, 768, 32, 8, "random", 3000)]
    for T, d, h, E, K, mode, wslots in shapes:
        try:
            inp, plan, hid, dab, gate, up, down = setup(T, d, h, E, K, mode)
            wins = expert_fwd.slot_windows(plan, wslots)
            for wi, win in enumerate(wins):
                y_t, y_g, dx_t, dx_g = both(inp, plan, hid, dab, gate, up, down, win)
                y_r, dx_r = ref(inp, plan, hid, dab, gate, up, down, win)
                row = dict(part="check", shape=[T, d, h, E, K, mode], window=[win.slot0, win.slot1],
                           y_rel=float((y_g.float() - y_r).norm() / y_r.norm().clamp(min=1e-30)),
                           y_eq_triton=bool(torch.equal(y_g, y_t)), y_nan=bool(y_g.isnan().any()),
                           y_maxdiff_triton=float((y_g.float() - y_t.float()).abs().max()) if y_g.numel() else 0.0)
                if h % BLOCK_K == 0:
                    row.update(dx_rel=float((dx_g.float() - dx_r).norm() / dx_r.norm().clamp(min=1e-30)),
                               dx_eq_triton=bool(torch.equal(dx_g, dx_t)), dx_nan=bool(dx_g.isnan().any()))
                rows.append(row)
                log(row)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(part="check", shape=[T, d, h, E, K, mode], error=f"{type(exc).__name__}: {str(exc)[:600]}"))
            log(rows[-1])
        dump()

    # 2. timing at the configs: the Triton kernel as the operator launches it (autotuned) against the prototype
    flush = torch.empty(256 * 1024 * 1024 // 4, device="cuda")
    configs = [c for c in os.environ.get("MB_CONFIGS", "C,D,A").split(",") if c]
    stage_list = [int(s) for s in os.environ.get("MB_STAGES", "3").split(",")]
    for name in configs:
        T, d, h, E, K = ed.CONFIGS[name]
        try:
            inp, plan, hid, dab, gate, up, down = setup(T, d, h, E, K, "router", seed=2)
            win = expert_fwd.slot_windows(plan, 0)[0]
            wtuple = (win.slot0, win.slot1, win.tile0, win.num_tiles)
            x = inp["x"]
            gt, ut, dtab = ed.weight_tables(inp)
            N = T * K
            y = torch.empty(N, d, device="cuda", dtype=x.dtype)
            y2 = torch.empty_like(y)
            fl_y, fl_dx = 2 * N * d * h, 4 * N * d * h

            def timed(fn):
                def run():
                    flush.zero_()
                    fn()
                fl = triton.testing.do_bench(lambda: flush.zero_(), warmup=10, rep=100)
                return triton.testing.do_bench(run, warmup=20, rep=200) - fl

            op_y = expert_fwd.down_operand(dtab, None, False, h, x)
            op_dx = expert_fwd.down_operand(gt, ut, True, h, x)
            variants = [("triton", lambda: expert_fwd.down_project(hid, h, op_y, d, plan, y, None, win),
                         lambda: expert_fwd.down_project(dab, h, op_dx, d, plan, y, None, win))]
            for stg in stage_list:
                variants.append((f"gluon-ws s{stg}",
                                 lambda s=stg: down_ws(hid, down, None, True, h, d, plan, y2, wtuple, stages=s),
                                 lambda s=stg: down_ws(dab, gate, up, False, h, d, plan, y2, wtuple, stages=s)))
            for rnd in range(2):
                for vname, fy, fdx in variants:
                    fy()
                    fdx()
                    ms_y, ms_dx = timed(fy), timed(fdx)
                    rows.append(dict(part="time", config=name, variant=vname, round=rnd, y_ms=ms_y,
                                     y_tflops=fl_y / ms_y / 1e9, dx_ms=ms_dx, dx_tflops=fl_dx / ms_dx / 1e9))
                    log(rows[-1])
                    dump()
            fy_t, fy_g = variants[0][1], variants[1][1]
            fy_t()
            fy_g()
            rows.append(dict(part="time-check", config=name, y_eq=bool(torch.equal(y, y2)),
                             y_maxdiff=float((y.float() - y2.float()).abs().max())))
            log(rows[-1])
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(part="time", config=name, error=f"{type(exc).__name__}: {str(exc)[:600]}"))
            log(rows[-1])
        dump()


if __name__ == "__main__":
    main(sys.argv[1])
