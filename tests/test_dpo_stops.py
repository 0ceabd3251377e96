"""DPO runs stopped where a stop used to lose work: a signal during the precomputed reference pass, and a crash while
a resume copies the reference beside this run's checkpoints.

Every fault is planned (ZEROTRAIN_FAULTS); each drill also runs the planted bug it catches, in the ranks
(stop_plants.py). One uninterrupted run of 4 steps on 2 ranks is what each drill's resumed run must equal, bitwise.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import stop_plants
from conftest import zerotrain_here
from model_folders import CHATML, llama_folder, write_jsonl
from test_dpo import PLAIN, SEQ
from test_production import final_state, in_own_session, steps_of

from zerotrain import checkpoint
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.runtime.launch import JobFailed, run_job
from zerotrain.runtime.run_folder import prepare_run, release_run_folders
from zerotrain.training.faults import CRASH_IN_SAVE_EXIT
from zerotrain.training.preference import REFERENCE_FILE

pytestmark = pytest.mark.timeout(600)
TESTS = os.path.dirname(os.path.abspath(__file__))


def plant(name: str) -> list[str]:
    """The launcher's lines that plant `name` (stop_plants.py) in every rank: the ranks' server imports it (it finds
    modules on its PYTHONPATH: the launcher's sys.path reaches the ranks, not the server)."""
    return ["import os", f"os.environ['ZEROTRAIN_TEST_PLANT'] = {name!r}",
            f"os.environ['PYTHONPATH'] = os.pathsep.join([{TESTS!r}, os.environ.get('PYTHONPATH', '')])",
            "import zerotrain.runtime.rank_start as r", "r.PRELOAD = [*r.PRELOAD, 'stop_plants']"]


@pytest.fixture(scope="module")
def dpo_args(tmp_path_factory) -> list[str]:
    """`zerotrain train --method dpo` on 2 ranks, 8 pairs a step (2 x accum 2 a rank): its reference pass scores 2
    micro-batches a rank. A constant learning rate, so that a run of 3 steps continued to 4 is the run of 4."""
    tmp = tmp_path_factory.mktemp("dpo-stops-data")
    llama_folder(tmp / "base", template=CHATML)
    return ["--method", "dpo", "--init-from", str(tmp / "base"), "--data", write_jsonl(tmp / "plain.jsonl", PLAIN),
            "--seq-len", str(SEQ), "--nproc", "2", "--micro-batch", "2", "--accum", "2", "--threads", "1",
            "--lr", "1e-2", "--warmup-steps", "0", "--min-lr-ratio", "1.0", "--peak-flops", "1e12", "--no-progress"]


@pytest.fixture(scope="module")
def dpo(dpo_args):
    """run(tmp_path, *args, faults=, planted=) runs dpo_args' training in a session of its own (a group signal reaches
    only the job; a plant, only its ranks); run(..., capfd=capfd) in this process, without a second interpreter to
    start, for a run that neither signals its group nor plants a bug."""
    def run(tmp_path, *more, faults="", planted=None, capfd=None):
        if capfd is not None:
            assert planted is None and not faults.startswith("group_")
            return zerotrain_here(capfd, "train", *dpo_args, *more, faults=faults or None)
        return in_own_session(tmp_path, "train", *dpo_args, *more, faults=faults,
                              python_first=plant(planted) if planted else ())

    return run


@pytest.fixture(scope="module")
def whole(dpo_args, tmp_path_factory) -> str:
    """4 steps, checkpoints at 2 and 4, never stopped."""
    tmp = tmp_path_factory.mktemp("dpo-whole")
    try:
        assert main(["train", *dpo_args, "--steps", "4", "--ckpt-every", "2", "--out", str(tmp / "whole")]) == 0
    finally:
        release_run_folders()
    return str(tmp / "whole")


def test_a_signal_during_the_reference_pass_finishes_it_saves_step_0_and_the_resumed_run_is_bitwise_identical(
        dpo, whole, tmp_path, capfd):
    """Ctrl-C to the group after rank 1's first forward of the reference pass (of 2): the ranks finish the pass and, as
    step 1 begins, save the last completed step, 0 (the first checkpoint, which keeps the pass: its manifest records
    the stored reference); step 1 is not applied, exit 0;
    the resumed run reads the reference back and ends bitwise identical to the run never stopped. Planted: the pass
    as part of the start-up, as it was: the signal ends every rank at once and the pass is lost."""
    stopped, faults = str(tmp_path / "stopped"), "group_sigint_in_reference@step=1,rank=1"
    r = dpo(tmp_path, "--steps", "4", "--ckpt-every", "2", "--out", stopped, faults=faults)
    assert r.returncode == 0 and r.left == [], r.stderr
    assert "group_sigint_in_reference after forward 1 of the reference pass on rank 1" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == \
        "zerotrain: stopped by SIGINT at step 0; saved step_00000000; continue with --resume auto"
    assert checkpoint.committed_steps(os.path.join(stopped, "checkpoints")) == ["step_00000000"]
    resumed = dpo(tmp_path, "--steps", "4", "--ckpt-every", "2", "--out", stopped, "--resume", "auto", capfd=capfd)
    assert resumed.returncode == 0, resumed.stderr
    assert steps_of(stopped) == [1, 2, 3, 4] and final_state(stopped, 4) == final_state(whole, 4)
    planted = dpo(tmp_path, "--steps", "4", "--ckpt-every", "2", "--out", str(tmp_path / "planted"), faults=faults,
                  planted="pass_in_the_start_up")
    assert planted.returncode != 0 and f"exit code {128 + signal.SIGINT}" in planted.stderr, planted.stderr
    assert not checkpoint.committed_steps(os.path.join(tmp_path, "planted", "checkpoints"))


def test_a_crash_while_a_resume_copies_the_reference_leaves_the_folders_own_whole_and_its_checkpoints_resume(
        dpo, dpo_args, whole, tmp_path, capfd, monkeypatch):
    """A run resumed from another folder's checkpoint copies the reference beside its own checkpoints, whose manifests
    record its sha256. Resumed again from there into the same folder, rank 0 crashes halfway through the copy
    (crash_in_reference): the folder's reference is the whole file it was, and the folder's checkpoint resumes to a
    run bitwise identical to the one never stopped. Planted: the copy written in place, as shutil.copyfile wrote it:
    half a file, and the folder's every checkpoint refused in one line."""
    step2 = os.path.join(whole, "checkpoints", checkpoint.step_name(2))
    ours = tmp_path / "ours"
    first = dpo(tmp_path, "--steps", "3", "--ckpt-every", "1", "--resume", step2, "--out", str(ours), capfd=capfd)
    assert first.returncode == 0, first.stderr
    reference = ours / "checkpoints" / REFERENCE_FILE
    kept = reference.read_bytes()
    shutil.copytree(ours, tmp_path / "planted")

    def crash(folder, planted=False):
        """The crash, then the resume; planted: the ranks' job writes the reference in place (stop_plants.py)."""
        argv = ["--steps", "3", "--resume", step2, "--out", str(folder)]
        if planted:
            monkeypatch.setenv("ZEROTRAIN_FAULTS", "crash_in_reference@step=0")
            try:
                with pytest.raises(JobFailed) as failed:
                    run_job(stop_plants.reference_written_in_place_job,
                            prepare_run(config_from_args(build_parser().parse_args(["train", *dpo_args, *argv]))),
                            time_limit=240)
            finally:
                release_run_folders()
                monkeypatch.delenv("ZEROTRAIN_FAULTS")
            error = str(failed.value)
        else:
            r = dpo(tmp_path, *argv, faults="crash_in_reference@step=0", capfd=capfd)
            assert r.returncode == 1, r.stderr
            error = r.stderr
        assert f"rank 0 failed with exit code {CRASH_IN_SAVE_EXIT}" in error, error
        return dpo(tmp_path, "--steps", "4", "--ckpt-every", "1", "--resume", "auto", "--out", str(folder),
                   capfd=capfd)

    resumed = crash(ours)
    assert reference.read_bytes() == kept
    assert resumed.returncode == 0, resumed.stderr
    assert final_state(str(ours), 4) == final_state(whole, 4)
    refused = crash(tmp_path / "planted", planted=True)
    assert (tmp_path / "planted" / "checkpoints" / REFERENCE_FILE).stat().st_size == len(kept) // 2
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "is not the" in refused.stderr and "the checkpoint's manifest records" in refused.stderr
