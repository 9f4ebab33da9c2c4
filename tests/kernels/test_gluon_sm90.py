"""The Gluon kernels for sm_90: down (moeblaze_fx/kernels/sm90/down.py), dW (sm90/dw.py) and the gathering GEMMs,
up and dh's (sm90/gather.py).

CPU: when they may take a launch (``weights``, ``usable``) and the row-block view of a table's storage the kernels
read weights through. GPU (``cuda`` marker; an sm_90 device, else skipped with the reason): the whole forward and
backward with the kernels on and off (the kernel option ``gluon``) are bitwise equal, against the float32 reference
within 1e-2, and each kernel is launched exactly as often as expected.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import moeblaze_fx
from moeblaze_fx import config
from moeblaze_fx.config import KernelOptions
from moeblaze_fx.kernels import autotune
from moeblaze_fx.kernels.plan import down_unit
from moeblaze_fx.kernels.sm90 import common as sm90_common
from moeblaze_fx.kernels.sm90 import down as sm90_down
from moeblaze_fx.kernels.sm90 import dw as sm90_dw
from moeblaze_fx.kernels.sm90 import gather as sm90_gather
from moeblaze_fx.kernels.triton import common as tcommon
from moeblaze_fx.kernels.triton import dw as tdw
from moeblaze_fx.kernels.tables import WeightTable, table_of, table_of_list

from test_expert import check_against_reference, grad_storage_like, make_case, run_kernels


def test_rows_view_addresses_every_expert():
    w = torch.randn(5, 2 * 24, 40)  # Hugging Face's fused [E, 2h, d]: gate rows, then up rows
    for half in (w[:, :24], w[:, 24:]):
        flat, e_rows = sm90_common.rows_view(half)
        assert e_rows == 48 and flat.shape == (4 * 48 + 24, 40)
        for e in range(5):
            assert torch.equal(flat[e * e_rows: e * e_rows + 24], half[e])
    dense = torch.randn(3, 7, 16)
    flat, e_rows = sm90_common.rows_view(dense)
    assert e_rows == 7 and torch.equal(flat, dense.reshape(21, 16))


def test_rows_view_refuses_what_is_not_row_blocks():
    w = torch.randn(4, 8, 16)
    assert sm90_common.rows_view(w.transpose(1, 2)) is None  # no unit column stride
    assert sm90_common.rows_view(w[:, :, :15].as_strided((4, 8, 15), (15, 16, 1))) is None  # expert stride 15
    assert sm90_common.rows_view(w.as_strided((4, 8, 16), (64, 16, 1))) is None  # experts overlap (4 rows apart)
    assert sm90_common.rows_view(w[:0]) is None


def test_never_taken_on_the_cpu():
    w = torch.randn(4, 64, 256, dtype=torch.bfloat16)
    assert sm90_down.weights(w, None, True, 256) is None
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    op = down_unit(table_of(w), None, True, 64, x)
    assert op.sm90 is None


def test_usable_needs_plan_tiles_and_aligned_rows():
    a = torch.empty(300, 256, dtype=torch.bfloat16)
    out = torch.empty(300, 512, dtype=torch.bfloat16)
    assert sm90_down.usable(a, out, 128)
    assert not sm90_down.usable(a, out, 16)  # plan tiles of another height
    assert not sm90_down.usable(a, out.float(), 128)  # out of another dtype
    assert not sm90_down.usable(a[:, 1:], out, 128)  # misaligned base
    assert not sm90_down.usable(torch.empty(300, 260, dtype=torch.bfloat16)[:, :256], out, 128)  # row stride 520 B
    assert not sm90_down.usable(a, torch.empty(512, 300, dtype=torch.bfloat16).t(), 128)  # column stride 300


def test_gluon_option_is_read_at_every_call():
    # the kernel option in force: the innermost autotune.using block's (the operators'), else config.current()'s
    assert sm90_common.enabled()
    with moeblaze_fx.patch(kernels={"gluon": False}):
        assert not sm90_common.enabled()
        with autotune.using(KernelOptions(gluon=True)):
            assert sm90_common.enabled()
    with autotune.using(KernelOptions(gluon=False)):
        assert not sm90_common.enabled()
    assert sm90_common.enabled()


def test_gluon_kernels_take_launches_only_on_the_triton_they_support(monkeypatch):
    # Gluon's API moves between Triton releases: the kernels launch only where SUPPORTED (Triton 3.6), with the kernel
    # option on, on an sm_90 CUDA device. A stand-in for a CUDA tensor on an sm_90 device.
    import types

    t = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(sm90_common, "is_sm90", lambda device: True)
    monkeypatch.setattr(sm90_common, "SUPPORTED", True)
    assert sm90_common.takes(t)
    with moeblaze_fx.patch(kernels={"gluon": False}):
        assert not sm90_common.takes(t)
    assert not sm90_common.takes(types.SimpleNamespace(is_cuda=False, device=torch.device("cpu")))
    monkeypatch.setattr(sm90_common, "SUPPORTED", False)  # e.g. Triton 3.9, whose Gluon fails on these kernels
    assert not sm90_common.takes(t)


def test_dw_never_taken_on_the_cpu():
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    slots = torch.randn(16, 256, dtype=torch.bfloat16)
    out = table_of(torch.empty(4, 128, 256, dtype=torch.bfloat16))
    assert not sm90_dw.usable(x, slots, out, 16)


def test_dw_leaves_tables_past_32_bit_offsets_to_triton():
    # The Gluon dW kernel addresses an element of an expert's matrix with a 32-bit offset (row x row stride + column x
    # column stride). A Megatron-style weight1 [d, E * 2h], viewed [E, 2h, d], gives dW_gate|up's transposed table a
    # stride of E * 2h: with E = 128, h = 8192, d = 2048 the last row's offset passes 2**31, with E = 8 it does not.
    def table(rows, cols, stride_r, stride_c):
        return WeightTable(torch.zeros(2, dtype=torch.int64), rows, cols, stride_r, stride_c, torch.bfloat16, 16)

    h, d = 8192, 2048
    for E, fits in ((128, False), (8, True)):
        assert sm90_dw.table_ok(table(d, 2 * h, E * 2 * h, 1)) == fits  # rows along d, 2h contiguous
        assert sm90_dw.table_ok(table(2 * h, d, 1, E * 2 * h)) == fits  # the same matrix read transposed
    assert sm90_dw.table_ok(table(d, 2 * h, 2 * h, 1))
    assert sm90_dw.table_ok(table(d - 64, 2 * h - 128, 2 * h, 1))  # ragged tiles: rows and columns off the tile's
    assert not sm90_dw.table_ok(table(d, 200, 2 * h, 1))  # columns not a multiple of 16
    assert not sm90_dw.table_ok(table(200, 2 * h, 2 * h, 1))  # rows not a multiple of 16
    assert not sm90_dw.table_ok(table(d, 2 * h, 2 * h + 4, 1))  # a row stride that is not a multiple of 16 bytes


def test_dw_store_descriptor_covers_each_experts_matrix():
    # The descriptor dW's tiles are stored through: expert e's output at rows e * e_rows of a 2-D view, rows along m
    # where n is contiguous (dW_down), along n where m is (dW_gate, dW_up read transposed from Hugging Face's
    # [E, 2h, d]); none for a table of separate tensors (ModuleList experts).
    E, h, d = 3, 256, 128
    gate_up = torch.randn(E, 2 * h, d, dtype=torch.bfloat16)
    down = torch.randn(E, d, h, dtype=torch.bfloat16)
    gate_t = tdw.transposed(table_of(gate_up[:, :h]))  # [d, h] per expert, m contiguous: O_COL
    up_t = tdw.transposed(table_of(gate_up[:, h:]))
    for table, rows, e_rows, block, matrix in [
            (gate_t, (E - 1) * 2 * h + h, 2 * h, [256, 128], lambda e: gate_up[e, :h]),
            (up_t, (E - 1) * 2 * h + h, 2 * h, [256, 128], lambda e: gate_up[e, h:]),
            (table_of(down), E * d, d, [128, 256], lambda e: down[e])]:
        desc, got_rows = sm90_dw._store_desc(table)
        assert got_rows == e_rows and list(desc.block_shape) == block
        assert tuple(desc.shape) == (rows, matrix(0).shape[1])
        flat = desc.base.as_strided(desc.shape, desc.strides)
        for e in range(E):
            assert torch.equal(flat[e * e_rows: e * e_rows + matrix(e).shape[0]], matrix(e))
    assert sm90_dw._store_desc(table_of_list(list(down))) is None


def test_gather_never_taken_on_the_cpu():
    w = torch.randn(4, 256, 128, dtype=torch.bfloat16)
    assert sm90_gather.up_weights(w, w, True, 128) is None
    assert sm90_gather.dh_weights(w, False, 256) is None


def test_gather_usable_needs_a_swiglu_unbiased_and_aligned_rows():
    x = torch.empty(300, 256, dtype=torch.bfloat16)
    hid = torch.empty(400, 192, dtype=torch.bfloat16)
    pre = torch.empty(400, 384, dtype=torch.bfloat16)
    assert sm90_gather.up_usable(x, hid, pre, "swiglu", False, 128)
    assert sm90_gather.up_usable(x, hid, None, "swiglu", False, 128)  # "recompute": A|B not kept
    assert sm90_gather.up_usable(x, hid, pre, "swiglu_clamp", False, 128)  # SwiGLU's clamped forms
    assert sm90_gather.up_usable(x, hid, pre, "swiglu_oai", False, 128)
    assert sm90_gather.up_usable(x, hid, pre, "geglu_tanh", False, 128)  # Gemma 4's
    assert sm90_gather.up_usable(x, hid, pre, "swiglu_softcap", False, 128)  # Inkling 2's
    assert sm90_gather.up_usable(x, hid, pre, "geglu", False, 128)
    assert not sm90_gather.up_usable(x, hid, pre, "silu", False, 128)  # plain: no up projection
    assert not sm90_gather.up_usable(x, hid, pre, "relu2", False, 128)
    assert not sm90_gather.up_usable(x, hid, pre, "swiglu", True, 128)  # biases take the Triton kernel
    assert not sm90_gather.up_usable(x, hid, pre, "swiglu", False, 64)  # plan tiles of another height
    assert not sm90_gather.up_usable(x[:, 1:], hid, pre, "swiglu", False, 128)  # misaligned x rows
    assert not sm90_gather.up_usable(x, hid, pre[1:, 1:], "swiglu", False, 128)  # misaligned A|B
    assert not sm90_gather.up_usable(x.half(), hid, pre, "swiglu", False, 128)  # mixed dtypes
    assert not sm90_gather.up_usable(x.float(), hid.float(), pre.float(), "swiglu", False, 128)  # 32-bit
    assert sm90_gather.dh_usable(x, hid, 128)
    assert not sm90_gather.dh_usable(x, hid.t(), 128)  # no unit column stride


def test_fused_dh_usable_needs_a_swiglu_chunks_of_64_and_aligned_rows():
    dy = torch.empty(300, 256, dtype=torch.bfloat16)
    hw = torch.empty(400, 192, dtype=torch.bfloat16)
    pre = torch.empty(400, 384, dtype=torch.bfloat16)
    dpre = torch.empty(400, 384, dtype=torch.bfloat16)
    wts = torch.empty(200, 2)
    usable = sm90_gather.dh_act_usable
    assert usable(dy, hw, pre, dpre, wts, "swiglu", 64, 128)
    assert usable(dy, hw, pre, dpre, wts.bfloat16(), "swiglu", 64, 128)  # routing weights of any float dtype
    assert usable(dy, hw, pre, dpre, wts, "swiglu_clamp", 64, 128)
    assert usable(dy, hw, pre, dpre, wts, "swiglu_oai", 64, 128)
    assert usable(dy, hw, pre, dpre, wts, "geglu_tanh", 64, 128)
    assert usable(dy, hw, pre, dpre, wts, "geglu", 64, 128)
    assert not usable(dy, hw, pre, dpre, wts, "silu", 64, 128)
    assert not usable(dy, hw, pre, dpre, wts, "swiglu", 32, 128)  # partials in other chunks
    assert not usable(dy, hw, pre, dpre, wts, "swiglu", 64, 64)  # plan tiles of another height
    assert not usable(dy, hw, pre[1:, 1:], dpre, wts, "swiglu", 64, 128)  # misaligned A|B
    assert not usable(dy, hw, pre, dpre.half(), wts, "swiglu", 64, 128)  # dA|dB of another dtype
    assert not usable(dy, hw, pre, dpre.t(), wts, "swiglu", 64, 128)  # no unit column stride
    assert not usable(dy, hw, pre, dpre, wts.long(), "swiglu", 64, 128)
    h200 = torch.empty(400, 200, dtype=torch.bfloat16)
    pre200 = torch.empty(400, 400, dtype=torch.bfloat16)
    assert not usable(dy, h200, pre200, pre200.clone(), wts, "swiglu", 64, 128)  # h % 16 != 0: two launches


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def _need_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        pytest.skip(f"the Gluon kernels run on sm_90 only; this device is sm_{major}{minor}")
    if not sm90_common.GLUON:
        pytest.skip("this Triton build has no Gluon")
    if not sm90_common.SUPPORTED:
        import triton
        pytest.skip(f"the Gluon kernels launch only with Triton 3.6 (sm90.common.SUPPORTED), not {triton.__version__}")


# (T, d, h, E, K, ids_mode, layout, bias, dtype, window_slots, down launches, (dW launches, of which TMA stores) per
# forward + backward, gathering launches (up, dh)): down counts Y and dX per window; dX takes the Triton kernel when
# h % 64 != 0 (its weights have n contiguous) and the list layout (no [E, r, c] tensor) never takes it. dW counts
# dW_down, dW_gate and dW_up per window (dW_gate and dW_up as one launch for hf_fused, whose up rows follow gate's),
# on the Gluon kernel wherever d and h are multiples of 16 (not h = 200); its tiles leave through TMA stores where
# the output is one [E, r, c] tensor and the matrices' rows (d, or h for a transposed table: dW_gate, dW_up of
# dense, dW_down of transposed) are a whole number of tiles (128; 256), else through pointer stores. The gathering
# kernel counts the up projection per window (not with biases) and dh's GEMM per window; "recompute" launches the up
# kernel again in the backward, then the fused dh, where both may take the window (h % 16 == 0), and otherwise runs
# the up GEMM inside the Triton dh kernel; h = 200 and 192 leave ragged column tiles.
GPU_CASES = [
    (1000, 320, 200, 8, 4, "empty_expert", "dense", False, torch.bfloat16, 0, 1, (0, 0), (1, 1)),
    (513, 256, 512, 6, 2, "sentinel", "hf_fused", True, torch.bfloat16, 0, 2, (2, 2), (0, 1)),
    (700, 512, 256, 4, 2, "one_expert", "hf_fused", False, torch.float16, 0, 2, (2, 2), (1, 1)),
    (900, 256, 256, 8, 2, "random", "hf_fused", False, torch.bfloat16, 500, 8, (8, 8), (4, 4)),
    (600, 192, 256, 8, 2, "random", "list", True, torch.bfloat16, 0, 0, (3, 0), (0, 0)),
    (1, 256, 256, 3, 2, "random", "dense", False, torch.bfloat16, 0, 2, (3, 3), (1, 1)),
    (500, 256, 256, 6, 3, "random", "hf_fused", False, torch.bfloat16, 0, 2, (2, 2), (1, 1)),  # K = 3: not a power of 2
    (400, 256, 192, 4, 2, "random", "dense", False, torch.bfloat16, 0, 2, (3, 1), (1, 1)),
    # W_gate, W_up with n contiguous (the up kernel's halves side by side along a buffer's columns), W_down with k
    # contiguous; dX's two tables with k contiguous take the Triton kernel
    (640, 256, 384, 4, 2, "random", "transposed", False, torch.bfloat16, 0, 1, (3, 2), (1, 1)),
]


def _switch(monkeypatch, on: bool) -> None:
    """The Gluon kernels on or off (the kernel option ``gluon`` of config.current(), which the kernels called
    directly read) until the test ends."""
    monkeypatch.setattr(config, "_current", dataclasses.replace(config.current(), kernels=KernelOptions(gluon=on)))


def _run_with(monkeypatch, on: bool, case, window_slots: int, policy: str = "activations"):
    """Forward and backward with the Gluon kernels on or off, the allocator's free memory poisoned first: (y, grads)
    as :func:`run_kernels`. Off, "recompute" runs as "activations": recomputed on the Gluon kernels, A|B are the
    forward's, which the Triton dh kernel that recomputes them in its own pass rounds otherwise."""
    _switch(monkeypatch, on)
    _poison()
    return run_kernels(case, policy if on else "activations", window_slots=window_slots)


