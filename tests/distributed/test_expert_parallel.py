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
comparison (split sizes from ``.tolist()``) is not rewritten: its region is reported left alone.

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
from torch._dynamo.utils import counters

import moeblaze_fx

E, K, D, H, WORLD = 4, 2, 16, 24, 2
TOKENS = 11  # per rank; not a multiple of anything
_TIMEOUT_S = 240


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, D, generator=gen) / D ** 0.5,
        "w1": torch.randn(E, H, D, generator=gen) / D ** 0.5,
        "w3": torch.randn(E, H, D, generator=gen) / D ** 0.5,
        "w2": torch.randn(E, D, H, generator=gen) / H ** 0.5,
    }


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(100 + rank))


def _route(x, router):
    scores = F.linear(x, router).softmax(-1)
    w, ids = scores.topk(K, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def _expert(rows, w1, w3, w2, compute):
    """One expert, its products in ``compute`` (torchtitan casts tokens and weights to bf16 for grouped products)."""
    c = lambda t: t.to(compute)  # noqa: E731
    return F.linear(F.silu(F.linear(c(rows), c(w1))) * F.linear(c(rows), c(w3)), c(w2)).to(rows.dtype)


def reference(x, weights, compute=None):
    """Every expert on one process: the same function without collectives."""
    w, ids = _route(x, weights["router"])
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        y = _expert(x[tok], weights["w1"][e], weights["w3"][e], weights["w2"][e], compute or x.dtype)
        out = out.index_add(0, tok, y * w[tok, slot, None])
    return out


def permute_indices(counts, experts: int, ranks: int, rows: int):
    """Rank-major received rows (``counts`` [ranks * experts]) to expert-major: the row each position reads, and the
    per-expert counts (torchtitan's _generate_permute_indices, without host sync)."""
    group_start = counts.cumsum(0) - counts
    by_rank = counts.view(ranks, experts)
    lengths = by_rank.t().reshape(-1)
    starts = group_start.view(ranks, experts).t().reshape(-1)
    out_ends = lengths.cumsum(0)
    position = torch.arange(rows, device=counts.device)
    shift = starts - (out_ends - lengths)
    return position + shift[torch.searchsorted(out_ends, position, right=True)], by_rank.sum(0)


class ExpertParallelMoE(torch.nn.Module):
    """torchtitan's expert-parallel MoE, reduced: this rank holds experts [rank*E/ep, (rank+1)*E/ep).
    ``experts``: "grouped_mm" (torchtitan's default, bf16 products) or "loop" (its per-expert loop over split sizes
    from ``.tolist()``, float32); ``collectives``: how the counts all-to-all is spelled."""

    def __init__(self, weights, rank: int, world: int, collectives: str, experts: str):
        super().__init__()
        local = slice(rank * E // world, (rank + 1) * E // world)
        self.router = torch.nn.Parameter(weights["router"].clone())
        self.w1 = torch.nn.Parameter(weights["w1"][local].clone())
        self.w3 = torch.nn.Parameter(weights["w3"][local].clone())
        self.w2 = torch.nn.Parameter(weights["w2"][local].clone())
        self.world = world
        self.collectives, self.experts = collectives, experts

    def _all_to_all(self, t, out_splits, in_splits):
        # torch.distributed.nn.functional.all_to_all_single (the autograd c10d one) raises under torch.compile
        # (torch 2.13 names the functional one instead): the tokens go through the functional collective always
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(t, out_splits, in_splits, dist.group.WORLD)

    def _grouped_mm(self, rows, per_expert):
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(rows.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(rows)

    def _loop(self, rows, per_expert):
        outs = [_expert(part, self.w1[e], self.w3[e], self.w2[e], rows.dtype)
                for e, part in enumerate(torch.split(rows, per_expert.tolist()))]
        return torch.cat(outs)

    def forward(self, x):
        ep, local = self.world, E // self.world
        w, ids = _route(x, self.router)
        flat = ids.view(-1)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        routed = x[order // K]
        with torch.no_grad():  # the counts all-to-all: how many rows each rank sends this rank, per local expert
            if self.collectives == "functional":
                from torch.distributed._functional_collectives import all_to_all_single
                counts_recv = all_to_all_single(counts, None, None, dist.group.WORLD)
                counts_recv = torch.ops._c10d_functional.wait_tensor(counts_recv)
            else:
                counts_recv = torch.empty_like(counts)
                dist.all_to_all_single(counts_recv, counts)
            send = counts.view(ep, local).sum(1).tolist()
            recv = counts_recv.view(ep, local).sum(1).tolist()
        received = self._all_to_all(routed, recv, send)  # the token all-to-all
        with torch.no_grad():
            permute, per_expert = permute_indices(counts_recv, local, ep, received.shape[0])
        experts = self._grouped_mm if self.experts == "grouped_mm" else self._loop
        y = experts(received[permute, :], per_expert)
        unpermuted = y.new_empty(received.shape)
        unpermuted[permute, :] = y
        # the all-to-all back, then un-sort and combine over the K choices
        back = self._all_to_all(unpermuted, send, recv)
        unsorted = torch.empty_like(back).index_copy(0, order, back)
        return (unsorted.view(-1, K, D) * w.unsqueeze(-1)).sum(1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _rank_main(rank: int, store: str, collectives: str, experts: str, dtype: torch.dtype, results) -> None:
    """One rank: compile the expert-parallel block, run forward and backward, compare with the single-process
    reference on this rank's tokens, and send back what the report said."""
    try:
        import moeblaze_fx  # noqa: F401  (registers the backend's ops)
        from moeblaze_fx.report import last_report

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        weights = {k: v.to(dtype) for k, v in _weights().items()}
        model = ExpertParallelMoE(weights, rank, WORLD, collectives, experts)
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
        want = reference(x_ref, ref_weights, torch.bfloat16 if experts == "grouped_mm" else None)
        want.backward(grad_out)
        local = slice(rank * E // WORLD, (rank + 1) * E // WORLD)
        errors = {"out": _rel(out.detach(), want.detach()), "x": _rel(x.grad, x_ref.grad)}
        # a weight's gradient sums over every rank's tokens: gather the reference's over the ranks
        for name in ("router", "w1", "w3", "w2"):
            g_ref = ref_weights[name].grad.float()
            dist.all_reduce(g_ref)
            g = getattr(model, name).grad.float()
            if name == "router":
                dist.all_reduce(g)
            else:
                g_ref = g_ref[local]
            errors[name] = _rel(g, g_ref)
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
        w, ids = _route(x, self.router)
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
  [0] skipped   tests/distributed/test_expert_parallel.py:263  -
      reason: expert-parallel dispatch inside the region: it holds 4 collective or opaque op(s) (_c10d_functional::wait_tensor; first at tests/distributed/test_expert_parallel.py:261), which are never run at compile time (every rank must run them alike), so the region is left alone. The local expert computation between the all-to-alls is rewritten on its own where the received rows are grouped by expert with counts and the experts are grouped products over them (torch._grouped_mm with offs = cumsum of the counts, torchtitan's); here it is not, so the block runs as compiled without the operator""")


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
    torch.testing.assert_close(out, reference(x, _weights()))
