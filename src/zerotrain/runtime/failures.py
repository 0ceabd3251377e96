"""A failed rank's one line: written by the rank (its traceback logged to a file), read back by the launcher."""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
import traceback

from zerotrain.config import Config
from zerotrain.durable import write_json
from zerotrain.errors import ZeroTrainError
from zerotrain.model import param_count

from .supervise import REAPED


def restart_count() -> int:
    """Which attempt of an elastic job this rank belongs to: 0 first, then one more each time the group re-forms.

    The ranks agree on it as they join (launch._agree_attempt): TORCHELASTIC_RESTART_COUNT is only this
    node's count, which a node restarted because another node failed does not raise. Before the ranks
    have agreed, or without the agent's store, this node's count.
    """
    if _agreed_attempt is not None:
        return _agreed_attempt
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def adopt_attempt(attempt: int) -> None:
    """The attempt every rank of this group agreed on: what restart_count() says from now on in this process."""
    global _agreed_attempt
    _agreed_attempt = attempt


_agreed_attempt: int | None = None


def adopt_job_dir(job_dir: str | None) -> None:
    """The job folder of zerotrain's own launcher (None under torchrun): where a restarted rank 0 reads why the
    attempt before its own failed."""
    global _job_dir
    _job_dir = job_dir


_job_dir: str | None = None


def adopted_job_dir() -> str | None:
    """The job folder this rank reports its failure in (None under torchrun)."""
    return _job_dir


def report_failure(error: Exception, rank: int, cfg: Config, job_dir: str | None) -> None:
    peer_lost = bool(getattr(error, "peer_lost", False))
    explained = isinstance(error, ZeroTrainError) and not peer_lost
    message = f"rank {rank}: {error}" if isinstance(error, ZeroTrainError) else \
        f"rank {rank}: {type(error).__name__}: {error}"
    log = _write_traceback(rank, cfg)
    if log and not explained:
        message += f" (traceback in {log})"
    if job_dir is None:
        print(f"zerotrain: {message}", file=sys.stderr, flush=True)
        return
    _write_report(job_dir, rank, message, "explained" if explained else "lost a peer" if peer_lost else "exception")


def report_user_error(error: Exception, rank: int, job_dir: str) -> None:
    """A ConfigError a rank raised (the same on every rank that reaches it): for the launcher to print as is."""
    _write_report(job_dir, rank, str(error), "user")


def _write_report(job_dir: str, rank: int, message: str, kind: str) -> None:
    """This rank's report of this attempt in the job folder, whole or absent: the launcher may read it meanwhile."""
    os.makedirs(os.path.join(job_dir, "failures"), exist_ok=True)
    report = {"rank": rank, "attempt": restart_count(), "time": time.time(), "message": message, "kind": kind}
    write_json(os.path.join(job_dir, "failures", f"attempt{restart_count()}-rank{rank:05d}.json"), report,
               durable=False)


def user_error(job_dir: str) -> str | None:
    """The earliest user error a rank of the job's last attempt reported, or None."""
    reports = _last_attempt_reports(job_dir)
    mistakes = sorted((r for r in reports if r["kind"] == "user"), key=lambda r: r["time"])
    return mistakes[0]["message"] if mistakes else None


def _last_attempt_reports(job_dir: str) -> list[dict]:
    reports = _reports(job_dir)
    last_attempt = max((r["attempt"] for r in reports), default=0)
    return [r for r in reports if r["attempt"] == last_attempt]


def _reports(job_dir: str) -> list[dict]:
    reports = []
    for path in glob.glob(os.path.join(job_dir, "failures", "*.json")):
        with open(path) as f:
            reports.append(json.load(f))
    return reports


UNKNOWN_CAUSE = ("its cause is not known here (under torchrun each node's agent restarts its own ranks: the output "
                 "of the node whose rank failed says which and why)")
SILENT = "ended without a word (killed by a signal, the kernel's out-of-memory killer's SIGKILL among them, or exited)"


