"""``moeblaze bench models``: one training step of real MoE model families, eager vs Inductor vs moeblaze.

Each family is a Hugging Face causal LM built from its config class with the block sizes of a published checkpoint
(hidden size, expert and dense intermediate sizes, experts, top-k, attention heads, vocabulary) and random weights;
nothing is downloaded. Only the number of decoder layers is cut (``layers``, default 2), and every one of those layers
is made an MoE layer (``first_k_dense_replace=0`` and the like), so the rows measure the MoE blocks a model trains.
``tiny=True`` shrinks every family to toy sizes (d = 64, E = 8) for tests on a CPU.

One step (every provider, the same model object, the same inputs)::

    loss = model(input_ids, labels=input_ids).loss     # forward + the model's own next-token loss
    loss.backward()                                     # gradients are reset before each step; no optimizer

With ``autocast=True`` the model's weights are float32 and the forward and loss run under ``torch.autocast`` (bf16
unless ``dtype`` says fp16), as mixed-precision training over float32 weights does.

Providers (one process, Dynamo reset before each one and each token count, so each compiles with static shapes):

* ``eager``: the model as built (experts in ``experts_implementation="grouped_mm"`` where the family has one);
* ``inductor``: ``torch.compile(model)``;
* ``moeblaze``: ``torch.compile(model, backend="moeblaze", options=moeblaze_options)``;
* ``inductor-no-experts`` (with ``moe_share=True``): ``inductor`` with every experts module replaced by a stand-in
  that returns its input scaled by the routing weights (no expert GEMMs; the router, attention, norms, the loss and
  their backward stay). ``1 - ms(no experts) / ms(inductor)`` is the share of Inductor's step spent in the expert
  computation, the region moeblaze replaces; ``1 / (1 - share)`` is the speed-up of the whole step if that region
  took no time at all, to put beside the speed-up moeblaze reaches.

``fsdp_style=True`` compiles each decoder layer (``model.model.layers[i]``) on its own instead of the whole model,
as torchtitan and FSDP2 training scripts do; embedding, final norm, LM head and loss then run eagerly.

Per row: the median step time of ``reps`` steps after ``warmup`` (CUDA events, L2 flushed before each step, the
steps enqueued back to back; the CPU's wall clock otherwise) with the step count and spread (``timing``), the
host's time to enqueue one step on CUDA (``timing.host_enqueue_ms``: each step started on an idle GPU, no
synchronisation inside), the peak
allocation of one step above the state before it (CUDA), the first call's time (compile included), the MoE
regions rewritten (``torch._dynamo.utils.counters["moeblaze"]`` over the provider's compiles, beside the number of
experts modules in the model, and the graphs Dynamo compiled; a region left alone puts its reason in the row's
note) and the loss's relative difference from eager's on the same inputs. With ``fsdp_style`` the decoder layers have one structure, so Dynamo compiles the first layer's graph
and runs it for every layer (the parameters are graph inputs): one region rewritten serves all MoE blocks.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..config import float32_matmul_precision
from ..report import all_reports
from .layer import environment, free_memory, is_oom
from .results import JsonResult, mb_cell, number_cell
from .timing import StepTimes, cuda_step_times, host_enqueue_ms, spread_note, sync, wall_step_times

__all__ = [
    "Family",
    "FAMILIES",
    "MODEL_PROVIDERS",
    "ModelsBenchResult",
    "build_model",
    "experts_modules",
    "run_models_bench",
    "format_models_markdown",
]

log = logging.getLogger("moeblaze_fx")

# Toy sizes shared by every family with tiny=True: small enough for a CPU step in well under a second.
_TINY_ATTN = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_TINY_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=None)  # special tokens inside the tiny vocabulary


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # the transformers config class
    checkpoint: str  # the published model whose block sizes `real` holds
    real: dict[str, Any]
    tiny: dict[str, Any]
    all_moe: dict[str, Any]  # what makes every decoder layer an MoE layer
    note: str = ""

    def config_kwargs(self, tiny: bool) -> dict[str, Any]:
        return {**(self.tiny if tiny else self.real), **self.all_moe}


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen/Qwen3-30B-A3B",
           real=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, norm_topk_prob=True),
           tiny=dict(_TINY_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True),
           all_moe=dict(decoder_sparse_step=1, mlp_only_layers=[])),
    Family("deepseek_v3", "DeepseekV3Config", "deepseek-ai/DeepSeek-V3",
           real=dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                     n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                     routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=128,
                     num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128),
           tiny=dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                     norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                     kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
           all_moe=dict(first_k_dense_replace=0),
           note="256 experts of 7168 x 2048: 11.3 B expert parameters a layer (45 GB with bf16 gradients); "
                "on one 80 GB GPU use --override deepseek_v3.n_routed_experts=64"),
    Family("mixtral", "MixtralConfig", "mistralai/Mixtral-8x7B-v0.1",
           real=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                     num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
           tiny=dict(_TINY_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
           all_moe={}),
    Family("gpt_oss", "GptOssConfig", "openai/gpt-oss-20b",
           real=dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                     num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                     sliding_window=128),
           tiny=dict(_TINY_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=16),
           all_moe={}),
    Family("olmoe", "OlmoeConfig", "allenai/OLMoE-1B-7B-0924",
           real=dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                     num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, norm_topk_prob=False),
           tiny=dict({k: v for k, v in _TINY_ATTN.items() if k != "head_dim"}, intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
           all_moe={}),
    Family("glm4_moe", "Glm4MoeConfig", "zai-org/GLM-4.5-Air",
           real=dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                     n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                     routed_scaling_factor=1.0, norm_topk_prob=True, num_attention_heads=96,
                     num_key_value_heads=8, head_dim=128, use_qk_norm=False),
           tiny=dict(_TINY_ATTN, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True),
           all_moe=dict(first_k_dense_replace=0)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen/Qwen1.5-MoE-A2.7B",
           real=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                     shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                     num_attention_heads=16, num_key_value_heads=16, norm_topk_prob=False),
           tiny=dict({k: v for k, v in _TINY_ATTN.items() if k != "head_dim"}, intermediate_size=128,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=False),
           all_moe=dict(decoder_sparse_step=1, mlp_only_layers=[])),
    Family("llama4", "Llama4TextConfig", "meta-llama/Llama-4-Scout-17B-16E",
           real=dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                     num_local_experts=16, num_experts_per_tok=1, num_attention_heads=40, num_key_value_heads=8,
                     head_dim=128),
           tiny=dict(_TINY_ATTN, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=8,
                     num_experts_per_tok=1),
           all_moe=dict(interleave_moe_layer_step=1)),
    Family("phimoe", "PhimoeConfig", "microsoft/Phi-3.5-MoE-instruct",
           real=dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_local_experts=16,
                     num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, router_jitter_noise=0.01),
           tiny=dict({k: v for k, v in _TINY_ATTN.items() if k != "head_dim"}, intermediate_size=32,
                     num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.01),
           all_moe={},
           note="sparsemixer routing: in training each of the two experts is sampled (Gumbel) from its own maximum"),
]}

MODEL_PROVIDERS = ("eager", "inductor", "moeblaze")
NO_EXPERTS = "inductor-no-experts"


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["deepseek_v3.n_routed_experts=64", "num_experts_per_tok=4"]`` -> {family or "*": {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {item!r}: expected [family.]key=value, e.g. deepseek_v3.n_routed_experts=64")
        family, dot, name = key.rpartition(".")
        family = family if dot else "*"
        if family != "*" and family not in FAMILIES:
            raise ValueError(f"--override {item!r}: unknown family {family!r}; choose from {', '.join(FAMILIES)}")
        out.setdefault(family, {})[name] = _parse_value(value)
    return out


def build_config(family: str, *, layers: int = 2, tiny: bool = False, overrides: Optional[dict[str, Any]] = None):
    """The family's transformers config: its block sizes (or the tiny ones), ``layers`` decoder layers, all MoE."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(FAMILIES)}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("the model benchmark needs transformers (pip install 'transformers>=5')") from exc
    fam = FAMILIES[family]
    cls = getattr(transformers, fam.config_class, None)
    if cls is None:
        raise RuntimeError(f"{family}: this transformers ({transformers.__version__}) has no {fam.config_class}; "
                           "upgrade transformers")
    kwargs = {**fam.config_kwargs(tiny), **(_TINY_TOKENS if tiny else {}), "num_hidden_layers": layers,
              "use_cache": False, "tie_word_embeddings": False, "attention_dropout": 0.0, **(overrides or {})}
    return cls(**kwargs)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules named ``experts`` that hold stacked (3-D) expert weights: one per MoE layer."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        if any(p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def build_model(family: str, *, layers: int = 2, tiny: bool = False, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, overrides: Optional[dict[str, Any]] = None, seed: int = 0,
                experts_implementation: Optional[str] = "grouped_mm") -> torch.nn.Module:
    """A causal LM of ``family`` with random weights, built on ``device`` in ``dtype``, in training mode."""
    from transformers import AutoModelForCausalLM

    config = build_config(family, layers=layers, tiny=tiny, overrides=overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if experts_implementation and getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation(experts_implementation)
    return model.train()


class _NoExperts(torch.nn.Module):
    """Stands in for an experts module: no expert GEMMs, but the routing weights stay in the graph (their
    gradient path to the router is kept) and the output has the experts' shape and dtype."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        weights = args[1] if len(args) >= 2 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
        if isinstance(weights, Tensor) and weights.dim() == 2 and weights.shape[0] == hidden_states.shape[0]:
            return hidden_states * weights.sum(-1, keepdim=True).to(hidden_states.dtype)
        return hidden_states * 1.0  # Llama 4: the input is already scaled by the router's scores


def _swap_experts(model: torch.nn.Module, replacement: Optional[Callable[[], torch.nn.Module]] = None):
    """Replace every experts module; returns a function that puts them back."""
    swapped = []
    for name, module in experts_modules(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swapped.append((parent, attr, module))
        setattr(parent, attr, (replacement or _NoExperts)())

    def restore() -> None:
        for parent, attr, module in swapped:
            setattr(parent, attr, module)
    return restore


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"fsdp_style: {type(model).__name__} has no model.layers ModuleList to compile per layer")
    return layers


def _compiled(model: torch.nn.Module, provider: str, fsdp_style: bool, moeblaze_options: Optional[dict[str, Any]]):
    """(callable, undo): the provider's step callable, and what puts the model back as it was."""
    if provider == "eager":
        return model, lambda: None
    kwargs: dict[str, Any] = {}
    if provider == "moeblaze":
        kwargs = {"backend": "moeblaze", "options": dict(moeblaze_options or {})}
    undo_experts = _swap_experts(model) if provider == NO_EXPERTS else (lambda: None)
    if not fsdp_style:
        return torch.compile(model, **kwargs), undo_experts
    layers = _decoder_layers(model)
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = torch.compile(layer, **kwargs)

    def undo() -> None:
        for i, layer in enumerate(originals):
            layers[i] = layer
        undo_experts()
    return model, undo


def _moeblaze_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["moeblaze"])


