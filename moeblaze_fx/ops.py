"""The MoEBlaze operators, registered with ``torch.library``.

``torch.ops.moeblaze.moe_ffn(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens,
kernel_options="")`` returns ``(y, preact, plan)``:

* ``y [T, d]`` in x's dtype: ``y[t] = sum_k weights[t,k] * expert_{ids[t,k]}(x[t])``;
* ``preact [T*K, 2h]`` (gate|up pre-activations, biases included; ``[T*K, h]`` for a plain
  activation) in slot order (the whole batch's on the Triton path, each token chunk's on the PyTorch
  path) under ``checkpoint="activations"``, an empty ``[0]`` tensor under ``"recompute"``. Its columns
  are gate's then up's, except on the Triton path over gate and up interleaved column by column
  (gpt-oss's ``gate_up_proj``), where they are interleaved alike, as is the split backward's dA|dB;
* ``plan``: on the Triton path, the five int32 tensors of the forward's :class:`DispatchPlan` (the index
  structures: ``[E+1]`` offsets, ``[T*K]`` token index and slot of each pair, two tile tables); an empty
  list on the PyTorch path, which builds a plan per token chunk.

Only ``y`` is meant for callers.

The expert parameters arrive as they are stored: ``params`` is the list of parameter tensors and
``layout`` (see ``moeblaze_fx/layout.py``) says where in them each *role* lives (gate
``[E, h, d]``, up ``[E, h, d]``, down ``[E, d, h]`` and the optional biases): a strided view of one
``[E, ...]`` tensor (fused, transposed, interleaved or separate weights) or the same view of E
separate per-expert tensors (``ModuleList`` experts). Nothing is stacked or copied: the kernels read
the weights through per-expert pointer tables and write the weight gradients straight into storage
of each parameter's own layout.

AOTAutograd saves for the backward exactly x, the ids, the routing weights, the forward's plan (two int32 per
pair, Triton path) and, under the default policy, the pre-activations; the PyTorch path rebuilds its plans in
backward by the same deterministic dispatch. The backward is ``moeblaze::moe_ffn_backward``, or, under
"activations" with one slot window on the Triton path (one chunk of tokens on the CPU path), three operators:
``moe_ffn_backward_act`` (dA|dB, dweights, the down projection's gradients), ``moe_ffn_backward_dx`` (dx) and
``moe_ffn_backward_dw`` (the gate|up gradients), so that the saved pre-activations are freed before the gate|up
gradient is allocated and that gradient need not exist before dx (see "The split backward" below).
``chunk_tokens`` (0: no bound) bounds the operator's transient buffers. The Triton path builds one plan and runs its
expert-sorted slots in windows of ``chunk_tokens * K`` slots: each expert's weights are read by the
windows its slots fall in (not by every window), its weight gradient is written by the window where its
slots start and added to by any later one they reach, and y / dx accumulate across windows. The PyTorch
path runs chunks of ``chunk_tokens`` tokens. All output shapes are static functions of the input shapes
(no host synchronisation), so dynamic T and CUDA graphs work.

``kernel_options`` is ``config.encode_kernels`` of the :class:`~moeblaze_fx.config.KernelOptions` the kernels run
with (``""``: the defaults), part of the call so that a compiled graph's forward and backward run with the options
it was compiled with; the autograd formula hands the forward's to the backward operators. The kernels are launched
inside ``kernels.autotune.using`` of the decoded options.

Implementations: plain PyTorch on every device (``kernels.reference``), replaced on CUDA for
bfloat16/float16/float32 by the Triton kernels in ``kernels/`` where they are available (float32 with its products
as the kernel option ``float32_products`` says and one fixed configuration for each way,
``kernels.autotune.FLOAT32_CONFIGS``; never the Gluon kernels). The PyTorch
path walks the experts on the host on the CPU, and on CUDA (float64, or without Triton) runs row tiles of a static
count with no host synchronisation (``kernels.reference``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from . import config as _config
from .config import KernelOptions, decode_kernels, encode_kernels
from .kernels import reference
from .kernels.reference import ACTIVATIONS, Activation, DispatchPlan, ExpertParams, parse_activation
from .layout import ROLES, RoleView, check_layout, decode_layout, dense, dense_experts, layout_of, role_value

__all__ = ["moe_ffn", "CHECKPOINT_POLICIES", "ACTIVATIONS", "default_chunk_tokens"]

CHECKPOINT_POLICIES = ("activations", "recompute")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CPU_BLOCK_M = 64
# Default bound on the operator's transient buffers per chunk of tokens (see default_chunk_tokens).
DEFAULT_TRANSIENT_BUDGET = 2 << 30
log = logging.getLogger("moeblaze_fx")


def plan_block_m(device: torch.device, options: KernelOptions | None = None, dtype: torch.dtype | None = None) -> int:
    """Rows per tile of the dispatch plan the operator builds on ``device`` for operands of ``dtype`` with kernel
    ``options`` (default: those of ``config.current()``)."""
    kernels = _triton_kernels() if device.type == "cuda" else None
    if kernels is None:
        return _CPU_BLOCK_M
    with kernels[4].using(options if options is not None else _config.current().kernels, dtype):
        return kernels[4].plan_block_m()


def _using(options: KernelOptions, dtype: torch.dtype):
    """The block the operator's kernels run in: with ``options`` where the Triton kernels are available."""
    kernels = _triton_kernels()
    return kernels[4].using(options, dtype) if kernels is not None else contextlib.nullcontext()


def _own_precision(fn):
    """Run an op's implementation with autocast off: it computes in its inputs' dtype, which the caller chose (the
    rewrite casts a mixed-precision region's operands to the dtype the region computes in). Left on, autocast would
    run the CPU path's float32 products in bf16 under an autocast the region itself was not subject to."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        if not torch.is_autocast_enabled(device):  # the usual case: no context to enter on every call
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)
    return run


# The operators are defined through torch.library.Library, not torch.library.custom_op: custom_op wraps every call
# in Python (an autograd wrapper, a backend wrapper, an aliasing check over the outputs), about 40 us a call on an
# H200's host against 11 us for a Library kernel (docs/host.md), four calls an operator step. The backward operators
# have no autograd kernel (they run under no grad; :func:`_backward` refuses a double backward); the forward's
# formula is registered with torch.library.register_autograd.
_LIB = torch.library.Library("moeblaze", "DEF")  # noqa: TOR901 - see above


def _operator(fn):
    """Define ``moeblaze::<fn's name less its leading underscore>`` with the schema of fn's annotations, fn (autocast
    off inside, :func:`_own_precision`; never traced by Dynamo) its implementation on every device."""
    name = fn.__name__.lstrip("_")
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, torch._disable_dynamo(_own_precision(fn)), "CompositeExplicitAutograd")
    return fn


def _fake(name: str):
    """Register the decorated function as ``moeblaze::<name>``'s fake (shape) implementation."""
    return torch.library.register_fake(f"moeblaze::{name}", lib=_LIB)


