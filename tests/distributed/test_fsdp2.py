"""The backend under FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 gloo ranks on the CPU.

Every case trains TinyMoETransformer (2 blocks, a per-expert loop the backend must find) for 3 optimizer steps on
2 ranks and is checked against a single-process eager run on the whole batch (float64: agreement to rounding), or,
under a ``MixedPrecisionPolicy``, against FSDP2 without compile under the same policy. All cases run in one spawn of
the ranks (:func:`fsdp_results`, module scope), so the test file costs one process start and one import per rank.

The ranks cannot hang the test: gloo's collectives time out (``GLOO_TIMEOUT_S``), the spawn has a deadline after
which its processes are killed (``SPAWN_DEADLINE_S``), and a rank that raises stops the others and fails the test
with its traceback (:func:`test_a_failing_rank_fails_the_test_and_stops_the_others`).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp2_cases import Case, Size, canonical, rank_main, rel_err, train_reference

import moeblaze_fx

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
GLOO_TIMEOUT_S = 120
SPAWN_DEADLINE_S = 600
SIZE = Size()

# Parity with the single-process reference, float64 parameters. The backend's "inductor" option is off except in
# one case: Inductor's C++ compile on the CPU costs about a minute here.
REFERENCE_CASES = [
    Case("blocks-reshard-adamw"),  # torchtitan's order: block.compile, then fully_shard(block), fully_shard(model)
    Case("blocks-keep-unsharded-sgd", reshard_after_forward=False, optimizer="sgd"),
    Case("blocks-checkpointed-adamw", checkpoint=True),  # checkpoint_wrapper -> block.compile -> fully_shard
    Case("model-after-shard-adamw", compile="model"),  # fully_shard everything, then torch.compile(model)
    Case("model-after-shard-checkpointed-sgd", compile="model", checkpoint=True, optimizer="sgd",
         reshard_after_forward=False),
    Case("blocks-inductor-adamw", inductor=True),
    # negative: without fullgraph=True Dynamo splits the per-expert loop at torch.where, and nothing is rewritten
    Case("model-after-shard-split-loop-adamw", compile="model", capture_dynamic_output_shapes=False),
]
# MixedPrecisionPolicy(param_dtype, reduce_dtype=float32) over float32 master weights: compiled per block against
# FSDP2 without compile under the same policy. SGD: AdamW divides each gradient by its own running scale, which turns
# 16-bit rounding in near-zero gradients into whole learning-rate steps (measured: up to 3e-2 apart after 3 steps).
MIXED = ("bfloat16", "float16")
MIXED_CASES = [case for mixed in MIXED for case in (
    Case(f"blocks-mixed-{mixed}", mixed=mixed, dtype="float32", optimizer="sgd"),
    Case(f"uncompiled-mixed-{mixed}", compile="none", mixed=mixed, dtype="float32", optimizer="sgd"))]

# Counters on every rank. The two blocks are one class: Dynamo traces the parameters as graph inputs
# (inline_inbuilt_nn_modules), so the second block runs the graph compiled for the first and one region is
# rewritten per compile, whether each block is compiled before fully_shard or the model after it. The profiler's
# count of operator calls in the last step shows that both blocks run the operator: 2 forwards and 2 backwards (each
# the split backward's three operators), and 2 more forwards where activation checkpointing recomputes the blocks in
# backward.
EXPECTED_COUNTERS = {"rewritten": 1}
_SPLIT_BACKWARD = {f"moeblaze::moe_ffn_backward_{half}": 2 for half in ("act", "dx", "dw")}  # ops.py, the split
EXPECTED_OP_CALLS = {"moeblaze::moe_ffn": 2, **_SPLIT_BACKWARD}
EXPECTED_OP_CALLS_CHECKPOINTED = {"moeblaze::moe_ffn": 4, **_SPLIT_BACKWARD}


def expected(case: Case) -> tuple[dict, dict]:
    """The counters and the last step's operator calls every rank must report for ``case``."""
    if case.compile == "none" or not case.capture_dynamic_output_shapes:
        return {}, {}  # the region split by graph breaks (a candidate is never found in half a loop)
    return EXPECTED_COUNTERS, EXPECTED_OP_CALLS_CHECKPOINTED if case.checkpoint else EXPECTED_OP_CALLS

# Relative error of the losses and of every parameter after the last step. float64 without Inductor: the same
# arithmetic up to summation order. With Inductor: the router's float32 softmax (TinyMoETransformer's
# F.softmax(..., dtype=float32)) is computed from float64 logits by Inductor and by eager in different orders, so
# the combine weights differ by float32 rounding: the gradients of one step differ by 3e-8 to 2e-7 from eager's
# under the default Inductor backend too (measured 2026-11-27 on this model in float64).
TOL_FLOAT64 = 1e-12
TOL_FLOAT64_INDUCTOR = 1e-6
# The compiled block computes the region in the policy's dtype as eager does, but the operator accumulates in
# float32 where eager rounds each expert's output: about two units of the 16-bit dtype's rounding (2^-8, 2^-11).
# Measured 2026-11-27 (CPU, torch 2.13): losses 3e-4 / 4e-5 apart, parameters 1.6e-3 / 1.9e-4.
TOL_MIXED = {"bfloat16": 8e-3, "float16": 1e-3}


