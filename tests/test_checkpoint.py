"""Checkpoints: the streamed file format, manifest, atomic commit, async writer, retention, crashes, verified load."""

import hashlib
import importlib
import json
import multiprocessing
import os
import struct
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_config
from safetensors.torch import load_file, save_file
from test_engine import run_steps

from zerotrain import checkpoint
from zerotrain.checkpoint import stream
from zerotrain.checkpoint.stream import read_safetensors, write_safetensors
from zerotrain.parallel import Comm
from zerotrain.runtime import rank_start
from zerotrain.training.loop import build_engine

commit_module = importlib.import_module("zerotrain.checkpoint.commit")
from zerotrain.checkpoint import save as save_module  # noqa: E402

SHARD = "optim-rank00000-of-00001.safetensors"


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def folder_hashes(path):
    return {n: sha(os.path.join(path, n)) for n in sorted(os.listdir(path))}


def trained(tmp_path, one_rank, steps=2):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    run_steps(engine, cfg, steps)
    return cfg, engine


# ---------------------------------------------------------------- the file format
def test_streamed_files_are_the_bytes_safetensors_writes_and_a_malformed_header_is_refused(tmp_path):
    tensors = {"master": torch.randn(1000), "step": torch.tensor([7]), "b": torch.randn(3, 5).bfloat16(),
               "exp_avg": torch.rand(1000), "empty": torch.zeros(0), "flag": torch.tensor([True, False])}
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    halfway = []
    record = write_safetensors(ours, tensors, halfway=lambda: halfway.append(os.path.getsize(ours)))
    save_file(tensors, theirs)
    assert open(ours, "rb").read() == open(theirs, "rb").read()  # byte for byte the library's format
    assert record.sha256 == sha(ours) and record.bytes == os.path.getsize(ours)  # hashed while writing
    assert len(halfway) == 1  # the hook ran once, midway
    back = load_file(ours)
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    mine, again = read_safetensors(theirs)
    assert again == record.__class__("theirs.safetensors", record.bytes, record.sha256)
    assert all(torch.equal(mine[k], t) for k, t in tensors.items())
    # planted: a header whose byte ranges overlap is refused, not read as garbage
    data = bytearray(open(ours, "rb").read())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["exp_avg"]["data_offsets"] = header["master"]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    open(ours, "wb").write(bytes(data[:8]) + text + bytes(data[8 + n :]))
    with pytest.raises(checkpoint.CheckpointError, match="not a valid safetensors file.*gap or overlap"):
        read_safetensors(ours)


# ---------------------------------------------------------------- manifest and (d)
def test_manifest_describes_the_checkpoint_and_keeps_the_callers_fields(tmp_path, one_rank):
    cfg, engine = trained(tmp_path, one_rank)
    path, written, manifest = checkpoint.save_checkpoint(str(tmp_path / "ck"), 2, engine, one_rank, cfg.to_dict())
    assert os.path.basename(path) == "step_00000002"
    on_disk = json.load(open(os.path.join(path, "manifest.json")))
    assert on_disk == manifest
    assert on_disk["format"] == "zerotrain-checkpoint" and on_disk["step"] == 2 and on_disk["world_size"] == 1
    assert on_disk["param_count"] == 28_032 and on_disk["config"]["model"]["n_embd"] == 32
    names = {f["name"] for f in on_disk["files"]}
    assert names == {SHARD} == set(os.listdir(path)) - {"manifest.json"}  # no sidecars left, no model file
    assert all(f["sha256"] == sha(os.path.join(path, f["name"])) for f in on_disk["files"])
    assert on_disk["layout"]["owned_ranges"][0] == [[b["start"], b["end"]] for b in on_disk["layout"]["buckets"]]
    model = checkpoint.checkpoint_model(path)  # from the shard's masters, without torch.distributed
    assert torch.equal(model["transformer.wte.weight"], engine.model.transformer.wte.weight.detach())
    assert open(tmp_path / "ck" / "latest").read().strip() == "step_00000002"

    writer = checkpoint.CheckpointWriter(str(tmp_path / "ck2"), one_rank)
    path, _, _ = writer.save(2, engine, {"data_skips": [[3, 5]], "threads_per_rank": 1, "config": cfg.to_dict()})
    loaded = checkpoint.load_checkpoint(path, build_engine(cfg, one_rank), one_rank)
    assert loaded["data_skips"] == [[3, 5]] and loaded["threads_per_rank"] == 1 and loaded["step"] == 2
    with pytest.raises(ValueError, match=r"\['step'\] are the writer's own"):
        writer.save(3, engine, {"step": 9})