def _poison() -> None:
    """Fill the caching allocator's free memory with NaN, so that a kernel reading rows nothing wrote (the unrouted
    slots past the last expert's) shows in the results."""
    torch.full((64 * 2 ** 20,), float("nan"), device="cuda")


def _several_tiles_a_program(slots: int, window_slots: int, h: int, block_n: int) -> None:
    """Check that a case gives the gathering kernels' programs (one per SM) at least two tiles each in its first
    window, counting only the tiles it has for sure: the window's slots // 128 row tiles x h's column tiles."""
    window = min(slots, window_slots) if window_slots else slots
    tiles = (window // sm90_gather.BLOCK_M) * -(-h // block_n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tiles >= 2 * sms, f"{tiles} tiles for {sms} programs: not the case the test means"


def _ragged_case(T, d, h, E, K, ids_mode, layout, dtype, window_slots, block_n, seed):
    """A SwiGLU case on the GPU for comparing two variants of a deferred epilogue, checked to give every program at
    least two tiles (:func:`_several_tiles_a_program`, tiles ``block_n`` wide), and its number of slot windows."""
    _need_sm90()
    _several_tiles_a_program(T * K, window_slots, h, block_n)
    case = make_case(T, d, h, E, K, act="swiglu", layout=layout, device="cuda", dtype=dtype, ids_mode=ids_mode,
                     seed=seed)
    return case, tcommon.num_slot_windows(T * K, window_slots)


def _assert_same_results(first, second, what: str, weights_close: bool = False) -> None:
    """Two (y, grads) of :func:`run_kernels` are bitwise equal: y, dx, the weight gradients and the routing-weight
    gradient, the last within 1e-2 instead where ``weights_close`` (sums of 64-column partials in another order)."""
    (y1, o1), (y2, o2) = first, second
    assert torch.equal(y1, y2), f"forward differs from {what}"
    assert torch.equal(o1["x"], o2["x"]), f"dx differs from {what}"
    if weights_close:
        torch.testing.assert_close(o1["weights"], o2["weights"], rtol=1e-2, atol=1e-5)
    else:
        assert torch.equal(o1["weights"], o2["weights"]), f"routing-weight gradients differ from {what}"
    assert all(torch.equal(a, b) for a, b in zip(o1["storage"], o2["storage"])), f"weight gradients differ from {what}"


def _launches() -> tuple[int, int, int]:
    return sm90_down.launches(), sm90_dw.launches(), sm90_gather.launches()


@pytest.mark.cuda
def test_no_gluon_launch_on_an_unsupported_triton_cuda(monkeypatch):
    # where the Triton release is not the kernels' (sm90.common.SUPPORTED false), the Triton kernels take every launch
    _need_sm90()
    case = make_case(900, 256, 256, 8, 2, act="swiglu", layout="hf_fused", device="cuda", dtype=torch.bfloat16,
                     ids_mode="random", seed=3)
    monkeypatch.setattr(sm90_common, "SUPPORTED", False)
    before = _launches()
    check_against_reference(case, "activations", tol=1e-2, ref_dtype=torch.float32)
    assert _launches() == before


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ("activations", "recompute"))
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,layout,bias,dtype,window_slots,down,dw,gather", GPU_CASES,
                         ids=[f"{c[6]}-T{c[0]}-h{c[2]}-w{c[9]}" for c in GPU_CASES])
