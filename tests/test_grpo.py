"""--method grpo end to end: TRL 1.16's GRPOTrainer as the oracle of a step, learning on a toy verifiable task, a
resume after a stop signal bitwise, and the runs it refuses.

The oracle: zerotrain runs step 1 and records its rollouts (prompts, completions, rewards); TRL's GRPOTrainer is
handed the same completions (its _generate replaced by them), scores them with the same reward function, computes
its advantages, reference log-probs and loss on the same initial model (its own forward), and one AdamW step
(zerotrain's settings) from its gradient. zerotrain's step-1 loss and its exported step-1 weights must equal TRL's
within 1e-5, for each loss type, beta 0 and 0.04, at 1 rank and at 2 ranks ZeRO-3 (TRL accumulating over the same
micro-batches, as DDP would average them). Planted in the product (advantages not normalised by the group's std), at
1 rank in this process, the loss is off.

With LoRA, TRL's GRPOTrainer gets peft's LoraConfig of the same rank, alpha and targets, holding zerotrain's initial
adapters (B drawn nonzero at 1 rank, so that the base and the adapted policy differ): loss, grad norm and the adapters
after the step within 1e-5 (dapo with and without the KL term, grpo with it; at 2 ranks ZeRO-3 with the product's
zero B). Planted: the reference scored with the adapters on (the loss is off, its KL 0), and the completions sampled
with them off (they are the base's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import world_of_one, zerotrain_here
from model_folders import llama_folder, write_jsonl
from safetensors.torch import load_file

from zerotrain import load_model
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.config import LoraConfig
from zerotrain.model import lora
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training import grpo
from zerotrain.training import grpo_loss as gl
from zerotrain.training.loop import train
from zerotrain.training.rollouts import read_rollouts

pytestmark = pytest.mark.timeout(600)
G, L, EOS = 4, 6, 2
RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]
# A reward of the completion's token ids (TRL's decode and zerotrain's need not agree on special tokens): varied within
# each group, so that every group has advantages of both signs
REWARD = '''
def varied(prompts, completions, completion_ids, answer, **kw):
    assert len(answer) == len(completions)
    return [len(set(ids)) / 6 + (ids[0] % 5) / 4 for ids in completion_ids]
'''
OPTIM = ["--lr", "1e-3", "--warmup-steps", "0", "--min-lr-ratio", "1", "--weight-decay", "0", "--beta2", "0.95",
         "--grad-clip", "1.0"]


def grpo_data(tmp, reward_file: str = "reward.py") -> dict:
    """A tiny random Llama whose EOS logit is raised, so completions end at varied lengths (some never end: cut at
    L), the prompts and the reward file (`reward_file`: a module name of its own where one process loads several)."""
    import transformers

    llama_folder(tmp / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "base"))
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.model.norm.weight * 3.0
    model.save_pretrained(str(tmp / "base"))
    (tmp / reward_file).write_text(REWARD)
    return {"base": str(tmp / "base"), "prompts": write_jsonl(tmp / "prompts.jsonl", RECORDS),
            "reward": f"{tmp / reward_file}:varied", "tmp": tmp}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return grpo_data(tmp_path_factory.mktemp("grpo-data"))


def argv(data, out, *, loss="dapo", beta=0.0, nproc=1, steps=1, more=()) -> list[str]:
    split = ["--micro-batch", "4", "--accum", "2"] if nproc == 1 else ["--nproc", "2", "--zero", "3",
                                                                        "--micro-batch", "2", "--accum", "2"]
    return ["train", "--method", "grpo", "--init-from", data["base"], "--data", data["prompts"], "--reward",
            data["reward"], "--num-generations", str(G), "--max-completion-length", str(L), "--grpo-loss", loss,
            "--grpo-beta", str(beta), "--steps", str(steps), "--threads", "1", "--no-progress", "--out", str(out),
            *split, *OPTIM, *more]


def in_this_process(args: list[str]) -> None:
    """`zerotrain ARGS` (1 rank) in this process, so that a bug planted here reaches it."""
    try:
        cfg = prepare_run(config_from_args(build_parser().parse_args(args)))
        with world_of_one() as comm:
            train(cfg, comm)
    finally:
        release_run_folders()


def step_one(out) -> dict:
    """zerotrain's step 1: its loss and grad norm, its rollouts, its weights as transformers loads them."""
    import transformers

    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    step = next(r for r in records if r.get("step") == 1 and "loss" in r)
    exported = os.path.join(out, "hf")
    assert main(["export", os.path.join(out, "checkpoints"), exported, "--format", "hf", "--dtype", "fp32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    return {"loss": step["loss"], "grad_norm": step["grad_norm"], "rollouts": read_rollouts(
        os.path.join(out, "rollouts.jsonl")), "weights": dict(model.named_parameters()), "record": step}


