"""`zerotrain bench accum`: throughput vs accumulation steps at a fixed micro-batch, as JSON, a figure and a table.

Each point of the grid trains from the same initial parameters with the real training loop on real
ranks; the first --warmup steps of each point are not timed. Accumulation raises the effective batch
without more memory: samples/s saturates once the fixed per-step costs (collectives, optimizer) are
amortized, while optimizer steps/s falls roughly as 1/accum. Collective calls per optimizer step stay
constant, because the engine communicates once per step whatever the accumulation.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import time
from collections import Counter

from zerotrain.cli.figures import pyplot
from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, PRESETS, Config
from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm

from .report import percentile, report_header, write_json

SCHEMA = "zerotrain.accum-curve"
DEFAULT_GRID = "1,2,4,8,16"
# The figure is saved at exactly this size: FIGURE_SIZE_IN x FIGURE_DPI pixels (width, height).
FIGURE_SIZE_IN = (11.0, 4.5)
FIGURE_DPI = 100
# The collectives of one optimizer step; everything else (init broadcast, checks) happens once per run.
STEP_PURPOSES = ("reduce_scatter_grads", "all_reduce_stats", "all_gather_params")

ACCUM_DEFAULTS = {
    **PRESETS["bench"],
    "nproc": 2, "micro_batch": 8, "steps": 6, "check_every": 0, "progress": False,
    "data": "synthetic",  # timing, not learning: no corpus to prepare
}
# The tiny model and a few steps: the whole sweep in well under two minutes on two cores.
QUICK_DEFAULTS = {"nproc": 2, "micro_batch": 4, "steps": 5, "check_every": 0, "progress": False,
                  "data": "synthetic"}
WARMUP, QUICK_WARMUP = 2, 1


def add_parser(benches) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = benches.add_parser("accum", help="throughput and optimizer-step rate vs gradient accumulation steps",
                           description="--steps is the number of timed optimizer steps per grid point.")
    add_training_flags(p, defaults=ACCUM_DEFAULTS)
    p.add_argument("--grid", default=DEFAULT_GRID, help=f"accumulation steps to sweep (default {DEFAULT_GRID})")
    p.add_argument("--warmup", type=checked(int, NON_NEGATIVE), default=None, help=f"untimed steps per point (default {WARMUP}, --quick {QUICK_WARMUP})")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    p.add_argument("--time-limit", type=float, default=1800.0, help="hard wall-clock limit of the sweep in seconds")
    p.set_defaults(func=cmd_accum)


def parse_grid(text: str) -> list[int]:
    try:
        grid = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        grid = []
    if not grid or any(a <= 0 for a in grid):
        raise ConfigError(f"--grid {text!r}: expected positive accumulation steps separated by commas, e.g. {DEFAULT_GRID}")
    return sorted(set(grid))


def accum_curve_job(cfg: Config, comm: Comm, *, grid: list[int], warmup: int) -> list[dict] | None:
    """Train warmup + cfg.loop.steps steps at every accumulation of the grid; rank 0 returns one point each."""
    from zerotrain.training.loop import train

    points = []
    for accum in grid:
        point_cfg = copy.deepcopy(cfg)
        point_cfg.loop.accum, point_cfg.loop.steps = accum, warmup + cfg.loop.steps
        before_calls, before_bytes = comm.snapshot()
        result = train(point_cfg, comm, announce=False)
        calls, nbytes = Counter(comm.calls) - before_calls, Counter(comm.bytes) - before_bytes
        points.append(_point(point_cfg, comm.world_size, result.records[warmup:], calls, nbytes))
    return points if comm.rank == 0 else None


def _point(cfg: Config, world_size: int, timed: list[dict], calls: Counter, nbytes: Counter) -> dict:
    steps = cfg.loop.steps  # steps: every step of the point, warm-up included
    step_s = [rec["step_ms"] / 1000 for rec in timed]
    elapsed = sum(step_s)
    effective = world_size * cfg.loop.micro_batch * cfg.loop.accum
    return {
        "accum_steps": cfg.loop.accum,
        "micro_batch": cfg.loop.micro_batch,
        "world_size": world_size,
        "effective_batch": effective,
        "effective_batch_tokens": effective * cfg.model.seq_len,
        "timed_steps": len(timed),
        "samples_per_s": effective * len(timed) / elapsed,
        "tokens_per_s": sum(rec["tokens"] for rec in timed) / elapsed,  # unmasked target tokens
        "optimizer_steps_per_s": len(timed) / elapsed,
        "step_time_median_s": percentile(step_s, 50),
        "step_time_p90_s": percentile(step_s, 90),
        "mean_loss": sum(rec["loss"] for rec in timed) / len(timed),
        "collective_calls_per_step": {p: calls[p] / steps for p in STEP_PURPOSES},
        "bytes_per_step": sum(nbytes[p] for p in STEP_PURPOSES) / steps,
        "bytes_per_step_by_purpose": {p: nbytes[p] / steps for p in STEP_PURPOSES},
    }


def cmd_accum(args: argparse.Namespace) -> int:
    from zerotrain.cli.flags import config_from_args
    from zerotrain.runtime.launch import run_job

    pyplot("accum-curve.png")  # before the sweep: a missing plotting library should not cost a run
    if args.accum is not None:
        raise ConfigError(f"--accum {args.accum}: bench accum sweeps the accumulation steps; use --grid")
    if args.tp not in (None, 1):
        raise ConfigError(f"--tp {args.tp}: bench accum measures data parallelism; zerotrain bench tp compares meshes")
    if args.quick:
        args._flag_defaults = QUICK_DEFAULTS
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    grid = parse_grid(args.grid)
    cfg = config_from_args(args)
    cfg.logging.metrics, cfg.checkpoint.every, cfg.checkpoint.resume = "", 0, ""  # the sweep writes only its results
    cfg.checkpoint.final_save = False
    out = cfg.logging.out or os.path.join("runs", "accum-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    m = cfg.model
    print(f"zerotrain bench accum: GPT {m.n_layer} layers, width {m.n_embd}, seq {m.seq_len}, vocab {m.vocab_size}; "
          f"{cfg.launch.nproc} ranks x micro-batch {cfg.loop.micro_batch}; accum {grid}; "
          f"{warmup} warm-up + {cfg.loop.steps} timed steps per point", flush=True)
    points = run_job(functools.partial(accum_curve_job, grid=grid, warmup=warmup), cfg, time_limit=args.time_limit)
    report = {
        **report_header(SCHEMA),
        "config": cfg.to_dict(),
        "grid": grid,
        "warmup_steps": warmup,
        "timed_steps": cfg.loop.steps,
        "bytes_counted": "bytes rank 0 sends per optimizer step under the ring algorithm (see comm.py)",
        "points": points,
    }
    json_path, png_path = os.path.join(out, "accum-curve.json"), os.path.join(out, "accum-curve.png")
    write_json(json_path, report)
    plot_curve(points, png_path, title=f"{cfg.launch.nproc} ranks x micro-batch {cfg.loop.micro_batch}, "
                                        f"GPT {m.n_layer}x{m.n_embd}, seq {m.seq_len}")
    print_table(points)
    print(f"\nwrote {json_path}\nwrote {png_path}")
    return 0


def print_table(points: list[dict]) -> None:
    head = (f"{'accum':>5} {'micro':>5} {'ranks':>5} {'eff.batch':>9} {'samples/s':>10} {'tokens/s':>10} "
            f"{'opt steps/s':>11} {'step p50 ms':>11} {'p90 ms':>8} {'loss':>7} {'RS/AR/AG calls':>14} {'KiB/step':>9}")
    print(head)
    print("-" * len(head))
    for p in points:
        c = p["collective_calls_per_step"]
        calls = "/".join(f"{c[k]:g}" for k in STEP_PURPOSES)
        print(f"{p['accum_steps']:5d} {p['micro_batch']:5d} {p['world_size']:5d} {p['effective_batch']:9d} "
              f"{p['samples_per_s']:10.1f} {p['tokens_per_s']:10.0f} {p['optimizer_steps_per_s']:11.2f} "
              f"{1000 * p['step_time_median_s']:11.1f} {1000 * p['step_time_p90_s']:8.1f} {p['mean_loss']:7.3f} "
              f"{calls:>14} {p['bytes_per_step'] / 1024:9.1f}")


def plot_curve(points: list[dict], path: str, title: str) -> None:
    """Two panels against effective batch: samples/s; optimizer steps/s with step time."""
    plt = pyplot("accum-curve.png")

    batch = [p["effective_batch"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    left.plot(batch, [p["samples_per_s"] for p in points], "o-", color="C0")
    left.set(title="throughput", xlabel="effective batch (sequences)", ylabel="samples/s", xscale="log")
    left.set_ylim(bottom=0)

    first = points[0]
    rate = right.plot(batch, [p["optimizer_steps_per_s"] for p in points], "o-", color="C1",
                      label="optimizer steps/s")
    # What steps/s would be if a step's cost grew exactly with its micro-batches.
    ideal = right.plot(batch, [first["optimizer_steps_per_s"] * first["accum_steps"] / p["accum_steps"] for p in points],
                       ":", color="C1", label="1/accum from the first point")
    right.set(title="optimizer steps", xlabel="effective batch (sequences)", ylabel="optimizer steps/s", xscale="log")
    right.set_ylim(bottom=0)
    step_time = right.twinx()
    ms = step_time.plot(batch, [1000 * p["step_time_median_s"] for p in points], "s--", color="C2",
                        label="step time, median (ms)")
    step_time.set_ylabel("optimizer step time (ms)")
    step_time.set_ylim(bottom=0)
    lines = rate + ideal + ms
    right.legend(lines, [line.get_label() for line in lines], loc="upper center", bbox_to_anchor=(0.5, -0.16),
                 ncol=3, fontsize="small", frameon=False)  # below the panel, clear of the curves
    for ax in (left, right):
        ax.set_xticks(batch, [str(b) for b in batch])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
