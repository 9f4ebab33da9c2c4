"""The normalizer: one vocabulary of roles, in-place updates made functional, nothing else changed."""
import operator

import expecttest
import pytest
import torch
import torch.nn.functional as F

from moeblaze_fx.passes import format_graph
from moeblaze_fx.passes.normalize import normalize, role


def _graph(fn, *inputs):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    return graphs[0]


def router_and_inplace(x, w):
    probs = F.softmax(x @ w, dim=-1)
    vals, ids = probs.topk(2, dim=-1)
    vals /= vals.sum(-1, keepdim=True)  # in place on a fresh tensor: made functional
    out = torch.zeros_like(x)
    order = ids.flatten().argsort(stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())  # setitem: made functional
    out.index_add_(0, order // 2, x.repeat_interleave(2, 0)[order])  # made functional
    return out * vals.sum(-1, keepdim=True) + inv.sum()


def mutates_a_view(x):
    out = torch.zeros(4, 4)
    row = out[0]  # a view of out
    out.add_(1)  # must stay in place: row sees it
    return row + x.sum()


class TestNormalize(expecttest.TestCase):
    def test_roles_and_functional_form(self):
        gm = normalize(_graph(router_and_inplace, torch.randn(6, 4), torch.randn(4, 3)))
        roles = {n.name: role(n) for n in gm.graph.nodes if role(n)}
        self.assertEqual(roles, {"topk": "topk", "order": "dispatch", "repeat_interleave": "dispatch",
                                 "setitem_functional": "combine", "index_add__functional": "combine",
                                 "matmul": "matmul"})
        self.assertExpectedInline(format_graph(gm), """\
l_x = input
l_w = input
matmul = operator.matmul(l_x, l_w)
probs = torch.softmax(matmul, dim=-1)
topk = .topk(probs, 2, dim=-1)
vals = operator.getitem(topk, 0)
ids = operator.getitem(topk, 1)
sum_1 = .sum(vals, -1, keepdim=True)
vals_1_functional = operator.truediv(vals, sum_1)
out = torch.zeros_like(l_x)
flatten = .flatten(ids)
order = .argsort(flatten, stable=True)
inv = torch.empty_like(order)
arange = torch.arange(12)
setitem_functional = moeblaze_fx.passes.normalize.functional_setitem(inv, order, arange)
floordiv = operator.floordiv(order, 2)
repeat_interleave = .repeat_interleave(l_x, 2, 0)
getitem_2 = operator.getitem(repeat_interleave, order)
index_add__functional = .index_add(out, 0, floordiv, getitem_2)
sum_2 = .sum(vals_1_functional, -1, keepdim=True)
mul = operator.mul(index_add__functional, sum_2)
sum_3 = .sum(setitem_functional)
add = operator.add(mul, sum_3)
return (add,)""")

    def test_function_is_unchanged(self):
        x, w = torch.randn(6, 4), torch.randn(4, 3)
        gm = normalize(_graph(router_and_inplace, x, w))
        torch.testing.assert_close(gm(x, w)[0], router_and_inplace(x, w))

    def test_mutation_seen_through_a_view_stays(self):
        x = torch.randn(3)
        gm = normalize(_graph(mutates_a_view, x))
        self.assertIn("add_", [str(n.target) for n in gm.graph.nodes])
        torch.testing.assert_close(gm(x)[0], mutates_a_view(x))


def mutates_a_piece(x):
    out = x.clone()  # fresh
    out.chunk(2)[0].mul_(2)  # a piece of a tuple of views: updates out
    return out


def mutates_a_no_op_cast(x):
    out = x.clone()  # fresh
    same = out.to(out.dtype)  # out itself: no name says view, the recorded values share a storage
    same.add_(1)
    return out


def updates_twice(x):
    out = x.clone()
    out.add_(1)  # made functional; the second update reads the first's result, a tensor of its own
    out.mul_(2)
    return out


def updates_a_view_of_an_updated_tensor(x):
    out = x * 1.0
    out.mul_(2)  # made functional
    out[:2].mul_(0.5)  # a view of the new value: out, read after, sees it
    return out


def casts_after_an_update(x):
    out = x * 1.0
    out.mul_(2)  # made functional
    same = out.to(torch.float32)  # out itself
    out.add_(1)  # seen through `same`
    return same


def updates_an_alias_nothing_else_reads(x):
    w = (x * 2).to(x.dtype)  # an alias of x * 2, which is not read again
    w /= w.sum(-1, keepdim=True)
    return w


@pytest.mark.parametrize("fn,kept", [
    (mutates_a_piece, ["mul_"]), (mutates_a_no_op_cast, ["add_"]), (updates_twice, []),
    (updates_a_view_of_an_updated_tensor, ["mul_"]), (casts_after_an_update, ["add_"]),
    (updates_an_alias_nothing_else_reads, [])])
def test_updates_of_aliases_stay_in_place(fn, kept):
    """An update of a tensor another alias of which is read after it stays in place, however the alias is spelled
    (also after an earlier update of the same tensor was made functional); updates seen through one tensor only are
    made functional."""
    x = torch.randn(4, 3)
    gm = normalize(_graph(fn, x))
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_method" and n.target.endswith("_")
            or n.target is operator.itruediv] == kept
    torch.testing.assert_close(gm(x)[0], fn(x), rtol=0, atol=0)


