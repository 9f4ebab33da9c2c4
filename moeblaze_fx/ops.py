"""The MoEBlaze operators, registered with ``torch.library``.

``torch.ops.moeblaze.moe_ffn(x, ids, weights, w_gate_up, w_down, activation, checkpoint)``
returns ``(y, preact, offsets, token_index, slot_of, tile_expert, tile_start)``:

* ``y [T, d]`` in x's dtype: ``y[t] = sum_k weights[t,k] * expert_{ids[t,k]}(x[t])``;
* ``preact [T*K, 2h]`` (the gate/up pre-activations, slot order) under ``checkpoint="activations"``,
  an empty ``[0]`` tensor under ``"recompute"``;
* the dispatch plan (see ``kernels.reference.DispatchPlan``), int32.

Only ``y`` is meant for callers (``moeblaze_fx.moe_ffn`` returns it); the other outputs exist so that
AOTAutograd saves exactly them for ``moeblaze::moe_ffn_backward`` and nothing else: x, the index
structures and, under the default policy, the pre-activations. All output shapes are static functions
of the input shapes (no unbacked sizes, no host synchronisation), so dynamic T and CUDA graphs work.

Implementations: plain PyTorch on every device (``kernels.reference``), replaced on CUDA for
bfloat16/float16 by the Triton kernels in ``kernels/`` where they are available.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from .kernels import reference
from .kernels.reference import GATED_ACTIVATIONS, DispatchPlan

__all__ = ["moe_ffn", "CHECKPOINT_POLICIES", "ACTIVATIONS"]

CHECKPOINT_POLICIES = ("activations", "recompute")
ACTIVATIONS = GATED_ACTIVATIONS
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CPU_BLOCK_M = 64
log = logging.getLogger("moeblaze_fx")


def plan_block_m(device: torch.device) -> int:
    """Rows per tile of the dispatch plan the operator builds on ``device``."""
    kernels = _triton_kernels() if device.type == "cuda" else None
    return kernels[1].plan_block_m() if kernels is not None else _CPU_BLOCK_M


def _check_inputs(x, ids, weights, w_gate_up, w_down, activation, checkpoint) -> None:
    """Validate the operator's contract; every message names the problem and the fix."""
    if x.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: x must be [T, d]; got shape {tuple(x.shape)} (reshape tokens to 2-D)")
    if ids.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: ids must be [T, K]; got shape {tuple(ids.shape)}")
    if weights.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: weights must be [T, K]; got shape {tuple(weights.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moeblaze.moe_ffn: ids must be int32 or int64, got {ids.dtype}")
    for name, t in (("x", x), ("weights", weights), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"moeblaze.moe_ffn: {name} has unsupported dtype {t.dtype}; use one of {_FLOAT_DTYPES}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(
            f"moeblaze.moe_ffn: x, w_gate_up and w_down must share a dtype; got {x.dtype}, {w_gate_up.dtype}, "
            f"{w_down.dtype} (cast the tokens or the weights first)"
        )
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"moeblaze.moe_ffn: w_gate_up must be [E, 2h, d] and w_down [E, d, h]; got {tuple(w_gate_up.shape)} "
            f"and {tuple(w_down.shape)}"
        )
    T, d = x.shape
    E, two_h, d_in = w_gate_up.shape
    if tuple(ids.shape) != tuple(weights.shape) or ids.shape[0] != T:
        raise ValueError(
            f"moeblaze.moe_ffn: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, K] with "
            f"T = {T} tokens of x"
        )
    if d_in != d:
        raise ValueError(f"moeblaze.moe_ffn: w_gate_up is [E, 2h, d] = {tuple(w_gate_up.shape)} but x has d = {d}")
    if two_h % 2:
        raise ValueError(f"moeblaze.moe_ffn: w_gate_up's rows (gate then up) must be even, got 2h = {two_h}")
    if tuple(w_down.shape) != (E, d, two_h // 2):
        raise ValueError(
            f"moeblaze.moe_ffn: w_down must be [E, d, h] = {(E, d, two_h // 2)} to match w_gate_up "
            f"{tuple(w_gate_up.shape)}; got {tuple(w_down.shape)}"
        )
    devices = {t.device for t in (x, ids, weights, w_gate_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"moeblaze.moe_ffn: all inputs must be on one device, got {sorted(map(str, devices))}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moeblaze.moe_ffn: unknown activation {activation!r}; supported: {ACTIVATIONS}")
    if checkpoint not in CHECKPOINT_POLICIES:
        raise ValueError(f"moeblaze.moe_ffn: unknown checkpoint policy {checkpoint!r}; supported: {CHECKPOINT_POLICIES}")


def _check_ids_range(ids: Tensor) -> None:
    # Ids >= E mean "no expert" (the contract); a negative id is a bug in the router. On the CPU the
    # check is free of consequence; on CUDA it is an asynchronous device assert (no host sync).
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":
        if bool((ids < 0).any()):
            raise ValueError("moeblaze.moe_ffn: ids contain negative expert ids; ids must be >= 0 (>= E means no expert)")
    else:
        torch._assert_async((ids >= 0).all(), "moeblaze.moe_ffn: ids contain negative expert ids")


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """(dispatch, expert_fwd, expert_bwd) modules, or None where Triton or the kernels are missing."""
    try:
        from .kernels import dispatch, expert_bwd, expert_fwd
    except ImportError as exc:
        log.debug("moeblaze: Triton kernels unavailable (%s); using the PyTorch implementation", exc)
        return None
    return dispatch, expert_fwd, expert_bwd


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _triton_kernels() is not None


def _make_plan(ids: Tensor, num_experts: int, block_m: int) -> DispatchPlan:
    kernels = _triton_kernels() if ids.is_cuda else None
    if kernels is not None:
        return kernels[0].dispatch(ids, num_experts, block_m=block_m)
    return reference.dispatch_reference(ids, num_experts, block_m=block_m)


@torch.library.custom_op("moeblaze::moe_ffn", mutates_args=())
def _moe_ffn(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "swiglu",
    checkpoint: str = "activations",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_inputs(x, ids, weights, w_gate_up, w_down, activation, checkpoint)
    _check_ids_range(ids)
    E = w_gate_up.shape[0]
    plan = _make_plan(ids, E, plan_block_m(x.device))
    save_preact = checkpoint == "activations"
    if _use_triton(x):
        y, preact = _triton_kernels()[1].expert_forward(x, weights, w_gate_up, w_down, plan, activation, save_preact)
    else:
        y, preact, _ = reference.moe_ffn_forward_torch(x, ids, weights, w_gate_up, w_down, activation, save_preact, plan)
    return (y, preact, *plan)


@_moe_ffn.register_fake
def _moe_ffn_fake(x, ids, weights, w_gate_up, w_down, activation="swiglu", checkpoint="activations"):
    _check_inputs(x, ids, weights, w_gate_up, w_down, activation, checkpoint)
    T, d = x.shape
    K = ids.shape[1]
    E, two_h, _ = w_gate_up.shape
    n_pairs = T * K
    n_tiles = reference.max_tiles(n_pairs, E, plan_block_m(x.device))
    i32 = dict(dtype=torch.int32, device=x.device)
    preact = x.new_empty((n_pairs, two_h) if checkpoint == "activations" else (0,))
    return (
        x.new_empty(T, d),
        preact,
        torch.empty(E + 1, **i32),
        torch.empty(n_pairs, **i32),
        torch.empty(n_pairs, **i32),
        torch.empty(n_tiles, **i32),
        torch.empty(n_tiles, **i32),
    )


@torch.library.custom_op("moeblaze::moe_ffn_backward", mutates_args=())
def _moe_ffn_backward(
    grad_y: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    preact: Tensor,
    offsets: Tensor,
    token_index: Tensor,
    slot_of: Tensor,
    tile_expert: Tensor,
    tile_start: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    plan = DispatchPlan(offsets, token_index, slot_of, tile_expert, tile_start)
    grad_y = grad_y.contiguous()
    if _use_triton(x):
        return _triton_kernels()[2].expert_backward(grad_y, x, weights, w_gate_up, w_down, preact, plan, activation)
    return reference.moe_ffn_backward_torch(grad_y, x, ids, weights, w_gate_up, w_down, preact, plan, activation)


@_moe_ffn_backward.register_fake
def _moe_ffn_backward_fake(grad_y, x, ids, weights, w_gate_up, w_down, preact, offsets, token_index, slot_of,
                           tile_expert, tile_start, activation):
    return (torch.empty_like(x), torch.empty_like(weights), torch.empty_like(w_gate_up), torch.empty_like(w_down))


def _setup_context(ctx, inputs, output):
    x, ids, weights, w_gate_up, w_down, activation, _checkpoint = inputs
    _y, preact, *plan = output
    ctx.activation = activation
    ctx.save_for_backward(x, ids, weights, w_gate_up, w_down, preact, *plan)
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_y, *_unused_grads):
    x, ids, weights, w_gate_up, w_down, preact, *plan = ctx.saved_tensors
    dx, dweights, dw_gate_up, dw_down = torch.ops.moeblaze.moe_ffn_backward(
        grad_y, x, ids, weights, w_gate_up, w_down, preact, *plan, ctx.activation
    )
    return dx, None, dweights, dw_gate_up, dw_down, None, None


_moe_ffn.register_autograd(_backward, setup_context=_setup_context)


def moe_ffn(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    *,
    activation: str = "swiglu",
    checkpoint: str = "activations",
) -> Tensor:
    """``y[t] = sum_k weights[t,k] * expert_{ids[t,k]}(x[t])`` as one MoEBlaze operator.

    Args:
        x: ``[T, d]`` tokens.
        ids: ``[T, K]`` int32/int64 expert ids; an id ``>= E`` contributes nothing.
        weights: ``[T, K]`` combine weights (any float dtype; differentiable).
        w_gate_up: ``[E, 2h, d]``, gate rows first then up rows (Hugging Face's layout).
        w_down: ``[E, d, h]``.
        activation: ``"swiglu"``.
        checkpoint: ``"activations"`` (save the gate/up pre-activations) or ``"recompute"`` (save only
            x and the index structures; recompute the up projection in backward).
    """
    return torch.ops.moeblaze.moe_ffn(x, ids, weights, w_gate_up, w_down, activation, checkpoint)[0]
