"""The step's loss stays on the device: no host sync per micro-batch, the same sum bit for bit; the copies to it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import tiny_config

from zerotrain.data import BatchSchedule, make_source, on_device
from zerotrain.training import executor, objectives
from zerotrain.training.loop import accumulate_gradients, build_engine

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # scripts/device-check.sh runs the CUDA case


def step_batch(cfg, step=0):
    schedule = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum, rank=0,
                             world_size=1)
    return schedule.batch(step)


class Recorded:
    """Wraps sft's head_loss: keeps each micro-batch's summed token loss, and counts Tensor.item calls."""

    def __init__(self, sync_each: bool = False):
        self.losses, self.items, self.sync_each = [], 0, sync_each
        self.real_head_loss, self.real_item = objectives.head_loss, torch.Tensor.item

    def head_loss(self, *args, **kwargs):
        loss = self.real_head_loss(*args, **kwargs)
        self.losses.append(loss.detach().clone())
        if self.sync_each:  # planted: the host reads every micro-batch's loss, as the loop once did
            loss.item()
        return loss

    def item(self, tensor):
        self.items += 1
        return self.real_item(tensor)

    def run(self, engine, batch):
        engine.zero_grad()
        with mock.patch.object(objectives, "head_loss", self.head_loss), \
                mock.patch.object(torch.Tensor, "item", lambda t: self.item(t)):
            return accumulate_gradients(engine, batch)


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_sum_stays_on_the_device_and_equals_the_host_sum_bitwise(tmp_path, one_rank, device):
    cfg = tiny_config(tmp_path, micro=8, accum=8, device=device, overlap="off")  # sums an fp32 sum would round
    cfg.data.source = "synthetic-varlen"  # micro-batch losses of every size
    engine, batch = build_engine(cfg, one_rank), step_batch(cfg)
    recorded = Recorded()
    loss_sum = recorded.run(engine, batch)
    assert recorded.items == 0  # no host sync in the whole accumulation
    assert loss_sum.shape == () and loss_sum.dtype == torch.float64 and loss_sum.device.type == device
    host = 0.0
    for loss in recorded.losses:  # what the loop summed before: a Python float, one .item() per micro-batch
        host += loss.item()
    assert len(recorded.losses) == 8 and float(loss_sum) == host

    # planted: a host read of each micro-batch's loss is counted, once per micro-batch
    synced = Recorded(sync_each=True)
    assert float(synced.run(engine, batch)) == host and synced.items == 8
    # planted: an fp32 sum on the device is not the host's float64 sum of the same values (on one of the first
    # steps' batches at least: a sum of 8 fp32-rounded values may happen to round to the float64 one)
    rounded = []
    for step in range(8):
        batch = step_batch(cfg, step)
        exact = Recorded()
        host = float(exact.run(engine, batch))
        assert host == sum(loss.item() for loss in exact.losses)
        with mock.patch.object(executor, "LOSS_SUM_DTYPE", torch.float32):
            rounded.append(float(Recorded().run(engine, batch)) != host)
    assert any(rounded)


@pytest.mark.parametrize("device", DEVICES)
def test_micro_batches_reach_the_device_in_order_and_stay_where_they_are_on_cpu(tmp_path, device):
    cfg = tiny_config(tmp_path, micro=2, accum=3)
    cfg.data.source = "synthetic-varlen"
    micro = step_batch(cfg).micro_batches
    moved = list(on_device(micro, torch.device(device)))
    assert len(moved) == 3
    for m, d in zip(micro, moved):
        assert d.inputs.device.type == device and d.segments is None
        assert torch.equal(d.inputs.cpu(), m.inputs) and torch.equal(d.labels.cpu(), m.labels)
        if device == "cpu":
            assert d is m  # no copy on CPU
    assert all(a is b for a, b in zip(on_device(moved, torch.device(device)), moved))  # there already: as they are
