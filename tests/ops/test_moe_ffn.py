"""The operator: numerics against the reference (output and every gradient), memory policy, errors."""
import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moeblaze_fx
from moeblaze_fx.config import KernelOptions
from moeblaze_fx.kernels.reference import ExpertParams, moe_ffn_reference, split_gate_up
from moeblaze_fx.layout import RoleView, encode_layout
from moeblaze_fx.ops import moe_ffn


def interpreted_block_m(device, options=None, dtype=None):
    """``ops.plan_block_m`` as on a GPU (the kernels' tile height under the options), for the Triton path driven on
    CPU tensors through the interpreter."""
    from moeblaze_fx.kernels import autotune

    with autotune.using(options if options is not None else moeblaze_fx.config.current().kernels, dtype):
        return autotune.plan_block_m()


def _ref(x, ids, w, wgu, wd, activation="swiglu"):
    return moe_ffn_reference(x, ids, w, ExpertParams(*split_gate_up(wgu), wd), activation)


def _inputs(T, d, h, E, K, dtype=torch.float64, ids_dtype=torch.int64, device="cpu", seed=0, route=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    if route is None:
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    else:
        ids = route(T, E, K, g)
    ids = ids.to(device, ids_dtype).contiguous()
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * h, d, generator=g, dtype=torch.float64) / d**0.5).to(device, dtype).requires_grad_()
    w_down = (torch.randn(E, d, h, generator=g, dtype=torch.float64) / h**0.5).to(device, dtype).requires_grad_()
    return x, ids, w, w_gate_up, w_down


def _all_to_expert_zero(T, E, K, g):
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    ids[:, 0] = 0
    ids[:, 1:] = torch.where(ids[:, 1:] == 0, E - 1, ids[:, 1:])
    return ids


def _with_sentinels(T, E, K, g):
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    ids[::3, 0] = E  # "no expert": contributes nothing
    ids[1::5, -1] = E + 7
    return ids


def _skip_last_experts(T, E, K, g):  # experts E-2 and E-1 get no token
    return torch.rand(T, E - 2, generator=g).argsort(dim=1)[:, :K]


ROUTES = {"random": None, "all-on-expert-0": _all_to_expert_zero, "sentinel-ids": _with_sentinels,
          "empty-experts": _skip_last_experts}


def _check(T, d, h, E, K, checkpoint, route, ids_dtype=torch.int64, dtype=torch.float64, device="cpu", tol=1e-10):
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype, ids_dtype, device, route=ROUTES[route])
    y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint)
    ref = _ref(x, ids, w, wgu, wd)
    assert y.dtype == x.dtype and y.shape == (T, d)
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    if T == 0:
        return
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, (x, w, wgu, wd), g)
    want = torch.autograd.grad(ref, (x, w, wgu, wd), g)
    for name, a, b in zip(("x", "weights", "w_gate_up", "w_down"), got, want):
        rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert rel <= tol, f"gradient of {name}: relative error {rel:.3g}"


@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    "T,d,h,E,K",
    [
        (13, 8, 6, 4, 2),  # T not a multiple of anything
        (1, 8, 6, 4, 2),  # one token
        (7, 5, 3, 3, 3),  # K = E: every expert on every token
        (40, 16, 12, 8, 1),  # top-1
    ],
    ids=lambda v: str(v),
)
def test_matches_reference_float64(T, d, h, E, K, checkpoint, route):
    if route == "empty-experts" and E - 2 < K:
        pytest.skip("needs E - 2 >= K experts to leave two empty")
    _check(T, d, h, E, K, checkpoint, route)


def test_int32_ids_and_zero_tokens():
    _check(9, 8, 6, 4, 2, "activations", "random", ids_dtype=torch.int32)
    _check(0, 8, 6, 4, 2, "activations", "random")  # T = 0: an empty batch


def test_weights_in_another_dtype():
    x, ids, w, wgu, wd = _inputs(11, 8, 6, 4, 2, dtype=torch.float32)
    w32 = w.detach().double().requires_grad_()
    y = moe_ffn(x, ids, w32, (wgu, wd))
    assert y.dtype == torch.float32
    (gw,) = torch.autograd.grad(y.sum(), (w32,))
    assert gw.dtype == torch.float64
    torch.testing.assert_close(y, _ref(x, ids, w, wgu, wd), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_opcheck(checkpoint):
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2)
    layout = encode_layout(4, [RoleView(0, 1, 0, 12 * 8, 8, 1, 6, 8), RoleView(0, 1, 6 * 8, 12 * 8, 8, 1, 6, 8),
                               RoleView(1, 1, 0, 8 * 6, 6, 1, 8, 6), None, None, None])
    for chunk in (0, 4):
        torch.library.opcheck(torch.ops.moeblaze.moe_ffn.default,
                              (x, ids, w, [wgu, wd], layout, "swiglu", checkpoint, chunk))


def _saved(fn):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(storages.values())


@pytest.mark.parametrize("checkpoint,preact_saved", [("activations", True), ("recompute", False)])
def test_memory_policy_saves_no_routed_copy(checkpoint, preact_saved):
    T, d, h, E, K = 32, 16, 24, 4, 2
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)
    saved = _saved(lambda: moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint))
    shapes = [s for s, _, _ in saved]
    assert (T * K, d) not in shapes  # never the routed [T*K, d] copy of the tokens
    assert ((T * K, 2 * h) in shapes) == preact_saved
    activation_bytes = sum(n for s, _, n in saved if s not in ((E, 2 * h, d), (E, d, h)))
    # x, the int64 ids, the weights and, under "activations", the pre-activations; the PyTorch path (here)
    # rebuilds its dispatch plans in backward
    expected = T * d * 4 + T * K * (8 + 4) + (T * K * 2 * h * 4 if preact_saved else 0)
    assert activation_bytes == expected
    assert len([s for s in shapes if s in ((E, 2 * h, d), (E, d, h))]) == 2  # the parameters, not copies


