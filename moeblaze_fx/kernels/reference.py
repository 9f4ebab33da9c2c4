"""Plain-PyTorch ground truth for every MoEBlaze kernel, and the CPU implementation of the operator.

The operator computes, for tokens ``x [T, d]``, expert ids ``ids [T, K]`` and combine weights
``weights [T, K]``::

    y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])        (ids[t, k] >= E contributes nothing)
    expert_e(v) = act(v @ gate[e].T + gate_bias[e], v @ up[e].T + up_bias[e]) @ down[e].T + down_bias[e]

with ``gate, up [E, h, d]``, ``down [E, d, h]`` and optional biases (:class:`ExpertParams`; ``up`` is
absent for a plain activation), and ``act(gate, up) = silu(gate) * up`` for SwiGLU (see
:data:`ACTIVATIONS` for the others).

Three layers live here:

* ``dispatch_reference`` builds the index structures (the contract the Triton dispatch kernels meet
  bit for bit): per-expert ``offsets [E+1]``, the expert-major ``token_index [T*K]``, the inverse map
  ``slot_of [T*K]`` and the row-tile metadata the grouped GEMMs walk.
* ``moe_ffn_reference`` is the obvious differentiable loop, used as the numerical truth in tests.
* ``moe_ffn_forward_torch`` / ``moe_ffn_backward_torch`` implement the operator's memory policy in
  plain PyTorch (the CPU path, and CUDA's for float64 or without Triton): the forward keeps, under the
  ``"activations"`` policy, the pre-activations ``A|B [T*K, 2h]`` (``[T*K, h]`` for a plain activation);
  never a gathered ``[T*K, d]`` copy of the tokens and never the expert outputs. The backward recomputes
  the activation and ``H`` and takes the routing-weight gradient as ``<dH', H> + <dy, down_bias>`` so the
  expert outputs ``Y`` are not needed. On the CPU they walk the experts (slot ranges read on the host); on
  any other device they walk row tiles of a static count (no host synchronisation).
"""
from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DispatchPlan",
    "max_tiles",
    "dispatch_reference",
    "check_ids",
    "GATED_ACTIVATIONS",
    "PLAIN_ACTIVATIONS",
    "ACTIVATIONS",
    "Activation",
    "parse_activation",
    "ExpertParams",
    "split_gate_up",
    "preact_width",
    "activation_forward",
    "activation_backward",
    "moe_ffn_reference",
    "moe_ffn_forward_torch",
    "moe_ffn_backward_torch",
]


class DispatchPlan(NamedTuple):
    """Index structures of one routing decision. Every tensor is int32 and lives on ids' device.

    A *pair* is one (token, choice) entry ``p = t * K + k`` of ``ids``; a *slot* is its row in the
    expert-major order. Slots ``offsets[e]:offsets[e+1]`` belong to expert ``e``; inside an expert,
    pairs keep ascending ``p`` (so runs are deterministic). Pairs whose id is ``>= E`` get no slot.
    """

    offsets: Tensor  # [E+1]  int32: first slot of each expert; offsets[E] = number of routed pairs
    token_index: Tensor  # [T*K] int32: pair p of each slot; slots >= offsets[E] hold the unrouted pairs, ascending
    slot_of: Tensor  # [T*K] int32: slot of pair p, or -1 when ids.flatten()[p] >= E
    tile_expert: Tensor  # [max_tiles(T*K, E, block_m)] int32: expert of each row tile, -1 past the last tile
    tile_start: Tensor  # [max_tiles(T*K, E, block_m)] int32: first slot of each row tile, offsets[E] past the last


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles of ``block_m`` rows: sum_e ceil(c_e / block_m) <= floor(TK / block_m) + E."""
    return num_pairs // block_m + num_experts


def plan_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, ...]:
    """The lengths of a :class:`DispatchPlan`'s five int32 tensors, in field order."""
    n_tiles = max_tiles(num_pairs, num_experts, block_m)
    return num_experts + 1, num_pairs, num_pairs, n_tiles, n_tiles


def _check_ids(ids: Tensor, num_experts: int) -> None:
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T, K], got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def check_ids(ids: Tensor) -> None:
    """Fail on a negative expert id (the operator's contract: ids >= E mean "no expert", a negative one is a router's
    bug): a ``ValueError`` on the CPU, an asynchronous device assert elsewhere (no host synchronisation). The Triton
    dispatch checks on CUDA inside its first launch instead (``kernels.dispatch.dispatch``, ``check_ids``)."""
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":
        if bool((ids < 0).any()):
            raise ValueError("moeblaze.moe_ffn: ids contain negative expert ids; ids must be >= 0 (>= E means no expert)")
    else:
        torch._assert_async((ids >= 0).all(), "moeblaze.moe_ffn: ids contain negative expert ids")


