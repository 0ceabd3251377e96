"""The guard: which updates are refused, which checkpoint a rollback restores, and which data it skips."""

import json
import math
import os
import random
import statistics
from unittest import mock

import pytest
from conftest import tiny_config, zerotrain_here

from zerotrain.errors import CheckpointError, ZeroTrainError
from zerotrain.training.guard import (Anomaly, AnomalyDetector, LossRule, NoCheckpointToRestore, RollbackExhausted,
                                      RollbackPolicy, data_step, near_zero_loss_rule, skip_after_rollback,
                                      token_loss_rule)
from zerotrain.training.faults import ENV
from zerotrain.training.loop import train


def detector_with(losses, factor=3.0, window=20, grad_norms=None, **bars):  # bars: also rule=, vocab_size=
    d = AnomalyDetector(factor, window, **bars)
    for i, loss in enumerate(losses, start=1):
        d.accept(i, loss, None if grad_norms is None else grad_norms[i - 1])
    return d


def old_rule(window):
    """The guard before the outlier test: non-finite, or a loss above 3 x the window's median."""
    return AnomalyDetector(3.0, window, loss_sigmas=math.inf)


def without_ruin_test():
    """Planted: the guard before issue 27, whose only test against the trend needs the loss and the gradient norm
    both far out (the outlier test)."""
    return mock.patch.object(AnomalyDetector, "_ruined", lambda self, *args, **kwargs: None)


# --- AnomalyDetector -------------------------------------------------------------------------------------------

def test_a_nonfinite_loss_on_any_rank_refuses_the_step_and_names_the_ranks():
    d = detector_with([2.0] * 10)
    a = d.check(7, 2.0, 1.0, nonfinite_ranks=[3, 1])
    assert a == Anomaly(7, "nonfinite", "non-finite loss on rank(s) [1, 3] at step 7")


@pytest.mark.parametrize("loss, grad_norm, reason", [
    (math.nan, 1.0, "non-finite loss nan at step 7"),
    (math.inf, 1.0, "non-finite loss inf at step 7"),
    (2.0, math.nan, "non-finite gradient norm nan at step 7"),
    (2.0, -math.inf, "non-finite gradient norm -inf at step 7"),
])
def test_a_nonfinite_global_loss_or_gradient_norm_refuses_the_step(loss, grad_norm, reason):
    a = AnomalyDetector(3.0, 20).check(7, loss, grad_norm, [])  # refused even with no history
    assert a.kind == "nonfinite" and a.step == 7 and a.reason == reason


def test_a_loss_above_factor_times_the_window_median_is_a_spike_and_one_at_the_bar_is_not():
    # The window holds only the last 20 accepted losses: the 100.0 of step 1 has left it.
    d = detector_with([100.0] + [2.0] * 10 + [2.41] * 10, factor=3.0, window=20)
    assert d.recent_losses == [2.0] * 10 + [2.41] * 10
    assert d.check(22, 3 * 2.205, 1.0, []) is None  # median 2.205; exactly at the bar is allowed
    a = d.check(22, 9.31, 1.0, [])
    assert a.kind == "spike"
    assert a.reason == "loss 9.31 at step 22 is above 3.0 x the median 2.205 of the last 20 steps"


def test_the_spike_test_waits_for_five_accepted_losses_or_a_smaller_full_window():
    d = detector_with([1.0] * 4, window=20)
    assert d.check(5, 1000.0, 1.0, []) is None  # 4 losses: too few to judge
    d.accept(5, 1.0)
    assert d.check(6, 1000.0, 1.0, []).kind == "spike"
    small = detector_with([1.0] * 3, window=3)  # a window of 3 is full at 3
    assert small.check(4, 1000.0, 1.0, []).kind == "spike"


def test_check_records_nothing_and_equal_inputs_give_equal_decisions():
    # Every rank runs this on the same all-reduced numbers and must refuse the same steps.
    losses = [2.0, 2.2, 1.9, 2.1, 2.05, 2.3, 1.95]
    ranks = [detector_with(losses), detector_with(losses)]
    for step, loss in [(8, 2.0), (9, 7.0), (10, 6.5), (11, math.nan)]:
        decisions = [d.check(step, loss, 1.0, []) for d in ranks]
        assert decisions[0] == decisions[1]
    assert ranks[0].recent_losses == losses


def test_rewind_restores_the_median_the_checkpoint_had_and_skipping_it_misjudges_the_replay():
    # Losses fall to ~1 by step 10; the discarded stretch after the checkpoint rose to ~4.
    history = [1.0] * 10 + [4.0] * 15
    d = detector_with(history, window=20)
    d.rewind(10)
    assert d.recent_losses == [1.0] * 10
    assert d.check(11, 3.5, 1.0, []).kind == "spike"  # judged against the restored model's median 1.0
    # and equal to a fresh process resuming from the checkpoint with the state saved at step 10
    saved = detector_with([1.0] * 10, window=20).state_dict()
    resumed = AnomalyDetector(3.0, 20)
    resumed.load_state_dict(json.loads(json.dumps(saved)))
    assert resumed.check(11, 3.5, 1.0, []) == d.check(11, 3.5, 1.0, [])
    # planted bug: without rewind the discarded losses set the median (4.0) and the spike passes
    assert detector_with(history, window=20).check(11, 3.5, 1.0, []) is None


def test_accepting_an_earlier_step_without_rewinding_is_refused():
    d = detector_with([1.0] * 10)
    with pytest.raises(ValueError, match="rewind"):
        d.accept(8, 1.0)
    d.rewind(7)
    d.accept(8, 1.0)


# --- the outlier test ------------------------------------------------------------------------------------------

# The tiny model on 2 ranks (micro-batch 2, accumulation 2, synthetic data, 14 steps), its update of step 9 made
# with a 1000x learning rate and nothing refused (metrics of `zerotrain train` with --spike-window 4): from step 10
# on the model is ruined and its loss sits near ln(64) = 4.159, the loss of a uniform guess.
RUINED_LOSSES = [4.1842, 4.0774, 4.0283, 3.9973, 3.9379, 3.8853, 3.8637, 3.8462, 3.7863,
                 4.1311, 4.1369, 4.1057, 4.1152, 4.1588]
RUINED_NORMS = [1.275, 1.0291, 1.4815, 1.4179, 1.3681, 1.2722, 1.427, 1.3437, 1.0356,
                3.091, 2.5968, 2.6483, 3.2649, 4.6208]


def first_refusal(detector, losses, norms, start=1):
    """Run the loop's check-then-accept over the steps; the first Anomaly, or None if every step was applied."""
    for step, (loss, norm) in enumerate(zip(losses, norms), start=start):
        anomaly = detector.check(step, loss, norm, [])
        if anomaly:
            return anomaly
        detector.accept(step, loss)
    return None


def test_the_first_step_on_a_model_ruined_by_an_lr_spike_is_refused_and_the_median_ratio_never_refuses_one():
    caught = first_refusal(AnomalyDetector(3.0, 5), RUINED_LOSSES, RUINED_NORMS)
    assert caught.step == 10 and caught.kind == "spike"
    assert caught.reason == ("loss 4.131 at step 10 is 34.4 sd above the trend 3.759 of the last 5 steps, and the "
                             "gradient norm 3.091 is 16.5 sd above those steps' median 1.344")
    # planted: the old rule alone (3 x the median) applies the ruined steps 10-14 and never refuses one
    assert first_refusal(old_rule(5), RUINED_LOSSES, RUINED_NORMS) is None


