"""GRPO's loss and advantages against TRL 1.16's GRPOTrainer, run here on a tiny local Llama (no downloads): the loss,
its gradient and its metrics equal TRL's _compute_loss within 1e-6 for each loss type, beta 0 and > 0, num_iterations
1 and 2; the advantages and completion masks equal those of TRL's _generate_and_score_completions for each
scale_rewards, with None rewards and weights. Planted in the product's functions: advantages not normalised, the KL
term's sign (its direction), dapo normalised per sequence; each caught."""

from __future__ import annotations

import itertools

import pytest
import torch
from model_folders import llama_folder

from zerotrain.training import grpo_loss as gl
from zerotrain.training.rewards import weighted_reward

pytestmark = pytest.mark.timeout(300)
G, L = 4, 6  # completions per prompt, max_completion_length
EOS = 2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A tiny GRPOTrainer on a random Llama whose EOS logit is raised, so sampled completions end at varied lengths
    (some never end: truncated)."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tmp = tmp_path_factory.mktemp("grpo")
    tokenizer = llama_folder(tmp / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "base"))
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.model.norm.weight * 3.0  # EOS likely after most hidden states, not all
    model.save_pretrained(str(tmp / "base"))
    records = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(3)]
    args = GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=3 * G, num_generations=G,
                      max_completion_length=L, report_to="none", use_cpu=True, seed=0)
    trainer = GRPOTrainer(model=str(tmp / "base"), reward_funcs=[lambda **kw: [0.0] * len(kw["prompts"])], args=args,
                          train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)
    trainer.records = records
    return trainer


def trl_loss(trainer, monkeypatch, batch, *, loss_type, beta, epsilon_high=0.28, micro_batches=1, correction=True):
    """TRL's _compute_loss over `batch` split into `micro_batches` (its gradient accumulation), the per-token log-probs
    and entropies given in place of its model's; the summed loss, the gradient of the log-probs, TRL's metrics."""
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer, "epsilon_high", epsilon_high)
    monkeypatch.setattr(trainer.args, "steps_per_generation", micro_batches)
    monkeypatch.setattr(trainer.args, "use_bias_correction_kl", correction)
    trainer.current_gradient_accumulation_steps = micro_batches
    trainer.model.train()
    trainer._metrics["train"].clear()
    logps = batch["logps"].clone().requires_grad_(True)
    total = 0.0
    for rows in torch.arange(len(logps)).chunk(micro_batches):
        monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                            lambda *a, rows=rows, **k: (logps[rows], batch["entropies"][rows], None))
        inputs = {"prompt_ids": torch.ones(len(rows), 1, dtype=torch.long), "prompt_mask": torch.ones(len(rows), 1),
                  "completion_ids": torch.zeros(len(rows), L, dtype=torch.long), "completion_mask": batch["mask"][rows],
                  "advantages": batch["advantages"][rows], "num_items_in_batch": batch["mask"].sum()}
        if batch.get("old_logps") is not None:
            inputs["old_per_token_logps"] = batch["old_logps"][rows]
        if beta:
            inputs["ref_per_token_logps"] = batch["ref_logps"][rows]
        total = total + trainer._compute_loss(None, inputs)
    total.backward()
    metrics = {k: v[-1] if len(v) == 1 else v for k, v in trainer._metrics["train"].items()}
    return total.detach(), logps.grad, metrics


def ours(batch, *, loss_type, beta, epsilon_high=0.28, micro_batches=1, correction=True):
    """zerotrain's loss over `batch` split into `micro_batches`, each normalised for the whole step; its gradient and
    its metric sums added up."""
    logps = batch["logps"].clone().requires_grad_(True)
    total, sums = 0.0, {}
    for rows in torch.arange(len(logps)).chunk(micro_batches):
        normaliser = gl.loss_normaliser(loss_type, rows=len(logps), tokens=batch["mask"].sum(),
                                        max_completion_length=L, micro_batch_tokens=batch["mask"][rows].sum(),
                                        micro_batches=micro_batches)
        loss, stats = gl.grpo_loss(logps[rows], batch["advantages"][rows], batch["mask"][rows], normaliser,
                                   loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=epsilon_high,
                                   old_logps=None if batch.get("old_logps") is None else batch["old_logps"][rows],
                                   ref_logps=batch["ref_logps"][rows], entropies=batch["entropies"][rows],
                                   kl_bias_correction=correction)
        total = total + loss
        for k, v in vars(stats).items():
            if v is not None:
                sums[k] = sums.get(k, 0.0) + v
    total.backward()
    return total.detach(), logps.grad, sums


