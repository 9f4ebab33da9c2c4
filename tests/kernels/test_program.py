"""Recorded launch programs (kernels/program.py) on the CPU: what a replay runs with a new call's tensors, what it
releases, and which calls are never recorded.

The launches here are stand-ins for the driver's launch function (``program.launched`` gets what ``kernels.launch``
passes it): Python functions over the tensors they are given, which is all a replay can tell apart. The operator's
own calls are replayed on the GPU (tests/ops/test_moe_ffn.py::test_replayed_calls_match_the_orchestrated_ones).
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from moeblaze_fx.kernels import program

HEAD = 13  # the driver launch's arguments before the kernel's: grid (3), stream, function, coop, pdl, 2 scratch,
# metadata, 3 hooks


def launch(run, *args, descs=(), encode=None):
    """What kernels.launch does for a cached launch: the launch itself (a driver call: no PyTorch operation is seen),
    then its record."""
    metas, flat = dict(descs), []
    for i, a in enumerate(args):  # each descriptor spliced in as its encoding (launch._expand)
        flat.extend(encode(a, metas[i]) if i in metas else [a])
    with _disable_current_modes():
        run(1, 1, 1, 0, "function", False, False, None, None, "metadata", None, None, None, *flat)
    program.launched(run, (1, 1, 1), 0, "function", False, False, "metadata", tuple(args), tuple(descs), encode)


def add_one(*a):  # out[:] = inp + 1, and the address it was given
    out, inp, address, log = a[HEAD:]
    out.copy_(inp + 1)
    log.append(address - out.data_ptr())


@program.host_step
def table(first: int, n: int, step: int) -> torch.Tensor:
    return torch.arange(first, first + n * step, step, dtype=torch.int64)


def body_of(log, tables):
    def body(x, w):
        y = torch.empty_like(x)
        launch(add_one, y, x, y.data_ptr() + 8, log)  # an address 8 bytes into y
        tables.append(table(y.data_ptr(), 3, 16))
        return y * w.sum(), y.new_zeros(2)
    return body


def test_a_replay_runs_the_recorded_steps_over_the_new_calls_tensors():
    log, tables = [], []
    body = body_of(log, tables)
    entry = program.Entry()
    before = program.stats()
    x, w = torch.randn(4, 3), torch.randn(5)
    program.run(entry, [x, w], lambda: body(x, w))
    assert entry.program is None  # a signature's first call is not recorded
    log.clear(), tables.clear()
    y0, z0 = program.run(entry, [x, w], lambda: body(x, w))
    assert entry.program is not None and entry.why is None
    assert entry.program.kinds == ("op", "launch", "host", "op", "op", "op")  # empty_like, ..., sum, mul, new_zeros
    torch.testing.assert_close(y0, (x + 1) * w.sum(), rtol=0, atol=0)
    for _ in range(2):  # new tensors: the replay's results are theirs, and so are the launch's address and the table
        x, w = torch.randn(4, 3), torch.randn(5)
        y, z = program.run(entry, [x, w], lambda: pytest.fail("replayed calls do not run the body"))
        torch.testing.assert_close(y, (x + 1) * w.sum(), rtol=0, atol=0)
        assert torch.equal(z, torch.zeros(2)) and z.data_ptr() != z0.data_ptr()
    after = program.stats()
    assert (after["recorded"] - before["recorded"], after["replayed"] - before["replayed"]) == (1, 2)
    assert log == [8, 8, 8]
    assert len(tables) == 1  # the host step ran again in each replay, over the new y: see below


def test_a_host_step_is_called_again_with_the_addresses_moved():
    calls = []

    @program.host_step
    def spy(first: int, n: int) -> torch.Tensor:
        calls.append(first)
        return torch.full((n,), first, dtype=torch.int64)

    def body(x):
        y = x + 1
        t = spy(y.data_ptr() + 4, 2)
        return y, t + 0

    entry = program.Entry()
    x = torch.randn(3)
    program.run(entry, [x], lambda: body(x))
    program.run(entry, [x], lambda: body(x))
    keep = []
    for _ in range(3):
        x = torch.randn(3)
        y, t = program.run(entry, [x], lambda: None)
        keep.append(y)  # (kept alive: each new y has its own address)
        assert calls[-1] == y.data_ptr() + 4 and torch.equal(t, torch.full((2,), y.data_ptr() + 4))
    assert len(calls) == 5


def test_a_transient_is_released_after_its_last_use():
    seen = {}

    def first(*a):
        seen["tmp"] = weakref.ref(a[HEAD])

    def second(*a):
        seen["alive at the second launch"] = seen["tmp"]() is not None

    def body(x):
        tmp = torch.empty(1000)
        launch(first, tmp)
        del tmp
        launch(second, x)
        return x * 2

    entry = program.Entry()
    x = torch.randn(2)
    for _ in range(2):
        program.run(entry, [x], lambda: body(x))
        assert seen["alive at the second launch"] is False
    program.run(entry, [x], lambda: None)
    assert seen["alive at the second launch"] is False  # the replay released it where the body did


class Desc:
    """A stand-in host tensor descriptor: a base tensor and fields."""

    def __init__(self, base, block):
        self.base, self.block = base, block


def test_descriptors_over_the_calls_tensors_are_made_again_and_others_kept():
    weight = torch.randn(8)
    kept = Desc(weight, [4])
    encodings = []

    def encode(desc, meta):
        encodings.append((desc.base.data_ptr(), tuple(desc.block), meta))
        return [desc.base.data_ptr(), desc.block[0]]

    got = []

    def run(*a):
        got.append(a[HEAD:])

    def body(x):
        y = x * 2
        launch(run, Desc(y, [2]), kept, descs=((0, "m0"), (1, "m1")), encode=encode)
        return y

    entry = program.Entry()
    x = torch.randn(6)
    for _ in range(2):
        program.run(entry, [x], lambda: body(x))
    assert entry.program is not None
    n = len(encodings)
    outs = []
    for _ in range(2):
        x = torch.randn(6)
        outs.append(program.run(entry, [x], lambda: None))
        y = outs[-1]
        assert got[-1] == (y.data_ptr(), 2, weight.data_ptr(), 4)
    # the weight's descriptor was encoded at the record only; y's again per new address
    assert [e for e in encodings[n:] if e[0] == weight.data_ptr()] == []
    assert [e[2] for e in encodings[n:]] == ["m0", "m0"]


def test_bumped_counters_count_replays_too():
    counter = program.Counter()

    def body(x):
        program.bump(counter)
        program.bump(counter, 2)
        return x + 1

    entry = program.Entry()
    x = torch.randn(2)
    for _ in range(4):
        program.run(entry, [x], lambda: body(x))
    assert counter.n == 12 and entry.program is not None


@pytest.mark.parametrize("case", ["item", "refused_launch", "host_tensor_address", "returns_input", "overlap",
                                  "same_tensor_twice"])
def test_calls_that_could_differ_unseen_are_never_recorded(case):
    x = torch.randn(4)
    inputs = {"overlap": [x, x[1:]], "same_tensor_twice": [x, x]}.get(case, [x])

    def body():
        if case == "item":
            return x * float(x.sum())  # a host value of the call's data
        if case == "refused_launch":
            program.refuse("a launch through Triton's own path")
            return x + 1
        if case == "host_tensor_address":
            y = x + 1
            return y, torch.tensor([y.data_ptr()]) + 0
        if case == "returns_input":
            return x
        return x + 1

    entry = program.Entry()
    before = program.stats()["refused"]
    for _ in range(program.ATTEMPTS + 3):
        program.run(entry, inputs, body)
    assert entry.program is None and entry.attempts == program.ATTEMPTS and entry.calls == program.ATTEMPTS + 3
    assert program.stats()["refused"] - before == program.ATTEMPTS
    assert entry.why == {"item": "aten._local_scalar_dense.default returned float", "refused_launch": "a launch through Triton's own path",
                         "host_tensor_address": "a host tensor holds an address of the call's tensors",
                         "returns_input": "the call returned a tensor it did not make",
                         "overlap": "two of the call's tensors overlap",
                         "same_tensor_twice": "one tensor passed twice"}[case]


def test_a_refused_record_keeps_the_calls_result():
    entry = program.Entry()
    x = torch.randn(3)

    def body():
        program.refuse("no")
        return x * 3

    for _ in range(2):
        torch.testing.assert_close(program.run(entry, [x], body), x * 3)
    assert program.recording() is None and entry.attempts == 1


@pytest.mark.parametrize("case", ["empty", "new_empty", "empty_strided", "zeros", "as_strided", "pinned", "channels_last"])
def test_allocations_and_views_replay_through_the_python_bindings_as_recorded(case):
    """A replay calls PyTorch's Python bindings for the allocations and as_strided it recorded (program._fast_op),
    with the recorded dtype, device, shape and strides; a factory asking for anything more (pinned memory, another
    memory format) stays the recorded operator."""
    aten = torch.ops.aten
    base = torch.randn(6, 4, dtype=torch.float64)
    calls = {
        "empty": (aten.empty.memory_format, ([3, 5],), {"dtype": torch.float16, "device": torch.device("cpu")}),
        "new_empty": (aten.new_empty.default, (base, [2, 7]), {"dtype": torch.int32, "layout": torch.strided,
                                                               "pin_memory": False}),
        "empty_strided": (aten.empty_strided.default, ([4, 3], [1, 4]), {"dtype": torch.float32}),
        "zeros": (aten.zeros.default, ([5, 2],), {"dtype": torch.int64, "device": torch.device("cpu")}),
        "as_strided": (aten.as_strided.default, (base, [3, 2], [4, 2], 5), {}),
        "pinned": (aten.empty.memory_format, ([3],), {"dtype": torch.float32, "pin_memory": True}),
        "channels_last": (aten.empty.memory_format, ([2, 3, 4, 5],), {"memory_format": torch.channels_last}),
    }
    fn, args, kwargs = calls[case]
    fast, fast_kwargs = program._fast_op(fn, kwargs)
    assert (fast is fn) == (case in ("pinned", "channels_last"))
    if case == "pinned":
        return  # (pinning needs an accelerator: only the choice is checked)
    got, want = fast(*args, **fast_kwargs), fn(*args, **kwargs)
    assert (got.shape, got.stride(), got.dtype, got.device, got.storage_offset()) == \
        (want.shape, want.stride(), want.dtype, want.device, want.storage_offset())
    if case == "zeros":
        assert not got.any()
    if case == "as_strided":
        assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and torch.equal(got, want)
