"""A stop signal inside a step longer than the launcher's grace period: the save of the last completed step starts at
once, beside the step, and is committed before the step ends.

torchrun kills its ranks 30 s after SIGTERM, and one step can take longer (bf16 GPT-2 on a CPU: 124-162 s). The drill
makes a step slow deterministically: sigterm_in_slow_step signals the launcher in step 3's second forward and blocks
that forward until `latest` names step_00000002, failing the rank if it never does. The order is asserted by the
fault's own wait, not by time.
"""

import os
import subprocess
import sys

import dist_jobs
import pytest
from conftest import zerotrain_here
from forked_child import run_forked
from test_production import TINY, final_state, steps_of, events, train_in_turn

from zerotrain import checkpoint
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.runtime.launch import JobFailed, run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders

pytestmark = pytest.mark.timeout(300)

# --accum 2: the fault fires in the step's second forward. --log-every 1: every step reads the device, so a stop
# takes effect in the step it came in (between log steps it waits for the next one: test_production's
# test_a_stop_between_log_steps_*)
ARGS = [*TINY, "--steps", "6", "--ckpt-every", "4", "--log-every", "1"]
SLOW_STEP = "sigterm_in_slow_step@step=3,rank=1"


def test_a_stop_in_a_slow_step_commits_the_last_completed_step_before_the_step_ends_and_resumes_bitwise(
        tmp_path, capfd, monkeypatch):
    """The stopped run commits step 2 while step 3 is blocked in its second forward, exits 0 as a stop, never applies
    step 3, and resumed it ends bitwise like a run never stopped. Planted: the save started only once every rank has
    agreed to stop (as before: after the step's all-reduce), so the slow step never sees a commit and the rank fails
    after the fault's bound."""
    stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
    r = zerotrain_here(capfd, "train", *ARGS, "--out", stopped, faults=SLOW_STEP)  # SIGTERM to the launcher: this process
    assert r.returncode == 0, r.stderr
    assert "zerotrain: ZEROTRAIN_FAULTS: step_00000002 committed while step 3 was in its forward 2" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        "zerotrain: stopped by SIGTERM at step 2; saved step_00000002; continue with --resume auto"
    assert steps_of(stopped) == [1, 2]  # step 3 is not applied: the resume redoes it
    assert events(stopped, "stop") == [{"event": "stop", "step": 2, "signal": "SIGTERM"}]
    root = os.path.join(stopped, "checkpoints")
    assert checkpoint.committed_steps(root) == ["step_00000002"]
    checkpoint.verify_or_raise(os.path.join(root, "step_00000002"))

    # the resume, the run never stopped, and what the comparison catches: the resume with a learning rate 1e-7 off
    nudged = str(tmp_path / "nudged")
    resumed, _, _ = train_in_turn([*ARGS, "--out", stopped, "--resume", "auto"], [*ARGS, "--out", whole],
                                  [*ARGS, "--out", nudged, "--resume", os.path.join(root, "step_00000002"),
                                   "--lr", "0.0030000003"])
    assert resumed["start_step"] == 2 and steps_of(stopped) == list(range(1, 7))
    assert final_state(stopped, 6) == final_state(whole, 6)
    assert final_state(nudged, 6) != final_state(whole, 6)

    planted = str(tmp_path / "planted")
    monkeypatch.setenv("ZEROTRAIN_FAULTS", SLOW_STEP + ",factor=2")  # the bound it fails after: never a commit
    try:
        with pytest.raises(JobFailed) as failed:
            run_job(dist_jobs.stop_saved_after_the_step_job,
                    prepare_run(config_from_args(build_parser().parse_args(["train", *ARGS, "--out", planted]))),
                    time_limit=240)
    finally:
        release_run_folders()
    assert ("sigterm_in_slow_step (up to 2 s) at step 3 on rank 1: step 3 was still in its forward 2 s after the stop, "
            "and no step_00000002 was committed") in str(failed.value)


