"""A sparse-attention indexer's top-k (DeepSeek-V3.2, GLM-5 under SDPA; HY-V4, whose attention sinks take the eager
path): it picks the keys each query attends to and scatters them into the attention mask. Its region calls attention
and selects no experts: no MoE, not reported. It was reported as a skipped MoE, with whatever its region first failed
on (an in-place update of the KV cache in those models), while the MoE block after it is rewritten as before."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_eager_and_compiled
from test_loop import ModuleListMoE, _x

import moeblaze_fx


class IndexedAttentionThenMoE(nn.Module):
    def __init__(self, d=16, heads=2, keys=4, eager=False):
        super().__init__()
        self.eager = eager
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.index = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.moe = ModuleListMoE(d=d)
        self.heads, self.keys = heads, keys

    def forward(self, hidden):
        B, S, d = hidden.shape
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in self.qkv(hidden).chunk(3, dim=-1))
        scores = self.index(hidden) @ hidden.transpose(1, 2)  # [B, S, S]: the indexer's key scores
        picked = scores.topk(self.keys, dim=-1).indices.to(torch.int32)  # as transformers' indexers return them
        masked = picked.new_ones((B, S, S), dtype=torch.bool).scatter(-1, picked.long(), False)
        if self.eager:  # transformers' eager attention with a sink column, as HY-V4's
            logits = (q @ k.transpose(-1, -2)).masked_fill(masked.unsqueeze(1), float("-inf"))
            logits = torch.cat([logits, logits.new_zeros(B, self.heads, S, 1)], dim=-1)
            probs = F.softmax(logits, dim=-1)[..., :-1]
            attn = F.dropout(probs, p=0.0, training=self.training).to(v.dtype) @ v
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked.unsqueeze(1))
        hidden = hidden + self.o_proj(attn.transpose(1, 2).reshape(B, S, d))
        return hidden + self.moe(hidden)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager-attention"])
@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_indexer_top_k_is_no_moe(inductor, eager):
    torch.manual_seed(0)
    x = _x().detach().requires_grad_()
    got = run_eager_and_compiled(IndexedAttentionThenMoE(eager=eager), (x,), options={"inductor": inductor})
    assert got == {"rewritten": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.status == "rewritten" and record.E == 4
