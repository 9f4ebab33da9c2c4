"""Step 3: extract what a candidate region computes with.

From the region's external inputs: the tokens ``x``, the combine ``weights``, the ``ids``, and the
expert parameters, grouped into *roles* (one ``[E, r, c]`` weight or ``[E, n]`` bias per role: a 3-D
(2-D) parameter, or the same parameter of every expert of a ``ModuleList``). Then the layout
hypotheses: each says which part of which role is the operator's gate, up, down and biases (stored
transposed or not; the whole role, its halves or its even/odd rows), and the activation candidates
from the functions the region calls. The operator reads those parts in place (``Layout.operator_args``);
shapes alone rule most hypotheses out; ``prove`` picks among the rest by computing.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..kernels.reference import Activation, ExpertParams
from ..layout import ROLES, RoleView, encode_layout
from .find import SHAPE_ONLY_NAMES, Candidate, example_value, same_size

from .normalize import canonical_name, role

__all__ = ["Extraction", "Role", "Layout", "Routing", "OUTPUT_WEIGHTED", "extract", "ids_from_counts", "unit_weights"]


@dataclasses.dataclass
class Role:
    """One expert tensor for all experts: a 3-D parameter (a 2-D one for a bias), or the same
    parameter of every expert of a ``ModuleList`` (2-D weights, 1-D biases)."""

    params: list[fx.Node]  # one node ([E, r, c] or [E, n]) or E nodes ([r, c] or [n]) in expert order
    shape: tuple[int, int, int]  # [E, r, c]; a bias is [E, n, 1]
    bias: bool = False

    @property
    def stacked(self) -> bool:
        return len(self.params) > 1 or example_value(self.params[0]).dim() == (1 if self.bias else 2)


# How an operator role is cut from an extracted role, along its output features (logical rows n):
# the rows each piece keeps, as a slice, and how the report writes it.
_PIECES = {"all": (lambda n: slice(None), ""), "first": (lambda n: slice(0, n // 2), "[:n/2]"),
           "second": (lambda n: slice(n // 2, None), "[n/2:]"), "even": (lambda n: slice(0, None, 2), "[0::2]"),
           "odd": (lambda n: slice(1, None, 2), "[1::2]")}


@dataclasses.dataclass(frozen=True)
class Part:
    """Operator role = rows ``piece`` of extracted role ``role``, stored transposed (``[E, in, out]``) when ``t``."""

    role: int
    t: bool = False
    piece: str = "all"

    def describe(self, names: list[str]) -> str:
        return f"{names[self.role]}{'.T' if self.t else ''}{_PIECES[self.piece][1]}"

    def view(self, role: Role, first: int) -> RoleView:
        """Where this part lives in the role's parameter(s) (``first``: index of its first parameter)."""
        val = example_value(role.params[0])
        strides = list(val.stride())
        if role.bias:
            strides = strides + [1]  # [.., n] -> [.., n, 1]
        if role.stacked:
            strides = [0] + strides
        s_e, s_r, s_c = strides
        rows, cols = role.shape[1], role.shape[2]
        if self.t:
            s_r, s_c, rows, cols = s_c, s_r, cols, rows
        offset = 0
        if self.piece != "all":
            rows //= 2
            if self.piece == "second":
                offset = rows * s_r
            elif self.piece in ("even", "odd"):
                offset = s_r if self.piece == "odd" else 0
                s_r *= 2
        return RoleView(first, len(role.params), offset, s_e, s_r, s_c, rows, cols)

    def value(self, value: torch.Tensor) -> torch.Tensor:
        """The part of a role's ``[E, r, c]`` (``[E, n]`` for a bias) tensor, as a view."""
        v = value.transpose(1, 2) if self.t else value
        return v[:, _PIECES[self.piece][0](v.shape[1])]


