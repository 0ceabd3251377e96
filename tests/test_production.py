"""Production runs as a user meets them: faults injected through ZEROTRAIN_FAULTS, nothing committed ever lost.

Every fault is planned deterministically (a step and a rank), never by sleeps or timing luck; each test
also shows what happens without the protection it proves, or the planted fault it catches.
"""

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import dist_jobs
import pytest
from conftest import child_pids, live_processes, tiny_config, zerotrain_here

from zerotrain import checkpoint
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.runtime.launch import JobFailed, run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training.loop import train_job

pytestmark = pytest.mark.timeout(300)

# --threads 1 (a 2-core machine's default): the launcher's ranks and torchrun's, one or two per node, all
# compute alike, so the runs of every drill can be compared bitwise with one uninterrupted run. --peak-flops: MFU
# against a given peak, not the CPU's matmul timed as each run starts (conftest's tiny_config).
TINY = ["--nproc", "2", "--micro-batch", "2", "--accum", "2", "--no-progress", "--data", "synthetic", "--threads", "1",
        "--peak-flops", "1e12"]


def train_in_turn(*argvs: list[str]) -> list[dict]:
    """`zerotrain train ARGV` for each argv, in turn on one start of the ranks (which costs more than these runs):
    each config as the command line builds it, its folder prepared as the command prepares it before the ranks
    start; what train_job returned to the command, in order."""
    try:
        cfgs = [prepare_run(config_from_args(build_parser().parse_args(["train", *argv]))) for argv in argvs]
        return run_job(functools.partial(dist_jobs.in_turn_job, jobs=[(train_job, cfg) for cfg in cfgs]), cfgs[0],
                       time_limit=240)
    finally:
        release_run_folders()


def last_line(r) -> str:
    return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_of(run_dir):
    return [r["step"] for r in records(run_dir) if "event" not in r]


def events(run_dir, kind):
    return [r for r in records(run_dir) if r.get("event") == kind]


def checkpoint_files(folder) -> dict[str, str]:
    """sha256 of every data file of a checkpoint (the manifest aside, which records the run's own flags)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def final_state(run_dir, step):
    return checkpoint_files(os.path.join(run_dir, "checkpoints", checkpoint.step_name(step)))


SIX_STEPS = ["--steps", "6", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The run folder of `train TINY --steps 6 --ckpt-every 2`, never stopped: the files every fault drill of six
    steps must end with. A checkpoint's data files hold the training state only, whatever cadence saved them."""
    out = str(tmp_path_factory.mktemp("uninterrupted") / "whole")
    assert main(["train", *TINY, *SIX_STEPS, "--out", out]) == 0
    return out


def test_a_fresh_run_refuses_a_folder_holding_an_earlier_run_and_retention_keeps_what_latest_names(tmp_path, capfd,
                                                                                                   uninterrupted):
    out = str(tmp_path / "R")
    shutil.copytree(uninterrupted, out)  # an earlier run's folder: 6 steps, checkpoints at steps 2, 4 and 6
    before = (steps_of(out), sorted(os.listdir(os.path.join(out, "checkpoints"))))
    assert before == ([1, 2, 3, 4, 5, 6], [".zerotrain.lock", "latest", "step_00000002", "step_00000004",
                                           "step_00000006"])

    # The reproduction of the data loss: a fresh, shorter run into the same folder with --keep 2.
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "4", "--ckpt-every", "4", "--keep", "2", "--out", out)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "already holds an earlier run's checkpoints (newest step_00000006)" in r.stderr
    assert "--resume auto" in r.stderr and "--overwrite" in r.stderr
    assert (steps_of(out), sorted(os.listdir(os.path.join(out, "checkpoints")))) == before  # untouched

    # the earlier run continued, and --resume auto in an empty folder, on one start of the ranks
    empty = str(tmp_path / "empty")
    train_in_turn([*TINY, "--steps", "12", "--ckpt-every", "4", "--keep", "2", "--out", out, "--resume", "auto"],
                  [*TINY, "--steps", "2", "--out", empty, "--resume", "auto"])
    empty_root = os.path.join(empty, "checkpoints")
    assert f"--resume auto: no checkpoint in {empty_root}; starting fresh" in capfd.readouterr().err
    assert steps_of(empty) == [1, 2]
    assert steps_of(out) == list(range(1, 13))  # appended, not rewritten
    root = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(root)) == [".zerotrain.lock", "latest", "step_00000008", "step_00000012"]
    assert checkpoint.resolve_resume("auto", root).endswith("step_00000012")

    r = zerotrain_here(capfd, "train", *TINY, "--steps", "4", "--ckpt-every", "4", "--keep", "2", "--out", out,
                       "--overwrite")
    assert r.returncode == 0, r.stderr
    assert "--overwrite: removed" in r.stderr
    assert steps_of(out) == [1, 2, 3, 4]
    assert sorted(os.listdir(root)) == [".zerotrain.lock", "latest", "step_00000004"]

    afile = tmp_path / "a-file"
    afile.write_text("not a folder")
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "2", "--out", str(afile))
    assert r.returncode == 2 and r.stderr == f"zerotrain: error: --out {afile} is a file, not a folder\n"


