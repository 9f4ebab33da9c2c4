"""benchmarks/scaling_device.{sh,py} without a GPU and without torchtitan: the plan of runs and its settings, the
parser against torchtitan 0.2.2's log lines as torchrun prefixes them, the error line of a failed run, the table
(medians, peaks, ratios, scaling efficiency, the operator check, failed and skipped runs), and the model flavor a
run derives. Also that benchmarks/torchtitan_device.sh, which the scaling script sources, still checks its settings.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scaling_device.sh"


def _load():
    spec = importlib.util.spec_from_file_location("scaling_device", ROOT / "benchmarks" / "scaling_device.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sd = _load()


def titan_line(rank, step, loss, mem_gib, tps, color=False):
    """One metrics line as torchtitan 0.2.2 logs it (components/metrics.py, its logging format), behind torchrun's
    prefix for --role rank --tee 3."""
    c = ("\x1b[31m", "\x1b[32m", "\x1b[33m", "\x1b[36m", "\x1b[34m", "\x1b[96m", "\x1b[35m", "\x1b[39m") if color \
        else ("",) * 8
    msg = (f"{c[0]}step: {step:2}  {c[1]}loss: {loss:8.5f}  {c[2]}grad_norm: {1.2345:7.4f}  "
           f"{c[3]}memory: {mem_gib:5.2f}GiB({100 * mem_gib / 79.19:.2f}%)  {c[4]}tps: {round(tps):,}  "
           f"{c[5]}tflops: {12.5:,.2f}  {c[6]}mfu: {1.26:.2f}%{c[7]}")
    return f"[rank{rank}]:[titan] 2026-11-27 12:00:{step:02d},123 - root - INFO - {msg}"


def test_parser_reads_every_rank_and_step():
    text = "\n".join([
        "[rank0]:[titan] 2026-11-27 12:00:00,001 - root - INFO - Training starts at step 1",
        titan_line(0, 1, 8.01958, 3.5, 812.0),
        titan_line(1, 1, 8.01958, 3.75, 790.0, color=True),
        titan_line(0, 12, 2.5, 9.25, 123456.4),
        titan_line(1, 12, 2.5, 9.5, 120001.0),
        "[rank1]:[titan] 2026-11-27 12:00:13,000 - root - INFO - Sleeping 2 seconds for other ranks to complete",
    ])
    got = sd.parse_train_log(text)
    assert got == {
        0: {1: {"loss": 8.01958, "memory_gib": 3.5, "tps": 812.0},
            12: {"loss": 2.5, "memory_gib": 9.25, "tps": 123456.0}},
        1: {1: {"loss": 8.01958, "memory_gib": 3.75, "tps": 790.0},
            12: {"loss": 2.5, "memory_gib": 9.5, "tps": 120001.0}},
    }
    # no torchrun prefix (one process): rank 0
    bare = titan_line(0, 3, 4.0, 1.0, 1000.0).split(":", 1)[1]
    assert sd.parse_train_log(bare) == {0: {3: {"loss": 4.0, "memory_gib": 1.0, "tps": 1000.0}}}


def test_last_error_is_the_ranks_exception_not_torchruns_summary():
    text = "\n".join([
        "[rank1]:Traceback (most recent call last):",
        '[rank1]:  File "/x/torchtitan/train.py", line 700, in <module>',
        "[rank1]:    raise RuntimeError('boom')",
        "[rank1]:torch._dynamo.exc.BackendCompilerFailed: backend='moeblaze' raised:",
        "[rank1]:RuntimeError: expected the counts on the GPU",
        "[rank1]:",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
    ])
    assert sd.last_error(text) == "RuntimeError: expected the counts on the GPU"
    assert sd.last_error("[rank0]:torch.OutOfMemoryError: CUDA out of memory.") == \
        "torch.OutOfMemoryError: CUDA out of memory."
    assert sd.last_error(titan_line(0, 1, 1.0, 1.0, 1.0)) is None


def _run(out, scratch, run, ngpu, par, backend, rc, tps_by_rank, mem_by_rank, steps=range(1, 13), calls=None,
         log_extra="", why=None):
    d = out / run
    d.mkdir()
    meta = {"run": run, "ngpu": ngpu, "parallelism": par, "backend": backend, "rc": rc, "seconds": 70,
            "why": why, "timed_from": 4, "timed_to": 10, "moe_blocks": 8}
    (d / "meta.json").write_text(json.dumps(meta))
    ranks = range(len(tps_by_rank or []))
    lines = [titan_line(r, s, 3.0, mem_by_rank[r](s), tps_by_rank[r](s)) for s in steps for r in ranks]
    (d / "train.log").write_text("\n".join(lines) + log_extra)
    if calls is not None:  # torchtitan's profile trace of the last step, one file per rank
        for rank, n in calls.items():
            trace = scratch / run / "profile_traces" / "iteration_12" / f"rank{rank}_trace.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            events = [{"name": "moeblaze::moe_ffn", "cat": "cpu_op"}] * n + \
                     [{"name": "moeblaze::moe_ffn", "cat": "kernel"}, {"name": "aten::mm", "cat": "cpu_op"}]
            trace.write_text(json.dumps({"traceEvents": events}))
            report = [{"regions": [{"status": "rewritten", "source": "moe.py:120"}]}]
            (d / f"moeblaze_report_rank{rank}.json").write_text(json.dumps(report))


def test_table_from_runs(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    env = {"commit": "abc123", "tokens_per_gpu": 16384, "seq_len": 4096, "local_batch": 4, "steps": 12,
           "timed_from": 4, "timed_to": 10, "flavor": "debugmodel_moe", "flavor_overrides": "",
           "scratch": str(scratch), "torchtitan": "0.2.2", "date": "2026-11-27", "torch": "2.11.0",
           "triton": "3.6.0", "device": "2 x NVIDIA H100 80GB HBM3"}
    (out / "env.json").write_text(json.dumps(env))
    # steps 1..3 (compile) and 11..12 (the profiler) are far off and must not count
    off = lambda base: (lambda s: base if 4 <= s <= 10 else 1.0)  # noqa: E731
    # timed steps 4..10 give 1000 + 10*s: median 1070 on the first rank
    lin = lambda base: (lambda s: base + 10 * s if 4 <= s <= 10 else 5.0)  # noqa: E731
    _run(out, scratch, "n1_fsdp_inductor", 1, "fsdp", "inductor", 0, [lin(1000)], [off(4.0)])
    _run(out, scratch, "n1_fsdp_moeblaze", 1, "fsdp", "moeblaze", 0, [lin(1200)], [off(3.5)], calls={0: 8})
    _run(out, scratch, "n2_fsdp_inductor", 2, "fsdp", "inductor", 0, [lin(900), lin(950)],
         [off(5.0), off(5.5)])
    # one rank ran the operator in 7 blocks only
    _run(out, scratch, "n2_fsdp_moeblaze", 2, "fsdp", "moeblaze", 0, [lin(1100), lin(1000)],
         [off(4.0), off(4.25)], calls={0: 8, 1: 7})
    # EP under Inductor crashed at step 6 on rank 1
    _run(out, scratch, "n2_fsdp-ep_inductor", 2, "fsdp-ep", "inductor", 1, [lin(800), lin(800)],
         [off(6.0), off(6.0)], steps=range(1, 6),
         log_extra="\n[rank1]:torch.distributed.DistBackendError: NCCL error in: all_to_all\n")
    _run(out, scratch, "n2_fsdp-ep_moeblaze", 2, "fsdp-ep", "moeblaze", None, None, None,
         why="not started: 20 s of BUDGET=480 s were left")

    rows, _ = sd.build_table(str(out))
    by = {r["run"]: r for r in rows}
    assert [r["run"] for r in rows] == ["n1_fsdp_inductor", "n1_fsdp_moeblaze", "n2_fsdp_inductor",
                                        "n2_fsdp_moeblaze", "n2_fsdp-ep_inductor", "n2_fsdp-ep_moeblaze"]
    assert by["n1_fsdp_inductor"]["tps"] == 1070.0 and by["n1_fsdp_inductor"]["memory_gib"] == 4.0
    assert by["n1_fsdp_moeblaze"]["tps"] == 1270.0
    assert by["n1_fsdp_moeblaze"]["vs_inductor"] == pytest.approx(1270 / 1070)
    assert by["n1_fsdp_moeblaze"]["operator_every_block"] is True
    assert by["n1_fsdp_moeblaze"]["regions"] == {0: {"graphs": 1, "rewritten": 1, "skipped": []}}
    assert by["n1_fsdp_inductor"]["operator_every_block"] is None
    assert by["n1_fsdp_inductor"]["scaling_efficiency"] == 1.0
    # 2 GPUs: mean over ranks of the per-rank medians; memory: the largest rank
    assert by["n2_fsdp_inductor"]["tps"] == (970 + 1020) / 2 and by["n2_fsdp_inductor"]["memory_gib"] == 5.5
    assert by["n2_fsdp_inductor"]["scaling_efficiency"] == pytest.approx(995 / 1070)
    assert by["n2_fsdp_moeblaze"]["tps"] == (1170 + 1070) / 2
    assert by["n2_fsdp_moeblaze"]["vs_inductor"] == pytest.approx(1120 / 995)
    assert by["n2_fsdp_moeblaze"]["scaling_efficiency"] == pytest.approx(1120 / 1270)
    assert by["n2_fsdp_moeblaze"]["operator_every_block"] is False
    assert by["n2_fsdp_moeblaze"]["status"] == "ok"
    ep = by["n2_fsdp-ep_inductor"]
    assert ep["status"] == "failed" and ep["tps"] == 845.0  # steps 4..5 only
    assert ep["error"] == "exit 1: torch.distributed.DistBackendError: NCCL error in: all_to_all"
    skipped = by["n2_fsdp-ep_moeblaze"]
    assert skipped["status"] == "not run" and skipped["tps"] is None and skipped["vs_inductor"] is None
    assert skipped["operator_every_block"] is None
    assert skipped["error"] == "not started: 20 s of BUDGET=480 s were left"

    md = (out / "scaling.md").read_text()
    assert md.startswith("torchtitan 0.2.2 debugmodel_moe, 16384 tokens per GPU (seq 4096 x 4), 12 steps, "
                         "tokens/s per GPU = median of steps 4..10; 2 x NVIDIA H100 80GB HBM3, torch 2.11.0, "
                         "triton 3.6.0, 2026-11-27, commit abc123\n")
    assert "| 1 | FSDP2 (1 GPU: none) | moeblaze | 1,270 | 3.50 | 1.187 | 1.000 | yes | ok |" in md
    assert "| 2 | FSDP2 | moeblaze | 1,120 | 4.25 | 1.126 | 0.882 | no {0: 8, 1: 7} | ok |" in md
    assert ("| 2 | FSDP2 + EP | inductor | 845 | 6.00 | — | 0.790 | — | failed: exit 1: "
            "torch.distributed.DistBackendError: NCCL error in: all_to_all |") in md
    assert "| 2 | FSDP2 + EP | moeblaze | — | — | — | — | — | not run: not started" in md
    assert json.loads((out / "scaling.json").read_text())["rows"][0]["run"] == "n1_fsdp_inductor"


def test_a_run_that_exits_0_without_its_steps_is_failed(tmp_path):
    out = tmp_path
    (out / "env.json").write_text(json.dumps({"scratch": str(tmp_path / "s")}))
    _run(out, tmp_path / "s", "n2_fsdp_inductor", 2, "fsdp", "inductor", 0, [lambda s: 1.0], [lambda s: 1.0])
    rows, _ = sd.build_table(str(out))
    assert rows[0]["status"] == "failed"
    assert rows[0]["error"] == "steps 4..10 missing on some rank (1 of 2 ranks logged)"


@dataclasses.dataclass
class _MoEArgs:  # the fields torchtitan 0.2.2's MoEArgs has that a flavor would change
    num_experts: int = 8
    top_k: int = 1
    route_norm: bool = False


@dataclasses.dataclass
class _ModelArgs:  # the same for Qwen3ModelArgs
    dim: int = 1024
    n_layers: int = 28
    moe_inter_dim: int = 768
    moe_args: _MoEArgs = dataclasses.field(default_factory=_MoEArgs)


def test_flavor_derived_from_a_base():
    base = _ModelArgs(dim=256, n_layers=8, moe_args=_MoEArgs(num_experts=64, top_k=8))
    table = {"debugmodel_moe": base}
    sd.register_flavor(table, "moe_d1024", "debugmodel_moe",
                       "dim=1024, moe_inter_dim=512,moe_args.num_experts=32,moe_args.route_norm=true")
    assert table["moe_d1024"] == _ModelArgs(dim=1024, n_layers=8, moe_inter_dim=512,
                                            moe_args=_MoEArgs(num_experts=32, top_k=8, route_norm=True))
    assert table["debugmodel_moe"] is base and base.dim == 256  # the base is untouched
    sd.register_flavor(table, "debugmodel_moe", "debugmodel_moe", "")  # its own flavor: nothing to do
    assert table["debugmodel_moe"] is base
    assert sd.expected_moe_blocks(8, sd.parse_overrides("dim=1024,n_layers=4")) == 4
    assert sd.expected_moe_blocks(8, sd.parse_overrides("")) == 8


@pytest.mark.parametrize("spec, name, base, message", [
    ("dim", "x", "debugmodel_moe", "is not key=value"),
    ("width=3", "x", "debugmodel_moe", "'width' is not a field of _ModelArgs"),
    ("router.top_k=3", "x", "debugmodel_moe", "'router.top_k' is not a field"),
    ("dim=2", "debugmodel_moe", "debugmodel_moe", "is one of torchtitan's own flavors"),
    ("dim=2", "x", "nosuch", "FLAVOR_BASE=nosuch is not a flavor"),
    ("moe_args.route_norm=maybe", "x", "debugmodel_moe", "'maybe' is not a boolean"),
])
def test_flavor_errors_say_what_to_write(spec, name, base, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        sd.register_flavor({"debugmodel_moe": _ModelArgs()}, name, base, spec)


def _script(*args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("NGPUS", "PARALLELISMS", "BACKENDS", "TOKENS_PER_GPU",
                                                           "SEQ_LEN", "STEPS", "TIMED_FROM", "FLAVOR",
                                                           "FLAVOR_OVERRIDES", "NGPU")}
    e.update({"PYTHON": sys.executable, "SCRATCH": "/tmp/scaling_scratch", **env})
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=e, timeout=60)


def test_plan_lists_every_run_with_torchtitans_options(tmp_path):
    done = _script(SCRIPT, "--plan", tmp_path, NGPUS="1 2 4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("10 runs, 16384 tokens per GPU (seq 4096 x local batch 4), 12 steps, timed 4..10, "
                        "flavor debugmodel_moe (8 MoE blocks)")
    runs = dict(line.split(": torchrun ", 1) for line in lines[1:])
    assert list(runs) == ["n1_fsdp_inductor", "n1_fsdp_moeblaze", "n2_fsdp_inductor", "n2_fsdp_moeblaze",
                          "n2_fsdp-ep_inductor", "n2_fsdp-ep_moeblaze", "n4_fsdp_inductor", "n4_fsdp_moeblaze",
                          "n4_fsdp-ep_inductor", "n4_fsdp-ep_moeblaze"]
    for run, cmd in runs.items():
        n, par, backend = run.split("_")
        n = n[1:]
        assert cmd.startswith(f"--nproc_per_node={n} torchtitan.train --model.name qwen3 --model.flavor debugmodel_moe")
        assert f"--parallelism.data_parallel_shard_degree {n} " in cmd
        assert f"--compile.backend {backend} " in cmd
        assert "--training.seq_len 4096 --training.local_batch_size 4 " in cmd
        assert ("--parallelism.expert_parallel_degree " + n in cmd) == (par == "fsdp-ep")
        assert ("--profiling.enable_profiling" in cmd) == (backend == "moeblaze")


def test_plan_with_a_derived_flavor_and_other_sizes(tmp_path):
    done = _script(SCRIPT, "--plan", tmp_path, NGPUS="2", PARALLELISMS="fsdp-ep", BACKENDS="moeblaze",
                   TOKENS_PER_GPU="8192", SEQ_LEN="2048", STEPS="20", FLAVOR="moe_d1024",
                   FLAVOR_OVERRIDES="dim=1024,n_layers=4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("1 runs, 8192 tokens per GPU (seq 2048 x local batch 4), 20 steps, timed 4..18, "
                        "flavor moe_d1024 (4 MoE blocks) = debugmodel_moe + dim=1024,n_layers=4")
    assert lines[1].startswith("n2_fsdp-ep_moeblaze: torchrun --nproc_per_node=2 torchtitan.train --model.name "
                               "qwen3 --model.flavor moe_d1024 ")


@pytest.mark.parametrize("env, message", [
    ({"TOKENS_PER_GPU": "10000"}, "TOKENS_PER_GPU=10000 is not a multiple of SEQ_LEN=4096"),
    ({"NGPUS": "1 two"}, "'two' is not a GPU count"),
    ({"PARALLELISMS": "fsdp tp"}, "'tp' is neither fsdp nor fsdp-ep"),
    ({"BACKENDS": "eager"}, "'eager' is neither inductor nor moeblaze"),
    ({"STEPS": "5"}, "the timed steps TIMED_FROM..STEPS-2 must be non-empty"),
    ({"FLAVOR_OVERRIDES": "dim=512"}, "FLAVOR_OVERRIDES is set but FLAVOR=debugmodel_moe is the base flavor"),
    ({"FLAVOR": "x", "FLAVOR_OVERRIDES": "dim"}, "is not key=value"),
])
def test_settings_are_checked(tmp_path, env, message):
    done = _script(SCRIPT, "--plan", tmp_path, **env)
    assert done.returncode == 2, done.stdout
    assert message in done.stderr


def test_torchtitan_device_sh_still_checks_its_settings_when_run(tmp_path):
    done = _script(ROOT / "benchmarks" / "torchtitan_device.sh", "--compare", tmp_path, NGPU="3")
    assert done.returncode == 2
    assert "NGPU=3: this benchmark runs on 2 or 4 GPUs" in done.stderr
    # expert parallelism spans every GPU or none
    done = _script(ROOT / "benchmarks" / "torchtitan_device.sh", "--compare", tmp_path, NGPU="4", EP="2")
    assert done.returncode == 2
    assert "EP=2: 1 (FSDP2 alone) or NGPU=4 (experts over every GPU)" in done.stderr
    helped = _script(ROOT / "benchmarks" / "torchtitan_device.sh", "--help")
    assert helped.returncode == 0 and "NGPU=2 bash benchmarks/torchtitan_device.sh OUTDIR" in helped.stdout


# A stand-in for the GPU machine's python: it says there are 2 GPUs, that torchtitan's needs are there, and runs
# torchrun as a trainer that logs torchtitan's metrics lines for every rank; EP under moeblaze crashes on rank 1 and
# 2-GPU FSDP2 under moeblaze hangs (cut by RUN_TIMEOUT). Everything else goes to the real interpreter.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == -c && $2 == *device_count* ]]; then echo 2; exit 0; fi
if [[ $1 == - && $2 == "$TT_TARGET" ]]; then cat >/dev/null; echo "missing: none"; exit 0; fi
if [[ $1 == -m && $2 == torch.distributed.run ]]; then
    n=1 backend= ep=0 steps=
    prev=
    for a in "$@"; do
        case $a in --nproc_per_node=*) n=${a#*=} ;; esac
        case $prev in --compile.backend) backend=$a ;; --training.steps) steps=$a ;;
                      --parallelism.expert_parallel_degree) ep=$a ;; esac
        prev=$a
    done
    [[ -n $TT_FLAVOR && -n $MOEBLAZE_REPO ]] || { echo "the launcher's environment is missing"; exit 3; }
    if [[ $backend == moeblaze && $ep == 0 && $n == 2 ]]; then exec sleep 30; fi
    base=1000; [[ $backend == moeblaze ]] && base=1100
    for ((s = 1; s <= steps; s++)); do
        for ((r = 0; r < n; r++)); do
            if [[ $backend == moeblaze && $ep != 0 && $s == 3 && $r == 1 ]]; then
                echo "[rank1]:RuntimeError: fake failure under EP"; exit 1
            fi
            printf '[rank%d]:[titan] 2026-11-27 12:00:00,000 - root - INFO - step: %2d  loss:  3.00000  grad_norm:  1.0000  memory:  %5.2fGiB(5.00%%)  tps: %s  tflops: 1.00  mfu: 0.10%%\n' \
                "$r" "$s" "$((n + 2)).5" "$((base - 100 * (n - 1)))"
        done
    done
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_run_mode_records_every_run_with_a_fake_trainer(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = _script(SCRIPT, out, PYTHON=str(fake), REAL_PYTHON=sys.executable, WHL_DIR=str(tmp_path / "nowheels"),
                   PYARROW_DIR=str(tmp_path / "nowheels"), SCRATCH=str(tmp_path / "scratch"), TT_TARGET=str(tmp_path / "tt"), RUN_TIMEOUT="5",
                   MOEBLAZE_COMMIT="feedbeef", NGPUS="1 2 4")
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {r["run"]: r for r in json.loads((out / "scaling.json").read_text())["rows"]}
    assert list(rows) == ["n1_fsdp_inductor", "n1_fsdp_moeblaze", "n2_fsdp_inductor", "n2_fsdp_moeblaze",
                          "n2_fsdp-ep_inductor", "n2_fsdp-ep_moeblaze", "n4_fsdp_inductor", "n4_fsdp_moeblaze",
                          "n4_fsdp-ep_inductor", "n4_fsdp-ep_moeblaze"]
    assert {k: (r["status"], r["tps"], r["memory_gib"]) for k, r in rows.items() if r["status"] == "ok"} == {
        "n1_fsdp_inductor": ("ok", 1000.0, 3.5), "n1_fsdp_moeblaze": ("ok", 1100.0, 3.5),
        "n2_fsdp_inductor": ("ok", 900.0, 4.5), "n2_fsdp-ep_inductor": ("ok", 900.0, 4.5)}
    assert rows["n2_fsdp_moeblaze"]["status"] == "failed"
    assert rows["n2_fsdp_moeblaze"]["error"].startswith("exit 124 (timed out)")
    assert rows["n2_fsdp-ep_moeblaze"]["error"] == "exit 1: RuntimeError: fake failure under EP"
    assert rows["n1_fsdp_moeblaze"]["vs_inductor"] == pytest.approx(1.1)
    assert rows["n2_fsdp-ep_inductor"]["scaling_efficiency"] == pytest.approx(0.9)
    for k in ("n4_fsdp_inductor", "n4_fsdp_moeblaze", "n4_fsdp-ep_inductor", "n4_fsdp-ep_moeblaze"):
        assert (rows[k]["status"], rows[k]["error"]) == ("not run", "needs 4 GPUs; the machine has 2")
    env = json.loads((out / "env.json").read_text())
    assert (env["commit"], env["tokens_per_gpu"], env["timed_from"], env["timed_to"]) == ("feedbeef", 16384, 4, 10)
    assert "| 1 | FSDP2 (1 GPU: none) | moeblaze | 1,100 | 3.50 | 1.100 | 1.000 |" in (out / "scaling.md").read_text()
    assert "n2_fsdp_moeblaze: exit 124" in done.stdout


def test_run_mode_stops_starting_runs_past_the_budget(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = _script(SCRIPT, out, PYTHON=str(fake), REAL_PYTHON=sys.executable, WHL_DIR=str(tmp_path / "nowheels"),
                   PYARROW_DIR=str(tmp_path / "nowheels"), SCRATCH=str(tmp_path / "scratch"), TT_TARGET=str(tmp_path / "tt"), NGPUS="1",
                   BUDGET="10", RUN_MIN="60")
    assert done.returncode == 1
    rows = json.loads((out / "scaling.json").read_text())["rows"]
    assert [(r["run"], r["status"]) for r in rows] == [("n1_fsdp_inductor", "not run"), ("n1_fsdp_moeblaze", "not run")]
    assert rows[0]["error"].startswith("not started: ") and rows[0]["error"].endswith(" of BUDGET=10 s were left")


def test_table_of_a_folder_without_runs_says_what_to_do(tmp_path):
    done = _script(SCRIPT, "--table", tmp_path)
    assert done.returncode == 1
    assert f"{tmp_path}/env.json is missing" in done.stderr and "--table only rebuilds the table" in done.stderr