def lossy_disk(real_write):
    """Planted fault: a disk that keeps the last bit of every shard other than it was given."""

    def write(path, tensors, **kwargs):
        record = real_write(path, tensors, **kwargs)
        if path.endswith(SHARD):
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last ^ 1]))
        return record

    return write


def test_a_save_never_reads_its_files_back_and_a_lossy_disk_is_caught_by_the_first_reader(tmp_path, one_rank,
                                                                                           monkeypatch):
    """Invariant (d): a file's sha256 is taken from the bytes as they are written, so a disk that keeps other bytes
    is caught by whoever reads the file first (verify, a load), sync or async, and a save reads nothing back.
    Planted: a writer that hashes the file as it lies on disk records the disk's bytes, and the loss goes unseen."""
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    root = str(tmp_path / "ck")
    read_before = stream.bytes_counted()["checkpoint_bytes_read"]
    checkpoint.save_checkpoint(root, 1, engine, one_rank, cfg.to_dict())
    assert stream.bytes_counted()["checkpoint_bytes_read"] == read_before  # nothing read back
    monkeypatch.setattr(save_module, "write_safetensors", lossy_disk(save_module.write_safetensors))
    lossy = [checkpoint.save_checkpoint(root, 2, engine, one_rank, cfg.to_dict())[0]]
    writer = checkpoint.CheckpointWriter(root, one_rank, async_save=True)
    writer.start(3, engine, {"config": cfg.to_dict()})
    lossy.append(writer.finish())
    for path in lossy:
        bad = checkpoint.verify.first_failure(checkpoint.verify_checkpoint(path))
        assert (bad.name, bad.file) == ("sha256", SHARD), bad
        with pytest.raises(checkpoint.CheckpointError, match=rf"{SHARD}: .*sha256"):
            checkpoint.load_checkpoint(path, build_engine(cfg, one_rank), one_rank)

    def hashed_on_disk(path, tensors, **kwargs):  # planted: the record describes the disk, not what was written
        record = lossy_disk(stream.write_safetensors)(path, tensors, **kwargs)
        return stream.FileRecord(record.name, *stream.sha256_file(path))

    monkeypatch.setattr(save_module, "write_safetensors", hashed_on_disk)
    unseen = checkpoint.save_checkpoint(root, 4, engine, one_rank, cfg.to_dict())[0]
    assert all(c.ok for c in checkpoint.verify_checkpoint(unseen))


def test_load_restores_the_exact_state_and_refuses_what_fails_its_checks(tmp_path, one_rank):
    """A manifest that fails its checks is refused before the engine is touched. A corrupt shard is refused once it is
    read: it was read into the engine's own state (no copy of the file beside it), so the next load a resume tries
    overwrites every value, exactly."""
    cfg, engine = trained(tmp_path, one_rank)
    path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "ck"), 2, engine, one_rank, cfg.to_dict())
    fresh = build_engine(cfg, one_rank)
    assert not torch.equal(fresh.held_params, engine.held_params)
    assert checkpoint.load_checkpoint(path, fresh, one_rank)["step"] == 2
    assert torch.equal(fresh.held_params, engine.held_params)
    assert torch.equal(fresh.adamw.exp_avg, engine.adamw.exp_avg)
    assert torch.equal(fresh.adamw.exp_avg_sq, engine.adamw.exp_avg_sq)
    assert fresh.step_count == engine.step_count == 2

    shard = os.path.join(path, SHARD)
    good = open(shard, "rb").read()
    data = bytearray(good)
    data[-100] ^= 0x01  # one bit of a master value (master's bytes come last: F32 tensors by name)
    open(shard, "wb").write(bytes(data))
    assert not torch.equal(load_file(shard)["master"], engine.adamw.master_shard())  # planted: an unchecked load takes it
    failed = build_engine(cfg, one_rank)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{SHARD}: sha256 .* \(corrupt\)"):
        checkpoint.load_checkpoint(path, failed, one_rank)
    assert failed.step_count == 0  # not restored: the engine is not taken for the checkpoint's
    open(shard, "wb").write(good)
    assert checkpoint.load_checkpoint(path, failed, one_rank)["step"] == 2  # what resume's next candidate does
    assert torch.equal(failed.held_params, engine.held_params) and failed.step_count == 2
    assert torch.equal(failed.adamw.exp_avg, engine.adamw.exp_avg)
    assert torch.equal(failed.adamw.exp_avg_sq, engine.adamw.exp_avg_sq)

    untouched = build_engine(cfg, one_rank)
    before = untouched.held_params.clone()

    manifest_file = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_file))
    manifest["layout"]["owned_ranges"][0][1][0] -= 10  # bucket 1's range reaches into bucket 0's
    json.dump(manifest, open(manifest_file, "w"))
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json: owned ranges overlap"):
        checkpoint.load_checkpoint(path, untouched, one_rank)
    assert torch.equal(untouched.held_params, before)