@pytest.fixture
def triton_path(monkeypatch):
    """The operator's Triton path on CPU tensors through Triton's interpreter (the GPU runs it for real); counts
    the dispatch plans the operator builds."""
    if torch.cuda.is_available():
        pytest.skip("drives the Triton path on CPU tensors through the interpreter, which is off on a GPU machine "
                    "(the cuda tests run that path for real)")
    from moeblaze_fx import ops

    monkeypatch.setattr(ops, "_use_triton", lambda x: True)
    monkeypatch.setattr(ops, "plan_block_m", interpreted_block_m)
    plans = []
    make_plan = ops._make_plan
    monkeypatch.setattr(ops, "_make_plan", lambda *a: plans.append(a) or make_plan(*a))
    return plans


@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_triton_path_saves_the_forward_plan(triton_path, checkpoint):
    """The forward's dispatch plan (the index structures) is saved and the backward dispatches nothing: one plan a
    step; the saved bytes are x, ids, weights, the plan and, under "activations", the pre-activations."""
    from moeblaze_fx.kernels import autotune
    from moeblaze_fx.kernels.reference import max_tiles
    from moeblaze_fx.passes import saved_bytes_after

    T, d, h, E, K = 40, 16, 24, 4, 2
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32, route=_with_sentinels)
    y = []
    saved = _saved(lambda: y.append(moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint)))
    assert len(triton_path) == 1
    n_tiles = max_tiles(T * K, E, autotune.plan_block_m())
    plan_shapes = [(E + 1,), (T * K,), (T * K,), (n_tiles,), (n_tiles,)]
    assert sorted(s for s, dtype, _ in saved if dtype == torch.int32) == sorted(plan_shapes)
    activation_bytes = sum(n for s, _, n in saved if s not in ((E, 2 * h, d), (E, d, h)))
    expected = T * d * 4 + T * K * (8 + 4) + 4 * sum(n for (n,) in plan_shapes) + \
        (T * K * 2 * h * 4 if checkpoint == "activations" else 0)
    assert activation_bytes == expected
    # the compile report's "after" column states the same bytes
    assert saved_bytes_after(T, d, h, K, 4, 8, 4, checkpoint, True, E, autotune.plan_block_m()) == expected
    g = torch.randn(T, d, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(y[0], (x, w, wgu, wd), g)
    assert len(triton_path) == 1  # the backward used the saved plan
    want = torch.autograd.grad(_ref(x, ids, w, wgu, wd), (x, w, wgu, wd), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_path_backward_with_the_saved_plan_equals_one_dispatching_again(triton_path):
    x, ids, w, wgu, wd = _inputs(40, 16, 24, 4, 2, dtype=torch.float32, route=_all_to_expert_zero)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    y, preact, plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)
    assert len(plan) == 5 and all(t.dtype == torch.int32 for t in plan) and len(triton_path) == 1
    g = torch.randn_like(y)
    saved = torch.ops.moeblaze.moe_ffn_backward(g, x, ids, w, params, layout, preact, plan, "swiglu", "activations", 0)
    assert len(triton_path) == 1
    again = torch.ops.moeblaze.moe_ffn_backward(g, x, ids, w, params, layout, preact, [], "swiglu", "activations", 0)
    assert len(triton_path) == 2
    for a, b in zip((saved[0], saved[1], *saved[2]), (again[0], again[1], *again[2])):
        assert torch.equal(a, b)


def _step_tokens(T, d, E, K, seed):
    """One step's tokens, routing (ids, weights requiring grad) and upstream gradient, float32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).requires_grad_()
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, generator=g).requires_grad_()
    return x, ids, w, torch.randn(T, d, generator=g)


@pytest.mark.parametrize("checkpoint,chunk_tokens,ops", [("activations", 0, 4), ("recompute", 0, 2),
                                                        ("activations", 9, 2)],  # ops: the forward and the backward's
                         ids=["split-backward", "recompute", "windows"])
def test_triton_path_replays_match_the_orchestrated_calls(triton_path, checkpoint, chunk_tokens, ops, monkeypatch):
    """The Triton path through Triton's interpreter, its launches recorded as Python calls (kernels/program.py): a
    signature's second call is recorded and later ones replayed, bitwise the orchestrated calls (kernel option
    replay=False) over new tensors at every step, the gradient buffers' pointer tables and the host descriptors over
    the call's tensors made again over each step's own. The backward operators are replayed; the forward never is
    here: on CPU tensors the dispatch checks the ids on the host (a synchronisation), which refuses each of its
    records. A replayed call goes to its program before any of the operator's own Python (ops._replayed): the
    weights' key is made only by calls that are not replayed. The GPU's test replays driver launches:
    test_replayed_calls_match_the_orchestrated_ones."""
    from moeblaze_fx import ops as ops_module
    from moeblaze_fx.kernels import program

    T, d, h, E, K = 40, 16, 24, 4, 2
    _, _, _, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)

    def step(replay: bool, seed: int):
        x, ids, w, gy = _step_tokens(T, d, E, K, seed)
        with moeblaze_fx.patch(kernels={"replay": replay}):
            y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint, chunk_tokens=chunk_tokens)
        return (y, *torch.autograd.grad(y, (x, w, wgu, wd), gy))

    keys = []
    weights_key = ops_module._weights_key
    monkeypatch.setattr(ops_module, "_weights_key", lambda *a: keys.append(1) or weights_key(*a))
    before = program.stats()
    replayed = [step(True, seed) for seed in range(4)]
    after = program.stats()
    assert {k: after[k] - before[k] for k in after} == {"recorded": ops - 1, "replayed": 2 * (ops - 1),
                                                         "refused": program.ATTEMPTS}
    assert len(keys) == 4 + 2 * (ops - 1)  # each forward; each backward operator's first and recorded calls
    for seed, got in enumerate(replayed):
        for a, b in zip(got, step(False, seed)):
            assert torch.equal(a, b)


def test_triton_path_records_each_way_of_multiplying_float32_apart(triton_path, float32_matmul_precision):
    """A float32 call's program is recorded under the way its products run (kernel option float32_products, "auto"
    resolved from torch's float32 matmul precision at the call): the same call after torch.set_float32_matmul_precision
    changes from "highest" (bf16x6) to "high" (bf16x3) is recorded again, not replayed from the record of the other way,
    and the first way's record replays again once torch's setting is back. (The Triton path interpreted: its three
    backward operators are recorded and replayed, the forward's records refused, as in the tests above.)"""
    from moeblaze_fx.kernels import program

    T, d, h, E, K = 40, 16, 24, 4, 2
    _, _, _, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)

    def steps(precision, seeds):
        float32_matmul_precision(precision)
        before = program.stats()
        for seed in seeds:
            x, ids, w, gy = _step_tokens(T, d, E, K, seed)
            torch.autograd.grad(moe_ffn(x, ids, w, (wgu, wd)), (x, w, wgu, wd), gy)
        after = program.stats()
        return {k: after[k] - before[k] for k in ("recorded", "replayed")}

    # each backward operator: its first call runs, its second is recorded, later ones replay
    assert steps("highest", range(4)) == {"recorded": 3, "replayed": 6}
    assert steps("high", range(4)) == {"recorded": 3, "replayed": 6}
    assert steps("highest", range(2)) == {"recorded": 0, "replayed": 6}


