"""The I/O plan (training/io_plan.py, `zerotrain plan`'s per-rank section) says what each rank of a real run reads,
writes and draws: a ZeRO-3 run on 2 ranks from a Hugging Face Llama folder (bf16, in several files, every parameter
its own bucket so that owned ranges cut rows) reads at start-up, hashes, writes at its save and reads at its resume
the bytes the plan gives each rank (within io_plan.TOLERANCE: 1% and 4 KiB), as does a LoRA run's start-up (its
frozen base's owned rows) and save, and a seeded run draws the values it gives. A resume reads its shard and its
share of the record's hashing, nothing else of the base. Planted in the product's own functions, each caught:
stage 3 reading the whole tensor of every parameter it owns part of and rank 0 writing the whole model at a save
(one run, each in its own counter), every rank checking every file of the checkpoint it resumes and the resume
reading the base again (one run), and a plan without the LoRA run's adapters. One start of 2 ranks runs the six
jobs in turn.
"""

import functools
import json

import dist_jobs
import io_plan_jobs as jobs
import pytest
import torch
import transformers
from conftest import tiny_config

from zerotrain.cli.main import main
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.runtime.launch import run_job
from zerotrain.training import memory_plan as memory_plan_module
from zerotrain.training.io_plan import TOLERANCE, differences, io_plan

pytestmark = pytest.mark.timeout(300)
W = 2
BUCKET_MB = 1e-4  # 26 values: every parameter is its own bucket, cut into W chunks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("io-plan")
    hf = str(tmp / "llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(hf, max_shard_size="40KB")

    def cfg(name, init_from=hf, steps=1, resume="", **run):
        c = tiny_config(tmp / name, nproc=W, micro=2, steps=steps, zero=3, bucket_mb=BUCKET_MB, seq_len=16,
                        ckpt_every=0 if resume else 1, **run)
        if init_from:  # the folder's model, as `zerotrain train --init-from` adopts it
            c.checkpoint.init_from = init_from
            c.model = adopt(c.model, weight_source(init_from), {"seq_len"})
        if resume:
            c.checkpoint.resume = str(tmp / resume / "checkpoints" / "step_00000001")
        return c

    runs = {"fresh": (jobs.counted_job, cfg("fresh")),
            "resumed": (jobs.counted_job, cfg("resumed", steps=2, resume="fresh")),
            "seeded": (jobs.counted_job, cfg("seeded", init_from="")),
            "lora": (jobs.counted_job, cfg("lora", lora_rank=4)),
            # two plants in one run: each shows in its own counter
            "whole tensor, whole model saved": (functools.partial(jobs.counted_job,
                                                                  plants=("whole tensor", "whole model saved")),
                                                cfg("planted")),
            "every file checked, base read again": (
                functools.partial(jobs.counted_job, plants=("every file checked", "base read again")),
                cfg("every-file", steps=2, resume="fresh"))}
    pairs = list(runs.values())
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), pairs[0][1], time_limit=180)
    return {name: (c, summary) for (name, (_, c)), summary in zip(runs.items(), results)}


def plan_of(runs, name):
    c, summary = runs[name]
    return io_plan(c), summary["per_rank"]


def test_a_fresh_run_reads_hashes_and_writes_what_the_plan_gives_each_rank_and_a_whole_tensor_read_is_caught(runs):
    plan, measured = plan_of(runs, "fresh")
    assert plan.init_from and len(plan.ranks) == W
    assert differences(plan, measured, phases=("startup", "save")) == []
    for r in plan.ranks:  # the reads and writes are planned exactly, not just within the tolerance
        assert measured["init_bytes_read"][r.rank] == r.startup_read
        assert measured["checkpoint_bytes_written"][r.rank] == r.save_written
        assert measured["checkpoint_bytes_read"][r.rank] == r.startup_hashed + r.startup_headers
    assert all(r.startup_hashed and r.startup_headers for r in plan.ranks)  # each rank hashes its run of the blocks
    planted, whole = plan_of(runs, "whole tensor, whole model saved")
    said = [line for line in differences(planted, whole, phases=("startup", "save")) if "init_bytes_read" in line]
    assert len(said) == W, said  # every rank
    assert min(whole["init_bytes_read"]) > (1 + TOLERANCE) * max(r.startup_read for r in planted.ranks)


