"""The memory plan of --method grpo counts what a GRPO rank holds beyond SFT's rows: the reference copy (--grpo-beta >
0 in full fine-tuning) and the KV cache while it samples.

The reference copy: a run checks its plan after step 1 (strict under the test suite), the copy's bytes, as the
objective holds them, against the plan's row, at 1 rank and at 2 ranks ZeRO-3 (its shard); the copy hidden from the
check (the objective's held_state planted empty) fails it in one line. The KV cache: the largest cache the sampler
fills in a step (every KVCache the run makes, its keys and values measured) equals the plan's row when the longest
prompt and --max-completion-length fill --seq-len, and the sampling batches planted one per prompt (G rows, not the
rank's completions) are caught."""

from __future__ import annotations

import pytest
import torch
from conftest import world_of_one
from model_folders import llama_folder, write_jsonl

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.model import generate
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training import grpo, memory_plan
from zerotrain.training.loop import train
from zerotrain.training.memory_plan import InvariantError

pytestmark = pytest.mark.timeout(600)
G, L = 4, 6
# 10 tokens each with the tokenizer's BOS: 10 + L = 16 = --seq-len
RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(4)]
REWARD = '''
def varied(prompts, completions, completion_ids, **kw):
    return [len(set(ids)) / 6 + (ids[0] % 5) / 4 for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-plan")
    llama_folder(tmp / "llama")
    (tmp / "reward.py").write_text(REWARD)
    return {"llama": str(tmp / "llama"), "prompts": write_jsonl(tmp / "prompts.jsonl", RECORDS),
            "reward": f"{tmp / 'reward.py'}:varied"}


def argv(data, out, beta: float, *more: str) -> list[str]:
    return ["train", "--method", "grpo", "--init-from", data["llama"], "--data", data["prompts"], "--reward",
            data["reward"], "--num-generations", str(G), "--max-completion-length", str(L), "--seq-len", "16",
            "--grpo-beta", str(beta), "--steps", "1", "--threads", "1", "--no-progress", "--out", str(out),
            "--micro-batch", "4", "--accum", "2", *more]


def run_here(args: list[str]):
    """`zerotrain ARGS` at 1 rank in this process (the plan checked after step 1, strictly); its config."""
    try:
        cfg = prepare_run(config_from_args(build_parser().parse_args(args)))
        with world_of_one() as comm:
            train(cfg, comm)
        return cfg
    finally:
        release_run_folders()


def test_the_reference_copy_is_planned_as_held_and_a_copy_hidden_from_the_check_is_caught(data, tmp_path,
                                                                                          monkeypatch):
    cfg = run_here(argv(data, tmp_path / "beta", 0.04))  # the check passes: measured = planned
    planned = memory_plan.memory_plan(cfg).rows["reference_model"]
    assert planned == 41_120 * 4  # the tiny Llama's parameters in fp32, once
    assert memory_plan.memory_plan(config_from_args(build_parser().parse_args(
        argv(data, tmp_path / "none", 0.0)))).rows["reference_model"] == 0
    # at 2 ranks ZeRO-3 the copy is sharded as the policy (checked in the run)
    assert main(argv(data, tmp_path / "zero3", 0.04, "--nproc", "2", "--zero", "3", "--accum", "1")) == 0
    release_run_folders()
    monkeypatch.setattr(grpo.GroupRelative, "held_state", lambda self: {})  # planted: the copy not reported
    with pytest.raises(InvariantError, match=f"holds 0 bytes of reference model, the plan {planned:,}"):
        run_here(argv(data, tmp_path / "hidden", 0.04))


def largest_cache(monkeypatch) -> list[int]:
    """Every KVCache the sampler makes from now on, its keys' and values' bytes, recorded."""
    made = []

    class Measured(generate.KVCache):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size())

    monkeypatch.setattr(generate, "KVCache", Measured)
    return made


def test_the_kv_cache_is_planned_as_the_sampler_fills_it_and_a_batch_per_prompt_is_caught(data, tmp_path,
                                                                                         monkeypatch):
    made = largest_cache(monkeypatch)
    cfg = run_here(argv(data, tmp_path / "run", 0.0))
    plan = memory_plan.memory_plan(cfg)
    # 2 layers x keys and values x 8 rows (the rank's 2 prompts of one length) x 2 KV heads x 16 positions x 8 x 4
    assert max(made) == plan.rows["kv_cache"] == 2 * 2 * 8 * 2 * 16 * 8 * 4
    assert plan.total == sum(v for k, v in plan.rows.items() if k != "kv_cache")  # smaller than the activations
    real = grpo.sample_completions

    def one_prompt_a_batch(model, prompts, *a, generator=None, **kw):  # planted
        return [c for i, p in enumerate(prompts) for c in real(model, [p], *a, generator=[generator[i]], **kw)]

    monkeypatch.setattr(grpo, "sample_completions", one_prompt_a_batch)
    made.clear()
    run_here(argv(data, tmp_path / "planted", 0.0))
    assert max(made) == plan.rows["kv_cache"] // 2
