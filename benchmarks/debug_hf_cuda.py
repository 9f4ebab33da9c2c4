"""Print the moeblaze report for a tiny bf16 Mixtral on CUDA (why a region is rewritten or skipped)."""
import sys

import torch

sys.path[:0] = ["tests", "tests/e2e"]
from test_hf import _tokens, build  # noqa: E402

import moeblaze_fx  # noqa: E402

model = build("mixtral", "grouped_mm", torch.bfloat16).cuda()
tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2)).cuda()
torch.compile(model, backend="moeblaze", fullgraph=True, options={"inductor": False})(tokens)
print(moeblaze_fx.report.format_table(moeblaze_fx.last_report()))
