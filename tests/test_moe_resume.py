"""A mixture of experts resumes bitwise from its checkpoint, and reshards onto another world size.

The tiny Qwen3-MoE (qwen3-moe-tiny, --moe-aux-coef 0.5: the balancing term a large part of the loss) on 2 ranks at
ZeRO-1: 6 steps saving at step 3, then a fresh run resumed from step 3. The resumed run's losses, balancing losses and
expert loads equal the uninterrupted run's bit for bit, and so do its final weights (every expert's, the routers'); a
resume that loses AdamW's moments (planted in checkpoint.resume, which the loop calls) is caught. The step-3
checkpoint resumed on 1 rank (the same global batch of 4 sequences: micro-batch 4) trains the last 3 steps as the
2 ranks did, within float noise (another world size sums in another order).

The uninterrupted run validates at step 3 (--eval-every 3, 2 batches): its val_loss is the cross-entropy alone
(docs/metrics.md: the balancing term is training's, not the model's fit), the mean token loss of the step-3 weights on
the validation rows counted here by hand, and `zerotrain eval` of the step-3 checkpoint prints the same; an eval that
adds the weighted balancing term (as transformers' eval loss does with output_router_logits), planted in
training/evaluate.py's path, is caught. The resumed run, which never validates, still equals the validating run bit
for bit: validation leaves nothing in the training (the routing its forwards record included).
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from conftest import zerotrain_here
from test_checkpoint import spawn

from zerotrain import checkpoint, load_model
from zerotrain.config import Config
from zerotrain.data import IGNORE, make_source
from zerotrain.model.moe import balancing_loss
from zerotrain.training import evaluate
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training import loop
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--no-progress",
                                      "--steps", "6", "--moe-aux-coef", "0.5", "--lr", "1e-2", "--zero", "1",
                                      "--threads", "1", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def run_of(cfg, comm) -> dict:
    """The run's losses, balancing losses, expert loads, where it started, and its final weights (as lists)."""
    result = train(cfg, comm, announce=False)
    return {"start": result.start_step, "loss": [r["loss"] for r in result.records],
            "val_loss": {r["step"]: r["val_loss"] for r in result.records if "val_loss" in r},
            "aux_loss": [r["aux_loss"] for r in result.records],
            "expert_load": [r["expert_load"] for r in result.records],
            "params": {k: v.tolist() for k, v in result.engine.full_state_dict().items()}}


def resumed(out, step3, *flags):
    cfg = config(out, *flags)
    cfg.checkpoint.resume = step3
    return cfg


def without_moments(target, engine, comm, **kwargs):
    """Planted in place of checkpoint.resume: the resume loses AdamW's moments."""
    found = REAL_RESUME(target, engine, comm, **kwargs)
    engine.adamw.exp_avg.zero_()
    engine.adamw.exp_avg_sq.zero_()
    return found


REAL_RESUME = loop.checkpoint.resume


def two_rank_job(rank, comm, tmp_path):
    """2 ranks: the uninterrupted run (saving at step 3), the run resumed from step 3, the planted lossy resume."""
    first = run_of(config(tmp_path / "first", "--nproc", "2", "--micro-batch", "2", "--ckpt-every", "3",
                          "--eval-every", "3", "--eval-batches", "2"), comm)
    step3 = os.path.join(str(tmp_path / "first"), "checkpoints", checkpoint.step_name(3))
    out = {"first": first, "step3": step3,
           "resumed": run_of(resumed(tmp_path / "resumed", step3, "--nproc", "2", "--micro-batch", "2"), comm)}
    with mock.patch.object(loop.checkpoint, "resume", without_moments):
        out["planted"] = run_of(resumed(tmp_path / "planted", step3, "--nproc", "2", "--micro-batch", "2"), comm)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_resume")
    codes, results = spawn(two_rank_job, 2, tmp, timeout=240)
    assert codes == [0, 0], results
    return results[0]


