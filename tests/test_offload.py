"""--offload-activations (training/offload.py): steps whose saved activations wait in host memory train bitwise as
steps that keep them, with and without --activation-checkpointing, GPT-2 and Llama; the hooks are active (they pack
every saved activation: what an outer count of saved tensors sees of the model's forward drops to the loss alone, and
checkpointed blocks pack only their inputs), and the CPU run is refused in one line.

On the CPU the host copy is a copy within host memory: the test proves the round trip and the hooks' reach, not a
memory saving. Planted in the product's functions and caught: a host copy rounded through bf16 (losses differ), the
hooks never entered (nothing packed).
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config, zerotrain_here

from zerotrain.cli.main import main
from zerotrain.config import PRESETS
from zerotrain.model import attention, build_model, summed_token_loss
from zerotrain.model.loss import head_loss
from zerotrain.training import memory_plan as plan_module
from zerotrain.training import offload
from zerotrain.training.activations import saved_for_backward

STEPS = 3


def short_run(preset: str, recompute: str, offloaded: bool):
    """(losses of STEPS AdamW steps on a fixed batch, final weights, the hooks or None, the bytes an outer count of
    saved tensors sees in the first forward) of the model as the step calls it (head_loss)."""
    cfg = tiny_config("/tmp", **PRESETS[preset])
    model = build_model(cfg.model, seed=0)
    model.recompute_blocks = recompute in ("blocks", "full")
    hooks = offload.offload_activations(model) if offloaded else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    losses, seen = [], None
    for step in range(STEPS):
        def loss():
            return head_loss(model, x, y, summed_token_loss, recompute == "full")
        if step == 0:
            seen, value = saved_for_backward(loss, model.parameters())
        else:
            value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(value.detach())
    return losses, [p.detach().clone() for p in model.parameters()], hooks, seen


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_offloaded_activations_train_bitwise_as_kept_ones_and_the_hooks_pack_them(preset):
    packed = {}
    for recompute in ("none", "blocks", "full"):
        kept, kept_weights, _, kept_seen = short_run(preset, recompute, offloaded=False)
        moved, moved_weights, hooks, moved_seen = short_run(preset, recompute, offloaded=True)
        assert all(torch.equal(a, b) for a, b in zip(kept, moved)), (recompute, kept, moved)
        assert all(torch.equal(a, b) for a, b in zip(kept_weights, moved_weights))
        # every step's forward packs the same tensors; an outer count sees no more than the loss outside the model
        assert hooks.packed > 0 and hooks.packed % STEPS == 0
        assert moved_seen < kept_seen / 4, (recompute, moved_seen, kept_seen)
        packed[recompute] = hooks.packed_bytes
    # with checkpointed blocks only their inputs (and the layers outside them) wait on the host
    assert packed["full"] < packed["blocks"] < 0.7 * packed["none"], packed


def test_a_lossy_host_copy_is_caught(monkeypatch):
    kept, _, _, _ = short_run("llama-tiny", "blocks", offloaded=False)
    real = offload.to_host
    monkeypatch.setattr(offload, "to_host", lambda t, pin: real(t.to(torch.bfloat16).to(t.dtype), pin)
                        if t.is_floating_point() else real(t, pin))
    moved, _, _, _ = short_run("llama-tiny", "blocks", offloaded=True)
    assert not all(torch.equal(a, b) for a, b in zip(kept, moved))


def test_hooks_never_entered_are_caught(monkeypatch):
    monkeypatch.setattr(offload.HostActivations, "__enter__", lambda self: self)
    monkeypatch.setattr(offload.HostActivations, "__exit__", lambda self, *exc: None)
    _, _, hooks, _ = short_run("tiny", "none", offloaded=True)
    assert hooks.packed == 0  # what the first test's `hooks.packed > 0` catches


def test_offload_on_the_cpu_or_with_compile_is_refused_in_one_line(tmp_path, capfd):
    for extra, said in (([], "with --device cpu they are in host memory already"),
                        (["--device", "cuda", "--compile"], "do not reach into a compiled graph")):
        result = zerotrain_here(capfd, "train", "--preset", "tiny", "--data", "synthetic", "--steps", "1",
                                "--out", str(tmp_path / "run"), "--offload-activations", *extra)
        assert result.returncode == 2, result
        assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr



def plan_rows(capsys, preset: str, recompute: str) -> dict:
    """`zerotrain plan --device cuda --offload-activations`'s report (a plan needs no GPU), micro-batch 4."""
    assert main(["plan", "--preset", preset, "--data", "synthetic", "--device", "cuda", "--precision", "fp32",
                 "--micro-batch", "4",
                 "--activation-checkpointing", recompute, "--offload-activations", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_plan_puts_offloaded_activations_on_the_host_as_the_hooks_move_them_and_a_device_plan_is_caught(
        preset, recompute, capsys, monkeypatch):
    """The hooks run on the CPU when entered directly (the flag is refused there, not the mechanism): what the device
    keeps (an outer count of saved tensors) is the plan's activations row, 0, and the storages the hooks copy to the
    host (each once, kept alive so that none is counted twice at a reused address) are its host row, to the byte.
    Not measured: a GPU's peak, and the pinned host memory itself."""
    report = plan_rows(capsys, preset, recompute)
    rows = report["rows"]
    # the kernels the plan counts for CUDA: with GQA in fp32, k and v copied to the query heads (the same code here)
    monkeypatch.setattr(attention, "repeats_kv_heads", lambda *args, **kwargs: True)
    cfg = tiny_config("/tmp", **PRESETS[preset])
    model = build_model(cfg.model, seed=0)
    model.recompute_blocks = recompute in ("blocks", "full")
    hooks = offload.offload_activations(model)
    copied, real = {}, offload.to_host

    def counted(t, pin):
        copied[t.untyped_storage().data_ptr()] = t  # kept: its address is not reused while counting
        return real(t, pin)

    monkeypatch.setattr(offload, "to_host", counted)
    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    kept, _ = saved_for_backward(lambda: head_loss(model, x, torch.roll(x, -1, dims=1), summed_token_loss,
                                                   recompute == "full"), model.parameters())
    moved = sum(t.untyped_storage().nbytes() for t in copied.values())
    assert kept == rows["activations"] == 0 and moved == rows["activations_host"] > 0
    # the hooks copy each saved tensor, a storage saved twice twice: more than the storages, by a bounded share
    assert moved <= hooks.packed_bytes <= 1.45 * moved
    # host memory with CUDA: not in the device's total
    assert report["total"] == sum(v for k, v in rows.items() if k not in ("activations_host", "checkpoint_staging"))
    # planted: the plan keeps them on the device, as it did before it knew the flag
    monkeypatch.setattr(plan_module, "activation_rows", lambda cfg, saved: {"activations": saved,
                                                                           "activations_host": 0})
    planted = plan_rows(capsys, preset, recompute)["rows"]
    assert planted["activations"] != kept and planted["activations_host"] != moved