def test_gluon_kernels_match_triton_bitwise_cuda(monkeypatch, T, d, h, E, K, ids_mode, layout, bias, dtype,
                                                 window_slots, down, dw, gather, policy):
    _need_sm90()
    case = make_case(T, d, h, E, K, act="swiglu", bias=bias, layout=layout, device="cuda", dtype=dtype,
                     ids_mode=ids_mode, seed=T + 5)
    _switch(monkeypatch, True)
    _poison()
    before, stores, acts = _launches(), sm90_dw.store_launches(), sm90_gather.act_launches()
    y1, o1 = check_against_reference(case, policy, tol=1e-2, ref_dtype=torch.float32, window_slots=window_slots)
    # "recompute" on the Gluon kernels: the up kernel into dA|dB's buffer, then the fused dh over it in place
    recomputed = policy == "recompute" and gather[0] > 0 and gather[1] > 0 and h % 16 == 0
    gathers = gather[0] + (gather[1] if policy == "activations" else 0) + (gather[0] + gather[1] if recomputed else 0)
    assert tuple(a - b for a, b in zip(_launches(), before)) == (down, dw[0], gathers)
    assert sm90_dw.store_launches() - stores == dw[1]
    # dh's GEMM and its epilogue in one launch wherever the GEMM took the Gluon kernel (SwiGLU, A|B kept, h % 16 == 0)
    fused = (policy == "activations" and h % 16 == 0) or recomputed
    assert sm90_gather.act_launches() - acts == (gather[1] if fused else 0)
    _switch(monkeypatch, False)
    before = _launches()
    # recomputed on the Gluon kernels, A|B are the forward's: the Triton kernels' results under "activations" (the
    # Triton dh kernel that recomputes A|B in its own pass rounds some dA|dB otherwise)
    y2, o2 = run_kernels(case, "activations" if recomputed else policy, window_slots=window_slots)
    assert _launches() == before
    # the fused dh sums <dH', H> over 64 columns in its own order, which the Triton epilogue lays out otherwise where
    # h % 64 != 0: a last-bit difference in a few routing-weight gradients
    _assert_same_results((y1, o1), (y2, o2), "the Triton kernels'", weights_close=fused and h % 64 != 0)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ("activations", "recompute"))