@pytest.mark.parametrize("experts", ["hf", "separate"])
def test_triton_path_replays_calls_over_weights_made_for_them(triton_path, experts):
    """Weights made for each call (cast from a master copy, as under autocast: new tensors at new addresses, with new
    values, every step) are recorded once per signature and replayed over the next step's weights: no address of
    theirs is in the key, and the recorded call made their pointer tables and host descriptors over them, which a
    replay makes again over the new ones. Bitwise the orchestrated calls (replay=False), gradients reaching the
    master weights through the cast. (The Triton path interpreted: the backward operators are recorded and replayed,
    the forward's records refused, as in the test above.)"""
    from moeblaze_fx.kernels import program

    T, d, h, E, K = 40, 16, 24, 4, 2
    _, _, _, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)
    master = (wgu, wd) if experts == "hf" else tuple(t.detach().clone().requires_grad_()
                                                     for t in (*split_gate_up(wgu), wd))
    made = []  # every step's weights stay alive: each step's are at new addresses

    def step(replay: bool, seed: int):
        x, ids, w, gy = _step_tokens(T, d, E, K, seed)
        cast = [m * (1.0 + seed) for m in master]  # new values and addresses; not a model's weight
        made.append(cast)
        experts_arg = tuple(cast) if experts == "hf" else ExpertParams(*cast)
        with moeblaze_fx.patch(kernels={"replay": replay}):
            y = moe_ffn(x, ids, w, experts_arg)
        return (y, *torch.autograd.grad(y, (x, w, *master), gy))

    before = program.stats()
    replayed = [step(True, seed) for seed in range(4)]
    after = program.stats()
    assert {k: after[k] - before[k] for k in after} == {"recorded": 3, "replayed": 6, "refused": program.ATTEMPTS}
    for seed, got in enumerate(replayed):
        for a, b in zip(got, step(False, seed)):
            assert torch.equal(a, b)
    assert not torch.equal(replayed[2][3], replayed[3][3])  # the steps' weights differ, and so do their gradients


