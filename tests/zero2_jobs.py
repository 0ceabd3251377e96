"""Jobs of the ZeRO-2 tests, run by spawned ranks (importable by module name); planted bugs patch the engine itself."""

from __future__ import annotations

from dist_jobs import summary

from zerotrain.config import Config
from zerotrain.parallel import Comm, GradientReducer
from zerotrain.training.loop import train


def stage_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, the final parameters, and what the engine holds for gradients (now, at most, the buckets)."""
    result = train(cfg, comm)
    out = summary(result)
    engine = result.engine
    out["params"] = engine.full_state_dict()
    held = engine.memory_held()
    out["grad_bytes"], out["grad_peak_bytes"] = held["grad_bytes"], held["grad_peak_bytes"]
    out["shard_bytes"] = engine.grads.grad_shard.numel() * 4
    sizes = sorted((b.end - b.start) * 4 for b in engine.layout.buckets)
    out["two_largest_buckets"] = sum(sizes[-2:])
    return out


def freed_early_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a bucket's full gradients are freed before its reduce-scatter reads them."""
    launch = GradientReducer._launch

    def early(self, index):
        self._release(index)
        launch(self, index)

    GradientReducer._launch = early
    return stage_job(cfg, comm)


def never_freed_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a reduced bucket's gradients are kept, so the next step would accumulate onto them."""
    GradientReducer._release = lambda self, index: None
    return stage_job(cfg, comm)