def test_incompatible_or_foreign_folders_are_refused(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    _, _, manifest = checkpoint.save_checkpoint(str(tmp_path / "ck"), 1, engine, one_rank, cfg.to_dict())
    assert checkpoint.incompatibility(manifest, {**vars(cfg.model), "n_embd": 64}) == \
        "checkpoint has model.n_embd=32, this run has 64"
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.read_manifest(str(tmp_path))


# ---------------------------------------------------------------- retention
def test_retention_keeps_what_latest_names_and_never_touches_newer_folders(tmp_path, one_rank, monkeypatch):
    cfg, engine = trained(tmp_path, one_rank, steps=1)
    root = str(tmp_path / "ck")
    checkpoint.save_checkpoint(root, 20, engine, one_rank, cfg.to_dict(), keep=2)  # a run that got to step 20 ...
    for step in (5, 10):  # ... restarted from an earlier step in the same folder
        checkpoint.save_checkpoint(root, step, engine, one_rank, cfg.to_dict(), keep=2)
    assert checkpoint.read_latest(root) == "step_00000010"
    assert checkpoint.committed_steps(root) == ["step_00000005", "step_00000010", "step_00000020"]
    checkpoint.save_checkpoint(root, 15, engine, one_rank, cfg.to_dict(), keep=2)
    assert checkpoint.committed_steps(root) == ["step_00000010", "step_00000015", "step_00000020"]
    assert checkpoint.find_resumable(root) == (os.path.join(root, "step_00000015"), [])

    def newest_by_name(root, keep):  # planted: the old rule, keep the newest `keep` names
        import shutil
        for name in checkpoint.committed_steps(root)[:-keep]:
            shutil.rmtree(os.path.join(root, name))

    monkeypatch.setattr(commit_module, "retain", newest_by_name)
    root = str(tmp_path / "old-rule")
    checkpoint.save_checkpoint(root, 20, engine, one_rank, cfg.to_dict(), keep=1)
    checkpoint.save_checkpoint(root, 5, engine, one_rank, cfg.to_dict(), keep=1)
    assert not os.path.isdir(os.path.join(root, checkpoint.read_latest(root)))  # latest names a deleted folder


# ---------------------------------------------------------------- the async writer
def held_copies(monkeypatch, engine):
    """The staging copy waits until training has reached its next update, deterministically, with no sleep.

    It proceeds once the update either waits for it (the writer's pre-hook, as it should) or has
    already happened (an optimizer that does not wait: the planted bug then leaks the new state).
    """
    reached = threading.Event()
    real_copy, real_wait = save_module._Staging.copy_from, checkpoint.CheckpointWriter._wait_staged

    def copy_from(self, engine, step_count):
        assert reached.wait(timeout=60), "training never reached its next update"
        real_copy(self, engine, step_count)

    def wait_staged(self):
        reached.set()
        real_wait(self)

    monkeypatch.setattr(save_module._Staging, "copy_from", copy_from)
    monkeypatch.setattr(checkpoint.CheckpointWriter, "_wait_staged", wait_staged)
    engine.adamw.optimizer.register_step_post_hook(lambda *_: reached.set())
    return reached


def test_async_save_writes_bitwise_the_files_of_a_sync_save_while_training_goes_on(tmp_path, one_rank, monkeypatch):
    cfg, engine = trained(tmp_path, one_rank)
    reached = held_copies(monkeypatch, engine)
    sync_path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "sync"), 2, engine, one_rank, cfg.to_dict())
    writer = checkpoint.CheckpointWriter(str(tmp_path / "async"), one_rank, async_save=True)
    writer.start(2, engine, {"config": cfg.to_dict()})
    assert not writer.local_done()  # the copy is held until training reaches its next update
    run_steps(engine, cfg, 1)  # the next update waits for the staging copy, not for the write
    async_path = writer.finish()
    assert folder_hashes(async_path) == folder_hashes(sync_path)  # manifest.json included
    assert writer.finish() is None and writer.local_done()

    staged = writer._staging.master.data_ptr()
    reached.set()
    writer.start(3, engine, {"config": cfg.to_dict()})
    assert writer._staging.master.data_ptr() == staged  # staging buffers are reused, not reallocated
    writer.finish()

    # planted: an update that does not wait for the copy leaks the next step's state into the files
    reached.clear()
    sync_path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "sync"), 3, engine, one_rank, cfg.to_dict())
    monkeypatch.setattr(checkpoint.CheckpointWriter, "_wait_staged", lambda self: None)
    unguarded = checkpoint.CheckpointWriter(str(tmp_path / "unguarded"), one_rank, async_save=True)
    unguarded.start(3, engine, {"config": cfg.to_dict()})
    run_steps(engine, cfg, 1)
    assert folder_hashes(unguarded.finish())[SHARD] != folder_hashes(sync_path)[SHARD]


