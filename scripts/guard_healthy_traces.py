"""Record the default configuration's first steps and write tests/guard_healthy_traces.json (issue 37).

Each trace is one run of `zerotrain train` recorded by `zerotrain bench spikes`' record_healthy (bench/spikes.py:
HEALTHY_SHAPES, HEALTHY_STARTS; one rank at --accum 2, the global batch of --nproc 2; the guard out of the way;
stopped after 300 steps): the losses (4 decimals) and gradient norms (3) of steps 1, 2, ... that the guard sees.
Runs already under --traces (the bench's folder) are reused, so this costs nothing after `zerotrain bench spikes`.

    python scripts/guard_healthy_traces.py [--traces runs/spikes/traces]    # about 30 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os

from zerotrain.bench.spikes import HEALTHY_SHAPES, HEALTHY_STARTS, HEALTHY_VOCAB, healthy_name, record_healthy

OUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "guard_healthy_traces.json"))
SEEDS = {"scratch": 5, "long-warmup": 1, "init-from": 1}  # per shape: 21 runs, 80 KB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=os.path.join("runs", "spikes", "traces"))
    args = p.parse_args()
    os.makedirs(args.traces, exist_ok=True)
    traces = {}
    for start in HEALTHY_STARTS:
        record_healthy(args.traces, list(HEALTHY_SHAPES), [start], SEEDS[start], time_limit=1800.0)
        for shape in HEALTHY_SHAPES:
            for seed in range(SEEDS[start]):
                with open(os.path.join(args.traces, healthy_name(shape, start, seed))) as f:
                    steps = json.load(f)["steps"]
                assert [s[0] for s in steps] == list(range(1, len(steps) + 1))
                traces[f"{shape}-{start}-seed{seed}"] = {"losses": [round(s[1], 4) for s in steps],
                                                         "grad_norms": [round(s[2], 3) for s in steps]}
    lines = [f" {json.dumps(name)}: {json.dumps(t, separators=(',', ':'))}" for name, t in traces.items()]
    with open(OUT, "w") as f:
        f.write(f'{{"vocab_size": {HEALTHY_VOCAB}, "shapes": {json.dumps(HEALTHY_SHAPES)},\n'
                f'"starts": {json.dumps(HEALTHY_STARTS)}, "traces": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {len(traces)} traces to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
