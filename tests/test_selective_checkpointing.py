"""--activation-checkpointing selective: each block keeps its matmuls' and attention's outputs and recomputes the
element-wise ops between them (model/recompute.py's policy). The same gradients as without checkpointing, bitwise; the
bytes it keeps are the plan's to the byte (model/activation_memory.py's selective_block), counted as the run counts
them (training/activations.py); a wrong policy and a plan that disagrees are caught."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from conftest import tiny_config
from test_activation_bytes import CONFIGS, SHAPES, packed_segments

from zerotrain.config import ConfigError
from zerotrain.model import activation_memory as memory
from zerotrain.model import build_model, summed_token_loss
from zerotrain.model import recompute as recompute_module
from zerotrain.model.activation_memory import activation_bytes
from zerotrain.model.loss import head_loss
from zerotrain.training.activations import saved_for_backward
from zerotrain.training.loop import train


def run(cfg, recompute, micro_batch=2, seq_len=16, precision="fp32", segments=None):
    """(bytes kept for the backward, counted as the loop counts them, {name: gradient}) of one forward and backward."""
    model = build_model(cfg, seed=0)
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.recompute_blocks = {"none": False, "selective": "selective", "blocks": True}[recompute]
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    saved, loss = saved_for_backward(lambda: head_loss(model, x, y, summed_token_loss, False, segments),
                                     model.parameters())
    loss.backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_recompute_gives_bitwise_the_eager_gradients_between_blocks_and_none_in_bytes(arch):
    kept_bytes, kept = run(CONFIGS[arch], "none")
    selective_bytes, selective = run(CONFIGS[arch], "selective")
    blocks_bytes, _ = run(CONFIGS[arch], "blocks")
    assert kept.keys() == selective.keys() and all(torch.equal(kept[n], selective[n]) for n in kept)
    assert blocks_bytes < selective_bytes < kept_bytes


def test_a_policy_that_keeps_more_than_the_plan_or_keeps_unseen_is_caught(monkeypatch):
    """Planted in the product's policy: the element-wise products kept too (the SwiGLU product, the norms' scalings:
    the plan disagrees with the run's count), and the matmuls kept without telling the count (it misses them)."""
    cfg = CONFIGS["llama"]
    planned = activation_bytes(cfg, 2, 16, recompute="selective")["total"]
    assert run(cfg, "selective")[0] == planned
    real = recompute_module.keep_matmul_outputs
    policy = recompute_module.CheckpointPolicy

    def keeps_products(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mul.Tensor:
            for observe in recompute_module._observers.stack:
                observe(ctx.op_output)
            return policy.MUST_SAVE
        return real(ctx, func, *args, **kwargs)

    monkeypatch.setattr(recompute_module, "keep_matmul_outputs", keeps_products)
    assert run(cfg, "selective")[0] > planned
    monkeypatch.setattr(recompute_module, "keep_matmul_outputs", lambda ctx, func, *a, **k:
                        policy.MUST_SAVE if func in recompute_module.KEPT_OPS else policy.PREFER_RECOMPUTE)
    assert run(cfg, "selective")[0] < planned


def test_a_block_selectively_recomputed_on_stale_inputs_breaks_gradient_equality(monkeypatch):
    """Planted in run_block's selective path: the checkpoint recomputes from a detached copy of the block's input."""
    _, kept = run(CONFIGS["llama"], "none")
    real = recompute_module.checkpoint

    def stale(block, x, *args, **kw):
        assert kw.get("context_fn") is recompute_module.selective_contexts  # the selective path, not blocks'
        return real(block, x.detach(), *args, **kw) + 0 * x

    monkeypatch.setattr(recompute_module, "checkpoint", stale)
    _, selective = run(CONFIGS["llama"], "selective")
    assert not all(torch.equal(kept[n], selective[n]) for n in kept)


@pytest.mark.parametrize("micro_batch,seq_len", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_bytes_equal_the_plan_and_a_forgotten_matmul_output_is_caught(arch, precision, micro_batch, seq_len):
    cfg = CONFIGS[arch]
    measured, _ = run(cfg, "selective", micro_batch, seq_len, precision)
    kw = dict(precision=precision, recompute="selective")
    assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] == measured
    with mock.patch.object(memory, "selective_block", lambda s, llama: 0):
        assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] < measured


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_selective_bytes_of_the_llama_family_s_variants_equal_the_plan(arch):
    """q/k/v biases (addmm), q/k norms and Gemma's four (1 + w) norms: recomputed, nothing kept beyond the matmuls."""
    cfg = dataclasses.replace(CONFIGS["llama"], arch=arch)
    for precision in ("fp32", "bf16"):
        measured, _ = run(cfg, "selective", precision=precision)
        assert activation_bytes(cfg, 2, 16, recompute="selective", precision=precision)["total"] == measured


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_bytes_with_packed_records_equal_the_plan(arch):
    cfg = CONFIGS[arch]
    measured, _ = run(cfg, "selective", segments=packed_segments(2, 16))
    assert activation_bytes(cfg, 2, 16, recompute="selective", documents=True)["total"] == measured


