"""The training flags every training command shares, built from config's declarations, and how they become a Config."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shutil
import sys

from zerotrain.config import (PRESETS, Config, Rule, Setting, apply_preset, check_applicable, cuda_defaults,
                               declared, fine_tuning_defaults, is_mixture, load_toml, merge, resolve, setting_for,
                               validate)
from zerotrain.data import check_source, epoch_steps
from zerotrain.data.pairs import read_splits
from zerotrain.data.prompts import read_prompts
from zerotrain.errors import ConfigError
from zerotrain.hub.init_from import adopt, has_weight_files, weight_source


class Parser(argparse.ArgumentParser):
    def _get_formatter(self):
        # argparse makes a formatter for every add_argument (to check its metavar), each asking the terminal for its
        # width: 7,440 asks a parser of every command's flags, 40% of its building (measured); asked once a parser
        if not hasattr(self, "_width"):
            self._width = shutil.get_terminal_size().columns - 2  # HelpFormatter's own width
        return self.formatter_class(prog=self.prog, width=self._width)

    def error(self, message: str):  # one line, exit 2, no usage dump
        if message.startswith("unrecognized arguments: "):
            message += _did_you_mean(message.split(": ", 1)[1].split()[0], self)
        # A command's parser names its command; the top parser's name is the one every error line starts with.
        raise ConfigError(f"{self.prog}: {message}" if " " in self.prog else message)


# What transformers' Trainer, TRL and torchtitan users type for zerotrain's flags: too far from them for a spelling
# match, so named here (suggested only where the command has the flag).
OTHER_TOOLS_NAMES = {
    "--learning-rate": "--lr", "--learning_rate": "--lr", "--lr-scheduler-type": "--lr-schedule",
    "--lr-scheduler": "--lr-schedule", "--num-train-epochs": "--epochs", "--max-steps": "--steps",
    "--per-device-train-batch-size": "--micro-batch", "--batch-size": "--micro-batch",
    "--gradient-accumulation-steps": "--accum", "--output-dir": "--out", "--save-steps": "--ckpt-every",
    "--max-seq-length": "--seq-len", "--max-length": "--seq-len", "--seq-length": "--seq-len",
    "--gradient-checkpointing": "--activation-checkpointing", "--model-name-or-path": "--init-from",
    "--resume-from-checkpoint": "--resume", "--dataset": "--data", "--max-grad-norm": "--grad-clip",
    "--warmup": "--warmup-steps",
}


def _did_you_mean(word: str, parser: argparse.ArgumentParser) -> str:
    """The commands that have flag `word`, if it is another command's flag; else the closest flag of this parser and
    its subcommands (argparse reports a subcommand's unknown flag at the top)."""
    owners: dict[str, list[str]] = {}  # flag -> the programs that take it
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for option in p._option_string_actions:
            if option.startswith("--"):
                owners.setdefault(option, []).append(p.prog)
        parsers.extend(c for a in p._actions if isinstance(a.choices, dict) for c in a.choices.values()
                       if isinstance(c, argparse.ArgumentParser))
    if not word.startswith("--"):
        return ""
    if word in owners:
        return f" ({word} is a flag of {', '.join(sorted(set(owners[word])))} only)"
    known = {name: name for name in owners} | {name: ours for name, ours in OTHER_TOOLS_NAMES.items() if ours in owners}
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {known[close[0]]}?)" if close else ""


def checked(typ: type, rule: Rule):
    """An argparse type for a command's own flag, held to one of config's rules (the settings' are checked there).

    A refused value is argparse's one-line error naming the flag: `argument --top-k: must be positive, got 0`.
    """
    def parse(text: str):
        try:
            value = typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if typ is int else 'a number'}, got {text!r}")
        if not rule.holds(value):
            raise argparse.ArgumentTypeError(f"{rule.says}, got {value}")
        return value

    parse.__name__ = typ.__name__
    return parse


def shown_default(s: Setting, value) -> str:
    """A default as --help and the README state it: a derived one in words (`runs/<timestamp>`)."""
    if s.shown is not None and value == s.default:
        return s.shown
    if s.type is bool:
        return "on" if value else "off"
    return str(value)