def _split_equals_whole(x, ids, w, params, layout, plan_len, activation="swiglu"):
    """Runs the forward (which saves a plan of ``plan_len`` tensors), then the whole backward and the three split
    operators on the same inputs; asserts they agree bitwise. Returns (dA|dB, the upstream gradient, A|B, plan)."""
    from moeblaze_fx import ops

    y, preact, plan_out = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, activation, "activations", 0)
    assert len(plan_out) == plan_len
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    whole = torch.ops.moeblaze.moe_ffn_backward(g, x, ids, w, params, layout, preact, plan_out, activation,
                                                "activations", 0)
    dpre, dweights, down = torch.ops.moeblaze.moe_ffn_backward_act(g, x, ids, w, params, layout, preact, plan_out,
                                                                   activation)
    dx = torch.ops.moeblaze.moe_ffn_backward_dx(dpre, x, ids, w, params, layout, plan_out, activation)
    gate_up = torch.ops.moeblaze.moe_ffn_backward_dw(dpre, x, ids, w, params, layout, plan_out, activation)
    E, views = moeblaze_fx.layout.decode_layout(layout)
    down_side, gate_side = ops._side_groups(len(params), views, E)
    assert dpre.shape == preact.shape and isinstance(dx, torch.Tensor)
    assert (len(down), len(gate_up)) == (len(down_side), len(gate_side)) and down and gate_up
    by_first = dict(zip([f for f, _ in down_side + gate_side], down + gate_up))
    split = [by_first[first] for first, _ in ops._groups(len(params), views, E)]
    assert len(split) == len(whole[2])
    for a, b in zip((whole[0], whole[1], *whole[2]), (dx, dweights, *split)):
        assert torch.equal(a, b)
    return dpre, g, preact, plan_out


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_split_backward_equals_the_one_operator_backward(path, request):
    """The split backward (dA|dB, dweights and the down gradient; then dx; then the gate|up gradient) computes
    bitwise what the one-operator backward does, on the Triton path (interpreted) and on the CPU path's walk of the
    experts; its fakes match; a wrong dA|dB, a plan on the CPU path and a layout whose one parameter holds down and
    gate are refused with the fix named."""
    from moeblaze_fx.kernels import backward

    if path == "triton":
        request.getfixturevalue("triton_path")
    x, ids, w, wgu, wd = _inputs(40, 16, 24, 4, 2, dtype=torch.float32, route=_with_sentinels)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    dpre, g, preact, plan = _split_equals_whole(x, ids, w, params, layout, 5 if path == "triton" else 0)
    if path == "cpu":  # unrouted slots (from offsets[E] on) are zero there
        routed = int((ids < 4).sum())
        assert torch.equal(dpre[routed:], torch.zeros_like(dpre[routed:])) and routed < dpre.shape[0]
    # opcheck compares whole outputs: every pair routed (dA|dB's rows of unrouted slots are left unwritten)
    x, ids, w, wgu, wd = _inputs(40, 16, 24, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    y, preact, plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)
    dpre = torch.ops.moeblaze.moe_ffn_backward_act(g, x, ids, w, params, layout, preact, plan, "swiglu")[0]
    xd, wdet, pd = x.detach(), w.detach(), [p.detach() for p in params]  # (the split operators have no backward)
    torch.library.opcheck(torch.ops.moeblaze.moe_ffn_backward_act.default,
                          (g, xd, ids, wdet, pd, layout, preact.detach(), plan, "swiglu"))
    for op in (torch.ops.moeblaze.moe_ffn_backward_dx, torch.ops.moeblaze.moe_ffn_backward_dw):
        torch.library.opcheck(op.default, (dpre.detach(), xd, ids, wdet, pd, layout, plan, "swiglu"))
        with pytest.raises(ValueError, match=r"dpre must be moe_ffn_backward_act's dA\|dB"):
            op(dpre[:, :24], x, ids, w, params, layout, plan, "swiglu")
    if path == "cpu":
        fake_plan = [torch.zeros(3, dtype=torch.int32)]
        with pytest.raises(ValueError, match=r"pass plan=\[\]"):
            torch.ops.moeblaze.moe_ffn_backward_dw(dpre, x, ids, w, params, layout, fake_plan, "swiglu")
    else:
        with pytest.raises(ValueError, match=r"phase 'act' runs one window"):
            tables, plan_t = _tables_and_plan(params, layout, plan)
            backward.expert_backward(g, x, w, tables, preact, plan_t, "swiglu", grads=tables, recompute=False,
                                     window_slots=16, phase="act")
    # gate, up and down in one parameter: its gradient is one buffer, which neither side's operator could return
    E, h, d = 4, 24, 16
    one = torch.cat([wgu.detach().reshape(-1), wd.detach().reshape(-1)])
    views = [RoleView(0, 1, 0, 2 * h * d, d, 1, h, d), RoleView(0, 1, h * d, 2 * h * d, d, 1, h, d),
             RoleView(0, 1, 2 * E * h * d, d * h, h, 1, d, h), None, None, None]
    mixed = encode_layout(E, views)
    with pytest.raises(ValueError, match=r"call moe_ffn_backward"):
        torch.ops.moeblaze.moe_ffn_backward_act(g, x, ids, w, [one], mixed, preact, plan, "swiglu")
    with pytest.raises(ValueError, match=r"call moe_ffn_backward"):
        torch.ops.moeblaze.moe_ffn_backward_dw(dpre, x, ids, w, [one], mixed, plan, "swiglu")
    wone = one.clone().requires_grad_()
    y1 = torch.ops.moeblaze.moe_ffn(x, ids, w, [wone], mixed, "swiglu", "activations", 0)[0]
    got = torch.autograd.grad(y1, (x, wone), g)  # the autograd formula keeps the one-operator backward there
    want = torch.autograd.grad(_ref(x, ids, w, wgu, wd), (x, wgu, wd), g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], torch.cat([want[1].reshape(-1), want[2].reshape(-1)]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["geglu", "relu2"])
def test_cpu_split_backward_with_biases_equals_the_one_operator_backward(activation):
    """Biases on every role, a gated and a plain activation, bf16 (dA|dB holds dgate|dup in the dtype the whole
    backward computes them in): the three operators are bitwise the one."""
    E, d, h, T, K = 4, 16, 12, 30, 2
    gen = torch.Generator().manual_seed(5)
    gated = activation == "geglu"
    experts = ExpertParams(*[None if t is None else t.to(torch.bfloat16) for t in (
        torch.randn(E, h, d, generator=gen) / 4, torch.randn(E, h, d, generator=gen) / 4 if gated else None,
        torch.randn(E, d, h, generator=gen) / 4, torch.randn(E, h, generator=gen),
        torch.randn(E, h, generator=gen) if gated else None, torch.randn(E, d, generator=gen))])
    params, layout = moeblaze_fx.layout.layout_of(experts)
    x = torch.randn(T, d, generator=gen).to(torch.bfloat16)
    ids = _with_sentinels(T, E, K, gen)
    w = torch.rand(T, K, generator=gen).to(torch.bfloat16)
    _split_equals_whole(x, ids, w, params, layout, 0, activation)


