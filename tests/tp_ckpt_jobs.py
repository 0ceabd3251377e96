"""Job functions for the tensor-parallel checkpoint tests, run by spawned ranks (importable by module name)."""

from __future__ import annotations

import copy
import os

import torch
from dist_jobs import without_moments
from safetensors.torch import save_file

from zerotrain import checkpoint
from zerotrain.checkpoint import homes as homes_module
from zerotrain.config import Config
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import Comm
from zerotrain.training.loop import build_engine, train


def full_params(engine, comm: Comm) -> dict[str, torch.Tensor] | None:
    """The full model's parameters on rank 0 (None elsewhere), placed by hand from DP replica 0's TP ranks.

    Independent of the checkpoint code: every rank's parameter buffer is gathered, and world ranks
    0 .. T-1 (TP ranks of replica 0) give the slices.
    """
    engine.wait_params()
    rows = comm.all_gather_rows(engine.flat_params.detach().float(), "test_full_params")
    if comm.rank != 0:
        return None
    out = {}
    for s in engine.layout.slots:
        pieces = [rows[t, s.offset : s.offset + s.numel].view(s.shape) for t in range(engine.mesh.tp_size)]
        if s.name in engine.tp_slices:
            tp_slice = engine.tp_slices[s.name]
            out[s.name] = torch.empty(tp_slice.full_shape)
            for t, piece in enumerate(pieces):
                tp_slice.place(out[s.name], piece, t)
        else:
            out[s.name] = pieces[0].clone()
    return out


def summary(result, comm: Comm) -> dict:
    return {"losses": [r["loss"] for r in result.records], "digests": result.digests, "start": result.start_step,
            "params": full_params(result.engine, comm), "mesh": result.engine.mesh.describe()}


def train_and_save_job(cfg: Config, comm: Comm) -> dict:
    """Train uninterrupted (saving every cfg.checkpoint.every steps)."""
    return summary(train(cfg, comm), comm)


def run_then_resume_on_the_same_mesh_job(cfg: Config, comm: Comm) -> dict:
    """Train uninterrupted; save the final state once sync and once async; resume from step 3 on the same mesh."""
    first = train(cfg, comm)
    folders = {}
    for way in ("sync", "async"):
        writer = checkpoint.CheckpointWriter(os.path.join(cfg.logging.out, way), comm)
        if way == "sync":
            folders[way] = writer.save(cfg.loop.steps, first.engine, {"config": cfg.to_dict()})[0]
        else:
            writer.start(cfg.loop.steps, first.engine, {"config": cfg.to_dict()})
            folders[way] = writer.finish()
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.resume = os.path.join(cfg.checkpoint.dir, checkpoint.step_name(3))
    resumed.checkpoint.every = 0
    resumed.logging.metrics = ""
    return {"first": summary(first, comm), "resumed": summary(train(resumed, comm), comm), "folders": folders}


def _dump_loaded_state(cfg: Config, comm: Comm, tag: str) -> dict:
    """Build a fresh engine on this mesh, load cfg.checkpoint.resume into it, write every rank's shard state."""
    engine = build_engine(cfg, comm)
    checkpoint.load_checkpoint(cfg.checkpoint.resume, engine, comm)
    state = {k: v.detach().cpu().contiguous() for k, v in engine.shard_state_dict().items()}
    save_file(state, os.path.join(cfg.logging.out, f"state-{tag}-rank{comm.rank:02d}.safetensors"))
    return {"layout": engine.layout.to_dict(), "mesh": engine.mesh.describe(),
            "tp_slices": {n: s.to_dict() for n, s in engine.tp_slices.items()}}


def cross_mesh_resume_job(cfg: Config, comm: Comm, planted: str = "") -> dict:
    """The state right after loading on this mesh (per rank, in files), then the resumed run to the end.

    `planted` also dumps the state of a buggy load under the tag "planted": "swapped slices" reads the
    old TP slices with TP ranks 0 and 1 exchanged; "no moments" loses AdamW's moments.
    """
    out = {"loaded": _dump_loaded_state(cfg, comm, "real")}
    if planted == "swapped slices":
        real = homes_module.tp_slices_of  # what the load's CheckpointHomes reads the old slices with
        homes_module.tp_slices_of = lambda manifest, *key: {n: TPSlice(s.dim, s.full_shape, s.parts[::-1])
                                                            for n, s in real(manifest, *key).items()}
        try:
            _dump_loaded_state(cfg, comm, "planted")
        finally:
            homes_module.tp_slices_of = real
    elif planted == "no moments":
        real = checkpoint.load_checkpoint
        checkpoint.load_checkpoint = without_moments(real)
        try:
            _dump_loaded_state(cfg, comm, "planted")
        finally:
            checkpoint.load_checkpoint = real
    out["resumed"] = summary(train(cfg, comm), comm)
    return out


def resume_swapped_slices_job(cfg: Config, comm: Comm) -> dict:
    return cross_mesh_resume_job(cfg, comm, "swapped slices")


def resume_without_moments_job(cfg: Config, comm: Comm) -> dict:
    return cross_mesh_resume_job(cfg, comm, "no moments")


def bf16_saves_job(cfg: Config, comm: Comm) -> dict:
    """bf16 with TP: train (saving sync at the end), then save the final state async; both folders."""
    result = train(cfg, comm)
    writer = checkpoint.CheckpointWriter(os.path.join(cfg.logging.out, "async"), comm)
    writer.start(cfg.loop.steps, result.engine, {"config": cfg.to_dict()})
    return {"sync": result.checkpoints[-1], "async": writer.finish(), "params": full_params(result.engine, comm)}
