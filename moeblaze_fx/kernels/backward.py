"""Fused expert backward: never needs the expert outputs Y, never builds a gathered copy of x or dy.

This module runs it (:func:`expert_backward`); the kernels live in :mod:`.triton.dh`, :mod:`.triton.dw`,
:mod:`.triton.down`, :mod:`.triton.combine` and :mod:`.triton.up` (Triton), :mod:`.sm90.gather`, :mod:`.sm90.dw`
and :mod:`.sm90.down` (Gluon, sm_90).

Inputs: dy = grad_y [T, d], x [T, d], routing weights w [T, K], the weight tables (W_gate, W_up [h, d] per
expert, W_up absent for a plain activation; W_down [d, h]), the optional biases, the plan, and preact =
A|B [N, 2h] (or A [N, h], plain activation) in slot order, biases included (saved by the forward,
"activations" policy) or an empty tensor (``"recompute"`` policy: A|B are recomputed, one extra up GEMM,
inside the first kernel or, on sm_90, by the forward's up kernel; see below). Weight gradients are written
through the ``grads`` tables (x.dtype or float32; overwritten, or added to with ``accumulate=True``); bias
gradients are returned in float32.

Data flow (six launches, seven under "activations", + one small reduction, plus one small launch per bias)::

    _expert_dh_kernel   per row tile of one expert, one pass over d (under "activations" two launches: the
                        GEMM, dH' stored into the w*H buffer, then the epilogue reading it back; DH_SPLIT):
                          dH' = dy[tok] @ W_down[e]                (dy rows gathered on the fly)
                          A|B = x[tok] @ W_{gate|up}[e].T + b      (RECOMPUTE only, same pass over d)
                        epilogue, the activation recomputed in registers (constexpr ACT):
                          H = act(A, B)
                          dw partial = <dH', H> over this program's columns   (routing-weight gradient)
                          dH = w * dH';  dA, dB = act'(A, B) dH
                        ──▶ dA|dB [N, 2h] (dA [N, h] plain), w*H [N, h], partials [h/chunk, N] fp32 by slot
    _expert_bias_grad_kernel (down bias only), per expert and column block of d:
                          d_down_bias[e] = sum_{s in e} w_s dy[tok_s];  <dy[tok_s], b_down[e]> partials by slot
    dweights[p] = sum_r partials[r, slot_of[p]]                         (one gather launch, rows in a fixed
                                                                         order: deterministic)
    _expert_dw_kernel   dW_down[e]    = sum_{s in e} dy[tok_s].T (w*H)[s]  (dy gathered, slots = contraction)
    _expert_down_kernel dX[s]         = dA[s] @ W_gate[e] + dB[s] @ W_up[e]  (row tiles; two K loops, one acc)
    _expert_dw_kernel   dW_gate[e].T  = sum_{s in e} x[tok_s].T dA[s]      (x gathered); dW_up likewise from dB;
                        one launch for both, [dW_gate | dW_up][e].T from dA|dB, where up's rows follow gate's
                        in one [E, 2h, d] tensor (Hugging Face's fused gate_up)
                        (interleaved gate and up, gpt-oss: A|B and dA|dB are interleaved column by column as the
                        weights are, so this is one plain launch writing the [d, 2h] gradient of the stored
                        gate_up_proj, and the dX above one contraction over 2h against the [2h, d] matrix; and
                        "recompute" computes A|B again with the forward's up kernel into the dA|dB buffer, dh then
                        running as under "activations" in place over it, instead of inside the dh kernel through
                        strided loads)
    _expert_bias_grad_kernel (gate/up biases): d_gate_bias[e] = sum_{s in e} dA[s]; d_up_bias from dB
    _expert_combine_kernel dx[t]      = sum_k dX[slot_of[t*K + k]]           (fp32, fixed k order; a window of fewer
                        slots than T over its own tokens only: triton.combine.combine)

With ``window_slots`` everything but the down-bias pass and the final reduction runs once per slot
window (see ``triton.common.SlotWindow``): the transients hold the window's rows; the dW kernels contract
over the part of each expert's slots inside the window, writing the experts whose slots start there and
adding onto those that started earlier; dx and the bias gradients add up across windows.

On sm_90 (the call's plan decides, :func:`.plan.backward_plan`, once per call and per window where the window's
buffers matter) the dW launches with 16-bit operands and output go to the Gluon kernel of :mod:`.sm90.dw` when the
rows allow (16-byte aligned, unit column strides, d and h multiples of 16; tiles past d or h read zeros and store
nothing); its results are bitwise the Triton kernel's.
Likewise dh's GEMM (the split's first launch) goes to the gathering kernel of :mod:`.sm90.gather` when d % 64 == 0
and W_down is row blocks of one tensor; for a gated activation of ``sm90.gather.ACTIVATIONS`` with h % 16 == 0 both
launches are one there, dH' never stored (elsewhere the epilogue stays a Triton launch). The kernel option
``gluon=False`` (``config.KernelOptions``) keeps the Triton kernels everywhere. Under "recompute"
with an activation of ``sm90.gather.ACTIVATIONS``, no biases and h % 16 == 0, the forward's Gluon up kernel computes
the window's A|B again into the dA|dB buffer and the fused dh runs in place over it (each element read before it is
written, by the program that writes it): the same kernels on the same A|B as "activations", so bitwise its results,
with no more memory than the Triton dh kernel that recomputes A|B inside its own pass.

Each output element is written by exactly one program per window with a fixed reduction order, so there
are no atomics and two runs with the same configuration are bitwise identical. Experts with no slots get
zero weight gradients (or an unchanged one when accumulating). Transients (dA|dB, w*H, per-slot dX,
partials) are freed on return.
"""
from __future__ import annotations

