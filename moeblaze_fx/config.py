"""Every option of the backend and of its kernels, in two dataclasses.

Options reach the backend through ``torch.compile(model, backend="moeblaze", options={...})``; the
defaults can be changed for a block of code with ``moeblaze_fx.patch(checkpoint="recompute")``. The kernel
options are the field ``kernels`` (:class:`KernelOptions`), given as a dict of its fields:
``options={"kernels": {"gluon": False}}`` or ``moeblaze_fx.patch(kernels={"gluon": False})``.

A compiled graph carries its kernel options as an argument of each MoEBlaze operator (:func:`encode_kernels`), so
the forward and the backward run with the options the graph was compiled with, whatever is in force when they run.
The direct API (``moeblaze_fx.moe_ffn``) takes those of :func:`current` at the call.

One environment variable overrides the defaults for a whole process (read once, at import):
``MOEBLAZE_OPTIONS``, items separated by ``;``, each ``name=value``; a kernel option is named
``kernels.<field>``. For example::

    MOEBLAZE_OPTIONS="checkpoint=recompute;verify=0;kernels.gluon=0;kernels.kernel_config=block_m=64,num_warps=4"

Booleans are ``1/0/true/false``, numbers are integers, ``none`` clears an optional field. The only other
variable read here is Triton's own ``TRITON_INTERPRET`` (:func:`interpreting`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Iterator, Optional

import torch

__all__ = ["MoEBlazeConfig", "KernelOptions", "patch", "current", "from_options", "encode_kernels", "decode_kernels",
           "interpreting", "float32_matmul_precision", "float32_matmul_reduced", "ENV_VAR", "FLOAT32_PRODUCTS"]

ENV_VAR = "MOEBLAZE_OPTIONS"
CHECKPOINT_CHOICES = ("activations", "recompute", "auto")
# The fields a pinned kernel configuration may set (kernels.autotune.KernelConfig's), and those that are tile sizes.
KERNEL_CONFIG_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "split_n")
_TILE_KEYS = ("block_m", "block_n", "block_k")
DISPATCH_PATHS = ("sort", "dense")
# How the CUDA kernels multiply float32 operands (the kernel option ``float32_products``, see KernelOptions).
FLOAT32_PRODUCTS = ("auto", "bf16x6", "bf16x3", "ieee")


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _kernel_config(value: Any) -> Optional[str]:
    """A pinned kernel configuration in its canonical form ``"block_m=32,block_n=16"`` (keys in KernelConfig's
    order), from that string (any key order) or a dict; None stays None."""
    if value is None:
        return None
    what = f"kernels.kernel_config={value!r}"
    if isinstance(value, str):
        items = {}
        for item in (s for s in value.split(",") if s.strip()):
            key, sep, v = item.partition("=")
            if not sep:
                raise ValueError(f"moeblaze: {what}: expected comma-separated key=value, e.g. 'block_m=64,num_warps=4'")
            items[key.strip()] = v.strip()
    elif isinstance(value, dict):
        items = dict(value)
    else:
        raise TypeError(f"moeblaze: {what}: give a string such as 'block_m=64,num_warps=4' or a dict of those keys")
    unknown = sorted(set(items) - set(KERNEL_CONFIG_KEYS))
    if unknown or not items:
        raise ValueError(f"moeblaze: {what}: unknown or no keys {unknown}; valid keys are {list(KERNEL_CONFIG_KEYS)}")
    ints = {}
    for key, v in items.items():
        try:
            ints[key] = int(v)
            if isinstance(v, (bool, float)):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"moeblaze: {what}: {key} must be an integer, got {v!r}") from None
    for key in _TILE_KEYS:
        if key in ints and (ints[key] < 16 or not _pow2(ints[key])):
            raise ValueError(f"moeblaze: {what}: {key} must be a power of two >= 16, got {ints[key]}")
    if ints.get("split_n", 1) not in (1, 2):
        raise ValueError(f"moeblaze: {what}: split_n must be 1 or 2, got {ints['split_n']}")
    for key in ("num_warps", "num_stages", "group_m"):
        if key in ints and ints[key] < 1:
            raise ValueError(f"moeblaze: {what}: {key} must be >= 1, got {ints[key]}")
    if "num_warps" in ints and not _pow2(ints["num_warps"]):
        raise ValueError(f"moeblaze: {what}: num_warps must be a power of two, got {ints['num_warps']}")
    return ",".join(f"{k}={ints[k]}" for k in KERNEL_CONFIG_KEYS if k in ints)


def _dispatch_config(value: Any) -> Optional[str]:
    """A pinned dispatch configuration in its canonical form ``"sort,4096,512,4"`` (path, pairs per program, pairs
    ranked at a time, warps), from that string or a tuple/list of the four; None stays None."""
    if value is None:
        return None
    what = f"kernels.dispatch_config={value!r}"
    parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else \
        list(value) if isinstance(value, (tuple, list)) else None
    try:
        path, chunk, block, warps = parts
        chunk, block, warps = int(chunk), int(block), int(warps)
    except (TypeError, ValueError):
        raise ValueError(f"moeblaze: {what}: expected 'path,chunk,block,num_warps', e.g. 'sort,4096,512,4'") from None
    if path not in DISPATCH_PATHS:
        raise ValueError(f"moeblaze: {what}: path must be one of {DISPATCH_PATHS}, got {path!r}")
    if not all(_pow2(v) for v in (chunk, block, warps)) or not 16 <= block <= chunk:
        raise ValueError(f"moeblaze: {what}: chunk, block and num_warps must be powers of two, with 16 <= block <= "
                         f"chunk")
    return f"{path},{chunk},{block},{warps}"


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the CUDA kernels run. Each field changes which kernels or configurations run, never what they compute
    (beyond floating-point rounding: of another tile shape, or of float32 products made another way)."""

    # The sm_90 (Hopper) Gluon kernels where they apply (16-bit operands, aligned row-block weights): the down
    # projection, the gathering up projection and dh GEMM (with dh's activation epilogue fused), the weight
    # gradients. Their results are bitwise those of the Triton kernels they replace. False: the portable Triton
    # kernels everywhere (the way around a problem in a Gluon kernel, and what the cuda tests compare against).
    gluon: bool = True
    # One launch configuration for every expert kernel instead of autotuning, e.g. "block_m=64,block_n=64,
    # block_k=32,num_warps=4,num_stages=2" (keys of kernels.autotune.KernelConfig; missing keys keep its defaults).
    # block_m is also the dispatch plan's tile height. For tests and for debugging a kernel at one configuration.
    kernel_config: Optional[str] = None
    # One configuration of the dispatch kernels, "path,chunk,block,num_warps" (e.g. "sort,4096,512,4"; path
    # "dense" ranks with a one-hot tile: slower, kept as the plain form of the sort to compare with). None: chosen
    # from the number of pairs and experts. For tests (several chunks at small sizes) and debugging.
    dispatch_config: Optional[str] = None
    # Replay an operator call from the record of an earlier call with the same signature (kernels.program): its
    # PyTorch operations and kernel launches again, with none of the orchestration's Python. False: the
    # orchestration decides every call again (the way around a problem in a replay, and what the cuda tests compare
    # against).
    replay: bool = True
    # How float32 operands are multiplied (a region that computes in float32: a Hugging Face model's grouped_mm
    # experts under torch.autocast over float32 weights). Triton's dot precisions, on the tensor cores: "bf16x6"
    # splits each operand into three bf16 parts and sums the six products of parts above float32's rounding;
    # "bf16x3" sums the three of the two leading parts. "ieee": float32 fused multiply-adds on the CUDA cores. "auto":
    # "bf16x3" where torch lets its own CUDA float32 matrix products run below float32 (TF32:
    # ``torch.set_float32_matmul_precision("high")``, ``torch.backends.cuda.matmul.fp32_precision = "tf32"``), else
    # "bf16x6". Relative error against float64 of an OLMoE layer's output and gradients (H200, 2026-12-01): bf16x6
    # 2.9-3.3e-7, ieee 1.3-1.5e-6, cuBLAS's float32 7.0-7.9e-7; bf16x3 7.8-8.0e-6, cuBLAS's TF32 5.1-5.3e-4, Triton's
    # TF32 2.3e-3. Forward + backward ms: 24.2, 65.7, 16.6 (Triton's TF32 20.0) (benchmarks/RESULTS.md).
    float32_products: str = "auto"

    def __post_init__(self) -> None:
        for name in ("gluon", "replay"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"moeblaze: kernel option {name!r} must be True or False, got {getattr(self, name)!r}")
        if self.float32_products not in FLOAT32_PRODUCTS:
            raise ValueError(f"moeblaze: kernel option 'float32_products' must be one of {FLOAT32_PRODUCTS}, got "
                             f"{self.float32_products!r}")
        object.__setattr__(self, "kernel_config", _kernel_config(self.kernel_config))
        object.__setattr__(self, "dispatch_config", _dispatch_config(self.dispatch_config))
        # made once: moe_ffn reads it at every call, and Dynamo traces that read (not dataclasses.fields)
        object.__setattr__(self, "_encoded", _encode(self))