def _tables_and_plan(params, layout, plan):
    from moeblaze_fx import ops
    from moeblaze_fx.kernels.reference import DispatchPlan

    E, views = moeblaze_fx.layout.decode_layout(layout)
    return ops._tables(params, views, E), DispatchPlan(*plan)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_split_backward_frees_the_saved_activations_before_the_gate_up_gradient(path, request):
    """In the compiled backward graph the saved A|B's last use is the first operator: the others (the third
    allocates the gate|up gradient) do not take it, so the graph frees it before; dx and the gate|up gradients come
    from separate operators. One window (chunk 0; one chunk of tokens on the CPU path) takes the split; several
    windows (chunks) keep the one-operator backward, whose windows bound the transients."""
    from torch._functorch.aot_autograd import aot_module_simplified

    if path == "triton":
        request.getfixturevalue("triton_path")
    x, ids, w, wgu, wd = _inputs(40, 16, 24, 4, 2, dtype=torch.float32)
    split = ["moe_ffn_backward_act", "moe_ffn_backward_dx", "moe_ffn_backward_dw"]
    for chunk, want in ((0, split), (6, ["moe_ffn_backward"])):
        graphs = []

        def backend(gm, example_inputs):
            def bw(g, _):
                graphs.append(g)
                return g
            return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g, bw_compiler=bw)

        f = torch.compile(lambda x, w, a, b: moe_ffn(x, ids, w, (a, b), chunk_tokens=chunk), backend=backend,
                          fullgraph=True)
        xs = [t.detach().clone().requires_grad_() for t in (x, w, wgu, wd)]
        f(*xs).sum().backward()
        (graph,) = graphs
        calls = [n for n in graph.graph.nodes if n.op == "call_function" and "moeblaze" in str(n.target)]
        assert [n.target._opname for n in calls] == want
        if chunk == 0:
            preact = calls[0].args[6]  # moe_ffn_backward_act(grad_y, x, ids, weights, params, layout, preact, ...)
            assert preact.op == "placeholder" and set(preact.users) == {calls[0]}
        torch._dynamo.reset()


@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_triton_path_opcheck(triton_path, checkpoint):
    """The fake implementation's plan shapes (static in T, K and E) match the real ones."""
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    torch.library.opcheck(torch.ops.moeblaze.moe_ffn.default, (x, ids, w, params, layout, "swiglu", checkpoint, 0))


def test_triton_path_runs_with_the_call_s_kernel_options(triton_path, monkeypatch):
    """The kernel options are an argument of the call: the plan's tile height follows its pinned configuration (the
    fake's plan shapes too), and the backward runs with the forward's options, whatever is in force when it runs."""
    from moeblaze_fx.config import encode_kernels
    from moeblaze_fx.kernels import autotune, backward
    from moeblaze_fx.kernels.reference import max_tiles

    seen = []
    real = backward.expert_backward
    monkeypatch.setattr(backward, "expert_backward", lambda *a, **k: seen.append(autotune.options()) or
                        real(*a, **k))
    T, d, h, E, K = 40, 16, 24, 4, 2
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    pinned = KernelOptions(kernel_config="block_m=32,block_n=16,block_k=16,num_warps=4,num_stages=1")
    encoded = encode_kernels(pinned)
    assert encoded == "kernel_config=block_m=32,block_n=16,block_k=16,num_warps=4,num_stages=1"
    y, preact, plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0, encoded)
    assert triton_path[-1][2] == 32 and plan[3].numel() == max_tiles(T * K, E, 32)
    g = torch.randn_like(y)
    with moeblaze_fx.patch(kernels={"kernel_config": "block_m=64"}):  # not what the call carries
        got = torch.autograd.grad(y, (x, w, wgu, wd), g)
    assert seen == [pinned] * 3 and len(triton_path) == 1  # the split backward's three operators
    want = torch.autograd.grad(_ref(x, ids, w, wgu, wd), (x, w, wgu, wd), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.moeblaze.moe_ffn.default,
                          (x, ids, w, params, layout, "swiglu", "recompute", 0, encoded))
    # the direct API: the options of config.current() at the call, the backward's too
    seen.clear()
    with moeblaze_fx.patch(kernels={"kernel_config": "block_m=32,block_n=16,block_k=16,num_warps=4,num_stages=1"}):
        y = moe_ffn(x, ids, w, (wgu, wd))
    assert triton_path[-1][2] == 32
    torch.autograd.grad(y, (x, w, wgu, wd), g)
    assert seen == [pinned] * 3


@pytest.mark.parametrize("dtype,options,block_m", [(torch.bfloat16, "", 128), (torch.float32, "", 128),
                                                   (torch.float32, "float32_products=ieee", 64)],
                         ids=["bf16", "float32", "float32-ieee"])
