"""Launch configurations of the expert kernels: one factory, one escape hatch, and the options in force.

Every expert kernel belongs to one *kind*; :func:`kernel_configs` is the single place that lists the
candidate configurations of each kind, and :func:`launch` is the single place that picks one:

* a pinned configuration (the kernel option ``kernel_config``, ``config.KernelOptions``; CI, debugging): that one
  configuration for every kernel, no benchmarking. Format ``"block_m=16,block_n=16,block_k=16,num_warps=4,
  num_stages=1"`` (missing keys keep the defaults of :class:`KernelConfig`).
* under ``TRITON_INTERPRET=1`` without a pin: :data:`INTERPRETER_CONFIG` (tiny tiles, no benchmarking).
* float32 operands on the GPU without a pin: the configuration of :data:`FLOAT32_CONFIGS` for how the products run
  (the kernel option ``float32_products``, resolved per call by :func:`using`; the candidates below are sized for
  16-bit operands' shared memory).
* otherwise: ``triton.autotune`` over the kind's short list, keyed on the GEMM sizes; after the first launch of
  a key, :func:`launch` calls the kernel with the tuner's choice directly.
  A kind with one candidate is launched with it directly, never through the tuner (``dh_act`` must be: it
  overwrites its input).

The kernel options in force (:func:`options`) are those of the innermost :func:`using` block on this thread: the
operators (``ops.py``) run their kernels inside one, with the options their call carries; outside any, those of
``config.current()``.

Kinds, and what ``block_m/n/k`` mean for each:

``up``           up projection (forward) over the plan's row tiles: rows x (h columns, gate and up each) x d
``dh``           backward dH' (A|B read from the saved preact) over row tiles: rows x h x d
``dh_recompute`` the same kernel recomputing A|B: three accumulators (gated), so a narrower tile
``dh_gemm``      the dh kernel split in two ("activations"): its GEMM alone, dH' stored (rows x h x d)
``dh_act``       ... and its epilogue alone, dH' read back (rows x h; block_k unused)
``down``         row-tile GEMM (forward down projection, backward dX = dA W_gate + dB W_up): rows x d x (h or 2 x h)
``dw``           per-expert weight gradient, contraction over the expert's slots: out rows x out cols x slots

The keys of the tuned kernels include the activation (``ACT``) where it changes the kernel; a launch
that accumulates into its output is never the one that tunes (see ``triton.dw.weight_grad``).

The row-tile kinds take ``BLOCK_M`` from the dispatch plan (:func:`plan_block_m`), never from a config:
the plan's ``tile_expert``/``tile_start`` are built for one tile height.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import config as _config
from ..config import KernelOptions, interpreting
from . import launch as _launch_module
from . import program as _program

__all__ = [
    "KernelConfig",
    "INTERPRETER_CONFIG",
    "FLOAT32_CONFIGS",
    "float32_products",
    "resolve_float32_products",
    "DEFAULT_BLOCK_M",
    "interpreting",
    "options",
    "using",
    "autotuning",
    "pinned_config",
    "plan_block_m",
    "kernel_configs",
    "dweights_chunk",
    "fit_descriptors",
    "fitted_descriptor",
    "tuned",
    "launch",
]

# Tile height of the dispatch plan on the GPU: 128 rows feed the H100's wgmma at full width.
DEFAULT_BLOCK_M = 128
# Every tuned config of the `dh` kinds has block_n a multiple of this (asserted in kernel_configs);
# the routing-weight gradient is reduced in chunks of this many hidden columns.
_DWEIGHTS_CHUNK = 64

_DH_KINDS = ("dh", "dh_recompute", "dh_gemm", "dh_act")  # their block_n carries the dweights chunks
_TILE_KINDS = ("up", *_DH_KINDS, "down")
KINDS = _TILE_KINDS + ("dw",)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = DEFAULT_BLOCK_M
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    split_n: int = 1  # dh only: side-by-side block_n tiles per program (1 or 2)

    def meta(self, kind: str) -> dict[str, int]:
        """The constexpr meta-parameters this config sets for kernels of ``kind``."""
        if kind in ("dh", "dh_gemm", "dh_act"):
            return {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m, "SPLIT_N": self.split_n}
        if kind == "dh_recompute":  # three accumulators already: never split
            return {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m, "SPLIT_N": 1}
        if kind in _TILE_KINDS:  # BLOCK_M comes from the plan
            return {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}
        if kind == "dw":
            return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}
        raise ValueError(f"unknown kernel kind {kind!r}; known: {KINDS}")

    def to_triton(self, kind: str) -> triton.Config:
        return triton.Config(self.meta(kind), num_warps=self.num_warps, num_stages=self.num_stages,
                             pre_hook=_fit_hook)


def fit_descriptors(args, meta) -> None:
    """Give every host tensor descriptor among ``args`` whose block follows the launch's configuration (it has a
    ``block_for(meta)``) the block of ``meta``: the autotuner times candidates of different blocks on the same
    descriptor object."""
    for a in args:
        fit = getattr(a, "block_for", None)
        if fit is not None:
            a.block_shape = fit(meta)


def fitted_descriptor(t: torch.Tensor, block_for):
    """A host tensor descriptor over ``t`` whose block is set at each launch to ``block_for(meta)`` of the
    configuration launched (:func:`fit_descriptors`): built before the tuner picks a configuration."""
    desc = TensorDescriptor(t, list(t.shape), list(t.stride()), [16] * t.dim())  # a valid block until fitted
    desc.block_for = block_for
    return desc


def _fit_hook(nargs: dict) -> None:  # a triton.Config pre_hook: nargs holds the arguments and the config's meta
    fit_descriptors(nargs.values(), nargs)


INTERPRETER_CONFIG = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, group_m=2)
# float32 on the GPU, one configuration per way of multiplying (triton.common.dot_precision). "ieee" runs on the CUDA
# cores, so small tiles; two 64 x 64 fp32 accumulators (up) and 3 stages of 12 KB fit every kind (dh's three too). At
# OLMoE's layer (4096, 2048, 1024, 64, 8) on an H200 (2026-11-28, kernel ms of a forward + backward step): block_k 16
# with 3 or 4 stages 65.6 (up 25.5, down 22.4, dW 13.9); block_k 32 with 2 stages 301.9 (the up kernel 251 of it),
# with 3 stages 351.6; 8 warps, 32- or 128-wide tiles, or 128 or 32 rows: 67.2-347.8.
# Tensor-core products of bf16 parts: at OLMoE's layer (H200, 2026-12-01, forward + backward ms) bf16x6 128 x 128 x 32
# tiles with 8 warps 24.2, 64 x 128 x 32 with 4 warps 23.7, 128 x 64 x 32 with 4 or 8 warps 25.8 / 27.0, 128 x 128 x 16
# with 4 stages 28.9; bf16x3 16.6 (128 x 128 x 32, 8 warps), 18.4 (128 x 64 x 32, 4 warps). One configuration for both,
# so that torch's TF32 setting, which picks between them, never changes the dispatch plan's tile height.
_SPLIT_BF16_CONFIG = KernelConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3, group_m=8)
FLOAT32_CONFIGS = {
    "ieee": KernelConfig(block_m=64, block_n=64, block_k=16, num_warps=4, num_stages=3, group_m=8),
    "bf16x6": _SPLIT_BF16_CONFIG,
    "bf16x3": _SPLIT_BF16_CONFIG,
}


def resolve_float32_products(opts: KernelOptions) -> str:
    """How a call under ``opts`` multiplies float32 operands: the kernel option ``float32_products``, with "auto"
    resolved from torch's CUDA float32 matmul precision now (``config.float32_matmul_reduced``): "bf16x3" where torch
    itself may run below float32 (TF32), "bf16x6" where it may not. A compiled graph reads the same setting when it
    is traced and when it runs: Dynamo guards on torch's TF32 flag and compiles again when it changes."""
    choice = opts.float32_products
    if choice != "auto":
        return choice
    return "bf16x3" if _config.float32_matmul_reduced("cuda") else "bf16x6"