@dataclasses.dataclass
class Layout:
    """The operator's expert roles, each a :class:`Part` of an extracted role; ``up`` is None for a
    plain (non-gated) activation."""

    gate: Part
    up: Optional[Part]
    down: Part
    gate_bias: Optional[Part] = None
    up_bias: Optional[Part] = None
    down_bias: Optional[Part] = None

    @property
    def parts(self) -> list[Optional[Part]]:
        return [self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias]

    def describe(self, names: list[str]) -> str:
        text = [f"{role} = {part.describe(names)}" for role, part in zip(ROLES, self.parts) if part is not None]
        return ", ".join(text)

    def experts(self, values: list[torch.Tensor]) -> ExpertParams:
        """Dense expert tensors (views of ``values``, one ``[E, ...]`` tensor per role) for the reference."""
        return ExpertParams(*[None if p is None else p.value(values[p.role]) for p in self.parts])

    def operator_args(self, roles: list[Role]) -> tuple[list[fx.Node], list[int]]:
        """The operator's ``params`` (graph nodes, each once) and ``layout`` ints."""
        params: list[fx.Node] = []
        first: dict[int, int] = {}
        views = []
        for part in self.parts:
            if part is None:
                views.append(None)
                continue
            if part.role not in first:
                first[part.role] = len(params)
                params.extend(roles[part.role].params)
            views.append(part.view(roles[part.role], first[part.role]))
        return params, encode_layout(roles[self.gate.role].shape[0], views)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How the region applies its combine weights ``w`` [T, K]: after ``fn`` (None, or ``"sigmoid"`` computed in
    float32 and rounded back to w's dtype, as Llama 4's router does), to the experts' outputs (the operator's own
    ``sum_k w_k f_k(x)``), or ``on_input`` to the tokens before the experts (Llama 4: ``f(w * x)``, top-1 only)."""

    fn: Optional[str] = None
    on_input: bool = False

    def apply(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The operator's (x, weights) for the region's x [T, d] and w [T, K]."""
        if self.fn == "sigmoid":
            w = torch.sigmoid(w.float()).to(w.dtype)
        return (x * w, torch.ones_like(w)) if self.on_input else (x, w)

    def describe(self) -> str:
        """How the report shows it ("" for the operator's own)."""
        parts = ([f"{self.fn}(w)"] if self.fn else []) + (["weights on the tokens"] if self.on_input else [])
        return ", ".join(parts)


OUTPUT_WEIGHTED = Routing()


@dataclasses.dataclass
class Extraction:
    x: fx.Node
    # the combine weights [T, K]; None for rows grouped by counts (``Candidate.counts_grouped``: unit weights)
    weights: Optional[fx.Node]
    ids: fx.Node  # the ids [T, K]; for rows grouped by counts, the counts [G*E] (``ids_from_counts``)
    roles: list[Role]
    role_names: list[str]
    layouts: list[Layout]
    activations: list[Activation]  # candidates, most likely first
    T: Any  # int or SymInt
    K: int
    d: int
    h: int  # -1 until proven when shapes alone leave it open
    E: int
    # the dtype the experts compute in (``compute_dtype``): the operator's; where the tokens or a weight reach the
    # experts in another dtype (autocast, casts in forward), the rewrite casts them to it, as the region did
    dtype: torch.dtype
    # how the combine weights are applied: hypotheses for prove, the operator's own first
    routings: list[Routing] = dataclasses.field(default_factory=lambda: [OUTPUT_WEIGHTED])
    # the float scalars the region takes as graph values (``torch.SymFloat``: under dynamic shapes Dynamo makes a
    # module's float attributes, gpt-oss's swiglu limit and alpha, inputs of the graph), read here at their values:
    # the rewrite bakes those values into the operator and guards the compiled graph on them
    traced_floats: tuple[fx.Node, ...] = ()


def _routings(cand: Candidate, K: int) -> list[Routing]:
    """Routing hypotheses: the operator's own, and at top-1 where the ids are scattered into a dense [T, E] map of
    the weights (``Candidate.quiet``: Llama 4's router scores, which multiply the tokens before every expert), the
    weights on the tokens, raw or through a sigmoid (where the region calls one)."""
    if K != 1 or not cand.quiet:
        return [OUTPUT_WEIGHTED]
    fns = [None] + (["sigmoid"] if any(canonical_name(n) == "sigmoid" for n in cand.nodes) else [])
    return [OUTPUT_WEIGHTED] + [Routing(fn, on_input=True) for fn in fns]


def _families(params: list[fx.Node], name_of: dict[fx.Node, str]) -> dict[str, list[tuple[int, fx.Node]]] | str:
    """ModuleList experts: parameters whose names differ only in the expert's index form one family,
    ordered by that index. The index is the number position (counted from the end of the name) at
    which every family holds same-shaped parameters, as many in each."""
    if not params:
        return {}
    numbers = {p: list(re.finditer(r"\d+", name_of[p])) for p in params}
    depth = min(len(m) for m in numbers.values())
    for j in range(1, depth + 1):
        trial: dict[str, list[tuple[int, fx.Node]]] = {}
        for p in params:
            m = numbers[p][-j]
            name = name_of[p]
            trial.setdefault(name[: m.start()] + "#" + name[m.end():], []).append((int(m.group()), p))
        sizes = {len(v) for v in trial.values()}
        if len(sizes) == 1 and sizes.pop() > 1 and all(
            len({tuple(example_value(p).shape) for _, p in v}) == 1 for v in trial.values()
        ):
            return trial
    return ("the per-expert parameters do not form families (one tensor of each expert per role); give every "
            "expert the same parameters (one nn.Linear per role)")