def test_sigterm_saves_exits_0_and_the_resumed_run_is_bitwise_identical(tmp_path, capfd, uninterrupted):
    args = [*TINY, "--steps", "6", "--ckpt-every", "4"]  # the stop comes before the first save: only its own saves
    whole, stopped = uninterrupted, str(tmp_path / "stopped")

    # the SIGTERM goes to the launcher alone (this process, whose handler the command installs for the run)
    r = zerotrain_here(capfd, "train", *args, "--out", stopped, faults="sigterm@step=3,rank=1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        "zerotrain: stopped by SIGTERM at step 3; saved step_00000003; continue with --resume auto"
    assert steps_of(stopped) == [1, 2, 3]
    # the resume, and what the comparison catches: the same resume with a learning rate 1e-7 relative off
    nudged = str(tmp_path / "nudged")
    step3 = os.path.join(stopped, "checkpoints", checkpoint.step_name(3))
    resumed, _ = train_in_turn([*args, "--out", stopped, "--resume", "auto"],
                               [*args, "--out", nudged, "--resume", step3, "--lr", "0.0030000003"])
    assert resumed["resumed_from"] == step3
    assert steps_of(stopped) == list(range(1, 7))
    assert final_state(stopped, 6) == final_state(whole, 6)
    assert final_state(nudged, 6) != final_state(whole, 6)


def in_own_session(tmp_path, *args, faults, python_first=(), console_reader_gone=False, settle_s=10):
    """`zerotrain ARGS` in a process group of its own (a group signal then reaches only the job), with `faults`;
    `python_first`: lines run in the launcher's interpreter before the command (a planted bug). What the group
    still holds `settle_s` after the launcher has exited is killed (a planted bug can orphan ranks) and returned as
    `left`.
    `console_reader_gone`: its output goes to a pipe whose reader has already gone (nothing of it is returned)."""
    code = "\n".join([*python_first, "import sys", "from zerotrain.cli.main import main", "sys.exit(main(sys.argv[1:]))"])
    env = dict(os.environ, ZEROTRAIN_FAULTS=faults)
    reader, writer = os.pipe()
    os.close(reader)
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err:
        job = subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True, start_new_session=True,
                               stdout=writer if console_reader_gone else out, stderr=writer if console_reader_gone else err)
        os.close(writer)
        try:
            job.wait(timeout=240)
        finally:
            deadline = time.monotonic() + settle_s  # the ranks' server ends once its launcher has gone
            while (left := _in_group(job.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            job.wait()
        out.seek(0)
        err.seek(0)
        r = subprocess.CompletedProcess(job.args, job.returncode, out.read(), err.read())
    r.left = left
    return r


def _in_group(pgid: int) -> list[int]:
    """Every live process of a process group: ranks orphaned by their server's death included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if state != "Z" and int(group) == pgid:
            found.append(int(pid))
    return found


@pytest.mark.parametrize("kind", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_is_one_stop_saved_at_its_step_and_the_resumed_run_is_bitwise_identical(
        tmp_path, uninterrupted, kind):
    """Ctrl-C in a terminal (SIGINT), `timeout` or `kill -TERM -- -PGID` (SIGTERM) signal the launcher, the ranks'
    server and every rank at once: one request, saved at its step, exit 0. Planted: a server that dies of SIGTERM
    (multiprocessing's own) took with it the ranks' exit codes, and every rank that saved was reported as 255."""
    args = [*TINY, "--steps", "6", "--ckpt-every", "4"]
    stopped = str(tmp_path / "stopped")
    r = in_own_session(tmp_path, "train", *args, "--out", stopped, faults=f"group_{kind.lower()}@step=3,rank=1")
    assert r.returncode == 0 and r.left == [], r.stderr
    # the launcher's one line for the request; the second when a rank's own delivery began its save first (a loaded
    # machine runs the ranks' handlers before the launcher's)
    assert r.stderr.strip().splitlines()[-1] in (
        f"zerotrain: {kind} received: every rank finishes its current step and saves; send it again to stop at once",
        f"zerotrain: saving step 3; {kind} and any further signal are ignored until the save is committed"), r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        f"zerotrain: stopped by {kind} at step 3; saved step_00000003; continue with --resume auto"
    assert checkpoint.committed_steps(os.path.join(stopped, "checkpoints")) == ["step_00000003"]
    if kind == "SIGTERM":
        # the planted server's death orphans its ranks: no waiting for them to end (they would not)
        planted = in_own_session(tmp_path, "train", *args, "--out", str(tmp_path / "planted"), faults="group_sigterm@step=3",
                                 python_first=["import zerotrain.runtime.rank_start as r",
                                               "r.SERVER_FLAG = 'NOT_THE_SERVER'"], settle_s=0)
        assert planted.returncode == 1 and "failed with exit code 255" in planted.stderr, planted.stderr
        return
    resumed, = train_in_turn([*args, "--out", stopped, "--resume", "auto"])
    assert resumed["start_step"] == 3 and steps_of(stopped) == list(range(1, 7))
    assert final_state(stopped, 6) == final_state(uninterrupted, 6)


def test_a_console_whose_reader_is_gone_does_not_end_a_run_stopped_by_a_signal(tmp_path):
    """`zerotrain train ... | tee log` and Ctrl-C: tee ends with the same signal, so every line the launcher and rank 0
    write from then on meets a broken pipe; here the reader is gone from the start. The run is stopped and saved at
    step 3 all the same, exit 0, nothing left behind. Planted: the launcher's console as it was (its "SIGINT
    received" line raised BrokenPipeError in its signal handler, which ended it)."""
    args = [*TINY, "--steps", "6", "--ckpt-every", "4"]
    r = in_own_session(tmp_path, "train", *args, "--out", str(tmp_path / "run"), faults="group_sigint@step=3,rank=1",
                       console_reader_gone=True)
    assert r.returncode == 0 and r.left == []
    assert checkpoint.committed_steps(os.path.join(tmp_path, "run", "checkpoints")) == ["step_00000003"]
    assert events(str(tmp_path / "run"), "stop") == [{"event": "stop", "step": 3, "signal": "SIGINT"}]
    planted = in_own_session(tmp_path, "train", *args, "--out", str(tmp_path / "planted"),
                             faults="group_sigint@step=3,rank=1", console_reader_gone=True,
                             python_first=["import contextlib, zerotrain.runtime.console as c",
                                           "c.console_outlives_its_reader = contextlib.nullcontext"])
    assert planted.returncode != 0


def test_one_stop_delivered_twice_is_one_request_and_a_later_second_signal_stops_at_once(tmp_path, monkeypatch):
    """The rank and the launcher count a signal within SAME_STOP_S of the first as that stop delivered again (a group
    signal that torchrun's agent, or `timeout`, delivers once more); one sent later stops at once. Planted: counting
    every delivery as a request (a window of 0) stops at once on one Ctrl-C under torchrun."""
    from zerotrain.runtime import stop as stop_module
    from zerotrain.runtime.stop import SAME_STOP_S, StopRequest
    from zerotrain.runtime.supervise import LauncherSignals

    now = [100.0]
    exits = []
    monkeypatch.setattr(stop_module.os, "_exit", exits.append)

    def deliver(handler, after_s):
        now[0] += after_s
        handler._on_signal(signal.SIGINT, None)

    def launcher():
        open(tmp_path / "stepping", "w").close()
        return LauncherSignals(str(tmp_path / "stop"), [str(tmp_path / "stepping")], clock=lambda: now[0])

    def rank():
        request = StopRequest(str(tmp_path / "stop"), clock=lambda: now[0])
        request.begin_stepping()
        return request

    def drill():
        """(launcher's hard stop, rank's exits) for a stop delivered twice 10 ms apart, then a second 2 s later."""
        seen = []
        for when in (0.01, SAME_STOP_S + 1):
            if os.path.exists(tmp_path / "stop"):
                os.remove(tmp_path / "stop")
            exits.clear()
            ours, theirs = launcher(), rank()
            for handler in (ours, theirs):
                deliver(handler, 0)
                deliver(handler, when)
            seen.append((ours.hard_stop, list(exits), theirs.requested))
        return seen

    assert drill() == [(None, [], True), ("SIGINT", [128 + signal.SIGINT], True)]
    # the stop file the launcher writes is not a signal: the rank's own copy of the group's signal is still its first
    exits.clear()
    open(tmp_path / "stop", "w").write("SIGINT")
    theirs = rank()
    assert theirs.requested
    deliver(theirs, 0)
    assert exits == []
    monkeypatch.setattr(stop_module, "SAME_STOP_S", 0.0)  # planted: every delivery counts
    assert drill()[0] == ("SIGINT", [128 + signal.SIGINT], True)


def test_a_signal_once_the_stop_save_has_begun_waits_for_it_in_the_rank_and_the_launcher(tmp_path, monkeypatch,
                                                                                          capsys):
    """Once every rank saves the stop's step (the step's all-reduce carried a stop flag), a second request more than
    SAME_STOP_S after the first neither ends a rank nor makes the launcher stop them: exiting then would leave the
    other ranks in the save's collectives and lose the step it commits. The launcher says so in one line. Planted:
    a rank that never records that its save began (StopRequest.begin_save does nothing) exits at once, and a
    launcher that sees no saving file stops every rank."""
    from zerotrain.runtime import stop as stop_module
    from zerotrain.runtime.stop import SAME_STOP_S, StopRequest
    from zerotrain.runtime.supervise import LauncherSignals

    now = [100.0]
    exits = []
    monkeypatch.setattr(stop_module.os, "_exit", exits.append)
    saving = str(tmp_path / "saving-rank0")

    def drill():
        """(the rank's exits, the signals it ignored, the launcher's hard stop) for a second signal in the save."""
        for path in (tmp_path / "stop", tmp_path / "saving-rank0"):
            if os.path.exists(path):
                os.remove(path)
        exits.clear()
        open(tmp_path / "stepping", "w").close()
        launcher = LauncherSignals(str(tmp_path / "stop"), [str(tmp_path / "stepping")], clock=lambda: now[0],
                                   saving_files=[saving, str(tmp_path / "saving-rank1")])
        rank = StopRequest(str(tmp_path / "stop"), saving_file=saving, clock=lambda: now[0])
        rank.begin_stepping()
        for handler in (launcher, rank):
            handler._on_signal(signal.SIGINT, None)
        rank.begin_save(3)  # the stop's step: its all-reduce carried the flag
        now[0] += SAME_STOP_S + 1
        for handler in (launcher, rank):
            handler._on_signal(signal.SIGINT, None)
        return exits[:], rank.ignored, launcher.hard_stop

    assert drill() == ([], 1, None)
    assert open(saving).read() == "3"
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "zerotrain: saving step 3; SIGINT and any further signal are ignored until the save is committed"
    monkeypatch.setattr(StopRequest, "begin_save", lambda self, step: None)  # planted: the save is not recorded
    assert drill() == ([128 + signal.SIGINT], 0, "SIGINT")


def test_a_first_signal_that_finds_a_rank_saving_still_leaves_the_stop_file(tmp_path):
    """A signal to the group reaches a rank and the launcher at once; when the rank's stop-save has begun before the
    launcher's handler runs (a loaded machine), the launcher still writes the stop file for that request (what a
    second request's drill waits for), and ignores the request with its one line."""
    from zerotrain.runtime.supervise import LauncherSignals

    open(tmp_path / "stepping", "w").close()
    with open(tmp_path / "saving-rank1", "w") as f:
        f.write("3")
    launcher = LauncherSignals(str(tmp_path / "stop"), [str(tmp_path / "stepping")], clock=lambda: 100.0,
                               saving_files=[str(tmp_path / "saving-rank0"), str(tmp_path / "saving-rank1")])
    launcher._on_signal(signal.SIGINT, None)
    assert open(tmp_path / "stop").read() == "SIGINT" and launcher.hard_stop is None


def test_a_second_signal_inside_a_stop_save_waits_for_its_commit_and_the_resumed_run_is_bitwise_identical(
        tmp_path, uninterrupted):
    """Ctrl-C to the group at step 3 (the stop), then Ctrl-C again while rank 0 commits step 3, SAME_STOP_S after the
    first (a second request): the save commits, the job exits 0 with its stop line, and the run resumed from it ends
    bitwise identical to one never stopped. Planted: a launcher that does not see the save begun stops every rank at
    once (exit 130)."""
    args = [*TINY, "--steps", "6", "--ckpt-every", "4"]
    stopped, faults = str(tmp_path / "stopped"), "group_sigint@step=3,rank=1;group_sigint_in_commit@step=3"
    r = in_own_session(tmp_path, "train", *args, "--out", stopped, faults=faults)
    assert r.returncode == 0 and r.left == [], r.stderr
    assert "zerotrain: saving step 3; SIGINT and any further signal are ignored until the save is committed\n" in \
        r.stderr
    assert "group_sigint_in_commit at step 3 on rank 0" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        "zerotrain: stopped by SIGINT at step 3; saved step_00000003; continue with --resume auto"
    assert checkpoint.committed_steps(os.path.join(stopped, "checkpoints")) == ["step_00000003"]
    resumed, = train_in_turn([*args, "--out", stopped, "--resume", "auto"])
    assert resumed["start_step"] == 3 and final_state(stopped, 6) == final_state(uninterrupted, 6)
    planted = in_own_session(tmp_path, "train", *args, "--out", str(tmp_path / "planted"), faults=faults,
                             python_first=["import zerotrain.runtime.supervise as s",
                                           "s.LauncherSignals.saving_step = lambda self: None"])
    assert planted.returncode == 128 + signal.SIGINT, planted.stderr
    assert planted.stderr.strip().splitlines()[-1] == \
        "zerotrain: stopped at once by a second SIGINT; what was not yet committed is lost"


def test_a_killed_rank_is_restarted_from_the_last_checkpoint_and_the_run_ends_bitwise_identical(tmp_path, capfd,
                                                                                                 uninterrupted):
    args = [*TINY, *SIX_STEPS]
    whole, killed = uninterrupted, str(tmp_path / "killed")

    r = zerotrain_here(capfd, "train", *args, "--out", killed, "--max-restarts", "1", faults="kill@step=5,rank=1")
    assert r.returncode == 0, r.stderr
    restart = events(killed, "restart")
    assert len(restart) == 1 and restart[0]["step"] == 4 and restart[0]["steps_lost"] == 0
    # the restart names the rank that died and why: rank 0 only lost its peer
    assert restart[0]["failed_rank"] == 1 and restart[0]["cause"].startswith("rank 1 ended without a word (killed")
    assert "restart 1: resumed from step 4, 0 step(s) lost; attempt 0 failed: rank 1 ended without a word " \
           "(killed by a signal" in r.stdout + r.stderr
    assert steps_of(killed) == list(range(1, 7))
    assert final_state(killed, 6) == final_state(whole, 6)
    assert json.load(open(os.path.join(killed, "summary.json")))["restarts"] == 1

    # without restarts the same fault ends the job, naming the rank that died
    r = zerotrain_here(capfd, "train", *args, "--out", str(tmp_path / "norestart"), faults="kill@step=5,rank=1")
    assert r.returncode == 1
    assert last_line(r).startswith("zerotrain: FAILED: rank 1 was killed by signal SIGKILL (a SIGKILL that nobody "
                                   "sent comes from the kernel's out-of-memory killer: this run asks each rank for "
                                   "about ")


def test_a_crash_inside_a_save_leaves_the_previous_checkpoint_and_latest_intact_and_async_saves_match_sync_bitwise(
        tmp_path, capfd, uninterrupted):
    """Rank 1 dies halfway through writing checkpoint 4, with sync and with async saves: checkpoint 2 and `latest`
    stay, and `--resume auto` ends the run with the uninterrupted run's checkpoints 2, 4 and 6. The uninterrupted run
    saved synchronously: in async mode every checkpoint of the drill was written by the async writer, so it writes
    bitwise what a sync save writes."""
    modes = {"sync": [], "async": ["--async-save"]}
    for mode, extra in modes.items():
        out = str(tmp_path / mode)
        r = zerotrain_here(capfd, "train", *TINY, *SIX_STEPS, "--out", out, *extra,
                           faults="crash_in_save@step=4,rank=1")
        assert r.returncode == 1, mode
        assert last_line(r) == "zerotrain: FAILED: rank 1 failed with exit code 75 (see its output above)", mode
        root = os.path.join(out, "checkpoints")
        assert checkpoint.committed_steps(root) == ["step_00000002"], mode
        assert checkpoint.resolve_resume("auto", root).endswith("step_00000002"), mode
        checkpoint.verify_or_raise(os.path.join(root, "step_00000002"))
    train_in_turn(*([*TINY, *SIX_STEPS, "--out", str(tmp_path / mode), *extra, "--resume", "auto"]
                    for mode, extra in modes.items()))
    for mode in modes:
        out = str(tmp_path / mode)
        assert steps_of(out) == list(range(1, 7)), mode
        saved = {s: final_state(out, s) for s in (2, 4, 6)}
        assert saved == {s: final_state(uninterrupted, s) for s in (2, 4, 6)}, mode
        assert len(set(str(v) for v in saved.values())) == 3  # each step's files differ from the others


def test_resume_auto_falls_back_past_a_corrupt_newest_checkpoint_naming_the_bad_file(tmp_path, capfd, uninterrupted):
    out = str(tmp_path / "R")
    shutil.copytree(uninterrupted, out)  # checkpoints at steps 2, 4 and 6
    shard = os.path.join(out, "checkpoints", "step_00000006", checkpoint.shard_name(1, 2))
    with open(shard, "r+b") as f:  # the planted fault: one flipped byte
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = zerotrain_here(capfd, "verify", shard.rsplit(os.sep, 1)[0])
    assert r.returncode == 1 and checkpoint.shard_name(1, 2) in r.stdout.strip().splitlines()[-1]
    r = zerotrain_here(capfd, "train", *TINY, *SIX_STEPS, "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "step_00000006 fails verification" in r.stderr and checkpoint.shard_name(1, 2) in r.stderr
    assert "falling back to step_00000004" in r.stderr
    assert steps_of(out) == list(range(1, 7))
    assert final_state(out, 6) == final_state(uninterrupted, 6)  # steps 5 and 6 trained again, as they were


def test_a_hung_rank_fails_the_job_within_the_timeout_naming_step_and_collective(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_FAULTS", "hang@step=3,rank=1")
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=6, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(JobFailed, match=r"rank 0: collective \w+ at step 3 timed out after 5 s"):
        run_job(dist_jobs.params_job, cfg, time_limit=120)
    assert time.monotonic() - t0 < 5 + 25  # start-up, the timeout, the group's shutdown
    assert child_pids() == []


# What ProcessGroupNCCL raises at a rank's wait (TORCH_NCCL_BLOCKING_WAIT=1 set by the user, or a collective called
# after NCCL's watchdog aborted the communicator; TORCH_NCCL_ASYNC_ERROR_HANDLING=2), as
# torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp builds them: a DistBackendError with the watchdog's message.
NCCL_ERRORS = {
    "timeout": ("[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=6, NumelOut=6, Timeout(ms)=5000) ran for 5004 "
                "milliseconds before timing out.",
                "collective step_flags at step 3 timed out after 5 s: another rank stopped answering (hung, or slower "
                "than --timeout allows)", False),
    "peer": ("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, remote process exited or there was a "
             "network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a "
             "remote process exiting prematurely.",
             "collective step_flags at step 3 failed: another rank is gone (NCCL error in: ../torch/csrc/distributed/"
             "c10d/NCCLUtils.cpp:77, remote process exited or there was a network error, NCCL version 2.27.3)", True),
    "peer, said later": ("NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled system error "
                         "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclSystemError: System call "
                         "(e.g. socket, malloc) or external library call failed or device error.\nLast error:\n"
                         "socket recv: Connection closed by remote peer",
                         "collective step_flags at step 3 failed: another rank is gone (NCCL error in: ../torch/csrc/"
                         "distributed/c10d/NCCLUtils.cpp:77, unhandled system error (run with NCCL_DEBUG=INFO for "
                         "details), NCCL version 2.27.3)", True),
    "local": ("[PG ID 0 PG GUID 0(default_pg) Rank 0] NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
              "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3",
              "collective step_flags at step 3 failed on this rank (NCCL error in: ../torch/csrc/distributed/c10d/"
              "NCCLUtils.cpp:77, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3)",
              False),
    "gloo timeout": ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv "
                     "operation to complete", "collective step_flags at step 3 timed out after 5 s: another rank "
                                              "stopped answering (hung, or slower than --timeout allows)", False),
}


@pytest.mark.parametrize("case", list(NCCL_ERRORS))
def test_an_nccl_watchdog_error_reaches_the_one_line_report_that_a_gloo_error_does(case, tmp_path, monkeypatch):
    import types

    import torch.distributed as dist

    from zerotrain.parallel.comm import CollectiveError, Comm
    from zerotrain.runtime import failures
    from zerotrain.runtime.launch import process_group_environment

    # NCCL ranks are not killed by NCCL's watchdog (its errors reach the rank's wait where the user sets
    # TORCH_NCCL_BLOCKING_WAIT=1; zerotrain waits no collective on the CPU: test_collective_watchdog.py); the agent's
    # error handling (1: kill the process) never stays
    assert process_group_environment("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
                                     ) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert process_group_environment("gloo") == {}
    raised, line, peer_lost = NCCL_ERRORS[case]
    comm = types.SimpleNamespace(step=3, timeout_s=5.0, timeout_flag="--timeout")
    with pytest.raises(CollectiveError) as caught:
        with Comm._guard(comm, "step_flags"):
            raise dist.DistBackendError(raised)
    assert str(caught.value) == line and caught.value.peer_lost == peer_lost
    # ... and the rank's report, the launcher's one line, as for gloo: explained unless the peer was lost
    monkeypatch.setattr(failures, "_write_traceback", lambda rank, cfg: None)
    failures.report_failure(caught.value, 0, tiny_config(tmp_path), str(tmp_path))
    [report] = failures._reports(str(tmp_path))
    assert report["message"] == f"rank 0: {line}" and report["kind"] == ("lost a peer" if peer_lost else "explained")


def test_nan_rolls_back_durably_and_a_crash_before_the_next_save_restarts_on_the_rolled_back_timeline_bitwise(
        tmp_path, capfd, monkeypatch):
    """A NaN at step 5 rolls back to checkpoint 4 (its async save in flight as the anomaly comes) and the run
    completes; the rollback saved step 4 again with the new skips and the rollback count before training went on.
    The same run with rank 1 killed at step 6, before the next save, restarts from that re-save and ends bitwise
    like it, skips and count carried; planted: the decision not made durable (no re-save, in the ranks of both
    attempts), the restart resumes the old checkpoint 4 and trains on the data the rollback skipped."""
    args = [*TINY, "--steps", "8", "--ckpt-every", "2", "--async-save"]
    out = str(tmp_path / "nan")
    r = zerotrain_here(capfd, "train", *args, "--out", out, faults="nan@step=5,rank=1")
    assert r.returncode == 0, r.stderr
    (rollback,) = events(out, "rollback")
    # to step 4: the async save of step 4 was committed before the rollback chose
    assert rollback["step"] == 5 and rollback["to_step"] == 4 and rollback["skipped_data_steps"] == [5, 5]
    assert "non-finite loss on rank(s) [1]" in rollback["reason"] and "rollback 1/3" in r.stderr
    assert steps_of(out)[-1] == 8 and json.load(open(os.path.join(out, "summary.json")))["rollbacks"] == 1
    root = os.path.join(out, "checkpoints")
    assert checkpoint.committed_steps(root)[-1] == "step_00000008"
    for step in (4, 8):  # the re-save of the restored step 4, and the last step
        checkpoint.verify_or_raise(os.path.join(root, checkpoint.step_name(step)))
        manifest = checkpoint.read_manifest(os.path.join(root, checkpoint.step_name(step)))
        assert manifest["data_skips"] == [[4, 1]], step  # step 5's batch is never trained on again
        assert manifest["rollback"]["rollbacks"] == 1, step

    def restarted(out, job=None):
        """The same run with rank 1 killed at step 6 and one restart: through the command, or `job` in the ranks."""
        argv = [*args, "--out", out, "--max-restarts", "1"]
        faults = "nan@step=5,rank=1;kill@step=6,rank=1"
        if job is None:
            r = zerotrain_here(capfd, "train", *argv, faults=faults)
            assert r.returncode == 0, r.stderr
            return
        monkeypatch.setenv("ZEROTRAIN_FAULTS", faults)
        try:
            run_job(job, prepare_run(config_from_args(build_parser().parse_args(["train", *argv]))), time_limit=240)
        finally:
            release_run_folders()
            monkeypatch.delenv("ZEROTRAIN_FAULTS")

    killed, planted = str(tmp_path / "killed"), str(tmp_path / "planted")
    restarted(killed)
    (restart,) = events(killed, "restart")
    assert restart["step"] == 4 and len(events(killed, "rollback")) == 1 and steps_of(killed) == list(range(1, 9))
    assert final_state(killed, 8) == final_state(out, 8)
    manifest = checkpoint.read_manifest(os.path.join(killed, "checkpoints", "step_00000008"))
    assert manifest["data_skips"] == [[4, 1]] and manifest["rollback"]["rollbacks"] == 1
    restarted(planted, dist_jobs.undurable_rollback_job)
    assert events(planted, "restart")[0]["step"] == 4 and len(events(planted, "rollback")) == 1
    manifest = checkpoint.read_manifest(os.path.join(planted, "checkpoints", "step_00000008"))
    assert manifest["data_skips"] == [] and manifest["rollback"]["rollbacks"] == 0  # skips and count lost
    assert final_state(planted, 8) != final_state(out, 8)
    # the planted fault without the guard's rollback: the run stops before the bad update
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "8", "--ckpt-every", "2", "--out", str(tmp_path / "abort"),
                       "--on-anomaly", "abort", faults="nan@step=5,rank=1")
    assert r.returncode == 1 and "invariant (a) failed: non-finite loss on rank(s) [1] at step 5" in last_line(r)


def test_an_lr_spike_rolls_back_past_the_damaged_checkpoint_and_metrics_keep_one_record_per_step_across_a_restart(
        tmp_path, capfd):
    """A real instability: checkpoints every step, so the newest holds the damage and the guard goes back further,
    past logged steps; then a rank is killed and the group restarts from an earlier checkpoint: the file holds one
    record per step, and the summary counts the first attempt's rollbacks."""
    out = str(tmp_path / "both")
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "10", "--ckpt-every", "1", "--lr", "1e-2", "--spike-factor",
                       "1.05", "--max-restarts", "1", "--out", out,
                       faults="lr_spike@step=5,factor=1e4;kill@step=9,rank=1")
    assert r.returncode == 0, r.stderr
    assert steps_of(out) == list(range(1, 11))  # one record per step: the abandoned steps' records went
    rollbacks, restarts = events(out, "rollback"), events(out, "restart")
    assert [e["to_step"] for e in rollbacks] == [5, 4]  # came back right after restoring step 5
    assert len(restarts) == 1 and r.stderr.count("zerotrain: rollback ") == len(rollbacks)
    assert json.load(open(os.path.join(out, "summary.json")))["rollbacks"] == len(rollbacks)
    losses = {rec["step"]: rec["loss"] for rec in records(out) if "event" not in rec}
    # restored to an undamaged model, it learns on: below the loss of the step it was restored to (a ruined
    # model sits near ln V = 4.16 here, above every loss of the timeline that trained)
    assert losses[10] < losses[rollbacks[-1]["to_step"]]


def test_a_rewind_drops_the_abandoned_records_and_a_resume_keeps_every_event(tmp_path, monkeypatch):
    """The metrics file through the Metrics the loop uses; planted: a rewind that keeps the abandoned records, and a
    resume truncation that drops events past the resumed step (as it did), each caught."""
    from zerotrain.training import metrics as metrics_module
    from zerotrain.training.metrics import Metrics, count_events

    def timeline(path):
        m = Metrics(path, active=True, progress=False, start=0, total=8)
        for step in range(1, 7):
            m.log({"step": step, "loss": 1.0, "tokens_per_s": 1.0})
        m.rewind(4)
        m.event({"event": "rollback", "step": 7, "to_step": 4})
        for step in range(5, 9):
            m.log({"step": step, "loss": 0.5, "tokens_per_s": 1.0})
        m.close()
        Metrics(path, active=True, progress=False, start=6, total=8).close()  # a restart resuming at step 6
        return [json.loads(line) for line in open(path)]

    kept = timeline(str(tmp_path / "good.jsonl"))
    assert [r["step"] for r in kept if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert count_events(str(tmp_path / "good.jsonl"), "rollback") == 1
    monkeypatch.setattr(Metrics, "rewind", lambda self, step: None)
    steps = [r["step"] for r in timeline(str(tmp_path / "norewind.jsonl")) if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6]
    monkeypatch.undo()
    real = metrics_module._truncate_after

    def drops_events(path, step):  # the old rule: keep only what is at or before the resumed step
        if os.path.isfile(path):
            lines = [line for line in open(path) if line.strip() and json.loads(line).get("step", 0) <= step]
            open(path, "w").writelines(lines)
        return real(path, step)

    monkeypatch.setattr(metrics_module, "_truncate_after", drops_events)
    timeline(str(tmp_path / "dropped.jsonl"))
    assert count_events(str(tmp_path / "dropped.jsonl"), "rollback") == 0


def test_wall_clock_cadence_saves_when_rank_0s_clock_says_so(tmp_path):
    often, rarely = str(tmp_path / "often"), str(tmp_path / "rarely")
    # rank 0's clock is heard at the log steps: --log-every 1 makes every step one
    train_in_turn([*TINY, "--steps", "4", "--ckpt-every-minutes", "1e-9", "--log-every", "1", "--out", often],
                  [*TINY, "--steps", "4", "--ckpt-every-minutes", "60", "--out", rarely])
    assert checkpoint.committed_steps(os.path.join(often, "checkpoints")) == [checkpoint.step_name(s) for s in (1, 2, 3, 4)]
    assert checkpoint.committed_steps(os.path.join(rarely, "checkpoints")) == ["step_00000004"]  # the last step only


def test_an_exception_in_a_rank_is_one_line_naming_the_rank_and_its_logged_traceback(tmp_path):
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=2)
    with pytest.raises(JobFailed) as failed:
        run_job(dist_jobs.raising_job, cfg, time_limit=120)
    log = os.path.join(cfg.logging.out, "logs", "rank00001.log")
    assert str(failed.value) == f"rank 1: ValueError: a bug in rank 1 (traceback in {log})"
    assert "Traceback" in open(log).read() and "raising_job" in open(log).read()
    assert child_pids() == []


def test_thirty_steps_on_the_embedded_corpus_lower_train_and_val_loss_and_eval_agrees(tmp_path, capfd):
    out = str(tmp_path / "stdlib")
    r = zerotrain_here(capfd, "train", "--nproc", "2", "--micro-batch", "4", "--steps", "30", "--lr", "1e-2",
                       "--eval-every", "10", "--ckpt-every", "30", "--no-progress", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "data --data python-stdlib" in r.stdout and "GPT-2 34,176 parameters" in r.stdout  # the start line
    steps = [rec for rec in records(out) if "event" not in rec]
    val = [rec["val_loss"] for rec in steps if "val_loss" in rec]
    assert [rec["step"] for rec in steps if "val_loss" in rec] == [10, 20, 30]
    assert val[-1] < val[0] - 0.1 and steps[-1]["loss"] < steps[0]["loss"] - 0.5
    # `zerotrain eval` on the final checkpoint computes the same validation batches
    r = zerotrain_here(capfd, "eval", os.path.join(out, "checkpoints", "step_00000030"), "--batches", "8",
                       "--batch-size", "8")
    assert r.returncode == 0 and f"val_loss {val[-1]:.6f}" in r.stdout


def _group_alive(pgid: int) -> list[int]:
    """Live processes of a process group (a launcher started in a session of its own, and its ranks)."""
    return [pid for pid, _, group in live_processes() if group == pgid]


def test_a_signal_before_the_first_step_ends_the_job_at_once_with_nothing_to_save(tmp_path):
    """Rank 0 hangs while it starts (hang@step=0): a SIGTERM then cannot be answered by a save, so the launcher
    stops every rank at once, says so in one line and exits 128 + 15, leaving no rank behind."""
    env = dict(os.environ, ZEROTRAIN_FAULTS="hang@step=0")
    out = str(tmp_path / "early")
    job = subprocess.Popen([sys.executable, "-m", "zerotrain", "train", *TINY, "--steps", "4", "--ckpt-every", "1",
                            "--out", out], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                           start_new_session=True)
    try:
        for line in job.stderr:  # the rank says what it does before it hangs
            if "hang before the first step on rank 0" in line:
                break
        job.send_signal(signal.SIGTERM)
        rest = job.communicate(timeout=60)[1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM
    assert rest.strip().splitlines()[-1] == "zerotrain: stopped by SIGTERM before the first step: nothing to save"
    assert not checkpoint.committed_steps(os.path.join(out, "checkpoints"))
    deadline = time.monotonic() + 30  # killed ranks take a moment to be reaped once their launcher is gone
    while _group_alive(job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_alive(job.pid) == []


def test_the_launcher_hard_stops_only_while_a_rank_is_still_starting(tmp_path):
    """The first signal is a hard stop while a rank has not begun stepping, and the save-and-stop request once
    every rank has; planted: a launcher that ignores the ranks' stepping files asks starting ranks to save."""
    from zerotrain.runtime.supervise import LauncherSignals

    stepping = [str(tmp_path / f"stepping-rank{r}") for r in range(2)]
    open(stepping[0], "w").close()  # rank 1 still starts
    early = LauncherSignals(str(tmp_path / "stop"), stepping)
    early._on_signal(signal.SIGTERM, None)
    assert early.hard_stop == "SIGTERM" and early.before_first_step and not os.path.exists(tmp_path / "stop")
    planted = LauncherSignals(str(tmp_path / "stop"), [])  # planted: no rank's start-up is known
    planted._on_signal(signal.SIGTERM, None)
    assert planted.hard_stop is None and os.path.exists(tmp_path / "stop")  # it would wait for a save
    os.remove(tmp_path / "stop")
    open(stepping[1], "w").close()  # now every rank steps
    late = LauncherSignals(str(tmp_path / "stop"), stepping)
    late._on_signal(signal.SIGTERM, None)
    assert late.hard_stop is None and open(tmp_path / "stop").read() == "SIGTERM"


def test_a_rank_signalled_before_its_first_step_exits_at_once_and_after_it_finishes_the_step():
    code = ("import os, signal, sys\n"
            "from zerotrain.runtime.stop import install_stop_request\n"
            "stop = install_stop_request(None)\n"
            "if sys.argv[1] == 'stepping':\n"
            "    stop.begin_stepping()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('requested', stop.requested, flush=True)\n")
    early = subprocess.run([sys.executable, "-c", code, "starting"], capture_output=True, text=True, timeout=60)
    assert early.returncode == 128 + signal.SIGTERM and early.stdout == ""
    late = subprocess.run([sys.executable, "-c", code, "stepping"], capture_output=True, text=True, timeout=60)
    assert late.returncode == 0 and late.stdout == "requested True\n"


def sleeping_job(cfg, comm):
    """Every rank blocks: only being stopped ends it."""
    while True:
        time.sleep(3600)


@pytest.mark.parametrize("planted", [False, True], ids=["ranks-only", "planted-every-descendant"])
def test_stopping_a_job_ends_its_ranks_and_spares_the_callers_other_children(tmp_path, monkeypatch, planted):
    """run_job used as a library, by a process with a child of its own: the wall-clock limit stops the job's
    ranks and leaves the sibling alone; planted: the old rule, every descendant, kills the sibling too."""
    from zerotrain.runtime import launch as launch_module
    from zerotrain.runtime import supervise

    if planted:
        real = supervise.stop_descendants
        monkeypatch.setattr(supervise, "stop_descendants", lambda agent, spare: real(agent, spare=set()))
        monkeypatch.setattr(launch_module, "stop_descendants", supervise.stop_descendants)
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(JobFailed, match="wall-clock limit of 3 s"):
            run_job(sleeping_job, tiny_config(tmp_path, nproc=2), time_limit=3)
        assert child_pids() == ([] if planted else [sibling.pid])  # the ranks are gone either way
    finally:
        sibling.kill()
        sibling.wait(timeout=30)


def test_the_resume_warning_says_what_changes_steps_change_the_schedule_only_a_new_global_batch_the_data():
    from zerotrain.training.loop import _schedule_change

    steps_only = _schedule_change((200, 16), (300, 16))
    assert "--steps 300 instead of 200" in steps_only and "learning-rate schedule" in steps_only
    assert "data" not in steps_only  # the batch of step s is sequences 0..15 of step s either way
    batch = _schedule_change((200, 16), (200, 32))
    assert "global batch of 32 sequences instead of 16 changes each step's data" in batch and "--steps" not in batch


def test_a_run_that_ends_normally_commits_a_final_checkpoint_unless_told_not_to(tmp_path, capfd, monkeypatch):
    """A fine-tune without --ckpt-every keeps its model (TRL and axolotl save at the end too); --no-final-save keeps
    none. Both on one start of the ranks; the first one's model exports. The launch leaves nothing in the temporary
    folder (the elastic agent's torchelastic_* folder went there, one per launch, never removed)."""
    kept, none = str(tmp_path / "kept"), str(tmp_path / "none")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    train_in_turn([*TINY, "--steps", "3", "--out", kept], [*TINY, "--steps", "3", "--out", none, "--no-final-save"])
    assert [n for n in os.listdir(temp) if not n.startswith("pymp-")] == []  # multiprocessing's goes at exit
    err = "".join(capfd.readouterr())
    assert "a checkpoint at the end only (--ckpt-every K or --ckpt-every-minutes M to save during the run)" in err
    assert "no checkpoints will be saved (--no-final-save)" in err
    assert steps_of(kept) == steps_of(none) == [1, 2, 3]
    assert checkpoint.resolve_resume("auto", os.path.join(kept, "checkpoints")).endswith("step_00000003")
    assert [n for n in os.listdir(os.path.join(none, "checkpoints")) if n.startswith("step_")] == []
    r = zerotrain_here(capfd, "export", kept, str(tmp_path / "exported"), "--format", "hf")
    assert r.returncode == 0, r.stderr
    r = zerotrain_here(capfd, "export", none, str(tmp_path / "nothing"), "--format", "hf")
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr, r.stderr


def test_a_runs_paths_travel_eval_from_another_folder_reads_the_data_the_run_named_relatively(tmp_path, capfd,
                                                                                               monkeypatch):
    """--data (and every input path) is stored resolved: `zerotrain eval RUN` from another folder finds the data the
    run named relative to where it started. A data name (synthetic) stays a name."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    (work / "notes").mkdir()
    for i in range(40):  # documents enough for a validation share
        (work / "notes" / f"{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog. " * 20)
    monkeypatch.chdir(work)
    r = zerotrain_here(capfd, "train", "--nproc", "1", "--preset", "tiny", "--data", "notes", "--steps", "2",
                       "--no-progress", "--out", "run")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((work / "run" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert manifest["config"]["data"]["data"] == str(work / "notes")
    monkeypatch.chdir(elsewhere)
    r = zerotrain_here(capfd, "eval", str(work / "run"), "--batches", "1")
    assert r.returncode == 0 and "loss" in r.stdout, r.stdout + r.stderr
    from zerotrain.config import Config
    from zerotrain.runtime.run_folder import resolve_paths
    cfg = Config()
    cfg.data.source, cfg.logging.out = "synthetic\nnotes.txt:2", str(tmp_path / "r")
    (elsewhere / "notes.txt").write_text("x")
    assert resolve_paths(cfg).data.source == f"synthetic\n{elsewhere / 'notes.txt'}:2"
