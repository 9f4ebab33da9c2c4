"""Step 3: extract what a candidate region computes with.

From the region's external inputs: the tokens ``x``, the combine ``weights``, the ``ids``, and the
expert parameters, grouped into *roles* (one ``[E, r, c]`` tensor per role: a 3-D parameter, or the
same parameter of every expert of a ``ModuleList`` stacked). Then the layout hypotheses: each a
recipe that builds the operator's ``w_gate_up [E, 2h, d]`` and ``w_down [E, d, h]`` from the roles.
Shapes alone rule most hypotheses out; ``prove`` picks among the rest by computing.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .find import SHAPE_ONLY_NAMES, Candidate, example_value, same_size

from .normalize import canonical_name, role

__all__ = ["Extraction", "Role", "Layout", "extract"]


@dataclasses.dataclass
class Role:
    """One expert weight for all experts: a 3-D parameter, or E 2-D parameters to stack."""

    params: list[fx.Node]  # one node ([E, r, c]) or E nodes ([r, c]) in expert order
    shape: tuple[int, int, int]  # [E, r, c]

    @property
    def stacked(self) -> bool:
        return len(self.params) > 1 or example_value(self.params[0]).dim() == 2


@dataclasses.dataclass
class Layout:
    """How the operator's weights are made from the roles.

    ``gate``/``up`` (or ``gate_up``) and ``down`` name roles; ``*_t`` says the role is stored
    transposed (``[E, in, out]``). ``gate_up`` holds gate rows then up rows.
    """

    down: int
    down_t: bool
    gate_up: Optional[int] = None
    gate_up_t: bool = False
    gate: Optional[int] = None
    up: Optional[int] = None
    gate_t: bool = False
    up_t: bool = False

    def describe(self, roles: list[Role], names: list[str]) -> str:
        t = lambda flag: ".T" if flag else ""  # noqa: E731
        if self.gate_up is not None:
            gu = f"{names[self.gate_up]}{t(self.gate_up_t)}"
        else:
            gu = f"cat({names[self.gate]}{t(self.gate_t)}, {names[self.up]}{t(self.up_t)})"
        return f"gate|up = {gu}, down = {names[self.down]}{t(self.down_t)}"

    def build(self, roles: list[Role], values: list[Any], call: Callable[..., Any]) -> tuple[Any, Any]:
        """Build (w_gate_up, w_down) from per-role values with ``call(fn, *args)``: eager or graph nodes."""

        def oriented(i: int, transposed: bool) -> Any:
            v = values[i]
            return call(torch.transpose, v, 1, 2) if transposed else v

        if self.gate_up is not None:
            w_gate_up = oriented(self.gate_up, self.gate_up_t)
        else:
            w_gate_up = call(torch.cat, [oriented(self.gate, self.gate_t), oriented(self.up, self.up_t)], 1)
        return w_gate_up, oriented(self.down, self.down_t)


@dataclasses.dataclass
class Extraction:
    x: fx.Node
    weights: fx.Node
    ids: fx.Node
    roles: list[Role]
    role_names: list[str]
    layouts: list[Layout]
    T: Any  # int or SymInt
    K: int
    d: int
    h: int  # -1 until proven when shapes alone leave it open
    E: int
    dtype: torch.dtype


def _param_roles(params: list[fx.Node], name_of: dict[fx.Node, str]) -> tuple[list[Role], list[str]] | str:
    three_d = [p for p in params if example_value(p).dim() == 3]
    two_d = [p for p in params if example_value(p).dim() == 2]
    other = [p for p in params if example_value(p).dim() not in (2, 3)]
    if other:
        shapes = [tuple(example_value(p).shape) for p in other]
        return f"expert parameters of unsupported rank (biases are not supported yet): {shapes}"
    roles: list[Role] = [Role([p], tuple(example_value(p).shape)) for p in three_d]
    names = [name_of[p] for p in three_d]
    # ModuleList experts: the parameters whose names differ only in the expert's index form one
    # role, ordered by that index. The index is the number position (counted from the end of the
    # name) at which every group holds same-shaped parameters, as many in each group.
    groups: dict[str, list[tuple[int, fx.Node]]] = {}
    if two_d:
        numbers = {p: list(re.finditer(r"\d+", name_of[p])) for p in two_d}
        depth = min(len(m) for m in numbers.values())
        for j in range(1, depth + 1):
            trial: dict[str, list[tuple[int, fx.Node]]] = {}
            for p in two_d:
                m = numbers[p][-j]
                name = name_of[p]
                trial.setdefault(name[: m.start()] + "#" + name[m.end():], []).append((int(m.group()), p))
            sizes = {len(v) for v in trial.values()}
            if len(sizes) == 1 and sizes.pop() > 1 and all(
                len({tuple(example_value(p).shape) for _, p in v}) == 1 for v in trial.values()
            ):
                groups = trial
                break
        if not groups:
            return "the 2-D expert parameters do not form per-expert families (one weight of each expert per role)"
    for skeleton, members in groups.items():
        members.sort(key=lambda m: m[0])
        shapes = {tuple(example_value(p).shape) for _, p in members}
        if len(shapes) != 1:
            return f"the experts' {skeleton} parameters differ in shape: {sorted(shapes)}"
        r, c = shapes.pop()
        roles.append(Role([p for _, p in members], (len(members), r, c)))
        names.append(skeleton.replace("#", "*"))
    return roles, names


def _layouts(roles: list[Role], d: int) -> tuple[list[Layout], int] | str:
    experts = {r.shape[0] for r in roles}
    if len(experts) != 1:
        return f"expert parameters disagree on the number of experts: {sorted(experts)}"
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

    if len(roles) == 2:
        for down in (1, 0):
            gu = 1 - down
            for down_t, h in down_options(down):
                for gu_t in in_options(gu, 2 * h):
                    layouts.append(Layout(down=down, down_t=down_t, gate_up=gu, gate_up_t=gu_t))
                    hs.add(h)
    elif len(roles) == 3:
        for down in (2, 1, 0):
            rest = [i for i in range(3) if i != down]
            for down_t, h in down_options(down):
                for gate, up in (rest, rest[::-1]):
                    for gate_t, up_t in itertools.product(in_options(gate, h), in_options(up, h)):
                        layouts.append(Layout(down=down, down_t=down_t, gate=gate, up=up, gate_t=gate_t, up_t=up_t))
                        hs.add(h)
    else:
        return f"expected 2 or 3 expert weights (gate|up and down, or gate, up and down); found {len(roles)}"
    if not layouts:
        shapes = [r.shape for r in roles]
        return f"no SwiGLU layout fits the expert weight shapes {shapes} with d = {d}"
    # where several hidden sizes fit (d == h, say), prove decides and sets Extraction.h
    return layouts, hs.pop() if len(hs) == 1 else -1


def extract(cand: Candidate, params: set[fx.Node], name_of: dict[fx.Node, str]) -> Extraction | str:
    """An :class:`Extraction`, or the reason the candidate cannot be one."""
    ids = cand.ids
    ids_val = example_value(ids)
    out_val = example_value(cand.output)
    if not isinstance(ids_val, torch.Tensor) or not isinstance(out_val, torch.Tensor):
        return "the region's ids or output are not tensors"
    K = ids_val.shape[-1]
    T = math.prod(ids_val.shape[:-1]) if ids_val.dim() > 1 else None
    if T is None:
        return f"expert ids have shape {tuple(ids_val.shape)}; expected [..., K]"
    d = out_val.shape[-1]
    if isinstance(d, torch.SymInt) or isinstance(K, torch.SymInt):
        return "the model dimension d or top-k K is symbolic; only the token count may be dynamic"

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
        return f"the region reads non-float tensors other than the ids: {[n.name for n in others]}"
    xs = [n for n in floats if same_size(example_value(n).shape[-1], d) and same_size(example_value(n).numel(), T * d)]
    ws = [n for n in floats if n not in xs and same_size(example_value(n).numel(), T * K)]
    if len(xs) != 1 or len(ws) != 1 or len(floats) != 2:
        return (f"expected the region to read tokens [T, d] and combine weights [T, K] besides the ids and "
                f"parameters; it reads {[(n.name, tuple(example_value(n).shape)) for n in floats]}")
    if not param_inputs:
        return "the region reads no parameters"
    found = _param_roles(param_inputs, name_of)
    if isinstance(found, str):
        return found
    roles, role_names = found
    lay = _layouts(roles, d)
    if isinstance(lay, str):
        return lay
    layouts, h = lay
    x_val = example_value(xs[0])
    if any(example_value(p).dtype != x_val.dtype for r in roles for p in r.params):
        return "the expert weights and the tokens have different dtypes"
    return Extraction(
        x=xs[0], weights=ws[0], ids=ids, roles=roles, role_names=role_names, layouts=layouts,
        T=T, K=int(K), d=int(d), h=h, E=int(roles[0].shape[0]), dtype=x_val.dtype,
    )


def idiom(cand: Candidate) -> str:
    """A short name for how the region is spelled, from the roles of its nodes."""
    names = {canonical_name(n) for n in cand.nodes}
    roles = {role(n) for n in cand.nodes}
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
    how = [n for n in ("sort", "argsort", "one_hot", "where", "nonzero", "histc", "bincount") if n in names]
    combine = [n for n in ("index_add", "index_put", "scatter_add", "functional_setitem") if n in names]
    detail = "+".join(how + combine)
    return f"{kind} [{detail}]" if detail else kind
