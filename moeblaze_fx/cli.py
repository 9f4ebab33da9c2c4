"""``moeblaze demo | compare | bench`` (also ``python -m moeblaze_fx``)."""
from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from typing import Any, Callable, Optional

import torch

from .bench.timing import StepTimes, spread_note
from .memory import SavedTensorBytes

__all__ = ["main", "demo"]


def _train(name: str, model: torch.nn.Module, step_loss: Callable[[torch.Tensor], torch.Tensor],
           batches: list[torch.Tensor], device: torch.device, progress: Any) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    losses, times, saved, peak = [], [], 0, None
    for i, batch in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        if i == 0:  # the compiling step: its compile-time work is not the step's activations
            loss, saved_i = step_loss(batch), 0
        else:
            with SavedTensorBytes(params) as meter:
                loss = step_loss(batch)
            saved_i = meter.total
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            if i > 0:  # the compiling step's autotuning and proof are not the step's memory
                peak = max(peak or 0, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        saved = max(saved, saved_i)
        progress.set_postfix_str(f"{name} step {i + 1}/{len(batches)} loss {losses[-1]:.4f}")
        progress.update(1)
    steady = StepTimes.of([1e3 * t for t in (times[1:] if len(times) > 1 else times)])  # the first step compiles
    return {"name": name, "losses": losses, "ms": steady.median, "timed": steady, "saved": saved, "peak": peak}


def demo(steps: int = 6, device: Optional[str] = None, dtype: str = "float32", tokens: int = 512,
         out=sys.stdout) -> list[dict[str, Any]]:
    """Train a small MoE transformer eagerly, under default torch.compile and under
    ``backend="moeblaze"`` from the same initial weights; print the report and a comparison."""
    from tqdm import tqdm

    import moeblaze_fx
    from moeblaze_fx.models import TinyMoETransformer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    base = TinyMoETransformer().to(dev, dt)
    seq = 64
    batches = [torch.randint(0, 256, (max(1, tokens // seq), seq + 1), device=dev) for _ in range(steps)]
    print(f"moeblaze demo: a {len(base.blocks)}-layer MoE transformer (d=64, h=128, E=8, K=2), "
          f"{tokens} tokens a step, {steps} SGD steps, {dt} on {dev}", file=out)

    variants: list[tuple[str, Callable[[torch.nn.Module], Callable]]] = [
        ("eager", lambda m: m.loss),
        ("torch.compile", lambda m: torch.compile(m.loss, fullgraph=True)),
        ("moeblaze", lambda m: torch.compile(m.loss, backend="moeblaze", fullgraph=True)),
    ]
    results = []
    torch._dynamo.reset()
    # The bar goes to stderr: the report goes to `out`, and a piped log should not get the bar's carriage returns.
    with tqdm(total=steps * len(variants), desc="training", file=sys.stderr, leave=False) as progress:
        for name, wrap in variants:
            model = copy.deepcopy(base)
            results.append(_train(name, model, wrap(model), batches, dev, progress))
            if name == "moeblaze":
                report = moeblaze_fx.last_report()
            torch._dynamo.reset()

    print("\nCompile report", file=out)
    print(moeblaze_fx.report.format_table(report), file=out)
    eager = results[0]["losses"]
    print("\n| variant | max loss diff vs eager | step ms (median, n steps) | saved for backward | peak memory |",
          file=out)
    print("|---|---|---|---|---|", file=out)
    for r in results:
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager))
        peak = "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f} MB"
        print(f"| {r['name']} | {diff:.2e} | {r['timed'].cell('.1f')} | {r['saved'] / 2**20:.2f} MB | {peak} |",
              file=out)
    note = spread_note([r["timed"].wide for r in results])
    if note:
        print(note, file=out)
    print(f"\nlosses (eager): {' '.join(f'{x:.4f}' for x in eager)}", file=out)
    if dev.type != "cuda":
        print("peak memory is measured on a GPU only; step times on a CPU say little about GPU speed.", file=out)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="moeblaze", description="MoEBlaze torch.compile backend")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="train a small MoE transformer eager / torch.compile / moeblaze")
    p_demo.add_argument("--steps", type=int, default=6)
    p_demo.add_argument("--tokens", type=int, default=512, help="tokens per step")
    p_demo.add_argument("--device", default=None)
    p_demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    try:
        from .bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_bench_args(sub.add_parser(
            "bench", help="one MoE layer across providers; 'bench models': real MoE model families, one training step"))
        bench_cli.add_compare_args(sub.add_parser("compare", help="before/after for a model"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "demo":
        demo(steps=args.steps, device=args.device, dtype=args.dtype, tokens=args.tokens)
    elif args.command == "bench":
        return bench_cli.run_bench(args) or 0
    elif args.command == "compare":
        return bench_cli.run_compare(args) or 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
