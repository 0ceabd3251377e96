"""The frozen copy of the initial policy that scores a full fine-tuning's live DPO reference, laid out like the policy.

--method dpo --dpo-reference live without LoRA scores each micro-batch's pairs with a second model: the initial
weights, built from the same values the engine started from (--init-from's files, or the seed: hub.initial_model),
TP-sliced as this rank's policy is (its vocabulary rows under --tp, so its log-probs are vocab-parallel as the
policy's), in the run's precision, every parameter frozen: no gradients, no optimizer state, never reduced, never
updated. At ZeRO-1 and 2 each rank holds it as it holds the policy's parameters (its TP slices and the replicated
ones, whole). At ZeRO-3 it is sharded as the policy is (parallel/frozen_copy.shard_frozen_copy: the policy's layout, each
rank its owned chunks, only those read from the files), and a unit is gathered for its forward and released after
it: the copy is never whole on a rank. It is built again from the base at a resume, never from a checkpoint's
trained weights.

It costs a second set of parameters (at ZeRO-3 a second shard) where the precomputed reference costs 16 bytes a pair,
and a forward without gradients of every micro-batch every step (at ZeRO-3 with its units' all-gathers), where the
precomputed one scored each pair once before step 1. It scores before the policy's forward, when none of the
policy's units is whole: at ZeRO-3 the copy's units and the policy's are never whole together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.config import Config
from zerotrain.hub.init_from import initial_model
from zerotrain.model.init import materialise
from zerotrain.parallel.context import context_parallel
from zerotrain.parallel.params import param_dtype, storage_bytes
from zerotrain.parallel.parts import parts_for
from zerotrain.parallel.frozen_copy import FrozenCopy, shard_frozen_copy
from zerotrain.runtime.launch import rank_device


@dataclass
class ReferenceCopy:
    """The frozen copy: `model` scores (under torch.no_grad()); `sharded`, at ZeRO-3, holds its shard and gathers its
    units."""

    model: torch.nn.Module
    sharded: FrozenCopy | None = None

    def held_bytes(self) -> int:
        """Bytes this rank holds for the copy now (between forwards): its parameters, or at ZeRO-3 its shard (its
        units are released)."""
        if self.sharded is not None:
            return self.sharded.param_bytes()
        return storage_bytes(self.model.parameters())

    def peak_bytes(self) -> int:
        """The most bytes the copy has held at once so far: at ZeRO-3 its shard and the units whole in a forward."""
        return self.sharded.param_peak_bytes if self.sharded is not None else self.held_bytes()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the copy holds (the memory plan's walk of what a rank holds)."""
        held = [self.sharded.param_shard, *self.sharded.bucket_params] if self.sharded is not None else []
        return list(self.model.parameters()) + held


def frozen_copy(cfg: Config, engine) -> ReferenceCopy:
    """This rank's frozen copy of the initial policy (`engine`'s model as it was before step 1), on its device."""
    model, init = initial_model(cfg, engine.mesh)
    model.requires_grad_(False)
    model.context_parallel = context_parallel(engine.mesh)  # --cp: it scores the policy's parts of the rows
    if not parts_for(cfg).placement.holds_whole_model:  # the policy's layout; its owned ranges alone read or drawn
        sharded = shard_frozen_copy(model, engine.dp, bucket_numel=cfg.parallel.bucket_numel,
                                    precision=cfg.parallel.precision, device=rank_device(cfg), init=init)
        return ReferenceCopy(model.eval(), sharded)
    materialise(model, init, rank_device(cfg), param_dtype(cfg.parallel.precision))
    return ReferenceCopy(model.eval())
