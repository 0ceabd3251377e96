"""Job functions for tests/test_io_plan.py, run by spawned ranks (importable by module name): `zerotrain train`'s job
with each rank's checkpoint bytes counted around it (the counters are the process's, and one start of the ranks runs
several jobs), and the planted bugs, each patching the product's own function: a whole-tensor read at stage 3's
start-up, each expert's slice of a stacked tensor read whole for every part of it (init_from.stacked_rows as it was),
each safetensors header read again to check the tensors after listing them (tensor_files keeping none), rank 0
writing the whole model at a save, every rank checking every file of the checkpoint it resumes, a resume reading
--init-from's files again before it restores the checkpoint over them, a resume listing --init-from's tensors for
the record (weight_source's `listed` ignored: model.safetensors' header read), the source a rank checked not handed
to its start-up (init_from.checked_source finding none: each header read again). `checked`: each rank checks
--init-from's folder first, as config_from_args does under torchrun, counted with the job.
`hash_job`: the ranks' record of an --init-from folder (WeightSource.record) and each rank's bytes hashed for it,
planted: each file hashed whole by one rank (the record before block digests)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import resume_jobs

from zerotrain.checkpoint import MODEL_FILE
from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint import save as save_module
from zerotrain.checkpoint.stream import bytes_counted, sha256_file
from zerotrain.checkpoint.verify import share_by_size
from zerotrain.config import Config
from zerotrain.hub import export, init_from
from zerotrain.parallel import Comm, ZeroEngine
from zerotrain.training import loop as loop_module
from zerotrain.training.loop import train_job


def counted_job(cfg: Config, comm: Comm, plants: tuple[str, ...] = (), checked: bool = False) -> dict | None:
    """`zerotrain train`'s summary (rank 0's), its per_rank checkpoint bytes those of this job alone (with `checked`,
    and of the check before it); `plants` name the planted bugs in force while it runs."""
    with contextlib.ExitStack() as patches:
        if "whole tensor" in plants:  # stage 3 takes the whole tensor of every parameter it owns part of
            patches.enter_context(mock.patch.object(
                ZeroEngine, "initial_range",
                lambda self, name, p, lo, hi: self.initial_value(name, p).reshape(-1)[lo:hi]))
        if "whole expert" in plants:
            patches.enter_context(mock.patch.object(init_from, "stacked_rows", whole_expert_rows))
        if "headers read again" in plants:  # the header that lists model.safetensors' tensors not kept
            patches.enter_context(mock.patch.object(init_from, "tensor_files",
                                                    lambda folder, headers=None: export.tensor_files(folder)))
        if "whole model saved" in plants:
            real = save_module._live_files

            def with_the_model(engine, rank, world_size):  # rank 0 writes the whole model beside its shard
                files = real(engine, rank, world_size)
                model = engine.full_state_dict()  # a gather at stage 3: every rank takes part
                if rank == 0:
                    files[MODEL_FILE] = model
                return files

            patches.enter_context(mock.patch.object(save_module, "_live_files", with_the_model))
        if "every file checked" in plants:
            patches.enter_context(mock.patch.object(load_module, "checks_beside_own_shard",
                                                    resume_jobs.every_file_checked))
        if "base read again" in plants:  # a resume fills its engine from --init-from's files before the checkpoint
            patches.enter_context(mock.patch.object(loop_module, "_restores", lambda cfg: False))
        if "tensors listed at resume" in plants:  # the record's source lists the tensors, as it did before
            real_source = init_from.weight_source
            patches.enter_context(mock.patch.object(
                loop_module, "weight_source",
                lambda path, verify=True, weights=True, listed=True: real_source(path, verify, weights)))
        if "check not handed over" in plants:  # the start-up builds its source anew, as it did before
            patches.enter_context(mock.patch.object(init_from, "checked_source", lambda folder: None))
        before = bytes_counted()
        if checked:  # config_from_args' check under torchrun: weight_source with verify, in the rank
            init_from.weight_source(cfg.checkpoint.init_from)
        report = train_job(cfg, comm)
        mine = {k: v - before[k] for k, v in bytes_counted().items()}
    counted = comm.io.all_gather_json(mine, "test_io_plan_counted")
    summary = report.get("summary")
    if summary is not None:
        for key in mine:
            summary["per_rank"][key] = [c[key] for c in counted]
    return summary


def whole_expert_rows(lazy, e, split, i, tp_slice, rank, first, last, count):
    """Planted (init_from.stacked_rows' place): expert `e`'s slice of the stacked tensor read whole, then split, sliced
    and cut to the rows, as --init-from read it before (a gate_up_proj read for the gate and again for up)."""
    part = split(count(lazy[e]))[i]
    return (part if tp_slice is None else tp_slice.take(part, rank))[first:last]


def whole_files_record(paths: list[str], comm=None) -> tuple[int, list[dict]]:
    """Planted (base_digest.folder_record's place): each file hashed whole by one rank, the files dealt out by size."""
    mine = share_by_size([(p, os.path.getsize(p)) for p in paths], comm.world_size)[comm.rank]
    digests = {name: d for got in comm.io.all_gather_json({os.path.basename(p): sha256_file(p)[1] for p in mine},
                                                          "planted_hash") for name, d in got.items()}
    return 0, [{"name": os.path.basename(p), "bytes": os.path.getsize(p), "blocks_sha256": digests[
        os.path.basename(p)]} for p in paths]


def hash_job(cfg: Config, comm: Comm, folder: str, plants: tuple[str, ...] = ()) -> dict:
    """The record every rank computes of --init-from `folder` (rank 0's) and each rank's bytes read for it."""
    with contextlib.ExitStack() as patches:
        if "whole files" in plants:
            patches.enter_context(mock.patch.object(init_from, "folder_record", whole_files_record))
        source = init_from.weight_source(folder, verify=False)
        before = bytes_counted()["checkpoint_bytes_read"]
        record = source.record(comm)
        hashed = bytes_counted()["checkpoint_bytes_read"] - before
    return {"record": record, "hashed": comm.io.all_gather_json(hashed, "test_hashed")}
