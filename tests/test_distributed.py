"""Multi-process runs on gloo over 127.0.0.1: split invariance, resume, resharding, memory, drift, NaN, crashes."""

import functools
import os

import dist_jobs
import pytest
import torch
from conftest import child_pids, tiny_config

from zerotrain import checkpoint
from zerotrain.runtime.launch import JobFailed, run_job

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(300)


def run(job, cfg):
    return run_job(job, cfg, time_limit=LIMIT)


def run_in_turn(*jobs):
    """The (job, config) pairs, all of one world size, run one after another on one start of the ranks."""
    return run_job(functools.partial(dist_jobs.in_turn_job, jobs=list(jobs)), jobs[0][1], time_limit=LIMIT)


def max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs_params(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("nproc", [2, 3])
def test_reduce_scatter_and_all_gather_sum_in_rank_order_with_buckets_in_flight(tmp_path, nproc):
    out = run(dist_jobs.collectives_job, tiny_config(tmp_path, nproc=nproc))
    for b, n in enumerate(out["sizes"]):
        inputs = [dist_jobs.collective_input(r, b, n) for r in range(nproc)]
        total = inputs[0].clone()
        for x in inputs[1:]:
            total += x  # rank order: what every run at this world size must reproduce bitwise
        assert torch.equal(out["gathered"][b], total), b
        assert torch.equal(out["shards"][b], total.chunk(nproc)[0]), b  # rank 0's shard
        # each rank's contribution shows: a reduction that missed any one rank would fail above
        for skip in range(nproc):
            partial = sum(x for r, x in enumerate(inputs) if r != skip)
            assert not torch.allclose(partial, total)


SOURCES = ["synthetic", "synthetic-varlen"]
SPLITS = [(1, 8, 1), (2, 2, 2), (4, 1, 2)]  # ranks x micro-batch x accumulation: 8 sequences each


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """{data: {split: params_job's result}} for every split and data source, and under "naive" the planted
    per-micro-batch mean weighting on 4 x 1 x 2 of the varlen data; one start of the ranks per split."""
    tmp = tmp_path_factory.mktemp("splits")

    def config(name, nproc, micro, accum, data):
        cfg = tiny_config(tmp / name, nproc=nproc, micro=micro, accum=accum)
        cfg.data.source = data
        return cfg

    runs = {data: {} for data in SOURCES}
    for nproc, micro, accum in SPLITS:
        jobs = [(dist_jobs.params_job, config(f"{data}-{nproc}{micro}{accum}", nproc, micro, accum, data))
                for data in SOURCES]
        if nproc == 4:
            jobs.append((dist_jobs.naive_mean_job, config("naive", nproc, micro, accum, "synthetic-varlen")))
        results = run_in_turn(*jobs)
        for data, result in zip(SOURCES, results):
            runs[data][(nproc, micro, accum)] = result
        if nproc == 4:
            runs["naive"] = results[-1]
    return runs


@pytest.mark.parametrize("data", SOURCES)
def test_split_over_ranks_and_micro_batches_does_not_change_the_math(splits, data):
    runs = splits[data]
    base = runs[(1, 8, 1)]
    assert list(runs) == SPLITS
    for split, r in runs.items():
        assert len(r["losses"]) == 5
        assert max_rel(r["losses"], base["losses"]) <= 1e-5, split
        assert max_rel(r["grad_norms"], base["grad_norms"]) <= 1e-5, split
        assert max_abs_params(r["params"], base["params"]) <= 1e-4, split
    if data == "synthetic-varlen":
        # planted bug: per-micro-batch mean weighting is caught on variable-length data
        assert max_rel(splits["naive"]["losses"], base["losses"]) > 1e-3


OVERLAPS = ["off", "on"]  # on: checkpoints are taken with all-gathers in flight


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    """{overlap: (cfg, interrupted_job's result, forgetful_resume_job's)}: 6 steps saving every 3, then a fresh run
    resumed from step 3; and the same with the planted resume that loses AdamW's moments. All on one start of
    2 ranks, each planted run after the real one it is compared with."""
    tmp = tmp_path_factory.mktemp("resumes")
    cfgs = {}
    for overlap in OVERLAPS:
        for kind in ("real", "planted"):
            cfgs[overlap, kind] = tiny_config(tmp / f"{overlap}-{kind}", nproc=2, micro=2, accum=2, steps=6,
                                              overlap=overlap)
            cfgs[overlap, kind].checkpoint.every = 3
    jobs = {"real": dist_jobs.interrupted_job, "planted": dist_jobs.forgetful_resume_job}
    results = dict(zip(cfgs, run_in_turn(*[(jobs[kind], cfg) for (_, kind), cfg in cfgs.items()])))
    return {overlap: (cfgs[overlap, "real"], results[overlap, "real"], results[overlap, "planted"])
            for overlap in OVERLAPS}


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_resume_is_bitwise_identical_and_a_lossy_resume_is_caught(resumes, overlap):
    cfg, out, planted = resumes[overlap]
    first, resumed = out["first"], out["resumed"]
    assert resumed["start"] == 3
    assert resumed["losses"] == first["losses"][3:]  # exact float equality, every step
    assert resumed["digests"] == first["digests"]
    assert all(torch.equal(first["params"][k], resumed["params"][k]) for k in first["params"])
    on_disk = checkpoint.checkpoint_model(os.path.join(cfg.checkpoint.dir, "step_00000006"))
    assert all(torch.equal(on_disk[k], resumed["params"][k]) for k in on_disk)

    # planted bug: a resume that loses AdamW's moments
    assert planted["resumed"]["digests"] != planted["first"]["digests"]
    assert planted["resumed"]["losses"] != planted["first"]["losses"][3:]


def test_resume_at_another_world_size_reshards_the_optimizer_state(tmp_path, resumes):
    # the 2-rank run: 6 steps, micro 2 x accum 2, saving every 3 (overlap off, the CPU default)
    cfg, out, _ = resumes["off"]
    full = out["first"]
    resumed_cfg = tiny_config(tmp_path, nproc=4, micro=1, accum=2, steps=6)
    resumed_cfg.checkpoint.resume = os.path.join(cfg.checkpoint.dir, "step_00000003")
    resumed_cfg.checkpoint.dir = str(tmp_path / "ck4")
    # planted in the resharding path the 4-rank resume takes: losing the moments there is far outside the bounds
    bad_cfg = tiny_config(tmp_path / "bad", nproc=4, micro=1, accum=2, steps=6)
    bad_cfg.checkpoint.resume, bad_cfg.checkpoint.dir = resumed_cfg.checkpoint.resume, str(tmp_path / "ck4bad")
    resumed, bad = run_in_turn((dist_jobs.resume_job, resumed_cfg), (dist_jobs.reshard_without_moments_job, bad_cfg))
    assert resumed["start"] == 3
    assert max_rel(resumed["losses"], full["losses"][3:]) <= 1e-5
    assert max_abs_params(resumed["params"], full["params"]) <= 1e-4
    assert bad["resharded"] and max_abs_params(bad["params"], full["params"]) > 1e-4


@pytest.mark.parametrize("nproc", [3, 4])
def test_optimizer_memory_matches_zero1_on_every_rank(tmp_path, nproc, request):
    if nproc == 4:  # the 4-rank split of `splits` already measured it: a run of its own would repeat it
        mem = request.getfixturevalue("splits")["synthetic"][(4, 1, 2)]["memory"]
    else:
        mem = run(dist_jobs.params_job, tiny_config(tmp_path, nproc=nproc, micro=1, accum=1, steps=2))["memory"]
    assert mem["per_rank"] == [mem["expected"]] * nproc
    assert mem["expected"] == 8 * mem["shard_numel"]
    assert mem["shard_numel"] * nproc >= 28_032  # padded P / N


def test_drift_on_one_rank_stops_the_run_naming_it(tmp_path):
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=6, check_every=2)
    with pytest.raises(JobFailed, match=r"invariant \(b\) failed: parameters of rank\(s\) \[1\] differ from rank 0 at step 2"):
        run(dist_jobs.drift_job, cfg)
    assert child_pids() == []


