"""The dW kernel's 32-bit row offsets at their boundary, on the GPU: the issue-4 scale point
(T, d, h, E, K) = (2,097,152, 1024, 4096, 8, 2) puts x's last element at offset 2**31 - 1, the largest that
``ROWS32`` admits. One "recompute" step with 32-bit offsets and one with 64-bit offsets (forced) must give
bitwise the same gradients.

    PYTHONPATH=. python3 benchmarks/rows32_device.py [--tokens 2097152]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from scale_device import step_fn  # noqa: E402

from moeblaze_fx.kernels import expert_bwd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2_097_152)
    args = p.parse_args()
    T, d, h, E, K = args.tokens, 1024, 4096, 8, 2
    step, leaves = step_fn(T, d, h, E, K, "recompute", torch.device("cuda"), torch.bfloat16)
    fits = expert_bwd._offsets_fit_int32(leaves[0].detach())
    step()
    narrow = [t.grad.clone() for t in leaves]
    real = expert_bwd._offsets_fit_int32
    expert_bwd._offsets_fit_int32 = lambda *tensors: False
    try:
        step()
    finally:
        expert_bwd._offsets_fit_int32 = real
    same = [bool(torch.equal(a, t.grad)) for a, t in zip(narrow, leaves)]
    print(f"T={T}: x's offsets fit int32: {fits}; gradients (x, router, gate_up, down) bitwise equal, "
          f"32-bit vs 64-bit offsets: {same}", flush=True)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
