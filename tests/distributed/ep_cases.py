"""A torchtitan-style expert-parallel MoE block and its single-process reference, shared by the CPU test
(``test_expert_parallel.py``, 2 spawned gloo ranks) and the GPU script (``run_nccl_ep.py``, torchrun over NCCL).

The block (:class:`ExpertParallelMoE`): the router's top-k; the counts all-to-all; the token all-to-all over
``.tolist()`` splits; the rank-major rows permuted expert-major by indices computed from the counts
(``searchsorted``); ``torch._grouped_mm`` over the local experts with ``offs = cumsum`` of their counts and
torchtitan's bf16 casts (or torchtitan's per-expert loop over ``.tolist()`` split sizes); the un-permute
(``new_empty`` + index assignment); the all-to-all back; the un-sort and the combine. (torchtitan:
distributed/expert_parallel.py, models/common/moe/{moe,utils}.py, read late 2026; rewritten here, no padding.)
Rank r holds experts ``[r * E / world, (r + 1) * E / world)``.

:func:`reference` is the same function with every expert on one process and no collective. A weight's gradient sums
over every rank's tokens: :func:`errors_against_reference` sums the reference's over the ranks before comparing.

Nothing here imports pytest: spawned ranks and torchrun's processes import this module alone.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["EPSize", "make_weights", "make_tokens", "route", "expert", "reference", "permute_indices",
           "ExpertParallelMoE", "rel_err", "block_results", "reference_results", "errors",
           "errors_against_reference", "GRADIENTS"]

# the gradients compared, besides the tokens': the router's (replicated) and every local expert weight's
GRADIENTS = ("router", "w1", "w3", "w2")


@dataclasses.dataclass(frozen=True)
class EPSize:
    experts: int = 4
    top_k: int = 2
    d: int = 16
    h: int = 24
    tokens: int = 11  # per rank


def make_weights(size: EPSize, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every expert's weights and the router, float32 on the CPU, the same on every rank (one seed)."""
    E, D, H = size.experts, size.d, size.h
    gen = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, D, generator=gen) / D ** 0.5,
        "w1": torch.randn(E, H, D, generator=gen) / D ** 0.5,
        "w3": torch.randn(E, H, D, generator=gen) / D ** 0.5,
        "w2": torch.randn(E, D, H, generator=gen) / H ** 0.5,
    }