def test_nan_on_one_rank_stops_the_run_naming_step_and_rank(tmp_path):
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=6)
    cfg.guard.on_anomaly = "abort"  # rollback is tested in test_production.py
    with pytest.raises(JobFailed, match=r"invariant \(a\) failed: non-finite loss on rank\(s\) \[1\] at step 3"):
        run(dist_jobs.nan_job, cfg)
    assert child_pids() == []


def test_a_rank_dying_mid_checkpoint_leaves_only_committed_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=6)
    cfg.checkpoint.every = 2
    with pytest.raises(JobFailed, match="rank 1 failed with exit code 9"):
        run(dist_jobs.crash_in_save_job, cfg)
    assert child_pids() == []
    root = cfg.checkpoint.dir
    assert checkpoint.committed_steps(root) == ["step_00000002"]
    assert sorted(os.listdir(root)) == [".step_00000004.tmp", "latest", "step_00000002"]
    assert checkpoint.resolve_resume("auto", root).endswith("step_00000002")


def test_overlap_gives_bitwise_the_same_result_and_early_or_stale_use_is_caught(tmp_path):
    modes = ("on", "off")
    cfgs = [tiny_config(tmp_path / overlap, nproc=2, micro=2, accum=2, steps=3, overlap=overlap) for overlap in modes]
    results = dict(zip(modes, run_in_turn(*[(dist_jobs.params_job, cfg) for cfg in cfgs])))
    assert results["on"]["digests"] == results["off"]["digests"]
    assert results["on"]["losses"] == results["off"]["losses"]
    # planted bug: a loop that forgets no_sync would reduce partial gradients; the engine refuses
    cfg = tiny_config(tmp_path / "early", nproc=2, micro=2, accum=2, steps=3, overlap="on")
    with pytest.raises(JobFailed, match="arrived after its bucket was reduced"):
        run(dist_jobs.no_sync_ignored_job, cfg)
    # planted bug: a forward that does not wait for its parameters' all-gather trains on stale values
    cfg = tiny_config(tmp_path / "stale", nproc=2, micro=2, accum=2, steps=3, overlap="on")
    with pytest.raises(JobFailed, match="was used while its all-gather was in flight"):
        run(dist_jobs.unwaited_forward_job, cfg)
