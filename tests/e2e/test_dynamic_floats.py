"""gpt-oss under dynamic=True: Dynamo makes the experts' float attributes (swiglu limit and alpha) graph inputs, whose
values the rewrite cannot take as the operator's constants. The region is left to Inductor with a reason that names
the fix, and with that fix (``specialize_float``) it is rewritten."""
import torch
import torch._dynamo.config

import moeblaze_fx
from moeblaze_fx.bench.models import build_model


def _compile_once():
    model = build_model("gpt_oss", layers=1, tiny=True)
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="moeblaze", dynamic=True)
    torch.testing.assert_close(compiled(input_ids=tokens).logits, model(input_ids=tokens).logits,
                               rtol=1e-4, atol=1e-5)
    return moeblaze_fx.last_report()


def test_traced_activation_constants_are_named_in_the_reason():
    with torch._dynamo.config.patch(specialize_float=False):  # (torch 2.13's default)
        (record,) = _compile_once()
    assert record.status == "skipped"
    assert record.reason.startswith("the experts' activation takes traced float inputs (")
    assert "torch._dynamo.config.specialize_float = True" in record.reason


def test_specialized_floats_under_dynamic_shapes_are_rewritten():
    with torch._dynamo.config.patch(specialize_float=True):
        (record,) = _compile_once()
    assert record.status == "rewritten"
    assert "swiglu_oai" in record.layout
