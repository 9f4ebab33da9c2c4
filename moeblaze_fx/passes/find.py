"""Step 2: find candidate expert regions.

A candidate starts at a ``topk`` whose indices (the expert ids) feed a dispatch, or at ids made of top-1 picks side by
side, which the normalizer gives the same role (PhiMoE's sparsemixer: no top-k, one maximum for each expert). Its
region is the expert computation, bounded by meaning rather than by spelling:

* its **output** is the immediate post-dominator of the ids: the first node that every path from the
  ids to the graph's output passes through. However the experts are spelled (a sort and grouped
  products, an unrolled per-expert loop of ``index_add``, a gather and batched products), the routes
  from the ids fan out and meet again exactly where expert outputs are combined.
  Where the router's weights are computed from the ids and also feed something beside the routed experts (Inkling
  normalizes the gathered routed logits together with the shared experts', whose gammas then depend on the ids),
  the routes through that weight computation are left out: the output is where the routes to the experts meet;
* its **body** is every node on a path from the ids to that output;
* its **support** is pulled in: nodes that read only parameters or constants (a transpose of an
  expert weight, an ``arange``) and shape-only factories (``zeros_like(x)``).

Runtime assertions (``_assert_scalar`` on data-dependent sizes) are not data: they are ignored when
post-dominators are computed and are removed with the region they guard.

A top-k whose region holds another top-k (the group top-k of group-limited routing, which masks what the experts'
top-k picks) or attention (a sparse-attention indexer) selects no experts and is dropped. One whose ids only feed a
``scatter`` into a dense map (Llama 4's router scores, but also top-k pooling) is ``quiet``: reported only if it is
rewritten.

Rows already grouped by expert, with counts (expert parallelism's local experts, between the token all-to-all and
the all-to-all back; torchtitan's experts compiled on their own), have no top-k in their graph: a grouped product
whose offsets come from counts a collective returned, or from a graph input, anchors a candidate at those counts
(:func:`_count_grouped_candidates`), bounded the same way; the operator then runs with K = 1, unit weights and ids
from the counts.

Two kinds of candidate are reported instead of analysed further:

* a block that **Dynamo split**: the graph ended at a graph break after the routing, with the ids or
  values computed from them among its outputs. The record names the break's file:line and, from
  Dynamo's graph-break type, what to change (``_BREAK_ADVICE``);
* **capacity routing** (Switch, GShard): a token's slot in its expert, a running count over the
  one-hot ids, is compared with a scalar capacity, and tokens past it are dropped. ``moe_ffn``
  computes every routed token: a different function, even where the proof's random routing happens
  not to overflow any expert, so it is recognised by structure, not by numbers.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, MutableMapping
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from .normalize import ROLE_OF, canonical_name, example_value, role, shares_storage
from .source import is_plumbing, short_path, source_of

__all__ = ["Candidate", "find_candidates", "assert_only_nodes", "SHAPE_ONLY_NAMES", "SUBGRAPH_OPS", "subgraph_body",
           "example_value", "size_hint", "skipped_moe_block", "EXPERT_PARALLEL"]

# Ops that read only the shape/dtype/device of their tensor inputs.
SHAPE_ONLY_NAMES = frozenset(
    {"zeros_like", "empty_like", "ones_like", "full_like", "new_zeros", "new_empty", "new_ones", "new_full",
     "sym_size", "size", "dim", "numel"}
)
_RANDOM_NAMES = frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
                           "multinomial", "dropout", "normal", "uniform_"})


@dataclasses.dataclass
class Candidate:
    topk: fx.Node
    ids: Optional[fx.Node]  # the expert-id tensor (topk's indices)
    output: Optional[fx.Node] = None  # the combined expert outputs
    nodes: list[fx.Node] = dataclasses.field(default_factory=list)  # body + support, graph order
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)  # external inputs, graph order
    asserts: list[fx.Node] = dataclasses.field(default_factory=list)  # runtime asserts guarding the body
    reason: Optional[str] = None  # why it cannot be a region, when it cannot
    # the ids only feed a scatter into a dense map (Llama 4's router scores, but also top-k pooling or a sparse mask):
    # an MoE only if it is proven one, and not reported otherwise
    quiet: bool = False
    # rows grouped by expert with per-expert counts (expert parallelism's local experts, after the token all-to-all):
    # ``topk`` and ``ids`` are then the counts [G*E] (G groups of the E experts, each row's group by offsets), the
    # region reads no ids or combine weights (K = 1, unit weights), see :func:`_count_grouped_candidates`
    counts_grouped: bool = False


_IN_PLACE_OPERATORS = frozenset(
    {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
     "irshift"})


def _updated(node: fx.Node) -> list[fx.Node]:
    """The tensors a node updates in place, left after normalize (which makes updates of tensors private to the
    graph functional): ``x.add_(y)``, ``x[i] = v``, ``x += y``, ``out=x``, ``torch._foreach_mul_([x], c)``, an
    operator whose schema writes an argument (``aten.mul_``, a custom op's ``mutates_args``). Not
    ``operator.and_`` (``a & b``)."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = [v for k, v in node.kwargs.items() if k == "out"]
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", target)
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema.arguments
        args = list(node.args) + [node.kwargs.get(a.name) for a in schema[len(node.args):]]
        written += [v for a, v in zip(schema, args) if a.alias_info is not None and a.alias_info.is_write]
    elif node.args:
        name = canonical_name(node)
        if name in _IN_PLACE_OPERATORS or name == "setitem" or (name.endswith("_") and not hasattr(operator, name)):
            written.append(node.args[0])  # a list for _foreach_*_
    flat = [n for v in written for n in (v if isinstance(v, (list, tuple)) else [v])]
    # a number (``n += 1`` on a size) is no update; a node without a recorded value may be a tensor
    return [n for n in flat if isinstance(n, fx.Node) and isinstance(example_value(n), (torch.Tensor, type(None)))]


def _update_of_read(body: set[fx.Node], ids: fx.Node, out: fx.Node, asserts: set[fx.Node],
                    order: dict[fx.Node, int]) -> Optional[fx.Node]:
    """The first in-place update, from the region's first node to its output, that the operator (run at the output,
    reading its inputs then) would not see as the region saw it: one inside the region, or of a tensor sharing
    storage with one the region reads (a token, a weight, a view of them). An update of a tensor the region never
    reads (a step counter, a routing statistic) is not one."""
    read = [example_value(n) for n in body | {i for n in body for i in n.all_input_nodes}]
    read = [v for v in read if isinstance(v, torch.Tensor)]
    first = min(body | {ids}, key=order.__getitem__)
    for node in _between(first.prev, out):
        if node in asserts:
            continue
        for target in _updated(node):
            value = example_value(target)
            if node in body or value is None or any(shares_storage(value, v) for v in read):
                return node
    return None


def _dead(node: fx.Node) -> bool:
    """An unused node without side effects (a mask a loop computed and did not use)."""
    if node.users or node.op not in ("call_function", "call_method"):
        return False
    return not (_updated(node) or node.is_impure())


def assert_only_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that carry no data to the output: asserts, unused pure nodes, and nodes whose every
    user is one of those (``sym_size -> ge -> _assert_scalar``)."""
    only: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output":
            continue
        if role(node) == "assert" or _dead(node) or (node.users and all(u in only for u in node.users)):
            only.add(node)
    return only


def _post_dominators(graph: fx.Graph, ignore: set[fx.Node]) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    ipdom: dict[fx.Node, fx.Node] = {nodes[-1]: nodes[-1]}  # the output node
    _fill_post_dominators(reversed(nodes[:-1]), ipdom, order, nodes[-1], ignore)
    return ipdom, order


def _fill_post_dominators(nodes: Iterable[fx.Node], ipdom: MutableMapping[fx.Node, fx.Node], order: dict[fx.Node, int],
                          exit_node: fx.Node, ignore: set[fx.Node], quiet: frozenset[fx.Node] = frozenset()) -> None:
    """``ipdom`` of ``nodes``, given in reverse graph order after every later node's: the nearest node every
    path to the output passes through, over the users, leaving out the users in ``ignore`` and the edges from
    ``quiet`` nodes to the output."""
    def meet(a: fx.Node, b: fx.Node) -> fx.Node:
        while a is not b:
            while order[a] < order[b]:
                a = ipdom[a]
            while order[b] < order[a]:
                b = ipdom[b]
        return a

    for node in nodes:
        succ = [u for u in node.users if u not in ignore and not (u is exit_node and node in quiet)]
        if not succ:
            ipdom[node] = exit_node
            continue
        cur = succ[0]
        for s in succ[1:]:
            cur = meet(cur, s)
        ipdom[node] = cur


def _side_uses(ids: fx.Node, exit_node: fx.Node, asserts: set[fx.Node]
               ) -> tuple[set[fx.Node], frozenset[fx.Node], list[fx.Node]]:
    """The routing's uses beside the expert computation: ``side``, the nodes computed from the ids that neither
    read an expert output nor lead to a node that does (a load-balancing loss from ``one_hot(ids)``, returned);
    ``quiet``, the nodes computed from the ids and from no expert output, whose edges to the graph's output (the
    ids returned) are side uses too; and the nodes after ``ids``, the output node left out. Indices the combine
    reads (an unsort permutation) lead to an expert output's node and are not side uses: set aside, they would
    let the search stop before the combine (at the sorted expert outputs, when K = 1)."""
    span = list(_between(ids, exit_node))[:-1]
    computed = _computed_from(ids, exit_node, asserts) - {exit_node}
    after = {n for n in computed if role(n) in ("grouped_mm", "matmul")}
    for node in span:
        if node not in after and any(i in after for i in node.all_input_nodes):
            after.add(node)
    leads = _reach(after, _inputs, computed)  # computed from the ids, and an expert output's node from them
    return computed - leads - after - {ids}, frozenset(computed - after), span


def _ids_of(topk: fx.Node) -> Optional[fx.Node]:
    if canonical_name(topk) != "topk":  # top-1 picks side by side (the normalizer's): the node is the ids
        return topk
    for user in topk.users:
        if canonical_name(user) == "getitem" and user.args[1] == 1:
            return user
        if user.op == "call_function" and canonical_name(user) == "getattr" and user.args[1] == "indices":
            return user
    return None


def _is_static(node: fx.Node, static: set[fx.Node], params: set[fx.Node]) -> bool:
    """A node whose value depends only on parameters, constants and sizes (``arange(s0 * 2)``)."""
    if node in params or node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method") or canonical_name(node) in _RANDOM_NAMES:
        return False
    return all(i in static or i in params or i.op == "get_attr" or _is_size(i) for i in node.all_input_nodes)


def _is_size(node: fx.Node) -> bool:
    return isinstance(example_value(node), (int, torch.SymInt))


def find_candidates(gm: fx.GraphModule, params: set[fx.Node]) -> list[Candidate]:
    """Candidates in graph order. ``params`` are the graph's parameter placeholders."""
    graph = gm.graph
    compiled_because = _compile_reason(gm)  # None outside Dynamo
    may_be_split = compiled_because is None or compiled_because.graph_break
    asserts = assert_only_nodes(graph)
    ipdom, order = _post_dominators(graph, asserts)
    exit_node = next(iter(reversed(graph.nodes)))  # torch 2.11: reversed() gives no iterator
    last_product = max((order[n] for n in graph.nodes if role(n) in ("grouped_mm", "matmul")), default=-1)
    static: set[fx.Node] = set()
    for node in graph.nodes:
        if _is_static(node, static, params):
            static.add(node)

    candidates = []
    dispatched: list[tuple[Candidate, set[fx.Node]]] = []  # top-k regions left alone for collectives, bodies
    for topk in graph.nodes:
        if role(topk) != "topk":
            continue
        ids = _ids_of(topk)
        if ids is not None and may_be_split and _leaves_graph(ids):
            candidates.append(Candidate(topk=topk, ids=ids, reason=_split_reason(compiled_because)))
            continue
        if ids is None or not any(role(u) == "dispatch" or canonical_name(u) in ("reshape", "view", "flatten", "to")
                                  for u in ids.users):
            inside = _routed_in_subgraph(gm, ids) if ids is not None else None
            if inside is not None:  # the experts run in a subgraph: reported, not rewritten
                candidates.append(Candidate(topk=topk, ids=ids, reason=(
                    f"the ids go into {inside}, where they are routed to the experts: the routing and the experts "
                    "must be in one graph to be rewritten. Checkpoint the router with the experts, or take the "
                    "experts out of the checkpoint and use options={'checkpoint': 'recompute'}")))
            continue  # top-k whose indices are not routed here
        at_break = compiled_because is not None and compiled_because.graph_break and _leaves_graph(ids, True)
        if not at_break and order[topk] > last_product:
            continue  # no matrix product follows, here or after a break (a load-balancing loss's top-k): not an MoE
        cand = Candidate(topk=topk, ids=ids, quiet=all(canonical_name(u) == "scatter" for u in ids.users))
        candidates.append(cand)
        out, body = _combine_point(graph, ids, ipdom, order, asserts, static)
        if out is None:
            # the ids may also be used beside the experts (an auxiliary loss, the ids returned), on a path to the
            # output that meets no expert output: look again without those uses. (With a meeting point found, no
            # such path exists.) Only the post-dominators from the ids on can change.
            side, quiet, span = _side_uses(ids, exit_node, asserts)
            if side or any(n in quiet for n in exit_node.all_input_nodes):
                ids_ipdom = collections.ChainMap({}, ipdom)
                _fill_post_dominators(reversed([ids] + span), ids_ipdom, order, exit_node, asserts | side, quiet)
                out, body = _combine_point(graph, ids, ids_ipdom, order, asserts, static)
        rerouted = out is not None and len(_weight_members(body, ids)[1]) > 1 and _routes_meet(
            graph, ids, ipdom, order, asserts, exit_node, static)
        if rerouted:
            # the router's weights, computed from the ids, feed more than the experts (shared experts' gammas
            # normalized with the routed weights, Inkling's): the expert routes alone meet earlier
            out, body = rerouted
        if out is None and at_break:
            cand.reason = _split_reason(compiled_because)  # values routed by the ids leave the graph at a break
            continue
        if out is None:
            cand.reason = ("the expert outputs never meet in one [T, d] tensor before the graph's output (a value "
                           "computed from the ids joins them on another path, or an in-place update could not be "
                           "made functional). Use values computed from the ids beside the experts only where they do "
                           "not join the expert outputs (an auxiliary loss, the ids returned); otherwise nothing can "
                           "be changed")
            continue
        if any(role(n) == "attention" for n in body):
            candidates.remove(cand)  # a sparse-attention indexer's top-k (DeepSeek-V3.2): it selects keys, no experts
            continue
        if any(role(n) == "topk" for n in body):
            candidates.remove(cand)  # group-limited routing's top-k of groups: it masks what the experts' top-k picks
            continue
        cand.output = out
        if collectives := _collectives(body):  # judged by structure: the proof would run them, on this rank only
            cand.reason = _collective_reason(collectives)
            dispatched.append((cand, body))
            continue
        capacity = _capacity_bound(body)
        if capacity is not None:
            cand.reason = _capacity_reason(*capacity)
            continue
        # the weights out before the support comes in too: a parameter-only producer the weights read (Gemma 4's
        # per_expert_scale cast to bf16 in forward, then indexed by the ids) would otherwise be pulled in and hide
        # them from _weight_members
        _push_out_weights(body, ids)
        _pull_in_support(body, ids, params, static, num_tokens=_num_tokens(ids), d=example_value(out).shape[-1])
        _push_out_weights(body, ids)
        if collectives := _collectives(body):  # pulled in with the support
            cand.reason = _collective_reason(collectives)
            continue
        mutation = _update_of_read(body, ids, out, asserts, order)
        if mutation is not None:
            cand.reason = (f"an in-place update ({canonical_name(mutation)}, node {mutation.name}) of a tensor the "
                           "region reads runs between the routing and the combine; the operator, which runs at the "
                           "combine, would read it after the update. Make that update out of place (`x = x.add(y)` "
                           "for `x.add_(y)`) or move it after the combine")
            continue
        cand.nodes = sorted(body, key=order.__getitem__)
        external = {i for n in body for i in n.all_input_nodes if i not in body}
        cand.inputs = sorted(external, key=order.__getitem__)
        cand.asserts = sorted(
            (a for a in asserts if any(i in body for i in a.all_input_nodes)), key=order.__getitem__
        )
        # close the assert set over assert-only chains (sym_size -> ge -> _assert_scalar)
        cand.asserts = sorted(set(cand.asserts) | _reach(cand.asserts, _users, asserts), key=order.__getitem__)
    candidates += _count_grouped_candidates(graph, candidates, dispatched, params, static, asserts, order)
    return sorted(candidates, key=lambda c: order[c.topk])


