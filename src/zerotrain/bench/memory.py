"""`zerotrain bench memory`: what each rank holds, measured beside the plan, for ZeRO-1, ZeRO-2, activation
checkpointing (blocks, and full: blocks, head and loss) and TP 2, with the step time each costs; JSON, a markdown
table and a figure.

Every variant runs one model on 2 ranks, each rank taking the same micro-batch (accumulation 1), so per-rank
activations compare directly; TP 2 x DP 1 therefore computes half the global batch of the DP 2 variants.
Per-rank bytes are the largest over the ranks (train()'s per_rank): parameters, gradients between steps and
at their peak during a step (stage 2's buckets in flight), optimizer state (with bf16's masters), and peak
RSS. Activations are what rank 0's first micro-batch saved for the backward (saved-tensor hooks). Beside
each is the memory plan's figure (training/memory_plan.py). With --repeats > 1 the variants alternate
(A B .., .. B A) so that the machine's drift spreads over all of them; step time is the median of rank 0's
timed steps, after --warmup untimed ones.

Targets (issue "Bigger models per rank"): at DP 2, ZeRO-2's state bytes (parameters + gradients +
optimizer) <= 0.85x ZeRO-1's, its gradient bytes <= 1/2 of ZeRO-1's plus two buckets, its step time within
1.05x of ZeRO-1's; activation checkpointing's saved bytes <= 0.3x without (blocks; full reported beside);
the plan's state exact and its activations within 10%.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time

import torch

from zerotrain.cli.figures import pyplot
from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE, Config
from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm

from .report import percentile, report_header, write_report

SCHEMA = "zerotrain.bench.memory"
VARIANTS = {  # name -> (ZeRO stage, TP degree, --activation-checkpointing)
    "ZeRO-1": (1, 1, "none"),
    "ZeRO-1 + blocks": (1, 1, "blocks"),
    "ZeRO-1 + full": (1, 1, "full"),
    "ZeRO-2": (2, 1, "none"),
    "ZeRO-2 + full": (2, 1, "full"),
    "TP 2": (1, 2, "none"),
}
SIZES = {
    "full": dict(preset="gpt2", micro_batch=1, warmup=1, steps=3, repeats=2),
    "quick": dict(preset="tiny", micro_batch=2, warmup=1, steps=2, repeats=1),
}
TARGETS = {"zero2_state_ratio_max": 0.85, "zero2_step_time_ratio_max": 1.05, "checkpointing_activation_ratio_max": 0.3,
           "plan_activation_error_max": 0.10}
SWEPT = {"nproc": "2 ranks", "tp": "its variants", "zero": "its variants", "activation_checkpointing": "its variants",
         "accum": "accumulation 1"}
FIGURE_SIZE_IN, FIGURE_DPI = (13.0, 5.0), 100
CATEGORIES = (("param_bytes", "parameters"), ("grad_peak_bytes", "gradients (peak)"),
              ("optimizer_bytes", "optimizer + masters"), ("activations", "activations"))


def add_parser(benches) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = benches.add_parser(
        "memory", help="per-rank bytes by kind, beside the plan, for ZeRO-1, ZeRO-2, activation checkpointing, TP 2",
        description="Train one model on 2 ranks as ZeRO-1 (without activation checkpointing, with blocks, and full), "
                    "ZeRO-2 (without, and full) and TP 2; report per-rank parameter, gradient, optimizer and "
                    "activation bytes and peak RSS, the memory plan's prediction beside each, and the step time. "
                    "--steps is the timed steps per job.")
    add_training_flags(p, defaults={"check_every": 0, "progress": False, "data": "synthetic"})
    p.add_argument("--warmup", type=checked(int, NON_NEGATIVE), help="untimed steps per job (default 1)")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds (default 2, --quick 1)")
    p.add_argument("--quick", action="store_true", help="a smoke run: the tiny GPT, 2 timed steps")
    p.add_argument("--time-limit", type=float, default=1200.0, help="wall-clock limit of each job in seconds")
    p.set_defaults(func=cmd_memory)


def memory_job(cfg: Config, comm: Comm, *, warmup: int) -> dict | None:
    """Train; rank 0 returns its step times, every rank's bytes, and the plan beside what was measured."""
    from zerotrain.training.loop import train

    result = train(cfg, comm, announce=False)
    if comm.rank != 0:
        return None
    return {"step_ms": [r["step_ms"] for r in result.records[warmup:]], "per_rank": result.per_rank,
            "plan": result.plan, "param_count": result.param_count, "threads_per_rank": torch.get_num_threads()}


