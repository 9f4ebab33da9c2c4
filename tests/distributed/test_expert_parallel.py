"""Expert parallelism: the local expert computation is rewritten, the collectives stay as written and nothing runs them
at compile time. A torchtitan-style expert-parallel block is compiled with ``backend="moeblaze"`` on 2 gloo ranks
(spawned processes, a file store, timeouts so a desync fails instead of hanging): the router's top-k; the counts
all-to-all; the token all-to-all over ``.tolist()`` splits; the rank-major rows permuted expert-major by indices
computed from the counts (``searchsorted``); ``torch._grouped_mm`` over the local experts with ``offs = cumsum`` of
their counts and torchtitan's bf16 casts; the un-permute (``new_empty`` + index assignment); the all-to-all back; the
un-sort and the combine. (torchtitan: distributed/expert_parallel.py, models/common/moe/{moe,utils}.py, read late
2026; rewritten here, no padding, as its bf16 path has none; the 0.2.2 release pads each local expert's rows to a
multiple of 8.) The region from the top-k holds the collectives and is left alone; the local part between the
all-to-alls is the operator with K = 1, unit weights and ids from the counts, and is rewritten on every rank, proven
on inputs that are the same on every rank. Each rank checks its output and every gradient against an uncompiled
single-process reference (every expert on one process, the same weights). The per-expert loop torchtitan keeps for
comparison (split sizes from ``.tolist()``) is not rewritten: its region is reported left alone. The block and the
reference are ``ep_cases.py``'s, which the GPU script ``run_nccl_ep.py`` runs over NCCL.

A unit test without processes checks the collective decision on a graph holding a ``_c10d_functional`` op, with the
prover replaced by one that fails the test.
"""
from __future__ import annotations

import datetime
import traceback

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ep_cases import EPSize, ExpertParallelMoE, errors_against_reference, make_tokens, make_weights, reference, route
from torch._dynamo.utils import counters

import moeblaze_fx

SIZE = EPSize(experts=4, top_k=2, d=16, h=24, tokens=11)  # 11 tokens per rank: not a multiple of anything
E, K, WORLD = SIZE.experts, SIZE.top_k, 2
_TIMEOUT_S = 240


def _weights(seed: int = 0):
    return make_weights(SIZE, seed)


def _tokens(rank: int) -> torch.Tensor:
    return make_tokens(SIZE, rank)