_CASTS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16"})


def _offsets_of(node: fx.Node) -> Optional[fx.Node]:
    """The group offsets a grouped product reads (``torch._grouped_mm(a, b, offs=...)``), or None."""
    if role(node) != "grouped_mm":
        return None
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    return offs if isinstance(offs, fx.Node) else None


def _count_like(node: fx.Node) -> bool:
    """A tensor that can hold counts: integers, or a 1-D float that needs no gradient (``torch.histc``'s)."""
    val = example_value(node)
    return isinstance(val, torch.Tensor) and (not val.is_floating_point() or (val.dim() == 1 and not val.requires_grad))


def _counts_root(offs: fx.Node) -> Optional[fx.Node]:
    """The counts the offsets are computed from, when they come from outside the expert computation: the one
    count-like tensor behind ``offs`` (through count-like tensors) that a collective returned (the counts all-to-all
    of expert parallelism) or that is an input of the graph (the experts compiled on their own, as torchtitan
    compiles them). None when the offsets come from the ids of a top-k in this graph (a top-k candidate's)."""
    roots, stack, seen = set(), [offs], {offs}
    while stack:
        node = stack.pop()
        counts = [i for i in node.all_input_nodes if _count_like(i) and canonical_name(i) not in SHAPE_ONLY_NAMES]
        if role(node) == "collective" or node.op == "placeholder" or not counts:
            roots.add(node)
            continue
        for i in counts:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    if len(roots) != 1:
        return None
    root = roots.pop()
    val = example_value(root)  # one count per group: ids [T, K] that a graph break made an input are no counts
    if not (isinstance(val, torch.Tensor) and val.dim() == 1):
        return None
    return root if role(root) == "collective" or root.op == "placeholder" else None


