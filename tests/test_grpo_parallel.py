"""--method grpo with tensor and expert parallelism: the completions are sampled on the training ranks (TP: every rank
of a TP group draws the same tokens; EP: every rank of an expert group runs the same forwards), and step 1's
completions, loss, grad norm and weights at --tp 2 (a tiny Llama) and at --ep 2 (a tiny Qwen3-MoE) equal the 1-rank
run's within 1e-5, on the same global batch of completions.

Planted in the product's functions on the ranks: a TP group's copies of its rollouts counted as more completions (the
loss and weights are off); TP rank 1 sampling with another seed (refused in one line, on every rank); prompts seeded
by their place on the rank (the EP run's completions are not the 1-rank run's)."""

from __future__ import annotations

import functools
import json
import os

import dist_jobs
import grpo_parallel_jobs as jobs
import pytest
import torch
from conftest import world_of_one
from model_folders import VOCAB, llama_folder, moe_folder, tokenizer_folder, write_jsonl

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training.loop import train
from zerotrain.training.rollouts import read_rollouts

pytestmark = pytest.mark.timeout(900)
G, L = 4, 6
RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
REWARD = '''
def varied(prompts, completions, completion_ids, **kw):
    return [len(set(ids)) / 6 + (ids[0] % 5) / 4 for ids in completion_ids]
'''
OPTIM = ["--lr", "1e-3", "--warmup-steps", "0", "--min-lr-ratio", "1", "--weight-decay", "0", "--grad-clip", "1.0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The prompts, the reward file, a tiny Llama (4 heads, 2 KV heads: --tp 2 splits both) and a tiny Qwen3-MoE (8
    experts, top 2, its second layer dense), each with the test tokenizer, their EOS logit raised so that completions
    end at varied lengths."""
    import transformers

    tmp = tmp_path_factory.mktemp("grpo-parallel")
    llama_folder(tmp / "llama")
    moe_folder(tmp / "moe", "qwen3_moe", vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    tokenizer_folder(tmp / "moe")
    for name in ("llama", "moe"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / name))
        with torch.no_grad():
            model.lm_head.weight[2] = model.model.norm.weight * 3.0
        model.save_pretrained(str(tmp / name))
    (tmp / "reward.py").write_text(REWARD)
    return {"llama": str(tmp / "llama"), "moe": str(tmp / "moe"), "reward": f"{tmp / 'reward.py'}:varied",
            "prompts": write_jsonl(tmp / "prompts.jsonl", RECORDS)}


def argv(data, model: str, out, split: list[str], loss: str = "dapo", beta: float = 0.04) -> list[str]:
    """Step 1 of a global batch of 8 completions (2 prompts x G), split by `split`."""
    return ["train", "--method", "grpo", "--init-from", data[model], "--data", data["prompts"], "--reward",
            data["reward"], "--num-generations", str(G), "--max-completion-length", str(L), "--grpo-loss", loss,
            "--grpo-beta", str(beta), "--steps", "1", "--threads", "1", "--no-progress", "--out", str(out),
            *split, *OPTIM]


def config(args: list[str]):
    return prepare_run(config_from_args(build_parser().parse_args(args)))


def one_rank(args: list[str]) -> None:
    """The 1-rank run, in this process."""
    try:
        cfg = config(args)
        with world_of_one() as comm:
            train(cfg, comm)
    finally:
        release_run_folders()


def on_two_ranks(runs: list[tuple]) -> list[str]:
    """(job, argv) pairs run in turn on 2 spawned ranks; each job's result (an InvariantError's message or "no
    error")."""
    pairs = [(job, config(args)) for job, args in runs]
    try:
        return run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), pairs[0][1], time_limit=600)
    finally:
        release_run_folders()


