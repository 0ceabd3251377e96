"""Re-saving a step whose folder exists: a crash between the commit's two renames leaves `latest` resolvable.

The commit moves the committed `step_N/` aside to `step_N.old/`, then renames the new folder into place. A crash
between the two leaves `latest` naming `step_N`, which is not there; readers take `step_N.old/` for it and the
next run in the folder puts it back (checkpoint/commit.py). Each test also shows the state without that recovery.
"""

import hashlib
import json
import os
import shutil

import pytest
from conftest import child_pids, tiny_config, zerotrain_here
from test_engine import run_steps

from zerotrain import checkpoint
from zerotrain.checkpoint import load as load_module
from zerotrain.cli.commands import verify_checkpoint as verify_command
from zerotrain.hub import pretrained
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training.loop import build_engine

pytestmark = pytest.mark.timeout(300)

STEP_2, STEP_4, STEP_6 = (checkpoint.step_name(s) for s in (2, 4, 6))
# the lesson's tiny model on 2 ranks, one thread each, as tests/test_production.py runs its drills
TINY = ["--nproc", "2", "--micro-batch", "2", "--accum", "2", "--no-progress", "--data", "synthetic", "--threads", "1"]


class Crashed(BaseException):
    """Rank 0 dying between the renames: nothing after the hook runs (not an Exception: no writer handles it)."""


def crash(step):
    raise Crashed(step)


def hashes(folder):
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(folder))}


def crashed_resave(tmp_path, comm):
    """A run folder with committed steps 2 and 4 (`latest` -> step 4) whose re-save of step 4, with other state,
    died between its renames; (config, checkpoint root, the committed step 4's file hashes)."""
    cfg = tiny_config(tmp_path, steps=6)
    root = cfg.checkpoint.dir
    engine = build_engine(cfg, comm)
    for step in (2, 4):
        run_steps(engine, cfg, 1)
        checkpoint.save_checkpoint(root, step, engine, comm, cfg.to_dict())
    committed = hashes(os.path.join(root, STEP_4))
    run_steps(engine, cfg, 1)  # the re-save writes other state: which copy survives is visible
    writer = checkpoint.CheckpointWriter(root, comm, commit_hook=crash)
    with pytest.raises(Crashed):
        writer.save(4, engine, {"config": cfg.to_dict()})
    assert checkpoint.read_latest(root) == STEP_4 and not os.path.exists(os.path.join(root, STEP_4))
    assert sorted(os.listdir(root)) == [".step_00000004.tmp", "latest", STEP_2, STEP_4 + ".old"]
    return cfg, root, committed


def test_a_crash_between_the_renames_of_a_resave_leaves_latest_resolvable_and_a_disabled_recovery_is_caught(
        tmp_path, one_rank, capfd, monkeypatch):
    cfg, root, committed = crashed_resave(tmp_path / "run", one_rank)
    aside = os.path.join(root, STEP_4 + ".old")

    # readers resolve `latest` to the committed step 4 and change nothing
    assert checkpoint.find_resumable(root) == (aside, [])
    assert checkpoint.resolve_resume("auto", root) == aside
    assert pretrained.model_folder(cfg.logging.out) == aside  # load_model, sample, export on the run folder
    r = zerotrain_here(capfd, "verify", root)
    assert r.returncode == 0, r.stdout
    assert f"== {aside} (latest: moved aside by a re-save" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "verified: 2 checkpoints, every check passed"
    assert hashes(aside) == committed and not os.path.exists(os.path.join(root, STEP_4))

    # the next run in the folder puts it back before it looks for the checkpoint to resume
    cfg.checkpoint.resume = "auto"
    try:
        prepared = prepare_run(cfg)
    finally:
        release_run_folders()
    assert prepared.checkpoint.resume == "auto"  # the ranks resolve it: they find step 4 put back
    err = capfd.readouterr().err
    assert f"put {STEP_4} back in {root}" in err and f"--resume auto: {STEP_4} is the newest checkpoint" in err
    assert checkpoint.committed_steps(root) == [STEP_2, STEP_4]  # nothing committed deleted
    assert hashes(os.path.join(root, STEP_4)) == committed  # the committed copy, not the crashed re-save's
    assert not os.path.exists(aside) and not os.path.exists(os.path.join(root, ".step_00000004.tmp"))
    checkpoint.verify_or_raise(os.path.join(root, STEP_4))

    # planted: the recovery disabled (no reader looks at step_4.old, nothing puts it back): latest dangles, and a
    # resume falls back to step 2, losing step 4's work although its checkpoint is on disk
    cfg, root, committed = crashed_resave(tmp_path / "planted", one_rank)
    for module in (load_module, verify_command, pretrained):
        monkeypatch.setattr(module, "committed_folder", lambda root, name: os.path.join(root, name))
    monkeypatch.setattr(checkpoint, "put_back_moved_aside", lambda root: [])
    assert checkpoint.find_resumable(root)[0] == os.path.join(root, STEP_2)
    assert zerotrain_here(capfd, "verify", root).returncode == 1
    names, skipped = checkpoint.resume_candidates(root)  # what the ranks try, in order
    assert names == [STEP_2] and skipped[0][1].endswith(f"latest names {STEP_4}, which does not exist")
    cfg.checkpoint.resume = "auto"
    try:
        prepare_run(cfg)
    finally:
        release_run_folders()
    assert f"--resume auto: {STEP_2} is the newest checkpoint" in capfd.readouterr().err


