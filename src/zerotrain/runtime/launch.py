"""Start N local ranks through PyTorch's elastic launcher, or join a torchrun job; own each rank's process group."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerotrain.config import Config
from zerotrain.errors import ConfigError, ZeroTrainError
from zerotrain.model import fused_delta_rule
from zerotrain.parallel import Comm, collective_watchdog
from zerotrain.parallel.collective_watchdog import CollectiveWatchdog, cuda_marker, process_group_timeout
from zerotrain.parallel.comm import collective_error
from zerotrain.parallel.parts import parts_for

from . import cuda_settings, rank_start
from .allocator import rank_allocator
from .console import console_outlives_its_reader
from .failures import (adopt_attempt, adopt_job_dir, adopted_job_dir, failure_reason, report_failure,
                       report_user_error, restart_count, user_error)
from .run_folder import release_run_folders
from .stop import install_stop_request
from .supervise import SAVING_FILE, STEPPING_FILE, STOP_FILE, LauncherSignals, Reaper, descendants, stop_descendants


class JobFailed(RuntimeError):
    """The distributed job did not succeed; the message is the one line to show the user."""


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank_device(cfg: Config) -> torch.device:
    """This rank's device: its CUDA device (set when the rank started) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.launch.device == "cuda" else torch.device("cpu")


def default_threads(cfg: Config) -> int:
    """Threads per rank: the machine's cores shared by the ranks on this machine."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc))
    return cfg.launch.threads or max(1, (os.cpu_count() or 1) // local_ranks)


class Interrupted(Exception):
    """A second SIGINT/SIGTERM stopped the job at once; `code` is the exit code (128 + signal)."""

    def __init__(self, signal_name: str, code: int, before_first_step: bool = False):
        super().__init__(f"stopped by {signal_name} before the first step: nothing to save" if before_first_step
                         else f"stopped at once by a second {signal_name}; what was not yet committed is lost")
        self.code = code


def run_job(job: Callable[[Config, Comm], Any], cfg: Config, *, time_limit: float | None = None,
            prepare: Callable[[Config], Config] | None = None) -> Any:
    """Run `job(cfg, comm)` on every rank and return rank 0's result.

    `prepare(cfg)` resolves what all ranks must agree on (paths, the checkpoint to resume): it runs once,
    here before the ranks start, or under torchrun on rank 0, whose result every rank then adopts.

    Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) this process is one rank and runs the job itself.
    Otherwise `cfg.launch.nproc` local ranks are spawned by torch's elastic agent with rendezvous on
    127.0.0.1 and `cfg.launch.max_restarts` restarts. The agent runs in a thread so that this process
    keeps SIGINT and SIGTERM: the first asks every rank to finish its step and save, the second (or
    the wall-clock limit) stops every rank at once, unless their stop's save has begun (supervise.py).
    """
    if in_torchrun():
        return _worker(job, cfg, None, prepare)
    if prepare:
        try:
            cfg = prepare(cfg)
        except BaseException:
            release_run_folders()  # a refusal after taking the folder must not keep it from the next run
            raise
    job_dir = tempfile.mkdtemp(prefix="zerotrain-job-")
    launched = _ElasticThread(job, cfg, job_dir)
    stepping, saving = ([os.path.join(job_dir, name.format(rank=r)) for r in range(cfg.launch.nproc)]
                        for name in (STEPPING_FILE, SAVING_FILE))
    stop = LauncherSignals(os.path.join(job_dir, STOP_FILE), stepping, saving_files=saving)
    deadline = time.monotonic() + time_limit if time_limit else None
    reaper = Reaper(job_dir)
    try:
        stop.install()
        present = set(descendants())  # a caller's own children, which a stop must spare (and the ranks' server)
        launched.start()
        while launched.is_alive():
            launched.join(0.05)
            reaper.poll()
            if stop.hard_stop:
                stop_descendants(launched, spare=present | {rank_start.server_pid()})
                raise Interrupted(stop.hard_stop, 128 + signal.Signals[stop.hard_stop].value, stop.before_first_step)
            if deadline and time.monotonic() > deadline:
                stop_descendants(launched, spare=present | {rank_start.server_pid()})
                raise JobFailed(f"the job exceeded its wall-clock limit of {time_limit:g} s; all ranks were stopped")
        return launched.outcome(job_dir)
    finally:
        stop.restore()
        shutil.rmtree(job_dir, ignore_errors=True)
        release_run_folders()


class _ElasticThread(threading.Thread):
    """torch's elastic agent, run off the main thread so that it leaves the signal handlers to us."""

    def __init__(self, job, cfg: Config, job_dir: str):
        super().__init__(daemon=True, name="zerotrain-elastic-agent")
        self.job, self.cfg, self.job_dir = job, cfg, job_dir
        self.results, self.error = None, None

    def run(self) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        for name in ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        options = dict(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=self.cfg.launch.nproc,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # the OS picks a free port
            run_id=uuid.uuid4().hex,
            max_restarts=self.cfg.launch.max_restarts,
            monitor_interval=0.05,
            start_method=rank_start.START_METHOD,
            local_addr="127.0.0.1",
            # the agent's folder inside the job's, removed with it (by default each launch left an empty
            # torchelastic_* folder in the temporary directory)
            logs_specs=DefaultLogsSpecs(log_dir=self.job_dir),
        )
        if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
            options["shutdown_timeout"] = 3  # after a failure, how long a rank may take to exit before SIGKILL
        rank_start.start_server()
        try:
            self.results = elastic_launch(LaunchConfig(**options), _worker)(self.job, self.cfg, self.job_dir, None,
                                                                            rank_start.LauncherState())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which explains it
            self.error = e

    def outcome(self, job_dir: str) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if self.error is None:
            return self.results[0]
        mistake = user_error(job_dir)
        if mistake:  # a setting a rank found wrong (data it cannot read, a fault spec): the user's to fix
            raise ConfigError(mistake)
        if isinstance(self.error, ChildFailedError):
            raise JobFailed(failure_reason(job_dir, self.error, self.cfg)) from None
        raise JobFailed(f"the launcher failed: {type(self.error).__name__}: {self.error}") from None


