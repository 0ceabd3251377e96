"""Every user error reaches the user as one line with exit code 2, wherever it is found: before the ranks start,
or inside a rank, under zerotrain's launcher and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_config, zerotrain_here

from zerotrain.data.tokenfiles import write_llmc
from zerotrain.errors import ConfigError
from zerotrain.runtime import launch
from zerotrain.runtime.launch import JobFailed, run_job

pytestmark = pytest.mark.timeout(300)

TINY = ["--nproc", "2", "--steps", "3", "--micro-batch", "2", "--no-progress"]


def zerotrain(*args, faults=None, torchrun=False, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "ZEROTRAIN_FAULTS"}
    if faults:
        env["ZEROTRAIN_FAULTS"] = faults
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0"] if torchrun else [sys.executable]
    return subprocess.run([*head, "-m", "zerotrain", *args], capture_output=True, text=True, timeout=240, env=env,
                          cwd=cwd)


def one_line_error(r) -> str:
    """The user error as the user sees it: exit 2, one `zerotrain: error:` line, no traceback, no FAILED."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("zerotrain: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr and "FAILED" not in r.stderr, r.stderr[-2000:]
    return errors[0]


def llmc_bin_without_val(tmp_path):
    path = tmp_path / "tokens.bin"
    write_llmc(str(path), np.arange(4000) % 200, vocab_size=256)
    return str(path), "has none"


def nanogpt_folder_with_only_train(tmp_path):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    (np.arange(4000) % 200).astype(np.uint16).tofile(folder / "train.bin")
    return str(folder), "has none"


def one_document_text(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a single paragraph, so nothing can be held out for validation: " * 4)
    return str(path), "a single document"


@pytest.mark.parametrize("make_data", [llmc_bin_without_val, nanogpt_folder_with_only_train, one_document_text])
def test_eval_every_without_validation_data_is_refused_before_the_ranks_start_naming_the_flag_that_supplies_it(
        tmp_path, capfd, make_data):
    data, why = make_data(tmp_path)
    line = one_line_error(zerotrain_here(capfd, "train", *TINY, "--data", data, "--eval-every", "10", "--out",
                                         str(tmp_path / "run")))
    assert line.startswith("zerotrain: error: --eval-every 10 needs validation tokens and --data ")
    assert why in line and line.endswith("pass --val-data PATH")
    assert not os.path.exists(tmp_path / "run" / "logs")  # no rank started


def test_val_data_supplies_the_validation_tokens(tmp_path, capfd):
    data, _ = one_document_text(tmp_path)
    val = tmp_path / "val.txt"
    val.write_text("held-out text, a paragraph of its own.\n\nAnd a second one, to be sure there is enough. " * 6)
    r = zerotrain_here(capfd, "train", *TINY, "--data", data, "--val-data", str(val), "--eval-every", "3",
                       "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "val_loss" in open(tmp_path / "run" / "metrics.jsonl").readlines()[-1]


def test_a_config_error_raised_inside_the_ranks_is_one_line_and_exit_2_under_the_launcher(tmp_path, capfd):
    """A bad ZEROTRAIN_FAULTS spec is found by each rank as it starts (the launcher never parses it)."""
    line = one_line_error(zerotrain_here(capfd, "train", *TINY, "--data", "synthetic", "--out", str(tmp_path / "run"),
                                         faults="explode@step=x"))
    assert line.startswith("zerotrain: error: ZEROTRAIN_FAULTS: unknown fault kind 'explode' in 'explode@step=x'")


def test_under_torchrun_a_rank_s_config_error_is_said_once_and_the_ranks_exit_2(tmp_path):
    """torchrun ends with its own report and exit code 1 whatever its ranks exit with; zerotrain's part is the one
    line (rank 0 says it at once and exits 2; torchrun then stops the other rank), no zerotrain traceback."""
    r = zerotrain("train", *TINY[2:], "--data", "synthetic", "--out", str(tmp_path / "run"), faults="explode@step=x",
                  torchrun=True)
    errors = [line for line in r.stderr.splitlines() if line.startswith("zerotrain: error: ")]
    assert errors == [errors[0]] and "unknown fault kind 'explode'" in errors[0], r.stderr[-2000:]
    assert r.returncode != 0 and "exitcode  : 2" in r.stderr
    assert "zerotrain/" not in r.stderr.split("zerotrain: error: ")[0]  # no traceback through zerotrain's code


def config_error_job(cfg, comm):
    raise ConfigError(f"--data {cfg.data.source}: planted, found by rank {comm.rank}")


def test_the_launcher_turns_a_rank_s_config_error_into_the_config_error_and_a_planted_miss_is_caught(
        tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, nproc=2)
    with pytest.raises(ConfigError, match=r"^--data synthetic: planted, found by rank [01]$"):
        run_job(config_error_job, cfg)
    monkeypatch.setattr(launch, "user_error", lambda job_dir: None)  # planted: the launcher ignores the report
    with pytest.raises(JobFailed):  # a failed job (exit 1), not the user error (exit 2) it is
        run_job(config_error_job, cfg)
