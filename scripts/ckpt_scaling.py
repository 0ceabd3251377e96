#!/usr/bin/env python
"""Checkpoint verification + load time by world size under slow storage (issue #26's 16-rank target).

For each world size W (default 2, 4, 8, 16) on this machine's CPU ranks:

1. save: train a small model 1 step on W ranks with --ckpt-every 1 (no fault);
2. resume: copy that run folder and continue it on W ranks with `--resume auto --steps 2` (a restart: the newest
   checkpoint that verifies is found, verified and loaded);
3. reshard: start a run on W/2 ranks with `--resume <step folder> --steps 2` (another world size: verified, then
   read by ranges).

2 and 3 each run twice, alternated: plain, and with ZEROTRAIN_FAULTS slow_storage@step=0 on every rank, each file
read or written costing F s per MiB (at least F per file). F is chosen so that ONE reader of the whole checkpoint
would spend --one-reader-s seconds (default 45). The storage time is (elapsed slow) - (elapsed plain), so that the
start-up of W ranks on few cores cancels. If time scales with each rank's share, it is about F x (checkpoint MiB /
readers): the `ideal` column.

The launcher process (which, where the product verifies there, verifies before any rank starts) is not a rank, and
ZEROTRAIN_FAULTS does not reach it; by default (--launcher-slow) this script starts the launcher through a small shim
that puts the launcher on the same slow storage and reports how long its preparation (prepare_run: --resume's
verification) took and how many checkpoint bytes it read. --no-launcher-slow leaves it at disk speed.

    python scripts/ckpt_scaling.py --root /tmp/ckm/scaling            # main's zerotrain, 2 4 8 16 ranks
    python scripts/ckpt_scaling.py --worlds 2,4 --one-reader-s 20     # quicker
    PYTHONPATH=/other/tree/src python scripts/ckpt_scaling.py ...     # another tree's zerotrain

Writes <root>/ckpt_scaling.json (every run) and <root>/ckpt_scaling.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

MIB = 1 << 20

# Run as the launcher: slow storage (if asked) and a record of prepare_run's time and bytes, then zerotrain's CLI.
SHIM = r"""
import atexit, json, os, sys, time
from zerotrain.checkpoint import stream
from zerotrain.runtime import launch
factor = float(os.environ.get("CKS_LAUNCHER_SLOW", "0") or 0)
if factor:
    stream.slow_storage(factor)
record = {"prepare_s": None}
_run_job = launch.run_job
def run_job(job, cfg, *, prepare=None, **kw):
    if prepare is not None:
        inner = prepare
        def prepare(cfg):
            t0 = time.monotonic()
            try:
                return inner(cfg)
            finally:
                record["prepare_s"] = time.monotonic() - t0
    return _run_job(job, cfg, prepare=prepare, **kw)
launch.run_job = run_job
def _dump():
    record.update(stream.bytes_counted())
    with open(os.environ["CKS_LAUNCHER_RECORD"], "w") as f:
        json.dump(record, f)
atexit.register(_dump)
from zerotrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def model_flags(args) -> list[str]:
    flags = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
             "--vocab-size", str(args.vocab_size)]
    if args.preset:
        flags = ["--preset", args.preset]
    return flags + ["--seq-len", str(args.seq_len), "--micro-batch", "1", "--accum", "1", "--data", "synthetic",
                    "--threads", "1", "--no-progress"]