def _worker(job: Callable[[Config, Comm], Any], cfg: Config, job_dir: str | None,
            prepare: Callable[[Config], Config] | None, launcher: rank_start.LauncherState | None = None) -> Any:
    """One rank: set threads and device, join the process group, run the job, always leave the group.

    Any exception ends the rank with one line naming the rank and the error (the traceback goes to
    `<out>/logs/rank{R}.log`): in the job folder for the launcher to show, or on stderr under torchrun. The rank's
    console outlives its reader (console.py).
    """
    with console_outlives_its_reader():
        return _rank(job, cfg, job_dir, prepare, launcher)


def _rank(job, cfg: Config, job_dir: str | None, prepare, launcher: rank_start.LauncherState | None) -> Any:
    if launcher is not None:  # a rank of zerotrain's own launcher
        rank_start.adopt(launcher)
    adopt_job_dir(job_dir)  # where a restarted rank 0 reads why the attempt before failed
    install_stop_request(*(os.path.join(job_dir, name.format(rank=os.environ["RANK"])) if job_dir else None
                           for name in (STOP_FILE, STEPPING_FILE, SAVING_FILE)))
    if job_dir:  # for the launcher's reaper
        os.makedirs(os.path.join(job_dir, "pids"), exist_ok=True)
        with open(os.path.join(job_dir, "pids", f"attempt{restart_count()}-rank{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
    torch.set_num_threads(default_threads(cfg))
    fused_delta_rule.choose(cfg.launch.linear_attention_kernel)  # Qwen3.5's linear layers: fla's kernels or torch
    rank_allocator(parts_for(cfg).placement.gathers_units)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ["RANK"])
    if cfg.launch.device == "cuda":
        said = cuda_settings.apply(cfg.parallel.precision, cfg.launch.deterministic)  # before the first CUDA call
        torch.cuda.set_device(local_rank)
        if rank == 0:
            for line in said:
                print(f"zerotrain: {line}", file=sys.stderr, flush=True)
    backend = "nccl" if cfg.launch.device == "cuda" else "gloo"
    os.environ.update(process_group_environment(backend))
    timeout = process_group_timeout(cfg.launch.timeout, backend)
    if backend == "nccl":  # the CPU does not wait for NCCL's collectives: a watch of its own names a hung one
        arm_collective_watchdog(rank, cfg, marker=cuda_marker)
    try:
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))  # failing to join: one line too
        io_timeout = process_group_timeout(cfg.launch.io_timeout, backend)  # new_group: every rank, in one order
        io = Comm(dist.new_group(timeout=io_timeout), timeout_s=cfg.launch.io_timeout, timeout_flag="--io-timeout")
        comm = Comm(timeout_s=cfg.launch.timeout, io=io)
        if prepare:
            cfg = _agree(cfg, comm, prepare)
        result = job(cfg, comm)
    except ConfigError as e:
        if job_dir is None:
            say_under_torchrun(e, rank)
        report_user_error(e, rank, job_dir)  # the launcher reports it as the command line would (exit 2)
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the rank
        _end_rank(e, rank, cfg, job_dir)
    collective_watchdog.install(None)
    dist.destroy_process_group()
    return result


