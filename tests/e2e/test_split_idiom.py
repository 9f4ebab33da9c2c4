"""Per-expert ``nn.Linear`` experts over chunks from ``split(counts.tolist())``, then ``cat`` and
``index_add_``.

``.tolist()`` of the counts makes Python numbers from data. What Dynamo does with it (torch 2.13):
* default config: a graph break at ``.tolist()``; the router is one graph (reported with the break's
  file:line and the fix), the experts another, specialised to the counts until they change;
* ``torch._dynamo.config.capture_scalar_outputs = True`` or ``fullgraph=True``: one graph; the counts
  become unbacked SymInts (``getitem`` + ``item``), ``split`` takes them as sizes, and runtime asserts
  (each count in [0, T*K], their sum == T*K) guard them. The region, asserts included, is rewritten.
* ``torch.bincount(ids, minlength=E)`` has a data-dependent length (an id >= E lengthens it): without
  capture_dynamic_output_shape_ops Dynamo breaks the graph at the bincount, even with
  capture_scalar_outputs; with it (or with fullgraph=True), ``.tolist()`` of that length fails to
  compile. Counts of static length (``histc``, ``one_hot(...).sum(0)``) are what can be one graph.
"""
import re

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_eager_and_compiled
from torch._dynamo.utils import counters

import moeblaze_fx
from moeblaze_fx.backend import rewrite_graph
from moeblaze_fx.passes import format_graph


class SwiGLUExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SplitMoE(nn.Module):
    def __init__(self, d=16, h=24, E=4, K=2, counts="histc"):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(d, h) for _ in range(E))
        self.E, self.K, self.counts = E, K, counts

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        w, ids = probs.topk(self.K, dim=-1)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        if self.counts == "bincount":  # length max(E, largest id + 1): data-dependent
            counts = torch.bincount(flat, minlength=self.E)
        elif self.counts == "histc":  # length E
            counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E).long()
        else:  # length E
            counts = F.one_hot(flat, self.E).sum(0)
        tok = order // self.K
        chunks = x[tok].split(counts.tolist())
        y = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y * w.flatten()[order, None])
        return out


def _x(T=10, seed=0):
    return torch.randn(T, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _new_records(before: int):
    """The records of every graph compiled since ``before`` graphs had been reported."""
    return [r for graph in moeblaze_fx.report.all_reports()[before:] for r in graph]


@pytest.mark.parametrize("T", [10, 1], ids=["T10", "T1-two-experts-empty"])  # K=2 of E=4: T=1 leaves two empty
@pytest.mark.parametrize("counts", ["histc", "one_hot-sum"])
@pytest.mark.parametrize("capture", ["capture_scalar_outputs", "fullgraph"])
def test_split_over_tolist_is_rewritten(capture, counts, T):
    torch.manual_seed(0)
    model = SplitMoE(counts=counts)
    with torch._dynamo.config.patch(capture_scalar_outputs=capture == "capture_scalar_outputs"):
        got = run_eager_and_compiled(model, (_x(T),), fullgraph=capture == "fullgraph")
    assert got == {"rewritten": 1}  # one graph: a split router would add a skipped record
    (record,) = moeblaze_fx.last_report()  # the ModuleList's Linear weights, as gate, up and down
    assert re.search(r"experts\.\*\.gate\.weight.*experts\.\*\.up\.weight.*down = experts\.\*\.down\.weight",
                     record.layout), record.layout


def test_split_through_inductor_recompute():
    torch.manual_seed(0)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = run_eager_and_compiled(SplitMoE(), (_x(),), fullgraph=False, options={"checkpoint": "recompute"})
    assert got == {"rewritten": 1}


def test_split_dynamic_token_count():
    """dynamic=True: the sizes are unbacked SymInts whose sum is a multiple of a symbolic T."""
    torch.manual_seed(0)
    model = SplitMoE()
    counters.clear()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(model, backend="moeblaze", dynamic=True, options={"inductor": False})
        for T in (5, 9, 13):
            x = _x(T, seed=T)
            torch.testing.assert_close(compiled(x), model(x))
    assert dict(counters["moeblaze"]) == {"rewritten": 1}
    assert dict(counters["stats"])["unique_graphs"] == 1


def test_runtime_asserts_go_with_the_region():
    """The captured graph guards the unbacked counts with runtime asserts; none survives the rewrite."""
    torch.manual_seed(0)
    before, after = [], []

    def capture(gm, example_inputs):
        before.append(format_graph(gm))
        new = rewrite_graph(gm, example_inputs)
        after.append(format_graph(new))
        return new.forward

    torch.compile(SplitMoE(), backend=capture, fullgraph=True)(_x())
    assert "aten._assert_scalar.default" in before[0]  # torch 2.13: 0 <= u_e <= 20 for each expert; sum == 20
    assert ".split(" in before[0] and ".item(" in before[0]
    for gone in ("_assert_scalar", ".split(", ".item(", "sym_sum"):
        assert gone not in after[0], gone


@pytest.mark.parametrize(
    "counts,capture_scalar_outputs",
    [("histc", False), ("bincount", False), ("bincount", True)],
    ids=["histc-default", "bincount-default", "bincount-capture_scalar_outputs"],
)
def test_graph_break_compiles_and_is_reported(counts, capture_scalar_outputs):
    """Without capture_scalar_outputs (or at the bincount) Dynamo splits the block: compilation still
    succeeds with eager results, and the one record names the break's file:line and the fix."""
    torch.manual_seed(0)
    before = len(moeblaze_fx.report.all_reports())
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalar_outputs):
        got = run_eager_and_compiled(SplitMoE(counts=counts), (_x(),), fullgraph=False)
    assert got == {"skipped": 1}
    (record,) = _new_records(before)  # the expert graphs hold no top-k: no candidate there
    line = {"histc": "chunks = x[tok].split(counts.tolist())",
            "bincount": "counts = torch.bincount(flat, minlength=self.E)"}[counts]
    assert "Dynamo split this MoE block at tests/e2e/test_split_idiom.py:" in record.reason
    assert f"(`{line}`)" in record.reason


