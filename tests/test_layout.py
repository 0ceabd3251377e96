"""ShardLayout: padding, buckets and owned ranges for any world size, including ones that divide nothing."""

import pytest

from zerotrain.config import ModelConfig
from zerotrain.model import build_model, is_decayed
from zerotrain.parallel import ShardLayout
from zerotrain.parallel.layout import NORM_CHUNK

PARAMS = [(n, tuple(p.shape), is_decayed(n, p))
          for n, p in build_model(ModelConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=64), 0).named_parameters()]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("bucket_numel", [1, 1000, 10_000, 10**9])
def test_owned_ranges_partition_the_padded_buffer(world_size, bucket_numel):
    layout = ShardLayout.build(PARAMS, world_size, bucket_numel)
    assert layout.numel == 28_032
    assert layout.padded_numel % world_size == 0
    # padding is the least that gives every rank whole chunks of the gradient norm's grid in every bucket
    assert all(b.chunk_numel(world_size) % NORM_CHUNK == 0 for b in layout.buckets)
    assert layout.padded_numel - layout.numel < world_size * NORM_CHUNK * len(layout.buckets)
    covered = sorted(r for rank in range(world_size) for r in layout.owned_ranges(rank))
    assert covered[0][0] == 0 and covered[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # disjoint and gap-free
    for rank in range(world_size):
        assert sum(hi - lo for lo, hi in layout.owned_ranges(rank)) == layout.shard_numel


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_every_parameter_sits_inside_one_bucket_in_reverse_model_order(world_size):
    layout = ShardLayout.build(PARAMS, world_size, 3000)
    for s in layout.slots:
        b = layout.buckets[s.bucket]
        assert b.start <= s.offset and s.offset + s.numel <= b.end
        assert (s.offset < b.decay_end) == s.decay  # decayed params first within the bucket
    buckets_in_model_order = [s.bucket for s in sorted(layout.slots, key=lambda s: [n for n, _, _ in PARAMS].index(s.name))]
    assert buckets_in_model_order == sorted(buckets_in_model_order, reverse=True)  # last layers fill first
    offsets = sorted((s.flat_offset, s.numel) for s in layout.slots)
    assert all(a[0] + a[1] == b[0] for a, b in zip(offsets, offsets[1:]))  # unpadded order is dense


def test_layout_survives_a_json_round_trip():
    layout = ShardLayout.build(PARAMS, 3, 3000)
    again = ShardLayout.from_dict(layout.to_dict())
    assert again.to_dict() == layout.to_dict()


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_shards_assemble_back_into_the_flat_buffer(world_size):
    import torch

    layout = ShardLayout.build(PARAMS, world_size, 3000)
    flat = torch.arange(layout.padded_numel, dtype=torch.float32)
    shards = [layout.shard(flat, r) for r in range(world_size)]
    assert all(s.numel() == layout.shard_numel for s in shards)
    assert torch.equal(layout.assemble(shards), flat)
    shards[-1][0] += 1  # planted bug: a wrong value in one shard shows up in the assembled buffer
    assert not torch.equal(layout.assemble(shards), flat)
