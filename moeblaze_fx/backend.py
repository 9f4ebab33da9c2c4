"""The ``moeblaze`` torch.compile backend.

``torch.compile(model, backend="moeblaze", options={...})`` runs the MoE passes on the Dynamo graph
(normalize -> find -> extract -> prove -> rewrite), emits the report, and hands the graph to
Inductor (``compile_fx``), so everything outside the MoE regions is compiled as by the default
backend. AOTAutograd takes each MoEBlaze operator's backward from its registered autograd formula.

A graph holding MoEBlaze operators compiles under a cache-key tag (:func:`cache_key_tag`): torch's AOTAutograd and
FX-graph caches key a graph by its code, which names the operators but not their schemas, autograd formulas or
fakes, so a cache entry made by another version of this package could replay a backward that calls
``moe_ffn_backward`` with another version's arguments.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import config as _config
from . import ops  # registers torch.ops.moeblaze.*
from .passes import run_passes
from torch._dynamo.utils import counters

from .report import discard_last, emit, last_report, write_json

__all__ = ["moeblaze_backend", "rewrite_graph", "cache_key_tag"]

# What the operators' fakes read while a graph is traced (ops.plan_block_m, ops._use_triton), beside the code.
_TRACE_ENV = ("MOEBLAZE_KERNEL_CONFIG", "TRITON_INTERPRET")


@functools.lru_cache(maxsize=None)
def source_fingerprint(root: str = str(pathlib.Path(__file__).parent)) -> str:
    """sha256 of every ``.py`` file under ``root`` (the package), with its relative path."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key_tag(gm: fx.GraphModule) -> Optional[str]:
    """The tag to compile ``gm`` under: None where it calls no MoEBlaze operator; else torch's own tag (the user's
    ``torch.compiler.config.cache_key_tag``) followed by this package's source fingerprint, whether the Triton
    kernels import, and the settings in ``_TRACE_ENV``."""
    if not any(n.op == "call_function" and getattr(n.target, "namespace", None) == "moeblaze"
               for n in gm.graph.nodes):
        return None
    env = ";".join(f"{k}={os.environ.get(k, '')}" for k in _TRACE_ENV)
    state = f"{source_fingerprint()};triton={ops._triton_kernels() is not None};{env}"
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


def moeblaze_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     options: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    cfg = _config.from_options(options)
    if not cfg.enabled:
        return compile_fx(gm, example_inputs) if cfg.inductor else gm.forward
    counted = dict(counters["moeblaze"])
    new_gm = rewrite_graph(gm, example_inputs, options)
    tag = cache_key_tag(new_gm) if cfg.inductor else None
    try:
        if tag is None:
            compiled = compile_fx(new_gm, example_inputs) if cfg.inductor else new_gm.forward
        else:  # the tag around AOTAutograd's key, and around each graph's compile (the backward's runs later)
            with torch.compiler.config.patch(cache_key_tag=tag):
                compiled = compile_fx(new_gm, example_inputs, inner_compile=_tagged(compile_fx_inner, tag))
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
