"""What a run trains on, by --method: its batch schedule, the gradients and loss of a step, its record's figures.

sft: sequences of tokens (the data's sources), the loss the mean over the global batch's target tokens
(accumulate_gradients), validated on the data's validation split; dpo: preference pairs, the loss the mean over the
global batch's pairs, validated on held-out pairs (preference.py). The loop asks the objective, never the method.

Each objective's step gives its micro-batches, forward and loss to the one executor (executor.run_micro_batches),
which scales, accumulates and sums them the same way for every method:

    method  forward (what the backward keeps)        loss summed over     units, normaliser    figures summed
    sft     head_loss with the summed token loss     the target tokens    tokens, global_tokens (MoE: balancing's)
            (--mtp train: + lambda / D x the MTP depths' summed token losses, model/mtp.py; the same normaliser)
    dpo     the reference, then the policy's         the pairs            pairs, global_pairs   preference.STATS
            sequence log-probs (chosen, rejected)
"""

from __future__ import annotations

import functools
import math

import torch

from zerotrain.config import Config
from zerotrain.data import IGNORE, BatchSchedule, MicroBatch, StepBatch, make_source, on_device
from zerotrain.model import summed_token_loss
from zerotrain.model.fused_delta_rule import bounds_for
from zerotrain.model.loss import head_loss
from zerotrain.parallel.context import context_parallel
from zerotrain.runtime.launch import rank_device

from .balancing import Balancing
from .evaluate import validation_loss
from .executor import Micro, MicroLoss, run_micro_batches
from .guard import LossRule, token_loss_rule
from .mtp_loss import MTPLoss, mtp_loss_for


def accumulate_gradients(engine, batch: StepBatch, forward=None, loss_factor: float = 1.0,
                         saved: list | None = None, balance: Balancing | None = None,
                         mtp: MTPLoss | None = None) -> torch.Tensor:
    """sft's step on this rank: forward and backward every micro-batch (executor.run_micro_batches); return its
    summed token loss (a 0-d tensor on the device: the caller reads it once, for the step's all-reduce).

    Each micro-batch's loss is its sum of token losses over the global token count, so the accumulated gradient is
    the global batch's mean-token-loss gradient whatever the split. `forward`, `loss_factor` and `saved`: as
    run_micro_batches's model, loss_factor and saved. LoRA's dropout masks are keyed by the step and each row's index
    in the global batch (BatchSchedule's layout: each DP replica a contiguous block), so they do not depend on the
    split. With `balance` (a mixture of experts: balancing.Balancing) each micro-batch's balancing term (its trained
    rows' balancing losses / the global batch's, weighted) joins the loss before the backward, and the summed loss
    returned holds it at the token loss's scale (x the global token count), so that the step's loss is the token loss
    plus the weighted balancing loss, as transformers' is. With `mtp` (--mtp train: mtp_loss.MTPLoss) each
    micro-batch's MTP depths' summed losses are added up apart, for the step's mtp_loss figure.
    """
    recompute = getattr(engine.model, "recompute_head", False)

    def scored(model, micro: MicroBatch) -> torch.Tensor:  # packed records' segments: each attends to itself
        return head_loss(model, micro.inputs, micro.labels, summed_token_loss, recompute, segments=micro.segments)

    def loss(micro: MicroBatch, token_loss: torch.Tensor) -> MicroLoss:
        term = balance.term(engine.model, micro.labels, batch.global_rows) if balance is not None else None
        if mtp is not None:
            mtp.add(engine.model)
        return MicroLoss(token_loss, (micro.labels != IGNORE).sum(), term=term)

    return run_micro_batches(engine, token_micro_batches(engine, batch), len(batch.micro_batches), scored, loss,
                             batch.global_tokens, model=forward, loss_factor=loss_factor, saved=saved).loss_sum


