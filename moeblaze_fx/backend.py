"""The ``moeblaze`` torch.compile backend.

``torch.compile(model, backend="moeblaze", options={...})`` runs the MoE passes on the Dynamo graph
(normalize -> find -> extract -> prove -> rewrite), emits the report, and hands the graph to
Inductor (``compile_fx``), so everything outside the MoE regions is compiled as by the default
backend. AOTAutograd takes each MoEBlaze operator's backward from its registered autograd formula.
``torch.compile``'s ``mode`` ("reduce-overhead", "max-autotune", ...) is Inductor's: its settings
(``torch._inductor.list_mode_options``) are applied to that compile, as with the default backend.

A graph holding MoEBlaze operators compiles under a cache-key tag (:func:`cache_key_tag`): torch's AOTAutograd and
FX-graph caches key a graph by its code, which names the operators but not their schemas, autograd formulas or
fakes, so a cache entry made by another version of this package could replay a backward that calls
``moe_ffn_backward`` with another version's arguments.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import pathlib
import uuid
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import config as _config
from . import ops  # registers torch.ops.moeblaze.*
from .passes import run_passes
from torch._dynamo.utils import counters

from .report import discard_last, emit, last_report, write_json

__all__ = ["moeblaze_backend", "rewrite_graph", "cache_key_tag"]

# What the operators' fakes read while a graph is traced beside the code and the graph's own arguments (the kernel
# options are an argument of each call, so a graph's code already holds them): whether Triton interprets (the
# dispatch and the kernels then run on the CPU).
_TRACE_STATE = {"TRITON_INTERPRET": _config.interpreting}
log = logging.getLogger("moeblaze_fx")


@functools.lru_cache(maxsize=None)
def source_fingerprint(root: str = str(pathlib.Path(__file__).parent)) -> str:
    """sha256 of every ``.py`` file under ``root`` (the package), with its relative path. Where no source file can
    be read (a zipped or compiled-only install), a random value, so that no cache entry made elsewhere matches."""
    digest, found = hashlib.sha256(), False
    try:
        for path in sorted(pathlib.Path(root).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
            found = True
    except OSError as exc:
        log.warning("moeblaze: cannot read the package's source (%s)", exc)
        found = False
    if not found:
        log.warning("moeblaze: no source of the package under %s: graphs with MoEBlaze operators are not shared "
                    "through torch's compile caches across processes", root)
        return uuid.uuid4().hex
    return digest.hexdigest()


source_fingerprint()  # at `import moeblaze_fx`: the code this process runs, not what is on disk at its first compile


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):  # a direct call, as Dynamo records it
        return target._qualified_op_name
    return ""


def cache_key_tag(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> Optional[str]:
    """The tag to compile ``gm`` under: None where neither it nor a subgraph calls a MoEBlaze operator; else torch's
    own tag (the user's ``torch.compiler.config.cache_key_tag``) followed by a hash of this package's source, the
    state in ``_TRACE_STATE`` and, for a graph with CUDA inputs, whether the Triton kernels import. The options
    (``MOEBLAZE_OPTIONS`` included) need no place here: those that change a graph's operators are in its code."""
    if not any(n.op == "call_function" and _op_name(n.target).startswith("moeblaze::")
               for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes):
        return None
    env = ";".join(f"{k}={int(read())}" for k, read in _TRACE_STATE.items())
    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    triton = ops._triton_kernels() is not None if cuda else "-"  # the CPU path never imports them
    state = f"{source_fingerprint()};triton={triton};{env}"
    ours = "moeblaze-" + hashlib.sha256(state.encode()).hexdigest()[:16]
    user = torch.compiler.config.cache_key_tag
    return f"{user}+{ours}" if user else ours


def rewrite_graph(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  options: Optional[dict[str, Any]] = None) -> fx.GraphModule:
    """Run the passes and the report on one Dynamo graph; return the graph to compile."""
    cfg = _config.from_options(options)
    if not cfg.enabled:
        return gm
    new_gm, records = run_passes(gm, example_inputs, cfg)
    emit(records)
    return new_gm


def _tagged(inner_compile: Callable[..., Any], tag: str) -> Callable[..., Any]:
    @functools.wraps(inner_compile)
    def compile_tagged(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.config.patch(cache_key_tag=tag):
            return inner_compile(*args, **kwargs)
    return compile_tagged


def mode_patches(mode: Optional[str], inductor: bool = True) -> dict[str, Any]:
    """The Inductor settings of ``torch.compile``'s ``mode`` (torch passes a mode other than "default" on to a
    backend named by string); a clear error for an unknown mode, or for one with ``inductor=False``."""
    if mode is None or mode == "default":
        return {}
    if not isinstance(mode, str):
        raise TypeError(f"moeblaze: mode must be a string such as 'reduce-overhead', got {mode!r}")
    from torch._inductor import list_mode_options

    patches = list_mode_options(mode)  # raises for an unknown mode, naming the known ones
    if not inductor:
        raise ValueError(f"moeblaze: mode={mode!r} sets Inductor options ({patches}), but inductor=False runs the "
                         f"graph without Inductor: drop the mode or moeblaze_fx.patch(inductor=False)")
    return patches


def _order_patches() -> dict[str, Any]:
    """Inductor settings for a graph with MoEBlaze operators: the post-grad pass that places the backward's gate|up
    gradients (``passes/order.py``), unless the user has a post-grad pass of their own there."""
    from torch._inductor import config as inductor_config

    if inductor_config.post_grad_custom_post_pass is not None:
        log.info("moeblaze: torch._inductor.config.post_grad_custom_post_pass is set: the backward's gate|up "
                 "gradients stay where autograd and Inductor put them (docs/memory.md)")
        return {}
    from .passes.order import SinkWeightGradients

    return {"post_grad_custom_post_pass": SinkWeightGradients()}


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], inductor: bool,
             patches: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if not inductor:
        if any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
               for n in gm.graph.nodes):
            # a subgraph call (torch.utils.checkpoint's) run as plain FX does not recompute its body as checkpoint
            # would (random ops draw other values in backward): through AOTAutograd, with no compiler
            from torch._dynamo.backends.registry import lookup_backend

            tag = cache_key_tag(gm, example_inputs)
            with torch.compiler.config.patch(cache_key_tag=tag) if tag else contextlib.nullcontext():
                return lookup_backend("aot_eager")(gm, example_inputs)
        return gm.forward
    tag = cache_key_tag(gm, example_inputs)
    if tag is None:
        return compile_fx(gm, example_inputs, config_patches=patches or None)
    patches = {**_order_patches(), **(patches or {})} or None
    # the tag around AOTAutograd's key, and around each graph's compile: the backward's runs at its first call, on
    # autograd's thread (config patches are per thread)
    with torch.compiler.config.patch(cache_key_tag=tag):
        return compile_fx(gm, example_inputs, inner_compile=_tagged(compile_fx_inner, tag), config_patches=patches)


def moeblaze_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     options: Optional[dict[str, Any]] = None, mode: Optional[str] = None) -> Callable[..., Any]:
    cfg = _config.from_options(options)
    patches = mode_patches(mode, cfg.inductor)
    if not cfg.enabled:
        return _compile(gm, example_inputs, cfg.inductor, patches)
    counted = dict(counters["moeblaze"])
    new_gm = rewrite_graph(gm, example_inputs, options)
    try:
        compiled = _compile(new_gm, example_inputs, cfg.inductor, patches)
    except BaseException:
        # Dynamo will trace this frame again (Inductor's "restart analysis") or give up on it: this
        # attempt's records and counts are not the graph that runs.
        counters["moeblaze"].clear()
        counters["moeblaze"].update(counted)
        discard_last()
        raise
    if cfg.report:
        write_json(last_report(), cfg.report)
    return compiled