def _static_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The node's shape in ints (a size Dynamo has already specialised to a constant counts as one, and reading it adds
    no guard), or None where a size is symbolic."""
    shape = example_value(node).shape
    return tuple(int(s) for s in shape) if all(is_concrete_int(s) for s in shape) else None


def _param_roles(params: list[fx.Node], name_of: dict[fx.Node, str]) -> tuple[list[Role], list[str]] | str:
    shapes = {p: _static_shape(p) for p in params}
    dynamic = [p for p in params if shapes[p] is None]
    if dynamic:  # plain tensors under dynamic=True (parameters are static unless force_parameter_static_shapes is off)
        return (f"the expert weights {[name_of[p] for p in dynamic]} have dynamic sizes "
                f"{[tuple(str(s) for s in example_value(p).shape) for p in dynamic]}; the operator needs E, h and d "
                "fixed: mark each weight static (torch._dynamo.mark_static(w)) or mark only the token dimension "
                "dynamic (torch._dynamo.mark_dynamic(x, 0)) instead of compiling with dynamic=True")
    by_rank: dict[int, list[fx.Node]] = {}
    for p in params:
        by_rank.setdefault(example_value(p).dim(), []).append(p)
    other = [p for r, ps in by_rank.items() if r not in (1, 2, 3) for p in ps]
    if other:
        return (f"expert parameters of unsupported rank: {[tuple(example_value(p).shape) for p in other]}; store "
                "each expert weight as [E, out, in] (or one nn.Linear per expert)")
    roles: list[Role] = [Role([p], shapes[p]) for p in by_rank.get(3, [])]
    names = [name_of[p] for p in by_rank.get(3, [])]
    # 2-D: [E, n] biases beside 3-D weights, else the per-expert weights of a ModuleList
    per_expert = by_rank.get(2, [])
    if roles:
        for p in per_expert:
            roles.append(Role([p], (*shapes[p], 1), bias=True))
            names.append(name_of[p])
        per_expert = []
    for group, bias in ((per_expert, False), (by_rank.get(1, []), True)):
        fam = _families(group, name_of)
        if isinstance(fam, str) and bias and by_rank.get(3):
            return (f"the region reads {[name_of[p] for p in group]} {[shapes[p] for p in group]} beside the stacked "
                    f"expert weights {[name_of[p] for p in by_rank[3]]}: a 1-D tensor is neither a weight nor a bias "
                    "of stacked experts, so the region computes another function than the operator's. A per-expert "
                    "scale of the combine weights (Gemma 4's router.per_expert_scale) is left outside when it "
                    "multiplies the routing weights before the experts read them; otherwise nothing can be changed")
        if isinstance(fam, str):
            return fam
        for skeleton, members in fam.items():
            members.sort(key=lambda m: m[0])
            shape = shapes[members[0][1]]
            roles.append(Role([p for _, p in members], (len(members), *shape, 1) if bias else (len(members), *shape),
                              bias=bias))
            names.append(skeleton.replace("#", "*"))
    return roles, names


def _stem(name: str) -> str:
    # a parametrized parameter (torch.nn.utils.parametrize, e.g. a cast in forward) by its own name:
    # experts.parametrizations.down_proj_bias.original -> experts.down_proj_bias
    name = re.sub(r"parametrizations[._]([^.]+)[._]original\d*$", r"\1", name)
    return re.sub(r"[._]?(weight|bias)$", "", name)


def _layouts(roles: list[Role], names: list[str], d: int) -> tuple[list[Layout], int] | str:
    weights = [i for i, r in enumerate(roles) if not r.bias]
    biases = [i for i, r in enumerate(roles) if r.bias]
    experts = {r.shape[0] for r in roles}
    if len(experts) != 1:
        return f"expert parameters disagree on the number of experts: {sorted(experts)}; nothing can be changed"
    layouts: list[Layout] = []
    hs: set[int] = set()

    def down_options(i: int):  # (transposed, h)
        _, r, c = roles[i].shape
        if r == d:
            yield False, c
        if c == d:
            yield True, r

    def in_options(i: int, out: int):  # transposed flags for a [*, out, d] projection
        _, r, c = roles[i].shape
        if (r, c) == (out, d):
            yield False
        if (c, r) == (out, d):
            yield True

    if len(weights) == 2:
        for down in weights[::-1]:
            gu = weights[0] if down == weights[1] else weights[1]
            for down_t, h in down_options(down):
                for t in in_options(gu, 2 * h):  # gate and up fused: halves or interleaved rows
                    for g, u in (("first", "second"), ("even", "odd")):
                        layouts.append(Layout(Part(gu, t, g), Part(gu, t, u), Part(down, down_t)))
                        hs.add(h)
                for t in in_options(gu, h):  # a plain activation
                    layouts.append(Layout(Part(gu, t), None, Part(down, down_t)))
                    hs.add(h)
    elif len(weights) == 3:
        for down in weights[::-1]:
            rest = [i for i in weights if i != down]
            for down_t, h in down_options(down):
                for gate, up in (rest, rest[::-1]):
                    for gate_t, up_t in itertools.product(in_options(gate, h), in_options(up, h)):
                        layouts.append(Layout(Part(gate, gate_t), Part(up, up_t), Part(down, down_t)))
                        hs.add(h)
    else:
        return (f"expected 2 or 3 expert weights (gate|up and down, or gate, up and down); found {len(weights)}: "
                "another expert function than the operator's, nothing can be changed")
    if not layouts:
        return (f"no layout fits the expert weight shapes {[roles[i].shape for i in weights]} with d = {d}; nothing "
                "can be changed")
    if biases:  # a bias belongs to the weight of the same name and is cut as that weight is
        with_bias = []
        for lay in layouts:
            fields = {f"{field}_bias": Part(b, False, part.piece)
                      for b in biases for field, part in zip(("gate", "up", "down"), lay.parts[:3])
                      if part is not None and _stem(names[part.role]) == _stem(names[b])
                      and roles[b].shape[1] == roles[part.role].shape[2 if part.t else 1]}
            if {p.role for p in fields.values()} == set(biases):
                with_bias.append(dataclasses.replace(lay, **fields))
        if not with_bias:
            return (f"the expert biases {[names[b] for b in biases]} do not match the expert weights "
                    f"{[names[i] for i in weights]} by name and size; name each bias after its weight "
                    "(w1.weight and w1.bias)")
        layouts = with_bias
    # where several hidden sizes fit (d == h, say), prove decides and sets Extraction.h
    return layouts, hs.pop() if len(hs) == 1 else -1


def _constants(node: fx.Node) -> list[float]:
    """The node's number arguments: literals, and traced floats at their values (:func:`traced_floats`)."""
    out = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out.append(float(a))
        elif isinstance(a, fx.Node) and (value := float_hint(a)) is not None:
            out.append(value)
    return out