@pytest.mark.parametrize("act", ["swiglu_clamp(limit=0.6)", "swiglu_oai(alpha=1.702,limit=0.6)", "geglu_tanh", "geglu",
                                 "swiglu_softcap(gate=0.5,up=0.8)"], ids=lambda a: a.split("(")[0])
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,layout,dtype,window_slots", [
    (900, 256, 256, 8, 2, "random", "hf_fused", torch.bfloat16, 500),  # windows
    (700, 512, 192, 4, 2, "one_expert", "dense", torch.float16, 0),  # columns past h, h % 64 != 0
], ids=["windows", "h192"])
def test_gluon_other_activations_match_triton_bitwise_cuda(monkeypatch, T, d, h, E, K, ids_mode, layout, dtype,
                                                           window_slots, act, policy):
    # The up kernel and the fused dh with the clamped SwiGLUs (DeepSeek-V4's, gpt-oss's), limit 0.6: both clamps
    # act on many of the unit-variance pre-activations; with both GeGLUs and Inkling 2's soft-caps (caps 0.5 and
    # 0.8, where they bend). The Triton kernels give the same results bitwise (under "activations": "recompute"
    # on the Gluon kernels works on the forward's A|B).
    _need_sm90()
    case = make_case(T, d, h, E, K, act=act, layout=layout, device="cuda", dtype=dtype, ids_mode=ids_mode,
                     seed=T + 17)
    windows = tcommon.num_slot_windows(T * K, window_slots)
    _switch(monkeypatch, True)
    _poison()
    launches, acts = sm90_gather.launches(), sm90_gather.act_launches()
    first = run_kernels(case, policy, window_slots=window_slots)
    # up and the fused dh; "recompute" launches up again in the backward, into the buffer the fused dh works in place
    assert sm90_gather.launches() - launches == (2 if policy == "activations" else 3) * windows
    assert sm90_gather.act_launches() - acts == windows
    _switch(monkeypatch, False)
    launches = sm90_gather.launches()
    second = run_kernels(case, "activations", window_slots=window_slots)  # "recompute" on Gluon: the same A|B
    assert sm90_gather.launches() == launches
    _assert_same_results(first, second, "the Triton kernels'", weights_close=h % 64 != 0)


