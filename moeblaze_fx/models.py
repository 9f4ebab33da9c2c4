"""A small MoE transformer written the way plain-PyTorch users write one, for the demo and tests.

Nothing here knows about MoEBlaze: the backend has to find the expert computation on its own.
The MoE block routes with softmax -> top-k -> renormalize and runs its experts as a per-expert loop
over ``range(E)`` (``one_hot`` + ``torch.where`` + ``index_add_``), with the expert weights held
as two 3-D parameters in Hugging Face's layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LoopMoE", "TinyMoETransformer"]


class LoopMoE(nn.Module):
    def __init__(self, d: int, h: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(d, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * h, d) * d**-0.5)
        self.down = nn.Parameter(torch.randn(num_experts, d, h) * h**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, self.num_experts).permute(2, 1, 0)  # [E, K, T]
        for e in range(self.num_experts):
            k, tok = torch.where(mask[e])
            gate, up = (x[tok] @ self.gate_up[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down[e].t()
            out.index_add_(0, tok, y * weights[tok, k, None])
        return out.reshape(shape)


class _Block(nn.Module):
    def __init__(self, d: int, h: int, heads: int, num_experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.moe = LoopMoE(d, h, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, S, d))
        return x + self.moe(self.norm2(x))


class TinyMoETransformer(nn.Module):
    """A causal language model: embedding, ``layers`` blocks of attention + MoE, a tied head."""

    def __init__(self, vocab: int = 256, d: int = 64, h: int = 128, layers: int = 2, heads: int = 4,
                 num_experts: int = 8, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        self.blocks = nn.ModuleList(_Block(d, h, heads, num_experts, top_k) for _ in range(layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
