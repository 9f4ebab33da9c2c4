"""What an operator call keeps for the next (ops.py): its arguments' checks by their signature, the experts' tables by
the parameters' addresses, the layout and the activation parsed once; nothing kept holds a parameter."""
from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

from moeblaze_fx import ops
from moeblaze_fx.config import KernelOptions, encode_kernels
from moeblaze_fx.kernels.reference import ExpertParams, parse_activation, split_gate_up
from moeblaze_fx.layout import decode_layout, layout_of


def _args(T=12, d=8, h=6, E=4, K=2, device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g, dtype=torch.float64).to(device, dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(device)
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(device, dtype)
    wgu = (torch.randn(E, 2 * h, d, generator=g, dtype=torch.float64) / d**0.5).to(device, dtype)
    wd = (torch.randn(E, d, h, generator=g, dtype=torch.float64) / h**0.5).to(device, dtype)
    params, layout = layout_of(ExpertParams(*split_gate_up(wgu), wd))
    return x, ids, w, params, layout


def _call(x, ids, w, params, layout, chunk_tokens=0, activation="swiglu", kernel_options=""):
    return torch.ops.moeblaze.moe_ffn(x, ids, w, params, layout, activation, "activations", chunk_tokens,
                                      kernel_options)[0]


@pytest.fixture
def counted_checks(monkeypatch):
    calls = []
    check = ops._check_inputs

    def counting(*args):
        calls.append(args)
        return check(*args)

    monkeypatch.setattr(ops, "_check_inputs", counting)
    ops._CHECKED.clear()
    return calls


def test_arguments_are_checked_once_per_signature(counted_checks):
    x, ids, w, params, layout = _args()
    first = _call(x, ids, w, params, layout)
    second = _call(x, ids, w, params, layout)
    assert len(counted_checks) == 1
    assert torch.equal(first, second)
    _call(x, ids, w, params, layout, chunk_tokens=5)  # another signature: checked
    assert len(counted_checks) == 2
    x2, ids2, w2, _, _ = _args(T=7, seed=1)  # other tokens: checked
    _call(x2, ids2, w2, params, layout)
    assert len(counted_checks) == 3
    _call(x2, ids2, w2, params, layout)
    assert len(counted_checks) == 3


def test_a_failed_check_is_not_kept(counted_checks):
    x, ids, w, params, layout = _args()
    _call(x, ids, w, params, layout)
    for _ in range(2):  # the same shapes with a wrong activation fail every time
        with pytest.raises(ValueError, match="unknown activation"):
            _call(x, ids, w, params, layout, activation="swishy")
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        _call(x, ids.double(), w, params, layout)
    bad = list(layout)
    bad[0] += 1  # one expert more than the parameters hold
    with pytest.raises(ValueError, match="bad layout"):
        _call(x, ids, w, params, bad)
    assert len(ops._CHECKED) == 1


def test_a_full_cache_is_emptied(monkeypatch):
    monkeypatch.setattr(ops, "_CACHE_MAX", 3)
    cache: dict = {}
    for i in range(3):
        ops._remember(cache, i, i)
    assert cache == {0: 0, 1: 1, 2: 2}
    ops._remember(cache, 3, 3)
    assert cache == {3: 3}


def test_layout_and_activation_are_parsed_once():
    _, _, _, _, layout = _args()
    E, views = decode_layout(layout)
    assert decode_layout(list(layout)) is decode_layout(tuple(layout))  # the same decoded object
    assert E == 4 and isinstance(views, tuple) and views[0].rows == 6
    assert parse_activation("swiglu_oai(alpha=1.702,limit=7.0)") is parse_activation("swiglu_oai(alpha=1.702,limit=7.0)")
    with pytest.raises(ValueError, match="unknown activation"):
        parse_activation(3)


@pytest.mark.cuda
def test_cuda_tables_are_kept_without_the_parameters():
    """The tables are built once per parameters' addresses; what is kept has no dense view, so a model's weights are
    freed with it; parameters at new addresses get new tables, and the output follows them. (Calls orchestrated
    every time, the kernel option replay=False: a replayed call makes its tables in its program,
    tests/ops/test_moe_ffn.py.)"""
    ops._WEIGHTS.clear()
    x, ids, w, params, layout = _args(T=64, d=64, h=64, E=4, K=2, device="cuda", dtype=torch.bfloat16)
    call = functools.partial(_call, kernel_options=encode_kernels(KernelOptions(replay=False)))
    first = call(x, ids, w, params, layout)
    assert len(ops._WEIGHTS) == 1
    kept = next(iter(ops._WEIGHTS.values()))
    assert all(t is None or t.dense is None for t in kept)
    assert torch.equal(call(x, ids, w, params, layout), first)
    assert len(ops._WEIGHTS) == 1
    moved = [p.clone() for p in params]  # the same values at other addresses
    assert torch.equal(call(x, ids, w, moved, layout), first)
    assert len(ops._WEIGHTS) == 2
    assert len(params) == 2  # [gate|up, down]: y is linear in the down weights
    torch.testing.assert_close(call(x, ids, w, [params[0], 2 * params[1]], layout), first * 2, rtol=0, atol=0)
    refs = [weakref.ref(p) for p in moved]
    del moved
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.cuda
def test_cuda_one_windows_first_tile_is_kept():
    from moeblaze_fx.kernels.dispatch import dispatch
    from moeblaze_fx.kernels.triton.common import slot_windows

    ids = torch.randint(0, 4, (32, 2), device="cuda")
    plan = dispatch(ids, 4)
    a, b = slot_windows(plan, 0)[0].tile0, slot_windows(plan, 0)[0].tile0
    assert a is b and a.tolist() == [0]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # another stream: its own
        assert slot_windows(plan, 0)[0].tile0 is not a


def test_kept_weight_units_follow_their_parameters():
    """kernels.plan keeps a call's weight units per (owners, units, dtype, device, options): built once while the
    parameters stay where they are, rebuilt in place when they move, gone with them; never holding them."""
    pytest.importorskip("triton")
    from moeblaze_fx.config import KernelOptions
    from moeblaze_fx.kernels import autotune, plan

    plan._UNITS.clear()
    made = []

    def get(key, owners, x, what=("forward",)):
        return plan.keep(plan.UnitsKey(key, owners), what, x, lambda: made.append(key) or object())

    p, q = torch.zeros(4), torch.zeros(3)
    x = torch.zeros(2, dtype=torch.float16)
    first = get("at A", (p, q), x)
    assert get("at A", (p, q), x) is first and made == ["at A"]
    assert get("at A", (p, q), x, ("backward",)) is not first and len(plan._UNITS) == 2  # other units
    assert get("at A", (p, q), x.float()) is not first and len(plan._UNITS) == 3  # another dtype
    with autotune.using(KernelOptions(gluon=False)):  # other kernel options
        assert get("at A", (p, q), x) is not first and len(plan._UNITS) == 4
    moved = get("at B", (p, q), x)  # the parameters moved: rebuilt, in the same entry
    assert moved is not first and len(plan._UNITS) == 4 and get("at B", (p, q), x) is moved
    assert made == ["at A"] * 4 + ["at B"]
    assert get(None, (p, q), x) is not moved  # no key: never kept
    del q
    gc.collect()
    assert len(plan._UNITS) == 0  # every entry had q among its owners
    assert plan.keep(None, ("forward",), x, lambda: 7) == 7 and len(plan._UNITS) == 0
    # an owner that takes no weak reference could never drop its entry: none is made
    assert plan.keep(plan.UnitsKey("at A", (p, 1234567)), ("forward",), x, lambda: 8) == 8 and len(plan._UNITS) == 0


def test_a_full_units_cache_is_emptied(monkeypatch):
    pytest.importorskip("triton")
    from moeblaze_fx.kernels import plan

    monkeypatch.setattr(plan, "_UNITS_MAX", 2)
    plan._UNITS.clear()
    owners = [torch.zeros(1) for _ in range(3)]
    for o in owners:
        plan.keep(plan.UnitsKey("k", (o,)), ("forward",), owners[0], object)
    assert len(plan._UNITS) == 1


@pytest.mark.cuda
def test_cuda_weight_units_are_kept_without_the_parameters(monkeypatch):
    """An operator step builds its plans' weight units (the Gluon descriptors over the weights among them) once; a
    later step reuses them; parameters moved to new memory replace them; what is kept holds the parameters' memory
    but not the parameters, and that memory is freed with them."""
    from moeblaze_fx.kernels import plan

    ops._WEIGHTS.clear()
    plan._UNITS.clear()
    built = []
    down_unit = plan.down_unit
    monkeypatch.setattr(plan, "down_unit", lambda *a: built.append(len(a)) or down_unit(*a))  # (holding no view)
    x, ids, w, params, layout = _args(T=256, d=128, h=128, E=4, K=2, device="cuda", dtype=torch.bfloat16)

    def step(params):
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_()
        y = _call(xg, ids, w, params, layout)
        y.backward(torch.ones_like(y))
        return [y.detach(), xg.grad] + [p.grad for p in params]

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a, b))

    params = [p.detach().clone().requires_grad_() for p in params]
    first = step(params)
    per_step = len(built)
    kept = len(plan._UNITS)
    assert per_step >= 2 and kept >= 2
    assert same(step(params), first) and len(built) == per_step and len(plan._UNITS) == kept  # nothing built
    for p in params:  # the same parameters in new memory: rebuilt, in place
        p.data = p.data.clone()
    assert same(step(params), first) and len(built) == 2 * per_step and len(plan._UNITS) == kept
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    other = [p.detach().clone().requires_grad_() for p in params]  # other parameters: their own entries
    other_bytes = sum(p.numel() * p.element_size() for p in other)
    assert same(step(other), first) and len(built) == 3 * per_step and len(plan._UNITS) == 2 * kept
    refs = [weakref.ref(p) for p in other]
    del other
    gc.collect()
    torch.cuda.synchronize()
    assert all(r() is None for r in refs) and len(plan._UNITS) == kept  # gone with them
    # and their memory with them (what stays: the new addresses' pointer tables, a few hundred bytes)
    assert torch.cuda.memory_allocated() < before + other_bytes // 8


