"""Record healthy --method sft runs the guard's constants never saw and write tests/guard_heldout_sft_traces.json.

The constants were set on tests/guard_healthy_traces.json (scripts/guard_healthy_traces.py: the default
configuration's first 300 steps on python-stdlib, seeds from 0). These are other seeds, shapes, data and learning
rates: in-process `train` (one rank) for STEPS steps, the guard out of the way (a window of 1, a factor of 1e9): the
loss (4 decimals), gradient norm (3) and trained tokens of each step, and the vocabulary the run's ln(V) is of.
  - scratch: the tests' tiny GPT-2 (tests/conftest.tiny_config) on synthetic data, lr 3e-3, seeds 1 to 3
  - llama: a tiny Llama (2 x 32, 4 heads, 2 kv heads) on synthetic-varlen (records of varying length), seeds 1, 2
  - init-from: the tests' tiny random Llama (V = 400, tests/model_folders.llama_folder) fine-tuned on 300 short
    text records at a fine-tuning lr 2e-5 (seeds 1, 2) and at 1e-3 (seed 1): several epochs, each ending on a
    partial step
8 runs, about 4 minutes on 2 busy cores.

    PYTHONPATH=src python scripts/guard_heldout_sft_traces.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from conftest import tiny_config, world_of_one  # noqa: E402
from model_folders import TEXTS, llama_folder, write_jsonl  # noqa: E402

from zerotrain.hub.init_from import adopt, weight_source  # noqa: E402
from zerotrain.training.loop import train  # noqa: E402

OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "guard_heldout_sft_traces.json"))
STEPS = 100
GUARD_OFF = dict(spike_window=1, spike_factor=1e9, on_anomaly="abort")
LLAMA = dict(arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64)  # --preset llama-tiny


def record(folder: str, base: str | None = None, **run) -> dict:
    cfg = tiny_config(folder, steps=STEPS, warmup_steps=10, **GUARD_OFF, **run)
    if base:
        cfg.model = adopt(cfg.model, weight_source(base), {"seq_len"})
    with world_of_one() as comm:
        train(cfg, comm, announce=False)
    with open(cfg.logging.metrics) as f:
        steps = [r for r in map(json.loads, f) if "event" not in r and "loss" in r]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    return {"vocab_size": cfg.model.vocab_size, "losses": [round(s["loss"], 4) for s in steps],
            "grad_norms": [round(s["grad_norm"], 3) for s in steps], "tokens": [s["tokens"] for s in steps]}


def main() -> int:
    traces = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {f"gpt2-synthetic-scratch-seed{s}": dict(seed=s) for s in (1, 2, 3)}
        runs.update({f"llama-synthetic-varlen-scratch-seed{s}": dict(seed=s, data="synthetic-varlen", **LLAMA)
                     for s in (1, 2)})
        base = os.path.join(tmp, "base")
        llama_folder(base)
        texts = write_jsonl(os.path.join(tmp, "texts.jsonl"), [{"text": t} for t in TEXTS])
        for lr, seeds in ((2e-5, (1, 2)), (1e-3, (1,))):
            runs.update({f"llama-v400-init-from-lr{lr:g}-seed{s}": dict(seed=s, init_from=base, data=texts, lr=lr,
                                                                         seq_len=32, val_fraction=0.0)
                         for s in seeds})
        for name, run in runs.items():
            base_of = run.get("init_from")
            traces[name] = record(os.path.join(tmp, name), base_of, **run)
            print(f"{name}: loss {traces[name]['losses'][0]} -> {traces[name]['losses'][-1]}, tokens "
                  f"{min(traces[name]['tokens'])}-{max(traces[name]['tokens'])}", flush=True)
    lines = [f" {json.dumps(name)}: {json.dumps(t, separators=(',', ':'))}" for name, t in traces.items()]
    with open(OUT, "w") as f:
        f.write(f'{{"held_out": true, "steps": {STEPS}, "traces": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {len(traces)} traces to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
