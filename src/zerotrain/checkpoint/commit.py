"""Committing written checkpoint files: per-rank file lists, the manifest, the rename into place, `latest`, retention.

Every rank writes and fsyncs its files in `.step_XXXXXXXX.tmp/`, then a sidecar listing them (name,
size, sha256) tagged with the writer's session and the step. Once every rank is known to be done,
rank 0 alone reads every sidecar (which is also how it finds out whether it sees the other nodes'
files at all), writes and fsyncs the manifest, renames the folder to `step_XXXXXXXX/`, replaces
`latest` atomically, and only then applies retention. A crash anywhere before the rename leaves a
`.tmp` folder nobody reads; after it, `latest` still names the previous checkpoint until replaced.

Re-saving a step whose folder exists (a run resumed from an earlier checkpoint, or replaying after a rollback)
takes two renames: the committed `step_N/` aside to `step_N.old/`, then the new folder into place. No portable
rename replaces a non-empty folder in one step (Linux's renameat2 exchange does, but not on every filesystem, and
Python has no call for it), and no order of operations helps: `latest` may name `step_N` itself, and pointing it
at an older step for the moment would send a crash's resume back past step N. So the state between the two
renames is recognised instead, wherever it matters: a `step_N.old/` holding its manifest with no `step_N/` beside
it IS step N's committed checkpoint. Readers (find_resumable, `zerotrain verify`, load_model) resolve `latest`
through format.committed_folder and change nothing; the processes that hold the folder put it back
(put_back_moved_aside): the launcher as it prepares a run (run_folder.prepare_run, before it looks for the
checkpoint to resume), rank 0 after an elastic restart, and rank 0 before every commit. A `step_N.old/` beside a
committed `step_N/` is the copy a finished re-save replaced, and goes. Retention deletes step folders only
(committed_steps), so a moved-aside folder is never deleted while it is the only copy of its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Callable

from zerotrain.durable import write_atomic, write_json

from .format import (ASIDE, LATEST, MANIFEST, CheckpointError, committed_steps, fsync_path, read_latest, step_name,
                     step_of)
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


def wait_for_sidecars(folder: str, world_size: int, session: str, step: int, timeout_s: float,
                      poll_s: float = 0.05) -> None:
    """Rank 0, with no collective: wait until every rank's sidecar of this save is in `folder` (each one written after
    its rank's files were fsynced, so together they say that every rank's files are durable); CheckpointError naming
    the first missing rank after `timeout_s`. A stop's save agrees through the folder itself: its ranks cannot meet
    in a collective while their training threads are still inside the step."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            read_sidecars(folder, world_size, session, step)
            return
        except CheckpointError as e:
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint step {step}: not every rank's files were written within "
                                      f"{timeout_s:g} s ({e})") from None
        time.sleep(poll_s)


def _unshared(rank: int, folder: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"rank 0 cannot see rank {rank}'s files ({name} in {folder}): the checkpoint folder must be on a "
        "filesystem shared by all nodes (set --ckpt-dir to such a folder)")


def commit(root: str, step: int, base: dict, world_size: int, session: str, keep: int,
           between_renames: Callable[[int], None] | None = None) -> tuple[str, dict]:
    """Rank 0: turn the written `.tmp` folder of `step` into the committed checkpoint; (path, manifest).

    `between_renames(step)`: called after an existing folder of the step is moved aside, before the new one is
    renamed into place (fault injection: a crash there)."""
    put_back_moved_aside(root)  # what a crash between an earlier re-save's renames left, before anything moves
    tmp = os.path.join(root, tmp_name(step))
    files = read_sidecars(tmp, world_size, session, step)
    manifest = {**base, "files": sorted(files, key=lambda f: f["name"])}
    listed = {f["name"] for f in files}
    for name in os.listdir(tmp):  # the sidecars, and debris a crashed earlier attempt at this step left
        if name not in listed:
            _remove(os.path.join(tmp, name))
    write_json(os.path.join(tmp, MANIFEST), manifest)
    storage_delay(os.path.getsize(os.path.join(tmp, MANIFEST)))
    fsync_path(tmp)
    final = os.path.join(root, step_name(step))
    _rename_into_place(tmp, final, (lambda: between_renames(step)) if between_renames else None)
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


def _rename_into_place(tmp: str, final: str, between: Callable[[], None] | None = None) -> None:
    """Rename the finished folder into place; an older folder of the same step is moved aside, then removed."""
    old = None
    if os.path.exists(final):
        old = final + ASIDE
        shutil.rmtree(old, ignore_errors=True)  # a copy an earlier re-save replaced: `final` is there
        os.rename(final, old)
    if between is not None:
        between()
    os.rename(tmp, final)
    fsync_path(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def put_back_moved_aside(root: str) -> list[str]:
    """Settle what re-saves left moved aside under `root`; the step folders put back, by name.

    `step_N.old/` with its manifest and no `step_N/`: a re-save crashed between its two renames, and it is step N's
    committed checkpoint: renamed back to `step_N/`. `step_N.old/` beside a committed `step_N/` (manifest present):
    the copy a finished re-save replaced, removed. Anything else is left as it is. Only a process that holds the
    folder calls this (the launcher preparing the run, rank 0 restarting or committing): a reader changes nothing.
    """
    if not os.path.isdir(root):
        return []
    restored = []
    for name in sorted(os.listdir(root)):
        final = name[: -len(ASIDE)]
        if not name.endswith(ASIDE) or step_of(final) is None or not os.path.isdir(os.path.join(root, name)):
            continue
        if not os.path.exists(os.path.join(root, final)) and os.path.isfile(os.path.join(root, name, MANIFEST)):
            os.rename(os.path.join(root, name), os.path.join(root, final))
            restored.append(final)
        elif os.path.isfile(os.path.join(root, final, MANIFEST)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if restored:
        fsync_path(root)
    return restored


def point_latest(root: str, name: str) -> None:
    """Replace `latest` atomically: a reader sees the old name or the new one, never a partial file."""
    write_atomic(os.path.join(root, LATEST), name + "\n")
    fsync_path(root)


def retain(root: str, keep: int) -> None:
    """Keep `keep` committed checkpoints counting the one `latest` names; delete only older ones.

    Folders newer than `latest` (a run restarted from an earlier step) and what `latest` names are
    never touched; ordering is by step number, not by name or time. A `step_N.old/` folder is no step folder:
    retention never deletes one (put_back_moved_aside settles them).
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