def trl_step(data, tmp, rollouts: list[dict], *, loss: str, beta: float, micro_batches: int,
             adapters: dict | None = None) -> dict:
    """TRL's GRPOTrainer on zerotrain's step-1 completions: its loss (accumulated over `micro_batches` as its
    gradient accumulation and DDP would), its grad norm, and its weights after one AdamW step of zerotrain's
    settings (constant lr 1e-3, betas (0.9, 0.95), eps 1e-8, no weight decay, clipped at 1). With `adapters`
    (zerotrain's initial ones, by name), its peft LoRA of the same rank, alpha and targets holding them, and its
    weights are the adapters (zerotrain's names)."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(data["tmp"]))
    try:
        import reward as reward_module
    finally:
        sys.path.pop(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(data["base"])
    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=len(rollouts), num_generations=G,
                      max_completion_length=L, loss_type=loss, beta=beta, report_to="none", use_cpu=True, bf16=False, seed=0)
    peft_config = None
    if adapters is not None:
        import peft

        peft_config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                      target_modules=list(LORA_TARGETS))
    trainer = GRPOTrainer(model=data["base"], reward_funcs=[reward_module.varied], args=args,
                          train_dataset=datasets.Dataset.from_list(RECORDS), processing_class=tokenizer,
                          peft_config=peft_config)
    if adapters is not None:
        held = dict(trainer.model.named_parameters())
        theirs = {adapter_name(n): n for n in held if ".lora_" in n}
        assert theirs.keys() == adapters.keys()
        with torch.no_grad():
            for name, value in adapters.items():
                held[theirs[name]].copy_(value)
    by_ids = {tuple(trainer._tokenize_prompts([r["prompt"]])[0][0]): r for r in RECORDS}
    inputs = [by_ids[tuple(r["prompt_ids"])] for r in rollouts]  # zerotrain's prompt encoding is TRL's
    prompt_ids, completion_ids = [r["prompt_ids"] for r in rollouts], [r["completion_ids"] for r in rollouts]
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, [r["text"] for r in rollouts], None, {},
                                         None, None)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    # its accumulation over the micro-batches (dapo's normaliser counts them as the steps of one generation)
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation = micro_batches
    total = 0.0
    for rows in torch.arange(len(rollouts)).chunk(micro_batches):
        part = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and len(v) == len(rollouts) else v
                for k, v in batch.items()}
        loss_part = trainer._compute_loss(trainer.model, part)
        loss_part.backward()
        total += float(loss_part.detach())
    params = [p for p in trainer.model.parameters()]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    optimizer.step()
    weights = dict(trainer.model.named_parameters())
    if adapters is not None:
        weights = {adapter_name(n): p for n, p in weights.items() if ".lora_" in n}
    return {"loss": total, "grad_norm": grad_norm, "advantages": batch["advantages"], "weights": weights}


def adapter_name(peft_name: str) -> str:
    """zerotrain's name of a peft adapter parameter: peft's without its wrapper's prefix and adapter name."""
    return peft_name.removeprefix("base_model.model.").replace(".default", "")


def largest_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(float((ours[k].detach() - theirs[k].detach()).abs().max()) for k in ours)


ONE_RANK = [(loss, beta) for loss in gl.LOSS_TYPES for beta in (0.0, 0.04)]
TWO_RANKS = ONE_RANK


