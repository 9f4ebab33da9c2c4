"""What the Triton kernels share: the device helpers that map programs to row tiles of a slot window and read
expert weights through pointer tables or tensor descriptors, and the host helpers that check the inputs, prove
alignment, choose how weights are read and cut the slots into windows.

Expert weights are read only through per-expert pointer tables (:class:`~moeblaze_fx.kernels.tables.WeightTable`):
each program loads ``ptrs[e]`` once (:func:`table_ptr`) and indexes the matrix with the table's two strides.

Alignment: an address loaded from a table carries no alignment the compiler can see, and without one every weight
load becomes a 2-byte access (no cp.async, no 16-byte vectors). The host passes the tables' proven alignment as a
constexpr (``W_ALIGN``, from ``WeightTable.align`` when the table has that field, :func:`table_align`; 1 otherwise)
and the kernels assert it with ``tl.multiple_of``.

Tensor descriptors: where a weight matrix has a unit stride, a 16-byte aligned other stride and a proven 16-byte
aligned base, the up and down kernels read its tiles through a descriptor (TMA on sm_90; :func:`weight_tma_mode`
picks the orientation, :func:`w_desc` / :func:`w_tile`). Tiles past a bound read as zeros, where the pointer loads
mask or wrap; both feed only outputs that are dropped at the store or zero terms, so the stored results of the two
paths are bitwise equal.

Row tiles come from the plan: ``tile_expert[i]`` / ``tile_start[i]`` describe ``plan_block_m()`` rows of one expert;
a tile may be ragged (masked against ``offsets[e+1]``), tiles past the last one hold -1 and their programs exit at
once, so grids are sized by the static bound ``max_tiles`` and no host synchronisation is needed. With
``window_slots`` the launches run once per *slot window* (:class:`SlotWindow`, a range of the expert-sorted slots):
a window's launches start at its first tile (found on the device) and clip each tile's rows to the window
(:func:`window_tile`), so a tile cut by a window boundary is computed by both windows, each storing its own rows.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import autotune
from ..act import ACT_CODES
from ..autotune import plan_block_m
from ..reference import Activation, DispatchPlan, max_tiles, parse_activation
from ..tables import ExpertTables, WeightTable, cacheable, stream_key

__all__ = ["SUPPORTED_DTYPES", "grouped_tile_ids", "table_ptr", "w_desc", "w_tile", "window_tile", "table_align",
           "tma_available", "ensure_tma_allocator", "weight_tma_mode", "check_table", "check_expert_inputs",
           "SlotWindow", "num_slot_windows", "slot_windows", "dot_precision", "desc_view"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------
@triton.jit
def grouped_tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (row tile, column block), GROUP_M row tiles at a time, so the
    programs running together share weight columns (and row tiles) in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pid_in_group) % group_size
    pid_n = (pid % num_pid_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def table_ptr(ptrs, e, elem_ty: tl.constexpr, ALIGN: tl.constexpr):
    """Expert e's matrix from a pointer table ``ptrs``: one int64 load, cast to a pointer to ``elem_ty``.
    ``ALIGN`` (bytes, proven by the host) restores the alignment the compiler cannot see through the cast."""
    ptr = tl.load(ptrs + e).to(tl.pointer_type(elem_ty))
    if ALIGN > 1:  # on the pointer: a hint on the integer does not survive the cast (checked in the sm_90 SASS)
        ptr = tl.multiple_of(ptr, ALIGN)
    return ptr


@triton.jit
def w_desc(base, k_dim, n_dim, stride_k, stride_n, MODE: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """A tensor descriptor (TMA on sm_90) over an expert's B [k_dim, n_dim] at ``base``: MODE 1 when n is the
    contiguous axis, 2 when k is. Tiles past either bound read as zeros."""
    if MODE == 1:
        return tl.make_tensor_descriptor(base, shape=[k_dim, n_dim], strides=[stride_k, 1],
                                         block_shape=[BLOCK_K, BLOCK_N])
    else:
        return tl.make_tensor_descriptor(base, shape=[n_dim, k_dim], strides=[stride_n, 1],
                                         block_shape=[BLOCK_N, BLOCK_K])


@triton.jit
def w_tile(desc, k0, n0, MODE: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B at (k0, n0) through a descriptor from :func:`w_desc`."""
    if MODE == 1:
        return desc.load([k0, n0])
    else:
        return desc.load([n0, k0]).T


