"""What the sm_90 Gluon kernels share: the guarded Gluon imports, the switch and device checks, the descriptors over
row blocks of an ``[E, r, c]`` view, and the Gluon device helpers more than one kernel calls.

Gluon is experimental: its import (and API) may be missing from a Triton build; :data:`GLUON` says whether it
imported, and the kernels' modules import the Gluon names from here. Its API also changes from one Triton release
to the next: the kernels are written and tested against Triton 3.6 and take launches only there (:data:`SUPPORTED`,
:func:`takes`; elsewhere the Triton kernels run). A Gluon function resolves the functions it calls
in its own module's namespace: the kernels call the helpers below as ``common.tile``, ``common.grouped_ids``,
``common.ring_barriers`` and ``common.release``.
"""
from __future__ import annotations

import functools

import torch
import triton

from ..autotune import options

try:  # Gluon is experimental: its import (and API) may be missing from a Triton build
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    GLUON = True
except ImportError:  # pragma: no cover - depends on the Triton build
    GLUON = False

# The Triton release the kernels are written and tested against. Gluon's API moves between releases (Triton 3.9's
# shared memory descriptors have no ``_reinterpret``, which the gathering kernels' epilogues use), so on another the
# kernels would fail to compile at their first launch: there the Triton kernels take every launch.
SUPPORTED = GLUON and triton.__version__.startswith("3.6.")

__all__ = ["GLUON", "SUPPORTED", "enabled", "takes", "is_sm90", "sm_count", "rows_view", "row_block_descs", "layout",
           "rows_ok"]


if GLUON:
    @gluon.jit
    def grouped_ids(t, num_m, num_n, GROUP_M: gl.constexpr):
        """(row tile, column block) of tile ``t``: ``triton.common.grouped_tile_ids`` in Gluon (a Gluon kernel cannot
        call a Triton function)."""
        in_group = GROUP_M * num_n
        first_m = (t // in_group) * GROUP_M
        size = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (t % in_group) % size, (t % in_group) // size

    @gluon.jit
    def tile(t, num_m, num_n, tile0, tiles_total, tile_expert_ptr, tile_start_ptr, offsets_ptr, slot0, slot1,
             GROUP_M: gl.constexpr):
        """Tile ``t`` of the launch, in the Triton kernel's grouped order: (expert or -1, start, first, end, pid_n);
        the rows the tile owns are [first, end), as ``triton.common.window_tile``."""
        pid_m, pid_n = grouped_ids(t, num_m, num_n, GROUP_M)
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
    def ring_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr):
        """(ready, empty) of a ring of ``STAGES``: ready counts ``READY_COUNT`` arrivals (128 where each thread of a
        4-warp producer arrives when its cp.async copies land; 1 where TMA copies complete it), empty one arrival
        of the consumers."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=READY_COUNT)
            mbarrier.init(empty.index(i), count=1)
        return ready, empty

    @gluon.jit
    def release(empty_a, empty_b, g, SA: gl.constexpr, SB: gl.constexpr, pred):
        """Step ``g``'s stages of both rings are free again: its MMA is done (``g`` may be -1 where ``pred`` is
        false)."""
        mbarrier.arrive(empty_a.index((g + SA) % SA), pred=pred)
        mbarrier.arrive(empty_b.index((g + SB) % SB), pred=pred)


def enabled() -> bool:
    """Whether the Gluon kernels (:mod:`.down`'s, :mod:`.gather`'s, :mod:`.dw`'s) may take launches: the kernel
    option ``gluon`` in force (``autotune.options()``)."""
    return options().gluon


def takes(t: torch.Tensor) -> bool:
    """Whether the Gluon kernels may take launches over ``t``'s device: a Triton they support (:data:`SUPPORTED`),
    the kernel option ``gluon`` in force (:func:`enabled`) and an sm_90 CUDA device."""
    return SUPPORTED and enabled() and t.is_cuda and is_sm90(t.device)


_SM90: dict[int, bool] = {}


def is_sm90(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)
    return _SM90[index]


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def rows_view(v: torch.Tensor):
    """(the [rows, cols] view of the storage under an [E, r, c] view with unit column stride, e_rows), or None
    when expert e's rows are not rows ``e * e_rows ..`` of one such view."""
    E, r, c = v.shape
    if v.stride(2) != 1 or v.stride(1) <= 0 or v.stride(0) % v.stride(1) or E == 0 or r == 0 or c == 0:
        return None
    e_rows = v.stride(0) // v.stride(1)
    if E > 1 and e_rows < r:
        return None  # experts' matrices overlap
    return torch.as_strided(v, ((E - 1) * e_rows + r, c), (v.stride(1), 1)), e_rows


def layout(block, dtype):
    """The NVMMA shared layout of a 16-bit ``block`` (a descriptor's or a shared buffer's)."""
    return _layout_of(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def _layout_of(block: tuple, dtype):  # a few microseconds a call otherwise, for each of ~17 descriptors a step
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def row_block_descs(views: list, block: list[int]) -> tuple[tuple, tuple] | None:
    """(Gluon descriptors with ``block`` over each ``[E, r, c]`` view's storage rows, each view's rows from one
    expert to the next), or None when some view's experts are not row blocks of one view (:func:`rows_view`).
    The views' bases and row strides are 16-byte aligned: ``triton.common.weight_tma_mode`` proved it."""
    descs, e_rows = [], []
    for v in views:
        rv = rows_view(v)
        if rv is None:
            return None
        descs.append(GluonDescriptor.from_tensor(rv[0], block, layout(block, v.dtype)))
        e_rows.append(rv[1])
    return tuple(descs), tuple(e_rows)


def rows_ok(t: torch.Tensor) -> bool:
    """``t`` [rows, cols] can be read or written through TMA: unit column stride, 16-byte aligned base and rows."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
