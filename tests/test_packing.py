"""Document-masked packing: whole records in windows with segment ids; a packed step equals each record run alone."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import tiny_config

from zerotrain.config import apply_preset
from zerotrain.data import IGNORE, BatchSchedule, RecordSource, make_source
from zerotrain.data import packing
from zerotrain.data.packing import best_fit, file_records
from zerotrain.data.tokenfiles import open_token_file, write_llmc
from zerotrain.errors import ConfigError
from zerotrain.model import build_model, summed_token_loss
from zerotrain.training import objectives
from zerotrain.training.loop import accumulate_gradients, build_engine

SEQ = 32  # window positions


def make_records(n=40, seed=0):
    """(prompt, completion) pairs of varied lengths, each told apart by its number."""
    rng = np.random.default_rng(seed)
    return [(f"Q{i}:" + "p" * int(rng.integers(0, 5)), f" a{i}" + "c" * int(rng.integers(0, 8))) for i in range(n)]


def write_records(folder, records, index=True):
    """A token folder as JSON Lines preparation writes it: bytes (end-of-text 0), a loss mask, a record index."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens, mask, offsets = [], [], [0]
    for prompt, completion in records:
        context, target = list(prompt.encode()), list(completion.encode()) + [0]
        tokens += context + target
        mask += [0] * len(context) + [1] * len(target)
        offsets.append(len(tokens))
    write_llmc(str(folder / "train.bin"), tokens, vocab_size=256)
    (folder / "train.mask").write_bytes(bytes(mask))
    if index:
        np.array(offsets, dtype="<u8").tofile(folder / "train.records")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 256, "eot_id": 0}))
    return folder


def record_source(folder, global_batch=6, pack=True, seq_len=SEQ, seed=0, truncate=True):
    files = [open_token_file(str(folder / "train.bin"))]
    return RecordSource(files, file_records(files, eot_id=0), seq_len, seed, 256, global_batch=global_batch,
                        pack=pack, truncate=truncate)


def pieces(mb: torch.Tensor, row: int):
    """(segment id, its positions) of one packed row, in order."""
    seg = mb.segments[row]
    return [(int(s), torch.nonzero(seg == s).view(-1)) for s in torch.unique_consecutive(seg)]


def expected_rows(records, seq_len=SEQ):
    """Per record: (inputs, labels) as the record run alone trains on them (its first seq_len + 1 tokens)."""
    out = []
    for prompt, completion in records:
        context, target = list(prompt.encode()), list(completion.encode()) + [0]
        tokens = (context + target)[: seq_len + 1]
        labels = [t if i + 1 >= len(context) else IGNORE for i, t in enumerate(tokens[1:])]
        out.append((tuple(tokens[:-1]), tuple(labels)))
    return out


def epoch_pieces(source, epoch):
    """Every record piece of `epoch`'s rows as (inputs, labels), checking each row's layout on the way."""
    found = []
    for step in range(source.first_step(epoch), source.first_step(epoch + 1)):
        mb = source.sequences(step, range(source.global_batch))
        for row in range(source.global_batch):
            seg = mb.segments[row]
            assert (seg[1:] >= seg[:-1]).all()  # ids non-decreasing along the window
            for n, (s, at) in enumerate(pieces(mb, row)):
                assert s == n and torch.equal(at, torch.arange(int(at[0]), int(at[0]) + len(at)))  # in order, whole
                if (mb.labels[row, at] == IGNORE).all():  # the padding: last, an id of its own, no tokens
                    assert n == len(pieces(mb, row)) - 1 and (mb.inputs[row, at] == 0).all()
                    continue
                found.append((tuple(mb.inputs[row, at].tolist()), tuple(mb.labels[row, at].tolist())))
    return found


def test_a_window_holds_whole_records_from_their_first_token_each_with_its_segment(tmp_path, monkeypatch):
    records = make_records()
    long = ("Q-long:", " " + "z" * 60)  # longer than the window: its first SEQ + 1 tokens train
    prompt_only = ("Q-prompt:" + "p" * 40, " lost")  # its completion falls past the window: nothing to train
    folder = write_records(tmp_path / "d", records + [long, prompt_only])
    source = record_source(folder)
    assert (source.truncated, source.left_out, len(source.records)) == (1, 1, 41)
    wanted = expected_rows(records + [long])
    for epoch in range(2):
        found = epoch_pieces(source, epoch)
        assert sorted(found) == sorted(wanted)  # each record once, whole, from its first token, prompt masked
    rows = source.rows_in_epoch(0)
    assert len(source.records) / rows > 1.5  # windows hold several records
    assert "41 records" in source.describe() and "1 longer than the window (--seq-len 32 + 1 tokens), truncated" in \
        source.describe() and "1 with no trained token in the window, left out" in source.describe()
    mb = source.sequences(0, range(6))
    assert int((mb.labels != IGNORE).sum()) == source.token_count(0, 6)

    # planted: the record index read one token late, so each record starts at its second token
    real = packing._read_offsets
    monkeypatch.setattr(packing, "_read_offsets", lambda path, n: np.minimum(real(path, n) + 1, n))
    assert sorted(epoch_pieces(record_source(folder), 0)) != sorted(wanted)