def _is_sizes(val) -> bool:
    scalar = (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)
    return isinstance(val, scalar + (torch.Size,)) or (
        isinstance(val, (list, tuple)) and len(val) > 0 and all(isinstance(v, scalar) for v in val))


def _sizes_only(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that compute sizes (``counts.tolist()`` of split sizes, ``x.size()``), and those whose every user is
    one: their data reaches the region as a size, which the proof and the operator take from the tensors they
    read, not as data."""
    only: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("call_function", "call_method") and (
                _is_sizes(example_value(node)) or (node.users and all(u in only for u in node.users))):
            only.add(node)
    return only


def _count_grouped_candidates(graph: fx.Graph, found: list[Candidate], dispatched: list[tuple[Candidate, set[fx.Node]]],
                              params: set[fx.Node], static: set[fx.Node], asserts: set[fx.Node],
                              order: dict[fx.Node, int]) -> list[Candidate]:
    """Expert computations over rows already grouped by expert, with counts: under expert parallelism, what a rank
    computes between the token all-to-all and the all-to-all back (torchtitan: rank-major rows permuted to
    expert-major, ``torch._grouped_mm`` with ``offs = cumsum(counts)``, un-permuted). It is the operator with K = 1,
    unit weights and ids given by the counts (:func:`moeblaze_fx.passes.extract.ids_from_counts`); the all-to-alls
    stay outside. Anchored at the counts (:func:`_counts_root`) of a grouped product that no top-k region holds, or
    that only a region left alone for its collectives holds (that region is then quiet: its local part is reported
    instead). The region is bounded as a top-k one is, from the counts, with edges into sizes left out (the split
    sizes of the all-to-alls read the counts too): its output is where the counts' routes meet again in an [N, d]
    float, N the grouped rows."""
    held = {n for c in found for n in c.nodes}
    exit_node = next(iter(reversed(graph.nodes)))
    sizes = _sizes_only(graph)
    ignore = asserts | sizes
    static_tensors = {n for n in static if isinstance(example_value(n), torch.Tensor)}
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        offs = _offsets_of(node)
        root = _counts_root(offs) if offs is not None and node not in held else None
        if root is not None:
            by_root.setdefault(root, []).append(node)

    candidates = []
    for root, products in by_root.items():
        span = list(_between(root, exit_node))[:-1]
        local_ipdom = collections.ChainMap({}, {exit_node: exit_node})
        _fill_post_dominators(reversed([root] + span), local_ipdom, order, exit_node, ignore)
        rows = example_value(products[0].args[0]).shape[0]
        computed = _computed_from(root, exit_node, ignore)
        out, body = None, set()
        node = local_ipdom[root]
        while node is not exit_node:
            val = example_value(node)
            if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() == 2 and \
                    same_size(val.shape[0], rows):
                body = {node} | _reach([node], _inputs, computed - {root})
                if all(p in body for p in products):
                    out = node
                    break
            node = local_ipdom[node]
        if out is None or _collectives(body):
            continue  # the grouped rows never meet in one [N, d] output, or a collective runs among them
        for outer, outer_body in dispatched:
            if any(p in outer_body for p in products):
                outer.quiet = True  # its local part below is reported (and rewritten) instead
        cand = Candidate(topk=root, ids=root, output=out, counts_grouped=True)
        candidates.append(cand)
        _pull_in_support(body, root, params, static_tensors, num_tokens=rows, d=example_value(out).shape[-1])
        # rows the products read straight from outside, cast there (torchtitan's x.bfloat16() for each product): the
        # casts are the region's, the rows its input
        body |= {i for n in list(body) for i in n.all_input_nodes if i not in body and canonical_name(i) in _CASTS
                 and all(u in body for u in i.users)}
        if collectives := _collectives(body):
            cand.reason = _collective_reason(collectives)
            continue
        mutation = _update_of_read(body, root, out, asserts, order)
        if mutation is not None:
            cand.reason = (f"an in-place update ({canonical_name(mutation)}, node {mutation.name}) of a tensor the "
                           "expert computation reads runs inside it; the operator, which runs at its output, would "
                           "read it after the update. Make that update out of place or move it after the experts")
            continue
        cand.nodes = sorted(body, key=order.__getitem__)
        cand.inputs = sorted({i for n in body for i in n.all_input_nodes if i not in body}, key=order.__getitem__)
        guarded = {a for a in asserts if any(i in body for i in a.all_input_nodes)}
        cand.asserts = sorted(guarded | _reach(guarded, _users, asserts), key=order.__getitem__)
    return candidates


def _collectives(body: set[fx.Node]) -> list[fx.Node]:
    return [n for n in _topological(body) if role(n) == "collective"]


EXPERT_PARALLEL = "expert-parallel dispatch inside the region"


def _collective_reason(nodes: list[fx.Node]) -> str:
    """Why a region holding collectives (or ops of unknown side effects) is left alone, and what the user can do."""
    names = sorted({canonical_name(n) for n in nodes})
    where = source_of(nodes[0])
    return (f"{EXPERT_PARALLEL}: it holds {len(nodes)} collective or opaque op(s) ({', '.join(names)}; first at "
            f"{where}), which are never run at compile time (every rank must run them alike), so the region is left "
            "alone. The local expert computation between the all-to-alls is rewritten on its own where the received "
            "rows are grouped by expert with counts and the experts are grouped products over them "
            "(torch._grouped_mm with offs = cumsum of the counts, torchtitan's); here it is not, so the block runs "
            "as compiled without the operator")


_TRANSFORMERS_FIX = ("for a transformers model whose experts take an implementation (model.set_experts_implementation "
                     "accepts it), use experts_implementation='grouped_mm' (its default for whole models) or "
                     "'batched_mm'")
GRAPH_BREAK = (
    "Dynamo split this MoE block: the graph ends right after the routing and the experts run in other graphs "
    "(a loop over a data-dependent tensor such as `for e in expert_hit`, a branch on a count, or .tolist() of "
    "counts). Compile with fullgraph=True to see where it breaks; loop over range(E) without the branch; "
    + _TRANSFORMERS_FIX
)
# Why Dynamo ended a graph (its graph-break type, the first line of its reason; or the operator it names):
# what that means for the MoE block, and what the user can change.
_BREAK_ADVICE = {
    "Data dependent operator": (
        ".tolist() or .item() turns a tensor into Python numbers ({op})",
        "set torch._dynamo.config.capture_scalar_outputs = True (or compile with fullgraph=True) to keep them in "
        "the graph as unbacked sizes, or keep the counts a tensor (torch._grouped_mm with offsets = cumsum of the "
        "counts)",
    ),
    "Unsupported Tensor.item() call with capture_scalar_outputs=False": (
        ".item() turns a tensor into a Python number",
        "set torch._dynamo.config.capture_scalar_outputs = True (or compile with fullgraph=True) to keep it in the "
        "graph as an unbacked size",
    ),
    "Dynamic shape operator": (
        "the output shape of {op} depends on the data",
        "set torch._dynamo.config.capture_dynamic_output_shape_ops = True (or compile with fullgraph=True), or use "
        "ops with static output shapes",
    ),
    "aten.bincount.default": (
        "torch.bincount's output length depends on the ids (an id >= minlength lengthens it)",
        "count with a static length instead: torch.histc(ids.float(), bins=E, min=0, max=E) or "
        "F.one_hot(ids, E).sum(0); capture_dynamic_output_shape_ops = True keeps bincount in the graph, but "
        ".tolist() of its data-dependent length then fails to compile",
    ),
}


# A Dynamo break at a ``for`` line it gives no other reason for ("step_unsupported", or a data-dependent expression
# with capture_scalar_outputs): the loop iterates a tensor whose length is the data's (HF's ``expert_hit``).
_LOOP_ADVICE = (
    "a Python loop over a tensor whose length depends on the data (the experts hit) cannot be traced",
    "loop over range(E) instead, each expert taking its rows with torch.where(ids == e) (an expert without rows "
    "then computes empty products), and set torch._dynamo.config.capture_dynamic_output_shape_ops = True (or "
    "compile with fullgraph=True) for the where",
)


def _compile_reason(gm: fx.GraphModule):
    """Why Dynamo ended this graph (its ``GraphCompileReason``: message, user stack, whether it was a
    graph break), or None outside Dynamo. Dynamo sets it on the module it hands the backend, and the
    passes' working copy carries it over."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason if hasattr(reason, "graph_break") and hasattr(reason, "user_stack") else None


def _break_advice(message: str) -> tuple[str, str, Optional[tuple[str, str]]]:
    """Of Dynamo's message for a graph break: its kind (the first line), the operator it names ("" for none) and
    :data:`_BREAK_ADVICE`'s (cause, fix) for either, or None."""
    message = message.strip()
    kind = message.splitlines()[0].strip()
    op = re.search(r"Operator `([^`]+)`", message)
    op = op.group(1) if op else ""
    return kind, op, _BREAK_ADVICE.get(op) or _BREAK_ADVICE.get(kind)


def _split_reason(compiled_because) -> str:
    """GRAPH_BREAK made specific: where Dynamo broke the graph, why, and what to change."""
    frames = [f for f in (compiled_because.user_stack if compiled_because else []) if f.filename]
    user = [f for f in frames if not is_plumbing(f.filename)] or frames
    if not user:
        return GRAPH_BREAK
    frame = user[-1]
    kind, op, advice = _break_advice(compiled_because.reason)
    if advice is None and frame.line and frame.line.lstrip().startswith("for "):
        advice = _LOOP_ADVICE
    cause, fix = advice or (
        f"Dynamo stopped tracing there ({kind})", "see why with TORCH_LOGS=graph_breaks and change that line")
    if op == "aten.nonzero.default":  # the block ended before its use: HF's `expert_hit`, looped over next
        fix += "; a Python loop over its result (`for e in expert_hit`) would break the graph next: loop over range(E)"
    if _takes_experts_implementation(frame.filename):
        fix = _TRANSFORMERS_FIX  # a library's own loop: choose its implementation rather than edit it
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return (f"Dynamo split this MoE block at {short_path(f'{frame.filename}:{frame.lineno}')}{code}: "
            f"{cause.format(op=op)}, so the graph ends there and the experts run in other graphs. "
            f"{fix[0].upper()}{fix[1:]}")


def _takes_experts_implementation(filename: str) -> bool:
    """Whether ``filename`` is a transformers model's module whose experts take an implementation (decorated with
    ``use_experts_implementation``). JetMoE's and DBRX's, for example, have their own loop and no other."""
    if os.sep + "transformers" + os.sep not in filename:
        return False
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == filename), None)
    return module is not None and hasattr(module, "use_experts_implementation")


