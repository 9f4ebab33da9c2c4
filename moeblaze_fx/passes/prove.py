"""Step 4: prove a candidate region equal to the MoEBlaze operator.

Structure (shapes and dtypes from fake tensors) is checked by ``extract``; here the region itself is
cut out of the graph as a standalone function of its inputs and run on small random inputs at its
traced sizes (ids drawn as distinct experts per token, the model's own expert weights; for rows grouped by counts,
counts, rows and expert weights all drawn from one fixed seed, the same on every rank), next to the
operator's reference under each layout hypothesis. A hypothesis is accepted only when the output
*and* the gradients of x, the combine weights and every expert parameter agree within the dtype's
tolerance. Wrong layouts, different activations, a detached weight or a dropped token all show up
as errors of order one, far above the tolerances, so the check separates cleanly.

Every random input comes from a local generator seeded with a constant (``PROOF_SEED``), never from the user's: two
ranks compiling the same graph decide alike, and a compile leaves the global random streams where they were.

While the region runs, ``saved_tensors_hooks`` measure the activation bytes eager autograd keeps for
its backward: the report's "before".
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Optional

import torch
import torch.fx as fx

from ..config import float32_matmul_reduced
from ..kernels.reference import Activation, moe_ffn_reference
from ..memory import SavedTensorBytes
from .extract import OUTPUT_WEIGHTED, Extraction, Layout, Routing, float_hint, ids_from_counts
from .find import Candidate, example_value, same_size, size_hint
from .normalize import role

__all__ = ["Proof", "region_module", "prove", "TOLERANCE", "tolerance", "traced_with_gradients", "is_mixed",
           "PROOF_SEED"]

# Relative error ||region - reference|| / ||reference|| accepted per dtype. The reference runs the
# same dtype with float32 accumulation; a wrong layout or function gives errors near 1. float32 gets 1e-4 where its
# matrix products run in float32 (correct regions of 59 Hugging Face families measured at most 4.2e-6 on the CPU,
# 2026-11-26), 2e-3 where they may run in TF32 or bf16 (torch.set_float32_matmul_precision below "highest", or the
# device's fp32_precision: config.float32_matmul_reduced): a near-miss such as the tanh-approximated GELU (4e-5) or a
# soft-cap near the identity (2e-3) must not pass where the precision allows telling it apart.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
FLOAT32_EXACT_TOLERANCE = 1e-4


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and not float32_matmul_reduced(device.type):
        return FLOAT32_EXACT_TOLERANCE
    return TOLERANCE[dtype]


@dataclasses.dataclass
class Proof:
    layout: Optional[Layout]
    activation: Optional[Activation] = None
    reason: Optional[str] = None  # why not proven
    forward_error: Optional[float] = None
    gradient_errors: dict[str, float] = dataclasses.field(default_factory=dict)
    saved_bytes_before: Optional[int] = None  # measured on the original region
    # the graph was traced with no gradient to compute (under torch.no_grad, or nothing requires grad): Dynamo runs
    # it only so, and only the forward was compared
    forward_only: bool = False
    routing: Routing = OUTPUT_WEIGHTED  # how the proven region applies its combine weights


def region_module(gm: fx.GraphModule, cand: Candidate) -> fx.GraphModule:
    """The region as its own GraphModule: placeholders for ``cand.inputs``, output ``cand.output``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in cand.inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in cand.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[cand.output])
    return fx.GraphModule(gm, graph)


def _concrete_shape(val: torch.Tensor) -> list[int]:
    return [size_hint(s) for s in val.shape]


# Elements of one float64 chunk in _rel_error. Whole float64 copies of an expert weight's gradient, [64, 4096, 7168]
# in DeepSeek-V3's blocks with 64 experts, are 14 GiB each: three of them ran the second block's proof out of an
# 80 GB H100's memory, and the block was skipped (2026-11-27).
ERROR_CHUNK = 1 << 24


