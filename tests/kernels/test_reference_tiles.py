"""The operator's two plain-PyTorch formulations (moeblaze_fx/kernels/reference.py) against each other.

Off the CPU (CUDA for float64, or without Triton) the operator runs the row-tile formulation, which reads no
size from the data; on the CPU the walk over the experts. Both run here on the CPU in float64: the forward
output, the saved pre-activations and every gradient of the tiled one equal the per-expert one to rounding.
The meta device (which holds no data, so any host read of a value raises) shows that the tiled formulation and
dispatch_reference read nothing back.
"""
from __future__ import annotations

import pytest
import torch

from moeblaze_fx.kernels import reference
from moeblaze_fx.kernels.reference import ExpertParams, dispatch_reference, parse_activation

F64 = torch.float64

# (T, K, E, ids, why)
CASES = [
    (37, 2, 5, "random", "non-power-of-two T; several tiles per expert at 4 rows a tile"),
    (16, 3, 6, "gaps", "experts 1 and 4 get no token and a third of the ids are >= E (no expert)"),
    (9, 4, 4, "one", "every routed pair on expert 2, the rest >= E: one expert spans many tiles"),
    (5, 3, 3, "all_e", "K = E, each token on every expert"),
    (1, 1, 7, "random", "T = 1: a single pair, most tiles unused"),
    (6, 2, 3, "none", "every id >= E: nothing routed, every gradient zero"),
]


def _ids(mode: str, T: int, K: int, E: int, g: torch.Generator) -> torch.Tensor:
    if mode == "random":
        return torch.randint(0, E, (T, K), generator=g)
    if mode == "gaps":
        ids = torch.randint(0, E + 3, (T, K), generator=g)
        return torch.where((ids == 1) | (ids == 4), E + 1, ids)
    if mode == "one":
        return torch.where(torch.rand(T, K, generator=g) < 0.6, 2, E + 5)
    if mode == "all_e":
        return torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    if mode == "none":
        return torch.full((T, K), E, dtype=torch.int64)
    raise ValueError(mode)


def _experts(E: int, d: int, h: int, gated: bool, bias: bool, g: torch.Generator, device="cpu") -> ExpertParams:
    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(device) / shape[-1] ** 0.5

    b = (lambda *shape: rnd(*shape)) if bias else (lambda *shape: None)
    return ExpertParams(rnd(E, h, d), rnd(E, h, d) if gated else None, rnd(E, d, h),
                        b(E, h), b(E, h) if gated else None, b(E, d))


@pytest.mark.parametrize("block, per_chunk", [(4, 1), (4, 3), (64, None)], ids=["4rows_1tile", "4rows_3tiles",
                                                                               "default"])
@pytest.mark.parametrize("act, bias", [("swiglu", False), ("swiglu_oai(alpha=1.702,limit=0.6)", True),
                                       ("gelu", True)], ids=["swiglu", "swiglu_oai_bias", "gelu_bias"])
@pytest.mark.parametrize("T, K, E, mode, why", CASES, ids=[f"T{c[0]}K{c[1]}E{c[2]}_{c[3]}" for c in CASES])
def test_tiles_match_expert_walk(T, K, E, mode, why, act, bias, block, per_chunk):
    g = torch.Generator().manual_seed(T * 100 + K * 10 + E)
    d, h = 12, 10
    a = parse_activation(act)
    p = _experts(E, d, h, a.gated, bias, g)
    x = torch.randn(T, d, generator=g, dtype=F64)
    ids = _ids(mode, T, K, E, g)
    w = torch.rand(T, K, generator=g, dtype=F64)
    grad_y = torch.randn(T, d, generator=g, dtype=F64)
    plan = dispatch_reference(ids, E)
    tol = dict(rtol=1e-12, atol=1e-12)

    y_t, pre_t = reference._forward_by_tile(x, K, w, p, a, True, plan, block=block, per_chunk=per_chunk)
    y_e, pre_e = reference._forward_by_expert(x, K, w, p, a, True, plan)
    torch.testing.assert_close(y_t, y_e, **tol)
    routed = plan.offsets[-1]
    torch.testing.assert_close(pre_t[:routed], pre_e[:routed], **tol)  # the unrouted slots are never read

    for recompute, pre in ((False, pre_e), (True, x.new_empty(0))):
        got = reference._backward_by_tile(grad_y, x, K, w, p, pre, plan, a, recompute, block=block,
                                          per_chunk=per_chunk)
        want = reference._backward_by_expert(grad_y, x, K, w, p, pre, plan, a, recompute)
        torch.testing.assert_close(got[0], want[0], **tol)  # dx
        torch.testing.assert_close(got[1], want[1], **tol)  # dweights
        for name, gt, gw in zip(ExpertParams._fields, got[2], want[2]):
            assert (gt is None) == (gw is None), name
            if gt is not None:
                torch.testing.assert_close(gt, gw, **tol, msg=lambda m: f"{name}: {m}")


def test_tiles_match_expert_walk_in_float32_with_a_nan_token():
    """A NaN token stays in its own rows (the padding rows that gather it are zeroed before any product)."""
    g = torch.Generator().manual_seed(7)
    T, K, E, d, h = 11, 2, 3, 8, 6
    a = parse_activation("swiglu")
    p = ExpertParams(*(t.float() if t is not None else None for t in _experts(E, d, h, True, False, g)))
    x = torch.randn(T, d, generator=g)
    x[4] = float("nan")
    ids = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    plan = dispatch_reference(ids, E)
    y_t, _ = reference._forward_by_tile(x, K, w, p, a, False, plan, block=4, per_chunk=2)
    y_e, _ = reference._forward_by_expert(x, K, w, p, a, False, plan)
    assert torch.isnan(y_t).any(1).tolist() == [t == 4 for t in range(T)]
    torch.testing.assert_close(y_t, y_e, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_off_cpu_path_reads_nothing_back():
    """On the meta device (no data: ``.tolist()`` or ``.item()`` raise) the operator's PyTorch path and the dispatch
    run through, with the shapes the CPU gives."""
    T, K, E, d, h = 10, 2, 4, 8, 6
    g = torch.Generator().manual_seed(0)
    p = _experts(E, d, h, True, True, g, device="meta")
    x = torch.empty(T, d, dtype=F64, device="meta")
    ids = torch.empty(T, K, dtype=torch.int64, device="meta")
    w = torch.empty(T, K, dtype=F64, device="meta")
    with pytest.raises(Exception):
        reference._expert_ranges(dispatch_reference(ids, E))  # the CPU walk does read the offsets
    y, preact, plan = reference.moe_ffn_forward_torch(x, ids, w, p, "swiglu", True)
    n_tiles = reference.max_tiles(T * K, E, 64)
    assert [tuple(t.shape) for t in plan] == [(E + 1,), (T * K,), (T * K,), (n_tiles,), (n_tiles,)]
    assert (y.shape, preact.shape, y.device.type) == ((T, d), (T * K, 2 * h), "meta")
    dx, dw, grads = reference.moe_ffn_backward_torch(torch.empty_like(x), x, ids, w, p, preact, plan, "swiglu", False)
    assert (dx.shape, dw.shape) == ((T, d), (T, K))
    assert [tuple(t.shape) for t in grads] == [tuple(t.shape) for t in p]