def random_batch(seed: int, num_iterations: int, rows: int = 8) -> dict:
    """Log-probs near the generating policy's (ratios both inside and outside the clip range when num_iterations is
    2), masks of varied lengths (one row empty), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, L, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, L + 1, (rows,), generator=g)
    lengths[3] = 0
    mask = (torch.arange(L) < lengths[:, None]).int()
    old = logps + torch.randn(rows, L, generator=g, dtype=torch.float64) * 0.6 if num_iterations == 2 else None
    return {"logps": logps, "old_logps": old, "mask": mask,
            "ref_logps": logps + torch.randn(rows, L, generator=g, dtype=torch.float64) * 0.5,
            "advantages": torch.randn(rows, generator=g, dtype=torch.float64),
            "entropies": torch.rand(rows, L, generator=g, dtype=torch.float64) * 4}


# Each loss type at beta 0 and 0.04 and num_iterations 1 and 2, with TRL's default KL correction; without it at 0.04
CASES = [(*case, True) for case in itertools.product(gl.LOSS_TYPES, (0.0, 0.04), (1, 2))] + \
    [(loss_type, 0.04, n, False) for loss_type in ("grpo", "dapo") for n in (1, 2)]


@pytest.mark.parametrize("loss_type,beta,num_iterations,correction", CASES)
def test_the_loss_its_gradient_and_metrics_equal_trls(trainer, monkeypatch, loss_type, beta, num_iterations,
                                                      correction):
    batch = random_batch(CASES.index((loss_type, beta, num_iterations, correction)), num_iterations)
    want, want_grad, metrics = trl_loss(trainer, monkeypatch, batch, loss_type=loss_type, beta=beta,
                                        correction=correction)
    got, grad, sums = ours(batch, loss_type=loss_type, beta=beta, correction=correction)
    assert abs(got - want) < 1e-6 and want.abs() > 1e-3, (got, want)
    assert torch.allclose(grad, want_grad, atol=1e-6, rtol=0)
    tokens = sums["tokens"]
    assert abs(sums["entropy"] / tokens - metrics["entropy"]) < 1e-6
    assert abs(sums["clipped_low"] / tokens - metrics["clip_ratio/low_mean"]) < 1e-6
    assert abs(sums["clipped_high"] / tokens - metrics["clip_ratio/high_mean"]) < 1e-6
    assert abs(sums["clipped"] / tokens - metrics["clip_ratio/region_mean"]) < 1e-6
    if num_iterations == 2:  # the clip acts: some tokens of both kinds are clipped
        assert sums["clipped_low"] > 0 and sums["clipped_high"] > 0
    if beta:
        assert abs(sums["kl"] / tokens - metrics["kl"]) < 1e-6 and sums["kl"] > 0


@pytest.mark.parametrize("loss_type", gl.LOSS_TYPES)
def test_a_step_split_into_micro_batches_is_trls_accumulation_and_only_bnpo_depends_on_the_split(
        trainer, monkeypatch, loss_type):
    """grpo, dr_grpo and dapo give the step's loss whatever the split (each micro-batch normalised for the whole step);
    bnpo is TRL's per-micro-batch mean, equal to TRL's at TRL's split and different at another."""
    batch = random_batch(100, 2)
    whole, whole_grad, _ = ours(batch, loss_type=loss_type, beta=0.04)
    split, split_grad, _ = ours(batch, loss_type=loss_type, beta=0.04, micro_batches=2)
    want, want_grad, _ = trl_loss(trainer, monkeypatch, batch, loss_type=loss_type, beta=0.04, micro_batches=2)
    assert abs(split - want) < 1e-6 and torch.allclose(split_grad, want_grad, atol=1e-6, rtol=0)
    if loss_type == "bnpo":
        assert abs(split - whole) > 1e-3
    else:
        assert abs(split - whole) < 1e-9 and torch.allclose(split_grad, whole_grad, atol=1e-12, rtol=0)


def test_dapo_normalised_per_sequence_is_caught(trainer, monkeypatch):
    batch = random_batch(7, 2)
    want = trl_loss(trainer, monkeypatch, batch, loss_type="dapo", beta=0.0)[0]
    sequence_mean = gl.sequence_mean_first
    monkeypatch.setattr(gl, "sequence_mean_first", lambda loss_type: True)  # planted: dapo averages each row first
    planted = ours(batch, loss_type="dapo", beta=0.0)[0]
    monkeypatch.setattr(gl, "sequence_mean_first", sequence_mean)
    monkeypatch.setattr(gl, "loss_normaliser", lambda loss_type, *, rows, **k: rows)  # and divides by the rows
    planted_too = ours(batch, loss_type="dapo", beta=0.0)[0]
    assert abs(planted - want) > 1e-3 and abs(planted_too - want) > 1e-3