def dispatch_reference(ids: Tensor, num_experts: int, block_m: int = 64) -> DispatchPlan:
    """Build the :class:`DispatchPlan` with a stable sort (the ground truth the kernels must equal).

    Every size is a function of the shapes (the counts are found by a search in the sorted keys, the tiles
    by a search in the running tile count), so this runs without host synchronisation on any device."""
    _check_ids(ids, num_experts)
    E = num_experts
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    sorted_key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(E + 1, device=dev))  # offsets[e] = #keys < e
    slots = torch.arange(num_pairs, device=dev)
    slot_of = torch.empty(num_pairs, dtype=torch.int64, device=dev)
    slot_of[order] = torch.where(slots < offsets[E], slots, -1)  # order is a permutation: no duplicate writes

    tiles = _row_tiles(offsets, max_tiles(num_pairs, E, block_m), block_m)
    tile_expert = torch.where(tiles.used, tiles.expert, -1)
    tile_start = torch.where(tiles.used, tiles.start, offsets[E])
    i32 = torch.int32
    return DispatchPlan(offsets.to(i32), order.to(i32), slot_of.to(i32), tile_expert.to(i32), tile_start.to(i32))


class _RowTiles(NamedTuple):
    """Row tiles of ``block`` slots over the experts' slot ranges, padded to a static count. Every field is
    ``[n_tiles]`` int64; past the last used tile ``used`` is False and ``expert`` is clamped to ``E - 1``."""

    used: Tensor
    expert: Tensor  # expert of the tile (E - 1 for an unused tile)
    start: Tensor  # first slot of the tile
    end: Tensor  # one past the expert's last slot: the tile's rows are start .. min(start + block, end) - 1


def _row_tiles(offsets: Tensor, n_tiles: int, block: int) -> _RowTiles:
    """Expert ``e`` gets ``ceil(count_e / block)`` consecutive tiles, the experts in order; ``offsets`` is the
    ``[E+1]`` int64 slot offsets. Found by a search in the running tile count (no data-dependent sizes)."""
    E = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles_per_expert = (counts + block - 1) // block
    tile_end = torch.cumsum(tiles_per_expert, 0)  # one past each expert's last tile
    tile = torch.arange(n_tiles, device=offsets.device)
    expert = torch.searchsorted(tile_end, tile, right=True)  # E past the last used tile
    used = expert < E
    expert = expert.clamp(max=E - 1)
    rank = tile - (tile_end - tiles_per_expert)[expert]
    return _RowTiles(used, expert, offsets[expert] + rank * block, offsets[expert + 1])


# ---------------------------------------------------------------------------------------------
# Activations. A gated activation maps the pre-activations (gate, up) [n, h] each to H [n, h]; a
# plain one maps the single pre-activation [n, h] (called ``gate`` here) to H.
# ---------------------------------------------------------------------------------------------
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "swiglu_oai", "swiglu_clamp", "swiglu_softcap")
PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
ACTIVATIONS = GATED_ACTIVATIONS + PLAIN_ACTIVATIONS
# The activations with parameters: the names their spec gives them, in order, and the Activation field each fills.
PARAMETERS = {"swiglu_oai": (("alpha", "alpha"), ("limit", "limit")), "swiglu_clamp": (("limit", "limit"),),
              "swiglu_softcap": (("gate", "alpha"), ("up", "limit"))}
_SPEC = re.compile(r"^(\w+)(?:\(([^()]*)\))?$")


class Activation(NamedTuple):
    """An expert activation. ``swiglu_oai`` is the clamped SwiGLU of gpt-oss:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``;
    ``swiglu_clamp`` the clamped SwiGLU of DeepSeek-V4 and HY-V4: ``silu(clamp(gate, max=limit)) *
    clamp(up, -limit, limit)``; ``swiglu_softcap`` the soft-capped SwiGLU of Inkling 2: ``softcap(gate, alpha) *
    sigmoid(gate) * softcap(up, limit)`` with ``softcap(v, c) = c * tanh(v / c)`` (spec ``swiglu_softcap(gate=A,
    up=L)``); ``relu2`` the squared ReLU of Nemotron-H's (plain) experts: ``relu(gate) ** 2``; ``geglu_tanh`` and
    ``gelu_tanh`` use the tanh-approximated GELU, ``F.gelu(v, approximate="tanh")`` (Gemma 4's
    ``gelu_pytorch_tanh``), where ``geglu`` and ``gelu`` use the exact (erf) one."""

    name: str
    alpha: float = 1.0
    limit: float = 0.0

    @property
    def gated(self) -> bool:
        return self.name in GATED_ACTIVATIONS

    @property
    def spec(self) -> str:
        """The string form the operator takes: ``"swiglu"``, ``"swiglu_oai(alpha=1.702,limit=7.0)"``,
        ``"swiglu_clamp(limit=10.0)"``, ``"swiglu_softcap(gate=4.0,up=25.0)"``."""
        params = PARAMETERS.get(self.name)
        if params is None:
            return self.name
        return f"{self.name}({','.join(f'{key}={getattr(self, field)!r}' for key, field in params)})"