def _rel_error(a: Optional[torch.Tensor], b: Optional[torch.Tensor], like: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||) in float64 (None: zeros shaped as ``like``), over chunks of :data:`ERROR_CHUNK`
    elements, so that no float64 copy of a whole gradient is made."""
    a = None if a is None else a.detach().reshape(-1)
    b = None if b is None else b.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=like.device)  # ||a||^2, ||b||^2, ||a - b||^2
    for i in range(0, like.numel(), ERROR_CHUNK):
        ca = a[i: i + ERROR_CHUNK].double() if a is not None else None
        cb = b[i: i + ERROR_CHUNK].double() if b is not None else None
        diff = ca if cb is None else cb.neg() if ca is None else ca - cb
        sums += torch.stack([(c.square().sum() if c is not None else sums.new_zeros(()))
                             for c in (ca, cb, diff)])
    norm_a, norm_b, norm_diff = sums.sqrt().tolist()
    return norm_diff / max(norm_b, norm_a, 1e-30)


def _strided_like(val: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` in ``val``'s dtype and shape, and its strides where they are dense (the region may view its inputs
    as the traced ones allow: ``ids.view(-1)`` needs contiguous ids, as topk's are)."""
    shape, stride = _concrete_shape(val), [size_hint(s) for s in val.stride()]
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size != 1 and step != expected:  # overlapping or with gaps: contiguous instead
            return data.to(val.dtype).reshape(shape).contiguous()
        expected *= size
    return torch.empty_strided(shape, stride, dtype=val.dtype, device=data.device).copy_(data.reshape(shape))


def _inputs(cand: Candidate, ext: Extraction, real: dict[fx.Node, Any], gen: torch.Generator):
    x_val = example_value(ext.x)
    device = x_val.device
    T = size_hint(ext.T)
    values: dict[fx.Node, Any] = {}
    for node in cand.inputs:
        val = example_value(node)
        if node is ext.ids:
            choice = torch.rand(T, ext.E, generator=gen, device=device).argsort(dim=1)[:, : ext.K]
            values[node] = _strided_like(val, choice)
        elif node is ext.x:
            values[node] = _strided_like(val, torch.randn(_concrete_shape(val), generator=gen, device=device))
        elif node is ext.weights:
            values[node] = _strided_like(val, torch.rand(_concrete_shape(val), generator=gen, device=device))
        elif isinstance(real.get(node, val), torch.SymInt):
            values[node] = size_hint(real.get(node, val))
        elif isinstance(val, torch.SymFloat) and node not in real:  # a traced float: its value in this compile
            values[node] = float_hint(node)
        elif node in real:
            values[node] = real[node]
        elif isinstance(val, torch.Tensor):
            values[node] = torch.zeros(_concrete_shape(val), dtype=val.dtype, device=val.device)
        else:
            values[node] = val
    return values


# Rows the proof of a count-grouped region runs with when their number is data-dependent (the token all-to-all's
# output): not a multiple of anything
GROUPED_PROOF_ROWS = 29


def _grouped_inputs(cand: Candidate, ext: Extraction, gen: torch.Generator, T: int) -> dict[fx.Node, Any]:
    """Inputs of a region over rows grouped by counts (``Candidate.counts_grouped``), the same on every rank: rows,
    counts summing to T over G*E groups (group 1 left empty), and the expert parameters drawn from ``gen`` too
    (under expert parallelism each rank holds other experts; its own would make the decision rank-dependent)."""
    device = example_value(ext.x).device
    values: dict[fx.Node, Any] = {}
    for node in cand.inputs:
        val = example_value(node)
        if node is ext.ids:
            groups = val.shape[0]
            member = torch.randint(0, groups, (T,), generator=gen, device=device)
            if groups > 2:
                member = torch.where(member == 1, 0, member)  # an empty group between two others
            values[node] = torch.bincount(member, minlength=groups).to(val.dtype)
        elif node is ext.x:
            values[node] = torch.randn(T, ext.d, generator=gen, device=device).to(val.dtype).reshape(T, ext.d)
        elif isinstance(val, torch.Tensor) and val.is_floating_point():  # a parameter
            shape = _concrete_shape(val)
            values[node] = _strided_like(val, torch.randn(shape, generator=gen, device=device) / shape[-1] ** 0.5)
        elif isinstance(val, torch.SymInt) and same_size(val, ext.T):
            values[node] = T
        elif isinstance(val, (torch.SymInt, torch.Tensor)):
            values[node] = size_hint(val) if isinstance(val, torch.SymInt) else torch.zeros(
                _concrete_shape(val), dtype=val.dtype, device=val.device)
        else:
            values[node] = val
    return values


def is_mixed(ext: Extraction) -> bool:
    """Whether the tokens or an expert weight reach the experts in another dtype than the one they compute in."""
    dtypes = {example_value(ext.x).dtype} | {example_value(p).dtype for role in ext.roles for p in role.params}
    return dtypes != {ext.dtype}


def traced_with_gradients(cand: Candidate) -> bool:
    """Whether the region's output needed a gradient when traced. Dynamo guards a graph on the grad mode and on its
    inputs' requires_grad, so a graph traced without (under torch.no_grad, or with nothing requiring grad) never
    runs a backward."""
    return bool(example_value(cand.output).requires_grad)


