"""``moeblaze bench``: one MoE layer, forward + backward, router included, for several implementations.

What one step is (every provider computes the same function)::

    logits = x @ w_router.T                      x [T, d], w_router [E, d]
    probs  = softmax(logits, fp32); top-k; renormalize; cast to x's dtype   -> ids [T, K], w [T, K]
    y[t]   = sum_k w[t, k] * W_down[e] @ (silu(W_gate[e] @ x[t]) * W_up[e] @ x[t]),  e = ids[t, k]
    grads  = autograd.grad(y, (x, w_router, w_gate_up, w_down), grad_y)

with the weights in Hugging Face's layout, ``w_gate_up [E, 2h, d]`` (gate rows, then up rows) and
``w_down [E, d, h]``.

Providers:

* ``moeblaze-activations`` / ``moeblaze-recompute``: the operator ``moeblaze_fx.moe_ffn`` under each
  memory policy (Triton kernels on CUDA where they are available, plain PyTorch elsewhere);
* ``moeblaze-lowmem``: ``"recompute"`` with ``transient_budget`` = 128 MiB (smaller slot windows: a
  lower peak for some speed);
* ``loop``: the per-expert loop of Mixtral in transformers < 5 (``one_hot`` + ``where`` + ``index_add_``);
* ``hf-grouped-mm``: the data flow of transformers' ``grouped_mm`` experts: sort the (token, choice)
  pairs by expert, gather the rows, ``histc`` + ``cumsum`` offsets, ``torch._grouped_mm`` for both
  projections, scale, inverse permutation, sum over K. Where ``torch._grouped_mm`` cannot run (the CPU,
  GPUs before sm80, or a failed probe) the two grouped products become a per-expert matmul over the same
  sorted rows, and the row says so;
* ``hf-grouped-mm-compiled``: the same under default ``torch.compile``, compiled afresh for every shape
  (Dynamo is reset before each configuration, so no shape runs a dynamic-shape recompile);
* ``moeblaze-graphs`` / ``hf-grouped-mm-graphs``: ``moeblaze-activations``' layer compiled with
  ``backend="moeblaze"``, and ``hf-grouped-mm``'s with the default backend, both under
  ``mode="reduce-overhead"``: each step replays CUDA graphs of the forward and the backward (CUDA only; the
  weights are marked as static addresses, as parameters are; no peak column: the graphs' memory pool is
  allocated when they are recorded, before the measured step);
* ``liger``: Liger-Kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``) when
  ``liger-kernel`` is importable and the device is CUDA.

Per row: median step time (CUDA events around each step with the L2 cache flushed before it, or a
wall-clock median on the CPU, labelled as such), TFLOP/s with FLOPs = 18*T*K*d*h, the fraction of a
dense GEMM rate measured in the same run (8192^3 bf16 on CUDA), saved-activation bytes (distinct
storages packed by ``saved_tensors_hooks`` during the forward; parameters excluded, ``x`` included),
peak allocation above the step's start (CUDA only), and the relative error ``||out - ref|| / ||ref||``
of the output and of every gradient against ``moe_ffn_reference`` in float32 on the same inputs and
the same expert choices. A provider that runs out of memory gets an "out of memory" row; memory is
freed and the run goes on (in the token sweep that provider stops there).

Each step is also split in two (``split_step_times``): ``fwd ms`` runs from the step's start to an event
recorded when the forward (router included) has returned, ``bwd ms`` from that event to the step's end, so the
backward is timed alone inside the same step (not as fwd+bwd minus a separate forward). Both are GPU-timeline
intervals: where the host is slower than the GPU they include the GPU's wait for launches. TFLOP/s of the forward
count 6*T*K*d*h, of the backward 12*T*K*d*h. On CUDA every row also has ``host ms``, the host's time to enqueue
one step (forward + backward) started on an idle GPU, with no synchronisation inside (``timing.host_enqueue_ms``);
the CPU has no such column (its step time is already wall time).

Named sets of shapes beside A-D (``--configs sonic``, ``--configs operator``, or one shape by name):
``sonic``, SonicMoE's H100 grid (issue 42; its published TFLOP/s and activation memory are carried as a reference,
not measured here), and ``operator``, the operator alone at per-GPU token counts (issue 39). Every row also carries
the tile-quantization waste of its shape's routing for the operator's dispatch plan: the padded rows
``sum_e ceil(count_e / block_m) * block_m`` against the real ``T*K`` rows (``tile_rows``, computed once per shape
outside the timed steps).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import inspect
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..memory import saved_activation_bytes  # noqa: F401  (compare.py reads it from here)
import torch.nn.functional as F
from torch import Tensor

from .results import JsonResult, mb_cell, number_cell
from .timing import L2_FLUSH_BYTES, SPREAD_MARK, StepTimes, cuda_step_times, host_enqueue_ms, spread_note, sync, \
    wall_step_times
from ..kernels.reference import ExpertParams, activation_forward, moe_ffn_reference, parse_activation, split_gate_up

__all__ = [
    "LayerConfig",
    "CONFIGS",
    "SONIC_CONFIGS",
    "OPERATOR_CONFIGS",
    "CONFIG_SETS",
    "NAMED_CONFIGS",
    "published_reference",
    "parse_configs",
    "tile_rows",
    "tile_quantization",
    "split_step_times",
    "SWEEP_SHAPE",
    "PROVIDERS",
    "Provider",
    "BenchResult",
    "run_layer_bench",
    "sweep_tokens",
    "parse_config",
    "layer_flops",
    "route",
    "format_markdown",
]

log = logging.getLogger("moeblaze_fx")

FLOPS_PER_TOKEN_CHOICE = 18  # 3 GEMMs forward (2*d*2h + 2*h*d = 6dh), 6 backward: 18*d*h per (token, choice)
FORWARD_FLOPS_PER_TOKEN_CHOICE = 6
DENSE_GEMM_N_CUDA = 8192  # the ceiling docs/benchmarks.md quotes: 8192^3 bf16
DENSE_GEMM_N_CPU = 1024
ROTATION_BYTES = 512 << 20  # input sets rotated between timed steps: at most this many bytes of them
MAX_ROTATION = 4
LOWMEM_BUDGET = 128 << 20  # transient_budget of the moeblaze-lowmem provider
REF_CHUNK_BYTES = 4 << 30  # transient fp32 memory of one chunk of the reference on CUDA


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    name: str
    T: int
    d: int
    h: int
    E: int
    K: int
    about: str = ""
    group: str = ""  # the named set it belongs to ("sonic", "operator"), "" for none

    def __post_init__(self) -> None:
        for field in ("T", "d", "h", "E", "K"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"layer config {self.name!r}: {field} must be a positive integer, got "
                                 f"{getattr(self, field)!r}")
        if self.K > self.E:
            raise ValueError(f"layer config {self.name!r}: K = {self.K} choices per token needs at least K experts, "
                             f"got E = {self.E}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.T, self.d, self.h, self.E, self.K)


# The configurations of docs/benchmarks.md (peers measured there on an H200, 2026-11-21).
CONFIGS: dict[str, LayerConfig] = {
    "A": LayerConfig("A", 32768, 2048, 8192, 16, 4, "large experts"),
    "B": LayerConfig("B", 16384, 4096, 14336, 8, 2, "Mixtral-like"),
    "C": LayerConfig("C", 16384, 2048, 768, 128, 8, "Qwen3-30B-A3B-like"),
    "D": LayerConfig("D", 16384, 2048, 1024, 64, 8, "OLMoE-like"),
}
SWEEP_SHAPE = (1024, 4096, 8, 2)  # (d, h, E, K) of the token-scaling sweep


def _named_set(group: str, about: str, shapes: Sequence[tuple[str, int, int, int, int, int]]) -> dict[str, LayerConfig]:
    return {name: LayerConfig(name, T, d, h, E, K, about, group) for name, T, d, h, E, K in shapes}


# SonicMoE's H100 grid (issue 42): four model sizes (T, d), three (h, E, K) each with T*K*h fixed per model, so the
# FLOPs and the minimal activation memory stay the same across a model's three shapes while the experts get finer.
SONIC_CONFIGS: dict[str, LayerConfig] = _named_set("sonic", "SonicMoE's H100 grid", [
    ("sonic-1.4b-256", 40960, 768, 256, 128, 8),
    ("sonic-1.4b-512", 40960, 768, 512, 64, 4),
    ("sonic-1.4b-1024", 40960, 768, 1024, 32, 2),
    ("sonic-7b-256", 24576, 1536, 256, 128, 8),
    ("sonic-7b-512", 24576, 1536, 512, 64, 4),
    ("sonic-7b-1024", 24576, 1536, 1024, 32, 2),
    ("sonic-30b-256", 32768, 4096, 256, 256, 16),
    ("sonic-30b-512", 32768, 4096, 512, 128, 8),
    ("sonic-30b-1024", 32768, 4096, 1024, 64, 4),
    ("sonic-120b-512", 32768, 4096, 512, 256, 16),
    ("sonic-120b-1024", 32768, 4096, 1024, 128, 8),
    ("sonic-120b-2048", 32768, 4096, 2048, 64, 4),
])
# SonicMoE's own figures (its paper, H100, fwd + bwd with the router, FLOPs = 18*T*K*d*h), published, not measured
# here: TFLOP/s read off its throughput plot (about +-5), activation memory per layer in GiB per model size.
SONIC_PUBLISHED_TFLOPS: dict[str, float] = {
    "sonic-7b-256": 389.0, "sonic-7b-1024": 465.0, "sonic-30b-256": 447.0, "sonic-30b-1024": 552.0,
    "sonic-120b-2048": 588.0,
}
SONIC_PUBLISHED_ACTIVATION_GIB: dict[str, float] = {"7b": 0.60, "30b": 2.45, "120b": 4.49}

# The operator alone at the token counts one GPU trains with (issue 39), the MoE blocks of the model benchmark's
# families: the host's time to enqueue a step matters here as much as the GPU's.
OPERATOR_CONFIGS: dict[str, LayerConfig] = _named_set("operator", "operator alone, per-GPU token counts", [
    ("op-qwen3-d1024-8k", 8192, 1024, 512, 64, 8),
    ("op-qwen3-30b-4k", 4096, 2048, 768, 128, 8),
    ("op-qwen3-30b-8k", 8192, 2048, 768, 128, 8),
    ("op-qwen3-30b-16k", 16384, 2048, 768, 128, 8),
    ("op-gpt-oss-20b-4k", 4096, 2880, 2880, 32, 4),
    ("op-mixtral-8x7b-4k", 4096, 4096, 14336, 8, 2),
])
CONFIG_SETS: dict[str, dict[str, LayerConfig]] = {"sonic": SONIC_CONFIGS, "operator": OPERATOR_CONFIGS}
NAMED_CONFIGS: dict[str, LayerConfig] = {**CONFIGS, **SONIC_CONFIGS, **OPERATOR_CONFIGS}


def published_reference(cfg: LayerConfig) -> Optional[dict[str, Any]]:
    """SonicMoE's published figures for ``cfg`` (``{"tflops", "activation_gib"}``, either may be None), or None where
    it published none. Published, not measured here."""
    if cfg.group != "sonic" or SONIC_CONFIGS.get(cfg.name) != cfg:
        return None
    tflops = SONIC_PUBLISHED_TFLOPS.get(cfg.name)
    gib = SONIC_PUBLISHED_ACTIVATION_GIB.get(cfg.name.split("-")[1])
    if tflops is None and gib is None:
        return None
    return {"tflops": tflops, "activation_gib": gib, "source": "SonicMoE (ICLR 2026), H100; published, not measured "
                                                               "here"}


def _config_names() -> str:
    return (f"A-D, a set ({', '.join(CONFIG_SETS)}) or one of its shapes "
            f"({', '.join(n for c in CONFIG_SETS.values() for n in c)})")


def parse_configs(text: str) -> list[LayerConfig]:
    """``--configs``: comma-separated names of built-in shapes (A-D, ``sonic-7b-256``, ...) and of named sets
    (``sonic``, ``operator``: all their shapes, in order); ``none`` or empty: no shape. Repeats are run once."""
    out: list[LayerConfig] = []
    for item in (p.strip() for p in text.split(",")):
        if not item or item.lower() == "none":
            continue
        if item.lower() in CONFIG_SETS:
            out.extend(CONFIG_SETS[item.lower()].values())
        elif item.upper() in CONFIGS or item.lower() in NAMED_CONFIGS:
            out.append(parse_config(item))
        else:
            raise ValueError(f"--configs: unknown configuration {item!r}; choose from {_config_names()}, or give a "
                             "shape with --config T,d,h,E,K")
    return list(dict.fromkeys(out))


def parse_config(text: str, name: Optional[str] = None) -> LayerConfig:
    """``"T,d,h,E,K"`` (or the name of a built-in shape: A-D, ``sonic-7b-256``, ...) -> :class:`LayerConfig`."""
    key = text.strip()
    if key.upper() in CONFIGS:
        return CONFIGS[key.upper()]
    if key.lower() in NAMED_CONFIGS:
        return NAMED_CONFIGS[key.lower()]
    parts = [p.strip() for p in key.split(",")]
    if len(parts) != 5:
        raise ValueError(f"--config expects T,d,h,E,K (five integers) or a name: {_config_names()}; got {text!r}")
    try:
        T, d, h, E, K = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--config expects five integers T,d,h,E,K; got {text!r}") from None
    return LayerConfig(name or f"T{T}_d{d}_h{h}_E{E}_K{K}", T, d, h, E, K, "user")


def sweep_tokens(start: int, max_tokens: int) -> list[int]:
    """T = start, 2*start, ... up to max_tokens."""
    if start < 1 or max_tokens < start:
        raise ValueError(f"token sweep needs 1 <= start <= max_tokens, got start={start}, max_tokens={max_tokens}")
    out, T = [], start
    while T <= max_tokens:
        out.append(T)
        T *= 2
    return out


def layer_flops(cfg: LayerConfig) -> int:
    return FLOPS_PER_TOKEN_CHOICE * cfg.T * cfg.K * cfg.d * cfg.h


def forward_flops(cfg: LayerConfig) -> int:
    """The forward's third of ``layer_flops``: 3 GEMMs, 6*T*K*d*h (the backward does 6 GEMMs, 12*T*K*d*h)."""
    return FORWARD_FLOPS_PER_TOKEN_CHOICE * cfg.T * cfg.K * cfg.d * cfg.h


