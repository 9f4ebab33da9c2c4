"""Expert parallelism + the moeblaze backend on 2 or 4 GPUs over NCCL, against a single-process reference, in bf16.

    PYTHONPATH=. torchrun --nproc-per-node 2 tests/distributed/run_nccl_ep.py
    PYTHONPATH=. torchrun --nproc-per-node 4 tests/distributed/run_nccl_ep.py
    PYTHONPATH=. torchrun --nproc-per-node 2 tests/distributed/run_nccl_ep.py --backend gloo --device cpu --no-inductor

The last line checks the script's logic without a GPU (the operator's PyTorch path, small sizes, no Inductor). On
CUDA the operator runs its Triton kernels and the backend hands the rest of the graph to Inductor. The world size is
the number of ranks; the experts are split evenly over them (``--experts`` must be a multiple of it).

Each case builds ``ep_cases.ExpertParallelMoE`` (torchtitan's expert-parallel block: counts all-to-all, token
all-to-all over ``.tolist()`` splits, permute, ``torch._grouped_mm`` over the local experts or torchtitan's per-expert
loop, un-permute, all-to-all back, combine), compiles it with ``backend="moeblaze"``, ``fullgraph=True``, runs one
forward and backward on this rank's tokens, and checks on every rank:

* the counters and the report: the local expert computation between the all-to-alls rewritten
  (``{"rewritten": 1}``; the region from the top-k, which holds the collectives, is left alone and not reported), or
  for the per-expert loop ``{"skipped": 1}`` for its collectives;
* the operator running: under ``torch.profiler``, in a step after the compile (whose proof runs the operator too),
  one ``moeblaze::moe_ffn`` and one backward (no operator at all for the loop);
* the output and every gradient (tokens, router, every local expert weight) against the single-process reference
  (``ep_cases.reference``: every expert on one process, the same weights, uncompiled eager on the same device),
  run twice: as the block computes (bf16 products) and in float32. A bf16 case passes where, for every quantity, the
  compiled block's error against float32 is at most ``--bf16-factor`` times eager bf16's own error against float32
  (and at least bf16's unit roundoff, 2^-9). The float32 loop case is held to ``--tol-float32`` against float32.

The scores are computed in float32 (``router_dtype``; torchtitan's router does its softmax in float32 too): bf16
scores tie often enough at these sizes that a one-unit difference between Inductor's softmax and eager's would send
a few tokens to other experts, an error of the routing rather than of the expert computation.

The same block is then compiled with the default Inductor backend (``backend="inductor"``, not with
``--no-inductor``), and both are timed: forward + backward, median of ``--steps`` steps after ``--warmup``, CUDA
events; peak memory above the state before the timed steps. The timing and Inductor's own error are printed, never
asserted. Rank 0 prints a PASS/FAIL table and the timing table; every rank exits with 1 if any case failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ep_cases beside this file
from ep_cases import (EPSize, ExpertParallelMoE, block_results, errors, make_tokens, make_weights,  # noqa: E402
                      reference, reference_results)

# bf16's unit roundoff (8 bits of mantissa): no quantity is held to less than this against float32
BF16_FLOOR = 2.0 ** -9
# The compiled block's error against float32 may be at most this many times eager bf16's own error: the operator
# accumulates in float32 and rounds where eager's products round, so the two are of the same size.
DEFAULT_BF16_FACTOR = 2.0
# The float32 per-expert loop is left alone: the compiled block and the reference differ by summation order.
DEFAULT_TOL_FLOAT32 = 1e-5

GPU_SIZE = EPSize(experts=16, top_k=4, d=1024, h=512, tokens=4096)  # 4096 tokens per rank, 16 experts over the ranks
CPU_SIZE = EPSize(experts=4, top_k=2, d=32, h=48, tokens=37)  # 37 tokens per rank: not a multiple of anything

EVENT_FORWARD = "moeblaze::moe_ffn"
# The operator's backward is one operator, or where its autograd formula sees a static row count three (ops.py,
# "the split backward"). The rows the local region receives come from the token all-to-all: their count is
# data-dependent, so a backward traced by AOTAutograd sees a symbolic count and takes the single operator, and one
# run without it (--no-inductor) sees the count and splits. Either form is one backward.
BACKWARD_FORMS = ({"moeblaze::moe_ffn_backward": 1},
                  {"moeblaze::moe_ffn_backward_act": 1, "moeblaze::moe_ffn_backward_dx": 1,
                   "moeblaze::moe_ffn_backward_dw": 1})


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str  # the weights' and tokens' dtype
    experts: str = "grouped_mm"  # "grouped_mm" (bf16 products) or "loop" (torchtitan's per-expert loop)
    collectives: str = "functional"  # how the counts all-to-all is spelled: "functional" or "c10d" (in place)


CASES = [
    Case("grouped_mm-bfloat16", "bfloat16"),  # bf16 weights and tokens
    Case("grouped_mm-float32-weights", "float32"),  # torchtitan's: float32 weights, bf16 grouped products
    Case("grouped_mm-dist_all_to_all_counts", "bfloat16", collectives="c10d"),  # dist.all_to_all_single in place
    Case("loop-float32", "float32", experts="loop"),  # the per-expert loop over .tolist() splits: left alone
]


def capture():
    """The split sizes' ``.tolist()`` stays in the graph as unbacked sizes (torchtitan compiles so too)."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", help="process group backend (nccl, or gloo with --device cpu)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--no-inductor", action="store_true",
                        help="the backend's inductor=False and no Inductor baseline (faster on CPU)")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help=f"comma-separated, from: {', '.join(c.name for c in CASES)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--bf16-factor", type=float, default=DEFAULT_BF16_FACTOR,
                        help="a bf16 case's error against float32, at most this times eager bf16's own")
    parser.add_argument("--tol-float32", type=float, default=DEFAULT_TOL_FLOAT32,
                        help="the float32 loop case's relative error against float32")
    parser.add_argument("--timeout-s", type=float, default=600, help="collective timeout")
    for field in dataclasses.fields(EPSize):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None,
                            help=f"{'tokens per rank' if field.name == 'tokens' else 'size'} (default "
                                 f"{getattr(CPU_SIZE, field.name)} on cpu, {getattr(GPU_SIZE, field.name)} on cuda)")
    args = parser.parse_args()

    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in by_name]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(by_name)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if "RANK" not in os.environ:
        parser.error("run under torchrun: torchrun --nproc-per-node 2 tests/distributed/run_nccl_ep.py")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device: use --backend gloo --device cpu to check the script on the CPU")
        torch.cuda.set_device(local_rank)
        device, size = torch.device("cuda", local_rank), GPU_SIZE
    else:
        device, size = torch.device("cpu"), CPU_SIZE
        torch.set_num_threads(1)  # the ranks share the machine's cores
    size = dataclasses.replace(size, **{f.name: getattr(args, f.name) for f in dataclasses.fields(EPSize)
                                        if getattr(args, f.name) is not None})
    world = int(os.environ["WORLD_SIZE"])
    if size.experts % world:
        parser.error(f"--experts {size.experts} does not split over {world} ranks: use a multiple of {world}")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        failed = run(args, [by_name[n] for n in args.cases.split(",")], size, device)
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