class _OnePerLine(argparse.Action):
    """A flag that may be given several times (--data A:0.7 --data B:0.3): its values kept one per line, as the
    setting holds them (config.data_sources reads them). Given again without a weight after one without, the last
    wins, as any other flag's does."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest)
        again = before is not None and (is_mixture(before) or is_mixture(values))
        setattr(namespace, self.dest, f"{before}\n{values}" if again else values)


def add_training_flags(p: argparse.ArgumentParser, defaults: dict[str, object] | None = None) -> None:
    """One flag per declared setting; `defaults` ({key: value}) are a command's own (the demo's), shown as such."""
    p.add_argument("--config", help="TOML file with [model] [data] [optim] [launch] [parallel] [loop] [logging] "
                                    "[checkpoint] [guard] tables; keys are the flags' names with underscores")
    p.add_argument("--preset", help="model preset: " + ", ".join(PRESETS))
    defaults = defaults or {}
    for key in defaults:
        setting_for(key)  # a command's defaults name settings that exist
    for s in declared():
        default = defaults.get(s.key, s.default)
        help_ = f"{s.help}{f'; applies to {s.scope}' if s.scope else ''} (default: {shown_default(s, default)})"
        if s.type is bool:
            p.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif s.many:
            p.add_argument(s.flag, action=_OnePerLine, default=None, metavar=s.key.upper(), help=help_)
        else:
            p.add_argument(s.flag, type=s.type, default=None, metavar=s.key.upper(), help=help_)
    p.add_argument("--no-overlap", action="store_true", help="the same as --overlap off")
    p.set_defaults(_flag_defaults=defaults)


def config_from_args(args: argparse.Namespace, environment: bool = True) -> Config:
    """defaults <- command defaults <- --config TOML <- --preset <- flags; then validate, resolve, check the data
    and (with `environment`) that this machine can run it."""
    cfg = Config()
    merge(cfg, by_section(args._flag_defaults), origin="defaults")
    vocab_given = False  # by the user: --vocab-size or the TOML; otherwise the data decides
    if args.config:
        toml = load_toml(args.config)
        merge(cfg, toml, origin=args.config)
        vocab_given = "vocab_size" in toml.get("model", {})
    if args.preset:
        apply_preset(cfg, args.preset)
    given = {s.key: getattr(args, s.key) for s in declared() if getattr(args, s.key) is not None}
    if args.no_overlap:
        given["overlap"] = "off"
    torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if torchrun:  # it decides the world
        given["nproc"] = int(os.environ["WORLD_SIZE"])
    merge(cfg, by_section(given), origin="command line")
    if cfg.checkpoint.init_from:  # the model, its sizes and its vocabulary come from the weights
        source = weight_source(cfg.checkpoint.init_from, weights=environment)  # a plan needs config.json alone
        stated = set(given) | set(toml.get("model", {}) if args.config else {}) | \
            (set(PRESETS[args.preset]) if args.preset else set())
        cfg.model = adopt(cfg.model, source, stated)
        cfg.checkpoint.init_from, vocab_given = source.folder, True
        fine_tuning_defaults(cfg, set(given) | set(args._flag_defaults) |  # lr and decay; warmup: resolve
                             (set(toml.get("optim", {})) if args.config else set()))
    cuda_defaults(cfg, set(given) | set(args._flag_defaults) | (set(toml.get("parallel", {})) if args.config else set())
                  | (set(PRESETS[args.preset]) if args.preset else set()))
    validate(cfg)
    check_applicable(cfg, stated_by_user(given, toml if args.config else {}, args.config), model_named(cfg, args))
    if cfg.data.chat_template and not os.path.isfile(cfg.data.chat_template):  # whatever the data: it is a typo
        raise ConfigError(f"--chat-template {cfg.data.chat_template}: no such file (a Jinja chat template, as "
                          "chat_template.jinja holds one)")
    if environment:
        check_environment(cfg)
    # A plan from a model's config.json alone, before its weights and tokenizer are downloaded: the run tokenizes and
    # checks the data; the plan needs only its path (packed records, DPO's pairs counted).
    model_only = not environment and bool(cfg.checkpoint.init_from) and not has_weight_files(cfg.checkpoint.init_from)
    if cfg.objective.method == "dpo":  # a file of preference pairs, encoded by the --init-from model's tokenizer
        if not cfg.checkpoint.init_from and environment:  # a plan (another machine's) needs neither
            raise ConfigError("--method dpo tunes a trained model: give it with --init-from (its tokenizer encodes "
                              "the pairs, its weights are the reference)")
        if cfg.checkpoint.init_from and not model_only:
            d = cfg.data
            read_splits(d.source, d.val_data, d.val_fraction, bool(cfg.loop.eval_every), cfg.checkpoint.init_from,
                        cfg.model.seq_len)
    elif cfg.objective.method == "grpo":  # a file of prompts, encoded by the --init-from model's tokenizer
        if not cfg.checkpoint.init_from and environment:
            raise ConfigError("--method grpo trains a model that can already answer: give it with --init-from (its "
                              "tokenizer encodes the prompts and decodes the completions)")
        if cfg.checkpoint.init_from and not model_only:
            read_prompts(cfg.data.source, cfg.checkpoint.init_from, cfg.model.seq_len,
                         cfg.objective.max_completion_length)
    elif not model_only:
        check_source(cfg, vocab_given=vocab_given or "vocab_size" in given)
    if cfg.loop.epochs:  # the steps follow from the records; derived values (warmup) from the steps
        if "steps" in given or (args.config and "steps" in toml.get("loop", {})):
            raise ConfigError(f"--epochs {cfg.loop.epochs} and --steps {cfg.loop.steps} both say how long to train: "
                              "give one")
        cfg.loop.steps = cfg.loop.steps if model_only else epoch_steps(cfg)
    resolve(cfg)
    if torchrun:
        _note_torchrun_restarts(cfg, "max_restarts" in given or bool(args.config and "max_restarts" in
                                                                     toml.get("launch", {})))
    return cfg


def stated_by_user(given: dict[str, object], toml: dict[str, dict], path: str | None) -> dict[str, str]:
    """{key: how the user stated it} for the settings the command line or the TOML file gives (a flag wins)."""
    stated = {key: f"{key} in [{section}] of {path}" for section, values in toml.items() if isinstance(values, dict)
              for key in values}
    return {**stated, **{key: setting_for(key).flag for key in given}}


def model_named(cfg: Config, args: argparse.Namespace) -> str:
    """The run's model as the user gave it, for messages: its --init-from folder, its preset, or the model."""
    if cfg.checkpoint.init_from:
        return f"--init-from {cfg.checkpoint.init_from}"
    return args.preset or "this run's model"