def restart_cause() -> tuple[int | None, str]:
    """Why the attempt before this one failed, for a restarted rank 0 to say: (the rank that failed or None, a line).

    From the job folder of zerotrain's own launcher: every rank of an attempt records its pid as it starts and
    reports an error it raised. A failure zerotrain explained (an invariant, a timeout) comes first; then an error
    a rank raised itself; then a rank that left no report (killed, or exited: the others only saw it vanish);
    then a rank that lost a peer. Under torchrun there is no such folder: the cause is said to be unknown.
    """
    if _job_dir is None or restart_count() == 0:
        return None, UNKNOWN_CAUSE
    attempt = restart_count() - 1
    reports = [r for r in _reports(_job_dir) if r["attempt"] == attempt]
    def ranks_in(folder: str) -> set[int]:
        return {int(name.rsplit("rank", 1)[1])
                for name in map(os.path.basename, glob.glob(os.path.join(_job_dir, folder, f"attempt{attempt}-rank*")))}

    # a rank the launcher's reaper killed (hung in a collective once another had failed) is not a cause
    return cause_of(reports, ranks_in("pids") - ranks_in(REAPED))


def cause_of(reports: list[dict], started: set[int]) -> tuple[int | None, str]:
    """The failed rank and the line that says why, from one attempt's reports and the ranks that started in it."""
    by_time = sorted(reports, key=lambda r: r["time"])
    for kind in ("explained", "exception"):
        first = next((r for r in by_time if r["kind"] == kind), None)
        if first is not None:
            return first["rank"], first["message"]
    silent = sorted(started - {r["rank"] for r in reports})
    if silent:
        return silent[0], f"rank {silent[0]} {SILENT}"
    if by_time:
        return by_time[0]["rank"], by_time[0]["message"]
    return None, UNKNOWN_CAUSE


def _write_traceback(rank: int, cfg: Config) -> str | None:
    """Append this rank's traceback to <out>/logs/rank{R}.log, or where that cannot be written (a full disk) to a
    temporary folder of this process's own; return its path."""
    global _fallback_logs
    text = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {restart_count()}\n{traceback.format_exc()}"
    for folder in (os.path.join(cfg.logging.out, "logs") if cfg.logging.out else None, "fallback"):
        if folder is None:
            continue
        try:
            if folder == "fallback":
                _fallback_logs = _fallback_logs or tempfile.mkdtemp(prefix="zerotrain-logs-")
                folder = _fallback_logs
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{rank:05d}.log")
            with open(path, "a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


_fallback_logs: str | None = None  # this process's own temporary log folder, made when the run folder fails it


def memory_asked(cfg: Config) -> str:
    """What a run asks of each rank's memory, in round figures: the likely cause when the kernel kills a rank."""
    m = cfg.model
    V, T = m.vocab_size, m.seq_len
    params = param_count(m)
    state = params * (4 + 4 + 8 / cfg.dp)  # fp32 parameters and gradients, AdamW's two moments sharded over DP
    logits = cfg.loop.micro_batch * T * V * 4
    return (f"this run asks each rank for about {_readable(state)} of parameters, gradients and optimizer state "
            f"and {_readable(logits)} for the logits of one micro-batch (--micro-batch {cfg.loop.micro_batch} x "
            f"--seq-len {T} x vocabulary {V}), before the other activations")


def _readable(n: float) -> str:
    """Bytes in the largest unit that keeps at least one whole unit: 1.5 GiB, 380 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} bytes"


def failure_reason(job_dir: str, error, cfg: Config | None = None) -> str:
    """The one line that explains a failed job, from the ranks' own reports of its last attempt.

    A failure zerotrain explained (an invariant, a timeout) comes first; then a rank that died without
    a word (killed by a signal, or exited), since the others then only saw their peer vanish; then the
    earliest report.
    """
    reports = _last_attempt_reports(job_dir)
    explained = sorted((r for r in reports if r["kind"] == "explained"), key=lambda r: r["time"])
    if explained:
        return explained[0]["message"]
    reported = {r["rank"] for r in reports}
    for rank, failure in sorted(error.failures.items()):
        if rank not in reported and failure.exitcode < 0:
            why = (f" (a SIGKILL that nobody sent comes from the kernel's out-of-memory killer: {memory_asked(cfg)})"
                   if failure.signal_name() == "SIGKILL" and cfg is not None else "")
            return f"rank {rank} was killed by signal {failure.signal_name()}{why}"
        if rank not in reported:
            return f"rank {rank} failed with exit code {failure.exitcode} (see its output above)"
    if reports:
        return min(reports, key=lambda r: r["time"])["message"]
    rank, failure = error.get_first_failure()
    return f"rank {rank} failed with exit code {failure.exitcode}"
