"""What a run writes and where: unwritable folders refused before any rank starts, a full disk's save leaves no debris
and names its file, rank logs stay out of shared places, and the lines a user reads are whole."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import tempfile

import pytest
from conftest import tiny_config, zerotrain_here
from test_production import TINY, last_line
from test_user_errors import one_line_error

from zerotrain.config import notes
from zerotrain.runtime import failures, run_folder
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training.metrics import Metrics

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def read_only(folder):
    """`folder` made read-only for this process: a read-only bind mount for root (whom permissions do not stop),
    the permission bits for anyone else."""
    folder.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
            yield folder
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    else:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            yield folder
        finally:
            folder.chmod(stat.S_IRWXU)


def test_an_unwritable_out_ckpt_dir_or_metrics_folder_is_one_line_before_any_rank_starts(tmp_path, capfd):
    with read_only(tmp_path / "ro") as ro:
        cases = [(["--out", str(ro / "run")], f"--out {ro / 'run'} cannot be written: Read-only file system"),
                 (["--out", str(ro)], f"--out {ro} cannot be written: Read-only file system"),
                 (["--out", str(tmp_path / "a"), "--ckpt-dir", str(ro / "ckpt")],
                  f"--ckpt-dir {ro / 'ckpt'} cannot be written: Read-only file system"),
                 (["--out", str(tmp_path / "b"), "--metrics", str(ro / "m.jsonl")],
                  f"--metrics folder {ro} cannot be written: Read-only file system")]
        if os.geteuid() != 0:
            cases = [(argv, message.replace("Read-only file system", "Permission denied")) for argv, message in cases]
        for argv, message in cases:
            r = zerotrain_here(capfd, "train", *TINY, "--steps", "2", *argv)
            assert one_line_error(r).startswith(f"zerotrain: error: {message}"), r.stderr
            assert "rank" not in r.stderr and not r.stdout  # refused in the launcher: no start line, no rank
    # a refused run leaves no folder it made (b's --out was made before its --metrics folder was refused)
    assert sorted(os.listdir(tmp_path)) == ["ro"]


def test_a_disk_full_save_leaves_no_debris_names_the_file_and_the_run_resumes(tmp_path, capfd):
    out = tmp_path / "full"
    ckpt = out / "checkpoints"
    eight = ["train", *TINY, "--steps", "8", "--ckpt-every", "2", "--out", str(out)]
    # synchronous save: rank 1's disk fills halfway through its shard of step 4
    r = zerotrain_here(capfd, *eight, faults="disk_full@step=4,rank=1")
    assert r.returncode == 1
    assert last_line(r).endswith(f": checkpoint step 4 not saved: rank 1: writing {ckpt}/.step_00000004.tmp/"
                                 "optim-rank00001-of-00002.safetensors failed: [Errno 28] No space left on device")
    assert last_line(r).startswith("zerotrain: FAILED: rank ")  # whichever rank says it first
    assert sorted(os.listdir(ckpt)) == [".zerotrain.lock", "latest", "step_00000002"]  # no partial step 4

    # asynchronous save (step 4's, the first, is synchronous and timed), rank 0's disk full at step 6: rank 1's part
    # of step 6 was written, and nothing commits it
    r = zerotrain_here(capfd, *eight, "--resume", "auto", "--async-save", faults="disk_full@step=6,rank=0")
    assert r.returncode == 1 and "optim-rank00000-of-00002.safetensors failed: [Errno 28]" in last_line(r)
    assert sorted(os.listdir(ckpt / ".step_00000006.tmp")) == ["files-rank00001.json",
                                                               "optim-rank00001-of-00002.safetensors"]

    # planted: the start that would remove it leaves it (prepare_run, where `train` takes its folders)
    cfg = tiny_config(out, steps=8)
    cfg.checkpoint.resume = "auto"
    with pytest.MonkeyPatch.context() as planted:
        planted.setattr(run_folder, "_clear_uncommitted_saves", lambda root: None)
        try:
            prepare_run(cfg)
        finally:
            release_run_folders()
    assert os.path.isdir(ckpt / ".step_00000006.tmp")

    r = zerotrain_here(capfd, *eight, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert f"zerotrain: removed .step_00000006.tmp in {ckpt}, left by a save that never committed" in r.stderr
    assert sorted(os.listdir(ckpt)) == [".zerotrain.lock", "latest", "step_00000002", "step_00000004",
                                        "step_00000006", "step_00000008"]


def test_a_rank_log_the_run_folder_cannot_take_goes_to_a_folder_of_its_own_not_a_shared_file(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = tiny_config(tmp_path)
    cfg.logging.out = str(blocker / "run")  # <out>/logs cannot be made
    try:
        raise RuntimeError("the failure")
    except RuntimeError:
        first, second = failures._write_traceback(0, cfg), failures._write_traceback(1, cfg)
    folder = os.path.dirname(first)
    assert os.path.dirname(second) == folder and os.path.basename(folder).startswith("zerotrain-logs-")
    assert os.path.dirname(folder) == tempfile.gettempdir()
    with open(first) as f:
        assert "RuntimeError: the failure" in f.read()
    cfg.logging.out = str(tmp_path / "run")
    try:
        raise RuntimeError("the next failure")
    except RuntimeError:
        assert failures._write_traceback(0, cfg) == str(tmp_path / "run" / "logs" / "rank00000.log")


def test_a_fault_planned_for_a_rank_the_job_lacks_is_refused_before_the_ranks_start(tmp_path, capfd):
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "2", "--out", str(tmp_path / "r"),
                       faults="kill@step=3,rank=7")
    assert one_line_error(r) == ("zerotrain: error: ZEROTRAIN_FAULTS: kill@step=3,rank=7 names rank 7, but the job "
                                 "has 2 rank(s) (0-1)")
    assert not os.path.exists(tmp_path / "r")


def test_a_warmup_as_long_as_the_run_is_said_before_it_starts(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, warmup_steps=100)
    assert notes(cfg) == ["--warmup-steps 100 is not shorter than --steps 2: the learning rate rises for the whole "
                          "run and ends at 2% of --lr 0.003"]
    assert notes(tiny_config(tmp_path, steps=20)) == []  # the default warmup, steps / 10


def test_the_start_line_is_printed_before_the_progress_bar_is_drawn(tmp_path, capsys):
    metrics = Metrics(str(tmp_path / "m.jsonl"), active=True, progress=True, start=0, total=3)
    metrics.announce("the start line")
    assert capsys.readouterr() == ("zerotrain: the start line\n", "")  # no bar on the terminal yet
    metrics.log(dict(step=1, loss=4.0, tokens_per_s=100.0))
    metrics.close()
    assert "train:" in capsys.readouterr().err


def test_the_memory_hint_of_a_small_model_reads_in_a_unit_of_its_size(tmp_path):
    said = failures.memory_asked(tiny_config(tmp_path))
    assert "about 438 KiB of parameters, gradients and optimizer state and 32 KiB for the logits" in said, said


def test_a_run_refused_after_taking_its_folders_leaves_none_it_made(tmp_path, capfd):
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "2", "--out", str(tmp_path / "new" / "run"),
                       "--resume", str(tmp_path / "no-such"))
    assert one_line_error(r) == f"zerotrain: error: --resume {tmp_path / 'no-such'}: no such checkpoint folder"
    assert os.listdir(tmp_path) == []


def test_ranks_take_the_launchers_environment_and_output_as_they_are_at_each_launch(tmp_path, capfd, monkeypatch):
    """The ranks are forked from a server started at the first launch: a variable set or removed since, and an
    output redirected since (pytest's capture, per test), reach the ranks of the next launch all the same."""
    import dist_jobs

    from zerotrain.runtime.launch import run_job

    for value in ("first", "second", None):
        if value is None:
            monkeypatch.delenv("ZT_PROBE")
        else:
            monkeypatch.setenv("ZT_PROBE", value)
        capfd.readouterr()
        assert run_job(dist_jobs.environment_probe_job, tiny_config(tmp_path, nproc=2), time_limit=120) == value
        out = capfd.readouterr().out
        assert f"rank 0 sees ZT_PROBE={value}" in out and f"rank 1 sees ZT_PROBE={value}" in out


def test_a_restart_names_the_rank_whose_failure_caused_it_and_says_when_the_cause_is_unknown(monkeypatch, tmp_path):
    def report(rank, kind, t, message=None):
        return {"rank": rank, "attempt": 0, "time": t, "kind": kind, "message": message or f"rank {rank}: {kind}"}

    killed = [report(0, "lost a peer", 1.0)]  # rank 1 SIGKILLed: no report of its own; rank 0 saw it vanish
    assert failures.cause_of(killed, {0, 1}) == (1, f"rank 1 {failures.SILENT}")
    # an error a rank raised comes before the peers it took down, and a timeout zerotrain explained before either
    crashed = [report(0, "lost a peer", 1.0), report(2, "exception", 2.0, "rank 2: ValueError: x")]
    assert failures.cause_of(crashed, {0, 1, 2}) == (2, "rank 2: ValueError: x")
    timed_out = [*crashed, report(3, "explained", 3.0, "rank 3: collective x at step 5 timed out")]
    assert failures.cause_of(timed_out, {0, 1, 2, 3}) == (3, "rank 3: collective x at step 5 timed out")
    assert failures.cause_of([], set()) == (None, failures.UNKNOWN_CAUSE)
    # rank 2 SIGKILLed, rank 1 saw it vanish, rank 0 hung in a collective and the launcher's reaper killed it: rank
    # 2 is the cause, whom the reaper's record tells apart from rank 0 (planted: no record, and rank 0 is blamed)
    job = tmp_path / "job"
    for name in ("pids", "reaped"):
        (job / name).mkdir(parents=True)
    for rank in range(3):
        (job / "pids" / f"attempt0-rank{rank}").write_text(str(10_000 + rank))
    (job / "reaped" / "attempt0-rank0").write_text("")
    monkeypatch.setattr(failures, "_job_dir", str(job))
    monkeypatch.setattr(failures, "restart_count", lambda: 1)
    monkeypatch.setattr(failures, "_reports", lambda job_dir: [report(1, "lost a peer", 1.0)])
    assert failures.restart_cause() == (2, f"rank 2 {failures.SILENT}")
    monkeypatch.setattr(failures, "REAPED", "not-recorded")
    assert failures.restart_cause() == (0, f"rank 0 {failures.SILENT}")
    # under torchrun (no job folder of zerotrain's launcher) the cause is said to be unknown, not guessed
    monkeypatch.setattr(failures, "_job_dir", None)
    monkeypatch.setattr(failures, "restart_count", lambda: 1)
    assert failures.restart_cause() == (None, failures.UNKNOWN_CAUSE) and "not known" in failures.UNKNOWN_CAUSE