@pytest.mark.parametrize("loss,beta", ONE_RANK)
def test_step_one_equals_trls_grpo_trainer_at_one_rank(data, tmp_path, loss, beta):
    out = tmp_path / "run"
    in_this_process(argv(data, out, loss=loss, beta=beta))
    ours = step_one(out)
    rollouts = ours["rollouts"]
    assert len(rollouts) == 2 * G and {r["step"] for r in rollouts} == {1}
    assert len({len(r["completion_ids"]) for r in rollouts}) > 1  # varied lengths: the normalisers differ
    theirs = trl_step(data, tmp_path / "trl", rollouts, loss=loss, beta=beta, micro_batches=2)
    assert torch.allclose(torch.tensor([r["advantage"] for r in rollouts]), theirs["advantages"], atol=1e-6)
    # on-policy the loss is a weighted sum of advantages (grpo's exactly their mean, 0): its gradient is what moves
    assert abs(ours["loss"] - theirs["loss"]) < 1e-5, (ours["loss"], theirs["loss"])
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5 and theirs["grad_norm"] > 1e-2
    assert largest_difference(ours["weights"], theirs["weights"]) < 1e-5
    if beta:
        assert ours["record"]["kl"] == 0.0  # the policy is the reference at step 1: k3 is 0 exactly


@pytest.mark.parametrize("loss,beta", TWO_RANKS)
def test_step_one_equals_trls_grpo_trainer_at_two_ranks_zero3(data, tmp_path, loss, beta):
    out = tmp_path / "run"
    assert main(argv(data, out, loss=loss, beta=beta, nproc=2)) == 0
    release_run_folders()
    ours = step_one(out)
    theirs = trl_step(data, tmp_path / "trl", ours["rollouts"], loss=loss, beta=beta, micro_batches=4)
    assert abs(ours["loss"] - theirs["loss"]) < 1e-5, (ours["loss"], theirs["loss"])
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5 and theirs["grad_norm"] > 1e-2
    assert largest_difference(ours["weights"], theirs["weights"]) < 1e-5


def test_advantages_not_normalised_are_caught(data, tmp_path, monkeypatch):
    real = gl.group_advantages
    monkeypatch.setattr(gl, "group_advantages", lambda rewards, G, scale="group": real(rewards, G, "none"))
    out = tmp_path / "planted"
    in_this_process(argv(data, out, loss="grpo"))
    ours = step_one(out)
    monkeypatch.undo()
    theirs = trl_step(data, tmp_path / "trl", ours["rollouts"], loss="grpo", beta=0.0, micro_batches=2)
    # grpo's on-policy loss is the advantages' mean, 0 either way: the gradient and the step tell
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) > 1e-2
    assert largest_difference(ours["weights"], theirs["weights"]) > 1e-3


# LoRA: rank 4, alpha 8 on every linear of the blocks, and in TRL peft's LoraConfig of the same (its reference: the
# base, the adapters disabled). B starts drawn, not zero (the product's initial_up replaced): the adapted policy is
# not its base at step 1, so the KL term tells which one scored the reference.
LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ARGS = ["--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA)]


def drawn_up(out_features: int, rank: int) -> torch.Tensor:
    return torch.randn(out_features, rank, generator=torch.Generator().manual_seed(out_features)) * 0.03


def initial_adapters(base: str) -> dict[str, torch.Tensor]:
    """zerotrain's adapters before step 1 (seed 0's A; B zero, or drawn_up's where it replaces initial_up), by
    name."""
    model = load_model(base)
    lora.add_adapters(model, LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA), 0)
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def lora_step_one(data, tmp, monkeypatch, *, loss: str, beta: float) -> tuple[dict, dict, dict]:
    """zerotrain's LoRA step 1 at 1 rank (B drawn), TRL's with peft on its rollouts, and the adapters both started
    from."""
    monkeypatch.setattr(lora, "initial_up", drawn_up)
    out = tmp / "run"
    in_this_process(argv(data, out, loss=loss, beta=beta, more=LORA_ARGS))
    start = initial_adapters(data["base"])
    ours = lora_step_one_of(out)
    theirs = trl_step(data, tmp / "trl", ours["rollouts"], loss=loss, beta=beta, micro_batches=2, adapters=start)
    return ours, theirs, start


def lora_step_one_of(out) -> dict:
    """step_one of a LoRA run, its weights the adapters (by name), as its peft export holds them."""
    ours = step_one(out)
    folder = os.path.join(out, "adapter")
    assert main(["export", os.path.join(out, "checkpoints"), folder, "--format", "peft"]) == 0
    adapters = load_file(os.path.join(folder, "adapter_model.safetensors"))
    ours["weights"] = {adapter_name(n): t.float() for n, t in adapters.items()}
    return ours


