"""A setting the user gives (flag or TOML key) that does nothing in the run is refused in one line, exit code 2: which
methods and which models or options each setting applies to is declared once, with the setting (config.py)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import zerotrain_here
from model_folders import CHATML, llama_folder, write_jsonl

from zerotrain import config as config_module
from zerotrain.cli.commands import train as train_command
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.config import METHODS, PRESETS, declared, setting_for
from zerotrain.errors import ConfigError

PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
         for i in range(8)]

# The runs the survey below names: a dense GPT-2, a dense Llama (no rope scaling, no window), a MoE, DPO runs of a
# tiny Llama folder with a loss with a reference and with one without.
RUNS = {"gpt2": ["--preset", "tiny", "--data", "synthetic"],
        "llama": ["--preset", "llama-tiny", "--data", "synthetic"],
        "moe": ["--preset", "qwen3-moe-tiny", "--data", "synthetic"],
        "dpo": ["--method", "dpo", "--init-from", "BASE", "--data", "PAIRS", "--seq-len", "32"],
        "simpo": ["--method", "dpo", "--init-from", "BASE", "--data", "PAIRS", "--seq-len", "32", "--dpo-loss",
                  "simpo"]}

# The survey: every setting that does something in some runs only, and a run of each kind it does nothing in (the
# default method, sft, for the model kinds; a dense Llama for the experts' settings). Every other setting applies to
# every run (the test below holds the declarations to this table both ways).
NOT_IN = {
    # SFT's data path only: DPO reads one file of pairs, renders no chat template of its own, validates every
    # held-out pair, and adds no balancing loss
    "pack": "dpo", "truncate": "dpo", "glob": "dpo", "data_cache": "dpo", "chat_template": "dpo", "epochs": "dpo",
    "eval_batches": "dpo",
    "moe_aux_coef": ("dpo", "llama"),
    "dpo_loss": "llama", "dpo_beta": "llama", "dpo_label_smoothing": ("llama", "simpo"),
    "dpo_reference": ("llama", "simpo"), "simpo_gamma": ("llama", "dpo"),
    "lora_alpha": "llama", "lora_dropout": "llama", "lora_targets": "llama",
    "n_kv_head": "gpt2", "head_width": "gpt2", "rope_theta": "gpt2", "rope_scaling": "gpt2",
    "rope_factor": "llama", "rope_low_freq_factor": "llama", "rope_high_freq_factor": "llama",
    "rope_original_context": "llama", "rope_beta_fast": "llama", "rope_beta_slow": "llama", "rope_truncate": "llama",
    "rope_attention_factor": "llama",
    "sliding_window": "llama", "sliding_window_pattern": "llama", "rope_local_theta": "llama",
    "query_pre_attn_scalar": "llama", "attn_softcap": "llama", "final_softcap": "llama",
    "n_experts": "llama", "experts_per_token": "llama", "expert_width": "llama", "norm_topk_prob": "llama",
    "shared_expert_width": "moe", "moe_every": "llama", "mlp_only_layers": "llama", "router_aux_coef": "llama",
    "ep": "llama", "lr_decay_ratio": "gpt2",
    "full_attention_interval": "llama", "partial_rotary": "llama", "linear_conv_kernel": "llama",
    "linear_key_heads": "llama", "linear_value_heads": "llama", "linear_key_width": "llama",
    "linear_value_width": "llama", "linear_attention_kernel": "llama",
    **{key: "llama" for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim",
                                "rope_interleave", "rope_mscale", "rope_mscale_all_dim", "first_dense_layers",
                                "shared_experts", "expert_groups", "expert_groups_per_token", "routed_scaling",
                                "routing_bias_speed", "mtp_layers", "mtp", "mtp_loss_weight", "llama4_scaling_beta",
                                "attention_bias", "use_qk_norm")},
    "nope_every": "llama", "attention_chunk": "llama", "qk_l2_norm": "llama", "temperature_tuning": "llama",
    "temperature_floor": "llama", "temperature_scale": "llama",
    **{key: "llama" for key in ("global_head_width", "k_eq_v", "global_kv_heads", "kv_shared_layers", "per_layer_width",
                                "double_wide_mlp")},
    **{key: "llama" for key in ("num_generations", "max_completion_length", "temperature", "top_p", "grpo_loss",
                                "grpo_beta", "grpo_epsilon", "grpo_epsilon_high", "grpo_iterations", "scale_rewards",
                                "mask_truncated_completions", "reward", "reward_weights", "reward_format")},
}
CASES = [(key, run) for key, runs in NOT_IN.items() for run in ((runs,) if isinstance(runs, str) else runs)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("applicability")
    llama_folder(tmp / "base", template=CHATML)
    (tmp / "template.jinja").write_text(CHATML)
    return {"BASE": str(tmp / "base"), "PAIRS": write_jsonl(tmp / "pairs.jsonl", PAIRS),
            "TEMPLATE": str(tmp / "template.jinja"), "tmp": tmp}


@pytest.fixture
def never_launched(monkeypatch):
    """A flag accepted would start training: the test fails there instead."""
    def launched(*a, **k):
        raise AssertionError("the run was accepted and launched")
    monkeypatch.setattr(train_command, "run_job", launched)


def run_argv(files, run: str) -> list[str]:
    return [files.get(a, a) for a in RUNS[run]]


def explicit(s, files) -> list[str]:
    """The setting given on the command line at its default value (a file that exists for --chat-template): that it
    was given is what counts, not its value."""
    if s.type is bool:
        return [s.flag if s.default else f"--no-{s.flag[2:]}"]
    value = files["TEMPLATE"] if s.key == "chat_template" else files["tmp"] if s.key == "data_cache" else s.default
    return [s.flag, str(value)]


def parse(files, run, *flags) -> config_module.Config:
    return config_from_args(build_parser().parse_args(["train", *run_argv(files, run), *flags]), environment=False)


@pytest.mark.parametrize("key, run", CASES)
def test_a_setting_given_where_it_does_nothing_is_refused_in_one_line(key, run, files, capfd, tmp_path,
                                                                      never_launched):
    s = setting_for(key)
    done = zerotrain_here(capfd, "train", *run_argv(files, run), *explicit(s, files), "--out", str(tmp_path),
                          "--no-progress")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"zerotrain: error: {s.flag} applies to "), done.stderr


def test_the_survey_names_every_declared_restriction_and_only_those():
    """Each restriction a declaration states has a case above: a run of a method it leaves out, and a run of one of
    its methods that lacks the model or option it needs; a setting not in the survey applies to every run."""
    assert {s.key for s in declared() if s.methods is not None or s.applies is not None} == set(NOT_IN)
    method = {run: "dpo" if "dpo" in argv else "sft" for run, argv in RUNS.items()}
    for s in declared():
        runs = [run for key, run in CASES if key == s.key]
        if s.methods is not None:
            assert any(method[run] not in s.methods for run in runs), s.key
        if s.applies is not None:
            assert any(method[run] in (s.methods or METHODS) for run in runs), s.key


def test_the_examples_of_the_issue_say_what_the_run_is(files, capfd, tmp_path, never_launched):
    said = {}
    for run, flags in (("dpo", ["--chat-template", "/no/such/template.jinja"]), ("llama", ["--moe-aux-coef", "0.5"]),
                       ("dpo", ["--moe-aux-coef", "0.5"]), ("llama", ["--lora-alpha", "8"])):
        done = zerotrain_here(capfd, "train", *run_argv(files, run), *flags, "--out", str(tmp_path), "--no-progress")
        assert done.returncode == 2
        said[flags[0]] = said.get(flags[0], []) + [done.stderr.strip()]
    assert said == {
        "--chat-template": ["zerotrain: error: --chat-template applies to --method sft; this run is --method dpo"],
        "--moe-aux-coef": ["zerotrain: error: --moe-aux-coef applies to mixture-of-experts models; llama-tiny has no "
                           "experts",
                           "zerotrain: error: --moe-aux-coef applies to --method sft; this run is --method dpo"],
        "--lora-alpha": ["zerotrain: error: --lora-alpha applies to LoRA runs (--lora-rank above 0); this run trains "
                         "every weight (--lora-rank 0)"]}


def test_a_toml_key_is_refused_as_a_flag_is_naming_its_table_and_file(files, capfd, tmp_path, never_launched):
    toml = tmp_path / "run.toml"
    toml.write_text("[data]\npack = false\n")
    done = zerotrain_here(capfd, "train", *run_argv(files, "dpo"), "--config", str(toml), "--out", str(tmp_path),
                          "--no-progress")
    assert (done.returncode, done.stderr) == (2, f"zerotrain: error: pack in [data] of {toml} applies to --method "
                                                 "sft; this run is --method dpo\n")


def test_a_model_named_by_flags_alone_is_this_run_s_model():
    with pytest.raises(ConfigError, match="^--rope-theta applies to the Llama family's models \\(rotary positions\\); "
                                          "this run's model is --arch gpt2$"):
        config_from_args(build_parser().parse_args(["train", "--data", "synthetic", "--rope-theta", "500"]))


def test_the_model_is_known_from_init_from_s_config_json_before_the_check(files):
    with pytest.raises(ConfigError, match=f"^--experts-per-token applies to mixture-of-experts models; --init-from "
                                          f"{files['BASE']} has no experts$"):
        config_from_args(build_parser().parse_args(["train", "--init-from", files["BASE"], "--data", files["PAIRS"],
                                                    "--seq-len", "32", "--experts-per-token", "2"]))


@pytest.mark.parametrize("run", sorted(RUNS))
def test_defaults_commands_defaults_and_presets_never_trip_it_and_what_applies_passes(run, files):
    parse(files, run)  # every default, none given
    applies = {"gpt2": ["--lora-rank", "4", "--lora-alpha", "8", "--pack", "--eval-batches", "2"],
               "llama": ["--rope-theta", "500", "--rope-scaling", "yarn", "--rope-beta-fast", "16", "--n-kv-head", "2"],
               "moe": ["--moe-aux-coef", "0.5", "--experts-per-token", "2", "--ep", "1", "--router-aux-coef", "0.01"],
               "dpo": ["--dpo-beta", "0.2", "--dpo-label-smoothing", "0.1", "--dpo-reference", "live",
                       "--val-fraction", "0.2"],
               "simpo": ["--simpo-gamma", "1", "--dpo-beta", "2"]}[run]
    parse(files, run, *applies)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_preset_trips_it(preset):
    config_from_args(build_parser().parse_args(["train", "--preset", preset, "--data", "synthetic"]),
                     environment=False)


def test_the_demo_s_own_defaults_never_trip_it(tmp_path):
    args = build_parser().parse_args(["demo", "--out", str(tmp_path)])
    assert args._flag_defaults  # the demo's own defaults, which the user did not give
    config_from_args(args, environment=False)


@pytest.mark.parametrize("key, run, plant", [
    ("chat_template", "dpo", {"methods": None}),  # DPO would take --chat-template and render nothing with it
    ("moe_aux_coef", "llama", {"applies": None}),  # a dense model would take a balancing weight
    ("lora_alpha", "gpt2", {"applies": None}),
])
def test_a_declaration_removed_lets_the_flag_through_silently(key, run, plant, files, monkeypatch):
    """The planted bug: the setting's declaration of where it applies dropped from config.declared, which the check
    reads; the flag is then accepted and does nothing, as before the declarations."""
    s = setting_for(key)
    argv = explicit(s, files)
    with pytest.raises(ConfigError, match=f"^{s.flag} applies to "):
        parse(files, run, *argv)
    real = config_module.declared
    monkeypatch.setattr(config_module, "declared",
                        lambda *a: (dataclasses.replace(d, **plant) if d.key == key else d for d in real(*a)))
    parse(files, run, *argv)  # accepted: the parametrised test above would fail for this pair
    assert key in {d.key for d in config_module.declared()}


def test_a_missing_chat_template_file_is_refused_whatever_the_data(capfd, tmp_path, never_launched):
    done = zerotrain_here(capfd, "train", "--data", "synthetic", "--chat-template", str(tmp_path / "no.jinja"),
                          "--out", str(tmp_path), "--no-progress")
    assert (done.returncode, done.stderr) == (2, f"zerotrain: error: --chat-template {tmp_path / 'no.jinja'}: no such "
                                                 "file (a Jinja chat template, as chat_template.jinja holds one)\n")


def test_help_says_where_a_setting_applies():
    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    helps = {a.option_strings[0]: a.help for a in train._actions if a.option_strings}
    assert helps["--moe-aux-coef"].endswith("; applies to --method sft with mixture-of-experts models (default: the "
                                            "model's)")
    assert helps["--lora-alpha"].endswith("; applies to LoRA runs (--lora-rank above 0) (default: 16.0)")
    assert helps["--lr"] == "peak learning rate (default: 0.003; with --init-from 2e-05)"  # every run's: as it was