def test_async_writer_refuses_a_second_save_in_flight_and_an_early_commit(tmp_path, one_rank, monkeypatch):
    _, engine = trained(tmp_path, one_rank)
    reached = held_copies(monkeypatch, engine)  # the save stays in flight until the test lets it go
    writer = checkpoint.CheckpointWriter(str(tmp_path / "ck"), one_rank, async_save=True)
    assert writer.local_done() and writer.commit_pending() is None and writer.finish() is None
    writer.start(2, engine, {})
    assert writer.pending_step == 2
    with pytest.raises(RuntimeError, match="save of step 2 is in flight"):
        writer.start(3, engine, {})
    with pytest.raises(RuntimeError, match="save of step 2 is in flight"):
        writer.save(3, engine, {})
    with pytest.raises(RuntimeError, match="still writing step 2"):
        writer.commit_pending()
    reached.set()
    while not writer.local_done():
        time.sleep(0.01)
    assert writer.commit_pending() == str(tmp_path / "ck" / "step_00000002")
    assert checkpoint.read_latest(str(tmp_path / "ck")) == "step_00000002"


# ---------------------------------------------------------------- crashes
def test_a_save_failing_midway_leaves_the_previous_checkpoint_and_latest(tmp_path, one_rank):
    cfg, engine = trained(tmp_path, one_rank)
    root = str(tmp_path / "ck")
    checkpoint.save_checkpoint(root, 2, engine, one_rank, cfg.to_dict(), keep=2)

    def disk_full(step):
        raise OSError(28, "No space left on device")

    writer = checkpoint.CheckpointWriter(root, one_rank, keep=2, halfway_hook=disk_full)
    with pytest.raises(checkpoint.CheckpointError, match=rf"rank 0: writing .*step_00000003.tmp/{SHARD} failed"):
        writer.save(3, engine, {"config": cfg.to_dict()})
    writer.start(4, engine, {"config": cfg.to_dict()})
    while True:
        try:
            if writer.local_done():
                break
        except checkpoint.CheckpointError as e:
            assert f"step_00000004.tmp/{SHARD} failed" in str(e)
            break
        time.sleep(0.01)
    assert writer.pending_step is None  # the failed save is dropped; the writer can save again
    assert checkpoint.committed_steps(root) == ["step_00000002"]
    assert checkpoint.read_latest(root) == "step_00000002"
    assert checkpoint.find_resumable(root) == (os.path.join(root, "step_00000002"), [])


def test_a_process_killed_midway_through_an_async_save_leaves_the_previous_checkpoint_and_latest(tmp_path):
    root = str(tmp_path / "ck")
    codes, _ = spawn(killed_mid_save_job, 1, tmp_path, root)
    assert codes == [9]
    assert checkpoint.committed_steps(root) == ["step_00000002"]
    assert checkpoint.read_latest(root) == "step_00000002"
    half = os.path.getsize(os.path.join(root, ".step_00000003.tmp", SHARD))
    assert 0 < half < os.path.getsize(os.path.join(root, "step_00000002", SHARD))  # it died mid-file
    assert checkpoint.find_resumable(root) == (os.path.join(root, "step_00000002"), [])


