"""Record healthy DPO runs and write tests/guard_dpo_traces.json: held-out traces the guard's constants never saw.

Each trace is one in-process `train` of --method dpo (one rank) on the tests' tiny random Llama (V = 400,
tests/model_folders.llama_folder) from its own weights, 60 steps at a constant learning rate, the guard out of the
way (a window of 1: no test against the trend; DPO's rule has no ratio test): the loss (4 decimals), gradient norm
(3) and pairs of each step. The grid: the sigmoid, hinge and ipo losses x clean pairs (8 sums, one prompt cut) or 32
pairs with 15% of their labels flipped x (pairs a step, lr) in (1, 1e-2), (2, 3e-2), (4, 3e-3), (4, 1e-2) x seeds 1
and 2: 48 runs of 15 to 130 s each on 2 cores shared with other work (the file's 48: 12 recorded first, then 36 in
15 minutes). The guard's DPO bars were set on seed 0 of a few of these settings. Runs already in the file
are kept (a run is deterministic: rerun, it writes the same trace), so an interrupted run or one stopped by
--time-limit goes on where it stopped.

    PYTHONPATH=src python scripts/guard_dpo_traces.py [--time-limit SECONDS]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from conftest import tiny_config, world_of_one  # noqa: E402
from model_folders import CHATML, llama_folder, write_jsonl  # noqa: E402

from zerotrain.hub.init_from import adopt, weight_source  # noqa: E402
from zerotrain.training.loop import train  # noqa: E402

OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "guard_dpo_traces.json"))
LOSSES = ("sigmoid", "hinge", "ipo")
SETTINGS = ((1, 1e-2), (2, 3e-2), (4, 3e-3), (4, 1e-2))  # (pairs a step, lr)
SEEDS = (1, 2)
STEPS = 60


def pairs(kind: str) -> list[dict]:
    """clean: the DPO tests' eight sums (tests/test_dpo.PLAIN); noisy: 32 sums, 15% of them with chosen and
    rejected swapped, as preference data with label noise has."""
    if kind == "clean":
        long = "The user asks and the assistant answers. " * 3
        return [{"prompt": ("" if i != 3 else long) + f"Question {i}: what is {i} plus {i}?",
                 "chosen": f" Answer: {2 * i}.", "rejected": f" Answer: {2 * i + 1}."} for i in range(8)]
    rng, out = random.Random(0), []
    for i in range(32):
        a, b = rng.randrange(50), rng.randrange(50)
        good, bad = f" Answer: {a + b}.", f" Answer: {a + b + rng.choice([1, -1, 10])}."
        if rng.random() < 0.15:
            good, bad = bad, good
        out.append({"prompt": f"Question {i}: what is {a} plus {b}?", "chosen": good, "rejected": bad})
    return out


def record(tmp: str, base: str, data: str, loss: str, micro: int, lr: float, seed: int) -> dict:
    cfg = tiny_config(os.path.join(tmp, f"run-{loss}-{micro}-{lr}-{seed}"), steps=STEPS, micro=micro, seq_len=32,
                      data=data, init_from=base, method="dpo", dpo_loss=loss, warmup_steps=0, min_lr_ratio=1.0,
                      lr=lr, weight_decay=0.0, beta2=0.95, grad_clip=1.0, peak_flops=1e12, seed=seed,
                      spike_window=1, on_anomaly="abort")
    cfg.model = adopt(cfg.model, weight_source(base), {"seq_len"})
    with world_of_one() as comm:
        train(cfg, comm, announce=False)
    with open(cfg.logging.metrics) as f:
        steps = [r for r in map(json.loads, f) if "event" not in r and "loss" in r]
    return {"losses": [round(s["loss"], 4) for s in steps], "grad_norms": [round(s["grad_norm"], 3) for s in steps],
            "pairs": micro}


def write(traces: dict) -> None:
    lines = [f" {json.dumps(name)}: {json.dumps(t, separators=(',', ':'))}" for name, t in traces.items()]
    with open(OUT, "w") as f:
        f.write(f'{{"steps": {STEPS}, "traces": {{\n' + ",\n".join(lines) + "\n}}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-limit", type=float, default=math.inf, help="seconds: start no run after this")
    args = p.parse_args()
    start = time.monotonic()
    traces = {}
    if os.path.exists(OUT):  # the runs already recorded are kept (each is deterministic: a rerun writes the same)
        with open(OUT) as f:
            traces = json.load(f)["traces"]
    # seed- and setting-major, so a run stopped by --time-limit has each loss and data at a setting before the next
    grid = [(seed, kind, loss, micro, lr) for seed in SEEDS for micro, lr in SETTINGS for kind in ("clean", "noisy")
            for loss in LOSSES]
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        llama_folder(base, template=CHATML)
        data = {kind: write_jsonl(os.path.join(tmp, f"{kind}.jsonl"), pairs(kind)) for kind in ("clean", "noisy")}
        for seed, kind, loss, micro, lr in grid:
            name = f"{loss}-{kind}-pairs{micro}-lr{lr:g}-seed{seed}"
            if name in traces:
                continue
            if time.monotonic() - start > args.time_limit:
                break
            traces[name] = record(tmp, base, data[kind], loss, micro, lr, seed)
            write(traces)  # as it goes: a stopped run keeps what it recorded
            print(f"{len(traces)}/{len(grid)} runs, {time.monotonic() - start:.0f} s", flush=True)
    print(f"wrote {len(traces)} traces to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