def test_weight_units_are_kept_only_for_a_models_weights():
    """The plans keep their weight units for parameters and tensors requiring grad (they persist from call to call);
    not for weights made for the call (cast under autocast: new tensors each time), whose units would be made and
    dropped at every call."""
    pytest.importorskip("triton")
    from moeblaze_fx.kernels import plan

    _, _, _, params, layout = _args()
    _, views = decode_layout(layout)
    assert ops._units_key(("k",), params, views) is None  # plain tensors, no grad: cast copies
    grads = [p.detach().requires_grad_() for p in params]
    got = ops._units_key(("k",), grads, views)
    assert isinstance(got, plan.UnitsKey) and got.key == ("k",)
    assert len(got.owners) == 2 and all(a is b for a, b in zip(got.owners, grads))  # [gate|up, down]: whole roles
    frozen = [torch.nn.Parameter(p, requires_grad=False) for p in params]  # frozen experts (fine-tuning)
    assert all(a is b for a, b in zip(ops._units_key(("k",), frozen, views).owners, frozen))
    assert ops._units_key(("k",), [grads[0], params[1]], views) is None  # one not a model's weight


def test_a_models_tables_are_kept_whole_and_go_with_it(monkeypatch):
    """For a model's weights (parameters, or tensors requiring grad) the experts' tables are kept whole, their dense
    views of the detached parameters included, with the plans' weight units: a later call with the parameters where
    they were views nothing again; parameters moved get new tables; the tables go with the parameters. (The Triton
    path's bookkeeping on the CPU: nothing is launched.)"""
    pytest.importorskip("triton")
    from moeblaze_fx.kernels import plan, tables

    monkeypatch.setattr(ops, "_use_triton", lambda x: True)
    monkeypatch.setattr(tables, "cacheable", lambda device: True)
    monkeypatch.setattr(tables, "stream_key", lambda device: 0)
    plan._UNITS.clear()
    x, _, _, params, layout = _args(dtype=torch.float32)
    params = [p.detach().clone().requires_grad_() for p in params]
    E, views = decode_layout(layout)

    def weights(params):
        return ops._expert_weights(x, params, views, E, ops._weights_key(params, layout))

    got = weights(params)  # (its units hold the parameters: the call's own)
    first = got.tables
    assert got.units is not None and len(plan._UNITS) == 1
    assert first.gate.dense is not None and first.gate.dense.data_ptr() == params[0].data_ptr()
    assert first.gate.dense._base is not params[0] and not first.gate.dense.requires_grad
    again = weights(params).tables
    assert again is first  # kept: nothing viewed again
    for p in params:  # the same parameters in new memory: new tables in the same entry
        p.data = p.data.clone()
    moved = weights(params).tables
    assert moved is not first and len(plan._UNITS) == 1 and moved.down.dense.data_ptr() == params[1].data_ptr()
    refs = [weakref.ref(p) for p in params]
    del params, got, p
    gc.collect()
    assert all(r() is None for r in refs) and len(plan._UNITS) == 0  # gone with them
    # weights cast for the call (no grad, not parameters): only their pointers are kept, nothing viewed is
    plain = _args()[3]
    assert weights(plain).units is None and len(plan._UNITS) == 0
