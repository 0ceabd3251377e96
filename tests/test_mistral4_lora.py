"""LoRA on Mistral 4's latent attention, as on DeepSeek-V3's (test_deepseek_lora): adapters on its low-rank
projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) and o_proj, trained 4 steps from --init-from of
test_mistral4's tiny model (its queries scaled by position past 16 of the 80), exported with --format peft: peft's
model over transformers' Mistral4ForCausalLM (loaded by class: AutoModelForCausalLM does not list it) computes the
run's logits within 1e-4 (measured 2.7e-7), and they moved from the base's (0.44). An export whose
adapter_config.json scales the adapters by another alpha (planted in the export's own function) is caught (0.20 off).
At --tp 2 (test_deepseek_lora's runs) the run takes the 1-rank run's losses within 1e-6 (6.7e-8) and ends at its
adapters within 1e-5 (6.0e-7, as one vector); a TP-split base's replicated lora_A left unsummed over the TP group is
stopped by the replica invariant.
"""

from __future__ import annotations

import pytest
import transformers
from test_deepseek import CAUGHT, EXACT, logits
from test_deepseek_lora import assert_tp2_trains_as_one_rank, lora_runs, peft_logits
from test_gemma import one_thread
from test_mistral4 import mistral4_model
from test_qwen35 import config_for

import zerotrain

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lora_runs(tmp_path_factory.mktemp("mistral4-lora"),
                     lambda folder: mistral4_model(folder, initializer_range=0.02))


def test_the_adapters_export_to_peft_with_the_runs_logits(runs, tmp_path):
    from zerotrain.cli.main import main

    with one_thread():
        assert main(["export", runs["1 rank"][2], str(tmp_path / "adapter"), "--format", "peft"]) == 0
        ours = logits(zerotrain.load_model(runs["1 rank"][2]))
        base = logits(transformers.Mistral4ForCausalLM.from_pretrained(str(runs["folder"]),
                                                                       attn_implementation="eager").eval())
        theirs = peft_logits(runs["folder"], tmp_path / "adapter")
    assert (ours - base).abs().max() > CAUGHT  # the adapters count
    assert (theirs - ours).abs().max() < EXACT, (theirs - ours).abs().max()


def test_an_export_with_another_alpha_in_its_config_is_caught(runs, tmp_path, monkeypatch):
    from zerotrain.cli.main import main
    from zerotrain.hub import adapter

    real = adapter.peft_config
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, *adapted: {**real(run, path, *adapted),
                                                                              "lora_alpha": run.lora.alpha / 2})
    with one_thread():
        assert main(["export", runs["1 rank"][2], str(tmp_path / "wrong"), "--format", "peft"]) == 0
        ours = logits(zerotrain.load_model(runs["1 rank"][2]))
        gap = (peft_logits(runs["folder"], tmp_path / "wrong") - ours).abs().max()
    assert gap > CAUGHT


def test_lora_at_tp2_trains_as_one_rank(runs):
    assert_tp2_trains_as_one_rank(runs)


def test_an_adapters_gradient_left_unsummed_over_tp_is_caught(runs):
    assert "replicated parameters of rank(s) [1] differ from rank 0" in runs["unsummed"].get("error", ""), \
        runs["unsummed"]
