"""Lock-free token dispatch: the :class:`DispatchPlan` of ``dispatch_reference``, bit for bit, in three
Triton launches, with no atomics, no global sort and no host synchronisation.

Notation: ``N = T*K`` pairs, pair ``p = t*K + k``; the pairs are cut into ``nc = cdiv(N, C)`` chunks of
``C`` consecutive pairs (one program each), walked ``S`` pairs at a time (a *block*); ``E`` experts;
*bin* ``E`` collects the unrouted pairs (ids outside ``[0, E)``), which the plan puts after every routed
slot, in ascending ``p``.

Data flow (forward only; dispatch has no backward, its outputs are integer indices)::

    ids [T, K] int32|int64 (any strides)
      |  1. _dispatch_histogram_kernel   grid (nc,)
      |     chunk c: counts[c, e] = #{p in chunk c : ids[p] == e}          (tl.histogram in registers)
      v
    chunk_base [nc + 1, E] int32 (rows < nc holding the counts)
      |  2. _dispatch_scan_kernel        grid (cdiv(E, SCAN_BLOCK_E),)
      |     per expert column, in place: chunk_base[c, e] = sum_{c' < c} counts[c', e];
      |     totals[e] = chunk_base[nc, e] = sum_c counts[c, e]
      v
    chunk_base [nc + 1, E] int32
      |  3. _dispatch_scatter_kernel     grid (nt + nc,)
      |     programs [0, nt): row tiles: binary search of t in cumsum(cdiv(totals, block_m));
      |     programs [nt, nt + nc), chunk c:
      |       offsets = excl_cumsum(totals) (chunk 0's program also stores them),
      |       next[e] = offsets[e] + chunk_base[c, e]  (next free slot of expert e for this chunk),
      |       next[E] = offsets[E] + unrouted pairs in chunks < c;
      |       per block of S pairs: rank of each pair among the block's pairs of its bin (stable),
      |       slot = next[bin] + rank, token_index[slot] = p, slot_of[p] = slot (-1 when unrouted),
      |       next += the block's histogram
      v
    offsets [E+1], token_index [N], slot_of [N], tile_expert [n_tiles], tile_start [n_tiles]   (int32)

The stable rank inside a block takes one of two paths (``DispatchConfig.path``):

* ``"sort"`` (the default for every E): key = bin * S + index in the block, sorted in registers (a
  bitonic network, as ``tl.sort``; keys are unique, so the order is total and deterministic). The pair
  at sorted position j of bin b has rank ``j - #{block pairs in bins < b}`` (from ``tl.histogram`` of
  the block), so ``slot = (next - excl_cumsum(block histogram))[b] + j`` through one ``tl.gather``.
* ``"dense"`` (opt-in): a one-hot [S, bins] tile and a cumsum along the pairs: the paper's dense map,
  but only a register tile of it. It lost to the sort even at E = 8 on an H200, so only a pinned
  configuration uses it.

A chunk (the histogram/scan granularity) spans several blocks (the sort granularity) so that the scan
stays small: with C = 512 = S, 1M x 8 pairs and E = 256 the scratch was 16 MB and the column scan
32 sequential steps; C = 4096 makes it 2 MB.

Nothing is saved (no backward). Memory: the outputs (``2*N + E + 1 + 2*n_tiles`` int32) plus
``(nc + 1) * E`` int32 of scratch (``chunk_base``): O(T*K + E*chunks), never a T x E map.
Determinism: every value is a function of the ids alone (integer counts, fixed-order scans, unique
sort keys, each output element written by exactly one program); no global atomics anywhere. ``tl.histogram`` counts within one
program (its lowering may use shared-memory increments; integer counts do not depend on their order).

Floor (H100 ~3.0 TB/s, H200 ~4.3 TB/s, read + write): ids read once (8*N bytes for int64) plus
token_index and slot_of written once (8*N bytes): T=1M, K=8 -> 128 MB -> ~43 us (H100), ~30 us (H200).
This design reads the ids twice (launches 1 and 3), ~64 MB more. Predicted ~0.1 ms at 1M x 8 if the
in-register sort kept up; it does not: measured on an H200 (commit ccf1907; docs/dispatch.md)
0.18 ms (E = 8), 0.20 ms (E = 64), 0.33 ms (E = 256) at 1M x 8, of which the scatter launch (the sort)
is 131-282 us, the histogram 30-35 us (~2 TB/s of ids read) and the scan 10 us. Below ~1M pairs the
host side of the three launches (~80 us per call) is the cost unless the call is replayed in a CUDA
graph (10-20 us on the device).

The kernel option ``dispatch_config="path,chunk,block,num_warps"`` (e.g. ``"sort,4096,512,4"``,
``config.KernelOptions``) pins one configuration, for tests and for debugging.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..config import interpreting
from .autotune import options
from .launch import launch, sized
from .reference import DispatchPlan, check_ids as check_ids_on_host, dispatch_reference, max_tiles

__all__ = ["DispatchConfig", "dispatch", "dispatch_forward", "default_config", "MAX_EXPERTS"]

# Kernels were decorated in interpreter mode iff the variable was set at import (Triton decides then).
_INTERPRETED = interpreting()

# The per-program tables (offsets, starts, tl.histogram bins) live in registers: next_pow2(E + 1) of
# them. 1024 experts (2048 bins) covers every published MoE; above it use dispatch_reference.
MAX_EXPERTS = 1024
# Pair indices are int32 (the plan's dtype) and a program computes c * C + local in int32.
_MAX_PAIRS = 2**31 - 2**16
_SCAN_BLOCK_E = 8  # 8 experts x 4 B = one 32 B sector per chunk row: coalesced, and E/8 programs


class DispatchConfig(NamedTuple):
    path: str  # "sort" or "dense": how a block's pairs are ranked
    chunk: int  # C, pairs per program (power of two): the histogram/scan granularity
    block: int  # S, pairs ranked at a time (power of two, <= chunk)
    num_warps: int
    scan_block_c: int = 512  # chunk rows per step of the column scan (power of two)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _load_bins(ids_ptr, p, live, K, E, stride_ids_t, stride_ids_k, CONTIGUOUS: tl.constexpr):
    """Bin of each pair p (its expert, or E when the id is outside [0, E)), whether it is routed, and the id (0 where
    not live).
    CONTIGUOUS ids are addressed by p itself, so the loads vectorise (p // K defeats that)."""
    if CONTIGUOUS:
        offs = p.to(tl.int64)
    else:
        t = p // K
        k = p - t * K
        offs = t.to(tl.int64) * stride_ids_t + k.to(tl.int64) * stride_ids_k
    x = tl.load(ids_ptr + offs, mask=live, other=0)
    routed = live & (x >= 0) & (x < E)
    b = tl.where(routed, x, E).to(tl.int32)
    return b, routed, x


@triton.jit
def _sort_unique_keys(x, LOG_N: tl.constexpr):
    """Ascending bitonic sort of a 1-D block of 2**LOG_N distinct int32 keys, in registers.

    tl.sort's network on a [2] * LOG_N hypercube, with one change: keys are unique, so a position's
    partner is the pair's sum minus itself (tl.sum) instead of an xor reduction. The GPU sees the same
    tt.reduce over a size-2 axis; the interpreter has a vectorised tl.sum but runs xor reductions element
    by element (about 50x slower). Written inline: each nested jit call costs the interpreter ~0.3 ms.
    """
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_N + 1):
        # Blocks of 2**stage positions alternate direction (bit `stage` of the position), except the last.
        if stage < LOG_N:
            flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_N - stage - 1) + [2] + [1] * stage)
        else:
            flip = tl.zeros([1] * LOG_N, dtype=tl.int32)
        for step in tl.static_range(stage):
            # compare positions that differ in bit i = stage - 1 - step: hypercube axis LOG_N - 1 - i
            partner = tl.sum(h, axis=LOG_N - stage + step, keep_dims=True) - h
            is_right = tl.reshape(tl.arange(0, 2), [1] * (LOG_N - stage + step) + [2] + [1] * (stage - 1 - step))
            h = tl.where((h > partner) != (flip ^ is_right), partner, h)
    return tl.reshape(h, x.shape)