def killed_mid_save_job(rank, comm, tmp_path, root):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, comm)
    run_steps(engine, cfg, 2)
    checkpoint.save_checkpoint(root, 2, engine, comm, cfg.to_dict())
    writer = checkpoint.CheckpointWriter(root, comm, async_save=True, halfway_hook=lambda step: os._exit(9))
    writer.start(3, engine, {"config": cfg.to_dict()})
    run_steps(engine, cfg, 1)
    writer.finish()
    return {}


# ---------------------------------------------------------------- two ranks
def test_two_ranks_commit_sync_and_async_saves_and_an_unshared_folder_stops_every_rank(tmp_path):
    root = str(tmp_path / "ck")
    codes, results = spawn(two_rank_job, 2, tmp_path, root)
    assert codes == [0, 0], results
    assert results[0]["paths"] == results[1]["paths"] == [os.path.join(root, checkpoint.step_name(s)) for s in (1, 2, 3)]
    assert results[0]["verified"] == [True, True, True]
    assert results[0]["loaded_equal"] and results[1]["loaded_equal"]
    for r in (0, 1):  # both ranks learn rank 0's verdict; neither is left waiting
        assert "rank 0 cannot see rank 1's files" in results[r]["unshared"]
        assert "must be on a filesystem shared by all nodes" in results[r]["unshared"]
    assert checkpoint.read_latest(root) == "step_00000003"
    names = {f["name"] for f in checkpoint.read_manifest(os.path.join(root, "step_00000003"))["files"]}
    assert names == {"optim-rank00000-of-00002.safetensors", "optim-rank00001-of-00002.safetensors"}


def two_rank_job(rank, comm, tmp_path, root):
    cfg = tiny_config(tmp_path, nproc=2)
    engine = build_engine(cfg, comm)
    run_steps(engine, cfg, 1)
    writer = checkpoint.CheckpointWriter(root, comm, keep=3, async_save=True)
    paths = [writer.save(1, engine, {"config": cfg.to_dict()})[0]]
    run_steps(engine, cfg, 1)
    writer.start(2, engine, {"config": cfg.to_dict()})
    path = None
    while path is None:  # the loop's per-step all-reduce carries "my part of this phase is done" as a flag
        run_steps(engine, cfg, 1)
        not_done = comm.all_reduce(torch.tensor([0.0 if writer.local_done() else 1.0]), "test")
        if not_done.item() == 0:  # written everywhere: rank 0 commits in its thread; then committed: the folder
            path = writer.advance()
    paths.append(path)
    writer.start(3, engine, {"config": cfg.to_dict()})
    real_commit = save_module.commit
    if rank == 0:  # a slow commit (shared storage): finish() returns on no rank before the checkpoint is in place
        save_module.commit = lambda *args, **kwargs: (time.sleep(0.5), real_commit(*args, **kwargs))[1]
    paths.append(writer.finish())
    save_module.commit = real_commit
    fresh = build_engine(cfg, comm)
    checkpoint.load_checkpoint(paths[-1], fresh, comm)
    out = {"paths": paths, "loaded_equal": torch.equal(fresh.held_params, engine.held_params)}
    if rank == 0:
        out["verified"] = [all(c.ok for c in checkpoint.verify_checkpoint(p)) for p in paths]
    elsewhere = root if rank == 0 else str(tmp_path / "node1-local-disk")  # rank 1 on a disk rank 0 cannot see
    try:
        checkpoint.CheckpointWriter(elsewhere, comm).save(4, engine, {})
    except checkpoint.CheckpointError as e:
        out["unshared"] = str(e)
    return out