def _check_inputs(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens) -> tuple[int, Activation]:
    """Validate the operator's contract; every message names the problem and the fix. Returns (h, act)."""
    layout = [int(v) for v in layout]  # SymInts under dynamic-shape tracing: the layout is static
    if x.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: x must be [T, d]; got shape {tuple(x.shape)} (reshape tokens to 2-D)")
    if ids.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: ids must be [T, K]; got shape {tuple(ids.shape)}")
    if weights.dim() != 2:
        raise ValueError(f"moeblaze.moe_ffn: weights must be [T, K]; got shape {tuple(weights.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moeblaze.moe_ffn: ids must be int32 or int64, got {ids.dtype}")
    for name, t in [("x", x), ("weights", weights)] + [(f"params[{i}]", p) for i, p in enumerate(params)]:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"moeblaze.moe_ffn: {name} has unsupported dtype {t.dtype}; use one of {_FLOAT_DTYPES}")
    if any(p.dtype != x.dtype for p in params):
        raise TypeError(f"moeblaze.moe_ffn: the expert parameters must have x's dtype {x.dtype}; got "
                        f"{sorted({str(p.dtype) for p in params})} (cast the tokens or the weights first)")
    T, d = x.shape
    if tuple(ids.shape) != tuple(weights.shape) or ids.shape[0] != T:
        raise ValueError(f"moeblaze.moe_ffn: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[T, K] with T = {T} tokens of x")
    devices = {t.device for t in (x, ids, weights, *params)}
    if len(devices) != 1:
        raise ValueError(f"moeblaze.moe_ffn: all inputs must be on one device, got {sorted(map(str, devices))}")
    if any(not _dense_storage(p) for p in params):
        raise ValueError("moeblaze.moe_ffn: expert parameters must be non-overlapping and dense (a parameter, not a "
                         "view with gaps); pass the underlying tensor and describe the view in the layout")
    act = parse_activation(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"moeblaze.moe_ffn: activation must be a string, got {activation!r}")
    if checkpoint not in CHECKPOINT_POLICIES:
        raise ValueError(f"moeblaze.moe_ffn: unknown checkpoint policy {checkpoint!r}; supported: {CHECKPOINT_POLICIES}")
    if not isinstance(chunk_tokens, (int, torch.SymInt)) or chunk_tokens < 0:
        raise ValueError(f"moeblaze.moe_ffn: chunk_tokens must be an int >= 0 (0: no chunking), got {chunk_tokens!r}")
    E, views = decode_layout(layout)
    why = check_layout(tuple(int(p.numel()) for p in params), tuple(layout))
    if why:
        raise ValueError(f"moeblaze.moe_ffn: bad layout: {why}")
    for v in views:  # the parameters of a per-expert role: alike, and grouped the same way by every role
        if v is None or v.count == 1:
            continue
        group = params[v.first: v.first + v.count]
        if any((list(p.shape), list(p.stride()), p.dtype) != (list(group[0].shape), list(group[0].stride()), group[0].dtype)
               for p in group):
            raise ValueError(f"moeblaze.moe_ffn: per-expert parameters {v.first}..{v.first + v.count - 1} differ in "
                             f"shape, strides or dtype: {[(tuple(p.shape), p.stride()) for p in group]}")
        for u in views:
            if u is not None and u.count > 1 and u.first != v.first and abs(u.first - v.first) < v.count:
                raise ValueError(f"moeblaze.moe_ffn: per-expert roles at parameters {u.first} and {v.first} overlap "
                                 "partly; roles must share a group of parameters exactly or not at all")
    gate, up, down, gate_bias, up_bias, down_bias = views
    h = gate.rows
    if (up is not None) != act.gated:
        raise ValueError(f"moeblaze.moe_ffn: activation {act.name!r} {'needs an' if act.gated else 'takes no'} up role")
    want = {"gate": (h, d), "up": (h, d), "down": (d, h), "gate_bias": (h, 1), "up_bias": (h, 1), "down_bias": (d, 1)}
    for role, v in zip(ROLES, views):
        if v is not None and (v.rows, v.cols) != want[role]:
            raise ValueError(f"moeblaze.moe_ffn: role {role!r} is [{v.rows}, {v.cols}] per expert; with d = {d} and "
                             f"h = {h} it must be {list(want[role])}")
    if up_bias is not None and up is None:
        raise ValueError("moeblaze.moe_ffn: an up bias needs an up role")
    return h, act


