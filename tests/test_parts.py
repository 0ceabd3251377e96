"""The parts' answers before a run (parallel/parts.py) are what the engine it builds does."""

import math

import pytest
from conftest import tiny_config

from zerotrain.parallel import engine as engine_module
from zerotrain.parallel import parts
from zerotrain.parallel.parts import parts_for
from zerotrain.training.loop import build_engine


def answers_of_engine(engine) -> dict:
    return {"gathers_units": engine.placement.gathers_units, "autograd_grads": engine.grads.grads_in_params,
            "state_bytes_per_value": engine.adamw.state_bytes_per_value}


def answers_of_parts(cfg, dp: int) -> dict:
    p = parts_for(cfg)
    return {"gathers_units": p.placement.gathers_units, "autograd_grads": p.gradients.autograd_grads(dp),
            "state_bytes_per_value": p.optimizer.state_bytes_per_value}


@pytest.mark.parametrize("zero, precision", [(1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_the_parts_answer_as_the_engine_they_plan_for_builds_and_a_wrong_answer_is_caught(
        one_rank, tmp_path, monkeypatch, zero, precision):
    cfg = tiny_config(tmp_path, zero=zero, precision=precision)
    engine = build_engine(cfg, one_rank)
    assert answers_of_parts(cfg, 1) == answers_of_engine(engine)
    # planted: the placement's answer flipped; the engine built from the same settings disagrees
    placement = type(parts_for(cfg).placement)
    monkeypatch.setattr(placement, "gathers_units", not placement.gathers_units)
    assert answers_of_parts(cfg, 1) != answers_of_engine(engine)


def loop_answers(engine) -> dict:
    """What the loop asks the engine it has: whether replicas start from one whole model, whether units are gathered,
    and the norm each of two world ranks computes with when they hold parameters of norms 3 and 4."""
    return {"holds_whole_model": engine.holds_whole_model, "gathers_units": engine.gathers_units,
            "computed_norms": engine.computed_norms([3.0, 4.0])}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_engine_answers_the_loop_with_its_placements_part_and_a_wrong_part_is_caught(
        one_rank, tmp_path, monkeypatch, zero):
    """The runtime engine holds the plan-time part of its placement (parts.py, built from its own settings): its
    answers are the plan's, and what its placement does (a sharded one gathers units, and each rank holds a shard of
    the model its DP group computes with). Planted: the engine's table pairs stage 3's placement with the replicated
    part; its answers then disagree with what its placement does."""
    cfg = tiny_config(tmp_path, zero=zero)
    engine = build_engine(cfg, one_rank)
    sharded = engine.placement.gathers_units
    expected = {"holds_whole_model": not sharded, "gathers_units": sharded,
                "computed_norms": [5.0, 5.0] if sharded else [3.0, 4.0]}
    assert loop_answers(engine) == expected
    plan = parts_for(cfg).placement
    assert (plan.holds_whole_model, plan.gathers_units) == (expected["holds_whole_model"], expected["gathers_units"])
    monkeypatch.setitem(engine_module.PLACEMENTS, 3, (engine_module.ShardedParameters, parts.ReplicatedPlacement))
    planted = build_engine(cfg, one_rank)
    assert (loop_answers(planted) == expected) == (zero < 3)


def test_a_sharded_rank_reports_the_norm_of_its_dp_groups_model_and_a_replicated_one_its_own():
    # TP 2 x DP 2: world rank d * 2 + t holds (sharded) its DP shard of TP slice t
    held = [3.0, 1.0, 4.0, 2.0]
    sharded = parts.ShardedPlacement(1).computed_norms(held, tp_size=2)
    assert sharded == [5.0, math.sqrt(5.0), 5.0, math.sqrt(5.0)]  # slice 0: sqrt(3^2 + 4^2); slice 1: sqrt(1 + 4)
    assert parts.ReplicatedPlacement(1).computed_norms(held, tp_size=2) == held
