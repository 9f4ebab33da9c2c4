"""FSDP2 training cases shared by the CPU test (``test_fsdp2.py``, gloo ranks) and the GPU script (``run_nccl.py``).

A case is one way a user combines the backend with ``torch.distributed.fsdp.fully_shard``:

* ``compile="blocks"``: torchtitan's order. Activation checkpointing (optional) wraps each block, then
  ``block.compile(backend="moeblaze", fullgraph=True)``, then ``fully_shard(block)`` for every block and
  ``fully_shard(model)`` last.
* ``compile="model"``: ``fully_shard`` every block and the model first, then ``torch.compile(model, backend=...)``.
* ``compile="none"``: FSDP2 alone (the baseline a mixed-precision case is compared with).

Every rank trains on its own slice of one global batch and records the global loss of each step, the full
(unsharded) parameters after the last step and ``torch._dynamo.utils.counters["moeblaze"]``. The single-process
reference (:func:`train_reference`) trains the same model on the whole batch: with FSDP2's gradient averaging and
equal token counts per rank, the two agree up to rounding.

Nothing here imports pytest: spawned ranks import this module alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["Case", "build_model", "batches", "shard_and_compile", "train_fsdp2", "train_reference", "rank_main",
           "rel_err"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    compile: str = "blocks"  # "blocks" (each block before fully_shard), "model" (after fully_shard) or "none"
    reshard_after_forward: bool = True
    mixed: Optional[str] = None  # None, "bfloat16" or "float16": MixedPrecisionPolicy(param_dtype=..., reduce fp32)
    checkpoint: bool = False  # torch.utils.checkpoint around each block (checkpoint_wrapper)
    optimizer: str = "adamw"  # "adamw" or "sgd"
    lr: Optional[float] = None  # None: 1e-2 for AdamW, 5e-2 for SGD
    # compile="model": let Dynamo capture ops with data-dependent output shapes (see capture_config)
    capture_dynamic_output_shapes: bool = True
    inductor: bool = False  # the backend's "inductor" option; False runs the rewritten graph without Inductor
    dtype: str = "float64"  # the parameters' dtype (the master weights under a mixed-precision policy)
    steps: int = 3
    raise_on_rank: Optional[int] = None  # a failure injected on one rank: the harness's own test


@dataclasses.dataclass(frozen=True)
class Size:
    vocab: int = 64
    d: int = 32
    h: int = 32
    layers: int = 2
    heads: int = 2
    experts: int = 4
    top_k: int = 2
    batch_per_rank: int = 2
    seq: int = 8


def build_model(size: Size, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The same TinyMoETransformer on every rank and in the reference: the seed decides every parameter."""
    from moeblaze_fx.models import TinyMoETransformer

    torch.manual_seed(seed)
    model = TinyMoETransformer(vocab=size.vocab, d=size.d, h=size.h, layers=size.layers, heads=size.heads,
                               num_experts=size.experts, top_k=size.top_k)
    return model.to(device=device, dtype=dtype)


def batches(size: Size, world: int, steps: int, device: torch.device, seed: int = 1) -> list[torch.Tensor]:
    """One global batch of tokens per step, ``[world * batch_per_rank, seq + 1]``; rank r trains on rows
    ``r * batch_per_rank`` to ``(r + 1) * batch_per_rank``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size.vocab, (world * size.batch_per_rank, size.seq + 1), generator=g).to(device)
            for _ in range(steps)]


def _optimizer(case: Case, params) -> torch.optim.Optimizer:
    if case.optimizer == "adamw":
        # foreach=False: the per-parameter loop, the same arithmetic on a DTensor shard and on a whole tensor
        return torch.optim.AdamW(params, lr=case.lr or 1e-2, weight_decay=0.1, foreach=False)
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr or 5e-2, momentum=0.9, foreach=False)
    raise ValueError(f"unknown optimizer {case.optimizer!r}; use 'adamw' or 'sgd'")


def shard_and_compile(model: torch.nn.Module, case: Case, mesh=None) -> torch.nn.Module:
    """Apply ``case``'s recipe to ``model`` (a TinyMoETransformer); returns the module to call."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"inductor": case.inductor}
    kwargs: dict[str, Any] = {"reshard_after_forward": case.reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if case.mixed is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, case.mixed), reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        if case.checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block = checkpoint_wrapper(block)  # torch.utils.checkpoint, non-reentrant
        if case.compile == "blocks":
            block.compile(backend="moeblaze", fullgraph=True, options=options)
        fully_shard(block, **kwargs)
        model.blocks[i] = block
    fully_shard(model, **kwargs)
    if case.compile == "model":
        # FSDP2's hooks are torch._dynamo.disable'd: the model's graph breaks around each block's hooks, so no
        # fullgraph=True (Dynamo refuses it). See capture_config for the per-expert loop.
        return torch.compile(model, backend="moeblaze", options=options)
    if case.compile not in ("blocks", "none"):
        raise ValueError(f"unknown compile mode {case.compile!r}; use 'blocks', 'model' or 'none'")
    return model


