"""RMSNorm, the normalization every Llama-family block uses (Gemma's (1 + w) variant lives in gemma.py)."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype (as Hugging Face's Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the gain as the caller passes it (Qwen3's q/k norms under TP: see LlamaAttention), else own."""
        xf = x.float()
        gain = self.weight if weight is None else weight
        return gain * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
