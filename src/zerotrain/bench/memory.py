"""`zerotrain bench memory`: what each rank holds, measured beside the plan, for ZeRO-1, ZeRO-2, ZeRO-3, activation
checkpointing (blocks, and full: blocks, head and loss), TP 2 and gradient accumulation under both --grad-reduce
modes, with the step time each costs; JSON, a markdown table and a figure.

Every variant runs one model on 2 ranks, each rank taking the same micro-batch, so per-rank activations compare
directly; TP 2 x DP 1 therefore computes half the global batch of the DP 2 variants. Most variants run at
accumulation 1; the "accum" ones at --accum A (8, --quick 2): ZeRO-1, and ZeRO-2 and ZeRO-3 with --grad-reduce step
(every bucket's full-size gradients through the window) and micro-batch (each micro-batch reduce-scattered into
the shard). Per-rank bytes are the largest over the ranks (train()'s per_rank): parameters between steps and at
their peak during a step (stage 3's shard with the units whole), gradients between steps and at their peak
(stage 2's and 3's buckets in flight), optimizer state (with bf16's masters), and peak RSS. Activations are what
rank 0's first micro-batch saved for the backward (saved-tensor hooks). Beside each is the memory plan's figure
(training/memory_plan.py; the parameters' peak is its parameters row plus parameter_units). With --repeats > 1 the
variants alternate (A B .., .. B A) so that the machine's drift spreads over all of them; step time is the median of
rank 0's timed optimizer steps (A micro-batches each in the accum variants), after --warmup untimed ones.
--variants runs some of them (a comparison is reported where its variants ran).

Targets (issue "Bigger models per rank"): at DP 2, ZeRO-2's state bytes (parameters + gradients +
optimizer) <= 0.85x ZeRO-1's, its gradient bytes <= 1/2 of ZeRO-1's plus two buckets, its step time within
1.05x of ZeRO-1's; ZeRO-3's step time within 1.15x of ZeRO-2's at accumulation 1 (the ratio paired per round);
with --grad-reduce micro-batch at accumulation A, ZeRO-3's gradient bytes at their peak <= 1/D of ZeRO-1's (at A)
plus two units, where two units are the plan's parameter_units row counted in fp32 (gradients are fp32): the root
unit with the largest other one (with --overlap on, the root with two neighbouring blocks: a looser bound);
activation checkpointing's saved bytes <= 0.3x without (blocks; full reported beside); the plan's state exact and
its activations within 10%. ZeRO-3's state at its peak over ZeRO-2's is reported beside, without a target.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from dataclasses import dataclass

import torch

from zerotrain.cli.figures import pyplot
from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE, Config, validate
from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm

from .report import percentile, report_header, write_report

SCHEMA = "zerotrain.bench.memory"


@dataclass(frozen=True)
class Variant:
    """One job of the bench: what it sets over the run the flags describe."""

    zero: int
    tp: int = 1
    checkpointing: str = "none"  # --activation-checkpointing
    accumulates: bool = False  # at the bench's accumulation (--accum), else 1
    grad_reduce: str = "step"


VARIANTS = {
    "ZeRO-1": Variant(1),
    "ZeRO-1 + blocks": Variant(1, checkpointing="blocks"),
    "ZeRO-1 + full": Variant(1, checkpointing="full"),
    "ZeRO-2": Variant(2),
    "ZeRO-2 + full": Variant(2, checkpointing="full"),
    "ZeRO-3": Variant(3),
    "TP 2": Variant(1, tp=2),
    "ZeRO-1 accum": Variant(1, accumulates=True),
    "ZeRO-2 accum step": Variant(2, accumulates=True),
    "ZeRO-2 accum micro-batch": Variant(2, accumulates=True, grad_reduce="micro-batch"),
    "ZeRO-3 accum step": Variant(3, accumulates=True),
    "ZeRO-3 accum micro-batch": Variant(3, accumulates=True, grad_reduce="micro-batch"),
}
# --quick's buckets are small enough that the tiny GPT spans several: two buckets in flight are then less than all.
SIZES = {
    "full": dict(preset="gpt2", micro_batch=1, accum=8, bucket_mb=None, warmup=1, steps=3, repeats=2),
    "quick": dict(preset="tiny", micro_batch=2, accum=2, bucket_mb=1 / 64, warmup=1, steps=2, repeats=1),
}
TARGETS = {"zero2_state_ratio_max": 0.85, "zero2_step_time_ratio_max": 1.05, "zero3_step_time_ratio_max": 1.15,
           "checkpointing_activation_ratio_max": 0.3, "plan_activation_error_max": 0.10}
SWEPT = {"nproc": "2 ranks", "tp": "its variants", "zero": "its variants", "activation_checkpointing": "its variants",
         "grad_reduce": "its variants"}
FIGURE_SIZE_IN, FIGURE_DPI = (16.0, 5.5), 100
CATEGORIES = (("param_peak_bytes", "parameters (peak)"), ("grad_peak_bytes", "gradients (peak)"),
              ("optimizer_bytes", "optimizer + masters"), ("activations", "activations"))


def add_parser(benches) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = benches.add_parser(
        "memory", help="per-rank bytes by kind, beside the plan, for ZeRO-1, 2 and 3, activation checkpointing, TP 2 "
                       "and accumulation under both --grad-reduce modes",
        description="Train one model on 2 ranks as ZeRO-1 (without activation checkpointing, with blocks, and full), "
                    "ZeRO-2 (without, and full), ZeRO-3 and TP 2 at accumulation 1, and as ZeRO-1, ZeRO-2 and ZeRO-3 "
                    "at accumulation --accum (default 8, --quick 2; ZeRO-2 and 3 with --grad-reduce step and "
                    "micro-batch); report per-rank parameter, gradient, optimizer and activation bytes and peak RSS, "
                    "the memory plan's prediction beside each, and the step time. --steps is the timed steps per job.")
    add_training_flags(p, defaults={"check_every": 0, "progress": False, "data": "synthetic"})
    p.add_argument("--warmup", type=checked(int, NON_NEGATIVE), help="untimed steps per job (default 1)")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds (default 2, --quick 1)")
    p.add_argument("--variants", help="comma-separated variants to run, of: " + ", ".join(VARIANTS) + " (default: all)")
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
    names = chosen_variants(args.variants)
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in ("warmup", "repeats", "steps", "micro_batch", "accum", "bucket_mb", "preset"):
        if getattr(args, key, None) is not None:
            size[key] = getattr(args, key)
    args.preset = size["preset"]
    from zerotrain.cli.flags import config_from_args

    cfg = config_from_args(args)
    cfg.logging.metrics, cfg.checkpoint.every, cfg.checkpoint.every_minutes, cfg.checkpoint.resume = "", 0, 0, ""
    cfg.checkpoint.final_save = False
    cfg.loop.steps, cfg.loop.micro_batch, cfg.loop.accum = size["warmup"] + size["steps"], size["micro_batch"], 1
    if size["bucket_mb"] is not None:
        cfg.parallel.bucket_mb = size["bucket_mb"]
    configs = {name: variant_config(cfg, VARIANTS[name], size["accum"]) for name in names}
    out = cfg.logging.out or os.path.join("runs", "bench-memory-" + time.strftime("%Y%m%d-%H%M%S"))
    m = cfg.model
    print(f"zerotrain bench memory: {m.arch} {m.n_layer} layers, width {m.n_embd}, seq {m.seq_len}, micro-batch "
          f"{cfg.loop.micro_batch} per rank, 2 ranks, accumulation 1 and {size['accum']}; {len(names)} variants, "
          f"{size['repeats']} round(s) of {size['warmup']} warm-up + {size['steps']} timed steps each; output {out}",
          flush=True)
    from zerotrain.runtime.launch import run_job

    t0 = time.perf_counter()
    jobs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(size["repeats"]):
        for name in (names if r % 2 == 0 else names[::-1]):
            job = functools.partial(memory_job, warmup=size["warmup"])
            jobs[name].append(run_job(job, configs[name], time_limit=args.time_limit))
    rows = [summarize(name, configs[name], jobs[name]) for name in names]
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
    if args.accum == 1:
        raise ConfigError("--accum 1: bench memory's accum variants need at least 2 (the others run at 1)")


def chosen_variants(text: str | None) -> list[str]:
    """--variants' names, in VARIANTS' order (all of them without it)."""
    if text is None:
        return list(VARIANTS)
    given = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in given if name not in VARIANTS]
    if unknown or not given:
        raise ConfigError(f"--variants {text!r}: {', '.join(map(repr, unknown)) or 'none given'} not among "
                          f"{', '.join(VARIANTS)}")
    return [name for name in VARIANTS if name in given]


def variant_config(cfg: Config, v: Variant, accum: int) -> Config:
    c = copy.deepcopy(cfg)
    c.launch.nproc, c.loop.accum = 2, (accum if v.accumulates else 1)
    c.parallel.zero, c.parallel.tp, c.parallel.activation_checkpointing = v.zero, v.tp, v.checkpointing
    c.parallel.grad_reduce = v.grad_reduce
    return validate(c)  # what the flags ask may not compose with a variant (--compile with ZeRO-3): said before any run


def summarize(name: str, cfg: Config, jobs: list[dict]) -> dict:
    """One row: the largest per-rank bytes, the plan's figure beside each, and the step time over the rounds."""
    first = jobs[0]
    per_rank, plan = first["per_rank"], first["plan"]
    rows = plan["rows"]
    step_ms = [t for job in jobs for t in job["step_ms"]]
    measured = {k: max(per_rank[k]) for k in ("param_bytes", "param_peak_bytes", "grad_bytes", "grad_peak_bytes",
                                               "optimizer_bytes")}
    measured["activations"] = plan["activations_measured"]
    measured["peak_rss_bytes"] = max(max(job["per_rank"]["peak_rss_bytes"]) for job in jobs)
    planned = {"param_bytes": rows["parameters"], "param_peak_bytes": rows["parameters"] + rows["parameter_units"],
               "parameter_units": rows["parameter_units"], "grad_bytes": rows["gradients"],
               "grad_peak_bytes": rows["gradients"] + rows["gradient_buckets"],
               "optimizer_bytes": rows["optimizer_state"] + rows["master_weights"], "activations": rows["activations"],
               "total": plan["total"]}
    return {
        "variant": name, "zero": cfg.parallel.zero, "tp": cfg.parallel.tp, "dp": 2 // cfg.parallel.tp,
        "activation_checkpointing": cfg.parallel.activation_checkpointing, "micro_batch": cfg.loop.micro_batch,
        "accum": cfg.loop.accum, "grad_reduce": cfg.parallel.grad_reduce, "precision": cfg.parallel.precision,
        "param_count": first["param_count"], "threads_per_rank": first["threads_per_rank"],
        "measured": measured, "planned": planned,
        "state_bytes": measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"],
        "state_bytes_at_peak": measured["param_peak_bytes"] + measured["grad_peak_bytes"] + measured["optimizer_bytes"],
        "plan_state_exact": all(measured[k] == planned[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")),
        "plan_param_peak_exact": measured["param_peak_bytes"] == planned["param_peak_bytes"],
        "plan_activation_error": (planned["activations"] - measured["activations"]) / measured["activations"],
        "timed_steps": len(step_ms), "step_ms_median": statistics.median(step_ms),
        "step_ms_p10": percentile(step_ms, 10), "step_ms_p90": percentile(step_ms, 90),
        "step_ms_per_repeat": [statistics.median(job["step_ms"]) for job in jobs],
    }


def two_units_grad_bytes(row: dict) -> int:
    """The plan's parameter_units row (the root unit with the largest other) as fp32 gradient bytes."""
    return row["planned"]["parameter_units"] * 4 // (2 if row["precision"] == "bf16" else 4)


def _per_round(a: dict, b: dict) -> list[float]:
    # Paired by round: a round's variants ran back to back, under much the same load.
    return [x / y for x, y in zip(a["step_ms_per_repeat"], b["step_ms_per_repeat"])]


def comparisons(rows: list[dict]) -> dict:
    """The ratios and bounds the targets name, each where the variants it compares ran; `met` beside them."""
    by = {r["variant"]: r for r in rows}
    have = lambda *names: all(n in by for n in names)  # noqa: E731
    out, met = {}, {}
    if have("ZeRO-1", "ZeRO-2"):
        one, two = by["ZeRO-1"], by["ZeRO-2"]
        out["zero2_state_ratio"] = two["state_bytes"] / one["state_bytes"]
        out["zero2_state_ratio_at_peak"] = two["state_bytes_at_peak"] / one["state_bytes_at_peak"]
        out["zero2_grad_peak_bytes"] = two["measured"]["grad_peak_bytes"]
        out["zero1_grad_bytes_half_plus_two_buckets"] = (
            one["measured"]["grad_peak_bytes"] / 2 + (two["planned"]["grad_peak_bytes"] - two["planned"]["grad_bytes"]))
        out["zero2_step_time_ratio_per_round"] = _per_round(two, one)
        out["zero2_step_time_ratio"] = statistics.median(out["zero2_step_time_ratio_per_round"])
        met["zero2_state_ratio"] = out["zero2_state_ratio_at_peak"] <= TARGETS["zero2_state_ratio_max"]
        met["zero2_grad_bytes"] = out["zero2_grad_peak_bytes"] <= out["zero1_grad_bytes_half_plus_two_buckets"]
        met["zero2_step_time_ratio"] = out["zero2_step_time_ratio"] <= TARGETS["zero2_step_time_ratio_max"]
    if have("ZeRO-2", "ZeRO-3"):
        two, three = by["ZeRO-2"], by["ZeRO-3"]
        out["zero3_state_ratio"] = three["state_bytes_at_peak"] / two["state_bytes_at_peak"]
        out["zero3_state_ratio_between_steps"] = three["state_bytes"] / two["state_bytes"]
        out["zero3_step_time_ratio_per_round"] = _per_round(three, two)
        out["zero3_step_time_ratio"] = statistics.median(out["zero3_step_time_ratio_per_round"])
        met["zero3_step_time_ratio"] = out["zero3_step_time_ratio"] <= TARGETS["zero3_step_time_ratio_max"]
    if have("ZeRO-1 accum", "ZeRO-3 accum micro-batch"):
        one, micro = by["ZeRO-1 accum"], by["ZeRO-3 accum micro-batch"]
        out["zero3_micro_batch_grad_peak_bytes"] = micro["measured"]["grad_peak_bytes"]
        out["zero1_grad_bytes_over_dp_plus_two_units"] = (
            one["measured"]["grad_peak_bytes"] / one["dp"] + two_units_grad_bytes(micro))
        met["zero3_micro_batch_grad_bytes"] = (
            out["zero3_micro_batch_grad_peak_bytes"] <= out["zero1_grad_bytes_over_dp_plus_two_units"])
    for stage in (2, 3):  # what --grad-reduce micro-batch saves and costs against step, at the same accumulation
        if have(f"ZeRO-{stage} accum step", f"ZeRO-{stage} accum micro-batch"):
            step, micro = by[f"ZeRO-{stage} accum step"], by[f"ZeRO-{stage} accum micro-batch"]
            out[f"zero{stage}_micro_batch_grad_peak_ratio"] = (
                micro["measured"]["grad_peak_bytes"] / step["measured"]["grad_peak_bytes"])
            out[f"zero{stage}_micro_batch_step_time_ratio"] = statistics.median(_per_round(micro, step))
    if have("ZeRO-1", "ZeRO-1 + blocks", "ZeRO-1 + full"):
        one, blocks, full = by["ZeRO-1"], by["ZeRO-1 + blocks"], by["ZeRO-1 + full"]
        out["checkpointing_activation_ratio"] = blocks["measured"]["activations"] / one["measured"]["activations"]
        out["checkpointing_step_time_ratio"] = statistics.median(_per_round(blocks, one))
        out["full_checkpointing_activation_ratio"] = full["measured"]["activations"] / one["measured"]["activations"]
        out["full_checkpointing_step_time_ratio"] = statistics.median(_per_round(full, one))
        for key in ("checkpointing_activation_ratio", "full_checkpointing_activation_ratio"):
            met[key] = out[key] <= TARGETS["checkpointing_activation_ratio_max"]
    out["plan_state_exact_everywhere"] = all(r["plan_state_exact"] for r in rows)
    out["plan_activation_error_max"] = max(abs(r["plan_activation_error"]) for r in rows)
    met["plan"] = (out["plan_state_exact_everywhere"] and
                   out["plan_activation_error_max"] <= TARGETS["plan_activation_error_max"])
    out["met"] = met
    return out


def table(report: dict) -> str:
    small = max(r["planned"]["total"] for r in report["rows"]) < 64 * 2**20
    unit, scale = ("KiB", 2**10) if small else ("MiB", 2**20)

    def mib(n: float) -> str:
        return f"{n / scale:,.1f}"

    lines = ["| variant | accum | parameters held / peak | gradients held / peak | optimizer + masters | activations | "
             "peak RSS | step ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        m, p = r["measured"], r["planned"]
        lines.append(f"| {r['variant']} | {r['accum']} | {mib(m['param_bytes'])} / {mib(m['param_peak_bytes'])} "
                     f"({mib(p['param_bytes'])} / {mib(p['param_peak_bytes'])}) | "
                     f"{mib(m['grad_bytes'])} / {mib(m['grad_peak_bytes'])} ({mib(p['grad_bytes'])} / "
                     f"{mib(p['grad_peak_bytes'])}) | {mib(m['optimizer_bytes'])} ({mib(p['optimizer_bytes'])}) | "
                     f"{mib(m['activations'])} ({mib(p['activations'])}) | {mib(m['peak_rss_bytes'])} "
                     f"({mib(p['total'])}) | {r['step_ms_median']:,.0f} |")
    ran = {r["variant"] for r in report["rows"]}
    lines += [
        "", f"{unit} per rank, the largest over the ranks; in brackets the memory plan's figure (parameters at their "
            "peak: its parameters row plus parameter_units; beside peak RSS: the plan's total, which leaves out "
            "torch's own runtime)." +
            (" TP 2 is TP 2 x DP 1, with the same micro-batch per rank (half the global batch)." if "TP 2" in ran
             else "") +
            (" The step time of an accum variant is one optimizer step: accum micro-batches."
             if any(VARIANTS[name].accumulates for name in ran) else ""), "",
        *comparison_lines(report["comparisons"], lambda n: f"{mib(n)} {unit}"),
    ]
    return "\n".join(lines) + "\n"


def comparison_lines(c: dict, size) -> list[str]:
    """One line per comparison that ran, its target's verdict beside it."""
    met = lambda k: "met" if c["met"][k] else "NOT met"  # noqa: E731
    rounds = lambda k: ", ".join(f"{x:.3f}" for x in c[k])  # noqa: E731
    lines = []
    if "zero2_state_ratio" in c:
        lines += [
            f"- ZeRO-2 state (parameters + gradients + optimizer) / ZeRO-1's: {c['zero2_state_ratio']:.3f} between "
            f"steps, {c['zero2_state_ratio_at_peak']:.3f} at the gradients' peak (target <= "
            f"{TARGETS['zero2_state_ratio_max']}: {met('zero2_state_ratio')}).",
            f"- ZeRO-2 gradient bytes at their peak: {size(c['zero2_grad_peak_bytes'])}, against half of ZeRO-1's "
            f"plus two buckets {size(c['zero1_grad_bytes_half_plus_two_buckets'])} ({met('zero2_grad_bytes')}).",
            f"- ZeRO-2 step time / ZeRO-1's: {c['zero2_step_time_ratio']:.3f} (the median over rounds, each round's "
            f"ratio: {rounds('zero2_step_time_ratio_per_round')}; target <= {TARGETS['zero2_step_time_ratio_max']}: "
            f"{met('zero2_step_time_ratio')}).",
        ]
    if "zero3_step_time_ratio" in c:
        lines += [
            f"- ZeRO-3 state at its peak (the shard with the units whole, gradients with their buckets, optimizer) / "
            f"ZeRO-2's: {c['zero3_state_ratio']:.3f} ({c['zero3_state_ratio_between_steps']:.3f} between steps).",
            f"- ZeRO-3 step time / ZeRO-2's at accumulation 1: {c['zero3_step_time_ratio']:.3f} (each round's ratio: "
            f"{rounds('zero3_step_time_ratio_per_round')}; target <= {TARGETS['zero3_step_time_ratio_max']}: "
            f"{met('zero3_step_time_ratio')}).",
        ]
    if "zero3_micro_batch_grad_peak_bytes" in c:
        lines.append(
            f"- ZeRO-3 with --grad-reduce micro-batch, accumulating: gradient bytes at their peak "
            f"{size(c['zero3_micro_batch_grad_peak_bytes'])}, against ZeRO-1's (accumulating) / D plus two units "
            f"{size(c['zero1_grad_bytes_over_dp_plus_two_units'])} ({met('zero3_micro_batch_grad_bytes')}).")
    for stage in (2, 3):
        if f"zero{stage}_micro_batch_grad_peak_ratio" in c:
            lines.append(
                f"- ZeRO-{stage} accumulating, --grad-reduce micro-batch / step: gradient peak "
                f"{c[f'zero{stage}_micro_batch_grad_peak_ratio']:.3f}x, step time "
                f"{c[f'zero{stage}_micro_batch_step_time_ratio']:.3f}x.")
    if "checkpointing_activation_ratio" in c:
        lines.append(
            f"- Activation checkpointing, blocks: saved bytes {c['checkpointing_activation_ratio']:.3f}x (target <= "
            f"{TARGETS['checkpointing_activation_ratio_max']}: {met('checkpointing_activation_ratio')}), step time "
            f"{c['checkpointing_step_time_ratio']:.3f}x: the price of running each block's forward twice. Full (the "
            f"head and the loss too): {c['full_checkpointing_activation_ratio']:.3f}x, step time "
            f"{c['full_checkpointing_step_time_ratio']:.3f}x.")
    lines.append(
        f"- The plan: state bytes exact in every variant: {'yes' if c['plan_state_exact_everywhere'] else 'NO'}; "
        f"activations off by at most {c['plan_activation_error_max']:.1%} ({met('plan')}).")
    return lines


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
    left.scatter(x, planned, marker="_", s=300, color="black", label="the plan", zorder=3)
    left.set(title="held per rank at the peak of a step, MiB", ylim=(0, 1.2 * max(bottom + planned)))
    left.legend(fontsize="small", ncols=5, loc="upper center")  # above the bars, in the headroom the ylim leaves
    median = [r["step_ms_median"] for r in rows]
    err = [[v - r["step_ms_p10"] for v, r in zip(median, rows)], [r["step_ms_p90"] - v for v, r in zip(median, rows)]]
    right.bar(x, median, color=[f"C{i % 6 + 4}" for i in x], yerr=err, capsize=4)
    right.set(title="optimizer step, ms (median, p10-p90; accum: that many micro-batches)", ylim=(0, None))
    for ax in (left, right):
        labels = [r["variant"].replace("accum", f"accum {r['accum']}") for r in rows]
        ax.set_xticks(x, [s.replace(" + ", "\n+ ").replace(" accum", "\naccum").replace(" micro", "\nmicro")
                          .replace(" step", "\nstep") for s in labels], fontsize="x-small")
        ax.grid(axis="y", alpha=0.3)
    m = report["config"]["model"]
    fig.suptitle(f"zerotrain bench memory: {m['arch']} {m['n_layer']}x{m['n_embd']}, seq {m['seq_len']}, micro-batch "
                 f"{report['size']['micro_batch']} per rank, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
