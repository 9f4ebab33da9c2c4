"""Survey: which Hugging Face transformers MoE families the moeblaze backend rewrites, and whether it stays exact.

    python benchmarks/hf_survey.py OUT_DIR [FAMILY ...] [--precisions fp32,autocast-bf16,casts-bf16] [--timeout 300]
                                   [--max-params 50000000] [--max-memory-gb 8]
    python benchmarks/hf_survey.py --table SURVEY_JSONL > TABLE_MD

Runs on the CPU; no GPU needed: ``pip install torch && pip install -e ".[test]"`` (which brings transformers), then
the command above. The current table is benchmarks/hf_survey_cpu.md (benchmarks/RESULTS.md, "Hugging Face model
survey").

For every MoE family of the installed transformers (default: each model directory whose modeling file mentions
``use_experts_implementation``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``,
``num_experts_per_tok`` or ``moe_topk``), a tiny float32 model is built from its config class (2 layers, hidden 32,
8 experts, top-2: ``GENERIC`` plus the per-family ``SPEC`` overrides below) and one training step is run twice on the
CPU, on the same weights and the same (2, 16) batch of token ids:

* eager;
* ``torch.compile(model, backend="moeblaze", options={"inductor": False}, fullgraph=False)``, so that the rewritten
  FX graph runs as is and any difference comes from the moeblaze rewrite, not from Inductor.

The loss is the causal-LM loss (or, for a base model, a fixed linear functional of the last hidden state). Measured:
the MoE layers the model has (modules carrying ``_is_expert_parallel``, or ``SPEC[...]["expect"]`` where the family
has none), moeblaze's ``rewritten``/``skipped`` counters and region records, Dynamo's graph breaks, and the largest
relative error against eager over the loss and every parameter gradient (``|a - b| / |b|`` in the 2-norm; a gradient
present on one side only counts as infinite). A relative error above 1e-4 is marked WRONG.

Each family runs under the experts implementations ``grouped_mm`` and ``batched_mm``
(``model.set_experts_implementation``); a family without that support runs once with its own code (``default``).
Every (family, implementation) runs in a fresh subprocess of this script (``--one FAMILY IMPL``, one at a time) with a
timeout and an address-space limit (``--max-memory-gb``), so a crash, a hang or an oversized allocation costs only
that row. A model over ``--max-params`` parameters (counted on the meta device before anything is allocated, where
the model can be built there) is not run, and the reason is recorded.

Output: one JSON line per run appended to OUT_DIR/survey.jsonl (logs in OUT_DIR/logs/), then OUT_DIR/survey.md, a
markdown table headed by the transformers, torch and moeblaze_fx versions (commit) and the date.

Adding rows to the committed table: run only the families and precisions missing from it into a fresh OUT_DIR, append
OUT_DIR/survey.jsonl to benchmarks/hf_survey_cpu.jsonl, and regenerate benchmarks/hf_survey_cpu.md from it with
``--table``. Each row keeps the versions, commit and date it ran with, and the table's header lists every such batch.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import glob
import inspect
import json
import os
import re
import resource
import subprocess
import sys
import time
import traceback

IMPLS = ("grouped_mm", "batched_mm")
WRONG_ABOVE = 1e-4
# The precisions a step runs in, with the relative error against eager in the same precision above which a tensor is
# looked at again (for the mixed ones: the bf16 rounding of a tiny model's step, as tests/helpers.py's TOL):
# fp32: float32 parameters and compute;
# autocast-bf16: float32 parameters, the forward under torch.autocast("cpu", torch.bfloat16), the backward after it
#   (Hugging Face Trainer's bf16=True, Accelerate, Lightning);
# casts-bf16: float32 parameters, each cast to bfloat16 where forward reads it (torch.nn.utils.parametrize with a
#   cast: the graph holds ``.to(torch.bfloat16)`` of every weight, as torchtitan's casts in forward or FSDP2's
#   MixedPrecisionPolicy give it), gradients back in float32.
PRECISIONS = {"fp32": WRONG_ABOVE, "autocast-bf16": 4e-2, "casts-bf16": 4e-2}
RESULT_MARK = "HF_SURVEY_RESULT "
MOE_PATTERN = (r"use_experts_implementation|num_local_experts|n_routed_experts|moe_num_experts|num_experts_per_tok"
               r"|moe_topk")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # this checkout's moeblaze_fx (the one run_versions names), not an installed copy
    sys.path.insert(0, REPO)

# ---------------------------------------------------------------------------------------------------------------------
# Tiny configs. GENERIC sets every size-like field a family may have; make() passes only the fields the family's config
# class declares (directly or through its attribute_map). SPEC: family -> cfg (config class name, when the family's
# registered config is a multimodal wrapper), model (model class name), kw (extra overrides), expect (MoE layers, for
# families whose experts carry no ``_is_expert_parallel`` marker).
# ---------------------------------------------------------------------------------------------------------------------
E = 8
GENERIC = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
    intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=24, expert_intermediate_size=24,
    num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E, num_experts_per_tok=2,
    moe_topk=2, moe_k=2, top_k=2, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    router_jitter_noise=0.0, input_jitter_noise=0.0, sliding_window=8, use_sliding_window=False,
    tie_word_embeddings=False, norm_topk_prob=True, output_router_logits=False,
    layer_types=None, first_dense_layers=0, num_dense_layers=0, moe_layer_start_index=0, moe_layer_freq=1,
    moe_layer_interval=1, dense_layers=None, shared_intermediate_size=24, mlp_layer_types=["sparse", "sparse"],
)

_LINEAR_ATTN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
SPEC = {
    "jamba": dict(kw=dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                          mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    "gpt_oss": dict(kw=dict(layer_types=["sliding_attention", "full_attention"])),
    "lfm2_moe": dict(kw=dict(layer_types=["full_attention", "conv"])),
    "nemotron_h": dict(kw=dict(layer_types=["full_attention", "moe", "moe"], num_hidden_layers=3, mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8,
                               moe_shared_expert_intermediate_size=24, use_mamba_kernels=False)),
    "beam": dict(kw=dict(mlp_layer_types=["sparse", "sparse"], layer_types=["sliding_attention", "full_attention"])),
    "longcat_flash": dict(kw=dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=24, zero_expert_num=2,
                                  moe_topk=2), expect=2),
    "doge": dict(kw=dict(is_moe=True, num_experts=16, num_experts_per_tok=4), expect=2),
    "dbrx": dict(kw=dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                         attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                         ffn_config=dict(hidden_size=32, ffn_hidden_size=24, moe_num_experts=E, moe_top_k=2)),
                 expect=2),
    "jetmoe": dict(kw=dict(kv_channels=8), expect=2),
    "mimo_v2_flash": dict(kw=dict(head_dim=12)),
    "kimi_linear": dict(kw=dict(linear_head_dim=8, linear_num_heads=4)),
    "deepseek_v4": dict(kw=dict(mlp_layer_types=["moe", "moe"])),
    "hy_v3": dict(kw=dict(mlp_layer_types=["sparse", "sparse"])),
    "hy_v4": dict(kw=dict(mlp_layer_types=["sparse", "sparse"], index_head_dim=8, index_n_heads=2, index_topk=8)),
    "granitemoehybrid": dict(kw=dict(layer_types=["attention", "mamba"], mamba_n_heads=4, mamba_d_state=8,
                                     mamba_chunk_size=8, mamba_d_head="auto", mamba_expand=2)),
    "zaya": dict(kw=dict(num_experts_per_tok=1, router_hidden_size=16)),
    "llama4": dict(cfg="Llama4TextConfig", model="Llama4ForCausalLM",
                   kw=dict(intermediate_size=24, intermediate_size_mlp=64, num_experts_per_tok=1,
                           attention_chunk_size=16, interleave_moe_layer_step=1), expect=2),
    "qwen3_5_moe": dict(cfg="Qwen3_5MoeTextConfig", model="Qwen3_5MoeForCausalLM", kw=_LINEAR_ATTN),
    "qwen4_exp": dict(cfg="Qwen4ExpTextConfig", model="Qwen4ExpForCausalLM", kw=_LINEAR_ATTN),
    "qwen3_next": dict(kw=_LINEAR_ATTN),
    "inkling": dict(cfg="InklingTextConfig", model="InklingForCausalLM"),
    "inkling2": dict(cfg="Inkling2TextConfig", model="Inkling2ForCausalLM", kw=dict(unpadded_vocab_size=64)),
    "inkling2_loop": dict(cfg="Inkling2LoopTextConfig", model="Inkling2LoopForCausalLM",
                          kw=dict(unpadded_vocab_size=64)),
    "aria": dict(cfg="AriaTextConfig", model="AriaTextForCausalLM"),
    "gemma4": dict(cfg="Gemma4TextConfig", model="Gemma4ForCausalLM",
                   kw=dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=64,
                           hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"])),
    "minimax_m3_vl": dict(cfg="MiniMaxM3VLTextConfig", model="MiniMaxM3VLForCausalLM"),
    "mistral4": dict(model="Mistral4ForCausalLM"),
    "dots3_note": dict(cfg="Dots3NoteTextConfig"),
    # The registered step3p7 config is a large vision-language model; its text tower alone is the MoE part.
    "step3p7": dict(cfg="Step3p7TextConfig", model="Step3p7TextModel", kw=dict(sliding_window=8, share_expert_dim=24),
                    expect=2),
}


def _config_fields(cfg_cls) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cfg_cls)}
    except TypeError:  # not a dataclass: fall back to the constructor's arguments
        return set(inspect.signature(cfg_cls.__init__).parameters)


def make(family: str):
    """The family's tiny config: GENERIC and SPEC overrides, restricted to the fields its config class declares."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    spec = SPEC.get(family, {})
    cfg_cls = getattr(transformers, spec["cfg"]) if "cfg" in spec else CONFIG_MAPPING[family]
    overrides = {**GENERIC, **spec.get("kw", {})}
    fields = _config_fields(cfg_cls)
    attribute_map = getattr(cfg_cls, "attribute_map", {}) or {}
    kwargs = {}
    for key, value in overrides.items():
        if key in fields:
            kwargs[key] = value
        elif key in attribute_map and attribute_map[key] in fields and attribute_map[key] not in kwargs:
            kwargs[attribute_map[key]] = value
    return cfg_cls(**kwargs)