def run(args, name: str, nproc: int, extra: list[str], out: str, slow: float) -> dict:
    """One `zerotrain train` through the shim; its elapsed time, per-rank bytes and RSS, the launcher's record."""
    record_file = out + ".launcher.json"
    env = dict(os.environ, CKS_LAUNCHER_RECORD=record_file, CKS_LAUNCHER_SLOW=str(slow if args.launcher_slow else 0))
    env.pop("ZEROTRAIN_FAULTS", None)
    if slow:
        env["ZEROTRAIN_FAULTS"] = ";".join(f"slow_storage@step=0,rank={r},factor={slow:g}" for r in range(nproc))
    cmd = [sys.executable, "-c", SHIM, "train", *model_flags(args), "--nproc", str(nproc), *extra, "--out", out]
    load = os.getloadavg()
    t0 = time.monotonic()
    with open(out + ".log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
    elapsed = time.monotonic() - t0
    r = {"name": name, "nproc": nproc, "slow_s_per_mib": slow, "rc": proc.returncode, "elapsed_s": round(elapsed, 2),
         "load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
         "cmd": " ".join(cmd[:2] + ["<shim>"] + cmd[3:]), "faults": env.get("ZEROTRAIN_FAULTS", "")}
    try:
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        r["wall_s"] = s["wall_s"]
        for key in ("checkpoint_bytes_written", "checkpoint_bytes_read", "peak_rss_bytes"):
            r[key] = s["per_rank"].get(key)
    except (OSError, ValueError, KeyError) as e:
        r["summary_error"] = repr(e)
    try:
        with open(record_file) as f:
            r["launcher"] = json.load(f)
    except (OSError, ValueError) as e:
        r["launcher"] = {"error": repr(e)}
    if proc.returncode != 0:
        with open(out + ".log") as f:
            r["log_tail"] = f.read()[-2000:]
    print(f"  {name}: rc {proc.returncode}, {elapsed:.1f} s, launcher prepare "
          f"{r['launcher'].get('prepare_s')} s, load {r['load_before'][0]:.2f}", flush=True)
    return r


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def mib(n) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8,16", help="world sizes of the save (comma-separated)")
    p.add_argument("--root", default="/tmp/ckm/scaling", help="run folders go here (emptied first)")
    p.add_argument("--preset", default="", help="a model preset instead of the --n-* flags")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--factor", type=float, default=0.0, help="slow_storage's s per MiB (default: from --one-reader-s)")
    p.add_argument("--one-reader-s", type=float, default=45.0,
                   help="choose F so one reader of the whole checkpoint would take this long")
    p.add_argument("--launcher-slow", action=argparse.BooleanOptionalAction, default=True,
                   help="the launcher's own checkpoint reads on the same slow storage (default: on)")
    p.add_argument("--run-timeout", type=float, default=1200.0)
    p.add_argument("--label", default="", help="a name for this tree in the table's title (e.g. main@abc1234)")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if os.path.isdir(args.root):
        shutil.rmtree(args.root)
    os.makedirs(args.root)
    import zerotrain
    label = args.label or zerotrain.__file__
    print(f"zerotrain from {zerotrain.__file__}; runs in {args.root}", flush=True)
    runs, rows, factor = [], [], args.factor
    for w in worlds:
        base = os.path.join(args.root, f"w{w:02d}")
        os.makedirs(base)
        print(f"W={w}", flush=True)
        save = run(args, f"save W={w}", w, ["--steps", "1", "--ckpt-every", "1"], os.path.join(base, "save"), 0)
        runs.append(save)
        step = os.path.join(base, "save", "checkpoints", "step_00000001")
        if save["rc"] != 0 or not os.path.isdir(step):
            rows.append({"W": w, "error": "save failed"})
            continue
        ckpt = du(step)
        if not factor:
            factor = round(args.one_reader_s / (ckpt / MIB), 3)
            print(f"  checkpoint {ckpt / MIB:.1f} MiB: slow_storage factor {factor} s per MiB", flush=True)
        row = {"W": w, "ckpt_bytes": ckpt, "files": len(os.listdir(step)), "factor": factor,
               "save_written_max": max(save.get("checkpoint_bytes_written") or [0])}
        for kind, nproc in (("resume", w), ("reshard", max(w // 2, 1))):
            got = {}
            for slow in (0.0, factor):
                out = os.path.join(base, f"{kind}-{'slow' if slow else 'plain'}")
                if kind == "resume":
                    shutil.copytree(os.path.join(base, "save"), out)
                    extra = ["--steps", "2", "--resume", "auto"]
                else:
                    extra = ["--steps", "2", "--resume", step]
                r = run(args, f"{kind} W={w} on {nproc} {'slow' if slow else 'plain'}", nproc, extra, out, slow)
                runs.append(r)
                got[bool(slow)] = r
            plain, slowr = got[False], got[True]
            ok = plain["rc"] == 0 and slowr["rc"] == 0
            storage = slowr["elapsed_s"] - plain["elapsed_s"] if ok else None
            lp = [(g["launcher"].get("prepare_s") or 0.0) for g in (plain, slowr)]
            reads = slowr.get("checkpoint_bytes_read") or []
            row[kind] = {"readers": nproc, "ok": ok, "plain_s": plain["elapsed_s"], "slow_s": slowr["elapsed_s"],
                         "storage_s": storage, "launcher_prepare_s": round(lp[1], 2),
                         "launcher_storage_s": round(lp[1] - lp[0], 2),
                         "ranks_storage_s": None if storage is None else round(storage - (lp[1] - lp[0]), 2),
                         "ideal_s": round(factor * ckpt / MIB / nproc, 1),
                         "read_max_over_share": round(max(reads) / (ckpt / nproc), 2) if reads else None,
                         "read_max": max(reads) if reads else None, "read_min": min(reads) if reads else None,
                         "read_sum": sum(reads) if reads else None,
                         "launcher_read": slowr["launcher"].get("checkpoint_bytes_read"),
                         "loads": [plain["load_before"][0], slowr["load_before"][0]]}
        rows.append(row)
        with open(os.path.join(args.root, "ckpt_scaling.json"), "w") as f:
            json.dump({"label": label, "args": vars(args), "rows": rows, "runs": runs}, f, indent=1)
    md = table(rows, label, args)
    with open(os.path.join(args.root, "ckpt_scaling.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all("error" not in r and r["resume"]["ok"] and r["reshard"]["ok"] for r in rows) else 1


def table(rows: list[dict], label: str, args) -> str:
    lines = [f"### Checkpoint verification + load under slow_storage: {label}", "",
             f"Model: {args.preset or f'--n-layer {args.n_layer} --n-embd {args.n_embd} --n-head {args.n_head} --vocab-size {args.vocab_size}'}"
             f", seq {args.seq_len}; launcher on slow storage too: {args.launcher_slow}. Seconds are elapsed(slow) - "
             "elapsed(plain) of the same command; ideal = F x checkpoint MiB / readers; launcher = the launcher's "
             "prepare_run (slow minus plain); ranks = storage - launcher. Bytes read per rank are the slow run's; "
             "share = checkpoint / readers.", "",
             "| W | ckpt MiB | F s/MiB | resume on W: storage s | launcher s | ranks s | ideal s | read/rank max MiB "
             "(min) | max / share | launcher read MiB | reshard on W/2: storage s | launcher s | ranks s | ideal s | "
             "read/rank max MiB (min) | max / share | launcher read MiB | load avg (plain, slow) |",
             "|" + "---|" * 18]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['W']} | {r['error']} |" + " |" * 16)
            continue
        cells = [str(r["W"]), mib(r["ckpt_bytes"]), f"{r['factor']:g}"]
        loads = []
        for kind in ("resume", "reshard"):
            k = r[kind]
            fmt = (lambda x: "-" if x is None else f"{x:.1f}")
            cells += [fmt(k["storage_s"]) + ("" if k["ok"] else " (failed)"), fmt(k["launcher_storage_s"]),
                      fmt(k["ranks_storage_s"]), fmt(k["ideal_s"]), f"{mib(k['read_max'])} ({mib(k['read_min'])})",
                      fmt(k["read_max_over_share"]), mib(k["launcher_read"])]
            loads.append("/".join(f"{x:.1f}" for x in k["loads"]))
        cells.append("; ".join(loads))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
