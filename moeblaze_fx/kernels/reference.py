"""Plain-PyTorch ground truth for every MoEBlaze kernel, and the CPU implementation of the operator.

The operator computes, for tokens ``x [T, d]``, expert ids ``ids [T, K]`` and combine weights
``weights [T, K]``::

    y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])        (ids[t, k] >= E contributes nothing)
    expert_e(v) = act(v @ w_gate_up[e].T) @ w_down[e].T

with ``w_gate_up [E, 2h, d]`` (rows ``[:h]`` the gate, ``[h:]`` the up projection; Hugging Face's
layout), ``w_down [E, d, h]``, and ``act(gate | up) = silu(gate) * up`` for SwiGLU.

Three layers live here:

* ``dispatch_reference`` builds the index structures (the contract the Triton dispatch kernels meet
  bit for bit): per-expert ``offsets [E+1]``, the expert-major ``token_index [T*K]``, the inverse map
  ``slot_of [T*K]`` and the row-tile metadata the grouped GEMMs walk.
* ``moe_ffn_reference`` is the obvious differentiable loop, used as the numerical truth in tests.
* ``moe_ffn_forward_torch`` / ``moe_ffn_backward_torch`` implement the operator's memory policy in
  plain PyTorch (the CPU path): the forward saves ``x``, the index structures and, under the
  ``"activations"`` policy, the pre-activations ``A|B [T*K, 2h]``; never a gathered ``[T*K, d]`` copy
  of the tokens and never the expert outputs. The backward recomputes ``silu`` and ``H`` and takes the
  routing-weight gradient as ``<dH', H>`` so the expert outputs ``Y`` are not needed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DispatchPlan",
    "max_tiles",
    "dispatch_reference",
    "GATED_ACTIVATIONS",
    "activation_forward",
    "activation_backward",
    "moe_ffn_reference",
    "moe_ffn_forward_torch",
    "moe_ffn_backward_torch",
]


class DispatchPlan(NamedTuple):
    """Index structures of one routing decision. Every tensor is int32 and lives on ids' device.

    A *pair* is one (token, choice) entry ``p = t * K + k`` of ``ids``; a *slot* is its row in the
    expert-major order. Slots ``offsets[e]:offsets[e+1]`` belong to expert ``e``; inside an expert,
    pairs keep ascending ``p`` (so runs are deterministic). Pairs whose id is ``>= E`` get no slot.
    """

    offsets: Tensor  # [E+1]  int32: first slot of each expert; offsets[E] = number of routed pairs
    token_index: Tensor  # [T*K] int32: pair p of each slot; slots >= offsets[E] hold the unrouted pairs, ascending
    slot_of: Tensor  # [T*K] int32: slot of pair p, or -1 when ids.flatten()[p] >= E
    tile_expert: Tensor  # [max_tiles(T*K, E, block_m)] int32: expert of each row tile, -1 past the last tile
    tile_start: Tensor  # [max_tiles(T*K, E, block_m)] int32: first slot of each row tile, offsets[E] past the last


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles of ``block_m`` rows: sum_e ceil(c_e / block_m) <= floor(TK / block_m) + E."""
    return num_pairs // block_m + num_experts


def _check_ids(ids: Tensor, num_experts: int) -> None:
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T, K], got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def dispatch_reference(ids: Tensor, num_experts: int, block_m: int = 64) -> DispatchPlan:
    """Build the :class:`DispatchPlan` with a stable sort (the ground truth the kernels must equal)."""
    _check_ids(ids, num_experts)
    E = num_experts
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)[:E]
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    slots = torch.arange(num_pairs, device=ids.device)
    slot_of = torch.full((num_pairs,), -1, dtype=torch.int64, device=ids.device)
    routed = slots < offsets[E]
    slot_of[order[routed]] = slots[routed]

    n_tiles = max_tiles(num_pairs, E, block_m)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(E, device=ids.device), tiles_per_expert)
    first_tile = torch.cumsum(tiles_per_expert, 0) - tiles_per_expert
    tile_rank = torch.arange(tile_expert.numel(), device=ids.device) - first_tile[tile_expert]
    tile_start = offsets[tile_expert] + tile_rank * block_m
    pad = n_tiles - tile_expert.numel()
    tile_expert = torch.cat([tile_expert, tile_expert.new_full((pad,), -1)])
    tile_start = torch.cat([tile_start, tile_start.new_full((pad,), 0) + offsets[E]])
    i32 = torch.int32
    return DispatchPlan(offsets.to(i32), order.to(i32), slot_of.to(i32), tile_expert.to(i32), tile_start.to(i32))


# ---------------------------------------------------------------------------------------------
# Activations. A gated activation maps the pre-activations (gate, up) [n, h] each to H [n, h].
# ---------------------------------------------------------------------------------------------
GATED_ACTIVATIONS = ("swiglu",)


