"""The routing used outside the expert computation as well: a load-balancing loss from the same one-hot mask or a
fresh one, or the ids, returned beside the output. The region is still the expert computation, rewritten, and the
side uses still see their values; also with top-1 routing and sorted tokens, where the unsort permutation must stay
in the region. Ids that change the experts' input, or a loss folded into the output, are left alone."""
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


class SortedTop1(torch.nn.Module):
    """Top-1 routing, tokens sorted by expert, experts as bmm over gathered weights, the routing weight on the
    hidden activation, the outputs unsorted at the end; optionally a load-balancing loss returned beside them. With
    K = 1 the sorted expert outputs are [T, d] too: a search that set aside the unsort permutation (read only by the
    combine) would stop there."""

    def __init__(self, aux: bool, d=16, h=24, E=4):
        super().__init__()
        self.gate = torch.nn.Linear(d, E, bias=False)
        self.w_gate_up = torch.nn.Parameter(torch.randn(E, 2 * h, d) * 0.3)
        self.w_down = torch.nn.Parameter(torch.randn(E, d, h) * 0.3)
        self.aux, self.E = aux, E

    def forward(self, x):
        probs = F.softmax(self.gate(x), -1)
        w, ids = torch.topk(probs, 1)
        flat = ids.view(-1)
        perm = flat.argsort()
        xs, es = x[perm], flat[perm]
        g, u = torch.bmm(self.w_gate_up[es], xs.unsqueeze(-1)).squeeze(-1).chunk(2, -1)
        ys = torch.bmm(self.w_down[es], (F.silu(g) * u * w.view(-1)[perm, None]).unsqueeze(-1)).squeeze(-1)
        out = ys[perm.argsort()]
        if self.aux:
            return out, (F.one_hot(flat, self.E).float().mean(0) * probs.mean(0)).sum()
        return out


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("aux", [False, True], ids=["alone", "aux-returned"])
def test_top1_sorted_tokens_combine_after_the_unsort(aux, verify):
    torch.manual_seed(0)
    x = torch.randn(12, 16, requires_grad=True)
    assert run_eager_and_compiled(SortedTop1(aux), (x,), options={"inductor": False, "verify": verify}) == {
        "rewritten": 1}


class SortedTop2(SortedTop1):
    """The same with K = 2: tokens repeated per choice, outputs summed over the choices. ``ids.view(-1)`` needs
    contiguous ids, as topk gives: the proof's random ids must be laid out as the traced ones."""

    def forward(self, x):
        K, d = 2, x.shape[-1]
        w, ids = torch.topk(F.softmax(self.gate(x), -1), K)
        flat = ids.view(-1)
        perm = flat.argsort()
        xs, es = x.repeat_interleave(K, 0)[perm], flat[perm]
        g, u = torch.bmm(self.w_gate_up[es], xs.unsqueeze(-1)).squeeze(-1).chunk(2, -1)
        ys = torch.bmm(self.w_down[es], (F.silu(g) * u * w.view(-1)[perm, None]).unsqueeze(-1)).squeeze(-1)
        return ys[perm.argsort()].view(-1, K, d).sum(1)


@pytest.mark.parametrize("verify", [True, False])
def test_top2_sorted_tokens_with_flat_ids_view(verify):
    torch.manual_seed(0)
    x = torch.randn(12, 16, requires_grad=True)
    assert run_eager_and_compiled(SortedTop2(False), (x,), options={"inductor": False, "verify": verify}) == {
        "rewritten": 1}


@pytest.mark.parametrize("side", ["aux-same-mask", "aux-own-mask", "ids-returned"])
def test_routing_used_beside_the_experts_is_rewritten(side):
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE(side), (_x(),)) == {"rewritten": 1}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"]


def test_routing_used_beside_the_experts_through_inductor():
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE("aux-same-mask"), (_x(),), options={}) == {"rewritten": 1}


@pytest.mark.parametrize("side,reason", [("ids-scale-input", "differs from the MoE operator"),
                                         ("aux-in-output", "expected the region to read tokens [T, d] and combine")])
def test_routing_that_changes_the_function_is_left_alone(side, reason):
    """The tokens scaled by their routing; a loss from the routing multiplied into the output (it meets the expert
    outputs, so the region would end after it)."""
    torch.manual_seed(0)
    assert run_eager_and_compiled(SideUseMoE(side), (_x(),)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.status == "skipped" and reason in record.reason


class DenseGated(torch.nn.Module):
    """Every expert on every token, combined through a gate matrix from one_hot(ids): a different function from the
    operator (experts run on tokens not routed to them), with the routing read only after the products."""

    def __init__(self, d=16, h=24, E=4, K=2):
        super().__init__()
        self.gate = torch.nn.Linear(d, E, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(E, h, d) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(E, d, h) * 0.2)
        self.K, self.E = K, E

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.gate(x), -1), self.K)
        gates = (F.one_hot(ids, self.E) * w[..., None]).sum(1)
        ys = torch.einsum("teh,edh->ted", F.silu(torch.einsum("td,ehd->teh", x, self.w1)), self.w2)
        return (gates[..., None] * ys).sum(1)