# Dynamo's note when a graph break inside a loop makes it run the whole frame eagerly (torch 2.11-2.13)
_SKIPPED_FRAME = re.compile(r"frame skipped: (\w+) \((.+?) line (\d+)\)")


def skipped_moe_block(gm: fx.GraphModule) -> Optional[tuple[str, str]]:
    """(source, reason) when ``gm`` is compiled from a call inside an MoE block Dynamo skipped; else None.

    A per-expert loop over ``range(E)`` compiled without fullgraph=True breaks inside the loop (``torch.where`` of a
    mask, ``nonzero``, ``.item()``); Dynamo then runs the whole block eagerly and compiles only what it calls: each
    expert's module, alone, with no top-k in its graph, so no candidate is found. Recognised from Dynamo's note
    ("frame skipped: forward (file line N)") and the skipped frame being on the stack of this compile, its code
    calling a top-k: the block was an MoE's, and the report says so with the fix."""
    if any(role(n) == "topk" for n in gm.graph.nodes) or not any(
            role(n) in ("grouped_mm", "matmul") for n in gm.graph.nodes):
        return None
    from torch._dynamo.utils import counters

    for message in [*counters["unimplemented"], *counters["graph_break"]]:
        for found in _SKIPPED_FRAME.finditer(message):
            name, filename, first = found.group(1), found.group(2), int(found.group(3))
            frame = sys._getframe()
            while frame is not None:
                code = frame.f_code
                if (code.co_name, code.co_filename, code.co_firstlineno) == (name, filename, first) and \
                        "topk" in code.co_names:
                    return short_path(f"{filename}:{frame.f_lineno}"), _skipped_reason(message, name, filename, first)
                frame = frame.f_back
    return None


