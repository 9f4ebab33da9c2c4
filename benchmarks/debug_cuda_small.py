"""Op on CUDA vs the float32 reference at small shapes (the tiny-Mixtral shapes included)."""
import torch

from moeblaze_fx.kernels.reference import ExpertParams, moe_ffn_reference, split_gate_up
from moeblaze_fx.ops import moe_ffn

for (T, d, h, E, K, wdt) in [(132, 32, 48, 4, 2, torch.float32), (132, 32, 48, 4, 2, torch.bfloat16),
                             (132, 64, 64, 4, 2, torch.float32), (132, 32, 64, 4, 2, torch.float32),
                             (132, 64, 48, 4, 2, torch.float32), (1000, 256, 192, 8, 2, torch.bfloat16),
                             (10, 32, 48, 4, 2, torch.float32)]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, d, generator=g).cuda().bfloat16()
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous().cuda()
    w = torch.rand(T, K, generator=g).cuda().to(wdt)
    wgu = (torch.randn(E, 2 * h, d, generator=g) / d**0.5).cuda().bfloat16()
    wd = (torch.randn(E, d, h, generator=g) / h**0.5).cuda().bfloat16()
    y = moe_ffn(x, ids, w, (wgu, wd))
    ref = moe_ffn_reference(x.float(), ids, w.float(), ExpertParams(*split_gate_up(wgu.float()), wd.float()))
    print(T, d, h, E, K, wdt, "rel", ((y.float() - ref).norm() / ref.norm()).item(), flush=True)