def _note_torchrun_restarts(cfg: Config, given: bool) -> None:
    """Under torchrun its agent restarts the ranks: rank 0 says that a --max-restarts given to zerotrain does not."""
    if given and os.environ["RANK"] == "0":
        print(f"zerotrain: note: --max-restarts {cfg.launch.max_restarts} is for zerotrain's own launcher; under "
              f"torchrun, restarts are torchrun's --max-restarts ({os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0')} "
              "for this job)", file=sys.stderr, flush=True)


def by_section(values: dict[str, object]) -> dict[str, dict[str, object]]:
    """{key: value} as {section: {key: value}}, the shape of a TOML file."""
    out: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        out.setdefault(setting_for(key).section, {})[key] = value
    return out


# Ranks per core beyond which a CPU run only waits: start-up and rendezvous grow with the ranks, not the work.
MAX_CPU_RANKS_PER_CORE = 8


def check_environment(cfg: Config) -> None:
    """What this machine must have for the run: cores or CUDA devices for its ranks, the optional packages it uses."""
    cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc))
    if cfg.launch.device == "cpu" and local > MAX_CPU_RANKS_PER_CORE * cores:
        raise ConfigError(f"--nproc {local} starts {local} ranks on this machine's {cores} core"
                          f"{'s' * (cores != 1)}: more than {MAX_CPU_RANKS_PER_CORE * cores} "
                          f"({MAX_CPU_RANKS_PER_CORE} per core) only wait on each other; spread them over machines "
                          "with torchrun")
    if cfg.launch.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available on this machine")
        # Under torchrun nproc is the world; this machine runs LOCAL_WORLD_SIZE of its ranks.
        if local > torch.cuda.device_count():
            raise ConfigError(f"--nproc {local} exceeds the {torch.cuda.device_count()} CUDA devices here")
    if cfg.launch.linear_attention_kernel == "fla" and importlib.util.find_spec("fla") is None:
        raise ConfigError("--linear-attention-kernel fla needs the flash-linear-attention package: pip install "
                          "flash-linear-attention, or give auto")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'zerotrain[tb]'")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb {cfg.logging.wandb} needs the wandb package: pip install 'zerotrain[wandb]'")


def reference_table() -> str:
    """The training reference in docs/reference.md: every setting's flag, TOML table and key, default and meaning."""
    rows = ["| flag | TOML | default | meaning |", "| --- | --- | --- | --- |"]
    for s in declared():
        flag = f"`{s.flag}` / `--no-{s.flag[2:]}`" if s.type is bool else f"`{s.flag}`"
        scope = f"; applies to {s.scope}" if s.scope else ""
        rows.append(f"| {flag} | `[{s.section}] {s.key}` | `{shown_default(s, s.default)}` | {s.help}{scope} |")
    return "\n".join(rows)
