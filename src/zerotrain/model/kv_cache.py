"""The KV cache generation fills: every layer's keys and values of the positions decoded so far."""

from __future__ import annotations

import torch


class KVCache:
    """The keys and values of every layer for the first `length` positions, preallocated to `positions` (at most the
    model's context; generate.py asks for the prompt and the new tokens only).

    Filled by a model's `forward(idx, cache)`: the new tokens sit at positions length .. length + T - 1,
    and each layer attends over all the positions stored so far. It stores the KV heads only (fewer than
    the query heads under grouped-query attention). It holds at most seq_len positions; the caller decides
    what happens past that (generate.py slides a window and refills the cache).
    """

    def __init__(self, cfg, batch: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 positions: int | None = None, kv_heads: int | None = None):
        """`kv_heads`: the KV heads this rank computes (fewer under TP: kv_heads_per_rank), default all of them."""
        self.positions = cfg.positions if positions is None else min(positions, cfg.positions)
        # Gemma 4's global layers are of their own shape: every layer's room is the widest, each uses its part
        heads, width = (max(sizes) for sizes in zip(*(cfg.attention_shape(i) for i in range(cfg.n_layer))))
        shape = (cfg.n_layer, batch, kv_heads or heads, self.positions, width)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values (B, KV, T, D) of the new positions; all of them so far."""
        end = self.length + k.shape[2]
        if end > self.positions:
            raise ValueError(f"the KV cache holds {self.positions} positions; {end} do not fit")
        heads, width = k.shape[1], k.shape[3]
        self.keys[layer, :, :heads, self.length : end, :width] = k
        self.values[layer, :, :heads, self.length : end, :width] = v
        return self.keys[layer, :, :heads, :end, :width], self.values[layer, :, :heads, :end, :width]
