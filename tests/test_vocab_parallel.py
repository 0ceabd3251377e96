"""The vocabulary split across TP and the loss computed from the head's input in chunks (model/vocab.py): the same
loss and gradients as the plain loss on full logits and as TP 1, a largest activation that halves with TP 2, and
planted bugs (a dropped chunk, a missing all-reduce, a vocabulary left whole) caught."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from test_checkpoint import spawn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import build_model, gpt2, parallelize, summed_token_loss, vocab
from zerotrain.model.activation_memory import activation_bytes
from zerotrain.model.generate import generate
from zerotrain.model.loss import head_loss
from zerotrain.training.activations import saved_storages

pytestmark = pytest.mark.timeout(300)

CONFIGS = {"gpt2": ModelConfig(**PRESETS["tiny"]),  # tied head, vocabulary 64
           "llama": dataclasses.replace(ModelConfig(**PRESETS["llama-tiny"]), tie_embeddings=False)}
# A vocabulary of 32,000 (Llama 2's, Mistral's first) on a model small enough that the head is its largest part.
LARGE_VOCAB = dataclasses.replace(ModelConfig(**PRESETS["tiny"]), n_layer=1, vocab_size=32_000)
B, T = 2, 16
SMALL_CHUNKS = 5  # tokens per chunk in the tests that cut the micro-batch into several chunks (the last one shorter)


def batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    y[0, :3] = -100  # tokens not trained on (a prompt's)
    return x, y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|: per tensor."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def loss_and_grads(model, x, y, plain: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = summed_token_loss(model(x), y) if plain else head_loss(model, x, y, summed_token_loss, False)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- one rank: chunks


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_chunked_loss_equals_the_plain_loss_and_its_gradients_and_a_dropped_chunk_is_caught(arch, monkeypatch):
    cfg = CONFIGS[arch]
    x, y = batch(cfg)
    model = build_model(cfg, seed=0)
    plain, plain_grads = loss_and_grads(model, x, y, plain=True)
    assert vocab.chunk_tokens(B * T, cfg.vocab_size, 4) == B * T  # below MIN_CHUNK_TOKENS: one chunk
    # Llama-3-8B, 1 x 8192 tokens in bf16 (6 bytes a logit): chunks whose logits fit in LOSS_CHUNK_BYTES (512 MiB),
    # at TP 1 and TP 8; in fp32 (4 bytes) twice as many tokens; Gemma 2's 256,000 soft-capped rows at the floor
    bf16 = vocab.loss_logit_bytes(2, False)
    assert vocab.chunk_tokens(8192, 128_256, bf16) == 512 and vocab.chunk_tokens(8192, 128_256 // 8, bf16) == 4096
    assert vocab.chunk_tokens(8192, 128_256, vocab.loss_logit_bytes(4, False)) == 1024
    assert vocab.chunk_tokens(8192, 256_000, vocab.loss_logit_bytes(2, True)) == vocab.MIN_CHUNK_TOKENS
    monkeypatch.setattr(vocab, "chunk_tokens", lambda tokens, rows, logit_bytes: SMALL_CHUNKS)  # 7, the last of 2
    chunked, grads = loss_and_grads(model, x, y)
    assert abs(chunked - plain) <= 1e-6 * abs(plain)
    assert max(rel(grads[n], plain_grads[n]) for n in grads) <= 1e-6
    with torch.no_grad():  # evaluation: the same loss, no gradients computed
        assert abs(head_loss(model, x, y, summed_token_loss, False).item() - plain) <= 1e-6 * abs(plain)
    # planted: the last chunk's tokens are never counted
    cut = vocab.chunk_bounds
    monkeypatch.setattr(vocab, "chunk_bounds", lambda tokens, chunk: cut(tokens, chunk)[:-1])
    dropped, _ = loss_and_grads(model, x, y)
    assert abs(dropped - plain) > 1e-3 * abs(plain)


# One block of width 16, a vocabulary of 1,000 and 2 x 1,024 tokens: several chunks at a small budget.
BUDGET_MODEL = dataclasses.replace(ModelConfig(**PRESETS["tiny"]), n_layer=1, n_embd=16, vocab_size=1000,
                                   seq_len=1024)


def chunk_logits_made(run) -> list[int]:
    """The tokens of each chunk's logits the head's matmul makes while `run()` runs (its (tokens, rows) products:
    the counter of what the loss holds at once), forward and backward."""
    made = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and \
                    out.shape[-1] == BUDGET_MODEL.vocab_size:
                made.append(out.shape[0])
            return out

    with Products():
        run()
    return made


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_loss_chunk_follows_the_memory_budget_the_plan_counts_and_an_oversized_chunk_is_caught(precision,
                                                                                                  monkeypatch):
    """The loss's chunk is the largest power of two of tokens whose logits (this rank's rows, the bytes each holds)
    fit in vocab.LOSS_CHUNK_BYTES, and the plan's loss working set (activation_bytes' `working`) is what those
    chunks hold, by the chunks the run's matmuls make. Planted: the run's path ignores the budget (one chunk of
    every token), which the plan, sized by the budget, does not foresee."""
    cfg, (b, t), dtype = BUDGET_MODEL, (2, 1024), {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    rows, per_logit = cfg.vocab_size, vocab.loss_logit_bytes(dtype.itemsize, False)
    # room for 1.5 x 256 tokens' logits: chunks of 256 (a power of two), 8 of them over the 2,048 tokens
    monkeypatch.setattr(vocab, "LOSS_CHUNK_BYTES", 384 * rows * per_logit)
    ids = torch.randint(0, rows, (b, t + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    model = build_model(cfg, seed=0).to(dtype)

    def measured() -> tuple[list[int], float]:
        model.zero_grad(set_to_none=True)
        losses = []
        made = chunk_logits_made(lambda: losses.append(head_loss(model, x, y, summed_token_loss, False)) or
                                 losses[0].backward())
        return made, losses[0].item()

    def working(made: list[int]) -> int:
        """What the chunks made hold at once: the largest one's logits, and over several in bf16 the weight
        gradient's fp32 sum (rows x width)."""
        summed = rows * cfg.n_embd * 4 if len(made) > 1 and dtype != torch.float32 else 0
        return max(made) * rows * per_logit + summed

    made, loss = measured()
    assert made == [256] * 8  # the budget's chunks, in the forward (their gradients taken in the same pass)
    plan = activation_bytes(cfg, b, t, precision=precision)["working"]
    assert plan == working(made) and max(made) * rows * per_logit <= vocab.LOSS_CHUNK_BYTES
    plain = summed_token_loss(model(x), y).item()
    assert abs(loss - plain) <= (1e-6 if precision == "fp32" else 1e-2) * abs(plain)
    # planted: the run's chunk ignores the budget (the plan's activation_memory keeps its own chunk_tokens)
    monkeypatch.setattr(vocab, "chunk_tokens", lambda tokens, rows, logit_bytes: tokens)
    made, _ = measured()
    assert made == [b * t] and working(made) > activation_bytes(cfg, b, t, precision=precision)["working"]