@triton.jit
def window_tile(pid_m, tile0_ptr, tiles_total, tile_expert_ptr, tile_start_ptr, offsets_ptr, slot0, slot1):
    """Row tile ``pid_m`` of a launch over the slot window [slot0, slot1), counted from the window's first
    tile (``tile0_ptr``, computed on the device): (expert, tile start, first row, end row). The rows a
    program owns are [first, end): the tile's rows clipped to the window (a tile cut by a window boundary is
    computed by both windows, each storing its own rows). Expert -1: nothing to do (past the plan's last
    tile, or the tile lies outside the window)."""
    t = pid_m + tl.load(tile0_ptr)
    inside = t < tiles_total
    t = tl.minimum(t, tiles_total - 1)
    e = tl.load(tile_expert_ptr + t)
    start = tl.load(tile_start_ptr + t)
    end = tl.minimum(tl.load(offsets_ptr + tl.maximum(e, 0) + 1), slot1)
    first = tl.maximum(start, slot0)
    e = tl.where(inside & (e >= 0) & (first < end), e, -1)
    return e, start, first, end


# ---------------------------------------------------------------------------------------------
# Host helpers
# ---------------------------------------------------------------------------------------------
def table_align(*tables: WeightTable | None) -> int:
    """Byte alignment every address of these tables is known to have (a power of two <= 16).

    Read from the table's ``align`` field when it has one (the table builders know the addresses);
    1 otherwise, which is always correct but costs the 16-byte loads on the GPU."""
    align = 16
    for t in tables:
        if t is not None:
            a = int(getattr(t, "align", 1) or 1)
            align = min(align, a & -a)  # lowest set bit: a power of two dividing a
    return max(align, 1)


def tma_available(device: torch.device) -> bool:
    """Whether kernels may build tensor descriptors on ``device``: TMA (sm_90+), or the Triton interpreter
    (which runs them too). Sets Triton's scratch allocator when needed (:func:`ensure_tma_allocator`)."""
    if autotune.interpreting():
        return True
    if device.type != "cuda" or not _has_tma(device.index if device.index is not None else torch.cuda.current_device()):
        return False
    ensure_tma_allocator()
    return True


