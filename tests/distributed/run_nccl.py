"""FSDP2 + the moeblaze backend on 2 or more GPUs over NCCL, against a single-GPU run, in bf16.

    PYTHONPATH=. torchrun --nproc-per-node 2 tests/distributed/run_nccl.py
    PYTHONPATH=. torchrun --nproc-per-node 2 tests/distributed/run_nccl.py --backend gloo --device cpu --no-inductor

The second line checks the script's logic without a GPU (the operator's PyTorch path, small sizes). On CUDA the
operator runs its Triton kernels. Each case trains TinyMoETransformer on every rank's slice of one global batch and
compares the global losses of every step and every parameter after the last step with

* a single-GPU eager run of the same model on the whole batch (bf16 parameters), or
* for ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` over float32 master weights, FSDP2
  without compile under the same policy, on the same ranks.

Every rank's ``torch._dynamo.utils.counters["moeblaze"]`` must be ``{"rewritten": 1}`` (the two blocks share one
compiled graph) and the profiler must see the operator run in every block. Rank 0 prints a PASS/FAIL table; every
rank exits with 1 if any case failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fsdp2_cases beside this file
from fsdp2_cases import Case, Size, canonical, rel_err, train_fsdp2, train_reference  # noqa: E402

# bf16 keeps 8 bits of mantissa (unit roundoff 2^-9 ~ 2e-3): the compiled and the eager step differ by rounding
# in every product, and AdamW turns small gradient differences into whole learning-rate steps on the elements
# whose gradient is near 0 (hence its small learning rate below). The defaults allow a few roundoffs; measured with
# --device cpu (2026-11-27, bf16 parameters, inductor=False, default CPU sizes): losses 3e-4 to 9e-4 apart,
# parameters 1.7e-3 (AdamW, lr 1e-3; 1.8e-2 at lr 1e-2) and 9.5e-3 (SGD). --tol-loss / --tol-param change them.
DEFAULT_TOL_LOSS = 1e-2
DEFAULT_TOL_PARAM = 3e-2


def cases(dtype: str, inductor: bool) -> list[tuple[Case, str]]:
    """(case, name of the case it is compared with; "reference" for the single-device eager run)."""
    # SGD under the policy: AdamW turns 16-bit rounding in near-zero gradients into whole learning-rate steps
    mixed = [Case("blocks-mixed-bf16-sgd", mixed="bfloat16", dtype="float32", optimizer="sgd", inductor=inductor),
             Case("uncompiled-mixed-bf16-sgd", compile="none", mixed="bfloat16", dtype="float32", optimizer="sgd",
                  inductor=inductor)]
    return [
        (Case("blocks-reshard-adamw", dtype=dtype, lr=1e-3, inductor=inductor), "reference"),
        (Case("blocks-keep-unsharded-checkpointed-sgd", reshard_after_forward=False, checkpoint=True,
              optimizer="sgd", dtype=dtype, inductor=inductor), "reference"),
        (Case("model-after-shard-adamw", compile="model", dtype=dtype, lr=1e-3, inductor=inductor), "reference"),
        (mixed[0], mixed[1].name),
        (mixed[1], "-"),  # the baseline of the case above, itself checked only for no rewrite
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", help="process group backend (nccl, or gloo with --device cpu)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", help="parameter dtype of the non-mixed cases")
    parser.add_argument("--no-inductor", action="store_true", help="the backend's inductor=False (faster on CPU)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps, at least 2")
    parser.add_argument("--tol-loss", type=float, default=DEFAULT_TOL_LOSS)
    parser.add_argument("--tol-param", type=float, default=DEFAULT_TOL_PARAM)
    parser.add_argument("--timeout-s", type=float, default=600, help="collective timeout")
    for field in dataclasses.fields(Size):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None,
                            help=f"model/batch size (default {field.default} on cpu, larger on cuda)")
    args = parser.parse_args()

    if args.steps < 2:
        parser.error("--steps must be at least 2: the operator calls are counted in a step after the compile")
    if "RANK" not in os.environ:
        parser.error("run under torchrun: torchrun --nproc-per-node 2 tests/distributed/run_nccl.py")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device: use --backend gloo --device cpu to check the script on the CPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # T = 4 * 512 = 2048 tokens per rank, enough rows per expert for the Triton kernels' tiles
        size = Size(vocab=512, d=256, h=512, layers=2, heads=4, experts=8, top_k=2, batch_per_rank=4, seq=512)
    else:
        device = torch.device("cpu")
        size = Size()
    size = dataclasses.replace(size, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Size)
                                        if getattr(args, f.name) is not None})
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        failed = run(args, size, device, rank, world)
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


def run(args, size: Size, device: torch.device, rank: int, world: int) -> bool:
    plan = cases(args.dtype, not args.no_inductor)
    plan = [(dataclasses.replace(case, steps=args.steps), against) for case, against in plan]
    results, rows = {}, []
    for case, _ in plan:
        results[case.name] = train_fsdp2(case, size, device)
    for case, against in plan:
        got = results[case.name]
        every = [None] * world
        dist.all_gather_object(every, {"counters": got["counters"], "op_calls": got["op_calls"]})
        compiled = case.compile != "none"
        want_counters = {"rewritten": 1} if compiled else {}
        forwards = size.layers * (2 if case.checkpoint else 1)  # checkpointing runs each block again in backward
        # the kernels (CUDA, 16-bit and float32) and the CPU path run the split backward: three operators a block
        # (ops.py); float64 on CUDA takes neither, and one operator
        split = device.type == "cpu" or (case.mixed or case.dtype) != "float64"
        backward = ({f"moeblaze::moe_ffn_backward_{half}": size.layers for half in ("act", "dx", "dw")}
                    if split else {"moeblaze::moe_ffn_backward": size.layers})
        want_calls = {"moeblaze::moe_ffn": forwards, **backward} if compiled else {}
        problems = [f"rank {r}: counters {e['counters']}, expected {want_counters}"
                    for r, e in enumerate(every) if e["counters"] != want_counters]
        problems += [f"rank {r}: operator calls {e['op_calls']}, expected {want_calls}"
                     for r, e in enumerate(every) if e["op_calls"] != want_calls]
        loss_err = param_err = float("nan")
        if against != "-":
            want = (train_reference(case, size, world, device) if against == "reference"
                    else results[against])
            loss_err = rel_err(got["losses"], want["losses"])
            param_err = max(rel_err(p, want["params"][canonical(n) if against == "reference" else n])
                            for n, p in got["params"].items())
            if not loss_err <= args.tol_loss:
                problems.append(f"losses {got['losses'].tolist()} against {want['losses'].tolist()}")
            if not param_err <= args.tol_param:
                problems.append(f"parameters after {case.steps} steps: max relative error {param_err:.3g}")
        rows.append((case.name, against, every[rank]["counters"], loss_err, param_err, problems))
    if rank == 0:
        print_table(rows, args, size, device, world)
    failed = torch.tensor([any(row[-1] for row in rows)], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # every rank exits with the same status
    return bool(failed.item())


def print_table(rows, args, size: Size, device: torch.device, world: int) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nFSDP2 + moeblaze: {world} ranks ({args.backend}, {name}), torch {torch.__version__}, {args.steps} steps, "
          f"inductor={not args.no_inductor}, tol loss {args.tol_loss:g} / params {args.tol_param:g}\n"
          f"size {dataclasses.asdict(size)}")
    header = f"{'case':42} {'compared with':26} {'rank 0 counters':18} {'loss err':>9} {'param err':>9}  result"
    print(header)
    print("-" * len(header))
    for case, against, counters, loss_err, param_err, problems in rows:
        print(f"{case:42} {against:26} {str(counters):18} {loss_err:9.2e} {param_err:9.2e}  "
              f"{'FAIL' if problems else 'PASS'}")
        for problem in problems:
            print(f"    {problem}")
    failed = sum(bool(r[-1]) for r in rows)
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(rows) - failed} of {len(rows)} cases passed")


if __name__ == "__main__":
    sys.exit(main())
