"""DeepSeek-V3's auxiliary-loss-free balancing in the training step (deepseek_v3's and glm4_moe's routers): each MoE
layer's e_score_correction_bias moves by --routing-bias-speed x sign(mean load - load) with every optimizer step
(model/group_routing.py's bias_update).

The loads are the step's tokens per expert summed over every rank and micro-batch: Balancing's figures, which ride
in the step's one all-reduce (training/balancing.py), so every rank computes the same update from the same numbers
and no collective is added. The bias is a parameter without gradient (AdamW leaves it where it is): the update is
written into this rank's fp32 master values of it, just before AdamW's step (the engine's update pre-hook, after
the placement has finished any all-gather still sending them), and the placement then publishes them as it does
AdamW's (stages 1 and 2 all-gather, stage 3 gathers the unit at its next forward, bf16 rounds the masters into the
parameters). Being a parameter, the bias is in every checkpoint (a resume continues it bitwise), reshards, is read
by --init-from and written by an hf export as transformers' buffer.
"""

from __future__ import annotations

import torch

from zerotrain.config import GROUP_ROUTED, Config
from zerotrain.model.group_routing import bias_update

BIAS = "e_score_correction_bias"


class RoutingBias:
    """The update of every MoE layer's bias, from the step's global loads (`take`), applied before AdamW's step."""

    def __init__(self, cfg: Config, engine):
        self.speed = cfg.model.routing_bias_speed
        self.experts = cfg.model.n_experts
        self.engine = engine  # the router's bias is a dense parameter: in the engine's dense group, at any --ep
        # the decoder's layers' (a multi-token-prediction layer's routing is not in the loads: model/mtp.py)
        self.names = [s.name for s in self.engine.layout.slots if s.name.endswith(BIAS) and
                      s.name.startswith("model.layers.")]
        self.names.sort(key=lambda n: int(n.split(".")[2]))  # model.layers.{i}...: Balancing's layer order
        self.pending: torch.Tensor | None = None
        self.engine.register_update_pre_hook(self._apply)

    def take(self, values: torch.Tensor) -> None:
        """The step's all-reduced values on the device, unread (training/control.reduce_step's), which end with the
        objective's extras, Balancing's [balancing loss, loads (layers x experts)]: the update the coming optimizer
        step applies, computed where the values are (no host read)."""
        loads = values[len(values) - len(self.names) * self.experts:].to(torch.float64)
        self.pending = bias_update(loads.view(len(self.names), self.experts), self.speed).float()

    def _apply(self) -> None:
        if self.pending is None:
            return
        for name, delta in zip(self.names, self.pending):
            for values, lo, hi in owned_master_values(self.engine, name):
                values.add_(delta[lo:hi].to(values.device))
        self.pending = None


def owned_master_values(engine, name: str) -> list[tuple[torch.Tensor, int, int]]:
    """[(this rank's fp32 master values of parameter `name`'s elements [lo, hi), lo, hi)]: the pieces of its flat
    range this rank owns (layout.owned_pieces), found in engine.master_views(), which lie in shard order."""
    slot = next(s for s in engine.layout.slots if s.name == name)
    views, starts, at = engine.master_views(), [], 0
    for view in views:
        starts.append(at)
        at += view.numel()
    out = []
    for piece in engine.layout.owned_pieces(engine.dp.rank, slot.offset, slot.offset + slot.numel):
        index = max(i for i, start in enumerate(starts) if start <= piece.shard_offset)
        at = piece.shard_offset - starts[index]
        out.append((views[index][at : at + piece.numel], piece.start - slot.offset, piece.end - slot.offset))
    return out


def routing_bias_for(cfg: Config, engine) -> RoutingBias | None:
    """The run's RoutingBias: DeepSeek-V3's routers (GLM-4.5's too) with a speed above 0 (None otherwise: the bias
    stays frozen; Mistral 4's routers have none; under LoRA a part of the frozen base, which a peft adapter does not
    carry)."""
    if cfg.model.arch not in GROUP_ROUTED or cfg.model.softmax_router or cfg.model.routing_bias_speed == 0 or \
            cfg.lora.rank:
        return None
    return RoutingBias(cfg, engine)
