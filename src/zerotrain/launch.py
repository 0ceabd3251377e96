"""Start N local ranks through PyTorch's elastic launcher, or join a torchrun job; own the process group and failures."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import Config, ConfigError
from .control import StopRequest
from .errors import ZeroTrainError
from .parallel import Comm


class JobFailed(RuntimeError):
    """The distributed job did not succeed; the message is the one line to show the user."""


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank_device(cfg: Config) -> torch.device:
    """This rank's device: its CUDA device (set when the rank started) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.run.device == "cuda" else torch.device("cpu")


def default_threads(cfg: Config) -> int:
    """Threads per rank: the machine's cores shared by the ranks on this machine."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.run.nproc))
    return cfg.run.threads or max(1, (os.cpu_count() or 1) // local_ranks)


def restart_count() -> int:
    """Which attempt of an elastic job this rank belongs to: 0 first, then one more per restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_stop: StopRequest | None = None


def stop_request() -> StopRequest:
    """This rank's stop request (signals, or the launcher's stop file); created when the rank starts."""
    global _stop
    if _stop is None:
        _stop = StopRequest()
    return _stop


class Interrupted(Exception):
    """A second SIGINT/SIGTERM stopped the job at once; `code` is the exit code (128 + signal)."""

    def __init__(self, signal_name: str, code: int):
        super().__init__(f"stopped at once by a second {signal_name}; what was not yet committed is lost")
        self.code = code


def run_job(job: Callable[[Config, Comm], Any], cfg: Config, *, time_limit: float | None = None,
            prepare: Callable[[Config], Config] | None = None) -> Any:
    """Run `job(cfg, comm)` on every rank and return rank 0's result.

    `prepare(cfg)` resolves what all ranks must agree on (paths, the checkpoint to resume): it runs once,
    here before the ranks start, or under torchrun on rank 0, whose result every rank then adopts.

    Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) this process is one rank and runs the job itself.
    Otherwise `cfg.run.nproc` local ranks are spawned by torch's elastic agent with rendezvous on
    127.0.0.1 and `cfg.run.max_restarts` restarts. The agent runs in a thread so that this process
    keeps SIGINT and SIGTERM: the first asks every rank to finish its step and save, the second (or
    the wall-clock limit) stops every rank at once.
    """
    if in_torchrun():
        return _worker(job, cfg, None, prepare)
    if prepare:
        cfg = prepare(cfg)
    job_dir = tempfile.mkdtemp(prefix="zerotrain-job-")
    launched = _ElasticThread(job, cfg, job_dir)
    stop = _LauncherSignals(os.path.join(job_dir, STOP_FILE))
    deadline = time.monotonic() + time_limit if time_limit else None
    reaper = _Reaper(job_dir)
    try:
        stop.install()
        launched.start()
        while launched.is_alive():
            launched.join(0.05)
            reaper.poll()
            if stop.hard_stop:
                _stop_descendants(launched)
                raise Interrupted(stop.hard_stop, 128 + signal.Signals[stop.hard_stop].value)
            if deadline and time.monotonic() > deadline:
                _stop_descendants(launched)
                raise JobFailed(f"the job exceeded its wall-clock limit of {time_limit:g} s; all ranks were stopped")
        return launched.outcome(job_dir)
    finally:
        stop.restore()
        shutil.rmtree(job_dir, ignore_errors=True)


STOP_FILE = "stop"


