"""Epochs: every record exactly once per epoch, in an order set by (seed, epoch), whatever the ranks, micro-batches
and packing; --epochs derives the steps; a resume mid-epoch continues the same order, bitwise, and one at another
global batch reads on from the row where the run stopped."""

from __future__ import annotations

import functools
import json
import os
from collections import Counter

import epoch_jobs
import numpy as np
import pytest
import torch
from conftest import tiny_config
from test_packing import expected_rows, make_records, record_source, write_records

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain import checkpoint
from zerotrain.data import BatchSchedule, RecordSource, epoch_steps, packing
from zerotrain.runtime.launch import run_job
from zerotrain.training.guard import data_step, skip_after_rollback

SPLITS = [(1, 6, 1), (2, 3, 1), (3, 2, 1), (3, 1, 2)]  # ranks x micro-batch x accumulation: 6 rows a step


def global_rows(source, step, world, micro, accum):
    """Step `step`'s rows as the ranks compute them, in rank order: (inputs, labels, segments or None)."""
    parts = []
    for rank in range(world):
        batch = BatchSchedule(source, micro_batch=micro, accum=accum, rank=rank, world_size=world).batch(step)
        parts += batch.micro_batches
    segments = None if parts[0].segments is None else torch.cat([m.segments for m in parts])
    return torch.cat([m.inputs for m in parts]), torch.cat([m.labels for m in parts]), segments


def row_records(x, y, seg):
    """The records a step's rows hold, as (inputs, labels): packed, by segment; unpacked, the record before its
    padding."""
    found = []
    for row in range(x.shape[0]):
        ids = seg[row] if seg is not None else (x[row] == 0).long()  # unpacked: the record, then padding
        for s in torch.unique_consecutive(ids):
            at = ids == s
            if (y[row, at] != -100).any():
                found.append((tuple(x[row, at].tolist()), tuple(y[row, at].tolist())))
    return found


def records_of_epoch(source, epoch, world, micro, accum):
    """Every record the ranks' rows of `epoch` hold, as (inputs, labels)."""
    return [r for step in range(source.first_step(epoch), source.first_step(epoch + 1))
            for r in row_records(*global_rows(source, step, world, micro, accum))]


@pytest.mark.parametrize("pack", [True, False])
def test_every_record_once_per_epoch_across_1_2_and_3_ranks_and_a_sampler_with_replacement_is_caught(
        tmp_path, monkeypatch, pack):
    records = make_records(45)
    folder = write_records(tmp_path / "d", records)
    wanted = sorted(expected_rows(records))
    source = record_source(folder, global_batch=6, pack=pack)
    for step in range(source.first_step(2)):  # the split does not change a step's rows
        base = global_rows(source, step, *SPLITS[0])
        for split in SPLITS[1:]:
            assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(global_rows(source, step, *split),
                                                                                      base)), (step, split)
    for epoch in range(2):
        for world, micro, accum in SPLITS:
            assert sorted(records_of_epoch(source, epoch, world, micro, accum)) == wanted, (epoch, world)
    for world in (1, 2, 3):  # other global batches lay the epochs out over other steps, each record still once
        other = record_source(folder, global_batch=2 * world, pack=pack)
        assert sorted(records_of_epoch(other, 1, world, 2, 1)) == wanted

    # planted: each epoch draws its records with replacement
    monkeypatch.setattr(packing, "epoch_order",
                        lambda seed, epoch, n: np.random.default_rng([seed, epoch]).integers(n, size=n))
    drawn = record_source(folder, global_batch=6, pack=pack)
    assert sorted(records_of_epoch(drawn, 0, 1, 6, 1)) != wanted
    monkeypatch.undo()
    # planted: each rank numbers its rows from 0, so the rows a rank reads depend on the world size
    real = BatchSchedule.batch

    def rank_local(self, step):
        rank, self.rank = self.rank, 0
        try:
            return real(self, step)
        finally:
            self.rank = rank

    monkeypatch.setattr(BatchSchedule, "batch", rank_local)
    assert sorted(records_of_epoch(source, 0, 1, 6, 1)) == wanted  # one rank cannot tell
    assert sorted(records_of_epoch(source, 0, 2, 3, 1)) != wanted


def test_the_order_depends_only_on_seed_and_epoch(tmp_path):
    folder = write_records(tmp_path / "d", make_records(45))

    def windows(source, epoch):  # the epoch's rows in order, whatever steps they are laid out over
        return [r for step in range(source.first_step(epoch), source.first_step(epoch + 1))
                for r in global_rows(source, step, 1, source.global_batch, 1)[0].tolist() if any(r)]

    a, b = record_source(folder, global_batch=4), record_source(folder, global_batch=7)
    assert windows(a, 1) == windows(b, 1)  # packing and order do not see the global batch
    assert windows(a, 0) != windows(a, 1)  # each epoch its own order
    assert windows(a, 1) != windows(record_source(folder, global_batch=4, seed=1), 1)
    assert windows(a, 3) == windows(record_source(folder, global_batch=4), 3)  # a fresh source, the same epoch


