"""torch's compile caches and the operators: a cache entry made by other code of this package, or under other trace
settings, must not be replayed (backend.cache_key_tag)."""
import pytest
import torch
import torch.fx as fx
from helpers import run_eager_and_compiled
from test_loop import ModuleListMoE, TopKPooling
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import moeblaze_fx
from moeblaze_fx import backend, config, moe_ffn, ops


class DirectMoE(torch.nn.Module):
    """A model that calls the operator itself."""

    def __init__(self, d=16, h=8, E=4, K=2):
        super().__init__()
        self.router = torch.nn.Linear(d, E, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * h, d) * d ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(E, d, h) * h ** -0.5)
        self.K = K

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1), self.K, dim=-1)
        return moe_ffn(x, ids, w / w.sum(-1, keepdim=True), (self.gate_up, self.down), activation="swiglu")


def _compile_step(model, x) -> tuple[dict, dict]:
    """One compile (through Inductor) and step, checked against eager: the AOTAutograd and FX-graph cache counters."""
    torch._dynamo.reset()
    assert run_eager_and_compiled(model, (x,), options={}) == {"rewritten": 1}
    fx_graph = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}, fx_graph


def test_cache_entries_follow_the_package(monkeypatch):
    torch.manual_seed(0)
    model, x = ModuleListMoE(), torch.randn(2, 5, 16, requires_grad=True)
    with fresh_cache():
        assert _compile_step(model, x) == ({"autograd_cache_miss": 1, "autograd_cache_saved": 1},
                                           {"fxgraph_cache_miss": 2})
        # same code: both graphs come from the caches (so the next miss is the tag's doing)
        assert _compile_step(model, x) == ({"autograd_cache_hit": 1}, {"fxgraph_cache_hit": 2})
        # other code of the package (an upgrade): the forward and the backward compile afresh
        monkeypatch.setattr(backend, "source_fingerprint", lambda: "another version")
        assert _compile_step(model, x) == ({"autograd_cache_miss": 1, "autograd_cache_saved": 1},
                                           {"fxgraph_cache_miss": 2})
        # other kernel options (what the fakes read when tracing): an argument of the operator, so other graph code
        with moeblaze_fx.patch(kernels={"kernel_config": "block_m=32"}):
            assert _compile_step(model, x)[0] == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}


