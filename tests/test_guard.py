"""The guard: which updates are refused, which checkpoint a rollback restores, and which data it skips."""

import json
import math

import pytest

from zerotrain.errors import ZeroTrainError
from zerotrain.training.guard import (Anomaly, AnomalyDetector, NoCheckpointToRestore, RollbackExhausted,
                                      RollbackPolicy, data_step, skip_after_rollback)


def detector_with(losses, factor=3.0, window=20):
    d = AnomalyDetector(factor, window)
    for i, loss in enumerate(losses, start=1):
        d.accept(i, loss)
    return d


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