class _LauncherSignals:
    """The launcher's SIGINT/SIGTERM: the first writes the ranks' stop file, the second asks for a hard stop."""

    def __init__(self, stop_file: str):
        self.stop_file, self.hard_stop, self._previous = stop_file, None, {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if os.path.exists(self.stop_file):
            self.hard_stop = name
            return
        with open(self.stop_file + ".tmp", "w") as f:
            f.write(name)
        os.replace(self.stop_file + ".tmp", self.stop_file)
        print(f"zerotrain: {name} received: every rank finishes its current step and saves; "
              f"send it again to stop at once", file=sys.stderr, flush=True)


class _Reaper:
    """Once a rank has reported a failure, the ranks of that attempt still running get a second, then SIGKILL.

    The elastic agent stops a failed group with SIGTERM and waits up to 30 s before SIGKILL; a rank hung
    inside a collective or a C call never runs its SIGTERM handler, so without this the job would outlive
    its --timeout by half a minute. Each rank records its pid per attempt, so a restarted group is spared.
    """

    GRACE_S = 1.0

    def __init__(self, job_dir: str):
        self.job_dir, self.handled, self.due = job_dir, set(), {}

    def poll(self) -> None:
        failures = os.path.join(self.job_dir, "failures")
        for name in os.listdir(failures) if os.path.isdir(failures) else []:
            attempt = name.split("-")[0]
            if attempt not in self.handled:
                self.handled.add(attempt)
                self.due[attempt] = time.monotonic() + self.GRACE_S
        for attempt, when in list(self.due.items()):
            if time.monotonic() > when:
                del self.due[attempt]
                for path in glob.glob(os.path.join(self.job_dir, "pids", f"{attempt}-*")):
                    with open(path) as f:
                        _signal(int(f.read()), signal.SIGKILL)


class _ElasticThread(threading.Thread):
    """torch's elastic agent, run off the main thread so that it leaves the signal handlers to us."""

    def __init__(self, job, cfg: Config, job_dir: str):
        super().__init__(daemon=True, name="zerotrain-elastic-agent")
        self.job, self.cfg, self.job_dir = job, cfg, job_dir
        self.results, self.error = None, None

    def run(self) -> None:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        for name in ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        options = dict(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=self.cfg.run.nproc,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # the OS picks a free port
            run_id=uuid.uuid4().hex,
            max_restarts=self.cfg.run.max_restarts,
            monitor_interval=0.05,
            start_method="spawn",
            local_addr="127.0.0.1",
        )
        if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
            options["shutdown_timeout"] = 3  # after a failure, how long a rank may take to exit before SIGKILL
        try:
            self.results = elastic_launch(LaunchConfig(**options), _worker)(self.job, self.cfg, self.job_dir, None)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which explains it
            self.error = e

    def outcome(self, job_dir: str) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if self.error is None:
            return self.results[0]
        if isinstance(self.error, ChildFailedError):
            raise JobFailed(_failure_reason(job_dir, self.error)) from None
        raise JobFailed(f"the launcher failed: {type(self.error).__name__}: {self.error}") from None


def _stop_descendants(agent: threading.Thread, grace_s: float = 2.0) -> None:
    """SIGTERM every process below this one, SIGKILL whatever is left after `grace_s`, let the agent wind down.

    The agent's thread must end before the interpreter does: its stores' threads abort the process otherwise.
    """
    victims = _descendants()
    for pid in victims:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in victims):
        time.sleep(0.05)
    for pid in victims:
        _signal(pid, signal.SIGKILL)
    agent.join(timeout=15)


def _descendants() -> list[int]:
    """Live processes below this one (multiprocessing's shared resource tracker excepted)."""
    parent_of = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    tracker = b"resource_tracker" in f.read()
            except OSError:
                continue
            if fields[0] != "Z" and not tracker:
                parent_of[int(entry)] = int(fields[1])
    found, frontier = [], {os.getpid()}
    while frontier:
        children = [pid for pid, ppid in parent_of.items() if ppid in frontier and pid not in found]
        found += children
        frontier = set(children)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _failure_reason(job_dir: str, error) -> str:
    """The one line that explains a failed job, from the ranks' own reports of its last attempt.

    A failure zerotrain explained (an invariant, a timeout) comes first; then a rank that died without
    a word (killed by a signal, or exited), since the others then only saw their peer vanish; then the
    earliest report.
    """
    reports = []
    for path in glob.glob(os.path.join(job_dir, "failures", "*.json")):
        with open(path) as f:
            reports.append(json.load(f))
    last_attempt = max((r["attempt"] for r in reports), default=0)
    reports = [r for r in reports if r["attempt"] == last_attempt]
    explained = sorted((r for r in reports if r["kind"] == "explained"), key=lambda r: r["time"])
    if explained:
        return explained[0]["message"]
    reported = {r["rank"] for r in reports}
    for rank, failure in sorted(error.failures.items()):
        if rank not in reported and failure.exitcode < 0:
            return f"rank {rank} was killed by signal {failure.signal_name()}"
        if rank not in reported:
            return f"rank {rank} failed with exit code {failure.exitcode} (see its output above)"
    if reports:
        return min(reports, key=lambda r: r["time"])["message"]
    rank, failure = error.get_first_failure()
    return f"rank {rank} failed with exit code {failure.exitcode}"


