"""``moeblaze bench`` / ``moeblaze compare`` logic on the CPU at tiny sizes, in float32.

Inductor compiles are the slow part on a small CPU: the compiled providers run on two tiny shapes in one
test, and ``compare`` on a one-layer, three-expert model.
"""
import argparse
import json
import math

import pytest
import torch

from moeblaze_fx import ops
from moeblaze_fx.bench import cli, layer
from moeblaze_fx.bench.compare import compare, default_loss
from moeblaze_fx.bench.layer import LayerConfig, Provider

CPU = torch.device("cpu")
GRADS = {"out", "dx", "dw_router", "dw_gate_up", "dw_down"}


def _bench(configs, providers=None, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("warmup", 1)
    kw.setdefault("reps", 1)
    kw.setdefault("progress", False)
    return layer.run_layer_bench(configs, providers, **kw)


# Shapes: T = 37 is not a power of two and leaves some of the 5 experts with few tokens; K = E = 3
# sends every token to every expert; T = 1 is a single token (most experts empty).
TINY = [
    LayerConfig("ragged", 37, 16, 24, 5, 2),
    LayerConfig("k_eq_e", 12, 8, 16, 3, 3),
    LayerConfig("one_token", 1, 8, 8, 4, 2),
]


CUDA_ONLY = {"liger", "moeblaze-graphs", "hf-grouped-mm-graphs"}


@pytest.fixture(scope="module")
def all_providers():
    return _bench(TINY)


def test_every_provider_agrees_with_the_reference(all_providers):
    rows = all_providers.rows
    runnable = [p for p in layer.PROVIDERS if p not in CUDA_ONLY]
    assert [(r["config"], r["provider"]) for r in rows] == [(c.name, p) for c in TINY for p in runnable]
    for r in rows:
        assert r["status"] == "ok", r
        assert set(r["rel_err"]) == GRADS
        # float32 against the float32 reference: only summation order differs.
        assert r["max_rel_err"] < 1e-5, r
        assert r["max_rel_err"] == max(r["rel_err"].values())
    assert "CUDA only" in all_providers.meta["skipped"]["liger"]
    assert all_providers.meta["skipped"]["moeblaze-graphs"] == "CUDA graphs need a CUDA device"
    assert set(all_providers.meta["skipped"]) == CUDA_ONLY


def test_hf_provider_says_it_uses_the_fallback_on_cpu(all_providers):
    notes = {r["provider"]: r["note"] for r in all_providers.rows}
    assert "per-expert matmul fallback" in notes["hf-grouped-mm"]
    assert "per-expert matmul fallback" in notes["hf-grouped-mm-compiled"]
    assert "torch.compile" in notes["hf-grouped-mm-compiled"]


@pytest.mark.parametrize("triton,gluon,note", [
    (False, False, "plain-PyTorch path"), (True, False, "Triton kernels"),
    (True, True, "Triton and sm_90 Gluon kernels")])
def test_moeblaze_provider_names_its_kernels(monkeypatch, triton, gluon, note):
    """The row's note says which kernels run: the sm_90 Gluon kernels where the device and Triton take them."""
    from moeblaze_fx.kernels.sm90 import common as sm90

    monkeypatch.setattr(ops, "_use_triton", lambda t: triton)
    monkeypatch.setattr(sm90, "takes", lambda t: gluon)
    cpu = torch.device("cpu")
    assert layer.PROVIDERS["moeblaze-activations"].build(cpu, torch.float32)[1] == note
    assert layer.PROVIDERS["moeblaze-lowmem"].build(cpu, torch.float32)[1] == f"{note}, transient_budget 128 MiB"


def test_hf_grouped_mm_path_with_torch_grouped_mm():
    # The bench takes torch._grouped_mm on CUDA only; where this torch runs it on the CPU, check the same
    # data flow (offsets, transposed expert weights, an expert with no rows) against the reference here.
    ok, why = layer._grouped_mm_probe(CPU, torch.float32, allow_cpu=True)
    if not ok:
        pytest.skip(why)
    configs = [LayerConfig("dense", 29, 16, 8, 6, 2),
               LayerConfig("sparse", 5, 16, 8, 16, 2)]  # 10 pairs over 16 experts: at least 6 empty groups
    table = {"grouped": Provider("grouped", "torch._grouped_mm", lambda d, t: (layer._hf_grouped_layer(True), ""))}
    rows = _bench(configs, provider_table=table).rows
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert all(r["max_rel_err"] < 1e-5 for r in rows), rows


def test_every_shape_compiles_afresh_with_static_shapes():
    # A compiled provider's later shapes must not run Dynamo's dynamic-shape recompile of the first one: each
    # configuration starts from a reset Dynamo, so each graph it compiles has static sizes.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
                      + [t for t in example_inputs if isinstance(t, torch.SymInt)])
        return gm.forward

    def build(device, dtype):
        return torch.compile(layer.loop_layer, backend=backend), ""

    table = {"compiled": Provider("compiled", "loop layer, recording backend", build)}
    rows = _bench([LayerConfig("first", 12, 8, 6, 3, 2), LayerConfig("second", 20, 8, 6, 3, 2),
                   LayerConfig("third", 28, 8, 6, 3, 2)], provider_table=table, check=False).rows
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"], rows
    assert graphs, "the recording backend never ran"
    dynamic = [g for g in graphs if any(isinstance(v, torch.SymInt) or any(isinstance(n, torch.SymInt) for n in v)
                                        for v in g)]
    assert not dynamic, dynamic
    assert {12, 20, 28} <= {v[0] for g in graphs for v in g if isinstance(v, tuple) and v}


