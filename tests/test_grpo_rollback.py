"""A GRPO run the guard rolls back keeps one timeline in rollouts.jsonl: a NaN planted in step 5's loss is refused,
step 4 restored (its checkpoint) and the replay trains on the next data; the file then holds each step once, in order,
the steps before the rollback as an uninterrupted run wrote them and every later step's records those its metrics
record counts (the rewards' mean). The writer planted without its rewind keeps the abandoned step 5 twice."""

from __future__ import annotations

import json
import os

import pytest
from conftest import world_of_one
from model_folders import llama_folder, write_jsonl

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training import rollouts
from zerotrain.training.loop import train
from zerotrain.training.rollouts import read_rollouts

pytestmark = pytest.mark.timeout(600)
RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(8)]
REWARD = '''
def varied(prompts, completions, completion_ids, **kw):
    return [len(set(ids)) / 6 + (ids[0] % 5) / 4 for ids in completion_ids]
'''
STEPS = 7


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-rollback")
    llama_folder(tmp / "llama")
    (tmp / "reward.py").write_text(REWARD)
    return {"llama": str(tmp / "llama"), "prompts": write_jsonl(tmp / "prompts.jsonl", RECORDS),
            "reward": f"{tmp / 'reward.py'}:varied"}


def run_here(data, out) -> None:
    args = ["train", "--method", "grpo", "--init-from", data["llama"], "--data", data["prompts"], "--reward",
            data["reward"], "--num-generations", "4", "--max-completion-length", "6", "--micro-batch", "8",
            "--steps", str(STEPS), "--ckpt-every", "2", "--threads", "1", "--no-progress", "--out", str(out)]
    try:
        cfg = prepare_run(config_from_args(build_parser().parse_args(args)))
        with world_of_one() as comm:
            train(cfg, comm)
    finally:
        release_run_folders()


def records(out, kind: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if kind in line]


def test_rollouts_of_rolled_back_steps_are_dropped_and_a_writer_that_keeps_them_is_caught(data, tmp_path,
                                                                                         monkeypatch):
    run_here(data, tmp_path / "whole")
    monkeypatch.setenv("ZEROTRAIN_FAULTS", "nan@step=5,rank=0")
    run_here(data, tmp_path / "rolled")
    [event] = records(tmp_path / "rolled", '"event": "rollback"')
    assert (event["step"], event["to_step"]) == (5, 4)
    whole, rolled = (read_rollouts(tmp_path / name / "rollouts.jsonl") for name in ("whole", "rolled"))
    assert [r["step"] for r in rolled] == [s for s in range(1, STEPS + 1) for _ in range(8)]  # each step once
    assert [r for r in rolled if r["step"] <= 4] == [r for r in whole if r["step"] <= 4]
    assert [r for r in rolled if r["step"] > 4] != [r for r in whole if r["step"] > 4]  # the replay's other data
    for step in records(tmp_path / "rolled", '"loss"'):  # each record is the step that trained on it
        mine = [r["reward"] for r in rolled if r["step"] == step["step"]]
        assert abs(sum(mine) / len(mine) - step["reward"]) < 1e-6
    monkeypatch.setattr(rollouts, "drop_steps_after", lambda path, step: None)  # planted: no rewind
    run_here(data, tmp_path / "planted")
    steps = [r["step"] for r in read_rollouts(tmp_path / "planted" / "rollouts.jsonl")]
    assert steps.count(5) == 16 and steps.count(4) == 8, steps  # the refused step 5's records and the replay's