def test_a_loss_back_at_ln_v_after_a_plateau_is_refused_though_below_3x_the_median_whatever_its_gradient_norm():
    rng = random.Random(0)
    plateau = [2.0 + rng.gauss(0, 0.02) for _ in range(40)]
    norms = [0.8 * math.exp(rng.gauss(0, 0.1)) for _ in range(40)]
    ln_v = math.log(64)
    assert ln_v < 3 * 2.0  # the ratio test can never see it
    d = detector_with(plateau, grad_norms=norms, vocab_size=64)
    assert d.check(41, ln_v, 2.5, []).reason.endswith("2.5 is 30.2 sd above those steps' median 0.7614")  # outlier
    # With an ordinary gradient norm it is the ruin test's: this test used to call that step a hard batch and let it
    # through, the rule that missed issue 27's ruined model (loss back at ln V, gradient norm unremarkable).
    assert d.check(41, ln_v, 0.8, []).reason == (
        "loss 4.159 at step 41 is back near ln(64) = 4.159, the loss of a uniform guess: 80.4 sd above the trend "
        "1.993 of the last 20 steps, it gave back 100% of the 2.17 that the trend was below it")
    planted = detector_with(plateau, grad_norms=norms, loss_sigmas=math.inf)  # neither test
    assert planted.check(41, ln_v, 2.5, []) is None and planted.check(41, ln_v, 0.8, []) is None
    # a hard batch (the loss far above the trend, but not half way back to ln V) or an odd one (a high gradient
    # norm, an ordinary loss) is not damage
    assert d.check(41, 2.9, 0.8, []) is None and d.check(41, 2.0, 5.0, []) is None


def ordinary_run(seed, steps=300):
    """A falling, noisy loss with hard batches (+0.6, ~15 sd, every 37th step) and a heavy-tailed gradient norm
    with odd batches (4x, every 53rd step), never both on one step: what an ordinary run looks like."""
    rng = random.Random(seed)
    losses = [2.2 + 2.0 * math.exp(-t / 40) + rng.gauss(0, 0.04) + (0.6 if t % 37 == 0 else 0.0)
              for t in range(1, steps + 1)]
    norms = [0.7 * math.exp(rng.gauss(0, 0.15)) * (4.0 if t % 53 == 0 else 1.0) for t in range(1, steps + 1)]
    return losses, norms


def refusals(detector, losses, norms, units=None):
    """The steps refused when every other step is applied (no rollback: the run goes on); `units`: each step's
    trained tokens (pairs), or unknown."""
    refused = []
    for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
        if detector.check(step, loss, norm, [], None if units is None else units[step - 1]):
            refused.append(step)
        else:
            detector.accept(step, loss)
    return refused


@pytest.mark.parametrize("seed", range(5))
def test_ordinary_noise_hard_batches_and_odd_gradient_norms_raise_no_alarm_and_either_test_alone_would(seed):
    losses, norms = ordinary_run(seed)
    assert refusals(AnomalyDetector(3.0, 20, vocab_size=97), losses, norms) == []  # ln(97) = 4.57, above every loss
    # planted: the loss test without the gradient norm's corroboration refuses every hard batch, and the
    # gradient-norm test alone, even at the loss's bar, every odd one (both some noisy steps besides)
    hard, odd = {t for t in range(21, 301) if t % 37 == 0}, {t for t in range(21, 301) if t % 53 == 0}
    assert hard <= set(refusals(AnomalyDetector(3.0, 20, grad_norm_sigmas=-math.inf), losses, norms))
    assert odd <= set(refusals(AnomalyDetector(3.0, 20, loss_sigmas=-math.inf, grad_norm_sigmas=9.0), losses, norms))


def test_the_outlier_test_waits_for_a_full_window_of_at_least_five_steps():
    losses, norms = [2.0, 2.01, 1.99, 2.0] * 10, [0.8, 0.82, 0.79, 0.81] * 10
    ruined = (4.16, 2.5)  # 2.08 x the median: only the outlier test can refuse it
    assert detector_with(losses[:19], grad_norms=norms[:19]).check(20, *ruined, []) is None  # 19 of 20: warming up
    assert detector_with(losses[:20], grad_norms=norms[:20]).check(21, *ruined, []).kind == "spike"
    assert detector_with(losses[:5], window=5, grad_norms=norms[:5]).check(6, *ruined, []).kind == "spike"
    assert detector_with(losses, window=4, grad_norms=norms).check(41, *ruined, []) is None  # off below 5
    # after a rollback the window refills from the restored step
    d = detector_with(losses, grad_norms=norms)
    d.rewind(15)
    assert d.check(16, *ruined, []) is None
    for step in range(16, 21):
        d.accept(step, 2.0, 0.8)
    assert d.check(21, *ruined, []).kind == "spike"


def test_the_ruin_test_needs_five_accepted_steps_and_a_window_of_five_but_not_a_full_window():
    losses, norms = [2.0, 2.01, 1.99, 2.0] * 10, [0.8, 0.82, 0.79, 0.81] * 10
    back = (math.log(64), 0.8)  # back at ln(64), an ordinary gradient norm: only the ruin test can refuse it
    assert detector_with(losses[:4], grad_norms=norms[:4], vocab_size=64).check(5, *back, []) is None
    five = detector_with(losses[:5], grad_norms=norms[:5], vocab_size=64)
    assert "back near ln(64)" in five.check(6, *back, []).reason
    assert detector_with(losses, window=4, grad_norms=norms, vocab_size=64).check(41, *back, []) is None  # off below 5
    assert detector_with(losses, grad_norms=norms).check(41, *back, []) is None  # no vocabulary: off
    # it does not ask for gradient norms: a state restored without them is judged at once
    old = AnomalyDetector(3.0, 20, vocab_size=64)
    old.load_state_dict({"steps": list(range(1, 21)), "losses": losses[:20]})
    assert old.check(21, *back, []).kind == "spike"


def test_the_ruin_test_asks_the_model_to_have_learned_and_the_loss_to_give_half_of_it_back():
    rng = random.Random(1)
    losses = [4.5 + rng.gauss(0, 0.03) for _ in range(20)]  # the trend 0.072 below ln(97) = 4.575: 3.5 sd
    ln_v = math.log(97)
    # too little learned to call a rise to ln V a return to it (the other tests judge it alone), or one 4.9 sd past it
    few = detector_with(losses, grad_norms=[1.0] * 20, vocab_size=97)
    assert few.check(21, ln_v, 1.0, []) is None and few.check(21, ln_v + 0.1, 1.0, []) is None
    # 7 sd past ln V, though, a model that had learned anything is worse than a uniform guess: refused
    assert few.check(21, ln_v + 0.15, 1.0, []).reason == (
        "loss 4.725 at step 21 is 7.4 sd above ln(97) = 4.575, the loss of a uniform guess, and 10.9 sd above the "
        "trend 4.503 of the last 20 steps")
    learned = [3.0 + rng.gauss(0, 0.01) for _ in range(20)]
    d = detector_with(learned, grad_norms=[1.0] * 20, vocab_size=97)
    assert d.check(21, 3.0 + 0.45 * (ln_v - 3.0), 1.0, []) is None  # gave back 45%: a hard batch
    assert d.check(21, 3.0 + 0.55 * (ln_v - 3.0), 1.0, []).kind == "spike"  # 55%: more than half
    assert detector_with(learned, grad_norms=[1.0] * 20, vocab_size=97, lost_fraction=0.6).check(
        21, 3.0 + 0.55 * (ln_v - 3.0), 1.0, []) is None


