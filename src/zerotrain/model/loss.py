"""How a model's forward becomes a loss (`head_loss`): the LM head computes the summed token loss, or each token's
log-prob of its target, itself (chunked over tokens, vocab-parallel under TP, never the full logits); any other loss
takes the logits. With --activation-checkpointing full, the head and the loss are recomputed in the backward."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def head_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, loss, recompute: bool,
              segments: torch.Tensor | None = None) -> torch.Tensor:
    """loss(model(idx, segments=segments), targets). A loss the head computes itself (`computed_by_head`: the summed
    token loss) is the model's, given the targets (vocab.LMHead, inside the model's call, so hooks around the head,
    ZeRO-3's units, see it): chunked over tokens, vocab-parallel under TP, without the full logits; any other loss
    takes the logits (all-gathered under TP). A loss `from_token_logps` (DPO's sequence log-probs) takes each token's
    log-prob of its target instead, which the head computes the same way (vocab.token_logps).

    With `recompute` (--activation-checkpointing full, while training) the head and the loss keep only the final
    norm's output for the backward, which runs them again (same values): the summed token loss computes its gradients
    there, once (vocab.token_loss's recompute; under a checkpoint they were computed in the forward, dropped, and
    computed again), any other under a checkpoint. `segments` (batch, time): the record each input token belongs to,
    for packed records (None: one document per row)."""
    by_head = getattr(loss, "computed_by_head", False)
    if getattr(loss, "from_token_logps", False):  # loss(each token's log p(target), targets): the head computes them
        def scored(h: torch.Tensor) -> torch.Tensor:
            return loss(model.lm_head(h, targets=targets, per_token=True), targets)

        recomputed = recompute and torch.is_grad_enabled()
        return model(idx, segments=segments,
                     head=(lambda h: checkpoint(scored, h, use_reentrant=False)) if recomputed else scored)
    if not (recompute and torch.is_grad_enabled()):  # the model's own call, as a compiled model traces it
        return model(idx, segments=segments, targets=targets) if by_head else loss(model(idx, segments=segments),
                                                                                   targets)

    if by_head:
        return model(idx, segments=segments, head=lambda h: model.lm_head(h, targets=targets, recompute=True))

    def run(h: torch.Tensor) -> torch.Tensor:
        return loss(model.lm_head(h), targets)

    return model(idx, segments=segments, head=lambda h: checkpoint(run, h, use_reentrant=False))