def test_plan_shapes_on_cuda_follow_the_dtype_and_the_options(monkeypatch, dtype, options, block_m):
    """On CUDA (fake tensors: no GPU needed) 16-bit and float32 take the kernels; the fake's plan has the row tiles of
    the autotuned kernels (128 rows) or of float32's fixed configuration for its way of multiplying (128 for the
    tensor cores' bf16x6 and bf16x3, 64 for ieee), or of a pinned one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moeblaze_fx import ops
    from moeblaze_fx.kernels import autotune
    from moeblaze_fx.kernels.reference import max_tiles

    if ops._triton_kernels() is None:
        pytest.skip("no Triton: CUDA takes the PyTorch path")
    monkeypatch.setattr(autotune, "interpreting", lambda: False)  # as on a GPU machine
    T, d, h, E, K = 100, 16, 8, 4, 2
    cpu, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(torch.empty(E, 2 * h, d)),
                                                            torch.empty(E, d, h)))
    with FakeTensorMode():  # (a fake CUDA tensor cannot be sliced without CUDA: the parameters as layout_of gives them)
        x, w = torch.empty(T, d, device="cuda", dtype=dtype), torch.empty(T, K, device="cuda", dtype=dtype)
        ids = torch.empty(T, K, device="cuda", dtype=torch.int64)
        params = [torch.empty_strided(p.shape, p.stride(), device="cuda", dtype=dtype) for p in cpu]
        assert ops._use_triton(x)
        plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0, options)[2]
        assert plan[3].shape == (max_tiles(T * K, E, block_m),)
        plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0,
                                          "kernel_config=block_m=32")[2]
        assert plan[3].shape == (max_tiles(T * K, E, 32),)
    with autotune.using(moeblaze_fx.config.decode_kernels(options), dtype):
        assert autotune.autotuning() == (dtype != torch.float32) and autotune.plan_block_m() == block_m


def test_kernel_options_argument_is_checked():
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    with pytest.raises(ValueError, match="kernel_options: gluon must be 1, 0, true or false, got 'maybe'"):
        torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0, "gluon=maybe")
    with pytest.raises(ValueError, match="names from \\['dispatch_config', 'float32_products', 'gluon', "
                                         "'kernel_config', 'replay'\\]"):
        torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0, "tma=0")
    # the PyTorch path (CPU) takes the same options: they choose among kernels, never what is computed
    y0 = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)[0]
    y1 = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0, "gluon=0")[0]
    assert torch.equal(y0, y1)


def test_backward_refuses_a_policy_that_is_not_one():
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        torch.ops.moeblaze.moe_ffn_backward(torch.ones(10, 8), x.detach(), ids, w.detach(), params, layout,
                                            torch.empty(0), [], "swiglu", "auto", 0)


def test_backward_policy_must_match_what_the_forward_saved():
    """The policy reaches the backward as an argument; a pre-activation tensor that disagrees with it is refused."""
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    _, preact, plan = torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)
    with pytest.raises(ValueError, match="recompute=True does not match preact"):
        torch.ops.moeblaze.moe_ffn_backward(torch.ones(10, 8), x.detach(), ids, w.detach(), params, layout,
                                            preact, plan, "swiglu", "recompute", 0)


def test_pytorch_path_returns_no_plan():
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    assert torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, "swiglu", "activations", 0)[2] == []


@pytest.mark.parametrize("plan", [[torch.zeros(5, dtype=torch.int32)] * 4, [torch.zeros(5, dtype=torch.int64)] * 5],
                         ids=["four-tensors", "int64"])
def test_backward_refuses_a_malformed_plan(plan):
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    params, layout = moeblaze_fx.layout.layout_of(ExpertParams(*split_gate_up(wgu), wd))
    with pytest.raises(ValueError, match="plan must be the forward's 5 int32 tensors"):
        torch.ops.moeblaze.moe_ffn_backward(torch.ones(10, 8), x.detach(), ids, w.detach(), params, layout,
                                            torch.empty(0), plan, "swiglu", "recompute", 0)


class _ZeroFills(TorchDispatchMode):
    """Records the shapes of the zero-filled tensors the ops under it produce."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like, torch.ops.aten.new_zeros,
                                   torch.ops.aten.zero_, torch.ops.aten.fill_) and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_backward_gets_no_zero_filled_preact_gradient(checkpoint):
    # The saved pre-activations are an output with no gradient: autograd must not hand backward a zero-filled
    # [T*K, 2h] for them (at config A, 4.3 GB written per step).
    T, d, h, E, K = 32, 16, 24, 4, 2
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32)
    y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint)
    with _ZeroFills() as fills:
        got = torch.autograd.grad(y, (x, w, wgu, wd), torch.ones_like(y))
    assert (T * K, 2 * h) not in fills.shapes
    want = torch.autograd.grad(_ref(x, ids, w, wgu, wd), (x, w, wgu, wd), torch.ones_like(y))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _NoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_backward_with_no_gradient_for_y():
    # A consumer of y that returns no gradient: backward still runs (x has another path to the loss) and gives
    # zeros, not an error.
    x, ids, w, wgu, wd = _inputs(12, 8, 6, 4, 2, dtype=torch.float32)
    y = moe_ffn(x, ids, w, (wgu, wd))
    dx, dw, dwgu, dwd = torch.autograd.grad(_NoGrad.apply(y).sum() + x.sum(), (x, w, wgu, wd))
    assert torch.equal(dx, torch.ones_like(x))
    assert not dw.any() and not dwgu.any() and not dwd.any()


@pytest.mark.parametrize("checkpoint,chunk_tokens", [("activations", 0), ("recompute", 0), ("activations", 5)],
                         ids=["split-backward", "recompute", "chunks"])