def parse_activation(spec: "str | Activation") -> Activation:
    """``Activation`` from its string form; raises ``ValueError`` naming the supported forms."""
    if isinstance(spec, Activation):
        return spec
    return _parse_activation(spec) if isinstance(spec, str) else _parse_activation.__wrapped__(spec)


@functools.lru_cache(maxsize=128)  # every operator call parses its activation
def _parse_activation(spec: str) -> Activation:
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    name = m and m.group(1)
    params = PARAMETERS.get(name, ())
    keys = [key for key, _ in params]
    given = [item.split("=", 1) for item in m.group(2).split(",")] if m and m.group(2) is not None else []
    if m is None or name not in ACTIVATIONS or [g[0] for g in given] != keys or any(len(g) != 2 for g in given):
        plain = tuple(a for a in ACTIVATIONS if a not in PARAMETERS)
        forms = ", ".join(f"'{n}({','.join(f'{k}={k[0].upper()}' for k, _ in p)})'" for n, p in PARAMETERS.items())
        raise ValueError(f"unknown activation {spec!r}; supported: {plain} and {forms}")
    if not params:
        return Activation(name)
    try:
        values = {field: float(g[1]) for (_, field), g in zip(params, given)}
    except ValueError:
        values = {field: math.nan for _, field in params}
    positive = [(key, field) for key, field in params if field == "limit" or name == "swiglu_softcap"]  # not alpha
    if not all(math.isfinite(v) for v in values.values()) or not all(values[field] > 0 for _, field in positive):
        raise ValueError(f"{name} needs finite parameters, {' and '.join(k for k, _ in positive)} > 0; got {spec!r}")
    return Activation(name, **values)


def _softcap(v: Tensor, cap: float) -> Tensor:
    return torch.tanh(v / cap) * cap


def _gelu_grad(v: Tensor) -> Tensor:
    cdf = 0.5 * (1.0 + torch.erf(v * 0.7071067811865476))
    return cdf + v * torch.exp(-0.5 * v * v) * 0.3989422804014327


def _gelu_tanh_grad(v: Tensor) -> Tensor:
    """The derivative of ``F.gelu(v, approximate="tanh")`` = 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3)."""
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * (v + 0.044715 * v ** 3))
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * 0.044715 * v * v)


def _silu_grad(v: Tensor) -> Tensor:
    sig = torch.sigmoid(v)
    return sig * (1 + v * (1 - sig))


def activation_forward(act: Activation, gate: Tensor, up: Tensor | None) -> Tensor:
    name = act.name
    if name == "swiglu":
        return F.silu(gate) * up
    if name == "geglu":
        return F.gelu(gate) * up
    if name == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if name == "swiglu_oai":
        g = gate.clamp(max=act.limit)
        return (up.clamp(-act.limit, act.limit) + 1) * (g * torch.sigmoid(act.alpha * g))
    if name == "swiglu_clamp":
        return F.silu(gate.clamp(max=act.limit)) * up.clamp(-act.limit, act.limit)
    if name == "swiglu_softcap":
        return _softcap(gate, act.alpha) * torch.sigmoid(gate) * _softcap(up, act.limit)
    if name == "silu":
        return F.silu(gate)
    if name == "gelu":
        return F.gelu(gate)
    if name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    if name == "relu":
        return F.relu(gate)
    if name == "relu2":
        return torch.square(F.relu(gate))
    raise ValueError(f"unknown activation {act!r}")


