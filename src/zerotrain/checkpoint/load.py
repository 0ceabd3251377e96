"""Loading a checkpoint: the one to resume found, every file's data read by one rank and checked as it is read, the
state restored or resharded.

`resume` is every load's path: a restart, `--resume auto`, `--resume PATH`, a rollback (load_checkpoint). On the
mesh and layout that wrote the checkpoint, each rank reads its own shard once, straight into the engine's state,
hashing the bytes it loads; on another, the ranks verify the files together and then read by ranges. find_resumable
and resolve_resume are the same search in one process, every file read there: for a caller outside the ranks, never
at a run's start.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from safetensors import safe_open

from zerotrain.errors import ConfigError
from zerotrain.parallel import Comm, ShardLayout, ZeroEngine, shard_values

from .format import (LATEST, MANIFEST, STATE_KEYS, CheckpointError, committed_folder, ep_of, mesh_of,
                      read_latest, read_manifest, shard_name, step_folders, step_of)
from .homes import CheckpointHomes, engine_shapes, expert_numel, same_expert_layout, shard_parts
from .reshard import Read, shard_reads
from .stream import FileRecord, count_read, read_hashed_into, sha256_file
from .verify import (checks_beside_own_shard, failure_message, files_problem, first_failure, name_problem,
                     partition_problem, record_problem, replica_digests, replicas_check, shard_problem, size_problem,
                     verify_checkpoint, verify_together)


def find_resumable(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under `root` that verifies (in this process, every file read here), and (folder, why)
    for each newer one that did not.

    Tried in order: resume_candidates(root). None with an empty list: there is nothing to resume from. None with a
    non-empty list: checkpoints were there and none verifies, an error for the caller.
    """
    names, skipped = resume_candidates(root)
    for name in names:
        path = os.path.join(root, name)
        bad = first_failure(verify_checkpoint(path))
        if bad is None:
            return path, skipped
        skipped.append((name, failure_message(path, bad)))
    return None, skipped


