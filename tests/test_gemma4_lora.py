"""LoRA on Gemma 4: adapters on the linears transformers' Gemma4ForCausalLM holds as linears in its decoder layers, in
its names: the attention's q_proj, k_proj, v_proj (none on a keys-as-values layer), o_proj, the MLP's gate_proj,
up_proj, down_proj, and the per-layer input's per_layer_input_gate and per_layer_projection. `all` is peft's
all-linear on transformers' model less the model's per_layer_model_projection (a linear outside the blocks, as the
head is); with the MoE block the router and the stacked routed experts are left out, as for the other mixtures of
experts. Trained 4 steps from --init-from of test_gemma4's tiny dense model (every kind of layer; two global KV heads,
so that --tp 2 divides both kinds).

The q and k norms' gains about 0.2, as in test_gemma4_tp: at test_gemma4's the softmax is sharp enough that fp32's
rounding parts --tp 2 from 1 rank by 2.5e-3 in the losses by step 4 (each group of targets alone 5e-5 at most).

Exported with --format peft, peft's model over transformers' Gemma4ForCausalLM computes the run's logits within 1e-4
(measured 1.7e-6), and they moved from the base's (0.87); an adapter_config.json leaving per_layer_projection out of
its targets (planted in the export's own function) is caught (0.77 off). At --tp 2 (test_deepseek_lora's runs: q, k,
v, gate, up's lora_B split with their base, o_proj and down_proj's lora_A split by their input columns, the per-layer
input's adapters replicated) the adapters take the 1-rank run's losses within 1e-6 (measured 5.4e-7) and end at its
adapters within 1e-3 (4.0e-4, as one vector: see the test); a column-parallel base's replicated lora_A left unsummed
over the TP group is stopped by the replica invariant.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_deepseek_lora import lora_runs
from test_gemma4 import CAUGHT, EXACT, UNGUARDED, hf_model
from test_llama4_lora import adapted, exported_to_peft, leave_out_of_peft_targets


pytestmark = pytest.mark.timeout(900)
STEPS = ("--lora-rank", "4", "--lora-alpha", "8", "--steps", "4", "--ckpt-every", "4", "--lr", "1e-2", *UNGUARDED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lora_runs(tmp_path_factory.mktemp("gemma4-lora"),
                     lambda folder: hf_model(folder, 0.02, qk_gain=0.2, global_kv_heads=2), STEPS)


def test_all_adapts_what_peft_all_linear_does_but_the_per_layer_model_projection(runs):
    import peft

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(runs["folder"]))
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules="all-linear"))
    theirs = {n.removeprefix("base_model.model.") for n, m in theirs.named_modules() if hasattr(m, "lora_A")}
    ours = adapted(runs["1 rank"][1])
    assert theirs - ours == {"model.per_layer_model_projection"} and not ours - theirs, ours ^ theirs
    assert any(".per_layer_input_gate" in n for n in ours) and any(".mlp.down_proj" in n for n in ours)
    assert not any("layers.1.self_attn.v_proj" in n for n in ours)  # a global layer: keys as values


def test_the_adapters_export_to_peft_with_the_runs_logits(runs, tmp_path):
    ours, base, theirs = exported_to_peft(runs, tmp_path / "adapter")
    assert (ours - base).abs().max() > CAUGHT  # the adapters count
    assert (theirs - ours).abs().max() < EXACT


def test_an_export_leaving_per_layer_projection_out_of_its_targets_is_caught(runs, tmp_path, monkeypatch):
    leave_out_of_peft_targets(monkeypatch, "per_layer_projection")
    ours, _, theirs = exported_to_peft(runs, tmp_path / "wrong")
    assert (theirs - ours).abs().max() > CAUGHT


def test_lora_at_tp2_trains_as_one_rank(runs):
    (ours, adapters), (theirs, reference, _) = runs["tp2"], runs["1 rank"]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) < 1e-6, (ours, theirs)
    assert set(adapters) == set(reference) and any(".mlp.down_proj.lora_A" in n for n in adapters)
    # the adapters as one vector within 1e-3, not test_deepseek_lora's 1e-5: one value of 768 of layer 4's
    # down_proj.lora_A ends 3.3e-3 apart (4.0e-4 of the vector), a near-zero gradient whose float noise AdamW's first
    # steps turn into a step of a third of lr; every other value within 1e-4
    gap = torch.cat([(adapters[n] - reference[n]).flatten() for n in reference]).norm()
    assert gap <= 1e-3 * torch.cat([reference[n].flatten() for n in reference]).norm()


def test_an_adapters_gradient_left_unsummed_over_tp_is_caught(runs):
    assert "replicated parameters of rank(s) [1] differ from rank 0" in runs["unsummed"].get("error", ""), \
        runs["unsummed"]
