"""`zerotrain bench compare`: ZeRO-1 against DDP, ZeroRedundancyOptimizer and FSDP2, alternated in one run.

All four strategies (either architecture) are built side by side in the same ranks and take turns: every strategy first
runs untimed warm-up steps, then each repeat runs `steps` timed optimizer steps of every strategy,
the order rotating from repeat to repeat so that drift in machine load spreads over all of them.
A strategy always continues from its own last step, so at the end every strategy has trained the
same steps on the same batches and its final parameters are compared with DDP + AdamW's.

A process's peak resident memory cannot be split between strategies that share it, so it is
measured in separate short runs, one fresh set of ranks per strategy (and one with no model, the
baseline of a bare rank).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import resource
import statistics
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from zerotrain.cli.figures import pyplot
from zerotrain.cli.flags import checked
from zerotrain.config import POSITIVE, Config
from zerotrain.data import BatchSchedule, StepBatch, make_source
from zerotrain.errors import ConfigError
from zerotrain.model import ARCH_NAMES
from zerotrain.parallel import Comm
from zerotrain.runtime.launch import rank_device
from zerotrain.training.schedule import lr_at

from . import baselines as S
from .report import machine_info, percentile, write_json

SCHEMA, SCHEMA_VERSION = "zerotrain.bench.compare", 1
AGREEMENT_BOUND = 1e-5  # max |final parameter - DDP + AdamW's|: the strategies compute the same thing
REFERENCE = "ddp"
SIZES = {  # warm-up steps, repeats, timed steps per strategy per repeat
    "full": dict(warmup=3, repeats=7, steps=10),
    "quick": dict(warmup=2, repeats=5, steps=4),
}
COMPARE_DEFAULTS = {
    "nproc": 2, "threads": 1, "micro_batch": 8, "progress": False,
    "grad_clip": 0.0,  # clipping off in all four; --grad-clip turns it on in all four
    "data": "synthetic",  # timing, not learning: no corpus to prepare
}


def add_parser(benches) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = benches.add_parser(
        "compare", help="zerotrain ZeRO-1 vs DDP, ZeroRedundancyOptimizer and FSDP2, side by side",
        description="Train the same model (GPT-2 or Llama) with four data-parallel strategies, alternating them, "
                    "and report step time, tokens/s, optimizer state, peak memory, bytes communicated and "
                    "final-parameter agreement. --steps is the timed steps per strategy per repeat.")
    add_training_flags(p, defaults=COMPARE_DEFAULTS)
    p.add_argument("--quick", action="store_true", help="fewer steps (well under 3 minutes on 2 cores)")
    p.add_argument("--heavy", action="store_true", help="communication-heavy case: --preset wide, micro-batch 1")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds of timed steps (default 7, quick 5)")
    p.add_argument("--warmup", type=checked(int, POSITIVE), help="untimed steps per strategy before timing, at least one: "
                   "the first step includes one-time setup (not the LR warmup)")
    p.add_argument("--weak-scaling", action="store_true",
                   help="also time zerotrain on 1 rank (always on without --quick)")
    p.set_defaults(func=cmd_compare)


@dataclass
class Plan:
    strategies: list[str]
    warmup: int
    repeats: int
    steps: int
    lr_steps: int  # the LR schedule's length: every strategy trains this many steps in the main run

    @property
    def total_steps(self) -> int:
        return self.warmup + self.repeats * self.steps


def compare_job(cfg: Config, comm: Comm, plan: Plan) -> dict:
    """Build the plan's strategies on this rank, alternate them, and return every rank's measurements."""
    device = rank_device(cfg)
    batch = _shared_batches(cfg, comm, device)
    built = {name: S.build(name, cfg, comm) for name in plan.strategies}
    tally = _Tally.empty(plan.strategies)
    run = functools.partial(_run_block, built=built, tally=tally, batch=batch, cfg=cfg, plan=plan, device=device)
    for name in plan.strategies:
        run(name, plan.warmup, timed=False)
    for r in range(plan.repeats):
        k = r % max(1, len(plan.strategies))
        for name in plan.strategies[k:] + plan.strategies[:k]:
            run(name, plan.steps, timed=True)
    ranks = comm.all_gather_json(_local_measurements(built, tally, device), "bench_results")
    return _job_result(built, ranks, tally.tokens, comm.world_size)


@dataclass
class _Tally:
    """What one rank has measured so far: the steps each strategy has taken, and the cost of its timed ones."""

    done: dict[str, int]
    times: dict[str, list[float]]
    comm_calls: dict[str, Counter]
    comm_bytes: dict[str, Counter]
    tokens: list[int]  # global tokens of each timed step of the first strategy

    @classmethod
    def empty(cls, names: list[str]) -> _Tally:
        """Nothing measured yet for any of `names`."""
        return cls(done={name: 0 for name in names}, times={name: [] for name in names},
                   comm_calls={name: Counter() for name in names}, comm_bytes={name: Counter() for name in names},
                   tokens=[])


def _shared_batches(cfg: Config, comm: Comm, device: torch.device) -> Callable[[int], StepBatch]:
    """A function returning this rank's batch of a step, on its device, made on first use."""
    schedule = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=comm.rank, world_size=comm.world_size)
    batches: dict[int, StepBatch] = {}

    def batch(step: int) -> StepBatch:
        # Generated once and shared by all strategies, outside the timed region.
        if step not in batches:
            b = schedule.batch(step)
            batches[step] = StepBatch([m.to(device) for m in b.micro_batches], b.global_tokens)
        return batches[step]

    return batch