@pytest.mark.cuda
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,layout,dtype,act,window_slots", [
    (900, 256, 256, 8, 2, "random", "hf_fused", torch.bfloat16, "swiglu", 500),  # windows, tiles cut by them
    (700, 512, 208, 4, 2, "one_expert", "dense", torch.float16, "swiglu", 0),  # columns past h, h % 64 != 0
    (640, 256, 384, 6, 3, "sentinel", "transposed", torch.bfloat16, "swiglu_clamp(limit=10.0)", 0),  # unrouted pairs
], ids=["windows", "h208", "clamp-sentinel"])
def test_recompute_on_gluon_gives_the_activations_results_cuda(monkeypatch, T, d, h, E, K, ids_mode, layout, dtype,
                                                               act, window_slots):
    # "recompute" runs the forward's up kernel again in the backward (A|B into dA|dB's buffer) and the fused dh in
    # place over it: the same kernels on the same A|B as "activations", so y, dx, the routing-weight gradient and
    # every weight gradient are bit for bit those of "activations"; against the float32 reference within 1e-2
    # (limit 10, DeepSeek-V4's: with the clamp in the bulk of the pre-activations, bf16 rounds some onto the limit
    # that float32 keeps below it, several % off under both policies: test_expert's test_clamped_swiglu_bf16_cuda).
    _need_sm90()
    case = make_case(T, d, h, E, K, act=act, layout=layout, device="cuda", dtype=dtype, ids_mode=ids_mode,
                     seed=T + 23)
    windows = tcommon.num_slot_windows(T * K, window_slots)
    _switch(monkeypatch, True)
    out = []
    for policy in ("recompute", "activations"):
        _poison()
        launches, acts = sm90_gather.launches(), sm90_gather.act_launches()
        out.append(check_against_reference(case, policy, tol=1e-2, ref_dtype=torch.float32,
                                           window_slots=window_slots))
        assert sm90_gather.launches() - launches == (3 if policy == "recompute" else 2) * windows
        assert sm90_gather.act_launches() - acts == windows
    _assert_same_results(*out, '"activations"')


