"""Training tokens/s at --cp 2 beside --cp 1: one rank holding each row whole, two DP ranks each holding whole rows
(the same two processes as --cp 2, no ring), and two CP ranks each holding half of every row (ring attention).

    PYTHONPATH=src python scripts/bench_cp.py [--seq-len 2048] [--steps 10] [--rounds 4]

Every variant trains the same global batch (2 rows of --seq-len tokens a step) of a Llama (4 blocks, width 128, 4
heads over 2 KV heads) on the synthetic data, one thread a rank. Each run is `zerotrain train` in a session of its own
(setsid), one at a time, the variants' order rotated each round; the figure is the run's median step's tokens/s (every
rank's tokens: summary.json's per-rank figure x the ranks). --cp 2 against 2 DP ranks is the ring's cost: the same
processes and tokens, the keys and values sent around the ring and each rank attending over both halves of its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--preset", "llama-tiny", "--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--n-kv-head", "2",
         "--intermediate-size", "256", "--vocab-size", "256", "--data", "synthetic"]
# name -> (ranks, the flags beyond the model's): the same global batch of 2 rows each
VARIANTS = {"--cp 1, 1 rank": (1, ["--micro-batch", "2"]),
            "--cp 1, 2 DP ranks": (2, ["--micro-batch", "1"]),
            "--cp 2, 2 ranks": (2, ["--micro-batch", "2", "--cp", "2"])}


def run(name: str, out: str, args) -> float:
    ranks, flags = VARIANTS[name]
    argv = [sys.executable, "-m", "zerotrain", "train", *MODEL, *flags, "--nproc", str(ranks), "--seq-len",
            str(args.seq_len), "--steps", str(args.steps), "--threads", "1", "--val-fraction", "0", "--no-progress",
            "--out", out]
    subprocess.run(argv, check=True, capture_output=True, text=True, start_new_session=True)  # setsid
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["throughput"]["tokens_per_s_per_rank"] * ranks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="zerotrain-bench-cp-")
    names = list(VARIANTS)
    seen: dict[str, list[float]] = {name: [] for name in names}
    try:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated each round
                seen[name].append(run(name, os.path.join(folder, f"round{r}-variant{names.index(name)}"), args))
                print(f"round {r + 1} {name}: {seen[name][-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    one = statistics.median(seen[names[0]])
    print(f"| --seq-len {args.seq_len}, 2 rows a step, {args.steps} steps, {args.rounds} rounds | tokens/s (median) | "
          "each round's | x 1 rank |")
    print("| --- | ---: | --- | ---: |")
    for name in names:
        median = statistics.median(seen[name])
        print(f"| {name} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in seen[name])} | {median / one:.2f} |")


if __name__ == "__main__":
    main()
