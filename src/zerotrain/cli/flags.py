"""The training flags every command shares, and how they become a validated Config."""

from __future__ import annotations

import argparse
import os

from zerotrain.config import Config, apply_preset, load_toml, merge, validate
from zerotrain.data import check_source
from zerotrain.errors import ConfigError

# flag -> (section, field, type, help)
TRAINING_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--nproc", "run", "nproc", int, "local ranks to spawn (ignored under torchrun)"),
    ("--tp", "run", "tp", int, "tensor-parallel degree: ranks that split each layer's heads and MLP (divides --nproc; "
                               "rank = dp_index x tp + tp_index)"),
    ("--steps", "run", "steps", int, "optimizer steps"),
    ("--micro-batch", "run", "micro_batch", int, "sequences per rank per micro-batch"),
    ("--accum", "run", "accum", int, "micro-batches per optimizer step"),
    ("--seed", "run", "seed", int, "seed of the model init and the data"),
    ("--device", "run", "device", str, "cpu (gloo) or cuda (NCCL)"),
    ("--precision", "run", "precision", str, "fp32, or bf16 parameters with an fp32 master shard"),
    ("--threads", "run", "threads", int, "torch threads per rank (0: cores / nproc)"),
    ("--bucket-mb", "run", "bucket_mb", float, "gradient bucket size in MiB"),
    ("--overlap", "run", "overlap", str, "communicate during compute: reduce-scatter in backward, all-gather in "
                                         "the next forward: on, off, or auto (on with CUDA, off on CPU)"),
    ("--check-every", "run", "check_every", int, "cross-rank drift check period in steps"),
    ("--timeout", "run", "timeout_s", float, "collective timeout in seconds: a rank that stops answering fails the job"),
    ("--eval-every", "run", "eval_every", int, "validation loss every K steps and at the end (0: never)"),
    ("--eval-batches", "run", "eval_batches", int, "fixed validation batches of DP replicas x micro-batch sequences"),
    ("--max-restarts", "run", "max_restarts", int, "restart the group after a worker dies, resuming from the newest "
                                                   "checkpoint that verifies (as torchrun's option)"),
    ("--out", "run", "out", str, "run folder (default runs/<timestamp>)"),
    ("--metrics", "run", "metrics", str, "metrics JSONL path (default <out>/metrics.jsonl)"),
    ("--n-layer", "model", "n_layer", int, "transformer blocks"),
    ("--n-head", "model", "n_head", int, "attention heads"),
    ("--n-embd", "model", "n_embd", int, "embedding width"),
    ("--seq-len", "model", "seq_len", int, "tokens per sequence"),
    ("--vocab-size", "model", "vocab_size", int, "vocabulary size (default: the data's; synthetic data: 64)"),
    ("--data", "data", "source", str, "python-stdlib (the default: this Python's standard library as bytes), "
                                      "synthetic, synthetic-varlen, a UTF-8 text file or folder, or token files "
                                      "(a folder with train.bin/val.bin from zerotrain prepare, nanoGPT or llm.c)"),
    ("--glob", "data", "glob", str, "a text folder's files (default **/*.txt)"),
    ("--val-fraction", "data", "val_fraction", float, "text: fraction of documents held out for validation (0.05)"),
    ("--data-cache", "data", "cache_dir", str, "where text inputs are prepared (default $ZEROTRAIN_CACHE or "
                                               "~/.cache/zerotrain)"),
    ("--lr", "optim", "lr", float, "peak learning rate"),
    ("--min-lr-ratio", "optim", "min_lr_ratio", float, "final learning rate as a fraction of --lr"),
    ("--warmup-steps", "optim", "warmup_steps", int, "linear warmup steps (default steps/10)"),
    ("--weight-decay", "optim", "weight_decay", float, "AdamW weight decay on matrices"),
    ("--grad-clip", "optim", "grad_clip", float, "clip the global gradient norm (0: off)"),
    ("--ckpt-dir", "checkpoint", "dir", str, "checkpoint folder (default <out>/checkpoints)"),
    ("--ckpt-every", "checkpoint", "every", int, "save every K steps (0: never)"),
    ("--ckpt-every-minutes", "checkpoint", "every_minutes", float, "save every M minutes of wall clock (0: never); "
                                                                  "with --ckpt-every, whichever comes due first"),
    ("--keep", "checkpoint", "keep", int, "committed checkpoints to keep (0: all)"),
    ("--resume", "checkpoint", "resume", str, "'auto' (the newest checkpoint that verifies, if any) or a checkpoint folder"),
    ("--on-anomaly", "guard", "on_anomaly", str, "rollback (restore the last checkpoint, skip the bad data) or abort"),
    ("--spike-factor", "guard", "spike_factor", float, "a loss above F x the median of the window is a spike"),
    ("--spike-window", "guard", "spike_window", int, "steps in the loss median the spike test uses"),
    ("--max-rollbacks", "guard", "max_rollbacks", int, "rollbacks allowed before the run stops with an error"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise ConfigError(f"{self.prog}: {message}")


def add_training_flags(p: argparse.ArgumentParser, defaults: dict[str, object] | None = None) -> None:
    p.add_argument("--config", help="TOML file with [model] [data] [optim] [run] [checkpoint] [guard] tables")
    p.add_argument("--preset", help="model size preset: tiny, bench, wide, gpt2")
    shown = Config()
    for key, value in (defaults or {}).items():  # a command's own defaults (the demo's) are the ones shown
        section, name = key.split(".")
        setattr(getattr(shown, section), name, value)
    for flag, section, name, typ, help_ in TRAINING_FLAGS:
        default = getattr(getattr(shown, section), name)
        shown_default = "" if "(default" in help_ else f" (default: {_show(flag, default)})"  # said in help_ itself
        p.add_argument(flag, type=typ, default=None, help=help_ + shown_default)
    p.add_argument("--no-pack", action="store_true", help="one document per sequence (padded, masked), not packed")
    p.add_argument("--no-overlap", action="store_true", help="the same as --overlap off")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--compile", action="store_true", help="compile the model with torch.compile")
    p.add_argument("--tensorboard", action="store_true", help="also log to <out>/tensorboard ('zerotrain[tb]')")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background while training goes on")
    p.add_argument("--overwrite", action="store_true", help="a fresh run may replace the checkpoints and metrics in its folder")
    p.set_defaults(_flag_defaults=defaults or {})


def config_from_args(args: argparse.Namespace) -> Config:
    """defaults <- subcommand defaults <- --config TOML <- --preset <- flags; then validate."""
    cfg = Config()
    overrides: dict[str, dict] = {}
    for key, value in args._flag_defaults.items():
        section, name = key.split(".")
        overrides.setdefault(section, {})[name] = value
    merge(cfg, overrides, origin="defaults")
    vocab_given = False  # by the user: --vocab-size or the TOML; otherwise the data decides
    if args.config:
        toml = load_toml(args.config)
        merge(cfg, toml, origin=args.config)
        vocab_given = "vocab_size" in toml.get("model", {})
    if args.preset:
        apply_preset(cfg, args.preset)
    given: dict[str, dict] = {}
    for flag, section, name, _, _ in TRAINING_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            given.setdefault(section, {})[name] = value
    if args.no_pack:
        given.setdefault("data", {})["pack"] = False
    if args.no_overlap:
        given.setdefault("run", {})["overlap"] = "off"
    if args.no_progress:
        given.setdefault("run", {})["progress"] = False
    if args.compile:
        given.setdefault("run", {})["compile"] = True
    if args.tensorboard:
        given.setdefault("run", {})["tensorboard"] = True
    if args.async_save:
        given.setdefault("checkpoint", {})["async_save"] = True
    if args.overwrite:
        given.setdefault("checkpoint", {})["overwrite"] = True
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):  # under torchrun: it decides the world
        given.setdefault("run", {})["nproc"] = int(os.environ["WORLD_SIZE"])
    merge(cfg, given, origin="command line")
    validate(cfg)
    check_source(cfg, vocab_given=vocab_given or "vocab_size" in given.get("model", {}))
    return cfg


def _show(flag: str, default) -> str:
    """A default as --help shows it: the empty string and -1 mean 'derived', said in words."""
    derived = {"--out": "runs/<timestamp>", "--metrics": "<out>/metrics.jsonl", "--ckpt-dir": "<out>/checkpoints",
               "--warmup-steps": "steps/10", "--resume": "none", "--threads": "cores / local ranks"}
    if flag in derived and default in ("", -1, 0):
        return derived[flag]
    return str(default)