def float_hint(node: fx.Node) -> float | None:
    """The value a traced float (a node whose example value is a ``torch.SymFloat``) has in this compile, or None
    (not a traced float, or one without a value: data-dependent)."""
    val = example_value(node)
    hint = getattr(val.node, "hint", None) if isinstance(val, torch.SymFloat) else None
    return None if hint is None else float(hint)


# Elementwise functions that give an expert activation its shape. A region may call only those its activation
# accounts for: one that calls another (a clamp beside silu, a tanh soft-cap, the tanh-approximated GELU) computes
# another function, which a numerical check at small pre-activations can miss (a clamp at 10 is never reached there).
_TANH_GELU = "gelu(approximate='tanh')"  # how the tanh-approximated GELU is named here (_shaping_name)
_CLAMP_CALLS = {"clamp", "clamp_min", "clamp_max", "clip"}  # those whose bounds are constants
_CLAMPS = _CLAMP_CALLS | {"minimum", "maximum", "hardtanh"}
_SHAPING = _CLAMPS | {
    "silu", "sigmoid", "gelu", _TANH_GELU, "relu", "relu6", "leaky_relu", "elu", "selu", "celu",
    "mish", "hardswish", "hardsigmoid", "softplus", "softsign", "logsigmoid", "tanh", "tanhshrink", "erf", "erfc",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "square", "sqrt", "rsqrt", "reciprocal", "abs", "sign",
    "sin", "cos"}
