"""Writing checkpoints: each rank writes and hashes its own share, synchronously or behind training.

A rank's share is its shard: its chunks of the flat layout's masters (the parameters, stored once: no rank
gathers or writes the whole model) and of the optimizer state; rank 0 also copies the tokenizer's files.
Each file's sha256 is taken from the bytes as they are written (stream.py), never by reading the file back:
every reader (a load, a reshard, `zerotrain verify`) checks what it reads against it.
`CheckpointWriter.save` writes at once (all ranks call it together; two small collectives share
each rank's outcome and rank 0's commit verdict, so no rank waits on one that failed). The writer's
collectives run on `comm.io`, whose wait is --io-timeout.
`start` saves asynchronously, in two phases that run behind training. Writing: the state is copied into
reusable CPU staging buffers and a background thread writes, hashes and fsyncs the files, then this rank's
sidecar. Committing, once every rank has written: rank 0's commit (the manifest, the rename into place,
`latest`, retention) runs in a thread of its own. The threads issue no collectives: the training loop learns
that every rank's part of the current phase is done through its own per-step all-reduce (`poll()` as flags:
done, failed) and then calls `advance()` on every rank; `finish()` waits for both phases with two collectives.
No file I/O of an async save runs on the training thread, so slow storage delays the save, never a step.
`start_stop_save` saves at once on a stop signal, while the training thread is still inside its step (a step can
outlast a launcher's grace period: torchrun kills its ranks 30 s after SIGTERM). Its thread writes the state as of
the last completed step, which nothing changes until the step's update, and agrees through the folder, not a
collective: rank 0 waits for every rank's sidecar, then commits. `finish_stop_save` waits for it on every rank.

On the CPU the staging copy itself runs in the background thread, behind the next forward and
backward, which leave the saved state untouched: an optimizer step pre-hook makes the next
update wait for the copy. On CUDA the copies are queued at `start` on a stream of their own (into pinned memory),
beside the next forward and backward; the same pre-hook makes the next update's stream wait for them (a stream wait,
not the host's), and the thread waits for them before writing.

With tensor parallelism each rank writes its own shard of its local layout; the manifest's TP slices say
how the TP ranks' parameters make the full model (checkpoint/consolidate.py). Checkpoints of format version 1
(written before) also held `model.safetensors`, the full model rank 0 gathered and wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerotrain.errors import InvariantError
from zerotrain.parallel import Comm, ZeroEngine, stream_api

from .commit import commit, tmp_name, wait_for_sidecars, write_sidecar
from .format import FORMAT, MANIFEST_SCHEMA, MESH_KEYS, VERSION, CheckpointError, shard_name, step_name
from .homes import EXPERT_PREFIX, EXPERT_TP_SLICES, shard_parts
from .stream import FileRecord, count_written, storage_delay, write_safetensors


@dataclass
class _Pending:
    """The one asynchronous save in flight on this rank."""

    step: int
    base: dict  # the manifest without its file list
    staged: threading.Event = field(default_factory=threading.Event)  # the state is copied out
    thread: threading.Thread | None = None  # writing this rank's files
    error: BaseException | None = None
    committing: bool = False  # every rank has written: rank 0 commits
    commit_thread: threading.Thread | None = None  # rank 0's
    commit_error: BaseException | None = None


@dataclass
class _StopSave:
    """A stop's save on this rank, started at once in its own thread."""

    step: int
    base: dict
    thread: threading.Thread | None = None
    error: BaseException | None = None


# How long rank 0's stop save waits for the other ranks' files when the writer's comm has no --io-timeout of its own.
STOP_SAVE_TIMEOUT_S = 1800.0


