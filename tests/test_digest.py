"""tensor_digest: the on-device fingerprint behind the drift check catches every one-value change and swap."""

import pytest
import torch

from zerotrain.parallel.digest import K, digest_hex, moved, tensor_digest

N = 10_007  # prime, so small chunks leave a ragged last piece


def buffer(n=N, dtype=torch.float32, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def one_ulp_up(x, i):
    y = x.clone()
    y[i] = torch.nextafter(y[i], torch.tensor(float("inf"), dtype=x.dtype))
    return y


def plain_float_sum(x):
    """A planted weak digest: what a reader might write first. Blind to order."""
    return torch.stack([x.double().sum()])


def test_int64_multiply_and_sum_wrap_mod_2_64():
    # The digest's arithmetic is mod 2**64; torch's int64 ops must wrap, not saturate or raise.
    big = torch.full((1000,), 2**62 + 12345, dtype=torch.int64)
    assert big.sum().item() == 12345 * 1000  # 1000 * 2**62 = 250 * 2**64 wraps to 0
    assert (big * 4).eq(4 * 12345).all()
    assert (torch.tensor(5, dtype=torch.int64) * (2**63 - 1)).item() == 2**63 - 5


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_digest_equals_the_exact_integer_formula_for_any_chunk(chunk):
    x = buffer()
    bits = x.view(torch.int32).tolist()
    plain = sum(bits) % 2**64
    poly = sum(b * pow(K, i, 2**64) for i, b in enumerate(bits)) % 2**64
    assert [v % 2**64 for v in tensor_digest(x, chunk=chunk).tolist()] == [plain, poly]


def test_identical_buffers_give_identical_digests_on_any_thread_count():
    x = buffer(1 << 20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_digest(x.clone(), chunk=1 << 16)
        torch.set_num_threads(max(2, threads))
        many = tensor_digest(x.clone(), chunk=1 << 16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert not torch.equal(one, tensor_digest(buffer(1 << 20, seed=1), chunk=1 << 16))


def test_digest_is_a_few_int64_values_on_the_input_device():
    d = tensor_digest(buffer())
    assert d.dtype == torch.int64 and d.shape == (2,) and d.device == buffer().device
    assert len(digest_hex(d)) == 2 * 16 + 1
    if torch.cuda.is_available():
        g = buffer().cuda()
        assert tensor_digest(g).device == g.device
        assert torch.equal(tensor_digest(g).cpu(), d)


@pytest.mark.parametrize("i", [0, 1, 63, 64, 65, N // 2, N - 1])
def test_a_one_ulp_change_anywhere_changes_the_digest(i):
    x = buffer()
    y = one_ulp_up(x, i)
    assert not torch.equal(x, y) and (x.view(torch.int32) - y.view(torch.int32)).abs().sum() == 1
    for chunk in (64, 1 << 20):  # positions 63/64/65 straddle a piece boundary at chunk=64
        assert not torch.equal(tensor_digest(x, chunk=chunk), tensor_digest(y, chunk=chunk))


def test_zero_and_negative_zero_differ():
    x = torch.zeros(100)
    y = x.clone()
    y[37] = -0.0
    assert torch.equal(x, y)  # numerically equal: a float comparison would call them the same
    assert plain_float_sum(x).equal(plain_float_sum(y))  # and the planted float digest misses it
    assert not torch.equal(tensor_digest(x), tensor_digest(y))


@pytest.mark.parametrize("i, j", [(0, 1), (3, N - 1), (100, 164)])
def test_swapping_two_different_values_changes_the_digest_and_a_float_sum_would_miss_it(i, j):
    x = buffer()
    y = x.clone()
    y[i], y[j] = x[j], x[i]
    assert x[i] != x[j]
    assert plain_float_sum(x).equal(plain_float_sum(y))  # the planted weak digest is blind to the swap
    assert torch.equal(tensor_digest(x)[:1], tensor_digest(y)[:1])  # so is our own plain sum ...
    assert not torch.equal(tensor_digest(x), tensor_digest(y))  # ... the position-weighted sum is not


def test_the_same_values_at_other_positions_give_another_digest():
    x = buffer(200)
    assert not torch.equal(tensor_digest(x, [(0, 100)]), tensor_digest(torch.cat([x[100:], x[:100]]), [(100, 200)]))


def test_ulp_patterns_that_cancel_plain_and_linear_sums_are_caught():
    # +1, -2, +1 ulp on neighbours: zero plain sum and zero sum with linear odd weights 2i+1.
    x = torch.full((64,), 1.0)
    y = x.view(torch.int32).clone()
    y[10] += 1
    y[11] -= 2
    y[12] += 1
    y = y.view(torch.float32)

    def linear(t):  # the planted weaker digest: odd weights 2i+1 instead of powers of K
        return (t.view(torch.int32).to(torch.int64) * (2 * torch.arange(64) + 1)).sum()

    assert linear(x) == linear(y)
    assert not torch.equal(tensor_digest(x), tensor_digest(y))


def test_ranges_restrict_what_is_hashed():
    x = buffer()
    ranges = [(10, 500), (2000, 2100)]
    outside, inside = one_ulp_up(x, 700), one_ulp_up(x, 2050)
    assert torch.equal(tensor_digest(x, ranges), tensor_digest(outside, ranges))
    assert not torch.equal(tensor_digest(x, ranges), tensor_digest(inside, ranges))
    assert not torch.equal(tensor_digest(x), tensor_digest(outside))  # the whole buffer does see it
    # pieces of the whole are the whole: range [lo, hi) hashes what None hashes there
    assert torch.equal(tensor_digest(x, [(0, 5000), (5000, N)], chunk=333), tensor_digest(x, chunk=333))


def test_bf16_buffers_are_digested_by_their_16_bit_patterns():
    x = buffer(dtype=torch.bfloat16)
    d = tensor_digest(x)
    assert d.dtype == torch.int64 and d.shape == (2,)
    assert torch.equal(d, tensor_digest(x.clone()))
    assert not torch.equal(tensor_digest(x, chunk=64), tensor_digest(one_ulp_up(x, N // 3), chunk=64))
    y = x.clone()
    y[5], y[9] = x[9], x[5]
    assert x[5] != x[9] and not torch.equal(d, tensor_digest(y))


def test_bad_inputs_are_messages_that_name_the_value():
    with pytest.raises(ValueError, match="1-D"):
        tensor_digest(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"\[5, 20\) is outside the buffer of 10"):
        tensor_digest(torch.zeros(10), [(5, 20)])


def test_chunk_digests_moved_to_where_they_lie_add_up_to_the_whole_buffers_and_a_wrong_offset_is_caught():
    # ZeRO-3's invariant (b): each rank digests its owned chunks where they sit in its shard, moves them to where they
    # lie in the flat buffer, and the DP group's sum is the digest of the buffer a gather would make.
    flat = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    chunks = [(0, 700), (700, 1500), (1500, 3000)]
    shards = [flat[lo:hi].clone() for lo, hi in chunks]  # each at position 0 of its own shard
    total = sum(moved(tensor_digest(shard), lo) for shard, (lo, _) in zip(shards, chunks))
    assert torch.equal(total, tensor_digest(flat))
    assert torch.equal(moved(tensor_digest(flat, [(5, 9)]), 0), tensor_digest(flat, [(5, 9)]))
    # planted: a chunk moved one position short (its values' order within the buffer would not be seen)
    wrong = sum(moved(tensor_digest(shard), lo - (i == 1)) for i, (shard, (lo, _)) in enumerate(zip(shards, chunks)))
    assert not torch.equal(wrong, tensor_digest(flat))
