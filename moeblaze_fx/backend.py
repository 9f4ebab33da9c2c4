"""The ``moeblaze`` torch.compile backend.

``torch.compile(model, backend="moeblaze", options={...})`` runs the MoE passes on the Dynamo graph
(normalize -> find -> extract -> prove -> rewrite), emits the report, and hands the graph to
Inductor (``compile_fx``), so everything outside the MoE regions is compiled as by the default
backend. AOTAutograd takes each MoEBlaze operator's backward from its registered autograd formula.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from . import config as _config
from . import ops  # noqa: F401  (registers torch.ops.moeblaze.*)
from .passes import run_passes
from torch._dynamo.utils import counters

from .report import discard_last, emit, last_report, write_json

__all__ = ["moeblaze_backend", "rewrite_graph"]


def rewrite_graph(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  options: Optional[dict[str, Any]] = None) -> fx.GraphModule:
    """Run the passes and the report on one Dynamo graph; return the graph to compile."""
    cfg = _config.from_options(options)
    if not cfg.enabled:
        return gm
    new_gm, records = run_passes(gm, example_inputs, cfg)
    emit(records)
    return new_gm


def moeblaze_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     options: Optional[dict[str, Any]] = None) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    cfg = _config.from_options(options)
    if not cfg.enabled:
        return compile_fx(gm, example_inputs) if cfg.inductor else gm.forward
    counted = dict(counters["moeblaze"])
    new_gm = rewrite_graph(gm, example_inputs, options)
    try:
        compiled = compile_fx(new_gm, example_inputs) if cfg.inductor else new_gm.forward
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