def model_class(family: str):
    """SPEC's model class, else the family's causal-LM class, else its base model class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    spec = SPEC.get(family, {})
    name = spec.get("model") or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family) or MODEL_MAPPING_NAMES.get(family)
    if name is None:
        raise LookupError(f"no causal-LM or base model class registered for {family!r}; add one to SPEC")
    return getattr(transformers, name)


def expert_modules(model) -> list[str]:
    """Names of the experts modules that transformers' experts implementations (grouped_mm, batched_mm) replace."""
    return [name for name, module in model.named_modules() if hasattr(module, "_is_expert_parallel")]


def list_families() -> list[str]:
    """Model types whose modeling file mentions an MoE marker (MOE_PATTERN)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    families = []
    models_dir = os.path.join(os.path.dirname(transformers.__file__), "models")
    for path in sorted(glob.glob(os.path.join(models_dir, "*", "modeling_*.py"))):
        with open(path) as f:
            if not re.search(MOE_PATTERN, f.read()):
                continue
        directory = os.path.basename(os.path.dirname(path))
        types = [t for t in CONFIG_MAPPING_NAMES if t == directory or t.replace("-", "_") == directory]
        families += [t for t in types or [directory] if t not in families]
    return families


# ---------------------------------------------------------------------------------------------------------------------
# One (family, impl) run, in its own process.
# ---------------------------------------------------------------------------------------------------------------------
def _rel_err(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _too_large(cfg, cls, n_params: int, max_params: int) -> str:
    return (f"{cls.__name__}({type(cfg).__name__}) has {n_params / 1e6:,.0f}M parameters after construction with the "
            f"tiny overrides (limit {max_params / 1e6:,.0f}M)")


def _cast_to(dtype):
    """A parametrization that casts a float32 parameter where forward reads it (casts in forward)."""
    import torch

    class CastTo(torch.nn.Module):
        def forward(self, weight):
            return weight.to(dtype)

    return CastTo()


def _cast_in_forward(model, dtype) -> None:
    """Every floating-point parameter of ``model`` read through a cast to ``dtype`` (the parameter stays float32)."""
    import torch.nn.utils.parametrize as parametrize

    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point():
                parametrize.register_parametrization(module, name, _cast_to(dtype), unsafe=True)


def _plain_name(name: str) -> str:
    """A parametrized parameter's name as it was before (``a.parametrizations.w.original`` -> ``a.w``)."""
    return name.replace("parametrizations.", "").replace(".original", "")