def test_a_wrong_provider_shows_in_the_error_column():
    # Experts with gate and up swapped: silu(up) * gate. The check must catch it.
    def swapped(x, w_router, w_gate_up, w_down, K):
        h = w_gate_up.shape[1] // 2
        return layer.loop_layer(x, w_router, torch.cat([w_gate_up[:, h:], w_gate_up[:, :h]], dim=1), w_down, K)

    table = {"swapped": Provider("swapped", "gate/up swapped", lambda device, dtype: (swapped, ""))}
    (row,) = _bench([TINY[0]], provider_table=table).rows
    assert row["status"] == "ok"
    assert row["rel_err"]["out"] > 0.1
    assert row["rel_err"]["dw_router"] > 0.1


def test_layers_and_reference_take_the_activation():
    """benchmarks/act_device.py times the layer with DeepSeek-V4's clamped SwiGLU: the MoEBlaze and HF layers and
    the reference compute that activation (limit 0.5: most pre-activations are clamped), and SwiGLU measured against
    its reference shows as an error."""
    cfg = TINY[0]
    inputs = layer.make_inputs(cfg, CPU, torch.float32, 0)
    ids, _ = layer.route(inputs.pool[0][0], inputs.w_router, cfg.K)
    act = "swiglu_clamp(limit=0.5)"
    ref = layer.compute_reference(inputs, ids, cfg.T, act)
    assert ref.activation == act
    for fn in (layer._moeblaze_layer("activations", activation=act), layer._hf_grouped_layer(False, activation=act)):
        fields, status = layer._run_one(fn, cfg, inputs, ref, CPU, 1, 1, 0.0)
        assert status == "ok" and fields["max_rel_err"] < 1e-5, fields
    fields, _ = layer._run_one(layer._moeblaze_layer("activations"), cfg, inputs, ref, CPU, 1, 1, 0.0)
    assert fields["rel_err"]["out"] > 0.1


def test_saved_bytes_differ_by_exactly_the_preactivations(all_providers):
    # The two policies save the same things except A|B: [T*K, 2h] in the layer's dtype.
    by = {(r["config"], r["provider"]): r["saved_bytes"] for r in all_providers.rows}
    for c in TINY:
        diff = by[(c.name, "moeblaze-activations")] - by[(c.name, "moeblaze-recompute")]
        assert diff == c.T * c.K * 2 * c.h * 4
        assert by[(c.name, "moeblaze-recompute")] < by[(c.name, "loop")]


def test_saved_activation_bytes_counts_distinct_storages_without_parameters():
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)

    def forward():
        y = x @ w  # saves x and w
        return y.sin() * y.sin()  # saves y (twice, one storage) and sin(y) (two storages)

    # x (96 B) + y (120 B) + two sin(y) results (120 B each); w excluded.
    assert layer.saved_activation_bytes(forward, [w]) == 96 + 120 + 2 * 120
    assert layer.saved_activation_bytes(forward, []) == 96 + 80 + 120 + 2 * 120


def test_rel_error():
    ref = torch.tensor([3.0, 4.0])
    assert layer.rel_error(ref.clone(), ref) == 0.0
    assert layer.rel_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert layer.rel_error(torch.ones(5), torch.zeros(5)) == math.inf
    # Chunked sums give the same answer.
    a, b = torch.randn(1000), torch.randn(1000)
    assert layer.rel_error(a, b, chunk_elems=7) == pytest.approx(layer.rel_error(a, b), rel=1e-12)


