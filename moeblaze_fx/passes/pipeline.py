"""The pass pipeline: normalize -> find -> extract -> prove -> rewrite, one record per candidate."""
from __future__ import annotations

import collections
import logging
import math
import re
import traceback
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import guard_float

from ..config import MoEBlazeConfig, encode_kernels
from ..kernels.reference import plan_sizes
from ..ops import _use_triton as use_triton, default_chunk_tokens, plan_block_m
from ..report import RegionRecord
from .extract import extract, idiom
from .find import SUBGRAPH_OPS, example_value, find_candidates, size_hint, skipped_moe_block, subgraph_body
from .normalize import normalize, operator_name
from .prove import GROUPED_PROOF_ROWS, Proof, prove, traced_with_gradients
from .rewrite import rewrite
from .source import source_of

__all__ = ["run_passes", "saved_bytes_after", "format_graph"]

log = logging.getLogger("moeblaze_fx")
_REPORT_IT = "a bug of moeblaze_fx, not of the model: nothing in the model can change it; please report it"


def format_graph(gm: fx.GraphModule) -> str:
    """One line per node, parameters named by module path: the form golden tests compare."""
    names = {n: _display_name(n.name) if n.op == "placeholder" else n.name for n in gm.graph.nodes}

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch.dtype):
            return str(a)
        return repr(a)

    lines = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            lines.append(f"{names[n]} = input")
            continue
        if n.op == "output":
            lines.append(f"return {arg(n.args[0])}")
            continue
        if n.op == "call_method" and operator_name(n.target):  # `a == b` prints the same on torch 2.11 and 2.13
            target = f"operator.{operator_name(n.target)}"
        elif n.op == "call_method":
            target = f".{n.target}"
        elif n.op == "get_attr":
            target = f"self.{n.target}"
        else:
            target = _qualified_name(n.target)
        args = [arg(a) for a in n.args] + [f"{k}={arg(v)}" for k, v in n.kwargs.items()]
        lines.append(f"{names[n]} = {target}({', '.join(args)})")
    return "\n".join(lines)


def _qualified_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", getattr(target, "__name__", str(target)))
    if name.startswith("_VariableFunctionsClass."):  # torch.topk and friends
        name = name.split(".", 1)[1]
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch"):
        return f"torch.{name}" if not name.startswith("Tensor.") else name
    return f"{module}.{name}" if module else name


def _display_name(name: str) -> str:
    """Dynamo's flattened parameter names back to module paths:
    ``L_self_modules_experts_modules_0_modules_w1_parameters_weight_`` -> ``experts.0.w1.weight``."""
    name = re.sub(r"^[Ll]_\w+?_(?=(modules|parameters)_)", "_", name)
    parts = re.split(r"_(?:modules|parameters|buffers)_", name)
    return ".".join(p for p in parts if p).rstrip("_").replace("#", "*")


def _order_of(err: float) -> float:
    """The power of ten at or above ``err``: stable across machines, unlike the error itself."""
    return 10.0 ** math.ceil(math.log10(max(err, 1e-16)))


def saved_bytes_after(T: int, d: int, h: int, K: int, itemsize: int, ids_itemsize: int, weights_itemsize: int,
                      policy: str, gated: bool = True, E: int = 0, block_m: int | None = None) -> int:
    """What the operator saves for backward (the formula in report.py's docstring); ``block_m``: the row tile of
    the dispatch plan the operator's Triton path saves for E experts (None: the PyTorch path, which saves none)."""
    n_pairs = T * K
    total = T * d * itemsize + n_pairs * (ids_itemsize + weights_itemsize)
    if policy == "activations":
        total += n_pairs * (2 if gated else 1) * h * itemsize
    if block_m is not None:  # int32 offsets [E+1], token index and slot [T*K], two tile tables
        if E < 1:
            raise ValueError(f"saved_bytes_after: the plan's size needs the number of experts, got E = {E}")
        total += 4 * sum(plan_sizes(n_pairs, E, block_m))
    return total


def _policy(cfg: MoEBlazeConfig, T: int, K: int, h: int, itemsize: int) -> str:
    if cfg.checkpoint != "auto":
        return cfg.checkpoint
    return "recompute" if T * K * 2 * h * itemsize > cfg.memory_budget else "activations"


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over the same module (parameters are shared, not copied)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    work = fx.GraphModule(gm, graph)
    work.meta.update(getattr(gm, "meta", {}))
    work.compile_subgraph_reason = getattr(gm, "compile_subgraph_reason", None)
    return work


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any],
               cfg: MoEBlazeConfig) -> tuple[fx.GraphModule, list[RegionRecord]]:
    """Rewrite every proven MoE region. Returns the graph to compile (``gm`` itself when nothing was
    rewritten) and one record per candidate. Never raises: an internal error leaves ``gm`` as it was."""
    try:
        new_gm, records = _run(gm, example_inputs, cfg)
    except Exception as exc:  # the user's compile must go on with their graph unchanged
        log.warning("moeblaze: internal error, graph left unchanged: %s", exc)
        log.debug("%s", traceback.format_exc())
        new_gm, records = gm, [RegionRecord(status="skipped", source="<graph>", idiom="-",
                                            reason=f"internal error, graph left unchanged: {type(exc).__name__}: {exc}; "
                                                   f"{_REPORT_IT}")]
    for record in records:  # counted from what is returned, so a failed graph counts nothing rewritten
        counters["moeblaze"][record.status] += 1
    return new_gm, records


