"""`zerotrain bench tp`: tensor vs data parallelism on the `wide` GPT, per mesh, as JSON, a markdown table and a figure.

Every mesh (TP1 x DP2, TP2 x DP1, and TP2 x DP2 when the machine has 4 cores) trains the same model
from the same initial parameters on the same global batch: each DP replica takes global/dp sequences
per step, so every mesh computes the same tokens per step and step times compare directly (tokens/s
is the global tokens over the step time). Each mesh uses the whole machine: threads per rank are
cores / ranks unless --threads says otherwise. Each mesh runs as its own job; with --repeats > 1 the
jobs alternate (A B, B A, ...) so that drift in the machine's load spreads over all meshes. The first
--warmup steps of every job are not timed; step time is the median of rank 0's timed steps (the
step's one all-reduce keeps the ranks within a collective of each other).

Per-rank parameter, gradient and optimizer bytes are the largest over the ranks (train()'s
per_rank). Bytes communicated per step are rank 0's counters, summed over its communicators (world,
DP group, TP group), by purpose, divided by the steps of the job; collectives made once per run
(the initial broadcast, checks) are listed apart. After training, each TP job times one all-reduce of
one micro-batch's activations on its TP group, alone: the price of each of the all-reduces TP puts
between two matmuls.

Target: per-rank parameter bytes at TP2 <= 0.55x TP1. Step time is reported as measured, with the
collectives that explain it: TP all-reduces activations twice per block forward and twice backward,
blocking, on the critical path; DP communicates its gradients and parameters once per step.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from collections import Counter

import torch

from zerotrain.cli.figures import pyplot
from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE, PRESETS, Config
from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm
from zerotrain.parallel.params import param_dtype

from .report import percentile, report_header, write_json

SCHEMA = "zerotrain.bench.tp"
PARAM_RATIO_TARGET = 0.55  # per-rank parameter bytes, TP2 / TP1: at most
# The collectives of one optimizer step, by purpose; everything else happens once per run.
TP_PURPOSES = ("all_reduce_tp_activations", "all_reduce_tp_grads")
# The vocabulary's (model/vocab.py), per micro-batch: the embedding's rows summed, the head input's gradient, and the
# loss's max and sums (one of each per chunk of tokens)
VOCAB_PURPOSES = ("all_reduce_tp_embedding", "all_reduce_tp_head_grads", "all_reduce_loss_max", "all_reduce_loss_sums")
STEP_PURPOSES = ("reduce_scatter_grads", "all_gather_params", "all_reduce_stats") + TP_PURPOSES + VOCAB_PURPOSES
PROBE_REPEATS = 20
ROUND_SPREAD_WARNING = 1.3  # one mesh's slowest round median over its fastest: above it, the load changed
SIZES = {  # per job: untimed warm-up steps, timed steps, alternating rounds of all meshes, global batch
    "full": dict(warmup=2, steps=6, repeats=4, global_batch=8),
    "quick": dict(warmup=1, steps=2, repeats=1, global_batch=4),
}
TP_DEFAULTS = {
    **PRESETS["wide"],
    "check_every": 0, "progress": False,
    "data": "synthetic",  # timing, not learning: no corpus to prepare
}
# The sweep decides these per mesh; a user's value would be silently replaced, so it is refused.
SWEPT_FLAGS = {"nproc": "--meshes", "tp": "--meshes", "micro_batch": "--global-batch", "accum": "--global-batch"}
FIGURE_SIZE_IN = (13.0, 5.0)
FIGURE_DPI = 100


def add_parser(benches) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = benches.add_parser(
        "tp", help="tensor vs data parallelism: step time, tokens/s, per-rank bytes and communication per mesh",
        description="Train the wide GPT on several TP x DP meshes at the same global batch and report step time, "
                    "tokens/s, per-rank parameter/gradient/optimizer bytes and bytes communicated per step by "
                    "purpose. --steps is the timed steps per job.")
    add_training_flags(p, defaults=TP_DEFAULTS)
    p.add_argument("--meshes", help="TPxDP meshes to run, e.g. 1x2,2x1,2x2 (default 1x2,2x1, and 2x2 with >= 4 cores)")
    p.add_argument("--global-batch", type=checked(int, POSITIVE), help="sequences per optimizer step, the same for every mesh "
                                                    "(default 8, --quick 4); divisible by every mesh's DP")
    p.add_argument("--warmup", type=checked(int, NON_NEGATIVE), help="untimed steps per job (default 2, --quick 1)")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds of one job per mesh (default 4, --quick 1)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 timed steps, global batch 4")
    p.add_argument("--time-limit", type=float, default=600.0, help="wall-clock limit of each job in seconds")
    p.set_defaults(func=cmd_tp)


def default_meshes(cores: int | None) -> list[tuple[int, int]]:
    """(tp, dp) pairs: TP1 x DP2 and TP2 x DP1, and TP2 x DP2 when 4 ranks have a core each."""
    return [(1, 2), (2, 1)] + ([(2, 2)] if (cores or 1) >= 4 else [])


def parse_meshes(text: str) -> list[tuple[int, int]]:
    try:
        meshes = [tuple(int(v) for v in m.lower().split("x")) for m in text.split(",") if m.strip()]
    except ValueError:
        meshes = []
    if not meshes or any(len(m) != 2 or min(m) < 1 for m in meshes):
        raise ConfigError(f"--meshes {text!r}: expected TPxDP pairs separated by commas, e.g. 1x2,2x1,2x2")
    return list(dict.fromkeys(meshes))


def mesh_name(tp: int, dp: int) -> str:
    return f"TP{tp} x DP{dp}"


def tp_job(cfg: Config, comm: Comm, *, warmup: int) -> dict | None:
    """Train warmup + timed steps on this mesh; rank 0 returns its measurements, then the TP all-reduce probe."""
    from zerotrain.training.loop import train

    result = train(cfg, comm, announce=False)
    calls, nbytes = dict(result.comm_calls), dict(result.comm_bytes)  # before the probes add their own
    mesh = result.engine.mesh
    tp_ms = _probe_tp_all_reduce(cfg, mesh.tp) if mesh.tp_size > 1 else None
    dp_ms = _probe_dp_reduce(result.engine) if mesh.dp_size > 1 else None
    if comm.rank != 0:
        return None
    return {
        "step_ms": [rec["step_ms"] for rec in result.records[warmup:]],
        "tokens": [rec["tokens"] for rec in result.records[warmup:]],
        "loss": [rec["loss"] for rec in result.records],
        "steps": len(result.records),
        "comm_calls": calls,
        "comm_bytes": nbytes,
        "per_rank": result.per_rank,
        "param_count": result.param_count,
        "threads_per_rank": torch.get_num_threads(),
        "tp_all_reduce_probe_ms": tp_ms,
        "dp_reduce_grads_probe_ms": dp_ms,
    }


def _probe_tp_all_reduce(cfg: Config, tp: Comm) -> float:
    """Median ms of one all-reduce of a micro-batch's activations (micro x seq x width) on this TP group."""
    m = cfg.model
    x = torch.ones(cfg.loop.micro_batch, m.seq_len, m.n_embd, dtype=param_dtype(cfg.parallel.precision),
                   device=tp.device)
    times = []
    for i in range(PROBE_REPEATS + 2):
        t0 = time.perf_counter()
        tp.all_reduce(x, "probe_tp_all_reduce")
        if x.is_cuda:
            torch.cuda.synchronize()
        if i >= 2:  # the first calls set up the connection's buffers
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def _probe_dp_reduce(engine) -> float:
    """Median ms of the engine's gradient reduction alone: every bucket's reduce-scatter and the stats all-reduce."""
    times = []
    for i in range(PROBE_REPEATS // 2 + 1):
        engine.zero_grad()  # a new window: reduce_grads launches every bucket again
        t0 = time.perf_counter()
        engine.reduce_grads(torch.zeros(0))
        if engine.held_params.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def mesh_config(cfg: Config, tp: int, dp: int, global_batch: int) -> Config:
    """The job's config: tp x dp ranks, each DP replica taking its share of the global batch in one micro-batch."""
    c = copy.deepcopy(cfg)
    c.parallel.tp, c.launch.nproc = tp, tp * dp
    c.loop.micro_batch, c.loop.accum = global_batch // dp, 1
    return c


def summarize(tp: int, dp: int, cfg: Config, jobs: list[dict], cores: int | None) -> dict:
    """One row of the report from the jobs (one per repeat) of one mesh."""
    step_ms = [t for job in jobs for t in job["step_ms"]]
    tokens = [n for job in jobs for n in job["tokens"]]
    steps = sum(job["steps"] for job in jobs)
    calls, nbytes = Counter(), Counter()
    for job in jobs:
        calls.update(job["comm_calls"])
        nbytes.update(job["comm_bytes"])
    first = jobs[0]
    per_rank = first["per_rank"]
    threads = first["threads_per_rank"]
    median = statistics.median(step_ms)
    by_purpose = {p: nbytes[p] / steps for p in STEP_PURPOSES if calls[p]}
    return {
        "mesh": mesh_name(tp, dp),
        "tp": tp,
        "dp": dp,
        "ranks": tp * dp,
        "threads_per_rank": threads,
        "oversubscribed": tp * dp * threads > (cores or 1),
        "micro_batch": cfg.loop.micro_batch,
        "accum": cfg.loop.accum,
        "global_batch": dp * cfg.loop.micro_batch * cfg.loop.accum,
        "global_batch_tokens": dp * cfg.loop.micro_batch * cfg.loop.accum * cfg.model.seq_len,
        "param_count": first["param_count"],
        "timed_steps": len(step_ms),
        "step_ms_median": median,
        "step_ms_p10": percentile(step_ms, 10),
        "step_ms_p90": percentile(step_ms, 90),
        "step_ms_per_repeat": [statistics.median(job["step_ms"]) for job in jobs],
        "step_ms_all": step_ms,
        "tokens_per_s": statistics.mean(tokens) / (median / 1000),  # unmasked target tokens of the global batch
        "param_bytes_per_rank": max(per_rank["param_bytes"]),
        "grad_bytes_per_rank": max(per_rank["grad_bytes"]),
        "optimizer_bytes_per_rank": max(per_rank["optimizer_bytes"]),
        "peak_rss_bytes_per_rank": max(max(job["per_rank"]["peak_rss_bytes"]) for job in jobs),
        "per_rank": per_rank,
        "comm_calls_per_step_by_purpose": {p: calls[p] / steps for p in STEP_PURPOSES if calls[p]},
        "comm_bytes_per_step_by_purpose": by_purpose,
        "comm_bytes_per_step": sum(by_purpose.values()),
        "comm_bytes_once_by_purpose": {p: nbytes[p] / len(jobs) for p in sorted(nbytes) if p not in STEP_PURPOSES},
        "tp_all_reduce_probe_ms": _median_probe(jobs, "tp_all_reduce_probe_ms"),
        "dp_reduce_grads_probe_ms": _median_probe(jobs, "dp_reduce_grads_probe_ms"),
        "final_loss": first["loss"][-1],
    }


def _median_probe(jobs: list[dict], key: str) -> float | None:
    """The median over the jobs of a probe's time; None where the mesh has nothing to probe (TP 1 or DP 1)."""
    times = [job[key] for job in jobs if job[key] is not None]
    return statistics.median(times) if times else None


def find(rows: list[dict], tp: int, dp: int) -> dict | None:
    return next((r for r in rows if (r["tp"], r["dp"]) == (tp, dp)), None)


def comparisons(rows: list[dict]) -> dict:
    """The target's ratio (largest TP2 row's parameter bytes over TP1's), and TP2 x DP1's step time over TP1 x DP2's."""
    tp1 = [r for r in rows if r["tp"] == 1]
    tp2 = [r for r in rows if r["tp"] == 2]
    ratio = (max(r["param_bytes_per_rank"] for r in tp2) / max(r["param_bytes_per_rank"] for r in tp1)
             if tp1 and tp2 else None)
    dp_row, tp_row = find(rows, 1, 2), find(rows, 2, 1)
    step_ratio = tp_row["step_ms_median"] / dp_row["step_ms_median"] if dp_row and tp_row else None
    # Paired by round: the two jobs of a round ran back to back, under much the same load.
    paired = (statistics.median(t / d for t, d in zip(tp_row["step_ms_per_repeat"], dp_row["step_ms_per_repeat"]))
              if dp_row and tp_row and "step_ms_per_repeat" in tp_row else None)
    return {
        "param_bytes_ratio_tp2_vs_tp1": ratio,
        "step_time_ratio_tp2xdp1_vs_tp1xdp2": step_ratio,
        "step_time_ratio_tp2xdp1_vs_tp1xdp2_paired": paired,
        "tokens_per_s_ratio_tp2xdp1_vs_tp1xdp2": (tp_row["tokens_per_s"] / dp_row["tokens_per_s"]
                                                  if dp_row and tp_row else None),
        "targets": {"param_bytes_ratio_tp2_vs_tp1_max": PARAM_RATIO_TARGET},
        "met": {"param_bytes_ratio_tp2_vs_tp1": None if ratio is None else ratio <= PARAM_RATIO_TARGET},
    }


def cmd_tp(args: argparse.Namespace) -> int:
    """Run every mesh's jobs in alternating rounds and write bench-tp.json, bench-tp.md and bench-tp.png."""
    pyplot("bench tp's bench-tp.png")  # before the runs: a missing plotting library should not cost them
    _refuse_torchrun_and_swept_flags(args)
    size = _resolve_size(args)
    cores = os.cpu_count()
    meshes = _resolve_meshes(args.meshes, size["global_batch"], cores)
    cfg = _sweep_config(args, size)
    configs = _mesh_configs(cfg, meshes, size["global_batch"])
    out = _output_folder(cfg)
    _announce(cfg, meshes, size, out)
    t0, load_before = time.perf_counter(), os.getloadavg()
    jobs = _run_rounds(meshes, configs, size, args.time_limit)
    rows = [summarize(tp, dp, configs[tp, dp], jobs[tp, dp], cores) for tp, dp in meshes]
    report = _build_report(cfg, meshes, size, rows, load_before, t0)
    _write_report(report, out)
    return 0


def _refuse_torchrun_and_swept_flags(args: argparse.Namespace) -> None:
    """Refuse a run under torchrun, and the flags the sweep sets per mesh."""
    from zerotrain.runtime.launch import in_torchrun

    if in_torchrun():
        raise ConfigError("bench tp starts its own ranks, one job per mesh: run it without torchrun")
    for name, instead in SWEPT_FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: bench tp sets it per mesh; use {instead}")


def _resolve_size(args: argparse.Namespace) -> dict:
    """Warm-up, timed steps, repeats and global batch: the size's defaults, overridden by the flags given."""
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in ("warmup", "repeats", "global_batch", "steps"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    return size


def _resolve_meshes(text: str | None, gb: int, cores: int | None) -> list[tuple[int, int]]:
    """The (tp, dp) meshes to run, from --meshes or the machine's cores; each must split the global batch."""
    meshes = parse_meshes(text) if text else default_meshes(cores)
    for tp, dp in meshes:
        if gb < 1 or gb % dp:
            raise ConfigError(f"--global-batch {gb}: {mesh_name(tp, dp)} needs a global batch divisible by DP {dp}")
    return meshes


def _sweep_config(args: argparse.Namespace, size: dict) -> Config:
    """The config every mesh's config starts from: no metrics, no checkpoints, warm-up and timed steps in one run."""
    from zerotrain.cli.flags import config_from_args

    cfg = config_from_args(args)
    cfg.logging.metrics, cfg.checkpoint.every, cfg.checkpoint.every_minutes = "", 0, 0
    cfg.checkpoint.final_save = False
    cfg.checkpoint.resume = ""  # the sweep writes only its results
    cfg.loop.steps = size["warmup"] + size["steps"]  # every step of a job, warm-up included
    return cfg


def _mesh_configs(cfg: Config, meshes: list[tuple[int, int]], gb: int) -> dict[tuple[int, int], Config]:
    """Each mesh's validated config, before any job starts."""
    configs = {}
    for tp, dp in meshes:
        configs[tp, dp] = mesh_config(cfg, tp, dp, gb)
        _validate_mesh(configs[tp, dp], tp, dp)
    return configs


def _output_folder(cfg: Config) -> str:
    """The results' folder, created: --out, else a new timestamped one under runs/."""
    out = cfg.logging.out or os.path.join("runs", "bench-tp-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    return out


def _announce(cfg: Config, meshes: list[tuple[int, int]], size: dict, out: str) -> None:
    """One line saying what the sweep is about to run, and where its results go."""
    m = cfg.model
    print(f"zerotrain bench tp: GPT {m.n_layer} layers, {m.n_head} heads, width {m.n_embd}, seq {m.seq_len}, "
          f"vocab {m.vocab_size}; meshes {', '.join(mesh_name(*k) for k in meshes)}; "
          f"global batch {size['global_batch']}; "
          f"{size['repeats']} round(s) of {size['warmup']} warm-up + {size['steps']} timed steps per mesh; "
          f"output {out}", flush=True)


def _run_rounds(meshes: list[tuple[int, int]], configs: dict, size: dict,
                time_limit: float) -> dict[tuple[int, int], list[dict]]:
    """Every round's job of every mesh, rank 0's measurements per mesh; odd rounds run the meshes in reverse."""
    from zerotrain.runtime.launch import run_job

    jobs: dict[tuple[int, int], list[dict]] = {k: [] for k in meshes}
    for r in range(size["repeats"]):
        order = meshes if r % 2 == 0 else meshes[::-1]
        for key in order:
            job = functools.partial(tp_job, warmup=size["warmup"])
            jobs[key].append(run_job(job, configs[key], time_limit=time_limit))
    return jobs


def _build_report(cfg: Config, meshes: list[tuple[int, int]], size: dict, rows: list[dict],
                  load_before: tuple[float, float, float], t0: float) -> dict:
    """The JSON report: the sweep's settings, one row per mesh, the comparisons and their explanation."""
    report = {
        **report_header(SCHEMA),
        "config": cfg.to_dict(),
        "meshes": [mesh_name(*k) for k in meshes],
        "global_batch": size["global_batch"],
        "warmup_steps": size["warmup"],
        "timed_steps": size["steps"],
        "repeats": size["repeats"],
        "step_time": "median of rank 0's timed steps over all repeats, zero_grad to the optimizer update",
        "bytes_counted": "bytes rank 0 sends per optimizer step under the ring algorithm (see comm.py), summed "
                         "over its world, DP and TP communicators",
        "per_rank_bytes": "the largest over the mesh's ranks",
        "rows": rows,
        **comparisons(rows),
        # Other processes' load is not the bench's: a reader of the step times needs to know it was there.
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    report["explanation"] = explain(report)
    return report


def _write_report(report: dict, out: str) -> None:
    """bench-tp.json, .md and .png into `out`, then the table and where they went on stdout."""
    json_path, md_path, png_path = (os.path.join(out, f"bench-tp.{ext}") for ext in ("json", "md", "png"))
    write_json(json_path, report)
    table = markdown(report)
    with open(md_path, "w") as f:
        f.write(table)
    plot(report, png_path)
    print(table)
    print(f"wrote bench-tp.json, bench-tp.md, bench-tp.png to {out} ({report['wall_s']:.0f} s)")


def _validate_mesh(cfg: Config, tp: int, dp: int) -> None:
    from zerotrain.config import validate

    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{mesh_name(tp, dp)}: {e}") from None


def explain(report: dict) -> str:
    """How much TP2 x DP1's step costs against TP1 x DP2's, and why, in the run's own numbers."""
    rows = report["rows"]
    dp_row, tp_row = find(rows, 1, 2), find(rows, 2, 1)
    if not (dp_row and tp_row):
        return ""
    n_layer = report["config"]["model"]["n_layer"]
    ratio = report["step_time_ratio_tp2xdp1_vs_tp1xdp2"]
    a, b = tp_row["step_ms_median"], dp_row["step_ms_median"]
    if ratio > 1:
        verdict = (f"TP2 x DP1 is {ratio:.2f}x slower per step than TP1 x DP2 ({a:.0f} vs {b:.0f} ms, "
                   f"{1 / ratio:.2f}x the tokens/s")
    else:
        verdict = (f"TP2 x DP1 is not slower than TP1 x DP2 here: {ratio:.2f}x the step time ({a:.0f} vs {b:.0f} ms, "
                   f"{1 / ratio:.2f}x the tokens/s")
    paired = report.get("step_time_ratio_tp2xdp1_vs_tp1xdp2_paired")
    verdict += f"; {paired:.2f}x paired round by round)" if paired is not None else ")"
    tp_calls = tp_row["comm_calls_per_step_by_purpose"]
    fwd, bwd = tp_calls.get("all_reduce_tp_activations", 0), tp_calls.get("all_reduce_tp_grads", 0)
    vocab = sum(tp_calls.get(p, 0) for p in VOCAB_PURPOSES)
    tp_bytes = sum(tp_row["comm_bytes_per_step_by_purpose"].get(p, 0) for p in TP_PURPOSES + VOCAB_PURPOSES)
    dp_purposes = ("reduce_scatter_grads", "all_gather_params")
    dp_calls = sum(dp_row["comm_calls_per_step_by_purpose"].get(p, 0) for p in dp_purposes)
    dp_bytes = sum(dp_row["comm_bytes_per_step_by_purpose"].get(p, 0) for p in dp_purposes)
    tp_probe, dp_probe = tp_row["tp_all_reduce_probe_ms"], dp_row["dp_reduce_grads_probe_ms"]
    tp_cost = (f"; alone, one such all-reduce takes {tp_probe:.2f} ms here, so these {fwd + bwd:g} cost about "
               f"{(fwd + bwd) * tp_probe:.0f} ms of the {a:.0f} ms step") if tp_probe is not None else ""
    dp_cost = (f"; alone, its reduce-scatter takes {dp_probe:.1f} ms and the all-gather moves the same bytes, so "
               f"about {2 * dp_probe:.0f} ms of the {b:.0f} ms step") if dp_probe is not None else ""
    why = (f"Each TP2 step makes {fwd:g} all-reduces of activations in the forward and {bwd:g} of their gradients in "
           f"the backward ({fwd / n_layer:g} forward and {bwd / n_layer:g} backward per block; with the vocabulary's "
           f"{vocab:g} (embedding, head, loss), {megabytes(tp_bytes)} sent per rank), each one a blocking gloo call over loopback between two matmuls, "
           f"on the critical path{tp_cost}. TP1 x DP2 communicates once per step, after the backward: {dp_calls:g} "
           f"reduce-scatter and all-gather calls moving {megabytes(dp_bytes)} per rank (every gradient and parameter "
           f"of P = {dp_row['param_count']:,}){dp_cost}.")
    rest = ("The rest is compute, and waiting for the slower rank at every collective: a TP rank runs the replicated "
            "layers (embeddings, layer norms, the tied head, the loss) on the whole batch where a DP rank runs them "
            "on its half, its matmuls are half as wide, and it meets its TP peer at every all-reduce")
    if tp_probe is not None and dp_probe is not None:
        rest += (f": about {a - (fwd + bwd) * tp_probe:.0f} ms of TP2's step against {b - 2 * dp_probe:.0f} ms "
                 "of DP2's")
    why += f" {rest}."
    if not dp_bytes:
        return f"{verdict}. {why}"
    m = report["config"]["model"]
    scale = (f"TP's bytes grow with the tokens per step (micro-batch x seq x width, {(fwd + bwd) / n_layer:g} "
             f"all-reduces per block), DP's with the parameters: at this global batch ({report['global_batch']} x "
             f"{m['seq_len']} tokens) TP sends {tp_bytes / dp_bytes:.2f}x DP's bytes")
    return f"{verdict}. {why} {scale}."


def megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 or not nbytes else f"{nbytes / 1e3:.2f} KB"


def markdown(report: dict) -> str:
    m, mach = report["config"]["model"], report["machine"]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    lines = [
        f"# bench tp: GPT {m['n_layer']} layers / {m['n_head']} heads / {m['n_embd']} wide, seq {m['seq_len']}, "
        f"vocab {m['vocab_size']}; {mach['cpu_count']} cores, torch {mach['torch']}",
        "",
        f"Global batch {report['global_batch']} sequences on every mesh; {report['repeats']} alternating round(s) of "
        f"{report['warmup_steps']} warm-up + {report['timed_steps']} timed steps per mesh; step time: "
        f"{report['step_time']}; per-rank bytes: {report['per_rank_bytes']}; communication: {report['bytes_counted']}.",
        "",
        "| mesh | ranks x threads | micro | step ms median (p10-p90) | per round | tokens/s | params/rank | "
        "grads/rank | optimizer/rank | peak RSS/rank | sent/step/rank by purpose (calls) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report["rows"]:
        sent = ", ".join(f"{p} {megabytes(v)} ({r['comm_calls_per_step_by_purpose'][p]:g})"
                         for p, v in r["comm_bytes_per_step_by_purpose"].items())
        over = " (oversubscribed)" if r["oversubscribed"] else ""
        lines.append(
            f"| {r['mesh']} | {r['ranks']} x {r['threads_per_rank']}{over} | {r['micro_batch']} | "
            f"{r['step_ms_median']:.1f} ({r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}) | "
            f"{' / '.join(f'{t:.0f}' for t in r['step_ms_per_repeat'])} | {r['tokens_per_s']:,.0f} | "
            f"{mib(r['param_bytes_per_rank'])} | {mib(r['grad_bytes_per_rank'])} | "
            f"{mib(r['optimizer_bytes_per_rank'])} | {mib(r['peak_rss_bytes_per_rank'])} | {sent} |")
    if any(r["dp"] == 1 for r in report["rows"]):
        lines += ["", "With DP 1 the ZeRO collectives are called but move nothing."]
    lines.append("")
    ratio = report["param_bytes_ratio_tp2_vs_tp1"]
    if ratio is not None:
        met = report["met"]["param_bytes_ratio_tp2_vs_tp1"]
        lines.append(f"Per-rank parameter bytes, TP2 / TP1: {ratio:.3f} (target <= {PARAM_RATIO_TARGET}: "
                     f"{'met' if met else 'NOT met'}).")
    if report["explanation"]:
        lines += ["", report["explanation"]]
    load = report["load_average_1min"]
    lines += ["", f"Load average (1 min) on the {mach['cpu_count']} cores: {load['before']:.1f} before the run, "
                  f"{load['after']:.1f} after."]
    spread = max(max(r["step_ms_per_repeat"]) / min(r["step_ms_per_repeat"]) for r in report["rows"])
    if spread > ROUND_SPREAD_WARNING:
        lines.append(f"The rounds' medians of one mesh differ by up to {spread:.2f}x: the machine's load changed "
                     "during the run, and the paired ratio is the better comparison; rerun on a quiet machine.")
    if any(r["oversubscribed"] for r in report["rows"]):
        lines += ["", f"Oversubscribed meshes run more threads than the machine's {mach['cpu_count']} cores: their "
                      "step times measure the contention as much as the parallelism."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Three panels per mesh: step time; per-rank parameter, gradient and optimizer bytes; bytes sent per step."""
    plt = pyplot("bench tp's bench-tp.png")

    rows = report["rows"]
    names = [r["mesh"] for r in rows]
    x = range(len(rows))
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    median = [r["step_ms_median"] for r in rows]
    err = [[v - r["step_ms_p10"] for v, r in zip(median, rows)], [r["step_ms_p90"] - v for v, r in zip(median, rows)]]
    left.bar(x, median, color=[f"C{i}" for i in x], yerr=err, capsize=4)
    left.set(title="optimizer step, ms (median, p10-p90)")

    width = 0.27
    for i, (key, label) in enumerate((("param_bytes_per_rank", "parameters"), ("grad_bytes_per_rank", "gradients"),
                                      ("optimizer_bytes_per_rank", "optimizer"))):
        mid.bar([j + (i - 1) * width for j in x], [r[key] / 2**20 for r in rows], width, label=label)
    mid.set(title="held per rank, MiB (max over ranks)")

    bottom = [0.0] * len(rows)
    for i, purpose in enumerate(STEP_PURPOSES):
        values = [r["comm_bytes_per_step_by_purpose"].get(purpose, 0) / 1e6 for r in rows]
        if any(values):
            right.bar(x, values, bottom=bottom, label=purpose, color=f"C{i + 3}")
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set(title="sent per step by rank 0, MB")
    for ax in (left, mid, right):
        ax.set_xticks(list(x), names)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    for ax in (mid, right):  # below the panel, clear of the bars
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small", frameon=False)
    m = report["config"]["model"]
    fig.suptitle(f"zerotrain bench tp: GPT {m['n_layer']}x{m['n_embd']}, seq {m['seq_len']}, "
                 f"global batch {report['global_batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
