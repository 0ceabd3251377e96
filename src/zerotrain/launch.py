"""Start N local ranks through PyTorch's elastic launcher, or join a torchrun job; own the process group."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import Config
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


def run_job(job: Callable[[Config, Comm], Any], cfg: Config, *, time_limit: float | None = None) -> Any:
    """Run `job(cfg, comm)` on every rank and return rank 0's result.

    Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) this process is one rank and runs the job itself;
    otherwise `cfg.run.nproc` local ranks are spawned by torch's elastic agent, with rendezvous on
    127.0.0.1 and no restarts: a failing rank stops the whole job promptly.
    """
    if in_torchrun():
        return _worker(job, cfg, None)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    options = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.run.nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # the OS picks a free port
        run_id=uuid.uuid4().hex,
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        options["shutdown_timeout"] = 5
    fail_dir = tempfile.mkdtemp(prefix="zerotrain-failures-")
    timer = None
    expired = threading.Event()
    if time_limit:
        def expire():
            expired.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the elastic agent stops every worker on SIGTERM

        timer = threading.Timer(time_limit, expire)
        timer.daemon = True
        timer.start()
    try:
        results = elastic_launch(LaunchConfig(**options), _worker)(job, cfg, fail_dir)
        return results[0]
    except ChildFailedError as e:
        raise JobFailed(_failure_reason(fail_dir, e)) from None
    except SignalException as e:
        if expired.is_set():
            raise JobFailed(f"the job exceeded its wall-clock limit of {time_limit:g} s; all ranks were stopped") from None
        raise JobFailed(f"the job was stopped by signal {e.sigval}") from None
    finally:
        if timer:
            timer.cancel()
        shutil.rmtree(fail_dir, ignore_errors=True)


def _failure_reason(fail_dir: str, error) -> str:
    """The first rank's own one-line explanation, else which rank died with which exit code."""
    for path in sorted(glob.glob(os.path.join(fail_dir, "rank*.txt"))):
        with open(path) as f:
            return f.read().strip()
    rank, failure = error.get_first_failure()
    return f"rank {rank} failed with exit code {failure.exitcode} (see its output above)"


def _worker(job: Callable[[Config, Comm], Any], cfg: Config, fail_dir: str | None) -> Any:
    """One rank: set threads and device, join the process group, run the job, always leave the group."""
    torch.set_num_threads(default_threads(cfg))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.run.device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if cfg.run.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.run.timeout_s))
    try:
        return job(cfg, Comm())
    except ZeroTrainError as e:
        message = str(e)
        if fail_dir is None:
            print(f"zerotrain: rank {dist.get_rank()}: {message}", file=sys.stderr, flush=True)
        else:
            with open(os.path.join(fail_dir, f"rank{dist.get_rank():05d}.txt"), "w") as f:
                f.write(message)
        sys.exit(1)
    finally:
        dist.destroy_process_group()
