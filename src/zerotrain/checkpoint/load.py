"""Loading a checkpoint: find the newest one that verifies, check what is read, restore or reshard the state."""

from __future__ import annotations

import os

import torch

from ..parallel import Comm, ZeroOneEngine
from .format import (LATEST, MANIFEST, STATE_KEYS, CheckpointError, read_latest, read_manifest, shard_name,
                     step_folders, step_of)
from .stream import DTYPE_CODES, read_safetensors
from .verify import (failure_message, files_problem, first_failure, layout_of, name_problem, partition_problem,
                     record_problem, shard_problem, verify)


def find_resumable(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under `root` that verifies, and (folder, why) for each newer one that did not.

    Tried in order: what `latest` names, then the committed step folders older than it, newest
    first (folders newer than `latest` belong to a run that was restarted from an earlier step:
    they are not this run's history). None with an empty list: there is nothing to resume from.
    None with a non-empty list: checkpoints were there and none verifies, an error for the caller.
    """
    latest = read_latest(root)
    names = step_folders(root)
    skipped: list[tuple[str, str]] = []
    if latest is not None:
        if step_of(latest) is None:
            skipped.append((LATEST, f"{os.path.join(root, LATEST)} names {latest!r}, not a step folder"))
        else:
            names = [n for n in names if step_of(n) < step_of(latest)]
            if os.path.isdir(os.path.join(root, latest)):
                names.insert(0, latest)
            else:
                skipped.append((latest, f"{os.path.join(root, LATEST)} names {latest}, which does not exist"))
    for name in names:
        path = os.path.join(root, name)
        bad = first_failure(verify(path))
        if bad is None:
            return path, skipped
        skipped.append((name, failure_message(path, bad)))
    return None, skipped


def resolve_resume(spec: str, root: str) -> str | None:
    """The checkpoint folder to resume from: "" -> none; "auto" -> the newest under `root` that verifies; a path.

    A checkpoint root given as the path is searched like "auto". Raises CheckpointError when
    checkpoints are there but none verifies, naming each one's first bad file.
    """
    if not spec:
        return None
    if spec != "auto":
        if not (os.path.isfile(os.path.join(spec, LATEST)) or
                (not os.path.isfile(os.path.join(spec, MANIFEST)) and step_folders(spec))):
            return spec
        root = spec  # a checkpoint root was given
    path, skipped = find_resumable(root)
    if path is None and skipped:
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(why for _, why in skipped))
    return path


def check_manifest(path: str, manifest: dict, reading: list[str]) -> None:
    """The checks that need no file data (listed files, partition, names of the files to read); raise on the first."""
    for problem, file in ((files_problem(manifest), MANIFEST), (partition_problem(manifest), MANIFEST),
                          *((name_problem(path, n), n) for n in reading)):
        if problem:
            raise CheckpointError(f"{os.path.join(path, file)}: {problem}")


def read_shard(path: str, manifest: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s optimizer shard, its bytes hashed as they are read and checked before use."""
    name = shard_name(rank, manifest["world_size"])
    file = os.path.join(path, name)
    entry = next(f for f in manifest["files"] if f["name"] == name)
    try:
        tensors, record = read_safetensors(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: is missing") from None
    problem = record_problem(record, entry) or shard_problem(
        {k: (_code(t), list(t.shape)) for k, t in tensors.items()}, manifest["layout"]["shard_numel"])
    if problem:
        raise CheckpointError(f"{file}: {problem}")
    return tensors


def _code(t: torch.Tensor) -> str:
    return DTYPE_CODES.get(t.dtype, str(t.dtype))


def load(path: str, engine: ZeroOneEngine, comm: Comm) -> dict:
    """Restore parameters, master shard, moments and step into `engine`; return the manifest.

    Everything read is checked first (schema, names, partition, size and sha256 of the very bytes
    loaded, shard shapes). At the same world size and layout each rank reads only its own shard;
    otherwise every rank rebuilds the full flat state from all shards (through the manifest's
    layout) and takes its part.
    """
    manifest = read_manifest(path)
    check_manifest(path, manifest, [])
    old = layout_of(manifest, path)
    new = engine.layout
    same = old.to_dict()["params"] == new.to_dict()["params"] and old.buckets == new.buckets
    ranks = [comm.rank] if same and old.world_size == new.world_size else list(range(old.world_size))
    check_manifest(path, manifest, [shard_name(r, old.world_size) for r in ranks])
    if {s.name: s.shape for s in old.slots} != {s.name: s.shape for s in new.slots}:
        raise CheckpointError(f"{path} holds a model with different parameters than this run")
    if len(ranks) == 1:
        engine.load_shard_state_dict(read_shard(path, manifest, comm.rank))
        return manifest
    shards = [read_shard(path, manifest, r) for r in ranks]
    sd = {"step": shards[0]["step"]}
    old_at = {s.name: s.offset for s in old.slots}
    for key in STATE_KEYS:
        old_flat = old.assemble([shard[key] for shard in shards])
        new_flat = torch.zeros(new.padded_numel)
        for s in new.slots:
            new_flat[s.offset : s.offset + s.numel] = old_flat[old_at[s.name] : old_at[s.name] + s.numel]
        sd[key] = new.shard(new_flat, comm.rank)
    engine.load_shard_state_dict(sd)
    return manifest
