"""A resume on the checkpoint's own mesh reads each file of it once across the ranks and the launcher none; a corrupt
file is still found, by whichever rank reads it.

On the mesh and layout that wrote a checkpoint, every rank reads its own shard whole, hashing the bytes as it loads
them: that is the shard's verification. So after --resume PATH, --resume auto or a restart the bytes rank r read are
exactly its shard's file, and the ranks' sum is the checkpoint's listed files (a run on synthetic data has no
tokenizer file; the manifest is JSON, read by every rank and not counted). The launcher reads manifests only: it
counts no checkpoint bytes. Planted: every rank checking every file before it reads its own shard (what a restart
did before), and the launcher verifying the checkpoint it names, are both caught by these counts. A version-1
checkpoint's model file is hashed once too, by one rank (and compared with the masters, a tensor at a time), and a
corrupt one is refused.
"""

import functools
import json
import os
import re
import shutil
import struct

import dist_jobs
import pytest
import reshard_jobs
import resume_jobs
from conftest import tiny_config, zerotrain_here

from zerotrain import checkpoint
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.cli.main import main
from zerotrain.runtime import run_folder
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
READ, WRITTEN = "checkpoint_bytes_read", "checkpoint_bytes_written"
pytestmark = pytest.mark.timeout(300)

TINY = ["--micro-batch", "2", "--accum", "2", "--no-progress", "--data", "synthetic", "--threads", "1"]


def run_in_turn(*jobs):
    """The (job, config) pairs, all of one world size, run one after another on one start of the ranks."""
    return run_job(functools.partial(dist_jobs.in_turn_job, jobs=list(jobs)), jobs[0][1], time_limit=LIMIT)


def file_sizes(path) -> dict[str, int]:
    """Each file the checkpoint at `path` lists, and its bytes."""
    return {f["name"]: f["bytes"] for f in checkpoint.read_manifest(path)["files"]}


def shard_sizes(path) -> list[int]:
    world = checkpoint.read_manifest(path)["world_size"]
    return [file_sizes(path)[checkpoint.shard_name(r, world)] for r in range(world)]


