"""An async save's staging copy on CUDA (checkpoint/save.py's _Staging), driven on CPU through its stream seam (a
recorder in place of torch.cuda, test_comm_stream.RecordedStreams): the copies run on a stream of their own after
an event the training stream recorded at the save's start, the next update's stream waits for their `copied` event
before it writes the state, the writer thread waits for that event on the host, and the files are bitwise a sync
save's. Planted: an update that does not wait for the copies is caught in the order. (On CPU the copies are done
when issued, so the order is what can be seen here; on CUDA the missed wait would let the update overwrite the
state mid-copy.)"""

from __future__ import annotations

from test_checkpoint import folder_hashes, run_steps, trained
from test_comm_stream import RecordedStreams

from zerotrain import checkpoint
from zerotrain.checkpoint import save as save_module


def staging_order(log: list[tuple]) -> list[str]:
    """The order of the staging's stream calls and the update, as words."""
    names = {}
    out = []
    for entry in log:
        if entry[0] == "record":
            names[entry[2]] = "ready" if entry[1] == "compute" else "copied"
            out.append(f"record {names[entry[2]]} on {entry[1]}")
        elif entry[0] == "wait":
            out.append(f"{entry[1]} waits for {names[entry[2]]}")
        elif entry[0] == "synchronize":
            out.append(f"host waits for {names[entry[1]]}")
        elif entry[0] in ("enter", "exit"):
            out.append(f"{entry[0]} {entry[1]}")
        else:
            out.append(entry[0])
    return out


def test_staging_copies_on_their_stream_and_the_next_update_waits_for_them_and_a_missed_wait_is_caught(
        tmp_path, one_rank, monkeypatch):
    cfg, engine = trained(tmp_path, one_rank)
    api = RecordedStreams()
    monkeypatch.setattr(save_module, "stream_api", lambda device: api)
    real_parts = save_module.shard_parts
    # the state's tensors looked up (the manifest's description looks too): the copies follow on the stream current
    monkeypatch.setattr(save_module, "shard_parts",
                        lambda e: api.log.append((f"state read on {api.current_stream().name}",)) or real_parts(e))
    sync_path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "sync"), 2, engine, one_rank, cfg.to_dict())
    real_wait = save_module._Staging.wait_copied
    monkeypatch.setattr(save_module._Staging, "wait_copied",
                        lambda self: (real_wait(self), api.log.append(("written",))))
    api.log.clear()

    writer = checkpoint.CheckpointWriter(str(tmp_path / "async"), one_rank, async_save=True)
    writer.start(2, engine, {"config": cfg.to_dict()})
    assert not writer._staging.copy_in_background  # the stream's copies, queued at start
    # AdamW's step done (its pre-hooks, the writers', ran before it)
    engine.adamw.optimizer.register_step_post_hook(lambda *_: api.log.append(("update",)))
    path = writer.finish()  # the write (its host wait) first, then the update: the log's order is fixed
    run_steps(engine, cfg, 1)
    assert staging_order(api.log) == [
        "state read on compute", "record ready on compute", "comm waits for ready", "enter comm",
        "state read on comm", "record copied on comm", "exit comm", "host waits for copied", "written",
        "update"]  # the save finished first (its host wait): the update has nothing left to wait for
    assert folder_hashes(path) == folder_hashes(sync_path)  # manifest.json included

    # the update before the write has finished: the writer's pre-hook orders the update's stream after the copies
    api.log.clear()
    writer = checkpoint.CheckpointWriter(str(tmp_path / "behind"), one_rank, async_save=True)
    writer.start(3, engine, {"config": cfg.to_dict()})
    run_steps(engine, cfg, 1)
    writer.finish()
    order = staging_order(api.log)
    assert order.index("compute waits for copied") < order.index("update"), order

    # planted: the update's stream does not wait for the copies
    monkeypatch.setattr(save_module._Staging, "order_update", lambda self: None)
    api.log.clear()
    writer = checkpoint.CheckpointWriter(str(tmp_path / "unguarded"), one_rank, async_save=True)
    writer.start(4, engine, {"config": cfg.to_dict()})
    run_steps(engine, cfg, 1)
    writer.finish()
    assert "compute waits for copied" not in staging_order(api.log)