def test_gradients_with_create_graph_equal_the_plain_ones_and_refuse_a_second_derivative(checkpoint, chunk_tokens):
    # The backward operators have no derivative: a first-order backward under create_graph=True gives the plain
    # gradients, and differentiating them again is an error naming why, never a silent zero.
    x, ids, w, wgu, wd = _inputs(12, 8, 6, 4, 2)
    y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint, chunk_tokens=chunk_tokens)
    g = torch.randn_like(y)
    plain = torch.autograd.grad(y, (x, w, wgu, wd), g, retain_graph=True)
    graphed = torch.autograd.grad(y, (x, w, wgu, wd), g, create_graph=True)
    for a, b in zip(graphed, plain):
        assert a.requires_grad
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="its gradients are not differentiable"):
        torch.autograd.grad(sum(t.sum() for t in graphed), (x, w, wgu, wd))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(x=a["x"][None]), "x must be [T, d]"),
        (lambda a: a.update(ids=a["ids"].float()), "ids must be int32 or int64"),
        (lambda a: a.update(ids=a["ids"][:-1], weights=a["weights"][:-1]), "must both be [T, K]"),
        (lambda a: a.update(w_gate_up=a["w_gate_up"][:, :, :-1].contiguous()), "experts[0] (w_gate_up) must be [E, 2h, d] with d = 8"),
        (lambda a: a.update(w_down=a["w_down"][:-1]), "experts[1] (w_down) must be [E, d, h] = (4, 8, 6)"),
        (lambda a: a.update(x=a["x"].half()), "must have x's dtype"),
        (lambda a: a.update(x=a["x"].int()), "unsupported dtype"),
        (lambda a: a.update(activation="tanh"), "unknown activation"),
        (lambda a: a.update(checkpoint="everything"), "unknown checkpoint policy"),
        (lambda a: a["ids"].__setitem__((0, 0), -1), "negative expert ids"),
    ],
    ids=["x-rank", "ids-dtype", "T-mismatch", "d-mismatch", "E-mismatch", "dtype-mismatch", "int-x", "activation",
         "policy", "negative-id"],
)
def test_bad_input_is_a_clear_error(mutate, message):
    x, ids, w, wgu, wd = _inputs(6, 8, 6, 4, 2, dtype=torch.float32)
    args = dict(x=x.detach(), ids=ids, weights=w.detach(), w_gate_up=wgu.detach(), w_down=wd.detach())
    kwargs = {}
    mutate(args)
    for key in ("activation", "checkpoint"):
        if key in args:
            kwargs[key] = args.pop(key)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        moe_ffn(args["x"], args["ids"], args["weights"], (args["w_gate_up"], args["w_down"]), **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
@pytest.mark.parametrize("T,d,h,E,K", [(1000, 256, 192, 8, 2), (333, 128, 96, 16, 4), (64, 64, 64, 4, 4)],
                         ids=lambda v: str(v))
def test_cuda_bfloat16_against_float32_reference(T, d, h, E, K, checkpoint):
    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.bfloat16, device="cuda")
    y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint)
    leaves32 = [t.detach().float().requires_grad_() for t in (x, w, wgu, wd)]
    ref = _ref(leaves32[0], ids, leaves32[1], leaves32[2], leaves32[3])
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, (x, w, wgu, wd), g.bfloat16())
    want = torch.autograd.grad(ref, leaves32, g)
    for name, a, b in zip(("y", "x", "weights", "w_gate_up", "w_down"), (y, *got), (ref, *want)):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel <= 1e-2, f"{name}: relative error {rel:.3g}"
    assert moeblaze_fx.moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint).equal(y)  # deterministic


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
@pytest.mark.parametrize("T,d,h,E,K,chunk_tokens", [(1000, 256, 256, 8, 2, None), (333, 128, 96, 16, 4, 100)],
                         ids=["gluon-shapes", "ragged-windows"])
# the default under torch's "highest" float32 precision (bf16x6), its TF32 counterpart and the CUDA cores' exact
# products; each within its error bound of float64 (cuBLAS's float32 reaches about 7e-7 and its TF32 5e-4 at
# OLMoE's layer, benchmarks/RESULTS.md)
@pytest.mark.parametrize("products,tol", [("auto", 3e-6), ("bf16x3", 1e-4), ("ieee", 1e-5)])
def test_cuda_float32_runs_the_kernels_without_host_sync(T, d, h, E, K, chunk_tokens, checkpoint, products, tol):
    """float32 on CUDA takes the Triton kernels (one configuration per way of multiplying,
    autotune.FLOAT32_CONFIGS), never the Gluon kernels (16-bit only, even on shapes they take), with no host
    synchronisation once compiled; the output and every gradient within ``tol`` (relative) of the float64
    reference. "auto" is bf16x6 under torch's default float32 precision."""
    from moeblaze_fx.kernels import autotune
    from moeblaze_fx.kernels.sm90 import down as sm90_down
    from moeblaze_fx.kernels.sm90 import dw as sm90_dw
    from moeblaze_fx.kernels.sm90 import gather as sm90_gather

    x, ids, w, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.float32, device="cuda", route=_with_sentinels)
    g = torch.randn(T, d, generator=torch.Generator().manual_seed(3)).cuda()

    def step():
        with moeblaze_fx.patch(kernels={"float32_products": products}):
            y = moe_ffn(x, ids, w, (wgu, wd), checkpoint=checkpoint, chunk_tokens=chunk_tokens)
            return y, *torch.autograd.grad(y, (x, w, wgu, wd), g)

    assert autotune.resolve_float32_products(KernelOptions()) == "bf16x6"  # torch's default: "highest"
    gluon = (sm90_down.launches(), sm90_dw.launches(), sm90_gather.launches())
    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert (sm90_down.launches(), sm90_dw.launches(), sm90_gather.launches()) == gluon
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, wgu, wd)]
    ref = _ref(leaves64[0], ids, *leaves64[1:])
    want = (ref, *torch.autograd.grad(ref, leaves64, g.double()))
    for name, a, b in zip(("y", "x", "weights", "w_gate_up", "w_down"), got, want):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel <= tol, f"{name}: relative error {rel:.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("experts,chunk_tokens,ops", [("hf", None, 4), ("hf", 300, 2), ("separate", None, 4)],
                         ids=["split-backward", "windows", "separate-weights"])
