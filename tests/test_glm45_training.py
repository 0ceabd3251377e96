"""GLM-4.5 training against test_deepseek_training's plain transformers + AdamW loop, which moves each router's
e_score_correction_bias by the auxiliary-loss-free rule after every step: 8 steps of --init-from at 1 rank (in this
process), at ZeRO-3 on 2 ranks, at --ep 2 and at --tp 2 (one start of 2 ranks for them all) equal it: losses and
gradient norms within 1e-5 relative, the final weights (the biases among them) within 1e-5 relative, every bias within
1e-6 of the loop's (measured: losses 1.5e-7, 1.2e-7, 1.2e-7, 1.5e-7; gradient norms 1.7e-7 to 2.6e-7; weights
1.6e-6 to 2.1e-6: the single tensors furthest off are the attention's q_proj and k_proj, 2e-5 relative). At ZeRO-3 each rank reads its slice of --init-from's file; `zerotrain export --format hf` of the
run loads in transformers as Glm4MoeForCausalLM with the run's weights bitwise. Under --tp 2 the shared experts
left whole on every rank (their tensor-parallel split planted away: their whole output added to each rank's partial
sum, and their input's gradient summed over the group) are caught (losses 1.8e-4 off, grad norms 3.6e-3, weights
6.4e-3)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import world_of_one
from test_deepseek_training import SPEED, assert_biases_moved_as_transformers_did, assert_trained_as_transformers, \
    exported_run, one_rank_run, start_biases, transformers_run, two_rank_runs
from test_gemma import one_thread
from test_glm45 import hf_model
from test_qwen35 import config_for, gaps

pytestmark = pytest.mark.timeout(900)


def unsplit_shared_experts_job(cfg, comm):
    """Planted: GLM-4.5's plan and parallelize are Llama's alone, the shared experts left whole on every TP rank:
    MoE.forward adds their whole output to each rank's partial sum of the routed experts' before the all-reduce
    (twice what it is), and copy_to_tp sums their input's gradient, whole on each rank, over the group."""
    from unittest import mock

    from zerotrain.model import glm, llama
    from zerotrain.training.loop import train_job

    with mock.patch.object(glm, "plan", llama.plan), mock.patch.object(glm, "parallelize", llama.parallelize):
        return train_job(cfg, comm)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"1 rank" | "zero3" | "ep2" | "tp2" | "transformers": {"loss", "grad_norm", "weights"}}."""
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("glm45-runs")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    torch.manual_seed(0)
    folder = tmp / "model"
    hf_model(folder, initializer_range=0.02)
    speed = ("--routing-bias-speed", str(SPEED))
    out = two_rank_runs(folder, tmp, *speed, more={"tp2": (train_job, ("--tp", "2")),
                                                   "tp2 unsplit": (unsplit_shared_experts_job, ("--tp", "2"))})
    with world_of_one() as comm:
        out["1 rank"] = one_rank_run(config_for(folder, tmp / "1-rank", *speed), comm)
        out["folder"] = tmp / "1-rank"
        out["transformers"] = transformers_run(folder, out["1 rank"]["lr"], tmp / "oracle")
    out["start biases"] = start_biases(hf_model)
    stack.close()
    return out


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2", "tp2"])
def test_eight_steps_train_as_transformers_adamw_and_the_bias_rule_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert_trained_as_transformers(ours, theirs)
    assert len(runs["start biases"]) == 2
    assert_biases_moved_as_transformers_did(ours, theirs, runs["start biases"])


def test_tp_with_the_shared_experts_left_unsplit_is_caught(runs):
    gap = gaps(runs["tp2 unsplit"], runs["transformers"])
    assert gap["grad_norm"] > 1e-3 and gap["weights"] > 1e-3, gap


def test_init_from_at_zero3_reads_each_ranks_slice_of_the_folder(runs):
    """Each of the 2 ranks read its owned ranges' rows of --init-from's file, not the whole model."""
    reads = runs["zero3"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.75 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_the_trained_run_exports_as_glm4_moe_with_its_trained_weights(runs, tmp_path):
    """`zerotrain export RUN OUT --format hf` of the 8-step run: transformers loads Glm4MoeForCausalLM with the run's
    weights bitwise (in fp32, the routers' biases into their buffers; the experts, which transformers stacks in memory,
    read back by zerotrain from the exported files)."""
    theirs, exported = exported_run(runs["folder"], tmp_path / "out", "Glm4MoeForCausalLM")
    ours = runs["1 rank"]["weights"]
    loaded = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    assert all(torch.equal(loaded[n], ours[n]) for n in ours if ".experts." not in n)  # theirs stacked in memory
    assert all(torch.equal(p, ours[n]) for n, p in exported.items())