def test_accept_takes_the_gradient_norm_check_was_given_for_the_step():
    d = detector_with([2.0] * 20, grad_norms=[0.8] * 20)
    assert d.check(21, 2.0, 0.9, []) is None
    d.accept(21, 2.0)  # as the loop calls it
    d.accept(22, 2.0)  # never checked: recorded without a norm, and the outlier test waits for a window without gaps
    assert d.state_dict()["grad_norms"][-2:] == [0.9, None]
    assert d.check(23, 4.16, 2.5, []) is None
    for step in range(23, 43):
        d.accept(step, 2.0 + 0.01 * (step % 3), 0.8 + 0.01 * (step % 2))
    assert d.check(43, 4.16, 2.5, []).kind == "spike"


def test_a_resumed_detector_decides_as_the_uninterrupted_one_and_an_old_checkpoints_state_still_loads():
    losses, norms = ordinary_run(0, steps=60)
    uninterrupted = detector_with(losses, grad_norms=norms)
    saved = json.loads(json.dumps(uninterrupted.state_dict()))
    assert len(saved["steps"]) == len(saved["losses"]) == len(saved["grad_norms"]) == 20
    resumed = AnomalyDetector(3.0, 20)
    resumed.load_state_dict(saved)
    later = [(61, 2.3, 0.7), (62, 4.16, 2.8), (62, 2.9, 0.7), (62, 2.3, 3.0)]  # ordinary, ruined, hard, odd
    decisions = [d.check(*s, []) for d in (uninterrupted, resumed) for s in later]
    assert decisions[:4] == decisions[4:] and decisions[1].kind == "spike"
    # the state a checkpoint of the current version holds ({"steps", "losses"}) loads: the ratio test applies
    # at once, the outlier test once a full window of gradient norms has been accepted again
    old = AnomalyDetector(3.0, 20)
    old.load_state_dict({"steps": saved["steps"], "losses": saved["losses"]})
    assert old.check(61, 9.5, 0.7, []).kind == "spike" and old.check(62, 4.16, 2.8, []) is None  # planted: misses
    first_refusal(old, losses[:20], norms[:20], start=61)
    assert old.check(81, 4.16, 2.8, []).kind == "spike"
    with pytest.raises(ValueError, match="2 gradient norms for 3 steps"):
        AnomalyDetector(3.0, 20).load_state_dict({"steps": [1, 2, 3], "losses": [2.0] * 3, "grad_norms": [1.0] * 2})


# --- recorded runs of several shapes -------------------------------------------------------------------------

# Real runs recorded by `zerotrain bench spikes --spike-nproc 2,1` (bench/spikes.py: the guard out of the way, the
# (step, loss, gradient norm) the guard sees, rounded to 6 decimals): "ordinary" holds seed 0 of each of its shapes,
# 300 steps on 1 rank; "ruined" runs on 2 ranks whose rank 0 updated its half of the model at step N with a 1000x
# learning rate, to step N + 5. Shapes: GPT-2 2 x 40 (V = 97) and 4 x 64 (V = 2048), Llama 2 x 32 (V = 64) on
# synthetic data, the bench preset (GPT-2 4 x 128, V = 256) on python-stdlib.
with open(os.path.join(os.path.dirname(__file__), "guard_traces.json")) as f:
    TRACES = json.load(f)


def replayed(trace, window, **bars):
    """The steps the guard refuses over a recorded trace, each not accepted (the run goes on)."""
    steps = trace["steps"]
    detector = AnomalyDetector(3.0, window, vocab_size=trace["vocab_size"], **bars)
    return refusals(detector, [s[1] for s in steps], [s[2] for s in steps])


def first_refused(trace, window, **bars):
    """The first Anomaly of a recorded trace, as the loop meets it."""
    steps = trace["steps"]
    detector = AnomalyDetector(3.0, window, vocab_size=trace["vocab_size"], **bars)
    return first_refusal(detector, [s[1] for s in steps], [s[2] for s in steps])


RUINED_IDS = [f"{t['shape']}-step{t['spike'][0]}" for t in TRACES["ruined"]]


@pytest.mark.parametrize("trace", TRACES["ruined"], ids=RUINED_IDS)
def test_the_first_step_on_a_model_a_1000x_lr_spike_sent_to_ln_v_is_refused_at_every_shape_by_the_ruin_test_alone(
        trace):
    spike = trace["spike"][0]
    assert all(a.step == spike + 1 for a in (first_refused(trace, 20), first_refused(trace, 20, loss_sigmas=math.inf)))
    reason = first_refused(trace, 20, loss_sigmas=math.inf).reason  # without the outlier test
    assert f"ln({trace['vocab_size']}) = {math.log(trace['vocab_size']):.4g}, the loss of a uniform guess" in reason


def test_the_guard_before_issue_27_trains_on_three_of_those_ruined_models():
    # planted: the ruin test gone, the guard is the rule that missed issue 27's model: within the first 20 steps
    # it has no test against the trend, and after them it needs the gradient norm far out too
    with without_ruin_test():
        missed = [name for name, t in zip(RUINED_IDS, TRACES["ruined"]) if first_refused(t, 20) is None]
    assert missed == ["llama-tiny-v64-step9", "gpt2-4x64-v2048-step9", "bench-v256-step9"]


@pytest.mark.parametrize("shape", TRACES["ordinary"])
def test_ordinary_runs_raise_no_alarm_at_the_default_window_and_the_ruin_test_none_at_any(shape):
    trace = TRACES["ordinary"][shape]
    assert replayed(trace, 20) == []
    for window in (5, 10, 20):  # the outlier test's false alarms at short windows are its own (see LOSS_SIGMAS)
        assert replayed(trace, window, loss_sigmas=math.inf) == []
    # planted: with a tenth of the headroom as the bar, ordinary hard batches are called ruined
    assert len(replayed(trace, 5, loss_sigmas=math.inf, lost_fraction=0.1)) >= 40


def test_the_ruin_test_calls_no_first_step_ruined_and_would_without_its_sd_bars():
    trace = TRACES["ordinary"]["gpt2-2x40-v97"]  # its first 6 losses: 4.580 4.558 4.575 4.575 4.573 4.575
    assert replayed(trace, 20, loss_sigmas=math.inf) == []
    # planted: without the bars, step 6 gives back 94% of a headroom of 0.003 (ln(97) = 4.575), by noise
    no_bars = dict(ruin_sigmas=0.0, learned_sigmas=0.0, learned_fraction=0.0)
    assert first_refused(trace, 20, loss_sigmas=math.inf, **no_bars).reason == (
        "loss 4.575 at step 6 is back near ln(97) = 4.575, the loss of a uniform guess: 0.6 sd above the trend 4.572 "
        "of the last 5 steps, it gave back 94% of the 0.00291 that the trend was below it")