def test_format_graph_spells_operators_one_way():
    """`a == b` is a call_method __eq__ under torch 2.11's Dynamo and operator.eq under 2.13: golden graphs read the
    same on both."""
    import torch.fx as fx

    g = fx.Graph()
    a = g.placeholder("a")
    eq = g.call_method("__eq__", (a, 0))
    g.output((eq, g.call_function(operator.eq, (a, 1)), g.call_method("masked_fill", (a, eq, 0))))
    assert format_graph(fx.GraphModule(torch.nn.Module(), g)).splitlines()[1:] == [
        "eq = operator.eq(a, 0)", "eq_1 = operator.eq(a, 1)", "masked_fill = .masked_fill(a, eq, 0)",
        "return (eq, eq_1, masked_fill)"]


def test_dunder_methods_have_the_operator_names():
    """torch 2.11's Dynamo records ``ids == e`` and ``a & b`` as .__eq__ / .__and__ method calls, 2.13's as
    operator.eq / operator.and_: one name each, so the vocabulary covers both."""
    import torch.fx as fx

    from moeblaze_fx.passes.normalize import canonical_name

    g = fx.Graph()
    a = g.placeholder("a")
    nodes = [g.call_method(m, (a, 0)) for m in ("__eq__", "__and__", "__iadd__", "__custom__", "eq")]
    nodes.append(g.call_function(operator.eq, (a, 0)))
    assert [canonical_name(n) for n in nodes] == ["eq", "and_", "iadd", "__custom__", "eq", "eq"]


def test_library_frames_are_judged_below_site_packages():
    """The report names the model's own line: torch's and transformers' integration frames are skipped, also when
    the virtual environment lives in a folder named torch (the GPU machine's /opt/torch/.venv)."""
    import os

    from moeblaze_fx.passes.source import is_plumbing

    venv = os.path.join(os.sep, "opt", "torch", ".venv", "lib", "python3.12", "site-packages")
    assert is_plumbing(os.path.join(venv, "torch", "nn", "modules", "module.py"))
    assert is_plumbing(os.path.join(venv, "transformers", "integrations", "moe.py"))
    assert not is_plumbing(os.path.join(venv, "transformers", "models", "mixtral", "modeling_mixtral.py"))
    assert is_plumbing(os.path.join(os.sep, "src", "pytorch", "torch", "nn", "functional.py"))
    assert not is_plumbing(os.path.join(os.sep, "src", "model.py"))


def updates_with_a_wider_dtype(x, scale):
    out = x * 2  # fresh, bfloat16
    out *= scale  # a float32 [1] tensor: the update stores bfloat16, `out * scale` would be float32
    out.mul_(scale)  # the method form alike
    return out


def test_an_update_made_functional_keeps_its_dtype():
    """Gemma 4's ``hidden_states *= self.layer_scalar`` (a float32 buffer) under casts to bf16: made functional, the
    product is cast back to the updated tensor's dtype, as the update stores it; the readers see bfloat16."""
    x, scale = torch.randn(3, 4, dtype=torch.bfloat16), torch.tensor([1.5])
    gm = normalize(_graph(updates_with_a_wider_dtype, x, scale))
    names = [str(n.target) for n in gm.graph.nodes]
    assert "mul_" not in names and operator.imul not in [n.target for n in gm.graph.nodes]
    assert sum(n.op == "call_method" and n.target == "to" for n in gm.graph.nodes) == 2
    got, want = gm(x, scale)[0], updates_with_a_wider_dtype(x, scale)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def picks(x, w):
    """Expert ids as top-1 picks side by side (PhiMoE's sparsemixer), and spellings that are no such ids."""
    s = x @ w
    first = s.max(dim=-1)[1].unsqueeze(-1)
    second = s.scatter(-1, first, float("-inf")).max(-1, keepdim=True)[1]
    third = s.argmax(-1, keepdim=True)
    ids = torch.cat((first, second, third), dim=-1)  # ids
    by_row = torch.cat((first, second), dim=0)  # along the tokens: no
    values = torch.cat((s.max(-1, keepdim=True)[0], s.max(-1, keepdim=True)[0]), -1)  # the maxima, not their indices
    unkept = torch.cat((s.argmax(-1), s.argmax(-1)), -1)  # the last dim not kept: [2T]
    over_tokens = torch.cat((s.argmax(0, keepdim=True), s.argmax(0, keepdim=True)), -1)  # a maximum over the tokens
    return ids.sum() + by_row.sum() + values.sum() + unkept.sum() + over_tokens.sum()


def test_top1_picks_side_by_side_are_ids():
    gm = normalize(_graph(picks, torch.randn(6, 4), torch.randn(4, 5)))
    assert [(n.name, canonical) for n in gm.graph.nodes if role(n) == "topk"
            for canonical in [str(n.target.__name__)]] == [("ids", "cat")]