_KERNEL_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))


def _kernel_options(value: Any, base: KernelOptions) -> KernelOptions:
    if isinstance(value, KernelOptions):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"moeblaze: option 'kernels' must be a dict of kernel options (or a KernelOptions), got "
                        f"{value!r}")
    unknown = sorted(set(value) - set(_KERNEL_FIELDS))
    if unknown:
        raise ValueError(f"moeblaze: unknown kernel option(s) {unknown}; valid kernel options are "
                         f"{list(_KERNEL_FIELDS)}")
    return dataclasses.replace(base, **value)


def encode_kernels(options: KernelOptions) -> str:
    """The canonical string of ``options`` that the operators take (``kernel_options``): the fields that differ
    from the defaults, ``name=value`` joined by ``;`` in field order; ``""`` for the defaults."""
    return options._encoded


def _encode(options: KernelOptions) -> str:
    items = []
    for f in dataclasses.fields(KernelOptions):
        value = getattr(options, f.name)
        if value != f.default:
            items.append(f"{f.name}={int(value) if isinstance(value, bool) else 'none' if value is None else value}")
    return ";".join(items)


@functools.lru_cache(maxsize=64)
def decode_kernels(encoded: str) -> KernelOptions:
    """The :class:`KernelOptions` of an operator's ``kernel_options`` string (:func:`encode_kernels`); cached."""
    if not isinstance(encoded, str):
        raise TypeError(f"moeblaze: kernel_options must be a string (config.encode_kernels), got {encoded!r}")
    values = _parse(encoded, "kernel_options", {f.name: f for f in dataclasses.fields(KernelOptions)})
    return KernelOptions(**values)