def run_one(family: str, impl: str, max_params: int, precision: str = "fp32") -> dict:
    """Eager step vs moeblaze-compiled step of the family's tiny model, both in ``precision``. Returns the result
    record."""
    import contextlib

    import torch
    from torch._dynamo.utils import counters

    import moeblaze_fx

    res: dict = dict(family=family, impl=impl, precision=precision)
    stage = "build"
    try:
        cfg = make(family)
        cls = model_class(family)
        res["model_class"] = cls.__name__
        try:
            with torch.device("meta"):  # count parameters before allocating anything
                n_params = sum(p.numel() for p in cls(copy.deepcopy(cfg)).parameters())
        except Exception as e:  # some models cannot be built on the meta device: count after the real build
            res["meta_build_error"] = f"{type(e).__name__}: {e}"[:500]
            n_params = 0
        if n_params > max_params:
            res.update(impl="-", n_params=n_params, not_run=_too_large(cfg, cls, n_params, max_params))
            return res
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
        res["n_params"] = n_params = sum(p.numel() for p in model.parameters())
        if n_params > max_params:
            res.update(impl="-", not_run=_too_large(cfg, cls, n_params, max_params))
            return res
        experts = expert_modules(model)
        res["expected_moe"] = len(experts) or SPEC.get(family, {}).get("expect")
        if impl != "default":
            if not experts:
                res["no_experts_impl"] = True
                res["not_run"] = "no experts module with set_experts_implementation support; run with impl=default"
                return res
            model.set_experts_implementation(impl)
        res["experts_impl"] = getattr(model.config, "_experts_implementation", None)

        tokens = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        causal = "CausalLM" in cls.__name__
        mixed = precision != "fp32"
        # the same step in float32 (no autocast, no casts): a mixed-precision tensor off eager is judged by its
        # distance from this one
        float32_copy = copy.deepcopy(model) if mixed else None
        if precision == "casts-bf16":
            _cast_in_forward(model, torch.bfloat16)
        compiled_copy = copy.deepcopy(model)

        def step(module, params, autocast=precision == "autocast-bf16") -> torch.Tensor:
            for p in params:
                p.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                if causal:
                    loss = module(tokens, labels=tokens, use_cache=False).loss
                else:  # a base model: a fixed linear functional of the last hidden state
                    h = module(tokens, use_cache=False).last_hidden_state
                    loss = (h.float() * torch.linspace(-1, 1, h.numel()).view(h.shape)).sum()
            loss.float().backward()
            return loss.detach().float()

        stage = "eager"
        want = step(model, list(model.parameters()))
        want_grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        res["loss_eager"] = float(want)
        if mixed:
            stage = "eager float32"
            ref = step(float32_copy, list(float32_copy.parameters()), autocast=False)
            ref_grads = {n: None if p.grad is None else p.grad.detach().clone()
                         for n, p in float32_copy.named_parameters()}

        stage = "compiled"
        torch._dynamo.reset()
        counters.clear()
        n_reports = len(moeblaze_fx.report.all_reports())
        compiled = torch.compile(compiled_copy, backend="moeblaze", options={"inductor": False}, fullgraph=False)
        got = None
        try:
            got = step(compiled, list(compiled_copy.parameters()))
        except Exception as e:  # a failure of the compiled step is a result, with what was counted up to it
            res["crash"] = f"{type(e).__name__}: {e}"[:2000]
            res["crash_tb"] = traceback.format_exc()[-3000:]
        moeblaze_counts = dict(counters["moeblaze"])
        res["rewritten"] = moeblaze_counts.get("rewritten", 0)
        res["skipped"] = moeblaze_counts.get("skipped", 0)
        res["graph_breaks"] = sum(counters["graph_break"].values())
        res["graph_break_reasons"] = [k[:300] for k in counters["graph_break"]][:8]
        res["unique_graphs"] = counters["stats"].get("unique_graphs")
        res["records"] = [dict(status=r.status, source=r.source, idiom=r.idiom, T=r.T, d=r.d, h=r.h, E=r.E, K=r.K,
                               layout=r.layout, reason=r.reason, check=r.check)
                          for graph in moeblaze_fx.report.all_reports()[n_reports:] for r in graph]
        if got is not None:
            res["loss_compiled"] = float(got)
            errs = {"loss": abs(float(got) - float(want)) / max(abs(float(want)), 1e-30)}
            res["grad_presence_mismatch"] = []
            for name, p in compiled_copy.named_parameters():
                a, b = p.grad, want_grads[name]
                if (a is None) != (b is None):
                    res["grad_presence_mismatch"].append(name)
                    errs[name] = float("inf")
                elif a is not None:
                    errs[name] = _rel_err(a, b)
            worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
            res["max_rel"] = worst[0][1]
            res["worst"] = worst
            res["tol"] = tol = PRECISIONS[precision]
            if mixed:  # a tensor off eager by more than tol: is the compiled step further from float32 than eager?
                res["beyond_float32"] = beyond = {}
                for name, err in errs.items():
                    if err <= tol or err == float("inf"):
                        continue
                    if name == "loss":
                        got_ref, want_ref = abs(float(got) - float(ref)), abs(float(want) - float(ref))
                        scale = max(abs(float(ref)), 1e-30)
                    else:
                        r, b = ref_grads[_plain_name(name)], want_grads[name]
                        got_ref, want_ref = _rel_err(compiled_copy.get_parameter(name).grad, r), _rel_err(b, r)
                        scale = 1.0
                    if got_ref / scale > 2 * want_ref / scale:
                        beyond[name] = [got_ref / scale, want_ref / scale]
    except Exception as e:
        res["error"] = f"{stage}: {type(e).__name__}: {e}"[:1500]
        if stage == "build" and "meta_build_error" in res:  # the meta device's error is the earlier, shorter one
            res["error"] = f"build (on the meta device): {res['meta_build_error']}; then {res['error']}"[:1500]
        res["error_stage"] = stage
        res["error_tb"] = traceback.format_exc()[-2500:]
    return res


