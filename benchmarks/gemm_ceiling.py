#!/usr/bin/env python3
"""What the vendor's GEMMs alone take for one layer step's nine GEMM units (18*N*d*h FLOPs), at configs A-D.

    python benchmarks/gemm_ceiling.py OUTDIR [--configs A,B,C,D]

Needs a CUDA GPU and the package: ``pip install <your CUDA build of torch 2.11-2.13>`` then ``pip install -e .``
from the repository root (``pip install -e ".[bench]"`` adds the optional peers and plots).

The layer benchmark's speed targets ask for the whole layer step (router, dispatch, gathers, SwiGLU, combine, forward and backward) to run a
given factor faster than the fastest peer. This measures, in the same process and on the same device, the GEMMs of a
step with none of the rest, on rows already gathered and sorted by expert:

* ``grouped``: ``torch._grouped_mm`` (the kernels the Hugging Face peer calls), forward X @ Wgu[e] and H @ Wd[e],
  backward through autograd (dX, dWgu, dH, dWd): the same six GEMMs the layer runs (9 units);
* ``dense``: cuBLAS ``torch.mm`` on the same operand shapes with no expert boundaries (one [N, d] x [d, 2h] GEMM and
  so on): an upper bound on what grouping could reach;
* ``dense8192``: the 8192^3 bf16 GEMM, the machine's ceiling as docs/benchmarks.md measures it.

Routing: softmax top-K of random logits (as the layer bench's router), so the groups are about N / E rows each.
Times: the layer bench's timer (``moeblaze_fx.bench.layer.time_steps``): CUDA events around each step, L2
flushed before each, median of ``REPS``. Writes OUTDIR/gemm_ceiling.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from moeblaze_fx.bench.layer import dense_gemm_rate, time_steps

CONFIGS = {"A": (32768, 2048, 8192, 16, 4), "B": (16384, 4096, 14336, 8, 2), "C": (16384, 2048, 768, 128, 8),
           "D": (16384, 2048, 1024, 64, 8)}
REPS, WARMUP = 20, 5
DEVICE = torch.device("cuda")


def timed(fn) -> float:
    """Median ms of ``fn`` over REPS, L2 flushed before each outside the events: the layer bench's timer."""
    return time_steps(lambda i: fn(), DEVICE, WARMUP, REPS)[0]


def config_rows(name):
    T, d, h, E, K = CONFIGS[name]
    N = T * K
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.softmax(torch.randn(T, E, device=dev, generator=g), -1).topk(K, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(N, d, device=dev, dtype=dt, generator=g)
    hid = torch.randn(N, h, device=dev, dtype=dt, generator=g)
    wgu = (torch.randn(E, d, 2 * h, device=dev, dtype=dt, generator=g) / d ** 0.5)
    wd = (torch.randn(E, h, d, device=dev, dtype=dt, generator=g) / h ** 0.5)
    gy = torch.randn(N, d, device=dev, dtype=dt, generator=g)
    gpre = torch.randn(N, 2 * h, device=dev, dtype=dt, generator=g)
    unit = 2 * N * d * h
    rows = []

    # grouped: forward and backward through autograd (leaves for x, hid and both weights)
    xl, hl = x.clone().requires_grad_(), hid.clone().requires_grad_()
    wgul = wgu.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # [E, d, 2h], column-major per expert
    wdl = wd.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()

    def grouped():
        pre = torch._grouped_mm(xl, wgul, offs=offs)
        y = torch._grouped_mm(hl, wdl, offs=offs)
        torch.autograd.backward((pre, y), (gpre, gy))

    def grouped_fwd():
        with torch.no_grad():
            torch._grouped_mm(x, wgul, offs=offs)
            torch._grouped_mm(hid, wdl, offs=offs)

    # dense: the same six GEMMs on the same shapes, no groups
    w1, w2 = wgu[0].clone(), wd[0].clone()  # [d, 2h], [h, d]

    def dense():
        torch.mm(x, w1)
        torch.mm(hid, w2)
        torch.mm(gpre, w1.t())
        torch.mm(x.t(), gpre)
        torch.mm(gy, w2.t())
        torch.mm(hid.t(), gy)

    for kind, fn, units in (("grouped", grouped, 9), ("grouped fwd", grouped_fwd, 3), ("dense", dense, 9)):
        try:
            ms = timed(fn)
            rows.append(dict(config=name, kind=kind, units=units, ms=ms, tflops=units * unit / ms / 1e9))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(config=name, kind=kind, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
        print(rows[-1], flush=True)
        xl.grad = hl.grad = wgul.grad = wdl.grad = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--configs", default="A,B,C,D")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    ceiling = dense_gemm_rate(DEVICE, torch.bfloat16, WARMUP, REPS)
    rows = [dict(kind="dense8192", ms=ceiling["ms"], tflops=ceiling["tflops"])]
    print(rows[-1], flush=True)
    for name in args.configs.split(","):
        rows += config_rows(name)
        torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=os.environ.get("MOEBLAZE_COMMIT", "unknown"),
               rows=rows)
    with open(os.path.join(args.outdir, "gemm_ceiling.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