def test_a_seeded_run_draws_what_the_plan_gives_each_rank(runs):
    plan, measured = plan_of(runs, "seeded")
    assert not plan.init_from and differences(plan, measured, phases=("startup", "save")) == []
    assert measured["init_values_drawn"] == [r.startup_drawn for r in plan.ranks]
    assert measured["init_bytes_read"] == [0] * W and measured["checkpoint_bytes_read"] == [0] * W


def test_a_lora_run_at_stage_3_reads_its_share_of_the_frozen_base_as_the_plan_gives_and_a_plan_without_it_is_caught(
        runs, monkeypatch):
    plan, measured = plan_of(runs, "lora")
    assert differences(plan, measured, phases=("startup", "save")) == []
    for r in plan.ranks:  # the base's owned rows (its own flat layout), the adapters' shard saved
        assert measured["init_bytes_read"][r.rank] == r.startup_read
        assert measured["checkpoint_bytes_written"][r.rank] == r.save_written
    full, _ = plan_of(runs, "fresh")  # the same base, trained whole: the same reads, a larger shard
    assert [r.startup_read for r in plan.ranks] == [r.startup_read for r in full.ranks]
    assert all(a.save_written < b.save_written for a, b in zip(plan.ranks, full.ranks))
    # planted: the plan lays the run out without its adapters (the base trained whole), as it did before
    monkeypatch.setattr(memory_plan_module, "add_adapters", lambda *args, **kwargs: None)  # planned_layouts' own
    said = differences(io_plan(runs["lora"][0]), measured, phases=("startup", "save"))
    assert sum("checkpoint_bytes_written" in line for line in said) == W, said  # every rank's save


def test_a_save_writing_the_whole_model_is_caught_by_the_plans_save_bytes(runs):
    plan, measured = plan_of(runs, "whole tensor, whole model saved")
    said = [line for line in differences(plan, measured, phases=("startup", "save")) if "written" in line]
    assert len(said) == 1 and said[0].startswith("rank 0 checkpoint_bytes_written"), said


def test_a_resume_reads_each_rank_its_shard_as_planned_and_every_rank_checking_every_file_is_caught(runs):
    plan, measured = plan_of(runs, "resumed")
    # given --init-from again, the resumed run hashes its share of the files for the record (planned, and counted
    # with the resume), and reads nothing else of them: its checkpoint overwrites every value
    assert differences(plan, measured, phases=("resume",)) == []
    assert [measured["checkpoint_bytes_read"][r.rank] - r.startup_hashed for r in plan.ranks] == \
        [r.resume_read for r in plan.ranks]
    assert measured["init_bytes_read"] == [0] * W
    planted, every = plan_of(runs, "every file checked, base read again")
    said = differences(planted, every, phases=("resume",))
    assert said and all("checkpoint_bytes_read" in line for line in said), said
    assert every["init_bytes_read"] == [r.startup_read for r in planted.ranks]  # the second plant, in its counter


def test_plan_prints_each_ranks_bytes_by_phase(capsys):
    argv = ["plan", "--preset", "llama-tiny", "--data", "synthetic", "--nproc", "4", "--zero", "3"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for label in ("start-up: read", "start-up: hashed", "save: written", "resume: read", "export: held beyond"):
        assert label in table
    assert main([*argv, "--json"]) == 0
    io = json.loads(capsys.readouterr().out)["io"]
    assert len(io["ranks"]) == 4 and io["ranks"][0]["save_written"] > 0
