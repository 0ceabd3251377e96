"""The run folder: paths resolved once, nothing a fresh run did not create overwritten, the checkpoint to resume found.

`prepare_run` runs once per job (in the launcher, or on rank 0 under torchrun, whose answer every
rank adopts), so every rank writes to the same folders and resumes from the same checkpoint.

A live run holds every folder it writes (`--out`, `--ckpt-dir`, the `--metrics` file's folder): the
process that prepared it (the launcher, or rank 0 under torchrun) keeps an exclusive `flock` on
`.zerotrain.lock` in each for its whole life. The kernel releases them when that process ends, however it
ends; a torchrun restart's new rank 0 takes them again. A second run into any of them, fresh or
`--resume auto`, is refused in one line naming the folder and the holder. Taking a folder is also the check
that it can be written, made before any rank starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time

from zerotrain import checkpoint
from zerotrain.config import Config, data_sources
from zerotrain.data.resolve import STDLIB, SYNTHETIC
from zerotrain.errors import ConfigError

from .failures import restart_count

SUMMARY = "summary.json"
LOCK = ".zerotrain.lock"
_held: dict[str, int] = {}  # folder -> the descriptor whose flock holds it, for this process's life


def output_folders(cfg: Config) -> list[tuple[str, str]]:
    """(flag, folder) of every folder the run writes into, each once; paths resolved (resolve_paths)."""
    folders: dict[str, str] = {}
    for flag, folder in (("--out", cfg.logging.out), ("--ckpt-dir", cfg.checkpoint.dir),
                         ("--metrics folder", os.path.dirname(cfg.logging.metrics))):
        folders.setdefault(folder, flag)  # TensorBoard writes into <out>/tensorboard, held with --out
    return [(flag, folder) for folder, flag in folders.items()]


def hold_run_folder(out: str, flag: str = "--out") -> None:
    """Take a folder of this run for the life of this process, or refuse (ConfigError) naming the run that has it.

    Creating the folder and its lock file, and writing who holds it, are the check that the folder can be
    written: a folder that cannot is refused here, naming the flag, before any rank starts.
    """
    if out in _held:  # this process prepared it already (a restarted attempt, or a caller running jobs in turn)
        return
    lock = os.path.join(out, LOCK)
    try:
        os.makedirs(out, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"{flag} {out} cannot be written: {e.strerror} ({e.filename or lock})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(f"{flag} {out} is in use by another run ({holder}): wait for it to end, or choose "
                          f"another {flag}") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                 "command": " ".join(os.path.basename(a) if i == 0 else a
                                                     for i, a in enumerate(sys.argv))}).encode())
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"{flag} {out} cannot be written: {e.strerror} ({lock})") from None
    _held[out] = fd


def hold_output_folders(cfg: Config) -> list[str]:
    """Take every folder the run writes (output_folders), or refuse naming the first that is held or unwritable;
    the folders this call made, parents before children (a refused run leaves none of them: let_go)."""
    made: list[str] = []
    try:
        for flag, folder in output_folders(cfg):
            missing, path = [], folder
            while not os.path.exists(path):
                missing.insert(0, path)
                path = os.path.dirname(path)
            made += missing
            hold_run_folder(folder, flag)
    except ConfigError:
        let_go(made)
        raise
    return made


def let_go(made: list[str]) -> None:
    """A refused run: release the folders in `made` and remove them, as far as they hold nothing but their lock."""
    for folder in reversed(made):
        if folder in _held:
            os.close(_held.pop(folder))
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, LOCK))
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def release_run_folders() -> None:
    """Let go of the folders this process holds (a caller that runs jobs in turn; the kernel does it at exit)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the descriptor releases its flock


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on {info['host']} since {since}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def resolve_paths(cfg: Config) -> Config:
    """Fill the run folder, metrics file and checkpoint folder defaults; make them absolute, and every input the run
    names by a path that exists here (--data's sources, --val-data, --chat-template, --init-from, --resume, the data
    cache): the config a run stores then reads the same from any folder (`zerotrain eval RUN` elsewhere)."""
    c, d = cfg.checkpoint, cfg.data
    d.source = "\n".join(_absolute_source(entry) for entry in d.source.split("\n"))
    d.val_data = _absolute_source(d.val_data)
    d.chat_template, d.cache_dir = _absolute_if_present(d.chat_template), _absolute_if_present(d.cache_dir)
    c.init_from, c.resume = _absolute_if_present(c.init_from), _absolute_if_present(c.resume)
    if not cfg.logging.out:
        cfg.logging.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    cfg.logging.out = os.path.abspath(cfg.logging.out)
    if not cfg.logging.metrics:
        cfg.logging.metrics = os.path.join(cfg.logging.out, "metrics.jsonl")
    cfg.logging.metrics = os.path.abspath(cfg.logging.metrics)
    if not c.dir:
        c.dir = os.path.join(cfg.logging.out, "checkpoints")
    c.dir = os.path.abspath(c.dir)
    return cfg


