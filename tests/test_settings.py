"""Every setting is declared once: its flag, TOML key, help and default come from that declaration and agree."""

from __future__ import annotations

import importlib.util
import math
import os
import re

import pytest

from zerotrain import config as config_module
from zerotrain.cli.flags import reference_table, shown_default
from zerotrain.cli.main import build_parser
from zerotrain.config import ABOVE_ONE, BELOW_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Config, declared, merge, validate
from zerotrain.errors import ConfigError

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "docs", "reference.md")
REGEN = os.path.join(os.path.dirname(__file__), "..", "scripts", "regen_reference.py")


def expected_names():
    """What the declaration promises: for each setting, its TOML key and the flag that is that key with dashes."""
    return [(s, s.key, "--" + s.key.replace("_", "-")) for s in declared()]


def train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["train"]
    return " ".join(sub.format_help().split())  # one line: argparse wraps help text


def help_default(help_text: str, s) -> str | None:
    """The default `--help` states for a setting: the first "(default: ...)" after its flag's own entry."""
    entry = f"{s.flag}, --no-{s.flag[2:]}" if s.type is bool else f"{s.flag} {s.key.upper()}"
    found = re.search(re.escape(entry) + r" .*?\(default: ([^)]*)\)", help_text)
    return found.group(1) if found else None


def reference_rows() -> dict[str, list[str]]:
    """docs/reference.md's flag table: flag cell -> cells."""
    rows = {}
    for line in open(REFERENCE):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `--") and len(cells) == 4:
            rows[cells[0].split("`")[1]] = cells
    return rows


def sample_value(s):
    if s.type is bool:
        return not s.default
    return "some-value" if s.type is str else s.default + s.type(3)


def check_flags_and_keys_agree():
    """Each setting: `--flag V` on the command line and `key = V` in its TOML table give the same value;
    --help lists the flag with its default; docs/reference.md has the flag, table, key and default."""
    parser, help_text, rows = build_parser(), train_help(), reference_rows()
    for s, key, flag in expected_names():
        value = sample_value(s)
        if s.type is bool:
            argv = ["train", flag if value else f"--no-{flag[2:]}"]
        else:
            argv = ["train", flag, str(value)]
        args = parser.parse_args(argv)
        from_toml = Config()
        merge(from_toml, {s.section: {key: value}}, origin="test")
        assert getattr(args, key, None) == value == getattr(getattr(from_toml, s.section), s.name), flag
        assert help_default(help_text, s) == shown_default(s, s.default), flag
        assert flag in rows, f"{flag} is missing from docs/reference.md (run scripts/regen_reference.py)"
        assert rows[flag][1] == f"`[{s.section}] {key}`" and rows[flag][2] == f"`{shown_default(s, s.default)}`", flag


def test_every_flag_and_toml_key_comes_from_the_declaration_and_agrees_with_help_and_the_reference():
    check_flags_and_keys_agree()
    assert len({s.key for s in declared()}) == len(list(declared()))  # a key names one setting
    # docs/reference.md's table is the one the declarations give (scripts/regen_reference.py writes it)
    assert reference_table() in open(REFERENCE).read()