# ---------------------------------------------------------------------------------------------------------------------
# The driver: one subprocess per (family, impl), one at a time.
# ---------------------------------------------------------------------------------------------------------------------
def spawn(family: str, impl: str, args, log_dir: str, precision: str = "fp32") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", family, impl, "--max-params", str(args.max_params),
           "--max-memory-gb", str(args.max_memory_gb), "--precision", precision]
    log_path = os.path.join(log_dir, f"{family}.{impl}.{precision}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.timeout)
            stdout, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout, returncode = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
        log.write(stdout)
    seconds = round(time.time() - t0, 1)
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if lines:
        res = json.loads(lines[-1][len(RESULT_MARK):])
    elif returncode is None:
        res = dict(family=family, impl=impl, precision=precision, error=f"timeout after {args.timeout} s")
    else:
        res = dict(family=family, impl=impl, precision=precision,
                   error=f"no result: the subprocess exited with code {returncode}")
    res["seconds"] = seconds
    return res


def survey(args) -> None:
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "survey.jsonl")
    families = args.families or list_families()
    versions = run_versions()
    t0 = time.time()
    print(f"{len(families)} families -> {jsonl}", flush=True)
    for family in families:
        for precision in args.precisions:
            for impl in IMPLS:
                res = spawn(family, impl, args, log_dir, precision)
                if res.get("no_experts_impl"):  # no set_experts_implementation support: the family's own code once
                    res = spawn(family, "default", args, log_dir, precision)
                res["versions"] = versions
                _append(jsonl, res)
                print(f"[{time.time() - t0:7.0f} s] {_summary_line(res)}", flush=True)
                # a build failure or a size limit does not depend on the experts implementation: one row is enough
                if res["impl"] == "default" or res.get("not_run") or res.get("error_stage") == "build":
                    break
            if res.get("not_run") or res.get("error_stage") == "build":  # nor on the precision
                break
    rows = [json.loads(line) for line in open(jsonl)]
    with open(os.path.join(args.out_dir, "survey.md"), "w") as f:
        f.write(markdown(rows))
    print(f"done in {time.time() - t0:.0f} s: {os.path.join(args.out_dir, 'survey.md')}", flush=True)


