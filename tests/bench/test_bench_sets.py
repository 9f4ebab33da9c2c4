"""``moeblaze bench``'s named shape sets (SonicMoE's grid, the operator alone), the forward/backward split, the host
enqueue time and the tile-quantization waste, on the CPU at tiny sizes."""
import argparse
import time

import pytest
import torch

from moeblaze_fx.bench import cli, layer, timing
from moeblaze_fx.bench.layer import LayerConfig, Provider
from moeblaze_fx.ops import plan_block_m

CPU = torch.device("cpu")


def test_the_sonic_set_is_sonicmoes_grid():
    # SonicMoE's H100 grid (issue 42), in its order: (T, d) per model size, three (h, E, K) each.
    assert [(name, c.shape) for name, c in layer.SONIC_CONFIGS.items()] == [
        ("sonic-1.4b-256", (40960, 768, 256, 128, 8)),
        ("sonic-1.4b-512", (40960, 768, 512, 64, 4)),
        ("sonic-1.4b-1024", (40960, 768, 1024, 32, 2)),
        ("sonic-7b-256", (24576, 1536, 256, 128, 8)),
        ("sonic-7b-512", (24576, 1536, 512, 64, 4)),
        ("sonic-7b-1024", (24576, 1536, 1024, 32, 2)),
        ("sonic-30b-256", (32768, 4096, 256, 256, 16)),
        ("sonic-30b-512", (32768, 4096, 512, 128, 8)),
        ("sonic-30b-1024", (32768, 4096, 1024, 64, 4)),
        ("sonic-120b-512", (32768, 4096, 512, 256, 16)),
        ("sonic-120b-1024", (32768, 4096, 1024, 128, 8)),
        ("sonic-120b-2048", (32768, 4096, 2048, 64, 4)),
    ]
    assert all(c.name == name and c.group == "sonic" for name, c in layer.SONIC_CONFIGS.items())
    # Within a model size the FLOPs are the same: T*K*h is fixed while the experts get finer.
    for size in ("1.4b", "7b", "30b", "120b"):
        flops = {layer.layer_flops(c) for n, c in layer.SONIC_CONFIGS.items() if n.split("-")[1] == size}
        assert len(flops) == 1, size


def test_the_operator_set():
    assert [c.shape for c in layer.OPERATOR_CONFIGS.values()] == [
        (8192, 1024, 512, 64, 8), (4096, 2048, 768, 128, 8), (8192, 2048, 768, 128, 8),
        (16384, 2048, 768, 128, 8), (4096, 2880, 2880, 32, 4), (4096, 4096, 14336, 8, 2),
    ]
    assert all(c.group == "operator" for c in layer.OPERATOR_CONFIGS.values())
    assert set(layer.CONFIG_SETS) == {"sonic", "operator"}


def test_parse_configs_expands_sets_and_names():
    sonic = list(layer.SONIC_CONFIGS.values())
    assert layer.parse_configs("sonic") == sonic
    assert layer.parse_configs("SONIC") == sonic
    assert layer.parse_configs("operator") == list(layer.OPERATOR_CONFIGS.values())
    assert layer.parse_configs("a, sonic-7b-256,B") == [layer.CONFIGS["A"], layer.SONIC_CONFIGS["sonic-7b-256"],
                                                        layer.CONFIGS["B"]]
    # A shape named on its own and inside its set runs once, where it first appears.
    assert layer.parse_configs("sonic-7b-1024,sonic") == [layer.SONIC_CONFIGS["sonic-7b-1024"]] + [
        c for c in sonic if c.name != "sonic-7b-1024"]
    assert layer.parse_configs("none") == [] and layer.parse_configs("") == []
    assert layer.parse_config("op-mixtral-8x7b-4k") is layer.OPERATOR_CONFIGS["op-mixtral-8x7b-4k"]
    with pytest.raises(ValueError, match="unknown configuration 'sonic-7b-333'.*sonic-7b-256"):
        layer.parse_configs("sonic-7b-333")


