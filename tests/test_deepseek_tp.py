"""DeepSeek-V3 under tensor parallelism against test_deepseek_training's plain transformers + AdamW loop (the routers'
biases moved by the auxiliary-loss-free rule after every step): 8 steps of --init-from at --tp 2 on 2 ranks, with a
query rank (q_a_proj, its norm, q_b_proj) and without (q_proj), equal it: losses, gradient norms and the final
weights (reassembled from the checkpoint's TP slices) within 1e-5 relative, every e_score_correction_bias within 1e-6
of the loop's (each TP rank moves the replicated bias by the same step loads). Measured, with a query rank: losses
2.4e-7, gradient norms 1.8e-7, weights 1.2e-7; with q_proj: 1.7e-7, 7.2e-7, 4.0e-6 (at 1 rank too: 2.7e-6, AdamW
on the tiny model's small gradients); the biases equal the loop's bitwise. The latent attention is split by heads
(q_b_proj or q_proj and kv_b_proj by the rows of each rank's heads, o_proj by their value columns), the low-rank parts
every head reads replicated; the experts and the shared experts by rows of their width.

Planted in the product's code and caught: kv_b_proj's rows dealt by another head grouping than the queries' (rank 0
heads 0 and 2, rank 1 heads 1 and 3: each rank's queries meet other heads' keys and values; losses up to 4.1e-3
off), and the per-head inputs' gradients not summed over the TP group (the replicated q_a_proj, kv_a_proj_with_mqa
and latent norms then move differently on the two ranks, which the run's replica invariant stops). Each TP rank
reads its slices of the folder (measured: 445,728 of 858,048 bytes). `zerotrain export --format hf` of the TP run
loads in transformers as DeepseekV3ForCausalLM with the run's weights.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_deepseek import hf_model
from test_deepseek_training import SPEED, assert_biases_moved_as_transformers_did, assert_trained_as_transformers, \
    exported_run, in_turn_runs, start_biases, transformers_run
from test_gemma import one_thread
from test_qwen35 import config_for, weights_of

from zerotrain.model import TPSlice, deepseek, mla

pytestmark = pytest.mark.timeout(900)
FOLDERS = {"low-rank q": {}, "q_proj": {"q_lora_rank": None}}
FLAGS = ("--routing-bias-speed", str(SPEED), "--nproc", "2", "--tp", "2")


def other_head_grouping_job(cfg, comm):
    """Planted: kv_b_proj's rows dealt by heads {0, 2} and {1, 3} (the queries' by {0, 1} and {2, 3})."""
    from zerotrain.training.loop import train_job

    real = deepseek.plan

    def planted(cfg, tp):
        slices = real(cfg, tp)
        for n in [n for n in slices if n.endswith("kv_b_proj.weight")]:
            s, H = slices[n], cfg.n_head
            rows = s.full_shape[0] // H  # a head's
            slices[n] = TPSlice(0, s.full_shape, tuple(tuple((h * rows, (h + 1) * rows) for h in range(r, H, tp))
                                                       for r in range(tp)))
        return slices

    deepseek.plan = planted
    try:
        return train_job(cfg, comm)
    finally:
        deepseek.plan = real


def unsummed_latent_job(cfg, comm):
    """Planted: the per-head inputs (the latents, the rotary key) passed on without their gradients' TP all-reduce."""
    from zerotrain.training.loop import train_job

    real = mla.to_heads
    mla.to_heads = lambda comm, *inputs: inputs
    try:
        return train_job(cfg, comm)
    except Exception as e:  # the replica invariant stops the run on every rank
        return {"error": str(e)}
    finally:
        mla.to_heads = real


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tp2 low-rank q" | "tp2 q_proj" | "other grouping" | "transformers low-rank q" | "transformers q_proj":
    {"loss", "grad_norm", "weights"}, "unsummed": its report, "folder", "file bytes"}."""
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("deepseek-tp")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    for name, changes in FOLDERS.items():
        hf_model(tmp / name.replace(" ", "-"), initializer_range=0.02, **changes)
    low = tmp / "low-rank-q"
    jobs = {f"tp2 {name}": (train_job, config_for(tmp / name.replace(" ", "-"), tmp / f"tp2-{name.replace(' ', '-')}",
                                                  *FLAGS)) for name in FOLDERS}
    jobs["other grouping"] = (other_head_grouping_job, config_for(low, tmp / "other-grouping", *FLAGS))
    jobs["unsummed"] = (unsummed_latent_job, config_for(low, tmp / "unsummed", *FLAGS))
    out = in_turn_runs(jobs)
    for name in FOLDERS:  # "other grouping"'s checkpoint's slices are not the plan's: verification refuses it
        out[f"tp2 {name}"]["weights"] = weights_of(tmp / f"tp2-{name.replace(' ', '-')}")
    for name in FOLDERS:
        folder = tmp / name.replace(" ", "-")
        out[f"transformers {name}"] = transformers_run(folder, out[f"tp2 {name}"]["lr"], tmp / f"oracle-{folder.name}")
    out["folder"], out["file bytes"] = tmp / "tp2-low-rank-q", (low / "model.safetensors").stat().st_size
    stack.close()
    return out


@pytest.mark.parametrize("name", list(FOLDERS))
def test_eight_steps_at_tp_train_as_transformers_adamw_and_the_bias_rule_do(runs, name):
    theirs, ours = runs[f"transformers {name}"], runs[f"tp2 {name}"]
    assert_trained_as_transformers(ours, theirs)
    assert_biases_moved_as_transformers_did(ours, theirs, start_biases(hf_model, **FOLDERS[name]))


def test_kv_b_proj_rows_dealt_by_another_head_grouping_are_caught(runs):
    ours, theirs = runs["other grouping"]["loss"], runs["transformers low-rank q"]["loss"]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) > 1e-3, (ours, theirs)


def test_the_latents_gradients_left_unsummed_over_tp_are_caught(runs):
    assert "replicated parameters of rank(s) [1] differ from rank 0" in runs["unsummed"].get("error", ""), \
        runs["unsummed"]


def test_each_tp_rank_reads_its_slices_of_the_folder(runs):
    reads = runs["tp2 low-rank q"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.55 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_the_tp_run_exports_as_deepseek_v3_with_its_weights(runs, tmp_path):
    with one_thread():
        theirs, exported = exported_run(runs["folder"], tmp_path / "out", "DeepseekV3ForCausalLM")
    ours = runs["tp2 low-rank q"]["weights"]
    assert all(torch.equal(p, ours[n]) for n, p in exported.items())
    loaded = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    for n in [n for n in ours if n.endswith("e_score_correction_bias") or ".self_attn." in n]:
        assert torch.equal(loaded[n], ours[n]), n
