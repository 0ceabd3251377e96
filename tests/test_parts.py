"""The parts' answers before a run (parallel/parts.py) are what the engine it builds does."""

import math

import pytest
from conftest import tiny_config

from zerotrain.parallel.parts import GradientHolding, parts_for
from zerotrain.parallel.replicated import ReplicatedParameters
from zerotrain.parallel.sharded import ShardedParameters
from zerotrain.training.loop import build_engine


def answers_of_engine(engine) -> dict:
    return {"gathers_units": engine.placement.gathers_units, "autograd_grads": engine.grads.grads_in_params,
            "bucketed": engine.grads.bucketed, "state_bytes_per_value": engine.adamw.state_bytes_per_value}


def answers_of_parts(cfg, dp: int) -> dict:
    p = parts_for(cfg)
    return {"gathers_units": p.placement.gathers_units, "autograd_grads": p.gradients.autograd_grads(dp),
            "bucketed": p.gradients.bucketed, "state_bytes_per_value": p.optimizer.state_bytes_per_value}


@pytest.mark.parametrize("zero, precision", [(1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_the_parts_answer_as_the_engine_they_plan_for_builds_and_a_wrong_answer_is_caught(
        one_rank, tmp_path, monkeypatch, zero, precision):
    cfg = tiny_config(tmp_path, zero=zero, precision=precision)
    engine = build_engine(cfg, one_rank)
    assert answers_of_parts(cfg, 1) == answers_of_engine(engine)
    # planted: the plan's gradient holding takes the stage's other way (whole for bucketed, bucketed for whole); its
    # answers disagree with what the engine builds
    holding = GradientHolding.__init__

    def other_way(self, *args, **kwargs):
        holding(self, *args, **kwargs)
        self.bucketed = not self.bucketed

    monkeypatch.setattr(GradientHolding, "__init__", other_way)
    assert answers_of_parts(cfg, 1) != answers_of_engine(build_engine(cfg, one_rank))


def loop_answers(engine) -> dict:
    """What the loop asks the engine it has: whether replicas start from one whole model, whether units are gathered,
    and the norm each of two world ranks computes with when they hold parameters of norms 3 and 4."""
    return {"holds_whole_model": engine.placement.holds_whole_model, "gathers_units": engine.placement.gathers_units,
            "computed_norms": engine.placement.computed_norms([3.0, 4.0], engine.mesh.tp_size)}


def held_at_run_time(engine) -> dict:
    """What the engine's placement holds between steps, measured, in the loop's and the plan's terms: a placement
    that gathers units holds no parameter whole (each is a view of a released bucket), so a rank's norm is its DP
    group's shards' together, and of values it owns half of (one rank of 2) it holds that half."""
    released = all(p.untyped_storage().nbytes() == 0 for p in engine.params)
    return {"holds_whole_model": not released, "gathers_units": released,
            "computed_norms": [5.0, 5.0] if released else [3.0, 4.0], "held of 1000, 500 owned": 500 if released
            else 1000}


def plan_answers(place) -> dict:
    """The same questions, answered by a placement built from the settings alone (parts_for)."""
    return {"holds_whole_model": place.holds_whole_model, "gathers_units": place.gathers_units,
            "computed_norms": place.computed_norms([3.0, 4.0], tp_size=1),
            "held of 1000, 500 owned": place.held(1000, 500)}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_placement_answers_the_plan_and_the_loop_as_it_holds_the_parameters_and_a_wrong_answer_is_caught(
        one_rank, tmp_path, monkeypatch, zero):
    """One class per stage answers before the run (parts_for(cfg).placement) and holds the parameters at run time
    (engine.placement): what it answers the plan and the loop is what it holds, and the plan's bytes are those it
    holds. Planted: the placement's answer on the whole model flipped, then its held values counted as the other
    stage's; the measured run disagrees with each."""
    cfg = tiny_config(tmp_path, zero=zero)
    engine, plan = build_engine(cfg, one_rank), parts_for(cfg).placement
    measured = held_at_run_time(engine)
    assert plan_answers(plan) == measured
    assert loop_answers(engine) == {k: measured[k] for k in loop_answers(engine)}
    L, place = engine.layout, engine.placement
    assert place.held(L.padded_numel, L.shard_numel) * engine.held_params.element_size() == place.param_bytes()
    monkeypatch.setattr(type(place), "holds_whole_model", not place.holds_whole_model)
    planted = build_engine(cfg, one_rank)
    assert plan_answers(parts_for(cfg).placement) != held_at_run_time(planted)
    assert loop_answers(planted) != {k: measured[k] for k in loop_answers(planted)}
    monkeypatch.undo()
    monkeypatch.setattr(type(place), "held", (ReplicatedParameters if zero == 3 else ShardedParameters).held)
    assert plan_answers(parts_for(cfg).placement) != held_at_run_time(build_engine(cfg, one_rank))


def test_a_sharded_rank_reports_the_norm_of_its_dp_groups_model_and_a_replicated_one_its_own():
    # TP 2 x DP 2: world rank d * 2 + t holds (sharded) its DP shard of TP slice t
    held = [3.0, 1.0, 4.0, 2.0]
    sharded = ShardedParameters(1).computed_norms(held, tp_size=2)
    assert sharded == [5.0, math.sqrt(5.0), 5.0, math.sqrt(5.0)]  # slice 0: sqrt(3^2 + 4^2); slice 1: sqrt(1 + 4)
    assert ReplicatedParameters(1).computed_norms(held, tp_size=2) == held
