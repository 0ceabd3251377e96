"""AdamW as zerotrain runs it: weight-decay groups and the fastest implementation torch offers."""

from __future__ import annotations

import torch

from zerotrain.config import OptimConfig
from zerotrain.model import is_decayed


def adamw_param_groups(named_params, weight_decay: float) -> list[dict]:
    """AdamW's two param groups for whole parameters: decayed matrices, and everything else."""
    named_params = list(named_params)
    groups = ({"params": [p for n, p in named_params if is_decayed(n, p)], "weight_decay": weight_decay},
              {"params": [p for n, p in named_params if not is_decayed(n, p)], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def adamw_options(optim: OptimConfig, device: torch.device) -> dict:
    """AdamW's keyword arguments: fused where this torch and device have it (one kernel over every tensor of a
    group), else foreach."""
    options = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
        options["fused"] = True
    except (RuntimeError, TypeError, ValueError):
        options["foreach"] = True
    return options


def build_adamw(groups: list[dict], optim: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, **adamw_options(optim, groups[0]["params"][0].device))
