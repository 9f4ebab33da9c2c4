"""Interleaved gate/up weights (gpt-oss): ``gate_up_proj [E, d, 2h]`` with gate = columns 0::2 and up = 1::2, its
bias ``[E, 2h]`` interleaved the same way, ``down_proj [E, h, d]`` with bias ``[E, d]``, the clamped SwiGLU.

The kernels read and write that storage as one 2h-wide matrix per expert (``tables.interleaved_gate_up``): the up
kernel's INTERLEAVED path reads it, and with A|B and dA|dB interleaved alike (the up and dh kernels' epilogues split
and join adjacent columns) dX is one down launch over 2h against the [2h, d] matrices (``tables.interleaved_table``)
and dW_gate|up one plain dW launch into the [d, 2h] gradient. CPU: the Triton interpreter (tests/conftest.py) in
float32 and float16 (its bf16 dot is wrong), forward and every gradient against ``moe_ffn_reference`` differentiated
by autograd in float64. GPU (``cuda`` marker): bf16, the same checks, on the default backends (Gluon where it
applies)."""
from __future__ import annotations

import pytest
import torch
import triton

import moeblaze_fx

from moeblaze_fx.kernels import autotune
from moeblaze_fx.kernels.backward import expert_backward
from moeblaze_fx.kernels.autotune import plan_block_m
from moeblaze_fx.kernels.forward import expert_forward
from moeblaze_fx.kernels import plan as kplan
from moeblaze_fx.kernels.sm90 import common as sm90_common
from moeblaze_fx.kernels.sm90 import down as sm90_down
from moeblaze_fx.kernels.sm90 import dw as sm90_dw
from moeblaze_fx.kernels.sm90 import gather as sm90_gather
from moeblaze_fx.kernels.triton import common as tcommon
from moeblaze_fx.kernels.triton import dh as tdh
from moeblaze_fx.kernels.triton import dw as tdw
from moeblaze_fx.kernels.reference import ExpertParams, dispatch_reference, moe_ffn_reference, parse_activation
from moeblaze_fx.kernels.tables import ExpertTables, interleaved_gate_up, table_of
from moeblaze_fx.layout import RoleView, encode_layout

GPT_OSS = "swiglu_oai(alpha=1.702,limit=7.0)"
# limit 0.6: both clamps active on many elements of unit-variance pre-activations
CLAMPED = "swiglu_oai(alpha=1.702,limit=0.6)"