# --- the default configuration's first steps (issue 37) -----------------------------------------------------------

# Real runs written by scripts/guard_healthy_traces.py (bench/spikes.py's record_healthy: `zerotrain train` with the
# guard out of the way, one rank at --accum 2, the global batch of --nproc 2): the first 300 steps of three shapes on
# python-stdlib (V = 256), the default configuration (GPT-2 2 x 32) among them, each from scratch on a 100,000-step
# schedule (warmup 10,000: the learning rate stays below 3% of --lr), on a 1,000,000-step one (long warmup), and
# fine-tuned (--init-from its own checkpoint after 1,000 steps). Losses to 4 decimals, gradient norms to 3.
with open(os.path.join(os.path.dirname(__file__), "guard_healthy_traces.json")) as f:
    HEALTHY = json.load(f)
TRIALS_RUN = "default-v256-scratch-seed0"  # `zerotrain train --nproc 2 --steps 100000 --ckpt-every 1000`, issue 37


def healthy_refusals(name, window, **bars):
    """The steps the guard refuses in a default-configuration trace, each not accepted (the run goes on)."""
    trace = HEALTHY["traces"][name]
    return refusals(AnomalyDetector(3.0, window, vocab_size=HEALTHY["vocab_size"], **bars),
                    trace["losses"], trace["grad_norms"])


def issue_27_ruin_test():
    """Planted: the ruin test before issue 37, which took half of any headroom above 5 sd back for ruin."""
    return mock.patch.object(AnomalyDetector, "learned", lambda self, headroom, spread: 1.0)


# At --spike-window 5 the ruin test alone refuses one step in each of two of these runs (a 5-step trend is a rough
# guess: 54% back of 0.409 and 77% of 0.212), the outlier test some more (see LOSS_SIGMAS).
RUIN_AT_WINDOW_5 = {"default-4x64-v256-scratch-seed0": [58], "default-4x64-v256-long-warmup-seed0": [78]}


@pytest.mark.parametrize("name", HEALTHY["traces"])
def test_the_default_configurations_first_steps_raise_no_alarm_at_the_default_window_nor_the_ruin_test_at_10(name):
    assert healthy_refusals(name, 20) == []
    for window in (10, 20):
        assert healthy_refusals(name, window, loss_sigmas=math.inf) == []
    assert healthy_refusals(name, 5, loss_sigmas=math.inf) == RUIN_AT_WINDOW_5.get(name, [])


def test_the_ruin_test_of_issue_27_stopped_the_trials_run_at_step_78_and_others_of_these_runs():
    trace = HEALTHY["traces"][TRIALS_RUN]
    with issue_27_ruin_test():
        # the trial's message (5.7 sd there, from the losses' full precision)
        assert first_refusal(AnomalyDetector(3.0, 20, vocab_size=256), trace["losses"], trace["grad_norms"]).reason == (
            "loss 5.483 at step 78 is back near ln(256) = 5.545, the loss of a uniform guess: 5.6 sd above the trend "
            "5.378 of the last 20 steps, it gave back 63% of the 0.167 that the trend was below it")
        alarmed = {w: [name for name in HEALTHY["traces"] if healthy_refusals(name, w, loss_sigmas=math.inf)]
                   for w in (5, 10, 20)}
    assert {w: len(names) for w, names in alarmed.items()} == {5: 16, 10: 9, 20: 5}  # of the 21 runs
    assert alarmed[20] == [TRIALS_RUN, "default-llama-v256-scratch-seed2", "default-llama-v256-scratch-seed3",
                           "default-4x64-v256-scratch-seed3", "default-v256-long-warmup-seed0"]


def test_a_model_that_learned_less_than_its_noise_may_have_hard_batches_but_not_come_back_to_ln_v():
    rng = random.Random(3)
    ln_v = math.log(256)
    early = [ln_v - 0.17 + rng.gauss(0, 0.01) for _ in range(20)]  # 3% of ln(V) learned, about 17 sd
    d = detector_with(early, grad_norms=[1.0] * 20, vocab_size=256)
    trend = statistics.median(early)
    assert d.share_to_give_back(ln_v - trend, 0.01) > 0.8
    assert d.check(21, trend + 0.65 * (ln_v - trend), 1.0, []) is None  # a hard batch, the trial's step 78
    assert "back near ln(256)" in d.check(21, ln_v, 1.0, []).reason  # all of it back: ruined
    with issue_27_ruin_test():  # planted: half of any headroom above 5 sd was enough
        assert d.check(21, trend + 0.65 * (ln_v - trend), 1.0, []).kind == "spike"
    # a model that learned a tenth of ln(V) and 10 sd gives back half: ruined, as before
    learned = detector_with([ln_v - 0.6 + rng.gauss(0, 0.02) for _ in range(20)], grad_norms=[1.0] * 20,
                            vocab_size=256)
    assert learned.share_to_give_back(0.6, 0.02) == 0.5
    assert learned.check(21, ln_v - 0.25, 1.0, []).kind == "spike" and learned.check(21, ln_v - 0.35, 1.0, []) is None


# --- held-out --method sft runs ------------------------------------------------------------------------------------

# Written by scripts/guard_heldout_sft_traces.py, held out: runs the constants above never saw (those were set on
# guard_healthy_traces.json, python-stdlib from seed 0): other seeds, the tiny GPT-2 on synthetic data, a Llama of
# --preset llama-tiny's shape on records of varying length (36-100 trained tokens a step), and the tests' tiny random
# Llama (V = 400) fine-tuned from its weights at lr 2e-5 (its loss moves 0.05 in 100 steps, within noise of ln(V))
# and 1e-3; 100 steps each, with each step's trained tokens.
with open(os.path.join(os.path.dirname(__file__), "guard_heldout_sft_traces.json")) as f:
    HELD_OUT_SFT = json.load(f)


def held_out_sft_refusals(name, window=20, **bars):
    trace = HELD_OUT_SFT["traces"][name]
    return refusals(AnomalyDetector(3.0, window, vocab_size=trace["vocab_size"], **bars), trace["losses"],
                    trace["grad_norms"], trace["tokens"])


@pytest.mark.parametrize("name", HELD_OUT_SFT["traces"])
def test_held_out_healthy_sft_runs_raise_no_alarm_at_the_default_window_nor_at_10(name):
    assert HELD_OUT_SFT["held_out"]
    assert held_out_sft_refusals(name) == held_out_sft_refusals(name, 10) == []


def test_a_fine_tuning_lr_keeps_the_loss_within_noise_of_ln_v_and_the_ruin_test_without_its_sd_bars_refuses_it():
    # planted: the ruin test's bars gone (any rise gives back headroom measured in noise); the partial-step share,
    # the step's units and the rule before the outlier test (3 x the median) refuse none of these runs
    no_bars = dict(ruin_sigmas=0.0, learned_sigmas=0.0, learned_fraction=0.0)
    alarmed = [name for name in HELD_OUT_SFT["traces"] if held_out_sft_refusals(name, **no_bars)]
    assert alarmed == ["llama-v400-init-from-lr2e-05-seed1", "llama-v400-init-from-lr2e-05-seed2"]