def _absolute_if_present(path: str) -> str:
    """`path` made absolute where it names a file or folder here (an empty setting or a name such as 'auto' stays)."""
    return os.path.abspath(path) if path and os.path.exists(path) else path


def _absolute_source(entry: str) -> str:
    """One --data entry (a source, or SOURCE:WEIGHT) with its source made absolute where it is a path here; the data
    names zerotrain knows (synthetic, python-stdlib) mean themselves even beside a folder of that name."""
    (source, weight), = data_sources(entry)
    if source in (*SYNTHETIC, STDLIB):
        return entry
    source = _absolute_if_present(source)
    return source if weight is None else f"{source}:{entry.rpartition(':')[2]}"


def say(message: str) -> None:
    print(f"zerotrain: {message}", file=sys.stderr, flush=True)


def prepare_run(cfg: Config) -> Config:
    """Resolve paths, refuse to clobber an earlier run, and check --resume as far as no checkpoint data is read.

    The checks here read `latest` and manifests only: the checkpoint is compatible with the model, not past --steps,
    its manifest well formed. Verifying the files is the ranks' (checkpoint.resume: each file read by one rank as it is
    loaded), so --resume auto and a checkpoint root keep their value here, and the ranks pick the newest checkpoint
    that verifies; this names the one they try first. A restarted attempt that had to prepare again only resolves
    paths: the folder holds its own first attempt, and the loop resumes from the newest checkpoint that verifies.
    """
    named = bool(cfg.logging.out)
    cfg = resolve_paths(cfg)
    c = cfg.checkpoint
    for flag, path in (("--out", cfg.logging.out), ("--ckpt-dir", c.dir)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag} {path} is a file, not a folder")
    if os.path.isdir(cfg.logging.metrics):
        raise ConfigError(f"--metrics {cfg.logging.metrics} is a folder, not a file")
    made = hold_output_folders(cfg)
    _put_back_moved_aside(c.dir)  # before the checkpoint to resume is looked for: it may be the one put back
    if restart_count() > 0:
        _clear_uncommitted_saves(c.dir)
        return cfg
    try:
        if c.resume == "auto":
            if not _name_first_candidate(cfg, c.dir, "--resume auto"):
                c.resume = ""  # nothing committed: the run continues the folder from step 0
        elif c.resume:
            c.resume = _explicit(c.resume)
            if checkpoint.is_checkpoint_root(c.resume):
                _name_first_candidate(cfg, c.resume, f"--resume {c.resume}")
            else:
                _check_resumable(cfg, c.resume)
        else:
            _claim_for_a_fresh_run(cfg)
    except BaseException:
        let_go(made)
        raise
    _clear_uncommitted_saves(c.dir)
    if not named:  # what goes there may not be what the user expects
        say(f"no --out given: this run's folder (summary.json, logs/) is {cfg.logging.out}")
    return cfg