def _skipped_reason(message: str, name: str, filename: str, first: int) -> str:
    kind, op, advice = _break_advice(message)
    cause, fix = advice or (
        f"Dynamo stopped tracing there ({kind})", "see where with TORCH_LOGS=graph_breaks and change that line")
    return (f"Dynamo skipped the MoE block `{name}` at {short_path(f'{filename}:{first}')}: a graph break inside its "
            f"loop over the experts ({cause.format(op=op)}) makes Dynamo run the whole block eagerly, so this graph "
            f"holds an expert's computation without the routing and nothing is rewritten. Compile with "
            f"fullgraph=True to see the break; {fix}")


_ID_VIEWS = frozenset({"reshape", "view", "flatten", "to", "long", "int"})


def _leaves_graph(ids: fx.Node, computed: bool = False) -> bool:
    """The ids (or a view of them; with ``computed``, anything computed from them) are an output of the
    graph: Dynamo broke the graph after routing."""
    frontier = [ids]
    seen = {ids}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output":
                return True
            if user not in seen and (computed or canonical_name(user) in _ID_VIEWS):
                seen.add(user)
                frontier.append(user)
    return False


# Higher-order ops whose first argument, an attribute of the graph, is a subgraph they run on the rest: how Dynamo
# records the function torch.utils.checkpoint runs. Name: what the report calls it.
SUBGRAPH_OPS = {"tag_activation_checkpoint": "torch.utils.checkpoint"}