def _worker(job: Callable[[Config, Comm], Any], cfg: Config, job_dir: str | None,
            prepare: Callable[[Config], Config] | None) -> Any:
    """One rank: set threads and device, join the process group, run the job, always leave the group.

    Any exception ends the rank with one line naming the rank and the error (the traceback goes to
    `<out>/logs/rank{R}.log`): in the job folder for the launcher to show, or on stderr under torchrun.
    """
    global _stop
    _stop = StopRequest(os.path.join(job_dir, STOP_FILE) if job_dir else None).install()
    if job_dir:  # for the launcher's reaper
        os.makedirs(os.path.join(job_dir, "pids"), exist_ok=True)
        with open(os.path.join(job_dir, "pids", f"attempt{restart_count()}-rank{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
    torch.set_num_threads(default_threads(cfg))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.run.device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if cfg.run.device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.run.timeout_s)
    dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    rank = dist.get_rank()
    try:
        comm = Comm(timeout_s=cfg.run.timeout_s)
        if prepare:
            cfg = _agree(cfg, comm, prepare)
        result = job(cfg, comm)
    except ConfigError:
        dist.destroy_process_group()
        raise  # the same on every rank: the command line reports it (exit 2)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the rank
        _report_failure(e, rank, cfg, job_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        if getattr(e, "peer_lost", False):
            # Stay a moment, so the agent sees first the rank that died without a word: the cause.
            time.sleep(2.0)
        # Leave at once: tearing down a group whose peer is gone can block on its unfinished transfers.
        os._exit(1)
    dist.destroy_process_group()
    return result


def _attempt_store(timeout: datetime.timedelta) -> dict:
    """init_process_group's store, under a prefix of its own for each elastic attempt.

    The elastic agent keeps one store for the whole job; without a prefix, a restarted group would read
    the addresses the dead group published there and try to connect to ranks that no longer exist.
    """
    global _job_store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # rank 0 hosts a store of its own, new for each attempt
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    _job_store = store
    return {"store": dist.PrefixStore(f"zerotrain/attempt{restart_count()}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


_job_store = None  # the elastic agent's store, which outlives a restart
_AGREED = "zerotrain/agreed_run"


def _agree(cfg: Config, comm: Comm, prepare: Callable[[Config], Config]) -> Config:
    """Rank 0 prepares the run (paths, resume point) and every rank adopts its result, or its error.

    A restarted group adopts what the first attempt agreed (kept in the agent's store), so it keeps the
    run folder, its default name included, and does not take its own checkpoints for an earlier run's.
    """
    payload = {}
    if comm.rank == 0:
        try:
            if restart_count() > 0 and _job_store is not None and _job_store.check([_AGREED]):
                payload = json.loads(_job_store.get(_AGREED))
            else:
                payload = {"config": prepare(cfg).to_dict()}
                if _job_store is not None:
                    _job_store.set(_AGREED, json.dumps(payload))
        except ConfigError as e:
            payload = {"error": str(e), "user": True}
        except ZeroTrainError as e:
            payload = {"error": str(e), "user": False}
    agreed = comm.all_gather_json(payload, "agree_run")[0]
    if "error" in agreed:
        raise (ConfigError if agreed["user"] else ZeroTrainError)(agreed["error"])
    return Config.from_dict(agreed["config"])


def _report_failure(error: Exception, rank: int, cfg: Config, job_dir: str | None) -> None:
    explained = isinstance(error, ZeroTrainError) and not getattr(error, "peer_lost", False)
    message = f"rank {rank}: {error}" if isinstance(error, ZeroTrainError) else \
        f"rank {rank}: {type(error).__name__}: {error}"
    log = _write_traceback(rank, cfg)
    if log and not explained:
        message += f" (traceback in {log})"
    if job_dir is None:
        print(f"zerotrain: {message}", file=sys.stderr, flush=True)
        return
    os.makedirs(os.path.join(job_dir, "failures"), exist_ok=True)
    report = {"rank": rank, "attempt": restart_count(), "time": time.time(), "message": message,
              "kind": "explained" if explained else "exception"}
    with open(os.path.join(job_dir, "failures", f"attempt{restart_count()}-rank{rank:05d}.json"), "w") as f:
        json.dump(report, f)


def _write_traceback(rank: int, cfg: Config) -> str | None:
    """Append this rank's traceback to <out>/logs/rank{R}.log (or a temporary file); return its path."""
    text = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {restart_count()}\n{traceback.format_exc()}"
    for folder in (os.path.join(cfg.run.out, "logs") if cfg.run.out else None, tempfile.gettempdir()):
        if folder is None:
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{rank:05d}.log" if folder != tempfile.gettempdir()
                                else f"zerotrain-rank{rank:05d}.log")
            with open(path, "a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None
