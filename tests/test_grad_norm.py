"""The gradient norm: chunks' fp32 sums of squares summed exactly, within float rounding of a float64 norm, and the same
bits at every world size (and device), in the engine's own reduce_grads too; a chunking per rank is caught."""

import math

import pytest
import torch
from conftest import tiny_config

from zerotrain.config import ModelConfig
from zerotrain.model import build_model, is_decayed
from zerotrain.parallel import ShardLayout, grad_norm
from zerotrain.runtime.launch import run_job

MODEL = build_model(ModelConfig(n_layer=2, n_head=4, n_embd=64, seq_len=32, vocab_size=500), 0)
PARAMS = [(n, tuple(p.shape), is_decayed(n, p)) for n, p in MODEL.named_parameters()]
BUCKET_NUMELS = [3000, 10**9]  # many buckets (parameters wider than one), and one
WORLD_SIZES = [1, 2, 3, 4, 5]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # scripts/device-check.sh runs the CUDA case


def gradients(seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of every parameter, their scales spread over seven orders of magnitude, as a model's are."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-5, 3, (1,), generator=g))
            for name, shape, _ in PARAMS}


def world_norm(grads: dict[str, torch.Tensor], world_size: int, bucket_numel: int, device: str = "cpu") -> float:
    """The norm ZeroEngine.reduce_grads computes at `world_size` ranks of reduced gradients `grads`: each rank's part
    from its shard of the layout, the parts summed as the step's all-reduce sums them."""
    layout = ShardLayout.build(PARAMS, world_size, bucket_numel)
    flat = torch.zeros(layout.padded_numel, device=device)
    for s in layout.slots:
        flat[s.offset : s.offset + s.numel] = grads[s.name].reshape(-1)
    parts = [grad_norm.exact_sum_limbs(grad_norm.chunk_squares(layout.shard(flat, r), [(0, layout.shard_numel)]))
             for r in range(world_size)]
    return float(grad_norm.norm_tensor(torch.stack(parts).sum(0)))


def test_the_chunked_norm_is_a_float64_norm_to_float_rounding():
    grads = gradients()
    reference = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]), dtype=torch.float64)
    for bucket_numel in BUCKET_NUMELS:
        assert abs(world_norm(grads, 1, bucket_numel) / reference.item() - 1) < 1e-6  # measured: 1.3e-9
    # planted: the norm of the gradients rounded to bf16 (as if taken of a bf16 copy), in the engine's own function
    real = grad_norm.chunk_squares
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grad_norm, "chunk_squares", lambda shard, ranges: real(shard.bfloat16().float(), ranges))
        assert abs(world_norm(grads, 1, BUCKET_NUMELS[0]) / reference.item() - 1) > 1e-6


def test_non_finite_gradients_give_a_non_finite_norm():
    grads = gradients()
    name = PARAMS[3][0]
    grads[name].view(-1)[7] = float("inf")
    assert world_norm(grads, 2, BUCKET_NUMELS[0]) == float("inf")
    grads[name].view(-1)[7] = float("nan")
    assert math.isnan(world_norm(grads, 3, BUCKET_NUMELS[0]))