def arm_collective_watchdog(rank: int, cfg: Config, marker=None, timeout_s: float | None = None) -> None:
    """Watch this rank's collectives (collective_watchdog.py): one not done within its timeout (`timeout_s`, else its
    communicator's) ends the rank with the one line a gloo timeout gives, reported as any failure of the rank's."""
    def timed_out(where: str, after_s: float, flag: str) -> None:
        _end_rank(collective_error(TimeoutError("timed out"), where, after_s, flag), rank, cfg, adopted_job_dir())

    collective_watchdog.install(CollectiveWatchdog(timed_out, marker=marker, timeout_s=timeout_s).start())


def _end_rank(error: Exception, rank: int, cfg: Config, job_dir: str | None) -> None:
    """Report `error` in the rank's one line and leave the process (from the rank's thread, or the watchdog's)."""
    report_failure(error, rank, cfg, job_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if getattr(error, "peer_lost", False):
        # Stay a moment, so the agent sees first the rank that died without a word: the cause.
        time.sleep(2.0)
    # Leave at once: tearing down a group whose peer is gone can block on its unfinished transfers.
    os._exit(1)


# How NCCL reports a collective that timed out or failed, set in each rank before its process group is made:
# ProcessGroupNCCL reads it as it starts. By default (and the elastic agent sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# for its workers) the watchdog thread aborts the communicator and then kills the process (SIGABRT), so no error
# ever reaches the rank's code: no one-line report, no peer_lost, and a restart could not say why. Instead
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): NCCL's watchdog aborts the communicator (kernels in flight exit)
# after the process group's timeout and leaves the process to the rank. The CPU waits for no collective
# (TORCH_NCCL_BLOCKING_WAIT is not set: the stream waits, and the CPU queues the next kernels); a collective that
# hangs is named by the rank's own watchdog (parallel/collective_watchdog.py) at --timeout, before NCCL's abort
# (the process group's timeout is --timeout plus NCCL_TIMEOUT_GRACE_S). A TORCH_NCCL_BLOCKING_WAIT the user sets
# is theirs: with 1 a wait raises the watchdog's error at the call, which comm.collective_error turns into the same
# line; the error handling is always set, since the elastic agent sets it for its workers whatever the user asked.
NCCL_ERRORS_AT_THE_CALL = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def process_group_environment(backend: str, environ=os.environ) -> dict[str, str]:
    """The environment a rank sets before it makes its process group of `backend`."""
    if backend != "nccl":
        return {}
    return dict(NCCL_ERRORS_AT_THE_CALL)


