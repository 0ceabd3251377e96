"""The plans of hybrid sharding (--dp-replicate R): runs of 4 ranks in 2 and 4 replica groups hold exactly the state
the memory plan gives (the strict check every test run makes, at ZeRO-1 in bf16 with accumulation, ZeRO-3, one rank a
group, and with --ep), send across the groups the all-reduce bytes it gives a step (a plan without that row is
caught), write and read at a save and a resume what the I/O plan gives each rank, and report the final parameter norm
that ZeRO over all 4 ranks reports (a norm summed over every replica group's copy of the shards, sqrt(R) x, is
caught). One start of 4 ranks runs the jobs in turn."""

from __future__ import annotations

import functools
import math
import os

import dist_jobs
import hsdp_jobs
import pytest
from conftest import tiny_config

from zerotrain import checkpoint
from zerotrain.cli.main import main
from zerotrain.parallel import parts as parts_module
from zerotrain.parallel.sharded import ShardedParameters
from zerotrain.runtime.launch import run_job
from zerotrain.training.io_plan import differences, io_plan
from zerotrain.training.memory_plan import STATE, memory_plan

pytestmark = pytest.mark.timeout(900)
STEPS = 2
MOE = dict(arch="qwen3_moe", n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, tie_embeddings=False,
           n_experts=4, experts_per_token=2, expert_width=32)


def config(tmp, name, zero, accum=1, **run):
    return tiny_config(tmp / name, nproc=4, zero=zero, micro=8 // (4 * accum), accum=accum,
                       **{"steps": STEPS, "threads": 1, **run})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan-hsdp")
    cfgs = {"z3": config(tmp, "z3", 3),
            "z3 r2": config(tmp, "z3-r2", 3, dp_replicate=2, ckpt_every=STEPS),
            "z1 r2 bf16 accum": config(tmp, "z1-r2", 1, accum=2, precision="bf16", dp_replicate=2),
            "z1 r4": config(tmp, "z1-r4", 1, dp_replicate=4),
            "ep2 z3 r2": config(tmp, "ep2-r2", 3, ep=2, dp_replicate=2, **MOE)}
    cfgs["r2 -> r2"] = config(tmp, "r2-r2", 3, dp_replicate=2, steps=STEPS + 1,
                              resume=os.path.join(cfgs["z3 r2"].checkpoint.dir, checkpoint.step_name(STEPS)))
    jobs = [(hsdp_jobs.planned_job, cfg) for cfg in cfgs.values()]
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=jobs), jobs[0][1], time_limit=800)
    return {name: (cfg, result) for (name, cfg), result in zip(cfgs.items(), results)}


def traffic_differences(cfg, sent: dict, steps: int) -> list[str]:
    """Where the bytes a run sent across its replica groups are not the plan's a step, times its steps."""
    planned = memory_plan(cfg).traffic.get("all_reduce_replicas", 0) * steps
    measured = sent.get("all_reduce_replicas", 0)
    return [] if measured == planned else [f"all_reduce_replicas sent {measured:,}, the plan {planned:,}"]


def test_replica_groups_hold_the_planned_state_and_send_the_planned_all_reduce_and_a_plan_without_it_is_caught(
        runs, monkeypatch):
    for name in ("z3 r2", "z1 r2 bf16 accum", "z1 r4", "ep2 z3 r2"):
        cfg, run = runs[name]
        plan = memory_plan(cfg)
        # the run checked its state against the plan after step 1, strictly (ZEROTRAIN_STRICT_PLAN): to the byte
        assert {k: run["plan"]["rows"][k] for k in STATE} == {k: plan.rows[k] for k in STATE}, name
        assert plan.traffic["all_reduce_replicas"] > 0 and traffic_differences(cfg, run["sent"], STEPS) == [], name
    cfg, run = runs["z3 r2"]  # shard x 4 x 2 (R - 1) / R a step: at R 2 the gradient shard's bytes (ZeRO-3: shard x 4)
    assert memory_plan(cfg).traffic["all_reduce_replicas"] == memory_plan(cfg).rows["gradients"]
    assert memory_plan(runs["z3"][0]).traffic == {} and "all_reduce_replicas" not in runs["z3"][1]["sent"]
    # planted: the hybrid sharding part forgets its all-reduce (the row missing): every R > 1 run's bytes differ
    monkeypatch.setattr(parts_module.HybridSharding, "traffic", lambda self, layouts: {})
    for name in ("z3 r2", "z1 r2 bf16 accum", "z1 r4", "ep2 z3 r2"):
        cfg, run = runs[name]
        assert traffic_differences(cfg, run["sent"], STEPS) == \
            [f"all_reduce_replicas sent {run['sent']['all_reduce_replicas']:,}, the plan 0"], name


def test_replica_groups_save_and_resume_the_bytes_the_io_plan_gives_each_rank_and_every_rank_writing_is_caught(
        runs, monkeypatch):
    cfg, run = runs["z3 r2"]
    plan = io_plan(cfg)
    written = [r.save_written for r in plan.ranks]
    assert written[2:] == [0, 0] and all(written[:2])  # replica group 0 writes, the other group nothing
    assert run["per_rank"]["checkpoint_bytes_written"] == written
    # resumed at R 2: the files hashed shared over all 4 ranks, each rank's owned values read by ranges
    resumed, read = io_plan(runs["r2 -> r2"][0]), runs["r2 -> r2"][1]["per_rank"]["checkpoint_bytes_read"]
    assert read == [r.resume_read for r in resumed.ranks]
    assert differences(resumed, runs["r2 -> r2"][1]["per_rank"], phases=("resume",), saves=0) == []
    # planted: the plan has every replica group write its shards
    monkeypatch.setattr(parts_module.RunParts, "writes_shard", lambda self, dp_rank, dp: True)
    said = differences(io_plan(cfg), run["per_rank"], phases=("save",))
    assert [line.split(" checkpoint")[0] for line in said] == ["rank 2", "rank 3"], said


def test_a_rank_of_two_replica_groups_reports_the_norm_zero_over_every_rank_reports_and_every_copy_counted_is_caught(
        runs, monkeypatch):
    z3, r2 = runs["z3"][1]["param_norms"], runs["z3 r2"][1]["param_norms"]
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(r2, z3, strict=True)), (r2, z3)
    # planted: the placement sums the norms of every DP rank, each replica group's copy of the shards among them
    held = [1.0, 2.0, 1.0, 2.0]  # 4 DP ranks in 2 groups of 2: ranks 2 and 3 hold copies of ranks 0 and 1's shards
    placement = ShardedParameters(1, replicas=2)
    assert placement.computed_norms(held, tp_size=1) == [math.sqrt(5)] * 4
    monkeypatch.setattr(placement, "replicas", 1)
    assert placement.computed_norms(held, tp_size=1) == [math.sqrt(10)] * 4  # sqrt(2) x the norm


def test_plan_prints_the_all_reduce_across_the_replica_groups(capsys):
    argv = ["plan", "--preset", "llama-tiny", "--data", "synthetic", "--nproc", "4", "--zero", "3",
            "--dp-replicate", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DP 4 (2 replica groups of 2)" in out and "--dp-replicate 2: " in out and "across the replica groups" in out
