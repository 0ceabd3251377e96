"""Loading a checkpoint: find it, verify its files against the manifest, restore or reshard the state."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from ..parallel import Comm, ShardLayout, ZeroOneEngine
from .format import LATEST, MANIFEST, STATE_KEYS, CheckpointError, _sha256, read_manifest, shard_name


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