def step_one(out) -> dict:
    """A run's step 1: its record, rollouts and exported weights (fp32, by name)."""
    import transformers

    record = next(json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line)
    exported = os.path.join(out, "hf")
    assert main(["export", os.path.join(out, "checkpoints"), exported, "--format", "hf", "--dtype", "fp32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    return {"record": record, "rollouts": read_rollouts(os.path.join(out, "rollouts.jsonl")),
            "weights": {n: p.detach() for n, p in model.named_parameters()}}


def largest_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(float((ours[k] - theirs[k]).abs().max()) for k in ours)


def differences(split: dict, single: dict) -> dict:
    """How far a split run's step 1 is from the 1-rank run's."""
    return {"completions": [r["completion_ids"] for r in split["rollouts"]] == [r["completion_ids"] for r in
                                                                                 single["rollouts"]],
            "loss": abs(split["record"]["loss"] - single["record"]["loss"]),
            "grad_norm": abs(split["record"]["grad_norm"] - single["record"]["grad_norm"]),
            "weights": largest_difference(split["weights"], single["weights"])}


def assert_equal_runs(split: dict, single: dict) -> None:
    d = differences(split, single)
    assert d["completions"] and len(split["rollouts"]) == 2 * G
    assert len({len(r["completion_ids"]) for r in single["rollouts"]}) > 1  # varied lengths: the normaliser counts
    assert d["loss"] < 1e-5 and d["grad_norm"] < 1e-5 and d["weights"] < 1e-5, d
    assert single["record"]["grad_norm"] > 1e-2 and largest_difference(single["weights"], single["start"]) > 1e-4


def initial_weights(folder: str) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


ONE_RANK = ["--micro-batch", "4", "--accum", "2"]


def test_tp2_step_one_equals_one_rank_and_duplicated_or_diverging_tp_draws_are_caught(data, tmp_path):
    one_rank(argv(data, "llama", tmp_path / "single", ONE_RANK))
    single = {**step_one(tmp_path / "single"), "start": initial_weights(data["llama"])}
    tp = ["--nproc", "2", "--tp", "2", "--micro-batch", "4", "--accum", "2"]
    results = on_two_ranks([(jobs.train_job, argv(data, "llama", tmp_path / "tp", tp)),
                            (jobs.tp_duplicates_kept_job, argv(data, "llama", tmp_path / "kept", tp)),
                            (jobs.tp_rank_seeded_job, argv(data, "llama", tmp_path / "seeded", tp))])
    assert results[:2] == ["no error", "no error"]
    assert_equal_runs(step_one(tmp_path / "tp"), single)
    # planted: the TP group's copies counted (16 completions where there are 8): each rank's loss is divided by
    # twice the tokens, the loss and gradient halved (AdamW's first step, clipped, hardly sees the scale)
    planted = differences(step_one(tmp_path / "kept"), single)
    assert planted["loss"] > 1e-2 and planted["grad_norm"] > 1.0, planted
    # planted: TP rank 1 draws with another seed; refused on every rank at the rollouts, before any update
    assert results[2] == ("GRPO: rank 1 sampled other completions than rank 0 of its tensor-parallel group: their "
                          "generators or logits differ")


def test_ep2_step_one_equals_one_rank_and_rank_seeded_draws_are_caught(data, tmp_path):
    one_rank(argv(data, "moe", tmp_path / "single", ONE_RANK))
    single = {**step_one(tmp_path / "single"), "start": initial_weights(data["moe"])}
    ep = ["--nproc", "2", "--ep", "2", "--micro-batch", "4", "--accum", "1"]
    results = on_two_ranks([(jobs.train_job, argv(data, "moe", tmp_path / "ep", ep)),
                            (jobs.rank_seeded_job, argv(data, "moe", tmp_path / "seeded", ep))])
    assert results == ["no error", "no error"]
    assert_equal_runs(step_one(tmp_path / "ep"), single)
    planted = differences(step_one(tmp_path / "seeded"), single)
    assert not planted["completions"] and planted["loss"] > 1e-5, planted
