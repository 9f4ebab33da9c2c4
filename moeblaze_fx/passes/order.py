"""Where the compiled backward computes the experts' gate|up gradients (Inductor's post-grad graphs).

The split backward's third operator, ``moeblaze::moe_ffn_backward_dw`` (``ops.py``, docs/memory.md), needs
nothing that later nodes produce and nothing later needs it but the gradients it returns. Autograd records it right
after the layer's dx, so the compiled backward allocates the layer's gate|up gradient (``[E, 2h, d]``) there, and
it stays alive through every layer's backward below, attention's large buffers included. Inductor's
``reorder_for_peak_memory`` moves its own dW_gate|up later where its estimate says so, but it keeps the graph's
order when none of its heuristics estimates lower, as it did for gpt-oss (docs/memory.md).

:func:`sink_weight_gradients` moves each such call, with the views of its results, to just before the first node
that reads them (in a backward graph: its output), where that holds fewer bytes alive meanwhile: the gradients it
would allocate early against the operands it keeps alive longer (dA|dB ``[T*K, 2h]``, x, the ids, the routing
weights and the plan; the parameters are alive anyway). The backend installs it as Inductor's
``post_grad_custom_post_pass`` for graphs with MoEBlaze operators, unless the user has set one.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .find import example_value, size_hint

__all__ = ["sink_weight_gradients", "SinkWeightGradients"]

log = logging.getLogger("moeblaze_fx")


def _bytes(value: Any) -> int:
    """Bytes of a node's value (a tensor, or a list/tuple of them); a symbolic size at its hint (1M elements for a
    data-dependent one)."""
    if isinstance(value, torch.Tensor):
        return size_hint(value.numel(), unbacked=1 << 20) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.is_view))


def sink_weight_gradients(graph: fx.Graph) -> int:
    """Move each ``moe_ffn_backward_dw`` call that is worth moving (see the module docstring) to just before its
    results' first reader. Returns how many were moved."""
    target = torch.ops.moeblaze.moe_ffn_backward_dw.default
    moved = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is target]:
        members = {node: None}  # the call and the views of its results (allocating nothing), in discovery order
        frontier = [node]
        while frontier:
            frontier = list(dict.fromkeys(u for n in frontier for u in n.users if _is_view(u) and u not in members))
            members.update(dict.fromkeys(frontier))
        group = list(members)
        readers = {u for n in group for u in n.users if u not in members}
        if not readers:
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        first = min(readers, key=position.__getitem__)
        if position[first] == position[node] + len(group):
            continue  # already there
        args = dict(zip((a.name for a in target._schema.arguments), node.args)) | dict(node.kwargs)
        params = set(args.get("params") or ())
        kept = sum(_bytes(example_value(n)) for n in node.all_input_nodes if n not in params)
        allocated = _bytes(example_value(node))
        if allocated <= kept:
            continue
        if any(position[i] >= position[first] for n in group for i in n.all_input_nodes if i not in members):
            continue  # a view reading a node made later (none is known): moving would break the order
        for n in sorted(group, key=position.__getitem__):
            first.prepend(n)
        moved += 1
    if moved:
        graph.lint()
        log.debug("moeblaze: %d gate|up weight-gradient call(s) moved to their first reader", moved)
    return moved


class SinkWeightGradients(CustomGraphPass):
    """:func:`sink_weight_gradients` as Inductor's custom post-grad pass (its uuid keys Inductor's FX-graph cache)."""

    def __call__(self, graph: fx.Graph) -> None:
        sink_weight_gradients(graph)

    def uuid(self) -> Optional[Any]:
        from ..backend import source_fingerprint

        return "moeblaze-sink-weight-gradients-" + source_fingerprint()
