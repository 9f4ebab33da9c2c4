"""Dispatch-metadata benchmark: the Triton dispatch against the two usual PyTorch spellings.

Peers (same process, same inputs, same timer):

* ``hf``: Hugging Face's metadata: ``torch.sort`` of the flattened ids, ``torch.histc`` counts, ``cumsum``
  offsets and the inverse permutation by a scatter (cheaper than HF's ``argsort`` of the order, so the
  stronger peer).
* ``argsort``: ``torch.argsort(stable=True)`` + ``torch.bincount`` + ``cumsum`` + scatter inverse.

Times are medians from ``triton.testing.do_bench`` (device events, warm-up first, the L2 cache flushed
before every run, so the inputs never sit in cache). ``moeblaze_graph_ms`` and ``hf_graph_ms`` replay
the same calls from a CUDA graph (``do_bench_cudagraph``: no launch overhead, L2 not flushed); the
argsort peer cannot be captured (``bincount`` synchronises with the host). ``floor_us`` is the
memory floor: ids read once and ``token_index`` + ``slot_of`` written once at the HBM copy rate.
"""
from __future__ import annotations

import torch
from triton.testing import do_bench, do_bench_cudagraph

from ..kernels.dispatch import DispatchConfig, default_config, dispatch, dispatch_forward

__all__ = [
    "hf_metadata",
    "argsort_bincount_metadata",
    "run_dispatch_bench",
    "profile_dispatch",
    "format_dispatch_table",
    "format_variant_table",
]

# Measured device-to-device copy rates (read + write), docs/benchmarks.md "Ceilings" (H100 and H200, 2026-11).
_HBM_TB_S = {"H100": 3.0, "H200": 4.3}


def hf_metadata(ids: torch.Tensor, num_experts: int):
    flat = ids.reshape(-1)
    _, order = torch.sort(flat)
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts.to(torch.int32), 0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=ids.device)
    return offsets, order, inverse


def argsort_bincount_metadata(ids: torch.Tensor, num_experts: int):
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0)
    inverse = torch.empty_like(order)
    inverse.scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    return offsets, order, inverse


