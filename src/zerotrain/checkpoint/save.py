"""Saving a checkpoint atomically: every rank writes and fsyncs its files, rank 0 commits and moves `latest`.

Files are written under a temporary folder name, renamed into place only when every rank's files
are fsynced; `latest` is then replaced atomically, so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ..parallel import Comm, ZeroOneEngine
from .format import FORMAT, LATEST, MANIFEST, MODEL_FILE, VERSION, _fsync_path, _sha256, shard_name, step_name


def save(root: str, step: int, engine: ZeroOneEngine, comm: Comm, config: dict, keep: int = 0):
    """Write step `step` under `root` atomically; return (folder, {file: tensors this rank wrote}, manifest)."""
    rank, W = comm.rank, comm.world_size
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, "." + step_name(step) + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crash mid-save is never committed
        os.makedirs(tmp)
    comm.barrier("checkpoint_barrier")
    written = {shard_name(rank, W): engine.shard_state_dict()}
    if rank == 0:
        written[MODEL_FILE] = engine.full_state_dict()
    infos = []
    for name, tensors in written.items():
        path = os.path.join(tmp, name)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)
        _fsync_path(path)
        infos.append({"name": name, "bytes": os.path.getsize(path), "sha256": _sha256(path)})
    files = [info for rank_infos in comm.all_gather_json(infos, "checkpoint_files") for info in rank_infos]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": W,
        "param_count": engine.layout.numel,
        "precision": engine.precision,
        "torch_version": torch.__version__,
        "layout": engine.layout.to_dict(),
        "config": config,
        "files": sorted(files, key=lambda f: f["name"]),
    }
    if rank == 0:
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        _commit(tmp, final)
        _point_latest(root, step_name(step))
        if keep:
            _retain(root, keep)
    comm.barrier("checkpoint_barrier")
    return final, written, manifest


def _commit(tmp: str, final: str) -> None:
    """Rename the finished folder into place; an older folder of the same step is replaced."""
    old = None
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _point_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_path(root)


def committed_steps(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".old")
                  and os.path.isfile(os.path.join(root, n, MANIFEST)))


def _retain(root: str, keep: int) -> None:
    for name in committed_steps(root)[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
