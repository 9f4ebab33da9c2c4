"""Expert parameters in the forms real code hands them to the experts (issue 40 point 2): DTensor parameters
unwrapped with ``.to_local()`` in forward (torchtitan under TP/EP; here a one-process gloo world and a
world_size=1 DeviceMesh on the CPU), a flat ``[E*h, d]`` parameter viewed per expert, and casts. Each is rewritten,
matches eager, and its gradients reach the original parameters (a DTensor's as a DTensor)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moeblaze_fx

D, H, E, K = 16, 24, 4, 2


class Block(nn.Module):
    """torchtitan-style grouped experts; ``form`` says how each expert weight reaches torch._grouped_mm."""

    def __init__(self, form: str, cast=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(E, D, generator=gen) / D ** 0.5)
        w1 = torch.randn(E, H, D, generator=gen) / D ** 0.5
        w3 = torch.randn(E, H, D, generator=gen) / D ** 0.5
        w2 = torch.randn(E, D, H, generator=gen) / H ** 0.5
        if form == "flat_view":  # stored [E*h, d], viewed per expert in forward
            w1, w3, w2 = w1.reshape(E * H, D), w3.reshape(E * H, D), w2.reshape(E * D, H)
        self.w1, self.w3, self.w2 = nn.Parameter(w1), nn.Parameter(w3), nn.Parameter(w2)
        self.form, self.cast = form, cast

    def weight(self, w, rows):
        if self.form == "dtensor":
            w = w.to_local()
        elif self.form == "flat_view":
            w = w.view(E, rows, -1)
        return w.to(self.cast) if self.cast is not None else w

    def forward(self, x):
        w, ids = F.linear(x, self.router).softmax(-1).topk(K, dim=-1)
        flat = ids.view(-1)
        if self.cast is None:  # torch._grouped_mm takes bf16 only on the CPU: batched products over gathered weights
            w1, w3, w2 = self.weight(self.w1, H)[flat], self.weight(self.w3, H)[flat], self.weight(self.w2, D)[flat]
            rows = x.repeat_interleave(K, dim=0).unsqueeze(-1)
            h = F.silu(torch.bmm(w1, rows)) * torch.bmm(w3, rows)
            y = torch.bmm(w2, h).squeeze(-1)
            return (y.view(-1, K, D) * w.unsqueeze(-1)).sum(1)
        order = torch.argsort(flat, stable=True)
        offsets = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E), 0, dtype=torch.int32)
        rows = x[order // K]
        if self.cast is not None:
            rows = rows.to(self.cast)
        w1, w3, w2 = self.weight(self.w1, H), self.weight(self.w3, H), self.weight(self.w2, D)
        h = F.silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
        y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)
        out = torch.empty_like(y).index_copy(0, order, y)
        return (out.view(-1, K, D) * w.unsqueeze(-1)).sum(1)


@pytest.fixture
def one_rank_world(tmp_path):
    """A one-process gloo world (a file store: no port to collide on)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check(model, tol):
    x = torch.randn(13, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)

    def step(fn):
        for t in list(model.parameters()) + [x]:
            t.grad = None
        out = fn(x)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return out.detach(), [(type(p.grad), _local(p.grad).clone()) for p in model.parameters()] + [(None, x.grad)]

    want, want_grads = step(model)
    counters.clear()
    got, got_grads = step(torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False}))
    assert dict(counters["moeblaze"]) == {"rewritten": 1}, [r.reason for r in moeblaze_fx.last_report()]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for (kind_got, g), (kind_want, w) in zip(got_grads, want_grads):
        assert kind_got is kind_want  # a DTensor parameter's gradient is a DTensor, as in eager
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["fp32", "bf16_casts"])
def test_dtensor_to_local_parameters_are_rewritten(one_rank_world, cast):
    """Was 'internal error while proving: ... invalid python storage' (the proof ran the DTensor itself)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = Block("dtensor", cast)
    for name in ("w1", "w3", "w2"):
        setattr(model, name, nn.Parameter(distribute_tensor(getattr(model, name).detach(), one_rank_world,
                                                            [Shard(0)])))
    _check(model, 1e-5 if cast is None else 3e-2)


@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["fp32", "bf16_casts"])
def test_flat_parameters_viewed_per_expert_are_rewritten(cast):
    _check(Block("flat_view", cast), 1e-5 if cast is None else 3e-2)


def _loop_block(x, router, w_gu, w_d, k=2, shift=0):
    """A per-expert loop over weights passed as plain tensors (a function compiled with them as arguments);
    ``shift``: expert e reads expert e + shift's gate/up weights (another function than the operator's)."""
    weights, ids = (x @ router).softmax(-1).topk(k, -1)
    y = torch.zeros_like(x)
    for e in range(w_gu.shape[0]):
        tok, slot = torch.where(ids == e)
        gate, up = (x[tok] @ w_gu[(e + shift) % w_gu.shape[0]].t()).chunk(2, -1)
        y.index_add_(0, tok, (F.silu(gate) * up) @ w_d[e].t() * weights[tok, slot, None])
    return y


def test_plain_tensor_weights_are_rewritten():
    """Expert weights that reach the region as plain tensors (graph inputs, not parameters) are the operator's
    weights; gradients reach them as in eager. Was: skipped with "expected the region to read tokens [T, d] and
    combine weights [T, K] besides the ids and parameters"."""
    g = torch.Generator().manual_seed(3)
    E, h = 4, 8
    x = torch.randn(21, D, generator=g).requires_grad_()
    router = torch.randn(D, E, generator=g)
    w_gu = (torch.randn(E, 2 * h, D, generator=g) / D ** 0.5).requires_grad_()
    w_d = (torch.randn(E, D, h, generator=g) / h ** 0.5).requires_grad_()

    def step(fn):
        y = fn(x, router, w_gu, w_d)
        return (y.detach(), *torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum(),
                                                 (x, w_gu, w_d)))

    want = step(_loop_block)
    counters.clear()
    got = step(torch.compile(_loop_block, backend="moeblaze", fullgraph=True, options={"inductor": False}))
    assert dict(counters["moeblaze"]) == {"rewritten": 1}, [r.reason for r in moeblaze_fx.last_report()]
    assert moeblaze_fx.last_report()[0].layout.startswith("gate = w_gu"), moeblaze_fx.last_report()[0].layout
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # each expert reading the next expert's plain weights is another function: the proof keeps it as written
    counters.clear()
    torch._dynamo.reset()
    shifted = torch.compile(lambda *a: _loop_block(*a, shift=1), backend="moeblaze", fullgraph=True,
                            options={"inductor": False})(x, router, w_gu, w_d)
    assert dict(counters["moeblaze"]) == {"skipped": 1}, dict(counters["moeblaze"])
    assert "differs from the MoE operator" in moeblaze_fx.last_report()[0].reason
    torch.testing.assert_close(shifted, _loop_block(x, router, w_gu, w_d, shift=1), rtol=1e-6, atol=1e-6)


