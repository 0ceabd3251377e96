"""`zerotrain bench spikes`: the spike guard's detections and false alarms, replayed over recorded training runs.

The guard decides on two global numbers per step, the all-reduced loss and gradient norm, so its decisions on a
run can be replayed exactly from that run's (step, loss, gradient norm) trace, at any window, without training
again. This benchmark records each trace once, with the guard out of the way (no spike test fires; a non-finite
step ends the trace), and keeps it under <out>/traces/; later calls replay the product's AnomalyDetector over
what is there (--replay-only records nothing):

  - false alarms: every step the guard refuses in an ordinary run of each shape (--seeds runs of --steps steps,
    on one rank: the guard's inputs are global values, and the split does not change the math); a refused step
    is not accepted and the run goes on, so one odd stretch can count more than once;
  - detection: runs of the same shapes whose update of step N is made with an lr_spike of factor F on rank 0
    (ZEROTRAIN_FAULTS), recorded to step N + POST_SPIKE_STEPS; detected when the guard refuses step N + 1, the
    first step that sees the spiked update (a rollback then restores a checkpoint from before N). On 2 ranks
    (--spike-nproc, the default) rank 0's update is its shard, half the model, as in issue 27's run: the GPT-2
    shapes then go back to about ln(V), their gradient norm not always far out; on 1 rank the whole model is
    spiked and its loss mostly blows up past ln(V). A spike whose step N + 1 falls in the window's warm-up (the
    outlier test waits for a full window) is counted apart;
  - the default configuration's first steps (issue 37): `zerotrain train` itself, stopped after HEALTHY_STEPS,
    of HEALTHY_SHAPES from scratch, with a long warmup and after --init-from (--healthy-seeds runs each): every
    step the guard refuses there, where the loss sits a little below ln(V) for hundreds of steps.
Each is also replayed without the guard's ruin test (no vocabulary: the rule before issue 27), without its
outlier test (what the ruin test catches alone) and with issue 27's ruin test (the rule before issue 37), for
comparison.

The shapes span widths, depths, both architectures and vocabularies of 64 to 2,048, on synthetic data and on
python-stdlib (the bench preset, whose 5 seeds x 300 steps are the false-alarm target of issue 27).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time

from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE, PRESETS, Config, GuardConfig, resolve, setting_for, validate
from zerotrain.errors import ConfigError, ZeroTrainError
from zerotrain.parallel import Comm
from zerotrain.training.guard import RUIN_SIGMAS

from .report import report_header, write_report

SCHEMA = "zerotrain.bench.spikes"
# name -> settings (keys as in the TOML), at 1 rank; on more, the accumulation is divided so that the global
# batch (8 or 16 sequences) stays.
SHAPES = {
    # issue 27's model: 2 layers, 2 heads, width 40, vocabulary 97, lr 1e-3 (2 ranks x micro 2 x accum 2 there)
    "gpt2-2x40-v97": dict(PRESETS["tiny"], n_head=2, n_embd=40, vocab_size=97, data="synthetic", micro_batch=2,
                          accum=4, lr=1e-3),
    "llama-tiny-v64": dict(PRESETS["llama-tiny"], data="synthetic", micro_batch=2, accum=4),
    "gpt2-4x64-v2048": dict(PRESETS["tiny"], n_layer=4, n_head=4, n_embd=64, seq_len=32, vocab_size=2048,
                            data="synthetic", micro_batch=4, accum=2),
    "bench-v256": dict(PRESETS["bench"], data="python-stdlib", micro_batch=8, accum=2),
}
DEFAULTS = dict(spikes="9,30,100,250", factors="1000,100", windows="5,10,20", spike_nproc="2")
POST_SPIKE_STEPS = 5  # steps recorded after a spike: the first is the one the guard must refuse
# Only a non-finite step ends a run: a window below 5 turns the outlier and ruin tests off, and no loss is 1e12 x the
# last one.
GUARD_OFF = {"spike_factor": 1e12, "spike_window": 1, "on_anomaly": "abort"}
Spike = tuple[int, float, int]  # (step N, factor F, world size); rank 0's update of step N is spiked


# Issue 37: the default configuration's first steps. `zerotrain train --nproc 2 --steps 100000` warms up over a tenth
# of its schedule, so for its first hundreds of steps the learning rate is a few percent of --lr and the loss falls by
# about its own noise: a hard batch there is no return to ln(V). Recorded with the command itself, the guard out of the
# way, on one rank with --accum 2 (the global batch of --nproc 2), stopped by a ZEROTRAIN_FAULTS sigterm after
# HEALTHY_STEPS steps; each shape from scratch (a tenth of 100,000 steps of warmup), with a long warmup (a tenth of
# 1,000,000) and fine-tuned (--init-from its own checkpoint after INIT_STEPS steps: lr 2e-5, 3% warmup).
HEALTHY_SHAPES = {
    "default-v256": [],  # nothing but the defaults: GPT-2 2 x 32 on python-stdlib, V = 256
    "default-llama-v256": ["--arch", "llama"],
    "default-4x64-v256": ["--n-layer", "4", "--n-embd", "64"],
}
HEALTHY_STARTS = {"scratch": ["--steps", "100000"], "long-warmup": ["--steps", "1000000"],
                  "init-from": ["--steps", "100000"]}
HEALTHY_STEPS = 300
INIT_STEPS = 1000
HEALTHY_VOCAB = 256  # python-stdlib's bytes
GUARD_OFF_FLAGS = ["--spike-factor", "1e12", "--spike-window", "1", "--on-anomaly", "abort"]


class _Enough(Exception):
    """Raised by the recording hook once a spiked run has gone POST_SPIKE_STEPS past its spike."""


def add_parser(benches) -> None:
    p = benches.add_parser(
        "spikes", help="the spike guard's detections and false alarms, replayed over recorded runs of several shapes",
        description="Record (once, under <out>/traces) ordinary runs and runs with a planted lr_spike for each "
                    "shape, with the guard out of the way; replay the guard over every trace at each window; "
                    "report false alarms and detections per shape, beside the guard without its ruin test "
                    "and without its outlier test (JSON and markdown).")
    p.add_argument("--out", default="", help="folder for the traces and the report (default runs/spikes)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--seeds", type=checked(int, POSITIVE), default=5, help="ordinary runs per shape (default 5)")
    p.add_argument("--steps", type=checked(int, POSITIVE), default=300, help="steps per run (default 300)")
    p.add_argument("--spike-seeds", type=checked(int, POSITIVE), default=2,
                   help="seeds (the first ones) of the spiked runs (default 2)")
    for flag, what in (("spikes", "steps N whose update is spiked"), ("factors", "lr_spike factors"),
                       ("windows", "--spike-window values replayed"),
                       ("spike-nproc", "world sizes of the spiked runs (rank 0 spiked: on 2, half the model)")):
        p.add_argument(f"--{flag}", default=DEFAULTS[flag.replace("-", "_")],
                       help=f"{what}, separated by commas (default {DEFAULTS[flag.replace('-', '_')]})")
    p.add_argument("--healthy-seeds", type=checked(int, NON_NEGATIVE), default=5,
                   help=f"runs per shape and start of the default configuration's first {HEALTHY_STEPS} steps "
                        "(default 5; 0: none)")
    p.add_argument("--replay-only", action="store_true", help="record nothing: replay the traces already there")
    p.add_argument("--time-limit", type=float, default=7200.0, help="wall-clock limit of each recording job in s")
    p.set_defaults(func=cmd_spikes)


def _numbers(text: str, flag: str, kind=int) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--{flag} {text!r}: expected positive numbers separated by commas")
    return values


def shape_config(shape: str, seed: int, steps: int, nproc: int = 1) -> Config:
    """The run of `shape` at `seed` on `nproc` ranks of one thread: no checkpoints, the guard out of the way."""
    accum = SHAPES[shape]["accum"]
    if accum % nproc:
        raise ConfigError(f"--spike-nproc {nproc} does not divide {shape}'s accumulation {accum} (its global batch)")
    cfg = Config()
    settings = {**SHAPES[shape], **GUARD_OFF, "accum": accum // nproc, "seed": seed, "steps": steps,
                "nproc": nproc, "threads": 1, "check_every": 0, "progress": False}
    for key, value in settings.items():
        s = setting_for(key)
        setattr(getattr(cfg, s.section), s.name, value)
    return resolve(validate(cfg))


def trace_name(shape: str, seed: int, steps: int, spike: Spike | None) -> str:
    what = "ordinary" if spike is None else f"lr_spike{spike[1]:g}@{spike[0]}-rank0of{spike[2]}"
    return f"{shape}-seed{seed}-{steps}steps-{what}.json"


def record_job(cfg: Config, comm: Comm, *, runs: list[tuple[int, Spike | None, str]]) -> None:
    """Train each (seed, spike, path) of `runs`; rank 0 writes its trace to path: [[step, loss, grad_norm], ...].

    A spiked run stops POST_SPIKE_STEPS after its spike; a non-finite step (refused) ends a trace with it.
    """
    from zerotrain.training.faults import ENV
    from zerotrain.training.loop import train

    for seed, spike, path in runs:
        run_cfg = Config.from_dict(cfg.to_dict())
        run_cfg.loop.seed = seed
        run_cfg.logging.metrics = path + ".metrics.jsonl"
        if comm.rank == 0 and os.path.exists(run_cfg.logging.metrics):
            os.remove(run_cfg.logging.metrics)
        os.environ[ENV] = "" if spike is None else f"lr_spike@step={spike[0]},factor={spike[1]:g},rank=0"
        stop_at = None if spike is None else spike[0] + POST_SPIKE_STEPS

        def enough(step: int, _engine, stop_at=stop_at) -> None:
            if stop_at is not None and step >= stop_at:  # every rank, at the same step
                raise _Enough

        ended = None
        try:
            train(run_cfg, comm, after_update=enough, announce=False)
        except _Enough:
            pass
        except ZeroTrainError as e:  # --on-anomaly abort: a non-finite loss or gradient norm
            ended = str(e)
        os.environ.pop(ENV, None)
        if comm.rank == 0:
            with open(run_cfg.logging.metrics) as f:
                steps = [[r["step"], r["loss"], r["grad_norm"]] for r in map(json.loads, f) if "event" not in r]
            if ended is not None:
                steps.append([len(steps) + 1, math.nan, math.nan])
            with open(path, "w") as f:
                json.dump({"seed": seed, "spike": spike, "ended": ended, "config": run_cfg.to_dict(),
                           "steps": steps}, f)
            os.remove(run_cfg.logging.metrics)


def healthy_name(shape: str, start: str, seed: int) -> str:
    return f"{shape}-{start}-seed{seed}-first{HEALTHY_STEPS}.json"


def _zerotrain(args: list[str], out: str, env: dict, time_limit: float) -> list[list[float]]:
    """Run `zerotrain train ARGS --out OUT` in a fresh process; its (step, loss, gradient norm) per step."""
    cmd = [sys.executable, "-m", "zerotrain", "train", *args, "--nproc", "1", "--accum", "2", "--threads", "1",
           "--no-progress", "--overwrite", "--out", out, *GUARD_OFF_FLAGS]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=time_limit)
    if done.returncode != 0:
        raise ZeroTrainError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [[r["step"], r["loss"], r["grad_norm"]] for r in map(json.loads, f) if "event" not in r]


def record_healthy(folder: str, shapes: list[str], starts: list[str], seeds: int, time_limit: float) -> None:
    """Record the runs of `shapes` x `starts` (of HEALTHY_STARTS) at seeds 0..seeds-1 not in `folder` yet (see
    HEALTHY_SHAPES)."""
    from zerotrain.training.faults import ENV

    stop = {ENV: f"sigterm@step={HEALTHY_STEPS}"}
    for start in starts:
        schedule = HEALTHY_STARTS[start]
        for shape in shapes:
            base = os.path.join(folder, f"{shape}-base{INIT_STEPS}")
            for seed in range(seeds):
                path = os.path.join(folder, healthy_name(shape, start, seed))
                if os.path.exists(path):
                    continue
                args = [*HEALTHY_SHAPES[shape], *schedule, "--seed", str(seed)]
                if start == "init-from":
                    init = os.path.join(base, "checkpoints", f"step_{INIT_STEPS:08d}")
                    if not os.path.isdir(init):
                        print(f"zerotrain bench spikes: training {shape} {INIT_STEPS} steps to fine-tune", flush=True)
                        _zerotrain([*HEALTHY_SHAPES[shape], "--steps", str(INIT_STEPS), "--ckpt-every",
                                    str(INIT_STEPS)], base, {ENV: ""}, time_limit)
                    args = [*schedule, "--seed", str(seed), "--init-from", init]
                print(f"zerotrain bench spikes: recording {shape} {start} seed {seed}", flush=True)
                run = path + ".run"
                steps = _zerotrain(args, run, stop, time_limit)
                with open(path, "w") as f:
                    json.dump({"shape": shape, "start": start, "seed": seed, "vocab_size": HEALTHY_VOCAB,
                               "args": args, "steps": steps}, f)
                shutil.rmtree(run)


def replay(steps: list[list[float]], window: int, vocab_size: int | None, **bars) -> list[tuple[int, str]]:
    """The (step, reason) of every step the guard refuses, at --spike-window `window`; the others are accepted.

    `vocab_size` None replays the guard without its ruin test; `bars` are AnomalyDetector's keyword arguments.
    """
    from zerotrain.training.guard import AnomalyDetector

    detector = AnomalyDetector(GuardConfig().spike_factor, window, vocab_size=vocab_size, **bars)
    refused = []
    for step, loss, grad_norm in steps:
        anomaly = detector.check(int(step), loss, grad_norm, [])
        if anomaly:
            refused.append((int(step), anomaly.reason))
        else:
            detector.accept(int(step), loss, grad_norm)
    return refused


def _record_missing(shape: str, wanted: list[tuple[int, Spike | None]], folder: str, steps: int,
                    time_limit: float) -> None:
    """Record the traces of `wanted` (seed, spike) not in `folder` yet: one job per world size."""
    from zerotrain.data.resolve import check_source
    from zerotrain.runtime.launch import run_job

    by_nproc: dict[int, list] = {}
    for seed, spike in wanted:
        path = os.path.join(folder, trace_name(shape, seed, steps, spike))
        if not os.path.exists(path):
            by_nproc.setdefault(1 if spike is None else spike[2], []).append((seed, spike, path))
    for nproc, runs in sorted(by_nproc.items()):
        cfg = shape_config(shape, 0, steps, nproc)
        check_source(cfg, vocab_given=True)  # prepares python-stdlib's cache before the ranks start
        print(f"zerotrain bench spikes: recording {len(runs)} run(s) of {shape} on {nproc} rank(s)", flush=True)
        run_job(functools.partial(record_job, runs=runs), cfg, time_limit=time_limit)


# The guard, and the guard without each of its tests against the trend: without the ruin test it is the rule before
# issue 27; without the outlier test (the loss and the gradient norm both far out), what the ruin test sees alone;
# with issue 27's ruin test, which let a loss give back half of any headroom above 5 sd (the rule before issue 37).
VARIANTS = {"guard": {}, "without_ruin_test": {"vocab_size": None},
            "without_outlier_test": {"loss_sigmas": math.inf},
            "issue_27_ruin_test": {"learned_sigmas": RUIN_SIGMAS, "learned_fraction": 0.0}}


def _detection(trace: dict, window: int, vocab_size: int | None, **bars) -> dict:
    spike, factor, nproc = trace["spike"]
    after = [(step, reason) for step, reason in replay(trace["steps"], window, vocab_size, **bars) if step > spike]
    return {"seed": trace["seed"], "spike_step": spike, "factor": factor, "nproc": nproc,
            "in_warmup": spike + 1 <= window,
            "refused": after[0][0] if after else None, "reason": after[0][1] if after else None,
            "detected": bool(after) and after[0][0] == spike + 1}


def summarize(shape: str, traces: list[dict], windows: list[int]) -> list[dict]:
    """One row per window: false alarms over the ordinary traces and detections over the spiked ones, for each
    of VARIANTS."""
    vocab = SHAPES[shape]["vocab_size"]
    ordinary = [t for t in traces if t["spike"] is None]
    spiked = [t for t in traces if t["spike"] is not None]
    rows = []
    for window in windows:
        row = {"shape": shape, "window": window, "vocab_size": vocab, "ordinary_runs": len(ordinary),
               "ordinary_steps": sum(len(t["steps"]) for t in ordinary)}
        for name, change in VARIANTS.items():
            bars = {"vocab_size": vocab, **change}
            row[name] = {
                "false_alarms": [{"seed": t["seed"], "step": step, "reason": reason}
                                 for t in ordinary for step, reason in replay(t["steps"], window, **bars)],
                "detections": [_detection(t, window, **bars) for t in spiked]}
        rows.append(row)
    return rows


def summarize_healthy(traces: list[dict], windows: list[int]) -> list[dict]:
    """One row per (shape, start, window) of the HEALTHY_SHAPES runs: the steps refused, for each of VARIANTS."""
    rows = []
    for shape in HEALTHY_SHAPES:
        for start in HEALTHY_STARTS:
            runs = [t for t in traces if (t["shape"], t["start"]) == (shape, start)]
            for window in windows if runs else []:
                row = {"shape": shape, "start": start, "window": window, "runs": len(runs),
                       "steps": sum(len(t["steps"]) for t in runs)}
                for name, change in VARIANTS.items():
                    bars = {"vocab_size": HEALTHY_VOCAB, **change}
                    row[name] = [{"seed": t["seed"], "step": step, "reason": reason}
                                 for t in runs for step, reason in replay(t["steps"], window, **bars)]
                rows.append(row)
    return rows


def healthy_table(rows: list[dict]) -> str:
    """Markdown: the steps refused in the default configuration's first steps, per shape, start and window."""
    lines = [f"The default configuration's first {HEALTHY_STEPS} steps (no fault): steps refused. Each cell: the "
             "guard, without its ruin test, without its outlier test, with issue 27's ruin test (before issue 37), "
             "separated by ' \\| '.", "", "| shape | start | window | runs | steps | refused |", "|---|---|---|---|---|---|"]
    for r in rows:
        refused = " \\| ".join(str(len(r[v])) for v in VARIANTS)
        lines.append(f"| {r['shape']} | {r['start']} | {r['window']} | {r['runs']} | {r['steps']} | {refused} |")
    alarms = [(r["shape"], r["start"], r["window"], a) for r in rows for a in r["guard"]]
    if alarms:
        lines.append("\nfalse alarms of the guard:")
        lines += [f"- {s} {st} window {w}: seed {a['seed']} step {a['step']}: {a['reason']}" for s, st, w, a in alarms]
    return "\n".join(lines) + "\n"