class _Scope(threading.local):
    """Per thread: (KernelOptions, fixed KernelConfig or None, float32 products or None) of the open :func:`using`
    blocks, innermost last."""

    def __init__(self) -> None:
        self.stack: list[tuple[KernelOptions, KernelConfig | None, str | None]] = []


_SCOPE = _Scope()


@contextlib.contextmanager
def using(opts: KernelOptions, dtype: torch.dtype | None = None) -> Iterator[KernelOptions]:
    """Run the kernels launched inside the block (on this thread) with ``opts``, on operands of ``dtype`` (float32
    multiplies as :func:`resolve_float32_products` says, with that way's :data:`FLOAT32_CONFIGS` configuration where
    nothing else is pinned)."""
    if not isinstance(opts, KernelOptions):
        raise TypeError(f"using() takes a config.KernelOptions, got {type(opts).__name__}")
    products = resolve_float32_products(opts) if dtype == torch.float32 else None
    _SCOPE.stack.append((opts, _resolve_fixed(opts, products), products))
    try:
        yield opts
    finally:
        _SCOPE.stack.pop()


def options() -> KernelOptions:
    """The kernel options in force: the innermost :func:`using` block's, else ``config.current().kernels``."""
    stack = _SCOPE.stack
    return stack[-1][0] if stack else _config.current().kernels


@functools.lru_cache(maxsize=64)
def _parse_pinned(spec: str) -> KernelConfig:
    values = dict((k, int(v)) for k, _, v in (item.partition("=") for item in spec.split(",")))
    return KernelConfig(**values)  # (validated by config.KernelOptions)


