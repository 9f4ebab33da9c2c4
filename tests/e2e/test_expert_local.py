"""The local expert computation of expert parallelism, alone (issue 41 point 3): rows grouped by expert with counts.

After the token all-to-all a rank holds rows from every rank, grouped rank-major by its local experts, with their
counts ``[ranks * E]``. torchtitan permutes them expert-major (indices from the counts: ``searchsorted`` over their
cumulative sums, no host sync), runs ``torch._grouped_mm`` with ``offs = cumsum`` of the per-expert counts, and
un-permutes (``new_empty`` + index assignment). Without expert parallelism it runs the same code with one rank
(``indices_padding_wrapper``), and it compiles the experts module on its own, so the counts are a graph input. That
is the operator with K = 1, unit weights and ids from the counts; it is rewritten, and a grouping that does not match
the counts is not.
"""
from __future__ import annotations

import functools

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from helpers import TOL, rewritten_graph, run_eager_and_compiled

import moeblaze_fx

E, D, H = 4, 16, 24


def permute_indices(counts: torch.Tensor, experts: int, ranks: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-major rows (``counts`` [ranks * experts]: rank 0's experts, then rank 1's...) to expert-major: the row
    each position reads, and the per-expert counts. torchtitan's spelling (models/common/moe/utils.py), rewritten."""
    group_start = counts.cumsum(0) - counts
    by_rank = counts.view(ranks, experts)
    per_expert = by_rank.sum(0)
    lengths = by_rank.t().reshape(-1)  # expert-major order of the groups
    starts = group_start.view(ranks, experts).t().reshape(-1)
    out_ends = lengths.cumsum(0)
    shift = starts - (out_ends - lengths)
    position = torch.arange(rows, device=counts.device)
    return position + shift[torch.searchsorted(out_ends, position, right=True)], per_expert


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts with its permute wrapper: float32 weights, bf16 grouped products (torch._grouped_mm
    takes bf16 on the CPU, and torchtitan casts so). ``ranks``: how many ranks' rows are grouped (1 without expert
    parallelism). ``grouping``: "counts" (right), "flipped" (the products' offsets read the counts backwards: a
    grouping that does not match the counts), "expert_major" (rows already grouped by expert: no permute)."""

    def __init__(self, ranks: int = 1, grouping: str = "counts"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(E, H, D, generator=gen) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H, generator=gen) / H ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, D, generator=gen) / D ** 0.5)
        self.ranks, self.grouping = ranks, grouping

    def _experts(self, x, per_expert):
        if self.grouping == "flipped":
            per_expert = per_expert.flip(0)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)

    def forward(self, x, counts):
        if self.grouping == "expert_major":
            return self._experts(x, counts)
        order, per_expert = permute_indices(counts, E, self.ranks, x.shape[0])
        y = self._experts(x[order, :], per_expert)
        out = y.new_empty(x.shape)
        out[order, :] = y
        return out


def _inputs(ranks: int, rows: int = 23):  # 23 rows: not a multiple of anything
    gen = torch.Generator().manual_seed(1)
    member = torch.randint(0, ranks * E, (rows,), generator=gen)
    member[member == 2] = 3  # group 2 (an expert of rank 0) empty
    counts = torch.bincount(member, minlength=ranks * E)
    return torch.randn(rows, D, generator=gen).requires_grad_(True), counts


@pytest.mark.parametrize("ranks,grouping", [
    (1, "counts"),  # torchtitan without expert parallelism: the permute wrapper with one rank
    (2, "counts"),  # what a rank of two receives under expert parallelism: rank-major groups
    (1, "expert_major"),  # rows already grouped by expert: the products alone
], ids=["one-rank", "two-ranks-rank-major", "expert-major-rows"])
def test_count_grouped_experts_are_rewritten(ranks, grouping):
    counts = run_eager_and_compiled(GroupedExperts(ranks, grouping), _inputs(ranks), dtype=torch.bfloat16)
    assert counts == {"rewritten": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.idiom == "grouped_mm over rows grouped by counts" and record.K == 1 and record.E == E
    assert record.layout == "gate = w1, up = w3, down = w2; activation swiglu"


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_grouping_that_does_not_match_the_counts_is_not_rewritten(ranks):
    """The products' offsets read the counts backwards: the rows of one expert go through another's weights, which the
    proof's own counts (an empty group among them) expose."""
    counts = run_eager_and_compiled(GroupedExperts(ranks, "flipped"), _inputs(ranks), dtype=torch.bfloat16)
    assert counts == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("the region's output differs from the MoE operator"), record.reason


