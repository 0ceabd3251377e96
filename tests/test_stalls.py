"""No hidden stalls: checkpoint I/O waits with --io-timeout, and a rank's writer failure stops every rank at once."""

import datetime
import os
import re
import time

import torch.distributed as dist
from conftest import tiny_config, zerotrain_here
from test_checkpoint import spawn

from test_production import TINY, events, final_state

from zerotrain import checkpoint
from zerotrain.checkpoint import save as save_module
from zerotrain.checkpoint.checkpointer import AsyncCost
from zerotrain.parallel import Comm
from zerotrain.training.loop import build_engine, train

STEP_TIMEOUT_S = 2  # the collectives' --timeout in these jobs; the spawned group's own wait is torch's 30 min


def comm_with_short_timeout(io: Comm) -> Comm:
    """The step's communicator with a short wait; `io` (the spawned group, with a long one) for checkpoint I/O."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    return Comm(group, timeout_s=STEP_TIMEOUT_S, io=io)


def slow_disk_save_job(rank, io, tmp_path, planted):
    comm = comm_with_short_timeout(io)
    if planted:  # planted: the writer's collectives wait with --timeout, as before --io-timeout
        comm.io = comm
    cfg = tiny_config(tmp_path / "cfg", nproc=2)
    engine = build_engine(cfg, io)  # the long wait: only the save is timed, however slowly a loaded machine starts
    timed_out = tmp_path / "rank0-timed-out"

    def stall(step):
        """A slow disk under rank 1: 3 x STEP_TIMEOUT_S, or until rank 0 has timed out waiting for it (planted)."""
        deadline = time.monotonic() + 3 * STEP_TIMEOUT_S
        while not timed_out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    writer = checkpoint.CheckpointWriter(str(tmp_path / "ck"), comm, halfway_hook=stall if rank == 1 else None)
    try:
        return {"saved": writer.save(1, engine, {})[0]}
    except Exception as e:  # noqa: BLE001 - reported to the test
        timed_out.touch()
        return {"error": str(e)}


def slow_disk_saves_job(rank, io, tmp_path):
    """The slow save as it is, then planted, on one start of the ranks: the planted one's timeout leaves the ranks
    out of step, so it goes last."""
    return {way: slow_disk_save_job(rank, io, tmp_path / way, way == "planted") for way in ("ok", "planted")}


def test_a_save_slower_than_the_step_timeout_waits_with_the_io_timeout(tmp_path):
    (tmp_path / "ok").mkdir(), (tmp_path / "planted").mkdir()
    codes, results = spawn(slow_disk_saves_job, 2, tmp_path, timeout=120)
    assert codes == [0, 0], results
    ok, planted = [r["ok"] for r in results], [r["planted"] for r in results]
    assert [r.get("saved") for r in ok] == [str(tmp_path / "ok" / "ck" / "step_00000001")] * 2
    checkpoint.verify_or_raise(ok[0]["saved"])
    assert "timed out after 2 s" in planted[0]["error"] and "--timeout" in planted[0]["error"]


def failing_async_writer_job(rank, io, tmp_path, planted):
    """Rank 1's async writer fails at step 8; like a rank whose peers cannot see it leave (NCCL, another node),
    it stays alive after its error until rank 0 has finished."""
    os.environ["ZEROTRAIN_FAULTS"] = "save_error@step=8,rank=1"  # step 4: the first save, synchronous
    if planted:  # planted: the writer's failure is raised before the step's all-reduce, as before
        poll = save_module.CheckpointWriter.poll

        def raising(self):
            written, error = poll(self)
            if error is not None:
                raise error
            return written, None
        save_module.CheckpointWriter.poll = raising
    comm = comm_with_short_timeout(io)
    # ckpt_every 4: no later save waits for the failed one; the writer fails within ms, long before step 12 ends the run
    cfg = tiny_config(tmp_path / "run", nproc=2, steps=12, ckpt_every=4, async_save=True)
    try:
        train(cfg, comm, announce=False)
        out = {"error": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"error": str(e)}
    deadline = time.monotonic() + 60
    while rank == 1 and not (tmp_path / "result-0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


def test_an_async_writer_failure_on_one_rank_stops_every_rank_in_that_step(tmp_path):
    (tmp_path / "ok").mkdir(), (tmp_path / "planted").mkdir()
    codes, results = spawn(failing_async_writer_job, 2, tmp_path / "ok", False, timeout=120)
    assert "injected write failure" in results[1]["error"]
    # the first step whose all-reduce finds the writer's thread ended: 9, or later if it was still writing
    assert re.fullmatch(r"step (9|1[0-2]): rank 1 failed before the step's all-reduce \(its own line says why\)",
                        results[0]["error"]), results[0]["error"]
    codes, results = spawn(failing_async_writer_job, 2, tmp_path / "planted", True, timeout=120)
    assert "injected write failure" in results[1]["error"]
    assert "timed out after 2 s" in results[0]["error"]  # rank 0 waited out the collective for a rank long gone


def test_an_async_save_is_judged_by_the_training_time_it_cost_against_a_synchronous_save():
    cost = AsyncCost()
    cost.sync_s = 1.0
    for seconds in (0.10, 0.11, 0.09):
        cost.step(seconds)  # no save in flight: the baseline, median 0.10
    cost.started(0.01)
    for seconds in (0.30, 0.30, 0.10):
        cost.step(seconds)
    cost.committed()
    assert cost.last == (0.01 + 0.70 - 3 * 0.10, 1.0) and not cost.slower  # 0.41 s of training: cheaper
    cost.started(0.01)
    cost.step(0.90)
    cost.start_s += 0.50  # the next save had to wait for this one (Checkpointer.finish)
    cost.committed()
    assert cost.last[0] > 1.0 and cost.slower and cost.recent == type(cost.recent)([0.10, 0.11, 0.09])


def test_async_saves_that_cost_more_than_a_synchronous_save_turn_synchronous_with_one_line(tmp_path, capfd):
    """The async writer's staging copy is held up (a writer with no core of its own), so the next optimizer step
    waits for it: every rank then saves synchronously, saying so once, and the files stay bitwise the same."""
    out = str(tmp_path / "stalled")
    r = zerotrain_here(capfd, "train", *TINY, "--steps", "8", "--ckpt-every", "2", "--async-save", "--out", out,
                       faults="slow_staging@step=4,rank=1")
    assert r.returncode == 0, r.stderr
    (event,) = events(out, "async_save_off")
    assert 5 <= event["step"] <= 8 and "saving synchronously from now on" in r.stderr
    assert r.stderr.count("--async-save: an async save cost") == 1
    sync = str(tmp_path / "sync")
    assert zerotrain_here(capfd, "train", *TINY, "--steps", "8", "--ckpt-every", "2", "--out", sync).returncode == 0
    assert all(final_state(out, s) == final_state(sync, s) for s in (2, 4, 6, 8))


# ---------------------------------------------------------------- slow storage off the step's timeout
SLOW_S = 1.2  # slow_storage's seconds per file: one file stays under STEP_TIMEOUT_S, two go past it


def slow_init_from_job(rank, io, tmp_path, source):
    """Rank 0's storage is slow from its start (2 x SLOW_S per file): it hashes its half of --init-from's one weight
    file for the manifests (charged once for the file, not per block) while rank 1, done with its half, waits for
    the digests. Then planted: the digests gathered on the step's timeout group."""
    os.environ["ZEROTRAIN_FAULTS"] = f"slow_storage@step=0,rank=0,factor={2 * SLOW_S}"
    out = {}
    for way in ("ok", "planted"):
        comm = comm_with_short_timeout(io)
        if way == "planted":
            comm.io = comm
        cfg = tiny_config(tmp_path / way, nproc=2, steps=2, init_from=source)
        try:
            result = train(cfg, comm, announce=False)
            out[way] = {"error": None, "steps": len(result.records)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[way] = {"error": str(e)}
    return out


def test_slow_storage_under_init_from_hashing_waits_with_the_io_timeout_and_the_ranks_share_the_hashing(tmp_path):
    from test_zero3 import exported

    cfg = tiny_config(tmp_path / "source")
    source = exported(tmp_path, cfg)
    codes, results = spawn(slow_init_from_job, 2, tmp_path, source, timeout=120)
    assert [r["ok"] for r in results] == [{"error": None, "steps": 2}] * 2, results
    assert results[1]["planted"]["error"].startswith("collective hash_init_from at step 0 timed out after 2 s")


def slow_commit_job(rank, io, tmp_path, planted):
    """Rank 0's storage turns slow at step 8 (SLOW_S per file), whose save is async: its write (one file) stays
    under the step's timeout, its commit (the manifest, then retention deleting step 4: two files) does not. The
    run must survive: the commit runs in a thread of rank 0's, and the ranks learn it is done through the steps'
    all-reduces. Planted: rank 0 commits on its training thread as soon as every rank has written.

    So that the commit phase deterministically begins at step 9, each rank's poll waits for its own write to end
    (the test's doing; rank 0's slow write then holds its step 9 by SLOW_S, under the timeout)."""
    os.environ["ZEROTRAIN_FAULTS"] = f"slow_storage@step=8,rank=0,factor={SLOW_S}"
    real_poll = save_module.CheckpointWriter.poll

    def written_first(self):
        pending = self._pending
        if pending is not None and not pending.committing:
            pending.thread.join()
        return real_poll(self)

    save_module.CheckpointWriter.poll = written_first
    if planted:
        real_advance = save_module.CheckpointWriter.advance

        def commit_on_the_training_thread(self):
            path = real_advance(self)
            if self._pending is not None and self._pending.committing and self._pending.commit_thread:
                self._pending.commit_thread.join()
            return path

        save_module.CheckpointWriter.advance = commit_on_the_training_thread
    comm = comm_with_short_timeout(io)
    cfg = tiny_config(tmp_path / "run", nproc=2, steps=12, ckpt_every=4, async_save=True, keep=1)
    try:
        result = train(cfg, comm, announce=False)
        return {"error": None, "checkpoints": [os.path.basename(p) for p in result.checkpoints]}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": str(e)}


def test_slow_storage_under_an_async_commit_and_retention_does_not_hold_a_step(tmp_path):
    (tmp_path / "ok").mkdir(), (tmp_path / "planted").mkdir()
    codes, results = spawn(slow_commit_job, 2, tmp_path / "ok", False, timeout=120)
    assert codes == [0, 0] and results[0] == results[1], results
    assert results[0] == {"error": None, "checkpoints": ["step_00000004", "step_00000008", "step_00000012"]}
    root = tmp_path / "ok" / "run" / "checkpoints"
    assert checkpoint.committed_steps(str(root)) == ["step_00000012"]  # keep 1: retention deleted 4 and 8
    checkpoint.verify_or_raise(str(root / "step_00000012"))
    codes, results = spawn(slow_commit_job, 2, tmp_path / "planted", True, timeout=120)
    assert re.fullmatch(r"collective \w+ at step (9|10) timed out after 2 s: .*", results[1]["error"]), results