def _beyond_limit(region, args, x_arg, x2d, reference, experts, act, T: int, d: int) -> float:
    """Forward error between the region and ``reference`` (the operator's function of the tokens) with the tokens
    scaled so that the largest gate or up pre-activation is 4x the activation's clamp limit. At the check's plain
    inputs a limit of 7 (gpt-oss) is seldom reached, and a limit read wrongly from the graph (another clamp's
    constant) would pass unseen."""
    with torch.no_grad():
        rows = x2d[:256].float()
        pre = max((rows @ w.float().reshape(-1, d).T).abs().amax().item()
                  for w in (experts.gate, experts.up) if w is not None)
        if not pre > 0:
            return 0.0
        scale = 4 * act.limit / pre
        scaled = [(a.detach() * scale) if a is x_arg else a for a in args]
        y_region = region(*scaled).reshape(T, d)
        y_ref = reference(x2d.detach() * scale)
        return _rel_error(y_region.to(y_ref.dtype), y_ref, y_ref)


# The seed of every random draw of a proof. A constant, so that every rank compiling the same graph draws the same
# inputs and decides alike (a rank that accepts a region while another rejects it would run other collectives).
PROOF_SEED = 0


@contextlib.contextmanager
def _fixed_global_rng(device: torch.device):
    """The proof's own draws use a local generator seeded with PROOF_SEED; anything in the region that draws from
    the global generators (an op the finder did not know as random) draws from them seeded with PROOF_SEED too. The
    user's generator states (the CPU's and ``device``'s) are restored afterwards: compiling does not move their
    random stream."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(PROOF_SEED)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(PROOF_SEED)
        yield


def prove(gm: fx.GraphModule, cand: Candidate, ext: Extraction, real: dict[fx.Node, Any]) -> Proof:
    """Find the layout and activation under which the region equals the operator (forward and gradients)."""
    # innermost no-op hooks: a caller's saved_tensors_hooks must not see the proof's tensors
    with _fixed_global_rng(example_value(ext.x).device), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return _prove(gm, cand, ext, real)


def _prove(gm: fx.GraphModule, cand: Candidate, ext: Extraction, real: dict[fx.Node, Any]) -> Proof:
    if any(role(n) == "collective" for n in cand.nodes):  # find leaves these alone; never run one here
        return Proof(None, reason="the region holds a collective, which is never run at compile time")
    for node in cand.inputs:
        if node in real and isinstance(real[node], torch._subclasses.FakeTensor):
            return Proof(None, reason="the backend was given fake inputs, so the region cannot be run to check it; "
                                      "compile outside FakeTensorMode to have it checked and rewritten")
    grouped = ext.weights is None  # rows grouped by counts: ids from the counts, unit weights
    try:
        T = size_hint(ext.T, unbacked=GROUPED_PROOF_ROWS if grouped else None)
    except Exception:  # an unbacked token count has no hint
        return Proof(None, reason=f"the token count {ext.T} has no concrete hint to check the region with; "
                                  "compile with a concrete token count (dynamic=False) to have it rewritten")
    region = region_module(gm, cand)
    gen = torch.Generator(device=example_value(ext.x).device).manual_seed(PROOF_SEED)
    try:
        values = _grouped_inputs(cand, ext, gen, T) if grouped else _inputs(cand, ext, real, gen)
    except Exception as exc:  # a size without a hint (unbacked, not the rows')
        return Proof(None, reason=f"the region reads a size with no concrete value to check it with "
                                  f"({type(exc).__name__}: {exc}); nothing can be changed")
    device = example_value(ext.x).device
    tol = tolerance(ext.dtype, device)
    # the tokens or a weight reach the experts in another dtype than the one they compute in (autocast, casts in
    # forward): the region is judged at its compute dtype's tolerance against a float32 evaluation of the function
    mixed = is_mixed(ext)

    leaves: dict[str, torch.Tensor] = {}
    args = []
    for node in cand.inputs:
        v = values[node]
        if isinstance(v, torch.Tensor) and v.is_floating_point() and (node in (ext.x, ext.weights) or node in real):
            v = v.detach().requires_grad_(True)
            leaves[node.name] = v
        args.append(v)
    by_node = dict(zip(cand.inputs, args))
    param_values = [[by_node[p] for p in role.params] for role in ext.roles]

    meter = SavedTensorBytes([by_node[p] for role in ext.roles for p in role.params])
    with torch.enable_grad(), meter:
        try:
            y_region = region(*args)
        except Exception as exc:  # the region's own code failed on fresh inputs
            return Proof(None, reason=f"running the region on random inputs failed: {type(exc).__name__}: {exc}; "
                                      "nothing can be changed")
    saved_before = meter.total

    x2d = by_node[ext.x].reshape(T, ext.d)
    if grouped:
        ids2d = ids_from_counts(by_node[ext.ids], x2d, ext.E)
        w2d = x2d.detach().new_ones((T, 1))
    else:
        w2d = by_node[ext.weights].reshape(T, ext.K)
        ids2d = by_node[ext.ids].reshape(T, ext.K)
    if y_region.numel() != T * ext.d:
        return Proof(None, reason=f"the region's output has {y_region.numel()} elements, expected T*d = "
                                  f"{T * ext.d}; nothing can be changed")

    def eager(fn, *a):
        return fn(*a)

    # no backward will run (the region's own backward may not even be recorded then): the forward alone is compared
    forward_only = not traced_with_gradients(cand)
    best: Optional[Proof] = None
    wide = torch.promote_types(ext.dtype, torch.float32)  # a mixed region is judged in float32 (float64 stays)
    with torch.enable_grad():
        stacked = [torch.stack(vals) if role.stacked else vals[0] for role, vals in zip(ext.roles, param_values)]
        if mixed:
            stacked = [v.to(wide) for v in stacked]
        for layout, act, routing in itertools.product(ext.layouts, ext.activations, ext.routings):
            if act.gated != (layout.up is not None):
                continue
            experts = layout.experts(stacked)

            def reference(x):
                """The operator's function of the tokens, under this hypothesis (called within this iteration)."""
                xr, wr = routing.apply(x.to(wide) if mixed else x, w2d)
                # the region runs under the autocast it was traced in (as it will run); the reference never does
                with torch.autocast(device.type, enabled=False):
                    return moe_ffn_reference(xr, ids2d, wr, experts, act)

            y_ref = reference(x2d)
            if not bool(y_ref.detach().abs().amax() > 0):
                return Proof(None, reason="the operator's output is zero on the check's inputs (zero expert "
                                          "weights?): nothing would be proven; initialise the expert weights "
                                          "before compiling", saved_bytes_before=saved_before)
            err = _rel_error(y_region.reshape(T, ext.d).to(y_ref.dtype), y_ref, y_ref)
            if err > tol:
                if best is None or (best.forward_error or 1e9) > err:
                    best = Proof(None, reason=f"the region's output differs from the MoE operator (relative "
                                              f"error {err:.2g} > {tol:g} for every layout and activation tried): "
                                              f"another function, nothing can be changed",
                                 forward_error=err)
                continue
            if act.limit > 0:  # the clamp must be reached for its limit to be proven (see _beyond_limit)
                beyond = _beyond_limit(region, args, by_node[ext.x], x2d, reference, experts, act, T, ext.d)
                if beyond > tol:
                    best = Proof(None, reason=f"the region's output differs from the MoE operator with "
                                              f"{act.spec} once the pre-activations pass its limit (relative "
                                              f"error {beyond:.2g} > {tol:g}): nothing can be changed",
                             forward_error=beyond)
                    continue
            if forward_only:
                ext.h = int(experts.gate.shape[1])
                return Proof(layout, act, None, err, {}, saved_before, forward_only=True, routing=routing)
            names = list(leaves)
            g = torch.randn(y_ref.shape, generator=gen, device=y_ref.device).to(y_ref.dtype)
            try:  # a backward runs outside the forward's autocast (as loss.backward() after the autocast block)
                with torch.autocast(device.type, enabled=False):
                    grads_region = torch.autograd.grad(
                        y_region, list(leaves.values()), g.reshape(y_region.shape).to(y_region.dtype),
                        retain_graph=True, allow_unused=True,
                    )
            except RuntimeError as exc:
                return Proof(None, reason=f"the region's output is not differentiable: {exc}; nothing can be changed",
                             forward_error=err)
            with torch.autocast(device.type, enabled=False):
                grads_ref = torch.autograd.grad(y_ref, list(leaves.values()), g, retain_graph=True, allow_unused=True)
            errors = {n: _rel_error(a, b, leaves[n]) for n, a, b in zip(names, grads_region, grads_ref)}
            del grads_region, grads_ref  # as large as the expert weights: not kept into the next hypothesis
            bad = {n: e for n, e in errors.items() if e > 2 * tol}
            if bad:
                worst = max(bad, key=bad.get)
                best = Proof(None, reason=f"outputs agree but the gradient of {worst} differs (relative error "
                                          f"{bad[worst]:.2g} > {2 * tol:g}): nothing can be changed", forward_error=err,
                             gradient_errors=errors)
                continue
            ext.h = int(experts.gate.shape[1])
            return Proof(layout, act, None, err, errors, saved_before, routing=routing)
    if best is None:
        best = Proof(None, reason="no layout hypothesis had consistent shapes; nothing can be changed")
    best.saved_bytes_before = saved_before
    return best