def spawn(job, world_size, tmp_path, *args, timeout=120):
    """Run `job(rank, comm, tmp_path, *args)` in `world_size` new processes; (exit codes, results by rank).

    The processes are forked from the forkserver local ranks start from (torch imported once), not spawned: a
    spawned process imports torch again, about 3 s of CPU each. They take this process's environment as it is now,
    not the server's (started by an earlier test, perhaps while its ZEROTRAIN_FAULTS was set), as the product's ranks
    do (rank_start.adopt).
    """
    rank_start.start_server()
    ctx = multiprocessing.get_context(rank_start.START_METHOD)
    store = tmp_path / "store"
    procs = [ctx.Process(target=_rank_main, args=(job, r, world_size, str(store), tmp_path, args, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    for r in range(world_size):
        file = tmp_path / f"result-{r}.json"
        results.append(json.loads(file.read_text()) if file.exists() else None)
    return [p.exitcode for p in procs], results


def _rank_main(job, rank, world_size, store, tmp_path, args, environ):
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        out = job(rank, Comm(), tmp_path, *args)
    except BaseException:
        out = {"error": traceback.format_exc()}
    (tmp_path / f"result-{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # without interpreter teardown: gloo threads can still hold tensors (see cli.main)


def test_hashing_behind_a_read_holds_at_most_a_few_blocks_and_an_unbounded_queue_is_caught(tmp_path, monkeypatch):
    """sha256_file's blocks are fresh bytes: a reader faster than the hash must wait, not queue the file in memory.
    The hash thread is held until the reader finds the queue full (or is done), so the largest backlog is what the
    queue lets through. Planted: an unbounded queue (maxsize 0) lets the whole file pile up."""
    monkeypatch.setattr(stream, "CHUNK", 64)
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 5)  # 20 blocks
    real_run, real_update, real_close = stream._Hasher._run, stream._Hasher.update, stream._Hasher.close

    def backlog(queued):
        gate, peak = threading.Event(), [0]

        def run(self):
            gate.wait()
            real_run(self)

        def update(self, block):
            if self._queue.full():
                gate.set()
            real_update(self, block)
            peak[0] = max(peak[0], self._queue.qsize())

        def close(self):
            gate.set()
            real_close(self)

        monkeypatch.setattr(stream._Hasher, "QUEUED", queued)
        monkeypatch.setattr(stream._Hasher, "_run", run)
        monkeypatch.setattr(stream._Hasher, "update", update)
        monkeypatch.setattr(stream._Hasher, "close", close)
        assert stream.sha256_file(str(path)) == (1280, sha(path))
        return peak[0]

    assert backlog(stream._Hasher.QUEUED) <= stream._Hasher.QUEUED
    assert backlog(0) == 20


def test_a_write_never_waits_for_its_hash_and_a_bounded_writer_queue_is_caught(tmp_path, monkeypatch):
    """write_safetensors' blocks are views of memory the writer holds anyway: the writer queues every block for the
    hash thread and never waits for it (a wait made every sync save run at the hash's speed: bench ckpt). The hash
    thread is held until the writer is done or finds the queue full. Planted: the writer's queue bounded at QUEUED, as
    sha256_file's is."""
    monkeypatch.setattr(stream, "CHUNK", 64)
    tensors = {"x": torch.arange(320, dtype=torch.float32)}  # 1,280 bytes of data: 20 blocks, and the header's
    real_init, real_run, real_update, real_close = (stream._Hasher.__init__, stream._Hasher._run,
                                                    stream._Hasher.update, stream._Hasher.close)

    def writer_waits(init) -> tuple[bool, int]:
        gate, seen = threading.Event(), {"full": False, "backlog": 0}

        def run(self):
            gate.wait()
            real_run(self)

        def update(self, block):
            if self._queue.full():
                seen["full"] = True
                gate.set()
            real_update(self, block)
            seen["backlog"] = max(seen["backlog"], self._queue.qsize())

        def close(self):
            gate.set()
            real_close(self)

        for name, fn in (("__init__", init), ("_run", run), ("update", update), ("close", close)):
            monkeypatch.setattr(stream._Hasher, name, fn)
        record = stream.write_safetensors(str(tmp_path / "x.safetensors"), tensors)
        assert record.sha256 == sha(tmp_path / "x.safetensors")
        return seen["full"], seen["backlog"]

    blocks = -(-len(stream.header_bytes(tensors)[0]) // 64) + 20
    assert writer_waits(real_init) == (False, blocks)  # every block queued at once, the header's included
    bounded = lambda self, threaded=True, queued=0: real_init(self, threaded, stream._Hasher.QUEUED)  # noqa: E731
    assert writer_waits(bounded)[0]