def regen_reference():
    """scripts/regen_reference.py as a module, so its main() runs in this process."""
    spec = importlib.util.spec_from_file_location("regen_reference", REGEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regen_reference_rewrites_a_stale_table_and_leaves_the_rest(tmp_path, capsys):
    regen, current = regen_reference(), open(REFERENCE).read()
    stale = tmp_path / "reference.md"
    drop = next(line for line in current.splitlines() if line.startswith("| `--ckpt-every` "))
    stale.write_text(current.replace(drop + "\n", ""))  # a setting declared since the table was written
    assert regen.main([str(stale), "--check"]) == 1
    assert "--ckpt-every" not in reference_rows_of(stale.read_text())  # --check changes nothing
    assert regen.main([str(stale)]) == 0
    rewritten = stale.read_text()
    assert reference_table() in rewritten and outside_the_table(rewritten) == outside_the_table(current)
    assert regen.main([str(stale), "--check"]) == 0
    stale.write_text(current.replace("<!-- end of flag table -->", ""))  # a file whose table cannot be found
    capsys.readouterr()
    assert regen.main([str(stale)]) == 2 and "markers" in capsys.readouterr().err


def reference_rows_of(text: str) -> set[str]:
    return {line.split("`")[1] for line in text.splitlines() if line.startswith("| `--")}


def outside_the_table(text: str) -> str:
    head, rest = text.split("<!-- flag table:", 1)
    return head + rest.split("<!-- end of flag table -->", 1)[1]


def test_a_setting_whose_flag_differs_from_its_toml_key_is_caught(monkeypatch):
    """Planted: the parser names --ckpt-every --checkpoint-every while TOML still says ckpt_every."""
    real = config_module.Setting.flag.fget
    monkeypatch.setattr(config_module.Setting, "flag",
                        property(lambda s: "--checkpoint-every" if s.key == "ckpt_every" else real(s)))
    with pytest.raises(AssertionError, match="--ckpt-every"):
        check_flags_and_keys_agree()


BAD = {POSITIVE: 0, NON_NEGATIVE: -1, FRACTION: 1.5, BELOW_ONE: 1.0, ABOVE_ONE: 1.0}


@pytest.mark.parametrize("s", [s for s in declared() if s.rule or s.type is float], ids=lambda s: s.key)
def test_every_validation_error_names_a_flag_that_exists(s):
    flags = {o for a in build_parser()._actions if a.dest == "command"
             for o in a.choices["train"]._option_string_actions}
    bad_values = [BAD.get(s.rule, "not-a-choice" if s.type is str else None)] + ([math.nan] if s.type is float else [])
    for bad in [b for b in bad_values if b is not None]:
        cfg = Config()
        setattr(getattr(cfg, s.section), s.name, type(s.default)(bad) if s.type is not str else bad)
        with pytest.raises(ConfigError) as raised:
            validate(cfg)
        message = str(raised.value)
        assert message.startswith(s.flag + " "), message
        assert set(re.findall(r"--[a-z][a-z0-9-]*", message)) <= flags, message


def test_cross_setting_errors_name_flags_that_exist():
    flags = {o for a in build_parser()._actions if a.dest == "command"
             for o in a.choices["train"]._option_string_actions}
    for section, values in (("model", {"n_embd": 30}), ("parallel", {"tp": 3}), ("optim", {"warmup_steps": -2})):
        cfg = Config()
        cfg.launch.nproc = 2
        merge(cfg, {section: values}, origin="test")
        with pytest.raises(ConfigError) as raised:
            validate(cfg)
        assert set(re.findall(r"--[a-z][a-z0-9-]*", str(raised.value))) <= flags, str(raised.value)


def test_validation_is_pure_and_derived_values_are_resolved_after_it():
    cfg = Config()
    cfg.loop.steps = 50
    before = cfg.to_dict()
    validate(cfg)
    assert cfg.to_dict() == before and cfg.optim.warmup_steps == -1
    config_module.resolve(cfg)
    assert cfg.optim.warmup_steps == 5


def test_an_unknown_or_misplaced_toml_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"timeout_s in \[launch\]: unknown setting 'timeout_s' "
                                          r"\(did you mean 'timeout'\?\)"):
        merge(Config(), {"launch": {"timeout_s": 5.0}}, origin="x.toml")
    with pytest.raises(ConfigError, match=r"nproc belongs in \[launch\], not \[loop\]"):
        merge(Config(), {"loop": {"nproc": 2}}, origin="x.toml")


def test_a_config_written_before_the_run_table_was_split_still_reads():
    """Checkpoint manifests of zerotrain 0.1 keep one [run] table and field names; they load into today's sections."""
    old = {"model": {"n_layer": 3}, "data": {"source": "synthetic", "cache_dir": "/c"},
           "run": {"nproc": 4, "tp": 2, "steps": 7, "timeout_s": 9.0, "out": "/o"},
           "checkpoint": {"dir": "/o/ck", "every": 5, "every_minutes": 0.5}}
    cfg = Config.from_dict(old)
    assert (cfg.model.n_layer, cfg.data.source, cfg.data.cache_dir) == (3, "synthetic", "/c")
    assert (cfg.launch.nproc, cfg.parallel.tp, cfg.loop.steps) == (4, 2, 7)
    assert (cfg.launch.timeout, cfg.logging.out) == (9.0, "/o")
    assert (cfg.checkpoint.dir, cfg.checkpoint.every, cfg.checkpoint.every_minutes) == ("/o/ck", 5, 0.5)
    assert Config.from_dict(cfg.to_dict()) == cfg


