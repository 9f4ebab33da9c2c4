"""Fused expert forward: gather-on-the-fly up projection, down projection, deterministic combine.

This module runs them (:func:`expert_forward`); the kernels live in :mod:`.triton.up`, :mod:`.triton.down` and
:mod:`.triton.combine` (Triton), :mod:`.sm90.gather` and :mod:`.sm90.down` (Gluon, sm_90), their shared helpers in
:mod:`.triton.common` and :mod:`.sm90.common`.

Notation: T tokens, K choices per token, N = T*K pairs, E experts, d model width, h expert width.
A *pair* p = t*K + k is one entry of ``ids``; a *slot* is its row in the expert-major order of the
:class:`~moeblaze_fx.kernels.reference.DispatchPlan` (``token_index[slot] = p``, ``slot_of[p] = slot``).

Expert weights are read only through per-expert pointer tables (:class:`~moeblaze_fx.kernels.tables.WeightTable`):
each program loads ``ptrs[e]`` once and indexes the matrix with the table's two strides, so a fused
``[E, 2h, d]`` parameter, its transposed or interleaved views and E separate ``nn.Linear`` weights are all
read in place. The activation is a constexpr (``ACT``, its arithmetic in :mod:`.act`): gated ones (swiglu, geglu,
geglu_tanh, swiglu_oai, swiglu_clamp, swiglu_softcap) have a gate and an up projection, plain ones (silu, gelu,
gelu_tanh, relu, relu2) only the gate projection.

Data flow (three launches)::

    x [T, d] ──(token_index: slot -> pair p -> token p // K, read while loading tiles)──┐
    W_gate[e], W_up[e] [h, d] (tables), gate/up biases [E, h] (optional) ──────────────┤
        _expert_up_kernel      per row tile of one expert: A = x_rows @ Wg.T + bg, B = x_rows @ Wu.T + bu in
                               one pass over d (B only for gated activations); epilogue rounds A|B, writes
                               them (when saving) and H = act(A, B)
        ──▶ preact [N, 2h] or [N, h] (saved, "activations" policy)   H [N, h] (transient)
    W_down[e] [d, h] (table), down bias [E, d] (optional) ───────────────────────────┐
        _expert_down_kernel    per row tile: Y = H @ W_down[e].T + bd   ──▶ Y [N, d] (transient, slot order)
        _expert_combine_kernel out[t] = sum_k w[t, k] * Y[slot_of[t*K + k]], fp32 accumulation in a fixed
                               k order, unrouted pairs (slot -1) skipped   ──▶ y [T, d]

No gathered [N, d] copy of x is ever built; the transients H and Y are freed when the launcher
returns. With ``window_slots`` the three launches run once per *slot window*
(:class:`.triton.common.SlotWindow`, a range of the expert-sorted slots), H and Y holding only the window's rows and
the combine adding each window's pairs onto y (:func:`.triton.combine.combine`: a window of fewer slots than T runs
over its own slots, touching only their tokens' rows). Saved for backward (by the caller): x, the plan, the routing
weights and, under the "activations" policy, preact (biases included). Nothing is reduced with atomics, so two runs
with the same configuration are bitwise identical.

Row tiles come from the plan: ``tile_expert[i]`` / ``tile_start[i]`` describe ``plan_block_m()`` rows
of one expert; a tile may be ragged (masked against ``offsets[e+1]``), tiles past the last one hold
-1 and their programs exit at once, so grids are sized by the static bound ``max_tiles`` and no host
synchronisation is needed. A window's launches start at its first tile (found on the device) and clip
each tile's rows to the window, so a tile cut by a window boundary is computed by both windows, each
storing its own rows.

Alignment: an address loaded from a table carries no alignment the compiler can see, and without one
every weight load becomes a 2-byte access (no cp.async, no 16-byte vectors). The host passes the
tables' proven alignment as a constexpr (``W_ALIGN``, from ``WeightTable.align`` when the table has that
field; 1 otherwise) and the kernels assert it with ``tl.multiple_of``.

Tensor descriptors: where a weight matrix has a unit stride, a 16-byte aligned other stride and a proven
16-byte aligned base, the up and down kernels read its tiles through a descriptor built in the kernel
from ``ptrs[e]`` (TMA on sm_90; :func:`.triton.common.weight_tma_mode` picks the orientation, ``W_TMA`` /
``B_TMA``), and the backward's dW kernel does the same for its slot-ordered operand. Tiles past a bound read as zeros,
where the pointer loads mask or wrap; both feed only outputs that are dropped at the store or zero
terms, so the stored results of the two paths are bitwise equal. Pointer loads remain for weights a descriptor
cannot describe (a stride or base that is not 16-byte aligned: odd widths, offsets into a parameter) and devices
before sm_90.

On sm_90 the call's plan (:func:`.plan.forward_plan`, decided once before the first launch) hands the down
projection's launches to the Gluon kernel of :mod:`.sm90.down` (persistent, warp-specialized, both operands through
TMA; bitwise equal results) when the weights are row blocks of one tensor and the window's rows are 16-byte aligned.
The gated up projection without biases goes to :mod:`.sm90.gather` (the same structure with a producer that gathers
x's rows; bitwise equal results) when d % 64 == 0 and the weights are row blocks of one tensor. The kernel option
``gluon=False`` (``config.KernelOptions``) keeps the Triton kernels.

Interleaved gate and up (gpt-oss's ``gate_up_proj [E, d, 2h]``: gate = columns 0::2, up = 1::2;
:func:`.tables.interleaved_gate_up` decides from the tables): each role alone is strided by 2 along h, which only
element-wise loads can read (no descriptor; the Gluon up kernel never takes them). The up kernel's INTERLEAVED path
reads each expert's [d, 2h] instead as one matrix, contiguous along 2h (a descriptor over it where its rows are 16-byte
aligned), into one [BLOCK_M, 2 * BLOCK_N] accumulator whose adjacent columns it splits into A and B. The saved A|B
(and the backward's dA|dB) are then interleaved the same way, column 2j A's column j and 2j + 1 B's (the up and dh
kernels' epilogues split and join adjacent columns in registers): the backward's dX and dW_gate|up are plain GEMMs
over the 2h columns, against the [2h, d] matrices (:func:`.tables.interleaved_table`) and into the stored [d, 2h]
gradient, on either backend.

Dtypes: bf16 and fp16 run on the tensor cores (fp32 accumulation), autotuned. fp32 dots take the input precision the
kernel option ``float32_products`` resolves to (:func:`.autotune.resolve_float32_products`: six bf16 products of
three-part splits on the tensor cores by default, three where torch allows TF32, IEEE fused multiply-adds on
request); the interpreter tests compute them in float32 whatever is asked. On CUDA the operator runs fp32 with one
fixed configuration for each way (``autotune.FLOAT32_CONFIGS``), never on the Gluon kernels.
"""
from __future__ import annotations