@functools.lru_cache(maxsize=None)
def _has_tma(index: int) -> bool:
    """CUDA device ``index`` is sm_90 or newer (and not ROCm: descriptors are untested there). Cached: it is
    asked at every launch, and a windowed step's launches are bound by the host (docs/host.md)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def ensure_tma_allocator() -> None:
    """Tensor descriptors built inside a kernel need global scratch (128 bytes per descriptor and program)
    from Triton's allocator: set one that takes it from PyTorch's caching allocator, unless the user has
    set their own. The allocator is a context variable: this runs in the thread that launches (autograd's,
    in backward), where an allocator the user set in another thread is not seen and this one is set."""
    from triton.runtime import _allocation
    current = getattr(_allocation, "_allocator", None)
    if current is not None and not isinstance(current.get(), _allocation.NullAllocator):
        return
    triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:  # noqa: ARG001 (Triton's allocator signature)
    return torch.empty(size, dtype=torch.int8, device="cuda")


def weight_tma_mode(strides: list[tuple[int, int]], align: int, itemsize: int, device: torch.device) -> int:
    """How a launch reads its weight tiles B[e] [k, n], given each table's (stride_k, stride_n) and their
    proven byte alignment: 1 = tensor descriptors with n contiguous, 2 = with k contiguous, 0 = pointers.
    A descriptor needs a 16-byte aligned base, a unit stride and a 16-byte aligned other stride.
    Measured: docs/up.md, docs/down.md (tensor descriptors)."""
    if align < 16 or not strides or not tma_available(device):
        return 0
    for mode, unit in ((1, 1), (2, 0)):
        if all(st[unit] == 1 and (st[1 - unit] * itemsize) % 16 == 0 for st in strides):
            return mode
    return 0


def check_table(name: str, t: WeightTable, rows: int, cols: int, E: int, x: Tensor,
                dtypes: tuple[torch.dtype, ...]) -> None:
    if (t.rows, t.cols) != (rows, cols):
        raise ValueError(f"{name} table must describe [{rows}, {cols}] matrices, got [{t.rows}, {t.cols}]")
    if t.ptrs.dim() != 1 or t.ptrs.numel() != E or t.ptrs.dtype != torch.int64:
        raise ValueError(f"{name} table must hold E={E} int64 addresses, got {t.ptrs.numel()} of {t.ptrs.dtype}")
    if t.ptrs.device != x.device:
        raise ValueError(f"{name} table lives on {t.ptrs.device}, x on {x.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}"
                        + ("; cast the weights (or run under autocast) before calling" if len(dtypes) == 1 else ""))


def _check_bias(name: str, b: Tensor | None, shape: tuple[int, int], x: Tensor) -> None:
    if b is None:
        return
    if tuple(b.shape) != shape:
        raise ValueError(f"{name} must be [E, n] = {shape}, got shape {tuple(b.shape)}")
    if b.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {b.dtype}; it must have x's dtype {x.dtype}")
    if b.device != x.device:
        raise ValueError(f"{name} is on {b.device}, x on {x.device}")
    if not b.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {b.stride()}); pass {name}.contiguous()")


def check_expert_inputs(x: Tensor, weights: Tensor, w: ExpertTables, plan: DispatchPlan,
                        activation: "Activation | str", gate_bias: Tensor | None = None,
                        up_bias: Tensor | None = None, down_bias: Tensor | None = None
                        ) -> tuple[int, int, int, int, int, Activation]:
    """Validate shapes, dtypes, devices, the tables and the plan's tile height; return (T, d, K, E, h, act)."""
    act = parse_activation(activation)
    if act.name not in ACT_CODES:
        raise ValueError(f"unsupported activation {act!r}; the Triton expert kernels implement {tuple(ACT_CODES)}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; the expert kernels support {SUPPORTED_DTYPES}")
    if weights.dim() != 2 or weights.shape[0] != T:
        raise ValueError(f"weights must be [T, K] with T={T}, got shape {tuple(weights.shape)}")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"routing weights must be a float tensor, got {weights.dtype}")
    K = weights.shape[1]
    if not isinstance(w, ExpertTables):
        raise TypeError(f"w must be an ExpertTables (see kernels.tables), got {type(w).__name__}")
    E = w.gate.ptrs.numel()
    h = w.gate.rows
    check_table("gate", w.gate, h, d, E, x, (x.dtype,))
    if act.gated != (w.up is not None):
        raise ValueError(f"activation {act.name!r} " + ("needs an up table (gated)" if act.gated
                                                        else "is not gated: pass w.up=None"))
    if w.up is not None:
        check_table("up", w.up, h, d, E, x, (x.dtype,))
    check_table("down", w.down, d, h, E, x, (x.dtype,))
    if up_bias is not None and not act.gated:
        raise ValueError(f"up_bias given, but activation {act.name!r} has no up projection")
    _check_bias("gate_bias", gate_bias, (E, h), x)
    _check_bias("up_bias", up_bias, (E, h), x)
    _check_bias("down_bias", down_bias, (E, d), x)
    tensors = (x, weights) + tuple(plan)
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, weights, expert tables and the plan must live on one device; got "
                         + ", ".join(str(t.device) for t in tensors))
    if plan.offsets.numel() != E + 1 or plan.token_index.numel() != T * K or plan.slot_of.numel() != T * K:
        raise ValueError(f"plan does not match the inputs (E={E}, T*K={T * K}): offsets {plan.offsets.numel()}, "
                         f"token_index {plan.token_index.numel()}, slot_of {plan.slot_of.numel()}")
    bm = plan_block_m()
    if plan.tile_expert.numel() != max_tiles(T * K, E, bm) or plan.tile_start.numel() != plan.tile_expert.numel():
        raise ValueError(f"plan has {plan.tile_expert.numel()} row tiles, the kernels expect "
                         f"{max_tiles(T * K, E, bm)}: build it with block_m=plan_block_m() (= {bm})")
    return T, d, K, E, h, act


