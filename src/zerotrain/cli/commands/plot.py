"""`zerotrain plot RUN_DIR`: train and validation loss, learning rate and tokens/s over steps, as one PNG."""

from __future__ import annotations

import argparse
import os

from zerotrain.cli.figures import pyplot
from zerotrain.errors import ConfigError
from zerotrain.training.metrics import read_step_records

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's metrics (loss, val loss, learning rate, tokens/s) to a PNG",
                       description="Reads RUN_DIR/metrics.jsonl and writes a PNG (default RUN_DIR/metrics.png). "
                                   "Needs matplotlib: pip install 'zerotrain[plot]'.")
    p.add_argument("run_dir", help="a run folder (holding metrics.jsonl) or a metrics JSONL file")
    p.add_argument("--out", help="PNG path (default <run_dir>/metrics.png)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    path = args.run_dir if os.path.isfile(args.run_dir) else os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"plot {args.run_dir}: no metrics.jsonl there")
    records = read_step_records(path)
    if not records:
        raise ConfigError(f"plot {path}: no step records to plot")
    plt = pyplot("zerotrain plot")
    out = args.out or os.path.join(os.path.dirname(path), "metrics.png")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 3.6), dpi=110)
    steps = [r["step"] for r in records]
    for ax, (key, title) in zip(axes, PANELS):
        ax.plot(steps, [r.get(key) for r in records], label="train" if key == "loss" else None, lw=1.2)
        if key == "loss":
            val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
            if val:
                ax.plot(*zip(*val), "o-", label="val", lw=1.2, ms=3)
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(path))))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"zerotrain: wrote {out} ({len(records)} steps)")
    return 0
