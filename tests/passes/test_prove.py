"""The proof's error measure: float64 sums over chunks, never a float64 copy of a whole gradient."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeblaze_fx.passes import prove


def _direct(a, b):
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return ((a - b).norm() / max(a.norm(), b.norm(), torch.tensor(1e-30, dtype=torch.float64))).item()


class _LargestFloat64(TorchDispatchMode):
    """The most elements of any float64 tensor an operator returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.largest = max(self.largest, t.numel())
        return out


# 7 divides none of the sizes (a short last chunk); 1000 is one chunk; 1 is every element alone
@pytest.mark.parametrize("chunk", [7, 1000, 1], ids=["ragged-chunks", "one-chunk", "element-chunks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rel_error_matches_the_whole_tensor_formula(monkeypatch, chunk, dtype):
    monkeypatch.setattr(prove, "ERROR_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10, 30, generator=gen).to(dtype)
    b = (a.float() + 0.01 * torch.randn(10, 30, generator=gen)).to(dtype)
    assert prove._rel_error(a, b, a) == pytest.approx(_direct(a, b), rel=1e-9)
    assert prove._rel_error(a, a.clone(), a) == 0.0
    # a missing gradient is zeros: the error is 1 against any nonzero other
    assert prove._rel_error(None, b, b) == pytest.approx(1.0)
    assert prove._rel_error(a, None, a) == pytest.approx(1.0)
    assert prove._rel_error(None, None, a) == 0.0
    assert prove._rel_error(torch.zeros(0), torch.zeros(0), torch.zeros(0)) == 0.0


def test_rel_error_makes_no_float64_copy_of_a_whole_tensor(monkeypatch):
    # A [64, 4096, 7168] bf16 gradient made 14 GiB float64 copies and ran the proof out of an 80 GB GPU's memory.
    monkeypatch.setattr(prove, "ERROR_CHUNK", 64)
    a, b = torch.randn(1000), torch.randn(1000)
    with _LargestFloat64() as mode:
        err = prove._rel_error(a, b, a)
    assert mode.largest == 64
    assert math.isfinite(err) and err == pytest.approx(_direct(a, b), rel=1e-9)
