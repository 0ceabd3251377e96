"""Job functions for tests/test_tp_resume_share.py, run by spawned ranks (importable by module name): a TP run saved,
resumed on its own mesh and resharded, each rank's checkpoint bytes read and its peak resident memory measured in its
own process, and the planted resume in which the last rank assembles every TP rank's flat masters (what the replicas
check did before it compared digests).

Peak RSS is the kernel's high-water mark of this process (VmHWM in /proc/self/status), reset to the current RSS before
what is measured (writing 5 to /proc/self/clear_refs): a rank started by fork inherits its parent's mark, and one that
ran an earlier job keeps that job's, so getrusage's ru_maxrss would measure neither job alone.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

from safetensors import safe_open

from zerotrain import checkpoint
from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint import verify as verify_module
from zerotrain.checkpoint.format import layout_of, mesh_of, shard_name
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.training.loop import train

READ = "checkpoint_bytes_read"


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset this process's peak RSS to its RSS now; that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak() -> int:
    return _status("VmHWM")


def measured_train(cfg: Config, comm: Comm, planted: bool = False) -> dict:
    """Train as cfg says; every rank's checkpoint bytes read, peak RSS over the whole job, and the growth of its RSS
    while the checkpoint loads (peak during the load minus RSS before it); `planted`: the last rank assembles every
    TP rank's flat masters while it checks the replicas."""
    real_resume = load_module.resume
    load = {}

    def measured_resume(*args, **kwargs):
        before = reset_peak()
        try:
            return real_resume(*args, **kwargs)
        finally:
            load["growth"] = peak() - before

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(checkpoint, "resume", measured_resume))  # what the loop calls
        if planted:
            patches.enter_context(mock.patch.object(load_module, "checks_beside_own_shard", last_rank_assembles))
        start = reset_peak()
        read = bytes_counted()[READ]
        train(cfg, comm)
        mine = {"read": bytes_counted()[READ] - read, "peak": peak(), "start_rss": start,
                "load_growth": load.get("growth")}
    return {"ranks": comm.io.all_gather_json(mine, "test_tp_share")}


def planted_job(cfg: Config, comm: Comm) -> dict:
    return measured_train(cfg, comm, planted=True)


def whole_shard_job(cfg: Config, comm: Comm) -> dict:
    """Planted: every rank reads its shard whole into tensors of its own (load.py's read_shard, the engine's places
    ignored), which the engine then copies from, as a resume did before it read in place."""
    real = load_module.read_shard
    with mock.patch.object(load_module, "read_shard", lambda path, manifest, rank, places=None: real(path, manifest,
                                                                                                       rank)):
        return measured_train(cfg, comm)


def last_rank_assembles(path: str, manifest: dict, part: tuple[int, int]):
    """Planted in place of load.py's checks_beside_own_shard: as before digests, the last rank reads every shard's
    masters whole, assembles each TP rank's padded flat buffer and compares the replicated parameters there (reading
    uncounted, as that code did)."""
    r, W = part
    checks = verify_module.checks_beside_own_shard(path, manifest, part)
    if r == W - 1:
        T, D = mesh_of(manifest)
        layout = layout_of(manifest, path)
        flats = []
        for t in range(T):
            masters = []
            for d in range(D):
                with safe_open(os.path.join(path, shard_name(d * T + t, T * D)), framework="pt") as f:
                    masters.append(f.get_tensor("master"))
            flats.append(layout.assemble(masters))
        slots = {s.name: s for s in layout.slots}
        for name in verify_module.replicated_names(manifest):
            s = slots[name]
            assert all(f[s.offset : s.offset + s.numel].equal(flats[0][s.offset : s.offset + s.numel]) for f in flats)
    return checks