def make_tokens(size: EPSize, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens ``[tokens, d]``, float32 on the CPU."""
    return torch.randn(size.tokens, size.d, generator=torch.Generator().manual_seed(100 + rank))


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, router_dtype: Optional[torch.dtype] = None):
    """Softmax, top-k, renormalized: (combine weights [T, K] in x's dtype, ids [T, K]). ``router_dtype``: the dtype
    the scores are computed in (None: x's). In float32 a bf16 block's compiled and eager runs pick the same experts:
    bf16 scores tie often enough that a one-unit difference between Inductor's softmax and eager's moves tokens."""
    if router_dtype is None:
        scores = F.linear(x, router).softmax(-1)
    else:
        scores = F.linear(x.to(router_dtype), router.to(router_dtype)).softmax(-1)
    w, ids = scores.topk(top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return (w if router_dtype is None else w.to(x.dtype)), ids


def expert(rows, w1, w3, w2, compute):
    """One expert, its products in ``compute`` (torchtitan casts tokens and weights to bf16 for grouped products)."""
    c = lambda t: t.to(compute)  # noqa: E731
    return F.linear(F.silu(F.linear(c(rows), c(w1))) * F.linear(c(rows), c(w3)), c(w2)).to(rows.dtype)


def reference(x, weights, top_k: int, compute=None, router_dtype=None):
    """Every expert on one process: the same function without collectives, each expert's products in ``compute``
    (None: x's dtype)."""
    w, ids = route(x, weights["router"], top_k, router_dtype)
    out = torch.zeros_like(x)
    for e in range(weights["w1"].shape[0]):
        tok, slot = torch.where(ids == e)
        y = expert(x[tok], weights["w1"][e], weights["w3"][e], weights["w2"][e], compute or x.dtype)
        out = out.index_add(0, tok, y * w[tok, slot, None])
    return out


def permute_indices(counts, experts: int, ranks: int, rows: int):
    """Rank-major received rows (``counts`` [ranks * experts]) to expert-major: the row each position reads, and the
    per-expert counts (torchtitan's _generate_permute_indices, without host sync)."""
    group_start = counts.cumsum(0) - counts
    by_rank = counts.view(ranks, experts)
    lengths = by_rank.t().reshape(-1)
    starts = group_start.view(ranks, experts).t().reshape(-1)
    out_ends = lengths.cumsum(0)
    position = torch.arange(rows, device=counts.device)
    shift = starts - (out_ends - lengths)
    return position + shift[torch.searchsorted(out_ends, position, right=True)], by_rank.sum(0)


class ExpertParallelMoE(torch.nn.Module):
    """torchtitan's expert-parallel MoE, reduced: this rank holds experts [rank*E/world, (rank+1)*E/world) of
    ``weights`` (:func:`make_weights`, any dtype and device). ``experts``: "grouped_mm" (torchtitan's default, bf16
    products) or "loop" (its per-expert loop over split sizes from ``.tolist()``, in the weights' dtype);
    ``collectives``: how the counts all-to-all is spelled, "functional" or "c10d" (``dist.all_to_all_single`` in
    place); ``router_dtype``: see :func:`route`."""

    def __init__(self, weights, rank: int, world: int, collectives: str, experts: str, top_k: int,
                 router_dtype: Optional[torch.dtype] = None):
        super().__init__()
        E = weights["w1"].shape[0]
        if E % world:
            raise ValueError(f"{E} experts do not split evenly over {world} ranks; use a multiple of {world}")
        if collectives not in ("functional", "c10d") or experts not in ("grouped_mm", "loop"):
            raise ValueError(f"collectives={collectives!r}, experts={experts!r}: use 'functional' or 'c10d', and "
                             f"'grouped_mm' or 'loop'")
        local = slice(rank * E // world, (rank + 1) * E // world)
        self.router = torch.nn.Parameter(weights["router"].clone())
        self.w1 = torch.nn.Parameter(weights["w1"][local].clone())
        self.w3 = torch.nn.Parameter(weights["w3"][local].clone())
        self.w2 = torch.nn.Parameter(weights["w2"][local].clone())
        self.num_experts, self.world, self.top_k, self.router_dtype = E, world, top_k, router_dtype
        self.collectives, self.experts = collectives, experts

    def _all_to_all(self, t, out_splits, in_splits):
        # torch.distributed.nn.functional.all_to_all_single (the autograd c10d one) raises under torch.compile
        # (torch 2.13 names the functional one instead): the tokens go through the functional collective always
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(t, out_splits, in_splits, dist.group.WORLD)

    def _grouped_mm(self, rows, per_expert):
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(rows.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(rows)

    def _loop(self, rows, per_expert):
        outs = [expert(part, self.w1[e], self.w3[e], self.w2[e], rows.dtype)
                for e, part in enumerate(torch.split(rows, per_expert.tolist()))]
        return torch.cat(outs)

    def forward(self, x):
        E, K, ep = self.num_experts, self.top_k, self.world
        local = E // ep
        w, ids = route(x, self.router, K, self.router_dtype)
        flat = ids.view(-1)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        routed = x[order // K]
        with torch.no_grad():  # the counts all-to-all: how many rows each rank sends this rank, per local expert
            if self.collectives == "functional":
                from torch.distributed._functional_collectives import all_to_all_single
                counts_recv = all_to_all_single(counts, None, None, dist.group.WORLD)
                counts_recv = torch.ops._c10d_functional.wait_tensor(counts_recv)
            else:
                counts_recv = torch.empty_like(counts)
                dist.all_to_all_single(counts_recv, counts)
            send = counts.view(ep, local).sum(1).tolist()
            recv = counts_recv.view(ep, local).sum(1).tolist()
        received = self._all_to_all(routed, recv, send)  # the token all-to-all
        with torch.no_grad():
            permute, per_expert = permute_indices(counts_recv, local, ep, received.shape[0])
        experts = self._grouped_mm if self.experts == "grouped_mm" else self._loop
        y = experts(received[permute, :], per_expert)
        unpermuted = y.new_empty(received.shape)
        unpermuted[permute, :] = y
        # the all-to-all back, then un-sort and combine over the K choices
        back = self._all_to_all(unpermuted, send, recv)
        unsorted = torch.empty_like(back).index_copy(0, order, back)
        return (unsorted.view(-1, K, x.shape[-1]) * w.unsqueeze(-1)).sum(1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def block_results(model: ExpertParallelMoE, out: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's output, token gradient and weight gradients (after backward), float32 copies. Collective: the
    router's gradient (replicated, each rank's from its own tokens) is summed over the ranks."""
    got = {"out": out.detach().float(), "x": x.grad.detach().float()}
    for name in GRADIENTS:
        g = getattr(model, name).grad.detach().float().clone()
        if name == "router":
            dist.all_reduce(g)
        got[name] = g
    return got


def reference_results(want: torch.Tensor, x_ref: torch.Tensor, ref_weights: dict) -> dict[str, torch.Tensor]:
    """The same quantities from :func:`reference` (``want`` on ``x_ref``, this rank's tokens, after the same
    backward), float32 copies. Collective: a weight's gradient sums over every rank's tokens, so the reference's are
    summed over the ranks; an expert weight's is then cut to this rank's experts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E = ref_weights["w1"].shape[0]
    local = slice(rank * E // world, (rank + 1) * E // world)
    got = {"out": want.detach().float(), "x": x_ref.grad.detach().float()}
    for name in GRADIENTS:
        g = ref_weights[name].grad.detach().float().clone()
        dist.all_reduce(g)
        got[name] = g if name == "router" else g[local]
    return got


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative error of each quantity of ``got`` against ``want``'s."""
    return {k: rel_err(got[k], want[k]) for k in got}


def errors_against_reference(model: ExpertParallelMoE, out, x, want, x_ref, ref_weights) -> dict[str, float]:
    """:func:`block_results` against :func:`reference_results` (collective: every rank calls it, in the same
    order)."""
    return errors(block_results(model, out, x), reference_results(want, x_ref, ref_weights))
