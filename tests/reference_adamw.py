"""zerotrain's AdamW in a plain torch loop: the optimizer of the transformers + AdamW loops that the training tests
compare zerotrain's runs with. Betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on what zerotrain decays
(model.is_decayed), the gradient clipped at norm 1, each step at the run's learning rate."""

from __future__ import annotations

import torch

from zerotrain.model import is_decayed


def reference_adamw(model, lr: float) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if is_decayed(n, p)], "weight_decay": 0.1},
                              {"params": [p for n, p in named if not is_decayed(n, p)], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def reference_step(optimizer, model, loss, lr: float) -> float:
    """One optimizer step of `loss` at `lr`, the gradient clipped at norm 1; its norm before the clipping."""
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm
