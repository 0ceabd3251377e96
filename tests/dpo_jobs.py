"""Jobs the DPO tests run on 2 and 4 ranks (importable by module name in the spawned ranks)."""

from __future__ import annotations

import os

from dist_jobs import summary

from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.training import memory_plan, preference, reference_model
from zerotrain.training.loop import train

FIGURES = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracy", "logps_chosen",
           "logps_rejected")
VAL_FIGURES = ("val_loss",) + tuple(f"val_{k}" for k in FIGURES)  # --eval-every's, on the held-out pairs


def log_of(result) -> dict:
    """The run's log with the preference figures of each step, and the validation's of the steps that have one, and
    the memory plan's rows (which the run checked against what it held)."""
    out = summary(result)
    out["plan_rows"] = result.plan["rows"]
    out.update({k: [r[k] for r in result.records] for k in FIGURES})
    out.update({k: [r[k] for r in result.records if k in r] for k in VAL_FIGURES})
    return out


def dpo_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log with the preference figures of each step."""
    return log_of(train(cfg, comm))


def dpo_reference_by_position_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a micro-batch's reference log-probs are looked up by the pairs' places in it, not by the pairs:
    right only where a micro-batch holds pairs 0..B-1 in order."""
    real = preference.Preference.reference_of

    def by_position(self, engine, forward, micro, ids):
        return real(self, engine, forward, micro, list(range(len(ids))))

    preference.Preference.reference_of = by_position
    try:
        return dpo_job(cfg, comm)
    finally:
        preference.Preference.reference_of = real


def dpo_reference_aliases_policy_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: full fine-tuning's live reference "copy" is the policy itself (aliased, not copied): right at
    step 1, then it moves with training. (The strict memory plan sees the policy's padded flat buffer where the copy
    should be, and would stop the run after step 1: here its difference is reported and the run goes on, so that
    the losses tell.)"""
    real, strict = reference_model.frozen_copy, os.environ.get(memory_plan.STRICT_ENV)
    reference_model.frozen_copy = lambda cfg, engine: reference_model.ReferenceCopy(engine.model)
    os.environ[memory_plan.STRICT_ENV] = "0"
    try:
        return dpo_job(cfg, comm)
    finally:
        reference_model.frozen_copy = real
        if strict is not None:
            os.environ[memory_plan.STRICT_ENV] = strict