def backward_flops(cfg: LayerConfig) -> int:
    return layer_flops(cfg) - forward_flops(cfg)


def tile_rows(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(real rows, padded rows) of a dispatch plan whose tiles hold ``block_m`` rows of one expert each, as 0-d
    int64 tensors on ``ids``' device, without a host synchronisation: real rows count the (token, choice) pairs
    with an id below ``num_experts`` (larger ids mean "no expert"); padded rows are
    ``sum_e ceil(count_e / block_m) * block_m``, the rows the tiles cover."""
    if block_m < 1:
        raise ValueError(f"tile_rows: block_m must be >= 1, got {block_m}")
    flat = ids.reshape(-1).to(torch.int64).clamp(max=num_experts)  # "no expert" ids land in bin E, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]
    padded = ((counts + (block_m - 1)) // block_m * block_m).sum()
    return counts.sum(), padded


def tile_quantization(ids: Tensor, num_experts: int, block_m: int) -> dict[str, int]:
    """``tile_rows`` on the host (one synchronisation): ``{"block_m", "real_rows", "padded_rows"}``."""
    real, padded = tile_rows(ids, num_experts, block_m)
    real_rows, padded_rows = torch.stack([real, padded]).tolist()
    return {"block_m": int(block_m), "real_rows": int(real_rows), "padded_rows": int(padded_rows)}


# ---------------------------------------------------------------------------------------------
# The layer: router, then the experts, one function per provider
# ---------------------------------------------------------------------------------------------
def route(x: Tensor, w_router: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """linear -> softmax (fp32) -> top-k -> renormalize; returns (ids [T, K] int64, weights [T, K] in x's dtype)."""
    probs = F.softmax(F.linear(x, w_router), dim=-1, dtype=torch.float32)
    top_w, ids = torch.topk(probs, K, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return ids, top_w.to(x.dtype)


def _moeblaze_layer(policy: str, budget: int | None = None,
                    activation: str = "swiglu") -> Callable[..., tuple[Tensor, Tensor]]:
    """The operator under ``policy``; ``budget``: its transient_budget in bytes (None: the default);
    ``activation``: the operator's spec."""
    from ..ops import default_chunk_tokens, moe_ffn

    def layer(x: Tensor, w_router: Tensor, w_gate_up: Tensor, w_down: Tensor, K: int) -> tuple[Tensor, Tensor]:
        ids, w = route(x, w_router, K)
        chunk = None if budget is None else default_chunk_tokens(K, x.shape[1], w_down.shape[2], True,
                                                                 x.element_size(), budget)
        return moe_ffn(x, ids, w, (w_gate_up, w_down), activation=activation, checkpoint=policy,
                       chunk_tokens=chunk), ids

    return layer


def loop_layer(x: Tensor, w_router: Tensor, w_gate_up: Tensor, w_down: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Mixtral-style: a mask per expert, ``where`` for its (choice, token) pairs, ``index_add_`` back."""
    ids, w = route(x, w_router, K)
    E = w_gate_up.shape[0]
    out = torch.zeros_like(x)
    expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)  # [E, K, T]
    for e in range(E):
        choice, token = torch.where(expert_mask[e])
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * w[token, choice, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out, ids


def _grouped_mm_probe(device: torch.device, dtype: torch.dtype, allow_cpu: bool = False) -> tuple[bool, str]:
    """Can ``torch._grouped_mm`` run forward and backward here? (bool, why not).

    The bench uses it on CUDA only (``allow_cpu`` is for tests): on the CPU, transformers itself falls
    back for some torch versions and alignments, and Inductor takes it in bfloat16 only.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False, "this torch has no torch._grouped_mm"
    if device.type != "cuda" and not allow_cpu:
        return False, f"the bench uses torch._grouped_mm on CUDA only, not on {device.type}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False, "torch._grouped_mm needs sm80 or newer"
    try:
        a = torch.randn(48, 32, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(3, 64, 32, device=device, dtype=dtype).transpose(-2, -1).requires_grad_()
        offs = torch.tensor([16, 16, 48], device=device, dtype=torch.int32)  # an empty group in the middle
        out = torch._grouped_mm(a, b, offs=offs)
        # A dense upstream gradient, as in the layer (an expanded one, from .sum(), is rejected by the kernel).
        torch.autograd.grad(out, (a, b), torch.randn_like(out))
        sync(device)
    except Exception as exc:  # noqa: BLE001 - any failure means "use the fallback", with the reason shown
        return False, f"torch._grouped_mm failed on {device.type}/{dtype}: {str(exc).splitlines()[0][:120]}"
    return True, ""


def _per_expert_mm(rows: Tensor, weight_t: Tensor, counts: Tensor) -> Tensor:
    # The fallback: the same sorted rows and the same offsets, one matmul per expert group.
    pieces = torch.split(rows, counts.to(torch.int64).tolist())
    return torch.cat([piece @ weight_t[e] for e, piece in enumerate(pieces)])


def _hf_grouped_layer(use_grouped_mm: bool, activation: str = "swiglu") -> Callable[..., tuple[Tensor, Tensor]]:
    """transformers' grouped_mm experts; ``activation``: an operator spec, applied as the reference applies it
    (for SwiGLU ``F.silu(gate) * up``)."""
    act = parse_activation(activation)

    def layer(x: Tensor, w_router: Tensor, w_gate_up: Tensor, w_down: Tensor, K: int) -> tuple[Tensor, Tensor]:
        ids, w = route(x, w_router, K)
        T, d = x.shape
        E = w_gate_up.shape[0]
        flat_ids = ids.reshape(-1)
        sorted_ids, perm = torch.sort(flat_ids)
        rows = x[perm // K]  # [T*K, d] routed copy of the tokens, expert-major
        row_w = w.reshape(-1)[perm]
        # histc as in transformers (no bincount: CUDA graphs); it takes float input on the CPU.
        hist_in = sorted_ids.int() if x.is_cuda else sorted_ids.float()
        counts = torch.histc(hist_in, bins=E, min=0, max=E - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w_gu_t, w_down_t = w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1)  # [E, d, 2h], [E, h, d]
        if use_grouped_mm:
            gate_up = torch._grouped_mm(rows, w_gu_t, offs=offsets)
        else:
            gate_up = _per_expert_mm(rows, w_gu_t, counts)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = activation_forward(act, gate, up)
        if use_grouped_mm:
            y = torch._grouped_mm(hidden, w_down_t, offs=offsets)
        else:
            y = _per_expert_mm(hidden, w_down_t, counts)
        y = y * row_w[:, None]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        out = y[inverse].view(T, K, d).sum(dim=1)
        return out, ids

    return layer


def _liger_layer(fn: Any) -> Callable[..., tuple[Tensor, Tensor]]:
    def layer(x: Tensor, w_router: Tensor, w_gate_up: Tensor, w_down: Tensor, K: int) -> tuple[Tensor, Tensor]:
        ids, w = route(x, w_router, K)
        return fn.apply(x, w_gate_up, w_down, ids.to(torch.int32), w), ids

    return layer


@dataclasses.dataclass
class Provider:
    """One implementation of the layer: ``build(device, dtype) -> (layer fn or None, note)``."""

    name: str
    label: str
    build: Callable[[torch.device, torch.dtype], tuple[Optional[Callable[..., tuple[Tensor, Tensor]]], str]]


def _build_moeblaze(policy: str, budget: int | None = None):
    def build(device: torch.device, dtype: torch.dtype):
        from .. import ops

        probe = torch.empty(0, device=device, dtype=dtype)
        note = "plain-PyTorch path"
        if ops._use_triton(probe):
            from ..kernels.sm90 import common as sm90

            note = "Triton and sm_90 Gluon kernels" if sm90.takes(probe) else "Triton kernels"
        if budget is not None:
            note += f", transient_budget {budget >> 20} MiB"
        return _moeblaze_layer(policy, budget), note

    return build


def _build_loop(device: torch.device, dtype: torch.dtype):
    return loop_layer, ""


def _grouped_mm_for_inductor(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    ok, why = _grouped_mm_probe(device, dtype)
    if ok and dtype != torch.bfloat16:
        return False, "torch._grouped_mm under Inductor takes bfloat16 only"
    return ok, why


def _build_hf(compiled: bool):
    def build(device: torch.device, dtype: torch.dtype):
        ok, why = (_grouped_mm_for_inductor if compiled else _grouped_mm_probe)(device, dtype)
        note = "torch._grouped_mm" if ok else f"per-expert matmul fallback ({why})"
        fn = _hf_grouped_layer(ok)
        if compiled:
            fn = torch.compile(fn)
            note += "; torch.compile default (Inductor)"
        return fn, note

    return build


def _cuda_graphed(layer: Callable[..., tuple[Tensor, Tensor]], backend: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """``layer`` compiled under ``mode="reduce-overhead"``; each call is a new step of the CUDA-graph trees."""
    compiled = torch.compile(layer, backend=backend, mode="reduce-overhead")

    def graphed(x: Tensor, w_router: Tensor, w_gate_up: Tensor, w_down: Tensor, K: int) -> tuple[Tensor, Tensor]:
        for w in (w_router, w_gate_up, w_down):  # as parameters are: not copied into the graph at each replay
            torch._dynamo.mark_static_address(w)
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x, w_router, w_gate_up, w_down, K)

    graphed.cuda_graphs = True  # type: ignore[attr-defined]
    return graphed


def _build_graphs(moeblaze: bool):
    def build(device: torch.device, dtype: torch.dtype):
        if device.type != "cuda":
            return None, "CUDA graphs need a CUDA device"
        if moeblaze:
            fn, note = _build_moeblaze("activations")(device, dtype)
            return _cuda_graphed(fn, "moeblaze"), note + "; backend='moeblaze', mode='reduce-overhead'"
        ok, why = _grouped_mm_for_inductor(device, dtype)
        if not ok:
            return None, why
        return _cuda_graphed(_hf_grouped_layer(True), "inductor"), "torch._grouped_mm; mode='reduce-overhead'"

    return build


def _build_liger(device: torch.device, dtype: torch.dtype):
    if device.type != "cuda":
        return None, "Liger's fused MoE runs Triton kernels on CUDA only"
    try:
        module = importlib.import_module("liger_kernel.ops.fused_moe")
        fn = module.LigerFusedMoEFunction
    except ImportError as exc:
        return None, f"liger-kernel is not installed or lacks the fused MoE ({exc}); pip install liger-kernel"
    except AttributeError:
        return None, "this liger-kernel has no LigerFusedMoEFunction (needs liger-kernel >= 0.8)"
    try:
        version = importlib.import_module("importlib.metadata").version("liger-kernel")
    except Exception:  # noqa: BLE001 - the version is informative only
        version = "?"
    autotune = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1")
    return _liger_layer(fn), f"liger-kernel {version}, LIGER_FUSED_MOE_AUTOTUNE={autotune}"


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("moeblaze-activations", "MoEBlaze, save A|B", _build_moeblaze("activations")),
        Provider("moeblaze-recompute", "MoEBlaze, recompute A|B", _build_moeblaze("recompute")),
        Provider("moeblaze-lowmem", "MoEBlaze, recompute A|B, 128 MiB of transients",
                 _build_moeblaze("recompute", LOWMEM_BUDGET)),
        Provider("loop", "per-expert loop (Mixtral-style)", _build_loop),
        Provider("hf-grouped-mm", "HF grouped_mm, eager", _build_hf(False)),
        Provider("hf-grouped-mm-compiled", "HF grouped_mm, torch.compile", _build_hf(True)),
        Provider("moeblaze-graphs", "MoEBlaze, save A|B, CUDA graphs", _build_graphs(True)),
        Provider("hf-grouped-mm-graphs", "HF grouped_mm, torch.compile reduce-overhead", _build_graphs(False)),
        Provider("liger", "Liger fused MoE", _build_liger),
    )
}


# ---------------------------------------------------------------------------------------------
# Inputs, the reference, measurement
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LayerInputs:
    w_router: Tensor  # [E, d]
    w_gate_up: Tensor  # [E, 2h, d]
    w_down: Tensor  # [E, d, h]
    pool: list[tuple[Tensor, Tensor]]  # rotated (x [T, d] leaf with grad, grad_y [T, d])
    K: int

    @property
    def params(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.w_router, self.w_gate_up, self.w_down


def make_inputs(cfg: LayerConfig, device: torch.device, dtype: torch.dtype, seed: int,
                rotate: Optional[int] = None) -> LayerInputs:
    """Random weights scaled by 1/sqrt(fan_in) (activations of order one) and a pool of token sets."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, grad: bool = False) -> Tensor:
        t = torch.randn(*shape, device=device, dtype=torch.float32, generator=gen).mul_(scale).to(dtype)
        return t.requires_grad_(grad)

    T, d, h, E, K = cfg.shape
    if rotate is None:
        set_bytes = 2 * T * d * torch.empty(0, dtype=dtype).element_size()
        rotate = max(1, min(MAX_ROTATION, ROTATION_BYTES // max(set_bytes, 1))) if device.type == "cuda" else 2
    w_router = randn(E, d, scale=d ** -0.5, grad=True)
    w_gate_up = randn(E, 2 * h, d, scale=d ** -0.5, grad=True)
    w_down = randn(E, d, h, scale=h ** -0.5, grad=True)
    pool = [(randn(T, d, grad=True), randn(T, d)) for _ in range(rotate)]
    return LayerInputs(w_router, w_gate_up, w_down, pool, K)


@dataclasses.dataclass
class Reference:
    ids: Tensor  # [T, K] the expert choices of the benchmark dtype's router (same device as the inputs)
    tensors: dict[str, Tensor]  # "out", "dx", "dw_router", "dw_gate_up", "dw_down": float32, on the CPU
    activation: str = "swiglu"  # the experts' activation (an operator spec)


GRAD_NAMES = ("dx", "dw_router", "dw_gate_up", "dw_down")


def _reference_chunk(cfg: LayerConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return cfg.T
    per_token = cfg.K * (2 * cfg.d + 6 * cfg.h) * 4 * 3  # gathered x, A|B, H, y, their grads (fp32)
    return max(1, min(cfg.T, REF_CHUNK_BYTES // per_token))


def compute_reference(inputs: LayerInputs, ids: Tensor, chunk: int, activation: str = "swiglu") -> Reference:
    """The float32 reference on the same inputs and the given expert choices, chunked over tokens.

    The router weights follow the same softmax -> gather(ids) -> renormalize path in float32, so its
    gradient is checked too; ``moe_ffn_reference`` computes the experts. Weight gradients are summed
    over the token chunks; results move to the CPU so the providers run with the GPU to themselves.
    """
    x, grad_y = inputs.pool[0]
    params32 = [p.detach().float().requires_grad_() for p in inputs.params]
    wr32, wgu32, wd32 = params32
    outs, dxs = [], []
    for lo in range(0, x.shape[0], chunk):
        hi = min(lo + chunk, x.shape[0])
        xc = x[lo:hi].detach().float().requires_grad_()
        probs = F.softmax(F.linear(xc, wr32), dim=-1)
        w = probs.gather(1, ids[lo:hi])
        w = w / w.sum(dim=-1, keepdim=True)
        y = moe_ffn_reference(xc, ids[lo:hi], w, ExpertParams(*split_gate_up(wgu32), wd32), activation)
        torch.autograd.backward(y, grad_y[lo:hi].float())
        outs.append(y.detach().cpu())
        dxs.append(xc.grad.cpu())
        del xc, probs, w, y
    tensors = {"out": torch.cat(outs), "dx": torch.cat(dxs)}
    for name, p in zip(GRAD_NAMES[1:], params32):
        tensors[name] = p.grad.cpu()
    return Reference(ids, tensors, activation)


def rel_error(actual: Tensor, expected: Tensor, chunk_elems: int = 1 << 26) -> float:
    """``||actual - expected|| / ||expected||`` in float64 sums, chunked (``expected`` may be on the CPU)."""
    a = actual.detach().reshape(-1)
    e = expected.reshape(-1)
    if a.numel() != e.numel():
        raise ValueError(f"rel_error: {a.numel()} elements vs {e.numel()} in the reference")
    num = den = 0.0
    for lo in range(0, a.numel(), chunk_elems):
        ac = a[lo:lo + chunk_elems].float()
        ec = e[lo:lo + chunk_elems].to(a.device, torch.float32)
        num += float((ac - ec).double().square().sum())
        den += float(ec.double().square().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def is_oom(exc: BaseException) -> bool:
    """CUDA out of memory, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def timer_label(device: torch.device, warmup: int, reps: int) -> str:
    if device.type == "cuda":
        return f"CUDA events, median of {reps} after {warmup} warm-up, L2 flushed before each"
    return f"CPU wall clock (not device events), median of {reps} after {warmup} warm-up"


def split_timer_label(device: torch.device) -> str:
    """How ``split_step_times`` divides a step into forward and backward."""
    clock = "events" if device.type == "cuda" else "wall-clock readings"
    return (f"fwd = from the step's start to the {clock} after the forward (router included) returned, bwd = from "
            f"there to the step's end (the backward alone, timed in the same step); each is its own median, so "
            f"fwd + bwd need not equal ms exactly")


def host_label(device: torch.device) -> str:
    if device.type == "cuda":
        return ("host ms = the host's time to enqueue one step (fwd + bwd) started on an idle GPU, no "
                "synchronisation inside, median of reps")
    return "host ms: CUDA only (on the CPU the step's wall time is the ms column)"


def split_step_times(forward: Callable[[int], Any], backward: Callable[[Any], Any], device: torch.device,
                     warmup: int, reps: int) -> tuple[list[float], list[float], list[float]]:
    """(step, forward, backward) times in ms of ``reps`` timed steps after ``warmup`` untimed ones. Step ``i`` is
    ``backward(forward(i))``: on CUDA, events before the step, after ``forward`` returned and after ``backward``
    returned, the L2 flushed before each step and the steps enqueued back to back; on the CPU the wall clock at
    the same three points. The forward's result is dropped after its backward."""
    for i in range(warmup):
        backward(forward(i))
    sync(device)
    if device.type == "cuda":
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(reps)]
        for i, (start, mid, end) in enumerate(events):
            flush.zero_()
            start.record()
            state = forward(warmup + i)
            mid.record()
            backward(state)
            end.record()
            del state
        torch.cuda.synchronize(device)
        marks = [(0.0, s.elapsed_time(m), s.elapsed_time(e)) for s, m, e in events]
    else:
        marks = []
        for i in range(reps):
            t0 = time.perf_counter()
            state = forward(warmup + i)
            t1 = time.perf_counter()
            backward(state)
            t2 = time.perf_counter()
            del state
            marks.append((0.0, (t1 - t0) * 1e3, (t2 - t0) * 1e3))
    return [e for _, _, e in marks], [m for _, m, _ in marks], [e - m for _, m, e in marks]


def step_times(step: Callable[[int], Any], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Each of ``reps`` timed steps' time in ms after ``warmup`` untimed ones (CUDA events, or the wall clock on the
    CPU)."""
    for i in range(warmup):
        step(i)
    sync(device)
    if device.type == "cuda":
        return cuda_step_times(step, device, reps, warmup)
    return wall_step_times(step, reps, warmup)


def time_steps(step: Callable[[int], Any], device: torch.device, warmup: int, reps: int) -> tuple[float, str]:
    """Median step time in ms, and how it was measured."""
    return statistics.median(step_times(step, device, warmup, reps)), timer_label(device, warmup, reps)


def dense_gemm_rate(device: torch.device, dtype: torch.dtype, warmup: int = 3, reps: int = 10) -> dict[str, Any]:
    """Measure the dense GEMM ceiling: n^3 in bf16 on CUDA (n = 8192), in the bench dtype on the CPU (n = 1024)."""
    if device.type == "cuda":
        n, gemm_dtype = DENSE_GEMM_N_CUDA, torch.bfloat16
    else:
        n, gemm_dtype = DENSE_GEMM_N_CPU, dtype
    a = torch.randn(n, n, device=device, dtype=gemm_dtype)
    b = torch.randn(n, n, device=device, dtype=gemm_dtype)
    ms, how = time_steps(lambda i: a @ b, device, warmup, reps)
    del a, b
    free_memory(device)
    return {"n": n, "dtype": str(gemm_dtype).replace("torch.", ""), "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9,
            "timer": how}


# ---------------------------------------------------------------------------------------------
# Running providers
# ---------------------------------------------------------------------------------------------
def _grads(layer: Callable[..., tuple[Tensor, Tensor]], inputs: LayerInputs, i: int) -> tuple[Tensor, ...]:
    return _backward(_forward(layer, inputs, i))


def _forward(layer: Callable[..., tuple[Tensor, Tensor]], inputs: LayerInputs, i: int) -> tuple[Tensor, ...]:
    """The forward of step ``i`` (router included): (y, x, grad_y, *params) for ``_backward``."""
    x, grad_y = inputs.pool[i % len(inputs.pool)]
    y, _ = layer(x, *inputs.params, inputs.K)
    return (y, x, grad_y, *inputs.params)


def _backward(state: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    y, x, grad_y, *params = state
    return torch.autograd.grad(y, (x, *params), grad_y)


def _row(cfg: LayerConfig, provider: str, section: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "section": section,
        "config": cfg.name,
        "T": cfg.T, "d": cfg.d, "h": cfg.h, "E": cfg.E, "K": cfg.K,
        "provider": provider,
        "status": "ok",
        "ms": None,
        "steps_timed": None,
        "ms_spread": None,  # (max - min) / median of the timed steps
        "wide_spread": None,  # ms_spread > timing.WIDE_SPREAD: the ms cell is marked and the table says why
        "tflops": None,
        "frac_dense_gemm": None,
        "fwd_ms": None,  # the forward alone (router included), median; see split_step_times
        "bwd_ms": None,  # the backward alone, median
        "fwd_tflops": None,  # 6*T*K*d*h / fwd_ms
        "bwd_tflops": None,  # 12*T*K*d*h / bwd_ms
        "host_ms": None,  # the host's time to enqueue one step on an idle GPU (CUDA only)
        "saved_bytes": None,
        "peak_bytes": None,
        "max_rel_err": None,
        "rel_err": None,
        "first_step_s": None,
        "set": cfg.group or None,
        "block_m": None,  # the operator's dispatch-plan tile height (moeblaze_fx.ops.plan_block_m)
        "real_rows": None,  # (token, choice) pairs routed to an expert, from this shape's routing
        "padded_rows": None,  # sum_e ceil(count_e / block_m) * block_m
        "published": published_reference(cfg),  # SonicMoE's figures: published, not measured here
        "note": "",
    }
    row.update(fields)
    return row


def _measure(layer: Callable[..., tuple[Tensor, Tensor]], cfg: LayerConfig, inputs: LayerInputs,
             ref: Optional[Reference], device: torch.device, warmup: int, reps: int,
             dense_tflops: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    _grads(layer, inputs, 0)  # first step: compiles, autotunes, allocates
    sync(device)
    out["first_step_s"] = time.perf_counter() - t0

    total, fwd, bwd = split_step_times(lambda i: _forward(layer, inputs, i), _backward, device,
                                       max(warmup - 1, 0), reps)
    out.update(StepTimes.of(total).fields(times=False))
    out["tflops"] = layer_flops(cfg) / out["ms"] / 1e9
    out["frac_dense_gemm"] = out["tflops"] / dense_tflops if dense_tflops else None
    out["fwd_ms"], out["bwd_ms"] = statistics.median(fwd), statistics.median(bwd)
    out["fwd_tflops"] = forward_flops(cfg) / out["fwd_ms"] / 1e9 if out["fwd_ms"] > 0 else None
    out["bwd_tflops"] = backward_flops(cfg) / out["bwd_ms"] / 1e9 if out["bwd_ms"] > 0 else None

    if device.type == "cuda":
        steps = iter(range(reps))
        out["host_ms"] = statistics.median(host_enqueue_ms(lambda: _grads(layer, inputs, next(steps)), device, reps))

    if device.type == "cuda" and not getattr(layer, "cuda_graphs", False):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        grads = _grads(layer, inputs, 0)
        torch.cuda.synchronize(device)
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        del grads

    x0 = inputs.pool[0][0]
    out["saved_bytes"] = saved_activation_bytes(lambda: layer(x0, *inputs.params, inputs.K), inputs.params)

    if ref is not None:
        x, grad_y = inputs.pool[0]
        y, ids = layer(x, *inputs.params, inputs.K)
        grads = torch.autograd.grad(y, (x, *inputs.params), grad_y)
        notes = []
        if not torch.equal(ids, ref.ids):
            # Near-ties between bf16 router logits may pick other experts; check against its own choice.
            mismatched = int((ids != ref.ids).any(dim=-1).sum())
            notes.append(f"router chose other experts for {mismatched} tokens; checked against its own choice")
            ref = compute_reference(inputs, ids, _reference_chunk(cfg, device), ref.activation)
        errs = {"out": rel_error(y, ref.tensors["out"])}
        for name, g in zip(GRAD_NAMES, grads):
            if name == "dw_router" and cfg.K == 1:
                # One choice: the renormalized weight is identically 1, so the router's gradient is zero up
                # to rounding and a relative error of it would compare noise with noise.
                notes.append("K=1: the router gets no gradient (weight = p/p = 1); dw_router not compared")
                continue
            errs[name] = rel_error(g, ref.tensors[name])
        out["rel_err"] = errs
        out["max_rel_err"] = max(errs.values())
        if notes:
            out["note_extra"] = "; ".join(notes)
        del y, ids, grads
    return out


def _run_one(layer, cfg, inputs, ref, device, warmup, reps, dense_tflops) -> tuple[dict[str, Any], str]:
    """Measure one provider; returns (fields, status). Out-of-memory and other errors become the status."""
    status, fields, error = "ok", {}, None
    try:
        fields = _measure(layer, cfg, inputs, ref, device, warmup, reps, dense_tflops)
    except Exception as exc:  # noqa: BLE001 - reported in the row; the run goes on
        if is_oom(exc):
            status = "out of memory"
        else:
            status = "error"
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            log.warning("moeblaze bench: %s failed at %s: %s", "provider", cfg.name, error)
    # Outside the except block: the exception (and the frames holding big tensors) is gone now.
    free_memory(device)
    if error:
        fields["error"] = error
    return fields, status


def _git_commit() -> str:
    env = os.environ.get("MOEBLAZE_COMMIT")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(module: str) -> Optional[str]:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - optional packages
        return None


def environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        name += f"{torch.get_num_threads()} threads)"
        total = None
    return {
        "device": name,
        "device_type": device.type,
        "device_memory_bytes": total,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger_kernel"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
    }


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BenchResult(JsonResult):
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    dispatch: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows, "dispatch": _jsonable(self.dispatch)}

    def to_markdown(self) -> str:
        return format_markdown(self)

    def plot(self, out_dir: str) -> list[str]:
        return plot_results(self, out_dir)


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    for attr in ("to_dict", "as_dict"):
        if callable(getattr(obj, attr, None)):
            return _jsonable(getattr(obj, attr)())
    return str(obj)


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; stay usable without it
        return None
    # stderr: the tables go to stdout, and a piped log should not get the bar's carriage returns
    return tqdm(total=total, disable=not enabled, desc="moeblaze bench", unit="run", dynamic_ncols=True,
                file=sys.stderr)


def run_layer_bench(
    configs: Sequence[LayerConfig] = tuple(CONFIGS.values()),
    providers: Optional[Sequence[str]] = None,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    sweep: Sequence[int] = (),
    sweep_shape: tuple[int, int, int, int] = SWEEP_SHAPE,
    warmup: int = 2,
    reps: int = 10,
    check: bool = True,
    check_max_tokens: Optional[int] = None,
    dispatch: bool = True,
    seed: int = 0,
    progress: bool = True,
    provider_table: Optional[dict[str, Provider]] = None,
    budget_s: Optional[float] = None,
    memory_fraction: Optional[float] = None,
) -> BenchResult:
    """Run the layer benchmark.

    Args:
        configs: layer shapes measured one by one (``CONFIGS`` A-D by default).
        providers: names from ``PROVIDERS`` (all by default); unavailable ones are listed in
            ``meta["skipped"]`` with the reason.
        sweep: token counts of the token-scaling sweep at ``sweep_shape`` = (d, h, E, K); each provider stops
            at its first out-of-memory.
        check: compare each provider with the float32 reference (skipped above ``check_max_tokens``).
        dispatch: also run ``moeblaze_fx.bench.dispatch.run_dispatch_bench`` when that module exists.
        provider_table: the providers to choose from (tests substitute failing ones).
        budget_s: start no new layer shape once this many seconds have passed (the dispatch benchmark still
            runs); what was not run is listed in ``meta["not_run"]``.
        memory_fraction: cap this process's CUDA allocations at this fraction of the GPU's memory (a smaller
            GPU, or a quick out-of-memory path); lifted again at the end.
    """
    started = time.perf_counter()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = PROVIDERS if provider_table is None else provider_table
    names = list(table) if providers is None else list(providers)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {list(table)}")
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup and reps must be >= 1, got warmup={warmup}, reps={reps}")

    meta = environment(device)
    if memory_fraction is not None:
        if device.type != "cuda" or not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction needs a CUDA device and a value in (0, 1], got {memory_fraction} on "
                             f"{device.type}")
        torch.cuda.set_per_process_memory_fraction(memory_fraction, device)
        meta["memory_fraction"] = memory_fraction
    try:
        return _run_layer_bench(meta, started, configs, names, table, device, dtype, sweep, sweep_shape, warmup,
                                reps, check, check_max_tokens, dispatch, seed, progress, budget_s)
    finally:
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _run_layer_bench(meta, started, configs, names, table, device, dtype, sweep, sweep_shape, warmup, reps, check,
                     check_max_tokens, dispatch, seed, progress, budget_s) -> BenchResult:
    meta.update(dtype=str(dtype).replace("torch.", ""), warmup=warmup, reps=reps, seed=seed,
                flops="18*T*K*d*h", saved="distinct storages packed by saved_tensors_hooks in the forward, "
                "parameters excluded, x included", peak="max allocated above the step's start (CUDA only)",
                rel_err="||out-ref||/||ref|| vs moe_ffn_reference in float32 on the same inputs and expert choices",
                fwd_bwd=split_timer_label(device), host=host_label(device),
                fwd_flops="6*T*K*d*h", bwd_flops="12*T*K*d*h",
                tiles="padded rows = sum over experts of ceil(count_e / block_m) * block_m for the operator's "
                      "dispatch plan (block_m = moeblaze_fx.ops.plan_block_m(device)), from each shape's routing, "
                      "against the real T*K rows")

    built: dict[str, tuple[Callable[..., Any], str]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        fn, note = table[name].build(device, dtype)
        if fn is None:
            skipped[name] = note
        else:
            built[name] = (fn, note)
    meta["providers"] = {n: {"label": table[n].label, "note": built[n][1]} for n in built}
    meta["skipped"] = skipped

    dense = dense_gemm_rate(device, dtype)
    meta["dense_gemm"] = dense
    meta["timer"] = timer_label(device, warmup, reps)

    sweep_cfgs = [LayerConfig(f"sweep-T{T}", T, *sweep_shape, about="token sweep") for T in sweep]
    bar = _progress(len(configs) * len(built) + len(sweep_cfgs) * len(built), progress)
    rows: list[dict[str, Any]] = []
    stopped: set[str] = set()
    meta["not_run"] = []

    def out_of_time() -> bool:
        return budget_s is not None and time.perf_counter() - started > budget_s

    try:
        for section, cfgs in (("configs", list(configs)), ("sweep", sweep_cfgs)):
            for cfg in cfgs:
                active = [n for n in built if not (section == "sweep" and n in stopped)]
                if bar is not None:
                    bar.update(len(built) - len(active))
                if not active:
                    continue
                if out_of_time():
                    meta["not_run"].append(f"{cfg.name} ({cfg.T}, {cfg.d}, {cfg.h}, {cfg.E}, {cfg.K}): time budget "
                                           f"of {budget_s:.0f} s spent")
                    if bar is not None:
                        bar.update(len(active))
                    continue
                rows.extend(_run_config(cfg, section, active, built, device, dtype, warmup, reps, check,
                                        check_max_tokens, seed, dense["tflops"], bar))
                if section == "sweep":
                    stopped.update(r["provider"] for r in rows[-len(active):] if r["status"] == "out of memory")
    finally:
        if bar is not None:
            bar.close()

    # The dispatch micro-benchmark is short and runs whatever the budget says.
    dispatch_result = run_dispatch(device) if dispatch else None
    meta["elapsed_s"] = time.perf_counter() - started
    return BenchResult(meta, rows, dispatch_result)


def _run_config(cfg, section, active, built, device, dtype, warmup, reps, check, check_max_tokens, seed,
                dense_tflops, bar) -> list[dict[str, Any]]:
    rows = []
    inputs = ref = None
    setup_status, setup_note = "ok", ""
    tiles: dict[str, int] = {}
    # Every shape compiles afresh, with static shapes, as a model trained at one shape would. Without this a
    # compiled provider's second shape is a recompile, for which Dynamo makes the changed sizes dynamic
    # ("automatic dynamic shapes"), and every later shape runs those generic kernels (H100, config C: 15.4 ms
    # after A and B had run, 10.0 ms compiled first; measured on an H100, 2026-11, see docs/benchmarks.md).
    torch._dynamo.reset()
    try:
        inputs = make_inputs(cfg, device, dtype, seed)
        with torch.no_grad():
            ids, _ = route(inputs.pool[0][0], inputs.w_router, cfg.K)
        # The tile-quantization waste of this shape's routing, once and outside every timed region.
        from ..ops import plan_block_m

        tiles = tile_quantization(ids, cfg.E, plan_block_m(device, dtype=dtype))
        if check and (check_max_tokens is None or cfg.T <= check_max_tokens):
            try:
                ref = compute_reference(inputs, ids, _reference_chunk(cfg, device))
            except Exception as exc:  # noqa: BLE001 - the timings stand without the check
                ref = None
                setup_note = ("no error check: the float32 reference ran out of memory" if is_oom(exc) else
                              f"no error check: the float32 reference failed ({type(exc).__name__}: {exc})"[:300])
            free_memory(device)
        elif check:
            setup_note = f"no error check above {check_max_tokens} tokens"
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        setup_status, setup_note, inputs, ref = "out of memory", "the inputs alone do not fit", None, None
    free_memory(device)

    for name in active:
        layer, provider_note = built[name]
        if bar is not None:
            bar.set_postfix_str(f"{cfg.name} {name}")
        if inputs is None:
            rows.append(_row(cfg, name, section, status=setup_status, note=setup_note))
        else:
            fields, status = _run_one(layer, cfg, inputs, ref, device, warmup, reps, dense_tflops)
            notes = [n for n in (provider_note, setup_note, fields.pop("note_extra", ""), fields.pop("error", ""))
                     if n]
            rows.append(_row(cfg, name, section, status=status, note="; ".join(notes), **tiles, **fields))
        if bar is not None:
            bar.update(1)
    del inputs, ref
    free_memory(device)
    return rows


def run_dispatch(device: torch.device) -> Any:
    """``moeblaze_fx.bench.dispatch.run_dispatch_bench`` when it exists (CUDA only), with its markdown table."""
    if device.type != "cuda":
        return {"status": "skipped", "note": "the dispatch micro-benchmark times Triton kernels on CUDA only"}
    try:
        module = importlib.import_module("moeblaze_fx.bench.dispatch")
    except ImportError as exc:
        return {"status": "skipped", "note": f"moeblaze_fx.bench.dispatch is not available ({exc})"}
    fn = getattr(module, "run_dispatch_bench", None)
    if fn is None:
        return {"status": "skipped", "note": "moeblaze_fx.bench.dispatch has no run_dispatch_bench"}
    offer = {"device": str(device)}
    try:
        params = inspect.signature(fn).parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        kwargs = {k: v for k, v in offer.items() if accepts_any or k in params}
    except (TypeError, ValueError):
        kwargs = {}
    try:
        rows = fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the layer results stand on their own
        error = f"{type(exc).__name__}: {exc}"[:500]
    else:
        result: dict[str, Any] = {"status": "ok", "rows": _jsonable(rows)}
        table = getattr(module, "format_dispatch_table", None)
        if callable(table):
            try:
                result["markdown"] = table(rows)
            except Exception as exc:  # noqa: BLE001
                result["markdown"] = f"(format_dispatch_table failed: {type(exc).__name__}: {exc})"
        return result
    free_memory(device)
    return {"status": "error", "note": error}


# ---------------------------------------------------------------------------------------------
# Output: markdown and plots
# ---------------------------------------------------------------------------------------------
def _fmt(value: Optional[float], spec: str) -> str:
    return number_cell(value, spec, tiny=True)  # tiny sizes on the CPU: show the digits that matter


def _status_cell(row: dict[str, Any]) -> Optional[str]:
    return None if row["status"] == "ok" else row["status"]


def format_markdown(result: BenchResult) -> str:
    m = result.meta
    dense = m.get("dense_gemm") or {}
    lines = [
        f"Device: {m['device']}; torch {m['torch']}, triton {m.get('triton') or '-'}, "
        f"transformers {m.get('transformers') or '-'}; {m['date']}; commit {m['commit']}; dtype {m['dtype']}.",
        f"Timer: {m.get('timer', '-')}. Dense GEMM {dense.get('n')}^3 {dense.get('dtype')}: "
        f"{_fmt(dense.get('tflops'), '.1f')} TFLOP/s measured in this run.",
        "FLOPs = 18*T*K*d*h; saved = activation bytes kept for backward (saved_tensors_hooks, parameters "
        "excluded, x included); peak = max allocation above the step's start; err = max over the output and "
        "every gradient of ||out-ref||/||ref|| vs the float32 reference.",
        f"ms = one step (fwd + bwd); {m.get('fwd_bwd', '-')}; {m.get('host', '-')}.",
        "",
    ]
    for section, title in (("configs", "Configurations"), ("sweep", "Token scaling")):
        rows = [r for r in result.rows if r["section"] == section]
        if not rows:
            continue
        if section == "sweep":
            s = rows[0]
            title += f", (d, h, E, K) = ({s['d']}, {s['h']}, {s['E']}, {s['K']})"
        lines += [f"### {title}", "",
                  "| config (T, d, h, E, K) | provider | ms | fwd + bwd ms | host ms | TFLOP/s | % dense GEMM | "
                  "saved MB | peak MB | max rel err | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        last = None
        for r in rows:
            cfg = f"{r['config']} {r['T']}, {r['d']}, {r['h']}, {r['E']}, {r['K']}"
            cfg_cell = cfg if cfg != last else ""
            last = cfg
            status = _status_cell(r)
            if status:
                cells = [status] + ["-"] * 8
            else:
                frac = None if r["frac_dense_gemm"] is None else 100 * r["frac_dense_gemm"]
                ms_cell = _fmt(r["ms"], ".2f") + (SPREAD_MARK if r.get("wide_spread") else "")
                cells = [ms_cell, _fwd_bwd_cell(r), _fmt(r.get("host_ms"), ".2f"), _fmt(r["tflops"], ".1f"),
                         _fmt(frac, ".0f"), mb_cell(r["saved_bytes"]), mb_cell(r["peak_bytes"]),
                         _fmt(r["max_rel_err"], ".1e")]
            note = r["note"].replace("|", "/")
            lines.append(f"| {cfg_cell} | {r['provider']} | " + " | ".join(cells) + f" | {note} |")
        lines.append("")
        if section == "sweep":
            lines += _sweep_grid(rows)
    sonic = [r for r in result.rows if r["section"] == "configs" and r.get("set") == "sonic"]
    if sonic:
        lines += _sonic_table(sonic)
    note = spread_note([r.get("wide_spread") for r in result.rows])
    if note:
        lines += [note, ""]
    if m.get("not_run"):
        lines.append("Not run: " + "; ".join(m["not_run"]) + ".")
        lines.append("")
    if m.get("skipped"):
        lines.append("Skipped providers: " + "; ".join(f"{k}: {v}" for k, v in m["skipped"].items()) + ".")
        lines.append("")
    if result.dispatch is not None:
        lines += ["### Dispatch metadata", "", _dispatch_markdown(result.dispatch), ""]
    return "\n".join(lines).rstrip() + "\n"


def _fwd_bwd_cell(row: dict[str, Any]) -> str:
    if row.get("fwd_ms") is None or row.get("bwd_ms") is None:
        return "-"
    return f"{_fmt(row['fwd_ms'], '.2f')} + {_fmt(row['bwd_ms'], '.2f')}"


def _tiles_cell(row: dict[str, Any]) -> str:
    real, padded = row.get("real_rows"), row.get("padded_rows")
    if real is None or padded is None:
        return "-"
    waste = f" (+{100 * (padded - real) / real:.1f}%)" if real else ""
    return f"{padded:,} / {real:,}{waste}"


def _published_cell(row: dict[str, Any]) -> str:
    pub = row.get("published")
    if not pub:
        return ""
    parts = []
    if pub.get("tflops") is not None:
        parts.append(f"≈{pub['tflops']:.0f} TFLOP/s")
    if pub.get("activation_gib") is not None:
        parts.append(f"≈{pub['activation_gib']:.2f} GiB")
    return ", ".join(parts)


def _sonic_table(rows: list[dict[str, Any]]) -> list[str]:
    """SonicMoE's grid: forward and backward apart, their TFLOP/s, activation memory, tile waste, its own figures."""
    block_m = sorted({r["block_m"] for r in rows if r.get("block_m") is not None})
    tile = f"block_m = {', '.join(map(str, block_m))}" if block_m else "block_m"
    out = ["### SonicMoE's grid", "",
           "TFLOP/s fwd = 6*T*K*d*h / fwd ms, bwd = 12*T*K*d*h / bwd ms, total = 18*T*K*d*h / ms; saved GiB as "
           f"above; padded / real rows: the operator's dispatch-plan tiles ({tile}) over this shape's routing. "
           "The last column is SonicMoE's own figure (its paper, H100, read off its plot, about +-5 TFLOP/s): "
           "published, not measured here.", "",
           "| config (h, E, K) | provider | fwd ms | bwd ms | TFLOP/s fwd / bwd / total | saved GiB | "
           "padded / real rows | SonicMoE (published, not measured here) |",
           "|---|---|---|---|---|---|---|---|"]
    last = None
    for r in rows:
        first = r["config"] != last
        last = r["config"]
        cfg_cell = f"{r['config']} ({r['h']}, {r['E']}, {r['K']})" if first else ""
        if r["status"] != "ok":
            cells = [r["status"], "-", "-", "-"]
        else:
            tflops = " / ".join(_fmt(r.get(k), ".0f") for k in ("fwd_tflops", "bwd_tflops", "tflops"))
            saved = None if r["saved_bytes"] is None else r["saved_bytes"] / 2 ** 30
            cells = [_fmt(r.get("fwd_ms"), ".2f"), _fmt(r.get("bwd_ms"), ".2f"), tflops, _fmt(saved, ".2f")]
        cells += [_tiles_cell(r) if first else "", _published_cell(r) if first else ""]
        out.append(f"| {cfg_cell} | {r['provider']} | " + " | ".join(cells) + " |")
    return out + [""]


def _sweep_grid(rows: list[dict[str, Any]]) -> list[str]:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    tokens = sorted({r["T"] for r in rows})
    cell = {(r["T"], r["provider"]): r for r in rows}
    out = ["| T | " + " | ".join(providers) + " |", "|---|" + "---|" * len(providers)]
    for T in tokens:
        cells = []
        for p in providers:
            r = cell.get((T, p))
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                peak = "" if r["peak_bytes"] is None else f" / {r['peak_bytes'] / 1e9:.1f} GB"
                cells.append(f"{r['ms']:.2f} ms{peak}")
        out.append(f"| {T} | " + " | ".join(cells) + " |")
    return out + [""]


def _dispatch_markdown(dispatch: Any) -> str:
    for attr in ("to_markdown", "markdown"):
        fn = getattr(dispatch, attr, None)
        if callable(fn):
            return fn()
    if isinstance(dispatch, str):
        return dispatch
    if isinstance(dispatch, dict) and isinstance(dispatch.get("markdown"), str):
        return dispatch["markdown"]
    if isinstance(dispatch, dict) and "note" in dispatch:
        return f"{dispatch.get('status', '')}: {dispatch['note']}"
    return "```\n" + json.dumps(_jsonable(dispatch), indent=2) + "\n```"


def plot_results(result: BenchResult, out_dir: str) -> list[str]:
    """PNG charts: per-config time and memory bars, and time / peak memory against T in the sweep."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib, or moeblaze-fx[bench])") from exc
    os.makedirs(out_dir, exist_ok=True)
    written = []
    subtitle = f"{result.meta['device']}, torch {result.meta['torch']}, {result.meta['dtype']}, {result.meta['date']}"

    configs = [r for r in result.rows if r["section"] == "configs"]
    if configs:
        names = list(dict.fromkeys(r["config"] for r in configs))
        providers = list(dict.fromkeys(r["provider"] for r in configs))
        metrics = [("ms", "ms per step (fwd+bwd)", 1.0), ("saved_bytes", "saved activations (MB)", 2 ** -20)]
        if any(r["peak_bytes"] is not None for r in configs):
            metrics.append(("peak_bytes", "peak memory (MB)", 2 ** -20))
        fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.5), squeeze=False)
        width = 0.8 / max(len(providers), 1)
        for ax, (key, label, scale) in zip(axes[0], metrics):
            for j, p in enumerate(providers):
                xs, ys, oom_xs = [], [], []
                for i, c in enumerate(names):
                    r = next((r for r in configs if r["config"] == c and r["provider"] == p), None)
                    if r is None:
                        continue
                    if r["status"] == "ok" and r[key] is not None:
                        xs.append(i + j * width)
                        ys.append(r[key] * scale)
                    elif r["status"] == "out of memory":
                        oom_xs.append(i + j * width)
                bars = ax.bar(xs, ys, width, label=p)
                if oom_xs:
                    ax.plot(oom_xs, [0] * len(oom_xs), "x", color=bars.patches[0].get_facecolor() if bars.patches
                            else "k", markersize=10)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
            ax.set_ylabel(label)
            ax.set_title(label)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"MoE layer, forward + backward ({subtitle})", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, "configs.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    sweep = [r for r in result.rows if r["section"] == "sweep"]
    if sweep:
        providers = list(dict.fromkeys(r["provider"] for r in sweep))
        metrics = [("ms", "ms per step (fwd+bwd)", 1.0)]
        if any(r["peak_bytes"] is not None for r in sweep):
            metrics.append(("peak_bytes", "peak memory (GB)", 1e-9))
        else:
            metrics.append(("saved_bytes", "saved activations (GB)", 1e-9))
        fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.8), squeeze=False)
        s = sweep[0]
        for ax, (key, label, scale) in zip(axes[0], metrics):
            for p in providers:
                rs = sorted((r for r in sweep if r["provider"] == p), key=lambda r: r["T"])
                ok = [(r["T"], r[key] * scale) for r in rs if r["status"] == "ok" and r[key] is not None]
                (line,) = ax.plot([t for t, _ in ok], [v for _, v in ok], "o-", label=p)
                for r in rs:
                    if r["status"] == "out of memory":
                        top = ok[-1][1] if ok else 1.0
                        ax.plot([r["T"]], [top], "X", color=line.get_color(), markersize=11)
                        ax.annotate("OOM", (r["T"], top), textcoords="offset points", xytext=(4, 4), fontsize=8,
                                    color=line.get_color())
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
            ax.set_ylabel(label)
            ax.set_title(f"{label}, (d, h, E, K) = ({s['d']}, {s['h']}, {s['E']}, {s['K']})", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"Token scaling; X = out of memory ({subtitle})", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, "sweep.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