class TestGolden(expecttest.TestCase):
    def _report_of_split(self, counts):
        torch.manual_seed(0)
        before = len(moeblaze_fx.report.all_reports())
        torch.compile(SplitMoE(counts=counts), backend="moeblaze", options={"inductor": False})(_x())
        return moeblaze_fx.report.format_table(_new_records(before))

    def test_rewritten_graph(self):
        torch.manual_seed(0)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(format_graph(rewrite_graph(gm, example_inputs)))
            return gm.forward

        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            torch.compile(SplitMoE(), backend=capture)(_x())
        (graph,) = graphs
        self.assertExpectedInline(graph, """\
router.weight = input
l_x = input
experts.0.gate.weight = input
experts.0.up.weight = input
experts.0.down.weight = input
experts.1.gate.weight = input
experts.1.up.weight = input
experts.1.down.weight = input
experts.2.gate.weight = input
experts.2.up.weight = input
experts.2.down.weight = input
experts.3.gate.weight = input
experts.3.up.weight = input
experts.3.down.weight = input
linear = torch.linear(l_x, router.weight, None)
probs = torch.softmax(linear, dim=-1)
topk = .topk(probs, 2, dim=-1)
w = operator.getitem(topk, 0)
ids = operator.getitem(topk, 1)
flatten_1 = .flatten(w)
reshape = torch.reshape(flatten_1, (-1, 2))
moe_ffn_default = moeblaze.moe_ffn.default(l_x, ids, reshape, [experts.0.gate.weight, experts.1.gate.weight, experts.2.gate.weight, experts.3.gate.weight, experts.0.up.weight, experts.1.up.weight, experts.2.up.weight, experts.3.up.weight, experts.0.down.weight, experts.1.down.weight, experts.2.down.weight, experts.3.down.weight], [4, 0, 4, 0, 0, 16, 1, 24, 16, 4, 4, 0, 0, 16, 1, 24, 16, 8, 4, 0, 0, 24, 1, 16, 24, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0], 'swiglu', 'activations', 3728270)
getitem = operator.getitem(moe_ffn_default, 0)
return (getitem,)""")

    def test_report_of_tolist_break(self):
        self.assertExpectedInline(self._report_of_split("histc"), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_split_idiom.py:50  -
      reason: Dynamo split this MoE block at tests/e2e/test_split_idiom.py:60 (`chunks = x[tok].split(counts.tolist())`): .tolist() or .item() turns a tensor into Python numbers (aten._local_scalar_dense.default), so the graph ends there and the experts run in other graphs. Set torch._dynamo.config.capture_scalar_outputs = True (or compile with fullgraph=True) to keep them in the graph as unbacked sizes, or keep the counts a tensor (torch._grouped_mm with offsets = cumsum of the counts)""")

    def test_report_of_bincount_break(self):
        self.assertExpectedInline(self._report_of_split("bincount"), """\
moeblaze: 0 of 1 MoE candidate(s) rewritten
  [0] skipped   tests/e2e/test_split_idiom.py:50  -
      reason: Dynamo split this MoE block at tests/e2e/test_split_idiom.py:54 (`counts = torch.bincount(flat, minlength=self.E)`): torch.bincount's output length depends on the ids (an id >= minlength lengthens it), so the graph ends there and the experts run in other graphs. Count with a static length instead: torch.histc(ids.float(), bins=E, min=0, max=E) or F.one_hot(ids, E).sum(0); capture_dynamic_output_shape_ops = True keeps bincount in the graph, but .tolist() of its data-dependent length then fails to compile""")
