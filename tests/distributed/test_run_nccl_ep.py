"""The expert-parallel GPU script (``run_nccl_ep.py``) in its CPU mode: torchrun, 2 gloo ranks, small sizes, the
backend without Inductor. It checks the script's own logic (counters, report, operator calls, the bf16 rule against
the float32 reference, the PASS/FAIL table and exit status) where CI has no GPU; the GPU run is by hand (its
docstring). The file takes about a minute on two shared CPU cores (2026-11-27: 53 to 64 s, most of it the passing run).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

import moeblaze_fx

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SCRIPT = pathlib.Path(__file__).with_name("run_nccl_ep.py")
ROOT = pathlib.Path(moeblaze_fx.__file__).resolve().parent.parent
DEADLINE_S = 300  # the subprocess is killed past this (gloo's collectives time out before: --timeout-s)


def _torchrun(*args: str, deadline_s: float = DEADLINE_S) -> subprocess.CompletedProcess:
    """The script on 2 CPU ranks under torchrun (``--standalone``: a free port, no clash with other jobs), importing
    this checkout's moeblaze_fx."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               "--backend", "gloo", "--device", "cpu", "--no-inductor", "--timeout-s", "120", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=deadline_s, env=env, cwd=ROOT)


def test_cpu_mode_passes_every_case_on_every_rank():
    done = _torchrun()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"moeblaze_fx {moeblaze_fx.__file__}" in done.stdout  # the ranks ran this checkout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("grouped_mm-", "loop-"))]
    results = [(row[0], row[1], row[-1]) for row in rows if row[-1] in ("PASS", "FAIL")]
    cases = ["grouped_mm-bfloat16", "grouped_mm-float32-weights", "grouped_mm-dist_all_to_all_counts", "loop-float32"]
    assert results == [(case, str(rank), "PASS") for case in cases for rank in range(2)], done.stdout
    assert "PASS: 4 of 4 cases passed on every rank" in done.stdout


def test_a_case_out_of_tolerance_fails_the_run():
    """The float32 loop held to 1e-12 (it differs from the reference by summation order, about 1e-7): the table
    says FAIL with the quantity and its error, and every rank exits with 1."""
    done = _torchrun("--cases", "loop-float32", "--tol-float32", "1e-12")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "against float32, above 1e-12" in done.stdout
    assert "FAIL: 0 of 1 cases passed on every rank" in done.stdout


def test_asks_for_torchrun():
    """Started without torchrun, the script says how to start it instead of waiting for ranks that never come."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--backend", "gloo"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "run under torchrun: torchrun --nproc-per-node 2 tests/distributed/run_nccl_ep.py" in done.stderr