def test_a_moved_aside_copy_beside_its_committed_step_is_debris_and_an_only_copy_survives_retention(tmp_path, one_rank):
    cfg, root, committed = crashed_resave(tmp_path, one_rank)
    engine = build_engine(cfg, one_rank)
    run_steps(engine, cfg, 1)
    # a commit of another step (a restarted run that resumed from step_4.old) with retention keeping 2: step 4 is
    # put back first, so retention counts it and deletes step 2, the oldest, not the only copy of step 4
    checkpoint.CheckpointWriter(root, one_rank, keep=2).save(6, engine, {"config": cfg.to_dict()})
    assert checkpoint.committed_steps(root) == [STEP_4, STEP_6] and checkpoint.read_latest(root) == STEP_6
    assert hashes(os.path.join(root, STEP_4)) == committed
    # a re-save that died after its second rename leaves the replaced copy beside the committed folder: debris
    shutil.copytree(os.path.join(root, STEP_4), os.path.join(root, STEP_4 + ".old"))
    assert checkpoint.put_back_moved_aside(root) == []
    assert sorted(os.listdir(root)) == ["latest", STEP_4, STEP_6]
    # a moved-aside folder without its manifest is no checkpoint: never put back in place of nothing
    os.makedirs(os.path.join(root, STEP_2 + ".old"))
    assert checkpoint.put_back_moved_aside(root) == [] and os.path.isdir(os.path.join(root, STEP_2 + ".old"))


def test_crash_in_commit_at_a_resaved_step_fails_in_one_line_and_resume_auto_continues_from_that_step(tmp_path, capfd):
    out = str(tmp_path / "run")
    root = os.path.join(out, "checkpoints")
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "4", "--ckpt-every", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    committed = hashes(os.path.join(root, STEP_4))

    # resumed from step 2, the run reaches step 4, whose folder exists, and rank 0 dies between the renames
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "4", "--ckpt-every", "2", "--out", out,
                       "--resume", os.path.join(root, STEP_2), faults="crash_in_commit@step=4")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == \
        "zerotrain: FAILED: rank 0 failed with exit code 75 (see its output above)"
    assert checkpoint.read_latest(root) == STEP_4 and not os.path.exists(os.path.join(root, STEP_4))
    assert hashes(os.path.join(root, STEP_4 + ".old")) == committed
    assert zerotrain_here(capfd, "verify", root).returncode == 0

    r = zerotrain_here(capfd, "train", *TINY, "--steps", "6", "--ckpt-every", "2", "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert f"put {STEP_4} back in {root}" in r.stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["resumed_from"] == os.path.join(root, STEP_4)
    assert checkpoint.committed_steps(root) == [STEP_2, STEP_4, STEP_6]
    assert not os.path.exists(os.path.join(root, STEP_4 + ".old"))
    assert child_pids() == []
