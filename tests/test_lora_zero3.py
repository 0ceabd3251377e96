"""LoRA at ZeRO-3: the adapters train as at ZeRO-1 while each rank holds only its share of the frozen base (gathered
per unit, never reduced); checkpoints, resume and the peft export are ZeRO-1's."""

from __future__ import annotations

import functools
import os

import lora_jobs
import pytest
import torch
from conftest import tiny_config
from dist_jobs import in_turn_job
from model_folders import llama_folder
from safetensors.torch import load_file

from zerotrain import checkpoint
from zerotrain.cli.main import main
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.model import meta_model
from zerotrain.model.init import SeedValues, materialise
from zerotrain.parallel import layout_of
from zerotrain.parallel.units import frozen_layout_of, units_whole_bytes
from zerotrain.runtime.launch import run_job
from zerotrain.training.memory_plan import memory_plan

LIMIT = 240  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(600)
RANK, ALPHA = 8, 16.0


def lora_config(out, base=None, steps=3, micro=1, **over):
    """A tiny Llama (untied head: the embedding and the head are frozen units of their own) with rank-8 adapters."""
    cfg = tiny_config(out, steps=steps, micro=micro, seq_len=16, lora_rank=RANK, lora_alpha=ALPHA, arch="llama",
                      n_head=4, n_kv_head=2, intermediate_size=64, tie_embeddings=False, **over)
    cfg.optim.lr = 1e-2  # the adapters move visibly in a few steps
    if base is not None:
        cfg.checkpoint.init_from = base
        cfg.model = adopt(cfg.model, weight_source(base), {"seq_len"})
    return cfg


def gpt2_config(out, **over):
    """GPT-2's tied head: the frozen embedding is the root unit's, whole from the forward into the backward."""
    cfg = tiny_config(out, steps=3, micro=2, seq_len=16, lora_rank=RANK, lora_alpha=ALPHA, **over)
    cfg.optim.lr = 1e-2
    return cfg


def copy_config(out, arch="llama"):
    """Full fine-tuning at ZeRO-3 on 2 ranks (the policy of a preference run), for its frozen copies."""
    shape = dict(n_head=4, n_kv_head=2, intermediate_size=64, tie_embeddings=False) if arch == "llama" else {}
    return tiny_config(out, nproc=2, zero=3, steps=1, micro=2, seq_len=16, arch=arch, **shape)


