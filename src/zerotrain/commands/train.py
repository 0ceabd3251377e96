"""`zerotrain train`: resolve the run folder and the resume point, launch the ranks, report the result."""

from __future__ import annotations

import argparse
import os

from .. import checkpoint
from ..config import Config, ConfigError
from ..flags import add_training_flags, config_from_args
from ..launch import in_torchrun, run_job
from ..train import resolve_paths, train_job


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT data-parallel with ZeRO-1")
    add_training_flags(p)
    p.set_defaults(func=cmd_train)


def check_resume(cfg: Config) -> None:
    """Resolve --resume and reject a missing or incompatible checkpoint before any worker starts."""
    spec = cfg.checkpoint.resume
    if spec and spec != "auto" and not os.path.isdir(spec):
        raise ConfigError(f"--resume {spec}: no such checkpoint folder")
    path = checkpoint.resolve_resume(spec, cfg.checkpoint.dir)
    if path is None:
        cfg.checkpoint.resume = ""
        return
    try:
        manifest = checkpoint.read_manifest(path)
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume {spec}: {e}") from None
    problem = checkpoint.incompatibility(manifest, vars(cfg.model))
    if problem:
        raise ConfigError(f"--resume {path}: incompatible model: {problem}")
    if manifest["step"] > cfg.run.steps:
        raise ConfigError(f"--resume {path}: checkpoint is at step {manifest['step']}, past --steps {cfg.run.steps}")
    cfg.checkpoint.resume = path


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if in_torchrun():  # torchrun decides the world; --nproc does not apply
        cfg.run.nproc = int(os.environ["WORLD_SIZE"])
    cfg = resolve_paths(cfg)
    check_resume(cfg)
    summary = run_job(train_job, cfg)
    if in_torchrun() and os.environ["RANK"] != "0":
        return 0
    last = summary["records"][-1] if summary["records"] else None
    print(f"zerotrain: trained to step {cfg.run.steps} on {cfg.run.nproc} rank(s); "
          + (f"final loss {last['loss']:.4f}; " if last else "")
          + f"metrics {cfg.run.metrics}")
    for path in summary["checkpoints"][-1:]:
        print(f"zerotrain: last checkpoint {path}")
    return 0