def test_plain_tensor_weights_under_dynamic_true_are_rewritten_once_their_sizes_are_fixed():
    """dynamic=True gives plain tensors symbolic sizes; here the router parameter fixes d, and E and h follow from the
    products (Dynamo specialises them to constants). Such sizes are the operator's fixed sizes: rewritten, and the
    output and every gradient (tokens, router, plain weights) as in eager. Was: "internal error while extracting:
    TypeError: unhashable type: non-nested SymInt"."""
    g = torch.Generator().manual_seed(3)
    E, h = 4, 8

    class Router(nn.Module):  # the router a parameter, the expert weights passed in
        def __init__(self):
            super().__init__()
            self.router = nn.Parameter(torch.randn(D, E, generator=g))

        def forward(self, x, w_gu, w_d):
            return _loop_block(x, self.router, w_gu, w_d)

    model = Router()
    x = torch.randn(21, D, generator=g).requires_grad_()
    w_gu = (torch.randn(E, 2 * h, D, generator=g) / D ** 0.5).requires_grad_()
    w_d = (torch.randn(E, D, h, generator=g) / h ** 0.5).requires_grad_()

    def step(fn):
        y = fn(x, w_gu, w_d)
        return (y.detach(), *torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum(),
                                                 (x, model.router, w_gu, w_d)))

    want = step(model)
    torch._dynamo.reset()
    counters.clear()
    got = step(torch.compile(model, backend="moeblaze", fullgraph=True, dynamic=True, options={"inductor": False}))
    assert dict(counters["moeblaze"]) == {"rewritten": 1}, [r.reason for r in moeblaze_fx.last_report()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_every_parameter_cast_in_forward_gemma4_is_rewritten():
    """Gemma 4 with every parameter float32 and cast to bf16 where forward reads it (parametrize). Two things kept it
    from being rewritten: the router's ``per_expert_scale.to(bf16)[ids]`` was pulled into the region with the
    parameter-only support before the router's weights were set apart, so the region was not the operator's; and its
    ``hidden_states *= self.layer_scalar`` (a float32 buffer), made functional as ``hidden_states * layer_scalar``,
    turned float32 where the update keeps bf16, so the next layer's bf16 products failed once the graph was
    rewritten. Now rewritten, forward and every gradient (reaching the float32 parameters) as eager in bf16."""
    import torch.nn.utils.parametrize as parametrize
    from test_hf import LAYERS, _tokens, build_family
    from helpers import TOL
    from test_mixed_precision import run_under_autocast

    class Cast(nn.Module):
        def forward(self, w):
            return w.to(torch.bfloat16)

    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(tokens, use_cache=False).logits

    model = build_family("gemma4", "grouped_mm")
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            parametrize.register_parametrization(module, name, Cast(), unsafe=True)
    got = run_under_autocast(Logits(model), (_tokens(),), None, tol=TOL[torch.bfloat16])
    assert got == {"rewritten": LAYERS}
    assert [(r.status, r.dtype) for r in moeblaze_fx.last_report()] == [("rewritten", "bfloat16")] * LAYERS


class ScaledInside(Block):
    """Block's stacked experts with their hidden activations scaled per expert by a 1-D [E] parameter inside the
    expert computation: another function than the operator's."""

    def __init__(self):
        super().__init__("stacked")
        self.scale = nn.Parameter(torch.rand(E, generator=torch.Generator().manual_seed(1)) + 0.5)

    def forward(self, x):
        w, ids = F.linear(x, self.router).softmax(-1).topk(K, dim=-1)
        flat = ids.view(-1)
        rows = x.repeat_interleave(K, dim=0).unsqueeze(-1)
        h = F.silu(torch.bmm(self.w1[flat], rows)) * torch.bmm(self.w3[flat], rows) * self.scale[flat].view(-1, 1, 1)
        y = torch.bmm(self.w2[flat], h).squeeze(-1)
        return (y.view(-1, K, D) * w.unsqueeze(-1)).sum(1)


def test_a_per_expert_scale_inside_the_experts_is_reported():
    """A 1-D per-expert tensor read inside the experts beside stacked weights: skipped, the reason naming it; the step
    runs as written."""
    from helpers import run_eager_and_compiled

    x = torch.randn(9, D, requires_grad=True)
    assert run_eager_and_compiled(ScaledInside(), (x,)) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.reason.startswith("the region reads ['scale'] [(4,)] beside the stacked expert weights"), record.reason
    assert "neither a weight nor a bias of stacked experts" in record.reason