def _oom_above(limit):
    def build(device, dtype):
        def layer_fn(x, w_router, w_gate_up, w_down, K):
            if x.shape[0] > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
            return layer.loop_layer(x, w_router, w_gate_up, w_down, K)

        return layer_fn, ""

    return build


def test_out_of_memory_row_and_the_sweep_stops_for_that_provider(monkeypatch):
    monkeypatch.setitem(layer.PROVIDERS, "loop", Provider("loop", "loop that runs out of memory", _oom_above(16)))
    result = _bench([LayerConfig("big", 32, 8, 16, 4, 2)], ["loop", "moeblaze-recompute"],
                    sweep=layer.sweep_tokens(8, 64), sweep_shape=(8, 16, 4, 2))
    rows = {(r["section"], r["T"], r["provider"]): r for r in result.rows}
    assert rows[("configs", 32, "loop")]["status"] == "out of memory"
    assert rows[("configs", 32, "loop")]["ms"] is None
    assert rows[("configs", 32, "moeblaze-recompute")]["status"] == "ok"
    sweep_loop = [T for (s, T, p) in rows if s == "sweep" and p == "loop"]
    assert sweep_loop == [8, 16, 32]  # 32 is the out-of-memory row; 64 is not tried
    assert rows[("sweep", 32, "loop")]["status"] == "out of memory"
    assert [T for (s, T, p) in rows if s == "sweep" and p == "moeblaze-recompute"] == [8, 16, 32, 64]
    md = result.to_markdown()
    assert "| sweep-T32 32, 8, 16, 4, 2 | loop | out of memory | - |" in md
    assert "| 64 | " in md and "| 32 | out of memory |" in md


def test_other_errors_are_reported_not_raised(monkeypatch):
    def build(device, dtype):
        def broken(*args):
            raise ValueError("boom")

        return broken, ""

    table = {"broken": Provider("broken", "broken", build)}
    (row,) = _bench([TINY[1]], provider_table=table).rows
    assert row["status"] == "error"
    assert "ValueError: boom" in row["note"]


def test_json_schema(all_providers):
    data = json.loads(all_providers.to_json())
    assert set(data) == {"meta", "rows", "dispatch"}
    meta = data["meta"]
    for key, kind in {"device": str, "torch": str, "date": str, "commit": str, "dtype": str, "timer": str,
                      "warmup": int, "reps": int, "dense_gemm": dict, "providers": dict, "skipped": dict}.items():
        assert isinstance(meta[key], kind), key
    assert meta["dtype"] == "float32"
    assert "wall clock" in meta["timer"]
    assert meta["dense_gemm"]["tflops"] > 0
    assert data["dispatch"]["status"] == "skipped"
    assert meta["fwd_flops"] == "6*T*K*d*h" and meta["bwd_flops"] == "12*T*K*d*h"
    assert "CUDA only" in meta["host"]
    int_keys = ("T", "d", "h", "E", "K", "saved_bytes", "block_m", "real_rows", "padded_rows")
    float_keys = ("ms", "tflops", "frac_dense_gemm", "max_rel_err", "first_step_s", "fwd_ms", "bwd_ms", "fwd_tflops",
                  "bwd_tflops")
    for r in data["rows"]:
        assert set(r) == {"section", "config", "T", "d", "h", "E", "K", "provider", "status", "ms", "steps_timed",
                          "ms_spread", "wide_spread", "tflops", "frac_dense_gemm", "fwd_ms", "bwd_ms", "fwd_tflops",
                          "bwd_tflops", "host_ms", "saved_bytes", "peak_bytes", "max_rel_err", "rel_err",
                          "first_step_s", "set", "block_m", "real_rows", "padded_rows", "published", "note"}
        assert r["steps_timed"] == meta["reps"] and isinstance(r["wide_spread"], bool)
        assert all(isinstance(r[k], int) for k in int_keys)
        assert all(isinstance(r[k], float) and r[k] >= 0 for k in float_keys)
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0  # each half of the step took time
        assert r["fwd_tflops"] == pytest.approx(6 * r["T"] * r["K"] * r["d"] * r["h"] / r["fwd_ms"] / 1e9)
        assert r["bwd_tflops"] == pytest.approx(12 * r["T"] * r["K"] * r["d"] * r["h"] / r["bwd_ms"] / 1e9)
        assert r["peak_bytes"] is None and r["host_ms"] is None  # CPU: no peak, no host column
        assert r["set"] is None and r["published"] is None  # TINY's shapes belong to no named set
        # Every (token, choice) goes to an expert; the plan's tiles cover them in whole block_m-row tiles.
        assert r["block_m"] == ops.plan_block_m(CPU)
        assert r["real_rows"] == r["T"] * r["K"]
        assert r["padded_rows"] % r["block_m"] == 0
        assert r["real_rows"] <= r["padded_rows"] <= r["real_rows"] + r["E"] * (r["block_m"] - 1)
        assert r["tflops"] == pytest.approx(18 * r["T"] * r["K"] * r["d"] * r["h"] / r["ms"] / 1e9)
        assert r["frac_dense_gemm"] == pytest.approx(r["tflops"] / meta["dense_gemm"]["tflops"])
        assert all(isinstance(v, float) for v in r["rel_err"].values())