def cmd_memory(args: argparse.Namespace) -> int:
    pyplot("bench memory's bench-memory.png")  # before the runs: a missing plotting library should not cost them
    _refuse(args)
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in ("warmup", "repeats", "steps", "micro_batch", "preset"):
        if getattr(args, key, None) is not None:
            size[key] = getattr(args, key)
    args.preset = size["preset"]
    from zerotrain.cli.flags import config_from_args

    cfg = config_from_args(args)
    cfg.logging.metrics, cfg.checkpoint.every, cfg.checkpoint.every_minutes, cfg.checkpoint.resume = "", 0, 0, ""
    cfg.loop.steps, cfg.loop.micro_batch, cfg.loop.accum = size["warmup"] + size["steps"], size["micro_batch"], 1
    configs = {name: variant_config(cfg, *v) for name, v in VARIANTS.items()}
    out = cfg.logging.out or os.path.join("runs", "bench-memory-" + time.strftime("%Y%m%d-%H%M%S"))
    m = cfg.model
    print(f"zerotrain bench memory: {m.arch} {m.n_layer} layers, width {m.n_embd}, seq {m.seq_len}, micro-batch "
          f"{cfg.loop.micro_batch} per rank, 2 ranks; {size['repeats']} round(s) of {size['warmup']} warm-up + "
          f"{size['steps']} timed steps per variant; output {out}", flush=True)
    from zerotrain.runtime.launch import run_job

    t0 = time.perf_counter()
    jobs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(size["repeats"]):
        for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            job = functools.partial(memory_job, warmup=size["warmup"])
            jobs[name].append(run_job(job, configs[name], time_limit=args.time_limit))
    rows = [summarize(name, configs[name], jobs[name]) for name in VARIANTS]
    report = {**report_header(SCHEMA), "config": cfg.to_dict(), "size": size, "rows": rows,
              "comparisons": comparisons(rows), "targets": TARGETS,
              "step_time": "median of rank 0's timed steps over all rounds, zero_grad to the optimizer update",
              "wall_s": time.perf_counter() - t0}
    write_report(out, "bench-memory", report, table(report))
    plot(report, os.path.join(out, "bench-memory.png"))
    return 0


def _refuse(args: argparse.Namespace) -> None:
    from zerotrain.runtime.launch import in_torchrun

    if in_torchrun():
        raise ConfigError("bench memory starts its own ranks, one job per variant: run it without torchrun")
    for name, instead in SWEPT.items():
        value = getattr(args, name)
        if value is not None:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: bench memory runs {instead}")


def variant_config(cfg: Config, zero: int, tp: int, checkpointing: str) -> Config:
    c = copy.deepcopy(cfg)
    c.launch.nproc, c.parallel.zero, c.parallel.tp, c.parallel.activation_checkpointing = 2, zero, tp, checkpointing
    return c