def test_a_rewrite_with_casts_is_cached():
    """Hugging Face's bfloat16 Mixtral: the rewrite casts the operator's output back to the combine's float32 dtype
    and views it as x. Inserted as call_function nodes of method descriptors, those made AOTAutograd bypass its
    cache ("'method_descriptor' object has no attribute '__module__'"); as Tensor method calls they do not."""
    from test_hf import build

    model = build("mixtral", "grouped_mm", torch.bfloat16).model.layers[0].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    step = lambda: (torch._dynamo.reset(), run_eager_and_compiled(model, (x,), dtype=torch.bfloat16, options={}),
                    {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")})[1:]
    with fresh_cache():
        assert step() == ({"rewritten": 1}, {"autograd_cache_miss": 1, "autograd_cache_saved": 1})
        assert step() == ({"rewritten": 1}, {"autograd_cache_hit": 1})


def _graph(target) -> fx.GraphModule:
    g = fx.Graph()
    a = g.placeholder("a")
    g.output(g.call_function(target, (a,)))
    return fx.GraphModule(torch.nn.Module(), g)


def _cuda_input():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a CUDA tensor's metadata, on a machine without one too
        return torch.empty(2, device="cuda")


def test_tag_names_what_the_fakes_see(monkeypatch):
    gm = _graph(torch.ops.moeblaze.moe_ffn.default)
    tag = backend.cache_key_tag(gm)
    assert tag.startswith("moeblaze-") and len(tag) == len("moeblaze-") + 16
    assert backend.cache_key_tag(gm) == tag
    assert backend.cache_key_tag(_graph(torch.ops.moeblaze.moe_ffn_backward.default)) == tag
    assert backend.cache_key_tag(_graph(torch.ops.moeblaze.moe_ffn)) == tag  # a direct call: Dynamo keeps the packet
    inner = _graph(torch.ops.moeblaze.moe_ffn.default)  # inside a subgraph (a checkpointed region's body)
    outer = _graph(torch.ops.aten.relu.default)
    outer.add_module("body", inner)
    assert backend.cache_key_tag(outer) == tag
    assert backend.cache_key_tag(_graph(torch.ops.aten.relu.default)) is None  # no operator of ours: torch's tag
    with moeblaze_fx.patch(kernels={"kernel_config": "block_m=32"}):  # the options are in the graph's code instead
        assert backend.cache_key_tag(gm) == tag
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0" if config.interpreting() else "1")
        assert backend.cache_key_tag(gm) not in (tag, None)
    with monkeypatch.context() as m:
        m.setattr(backend, "source_fingerprint", lambda: "another version")
        assert backend.cache_key_tag(gm) not in (tag, None)
    # whether the Triton kernels import counts where the graph has CUDA inputs (the CPU path never imports them)
    cuda = backend.cache_key_tag(gm, [_cuda_input()])
    assert cuda not in (tag, None)
    with monkeypatch.context() as m:
        m.setattr(ops, "_triton_kernels", lambda: None)
        assert backend.cache_key_tag(gm, [_cuda_input()]) not in (tag, cuda, None)
        assert backend.cache_key_tag(gm, [torch.empty(2)]) == tag
    assert backend.cache_key_tag(gm) == tag
    with torch.compiler.config.patch(cache_key_tag="mine"):
        assert backend.cache_key_tag(gm) == "mine+" + tag
        assert backend.cache_key_tag(_graph(torch.ops.aten.relu.default)) is None


def test_source_fingerprint_covers_the_package(tmp_path):
    """The default root is the package itself: a copy hashes the same, an edit to any module of the copy does not."""
    import shutil

    root = backend.pathlib.Path(backend.__file__).parent
    copy = tmp_path / "moeblaze_fx"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        assert backend.source_fingerprint(str(copy)) == backend.source_fingerprint()
        for module in ("ops.py", "kernels/reference.py"):
            (copy / module).write_text((copy / module).read_text() + "\n# another version\n")
            changed = backend.source_fingerprint.__wrapped__(str(copy))
            assert changed != backend.source_fingerprint()
    finally:
        backend.source_fingerprint.cache_clear()
        backend.source_fingerprint()


def test_source_fingerprint_reads_every_source_file(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "b.py").write_text("y = 2\n")

    def fp():
        backend.source_fingerprint.cache_clear()
        return backend.source_fingerprint(str(tmp_path))

    first = fp()
    (tmp_path / "notes.txt").write_text("not source")
    assert fp() == first
    (tmp_path / "kernels" / "b.py").write_text("y = 3\n")
    second = fp()
    assert second != first
    (tmp_path / "kernels" / "b.py").rename(tmp_path / "kernels" / "c.py")
    assert fp() not in (first, second)
    (tmp_path / "kernels" / "c.py").unlink()
    (tmp_path / "a.py").unlink()
    empty = fp()  # no source to read: a value no other process makes
    assert empty not in (first, second) and empty != fp()
    backend.source_fingerprint.cache_clear()
    backend.source_fingerprint()


@pytest.mark.parametrize("user_tag", ["", "mine"])
def test_compile_runs_under_the_tag(monkeypatch, user_tag):
    """Inductor sees the tag while it keys the forward, the backward (compiled when the backward first runs) and
    AOTAutograd's entry; a graph without our operators compiles under the user's tag alone."""
    import torch._inductor.codecache as codecache

    seen = []
    init = codecache.FxGraphHashDetails.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self.cache_key_tag)

    monkeypatch.setattr(codecache.FxGraphHashDetails, "__init__", spy)
    torch.manual_seed(0)
    with fresh_cache(), torch.compiler.config.patch(cache_key_tag=user_tag):
        run_eager_and_compiled(ModuleListMoE(), (torch.randn(2, 5, 16, requires_grad=True),), options={})
        ours = seen[:]
        seen.clear()
        # the operator called directly, with the passes switched off: tagged too
        torch._dynamo.reset()
        direct = torch.compile(DirectMoE(), backend="moeblaze", options={"enabled": False})
        direct(torch.randn(6, 16, requires_grad=True)).sum().backward()
        ours_direct = seen[:]
        seen.clear()
        torch._dynamo.reset()
        torch.compile(TopKPooling(), backend="moeblaze")(torch.randn(3, 16, requires_grad=True)).sum().backward()
        assert torch.compiler.config.cache_key_tag == user_tag
        want = backend.cache_key_tag(_graph(torch.ops.moeblaze.moe_ffn.default))
    assert ours == [want] * 3  # AOTAutograd's key, the forward's, the backward's
    assert ours_direct == [want] * 3  # the router and the operator in one graph
    assert want.startswith(f"{user_tag}+moeblaze-" if user_tag else "moeblaze-")
    assert seen and set(seen) == {user_tag}


@pytest.mark.cuda
def test_cache_replay_on_cuda(monkeypatch):
    """A bf16 training step on the GPU (the operator's Triton path, whose forward saves its dispatch plan for the
    backward) replayed from torch's caches equals eager; other package code compiles afresh."""
    torch.manual_seed(0)
    model = ModuleListMoE(d=64, h=96).cuda().to(torch.bfloat16)
    x = torch.randn(4, 33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        torch._dynamo.reset()
        got = run_eager_and_compiled(model, (x,), dtype=torch.bfloat16, options={"checkpoint": "activations"})
        assert got == {"rewritten": 1}
        return {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}

    with fresh_cache():
        assert step() == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}
        assert step() == {"autograd_cache_hit": 1}
        monkeypatch.setattr(backend, "source_fingerprint", lambda: "another version")
        assert step() == {"autograd_cache_miss": 1, "autograd_cache_saved": 1}


def test_source_fingerprint_is_taken_at_import():
    """The hash is of the code the process imported: files changed on disk later (an upgrade in place, a branch
    switch under an editable install) must not give the old code the new code's tag."""
    import subprocess
    import sys

    code = ("import moeblaze_fx; i = moeblaze_fx.backend.source_fingerprint.cache_info(); "
            "print(i.currsize, i.misses, i.hits)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1", "0"]
