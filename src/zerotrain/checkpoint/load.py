"""Loading a checkpoint: find the newest one that verifies, check what is read, restore or reshard the state."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from zerotrain.parallel import Comm, ShardLayout, ZeroEngine

from .format import (LATEST, MANIFEST, STATE_KEYS, CheckpointError, committed_folder, mesh_of, read_latest,
                      read_manifest, shard_name, step_folders, step_of, tp_slices_of)
from .reshard import Read, full_shapes, shard_reads
from .stream import DTYPE_CODES, count_read, read_safetensors
from .verify import (failure_message, files_problem, first_failure, layout_of, name_problem, partition_problem,
                     record_problem, shard_problem, verify_checkpoint, verify_together)


def find_resumable(root: str, comm: Comm | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under `root` that verifies, and (folder, why) for each newer one that did not.

    Tried in order: what `latest` names, then the committed step folders older than it, newest
    first (folders newer than `latest` belong to a run that was restarted from an earlier step:
    they are not this run's history). None with an empty list: there is nothing to resume from.
    None with a non-empty list: checkpoints were there and none verifies, an error for the caller.

    With `comm`, every rank calls this together: rank 0's view of the folder decides which candidates
    there are, and every rank verifies its share of each (verify_together); the same answer on every rank.
    """
    names, skipped = _candidates(root)
    if comm is not None:
        names, skipped = comm.io.all_gather_json([names, skipped], "agree_resume")[0]
    for name in names:
        path = os.path.join(root, name)
        bad = first_failure(verify_checkpoint(path) if comm is None else verify_together(path, comm))
        if bad is None:
            return path, [tuple(s) for s in skipped]
        skipped.append((name, failure_message(path, bad)))
    return None, [tuple(s) for s in skipped]


def _candidates(root: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The step folders find_resumable tries, newest first, and (name, why) for what `latest` names in vain."""
    latest = read_latest(root)
    names = step_folders(root)
    skipped: list[tuple[str, str]] = []
    if latest is not None:
        if step_of(latest) is None:
            skipped.append((LATEST, f"{os.path.join(root, LATEST)} names {latest!r}, not a step folder"))
        else:
            names = [n for n in names if step_of(n) < step_of(latest)]
            folder = committed_folder(root, latest)  # step_N.old/: a re-save of step N stopped between its renames
            if os.path.isdir(folder):
                names.insert(0, os.path.basename(folder))
            else:
                skipped.append((latest, f"{os.path.join(root, LATEST)} names {latest}, which does not exist"))
    return names, skipped


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


def load_checkpoint(path: str, engine: ZeroEngine, comm: Comm) -> dict:
    """Restore parameters, master shard, moments and step into `engine`; return the manifest.

    `comm` is the world communicator (shard files are named by world rank); the engine's mesh may
    differ from the one that wrote the checkpoint. Everything read is checked first, and the checkpoint
    must hold the same model (full names and full shapes). On the same mesh and local layout each rank
    reads only its own shard, checking the size and sha256 of the very bytes loaded and the shard's
    shapes. Otherwise (another world size, TP degree or bucket size) the ranks verify the checkpoint
    together, each hashing its share of the files, and each then reads only the ranges of the old
    shards it will own (`_reshard`).
    """
    manifest = read_manifest(path)
    check_manifest(path, manifest, [])
    old, old_slices, (old_tp, old_dp) = layout_of(manifest, path), tp_slices_of(manifest), mesh_of(manifest)
    new, mesh = engine.layout, engine.mesh
    if full_shapes(old, old_slices) != full_shapes(new, engine.tp_slices):
        raise CheckpointError(f"{path} holds a model with different parameters than this run")
    same = ((old_tp, old_dp) == (mesh.tp_size, mesh.dp_size) and old_slices == engine.tp_slices
            and old.to_dict()["params"] == new.to_dict()["params"] and old.buckets == new.buckets)
    if same:
        check_manifest(path, manifest, [shard_name(comm.rank, manifest["world_size"])])
        engine.load_shard_state_dict(read_shard(path, manifest, comm.rank))
        return manifest
    # a ranged read cannot hash what it loads: the whole checkpoint is verified first, each file by one rank
    bad = first_failure(verify_together(path, comm))
    if bad is not None:
        raise CheckpointError(failure_message(path, bad))
    # engine.dp: the DP group ZeRO shards over (its rank is the DP rank)
    engine.load_shard_state_dict(_reshard(path, manifest, old, old_slices, new, engine.tp_slices, mesh.tp_rank,
                                          engine.dp.rank))
    return manifest


def _reshard(path: str, manifest: dict, old: ShardLayout, old_slices: dict, new: ShardLayout, new_slices: dict,
             tp_rank: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """The shard state of TP rank `tp_rank`, DP rank `dp_rank` in layout `new`, read by ranges from the checkpoint
    at `path` (verified: see load_checkpoint), whose layout is `old`.

    Each old shard this rank needs is opened once per state key, and only the byte ranges `shard_reads` names
    are read (safetensors' lazy slices of the memory-mapped file); the step is world rank 0's. Exact: values
    are only copied, padding stays zero. Measured (gpt2 124M, a 3-rank checkpoint resumed on 2 ranks, 2 cores):
    peak RSS 2,767 MiB per rank, against 5,206 when every rank read every old shard whole into full flat
    buffers; of it, the engine held 1,896 before the load, this rank's new state 708 (3 x its shard) and the
    pages of one key of one old shard, mapped meanwhile, 157.
    """
    old_tp, world_size = mesh_of(manifest)[0], manifest["world_size"]
    reads = shard_reads(old, old_slices, old_tp, new, new_slices, tp_rank, dp_rank)
    sd = {key: torch.zeros(new.shard_numel, dtype=torch.float32) for key in STATE_KEYS}
    for rank in sorted({r.rank for r in reads}):
        _read_ranges(os.path.join(path, shard_name(rank, world_size)), [r for r in reads if r.rank == rank], sd)
    with safe_open(os.path.join(path, shard_name(0, world_size)), framework="pt") as f:
        sd["step"] = f.get_tensor("step").clone()
    count_read(sd["step"].numel() * sd["step"].element_size())
    return sd


def _read_ranges(file: str, reads: list[Read], sd: dict[str, torch.Tensor]) -> None:
    """Copy each read's values of every state key from the shard `file` into `sd`, reading only those bytes.

    The file is mapped once per key and let go before the next: the pages read stay resident only meanwhile.
    """
    for key in STATE_KEYS:
        with safe_open(file, framework="pt") as f:
            values = f.get_slice(key)
            for r in reads:
                sd[key][r.dst : r.dst + r.numel] = values[r.src : r.src + r.numel]
        del values
        count_read(sum(r.numel for r in reads) * sd[key].element_size())
