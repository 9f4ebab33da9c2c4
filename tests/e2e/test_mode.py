"""torch.compile's ``mode`` with backend="moeblaze": Inductor's settings for the mode are in force while the
rewritten graph compiles (forward and backward), as with the default backend; "reduce-overhead" runs the step,
MoEBlaze operators included, as CUDA graphs."""
import pytest
import torch
import torch._functorch.config
import torch._inductor.compile_fx as inductor_compile_fx
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import moeblaze_fx
from moeblaze_fx.backend import mode_patches
from moeblaze_fx.models import TinyMoETransformer

LAYERS = 2


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return TinyMoETransformer(vocab=64, d=32, h=48, layers=LAYERS, heads=2, num_experts=4, top_k=2).to(device, dtype)


def _tokens(step=0, device="cpu"):
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step)).to(device)


@pytest.fixture
def inductor_settings(monkeypatch):
    """The Inductor settings each graph (forward, then backward) was compiled under (torch's compile caches off:
    a cached graph is not compiled again)."""
    seen = []
    patches = (inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False))
    for p in patches:
        p.__enter__()
    real = inductor_compile_fx._compile_fx_inner

    def spy(*args, **kwargs):
        seen.append((inductor_config.triton.cudagraphs, inductor_config.max_autotune))
        return real(*args, **kwargs)
    monkeypatch.setattr(inductor_compile_fx, "_compile_fx_inner", spy)  # what compile_fx_inner calls
    yield seen
    for p in reversed(patches):
        p.__exit__(None, None, None)


@pytest.mark.parametrize("mode,expect", [
    (None, (False, False)),
    ("default", (False, False)),
    ("reduce-overhead", (True, False)),  # CUDA graphs (skipped by Inductor for CPU tensors: the step still runs)
    ("max-autotune-no-cudagraphs", (False, True)),
])
def test_mode_settings_reach_both_graphs(inductor_settings, mode, expect):
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    want = model.loss(_tokens())
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model.loss, backend="moeblaze", mode=mode, fullgraph=True)
    got = compiled(_tokens())
    got.backward()
    assert counters["moeblaze"]["rewritten"] == LAYERS
    assert inductor_settings == [expect, expect]  # the forward's compile, then the backward's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_mode_with_options_through_patch(inductor_settings):
    """torch.compile takes a mode or options, not both: with a mode, the backend's options come from
    moeblaze_fx.patch around the first call (the compile)."""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    with moeblaze_fx.patch(checkpoint="recompute"):
        torch.compile(model.loss, backend="moeblaze", mode="reduce-overhead", fullgraph=True)(_tokens()).backward()
    assert [r.policy for r in moeblaze_fx.last_report()] == ["recompute"] * LAYERS
    assert inductor_settings == [(True, False)] * 2
    torch._dynamo.reset()
    inductor_settings.clear()
    with moeblaze_fx.patch(enabled=False):  # the passes off: the default backend, in the same mode
        torch.compile(model.loss, backend="moeblaze", mode="reduce-overhead", fullgraph=True)(_tokens()).backward()
    assert inductor_settings == [(True, False)] * 2


def test_unknown_mode_is_a_clear_error():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Unrecognized mode=fastest, should be one of: .*reduce-overhead"):
        torch.compile(_model().loss, backend="moeblaze", mode="fastest")(_tokens())


def test_mode_without_inductor_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mode='reduce-overhead' sets Inductor options .* inductor=False"):
        mode_patches("reduce-overhead", inductor=False)
    assert mode_patches("default", inductor=False) == {}
    with pytest.raises(TypeError, match="mode must be a string"):
        mode_patches(1)


class _ListModel(torch.nn.Module):
    """A ModuleList of Linear experts (their pointer table is copied from the host, not computed on the device)."""

    def __init__(self):
        super().__init__()
        from test_loop import ModuleListMoE

        self.embed = torch.nn.Embedding(64, 32)
        self.moe = ModuleListMoE(d=32, h=48, E=4, K=2)

    def loss(self, tokens):
        return (self.moe(self.embed(tokens)).float() ** 2).mean()


@pytest.mark.cuda
@pytest.mark.parametrize("experts", ["parameters", "module_list"])
def test_reduce_overhead_training_steps_on_cuda(monkeypatch, experts):
    """bf16 steps of a MoE model as CUDA graphs: forward and backward recorded once each, no graph skipped, no
    tensor left alive in the graphs' pool by the warm-up, then replayed on new tokens. Each step's loss and every
    gradient equal those of the same compile without CUDA graphs (eager bf16 differs from any compile by its own
    roundings: 0.1 in the embedding's gradient here, on an H200; the rewrite against eager is tested elsewhere)."""
    from torch._inductor import cudagraph_trees

    recorded = []
    real = cudagraph_trees.CUDAGraphTreeManager.record_function

    def spy(self, *args, **kwargs):
        recorded.append(self)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", spy)
    torch._dynamo.reset()
    counters.clear()
    if experts == "parameters":
        model, layers = _model(torch.bfloat16, "cuda"), LAYERS
    else:
        torch.manual_seed(0)
        model, layers = _ListModel().to("cuda", torch.bfloat16), 1
    plain = torch.compile(model.loss, backend="moeblaze", fullgraph=True)
    graphed = torch.compile(model.loss, backend="moeblaze", mode="reduce-overhead", fullgraph=True)

    def step(fn, tokens):
        loss = fn(tokens)
        loss.backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.float().clone(), grads

    for i in range(4):  # warm-up, recording, then replays
        tokens = _tokens(i, "cuda")
        want, want_grads = step(plain, tokens)
        torch.compiler.cudagraph_mark_step_begin()
        got, got_grads = step(graphed, tokens)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
        for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads):
            rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert rel <= 1e-2, f"step {i}: gradient of {name}: relative error {rel:.3g}"
    assert counters["moeblaze"]["rewritten"] == 2 * layers  # each compile rewrites every layer
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(recorded) == 2  # the forward graph and the backward graph, each recorded once


@pytest.mark.cuda
def test_bf16_compile_is_as_close_to_float32_as_inductors():
    """The yardstick for the bf16 comparisons above: against the float32 model, the moeblaze compile's loss and
    gradients are within 1.5x of the default Inductor compile's error: the operator adds no error of its own
    beyond bf16 rounding."""
    torch._dynamo.reset()
    counters.clear()
    ref_model = _model(torch.float32, "cuda")
    model = _model(torch.bfloat16, "cuda")
    tokens = _tokens(5, "cuda")

    def errors(fn, m):
        loss = fn(tokens)
        loss.backward()
        ref_loss = ref_model.loss(tokens)
        ref_loss.backward()
        out = {"loss": abs(loss.float().item() - ref_loss.item()) / abs(ref_loss.item())}
        for (name, p), r in zip(m.named_parameters(), ref_model.parameters()):
            out[name] = ((p.grad.float() - r.grad).norm() / r.grad.norm()).item()
        m.zero_grad(set_to_none=True)
        ref_model.zero_grad(set_to_none=True)
        return out

    inductor = errors(torch.compile(model.loss, fullgraph=True), model)
    ours = errors(torch.compile(model.loss, backend="moeblaze", fullgraph=True), model)
    assert counters["moeblaze"]["rewritten"] == LAYERS
    for name, err in ours.items():
        assert err <= 1.5 * inductor[name] + 1e-3, f"{name}: moeblaze {err:.3g}, Inductor {inductor[name]:.3g}"