@sized(triton.jit)
def _dispatch_histogram_kernel(
    ids_ptr,  # [T, K] int32 | int64
    counts_ptr,  # [nc, E] int32, out: routed pairs of chunk c per expert
    N,  # T * K
    K,
    E,
    stride_ids_t,
    stride_ids_k,
    stride_counts_c,
    CHUNK: tl.constexpr,  # C, pairs per program
    BLOCK: tl.constexpr,  # pairs per step (divides C)
    HIST_BINS: tl.constexpr,  # power of two >= max(E, 32)
    CONTIGUOUS: tl.constexpr,  # ids.is_contiguous()
    CHECK_IDS: tl.constexpr,  # assert that no id is negative (launched with debug=True, which keeps the assert)
):
    """grid (nc,): program c counts the pairs [c*C, (c+1)*C) per expert, BLOCK pairs at a time."""
    c = tl.program_id(0)
    counts = tl.zeros([HIST_BINS], dtype=tl.int32)
    for s in range(0, tl.minimum(CHUNK, N - c * CHUNK), BLOCK):
        p = c * CHUNK + s + tl.arange(0, BLOCK)
        live = p < N
        b, routed, x = _load_bins(ids_ptr, p, live, K, E, stride_ids_t, stride_ids_k, CONTIGUOUS)
        if CHECK_IDS:
            tl.device_assert(x >= 0, "moeblaze.moe_ffn: ids contain negative expert ids")  # (0 where not live)
        counts += tl.histogram(tl.where(routed, b, 0), HIST_BINS, mask=routed)
    e = tl.arange(0, HIST_BINS)
    tl.store(counts_ptr + c.to(tl.int64) * stride_counts_c + e, counts, mask=e < E)


