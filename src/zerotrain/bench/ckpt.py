"""`zerotrain bench ckpt`: checkpoint save, load and verify speed against the disk's, and what an async save costs training.

One rank, in this process, on a GPT of the chosen preset (gpt2: 124M parameters, 2 GB per
checkpoint). Every figure is measured in the same run, into the same folder:

    disk_write_gbps   the checkpoint's bytes written as one plain file, then fsynced: the ceiling
    save_gbps         a synchronous save (write + sha256 + fsync + commit) of those bytes
    file_write_gbps   one shard file written three ways: sha256 in a thread (what saves use), sha256
                      inline, and safetensors.save_file followed by re-reading the file to hash it
    load_gbps         a verified load (bytes hashed as read, checked, restored) of this rank's shard
    verify_s          `zerotrain verify` of the whole checkpoint
    async_stall_s     training time one async save costs: windows of K steps with and without a save
                      started at their first step boundary, alternated; the difference of medians
    async_kept        whether a run with --async-save keeps saving in the background here: it does while an
                      async save costs training no more than a synchronous save (checkpoint.checkpointer.AsyncCost)

Targets: save >= 0.8x the disk's bandwidth; an async save's stall <= 0.1x a synchronous save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from zerotrain import checkpoint
from zerotrain.checkpoint.stream import sha256_file, write_durably, write_safetensors
from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE, PRESETS, Config, resolve, validate
from zerotrain.data import BatchSchedule, make_source
from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm
from zerotrain.training.schedule import lr_at

from .report import report_header, write_report

SCHEMA = "zerotrain.bench.ckpt"
SAVE_TARGET, STALL_TARGET = 0.8, 0.1  # save_gbps / disk_write_gbps >= ; async_stall_s / sync_save_s <=
# seq_len is cut to 128 for gpt2 (123.8M parameters instead of 124.4M): one training step on the CPU
# stays a few seconds, so the async windows fit in minutes; the checkpoint's bytes barely change.
SIZES = {
    "full": dict(preset="gpt2", seq_len=128, micro_batch=1, repeats=3),
    "quick": dict(preset="wide", seq_len=64, micro_batch=4, repeats=3),
}


def add_parser(benches) -> None:
    p = benches.add_parser("ckpt", help="checkpoint save/load/verify throughput vs the disk, and async-save stall",
                           description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="--preset wide: under a minute")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default gpt2, --quick wide)")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="repetitions of each measurement (default 3)")
    p.add_argument("--threads", type=checked(int, NON_NEGATIVE), default=0, help="torch threads for the training steps (0: torch's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default="", help="folder for bench-ckpt.json/.md and the scratch checkpoints")
    p.set_defaults(func=cmd_ckpt)


def cmd_ckpt(args: argparse.Namespace) -> int:
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.preset:
        size["preset"] = args.preset
    if args.repeats is not None:
        size["repeats"] = args.repeats
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    if dist.is_initialized():
        raise ConfigError("bench ckpt runs its own one-rank process group; run it from a fresh process")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or os.path.join("runs", "ckpt-" + time.strftime("%Y%m%d-%H%M%S"))
    scratch = os.path.join(out, "scratch")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    cfg = _config(size, args.device, out)
    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        figures = measure(cfg, Comm(), scratch, size["repeats"])
    finally:
        dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {
        **report_header(SCHEMA),
        "preset": size["preset"],
        "model": vars(cfg.model),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "repeats": size["repeats"],
        **figures,
        "targets": {"save_vs_disk_min": SAVE_TARGET, "async_stall_vs_sync_save_max": STALL_TARGET},
        "met": {"save_vs_disk": figures["save_vs_disk"] >= SAVE_TARGET,
                "async_stall": figures["async_stall_vs_sync_save"] <= STALL_TARGET},
        "wall_s": time.perf_counter() - t0,
    }
    write_report(out, "bench-ckpt", report, markdown(report))
    return 0


def _config(size: dict, device: str, out: str) -> Config:
    cfg = Config()
    for k, v in PRESETS[size["preset"]].items():
        setattr(cfg.model, k, v)
    cfg.model.seq_len = min(cfg.model.seq_len, size["seq_len"])
    cfg.loop.micro_batch, cfg.launch.device, cfg.logging.out, cfg.logging.progress = size["micro_batch"], device, out, False
    cfg.parallel.overlap = "off"  # nothing in flight at the step boundary: the stall is the save's alone
    cfg.data.source = "synthetic"
    return resolve(validate(cfg))


def measure(cfg: Config, comm: Comm, scratch: str, repeats: int) -> dict:
    """Every figure of the report, from one engine trained a step at a time."""
    engine, train_step, steps = _trainer(cfg, comm)
    train_step()  # warm-up: allocations, first-call costs
    writer = checkpoint.CheckpointWriter(os.path.join(scratch, "checkpoints"), comm, keep=2, async_save=True)
    extra = {"config": cfg.to_dict()}
    nbytes, shard_bytes = _checkpoint_sizes(writer, engine, extra, steps[0])
    disk_s, sync_s = _disk_and_sync_saves(train_step, writer, engine, extra, steps, scratch, nbytes, repeats)
    path = os.path.join(writer.root, checkpoint.step_name(steps[0]))
    file_s = _file_writes(os.path.join(scratch, "file.safetensors"), engine, repeats)
    load_s, verify_s = _loads_and_verifies(path, engine, comm, repeats)
    stall = _async_stall(train_step, writer, engine, extra, steps, repeats, statistics.median(sync_s))
    return _figures(engine.layout.numel, nbytes, shard_bytes, disk_s=disk_s, sync_s=sync_s, file_s=file_s,
                    load_s=load_s, verify_s=verify_s, stall=stall)


def _trainer(cfg: Config, comm: Comm) -> tuple:
    """The engine, a function that trains it one step further, and the one-item list counting its steps."""
    from zerotrain.training.loop import accumulate_gradients, build_engine

    engine = build_engine(cfg, comm)
    schedule = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=1, rank=0, world_size=1)
    steps = [0]

    def train_step() -> None:
        batch = schedule.batch(steps[0])
        engine.zero_grad()
        accumulate_gradients(engine, batch)
        norm, _ = engine.reduce_grads(torch.zeros(0))
        engine.apply(lr_at(steps[0], cfg.optim, 10_000), norm)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        steps[0] += 1

    return engine, train_step, steps


def _checkpoint_sizes(writer, engine, extra: dict, step: int) -> tuple[int, int]:
    """Bytes of the whole checkpoint and of this rank's shard, from one untimed save."""
    _, _, manifest = writer.save(step, engine, extra)
    nbytes = sum(f["bytes"] for f in manifest["files"])
    shard = checkpoint.shard_name(0, 1)
    shard_bytes = next(f["bytes"] for f in manifest["files"] if f["name"] == shard)
    return nbytes, shard_bytes