def halfway(cfg) -> str:
    return os.path.join(cfg.checkpoint.dir, checkpoint.step_name(2))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """One start of 2 ranks: ZeRO-1 and ZeRO-3 LoRA (a Llama with accumulation, checkpointed at step 2; a GPT-2),
    ZeRO-3 resumed from its step 2, and planted: that resume with AdamW's second moments lost, each rank's share of
    the base read from the start of each tensor, rank 1 computing with a drifted copy of a frozen bucket, a save of
    the shard as it was before the step's update; then all-frozen copies of a ZeRO-3 model (shard_frozen_copy)."""
    tmp = tmp_path_factory.mktemp("lora-zero3")
    llama = dict(nproc=2, accum=2, ckpt_every=2)
    z3 = lora_config(tmp / "z3", zero=3, **llama)
    jobs = [(lora_jobs.lora_job, lora_config(tmp / "z1", zero=1, **llama)),
            (lora_jobs.lora_job, z3),
            (lora_jobs.lora_job, gpt2_config(tmp / "g1", nproc=2, zero=1)),
            (lora_jobs.lora_job, gpt2_config(tmp / "g3", nproc=2, zero=3)),
            (lora_jobs.lora_job, lora_config(tmp / "resumed", zero=3, resume=halfway(z3), **llama)),
            (lora_jobs.lora_lossy_resume_job, lora_config(tmp / "lossy", zero=3, resume=halfway(z3), **llama)),
            (lora_jobs.lora_misread_base_job, lora_config(tmp / "misread", zero=3, nproc=2, accum=2, steps=1)),
            (lora_jobs.lora_drifted_frozen_gather_job, lora_config(tmp / "drifted", zero=3, nproc=2, steps=2,
                                                                                check_every=1)),
            (lora_jobs.lora_stale_save_job, lora_config(tmp / "stale", zero=3, steps=2, **llama)),
            (lora_jobs.frozen_copy_job, copy_config(tmp / "copy")),
            (lora_jobs.frozen_copy_job, copy_config(tmp / "copy-gpt2", arch="gpt2")),
            (lora_jobs.ungathered_frozen_copy_job, copy_config(tmp / "copy-planted"))]
    out = run_job(functools.partial(in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    names = ["z1", "z3", "gpt2 z1", "gpt2 z3", "resumed", "lossy", "misread", "drifted", "stale", "copy",
             "copy gpt2", "copy planted"]
    return {**dict(zip(names, out)), "z1 config": jobs[0][1], "z3 config": z3, "stale config": jobs[8][1], "copy config": jobs[-3][1],
            "copy gpt2 config": jobs[-2][1]}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """One start of 4 ranks, each run one step from a saved Llama (--init-from): ZeRO-1 and ZeRO-3 LoRA, and ZeRO-3
    with the frozen base kept whole on every rank (planted)."""
    tmp = tmp_path_factory.mktemp("lora-zero3-4")
    llama_folder(tmp / "base")
    base = str(tmp / "base")
    jobs = [(lora_jobs.lora_job, lora_config(tmp / "z1", base, steps=1, nproc=4, zero=1)),
            (lora_jobs.lora_job, lora_config(tmp / "z3", base, steps=1, nproc=4, zero=3)),
            (lora_jobs.lora_whole_base_job, lora_config(tmp / "whole", base, steps=1, nproc=4, zero=3))]
    out = run_job(functools.partial(in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    return {**dict(zip(["z1", "z3", "whole"], out)), "z3 config": jobs[1][1]}


def rel(a, b) -> float:
    return max(((x - y).norm() / y.norm()).item() if torch.is_tensor(x) else abs(x - y) / abs(y) for x, y in zip(a, b))


def agrees(run, base) -> bool:
    """Losses within 1e-6 relative, every adapter within 1e-5 (the same adapters trained)."""
    names = sorted(base["params"])
    return (sorted(run["params"]) == names and rel(run["losses"], base["losses"]) <= 1e-6
            and rel([run["params"][n] for n in names], [base["params"][n] for n in names]) <= 1e-5)


def test_zero3_lora_trains_as_zero1_with_accumulation_and_a_misread_base_is_caught(two):
    for z1, z3 in (("z1", "z3"), ("gpt2 z1", "gpt2 z3")):
        assert agrees(two[z3], two[z1]), z3
        assert two[z3]["frozen_grads"] == [] and all(".lora_" in n for n in two[z3]["trained"])
    # planted: the ranks' shares of the base read from each tensor's start: another model, other losses
    assert rel(two["misread"]["losses"], two["z1"]["losses"][:1]) > 1e-3


def test_zero3_lora_resumes_bitwise_and_a_lossy_resume_is_caught(two):
    resumed, whole = two["resumed"], two["z3"]
    assert resumed["start"] == 2 and resumed["losses"] == whole["losses"][2:]
    assert all(torch.equal(resumed["params"][n], t) for n, t in whole["params"].items())
    lossy = two["lossy"]["params"]  # planted: the second moments not restored
    assert not all(torch.equal(lossy[n], t) for n, t in whole["params"].items())


def test_zero3_lora_exports_the_peft_adapter_and_the_merged_model_of_zero1_and_a_stale_save_is_caught(two, tmp_path):
    folders = {}
    for name in ("z1", "z3", "stale"):
        for fmt in ("peft", "hf"):
            folders[name, fmt] = tmp_path / f"{name}-{fmt}"
            assert main(["export", halfway(two[f"{name} config"]), str(folders[name, fmt]), "--format", fmt]) == 0

    def difference(name, fmt, file):
        ours, theirs = (load_file(str(folders[run, fmt] / file)) for run in (name, "z1"))
        assert sorted(ours) == sorted(theirs) and len(ours) > 0, fmt
        return rel([ours[n] for n in sorted(ours)], [theirs[n] for n in sorted(ours)])

    for fmt, file in (("peft", "adapter_model.safetensors"), ("hf", "model.safetensors")):
        assert difference("z3", fmt, file) <= 1e-5, fmt
        assert difference("stale", fmt, file) > 1e-3, fmt  # planted: the shard saved as it was before the update


def test_invariant_b_covers_the_sharded_base_and_a_rank_computing_with_a_drifted_copy_is_caught(two):
    assert two["z3"]["digests"][0] == two["z3"]["digests"][1]
    caught = two["drifted"]["invariant"]  # planted: at step 2 rank 1's gathered copy of a frozen bucket drifts
    assert "invariant (b) failed: parameters of rank(s) [1] differ from rank 0 at step 2" in caught


def test_each_of_4_ranks_holds_and_reads_a_quarter_of_the_base_and_a_base_kept_whole_is_caught(four):
    """From summary.json's per-rank counters: the frozen base each rank holds, and what it read of --init-from's
    files (the base is all of them but the adapters, which are drawn)."""
    z1, z3, whole = (four[k]["per_rank"] for k in ("z1", "z3", "whole"))
    assert agrees(four["z3"], four["z1"])
    held = max(z3["frozen_bytes"]) / max(z1["frozen_bytes"])
    assert held <= 0.3, held
    assert max(z3["init_bytes_read"]) <= 0.3 * max(z1["init_bytes_read"])
    assert max(whole["frozen_bytes"]) / max(z1["frozen_bytes"]) > 0.3  # planted: the base whole on every rank
    # the plan counts the sharded base: what a rank holds of it (the run checked it, strict, after its first step)
    assert memory_plan(four["z3 config"]).rows["frozen_base"] == max(z3["frozen_bytes"])


def test_a_frozen_copy_sharded_like_the_model_computes_the_unsharded_models_logits_and_an_ungathered_unit_is_caught(
        two):
    """frozen_copy.shard_frozen_copy: an all-frozen model sharded over 2 ranks as ZeRO-3 shards the policy (its values copied
    from the engine's shard, or drawn from the seed), whole per unit in its forward only."""
    for name in ("copy", "copy gpt2"):
        run, cfg = two[name], two[name + " config"]
        module = materialise(meta_model(cfg.model), SeedValues(cfg.model, cfg.loop.seed, {}, 0))
        with torch.no_grad():
            whole = module(torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)))
        like, drawn, policy = run["logits"]  # rank 0's
        assert torch.equal(like, policy) and torch.equal(drawn, policy), name  # the same values, computed alike
        assert rel([policy], [whole]) <= 1e-6, name  # another process's threads: float noise at most
        full = sum(p.numel() * 4 for p in module.parameters())
        assert all(held < 0.6 * full for held in run["held"]) and run["after"] == run["held"], name
        # at most the shard and the root unit with the largest other unit whole: what the plan counts
        module.requires_grad_(False)
        none_trained, frozen = (f(module, 2, cfg.parallel.bucket_numel) for f in (layout_of, frozen_layout_of))
        most = units_whole_bytes(module, none_trained, 4, frozen=frozen)
        assert all(peak <= held + most for peak, held in zip(run["peak"], run["held"])), name
        assert "call it under torch.no_grad()" in run["error"], name
    # planted: the copies' blocks are never gathered
    assert "was not gathered" in two["copy planted"]["error"]