# --- RollbackPolicy --------------------------------------------------------------------------------------------

def anomaly(step):
    return Anomaly(step, "spike", f"loss 9 at step {step} is above 3.0 x the median 2 of the last 20 steps")


def test_a_rollback_restores_the_newest_committed_checkpoint_before_the_anomaly():
    p = RollbackPolicy(max_rollbacks=3)
    assert p.decide(anomaly(17), [5, 10, 15, 20]) == 15
    assert p.rollbacks == 1
    p.note_commit(20)
    assert p.decide(anomaly(20), [5, 10, 15, 20]) == 15  # step 20's own update was refused: not a candidate


def test_an_anomaly_right_after_a_rollback_goes_one_checkpoint_further_back():
    p = RollbackPolicy(max_rollbacks=5)
    assert p.decide(anomaly(17), [5, 10, 15]) == 15
    assert p.came_back(anomaly(18))  # the first step past the old anomaly still counts as right after
    assert p.decide(anomaly(16), [5, 10, 15]) == 10
    assert p.decide(anomaly(12), [5, 10, 15]) == 5  # and again: the chain keeps going back
    # planted bug: judged without the previous rollback (a fresh policy), it would restore 10 forever
    assert RollbackPolicy(5).decide(anomaly(12), [5, 10, 15]) == 10


def test_progress_past_the_old_anomaly_or_a_new_commit_means_a_plain_rollback():
    p = RollbackPolicy(max_rollbacks=5)
    assert p.decide(anomaly(17), [5, 10]) == 10
    assert not p.came_back(anomaly(19))  # got two steps past the old anomaly: a new problem
    assert p.decide(anomaly(19), [5, 10]) == 10
    p.note_commit(15)
    assert not p.came_back(anomaly(16))  # progress was saved since the rollback
    assert p.decide(anomaly(16), [5, 10, 15]) == 15


def test_checkpoints_of_the_abandoned_timeline_are_not_restored_until_committed_again():
    p = RollbackPolicy(max_rollbacks=5)
    assert p.decide(anomaly(17), [5, 10, 15]) == 15
    assert p.decide(anomaly(16), [5, 10, 15]) == 10  # 15 now holds discarded updates
    # a later anomaly at 17 that is not right after (the run got to 19 first, no new commit)
    assert p.decide(anomaly(19), [5, 10, 15]) == 10
    p.note_commit(15)  # the new timeline saved step 15 again
    assert p.decide(anomaly(19), [5, 10, 15]) == 15


def test_rollbacks_past_the_limit_stop_the_run_with_a_one_line_error():
    p = RollbackPolicy(max_rollbacks=2)
    p.decide(anomaly(17), [10])
    p.decide(anomaly(30), [10])
    with pytest.raises(RollbackExhausted) as e:
        p.decide(anomaly(40), [10])
    assert str(e.value) == ("loss 9 at step 40 is above 3.0 x the median 2 of the last 20 steps: "
                            "it would need rollback 3, more than --max-rollbacks 2 allows")
    assert isinstance(e.value, ZeroTrainError) and p.rollbacks == 2
    with pytest.raises(RollbackExhausted, match="--max-rollbacks 0"):
        RollbackPolicy(0).decide(anomaly(17), [10])


def test_no_committed_checkpoint_before_the_anomaly_is_a_one_line_error_naming_the_flags():
    with pytest.raises(NoCheckpointToRestore) as e:
        RollbackPolicy(3).decide(Anomaly(7, "nonfinite", "non-finite gradient norm nan at step 7"), [10])
    assert str(e.value) == ("non-finite gradient norm nan at step 7: no committed checkpoint precedes step 7 "
                            "to roll back to; save checkpoints with --ckpt-every or --ckpt-every-minutes")
    p = RollbackPolicy(3)
    p.decide(anomaly(7), [5])
    with pytest.raises(NoCheckpointToRestore, match="came back right after the rollback to step 5"):
        p.decide(anomaly(6), [5])
    assert issubclass(NoCheckpointToRestore, ZeroTrainError)


def test_a_restored_policy_counts_and_chooses_as_the_one_that_saved_its_state_and_a_fresh_one_does_not():
    """A resumed or restarted run restores the policy from its checkpoint (JSON): it refuses the rollback past
    --max-rollbacks, goes further back when the anomaly comes back, and skips the abandoned checkpoints, as the
    policy that wrote the state; planted: a fresh policy (the state not restored) does none of these."""
    p = RollbackPolicy(max_rollbacks=2)
    assert p.decide(anomaly(17), [5, 10, 15]) == 15
    assert p.decide(anomaly(16), [5, 10, 15]) == 10  # came back: 15 is abandoned
    state = json.loads(json.dumps(p.state_dict()))
    assert state == {"rollbacks": 2, "last_anomaly_step": 16, "last_target": 10, "committed_since_rollback": False,
                     "abandoned": [15]}
    restored, fresh = RollbackPolicy(max_rollbacks=3), RollbackPolicy(max_rollbacks=3)
    restored.load_state_dict(state)
    assert restored.rollbacks == 2 and restored.came_back(anomaly(12)) and not fresh.came_back(anomaly(12))
    assert restored.decide(anomaly(12), [5, 10, 15]) == 5 and fresh.decide(anomaly(12), [5, 10, 15]) == 10
    restored.load_state_dict(state)
    assert restored.decide(anomaly(19), [5, 10, 15]) == 10  # not after 15, abandoned ...
    assert RollbackPolicy(3).decide(anomaly(19), [5, 10, 15]) == 15  # ... which a fresh policy restores
    # the limit is the resuming run's own: at --max-rollbacks 2 the third rollback of the run is refused
    at_limit = RollbackPolicy(max_rollbacks=2)
    at_limit.load_state_dict(state)
    with pytest.raises(RollbackExhausted, match="it would need rollback 3, more than --max-rollbacks 2"):
        at_limit.decide(anomaly(30), [5, 10, 15, 20])
    assert RollbackPolicy(max_rollbacks=2).decide(anomaly(30), [5, 10, 15, 20]) == 20
    for bad, field in (({**state, "rollbacks": -1}, "rollbacks is -1"), ({**state, "abandoned": None}, "abandoned"),
                       ({**state, "last_target": "10"}, "last_target is '10'"), ({}, "abandoned")):
        with pytest.raises(ValueError, match=f"rollback state: {field}"):
            RollbackPolicy(3).load_state_dict(bad)


