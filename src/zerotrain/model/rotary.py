"""Rotary position embeddings: the cos and sin tables, their rotation of q and k, and the frequency scalings
(Llama 3.1's, linear, YaRN) that stretch a model's context."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rope scaling: wavelengths longer than original_context / low_freq_factor turn `factor` times
    slower, those shorter than original_context / high_freq_factor stay, and those between are interpolated
    smoothly; the context grows without retraining the high frequencies that encode nearby order."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        wavelength = 2 * math.pi / inv_freq
        slowed = inv_freq / self.factor
        smooth = (self.original_context / wavelength - self.low_freq_factor) / \
            (self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelength > self.original_context / self.low_freq_factor, slowed, inv_freq)
        in_between = (wavelength >= self.original_context / self.high_freq_factor) & \
            (wavelength <= self.original_context / self.low_freq_factor)
        return torch.where(in_between, between, out)


@dataclass(frozen=True)
class LinearScaling:
    """Linear rope scaling (Gemma 3's global layers): every frequency `factor` times slower, positions interpolated."""

    factor: float

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023), as transformers' rope_type "yarn" computes it (gpt-oss, long-context Qwen): the
    frequencies that turn more than beta_fast times over the original context are kept, those turning fewer than
    beta_slow times are slowed by `factor`, and a linear ramp over the dimensions between blends the two; cos and
    sin are multiplied by `magnitude` (transformers' attention_factor: 0.1 ln(factor) + 1 unless given), which
    scales every q.k score by its square. `truncate` rounds the ramp's ends to whole dimensions. The ramp's ends
    depend on the rotary base, which the scaling therefore holds."""

    factor: float
    original_context: int
    theta: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 0.0  # 0: YaRN's own, from the factor

    @property
    def magnitude(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        dim = 2 * inv_freq.numel()

        def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over the context
            return dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, device=inv_freq.device).float() / dim)
        kept = 1 - ramp  # 1: the frequency as it was (extrapolated), 0: slowed by the factor (interpolated)
        return 1.0 / (self.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: Llama3Scaling | LinearScaling | YarnScaling | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary embeddings at `positions`, in fp32, rotate-half layout: frequency i at columns i and
    i + head_dim / 2. Positions (T,) give tables (T, head_dim), shared by the batch; positions (B, T) of packed
    records give (B, 1, T, head_dim), one table per row, shared by its heads. `scaling` rescales the
    frequencies (Llama 3.1's, YaRN's), and YaRN's also the tables (its magnitude)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    if scaling is not None:
        inv_freq = scaling.rescale(inv_freq)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    if positions.dim() == 2:
        angles = angles.unsqueeze(1)
    magnitude = getattr(scaling, "magnitude", 1.0)
    if magnitude != 1.0:
        return angles.cos() * magnitude, angles.sin() * magnitude
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (x_i, x_{i + D/2}) pairs of x (B, H, T, D) by its position's angles. Tables narrower
    than the head (GLM-4.5's --partial-rotary, D' = cos.shape[-1]) rotate its first D' units, pairs (x_i, x_{i + D'/2}),
    and pass the rest through, as transformers' apply_rotary_pos_emb does."""
    if cos.shape[-1] < x.shape[-1]:
        # written into a tensor of x's layout, not torch.cat's contiguous one: the attention's output then keeps the
        # layout o_proj reads as a view, as after whole-head rotary (a contiguous q made SDPA's output (B, H, T, D),
        # whose transpose o_proj saved as one more copy of it per layer: measured on CPU)
        width, out = cos.shape[-1], torch.empty_like(x)
        out[..., :width] = apply_rotary(x[..., :width], cos, sin)
        out[..., width:] = x[..., width:]
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))