def _step(module: Callable, model: torch.nn.Module, x0: torch.Tensor, grad_out: torch.Tensor):
    """One forward and backward from fresh gradients: (output, the tokens whose .grad was filled)."""
    model.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_(True)
    with capture():
        out = module(x)
    out.backward(grad_out)
    return out, x


def _time(step: Callable[[], Any], args, device: torch.device) -> tuple[float, Optional[float]]:
    """(median ms per step, peak MB above the state before the timed steps; None on the CPU)."""
    for _ in range(args.warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    events = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    return statistics.median(s.elapsed_time(e) for s, e in events), peak


def _op_calls(step: Callable[[], Any]) -> dict[str, int]:
    """How often each MoEBlaze operator ran in one step."""
    calls: dict[str, int] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    for event in prof.events():
        if event.name.startswith("moeblaze::"):
            calls[event.name] = calls.get(event.name, 0) + 1
    return calls


def _reference(weights, x0, grad_out, size: EPSize, dtype, compute):
    """The single-process reference's quantities (collective), its weights and tokens cast to ``dtype``."""
    ref_weights = {k: v.to(dtype).clone().requires_grad_(True) for k, v in weights.items()}
    x_ref = x0.detach().to(dtype).clone().requires_grad_(True)
    want = reference(x_ref, ref_weights, size.top_k, compute, router_dtype=torch.float32)
    want.backward(grad_out.to(dtype))
    return reference_results(want, x_ref, ref_weights)


def run_case(case: Case, args, size: EPSize, device: torch.device) -> dict[str, Any]:
    """One case on this rank (collective: every rank runs the same cases in the same order)."""
    from torch._dynamo.utils import counters

    from moeblaze_fx.report import last_report

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, case.dtype)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in make_weights(size).items()}
    x0 = make_tokens(size, rank).to(device=device, dtype=dtype)
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7 + rank)).to(device=device, dtype=dtype)

    def build():
        return ExpertParallelMoE(weights, rank, world, case.collectives, case.experts, size.top_k, torch.float32)

    torch._dynamo.reset()
    counters.clear()
    model = build()
    compiled = torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": not args.no_inductor})
    out, x = _step(compiled, model, x0, grad_out)
    got = block_results(model, out, x)
    result: dict[str, Any] = {
        "counters": dict(counters["moeblaze"]),
        "report": [(r.status, r.reason, r.idiom) for r in last_report()],
    }
    result["op_calls"] = _op_calls(lambda: _step(compiled, model, x0, grad_out))
    result["ms"], result["peak_mb"] = _time(lambda: _step(compiled, model, x0, grad_out), args, device)

    # the references: every expert on this process, this rank's tokens, eager; as the block computes and in float32
    fp32 = _reference(weights, x0, grad_out, size, torch.float32, torch.float32)
    result["err_fp32"] = errors(got, fp32)
    if case.experts == "grouped_mm":
        eager = _reference(weights, x0, grad_out, size, dtype, torch.bfloat16)
        result["eager_err_fp32"] = errors(eager, fp32)
        result["err_eager"] = errors(got, eager)

    result["inductor_ms"] = result["inductor_peak_mb"] = result["inductor_err_fp32"] = None
    if not args.no_inductor:
        torch._dynamo.reset()
        baseline = build()
        compiled_i = torch.compile(baseline, backend="inductor", fullgraph=True)
        out_i, x_i = _step(compiled_i, baseline, x0, grad_out)
        result["inductor_err_fp32"] = max(errors(block_results(baseline, out_i, x_i), fp32).values())
        result["inductor_ms"], result["inductor_peak_mb"] = _time(lambda: _step(compiled_i, baseline, x0, grad_out),
                                                                  args, device)
    torch._dynamo.reset()
    return result