def test_a_resumed_run_counts_the_rollbacks_its_checkpoint_records_and_an_edited_record_is_one_line(
        tmp_path, one_rank, monkeypatch):
    """One rank in this process: a NaN at step 3 rolls back once (--max-rollbacks 1); `--resume auto` from step 4
    meets a NaN at step 5 and stops, the run's second rollback refused. Planted: the state not read on resume
    (load_state_dict a no-op), the count starts again and the resumed run rolls back; an edited state fails in one
    line naming the manifest."""
    first = tiny_config(tmp_path, steps=4, ckpt_every=2, max_rollbacks=1)
    monkeypatch.setenv(ENV, "nan@step=3")
    assert [e["to_step"] for e in train(first, one_rank).rollbacks] == [2]
    resumed = tiny_config(tmp_path, steps=6, ckpt_every=2, max_rollbacks=1, resume="auto")
    monkeypatch.setenv(ENV, "nan@step=5")
    with pytest.raises(RollbackExhausted, match="it would need rollback 2, more than --max-rollbacks 1 allows"):
        train(resumed, one_rank)
    with mock.patch.object(RollbackPolicy, "load_state_dict", lambda self, state: None):
        assert [e["rollback"] for e in train(resumed, one_rank).rollbacks] == [1]  # planted: counted from 0
    manifest = os.path.join(tmp_path, "checkpoints", "step_00000006", "manifest.json")
    with open(manifest) as f:
        edited = json.load(f)
    edited["rollback"]["rollbacks"] = -1
    with open(manifest, "w") as f:
        json.dump(edited, f)
    with pytest.raises(CheckpointError) as e:
        train(tiny_config(tmp_path, steps=8, ckpt_every=2, resume="auto"), one_rank)
    assert str(e.value) == f"{manifest}: rollback state: rollbacks is -1, not a non-negative integer"


def test_a_rollback_past_the_resumed_step_restores_the_guard_window_the_checkpoint_had(tmp_path, one_rank,
                                                                                       monkeypatch):
    """One rank in this process, --spike-window 5: NaNs at steps 9 and 10 roll back to step 8, then (the anomaly came
    back) to step 6. Run whole, and resumed from step 8 of an 8-step run (whose manifest holds only the window before
    it): the second rollback restores the window step 6 had, steps 2-6, in both, as its re-save records. Planted: the
    detector rewound in memory (the run's history), which after a resume no longer reaches back past step 8's
    window: steps 4-6."""
    from zerotrain.training.guard import AnomalyDetector

    def guard_at_6(name, resume_at_8):
        cfg = dict(ckpt_every=2, spike_window=5, max_rollbacks=3)
        if resume_at_8:
            train(tiny_config(tmp_path / name, steps=8, **cfg), one_rank)
        monkeypatch.setenv(ENV, "nan@step=9;nan@step=10")
        rollbacks = train(tiny_config(tmp_path / name, steps=10, resume="auto" if resume_at_8 else "", **cfg),
                          one_rank).rollbacks
        monkeypatch.delenv(ENV)
        assert [e["to_step"] for e in rollbacks] == [8, 6]
        with open(os.path.join(tmp_path, name, "checkpoints", "step_00000006", "manifest.json")) as f:
            return json.load(f)["guard"]["steps"]

    assert guard_at_6("whole", False) == guard_at_6("resumed", True) == [2, 3, 4, 5, 6]
    real_load = AnomalyDetector.load_state_dict
    calls = []

    def rewind_instead(self, state):  # planted: a rollback rewinds the run's history, as before
        calls.append(len(calls))
        if len(calls) == 1:  # the resume's own load
            return real_load(self, state)
        self.rewind(state["steps"][-1])

    monkeypatch.setattr(AnomalyDetector, "load_state_dict", rewind_instead)
    assert guard_at_6("planted", True) == [4, 5, 6]


# --- skipped data ----------------------------------------------------------------------------------------------

def test_after_a_rollback_the_next_update_trains_on_the_batch_after_the_bad_one():
    skips = skip_after_rollback([], restored_step=10, anomaly_step=17)
    assert skips == [[10, 7]]
    assert [data_step(s, skips) for s in (8, 9, 10, 11)] == [8, 9, 17, 18]  # data 10..16 never again
    assert json.loads(json.dumps(skips)) == skips


def test_two_rollbacks_compose_and_no_data_step_is_trained_twice():
    skips = skip_after_rollback([], 10, 17)  # index 16 had data 16
    skips = skip_after_rollback(skips, 20, 25)  # index 24 had data 31
    assert skips == [[10, 7], [20, 5]]  # index 20 would have had data 27
    assert data_step(20, skips) == 32
    skips = skip_after_rollback(skips, 15, 21)  # further back, past the first pair: index 20 had data 32
    assert skips == [[10, 7], [15, 11]]  # index 15 would have had data 22
    assert data_step(15, skips) == 33
    steps = [data_step(s, skips) for s in range(40)]
    assert steps == sorted(set(steps))  # strictly increasing along the timeline


def test_a_second_rollback_to_the_same_checkpoint_uses_the_current_skips_not_the_checkpoints():
    first = skip_after_rollback([], 10, 17)  # checkpoint 10 was written before this, with skips []
    assert data_step(18, first) == 25  # index 18 (step 19) trained on data 25 and was refused
    again = skip_after_rollback(first, 10, 19)
    assert again == [[10, 16]] and data_step(10, again) == 26
    # planted bug: the restored checkpoint's own (empty) list replays data 19..25, the bad batch 25 included
    wrong = skip_after_rollback([], 10, 19)
    assert data_step(10, wrong) == 19 and 25 in [data_step(s, wrong) for s in range(10, 20)]


def test_a_rollback_must_restore_a_step_before_the_refused_one():
    with pytest.raises(ValueError, match="must come before"):
        skip_after_rollback([], 17, 17)


# --- through the CLI -------------------------------------------------------------------------------------------

# Issue 27's run: GPT-2 with 2 layers, 2 heads, width 40 and a vocabulary of 97, lr 1e-3, on 2 ranks.
ISSUE_27 = ["--nproc", "2", "--n-layer", "2", "--n-head", "2", "--n-embd", "40", "--vocab-size", "97", "--lr", "1e-3",
            "--micro-batch", "2", "--accum", "2", "--no-progress", "--data", "synthetic", "--steps", "14",
            "--ckpt-every", "2"]


def train_with_lr_spike(capfd, out, *flags):
    """`zerotrain train` of issue 27's model whose update of step 9 on rank 0 (its half of the model) uses a 1000x
    learning rate; its metrics."""
    r = zerotrain_here(capfd, "train", *ISSUE_27, "--out", out, *flags, faults="lr_spike@step=9,factor=1000")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.timeout(300)
def test_a_1000x_lr_spike_that_sends_the_model_back_to_ln_v_is_rolled_back_by_the_cli_and_the_two_bar_rule_trains_on(
        tmp_path, capfd):
    guarded = train_with_lr_spike(capfd, str(tmp_path / "guarded"), "--spike-window", "5")
    (rollback,) = [r for r in guarded if r.get("event") == "rollback"]  # and no false alarm before or after it
    assert rollback["step"] == 10 and rollback["to_step"] == 8 and rollback["skipped_data_steps"] == [9, 10]
    assert "is back near ln(97) = 4.575, the loss of a uniform guess" in rollback["reason"]
    # The same run with a window of 4 (the trend tests off, the 3 x median test on): the ruined model's steps are
    # applied and logged; replayed through the detector they get the decision the CLI made, word for word
    unguarded = train_with_lr_spike(capfd, str(tmp_path / "unguarded"), "--spike-window", "4")
    assert not [r for r in unguarded if r.get("event")]
    steps = [r for r in unguarded if "event" not in r]
    losses, norms = [r["loss"] for r in steps], [r["grad_norm"] for r in steps]
    assert all(abs(loss - math.log(97)) < 0.05 for loss in losses[9:])  # ruined: it stays at ln(97)
    assert max(norms[9:]) < 2 * max(norms[:9])  # with gradient norms no larger than ordinary ones
    assert first_refusal(AnomalyDetector(3.0, 5, vocab_size=97), losses, norms).reason == rollback["reason"]
    assert first_refusal(AnomalyDetector(3.0, 20, vocab_size=97), losses, norms).step == 10  # the default window too
    # planted: the guard before issue 27 (3 x the median, or the loss and the gradient norm both far out) applies
    # every ruined step, at either window
    with without_ruin_test():
        assert [first_refusal(AnomalyDetector(3.0, w, vocab_size=97), losses, norms) for w in (5, 20)] == [None] * 2
    final = [r["loss"] for r in guarded if "event" not in r][-1]
    assert final < min(losses[9:]) - 0.1  # the rolled-back run learns on; the ruined one does not