def test_the_kl_terms_direction_is_caught(trainer, monkeypatch):
    batch = random_batch(8, 1)
    want = trl_loss(trainer, monkeypatch, batch, loss_type="grpo", beta=0.04)[0]
    kl = gl.per_token_kl
    monkeypatch.setattr(gl, "per_token_kl", lambda logps, ref: kl(ref, logps))  # planted: KL(ref || policy)'s k3
    assert abs(ours(batch, loss_type="grpo", beta=0.04)[0] - want) > 1e-5


def trl_rollout(trainer, monkeypatch, per_function, weights, scale_rewards):
    """TRL's _generate_and_score_completions over the trainer's 3 prompts x G completions (sampled by its model),
    scored by reward functions returning the columns of `per_function` (None where NaN)."""
    funcs = []
    for i in range(per_function.shape[1]):
        def reward(prompts, completions, completion_ids, i=i, **kw):
            return [None if torch.isnan(v) else float(v) for v in per_function[:, i]]
        reward.__name__ = f"r{i}"
        funcs.append(reward)
    monkeypatch.setattr(trainer, "reward_funcs", funcs)
    monkeypatch.setattr(trainer, "reward_func_names", [f.__name__ for f in funcs])
    monkeypatch.setattr(trainer, "reward_processing_classes", [None] * len(funcs))
    monkeypatch.setattr(trainer, "reward_weights", torch.tensor(weights))
    monkeypatch.setattr(trainer, "scale_rewards", scale_rewards)
    inputs = [r for r in trainer.records for _ in range(G)]
    return trainer._generate_and_score_completions(inputs)


def planted_rewards(seed: int) -> torch.Tensor:
    """Scores of 3 x G completions by two functions: one group all equal (std 0), Nones in places, one completion
    scored by neither."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3 * G, 2, generator=g)
    scores[:G, 0] = 1.5
    scores[:G, 1] = float("nan")
    scores[5, 0] = float("nan")
    scores[9] = float("nan")
    return scores


@pytest.mark.parametrize("scale_rewards", gl.SCALE_REWARDS)
def test_advantages_equal_trls_with_nones_and_weights_and_unnormalised_advantages_are_caught(
        trainer, monkeypatch, scale_rewards):
    per_function = planted_rewards(1)
    weights = [1.0, 0.5]
    out = trl_rollout(trainer, monkeypatch, per_function, weights, scale_rewards)
    rewards = weighted_reward(per_function, torch.tensor(weights))
    advantages, zero_std = gl.group_advantages(rewards, G, scale_rewards)
    assert torch.allclose(advantages, out["advantages"], atol=1e-6, rtol=0)
    assert advantages[9] == 0 and advantages.abs().max() > 0.5
    assert zero_std[:G].all() == (scale_rewards != "batch")  # the equal group's std is 0, the batch's is not
    assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(zero_std.float().mean().item())
    if scale_rewards != "none":
        monkeypatch.setattr(gl, "nanstd", lambda x, dim=None: torch.ones_like(x if dim is None else x.mean(dim)))
        planted = gl.group_advantages(rewards, G, scale_rewards)[0]  # planted: the std left out
        assert not torch.allclose(planted, out["advantages"], atol=1e-3, rtol=0)


@pytest.mark.parametrize("mask_truncated", (False, True))
def test_completion_masks_equal_trls_and_truncated_completions_masked_or_not_differ(trainer, monkeypatch,
                                                                                    mask_truncated):
    monkeypatch.setattr(trainer, "mask_truncated_completions", mask_truncated)
    out = trl_rollout(trainer, monkeypatch, planted_rewards(2), [1.0, 1.0], "group")
    ids = out["completion_ids"]
    ended = (ids == EOS).any(dim=1)
    assert ended.any() and not ended.all()  # both kinds drawn
    # TRL pads a finished row with its pad token (the EOS here): the product's mask must stop at the first EOS
    mask = gl.completion_mask(ids, [EOS], mask_truncated)
    assert torch.equal(mask, out["completion_mask"].int())
    assert not torch.equal(mask, gl.completion_mask(ids, [EOS], not mask_truncated))
