"""What a user sees from the command line: plot requirements checked first, the table printed whatever happens to
the plot, progress bars on stderr, step times with their step count and a flag on a wide spread."""
from __future__ import annotations

import argparse
import sys

import pytest
import torch

from moeblaze_fx.bench import cli, compare as compare_mod, layer
from moeblaze_fx.bench.compare import CompareResult, CompareRow, compare, format_compare_table
from moeblaze_fx.bench.timing import SPREAD_MARK, SPREAD_NOTE, WIDE_SPREAD, StepTimes


def _compare_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_compare_args(parser)
    return parser.parse_args(["--device", "cpu", "--no-inductor", "--policies", "recompute", "--steps", "2",
                              "--batch", "1", "--seq", "8", "--hidden", "16", "--expert-hidden", "16",
                              "--experts", "3", "--layers", "1", "--no-progress", *extra])


def test_compare_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError

    def no_work(*args, **kwargs):
        raise AssertionError("the model was built although the plot could never be drawn")

    monkeypatch.setattr(cli, "build_compare_model", no_work)
    assert cli.run_compare(_compare_args("--plot")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--plot: plotting needs matplotlib, which is not installed: pip install matplotlib" in captured.err
    with pytest.raises(RuntimeError, match="needs matplotlib"):
        compare(torch.nn.Linear(2, 2), torch.randn(3, 2), plot=True)  # the API checks first too


def test_bench_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(layer, "run_layer_bench", lambda *a, **k: pytest.fail("ran without a way to plot"))
    parser = argparse.ArgumentParser()
    cli.add_bench_args(parser)
    args = parser.parse_args(["--configs", "none", "--config", "8,8,8,2,1", "--device", "cpu", "--plot"])
    assert cli.run_bench(args) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_compare_prints_its_table_when_the_plot_fails(monkeypatch, capsys):
    monkeypatch.setattr(compare_mod, "check_plot_requirements", lambda: None)

    def broken_plot(result, path):
        raise RuntimeError("the plot broke")

    monkeypatch.setattr(compare_mod, "plot_compare", broken_plot)
    assert cli.run_compare(_compare_args("--plot", "x.png")) == 1
    captured = capsys.readouterr()
    assert "| variant | loss |" in captured.out and "| moeblaze-recompute | " in captured.out
    assert "the plot was not written: the plot broke" in captured.err


def test_progress_bars_write_to_stderr(capsys):
    torch.manual_seed(0)
    compare(torch.nn.Linear(4, 3), torch.randn(5, 4), policies=(), inductor=False, steps=1, progress=True)
    captured = capsys.readouterr()
    assert "moeblaze compare" in captured.err
    assert captured.out == ""

    parser = argparse.ArgumentParser()
    cli.add_bench_args(parser)
    args = parser.parse_args(["--configs", "none", "--config", "8,8,8,2,1", "--providers", "loop", "--device", "cpu",
                              "--dtype", "fp32", "--warmup", "1", "--reps", "1", "--no-check"])
    assert cli.run_bench(args) == 0
    captured = capsys.readouterr()
    assert "moeblaze bench" in captured.err
    assert "\r" not in captured.out and "| loop |" in captured.out


@pytest.mark.parametrize("times, median, spread, wide", [
    ((10.0,), 10.0, 0.0, False),  # one step: nothing to compare it with
    ((10.0, 11.0, 12.0), 11.0, 2 / 11, False),
    ((10.0, 10.0, 10.0 * (1 + WIDE_SPREAD)), 10.0, WIDE_SPREAD, False),  # exactly at the threshold: not flagged
    ((10.0, 10.0, 13.0), 10.0, 0.3, True),
    ((5.0, 20.0), 12.5, 1.2, True),  # two steps four times apart
])
def test_step_times_spread(times, median, spread, wide):
    t = StepTimes.of(times)
    assert t.n == len(times)
    assert t.median == pytest.approx(median)
    assert t.spread == pytest.approx(spread)
    assert t.wide is wide
    assert t.cell(".1f") == f"{median:.1f} (n={len(times)})" + (SPREAD_MARK if wide else "")
    with pytest.raises(ValueError, match="at least one"):
        StepTimes.of([])


def _result(times_per_row):
    rows = []
    for name, times in times_per_row:
        t = StepTimes.of(times)
        rows.append(CompareRow(name, loss=1.0, loss_rel_diff=0.0, max_grad_rel_err=0.0, step_ms=t.median,
                               step_times_ms=list(times), steps_timed=t.n, step_spread=t.spread, wide_spread=t.wide))
    return CompareResult(rows, {}, {"device": "CPU", "torch": torch.__version__, "dtype": "float32",
                                    "timer": "CPU wall clock"})


def test_compare_table_says_how_many_steps_and_flags_a_wide_spread():
    steady = format_compare_table(_result([("eager", [10.0, 10.5, 10.2]), ("inductor", [5.0, 5.1, 5.05])]))
    assert "| step ms (n steps) |" in steady
    assert "| 10.20 (n=3) |" in steady and "| 5.05 (n=3) |" in steady
    assert SPREAD_NOTE not in steady and SPREAD_MARK + " |" not in steady
    noisy = format_compare_table(_result([("eager", [10.0, 10.5, 10.2]), ("inductor", [5.0, 9.0])]))
    assert "| 7.00 (n=2)* |" in noisy
    assert noisy.rstrip().endswith(SPREAD_NOTE)


def test_compare_rows_record_their_steps():
    torch.manual_seed(0)
    result = compare(torch.nn.Linear(4, 3), torch.randn(5, 4), policies=(), inductor=False, steps=3)
    (row,) = result.rows
    assert row.steps_timed == 3 and len(row.step_times_ms) == 3
    assert row.step_ms == sorted(row.step_times_ms)[1]
    assert row.step_spread == pytest.approx((max(row.step_times_ms) - min(row.step_times_ms)) / row.step_ms)
    assert row.wide_spread is (row.step_spread > WIDE_SPREAD)
    assert "(n=3)" in result.table()


def test_layer_table_flags_a_wide_spread():
    meta = {"device": "CPU", "torch": "t", "date": "d", "commit": "c", "dtype": "float32", "timer": "wall clock",
            "dense_gemm": {}}
    cfg = layer.LayerConfig("tiny", 8, 8, 8, 2, 1)
    ok = layer._row(cfg, "loop", "configs", ms=1.5, steps_timed=3, ms_spread=0.1, wide_spread=False, tflops=1.0,
                    frac_dense_gemm=0.5, saved_bytes=10, max_rel_err=0.0)
    noisy = dict(ok, provider="hf-grouped-mm", ms=2.5, ms_spread=0.8, wide_spread=True)
    md = layer.BenchResult(meta, [ok, noisy]).to_markdown()
    assert "| loop | 1.50 |" in md and "| hf-grouped-mm | 2.50* |" in md
    assert SPREAD_NOTE in md
    assert SPREAD_NOTE not in layer.BenchResult(meta, [ok]).to_markdown()