def test_under_torchrun_a_stop_in_a_slow_step_is_committed_before_the_step_ends(tmp_path):
    """torchrun's agent passes the SIGTERM it received on to every rank, and kills them 30 s later: the commit of step 2
    comes while step 3 is still blocked in its forward, and the ranks exit as a stop (torchrun reports the signal with
    its own exit code)."""
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                        "zerotrain", "train", *ARGS[2:], "--out", out], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "ZEROTRAIN_FAULTS": SLOW_STEP})
    assert "zerotrain: ZEROTRAIN_FAULTS: step_00000002 committed while step 3 was in its forward 2" in r.stderr, \
        r.stderr[-3000:]
    assert "zerotrain: stopped by SIGTERM at step 2; saved step_00000002" in r.stdout, r.stdout[-2000:]
    assert checkpoint.committed_steps(os.path.join(out, "checkpoints")) == ["step_00000002"]
    assert steps_of(out) == [1, 2]


# A rank whose training thread waits inside a collective (here torch's own C++ wait on a future, which a signal does
# not end, as gloo's and NCCL's do not) when the stop comes. The order is made certain without a sleep: the switch
# interval is so long that the main thread keeps the GIL until its wait releases it, and only then can the thread that
# sends the signal run. The main thread's handler cannot run until the wait ends, and only the watcher ends it
# (a bounded fallback ends it otherwise, and says so).
BLOCKED_IN_A_WAIT = """
import os, signal, sys, threading, time
import torch
from zerotrain.runtime import stop as stop_module
from zerotrain.runtime.stop import StopWatch, install_stop_request

if sys.argv[1] == "planted":  # the watcher as it was: it polls `requested`, which only the main thread's handler sets
    stop_module.StopRequest.wait = lambda self, timeout_s: (time.sleep(timeout_s), self.requested)[1]
stop = install_stop_request(None)
stop.begin_stepping()
released, lock, go = torch.futures.Future(), threading.Lock(), threading.Event()

def release(by):
    with lock:
        if not released.done():
            released.set_result(by)

def signal_then_wait():
    go.wait()  # runs once the main thread has released the GIL: inside released.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)
    release("the fallback, 2 s later")

watch = StopWatch(stop, lambda: release("the watcher"))
sender = threading.Thread(target=signal_then_wait, daemon=True)
sender.start()
sys.setswitchinterval(1000.0)
go.set()
by = released.wait()
sys.setswitchinterval(0.005)
print(f"released by {by}; stop requested: {stop.requested}", flush=True)
watch.close()
"""


@pytest.mark.parametrize("planted", [False, True], ids=["wakeup-fd", "planted-polling-requested"])
def test_a_stop_reaches_the_watcher_while_the_training_thread_waits_inside_a_collective(planted):
    """The interleaving that hung the torchrun drill: torchrun's agent signals every rank itself, and rank 0's training
    thread was already waiting in step 3's reduce-scatter for rank 1, blocked in its forward until the commit. Python
    runs the SIGTERM handler on the main thread only between bytecodes, so the watcher, which polled the handler's
    flag, never started rank 0's save: nothing was committed until torchrun's SIGKILL. The watcher reads the wakeup fd
    the C handler writes, and starts the save at once. Planted: the watcher polling the flag, as before."""
    r = run_forked(BLOCKED_IN_A_WAIT, "planted" if planted else "fixed", timeout=60)
    assert r.returncode == 0, r.stderr
    expected = "the fallback, 2 s later" if planted else "the watcher"
    assert r.stdout == f"released by {expected}; stop requested: True\n", r.stdout + r.stderr


def test_ranks_whose_stop_saves_are_of_different_steps_are_refused_at_once_and_nothing_is_committed(
        tmp_path, monkeypatch):
    """The ranks agree on the saved step by construction (each saves the step it had armed, and its flag is in the
    next step's all-reduce once its save began); the stop's end checks it before any rank waits for another's files.
    Planted: rank 1 arms the step before the one it completed; the job fails naming each rank's step, at once (not
    after rank 0 waited --io-timeout for rank 1's files of step 2), and commits nothing."""
    run = str(tmp_path / "run")
    monkeypatch.setenv("ZEROTRAIN_FAULTS", "sigterm@step=2,rank=1")
    try:
        with pytest.raises(JobFailed) as failed:
            run_job(dist_jobs.stop_save_of_another_step_job,
                    prepare_run(config_from_args(build_parser().parse_args(["train", *ARGS, "--out", run]))),
                    time_limit=240)
    finally:
        release_run_folders()
    assert "a stop's save: the ranks saved different steps (rank 0: step 2, rank 1: step 1)" in str(failed.value)
    assert checkpoint.committed_steps(os.path.join(run, "checkpoints")) == []