def _run_block(name: str, steps: int, timed: bool, *, built: dict, tally: _Tally, batch: Callable[[int], StepBatch],
               cfg: Config, plan: Plan, device: torch.device) -> None:
    """`steps` optimizer steps of one strategy, continuing from its last; timed ones are added to the tally."""
    strategy = built[name]
    dist.barrier()  # the previous strategy's stragglers must not land in this one's timings
    calls_before, bytes_before = strategy.comm_counts()
    for i in range(steps):
        b = batch(tally.done[name])
        lr = lr_at(tally.done[name], cfg.optim, plan.lr_steps)
        t0 = time.perf_counter()
        strategy.step(b, lr)
        if i == steps - 1:
            strategy.settle()  # the block's timings hold all of its communication, and no other's
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        tally.done[name] += 1
        if timed:
            tally.times[name].append(elapsed)
            if name == plan.strategies[0]:
                tally.tokens.append(b.global_tokens)
    if timed:
        calls_after, bytes_after = strategy.comm_counts()
        tally.comm_calls[name].update(calls_after - calls_before)
        tally.comm_bytes[name].update(bytes_after - bytes_before)


def _local_measurements(built: dict, tally: _Tally, device: torch.device) -> dict:
    """This rank's measurements, as gathered from every rank: timings, communication, state and peak memory."""
    return {
        "step_s": tally.times,
        "comm_calls": tally.comm_calls,
        "comm_bytes": tally.comm_bytes,
        "state_bytes": {name: s.state_bytes() for name, s in built.items()},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
    }


def _job_result(built: dict, ranks: list[dict], tokens: list[int], world_size: int) -> dict:
    """The job's result: every rank's measurements, and how far each strategy's final parameters are from DDP's."""
    finals = {name: s.full_params() for name, s in built.items()}
    params = next(iter(finals.values()), {})
    return {
        "ranks": ranks,
        "tokens_per_step": tokens,
        "param_count": sum(t.numel() for t in params.values()),
        "param_gaps": param_gaps(finals, REFERENCE),
        "world_size": world_size,
    }


def param_gaps(finals: dict[str, dict[str, torch.Tensor]], reference: str) -> dict[str, float]:
    """Max |parameter - reference's| over all parameters, per strategy; inf where names or shapes differ."""
    if reference not in finals:
        return {}
    ref = finals[reference]
    gaps = {}
    for name, params in finals.items():
        if params.keys() != ref.keys() or any(params[k].shape != ref[k].shape for k in ref):
            gaps[name] = float("inf")
            continue
        gaps[name] = max((float((params[k] - ref[k]).abs().max()) for k in ref if ref[k].numel()), default=0.0)
    return gaps