_ACCOUNTED = {"swiglu": {"silu", "sigmoid"}, "silu": {"silu", "sigmoid"}, "geglu": {"gelu"}, "gelu": {"gelu"},
              "geglu_tanh": {_TANH_GELU}, "gelu_tanh": {_TANH_GELU}, "relu": {"relu"},
              "swiglu_oai": _CLAMPS | {"sigmoid"}, "swiglu_clamp": _CLAMPS | {"silu", "sigmoid"},
              "swiglu_softcap": {"tanh", "sigmoid"},
              "relu2": {"relu", "square", "pow"}}


def _bounds(node: fx.Node) -> list[float]:
    """A clamp's finite constant bounds; an infinite one (Step-3.7's unclamped layers) bounds nothing."""
    return [c for c in _constants(node) if math.isfinite(c)]


def _no_op_clamp(node: fx.Node) -> bool:
    """A clamp whose every bound is a constant infinity (or None): the identity."""
    return (canonical_name(node) in _CLAMP_CALLS and not _bounds(node)
            and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())))


def _shaping_name(node: fx.Node) -> str:
    name = canonical_name(node)
    if name == "gelu" and (node.kwargs.get("approximate") or (node.args[1:2] or ["none"])[0]) != "none":
        return _TANH_GELU
    return name


def _on_floats(node: fx.Node) -> bool:
    """Whether the node computes floats: a clamp of the expert ids (transformers 5.17's batched_mm) shapes no
    activation, and its bounds are no clamp limit."""
    return isinstance(val := example_value(node), torch.Tensor) and val.is_floating_point()


def _shaping(cand: Candidate) -> set[str]:
    """The activation-shaping functions the region calls on floats."""
    return {name for n in cand.nodes if (name := _shaping_name(n)) in _SHAPING and not _no_op_clamp(n)
            and _on_floats(n)}


def traced_floats(cand: Candidate) -> tuple[fx.Node, ...]:
    """The float scalars traced as graph values (``torch.SymFloat``) that the region's nodes take as arguments, in
    graph order: the values the region computes with beyond its tensors."""
    found: dict[fx.Node, None] = {}
    for n in cand.nodes:
        for a in (*n.args, *n.kwargs.values()):
            if isinstance(a, fx.Node) and isinstance(example_value(a), torch.SymFloat):
                found[a] = None
    return tuple(found)


def unaccounted(cand: Candidate, act: Activation) -> list[str]:
    """The activation-shaping functions the region calls that ``act`` does not compute."""
    return sorted(_shaping(cand) - _ACCOUNTED[act.name])


def _softcap(tanh: fx.Node) -> float | None:
    """The cap c of a soft-cap ``tanh(v / c) * c`` from its tanh's argument (``v / c`` or ``v * (1 / c)``); None
    when that is not a division or product by one constant. (The product by c after it is left to the proof.)"""
    arg = tanh.args[0] if tanh.args else None
    if not isinstance(arg, fx.Node) or len(consts := _constants(arg)) != 1 or consts[0] == 0:
        return None
    name = canonical_name(arg)
    if name in ("truediv", "div") and not isinstance(arg.args[1], fx.Node):
        return consts[0]
    return 1.0 / consts[0] if name in ("mul", "mul_") else None


def _activations(cand: Candidate, gated: bool) -> list[Activation]:
    """Activation candidates from the functions the region calls, each accounting for every activation-shaping
    function the region calls."""
    nodes = {canonical_name(n): n for n in cand.nodes}
    found: list[Activation] = []
    clamps = [c for n in cand.nodes if canonical_name(n) in _CLAMP_CALLS
              and _on_floats(n) for c in _bounds(n)]
    if gated and "sigmoid" in nodes and clamps:
        sig_in = nodes["sigmoid"].args[0]
        alpha = next(iter(_constants(sig_in)), 1.0) if isinstance(sig_in, fx.Node) and canonical_name(sig_in) in (
            "mul", "mul_") else 1.0
        found.append(Activation("swiglu_oai", alpha, max(abs(c) for c in clamps)))
    # DeepSeek-V4's clamp comes before the SiLU: one after it (Step-3.7's silu(gate).clamp(max=L)) is another
    # function, whose difference at the limit (L against silu(L)) is near the float32 proof's tolerance
    if gated and clamps and any(fn in nodes and isinstance(arg := nodes[fn].args[0], fx.Node)
                                and canonical_name(arg) in _CLAMPS for fn in ("silu", "sigmoid")):
        found.append(Activation("swiglu_clamp", 1.0, max(abs(c) for c in clamps)))
    # Inkling 2: softcap(gate) * sigmoid(gate) * softcap(up), tanh soft-caps (two an expert in a per-expert loop)
    # with at most two caps; which one is the gate's is left to the proof
    caps = {_softcap(n) for n in cand.nodes if canonical_name(n) == "tanh" and _on_floats(n)}
    if gated and "sigmoid" in nodes and 1 <= len(caps) <= 2 and None not in caps and all(c > 0 for c in caps):
        first, *rest = sorted(caps)
        second = rest[0] if rest else first
        found += [Activation("swiglu_softcap", first, second)] + (
            [Activation("swiglu_softcap", second, first)] if rest else [])
    if "gelu" in nodes:  # exact or tanh-approximated (Gemma 4): the one the region calls is accounted for
        found.append(Activation("geglu" if gated else "gelu"))
        found.append(Activation("geglu_tanh" if gated else "gelu_tanh"))
    if "relu" in nodes and not gated:
        found.append(Activation("relu"))
        found.append(Activation("relu2"))  # Nemotron-H: relu(x) ** 2, spelled with square, pow or a product
    if "silu" in nodes or "sigmoid" in nodes:
        found.append(Activation("swiglu" if gated else "silu"))
    return [act for act in found if not unaccounted(cand, act)]


