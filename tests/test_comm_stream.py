"""The bucket collectives' stream (parallel/comm_stream.py), driven on CPU through its seam: a recorder in place of
torch.cuda's stream API, over one gloo rank. Every collective is issued on the communication stream after an event
the compute stream recorded, records its `done` there, and the compute stream waits for `done` before a buffer the
collective used is read, written or freed (the gradient buckets, the gradient shard, stage 3's gathered buckets and
the shard they are gathered from); the losses are bitwise those of the current-stream path. Planted: a landing that
lets the compute stream go on without waiting is caught."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from conftest import tiny_config

from zerotrain.parallel import comm_stream, grad_norm
from zerotrain.parallel.comm_stream import CommStream
from zerotrain.parallel.gradients import GradientReducer
from zerotrain.parallel.sharded import ShardedParameters
from zerotrain.training.loop import train


class RecordedStreams:
    """torch.cuda's stream API as CommStream calls it (Stream, Event, stream(), current_stream()), recording in `log`
    what each stream records and waits for; beside it, the buffers each landing holds and what the run does with
    buffers (`use`)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.ids = itertools.count()
        self.compute = self._Stream(self, "compute")
        self._current = self.compute

    class _Stream:
        def __init__(self, api, name):
            self.api, self.name = api, name

        def wait_event(self, event) -> None:
            self.api.log.append(("wait", self.name, event.id))

    class _Event:
        def __init__(self, api):
            self.api, self.id = api, next(api.ids)

        def record(self, stream=None) -> None:
            self.api.log.append(("record", (stream or self.api.current_stream()).name, self.id))

        def synchronize(self) -> None:  # the host waits for the event
            self.api.log.append(("synchronize", self.id))

    def Stream(self, priority: int = 0):  # noqa: N802 (torch.cuda's name)
        return self._Stream(self, "comm")

    def Event(self):  # noqa: N802
        return self._Event(self)

    def current_stream(self):
        return self._current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self._current = self._current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self._current = previous
            self.log.append(("exit", stream.name))

    def use(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().nbytes():
            self.log.append((what, tensor.untyped_storage().data_ptr()))


def stream_order_problems(log: list[tuple]) -> tuple[list[str], int]:
    """What in `log` breaks the order (a buffer used while a collective that used it is not waited for by the
    compute stream; a collective not issued after a compute-stream event; a done event not on the communication
    stream; a landing never waited for), and the number of collectives."""
    recorded_on, outstanding, problems, landings, ready = {}, {}, [], 0, False
    for entry in log:
        kind = entry[0]
        if kind == "record":
            recorded_on[entry[2]] = entry[1]
        elif kind == "wait" and entry[1] == "comm":
            ready = recorded_on.get(entry[2]) == "compute"
        elif kind == "wait" and entry[1] == "compute":
            outstanding.pop(entry[2], None)
        elif kind == "landing":
            landings += 1
            done, storages = entry[1], entry[2]
            if not ready:
                problems.append(f"collective {landings} issued without waiting for a compute-stream event")
            if recorded_on.get(done) != "comm":
                problems.append(f"collective {landings}'s done event recorded on {recorded_on.get(done)}")
            outstanding[done], ready = set(storages), False
        else:  # a buffer read, written or freed by the compute stream
            late = [d for d, storages in outstanding.items() if entry[1] in storages]
            if late:
                problems.append(f"{kind} of a buffer before the compute stream waited for collective event {late}")
    problems += [f"collective event {d} never waited for" for d in outstanding]
    return problems, landings


@pytest.fixture
def recorded(monkeypatch):
    """The recorder, with the run's buffer uses noted: a bucket's gradients freed, the gradient shard read by the
    norm, a gathered stage 3 bucket freed or read by its unit, the shard written by AdamW."""
    api = RecordedStreams()

    class RecordedLanding(comm_stream.Landing):
        def __init__(self, api_, done, tensors):
            super().__init__(api_, done, tensors)
            api.log.append(("landing", done.id, [t.untyped_storage().data_ptr() for t in tensors]))

    monkeypatch.setattr(comm_stream, "Landing", RecordedLanding)
    real_release, real_squares = GradientReducer._release, grad_norm.chunk_squares
    real_free, real_gather = ShardedParameters._release_bucket, ShardedParameters.gather_unit
    real_before_update = ShardedParameters.before_update

    def release(self, index):
        if index in self._bucket_grads:
            api.use("free", self._bucket_grads[index])
        real_release(self, index)

    def squares(shard, ranges):
        api.use("read", shard)
        return real_squares(shard, ranges)

    def free(self, index):
        api.use("free", self.bucket_params[index])
        real_free(self, index)

    def gather_unit(self, unit, phase):
        real_gather(self, unit, phase)
        for b in self.unit_buckets[unit]:
            api.use("read", self.bucket_params[b])

    def before_update(self):
        real_before_update(self)
        api.use("write", self.param_shard)

    monkeypatch.setattr(GradientReducer, "_release", release)
    monkeypatch.setattr(grad_norm, "chunk_squares", squares)
    monkeypatch.setattr(ShardedParameters, "_release_bucket", free)
    monkeypatch.setattr(ShardedParameters, "gather_unit", gather_unit)
    monkeypatch.setattr(ShardedParameters, "before_update", before_update)
    return api


def losses(result) -> list[float]:
    return [r["loss"] for r in result.records]


@pytest.mark.parametrize("settings", [dict(zero=2, accum=2), dict(zero=3, overlap="on"),
                                      dict(zero=3, overlap="on", grad_reduce="micro-batch", accum=2)],
                         ids=["zero2-accum2", "zero3-prefetch", "zero3-micro-batch"])
def test_collectives_run_on_their_stream_and_every_buffer_waits_for_them_and_a_skipped_wait_is_caught(
        tmp_path, one_rank, recorded, monkeypatch, settings):
    plain = train(tiny_config(tmp_path / "current", steps=3, **settings), one_rank, announce=False)
    one_rank.stream = CommStream(recorded)  # the CUDA path, its stream API recorded
    try:
        streamed = train(tiny_config(tmp_path / "streamed", steps=3, **settings), one_rank, announce=False)
        problems, collectives = stream_order_problems(recorded.log)
        assert problems == [] and collectives > 0, problems
        assert any(entry[0] == "free" for entry in recorded.log)  # the buffers' uses were seen
        assert losses(streamed) == losses(plain)  # bitwise: the same collectives, ordered by the stream
        # planted: the compute stream does not wait for a collective before it goes on
        monkeypatch.setattr(comm_stream.Landing, "wait", lambda self: None)
        recorded.log.clear()
        train(tiny_config(tmp_path / "unwaited", steps=3, **settings), one_rank, announce=False)
        problems, _ = stream_order_problems(recorded.log)
        assert any("before the compute stream waited" in p for p in problems), problems
    finally:
        one_rank.stream = CommStream(None)


def test_on_the_cpu_a_collective_runs_on_the_current_stream_as_issued(one_rank):
    """No stream API (CPU, gloo): `run` calls the collective as the caller asked and hands back its own handle."""
    stream, calls = CommStream(None), []
    handle = object()
    assert stream.run(lambda is_async: calls.append(is_async) or handle, (), async_op=True) is handle
    assert stream.run(lambda is_async: calls.append(is_async), (), async_op=False) is None
    assert calls == [True, False] and one_rank.stream.side is None
