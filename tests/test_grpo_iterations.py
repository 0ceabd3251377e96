"""--grpo-iterations 2 end to end against TRL 1.16's GRPOTrainer (num_iterations=2): zerotrain samples and scores one
generation at step 1 and trains on it at steps 1 and 2, the ratio taken to the generating policy's log-probs; TRL,
handed the same completions, computes its old log-probs, advantages (and reference log-probs) once, and takes two
AdamW steps of zerotrain's settings on them, accumulating over the same micro-batches. Both steps' losses and the
weights after step 2 agree within 1e-5, and step 2's ratio is not 1 (the step moved the policy), so the old log-probs
matter. Planted in the product: the ratio taken to the policy being trained (old log-probs dropped): step 2's loss is
off."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
from conftest import world_of_one
from test_grpo import G, L, RECORDS, grpo_data

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training import grpo
from zerotrain.training.loop import train
from zerotrain.training.rollouts import read_rollouts

pytestmark = pytest.mark.timeout(600)
OPTIM = ["--lr", "1e-2", "--warmup-steps", "0", "--min-lr-ratio", "1", "--weight-decay", "0", "--beta2", "0.95",
         "--grad-clip", "1.0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return grpo_data(tmp_path_factory.mktemp("grpo-iterations"), "iter_reward.py")


def zerotrain_two_steps(data, out, loss: str, beta: float) -> dict:
    """Two steps of one generation at 1 rank, in this process: each step's record, the rollouts, the weights."""
    import transformers

    args = ["train", "--method", "grpo", "--init-from", data["base"], "--data", data["prompts"], "--reward",
            data["reward"], "--num-generations", str(G), "--max-completion-length", str(L), "--grpo-loss", loss,
            "--grpo-beta", str(beta), "--grpo-iterations", "2", "--steps", "2", "--micro-batch", "4", "--accum", "2",
            "--threads", "1", "--no-progress", "--out", str(out), *OPTIM]
    try:
        cfg = prepare_run(config_from_args(build_parser().parse_args(args)))
        with world_of_one() as comm:
            train(cfg, comm)
    finally:
        release_run_folders()
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    exported = os.path.join(out, "hf")
    assert main(["export", os.path.join(out, "checkpoints"), exported, "--format", "hf", "--dtype", "fp32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    return {"records": records, "rollouts": read_rollouts(os.path.join(out, "rollouts.jsonl")),
            "weights": {n: p.detach() for n, p in model.named_parameters()}}


def trl_two_steps(data, tmp, rollouts: list[dict], *, loss: str, beta: float, micro_batches: int = 2) -> dict:
    """TRL's GRPOTrainer with num_iterations=2 on zerotrain's completions: its generation batch scored once (old
    log-probs, advantages, reference log-probs), then two AdamW steps (lr 1e-2, betas (0.9, 0.95), no weight decay,
    clipped at 1), each accumulated over `micro_batches` as its gradient accumulation would; each step's loss, the
    weights after them."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(data["tmp"]))
    try:
        import iter_reward
    finally:
        sys.path.pop(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(data["base"])
    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=len(rollouts), num_generations=G,
                      max_completion_length=L, loss_type=loss, beta=beta, num_iterations=2, report_to="none",
                      use_cpu=True, bf16=False, seed=0)
    trainer = GRPOTrainer(model=data["base"], reward_funcs=[iter_reward.varied], args=args,
                          train_dataset=datasets.Dataset.from_list(RECORDS), processing_class=tokenizer)
    by_ids = {tuple(trainer._tokenize_prompts([r["prompt"]])[0][0]): r for r in RECORDS}
    inputs = [by_ids[tuple(r["prompt_ids"])] for r in rollouts]
    prompt_ids, completion_ids = [r["prompt_ids"] for r in rollouts], [r["completion_ids"] for r in rollouts]
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, [r["text"] for r in rollouts], None, {},
                                         None, None)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    assert batch["old_per_token_logps"] is not None  # num_iterations 2: the generating policy's, kept
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation = micro_batches
    params = list(trainer.model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(2):
        total = 0.0
        for rows in torch.arange(len(rollouts)).chunk(micro_batches):
            part = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and len(v) == len(rollouts) else v
                    for k, v in batch.items()}
            loss_part = trainer._compute_loss(trainer.model, part)
            loss_part.backward()
            total += float(loss_part.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach() for n, p in trainer.model.named_parameters()}}


def largest_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(float((ours[k] - theirs[k]).abs().max()) for k in ours)


@pytest.mark.parametrize("loss,beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_two_iterations_of_a_generation_equal_trls_num_iterations_2(data, tmp_path, loss, beta):
    ours = zerotrain_two_steps(data, tmp_path / "run", loss, beta)
    assert [r["step"] for r in ours["records"]] == [1, 2] and {r["step"] for r in ours["rollouts"]} == {1}
    theirs = trl_two_steps(data, tmp_path / "trl", ours["rollouts"], loss=loss, beta=beta)
    losses = [r["loss"] for r in ours["records"]]
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, theirs["losses"])), (losses, theirs["losses"])
    assert largest_difference(ours["weights"], theirs["weights"]) < 1e-5
    assert ours["records"][1]["clip_ratio"] > 0 or abs(losses[1] - losses[0]) > 1e-4  # step 2 is off-policy


def test_a_ratio_to_the_policy_being_trained_is_caught(data, tmp_path, monkeypatch):
    real = grpo.GroupRelative.group_micro

    def without_old(self, engine, chunk, reference=True):  # planted: the generating policy's log-probs dropped
        return dataclasses.replace(real(self, engine, chunk, reference), old=None)

    monkeypatch.setattr(grpo.GroupRelative, "group_micro", without_old)
    ours = zerotrain_two_steps(data, tmp_path / "run", "dapo", 0.0)
    monkeypatch.undo()
    theirs = trl_two_steps(data, tmp_path / "trl", ours["rollouts"], loss="dapo", beta=0.0)
    assert abs(ours["records"][0]["loss"] - theirs["losses"][0]) < 1e-5  # step 1 is on-policy either way
    assert abs(ours["records"][1]["loss"] - theirs["losses"][1]) > 1e-4, (ours["records"], theirs["losses"])