def agreement_failures(gaps: dict[str, float], bound: float = AGREEMENT_BOUND) -> list[str]:
    """One line per strategy whose final parameters are further than `bound` from the reference's."""
    return [f"{S.LABELS.get(name, name)}: final parameters differ from {S.LABELS[REFERENCE]} by up to "
            f"{gap:.3g} (bound {bound:g})" for name, gap in gaps.items() if not gap <= bound]


def summarize(main: dict, probes: dict[str, dict], baseline: dict, plan: Plan, weak: dict | None) -> dict:
    """Per-strategy figures from the per-rank measurements (a step lasts as long as its slowest rank)."""
    W, P = main["world_size"], main["param_count"]
    tokens = statistics.mean(main["tokens_per_step"]) if main["tokens_per_step"] else 0.0
    allreduce_bytes = 2 * (W - 1) / W * 4 * P  # one ring all-reduce of fp32 gradients, per rank
    results, rank0 = {}, main["ranks"][0]
    for name in plan.strategies:
        step_s = [max(rank["step_s"][name][i] for rank in main["ranks"]) for i in range(plan.repeats * plan.steps)]
        per_repeat = [statistics.median(step_s[r * plan.steps : (r + 1) * plan.steps]) for r in range(plan.repeats)]
        median = statistics.median(step_s)
        state = [rank["state_bytes"][name] for rank in main["ranks"]]
        sent = [sum(rank["comm_bytes"][name].values()) / len(step_s) for rank in main["ranks"]]
        rss = [rank["peak_rss_bytes"] for rank in probes[name]["ranks"]]
        cuda = [rank["peak_cuda_bytes"] for rank in probes[name]["ranks"]]
        results[name] = {
            "label": S.LABELS[name],
            "step_ms": {"median": 1e3 * median, "p10": 1e3 * percentile(step_s, 10), "p90": 1e3 * percentile(step_s, 90),
                        "min": 1e3 * min(step_s), "max": 1e3 * max(step_s),
                        "per_repeat_median": [1e3 * t for t in per_repeat], "all": [1e3 * t for t in step_s]},
            "tokens_per_s": tokens / median,
            "optimizer_state_bytes": {"per_rank": state, "max": max(state), "mean": statistics.mean(state),
                                      "max_bytes_per_param": max(state) / P},
            "comm_bytes_per_step": {"per_rank": sent, "max": max(sent), "mean": statistics.mean(sent),
                                    "vs_one_allreduce": statistics.mean(sent) / allreduce_bytes if allreduce_bytes else None,
                                    "rank0_by_collective": {k: v / len(step_s) for k, v in rank0["comm_bytes"][name].items()}},
            "comm_calls_per_step": {k: v / len(step_s) for k, v in rank0["comm_calls"][name].items()},
            "peak_rss_bytes": {"per_rank": rss, "max": max(rss), "mean": statistics.mean(rss)},
            "peak_cuda_bytes": {"per_rank": cuda, "max": max(cuda)} if cuda[0] is not None else None,
            "param_max_abs_diff_vs_ddp": main["param_gaps"].get(name),
        }
    if REFERENCE in results:
        ref, ref_repeats = results[REFERENCE]["step_ms"]["median"], results[REFERENCE]["step_ms"]["per_repeat_median"]
        for r in results.values():
            r["ratio_to_ddp"] = r["step_ms"]["median"] / ref
            # Paired per repeat: both ran in the same round, under the same load.
            r["ratio_to_ddp_paired_median"] = statistics.median(
                a / b for a, b in zip(r["step_ms"]["per_repeat_median"], ref_repeats))
    out = {"param_count": P, "world_size": W, "global_tokens_per_step": tokens,
           "allreduce_bytes_per_rank": allreduce_bytes,
           "baseline_rank_rss_bytes": max(rank["peak_rss_bytes"] for rank in baseline["ranks"]),
           "strategies": results, "weak_scaling": None}
    if weak is not None and "zerotrain" in results:
        one = weak["ranks"][0]["step_s"]["zerotrain"]
        single = statistics.mean(weak["tokens_per_step"]) / statistics.median(one)
        out["weak_scaling"] = {"tokens_per_s_1_rank": single, "world_size": W,
                               "tokens_per_s_W_ranks": results["zerotrain"]["tokens_per_s"],
                               "speedup": results["zerotrain"]["tokens_per_s"] / single, "target": 1.85}
    return out


