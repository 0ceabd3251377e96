"""Job functions for tests/test_resume_reads.py, run by spawned ranks (importable by module name): a resume whose
checkpoint bytes each rank counts, after a restart or not, and the planted verification that has every rank hash
every file of the checkpoint before it reads its own shard (what a restart did before the ranks verified as they
read)."""

from __future__ import annotations

import contextlib
from unittest import mock

from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.checkpoint.verify import verify_checkpoint
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.training import loop
from zerotrain.training.loop import train

READ = "checkpoint_bytes_read"


def every_file_checked(path, manifest, part):
    """Planted in place of load.py's checks_beside_own_shard: this rank checks every file of the checkpoint, the
    other ranks' shards included."""
    return verify_checkpoint(path)


def counted_resume_job(cfg: Config, comm: Comm, restart: bool = False, planted: bool = False) -> dict:
    """Train, resuming as cfg says (`restart`: as the group's attempt 1 would); the checkpoint bytes each rank read
    meanwhile, where it started and from which folder. `planted`: every rank checks every file (every_file_checked)."""
    with contextlib.ExitStack() as patches:
        if restart:
            patches.enter_context(mock.patch.object(loop, "restart_count", lambda: 1))
        if planted:
            patches.enter_context(mock.patch.object(load_module, "checks_beside_own_shard", every_file_checked))
        before = bytes_counted()[READ]
        result = train(cfg, comm)
        read = bytes_counted()[READ] - before
    return {"read": comm.io.all_gather_json(read, "test_resume_read"), "start": result.start_step,
            "resumed_from": result.resumed_from}


def restarted_job(cfg: Config, comm: Comm) -> dict:
    return counted_resume_job(cfg, comm, restart=True)


def planted_job(cfg: Config, comm: Comm) -> dict:
    return counted_resume_job(cfg, comm, planted=True)
