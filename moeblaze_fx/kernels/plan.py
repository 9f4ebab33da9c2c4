"""The per-call plan: which backend runs each unit, the slot windows, and the weights' views and descriptors.

:func:`forward_plan` is built once per forward call (:func:`.forward.expert_forward`) and :func:`backward_plan` once
per backward call (:func:`.backward.expert_backward`), before the first launch. They resolve, from the weight tables
and x alone, what every window's launches share: the slot windows (:func:`.triton.common.slot_windows`), the up
projection's weight alignment and descriptor mode (:func:`.triton.up.up_weight_mode`), the down kernel's B operand
(:func:`.triton.down.down_operand`, for Y and for dX), and the Gluon kernels' views of the weights where an sm_90
kernel may take the unit (:mod:`.sm90.gather`, :mod:`.sm90.down`). What also depends on a window's own buffers (their
alignment, which follows from x's allocator, dtype and shapes) is asked of the plan per window through its methods
(:meth:`UpUnit.on_sm90`, :meth:`DownUnit.on_sm90`, :meth:`BackwardPlan.dh_launches`,
:meth:`BackwardPlan.dw_on_sm90`);
the orchestration then runs what they say. The part resolved from the tables and x alone (the units: every field but
the windows) is kept for later calls where the caller gives a :class:`UnitsKey` (the operator does, for the
parameters' tables it keeps).

The Gluon kernels give bitwise the Triton kernels' results wherever they take a launch; the kernel option
``gluon=False`` (``config.KernelOptions``) keeps the Triton kernels everywhere (:func:`.sm90.common.enabled`).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

from torch import Tensor

from .autotune import options, plan_block_m
from .reference import Activation, DispatchPlan
from .sm90 import down as sm90_down
from .sm90 import dw as sm90_dw
from .sm90 import gather as sm90_gather
from .tables import ExpertTables, WeightTable, interleaved_gate_up, interleaved_table
from .triton import dh as tdh
from .triton import down as tdown
from .triton import up as tup
from .triton.common import SlotWindow, desc_view, slot_windows, table_align, weight_tma_mode

__all__ = ["UpUnit", "DownUnit", "ForwardPlan", "BackwardPlan", "UnitsKey", "keep", "forward_plan", "backward_plan",
           "up_sm90_weights"]


class UnitsKey(NamedTuple):
    """Lets a call's weight units (what :func:`forward_plan` and :func:`backward_plan` resolve from the tables and x
    alone: the units' backends, modes and descriptors) be kept for later calls. ``key`` must determine the tables:
    the parameters' addresses, shapes, strides and dtypes, the layout, the stream the tables were made for. The
    tables' ``dense`` views are of the ``owners`` (the parameters) detached, so what is kept holds their memory but
    not them, and goes when the first of them does."""

    key: tuple
    owners: tuple


# The units kept, one entry per (owners, which units, x's dtype and device, the kernel options in force,
# tdh.DH_SPLIT), holding the UnitsKey.key they were made under: a call under another key (the parameters moved)
# replaces them, so no more than the parameters' current memory is ever held. Building them cost about a tenth of an
# operator step's host time (the Gluon kernels' descriptors over the weights, at (8192, 1024, 512, 64, 8): 0.23 ms
# a forward, 0.17 ms over the three backward calls; H100, docs/host.md). An entry goes with the first of its owners
# to go; a full cache is emptied.
_UNITS: dict = {}
_UNITS_MAX = 256


def keep(cache: UnitsKey | None, what: tuple, x: Tensor, make):
    """``make()``, kept under ``cache`` (see :class:`UnitsKey`) and ``what`` where given: the plans' weight units, and
    the operator's weight tables (``ops._expert_weights``)."""
    if cache is None:
        return make()
    slot = (tuple(map(id, cache.owners)), what, x.dtype, x.device, options(), tdh.DH_SPLIT)
    got = _UNITS.get(slot)
    if got is not None and got[0] == cache.key:
        return got[1]
    units = make()
    if got is None:
        try:
            for owner in cache.owners:  # (an owner's id is not reused before its finalizer has run)
                weakref.finalize(owner, _UNITS.pop, slot, None)
        except TypeError:  # an owner that takes no weak reference: nothing could drop the entry, so none is made
            return units
        if len(_UNITS) >= _UNITS_MAX:
            _UNITS.clear()
    _UNITS[slot] = (cache.key, units)
    return units