def test_a_moe_resume_is_bitwise_losses_balancing_and_weights_and_a_lossy_resume_is_caught(two_ranks):
    first, again, planted = two_ranks["first"], two_ranks["resumed"], two_ranks["planted"]
    assert len(first["loss"]) == 6 and again["start"] == 3 and len(again["loss"]) == 3
    assert first["aux_loss"][3] * 0.5 > 0.1 * first["loss"][3]  # the balancing term weighs in the loss
    for key in ("loss", "aux_loss", "expert_load"):
        assert again[key] == first[key][3:], key  # exact equality, every step
    assert again["params"].keys() == first["params"].keys()
    assert any(".mlp.experts." in k for k in first["params"]) and any(".mlp.gate." in k for k in first["params"])
    assert again["params"] == first["params"]  # every expert's weights and the routers', bit for bit
    # planted: a resume that loses AdamW's moments
    assert planted["start"] == 3 and planted["loss"][0] == first["loss"][3]  # the weights came back...
    assert planted["loss"][1:] != first["loss"][4:] and planted["params"] != first["params"]  # ...the moments did not


def test_a_moe_checkpoint_of_2_ranks_resumes_on_1_rank_and_trains_on_as_the_2_ranks_did(two_ranks, one_rank,
                                                                                         tmp_path):
    first = two_ranks["first"]
    cfg = resumed(tmp_path / "one", two_ranks["step3"], "--nproc", "1", "--micro-batch", "4")
    one = run_of(cfg, one_rank)
    assert one["start"] == 3 and len(one["loss"]) == 3
    for key in ("loss", "aux_loss"):
        for got, want in zip(one[key], first[key][3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (key, one[key], first[key][3:])
    assert one["expert_load"] == first["expert_load"][3:]
    worst = max((torch.tensor(one["params"][k]) - torch.tensor(v)).abs().max().item()
                for k, v in first["params"].items())
    assert worst <= 1e-5, worst
    # the manifest of the 2-rank checkpoint named 2 ranks: this was a reshard, not a same-world resume
    with open(os.path.join(two_ranks["step3"], "manifest.json")) as f:
        assert json.load(f)["world_size"] == 2


def printed_val_loss(capfd, step3) -> float:
    r = zerotrain_here(capfd, "eval", step3, "--batches", "2")
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split()[1])


def test_a_moe_validation_is_the_token_loss_alone_eval_agrees_and_one_with_the_balancing_term_is_caught(
        two_ranks, capfd, monkeypatch):
    step3, coef = two_ranks["step3"], 0.5
    val = {int(step): v for step, v in two_ranks["first"]["val_loss"].items()}  # JSON keys
    assert set(val) == {3, 6}
    # by hand: the step-3 weights on the validation rows (2 batches of the run's 2 ranks x 2 sequences)
    with open(os.path.join(step3, "manifest.json")) as f:
        cfg = Config.from_dict(json.load(f)["config"])
    model = load_model(step3)
    token_sum, tokens, aux = 0.0, 0, []
    with torch.no_grad():
        for micro in evaluate.validation_sequences(make_source(cfg, split="val", global_batch=4), 2, batch=4,
                                                   micro_batch=4):
            logits = model(micro.inputs)
            token_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro.labels.flatten(),
                                                           ignore_index=IGNORE, reduction="sum").item()
            tokens += int((micro.labels != IGNORE).sum())
            aux.append(balancing_loss(model)[0])
    by_hand, aux_mean = token_sum / tokens, torch.cat(aux).mean().item()
    assert coef * aux_mean > 1e-2 * by_hand  # the balancing term, had it been added, would show
    assert val[3] == pytest.approx(by_hand, rel=1e-6)
    assert printed_val_loss(capfd, step3) == pytest.approx(val[3], abs=2e-6)  # eval prints 6 decimals

    # planted in eval's path (evaluate.summed_loss's head_loss): the weighted balancing term added to each
    # micro-batch's summed token loss, as transformers' eval loss with output_router_logits holds it
    real = evaluate.head_loss

    def with_balancing(model, x, y, loss_fn, recompute, segments=None):
        summed = real(model, x, y, loss_fn, recompute, segments)
        return summed + coef * balancing_loss(model)[0].mean() * int((y != IGNORE).sum())

    monkeypatch.setattr(evaluate, "head_loss", with_balancing)
    planted = printed_val_loss(capfd, step3)
    assert planted == pytest.approx(by_hand + coef * aux_mean, rel=1e-5)
    assert abs(planted - val[3]) > 1e-2 * val[3]