# (optimizer step a run starts at, its ranks x micro-batch x accumulation): 4, then 6, then 3 rows a step
RESIZES = [(0, (2, 2, 1)), (3, (3, 2, 1)), (5, (1, 1, 3))]


def resized_epochs(folder, pack, epochs=2):
    """Per epoch, the records a run trained on and those of the data steps a rollback skipped, as Counters: the run
    resumed at other global batches (RESIZES), each from the state_dict() of the schedule before it, with a guard
    rollback from step 6 to step 4 (data steps 4 and 5 skipped, never read)."""
    skips = skip_after_rollback([], 4, 6)
    assert [data_step(s, skips) for s in (3, 4, 5)] == [3, 6, 7]
    runs, schedule = [], None
    for start, (world, micro, accum) in RESIZES:
        source = record_source(folder, global_batch=world * micro * accum, pack=pack)
        resumed = BatchSchedule(source, micro_batch=micro, accum=accum, rank=0, world_size=world)
        if schedule:  # the checkpoint keeps the state_dict beside data_skips; a resume continues from its data step
            resumed.resume(json.loads(json.dumps(schedule.state_dict())), data_step(start, skips),
                           schedule.global_batch)
        runs.append((start, source, (world, micro, accum)))
        schedule = resumed
    assert schedule.state_dict() == {"data_layout": [[0, 4], [3, 6], [7, 3]]}
    trained, skipped = [Counter() for _ in range(epochs)], [Counter() for _ in range(epochs)]
    step = 0
    while data_step(step, skips) < source.first_step(epochs):
        _, source, split = [r for r in runs if r[0] <= step][-1]
        d = data_step(step, skips)
        trained[source.locate(d)[0]].update(row_records(*global_rows(source, d, *split)))
        step += 1
    for d in (4, 5):  # the rows the G = 6 run's steps would have read
        skipped[source.locate(d)[0]].update(row_records(*source.sequences(d, range(6))))
    return trained, skipped


@pytest.mark.parametrize("pack", [True, False])
def test_a_resume_at_another_global_batch_reads_on_where_the_run_stopped_and_rows_of_step_times_g_are_caught(
        tmp_path, monkeypatch, pack):
    """Resumed at 6 rows a step after 4, then at 3, mid-epoch: every record once per epoch, less those of the data
    steps a rollback skipped (never read); a run that never changes its batch keeps step k at rows k x G."""
    records = make_records(45)
    folder = write_records(tmp_path / "d", records)
    wanted = Counter(expected_rows(records))
    trained, skipped = resized_epochs(folder, pack)
    if pack:  # 21 windows an epoch: data step 4 ends epoch 0, step 5 begins epoch 1
        assert skipped[0] and skipped[1]
    else:  # rows 18-29 of epoch 0
        assert sum(skipped[0].values()) == 12 and not skipped[1]
    for epoch in range(2):
        assert trained[epoch] + skipped[epoch] == wanted, epoch

    one = record_source(folder, global_batch=4, pack=pack)  # no resize: step k of an epoch at rows 4k .. 4k + 3
    BatchSchedule(one, micro_batch=2, accum=1, rank=0, world_size=2).resume({}, 5, 4)  # a checkpoint without layout
    assert one.layout == [[0, 4]] and [one.step_rows(s)[1:] for s in range(3)] == [(0, 4), (4, 4), (8, 4)]

    # planted: a resumed run lays its steps out at its global batch from the first step on (step k at rows k x G)
    monkeypatch.setattr(RecordSource, "step_rows", epoch_jobs.step_times_batch(RecordSource.step_rows))
    trained, skipped = resized_epochs(folder, pack)
    assert any(wanted - trained[e] - skipped[e] for e in range(2))  # records never read in their epoch
    assert max(max(c.values()) for c in trained) > 1 or pack  # unpacked, rows 36-41 of epoch 0 also read twice


def parse(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]), environment=False)


