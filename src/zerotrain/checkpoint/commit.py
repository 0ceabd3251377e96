"""Committing written checkpoint files: per-rank file lists, the manifest, the rename into place, `latest`, retention.

Every rank writes and fsyncs its files in `.step_XXXXXXXX.tmp/`, then a sidecar listing them (name,
size, sha256) tagged with the writer's session and the step. Once every rank is known to be done,
rank 0 alone reads every sidecar (which is also how it finds out whether it sees the other nodes'
files at all), writes and fsyncs the manifest, renames the folder to `step_XXXXXXXX/`, replaces
`latest` atomically, and only then applies retention. A crash anywhere before the rename leaves a
`.tmp` folder nobody reads; after it, `latest` still names the previous checkpoint until replaced.
"""

from __future__ import annotations

import json
import os
import shutil

from zerotrain.durable import write_atomic, write_json

from .format import LATEST, MANIFEST, CheckpointError, _fsync_path, committed_steps, read_latest, step_name, step_of
from .stream import FileRecord, storage_delay

SIDECAR_PREFIX = "files-rank"


def tmp_name(step: int) -> str:
    return "." + step_name(step) + ".tmp"


def sidecar_name(rank: int) -> str:
    return f"{SIDECAR_PREFIX}{rank:05d}.json"


def write_sidecar(folder: str, rank: int, session: str, step: int, records: list[FileRecord]) -> None:
    """This rank's list of the files it wrote (already fsynced) into `folder`, for rank 0 to read.

    Not fsynced itself: rank 0 reads it before the commit and deletes it; what must survive a crash
    (the files, the folder's entries, the manifest) is made durable by the writer and the commit.
    """
    body = {"session": session, "step": step, "rank": rank, "files": [r.to_dict() for r in records]}
    # whole or absent: rank 0 never reads half a list
    write_json(os.path.join(folder, sidecar_name(rank)), body, durable=False)


def read_sidecars(folder: str, world_size: int, session: str, step: int) -> list[dict]:
    """Every rank's file records; CheckpointError if rank 0 cannot see a rank's files from this save."""
    records = []
    for rank in range(world_size):
        path = os.path.join(folder, sidecar_name(rank))
        try:
            with open(path) as f:
                body = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            body = None
        if not body or body.get("session") != session or body.get("step") != step:
            raise _unshared(rank, folder, sidecar_name(rank))
        for info in body["files"]:
            file = os.path.join(folder, info["name"])
            if not os.path.isfile(file) or os.path.getsize(file) != info["bytes"]:
                raise _unshared(rank, folder, info["name"])
        records += body["files"]
    return records


def _unshared(rank: int, folder: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"rank 0 cannot see rank {rank}'s files ({name} in {folder}): the checkpoint folder must be on a "
        "filesystem shared by all nodes (set --ckpt-dir to such a folder)")


def commit(root: str, step: int, base: dict, world_size: int, session: str, keep: int) -> tuple[str, dict]:
    """Rank 0: turn the written `.tmp` folder of `step` into the committed checkpoint; (path, manifest)."""
    tmp = os.path.join(root, tmp_name(step))
    files = read_sidecars(tmp, world_size, session, step)
    manifest = {**base, "files": sorted(files, key=lambda f: f["name"])}
    listed = {f["name"] for f in files}
    for name in os.listdir(tmp):  # the sidecars, and debris a crashed earlier attempt at this step left
        if name not in listed:
            _remove(os.path.join(tmp, name))
    write_json(os.path.join(tmp, MANIFEST), manifest)
    storage_delay(os.path.getsize(os.path.join(tmp, MANIFEST)))
    _fsync_path(tmp)
    final = os.path.join(root, step_name(step))
    _rename_into_place(tmp, final)
    point_latest(root, step_name(step))
    if keep:
        retain(root, keep)
    _clear_debris(root, step)
    return final, manifest


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def _rename_into_place(tmp: str, final: str) -> None:
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


def point_latest(root: str, name: str) -> None:
    """Replace `latest` atomically: a reader sees the old name or the new one, never a partial file."""
    write_atomic(os.path.join(root, LATEST), name + "\n")
    _fsync_path(root)


def retain(root: str, keep: int) -> None:
    """Keep `keep` committed checkpoints counting the one `latest` names; delete only older ones.

    Folders newer than `latest` (a run restarted from an earlier step) and what `latest` names are
    never touched; ordering is by step number, not by name or time.
    """
    latest = step_of(read_latest(root) or "")
    if latest is None:
        return
    older = [n for n in committed_steps(root) if step_of(n) < latest]  # oldest first
    for name in older[: max(0, len(older) - (keep - 1))]:
        folder = os.path.join(root, name)
        storage_delay(sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file()))
        shutil.rmtree(folder, ignore_errors=True)


def _clear_debris(root: str, step: int) -> None:
    """Remove `.tmp` folders of earlier steps (saves that crashed): nothing can commit them any more."""
    for name in os.listdir(root):
        if name.startswith(".step_") and name.endswith(".tmp"):
            earlier = step_of(name[1:-4])
            if earlier is not None and earlier < step:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
