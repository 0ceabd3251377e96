"""The guard: refuse an anomalous update before it is applied, pick the checkpoint to roll back to, skip the bad data.

Every rank runs the same code on the same all-reduced numbers (the global loss and gradient norm, and the
summed per-rank non-finite flags), so every rank refuses the same step and restores the same checkpoint
without another collective. One step of the loop uses it like this:

    anomaly = detector.check(step + 1, loss, grad_norm, nonfinite_ranks)    # before engine.apply
    if anomaly is None: apply; detector.accept(step + 1, loss)
    else:
        target = policy.decide(anomaly, committed_steps)                      # raises past the limits
        skips = skip_after_rollback(skips, target, anomaly.step)              # the run's current skips
        restore checkpoint `target`; detector.rewind(target); continue at step index `target`
    after a checkpoint commits: policy.note_commit(step)

Steps named `step` in Anomaly, check, accept, rewind and the policy are 1-based optimizer steps (the number of
updates applied once that step's update is in), which is also the step a checkpoint is named after. `data_step`
takes the 0-based optimizer step index of the loop (`for step in range(start, steps)`).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Literal

from zerotrain.errors import ZeroTrainError


class RollbackExhausted(ZeroTrainError):
    """Anomalies kept coming: rolling back again would exceed --max-rollbacks."""


class NoCheckpointToRestore(ZeroTrainError):
    """An anomaly needs a rollback, but no committed checkpoint precedes it."""


@dataclass(frozen=True)
class Anomaly:
    step: int  # 1-based optimizer step whose update was refused
    kind: Literal["nonfinite", "spike"]
    reason: str  # one line for logs and error messages


# Below this many accepted losses the median is too noisy to call anything a spike
# (the first steps of a run drop fast, and one early loss would set the bar).
MIN_SPIKE_HISTORY = 5


class AnomalyDetector:
    """Decides, before the optimizer step, whether a step's update is refused.

    A step is refused when any rank's loss is non-finite, the global loss or gradient norm is non-finite, or
    the loss exceeds `spike_factor` x the median of the last `window` accepted losses. The spike test applies
    only once min(window, 5) losses have been accepted (since the start of the run, the resume, or the step
    rolled back to); until then only the non-finite tests can refuse a step.

    The history is the accepted (step, loss) pairs of the current timeline: `rewind(to_step)` forgets those
    after the restored checkpoint, so after a rollback the median is the one the restored model had, the same
    one a fresh process resuming from that checkpoint with `load_state_dict` gets.
    """

    def __init__(self, spike_factor: float, window: int):
        self.spike_factor = spike_factor
        self.window = window
        # Every accepted step of this timeline, not only the window: a rollback may go back further than
        # `window` steps and must find the losses that preceded the restored checkpoint (16 bytes a step).
        self._steps: list[int] = []
        self._losses: list[float] = []

    @property
    def recent_losses(self) -> list[float]:
        """The accepted losses the spike test compares against (the last `window`)."""
        return self._losses[-self.window:]

    def check(self, step: int, loss: float, grad_norm: float, nonfinite_ranks: list[int]) -> Anomaly | None:
        """The reason to refuse step `step`'s update, or None to apply it. Records nothing."""
        if nonfinite_ranks:
            return Anomaly(step, "nonfinite", f"non-finite loss on rank(s) {sorted(nonfinite_ranks)} at step {step}")
        if not math.isfinite(loss):
            return Anomaly(step, "nonfinite", f"non-finite loss {loss} at step {step}")
        if not math.isfinite(grad_norm):
            return Anomaly(step, "nonfinite", f"non-finite gradient norm {grad_norm} at step {step}")
        recent = self.recent_losses
        if len(recent) >= min(self.window, MIN_SPIKE_HISTORY):
            median = statistics.median(recent)
            if loss > self.spike_factor * median:
                return Anomaly(step, "spike", f"loss {loss:.4g} at step {step} is above {self.spike_factor} x "
                                              f"the median {median:.4g} of the last {len(recent)} steps")
        return None

    def accept(self, step: int, loss: float) -> None:
        """Record the loss of a step whose update was applied."""
        if self._steps and step <= self._steps[-1]:
            # The loop went back without rewind(): the median would mix two timelines.
            raise ValueError(f"accept({step}) after step {self._steps[-1]}: call rewind() after a rollback")
        self._steps.append(step)
        self._losses.append(float(loss))

    def rewind(self, to_step: int) -> None:
        """Forget the accepted losses of steps after `to_step` (the checkpoint just restored)."""
        keep = bisect.bisect_right(self._steps, to_step)
        del self._steps[keep:], self._losses[keep:]

    def state_dict(self) -> dict:
        """The window the next decision needs, JSON-serialisable, so a resumed run decides as the uninterrupted one."""
        return {"steps": self._steps[-self.window:], "losses": self.recent_losses}

    def load_state_dict(self, state: dict) -> None:
        self._steps = [int(s) for s in state["steps"]]
        self._losses = [float(v) for v in state["losses"]]