def per_rank_chunks(shard, ranges):
    """Planted: each rank chunks its own ranges into four equal pieces, wherever the world size puts them."""
    return [piece.view(1, -1) for a, z in ranges for piece in shard[a:z].chunk(4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bucket_numel", BUCKET_NUMELS)
def test_the_norm_is_bitwise_the_same_at_every_world_size_and_a_per_rank_chunking_is_caught(bucket_numel, device,
                                                                                           monkeypatch):
    grads = gradients(1)
    norms = {w: world_norm(grads, w, bucket_numel, device) for w in WORLD_SIZES}
    assert len(set(norms.values())) == 1, norms
    assert norms[1] == world_norm(grads, 1, bucket_numel, "cpu")  # and on every device (elementwise adds only)
    monkeypatch.setattr(grad_norm, "norm_chunks", per_rank_chunks)
    planted = {w: world_norm(grads, w, bucket_numel, device) for w in WORLD_SIZES}
    assert len(set(planted.values())) > 1, planted


def engine_norm_job(cfg, comm) -> float:
    """The norm reduce_grads returns for the same reduced gradients at this job's world size: rank 0's local
    gradients are the test's, the others' zero, so the reduce-scatter's sums are exactly them."""
    from zerotrain.training.loop import build_engine

    engine = build_engine(cfg, comm)
    grads = gradients(2)
    engine.zero_grad()
    for s, p in zip(engine.layout.slots, engine.params):  # as backward leaves them: .grad set, the engine's hook run
        p.grad = grads[s.name].clone() if comm.rank == 0 else torch.zeros_like(grads[s.name])
        engine.grads._on_grad_ready(p)
    norm, _ = engine.reduce_grads(torch.zeros(0))
    return float(norm)  # 0-d, on the device: read here


def per_rank_chunks_norm_job(cfg, comm) -> float:
    """engine_norm_job with the planted per-rank chunking in this rank's engine."""
    grad_norm.norm_chunks = per_rank_chunks
    return engine_norm_job(cfg, comm)


def test_the_engine_reduces_the_same_norm_bits_on_one_two_and_three_ranks(tmp_path):
    cfgs = {n: tiny_config(tmp_path / str(n), nproc=n, threads=1, n_embd=64, vocab_size=500, seq_len=32)
            for n in (1, 2, 3)}
    honest = {n: run_job(engine_norm_job, cfg, time_limit=120) for n, cfg in cfgs.items()}
    assert len(set(honest.values())) == 1, honest
    # the in-process account above is the engine's, to the bit
    assert honest[1] == world_norm(gradients(2), 1, cfgs[1].parallel.bucket_numel)
    planted = {n: run_job(per_rank_chunks_norm_job, cfg, time_limit=120) for n, cfg in cfgs.items()}
    assert len(set(planted.values())) > 1, planted


@pytest.mark.parametrize("bucket_numel", BUCKET_NUMELS)
def test_one_ranks_norm_of_the_parameters_own_gradients_is_the_flat_buffers_bits_and_another_grid_is_caught(
        bucket_numel, monkeypatch):
    """One rank reads each parameter's gradient where autograd left it (engine.grads_in_params): the rows that span
    two parameters, or padding, are put together from their parts. Its limbs must be the flat buffer's, bit for bit.
    Planted: the parts put in rows of another width."""
    grads = gradients(3)
    layout = ShardLayout.build(PARAMS, 1, bucket_numel)
    pieces = [(s.offset, grads[s.name].reshape(-1)) for s in layout.slots]
    assert any(s.offset % grad_norm.NORM_CHUNK for s in layout.slots)  # rows that span parameters
    flat = torch.zeros(layout.padded_numel)
    for offset, g in pieces:
        flat[offset : offset + g.numel()] = g
    expected = grad_norm.exact_sum_limbs(grad_norm.chunk_squares(flat, [(0, layout.padded_numel)]))
    assert torch.equal(grad_norm.exact_sum_limbs(grad_norm.scattered_chunk_squares(pieces)), expected)
    assert float(grad_norm.norm_tensor(expected)) == world_norm(grads, 2, bucket_numel)
    monkeypatch.setattr(grad_norm, "NORM_CHUNK", grad_norm.NORM_CHUNK // 2)
    assert not torch.equal(grad_norm.exact_sum_limbs(grad_norm.scattered_chunk_squares(pieces)), expected)


def test_one_ranks_norm_squares_every_gradient_in_one_kept_block_and_a_block_per_tensor_is_caught(monkeypatch):
    """scattered_chunk_squares reads every parameter's gradient where it is through one scratch block, grown as needed
    and kept (a fresh block per tensor was fresh memory to fault in, every step); the bits are the flat buffer's.
    Planted: a block allocated for every tensor."""
    grads = gradients(4)
    layout = ShardLayout.build(PARAMS, 1, BUCKET_NUMELS[1])
    pieces = [(s.offset, grads[s.name].reshape(-1)) for s in layout.slots]
    expected = grad_norm.scattered_chunk_squares(pieces)
    allocated = []
    real_empty = torch.empty

    def counted_empty(*args, **kwargs):
        allocated.append(args)
        return real_empty(*args, **kwargs)

    def blocks_allocated() -> int:
        allocated.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grad_norm.torch, "empty", counted_empty)
            assert torch.equal(grad_norm.scattered_chunk_squares(pieces), expected)
        return len(allocated)

    whole_rows = sum(1 for o, g in pieces if len(set(grad_norm.grid_cut(o, o + g.numel()))) == 2)  # squared in place
    sizes = [min(grad_norm.BLOCK_VALUES[False], g.numel()) for _, g in pieces]
    grown = sum(1 for i, n in enumerate(sizes) if n > max(sizes[:i], default=0))  # a tensor larger than any before
    assert blocks_allocated() <= grown < whole_rows
    real_take = grad_norm.Scratch.take
    monkeypatch.setattr(grad_norm.Scratch, "take", lambda self, numel, device: (
        setattr(self, "block", None), real_take(self, numel, device))[1])  # planted: a fresh block every time
    assert blocks_allocated() >= whole_rows


def python_exact_sum(squares: torch.Tensor) -> float:
    """The exact sum of float64 `squares` (each 0 or a normal float64), rounded once: with Python's integers, as the
    host computed it before the device did (a read a step)."""
    m, e = torch.frexp(squares)
    return sum(int(x) << int(k - grad_norm.E_MIN) for x, k in zip((m * 2.0**53).long().tolist(), e.tolist()) if x) \
        / 2 ** (53 - grad_norm.E_MIN)


def test_the_device_rounds_the_exact_sum_once_as_pythons_integers_do_and_a_dropped_carry_is_caught(monkeypatch):
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g, dtype=torch.float64)
              * 10.0 ** int(torch.randint(-30, 30, (1,), generator=g))).float().double() ** 2 for _ in range(60)]
    # sums whose rounding is a tie, or one bit past it far below the top limbs (the sticky quarter decides)
    cases += [torch.tensor([2.0**60, 2.0**8, 2.0**-200], dtype=torch.float64),
              torch.tensor([2.0**60, 2.0**8], dtype=torch.float64), torch.tensor([2.0**60, 3 * 2.0**8], dtype=torch.float64)]

    def world_sum(v: torch.Tensor, ranks: int) -> float:
        return float(grad_norm.exact_sum(torch.stack([grad_norm.exact_sum_limbs(c) for c in v.chunk(ranks)]).sum(0)))

    for v in cases:
        assert world_sum(v, 1) == world_sum(v, 3) == python_exact_sum(v)
    monkeypatch.setattr(grad_norm, "_carry", lambda limbs: limbs & (2**32 - 1))  # planted: the carries dropped
    assert any(world_sum(v, 3) != python_exact_sum(v) for v in cases)
