"""LoRA on DeepSeek-V3's latent attention: adapters on its low-rank projections (q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj) and o_proj, trained 4 steps from --init-from of test_deepseek's tiny model, exported
with --format peft: peft's model over transformers' DeepseekV3ForCausalLM computes the run's logits (within 1e-4),
and they moved from the base's. An export whose adapter_config.json leaves kv_b_proj out of its targets (planted in
the export's own function) is caught. At --tp 2 (kv_b_proj's and q_b_proj's adapters split with their base by
heads, q_a_proj's and kv_a_proj_with_mqa's replicated with theirs) the run takes the 1-rank run's losses within 1e-6
relative (measured 6.7e-8) and ends at its adapters within 1e-5 (3.4e-6, as one vector); the column-parallel bases'
replicated lora_A gradients left unsummed over the TP group (planted in model/lora.py) is stopped by the replica
invariant. The routers' biases stay as the base has them (frozen with it: routing_bias_for gives no update).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import world_of_one
from dist_jobs import in_turn_job
from test_deepseek import CAUGHT, EXACT, hf_model, logits
from test_deepseek_training import LIMIT
from test_gemma import one_thread
from test_qwen35 import config_for

import zerotrain
from zerotrain.checkpoint.consolidate import checkpoint_model
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(900)
TARGETS = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", TARGETS, "--steps", "4", "--ckpt-every", "4",
        "--lr", "1e-2")


def unsummed_adapter_job(cfg, comm):
    """Planted: the column-parallel bases' (q_b_proj's, kv_b_proj's) replicated lora_A taking each rank's own part
    of its gradient, never summed over the TP group."""
    from zerotrain.model import lora
    from zerotrain.training.loop import train_job

    real = lora.sum_over_replicas
    lora.sum_over_replicas = lambda weight, comm, collective="": weight
    try:
        return train_job(cfg, comm)
    except Exception as e:  # the replica invariant stops the run on every rank
        return {"error": str(e)}
    finally:
        lora.sum_over_replicas = real


def lora_runs(tmp, build_base, lora=LORA) -> dict:
    """The LoRA runs (flags `lora`) of the base `build_base(folder)` saves: {"folder", "1 rank": (losses, adapters,
    step folder), "tp2": (losses, adapters), "unsummed": its report}, the 1-rank run in this process, the others on
    one start of 2 ranks."""
    from zerotrain.training.loop import train, train_job

    with one_thread():
        build_base(tmp / "model")
        with world_of_one() as comm:
            result = train(config_for(tmp / "model", tmp / "one", *lora), comm, announce=False)
        adapters = {n: p.detach().clone() for n, p in result.engine.model.named_parameters() if p.requires_grad}
        out = {"folder": tmp / "model", "1 rank": ([r["loss"] for r in result.records], adapters,
                                                    result.checkpoints[-1])}
        configs = [config_for(tmp / "model", tmp / name, *lora, "--nproc", "2", "--tp", "2")
                   for name in ("tp2", "unsummed")]
        report, out["unsummed"] = run_job(functools.partial(in_turn_job, jobs=[(train_job, configs[0]),
                                                                                (unsummed_adapter_job, configs[1])]),
                                          configs[0], time_limit=LIMIT)
        out["tp2"] = ([r["loss"] for r in report["records"]],
                      checkpoint_model(str(next((tmp / "tp2").rglob("step_00000004")))))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lora_runs(tmp_path_factory.mktemp("deepseek-lora"), lambda folder: hf_model(folder, initializer_range=0.02))


def peft_logits(base, adapter):
    """peft's model of the adapter folder over transformers' model of `base`, loaded by the class its config.json
    names (transformers 5.25's AutoModelForCausalLM does not list Mistral 4)."""
    import peft

    model_class = getattr(transformers, json.loads((Path(base) / "config.json").read_text())["architectures"][0])
    hf = model_class.from_pretrained(str(base), attn_implementation="eager")
    return logits(peft.PeftModel.from_pretrained(hf, str(adapter)).eval())


def test_the_adapters_export_to_peft_with_the_runs_logits(runs, tmp_path):
    from zerotrain.cli.main import main

    step = runs["1 rank"][2]
    assert main(["export", step, str(tmp_path / "adapter"), "--format", "peft"]) == 0
    ours = logits(zerotrain.load_model(step))
    base = logits(transformers.AutoModelForCausalLM.from_pretrained(str(runs["folder"]),
                                                                    attn_implementation="eager").eval())
    assert (ours - base).abs().max() > CAUGHT  # the adapters count
    assert (peft_logits(runs["folder"], tmp_path / "adapter") - ours).abs().max() < EXACT


def test_an_export_leaving_kv_b_proj_out_of_its_targets_is_caught(runs, tmp_path, monkeypatch):
    from zerotrain.cli.main import main
    from zerotrain.hub import adapter

    real = adapter.peft_config
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, *adapted: {
        **real(run, path, *adapted), "target_modules": [m for m in real(run, path, *adapted)["target_modules"]
                                                        if m != "kv_b_proj"]})
    step = runs["1 rank"][2]
    assert main(["export", step, str(tmp_path / "wrong"), "--format", "peft"]) == 0
    assert (peft_logits(runs["folder"], tmp_path / "wrong") - logits(zerotrain.load_model(step))).abs().max() > CAUGHT


def test_lora_at_tp2_trains_as_one_rank(runs):
    assert_tp2_trains_as_one_rank(runs)


def assert_tp2_trains_as_one_rank(runs, split: str = "kv_b_proj") -> None:
    """lora_runs' --tp 2 run took the 1-rank run's losses within 1e-6 relative and ended at its adapters within 1e-5
    (among them those of `split`, a base split by TP)."""
    (ours, adapters), (theirs, reference, _) = runs["tp2"], runs["1 rank"]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) < 1e-6, (ours, theirs)
    assert set(adapters) == set(reference) and any(f".{split}.lora_B" in n for n in adapters)
    # the adapters as one vector (test_qwen35's gaps): AdamW's first steps divide each gradient value by its own size,
    # so a near-zero value's float noise becomes a step of up to lr
    gap = torch.cat([(adapters[n] - reference[n]).flatten() for n in reference]).norm()
    assert gap <= 1e-5 * torch.cat([reference[n].flatten() for n in reference]).norm()


def test_an_adapters_gradient_left_unsummed_over_tp_is_caught(runs):
    assert "replicated parameters of rank(s) [1] differ from rank 0" in runs["unsummed"].get("error", ""), \
        runs["unsummed"]
