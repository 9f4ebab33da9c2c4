"""The operator over parameters as they are stored: fused, separate, transposed, interleaved and
per-expert (ModuleList) weights, biases, every activation, token chunks and slot windows. Output and every gradient
against the reference in float64; layout errors."""
import re

import pytest
import torch

import moeblaze_fx
from moeblaze_fx.kernels.reference import ACTIVATIONS, ExpertParams, moe_ffn_reference, parse_activation
from moeblaze_fx.layout import RoleView, encode_layout
from moeblaze_fx.ops import moe_ffn

T, d, h, E, K = 23, 8, 6, 4, 2
SPECS = {name: name for name in ACTIVATIONS} | {"swiglu_oai": "swiglu_oai(alpha=1.702,limit=0.7)",
                                                "swiglu_clamp": "swiglu_clamp(limit=0.7)",
                                                "swiglu_softcap": "swiglu_softcap(gate=0.5,up=0.8)"}


def interpreted_block_m(device, options=None, dtype=None):
    """``ops.plan_block_m`` as on a GPU (the kernels' tile height under the options), for the Triton path driven on
    CPU tensors through the interpreter."""
    from moeblaze_fx.kernels import autotune

    with autotune.using(options if options is not None else moeblaze_fx.config.current().kernels, dtype):
        return autotune.plan_block_m()


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _storage(style, gated, bias, g):
    """Parameters in one storage style, and the ExpertParams views of them the reference reads."""
    n_up = 2 * h if gated else h
    if style == "fused":  # Hugging Face: [E, 2h, d] gate rows then up rows; down [E, d, h]
        params = {"gate_up": _rand(E, n_up, d, g=g), "down": _rand(E, d, h, g=g)}
    elif style == "interleaved-transposed":  # gpt-oss: [E, d, 2h] with gate/up in alternating columns
        params = {"gate_up": _rand(E, d, n_up, g=g), "down": _rand(E, h, d, g=g)}
    else:  # DeepSeek: separate w1, w3 [E, h, d]
        params = {"w1": _rand(E, h, d, g=g), "down": _rand(E, d, h, g=g)}
        if gated:
            params["w3"] = _rand(E, h, d, g=g)
    if bias:
        params["b_gate_up"] = _rand(E, n_up, g=g)
        params["b_down"] = _rand(E, d, g=g)
    params = {k: v.requires_grad_() for k, v in params.items()}
    return params, _retake(style, gated, bias, params)


def _retake(style, gated, bias, p):
    if style == "fused":
        gate, up = (p["gate_up"][:, :h], p["gate_up"][:, h:]) if gated else (p["gate_up"], None)
        down = p["down"]
    elif style == "interleaved-transposed":
        gu = p["gate_up"].transpose(1, 2)
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if gated else (gu, None)
        down = p["down"].transpose(1, 2)
    else:
        gate, up, down = p["w1"], p.get("w3"), p["down"]
    if not bias:
        return ExpertParams(gate, up, down)
    b = p["b_gate_up"]
    if style == "interleaved-transposed":
        bg, bu = (b[:, 0::2], b[:, 1::2]) if gated else (b, None)
    else:
        bg, bu = (b[:, :h], b[:, h:]) if gated else (b, None)
    return ExpertParams(gate, up, down, bg, bu, p["b_down"])


def _inputs(g, sentinel=True):
    x = _rand(T, d, g=g).requires_grad_()
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    if sentinel:
        ids[::4, 0] = E  # no expert
    w = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_()
    return x, ids, w


def _compare(y, ref, leaves, g, tol=1e-10):
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    gy = torch.randn(y.shape, generator=g, dtype=y.dtype)
    got = torch.autograd.grad(y, leaves, gy)
    want = torch.autograd.grad(ref, leaves, gy)
    for i, (a, b) in enumerate(zip(got, want)):
        rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert rel <= tol, f"gradient {i}: relative error {rel:.3g}"


@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("style", ["fused", "interleaved-transposed", "separate"])
@pytest.mark.parametrize("activation", list(SPECS))
def test_storage_styles_activations_biases(activation, style, bias, chunk_tokens):
    g = torch.Generator().manual_seed(0)
    spec = SPECS[activation]
    gated = parse_activation(spec).gated
    params, experts = _storage(style, gated, bias, g)
    x, ids, w = _inputs(g)
    for checkpoint in ("activations", "recompute"):
        y = moe_ffn(x, ids, w, experts, activation=spec, checkpoint=checkpoint, chunk_tokens=chunk_tokens)
        ref = moe_ffn_reference(x, ids, w, experts, spec)
        _compare(y, ref, [x, w, *params.values()], g)


