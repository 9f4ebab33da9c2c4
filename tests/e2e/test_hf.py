"""Hugging Face transformers >= 5 MoE models, built from tiny configs with random weights (no hub).

Each model family under each experts implementation: one rewrite per MoE layer, exact counters, and
the loss and every parameter's gradient equal to eager.
"""
import expecttest
import pytest
import torch
import transformers
from helpers import rewritten_graph, run_eager_and_compiled
from torch._dynamo.utils import counters

import moeblaze_fx

LAYERS = 2
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def build(family: str, impl: str, dtype: torch.dtype, top_k: int = 2):
    """``top_k`` applies to qwen3_moe, whose top-1 weights are the router's probabilities (Mixtral renormalizes
    them to 1, so its router gets no gradient at top-1)."""
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=24, intermediate_size=64, num_experts=8,
                                          num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=top_k > 1, head_dim=8)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=8, num_experts_per_tok=2)
        cls = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(dtype)
    model.set_experts_implementation(impl)
    return model


def _tokens():
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize(
    "impl,dtype",
    [
        ("grouped_mm", torch.float32),  # the graph holds transformers::grouped_mm_fallback
        ("grouped_mm", torch.bfloat16),  # the graph holds torch._grouped_mm
        ("batched_mm", torch.float32),  # a gather of expert weights and torch.bmm
    ],
    ids=["grouped_mm-fp32", "grouped_mm-bf16", "batched_mm-fp32"],
)
def test_causal_lm_one_rewrite_per_layer(family, impl, dtype):
    model = build(family, impl, dtype)
    tokens = _tokens()
    got = run_eager_and_compiled(model, (tokens,), loss=None, dtype=dtype,
                                 options={"inductor": False})
    assert got == {"rewritten": LAYERS}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"] * LAYERS


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_inference_under_no_grad_is_rewritten(impl):
    """A graph traced under torch.no_grad (an evaluation loop) never runs a backward: the proof compares the forward
    only (the region's gradients are not recorded there), and the operator does not write A|B."""
    model = build("mixtral", impl, torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        counters.clear()
        got = torch.compile(model, backend="moeblaze", options={"inductor": False})(tokens).logits
    assert dict(counters["moeblaze"]) == {"rewritten": LAYERS}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    records = moeblaze_fx.last_report()
    assert [r.policy for r in records] == ["recompute"] * LAYERS
    # nothing is saved for a backward in either graph (the report said 28.8 KB -> 2.1 KB, measured with gradients on)
    assert [(r.saved_bytes_before, r.saved_bytes_after) for r in records] == [(0, 0)] * LAYERS
    assert all(r.check.startswith("numerical: forward (traced without gradients) within rel. error") for r in records)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_top1_one_rewrite_per_layer(impl):
    """Top-1: under batched_mm a token's expert output is [T, d] before its routing weight is applied, so the
    region must run on to the weighting (it ended before it, and was skipped for reading no weights)."""
    model = build("qwen3_moe", impl, torch.float32, top_k=1)
    got = run_eager_and_compiled(model, (_tokens(),))
    assert got == {"rewritten": LAYERS}
    assert [r.K for r in moeblaze_fx.last_report()] == [1] * LAYERS


def build_deepseek_v4(impl: str, limit: float, **overrides) -> torch.nn.Module:
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4")
    cfg = transformers.DeepseekV4Config(**COMMON | dict(num_key_value_heads=1), head_dim=16, q_lora_rank=16,
                                        o_lora_rank=16, o_groups=2, moe_intermediate_size=24, n_routed_experts=8,
                                        num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["moe"] * LAYERS,
                                        index_n_heads=2, index_head_dim=8, index_topk=8, sliding_window=8,
                                        swiglu_limit=limit, num_nextn_predict_layers=0, **overrides)
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg).float()
    model.set_experts_implementation(impl)
    return model


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_deepseek_v4_clamped_swiglu_is_rewritten(impl):
    """DeepSeek-V4's experts compute silu(gate.clamp(max=L)) * up.clamp(-L, L): rewritten as swiglu_clamp with the
    model's limit. Limit 0.05 here, where the pre-activations of the random model (std ~0.1) pass it, so the step's
    loss and gradients cross the clamps. Tolerance 5e-4: the mHC head's gradients are ill-conditioned, eager float32
    itself is 1.3e-4 off float64 on model.hc_head.hc_base (CPU, 2026-11-26)."""
    model = build_deepseek_v4(impl, 0.05)
    assert run_eager_and_compiled(model, (_tokens(),), tol=5e-4) == {"rewritten": LAYERS}
    assert [r.layout.rsplit("; ", 1)[1] for r in moeblaze_fx.last_report()] == [
        "activation swiglu_clamp(limit=0.05)"] * LAYERS


