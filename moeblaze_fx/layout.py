"""How expert weights are stored: each *role* (gate, up, down and their biases) as a strided view of parameter
storage, and the operator's integer encoding of those views.

The operator takes the expert parameters as they are stored: a list of tensors plus ``layout``, the ints
:func:`encode_layout` makes (E, then 8 ints per role in :data:`ROLES` order). A role is a strided view of one
``[E, ...]`` tensor (fused, transposed, interleaved or separate weights) or the same view of E separate per-expert
tensors (``ModuleList`` experts). ``ops.py`` decodes and checks it; ``passes/extract.py`` encodes what it proved.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy
import torch
from torch import Tensor

from .kernels.reference import ExpertParams

__all__ = ["ROLES", "RoleView", "encode_layout", "decode_layout", "layout_of", "role_value", "dense_experts",
           "dense", "check_layout"]

ROLES = ExpertParams._fields  # gate, up, down, gate_bias, up_bias, down_bias


class RoleView(NamedTuple):
    """One role of every expert as a strided view of parameter storage.

    ``count == 1``: ``params[first]`` holds all experts; expert e's matrix starts ``offset + e*stride_e``
    elements after the parameter's first element. ``count == E``: ``params[first + e]`` holds expert e,
    starting ``offset`` elements after its first element (``stride_e`` unused). A bias is a matrix of
    ``cols == 1``."""

    first: int
    count: int
    offset: int
    stride_e: int
    stride_r: int
    stride_c: int
    rows: int
    cols: int

    def numel(self, num_experts: int) -> int:
        return num_experts * self.rows * self.cols


_ABSENT = (-1, 0, 0, 0, 0, 0, 0, 0)


def encode_layout(num_experts: int, views: Sequence[RoleView | None]) -> list[int]:
    """The operator's ``layout`` argument: E, then 8 ints per role in :data:`ROLES` order (-1 = absent)."""
    if len(views) != len(ROLES):
        raise ValueError(f"encode_layout needs one view (or None) per role {ROLES}, got {len(views)}")
    out = [int(num_experts)]
    for v in views:
        out.extend(_ABSENT if v is None else (int(i) for i in v))
    return out


def decode_layout(layout: Sequence[int]) -> tuple[int, tuple[RoleView | None, ...]]:
    """``(E, views)`` of an encoded layout (cached: every operator call decodes its layout)."""
    try:
        return _decode_layout(tuple(layout))
    except TypeError:  # SymInts under tracing, which do not hash: the layout is static
        return _decode_layout(tuple(int(v) for v in layout))


@functools.lru_cache(maxsize=512)
def _decode_layout(layout: tuple[int, ...]) -> tuple[int, tuple[RoleView | None, ...]]:
    n = len(ROLES) * len(RoleView._fields)
    if len(layout) != 1 + n:
        raise ValueError(f"moeblaze.moe_ffn: layout must hold 1 + {n} ints (see encode_layout), got {len(layout)}")
    views = [RoleView(*layout[1 + 8 * i: 9 + 8 * i]) for i in range(len(ROLES))]
    return int(layout[0]), tuple(None if v.first < 0 else v for v in views)


def layout_of(experts: ExpertParams, within: Sequence[tuple[Tensor, int] | None] | None = None
              ) -> tuple[list[Tensor], list[int]]:
    """``(params, layout)`` for expert tensors given as ``[E, ...]`` tensors or views of them (biases
    ``[E, n]``): each role is described as a view of its base tensor, so gradients reach the base.

    ``within``, per role: None, or ``(tensor, offset)`` when the caller knows the role starts ``offset``
    elements into ``tensor`` with ``tensor``'s strides (``moe_ffn``'s split of a fused gate/up weight).
    It is used while Dynamo traces, which cannot read storage offsets: there a role that is contiguous
    (or is in its last two dimensions transposed) is its own base, a role whose ``within`` tensor is so
    is described in it, and any other role is described through storage offsets, which breaks the graph
    (correct, but more graphs than one)."""
    params: list[Tensor] = []
    views: list[RoleView | None] = []
    E = experts.gate.shape[0]
    compiling = torch.compiler.is_compiling()
    for i, t in enumerate(experts):
        if t is None:
            views.append(None)
            continue
        if t.dim() not in (2, 3) or t.shape[0] != E:
            want = "[E, n]" if ROLES[i].endswith("bias") else "[E, rows, cols]"
            raise ValueError(f"moeblaze.moe_ffn: experts.{ROLES[i]} must be {want} with E = {E} experts (E is "
                             f"experts.gate's first dimension, gate {tuple(experts.gate.shape)}); got shape "
                             f"{tuple(t.shape)}")
        t3 = t if t.dim() == 3 else t.unsqueeze(-1)
        known = None if within is None else within[i]
        if compiling and _contiguous_or_transposed(t):
            base, offset = t, 0
        elif compiling and known is not None and _contiguous_or_transposed(known[0]):
            base, offset = known
        else:
            base = t._base if t._base is not None else t
            offset = t3.storage_offset() - base.storage_offset()
        index = next((j for j, p in enumerate(params) if p is base), None)
        if index is None:
            params.append(base)
            index = len(params) - 1
        views.append(RoleView(index, 1, offset, t3.stride(0), t3.stride(1), t3.stride(2), t3.shape[1], t3.shape[2]))
    return params, encode_layout(E, views)