def _append(path: str, res: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(res, default=str) + "\n")


def _summary_line(res: dict) -> str:
    return (f"{res['family']:18s} {res['impl']:10s} {res.get('precision', 'fp32'):13s} "
            f"expected={res.get('expected_moe')} "
            f"rewritten={res.get('rewritten')} skipped={res.get('skipped')} breaks={res.get('graph_breaks')} "
            f"max_rel={res.get('max_rel')} {_note(res)[:120]}")


# ---------------------------------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------------------------------
def _shorten(text: str, limit: int = 150) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _note(res: dict) -> str:
    """The error, crash or not-run reason, else the reason of the first skipped region record."""
    for key in ("error", "crash"):
        if res.get(key):
            return f"{key}: {res[key]}"
    if res.get("not_run"):
        return f"not run: {res['not_run']}"
    skipped = [r for r in res.get("records") or [] if r["status"] != "rewritten"]
    if skipped:
        return f"{os.path.basename(skipped[0]['source'] or '')}: {skipped[0]['reason']}"
    if not res.get("records"):
        return "no candidate region reported"
    return ""


def outcome(res: dict) -> str:
    """full | partial | none | error | not run | wrong (a rewrite-free run is never 'wrong' for moeblaze's sake)."""
    if res.get("not_run"):
        return "not run"
    if res.get("error") or res.get("crash"):
        return "error"
    rel, tol = res.get("max_rel"), res.get("tol", WRONG_ABOVE)
    if rel is None or (rel > tol and res.get("beyond_float32", True)):
        return "wrong"
    expected, rewritten = res.get("expected_moe"), res.get("rewritten", 0)
    if rewritten == 0:
        return "none"
    if expected is None or rewritten >= expected:
        return "full"
    return "partial"