def activation_forward(activation: str, gate: Tensor, up: Tensor) -> Tensor:
    if activation == "swiglu":
        return F.silu(gate) * up
    raise ValueError(f"unknown activation {activation!r}; supported: {GATED_ACTIVATIONS}")


def activation_backward(activation: str, gate: Tensor, up: Tensor, d_h: Tensor) -> tuple[Tensor, Tensor]:
    """Given dL/dH, return (dL/dgate, dL/dup), recomputing what the forward computed."""
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = d_h * up * (sig * (1 + gate * (1 - sig)))
        return d_gate, d_h * silu
    raise ValueError(f"unknown activation {activation!r}; supported: {GATED_ACTIVATIONS}")


def moe_ffn_reference(
    x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor, activation: str = "swiglu"
) -> Tensor:
    """The obvious differentiable loop over experts; accumulates in float32, returns x's dtype."""
    E, two_h, _ = w_gate_up.shape
    h = two_h // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in range(E):
        tok, k = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        pre = x[tok] @ w_gate_up[e].t()
        hid = activation_forward(activation, pre[:, :h], pre[:, h:])
        y = hid @ w_down[e].t()
        out = out.index_add(0, tok, y.to(acc) * weights[tok, k, None].to(acc))
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The operator's plain-PyTorch implementation (CPU path), following the memory policy.
# ---------------------------------------------------------------------------------------------
def _expert_ranges(plan: DispatchPlan) -> list[tuple[int, int, int]]:
    # Host-side walk of the offsets: fine on the CPU path, which has nothing to synchronise with.
    off = plan.offsets.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def moe_ffn_forward_torch(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str,
    save_preact: bool,
    plan: DispatchPlan | None = None,
) -> tuple[Tensor, Tensor, DispatchPlan]:
    """Returns (y [T, d] in x's dtype, preact [T*K, 2h] or [0], plan).

    Per expert: gather that expert's rows of x (a transient [n_e, d] block, freed at once), one
    up-projection GEMM for gate and up together, the activation, the down projection, and a
    weighted accumulation into a float32 output. ``preact`` is written in slot order.
    """
    T, d = x.shape
    K = ids.shape[1]
    E, two_h, _ = w_gate_up.shape
    if plan is None:
        plan = dispatch_reference(ids, E)
    tok_of_slot = plan.token_index.to(torch.int64) // K
    w_flat = weights.reshape(-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(T, d, dtype=acc, device=x.device)
    preact = x.new_empty((T * K, two_h) if save_preact else (0,))
    h = two_h // 2
    for e, lo, hi in _expert_ranges(plan):
        tok = tok_of_slot[lo:hi]
        pre = x[tok] @ w_gate_up[e].t()
        if save_preact:
            preact[lo:hi] = pre
        hid = activation_forward(activation, pre[:, :h], pre[:, h:])
        y = hid @ w_down[e].t()
        scale = w_flat[plan.token_index[lo:hi].to(torch.int64)].to(acc)
        out.index_add_(0, tok, y.to(acc) * scale[:, None])
    return out.to(x.dtype), preact, plan


def moe_ffn_backward_torch(
    grad_y: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    preact: Tensor,
    plan: DispatchPlan,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, dweights, dw_gate_up, dw_down). ``preact`` empty means recompute it."""
    T, d = x.shape
    K = ids.shape[1]
    E, two_h, _ = w_gate_up.shape
    h = two_h // 2
    tok_of_slot = plan.token_index.to(torch.int64) // K
    w_flat = weights.reshape(-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    dx = torch.zeros(T, d, dtype=acc, device=x.device)
    dweights = torch.zeros(T * K, dtype=acc, device=x.device)
    dw_gate_up = torch.zeros_like(w_gate_up)
    dw_down = torch.zeros_like(w_down)
    recompute = preact.numel() == 0
    for e, lo, hi in _expert_ranges(plan):
        pairs = plan.token_index[lo:hi].to(torch.int64)
        tok = tok_of_slot[lo:hi]
        xe = x[tok]
        pre = xe @ w_gate_up[e].t() if recompute else preact[lo:hi]
        gate, up = pre[:, :h], pre[:, h:]
        hid = activation_forward(activation, gate, up)
        dout = grad_y[tok]
        d_hid_unscaled = dout @ w_down[e]  # dH' [n, h]: the gradient H would get with weight 1
        dweights[pairs] = (d_hid_unscaled.to(acc) * hid.to(acc)).sum(1)
        scale = w_flat[pairs].to(dout.dtype)[:, None]
        dw_down[e] = (dout * scale).t() @ hid
        d_gate, d_up = activation_backward(activation, gate, up, d_hid_unscaled * scale)
        d_pre = torch.cat([d_gate, d_up], dim=1)
        dw_gate_up[e] = d_pre.t() @ xe
        dx.index_add_(0, tok, (d_pre @ w_gate_up[e]).to(acc))
    return dx.to(x.dtype), dweights.view(T, K).to(weights.dtype), dw_gate_up, dw_down
