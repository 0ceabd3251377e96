"""Full fine-tuning's live DPO reference (--dpo-reference live without --lora-rank): a frozen copy of the initial
policy, laid out like it, scores each micro-batch; it gives the precomputed reference's losses at ZeRO-1 on 2 ranks
and at TP 2, validates held-out pairs against the same copy, is built again from the base at a resume (bitwise), and
the memory plan counts it. Planted: a "copy" that aliases the policy, a copy built from the resumed weights, a plan
that leaves the copy out.

Kept short for CI: one start of 2 ranks runs the four runs and the planted one (3 steps each); the resumes and the
plan's check run in this process, on one rank."""

from __future__ import annotations

import functools
import json
import os
import shutil

import dpo_jobs
import pytest
from conftest import world_of_one, zerotrain_here
from dist_jobs import in_turn_job
from model_folders import CHATML, llama_folder, write_jsonl
from safetensors.torch import load_file, save_file
from test_dpo import HELD, LIMIT, LN2, PLAIN, SEQ, dpo_config, rel

from zerotrain.errors import ConfigError
from zerotrain.model import param_count
from zerotrain.runtime.launch import run_job
from zerotrain.training import memory_plan as plan_module
from zerotrain.training import reference_model
from zerotrain.training.invariants import InvariantError
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny random Llama with a ChatML template, the pairs and the held-out pairs as JSON Lines."""
    tmp = tmp_path_factory.mktemp("dpo-live-data")
    llama_folder(tmp / "base", template=CHATML)
    return {"base": str(tmp / "base"), "plain": write_jsonl(tmp / "plain.jsonl", PLAIN),
            "held": write_jsonl(tmp / "held.jsonl", HELD)}


@pytest.fixture(scope="module")
def group():
    with world_of_one() as comm:
        yield comm


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    """8 pairs a step, 3 steps, the held-out pairs validated at the last, on 2 ranks (one start): ZeRO-1 and ZeRO-3
    x 2 x accum 2 and TP 2 x 4 x accum 2, each with the precomputed and the live reference; and the planted copy that
    aliases the policy."""
    tmp = tmp_path_factory.mktemp("dpo-live")

    def config(name, **over):
        return dpo_config(tmp / name, data, **{"steps": STEPS, "nproc": 2, "eval_every": STEPS,
                                               "val_data": data["held"], **over})

    zero1, zero3, tp2 = {"micro": 2, "accum": 2}, {"micro": 2, "accum": 2, "zero": 3}, {"tp": 2, "micro": 4, "accum": 2}
    runs = {"precomputed ZeRO-1": (dpo_jobs.dpo_job, config("pre-z1", **zero1)),
            "live ZeRO-1": (dpo_jobs.dpo_job, config("live-z1", dpo_reference="live", **zero1)),
            "precomputed ZeRO-3": (dpo_jobs.dpo_job, config("pre-z3", **zero3)),
            "live ZeRO-3": (dpo_jobs.dpo_job, config("live-z3", dpo_reference="live", **zero3)),
            "precomputed TP 2": (dpo_jobs.dpo_job, config("pre-tp2", **tp2)),
            "live TP 2": (dpo_jobs.dpo_job, config("live-tp2", dpo_reference="live", **tp2)),
            "aliased": (dpo_jobs.dpo_reference_aliases_policy_job, config("aliased", dpo_reference="live", **zero1))}
    jobs = list(runs.values())
    results = run_job(functools.partial(in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    return dict(zip(runs, results))


def test_live_reference_equals_the_precomputed_one_at_zero1_zero3_and_tp2_and_a_copy_aliasing_the_policy_is_caught(
        two_ranks):
    for split in ("ZeRO-1", "ZeRO-3", "TP 2"):
        pre, live = two_ranks[f"precomputed {split}"], two_ranks[f"live {split}"]
        assert len(live["losses"]) == STEPS and live["losses"][0] == LN2, (split, live["losses"])
        assert live["losses"][-1] < LN2 - 1e-3  # the policy moved away from its reference
        assert rel(live["losses"], pre["losses"]) <= 1e-6, (split, live["losses"], pre["losses"])
        for key in ("rewards_margins", "logps_chosen", "logps_rejected"):
            assert max(abs(a - b) for a, b in zip(live[key], pre[key])) <= 1e-5, (split, key)
        # the held-out pairs are validated against the same copy: the precomputed reference's held-out rows' figures
        assert len(live["val_loss"]) == 1 and rel(live["val_loss"], pre["val_loss"]) <= 1e-6, split
        assert abs(live["val_rewards_margins"][0] - pre["val_rewards_margins"][0]) <= 1e-5
    # the copy is laid out like the policy: whole at ZeRO-1, at ZeRO-3 each rank's shard (the runs checked these rows
    # against the bytes they held after step 1)
    z1, z3 = two_ranks["live ZeRO-1"]["plan_rows"], two_ranks["live ZeRO-3"]["plan_rows"]
    assert z3["reference_model"] == z3["parameters"] < z1["reference_model"] * 0.6
    assert z1["reference"] == 0 and two_ranks["precomputed ZeRO-1"]["plan_rows"]["reference_model"] == 0
    # planted: the "copy" is the policy: ln 2 at step 1 (the policy is the reference there), then ln 2 for ever
    aliased, pre = two_ranks["aliased"]["losses"], two_ranks["precomputed ZeRO-1"]["losses"]
    assert aliased[0] == pre[0] == LN2
    assert all(abs(a - b) > 1e-4 for a, b in zip(aliased[1:], pre[1:])), (aliased, pre)


def live_config(tmp, data, **over):
    return dpo_config(tmp, data, **{"steps": STEPS, "dpo_reference": "live", **over})


@pytest.fixture(scope="module")
def whole(data, group, tmp_path_factory):
    """A live-reference run of 3 steps on one rank that saves step 2 (what the resumes continue)."""
    result = train(live_config(tmp_path_factory.mktemp("whole"), data, ckpt_every=2), group)
    return {"losses": [r["loss"] for r in result.records], "digests": result.digests,
            "checkpoints": result.checkpoints, "plan": result.plan}


def test_a_live_reference_run_resumes_bitwise_from_the_base_and_a_copy_of_the_resumed_weights_is_caught(
        whole, data, group, tmp_path, monkeypatch):
    step2 = whole["checkpoints"][0]
    assert step2.endswith("step_00000002")

    def resumed(name):
        result = train(live_config(tmp_path / name, data, resume=step2), group)
        return [r["loss"] for r in result.records], result.digests

    losses, digests = resumed("resumed")
    assert losses == whole["losses"][2:] and digests == whole["digests"]
    real = reference_model.frozen_copy

    def of_the_resumed_weights(cfg, engine):  # planted: the copy taken from the checkpoint's trained policy
        copy = real(cfg, engine)
        copy.model.load_state_dict(engine.model.state_dict())
        return copy

    monkeypatch.setattr(reference_model, "frozen_copy", of_the_resumed_weights)
    assert abs(resumed("copied at the resume")[0][0] - losses[0]) > 1e-4


def test_a_live_reference_run_resumed_with_another_base_is_refused(whole, data, group, tmp_path):
    other = tmp_path / "other-base"  # planted: the base's final norm moved by 1e-3
    shutil.copytree(data["base"], other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    other_data = {**data, "base": str(other)}
    with pytest.raises(ConfigError, match="is not the base the reference of .* was scored on"):
        train(live_config(tmp_path / "refused", other_data, resume=whole["checkpoints"][0]), group)


def test_the_plan_counts_the_copy_and_a_plan_without_it_is_caught(whole, data, group, tmp_path, monkeypatch, capfd):
    rows = whole["plan"]["rows"]  # the run checked them against what it held after step 1 (strict under the tests)
    precomputed = plan_module.memory_plan(dpo_config(tmp_path / "pre", data))
    assert rows["reference"] == 0 and precomputed.rows["reference"] == 16 * len(PLAIN)
    assert rows["reference_model"] == 4 * param_count(live_config(tmp_path / "live", data).model)  # fp32, unpadded
    assert precomputed.rows["reference_model"] == 0
    # planted: the plan leaves the copy out; the run's check after step 1 stops it
    monkeypatch.setattr(plan_module, "reference_model_bytes", lambda *args: 0)
    with pytest.raises(InvariantError, match="reference model"):
        train(live_config(tmp_path / "unplanned", data, steps=1), group)
    monkeypatch.undo()
    # `zerotrain plan` says what each reference holds: the live copy against the precomputed 16 bytes a pair
    argv = ("plan", "--method", "dpo", "--init-from", data["base"], "--data", data["plain"], "--seq-len", str(SEQ),
            "--dpo-reference", "live")
    done = zerotrain_here(capfd, *argv, "--json")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)["dpo_reference"]
    assert said["mode"] == "live" and said["reference_model"] == rows["reference_model"] and said["reference"] == 0
    assert said["other"] == {"mode": "precomputed", "reference": 16 * len(PLAIN), "reference_model": 0,
                             "total": said["total"] - rows["reference_model"] + 16 * len(PLAIN)}
    table = zerotrain_here(capfd, *argv).stdout
    assert "reference model (DPO live, full FT)" in table and "--dpo-reference precomputed would hold" in table