def test_cli_configs_take_a_set_and_reject_an_unknown_name(capsys):
    parser = argparse.ArgumentParser()
    cli.add_bench_args(parser)
    (configs,) = [a for a in parser._actions if "--configs" in a.option_strings]
    assert "'sonic':" in configs.help and "sonic-120b-2048" in configs.help and "'operator':" in configs.help
    args = parser.parse_args(["--configs", "sonik", "--device", "cpu", "--no-progress"])
    assert cli.run_bench(args) == 2
    err = capsys.readouterr().err
    assert "unknown configuration 'sonik'" in err and "sonic, operator" in err


def test_published_reference_only_where_sonicmoe_published():
    pub = {n: layer.published_reference(c) for n, c in layer.SONIC_CONFIGS.items()}
    assert {n: p["tflops"] for n, p in pub.items() if p and p["tflops"] is not None} == {
        "sonic-7b-256": 389.0, "sonic-7b-1024": 465.0, "sonic-30b-256": 447.0, "sonic-30b-1024": 552.0,
        "sonic-120b-2048": 588.0}
    assert pub["sonic-7b-512"]["activation_gib"] == 0.60 and pub["sonic-30b-512"]["activation_gib"] == 2.45
    assert all(pub[n] is None for n in pub if n.startswith("sonic-1.4b"))
    assert all("published, not measured here" in p["source"] for p in pub.values() if p)
    # A shape of another size under the same name is not SonicMoE's shape: no reference for it.
    assert layer.published_reference(LayerConfig("sonic-7b-256", 8, 8, 8, 4, 2, group="sonic")) is None
    assert layer.published_reference(layer.OPERATOR_CONFIGS["op-qwen3-30b-4k"]) is None


def test_tile_rows_on_a_hand_made_routing():
    # E = 3, block_m = 4; id 3 means "no expert". Counts: expert 0 -> 5, expert 1 -> 2, expert 2 -> 0.
    ids = torch.tensor([[0, 1], [0, 3], [0, 1], [0, 0]])
    real, padded = layer.tile_rows(ids, 3, 4)
    assert (real.item(), padded.item()) == (7, 8 + 4 + 0)
    assert real.device == ids.device and real.dtype == torch.int64
    assert layer.tile_quantization(ids, 3, 4) == {"block_m": 4, "real_rows": 7, "padded_rows": 12}
    # One-row tiles pad nothing; one tile as tall as every row pads each non-empty expert to it.
    assert layer.tile_quantization(ids, 3, 1)["padded_rows"] == 7
    assert layer.tile_quantization(ids.to(torch.int32), 3, 64)["padded_rows"] == 128
    # Exact multiples of block_m: no waste.
    assert layer.tile_quantization(torch.tensor([[0, 1]] * 4), 2, 2)["padded_rows"] == 8
    with pytest.raises(ValueError, match="block_m"):
        layer.tile_rows(ids, 3, 0)


def test_split_step_times_times_forward_and_backward_apart():
    calls = []

    def forward(i):
        calls.append(("fwd", i))
        time.sleep(0.02)
        return i

    def backward(state):
        calls.append(("bwd", state))
        time.sleep(0.004)

    total, fwd, bwd = layer.split_step_times(forward, backward, CPU, warmup=1, reps=3)
    # The backward gets its own step's forward result; warm-up first, untimed.
    assert calls == [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2), ("bwd", 2), ("fwd", 3), ("bwd", 3)]
    assert len(total) == len(fwd) == len(bwd) == 3
    assert all(f >= 20.0 for f in fwd) and all(b >= 4.0 for b in bwd)
    assert all(t == pytest.approx(f + b) for t, f, b in zip(total, fwd, bwd))


def test_host_enqueue_ms_times_each_step():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.003)

    times = timing.host_enqueue_ms(step, CPU, 4)
    assert len(calls) == 4 and len(times) == 4
    assert all(t >= 3.0 for t in times)
    with pytest.raises(ValueError, match="reps"):
        timing.host_enqueue_ms(step, CPU, 0)