def subgraph_body(gm: fx.GraphModule, call: fx.Node) -> Optional[fx.GraphModule]:
    """The body ``call`` runs, when it calls one of ``SUBGRAPH_OPS``; else None."""
    if call.op != "call_function" or not isinstance(call.target, torch._ops.HigherOrderOperator):
        return None
    body = call.args[0] if call.args and isinstance(call.args[0], fx.Node) else None
    if call.target.name() not in SUBGRAPH_OPS or body is None or body.op != "get_attr":
        return None
    module = getattr(gm, str(body.target), None)
    return module if isinstance(module, fx.GraphModule) else None


def _routed_in_subgraph(gm: fx.GraphModule, ids: fx.Node) -> Optional[str]:
    """What runs the experts, when the ids (or a view of them) go into a subgraph (``torch.utils.checkpoint``'s
    function) that dispatches them and holds a matrix product; else None."""
    def routing(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if canonical_name(u) in _ID_VIEWS or ROLE_OF.get(canonical_name(u)) == "dispatch"]

    views = {ids} | _reach([ids], lambda n: [u for u in n.users if canonical_name(u) in _ID_VIEWS])
    for call in {u for v in views for u in v.users}:
        body = subgraph_body(gm, call)
        if body is None:
            continue
        reads = [p for p, a in zip(body.graph.find_nodes(op="placeholder"), call.args[1:]) if a in views]
        if any(ROLE_OF.get(canonical_name(n)) == "dispatch" for n in _reach(reads, routing)) and any(
                ROLE_OF.get(canonical_name(n)) in ("grouped_mm", "matmul") for n in body.graph.nodes):
            return f"{SUBGRAPH_OPS[call.target.name()]}'s function"
    return None