# --- a loss that falls to 0: DPO ----------------------------------------------------------------------------------

def test_the_method_declares_its_rule_and_dpos_chance_loss_is_its_loss_at_margin_0():
    from zerotrain.training.objectives import TokenObjective
    from zerotrain.training.preference import Preference

    cfg = tiny_config("/tmp", vocab_size=97)
    assert TokenObjective(cfg).loss_rule() == token_loss_rule(97)
    chances = {}
    for loss in ("sigmoid", "hinge", "ipo", "simpo", "orpo"):
        cfg.objective.dpo_loss = loss
        rule = Preference(cfg).loss_rule()
        assert not (rule.ratio_test or rule.outlier_test or rule.gives_back_test)
        chances[loss] = round(rule.chance_loss, 4)
    # ln 2; 1; (1 / (2 beta))^2 at beta 0.1; softplus(gamma 0.5); ln(97) + beta ln 2 (a uniform guess's NLL)
    assert chances == {"sigmoid": 0.6931, "hinge": 1.0, "ipo": 25.0, "simpo": 0.9741, "orpo": 4.644}


@pytest.fixture(scope="module")
def dpo_base(tmp_path_factory):
    from model_folders import CHATML, llama_folder, write_jsonl
    from test_dpo import PLAIN

    tmp = tmp_path_factory.mktemp("guard-dpo")
    llama_folder(tmp / "base", template=CHATML)
    return {"base": str(tmp / "base"), "plain": write_jsonl(tmp / "plain.jsonl", PLAIN)}


def dpo_run(out, data, one_rank, loss, steps=60, **over):
    """`train` of --method dpo on the tiny Llama and the DPO tests' eight pairs (constant lr, the default guard):
    the run's losses and its rollback events."""
    from test_dpo import dpo_config

    cfg = dpo_config(str(out), data, steps=steps, dpo_loss=loss, **over)
    result = train(cfg, one_rank)
    with open(cfg.logging.metrics) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "event" not in r and "loss" in r]
    return losses, result.rollbacks


