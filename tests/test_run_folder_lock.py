"""A live run holds its folder: a second run into it is refused in one line naming the holder, and nothing is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import tiny_config, zerotrain_here
from test_production import TINY, checkpoint_files, last_line

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.runtime import run_folder
from zerotrain.runtime.run_folder import prepare_run, release_run_folders

pytestmark = pytest.mark.timeout(300)


def start_hung_run(out: str, *extra: str) -> subprocess.Popen:
    """A real run that commits checkpoints 2 and 4, then hangs before step 6's collectives (ZEROTRAIN_FAULTS),
    holding its folders."""
    env = dict(os.environ, ZEROTRAIN_FAULTS="hang@step=6")
    return subprocess.Popen([sys.executable, "-m", "zerotrain", "train", *TINY, "--steps", "8", "--ckpt-every", "2",
                             "--out", out, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_until_hung(run: subprocess.Popen) -> None:
    """Read the run's stderr until its rank 0 says it hangs at step 6: step 4's checkpoint is committed by then."""
    for line in run.stderr:
        if "hang at step 6 on rank 0" in line:
            return
    raise AssertionError(f"the run ended (exit code {run.wait(timeout=60)}) before it hung at step 6")


def test_a_second_run_into_any_folder_of_a_live_run_is_refused_naming_it_and_the_first_runs_files_stay(
        tmp_path, capfd, monkeypatch):
    """A live run holds --out, --ckpt-dir and the --metrics folder: a second run into any of them, fresh (the most
    destructive) or --resume auto, is refused in one line; planted: a lock that covers --out only lets a run with
    another --out into the live run's checkpoints."""
    out, ckpt, metrics = str(tmp_path / "same"), str(tmp_path / "shared-ckpt"), str(tmp_path / "shared-metrics")
    live = start_hung_run(out, "--ckpt-dir", ckpt, "--metrics", os.path.join(metrics, "m.jsonl"))
    try:
        wait_until_hung(live)
        before = {step: checkpoint_files(os.path.join(ckpt, f"step_{step:08d}")) for step in (2, 4)}
        assert all(before.values())
        second = ["train", *TINY, "--steps", "4", "--ckpt-every", "2"]
        refusals = [(["--out", out, "--overwrite", "--seed", "7"], f"--out {out}"),
                    (["--out", out, "--resume", "auto"], f"--out {out}"),
                    (["--out", str(tmp_path / "b"), "--ckpt-dir", ckpt, "--seed", "7"], f"--ckpt-dir {ckpt}"),
                    (["--out", str(tmp_path / "c"), "--metrics", os.path.join(metrics, "other.jsonl")],
                     f"--metrics folder {metrics}")]
        for extra, held in refusals:
            r = zerotrain_here(capfd, *second, *extra)
            assert r.returncode == 2, r.stderr
            assert last_line(r).startswith(f"zerotrain: error: {held} is in use by another run (pid {live.pid} on ")
            assert "Traceback" not in r.stderr
        assert not os.path.exists(tmp_path / "b" / "checkpoints") and not os.path.exists(tmp_path / "c")
        assert {step: checkpoint_files(os.path.join(ckpt, f"step_{step:08d}")) for step in (2, 4)} == before

        # planted: the lock covers --out only; the run with another --out would have trained into the live run's
        # checkpoints (its folder is prepared as `train` prepares it; no rank is started)
        monkeypatch.setattr(run_folder, "output_folders", lambda cfg: [("--out", cfg.logging.out)])
        planted = config_from_args(build_parser().parse_args([*second, "--out", str(tmp_path / "d"), "--ckpt-dir",
                                                              ckpt, "--resume", "auto"]))
        try:
            capfd.readouterr()
            assert prepare_run(planted).checkpoint.resume == "auto"  # the ranks verify and resume the newest
            assert "--resume auto: step_00000004 is the newest checkpoint" in capfd.readouterr().err
        finally:
            release_run_folders()
    finally:
        os.killpg(live.pid, signal.SIGKILL)  # the live run dies without a word: the kernel releases its lock
        live.communicate(timeout=60)
    monkeypatch.undo()
    # nothing holds the folders any more: the next run takes them (prepare_run, where `train` takes its folders), to
    # continue from the newest checkpoint
    after = config_from_args(build_parser().parse_args(["train", *TINY, "--steps", "6", "--ckpt-every", "2",
                                                         "--resume", "auto", "--out", out, "--ckpt-dir", ckpt]))
    try:
        assert prepare_run(after).checkpoint.resume == "auto"
        assert "--resume auto: step_00000004 is the newest checkpoint" in capfd.readouterr().err
    finally:
        release_run_folders()