def _capacity_bound(body: set[fx.Node]) -> Optional[tuple[fx.Node, object]]:
    """Capacity routing: (the comparison, the capacity) where a per-token tensor with a running count
    behind it (a token's slot in its expert) is compared with a scalar; None when the body has none.
    Expert offsets (a cumsum of the counts) compared with token positions are no capacity: there the
    running count is the scalar side and the per-token side (an ``arange``) counts nothing."""
    for node in _topological(body):
        if role(node) != "compare" or len(node.args) != 2:
            continue
        for slot, bound in (node.args, node.args[::-1]):
            if _is_scalar(bound) and _counted(slot, body):
                return node, bound
    return None


def _is_scalar(arg) -> bool:
    val = example_value(arg)
    if isinstance(val, torch.Tensor):
        return val.dim() == 0
    return isinstance(val, (int, float, torch.SymInt, torch.SymFloat))


def _counted(node, body: set[fx.Node]) -> bool:
    """A per-token tensor in the body with a running count behind it (within the body)."""
    val = example_value(node)
    if not isinstance(node, fx.Node) or node not in body or not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        if role(n) == "running_count":
            return True
        for i in n.all_input_nodes:
            if i in body and i not in seen:
                seen.add(i)
                stack.append(i)
    return False


def _capacity_reason(compare: fx.Node, bound) -> str:
    capacity = example_value(bound)
    if isinstance(capacity, torch.Tensor):
        capacity = bound.name
    elif isinstance(capacity, torch.SymInt):  # symbolic (dynamic sizes, a float factor): its traced value
        capacity = f"{size_hint(capacity)} (at the traced sizes)"
    return (f"capacity routing: a running count of each expert's tokens is compared with a capacity C={capacity} at "
            f"{source_of(compare)}, and tokens beyond C are dropped; moe_ffn computes every routed token, "
            f"so the two differ whenever an expert is routed more than C tokens: not rewritten, and nothing can be changed "
            f"while the model drops tokens past a capacity")


def _num_tokens(ids: fx.Node):
    val = example_value(ids)
    return math.prod(val.shape[:-1]) if val.dim() > 1 else val.shape[0]


def _between(first: fx.Node, last: fx.Node) -> Iterable[fx.Node]:
    """The nodes after ``first`` up to ``last``, in graph order."""
    node = first
    while node is not last:
        node = node.next
        yield node


def _computed_from(ids: fx.Node, last: fx.Node, asserts: set[fx.Node]) -> set[fx.Node]:
    """``ids`` and the nodes after it up to ``last`` that read one of them (asserts left out)."""
    computed = {ids}
    for node in _between(ids, last):
        if node not in asserts and any(i in computed for i in node.all_input_nodes):
            computed.add(node)
    return computed


def _inputs(node: fx.Node) -> Iterable[fx.Node]:
    return node.all_input_nodes


def _users(node: fx.Node) -> Iterable[fx.Node]:
    return node.users


def _reach(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]],
           within: Optional[set[fx.Node]] = None) -> set[fx.Node]:
    """The nodes (of ``within``, when given) that ``step`` (``_inputs``, ``_users``) leads to from ``starts``,
    transitively."""
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        for n in step(stack.pop()):
            if (within is None or n in within) and n not in seen:
                seen.add(n)
                stack.append(n)
    return seen


def _body(ids: fx.Node, out: fx.Node, asserts: set[fx.Node]) -> set[fx.Node]:
    """Nodes on a path from ids to out (out included, ids not)."""
    return {out} | _reach([out], _inputs, _computed_from(ids, out, asserts) - {ids})


def _combine_point(graph, ids, ipdom, order, asserts, static) -> tuple[Optional[fx.Node], set[fx.Node]]:
    """Walk up the post-dominators of ids to the first float [T, ...] tensor with an expert product
    behind it: where the per-expert routes meet again, after the reduction over the K choices.

    With K = 1 a token's one expert output is already [T, d], before the routing weight is applied (HF
    ``batched_mm``: ``out * w.unsqueeze(-1)`` after the products). The walk then goes on to the first point whose
    region reads a weight-sized [T] float from outside, as long as the nodes it adds read no other [T, d] float
    (a residual) from outside; not where the region already computes the weights from the ids and reads them
    (ZAYA's, gathered by id and masked where the id is its skip expert): a [d] parameter read after the combine
    would pass for a weight where T = d. Values of ``static`` (computed from parameters alone) are never weights."""
    T = _num_tokens(ids)
    node = ipdom[ids]
    while node.op != "output":
        val = example_value(node)
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2:
            if same_size(val.numel(), T * val.shape[-1]):
                body = _body(ids, node, asserts)
                if any(role(n) in ("grouped_mm", "matmul") for n in body):
                    if example_value(ids).shape[-1] == 1 and not _reads_weights(body, T, static) and \
                            not _weight_members(body, ids)[1]:
                        return _weighted_point(ids, node, body, ipdom, asserts, T, static)
                    return node, body
        node = ipdom[node]
    return None, set()