def run_ranks(tmp_path, cases: list[Case], deadline_s: float = SPAWN_DEADLINE_S) -> list[dict]:
    """Run ``cases`` on WORLD gloo ranks; return each rank's results. A rank that raises fails the call with its
    traceback (torch.multiprocessing stops the other ranks); past ``deadline_s`` every rank is killed."""
    init_file = tmp_path / "init"
    ctx = mp.start_processes(rank_main, args=(WORLD, str(init_file), cases, SIZE, str(tmp_path), GLOO_TIMEOUT_S),
                             nprocs=WORLD, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.0, min(5.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                raise TimeoutError(f"the {WORLD} ranks did not finish within {deadline_s:.0f} s: killed")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    start = time.monotonic()
    results = run_ranks(tmp_path_factory.mktemp("fsdp2"), REFERENCE_CASES + MIXED_CASES)
    print(f"\n{WORLD} ranks ran {len(REFERENCE_CASES + MIXED_CASES)} cases in {time.monotonic() - start:.1f} s")
    return results


def _per_rank(results: list[dict], name: str, key: str) -> list:
    return [r[name][key] for r in results]


def test_ranks_import_this_checkout(fsdp_results):
    """The spawned ranks run the package the test imports (not another installed copy)."""
    assert _per_rank(fsdp_results, REFERENCE_CASES[0].name, "package") == [moeblaze_fx.__file__] * WORLD


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.name)
def test_matches_single_process_reference(fsdp_results, case):
    want_counters, want_op_calls = expected(case)
    assert _per_rank(fsdp_results, case.name, "counters") == [want_counters] * WORLD
    assert _per_rank(fsdp_results, case.name, "op_calls") == [want_op_calls] * WORLD

    want = train_reference(case, SIZE, WORLD, torch.device("cpu"))
    tol = TOL_FLOAT64_INDUCTOR if case.inductor else TOL_FLOAT64
    for rank, got in enumerate(_per_rank(fsdp_results, case.name, "losses")):
        assert rel_err(got, want["losses"]) <= tol, f"rank {rank}: losses {got} against {want['losses']}"
    for rank, params in enumerate(_per_rank(fsdp_results, case.name, "params")):
        assert sorted(map(canonical, params)) == sorted(want["params"])
        for name, got in params.items():
            err = rel_err(got, want["params"][canonical(name)])
            assert err <= tol, f"rank {rank}: {name} after {case.steps} steps: relative error {err:.3g}"
    # the reference moved: the steps did something to compare
    assert rel_err(want["losses"][-1:], want["losses"][:1]) > 1e-3


@pytest.mark.parametrize("mixed", MIXED)
def test_mixed_precision_matches_uncompiled_fsdp2(fsdp_results, mixed):
    compiled, eager = f"blocks-mixed-{mixed}", f"uncompiled-mixed-{mixed}"
    # FSDP2 casts the gathered parameters and the block's inputs in its hooks, outside the compiled graph: the graph's
    # region is 16-bit throughout (no casts in it), and it is rewritten (observed {"rewritten": 1} on each rank,
    # torch 2.13, 2026-11-27). A region with casts written in forward or under autocast is another matter.
    assert _per_rank(fsdp_results, compiled, "counters") == [EXPECTED_COUNTERS] * WORLD
    assert _per_rank(fsdp_results, compiled, "op_calls") == [EXPECTED_OP_CALLS] * WORLD
    assert _per_rank(fsdp_results, eager, "counters") == [{}] * WORLD
    assert _per_rank(fsdp_results, eager, "op_calls") == [{}] * WORLD

    tol = TOL_MIXED[mixed]
    for rank in range(WORLD):
        got, want = fsdp_results[rank][compiled], fsdp_results[rank][eager]
        assert rel_err(got["losses"], want["losses"]) <= tol, f"rank {rank}: {got['losses']} against {want['losses']}"
        for name, p in got["params"].items():
            assert p.dtype == torch.float32, f"{name}: the master weights stay float32, got {p.dtype}"
            err = rel_err(p, want["params"][name])
            assert err <= tol, f"rank {rank}: {name} after 3 steps: relative error {err:.3g}"


def test_a_failing_rank_fails_the_test_and_stops_the_others(tmp_path):
    """Rank 1 raises before its first collective; rank 0 would wait in it until gloo's timeout. The parent must
    raise at once with rank 1's error and leave no rank running."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="failure injected on rank 1"):
        run_ranks(tmp_path, [Case("injected-failure", compile="none", raise_on_rank=1)], deadline_s=GLOO_TIMEOUT_S)
    assert time.monotonic() - start < GLOO_TIMEOUT_S / 2
    assert (tmp_path / "rank1.err").read_text().rstrip().endswith("failure injected on rank 1 by case "
                                                                  "'injected-failure'")
    assert not (tmp_path / "rank0.pt").exists()


def test_gpu_script_imports_and_asks_for_torchrun():
    """run_nccl.py (the NCCL check, run on GPUs by hand) imports cleanly and, started without torchrun, says how to
    start it instead of waiting in init_process_group for ranks that never come. Its training logic is
    fsdp2_cases', which the tests above run."""
    script = pathlib.Path(__file__).with_name("run_nccl.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--backend", "gloo"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "run under torchrun: torchrun --nproc-per-node 2 tests/distributed/run_nccl.py" in done.stderr
