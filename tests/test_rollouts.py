"""GRPO's rollout records (training/rollouts.py): one line per completion with its ids (cut after the first EOS, which
stays; a record keeping what follows is caught), text, scores by reward function (None as null), reward and advantage;
a resume drops the records of steps after it and a line a crash cut short (a resume that kept them is caught). One
step end to end on a tiny model: sampled, scored by exact_answer, advantages, written."""

from __future__ import annotations

import json

import pytest
import torch
from model_folders import family_folder

import zerotrain
from zerotrain.model.generate import sample_completions
from zerotrain.training import grpo_loss, rollouts
from zerotrain.training.rewards import exact_answer, reward_weights, score, weighted_reward
from zerotrain.training.rollouts import FILE, RolloutWriter, read_rollouts, rollout_records

EOS = 2


def records(step: int) -> list[dict]:
    per_function = torch.tensor([[1.0, float("nan")], [0.0, 0.5], [float("nan"), float("nan")]])
    return rollout_records(step, [[1, 5]] * 3, [[7, EOS, EOS, EOS], [8, 9], [EOS]], ["a", "b", ""],
                           ["exact_answer", "short"], per_function, torch.tensor([1.0, 0.5, float("nan")]),
                           torch.tensor([0.7, -0.7, 0.0]), stop_ids=[EOS])


def test_a_record_holds_the_completion_cut_after_its_eos_and_nones_as_null_and_one_past_the_eos_is_caught(
        tmp_path, monkeypatch):
    writer = RolloutWriter(str(tmp_path / FILE))
    writer.write(records(1))
    writer.close()
    lines = (tmp_path / FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "prompt_ids": [1, 5], "completion_ids": [7, EOS], "text": "a",
         "rewards": {"exact_answer": 1.0, "short": None}, "reward": 1.0, "advantage": pytest.approx(0.7)},
        {"step": 1, "prompt_ids": [1, 5], "completion_ids": [8, 9], "text": "b",
         "rewards": {"exact_answer": 0.0, "short": 0.5}, "reward": 0.5, "advantage": pytest.approx(-0.7)},
        {"step": 1, "prompt_ids": [1, 5], "completion_ids": [EOS], "text": "",
         "rewards": {"exact_answer": None, "short": None}, "reward": None, "advantage": 0.0}]
    assert "NaN" not in (tmp_path / FILE).read_text()
    monkeypatch.setattr(rollouts, "until_stop", lambda ids, stop_ids: (ids, False))  # planted: nothing cut
    assert records(1)[0]["completion_ids"] != [7, EOS]


def test_a_resume_drops_later_steps_and_a_torn_line_and_a_resume_that_keeps_them_is_caught(tmp_path, monkeypatch):
    path = str(tmp_path / FILE)
    writer = RolloutWriter(path)
    for step in (1, 2, 3):
        writer.write(records(step))
    writer.close()
    with open(path, "a") as f:
        f.write('{"step": 4, "prompt_ids": [1, ')  # a crash mid-write
    assert [r["step"] for r in read_rollouts(path)] == [1] * 3 + [2] * 3 + [3] * 3
    RolloutWriter(path, start=2).close()  # resumed from step 2's checkpoint
    assert [r["step"] for r in read_rollouts(path)] == [1] * 3 + [2] * 3
    writer = RolloutWriter(path, start=2)
    writer.write(records(3))
    writer.close()
    assert [r["step"] for r in read_rollouts(path)] == [1] * 3 + [2] * 3 + [3] * 3
    assert all(line.endswith("}") for line in open(path).read().splitlines())
    RolloutWriter(str(tmp_path / "inactive" / FILE), active=False).write(records(1))  # off rank 0: nothing
    assert not (tmp_path / "inactive").exists()
    monkeypatch.setattr(rollouts, "drop_steps_after", lambda path, step: None)  # planted: the resume drops nothing
    RolloutWriter(path, start=1).close()
    assert [r["step"] for r in read_rollouts(path)][-1] == 3


def test_one_step_sampled_scored_and_written(tmp_path):
    """Two prompts x G = 4 sampled completions on a tiny Llama, scored by exact_answer against answers its completions'
    last numbers give half of the time (planted by the record's answer), advantages by group, written."""
    folder = tmp_path / "llama"
    family_folder(folder, "llama")
    model = zerotrain.load_model(str(folder))
    G = 4
    prompts = [[1, 10, 11, 12], [1, 20, 21]]
    completions = sample_completions(model, prompts, G, 6, temperature=1.0,
                                     generator=torch.Generator().manual_seed(0), stop_ids=[EOS])
    texts = [" ".join(map(str, c)) for c in completions]
    answers = [str(c[-1]) if i % 2 == 0 else "-1" for i, c in enumerate(completions)]  # right for every other
    per_function = score([exact_answer], [str(p) for p in prompts for _ in range(G)], texts, completions,
                         columns={"answer": answers})
    rewards = weighted_reward(per_function, reward_weights(None, 1))
    advantages, _ = grpo_loss.group_advantages(rewards, G, "group")
    writer = RolloutWriter(str(tmp_path / FILE))
    writer.write(rollout_records(1, [p for p in prompts for _ in range(G)], completions, texts, ["exact_answer"],
                                 per_function, rewards, advantages, stop_ids=[EOS]))
    writer.close()
    got = read_rollouts(str(tmp_path / FILE))
    assert [r["completion_ids"] for r in got] == completions
    assert [r["reward"] for r in got] == [1.0, 0.0] * 4
    assert [r["advantage"] > 0 for r in got] == [True, False] * 4
    assert sum(r["advantage"] for r in got[:G]) == pytest.approx(0, abs=1e-6)