def _outside_floats(body: set[fx.Node], readers: Optional[set[fx.Node]] = None,
                    skip: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> Iterable[torch.Tensor]:
    """The float tensors from outside ``body`` (and not in ``skip``) that its nodes (those of ``readers``, when
    given) read."""
    for n in body if readers is None else readers:
        for i in n.all_input_nodes:
            val = example_value(i)
            if i not in body and i not in skip and isinstance(val, torch.Tensor) and val.is_floating_point():
                yield val


def _reads_weights(body: set[fx.Node], T, static: set[fx.Node]) -> bool:
    """Whether ``body`` reads a [T]-sized float from outside that is not computed from parameters alone (an expert
    bias ``[E, d]`` has T's size where T = E·d)."""
    return any(same_size(v.numel(), T) for v in _outside_floats(body, skip=static))


def _weighted_point(ids, first, first_body, ipdom, asserts, T, static) -> tuple[fx.Node, set[fx.Node]]:
    """For K = 1: the first post-dominator after ``first`` whose region reads the routing weights, or ``first``
    when the walk meets a node reading another [T, d] float from outside first."""
    d = example_value(first).shape[-1]
    node = ipdom[first]
    while node.op != "output":
        val = example_value(node)
        if not (isinstance(val, torch.Tensor) and val.is_floating_point() and same_size(val.numel(), T * d)):
            break
        body = _body(ids, node, asserts)
        if any(same_size(v.numel(), T * d) for v in _outside_floats(body, body - first_body)):
            break
        if _reads_weights(body, T, static):
            return node, body
        node = ipdom[node]
    return first, first_body


def same_size(a, b) -> bool:
    """Sizes equal for every value of their symbols (decided without adding guards)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _weight_members(body: set[fx.Node], ids: fx.Node) -> tuple[set[fx.Node], list[fx.Node]]:
    """The router's weight computation inside ``body`` when it reads the ids (``scores.gather(1, ids)``,
    renormalized, flattened): the float nodes rooted at the ids that read only each other and values from outside
    the region; and those of them that the rest of ``body`` reads."""
    members: set[fx.Node] = set()
    for node in _topological(body):
        val = example_value(node)
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue
        inputs = node.all_input_nodes
        if any(i is ids or i in members for i in inputs) and all(i in members or i not in body for i in inputs):
            members.add(node)
    return members, [n for n in members if any(u in body and u not in members for u in n.users)]


def _push_out_weights(body: set[fx.Node], ids: fx.Node) -> None:
    """Leave the router's weight computation (:func:`_weight_members`) outside the region: when the expert
    computation reads exactly one of its nodes, that one becomes the region's combine-weights input."""
    members, read = _weight_members(body, ids)
    if len(read) == 1:
        body.difference_update(members)


def _routes_meet(graph, ids, ipdom, order, asserts, exit_node, static) -> Optional[tuple[fx.Node, set[fx.Node]]]:
    """The combine point of the ids' routes to the experts alone: post-dominators from the ids on, the router's
    weight computation (:func:`_weight_members` over everything computed from the ids) left out of the ids' paths.
    None when those routes meet nowhere, or where the region found reads more than one of the weights' nodes. The
    weights are pushed out of the body here, before the support comes in, which would otherwise take the logits
    they are gathered from."""
    members, _ = _weight_members(_computed_from(ids, exit_node, asserts) - {ids, exit_node}, ids)
    span = list(_between(ids, exit_node))[:-1]
    routes_ipdom = collections.ChainMap({}, ipdom)
    _fill_post_dominators(reversed([ids] + span), routes_ipdom, order, exit_node, asserts | members)
    out, body = _combine_point(graph, ids, routes_ipdom, order, asserts, static)
    if out is None:
        return None
    members, read = _weight_members(body, ids)
    if len(read) != 1:
        return None
    return out, body - members


def _topological(nodes: set[fx.Node]) -> list[fx.Node]:
    if not nodes:
        return []
    graph = next(iter(nodes)).graph
    return [n for n in graph.nodes if n in nodes]


def _pull_in_support(body: set[fx.Node], ids: fx.Node, params: set[fx.Node], static: set[fx.Node], num_tokens,
                     d) -> None:
    """Add to ``body`` what only serves it: parameter-only and shape-only producers, and private
    preprocessing of the tokens (``x.repeat_interleave(K)``) up to the tokens [T, d] and the combine
    weights [T*K] themselves, which stay outside as the region's inputs."""
    K = example_value(ids).shape[-1]

    def boundary(node: fx.Node) -> bool:
        val = example_value(node)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return True
        tokens = val.dim() >= 1 and same_size(val.shape[-1], d) and same_size(val.numel(), num_tokens * d)
        return tokens or same_size(val.numel(), num_tokens * K)

    changed = True
    while changed:
        changed = False
        for node in list(body):
            for i in node.all_input_nodes:
                if i in body or i is ids or i in params or i.op in ("placeholder", "get_attr"):
                    continue
                pull = i in static or canonical_name(i) in SHAPE_ONLY_NAMES
                if not pull and not boundary(i) and all(u in body for u in i.users):
                    pull = True  # private to the region
                if pull:
                    body.add(i)
                    changed = True


def size_hint(size, unbacked: Optional[int] = None) -> int:
    """The concrete value behind a size that may be symbolic (torch 2.11 and 2.13 name this differently);
    ``unbacked``, when given, for a data-dependent size, which has none (else that raises)."""
    if isinstance(size, int):
        return size
    if unbacked is not None and free_unbacked_symbols(size):
        return unbacked
    try:
        from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint
    except ImportError:  # torch < 2.12
        from torch.fx.experimental.symbolic_shapes import hint_int as hint
    return int(hint(size))
