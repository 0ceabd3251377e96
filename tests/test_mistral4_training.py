"""Mistral 4 training against a plain transformers + AdamW loop (test_deepseek_training's, over Mistral4ForCausalLM:
no routing bias to move): 8 steps of --init-from at 1 rank (in this process), at ZeRO-3 on 2 ranks and at --ep 2 (one
start of 2 ranks for both) equal it: losses, gradient norms and the final weights within 1e-5 relative (measured:
losses 1.8e-7, 1.9e-7, 1.9e-7; gradient norms 2.9e-6, 3.3e-6, 3.3e-6; weights 8.3e-7, 8.8e-7, 8.8e-7); the routers'
softmax cut from the gradient (planted in the function the run calls) is caught. At ZeRO-3
each rank reads its slice of --init-from's file (the experts stacked per layer, as transformers saves them);
`zerotrain export --format hf` of the run loads in transformers as Mistral4ForCausalLM with the run's weights
bitwise."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from conftest import world_of_one
from test_deepseek_training import assert_trained_as_transformers, exported_run, one_rank_run, transformers_run, \
    two_rank_runs
from test_gemma import one_thread
from test_mistral4 import mistral4_model
from test_qwen35 import config_for, gaps

from zerotrain.model import group_routing

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"1 rank" | "zero3" | "ep2" | "router without gradient" | "transformers": {"loss", "grad_norm", "weights"},
    "folder": the 1-rank run}."""
    tmp = tmp_path_factory.mktemp("mistral4-runs")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    folder = tmp / "model"
    mistral4_model(folder, initializer_range=0.02)
    out = two_rank_runs(folder, tmp)
    with world_of_one() as comm:
        for name in ("1 rank", "router without gradient"):
            with pytest.MonkeyPatch.context() as mp:
                if name == "router without gradient":
                    mp.setattr(group_routing, "softmax_scores", lambda flat, weight: torch.nn.functional.linear(
                        flat, weight.detach()).softmax(dim=-1))
                out[name] = one_rank_run(config_for(folder, tmp / name.replace(" ", "-")), comm)
        out["folder"] = tmp / "1-rank"
        out["transformers"] = transformers_run(folder, out["1 rank"]["lr"], tmp / "oracle")
    stack.close()
    return out


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2"])
def test_eight_steps_train_as_transformers_adamw_does(runs, run):
    assert_trained_as_transformers(runs[run], runs["transformers"])


def test_the_routers_cut_from_the_gradient_are_caught(runs):
    assert gaps(runs["router without gradient"], runs["transformers"])["weights"] > 1e-4


def test_init_from_at_zero3_reads_each_ranks_slice_of_the_folder(runs):
    """Each of the 2 ranks read its owned ranges' rows of --init-from's file (the stacked experts' too), not the whole
    model."""
    reads = runs["zero3"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.75 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_the_trained_run_exports_as_mistral4_with_its_trained_weights(runs, tmp_path):
    """`zerotrain export RUN OUT --format hf` of the 8-step run: transformers loads Mistral4ForCausalLM with the run's
    weights bitwise (in fp32, the experts stacked again) and they are the transformers loop's within 1e-5 relative."""
    theirs, exported = exported_run(runs["folder"], tmp_path / "out", "Mistral4ForCausalLM",
                                    loader=transformers.Mistral4ForCausalLM)
    ours = runs["1 rank"]["weights"]
    assert all(torch.equal(p, ours[n]) for n, p in exported.items())
    stacked = dict(theirs.named_parameters())["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(stacked[3], ours["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert gaps(runs["1 rank"], runs["transformers"])["weights"] <= 1e-5