def test_markdown_table(all_providers):
    md = all_providers.to_markdown()
    lines = md.splitlines()
    assert lines[0].startswith("Device: CPU")
    header = ("| config (T, d, h, E, K) | provider | ms | fwd + bwd ms | host ms | TFLOP/s | % dense GEMM | saved MB | "
              "peak MB | max rel err | note |")
    assert header in lines
    table = lines[lines.index(header) + 2:]
    body = [ln for ln in table[: table.index("")]]
    assert len(body) == len(all_providers.rows)
    assert body[0].startswith("| ragged 37, 16, 24, 5, 2 | moeblaze-activations | ")
    assert body[1].startswith("|  | moeblaze-recompute | ")  # the config cell is not repeated
    for line, row in zip(body, all_providers.rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 11
        assert cells[2].endswith("*") is row["wide_spread"]  # a wide spread of the timed steps is marked
        assert float(cells[2].rstrip("*")) == pytest.approx(row["ms"], abs=0.005, rel=0.05)  # two decimals
        fwd, bwd = (float(v) for v in cells[3].split(" + "))
        assert (fwd, bwd) == (pytest.approx(row["fwd_ms"], abs=0.005, rel=0.05),
                              pytest.approx(row["bwd_ms"], abs=0.005, rel=0.05))
        assert cells[4] == "-"  # no host column on the CPU
        assert cells[8] == "-"  # no peak memory on the CPU
        assert float(cells[9]) == pytest.approx(row["max_rel_err"], rel=0.06)
    assert "host ms: CUDA only" in md
    assert "### SonicMoE's grid" not in md  # no shape of the sonic set ran
    assert ("Skipped providers: moeblaze-graphs: CUDA graphs need a CUDA device; hf-grouped-mm-graphs: CUDA graphs "
            "need a CUDA device; liger: Liger's fused MoE runs Triton kernels on CUDA only.") in md


def test_config_parsing_and_sweep():
    assert layer.parse_config("b") is layer.CONFIGS["B"]
    c = layer.parse_config("64, 32, 48, 4, 2")
    assert c.shape == (64, 32, 48, 4, 2) and c.name == "T64_d32_h48_E4_K2"
    with pytest.raises(ValueError, match="T,d,h,E,K"):
        layer.parse_config("1,2,3")
    with pytest.raises(ValueError, match="at least K experts"):
        layer.parse_config("8,8,8,2,3")
    assert layer.sweep_tokens(8192, 65536) == [8192, 16384, 32768, 65536]
    assert layer.sweep_tokens(8192, 8191 * 4) == [8192, 16384]
    assert layer.layer_flops(layer.CONFIGS["A"]) == 18 * 32768 * 4 * 2048 * 8192


def test_cli_bench_writes_json_and_markdown(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_bench_args(parser)
    args = parser.parse_args(["--configs", "none", "--config", "16,8,16,4,2", "--providers", "loop,moeblaze-recompute",
                              "--device", "cpu", "--dtype", "fp32", "--warmup", "1", "--reps", "2", "--sweep",
                              "--sweep-start", "8", "--max-tokens", "16", "--sweep-shape", "8,16,4,1",
                              "--out", str(tmp_path), "--no-progress"])
    assert cli.run_bench(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["section"], r["T"], r["provider"]) for r in data["rows"]] == [
        ("configs", 16, "loop"), ("configs", 16, "moeblaze-recompute"),
        ("sweep", 8, "loop"), ("sweep", 8, "moeblaze-recompute"),
        ("sweep", 16, "loop"), ("sweep", 16, "moeblaze-recompute"),
    ]
    assert all(r["status"] == "ok" and r["max_rel_err"] < 1e-5 for r in data["rows"])
    # K = 1 in the sweep: the router's gradient is zero up to rounding and is left out of the check.
    assert all(set(r["rel_err"]) == GRADS - {"dw_router"} for r in data["rows"][2:])
    assert "K=1: the router gets no gradient" in data["rows"][2]["note"]
    md = (tmp_path / "bench.md").read_text()
    assert "### Token scaling, (d, h, E, K) = (8, 16, 4, 1)" in md
    assert md in capsys.readouterr().out
    bad = parser.parse_args(["--configs", "Z", "--device", "cpu"])
    assert cli.run_bench(bad) == 2


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    result = _bench([TINY[1]], ["loop"], sweep=[4, 8], sweep_shape=(8, 16, 3, 2))
    result.rows.append(dict(result.rows[-1], T=16, status="out of memory", ms=None, saved_bytes=None))
    paths = result.plot(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["configs.png", "sweep.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_compare_on_a_tiny_model():
    model, inputs, loss_fn, compile_kwargs = cli.build_compare_model(
        None, batch=1, seq=8, d=16, h=16, num_experts=3, top_k=2, layers=1, heads=2, vocab=32)
    result = compare(model, inputs, loss_fn=loss_fn, steps=1, compile_kwargs=compile_kwargs)
    assert [r.variant for r in result.rows] == ["eager", "inductor", "moeblaze-activations", "moeblaze-recompute"]
    for r in result.rows:
        assert r.status == "ok", r
        assert r.loss == pytest.approx(result.row("eager").loss, rel=1e-5)
        assert r.loss_rel_diff < 1e-5
        assert r.max_grad_rel_err < 1e-4, r
        assert r.step_ms > 0 and r.saved_bytes > 0
        assert r.peak_bytes is None  # CPU
    for policy in ("activations", "recompute"):
        row = result.row(f"moeblaze-{policy}")
        assert (row.regions_rewritten, row.regions_found) == (1, 1)
        (record,) = result.reports[f"moeblaze-{policy}"]
        assert record["status"] == "rewritten" and record["policy"] == policy
    assert result.row("eager").regions_found is None
    # Recompute keeps less for backward than saving the pre-activations.
    assert result.row("moeblaze-recompute").saved_bytes < result.row("moeblaze-activations").saved_bytes
    table = result.table().splitlines()
    assert table[2].startswith("| variant | loss | loss rel diff | max grad rel err |")
    assert len(table) == 4 + len(result.rows)
    assert "1/1 rewritten" in table[-1]
    data = json.loads(result.to_json())
    assert [r["variant"] for r in data["rows"]] == [r.variant for r in result.rows]
    assert data["reports"]["moeblaze-recompute"][0]["policy"] == "recompute"


def test_compare_reports_a_failing_variant():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    x = torch.randn(5, 4)
    calls = {"n": 0}

    def loss_fn(out):
        calls["n"] += 1
        return out.sum()

    # An unknown backend option fails the moeblaze compile: that row says so, eager still stands.
    result = compare(model, x, loss_fn=loss_fn, policies=("recompute",), inductor=False, steps=2,
                     moeblaze_options={"no_such_option": 1})
    eager, failed = result.rows
    assert eager.status == "ok" and eager.loss == pytest.approx(float(model(x).detach().sum()))
    # eager: warm-up, two timed steps, the saved-bytes forward; the failing compile never reaches the loss.
    assert calls["n"] == 1 + 2 + 1
    assert failed.status == "error" and "no_such_option" in failed.note
    assert failed.loss is None and failed.max_grad_rel_err is None
    assert "| moeblaze-recompute | - | - | - |" in result.table()
    assert default_loss(torch.ones(2, 2) * 3) == 9.0
    with pytest.raises(ValueError, match="steps"):
        compare(model, x, steps=0)


def test_time_budget_stops_new_shapes():
    result = _bench([TINY[1], TINY[2]], ["loop"], budget_s=0.0)
    assert result.rows == []
    assert [n.split(":")[0] for n in result.meta["not_run"]] == ["k_eq_e (12, 8, 16, 3, 3)", "one_token (1, 8, 8, 4, 2)"]
    assert result.dispatch["status"] == "skipped"  # the dispatch step is not gated by the budget (CUDA only)
    assert "Not run: k_eq_e" in result.to_markdown()