class UpUnit(NamedTuple):
    """The up projection's weights as each backend reads them."""

    align: int  # W_gate's and W_up's proven alignment (tup.up_weight_mode)
    w_tma: int  # their descriptor mode in the Triton kernel: 0 pointers, 1 / 2 descriptors
    sm90: "sm90_gather.GatherWeights | None"  # the Gluon kernel's view, where it may take windows
    biased: bool  # gate or up biases (the Gluon kernel takes none)

    def on_sm90(self, x: Tensor, hid: Tensor, pre: Tensor | None, act: Activation) -> bool:
        """Whether a window's up projection (H into ``hid``, A|B into ``pre`` when kept) runs on the Gluon kernel."""
        return self.sm90 is not None and sm90_gather.up_usable(x, hid, pre, act.name, self.biased, plan_block_m())


class DownUnit(NamedTuple):
    """The down kernel's B operand (Y = H @ W_down[e].T, or dX = dA @ W_gate[e] + dB @ W_up[e]) as each backend reads
    it."""

    triton: tdown.DownOperand
    sm90: "sm90_down.Sm90Weights | None"  # the Gluon kernel's view of B0, B1 where it may take the launches

    def on_sm90(self, a: Tensor, out: Tensor) -> bool:
        """Whether a window's launch (``a`` its rows, ``out`` its output) runs on the Gluon kernel."""
        return self.sm90 is not None and sm90_down.usable(a, out, plan_block_m())

    def project(self, a: Tensor, k_dim: int, n_dim: int, plan: DispatchPlan, out: Tensor, bias: Tensor | None,
                window: SlotWindow) -> Tensor:
        """out[slot] = a[slot, :k_dim] @ B0[e] (+ a[slot, k_dim:2k_dim] @ B1[e]) (+ bias[e]) for every routed slot of
        ``window``, on the backend :meth:`on_sm90` picks (see :func:`.triton.down.down_project`)."""
        if window.num_tiles == 0 or out.numel() == 0:
            return out
        if self.on_sm90(a, out):
            return sm90_down.down_sm90(a, self.sm90, k_dim, n_dim, plan, out, bias, window)
        return tdown.down_project(a, k_dim, self.triton, n_dim, plan, out, bias, window)


def down_unit(b0: WeightTable, b1: WeightTable | None, k_is_rows: bool, k_dim: int, x: Tensor) -> DownUnit:
    """The down kernel's B operand for inputs like ``x`` (see :func:`.triton.down.down_operand`), and the Gluon
    kernel's view of it where the weights are row blocks of one tensor (descriptors over every expert) on CUDA."""
    b = tdown.down_operand(b0, b1, k_is_rows, k_dim, x)
    views = b.views
    sm90 = sm90_down.weights(views[0], views[1] if b1 is not None else None, b.mode == 2, k_dim) \
        if b.host and x.is_cuda else None
    return DownUnit(b, sm90)


def up_sm90_weights(w: ExpertTables, d: int, mode: int, x: Tensor) -> "sm90_gather.GatherWeights | None":
    """The Gluon up kernel's view of W_gate and W_up (B[e][k, n] = W[e][n, k]), or None where it cannot take
    them (see :func:`.sm90.gather.up_weights`; ``mode`` from :func:`.triton.up.up_weight_mode`)."""
    if not (x.is_cuda and mode and w.up is not None) or interleaved_gate_up(w.gate, w.up):
        return None  # (the Gluon kernel reads two [h, d] matrices, not one interleaved [2h, d])
    return sm90_gather.up_weights(desc_view(w.gate, False, mode), desc_view(w.up, False, mode), mode == 2, d)