class CheckpointWriter:
    """Saves the checkpoints of one run under `root`; all ranks construct it together (one collective).

    `keep`: committed checkpoints to keep (0: all). `async_save`: the run's choice, for the caller
    (`save` and `start` both work either way). `halfway_hook(step)`: called after about half of this rank's
    shard bytes are written (fault injection); an exception it raises fails the save. `staging_hook(step)`:
    called in an async save's thread before it copies the state (fault injection: a late copy). `commit_hook(step)`:
    called by rank 0's commit between moving an existing folder of the step aside and renaming the new one into
    place (fault injection: a crash between the two renames of a re-save).
    `copied_files`: {name in the checkpoint: source path} that rank 0 copies into every checkpoint
    (the tokenizer), listed in the manifest with size and sha256 like every file.
    """

    def __init__(self, root: str, comm: Comm, *, keep: int = 0, async_save: bool = False,
                 halfway_hook: Callable[[int], None] | None = None, copied_files: dict[str, str] | None = None,
                 staging_hook: Callable[[int], None] | None = None, commit_hook: Callable[[int], None] | None = None):
        self.root, self.comm, self.keep, self.async_save = root, comm, keep, async_save
        self.copied_files = copied_files or {}
        self.halfway_hook, self.staging_hook, self.commit_hook = halfway_hook, staging_hook, commit_hook
        # One id per writer, agreed by all ranks: a sidecar left by another writer (a crashed run,
        # a stale copy on one node's own disk) is never taken for one of this writer's.
        self.session = comm.io.all_gather_json(uuid.uuid4().hex, "checkpoint_session")[0]
        self._staging: _Staging | None = None
        self._pending: _Pending | None = None
        self._guarded: set[int] = set()  # engines whose updates wait for the staging copy
        self._stop: _StopSave | None = None  # a stop's save, started at once

    # ------------------------------------------------------------------ synchronous
    def save(self, step: int, engine: ZeroEngine, extra: dict | None = None):
        """Write and commit step `step` now; (folder, {file: tensors this rank wrote}, manifest) on every rank.

        The tensors are views of the engine's state where possible: valid until the next update.
        """
        self._refuse_in_flight("save")
        base = self._describe(step, engine, extra or {})
        folder = os.path.join(self.root, tmp_name(step))
        local, records, files = None, [], {}
        try:
            files = _live_files(engine, self.comm.rank, base["world_size"]) if writes_shard(engine) else {}
            records = self._write(folder, files, step, base["world_size"])
            if writes_shard(engine):
                write_sidecar(folder, self.comm.rank, self.session, step, records)
        except Exception as e:  # told to every rank below, so none is left waiting in a collective
            local = e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}")
        reports = self.comm.io.all_gather_json(
            {"error": str(local) if local else None, "files": [r.to_dict() for r in records]}, "checkpoint_files")
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            if self.comm.rank == 0:  # every rank is past its writes: what this save left goes, not to fill a disk
                shutil.rmtree(folder, ignore_errors=True)
            raise CheckpointError(f"checkpoint step {step} not saved: rank {failed[0][0]}: {failed[0][1]}") from local
        verdict = None
        if self.comm.rank == 0:
            try:
                commit(self.root, step, base, base["world_size"], self.session, self.keep, self.commit_hook)
            except (CheckpointError, OSError) as e:
                verdict = str(e)
        verdict = self.comm.io.all_gather_json(verdict, "checkpoint_commit")[0]
        if verdict:
            raise CheckpointError(verdict)
        listed = sorted((f for rep in reports for f in rep["files"]), key=lambda f: f["name"])
        return os.path.join(self.root, step_name(step)), files, {**base, "files": listed}

    # ------------------------------------------------------------------ asynchronous
    def start(self, step: int, engine: ZeroEngine, extra: dict | None = None) -> None:
        """Begin saving step `step` behind training; returns once the state's copy is under way (no collective)."""
        self._refuse_in_flight("start")
        base = self._describe(step, engine, extra or {})
        engine.wait_params()  # an all-gather in flight still writes the parameters being copied
        if self._staging is None or not self._staging.fits(engine):
            self._staging = _Staging(engine, self.comm.rank, base["world_size"], writes=writes_shard(engine))
        staging, step_count = self._staging, engine.step_count
        if id(engine) not in self._guarded:  # every update of the engine's state (with --ep: both engines')
            engine.register_update_pre_hook(lambda: self._wait_staged())  # looked up at each update, not bound now
            self._guarded.add(id(engine))
        pending = _Pending(step, base)
        if not staging.copy_in_background:
            staging.copy_from(engine, step_count)  # queued on the staging stream: the update waits for it
            pending.staged.set()
        pending.thread = threading.Thread(target=self._background, args=(pending, engine, staging, step_count),
                                          name=f"zerotrain-save-{step}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def _background(self, pending: _Pending, engine: ZeroEngine, staging: _Staging, step_count: int) -> None:
        files: dict = {}
        try:
            try:
                if self.staging_hook is not None:
                    self.staging_hook(pending.step)
                if staging.copy_in_background:
                    staging.copy_from(engine, step_count)
                else:
                    staging.wait_copied()
            finally:
                pending.staged.set()
            files = staging.files()
            folder = os.path.join(self.root, tmp_name(pending.step))
            records = self._write(folder, files, pending.step, pending.base["world_size"])
            if staging.writes:
                write_sidecar(folder, self.comm.rank, self.session, pending.step, records)
        except BaseException as e:  # surfaced by poll() on the training thread
            pending.error = e
            for name in files:  # this rank's part of a save that can no longer commit
                _discard(os.path.join(self.root, tmp_name(pending.step), name))

    def _wait_staged(self) -> None:
        pending = self._pending
        if pending is not None:
            pending.staged.wait()
            if self._staging is not None:
                self._staging.order_update()

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight on this rank, or None."""
        return self._pending.step if self._pending else None

    def poll(self) -> tuple[bool, BaseException | None]:
        """(done, error) of this rank's part of the save in flight's current phase, without raising (done when none
        is in flight). Writing: this rank's files are written. Committing: rank 0's commit is done (the other ranks
        have no part in it).

        The loop shares both in its step's all-reduce, so a writer's failure reaches every rank in that step.
        """
        pending = self._pending
        if pending is None:
            return True, None
        if pending.committing:
            thread = pending.commit_thread
            if thread is None:
                return True, None
            if thread.is_alive():
                return False, None
            return pending.commit_error is None, pending.commit_error
        if pending.thread.is_alive():
            return False, None
        return pending.error is None, (_as_checkpoint_error(pending) if pending.error is not None else None)

    def local_done(self) -> bool:
        """This rank's part of the save in flight's current phase is done (True when none is); re-raises its
        failure."""
        done, error = self.poll()
        if error is not None:
            self._pending = None
            raise error
        return done

    def advance(self) -> str | None:
        """Every rank, once the step's all-reduce says every rank's part of the current phase is done.

        After the writes, rank 0 starts the commit in its own thread (None is returned); after the commit, the save
        is over: its folder is returned on every rank.
        """
        pending = self._pending
        if pending is None:
            return None
        if not self.local_done():
            raise RuntimeError(f"advance() while this rank's part of saving step {pending.step} is not done: "
                               "advance only after every rank's poll() says done")
        if pending.committing:
            self._pending = None
            return os.path.join(self.root, step_name(pending.step))
        pending.committing = True
        if self.comm.rank == 0:
            pending.commit_thread = threading.Thread(target=self._commit_in_background, args=(pending,),
                                                     name=f"zerotrain-commit-{pending.step}", daemon=True)
            pending.commit_thread.start()
        return None

    def _commit_in_background(self, pending: _Pending) -> None:
        try:
            commit(self.root, pending.step, pending.base, pending.base["world_size"], self.session, self.keep,
                   self.commit_hook)
        except BaseException as e:  # surfaced by poll() on the training thread
            pending.commit_error = e if isinstance(e, CheckpointError) else \
                CheckpointError(f"committing step {pending.step} failed: {type(e).__name__}: {e}")

    def _commit(self, pending: _Pending) -> None:
        """Rank 0, on the training thread: commit the written save, or wait for the commit thread's."""
        if pending.commit_thread is not None:
            pending.commit_thread.join()
            if pending.commit_error is not None:
                raise pending.commit_error
        else:
            commit(self.root, pending.step, pending.base, pending.base["world_size"], self.session, self.keep,
                   self.commit_hook)

    def commit_pending(self) -> str | None:
        """Every rank, once all agreed their writes are done: rank 0 commits now, on this thread (or waits for its
        commit thread); the folder (None if no save was in flight)."""
        pending = self._pending
        if pending is None:
            return None
        if not pending.committing and not self.local_done():
            raise RuntimeError(f"commit_pending() while this rank is still writing step {pending.step}: "
                               "commit only after every rank's local_done() is True")
        self._pending = None
        if self.comm.rank == 0:
            self._commit(pending)
        return os.path.join(self.root, step_name(pending.step))

    def finish(self) -> str | None:
        """All ranks: wait for the save in flight, agree with one collective, commit, and agree on rank 0's commit
        (a second collective: on return the checkpoint is in place on every rank, as after `save`, so a rollback or
        a reader right after finds it); the folder, or None if no save was in flight."""
        pending = self._pending
        if pending is not None:
            pending.thread.join()
        error = _as_checkpoint_error(pending) if pending is not None and pending.error is not None else None
        states = self.comm.io.all_gather_json(
            {"step": pending.step if pending else None, "error": str(error) if error else None}, "checkpoint_finish")
        failed = [(r, s["error"]) for r, s in enumerate(states) if s["error"]]
        if failed:
            self._pending = None
            raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}") from error
        steps = {s["step"] for s in states}
        if steps == {None}:
            return None
        if len(steps) > 1:
            raise RuntimeError(f"ranks disagree on the checkpoint save in flight: steps {sorted(steps, key=str)}")
        verdict = None
        try:
            path = self.commit_pending()
        except (CheckpointError, OSError) as e:  # rank 0's commit: told to every rank below
            verdict, path = str(e), None
        verdict = self.comm.io.all_gather_json(verdict, "checkpoint_commit")[0]
        if verdict:
            raise CheckpointError(verdict)
        return path

    # ------------------------------------------------------------------ a stop's save, at once
    def start_stop_save(self, step: int, engine: ZeroEngine, extra: dict, after=None) -> None:
        """Begin saving `step` (the last completed one) in a thread, with no collective, while the training thread may
        still be inside the next step: its micro-batches change gradients only, and its update waits for
        `finish_stop_save` (every rank's stop decision comes first). `after`: on CUDA, an event recorded on the
        training stream once the state of `step` was queued; the copy to the host waits for it on a side stream."""
        pending = self._pending
        self._stop = _StopSave(step, self._describe(step, engine, extra))
        self._stop.thread = threading.Thread(target=self._stop_save, args=(self._stop, engine, pending, after),
                                             name=f"zerotrain-stop-save-{step}", daemon=True)
        self._stop.thread.start()

    def _stop_save(self, stop: _StopSave, engine: ZeroEngine, pending: _Pending | None, after) -> None:
        folder = os.path.join(self.root, tmp_name(stop.step))
        try:
            if pending is not None:  # an async save's writes (and rank 0's commit) end first: it is superseded
                pending.thread.join()
                if pending.commit_thread is not None:
                    pending.commit_thread.join()
            writers = stop.base["world_size"]  # with --dp-replicate: replica group 0's ranks (writes_shard)
            files = self._stop_files(engine, pending, after, writers) if writes_shard(engine) else {}
            records = self._write(folder, files, stop.step, writers)
            if writes_shard(engine):
                write_sidecar(folder, self.comm.rank, self.session, stop.step, records)
            if self.comm.rank == 0:
                wait_for_sidecars(folder, writers, self.session, stop.step,
                                  self.comm.io.timeout_s or STOP_SAVE_TIMEOUT_S)
                commit(self.root, stop.step, stop.base, writers, self.session, self.keep, self.commit_hook)
        except BaseException as e:  # told to every rank by finish_stop_save
            stop.error = e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}")

    def _stop_files(self, engine: ZeroEngine, pending: _Pending | None, after, writers: int) -> dict:
        """This rank's shard as of the last completed step. On the CPU: the engine's state where it lies, as a
        synchronous save writes it (the one write an all-gather in flight may make to the owned range is of the same
        bytes). On CUDA: staged to the host as an async save stages (_Staging), on a side stream after `after`."""
        if engine.device.type != "cuda":
            return _shard_files(engine, self.comm.rank, writers)
        if self._staging is None or not self._staging.fits(engine):
            self._staging = _Staging(engine, self.comm.rank, writers)
        side = torch.cuda.Stream(engine.device)
        with torch.cuda.stream(side):
            if after is not None:
                side.wait_event(after)
            self._staging.copy_from(engine, engine.step_count)
        self._staging.wait_copied()
        return self._staging.files()

    def finish_stop_save(self) -> str:
        """Every rank, once all agreed to stop: one collective checks that the ranks save the same step, then wait for
        this rank's part of the stop's save (rank 0: its commit), and another tells every rank whether it is
        committed; its folder. A superseded async save is dropped."""
        stop, self._stop, self._pending = self._stop, None, None
        # Every rank saves the step it had armed when the stop came, and a rank's flag is set in the next step's
        # all-reduce once its save began, so the ranks agree by construction: said here, not assumed, before any
        # rank waits for a save the others are not writing (rank 0 would wait --io-timeout for their files)
        steps = self.comm.io.all_gather_json(stop.step, "checkpoint_stop_step")
        if len(set(steps)) > 1:
            offered = ", ".join(f"rank {r}: step {step}" for r, step in enumerate(steps))
            raise CheckpointError(f"a stop's save: the ranks saved different steps ({offered}); none is committed")
        stop.thread.join()
        errors = self.comm.io.all_gather_json(str(stop.error) if stop.error else None, "checkpoint_stop_save")
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            raise CheckpointError(f"checkpoint step {stop.step} not saved: rank {failed[0][0]}: {failed[0][1]}") \
                from stop.error
        return os.path.join(self.root, step_name(stop.step))

    @property
    def stop_saving(self) -> bool:
        """A stop's save was started on this rank."""
        return self._stop is not None

    # ------------------------------------------------------------------ shared
    def _refuse_in_flight(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{what}() while the save of step {self._pending.step} is in flight: "
                               "commit_pending() or finish() it first")

    def _describe(self, step: int, engine: ZeroEngine, extra: dict) -> dict:
        """The manifest without its file list; the caller's fields beside the writer's own."""
        clash = sorted(set(extra) & {*MANIFEST_SCHEMA, *MESH_KEYS})
        if clash:
            raise ValueError(f"manifest field(s) {clash} are the writer's own; name extra fields otherwise")
        mesh, parts = engine.mesh.describe(), dict(shard_parts(engine))
        if mesh["tp"] * mesh["dp"] * mesh.get("dp_replicate", 1) != self.comm.world_size:
            raise ValueError(f"the writer's comm has {self.comm.world_size} ranks, the engine's mesh TP {mesh['tp']} "
                             f"x DP {mesh['dp']} x {mesh.get('dp_replicate', 1)} replica group(s): give the writer the "
                             "world communicator")
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            # the ranks that write a shard: with --dp-replicate R, replica group 0's (its shard files are named by
            # world rank, which in group 0 is the rank among them); the other groups hold the same shards
            "world_size": mesh["tp"] * mesh["dp"],
            "mesh": mesh,
            "param_count": engine.param_count,  # the full model's
            "precision": engine.precision,
            "torch_version": torch.__version__,
            "layout": engine.layout.to_dict(),  # this rank's local layout, the same on every TP rank
            # expert parallelism: the expert engine's layout over its replica group (EP rank 0's names), the experts
            # of each MoE layer an EP rank holds (EP rank e's names: EP rank 0's, the index shifted by e x those) and,
            # under TP, their TP slices (EP rank 0's names; every EP rank's experts are split alike)
            **({"expert_layout": parts[EXPERT_PREFIX].layout.to_dict(), "experts_per_rank": engine.experts_per_rank,
                EXPERT_TP_SLICES: {name: s.to_dict() for name, s in parts[EXPERT_PREFIX].tp_slices.items()}}
               if EXPERT_PREFIX in parts else {}),
            "tp_slices": {name: s.to_dict() for name, s in engine.tp_slices.items()},
            **extra,
        }

    def _write(self, folder: str, files: dict[str, dict[str, torch.Tensor]], step: int,
               writers: int) -> list[FileRecord]:
        """Write this rank's files into `folder`, each fsynced; failures name the file. `writers`: the ranks that
        write a shard (the manifest's world size)."""
        shard, hook = shard_name(self.comm.rank, writers), self.halfway_hook
        records = []
        for name, tensors in files.items():
            path = os.path.join(folder, name)
            halfway = (lambda: hook(step)) if hook is not None and name == shard else None
            try:
                os.makedirs(folder, exist_ok=True)
                records.append(write_safetensors(path, tensors, halfway=halfway))
            except Exception as e:
                _discard(path)  # a partial file holds the space a full disk lacks
                raise CheckpointError(f"writing {path} failed: {e}") from e
        for name, source in self.copied_files.items() if self.comm.rank == 0 else ():
            try:
                records.append(copy_file(source, os.path.join(folder, name)))
            except OSError as e:
                raise CheckpointError(f"copying {source} into {folder} failed: {e}") from e
        return records


