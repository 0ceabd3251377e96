"""Benchmark packed records against one record per row (`--no-pack`): trained tokens per second on the same records.

    python scripts/bench_packing.py [--records 600] [--seq-len 512] [--micro-batch 8] [--steps 20] [--rounds 2]

The records are prompt/completion pairs of made-up words whose lengths follow a lognormal distribution (median about
a fifth of the window, a long tail past it), as instruction data sets have them. Each variant is one `zerotrain
train --preset bench` run on one rank, in a process of its own, the variants alternating over the rounds; the
figure is summary.json's median trained tokens/s (trained: the completion tokens the loss counts, not padding).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile


def write_records(path: str, n: int, seq_len: int) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlcumwfgyp") for _ in range(rng.randint(2, 8))) for _ in range(2000)]
    with open(path, "w") as f:
        for _ in range(n):
            length = max(4, int(rng.lognormvariate(math.log(seq_len / 5), 0.8)))  # bytes, about a token each
            text = " ".join(rng.choice(words) for _ in range(max(2, length // 6)))
            cut = len(text) // 3
            f.write(json.dumps({"prompt": text[:cut], "completion": text[cut:]}) + "\n")


def run(data: str, out: str, args, pack: bool) -> dict:
    argv = [sys.executable, "-m", "zerotrain", "train", "--preset", "bench", "--data", data, "--seq-len",
            str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--val-fraction",
            "0", "--truncate", "--no-progress", "--out", out] + ([] if pack else ["--no-pack"])  # a few are longer
    subprocess.run(argv, check=True, capture_output=True, text=True)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"tokens_per_s": summary["throughput"]["tokens_per_s_per_rank"], "tokens": summary["tokens"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="zerotrain-bench-packing-")
    try:
        data = os.path.join(folder, "records.jsonl")
        write_records(data, args.records, args.seq_len)
        seen: dict[str, list[float]] = {"packed": [], "--no-pack": []}
        for r in range(args.rounds):
            order = ("packed", "--no-pack") if r % 2 == 0 else ("--no-pack", "packed")
            for name in order:
                out = os.path.join(folder, f"{name.strip('-')}-{r}")
                seen[name].append(run(data, out, args, name == "packed")["tokens_per_s"])
        packed, unpacked = statistics.median(seen["packed"]), statistics.median(seen["--no-pack"])
        print(f"| {args.records} records, --seq-len {args.seq_len}, micro-batch {args.micro_batch}, {args.steps} steps, "
              f"{args.rounds} rounds | trained tokens/s (median) |")
        print("| --- | ---: |")
        print(f"| packed | {packed:,.0f} |")
        print(f"| --no-pack | {unpacked:,.0f} |")
        print(f"| packed / --no-pack | {packed / unpacked:.2f}x |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