def _modulelist(g, bias):
    ws = {name: [_rand(*shape, g=g).requires_grad_() for _ in range(E)]
          for name, shape in (("w1", (h, d)), ("w3", (h, d)), ("w2", (d, h)))}
    if bias:
        ws.update({f"b{n}": [_rand(r, g=g).requires_grad_() for _ in range(E)] for n, r in (("1", h), ("3", h), ("2", d))})
    return ws


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("chunk_tokens", [0, 7])
def test_modulelist_experts_are_read_in_place(bias, chunk_tokens):
    """E separate nn.Linear-style weights (and biases): one table entry each, gradients to each."""
    g = torch.Generator().manual_seed(1)
    ws = _modulelist(g, bias)
    params = ws["w1"] + ws["w3"] + ws["w2"]
    views = [RoleView(0, E, 0, 0, d, 1, h, d), RoleView(E, E, 0, 0, d, 1, h, d), RoleView(2 * E, E, 0, 0, h, 1, d, h)]
    if bias:
        params += ws["b1"] + ws["b3"] + ws["b2"]
        views += [RoleView(3 * E, E, 0, 0, 1, 1, h, 1), RoleView(4 * E, E, 0, 0, 1, 1, h, 1),
                  RoleView(5 * E, E, 0, 0, 1, 1, d, 1)]
    else:
        views += [None, None, None]
    x, ids, w = _inputs(g)
    y = torch.ops.moeblaze.moe_ffn(x, ids, w, params, encode_layout(E, views), "swiglu", "recompute", chunk_tokens)[0]
    stacked = [torch.stack(ws[k]) for k in ("w1", "w3", "w2")]
    if bias:
        stacked += [torch.stack(ws[k]) for k in ("b1", "b3", "b2")]
    ref = moe_ffn_reference(x, ids, w, ExpertParams(*stacked), "swiglu")
    _compare(y, ref, [x, w, *params], g)


def test_chunked_equals_unchunked_exactly_in_float64():
    g = torch.Generator().manual_seed(2)
    _, experts = _storage("fused", True, True, g)
    x, ids, w = _inputs(g)
    whole = moe_ffn(x, ids, w, experts, chunk_tokens=0)
    for chunk in (1, 4, 22, 23, 100):
        torch.testing.assert_close(moe_ffn(x, ids, w, experts, chunk_tokens=chunk), whole, rtol=1e-14, atol=1e-14)


def _fused_layout(**change):
    base = dict(gate=RoleView(0, 1, 0, 2 * h * d, d, 1, h, d), up=RoleView(0, 1, h * d, 2 * h * d, d, 1, h, d),
                down=RoleView(1, 1, 0, d * h, h, 1, d, h))
    base.update(change)
    return encode_layout(E, [base["gate"], base["up"], base["down"], None, None, None])


@pytest.mark.parametrize("layout,activation,message", [
    (_fused_layout(up=RoleView(0, 1, 1, 2 * h * d, d, 1, h, d)), "swiglu", "roles overlap in parameter 0"),
    (_fused_layout(up=RoleView(0, 1, h * d + 1, 2 * h * d, d, 1, h, d)), "swiglu", "reaches element"),
    (_fused_layout(down=RoleView(2, 1, 0, d * h, h, 1, d, h)), "swiglu", "names parameters 2..2 of 2"),
    (_fused_layout(), "relu", "activation 'relu' takes no up role"),
    (_fused_layout(up=None), "swiglu", "activation 'swiglu' needs an up role"),
    (_fused_layout()[:-1], "swiglu", "layout must hold 1 + 48 ints"),
    (_fused_layout(), "swiglu_oai(alpha=1,limit=-1)", "limit > 0"),
    (_fused_layout(), "tanh", "unknown activation"),
], ids=["overlap", "out-of-bounds", "bad-index", "plain-with-up", "gated-without-up", "short", "bad-limit", "tanh"])
def test_bad_layout_is_a_clear_error(layout, activation, message):
    g = torch.Generator().manual_seed(3)
    x, ids, w = _inputs(g)
    params = [_rand(E, 2 * h, d, g=g), _rand(E, d, h, g=g)]
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.moeblaze.moe_ffn(x.detach(), ids, w.detach(), params, layout, activation, "activations", 0)