def pinned_config() -> KernelConfig | None:
    """The configuration pinned by the kernel option ``kernel_config`` in force, or None."""
    spec = options().kernel_config
    return _parse_pinned(spec) if spec else None


def _resolve_fixed(opts: KernelOptions, products: str | None = None) -> KernelConfig | None:
    """The configuration every launch takes under ``opts`` (None: autotuned), for float32 operands multiplied as
    ``products`` (None: 16-bit operands)."""
    if opts.kernel_config:
        return _parse_pinned(opts.kernel_config)
    if interpreting():
        return INTERPRETER_CONFIG
    return FLOAT32_CONFIGS[products] if products is not None else None


def _fixed_config() -> KernelConfig | None:
    stack = _SCOPE.stack
    return stack[-1][1] if stack else _resolve_fixed(_config.current().kernels)


def float32_products() -> str:
    """How the launches of the innermost :func:`using` block multiply float32 operands (Triton's ``input_precision``);
    outside one, as ``config.current()``'s options say."""
    stack = _SCOPE.stack
    products = stack[-1][2] if stack else None
    return products if products is not None else resolve_float32_products(options())


def autotuning() -> bool:
    """Whether :func:`launch` goes through ``triton.autotune`` (which runs each candidate several times, so a
    launch that adds into its output must not be the one that tunes)."""
    return _fixed_config() is None


def plan_block_m() -> int:
    """Tile height the dispatch plan must be built with: ``dispatch(ids, E, block_m=plan_block_m())``."""
    cfg = _fixed_config()
    return cfg.block_m if cfg is not None else DEFAULT_BLOCK_M


def dweights_chunk() -> int:
    """Hidden columns per partial sum of the routing-weight gradient (divides every dh block_n in use).
    Half of a fixed config's block_n, so that the interpreter tests exercise programs owning two chunks."""
    cfg = _fixed_config()
    return max(cfg.block_n // 2, 8) if cfg is not None else _DWEIGHTS_CHUNK


def kernel_configs(kind: str) -> list[KernelConfig]:
    """The autotuning candidates of one kernel kind (H100/H200, 16-bit operands). Kept short: every
    candidate costs a compile and a benchmark per new key."""
    if kind == "up":  # two accumulators (gate, up) of block_m x block_n. H100, 2026-11-21, pointer loads (ms):
        # C 1.81 / 1.72 / 2.10, D 2.25 / 2.45 / 2.64 for these three; 64-wide tiles never won on A-D
        cfgs = [KernelConfig(block_n=128, block_k=64, num_warps=8, num_stages=3),
                KernelConfig(block_n=128, block_k=64, num_warps=8, num_stages=4),
                KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=4)]
    elif kind == "dh":  # one dH' accumulator, then an epilogue holding dH', A, B. A 128x64 tile is L2-bound
        # (H200, config A, at ad053fa: 262 TFLOP/s); block_n=128 spills 1 KB in the epilogue (and ran at 189);
        # split_n=2 runs the GEMM 128 wide and the epilogue 64 columns at a time: 329-332 TFLOP/s
        cfgs = [KernelConfig(block_n=64, block_k=64, num_warps=8, num_stages=4, split_n=2, group_m=16),
                KernelConfig(block_n=64, block_k=128, num_warps=8, num_stages=3, split_n=2)]
    elif kind == "dh_recompute":  # three accumulators: dH', A, B (170-175 registers, no spills)
        cfgs = [KernelConfig(block_n=64, block_k=64, num_warps=8, num_stages=3),
                KernelConfig(block_n=64, block_k=32, num_warps=8, num_stages=4)]
    elif kind == "dh_gemm":  # the GEMM alone: no epilogue registers, so the 256-wide tiles of up and down fit
        cfgs = [KernelConfig(block_n=256, block_k=64, num_warps=8, num_stages=3),
                KernelConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, split_n=2)]
    elif kind == "dh_act":  # memory-bound: one configuration, no tuning. H100 (docs/dh.md), ms at
        # C / D / A, the partials by slot: 128 x 64 tiles with 16 warps and group_m 1 (the rows' columns in order)
        # 0.418 / 0.556 / 4.40, 2.9 TB/s against a 3.0 TB/s copy; two 64-column halves with 8 warps 0.514 / 0.683 /
        # 5.48 (with group_m 8 and the partials by pair, the earlier choice: 0.556 / 0.749 / 6.13); a 128 x 128 tile,
        # two 128-column halves and 4 warps were 15-73 % slower than that
        cfgs = [KernelConfig(block_n=64, block_k=64, num_warps=16, num_stages=1, split_n=1, group_m=1)]
    elif kind == "down":  # H100, 2026-11-21, pointer loads, dX ms: C 1.65 / 1.60 / 2.06, D 2.06 / 2.03 / 2.52
        cfgs = [KernelConfig(block_n=256, block_k=64, num_warps=8, num_stages=3),
                KernelConfig(block_n=256, block_k=64, num_warps=8, num_stages=4),
                KernelConfig(block_n=128, block_k=64, num_warps=8, num_stages=4)]
    elif kind == "dw":  # the gathered operand on A's side (dW_gate, dW_up computed transposed). H100, 2026-11-21
        # (docs/dw.md), raw launches, dW_down / dW_gate ms: 128x256 s7 C 0.98 / 0.95, D 1.17 / 1.11, A 7.57 / 8.64;
        # s5 C 0.96 / 0.97, D 1.10 / 1.13, A 7.46 / 8.11 (7 and 5 stages hold 4 and 3 tile buffers: the gathered
        # rows' indices take a stage). 256x128 tiles (s3 with the rows in registers, s7) lost on both
        # launches, 1.14-1.20 ms at C (docs/dw.md)
        cfgs = [KernelConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=7),
                KernelConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=5)]
    else:
        raise ValueError(f"unknown kernel kind {kind!r}; known: {KINDS}")
    if kind in _DH_KINDS:
        assert all(c.block_n % _DWEIGHTS_CHUNK == 0 and c.block_n * c.split_n <= 256 for c in cfgs)
    return cfgs