def _rank_main(rank: int, store: str, collectives: str, experts: str, dtype: torch.dtype, results) -> None:
    """One rank: compile the expert-parallel block, run forward and backward, compare with the single-process
    reference on this rank's tokens, and send back what the report said."""
    try:
        import moeblaze_fx  # noqa: F401  (registers the backend's ops)
        from moeblaze_fx.report import last_report

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        weights = {k: v.to(dtype) for k, v in _weights().items()}
        model = ExpertParallelMoE(weights, rank, WORLD, collectives, experts, K)
        x = _tokens(rank).to(dtype).requires_grad_(True)
        counters.clear()
        # .tolist() of the split sizes stays in the graph as unbacked sizes (torchtitan compiles so too)
        with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
            compiled = torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False})
            out = compiled(x)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank)).to(dtype)
        out.backward(grad_out)
        report = [(r.status, r.reason, r.idiom) if r.status == "rewritten" else (r.status, r.reason)
                  for r in last_report()]

        # the reference: all experts on this process, the same weights, this rank's tokens
        ref_weights = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
        x_ref = x.detach().clone().requires_grad_(True)
        want = reference(x_ref, ref_weights, K, torch.bfloat16 if experts == "grouped_mm" else None)
        want.backward(grad_out)
        # a weight's gradient sums over every rank's tokens: the reference's are summed over the ranks
        errors = errors_against_reference(model, out, x, want, x_ref, ref_weights)
        results.put((rank, report, dict(counters["moeblaze"]), errors, None))
    except BaseException:
        results.put((rank, None, None, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("collectives,experts,dtype", [
    ("functional", "grouped_mm", torch.float32),  # torchtitan's: float32 weights, bf16 grouped products
    ("c10d", "grouped_mm", torch.float32),  # the counts through torch.distributed.all_to_all_single, in place
    ("functional", "grouped_mm", torch.bfloat16),  # bf16 weights: where the ranks' proofs fell out of step (issue 40)
    ("functional", "loop", torch.float32),  # torchtitan's per-expert loop over .tolist() splits: left alone
], ids=["grouped_mm-float32", "grouped_mm-dist_all_to_all_counts", "grouped_mm-bfloat16", "loop-float32"])
def test_expert_parallel_block_on_every_rank(collectives, experts, dtype, tmp_path):
    """Exact counters and report on each rank: the local grouped products rewritten (the region from the top-k, which
    holds the collectives, is then not reported), or for the loop the region left alone for its collectives.
    torch.distributed.all_to_all_single (in place, for the counts) is traced by Dynamo as the functional collective
    plus a copy_; torch.distributed.nn.functional's autograd one raises under torch.compile on torch 2.13, so the
    tokens always take the functional autograd collective."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")  # a file store: no port to race for with other test processes
    procs = [ctx.Process(target=_rank_main, args=(r, store, collectives, experts, dtype, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(WORLD):
            rank, report, counts, errors, failure = results.get(timeout=_TIMEOUT_S)
            got[rank] = (report, counts, errors, failure)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(WORLD):
        report, counts, errors, failure = got[rank]
        assert failure is None, f"rank {rank} failed:\n{failure}"
        if experts == "grouped_mm":
            assert counts == {"rewritten": 1}, f"rank {rank}: {counts}"
            assert report == [("rewritten", None, "grouped_mm over rows grouped by counts")], f"rank {rank}: {report}"
        else:
            assert counts == {"skipped": 1}, f"rank {rank}: {counts}"
            assert len(report) == 1 and report[0][0] == "skipped", f"rank {rank}: {report}"
            assert report[0][1].startswith("expert-parallel dispatch inside the region: "), report[0][1]
            assert "all_to_all_single" in report[0][1] and "here it is not" in report[0][1]
        # bf16 products (the reference computes its products in bf16 too, expert by expert)
        tol = 1e-5 if experts == "loop" else 3e-2
        bad = {k: v for k, v in errors.items() if v > tol}
        assert not bad, f"rank {rank}: relative errors above {tol}: {bad}"


class WaitInTheExperts(torch.nn.Module):
    """A per-expert loop with a wait on a collective inside the expert computation (no process group needed:
    ``wait_tensor`` of a tensor no collective produced returns it)."""

    def __init__(self):
        super().__init__()
        w = _weights()
        self.router = torch.nn.Parameter(w["router"])
        self.w1, self.w3, self.w2 = (torch.nn.Parameter(w[k]) for k in ("w1", "w3", "w2"))

    def forward(self, x):
        w, ids = route(x, self.router, K)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            rows = torch.ops._c10d_functional.wait_tensor(x[tok])
            y = F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
            out = out.index_add(0, tok, y * w[tok, slot, None])
        return out


class TestGolden(expecttest.TestCase):
    def test_report(self):
        torch.compile(WaitInTheExperts(), backend="moeblaze", fullgraph=True, options={"inductor": False})(_tokens(0))
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.report.last_report()), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/distributed/test_expert_parallel.py:147  -
      reason: expert-parallel dispatch inside the region: it holds 4 collective or opaque op(s) (_c10d_functional::wait_tensor; first at tests/distributed/test_expert_parallel.py:145), which are never run at compile time (every rank must run them alike), so the region is left alone. The local expert computation between the all-to-alls is rewritten on its own where the received rows are grouped by expert with counts and the experts are grouped products over them (torch._grouped_mm with offs = cumsum of the counts, torchtitan's); here it is not, so the block runs as compiled without the operator""")


def test_collective_in_region_is_never_proven():
    """No processes: a region holding a ``_c10d_functional`` op is skipped by structure, and the prover never runs."""
    import moeblaze_fx.passes.pipeline as pipeline
    from moeblaze_fx.report import last_report


    def never(*args, **kwargs):
        raise AssertionError("prove ran on a region holding a collective")

    original = pipeline.prove
    pipeline.prove = never
    try:
        counters.clear()
        x = _tokens(0).requires_grad_(True)
        model = WaitInTheExperts()
        out = torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False})(x)
        out.sum().backward()
    finally:
        pipeline.prove = original
    assert dict(counters["moeblaze"]) == {"skipped": 1}
    (record,) = last_report()
    assert record.reason.startswith("expert-parallel dispatch inside the region: ")
    assert "_c10d_functional::wait_tensor" in record.reason
    torch.testing.assert_close(out, reference(x, _weights(), K))