@pytest.mark.parametrize("spec,want", [
    ("swiglu_clamp(limit=10.0)", ("swiglu_clamp", 1.0, 10.0)),
    ("swiglu_oai(alpha=1.702,limit=7.0)", ("swiglu_oai", 1.702, 7.0)),
    ("relu2", ("relu2", 1.0, 0.0)),
    ("geglu_tanh", ("geglu_tanh", 1.0, 0.0)),
    ("gelu_tanh", ("gelu_tanh", 1.0, 0.0)),
    ("swiglu_softcap(gate=4.0,up=25.0)", ("swiglu_softcap", 4.0, 25.0)),
])
def test_activation_specs_round_trip(spec, want):
    act = parse_activation(spec)
    assert tuple(act) == want and act.spec == spec and parse_activation(act.spec) == act


@pytest.mark.parametrize("spec,message", [
    ("swiglu_clamp", "unknown activation"),  # the limit is part of the function
    ("swiglu_clamp(alpha=1.0,limit=2.0)", "unknown activation"),  # no alpha
    ("relu2(limit=1.0)", "unknown activation"),
    ("gelu(approximate='tanh')", "supported: ('swiglu', 'geglu', 'geglu_tanh', 'silu', 'gelu', 'gelu_tanh', 'relu', "
                                 "'relu2') and 'swiglu_oai(alpha=A,limit=L)', 'swiglu_clamp(limit=L)', "
                                 "'swiglu_softcap(gate=G,up=U)'"),
    ("swiglu_softcap(up=25.0,gate=4.0)", "unknown activation"),  # the parameters in their order
    ("swiglu_softcap(gate=-4.0,up=25.0)", "swiglu_softcap needs finite parameters, gate and up > 0"),
    ("swiglu_clamp(limit=0)", "swiglu_clamp needs finite parameters, limit > 0"),
    ("swiglu_clamp(limit=inf)", "finite parameters"),
    ("swiglu_clamp(limit=ten)", "finite parameters"),
])
def test_bad_activation_specs(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_activation(spec)


def test_per_expert_parameters_must_be_alike():
    g = torch.Generator().manual_seed(4)
    x, ids, w = _inputs(g)
    ws = _modulelist(g, False)
    ws["w1"][1] = ws["w1"][1].t().contiguous().t()  # same shape, other strides
    layout = encode_layout(E, [RoleView(0, E, 0, 0, d, 1, h, d), RoleView(E, E, 0, 0, d, 1, h, d),
                               RoleView(2 * E, E, 0, 0, h, 1, d, h), None, None, None])
    with pytest.raises(ValueError, match="differ in shape, strides or dtype"):
        torch.ops.moeblaze.moe_ffn(x.detach(), ids, w.detach(), ws["w1"] + ws["w3"] + ws["w2"], layout, "swiglu",
                                   "activations", 0)
    shifted = encode_layout(E, [RoleView(0, E, 0, 0, d, 1, h, d), RoleView(E - 1, E, 0, 0, d, 1, h, d),
                                RoleView(2 * E, E, 0, 0, h, 1, d, h), None, None, None])
    params = [t.detach().contiguous() for t in ws["w1"] + ws["w3"] + ws["w2"]]
    with pytest.raises(ValueError, match="overlap partly"):
        torch.ops.moeblaze.moe_ffn(x.detach(), ids, w.detach(), params, shifted, "swiglu", "activations", 0)


def test_a_parameter_with_gaps_is_refused():
    g = torch.Generator().manual_seed(5)
    x, ids, w = _inputs(g)
    params = [_rand(E, 4 * h, d, g=g)[:, ::2], _rand(E, d, h, g=g)]  # a view with gaps, not a parameter
    with pytest.raises(ValueError, match="non-overlapping and dense"):
        torch.ops.moeblaze.moe_ffn(x.detach(), ids, w.detach(), params, _fused_layout(), "swiglu", "activations", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the Triton path on CPU tensors through the interpreter")
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_triton_path_slot_windows_in_the_interpreter(monkeypatch, checkpoint):
    """The operator's kernel path (tables, slot windows, weight gradients of experts spanning windows
    added to in place or in float32) on CPU tensors under TRITON_INTERPRET, float32, against the
    reference; fused and per-expert (ModuleList) parameters with biases."""
    from moeblaze_fx import ops

    monkeypatch.setattr(ops, "_use_triton", lambda x: True)
    monkeypatch.setattr(ops, "plan_block_m", interpreted_block_m)
    g = torch.Generator().manual_seed(6)
    params, _ = _storage("fused", True, True, g)
    params = {k: v.detach().float().requires_grad_() for k, v in params.items()}
    experts = _retake("fused", True, True, params)
    T40 = 40
    x = _rand(T40, d, g=g).float().requires_grad_()
    ids = torch.rand(T40, E, generator=g).argsort(dim=1)[:, :K]
    ids[::5, 1] = E  # unrouted pairs: their slots sit past every expert's
    w = torch.rand(T40, K, generator=g).requires_grad_()
    # chunk_tokens c: windows of 2c of the 80 slots. 6: seven windows, gradients of experts spanning several
    # added to in place; 15: three windows, in float32 (4 x 576 weight elements fit in a window's
    # 15 * 2 * (2h + max(h, d)) * 4 bytes of transients); 20: two windows, in place
    for chunk in (0, 6, 15, 20):
        y = moe_ffn(x, ids, w, experts, checkpoint=checkpoint, chunk_tokens=chunk)
        ref = moe_ffn_reference(x, ids, w, experts)
        _compare(y, ref, [x, w, *params.values()], g, tol=1e-5)
    ws = {k: [t.detach().float().requires_grad_() for t in v] for k, v in _modulelist(g, True).items()}
    flat = [t for k in ("w1", "w3", "w2", "b1", "b3", "b2") for t in ws[k]]
    views = [RoleView(i * E, E, 0, 0, c, 1, r, c) for i, (r, c) in enumerate(((h, d), (h, d), (d, h)))] + [
        RoleView((3 + i) * E, E, 0, 0, 1, 1, r, 1) for i, r in enumerate((h, h, d))]
    stacked = ExpertParams(*[torch.stack(ws[k]) for k in ("w1", "w3", "w2", "b1", "b3", "b2")])
    for chunk in (0, 6):
        y = torch.ops.moeblaze.moe_ffn(x, ids, w, flat, encode_layout(E, views), "swiglu", checkpoint, chunk)[0]
        _compare(y, moe_ffn_reference(x, ids, w, stacked), [x, w, *flat], g, tol=1e-5)


def _graphs(fn, *args) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_count


@pytest.mark.parametrize("style,form,graphs", [
    ("fused", "tuple", 1),  # moe_ffn splits the fused weight itself: described in it, no storage offsets read
    ("separate", "experts", 1),  # dense parameters: each its own base
    ("fused", "experts", 2),  # slices made by the caller: their offsets are read, which breaks the graph
    ("interleaved-transposed", "experts", 2),
])
def test_direct_call_under_torch_compile(style, form, graphs):
    """A model calling moe_ffn itself under torch.compile: the graphs Dynamo makes, and output and every
    gradient against the reference (aot_eager, and once through Inductor)."""
    g = torch.Generator().manual_seed(7)
    params, experts = _storage(style, True, False, g)
    x, ids, w = _inputs(g)

    def call(x, w, *tensors):
        if form == "tuple":
            return moe_ffn(x, ids, w, tuple(tensors), chunk_tokens=5)
        return moe_ffn(x, ids, w, _retake(style, True, False, dict(zip(params, tensors))), chunk_tokens=5)

    assert _graphs(call, x, w, *params.values()) == graphs
    for backend in ["aot_eager", "inductor"] if form == "tuple" else ["aot_eager"]:
        torch._dynamo.reset()
        y = torch.compile(call, backend=backend)(x, w, *params.values())
        _compare(y, moe_ffn_reference(x, ids, w, experts), [x, w, *params.values()], g)


def test_direct_call_under_torch_compile_reads_each_calls_weights():
    """Weights passed into the compiled function as views at other offsets of one buffer: each call reads its
    own (a layout fixed at compile time would read the first call's). Contiguous and transposed views are
    described in one graph; a view with gaps through storage offsets, in several."""
    g = torch.Generator().manual_seed(8)
    x, ids, w = _inputs(g)
    down = _rand(E, d, h, g=g)
    store = _rand(2, E, 2 * h, d, g=g)
    store_t = _rand(2, E, d, 2 * h, g=g)
    gapped = _rand(E, 2 * h, 2, d, g=g)
    cases = [(True, [store[i] for i in range(2)]), (True, [store_t[i].transpose(1, 2) for i in range(2)]),
             (False, [gapped[:, :, i] for i in range(2)])]
    for fullgraph, weights in cases:
        torch._dynamo.reset()
        call = torch.compile(lambda x, gu, dn: moe_ffn(x, ids, w, (gu, dn)), backend="aot_eager", fullgraph=fullgraph)
        for gate_up in weights:
            want = moe_ffn_reference(x, ids, w, ExpertParams(gate_up[:, :h], gate_up[:, h:], down))
            torch.testing.assert_close(call(x, gate_up, down), want, rtol=1e-10, atol=1e-10)
