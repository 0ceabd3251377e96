"""--activation-checkpointing blocks and full: the same gradients bitwise, fewer bytes kept for the backward, the
head's gradient matmuls once, and no MoE routing kept past the backward."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from zerotrain.config import PRESETS
from zerotrain.model import build_model, summed_token_loss
from zerotrain.model import recompute as recompute_module
from zerotrain.model.loss import head_loss
from zerotrain.training.activations import saved_for_backward
from zerotrain.training.loop import train


def gradients(preset: str, recompute: bool, head: bool = False):
    cfg = tiny_config("/tmp", **PRESETS[preset])
    model = build_model(cfg.model, seed=0)
    model.recompute_blocks = recompute
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    saved, loss = saved_for_backward(lambda: head_loss(model, x, y, summed_token_loss, head),
                                     model.parameters())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_recomputed_blocks_give_bitwise_the_same_gradients_and_keep_fewer_bytes(preset):
    kept, kept_bytes = gradients(preset, recompute=False)
    recomputed, recomputed_bytes = gradients(preset, recompute=True)
    assert kept.keys() == recomputed.keys() and all(torch.equal(kept[n], recomputed[n]) for n in kept)
    assert recomputed_bytes < 0.7 * kept_bytes
    full, full_bytes = gradients(preset, recompute=True, head=True)  # the head and the loss recomputed too
    assert all(torch.equal(kept[n], full[n]) for n in kept)
    assert full_bytes < recomputed_bytes


def test_a_block_recomputed_on_stale_inputs_is_caught(monkeypatch):
    kept, _ = gradients("llama-tiny", recompute=False)
    real = recompute_module.checkpoint

    def stale(block, x, *args, **kw):  # planted: the recomputation sees a detached copy of the input
        return real(block, x.detach(), *args, **kw) + 0 * x
    monkeypatch.setattr(recompute_module, "checkpoint", stale)
    recomputed, _ = gradients("llama-tiny", recompute=True)
    assert not all(torch.equal(kept[n], recomputed[n]) for n in kept)


def test_a_head_recomputed_on_stale_inputs_is_caught(monkeypatch):
    from zerotrain.model import vocab

    kept, _ = gradients("tiny", recompute=False)
    real = vocab.token_loss

    def stale(h, weight, targets, recompute=False, **kw):  # planted: the recomputing loss kept a detached copy of h
        if not recompute:
            return real(h, weight, targets, **kw)
        return real(h.detach(), weight, targets, recompute=True, **kw) + 0 * h.sum()
    monkeypatch.setattr(vocab, "token_loss", stale)
    recomputed, _ = gradients("tiny", recompute=False, head=True)
    assert not all(torch.equal(kept[n], recomputed[n]) for n in kept)


def head_passes(monkeypatch, recompute: bool, head: bool) -> dict[str, int]:
    """{pass: calls} of the head's chunk passes (vocab.chunk_logits: its logits; vocab.chunk_grads: their gradient
    matmuls into the head's input and weight) over one forward and backward of the summed token loss."""
    from zerotrain.model import vocab

    calls = {"logits": 0, "grads": 0}
    for name, key in (("chunk_logits", "logits"), ("chunk_grads", "grads")):
        def counted(*args, real=getattr(vocab, name), key=key):
            calls[key] += 1
            return real(*args)
        monkeypatch.setattr(vocab, name, counted)
    gradients("tiny", recompute, head)
    return calls


