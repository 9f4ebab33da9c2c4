"""MoE blocks under activation checkpointing: Dynamo keeps code run by torch.utils.checkpoint (Hugging Face's
gradient checkpointing, reentrant or not) as a tag_activation_checkpoint call of a subgraph, and the passes rewrite
inside it. The checkpoint stays: the operator runs inside the body and is recomputed in backward with the rest."""
import pytest
import torch
import torch.nn.functional as F
from helpers import run_eager_and_compiled
from test_hf import LAYERS, _tokens, build
from test_loop import ModuleListMoE, _x
from torch.utils.checkpoint import checkpoint

import moeblaze_fx
from moeblaze_fx.report import format_table


def _checkpointed_hf(family: str, use_reentrant: bool):
    model = build(family, "grouped_mm", torch.float32)
    model.config.use_cache = False  # else a warning about the cache breaks the graph
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    return model


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_gradient_checkpointing_rewrites_every_layer(family, use_reentrant):
    model = _checkpointed_hf(family, use_reentrant)
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": LAYERS}
    records = moeblaze_fx.last_report()
    assert [r.status for r in records] == ["rewritten"] * LAYERS
    assert all(r.idiom.endswith(", inside torch.utils.checkpoint") for r in records)
    assert all(f"transformers/models/{family}/modeling_{family}.py:" in r.source for r in records), [
        r.source for r in records]


def test_hf_gradient_checkpointing_through_inductor():
    model = _checkpointed_hf("mixtral", use_reentrant=False)
    assert run_eager_and_compiled(model, (_tokens(),), options={"checkpoint": "recompute"}) == {"rewritten": LAYERS}


class CheckpointedBlocks(torch.nn.Module):
    """Two MoE blocks: the first run under torch.utils.checkpoint, the second as is."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ModuleListMoE() for _ in range(2))

    def forward(self, x):
        x = x + checkpoint(self.blocks[0], x, use_reentrant=False)
        return x + self.blocks[1](x)


def test_checkpointed_and_plain_blocks_reported_in_order():
    torch.manual_seed(0)
    assert run_eager_and_compiled(CheckpointedBlocks(), (_x(),)) == {"rewritten": 2}
    records = moeblaze_fx.last_report()
    assert [r.idiom.endswith("inside torch.utils.checkpoint") for r in records] == [True, False]
    table = format_table(records).splitlines()
    assert table[0] == "moeblaze: 2 of 2 MoE candidate(s) rewritten"
    assert table[1].endswith(", inside torch.utils.checkpoint") and not table[4].endswith("checkpoint")


def test_the_callers_graph_is_left_as_it_was():
    """The body is rewritten in a copy: the graph Dynamo handed the backend still calls the original body."""
    from moeblaze_fx.backend import rewrite_graph

    seen = []

    def capture(gm, example_inputs):
        before = {name: m.code for name, m in gm.named_children()}
        new = rewrite_graph(gm, example_inputs, {"inductor": False})
        seen.append((before, {name: m.code for name, m in gm.named_children()},
                     {name: m.code for name, m in new.named_children()}))
        return new.forward

    torch.manual_seed(0)
    model = CheckpointedBlocks()
    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True)(_x())
    ((before, after, new),) = seen
    assert before == after
    assert [("moeblaze.moe_ffn" in code) for code in new.values()] == [True] * len(new)
    assert [("moeblaze.moe_ffn" in code) for code in before.values()] == [False] * len(before)


class RoutingOutside(ModuleListMoE):
    """The router outside the checkpoint, the experts inside it."""

    def experts_of(self, x, w, ids):
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.K, dim=-1)
        return checkpoint(self.experts_of, x, w, ids, use_reentrant=False)


def test_routing_outside_the_checkpoint_is_reported():
    torch.manual_seed(0)
    assert run_eager_and_compiled(RoutingOutside(), (torch.randn(10, 16, requires_grad=True),)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason == (
        "the ids go into torch.utils.checkpoint's function, where they are routed to the experts: the routing and the "
        "experts must be in one graph to be rewritten. Checkpoint the router with the experts, or take the experts "
        "out of the checkpoint and use options={'checkpoint': 'recompute'}")
    assert "test_checkpoint.py:" in record.source


def _balance(ids, probs):
    return (F.one_hot(ids, 4).float().mean((0, 1)) * probs.mean(0)).sum() * 4


class AuxInCheckpoint(ModuleListMoE):
    """Router and experts outside any checkpoint; only a load-balancing loss reads the ids in one."""

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, self.K, dim=-1)
        aux = checkpoint(_balance, ids, probs, use_reentrant=False)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e in range(self.E):
            k, tok = torch.where(mask[e])
            out = out.index_add(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out, aux


class PoolsInCheckpoint(torch.nn.Module):
    """A top-k that is no MoE (pooling) whose indices go into a checkpointed scatter."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        v, idx = self.proj(x).topk(4, dim=-1)
        return checkpoint(lambda v, i: torch.zeros(x.shape).scatter(-1, i, v), v, idx, use_reentrant=False)


