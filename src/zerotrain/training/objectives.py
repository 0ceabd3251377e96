"""What a run trains on, by --method: its batch schedule, the gradients and loss of a step, its record's figures.

sft: sequences of tokens (the data's sources), the loss the mean over the global batch's target tokens
(loop.accumulate_gradients), validated on the data's validation split; dpo: preference pairs, the loss the mean over
the global batch's pairs, validated on held-out pairs (preference.py). The loop asks the objective, never the method.
"""

from __future__ import annotations

from zerotrain.config import Config
from zerotrain.data import BatchSchedule, StepBatch, make_source
from zerotrain.parallel.context import context_parallel

from .balancing import Balancing
from .evaluate import validation_loss
from .guard import LossRule, token_loss_rule


class TokenObjective:
    """--method sft: next-token loss on the data's tokens (with a mixture of experts, plus its balancing loss)."""

    def __init__(self, cfg: Config, accumulate):
        self.cfg, self._accumulate = cfg, accumulate  # the loop's own step, which bench and equivalence share
        self.balance = Balancing(cfg) if cfg.model.moe else None

    def accumulate(self, engine, batch: StepBatch, forward=None, loss_factor: float = 1.0, saved=None):
        return self._accumulate(engine, batch, forward, loss_factor, saved, balance=self.balance)

    def schedule(self, mesh) -> BatchSchedule:
        cfg = self.cfg
        cp = context_parallel(mesh)  # --cp: the replica's rows, this rank's part of each
        return BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=mesh.dp_rank, world_size=mesh.dp_size, part=cp.part if cp else None)

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
        """How the guard judges this loss: the token loss's tests, ln(V) a uniform guess's loss."""
        return token_loss_rule(self.cfg.model.vocab_size)

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
        """A mixture of experts' balancing losses and expert loads, for the step's all-reduce (else None)."""
        return self.balance.extras() if self.balance else None

    def held_state(self) -> dict:
        return {}

    def figures(self, totals: list[float], batch: StepBatch) -> dict:
        return self.balance.figures(totals, batch.global_rows) if self.balance else {}


def objective_for(cfg: Config, accumulate_tokens):
    """The objective --method names; `accumulate_tokens` is sft's step (loop.accumulate_gradients)."""
    if cfg.objective.method == "dpo":
        from .preference import Preference

        return Preference(cfg)
    return TokenObjective(cfg, accumulate_tokens)
