"""--activation-checkpointing blocks: the same gradients bitwise, fewer bytes kept for the backward."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from zerotrain.config import PRESETS
from zerotrain.model import build_model, layers, summed_token_loss
from zerotrain.training.activations import saved_for_backward
from zerotrain.training.loop import train


def gradients(preset: str, recompute: bool, head: bool = False):
    cfg = tiny_config("/tmp", **PRESETS[preset])
    model = build_model(cfg.model, seed=0)
    model.recompute_blocks = recompute
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    saved, loss = saved_for_backward(lambda: layers.head_loss(model, x, y, summed_token_loss, head),
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
    real = layers.checkpoint

    def stale(block, x, *args, **kw):  # planted: the recomputation sees a detached copy of the input
        return real(block, x.detach(), *args, **kw) + 0 * x
    monkeypatch.setattr(layers, "checkpoint", stale)
    recomputed, _ = gradients("llama-tiny", recompute=True)
    assert not all(torch.equal(kept[n], recomputed[n]) for n in kept)


def test_a_head_recomputed_on_stale_inputs_is_caught(monkeypatch):
    kept, _ = gradients("tiny", recompute=False)
    real = layers.checkpoint

    def stale(fn, h, **kw):  # planted: the head's recomputation sees a detached copy of the final norm's output
        return real(fn, h.detach(), **kw) + 0 * h.sum()
    monkeypatch.setattr(layers, "checkpoint", stale)
    recomputed, _ = gradients("tiny", recompute=False, head=True)
    assert not all(torch.equal(kept[n], recomputed[n]) for n in kept)


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
