"""Preference tuning (--method dpo): TRL's DPOTrainer as the oracle (pair log-probs, five steps of sigmoid and IPO),
the same losses at every split, the reference precomputed from the initial weights (or LoRA's base, live), resume,
validation on held-out pairs against the same reference.

Kept short for CI: the expensive runs are module fixtures that several tests assert on (TRL's two five-step runs and
one forward; zerotrain's runs beside them, whose sigmoid run's checkpoint the resumes continue; one start of 2 ranks
and one of 4 for the splits, whose runs also validate), and TRL is imported only where its fixture runs."""

from __future__ import annotations

import functools
import math
import os
import shutil
from dataclasses import replace

import dpo_jobs
import pytest
import torch
from conftest import tiny_config, world_of_one, zerotrain_here
from dist_jobs import in_turn_job
from model_folders import CHATML, llama_folder, write_jsonl
from safetensors.torch import load_file, save_file

from zerotrain.config import Config
from zerotrain.data import pairs as pairs_module
from zerotrain.data.pairs import Pair, fit, parse_pair, read_pairs
from zerotrain.errors import ConfigError
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.model.loss import head_loss
from zerotrain.runtime.launch import run_job
from zerotrain.training import memory_plan as plan_module
from zerotrain.training import preference
from zerotrain.training.loop import train

LIMIT = 180  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(400)
SEQ = 32
LN2 = float(torch.tensor(math.log(2), dtype=torch.float32))  # -log sigmoid(0) in fp32
LONG = "The user asks and the assistant answers. " * 3  # makes one prompt longer than the window: cut from the left
PLAIN = [{"prompt": ("" if i != 3 else LONG) + f"Question {i}: what is {i} plus {i}?", "chosen": f" Answer: {2 * i}.",
          "rejected": f" Answer: {2 * i + 1}."} for i in range(8)]
# Conversations that fit the window: TRL cuts each row on its own (keep_end), so a cut prompt before completions of
# other lengths has another context in TRL's chosen row than in its rejected one (zerotrain keeps one prompt a pair)
CHAT = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
         "chosen": [{"role": "assistant", "content": f"It is {2 * i}."}],
         "rejected": [{"role": "assistant", "content": f"Maybe {2 * i + 3}."}]} for i in range(8)]
# Held-out pairs (--val-data): 5, so that a replica's last validation forward is filled up at every split
HELD = [{"prompt": f"Question {i}: what is {i} times two?", "chosen": f" Answer: {2 * i}.",
         "rejected": f" Answer: {2 * i - 1}."} for i in range(8, 13)]


@pytest.fixture(scope="module")
def group():
    with world_of_one() as comm:
        yield comm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny random Llama with a ChatML template (transformers' save_pretrained), and the pairs as JSON Lines."""
    tmp = tmp_path_factory.mktemp("dpo-data")
    llama_folder(tmp / "base", template=CHATML)
    return {"base": str(tmp / "base"), "plain": write_jsonl(tmp / "plain.jsonl", PLAIN),
            "chat": write_jsonl(tmp / "chat.jsonl", CHAT), "held": write_jsonl(tmp / "held.jsonl", HELD)}


def dpo_config(out, data, records="plain", steps=5, micro=8, **over) -> Config:
    """Constant lr 1e-2 (as TRL's runs below), AdamW (0.9, 0.95), no weight decay, clipped at 1. The peak MFU is
    measured against is given: timing a CPU matmul on a busy machine took a second or two of each short run."""
    settings = dict(steps=steps, micro=micro, seq_len=SEQ, data=data[records], init_from=data["base"], method="dpo",
                    warmup_steps=0, min_lr_ratio=1.0, lr=1e-2, weight_decay=0.0, beta2=0.95, grad_clip=1.0,
                    peak_flops=1e12)
    cfg = tiny_config(out, **{**settings, **over})
    cfg.model = adopt(cfg.model, weight_source(data["base"]), {"seq_len"})
    return cfg


def stored_reference(cfg: Config) -> torch.Tensor:
    """[pairs, 2]: the (chosen, rejected) log-probs the run scored before step 1, as it stored them."""
    return load_file(os.path.join(cfg.checkpoint.dir, preference.REFERENCE_FILE))["logps"]


def trl_args(out, steps: int, **over) -> dict:
    """The training settings TRL's trainers share with dpo_config (steps of 8 pairs at constant lr 1e-2, AdamW (0.9,
    0.95), no weight decay, clipped at 1), each step's loss and grad norm logged."""
    return dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=max(steps, 1), learning_rate=1e-2,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                adam_epsilon=1e-8, max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", seed=0,
                optim="adamw_torch", bf16=False, max_length=SEQ + 1, disable_tqdm=True, logging_steps=1, **over)


