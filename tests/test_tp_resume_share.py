"""A TP checkpoint resumes with every rank paying its share: TP 2 x DP 2 saved, resumed on its own mesh and resharded
to TP 1 x DP 4, every rank's checkpoint bytes read and peak resident memory measured in its own process.

Bytes (counted where read, stream.count_read): on its own mesh a rank reads its own shard (the replicas check compares
digests each rank took of the shard it holds, in memory); at a reshard its share of the verification (the files over
the ranks) and the values it will own. Memory (the kernel's high-water mark of each rank's process, reset before what is
measured: tp_share_jobs): the whole resumed job's peak within 1.25x of a fresh run's on the same mesh, and on its own
mesh the load's growth within 0.5x of the shard it reads (read in place, into the engine's own state). Planted: the
last rank assembling every TP rank's flat masters to compare the replicas (what the check did before), and every rank
reading its shard whole beside the engine (what the resume did before), each caught by that growth.
"""

import functools
import os

import dist_jobs
import pytest
import tp_share_jobs
from conftest import tiny_config

from zerotrain import checkpoint
from zerotrain.checkpoint.format import STATE_KEYS
from zerotrain.runtime.launch import run_job

LIMIT = 240  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("tp_resume_share")]
# big enough that a rank's shard (~4 MB) stands above allocator noise; one bucket per MiB
MODEL = dict(n_layer=2, n_head=4, n_embd=320, bucket_mb=1, threads=1)
BOUND = 1.25
IN_PLACE = 0.5  # a resume's growth while it loads, of the shard it reads: its values land in the engine's own state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """On one start of 4 ranks: a fresh TP 2 x DP 2 run saving step 2; its resume to step 3 on its own mesh; the same
    with the planted last-rank assembly; a fresh TP 1 x DP 4 run; the TP 2 x DP 2 checkpoint resumed on TP 1 x DP 4."""
    tmp = tmp_path_factory.mktemp("tp-share")
    fresh = tiny_config(tmp / "fresh", nproc=4, micro=2, steps=2, tp=2, ckpt_every=2, **MODEL)
    step2 = os.path.join(fresh.checkpoint.dir, checkpoint.step_name(2))

    def resuming(name, tp):
        cfg = tiny_config(tmp / name, nproc=4, micro=2, steps=3, tp=tp, **MODEL)
        cfg.checkpoint.resume = step2
        return cfg

    jobs = [(tp_share_jobs.measured_train, fresh), (tp_share_jobs.measured_train, resuming("same", 2)),
            (tp_share_jobs.planted_job, resuming("planted", 2)), (tp_share_jobs.whole_shard_job, resuming("whole", 2)),
            (tp_share_jobs.measured_train, tiny_config(tmp / "fresh-tp1", nproc=4, micro=2, steps=2, tp=1, **MODEL)),
            (tp_share_jobs.measured_train, resuming("reshard", 1))]
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=jobs), fresh, time_limit=LIMIT)
    names = ("fresh", "same", "planted", "whole", "fresh-tp1", "reshard")
    return {"step2": step2, **{n: r["ranks"] for n, r in zip(names, results)}}


def files(path) -> dict[str, int]:
    return {f["name"]: f["bytes"] for f in checkpoint.read_manifest(path)["files"]}


def test_a_tp_resume_on_its_own_mesh_reads_each_ranks_shard_and_peaks_as_a_fresh_run(runs):
    sizes = files(runs["step2"])
    for r, (mine, fresh) in enumerate(zip(runs["same"], runs["fresh"])):
        share = sizes[checkpoint.shard_name(r, 4)]
        assert mine["read"] == share, r  # its own shard once: the replicas compared by digests, nothing else read
        assert mine["peak"] <= BOUND * fresh["peak"], (r, mine, fresh)
        assert 0 <= mine["load_growth"] <= IN_PLACE * share, (r, mine, share)


def test_a_tp_resume_reads_its_shard_in_place_and_a_whole_shard_copy_is_caught_by_its_memory(runs):
    """Planted: each rank's shard read whole into tensors of its own, then copied into the engine (the resume before
    it read in place: 1.29x a fresh run's peak resident memory at 296M parameters); the state it loads is the
    same, its memory grows by about the shard while it loads."""
    sizes = files(runs["step2"])
    for r, (mine, whole) in enumerate(zip(runs["same"], runs["whole"])):
        share = sizes[checkpoint.shard_name(r, 4)]
        assert mine["load_growth"] <= IN_PLACE * share < whole["load_growth"], (r, mine, whole, share)
        assert whole["read"] == mine["read"], r  # the bytes read do not see it


def test_the_last_rank_assembling_every_tp_ranks_masters_is_caught_by_its_memory(runs):
    sizes = files(runs["step2"])
    growth = [mine["load_growth"] for mine in runs["planted"]]
    shares = [sizes[checkpoint.shard_name(r, 4)] for r in range(4)]
    # planted: rank 3 held every shard's masters and both TP ranks' flat buffers at once, uncounted by the bytes read
    assert growth[3] > BOUND * shares[3], (growth, shares)
    assert all(g <= BOUND * s for g, s in zip(growth[:3], shares[:3])), (growth, shares)
    assert [m["read"] for m in runs["planted"]] == [m["read"] for m in runs["same"]]  # the bytes do not see it


def test_a_tp_reshard_reads_each_ranks_share_and_peaks_as_a_fresh_run_on_its_mesh(runs):
    sizes = files(runs["step2"])
    old = checkpoint.read_manifest(runs["step2"])
    # the new layout, TP 1 x DP 4: every value of the full model (replicated ones once), in 4 shards
    new_shard_numel = -(-int(old["param_count"]) // 4)
    for r, (mine, fresh) in enumerate(zip(runs["reshard"], runs["fresh-tp1"])):
        verification = sum(sizes.values()) / 4  # each file hashed by one of 4 ranks (equal shards: one each)
        owned = len(STATE_KEYS) * 4 * new_shard_numel + 8  # every value it will own of each state key, and the step
        assert mine["read"] <= BOUND * (verification + owned), (r, mine, verification, owned)
        assert mine["peak"] <= BOUND * fresh["peak"], (r, mine, fresh)