def problems_of(case: Case, result: dict[str, Any], args, device: torch.device) -> list[str]:
    """What is wrong with one rank's result of ``case`` (empty: it passed)."""
    problems = []
    if case.experts == "grouped_mm":
        want_counters = {"rewritten": 1}
        want_report = [("rewritten", None, "grouped_mm over rows grouped by counts")]
        want_calls = [{EVENT_FORWARD: 1, **form} for form in BACKWARD_FORMS]
        report_ok = result["report"] == want_report
    else:
        want_counters = {"skipped": 1}
        want_calls = [{}]
        report = result["report"]
        report_ok = (len(report) == 1 and report[0][0] == "skipped"
                     and report[0][1].startswith("expert-parallel dispatch inside the region: ")
                     and "all_to_all_single" in report[0][1])
    if result["counters"] != want_counters:
        problems.append(f"counters {result['counters']}, expected {want_counters}")
    if not report_ok:
        problems.append(f"report {result['report']}")
    if result["op_calls"] not in want_calls:
        problems.append(f"operator calls {result['op_calls']}, expected {' or '.join(map(str, want_calls))}")
    if case.experts == "grouped_mm":
        for name, err in result["err_fp32"].items():
            eager = result["eager_err_fp32"][name]
            tol = max(args.bf16_factor * eager, BF16_FLOOR)
            if not err <= tol:
                problems.append(f"{name}: error {err:.3g} against float32, above {tol:.3g} "
                                f"({args.bf16_factor:g} x eager bf16's {eager:.3g})")
    else:
        for name, err in result["err_fp32"].items():
            if not err <= args.tol_float32:
                problems.append(f"{name}: error {err:.3g} against float32, above {args.tol_float32:g}")
    return problems