def run_versions() -> str:
    """transformers, torch and moeblaze_fx (the commit of this checkout) versions, and today's date."""
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip():
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, moeblaze_fx {commit}, "
            f"{datetime.date.today().isoformat()}")


def _precision(res: dict) -> str:
    return res.get("precision", "fp32")  # rows written before the precisions were added ran in float32


def markdown(rows: list[dict]) -> str:
    versions = sorted({res.get("versions") or "versions not recorded" for res in rows})
    out = [
        "# Hugging Face MoE families under the moeblaze backend (CPU)",
        "",
        "; ".join(versions),
        "",
        "Generated by `python benchmarks/hf_survey.py OUT_DIR` (see its docstring): per family a tiny model "
        "(2 layers, hidden 32, 8 experts, top-2) with float32 parameters, one training step eager vs "
        '`torch.compile(backend="moeblaze", options={"inductor": False})` in the same precision, on the CPU. '
        "Precision: fp32; autocast-bf16 (the forward under `torch.autocast(\"cpu\", torch.bfloat16)`); casts-bf16 "
        "(every parameter cast to bfloat16 where forward reads it, through `torch.nn.utils.parametrize`). "
        f"Max rel. err: over the loss and every parameter gradient; in fp32 above {WRONG_ABOVE:g} is marked WRONG; "
        f"in bf16 a tensor above {PRECISIONS['autocast-bf16']:g} is marked WRONG only when the compiled step is more "
        "than twice as far from the float32 step as eager bf16 is (a tiny model's bf16 gradients can be "
        "ill-conditioned: eager bf16 is itself that far from float32 there). MoE layers expected: experts modules "
        "that `set_experts_implementation` replaces (or the count the family's config gives, for families without "
        "them).",
        "",
    ]
    run_s = sum(res.get("seconds") or 0 for res in rows)
    out += [f"Run time: {run_s / 60:.1f} min, summed over {len(rows)} subprocesses run one at a time.", ""]

    for precision in [p for p in PRECISIONS if any(_precision(res) == p for res in rows)]:
        by_family: dict[str, list[str]] = {}
        for res in rows:
            if _precision(res) == precision:
                by_family.setdefault(res["family"], []).append(outcome(res))
        counts: dict[str, int] = {}
        for outcomes in by_family.values():
            kind = outcomes[0] if len(set(outcomes)) == 1 else "mixed"
            counts[kind] = counts.get(kind, 0) + 1
        wrong_rows = sum(o == "wrong" for outcomes in by_family.values() for o in outcomes)
        out += [
            f"{precision}: families: {len(by_family)}. Every expected MoE layer rewritten: {counts.get('full', 0)}; "
            f"some of them: {counts.get('partial', 0)}; none: {counts.get('none', 0)}; an error: "
            f"{counts.get('error', 0)}; not run: {counts.get('not run', 0)}; WRONG under every impl: "
            f"{counts.get('wrong', 0)}; outcomes differing between impls: {counts.get('mixed', 0)}. WRONG rows: "
            f"{wrong_rows}.",
            "",
        ]
    out += [
        "| family | impl | precision | MoE layers expected | rewritten | skipped | graph breaks | max rel. err vs eager "
        "| first skipped region's reason, or error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {p: i for i, p in enumerate(PRECISIONS)}
    for res in sorted(rows, key=lambda r: (r["family"], order.get(_precision(r), len(order)))):
        rel = res.get("max_rel")
        if rel is None:
            rel_text = "-"
        elif outcome(res) == "wrong":
            rel_text = f"**{rel:.1e} WRONG**"
        elif rel > res.get("tol", WRONG_ABOVE):
            rel_text = f"{rel:.1e} (eager bf16 as far from float32)"
        else:
            rel_text = f"{rel:.1e}"
        cells = [res["family"], res["impl"], _precision(res), res.get("expected_moe"), res.get("rewritten"),
                 res.get("skipped"), res.get("graph_breaks"), rel_text, _shorten(_note(res))]
        out.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", help="where survey.jsonl, survey.md and logs/ go")
    parser.add_argument("families", nargs="*", help="model types (default: every MoE family found)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per (family, impl) subprocess")
    parser.add_argument("--max-params", type=int, default=50_000_000, help="do not run larger models")
    parser.add_argument("--max-memory-gb", type=float, default=8.0,
                        help="address-space limit of each subprocess, so an oversized model fails to allocate "
                             "instead of drawing the machine's out-of-memory killer")
    parser.add_argument("--precisions", type=lambda text: text.split(","), default=list(PRECISIONS),
                        help=f"comma-separated, of {', '.join(PRECISIONS)} (default: all)")
    parser.add_argument("--precision", default="fp32", choices=list(PRECISIONS), help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument("--table", metavar="JSONL", help="only rewrite the markdown table of an existing survey.jsonl")
    args = parser.parse_args(argv)
    if args.one:
        limit = int(args.max_memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        res = run_one(*args.one, max_params=args.max_params, precision=args.precision)
        print(RESULT_MARK + json.dumps(res, default=str), flush=True)
    elif args.table:
        sys.stdout.write(markdown([json.loads(line) for line in open(args.table)]))
    elif args.out_dir:
        unknown = [p for p in args.precisions if p not in PRECISIONS]
        if unknown:
            parser.error(f"--precisions: unknown {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
        survey(args)
    else:
        parser.error("OUT_DIR is required")


if __name__ == "__main__":
    main()