def _contiguous_or_transposed(t: Tensor) -> bool:
    """Dense in one of the two orders parameters come in; traceable by Dynamo, also on symbolic strides."""
    return t.is_contiguous() or t.transpose(-1, -2).is_contiguous()


def role_value(params: Sequence[Tensor], v: RoleView, E: int, detached: bool = False) -> Tensor | list[Tensor]:
    """The role as an ``[E, rows, cols]`` view (count 1) or a list of E ``[rows, cols]`` views. ``detached``: the
    count-1 view is one of ``detach()`` of the parameter, which holds its memory but not the parameter itself."""
    if v.count == 1:
        p = params[v.first].detach() if detached else params[v.first]
        return p.as_strided((E, v.rows, v.cols), (v.stride_e, v.stride_r, v.stride_c), p.storage_offset() + v.offset)
    return [p.as_strided((v.rows, v.cols), (v.stride_r, v.stride_c), p.storage_offset() + v.offset)
            for p in params[v.first: v.first + v.count]]


def dense(value: Tensor | list[Tensor], is_bias: bool) -> Tensor:
    t = torch.stack(value) if isinstance(value, list) else value
    return t.squeeze(-1) if is_bias else t


def dense_experts(params: Sequence[Tensor], views: Sequence[RoleView | None], E: int) -> ExpertParams:
    """Every role as an ``[E, ...]`` tensor: views where one parameter holds all experts, a stack of
    the per-expert tensors otherwise (the plain-PyTorch path)."""
    return ExpertParams(*[None if v is None else dense(role_value(params, v, E), role.endswith("bias"))
                          for role, v in zip(ROLES, views)])


@functools.lru_cache(maxsize=512)
def check_layout(shapes: tuple, layout: tuple[int, ...]) -> str | None:
    """Why ``layout`` does not fit parameters of ``shapes`` (numel, storage extent), or None."""
    E, views = decode_layout(layout)
    gate, up, down = views[:3]
    if gate is None or down is None:
        return "the layout must give the gate and down roles"
    for role, v in zip(ROLES, views):
        if v is None:
            continue
        if v.count not in (1, E) or v.first + v.count > len(shapes) or v.first < 0:
            return f"role {role!r} names parameters {v.first}..{v.first + v.count - 1} of {len(shapes)}"
        if min(v.offset, v.stride_e, v.stride_r, v.stride_c, v.rows, v.cols) < 0:
            return f"role {role!r} has a negative offset, stride or size: {v}"
        extent = v.offset + (v.rows - 1) * v.stride_r + (v.cols - 1) * v.stride_c + 1
        if v.count == 1:
            extent += (E - 1) * v.stride_e
        for numel in shapes[v.first: v.first + v.count]:
            if v.rows * v.cols > 0 and extent > numel:
                return f"role {role!r} reaches element {extent - 1} of a parameter of {numel} elements"
    # roles sharing a parameter must not overlap: each gradient element is written by one role
    for i, a in enumerate(views):
        for b in views[i + 1:]:
            if a is not None and b is not None and a.first == b.first and _overlap(a, b, E):
                return f"roles overlap in parameter {a.first}: {a} and {b}"
    return None


def _overlap(a: RoleView, b: RoleView, E: int) -> bool:
    ea = E if a.count == 1 else 1
    eb = E if b.count == 1 else 1
    if (a.stride_e, a.stride_r, a.stride_c, a.rows, a.cols) != (b.stride_e, b.stride_r, b.stride_c, b.rows, b.cols) \
            or ea != eb or 0 in (a.stride_c, a.stride_r):
        # different shapes: compare index sets (only small parameters reach this)
        ia = set(_indices(a, ea)) if ea * a.rows * a.cols <= 1 << 22 else None
        return ia is None or any(i in ia for i in _indices(b, eb))
    # same shape and strides: overlap iff offset difference = i*s_e + j*s_r + k*s_c with |i|<E, |j|<rows, |k|<cols
    # (numpy, not torch: this also runs under fake-tensor tracing)
    delta = abs(b.offset - a.offset)
    j = numpy.arange(-a.rows + 1, a.rows, dtype=numpy.int64)
    for e in range(-ea + 1, ea):
        r = delta - e * a.stride_e - j * a.stride_r
        k = numpy.floor_divide(r, a.stride_c)
        if bool(((r - k * a.stride_c == 0) & (numpy.abs(k) < a.cols)).any()):
            return True
    return False


def _indices(v: RoleView, e_count: int):
    for e in range(e_count):
        for r in range(v.rows):
            base = v.offset + e * v.stride_e + r * v.stride_r
            for c in range(v.cols):
                yield base + c * v.stride_c

