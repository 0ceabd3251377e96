"""The run's metrics on rank 0: each step's record (JSONL, the progress line, TensorBoard, W&B) and the summary."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys

from tqdm import tqdm

from zerotrain.checkpoint import committed_steps
from zerotrain.config import Config
from zerotrain.durable import write_atomic
from zerotrain.errors import ConfigError

# What TensorBoard shows of a step record (W&B takes every number in it); a mixture's figures by source as KEY/NAME
BOARD_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_rank", "mfu",
              "rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracy", "logps_chosen",
              "logps_rejected", "val_rewards_margins", "val_rewards_accuracy",  # from rewards_chosen: --method dpo's
              "aux_loss",  # a mixture of experts' balancing loss
              "mtp_loss")  # --mtp train's MTP loss (training/mtp_loss.py)
BY_SOURCE_KEYS = ("source_val_loss", "source_tokens")
WANDB_ID = "zerotrain-run-id"  # in <out>/wandb/: the W&B run a resume continues
# A step record's figures the summary gives the median of: the first step's warm-up does not move a median
THROUGHPUT_KEYS = ("tokens_per_s_per_rank", "flops_per_s_per_rank", "mfu")


class Metrics:
    """Rank 0 writes; other ranks hold a no-op instance so the loop needs no rank checks.

    The file is appended to. A run resuming at step s first drops the step records after s (they
    belong to work that was not committed), and a rollback to step s drops those of the abandoned steps,
    rewriting the file atomically, so the file holds one record per step of the timeline that trained.
    Events (restart, rollback, stop) are history and always kept. `dropped_after` is the last step a
    resume dropped, which tells a restart how many steps it lost.
    """

    def __init__(self, path: str, *, active: bool, progress: bool, start: int, total: int, log_every: int = 0,
                 tensorboard: str | None = None, wandb: str | None = None, config: Config | None = None):
        self.active = active
        self.path, self.tensorboard = path, tensorboard
        self.file = None
        self.bar = None
        self.board = None
        self.wandb = None
        self.dropped_after = start
        if not active:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.dropped_after = _truncate_after(path, start)
            self.file = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the [tb] extra; checked when the config was

            self.board = SummaryWriter(tensorboard, purge_step=start + 1)
        if wandb:
            self.wandb = _wandb_run(wandb, config, resumed=start > 0)
        # The bar starts with the first step, after the start line: a line printed beside a drawn bar lands on it.
        self._bar_span = (start, total) if progress else None
        # without the bar, a line every log_every steps and at the last, for logs read by people (a batch job's)
        self.log_every, self.total = (0 if progress else log_every), total

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self._write(record)
        by_source = {f"{key}/{name}": v for key in BY_SOURCE_KEYS for name, v in record.get(key, {}).items()}
        if self.board:
            for key in BOARD_KEYS:
                if record.get(key) is not None:
                    self.board.add_scalar(key, record[key], record["step"])
            for key, value in by_source.items():
                self.board.add_scalar(key, value, record["step"])
        if self.wandb:
            self.wandb.log({**{k: v for k, v in record.items() if isinstance(v, (int, float))}, **by_source})
        if self._bar_span and self.bar is None:
            start, total = self._bar_span
            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=True)
        if self.bar:
            postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if "mfu" in record:
                postfix["mfu"] = f"{record['mfu']:.3g}"
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(**postfix, refresh=False)
            self.bar.update(1)
        elif self.log_every and (record["step"] % self.log_every == 0 or record["step"] == self.total):
            print(f"zerotrain: {step_line(record, self.total)}", file=sys.stderr, flush=True)

    def announce(self, line: str) -> None:
        """A line for the person watching (the run's start line), on rank 0, before the progress bar starts."""
        if self.active:
            print(f"zerotrain: {line}", flush=True)

    def where(self) -> str:
        """Where the metrics go besides the JSONL file, for the start line."""
        if not self.wandb:
            return ""
        at = (f"offline in {os.path.dirname(self.wandb.dir)} ('wandb sync' uploads it)" if self.wandb.offline
              else self.wandb.url)
        return f"; W&B run {self.wandb.name} of project {self.wandb.project}: {at}"

    def event(self, record: dict, message: str | None = None) -> None:
        """An event (restart, rollback, stop) in the metrics, and its line on screen."""
        if not self.active:
            return
        self._write(record)
        if message:
            if self.bar:
                self.bar.write(f"zerotrain: {message}", file=sys.stderr)
                if "to_step" in record:  # a rollback moves the bar back
                    self.bar.n = record["to_step"]
                    self.bar.refresh()
            else:
                print(f"zerotrain: {message}", file=sys.stderr, flush=True)

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the abandoned steps' records go (file and TensorBoard); the replay writes them anew."""
        if not self.active:
            return
        if self.file:
            self.file.close()
            _truncate_after(self.path, step)
            self.file = open(self.path, "a")
        if self.board:  # a writer's purge_step hides the steps from there on in what TensorBoard shows
            from torch.utils.tensorboard import SummaryWriter

            self.board.close()
            self.board = SummaryWriter(self.tensorboard, purge_step=step + 1)

    def _write(self, record: dict) -> None:
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk's write names no file
                raise OSError(e.errno, e.strerror, self.path) from e

    def close(self, summary: dict | None = None) -> None:
        """Close every logger; the W&B run ends with the run's summary, or as failed without one."""
        if self.wandb:
            if summary is not None:
                self.wandb.summary.update(summary)
            self.wandb.finish(exit_code=0 if summary is not None else 1)
            self.wandb = None
        if self.board:
            self.board.close()
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()


def _wandb_run(project: str, config: Config | None, resumed: bool):
    """A W&B run of `project` with the run's config, named after the run folder; quiet: zerotrain says where it is.

    A resumed or restarted run continues the W&B run its folder started (its id is kept in <out>/wandb/), so the
    whole timeline is one W&B run; offline, each invocation is a folder of that id, which `wandb sync` joins.
    """
    import wandb  # the [wandb] extra; checked when the config was

    out = config.logging.out if config else os.getcwd()
    id_file = os.path.join(out, "wandb", WANDB_ID)
    if resumed and os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(6)  # W&B takes any short id unique in its project
        os.makedirs(os.path.dirname(id_file), exist_ok=True)
        write_atomic(id_file, run_id + "\n", durable=False)
    try:
        run = wandb.init(project=project, name=os.path.basename(os.path.abspath(out)), dir=out, id=run_id,
                         resume="allow", config=config.to_dict() if config else None,
                         settings=wandb.Settings(console="off", silent=True))
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:  # not logged in, a bad key: the user's
        raise ConfigError(f"--wandb {project}: W&B cannot log ({e}): run 'wandb login', or set WANDB_MODE=offline "
                          "to log without a network") from None
    # a rollback replays steps: the step is the x-axis, W&B's own counter only orders the records
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def summarize(report: dict) -> dict:
    """summary.json's figures from what rank 0 reports: the run in a few numbers, throughput (each figure's median
    over the steps) and memory per rank with its max and mean across ranks."""
    cfg = Config.from_dict(report["config"])
    records = read_step_records(cfg.logging.metrics) or report["records"]  # the whole run, resumes included
    per_rank, root = report["per_rank"], cfg.checkpoint.dir
    throughput = dict(report.get("throughput", {}))
    for key in THROUGHPUT_KEYS:
        values = [r[key] for r in records if key in r]
        throughput[key] = statistics.median(values) if values else None
    return {
        "steps": records[-1]["step"] if records else report["start_step"],
        "start_step": report["start_step"],
        "resumed_from": report["resumed_from"],
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "tokens": sum(r["tokens"] for r in records),
        **_source_tokens(records),
        **_preference(records),
        **_experts(records),
        "wall_s": round(report["wall_s"], 3),  # of this invocation
        "world_size": report["world_size"],
        "threads_per_rank": report["threads_per_rank"],
        "param_count": report["param_count"],
        "checkpoints": [os.path.join(root, name) for name in committed_steps(root)],
        "restarts": report["restarts"],
        "rollbacks": count_events(cfg.logging.metrics, "rollback") or len(report["rollbacks"]),
        "stopped": report["stopped"],
        "throughput": throughput,
        "per_rank": per_rank,
        "plan": report["plan"],
        "max": {k: max(v) for k, v in per_rank.items()},
        "mean": {k: statistics.fmean(v) for k, v in per_rank.items()},
    }


def _experts(records: list[dict]) -> dict:
    """A mixture of experts: {"experts": the last step's aux_loss and expert_load, and each MoE layer's most uneven
    load over the run (expert_load_max)}, or nothing."""
    loads = [r["expert_load"] for r in records if "expert_load" in r]
    if not loads:
        return {}
    last = next(r for r in reversed(records) if "expert_load" in r)
    return {"experts": {"aux_loss": last["aux_loss"], "expert_load": last["expert_load"],
                        "expert_load_max": [max(layer) for layer in zip(*loads)]}}


PREFERENCE_FIGURES = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracy", "logps_chosen",
                      "logps_rejected")