def header_bytes(path) -> int:
    """The bytes of every shard's safetensors header (its length and its JSON): what reading all headers reads."""
    world, total = checkpoint.read_manifest(path)["world_size"], 0
    for r in range(world):
        with open(os.path.join(path, checkpoint.shard_name(r, world)), "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def flip_a_byte(file, at=200):
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A 2-rank run saves steps 2 and 4; the launcher prepares --resume auto and --resume PATH runs (its bytes counted
    around each); then, on one start of 2 ranks, --resume PATH, --resume auto, a restart (attempt 1) and --resume PATH
    with the planted every-file check each resume step 4 and train to step 5 without saving."""
    tmp = tmp_path_factory.mktemp("resume")
    saved = tiny_config(tmp / "saved", nproc=2, micro=2, steps=4)
    saved.checkpoint.every = 2
    run_in_turn((reshard_jobs.save_job, saved))
    root = saved.checkpoint.dir
    step4 = os.path.join(root, checkpoint.step_name(4))

    def resuming(name, resume):
        cfg = tiny_config(tmp / name, nproc=2, micro=2, steps=5)
        cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.final_save = root, resume, False
        return cfg

    launcher, prepared = {}, {}
    try:
        for case, resume in (("auto", "auto"), ("path", step4)):
            before = bytes_counted()[READ]
            prepared[case] = prepare_run(resuming(case, resume))
            launcher[case] = bytes_counted()[READ] - before
    finally:
        release_run_folders()
    results = run_in_turn((resume_jobs.counted_resume_job, prepared["path"]),
                          (resume_jobs.counted_resume_job, prepared["auto"]),
                          (resume_jobs.restarted_job, resuming("restart", "")),
                          (resume_jobs.planted_job, resuming("planted", step4)))
    assert prepared["auto"].checkpoint.resume == "auto"  # the ranks pick the checkpoint, verifying as they read
    return {"step4": step4, "launcher": launcher, "resuming": resuming,
            "ranks": dict(zip(("path", "auto", "restart", "planted"), results))}


@pytest.mark.parametrize("case", ["path", "auto", "restart"])
def test_a_same_mesh_resume_reads_each_ranks_shard_once_and_the_launcher_reads_nothing(counted, case):
    step4, out = counted["step4"], counted["ranks"][case]
    assert (out["start"], out["resumed_from"]) == (4, step4)
    # each rank read exactly its own shard: its verification is the read that loads it
    assert out["read"] == shard_sizes(step4), case
    assert sum(out["read"]) == sum(file_sizes(step4).values())  # every listed file once, across the ranks
    if case in counted["launcher"]:
        assert counted["launcher"][case] == 0  # the launcher read manifests, no checkpoint data


def test_every_rank_checking_every_file_before_its_own_shard_is_caught_by_the_byte_count(counted):
    step4, real, planted = counted["step4"], counted["ranks"]["path"], counted["ranks"]["planted"]
    shards, files = shard_sizes(step4), sum(file_sizes(step4).values())
    assert planted["start"] == real["start"] == 4  # it resumed the same state: only the bytes read tell them apart
    # planted: each rank hashed every file and read every shard's header, then read its own shard
    assert planted["read"] == [own + files + header_bytes(step4) for own in shards]
    assert all(p > r for p, r in zip(planted["read"], real["read"]))


def test_a_launcher_that_verifies_the_checkpoint_it_names_is_caught_by_its_byte_count(counted, monkeypatch):
    step4 = counted["step4"]
    real = run_folder._check_resumable

    def verifying(cfg, path, manifest=None):  # planted: the launcher hashes the checkpoint, as it did before
        real(cfg, path, manifest)
        checkpoint.verify_or_raise(path)

    monkeypatch.setattr(run_folder, "_check_resumable", verifying)
    read = {}
    try:
        for case, resume in (("auto", "auto"), ("path", step4)):
            before = bytes_counted()[READ]
            prepare_run(counted["resuming"](f"launcher-{case}", resume))
            read[case] = bytes_counted()[READ] - before
    finally:
        release_run_folders()
    assert read == {case: sum(file_sizes(step4).values()) + header_bytes(step4) for case in ("auto", "path")}
    assert counted["launcher"] == {"auto": 0, "path": 0}


# ---------------------------------------------------------------- a real restart, as summary.json counts it
@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """`train` on 2 ranks to step 4, saving every 2 steps, with rank 1 killed at step 3 and one restart allowed; its
    run folder."""
    out = str(tmp_path_factory.mktemp("restart") / "run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ZEROTRAIN_FAULTS", "kill@step=3,rank=1")
        try:
            code = main(["train", "--nproc", "2", *TINY, "--steps", "4", "--ckpt-every", "2", "--max-restarts", "1",
                         "--out", out])
        finally:
            release_run_folders()
    assert code == 0
    return out


def test_a_restart_reads_each_ranks_shard_once_as_summary_json_counts_it(restarted):
    summary = json.load(open(os.path.join(restarted, "summary.json")))
    assert summary["restarts"] == 1 and summary["start_step"] == 2
    per_rank = summary["per_rank"]
    # the restarted ranks' counts: the resume's reads (each rank's shard of step 2), then step 4's save, which reads
    # nothing back
    step2, step4 = (os.path.join(restarted, "checkpoints", checkpoint.step_name(s)) for s in (2, 4))
    assert per_rank[WRITTEN] == shard_sizes(step4)
    assert per_rank[READ] == shard_sizes(step2)


# ---------------------------------------------------------------- corruption, whoever reads it
SHARD_BYTES_DIFFER = r"sha256 [0-9a-f]{12}\.\.\. differs from [0-9a-f]{12}\.\.\. in manifest\.json \(corrupt\)"


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """A 3-rank run's folder with checkpoints at steps 2 and 4."""
    out = str(tmp_path_factory.mktemp("three") / "run")
    try:
        assert main(["train", "--nproc", "3", *TINY, "--steps", "4", "--ckpt-every", "2", "--out", out]) == 0
    finally:
        release_run_folders()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_resume_path_with_a_corrupt_shard_of_rank_1_fails_in_one_line_naming_it(world, restarted, three_ranks,
                                                                               tmp_path, capfd):
    out = str(tmp_path / "copy")
    shutil.copytree({2: restarted, 3: three_ranks}[world], out)
    step4 = os.path.join(out, "checkpoints", checkpoint.step_name(4))
    shard = os.path.join(step4, checkpoint.shard_name(1, world))
    flip_a_byte(shard)  # the planted fault, in the file rank 1 alone reads
    before = bytes_counted()[READ]
    r = zerotrain_here(capfd, "train", "--nproc", str(world), *TINY, "--steps", "5", "--out", str(tmp_path / "new"),
                       "--resume", step4)
    assert bytes_counted()[READ] == before  # the launcher read none of it: the ranks found it
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert re.fullmatch(rf"zerotrain: FAILED: rank \d: --resume {re.escape(step4)}: {re.escape(shard)}: "
                        rf"{SHARD_BYTES_DIFFER}\n", r.stderr), r.stderr


def test_resume_auto_past_a_corrupt_shard_of_rank_1_falls_back_said_once_by_rank_0(three_ranks, tmp_path, capfd):
    out = str(tmp_path / "copy")
    shutil.copytree(three_ranks, out)
    root = os.path.join(out, "checkpoints")
    shard = os.path.join(root, checkpoint.step_name(4), checkpoint.shard_name(1, 3))
    flip_a_byte(shard)
    r = zerotrain_here(capfd, "train", "--nproc", "3", *TINY, "--steps", "5", "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("--resume auto: step_00000004 is the newest checkpoint") == 1  # the launcher names it
    said = rf"--resume auto: step_00000004 fails verification \({re.escape(shard)}: {SHARD_BYTES_DIFFER}\)"
    failed = re.findall(said, r.stderr)
    assert len(failed) == 1, r.stderr  # rank 0 says it, once
    assert r.stderr.count("--resume auto: falling back to step_00000002, the newest checkpoint that verifies") == 1
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["start_step"] == 2 and summary["resumed_from"] == os.path.join(root, checkpoint.step_name(2))


# ---------------------------------------------------------------- format version 1: the model file, read once too
def test_a_version_1_checkpoint_resumes_reading_its_model_file_once_and_a_corrupt_one_is_refused(tmp_path, one_rank):
    from conftest import as_version_1

    from zerotrain.training.loop import build_engine

    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "ck"), 1, engine, one_rank, cfg.to_dict())
    as_version_1(path)
    sizes = file_sizes(path)
    assert set(sizes) == {checkpoint.shard_name(0, 1), checkpoint.MODEL_FILE}
    before = bytes_counted()[READ]
    assert checkpoint.load_checkpoint(path, build_engine(cfg, one_rank), one_rank)["version"] == 1
    # the shard as it loads, the model file hashed, then the model check: the file's tensors and the masters they are
    # compared with, each read once more (counted since the check streams them a tensor at a time)
    count = checkpoint.read_manifest(path)["param_count"]
    assert bytes_counted()[READ] - before == sum(sizes.values()) + 2 * 4 * count
    model_file = os.path.join(path, checkpoint.MODEL_FILE)
    flip_a_byte(model_file, at=os.path.getsize(model_file) - 4)  # planted: one byte of the model's last tensor
    with pytest.raises(checkpoint.CheckpointError, match=rf"{re.escape(checkpoint.MODEL_FILE)}: {SHARD_BYTES_DIFFER}"):
        checkpoint.load_checkpoint(path, build_engine(cfg, one_rank), one_rank)