def _caught(detections: list[dict], kind: tuple[float, int]) -> str:
    """'refused at N+1 / runs' for one (factor, world size), the runs whose N+1 falls in the warm-up in brackets."""
    runs = [d for d in detections if (d["factor"], d["nproc"]) == kind]
    late = [d for d in runs if d["in_warmup"]]
    said = f"{sum(d['detected'] for d in runs if not d['in_warmup'])}/{len(runs) - len(late)}"
    return said + (f" ({sum(d['detected'] for d in late)}/{len(late)})" if late else "")


def table(rows: list[dict], kinds: list[tuple[float, int]]) -> str:
    """Markdown: per shape and window, false alarms and spikes refused at N + 1, for the guard and its VARIANTS;
    then every miss of the guard and every false alarm."""
    heads = " | ".join(f"x{f:g} on rank 0 of {n}" for f, n in kinds)
    lines = ["Spiked runs refused at step N+1 / spiked runs past the window's warm-up (in brackets: those whose "
             "step N+1 falls in the warm-up). Each cell: the guard, without its ruin test (the rule before issue "
             "27), without its outlier test (the ruin test's own part), with issue 27's ruin test (the rule before "
             "issue 37), separated by ' \\| '.", "",
             f"| shape | window | ordinary steps | false alarms | {heads} |", "|---|---|---|---|" + "---|" * len(kinds)]
    for r in rows:
        alarms = " \\| ".join(str(len(r[v]["false_alarms"])) for v in VARIANTS)
        cells = " | ".join(" \\| ".join(_caught(r[v]["detections"], k) for v in VARIANTS) for k in kinds)
        lines.append(f"| {r['shape']} | {r['window']} | {r['ordinary_steps']} | {alarms} | {cells} |")
    missed = [(r["shape"], r["window"], d) for r in rows for d in r["guard"]["detections"] if not d["detected"]]
    if missed:
        lines.append("\nmissed by the guard (refused: the first refused step after the spike, if any):")
        lines += [f"- {s} window {w}: seed {d['seed']} lr_spike x{d['factor']:g} at step {d['spike_step']} on rank 0 "
                  f"of {d['nproc']}{' (in warm-up)' if d['in_warmup'] else ''}: refused {d['refused']}"
                  for s, w, d in missed]
    alarms = [(r["shape"], r["window"], a) for r in rows for a in r["guard"]["false_alarms"]]
    if alarms:
        lines.append("\nfalse alarms of the guard:")
        lines += [f"- {s} window {w}: seed {a['seed']} step {a['step']}: {a['reason']}" for s, w, a in alarms]
    return "\n".join(lines) + "\n"


