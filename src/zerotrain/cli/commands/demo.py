"""`zerotrain demo`: tiny GPT, 4 ranks, 20 steps, checkpoint at 10, the four invariants and a bitwise resume.

With `--tp 2` the 4 ranks are a TP 2 x DP 2 mesh: each block's heads and MLP split across 2 ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

from zerotrain.checkpoint.verify import failure_message, first_failure, verify_together
from zerotrain.config import Config
from zerotrain.errors import ConfigError, InvariantError
from zerotrain.model import ARCH_NAMES
from zerotrain.parallel import Comm
from zerotrain.parallel.parts import parts_for
from zerotrain.training.loop import train

DEMO_DEFAULTS = {
    "nproc": 4, "steps": 20, "micro_batch": 4, "accum": 2, "check_every": 5,
    "progress": False, "ckpt_every": 10, "lr": 1e-2, "on_anomaly": "abort",
    "data": "synthetic",  # the lesson's Markov chain: learnable in 20 steps, nothing to read
}


def add_parser(sub) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = sub.add_parser("demo", help="the self-verifying end-to-end demo (no arguments needed)")
    add_training_flags(p, defaults=DEMO_DEFAULTS)
    p.add_argument("--time-limit", type=float, default=120.0, help="hard wall-clock limit in seconds")
    p.add_argument("--resume-from", type=int, default=10, help="step whose checkpoint the resume starts from")
    p.set_defaults(func=cmd_demo)


def demo_job(cfg: Config, comm: Comm) -> dict:
    """Train from scratch, then again from the step-k checkpoint with fresh objects; compare bitwise."""
    first = train(cfg, comm, announce=False)
    for path in first.checkpoints:  # invariant (d): each file read by one rank, against the sha256 taken as written
        bad = first_failure(verify_together(path, comm))
        if bad is not None:
            raise InvariantError(f"invariant (d) failed: {failure_message(path, bad)}")
    resumed_cfg = copy.deepcopy(cfg)
    resumed_cfg.checkpoint.resume = os.path.join(cfg.checkpoint.dir, f"step_{cfg.checkpoint.every:08d}")
    resumed_cfg.checkpoint.every, resumed_cfg.checkpoint.final_save = 0, False  # the first run's stay as they are
    resumed_cfg.logging.metrics = os.path.join(cfg.logging.out, "metrics-resumed.jsonl")
    second = train(resumed_cfg, comm, announce=False)
    tail = {r["step"]: r["loss"] for r in first.records if r["step"] > second.start_step}
    same_losses = all(tail[r["step"]] == r["loss"] for r in second.records) and len(tail) == len(second.records)
    same_params = first.digests == second.digests
    if not (same_losses and same_params):
        raise InvariantError(
            f"resume check failed: run resumed at step {second.start_step} differs from the uninterrupted run "
            f"(losses {'equal' if same_losses else 'differ'}, parameters {'equal' if same_params else 'differ'})"
        )
    m = first.memory
    return {
        "world_size": comm.world_size,
        "tp": cfg.parallel.tp,
        "steps": cfg.loop.steps,
        "param_count": first.param_count,
        "global_batch": cfg.global_batch,
        "losses": [r["loss"] for r in first.records],
        "grad_norms": [r["grad_norm"] for r in first.records],
        "param_hashes": first.digests,
        "param_norms": first.param_norms,
        "optimizer_bytes": m.per_rank,
        "optimizer_bytes_max": m.max,
        "optimizer_bytes_mean": m.mean,
        "expected_bytes": m.expected,
        "bytes_per_value": m.bytes_per_value,
        "shard_numel": m.shard_numel,
        "memory_checked_every": cfg.loop.check_every,  # (c) measured then and after the last step
        "refused_steps": len(first.rollbacks),
        "precision": cfg.parallel.precision,
        "checkpoints": first.checkpoints,
        "checkpoint_path": resumed_cfg.checkpoint.resume,
        "resumed_from_step": second.start_step,
        "resumed_losses": [r["loss"] for r in second.records],
        "resumed_param_hashes": second.digests,
        "resume_verified": True,
        "comm_calls_per_step": {k: v / cfg.loop.steps for k, v in first.comm_calls.items()
                                if k in ("reduce_scatter_grads", "all_gather_params", "all_gather_units",
                                         "prefetch_units", "all_reduce_stats", "all_reduce_tp_activations",
                                         "all_reduce_tp_grads")},
        "param_bytes": first.per_rank["param_bytes"],
        "invariants": {"a_finite_loss": True, "b_no_drift": True, "c_zero1_memory": True,
                       "d_checkpoint_roundtrip": True},
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from zerotrain.cli.flags import config_from_args
    from zerotrain.runtime.launch import run_job
    from zerotrain.runtime.run_folder import prepare_run

    cfg = config_from_args(args)
    if not cfg.logging.out:
        cfg.logging.out = tempfile.mkdtemp(prefix="zerotrain-demo-")
    cfg.logging.metrics = ""
    if not (0 < args.resume_from < cfg.loop.steps):
        raise ConfigError(f"--resume-from {args.resume_from} must be between 1 and --steps - 1 ({cfg.loop.steps - 1})")
    cfg.checkpoint.every = args.resume_from
    cfg.checkpoint.resume = ""
    cfg = prepare_run(cfg)  # an --out holding an earlier run is refused, as for train
    os.makedirs(cfg.logging.out, exist_ok=True)
    mesh = f"TP {cfg.parallel.tp} x DP {cfg.dp} = " if cfg.parallel.tp > 1 else ""
    print(f"zerotrain demo: {mesh}{cfg.launch.nproc} ranks x micro-batch {cfg.loop.micro_batch} x accum {cfg.loop.accum} "
          f"(global batch {cfg.global_batch}), {cfg.loop.steps} steps, checkpoint every {cfg.checkpoint.every}")
    print(f"output folder: {cfg.logging.out}", flush=True)
    t0 = time.perf_counter()
    report = run_job(demo_job, cfg, time_limit=args.time_limit)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    report_path = os.path.join(cfg.logging.out, "report.json")
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    _print_report(report, cfg)
    print(f"report: {report_path}")
    return 0


def _print_report(rep: dict, cfg: Config) -> None:
    W = rep["world_size"]
    print(f"\nmodel: {ARCH_NAMES[cfg.model.arch]} {cfg.model.n_layer} layers, {cfg.model.n_head} heads, width {cfg.model.n_embd}, "
          f"vocab {cfg.model.vocab_size}, seq {cfg.model.seq_len}: P = {rep['param_count']:,} parameters")
    print("\nstep   loss      grad_norm")
    for i, (loss, gn) in enumerate(zip(rep["losses"], rep["grad_norms"]), start=1):
        mark = "  <- checkpoint" if f"step_{i:08d}" in " ".join(rep["checkpoints"]) else ""
        print(f"{i:4d}   {loss:.5f}   {gn:.5f}{mark}")
    T = rep["tp"]
    # the digests' hex: replicated parameters (2 words), then this rank's TP slices (2 words)
    print("\nrank   replicated digest   TP-slice digest    parameter norm   parameter bytes   optimizer bytes")
    for r in range(W):
        words = rep["param_hashes"][r].split("-")
        sliced = words[2][:16] if T > 1 else "-"
        print(f"{r:4d}   {words[0][:16]}    {sliced:<16}   {rep['param_norms'][r]:.6f}         "
              f"{rep['param_bytes'][r]:>9,}         {rep['optimizer_bytes'][r]:,}")
    print(f"optimizer bytes: max {rep['optimizer_bytes_max']:,}, mean {rep['optimizer_bytes_mean']:,.0f}, "
          f"ZeRO-1 formula {rep['bytes_per_value']} x {'padded P / N' if T == 1 else 'padded local P / DP'} = {rep['bytes_per_value']} x {rep['shard_numel']:,}"
          f" = {rep['expected_bytes']:,} ({cfg.parallel.precision}: "
          + ("moments only, the fp32 master is the parameter buffer" if rep["bytes_per_value"] == 8
             else "fp32 master + moments") + ")")
    calls = rep["comm_calls_per_step"]
    # stage 3 gathers each unit when it is used (each block twice, the root once) instead of one round after the update
    unit_gathers = calls.get("all_gather_units", 0) + calls.get("prefetch_units", 0)  # prefetched: --overlap on
    gathers = (f"{unit_gathers:g} unit all-gathers" if parts_for(cfg).placement.gathers_units
               else f"{calls.get('all_gather_params', 0):g} all-gather")
    print(f"collectives per optimizer step: {calls.get('reduce_scatter_grads', 0):g} reduce-scatter, "
          f"{gathers}, {calls.get('all_reduce_stats', 0):g} scalar all-reduce "
          f"(accum {cfg.loop.accum})" + (f"; per TP rank {calls.get('all_reduce_tp_activations', 0):g} activation and "
                                        f"{calls.get('all_reduce_tp_grads', 0):g} gradient all-reduces"
                                        if T > 1 else ""))
    print("\ninvariants")
    refused = rep["refused_steps"]
    every = rep["memory_checked_every"]
    for text in (f"(a) finite loss on every rank, all {rep['steps']} steps"
                 + (f" ({refused} refused and rolled back)" if refused else ""),
                 f"(b) parameters bitwise identical on all {W} ranks" if T == 1 else
                 "(b) replicas bitwise equal (TP slices per DP group)",
                 "(c) AdamW's state = ZeRO-1 formula, every rank, at step "
                 + (f"{every}, {2 * every}, ..., " if every else "") + f"{rep['steps']}",
                 f"(d) checkpoints verify: sha256 as written = as read ({len(rep['checkpoints'])} saved)"):
        print(f"  {text + ' ':.<70} PASS")
    print(f"\nRESUME VERIFIED: resumed from {os.path.basename(rep['checkpoint_path'])}, trained to step "
          f"{rep['steps']} again: losses of steps {rep['resumed_from_step'] + 1}-{rep['steps']} and final parameters "
          f"are bitwise identical to the uninterrupted run")
    print(f"wall time: {rep['wall_s']:.1f} s")
