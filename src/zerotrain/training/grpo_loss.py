"""GRPO's loss: group advantages from rewards, the clipped per-token policy loss with a KL term, and each loss type's
normaliser, as TRL 1.16's GRPOTrainer computes them (TRL is the oracle: tests/test_grpo_loss.py runs its
_compute_loss).

For each prompt the policy drew G completions; their rewards r_i give advantages A_i = (r_i - mean_group r) /
(std + 1e-4), the std the group's (scale_rewards "group"), the whole batch's ("batch") or none at all ("none": the
centred reward). Each completion token t of row i then costs

    -min(rho A_i, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A_i) + beta KL_t,
    rho = exp(logp_t - old_logp_t),  KL_t = rho (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   (k3, never negative)

where old_logp is the generating policy's (the same as logp, detached, when each rollout is trained on once:
num_iterations 1) and ref the reference model's. The loss types differ only in how the token costs are summed and
divided (the normaliser):

    grpo      each row's mean over its tokens, then the mean over the rows      sum_i mean_t / rows
    dr_grpo   the token sum over rows x max_completion_length                    sum_{i,t} / (rows L)
    dapo      the token sum over the global batch's tokens                       sum_{i,t} / tokens
    bnpo      the token sum over the micro-batch's tokens, averaged over the micro-batches of the step

A step split over ranks and micro-batches adds up each micro-batch's `grpo_loss`, so each call gets the divisor of
the whole step (`loss_normaliser`): the rows or tokens of the global batch. Then grpo, dr_grpo and dapo give the same
loss at any split. bnpo is defined by TRL on the micro-batch (its tokens, times the micro-batches across ranks and
accumulation: DDP's mean over ranks and TRL's 1 / accumulation), so it depends on the split by definition: it equals
TRL's where zerotrain's micro-batches are TRL's per-device batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_FLOOR = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not 0 / 0


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected) of the non-NaN entries, NaN with fewer than two (TRL's)."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = (variance * correction).sqrt()
    return std.reshape(()) if dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantage of each of the N = prompts x G completions, ordered prompt-major (a prompt's G side by side),
    from their rewards (N,), NaN for a completion no reward function scored; and whether each one's std is 0 (a
    group that teaches nothing, logged as frac_reward_zero_std). An unscored completion is left out of its group's
    mean and std and gets advantage 0 (TRL's)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # "none" keeps the group std for the zero-std count alone
        std = nanstd(groups, dim=1).repeat_interleave(num_generations) if num_generations > 1 else \
            torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_FLOOR)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor | list[int],
                    mask_truncated_completions: bool = False) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first end-of-sequence token (B, L), 0 after it; with
    `mask_truncated_completions`, 0 on the whole of a completion that never ended (cut at max_completion_length)."""
    eos = torch.as_tensor(eos_ids, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)
    ended = is_eos.any(dim=1)
    L = completion_ids.shape[1]
    first = torch.where(ended, is_eos.int().argmax(dim=1), torch.full_like(ended, L, dtype=torch.long))
    mask = (torch.arange(L, device=completion_ids.device) <= first[:, None]).int()
    return mask * ended[:, None].int() if mask_truncated_completions else mask


def loss_normaliser(loss_type: str, *, rows: int, tokens: torch.Tensor | None = None,
                    max_completion_length: int | None = None, micro_batch_tokens: torch.Tensor | None = None,
                    micro_batches: int = 1) -> torch.Tensor | float:
    """What one micro-batch's summed loss is divided by, so that the micro-batches of a step add up to the step's
    loss: `rows` and `tokens` (completion tokens in the loss) are the global batch's, across ranks and accumulation;
    bnpo's is its own micro-batch's tokens times the `micro_batches` of the step (ranks x accumulation)."""
    if loss_type == "grpo":
        return rows
    if loss_type == "dr_grpo":
        return rows * max_completion_length
    if loss_type == "dapo":
        return tokens.clamp(min=1.0)
    if loss_type == "bnpo":
        return micro_batch_tokens.clamp(min=1.0) * micro_batches
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def sequence_mean_first(loss_type: str) -> bool:
    """Whether each row's token losses are averaged before the rows are summed (grpo: a long completion weighs as
    much as a short one), rather than every token summed alike."""
    return loss_type == "grpo"


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) at each drawn token: exp(d) - d - 1, d = ref - logp (>= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


@dataclass
class GRPOStats:
    """Masked sums of the micro-batch, summed over the step and divided by `tokens` once reduced (TRL's metrics are
    means over the global batch's completion tokens): kl, entropy, the tokens whose ratio was clipped below (with a
    negative advantage), above (with a positive one) and either."""
    tokens: torch.Tensor
    kl: torch.Tensor | None
    entropy: torch.Tensor | None
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped: torch.Tensor


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, normaliser, *,
              loss_type: str = "dapo", old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
              kl_bias_correction: bool = True, entropies: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, GRPOStats]:
    """This micro-batch's share of the step's loss and its metric sums: `logps` (B, L) the policy's log-probs of
    the drawn completion tokens (with gradient), `advantages` (B,), `mask` (B, L) the tokens in the loss
    (completion_mask), `normaliser` from loss_normaliser for the whole step. `old_logps`: the generating policy's
    (None: this policy's, detached, num_iterations 1); `ref_logps` with `beta` > 0 the reference's.
    `kl_bias_correction` (TRL's use_bias_correction_kl, on by default) weighs the KL term by the ratio rho: 1 in
    value on-policy, but its gradient makes the KL's the unbiased reverse-KL gradient (DeepSeek-V3.2)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = None
    if beta != 0.0:
        kl = per_token_kl(logps, ref_logps)
        if kl_bias_correction:
            kl = kl * ratio
        token_loss = token_loss + beta * kl
    if sequence_mean_first(loss_type):
        summed = ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        summed = (token_loss * mask).sum()
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    with torch.no_grad():
        stats = GRPOStats(tokens=mask.sum(), kl=None if kl is None else (kl * mask).sum(),
                          entropy=None if entropies is None else (entropies * mask).sum(),
                          clipped_low=(low * mask).sum(), clipped_high=(high * mask).sum(),
                          clipped=((low | high) * mask).sum())
    return summed / normaliser, stats