def summarize(name: str, cfg: Config, jobs: list[dict]) -> dict:
    """One row: the largest per-rank bytes, the plan's figure beside each, and the step time over the rounds."""
    first = jobs[0]
    per_rank, plan = first["per_rank"], first["plan"]
    rows = plan["rows"]
    step_ms = [t for job in jobs for t in job["step_ms"]]
    measured = {k: max(per_rank[k]) for k in ("param_bytes", "grad_bytes", "grad_peak_bytes", "optimizer_bytes")}
    measured["activations"] = plan["activations_measured"]
    measured["peak_rss_bytes"] = max(max(job["per_rank"]["peak_rss_bytes"]) for job in jobs)
    planned = {"param_bytes": rows["parameters"], "grad_bytes": rows["gradients"],
               "grad_peak_bytes": rows["gradients"] + rows["gradient_buckets"],
               "optimizer_bytes": rows["optimizer_state"] + rows["master_weights"], "activations": rows["activations"],
               "total": plan["total"]}
    return {
        "variant": name, "zero": cfg.parallel.zero, "tp": cfg.parallel.tp, "dp": 2 // cfg.parallel.tp,
        "activation_checkpointing": cfg.parallel.activation_checkpointing, "micro_batch": cfg.loop.micro_batch,
        "param_count": first["param_count"], "threads_per_rank": first["threads_per_rank"],
        "measured": measured, "planned": planned,
        "state_bytes": measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"],
        "state_bytes_at_peak": measured["param_bytes"] + measured["grad_peak_bytes"] + measured["optimizer_bytes"],
        "plan_state_exact": all(measured[k] == planned[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")),
        "plan_activation_error": (planned["activations"] - measured["activations"]) / measured["activations"],
        "timed_steps": len(step_ms), "step_ms_median": statistics.median(step_ms),
        "step_ms_p10": percentile(step_ms, 10), "step_ms_p90": percentile(step_ms, 90),
        "step_ms_per_repeat": [statistics.median(job["step_ms"]) for job in jobs],
    }


def comparisons(rows: list[dict]) -> dict:
    by = {r["variant"]: r for r in rows}
    one, two = by["ZeRO-1"], by["ZeRO-2"]
    blocks, full = by["ZeRO-1 + blocks"], by["ZeRO-1 + full"]
    # Paired by round: a round's variants ran back to back, under much the same load.
    paired = lambda a, b: statistics.median(x / y for x, y in zip(a["step_ms_per_repeat"], b["step_ms_per_repeat"]))  # noqa: E731
    out = {
        "zero2_state_ratio": two["state_bytes"] / one["state_bytes"],
        "zero2_state_ratio_at_peak": two["state_bytes_at_peak"] / one["state_bytes_at_peak"],
        "zero2_grad_peak_bytes": two["measured"]["grad_peak_bytes"],
        "zero1_grad_bytes_half_plus_two_buckets": one["measured"]["grad_peak_bytes"] / 2 +
                                                   (two["planned"]["grad_peak_bytes"] - two["planned"]["grad_bytes"]),
        "zero2_step_time_ratio": paired(two, one),
        "zero2_step_time_ratio_per_round": [x / y for x, y in
                                            zip(two["step_ms_per_repeat"], one["step_ms_per_repeat"])],
        "checkpointing_activation_ratio": blocks["measured"]["activations"] / one["measured"]["activations"],
        "checkpointing_step_time_ratio": paired(blocks, one),
        "full_checkpointing_activation_ratio": full["measured"]["activations"] / one["measured"]["activations"],
        "full_checkpointing_step_time_ratio": paired(full, one),
        "plan_state_exact_everywhere": all(r["plan_state_exact"] for r in rows),
        "plan_activation_error_max": max(abs(r["plan_activation_error"]) for r in rows),
    }
    out["met"] = {
        "zero2_state_ratio": out["zero2_state_ratio_at_peak"] <= TARGETS["zero2_state_ratio_max"],
        "zero2_grad_bytes": out["zero2_grad_peak_bytes"] <= out["zero1_grad_bytes_half_plus_two_buckets"],
        "zero2_step_time_ratio": out["zero2_step_time_ratio"] <= TARGETS["zero2_step_time_ratio_max"],
        "checkpointing_activation_ratio":
            out["checkpointing_activation_ratio"] <= TARGETS["checkpointing_activation_ratio_max"],
        "full_checkpointing_activation_ratio":
            out["full_checkpointing_activation_ratio"] <= TARGETS["checkpointing_activation_ratio_max"],
        "plan": out["plan_state_exact_everywhere"] and
            out["plan_activation_error_max"] <= TARGETS["plan_activation_error_max"],
    }
    return out


def table(report: dict) -> str:
    c = report["comparisons"]
    small = max(r["planned"]["total"] for r in report["rows"]) < 64 * 2**20
    unit, scale = ("KiB", 2**10) if small else ("MiB", 2**20)

    def mib(n: float) -> str:
        return f"{n / scale:,.1f}"

    lines = ["| variant | parameters | gradients held / peak | optimizer + masters | activations | peak RSS | "
             "step ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        m, p = r["measured"], r["planned"]
        lines.append(f"| {r['variant']} | {mib(m['param_bytes'])} ({mib(p['param_bytes'])}) | "
                     f"{mib(m['grad_bytes'])} / {mib(m['grad_peak_bytes'])} ({mib(p['grad_bytes'])} / "
                     f"{mib(p['grad_peak_bytes'])}) | {mib(m['optimizer_bytes'])} ({mib(p['optimizer_bytes'])}) | "
                     f"{mib(m['activations'])} ({mib(p['activations'])}) | {mib(m['peak_rss_bytes'])} "
                     f"({mib(p['total'])}) | {r['step_ms_median']:,.0f} |")
    met = lambda k: "met" if c["met"][k] else "NOT met"  # noqa: E731
    lines += [
        "", f"{unit} per rank, the largest over the ranks; in brackets the memory plan's figure (beside peak RSS: the "
            "plan's total, which leaves out torch's own runtime). TP 2 is TP 2 x DP 1, with the same micro-batch "
            "per rank (half the global batch).", "",
        f"- ZeRO-2 state (parameters + gradients + optimizer) / ZeRO-1's: {c['zero2_state_ratio']:.3f} between steps, "
        f"{c['zero2_state_ratio_at_peak']:.3f} at the gradients' peak (target <= "
        f"{TARGETS['zero2_state_ratio_max']}: {met('zero2_state_ratio')}).",
        f"- ZeRO-2 gradient bytes at their peak: {mib(c['zero2_grad_peak_bytes'])} {unit}, against half of ZeRO-1's "
        f"plus two buckets {mib(c['zero1_grad_bytes_half_plus_two_buckets'])} {unit} ({met('zero2_grad_bytes')}).",
        f"- ZeRO-2 step time / ZeRO-1's: {c['zero2_step_time_ratio']:.3f} (the median over rounds, each round's "
        f"ratio: {', '.join(f'{x:.3f}' for x in c['zero2_step_time_ratio_per_round'])}; target <= "
        f"{TARGETS['zero2_step_time_ratio_max']}: {met('zero2_step_time_ratio')}).",
        f"- Activation checkpointing, blocks: saved bytes {c['checkpointing_activation_ratio']:.3f}x (target <= "
        f"{TARGETS['checkpointing_activation_ratio_max']}: {met('checkpointing_activation_ratio')}), step time "
        f"{c['checkpointing_step_time_ratio']:.3f}x: the price of running each block's forward twice. Full (the "
        f"head and the loss too): {c['full_checkpointing_activation_ratio']:.3f}x, step time "
        f"{c['full_checkpointing_step_time_ratio']:.3f}x.",
        f"- The plan: state bytes exact in every variant: {'yes' if c['plan_state_exact_everywhere'] else 'NO'}; "
        f"activations off by at most {c['plan_activation_error_max']:.1%} ({met('plan')}).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Per variant: stacked measured bytes by kind, the plan's total as a marker; and the step time."""
    plt = pyplot("bench memory's bench-memory.png")
    rows = report["rows"]
    x = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    bottom = [0.0] * len(rows)
    for i, (key, label) in enumerate(CATEGORIES):
        values = [r["measured"][key] / 2**20 for r in rows]
        left.bar(x, values, bottom=bottom, label=label, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, values)]
    planned = [sum(r["planned"][k] for k, _ in CATEGORIES) / 2**20 for r in rows]
    left.scatter(x, planned, marker="_", s=900, color="black", label="the plan", zorder=3)
    left.set(title="held per rank at the peak of a step, MiB")
    left.legend(fontsize="small")
    median = [r["step_ms_median"] for r in rows]
    err = [[v - r["step_ms_p10"] for v, r in zip(median, rows)], [r["step_ms_p90"] - v for v, r in zip(median, rows)]]
    right.bar(x, median, color=[f"C{i + 4}" for i in x], yerr=err, capsize=4)
    right.set(title="optimizer step, ms (median, p10-p90)")
    for ax in (left, right):
        ax.set_xticks(x, [r["variant"].replace(" + ", "\n+ ") for r in rows], fontsize="small")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    m = report["config"]["model"]
    fig.suptitle(f"zerotrain bench memory: {m['arch']} {m['n_layer']}x{m['n_embd']}, seq {m['seq_len']}, micro-batch "
                 f"{report['size']['micro_batch']} per rank, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
