"""passes/order.py: the compiled backward computes the gate|up gradients where they cost least (docs/memory.md).

A tiny gpt-oss causal LM (biases, interleaved gate|up) compiled whole, bf16, on the CPU path: its three-operator
backward goes through AOTAutograd and Inductor as on the GPU."""
import operator
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import moeblaze_fx.backend as backend
from helpers import cpu_peak_bytes
from moeblaze_fx.bench.models import build_model
from moeblaze_fx.passes.order import SinkWeightGradients, sink_weight_gradients

# 32 experts of d = h = 128, 128 tokens: one layer's gate|up gradient (with its bias) is 32 x 256 x 129 x 2 bytes =
# 2.1 MB against the 128 tokens' dA|dB and x (128 KB + 32 KB): worth moving. At these sizes Inductor's own
# reordering keeps the graph's order; at the tiny family's it already moves dw last by itself.
MANY_EXPERTS = dict(hidden_size=128, intermediate_size=128, num_local_experts=32, vocab_size=4096,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16)
TOKENS = 128
# 2 experts, 512 tokens of top-2: dA|dB is 1024 x 64 x 2 bytes = 128 KB and x 64 KB, against a 2 x 64 x 65 x 2 =
# 17 KB gradient: not worth moving
FEW_EXPERTS = dict(num_local_experts=2, intermediate_size=32)


def _step(overrides: dict, tokens: int, order: bool = True):
    """(backward output code, every parameter's gradient, the CPU peak of a second step in bytes)."""
    model = build_model("gpt_oss", layers=2, tiny=True, dtype=torch.bfloat16, overrides=overrides)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="moeblaze")

    def step():
        compiled(input_ids=ids, labels=ids).loss.backward()

    counters.clear()
    patch = pytest.MonkeyPatch()
    if not order:
        patch.setattr(backend, "_order_patches", lambda: {})
    try:
        _, codes = run_and_get_code(step)
    finally:
        patch.undo()
    assert counters["moeblaze"]["rewritten"] == 2 and len(codes) == 2
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return codes[1], grads, cpu_peak_bytes(step)


def _calls(code: str) -> list[str]:
    """The kernels and operators the backward's call() runs, in order: our operators by name, the rest as 'other'."""
    out = []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("#") or "async_compile" in line or "assert_size_stride" in line:
            continue
        op = re.search(r"torch\.ops\.moeblaze\.moe_ffn_backward_(\w+)\.default\(", line)
        if op:
            out.append(op.group(1))
        elif re.search(r"extern_kernels\.\w+\(|\.run\(|torch\.ops\.aten\.\w+", line):
            out.append("other")
    return out


def test_gate_up_gradients_come_last_and_lower_the_peak():
    code, grads, peak = _step(MANY_EXPERTS, TOKENS)
    calls = _calls(code)
    assert calls.count("act") == calls.count("dx") == calls.count("dw") == 2
    assert calls[-2:] == ["dw", "dw"]  # after every other kernel: their results' first reader is the output
    torch._dynamo.reset()
    code_before, grads_before, peak_before = _step(MANY_EXPERTS, TOKENS, order=False)
    calls_before = _calls(code_before)
    assert calls_before[calls_before.index("dx") + 1] == "dw"  # where autograd recorded it: right after dx
    # the same kernels on the same operands: bitwise the same gradients
    assert grads.keys() == grads_before.keys()
    assert all(torch.equal(grads[n], grads_before[n]) for n in grads)
    # measured 2026-11-28: 8.89 MB against 10.92 without the pass
    assert peak < 0.9 * peak_before, (peak / 1e6, peak_before / 1e6)


def test_gate_up_gradients_stay_where_moving_them_would_keep_more_alive():
    calls = _calls(_step(FEW_EXPERTS, 512)[0])
    assert calls.count("dw") == 2
    torch._dynamo.reset()
    assert _calls(_step(FEW_EXPERTS, 512, order=False)[0]) == calls  # the pass moved nothing


def test_a_users_own_post_grad_pass_is_kept():
    seen = []

    def own(graph):
        seen.append(sum(1 for n in graph.nodes if n.op == "call_function"))

    with torch._inductor.config.patch(post_grad_custom_post_pass=own):
        assert backend._order_patches() == {}
        calls = _calls(_step(MANY_EXPERTS, TOKENS)[0])
    assert len(seen) == 2  # the forward's graph and the backward's
    assert calls[calls.index("dx") + 1] == "dw"  # not moved


def test_the_pass_on_a_graph_without_moeblaze_operators_moves_nothing():
    gm = torch.fx.symbolic_trace(lambda a, b: (a @ b).relu() + b)
    before = [n.name for n in gm.graph.nodes]
    assert sink_weight_gradients(gm.graph) == 0
    assert [n.name for n in gm.graph.nodes] == before
    assert SinkWeightGradients().uuid().startswith("moeblaze-sink-weight-gradients-")


def _graph(tokens: int, experts: int):
    """A post-grad-like graph: dw's gradient (``[E, 2h, d]``, read by the output through getitem) beside another
    node that the output also reads; meta values as Inductor's graphs carry them."""
    d, h, K = 16, 8, 2
    g = torch.fx.Graph()
    vals = {"dpre": torch.empty(tokens * K, 2 * h), "x": torch.empty(tokens, d),
            "ids": torch.empty(tokens, K, dtype=torch.int64), "w": torch.empty(tokens, K),
            "gate_up": torch.empty(experts, 2 * h, d), "down": torch.empty(experts, d, h),
            "plan": torch.empty(tokens * K, dtype=torch.int32)}
    nodes = {}
    for name, v in vals.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = v
    dw = g.call_function(torch.ops.moeblaze.moe_ffn_backward_dw.default,
                         (nodes["dpre"], nodes["x"], nodes["ids"], nodes["w"], [nodes["gate_up"], nodes["down"]],
                          [0], [nodes["plan"]], "swiglu"))
    dw.meta["val"] = [torch.empty(experts, 2 * h, d)]
    grad = g.call_function(operator.getitem, (dw, 0))
    other = g.call_function(torch.ops.aten.mul.Tensor, (nodes["x"], nodes["x"]))
    g.output((grad, other))
    return g


def _order(graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "call_function"]


def test_sink_moves_the_call_and_its_views_before_the_first_reader():
    graph = _graph(tokens=4, experts=8)  # gradient 8 x 16 x 16 x 4 bytes against 4 tokens' operands
    assert _order(graph) == ["moe_ffn_backward_dw_default", "getitem", "mul_tensor"]
    assert sink_weight_gradients(graph) == 1
    assert _order(graph) == ["mul_tensor", "moe_ffn_backward_dw_default", "getitem"]
    assert sink_weight_gradients(graph) == 0  # already there


def test_sink_leaves_a_call_whose_operands_outweigh_its_gradients():
    graph = _graph(tokens=512, experts=2)
    assert sink_weight_gradients(graph) == 0
    assert _order(graph) == ["moe_ffn_backward_dw_default", "getitem", "mul_tensor"]