def _dh_sm90_weights(w: ExpertTables, d: int, x: Tensor) -> "sm90_gather.GatherWeights | None":
    """The Gluon kernel's view of W_down for dh's GEMM (B[e][k, n] = W_down[e][k, n]), or None where it cannot
    take it (see :func:`.sm90.gather.dh_weights`)."""
    mode = weight_tma_mode([(w.down.stride_r, w.down.stride_c)], table_align(w.down), x.element_size(), x.device)
    if not (x.is_cuda and mode):
        return None
    return sm90_gather.dh_weights(desc_view(w.down, True, mode), mode == 2, d)


class ForwardPlan(NamedTuple):
    """What a forward call's windows share: the windows, the up projection's and the down kernel's weights."""

    windows: list[SlotWindow]
    up: UpUnit
    down: DownUnit  # Y = H @ W_down[e].T: B[e][k, n] = W_down[e][n, k]


def forward_plan(x: Tensor, w: ExpertTables, plan: DispatchPlan, d: int, h: int, biased: bool,
                 window_slots: int, cache: UnitsKey | None = None) -> ForwardPlan:
    """The plan of one forward call (inputs checked by :func:`.triton.common.check_expert_inputs`); its units kept
    under ``cache`` where given."""
    def make():
        align, w_tma = tup.up_weight_mode(w, x)
        return UpUnit(align, w_tma, up_sm90_weights(w, d, w_tma, x), biased), down_unit(w.down, None, False, h, x)

    up, down = keep(cache, ("forward", d, h, biased), x, make)
    return ForwardPlan(slot_windows(plan, window_slots), up, down)


class BackwardPlan(NamedTuple):
    """What a backward call's windows share, and the per-window choices of dh's and dW's launches."""

    windows: list[SlotWindow]
    # dX = dA @ W_gate[e] (+ dB @ W_up[e]): B[e][k, n] = W[e][k, n]; with ``pairs`` one B of 2h rows (gate's and up's
    # interleaved); None without the dx phase
    dx: DownUnit | None
    dh_sm90: "sm90_gather.GatherWeights | None"  # the Gluon view of W_down for dh's GEMM (split dh only)
    # "recompute" on sm_90: A|B recomputed by the forward's Gluon up kernel, then the fused dh (see .backward's doc)
    up_sm90: "sm90_gather.GatherWeights | None"
    # "recompute" with interleaved gate/up weights (gpt-oss): A|B recomputed by the Triton up kernel into the dA|dB
    # buffer, then dh as under "activations" in place over it; the up kernel's (align, w_tma) then
    up_mode: tuple[int, int] | None
    recompute: bool
    split: bool  # tdh.DH_SPLIT when the plan was made
    biased: bool
    # gate and up interleaved column by column (gpt-oss, tables.interleaved_gate_up): A|B and dA|dB are interleaved
    # alike (column 2j A's column j, 2j + 1 B's), so that dX and dW_gate|up are plain GEMMs over their 2h columns
    pairs: bool

    def dx_k(self, h: int) -> int:
        """The contraction of dX: dA's h columns and dB's h (two K loops, or one over 2h interleaved)."""
        return 2 * h if self.pairs else h

    def halves(self, dpre: Tensor, h: int) -> tuple[Tensor, Tensor]:
        """dA and dB as views of dA|dB ``dpre``."""
        return (dpre[:, 0::2], dpre[:, 1::2]) if self.pairs else (dpre[:, :h], dpre[:, h:])

    def dh_launches(self, grad_y: Tensor, x: Tensor, hw: Tensor, pre: Tensor, dpre: Tensor, weights: Tensor,
                    act: Activation, chunk: int) -> list[tuple[str, str | None, int]]:
        """The launches of one window's dh, in order, as (unit, kind, phase): ``"sm90.up"`` (A|B recomputed into
        ``dpre``, H into ``hw``), ``"triton.up"`` (likewise, through the Triton up kernel), ``"sm90.dh"`` (dh's GEMM,
        dH' into ``hw``), ``"sm90.dh_act"`` (dh's GEMM and its epilogue in one launch, over ``pre``), and
        ``"triton.dh"`` with the dh kernel's ``kind`` and PHASE (:func:`.triton.dh.dh_launch`). The window's buffers
        decide with the plan: the Gluon kernels need their rows 16-byte aligned (the fused one reads A|B by halves
        or, with ``pairs``, interleaved; under "recompute" with ``pairs`` the Triton up kernel recomputes A|B, then dh
        runs as under "activations")."""
        bm = plan_block_m()
        if self.up_sm90 is not None and (sm90_gather.up_usable(x, hw, dpre, act.name, self.biased, bm) and
                                         sm90_gather.dh_act_usable(grad_y, hw, dpre, dpre, weights, act.name, chunk,
                                                                   bm)):
            # A|B into the dA|dB buffer (H into hw, which the fused dh overwrites with w*H), exactly as the
            # forward computed them; the fused dh then reads each A|B element before it writes its dA|dB there
            return [("sm90.up", None, 0), ("sm90.dh_act", None, 0)]
        launches: list[tuple[str, str | None, int]] = []
        if self.up_mode is not None:
            launches.append(("triton.up", None, 0))
            phases = [("dh_gemm", 1), ("dh_act", 2)]
        elif self.recompute:
            phases = [("dh_recompute", 0)]
        elif self.split:
            phases = [("dh_gemm", 1), ("dh_act", 2)]
        else:
            phases = [("dh", 0)]
        for kind, phase in phases:
            if phase == 1 and self.dh_sm90 is not None and sm90_gather.dh_usable(grad_y, hw, plan_block_m()):
                if sm90_gather.dh_act_usable(grad_y, hw, pre, dpre, weights, act.name, chunk, plan_block_m()):
                    launches.append(("sm90.dh_act", None, 0))  # both phases in one launch: the same dA|dB and w*H
                    break
                launches.append(("sm90.dh", None, 0))  # the same dH', bitwise
                continue
            launches.append(("triton.dh", kind, phase))
        return launches

    @property
    def dh_recomputes(self) -> bool:
        """Whether the Triton dh kernel recomputes A|B itself (``"recompute"``, not through an up kernel)."""
        return self.recompute and self.up_mode is None

    def dw_on_sm90(self, tokens: Tensor, slots: Tensor, out: WeightTable) -> bool:
        """Whether a dW launch (:func:`.triton.dw.weight_grad`'s operands) runs on the Gluon kernel."""
        return sm90_dw.usable(tokens, slots, out, table_align(out))