def test_a_soft_capped_loss_equals_the_plain_loss_of_capped_logits():
    """Gemma 2's final-logit soft-cap, applied to each chunk's logits before the max; values and gradients."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = (3 * torch.randn(50, 16, generator=g)).requires_grad_()
    y = torch.randint(0, 50, (37,), generator=g)
    y[:4] = -100
    loss = vocab.token_loss(h, w, y, softcap=5.0, chunk=8)
    grads = torch.autograd.grad(0.5 * loss, [h, w])
    plain = summed_token_loss(vocab.capped(h @ w.T, 5.0), y)
    want = torch.autograd.grad(0.5 * plain, [h, w])
    assert abs(loss.item() - plain.item()) <= 1e-6 * plain.item()
    assert max(rel(a, b) for a, b in zip(grads, want)) <= 1e-6
    uncapped = summed_token_loss(h @ w.T, y)
    assert abs(uncapped.item() - plain.item()) > 1e-2 * plain.item()  # the cap changes this loss: it is applied


# ----------------------------------------------------------------------------- two ranks: TP 2 against TP 1


def largest_created(run) -> int:
    """Bytes of the largest tensor any operation creates while `run()` runs (forward and backward)."""

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.nbytes = max(Largest.nbytes, t.numel() * t.element_size())
            return out

    with Largest():
        run()
    return Largest.nbytes


def largest_activation(model, x, y) -> dict[str, int]:
    """The largest tensor saved for the backward (saved-tensor hooks, the parameters left out) and the largest any
    operation creates in the forward and backward of one micro-batch."""
    saved = {}

    def step():
        storages, loss = saved_storages(lambda: head_loss(model, x, y, summed_token_loss, False),
                                        model.parameters())
        saved.update(storages)
        loss.backward()

    created = largest_created(step)
    return {"saved": max(saved.values()), "created": created}


def tp_job(rank, comm, tmp_path):
    """TP 2 against TP 1 on each rank: the loss, every gradient (this rank's slice of it), the logits, evaluation and
    greedy generation; each as correct, with the sum-exp all-reduce missing (planted), and the largest activation
    per rank for the 32,000-token vocabulary, vocabulary split and (planted) whole."""
    out = {}
    for arch, cfg in CONFIGS.items():
        x, y = batch(cfg, seed=1)
        whole = build_model(cfg, seed=0)
        with mock.patch.object(vocab, "chunk_tokens", lambda tokens, rows, width: SMALL_CHUNKS):
            want, want_grads = loss_and_grads(whole, x, y)  # TP 1: the same chunks, the whole vocabulary
        split = build_model(cfg, seed=0)
        slices = parallelize(split, 2, rank, comm)
        assert isinstance(split.lm_head, vocab.VocabParallelHead) and split.lm_head.weight.shape[0] == 32

        def against_tp1(split=split, slices=slices, x=x, y=y, want=want, want_grads=want_grads):
            loss, grads = loss_and_grads(split, x, y)
            worst = max(rel(grads[n], slices[n].take(want_grads[n], rank) if n in slices else want_grads[n])
                        for n in grads)
            return {"loss": abs(loss - want) / abs(want), "grads": worst}

        with mock.patch.object(vocab, "chunk_tokens", lambda tokens, rows, width: SMALL_CHUNKS):
            out[arch] = against_tp1()
            with mock.patch.object(vocab, "global_sums", lambda sums, comm: sums):  # planted: no all-reduce
                out[arch + " planted"] = against_tp1()
        with torch.no_grad():
            out[arch]["logits"] = rel(split(x), whole(x))
            out[arch]["eval"] = abs(head_loss(split, x, y, summed_token_loss, False).item() - want) / abs(want)
        prompt = x[:, :4]
        out[arch]["generate"] = torch.equal(generate(split, prompt, 6, temperature=0),
                                            generate(whole, prompt, 6, temperature=0))
    return {**out, **largest_at_tp1_tp2_and_planted(largest_activation, rank, comm)}


def largest_at_tp1_tp2_and_planted(largest, rank: int, comm) -> dict:
    """`largest(model, x, y)` of the 32,000-token vocabulary's model at TP 1, at TP 2 (this rank's), and at TP 2 with
    the vocabulary left whole (planted)."""
    x, y = batch(LARGE_VOCAB)
    out = {"tp1": largest(build_model(LARGE_VOCAB, seed=0), x, y)}
    model = build_model(LARGE_VOCAB, seed=0)
    parallelize(model, 2, rank, comm)
    out["tp2"] = largest(model, x, y)
    with mock.patch.object(gpt2, "splits_vocab", lambda vocab_size, tp: False):  # planted: the vocabulary left whole
        model = build_model(LARGE_VOCAB, seed=0)
        parallelize(model, 2, rank, comm)
        out["tp2 planted"] = largest(model, x, y)
    return out


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    codes, results = spawn(tp_job, 2, tmp_path_factory.mktemp("tp"), timeout=240)
    assert codes == [0, 0] and all(r is not None and "error" not in r for r in results), results
    return results


def test_tp2_vocab_parallel_loss_and_gradients_equal_tp1_and_a_missing_all_reduce_is_caught(tp_results):
    for rank, r in enumerate(tp_results):
        for arch in CONFIGS:
            assert r[arch]["loss"] <= 1e-6 and r[arch]["grads"] <= 1e-6, (rank, arch, r[arch])
            assert r[arch + " planted"]["loss"] > 1e-2 and r[arch + " planted"]["grads"] > 1e-2, (rank, arch)


def test_tp2_logits_evaluation_and_generation_equal_tp1(tp_results):
    for r in tp_results:
        for arch in CONFIGS:
            assert r[arch]["logits"] <= 1e-6 and r[arch]["eval"] <= 1e-6 and r[arch]["generate"], (arch, r[arch])


def test_the_largest_activation_of_a_32000_token_vocabulary_at_tp2_is_at_most_055x_tp1s_and_a_whole_one_is_caught(
        tp_results):
    for r in tp_results:
        for what in ("saved", "created"):
            assert r["tp2"][what] <= 0.55 * r["tp1"][what], (what, r)
            assert r["tp2 planted"][what] > 0.9 * r["tp1"][what], (what, r)
    # TP 1: the head's weight gradient (V C 4 bytes) is the largest saved tensor, where the plain loss kept the
    # log-probabilities (B T V 4 bytes, on every TP rank)
    V, C = LARGE_VOCAB.vocab_size, LARGE_VOCAB.n_embd
    assert tp_results[0]["tp1"]["saved"] == V * C * 4
    # the plan's figures halve too: what is kept for the backward beyond the blocks, and the working set
    plan = {tp: activation_bytes(LARGE_VOCAB, B, T, tp=tp) for tp in (1, 2)}
    assert plan[2]["loss"] <= 0.55 * plan[1]["loss"] and plan[2]["working"] <= 0.55 * plan[1]["working"]


def test_a_vocabulary_tp_does_not_divide_stays_whole_on_every_rank():
    cfg = dataclasses.replace(CONFIGS["gpt2"], vocab_size=65)
    slices = gpt2.plan(cfg, 2)
    assert "transformer.wte.weight" not in slices and "transformer.wte.weight" in gpt2.plan(CONFIGS["gpt2"], 2)
    with torch.device("meta"):
        model = build_model(cfg, seed=0)
        parallelize(model, 2, 0, None)
    assert model.transformer.wte.weight.shape == (65, 32) and model.lm_head.weight is model.transformer.wte.weight
