"""The routing used outside the expert computation as well: a load-balancing loss from the same one-hot mask or a
fresh one, the ids returned, an auxiliary loss folded into the output after the combine. The region is still the
expert computation, rewritten, and the side uses still see their values. Ids that change the experts' input are a
different function: left alone."""
import pytest
import torch
import torch.nn.functional as F
from helpers import run_eager_and_compiled
from test_loop import ModuleListMoE, _x

import moeblaze_fx


class SideUseMoE(ModuleListMoE):
    def __init__(self, side: str):
        super().__init__()
        self.side = side

    def forward(self, hidden):
        B, S, d = hidden.shape
        x = hidden.view(-1, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, self.K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        if self.side == "ids-scale-input":  # the tokens depend on their routing: not the operator's function
            x = x * (1 + (ids == 0).any(-1, keepdim=True).to(x.dtype))
        mask = F.one_hot(ids, num_classes=self.E)  # [T, K, E]
        out = torch.zeros_like(x)
        for e in range(self.E):
            k, tok = torch.where(mask.permute(2, 1, 0)[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        out = out.view(B, S, d)
        # Switch Transformer's load-balancing loss: E * sum_e (fraction of choices routed to e) * (mean prob of e)
        if self.side == "aux-same-mask":
            return out, self.E * (mask.float().mean((0, 1)) * probs.mean(0)).sum()
        if self.side == "aux-own-mask":
            counts = F.one_hot(ids.flatten(), num_classes=self.E).sum(0)
            return out, self.E * (counts.float() / ids.numel() * probs.mean(0)).sum()
        if self.side == "aux-in-output":
            return out * (1 + self.E * (mask.float().mean((0, 1)) * probs.mean(0)).sum())
        if self.side == "ids-returned":
            return out, ids
        return out


@pytest.mark.parametrize("side", ["aux-same-mask", "aux-own-mask", "aux-in-output", "ids-returned"])
def test_routing_used_beside_the_experts_is_rewritten(side):
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE(side), (_x(),)) == {"rewritten": 1}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"]


def test_routing_used_beside_the_experts_through_inductor():
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE("aux-same-mask"), (_x(),), options={}) == {"rewritten": 1}


def test_ids_that_change_the_experts_input_are_left_alone():
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE("ids-scale-input"), (_x(),)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.status == "skipped" and "differs from the MoE operator" in record.reason