def test_ids_read_in_a_checkpoint_beside_the_experts():
    torch.manual_seed(0)
    assert run_eager_and_compiled(AuxInCheckpoint(), (torch.randn(10, 16, requires_grad=True),)) == {"rewritten": 1}
    torch.manual_seed(0)
    assert run_eager_and_compiled(PoolsInCheckpoint(), (torch.randn(10, 16, requires_grad=True),)) == {}
    assert moeblaze_fx.last_report() == []


@torch._dynamo.config.patch(install_free_tensors=True)
def test_parameters_held_as_attributes_reach_the_body():
    """With install_free_tensors, Dynamo holds free modules' parameters as get_attr nodes of the outer graph: the
    body's placeholders bound to them are the experts' parameters, with the outer graph's names."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(ModuleListMoE() for _ in range(2))

    def f(x):
        for b in blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x

    x = _x().detach()
    want = f(x)
    torch._dynamo.reset()
    got = torch.compile(f, backend="moeblaze", fullgraph=True, options={"inductor": False})(x)
    torch.testing.assert_close(got, want)
    records = moeblaze_fx.last_report()
    assert [r.status for r in records] == ["rewritten"] * 2
    # named as Dynamo names the attributes (as outside a checkpoint)
    assert [r.layout.split(",")[0] for r in records] == [f"gate = L__blocks___{i}_experts_*_w1_weight" for i in range(2)]


class DropoutInCheckpoint(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ModuleListMoE() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(lambda z, b=b: F.dropout(b(F.dropout(z, 0.3)), 0.2), x, use_reentrant=False)
        return x


@pytest.mark.parametrize("options", [{"inductor": False}, {}], ids=["fx", "inductor"])
def test_dropout_in_the_checkpoint_recomputed_with_the_same_masks(options):
    """Backward recomputes the body with the forward's random masks: without Inductor too, where the graph runs
    through AOTAutograd (plain FX draws new masks in the recompute)."""
    torch.manual_seed(0)
    model = DropoutInCheckpoint()
    compiled = torch.compile(model, backend="moeblaze", fullgraph=True, options=options)

    def step(fn):
        model.zero_grad()
        torch.manual_seed(5)
        x = _x().requires_grad_()
        out = fn(x)
        out.sum().backward()
        return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        got = step(compiled)
    for a, b in zip(got, step(model)):
        torch.testing.assert_close(a, b)
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"] * 2


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["activations", "recompute"])
def test_hf_gradient_checkpointing_bf16_training_step_on_cuda(policy):
    """Hugging Face gradient checkpointing, bf16 on the GPU through Inductor (the operator's Triton path inside the
    checkpointed body): the loss and every gradient equal eager within bf16 tolerance."""
    model = _checkpointed_hf("mixtral", use_reentrant=False).to(torch.bfloat16).cuda()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2)).cuda()
    got = run_eager_and_compiled(model, (tokens,), dtype=torch.bfloat16, options={"checkpoint": policy})
    assert got == {"rewritten": LAYERS}
    assert all(r.idiom.endswith(", inside torch.utils.checkpoint") for r in moeblaze_fx.last_report())