import torch
import triton
from torch import Tensor

from .autotune import dweights_chunk
from .plan import BackwardPlan, UnitsKey, backward_plan
from .reference import Activation, DispatchPlan
from .sm90 import dw as sm90_dw
from .sm90 import gather as sm90_gather
from .tables import ExpertTables, WeightTable
from .triton import dh as tdh
from .triton import dw as tdw
from .triton import up as tup
from .triton.combine import combine, routing_weight_grad
from .triton.common import check_expert_inputs, check_table

__all__ = ["expert_backward", "check_grad_tables", "PHASE_ROLES"]


def _weight_grad(bp: BackwardPlan, tokens: Tensor, slots: Tensor, out: WeightTable, plan: DispatchPlan, K: int,
                 accumulate: bool, window: tuple[int, int, int]) -> None:
    """:func:`.triton.dw.weight_grad` on the backend the plan picks (:meth:`.plan.BackwardPlan.dw_on_sm90`)."""
    if out.ptrs.numel() == 0 or out.rows == 0 or out.cols == 0:
        return
    if bp.dw_on_sm90(tokens, slots, out):
        return sm90_dw.dw_sm90(tokens, slots, out, plan, K, accumulate, window)  # sm_90: Gluon (bitwise the same)
    tdw.weight_grad(tokens, slots, out, plan, K, accumulate, window)


def check_grad_tables(grads: ExpertTables, w: ExpertTables, x: Tensor, roles=("gate", "up", "down")) -> None:
    """The gradient tables of ``roles`` mirror the weight tables: same shapes and E, dtype x.dtype or float32; up's
    exactly when w has one (a gated activation). The other roles' entries are not read (they may be None)."""
    if not isinstance(grads, ExpertTables):
        raise TypeError(f"grads must be an ExpertTables (see kernels.tables), got {type(grads).__name__}")
    if "up" in roles and (grads.up is None) != (w.up is None):
        raise ValueError("grads.up must be given exactly when w.up is (a gated activation)")
    E = w.gate.ptrs.numel()
    dtypes = tuple(dict.fromkeys((x.dtype, torch.float32)))
    for name in roles:
        g, t = getattr(grads, name), getattr(w, name)
        if g is None and name != "up":
            raise ValueError(f"grads.{name} is missing: this call writes the {name} weight's gradient")
        if g is not None:
            check_table(f"grads.{name}", g, t.rows, t.cols, E, x, dtypes)


