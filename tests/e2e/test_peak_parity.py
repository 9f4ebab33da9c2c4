"""What moeblaze's compiled step shares with Inductor's outside the MoE regions (docs/memory.md, "What is left above
Inductor's peak"): the same Dynamo graphs (no graph break of its own) and the same tensors saved for the LM head's
loss. On the H100 the peaks of GLM-4.5-Air and OLMoE differed; these are the causes ruled out, kept from coming
back. Tiny causal LMs of the model benchmark, bf16 (the loss upcasts the logits to float32), a vocabulary large
enough that a logits-sized save cannot hide among the others."""
import pytest
import torch
from torch._dynamo.utils import counters

from moeblaze_fx.bench.models import build_model

VOCAB, TOKENS = 2048, 32


def _step(family: str, backend: str):
    """(graphs compiled, graph breaks, regions rewritten, (shape, dtype) of every saved tensor with the
    vocabulary as its last dimension) of one compiled forward + loss + backward."""
    model = build_model(family, layers=2, tiny=True, dtype=torch.bfloat16, overrides={"vocab_size": VOCAB})
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    kwargs = {"backend": "moeblaze"} if backend == "moeblaze" else {}
    compiled = torch.compile(model, **kwargs)
    counters.clear()
    saved = []

    def pack(t):
        if t.dim() and t.shape[-1] == VOCAB:
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    return (int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values()),
            counters["moeblaze"]["rewritten"], sorted(saved, key=str))


@pytest.mark.parametrize("family", ["glm4_moe", "olmoe"])
def test_same_graphs_and_loss_saves_as_inductor(family):
    graphs, breaks, rewritten, saved = _step(family, "inductor")
    assert (graphs, breaks, rewritten) == (1, 0, 0)
    # the bf16 logits (saved once, the forward's output too); the float32 upcast is recomputed in backward
    assert saved == [((1, TOKENS, VOCAB), torch.bfloat16)]
    torch._dynamo.reset()
    assert _step(family, "moeblaze") == (1, 0, 2, saved)
