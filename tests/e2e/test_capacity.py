"""Capacity-based routing (Switch, GShard) is a different function from moe_ffn and is left alone.

Each expert takes at most C = ceil(capacity_factor * T * K / E) (token, choice) pairs, first choices of
all tokens before second choices; the rest are dropped (they contribute nothing). ``moe_ffn`` computes
every routed token. The two agree only on inputs where no expert overflows, so a capacity block is
recognised by its structure (a running count of each expert's tokens compared with C) and never
rewritten, whatever C is: the numerical check alone would accept it whenever its random routing happens
not to overflow an expert (``test_generous_capacity_still_drops_on_skewed_input``).
"""
import copy
import math

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_eager_and_compiled

import moeblaze_fx


class CapacityMoE(nn.Module):
    """``switch``: top-1, ``keep = mask * torch.lt(pos, C)``, experts via torch.bmm.
    ``gshard``: top-2 renormalised, ``mask.masked_fill(pos >= C, 0)``, experts via einsum.
    Dense dispatch and combine tensors [T, E, C] with einsum, SwiGLU experts over [E, C, d]."""

    def __init__(self, style="gshard", d=16, h=24, E=4, capacity_factor=1.0):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, d, h) / d**0.5)
        self.w_up = nn.Parameter(torch.randn(E, d, h) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(E, h, d) / h**0.5)
        self.style, self.E, self.K = style, E, 1 if style == "switch" else 2
        self.capacity_factor = capacity_factor

    def forward(self, x):
        T, d = x.shape
        E, K = self.E, self.K
        C = math.ceil(self.capacity_factor * T * K / E)
        probs = F.softmax(self.router(x), dim=-1)
        w, ids = probs.topk(K, dim=-1)
        if K > 1:
            w = w / w.sum(-1, keepdim=True)
        mask = F.one_hot(ids, E)  # [T, K, E]
        # a (token, choice)'s slot in its expert: first choices of all tokens take slots first
        pos = torch.cumsum(mask.transpose(0, 1).reshape(K * T, E), dim=0).reshape(K, T, E).transpose(0, 1) - 1
        if self.style == "switch":
            keep = mask * torch.lt(pos, C)
        else:
            keep = mask.masked_fill(pos >= C, 0)
        slot = F.one_hot((pos * keep).sum(-1), C)  # [T, K, C]
        dispatch = (keep[..., None] * slot[:, :, None, :]).sum(1).to(x.dtype)  # [T, E, C]
        combine = (w[..., None, None] * keep[..., None] * slot[:, :, None, :]).sum(1)  # [T, E, C]
        xe = torch.einsum("td,tec->ecd", x, dispatch)  # [E, C, d]
        if self.style == "switch":
            ye = torch.bmm(F.silu(torch.bmm(xe, self.w_gate)) * torch.bmm(xe, self.w_up), self.w_down)
        else:
            hidden = F.silu(torch.einsum("ecd,edh->ech", xe, self.w_gate)) * torch.einsum("ecd,edh->ech", xe, self.w_up)
            ye = torch.einsum("ech,ehd->ecd", hidden, self.w_down)
        return torch.einsum("tec,ecd->td", combine, ye)


