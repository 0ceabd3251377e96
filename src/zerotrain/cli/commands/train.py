"""`zerotrain train`: prepare the run folder and the resume point, launch the ranks, report and summarise."""

from __future__ import annotations

import argparse
import os
import sys

from zerotrain.cli.flags import add_training_flags, config_from_args
from zerotrain.config import Config, notes
from zerotrain.durable import write_json
from zerotrain.runtime.launch import in_torchrun, run_job
from zerotrain.runtime.run_folder import SUMMARY, prepare_run
from zerotrain.training.faults import ENV as FAULTS_ENV
from zerotrain.training.faults import Faults
from zerotrain.training.loop import train_job
from zerotrain.training.throughput import flop_rate


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT or Llama data- and tensor-parallel with ZeRO")
    add_training_flags(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # under torchrun, nproc is torchrun's world size
    Faults.parse(os.environ.get(FAULTS_ENV, "")).check_ranks(cfg.launch.nproc)
    if not in_torchrun() or os.environ["RANK"] == "0":
        for note in notes(cfg):
            print(f"zerotrain: note: {note}", file=sys.stderr, flush=True)
    result = run_job(train_job, cfg, prepare=prepare_run)
    if in_torchrun() and os.environ["RANK"] != "0":
        return 0
    summary = write_summary(result)
    last = result["records"][-1] if result["records"] else None
    stopped = result["stopped"]
    if stopped:
        saved = os.path.basename(stopped["checkpoint"]) if stopped["checkpoint"] else "nothing"
        print(f"zerotrain: stopped by {stopped['signal']} at step {stopped['step']}; saved {saved}; "
              "continue with --resume auto")
        return 0
    print(f"zerotrain: trained to step {summary['steps']} on {result['world_size']} rank(s); "
          + (f"final loss {last['loss']:.4f}; " if last else "")
          + f"metrics {result['config']['logging']['metrics']}")
    for path in result["checkpoints"][-1:]:
        print(f"zerotrain: last checkpoint {path}")
    print(f"zerotrain: summary {summary['path']}: " + summary_line(summary))
    return 0


def write_summary(result: dict) -> dict:
    """<out>/summary.json: the summary rank 0 made of the run (training.metrics.summarize), with its path."""
    summary = result["summary"]
    path = os.path.join(Config.from_dict(result["config"]).logging.out, SUMMARY)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, summary, durable=False)
    return {**summary, "path": path}


def summary_line(s: dict) -> str:
    mib = 2**20
    loss = f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, " if s["first_loss"] is not None else ""
    return (f"{s['steps']} steps, {loss}{s['tokens']:,} tokens, {s['wall_s']:.1f} s, "
            f"{len(s['checkpoints'])} checkpoint(s), {s['restarts']} restart(s), {s['rollbacks']} rollback(s); "
            f"per rank max/mean: params {s['max']['param_bytes'] / mib:.1f}/{s['mean']['param_bytes'] / mib:.1f} MiB, "
            f"grads {s['max']['grad_peak_bytes'] / mib:.1f}/{s['mean']['grad_peak_bytes'] / mib:.1f} MiB at most, "
            f"optimizer {s['max']['optimizer_bytes'] / mib:.1f}/{s['mean']['optimizer_bytes'] / mib:.1f} MiB, "
            f"peak RSS {s['max']['peak_rss_bytes'] / mib:.0f}/{s['mean']['peak_rss_bytes'] / mib:.0f} MiB"
            + (f", device {s['max']['peak_device_bytes'] / mib:.0f}/{s['mean']['peak_device_bytes'] / mib:.0f} MiB"
               if "peak_device_bytes" in s["max"] else "") + throughput_line(s["throughput"]))


def throughput_line(t: dict) -> str:
    """The median step's figures per rank, when the run has step records."""
    if t.get("tokens_per_s_per_rank") is None:
        return ""
    mfu = f", MFU {t['mfu']:.3g}" if t.get("mfu") is not None else ""
    return (f"; median step per rank: {t['tokens_per_s_per_rank']:,.0f} tokens/s, "
            f"{flop_rate(t['flops_per_s_per_rank'])}{mfu}")
