"""The Triton dispatch (moeblaze_fx.kernels.dispatch) against dispatch_reference, bit for bit.

Without a GPU, conftest sets TRITON_INTERPRET=1 and the kernels run in Triton's interpreter on the CPU;
with a GPU the same tests run the compiled kernels, plus the ``cuda`` ones (determinism, CUDA-graph
capture, no host synchronisation, 1M tokens in O(T*K) memory).
"""
import pytest
import torch

import moeblaze_fx
from moeblaze_fx.config import KernelOptions
from moeblaze_fx.kernels import dispatch as dispatch_module
from moeblaze_fx.kernels.autotune import using
from moeblaze_fx.kernels.dispatch import MAX_EXPERTS, DispatchConfig, dispatch, dispatch_forward
from moeblaze_fx.kernels.reference import DispatchPlan, dispatch_reference, max_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64")]


def _make_ids(T, K, E, dtype, pattern="sentinel", seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int64)
    big = 2**40 if dtype == torch.int64 else 2**31 - 1
    if pattern == "sentinel":  # about 1 in 8 pairs routed nowhere: E, E + 1, far above E, negative
        sentinels = torch.tensor([E, E + 1, E + 1000, big, -1, -7], dtype=torch.int64)
        pick = torch.randint(0, len(sentinels), (T, K), generator=g)
        ids = torch.where(torch.rand(T, K, generator=g) < 0.125, sentinels[pick], ids)
    elif pattern == "one_expert":  # every pair on the last expert: one run of T*K slots
        ids.fill_(E - 1)
    elif pattern == "sparse":  # only experts 0, E//2 and E-1 used: every other expert is empty
        ids = torch.tensor([0, E // 2, E - 1])[torch.randint(0, 3, (T, K), generator=g)]
    elif pattern == "all_sentinel":  # nothing routed: offsets all 0, every slot unrouted
        ids.fill_(E)
    elif pattern == "k_equals_e":  # each token picks every expert once, in a random order
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)
    elif pattern != "random":
        raise ValueError(pattern)
    return ids.to(dtype=dtype, device=device)


def _assert_plan_equal(got: DispatchPlan, ref: DispatchPlan):
    assert isinstance(got, DispatchPlan)
    for name, a, b in zip(DispatchPlan._fields, got, ref):
        assert a.dtype == b.dtype == torch.int32, (name, a.dtype, b.dtype)
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        assert a.device == b.device, (name, a.device, b.device)
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{name} differs at {bad}: got {a[bad].tolist()}, expected {b[bad].tolist()}")


def _check(ids, E, block_m=64, config=None):
    got = dispatch(ids, E, block_m) if config is None else dispatch_forward(ids, E, block_m, config)
    _assert_plan_equal(got, dispatch_reference(ids, E, block_m))
    return got


# The full cross product, with about 1 in 8 ids a sentinel (>= E or < 0).
# T: 0 (no pairs: no launch, padded tiles), 1 (one pair), 7 (odd, far below a chunk), 1000 (several
# chunks for K = 8), 4097 (non-power-of-two, one pair past a power of two: a ragged last chunk).
# K: 1 (K == 1 is specialised by Triton), 2 (Mixtral), 8 (fine-grained MoE).
# E: 1 (single expert, dense path), 4 (dense path), 64 (sort path), 256 (sort path, DeepSeek-sized).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [1, 4, 64, 256], ids=lambda e: f"E{e}")
@pytest.mark.parametrize("K", [1, 2, 8], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("T", [0, 1, 7, 1000, 4097], ids=lambda t: f"T{t}")
def test_matches_reference(T, K, E, dtype):
    _check(_make_ids(T, K, E, dtype, "sentinel", seed=T * 131 + K * 7 + E), E)


# Routing patterns that stress one piece each (see _make_ids); sizes span one and many chunks and
# both paths (E = 4 dense, 64 and 256 sort).
@pytest.mark.parametrize("pattern", ["random", "one_expert", "sparse", "all_sentinel"])
@pytest.mark.parametrize("T,K,E", [(1000, 2, 4), (1000, 8, 64), (4097, 2, 256)], ids=lambda v: str(v))
def test_patterns(T, K, E, pattern):
    _check(_make_ids(T, K, E, torch.int64, pattern, seed=3), E)


# K == E: every token on every expert (each expert gets exactly T pairs).
@pytest.mark.parametrize("E", [4, 64], ids=lambda e: f"E{e}")
def test_k_equals_e(E):
    _check(_make_ids(300, E, E, torch.int64, "k_equals_e", seed=5), E)


# Both rank paths on the same inputs, with chunks from tiny (many chunks, many steps of the column
# scan: scan_block_c = 4) to larger than all the pairs (one partial chunk), one or several blocks
# ranked per chunk.
@pytest.mark.parametrize(
    "config",
    [
        DispatchConfig("sort", 16, 16, 4, 4),
        DispatchConfig("sort", 256, 32, 4, 4),
        DispatchConfig("sort", 4096, 512, 4),
        DispatchConfig("dense", 32, 16, 4, 4),
        DispatchConfig("dense", 8192, 128, 4),
    ],
    ids=lambda c: f"{c.path}-{c.chunk}-{c.block}",
)
@pytest.mark.parametrize("E", [4, 64], ids=lambda e: f"E{e}")
def test_configs(E, config):
    _check(_make_ids(300, 8, E, torch.int64, "sentinel", seed=11), E, config=config)


# Tile metadata for tiles of 1 row (a tile per slot), small, default-sized and larger than a run.
@pytest.mark.parametrize("block_m", [1, 16, 128, 1024])
def test_block_m(block_m):
    plan = _check(_make_ids(1000, 2, 64, torch.int64, "sparse", seed=2), 64, block_m=block_m)
    assert plan.tile_expert.numel() == max_tiles(2000, 64, block_m)


# Strided views of ids (a column slice, a transposed layout) are read in place, without a copy.
@pytest.mark.parametrize("layout", ["column_slice", "transposed"])
def test_strided_ids(layout):
    if layout == "column_slice":
        ids = _make_ids(1000, 4, 64, torch.int64, seed=4)[:, ::2]
    else:
        ids = _make_ids(2, 1000, 64, torch.int64, seed=4).t()
    assert not ids.is_contiguous()
    _check(ids, 64)


def test_option_pins_config():
    with moeblaze_fx.patch(kernels={"dispatch_config": "sort,64,32,4"}):  # config.current()'s, outside using()
        assert dispatch_module.default_config(10_000, 8) == DispatchConfig("sort", 64, 32, 4)
    with using(KernelOptions(dispatch_config="sort,64,32,4")):  # the operators' way
        assert dispatch_module.default_config(10_000, 8) == DispatchConfig("sort", 64, 32, 4)
        _check(_make_ids(500, 2, 8, torch.int32, seed=6), 8)
    assert dispatch_module.default_config(10_000, 8) != DispatchConfig("sort", 64, 32, 4)
    with pytest.raises(ValueError, match="path,chunk,block,num_warps"):
        KernelOptions(dispatch_config="fast")


@pytest.mark.skipif(DEVICE == "cuda", reason="the fallback is for CPU tensors")
def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(dispatch_module, "_INTERPRETED", False)
    monkeypatch.setattr(dispatch_module, "dispatch_forward", lambda *a, **k: pytest.fail("launched kernels"))
    ids = _make_ids(100, 2, 8, torch.int64, device="cpu")
    _assert_plan_equal(dispatch(ids, 8), dispatch_reference(ids, 8))


@pytest.mark.parametrize(
    "ids,num_experts,block_m,exc,match",
    [
        (torch.zeros(8, dtype=torch.int64), 4, 64, ValueError, r"2-D \[T, K\].*reshape"),
        (torch.zeros(2, 3, 4, dtype=torch.int64), 4, 64, ValueError, r"2-D \[T, K\]"),
        (torch.zeros(4, 2), 4, 64, TypeError, r"int32 or int64.*ids.to\(torch.int64\)"),
        (torch.zeros(4, 2, dtype=torch.int16), 4, 64, TypeError, "int32 or int64"),
        ([[0, 1]], 4, 64, TypeError, "torch.Tensor"),
        (torch.zeros(4, 2, dtype=torch.int64), 0, 64, ValueError, "num_experts must be >= 1"),
        (torch.zeros(4, 2, dtype=torch.int64), -3, 64, ValueError, "num_experts must be >= 1"),
        (torch.zeros(4, 2, dtype=torch.int64), 4.0, 64, TypeError, "num_experts must be a Python int"),
        (torch.zeros(4, 2, dtype=torch.int64), 4, 0, ValueError, "positive power of two"),
        (torch.zeros(4, 2, dtype=torch.int64), 4, -64, ValueError, "positive power of two"),
        (torch.zeros(4, 2, dtype=torch.int64), 4, 48, ValueError, "positive power of two"),
        (torch.zeros(4, 2, dtype=torch.int64), 4, 3, ValueError, "positive power of two"),
    ],
    ids=[
        "rank1", "rank3", "float", "int16", "list", "E0", "E-3", "E-float",
        "block0", "block-neg", "block48", "block3",
    ],
)  # fmt: skip
def test_bad_input(ids, num_experts, block_m, exc, match):
    if isinstance(ids, torch.Tensor):
        ids = ids.to(DEVICE)
    with pytest.raises(exc, match=match):
        dispatch(ids, num_experts, block_m)


def test_too_many_experts():
    with pytest.raises(ValueError, match="dispatch_reference"):
        dispatch_forward(_make_ids(4, 2, 8, torch.int64), MAX_EXPERTS + 1)


def test_bad_config():
    ids = _make_ids(4, 2, 8, torch.int64)
    with pytest.raises(ValueError, match="'sort' or 'dense'"):
        dispatch_forward(ids, 8, 64, DispatchConfig("radix", 1024, 512, 4))
    with pytest.raises(ValueError, match="power of two"):
        dispatch_forward(ids, 8, 64, DispatchConfig("sort", 1000, 512, 4))
    with pytest.raises(ValueError, match=r"block must be in \[16, chunk\]"):
        dispatch_forward(ids, 8, 64, DispatchConfig("sort", 512, 1024, 4))


# ------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------
# Sizes where the default config picks larger chunks and more programs than on the CPU.
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E", [(65536, 2, 8), (65536, 8, 64), (131072, 8, 256), (262144, 2, 16)], ids=str)
def test_cuda_large_matches_reference(T, K, E, dtype):
    _check(_make_ids(T, K, E, dtype, "sentinel", seed=T + E), E)


@pytest.mark.cuda
@pytest.mark.parametrize("E", [8, 256], ids=lambda e: f"E{e}")
def test_cuda_bitwise_deterministic(E):
    ids = _make_ids(262144, 8, E, torch.int64, "random", seed=1)
    first = dispatch(ids, E)
    for _ in range(5):
        for a, b in zip(first, dispatch(ids, E)):
            assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_no_host_sync():
    ids = _make_ids(65536, 8, 64, torch.int64, seed=2)
    dispatch(ids, 64)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dispatch(ids, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("E", [8, 256], ids=lambda e: f"E{e}")
def test_cuda_graph_capture(E):
    T, K = 65536, 8
    static_ids = _make_ids(T, K, E, torch.int64, seed=7)
    dispatch(static_ids, E)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_plan = dispatch(static_ids, E)
    for seed in (8, 9):
        new_ids = _make_ids(T, K, E, torch.int64, seed=seed)
        static_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _assert_plan_equal(static_plan, dispatch_reference(new_ids, E))


@pytest.mark.cuda
def test_cuda_1m_tokens_memory_is_o_tk():
    T, K, E, block_m = 1 << 20, 8, 256, 64
    ids = _make_ids(T, K, E, torch.int64, seed=12)
    dispatch(ids, E, block_m)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    plan = dispatch(ids, E, block_m)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    N = T * K
    outputs = 4 * (2 * N + (E + 1) + 2 * max_tiles(N, E, block_m))
    scratch_bound = 4 * (N // 512 + 1) * E  # chunks of >= 512 pairs
    assert peak <= outputs + scratch_bound + (2 << 20), (peak, outputs, scratch_bound)
    assert peak < T * E  # below even a one-byte-per-entry T x E map (an int32 one is 1 GiB)
    _assert_plan_equal(plan, dispatch_reference(ids, E, block_m))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the check is a device assert: "
                                             "test_cuda_check_ids_is_a_device_assert")
@pytest.mark.parametrize("interpreted", [False, True], ids=["reference", "kernels"])
def test_check_ids_rejects_a_negative_id_on_the_cpu(monkeypatch, interpreted):
    """``check_ids``: a negative id is an error (ids >= E are unrouted and pass); without it, it is unrouted."""
    monkeypatch.setattr(dispatch_module, "_INTERPRETED", interpreted)
    ids = _make_ids(50, 2, 8, torch.int64, pattern="random", device="cpu")
    ids[3, 1] = 8 + 5  # unrouted, not an error
    _assert_plan_equal(dispatch(ids, 8, check_ids=True), dispatch_reference(ids, 8))
    ids[7, 0] = -1
    with pytest.raises(ValueError, match="ids contain negative expert ids"):
        dispatch(ids, 8, check_ids=True)
    _assert_plan_equal(dispatch(ids, 8), dispatch_reference(ids, 8))


_NEGATIVE_ID_CHILD = """
import torch
from moeblaze_fx.kernels.dispatch import dispatch
ids = torch.randint(0, 8, (4096, 2), device="cuda")
dispatch(ids, 8, check_ids=True)
torch.cuda.synchronize()
print("valid ids passed", flush=True)
ids[1000, 1] = -3
dispatch(ids, 8, check_ids=True)
torch.cuda.synchronize()
print("negative id passed", flush=True)
"""


@pytest.mark.cuda
def test_cuda_check_ids_is_a_device_assert():
    """On CUDA the check is a device assert inside the histogram launch: valid ids pass; a negative one stops the
    process's CUDA work with the message (so the check runs in a child process). It costs no launch of its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NEGATIVE_ID_CHILD], capture_output=True, text=True, timeout=300)
    assert "valid ids passed" in done.stdout, done.stderr[-2000:]
    assert "negative id passed" not in done.stdout
    assert done.returncode != 0
    assert "ids contain negative expert ids" in done.stdout + done.stderr, done.stderr[-2000:]


@pytest.mark.cuda
def test_cuda_check_ids_adds_no_launch():
    from torch.profiler import ProfilerActivity, profile

    ids = _make_ids(4096, 8, 64, torch.int64, pattern="random")
    counts = []
    for check in (False, True):
        dispatch(ids, 64, check_ids=check)  # compiled outside the count
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plan = dispatch(ids, 64, check_ids=check)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
        _assert_plan_equal(plan, dispatch_reference(ids, 64))
    assert counts[0] == counts[1] == 3, counts