def _router_ids(T: int, K: int, E: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """Top-K distinct experts per token from random scores, as a router produces them."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.empty(T, K, dtype=torch.int64, device=device)
    step = 1 << 16  # bounded temporary: [step, E] scores at a time
    for t0 in range(0, T, step):
        scores = torch.rand(min(step, T - t0), E, generator=g, device=device)
        ids[t0 : t0 + step] = scores.topk(K, dim=1).indices
    return ids.to(dtype)


def _hbm_tb_s(device) -> float:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _HBM_TB_S.items() if k in name), 3.0)


def run_dispatch_bench(
    Ts=(16384, 131072, 1048576),
    Ks=(2, 8),
    Es=(8, 64, 256),
    *,
    id_dtype: torch.dtype = torch.int64,
    block_m: int = 64,
    configs: dict[str, DispatchConfig] | None = None,
    peers: bool = True,
    cuda_graph: bool = True,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    device: str = "cuda",
    seed: int = 0,
) -> list[dict]:
    """One dict per (T, K, E): times in ms (medians), the floor in us and the speed-up over the faster peer.

    ``configs`` times extra pinned configurations of the Triton dispatch (``variant_ms[name]``); a
    configuration that fails to compile or run is recorded as an error string, not raised.
    """
    rows = []
    for T in Ts:
        for K in Ks:
            for E in Es:
                if K > E:
                    continue
                ids = _router_ids(T, K, E, id_dtype, device, seed)
                N = T * K
                floor_bytes = N * ids.element_size() + 2 * N * 4
                row = {
                    "T": T, "K": K, "E": E, "ids_dtype": str(id_dtype).replace("torch.", ""),
                    "config": default_config(N, E)._asdict(),
                    "floor_us": floor_bytes / (_hbm_tb_s(device) * 1e12) * 1e6,
                }  # fmt: skip
                row["moeblaze_ms"] = do_bench(lambda: dispatch(ids, E, block_m), warmup_ms, rep_ms, return_mode="median")
                if cuda_graph:
                    row["moeblaze_graph_ms"] = do_bench_cudagraph(lambda: dispatch(ids, E, block_m), return_mode="median")
                if peers:
                    row["hf_ms"] = do_bench(lambda: hf_metadata(ids, E), warmup_ms, rep_ms, return_mode="median")
                    if cuda_graph:  # sort + histc(min, max given) + cumsum + scatter capture; bincount syncs
                        row["hf_graph_ms"] = do_bench_cudagraph(lambda: hf_metadata(ids, E), return_mode="median")
                    row["argsort_ms"] = do_bench(
                        lambda: argsort_bincount_metadata(ids, E), warmup_ms, rep_ms, return_mode="median"
                    )
                    best_peer = min(row["hf_ms"], row["argsort_ms"])
                    row["speedup"] = best_peer / row["moeblaze_ms"]
                if configs:
                    row["variant_ms"] = {}
                    for name, cfg in configs.items():
                        try:
                            fn = lambda: dispatch_forward(ids, E, block_m, cfg)  # noqa: E731
                            row["variant_ms"][name] = do_bench(fn, warmup_ms, rep_ms, return_mode="median")
                        except Exception as exc:  # record and go on: one bad variant must not end the sweep
                            row["variant_ms"][name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                del ids
    return rows


def profile_dispatch(ids: torch.Tensor, num_experts: int, config: DispatchConfig | None = None, iters: int = 20) -> dict:
    """Device time per launch (us, mean over ``iters`` calls, from the profiler) and the host time of
    one call (us, ``iters * 10`` calls back to back, no synchronisation inside)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    fn = (lambda: dispatch(ids, num_experts)) if config is None else (lambda: dispatch_forward(ids, num_experts, 64, config))
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.count:
            kernels[evt.key] = getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) / iters
    t0 = time.perf_counter()
    for _ in range(iters * 10):
        fn()
    host_us = (time.perf_counter() - t0) / (iters * 10) * 1e6
    torch.cuda.synchronize()
    return {"kernels_us": kernels, "host_us_per_call": host_us}


def format_dispatch_table(rows: list[dict]) -> str:
    """Markdown table of ``run_dispatch_bench`` rows (times in ms, floor in us)."""
    has_graph = any("moeblaze_graph_ms" in r for r in rows)
    has_peers = any("hf_ms" in r for r in rows)
    head = ["T", "K", "E", "config", "floor us", "moeblaze ms"]
    head += ["moeblaze graph ms"] if has_graph else []
    has_hf_graph = any("hf_graph_ms" in r for r in rows)
    head += ["HF sort+histc ms", "argsort+bincount ms", "speed-up vs faster peer"] if has_peers else []
    head += ["HF graph ms", "graph speed-up vs HF graph"] if has_hf_graph else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["config"]
        cells = [str(r["T"]), str(r["K"]), str(r["E"]), f"{c['path']} {c['chunk']}/{c['block']}/{c['num_warps']}w"]
        cells += [f"{r['floor_us']:.1f}", f"{r['moeblaze_ms']:.4f}"]
        cells += [f"{r['moeblaze_graph_ms']:.4f}"] if has_graph else []
        if has_peers:
            cells += [f"{r['hf_ms']:.4f}", f"{r['argsort_ms']:.4f}", f"{r['speedup']:.2f}x"]
        if has_hf_graph:
            cells += [f"{r['hf_graph_ms']:.4f}", f"{r['hf_graph_ms'] / r['moeblaze_graph_ms']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_variant_table(rows: list[dict]) -> str:
    """Markdown table of the pinned-configuration sweep (ms), one column per configuration."""
    names = sorted({n for r in rows for n in r.get("variant_ms", {})})
    if not names:
        return ""
    lines = ["| T | K | E | default ms | " + " | ".join(names) + " |", "|" + "---|" * (4 + len(names))]
    for r in rows:
        v = r.get("variant_ms", {})
        cells = [
            f"{v[n]:.4f}" if isinstance(v.get(n), float) else ("err" if n in v else "-") for n in names
        ]
        lines.append(f"| {r['T']} | {r['K']} | {r['E']} | {r['moeblaze_ms']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