def _disk_and_sync_saves(train_step, writer, engine, extra: dict, steps: list[int], scratch: str, nbytes: int,
                         repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each plain-file write of the checkpoint's bytes and of each synchronous save, alternated."""
    sync_s, disk_s = [], []
    plain = os.path.join(scratch, "plain.bin")

    def sync_save() -> float:
        t0 = time.perf_counter()
        writer.save(steps[0], engine, extra)
        return time.perf_counter() - t0

    ways = [(disk_s, lambda: _plain_write(plain, _plain_views(engine, nbytes))), (sync_s, sync_save)]
    for r in range(repeats):
        # The order alternates: what ran before (a deletion, writeback still draining) weighs on each in turn.
        train_step()
        for times, run in ways[r % 2 :] + ways[: r % 2]:
            times.append(run())
    return disk_s, sync_s


def _loads_and_verifies(path: str, engine, comm: Comm, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each verified load of the checkpoint at `path` and of each verify of it, one after the other."""
    load_s, verify_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        checkpoint.load_checkpoint(path, engine, comm)
        load_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpoint.verify_or_raise(path)
        verify_s.append(time.perf_counter() - t0)
    return load_s, verify_s


def _figures(param_count: int, nbytes: int, shard_bytes: int, *, disk_s: list[float], sync_s: list[float],
             file_s: dict[str, list[float]], load_s: list[float], verify_s: list[float], stall: dict) -> dict:
    """The report's figures from the timings: medians, bandwidths, ratios, and every sample."""
    sync_save_s, disk = statistics.median(sync_s), nbytes / statistics.median(disk_s) / 1e9
    save = nbytes / sync_save_s / 1e9
    return {
        "param_count": param_count,
        "bytes": nbytes,
        "shard_bytes": shard_bytes,
        "disk_write_gbps": disk,
        "save_gbps": save,
        "save_vs_disk": save / disk,
        "sync_save_s": sync_save_s,
        "file_write_gbps": {way: shard_bytes / statistics.median(s) / 1e9 for way, s in file_s.items()},
        "load_bytes": shard_bytes,
        "load_gbps": shard_bytes / statistics.median(load_s) / 1e9,
        "load_s": statistics.median(load_s),
        "verify_s": statistics.median(verify_s),
        **stall,
        "async_stall_vs_sync_save": stall["async_stall_s"] / sync_save_s,
        "async_kept": stall["async_stall_s"] <= sync_save_s,
        "samples": {"sync_save_s": sync_s, "disk_write_s": disk_s, "load_s": load_s, "verify_s": verify_s,
                    **{f"file_write_s_{way}": s for way, s in file_s.items()}},
    }


def _plain_views(engine, nbytes: int) -> list[memoryview]:
    """`nbytes` of the engine's state as it sits in memory (restarting from the top if short of the files' headers)."""
    sd = engine.shard_state_dict()
    tensors = [t.detach().cpu().contiguous() for t in (engine.held_params.float(), sd["master"], sd["exp_avg"],
                                                       sd["exp_avg_sq"])]
    views, left = [], nbytes
    while left:
        for t in tensors:
            view = memoryview(t.view(torch.uint8).numpy()).cast("B")[:left]
            views.append(view)
            left -= view.nbytes
    return [v for v in views if v.nbytes]


def _plain_write(path: str, views: list[memoryview]) -> float:
    """Seconds to write the buffers as one plain file and fsync it: the disk's speed, no format, no hash.

    Through the writer's own write loop (write_durably), so the only differences from a save are the
    safetensors header, the sha256 and the commit.
    """
    t0 = time.perf_counter()
    write_durably(path, views)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return elapsed


def _file_writes(path: str, engine, repeats: int) -> dict[str, list[float]]:
    """One shard file written with sha256 in a thread, inline, and via save_file plus a re-read; seconds each."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in engine.shard_state_dict().items()}

    def save_file_then_hash():
        save_file(tensors, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        sha256_file(path)

    ways = {"hash_in_thread": lambda: write_safetensors(path, tensors),
            "hash_inline": lambda: write_safetensors(path, tensors, hash_in_thread=False),
            "save_file_then_hash": save_file_then_hash}
    times = {way: [] for way in ways}
    for _ in range(repeats):
        for way, write in ways.items():  # alternated, so drift in the machine's load hits all three
            t0 = time.perf_counter()
            write()
            times[way].append(time.perf_counter() - t0)
            os.remove(path)
    return times


def _async_stall(train_step, writer, engine, extra, steps, repeats, sync_save_s) -> dict:
    """Median time of K steps with an async save started at the first boundary, minus without; alternated.

    K covers the save with room to spare (from the step time and the synchronous save), and a save
    still running at the end of its window is waited for inside it: a stall is never hidden.
    """
    t0 = time.perf_counter()
    train_step()
    step_s = time.perf_counter() - t0
    window = max(2, int(2 * sync_save_s / step_s) + 2)
    writer.start(steps[0], engine, extra)  # untimed: the staging buffers are allocated by the first one
    writer.finish()
    plain, saving, start_s, steps_to_commit = [], [], [], []
    for r in range(2 * repeats):
        with_save = (r % 2 == 1) if (r // 2) % 2 == 0 else (r % 2 == 0)  # ABBA: order effects cancel
        t0 = time.perf_counter()
        if with_save:
            t1 = time.perf_counter()
            writer.start(steps[0], engine, extra)
            start_s.append(time.perf_counter() - t1)
        committed_after = None
        for i in range(window):
            train_step()
            if with_save and committed_after is None and writer.local_done():
                writer.commit_pending()
                committed_after = i + 1
        if with_save and committed_after is None:
            writer.finish()
            committed_after = window + 1
        (saving if with_save else plain).append(time.perf_counter() - t0)
        if with_save:
            steps_to_commit.append(committed_after)
    return {
        "async_stall_s": statistics.median(saving) - statistics.median(plain),
        "async_window_steps": window,
        "step_s": statistics.median(plain) / window,
        "async_start_s": statistics.median(start_s),
        "async_steps_to_commit": steps_to_commit,
        "samples_async": {"with_save_s": saving, "without_s": plain},
    }


def markdown(report: dict) -> str:
    gbps = report["file_write_gbps"]
    rows = [
        ("checkpoint size", f"{report['bytes'] / 1e9:.3f} GB ({report['param_count'] / 1e6:.1f}M parameters, "
                            f"shard {report['shard_bytes'] / 1e9:.3f} GB)", ""),
        ("disk: one plain file, write + fsync", f"{report['disk_write_gbps']:.2f} GB/s", ""),
        ("synchronous save", f"{report['save_gbps']:.2f} GB/s ({report['sync_save_s']:.2f} s), "
                             f"{report['save_vs_disk']:.2f}x the disk",
         f">= {SAVE_TARGET}x: {'met' if report['met']['save_vs_disk'] else 'NOT met'}"),
        ("one shard file, sha256 in a thread", f"{gbps['hash_in_thread']:.2f} GB/s", ""),
        ("one shard file, sha256 inline", f"{gbps['hash_inline']:.2f} GB/s", ""),
        ("one shard file, save_file + re-read for sha256", f"{gbps['save_file_then_hash']:.2f} GB/s", ""),
        ("verified load (own shard)", f"{report['load_gbps']:.2f} GB/s ({report['load_s']:.2f} s)", ""),
        ("verify (whole checkpoint)", f"{report['verify_s']:.2f} s", ""),
        ("training step", f"{report['step_s']:.3f} s ({report['threads']} threads)", ""),
        ("async save: start() returns in", f"{report['async_start_s'] * 1000:.1f} ms", ""),
        ("async save: training time lost", f"{report['async_stall_s']:.3f} s, "
                                           f"{report['async_stall_vs_sync_save']:.2f}x a synchronous save",
         f"<= {STALL_TARGET}x: {'met' if report['met']['async_stall'] else 'NOT met'}"),
        ("what --async-save does here", "keeps saving in the background" if report["async_kept"] else
         "saves synchronously after its first async save (which cost more than a synchronous one)", ""),
    ]
    m = report["machine"]
    head = (f"# bench ckpt: {report['preset']} on {report['device']}, {m['cpu_count']} cores, torch {m['torch']}\n\n"
            "| measure | result | target |\n|---|---|---|\n")
    return head + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