class SlotWindow(NamedTuple):
    """A range [slot0, slot1) of the plan's slots (expert-major order) that one round of launches covers.

    The per-slot transients of a round (H, Y, dA|dB, w*H, dX per slot) hold only the window's rows, so the
    window bounds them; each expert's weights are read by the windows its slots fall in, so, unlike
    chunks of tokens, a window does not re-read every weight."""

    slot0: int
    slot1: int
    tile0: Tensor  # [1] int32 on the device: the first row tile that meets the window
    num_tiles: int  # a bound on the row tiles that meet the window: the launches' grid


def num_slot_windows(num_slots: int, window_slots: int) -> int:
    """How many windows :func:`slot_windows` makes of ``num_slots`` slots."""
    if window_slots < 0:
        raise ValueError(f"window_slots must be >= 0 (0: one window), got {window_slots}")
    return triton.cdiv(num_slots, window_slots) if 0 < window_slots < num_slots else 1


def slot_windows(plan: DispatchPlan, window_slots: int) -> list[SlotWindow]:
    """Windows of at most ``window_slots`` slots (0: one window of all N), as equal as possible.

    The row tiles meeting a window are a contiguous run of the plan's tiles (they are in slot order); the
    first one is found on the device (a search over the tiles' ends), so there is no host synchronisation.
    A window of n slots meets at most ``max_tiles(n, E, block_m) + 1`` tiles (one per expert for its ragged
    end, plus one cut by the window's start)."""
    N = plan.token_index.numel()
    total = plan.tile_expert.numel()
    E = plan.offsets.numel() - 1
    dev = plan.token_index.device
    count = num_slot_windows(N, window_slots)
    if count == 1:
        return [SlotWindow(0, N, _zero_tile(dev), total)]
    step = triton.cdiv(N, count)
    bm = plan_block_m()
    te = plan.tile_expert.long()
    ends = torch.minimum(plan.tile_start.long() + bm, plan.offsets.long()[te.clamp(min=0) + 1])
    ends = torch.where(te >= 0, ends, torch.iinfo(torch.int64).max)  # unused tiles: after every slot
    starts = torch.arange(0, N, step, device=dev, dtype=torch.int64)
    firsts = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # first tile ending after slot0
    return [SlotWindow(s0, min(s0 + step, N), firsts[i: i + 1], min(total, max_tiles(min(step, N - s0), E, bm) + 1))
            for i, s0 in enumerate(range(0, N, step))]


def _zero_tile(device: torch.device) -> Tensor:
    """``[1]`` int32 zero on ``device``: one window's first tile. The kernels only read it, so it is made once per
    device and stream where a kept tensor may be (``tables.cacheable``; a fill launch a call otherwise)."""
    if not cacheable(device):
        return torch.zeros(1, dtype=torch.int32, device=device)
    return _kept_zero(device, stream_key(device))


@functools.lru_cache(maxsize=64)
def _kept_zero(device: torch.device, stream: int) -> Tensor:  # noqa: ARG001 (a key)
    return torch.zeros(1, dtype=torch.int32, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for operands of ``dtype``: float32 as the call's kernel options say
    (:func:`.autotune.float32_products`), "ieee" under Triton's interpreter (which multiplies float32 in float32
    whatever is asked, and knows no bf16x6 or bf16x3); 16-bit operands ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if autotune.interpreting() else autotune.float32_products()


def desc_view(table: WeightTable, k_is_rows: bool, mode: int) -> Tensor | None:
    """The [E, k, n] (mode 1) or [E, n, k] (mode 2) view of the table's one [E, r, c] tensor that a descriptor of
    every expert's B[e] is built over (unit last stride); None when there is no such tensor, it is empty or its
    expert stride is not 16-byte aligned."""
    dense = table.dense
    if dense is None or mode == 0 or dense.numel() == 0 or (dense.stride(0) * dense.element_size()) % 16:
        return None  # (a descriptor's shape must be positive)
    kn = dense if k_is_rows else dense.transpose(1, 2)
    return kn if mode == 1 else kn.transpose(1, 2)
