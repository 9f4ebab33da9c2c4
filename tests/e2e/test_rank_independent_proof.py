"""A region's compile-time decision is rank-independent (issue 40): the proof draws its random tokens, ids, combine
weights and output gradient from a local generator seeded with a constant, so two ranks compiling the same graph
decide alike whatever their global seeds, and a compile leaves the user's random stream where it was.

Dynamo restores the global generator's state around a frame's compile, so a draw from it inside the backend would
not show after ``torch.compile`` returns: these tests look from inside the backend, around the rewrite itself.
"""
import pytest
import torch
from test_mixed_precision import LoopMoE, TitanMoE, _autocast, _x
from torch._dynamo.utils import counters

import moeblaze_fx.passes.pipeline as pipeline
from moeblaze_fx.backend import rewrite_graph


def _compile_recording(model, x, dtype):
    """Compile ``model`` with a backend that runs moeblaze's rewrite and records the global CPU generator's state
    just before and just after it, and every proof the pipeline returns. Returns (states, proofs)."""
    states, proofs = [], []
    prove = pipeline.prove

    def recording_prove(*args, **kwargs):
        proof = prove(*args, **kwargs)
        proofs.append(proof)
        return proof

    def backend(gm, example_inputs):
        before = torch.get_rng_state()
        new = rewrite_graph(gm, example_inputs, {"inductor": False})
        states.append((before, torch.get_rng_state()))
        return new.forward

    torch._dynamo.reset()
    counters.clear()
    pipeline.prove = recording_prove
    try:
        with _autocast(dtype):
            torch.compile(model, backend=backend, fullgraph=True)(x)
    finally:
        pipeline.prove = prove
    return states, proofs


@pytest.mark.parametrize("block,dtype", [("loop", None), ("loop", torch.bfloat16), ("titan", None)],
                         ids=["loop-fp32", "loop-autocast-bf16", "titan-casts"])
def test_compile_leaves_the_global_random_stream_alone(block, dtype):
    torch.manual_seed(0)
    model = LoopMoE() if block == "loop" else TitanMoE()
    torch.manual_seed(1234)
    states, proofs = _compile_recording(model, _x(), dtype)
    assert dict(counters["moeblaze"]) == {"rewritten": 1}
    assert len(proofs) == 1 and proofs[0].layout is not None
    (before, after), = states
    assert torch.equal(before, after), "the rewrite moved the global CPU generator"


@pytest.mark.parametrize("block", ["loop-autocast-bf16", "titan-casts"])
def test_decision_is_the_same_under_any_global_seed(block):
    """Two "ranks" with different global seeds (a data-parallel run seeds each rank's dropout differently) compile
    the same model: the proofs measure the same errors to the last bit, and so decide alike. bf16 regions: their
    errors depend on the drawn inputs (a float32 region here agrees with the operator exactly, whatever is drawn)."""
    torch.manual_seed(0)
    model, dtype = (LoopMoE(), torch.bfloat16) if block == "loop-autocast-bf16" else (TitanMoE(), None)
    seen = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        _, proofs = _compile_recording(model, _x(), dtype)
        assert dict(counters["moeblaze"]) == {"rewritten": 1}
        (proof,) = proofs
        seen.append((proof.layout, proof.activation, proof.forward_error, proof.gradient_errors))
    # drawn from the global generator, these errors would differ between the seeds
    assert seen[0][2] > 0 and seen[0][3] and min(seen[0][3].values()) > 0, seen[0]
    assert seen[0] == seen[1]
