"""What a run trains on, by --method: its batch schedule, the gradients and loss of a step, its record's figures.

sft: sequences of tokens (the data's sources), the loss the mean over the global batch's target tokens
(loop.accumulate_gradients); dpo: preference pairs, the loss the mean over the global batch's pairs
(preference.py). The loop asks the objective, never the method.
"""

from __future__ import annotations

from zerotrain.config import Config
from zerotrain.data import BatchSchedule, StepBatch, make_source


class TokenObjective:
    """--method sft: next-token loss on the data's tokens."""

    def __init__(self, cfg: Config, accumulate):
        self.cfg, self.accumulate = cfg, accumulate  # the loop's own step, which bench and equivalence share

    def schedule(self, mesh) -> BatchSchedule:
        cfg = self.cfg
        return BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=mesh.dp_rank, world_size=mesh.dp_size)

    def refuse(self, manifest: dict, path: str, base: dict | None) -> str | None:
        theirs = Config.from_dict(manifest["config"]).objective.method
        if theirs != "sft":
            return f"--resume {path}: its run trained --method {theirs}: give --method {theirs} to continue it"
        return None

    def prepare(self, engine, comm, manifest: dict, resumed_from: str | None, base: dict | None) -> dict:
        return {}

    def loss_units(self, batch: StepBatch) -> int:
        return batch.global_tokens

    def extras(self) -> None:
        return None

    def figures(self, totals: list[float], batch: StepBatch) -> dict:
        return {}


def objective_for(cfg: Config, accumulate_tokens):
    """The objective --method names; `accumulate_tokens` is sft's step (loop.accumulate_gradients)."""
    if cfg.objective.method == "dpo":
        from .preference import Preference

        return Preference(cfg)
    return TokenObjective(cfg, accumulate_tokens)