def make_case(T, d, h, E, K, *, act=CLAMPED, bias=True, dtype=torch.float32, device="cpu", ids_mode="random",
              seed=0):
    """gpt-oss's parameters as stored, the routing and dy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    if ids_mode == "empty_expert":  # expert 1 gets no token
        ids = torch.where(ids == 1, 0, ids)
    elif ids_mode == "sentinel":  # ids >= E: no expert; token 0 routed nowhere
        ids = torch.where(torch.rand(T, K, generator=g) < 0.3, E, ids)
        ids[0] = E
    weights = torch.rand(T, K, generator=g) + 0.1
    storage = {"gate_up": torch.randn(E, d, 2 * h, generator=g) / d ** 0.5,
               "down": torch.randn(E, h, d, generator=g) / h ** 0.5}
    if bias:
        storage["gate_up_bias"] = 0.5 * torch.randn(E, 2 * h, generator=g)
        storage["down_bias"] = 0.5 * torch.randn(E, d, generator=g)
    grad_y = torch.randn(T, d, generator=g)
    return dict(x=x.to(device, dtype), ids=ids.to(device), weights=weights.to(device, dtype),
                grad_y=grad_y.to(device, dtype), storage={k: v.to(device, dtype) for k, v in storage.items()},
                act=act, E=E, h=h)


def roles(storage: dict) -> ExpertParams:
    """The roles as views of the storage (gate, up [E, h, d]; down [E, d, h]; biases [E, n])."""
    gu = storage["gate_up"].transpose(1, 2)  # [E, 2h, d]: rows 0::2 gate, 1::2 up
    b = storage.get("gate_up_bias")
    return ExpertParams(gu[:, 0::2], gu[:, 1::2], storage["down"].transpose(1, 2),
                        None if b is None else b[:, 0::2], None if b is None else b[:, 1::2],
                        storage.get("down_bias"))


def tables_of_roles(p: ExpertParams) -> ExpertTables:
    return ExpertTables(table_of(p.gate), table_of(p.up), table_of(p.down))


def run_kernels(case, policy, window_slots=0, storage=None):
    act = parse_activation(case["act"])
    storage = case["storage"] if storage is None else storage
    p = roles(storage)
    w = tables_of_roles(p)
    biases = [None if b is None else b.contiguous() for b in (p.gate_bias, p.up_bias, p.down_bias)]
    plan = dispatch_reference(case["ids"], case["E"], block_m=plan_block_m())
    y, preact = expert_forward(case["x"], case["weights"], w, plan, act, policy == "activations", *biases,
                               window_slots=window_slots)
    grads = {k: torch.full_like(v, float("nan")) for k, v in storage.items()}  # an unwritten element shows
    gp = roles(grads)
    dx, dweights, dbg, dbu, dbd = expert_backward(case["grad_y"], case["x"], case["weights"], w, preact, plan, act,
                                                  *biases, grads=tables_of_roles(gp),
                                                  recompute=policy == "recompute", window_slots=window_slots)
    if "gate_up_bias" in storage:  # the bias gradients, put back into the interleaved [E, 2h] storage
        grads["gate_up_bias"] = torch.stack([dbg, dbu], dim=-1).flatten(1)
        grads["down_bias"] = dbd
    return y, dict(x=dx, weights=dweights, **grads)


def run_reference(case):
    def leaf(t):
        return t.detach().double().requires_grad_(True)
    x, weights = leaf(case["x"]), leaf(case["weights"])
    storage = {k: leaf(v) for k, v in case["storage"].items()}
    y = moe_ffn_reference(x, case["ids"], weights, roles(storage), case["act"])
    y.backward(case["grad_y"].double())
    return y.detach(), dict(x=x.grad, weights=weights.grad, **{k: v.grad for k, v in storage.items()})


def rel_err(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return float((out - ref).norm() / ref.norm()) if ref.norm() > 0 else float(out.norm())


def check(case, policy, tol, window_slots=0):
    y, got = run_kernels(case, policy, window_slots)
    y_ref, want = run_reference(case)
    errs = {"y": rel_err(y, y_ref)} | {k: rel_err(got[k], want[k]) for k in want}
    assert set(errs) == {"y", "x", "weights", *case["storage"]}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"


def _interleaved_flags(monkeypatch):
    """Record every Triton launch as (kind, INTERLEAVED, TWO_B); in ``.modes`` (kind, INTERLEAVED, the descriptor
    mode or flag: W_TMA, B_TMA or TMA)."""
    seen = _Seen()
    launch = autotune.launch

    def spy(kernel, tuned_kernel, kind, *args, **kwargs):
        seen.append((kind, kwargs.get("INTERLEAVED"), kwargs.get("TWO_B")))
        modes.append((kind, kwargs.get("INTERLEAVED"), kwargs.get("W_TMA", kwargs.get("B_TMA", kwargs.get("TMA")))))
        return launch(kernel, tuned_kernel, kind, *args, **kwargs)

    modes = []
    monkeypatch.setattr(autotune, "launch", spy)
    seen.modes = modes
    return seen


class _Seen(list):
    modes: list


# ---------------------------------------------------------------------------------------------
# CPU (interpreter)
# ---------------------------------------------------------------------------------------------
# (T, d, h, E, K, ids_mode, window_slots): the interpreter's tiles are 16 wide
CASES = [
    (37, 40, 24, 5, 4, "empty_expert", 0),  # d, h not multiples of the tile; an empty expert; K = 4
    (23, 24, 40, 5, 1, "empty_expert", 0),  # K = 1
    (29, 32, 32, 4, 2, "sentinel", 0),  # d, h multiples of the tile (mask-free paths); unrouted pairs
    (37, 40, 24, 5, 4, "empty_expert", 41),  # windows of 41 of the 148 slots: experts spanning windows
    (23, 24, 40, 5, 1, "sentinel", 7),  # many small windows, K = 1
]


@pytest.mark.parametrize("policy", ["activations", "recompute"])
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,window_slots", CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-E{c[3]}K{c[4]}-{c[5]}-w{c[6]}" for c in CASES])
def test_interleaved_matches_reference(monkeypatch, T, d, h, E, K, ids_mode, window_slots, policy):
    seen = _interleaved_flags(monkeypatch)
    case = make_case(T, d, h, E, K, ids_mode=ids_mode, seed=T + K)
    check(case, policy, tol=1e-5, window_slots=window_slots)
    windows = tcommon.num_slot_windows(T * K, window_slots)
    # every up launch on the interleaved path (under "recompute" A|B computed again by the up kernel, then dh as
    # under "activations", never the dh kernel's own strided recomputation); per window one B for Y and one for dX
    # (over 2h), and two dW launches (down; gate and up together)
    ups = 2 if policy == "recompute" else 1
    assert [s for s in seen if s[0] == "up"] == [("up", True, None)] * (ups * windows)
    kinds = [s[0] for s in seen]
    assert kinds.count("dh_gemm") == kinds.count("dh_act") == windows and "dh_recompute" not in kinds
    assert [s for s in seen if s[0] == "down"] == [("down", None, False)] * (2 * windows)
    assert [s for s in seen if s[0] == "dw"] == [("dw", None, None)] * (2 * windows)
    # the weights' 16-byte aligned rows (2h * 4 bytes, h % 2 == 0) take descriptors: up's over [d, 2h] (mode 1),
    # Y's over down_proj [E, h, d] (mode 1), dX's over [2h, d] read transposed (mode 2), dW's over dA|dB
    assert {m for m in seen.modes if m[0] in ("up", "down", "dw")} == {("up", True, 1), ("down", None, 1),
                                                                       ("down", None, 2), ("dw", None, True)}


@pytest.mark.parametrize("policy", ["activations", "recompute"])
@pytest.mark.parametrize("case_index", [0, 2], ids=["ragged", "even"])
def test_interleaved_through_pointers(monkeypatch, case_index, policy):
    # Without tensor descriptors (devices before sm_90, a base or row stride that is not 16-byte aligned): the
    # interleaved tiles through pointer loads, ragged (masked, wrapped columns) and even.
    monkeypatch.setattr(tcommon, "tma_available", lambda device: False)
    monkeypatch.setattr(tdw, "tma_available", lambda device: False)
    seen = _interleaved_flags(monkeypatch)
    T, d, h, E, K, ids_mode, window_slots = CASES[case_index]
    case = make_case(T, d, h, E, K, ids_mode=ids_mode, seed=T + K + 1)
    check(case, policy, tol=1e-5, window_slots=window_slots)
    assert {m for m in seen.modes if m[0] in ("up", "down", "dw")} == {("up", True, 0), ("down", None, 0),
                                                                       ("dw", None, False)}


@pytest.mark.parametrize("policy", ["activations", "recompute"])
def test_interleaved_wide_tiles_past_a_descriptor_block(policy):
    # A pinned configuration whose interleaved tiles would exceed a descriptor's 256-element block (up's
    # 2 x block_n columns): those tiles load through pointers, the results unchanged.
    from moeblaze_fx.config import KernelOptions

    case = make_case(37, 40, 24, 5, 4, ids_mode="empty_expert", seed=12)
    with autotune.using(KernelOptions(kernel_config="block_m=16,block_n=256,block_k=256,num_warps=4")):
        check(case, policy, tol=1e-5)


def test_interleaved_recompute_inside_dh_when_not_split(monkeypatch):
    # DH_SPLIT = False (one fused dh launch, kept for comparisons): "recompute" keeps the dh kernel's own
    # recomputation of A|B, through the strided gate and up tables; still every gradient as the reference's.
    monkeypatch.setattr(tdh, "DH_SPLIT", False)
    seen = _interleaved_flags(monkeypatch)
    case = make_case(37, 40, 24, 5, 4, ids_mode="empty_expert", seed=11)
    check(case, "recompute", tol=1e-5, window_slots=41)
    kinds = [s[0] for s in seen]
    assert kinds.count("dh_recompute") == kinds.count("up") == 4


def test_interleaved_plan_fuses_dh_where_the_gluon_kernel_may(monkeypatch):
    # The fused Gluon dh (its GEMM and the activation's epilogue in one launch) takes interleaved A|B too, under
    # "activations" over the saved A|B and under "recompute" over the A|B the Triton up kernel computed again into
    # the dA|dB buffer. The plan's choice alone: the kernels' views and the window's buffers stand in.
    t, view = torch.empty(8, 8), object()
    act = parse_activation(GPT_OSS)
    for name in ("dh_usable", "dh_act_usable"):
        monkeypatch.setattr(sm90_gather, name, lambda *args: True)
    saved = kplan.BackwardPlan([], None, view, None, None, recompute=False, split=True, biased=True, pairs=True)
    assert saved.dh_launches(t, t, t, t, t, t, act, 64) == [("sm90.dh_act", None, 0)]
    again = saved._replace(recompute=True, up_mode=(16, 1))
    assert again.dh_launches(t, t, t, t, t, t, act, 64) == [("triton.up", None, 0), ("sm90.dh_act", None, 0)]
    monkeypatch.setattr(sm90_gather, "dh_act_usable", lambda *args: False)  # e.g. h % 16 != 0: two launches
    assert saved.dh_launches(t, t, t, t, t, t, act, 64) == [("sm90.dh", None, 0), ("triton.dh", "dh_act", 2)]


@pytest.mark.parametrize("policy", ["activations", "recompute"])
def test_interleaved_float16(policy):
    case = make_case(37, 40, 24, 5, 2, ids_mode="empty_expert", dtype=torch.float16, seed=3)
    check(case, policy, tol=2e-3)


def test_interleaved_without_biases_gpt_oss_limit():
    case = make_case(29, 24, 40, 3, 2, act=GPT_OSS, bias=False, seed=4)
    check(case, "activations", tol=1e-5)


def test_interleaved_detection():
    w = torch.zeros(4, 16, 2 * 8)  # gpt-oss: [E, d, 2h]
    gu = w.transpose(1, 2)
    gate, up = table_of(gu[:, 0::2]), table_of(gu[:, 1::2])
    assert interleaved_gate_up(gate, up)
    assert not interleaved_gate_up(up, gate)  # up before gate
    assert not interleaved_gate_up(gate, None)
    assert not interleaved_gate_up(gate, table_of(torch.zeros(4, 16, 16).transpose(1, 2)[:, 1::2]))  # another tensor
    rows = torch.zeros(4, 2 * 8, 16)  # interleaved rows of [E, 2h, d]: row stride 2d, not 2
    assert not interleaved_gate_up(table_of(rows[:, 0::2]), table_of(rows[:, 1::2]))
    fused = torch.zeros(4, 16, 2 * 8)  # gate columns, then up's: adjacent blocks, not interleaved
    assert not interleaved_gate_up(table_of(fused[:, :, :8].transpose(1, 2)), table_of(fused[:, :, 8:].transpose(1, 2)))
    wide = torch.zeros(4, 16, 2 * 8 + 4)[:, :, :16].transpose(1, 2)  # rows padded to 20: still one [2h, d] each
    assert interleaved_gate_up(table_of(wide[:, 0::2]), table_of(wide[:, 1::2]))
    g = tdw.interleaved_grad_table(gate, up)
    assert (g.rows, g.cols, g.stride_r, g.stride_c) == (16, 16, 16, 1) and torch.equal(g.ptrs, gate.ptrs)


@pytest.mark.parametrize("style", ["dense", "fused", "interleaved_rows"])
def test_other_layouts_take_the_strided_paths(monkeypatch, style):
    seen = _interleaved_flags(monkeypatch)
    E, d, h = 3, 24, 20
    g = torch.Generator().manual_seed(5)
    if style == "dense":
        gate, up = torch.randn(E, h, d, generator=g), torch.randn(E, h, d, generator=g)
    elif style == "fused":
        gate, up = torch.randn(E, 2 * h, d, generator=g).split(h, dim=1)
    else:
        both = torch.randn(E, 2 * h, d, generator=g)
        gate, up = both[:, 0::2], both[:, 1::2]
    down = torch.randn(E, d, h, generator=g)
    x, ids, wts = torch.randn(19, d, generator=g), torch.randint(0, E, (19, 2), generator=g), torch.rand(19, 2)
    w = ExpertTables(table_of(gate), table_of(up), table_of(down))
    plan = dispatch_reference(ids, E, block_m=plan_block_m())
    y, preact = expert_forward(x, wts, w, plan, "swiglu", True)
    grads = ExpertTables(*(table_of(torch.empty_like(t)) for t in (gate, up, down)))
    expert_backward(torch.randn_like(x), x, wts, w, preact, plan, "swiglu", grads=grads, recompute=False)
    # the up kernel's strided path, and dX as two B (dA's and dB's halves)
    assert [s for s in seen if s[0] == "up"] == [("up", False, None)]
    assert sorted(s for s in seen if s[0] == "down") == [("down", None, False), ("down", None, True)]


@pytest.mark.parametrize("weights_interleaved", [True, False], ids=["weights-interleaved", "grads-interleaved"])
def test_interleaved_weights_or_gradients_alone(monkeypatch, weights_interleaved):
    # Only one of the weights and the gradient tables interleaved: dA|dB follows the weights, and the gate and up
    # gradients take a launch each through dA's and dB's columns (strided views where dA|dB is interleaved).
    seen = _interleaved_flags(monkeypatch)
    case = make_case(37, 40, 24, 5, 4, ids_mode="empty_expert", seed=21)
    E, h = case["E"], case["h"]
    act = parse_activation(case["act"])
    stored = roles(case["storage"])
    dense = ExpertParams(*[None if t is None else t.contiguous() for t in stored])  # the same values, gate|up apart
    p = stored if weights_interleaved else dense
    biases = [None if b is None else b.contiguous() for b in (p.gate_bias, p.up_bias, p.down_bias)]
    plan = dispatch_reference(case["ids"], E, block_m=plan_block_m())
    y, preact = expert_forward(case["x"], case["weights"], tables_of_roles(p), plan, act, True, *biases)
    if weights_interleaved:
        g = {"gate": torch.empty(E, h, 40), "up": torch.empty(E, h, 40), "down": torch.empty(E, 40, h)}
        grads = ExpertTables(table_of(g["gate"]), table_of(g["up"]), table_of(g["down"]))
    else:
        gs = roles({"gate_up": torch.empty(E, 40, 2 * h), "down": torch.empty(E, h, 40)})
        grads = tables_of_roles(gs)
        g = {"gate": gs.gate, "up": gs.up, "down": gs.down}
    dx, dweights, dbg, dbu, dbd = expert_backward(case["grad_y"], case["x"], case["weights"], tables_of_roles(p),
                                                  preact, plan, act, *biases, grads=grads, recompute=False)
    y_ref, want = run_reference(case)
    wref = roles(want)
    assert rel_err(y, y_ref) <= 1e-5 and rel_err(dx, want["x"]) <= 1e-5 and rel_err(dweights, want["weights"]) <= 1e-5
    for name in ("gate", "up", "down"):
        assert rel_err(g[name], getattr(wref, name)) <= 1e-5, name
    assert rel_err(dbg, wref.gate_bias) <= 1e-5 and rel_err(dbu, wref.up_bias) <= 1e-5
    assert [s[0] for s in seen].count("dw") == 3  # down, gate, up
    assert [s for s in seen if s[0] == "up"] == [("up", weights_interleaved, None)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the Triton path on CPU tensors through the interpreter")
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_operator_over_gpt_oss_storage_in_the_interpreter(monkeypatch, checkpoint):
    """The operator (layout views of gpt-oss's four parameters) on its kernel path, slot windows included (the
    weight gradients of experts spanning windows added to in place, or in float32 buffers of the same interleaved
    layout), against the reference."""
    from moeblaze_fx import ops

    seen = _interleaved_flags(monkeypatch)
    monkeypatch.setattr(ops, "_use_triton", lambda x: True)

    def block_m(device, options=None, dtype=None):
        with autotune.using(options if options is not None else ops._config.current().kernels, dtype):
            return autotune.plan_block_m()

    monkeypatch.setattr(ops, "plan_block_m", block_m)
    T, d, h, E, K = 160, 24, 20, 4, 2
    case = make_case(T, d, h, E, K, ids_mode="sentinel", seed=9)
    params = [case["storage"][k].clone().requires_grad_() for k in ("gate_up", "down", "gate_up_bias", "down_bias")]
    views = [RoleView(0, 1, 0, d * 2 * h, 2, 2 * h, h, d), RoleView(0, 1, 1, d * 2 * h, 2, 2 * h, h, d),
             RoleView(1, 1, 0, h * d, 1, d, d, h), RoleView(2, 1, 0, 2 * h, 2, 1, h, 1),
             RoleView(2, 1, 1, 2 * h, 2, 1, h, 1), RoleView(3, 1, 0, d, 1, 1, d, 1)]
    layout = encode_layout(E, views)
    x = case["x"].clone().requires_grad_()
    wts = case["weights"].clone().requires_grad_()
    leaves = [x, wts, *params]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = moe_ffn_reference(ref_leaves[0], case["ids"], ref_leaves[1],
                            roles(dict(zip(("gate_up", "down", "gate_up_bias", "down_bias"), ref_leaves[2:]))),
                            case["act"])
    want = torch.autograd.grad(ref, ref_leaves, case["grad_y"].double())
    # chunk_tokens c: windows of 2c of the 320 slots. 0: one; 20: eight, gradients of experts spanning windows added
    # to in place; 48: four, added to in float32 buffers (4 bytes x 5760 weight elements fit in a window's 96 x
    # 256 bytes of transients), the gate/up one allocated interleaved like the parameter
    for chunk in (0, 20, 48):
        seen.clear()
        y = torch.ops.moeblaze.moe_ffn(x, case["ids"], wts, params, layout, case["act"], checkpoint, chunk)[0]
        got = torch.autograd.grad(y, leaves, case["grad_y"])
        assert rel_err(y, ref) <= 1e-5
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) <= 1e-5, f"gradient {i} (chunk_tokens={chunk})"
        windows = tcommon.num_slot_windows(T * K, chunk * K)
        assert windows == {0: 1, 20: 8, 48: 4}[chunk]
        ups = 2 if checkpoint == "recompute" else 1  # (A|B again by the up kernel in backward)
        assert [s for s in seen if s[0] == "up"] == [("up", True, None)] * (ups * windows)
        assert [s for s in seen if s[0] == "down"] == [("down", None, False)] * (2 * windows)
        assert [s for s in seen if s[0] == "dw"] == [("dw", None, None)] * (2 * windows)
    assert ops._interleaved_gate_up(views) and not ops._interleaved_gate_up([views[1], views[0]])


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def dweights_scale(case) -> torch.Tensor:
    """Per routed pair, sum_n |dH'_n H_n| + sum_j |dy_j b_down_j| in float64: the size of the summands of the
    routing-weight gradient, the yardstick of its error in bf16 (it is a dot product that can cancel)."""
    from moeblaze_fx.kernels.reference import activation_forward

    act = parse_activation(case["act"])
    p = ExpertParams(*[None if t is None else t.double() for t in roles(case["storage"])])
    x, gy, ids = case["x"].double(), case["grad_y"].double(), case["ids"]
    scale = torch.zeros(ids.shape, dtype=torch.float64, device=x.device)
    for e in range(case["E"]):
        t, k = torch.where(ids == e)
        gate = x[t] @ p.gate[e].t() + (0 if p.gate_bias is None else p.gate_bias[e])
        up = x[t] @ p.up[e].t() + (0 if p.up_bias is None else p.up_bias[e])
        s = ((gy[t] @ p.down[e]).abs() * activation_forward(act, gate, up).abs()).sum(1)
        if p.down_bias is not None:
            s = s + (gy[t].abs() * p.down_bias[e].abs()).sum(1)
        scale[t, k] = s
    return scale


# (T, d, h, E, K, ids_mode, window_slots, bias): h % 4 == 0 gives 16-byte aligned [d, 2h] rows (descriptors);
# h = 90 does not (pointer loads), with d and h off every tile
CUDA_CASES = [
    (600, 192, 256, 8, 2, "empty_expert", 0, True),
    (600, 200, 90, 8, 4, "sentinel", 0, True),
    (900, 256, 512, 8, 1, "random", 0, True),
    (700, 192, 256, 8, 4, "random", 1024, True),  # windows: weight gradients added to across windows
    (600, 192, 256, 8, 2, "random", 0, False),  # no biases: still never the Gluon up kernel (interleaved)
]


def _cuda_case_id(c) -> str:
    return f"T{c[0]}-d{c[1]}-h{c[2]}-K{c[4]}-w{c[6]}-{'bias' if c[7] else 'nobias'}"


def _gluon_runs() -> bool:
    """Whether the Gluon kernels take launches here: an sm_90 device and the Triton they support."""
    return sm90_common.SUPPORTED and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["activations", "recompute"])
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,window_slots,bias", CUDA_CASES, ids=map(_cuda_case_id, CUDA_CASES))
def test_interleaved_bf16_cuda(monkeypatch, T, d, h, E, K, ids_mode, window_slots, bias, policy):
    seen = _interleaved_flags(monkeypatch)
    gluon0 = (sm90_down.launches(), sm90_dw.launches(), sm90_gather.act_launches())
    case = make_case(T, d, h, E, K, act=GPT_OSS, bias=bias, dtype=torch.bfloat16, device="cuda", ids_mode=ids_mode,
                     seed=T + h)
    y, got = run_kernels(case, policy, window_slots)
    y_ref, want = run_reference(case)
    errs = {"y": rel_err(y, y_ref)} | {k: rel_err(got[k], want[k]) for k in want if k != "weights"}
    errs["weights"] = float((got["weights"].double() - want["weights"]).norm() / dweights_scale(case).norm())
    bad = {k: v for k, v in errs.items() if not v <= 1e-2}
    assert not bad, f"relative errors above 1e-2: {bad} (all: {errs})"
    y2, got2 = run_kernels(case, policy, window_slots)
    assert torch.equal(y, y2) and all(torch.equal(got[k], got2[k]) for k in got), "not bitwise deterministic"
    windows = tcommon.num_slot_windows(T * K, window_slots)
    assert windows == (3 if window_slots else 1)  # 2800 slots in windows of 1024
    ups = 2 if policy == "recompute" else 1  # two runs of forward and backward
    assert [s for s in seen if s[0] == "up"] == [("up", True, None)] * (2 * ups * windows)
    # per window and run, on either backend: Y and dX (one B over 2h) two down launches, dW_down and dW_gate|up
    # (together, into the interleaved gradient) two dW launches
    kinds = [s[0] for s in seen]
    assert kinds.count("down") + sm90_down.launches() - gluon0[0] == 2 * 2 * windows
    assert kinds.count("dw") + sm90_dw.launches() - gluon0[1] == 2 * 2 * windows
    # dh's GEMM and its epilogue in one Gluon launch a window (d % 64 == 0, h % 16 == 0 on sm_90), else two launches
    fused = _gluon_runs() and d % 64 == 0 and h % 16 == 0
    assert sm90_gather.act_launches() - gluon0[2] == (2 * windows if fused else 0)
    assert kinds.count("dh_act") == (0 if fused else 2 * windows)


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_operator_over_gpt_oss_storage_bf16_cuda(checkpoint):
    """The operator with its default kernel options (Gluon where it applies) over gpt-oss's four parameters, bf16,
    forward and every gradient against the reference in float32."""
    T, d, h, E, K = 1000, 256, 192, 8, 4
    case = make_case(T, d, h, E, K, act=GPT_OSS, dtype=torch.bfloat16, device="cuda", seed=17)
    names = ("gate_up", "down", "gate_up_bias", "down_bias")
    params = [case["storage"][k].clone().requires_grad_() for k in names]
    views = [RoleView(0, 1, 0, d * 2 * h, 2, 2 * h, h, d), RoleView(0, 1, 1, d * 2 * h, 2, 2 * h, h, d),
             RoleView(1, 1, 0, h * d, 1, d, d, h), RoleView(2, 1, 0, 2 * h, 2, 1, h, 1),
             RoleView(2, 1, 1, 2 * h, 2, 1, h, 1), RoleView(3, 1, 0, d, 1, 1, d, 1)]
    x = case["x"].clone().requires_grad_()
    wts = case["weights"].clone().requires_grad_()
    leaves = [x, wts, *params]
    y = torch.ops.moeblaze.moe_ffn(x, case["ids"], wts, params, encode_layout(E, views), case["act"], checkpoint,
                                   0)[0]
    got = torch.autograd.grad(y, leaves, case["grad_y"])
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = moe_ffn_reference(ref_leaves[0], case["ids"], ref_leaves[1], roles(dict(zip(names, ref_leaves[2:]))),
                            case["act"])
    want = torch.autograd.grad(ref, ref_leaves, case["grad_y"].float())
    assert rel_err(y, ref) <= 1e-2
    for i, (a, b) in enumerate(zip(got, want)):
        if i != 1:  # the routing weights' gradient: see test_interleaved_bf16_cuda's yardstick
            assert rel_err(a, b) <= 1e-2, f"gradient {i}"
    scale = dweights_scale(case).norm()
    assert float((got[1].double() - want[1].double()).norm() / scale) <= 1e-2


GLUON_CASES = [c for c in CUDA_CASES if c[1] % 64 == 0 and c[2] % 16 == 0]


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["activations", "recompute"])
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,window_slots,bias", GLUON_CASES, ids=map(_cuda_case_id, GLUON_CASES))
def test_interleaved_fused_dh_matches_triton_cuda(T, d, h, E, K, ids_mode, window_slots, bias, policy):
    """The fused Gluon dh over interleaved A|B (each block's 32 + 32 column pairs split in registers, dA|dB joined back
    into pairs) and the other Gluon units against the Triton kernels alone: the forward, dx and every weight gradient
    bitwise; the routing weights' gradient within 1e-2 (the fused kernel sums <dH', H> over 32 columns, then adds the
    two halves)."""
    if not _gluon_runs():
        pytest.skip(f"the Gluon kernels run on sm_90 with Triton 3.6 (sm90.common.SUPPORTED); this is "
                    f"sm_{''.join(map(str, torch.cuda.get_device_capability()))} with Triton {triton.__version__}")
    case = make_case(T, d, h, E, K, act=GPT_OSS, bias=bias, dtype=torch.bfloat16, device="cuda", ids_mode=ids_mode,
                     seed=T + h + 1)
    windows = tcommon.num_slot_windows(T * K, window_slots)
    fused = sm90_gather.act_launches()
    with moeblaze_fx.patch(kernels={"gluon": True}):
        y1, got1 = run_kernels(case, policy, window_slots)
    assert sm90_gather.act_launches() - fused == windows
    with moeblaze_fx.patch(kernels={"gluon": False}):
        y2, got2 = run_kernels(case, policy, window_slots)
    assert sm90_gather.act_launches() - fused == windows
    assert torch.equal(y1, y2), "forward differs from the Triton kernels'"
    differ = [k for k in got1 if k != "weights" and not torch.equal(got1[k], got2[k])]
    assert not differ, f"gradients differing from the Triton kernels': {differ}"
    torch.testing.assert_close(got1["weights"], got2["weights"], rtol=1e-2, atol=1e-5)