@pytest.mark.cuda
@pytest.mark.parametrize("window_slots", [0, 700])
def test_gluon_dw_accumulates_like_triton_cuda(monkeypatch, window_slots):
    # accumulate=True (gradient accumulation): every expert with slots adds onto the stored bf16 gradient
    _need_sm90()
    case = make_case(1000, 256, 256, 8, 4, act="swiglu", layout="hf_fused", device="cuda", dtype=torch.bfloat16,
                     ids_mode="empty_expert", seed=41)
    start = grad_storage_like(case, fill=0.0)
    for s in start:
        s.normal_()
    out = []
    for on in (True, False):
        _switch(monkeypatch, on)
        grads = [s.clone() for s in start]
        before = sm90_dw.launches()
        run_kernels(case, "activations", grads=grads, accumulate=True, window_slots=window_slots)
        assert sm90_dw.launches() - before == (2 * tcommon.num_slot_windows(4000, window_slots) if on else 0)
        out.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*out))
    assert not all(torch.equal(a, b) for a, b in zip(out[0], start)), "nothing was accumulated"


@pytest.mark.cuda
@pytest.mark.parametrize("window_slots", [0, 500])
@pytest.mark.parametrize("layout", ["hf_fused", "transposed", "list"])
def test_gluon_dw_tma_and_pointer_stores_agree_cuda(monkeypatch, layout, window_slots):
    # dW's tiles leave through TMA stores where the output is one [E, r, c] tensor (rows along m, or along n for
    # the transposed dW_gate / dW_up of hf_fused), through pointer stores for ModuleList experts (a table of
    # addresses); either gives the Triton kernel's results bitwise. Windows: later windows add onto experts started
    # earlier.
    _need_sm90()
    case = make_case(900, 256, 256, 8, 2, act="swiglu", layout=layout, device="cuda", dtype=torch.bfloat16,
                     ids_mode="empty_expert", seed=17)
    windows = tcommon.num_slot_windows(1800, window_slots)
    out = []
    for on in (True, False):
        launches, stores = sm90_dw.launches(), sm90_dw.store_launches()
        y, o = _run_with(monkeypatch, on, case, window_slots)
        per_window = (2 if layout == "hf_fused" else 3) if on else 0  # dW_gate and dW_up as one launch for hf_fused
        assert sm90_dw.launches() - launches == per_window * windows
        assert sm90_dw.store_launches() - stores == (per_window * windows if layout != "list" else 0)
        assert all(torch.isfinite(g).all() for g in o["storage"]), "an unwritten weight gradient element"
        out.append(o["storage"])
    assert all(torch.equal(a, b) for a, b in zip(*out)), "the Gluon dW's stores differ from the Triton kernel's"


