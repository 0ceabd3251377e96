"""The step reads nothing from the device between log steps: every read of a tensor's values by the host (item,
tolist, bool, float, int, numpy, cpu, nonzero, .to('cpu')), counted in every rank over the steps of a run at
--log-every 10 (tests/host_reads_jobs.py), is at most one a step on average for dense ZeRO-1, ZeRO-3 with --overlap,
TP 2, LoRA and DPO, and for a mixture of experts one per MoE layer per micro-batch (the all-to-all's split sizes)
plus one. On CPU a host tensor read counts as one of a device's: the step is shaped as it runs on a GPU.

A planted per-step `float(loss)` in the product's step trips the bound."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import host_reads_jobs
import pytest
from conftest import tiny_config
from dist_jobs import in_turn_job
from model_folders import CHATML, llama_folder, write_jsonl

from zerotrain.cli.main import build_parser
from zerotrain.cli.flags import config_from_args
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.model import moe as moe_module
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training import objectives

LIMIT = 300  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(600)
STEPS = 20
PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" Answer: {2 * i}.",
          "rejected": f" Answer: {2 * i + 1}."} for i in range(8)]


def dense(out, **over):
    return tiny_config(out, nproc=2, steps=STEPS, micro=2, accum=2, log_every=10, **over)


def moe(out):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--no-progress",
                                      "--steps", str(STEPS), "--nproc", "2", "--ep", "2", "--micro-batch", "2",
                                      "--accum", "2", "--log-every", "10", "--out", str(out)])
    return resolve_paths(config_from_args(args))


def dpo(out, base: str, pairs: str):
    cfg = tiny_config(out, nproc=2, steps=STEPS, micro=2, seq_len=32, data=pairs, init_from=base, method="dpo",
                      log_every=10)
    cfg.model = adopt(cfg.model, weight_source(base), {"seq_len"})
    return cfg


@contextlib.contextmanager
def expert_loop_reads_its_counts():
    """Planted bug: the expert loop reads its counts again, though expert parallelism read them with the split
    sizes (the product's own model/moe.expert_loop)."""
    loop = moe_module.expert_loop

    def reading(experts, tokens, counts, sizes=None):
        return loop(experts, tokens, counts)

    with mock.patch.object(moe_module, "expert_loop", reading):
        yield


@contextlib.contextmanager
def float_loss_every_step():
    """Planted bug: the executor reads each step's loss sum on the host (the product's own step function)."""
    run = objectives.run_micro_batches

    def reading(*args, **kwargs):
        totals = run(*args, **kwargs)
        float(totals.loss_sum)
        return totals

    with mock.patch.object(objectives, "run_micro_batches", reading):
        yield


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """{configuration: every rank's counts}, from one start of 2 ranks."""
    tmp = tmp_path_factory.mktemp("host-reads")
    llama_folder(tmp / "base", template=CHATML)
    pairs = write_jsonl(tmp / "pairs.jsonl", PAIRS)
    configs = {
        "zero1": dense(tmp / "zero1", zero=1),
        "zero3 overlap": dense(tmp / "zero3", zero=3, overlap="on"),
        "tp2": dense(tmp / "tp2", tp=2),
        "lora": dense(tmp / "lora", lora_rank=4, lora_alpha=8),
        "dpo": dpo(tmp / "dpo", str(tmp / "base"), pairs),
        "moe ep2": moe(tmp / "moe"),
        "zero1 planted float(loss)": dense(tmp / "planted", zero=1),
        "moe ep2 planted expert loop read": moe(tmp / "moe-planted"),
    }
    plants = {"zero1 planted float(loss)": float_loss_every_step,
              "moe ep2 planted expert loop read": expert_loop_reads_its_counts}
    jobs = [(functools.partial(host_reads_jobs.all_ranks_job, plant=plants.get(name)), cfg)
            for name, cfg in configs.items()]
    results = run_job(functools.partial(in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    counted = dict(zip(configs, results))
    for name, ranks in counted.items():
        print(f"{name}: " + "; ".join(f"rank {r['rank']} {r['per_step']:.2f}/step {r['reads']}" for r in ranks))
        for key, n in sorted(ranks[0].get("where", {}).items()):
            print(f"    {n:5d} {key}")
    return counted


@pytest.mark.parametrize("name", ["zero1", "zero3 overlap", "tp2", "lora", "dpo"])
def test_a_dense_step_reads_the_device_at_most_once_a_step_on_average(counted, name):
    for rank in counted[name]:
        assert rank["per_step"] <= 1.0, (name, rank)


def test_a_moe_step_reads_at_most_once_per_moe_layer_per_micro_batch_plus_one(counted):
    layers, micro_batches = 2, 2  # qwen3-moe-tiny: two MoE layers; --accum 2
    for rank in counted["moe ep2"]:
        assert rank["per_step"] <= layers * micro_batches + 1, rank
    # planted: a second read per layer and micro-batch (the expert loop's counts) breaks the bound
    assert any(rank["per_step"] > layers * micro_batches + 1 for rank in counted["moe ep2 planted expert loop read"])


def test_a_planted_per_step_float_of_the_loss_is_caught(counted):
    assert any(rank["per_step"] > 1.0 for rank in counted["zero1 planted float(loss)"])