def every_option() -> set[str]:
    """Every flag of every command and bench of the CLI."""
    found, parsers = set(), [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            found.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action.choices, dict):
                parsers.extend(p for p in action.choices.values() if hasattr(p, "_actions"))
    return found


def flags_named_by_config_errors(source: str) -> set[str]:
    """The --flags written in the messages of every `raise ConfigError(...)` in a module's source."""
    import ast

    named = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", None) == "ConfigError"):
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    named.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", part.value))
    return named


def test_every_flag_a_config_error_names_exists():
    """Whatever raises the error (config, data, a command), the flag it tells the user about is one they can pass."""
    package = os.path.join(os.path.dirname(__file__), "..", "src", "zerotrain")
    options, unknown = every_option(), {}
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                missing = flags_named_by_config_errors(open(path).read()) - options
                if missing:
                    unknown[os.path.relpath(path, package)] = sorted(missing)
    assert unknown == {}
    planted = 'raise ConfigError(f"--beta3 must be in [0, 1), got {x}")'  # a flag that does not exist
    assert flags_named_by_config_errors(planted) - options == {"--beta3"}


def test_a_toml_of_zerotrain_0_1_is_told_where_its_run_table_went_and_a_mistyped_flag_gets_a_suggestion(tmp_path):
    from zerotrain.cli.main import main

    old = tmp_path / "old.toml"
    old.write_text("[run]\nnproc = 2\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"the \[run\] table is now .*belong in \[launch\], \[loop\]"):
        merge(Config(), {"run": {"nproc": 2, "steps": 5}}, origin=str(old))
    assert main(["train", "--config", str(old)]) == 2
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --ckpt-evry 3 \(did you mean --ckpt-every\?\)"):
        build_parser().parse_args(["train", "--ckpt-evry", "3"])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --frobnicate$"):
        build_parser().parse_args(["train", "--frobnicate"])
    # Another command's flag is named as such, not offered back as its own closest match.
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --time-limit 8 \(--time-limit is a flag of "
                                          r"[a-z ,]*zerotrain demo[a-z ,]* only\)$"):
        build_parser().parse_args(["train", "--time-limit", "8"])


@pytest.mark.parametrize("theirs, ours", [("--learning-rate", "--lr"), ("--learnin-rate", "--lr"),
                                          ("--max-grad-norm", "--grad-clip"), ("--output-dir", "--out"),
                                          ("--gradient-accumulation-steps", "--accum")])
def test_another_tools_name_for_a_flag_is_answered_with_zerotrains(theirs, ours):
    """transformers' Trainer, TRL and torchtitan users type their tools' names; a misspelling of one too."""
    with pytest.raises(ConfigError, match=rf"unrecognized arguments: {theirs} 3 \(did you mean {ours}\?\)"):
        build_parser().parse_args(["train", theirs, "3"])


def test_help_is_wrapped_at_the_terminals_width_as_argparse_wraps_it_and_a_stale_width_is_caught(monkeypatch):
    """The parser asks the terminal's width once (flags.Parser: argparse asks it at every add_argument): a command's
    --help is argparse's own at any width. Planted: a width kept from another terminal is caught."""
    import argparse

    from zerotrain.cli.flags import Parser

    for columns in ("61", "97", "160"):
        monkeypatch.setenv("COLUMNS", columns)
        train = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
        mine = train.format_help()
        with monkeypatch.context() as m:
            m.setattr(Parser, "_get_formatter", argparse.ArgumentParser._get_formatter)
            assert mine == train.format_help()
        train._width = 78  # planted
        assert train.format_help() != mine
