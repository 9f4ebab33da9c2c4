"""kernels.launch: a launch goes through the compiled kernel's launcher only when everything Triton specializes on
matches an earlier launch, with the arguments Triton would pass; anything else takes ``kernel[grid]``. Driven here
with a stand-in kernel (the GPU's cuda tests run the real kernels through it)."""
import inspect
import types

import pytest
import torch

from moeblaze_fx.kernels import launch as L


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty, unspecialized=False):
        self.name, self.default = name, default
        self.is_constexpr = name.isupper()  # the stand-in's convention: constexprs are upper case
        self.do_not_specialize = unspecialized

    @property
    def has_default(self):
        return self.default is not inspect.Parameter.empty


class _Compiled:
    def __init__(self, calls):
        self.packed_metadata, self.function, self.calls = ("warps", 1, 0), "fn-handle", calls

    def run(self, *a):
        self.calls.append(("fast", a))


class _Kernel:
    """``kernel[grid](*args, **kwargs)`` records a slow launch and returns one compiled kernel per call."""

    def __init__(self, names, defaults, unspecialized=()):
        self.params = [_Param(n, defaults.get(n, inspect.Parameter.empty), n in unspecialized) for n in names]
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("slow", grid, args, kwargs))
            return _Compiled(self.calls)
        return run


class _Heuristics:
    """``triton.heuristics``: constexprs computed from the arguments at each launch."""

    def __init__(self, fn, values):
        self.fn, self.values, self.arg_names = fn, values, [p.name for p in fn.params]

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            for name, heuristic in self.values.items():
                kwargs[name] = heuristic({**dict(zip(self.arg_names, args)), **kwargs})
            return self.fn[grid](*args, **kwargs)
        return run


