"""`zerotrain verify PATH`: check a checkpoint folder (any mesh), or every checkpoint under a root, against its manifest."""

from __future__ import annotations

import argparse
import os

from zerotrain.checkpoint import LATEST, MANIFEST, committed_folder, read_latest, step_folders, verify_checkpoint
from zerotrain.checkpoint.format import step_of
from zerotrain.checkpoint.verify import failure_message, first_failure
from zerotrain.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="check checkpoints: manifest, file names, sizes, sha256, layout, shards, model",
        description="PATH is a checkpoint folder (step_XXXXXXXX), or a checkpoint root: then what `latest` names "
                    "and every committed step folder, newest first. Checkpoints of any TP x DP mesh: one shard "
                    "per rank, whose masters assemble to the full model through the layout and the TP slices "
                    "(format 1 also held it as model.safetensors, checked against them). Prints one line per "
                    "check; exits 0 when every check passes, 1 naming the first bad file and why.")
    p.add_argument("path", help="a step folder or a checkpoint root")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    path = args.path
    if not os.path.exists(path):
        raise ConfigError(f"verify {path}: no such checkpoint folder or checkpoint root")
    first_bad, folders = None, 0
    for folder, note in checkpoints_to_verify(path):
        if note is not None:
            print(f"== {folder}{note}")
        if not os.path.isdir(folder):  # `latest` names a folder that is not there
            line = f"{os.path.join(path, LATEST)} names {os.path.basename(folder)}, which does not exist"
            print(f"FAIL latest {LATEST}: {line}")
            first_bad = first_bad or line
            continue
        checks = verify_checkpoint(folder)
        folders += 1
        for check in checks:
            print(check.line())
        bad = first_failure(checks)
        if bad and first_bad is None:
            first_bad = failure_message(folder, bad)
    if first_bad:
        print(f"FAILED: {first_bad}")
        return 1
    print(f"verified: {folders} checkpoint{'s' if folders != 1 else ''}, every check passed")
    return 0


def checkpoints_to_verify(path: str) -> list[tuple[str, str | None]]:
    """(folder, heading note or None) for a step folder, or for each checkpoint of a root, latest first."""
    is_root = (os.path.isdir(path) and step_of(os.path.basename(os.path.normpath(path))) is None
               and not os.path.isfile(os.path.join(path, MANIFEST))
               and (read_latest(path) is not None or bool(step_folders(path))))
    if not is_root:
        return [(path, None)]
    latest = read_latest(path)
    out = []
    if latest:
        folder = committed_folder(path, latest)  # step_N.old/ when a re-save of step N stopped between its renames
        out.append((folder, " (latest)" if folder == os.path.join(path, latest) else
                    " (latest: moved aside by a re-save that stopped between its renames; the next run in this "
                    "folder puts it back)"))
    out += [(os.path.join(path, n), "") for n in step_folders(path) if n != latest]
    return out
