"""The batch schedule: the global batch of a step depends only on (seed, step), never on the split."""

import numpy as np
import pytest
import torch

from zerotrain.config import Config, ConfigError
from zerotrain.data import IGNORE, check_source, BatchSchedule, SyntheticSource, TextSource, make_source


def global_batch(source, step, world, micro, accum):
    xs, ys, counts = [], [], set()
    for rank in range(world):
        batch = BatchSchedule(source, micro_batch=micro, accum=accum, rank=rank, world_size=world).batch(step)
        counts.add(batch.global_tokens)
        for x, y in batch.micro_batches:
            assert x.shape == (micro, source.seq_len)
            xs.append(x)
            ys.append(y)
    assert len(counts) == 1  # every rank agrees on the global token count
    return torch.cat(xs), torch.cat(ys), counts.pop()


@pytest.mark.parametrize("varlen", [False, True])
def test_split_over_ranks_and_micro_batches_does_not_change_the_global_batch(varlen):
    source = SyntheticSource(64, 16, seed=1, varlen=varlen)
    x1, y1, n1 = global_batch(source, 3, 1, 8, 1)
    for world, micro, accum in [(2, 4, 1), (2, 2, 2), (4, 1, 2)]:
        x, y, n = global_batch(source, 3, world, micro, accum)
        assert torch.equal(x, x1) and torch.equal(y, y1) and n == n1
    assert n1 == int((y1 != IGNORE).sum())
    x_other, _, _ = global_batch(source, 4, 1, 8, 1)
    assert not torch.equal(x_other, x1)  # another step is another batch


def test_varlen_batches_mask_padding_and_vary_in_real_tokens():
    source = SyntheticSource(64, 16, seed=0, varlen=True)
    x, y = source.sequences(0, range(32))
    real = (y != IGNORE).sum(dim=1)
    assert real.min() >= 1 and real.max() <= 16 and len(set(real.tolist())) > 4
    for row in range(32):
        n = int(real[row])
        assert torch.equal(y[row, :n], x[row, 1 : n + 1]) if n < 16 else True
        assert (y[row, n:] == IGNORE).all()


def test_synthetic_data_follows_its_markov_chain():
    source = SyntheticSource(64, 16, seed=0)
    x, y = source.sequences(0, range(64))
    follows = (torch.from_numpy(source.perm)[x] == y).float().mean().item()
    assert 0.75 < follows < 0.9  # 80% chain + 20% noise (which can hit the chain by chance)


def test_text_source_packed_and_unpacked(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"first document here\n\nsecond one\n\n\nthird and last document")
    packed = TextSource(str(path), 8, seed=0)
    x, y = packed.sequences(0, range(4))
    data = np.fromfile(path, dtype=np.uint8)
    for row in range(4):
        window = bytes(x[row].tolist()) + bytes([int(y[row, -1])])
        assert window in bytes(data)
    docs = TextSource(str(path), 32, seed=0, pack=False)
    assert len(docs.docs) == 3
    x, y = docs.sequences(0, range(6))
    assert docs.token_count(0, 6) == int((y != IGNORE).sum())


def test_bad_data_is_a_config_error(tmp_path):
    cfg = Config()
    cfg.data.source = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="missing.txt: no such file"):
        check_source(cfg)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    cfg.data.source, cfg.model.vocab_size = str(short), 256
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        check_source(cfg)
    assert make_source(Config()).vocab_size == 64