def experts_on_plain_weights(x, counts, w1, w3, w2, flipped=False):
    """GroupedExperts' computation over weights passed as arguments (a function compiled with them: plain tensors,
    not parameters), already cast to bf16 by the caller, outside the compiled region. The ranks are read off the
    counts ``[ranks * E]``; ``flipped``: the offsets read the counts backwards (another function than the
    operator's)."""
    order, per_expert = permute_indices(counts, E, counts.shape[0] // E, x.shape[0])
    offsets = torch.cumsum(per_expert.flip(0) if flipped else per_expert, dim=0, dtype=torch.int32)
    rows = x[order, :].bfloat16()
    h = F.silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)
    out = y.new_empty(x.shape)
    out[order, :] = y
    return out


def _masters():
    """float32 expert weights [E, out, in] (leaves, as an optimizer's master weights), w1, w3, w2."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(E, *shape, generator=gen) / shape[1] ** 0.5).requires_grad_()
            for shape in ((H, D), (H, D), (D, H))]


def _plain_step(fn, x, counts, masters, cast=lambda w: w.bfloat16()):
    """Forward with the masters cast outside ``fn``, backward to the tokens and through the casts to the masters."""
    y = fn(x, counts, *(cast(w) for w in masters))
    loss = (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum()
    return (y.detach(), *torch.autograd.grad(loss, (x, *masters)))


def _assert_matches(got, want, tol):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype == torch.float32, (i, a.dtype, b.dtype)  # the masters' gradients stay float32
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= tol, f"tensor {i} (output, x, w1, w3, w2): relative error {err:.3g}"


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks-rank-major"])
def test_plain_tensor_weights_cast_outside_are_rewritten(ranks):
    """Stacked weights cast to bf16 outside the compiled function (``w.bfloat16()`` of float32 masters, passed in):
    graph inputs that are plain tensors, the operator's weights as parameters are; the output, the tokens' gradient
    and the masters' float32 gradients (through the casts) as in eager."""
    x, counts = _inputs(ranks)
    masters = _masters()
    want = _plain_step(experts_on_plain_weights, x, counts, masters)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(experts_on_plain_weights, backend="moeblaze", fullgraph=True, options={"inductor": False})
    got = _plain_step(compiled, x, counts, masters)
    assert dict(counters["moeblaze"]) == {"rewritten": 1}, [r.reason for r in moeblaze_fx.last_report()]
    (record,) = moeblaze_fx.last_report()
    assert record.idiom == "grouped_mm over rows grouped by counts" and (record.K, record.E) == (1, E)
    assert record.dtype == "bfloat16"
    assert record.layout == "gate = w1, up = w3, down = w2; activation swiglu", record.layout
    _assert_matches(got, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_plain_tensor_weights_grouped_against_the_counts_are_not_rewritten(ranks):
    """The same plain weights with the offsets read backwards: the proof rejects it and the function runs as
    written."""
    x, counts = _inputs(ranks)
    masters = _masters()
    flipped = functools.partial(experts_on_plain_weights, flipped=True)
    want = _plain_step(flipped, x, counts, masters)
    torch._dynamo.reset()
    counters.clear()
    got = _plain_step(torch.compile(flipped, backend="moeblaze", fullgraph=True, options={"inductor": False}), x,
                      counts, masters)
    assert dict(counters["moeblaze"]) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("the region's output differs from the MoE operator"), record.reason
    _assert_matches(got, want, 1e-6)


def test_plain_tensor_weights_under_dynamic_true():
    """Under dynamic=True plain weights get symbolic E, h and d (parameters stay static): skipped with a reason that
    says what to change (was: "internal error while extracting: TypeError: unhashable type: non-nested SymInt"), and
    rewritten once the weights are marked static as the reason says."""
    x, counts = _inputs(2)
    masters = _masters()
    want = _plain_step(experts_on_plain_weights, x, counts, masters)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(experts_on_plain_weights, backend="moeblaze", fullgraph=True, dynamic=True,
                             options={"inductor": False})
    got = _plain_step(compiled, x, counts, masters)
    assert dict(counters["moeblaze"]) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("the expert weights ['w1', 'w3', 'w2'] have dynamic sizes"), record.reason
    assert "torch._dynamo.mark_static(w)" in record.reason, record.reason
    _assert_matches(got, want, 1e-6)

    def static(w):
        w = w.bfloat16()
        torch._dynamo.mark_static(w)
        return w

    torch._dynamo.reset()
    counters.clear()
    got = _plain_step(compiled, x, counts, masters, cast=static)
    assert dict(counters["moeblaze"]) == {"rewritten": 1}, [r.reason for r in moeblaze_fx.last_report()]
    _assert_matches(got, want, TOL[torch.bfloat16])


class TestGolden(expecttest.TestCase):
    def test_report(self):
        torch.compile(GroupedExperts(2), backend="moeblaze", fullgraph=True, options={"inductor": False})(*_inputs(2))
        self.assertExpectedInline(moeblaze_fx.report.format_table(moeblaze_fx.last_report()), """\
moeblaze: 1 of 1 MoE candidate(s) rewritten
  [0] rewritten tests/e2e/test_expert_local.py:70  grouped_mm over rows grouped by counts
      T=23 d=16 h=24 E=4 K=1 bfloat16  policy=activations  saved for backward: 14.9 KB -> 3.1 KB
      layout: gate = w1, up = w3, down = w2; activation swiglu; check: numerical: forward and gradients within rel. error 1e-02 of the operator""")

    def test_graph(self):
        self.assertExpectedInline(rewritten_graph(GroupedExperts(2), *_inputs(2)), """\
l_x = input
l_counts = input
w1 = input
w3 = input
w2 = input
to = .to(l_x, torch.bfloat16)
ids_from_counts = moeblaze_fx.passes.extract.ids_from_counts(l_counts, to, 4)
unit_weights = moeblaze_fx.passes.extract.unit_weights(to)
to_1 = .to(w1, torch.bfloat16)
to_2 = .to(w3, torch.bfloat16)
to_3 = .to(w2, torch.bfloat16)
moe_ffn_default = moeblaze.moe_ffn.default(to, ids_from_counts, unit_weights, [to_1, to_2, to_3], [4, 0, 1, 0, 384, 16, 1, 24, 16, 1, 1, 0, 384, 16, 1, 24, 16, 2, 1, 0, 384, 24, 1, 16, 24, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 14913080)
getitem_2 = operator.getitem(moe_ffn_default, 0)
to_4 = .to(getitem_2, torch.float32)
return (to_4,)""")


def test_dynamic_rows_through_inductor():
    """The row count a dynamic size (as it is under expert parallelism, where the token all-to-all decides it), the
    graph compiled by Inductor after the rewrite: one compile for two row counts, against eager."""
    model = GroupedExperts(2)
    compiled = torch.compile(model, backend="moeblaze", dynamic=True, fullgraph=True)
    counters.clear()
    for rows in (23, 31):
        x, counts = _inputs(2, rows)
        got, want = compiled(x, counts), model(x, counts)
        torch.testing.assert_close(got, want, rtol=4e-2, atol=4e-2)
    assert dict(counters["moeblaze"]) == {"rewritten": 1}