@pytest.mark.parametrize("loss,beta", [("dapo", 0.0), ("dapo", 0.04), ("grpo", 0.04)])
def test_a_lora_step_one_equals_trls_grpo_trainer_with_peft_at_one_rank(data, tmp_path, monkeypatch, loss, beta):
    ours, theirs, start = lora_step_one(data, tmp_path, monkeypatch, loss=loss, beta=beta)
    assert len({len(r["completion_ids"]) for r in ours["rollouts"]}) > 1  # varied lengths: the normalisers differ
    assert len(ours["weights"]) == 2 * 7 * 2  # A and B of 7 linears in each of the 2 blocks
    assert abs(ours["loss"] - theirs["loss"]) < 1e-5, (ours["loss"], theirs["loss"])
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5 and theirs["grad_norm"] > 1e-2
    assert largest_difference(ours["weights"], theirs["weights"]) < 1e-5
    assert largest_difference(ours["weights"], start) > 1e-4  # the step moved them
    if beta:
        assert ours["record"]["kl"] > 1e-4  # the base, not the adapted policy, is the reference


def test_a_lora_step_one_equals_trls_grpo_trainer_with_peft_at_two_ranks_zero3(data, tmp_path):
    """The product's own initial adapters (B zero: the reference is the policy at step 1), its base sharded."""
    out = tmp_path / "run"
    assert main(argv(data, out, loss="dapo", beta=0.04, nproc=2, more=LORA_ARGS)) == 0
    release_run_folders()
    ours = lora_step_one_of(out)
    theirs = trl_step(data, tmp_path / "trl", ours["rollouts"], loss="dapo", beta=0.04, micro_batches=4,
                      adapters=initial_adapters(data["base"]))
    assert abs(ours["loss"] - theirs["loss"]) < 1e-5, (ours["loss"], theirs["loss"])
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) < 1e-5 and theirs["grad_norm"] > 1e-2
    assert largest_difference(ours["weights"], theirs["weights"]) < 1e-5
    assert ours["record"]["kl"] == 0.0


def test_a_lora_reference_scored_with_the_adapters_on_is_caught(data, tmp_path, monkeypatch):
    import contextlib

    monkeypatch.setattr(grpo, "adapters_off", lambda model: contextlib.nullcontext())  # planted
    ours, theirs, _ = lora_step_one(data, tmp_path, monkeypatch, loss="dapo", beta=0.04)
    assert ours["record"]["kl"] == 0.0  # the policy against itself
    assert abs(ours["loss"] - theirs["loss"]) > 1e-4, (ours["loss"], theirs["loss"])


def test_lora_completions_are_sampled_with_the_adapters_on_and_the_base_sampling_them_is_caught(data, tmp_path,
                                                                                                monkeypatch):
    """The same seed's draws: the adapted policy's differ from its base's (B drawn); sampled with the adapters off
    (planted around the product's sampler), they are the base's."""
    def completions(name: str, *more) -> list[list[int]]:
        in_this_process(argv(data, tmp_path / name, more=more))
        return [r["completion_ids"] for r in read_rollouts(os.path.join(tmp_path / name, "rollouts.jsonl"))]

    base = completions("base")
    monkeypatch.setattr(lora, "initial_up", drawn_up)
    assert completions("lora", *LORA_ARGS) != base
    real = grpo.sample_completions

    def base_sampling(model, *args, **kw):  # planted: the rollouts drawn by the base
        with lora.adapters_off(model):
            return real(model, *args, **kw)

    monkeypatch.setattr(grpo, "sample_completions", base_sampling)
    assert completions("planted", *LORA_ARGS) == base


# The toy task: each prompt names 10 of a pool of 30 token ids ("Say one of: ..."); a completion earns 1 when it holds
# one of its prompt's. The random model hits one in about 1 of 6 completions; the pool's tokens are few enough for a
# tiny model to learn at lr 1e-2 in 60 steps of 4 prompts x G = 4 completions, on 2 ranks.
TOY_REWARD = '''
def named_token(prompts, completions, completion_ids, targets, **kw):
    return [float(any(t in set(ids) for t in named)) for ids, named in zip(completion_ids, targets)]
'''


