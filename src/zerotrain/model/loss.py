"""How a model's forward becomes a loss (`head_loss`): the LM head computes the summed token loss, or each token's
log-prob of its target for a `TokenLogpsLoss`, itself (chunked over tokens, vocab-parallel under TP, never the full
logits); any other loss takes the logits. With --activation-checkpointing full, the head and the loss are recomputed
in the backward."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over unmasked target tokens (label -100 is ignored).

    A sum, not a mean: the caller divides by the global token count so that any split of the
    global batch over ranks and micro-batches yields the same gradient. Given this loss, head_loss has the head
    compute the same sum itself from its input (vocab.LMHead): chunked over tokens, vocab-parallel under TP, without
    the full logits.
    """
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100, reduction="sum"
    )


class TokenLogpsLoss:
    """A loss of each token's log-prob of its target, (rows, T) with 0 where the target is masked, rather than of the
    logits: head_loss has the head compute those (vocab.token_logps, chunked and vocab-parallel, never the full
    logits) and calls `fn(token_logps, targets)`. DPO's sequence log-probs are one (training/preference.py). Used as a
    decorator, it keeps the function's name and docstring."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, token_logps: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(token_logps, targets)


def head_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, loss, recompute: bool,
              segments: torch.Tensor | None = None) -> torch.Tensor:
    """loss(model(idx, segments=segments), targets). The summed token loss (`summed_token_loss` itself) the head
    computes: the model's, given the targets (vocab.LMHead, inside the model's call, so hooks around the head,
    ZeRO-3's units, see it): chunked over tokens, vocab-parallel under TP, without the full logits; any other loss
    takes the logits (all-gathered under TP). A `TokenLogpsLoss` (DPO's sequence log-probs) takes each token's
    log-prob of its target instead, which the head computes the same way (vocab.token_logps).

    With `recompute` (--activation-checkpointing full, while training) the head and the loss keep only the final
    norm's output for the backward, which runs them again (same values): the summed token loss computes its gradients
    there, once (vocab.token_loss's recompute; under a checkpoint they were computed in the forward, dropped, and
    computed again), any other under a checkpoint. `segments` (batch, time): the record each input token belongs to,
    for packed records (None: one document per row)."""
    by_head = loss is summed_token_loss
    if isinstance(loss, TokenLogpsLoss):  # loss(each token's log p(target), targets): the head computes them
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