def test_a_recomputed_head_computes_its_gradient_matmuls_once_and_a_checkpointed_one_is_caught(monkeypatch):
    """--activation-checkpointing full keeps the head's input, not its gradients: the loss's logits once in the
    forward, once more with their gradient matmuls in the backward. Planted: the head's loss under a checkpoint (as
    it ran), which computes the gradients in the forward, drops them and computes them again."""
    from zerotrain.model import vocab

    kept = head_passes(monkeypatch, recompute=False, head=False)
    assert kept == {"logits": 1, "grads": 1}  # one chunk of tokens: the gradients taken with the loss
    assert head_passes(monkeypatch, recompute=True, head=True) == {"logits": 2, "grads": 1}
    real = vocab.token_loss

    def checkpointed(h, weight, targets, recompute=False, **kw):
        if not recompute:
            return real(h, weight, targets, **kw)
        return recompute_module.checkpoint(lambda h: real(h, weight, targets, **kw), h, use_reentrant=False)
    monkeypatch.setattr(vocab, "token_loss", checkpointed)
    assert head_passes(monkeypatch, recompute=True, head=True) == {"logits": 2, "grads": 2}


def test_no_moe_routing_outlives_a_recomputed_backward_and_a_recorded_recomputation_is_caught(monkeypatch):
    """A recomputed MoE block records no routing in the backward: the balancing loss took the forward's, and one
    recorded there would hold the recomputed router's graph until the next forward. Counted as the routing tensors
    alive after the backward (weak references). Planted: the recomputation taken for a forward."""
    import gc
    import weakref

    from zerotrain.model import moe

    def alive_after_backward() -> int:
        cfg = tiny_config("/tmp", **PRESETS["qwen3-moe-tiny"])
        model = build_model(cfg.model, seed=0)
        model.recompute_blocks = True
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
        recorded = []
        real = moe.Routing

        def routing(*fields):
            recorded.append(weakref.ref(fields[0]))  # each record's probability sums, which hold the router's graph
            return real(*fields)
        with monkeypatch.context() as m:
            m.setattr(moe, "Routing", routing)
            loss = head_loss(model, x, torch.roll(x, -1, dims=1), summed_token_loss, True)
            per_row, _ = moe.balancing_loss(model)
            (loss + per_row.sum()).backward()
        gc.collect()
        return len(recorded), sum(r() is not None for r in recorded)

    recorded, alive = alive_after_backward()
    assert (recorded, alive) == (2, 0)  # the 2 MoE layers' forward records, taken and freed
    monkeypatch.setattr(moe, "in_backward", lambda: False)  # planted: a recomputation records its routing
    recorded, alive = alive_after_backward()
    assert (recorded, alive) == (4, 2)


def test_a_run_with_recomputed_blocks_trains_bitwise_like_one_without(tmp_path, one_rank):
    runs = {}
    for mode in ("none", "blocks", "full"):
        cfg = tiny_config(tmp_path / mode, steps=3, activation_checkpointing=mode)
        result = train(cfg, one_rank, announce=False)
        runs[mode] = ([r["loss"] for r in result.records], result.digests)
    assert runs["none"] == runs["blocks"] == runs["full"]


def test_recomputed_blocks_under_tp_train_bitwise_like_kept_ones(tmp_path):
    import functools
    import json

    import dist_jobs

    from zerotrain.runtime.launch import run_job

    modes = ("none", "blocks")
    cfgs = {mode: tiny_config(tmp_path / mode, nproc=2, tp=2, micro=4, steps=3, ckpt_every=3,
                              activation_checkpointing=mode, **PRESETS["llama-tiny"]) for mode in modes}
    # both runs in turn on one start of the 2 ranks
    run_job(functools.partial(dist_jobs.in_turn_job, jobs=[(dist_jobs.tp_params_job, cfg) for cfg in cfgs.values()]),
            cfgs["none"], time_limit=120)
    hashes = {}
    for mode, cfg in cfgs.items():
        manifest = json.loads((tmp_path / mode / "checkpoints" / "step_00000003" / "manifest.json").read_text())
        assert manifest["mesh"] == {"tp": 2, "dp": 1}
        hashes[mode] = {f["name"]: f["sha256"] for f in manifest["files"]}
    assert hashes["none"] == hashes["blocks"]  # the recomputation's all-reduces run again, to the same values