# Under torchrun, how long a rank other than 0 that found a user error waits before saying it itself.
TORCHRUN_USER_ERROR_GRACE_S = 10.0


def say_under_torchrun(error: ConfigError, rank: int) -> None:
    """A user error under torchrun: one line, exit 2.

    Rank 0 says it and exits at once. Every rank that reads the same settings finds the same error, and
    torchrun stops the others as soon as rank 0 has failed (a rank not yet stepping exits on the signal);
    a rank still running after the grace found an error of its own (data missing on its machine) and
    says it, naming itself.
    """
    if rank != 0:
        time.sleep(TORCHRUN_USER_ERROR_GRACE_S)
    print(f"zerotrain: error: {error}" if rank == 0 else f"zerotrain: error: rank {rank}: {error}",
          file=sys.stderr, flush=True)
    os._exit(2)


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
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = _agree_attempt(store, rank, world_size, timeout)
    adopt_attempt(attempt)  # restart_count() from here on: faults, the run folder, resume, reports
    return {"store": dist.PrefixStore(f"zerotrain/attempt{attempt}", store), "rank": rank, "world_size": world_size}


_ATTEMPTS = "zerotrain/attempts"  # how many groups rank 0 has started in this job's store


def _agree_attempt(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> int:
    """Which attempt of the job this group is, the same on every rank: 0, then one more each time a group forms.

    torchrun's TORCHELASTIC_RESTART_COUNT cannot say it across nodes: a node restarted because another node
    failed does not count that restart (torch/distributed/elastic/agent/server/api.py), so after the first
    restart the nodes' counts differ, and so did the prefixes built from them. Instead rank 0 of each group
    counts one more attempt in the job's store. That store keeps what every earlier attempt wrote, so another
    rank cannot just read the count (it may still be the last attempt's): it asks under a token new to its
    process, and takes the count rank 0 writes under that token. Rank 0 answers every token it sees, stale
    ones too, until every rank has taken its count; the groups of two attempts never overlap, since each
    node's agent stops its ranks before the next rendezvous.
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"zerotrain/ask/rank{rank}", token)
        store.wait([f"zerotrain/answer/{token}"], timeout)
        attempt = int(store.get(f"zerotrain/answer/{token}"))
        store.add(f"zerotrain/attempt{attempt}/joined", 1)
        return attempt
    attempt = store.add(_ATTEMPTS, 1) - 1
    answered: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"zerotrain/attempt{attempt}/joined", 0) < world_size - 1:
        for r in range(1, world_size):
            ask = f"zerotrain/ask/rank{r}"
            if store.check([ask]) and (token := store.get(ask)) != answered.get(r):
                store.set(f"zerotrain/answer/{token.decode()}", str(attempt))
                answered[r] = token
        if time.monotonic() > deadline:
            raise ZeroTrainError(f"the other ranks did not all join attempt {attempt} of the job within --timeout "
                                 f"{timeout.total_seconds():g} s")
        time.sleep(0.01)
    return attempt


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
                prepare(Config.from_dict(payload["config"]))  # this attempt's rank 0 takes the run folder again
            else:
                payload = {"config": prepare(cfg).to_dict()}
                if _job_store is not None:
                    _job_store.set(_AGREED, json.dumps(payload))
        except ConfigError as e:
            payload = {"error": str(e), "user": True}
        except ZeroTrainError as e:
            payload = {"error": str(e), "user": False}
    agreed = comm.io.all_gather_json(payload, "agree_run")[0]  # rank 0 may verify a checkpoint meanwhile
    if "error" in agreed:
        raise (ConfigError if agreed["user"] else ZeroTrainError)(agreed["error"])
    return Config.from_dict(agreed["config"])