class _Chain:
    def __init__(self, *calls):
        self.calls = list(calls)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(L, "_SUPPORTED", True)
    monkeypatch.setattr(L, "_CACHE", {})
    monkeypatch.setattr(L, "_PARAM_KINDS", {})
    monkeypatch.setattr(L, "_knobs", types.SimpleNamespace(  # Triton 3.6's empty hook chains
        runtime=types.SimpleNamespace(launch_enter_hook=_Chain(), launch_exit_hook=_Chain(), debug=False),
        compilation=types.SimpleNamespace(instrumentation_mode="")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(L, "_JITFunction", _Kernel)
    monkeypatch.setattr(L, "_Heuristics", _Heuristics)
    return _Kernel(["x", "n", "flag", "BLOCK", "EXTRA"], {"EXTRA": 5})


def _kinds(kernel):
    return [c[0] for c in kernel.calls]


def test_second_launch_goes_to_the_launcher_with_triton_s_arguments(fast):
    x = torch.zeros(64)
    L.launch(fast, (3, 2), x, 17, True, BLOCK=64, num_warps=4)
    L.launch(fast, (3, 2), x, 18, True, BLOCK=64, num_warps=4)  # 17 and 18: neither 1 nor a multiple of 16
    assert _kinds(fast) == ["slow", "fast"]
    # grid padded to 3 dims, stream, handle, packed metadata, no launch metadata, hooks, the positional arguments,
    # then the remaining parameters in signature order (keyword, else default); num_warps is an option
    assert fast.calls[1][1] == (3, 2, 1, 77, "fn-handle", ("warps", 1, 0), None, None, None, x, 18, True, 64, 5)


@pytest.mark.parametrize("change", [
    lambda a: dict(a, n=1),  # Triton specializes an int equal to 1
    lambda a: dict(a, n=32),  # ... and one divisible by 16
    lambda a: dict(a, n=2**40),  # ... and its width
    lambda a: dict(a, x=torch.zeros(65)[1:]),  # a pointer's 16-byte alignment (4 bytes off)
    lambda a: dict(a, x=torch.zeros(64, dtype=torch.float16)),  # its dtype
    lambda a: dict(a, flag=False),
    lambda a: dict(a, BLOCK=128),  # a constexpr
    lambda a: dict(a, num_warps=8),  # an option
], ids=["int-1", "int-div16", "int-wide", "misaligned", "dtype", "bool", "constexpr", "option"])
def test_any_change_triton_specializes_on_misses(fast, change):
    base = dict(x=torch.zeros(64), n=17, flag=True, BLOCK=64, num_warps=4)
    for a in (base, change(base)):
        L.launch(fast, (1,), a["x"], a["n"], a["flag"], BLOCK=a["BLOCK"], num_warps=a["num_warps"])
    assert _kinds(fast) == ["slow", "slow"]


def test_unkeyed_arguments_hooks_and_an_unsupported_triton_take_triton_s_path(fast, monkeypatch):
    L.launch(fast, (1,), [1, 2], 17, True, BLOCK=64)  # a list is not keyed
    L.launch(fast, (1,), [1, 2], 17, True, BLOCK=64)
    L.launch(fast, lambda meta: (1,), torch.zeros(4), 17, True, BLOCK=64)  # a callable grid
    L.launch(fast, lambda meta: (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(fast) == ["slow"] * 4
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    for hook in ("launch_enter_hook", "launch_exit_hook"):  # a profiler's hook added to either chain
        monkeypatch.setattr(L._knobs.runtime, hook, _Chain(lambda metadata: None))
        L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
        monkeypatch.setattr(L._knobs.runtime, hook, _Chain())
    monkeypatch.setattr(L, "_SUPPORTED", False)  # another Triton than 3.6, or the interpreter
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(fast) == ["slow"] * 8
    monkeypatch.setattr(L, "_SUPPORTED", True)
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(fast) == ["slow"] * 8 + ["fast"]


def test_kernels_are_keyed_by_identity_never_hashed(fast):
    """A kernel's own hash rebuilds its source key at every launch (Triton's JITFunction): the cache keys kernels by
    identity and holds each one, so that an id is never reused by another kernel."""
    class Unhashable(_Kernel):
        def __hash__(self):
            raise AssertionError("hashed")

    a, b = (Unhashable(["x", "n", "flag", "BLOCK", "EXTRA"], {"EXTRA": 5}) for _ in range(2))
    for kernel in (a, b, a, b):
        L.launch(kernel, (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(a) == _kinds(b) == ["slow", "fast"]
    assert {id(a), id(b)} <= set(L._PARAM_KINDS) and L._PARAM_KINDS[id(a)][0] is a


def test_a_constexpr_passed_by_position_is_keyed_by_value(fast):
    for block in (2, 8, 8):  # as ints, 2 and 8 would share a key (neither 1 nor a multiple of 16)
        L.launch(fast, (1,), torch.zeros(4), 17, True, block)
    assert _kinds(fast) == ["slow", "slow", "fast"]
    assert fast.calls[2][1][-3:] == (True, 8, 5)


def test_heuristics_values_are_keyed(fast):
    """A ``triton.heuristics`` value depends on arguments beyond what Triton specializes on (here n % 64): it is
    computed at each launch and keyed, so 64 and 80 (both multiples of 16) get different kernels."""
    wrapped = _Heuristics(fast, {"BLOCK": lambda a: 64 if a["n"] % 64 == 0 else 32})
    for n in (64, 128, 80):
        L.launch(wrapped, (1,), torch.zeros(4), n, True)
    assert _kinds(fast) == ["slow", "fast", "slow"]
    assert fast.calls[0][3] == {"BLOCK": 64} and fast.calls[1][1][-2:] == (64, 5)
    assert fast.calls[2][3] == {"BLOCK": 32}


def test_an_autotuner_is_left_to_triton(fast):
    tuned = type("Autotuner", (), {"__getitem__": lambda self, grid: fast[grid]})()
    for _ in range(2):
        L.launch(tuned, (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(fast) == ["slow", "slow"]


def test_runtime_keywords_pre_run_hooks_and_triton_s_debug_are_not_reused(fast, monkeypatch):
    for _ in range(2):  # a runtime argument by keyword
        L.launch(fast, (1,), torch.zeros(4), 17, BLOCK=64, flag=True)
    assert _kinds(fast) == ["slow", "slow"]
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    monkeypatch.setattr(L._knobs.runtime, "debug", True)  # TRITON_DEBUG: kernels with device asserts
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    monkeypatch.setattr(L._knobs.runtime, "debug", False)
    fast.pre_run_hooks = [lambda *a, **k: None]
    L.launch(fast, (1,), torch.zeros(4), 17, True, BLOCK=64)
    assert _kinds(fast) == ["slow"] * 5


def test_a_missing_parameter_is_left_to_triton(fast):
    for _ in range(2):  # BLOCK has no default and is not given: Triton raises, and nothing is cached here
        L.launch(fast, (1,), torch.zeros(4), 17, True)
    assert _kinds(fast) == ["slow", "slow"]


def test_off_where_triton_is_not_3_6_or_interpreted():
    import triton

    assert L.enabled() == (triton.__version__.startswith("3.6.") and not L.interpreting())


def test_an_unspecialized_int_is_keyed_by_its_width_only(fast):
    rows = _Kernel(["x", "rows", "BLOCK"], {}, unspecialized=("rows",))
    for n in (17, 32, 1, 4104, 2**40, 2**40 + 16):  # Triton does not specialize it on 1 or on 16: only its width
        L.launch(rows, (1,), torch.zeros(4), n, BLOCK=64)
    assert _kinds(rows) == ["slow", "fast", "fast", "fast", "slow", "fast"]
    assert rows.calls[1][1][-2:] == (32, 64)  # the launcher gets this launch's value


def _launched_kernels():
    """Every kernel the operator launches: (module.name, its JIT function), autotuners and heuristics unwrapped."""
    import importlib

    out = []
    for module in ("dispatch", "triton.up", "triton.down", "triton.combine", "triton.dh", "triton.dw", "sm90.down",
                   "sm90.dw", "sm90.gather"):
        mod = importlib.import_module(f"moeblaze_fx.kernels.{module}")
        for name, obj in vars(mod).items():
            while hasattr(obj, "fn") and not hasattr(obj, "params"):  # triton.autotune, triton.heuristics
                obj = obj.fn
            if name.endswith("_kernel") and hasattr(obj, "params"):
                out.append((f"{module}.{name}", obj))
    return out


_UNSPECIALIZED_TABLE = """
import json
from tests.kernels.test_launch import _launched_kernels
print(json.dumps({name: [p.name for p in k.params if p.do_not_specialize] for name, k in _launched_kernels()}))
"""


def test_token_sized_parameters_are_never_specialized():
    """A kernel compiled once serves every token count: each parameter that follows it (pairs, tiles, chunks, a
    window's end) is left unspecialized in every kernel the operator launches. Read in a process without Triton's
    interpreter, whose kernels do not keep their parameters' specialization."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _UNSPECIALIZED_TABLE], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    unspecialized = json.loads(done.stdout.strip().splitlines()[-1])
    # dispatch 3, forward 4, backward 3; the sm_90 Gluon kernels where this Triton has Gluon
    assert len(unspecialized) >= 10, sorted(unspecialized)
    source = {name: k for name, k in _launched_kernels()}  # every kernel's parameter names (this process)
    for name, names in unspecialized.items():
        params = {p.name for p in source[name].params} if name in source else set(names)
        assert sorted(params & L.TOKEN_SIZED) == sorted(names), name
    assert sorted(unspecialized["dispatch._dispatch_scatter_kernel"]) == ["N", "n_tiles", "num_chunks",
                                                                          "num_tile_programs"]
    assert sorted(unspecialized["triton.up._expert_up_kernel"]) == ["num_tiles", "slot1", "tiles_total"]
    assert sorted(unspecialized["triton.combine._expert_combine_kernel"]) == ["T", "slot1"]


@pytest.mark.cuda
def test_cuda_new_token_counts_compile_nothing():
    """Once a size has run, other token counts (T and T*K with other residues mod 16, other tile counts) reuse every
    compiled kernel: the count of compiled specializations does not grow (a kernel per divisibility pattern of the
    token-sized ints did: torchtitan's expert parallelism, whose rows change every step, compiled most steps)."""
    inputs, step = _cuda_layer()

    def compiled():
        return sum(len(cache[0]) for _, k in _launched_kernels() for cache in k.device_caches.values())

    step(*inputs(1000))
    before = compiled()
    assert before > 0
    for T in (1008, 1001, 1016, 1003, 1024, 1999, 2048):
        step(*inputs(T))
    assert compiled() == before


def _cuda_layer():
    """(inputs, step) of one bf16 layer on the GPU (d, h, E, K = 256, 192, 8, 2): ``inputs(T)`` gives (x, ids, w, dy),
    ``step(x, ids, w, dy)`` the output and the gradients of x, w and both expert weights."""
    from moeblaze_fx import moe_ffn

    d, h, E, K = 256, 192, 8, 2
    g = torch.Generator().manual_seed(0)
    wgu = (torch.randn(E, 2 * h, d, generator=g) / d**0.5).cuda().bfloat16().requires_grad_()
    wd = (torch.randn(E, d, h, generator=g) / h**0.5).cuda().bfloat16().requires_grad_()

    def inputs(T):
        x = torch.randn(T, d, generator=g).cuda().bfloat16().requires_grad_()
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].cuda()
        w = torch.rand(T, K, generator=g).cuda().bfloat16().requires_grad_()
        return x, ids, w, torch.randn(T, d, generator=g).cuda().bfloat16()

    def step(x, ids, w, dy):
        y = moe_ffn(x, ids, w, (wgu, wd))
        return (y, *torch.autograd.grad(y, (x, w, wgu, wd), dy))

    return inputs, step


@pytest.mark.cuda
def test_cuda_layer_steps_through_the_launcher_equal_triton_s_path(monkeypatch):
    """The operator's launches (dispatch, up, down, combine, dh, dW) take the launcher from the second step on,
    and steps of other sizes (T not a multiple of 16, T = 1), whose specializations may differ, give bit for bit
    what Triton's own path gives."""
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the launcher's calling convention is Triton 3.6's; this is {triton.__version__}")
    inputs, step = _cuda_layer()
    first_inputs = inputs(1000)
    first = step(*first_inputs)
    before = L.stats()
    second = step(*first_inputs)
    after = L.stats()
    assert after["fast"] > before["fast"] and after["slow"] == before["slow"]  # every launch hit
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for T in (1001, 1008, 1, 1000):
        case = inputs(T)
        monkeypatch.setattr(L, "_SUPPORTED", True)
        step(*case)  # compiles what this size needs
        fast = step(*case)
        monkeypatch.setattr(L, "_SUPPORTED", False)  # Triton's own path
        count = L.stats()["fast"]
        off = step(*case)
        assert L.stats()["fast"] == count
        for a, b in zip(fast, off):
            assert torch.equal(a, b), T
    assert L.stats()["fast"] > after["fast"]


def _wrapped(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's ``wrap_handle_tensordesc``: its inner function, as :func:`L._raw_launcher` reads it (its free
    variables); the fast path never calls it."""
    def inner(*args):
        raise AssertionError(("the fast path calls the driver's launch function itself", launcher, tensordesc_indices,
                              tensordesc_meta))
    return inner


class _Desc:
    """A host tensor descriptor, keyed as Triton specializes one (:func:`L._arg_key`)."""

    def __init__(self, base):
        self.base, self.shape, self.strides = base, list(base.shape), list(base.stride())
        self.block_shape, self.layout, self.padding = [16], "nvmma", "zero"


class _Driver:
    """Triton 3.6's ``CudaLauncher``: no scratch, and ``launch`` the driver's function, wrapped where the kernel
    takes descriptors."""

    def __init__(self, calls, descs=None, scratch=0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        raw = lambda *a: calls.append(("raw", a))  # noqa: E731
        self.launch = raw if descs is None else _wrapped(raw, set(descs), [{"meta": i} for i in descs])
        self.calls = calls

    def __call__(self, *a):
        self.calls.append(("fast", a))


def test_the_driver_launches_with_each_descriptor_encoded_once(fast, monkeypatch):
    """A kernel whose launcher has no scratch is launched through the driver's own function, each descriptor replaced
    by its encoding in place; a descriptor's encoding is kept on it (the weights' descriptors live from call to
    call), a new descriptor is encoded again; with scratch to allocate, the launcher's own call is kept."""
    encoded = []
    monkeypatch.setattr(L, "_GluonDescriptor", _Desc)
    monkeypatch.setattr(L, "_make_tensordesc_arg", lambda d, meta: encoded.append((d, meta)) or ["map", *d.shape])
    kernel = _Kernel(["x", "desc", "n", "BLOCK"], {})
    driver = _Driver(kernel.calls, descs=[1])
    monkeypatch.setattr(_Compiled, "run", driver)
    x, w = torch.zeros(64), _Desc(torch.zeros(32))
    for n in (17, 18, 19):
        L.launch(kernel, (3,), x, w, n, BLOCK=64)
    assert _kinds(kernel) == ["slow", "raw", "raw"]
    # grid, stream, handle, cooperative, PDL, no scratch, packed metadata, no launch metadata or hooks, then the
    # arguments with the descriptor's encoding (its map, shape, strides) in its place
    assert kernel.calls[1][1] == (3, 1, 1, 77, "fn-handle", False, True, None, None, ("warps", 1, 0), None, None, None,
                                  x, "map", 32, 18, 64)
    assert encoded == [(w, {"meta": 1})]  # encoded once
    other = _Desc(torch.zeros(32))
    L.launch(kernel, (3,), x, other, 17, BLOCK=64)
    assert len(encoded) == 2 and encoded[1][0] is other and kernel.calls[-1][1][-4:] == ("map", 32, 17, 64)
    plain = _Kernel(["x", "n", "BLOCK"], {})
    monkeypatch.setattr(_Compiled, "run", _Driver(plain.calls, scratch=128))  # scratch: the launcher's own call
    for n in (17, 18):
        L.launch(plain, (1,), x, n, BLOCK=64)
    assert _kinds(plain) == ["slow", "fast"]