def resume_candidates(root: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The step folders under `root` a resume tries, newest first, and (name, why) for what `latest` names in vain.

    What `latest` names, then the committed step folders older than it, newest first (folders newer than `latest`
    belong to a run that was restarted from an earlier step: they are not this run's history).
    """
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


def is_checkpoint_root(path: str) -> bool:
    """Whether the folder `path` holds checkpoints (a `latest`, or step folders and no manifest of its own) rather than
    being one."""
    return os.path.isfile(os.path.join(path, LATEST)) or (
        not os.path.isfile(os.path.join(path, MANIFEST)) and bool(step_folders(path)))


def resolve_resume(spec: str, root: str) -> str | None:
    """The checkpoint folder to resume from, found in this process: "" -> none; "auto" -> the newest under `root`
    that verifies; a path.

    A checkpoint root given as the path is searched like "auto". Raises CheckpointError when
    checkpoints are there but none verifies, naming each one's first bad file.
    """
    if not spec:
        return None
    if spec != "auto":
        if not is_checkpoint_root(spec):
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


def read_shard(path: str, manifest: dict, rank: int, places: dict | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s optimizer shard: its tensors' dtypes and shapes checked from its header, then its values read a
    block at a time, every byte hashed as it is read, and the size and sha256 checked against the manifest.

    `places`: where its values go, by key (shard_places: the engine's own state), read there with pread, no copy of
    the file held; the tensors without a place (all of them without `places`) are returned, each its own. A file
    that fails its check raises once it is read: its places then hold what it held.
    """
    name = shard_name(rank, manifest["world_size"])
    file = os.path.join(path, name)
    entry = next(f for f in manifest["files"] if f["name"] == name)
    problem = size_problem(path, entry)
    if problem:
        raise CheckpointError(f"{file}: {problem}")

    def checked(header: dict) -> dict:  # before a value is read into a place
        problem = shard_problem(header, manifest["layout"]["shard_numel"], expert_numel(manifest))
        if problem:
            raise CheckpointError(f"{file}: {problem}")
        return places or {}

    try:
        tensors, record = read_hashed_into(file, checked)
    except CheckpointError as e:  # its header is not a safetensors header, or not the layout's
        corrupt = record_problem(FileRecord(name, *sha256_file(file)), entry)  # a corrupt file is named so first
        raise CheckpointError(f"{file}: {corrupt}" if corrupt else str(e)) from None
    problem = record_problem(record, entry)
    if problem:
        raise CheckpointError(f"{file}: {problem}")
    return tensors


def shard_places(engine) -> dict:
    """Where `engine` holds the state its rank's shard file holds, by the file's keys: each part's masters where they
    lie (master_views, in shard order), exp_avg and exp_avg_sq, the keys of an --ep run's expert engine prefixed
    expert_; its parameters' all-gathers finished first (the owned values are about to be written). The step counts
    have no place: they are read apart, for load_shard_state_dict."""
    places = {}
    for prefix, part in shard_parts(engine):
        part.wait_params()
        places.update({prefix + "master": part.master_views(), prefix + "exp_avg": part.adamw.exp_avg,
                       prefix + "exp_avg_sq": part.adamw.exp_avg_sq})
    return places


def refuse_ep_at_other_tp(path: str, manifest: dict, engine) -> None:
    """ConfigError when an expert-parallel checkpoint would resume at another --tp, or a checkpoint at another --tp
    into an --ep run: the experts reshard across --ep and world size (homes.CheckpointHomes), not yet across TP
    degrees."""
    old_ep, new_ep, old_tp = ep_of(manifest), engine.mesh.ep_size, mesh_of(manifest)[0]
    if max(old_ep, new_ep) > 1 and old_tp != engine.mesh.tp_size:
        raise ConfigError(f"{path} was written at --ep {old_ep} with --tp {old_tp}; this run has --tp "
                          f"{engine.mesh.tp_size} (--ep {new_ep}): expert parallelism reshards across --ep and world "
                          f"size, not across --tp yet (resume with --tp {old_tp})")


def resume(target: str, engine: ZeroEngine, comm: Comm, *, search: bool,
           refuse: Callable[[dict, str], str | None] | None = None) -> tuple[str | None, dict, list[tuple[str, str]]]:
    """Restore into `engine` the checkpoint `target` names, each file's data read by one rank: (folder, its manifest,
    (name, why) of each candidate skipped).

    `search`: `target` is a checkpoint root; its candidates (resume_candidates, newest first) are tried in turn, each
    that fails skipped, the first that verifies restored; (None, {}, skipped) when none does (an error for the caller
    when `skipped` is not empty). Otherwise `target` is one checkpoint folder, and a failure raises CheckpointError
    naming the file and the problem. Every rank calls this together; rank 0's view of the folder decides the candidates.
    `refuse(manifest, folder)`: rank 0's reason to refuse a candidate (a ConfigError on every rank), or None.
    """
    view = None
    if comm.rank == 0:
        names, skipped = resume_candidates(target) if search else ([""], [])
        view = [[os.path.join(target, n) if n else target for n in names], skipped]
    paths, skipped = comm.io.all_gather_json(view, "agree_resume")[0]
    skipped = [tuple(s) for s in skipped]
    for path in paths:
        manifest, problem = _load_verified(path, engine, comm, refuse)
        if problem is None:
            return path, manifest, skipped
        if not search:
            raise CheckpointError(problem)
        skipped.append((os.path.basename(path), problem))
    return None, {}, skipped


def load_checkpoint(path: str, engine: ZeroEngine, comm: Comm) -> dict:
    """Restore the checkpoint folder `path` into `engine` (resume without a search); its manifest."""
    return resume(path, engine, comm, search=False)[1]


def _load_verified(path: str, engine: ZeroEngine, comm: Comm, refuse) -> tuple[dict, str | None]:
    """Restore the checkpoint at `path` into `engine` if it verifies: (manifest, None); else ({}, the first problem a
    rank found). A problem found before any file data is read leaves the engine untouched; a shard read in place that
    then fails its hash or the replicas check has overwritten the engine's state, which the caller must not train
    on: it restores another checkpoint (resume's next candidate overwrites every value) or stops.

    `comm` is the world communicator (shard files are named by world rank); the engine's mesh may differ from the one
    that wrote the checkpoint, but it must hold the same model (full names and full shapes). Every rank runs the checks
    that read no file data. On the same mesh and local layout each rank then reads its own shard straight into the
    engine's state where it lies (shard_places; no copy of the file held beside it), hashing it as it is read: that
    is its verification, and the shard is read once. The other files' checks (tokenizer files; at version 1 the
    model file, against the masters) are shared out over the ranks (checks_beside_own_shard); with TP
    each rank digests its own shard's replicated masters in memory (replica_digests), and the digests travel with the
    one all_gather_json that agrees every rank's outcome before anything is restored, so every rank compares them
    and none reads another's shard.
    Otherwise (another world size, TP degree, --ep or bucket size) a ranged read cannot hash what it loads: the ranks
    verify the checkpoint together, each file hashed by one of them, and each then reads only the ranges of the old
    shards it will own (_reshard), for each shard its file holds (with --ep the dense engine's and the expert
    engine's: its block of experts, wherever the checkpoint held them).
    """
    manifest, homes, state, digests, problem, refused, same = {}, None, None, None, None, None, False
    try:
        manifest = read_manifest(path)
        check_manifest(path, manifest, [])
        refuse_ep_at_other_tp(path, manifest, engine)
        refused = refuse(manifest, path) if refuse is not None and comm.rank == 0 else None
        if not refused:  # a refusal says more than "another model"
            homes = CheckpointHomes.of(manifest, path)  # the one reading of its layouts, for the check and the load
            same = _same_mesh(path, manifest, homes, engine)
        if same:
            state, digests = _read_own_share(path, manifest, homes, engine, comm)
    except CheckpointError as e:
        problem = str(e)
    except OSError as e:  # a file this rank cannot read: the others must hear of it, not wait for it
        problem = f"{e.filename or path}: cannot be read ({e.strerror})"
    outcomes = comm.io.all_gather_json([problem, refused, digests], "resume_outcome")
    if outcomes[0][1]:
        raise ConfigError(outcomes[0][1])
    problem = next((p for p, _, _ in outcomes if p), None)
    if problem is not None:
        return {}, problem
    if same:
        if mesh_of(manifest)[0] > 1:  # TP: the replicas each rank digested of its own shard, compared on every rank
            check = replicas_check(path, manifest, {q: d for q, (_, _, d) in enumerate(outcomes)})
            if not check.ok:
                return {}, failure_message(path, check)
        engine.load_shard_state_dict(state)  # its values already in place: the step counts, the parameters published
        return manifest, None
    bad = first_failure(verify_together(path, comm))
    if bad is not None:
        return {}, failure_message(path, bad)
    state = {}
    for prefix, part in shard_parts(engine):  # with --ep: the dense engine's shard, then the expert engine's
        # part.dp: the group the part shards over (its rank is the DP rank there; the expert replica group's with --ep)
        state.update({prefix + k: v for k, v in _reshard(path, manifest, homes, part.layout, part.tp_slices,
                                                         part.mesh.tp_rank, part.dp.rank, prefix=prefix).items()})
    engine.load_shard_state_dict(state)
    return manifest, None


def _same_mesh(path: str, manifest: dict, homes: CheckpointHomes, engine: ZeroEngine) -> bool:
    """Whether `engine` has the mesh, TP slices, local layout and expert layout of the checkpoint at `path` (`homes`:
    its parameters' places; each rank's shard loads as it is); CheckpointError when it holds another model (compared
    by global names and full shapes: an --ep checkpoint's experts are every EP rank's, whatever the EP degrees)."""
    (old_tp, old_dp), new, mesh = mesh_of(manifest), engine.layout, engine.mesh
    if homes.shapes != engine_shapes(engine):
        raise CheckpointError(f"{path} holds a model with different parameters than this run")
    old = homes.layout
    # With --dp-replicate R > 1 a rank's shard file is replica group 0's: read by ranges, as at another mesh
    return ((old_tp, old_dp, 1) == (mesh.tp_size, mesh.dp_shard.world_size, mesh.dp_replicate_size)
            and homes.tp_slices == engine.tp_slices
            and old.to_dict()["params"] == new.to_dict()["params"] and old.buckets == new.buckets
            and same_expert_layout(homes, engine))


def _read_own_share(path: str, manifest: dict, homes: CheckpointHomes, engine: ZeroEngine,
                    comm: Comm) -> tuple[dict, dict[str, str]]:
    """This world rank's shard, read into `engine`'s state where it lies and hashed as it is read: the state dict to
    restore (those places and the step counts); and the replica digests of its masters (taken in place: no byte read
    twice; `homes`: the checkpoint's layouts), then its share of the other files' checks; CheckpointError naming the
    first bad file."""
    check_manifest(path, manifest, [shard_name(comm.rank, manifest["world_size"])])
    places = shard_places(engine)
    state = {**places, **read_shard(path, manifest, comm.rank, places)}
    digests = replica_digests(manifest, homes.layout, homes.expert_layout, comm.rank,
                              lambda lo, hi, key: shard_values(places[key], lo, hi).cpu())
    bad = first_failure(checks_beside_own_shard(path, manifest, (comm.rank, comm.world_size)))
    if bad is not None:
        raise CheckpointError(failure_message(path, bad))
    return state, digests


def _reshard(path: str, manifest: dict, homes: CheckpointHomes, new: ShardLayout, new_slices: dict, tp_rank: int,
             dp_rank: int, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """The shard state of TP rank `tp_rank`, DP rank `dp_rank` in layout `new`, read by ranges from the checkpoint
    at `path` (verified: see load_checkpoint), whose parameters live where `homes` says (built once per load, for
    every part). `prefix` "expert_": `new` is an --ep run's expert layout (`dp_rank` its rank in the replica group),
    its experts found wherever the checkpoint holds them (homes.CheckpointHomes: its flat layout at --ep 1, its
    expert layout of their EP rank otherwise); the keys of the result are unprefixed.

    Each old shard this rank needs is opened once per state key, and only the byte ranges `shard_reads` names
    are read (safetensors' lazy slices of the memory-mapped file); the step is world rank 0's. Exact: values
    are only copied, padding stays zero. Measured (gpt2 124M, a 3-rank checkpoint resumed on 2 ranks, 2 cores):
    peak RSS 2,767 MiB per rank, against 5,206 when every rank read every old shard whole into full flat
    buffers; of it, the engine held 1,896 before the load, this rank's new state 708 (3 x its shard) and the
    pages of one key of one old shard, mapped meanwhile, 157.
    """
    world_size = manifest["world_size"]
    reads = shard_reads(homes, new, new_slices, tp_rank, dp_rank)
    sd = {key: torch.zeros(new.shard_numel, dtype=torch.float32) for key in STATE_KEYS}
    for rank in sorted({r.rank for r in reads}):
        _read_ranges(os.path.join(path, shard_name(rank, world_size)), [r for r in reads if r.rank == rank], sd)
    with safe_open(os.path.join(path, shard_name(0, world_size)), framework="pt") as f:
        sd["step"] = f.get_tensor(homes.step_key(prefix)).clone()
    count_read(sd["step"].numel() * sd["step"].element_size())
    return sd


def _read_ranges(file: str, reads: list[Read], sd: dict[str, torch.Tensor]) -> None:
    """Copy each read's values of every state key (under its prefix in the file) from the shard `file` into `sd`,
    reading only those bytes.

    The file is mapped once per key and let go before the next: the pages read stay resident only meanwhile.
    """
    for key in STATE_KEYS:
        with safe_open(file, framework="pt") as f:
            for prefix in sorted({r.prefix for r in reads}):
                values = f.get_slice(prefix + key)
                for r in reads:
                    if r.prefix == prefix:
                        sd[key][r.dst : r.dst + r.numel] = values[r.src : r.src + r.numel]
                del values
        count_read(sum(r.numel for r in reads) * sd[key].element_size())
