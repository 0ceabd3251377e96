"""The guard: refuse an anomalous update before it is applied, pick the checkpoint to roll back to, skip the bad data.

Every rank runs the same code on the same all-reduced numbers (the global loss and gradient norm, and the
summed per-rank non-finite flags), so every rank refuses the same step and restores the same checkpoint
without another collective. One step of the loop uses it like this:

    anomaly = detector.check(step + 1, loss, grad_norm, nonfinite_ranks)    # before engine.apply
    if anomaly is None: apply; detector.accept(step + 1, loss, grad_norm)
    else:
        target = policy.decide(anomaly, committed_steps)                      # raises past the limits
        skips = skip_after_rollback(skips, target, anomaly.step)              # the run's current skips
        restore checkpoint `target`; detector.rewind(target)
        re-save `target` with skips, detector.state_dict(), policy.state_dict(); continue at step index `target`
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


@dataclass(frozen=True)
class LossRule:
    """What a method's loss looks like to the guard, and so which tests judge it; the method declares it
    (its objective's loss_rule()), the detector never asks which method it serves.

    `chance_loss` is the loss of a model that learned nothing, which a ruined one returns to or passes: ln(V) for
    the token loss, the loss at the reference for DPO (a ruined policy's margins are large and of either sign, and
    the DPO losses are convex in the margin, so their mean is at or above the loss at margin 0); None: no such bar.
    A token loss has a floor well above 0, its noise scales with it, and an odd batch raises its loss or its
    gradient norm but not both: `ratio_test` (F x the median), `outlier_test` (both far out), `gives_back_test`
    (half of what was learned back at once) and a spread relative to the median fit it. A loss that falls to 0
    (DPO; hinge reaches it exactly) or changes sign (GRPO's) makes a ratio to its median meaningless, and DPO's
    gradient scales with its loss, so a hard pair raises both: such a loss sets those tests off and gives
    `min_spread`, the smallest spread its trend test assumes, in the loss's own units.
    """

    chance_loss: float | None
    chance: str  # how a message names chance_loss
    ratio_test: bool = True
    outlier_test: bool = True
    gives_back_test: bool = True
    min_spread: float = 0.0  # absolute; the token loss's is relative (MIN_RELATIVE_SPREAD of the window's median)
    # how far past chance_loss the loss must be besides ruin_sigmas sd, as a share of chance_loss (PAST_CHANCE)
    past_chance_share: float = 0.0


def token_loss_rule(vocab_size: int | None) -> LossRule:
    """--method sft: the mean next-token loss, every test, ln(V) as a uniform guess's loss (no vocabulary: none)."""
    if not vocab_size:
        return LossRule(None, "")
    return LossRule(math.log(vocab_size), f"ln({vocab_size}) = {math.log(vocab_size):.4g}, the loss of a uniform guess")


def near_zero_loss_rule(chance_loss: float | None, chance: str) -> LossRule:
    """A loss that falls toward 0 (DPO's): judged by how far past `chance_loss` (its value for a model that learned
    nothing) and above its trend it went, in robust sd with a floor in its own units, never by a ratio to its median."""
    scale = abs(chance_loss) if chance_loss else 1.0
    return LossRule(chance_loss, chance, ratio_test=False, outlier_test=False, gives_back_test=False,
                    min_spread=MIN_SPREAD_OF_CHANCE * scale, past_chance_share=PAST_CHANCE)


# Below this many accepted losses the median is too noisy to call anything a spike
# (the first steps of a run drop fast, and one early loss would set the bar).
MIN_SPIKE_HISTORY = 5

# The outlier test's bars, in robust standard deviations (sd): 1.4826 x the median absolute deviation, which is the
# standard deviation for Gaussian noise but is not inflated by the outliers it looks for. Measured on 25 ordinary
# runs, 4,150 steps (the bench preset on python-stdlib, 2 CPU ranks, 5 seeds x 300 steps; the tiny model, 20 runs of
# 30-200 steps on python-stdlib and synthetic data), --spike-window 20: no step crossed both bars; among steps whose
# gradient norm was above 3 sd, the loss was at most 6.1 sd above its trend. The first step on a model ruined by
# a 1000x lr_spike on rank 0 of 2 (the tiny model at step 10, --spike-window 5, 5 seeds x 2 batch splits): its
# loss 12-120 sd above the trend, its gradient norm 5.5-155 sd above the median. Neither simpler test separates
# these: the loss against its median (median + k x MAD) put the ruined steps at 3.7-7.0 sd and ordinary ones up to
# 4.6, since the median of a falling loss lags it; the gradient norm alone reached 22 sd on ordinary odd batches.
LOSS_SIGMAS = 9.0
GRAD_NORM_SIGMAS = 3.0
# The ruin test's bars. An lr spike can send a model back to the loss of a uniform guess over its vocabulary, ln(V),
# or past it, whatever its size, without its gradient norm standing out (issue 27: GPT-2 2 x 40, V = 97, on 2 ranks,
# a 1000x lr_spike on rank 0 at step 9: loss 4.36 -> 4.55, gradient norm 1.84 -> 2.17). Measured in units that do
# not depend on the model: the fraction of its headroom ln(V) - trend the loss gave back, the rise and the headroom
# in robust sd of the window. `zerotrain bench spikes` (bench/spikes.py: GPT-2 2 x 40 V = 97, Llama 2 x 32 V = 64,
# GPT-2 4 x 64 V = 2048 on synthetic data, the bench preset V = 256 on python-stdlib; 5 seeds x 300 steps each,
# windows 5, 10 and 20: 17,700 checks of ordinary steps): no ordinary step with its rise and headroom above 5 sd gave
# back more than 0.33 of the headroom, the steps giving back half or more (all in steps 6-10) rose or had learned
# at most 1.7 sd, and none came more than 2.6 sd past ln(V). The first step after a 1000x spike on rank 0 of 2 gave
# back 91% or more (issue 27's run: 10.5-12.5 sd above the trend) or went past ln(V) by 9.7 sd or more; a model
# that had learned less than 5 sd is not told from noise (GPT-2 2 x 40 spiked at step 9 of 300: 0.07 below ln(V)).
LOST_FRACTION = 0.5
RUIN_SIGMAS = 5.0
# How much a loss must give back depends on how clearly the model had learned (issue 37). `zerotrain train --steps
# 100000` warms up over 10,000 steps, so for hundreds of steps its loss sits 0.1-0.3 below ln(V) (0.1 of it at the
# first step: a random tied embedding already favours repeated bytes) with hard batches 0.1 above the trend: the
# bars above took one giving back 63% of 0.167 (9 sd, 3% of ln(V)) at step 78 for a ruined model. A headroom counts
# as learned once it is at least LEARNED_SIGMAS sd (then half of it back is itself RUIN_SIGMAS sd) and
# LEARNED_FRACTION of ln(V); below either, the share to give back rises linearly from LOST_FRACTION to all of it
# (AnomalyDetector.share_to_give_back). `zerotrain bench spikes` over the default configuration's first 300 steps
# (bench/spikes.py's HEALTHY_SHAPES: 3 shapes on python-stdlib, V = 256, from scratch, with a long warmup and with
# --init-from, 5 seeds each: 45 runs): with rise and headroom above 5 sd, no ordinary step came within 18 points of
# that share at window 20 (issue 27's 50% refused steps in 8 runs) nor 4 at 10; at 5, two steps passed it by 1
# point. Ruined models that gave back less than all of their headroom pass it by 6 points or more: issue 27's
# (4.3% of ln(V), 88% back: share 73%), GPT-2 4 x 64 V = 2048 after a 100x spike at step 30 (5.7%, 71%: 64%), the
# bench preset after a 1000x spike at step 9 (24%, 59%: 50%); what went back past ln(V) is refused as before.
LEARNED_SIGMAS = RUIN_SIGMAS / LOST_FRACTION
LEARNED_FRACTION = 0.08
# The smallest spread the trend tests assume, as a fraction of the window's median: below it, differences are
# rounding, not batch noise (measured over 20-step windows: at least 0.005 for the loss, 0.03 for the gradient norm).
MIN_RELATIVE_SPREAD = 1e-3
MAD_TO_SD = 1.4826
# A loss that falls to 0 (near_zero_loss_rule). Its window can be all zeros (a hinge run past its margins), so the
# smallest spread is a share of the loss at chance (hinge 1, sigmoid ln 2): 0.01 of it. And a few pairs make a step,
# so one hard pair lifts a step's loss a lot: the loss must also be PAST_CHANCE of the chance loss past it. Measured
# on DPO runs of a tiny Llama (seed 0, 60 steps, lr 1e-3 to 3e-2, 1 to 4 pairs a step, clean and label-noised
# pairs): no healthy step passed both bars; held out: tests/guard_dpo_traces.json (scripts/guard_dpo_traces.py).
# The first step after a 1000x lr spike at step 30 of the sigmoid run went from 0.23 to 15.0 (ln 2 = 0.693), the
# hinge run's from 0 to 3.88 (chance 1).
MIN_SPREAD_OF_CHANCE = 0.01
PAST_CHANCE = 0.5
# A step with fewer trained tokens than usual (an epoch's partial last step) is noisier, by the square root of the
# ratio (step_spread), and, when it has less than PARTIAL_SHARE of the window's median, not a sample of the data
# like the others: 4 short records are mostly a record's first tokens, which a model near ln(V) predicts worst. Such a
# step may refuse an update for a loss past ln(V) or far out with its gradient norm, not for giving back part of what
# the model learned: a ruined model shows that on the next full step. Seen: a small random model (V = 300) whose
# epoch ended on 37 trained tokens against 80-260 in full steps, loss 5.347 (a reference computed 5.34702 on those
# rows) 15.8 sd above the trend of full steps, over half of its headroom below ln(300) = 5.704.
PARTIAL_SHARE = 0.5
# The trend's slope costs O(points^2) (all pairs): longer windows take every k-th step for the slope, so it stays
# at most 128 points (8,128 pairs).
MAX_SLOPE_POINTS = 128


def theil_sen_at(xs: list[int], ys: list[float], x: float) -> tuple[float, list[float]]:
    """The Theil-Sen line through (xs, ys) evaluated at x, and the residuals of ys about the line.

    The slope is the median of the slopes between all pairs of points (of every k-th point past
    MAX_SLOPE_POINTS), so a few outliers in the window neither tilt it nor shift it, unlike least squares.
    """
    stride = math.ceil(len(xs) / MAX_SLOPE_POINTS)
    px, py = xs[::stride], ys[::stride]
    n = len(px)
    slope = statistics.median((py[j] - py[i]) / (px[j] - px[i]) for i in range(n) for j in range(i + 1, n))
    intercept = statistics.median(y - slope * xi for xi, y in zip(xs, ys))
    return intercept + slope * x, [y - (intercept + slope * xi) for xi, y in zip(xs, ys)]


def robust_spread(residuals: list[float], typical: float) -> float:
    """The robust standard deviation of `residuals` (1.4826 x their median absolute value), at least
    MIN_RELATIVE_SPREAD x |typical|, so a window that happens to be nearly constant does not make every small
    rise an outlier; 0 only for a window of zeros."""
    return max(MAD_TO_SD * statistics.median(abs(r) for r in residuals), MIN_RELATIVE_SPREAD * abs(typical))


def sigmas_above(value: float, center: float, residuals: list[float], typical: float) -> float:
    """How many robust standard deviations of `residuals` (robust_spread) `value` lies above `center`
    (negative: below)."""
    spread = robust_spread(residuals, typical)
    if spread == 0.0:  # a window of zeros
        return math.inf if value > center else 0.0
    return (value - center) / spread


class AnomalyDetector:
    """Decides, before the optimizer step, whether a step's update is refused.

    A step is refused when
      - any rank's loss is non-finite, or the global loss or gradient norm is (nonfinite);
      - the loss exceeds `spike_factor` x the median of the last `window` accepted losses (spike). This catches
        a blow-up, but not a ruined model whose loss went back near ln(V), the loss of a uniform guess over the
        vocabulary: that is above F x the median only while the median is below ln(V) / F;
      - the outlier test (spike): the loss is more than `loss_sigmas` robust standard deviations above the
        robust (Theil-Sen) trend of the window's losses, where they were heading, and the gradient norm is more
        than `grad_norm_sigmas` above the window's median gradient norm. A blow-up shows in both; an ordinary
        odd batch raises one of them, not both (see LOSS_SIGMAS for the measurements);
      - the ruin test (spike; with `vocab_size`): the trend is below ln(V), the loss rose at least `ruin_sigmas`
        sd above it, and it is back near ln(V) (the model had learned at least `ruin_sigmas` sd, its headroom
        ln(V) - trend, and the loss gave back at least `lost_fraction` of it if that headroom is clearly
        learning, at least `learned_sigmas` sd and `learned_fraction` of ln(V), up to all of it for a model that
        learned less: share_to_give_back) or past ln(V) by `ruin_sigmas` sd, worse than a uniform guess.
        Measured in units of the model's own progress and noise, so the bars hold at any size and vocabulary; the
        gradient norm, which a ruined model's need not raise, is not asked (see LOST_FRACTION, LEARNED_FRACTION).
    Which of these judge a step is the method's LossRule (rule; default the token loss's over `vocab_size`): a loss
    that falls to 0, DPO's, is judged by the ruin test's bar past its chance loss alone (near_zero_loss_rule). The
    trend tests weigh a step by its units (`check(..., units)`: its trained tokens, or pairs): a step with fewer
    than the window's median is judged by a spread larger by the square root of the ratio (step_spread).
    The ratio test applies once min(window, 5) losses have been accepted; the outlier test once the window is
    full (which serves as its warm-up, over the fast first steps of a run); the ruin test once 5 losses have been
    accepted, on the trend of those in the window (its sd bars are its warm-up: early in a run the headroom is
    within the noise). A window below 5 turns both trend tests off. Counted since the start of the run, the
    resume, or the step rolled back to; until then only the non-finite tests can refuse a step. Short windows
    give the outlier test few samples: on the ordinary runs of LOSS_SIGMAS' measurement, 61 of 4,150 steps
    crossed both bars at --spike-window 5, 1 at 10, none at 20 (`zerotrain bench spikes`: 18-45 of 1,500 per
    shape at 5, 0-4 at 10, none at 20); the ruin test raised none at any of them, and over the default
    configuration's first 300 steps (45 runs, see LEARNED_FRACTION) none at 10 and 20, 2 at 5.

    The history is the accepted (step, loss, gradient norm) triples of the current timeline: `rewind(to_step)`
    forgets those after the restored checkpoint, so after a rollback the window is the one the restored model
    had, the same one a fresh process resuming from that checkpoint with `load_state_dict` gets. The loop restores
    a rollback's window from the checkpoint's manifest (rewinding only one written without it): a resumed run's
    history begins with the window of its checkpoint and may not reach back to an earlier one's.
    """

    def __init__(self, spike_factor: float, window: int, *, vocab_size: int | None = None,
                 rule: LossRule | None = None, loss_sigmas: float = LOSS_SIGMAS, grad_norm_sigmas: float = GRAD_NORM_SIGMAS,
                 ruin_sigmas: float = RUIN_SIGMAS, lost_fraction: float = LOST_FRACTION,
                 learned_sigmas: float = LEARNED_SIGMAS, learned_fraction: float = LEARNED_FRACTION):
        self.spike_factor = spike_factor
        self.window = window
        self.loss_sigmas = loss_sigmas  # math.inf turns the outlier test off
        self.grad_norm_sigmas = grad_norm_sigmas
        # the method's loss (default: the token loss over `vocab_size`); its chance loss, ln(V) for the token loss, is
        # what a ruined model returns to (None turns the ruin test off)
        self.rule = rule or token_loss_rule(vocab_size)
        self.uniform_loss = self.rule.chance_loss
        self.ruin_sigmas = ruin_sigmas
        self.lost_fraction = lost_fraction
        self.learned_sigmas = learned_sigmas
        self.learned_fraction = learned_fraction
        # Every accepted step of this timeline, not only the window: a rollback may go back further than
        # `window` steps and must find the steps that preceded the restored checkpoint (24 bytes a step).
        self._steps: list[int] = []
        self._losses: list[float] = []
        self._grad_norms: list[float | None] = []  # None: restored from a checkpoint that did not record it
        self._units: list[int | None] = []  # each step's trained tokens (DPO: pairs); None: not recorded
        self._checked: tuple[int, float, int | None] | None = None  # (step, gradient norm, units) of the last check()

    @property
    def recent_losses(self) -> list[float]:
        """The accepted losses the spike tests compare against (the last `window`)."""
        return self._losses[-self.window:]

    def check(self, step: int, loss: float, grad_norm: float, nonfinite_ranks: list[int],
              units: int | None = None) -> Anomaly | None:
        """The reason to refuse step `step`'s update, or None to apply it; notes the gradient norm and `units` (the
        step's trained tokens, or pairs: what its loss is the mean over) for accept()."""
        self._checked = (step, grad_norm, units)
        if nonfinite_ranks:
            return Anomaly(step, "nonfinite", f"non-finite loss on rank(s) {sorted(nonfinite_ranks)} at step {step}")
        if not math.isfinite(loss):
            return Anomaly(step, "nonfinite", f"non-finite loss {loss} at step {step}")
        if not math.isfinite(grad_norm):
            return Anomaly(step, "nonfinite", f"non-finite gradient norm {grad_norm} at step {step}")
        recent = self.recent_losses
        if self.rule.ratio_test and len(recent) >= min(self.window, MIN_SPIKE_HISTORY):
            median = statistics.median(recent)
            if loss > self.spike_factor * median:
                return Anomaly(step, "spike", f"loss {loss:.4g} at step {step} is above {self.spike_factor} x "
                                              f"the median {median:.4g} of the last {len(recent)} steps")
        return self._against_trend(step, loss, grad_norm, units)

    def _against_trend(self, step: int, loss: float, grad_norm: float, units: int | None) -> Anomaly | None:
        """The outlier test and the ruin test: the loss against where the window's losses were heading."""
        steps, losses = self._steps[-self.window:], self._losses[-self.window:]
        if len(steps) < MIN_SPIKE_HISTORY or self.window < MIN_SPIKE_HISTORY:
            return None
        expected, residuals = theil_sen_at(steps, losses, step)
        spread = self.step_spread(robust_spread(residuals, statistics.median(losses)), units)
        loss_sd = (loss - expected) / spread if spread else (math.inf if loss > expected else 0.0)
        grad_norms = self._grad_norms[-self.window:]
        if (self.rule.outlier_test and len(steps) == self.window and loss_sd > self.loss_sigmas
                and None not in grad_norms):
            median_norm = statistics.median(grad_norms)
            norm_sd = sigmas_above(grad_norm, median_norm, [g - median_norm for g in grad_norms], median_norm)
            if norm_sd > self.grad_norm_sigmas:
                return Anomaly(step, "spike", f"loss {loss:.4g} at step {step} is {loss_sd:.1f} sd above the trend "
                                              f"{expected:.4g} of the last {len(steps)} steps, and the gradient "
                                              f"norm {grad_norm:.4g} is {norm_sd:.1f} sd above those steps' median "
                                              f"{median_norm:.4g}")
        if not spread:  # a window of zeros
            return None
        return self._ruined(step, loss, expected, spread, len(steps), partial=self.partial(units))

    def partial(self, units: int | None) -> bool:
        """Whether a step of `units` trained tokens (pairs) has fewer than PARTIAL_SHARE of the window's median."""
        known = [u for u in self._units[-self.window:] if u]
        return bool(units and known and units < PARTIAL_SHARE * statistics.median(known))

    def step_spread(self, spread: float, units: int | None) -> float:
        """The spread a step of `units` trained tokens (pairs) is judged by: the window's (at least the rule's
        min_spread), times sqrt(the window's median units / units) for a step with fewer, whose mean has that much
        more noise (an epoch's partial last step); the window's own for a step with as many or more, or unknown."""
        spread = max(spread, self.rule.min_spread)
        known = [u for u in self._units[-self.window:] if u]
        if units and known and units < statistics.median(known):
            spread *= math.sqrt(statistics.median(known) / units)
        return spread

    def _ruined(self, step: int, loss: float, expected: float, spread: float, n: int,
                partial: bool = False) -> Anomaly | None:
        """The ruin test: a model that had learned (its trend below ln(V)) back at or past a uniform guess."""
        if self.uniform_loss is None:
            return None
        headroom, k = self.uniform_loss - expected, self.ruin_sigmas  # headroom: what the model had learned
        if headroom <= 0 or loss - expected < k * spread:
            return None
        uniform = self.rule.chance
        trend = f"the trend {expected:.4g} of the last {n} steps"
        sd = (loss - expected) / spread
        if loss - self.uniform_loss >= max(k * spread, self.rule.past_chance_share * abs(self.uniform_loss)):
            past = (loss - self.uniform_loss) / spread
            return Anomaly(step, "spike", f"loss {loss:.4g} at step {step} is {past:.1f} sd above {uniform}, and "
                                          f"{sd:.1f} sd above {trend}")
        if (self.rule.gives_back_test and not partial and headroom >= k * spread
                and loss - expected >= self.share_to_give_back(headroom, spread) * headroom):
            return Anomaly(step, "spike", f"loss {loss:.4g} at step {step} is back near {uniform}: {sd:.1f} sd "
                                          f"above {trend}, it gave back {(loss - expected) / headroom:.0%} of the "
                                          f"{headroom:.3g} that the trend was below it")
        return None

    def learned(self, headroom: float, spread: float) -> float:
        """How clearly a trend `headroom` below ln(V) is learning rather than noise, from 0 to 1: its headroom over
        `learned_sigmas` sd of the window or over `learned_fraction` of ln(V), whichever is less, at most 1 (a bar of
        0 asks nothing)."""
        bars = (self.learned_sigmas * spread, self.learned_fraction * self.uniform_loss)
        return min([1.0] + [headroom / bar for bar in bars if bar > 0])

    def share_to_give_back(self, headroom: float, spread: float) -> float:
        """The share of its headroom a loss must give back to call the model ruined: `lost_fraction` of a headroom
        learned clearly (learned() 1), rising to all of it (back at ln(V)) as what it learned shrinks to nothing."""
        return 1.0 - (1.0 - self.lost_fraction) * self.learned(headroom, spread)

    def accept(self, step: int, loss: float, grad_norm: float | None = None, units: int | None = None) -> None:
        """Record the loss, gradient norm and trained units of a step whose update was applied.

        Without `grad_norm` (`units`), the one check() was given for this step is used (the loop checks each step
        before applying it); a step never checked is recorded without one, and the outlier test waits for a window
        without gaps.
        """
        if self._steps and step <= self._steps[-1]:
            # The loop went back without rewind(): the window would mix two timelines.
            raise ValueError(f"accept({step}) after step {self._steps[-1]}: call rewind() after a rollback")
        if self._checked is not None and self._checked[0] == step:
            grad_norm = self._checked[1] if grad_norm is None else grad_norm
            units = self._checked[2] if units is None else units
        self._steps.append(step)
        self._losses.append(float(loss))
        self._grad_norms.append(None if grad_norm is None else float(grad_norm))
        self._units.append(None if units is None else int(units))
        self._checked = None

    def rewind(self, to_step: int) -> None:
        """Forget the accepted steps after `to_step` (the checkpoint just restored)."""
        keep = bisect.bisect_right(self._steps, to_step)
        del self._steps[keep:], self._losses[keep:], self._grad_norms[keep:], self._units[keep:]
        self._checked = None

    def state_dict(self) -> dict:
        """The window the next decision needs, JSON-serialisable, so a resumed run decides as the uninterrupted one."""
        return {"steps": self._steps[-self.window:], "losses": self.recent_losses,
                "grad_norms": self._grad_norms[-self.window:], "units": self._units[-self.window:]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict, also one written before gradient norms were recorded ({"steps", "losses"}).

        With such a state the outlier test waits until a full window of gradient norms has been accepted again.
        """
        self._steps = [int(s) for s in state["steps"]]
        self._losses = [float(v) for v in state["losses"]]
        grad_norms = state.get("grad_norms", [None] * len(self._steps))
        if len(grad_norms) != len(self._steps):
            raise ValueError(f"guard state has {len(grad_norms)} gradient norms for {len(self._steps)} steps")
        self._grad_norms = [None if g is None else float(g) for g in grad_norms]
        units = state.get("units", [None] * len(self._steps))  # a checkpoint written before units were recorded
        if len(units) != len(self._steps):
            raise ValueError(f"guard state has {len(units)} unit counts for {len(self._steps)} steps")
        self._units = [None if u is None else int(u) for u in units]
        self._checked = None


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
    `rollbacks` counts the rollbacks decided in the run: `state_dict()` goes into every checkpoint (and into the
    re-save of the restored one that makes a rollback durable), `load_state_dict` restores it on resume, so a
    restarted or resumed run counts against --max-rollbacks, and chooses, as the uninterrupted one would.
    """

    def __init__(self, max_rollbacks: int):
        self.max_rollbacks = max_rollbacks
        self.rollbacks = 0
        self._last_anomaly_step: int | None = None
        self._last_target: int | None = None
        self._committed_since_rollback = False
        self._abandoned: set[int] = set()

    def state_dict(self) -> dict:
        """What the next decision depends on, JSON-serialisable."""
        return {"rollbacks": self.rollbacks, "last_anomaly_step": self._last_anomaly_step,
                "last_target": self._last_target, "committed_since_rollback": self._committed_since_rollback,
                "abandoned": sorted(self._abandoned)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict (the limit, --max-rollbacks, stays this run's own); ValueError naming a bad field."""
        abandoned = state.get("abandoned")
        if not isinstance(abandoned, list):
            raise ValueError(f"rollback state: abandoned is {abandoned!r}, not a list of steps")
        self.rollbacks = _a_step("rollbacks", state.get("rollbacks"))
        self._last_anomaly_step = _a_step("last_anomaly_step", state.get("last_anomaly_step"), optional=True)
        self._last_target = _a_step("last_target", state.get("last_target"), optional=True)
        self._committed_since_rollback = state.get("committed_since_rollback") is True
        self._abandoned = {_a_step("abandoned", s) for s in abandoned}

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


def _a_step(key: str, value, optional: bool = False) -> int | None:
    """`value`, a count or step number of a rollback state (None allowed when `optional`); ValueError if not."""
    if value is None and optional:
        return None
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"rollback state: {key} is {value!r}, not a non-negative integer")
    return value


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