def test_an_moe_that_cannot_be_rewritten_is_still_reported():
    """A top-k is dropped as "not an MoE" only when no matrix product follows it (a load-balancing loss's); this
    block's products follow its top-k though its ids reach none of them, and it is reported as left alone."""
    torch.manual_seed(0)
    assert run_eager_and_compiled(DenseGated(), (torch.randn(10, 16, requires_grad=True),)) == {"skipped": 1}
    assert [r.status for r in moeblaze_fx.last_report()] == ["skipped"]


@torch.library.custom_op("moeblaze_test::halve", mutates_args=("t",))
def _halve(t: torch.Tensor) -> None:
    t.mul_(0.5)


@_halve.register_fake
def _(t):
    return None


class MutatesTokens(ModuleListMoE):
    """A per-expert loop that also updates its input tokens in place after each expert: each expert reads the tokens
    as the earlier ones left them, which one operator call at the combine cannot do."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.K, dim=-1)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        if self.how == "view-after-update":  # a fresh tensor updated (made functional), then a view of it updated
            x = x * 1.0
            x.mul_(2.0)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
            if self.how == "index_fill_":  # reads the routing
                x.index_fill_(0, tok, 0.0)
            elif self.how == "setitem":
                x[tok] *= 0.5
            elif self.how == "iadd":  # does not read it: operator.iadd on the input
                x += 1.0
            elif self.how == "view":  # through a view of the tokens
                x.view(-1)[:5].mul_(0.5)
            elif self.how == "chunk":  # through a piece of x.chunk: normalize must not take it for a fresh tensor
                x.chunk(2)[0].mul_(0.5)
            elif self.how == "view-after-update":
                x[:3].mul_(0.5)
            elif self.how == "out=":
                torch.mul(x, 0.5, out=x)
            elif self.how == "foreach":
                torch._foreach_mul_([x], 0.5)
            elif self.how == "aten":
                torch.ops.aten.mul_.Scalar(x, 0.5)
            elif self.how == "custom-op":  # an operator whose schema says it writes x
                _halve(x)
            else:
                x.mul_(0.5)
        return out


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("how", ["index_fill_", "setitem", "iadd", "mul_", "view", "chunk", "view-after-update",
                                 "out=", "foreach", "aten", "custom-op"])
def test_tokens_updated_in_place_inside_the_region_are_left_alone(how, verify):
    torch.manual_seed(0)
    model, x = MutatesTokens(how), torch.randn(10, 16)
    want = model(x.clone())
    torch._dynamo.reset()
    got = torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False, "verify": verify})(
        x.clone())
    assert [r.status for r in moeblaze_fx.last_report()] == ["skipped"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class UpdatesState(ModuleListMoE):
    """A per-expert loop that also updates module state the experts never read: a step counter, tokens counted per
    expert. The operator at the combine computes what the loop did, and the updates still happen, in their order."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("counts", torch.zeros(self.E))

    def forward(self, hidden):
        x = hidden.view(-1, hidden.shape[-1])
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.K, dim=-1)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
            if self.how == "counter" and e == 0:  # reads nothing of the routing
                self.calls += 1
            elif self.how == "per-expert-count":  # reads the routing: a side use that updates in place
                self.counts[e] += tok.numel()
            elif self.how == "mask-count" and e == 0:
                self.counts.add_(mask.sum((1, 2)).float())
        return out.view(hidden.shape)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("how", ["counter", "per-expert-count", "mask-count"])
def test_updates_of_state_the_region_does_not_read_are_kept(how, verify):
    torch.manual_seed(0)
    model = UpdatesState(how)
    eager = UpdatesState(how)
    eager.load_state_dict(model.state_dict())
    x = _x()
    for _ in range(2):
        want = eager(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moeblaze", fullgraph=True,
                             options={"inductor": False, "verify": verify})
    for _ in range(2):
        got = compiled(x)
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"]
    torch.testing.assert_close(got, want)
    assert torch.equal(model.calls, eager.calls) and torch.equal(model.counts, eager.counts)
    assert model.calls.item() == (2 if how == "counter" else 0) and model.counts.sum().item() == (
        0 if how == "counter" else 2 * x[..., 0].numel() * model.K)


def test_updates_of_state_with_gradients_through_inductor():
    torch.manual_seed(0)
    model = UpdatesState("per-expert-count")
    assert run_eager_and_compiled(model, (_x(),), options={}) == {"rewritten": 1}
    assert model.counts.sum().item() == 2 * 10 * model.K  # 10 tokens, in the eager step and the compiled one


class VmapBeforeMoE(ModuleListMoE):
    """torch.vmap in the same graph (Jamba's associative scan on the CPU vmaps its combine): Dynamo records values
    as functorch batched tensors, whose storage is that of the tensor they wrap."""

    def forward(self, hidden):
        return super().forward(hidden + torch.vmap(torch.sin)(hidden))


@pytest.mark.parametrize("verify", [True, False])
def test_vmap_elsewhere_in_the_graph(verify):
    """Before: reading a batched value's storage raised, and the whole graph was left unchanged ("internal error")."""
    torch.manual_seed(0)
    assert run_eager_and_compiled(VmapBeforeMoE(), (_x(),), options={"inductor": False, "verify": verify}) == {
        "rewritten": 1}