@pytest.mark.cuda
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,layout,dtype,window_slots", [
    (12000, 320, 208, 8, 4, "empty_expert", "dense", torch.bfloat16, 0),  # columns past h in the last column tile
    (8000, 256, 768, 8, 2, "random", "hf_fused", torch.bfloat16, 12000),  # tiles cut by windows
    (9000, 512, 512, 4, 2, "one_expert", "hf_fused", torch.float16, 0),
    (8000, 256, 320, 6, 3, "sentinel", "transposed", torch.bfloat16, 0),  # K = 3, unrouted pairs, W_down k-major
], ids=["h208", "windows", "fp16", "K3-sentinel"])
def test_fused_dh_matches_the_split_launches_cuda(monkeypatch, T, d, h, E, K, ids_mode, layout, dtype, window_slots):
    # The fused dh gives the dA|dB and w*H of the Triton kernels' two launches (the GEMM, then the epilogue) bit for
    # bit, so the same dx and weight gradients. The routing-weight gradient sums the same 64-column partials, each
    # in an order that may differ where h % 64 != 0. Tiles cut by windows, several tiles a program (each tile's
    # epilogue runs in the next one's K loop) and the last tile's (after the loop) are all here. (dh as the Gluon
    # GEMM then the Triton epilogue, where the fused kernel does not apply: GPU_CASES' h = 200.)
    case, windows = _ragged_case(T, d, h, E, K, ids_mode, layout, dtype, window_slots, sm90_gather.DH_BLOCK_N, T + 11)
    out = []
    for on in (True, False):
        launches, acts = sm90_gather.launches(), sm90_gather.act_launches()
        y, o = _run_with(monkeypatch, on, case, window_slots)
        assert sm90_gather.launches() - launches == (2 * windows if on else 0)  # up and the fused dh per window
        assert sm90_gather.act_launches() - acts == (windows if on else 0)
        out.append((y, o))
    _assert_same_results(*out, "the Triton kernels' split dh", weights_close=h % 64 != 0)
    assert torch.isfinite(out[0][1]["weights"]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("T,d,h,E,K,ids_mode,layout,dtype,window_slots,policy", [
    (12000, 320, 200, 8, 4, "empty_expert", "dense", torch.bfloat16, 0, "activations"),  # columns past h
    (8000, 256, 512, 8, 2, "random", "hf_fused", torch.bfloat16, 12000, "activations"),  # tiles cut by windows
    (9000, 512, 256, 4, 2, "one_expert", "hf_fused", torch.float16, 0, "activations"),
    (8000, 256, 384, 3, 2, "sentinel", "transposed", torch.bfloat16, 0, "recompute"),  # no A|B kept
], ids=["h200", "windows", "fp16", "recompute"])
def test_up_h_in_next_loop_matches_triton_cuda(monkeypatch, T, d, h, E, K, ids_mode, layout, dtype,
                                                   window_slots, policy):
    # The up kernel computes a tile's H during the next tile's K loop, block by block, and stores it through pointers
    # (the last tile's after the loop): the Triton up kernel's H bitwise (the same elementwise function of the same
    # rounded A|B), so equal outputs and gradients. The cases have several tiles a program (each tile's H then runs
    # in the next one's K loop, the last tile's after the loop) and ragged tiles (experts' last rows, windows,
    # columns past h).
    case, windows = _ragged_case(T, d, h, E, K, ids_mode, layout, dtype, window_slots, sm90_gather.UP_BLOCK_N, T + 13)
    out = []
    for on in (True, False):
        launches = sm90_gather.launches()
        y, o = _run_with(monkeypatch, on, case, window_slots, policy)
        per_window = 2 if policy == "activations" else 3  # up and dh, and "recompute"'s up again
        assert sm90_gather.launches() - launches == (per_window * windows if on else 0)
        assert torch.isfinite(y).all(), "an unwritten H element"
        out.append((y, o))
    # (the fused dh, h % 16 == 0, sums the routing-weight partials in its own order where h % 64 != 0)
    _assert_same_results(*out, "the Triton up kernel's", weights_close=h % 16 == 0 and h % 64 != 0)


@pytest.mark.cuda
def test_gather_leaves_d_not_multiple_of_64_to_triton_cuda(monkeypatch):
    # d = 200: the gathering kernels' 64-wide steps would cross a row's end, so both stay with the Triton kernels
    _need_sm90()
    case = make_case(300, 200, 256, 4, 2, act="swiglu", layout="dense", device="cuda", dtype=torch.bfloat16,
                     ids_mode="random", seed=7)
    _switch(monkeypatch, True)
    before = sm90_gather.launches()
    check_against_reference(case, "activations", tol=1e-2, ref_dtype=torch.float32)
    assert sm90_gather.launches() == before
