"""gpt-oss under dynamic=True: Dynamo makes the experts' float attributes (swiglu limit and alpha) graph inputs
(``specialize_float`` False, torch's default). The rewrite takes them at their values in the compile, bakes those
into the operator's activation and guards the graph on them: the region is rewritten, and a model whose limit or
alpha changes is compiled again with the new values instead of computing with the old ones."""
import pytest
import torch
import torch._dynamo.config

import moeblaze_fx
from moeblaze_fx.bench.models import build_model


@pytest.fixture
def gpt_oss():
    model = build_model("gpt_oss", layers=1, tiny=True)
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    return model, tokens


def _check(compiled, model, tokens):
    torch.testing.assert_close(compiled(input_ids=tokens).logits, model(input_ids=tokens).logits,
                               rtol=1e-4, atol=1e-5)
    (record,) = moeblaze_fx.last_report()
    return record


def test_traced_activation_constants_are_taken_at_their_values_and_guarded(gpt_oss):
    model, tokens = gpt_oss
    experts = model.model.layers[0].mlp.experts
    with torch._dynamo.config.patch(specialize_float=False):  # (torch's default)
        compiled = torch.compile(model, backend="moeblaze", dynamic=True)
        record = _check(compiled, model, tokens)
        assert record.status == "rewritten", record.reason
        assert record.layout.endswith(f"activation swiglu_oai(alpha={experts.alpha},limit={experts.limit})")
        assert record.check.endswith("; the traced float inputs it reads taken at their values (the graph is "
                                     "guarded on them)")
        experts.limit = 3.0  # clamps that bite at small pre-activations: the old limit would compute other values
        record = _check(compiled, model, tokens)
        assert record.status == "rewritten" and record.layout.endswith(f"alpha={experts.alpha},limit=3.0)")
        experts.alpha = 1.25
        record = _check(compiled, model, tokens)
        assert record.status == "rewritten" and record.layout.endswith("alpha=1.25,limit=3.0)")


def test_specialized_floats_under_dynamic_shapes_are_rewritten(gpt_oss):
    model, tokens = gpt_oss
    with torch._dynamo.config.patch(specialize_float=True):
        record = _check(torch.compile(model, backend="moeblaze", dynamic=True), model, tokens)
    assert record.status == "rewritten"
    assert record.check.startswith("numerical:") and "traced float" not in record.check
    assert "swiglu_oai" in record.layout


def test_traced_floats_and_their_values():
    """The floats a region reads as graph values, in graph order, and each one's value in the compile: none for a
    data-dependent one (an unbacked ``SymFloat``, a tensor's ``.item()``), which cannot be baked in (extract then names
    it in its reason)."""
    import types

    import torch.fx as fx
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moeblaze_fx.passes.extract import float_hint, traced_floats

    env = ShapeEnv()
    graph = fx.Graph()
    limit, unknown, x = graph.placeholder("limit"), graph.placeholder("unknown"), graph.placeholder("x")
    limit.meta["example_value"] = env.create_symfloatnode(env.create_symbol(7.0, source=ConstantSource("limit")),
                                                          hint=7.0)
    unknown.meta["example_value"] = env.create_unbacked_symfloat()
    x.meta["example_value"] = torch.zeros(4)
    clamp = graph.call_function(torch.clamp, (x,), {"min": unknown, "max": limit})
    region = types.SimpleNamespace(nodes=[clamp])
    assert traced_floats(region) == (unknown, limit)
    assert float_hint(limit) == 7.0 and float_hint(unknown) is None and float_hint(x) is None
