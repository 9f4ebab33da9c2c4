"""A plain-PyTorch MoE block written as a per-expert loop, compiled with the moeblaze backend.

    python examples/plain_loop_moe.py

The loop over range(E) with torch.where is captured as one graph under fullgraph=True (without it,
Dynamo breaks the graph at torch.where and the block runs eagerly). The backend replaces the loop
with one MoEBlaze operator; the router (softmax -> top-k -> renormalize) stays as written.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import moeblaze_fx


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, d=64, h=128, num_experts=8, top_k=2):
        super().__init__()
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


torch.manual_seed(0)
moe = MoE()
x = torch.randn(256, 64, requires_grad=True)
compiled = torch.compile(moe, backend="moeblaze", fullgraph=True)

y = compiled(x)
y.square().mean().backward()
print(moeblaze_fx.report.format_table(moeblaze_fx.last_report()))

x_ref = x.detach().clone().requires_grad_()
torch.testing.assert_close(y, moe(x_ref))
print("same output as eager:", True)
