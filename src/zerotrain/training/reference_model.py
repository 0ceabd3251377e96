"""The frozen copy of the initial policy that scores a full fine-tuning's live DPO reference, laid out like the policy.

--method dpo --dpo-reference live without LoRA scores each micro-batch's pairs with a second model: the initial
weights, built from the same values the engine started from (--init-from's files, or the seed: hub.initial_model),
TP-sliced as this rank's policy is (its vocabulary rows under --tp, so its log-probs are vocab-parallel as the
policy's), in the run's precision, every parameter frozen: no gradients, no optimizer state, never reduced, never
updated. At ZeRO-1 and 2 each rank holds it as it holds the policy's parameters (its TP slices and the replicated
ones, whole). It is built again from the base at a resume, never from a checkpoint's trained weights.

It costs a second set of parameters where the precomputed reference costs 16 bytes a pair; it scores each pair again
every step (a forward without gradients), where the precomputed one scored it once before step 1.
"""

from __future__ import annotations

import torch

from zerotrain.config import Config
from zerotrain.hub.init_from import initial_model
from zerotrain.model.init import materialise
from zerotrain.runtime.launch import rank_device


def frozen_copy(cfg: Config, engine) -> torch.nn.Module:
    """This rank's frozen copy of the initial policy (`engine`'s model as it was before step 1), on its device."""
    model, init = initial_model(cfg, engine.mesh)
    dtype = torch.bfloat16 if cfg.parallel.precision == "bf16" else torch.float32
    materialise(model, init, rank_device(cfg), dtype)
    model.requires_grad_(False)
    return model.eval()


def held_bytes(model: torch.nn.Module | None) -> int:
    """Bytes of the distinct storages behind the copy's parameters (a tied head once): the memory plan's row."""
    if model is None:
        return 0
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())
