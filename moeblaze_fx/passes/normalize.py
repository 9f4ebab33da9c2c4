"""Step 1: bring the many torch-level spellings of an MoE block to one vocabulary.

Two things happen here, both driven by the tables below (a new spelling is a new table row):

* **Roles.** Every node gets ``node.meta["moeblaze_role"]``: what it means for MoE analysis
  (``"topk"``, ``"dispatch"``, ``"grouped_mm"``, ``"matmul"``, ``"combine"``, ``"running_count"``,
  ``"compare"``, ``"attention"``, ``"collective"``, ``"assert"``, or ``None``), whatever its spelling: a function, a method, an
  aten overload or a library's custom op. Eager attention has no op of its own: its softmax takes the role
  where the probabilities weigh a matrix product. Expert ids picked one by one (top-1 indices of maxima, kept
  last dim, concatenated along it) take the role ``"topk"`` themselves.
* **Functional form.** In-place updates of freshly made tensors (``out.index_add_(...)``,
  ``inv[perm] = arange``, ``w /= s``) become their out-of-place forms, and later readers of the
  mutated tensor read the new value instead. Data flow is then visible in the def-use edges, which
  is what ``find`` walks. Aliasing is judged by the storage of Dynamo's recorded (fake) values, so
  views count however they are spelled. An update of a graph input, or of a tensor another alias of
  which is read after it, is left as is; ``find`` leaves a region alone when such an update
  touches what the region reads.

The rewrite preserves the function exactly: a functional update followed by rewired readers
computes what the in-place update did.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["canonical_name", "example_value", "role", "normalize", "functional_setitem", "functional_copy",
           "shares_storage", "ROLE_OF",
           "ASSERT_NAMES", "is_collective"]

# --- the vocabulary --------------------------------------------------------------------------
ROLE_OF: dict[str, str] = {
    # routing
    "topk": "topk",
    # dispatch: turning ids into per-expert token lists or counts
    "sort": "dispatch",
    "argsort": "dispatch",
    "histc": "dispatch",
    "bincount": "dispatch",
    "one_hot": "dispatch",
    "eq": "dispatch",  # ids == e, the per-expert mask of a loop
    "nonzero": "dispatch",
    "repeat_interleave": "dispatch",
    "scatter": "dispatch",  # the ids scattered into a dense [T, E] map of the routing weights (Llama 4's scores)
    # expert matrix products
    "_grouped_mm": "grouped_mm",
    "grouped_mm": "grouped_mm",
    "transformers::grouped_mm_fallback": "grouped_mm",
    "bmm": "matmul",
    "baddbmm": "matmul",
    "matmul": "matmul",
    "mm": "matmul",
    "linear": "matmul",
    "einsum": "matmul",
    # combining expert outputs back into token order
    "index_add": "combine",
    "scatter_add": "combine",
    "index_put": "combine",
    "functional_setitem": "combine",
    # capacity routing (Switch, GShard): a token's slot in its expert is a running count over the
    # one-hot ids, compared with the capacity; tokens past it are dropped
    "cumsum": "running_count",
    "lt": "compare",
    "le": "compare",
    "gt": "compare",
    "ge": "compare",
    "less": "compare",
    "less_equal": "compare",
    "greater": "compare",
    "greater_equal": "compare",
    # attention: a top-k whose region calls it selects keys (a sparse-attention indexer), not experts
    "scaled_dot_product_attention": "attention",
    "_scaled_dot_product_flash_attention": "attention",
    "_scaled_dot_product_efficient_attention": "attention",
    "_scaled_dot_product_cudnn_attention": "attention",
    "flex_attention": "attention",
}
ASSERT_NAMES = frozenset(
    {"_assert_scalar", "_assert_async", "_assert_tensor_metadata", "sym_constrain_range", "sym_constrain_range_for_size"}
)

# Collectives, waits on them and what drives other ranks: never run at compile time (find leaves a region holding
# one alone). Namespaces of torch's collectives (functional and autograd, c10d's own, symmetric memory); a custom op
# of any namespace not below that writes an argument or returns nothing (DeepEP-style dispatch/combine libraries,
# NVSHMEM wrappers) is treated the same: its side effects are unknown.
_COLLECTIVE_NAMESPACES = ("c10d", "symm_mem", "nvshmem")  # substrings: _c10d_functional, _c10d_functional_autograd
_PURE_NAMESPACES = frozenset({"aten", "prims", "moeblaze", "transformers", "profiler"})


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` is a collective, a wait on one, or an op whose side effects are unknown (see above)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:  # a traced torch.distributed function kept as itself
        return (getattr(target, "__module__", None) or "").startswith("torch.distributed")
    if not overloads:
        return False
    namespace = overloads[0].namespace
    if any(c in namespace for c in _COLLECTIVE_NAMESPACES):
        return True
    return namespace not in _PURE_NAMESPACES and any(o._schema.is_mutable or not o._schema.returns for o in overloads)


# In-place methods: ``x.foo_(...)`` becomes ``x.foo(...)`` whenever torch.Tensor has that
# out-of-place method (index_add_, masked_fill_, clamp_, scatter_, div_, ...); these have none.
_NO_FUNCTIONAL_FORM = frozenset({"copy_", "set_", "resize_", "resize_as_", "requires_grad_", "share_memory_"})
_INPLACE_OPERATORS = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}


def functional_setitem(base: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """Out-of-place ``base[index] = value``."""
    out = base.clone()
    out[index] = value
    return out


def functional_copy(base: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Out-of-place ``base.copy_(src)``."""
    out = base.clone()
    out.copy_(src)
    return out