def cmd_spikes(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        raise ConfigError(f"--shapes {args.shapes!r}: unknown shape(s) {', '.join(unknown)} "
                          f"(known: {', '.join(SHAPES)})")
    spikes, factors = _numbers(args.spikes, "spikes"), _numbers(args.factors, "factors", float)
    windows, world_sizes = _numbers(args.windows, "windows"), _numbers(args.spike_nproc, "spike-nproc")
    if max(spikes) + POST_SPIKE_STEPS > args.steps:
        raise ConfigError(f"--spikes {args.spikes}: step {max(spikes)} + {POST_SPIKE_STEPS} is past "
                          f"--steps {args.steps}")
    out = args.out or os.path.join("runs", "spikes")
    folder = os.path.join(out, "traces")
    os.makedirs(folder, exist_ok=True)
    kinds = [(f, n) for n in world_sizes for f in factors]
    wanted = [(seed, None) for seed in range(args.seeds)]
    wanted += [(seed, (step, f, n)) for seed in range(args.spike_seeds) for f, n in kinds for step in spikes]
    for shape in [] if args.replay_only else shapes:  # every trace first: the replay takes a moment, training not
        _record_missing(shape, wanted, folder, args.steps, args.time_limit)
    if args.healthy_seeds and not args.replay_only:
        record_healthy(folder, list(HEALTHY_SHAPES), list(HEALTHY_STARTS), args.healthy_seeds, args.time_limit)
    rows = []
    for shape in shapes:
        traces = []
        for seed, spike in wanted:
            path = os.path.join(folder, trace_name(shape, seed, args.steps, spike))
            if os.path.exists(path):
                with open(path) as f:
                    trace = json.load(f)
                trace["spike"] = None if trace["spike"] is None else tuple(trace["spike"])
                traces.append(trace)
        rows += summarize(shape, traces, windows)
    healthy = []
    for shape in HEALTHY_SHAPES:
        for start in HEALTHY_STARTS:
            for seed in range(args.healthy_seeds):
                path = os.path.join(folder, healthy_name(shape, start, seed))
                if os.path.exists(path):
                    with open(path) as f:
                        healthy.append(json.load(f))
    healthy_rows = summarize_healthy(healthy, windows)
    report = {**report_header(SCHEMA), "shapes": {s: SHAPES[s] for s in shapes}, "steps": args.steps,
              "post_spike_steps": POST_SPIKE_STEPS, "rows": rows,
              "healthy": {"shapes": HEALTHY_SHAPES, "starts": HEALTHY_STARTS, "steps": HEALTHY_STEPS,
                          "rows": healthy_rows},
              "wall_s": time.perf_counter() - t0}
    write_report(out, "spikes", report, table(rows, kinds) + "\n" + healthy_table(healthy_rows))
    return 0