def markdown(summary: dict, cfg: Config, plan: Plan) -> str:
    m = cfg.model
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    lines = [
        f"{ARCH_NAMES[m.arch]} {m.n_layer} layers / {m.n_head} heads / {m.n_embd} wide, seq {m.seq_len}, "
        f"vocab {m.vocab_size}: "
        f"P = {summary['param_count']:,}; {summary['world_size']} rank(s) x {cfg.launch.threads} thread(s), "
        f"micro-batch {cfg.loop.micro_batch} x accum {cfg.loop.accum}, {summary['global_tokens_per_step']:.0f} tokens/step, {cfg.launch.device}; "
        f"zerotrain overlap {'on' if cfg.reduce_in_backward else 'off'} (--overlap {cfg.parallel.overlap})",
        f"{plan.repeats} alternating repeats x {plan.steps} timed steps per strategy after {plan.warmup} warm-up steps; "
        "a step is timed from zero_grad to the optimizer update, data generation excluded (an all-gather "
        "running behind the next forward is timed there, and the last step of a block waits for its own); "
        "paired: median over repeats of the ratio within a repeat",
        "",
        "| strategy | step ms median | p10-p90 ms | tokens/s | vs DDP (paired) | opt. state/rank max (mean) | B/param | "
        "sent/step/rank | vs 1 all-reduce | peak RSS/rank | max abs diff vs DDP |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for res in summary["strategies"].values():
        t, st, c, rss = res["step_ms"], res["optimizer_state_bytes"], res["comm_bytes_per_step"], res["peak_rss_bytes"]
        ratio = f"{res['ratio_to_ddp']:.2f}x ({res['ratio_to_ddp_paired_median']:.2f}x)" if "ratio_to_ddp" in res else "-"
        vs_ar = f"{c['vs_one_allreduce']:.2f}x" if c["vs_one_allreduce"] is not None else "-"
        gap = res["param_max_abs_diff_vs_ddp"]
        cuda = f" (CUDA {mb(res['peak_cuda_bytes']['max'])})" if res["peak_cuda_bytes"] else ""
        lines.append(
            f"| {res['label']} | {t['median']:.1f} | {t['p10']:.1f}-{t['p90']:.1f} | {res['tokens_per_s']:,.0f} | "
            f"{ratio} | {mb(st['max'])} ({mb(st['mean'])}) | {st['max_bytes_per_param']:.2f} | {mb(c['mean'])} | "
            f"{vs_ar} | {mb(rss['max'])}{cuda} | {'-' if gap is None else f'{gap:.2g}'} |")
    lines += ["", f"peak RSS of a bare rank (process group, no model): {mb(summary['baseline_rank_rss_bytes'])}"]
    w = summary["weak_scaling"]
    if w:
        lines.append(f"weak scaling (zerotrain): {w['tokens_per_s_W_ranks']:,.0f} tokens/s on {w['world_size']} ranks "
                     f"vs {w['tokens_per_s_1_rank']:,.0f} on 1 rank = {w['speedup']:.2f}x (target >= {w['target']}x)")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    plt = pyplot("bench compare's compare.png")

    res = list(summary["strategies"].values())
    labels = [textwrap.fill(r["label"], 16) for r in res]
    colors = ["tab:green", "tab:blue", "tab:orange", "tab:purple"][: len(res)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    median = [r["step_ms"]["median"] for r in res]
    err = [[m - r["step_ms"]["p10"] for m, r in zip(median, res)], [r["step_ms"]["p90"] - m for m, r in zip(median, res)]]
    panels = [
        (axes[0, 0], median, "optimizer step, ms (median, p10-p90)", err),
        (axes[0, 1], [r["comm_bytes_per_step"]["mean"] / 1e6 for r in res], "sent per step per rank, MB", None),
        (axes[1, 0], [r["optimizer_state_bytes"]["max"] / 1e6 for r in res], "optimizer state, max over ranks, MB", None),
        (axes[1, 1], [r["peak_rss_bytes"]["max"] / 1e6 for r in res], "peak resident memory per rank, MB", None),
    ]
    for ax, values, title, yerr in panels:
        ax.bar(range(len(res)), values, color=colors, yerr=yerr, capsize=4)
        ax.set_xticks(range(len(res)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"zerotrain bench compare: P = {summary['param_count']:,}, {summary['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



def config_and_plan(args: argparse.Namespace) -> tuple[Config, Plan, bool]:
    """The validated config, the main run's plan, and whether to measure weak scaling."""
    from zerotrain.cli.flags import config_from_args
    from zerotrain.runtime.launch import default_threads, in_torchrun

    if in_torchrun():
        raise ConfigError("bench compare starts its own ranks (it also needs a 1-rank run): run it without torchrun")
    if args.heavy:
        if args.preset not in (None, "wide"):
            raise ConfigError(f"--heavy uses --preset wide, got --preset {args.preset}")
        args.preset = "wide"
        if args.micro_batch is None:
            args.micro_batch = 1
    args.preset = args.preset or "bench"
    cfg = config_from_args(args)
    if cfg.parallel.tp != 1:
        raise ConfigError(f"--tp {cfg.parallel.tp}: bench compare compares data-parallel strategies; "
                          "zerotrain bench tp compares TP x DP meshes")
    if cfg.parallel.precision != "fp32":
        raise ConfigError(f"--precision {cfg.parallel.precision}: bench compare compares fp32 training only "
                          "(the PyTorch strategies keep fp32 parameters)")
    size = SIZES["quick" if args.quick else "full"]
    warmup = size["warmup"] if args.warmup is None else args.warmup
    repeats = size["repeats"] if args.repeats is None else args.repeats
    steps = size["steps"] if args.steps is None else args.steps
    plan = Plan(list(S.NAMES), warmup, repeats, steps, lr_steps=warmup + repeats * steps)
    cfg.loop.steps = plan.total_steps
    if args.warmup_steps is None:
        cfg.optim.warmup_steps = max(1, plan.total_steps // 10)
    cfg.launch.threads = default_threads(cfg)  # the 1-rank run keeps the threads per rank
    if not cfg.logging.out:
        cfg.logging.out = os.path.join("runs", time.strftime("bench-compare-%Y%m%d-%H%M%S"))
    return cfg, plan, args.weak_scaling or not args.quick


def cmd_compare(args: argparse.Namespace) -> int:
    from zerotrain.runtime.launch import run_job

    pyplot("bench compare's compare.png")  # before the runs: a missing plotting library should not cost them
    cfg, plan, weak_scaling = config_and_plan(args)
    out = cfg.logging.out
    os.makedirs(out, exist_ok=True)
    print(f"zerotrain bench compare: {', '.join(S.LABELS[n] for n in plan.strategies)} on {cfg.launch.nproc} rank(s); "
          f"{plan.warmup} warm-up + {plan.repeats} x {plan.steps} timed steps each; output {out}", flush=True)
    t0 = time.perf_counter()
    main = run_job(functools.partial(compare_job, plan=plan), cfg)
    probe = lambda names: Plan(names, plan.warmup, 1, min(plan.steps, 2), plan.lr_steps)  # noqa: E731
    baseline = run_job(functools.partial(compare_job, plan=probe([])), cfg)
    probes = {name: run_job(functools.partial(compare_job, plan=probe([name])), cfg) for name in plan.strategies}
    weak = None
    if weak_scaling:
        single = copy.deepcopy(cfg)
        single.launch.nproc = 1
        weak = run_job(functools.partial(compare_job, plan=Plan(["zerotrain"], plan.warmup, plan.repeats, plan.steps,
                                                                plan.lr_steps)), single)
    summary = summarize(main, probes, baseline, plan, weak)
    failures = agreement_failures(main["param_gaps"])
    report = {"schema": SCHEMA, "version": SCHEMA_VERSION, "machine": machine_info(),
              "config": cfg.to_dict(), "plan": asdict(plan), "agreement_bound": AGREEMENT_BOUND,
              "agreement_failures": failures, "wall_s": round(time.perf_counter() - t0, 2), **summary}
    write_json(os.path.join(out, "compare.json"), report)
    table = markdown(summary, cfg, plan)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(table)
    plot(summary, os.path.join(out, "compare.png"))
    print(table)
    print(f"wrote compare.json, compare.md, compare.png to {out} ({report['wall_s']:.0f} s)")
    for line in failures:
        print(f"zerotrain: FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0
