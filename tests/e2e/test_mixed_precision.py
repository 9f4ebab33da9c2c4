"""Mixed precision (issue 40): float32 parameters, bf16/fp16 compute.

Autocast around Hugging Face models (every family and experts implementation the suite has), per-expert loops under
autocast, torchtitan-style ``.bfloat16()`` casts of the tokens and each weight in forward, ``functional_call`` and
frozen experts. Each is compared with eager under the same precision, and the proof of such a region is checked to
reject a wrong candidate at the compute dtype's tolerance.

Under autocast, Dynamo's graph holds no autocast nodes when the autocast context is entered outside the compiled
function: the matrix products are recorded as plain ``linear``/``bmm``/``matmul`` nodes with bf16 example values,
and the casts happen at dispatch when the graph runs (the backend itself is called with autocast enabled).
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import TOL
from torch._dynamo.utils import counters

import moeblaze_fx

D, H, E, K = 16, 24, 4, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Mixtral-style per-expert loop; under autocast an expert's output is bf16 and is cast back to the float32
    accumulator before index_add_ (index_add_ needs one dtype)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, k = torch.where(ids == e)
            y = self.experts[e](x[tok]) * w[tok, k, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class TitanMoE(nn.Module):
    """torchtitan's grouped experts: float32 parameters, the tokens and each weight cast with ``.bfloat16()`` in
    forward, ``torch._grouped_mm`` over the experts' rows, the output cast back with ``type_as``."""

    def __init__(self, cast=torch.bfloat16):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(E, D, generator=gen) / D ** 0.5)
        self.w1 = nn.Parameter(torch.randn(E, H, D, generator=gen) / D ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, D, generator=gen) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H, generator=gen) / H ** 0.5)
        self.cast = cast

    def forward(self, x):
        scores = F.linear(x, self.router).softmax(-1)
        w, ids = scores.topk(K, dim=-1)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[order // K].to(self.cast)
        h = F.silu(torch._grouped_mm(rows, self.w1.to(self.cast).transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(rows, self.w3.to(self.cast).transpose(-2, -1), offs=offsets)
        y = torch._grouped_mm(h, self.w2.to(self.cast).transpose(-2, -1), offs=offsets).type_as(x)
        out = torch.empty_like(y).index_copy(0, order, y)
        return (out.view(-1, K, D) * w.unsqueeze(-1).to(out.dtype)).sum(1)


def _x(n=13):  # 13 tokens: not a multiple of anything
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1))


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_under_autocast(model, inputs, dtype, *, tol=None, compile_fn=None, ill_conditioned=()):
    """helpers.run_eager_and_compiled with the forward under autocast and the backward after it (Trainer's bf16=True,
    Accelerate, Lightning): output and every gradient of the compiled model against eager, within TOL[dtype]. The
    gradients must reach the float32 parameters in float32. Returns the moeblaze counters of the compile.

    ``ill_conditioned``: name fragments of parameters outside the MoE block whose gradients eager itself gets only
    roughly in this precision. Such a gradient off eager's by more than the tolerance passes within bf16's (the
    loosest) tolerance, or when the compiled step's is no further than twice eager's from the gradient of the same
    step in float32 (no autocast)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step(fn, dtype=dtype):
        for t in [p for _, p in params] + leaves:
            t.grad = None
        with _autocast(dtype):
            out = fn(*inputs)
        out = getattr(out, "logits", out)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return out.detach(), [p.grad for _, p in params] + [t.grad for t in leaves]

    float32_grads = step(model, None)[1] if ill_conditioned else None
    want, want_grads = step(model)
    counters.clear()
    compiled = (compile_fn or (lambda m: torch.compile(m, backend="moeblaze", fullgraph=True,
                                                       options={"inductor": False})))(model)
    got, got_grads = step(compiled)
    tol = TOL[dtype or torch.float32] if tol is None else tol
    assert got.dtype == want.dtype and _rel(got, want) <= tol, f"output: relative error {_rel(got, want):.3g}"
    names = [n for n, _ in params] + [f"input{i}" for i in range(len(leaves))]
    for name, a, b, (_, p) in zip(names, got_grads, want_grads, params + [(None, t) for t in leaves]):
        assert (a is None) == (b is None), f"gradient of {name}: present in one run only"
        if a is not None:
            assert a.dtype == p.dtype == b.dtype, f"gradient of {name}: {a.dtype}, eager {b.dtype}"
            if _rel(a, b) > tol and any(part in name for part in ill_conditioned):
                ref = float32_grads[names.index(name)]
                assert _rel(a, b) <= TOL[torch.bfloat16] or _rel(a, ref) <= 2 * _rel(b, ref), (
                    f"gradient of {name}: relative error {_rel(a, b):.3g}, {_rel(a, ref):.3g} from float32 where "
                    f"eager is {_rel(b, ref):.3g} from it")
                continue
            assert _rel(a, b) <= tol, f"gradient of {name}: relative error {_rel(a, b):.3g}"
    return dict(counters["moeblaze"])


def _records():
    return [(r.status, r.dtype) for r in moeblaze_fx.last_report()]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hf_under_autocast_is_rewritten(family, impl, dtype):
    """float32 parameters, forward and backward under autocast (Trainer's bf16=True). batched_mm's bmm is cast by
    autocast: the region computes in the autocast dtype. grouped_mm's transformers::grouped_mm_fallback casts the
    tokens to the weights' dtype, and autocast does not reach into the custom op: that region computes in float32."""
    from test_hf import LAYERS, _tokens, build

    model = build(family, impl, torch.float32)
    got = run_under_autocast(model, (_tokens(),), dtype)
    assert got == {"rewritten": LAYERS}
    compute = "float32" if impl == "grouped_mm" else str(dtype).replace("torch.", "")
    assert _records() == [("rewritten", compute)] * LAYERS


def _build_suite_family(family: str, impl: str) -> nn.Module:
    """The float32 tiny models of the families tests/e2e/test_hf.py checks in float32 (same configs)."""
    from test_hf import build_deepseek_v4, build_family

    return build_deepseek_v4(impl, 0.05) if family == "deepseek_v4" else build_family(family, impl)


# Gradients eager itself gets only roughly under autocast (outside the MoE blocks), measured 2026-11-27 on the CPU:
# DeepSeek-V4's mHC mixing parameters (*_hc.*, hc_head.*): under bf16 eager is 0.04-1.2 off its own float32 step,
# and the compiled step 0.003-1.3 (no further); under fp16 2.5e-2 off eager (hc_head.hc_scale, batched_mm). Inkling's
# attention keys (projection, short convolution, norm) under fp16: 1.2e-2 to 1.5e-2 off eager in both experts
# implementations, grouped_mm's region computing in float32 included.
ILL_CONDITIONED = {"deepseek_v4": ("_hc.", "hc_head."), "inkling": ("self_attn.k_",)}


SUITE_FAMILIES = [(family, impl) for family in ("deepseek_v3", "gpt_oss", "glm4_moe", "qwen2_moe", "deepseek_v4",
                                                 "nemotron_h", "gemma4", "inkling2", "inkling")
                  for impl in ("grouped_mm", "batched_mm")] + [("llama4", "default")]


@pytest.mark.parametrize("family,impl", SUITE_FAMILIES, ids=[f"{f}-{i}" for f, i in SUITE_FAMILIES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_suite_family_under_autocast_is_rewritten(family, impl, dtype):
    """The other families of the suite (moeblaze_fx.bench.models' tiny configs; test_hf.py's DeepSeek-V4, Nemotron-H,
    Gemma 4, Inkling 2 and Inkling), float32 parameters under autocast: every MoE layer rewritten, in the dtype the
    experts compute in (float32 under grouped_mm, as above; Llama 4's experts are one bmm over every expert, autocast's
    dtype, with no experts implementation to set)."""
    from test_hf import LAYERS, _tokens

    from moeblaze_fx.bench import models

    if family in models.FAMILIES:
        model = models.build_model(family, tiny=True, experts_implementation=None if impl == "default" else impl)
    else:
        model = _build_suite_family(family, impl)
    got = run_under_autocast(model, (_tokens(),), dtype, ill_conditioned=ILL_CONDITIONED.get(family, ()))
    assert got == {"rewritten": LAYERS}
    compute = "float32" if impl == "grouped_mm" else str(dtype).replace("torch.", "")
    assert _records() == [("rewritten", compute)] * LAYERS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_per_expert_loop_under_autocast_is_rewritten(dtype):
    torch.manual_seed(0)
    got = run_under_autocast(LoopMoE(), (_x().requires_grad_(True),), dtype)
    assert got == {"rewritten": 1}
    assert _records() == [("rewritten", str(dtype).replace("torch.", ""))]


@pytest.mark.parametrize("cast", [torch.bfloat16], ids=["bf16"])  # torch._grouped_mm takes bf16 only
def test_casts_in_forward_are_rewritten(cast):
    """torchtitan's style: no autocast, ``.to(bf16)`` of the tokens and of each weight inside forward."""
    got = run_under_autocast(TitanMoE(cast), (_x().requires_grad_(True),), None, tol=TOL[cast])
    assert got == {"rewritten": 1}
    assert _records() == [("rewritten", str(cast).replace("torch.", ""))]


def test_functional_call_under_autocast_is_rewritten():
    """torch.func.functional_call with the module's own parameters (as a training loop written with torch.func)."""
    torch.manual_seed(0)
    model = LoopMoE()

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return torch.func.functional_call(self.inner, dict(self.inner.named_parameters()), (x,))

    got = run_under_autocast(Functional(), (_x().requires_grad_(True),), torch.bfloat16)
    assert got == {"rewritten": 1}


@pytest.mark.parametrize("block", ["loop", "titan"])
def test_frozen_experts_are_rewritten(block):
    """Expert weights with requires_grad=False (fine-tuning the router only): the tokens' and router's gradients
    still pass through the operator."""
    torch.manual_seed(0)
    model = LoopMoE() if block == "loop" else TitanMoE()
    for name, p in model.named_parameters():
        if "gate" not in name and "router" not in name:
            p.requires_grad_(False)
    dtype = torch.bfloat16 if block == "loop" else None
    got = run_under_autocast(model, (_x().requires_grad_(True),), dtype, tol=TOL[torch.bfloat16])
    assert got == {"rewritten": 1}


@pytest.mark.parametrize("wrong", ["gelu_for_silu", "gate_up_swapped"])
@pytest.mark.parametrize("block", ["loop_autocast", "titan_casts"])
def test_wrong_candidate_fails_at_the_compute_dtype_tolerance(block, wrong):
    """The proof of a bf16 region is held to bf16's tolerance against a float32 evaluation: loose enough for bf16
    rounding, still below what a wrong function gives. Extraction is narrowed to one wrong hypothesis (GeGLU for
    the SwiGLU the experts compute, or the gate and up weights exchanged); the region must then be left alone."""
    import dataclasses

    import moeblaze_fx.passes.pipeline as pipeline
    from moeblaze_fx.kernels.reference import Activation
    from moeblaze_fx.passes.prove import tolerance

    def narrowed(*args, **kwargs):
        ext = extract(*args, **kwargs)
        if wrong == "gelu_for_silu":
            ext.activations = [Activation("geglu")]
        else:
            swapped = [lay for lay in ext.layouts if "w3" in ext.role_names[lay.gate.role]]
            assert swapped, ext.role_names
            ext.layouts = swapped
            ext.activations = [a for a in ext.activations if a.name == "swiglu"]
        return dataclasses.replace(ext)

    torch.manual_seed(0)
    model, dtype = (LoopMoE(), torch.bfloat16) if block == "loop_autocast" else (TitanMoE(), None)
    extract = pipeline.extract
    pipeline.extract = narrowed
    try:
        counters.clear()
        with _autocast(dtype):
            torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False})(_x())
    finally:
        pipeline.extract = extract
    assert dict(counters["moeblaze"]) == {"skipped": 1}
    (record,) = moeblaze_fx.last_report()
    assert record.dtype == "bfloat16"
    bound = f"> {tolerance(torch.bfloat16, torch.device('cpu')):g} for every layout"
    assert record.reason.startswith("the region's output differs from the MoE operator") and bound in record.reason, \
        record.reason
    # GeGLU for SwiGLU measured 0.1-0.2 here (2026-11-27, CPU), the exchanged weights more: above the bf16
    # tolerance, which correct bf16 regions stay an order of magnitude below (rewritten at rel. error ~1e-2)
    err = float(record.reason.split("relative error ")[1].split(" ")[0])
    assert err > tolerance(torch.bfloat16, torch.device("cpu")), record.reason


@pytest.mark.parametrize("block", ["gpt_oss", "modulelist_bias"])
def test_parametrized_casts_with_expert_biases_are_rewritten(block):
    """Every parameter read through a cast to bf16 (torch.nn.utils.parametrize): the biases are matched to their
    weights by the parameters' own names (``experts.parametrizations.down_proj_bias.original`` is down_proj's bias).
    Left alone before ("the expert biases ... do not match the expert weights")."""
    import torch.nn.utils.parametrize as parametrize
    from test_variants import GptOssStyleMoE, ModuleListMoE

    class CastTo(nn.Module):
        def forward(self, weight):
            return weight.to(torch.bfloat16)

    torch.manual_seed(0)
    model = GptOssStyleMoE() if block == "gpt_oss" else ModuleListMoE(act="swiglu", bias=True)
    for module in list(model.modules()):
        for name, _ in list(module.named_parameters(recurse=False)):
            parametrize.register_parametrization(module, name, CastTo(), unsafe=True)
    got = run_under_autocast(model, (_x().to(torch.bfloat16).requires_grad_(True),), None, tol=TOL[torch.bfloat16])
    assert got == {"rewritten": 1}
    assert _records() == [("rewritten", "bfloat16")]