def _discard(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def save_checkpoint(root: str, step: int, engine: ZeroEngine, comm: Comm, config: dict, keep: int = 0):
    """Write step `step` under `root` synchronously; (folder, {file: tensors this rank wrote}, manifest)."""
    return CheckpointWriter(root, comm, keep=keep).save(step, engine, {"config": config})


def copy_file(source: str, path: str) -> FileRecord:
    """Copy `source` to `path`, fsynced, its bytes counted as written; its record is of the bytes written."""
    with open(source, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    count_written(len(data))
    storage_delay(len(data))
    return FileRecord(os.path.basename(path), len(data), hashlib.sha256(data).hexdigest())


def _as_checkpoint_error(pending: _Pending) -> BaseException:
    e = pending.error
    if isinstance(e, (CheckpointError, InvariantError)):
        return e
    wrapped = CheckpointError(f"saving step {pending.step} failed: {type(e).__name__}: {e}")
    wrapped.__cause__ = e
    return wrapped


def writes_shard(engine: ZeroEngine) -> bool:
    """Whether this rank writes its shard: hybrid sharding (--dp-replicate) holds every shard once in each replica
    group, and replica group 0 writes it, once (the others' copies are bitwise the same: invariant (b))."""
    return engine.mesh.dp_replicate_rank == 0


def _live_files(engine: ZeroEngine, rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's file for a synchronous save, its shard, from the engine's state (views where it is already fp32 on
    the CPU). `rank` is the world rank: shard files are named by it, whatever the mesh. A LoRA run's shard holds its
    adapters; its frozen base is the manifest's init_from record. With --ep the file holds the expert engine's shard
    beside the dense one's, under expert_ keys (homes.shard_parts).
    """
    engine.wait_params()
    return _shard_files(engine, rank, world_size)


def _shard_files(engine: ZeroEngine, rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """_live_files without waiting for an all-gather in flight (a stop's save, off the training thread)."""
    state = {prefix + k: v for prefix, part in shard_parts(engine) for k, v in _part_state(part).items()}
    return {shard_name(rank, world_size): {k: v if isinstance(v, list) else v.detach().cpu().contiguous()
                                           for k, v in state.items()}}


def _part_state(engine: ZeroEngine) -> dict:
    """One ZeRO engine's shard state, the keys _Staging.files writes.

    In fp32 on the CPU the masters are written where they lie (engine.master_views: at stages 1 and 2 this rank's
    pieces of the parameter buffer; the writer takes a tensor's parts), not concatenated first. The copy the
    concatenation made was 22% of a sync save's time in its profile (bench ckpt --quick, one rank: 26 MB into fresh
    pages at every save).
    """
    adamw = engine.adamw
    if adamw.master is None and engine.device.type == "cpu":
        return {"master": engine.master_views(), "exp_avg": adamw.exp_avg, "exp_avg_sq": adamw.exp_avg_sq,
                "step": torch.tensor([engine.step_count], dtype=torch.int64)}
    return engine.shard_state_dict()


class _Staging:
    """Reusable CPU copies of one rank's checkpoint state: allocated at the first async save, reused after.

    On CUDA the host buffers are pinned and the device-to-host copies run on a stream of their own (`api`,
    comm_stream.stream_api: torch.cuda, or a recorder in the tests): it waits for an event the training stream
    records at the save's start (the state as of the last update), the next forward and backward run beside the
    copies, and the next update's stream waits for their `copied` event (`order_update`) before it writes the state;
    the writer thread waits for that event on the host. On the CPU (no stream) the writer thread copies.
    """

    def __init__(self, engine: ZeroEngine, rank: int, world_size: int, writes: bool = True, api=None):
        L = engine.layout
        self.layout, self.rank, self.world_size = L, rank, world_size  # world rank and size: the shard's file name
        self.writes = writes  # a replica group's but the first's rank (writes_shard) copies and writes nothing
        self.device = engine.device
        self.api = api if api is not None else stream_api(self.device)
        self.stream = self.api.Stream() if self.api is not None else None
        self.copy_in_background = self.stream is None
        pin = self.device.type == "cuda"
        self.master, self.exp_avg, self.exp_avg_sq = (torch.empty(L.shard_numel if writes else 0, pin_memory=pin)
                                                      for _ in range(3))
        self.step = torch.zeros(1, dtype=torch.int64)
        self.experts: dict[str, torch.Tensor] = {}  # with --ep: the expert engine's shard, under expert_ keys
        self._copied = None

    def fits(self, engine: ZeroEngine) -> bool:
        return engine.layout is self.layout and engine.device == self.device

    def copy_from(self, engine: ZeroEngine, step_count: int) -> None:
        if not self.writes:
            return
        on_stream = contextlib.nullcontext()
        if self.stream is not None:  # after what the training stream has queued: the state as of the last update
            ready = self.api.Event()
            ready.record(self.api.current_stream())
            self.stream.wait_event(ready)
            on_stream = self.api.stream(self.stream)
        non_blocking = not self.copy_in_background  # CUDA: queued, not waited for
        with on_stream, torch.no_grad():
            (_, flat), *others = shard_parts(engine)  # the flat layout's shard (with --ep the dense engine's), then
            at = 0
            for part in flat.master_views():  # the masters where they lie, in shard order
                self.master[at : at + part.numel()].copy_(part, non_blocking=non_blocking)
                at += part.numel()
            self.exp_avg.copy_(flat.adamw.exp_avg, non_blocking=non_blocking)
            self.exp_avg_sq.copy_(flat.adamw.exp_avg_sq, non_blocking=non_blocking)
            # expert parallelism: the expert engine's shard, copied whole (it is a fraction of the experts)
            self.experts = {prefix + k: v.detach().cpu().clone() for prefix, part in others
                            for k, v in part.shard_state_dict().items()}
            if self.stream is not None:
                self._copied = self.api.Event()
                self._copied.record(self.stream)
        self.step.fill_(step_count)

    def order_update(self) -> None:
        """The training stream waits for the copies before the next update writes the state they read (a stream
        wait: the host goes on)."""
        if self._copied is not None:
            self.api.current_stream().wait_event(self._copied)

    def wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def files(self) -> dict[str, dict[str, torch.Tensor]]:
        if not self.writes:
            return {}
        shard = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step,
                 **self.experts}
        return {shard_name(self.rank, self.world_size): shard}