# Fresh buffers a ``copy_`` fills whole: how Dynamo traces an in-place collective into a buffer made for it
# (``out = torch.empty_like(x); dist.all_to_all_single(out, x)``: the functional collective, then ``out.copy_``)
_BUFFERS = frozenset({"empty_like", "empty", "new_empty", "zeros_like", "zeros", "new_zeros"})


def operator_name(method: str) -> Optional[str]:
    """The ``operator`` function a dunder method stands for (``__eq__`` -> ``"eq"``, ``__and__`` -> ``"and_"``),
    else None: torch 2.11's Dynamo records ``ids == e`` as the method call ``.__eq__``, 2.13's as ``operator.eq``."""
    if len(method) <= 4 or not (method.startswith("__") and method.endswith("__")):
        return None
    op = method[2:-2]
    return op if hasattr(operator, op) else f"{op}_" if hasattr(operator, f"{op}_") else None


def canonical_name(node: fx.Node) -> str:
    """The spelling-independent name of what a node calls: ``torch.topk``, ``x.topk`` and
    ``aten.topk.default`` are all ``"topk"``; a library's custom op keeps its namespace."""
    target = node.target
    if node.op == "call_method":
        return operator_name(str(target)) or str(target)
    if node.op != "call_function":
        return node.op
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, name = target._qualified_op_name.split("::")
        return name if ns == "aten" else f"{ns}::{name}"
    return getattr(target, "__name__", str(target))


def example_value(node: Any) -> Any:
    """The fake value Dynamo recorded for a node (a non-node argument is its own value)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def role(node: fx.Node) -> Optional[str]:
    return node.meta.get("moeblaze_role")


# What an eager attention's probabilities pass through on their way to the product with the values.
_PASS_THROUGH = frozenset({"getitem", "dropout", "to", "type", "float", "half", "bfloat16", "contiguous"})


def _weighs_a_product(node: fx.Node) -> bool:
    """Whether the node's value (through casts, dropout and indexing) is a factor of a matrix product."""
    for user in node.users:
        name = canonical_name(user)
        if ROLE_OF.get(name) == "matmul" or (name in _PASS_THROUGH and _weighs_a_product(user)):
            return True
    return False