@dataclasses.dataclass(frozen=True)
class MoEBlazeConfig:
    # Memory policy of every rewritten region: "activations" saves x, the ids, the combine weights and
    # the gate/up pre-activations; "recompute" saves x, the ids and the weights and recomputes the up
    # projection in backward; "auto" picks "recompute" for a region whose pre-activations would
    # exceed `memory_budget` bytes, "activations" otherwise.
    checkpoint: str = "activations"
    # Bytes of pre-activations a region may save under checkpoint="auto".
    memory_budget: int = 1 << 30
    # Bytes of transient per-slot buffers the operator may hold at once: the Triton path runs windows of
    # the expert-sorted slots that fit, the PyTorch path chunks of tokens. 0: everything at once.
    transient_budget: int = 2 << 30
    # Prove each candidate numerically (forward and every gradient, small random inputs at compile
    # time) before rewriting it. Off: shapes and structure alone decide.
    verify: bool = True
    # Path of a JSON file the compile report is written to (appended per compiled graph), or None.
    report: Optional[str] = None
    # Hand the rewritten graph to Inductor (compile_fx). Off: run the rewritten FX graph eagerly.
    inductor: bool = True
    # Run the passes at all. Off: the backend is the default Inductor backend.
    enabled: bool = True
    # The kernels' options (KernelOptions), baked into each rewritten operator call.
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_CHOICES:
            raise ValueError(f"moeblaze: checkpoint must be one of {CHECKPOINT_CHOICES}, got {self.checkpoint!r}")
        for budget in ("memory_budget", "transient_budget"):
            value = getattr(self, budget)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"moeblaze: {budget} must be a non-negative number of bytes, got {value!r}")
        for flag in ("verify", "inductor", "enabled"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"moeblaze: option {flag!r} must be True or False, got {getattr(self, flag)!r}")
        if self.report is not None and not isinstance(self.report, str):
            raise TypeError(f"moeblaze: option 'report' must be a file path (str) or None, got {self.report!r}")
        if not isinstance(self.kernels, KernelOptions):
            raise TypeError(f"moeblaze: option 'kernels' must be a KernelOptions (or a dict of its fields given to "
                            f"torch.compile's options or moeblaze_fx.patch), got {self.kernels!r}")