def recording(trainer_class, losses: list):
    """`trainer_class` recording the loss of each of its steps in `losses`."""
    class Recording(trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(loss.item())
            return loss

    return Recording


def trained(trainer, losses: list) -> dict:
    """Train; each step's loss and grad norm (before clipping, as zerotrain's records give it)."""
    trainer.train()
    return {"losses": losses, "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}


def trl_run(data, records, loss_type="sigmoid", steps=5, out=None, logps=True, **over):
    """TRL's DPOTrainer on the same model and pairs: each pair's log-probs under the initial model (its reference
    forward, on a batch of all eight pairs; `logps`) and the losses and grad norms of `steps` steps of 8 pairs at
    lr 1e-2 (0: none); `over`: DPOConfig's beta, label_smoothing."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    losses = []
    args = DPOConfig(**trl_args(out, steps, **{"beta": 0.1, **over}), loss_type=[loss_type],
                     truncation_mode="keep_end",
                     # the same losses to the bit, in half the time: the reference's log-probs scored once, before
                     # step 1, not by a reference model every step; no activation checkpointing (its recompute)
                     precompute_ref_log_probs=True, gradient_checkpointing=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(data["base"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(data["base"])
    trainer = recording(DPOTrainer, losses)(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                                            processing_class=tokenizer)
    out = {"losses": losses}
    if logps:
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
        with torch.no_grad():
            chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
        out["logps"] = torch.stack([chosen, rejected], dim=1).double()
    if steps:
        out.update(trained(trainer, losses))
    return out


@pytest.fixture(scope="module")
def trl(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    return {"sigmoid": trl_run(data, PLAIN, out=tmp / "s"),
            "ipo": trl_run(data, PLAIN, "ipo", out=tmp / "i", logps=False),  # the same log-probs as sigmoid's
            "chat": trl_run(data, CHAT, steps=0, out=tmp / "c")}


def rel(a, b) -> float:
    """The largest relative difference (0 where both are the same, 0 included)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.where(a == b, 0.0, (a - b).abs() / b.abs()).max())


@pytest.fixture(scope="module")
def runs(data, group, tmp_path_factory):
    """zerotrain's runs beside TRL's (in this process, one rank), and the planted ones. The sigmoid run saves step 4:
    what the resumes below continue."""
    tmp = tmp_path_factory.mktemp("dpo-runs")
    out = {}

    def run(name, records="plain", **over):
        cfg = dpo_config(tmp / name, data, records, **over)
        result = train(cfg, group)
        out[name] = {"losses": [r["loss"] for r in result.records], "records": result.records,
                     "grad_norms": [r["grad_norm"] for r in result.records],
                     "reference": stored_reference(cfg), "summary": result.report["summary"],
                     "checkpoints": result.checkpoints, "digests": result.digests}

    run("sigmoid", ckpt_every=4)
    run("ipo", dpo_loss="ipo")
    run("chat", "chat", steps=1)
    mp = pytest.MonkeyPatch()
    try:  # planted: beta applied twice (the loss's beta on a logit already scaled by beta)
        real = preference.pair_losses
        mp.setattr(preference, "pair_losses", lambda o, p, r, c: real(replace(o, dpo_beta=o.dpo_beta ** 2), p, r, c))
        run("beta twice", steps=2)
        mp.undo()
        # planted: IPO's log-ratios not divided by the completions' token counts (the sums' squared loss)
        mp.setattr(preference, "pair_losses", lambda o, p, r, c: real(o, p, r, torch.ones_like(c)))
        run("ipo unnormalised", steps=2, dpo_loss="ipo")
        mp.undo()
        # planted: the reference is the policy itself (its own log-probs, detached), scored every step
        mp.setattr(preference.Preference, "reference_of",
                   lambda self, engine, forward, micro, ids: torch.no_grad()(
                       lambda: head_loss(forward, micro.inputs, micro.labels, preference.sequence_logps,
                                         False)[0].view(2, len(ids)))())
        run("policy as reference", steps=2)
        mp.undo()
        # planted: a prompt too long is cut from the right (its start kept), as a keep_start truncation does
        mp.setattr(pairs_module, "fit", lambda pair, length: fit(
            Pair(pair.prompt[: length - max(len(pair.chosen), len(pair.rejected))], pair.chosen, pair.rejected),
            length))
        run("prompt cut from the right", steps=1)
    finally:
        mp.undo()
    return out


def test_pair_log_probs_equal_trls_plain_and_conversational_and_a_prompt_cut_from_the_right_is_caught(runs, trl):
    assert rel(runs["sigmoid"]["reference"], trl["sigmoid"]["logps"]) <= 1e-5
    assert rel(runs["chat"]["reference"], trl["chat"]["logps"]) <= 1e-5
    # the planted cut differs on the one pair whose prompt is cut (pair 3), and only there
    planted = runs["prompt cut from the right"]["reference"]
    assert rel(planted[3], trl["sigmoid"]["logps"][3]) > 1e-3
    assert rel(torch.cat([planted[:3], planted[4:]]), torch.cat([trl["sigmoid"]["logps"][:3],
                                                               trl["sigmoid"]["logps"][4:]])) <= 1e-5


def test_five_steps_of_sigmoid_and_ipo_equal_trls_and_beta_twice_the_policy_as_reference_or_ipo_unnormalised_is_caught(
        runs, trl):
    for loss in ("sigmoid", "ipo"):
        ours, theirs = runs[loss], trl[loss]
        assert len(ours["losses"]) == len(theirs["losses"]) == len(theirs["grad_norms"]) == 5
        assert rel(ours["losses"], theirs["losses"]) <= 1e-5, (ours["losses"], theirs["losses"])
        assert rel(ours["grad_norms"], theirs["grad_norms"]) <= 1e-5, (ours["grad_norms"], theirs["grad_norms"])
        # off the reference: from step 2 on, the mean margin beta Delta is away from 0 (at step 1 it is 0: the policy
        # is the reference), so the losses compared are not the loss at Delta = 0
        margins = [r["rewards_margins"] for r in ours["records"]]
        assert margins[0] == 0 and min(margins[1:]) > 0.05, margins
    for planted, loss in (("beta twice", "sigmoid"), ("policy as reference", "sigmoid"), ("ipo unnormalised", "ipo")):
        assert rel(runs[planted]["losses"][1], trl[loss]["losses"][1]) > 1e-3, planted


def test_step_one_with_the_policy_as_reference_is_ln2_exactly_and_moves_after_and_a_frozen_reference_is_caught(runs):
    losses = runs["sigmoid"]["losses"]
    assert losses[0] == LN2 and all(loss < LN2 - 1e-3 for loss in losses[1:])
    first = runs["sigmoid"]["records"][0]
    assert first["rewards_chosen"] == first["rewards_rejected"] == first["rewards_accuracy"] == 0
    assert first["pairs"] == 8 and first["logps_chosen"] < 0
    last = runs["sigmoid"]["records"][-1]
    assert last["rewards_accuracy"] > 0.5 and last["rewards_margins"] > 0
    assert runs["sigmoid"]["summary"]["preference"] == {k: last[k] for k in dpo_jobs.FIGURES}
    # the planted reference that follows the policy never moves: the check above fails for it
    assert runs["policy as reference"]["losses"] == [LN2, LN2]


# ----------------------------------------------------------------------------- every split

@pytest.fixture(scope="module")
def splits(data, group, tmp_path_factory):
    """8 pairs a step, 2 steps, each validated on the 5 held-out pairs (--val-data): 1 rank x 8 here; 2 ranks x 2 x
    accum 2 at ZeRO-1 and ZeRO-3, TP 2 x 4 x accum 2 and a planted reference looked up by position (one start of 2
    ranks); 4 ranks x 2 at ZeRO-1 and ZeRO-3. Here too, a planted validation against the policy itself."""
    tmp = tmp_path_factory.mktemp("dpo-splits")

    def config(name, **over):
        return dpo_config(tmp / name, data, **{"steps": 2, "eval_every": 1, "val_data": data["held"], **over})

    two = [(dpo_jobs.dpo_job, config("z1-2", nproc=2, micro=2, accum=2)),
           (dpo_jobs.dpo_job, config("z3-2", nproc=2, micro=2, accum=2, zero=3)),
           (dpo_jobs.dpo_job, config("tp2", nproc=2, tp=2, micro=4, accum=2)),
           (dpo_jobs.dpo_reference_by_position_job, config("planted", nproc=2, micro=2, accum=2, steps=1))]
    four = [(dpo_jobs.dpo_job, config("z1-4", nproc=4, micro=2)), (dpo_jobs.dpo_job, config("z3-4", nproc=4, micro=2,
                                                                                            zero=3))]
    two = run_job(functools.partial(in_turn_job, jobs=two), two[0][1], time_limit=LIMIT)
    four = run_job(functools.partial(in_turn_job, jobs=four), four[0][1], time_limit=LIMIT)

    def here(name, **over):  # in this process: the final model and the stored reference stay at hand
        cfg = config(name, **over)
        result = train(cfg, group)
        return {**dpo_jobs.log_of(result), "model": result.engine.model, "reference": stored_reference(cfg),
                "summary": result.report["summary"], "objective": cfg.objective}

    one = here("one", ckpt_every=1)  # step 1's checkpoint: what the resume with held-out pairs continues
    mp = pytest.MonkeyPatch()
    try:  # planted: the held-out pairs (their ids follow the training pairs') validated against the policy itself
        real = preference.Preference.reference_of

        def policy_for_held_out(self, engine, forward, micro, ids):
            if min(ids) < len(self.source.pairs):
                return real(self, engine, forward, micro, ids)
            return head_loss(forward, micro.inputs, micro.labels, preference.sequence_logps, False)[0].view(2, len(ids))

        mp.setattr(preference.Preference, "reference_of", policy_for_held_out)
        against_policy = here("validated against the policy", steps=1)
    finally:
        mp.undo()
    return {"1 x 8": one, "2 x 2 x 2 ZeRO-1": two[0], "2 x 2 x 2 ZeRO-3": two[1], "TP 2": two[2], "planted": two[3],
            "4 x 2 ZeRO-1": four[0], "4 x 2 ZeRO-3": four[1], "validated against the policy": against_policy}


def test_the_losses_and_figures_are_the_same_at_every_split_and_a_reference_looked_up_by_position_is_caught(splits):
    one = splits["1 x 8"]
    for name in ("2 x 2 x 2 ZeRO-1", "2 x 2 x 2 ZeRO-3", "TP 2", "4 x 2 ZeRO-1", "4 x 2 ZeRO-3"):
        run = splits[name]
        assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"])) <= 1e-6, (name, run["losses"])
        for key in dpo_jobs.FIGURES:
            assert max(abs(a - b) for a, b in zip(run[key], one[key])) <= 1e-5, (name, key)
    assert abs(splits["planted"]["losses"][0] - one["losses"][0]) > 1e-4


def full_logits_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sequence_logps' [2, rows] from full logits (transformers' model's), by log_softmax and gather."""
    token = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return preference.sequence_logps(token * (labels != -100), labels)


def held_out_oracle(data, run) -> dict:
    """The validation of the held-out pairs recomputed here from the run's final model, all in one batch, against
    the held-out rows of its stored reference (the last 5)."""
    pairs, counts = read_pairs(data["held"], data["base"], SEQ)
    micro = preference.PreferenceSource(pairs, counts, SEQ, 0, len(pairs), "held").rows(list(range(len(pairs))))
    with torch.no_grad():
        logps = head_loss(run["model"], micro.inputs, micro.labels, preference.sequence_logps, False)
    policy, reference = logps[0].view(2, -1), run["reference"][-len(pairs):].t().float()
    losses, chosen, rejected = preference.pair_losses(run["objective"], policy, reference, logps[1].view(2, -1))
    return {"val_loss": float(losses.mean()), "val_rewards_margins": float((chosen - rejected).mean()),
            "val_rewards_accuracy": float((chosen > rejected).float().mean())}


def test_held_out_pairs_are_validated_against_the_same_reference_at_every_split_and_against_the_policy_is_caught(
        splits, data):
    one = splits["1 x 8"]
    assert len(one["val_loss"]) == 2 and len(one["reference"]) == 8 + len(HELD)
    for name in ("2 x 2 x 2 ZeRO-1", "2 x 2 x 2 ZeRO-3", "TP 2", "4 x 2 ZeRO-1", "4 x 2 ZeRO-3"):
        run = splits[name]
        assert max(abs(a - b) for a, b in zip(run["val_loss"], one["val_loss"])) <= 1e-6, (name, run["val_loss"])
        for key in dpo_jobs.VAL_FIGURES:
            assert len(run[key]) == 2, (name, key)  # log-probs: within 1e-6 relative; the rest within 1e-5
            assert all(abs(a - b) <= 1e-5 * max(1, abs(b) / 10) for a, b in zip(run[key], one[key])), (name, key)
    # the held-out rows of the stored reference are the base model's log-probs (transformers' forward of it)
    import transformers

    pairs, counts = read_pairs(data["held"], data["base"], SEQ)
    micro = preference.PreferenceSource(pairs, counts, SEQ, 0, len(pairs), "held").rows(list(range(len(pairs))))
    base = transformers.AutoModelForCausalLM.from_pretrained(data["base"], dtype=torch.float32)
    with torch.no_grad():
        logps = full_logits_logps(base(micro.inputs).logits, micro.labels)[0].view(2, -1).t()
    assert rel(one["reference"][8:], logps) <= 1e-5
    # the last validation is the final model's on the held-out pairs against those rows, and the summary's
    oracle = held_out_oracle(data, one)
    for key, value in oracle.items():
        assert abs(one[key][-1] - value) <= 1e-6, (key, one[key][-1], value)
    assert oracle["val_loss"] != pytest.approx(LN2, abs=1e-4)  # the policy moved away from the reference
    assert one["summary"]["preference"]["validation"] == {"step": 2, "val_pairs": len(HELD),
                                                          **{k: one[k][-1] for k in dpo_jobs.VAL_FIGURES}}
    # the planted validation against the policy: ln 2 and no reward, whatever the model; the oracle tells
    planted = splits["validated against the policy"]
    assert planted["val_loss"] == [LN2] and planted["val_rewards_margins"] == [0.0]
    assert abs(planted["val_loss"][-1] - held_out_oracle(data, planted)["val_loss"]) > 1e-5


def test_a_resume_reads_the_held_out_reference_back_bitwise_and_other_held_out_pairs_are_refused(splits, data,
                                                                                                 group, tmp_path):
    one = splits["1 x 8"]
    step1 = os.path.join(os.path.dirname(one["summary"]["checkpoints"][0]), "step_00000001")

    def resumed(name, held):
        cfg = dpo_config(tmp_path / name, data, steps=2, eval_every=1, val_data=held, resume=step1)
        return dpo_jobs.log_of(train(cfg, group))

    again = resumed("resumed", data["held"])
    assert again["losses"] == one["losses"][1:] and again["digests"] == one["digests"]
    assert all(again[k] == one[k][1:] for k in dpo_jobs.VAL_FIGURES)
    other = write_jsonl(tmp_path / "other-held.jsonl", HELD[:4])  # planted: other held-out pairs than those scored
    with pytest.raises(ConfigError, match="and its held-out pairs .* is not the pairs the reference of"):
        resumed("other held-out", other)


def test_val_fraction_holds_out_records_of_the_pairs_file_and_eval_every_needs_held_out_pairs(data):
    train_pairs, held = pairs_module.read_splits(data["plain"], "", 0.25, True, data["base"], SEQ)
    everything = read_pairs(data["plain"], data["base"], SEQ)[0]
    assert held[0] and len(train_pairs[0]) + len(held[0]) == len(everything)
    assert sorted(map(repr, train_pairs[0] + held[0])) == sorted(map(repr, everything))
    assert len(pairs_module.read_splits(data["plain"], "", 0.01, True, data["base"], SEQ)[1][0]) == 1  # one at least
    assert pairs_module.read_splits(data["plain"], "", 0.25, False, data["base"], SEQ) == \
        (read_pairs(data["plain"], data["base"], SEQ), None)  # without --eval-every every pair trains


# ----------------------------------------------------------------------------- LoRA, resume, refusals

def test_lora_with_the_live_reference_equals_the_precomputed_one_and_adapters_left_on_are_caught(data, group,
                                                                                               tmp_path, monkeypatch):
    def lora(name, **over):
        cfg = dpo_config(tmp_path / name, data, steps=2, lora_rank=4, lora_alpha=8.0, **over)
        return [r["loss"] for r in train(cfg, group).records]

    precomputed, live = lora("pre"), lora("live", dpo_reference="live")
    assert precomputed[0] == LN2 and precomputed[1] < LN2 - 1e-4
    assert max(abs(a - b) for a, b in zip(live, precomputed)) <= 1e-6
    # at ZeRO-3 the base is sharded: the reference's forward gathers it unit by unit (within the plan, checked strictly)
    assert max(abs(a - b) for a, b in zip(lora("live z3", dpo_reference="live", zero=3), precomputed)) <= 1e-6
    assert not os.path.exists(tmp_path / "live" / "checkpoints" / preference.REFERENCE_FILE)
    monkeypatch.setattr(preference, "adapters_off", lambda model: torch.no_grad())  # planted: the policy, adapters on
    assert lora("left on", dpo_reference="live") == [LN2, LN2]


def test_a_resume_is_bitwise_and_a_reference_scored_again_from_the_trained_policy_is_caught(runs, data, group,
                                                                                          tmp_path, monkeypatch):
    whole = runs["sigmoid"]  # 5 steps, step 4 saved
    step4 = whole["checkpoints"][0]
    assert step4.endswith("step_00000004")

    def resumed(name):
        result = train(dpo_config(tmp_path / name, data, resume=step4), group)
        return [r["loss"] for r in result.records], result.digests

    losses, digests = resumed("resumed")
    assert losses == whole["losses"][4:] and digests == whole["digests"]
    real = preference.Preference.prepare

    def rescored(self, engine, comm, manifest, resumed_from, base):  # planted: the reference scored at the resume
        return real(self, engine, comm, manifest, None, base)

    monkeypatch.setattr(preference.Preference, "prepare", rescored)
    assert resumed("rescored")[0] != losses


def test_a_resume_with_another_base_is_refused_in_one_line(runs, data, tmp_path, capfd):
    step = runs["sigmoid"]["checkpoints"][0]
    other = tmp_path / "other-base"
    shutil.copytree(data["base"], other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    done = zerotrain_here(capfd, "train", "--method", "dpo", "--init-from", str(other), "--resume", step, "--data",
                          data["plain"], "--steps", "5", "--micro-batch", "8", "--seq-len", str(SEQ), "--out",
                          str(tmp_path / "refused"), "--no-progress")
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "is not the base the reference of" in errors[0] and "model.safetensors" in errors[0]
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- records

def test_an_implicit_prompt_is_the_common_first_messages_and_a_bad_record_is_one_line(data, tmp_path):
    explicit = CHAT[0]
    implicit = {"chosen": explicit["prompt"] + explicit["chosen"],
                "rejected": explicit["prompt"] + explicit["rejected"]}
    assert parse_pair(implicit, "x:1") == parse_pair(explicit, "x:1")
    with pytest.raises(ConfigError, match=r"^x:2: not a preference pair"):
        parse_pair({"prompt": "a", "completion": "b"}, "x:2")
    with pytest.raises(ConfigError, match=r"x:3: chosen and rejected are the same conversation"):
        parse_pair({"chosen": implicit["chosen"], "rejected": implicit["chosen"]}, "x:3")


def test_a_pair_is_cut_prompt_first_from_the_left_and_a_completion_is_never_emptied():
    pair = Pair(tuple(range(10)), (20, 21, 22), (30,))
    assert fit(pair, 8) == (Pair(tuple(range(5, 10)), (20, 21, 22), (30,)), True, False)
    assert fit(pair, 13) == (pair, False, False)
    cut, prompt_cut, completion_cut = fit(Pair((1, 2), tuple(range(20)), (30, 31)), 6)
    assert cut == Pair((2,), tuple(range(5)), (30, 31)) and prompt_cut and completion_cut
    assert fit(Pair((1,), (5,), (6,)), 2)[0] == Pair((1,), (5,), (6,))


def test_the_start_line_counts_cut_and_dropped_records(data, tmp_path):
    pairs, counts = read_pairs(data["plain"], data["base"], SEQ)
    assert len(pairs) == 8 and counts.prompts_cut == 1 and counts.completions_cut == 0 and counts.dropped == 0
    assert "8 pairs (1 prompt cut from the left" in counts.describe()
    # an empty chosen still gets the end-of-text token (TRL's rule); after a prompt that ends with it, none
    dropped = write_jsonl(tmp_path / "d.jsonl", PLAIN[:2] + [{"prompt": "Q", "chosen": "", "rejected": "x"},
                                                           {"prompt": "Q</s>", "chosen": "", "rejected": "x"}])
    pairs, counts = read_pairs(dropped, data["base"], SEQ)
    assert len(pairs) == 3 and pairs[2].chosen == (2,) and counts.dropped == 1
    assert "3 pairs (0 prompts cut from the left, 0 pairs with completions cut, 1 record dropped" in counts.describe()
    assert all(len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= SEQ + 1 for p in pairs)


def test_the_plan_counts_the_doubled_micro_batch_and_the_reference(data, tmp_path):
    cfg = dpo_config(tmp_path, data, micro=4)
    plan = plan_module.memory_plan(cfg)
    sft = plan_module.memory_plan(replace(cfg, objective=replace(cfg.objective, method="sft")), micro_batch=8)
    # 2 x 4 sequences; the head keeps its input, each token's log-sum-exp and target (12 bytes) for the log-probs,
    # where the summed loss keeps the gradients of its input and weight (fp32)
    m = cfg.model
    assert plan.rows["activations"] - sft.rows["activations"] == 8 * SEQ * 12 - m.vocab_size * m.n_embd * 4
    assert plan.rows["reference"] == 16 * 8
    assert sft.rows["reference"] == 0


@pytest.mark.parametrize("argv, says", [
    ((), "--method dpo tunes a trained model: give it with --init-from"),
    (("--init-from", "BASE", "--eval-every", "2", "--val-fraction", "0"),
     "--eval-every 2: --method dpo validates on held-out pairs: give --val-fraction above 0"),
    (("--init-from", "BASE", "--dpo-label-smoothing", "0.5"), "--dpo-label-smoothing must be in [0, 0.5)"),
])
def test_a_dpo_run_it_cannot_make_is_refused_in_one_line(data, capfd, tmp_path, argv, says):
    argv = [data["base"] if a == "BASE" else a for a in argv]
    done = zerotrain_here(capfd, "train", "--method", "dpo", "--data", data["plain"], "--out", str(tmp_path),
                          "--no-progress", *argv)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_each_loss_at_the_reference_is_its_known_value(data, tmp_path):
    """At Delta = 0, step 1's (away from it, and simpo and orpo: against TRL over five steps, test_dpo_losses.py)."""
    cfg = dpo_config(tmp_path, data).objective
    policy, counts = torch.tensor([[-3.0, -5.0], [-4.0, -2.0]]), torch.tensor([[2.0, 5.0], [4.0, 2.0]])
    at = {loss: preference.pair_losses(replace(cfg, dpo_loss=loss), policy, policy, counts)[0]
          for loss in ("sigmoid", "ipo", "hinge")}
    assert torch.equal(at["sigmoid"], torch.full((2,), LN2)) and torch.equal(at["hinge"], torch.ones(2))
    assert torch.allclose(at["ipo"], torch.full((2,), (1 / (2 * cfg.dpo_beta)) ** 2))
    smoothed = preference.pair_losses(replace(cfg, dpo_label_smoothing=0.2), policy, policy, counts)[0]
    assert torch.allclose(smoothed, torch.full((2,), LN2))  # (0.8 ln 2 - 0.2 ln 2) / 0.6