def activation_backward(act: Activation, gate: Tensor, up: Tensor | None, d_h: Tensor) -> tuple[Tensor, Tensor | None]:
    """Given dL/dH, return (dL/dgate, dL/dup or None), recomputing what the forward computed.
    Clamps pass the gradient where the input lies inside the closed interval (as ``torch.clamp``)."""
    name = act.name
    if name == "swiglu":
        return d_h * up * _silu_grad(gate), d_h * F.silu(gate)
    if name == "geglu":
        return d_h * up * _gelu_grad(gate), d_h * F.gelu(gate)
    if name == "geglu_tanh":
        return d_h * up * _gelu_tanh_grad(gate), d_h * F.gelu(gate, approximate="tanh")
    if name == "swiglu_oai":
        L, a = act.limit, act.alpha
        g = gate.clamp(max=L)
        sig = torch.sigmoid(a * g)
        u1 = up.clamp(-L, L) + 1
        d_gate = d_h * u1 * (sig + a * g * sig * (1 - sig)) * (gate <= L)
        d_up = d_h * (g * sig) * ((up >= -L) & (up <= L))
        return d_gate, d_up
    if name == "swiglu_clamp":
        L = act.limit
        g = gate.clamp(max=L)
        d_gate = d_h * up.clamp(-L, L) * _silu_grad(g) * (gate <= L)
        d_up = d_h * F.silu(g) * ((up >= -L) & (up <= L))
        return d_gate, d_up
    if name == "swiglu_softcap":
        tg, tu, sig = torch.tanh(gate / act.alpha), torch.tanh(up / act.limit), torch.sigmoid(gate)
        d_gate = d_h * (tu * act.limit) * ((1 - tg * tg) * sig + (tg * act.alpha) * sig * (1 - sig))
        d_up = d_h * (tg * act.alpha) * sig * (1 - tu * tu)
        return d_gate, d_up
    if name == "silu":
        return d_h * _silu_grad(gate), None
    if name == "gelu":
        return d_h * _gelu_grad(gate), None
    if name == "gelu_tanh":
        return d_h * _gelu_tanh_grad(gate), None
    if name == "relu":
        return d_h * (gate > 0), None
    if name == "relu2":
        return d_h * 2 * F.relu(gate), None
    raise ValueError(f"unknown activation {act!r}")


# ---------------------------------------------------------------------------------------------
# Expert parameters, dense: what the plain-PyTorch implementation and the reference compute with.
# ---------------------------------------------------------------------------------------------
class ExpertParams(NamedTuple):
    """Every expert's parameters as ``[E, ...]`` tensors (any strides).

    ``up`` is None exactly for the plain activations; a bias left None is absent."""

    gate: Tensor  # [E, h, d]: gate projection (the only up-projection of a plain activation)
    up: Tensor | None  # [E, h, d]
    down: Tensor  # [E, d, h]
    gate_bias: Tensor | None = None  # [E, h]
    up_bias: Tensor | None = None  # [E, h]
    down_bias: Tensor | None = None  # [E, d]