_FIELDS = tuple(f.name for f in dataclasses.fields(MoEBlazeConfig))


def _value(text: str, f: dataclasses.Field, where: str) -> Any:
    """A field's value from its text in ``MOEBLAZE_OPTIONS`` or an encoded kernel_options."""
    text = text.strip()
    if f.default is None and text.lower() == "none":
        return None
    if isinstance(f.default, bool):
        if text.lower() not in ("1", "0", "true", "false"):
            raise ValueError(f"moeblaze: {where}: {f.name} must be 1, 0, true or false, got {text!r}")
        return text.lower() in ("1", "true")
    if isinstance(f.default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"moeblaze: {where}: {f.name} must be an integer, got {text!r}") from None
    return text


def _parse(spec: str, where: str, fields: dict[str, dataclasses.Field]) -> dict[str, Any]:
    values = {}
    for item in (s for s in spec.split(";") if s.strip()):
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ValueError(f"moeblaze: {where}={spec!r}: expected ';'-separated name=value items with names from "
                             f"{sorted(fields)}; got {item.strip()!r}")
        values[name] = _value(text, fields[name], where)
    return values


def parse_environment(spec: str) -> MoEBlazeConfig:
    """The defaults with ``MOEBLAZE_OPTIONS``'s value ``spec`` applied (see the module doc)."""
    fields = {f.name: f for f in dataclasses.fields(MoEBlazeConfig) if f.name != "kernels"}
    fields.update({f"kernels.{f.name}": f for f in dataclasses.fields(KernelOptions)})
    values = _parse(spec, ENV_VAR, fields)
    kernels = {k[len("kernels."):]: v for k, v in values.items() if k.startswith("kernels.")}
    backend = {k: v for k, v in values.items() if not k.startswith("kernels.")}
    return MoEBlazeConfig(**backend, kernels=KernelOptions(**kernels))


_current = parse_environment(os.environ.get(ENV_VAR, ""))


def current() -> MoEBlazeConfig:
    return _current


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, Triton's own variable): kernels run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def float32_matmul_precision(device_type: str) -> str:
    """What torch's own float32 matrix products on ``device_type`` may round to: "ieee" (float32, torch's default),
    "tf32" (CUDA; the CPU's oneDNN too) or "bf16" (oneDNN): ``torch.set_float32_matmul_precision``, or the backend's
    ``fp32_precision``. Read through the per-backend setting, which answers whichever of torch's two APIs set it
    (``torch.get_float32_matmul_precision()`` and ``torch.backends.cuda.matmul.allow_tf32`` raise once the newer one
    has been used)."""
    backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul
    precision = backend.fp32_precision
    return "ieee" if precision == "none" else precision


def float32_matmul_reduced(device_type: str) -> bool:
    """Whether torch's own float32 matrix products on ``device_type`` may run below float32 precision
    (:func:`float32_matmul_precision`)."""
    return float32_matmul_precision(device_type) != "ieee"


def from_options(options: Optional[dict[str, Any]]) -> MoEBlazeConfig:
    """The config in force, updated by ``torch.compile(..., options=...)``; unknown keys are an error. ``kernels``
    is a dict of kernel options, applied over those in force."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ValueError(f"moeblaze: unknown option(s) {unknown}; valid options are {list(_FIELDS)}")
    if "kernels" in options:
        options["kernels"] = _kernel_options(options["kernels"], _current.kernels)
    return dataclasses.replace(_current, **options)


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[MoEBlazeConfig]:
    """Change the defaults inside a ``with`` block: ``with moeblaze_fx.patch(verify=False): ...``,
    ``with moeblaze_fx.patch(kernels={"gluon": False}): ...``."""
    global _current
    saved = _current
    _current = from_options(changes)
    try:
        yield _current
    finally:
        _current = saved