# Tiny configs of the families whose blocks need more than COMMON (test_mixed_precision builds them too): the config
# class name in transformers, its keyword arguments, the causal-LM class name.
_FAMILY_CONFIGS = {
    "nemotron_h": ("NemotronHConfig", dict(COMMON | dict(num_hidden_layers=3), layer_types=["full_attention", "moe", "moe"],
                   head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                   moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1, mamba_num_heads=4,
                   mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8, use_mamba_kernels=False),
                   "NemotronHForCausalLM"),
    "gemma4": ("Gemma4TextConfig", dict(COMMON, head_dim=8, global_head_dim=8, enable_moe_block=True, num_experts=8,
               top_k_experts=2, moe_intermediate_size=24, intermediate_size=48, vocab_size_per_layer_input=64,
               hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
               "Gemma4ForCausalLM"),
    "inkling2": ("Inkling2TextConfig", dict(COMMON | dict(num_key_value_heads=4), unpadded_vocab_size=64, head_dim=8,
                 sliding_window_size=8, layer_types=["hybrid_sliding"] * LAYERS, moe_intermediate_size=24,
                 n_routed_experts=8, num_experts_per_tok=2, mlp_gate_softcap=0.05, mlp_up_softcap=0.08),
                 "Inkling2ForCausalLM"),
    "inkling": ("InklingTextConfig", dict(COMMON | dict(num_key_value_heads=4), head_dim=8, moe_intermediate_size=24,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1), "InklingForCausalLM"),
    "zaya": ("ZayaConfig", dict(COMMON, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=1,
             router_hidden_size=16), "ZayaForCausalLM"),
    "phimoe": ("PhimoeConfig", dict(COMMON, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2),
               "PhimoeForCausalLM"),
}


def build_family(family: str, impl: str) -> torch.nn.Module:
    """The float32 tiny causal LM of one of :data:`_FAMILY_CONFIGS`, experts through ``impl``; skipped where this
    transformers has no such family."""
    config_name, kwargs, model_name = _FAMILY_CONFIGS[family]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    cfg = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).float()
    model.set_experts_implementation(impl)
    return model


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_nemotron_h_squared_relu_is_rewritten(impl):
    """Nemotron-H's experts are plain (up and down, no gate) with the squared ReLU: rewritten as relu2."""
    model = build_family("nemotron_h", impl)
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": 2}
    assert [r.layout.rsplit("; ", 1)[1] for r in moeblaze_fx.last_report()] == ["activation relu2"] * 2


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gemma4_tanh_geglu_is_rewritten(impl):
    """Gemma 4's experts compute gelu_pytorch_tanh(gate) * up: rewritten as geglu_tanh (left alone before it
    existed, as no activation accounted for the tanh GELU)."""
    model = build_family("gemma4", impl)
    assert model.config.hidden_activation == "gelu_pytorch_tanh"
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": LAYERS}
    assert [r.layout.rsplit("; ", 1)[1] for r in moeblaze_fx.last_report()] == ["activation geglu_tanh"] * LAYERS


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_inkling2_softcapped_swiglu_is_rewritten(impl):
    """Inkling 2's experts compute softcap(gate, 4) * sigmoid(gate) * softcap(up, 25): rewritten as swiglu_softcap
    with the model's caps. Caps 0.05 and 0.08 here, about the random model's pre-activations (std ~0.1), so the
    soft-caps bend and a cap read wrongly (or on the wrong side) shows."""
    model = build_family("inkling2", impl)
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": LAYERS}
    assert [r.layout.rsplit("; ", 1)[1] for r in moeblaze_fx.last_report()] == [
        "activation swiglu_softcap(gate=0.05,up=0.08)"] * LAYERS


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_inkling_routed_experts_are_rewritten_beside_jointly_normalized_shared_experts(impl):
    """Inkling's router normalizes the routed experts' gathered logits together with the shared experts' logits,
    so the shared experts' gammas are computed from the ids too: the routed experts are rewritten, the shared
    experts stay in the graph."""
    model = build_family("inkling", impl)
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": LAYERS}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_phimoe_sparsemixer_picks_are_rewritten(impl, training):
    """PhiMoE's sparsemixer has no top-k: it picks each of its two experts with a maximum of its own (in training,
    of Gumbel-perturbed scores, the second with the first masked out) and puts the two picks side by side. Those ids
    anchor the region (left alone before: no candidate). Seeded alike, eager and compiled sample the same experts."""
    model = build_family("phimoe", impl).train(training)
    assert model.config.router_jitter_noise > 0  # the sampling's threshold, the checkpoint's default
    assert run_eager_and_compiled(model, (_tokens(),), seed=3) == {"rewritten": LAYERS}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"] * LAYERS