def test_replayed_calls_match_the_orchestrated_ones(experts, chunk_tokens, ops):
    """A call whose signature was recorded is replayed (kernels/program.py): bitwise the output and every gradient
    of the same call orchestrated again (kernel option replay=False), over new tensors at every step (new addresses:
    the transients, the gradient buffers' pointer tables and the descriptors over them move). One record per
    operator at its second call, every later call replayed: the forward and the three backward operators of the split
    backward, or the forward and the one backward operator over several slot windows. Weights made for each call
    (cast from the model's) are recorded once and replayed over the next calls' weights, which move and change."""
    from moeblaze_fx.kernels import program

    T, d, h, E, K = 1000, 256, 256, 8, 2  # shapes the Gluon kernels take
    _, _, _, wgu, wd = _inputs(T, d, h, E, K, dtype=torch.bfloat16, device="cuda")
    weights = (wgu, wd) if experts == "hf" else ExpertParams(*[t.detach().clone().requires_grad_()
                                                               for t in (*split_gate_up(wgu), wd)])
    leaves = (wgu, wd) if experts == "hf" else tuple(weights)[:3]

    def step(replay: bool, seed: int, weights=weights, leaves=leaves):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(T, d, device="cuda", generator=g).bfloat16().requires_grad_()
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K]
        w = torch.rand(T, K, device="cuda", generator=g).bfloat16().requires_grad_()
        gy = torch.randn(T, d, device="cuda", generator=g).bfloat16()
        with moeblaze_fx.patch(kernels={"replay": replay}):
            y = moe_ffn(x, ids, w, weights, chunk_tokens=chunk_tokens)
        return (y, *torch.autograd.grad(y, (x, w, *leaves), gy, retain_graph=True))  # (weights cast once, used twice)

    step(False, 0)  # compiles every kernel: no record is refused
    before = program.stats()
    replayed = [step(True, seed) for seed in range(1, 5)]
    after = program.stats()
    assert {k: after[k] - before[k] for k in after} == {"recorded": ops, "replayed": 2 * ops, "refused": 0}
    for seed, got in enumerate(replayed, 1):
        for a, b in zip(got, step(False, seed)):
            assert torch.equal(a, b)
    # weights made for each call from the model's (cast, as under autocast): recorded once, replayed over others
    def made(seed):
        cast = [None if t is None else t * (1.0 + seed) for t in weights]
        return tuple(cast) if experts == "hf" else ExpertParams(*cast)

    first = made(5)  # the recorded call's weights are those of the call before it (their tables kept by address)
    steps = [(5, first), (6, first), (7, made(7)), (8, made(8))]
    before = program.stats()
    replayed = [step(True, seed, cast) for seed, cast in steps]
    after = program.stats()
    assert {k: after[k] - before[k] for k in after} == {"recorded": ops, "replayed": 2 * ops, "refused": 0}
    for (seed, cast), got in zip(steps, replayed):
        for a, b in zip(got, step(False, seed, cast)):
            assert torch.equal(a, b)


def test_importing_the_package_loads_no_benchmark_code():
    code = ("import sys, moeblaze_fx; assert not [m for m in sys.modules if m.startswith('moeblaze_fx.bench')]; "
            "assert callable(moeblaze_fx.compare); assert 'moeblaze_fx.bench.compare' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("experts,error,match", [
    # one expert's weight where all experts' are expected: the message names the argument and the shape wanted
    (lambda wgu, wd: (wgu[0], wd), ValueError, r"experts\[0\] \(w_gate_up\) must be \[E, 2h, d\].*one expert's"),
    (lambda wgu, wd: (wgu, wd[0]), ValueError, r"experts\[1\] \(w_down\) must be \[E, d, h\] = \(4, 8, 6\)"),
    (lambda wgu, wd: (wgu, wd.transpose(1, 2)), ValueError, r"experts\[1\] \(w_down\) must be \[E, d, h\]"),
    (lambda wgu, wd: (wgu, wgu, wd), TypeError, r"got a tuple of 3 \(separate gate, up and down weights: pass "
                                                r"ExpertParams"),
    (lambda wgu, wd: wgu, TypeError, "experts must be Hugging Face's"),
    (lambda wgu, wd: ExpertParams(wgu[:, :6], wgu[:, 6:], wd[:3]), ValueError,
     r"experts.down must be \[E, rows, cols\] with E = 4 experts"),
], ids=["gate-up-of-one-expert", "down-of-one-expert", "down-transposed", "three-tensors", "one-tensor",
        "down-with-fewer-experts"])
def test_experts_argument_errors_name_the_argument(experts, error, match):
    x, ids, w, wgu, wd = _inputs(10, 8, 6, 4, 2, dtype=torch.float32)
    with pytest.raises(error, match=match):
        moe_ffn(x, ids, w, experts(wgu, wd))