class _InsideSubgraph:
    """A body's ``compile_subgraph_reason``: it ends where its code does, not at a graph break."""
    graph_break = False
    user_stack = ()
    reason = ""


def _run(gm: fx.GraphModule, example_inputs: Sequence[Any],
         cfg: MoEBlazeConfig) -> tuple[fx.GraphModule, list[RegionRecord]]:
    work = _copy(gm)
    placeholders = [n for n in work.graph.nodes if n.op == "placeholder"]
    records, changed = _rewrite(work, dict(zip(placeholders, example_inputs)), cfg, where="")
    return (work if changed else gm), records


def _subgraph_calls(work: fx.GraphModule) -> list[tuple[fx.Node, str, str]]:
    """(call, body attribute, where) for each call of a subgraph op (``find.SUBGRAPH_OPS``): the passes run in its
    body too (torch.utils.checkpoint's function, as Hugging Face's gradient checkpointing calls it, reentrant or
    not). A body several calls share (Dynamo gives each call its own) would be rewritten for one call's operands,
    and is left alone."""
    calls = [(n, str(n.args[0].target), f"inside {SUBGRAPH_OPS[n.target.name()]}") for n in work.graph.nodes
             if subgraph_body(work, n) is not None]
    uses = collections.Counter(attr for _, attr, _ in calls)
    return [c for c in calls if uses[c[1]] == 1]


def _local_parameters(graph: fx.Graph, params: set[fx.Node], real: dict[fx.Node, Any],
                      name_of: dict[fx.Node, str]) -> None:
    """A DTensor parameter unwrapped in forward (``w.to_local()``, torchtitan's experts under TP/EP), or a flat
    ``[E*h, d]`` parameter viewed per expert, is an expert parameter in that form: the region reads the local tensor,
    the operator is given it, and its gradient reaches the DTensor through ``to_local``'s backward. (The DTensor itself cannot be run by the proof: its storage
    is not a plain tensor's.)"""
    for node in graph.nodes:
        if not (node.op == "call_method" and node.args and node.args[0] in params):
            continue
        param = node.args[0]
        # a flat [E*h, d] weight viewed per expert ([E, h, d]) is that expert weight too
        per_expert = node.target in ("view", "reshape", "unflatten") and example_value(param).dim() == 2 and \
            isinstance(example_value(node), torch.Tensor) and example_value(node).dim() == 3 and \
            not node.kwargs and not any(isinstance(a, fx.Node) for a in node.args[1:])
        if node.target == "to_local" or per_expert:
            params.add(node)
            name_of[node] = name_of[param]
            if param in real:
                real[node] = real[param].to_local() if node.target == "to_local" else \
                    getattr(real[param], str(node.target))(*node.args[1:])