def _preference(records: list[dict]) -> dict:
    """--method dpo: the last step's preference figures ({"preference": {...}}), with --eval-every the last
    validation's on the held-out pairs ("validation": its step, val_loss and the val_ figures), or nothing."""
    last = records[-1] if records else {}
    if "rewards_chosen" not in last:
        return {}
    out = {"preference": {k: last[k] for k in PREFERENCE_FIGURES}}
    validated = [r for r in records if "val_rewards_chosen" in r]
    if validated:
        v = validated[-1]
        out["preference"]["validation"] = {"step": v["step"], "val_loss": v["val_loss"], "val_pairs": v["val_pairs"],
                                           **{f"val_{k}": v[f"val_{k}"] for k in PREFERENCE_FIGURES}}
    return out


def _source_tokens(records: list[dict]) -> dict:
    """A mixture's tokens by source over the run ({"source_tokens": {name: tokens}}), or nothing for one source."""
    totals: dict[str, int] = {}
    for r in records:
        for name, tokens in r.get("source_tokens", {}).items():
            totals[name] = totals.get(name, 0) + tokens
    return {"source_tokens": totals} if totals else {}


def _truncate_after(path: str, step: int) -> int:
    """Keep the step records of steps <= step, and every event; return the last step seen."""
    if not os.path.isfile(path):
        return step
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = [json.loads(line) for line in lines]
    last = max((r["step"] for r in records if "step" in r and "event" not in r), default=step)
    kept = [line for line, r in zip(lines, records) if "event" in r or r.get("step", 0) <= step]
    if len(kept) < len(lines):
        write_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))
    return last


def read_step_records(path: str) -> list[dict]:
    """The step records of a metrics file, in step order; a step replayed after a rollback keeps its last record."""
    by_step = {}
    if path and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line) if line.strip() else {}
                if "event" not in record and "step" in record:
                    by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def count_events(path: str, kind: str) -> int:
    """Events of one kind in a metrics file: the whole run's, restarts and resumes included."""
    if not path or not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum(json.loads(line).get("event") == kind for line in f if line.strip())



def step_line(record: dict, total: int) -> str:
    """One step's figures in a line: `step 20/200: loss 3.4521, lr 2.9e-03, grad norm 0.841, 12,345 tokens/s`."""
    mtp = f", mtp loss {record['mtp_loss']:.4f}" if "mtp_loss" in record else ""  # --mtp train: in loss x lambda
    line = (f"step {record['step']}/{total}: loss {record['loss']:.4f}{mtp}, lr {record['lr']:.2e}, grad norm "
            f"{record['grad_norm']:.3g}, {record['tokens_per_s']:,.0f} tokens/s")
    if "mfu" in record:
        line += f", MFU {record['mfu']:.3g}"
    if "val_loss" in record:
        line += f", val loss {record['val_loss']:.4f}"
    return line
