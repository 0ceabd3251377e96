"""Fine-tuning's optimizer defaults: with --init-from, lr 2e-5, no weight decay and a warmup of 3% of the steps
where neither a flag nor the TOML sets them, said in the start line."""

from __future__ import annotations

import pytest
from conftest import zerotrain_here
from test_finetune_export import model_folder

from zerotrain import config as config_module
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("model") / "llama", "llama")


def optim_of(*flags):
    args = build_parser().parse_args(["train", "--data", "synthetic", "--no-progress", *flags])
    o = config_from_args(args, environment=False).optim
    return o.lr, o.weight_decay, o.warmup_steps


def test_init_from_gets_fine_tuning_defaults_unless_set_and_one_applied_over_the_users_is_caught(source, tmp_path,
                                                                                              monkeypatch):
    assert optim_of("--steps", "100") == (3e-3, 0.1, 10)  # pretraining's
    assert optim_of("--init-from", source, "--steps", "100") == (2e-5, 0.0, 3)
    assert optim_of("--init-from", source, "--steps", "10") == (2e-5, 0.0, 1)  # at least one step of warmup
    given = ("--init-from", source, "--steps", "100", "--lr", "1e-4", "--weight-decay", "0.01", "--warmup-steps", "7")
    assert optim_of(*given) == (1e-4, 0.01, 7)
    toml = tmp_path / "run.toml"
    toml.write_text("[optim]\nlr = 5e-5\n")
    assert optim_of("--config", str(toml), "--init-from", source, "--steps", "100") == (5e-5, 0.0, 3)
    # planted: the defaults applied over what the user said
    monkeypatch.setattr("zerotrain.cli.flags.fine_tuning_defaults",
                        lambda cfg, stated: config_module.fine_tuning_defaults(cfg, set()))
    assert optim_of(*given) != (1e-4, 0.01, 7)


def test_the_start_line_says_the_fine_tuning_settings_that_apply(source, tmp_path, capfd):
    r = zerotrain_here(capfd, "train", "--init-from", source, "--data", "synthetic", "--seq-len", "32", "--steps", "2",
                       "--micro-batch", "2", "--no-progress", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    start_line = next(line for line in r.stdout.splitlines() if "training steps 1-2" in line)
    assert "training steps 1-2; fine-tuning at lr 2e-05, weight decay 0, warmup 1 step;" in start_line
    r = zerotrain_here(capfd, "train", "--data", "synthetic", "--steps", "2", "--micro-batch", "2", "--no-progress",
                       "--out", str(tmp_path / "pretraining"))
    assert r.returncode == 0 and "fine-tuning" not in r.stdout
