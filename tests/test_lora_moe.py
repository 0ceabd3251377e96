"""LoRA on a mixture of experts: which linears get adapters, their dropout and their resume.

By default (--lora-targets all) the adapters go on every linear of the blocks that transformers' model holds as a
linear: the attention's projections (and a dense MLP's or a shared expert's), not the routed experts, which
transformers 5 stacks in 3-D tensors (peft's all-linear on that model).
`--lora-targets ...,experts` adapts each routed expert's three projections
too (merged export only). Dropout on the routed experts' 2-D rows trains, and a run stopped and resumed equals the
uninterrupted run bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from model_folders import moe_folder

from zerotrain import load_model
from zerotrain.config import LoraConfig
from zerotrain.model import lora
from zerotrain.model.moe import moe_layers
from zerotrain.training.loop import train
from test_moe_resume import config

pytestmark = pytest.mark.timeout(300)
EXPERTS = "q_proj,k_proj,v_proj,o_proj,experts"


def run_of(cfg, comm) -> dict:
    result = train(cfg, comm, announce=False)
    return {"start": result.start_step, "loss": [r["loss"] for r in result.records],
            "adapters": {n: p.detach().clone() for n, p in result.engine.model.named_parameters() if p.requires_grad},
            "checkpoints": result.checkpoints}


def lora_run(out, comm, *flags):
    return run_of(config(out, "--lora-rank", "4", "--lora-dropout", "0.25", "--lora-targets", EXPERTS, "--nproc", "1",
                         "--micro-batch", "4", *flags), comm)


def shared_generator_masks(keys, adapter, features, in_features, rows, p, device):
    """Planted in place of lora.routed_keep_mask: the routed experts' masks from torch's global generator."""
    return torch.rand(rows, in_features, device=device) >= p


def test_moe_lora_with_dropout_on_the_experts_resumes_bitwise_and_a_global_generators_masks_are_caught(
        one_rank, tmp_path, monkeypatch):
    first = lora_run(tmp_path / "first", one_rank, "--ckpt-every", "3")
    assert any(".mlp.experts." in n for n in first["adapters"]) and any(".q_proj." in n for n in first["adapters"])
    again = lora_run(tmp_path / "again", one_rank, "--resume", first["checkpoints"][0])
    assert again["start"] == 3 and again["loss"] == first["loss"][3:]  # exact, every step
    assert all(torch.equal(first["adapters"][n], again["adapters"][n]) for n in first["adapters"])
    plain = run_of(config(tmp_path / "plain", "--lora-rank", "4", "--lora-targets", EXPERTS, "--nproc", "1",
                          "--micro-batch", "4"), one_rank)
    assert plain["loss"][1:] != first["loss"][1:]  # the dropout drops
    monkeypatch.setattr(lora, "routed_keep_mask", shared_generator_masks)  # planted
    whole = lora_run(tmp_path / "planted", one_rank, "--ckpt-every", "3")
    part = lora_run(tmp_path / "planted_again", one_rank, "--resume", whole["checkpoints"][0])
    assert part["loss"] != whole["loss"][3:]


def test_a_shared_experts_dropout_masks_are_its_tokens_rows_and_positions(one_rank):
    """Qwen2-MoE's shared expert reads the tokens flattened: its masks are those of the (row, position) they are."""
    from zerotrain.config import ModelConfig, PRESETS
    from zerotrain.model import build_model

    cfg = ModelConfig(**{**PRESETS["qwen3-moe-tiny"], "arch": "qwen2_moe", "norm_topk_prob": False,
                         "shared_expert_width": 24})
    model = build_model(cfg, seed=0)
    lora.add_adapters(model, LoraConfig(rank=4, dropout=0.5), seed=0)
    shared = moe_layers(model)[0].shared_expert.up_proj.lora_dropout
    x = torch.ones(2 * 16, cfg.n_embd)
    with lora.dropout_rows(model, step=3, rows=range(5, 7)):
        flat = shared.train()(x)
        rows = shared(x.view(2, 16, -1))  # as (rows, positions, features)
    with lora.dropout_rows(model, step=3, rows=range(6, 7)):
        second = shared(x[16:])  # row 6 alone, flattened
    assert torch.equal(flat.view(2, 16, -1), rows) and torch.equal(flat[16:], second) and (flat == 0).any()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    moe_folder(root / "qwen3_moe", "qwen3_moe")
    return root / "qwen3_moe"


def test_the_default_targets_leave_the_routed_experts_out_and_train_with_dropout(qwen3_moe, tmp_path, capfd):
    from conftest import zerotrain_here

    model = load_model(str(qwen3_moe))
    lora.add_adapters(model, LoraConfig(rank=4), seed=0)
    adapted = [n for n, _ in lora.adapted_modules(model, LoraConfig().modules("qwen3_moe"))]
    assert adapted and not any(".experts." in n for n in adapted) and not any(n.endswith("mlp.gate") for n in adapted)
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--init-from", str(qwen3_moe), "--data", "synthetic", "--seq-len", "16",
                       "--micro-batch", "2", "--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "5e-2", "--steps",
                       "2", "--ckpt-every", "2", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]


def planned(out, comm, *flags) -> dict:
    """One step's plan, with the activations its first micro-batch saved (the run checks the state rows itself)."""
    return train(config(out, "--lora-rank", "4", "--lora-dropout", "0.25", "--nproc", "1", "--micro-batch", "2",
                        "--steps", "1", *flags), comm, announce=False).plan


def test_the_plan_counts_a_moe_lora_runs_activations_to_the_byte_and_routed_experts_counted_per_token_are_caught(
        one_rank, tmp_path, monkeypatch):
    """With dropout, the default targets (the attention's adapters; the routed experts frozen, their rows and
    products not kept) and `experts` (each routed projection's A output, dropped copy and mask over its rows, N k of
    them in all): the plan's activations are what the first micro-batch saved. Caught: a plan that takes the routed
    experts' linears for linears every token goes through."""
    from zerotrain.training import memory_plan

    for name, flags in (("default", ()), ("experts", ("--lora-targets", EXPERTS))):
        plan = planned(tmp_path / name, one_rank, *flags)
        assert plan["activations_measured"] == plan["rows"]["activations"], name
    monkeypatch.setattr(memory_plan, "routed_expert_linears", lambda model: set())  # planted
    plan = planned(tmp_path / "planted", one_rank, "--lora-targets", EXPERTS)
    assert plan["activations_measured"] != plan["rows"]["activations"]


def test_naming_an_mlp_projection_that_only_routed_experts_have_is_refused_in_one_line(capfd, tmp_path):
    from conftest import zerotrain_here
    from test_user_errors import one_line_error

    r = zerotrain_here(capfd, "train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--lora-rank", "4",
                       "--lora-targets", "q_proj,down_proj", "--steps", "1", "--out", str(tmp_path / "bad"))
    assert "--lora-targets 'down_proj' adapts nothing" in one_line_error(r) and "name experts" in one_line_error(r)
    cfg = config(tmp_path / "dense", "--lora-rank", "4", "--lora-targets", "q_proj,down_proj", "--mlp-only-layers",
                 "0")  # a dense first layer has a down_proj
    assert cfg.lora.targets == "q_proj,down_proj"
