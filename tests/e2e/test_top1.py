"""Top-1 routing with experts as products over gathered weights: a token's one expert output is already [T, d]
before its routing weight is applied, so the region runs on from there to the weighting, and no further than a
node that reads another [T, d] tensor (a residual)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_eager_and_compiled

import moeblaze_fx


class GatheredTop1(nn.Module):
    """Experts as bmm over weights gathered by id. ``scale``: where the routing weight goes: "output" (after the
    products, as HF batched_mm does), "output_fp32" (after a cast), "input" (on the tokens, as Llama 4 does: no
    weight on the output), "after_residual" (on the residual sum). ``biases``: each expert's, gathered by id."""

    def __init__(self, scale, d=16, h=12, E=4, biases=False):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * h, d) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(E, d, h) / h**0.5)
        self.w_gate_up_bias = nn.Parameter(torch.randn(E, 2 * h) / 10) if biases else None
        self.w_down_bias = nn.Parameter(torch.randn(E, d) / 10) if biases else None
        self.scale = scale

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        w, ids = torch.topk(probs, 1, dim=-1)
        ids = ids.reshape(-1)
        tokens = x * w if self.scale == "input" else x
        gate_up = torch.bmm(self.w_gate_up[ids], tokens.unsqueeze(-1)).squeeze(-1)
        if self.w_gate_up_bias is not None:
            gate_up = gate_up + self.w_gate_up_bias[ids]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.bmm(self.w_down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        if self.w_down_bias is not None:
            y = y + self.w_down_bias[ids]
        if self.scale == "output":
            return y * w + x
        if self.scale == "output_fp32":
            return (y.float() * w).to(x.dtype) + x
        if self.scale == "after_residual":
            return (y + x) * w
        return y + x


def _x(T=10, d=16):
    return torch.randn(T, d, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scale", ["output", "output_fp32"])
def test_weight_after_the_products_is_in_the_region(scale):
    torch.manual_seed(0)
    got = run_eager_and_compiled(GatheredTop1(scale), (_x(),))
    assert got == {"rewritten": 1}
    (record,) = moeblaze_fx.last_report()
    assert (record.K, record.E, record.h) == (1, 4, 12)


@pytest.mark.parametrize("tokens", [10, 64], ids=["T!=E*d", "T=E*d"])
def test_expert_biases_are_not_taken_for_the_weights(tokens):
    """The walk to the weighting passes reads of parameters: with T = E·d (4·16) the down biases ``[E, d]``,
    read where the expert routes meet, once passed for the [T] routing weights and the region stopped short of them
    (left alone: no weights read)."""
    torch.manual_seed(0)
    got = run_eager_and_compiled(GatheredTop1("output", biases=True), (_x(T=tokens),))
    assert got == {"rewritten": 1}
    (record,) = moeblaze_fx.last_report()
    assert (record.T, record.K) == (tokens, 1)
    assert "down_bias = w_down_bias" in record.layout


@pytest.mark.parametrize("scale", ["input", "after_residual"])
def test_no_weight_before_a_residual_is_left_alone(scale):
    """The walk stops at the residual: the region (the unweighted experts) reads no routing weight."""
    torch.manual_seed(0)
    got = run_eager_and_compiled(GatheredTop1(scale), (_x(),))
    assert got == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("expected the region to read tokens [T, d] and combine weights [T, K]")
