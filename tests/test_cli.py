"""The command line as a user meets it: the demo end to end, train and resume, torchrun, one-line errors."""

import json
import os
import subprocess
import sys

import pytest
from conftest import zerotrain_here

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def test_demo_proves_the_four_invariants_and_a_bitwise_resume(tmp_path, capfd):
    r = zerotrain_here(capfd, "demo", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for line in ("(a) finite loss", "(b) parameters bitwise identical", "(c) AdamW's state = ZeRO-1 formula", "(d) checkpoints"):
        assert any(line in l and l.endswith("PASS") for l in r.stdout.splitlines()), line
    assert "RESUME VERIFIED" in r.stdout
    report = json.load(open(tmp_path / "report.json"))
    assert report["world_size"] == 4 and report["steps"] == 20 and report["param_count"] == 28_032
    assert len(report["losses"]) == 20 and report["losses"][-1] < report["losses"][0] - 0.5
    assert len(set(report["param_hashes"])) == 1 and report["resume_verified"] is True
    assert report["optimizer_bytes"] == [report["expected_bytes"]] * 4
    assert report["checkpoint_path"].endswith("step_00000010")
    assert report["resumed_losses"] == report["losses"][10:]
    assert report["comm_calls_per_step"]["reduce_scatter_grads"] == report["comm_calls_per_step"]["all_gather_params"]
    assert os.path.isfile(os.path.join(report["checkpoint_path"], "manifest.json"))


def test_demo_wall_clock_limit_stops_a_run_with_one_line(tmp_path, capfd):
    r = zerotrain_here(capfd, "demo", "--out", str(tmp_path), "--time-limit", "1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == \
        "zerotrain: FAILED: the job exceeded its wall-clock limit of 1 s; all ranks were stopped"
    assert "Traceback" not in r.stderr


def test_train_writes_metrics_and_resume_auto_continues(tmp_path, capfd):
    args = ["train", "--nproc", "2", "--micro-batch", "2", "--accum", "2", "--out", str(tmp_path),
            "--ckpt-every", "2", "--no-progress", "--keep", "2", "--data", "synthetic"]
    r = zerotrain_here(capfd, *args, "--steps", "4")
    assert r.returncode == 0, r.stderr
    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    assert set(records[0]) >= {"step", "loss", "grad_norm", "lr", "tokens", "step_ms", "batch_sequences"}
    assert records[0]["tokens"] == records[0]["batch_tokens"] == 8 * 16 and records[0]["batch_sequences"] == 8
    r = zerotrain_here(capfd, *args, "--steps", "6", "--resume", "auto")
    assert r.returncode == 0, r.stderr
    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".zerotrain.lock", "latest", "step_00000004",
                                                            "step_00000006"]


def test_torchrun_job_is_joined_not_respawned_and_its_world_size_decides_tp(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[launch]\nnproc = 3\n")  # ignored: torchrun's world size decides (3 would refuse --tp 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "zerotrain", "train", "--steps", "2", "--micro-batch", "2",
           "--out", str(tmp_path), "--no-progress", "--config", str(toml), "--data", "synthetic", "--tp", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("zerotrain: trained to step 2 on 2 rank(s)") == 1  # rank 0 only
    assert "TP 2 x DP 1 = 2 ranks" in r.stdout
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 2


def test_under_torchrun_the_gpu_count_is_checked_against_this_node_s_ranks(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    # rank 0 of 2 nodes x 8 GPUs: a world of 16, 8 of them here
    for key, value in {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["train", "--device", "cuda", "--data", "synthetic", "--tp", "4"])
    cfg = config_from_args(args)
    assert (cfg.launch.nproc, cfg.dp) == (16, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "9")  # planted: more ranks on this node than GPUs
    with pytest.raises(ConfigError, match="--nproc 9 exceeds the 8 CUDA devices here"):
        config_from_args(build_parser().parse_args(["train", "--device", "cuda", "--data", "synthetic"]))


def test_user_errors_are_one_line_with_exit_code_2(tmp_path, capfd):
    r = zerotrain_here(capfd, "train", "--n-embd", "30", "--n-head", "4")
    assert r.returncode == 2
    assert r.stderr == "zerotrain: error: --n-embd 30 is not divisible by --n-head 4\n"


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc must be positive, got 0"),
    (["--n-layer", "-1"], "--n-layer must be positive, got -1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--data", "nope.txt"], "--data nope.txt: no such file"),
    (["--precision", "fp8"], "--precision must be fp32 or bf16, got 'fp8'"),
    (["--overlap", "yes"], "--overlap must be auto, on or off, got 'yes'"),
    (["--resume", "no/such/folder"], "--resume no/such/folder: no such checkpoint folder"),
])
def test_bad_flags_name_the_bad_value(capsys, args, message):
    assert main(["train", "--data", "synthetic", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_tensorboard_without_its_package_names_the_extra(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["train", "--tensorboard"]) == 2
    assert capsys.readouterr().err == \
        "zerotrain: error: --tensorboard needs the tensorboard package: pip install 'zerotrain[tb]'\n"


@pytest.mark.parametrize("flags, device, compile, backward, forward", [
    ([], "cpu", False, False, False),  # on CPU overlapping measured no faster
    ([], "cuda", False, True, True),
    ([], "cuda", True, True, False),  # a model compiled whole cannot wait for a bucket midway
    (["--zero", "3"], "cuda", True, True, True),  # at stage 3 each block is compiled, its gathers between them
    (["--overlap", "on"], "cpu", False, True, True),
    (["--no-overlap"], "cuda", False, False, False),
])
def test_overlap_auto_chooses_per_device_and_flags_override_it(flags, device, compile, backward, forward):
    cfg = config_from_args(build_parser().parse_args(["train", "--data", "synthetic", *flags]))
    cfg.launch.device, cfg.loop.compile = device, compile
    assert (cfg.reduce_in_backward, cfg.gather_in_forward) == (backward, forward)


def test_short_data_file_and_incompatible_checkpoint_fail_before_workers(tmp_path, capfd):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    assert main(["train", "--data", str(short)]) == 2
    assert "fewer than one sequence of --seq-len 16" in capfd.readouterr().err
    other = tmp_path / "other"  # a real checkpoint, of a wider model
    assert zerotrain_here(capfd, "train", "--n-embd", "64", "--steps", "1", "--ckpt-every", "1", "--no-progress",
                          "--data", "synthetic", "--out", str(other)).returncode == 0
    ck = other / "checkpoints" / "step_00000001"
    assert main(["train", "--data", "synthetic", "--resume", str(ck)]) == 2
    assert "incompatible model: checkpoint has model.n_embd=64, this run has 32" in capfd.readouterr().err
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nn_embd = 48\nn_head = 5\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "--n-embd 48 is not divisible by --n-head 5" in capfd.readouterr().err
    toml.write_text("[modle]\n")
    assert main(["train", "--config", str(toml)]) == 2
    assert "unknown table [modle] (did you mean [model]?" in capfd.readouterr().err
