"""LoRA on Llama 4: adapters on the linears transformers' Llama4ForCausalLM holds as linears, in its names: the
attention's q_proj, k_proj, v_proj, o_proj, and the MLP's gate_proj, up_proj, down_proj of its dense layers and of
each MoE layer's shared expert; `all` leaves out the routed experts (stacked 3-D parameters in transformers, not
linears) and the router (a linear there, but no family's router takes adapters in zerotrain), as for the other
mixtures of experts. Trained 4 steps from --init-from of test_llama4's tiny model (every kind of layer).

Adapters on the attention, exported with --format peft: peft's model over transformers' Llama4ForCausalLM computes the
run's logits within 1e-4 (measured 3.6e-7), and they moved from the base's (0.73); an adapter_config.json leaving
o_proj out of its targets (planted in the export's own function) is caught (0.49 off). Adapters on the MLPs (`all`)
are refused for peft in one line, as for the other mixtures of experts: peft takes down_proj for the experts' stacked
tensor of that name (with the refusal planted away, its logits are 0.09 off the run's), and the merged --format hf
export loads in transformers with the run's logits (2.4e-7). `all` with the routed experts' linears not told apart
(planted) adapts them too, and is caught. At --tp 2 (test_deepseek_lora's runs: q, k, v's lora_B split with their
base by heads, their lora_A replicated; o_proj's lora_A split by its input columns) the attention's adapters take the
1-rank run's losses within 1e-6 (measured: equal) and end at its adapters within 1e-5 (8.6e-7, as one vector); a
column-parallel base's replicated lora_A left unsummed over the TP group is stopped by the replica invariant.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import world_of_one
from test_deepseek import CAUGHT, EXACT, logits
from test_deepseek_lora import assert_tp2_trains_as_one_rank, lora_runs, peft_logits
from test_gemma import one_thread
from test_llama4 import UNGUARDED, hf_model
from test_qwen35 import config_for

import zerotrain

pytestmark = pytest.mark.timeout(900)
STEPS = ("--lora-rank", "4", "--lora-alpha", "8", "--steps", "4", "--ckpt-every", "4", "--lr", "1e-2", *UNGUARDED)
ATTENTION = (*STEPS, "--lora-targets", "q_proj,k_proj,v_proj,o_proj")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """lora_runs' of the attention's adapters, and "all": the 1-rank run of `all`'s step folder and adapter names."""
    from zerotrain.training.loop import train

    tmp = tmp_path_factory.mktemp("llama4-lora")
    out = lora_runs(tmp, lambda folder: hf_model(folder, 0.02), ATTENTION)
    with one_thread(), world_of_one() as comm:
        result = train(config_for(tmp / "model", tmp / "all", *STEPS), comm, announce=False)
    out["all"] = (result.checkpoints[-1], [n for n, p in result.engine.model.named_parameters() if p.requires_grad])
    return out


def adapted(names) -> set[str]:
    """The linears holding the adapters `names`."""
    return {n.rpartition(".lora_")[0] for n in names}


def transformers_linears(folder) -> set[str]:
    """The blocks' linears of transformers' Llama4ForCausalLM of `folder`, in zerotrain's names (its feed_forward is
    zerotrain's mlp): not the head, nor the routers (Llama4Router is an nn.Linear)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    return {n.replace(".feed_forward.", ".mlp.") for n, m in hf.named_modules()
            if type(m) is torch.nn.Linear and n != "lm_head"}


def test_all_adapts_the_linears_transformers_holds_not_the_routed_experts(runs, tmp_path, monkeypatch):
    from zerotrain.model import lora
    from zerotrain.training.loop import train

    ours, theirs = adapted(runs["all"][1]), transformers_linears(runs["folder"])
    assert ours == theirs, ours ^ theirs
    assert any(".shared_expert.down_proj" in n for n in ours) and any(".mlp.up_proj" in n for n in ours)
    # planted: the routed experts' linears not told apart (`all` then adapts them too): caught
    monkeypatch.setattr(lora, "routed_expert_linears", lambda model: set())
    with one_thread(), world_of_one() as comm:
        result = train(config_for(runs["folder"], tmp_path / "planted", *STEPS, "--steps", "1"), comm, announce=False)
    planted = adapted(n for n, p in result.engine.model.named_parameters() if p.requires_grad)
    assert planted != theirs and any(".experts.0." in n for n in planted)


def exported_to_peft(runs, out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1-rank run's adapters exported to peft in `out`: the run's logits, the base folder's in transformers and
    peft's over that base."""
    from zerotrain.cli.main import main

    step = runs["1 rank"][2]
    with one_thread():
        assert main(["export", step, str(out), "--format", "peft"]) == 0
        ours = logits(zerotrain.load_model(step))
        base = logits(transformers.AutoModelForCausalLM.from_pretrained(str(runs["folder"]),
                                                                        attn_implementation="eager").eval())
        return ours, base, peft_logits(runs["folder"], out)


def leave_out_of_peft_targets(monkeypatch, target: str) -> None:
    """Planted: a peft export whose config leaves `target` out of its target_modules."""
    from zerotrain.hub import adapter

    real = adapter.peft_config
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, *adapted: {
        **real(run, path, *adapted), "target_modules": [m for m in real(run, path, *adapted)["target_modules"]
                                                        if m != target]})


def test_the_attentions_adapters_export_to_peft_with_the_runs_logits(runs, tmp_path):
    ours, base, theirs = exported_to_peft(runs, tmp_path / "adapter")
    assert (ours - base).abs().max() > CAUGHT  # the adapters count
    assert (theirs - ours).abs().max() < EXACT


def test_an_export_leaving_o_proj_out_of_its_targets_is_caught(runs, tmp_path, monkeypatch):
    leave_out_of_peft_targets(monkeypatch, "o_proj")
    ours, _, theirs = exported_to_peft(runs, tmp_path / "wrong")
    assert (theirs - ours).abs().max() > CAUGHT


def test_mlp_adapters_are_refused_for_peft_which_would_take_them_for_the_experts(runs, tmp_path, monkeypatch,
                                                                                  capsys):
    from zerotrain.cli.main import main
    from zerotrain.hub import adapter

    step = runs["all"][0]
    with one_thread():
        assert main(["export", step, str(tmp_path / "refused"), "--format", "peft"]) == 2
        assert "has adapters on an MLP of a mixture of experts" in capsys.readouterr().err
        monkeypatch.setattr(adapter, "moe_peft_problem", lambda run, adapters: None)  # the refusal planted away
        assert main(["export", step, str(tmp_path / "peft"), "--format", "peft"]) == 0
        ours = logits(zerotrain.load_model(step))
        assert (peft_logits(runs["folder"], tmp_path / "peft") - ours).abs().max() > CAUGHT
        assert main(["export", step, str(tmp_path / "hf"), "--format", "hf", "--dtype", "fp32"]) == 0
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    assert (logits(merged.eval()) - ours).abs().max() < EXACT


def test_lora_at_tp2_trains_as_one_rank(runs):
    assert_tp2_trains_as_one_rank(runs, split="q_proj")


def test_an_adapters_gradient_left_unsummed_over_tp_is_caught(runs):
    assert "replicated parameters of rank(s) [1] differ from rank 0" in runs["unsummed"].get("error", ""), \
        runs["unsummed"]
