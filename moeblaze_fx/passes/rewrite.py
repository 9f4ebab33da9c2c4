"""Step 5: replace a proven region by one ``torch.ops.moeblaze.moe_ffn`` call.

Inserted before the region's output: reshapes of x/ids/weights to 2-D (and the proven routing's function of the
weights, or their product with the tokens: ``extract.Routing``), the operator (reading the
expert parameters in place: the layout ints say where each role lives, no stack or copy even for
``ModuleList`` experts), ``getitem 0``, and a reshape/cast back to the output's shape and dtype. Readers of the old output read the new one; the region's nodes and the runtime asserts
that guarded its data-dependent sizes are erased. Every inserted node gets ``example_value`` from
the fake tensors and the old output's stack trace.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .extract import OUTPUT_WEIGHTED, Extraction, Layout, Routing, ids_from_counts, unit_weights
from .find import Candidate, example_value

__all__ = ["rewrite"]


def _as_2d(node: fx.Node, cols: int, call) -> fx.Node:
    val = example_value(node)
    if val.dim() == 2 and val.shape[1] == cols:
        return node
    return call(torch.reshape, node, (-1, cols))


def rewrite(gm: fx.GraphModule, cand: Candidate, ext: Extraction, layout: Layout, activation: str,
            checkpoint: str, chunk_tokens: int, routing: Routing = OUTPUT_WEIGHTED,
            kernel_options: str = "") -> fx.Node:
    graph = gm.graph
    y = cand.output
    y_val = example_value(y)
    x_val = example_value(ext.x)
    fake_mode = example_value(ext.ids).fake_mode
    trace = y.meta.get("stack_trace")

    def call(fn, *args):
        """A node calling ``fn``, or the Tensor method named ``fn`` as Dynamo records methods (a method
        descriptor as a call_function target makes AOTAutograd's cache bypass the graph)."""
        method = isinstance(fn, str)
        node = graph.call_method(fn, tuple(args)) if method else graph.call_function(fn, tuple(args))
        vals = [[example_value(a) for a in arg] if isinstance(arg, list) else example_value(arg) for arg in args]
        # the innermost no-op hooks keep a caller's saved_tensors_hooks away from fake tensors
        with fake_mode, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            node.meta["example_value"] = getattr(vals[0], fn)(*vals[1:]) if method else fn(*vals)
        if trace:
            node.meta["stack_trace"] = trace
        node.meta["moeblaze_role"] = "moeblaze"
        return node

    with graph.inserting_before(y):
        x2d = _as_2d(ext.x, ext.d, call)
        if x_val.dtype != ext.dtype:  # the casts the region made (autocast's at dispatch, or written in forward)
            x2d = call("to", x2d, ext.dtype)
        if ext.weights is None:  # rows grouped by counts: each row's expert from the counts, unweighted
            ids2d, w2d = call(ids_from_counts, ext.ids, x2d, ext.E), call(unit_weights, x2d)
        else:
            ids2d, w2d = _as_2d(ext.ids, ext.K, call), _as_2d(ext.weights, ext.K, call)
        if routing.fn == "sigmoid":  # as Routing.apply
            w2d = call("to", call(torch.sigmoid, call("float", w2d)), example_value(w2d).dtype)
        if routing.on_input:
            x2d, w2d = call(operator.mul, x2d, w2d), call(torch.ones_like, w2d)
        params, layout_ints = layout.operator_args(ext.roles)
        # a cast keeps a dense parameter's strides (preserve_format), so the layout ints still hold; its backward
        # returns the gradient in the parameter's own dtype
        params = [p if example_value(p).dtype == ext.dtype else call("to", p, ext.dtype) for p in params]
        # kernel_options (config.encode_kernels): given where not the defaults ("")
        op = call(torch.ops.moeblaze.moe_ffn.default, x2d, ids2d, w2d, params, layout_ints, activation, checkpoint,
                  chunk_tokens, *((kernel_options,) if kernel_options else ()))
        out = call(operator.getitem, op, 0)
        if tuple(y_val.shape) != tuple(example_value(out).shape):
            out = call("view_as", out, ext.x) if tuple(y_val.shape) == tuple(x_val.shape) else \
                call(torch.reshape, out, tuple(y_val.shape))
        if y_val.dtype != ext.dtype:
            out = call("to", out, y_val.dtype)
    y.replace_all_uses_with(out)
    for node in reversed(cand.asserts):
        if not node.users:
            graph.erase_node(node)
    for node in reversed(cand.nodes):
        if not node.users:
            graph.erase_node(node)
    return op