@pytest.fixture(scope="module")
def toy(data):
    """The tests' tiny random Llama as llama_folder makes it (its EOS not raised: completions run to L tokens)."""
    import random

    tokenizer, rng = llama_folder(data["tmp"] / "toy-base"), random.Random(0)
    pool = rng.sample(range(100, 400), 30)
    records = []
    for _ in range(16):
        ids = rng.sample(pool, 10)
        records.append({"prompt": "Say one of:" + "".join(tokenizer.decode([t]) for t in ids), "targets": ids})
    (data["tmp"] / "toy.py").write_text(TOY_REWARD)
    return {"prompts": write_jsonl(data["tmp"] / "toy.jsonl", records), "base": str(data["tmp"] / "toy-base"),
            "reward": f"{data['tmp'] / 'toy.py'}:named_token"}


def toy_args(data, toy, out, steps: int, *more) -> list[str]:
    return ["--method", "grpo", "--init-from", toy["base"], "--data", toy["prompts"], "--reward", toy["reward"],
            "--num-generations", "4", "--micro-batch", "8", "--nproc", "2", "--steps", str(steps),
            "--max-completion-length", "6", "--lr", "1e-2", "--warmup-steps", "0", "--min-lr-ratio", "1", "--threads",
            "1", "--no-progress", "--out", str(out), *more]