def capture_config(case: Case):
    """The Dynamo settings a case trains under. Without fullgraph=True, Dynamo breaks the graph at a
    data-dependent output shape (the ``torch.where`` of TinyMoETransformer's per-expert loop) unless it may
    capture such ops, and a region split by graph breaks is never rewritten."""
    if case.compile == "model" and case.capture_dynamic_output_shapes:
        return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
    return contextlib.nullcontext()


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def train_fsdp2(case: Case, size: Size, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Run ``case`` on this rank (the process group is up); every rank returns the same global losses and full
    parameters, and its own moeblaze counters."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import moeblaze_fx

    rank, world = dist.get_rank(), dist.get_world_size()
    if case.steps < 2:
        raise ValueError(f"case {case.name!r}: steps={case.steps}; at least 2 (the operator calls are counted in the "
                         f"last step, after the first step's compile, whose proof runs the operator too)")
    if case.raise_on_rank == rank:
        raise RuntimeError(f"failure injected on rank {rank} by case {case.name!r}")
    torch._dynamo.reset()
    counters.clear()
    model = build_model(size, getattr(torch, case.dtype), device, seed)
    run = shard_and_compile(model, case, init_device_mesh(device.type, (world,)))
    opt = _optimizer(case, model.parameters())
    losses, op_calls = [], {}
    for step, tokens in enumerate(batches(size, world, case.steps, device)):
        mine = tokens[rank * size.batch_per_rank:(rank + 1) * size.batch_per_rank]
        # the last step under the profiler: how often each MoEBlaze operator ran (the counters say what was
        # compiled; this says that every block runs the operator, the blocks that share one compiled graph too).
        # Not the first step: the compile's proof runs the operator as well.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == case.steps - 1 \
                else contextlib.nullcontext() as prof:
            with capture_config(case):
                loss = _loss(run, mine)
            loss.backward()
        if prof is not None:
            for event in prof.events():
                if event.name.startswith("moeblaze::"):
                    op_calls[event.name] = op_calls.get(event.name, 0) + 1
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).cpu())
    params = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params, "counters": dict(counters["moeblaze"]),
            "op_calls": op_calls, "package": moeblaze_fx.__file__}


def train_reference(case: Case, size: Size, world: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """The single-process eager run: the same model on the whole global batch, no FSDP2, no compile."""
    model = build_model(size, getattr(torch, case.dtype), device, seed)
    opt = _optimizer(case, model.parameters())
    losses = []
    for tokens in batches(size, world, case.steps, device):
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return {"losses": torch.stack(losses), "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def canonical(name: str) -> str:
    """A parameter's name without the wrappers' parts (checkpoint_wrapper's ``_checkpoint_wrapped_module``,
    torch.compile's ``_orig_mod``): the reference model's name for it."""
    for part in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def rank_main(rank: int, world: int, init_file: str, cases: list[Case], size: Size, out_dir: str,
              timeout_s: float) -> None:
    """One gloo rank on the CPU: run every case, save ``rank{rank}.pt`` in ``out_dir`` (a dict case name -> result).
    An exception is saved beside it (``rank{rank}.err``) and raised again, so that the parent fails and stops the
    other ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        results = {}
        for case in cases:
            results[case.name] = train_fsdp2(case, size, torch.device("cpu"))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
