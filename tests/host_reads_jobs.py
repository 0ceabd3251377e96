"""Rank-side counting for tests/test_host_reads.py: every read of a tensor's values by the host during the steps.

Each rank patches torch.Tensor's reading methods (item, tolist, __bool__, __float__, __int__, __index__, numpy,
cpu, nonzero, and .to('cpu') or from another device to the CPU) and counts the
calls made while a step runs: from the step's start (Mesh.set_step) to the end of the run, without what a save
(the checkpointer's), the end of the run (_finish) and the evaluation do, which are not the step's. On CPU a read of
a host tensor counts as much as one of a device tensor: the step is shaped as it would run on a GPU."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
from unittest import mock

import torch

from zerotrain import checkpoint
from zerotrain.parallel import mesh as mesh_module
from zerotrain.training import loop as loop_module

READERS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "nonzero")


class Counter:
    """Reads counted by method, while `on` and not paused, on the training thread only (the stop watcher and an
    async writer are not the step)."""

    def __init__(self):
        self.on, self.paused, self.by_name = False, 0, {}
        self.thread = threading.get_ident()
        self.where: dict[str, int] | None = {} if os.environ.get("ZEROTRAIN_READS_WHERE") else None

    def count(self, name: str) -> None:
        if self.on and not self.paused and threading.get_ident() == self.thread:
            self.by_name[name] = self.by_name.get(name, 0) + 1
            if self.where is not None:  # where in zerotrain each read is made (to find them, not for the test)
                frame = next(f for f in traceback.extract_stack()[::-1] if "/zerotrain/" in f.filename)
                key = f"{name} {frame.filename.split('/zerotrain/')[-1]}:{frame.lineno} {frame.name}"
                self.where[key] = self.where.get(key, 0) + 1

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _counting(counter: Counter, name: str, original):
    @functools.wraps(original)
    def read(self, *args, **kwargs):
        counter.count(name)
        with counter.pause():  # a reader calling another is one read
            return original(self, *args, **kwargs)
    return read


def _counting_to(counter: Counter, original):
    """.to() that names the CPU ('cpu', or a device built from it), or moves a tensor from another device to it: a
    move to a tensor's own device (x.to(y.device), y on the CPU in this run) is a move to the step's device."""
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        named = target == "cpu" or (isinstance(target, torch.device) and target == torch.device("cpu")
                                    and self.device.type != "cpu")
        if named:
            counter.count("to_cpu")
        with counter.pause():
            return original(self, *args, **kwargs)
    return to


def _paused(counter: Counter, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        with counter.pause():
            return original(*args, **kwargs)
    return call


def reading_patches(counter: Counter) -> list:
    """torch.Tensor's reading methods (READERS and .to) patched to count into `counter`."""
    patches = [mock.patch.object(torch.Tensor, name, _counting(counter, name, getattr(torch.Tensor, name)))
               for name in READERS]
    return patches + [mock.patch.object(torch.Tensor, "to", _counting_to(counter, torch.Tensor.to))]


def count_reads(run, steps: int) -> dict:
    """Run `run()` (a training job) with every read counted; {"reads": {method: count}, "per_step": reads / steps}."""
    counter = Counter()
    set_step = mesh_module.Mesh.set_step

    def start_step(self, step):
        counter.on = True
        return set_step(self, step)

    patches = reading_patches(counter)
    patches.append(mock.patch.object(mesh_module.Mesh, "set_step", start_step))
    for owner, name in ((checkpoint.Checkpointer, "_save"), (checkpoint.Checkpointer, "stop"),
                        (checkpoint.Checkpointer, "finish"), (checkpoint.Checkpointer, "recommit"),
                        (loop_module, "_finish")):
        patches.append(mock.patch.object(owner, name, _paused(counter, getattr(owner, name))))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        run()
    total = sum(counter.by_name.values())
    return {"reads": dict(sorted(counter.by_name.items())), "total": total, "per_step": total / steps,
            **({"where": counter.where} if counter.where is not None else {})}


def reads_job(cfg, comm, plant=None) -> dict:
    """`zerotrain train` with this rank's reads counted (see count_reads); `plant` (a context manager factory) wraps
    the run with a planted bug."""
    with plant() if plant else contextlib.nullcontext():
        return count_reads(lambda: loop_module.train(cfg, comm, announce=False), cfg.loop.steps) | {"rank": comm.rank}


def all_ranks_job(cfg, comm, plant=None) -> list[dict]:
    """reads_job, every rank's result gathered on rank 0 (run_job returns rank 0's)."""
    mine = reads_job(cfg, comm, plant)
    return comm.io.all_gather_json(mine, "gather_reads")


def reads_only_at_the_end_job(cfg, comm):
    """Planted: `zerotrain train` whose ranks read the device at the last step only, whatever --log-every says (a
    stop then lands there)."""
    with mock.patch.object(loop_module, "reads_at", lambda cfg, done, start: done == cfg.loop.steps):
        return loop_module.train_job(cfg, comm)