def run_zerotrain(*args, faults=None):
    """`zerotrain ARGS` in a process of its own: a fault that signals the launcher must not reach pytest's."""
    env = {k: v for k, v in os.environ.items() if k != "ZEROTRAIN_FAULTS"}
    if faults:
        env["ZEROTRAIN_FAULTS"] = faults
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def rewards_of(out) -> list[float]:
    return [r["reward"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "reward" in r]


def checkpoint_files(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.endswith(".safetensors")}


@pytest.fixture(scope="module")
def toy_run(data, toy, tmp_path_factory):
    """The toy task's run of 60 steps on 2 ranks, never stopped, checkpoints every 10 steps, the guard set to abort
    on an anomaly: the run the learning, the guard's and the resume's tests all assert on. Its learning rate is
    constant (no warmup, --min-lr-ratio 1), so its first 10 steps are a run of --steps 10."""
    out = tmp_path_factory.mktemp("grpo-toy") / "whole"
    try:
        assert main(["train", *toy_args(data, toy, out, 60, "--ckpt-every", "10", "--on-anomaly", "abort")]) == 0
    finally:
        release_run_folders()
    return out


def test_it_learns_a_toy_verifiable_task_on_two_ranks(toy_run):
    rewards = rewards_of(toy_run)
    assert len(rewards) == 60
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, (first, last, rewards)


def test_a_run_stopped_at_step_7_and_resumed_equals_the_uninterrupted_one_bitwise(data, toy, toy_run, tmp_path,
                                                                                   capfd):
    stopped, nudged = tmp_path / "stopped", tmp_path / "nudged"
    r = run_zerotrain("train", *toy_args(data, toy, stopped, 10), faults="sigterm@step=7,rank=1")
    assert r.returncode == 0, r.stderr
    assert "stopped by SIGTERM at step 7" in r.stdout + r.stderr
    # step 8 began before the stop was agreed: its rollouts were written, and the resume drops them
    assert max(rec["step"] for rec in read_rollouts(os.path.join(stopped, "rollouts.jsonl"))) == 8
    r = zerotrain_here(capfd, "train", *toy_args(data, toy, stopped, 10), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    step10 = os.path.join("checkpoints", "step_00000010")
    assert checkpoint_files(stopped / step10) == checkpoint_files(toy_run / step10)
    whole_rollouts = [line for line in open(toy_run / "rollouts.jsonl", "rb") if json.loads(line)["step"] <= 10]
    assert open(stopped / "rollouts.jsonl", "rb").readlines() == whole_rollouts
    assert rewards_of(stopped) == rewards_of(toy_run)[:10]
    # what the comparison catches: the same resume at a temperature 1e-6 off draws other completions
    shutil.copytree(stopped / "checkpoints" / "step_00000007", nudged / "start" / "step_00000007")
    r = zerotrain_here(capfd, "train", *toy_args(data, toy, nudged, 10), "--resume",
                       str(nudged / "start" / "step_00000007"), "--temperature", "0.999999")
    assert r.returncode == 0, r.stderr
    assert checkpoint_files(nudged / step10) != checkpoint_files(toy_run / step10)


@pytest.mark.parametrize("change,says", [
    (["--num-generations", "3"], "--micro-batch 4 x --accum 2 = 8 completions a rank is not a multiple of "
                                 "--num-generations 3"),
    (["--num-generations", "1"], "--num-generations must be at least 2"),
    (["--reward-weights", "1,2"], "--reward-weights 1,2 gives 2 weights for 1 --reward functions"),
    (["--reward-weights", "one"], "--reward-weights one: 'one' is not a number"),
    (["--grpo-loss", "ppo"], "--grpo-loss must be grpo, dr_grpo, dapo or bnpo"),
    (["--max-completion-length", "60"], "a prompt of 10 tokens leaves no room for --max-completion-length 60 in "
                                        "--seq-len 64"),
    (["--reward", "format"], "--reward format needs --reward-format REGEX"),
    (["--reward", "nowhere.py:f"], "--reward nowhere.py:f: no file nowhere.py"),
])
def test_a_grpo_run_it_cannot_make_is_refused_in_one_line(data, tmp_path, capfd, change, says):
    r = zerotrain_here(capfd, *argv(data, tmp_path / "run"), *change)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr


def test_grpo_flags_apply_to_grpo_alone_and_it_needs_a_reward_and_a_model(data, tmp_path, capfd):
    r = zerotrain_here(capfd, "train", "--data", "synthetic", "--steps", "1", "--num-generations", "4", "--out",
                       str(tmp_path / "sft"))
    assert r.returncode == 2 and "--num-generations applies to --method grpo; this run is --method sft" in r.stderr
    args = argv(data, tmp_path / "run")
    at = args.index("--reward")
    r = zerotrain_here(capfd, *args[:at], *args[at + 2:])
    assert r.returncode == 2 and "--method grpo needs a reward" in r.stderr
    at = args.index("--init-from")
    r = zerotrain_here(capfd, *args[:at], *args[at + 2:])
    assert r.returncode == 2 and "--method grpo trains a model that can already answer" in r.stderr


def test_grpo_iterations_train_each_generation_mu_steps_and_a_resume_inside_one_is_refused(data, tmp_path, capfd):
    out = tmp_path / "run"
    r = zerotrain_here(capfd, *argv(data, out, steps=4, more=["--grpo-iterations", "2", "--ckpt-every", "1"]))
    assert r.returncode == 0, r.stderr
    assert sorted({rec["step"] for rec in read_rollouts(os.path.join(out, "rollouts.jsonl"))}) == [1, 3]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = {rec["step"]: rec for rec in records if "loss" in rec}
    assert steps[1]["reward"] == steps[2]["reward"] and steps[3]["reward"] == steps[4]["reward"]
    assert steps[1]["clip_ratio"] == 0.0  # the generating policy itself: every ratio is 1
    step3 = os.path.join(out, "checkpoints", "step_00000003")
    r = zerotrain_here(capfd, *argv(data, tmp_path / "resumed", steps=4, more=["--grpo-iterations", "2", "--resume",
                                                                               step3]))
    assert r.returncode == 2 and "step 3 is inside a generation of --grpo-iterations 2" in r.stderr, r.stderr


def test_the_guard_never_judges_grpos_loss_by_its_ratio_but_still_refuses_a_nan(data, toy, toy_run, tmp_path, capfd):
    """The toy run's loss changes sign and sits near 0 (a ratio to its median is meaningless): 60 steps with
    --on-anomaly abort, none refused; a NaN planted in step 4's loss on rank 1 is refused before it is applied."""
    losses = [rec["loss"] for rec in map(json.loads, open(toy_run / "metrics.jsonl")) if "loss" in rec]
    assert len(losses) == 60 and min(losses[:12]) < 0 < max(losses[:12])
    r = zerotrain_here(capfd, "train", *toy_args(data, toy, tmp_path / "nan", 6, "--on-anomaly", "abort"),
                       faults="nan@step=4,rank=1")
    assert r.returncode != 0 and "non-finite loss on rank(s) [1] at step 4" in r.stdout + r.stderr, r.stderr