def _dense_storage(p: Tensor) -> bool:
    """Its elements fill a block of storage exactly once (any dimension order)."""
    expected = 1
    for stride, size in sorted((int(st), int(sz)) for st, sz in zip(p.stride(), p.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """(dispatch, forward, backward, tables, autotune, triton.common, plan, program, launch) modules, or None where
    Triton or the kernels are missing."""
    try:
        from .kernels import autotune, backward, dispatch, forward, launch, plan, program, tables
        from .kernels.triton import common
    except ImportError as exc:
        log.debug("moeblaze: Triton kernels unavailable (%s); using the PyTorch implementation", exc)
        return None
    return dispatch, forward, backward, tables, autotune, common, plan, program, launch


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and _triton_kernels() is not None


def _make_plan(ids: Tensor, num_experts: int, block_m: int, check_ids: bool = False) -> DispatchPlan:
    """The dispatch plan (the Triton dispatch on CUDA, run with the kernel options in force; with ``check_ids``, a
    negative id fails there, see ``kernels.dispatch.dispatch``)."""
    kernels = _triton_kernels() if ids.is_cuda else None
    if kernels is not None:
        return kernels[0].dispatch(ids, num_experts, block_m, check_ids)
    if check_ids:
        reference.check_ids(ids)
    return reference.dispatch_reference(ids, num_experts, block_m=block_m)


def default_chunk_tokens(K: int, d: int, h: int, gated: bool, itemsize: int,
                         budget: int = DEFAULT_TRANSIENT_BUDGET) -> int:
    """Tokens per chunk (``K`` times that many slots per window on the Triton path) so that the per-slot
    transients alive at once stay within ``budget`` bytes: the forward's H and Y (``h + d`` elements a
    slot), the backward's dA|dB with w*H, then with dX (w*H is freed first: ``preact + max(h, d)``). 0 (no
    bound) for budget 0."""
    if budget <= 0:
        return 0
    return max(256, budget // max(K * _slot_bytes(d, h, gated, itemsize), 1))


def _slot_bytes(d: int, h: int, gated: bool, itemsize: int) -> int:
    """Bytes of per-slot transients alive at once (see default_chunk_tokens)."""
    return max(h + d, (2 if gated else 1) * h + max(h, d)) * itemsize


def _chunks(T: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Token ranges of at most ``chunk_tokens`` (0: one range), as equal as possible."""
    n = -(-T // chunk_tokens) if 0 < chunk_tokens < T else 1
    step = -(-T // n) if T else 1
    return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)] or [(0, 0)]


# ---------------------------------------------------------------------------------------------
# The paths: Triton kernels through pointer tables, or plain PyTorch over dense views
# ---------------------------------------------------------------------------------------------
def _tables(params: Sequence[Tensor], views: Sequence[RoleView | None], E: int):
    tables = _triton_kernels()[3]

    def table(v):
        if v is None:
            return None
        if v.count == 1:  # (a view of the detached parameter: the plan may keep it, see _expert_weights)
            return tables.table_of(role_value(params, v, E, detached=True))
        group = params[v.first: v.first + v.count]  # checked alike in shape, strides and dtype
        size = group[0].element_size()
        return tables.table_of_addresses(tuple(p.data_ptr() + v.offset * size for p in group), v.rows, v.cols,
                                         v.stride_r, v.stride_c, group[0].dtype, group[0].device)

    return tables.ExpertTables(*(table(v) for v in views[:3]))


def _biases(params: Sequence[Tensor], views: Sequence[RoleView | None], E: int) -> list[Tensor | None]:
    # biases are small: one contiguous [E, n] copy each
    return [None if v is None else dense(role_value(params, v, E), True).contiguous() for v in views[3:]]


class _KernelWeights(NamedTuple):
    tables: object  # kernels.tables.ExpertTables
    biases: list  # gate, up, down bias: contiguous [E, n] or None
    units: object  # kernels.plan.UnitsKey under which the kernels' plans may keep their weight units, or None


def _expert_weights(x: Tensor, params: Sequence[Tensor], views: Sequence[RoleView | None], E: int,
                    key: tuple | None = None):
    """What one call's windows or chunks compute with: tables and biases for the kernels, or dense ``ExpertParams``
    for the plain-PyTorch path. With ``key`` (:func:`_weights_key` of ``params`` and the layout of ``views``), the
    tables are kept for later calls with the same key, dtype and stream where they may be (``tables.cacheable``).
    For a model's weights (:func:`_units_key`) they are kept whole, ``dense`` views of the detached parameters
    included, with the kernels' plans' weight units (descriptors over those views), until one of the parameters goes
    (``kernels.plan.UnitsKey``): a call then views nothing again but the biases, which are copied at every call.
    For other weights (cast for this call) only the pointers are kept, holding no tensor, and each call views them
    again."""
    if not _use_triton(x):
        return dense_experts(params, views, E)
    kernels = _triton_kernels()
    tables = kernels[3]
    if key is None or not tables.cacheable(x.device) or (kernels[7].recording() is not None and
                                                         not _models_weights(params)):
        # (a call recorded for weights made for it is replayed over other weights: its tables are made in the call,
        # as host steps a replay makes again over the new weights, never taken from a cache)
        return _KernelWeights(_tables(params, views, E), _biases(params, views, E), None)
    key = _kept_key(x, key)
    units = _units_key(key, params, views)
    if units is not None:
        return _KernelWeights(kernels[6].keep(units, ("tables", E), x, lambda: _tables(params, views, E)),
                              _biases(params, views, E), units)
    kept = _WEIGHTS.get(key)
    if kept is None:
        built = _tables(params, views, E)
        _remember(_WEIGHTS, key, tables.ExpertTables(*[None if t is None else t._replace(dense=None) for t in built]))
    else:  # the same tables over this call's views of the parameters
        built = tables.ExpertTables(*[None if t is None else t if v.count > 1 else t._replace(
            dense=role_value(params, v, E, detached=True)) for t, v in zip(kept, views[:3])])
    return _KernelWeights(built, _biases(params, views, E), None)


def _kept_key(x: Tensor, wkey: tuple) -> tuple:
    """What kept weight tables, units and programs are keyed by: the parameters' addresses and layout (``wkey``,
    :func:`_weights_key`), x's dtype, and the stream on CUDA (a kept tensor is read only on the stream that wrote
    it)."""
    return wkey, x.dtype, _triton_kernels()[3].stream_key(x.device) if x.is_cuda else None


def _units_key(key: tuple, params: Sequence[Tensor], views: Sequence[RoleView | None]):
    """The ``kernels.plan.UnitsKey`` the kernels' plans keep their weight units under (``key``: the parameters'
    addresses and layout, the dtype and stream), owned by the parameters holding whole roles; None where those are
    not a model's weights (:func:`_models_weights`: weights cast for this call under autocast, new tensors at every
    call, for which keeping would only make and drop the units each time)."""
    # (one entry per tensor: a tensor hashes by identity)
    owners = tuple(dict.fromkeys(params[v.first] for v in views[:3] if v is not None and v.count == 1)) or (params[0],)
    if not _models_weights(owners):
        return None
    return _triton_kernels()[6].UnitsKey(key, owners)


def _models_weights(params: Sequence[Tensor]) -> bool:
    """Whether every one of ``params`` is a model's weight, alive from call to call at its address: a parameter, or a
    leaf requiring grad. Not one made for the call: a weight cast under autocast or in the forward (a new tensor at
    every call; in a compiled graph it requires no grad, eagerly it has the cast's grad_fn)."""
    return all(isinstance(p, torch.nn.Parameter) or (p.requires_grad and p.grad_fn is None) for p in params)


# An operator step makes four calls (the forward and the three backward operators), and each checked its arguments
# and built the experts' tables again: about a tenth of the step's host time at (8192, 1024, 512, 64, 8) (H100,
# docs/host.md). What depends only on the arguments' shapes, dtypes, devices, layout and the parameters' addresses
# is kept here, by those. Bounded: a full cache is emptied (FSDP2's parameters may change addresses every step).
_CACHE_MAX = 512
_CHECKED: dict = {}  # _check_inputs's (h, act), by what it reads
_WEIGHTS: dict = {}  # _expert_weights's tables without their dense views, by _weights_key, dtype and stream


def _remember(cache: dict, key, value):
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


def _weights_key(params: Sequence[Tensor], layout: Sequence[int]) -> tuple:
    """The parameters' addresses, shapes, strides, dtypes and devices, and the layout."""
    return tuple((p.data_ptr(), p.shape, p.stride(), p.dtype, p.device) for p in params), tuple(layout)


# Programs by everything their signature holds (:func:`_replay_key`), weakly: a call with a recorded program goes to
# its replay before any of the operator's own Python (its checks, the layout's decoding, the weights' key, the
# programs' own lookup by the parameters' units: about 0.7 ms of the 3.9 ms an eager operator step took to enqueue at
# (8192, 1024, 512, 64, 8), beside 1.0 ms in the replays themselves; H200, docs/host.md). The program itself is kept
# with the parameters' units (``_programmed``), so an entry here goes with them; a program over weights made for the
# call (no address in its key) is kept in ``_UNOWNED``.
_REPLAYS: dict = {}
_UNOWNED: dict = {}  # program.Entry by _replay_key, for weights that are not a model's (see _programmed)


def _replay_key(what: tuple, x: Tensor, kernel_options: str, layout: Sequence[int], params: Sequence[Tensor],
                inputs: Sequence[Tensor]) -> tuple:
    """Everything an operator call's program is recorded under (see :func:`_programmed`): ``what`` (the operator and
    its non-tensor arguments), the kernel options, how float32 operands are multiplied (torch's precision setting
    can resolve the option "auto" another way at the next call), the layout, each input's shape, strides, dtype and
    16-byte alignment, x's device, the current device and stream, the dh kernel's split, and last the parameters'
    addresses where they are a model's weights (:func:`_models_weights`; None for weights made for the call)."""
    kernels = _triton_kernels()
    cuda = x.is_cuda
    products = kernels[4].resolve_float32_products(decode_kernels(kernel_options)) \
        if x.dtype == torch.float32 else None
    return (what, kernel_options, products, tuple(layout), x.device, torch.cuda.current_device() if cuda else None,
            kernels[3].stream_key(x.device) if cuda else None, kernels[6].tdh.DH_SPLIT,
            tuple([(t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in inputs]),
            tuple([p.data_ptr() for p in params]) if _models_weights(params) else None)


def _replayed(what: tuple, x: Tensor, kernel_options: str, layout: Sequence[int], params: Sequence[Tensor],
              inputs: list[Tensor]) -> tuple:
    """(the call's :func:`_replay_key`, the replay of the program recorded under it with ``inputs``, or None where
    none is kept or replays may not run now)."""
    key = _replay_key(what, x, kernel_options, layout, params, inputs)
    ref = _REPLAYS.get(key)
    entry = ref() if ref is not None else None
    if entry is None or not _replays_allowed(x):
        return key, None
    return key, _triton_kernels()[7].run(entry, inputs, None)


def _replays_allowed(x: Tensor) -> bool:
    """Whether programs may be recorded and replayed for a call on ``x`` now (see :func:`_programmed`)."""
    kernels = _triton_kernels()
    return (kernels[8].direct() or _config.interpreting()) and (not x.is_cuda or kernels[3].cacheable(x.device))


def _programmed(x: Tensor, params: Sequence[Tensor], views: Sequence[RoleView | None], wkey: tuple,
                inputs: list[Tensor], body, key: tuple):
    """``body()``, a Triton-path call of an operator whose tensor arguments are ``inputs``, through its recorded launch
    program (``kernels.program``): recorded, or replayed from the record of an earlier call with the same signature
    ``key`` (its :func:`_replay_key`, under which :func:`_replayed` finds the program again; ``kernels.plan.keep`` adds
    the kernel options in force). Over a model's weights (:func:`_models_weights`) the key holds their addresses,
    the program holds their tables and descriptors as constants, and it is kept with the parameters' units and goes
    with them. Over weights made for the call (cast under autocast or in the forward: new tensors, maybe at new
    addresses, at every call) the key holds none, the recorded call makes its tables and descriptors over them (host
    steps and descriptors a replay makes again over the new weights: :func:`_expert_weights`), and the program is kept
    in a bounded table. Not used under the kernel option ``replay=False``, while launches take Triton's own path (a
    profiler's hook; under Triton's interpreter, which runs the Triton path on CPU tensors in the tests, they are
    recorded as Python calls), or while allocations come from a CUDA graph's pool."""
    kernels = _triton_kernels()
    autotune, plan, program = (kernels[i] for i in (4, 6, 7))
    if not autotune.options().replay or not _replays_allowed(x):
        return body()
    if key[-1] is None:  # weights made for the call (no addresses in the key: _replay_key)
        entry = _UNOWNED.get(key) or _remember(_UNOWNED, key, program.Entry())
    else:  # (kept by the signature less the addresses: parameters that moved replace their program, see plan.keep)
        entry = plan.keep(_units_key(_kept_key(x, wkey), params, views), ("program", key[:-1]), x, program.Entry)
    result = program.run(entry, inputs, body)
    if entry.program is not None:
        _remember(_REPLAYS, key, weakref.ref(entry))
    return result


def _checked(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens, wkey) -> tuple[int, Activation]:
    """:func:`_check_inputs` of a real call, run once per signature of the arguments (``wkey``: the
    :func:`_weights_key` of ``params`` and ``layout``)."""
    key = (x.shape, x.dtype, x.device, ids.shape, ids.dtype, ids.device, weights.shape, weights.dtype, weights.device,
           wkey, activation, checkpoint, chunk_tokens)
    got = _CHECKED.get(key)
    if got is None:
        got = _remember(_CHECKED, key, _check_inputs(x, ids, weights, params, layout, activation, checkpoint,
                                                     chunk_tokens))
    return got


def _forward_chunk(x, ids, weights, experts, E, act, save_preact, opts, out=None, preact_out=None):
    """y and preact of these tokens (plain-PyTorch path); written into ``out`` / ``preact_out`` when given."""
    plan = _make_plan(ids, E, plan_block_m(x.device, opts, x.dtype))
    y, preact, _ = reference.moe_ffn_forward_torch(x, ids, weights, experts, act, save_preact, plan)
    if out is not None:
        out.copy_(y)
    if preact_out is not None and save_preact:
        preact_out.copy_(preact)
    return y, preact


@_operator
def _moe_ffn(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    params: list[Tensor],
    layout: list[int],
    activation: str,
    checkpoint: str,
    chunk_tokens: int,
    kernel_options: str = "",
) -> tuple[Tensor, Tensor, list[Tensor]]:
    if _use_triton(x):
        what, inputs = ("moe_ffn", activation, checkpoint, chunk_tokens), [x, ids, weights, *params]
        key, replayed = _replayed(what, x, kernel_options, layout, params, inputs)
        if replayed is not None:
            return replayed
    wkey = _weights_key(params, layout)
    h, act = _checked(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens, wkey)
    opts = decode_kernels(kernel_options)
    with _using(opts, x.dtype):
        if not _use_triton(x):
            return _forward(x, ids, weights, params, layout, act, checkpoint, chunk_tokens, h, opts, wkey)
        return _programmed(x, params, decode_layout(layout)[1], wkey, inputs,
                           lambda: _forward(x, ids, weights, params, layout, act, checkpoint, chunk_tokens, h, opts,
                                            wkey), key)


def _forward(x, ids, weights, params, layout, act, checkpoint, chunk_tokens, h, opts, wkey):
    E, views = decode_layout(layout)
    T, K = ids.shape
    save = checkpoint == "activations"
    width = (2 if act.gated else 1) * h
    experts = _expert_weights(x, params, views, E, wkey)
    if isinstance(experts, _KernelWeights):  # one plan; windows of chunk_tokens * K slots bound the transients
        plan = _make_plan(ids, E, plan_block_m(x.device, opts, x.dtype), True)
        y, preact = _triton_kernels()[1].expert_forward(x, weights, experts.tables, plan, act, save, *experts.biases,
                                                        window_slots=chunk_tokens * K, units_key=experts.units)
        return y, preact, list(plan)  # saved for backward: the backward does not dispatch again
    reference.check_ids(ids)  # (the Triton path's dispatch checks them in its first launch)
    chunks = _chunks(T, chunk_tokens)
    if len(chunks) == 1:
        return *_forward_chunk(x, ids, weights, experts, E, act, save, opts), []
    y = x.new_empty(x.shape)
    preact = x.new_empty((T * K, width) if save else (0,))
    for t0, t1 in chunks:
        _forward_chunk(x[t0:t1], ids[t0:t1], weights[t0:t1], experts, E, act, save, opts, out=y[t0:t1],
                       preact_out=preact[t0 * K: t1 * K] if save else None)
    return y, preact, []


@_fake("moe_ffn")
def _moe_ffn_fake(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens, kernel_options=""):
    h, act = _check_inputs(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens)
    opts = decode_kernels(kernel_options)
    width = (2 if act.gated else 1) * h
    n_pairs = ids.shape[0] * ids.shape[1]
    plan = []
    # the real implementation's choice of path; the plan's shapes follow from T, K, E and the row tile, which the
    # real implementation reads the same way, from the same kernel options (an argument of the call)
    if _use_triton(x):
        sizes = reference.plan_sizes(n_pairs, int(layout[0]), plan_block_m(x.device, opts, x.dtype))
        plan = [ids.new_empty((n,), dtype=torch.int32) for n in sizes]
    return x.new_empty(x.shape), x.new_empty((n_pairs, width) if checkpoint == "activations" else (0,)), plan


def _groups(num_params: int, views: Sequence[RoleView | None], E: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each gradient allocation: the E parameters of a per-expert role share one
    stacked ``[E, ...]`` buffer (their gradients are its slices), any other parameter has its own."""
    starts = {v.first for v in views if v is not None and v.count == E and E > 1}
    groups, i = [], 0
    while i < num_params:
        count = E if i in starts else 1
        groups.append((i, count))
        i += count
    return groups


def _grad_buffers(params: Sequence[Tensor], views: Sequence[RoleView | None], E: int,
                  groups: Sequence[tuple[int, int]] | None = None) -> dict[int, Tensor]:
    """One gradient buffer per group (keyed by its first parameter; ``groups``: those of :func:`_groups`, or a part
    of them), in each parameter's own strides (stacked for a per-expert group); zeroed where the roles leave
    elements uncovered."""
    bufs = {}
    for first, count in (_groups(len(params), views, E) if groups is None else groups):
        p = params[first]
        covered = sum(v.numel(E) if v.count == 1 else v.rows * v.cols * count
                      for v in views if v is not None and v.first == first)
        shape, stride = (p.shape, p.stride()) if count == 1 else ((count, *p.shape), (p.numel(), *p.stride()))
        buf = torch.empty_strided(shape, stride, dtype=p.dtype, device=p.device)
        bufs[first] = buf.zero_() if covered < buf.numel() else buf
    return bufs


def _once(make):
    """A function returning ``make()``, called on its first call only."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]
    return get


def _grad_role(bufs: dict[int, Tensor], v: RoleView, E: int) -> Tensor:
    """The role's place in the gradient buffers as one ``[E, rows, cols]`` view."""
    buf = bufs[v.first]
    stride_e = buf.stride(0) if v.count > 1 else v.stride_e
    return buf.as_strided((E, v.rows, v.cols), (stride_e, v.stride_r, v.stride_c), buf.storage_offset() + v.offset)


def _store_role(bufs: dict[int, Tensor], v: RoleView, E: int, grad: Tensor, accumulate: bool) -> None:
    """Write (or add) a dense ``[E, rows, cols]`` (or ``[E, n]``) gradient into the role's place in ``bufs``."""
    dest = _grad_role(bufs, v, E)
    grad = grad.reshape(dest.shape)
    dest.add_(grad) if accumulate else dest.copy_(grad)


def _backward_chunk(grad_y, x, ids, weights, experts, views, E, act, preact, recompute, bufs, accumulate, opts):
    """dx, dweights of these tokens (plain-PyTorch path); parameter gradients stored (or added) into bufs."""
    plan = _make_plan(ids, E, plan_block_m(x.device, opts, x.dtype))
    dx, dweights, grads = reference.moe_ffn_backward_torch(grad_y, x, ids, weights, experts, preact, plan, act,
                                                                recompute)
    for v, g in zip(views, grads):
        if v is not None:
            _store_role(bufs, v, E, g, accumulate)
    return dx, dweights


@_operator
def _moe_ffn_backward(
    grad_y: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    params: list[Tensor],
    layout: list[int],
    preact: Tensor,
    plan: list[Tensor],
    activation: str,
    checkpoint: str,
    chunk_tokens: int,
    kernel_options: str = "",
) -> tuple[Tensor, Tensor, list[Tensor]]:
    if _use_triton(x):
        what = ("moe_ffn_backward", activation, checkpoint, chunk_tokens)
        inputs = [grad_y, x, ids, weights, *params, preact, *plan]
        key, replayed = _replayed(what, x, kernel_options, layout, params, inputs)
        if replayed is not None:
            return replayed
    act = parse_activation(activation)
    if checkpoint not in CHECKPOINT_POLICIES:
        raise ValueError(f"moeblaze.moe_ffn_backward: checkpoint must be one of {CHECKPOINT_POLICIES}, got {checkpoint!r}")
    opts = decode_kernels(kernel_options)
    wkey = _weights_key(params, layout)
    with _using(opts, x.dtype):
        if not _use_triton(x):
            return _backward_impl(grad_y, x, ids, weights, params, layout, preact, plan, act, checkpoint,
                                  chunk_tokens, opts, wkey)
        return _programmed(x, params, decode_layout(layout)[1], wkey, inputs,
                           lambda: _backward_impl(grad_y, x, ids, weights, params, layout, preact, plan, act,
                                                  checkpoint, chunk_tokens, opts, wkey), key)


def _backward_impl(grad_y, x, ids, weights, params, layout, preact, plan, act, checkpoint, chunk_tokens, opts, wkey):
    recompute = checkpoint == "recompute"
    E, views = decode_layout(layout)
    T, K = ids.shape
    if plan and (len(plan) != len(DispatchPlan._fields) or any(t.dtype != torch.int32 for t in plan)):
        raise ValueError(f"moeblaze.moe_ffn_backward: plan must be the forward's {len(DispatchPlan._fields)} int32 "
                         f"tensors (or [] to dispatch again); got {[(tuple(t.shape), t.dtype) for t in plan]}")
    grad_y = grad_y.contiguous()
    experts = _expert_weights(x, params, views, E, wkey)
    if isinstance(experts, _KernelWeights):
        return _kernel_backward(grad_y, x, ids, weights, experts, views, E, act, preact, recompute, plan,
                                _once(lambda: _grad_buffers(params, views, E)), chunk_tokens, opts)
    bufs = _grad_buffers(params, views, E)
    chunks = _chunks(T, chunk_tokens)  # the PyTorch path: a plan per chunk, built again
    dx = x.new_empty(x.shape) if len(chunks) > 1 else None
    dweights = weights.new_empty(weights.shape) if len(chunks) > 1 else None
    for i, (t0, t1) in enumerate(chunks):
        pre = preact if recompute or len(chunks) == 1 else preact[t0 * K: t1 * K]
        dx_c, dw_c = _backward_chunk(grad_y[t0:t1], x[t0:t1], ids[t0:t1], weights[t0:t1], experts, views, E, act, pre,
                                     recompute, bufs, i > 0, opts)
        if len(chunks) == 1:
            dx, dweights = dx_c, dw_c
        else:
            dx[t0:t1] = dx_c
            dweights[t0:t1] = dw_c
    return dx, dweights, list(bufs.values())


def _interleaved_gate_up(views: Sequence[RoleView | None]) -> bool:
    """Whether the gate and up roles interleave column by column in one ``[E, ...]`` parameter (gpt-oss's
    ``gate_up_proj [E, d, 2h]``): the layout form of ``kernels.tables.interleaved_gate_up``, by which the kernels
    read those weights as one 2h-wide matrix and keep A|B and dA|dB interleaved alike (from the tables built of
    these views)."""
    gate, up = views[0], views[1]
    return (up is not None and gate.count == up.count == 1 and gate.first == up.first
            and up.offset == gate.offset + 1 and gate.stride_r == up.stride_r == 2 and gate.stride_c == up.stride_c
            and gate.stride_e == up.stride_e)


def _kernel_backward(grad_y, x, ids, weights, experts, views, E, act, preact, recompute, plan, bufs, chunk_tokens,
                     opts, phase="all", dpre=None):
    """The Triton path: one plan (the forward's, or built again from ids when ``plan`` is empty), windows of
    chunk_tokens * K slots. Weight gradients are written through
    tables straight into ``bufs()`` (a function allocating the gradient buffers on its first call, made when the
    kernels reach their first weight-gradient launch); over more than two windows, into float32 buffers first when those cost
    less than one window's transients (an expert spanning several windows is added to once per window:
    in float32 there, else in place in the parameters' dtype)."""
    bwd, tables, common = (_triton_kernels()[i] for i in (2, 3, 5))
    T, K = ids.shape
    window_slots = chunk_tokens * K
    weight_numel = sum(v.numel(E) for v in views[:3] if v is not None)
    window_bytes = window_slots * _slot_bytes(x.shape[1], views[0].rows, act.gated, x.element_size())
    acc32 = None
    if phase == "all" and common.num_slot_windows(T * K, window_slots) > 2 and 4 * weight_numel <= window_bytes:
        acc32 = [None if v is None else torch.empty((E, v.rows, v.cols), dtype=torch.float32, device=x.device)
                 for v in views[:3]]
        if _interleaved_gate_up(views):  # the same interleaved [E, d, 2h] layout: one contiguous 2h-wide dW launch
            h, d = views[0].rows, views[0].cols
            gate_up = torch.empty((E, d, 2 * h), dtype=torch.float32, device=x.device)
            acc32[:2] = gate_up[:, :, 0::2].transpose(1, 2), gate_up[:, :, 1::2].transpose(1, 2)
    written = bwd.PHASE_ROLES[phase]  # the roles whose gradients this call writes

    def grad_tables():  # called by the kernels just before their first weight-gradient launch
        dense = acc32 or [None if v is None or role not in written else _grad_role(bufs(), v, E)
                          for role, v in zip(ROLES, views[:3])]
        return tables.ExpertTables(*[None if g is None else tables.table_of(g) for g in dense])

    plan = DispatchPlan(*plan) if plan else _make_plan(ids, E, plan_block_m(x.device, opts, x.dtype))
    out, dweights, *dbias = bwd.expert_backward(grad_y, x, weights, experts.tables, preact, plan, act,
                                                *experts.biases, grads=grad_tables, recompute=recompute,
                                                window_slots=window_slots, phase=phase, dpre=dpre,
                                                units_key=experts.units)
    for v, g in zip(views[3:], dbias):
        if v is not None and g is not None:
            _store_role(bufs(), v, E, g, False)
    if acc32 is not None:
        for v, g in zip(views[:3], acc32):
            if v is not None:
                _store_role(bufs(), v, E, g, False)
    return out, dweights, list(bufs().values())


def _fake_grads(params: Sequence[Tensor], groups: Sequence[tuple[int, int]]) -> list[Tensor]:
    grads = []
    for first, count in groups:
        p = params[first]
        shape, stride = (p.shape, p.stride()) if count == 1 else ((count, *p.shape), (p.numel(), *p.stride()))
        grads.append(torch.empty_strided(shape, stride, dtype=p.dtype, device=p.device))
    return grads


@_fake("moe_ffn_backward")
def _moe_ffn_backward_fake(grad_y, x, ids, weights, params, layout, preact, plan, activation, checkpoint,
                           chunk_tokens, kernel_options=""):
    decode_kernels(kernel_options)  # (validates it)
    E, views = decode_layout(layout)
    return torch.empty_like(x), torch.empty_like(weights), _fake_grads(params, _groups(len(params), views, E))


# ---------------------------------------------------------------------------------------------
# The split backward: three operators, so that the saved A|B can be freed between them and the gate|up gradients
# are not tied to dx
# ---------------------------------------------------------------------------------------------
# One backward operator holds its arguments to its end: the saved A|B [T*K, 2h] stays alive while dA|dB [T*K, 2h]
# and the weight gradients are allocated, where Inductor's own backward frees its A|B after the activation's
# gradient. And one operator returning dx with the gate|up gradients makes every one of them exist before dx, so
# before what the layers below compute from dx (a model's embedding gradient, a float32 [vocab, d] accumulator),
# where Inductor's scheduler computes its own dW_gate|up after that accumulator is freed (docs/memory.md). With one
# slot window under "activations" (on the Triton path, or the plain-PyTorch path's walk of the experts on the CPU
# in one chunk of tokens) the backward is therefore three operators (the autograd formula picks them; the
# compiled backward frees each argument after its last use, and nothing orders the third after the second):
#   moe_ffn_backward_act(grad_y, x, ..., preact, plan) -> (dA|dB, dweights, gradients of the down side's groups)
#   moe_ffn_backward_dx(dA|dB, x, ..., plan)            -> dx
#   moe_ffn_backward_dw(dA|dB, x, ..., plan)            -> gradients of the other (gate side's) groups
# The third allocates the gate|up gradient with dA|dB alive but A|B freed: one [T*K, 2h] buffer, as in Inductor's.
_DOWN_SIDE = ("down", "down_bias")


def _side_groups(num_params: int, views: Sequence[RoleView | None],
                 E: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """(the gradient groups of :func:`_groups` that hold the down projection's roles, the others); None where one
    group holds roles of both (one buffer that neither side's operator could return whole)."""
    down_side, gate_side = [], []
    for first, count in _groups(num_params, views, E):
        sides = {role in _DOWN_SIDE for role, v in zip(ROLES, views) if v is not None and v.first == first}
        if len(sides) > 1:
            return None
        (down_side if sides == {True} else gate_side).append((first, count))
    return down_side, gate_side


def _split_path(x: Tensor) -> str | None:
    """Which implementation the split backward runs on for ``x``: "triton", "cpu" (the plain-PyTorch walk of the
    experts), or None (the plain-PyTorch row tiles on another device: one operator)."""
    if _use_triton(x):
        return "triton"
    return "cpu" if x.device.type == "cpu" else None


def _split_halves(x, params, layout, checkpoint, chunk_tokens, T, K, plan_len):
    """The (down side's, gate side's) groups where the split backward applies: "activations", static T, one slot
    window (the Triton path, which saved a plan) or one chunk of tokens (the CPU path), and no gradient group
    holding roles of both sides."""
    if checkpoint != "activations" or not isinstance(T, int):
        return None
    path = _split_path(x)
    if path == "triton" and (plan_len == 0 or _triton_kernels()[5].num_slot_windows(T * K, chunk_tokens * K) != 1):
        return None
    if path is None or (path == "cpu" and len(_chunks(T, chunk_tokens)) != 1):
        return None
    E, views = decode_layout(layout)
    return _side_groups(len(params), views, E)


def _split_call(name, x, params, layout, plan, kernel_options):
    """(E, views, options, the two sides' groups, the path) of a split-backward call, checked."""
    E, views = decode_layout(layout)
    halves = _side_groups(len(params), views, E)
    path = _split_path(x)
    if halves is None or path is None:
        raise ValueError(f"moeblaze.{name}: the split backward runs on the Triton path or on the CPU, with no "
                         "gradient group holding both the down projection's roles and the others; call "
                         "moe_ffn_backward")
    if path == "cpu" and len(plan):
        raise ValueError(f"moeblaze.{name}: on the CPU the plan is built again from ids (the forward saved none); "
                         f"pass plan=[], got {len(plan)} tensors")
    return E, views, decode_kernels(kernel_options), halves, path


def _torch_phase(phase, grad_y, x, ids, weights, params, views, E, act, preact, dpre, groups, opts):
    """One phase of the split backward on the CPU path (one chunk): (the phase's two tensors of
    ``reference.moe_ffn_backward_torch``, the gradients of ``groups``, written in place through views of their
    buffers: no dense copy beside them). The plan is built again from ids: the dispatch is deterministic, so it is
    the forward's, the slot order of ``preact`` and ``dpre``."""
    plan = _make_plan(ids, E, plan_block_m(x.device, opts, x.dtype))
    bufs = _grad_buffers(params, views, E, groups)
    experts = dense_experts(params, views, E)
    # the roles of these groups as [E, rows, cols] (biases [E, n]) views: a phase writes only its side's roles,
    # and a side's roles are exactly those its groups hold
    out = ExpertParams(*[None if v is None or v.first not in bufs else _role_view(bufs, v, E, role)
                         for role, v in zip(ROLES, views)])
    first, second, _ = reference.moe_ffn_backward_torch(grad_y, x, ids, weights, experts, preact, plan, act, False,
                                                        phase=phase, dpre=dpre, out=out)
    return first, second, list(bufs.values())


def _role_view(bufs, v, E, role):
    view = _grad_role(bufs, v, E)
    return view[..., 0] if role.endswith("bias") else view


@_operator
def _moe_ffn_backward_act(
    grad_y: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    params: list[Tensor],
    layout: list[int],
    preact: Tensor,
    plan: list[Tensor],
    activation: str,
    kernel_options: str = "",
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The split backward's first operator ("activations", one window): (dA|dB [T*K, width] in slot order, its rows
    of unrouted pairs' slots left unwritten on the Triton path, zero on the CPU; dweights; the gradients of the down
    side's groups)."""
    if _use_triton(x):
        what, inputs = ("moe_ffn_backward_act", activation), [grad_y, x, ids, weights, *params, preact, *plan]
        key, replayed = _replayed(what, x, kernel_options, layout, params, inputs)
        if replayed is not None:
            return replayed
    E, views, opts, (down_side, _), path = _split_call("moe_ffn_backward_act", x, params, layout, plan,
                                                       kernel_options)
    act = parse_activation(activation)
    if path == "cpu":
        return _torch_phase("act", grad_y.contiguous(), x, ids, weights, params, views, E, act, preact, None,
                            down_side, opts)
    wkey = _weights_key(params, layout)

    def body():
        bufs = _once(lambda: _grad_buffers(params, views, E, down_side))
        experts = _expert_weights(x, params, views, E, wkey)
        return _kernel_backward(grad_y.contiguous(), x, ids, weights, experts, views, E, act, preact, False, plan,
                                bufs, 0, opts, "act")
    with _using(opts, x.dtype):
        return _programmed(x, params, views, wkey, inputs, body, key)


@_fake("moe_ffn_backward_act")
def _moe_ffn_backward_act_fake(grad_y, x, ids, weights, params, layout, preact, plan, activation, kernel_options=""):
    E, views, _, (down_side, _), _ = _split_call("moe_ffn_backward_act", x, params, layout, plan, kernel_options)
    return preact.new_empty(preact.shape), torch.empty_like(weights), _fake_grads(params, down_side)


def _check_dpre(name, dpre, x, ids, views, activation):
    """The first operator's dA|dB, or an error naming what to pass."""
    h = views[0].rows
    width = (2 if parse_activation(activation).gated else 1) * h
    want = (ids.shape[0] * ids.shape[1], width)
    if tuple(dpre.shape) != want or dpre.dtype != x.dtype:
        raise ValueError(f"moeblaze.{name}: dpre must be moe_ffn_backward_act's dA|dB [T*K, width] = {want} of "
                         f"{x.dtype}; got {tuple(dpre.shape)} of {dpre.dtype}")


def _from_dpre(phase, dpre, x, ids, weights, params, layout, plan, activation, kernel_options):
    """The split backward's second or third operator (``phase`` "dx" or "dw"), from the first one's dA|dB: the
    (dx or None, None, the gate side's gradients, none for "dx") of :func:`_torch_phase` / :func:`_kernel_backward`."""
    name = f"moe_ffn_backward_{phase}"
    if _use_triton(x):
        what, inputs = (name, activation), [dpre, x, ids, weights, *params, *plan]
        key, replayed = _replayed(what, x, kernel_options, layout, params, inputs)
        if replayed is not None:
            return replayed
    E, views, opts, (_, gate_side), path = _split_call(name, x, params, layout, plan, kernel_options)
    _check_dpre(name, dpre, x, ids, views, activation)
    groups = gate_side if phase == "dw" else []
    act = parse_activation(activation)
    if path == "cpu":
        return _torch_phase(phase, None, x, ids, weights, params, views, E, act, None, dpre, groups, opts)
    wkey = _weights_key(params, layout)

    def body():
        bufs = _once(lambda: _grad_buffers(params, views, E, groups))
        experts = _expert_weights(x, params, views, E, wkey)
        return _kernel_backward(None, x, ids, weights, experts, views, E, act, None, False, plan, bufs, 0, opts,
                                phase, dpre)
    with _using(opts, x.dtype):
        return _programmed(x, params, views, wkey, inputs, body, key)


def _from_dpre_fake(phase, dpre, x, ids, params, layout, plan, activation, kernel_options):
    """The gate side's groups of a split-backward call from dA|dB, its arguments checked as the real one checks."""
    name = f"moe_ffn_backward_{phase}"
    _, views, _, (_, gate_side), _ = _split_call(name, x, params, layout, plan, kernel_options)
    _check_dpre(name, dpre, x, ids, views, activation)
    return gate_side


@_operator
def _moe_ffn_backward_dx(
    dpre: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    params: list[Tensor],
    layout: list[int],
    plan: list[Tensor],
    activation: str,
    kernel_options: str = "",
) -> Tensor:
    """The split backward's second operator: dx from the first one's dA|dB (no parameter gradient)."""
    return _from_dpre("dx", dpre, x, ids, weights, params, layout, plan, activation, kernel_options)[0]


@_fake("moe_ffn_backward_dx")
def _moe_ffn_backward_dx_fake(dpre, x, ids, weights, params, layout, plan, activation, kernel_options=""):
    _from_dpre_fake("dx", dpre, x, ids, params, layout, plan, activation, kernel_options)
    return torch.empty_like(x)


@_operator
def _moe_ffn_backward_dw(
    dpre: Tensor,
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    params: list[Tensor],
    layout: list[int],
    plan: list[Tensor],
    activation: str,
    kernel_options: str = "",
) -> list[Tensor]:
    """The split backward's third operator: the gradients of the groups other than the down side's (the gate|up
    weights and their biases) from the first one's dA|dB, x and the plan."""
    return _from_dpre("dw", dpre, x, ids, weights, params, layout, plan, activation, kernel_options)[2]


@_fake("moe_ffn_backward_dw")
def _moe_ffn_backward_dw_fake(dpre, x, ids, weights, params, layout, plan, activation, kernel_options=""):
    return _fake_grads(params, _from_dpre_fake("dw", dpre, x, ids, params, layout, plan, activation, kernel_options))


def _setup_context(ctx, inputs, output):
    x, ids, weights, params, layout, activation, checkpoint, chunk_tokens, kernel_options = inputs
    _y, preact, plan = output
    ctx.layout, ctx.activation, ctx.checkpoint, ctx.chunk_tokens = layout, activation, checkpoint, chunk_tokens
    ctx.kernel_options = kernel_options  # the backward runs with the forward's kernel options
    ctx.plan_len = len(plan)
    ctx.save_for_backward(x, ids, weights, preact, *plan, *params)
    ctx.mark_non_differentiable(preact, *plan)
    # preact never gets a gradient: left to the default, autograd would hand backward a zero-filled [T*K, 2h]
    # for it (at config A of docs/benchmarks.md, 4.3 GB written in every backward, and held through it)
    ctx.set_materialize_grads(False)


class _FirstOrderOnly(torch.autograd.Function):
    """The operator's gradients, as views whose backward refuses: the backward operators have no derivative.
    ``anchor``: a tensor of the call requiring grad, so that the views do."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("moeblaze.moe_ffn: its gradients are not differentiable (no double backward); a second "
                           "derivative needs the model without the MoEBlaze operator (without backend='moeblaze')")


def _backward(ctx, grad_y, _grad_preact, _grad_plan):
    if not torch.is_grad_enabled():  # the usual case (create_graph=False)
        return _gradients(ctx, grad_y)
    anchor = next((t for t in (grad_y, *ctx.saved_tensors) if t is not None and t.requires_grad), None)
    with torch.no_grad():  # (create_graph=True) the backward operators run as usual, their outputs marked
        dx, none, dweights, dparams, *rest = _gradients(ctx, grad_y)
    if anchor is None:
        return (dx, none, dweights, dparams, *rest)
    present = [g for g in (dx, dweights, *dparams) if g is not None]
    marked = iter(_FirstOrderOnly.apply(anchor, *present))
    dx, dweights = (None if g is None else next(marked) for g in (dx, dweights))
    return (dx, none, dweights, [None if g is None else next(marked) for g in dparams], *rest)


def _gradients(ctx, grad_y):
    x, ids, weights, preact, *rest = ctx.saved_tensors
    plan, params = rest[:ctx.plan_len], rest[ctx.plan_len:]
    if grad_y is None:  # y did not reach what is differentiated (gradients are not materialized: see above)
        grad_y = x.new_zeros(x.shape)
    E, views = decode_layout(ctx.layout)
    halves = _split_halves(x, params, ctx.layout, ctx.checkpoint, ctx.chunk_tokens, *ids.shape, len(plan))
    if halves is not None:  # three operators: A|B freed before the gate|up gradient, which dx does not wait for
        args = (params, ctx.layout)
        dpre, dweights, down_grads = torch.ops.moeblaze.moe_ffn_backward_act(
            grad_y, x, ids, weights, *args, preact, plan, ctx.activation, ctx.kernel_options)
        del preact
        dx = torch.ops.moeblaze.moe_ffn_backward_dx(dpre, x, ids, weights, *args, plan, ctx.activation,
                                                    ctx.kernel_options)
        gate_grads = torch.ops.moeblaze.moe_ffn_backward_dw(dpre, x, ids, weights, *args, plan, ctx.activation,
                                                            ctx.kernel_options)
        by_first = dict(zip([f for f, _ in halves[0]], down_grads)) | dict(zip([f for f, _ in halves[1]], gate_grads))
        grads = [by_first[first] for first, _ in _groups(len(params), views, E)]
    else:
        dx, dweights, grads = torch.ops.moeblaze.moe_ffn_backward(
            grad_y, x, ids, weights, params, ctx.layout, preact, plan, ctx.activation, ctx.checkpoint,
            ctx.chunk_tokens, ctx.kernel_options)
    dparams = []  # a per-expert group's gradient is one stacked buffer: its slices are the parameters'
    for g, (_, count) in zip(grads, _groups(len(params), views, E)):
        dparams.extend(g.unbind(0) if count > 1 else [g])
    grads = (dx, None, dweights, dparams, None, None, None, None, None)
    # one for each argument given: the dispatcher drops kernel_options where it equals its default ("")
    return grads[:len(ctx.needs_input_grad)]


torch.library.register_autograd("moeblaze::moe_ffn", _backward, setup_context=_setup_context, lib=_LIB)


def _hf_experts(experts, x: Tensor) -> tuple[Tensor, Tensor]:
    """Hugging Face's ``(w_gate_up [E, 2h, d], w_down [E, d, h])``, checked: each message names the argument."""
    usage = ("experts must be Hugging Face's (w_gate_up [E, 2h, d], w_down [E, d, h]) or an "
             "ExpertParams(gate, up, down, ...) of [E, ...] tensors")
    if not isinstance(experts, (tuple, list)) or len(experts) != 2:
        what = f"a {type(experts).__name__} of {len(experts)}" if isinstance(experts, (tuple, list)) else \
            f"a {type(experts).__name__}"
        hint = (" (separate gate, up and down weights: pass ExpertParams(gate=..., up=..., down=...))"
                if isinstance(experts, (tuple, list)) and len(experts) == 3 else "")
        raise TypeError(f"moeblaze.moe_ffn: {usage}; got {what}{hint}")
    w_gate_up, w_down = experts
    for name, t in (("experts[0] (w_gate_up)", w_gate_up), ("experts[1] (w_down)", w_down)):
        if not isinstance(t, Tensor):
            raise TypeError(f"moeblaze.moe_ffn: {name} must be a tensor; got {type(t).__name__}")
    d = x.shape[-1]
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != d:
        hint = " (a 2-D tensor is one expert's weight: pass all experts' [E, 2h, d])" if w_gate_up.dim() == 2 else ""
        raise ValueError(f"moeblaze.moe_ffn: experts[0] (w_gate_up) must be [E, 2h, d] with d = {d} (x's last "
                         f"dimension); got shape {tuple(w_gate_up.shape)}{hint}")
    E, h = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if w_down.dim() != 3 or tuple(w_down.shape) != (E, d, h):
        hint = " (a 2-D tensor is one expert's weight: pass all experts' [E, d, h])" if w_down.dim() == 2 else ""
        raise ValueError(f"moeblaze.moe_ffn: experts[1] (w_down) must be [E, d, h] = {(E, d, h)} (E and h from "
                         f"w_gate_up, d from x); got shape {tuple(w_down.shape)}{hint}")
    return w_gate_up, w_down


def moe_ffn(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: ExpertParams | tuple[Tensor, Tensor],
    *,
    activation: str = "swiglu",
    checkpoint: str = "activations",
    chunk_tokens: int | None = None,
) -> Tensor:
    """``y[t] = sum_k weights[t,k] * expert_{ids[t,k]}(x[t])`` as one MoEBlaze operator.

    Args:
        x: ``[T, d]`` tokens.
        ids: ``[T, K]`` int32/int64 expert ids; an id ``>= E`` contributes nothing.
        weights: ``[T, K]`` combine weights (any float dtype; differentiable).
        experts: an :class:`~moeblaze_fx.kernels.reference.ExpertParams` of ``[E, ...]`` tensors or
            views of parameters (transposed, sliced, interleaved: gradients reach the parameter
            without copies), or Hugging Face's ``(w_gate_up [E, 2h, d], w_down [E, d, h])``.
        activation: one of ``"swiglu"``, ``"geglu"``, ``"geglu_tanh"`` (Gemma 4: the GELU approximated with
            tanh), ``"swiglu_oai(alpha=A,limit=L)"`` (gpt-oss), ``"swiglu_clamp(limit=L)"`` (DeepSeek-V4:
            ``silu(gate.clamp(max=L)) * up.clamp(-L, L)``), ``"swiglu_softcap(gate=G,up=U)"`` (Inkling 2:
            ``G tanh(gate / G) * sigmoid(gate) * U tanh(up / U)``) (gated: gate and up), ``"silu"``, ``"gelu"``,
            ``"gelu_tanh"``, ``"relu"``, ``"relu2"`` (Nemotron-H: ``relu(gate) ** 2``) (plain: ``experts.up`` is
            None).
        checkpoint: ``"activations"`` (save the pre-activations) or ``"recompute"`` (save only x,
            ids and weights; recompute the up projection in backward).
        chunk_tokens: bounds the transient buffers to those of this many tokens (slot windows of
            ``chunk_tokens * K`` on the Triton path, token chunks on the PyTorch path); None picks
            :func:`default_chunk_tokens`, 0 processes everything at once.

    The kernels run with the kernel options of ``config.current()`` at the call (``moeblaze_fx.patch(kernels=...)``),
    in backward too.
    """
    within = None
    if not isinstance(experts, ExpertParams):
        w_gate_up, w_down = _hf_experts(experts, x)
        experts = ExpertParams(*reference.split_gate_up(w_gate_up), w_down)
        within = [(w_gate_up, 0), (w_gate_up, experts.gate.shape[1] * w_gate_up.stride(1))] + [None] * (len(ROLES) - 2)
    params, layout = layout_of(experts, within)
    if chunk_tokens is None:
        act = parse_activation(activation)
        chunk_tokens = default_chunk_tokens(ids.shape[-1], x.shape[-1], experts.gate.shape[1], act.gated,
                                            x.element_size())
    return torch.ops.moeblaze.moe_ffn(x, ids, weights, params, layout, activation, checkpoint, chunk_tokens,
                                      encode_kernels(_config.current().kernels))[0]