from torch import Tensor

from .plan import UnitsKey, forward_plan
from .reference import Activation, DispatchPlan
from .sm90 import gather as sm90_gather
from .tables import ExpertTables
from .triton import up as tup
from .triton.combine import combine
from .triton.common import check_expert_inputs

__all__ = ["expert_forward"]


def expert_forward(x: Tensor, weights: Tensor, w: ExpertTables, plan: DispatchPlan,
                   activation: "Activation | str", save_preact: bool,
                   gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                   *, out: Tensor | None = None, preact_out: Tensor | None = None,
                   window_slots: int = 0, units_key: UnitsKey | None = None) -> tuple[Tensor, Tensor]:
    """y [T, d] (x.dtype) and preact in slot order (x.dtype): ``[T*K, 2h]`` (gate|up) for a gated activation,
    ``[T*K, h]`` for a plain one, biases included; ``[0]`` unless save_preact.

    ``w`` holds the weight tables (``w.up`` None exactly for a plain activation); biases are optional
    contiguous ``[E, h]``, ``[E, h]``, ``[E, d]`` tensors of x's dtype. ``plan`` must come from
    ``dispatch(ids, E, block_m=plan_block_m())`` (or ``dispatch_reference``). ``out`` / ``preact_out``:
    storage to write y / preact into (any strides). ``window_slots`` > 0 runs the slots in windows of at
    most that many (:func:`.triton.common.slot_windows`), bounding the transients H and Y to that many rows; y then
    accumulates across windows in its own dtype (a token whose slots fall in several windows is rounded
    once per window). ``units_key``: keep the plan's weight units for later calls (:class:`.plan.UnitsKey`)."""
    T, d, K, E, h, act = check_expert_inputs(x, weights, w, plan, activation, gate_bias, up_bias, down_bias)
    N = T * K
    width = 2 * h if act.gated else h
    for name, given, shape in (("out", out, (T, d)), ("preact_out", preact_out, (N, width))):
        if given is not None and (tuple(given.shape) != shape or given.dtype != x.dtype or given.device != x.device):
            raise ValueError(f"{name} must be {shape} of {x.dtype} on {x.device}, got {tuple(given.shape)} of "
                             f"{given.dtype} on {given.device}")
    preact = (preact_out if preact_out is not None else x.new_empty((N, width))) if save_preact else x.new_empty((0,))
    out = out if out is not None else x.new_empty((T, d))
    if N == 0 or d == 0:
        return out.zero_(), preact
    if h == 0 and down_bias is None:  # every expert maps to zero
        return out.zero_(), preact
    fp = forward_plan(x, w, plan, d, h, gate_bias is not None or up_bias is not None, window_slots, units_key)
    for i, win in enumerate(fp.windows):
        n = win.slot1 - win.slot0
        hid = x.new_empty((n, h))  # transient: the window's H
        if h > 0:
            pre = preact[win.slot0:] if save_preact else hid  # placeholder pointer when not saving, never written
            if fp.up.on_sm90(x, hid, pre if save_preact else None, act):
                sm90_gather.up_sm90(x, fp.up.sm90, plan, K, d, h, win, hid, pre if save_preact else None, act)
            else:
                tup.up_project(x, w, gate_bias, up_bias, hid, pre, plan, win, d, h, K, act, save_preact, fp.up.align,
                               fp.up.w_tma)
            del pre  # may alias hid: it must not outlive the window
        y_slots = x.new_empty((n, d))  # transient: the window's Y
        # Y = H @ W_down[e].T (+ b_down[e])
        fp.down.project(hid, h, d, plan, y_slots, down_bias, win)
        del hid
        combine(y_slots, weights, plan, T, K, out, (win.slot0, win.slot1), accumulate=i > 0)
        del y_slots
    return out, preact
