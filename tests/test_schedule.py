"""The learning-rate schedules: warmup, then cosine, linear, constant or warmup-stable-decay, each at its landmarks."""

from __future__ import annotations

import math

import pytest

from zerotrain.config import OptimConfig
from zerotrain.training.schedule import lr_at


def curve(schedule: str, steps: int = 110, **settings) -> list[float]:
    optim = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, lr_schedule=schedule, **settings)
    return [lr_at(step, optim, steps) for step in range(steps)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    lrs = curve(schedule)
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[10] == 1.0


def test_cosine_and_linear_decay_to_the_floor_by_their_own_shapes():
    cosine, linear = curve("cosine"), curve("linear")
    # 100 steps after warmup: halfway is step 60, the last update (step 109) is at progress 0.99
    assert cosine[60] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert linear[60] == pytest.approx(1.0 - 0.9 * 0.5)
    assert linear[35] == pytest.approx(1.0 - 0.9 * 0.25) and cosine[35] > linear[35]  # cosine holds longer early
    assert cosine[109] == pytest.approx(0.1, abs=3e-4) and linear[109] == pytest.approx(0.1 + 0.9 * 0.01)


def test_constant_holds_the_peak_after_warmup():
    assert set(curve("constant")[10:]) == {1.0}


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly_over_its_share_of_the_steps():
    lrs = curve("wsd", lr_decay_ratio=0.2)
    assert set(lrs[10:91]) == {1.0}  # progress up to 0.8: stable
    assert lrs[95] == pytest.approx(1.0 - 0.9 * 0.25)  # progress 0.85: a quarter through the decay
    assert lrs[109] == pytest.approx(1.0 - 0.9 * 0.95)
    assert curve("wsd", lr_decay_ratio=1.0)[10:] == pytest.approx(curve("linear")[10:])  # all decay: linear
    assert set(curve("wsd", lr_decay_ratio=0.0)[10:]) == {1.0}  # no decay: constant


def test_an_unknown_schedule_is_refused_in_one_line(capsys):
    from zerotrain.cli.main import main

    assert main(["train", "--lr-schedule", "cosine2", "--data", "synthetic", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lr-schedule must be cosine, linear, constant or wsd" in err, err
