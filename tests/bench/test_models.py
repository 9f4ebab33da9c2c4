"""``moeblaze bench models`` at tiny sizes on the CPU.

The moeblaze rows here compile with ``{"inductor": False}``: a whole Hugging Face model under Inductor takes minutes
to compile on a small CPU, and what these tests check (every MoE block found and rewritten, the loss unchanged, the
harness's bookkeeping) does not depend on Inductor. The product path compiles with Inductor (the default options).
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from moeblaze_fx.bench import cli, models
from moeblaze_fx.bench.models import FAMILIES, NO_EXPERTS, ModelsBenchResult

NO_INDUCTOR = {"inductor": False}

# (family, expert count attribute, value at the published block sizes, top-k)
REAL_SIZES = [
    ("qwen3_moe", "num_experts", 128, 8),
    ("deepseek_v3", "n_routed_experts", 256, 8),
    ("mixtral", "num_local_experts", 8, 2),
    ("gpt_oss", "num_local_experts", 32, 4),
    ("olmoe", "num_experts", 64, 8),
    ("glm4_moe", "n_routed_experts", 128, 8),
    ("qwen2_moe", "num_experts", 60, 4),
    ("llama4", "num_local_experts", 16, 1),
    ("phimoe", "num_local_experts", 16, 2),
]


def test_every_family_is_listed():
    assert list(FAMILIES) == [f for f, *_ in REAL_SIZES]


@pytest.mark.parametrize("family, experts_key, experts, top_k", REAL_SIZES, ids=[f for f, *_ in REAL_SIZES])
def test_real_config_has_the_checkpoint_block_sizes(family, experts_key, experts, top_k):
    config = models.build_config(family, layers=2)  # the config only: no weights are allocated
    assert config.num_hidden_layers == 2
    assert getattr(config, experts_key) == experts
    assert config.num_experts_per_tok == top_k
    assert config.hidden_size == FAMILIES[family].real["hidden_size"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_builds_and_steps_at_tiny_size(family):
    model = models.build_model(family, layers=2, tiny=True)
    blocks = models.experts_modules(model)
    assert [name for name, _ in blocks] == ["model.layers.0.mlp.experts" if family not in ("llama4",) else
                                            "model.layers.0.feed_forward.experts",
                                            "model.layers.1.mlp.experts" if family not in ("llama4",) else
                                            "model.layers.1.feed_forward.experts"]
    # grouped_mm experts where the family has a choice (Llama 4's experts are one bmm over every expert)
    expected_impl = "eager" if family == "llama4" else "grouped_mm"
    assert getattr(model.config, "_experts_implementation", None) == expected_impl
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for _, experts in blocks:
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.parameters())


# gpt-oss: biases and the clamped SwiGLU; deepseek_v3: group-limited routing and a shared expert beside the region;
# phimoe: ids from two sampled top-1 picks.
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "phimoe"])
def test_every_moe_block_is_rewritten(family):
    result = models.run_models_bench([family], [64], layers=2, seq=32, tiny=True, providers=("eager", "moeblaze"),
                                     device="cpu", warmup=1, reps=2, moeblaze_options=NO_INDUCTOR, progress=False)
    eager, moeblaze = result.rows
    assert [r["provider"] for r in result.rows] == ["eager", "moeblaze"]
    assert eager["status"] == moeblaze["status"] == "ok", result.rows
    assert (moeblaze["regions"], moeblaze["regions_rewritten"], moeblaze["moe_blocks"]) == ({"rewritten": 2}, 2, 2)
    assert moeblaze["graphs"] == 1  # the whole model in one graph
    assert eager["regions"] is None and eager["loss_rel_diff"] == 0.0
    assert moeblaze["loss_rel_diff"] < 1e-5
    assert (moeblaze["batch"], moeblaze["seq"], moeblaze["tokens"]) == (2, 32, 64)
    assert moeblaze["steps_timed"] == 2 and len(moeblaze["step_times_ms"]) == 2
    assert moeblaze["first_step_s"] > 0 and moeblaze["ms"] > 0
    assert moeblaze["peak_bytes"] is None and moeblaze["host_ms"] is None  # CUDA only
    assert result.meta["families"][family]["moe_blocks"] == 2


def test_autocast_trains_float32_weights_in_bf16_and_rewrites_every_block(monkeypatch):
    """``autocast=True``: the model's weights stay float32 and each step's forward runs under torch.autocast(bf16)
    (mixed-precision training); every block is still rewritten."""
    seen = []
    step = models._step
    monkeypatch.setattr(models, "_step", lambda fn, model, ids, seed, autocast=None: seen.append(
        (autocast, {p.dtype for p in model.parameters()})) or step(fn, model, ids, seed, autocast))
    result = models.run_models_bench(["olmoe"], [64], layers=2, seq=32, tiny=True, providers=("eager", "moeblaze"),
                                     device="cpu", autocast=True, warmup=1, reps=1, moeblaze_options=NO_INDUCTOR,
                                     progress=False)
    eager, moeblaze = result.rows
    assert eager["status"] == moeblaze["status"] == "ok", result.rows
    assert (moeblaze["regions"], moeblaze["regions_rewritten"]) == ({"rewritten": 2}, 2)
    assert moeblaze["loss_rel_diff"] < 2e-2  # bf16 against bf16, in another order
    assert set(map(str, seen)) == {str((torch.bfloat16, {torch.float32}))}
    assert (result.meta["dtype"], result.meta["autocast"]) == ("float32", "bfloat16")
    assert "dtype float32, under torch.autocast(bfloat16); torch's float32 matmul precision ieee." in \
        result.to_markdown()
    with pytest.raises(ValueError, match="autocast computes in bf16 or fp16"):
        models.run_models_bench(["olmoe"], [64], tiny=True, device="cpu", dtype=torch.float32, autocast=True)


def test_fsdp_style_compiles_each_layer_and_puts_the_model_back():
    model = models.build_model("olmoe", layers=2, tiny=True)
    layers = list(model.model.layers)
    fn, undo = models._compiled(model, "moeblaze", True, NO_INDUCTOR)
    assert fn is model
    assert all(type(l).__name__ == "OptimizedModule" for l in model.model.layers)
    undo()
    assert list(model.model.layers) == layers

    result = models.run_models_bench(["olmoe"], [64], layers=2, seq=32, tiny=True, providers=("eager", "moeblaze"),
                                     fsdp_style=True, device="cpu", warmup=1, reps=1, moeblaze_options=NO_INDUCTOR,
                                     progress=False)
    moeblaze = result.rows[1]
    assert moeblaze["status"] == "ok", moeblaze
    # The two layers have one structure and their parameters are graph inputs: Dynamo compiles the first layer's
    # graph (one region rewritten) and runs it for the second.
    assert (moeblaze["regions"], moeblaze["graphs"], moeblaze["moe_blocks"]) == ({"rewritten": 1}, 1, 2)
    assert moeblaze["loss_rel_diff"] < 1e-5
    assert "each decoder layer compiled on its own" in result.to_markdown()


def test_a_block_left_alone_says_why_in_its_row(monkeypatch):
    # DeepSeek-V3's second block was left to Inductor on an H100 (its proof ran out of memory), and the row said only
    # "1/2": the reason belongs in the row.
    from moeblaze_fx.passes import pipeline
    from moeblaze_fx.passes.prove import Proof

    monkeypatch.setattr(pipeline, "prove", lambda *a: Proof(None, reason="internal error while proving: test"))
    result = models.run_models_bench(["mixtral"], [32], layers=1, seq=16, tiny=True, providers=("moeblaze",),
                                     device="cpu", warmup=1, reps=1, moeblaze_options=NO_INDUCTOR, progress=False)
    row, = result.rows
    assert (row["status"], row["regions"], row["regions_rewritten"]) == ("ok", {"skipped": 1}, 0)
    assert row["note"] == "skipped: internal error while proving: test"
    assert "| 0/1 (1 graph) | - | skipped: internal error while proving: test |" in result.to_markdown()


def test_no_experts_stand_in_keeps_the_router_in_the_step():
    model = models.build_model("qwen3_moe", layers=1, tiny=True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    full = model(input_ids=ids, labels=ids).loss
    (name, experts), = models.experts_modules(model)
    restore = models._swap_experts(model)
    assert models.experts_modules(model) == []
    model.zero_grad(set_to_none=True)
    ablated = model(input_ids=ids, labels=ids).loss
    ablated.backward()
    assert not torch.equal(full, ablated)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router still gets a gradient
    assert all(p.grad is None for p in experts.parameters())
    restore()
    assert models.experts_modules(model) == [(name, experts)]


def _row(provider, ms, **kw):
    return models._row("qwen3_moe", 4096, 2, 2048, provider, ms=ms, step_times_ms=[ms, ms], steps_timed=2,
                       ms_spread=0.0, wide_spread=False, first_step_s=1.0, moe_blocks=2, **kw)


def test_moe_share_and_markdown():
    meta = {"device": "GPU", "torch": "t", "date": "d", "commit": "c", "dtype": "bfloat16", "layers": 2,
            "tiny": False, "fsdp_style": False, "timer": "CUDA events", "peak": "peak", "families": {}}
    rows = [_row("eager", 20.0, loss_rel_diff=0.0), _row("inductor", 10.0, loss_rel_diff=0.0),
            _row("moeblaze", 8.0, regions={"rewritten": 2}, regions_rewritten=2, graphs=1, loss_rel_diff=1e-6),
            _row(NO_EXPERTS, 6.0)]
    result = ModelsBenchResult(meta, rows)
    assert result.moe_share("qwen3_moe", 4096) == pytest.approx(0.4)
    assert result.moe_share("qwen3_moe", 8192) is None
    md = result.to_markdown()
    assert "| qwen3_moe (2, 4096 = 2 x 2048) | eager | 20.00 (n=2) | - | 0.50 |" in md
    assert "|  | moeblaze | 8.00 (n=2) | - | 1.25 | - | 1.0 | 2/2 (1 graph) | 1.0e-06 |" in md
    assert "the expert computation takes 40% of Inductor's step; if it took no time the step would be 1.67x" in md
    assert json.loads(result.to_json())["rows"][2]["regions"] == {"rewritten": 2}


def test_cli_bench_models(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_bench_args(sub.add_parser("bench"))
    args = parser.parse_args(["bench", "models", "--tiny", "--families", "mixtral", "--providers", "eager,moeblaze",
                              "--layers", "1", "--tokens", "32", "--seq", "16", "--device", "cpu", "--warmup", "1",
                              "--reps", "1", "--moeblaze-options", '{"inductor": false}',
                              "--override", "mixtral.num_local_experts=4", "--out", str(tmp_path)])
    assert cli.run_bench(args) == 0
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "models.json").read_text())
    assert [(r["family"], r["provider"], r["status"], r["regions_rewritten"]) for r in data["rows"]] == [
        ("mixtral", "eager", "ok", None), ("mixtral", "moeblaze", "ok", 1)]
    assert data["meta"]["families"]["mixtral"]["config"]["num_local_experts"] == 4
    assert data["meta"]["moeblaze_options"] == {"inductor": False}
    assert (tmp_path / "models.md").read_text() in captured.out
    assert "moeblaze bench models" in captured.err  # the progress bar
    # the layer benchmark is still `moeblaze bench` without a subcommand
    layer_args = parser.parse_args(["bench", "--configs", "none", "--device", "cpu"])
    assert layer_args.bench_what is None


@pytest.mark.parametrize("argv, message", [
    (["--families", "qwen9"], "unknown model families ['qwen9']"),
    (["--tokens", "64,abc"], "--tokens: expected comma-separated integers"),
    (["--tokens", "48", "--seq", "32"], "not a multiple of the sequence length 32"),
    (["--override", "n_routed_experts"], "expected [family.]key=value"),
    (["--override", "qwen9.num_experts=4"], "unknown family 'qwen9'"),
    (["--moeblaze-options", "{bad"], "--moeblaze-options: not JSON"),
    (["--providers", "eager,tensorrt"], "unknown providers ['tensorrt']"),
])
def test_cli_bench_models_rejects_bad_arguments(argv, message, capsys):
    parser = argparse.ArgumentParser()
    cli.add_models_args(parser)
    args = parser.parse_args(["--tiny", "--device", "cpu", "--no-progress", *argv])
    args.bench_what = "models"
    assert cli.run_bench(args) == 2
    assert message in capsys.readouterr().err