def split_gate_up(w_gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """Views of Hugging Face's ``[E, 2h, d]`` (gate rows, then up rows) as ``([E, h, d], [E, h, d])``."""
    h = w_gate_up.shape[1] // 2
    return w_gate_up[:, :h], w_gate_up[:, h:]


def _project(rows: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    out = rows @ w.t()
    return out if b is None else out + b


def moe_ffn_reference(x: Tensor, ids: Tensor, weights: Tensor, experts: ExpertParams,
                      activation: "str | Activation" = "swiglu") -> Tensor:
    """The obvious differentiable loop over experts; accumulates in float32, returns x's dtype."""
    act = parse_activation(activation)
    E = experts.gate.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    p = experts
    for e in range(E):
        tok, k = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        gate = _project(xe, p.gate[e], None if p.gate_bias is None else p.gate_bias[e])
        up = None if p.up is None else _project(xe, p.up[e], None if p.up_bias is None else p.up_bias[e])
        y = _project(activation_forward(act, gate, up), p.down[e], None if p.down_bias is None else p.down_bias[e])
        out = out.index_add(0, tok, y.to(acc) * weights[tok, k, None].to(acc))
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The operator's plain-PyTorch implementation, following the memory policy. Two formulations of the same
# computation: on the CPU a walk of the experts whose slot ranges are read on the host (nothing to synchronise
# with there, and one matrix product per expert); on any other device (CUDA takes this path for float64, which
# the kernels do not take, or where Triton is missing) row tiles of a static count, each tile gathering its
# expert's weights, so that no size depends on the data and nothing waits for the device.
# ---------------------------------------------------------------------------------------------
def _expert_ranges(plan: DispatchPlan) -> list[tuple[int, int, int]]:
    # a host-side walk of the offsets: the CPU formulation only (a host synchronisation anywhere else)
    off = plan.offsets.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def _bias(b: Tensor | None, e: int) -> Tensor | None:
    return None if b is None else b[e]


def preact_width(experts: ExpertParams) -> int:
    """Columns of the saved pre-activations: gate|up (2h) for a gated activation, h otherwise."""
    h = experts.gate.shape[1]
    return 2 * h if experts.up is not None else h


# Rows of one tile of the tiled formulation: each tile reads its expert's whole weights once, so the weight
# traffic is (T*K / TILE_ROWS + E) times the experts' size; the padding is at most TILE_ROWS - 1 rows per expert.
TILE_ROWS = 64
# Bytes of per-chunk transients of the tiled formulation (the gathered weights dominate, with the backward's
# per-tile weight gradients): a few hundred MB at d = 2048, h = 768 in float64 is 3 tiles a chunk.
TILE_CHUNK_BUDGET = 256 << 20


def _tiles_per_chunk(experts: ExpertParams, acc: torch.dtype, block: int, backward: bool,
                     budget: int = TILE_CHUNK_BUDGET) -> int:
    """Tiles computed at once so that their gathered weights (and, in the backward, their weight-gradient
    partials) and row blocks stay within ``budget`` bytes; at least one."""
    E, h, d = experts.gate.shape
    mats = 3 if experts.up is not None else 2
    item, acc_item = experts.gate.element_size(), torch.empty((), dtype=acc).element_size()
    per_tile = mats * h * d * (item + (acc_item if backward else 0)) + block * (3 * d + 3 * mats * h) * acc_item
    return max(1, budget // max(per_tile, 1))


def _tile_chunks(plan: DispatchPlan, num_pairs: int, block: int, per_chunk: int):
    """Yields ``(expert [C], slots [C, block], valid [C, block])`` over chunks of the row tiles; ``slots`` is
    clamped into range where ``valid`` is False (the rows past an expert's end and the unused tiles)."""
    E = plan.offsets.numel() - 1
    n_tiles = max_tiles(num_pairs, E, block)
    tiles = _row_tiles(plan.offsets.to(torch.int64), n_tiles, block)
    rows = torch.arange(block, device=plan.offsets.device)
    for c0 in range(0, n_tiles, per_chunk):
        c1 = min(c0 + per_chunk, n_tiles)
        slots = tiles.start[c0:c1, None] + rows
        valid = tiles.used[c0:c1, None] & (slots < tiles.end[c0:c1, None])
        yield tiles.expert[c0:c1], slots.clamp(max=num_pairs - 1), valid


def _project_tiles(rows: Tensor, w: Tensor, b: Tensor | None, expert: Tensor) -> Tensor:
    """``rows [C, n, in] @ w[expert].T (+ b[expert])`` with ``w [E, out, in]``: ``[C, n, out]``."""
    out = torch.bmm(rows, w[expert].transpose(1, 2))
    return out if b is None else out + b[expert][:, None, :]


def _masked(valid: Tensor, v: Tensor) -> Tensor:
    """``v [C, n, ...]`` with the invalid rows zero (whatever they held: NaN, inf or unwritten memory)."""
    return torch.where(valid.view(*valid.shape, *([1] * (v.dim() - 2))), v, 0)


def moe_ffn_forward_torch(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: ExpertParams,
    activation: "str | Activation",
    save_preact: bool,
    plan: DispatchPlan | None = None,
) -> tuple[Tensor, Tensor, DispatchPlan]:
    """Returns (y [T, d] in x's dtype, preact [T*K, 2h or h] or [0], plan).

    Per expert (per row tile off the CPU): gather that expert's rows of x (a transient block, freed at once),
    the up projection(s) with their biases, the activation, the down projection, and a weighted accumulation
    into a float32 (float64 for float64) output. ``preact`` (biases included) is written in slot order.
    """
    act = parse_activation(activation)
    if plan is None:
        plan = dispatch_reference(ids, experts.gate.shape[0])
    run = _forward_by_expert if x.device.type == "cpu" else _forward_by_tile
    y, preact = run(x, ids.shape[1], weights, experts, act, save_preact, plan)
    return y, preact, plan


def _forward_by_expert(x, K, weights, experts, act, save_preact, plan):
    T, d = x.shape
    p = experts
    h = p.gate.shape[1]
    tok_of_slot = plan.token_index.to(torch.int64) // K
    w_flat = weights.reshape(-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(T, d, dtype=acc, device=x.device)
    preact = x.new_empty((T * K, preact_width(p)) if save_preact else (0,))
    for e, lo, hi in _expert_ranges(plan):
        tok = tok_of_slot[lo:hi]
        xe = x[tok]
        gate = _project(xe, p.gate[e], _bias(p.gate_bias, e))
        up = None if p.up is None else _project(xe, p.up[e], _bias(p.up_bias, e))
        if save_preact:
            preact[lo:hi, :h] = gate
            if up is not None:
                preact[lo:hi, h:] = up
        y = _project(activation_forward(act, gate, up), p.down[e], _bias(p.down_bias, e))
        scale = w_flat[plan.token_index[lo:hi].to(torch.int64)].to(acc)
        out.index_add_(0, tok, y.to(acc) * scale[:, None])
    return out.to(x.dtype), preact


def _forward_by_tile(x, K, weights, experts, act, save_preact, plan, block=TILE_ROWS, per_chunk=None):
    """The forward over row tiles (no host synchronisation). Scatters go through ``index_put_(accumulate=True)``
    (deterministic on CUDA): the invalid rows add zeros, each slot of ``preact`` gets one value onto zero."""
    T, d = x.shape
    p = experts
    num_pairs = T * K
    w_flat = weights.reshape(-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(T, d, dtype=acc, device=x.device)
    preact = x.new_zeros((num_pairs, preact_width(p)) if save_preact else (0,))
    if num_pairs == 0:
        return out.to(x.dtype), preact
    token_index = plan.token_index.to(torch.int64)
    per_chunk = per_chunk or _tiles_per_chunk(p, acc, block, backward=False)
    for e, slots, valid in _tile_chunks(plan, num_pairs, block, per_chunk):
        pairs = token_index[slots]
        tok = pairs // K
        xe = _masked(valid, x[tok])
        gate = _project_tiles(xe, p.gate, p.gate_bias, e)
        up = None if p.up is None else _project_tiles(xe, p.up, p.up_bias, e)
        if save_preact:
            pre = gate if up is None else torch.cat([gate, up], dim=-1)
            preact.index_put_((slots.flatten(),), _masked(valid, pre).flatten(0, 1), accumulate=True)
        y = _project_tiles(activation_forward(act, gate, up), p.down, p.down_bias, e)
        contrib = _masked(valid, y.to(acc) * w_flat[pairs].to(acc)[..., None])
        out.index_put_((tok.flatten(),), contrib.flatten(0, 1), accumulate=True)
    return out.to(x.dtype), preact


def moe_ffn_backward_torch(
    grad_y: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: ExpertParams,
    preact: Tensor,
    plan: DispatchPlan,
    activation: "str | Activation",
    recompute: bool,
    *,
    phase: str = "all",
    dpre: Tensor | None = None,
    out: ExpertParams | None = None,
) -> tuple[Tensor | None, Tensor | None, ExpertParams | None]:
    """Returns (dx, dweights, grads) with ``grads`` an :class:`ExpertParams` of the gradients of
    ``experts`` (None where ``experts`` has None). ``recompute``: the memory policy; True computes the
    pre-activations again (``preact`` is then the forward's empty tensor), False reads them from ``preact``.

    The routing-weight gradient is ``<dH', H> + <dy, b_down>`` per slot (dH' the gradient H gets with
    weight 1), so the expert outputs are never needed.

    ``phase`` (CPU only) cuts the work into the three calls of the operator's split backward, as
    ``backward.expert_backward`` does: ``"act"`` returns (dA|dB [T*K, width] x.dtype in the plan's slot order,
    rows of unrouted slots zero; dweights; grads with only the down projection's roles); ``"dx"`` takes that dA|dB
    as ``dpre`` and returns (dx, None, None); ``"dw"`` takes it too and returns (None, None, grads with only the
    gate and up roles and their biases). Together they compute bitwise what ``"all"`` does (dA|dB holds each
    expert's dgate|dup in x's dtype, the dtype ``"all"`` computes them in).

    ``out`` (CPU only): tensors of the gradients' shapes and dtypes, any strides (views of the caller's gradient
    buffers), that the roles this call writes are written into (zeroed first, for the experts with no slots)
    instead of new zero-filled ones, so that the caller needs no second copy; ``grads`` then holds them."""
    act = parse_activation(activation)
    if phase not in ("all", "act", "dx", "dw"):
        raise ValueError(f"phase must be one of ('all', 'act', 'dx', 'dw'), got {phase!r}")
    if phase in ("dx", "dw"):
        if dpre is None:
            raise ValueError(f"phase {phase!r} takes the 'act' phase's dA|dB as dpre")
    elif recompute != (preact.dim() == 1):  # the forward's [0] under "recompute", [T*K, width] otherwise
        raise ValueError(f"recompute={recompute} does not match preact of shape {tuple(preact.shape)}")
    if x.device.type == "cpu":
        return _backward_by_expert(grad_y, x, ids.shape[1], weights, experts, preact, plan, act, recompute, phase,
                                   dpre, out)
    if phase != "all" or out is not None:
        raise ValueError(f"phase {phase!r} and out run on the CPU (the walk of the experts), got x on {x.device}; "
                         "use phase='all' without out")
    return _backward_by_tile(grad_y, x, ids.shape[1], weights, experts, preact, plan, act, recompute)


def _backward_by_expert(grad_y, x, K, weights, experts, preact, plan, act, recompute, phase="all", dpre=None,
                        out=None):
    T, d = x.shape
    p = experts
    h = p.gate.shape[1]
    width = 2 * h if p.up is not None else h
    act_phase, dx_phase, dw_phase = phase in ("all", "act"), phase in ("all", "dx"), phase in ("all", "dw")
    tok_of_slot = plan.token_index.to(torch.int64) // K
    w_flat = weights.reshape(-1) if act_phase else None
    acc = torch.promote_types(x.dtype, torch.float32)
    dx = torch.zeros(T, d, dtype=acc, device=x.device) if dx_phase else None
    dweights = torch.zeros(T * K, dtype=acc, device=x.device) if act_phase else None
    roles = {"all": ExpertParams._fields, "act": ("down", "down_bias"), "dx": (),
             "dw": ("gate", "up", "gate_bias", "up_bias")}[phase]
    if out is None:
        out = ExpertParams(*[None if t is None or role not in roles else torch.zeros_like(t)
                             for role, t in zip(ExpertParams._fields, p)])
    elif any((o is None) != (t is None) or o is not None and (o.shape, o.dtype) != (t.shape, t.dtype)
             for role, o, t in zip(ExpertParams._fields, out, p) if role in roles):
        raise ValueError(f"out must hold a tensor of each present parameter's shape and dtype for the roles {roles} "
                         f"of phase {phase!r}: {[None if t is None else (tuple(t.shape), t.dtype) for t in p]}, got "
                         f"{[None if o is None else (tuple(o.shape), o.dtype) for o in out]}")
    else:
        out = ExpertParams(*[o.zero_() if o is not None and role in roles else None
                             for role, o in zip(ExpertParams._fields, out)])
    grads = ExpertParams(*[o if role in roles else None for role, o in zip(ExpertParams._fields, out)])
    ranges = _expert_ranges(plan)
    if phase == "act":  # dA|dB of every routed slot; the unrouted ones (from offsets[E] on) zero
        dpre = x.new_empty((T * K, width))
        dpre[int(plan.offsets[-1]):].zero_()
    for e, lo, hi in ranges:
        tok = tok_of_slot[lo:hi]
        xe = x[tok] if dw_phase or recompute else None
        if act_phase:
            pairs = plan.token_index[lo:hi].to(torch.int64)
            if recompute:
                gate = _project(xe, p.gate[e], _bias(p.gate_bias, e))
                up = None if p.up is None else _project(xe, p.up[e], _bias(p.up_bias, e))
            else:
                gate, up = preact[lo:hi, :h], None if p.up is None else preact[lo:hi, h:]
            hid = activation_forward(act, gate, up)
            dout = grad_y[tok]
            d_hid_unscaled = dout @ p.down[e]  # dH' [n, h]
            dw = (d_hid_unscaled.to(acc) * hid.to(acc)).sum(1)
            if p.down_bias is not None:
                dw = dw + (dout.to(acc) * p.down_bias[e].to(acc)).sum(1)
            dweights[pairs] = dw
            scaled = dout * w_flat[pairs].to(dout.dtype)[:, None]
            grads.down[e] = scaled.t() @ hid
            if grads.down_bias is not None:
                grads.down_bias[e] = scaled.to(acc).sum(0).to(p.down_bias.dtype)
            d_gate, d_up = activation_backward(act, gate, up, d_hid_unscaled * w_flat[pairs].to(dout.dtype)[:, None])
            if phase == "act":
                dpre[lo:hi, :h] = d_gate
                if d_up is not None:
                    dpre[lo:hi, h:] = d_up
                continue
        else:  # the same tensors "all" computes, read back contiguous (the products see the same operands)
            d_gate = dpre[lo:hi, :h].contiguous()
            d_up = None if p.up is None else dpre[lo:hi, h:].contiguous()
        if dw_phase:
            grads.gate[e] = d_gate.t() @ xe
            if grads.gate_bias is not None:
                grads.gate_bias[e] = d_gate.to(acc).sum(0).to(p.gate_bias.dtype)
            if d_up is not None:
                grads.up[e] = d_up.t() @ xe
                if grads.up_bias is not None:
                    grads.up_bias[e] = d_up.to(acc).sum(0).to(p.up_bias.dtype)
        if dx_phase:
            dxe = d_gate @ p.gate[e]
            if d_up is not None:
                dxe = dxe + d_up @ p.up[e]
            dx.index_add_(0, tok, dxe.to(acc))
    if phase == "act":
        return dpre, dweights.view(T, K).to(weights.dtype), grads
    return (None if dx is None else dx.to(x.dtype), None if dweights is None else dweights.view(T, K).to(weights.dtype),
            None if phase == "dx" else grads)


def _backward_by_tile(grad_y, x, K, weights, experts, preact, plan, act, recompute, block=TILE_ROWS,
                      per_chunk=None):
    """The backward over row tiles (no host synchronisation). Each tile's weight gradients are partial sums,
    added per expert in a float32 (float64) buffer in tile order; the invalid rows are zeroed before any product."""
    T, d = x.shape
    p = experts
    h = p.gate.shape[1]
    num_pairs = T * K
    w_flat = weights.reshape(-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    dx = torch.zeros(T, d, dtype=acc, device=x.device)
    dweights = torch.zeros(num_pairs, dtype=acc, device=x.device)
    sums = ExpertParams(*[None if t is None else torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, acc),
                                                             device=t.device) for t in p])
    token_index = plan.token_index.to(torch.int64)
    chunks = _tile_chunks(plan, num_pairs, block, per_chunk or _tiles_per_chunk(p, acc, block, backward=True))
    for e, slots, valid in chunks if num_pairs else ():
        pairs = token_index[slots]
        tok = pairs // K
        xe = _masked(valid, x[tok])
        if recompute:
            gate = _project_tiles(xe, p.gate, p.gate_bias, e)
            up = None if p.up is None else _project_tiles(xe, p.up, p.up_bias, e)
        else:
            pre = _masked(valid, preact[slots])
            gate, up = pre[..., :h], None if p.up is None else pre[..., h:]
        hid = activation_forward(act, gate, up)
        dout = _masked(valid, grad_y[tok])
        d_hid_unscaled = torch.bmm(dout, p.down[e])  # dH' [C, n, h]
        dw = (d_hid_unscaled.to(acc) * hid.to(acc)).sum(-1)
        if p.down_bias is not None:
            dw = dw + (dout.to(acc) * p.down_bias[e][:, None, :].to(acc)).sum(-1)
        dweights.index_put_((pairs.flatten(),), _masked(valid, dw).flatten(), accumulate=True)
        w_pair = _masked(valid, w_flat[pairs].to(dout.dtype))[..., None]
        scaled = dout * w_pair
        sums.down.index_put_((e,), torch.bmm(scaled.transpose(1, 2), hid).to(sums.down.dtype), accumulate=True)
        if sums.down_bias is not None:
            sums.down_bias.index_put_((e,), scaled.to(acc).sum(1).to(sums.down_bias.dtype), accumulate=True)
        d_gate, d_up = activation_backward(act, gate, up, d_hid_unscaled * w_pair)
        d_gate = _masked(valid, d_gate)
        sums.gate.index_put_((e,), torch.bmm(d_gate.transpose(1, 2), xe).to(sums.gate.dtype), accumulate=True)
        dxe = torch.bmm(d_gate, p.gate[e])
        if sums.gate_bias is not None:
            sums.gate_bias.index_put_((e,), d_gate.to(acc).sum(1).to(sums.gate_bias.dtype), accumulate=True)
        if d_up is not None:
            d_up = _masked(valid, d_up)
            sums.up.index_put_((e,), torch.bmm(d_up.transpose(1, 2), xe).to(sums.up.dtype), accumulate=True)
            dxe = dxe + torch.bmm(d_up, p.up[e])
            if sums.up_bias is not None:
                sums.up_bias.index_put_((e,), d_up.to(acc).sum(1).to(sums.up_bias.dtype), accumulate=True)
        dx.index_put_((tok.flatten(),), _masked(valid, dxe.to(acc)).flatten(0, 1), accumulate=True)
    grads = ExpertParams(*[None if s is None else s.to(t.dtype) for s, t in zip(sums, p)])
    return dx.to(x.dtype), dweights.view(T, K).to(weights.dtype), grads
