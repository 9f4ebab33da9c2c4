"""Per-expert pointer tables: how the Triton kernels address expert weights without copying them.

An expert weight of one role (gate, up or down) is E matrices of one shape and one pair of strides,
wherever they live: slices of one ``[E, r, c]`` parameter (Hugging Face's fused ``gate_up_proj``, a
transposed or interleaved view of it) or E separate ``nn.Linear`` weights of a ``ModuleList``. A
:class:`WeightTable` holds the address of each expert's element ``[0, 0]`` plus the two strides; the
kernels load ``ptrs[e]`` once per program and cast it to a pointer. Gradients are written through
tables of the same form, so a weight gradient lands in the parameter's own layout with no copy.

Tables of one ``[E, r, c]`` tensor are built on the device (one ``arange``; no host-to-device copy, so
CUDA-graph capture works) and cached by (first address, E, expert stride, device, stream): the
table's content is a function of the key, so a hit is always right, and a step reuses the last
step's tables instead of launching kernels for them (three launches per table before: 27 of a layer
step's 78; H100; docs/host.md).
Tables of separate tensors are a host-to-device copy of E addresses, cached by those addresses.
No table is cached while this thread allocates from a CUDA graph's private memory pool (a capture, or the
warm-up run of torch.compile's CUDA-graph trees under ``mode="reduce-overhead"``): the graph reuses that
memory, so a cached table would be overwritten, and the trees reject a warm-up that leaves such a tensor alive.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .program import host_step
from .reference import ExpertParams

__all__ = ["WeightTable", "ExpertTables", "table_of", "table_of_list", "table_of_addresses", "tables_of",
           "interleaved_gate_up", "interleaved_table", "cacheable", "stream_key"]


class WeightTable(NamedTuple):
    """E matrices ``[rows, cols]``: element ``[i, j]`` of expert e at byte address
    ``ptrs[e] + (i * stride_r + j * stride_c) * dtype.itemsize``."""

    ptrs: Tensor  # [E] int64 byte addresses, on the kernels' device
    rows: int
    cols: int
    stride_r: int  # elements
    stride_c: int  # elements
    dtype: torch.dtype
    # bytes: a power of two <= 16 dividing every address in ptrs. A pointer loaded from a table carries
    # no alignment the compiler can see; the kernels assert this much so weight tiles load 16 bytes at a time.
    align: int = 1
    # the [E, rows, cols] tensor the table addresses, when it is one (table_of): the host can then describe
    # every expert's matrix with one tensor descriptor
    dense: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.ptrs.numel()


class ExpertTables(NamedTuple):
    """The three expert weights as tables: gate/up ``[h, d]`` (``up`` None for a plain activation),
    down ``[d, h]``."""

    gate: WeightTable
    up: WeightTable | None
    down: WeightTable


def interleaved_gate_up(gate: WeightTable, up: WeightTable | None) -> bool:
    """Whether gate and up are interleaved column by column in one ``[.., 2h]`` row per input column (gpt-oss's
    ``gate_up_proj [E, d, 2h]``: gate = columns 0::2, up = 1::2): both tables views of one tensor with the same
    strides, a row stride of 2 elements, up's matrices one element after gate's. Then each expert's gate and up
    rows form one ``[2h, cols]`` matrix with unit row stride (row 2j gate's row j, row 2j + 1 up's), which the
    kernels read (and, for gradients, write) as one 2h-wide matrix (:func:`interleaved_table`) instead of two strided
    ones (element-wise gathers, no tensor descriptor). The kernels then keep A|B and dA|dB interleaved the same way,
    column 2j A's (dA's) column j and 2j + 1 B's (dB's), so that dX and dW_gate|up are plain GEMMs over 2h."""
    if up is None or gate.dense is None or up.dense is None or gate.dtype != up.dtype:
        return False
    g, u = gate.dense, up.dense
    E, h, c = g.shape
    return (u.shape == g.shape and u.stride() == g.stride() and h > 0 and g.stride(1) == 2
            and (c <= 1 or g.stride(2) >= 2 * h)  # the [2h, c] matrices do not overlap themselves
            and u.data_ptr() == g.data_ptr() + g.element_size())


def interleaved_table(gate: WeightTable, up: WeightTable) -> WeightTable:
    """Where gate and up are interleaved (:func:`interleaved_gate_up`): one table of their ``[2h, cols]`` matrices,
    row 2j gate's row j and 2j + 1 up's (unit row stride), through gate's addresses."""
    g = gate.dense  # [E, h, c] with strides (., 2, stride_c)
    E, h, c = g.shape
    return table_of(g.as_strided((E, 2 * h, c), (g.stride(0), 1, g.stride(2))))


def table_of(w: Tensor) -> WeightTable:
    """Table of the E matrices of an ``[E, r, c]`` tensor (any strides, views included)."""
    if w.dim() != 3:
        raise ValueError(f"table_of expects an [E, rows, cols] tensor, got shape {tuple(w.shape)}")
    E, r, c = w.shape
    step = w.stride(0) * w.element_size() if E > 1 else 0  # bytes from one expert's matrix to the next
    ptrs = _strided_ptrs(w.data_ptr(), E, step, w.device)
    return WeightTable(ptrs, r, c, w.stride(1), w.stride(2), w.dtype, math.gcd(16, w.data_ptr(), step), w)


