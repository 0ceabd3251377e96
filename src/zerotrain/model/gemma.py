"""Gemma 2 and Gemma 3's own pieces, which the Llama decoder (llama.py) takes as options: the (1 + w) RMSNorm, the
embedding's scale and the GeGLU activation, each as transformers computes it (its Gemma2RMSNorm,
Gemma2TextScaledWordEmbedding and gelu_pytorch_tanh), so that the logits are its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (1 + weight), the gain applied in fp32 too (Llama's multiplies after the cast back
    to x's dtype), returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: a gain of 1 + weight, so the weight starts at 0 (llama.init_rule)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the gain's weight as the caller passes it (q/k norms under TP: llama.normalize_heads), else own."""
        return rms_norm_plus_one(x, self.weight if weight is None else weight, self.eps)


def embedding_scale(width: int, dtype: torch.dtype) -> float:
    """The factor of the token embedding's output: sqrt(width), rounded to the weights' dtype as transformers casts
    its fp32 scale (sqrt(2304) = 48 exactly; sqrt(1152) = 33.94... is 34.0 in bf16). A Python number, so that the
    multiplication keeps nothing for the backward."""
    return torch.tensor(width**0.5).to(dtype).item()


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation, transformers' gelu_pytorch_tanh) of the gate times up."""
    return F.gelu(gate, approximate="tanh") * up