def token_micro_batches(engine, batch: StepBatch):
    """This rank's micro-batches on the device, with their rows' places in the global batch (BatchSchedule's layout:
    each DP replica a contiguous block). Packed records' boundaries for fla come along, computed on the host."""
    row = engine.mesh.dp_rank * sum(len(m.inputs) for m in batch.micro_batches)
    for micro in on_device(batch.micro_batches, engine.device, bounds_for(engine.model.cfg, engine.device)):
        yield Micro(range(row, row + len(micro.inputs)), micro)
        row += len(micro.inputs)


class TokenObjective:
    """--method sft: next-token loss on the data's tokens (with a mixture of experts, plus its balancing loss)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.balance = Balancing(cfg) if cfg.model.moe else None
        self.mtp = mtp_loss_for(cfg)

    def accumulate(self, engine, batch: StepBatch, forward=None, loss_factor: float = 1.0, saved=None):
        return accumulate_gradients(engine, batch, forward, loss_factor, saved, balance=self.balance, mtp=self.mtp)

    def schedule(self, mesh) -> BatchSchedule:
        cfg = self.cfg
        cp = context_parallel(mesh)  # --cp: the replica's rows, this rank's part of each
        part = None
        if cp:  # through fla, the linear layers' record starts from the whole rows, on the host
            fused = bounds_for(cfg.model, rank_device(cfg)) is not None
            part = functools.partial(cp.part, reach=cfg.model.linear_conv_kernel - 1) if fused else cp.part
        return BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=mesh.dp_rank, world_size=mesh.dp_size, part=part)

    def refuse(self, manifest: dict, path: str, base: dict | None) -> str | None:
        theirs = Config.from_dict(manifest["config"]).objective.method
        if theirs != "sft":
            return f"--resume {path}: its run trained --method {theirs}: give --method {theirs} to continue it"
        return None

    def prepare(self, engine, comm, manifest: dict, resumed_from: str | None, base: dict | None) -> dict:
        return {}

    def loss_units(self, batch: StepBatch) -> int:
        return batch.global_tokens

    def loss_rule(self) -> LossRule:
        """How the guard judges this loss: the token loss's tests, ln(V) a uniform guess's loss (with --mtp train,
        (1 + lambda) ln(V): the uniform guess at every depth too)."""
        m = self.cfg.model
        if m.mtp == "train" and m.mtp_layers:
            chance = (1 + m.mtp_loss_weight) * math.log(m.vocab_size)
            return LossRule(chance, f"(1 + {m.mtp_loss_weight}) ln({m.vocab_size}) = {chance:.4g}, the loss of a "
                                    "uniform guess with its MTP depths")
        return token_loss_rule(m.vocab_size)

    def validation_source(self):
        return make_source(self.cfg, split="val")

    def validate(self, engine, source) -> dict:
        """--eval-every: the validation loss (a mixture: each source's, and their weighted mean)."""
        cfg = self.cfg
        sources = getattr(source, "sources", None)
        losses = {name: validation_loss(engine.model, one, engine.mesh, batches=cfg.loop.eval_batches,
                                        micro_batch=cfg.loop.micro_batch)
                  for name, one in (sources or {"": source}).items()}
        if sources:
            return {"source_val_loss": losses,
                    "val_loss": sum(source.weights[name] * loss for name, loss in losses.items())}
        return {"val_loss": losses[""]}

    def extras(self):
        """For the step's all-reduce: --mtp train's summed MTP losses first, then a mixture of experts' balancing
        losses and expert loads (None: neither)."""
        parts = [part.extras() for part in (self.mtp, self.balance) if part is not None]
        return torch.cat(parts) if parts else None

    def held_state(self) -> dict:
        return {}

    def figures(self, totals: list[float], batch: StepBatch) -> dict:
        out = {}
        if self.mtp:
            out, totals = self.mtp.figures(totals[0], batch.global_tokens), totals[1:]
        return {**out, **(self.balance.figures(totals, batch.global_rows) if self.balance else {})}


def objective_for(cfg: Config):
    """The objective --method names."""
    if cfg.objective.method == "dpo":
        from .preference import Preference

        return Preference(cfg)
    if cfg.objective.method == "grpo":
        from .grpo import GroupRelative

        return GroupRelative(cfg)
    return TokenObjective(cfg)