@sized(triton.jit)  # num_chunks is a runtime int even when 1: it is cast to int64
def _dispatch_scan_kernel(
    chunk_base_ptr,  # [nc + 1, E] int32, in: counts; out: sum over earlier chunks; row nc: totals
    num_chunks,
    E,
    stride_base_c,
    BLOCK_C: tl.constexpr,  # chunk rows per step
    BLOCK_E: tl.constexpr,  # expert columns per program
):
    """grid (cdiv(E, BLOCK_E),): program i scans expert columns [i*BLOCK_E, (i+1)*BLOCK_E) over chunks."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = (c < num_chunks)[:, None] & e_mask[None, :]
        ptrs = chunk_base_ptr + c.to(tl.int64)[:, None] * stride_base_c + e[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        inclusive = tl.cumsum(counts, axis=0)
        tl.store(ptrs, carry[None, :] + inclusive - counts, mask=mask)
        carry += tl.sum(counts, axis=0)
    tl.store(chunk_base_ptr + num_chunks.to(tl.int64) * stride_base_c + e, carry, mask=e_mask)


@sized(triton.jit)  # num_chunks is a runtime int even when 1: it is cast to int64
def _dispatch_scatter_kernel(
    ids_ptr,  # [T, K] int32 | int64
    chunk_base_ptr,  # [nc + 1, E] int32: slots of expert e taken by chunks before c; row nc: totals
    offsets_ptr,  # [E+1] int32, out
    token_index_ptr,  # [N] int32, out: pair of each slot
    slot_of_ptr,  # [N] int32, out: slot of each pair, -1 when unrouted
    tile_expert_ptr,  # [n_tiles] int32, out: expert of each row tile, -1 past the last
    tile_start_ptr,  # [n_tiles] int32, out: first slot of each row tile, offsets[E] past the last
    N,
    K,
    E,
    num_tile_programs,  # nt
    num_chunks,  # nc
    n_tiles,
    block_m,
    stride_ids_t,
    stride_ids_k,
    stride_base_c,
    CHUNK: tl.constexpr,  # C, pairs per chunk program
    BLOCK: tl.constexpr,  # S, pairs ranked at a time
    LOG_BLOCK: tl.constexpr,
    BINS: tl.constexpr,  # power of two >= E + 1 (bin E = unrouted); >= 32 on the sort path
    LOG_BINS: tl.constexpr,
    DENSE: tl.constexpr,  # rank through a one-hot tile instead of the sort
    TILE_BLOCK: tl.constexpr,  # row tiles per step of a tile program
    TILES_PER_PROGRAM: tl.constexpr,
    CONTIGUOUS: tl.constexpr,  # ids.is_contiguous()
):
    """grid (nt + nc,): programs [0, nt) write TILES_PER_PROGRAM row tiles each; program nt + c
    ranks and scatters chunk c. The tile programs come first so they overlap the chunk programs."""
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    totals = tl.load(chunk_base_ptr + num_chunks.to(tl.int64) * stride_base_c + bins, mask=bins < E, other=0)
    offsets = tl.cumsum(totals, axis=0) - totals  # offsets[b] for b >= E: the routed total
    routed_total = tl.sum(totals, axis=0)
    if pid < num_tile_programs:
        # Tile t belongs to expert e = #{b : tiles_inclusive[b] <= t}: binary search over the BINS
        # non-decreasing values (LOG_BINS gathers) instead of comparing with all of them.
        tiles = (totals + block_m - 1) // block_m
        tiles_inclusive = tl.cumsum(tiles, axis=0)
        tiles_exclusive = tiles_inclusive - tiles
        used_tiles = tl.sum(tiles, axis=0)
        for t0 in range(0, TILES_PER_PROGRAM, TILE_BLOCK):
            t = pid * TILES_PER_PROGRAM + t0 + tl.arange(0, TILE_BLOCK)
            expert = tl.zeros([TILE_BLOCK], dtype=tl.int32)
            for step in tl.static_range(LOG_BINS):
                candidate = expert + (1 << (LOG_BINS - 1 - step))
                below = tl.gather(tiles_inclusive, candidate - 1, 0) <= t
                expert = tl.where(below, candidate, expert)
            used = t < used_tiles  # then expert < E
            e_idx = tl.minimum(expert, E)
            start = tl.gather(offsets, e_idx, 0) + (t - tl.gather(tiles_exclusive, e_idx, 0)) * block_m
            t_mask = t < n_tiles
            tl.store(tile_expert_ptr + t, tl.where(used, expert, -1), mask=t_mask)
            tl.store(tile_start_ptr + t, tl.where(used, start, routed_total), mask=t_mask)
    else:
        c = pid - num_tile_programs
        if c == 0:
            tl.store(offsets_ptr + bins, offsets, mask=bins <= E)
        base = tl.load(chunk_base_ptr + c.to(tl.int64) * stride_base_c + bins, mask=bins < E, other=0)
        unrouted_before = c * CHUNK - tl.sum(base, axis=0)  # every chunk before c is full
        next_slot = tl.where(bins < E, offsets + base, routed_total + unrouted_before)  # bins > E unused
        j = tl.arange(0, BLOCK)
        for s in range(0, tl.minimum(CHUNK, N - c * CHUNK), BLOCK):
            p = c * CHUNK + s + j
            live = p < N
            b, routed, _ = _load_bins(ids_ptr, p, live, K, E, stride_ids_t, stride_ids_k, CONTIGUOUS)
            if DENSE:
                hit = (b[:, None] == bins[None, :]) & live[:, None]  # [BLOCK, BINS]
                hit_i = hit.to(tl.int32)
                slot = tl.sum(tl.where(hit, next_slot[None, :] + tl.cumsum(hit_i, axis=0) - 1, 0), axis=1)
                next_slot += tl.sum(hit_i, axis=0)
                tl.store(slot_of_ptr + p, tl.where(routed, slot, -1), mask=live)
                tl.store(token_index_ptr + slot, p, mask=live)
            else:
                counts = tl.histogram(tl.where(live, b, 0), BINS, mask=live)
                # slot of sorted position j in bin b = next[b] + (j - #{block pairs in bins < b})
                rank_base = next_slot - (tl.cumsum(counts, axis=0) - counts)
                key = tl.where(live, b, E + 1) * BLOCK + j  # padding lanes sort last (bin E + 1)
                key = _sort_unique_keys(key, LOG_BLOCK)
                sorted_bin = key >> LOG_BLOCK
                sorted_p = p - j + (key & (BLOCK - 1))
                sorted_live = sorted_bin <= E
                slot = tl.gather(rank_base, tl.minimum(sorted_bin, E), 0) + j
                tl.store(token_index_ptr + slot, sorted_p, mask=sorted_live)
                tl.store(slot_of_ptr + sorted_p, tl.where(sorted_bin < E, slot, -1), mask=sorted_live)
                next_slot += counts


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
def _check_args(ids: Tensor, num_experts: int, block_m: int) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids must be a torch.Tensor of expert ids [T, K], got {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(
            f"ids must be a 2-D [T, K] tensor of expert ids (one row per token), got shape {tuple(ids.shape)}; "
            "reshape the router's top-k indices to [num_tokens, top_k]"
        )
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}; convert with ids.to(torch.int64)")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"num_experts must be a Python int, got {type(num_experts).__name__}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a positive power of two (e.g. 64), got {block_m!r}")


def _pinned(spec: str) -> DispatchConfig:
    path, chunk, block, num_warps = spec.split(",")  # (validated by config.KernelOptions)
    return DispatchConfig(path, int(chunk), int(block), int(num_warps))


def default_config(num_pairs: int, num_experts: int) -> DispatchConfig:
    """The configuration ``dispatch`` uses; the kernel option ``dispatch_config`` in force overrides it."""
    pinned = options().dispatch_config
    if pinned:
        return _pinned(pinned)
    # About two chunks per SM (132 on H100/H200) while that keeps chunks of 512..4096 pairs.
    chunk = min(max(triton.next_power_of_2(triton.cdiv(num_pairs, 264)), 512), 4096)
    # H200 sweeps (a420f50, 1a3e932), 4 warps: sorting 512 keys at a time beat 1024..4096 at every size;
    # 256 beat 512 where the per-block tables are small (1M x 8, E = 8: 0.20 vs 0.28 ms; 131072 x 8,
    # E = 64: 0.058 vs 0.075 ms) but not at E = 256 (0.367 vs 0.349 ms). The dense path lost to the
    # sort even at E = 8 (0.31 ms), so it is opt-in only.
    block = 256 if max(triton.next_power_of_2(num_experts + 1), 32) <= 128 else 512
    return DispatchConfig("sort", chunk, block, 4)


def _validate_config(config: DispatchConfig) -> None:
    if config.path not in ("sort", "dense"):
        raise ValueError(f"dispatch config path must be 'sort' or 'dense', got {config.path!r}")
    for name in ("chunk", "block", "num_warps", "scan_block_c"):
        v = getattr(config, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"dispatch config {name} must be a positive power of two, got {v}")
    if not 16 <= config.block <= config.chunk:
        raise ValueError(f"dispatch config block must be in [16, chunk], got {config.block} (chunk {config.chunk})")


def _scatter_meta(config: DispatchConfig, num_experts: int) -> dict:
    """Compile-time parameters of _dispatch_scatter_kernel for a configuration."""
    _validate_config(config)
    dense = config.path == "dense"
    bins = triton.next_power_of_2(num_experts + 1)
    if not dense:
        bins = max(bins, 32)  # tl.histogram spreads its bins over a warp's lanes
    tile_block = 64 * config.num_warps  # two row tiles per thread and step
    return dict(
        CHUNK=config.chunk, BLOCK=config.block, LOG_BLOCK=config.block.bit_length() - 1,
        BINS=bins, LOG_BINS=bins.bit_length() - 1, DENSE=dense,
        TILE_BLOCK=tile_block, TILES_PER_PROGRAM=4 * tile_block,
    )  # fmt: skip


def dispatch_forward(
    ids: Tensor, num_experts: int, block_m: int = 64, config: DispatchConfig | None = None, check_ids: bool = False
) -> DispatchPlan:
    """Host launcher: allocate, size the grids from shapes (never from data) and launch the 3 kernels. ``check_ids``:
    see :func:`dispatch`."""
    _check_args(ids, num_experts, block_m)
    if check_ids and not ids.is_cuda:
        check_ids_on_host(ids)
    E = num_experts
    if E > MAX_EXPERTS:
        raise ValueError(
            f"the Triton dispatch supports num_experts <= {MAX_EXPERTS}, got {E}; "
            "use moeblaze_fx.kernels.reference.dispatch_reference for more experts"
        )
    T, K = ids.shape
    N = T * K
    if N > _MAX_PAIRS:
        raise ValueError(f"T*K = {N} pairs does not fit the int32 plan (at most {_MAX_PAIRS}); split the batch")
    device = ids.device
    i32 = torch.int32
    n_tiles = max_tiles(N, E, block_m)
    token_index = torch.empty(N, dtype=i32, device=device)
    slot_of = torch.empty(N, dtype=i32, device=device)
    if N == 0:
        # Nothing routed: every offset is 0, every tile is padding. No launch.
        offsets = torch.zeros(E + 1, dtype=i32, device=device)
        tile_expert = torch.full((n_tiles,), -1, dtype=i32, device=device)
        tile_start = torch.zeros(n_tiles, dtype=i32, device=device)
        return DispatchPlan(offsets, token_index, slot_of, tile_expert, tile_start)

    config = config or default_config(N, E)
    meta = _scatter_meta(config, E)
    chunk = config.chunk
    num_chunks = triton.cdiv(N, chunk)
    offsets = torch.empty(E + 1, dtype=i32, device=device)
    tile_expert = torch.empty(n_tiles, dtype=i32, device=device)
    tile_start = torch.empty(n_tiles, dtype=i32, device=device)
    chunk_base = torch.empty((num_chunks + 1, E), dtype=i32, device=device)  # row num_chunks: totals
    contiguous = ids.is_contiguous()
    check = check_ids and ids.is_cuda  # Triton keeps a device assert only in a kernel compiled with debug=True

    launch(
        _dispatch_histogram_kernel, (num_chunks,),
        ids, chunk_base, N, K, E, ids.stride(0), ids.stride(1), chunk_base.stride(0),
        CHUNK=chunk, BLOCK=min(chunk, 16 * 32 * config.num_warps), HIST_BINS=max(triton.next_power_of_2(E), 32),
        CONTIGUOUS=contiguous, CHECK_IDS=check, num_warps=config.num_warps, **({"debug": True} if check else {}),
    )
    launch(
        _dispatch_scan_kernel, (triton.cdiv(E, _SCAN_BLOCK_E),),
        chunk_base, num_chunks, E, chunk_base.stride(0),
        BLOCK_C=config.scan_block_c, BLOCK_E=_SCAN_BLOCK_E, num_warps=4,
    )
    num_tile_programs = triton.cdiv(n_tiles, meta["TILES_PER_PROGRAM"])
    launch(
        _dispatch_scatter_kernel, (num_tile_programs + num_chunks,),
        ids, chunk_base, offsets, token_index, slot_of, tile_expert, tile_start,
        N, K, E, num_tile_programs, num_chunks, n_tiles, block_m,
        ids.stride(0), ids.stride(1), chunk_base.stride(0),
        **meta, CONTIGUOUS=contiguous, num_warps=config.num_warps,
    )  # fmt: skip
    return DispatchPlan(offsets, token_index, slot_of, tile_expert, tile_start)


def dispatch(ids: Tensor, num_experts: int, block_m: int = 64, check_ids: bool = False) -> DispatchPlan:
    """Build the dispatch plan of ``ids [T, K]`` (int32 or int64) for ``num_experts`` experts.

    Bitwise equal to :func:`~moeblaze_fx.kernels.reference.dispatch_reference`. Runs the Triton kernels
    when ``ids`` is on a CUDA device (or when Triton's interpreter was on at import,
    ``TRITON_INTERPRET=1``); otherwise runs the reference. No host synchronisation: capturable in a
    CUDA graph.

    Ids outside ``[0, E)`` are unrouted. ``check_ids`` makes a negative id an error (the operator's contract: ids
    >= E mean "no expert", a negative one is a router's bug): on CUDA a device assert in the histogram launch, which
    reads every id anyway (no launch of its own, no host synchronisation; as with ``torch._assert_async``, the
    process's CUDA context does not survive a failed one), on the CPU a ``ValueError``.
    """
    _check_args(ids, num_experts, block_m)
    if ids.is_cuda or _INTERPRETED:
        return dispatch_forward(ids, num_experts, block_m, check_ids=check_ids)
    if check_ids:
        check_ids_on_host(ids)
    return dispatch_reference(ids, num_experts, block_m)