def ids_from_counts(counts: torch.Tensor, x: torch.Tensor, experts: int) -> torch.Tensor:
    """The ids ``[N, 1]`` of rows ``x`` [N, d] grouped by ``counts`` [G*E]: row r is in group j where
    ``offs[j-1] <= r < offs[j]`` (``offs = cumsum(counts)``), and group j holds expert ``j % E`` (G groups of the E
    experts: one group when the rows are expert-major, one per source rank when rank-major, as the token all-to-all
    of expert parallelism leaves them). Rows past the last offset get E, "no expert". Static shapes, no host sync."""
    offs = torch.cumsum(counts.reshape(-1), 0)
    group = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype), right=True)
    return torch.where(group < offs.shape[0], group.remainder(experts), experts).reshape(-1, 1)


def unit_weights(x: torch.Tensor) -> torch.Tensor:
    """Combine weights ``[N, 1]`` of ones for rows ``x`` [N, d] (each row goes to one expert, unweighted)."""
    return x.new_ones((x.shape[0], 1))


def _plain_weights(inputs: list[fx.Node], name_of: dict[fx.Node, str]) -> list[fx.Node]:
    """Graph inputs that are plain tensors rather than parameters and may be stacked expert weights: float
    ``[E, rows, cols]`` placeholders (a function compiled with the weights as arguments). Named in ``name_of``; the
    roles, the layouts and the proof judge them as they judge parameters (a tensor that is not an expert weight makes
    the proof fail). Gradients reach them as they reach any graph input."""
    plain = [n for n in inputs if n.op == "placeholder" and isinstance(example_value(n), torch.Tensor)
             and example_value(n).is_floating_point() and example_value(n).dim() == 3]
    for n in plain:
        name_of.setdefault(n, re.sub(r"^L_|_$", "", str(n.target)))
    return plain


