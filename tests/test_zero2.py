"""--zero 2: gradients sharded as each bucket completes; bitwise the same training as stage 1, fewer bytes held."""

import os

import pytest
import torch
import zero2_jobs
from conftest import tiny_config

from zerotrain.runtime.launch import JobFailed, run_job

pytestmark = pytest.mark.timeout(300)


def run(job, cfg):
    return run_job(job, cfg, time_limit=120)


def same_training(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["digests"] == b["digests"] and \
        all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def config(path, zero, **kw):
    kw = {"nproc": 2, "micro": 2, "steps": 3, **kw}
    return tiny_config(path / f"zero{zero}", zero=zero, **kw)


@pytest.mark.parametrize("split", [dict(accum=1, overlap="on"), dict(accum=2, overlap="off", precision="bf16"),
                                   dict(nproc=4, tp=2, accum=2, overlap="on")],
                         ids=["accum1", "accum2-bf16", "tp2xdp2"])
def test_stage2_trains_bitwise_like_stage1_holding_a_shard_of_the_gradients(tmp_path, split):
    one = run(zero2_jobs.stage_job, config(tmp_path, 1, **split))
    two = run(zero2_jobs.stage_job, config(tmp_path, 2, **split))
    # The same additions in the same order into the same reduce-scatters: bitwise, with accumulation too.
    assert same_training(one, two)
    # Between steps stage 2 holds the gradient shard only; during one, at most two buckets more at accumulation 1
    # (with accumulation every bucket stays through the window: stage 1's peak, less its bf16 copy).
    assert two["grad_bytes"] == two["shard_bytes"] < one["grad_bytes"]
    if split["accum"] == 1:
        assert two["grad_peak_bytes"] <= two["shard_bytes"] + two["two_largest_buckets"]
        assert two["grad_peak_bytes"] <= one["grad_peak_bytes"] / 2 + two["two_largest_buckets"]
    else:
        assert two["grad_peak_bytes"] <= one["grad_peak_bytes"]


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    return run(zero2_jobs.stage_job, config(tmp_path_factory.mktemp("stage1"), 1, accum=2))


def test_a_bucket_freed_before_its_reduce_scatter_or_never_freed_is_caught(tmp_path, stage1):
    planted = run(zero2_jobs.freed_early_job, config(tmp_path, 2, accum=2))
    assert not same_training(stage1, planted)
    # Never freed: the next step accumulates onto the last one's gradients. The run's own memory plan check
    # stops it after its first step, before any such step: it holds more than its shard of the gradients.
    with pytest.raises(JobFailed, match=r"memory plan failed at step 1: rank \d holds [\d,]+ bytes of gradients, "
                                        r"the plan [\d,]+"):
        run(zero2_jobs.never_freed_job, config(tmp_path / "kept", 2, accum=2))


def test_a_stage1_checkpoint_resumes_at_stage2_and_back_bitwise(tmp_path):
    full = run(zero2_jobs.stage_job, config(tmp_path / "full", 1, accum=2, steps=6, ckpt_every=2))
    chain = [(1, "full", 2, "two"), (2, "two", 4, "back")]  # stage 1's step 2 at stage 2, whose step 4 at stage 1
    for saved, folder, step, out_folder in chain:
        cfg = config(tmp_path / out_folder, 3 - saved, accum=2, steps=6, ckpt_every=2)
        cfg.checkpoint.resume = os.path.join(config(tmp_path / folder, saved).checkpoint.dir, f"step_{step:08d}")
        out = run(zero2_jobs.stage_job, cfg)
        assert out["start"] == step and out["losses"] == full["losses"][step:] and out["digests"] == full["digests"]