class OtherProcess:
    """Another process that takes run folders with hold_run_folder when told to, and lets them go: one interpreter for
    the tests of this file (each would import zerotrain, torch with it, for a line or two)."""

    SERVE = ("import sys\n"
             "from zerotrain.runtime.run_folder import ConfigError, hold_run_folder, release_run_folders\n"
             "for line in sys.stdin:\n"
             "    if line.startswith('take '):\n"
             "        try:\n"
             "            hold_run_folder(line[5:].rstrip('\\n'))\n"
             "            print('taken', flush=True)\n"
             "        except ConfigError as e:\n"
             "            print('refused', e, flush=True)\n"
             "    else:\n"
             "        release_run_folders()\n"
             "        print('released', flush=True)\n")

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", self.SERVE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def _ask(self, line: str) -> str:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline()

    def take(self, folder: str) -> bool:
        """Whether it took `folder` (it holds it until release)."""
        answer = self._ask(f"take {folder}")
        assert answer.startswith(("taken", "refused")), answer
        return answer.startswith("taken")

    def release(self) -> None:
        assert self._ask("release") == "released\n"


@pytest.fixture(scope="module")
def other_process():
    other = OtherProcess()
    yield other
    other.process.communicate("", timeout=30)


def test_the_folder_check_is_the_lock_a_planted_no_op_lock_lets_a_second_run_in(tmp_path, monkeypatch, other_process):
    """prepare_run refuses a held folder because of the lock alone: with hold_run_folder planted as a no-op, it
    would let a second run into a folder another process is training in."""
    out = str(tmp_path / "held")
    assert other_process.take(out)
    try:
        cfg = tiny_config(tmp_path, steps=2)
        cfg.logging.out, cfg.logging.metrics, cfg.checkpoint.dir = out, "", ""
        with pytest.raises(run_folder.ConfigError, match=f"in use by another run \\(pid {other_process.pid} "):
            prepare_run(cfg)
        monkeypatch.setattr(run_folder, "hold_run_folder", lambda out, flag="--out": None)  # planted: nothing held
        assert prepare_run(cfg).logging.out == out  # the second run would have gone ahead
    finally:
        other_process.release()


def test_a_run_refused_after_taking_its_folder_lets_it_go(tmp_path, monkeypatch, other_process):
    """run_job's prepare may take the run folder and then refuse the run: the folder is let go at once, so a caller
    that goes on living (a notebook, a sweep) does not keep the next run out. Planted: the release skipped."""
    from zerotrain.runtime import launch

    def take_then_refuse(cfg):
        run_folder.hold_run_folder(str(tmp_path / "run"))
        raise run_folder.ConfigError("refused after taking the folder")

    def other_process_takes_it() -> bool:
        try:
            return other_process.take(str(tmp_path / "run"))
        finally:
            other_process.release()

    cfg = tiny_config(tmp_path, steps=1)
    with pytest.raises(run_folder.ConfigError, match="refused after taking"):
        launch.run_job(lambda cfg, comm: None, cfg, prepare=take_then_refuse)
    assert other_process_takes_it()

    monkeypatch.setattr(launch, "release_run_folders", lambda: None)  # planted: the refusal keeps the folder
    try:
        with pytest.raises(run_folder.ConfigError, match="refused after taking"):
            launch.run_job(lambda cfg, comm: None, cfg, prepare=take_then_refuse)
        assert not other_process_takes_it()
    finally:
        release_run_folders()
