"""Each --dpo-loss against TRL over five steps off the reference: hinge and label-smoothed sigmoid against TRL's
DPOTrainer (loss types hinge and robust), simpo against its CPOTrainer (loss_type simpo, no NLL term), orpo against
its ORPOTrainer (trl.experimental in TRL 1.x); sigmoid and ipo are in test_dpo.py. Losses and grad norms within
1e-5, with margins away from 0 (asserted), and for each loss a bug planted in the product's pair_losses is caught.

Kept short for CI: one TRL run of five steps per loss (module fixture), one zerotrain run each beside it, and a
planted run of two steps each, all in this process on one rank."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from conftest import world_of_one
from model_folders import CHATML, llama_folder, write_jsonl
from test_dpo import LN2, LONG, PLAIN, SEQ, dpo_config, recording, rel, trained, trl_args, trl_run

from zerotrain.config import REFERENCE_FREE
from zerotrain.data.pairs import read_pairs
from zerotrain.training import preference
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(400)
HINGE_BETA = 0.3  # large enough that at step 4 some pairs are past the hinge (beta Delta > 1: flat) and some not
SMOOTHING = 0.2
# TRL's CPOTrainer and ORPOTrainer do not cut a prompt from the left: pairs that fit the window
SHORT = [dict(p, prompt=p["prompt"].removeprefix(LONG)) for p in PLAIN]
# TRL's ORPO NLL term is the cross-entropy of the chosen rows' every token after the first, prompt included, over the
# batch's tokens; zerotrain's is each pair's mean over its chosen completion (docs/dpo.md). They coincide where the
# prompt is BOS alone and every chosen completion has as many tokens: these pairs (the question in the completion)
NO_PROMPT = [{"prompt": "", "chosen": f"Question {i}: what is {i} plus {i}? Answer: {2 * i}.",
              "rejected": f"Question {i}: what is {i} plus {i}? Answer: {2 * i + 1}."} for i in range(8)]


@pytest.fixture(scope="module")
def group():
    with world_of_one() as comm:
        yield comm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny random Llama of test_dpo.py (the same seed) and the pairs as JSON Lines."""
    tmp = tmp_path_factory.mktemp("dpo-losses-data")
    llama_folder(tmp / "base", template=CHATML)
    return {"base": str(tmp / "base"), "plain": write_jsonl(tmp / "plain.jsonl", PLAIN),
            "short": write_jsonl(tmp / "short.jsonl", SHORT), "no prompt": write_jsonl(tmp / "np.jsonl", NO_PROMPT)}


