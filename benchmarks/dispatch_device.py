"""The lock-free Triton dispatch (token index, offsets, inverse permutation) on a GPU: correctness on the device,
then its speed against the two PyTorch spellings of the same metadata (benchmarks/RESULTS.md, "Dispatch").

    python benchmarks/dispatch_device.py OUT_DIR [--commit SHA] [--sweep]

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots).

Checks (each printed as PASS/FAIL; the run goes on to the benchmark either way and exits 1 on any FAIL):
bitwise equality with dispatch_reference at several sizes (int32 and int64 ids, about 1 in 8 ids a
sentinel), run-to-run bitwise equality, CUDA-graph capture and replay on new ids, no host
synchronisation (torch.cuda.set_sync_debug_mode("error")) and the peak memory of T = 1M, K = 8, E = 256.
Then ``run_dispatch_bench`` at T in {16384, 131072, 1048576}, K in {2, 8}, E in {8, 64, 256}; with
``--sweep`` also a sweep of pinned configurations at a few points. Writes OUT_DIR/dispatch_bench.json
and OUT_DIR/dispatch_bench.md and prints the table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import triton

from moeblaze_fx.bench.dispatch import (
    _router_ids,
    format_dispatch_table,
    format_variant_table,
    profile_dispatch,
    run_dispatch_bench,
)
from moeblaze_fx.kernels.dispatch import DispatchConfig, default_config, dispatch
from moeblaze_fx.kernels.reference import dispatch_reference, max_tiles

FAILS: list[str] = []


def check(name, fn):
    t0 = time.perf_counter()
    try:
        fn()
        print(f"PASS {name} ({time.perf_counter() - t0:.1f}s)")
    except Exception:
        FAILS.append(name)
        print(f"FAIL {name}\n{traceback.format_exc()}")


def make_ids(T, K, E, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g, device="cuda")
    sentinels = torch.tensor([E, E + 1, E + 1000, -1], device="cuda")
    pick = torch.randint(0, 4, (T, K), generator=g, device="cuda")
    ids = torch.where(torch.rand(T, K, generator=g, device="cuda") < 0.125, sentinels[pick], ids)
    return ids.to(dtype)


def assert_equal(got, ref):
    for name, a, b in zip(ref._fields, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:5].flatten()
            raise AssertionError(f"{name} differs at {bad.tolist()}: {a[bad].tolist()} vs {b[bad].tolist()}")


def correctness(results: dict):
    sizes = [(1, 1, 1), (7, 2, 4), (4097, 8, 64), (65536, 2, 8), (65536, 8, 256), (131072, 8, 64),
             (262144, 2, 16), (1 << 20, 2, 8), (1 << 20, 8, 256)]  # fmt: skip
    for T, K, E in sizes:
        for dtype in (torch.int32, torch.int64):
            ids = make_ids(T, K, E, dtype, seed=T + K + E)
            check(f"bitwise T={T} K={K} E={E} {dtype}", lambda: assert_equal(dispatch(ids, E), dispatch_reference(ids, E)))
    for bm in (16, 128):
        ids = make_ids(100000, 8, 64, torch.int64, seed=3)
        check(f"bitwise block_m={bm}", lambda: assert_equal(dispatch(ids, 64, bm), dispatch_reference(ids, 64, bm)))

    def run_to_run(T, K, E):
        ids = make_ids(T, K, E, torch.int64, seed=5)
        first = dispatch(ids, E)
        for _ in range(3):
            for a, b in zip(first, dispatch(ids, E)):
                assert torch.equal(a, b)

    for T, K, E in [(1 << 20, 8, 256), (1 << 20, 2, 8), (131072, 8, 64)]:
        check(f"run-to-run T={T} K={K} E={E}", lambda: run_to_run(T, K, E))

    def graph_capture(T, K, E):
        static_ids = make_ids(T, K, E, torch.int64, seed=7)
        dispatch(static_ids, E)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            plan = dispatch(static_ids, E)
        for seed in (8, 9):
            new = make_ids(T, K, E, torch.int64, seed=seed)
            static_ids.copy_(new)
            g.replay()
            torch.cuda.synchronize()
            assert_equal(plan, dispatch_reference(new, E))

    for T, K, E in [(131072, 8, 256), (131072, 2, 8)]:
        check(f"cuda-graph T={T} K={K} E={E}", lambda: graph_capture(T, K, E))

    def no_sync():
        ids = make_ids(65536, 8, 64, torch.int64, seed=2)
        dispatch(ids, 64)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dispatch(ids, 64)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    check("no host sync", no_sync)

    def peak_memory():
        T, K, E = 1 << 20, 8, 256
        ids = make_ids(T, K, E, torch.int64, seed=12)
        dispatch(ids, E)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        plan = dispatch(ids, E)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        N = T * K
        outputs = 4 * (2 * N + E + 1 + 2 * max_tiles(N, E, 64))
        results["peak_memory_1M_8_256"] = {"peak_bytes": peak, "output_bytes": outputs, "T_x_E_int32_bytes": 4 * T * E}
        print(f"  peak {peak / 2**20:.1f} MiB, outputs {outputs / 2**20:.1f} MiB, a T x E int32 map {4 * T * E / 2**20:.0f} MiB")
        assert peak <= outputs + 4 * (N // 512 + 1) * E + (2 << 20)
        del plan

    check("peak memory T=1M K=8 E=256", peak_memory)


SWEEP_POINTS = [(131072, 8, 8), (1 << 20, 8, 64)]
PROFILE_POINTS = [(16384, 8, 256), (131072, 8, 8), (1 << 20, 8, 8), (1 << 20, 8, 256)]


def sweep_configs(T, K, E):
    """Pinned variants around the default: sorted blocks of 256 and 512, and the dense path for small E."""
    c = default_config(T * K, E).chunk
    variants = [("sort", c, 256, 4), ("sort", c, 512, 4)]
    if triton.next_power_of_2(E + 1) <= 16:
        variants += [("dense", c, 128, 4)]
    return {f"{p}{ch}/{b}/{w}": DispatchConfig(p, ch, b, w) for p, ch, b, w in variants if b <= ch}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "commit": args.commit,
        "command": "python benchmarks/dispatch_device.py OUT_DIR" + (" --sweep" if args.sweep else ""),
    }  # fmt: skip
    print(json.dumps(meta))
    results: dict = {"meta": meta}
    if not args.skip_checks:
        t0 = time.perf_counter()
        correctness(results)
        print(f"checks: {len(FAILS)} failed ({time.perf_counter() - t0:.0f}s)")
    results["failed_checks"] = FAILS

    if args.sweep:
        t0 = time.perf_counter()
        sweep_rows = []
        for T, K, E in SWEEP_POINTS:
            sweep_rows += run_dispatch_bench((T,), (K,), (E,), configs=sweep_configs(T, K, E), peers=False, cuda_graph=False, rep_ms=50)
        results["sweep"] = sweep_rows
        for r in sweep_rows:
            print(f"T={r['T']} K={r['K']} E={r['E']} default {r['moeblaze_ms']:.4f} " + " ".join(
                f"{n}={v:.4f}" if isinstance(v, float) else f"{n}={v}" for n, v in r["variant_ms"].items()))
        print(f"sweep {time.perf_counter() - t0:.0f}s")
        profiles = {}
        for T, K, E in PROFILE_POINTS:
            prof = profile_dispatch(_router_ids(T, K, E, torch.int64, "cuda", 0), E)
            profiles[f"{T}x{K}xE{E}"] = prof
            print(f"profile T={T} K={K} E={E}: host {prof['host_us_per_call']:.1f} us/call; "
                  + ", ".join(f"{k[:40]} {v:.1f}us" for k, v in prof["kernels_us"].items()))
        results["profiles"] = profiles

    t0 = time.perf_counter()
    rows = run_dispatch_bench()
    results["bench"] = rows
    print(f"bench {time.perf_counter() - t0:.0f}s")
    table = format_dispatch_table(rows)
    with open(os.path.join(args.out_dir, "dispatch_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out_dir, "dispatch_bench.md"), "w") as f:
        f.write(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, commit {meta['commit']}\n\n")
        f.write(table + "\n")
        if args.sweep:
            f.write("\n" + format_variant_table(results["sweep"]) + "\n")
    worst = min(r["speedup"] for r in rows)
    print(f"\nfailed checks: {FAILS or 'none'}; min speed-up vs faster peer {worst:.2f}x")
    print(table)
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