@pytest.mark.parametrize("tokens", [14, 32], ids=["T!=d", "T=d"])
def test_zaya_top1_weights_computed_in_the_region(tokens):
    """ZAYA (top-1) gathers its weights by id and zeroes those of its skip expert inside the region. With T = d = 32
    the region once ran on past the combine into the residual scaling, whose [d] bias passed for the [T] routing
    weights, and was left alone."""
    model = build_family("zaya", "grouped_mm")
    ids = torch.randint(0, 64, (2, tokens // 2), generator=torch.Generator().manual_seed(1))
    assert run_eager_and_compiled(model, (ids,)) == {"rewritten": LAYERS}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"] * LAYERS


def _jetmoe() -> torch.nn.Module:
    if not hasattr(transformers, "JetMoeConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no JetMoE")
    cfg = transformers.JetMoeConfig(**COMMON, kv_channels=8, intermediate_size=24, num_local_experts=8,
                                    num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.JetMoeForCausalLM(cfg).float()


def test_jetmoe_split_at_its_counts_is_reported_with_the_dynamo_fix():
    """JetMoE's experts (its own loop, no experts implementation to choose) split the sorted rows by
    ``counts.tolist()``: Dynamo breaks there, and the report gives Dynamo's fix, not ``experts_implementation``."""
    before = len(moeblaze_fx.report.all_reports())
    got = run_eager_and_compiled(_jetmoe(), (_tokens(),), fullgraph=False)
    assert got == {"skipped": 1}  # one router graph serves both layers
    (record,) = [r for graph in moeblaze_fx.report.all_reports()[before:] for r in graph if r.status == "skipped"]
    assert record.reason.startswith("Dynamo split this MoE block at transformers/models/jetmoe/modeling_jetmoe.py:")
    assert "Set torch._dynamo.config.capture_scalar_outputs = True" in record.reason
    assert "experts_implementation" not in record.reason


@pytest.mark.parametrize("how", ["capture_scalar_outputs", "fullgraph"])
def test_jetmoe_with_its_counts_in_the_graph_is_rewritten(how):
    """The fix the report gives: with the counts kept as unbacked sizes the block is one sort + split + index_add
    loop, rewritten in both layers."""
    with torch._dynamo.config.patch(capture_scalar_outputs=how == "capture_scalar_outputs"):
        got = run_eager_and_compiled(_jetmoe(), (_tokens(),), fullgraph=how == "fullgraph")
    assert got == {"rewritten": LAYERS}
    assert [r.idiom for r in moeblaze_fx.last_report()] == ["per-expert loop [sort+split+index_add]"] * LAYERS


def test_llama4_weights_on_the_tokens_are_rewritten():
    """Llama 4 runs every expert on every token scaled by its router score, sigmoid(top value) for the chosen expert
    and 0 for the others: rewritten as the operator on the weighted tokens, the top-1 expert's only."""
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    cfg = transformers.Llama4TextConfig(**COMMON, head_dim=8, intermediate_size=24, intermediate_size_mlp=64,
                                        num_local_experts=8, num_experts_per_tok=1, attention_chunk_size=16,
                                        interleave_moe_layer_step=1)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(cfg).float()
    assert run_eager_and_compiled(model, (_tokens(),)) == {"rewritten": LAYERS}
    assert [r.layout.split("; ", 1)[1] for r in moeblaze_fx.last_report()] == [
        "sigmoid(w), weights on the tokens; activation swiglu"] * LAYERS


def test_mixtral_through_inductor_recompute():
    model = build("mixtral", "grouped_mm", torch.float32)
    got = run_eager_and_compiled(model, (_tokens(),), options={"checkpoint": "recompute"})
    assert got == {"rewritten": LAYERS}


class TestGolden(expecttest.TestCase):
    def _block_graph(self, impl, dtype):
        block = build("mixtral", impl, dtype).model.layers[0].mlp
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        return rewritten_graph(block, x)

    def test_grouped_mm_fallback_fp32(self):
        self.assertExpectedInline(self._block_graph("grouped_mm", torch.float32), """\
l_hidden_states = input
gate.weight = input
experts.gate_up_proj = input
experts.down_proj = input
hidden_states = .view(l_hidden_states, -1, 32)
hidden_states_1 = .reshape(hidden_states, -1, 32)
router_logits = torch.linear(hidden_states_1, gate.weight)
float_1 = .float(router_logits)
router_probs = torch.softmax(float_1, dim=-1)
topk = torch.topk(router_probs, 2, dim=-1)
router_top_value = operator.getitem(topk, 0)
router_indices = operator.getitem(topk, 1)
sum_1 = .sum(router_top_value, dim=-1, keepdim=True)
router_top_value_1_functional = operator.truediv(router_top_value, sum_1)
sample_weights = .reshape(router_top_value_1_functional, -1)
reshape = torch.reshape(sample_weights, (-1, 2))
moe_ffn_default = moeblaze.moe_ffn.default(hidden_states, router_indices, reshape, [experts.gate_up_proj, experts.down_proj], [4, 0, 1, 0, 3072, 32, 1, 48, 32, 0, 1, 1536, 3072, 32, 1, 48, 32, 1, 1, 0, 1536, 48, 1, 32, 48, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 1864135)
getitem = operator.getitem(moe_ffn_default, 0)
hidden_states_2 = .to(getitem, torch.float32)
hidden_states_3 = .reshape(hidden_states_2, 2, 5, 32)
return (hidden_states_3,)""")

    def test_grouped_mm_bf16(self):
        self.assertExpectedInline(self._block_graph("grouped_mm", torch.bfloat16), """\
l_hidden_states = input
gate.weight = input
experts.gate_up_proj = input
experts.down_proj = input
hidden_states = .view(l_hidden_states, -1, 32)
hidden_states_1 = .reshape(hidden_states, -1, 32)
router_logits = torch.linear(hidden_states_1, gate.weight)
float_1 = .float(router_logits)
router_probs = torch.softmax(float_1, dim=-1)
topk = torch.topk(router_probs, 2, dim=-1)
router_top_value = operator.getitem(topk, 0)
router_indices = operator.getitem(topk, 1)
sum_1 = .sum(router_top_value, dim=-1, keepdim=True)
router_top_value_1_functional = operator.truediv(router_top_value, sum_1)
sample_weights = .reshape(router_top_value_1_functional, -1)
reshape = torch.reshape(sample_weights, (-1, 2))
moe_ffn_default = moeblaze.moe_ffn.default(hidden_states, router_indices, reshape, [experts.gate_up_proj, experts.down_proj], [4, 0, 1, 0, 3072, 32, 1, 48, 32, 0, 1, 1536, 3072, 32, 1, 48, 32, 1, 1, 0, 1536, 48, 1, 32, 48, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 3728270)
getitem = operator.getitem(moe_ffn_default, 0)
to_2 = .to(getitem, torch.float32)
hidden_states_2 = .to(to_2, torch.bfloat16)
hidden_states_3 = .reshape(hidden_states_2, 2, 5, 32)
return (hidden_states_3,)""")

    def test_batched_mm(self):
        self.assertExpectedInline(self._block_graph("batched_mm", torch.float32), """\
l_hidden_states = input
gate.weight = input
experts.gate_up_proj = input
experts.down_proj = input
hidden_states = .view(l_hidden_states, -1, 32)
hidden_states_1 = .reshape(hidden_states, -1, 32)
router_logits = torch.linear(hidden_states_1, gate.weight)
float_1 = .float(router_logits)
router_probs = torch.softmax(float_1, dim=-1)
topk = torch.topk(router_probs, 2, dim=-1)
router_top_value = operator.getitem(topk, 0)
router_indices = operator.getitem(topk, 1)
sum_1 = .sum(router_top_value, dim=-1, keepdim=True)
router_top_value_1_functional = operator.truediv(router_top_value, sum_1)
sample_weights = .reshape(router_top_value_1_functional, -1)
unsqueeze_2 = .unsqueeze(sample_weights, -1)
reshape = torch.reshape(unsqueeze_2, (-1, 2))
moe_ffn_default = moeblaze.moe_ffn.default(hidden_states, router_indices, reshape, [experts.gate_up_proj, experts.down_proj], [4, 0, 1, 0, 3072, 32, 1, 48, 32, 0, 1, 1536, 3072, 32, 1, 48, 32, 1, 1, 0, 1536, 48, 1, 32, 48, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 1864135)
getitem = operator.getitem(moe_ffn_default, 0)
hidden_states_2 = .to(getitem, torch.float32)
hidden_states_3 = .reshape(hidden_states_2, 2, 5, 32)
return (hidden_states_3,)""")


class WithLosses(torch.nn.Module):
    """A training forward: the language-model loss and the router's load-balancing loss, which takes its own top-k
    of every layer's router probabilities and counts it with one_hot."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        out = self.model(tokens, labels=tokens)
        return out.logits, out.loss, out.aux_loss


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_load_balancing_loss_is_not_a_candidate(family):
    """output_router_logits=True: every MoE layer rewritten, the loss's top-k neither rewritten nor reported, and
    the logits, both losses and every gradient equal to eager."""
    model = build(family, "grouped_mm", torch.float32)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.02
    assert run_eager_and_compiled(WithLosses(model), (_tokens(),)) == {"rewritten": LAYERS}
    assert [r.status for r in moeblaze_fx.last_report()] == ["rewritten"] * LAYERS


def test_dynamic_token_count_one_compile(tmp_path):
    """dynamic=True: T is symbolic, one compile serves every sequence length (Inductor's restart of
    the frame does not double-count), and the JSON report holds that one graph."""
    model = build("mixtral", "grouped_mm", torch.float32)
    path = tmp_path / "report.json"
    compiled = torch.compile(model, backend="moeblaze", dynamic=True, options={"report": str(path)})
    from torch._dynamo.utils import counters

    counters.clear()
    for seq in (5, 9, 13):
        tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seq))
        torch.testing.assert_close(compiled(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-5)
    assert dict(counters["moeblaze"]) == {"rewritten": LAYERS}
    import json

    (graph,) = json.loads(path.read_text())
    assert [r["status"] for r in graph["regions"]] == ["rewritten"] * LAYERS
    assert all("s" in r["T"] for r in graph["regions"])  # a symbolic token count


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["activations", "recompute"])
def test_mixtral_bf16_training_step_on_cuda(checkpoint):
    """One compiled training step of a tiny bf16 Mixtral on the GPU (Inductor, the operator's CUDA
    path) equals eager within bf16 tolerance: loss and every gradient."""
    model = build("mixtral", "grouped_mm", torch.bfloat16).cuda()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2)).cuda()
    got = run_eager_and_compiled(model, (tokens,), dtype=torch.bfloat16, options={"checkpoint": checkpoint})
    assert got == {"rewritten": LAYERS}


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_top1_bf16_training_step_on_cuda(impl):
    """Top-1 (K = 1) reaches the operator's CUDA kernels: a compiled bf16 step equals eager."""
    model = build("qwen3_moe", impl, torch.bfloat16, top_k=1).cuda()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2)).cuda()
    got = run_eager_and_compiled(model, (tokens,), dtype=torch.bfloat16, options={})
    assert got == {"rewritten": LAYERS}


def test_graph_break_in_the_block_is_reported():
    """experts_implementation="eager" loops over a data-dependent tensor: Dynamo splits each MoE block.
    Compilation still succeeds with eager results, and each split block is reported with the fix."""
    model = build("mixtral", "eager", torch.float32)
    got = run_eager_and_compiled(model, (_tokens(),), fullgraph=False)
    # one compiled router graph serves every layer (same code, parameters as inputs): one record
    assert got == {"skipped": 1}
    records = [r for graph in moeblaze_fx.report.all_reports() for r in graph][-1:]
    for record in records:
        assert "transformers/models/mixtral/modeling_mixtral.py:" in record.source
        assert record.reason.startswith("Dynamo split this MoE block")
        assert "experts_implementation='grouped_mm'" in record.reason
