"""Step 2: find candidate expert regions.

A candidate starts at a ``topk`` whose indices (the expert ids) feed a dispatch. Its region is the
expert computation, bounded by meaning rather than by spelling:

* its **output** is the immediate post-dominator of the ids: the first node that every path from the
  ids to the graph's output passes through. However the experts are spelled (a sort and grouped
  products, an unrolled per-expert loop of ``index_add``, a gather and batched products), the routes
  from the ids fan out and meet again exactly where expert outputs are combined;
* its **body** is every node on a path from the ids to that output;
* its **support** is pulled in: nodes that read only parameters or constants (a transpose of an
  expert weight, an ``arange``) and shape-only factories (``zeros_like(x)``).

Runtime assertions (``_assert_scalar`` on data-dependent sizes) are not data: they are ignored when
post-dominators are computed and are removed with the region they guard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .normalize import canonical_name, example_value, role

__all__ = ["Candidate", "find_candidates", "assert_only_nodes", "SHAPE_ONLY_NAMES", "example_value", "size_hint"]

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


def _dead(node: fx.Node) -> bool:
    """An unused node without side effects (a mask a loop computed and did not use)."""
    if node.users or node.op not in ("call_function", "call_method"):
        return False
    name = canonical_name(node)
    return not (name.endswith("_") or name == "setitem" or node.is_impure())


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
    exit_node = nodes[-1]  # the output node
    ipdom: dict[fx.Node, fx.Node] = {exit_node: exit_node}

    def meet(a: fx.Node, b: fx.Node) -> fx.Node:
        while a is not b:
            while order[a] < order[b]:
                a = ipdom[a]
            while order[b] < order[a]:
                b = ipdom[b]
        return a

    for node in reversed(nodes[:-1]):
        succ = [u for u in node.users if u not in ignore]
        if not succ:
            ipdom[node] = exit_node
            continue
        cur = succ[0]
        for s in succ[1:]:
            cur = meet(cur, s)
        ipdom[node] = cur
    return ipdom, order


def _ids_of(topk: fx.Node) -> Optional[fx.Node]:
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
    asserts = assert_only_nodes(graph)
    ipdom, order = _post_dominators(graph, asserts)
    static: set[fx.Node] = set()
    for node in graph.nodes:
        if _is_static(node, static, params):
            static.add(node)

    candidates = []
    for topk in graph.nodes:
        if role(topk) != "topk":
            continue
        ids = _ids_of(topk)
        if ids is not None and _leaves_graph(ids):
            candidates.append(Candidate(topk=topk, ids=ids, reason=GRAPH_BREAK))
            continue
        if ids is None or not any(role(u) == "dispatch" or canonical_name(u) in ("reshape", "view", "flatten", "to")
                                  for u in ids.users):
            continue  # top-k whose indices are not routed: not an MoE
        cand = Candidate(topk=topk, ids=ids)
        candidates.append(cand)
        out, body = _combine_point(graph, ids, ipdom, order, asserts)
        if out is None:
            cand.reason = ("the expert outputs never meet in one [T, d] tensor before the graph's output (the ids are "
                           "also used outside the expert computation, or an in-place update could not be made "
                           "functional)")
            continue
        cand.output = out
        _pull_in_support(body, ids, params, static, num_tokens=_num_tokens(ids), d=example_value(out).shape[-1])
        _push_out_weights(body, ids)
        cand.nodes = sorted(body, key=order.__getitem__)
        external = {i for n in body for i in n.all_input_nodes if i not in body}
        cand.inputs = sorted(external, key=order.__getitem__)
        cand.asserts = sorted(
            (a for a in asserts if any(i in body for i in a.all_input_nodes)), key=order.__getitem__
        )
        # close the assert set over assert-only chains (sym_size -> ge -> _assert_scalar)
        pending = list(cand.asserts)
        seen = set(pending)
        while pending:
            for u in pending.pop().users:
                if u in asserts and u not in seen:
                    seen.add(u)
                    pending.append(u)
        cand.asserts = sorted(seen, key=order.__getitem__)
    return candidates


GRAPH_BREAK = (
    "Dynamo split this MoE block: the graph ends right after the routing and the experts run in other graphs "
    "(a loop over a data-dependent tensor such as `for e in expert_hit`, a branch on a count, or .tolist() of "
    "counts). Compile with fullgraph=True to see where it breaks; loop over range(E) without the branch; "
    "for transformers use experts_implementation='grouped_mm' (its default for whole models) or 'batched_mm'"
)


def _leaves_graph(ids: fx.Node) -> bool:
    """The ids (or a view of them) are an output of the graph: Dynamo broke the graph after routing."""
    frontier = [ids]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output":
                return True
            if canonical_name(user) in ("reshape", "view", "flatten", "to", "long", "int"):
                frontier.append(user)
    return False


def _num_tokens(ids: fx.Node):
    val = example_value(ids)
    return math.prod(val.shape[:-1]) if val.dim() > 1 else val.shape[0]


def _body(graph: fx.Graph, ids: fx.Node, out: fx.Node, order: dict[fx.Node, int], asserts: set[fx.Node]) -> set[fx.Node]:
    """Nodes on a path from ids to out (out included, ids not)."""
    forward = {ids}
    for node in graph.nodes:
        if order[node] > order[out]:
            break
        if node is not ids and node not in asserts and any(i in forward for i in node.all_input_nodes):
            forward.add(node)
    body = {out}
    stack = [out]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i in forward and i not in body and i is not ids:
                body.add(i)
                stack.append(i)
    return body


def _combine_point(graph, ids, ipdom, order, asserts) -> tuple[Optional[fx.Node], set[fx.Node]]:
    """Walk up the post-dominators of ids to the first float [T, ...] tensor with an expert product
    behind it: where the per-expert routes meet again, after the reduction over the K choices."""
    T = _num_tokens(ids)
    node = ipdom[ids]
    while node.op != "output":
        val = example_value(node)
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 2:
            if same_size(val.numel(), T * val.shape[-1]):
                body = _body(graph, ids, node, order, asserts)
                if any(role(n) in ("grouped_mm", "matmul") for n in body):
                    return node, body
        node = ipdom[node]
    return None, set()


def same_size(a, b) -> bool:
    """Sizes equal for every value of their symbols (decided without adding guards)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _push_out_weights(body: set[fx.Node], ids: fx.Node) -> None:
    """Leave the router's weight computation outside the region when it reads the ids
    (``scores.gather(1, ids)``, renormalized, flattened): the float nodes rooted at the ids that read
    only each other and values from outside the region. When the expert computation reads exactly
    one of them, that one becomes the region's combine-weights input."""
    members: set[fx.Node] = set()
    for node in _topological(body):
        val = example_value(node)
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue
        inputs = node.all_input_nodes
        if any(i is ids or i in members for i in inputs) and all(i in members or i not in body for i in inputs):
            members.add(node)
    read = [n for n in members if any(u in body and u not in members for u in n.users)]
    if len(read) == 1:
        body.difference_update(members)


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
        return same_size(val.numel(), num_tokens * d) or same_size(val.numel(), num_tokens * K)

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


def size_hint(size) -> int:
    """The concrete value behind a size that may be symbolic (torch 2.11 and 2.13 name this differently)."""
    if isinstance(size, int):
        return size
    try:
        from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as hint
    except ImportError:  # torch < 2.12
        from torch.fx.experimental.symbolic_shapes import hint_int as hint
    return int(hint(size))
