"""Plain-PyTorch MoE blocks written as per-expert loops, as Dynamo unrolls them under fullgraph=True."""
import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import rewritten_graph, run_eager_and_compiled

import moeblaze_fx
from moeblaze_fx.models import LoopMoE


class SwiGLUExpert(nn.Module):
    def __init__(self, d, h, act=F.silu):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class ModuleListMoE(nn.Module):
    """Mixtral-style: a ModuleList of experts with separate Linear layers."""

    def __init__(self, d=16, h=24, E=4, K=2, combine="index_add", acts=None, mask="one_hot"):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        acts = acts or [F.silu] * E
        self.experts = nn.ModuleList(SwiGLUExpert(d, h, a) for a in acts)
        self.E, self.K, self.combine, self.mask = E, K, combine, mask

    def forward(self, hidden):
        B, S, d = hidden.shape
        x = hidden.view(-1, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, self.K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        for e in range(self.E):
            if self.mask == "one_hot":
                k, tok = torch.where(mask[e])
            else:
                tok, k = torch.where(ids == e)
            y = self.experts[e](x[tok]) * w[tok, k, None]
            if self.combine == "index_add":
                out.index_add_(0, tok, y)
            else:
                out[tok] += y
        return out.view(B, S, d)


class TopKPooling(nn.Module):
    """top-k used for something that is not an MoE: keep the k largest features of each token."""

    def __init__(self, d=16, k=4):
        super().__init__()
        self.proj, self.k = nn.Linear(d, d), k

    def forward(self, x):
        scores = self.proj(x)
        vals, idx = scores.topk(self.k, dim=-1)
        return torch.zeros_like(scores).scatter(-1, idx, vals).relu() @ self.proj.weight


def _x(shape=(2, 5, 16), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.parametrize("mask", ["one_hot", "eq"])  # where(one_hot(ids)[e]) or where(ids == e)
@pytest.mark.parametrize("combine", ["index_add", "setitem-iadd"])  # out.index_add_(...) or out[tok] += ...
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_modulelist_loop_is_rewritten(combine, checkpoint, mask):
    torch.manual_seed(0)
    got = run_eager_and_compiled(ModuleListMoE(combine=combine, mask=mask), (_x(),),
                                 options={"inductor": False, "checkpoint": checkpoint})
    assert got == {"rewritten": 1}


def test_fused_parameter_loop_is_rewritten():
    torch.manual_seed(0)
    assert run_eager_and_compiled(LoopMoE(16, 24, 4, 2), (_x(),)) == {"rewritten": 1}


def test_loop_through_inductor():
    torch.manual_seed(0)
    assert run_eager_and_compiled(ModuleListMoE(), (_x(),), options={}) == {"rewritten": 1}


def test_topk_that_is_not_moe_is_left_alone():
    torch.manual_seed(0)
    assert run_eager_and_compiled(TopKPooling(), (_x(),)) == {}
    assert moeblaze_fx.last_report() == []


def test_loop_with_a_different_expert_is_left_alone():
    torch.manual_seed(0)
    model = ModuleListMoE(acts=[F.silu, F.silu, F.gelu, F.silu])  # expert 2 computes GELU-GLU
    assert run_eager_and_compiled(model, (_x(),)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.status == "skipped"
    # no one activation accounts for both silu and gelu: left alone before any numerical check
    assert record.reason.endswith("computes what the experts call: gelu, silu; nothing can be changed short of using "
                                  "one of those")


def test_unknown_option_lists_valid_ones():
    with pytest.raises(Exception, match=r"unknown option\(s\) \['chekpoint'\]; valid options are"):
        torch.compile(LoopMoE(16, 24, 4, 2), backend="moeblaze", fullgraph=True,
                      options={"chekpoint": "recompute"})(_x())


class TestGolden(expecttest.TestCase):
    def test_modulelist_loop_graph(self):
        torch.manual_seed(0)
        self.assertExpectedInline(rewritten_graph(ModuleListMoE(), _x()), """\
l_hidden = input
gate.weight = input
experts.0.w1.weight = input
experts.0.w3.weight = input
experts.0.w2.weight = input
experts.1.w1.weight = input
experts.1.w3.weight = input
experts.1.w2.weight = input
experts.2.w1.weight = input
experts.2.w3.weight = input
experts.2.w2.weight = input
experts.3.w1.weight = input
experts.3.w3.weight = input
experts.3.w2.weight = input
x = .view(l_hidden, -1, 16)
linear = torch.linear(x, gate.weight, None)
probs = torch.softmax(linear, dim=-1, dtype=torch.float32)
topk = torch.topk(probs, 2, dim=-1)
w = operator.getitem(topk, 0)
ids = operator.getitem(topk, 1)
sum_1 = .sum(w, -1, keepdim=True)
truediv = operator.truediv(w, sum_1)
w_1 = .to(truediv, torch.float32)
moe_ffn_default = moeblaze.moe_ffn.default(x, ids, w_1, [experts.0.w1.weight, experts.1.w1.weight, experts.2.w1.weight, experts.3.w1.weight, experts.0.w3.weight, experts.1.w3.weight, experts.2.w3.weight, experts.3.w3.weight, experts.0.w2.weight, experts.1.w2.weight, experts.2.w2.weight, experts.3.w2.weight], [4, 0, 4, 0, 0, 16, 1, 24, 16, 4, 4, 0, 0, 16, 1, 24, 16, 8, 4, 0, 0, 24, 1, 16, 24, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 3728270)
getitem = operator.getitem(moe_ffn_default, 0)
view_1 = .view(getitem, 2, 5, 16)
return (view_1,)""")

    def test_report(self):
        torch.manual_seed(0)
        rewritten_graph(ModuleListMoE(), _x(), options={"checkpoint": "recompute"})
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.last_report()), """\
moeblaze: 1 of 1 MoE candidate(s) rewritten
  [0] rewritten tests/e2e/test_loop.py:49  per-expert loop [one_hot+where+index_add]
      T=10 d=16 h=24 E=4 K=2 float32  policy=recompute  saved for backward: 11.6 KB -> 880 B
      layout: gate = experts.*.w1.weight, up = experts.*.w3.weight, down = experts.*.w2.weight; activation swiglu; check: numerical: forward and gradients within rel. error 1e-07 of the operator""")

    def test_report_of_skipped(self):
        torch.manual_seed(0)
        rewritten_graph(ModuleListMoE(acts=[F.silu, F.relu, F.silu, F.silu]), _x())
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.last_report()), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_loop.py:49  per-expert loop [one_hot+where+index_add]
      reason: no supported expert activation (SwiGLU, GeGLU, the clamped SwiGLUs of gpt-oss and DeepSeek-V4, Inkling 2's soft-capped SwiGLU, SiLU, GELU, ReLU, squared ReLU; GELU exact or tanh) computes what the experts call: relu, silu; nothing can be changed short of using one of those""")


def test_zero_expert_weights_prove_nothing():
    """With all-zero expert weights every function looks equal on the check's inputs: not a proof."""
    torch.manual_seed(0)
    model = LoopMoE(16, 24, 4, 2)
    with torch.no_grad():
        model.gate_up.zero_()
        model.down.zero_()
    assert run_eager_and_compiled(model, (_x(),)) == {"skipped": 1}
    assert "nothing would be proven" in moeblaze_fx.last_report()[0].reason


def test_loop_skipped_by_a_graph_break_is_reported_with_the_fix():
    """Without fullgraph=True, torch.where inside the loop over range(E) breaks the graph; a break inside a loop makes
    Dynamo run the whole block eagerly and compile only each expert's module, whose graph holds no top-k (issue 38
    point 7: this used to be "no MoE candidates" and nothing else). Each expert graph now names the block and the
    fix; with the flag the fix names, the same block is one graph and is rewritten."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = ModuleListMoE(mask="where")
    x = torch.randn(2, 5, 16)
    counters.clear()
    torch.compile(model, backend="moeblaze", options={"inductor": False})(x)
    # Expert.forward compiles twice (static, then dynamic sizes after the second expert's row count differs)
    assert dict(counters["moeblaze"]) == {"skipped": 2}
    (record,) = moeblaze_fx.last_report()
    assert record.source == "tests/e2e/test_loop.py:47" and record.idiom == "per-expert loop (run eagerly)"
    assert record.reason.startswith("Dynamo skipped the MoE block `forward` at tests/e2e/test_loop.py:34: a graph "
                                    "break inside its loop over the experts (the output shape of "
                                    "aten.nonzero.default depends on the data)"), record.reason
    assert "capture_dynamic_output_shape_ops = True" in record.reason

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = run_eager_and_compiled(model, (x,), fullgraph=False)
    assert got == {"rewritten": 1}


class ExpertHitMoE(nn.Module):
    """Hugging Face's eager experts: a loop over the experts hit (``nonzero`` of the routed counts), or, as the
    report advises instead, over ``range(E)``."""

    def __init__(self, over="hit", d=16, h=24, E=4, K=2):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * h, d) / d**0.5)
        self.down = nn.Parameter(torch.randn(E, d, h) / h**0.5)
        self.over, self.E, self.K = over, E, K

    def forward(self, x):
        w, ids = F.softmax(self.router(x), dim=-1).topk(self.K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, self.E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in (hit[:, 0] if self.over == "hit" else range(self.E)):
            k, tok = torch.where(mask[e])
            gate, up = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, self.down[e]) * w[tok, k, None])
        return out


class TestExpertHitReports(expecttest.TestCase):
    def _report(self, **dynamo_config):
        torch.manual_seed(0)
        before = len(moeblaze_fx.report.all_reports())
        with torch._dynamo.config.patch(**dynamo_config):
            got = run_eager_and_compiled(ExpertHitMoE(), (_x((10, 16)),), fullgraph=False)
        assert got == {"skipped": 1}
        return moeblaze_fx.report.format_table([r for g in moeblaze_fx.report.all_reports()[before:] for r in g])

    def test_at_the_experts_hit(self):
        """The block ends at ``nonzero``; the fix names the loop that would break the graph next."""
        self.assertExpectedInline(self._report(), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_loop.py:215  -
      reason: Dynamo split this MoE block at tests/e2e/test_loop.py:218 (`hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()`): the output shape of aten.nonzero.default depends on the data, so the graph ends there and the experts run in other graphs. Set torch._dynamo.config.capture_dynamic_output_shape_ops = True (or compile with fullgraph=True), or use ops with static output shapes; a Python loop over its result (`for e in expert_hit`) would break the graph next: loop over range(E)""")

    def test_at_the_loop_over_them(self):
        """With the fix for ``nonzero``, Dynamo breaks at the loop over its result, which no setting traces: the report
        says to loop over range(E)."""
        self.assertExpectedInline(self._report(capture_dynamic_output_shape_ops=True), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_loop.py:215  -
      reason: Dynamo split this MoE block at tests/e2e/test_loop.py:219 (`for e in (hit[:, 0] if self.over == "hit" else range(self.E)):`): a Python loop over a tensor whose length depends on the data (the experts hit) cannot be traced, so the graph ends there and the experts run in other graphs. Loop over range(E) instead, each expert taking its rows with torch.where(ids == e) (an expert without rows then computes empty products), and set torch._dynamo.config.capture_dynamic_output_shape_ops = True (or compile with fullgraph=True) for the where""")


def test_the_loop_over_range_e_the_report_advises_is_rewritten():
    torch.manual_seed(0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert run_eager_and_compiled(ExpertHitMoE("range"), (_x((10, 16)),), fullgraph=False) == {"rewritten": 1}