def _extract_counts_grouped(cand: Candidate, params: set[fx.Node], name_of: dict[fx.Node, str]) -> Extraction | str:
    """Rows grouped by counts (``Candidate.counts_grouped``): the region reads rows [N, d], the counts and the expert
    parameters; the operator's ids come from the counts, its weights are ones."""
    counts_val, out_val = example_value(cand.ids), example_value(cand.output)
    if counts_val.dim() != 1 or counts_val.is_floating_point() and counts_val.requires_grad:
        return (f"the group counts have shape {tuple(counts_val.shape)}; expected one count per group [G*E]; "
                "nothing can be changed")
    N, d = out_val.shape
    body = set(cand.nodes)
    param_inputs = [n for n in cand.inputs if n in params]
    data = [n for n in cand.inputs if n is not cand.ids and n not in params
            and isinstance(example_value(n), torch.Tensor)
            and not all(u not in body or canonical_name(u) in SHAPE_ONLY_NAMES for u in n.users)]
    rows = [n for n in data if example_value(n).is_floating_point() and same_size(example_value(n).shape[-1], d)
            and same_size(example_value(n).numel(), N * d)]
    if len(rows) == 1:
        plain = _plain_weights([n for n in data if n is not rows[0]], name_of)
        data = [n for n in data if n not in plain]
        param_inputs += plain
    if len(data) != 1 or not example_value(data[0]).is_floating_point() or not (
            same_size(example_value(data[0]).shape[-1], d) and same_size(example_value(data[0]).numel(), N * d)):
        return (f"expected the grouped experts to read rows [N, d] besides the counts and parameters; they read "
                f"{[(n.name, tuple(example_value(n).shape)) for n in data]}: another function than the operator's, "
                "nothing can be changed")
    if not param_inputs:
        return ("the grouped experts read no expert weights the operator can take; make them parameters of the "
                "module (nn.Parameter) or pass them as stacked [E, out, in] tensors")
    found = _param_roles(param_inputs, name_of)
    if isinstance(found, str):
        return found
    roles, role_names = found
    E = int(roles[0].shape[0])
    if isinstance(counts_val.shape[0], int) and counts_val.shape[0] % E:
        return (f"{counts_val.shape[0]} group counts for {E} experts: the groups are not whole rounds of the "
                "experts, nothing can be changed")
    found = _layouts_and_activations(cand, roles, role_names, int(d), example_value(data[0]).dtype)
    if isinstance(found, str):
        return found
    layouts, h, activations, dtype, floats = found
    return Extraction(x=data[0], weights=None, ids=cand.ids, roles=roles, role_names=role_names, layouts=layouts,
                      activations=activations, T=N, K=1, d=int(d), h=h, E=E, dtype=dtype, traced_floats=floats)


def _layouts_and_activations(cand: Candidate, roles: list[Role], role_names: list[str], d: int,
                             x_dtype: torch.dtype
                             ) -> tuple[list[Layout], int, list, torch.dtype, tuple[fx.Node, ...]] | str:
    """(the layouts whose gatedness a supported activation matches, h, those activations (gated first), the dtype the
    experts compute in, the region's :func:`traced_floats`), or the reason there are none."""
    lay = _layouts(roles, role_names, d)
    if isinstance(lay, str):
        return lay
    layouts, h = lay
    floats = traced_floats(cand)
    unknown = [n.name for n in floats if float_hint(n) is None]
    if unknown:  # (the others are taken at their values, and the graph guarded on them)
        return (f"the experts read floats computed from tensors in the graph ({', '.join(unknown)}: no value in this "
                "compile) where the operator needs constants; make them Python floats (a module attribute, a "
                "constant)")
    activations = {gated: _activations(cand, gated) for gated in (True, False)}
    layouts = [lay for lay in layouts if activations[lay.up is not None]]
    if not layouts:
        called = sorted(_shaping(cand))
        return ("no supported expert activation (SwiGLU, GeGLU, the clamped SwiGLUs of gpt-oss and DeepSeek-V4, "
                "Inkling 2's soft-capped SwiGLU, SiLU, GELU, ReLU, squared ReLU; GELU exact or tanh) computes what "
                f"the experts call: {', '.join(called) or 'no activation function'}; nothing can be changed short of "
                "using one of those")
    dtype = compute_dtype(cand, x_dtype)
    if dtype not in _COMPUTE_DTYPES:
        return (f"the experts compute in {dtype}, which the operator does not support ({_COMPUTE_DTYPES}); cast the "
                "tokens and expert weights to one of those")
    return layouts, h, activations[True] + activations[False], dtype, floats


