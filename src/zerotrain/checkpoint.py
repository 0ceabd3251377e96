"""Sharded checkpoints: atomic save, self-describing manifest, integrity checks, resume and resharding.

A checkpoint is a folder `step_{step:08d}/` holding `manifest.json`, `model.safetensors` (the full
fp32 model, loadable without torch.distributed) and one `optim-rank{r}-of-{W}.safetensors` per rank.
It is written under a temporary name and renamed into place only when every rank's files are
fsynced; `latest` is then replaced atomically. Safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from .comm import Comm
from .launch import ZeroTrainError
from .zero import ShardLayout, ZeroOneEngine

FORMAT, VERSION = "zerotrain-checkpoint", 1
MODEL_FILE, MANIFEST, LATEST = "model.safetensors", "manifest.json", "latest"
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(ZeroTrainError):
    pass


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"optim-rank{rank:05d}-of-{world_size:05d}.safetensors"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def resolve_resume(spec: str, root: str) -> str | None:
    """The checkpoint folder to resume from: "" -> none, "auto" -> `root/latest` if present, else a path."""
    if not spec:
        return None
    if spec == "auto":
        latest = os.path.join(root, LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            return os.path.join(root, f.read().strip())
    if os.path.isfile(os.path.join(spec, LATEST)):  # a checkpoint root was given
        return resolve_resume("auto", spec)
    return spec


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {MANIFEST} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
            f"is not {FORMAT!r} version {VERSION}"
        )
    return manifest


def incompatibility(manifest: dict, model_config: dict) -> str | None:
    """Why a checkpoint cannot initialise this model, or None."""
    theirs = manifest["config"]["model"]
    for key, value in model_config.items():
        if theirs.get(key) != value:
            return f"checkpoint has model.{key}={theirs.get(key)}, this run has {value}"
    return None


def verify_files(path: str, manifest: dict, names: list[str] | None = None) -> None:
    """Sizes and sha256 of the listed files (default: all) match the manifest."""
    for info in manifest["files"]:
        if names is not None and info["name"] not in names:
            continue
        file = os.path.join(path, info["name"])
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        if os.path.getsize(file) != info["bytes"] or _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file} is corrupt: size or sha256 differs from {MANIFEST}")


def load(path: str, engine: ZeroOneEngine, comm: Comm) -> int:
    """Restore parameters, master shard, moments and step into `engine`; return the step.

    At the same world size and layout each rank reads only its own shard; otherwise every rank
    rebuilds the full flat state from all shards (through the manifest's layout) and takes its part.
    """
    manifest = read_manifest(path)
    old = ShardLayout.from_dict(manifest["layout"])
    new = engine.layout
    shapes_old = {s.name: s.shape for s in old.slots}
    shapes_new = {s.name: s.shape for s in new.slots}
    if shapes_old != shapes_new:
        raise CheckpointError(f"{path} holds a model with different parameters than this run")
    same = old.to_dict()["params"] == new.to_dict()["params"] and old.buckets == new.buckets
    if same and old.world_size == new.world_size:
        name = shard_name(comm.rank, comm.world_size)
        verify_files(path, manifest, [name])
        engine.load_shard_state_dict(load_file(os.path.join(path, name)))
        return manifest["step"]
    names = [shard_name(r, old.world_size) for r in range(old.world_size)]
    verify_files(path, manifest, names)
    shards = [load_file(os.path.join(path, n)) for n in names]
    sd = {"step": shards[0]["step"]}
    old_at = {s.name: s.offset for s in old.slots}
    for key in STATE_KEYS:
        old_flat = old.assemble([shard[key] for shard in shards])
        new_flat = torch.zeros(new.padded_numel)
        for s in new.slots:
            new_flat[s.offset : s.offset + s.numel] = old_flat[old_at[s.name] : old_at[s.name] + s.numel]
        sd[key] = new.shard(new_flat, comm.rank)
    engine.load_shard_state_dict(sd)
    return manifest["step"]