def _rewrite(work: fx.GraphModule, real: dict[fx.Node, Any], cfg: MoEBlazeConfig, where: str,
             names: Optional[dict[fx.Node, str]] = None) -> tuple[list[RegionRecord], bool]:
    """Rewrite ``work`` (a copy: changed in place) and the bodies of its subgraph calls (copies put in its
    attributes). ``real``: the values of its placeholders that are known; ``names``: display names of its
    parameter placeholders (a body's, from its caller). Returns the records in graph order and whether anything
    changed."""
    normalize(work)
    name_of: dict[fx.Node, str] = {}
    params: set[fx.Node] = set()
    for node in work.graph.nodes:
        if node.op == "placeholder" and isinstance(real.get(node), torch.nn.Parameter):
            params.add(node)
            name_of[node] = (names or {}).get(node) or _display_name(str(node.target))
        elif node.op == "get_attr":
            try:
                value = work.get_parameter(str(node.target))
            except AttributeError:
                continue  # a buffer or constant, not an expert parameter
            if isinstance(value, torch.nn.Parameter):
                params.add(node)
                real[node] = value
                name_of[node] = str(node.target)
    _local_parameters(work.graph, params, real, name_of)

    order = {n: i for i, n in enumerate(work.graph.nodes)}
    keyed: list[tuple[int, RegionRecord]] = []
    changed = False
    for call, attr, inside in _subgraph_calls(work):
        body = _copy(getattr(work, attr))
        body.compile_subgraph_reason = _InsideSubgraph()
        inner = [n for n in body.graph.nodes if n.op == "placeholder"]
        operands = call.args[1:]
        if len(inner) != len(operands):
            log.debug("moeblaze: %s of %s: %d placeholders for %d operands, not looked into", attr, call.name,
                      len(inner), len(operands))
            continue
        pairs = [(p, a) for p, a in zip(inner, operands) if isinstance(a, fx.Node)]
        body_records, body_changed = _rewrite(body, {p: real[a] for p, a in pairs if a in real}, cfg, where=inside,
                                              names={p: name_of[a] for p, a in pairs if a in name_of})
        keyed += [(order[call], r) for r in body_records]
        if body_changed:
            setattr(work, attr, body)
            changed = True

    rewritten = 0
    quiet: set[int] = set()  # ids of the records of candidates reported only if rewritten (Candidate.quiet)
    candidates = find_candidates(work, params)
    if not candidates and not where and (skipped := skipped_moe_block(work)) is not None:
        keyed.append((0, RegionRecord(status="skipped", source=skipped[0], idiom="per-expert loop (run eagerly)",
                                      reason=skipped[1])))
    for cand in candidates:
        source = source_of(*([cand.output] if cand.output is not None else []), cand.topk)
        record = RegionRecord(status="skipped", source=source, idiom=idiom(cand) if cand.nodes else "-")
        if where:
            record.idiom = f"{record.idiom}, {where}"
        keyed.append((order[cand.topk], record))
        if cand.quiet:
            quiet.add(id(record))
        if cand.reason:
            record.reason = cand.reason
            continue
        try:  # analysis only: a failure here skips this candidate and leaves the graph as it is
            ext = extract(cand, params, name_of)
        except Exception as exc:
            ext = f"internal error while extracting: {type(exc).__name__}: {exc}; {_REPORT_IT}"
        if isinstance(ext, str):
            record.reason = ext
            continue
        record.T = ext.T if isinstance(ext.T, int) else str(ext.T)
        record.d, record.E, record.K, record.dtype = ext.d, ext.E, ext.K, str(ext.dtype).replace("torch.", "")
        record.h = ext.h if ext.h > 0 else None
        if cfg.verify:
            try:
                proof = prove(work, cand, ext, real)
            except Exception as exc:
                proof = Proof(None, reason=f"internal error while proving: {type(exc).__name__}: {exc}; {_REPORT_IT}")
            record.saved_bytes_before = proof.saved_bytes_before
            if proof.layout is None:
                record.reason = proof.reason
                continue
            layout, act, routing = proof.layout, proof.activation, proof.routing
            grads = max(proof.gradient_errors.values(), default=0.0)
            what = "forward (traced without gradients)" if proof.forward_only else "forward and gradients"
            record.check = (f"numerical: {what} within rel. error "
                            f"{_order_of(max(proof.forward_error, grads)):.0e} of the operator")
        else:
            layout, routing = ext.layouts[0], ext.routings[0]
            act = next(a for a in ext.activations if a.gated == (layout.up is not None))
            ext.h = int(layout.down.view(ext.roles[layout.down.role], 0).cols)
            record.check = "shapes only (verify=False)"
        record.h = ext.h
        described = routing.describe()
        record.layout = (f"{layout.describe(ext.role_names)}; {described + '; ' if described else ''}"
                         f"activation {act.spec}")
        itemsize = torch.empty((), dtype=ext.dtype).element_size()
        t_hint = size_hint(ext.T, unbacked=GROUPED_PROOF_ROWS)  # data-dependent rows: counted as the proof ran them
        # traced with no gradient to compute: nothing is saved for a backward, so the forward need not write A|B
        with_grad = traced_with_gradients(cand)
        policy = _policy(cfg, t_hint, ext.K, ext.h, itemsize) if with_grad else "recompute"
        chunk = default_chunk_tokens(ext.K, ext.d, ext.h, act.gated, itemsize, cfg.transient_budget)
        if ext.traced_floats:  # their values are baked into the operator: the compiled graph serves those only
            for node in ext.traced_floats:
                guard_float(example_value(node))
            record.check += "; the traced float inputs it reads taken at their values (the graph is guarded on them)"
        rewrite(work, cand, ext, layout, act.spec, policy, chunk, routing, encode_kernels(cfg.kernels))
        record.status, record.policy = "rewritten", policy
        x_val = example_value(ext.x)
        if with_grad:
            record.saved_bytes_after = saved_bytes_after(
                t_hint, ext.d, ext.h, ext.K, itemsize,
                *((example_value(ext.ids).element_size(), example_value(ext.weights).element_size())
                  if ext.weights is not None else (8, itemsize)),  # rows grouped by counts: int64 ids, unit weights
                policy, act.gated, ext.E,
                plan_block_m(x_val.device, cfg.kernels, ext.dtype) if use_triton(x_val.to(ext.dtype)) else None,
            ) + (t_hint * ext.d * itemsize if routing.on_input else 0)  # the weighted tokens the operator keeps
        else:  # neither graph saves anything (the proof's meter ran with gradients on)
            record.saved_bytes_before = record.saved_bytes_after = 0
        rewritten += 1
    if rewritten:
        work.graph.lint()
        work.recompile()
    keyed = [(o, r) for o, r in keyed if r.status == "rewritten" or id(r) not in quiet]
    return [r for _, r in sorted(keyed, key=lambda p: p[0])], changed or rewritten > 0