def backward_plan(x: Tensor, w: ExpertTables, plan: DispatchPlan, d: int, h: int, window_slots: int,
                  recompute: bool, biased: bool, act_phase: bool, dx_phase: bool,
                  cache: UnitsKey | None = None) -> BackwardPlan:
    """The plan of one backward call (or of one of its phases: ``act_phase``, ``dx_phase`` say which units run); its
    units kept under ``cache`` where given."""
    units = keep(cache, ("backward", d, h, recompute, biased, act_phase, dx_phase), x,
                   lambda: _backward_units(x, w, d, h, recompute, biased, act_phase, dx_phase))
    return BackwardPlan(slot_windows(plan, window_slots), *units)


def _backward_units(x: Tensor, w: ExpertTables, d: int, h: int, recompute: bool, biased: bool, act_phase: bool,
                    dx_phase: bool) -> tuple:
    """The fields of :class:`BackwardPlan` after its windows."""
    pairs = interleaved_gate_up(w.gate, w.up)
    if not dx_phase:
        dx = None
    elif pairs:
        dx = down_unit(interleaved_table(w.gate, w.up), None, True, 2 * h, x)
    else:
        dx = down_unit(w.gate, w.up, True, h, x)
    split = tdh.DH_SPLIT
    dh_sm90 = _dh_sm90_weights(w, d, x) if split and act_phase else None
    up_mode = tup.up_weight_mode(w, x) if recompute else None  # the up kernel's (align, w_tma), for either recompute
    up_sm90 = up_sm90_weights(w, d, up_mode[1], x) if recompute and dh_sm90 is not None else None
    # the dh kernel's own recomputation would read interleaved weights with a 2-element stride (element-wise
    # gathers); as the Gluon path above does, each A|B element is read before it is written, by the program that
    # writes it. Only split: the epilogue launch (dh_act) has one configuration, never re-run by the tuner over its
    # own output.
    recompute_up = recompute and split and up_sm90 is None and pairs
    return dx, dh_sm90, up_sm90, up_mode if recompute_up else None, recompute, split, biased, pairs