def _trees_warming_up(device: torch.device) -> bool:
    """Whether torch.compile's CUDA-graph trees are running a graph's warm-up on ``device``: eagerly, with this
    thread's allocations coming from the pool of the graphs they record next."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # imported by Inductor once it compiles for graphs
    if trees is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    manager = trees.get_manager(index, create_if_none_exists=False)
    return manager is not None and manager.in_warmup


def cacheable(device: torch.device) -> bool:
    """Whether a tensor made now on ``device`` may be kept for later calls: a CUDA device, with allocations not coming
    from a CUDA graph's pool. A tensor made during a capture holds its values only once the graph replays, and one
    made during the trees' warm-up sits in memory the recorded graph reuses."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing() and not _trees_warming_up(device)


def stream_key(device: torch.device) -> int:
    """The current stream of a CUDA ``device``, for cache keys: a cached tensor is read only on the stream that
    wrote it (a hit is never read on a stream the kernel that wrote it may not have reached)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


@host_step  # (a replay makes the table again over its own tensors: a gradient buffer's table moves with it)
def _strided_ptrs(first: int, E: int, step: int, device: torch.device) -> Tensor:
    """``[E]`` int64 addresses ``first + e * step`` on ``device``, cached per stream where :func:`cacheable`."""
    if not cacheable(device):
        return _arange_ptrs(first, E, step, device)
    return _cached_strided_ptrs(first, E, step, device, stream_key(device))


@functools.lru_cache(maxsize=256)
def _cached_strided_ptrs(first: int, E: int, step: int, device: torch.device, stream: int) -> Tensor:  # noqa: ARG001
    return _arange_ptrs(first, E, step, device)


def _arange_ptrs(first: int, E: int, step: int, device: torch.device) -> Tensor:
    if step == 0 or E == 0:  # one expert, or every expert at one address (a broadcast view)
        return torch.full((E,), first, dtype=torch.int64, device=device)
    return torch.arange(first, first + E * step, step, dtype=torch.int64, device=device)


@host_step
def _cached_ptrs(addresses: tuple[int, ...], device: torch.device) -> Tensor:
    """``[E]`` int64 ``addresses`` on ``device``, cached by them, except while allocations come from a CUDA graph's
    pool. During a capture the graph copies them from pinned host memory at each replay, so that memory is kept
    for the life of the process (8 bytes an expert, per captured table)."""
    if device.type != "cuda":
        return torch.tensor(addresses, dtype=torch.int64, device=device)
    if torch.cuda.is_current_stream_capturing():
        host = torch.tensor(addresses, dtype=torch.int64).pin_memory()
        _CAPTURED_HOST_TABLES.append(host)
        return host.to(device, non_blocking=True)
    if _trees_warming_up(device):
        return _addresses_tensor(addresses, device)
    return _cached_addresses_tensor(addresses, device)


def _addresses_tensor(addresses: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor(addresses, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


_cached_addresses_tensor = functools.lru_cache(maxsize=256)(_addresses_tensor)
_CAPTURED_HOST_TABLES: list[Tensor] = []  # read by captured graphs' copies at every replay


def table_of_list(ws: Sequence[Tensor]) -> WeightTable:
    """Table of E separate ``[r, c]`` tensors of one shape, dtype, device and strides."""
    if not ws:
        raise ValueError("table_of_list needs at least one tensor")
    first = ws[0]
    for w in ws:
        if w.dim() != 2 or w.shape != first.shape or w.stride() != first.stride() or w.dtype != first.dtype \
                or w.device != first.device:
            raise ValueError("table_of_list: every expert's matrix must share shape, strides, dtype and device; got "
                             f"{[(tuple(t.shape), t.stride(), t.dtype, str(t.device)) for t in ws]}")
    addresses = tuple(w.data_ptr() for w in ws)
    ptrs = _cached_ptrs(addresses, first.device)
    r, c = first.shape
    return WeightTable(ptrs, r, c, first.stride(0), first.stride(1), first.dtype, math.gcd(16, *addresses))


def table_of_addresses(addresses: tuple[int, ...], rows: int, cols: int, stride_r: int, stride_c: int,
                       dtype: torch.dtype, device: torch.device) -> WeightTable:
    """Table of E matrices at the given byte addresses (the operator's per-expert parameters)."""
    return WeightTable(_cached_ptrs(addresses, device), rows, cols, stride_r, stride_c, dtype, math.gcd(16, *addresses))


def tables_of(experts: ExpertParams) -> ExpertTables:
    """Tables of dense ``[E, ...]`` expert weights (tests and benchmarks; the operator builds its own)."""
    return ExpertTables(table_of(experts.gate), None if experts.up is None else table_of(experts.up),
                        table_of(experts.down))
