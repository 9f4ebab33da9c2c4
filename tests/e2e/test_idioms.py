"""More of the world's MoE code (issue 6): grouped products over separate w1/w3/w2 weights, a
sigmoid router with an expert-bias correction and group-limited top-k, weights gathered from the
scores by id, scatter_add, and shared experts beside the routed ones."""
import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import rewritten_graph, run_eager_and_compiled

import moeblaze_fx


class DeepSeekStyleMoE(nn.Module):
    def __init__(self, d=32, h=16, E=8, K=2, groups=4, topk_groups=2, shared=False):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, E))  # expert-bias load-balancing correction
        self.w1 = nn.Parameter(torch.randn(E, h, d) / d**0.5)
        self.w3 = nn.Parameter(torch.randn(E, h, d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, h) / h**0.5)
        self.E, self.K, self.G, self.TG = E, K, groups, topk_groups
        self.shared = nn.Sequential(nn.Linear(d, h, bias=False), nn.SiLU(), nn.Linear(h, d, bias=False)) if shared else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if shared else None

    def forward(self, x):
        T, d = x.shape
        scores = torch.sigmoid(self.gate(x))
        biased = scores + self.bias
        group_score = biased.view(T, self.G, -1).topk(2, dim=-1).values.sum(-1)
        group_idx = group_score.topk(self.TG, dim=-1).indices
        group_mask = torch.zeros_like(group_score).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(T, self.G, self.E // self.G).reshape(T, self.E)
        ids = biased.masked_fill(expert_mask == 0, float("-inf")).topk(self.K, dim=-1).indices
        w = scores.gather(1, ids)  # weights from the unbiased scores
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=self.E), 0).to(torch.int32)
        tok = order // self.K
        xs = x[tok]
        g = torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, self.w3.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(g) * u, self.w2.transpose(1, 2), offs=offs)
        y = y * w.flatten()[order, None]
        out = torch.zeros_like(x).scatter_add(0, tok[:, None].expand(-1, d), y)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


def _x():
    # torch._grouped_mm takes bfloat16 on the CPU
    return torch.randn(20, 32, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()


@pytest.mark.parametrize("shared", [False, True], ids=["routed-only", "with-shared-expert"])
def test_sigmoid_group_limited_router_grouped_mm_scatter_add(shared):
    torch.manual_seed(0)
    model = DeepSeekStyleMoE(shared=shared).bfloat16()
    assert run_eager_and_compiled(model, (_x(),), dtype=torch.bfloat16) == {"rewritten": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.layout == "gate = w1, up = w3, down = w2; activation swiglu"


class TestGolden(expecttest.TestCase):
    def test_shared_expert_stays(self):
        torch.manual_seed(0)
        graph = rewritten_graph(DeepSeekStyleMoE(shared=True).bfloat16(), _x())
        self.assertExpectedInline(graph, """\
l_x = input
gate.weight = input
l_self.bias = input
w1 = input
w3 = input
w2 = input
shared_gate.weight = input
shared.0.weight = input
shared.2.weight = input
linear = torch.linear(l_x, gate.weight, None)
scores = torch.sigmoid(linear)
biased = operator.add(scores, l_self.bias)
view = .view(biased, 20, 4, -1)
topk = .topk(view, 2, dim=-1)
getitem = operator.getitem(topk, 0)
group_score = .sum(getitem, -1)
topk_1 = .topk(group_score, 2, dim=-1)
group_idx = operator.getitem(topk_1, 1)
zeros_like = torch.zeros_like(group_score)
group_mask_functional = .scatter(zeros_like, 1, group_idx, 1.0)
unsqueeze = .unsqueeze(group_mask_functional, -1)
expand = .expand(unsqueeze, 20, 4, 2)
expert_mask = .reshape(expand, 20, 8)
eq = operator.eq(expert_mask, 0)
masked_fill = .masked_fill(biased, eq, -inf)
topk_2 = .topk(masked_fill, 2, dim=-1)
ids = operator.getitem(topk_2, 1)
w = .gather(scores, 1, ids)
sum_2 = .sum(w, -1, keepdim=True)
w_1 = operator.truediv(w, sum_2)
flatten_1 = .flatten(w_1)
reshape = torch.reshape(flatten_1, (-1, 2))
moe_ffn_default = moeblaze.moe_ffn.default(l_x, ids, reshape, [w1, w3, w2], [8, 0, 1, 0, 512, 32, 1, 16, 32, 1, 1, 0, 512, 32, 1, 16, 32, 2, 1, 0, 512, 16, 1, 32, 16, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 8388608)
getitem_9 = operator.getitem(moe_ffn_default, 0)
linear_1 = torch.linear(l_x, shared_gate.weight, None)
sigmoid_1 = torch.sigmoid(linear_1)
input_1 = torch.linear(l_x, shared.0.weight, None)
input_2 = torch.silu(input_1, inplace=False)
input_3 = torch.linear(input_2, shared.2.weight, None)
mul_2 = operator.mul(sigmoid_1, input_3)
out_1 = operator.add(getitem_9, mul_2)
return (out_1,)""")