def run(args, cases: list[Case], size: EPSize, device: torch.device) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for case in cases:
        # a rank that raises stops here: torchrun then stops the others (no table, the traceback instead)
        result = run_case(case, args, size, device)
        problems = problems_of(case, result, args, device)
        every: list = [None] * world
        dist.all_gather_object(every, {"result": result, "problems": problems})
        rows.append((case, every))
    if rank == 0:
        print_tables(rows, args, size, device, world)
    failed = torch.tensor([any(e["problems"] for _, every in rows for e in every)], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank exits with the same status
    return bool(failed.item())


def _fmt(value: Optional[float], spec: str) -> str:
    """``value`` in ``spec`` (a width first), or "-" right-aligned to that width."""
    width = int(spec.split(".")[0] or 0)
    return f"{'-':>{width}}" if value is None else format(value, spec)


def print_tables(rows, args, size: EPSize, device: torch.device, world: int) -> None:
    import moeblaze_fx

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nExpert parallelism + moeblaze: {world} ranks ({args.backend}, {name}), torch {torch.__version__}, "
          f"inductor={not args.no_inductor}, bf16 factor {args.bf16_factor:g}, float32 tol {args.tol_float32:g}\n"
          f"size {dataclasses.asdict(size)} ({size.experts // world} experts per rank, tokens per rank), "
          f"moeblaze_fx {moeblaze_fx.__file__}")
    header = (f"{'case':36} {'rank':>4} {'counters':18} {'err vs fp32':>11} {'eager bf16':>10} {'worst ratio':>11}  "
              "result")
    print(header)
    print("-" * len(header))
    for case, every in rows:
        for r, e in enumerate(every):
            result = e["result"]
            err = max(result["err_fp32"].values()) if "err_fp32" in result else None
            eager = ratio = None
            if "eager_err_fp32" in result:
                eager = max(result["eager_err_fp32"].values())
                ratio = max(v / max(result["eager_err_fp32"][k], 1e-30) for k, v in result["err_fp32"].items())
            print(f"{case.name:36} {r:>4} {str(result.get('counters', '-')):18} {_fmt(err, '11.2e')} "
                  f"{_fmt(eager, '10.2e')} {_fmt(ratio, '11.2f')}  {'FAIL' if e['problems'] else 'PASS'}")
            for problem in e["problems"]:
                print(f"    {problem}")
    print("\nerr vs fp32, eager bf16: the largest relative error over the output and every gradient; worst ratio: the "
          "largest of compiled / eager bf16, quantity by quantity")
    print(f"\nforward + backward per step (median of {args.steps}, "
          f"{'CUDA events' if device.type == 'cuda' else 'wall clock'}), peak MB above the state before the steps; "
          "informational")
    header = (f"{'case':36} {'rank':>4} {'moeblaze ms':>11} {'inductor ms':>11} {'moeblaze MB':>11} "
              f"{'inductor MB':>11} {'inductor err':>12}")
    print(header)
    print("-" * len(header))
    for case, every in rows:
        for r, e in enumerate(every):
            result = e["result"]
            print(f"{case.name:36} {r:>4} {_fmt(result.get('ms'), '11.2f')} {_fmt(result.get('inductor_ms'), '11.2f')} "
                  f"{_fmt(result.get('peak_mb'), '11.0f')} {_fmt(result.get('inductor_peak_mb'), '11.0f')} "
                  f"{_fmt(result.get('inductor_err_fp32'), '12.2e')}")
    failed = sum(any(e["problems"] for e in every) for _, every in rows)
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(rows) - failed} of {len(rows)} cases passed on every rank")


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The verdict is printed and the process group destroyed: leave without the interpreter's teardown. Once, under
    # CI's load (torch 2.13, CPU, 2026-11-28), a native thread still running there aborted rank 0 after every case had
    # passed ("terminate called without an active exception", exit code -6).
    os._exit(status)