# The roles whose weight gradients each phase of expert_backward writes
PHASE_ROLES = {"all": ("gate", "up", "down"), "act": ("down",), "dx": (), "dw": ("gate", "up")}


def expert_backward(grad_y: Tensor, x: Tensor, weights: Tensor, w: ExpertTables, preact: Tensor,
                    plan: DispatchPlan, activation: "Activation | str",
                    gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                    *, grads: ExpertTables | None, recompute: bool, accumulate: bool = False, window_slots: int = 0,
                    phase: str = "all", dpre: Tensor | None = None, units_key: UnitsKey | None = None,
                    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx [T, d] x.dtype, dweights [T, K] weights.dtype, d_gate_bias, d_up_bias, d_down_bias).

    Weight gradients go through ``grads`` (tables of the same shapes as ``w``, x.dtype or float32):
    overwritten, or added to when ``accumulate`` (experts with no slots: zeros, or left as they are). ``grads`` may
    be a function returning those tables, called once just before the first weight-gradient kernel: the caller then
    allocates the gradients after the transients freed before it (the per-slot dX, w*H). Bias
    gradients are float32 ``[E, h]``, ``[E, h]``, ``[E, d]``, None where the bias is None.
    ``recompute``: the memory policy. True ("recompute"): A|B are computed again and ``preact`` is the empty
    tensor the forward returned; False ("activations"): ``preact`` is the forward's slot-order ``[T*K, 2h]``
    (``[T*K, h]`` for a plain activation).

    ``window_slots`` > 0 runs the slots in windows of at most that many (:func:`~.triton.common.slot_windows`),
    bounding the transients dA|dB, w*H and dX to that many rows. An expert whose slots span several windows
    gets its weight gradient added to in place (one rounding to the gradient's dtype per window it spans),
    and dx accumulates across windows in x's dtype (one rounding per window a token's slots fall in).

    ``phase`` cuts the work of one window (``window_slots`` 0, or not below T*K) into three calls, so that what
    the first reads can be freed before the others allocate, and the gate|up gradients need not exist before dx
    (the operator's split backward, ``ops.py``): ``"act"`` runs dh with its activation epilogue, dW_down and the
    down bias and returns (dA|dB [T*K, width], dweights, None, None, d_down_bias); ``"dx"`` takes that dA|dB as
    ``dpre`` and runs dX and its combine, returning (dx, None, None, None, None) (``grads`` is not used: it may be
    None); ``"dw"`` takes the same ``dpre`` and runs dW_gate|up and the gate/up biases, returning (None, None,
    d_gate_bias, d_up_bias, None). Each writes only its roles' gradient tables (:data:`PHASE_ROLES`); together
    they compute bitwise what ``"all"`` does. ``units_key``: keep the plan's weight units for later calls
    (:class:`.plan.UnitsKey`)."""
    T, d, K, E, h, act = check_expert_inputs(x, weights, w, plan, activation, gate_bias, up_bias, down_bias)
    if phase not in PHASE_ROLES:
        raise ValueError(f"phase must be one of {tuple(PHASE_ROLES)}, got {phase!r}")
    make_grads = grads if callable(grads) else None  # made just before the first weight-gradient kernel
    if make_grads is None and PHASE_ROLES[phase]:
        check_grad_tables(grads, w, x, PHASE_ROLES[phase])
    act_phase, dx_phase, dw_phase = phase in ("all", "act"), phase in ("all", "dx"), phase in ("all", "dw")
    N = T * K
    width = 2 * h if act.gated else h
    if act_phase:  # (the "dx" and "dw" phases never read grad_y: it may be None)
        if tuple(grad_y.shape) != (T, d):
            raise ValueError(f"grad_y must be [T, d] = {(T, d)}, got shape {tuple(grad_y.shape)}")
        if grad_y.device != x.device:
            raise ValueError(f"grad_y is on {grad_y.device}, x on {x.device}")
        grad_y = grad_y.to(x.dtype)
    if act_phase and recompute and preact.numel() != 0:
        raise ValueError(f"recompute=True takes the forward's empty preact, got shape {tuple(preact.shape)}")
    if act_phase and not recompute and (tuple(preact.shape) != (N, width) or preact.dtype != x.dtype):
        raise ValueError(f"preact must be [T*K, {'2h' if act.gated else 'h'}] = {(N, width)} of {x.dtype} "
                         f"(recompute=False), got {tuple(preact.shape)} of {preact.dtype}")
    if not act_phase and (dpre is None or tuple(dpre.shape) != (N, width) or dpre.dtype != x.dtype):
        raise ValueError(f"phase {phase!r} takes the 'act' phase's dA|dB [T*K, width] = {(N, width)} of {x.dtype} "
                         f"as dpre, got {None if dpre is None else (tuple(dpre.shape), dpre.dtype)}")

    busy = N > 0 and h > 0 and d > 0  # some GEMM has work
    dx = (x.new_empty((T, d)) if busy else x.new_zeros((T, d))) if dx_phase else None
    chunk = dweights_chunk()
    num_chunks = triton.cdiv(h, chunk)
    # Rows of the routing-weight partials: first the <dy, b_down> ones (one per column block of d), then the
    # <dH', H> chunks, then spare chunks a program's columns may run into.
    bias_rows = triton.cdiv(d, tdw.bias_grad_block_n(d)) if down_bias is not None and d > 0 else 0
    # The routing-weight gradient's partial sums, by slot (zero where no program adds one). Rows a multiple of 16
    # apart whatever N: the kernels writing and reading them are specialized on that stride, and a stride of N
    # compiled them again for each new residue of the token count (tests/kernels/test_launch.py)
    part = torch.zeros((bias_rows + num_chunks + tdh.MAX_BLOCK_N // chunk, -(-N // 16) * 16), dtype=torch.float32,
                       device=x.device)[:, :N] if act_phase else None
    d_down_bias = None
    if down_bias is not None and act_phase:  # d_down_bias[e] = sum_s w_s dy[tok_s]; <dy[tok_s], b_down[e]> in part
        d_down_bias = tdw.bias_grad(grad_y, True, weights, plan, K, E, dot_bias=down_bias, part=part)
    skip = accumulate and N == 0  # nothing to add
    d_gate_bias = torch.zeros((E, h), dtype=torch.float32, device=x.device) if gate_bias is not None and dw_phase \
        else None
    d_up_bias = torch.zeros((E, h), dtype=torch.float32, device=x.device) if up_bias is not None and dw_phase \
        else None

    bp = backward_plan(x, w, plan, d, h, window_slots, recompute, gate_bias is not None or up_bias is not None,
                       act_phase, dx_phase, units_key)
    windows = bp.windows
    if phase != "all" and len(windows) != 1:
        raise ValueError(f"phase {phase!r} runs one window: window_slots must be 0 or at least T*K = {N}, got "
                         f"{window_slots}")

    def grad_tables():  # (the gradient tables, dW_gate|up in one launch, likewise interleaved (gpt-oss's)), made once
        nonlocal grads, made
        if made is None:
            if make_grads is not None:
                grads = make_grads()
                check_grad_tables(grads, w, x, PHASE_ROLES[phase])
            made = (grads, tdw.gate_up_table(grads.gate, grads.up) if dw_phase else None,
                    tdw.interleaved_grad_table(grads.gate, grads.up) if dw_phase else None)
        return made

    made = None
    dpre_in, dpre = dpre, None
    for i, win in enumerate(windows):
        s0, s1 = win.slot0, win.slot1
        n = s1 - s0
        dw_window = (s0, s1, s1 if i + 1 < len(windows) else N + 1)
        if not act_phase:
            dpre = dpre_in
        else:
            dpre = x.new_empty((n, width))  # transients: the window's dA|dB, w*H
            hw = x.new_empty((n, h))
        if busy and act_phase:
            pre = dpre if recompute else preact[s0:]  # placeholder pointer when recomputing, never read
            for unit, kind, dh_phase in bp.dh_launches(grad_y, x, hw, pre, dpre, weights, act, chunk):
                if unit == "sm90.up":  # A|B into the dA|dB buffer, H into hw (see BackwardPlan.dh_launches)
                    sm90_gather.up_sm90(x, bp.up_sm90, plan, K, d, h, win, hw, dpre, act)
                elif unit == "triton.up":
                    tup.up_project(x, w, gate_bias, up_bias, hw, dpre, plan, win, d, h, K, act, True, *bp.up_mode)
                elif unit == "sm90.dh_act":
                    sm90_gather.dh_act_sm90(grad_y, bp.dh_sm90, plan, K, d, h, win, hw, pre, dpre, part[bias_rows:],
                                            weights, act, bp.pairs)
                elif unit == "sm90.dh":
                    sm90_gather.dh_sm90(grad_y, bp.dh_sm90, plan, K, d, h, win, hw)
                else:
                    tdh.dh_launch(kind, dh_phase, grad_y, x, w, gate_bias, up_bias, weights, pre, dpre, hw,
                                  part[bias_rows:], plan, win, d, h, K, act, chunk, bp.dh_recomputes,
                                  bp.pairs)
            del pre  # may alias dpre: it must not outlive the window
        if act_phase:
            if not skip:
                _weight_grad(bp, grad_y, hw, grad_tables()[0].down, plan, K, accumulate, dw_window)  # [E, d, h]
            del hw
        if busy and dx_phase:  # dX, combined into dx at once: its slots are freed before dW_gate|up
            dx_slots = x.new_empty((n, d))
            bp.dx.project(dpre, bp.dx_k(h), d, plan, dx_slots, None, win)
            combine(dx_slots, None, plan, T, K, dx, (s0, s1), accumulate=i > 0)
            del dx_slots
        if not dw_phase:  # "act" or "dx": one window
            break
        if not skip:
            grads, grads_gate_up, grads_interleaved = grad_tables()
            # [E, h, d], computed as its transpose: the gathered operand goes on A's side (see the kernel)
            if bp.pairs and grads_interleaved is not None:  # dA|dB interleaved as the gradient: [E, d, 2h] at once
                _weight_grad(bp, x, dpre, grads_interleaved, plan, K, accumulate, dw_window)
            elif not bp.pairs and grads_gate_up is not None:
                _weight_grad(bp, x, dpre, tdw.transposed(grads_gate_up), plan, K, accumulate, dw_window)
            else:
                halves = bp.halves(dpre, h)  # (views of dA|dB: gone with it, below)
                _weight_grad(bp, x, halves[0], tdw.transposed(grads.gate), plan, K, accumulate, dw_window)
                if act.gated:
                    _weight_grad(bp, x, halves[1], tdw.transposed(grads.up), plan, K, accumulate, dw_window)
                del halves
        if gate_bias is not None or up_bias is not None:
            if bp.pairs:  # one pass over dA|dB's contiguous rows, then its interleaved halves
                both = tdw.bias_grad(dpre, False, None, plan, K, E, window=(s0, s1))
                d_ab = both[:, 0::2], both[:, 1::2]
            else:
                d_ab = [tdw.bias_grad(part, False, None, plan, K, E, window=(s0, s1)) if bias is not None else None
                        for part, bias in zip(bp.halves(dpre, h), (gate_bias, up_bias))]
            if gate_bias is not None:
                d_gate_bias += d_ab[0]
            if up_bias is not None:
                d_up_bias += d_ab[1]
        del dpre
    if phase == "dx":
        return dx, None, None, None, None
    if phase == "dw":
        return None, None, d_gate_bias, d_up_bias, None
    dweights = routing_weight_grad(part, bias_rows + num_chunks, plan, T, K, weights.dtype)
    if phase == "act":
        return dpre, dweights, None, None, d_down_bias
    return dx, dweights, d_gate_bias, d_up_bias, d_down_bias