def trl_reference_free_run(data, records, loss_type, out) -> dict:
    """Five steps of TRL's CPOTrainer (simpo: SimPO, cpo_alpha 0, the default gamma 0.5) or ORPOTrainer (orpo) at
    beta 0.1: their losses and grad norms."""
    import datasets
    import transformers
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    losses = []
    if loss_type == "simpo":
        trainer_class, args = CPOTrainer, CPOConfig(**trl_args(out, 5, beta=0.1), loss_type="simpo", cpo_alpha=0.0,
                                                    simpo_gamma=0.5)
    else:
        trainer_class, args = ORPOTrainer, ORPOConfig(**trl_args(out, 5, beta=0.1))
    model = transformers.AutoModelForCausalLM.from_pretrained(data["base"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(data["base"])
    tokenizer.pad_token = tokenizer.eos_token  # their collator pads; the padding is masked out of every loss
    trainer = recording(trainer_class, losses)(model=model, args=args, processing_class=tokenizer,
                                               train_dataset=datasets.Dataset.from_list(records))
    return trained(trainer, losses)


@pytest.fixture(scope="module")
def trl(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-losses")
    return {"hinge": trl_run(data, PLAIN, "hinge", out=tmp / "h", logps=False, beta=HINGE_BETA),
            "robust": trl_run(data, PLAIN, "robust", out=tmp / "r", logps=False, label_smoothing=SMOOTHING),
            "simpo": trl_reference_free_run(data, SHORT, "simpo", tmp / "s"),
            "orpo": trl_reference_free_run(data, NO_PROMPT, "orpo", tmp / "o")}


# Each loss's zerotrain run: its data and settings, and the bug planted in pair_losses (the product's function, as
# the step calls it) that the comparison with TRL must catch
RUNS = {
    "hinge": ("plain", dict(dpo_loss="hinge", dpo_beta=HINGE_BETA),
              # the hinge's sign: max(0, 1 + beta Delta) (chosen and rejected swapped)
              lambda real: lambda o, p, r, c: real(o, p.flip(0), r.flip(0), c.flip(0))),
    "robust": ("plain", dict(dpo_label_smoothing=SMOOTHING),
               # label smoothing dropped: plain DPO's loss
               lambda real: lambda o, p, r, c: real(replace(o, dpo_label_smoothing=0.0), p, r, c)),
    "simpo": ("short", dict(dpo_loss="simpo"),
              # SimPO's target margin gamma dropped
              lambda real: lambda o, p, r, c: real(replace(o, simpo_gamma=0.0), p, r, c)),
    "orpo": ("no prompt", dict(dpo_loss="orpo"),
             # ORPO's odds-ratio term dropped (its weight beta 0): the NLL term alone
             lambda real: lambda o, p, r, c: real(replace(o, dpo_beta=0.0), p, r, c)),
}


@pytest.fixture(scope="module")
def runs(data, group, tmp_path_factory):
    """zerotrain's five steps of each loss beside TRL's, and two steps of each with its planted bug."""
    tmp = tmp_path_factory.mktemp("dpo-loss-runs")
    out = {}

    def run(name, records, steps, **over):
        result = train(dpo_config(tmp / name, data, records, steps=steps, **over), group)
        out[name] = {"losses": [r["loss"] for r in result.records],
                     "grad_norms": [r["grad_norm"] for r in result.records],
                     "margins": [r["rewards_margins"] for r in result.records],
                     "reference file": os.path.exists(tmp / name / "checkpoints" / preference.REFERENCE_FILE)}

    mp = pytest.MonkeyPatch()
    try:
        for loss, (records, over, planted) in RUNS.items():
            run(loss, records, 5, **over)
            mp.setattr(preference, "pair_losses", planted(preference.pair_losses))
            run(f"{loss} planted", records, 2, **over)
            mp.undo()
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("loss", list(RUNS))
def test_five_steps_off_the_reference_equal_trls_and_a_bug_planted_in_the_loss_is_caught(runs, trl, loss):
    ours, theirs = runs[loss], trl[loss]
    assert len(ours["losses"]) == len(theirs["losses"]) == len(theirs["grad_norms"]) == 5
    assert rel(ours["losses"], theirs["losses"]) <= 1e-5, (ours["losses"], theirs["losses"])
    assert rel(ours["grad_norms"], theirs["grad_norms"]) <= 1e-5, (ours["grad_norms"], theirs["grad_norms"])
    # off the reference: the mean margin is away from 0 from step 2 on (at step 1 the policy is the reference: 0
    # exactly); simpo's and orpo's, without a reference, are beta times the difference of the completions' mean token
    # log-probs (orpo's pairs differ in one token of 14: theirs is the smallest, 0.004 to 0.009)
    if loss in REFERENCE_FREE:
        assert min(abs(m) for m in ours["margins"][1:]) > 3e-3, ours["margins"]
    else:
        assert ours["margins"][0] == 0 and min(abs(m) for m in ours["margins"][1:]) > 0.05, ours["margins"]
    planted = runs[f"{loss} planted"]["losses"]
    assert rel(planted, theirs["losses"][:2]) > 1e-3, (loss, planted, theirs["losses"][:2])


def test_the_hinge_is_flat_for_some_pairs_and_label_smoothing_changes_the_loss(runs, trl):
    hinge = runs["hinge"]
    # a step where some pairs are past the hinge (beta Delta > 1: loss 0) and some are not: the mean of
    # max(0, 1 - beta Delta) is above 1 - the mean margin, and above 0
    assert any(1 - m + 1e-2 < loss and loss > 1e-2 for loss, m in zip(hinge["losses"], hinge["margins"])), hinge
    # label smoothing changes the loss away from the reference (at step 1 both are ln 2), by TRL's own runs too; the
    # run without it is the planted one, caught above
    robust, plain = runs["robust"]["losses"], runs["robust planted"]["losses"]
    assert robust[0] == plain[0] == LN2 and abs(robust[1] - plain[1]) > 1e-2
    assert abs(trl["robust"]["losses"][1] - plain[1]) > 1e-2


def test_simpo_and_orpo_train_without_a_reference_and_orpos_pairs_meet_trls_definition(runs, data):
    assert not runs["simpo"]["reference file"] and not runs["orpo"]["reference file"]
    assert runs["hinge"]["reference file"]
    # where the two ORPO NLL terms coincide: the prompt BOS alone, every chosen completion as long
    pairs, _ = read_pairs(data["no prompt"], data["base"], SEQ)
    assert {len(p.prompt) for p in pairs} == {1} and len({len(p.chosen) for p in pairs}) == 1