def _skip_reasons(reports: list) -> list[str]:
    """The reasons of the regions these compiles' reports left alone, each cut to a readable length."""
    return [(r.reason or "no reason recorded")[:200] for records in reports for r in records if r.status != "rewritten"]


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _step(fn: Callable[..., Any], model: torch.nn.Module, input_ids: Tensor, seed: int,
          autocast: Optional[torch.dtype] = None) -> Tensor:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with torch.autocast(input_ids.device.type, dtype=autocast, enabled=autocast is not None):
        loss = fn(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach()


def _measure(fn, model, input_ids, device, warmup: int, reps: int, seed: int,
             autocast: Optional[torch.dtype] = None) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def step(*_):
        return _step(fn, model, input_ids, seed, autocast)

    sync(device)
    t0 = time.perf_counter()
    loss = step()  # compiles
    sync(device)
    out["first_step_s"] = time.perf_counter() - t0
    out["loss"] = float(loss)
    for _ in range(max(warmup - 1, 0)):
        step()
    sync(device)
    if device.type == "cuda":
        times = cuda_step_times(step, device, reps)
        out["host_ms"] = StepTimes.of(host_enqueue_ms(step, device, reps)).median
    else:
        times = wall_step_times(step, reps)
    out.update(StepTimes.of(times).fields())
    if device.type == "cuda":
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    return out


def _row(family: str, tokens: int, batch: int, seq: int, provider: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "family": family, "tokens": tokens, "batch": batch, "seq": seq, "provider": provider, "status": "ok",
        "ms": None, "step_times_ms": None, "steps_timed": None, "ms_spread": None, "wide_spread": None,
        "host_ms": None, "peak_bytes": None, "first_step_s": None, "loss": None, "loss_rel_diff": None,
        "moe_blocks": None, "graphs": None, "regions": None, "regions_rewritten": None, "note": "",
    }
    row.update(fields)
    return row


@dataclasses.dataclass
class ModelsBenchResult(JsonResult):
    meta: dict[str, Any]
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": self.rows}

    def to_markdown(self) -> str:
        return format_models_markdown(self)

    def moe_share(self, family: str, tokens: int) -> Optional[float]:
        """Share of Inductor's step in the expert computation: 1 - ms(no experts) / ms(inductor)."""
        ms = {r["provider"]: r["ms"] for r in self.rows
              if r["family"] == family and r["tokens"] == tokens and r["status"] == "ok"}
        if ms.get("inductor") and ms.get(NO_EXPERTS) is not None:
            return 1.0 - ms[NO_EXPERTS] / ms["inductor"]
        return None


def _split_tokens(tokens: int, seq: Optional[int]) -> tuple[int, int]:
    seq = min(tokens, seq or 2048)
    if tokens % seq:
        raise ValueError(f"tokens per step {tokens} is not a multiple of the sequence length {seq}; pick --seq so "
                         "that it divides every token count")
    return tokens // seq, seq


def run_models_bench(
    families: Sequence[str] = tuple(FAMILIES),
    tokens: Sequence[int] = (4096, 8192, 16384),
    *,
    layers: int = 2,
    seq: Optional[int] = None,
    tiny: bool = False,
    providers: Sequence[str] = MODEL_PROVIDERS,
    fsdp_style: bool = False,
    moe_share: bool = False,
    device: str | torch.device = "cuda",
    dtype: Optional[torch.dtype] = None,
    autocast: bool = False,
    warmup: int = 2,
    reps: int = 8,
    moeblaze_options: Optional[dict[str, Any]] = None,
    overrides: Optional[dict[str, dict[str, Any]]] = None,
    seed: int = 0,
    progress: bool = True,
) -> ModelsBenchResult:
    """Run the model benchmark (see the module docstring). ``dtype`` defaults to bf16 on CUDA, float32 on the CPU.
    With ``autocast`` the weights are float32 and each step's forward and loss run under ``torch.autocast`` in
    ``dtype`` (default bf16), as mixed-precision training with float32 weights does (the Hugging Face Trainer's
    ``bf16=True``, torchtitan on one GPU). ``overrides``: {family or "*": {config key: value}} applied over the
    family's sizes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if autocast:
        dtype = dtype or torch.bfloat16
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast computes in bf16 or fp16, not {dtype}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    weights_dtype, autocast_dtype = (torch.float32, dtype) if autocast else (dtype, None)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown model families {unknown}; choose from {', '.join(FAMILIES)}")
    bad = [p for p in providers if p not in MODEL_PROVIDERS]
    if bad:
        raise ValueError(f"unknown providers {bad}; choose from {', '.join(MODEL_PROVIDERS)}")
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup and reps must be >= 1, got warmup={warmup}, reps={reps}")
    provider_list = list(providers)
    if moe_share:
        if "inductor" not in provider_list:
            provider_list.append("inductor")
        provider_list.append(NO_EXPERTS)
    splits = {t: _split_tokens(t, seq) for t in tokens}
    overrides = overrides or {}

    meta = environment(device)
    meta.update(dtype=str(weights_dtype).replace("torch.", ""),
                autocast=None if autocast_dtype is None else str(autocast_dtype).replace("torch.", ""),
                # what float32 products may round to (torch's and, under "auto", the operator's: config.KernelOptions)
                float32_matmul=float32_matmul_precision(device.type),
                layers=layers, tiny=tiny, fsdp_style=fsdp_style,
                warmup=warmup, reps=reps, seed=seed, moeblaze_options=dict(moeblaze_options or {}),
                step="model(input_ids, labels=input_ids).loss; loss.backward(); grads reset before each step",
                timer=(f"CUDA events, median of {reps} after {warmup} warm-up, L2 flushed before each; host = the "
                       "host's ms to enqueue one step started on an idle GPU" if device.type == "cuda" else
                       f"CPU wall clock (not device events), median of {reps} after {warmup} warm-up"),
                peak="max allocated during one step above the state before it (CUDA only)",
                moe_share="1 - ms(inductor-no-experts) / ms(inductor): experts modules replaced by x * sum(weights)",
                families={})
    rows: list[dict[str, Any]] = []
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(families) * len(tokens) * len(provider_list), desc="moeblaze bench models",
                       unit="run", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    try:
        for family in families:
            fam_over = {**overrides.get("*", {}), **overrides.get(family, {})}
            model = None
            try:
                model = build_model(family, layers=layers, tiny=tiny, device=device, dtype=weights_dtype,
                                    overrides=fam_over, seed=seed)
            except Exception as exc:  # noqa: BLE001 - one family failing must not hide the others
                status = "out of memory" if is_oom(exc) else "error"
                note = f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                for t in tokens:
                    rows.extend(_row(family, t, *splits[t], p, status=status, note=note) for p in provider_list)
                if bar is not None:
                    bar.update(len(tokens) * len(provider_list))
                free_memory(device)
                continue
            blocks = experts_modules(model)
            fam = FAMILIES[family]
            meta["families"][family] = {
                "checkpoint": fam.checkpoint, "config_class": fam.config_class,
                "config": {k: v for k, v in {**fam.config_kwargs(tiny), **fam_over}.items()},
                "parameters": sum(p.numel() for p in model.parameters()),
                "experts_implementation": getattr(model.config, "_experts_implementation", None),
                "moe_blocks": len(blocks), "note": fam.note}
            for t in tokens:
                rows.extend(_run_tokens(model, family, t, splits[t], provider_list, device, fsdp_style,
                                        moeblaze_options, warmup, reps, seed, len(blocks), bar, autocast_dtype))
            del model, blocks
            torch._dynamo.reset()  # the compiled code holds the model: let its memory go before the next family
            free_memory(device)
    finally:
        torch._dynamo.reset()
        if bar is not None:
            bar.close()
    return ModelsBenchResult(meta, rows)


def _run_tokens(model, family, tokens, split, providers, device, fsdp_style, moeblaze_options, warmup, reps, seed,
                n_blocks, bar, autocast) -> list[dict[str, Any]]:
    batch, seq = split
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    rows = []
    eager_loss = None
    for provider in providers:
        if bar is not None:
            bar.set_postfix_str(f"{family} {tokens} {provider}")
        torch._dynamo.reset()
        before, graphs_before = _moeblaze_counts(), _graphs_compiled()
        reports_before = len(all_reports())
        fields: dict[str, Any] = {}
        status, error = "ok", ""
        undo = lambda: None  # noqa: E731
        try:
            fn, undo = _compiled(model, provider, fsdp_style, moeblaze_options)
            fields = _measure(fn, model, input_ids, device, warmup, reps, seed, autocast)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the run goes on
            status = "out of memory" if is_oom(exc) else "error"
            from .compare import describe_error

            error = describe_error(exc) if status == "error" else ""
            log.warning("moeblaze bench models: %s %s at %d tokens: %s", family, provider, tokens, error or status)
        finally:
            undo()
            for p in model.parameters():
                p.grad = None
        after = _moeblaze_counts()
        regions = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        if provider != "eager":
            fields["graphs"] = _graphs_compiled() - graphs_before
        if provider == "moeblaze":
            fields["regions"] = regions
            fields["regions_rewritten"] = regions.get("rewritten", 0)
            skipped = _skip_reasons(all_reports()[reports_before:])
            if skipped and status == "ok":  # a block left to Inductor says why, in the row
                error = f"skipped: {skipped[0]}" + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else "")
        if provider == "eager" and status == "ok":
            eager_loss = fields["loss"]
        if fields.get("loss") is not None and eager_loss is not None and provider != NO_EXPERTS:
            fields["loss_rel_diff"] = abs(fields["loss"] - eager_loss) / max(abs(eager_loss), 1e-30)
        rows.append(_row(family, tokens, batch, seq, provider, status=status, note=error, moe_blocks=n_blocks,
                         **fields))
        free_memory(device)
        if bar is not None:
            bar.update(1)
    return rows


def format_models_markdown(result: ModelsBenchResult) -> str:
    m = result.meta
    compile_what = "each decoder layer compiled on its own (FSDP2 style)" if m.get("fsdp_style") else \
        "the whole model compiled"
    lines = [
        f"Device: {m['device']}; torch {m['torch']}, triton {m.get('triton') or '-'}, transformers "
        f"{m.get('transformers') or '-'}; {m['date']}; commit {m['commit']}; dtype {m['dtype']}"
        + (f", under torch.autocast({m['autocast']})" if m.get("autocast") else "")
        + (f"; torch's float32 matmul precision {m['float32_matmul']}." if m["dtype"] == "float32" and
           m.get("float32_matmul") else "."),
        f"One step = forward + loss + backward, {m['layers']} decoder layer{'s' if m['layers'] != 1 else ''} (all MoE), "
        f"{'tiny sizes' if m.get('tiny') else 'the checkpoint block sizes'}, random weights; {compile_what}.",
        f"Timer: {m['timer']}. Peak: {m['peak']}. Compile s: the first step. Regions: MoE regions rewritten / "
        "experts modules in the model (graphs Dynamo compiled; decoder layers compiled one by one share the graph "
        "of the first, so there a region rewritten once runs in every layer). vs inductor: inductor ms / this "
        "row's ms (> 1 is faster).",
        "",
        "| model (layers, tokens = batch x seq) | provider | step ms (n steps) | host ms | vs inductor | peak MB | "
        "compile s | regions | loss rel diff | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    shares = []
    last = None
    for r in result.rows:
        label = f"{r['family']} ({m['layers']}, {r['tokens']} = {r['batch']} x {r['seq']})"
        cell = label if label != last else ""
        last = label
        if r["status"] != "ok":
            lines.append(f"| {cell} | {r['provider']} | {r['status']} | - | - | - | - | - | - | "
                         f"{r['note'].replace('|', '/')} |")
            continue
        ind = next((x for x in result.rows if x["family"] == r["family"] and x["tokens"] == r["tokens"]
                    and x["provider"] == "inductor" and x["status"] == "ok"), None)
        speed = None if ind is None or not r["ms"] else ind["ms"] / r["ms"]
        step = StepTimes.of(r["step_times_ms"]).cell(".2f") if r["step_times_ms"] else "-"
        regions = "-" if r["regions_rewritten"] is None else f"{r['regions_rewritten']}/{r['moe_blocks']}"
        if r["regions_rewritten"] is not None and r["graphs"] is not None:
            regions += f" ({r['graphs']} graph{'s' if r['graphs'] != 1 else ''})"
        lines.append(
            f"| {cell} | {r['provider']} | {step} | {number_cell(r['host_ms'], '.2f')} | {number_cell(speed, '.2f')} | "
            f"{mb_cell(r['peak_bytes'], '.0f')} | {number_cell(r['first_step_s'], '.1f')} | {regions} | "
            f"{number_cell(r['loss_rel_diff'], '.1e')} | {r['note'].replace('|', '/')} |")
        if r["provider"] == NO_EXPERTS:
            share = result.moe_share(r["family"], r["tokens"])
            if share is not None:
                best = f"{1 / (1 - share):.2f}x" if share < 1 else "unbounded"
                shares.append(f"- {label}: the expert computation takes {share:.0%} of Inductor's step; if it took "
                              f"no time the step would be {best} faster.")
    lines.append("")
    note = spread_note([r.get("wide_spread") for r in result.rows])
    if note:
        lines += [note, ""]
    if shares:
        lines += ["Share of Inductor's step in the experts (1 - ms(inductor-no-experts) / ms(inductor)):", "",
                  *shares, ""]
    notes = [f"- {name}: {info['note']}" for name, info in m.get("families", {}).items() if info.get("note")]
    if notes:
        lines += ["Families:", "", *notes, ""]
    return "\n".join(lines).rstrip() + "\n"
