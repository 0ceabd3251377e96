"""A stop between log steps takes effect at the next one (--log-every N): the flags that carry it are read there with
the step's other values, so no rank reads the device in the steps between; every rank saves the step before the log
step (the steps since the last read judged first), and the run resumed from it ends bitwise like one never stopped."""

import os

import host_reads_jobs
import pytest
from conftest import zerotrain_here
from test_production import TINY, events, final_state, steps_of, train_in_turn

from zerotrain import checkpoint
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders

pytestmark = pytest.mark.timeout(400)

ARGS = [*TINY, "--steps", "12", "--log-every", "5"]
STOP = "sigterm@step=2,rank=1"  # after step 2's update: between the log steps 0 and 5


def test_a_stop_between_log_steps_saves_the_step_before_the_next_log_step_and_resumes_bitwise(tmp_path, capfd,
                                                                                              monkeypatch):
    stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
    r = zerotrain_here(capfd, "train", *ARGS, "--out", stopped, faults=STOP)  # SIGTERM to the launcher: this process
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        "zerotrain: stopped by SIGTERM at step 4; saved step_00000004; continue with --resume auto"
    assert steps_of(stopped) == [1, 2, 3, 4]  # the log step 5 is not applied: the resume redoes it
    assert events(stopped, "stop") == [{"event": "stop", "step": 4, "signal": "SIGTERM"}]
    root = os.path.join(stopped, "checkpoints")
    assert checkpoint.committed_steps(root) == ["step_00000004"]
    resumed, _ = train_in_turn([*ARGS, "--out", stopped, "--resume", "auto"], [*ARGS, "--out", whole])
    assert resumed["start_step"] == 4 and steps_of(stopped) == list(range(1, 13))
    assert final_state(stopped, 12) == final_state(whole, 12)

    # planted: ranks that read the device at the last step only: the stop lands there, not at the next log step
    planted = str(tmp_path / "planted")
    monkeypatch.setenv("ZEROTRAIN_FAULTS", STOP)
    try:
        run_job(host_reads_jobs.reads_only_at_the_end_job,
                prepare_run(config_from_args(build_parser().parse_args(["train", *ARGS, "--out", planted]))),
                time_limit=240)
    finally:
        release_run_folders()
    assert events(planted, "stop")[0]["step"] != 4