def test_a_run_with_selective_recompute_trains_bitwise_like_one_without_and_its_plan_is_its_count(tmp_path, one_rank,
                                                                                                  monkeypatch):
    """Through the loop the product runs (Llama, ZeRO-1, 3 steps): the same losses and parameters bitwise, and the
    activations row of its plan is what its first micro-batch kept (the loop counts it); planted: a plan without the
    kept matmul outputs disagrees with that count."""
    llama = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
    plain = train(tiny_config(tmp_path / "none", steps=3, **llama), one_rank)
    selective = train(tiny_config(tmp_path / "selective", steps=3, activation_checkpointing="selective", **llama),
                      one_rank)
    assert [r["loss"] for r in selective.records] == [r["loss"] for r in plain.records]
    assert torch.equal(selective.engine.held_params, plain.engine.held_params)
    plan = selective.report["plan"]
    assert plan["activations_measured"] == plan["rows"]["activations"] < plain.report["plan"]["rows"]["activations"]
    monkeypatch.setattr(memory, "selective_block", lambda s, llama: 0)
    unplanned = train(tiny_config(tmp_path / "unplanned", steps=1, activation_checkpointing="selective", **llama),
                      one_rank).report["plan"]
    assert unplanned["activations_measured"] > unplanned["rows"]["activations"]


def test_selective_is_refused_in_one_line_where_the_plan_does_not_count_it_yet(tmp_path):
    for model, what in ((dict(arch="qwen3_moe", n_experts=4, experts_per_token=2), "--arch qwen3_moe with experts"),
                        (dict(arch="gemma2", attn_softcap=50.0), "--attn-softcap"), (dict(lora_rank=4), "--lora-rank")):
        with pytest.raises(ConfigError, match=f"--activation-checkpointing selective does not work with {what} yet"):
            tiny_config(tmp_path, activation_checkpointing="selective", **model)


LLAMA31_8B = ["--preset", "llama-3.1-8b", "--nproc", "8", "--zero", "3", "--precision", "bf16", "--seq-len", "8192",
              "--micro-batch", "2", "--device", "cuda", "--data", "synthetic", "--device-memory", "80GiB"]


def test_llama31_8b_at_8k_on_8_ranks_fits_80_gib_with_selective_recompute_and_its_slack_is_said(capsys):
    """ZeRO-3, bf16, 2 x 8,192 tokens: without recompute the activations do not fit; selective keeps 51.54 GiB of
    them, 76.40 GiB in all, 3.60 GiB (5%) left for what the plan does not count (torchtitan measures 82.4 GiB at this
    setting, with whole logits, which zerotrain never holds)."""
    from zerotrain.cli.main import main

    assert main(["plan", *LLAMA31_8B, "--activation-checkpointing", "none"]) == 0
    assert "does not fit: the activations at micro-batch 2" in capsys.readouterr().out
    assert main(["plan", *LLAMA31_8B, "--activation-checkpointing", "selective"]) == 0
    table = capsys.readouterr().out
    assert "8,030,261,248 parameters" in table and "does not fit" not in table
    assert "activations (one micro-batch)             51.54 GiB" in table
    assert "total, at the peak of a step              76.40 GiB" in table
    assert "largest micro-batch in 80.00 GiB: 2\n" in table
    assert "slack in 80.00 GiB: 3.60 GiB (5%) beyond the plan" in table
