"""Arguments and entry points of ``moeblaze bench`` and ``moeblaze compare`` (called by ``moeblaze_fx.cli``).

    parser = subparsers.add_parser("bench"); add_bench_args(parser)      ->  run_bench(args) -> exit code
    parser = subparsers.add_parser("compare"); add_compare_args(parser)  ->  run_compare(args) -> exit code

``moeblaze bench`` runs the layer benchmark (``layer.py``) on shapes A-D, on a named set (``--configs sonic``:
SonicMoE's H100 grid; ``--configs operator``: the operator alone at per-GPU token counts) or on single named shapes
(``--configs sonic-7b-256``); ``moeblaze bench models`` the model benchmark (``models.py``: real model families, one
training step, eager / Inductor / moeblaze).

``moeblaze compare`` builds a small MoE transformer of its own (``--model builtin``, experts written as
Mixtral's per-expert loop) or a tiny Hugging Face model from its config with random weights
(``--hf mixtral|qwen3|olmoe``; nothing is downloaded) and compares eager, ``torch.compile`` and
``backend="moeblaze"`` on a training step.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..models import TinyMoETransformer

__all__ = [
    "add_bench_args",
    "run_bench",
    "add_compare_args",
    "run_compare",
    "add_models_args",
    "run_models",
    "build_compare_model",
    "DTYPES",
]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}") from None


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_device(device: str) -> Optional[str]:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: no CUDA GPU is visible to this torch ({torch.__version__}); use --device cpu"
    return None


# ---------------------------------------------------------------------------------------------
# moeblaze bench
# ---------------------------------------------------------------------------------------------
def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .layer import CONFIG_SETS, CONFIGS, PROVIDERS, SWEEP_SHAPE

    parser.description = (
        "One MoE layer, forward + backward, router included (linear -> softmax -> top-k -> renormalize), "
        "for several implementations. FLOPs = 18*T*K*d*h; forward and backward are also timed apart.")
    sets = "; ".join(f"'{name}': {', '.join(cfgs)}" for name, cfgs in CONFIG_SETS.items())
    parser.add_argument("--configs", default="A,B,C,D",
                        help=f"built-in configurations to run, comma-separated: {','.join(CONFIGS)}, a named set "
                             f"(all its shapes) or one shape of a set ({sets}), or 'none' (default: A,B,C,D)")
    parser.add_argument("--config", action="append", default=[], metavar="T,d,h,E,K",
                        help="an extra layer shape (repeatable)")
    parser.add_argument("--providers", default=None,
                        help=f"comma-separated subset of {','.join(PROVIDERS)} (default: all available)")
    parser.add_argument("--sweep", action="store_true",
                        help="token-scaling sweep at (d,h,E,K) = %s: T doubles from --sweep-start until each "
                             "provider's first out-of-memory or --max-tokens" % (SWEEP_SHAPE,))
    parser.add_argument("--sweep-shape", default=",".join(map(str, SWEEP_SHAPE)), metavar="d,h,E,K",
                        help="layer shape of the sweep (default: %(default)s)")
    parser.add_argument("--sweep-start", type=int, default=8192, help="first T of the sweep (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=1 << 21, help="last T of the sweep (default: %(default)s)")
    parser.add_argument("--device", default=_default_device(), help="cuda or cpu (default: %(default)s)")
    parser.add_argument("--dtype", type=_dtype, default=torch.bfloat16, help="bf16 (default), fp16 or fp32")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per row (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per row, median reported (default: %(default)s)")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 reference and the error column")
    parser.add_argument("--check-max-tokens", type=int, default=None,
                        help="skip the error check above this many tokens (default: always check)")
    parser.add_argument("--no-dispatch", action="store_true", help="skip the dispatch micro-benchmark")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new layer shape after this many seconds; the rest is listed as not run")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="cap CUDA allocations at this fraction of the GPU (a smaller GPU; quick OOM checks)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", default=None, metavar="PATH", help="write the markdown tables")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write bench.json, bench.md (and with --plot the PNGs) into DIR")
    parser.add_argument("--plot", action="store_true", help="write PNG charts (needs matplotlib) into --out or .")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    what = parser.add_subparsers(dest="bench_what", metavar="{models}",
                                 help="'models': one training step of real MoE model families (moeblaze bench "
                                      "models --help); without it, the layer benchmark above")
    add_models_args(what.add_parser("models", help="one training step of real MoE model families"))
    return parser


def _write_results(result, args: argparse.Namespace, stem: str) -> None:
    """Print the markdown tables; write them and the JSON rows where --out, --json and --markdown say."""
    markdown = result.to_markdown()
    print(markdown)
    sys.stdout.flush()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        result.to_json(os.path.join(args.out, f"{stem}.json"))
        with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
            f.write(markdown)
    if args.json:
        result.to_json(args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown)


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_what", None) == "models":
        return run_models(args)
    from .layer import NAMED_CONFIGS, parse_config, parse_configs, run_layer_bench, sweep_tokens

    problem = _check_device(args.device)
    if problem:
        print(f"moeblaze bench: {problem}", file=sys.stderr)
        return 2
    try:
        configs = parse_configs(args.configs)
        configs += [parse_config(c) for c in args.config]
        providers = None if not args.providers else [p.strip() for p in args.providers.split(",") if p.strip()]
        sweep_shape = tuple(int(v) for v in args.sweep_shape.split(","))
        if len(sweep_shape) != 4:
            raise ValueError(f"--sweep-shape expects d,h,E,K; got {args.sweep_shape!r}")
        sweep = sweep_tokens(args.sweep_start, args.max_tokens) if args.sweep else []
    except ValueError as exc:
        print(f"moeblaze bench: {exc}", file=sys.stderr)
        return 2
    if not configs and not sweep:
        print("moeblaze bench: nothing to run: give --configs (A-D, sonic, operator or a shape's name), --config or "
              "--sweep", file=sys.stderr)
        return 2
    if args.plot:
        from .compare import check_plot_requirements

        try:  # before any work: a missing plotting package must not cost the user a run
            check_plot_requirements()
        except RuntimeError as exc:
            print(f"moeblaze bench: --plot: {exc}", file=sys.stderr)
            return 2
    if torch.device(args.device).type == "cpu" and any(NAMED_CONFIGS.get(c.name) == c for c in configs):
        print("moeblaze bench: note: the built-in configs (A-D, sonic, operator) are GPU-sized; on the CPU use "
              "--configs none --config T,d,h,E,K", file=sys.stderr)
    try:
        result = run_layer_bench(
            configs, providers, device=args.device, dtype=args.dtype, sweep=sweep, sweep_shape=sweep_shape,
            warmup=args.warmup, reps=args.reps, check=not args.no_check, check_max_tokens=args.check_max_tokens,
            dispatch=not args.no_dispatch, seed=args.seed, progress=not args.no_progress, budget_s=args.budget_s,
            memory_fraction=args.memory_fraction)
    except ValueError as exc:
        print(f"moeblaze bench: {exc}", file=sys.stderr)
        return 2
    _write_results(result, args, "bench")
    if args.plot:
        try:
            for path in result.plot(args.out or "."):
                print(f"wrote {path}")
        except RuntimeError as exc:
            print(f"moeblaze bench: {exc}", file=sys.stderr)
            return 1
    failed = [r for r in result.rows if r["status"] == "error"]
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# moeblaze bench models
# ---------------------------------------------------------------------------------------------
MODELS_TOKENS = "4096,8192,16384"
TINY_TOKENS = "64"


def add_models_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .models import FAMILIES, MODEL_PROVIDERS

    parser.description = (
        "One training step (forward + loss + backward) of Hugging Face MoE model families built from their configs "
        "with the block sizes of a published checkpoint and random weights (nothing is downloaded), for eager, "
        "torch.compile (Inductor) and backend='moeblaze' in one process: step time, host time, peak memory, compile "
        "time, MoE regions rewritten, loss agreement with eager.")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated from %(default)s (default: all)")
    parser.add_argument("--tokens", default=None,
                        help=f"tokens per step, comma-separated (default: {MODELS_TOKENS}; {TINY_TOKENS} with --tiny)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length; batch = tokens / seq (default: min(tokens, 2048); 32 with --tiny)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, every one MoE (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (d=64, E=8) for a CPU")
    parser.add_argument("--providers", default=",".join(MODEL_PROVIDERS),
                        help="comma-separated from %(default)s (default: all)")
    parser.add_argument("--fsdp-style", action="store_true",
                        help="compile each decoder layer (model.model.layers[i]) on its own, as FSDP2 and "
                             "torchtitan do, instead of the whole model")
    parser.add_argument("--moe-share", action="store_true",
                        help="also time Inductor with the experts modules replaced by a stand-in without GEMMs: the "
                             "share of Inductor's step in the experts, and the best speed-up replacing them can give")
    parser.add_argument("--override", action="append", default=[], metavar="[FAMILY.]KEY=VALUE",
                        help="set a config field (JSON value) for one family or all, e.g. "
                             "deepseek_v3.n_routed_experts=64 (repeatable)")
    parser.add_argument("--moeblaze-options", default=None, metavar="JSON",
                        help='backend options of the moeblaze provider, e.g. \'{"checkpoint": "recompute"}\'')
    parser.add_argument("--device", default=_default_device(), help="cuda or cpu (default: %(default)s)")
    parser.add_argument("--dtype", type=_dtype, default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 "
                                                                   "on CPU); with --autocast, the autocast dtype")
    parser.add_argument("--autocast", action="store_true",
                        help="mixed precision: float32 weights, each step's forward and loss under torch.autocast in "
                             "--dtype (default bf16), as the Hugging Face Trainer's bf16=True trains")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps, the compiling one included "
                                                              "(default: %(default)s)")
    parser.add_argument("--reps", type=int, default=8, help="timed steps, median reported (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", default=None, metavar="PATH", help="write the markdown table")
    parser.add_argument("--out", default=None, metavar="DIR", help="write models.json and models.md into DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return values


def run_models(args: argparse.Namespace) -> int:
    import json

    from .models import parse_overrides, run_models_bench

    problem = _check_device(args.device)
    if problem:
        print(f"moeblaze bench models: {problem}", file=sys.stderr)
        return 2
    try:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        tokens = _int_list(args.tokens or (TINY_TOKENS if args.tiny else MODELS_TOKENS), "--tokens")
        providers = [p.strip() for p in args.providers.split(",") if p.strip()]
        overrides = parse_overrides(args.override)
        try:
            options = json.loads(args.moeblaze_options) if args.moeblaze_options else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--moeblaze-options: not JSON ({exc}): {args.moeblaze_options!r}") from None
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"--moeblaze-options: expected a JSON object, got {args.moeblaze_options!r}")
        result = run_models_bench(
            families, tokens, layers=args.layers, seq=args.seq or (32 if args.tiny else None), tiny=args.tiny,
            providers=providers, fsdp_style=args.fsdp_style, moe_share=args.moe_share, device=args.device,
            dtype=args.dtype, autocast=args.autocast, warmup=args.warmup, reps=args.reps, moeblaze_options=options,
            overrides=overrides,
            seed=args.seed, progress=not args.no_progress)
    except (ValueError, RuntimeError) as exc:
        print(f"moeblaze bench models: {exc}", file=sys.stderr)
        return 2
    _write_results(result, args, "models")
    return 1 if any(r["status"] == "error" for r in result.rows) else 0


# ---------------------------------------------------------------------------------------------
# The built-in model of `moeblaze compare` (moeblaze_fx.models.TinyMoETransformer)
# ---------------------------------------------------------------------------------------------
def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


HF_MODELS = ("mixtral", "qwen3", "olmoe")


def _hf_config(name: str, vocab: int, d: int, layers: int, heads: int, h: int, num_experts: int, top_k: int):
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("--hf needs transformers (pip install 'transformers>=5')") from exc
    common = dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), max_position_embeddings=4096, bos_token_id=0,
                  eos_token_id=1, pad_token_id=None)
    if name == "mixtral":
        return transformers.MixtralConfig(intermediate_size=h, num_local_experts=num_experts,
                                          num_experts_per_tok=top_k, **common)
    if name == "qwen3":
        return transformers.Qwen3MoeConfig(intermediate_size=2 * h, moe_intermediate_size=h, num_experts=num_experts,
                                           num_experts_per_tok=top_k, head_dim=d // heads, decoder_sparse_step=1,
                                           mlp_only_layers=[], norm_topk_prob=True, **common)
    if name == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=h, num_experts=num_experts, num_experts_per_tok=top_k,
                                        **common)
    raise ValueError(f"--hf: unknown model {name!r}; choose from {HF_MODELS}")


def build_compare_model(hf: Optional[str] = None, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        batch: int = 2, seq: int = 32, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4,
                        h: int = 96, num_experts: int = 8, top_k: int = 2, seed: int = 0):
    """(model, example_inputs, loss_fn, compile_kwargs) for ``compare``: the built-in model or a tiny HF one."""
    torch.manual_seed(seed)
    if hf is None:
        model = TinyMoETransformer(vocab=vocab, d=d, h=h, layers=layers, heads=heads, num_experts=num_experts,
                                   top_k=top_k)
        # The per-expert loop's `where` has a data-dependent size: Dynamo keeps it in one graph only with
        # fullgraph=True (otherwise it breaks the graph there and no backend sees the whole region).
        compile_kwargs: dict[str, Any] = {"fullgraph": True}
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_hf_config(hf, vocab, d, layers, heads, h, num_experts, top_k))
        compile_kwargs = {}
    model = model.to(device=device, dtype=dtype).train()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    if hf is None:
        return model, (input_ids,), lambda logits: next_token_loss(logits, input_ids), compile_kwargs
    # Hugging Face models compute the shifted next-token loss themselves from labels.
    return model, {"input_ids": input_ids, "labels": input_ids}, None, compile_kwargs


# ---------------------------------------------------------------------------------------------
# moeblaze compare
# ---------------------------------------------------------------------------------------------
def add_compare_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = (
        "Before/after on a small MoE model: eager, torch.compile (Inductor) and backend='moeblaze' per memory "
        "policy: loss and gradient agreement with eager, step time, saved activations, peak memory, compile report.")
    parser.add_argument("--hf", choices=HF_MODELS, default=None,
                        help="a tiny Hugging Face model of this family, random weights, no download "
                             "(default: the built-in MoE transformer)")
    parser.add_argument("--device", default=_default_device(), help="cuda or cpu (default: %(default)s)")
    parser.add_argument("--dtype", type=_dtype, default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (default: %(default)s)")
    parser.add_argument("--policies", default="activations,recompute",
                        help="moeblaze memory policies to compare (default: %(default)s)")
    parser.add_argument("--no-inductor", action="store_true", help="leave out the default torch.compile variant")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64, help="model width d (default: %(default)s)")
    parser.add_argument("--expert-hidden", type=int, default=96, help="expert width h (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=8, help="E (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=2, help="K (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", nargs="?", const="moeblaze_compare.png", default=None, metavar="PNG",
                        help="write a PNG (default name: %(const)s)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def run_compare(args: argparse.Namespace) -> int:
    from .compare import check_plot_requirements, compare, plot_compare

    problem = _check_device(args.device)
    if problem:
        print(f"moeblaze compare: {problem}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:  # before any work: a missing plotting package must not cost the user a run
            check_plot_requirements()
        except RuntimeError as exc:
            print(f"moeblaze compare: --plot: {exc}", file=sys.stderr)
            return 2
    dtype = args.dtype or (torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    try:
        model, inputs, loss_fn, compile_kwargs = build_compare_model(
            args.hf, device=args.device, dtype=dtype, batch=args.batch, seq=args.seq, d=args.hidden,
            h=args.expert_hidden, num_experts=args.experts, top_k=args.top_k, layers=args.layers, seed=args.seed)
        result = compare(model, inputs, loss_fn=loss_fn, policies=policies, steps=args.steps,
                         inductor=not args.no_inductor, compile_kwargs=compile_kwargs, seed=args.seed,
                         progress=not args.no_progress)
    except (ValueError, RuntimeError) as exc:
        print(f"moeblaze compare: {exc}", file=sys.stderr)
        return 2
    what = f"Hugging Face {args.hf} (tiny, random weights)" if args.hf else "built-in MoE transformer"
    print(f"{what}: batch {args.batch} x seq {args.seq}, d={args.hidden}, h={args.expert_hidden}, "
          f"E={args.experts}, K={args.top_k}, {args.layers} layers\n")
    print(result.table())
    for variant in result.reports:
        print(f"{variant}:\n{result.report_text(variant)}\n")
    sys.stdout.flush()
    code = 0 if all(r.status == "ok" for r in result.rows) else 1
    if args.json:
        result.to_json(args.json)
    if args.plot is not None:
        try:  # after the table is out: whatever happens to the plot, the results were printed
            result.plot_path = plot_compare(result, args.plot)
            print(f"wrote {result.plot_path}")
        except (RuntimeError, OSError) as exc:
            print(f"moeblaze compare: the plot was not written: {exc}", file=sys.stderr)
            code = 1
    return code
