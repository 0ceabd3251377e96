"""DeepSeek-V3's router: sigmoid scores, experts chosen by group-limited top-k on the scores plus a load-balancing
bias, weighted by the scores themselves; and the bias's update (auxiliary-loss-free balancing).

    scores      s = sigmoid(x W^T), in fp32 (transformers' DeepseekV3TopkRouter)
    choice      on s + b (b: e_score_correction_bias): the experts split into n_group equal groups, each group scored
                by the sum of its two best experts; the topk_group best groups kept, the top-k experts among theirs
    weights     the chosen experts' s (not s + b: the bias decides who, never how much), divided by their sum when
                norm_topk_prob, times routed_scaling_factor

Mistral 4's router (cfg.softmax_router) is the same with s = softmax(x W^T) in the activations' dtype (transformers'
Mistral4TopkRouter: bf16 in a bf16 run) and no bias: the groups and the top-k on s itself (its masked experts filled
with 0 where DeepSeek's take -inf: a softmax's probabilities are positive, so the same experts are chosen).

The bias has no gradient. After each optimizer step it moves by speed x sign(mean load - load) per expert (DeepSeek-V3
paper, section 2.1.2: an overloaded expert's bias falls, an underloaded one's rises), the loads being the tokens each
expert got over the whole step on every rank: the same numbers on every rank, so every replica's bias stays equal.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

GROUP_SCORE_EXPERTS = 2  # a group's score: the sum of its best two experts' (transformers' and DeepSeek's)


class GroupLimitedRouter(nn.Module):
    """The router's weight and its e_score_correction_bias (both fp32 in transformers' checkpoints; Mistral 4's router
    has no bias). The bias is a parameter without gradient so that checkpoints, resharding, --init-from and export
    carry it as any weight; its zero gradient leaves AdamW's moments at zero and its value unmoved (1-D: no weight
    decay)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.n_group, self.topk_group = cfg.expert_groups, cfg.expert_groups_per_token
        self.normalize, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling
        self.softmax = cfg.softmax_router
        self.weight = nn.Parameter(torch.zeros(cfg.n_experts, cfg.n_embd))
        if not self.softmax:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_experts))

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the scores (N, E): sigmoid in fp32, or Mistral 4's softmax in flat's dtype; the top-k weights (N, k) in
        the scores' dtype; the experts chosen (N, k)) of tokens `flat` (N, C)."""
        if self.softmax:
            scores = softmax_scores(flat, self.weight)
            choice = scores.detach()
        else:
            scores = torch.sigmoid(torch.nn.functional.linear(flat.float(), self.weight.float()))
            choice = scores.detach() + self.e_score_correction_bias.detach().float()
        chosen = group_limited_top_k(choice, self.n_group, self.topk_group, self.top_k)
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, chosen


def softmax_scores(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mistral 4's router probabilities softmax(x W^T) (N, E), in the activations' dtype as transformers computes
    them."""
    return torch.nn.functional.linear(flat, weight).softmax(dim=-1)


def group_limited_top_k(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """The top_k experts (N, top_k) by `choice` (N, E) among the experts of each token's topk_group best groups."""
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)
    group_scores = grouped.topk(GROUP_SCORE_EXPERTS, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], 1)
    allowed = kept.bool().unsqueeze(-1).expand(N, n_group, E // n_group).reshape(N, E)
    return choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]


def bias_update(loads: torch.Tensor, speed: float) -> torch.Tensor:
    """What each expert's bias moves by after a step whose loads (tokens per expert, (..., E)) were `loads`:
    speed x sign(mean load - load)."""
    return speed * torch.sign(loads.mean(dim=-1, keepdim=True) - loads)
