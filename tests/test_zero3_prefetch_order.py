"""ZeRO-3's prefetch is issued ahead of the compute it hides behind: block u+1's gather before block u's forward
computes, block u-1's before block u's backward has finished. On CUDA that order is what lets NCCL's stream run the
gather beside the compute stream (the compute stream waits on it only when the unit runs); on one gloo rank the same
code runs, so the order is checked here."""

import pytest
import torch
from conftest import tiny_config

from zerotrain.data import BatchSchedule, make_source
from zerotrain.model.recompute import in_backward
from zerotrain.parallel import ShardedParameters
from zerotrain.training.loop import accumulate_gradients, build_engine


def record_one_micro_batch(tmp_path, comm) -> tuple[list[tuple[str, int]], int]:
    """One micro-batch's forward and backward at --zero 3 --overlap on: the events in the order they happened
    (("prefetch", u): unit u's gather issued; ("forward", u): block u's first submodule computes; ("backward done",
    u): the gradient of block u's input is complete), and the number of units."""
    cfg = tiny_config(tmp_path, zero=3, overlap="on", micro=4, steps=1, n_layer=4)
    engine = build_engine(cfg, comm)
    placement = engine.placement
    events: list[tuple[str, int]] = []
    real_prefetch = ShardedParameters.prefetch_unit

    def recorded_prefetch(self, unit):
        events.append(("prefetch", unit))
        return real_prefetch(self, unit)

    for index, unit in enumerate(placement.units):
        if index == 0:
            continue
        block = unit[0]
        first = next(block.children())
        first.register_forward_pre_hook(lambda _m, _a, u=index: events.append(("forward", u))
                                        if torch.is_grad_enabled() else None)

        def watch_input(_m, args, u=index):
            if torch.is_grad_enabled() and args and args[0].requires_grad:
                args[0].register_hook(lambda _g: events.append(("backward done", u)))

        block.register_forward_pre_hook(watch_input)
    batch = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=1, rank=0,
                          world_size=1).batch(0)
    engine.zero_grad()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardedParameters, "prefetch_unit", recorded_prefetch)
        accumulate_gradients(engine, batch)
    return events, len(placement.units)


def assert_prefetched_ahead(events: list[tuple[str, int]], units: int) -> None:
    """Every block but the last has the next block's gather issued before its own forward computes; every block but
    the first has the previous block's gather issued, once the forward is over, before its own backward is done."""
    end_of_forward = max(at for at, (kind, _) in enumerate(events) if kind == "forward")
    for u in range(1, units - 1):
        issued = [at for at, e in enumerate(events) if e == ("prefetch", u + 1) and at < end_of_forward]
        assert issued and issued[0] < events.index(("forward", u)), f"block {u + 1} prefetched after block {u} computed"
    for u in range(2, units):
        done = events.index(("backward done", u))
        assert any(end_of_forward < at < done for at, e in enumerate(events) if e == ("prefetch", u - 1)), \
            f"block {u - 1} prefetched after block {u}'s backward was done"


def test_the_prefetch_is_issued_before_the_compute_it_hides_behind_and_a_late_one_is_caught(tmp_path, one_rank,
                                                                                              monkeypatch):
    events, units = record_one_micro_batch(tmp_path / "right", one_rank)
    assert units == 5  # the root and four blocks
    assert_prefetched_ahead(events, units)
    # Planted in the product's own hooks: the forward's prefetch moved to the unit's forward hook (after it computed).
    real_prefetch_after, real_leave = ShardedParameters._prefetch_after, ShardedParameters._leave_unit

    def prefetch_only_in_backward(self, unit, backward):
        if backward:
            real_prefetch_after(self, unit, backward)

    def leave_then_prefetch(self, unit):
        real_leave(self, unit)
        if torch.is_grad_enabled() and not in_backward():
            real_prefetch_after(self, unit, False)

    monkeypatch.setattr(ShardedParameters, "_prefetch_after", prefetch_only_in_backward)
    monkeypatch.setattr(ShardedParameters, "_leave_unit", leave_then_prefetch)
    late, units = record_one_micro_batch(tmp_path / "late", one_rank)
    with pytest.raises(AssertionError, match="prefetched after block"):
        assert_prefetched_ahead(late, units)


def test_a_backward_without_its_prefetch_is_caught(tmp_path, one_rank, monkeypatch):
    """Planted in the product's own hook: the backward's prefetch of the previous block never issued (each block
    gathered only when its own backward reads a weight)."""
    real_prefetch_after = ShardedParameters._prefetch_after
    monkeypatch.setattr(ShardedParameters, "_prefetch_after",
                        lambda self, unit, backward: None if backward else real_prefetch_after(self, unit, backward))
    events, units = record_one_micro_batch(tmp_path, one_rank)
    with pytest.raises(AssertionError, match="backward was done"):
        assert_prefetched_ahead(events, units)