class RollbackPolicy:
    """Chooses the committed checkpoint to restore after an anomaly, and stops the run when rollbacks don't help.

    The target is the newest committed checkpoint before the anomaly's step, except when the anomaly comes
    back right after a rollback; then it is the newest one before the previous rollback's target, since
    restoring that target (with the bad data skipped) did not get the run clear.

    "Right after" means both:
      - the new anomaly's step <= the previous anomaly's step + 1: the run failed again while replaying the
        rolled-back stretch or on the first step past it, and
      - no checkpoint after the previous target has been committed (note_commit) since that rollback.
    A run that got further, or saved progress in between, rolls back to the newest checkpoint as usual.

    Checkpoints after a rollback's target belong to the abandoned timeline: they are not chosen again until
    the run commits that step anew (note_commit), so a rollback never jumps forward into discarded updates.
    `rollbacks` counts the rollbacks decided in this process.
    """

    def __init__(self, max_rollbacks: int):
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self._last_anomaly_step: int | None = None
        self._last_target: int | None = None
        self._committed_since_rollback = False
        self._abandoned: set[int] = set()

    def note_commit(self, step: int) -> None:
        """The checkpoint of `step` is committed on every rank (call after each sync or async save commits)."""
        self._abandoned.discard(step)
        if self._last_target is not None and step > self._last_target:
            self._committed_since_rollback = True

    def came_back(self, anomaly: Anomaly) -> bool:
        """Whether `anomaly` came right after the previous rollback (see the class docstring)."""
        return (self._last_anomaly_step is not None
                and anomaly.step <= self._last_anomaly_step + 1
                and not self._committed_since_rollback)

    def decide(self, anomaly: Anomaly, committed_steps: list[int]) -> int:
        """Record a rollback for `anomaly` and return the step of the committed checkpoint to restore."""
        if self.rollbacks >= self.max_rollbacks:
            raise RollbackExhausted(
                f"{anomaly.reason}: it would need rollback {self.rollbacks + 1}, "
                f"more than --max-rollbacks {self.max_rollbacks} allows")
        usable = sorted({int(s) for s in committed_steps} - self._abandoned)
        again = self.came_back(anomaly)
        before = self._last_target if again else anomaly.step
        earlier = [s for s in usable if s < before]
        if not earlier:
            where = f"it came back right after the rollback to step {before}, and " if again else ""
            raise NoCheckpointToRestore(
                f"{anomaly.reason}: {where}no committed checkpoint precedes step {before} to roll back to; "
                f"save checkpoints with --ckpt-every or --ckpt-every-minutes")
        target = earlier[-1]
        self._abandoned.update(s for s in usable if s > target)
        self._last_anomaly_step, self._last_target = anomaly.step, target
        self._committed_since_rollback = False
        self.rollbacks += 1
        return target


# Skipped data after rollbacks. A skip list is a JSON-serialisable list of [at_step, count] pairs, each meaning
# "after optimizer step at_step, the next `count` data steps are skipped"; checkpoints record the list in force
# when they were written. Data positions only move forward: no data step is trained on twice in a run, and
# nothing a refused or discarded update saw is trained on again.

def data_step(step: int, skips: list[list[int]]) -> int:
    """The 0-based data step that 0-based optimizer step index `step` trains on."""
    return step + sum(count for at, count in skips if at <= step)


def skip_after_rollback(skips: list[list[int]], restored_step: int, anomaly_step: int) -> list[list[int]]:
    """The skip list after rolling back from refused step `anomaly_step` (1-based) to checkpoint `restored_step`.

    `skips` is the list in force when the anomaly happened (the run's current one, not the restored
    checkpoint's: after a second rollback to the same checkpoint, that one lacks the first skip and would
    replay data the discarded updates saw). The result keeps the pairs before `restored_step` and replaces
    the rest by one pair, so that index `restored_step` trains on the data step after the refused step's
    batch: data_step(restored_step, new) == data_step(anomaly_step - 1, skips) + 1.
    """
    if not (0 <= restored_step < anomaly_step):
        raise ValueError(f"restored step {restored_step} must come before the refused step {anomaly_step}")
    kept = [[int(at), int(count)] for at, count in skips if at < restored_step]
    resume_at = data_step(anomaly_step - 1, skips) + 1
    count = resume_at - data_step(restored_step, kept)
    return kept + [[int(restored_step), count]]