@functools.lru_cache(maxsize=None)
def _only_config(kind: str) -> KernelConfig | None:
    """The kind's configuration when it has a single candidate (launches look this up on the host's hot path)."""
    cfgs = kernel_configs(kind)
    return cfgs[0] if len(cfgs) == 1 else None


def tuned(kernel, kind: str, key: list[str]):
    """``kernel`` (a heuristics/jit kernel) wrapped in ``triton.autotune`` over the kind's candidates."""
    return triton.autotune(configs=[c.to_triton(kind) for c in kernel_configs(kind)], key=key)(kernel)


# The autotuner's choice per launch key (see _launch_key): later launches with that key go straight to the
# kernel with it. Triton's Autotuner.run rebuilds its key from every argument at every launch, and a windowed
# step makes ~10 launches a window: its host time, not its kernels, bounded the step (docs/host.md).
_CHOSEN: dict[tuple, dict] = {}
_KEY_POSITIONS: dict[object, tuple] = {}  # per tuned kernel (module-level singletons, keyed by themselves)


def _launch_key(tuned_kernel, args: tuple, constexprs: dict) -> tuple:
    """At least as fine as ``triton.autotune``'s key (its key arguments' values and every tensor argument's
    dtype): those, plus every constexpr, so that one entry never stands for two of the tuner's keys."""
    positions = _KEY_POSITIONS.get(tuned_kernel)
    if positions is None:
        names = list(tuned_kernel.arg_names)
        positions = _KEY_POSITIONS[tuned_kernel] = tuple((k, names.index(k)) for k in tuned_kernel.keys)
    values = tuple(args[i] if i < len(args) else constexprs[k] for k, i in positions)
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    return tuned_kernel, values, dtypes, tuple(sorted(constexprs.items()))


def launch(kernel, tuned_kernel, kind: str, grid, *args, **constexprs):
    """Launch with the pinned / interpreter configuration when there is one, else through the autotuner: the
    first launch of each key (:func:`_launch_key`) runs ``tuned_kernel`` (tuning when its key is new), later
    ones run ``kernel`` with the configuration it chose, the same call without the tuner's bookkeeping, through
    :func:`.launch.launch` (no Triton binding once the specialization is compiled).

    ``grid`` is a callable of the meta-parameters (as for ``triton.autotune``)."""
    cfg = _fixed_config()
    if cfg is None:  # a kind with one candidate: never through the tuner, which may run a launch many times
        cfg = _only_config(kind)
    if cfg is not None:
        meta = cfg.meta(kind)
        fit_descriptors(args, meta)
        return _launch(kernel, grid, args, constexprs, dict(meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    key = _launch_key(tuned_kernel, args, constexprs)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        _program.refuse("a launch of an autotuned Triton kernel through its tuner")
        out = tuned_kernel[grid](*args, **constexprs)
        _CHOSEN[key] = tuned_kernel.best_config.all_kwargs()
        return out
    fit_descriptors(args, chosen)
    return _launch(kernel, grid, args, constexprs, chosen)


def _launch(kernel, grid, args: tuple, constexprs: dict, meta: dict) -> None:
    """``kernel[grid](*args, **constexprs, **meta)`` through :func:`.launch.launch`, the grid evaluated here (the
    grids of these kernels read only the configuration's meta-parameters)."""
    _launch_module.launch(kernel, tuple(grid({**constexprs, **meta})) if callable(grid) else grid, *args, **constexprs,
                          **meta)