def test_the_record_index_and_the_end_of_text_scan_agree_and_a_damaged_index_is_refused(tmp_path):
    records = make_records(12)
    indexed, scanned = write_records(tmp_path / "i", records), write_records(tmp_path / "s", records, index=False)
    by_index = file_records([open_token_file(str(indexed / "train.bin"))], eot_id=None)
    assert np.array_equal(by_index, file_records([open_token_file(str(scanned / "train.bin"))], eot_id=0))
    with pytest.raises(ConfigError, match="no record index"):
        file_records([open_token_file(str(scanned / "train.bin"))], eot_id=None)
    np.array([0, 5, 3], dtype="<u8").tofile(indexed / "train.records")
    with pytest.raises(ConfigError, match="train.records: not a record index of its"):
        file_records([open_token_file(str(indexed / "train.bin"))], eot_id=0)


def test_best_fit_places_each_item_once_within_the_capacity():
    costs = np.random.default_rng(1).integers(1, 33, 500)
    window = best_fit(costs, 32)
    load = np.bincount(window)
    assert load.min() > 0 and (np.bincount(window, weights=costs) <= 32).all()
    assert len(load) < 0.75 * len(costs)  # far fewer windows than items
    assert np.array_equal(window, best_fit(costs, 32))


def test_no_pack_rows_are_one_record_each_without_segments(tmp_path):
    records = make_records(10)
    source = record_source(write_records(tmp_path / "d", records), global_batch=4, pack=False)
    rows = []
    for step in range(source.first_step(0), source.first_step(1)):
        mb = source.sequences(step, range(4))
        assert mb.segments is None
        for row in range(4):
            n = int((mb.inputs[row] != 0).sum())
            if n:
                rows.append((tuple(mb.inputs[row, :n].tolist()), tuple(mb.labels[row, :n].tolist())))
            else:  # the epoch's last step: 10 records in 3 steps of 4 rows
                assert (mb.labels[row] == IGNORE).all() and step == 2
    assert sorted(rows) == sorted(expected_rows(records))


# ---------------------------------------------------------------- through the loop, with the model
def packed_config(tmp_path, folder, arch):
    cfg = tiny_config(tmp_path, micro=3, accum=2)
    if arch == "llama":
        apply_preset(cfg, "llama-tiny")
    cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len = str(folder), 256, SEQ
    return cfg


def alone(model, batch):
    """Every record of the step's micro-batches as a row of its own: (summed token losses per record, their sum),
    backward with the step's global token count."""
    losses = []
    for mb in batch.micro_batches:
        for row in range(mb.inputs.shape[0]):
            for s, at in pieces(mb, row):
                if (mb.labels[row, at] == IGNORE).all():
                    continue  # padding, or an empty row
                loss = summed_token_loss(model(mb.inputs[row, at][None]), mb.labels[row, at][None])
                (loss / batch.global_tokens).backward()
                losses.append(loss.detach())
    return losses


def max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_packed_step_equals_each_record_run_alone_and_a_cross_record_leak_is_caught(tmp_path, one_rank, arch):
    folder = write_records(tmp_path / "d", make_records(30))
    cfg = packed_config(tmp_path, folder, arch)
    engine = build_engine(cfg, one_rank)
    schedule = BatchSchedule(make_source(cfg), micro_batch=3, accum=2, rank=0, world_size=1)
    batch = schedule.batch(0)
    assert max(int(mb.segments.max()) for mb in batch.micro_batches) >= 2  # rows of several records
    engine.zero_grad()
    packed_loss = float(accumulate_gradients(engine, batch))
    packed = {n: p.grad.clone() for n, p in engine.model.named_parameters()}

    reference = build_model(cfg.model, cfg.loop.seed)
    each = alone(reference, batch)
    ref = {n: p.grad for n, p in reference.named_parameters()}
    assert abs(packed_loss - float(sum(each))) <= 1e-5 * float(sum(each))
    assert max_rel(packed, ref) <= 1e-5
    # per record: the packed forward's token losses of each segment against the record alone
    with torch.no_grad():
        for mb in batch.micro_batches:
            logits = engine.model(mb.inputs, segments=mb.segments)
            token = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), mb.labels, ignore_index=IGNORE,
                                                      reduction="none")
            for row in range(mb.inputs.shape[0]):
                for s, at in pieces(mb, row):
                    if (mb.labels[row, at] != IGNORE).any():
                        alone_loss = summed_token_loss(reference(mb.inputs[row, at][None]), mb.labels[row, at][None])
                        assert abs(float(token[row, at].sum() - alone_loss)) <= 1e-5 * float(alone_loss)

    # planted: the loop forgets the segments, so each record attends to the records before it in its window
    real = objectives.head_loss
    with mock.patch.object(objectives, "head_loss", lambda *a, segments=None: real(*a)):
        engine.zero_grad()
        leaked_loss = float(accumulate_gradients(engine, batch))
    leaked = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    # a random model's loss barely sees its context; its gradients do
    assert leaked_loss != packed_loss and max_rel(leaked, ref) > 1e-2, max_rel(leaked, ref)