def extract(cand: Candidate, params: set[fx.Node], name_of: dict[fx.Node, str]) -> Extraction | str:
    """An :class:`Extraction`, or the reason the candidate cannot be one."""
    if cand.counts_grouped:
        return _extract_counts_grouped(cand, params, name_of)
    ids = cand.ids
    ids_val = example_value(ids)
    out_val = example_value(cand.output)
    if not isinstance(ids_val, torch.Tensor) or not isinstance(out_val, torch.Tensor):
        return "the region's ids or output are not tensors; nothing can be changed"
    K = ids_val.shape[-1]
    T = math.prod(ids_val.shape[:-1]) if ids_val.dim() > 1 else None
    if T is None:
        return f"expert ids have shape {tuple(ids_val.shape)}; expected [..., K]; nothing can be changed"
    d = out_val.shape[-1]
    if isinstance(d, torch.SymInt) or isinstance(K, torch.SymInt):
        return ("the model dimension d or top-k K is symbolic; only the token count may be dynamic. Mark only the "
                "token dimension dynamic (torch._dynamo.mark_dynamic(x, 0)) or compile with dynamic=False")

    body = set(cand.nodes)
    data_inputs = []
    param_inputs = []
    for node in cand.inputs:
        if node is ids:
            continue
        if node in params:
            param_inputs.append(node)
            continue
        val = example_value(node)
        if not isinstance(val, torch.Tensor):
            continue  # sizes and other scalars are replayed as they are
        if all(u not in body or canonical_name(u) in SHAPE_ONLY_NAMES for u in node.users):
            continue  # read only for its shape
        data_inputs.append(node)

    floats = [n for n in data_inputs if example_value(n).is_floating_point()]
    others = [n for n in data_inputs if not example_value(n).is_floating_point()]
    if others:
        return (f"the region reads non-float tensors other than the ids: {[n.name for n in others]}; the operator "
                "reads only tokens, combine weights, ids and expert weights: nothing can be changed")
    xs = [n for n in floats if same_size(example_value(n).shape[-1], d) and same_size(example_value(n).numel(), T * d)]
    ws = [n for n in floats if n not in xs and same_size(example_value(n).numel(), T * K)
          and (example_value(n).dim() == 1 or any(same_size(example_value(n).shape[-1], c) for c in (K, 1)))]
    if len(xs) == 1 and len(ws) == 1:
        plain = _plain_weights([n for n in floats if n not in (xs[0], ws[0])], name_of)
        floats = [n for n in floats if n not in plain]
        param_inputs += plain
    if len(xs) != 1 or len(ws) != 1 or len(floats) != 2:
        return (f"expected the region to read tokens [T, d] and combine weights [T, K] besides the ids and "
                f"parameters; it reads {[(n.name, tuple(example_value(n).shape)) for n in floats]}: another "
                "function than the operator's, nothing can be changed")
    if not param_inputs:
        return ("the region reads no expert weights it can take; make them parameters of the module (nn.Parameter; "
                "under torch.func.functional_call, the module's own parameters) or stacked [E, out, in] tensors")
    found = _param_roles(param_inputs, name_of)
    if isinstance(found, str):
        return found
    roles, role_names = found
    found = _layouts_and_activations(cand, roles, role_names, d, example_value(xs[0]).dtype)
    if isinstance(found, str):
        return found
    layouts, h, activations, dtype, floats = found
    return Extraction(
        x=xs[0], weights=ws[0], ids=ids, roles=roles, role_names=role_names, layouts=layouts,
        activations=activations, T=T, K=int(K), d=int(d), h=h, E=int(roles[0].shape[0]),
        dtype=dtype, routings=_routings(cand, int(K)), traced_floats=floats,
    )


_COMPUTE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # the operator's dtypes


def compute_dtype(cand: Candidate, default: torch.dtype) -> torch.dtype:
    """The dtype the region's expert products compute in: the narrowest float dtype among their recorded values.
    Autocast shows there: Dynamo records ``linear``/``bmm``/``matmul`` under an autocast entered outside the compiled
    function with the autocast dtype (the casts happen at dispatch; the graph holds no autocast node), as it records
    explicit casts (torchtitan's ``.bfloat16()`` of the tokens and each weight). A library's custom op that autocast
    does not reach (transformers' ``grouped_mm_fallback``, which casts to the weights' dtype) keeps its own dtype.
    ``default`` (the tokens' dtype) where no product has a recorded float value."""
    dtypes = [v.dtype for n in cand.nodes if role(n) in ("grouped_mm", "matmul")
              and isinstance(v := example_value(n), torch.Tensor) and v.is_floating_point()]
    return min(dtypes, key=lambda t: torch.finfo(t).bits, default=default)


def idiom(cand: Candidate) -> str:
    """A short name for how the region is spelled, from the roles of its nodes."""
    names = {canonical_name(n) for n in cand.nodes}
    roles = {role(n) for n in cand.nodes}
    if cand.counts_grouped:
        return "grouped_mm over rows grouped by counts"
    if "transformers::grouped_mm_fallback" in names:
        kind = "grouped_mm (transformers fallback)"
    elif "grouped_mm" in roles:
        kind = "grouped_mm"
    elif "bmm" in names:
        kind = "batched_mm over gathered weights"
    elif "matmul" in roles:
        kind = "per-expert loop"
    else:
        kind = "unknown"
    how = [n for n in ("sort", "argsort", "one_hot", "where", "nonzero", "histc", "bincount", "split") if n in names]
    combine = [n for n in ("index_add", "index_put", "scatter_add", "functional_setitem") if n in names]
    detail = "+".join(how + combine)
    return f"{kind} [{detail}]" if detail else kind
