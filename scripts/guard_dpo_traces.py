"""Record healthy DPO runs and write tests/guard_dpo_traces.json: held-out traces the guard's constants never saw.

Each trace is one in-process `train` of --method dpo (one rank) on the tests' tiny random Llama (V = 400,
tests/model_folders.llama_folder) from its own weights, 60 steps at a constant learning rate, the guard out of the
way (a window of 1: no test against the trend; DPO's rule has no ratio test): the loss (4 decimals), gradient norm
(3) and pairs of each step. The grid: the sigmoid, hinge and ipo losses x clean pairs (8 sums, one prompt cut) or 32
pairs with 15% of their labels flipped x (pairs a step, lr) in (1, 1e-2), (2, 3e-2), (4, 3e-3), (4, 1e-2) x seeds 1
and 2 (48 runs, about 5 minutes on 2 cores). The guard's DPO bars were set on seed 0 of a few of these settings.

    PYTHONPATH=src python scripts/guard_dpo_traces.py
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile

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


def main() -> int:
    traces = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        llama_folder(base, template=CHATML)
        for kind in ("clean", "noisy"):
            data = write_jsonl(os.path.join(tmp, f"{kind}.jsonl"), pairs(kind))
            for loss in LOSSES:
                for micro, lr in SETTINGS:
                    for seed in SEEDS:
                        traces[f"{loss}-{kind}-pairs{micro}-lr{lr:g}-seed{seed}"] = record(tmp, base, data, loss,
                                                                                          micro, lr, seed)
    lines = [f" {json.dumps(name)}: {json.dumps(t, separators=(',', ':'))}" for name, t in traces.items()]
    with open(OUT, "w") as f:
        f.write(f'{{"steps": {STEPS}, "traces": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {len(traces)} traces to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