# Runs that the rule before it stopped (no checkpoints: the run died): hinge at its first positive loss after a
# window of exact zeros, sigmoid at a hard pair 3.7x the median of a loss near 0
DPO_RUNS = {"hinge": (dict(micro=4, lr=3e-3), "loss 0.00658 at step 40 is above 3.0 x the median 0 of the last 20"),
            "sigmoid": (dict(micro=1, lr=3e-2), "loss 0.05673 at step 37 is above 3.0 x the median 0.01532 of the")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss", DPO_RUNS)
def test_dpo_runs_to_a_loss_near_0_raise_no_alarm_and_the_token_losss_rule_stops_them(loss, dpo_base, tmp_path,
                                                                                        one_rank):
    from zerotrain.training.preference import Preference

    settings, stopped = DPO_RUNS[loss]
    losses, rollbacks = dpo_run(tmp_path / "run", dpo_base, one_rank, loss, **settings)
    assert len(losses) == 60 and rollbacks == []
    assert max(losses[-10:]) < 0.02 and statistics.median(losses[-20:]) < 0.01  # near 0 (hinge: exactly, mostly)
    # planted: the method's rule is the token loss's (the guard before it: one rule for every method)
    with mock.patch.object(Preference, "loss_rule", lambda self: token_loss_rule(self.cfg.model.vocab_size)):
        with pytest.raises(NoCheckpointToRestore, match=stopped):
            dpo_run(tmp_path / "planted", dpo_base, one_rank, loss, **settings)


@pytest.mark.timeout(300)
def test_a_dpo_loss_blown_up_by_an_lr_spike_or_a_nan_is_refused_and_rolled_back(dpo_base, tmp_path, one_rank,
                                                                                 monkeypatch):
    settings = dict(micro=4, lr=3e-3, ckpt_every=10)
    monkeypatch.setenv(ENV, "lr_spike@step=30,factor=1000")
    losses, rollbacks = dpo_run(tmp_path / "spike", dpo_base, one_rank, "sigmoid", steps=32, **settings)
    assert rollbacks[0]["step"] == 31 and rollbacks[0]["reason"].startswith(
        "loss 14.65 at step 31 is 851.2 sd above 0.6931, the sigmoid loss of a policy that learned nothing")
    monkeypatch.setenv(ENV, "nan@step=30")
    _, rollbacks = dpo_run(tmp_path / "nan", dpo_base, one_rank, "hinge", steps=32, **settings)
    assert [(r["step"], r["to_step"]) for r in rollbacks] == [(30, 20)] and "non-finite" in rollbacks[0]["reason"]
    # planted: the bar past the chance loss gone, the blown-up policy's steps are applied
    monkeypatch.setenv(ENV, "lr_spike@step=30,factor=1000")
    with mock.patch.object(AnomalyDetector, "_ruined", lambda self, *args, **kwargs: None):
        losses, rollbacks = dpo_run(tmp_path / "planted", dpo_base, one_rank, "sigmoid", steps=32, **settings)
    assert rollbacks == [] and losses[30] > 10


def test_a_near_zero_loss_is_judged_in_its_own_units_and_a_ratio_to_its_median_would_refuse_its_noise():
    hinge = near_zero_loss_rule(1.0, "1, the hinge loss of a policy that learned nothing")
    zeros = detector_with([0.0] * 20, grad_norms=[0.0] * 20, rule=hinge)
    assert zeros.check(21, 0.3, 0.5, []) is None and zeros.check(21, 1.04, 0.5, []) is None  # a hard batch
    assert zeros.check(21, 3.88, 9.0, []).reason == (
        "loss 3.88 at step 21 is 288.0 sd above 1, the hinge loss of a policy that learned nothing, and 388.0 sd "
        "above the trend 0 of the last 20 steps")
    # a sigmoid run near 0 with a hard pair: 0.2225 against a median of 0.044 (5x) is noise, 15 is a blow-up
    rng = random.Random(0)
    near = [0.044 * math.exp(rng.gauss(0, 0.5)) for _ in range(20)]
    sigmoid = near_zero_loss_rule(math.log(2), "ln 2")
    assert detector_with(near, rule=sigmoid).check(21, 0.2225, 1.0, []) is None
    assert detector_with(near, rule=sigmoid).check(21, 15.0, 1.0, []).kind == "spike"
    assert detector_with(near, vocab_size=400).check(21, 0.2225, 1.0, []).kind == "spike"  # planted: the token rule
    # a loss around 0 that changes sign (the seam a GRPO rule uses: no chance bar, the spread in its own units)
    centered = LossRule(None, "", ratio_test=False, outlier_test=False, gives_back_test=False, min_spread=0.01)
    signed = detector_with([0.05 * math.sin(t) for t in range(20)], rule=centered)
    assert signed.check(21, -0.2, 1.0, []) is None and signed.check(21, 0.3, 1.0, []) is None


# --- a step weighed by its trained tokens ---------------------------------------------------------------------------

def test_an_epochs_partial_last_step_is_judged_by_its_own_noise_and_unweighed_it_was_called_ruined():
    # A small random model near ln(300) = 5.704, full steps of 80-260 trained tokens; the epoch's last step has 4
    # short records, 37 tokens, whose mean is sqrt(170 / 37) = 2.1x as noisy and mostly of records' first tokens
    rng = random.Random(5)
    losses = [5.02 - 0.002 * t + rng.gauss(0, 0.02) for t in range(1, 21)]
    units = [rng.randrange(80, 261) for _ in range(20)]
    d = AnomalyDetector(3.0, 20, vocab_size=300)
    for step, (loss, n) in enumerate(zip(losses, units), start=1):
        d.accept(step, loss, 1.0, n)
    assert d.check(21, 5.347, 1.0, [], units=37) is None
    assert d.check(21, 5.90, 1.0, [], units=37).kind == "spike"  # past ln(V) by 5 sd of its own noise: ruined
    assert d.check(21, 5.347, 1.0, [], units=120).kind == "spike"  # a full step so far back: ruined
    # planted: the step weighed as a full one (no unit count), the rule before: refused as a return to ln(V)
    planted = d.check(21, 5.347, 1.0, [])
    assert planted.kind == "spike" and "back near ln(300) = 5.704" in planted.reason
    # the unit counts travel with the window: a resumed detector weighs as the uninterrupted one
    resumed = AnomalyDetector(3.0, 20, vocab_size=300)
    resumed.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert resumed.check(21, 5.347, 1.0, [], units=37) is None
    # the state a checkpoint of the previous version holds (no "units") loads: its steps' counts are unknown, so the
    # step is weighed as that version weighed it until a window with counts has been accepted again
    previous = AnomalyDetector(3.0, 20, vocab_size=300)
    previous.load_state_dict({k: v for k, v in d.state_dict().items() if k != "units"})
    assert previous.check(21, 5.347, 1.0, [], units=37).kind == "spike"
    with pytest.raises(ValueError, match="2 unit counts for 20 steps"):
        AnomalyDetector(3.0, 20).load_state_dict({**d.state_dict(), "units": [1, 2]})


# --- held-out DPO runs ----------------------------------------------------------------------------------------------

# Written by scripts/guard_dpo_traces.py, its whole grid: the sigmoid, hinge and ipo losses x clean or label-noised
# pairs (15% of 32 flipped) x 1-4 pairs a step at lr 3e-3 to 3e-2 x seeds 1 and 2, 60 steps each: 48 runs, none of
# which the DPO rule's constants were set on.
with open(os.path.join(os.path.dirname(__file__), "guard_dpo_traces.json")) as f:
    DPO_TRACES = json.load(f)["traces"]


def dpo_refusals(name, rule_of):
    trace = DPO_TRACES[name]
    loss = name.split("-")[0]
    return refusals(AnomalyDetector(3.0, 20, rule=rule_of(loss)), trace["losses"], trace["grad_norms"])


def dpo_rule(loss):
    from zerotrain.training.preference import Preference

    cfg = tiny_config("/tmp", method="dpo", dpo_loss=loss, vocab_size=400)
    return Preference(cfg).loss_rule()


# Held out, the rule refuses healthy steps of 3 of the 48 runs, all on label-noised pairs at 1 or 2 pairs a step: a
# flipped pair the policy had learned the other way is a step's whole loss, past the chance loss by more than half of
# it (hinge 2.851 at step 58, chance 1; ipo 42.06 to 70.78, chance 25). Known false alarms, not fixed: strict, so a
# rule that stops raising them shows here.
DPO_FALSE_ALARMS = {"hinge-noisy-pairs1-lr0.01-seed1": [58], "ipo-noisy-pairs1-lr0.01-seed1": [54, 58],
                    "ipo-noisy-pairs2-lr0.03-seed2": [23, 27, 29]}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"refuses steps {DPO_FALSE_ALARMS[name]}"))
    if name in DPO_FALSE_ALARMS else name for name in DPO_TRACES])
def test_held_out_healthy_dpo_runs_raise_no_alarm(name):
    assert dpo_refusals(name, dpo_rule) == []


def test_the_held_out_dpo_runs_false_alarms_are_the_ones_stated():
    assert {name: dpo_refusals(name, dpo_rule) for name in DPO_FALSE_ALARMS} == DPO_FALSE_ALARMS


def test_the_token_losss_rule_raises_an_alarm_in_a_third_of_the_held_out_dpo_runs():
    # planted: the method's rule is the token loss's (3 x the median of a loss near 0, its outlier and ruin tests)
    planted = [name for name in DPO_TRACES if dpo_refusals(name, lambda loss: token_loss_rule(400))]
    assert (len(planted), len(DPO_TRACES)) == (16, 48)
    assert sum(name.startswith("ipo") for name in planted) == 10  # of 16 ipo runs


# --- the guard at the log steps (--log-every): the steps between are judged at the next one -----------------------

def log_every_run(out, one_rank, **over):
    """A 15-step run of the tiny model reading the device every 5 steps, saving every 10: its step records, rollback
    events and result."""
    cfg = tiny_config(out, steps=15, micro=4, log_every=5, ckpt_every=10, **over)
    result = train(cfg, one_rank)
    with open(cfg.logging.metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "event" not in r], [r for r in rows if r.get("event") == "rollback"], result


def test_a_nan_between_log_steps_is_judged_at_the_next_one_rolled_back_and_a_skipped_judgement_is_caught(
        tmp_path, one_rank, monkeypatch):
    from zerotrain.training import loop

    monkeypatch.setenv(ENV, "nan@step=12")  # step 12's update is applied before the host reads its loss (at 15)
    records, rollbacks, result = log_every_run(tmp_path / "guarded", one_rank)
    # refused as step 12, back to step 10, the data of the discarded steps 11-14 skipped (step 15 had not begun)
    assert [(r["step"], r["to_step"], r["skipped_data_steps"]) for r in rollbacks] == [(12, 10, [11, 14])]
    assert "non-finite" in rollbacks[0]["reason"]
    assert [r["step"] for r in records] == list(range(1, 16))  # one record a step, the replayed ones once
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert all(math.isfinite(n) for n in result.param_norms)
    # planted: the steps between log steps never judged (their values dropped unread): step 15 is refused instead,
    # from a model the NaN had already ruined, and the unread steps have no records
    monkeypatch.setattr(loop, "_judge_unread", lambda cfg, run, comm: run.unread.clear())
    records, rollbacks, _ = log_every_run(tmp_path / "planted", one_rank)
    assert [r["step"] for r in rollbacks] != [12]
    assert [r["step"] for r in records] != list(range(1, 16))