def test_a_set_shape_gets_the_sonic_table_and_its_routings_waste():
    # A tiny stand-in for a SonicMoE shape (the real ones are GPU-sized): its rows carry the set, the split times and
    # the waste of its own routing, and the markdown adds SonicMoE's table for them.
    cfg = LayerConfig("sonic-tiny", 37, 16, 24, 5, 2, "tiny", group="sonic")
    table = {"loop": layer.PROVIDERS["loop"], "moeblaze-activations": layer.PROVIDERS["moeblaze-activations"]}
    result = layer.run_layer_bench([cfg, LayerConfig("plain", 12, 8, 16, 3, 3)], list(table), device="cpu",
                                   dtype=torch.float32, warmup=1, reps=2, progress=False, check=False,
                                   provider_table=table)
    rows = result.rows
    assert [(r["config"], r["provider"], r["set"]) for r in rows] == [
        ("sonic-tiny", "loop", "sonic"), ("sonic-tiny", "moeblaze-activations", "sonic"),
        ("plain", "loop", None), ("plain", "moeblaze-activations", None)]
    inputs = layer.make_inputs(cfg, CPU, torch.float32, 0)
    ids, _ = layer.route(inputs.pool[0][0], inputs.w_router, cfg.K)
    bm = plan_block_m(CPU, dtype=torch.float32)  # the plan the operator builds for this run
    counts = torch.bincount(ids.reshape(-1), minlength=cfg.E).tolist()
    expected = sum(-(-c // bm) * bm for c in counts)
    for r in rows[:2]:
        assert (r["block_m"], r["real_rows"], r["padded_rows"]) == (bm, 74, expected)
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["host_ms"] is None
    md = result.to_markdown()
    assert "### SonicMoE's grid" in md
    sonic = md[md.index("### SonicMoE's grid"):].splitlines()
    header = next(i for i, ln in enumerate(sonic) if ln.startswith("| config (h, E, K) |"))
    body = sonic[header + 2:header + 4]
    assert body[0].startswith("| sonic-tiny (24, 5, 2) | loop | ")
    assert body[1].startswith("|  | moeblaze-activations | ")
    assert f"| {expected:,} / 74 (+{100 * (expected - 74) / 74:.1f}%) |" in body[0]
    assert "plain" not in "\n".join(sonic[header:])


def test_sonic_table_shows_the_published_figures_labelled():
    meta = {"device": "d", "torch": "t", "date": "x", "commit": "c", "dtype": "bfloat16", "dense_gemm": {}}
    fields = dict(ms=6.0, fwd_ms=2.0, bwd_ms=4.0, tflops=300.0, fwd_tflops=250.0, bwd_tflops=320.0,
                  saved_bytes=int(0.5 * 2 ** 30), host_ms=1.0, block_m=128, real_rows=196608, padded_rows=204800)
    rows = [layer._row(layer.SONIC_CONFIGS["sonic-7b-256"], "moeblaze-activations", "configs", **fields),
            layer._row(layer.SONIC_CONFIGS["sonic-7b-256"], "hf-grouped-mm-compiled", "configs", **fields),
            layer._row(layer.SONIC_CONFIGS["sonic-7b-512"], "moeblaze-activations", "configs", **fields),
            layer._row(layer.SONIC_CONFIGS["sonic-1.4b-256"], "moeblaze-activations", "configs",
                       status="out of memory")]
    md = layer.BenchResult(meta, rows).to_markdown()
    assert "| config (h, E, K) | provider | fwd ms | bwd ms | TFLOP/s fwd / bwd / total | saved GiB | " \
           "padded / real rows | SonicMoE (published, not measured here) |" in md
    assert ("| sonic-7b-256 (256, 128, 8) | moeblaze-activations | 2.00 | 4.00 | 250 / 320 / 300 | 0.50 | "
            "204,800 / 196,608 (+4.2%) | ≈389 TFLOP/s, ≈0.60 GiB |") in md
    assert "|  | hf-grouped-mm-compiled | 2.00 | 4.00 | 250 / 320 / 300 | 0.50 |  |  |" in md
    assert "| sonic-7b-512 (512, 64, 4) | moeblaze-activations | 2.00 | 4.00 | 250 / 320 / 300 | 0.50 | " \
           "204,800 / 196,608 (+4.2%) | ≈0.60 GiB |" in md
    assert "| sonic-1.4b-256 (256, 128, 8) | moeblaze-activations | out of memory | - | - | - | - |  |" in md
    # The main table has the split and the host column.
    assert "| sonic-7b-256 24576, 1536, 256, 128, 8 | moeblaze-activations | 6.00 | 2.00 + 4.00 | 1.00 | 300.0 |" in md