def _arg(node: fx.Node, i: int, key: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


def _last_dim(node: fx.Node, dim: Any) -> bool:
    value = example_value(node)
    return isinstance(dim, int) and isinstance(value, torch.Tensor) and dim in (-1, value.dim() - 1)


def _top1_pick(node: fx.Node) -> bool:
    """The indices of a maximum over the last dim, that dim kept: ``x.max(-1, keepdim=True)[1]``,
    ``x.argmax(-1, keepdim=True)``, or either without ``keepdim`` and then ``unsqueeze(-1)``."""
    if canonical_name(node) == "unsqueeze":
        inner, dim = node.args[0], _arg(node, 1, "dim")
        return isinstance(inner, fx.Node) and _last_dim(node, dim) and _top1_pick_of(inner, keep=False)
    return _top1_pick_of(node, keep=True)


def _top1_pick_of(node: fx.Node, keep: bool) -> bool:
    name = canonical_name(node)
    if name == "getitem" and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
        node, name = node.args[0], canonical_name(node.args[0])
        if name != "max":
            return False
    elif name != "argmax":
        return False
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return source is not None and _last_dim(source, _arg(node, 1, "dim")) and bool(_arg(node, 2, "keepdim")) == keep


def _stacked_picks(node: fx.Node) -> bool:
    """Expert ids made of top-1 picks side by side (``cat`` along the last dim): PhiMoE's sparsemixer picks each of
    its two experts with its own (Gumbel-sampled) maximum."""
    parts = _arg(node, 0, "tensors")
    return (canonical_name(node) in ("cat", "concat", "concatenate") and isinstance(parts, (list, tuple))
            and len(parts) > 1 and _last_dim(node, _arg(node, 1, "dim", 0))
            and all(isinstance(p, fx.Node) and _top1_pick(p) for p in parts))


def _role_of(node: fx.Node) -> Optional[str]:
    name = canonical_name(node)
    if _stacked_picks(node):
        return "topk"  # its own ids
    if name in ASSERT_NAMES:
        return "assert"
    if is_collective(node):
        return "collective"
    if name == "where" and len(node.args) + len(node.kwargs) == 1:
        return "dispatch"  # torch.where(cond) is nonzero
    if name in ("softmax", "_softmax") and _weighs_a_product(node):
        return "attention"  # eager attention (HY-V4's, with its sinks): probabilities weighing the values
    return ROLE_OF.get(name)


def _storage(value: Any) -> Optional[StorageWeakRef]:
    """The storage of a recorded tensor value (of the tensor a ``torch.vmap`` batch wraps); None for a non-tensor or
    a tensor whose storage cannot be read."""
    if not isinstance(value, torch.Tensor):
        return None
    while torch._C._functorch.is_batchedtensor(value):
        value = torch._C._functorch.get_unwrapped(value)
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
        return None


def shares_storage(a: Any, b: Any) -> bool:
    """True when two recorded values are tensors over one storage (Dynamo's fake tensors keep the aliasing of the
    real ones: a view however spelled, ``x.to(x.dtype)``, a piece of ``x.chunk(2)``, an in-place update's result),
    and, to be safe, when either is a tensor whose storage cannot be read."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    ref_a, ref_b = _storage(a), _storage(b)
    return ref_a is None or ref_b is None or ref_a == ref_b


def _mutation(node: fx.Node) -> Optional[tuple[Any, str]]:
    """(out-of-place target, call kind) when ``node`` updates its first argument in place."""
    name = node.target
    if (node.op == "call_method" and name.endswith("_") and not name.startswith("_")
            and name not in _NO_FUNCTIONAL_FORM and callable(getattr(torch.Tensor, name[:-1], None))):
        return name[:-1], "call_method"
    if node.op == "call_method" and name == "copy_" and len(node.args) == 2 and not node.kwargs and all(
            isinstance(a, fx.Node) for a in node.args) and canonical_name(node.args[0]) in _BUFFERS:
        base, src = (example_value(a) for a in node.args)
        if isinstance(base, torch.Tensor) and isinstance(src, torch.Tensor) and base.dtype == src.dtype and \
                base.dim() == src.dim() and all(statically_known_true(a == b) for a, b in zip(base.shape, src.shape)):
            return functional_copy, "call_function"
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        if isinstance(example_value(node.args[0]), torch.Tensor):
            return _INPLACE_OPERATORS[node.target], "call_function"
    if node.op == "call_function" and node.target is operator.setitem:
        if isinstance(example_value(node.args[0]), torch.Tensor):
            return functional_setitem, "call_function"
    return None


def _private(node: fx.Node, base: fx.Node, aliases: list[fx.Node], order: dict[fx.Node, float]) -> bool:
    """True when ``node``'s update of ``base`` is seen through ``base`` alone: its storage was made in the graph
    (not an input or parameter, whose update the caller sees), and no other tensor over it (``aliases``, by the
    recorded values) made before the update is read after it. The update can then be out of place, its readers
    rewired; an alias made after it is made from ``base`` (rewired too) or from one read after it."""
    for alias in aliases:
        if alias is base or order[alias] >= order[node]:
            continue
        if alias.op in ("placeholder", "get_attr"):
            return False
        if any(order.get(u, -1) > order[node] for u in alias.users):
            return False  # a view, or the tensor it is a view of, read after the update sees it
    return base.op in ("call_function", "call_method")


def _functionalize(graph: fx.Graph) -> int:
    order: dict[fx.Node, float] = {n: i for i, n in enumerate(graph.nodes)}
    by_storage: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in graph.nodes:
        ref = _storage(example_value(node))
        if ref is not None:
            by_storage.setdefault(ref, []).append(node)
    changed = 0
    for node in list(graph.nodes):
        found = _mutation(node)
        if found is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        base = node.args[0]
        ref = _storage(example_value(base))  # no recorded value: aliasing unknown, the update stays
        if ref is None or not _private(node, base, by_storage[ref], order):
            continue
        target, kind = found
        with graph.inserting_after(node):
            new = graph.create_node(kind, target, node.args, node.kwargs, name=f"{node.name}_functional")
        new.meta = dict(node.meta)
        # the updated tensor's value: a view of it taken later records that storage too, and stays its alias
        new.meta["example_value"] = example_value(base)
        result = new
        base_dtype = example_value(base).dtype
        if target not in (functional_setitem, functional_copy) and any(
                isinstance(v := example_value(a), torch.Tensor) and v.is_floating_point() and v.dtype != base_dtype
                for a in node.all_input_nodes if a is not base):
            # an in-place update keeps its tensor's dtype, the out-of-place op promotes (bf16 *= a float32 tensor:
            # bf16, bf16 * it: float32): cast back, as the update stores
            with graph.inserting_after(new):
                result = graph.create_node("call_method", "to", (new, base_dtype), name=f"{node.name}_functional_cast")
            result.meta = dict(new.meta)
            new.meta.pop("example_value")  # its dtype is the promoted one, not recorded
            order[result] = order[node] + 0.75
        by_storage[ref].append(result)
        node.replace_all_uses_with(result)
        for user in list(base.users):
            if user not in (new, result) and order.get(user, -1) > order[node]:
                user.replace_input_with(base, result)
        order[new] = order[node] + 0.5
        graph.erase_node(node)
        changed += 1
    return changed


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Functionalize in-place updates of fresh tensors and tag every node with its role (in place)."""
    changed = _functionalize(gm.graph)
    for node in gm.graph.nodes:
        node.meta["moeblaze_role"] = _role_of(node)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