def _x(T=10, seed=0):
    return torch.randn(T, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _drops(model: CapacityMoE, x: torch.Tensor) -> bool:
    """Whether ``model`` drops a token of ``x``: compared with the same model at C = T, which cannot."""
    unbounded = copy.deepcopy(model)
    unbounded.capacity_factor = model.E / model.K
    with torch.no_grad():
        return not torch.allclose(model(x), unbounded(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "factor,drops",
    [
        (1.0, True),  # C = T*K/E: the test input overflows an expert
        ("C=T", False),  # C = T: no token can be dropped at this T, and still not rewritten
    ],
    ids=["drops", "C=T"],
)
@pytest.mark.parametrize("style", ["switch", "gshard"])
def test_capacity_routing_is_left_alone(style, factor, drops):
    torch.manual_seed(0)
    model = CapacityMoE(style)
    model.capacity_factor = model.E / model.K if factor == "C=T" else factor
    assert _drops(model, _x()) == drops  # the case is what its id says
    assert run_eager_and_compiled(model, (_x(),)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("capacity routing: a running count of each expert's tokens is compared with a "
                                    "capacity C=")
    assert "moe_ffn computes every routed token" in record.reason


def test_generous_capacity_still_drops_on_skewed_input():
    """C = 8 of T = 10 (K = 2, E = 4): the test input and the prover's random routing overflow no expert,
    so the numbers alone would accept the region. A batch of one repeated token sends all T tokens to
    the same two experts: eager drops 2 of them there, and the compiled model must too."""
    torch.manual_seed(0)
    model = CapacityMoE("gshard", capacity_factor=1.5)
    x = _x()
    assert not _drops(model, x)
    compiled = torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False})
    torch.testing.assert_close(compiled(x), model(x))
    skewed = x.detach()[:1].expand(10, 16).clone()
    assert _drops(model, skewed)
    torch.testing.assert_close(compiled(skewed), model(skewed))
    assert [r.status for r in moeblaze_fx.last_report()] == ["skipped"]


def test_capacity_through_inductor():
    torch.manual_seed(0)
    assert run_eager_and_compiled(CapacityMoE("gshard"), (_x(),), options={}) == {"skipped": 1}


class OffsetsLoopMoE(nn.Module):
    """Not capacity: a running count (expert offsets, cumsum of the counts) compared with token
    positions selects each expert's tokens, and no token is dropped. Rewritten."""

    def __init__(self, d=16, h=24, E=4, K=2):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, h, d) / d**0.5)
        self.w3 = nn.Parameter(torch.randn(E, h, d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, h) / h**0.5)
        self.E, self.K = E, K

    def forward(self, x):
        w, ids = F.softmax(self.router(x), dim=-1).topk(self.K, dim=-1)
        flat, w_flat = ids.flatten(), w.flatten()
        order = flat.argsort(stable=True)
        ends = torch.cumsum(F.one_hot(flat, self.E).sum(0), 0)
        slots = torch.arange(flat.numel())
        out = torch.zeros_like(x)
        for e in range(self.E):
            pick = order[(slots >= (ends[e - 1] if e else 0)) & (slots < ends[e])]
            tok = pick // self.K
            y = (F.silu(x[tok] @ self.w1[e].t()) * (x[tok] @ self.w3[e].t())) @ self.w2[e].t()
            out.index_add_(0, tok, y * w_flat[pick, None])
        return out


def test_running_count_compared_with_positions_is_not_capacity():
    torch.manual_seed(0)
    assert run_eager_and_compiled(OffsetsLoopMoE(), (_x(),)) == {"rewritten": 1}


class TestGolden(expecttest.TestCase):
    def test_report(self):
        torch.manual_seed(0)
        torch.compile(CapacityMoE("switch"), backend="moeblaze", fullgraph=True, options={"inductor": False})(_x())
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.last_report()), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_capacity.py:61  -
      reason: capacity routing: a running count of each expert's tokens is compared with a capacity C=3 at tests/e2e/test_capacity.py:49, and tokens beyond C are dropped; moe_ffn computes every routed token, so the two differ whenever an expert is routed more than C tokens: not rewritten, and nothing can be changed while the model drops tokens past a capacity""")

    def test_report_symbolic_capacity(self):
        """dynamic=True: C = ceil(1.5 * T * 2 / 4) is symbolic; the report shows its traced value."""
        torch.manual_seed(0)
        model = CapacityMoE("gshard", capacity_factor=1.5)
        torch.compile(model, backend="moeblaze", dynamic=True, options={"inductor": False})(_x())
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.last_report()), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_capacity.py:61  -
      reason: capacity routing: a running count of each expert's tokens is compared with a capacity C=8 (at the traced sizes) at tests/e2e/test_capacity.py:51, and tokens beyond C are dropped; moe_ffn computes every routed token, so the two differ whenever an expert is routed more than C tokens: not rewritten, and nothing can be changed while the model drops tokens past a capacity""")