def _clear_uncommitted_saves(root: str) -> None:
    """Remove what saves that never committed left in the checkpoint folder (`.step_N.tmp/`: a crash or a full disk
    mid-save): nothing reads them, and they hold disk space. This run holds the folder, so no live run writes there."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        if name.startswith(".step_") and name.endswith(".tmp") and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            say(f"removed {name} in {root}, left by a save that never committed")


def _put_back_moved_aside(root: str) -> None:
    """Put back a committed step folder that a re-save moved aside (`step_N.old/`) and did not replace (a crash between
    its two renames), so `latest` names a folder that is there; this run holds the folder (checkpoint/commit.py)."""
    for name in checkpoint.put_back_moved_aside(root):
        say(f"put {name} back in {root}: a re-save of that step stopped between moving it aside and replacing it")


def earlier_run(cfg: Config) -> list[str]:
    """What an earlier run left that a fresh run would overwrite: checkpoints, `latest`, metrics."""
    found = [os.path.join(cfg.checkpoint.dir, n) for n in checkpoint.committed_steps(cfg.checkpoint.dir)]
    latest = os.path.join(cfg.checkpoint.dir, checkpoint.LATEST)
    if os.path.isfile(latest):
        found.append(latest)
    for path in (cfg.logging.metrics, os.path.join(cfg.logging.out, SUMMARY)):
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            found.append(path)
    return found


def _claim_for_a_fresh_run(cfg: Config) -> None:
    found = earlier_run(cfg)
    if not found:
        return
    if not cfg.checkpoint.overwrite:
        steps = [os.path.basename(p) for p in found if os.path.basename(p).startswith("step_")]
        what = (f"checkpoints (newest {steps[-1]})" if steps else "") + \
            (" and " if steps and len(found) > len(steps) else "") + \
            (", ".join(os.path.basename(p) for p in found if not os.path.basename(p).startswith("step_"))
             if len(found) > len(steps) else "")
        raise ConfigError(f"{cfg.logging.out} already holds an earlier run's {what}: continue it with --resume auto, "
                          "or replace it with --overwrite")
    for path in found:  # the user asked for it by name
        try:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except OSError as e:
            raise ConfigError(f"--overwrite: cannot remove {e.filename or path} of the earlier run ({e.strerror})") \
                from None
    say(f"--overwrite: removed {len(found)} item(s) of the earlier run in {cfg.logging.out}")


def _name_first_candidate(cfg: Config, root: str, label: str) -> bool:
    """Say which checkpoint under `root` the ranks try first, after its cheap checks; False when there is none.

    The first is the newest whose manifest reads (one that does not fails the ranks' verification too, and they say
    so); when none reads, the ranks say why each fails.
    """
    names, skipped = checkpoint.resume_candidates(root)
    if not names and not skipped:
        say(f"{label}: no checkpoint in {root}; starting fresh")
        return False
    for name in names:
        path = os.path.join(root, name)
        try:
            manifest = checkpoint.read_manifest(path)
        except checkpoint.CheckpointError:
            continue
        _check_resumable(cfg, path, manifest)
        say(f"{label}: {name} is the newest checkpoint; the ranks verify it as they load it")
        break
    return True


def _explicit(spec: str) -> str:
    if not os.path.isdir(spec):
        raise ConfigError(f"--resume {spec}: no such checkpoint folder")
    return os.path.abspath(spec)


def _check_resumable(cfg: Config, path: str, manifest: dict | None = None) -> None:
    """Refuse (ConfigError) a checkpoint whose manifest does not read, holds another model or is past --steps; its
    files are the ranks' to verify."""
    if manifest is None:
        try:
            manifest = checkpoint.read_manifest(path)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"--resume {path}: {e}") from None
    problem = checkpoint.incompatibility(manifest, vars(cfg.model))
    if problem:
        raise ConfigError(f"--resume {path}: incompatible model: {problem}")
    if manifest["step"] > cfg.loop.steps:
        raise ConfigError(f"--resume {path}: checkpoint is at step {manifest['step']}, past --steps {cfg.loop.steps}")