def test_epochs_derive_the_steps_and_are_refused_with_steps_or_without_records(tmp_path, capsys):
    folder = write_records(tmp_path / "d", make_records(45))
    common = ["--data", str(folder), "--seq-len", "32", "--micro-batch", "3", "--nproc", "2"]
    cfg = parse(common + ["--epochs", "3"])
    source = record_source(folder, global_batch=6)
    assert cfg.loop.steps == source.first_step(3) == epoch_steps(cfg)
    assert cfg.optim.warmup_steps == max(1, cfg.loop.steps // 10)  # derived from the derived steps
    assert source.first_step(3) == sum(-(-source.rows_in_epoch(e) // 6) for e in range(3))  # a partial last step
    assert parse(common + ["--epochs", "3", "--no-pack"]).loop.steps == 3 * -(-45 // 6)
    for argv, says in [(common + ["--epochs", "2", "--steps", "9"], "--epochs 2 and --steps 9 both say how long"),
                       (["--data", "synthetic", "--epochs", "2"], "--epochs 2: --data synthetic is read as random "
                                                                  "windows, not records")]:
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


@pytest.mark.timeout(300)
def test_two_ranks_see_each_record_once_per_epoch_resumed_mid_epoch_bitwise_or_at_another_global_batch(tmp_path, capfd):
    records = make_records(80)
    folder = write_records(tmp_path / "d", records)
    cfg = tiny_config(tmp_path / "run", nproc=2, micro=2, accum=2, steps=1)
    cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len, cfg.loop.epochs = str(folder), 256, 32, 2
    cfg.loop.steps = epoch_steps(cfg)
    source = record_source(folder, global_batch=8)
    epoch_end = source.first_step(1)
    resume_at = epoch_end // 2  # inside the first epoch
    assert 0 < resume_at < epoch_end < cfg.loop.steps == source.first_step(2)
    cfg.checkpoint.every = resume_at
    resized = record_source(folder, global_batch=6)  # resumed at 2 ranks x micro 1 x accum 3, to the epoch's end
    resized.continue_layout([[0, 8]], resume_at)
    resized_steps, resized_out = resized.first_step(1), str(tmp_path / "resized")
    job = functools.partial(epoch_jobs.epochs_resume_job, resume_at=resume_at, resized_steps=resized_steps,
                            resized_out=resized_out)
    out = run_job(job, cfg, time_limit=120)
    printed = capfd.readouterr().out
    assert f"80 records, packed {80 / source.rows_in_epoch(0):.1f} per window of 32" in printed
    assert f"training steps 1-{cfg.loop.steps} (2 epochs)" in printed

    first, resumed, forgetful = out["first"], out["resumed"], out["forgetful"]
    wanted = sorted(expected_rows(records))
    for epoch in range(2):  # what the ranks trained on: each record once per epoch
        seen = [tuple(map(tuple, p)) for step in range(source.first_step(epoch), source.first_step(epoch + 1))
                for p in first["seen"][step]]
        assert sorted(seen) == wanted, epoch
    assert resumed["start"] == resume_at and len(first["losses"]) == cfg.loop.steps
    assert resumed["losses"] == first["losses"][resume_at:]  # exact, every step
    assert resumed["digests"] == first["digests"]
    assert all(resumed["seen"][s] == first["seen"][s] for s in range(resume_at, cfg.loop.steps))
    # planted: the resume forgets where the data was and starts the epoch's order over
    assert forgetful["seen"][0] == first["seen"][0] and forgetful["losses"] != first["losses"][resume_at:]
    assert forgetful["digests"] != first["digests"]
    # the memory plan counts the records' attention mask: the activations it plans are what the first step saved
    plan, unplanned = first["plan"], out["unplanned"]["plan"]
    assert plan["activations_measured"] == plan["rows"]["activations"]
    assert unplanned["activations_measured"] > unplanned["rows"]["activations"]  # planted: the mask left out

    # resumed mid-epoch at 6 rows a step after 8: each record of the epoch trained on once, over both runs
    other, step_times_g = out["other_batch"], out["step_times_g"]
    assert other["start"] == resume_at and set(other["epochs"].values()) == {1}
    assert Counter(epoch_records(first, other, resume_at, resized_steps)) == Counter(wanted)
    assert f"a global batch of 6 sequences instead of 8 reads the epoch on from the row where the checkpoint's run " \
           f"stopped" in printed and f"to step {resized_steps} (1 epoch)" in printed
    assert f"its 2 epochs end at step {resized.first_step(2)} (--steps {resized.first_step(2)} in place of " \
           "--epochs 2 ends there)" in printed  # --epochs counted the steps as if every step had had 6 rows
    layouts = [json.load(open(os.path.join(folder, checkpoint.step_name(step), "manifest.json")))["data_layout"]
               for folder, step in [(cfg.checkpoint.dir, resume_at), (resized_out, resized_steps)]]
    assert layouts == [[[0, 8]], [[0, 8], [resume_at, 6]]]
    # planted: the resumed run reads rows 6k .. 6k + 5 at step k, replaying rows the first run read at 8 a step
    replayed = Counter(epoch_records(first, step_times_g, resume_at, resized_steps))
    assert replayed != Counter(wanted) and max(replayed.values()) > 1


def epoch_records(first, resumed, resume_at, steps):
    """The records of epoch 1 the ranks trained on: the first run's before `resume_at`, the resumed run's after."""
    return [tuple(map(tuple, p)) for run, span in [(first, range(resume_at)), (resumed, range(resume_at, steps))]
            for step in span if run["epochs"][step] == 1 for p in run["seen"][step]]
