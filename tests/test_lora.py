"""LoRA: adapters that start as the base, train alone, match peft's math, export to peft and merged, resume on
their own base only, and give the same result at TP 2 as at TP 1."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import types

import lora_jobs
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import tiny_config, world_of_one, zerotrain_here
from dist_jobs import in_turn_job
from model_folders import llama_folder
from safetensors.torch import load_file, save_file

from zerotrain import checkpoint, load_model
from zerotrain.cli.main import main
from zerotrain.config import LoraConfig
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.model import lora, summed_token_loss
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import train

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(300)
RANK, ALPHA = 4, 8.0  # scale 2: alpha alone (the planted bug) is 4 times too large
DROPOUT = 0.5  # the runs that test dropout: half of each adapter's inputs dropped
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def group():
    """One gloo rank on 127.0.0.1 for the module's in-process runs."""
    with world_of_one() as comm:
        yield comm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama saved by transformers, with its tokenizer."""
    folder = tmp_path_factory.mktemp("base") / "llama"
    llama_folder(folder)
    return str(folder)


def lora_config(out, base: str | None, steps=4, micro=2, **over):
    cfg = tiny_config(out, steps=steps, micro=micro, seq_len=16, lora_rank=RANK, lora_alpha=ALPHA, **over)
    cfg.optim.lr = 1e-2  # adapters move visibly in a few steps
    if base is not None:
        cfg.checkpoint.init_from = base
        cfg.model = adopt(cfg.model, weight_source(base), {"seq_len"})
    return cfg


def logits_of(model, idx):
    with torch.no_grad():
        return model.eval()(idx).float()


def inputs(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained(group, base, tmp_path_factory):
    """4 LoRA steps from the base with dropout, checkpointed at 2 and 4: the run, and its step-4 checkpoint."""
    cfg = lora_config(tmp_path_factory.mktemp("lora-run"), base, ckpt_every=2, lora_dropout=DROPOUT)
    result = train(cfg, group, announce=False)
    return result, cfg, result.checkpoints[-1]


# ----------------------------------------------------------------------------- in one process, no training


def zerotrain_with_adapters(base: str, seed: int = 0):
    model = load_model(base).requires_grad_(False)
    lora.add_adapters(model, LoraConfig(rank=RANK, alpha=ALPHA), seed)
    return model


def test_the_first_forward_equals_the_base_and_a_nonzero_initial_b_is_caught(base, monkeypatch):
    idx = inputs(400)
    plain = logits_of(load_model(base), idx)
    assert torch.equal(logits_of(zerotrain_with_adapters(base), idx), plain)  # B zero: B A x adds exact zeros
    monkeypatch.setattr(lora, "initial_up", lambda out, rank: torch.full((out, rank), 0.01))
    assert not torch.equal(logits_of(zerotrain_with_adapters(base), idx), plain)


def one_linear_with_adapters(seed: int) -> torch.nn.Module:
    """A q_proj of 48 -> 24 features alone, with its adapters drawn from `seed`."""
    model = torch.nn.Module()
    model.cfg = types.SimpleNamespace(arch="llama")  # what add_adapters reads of a model's config
    model.q_proj = torch.nn.Linear(48, 24, bias=False)
    lora.add_adapters(model, LoraConfig(rank=RANK, alpha=ALPHA, targets="q_proj"), seed)
    return model.q_proj


def test_the_adapters_are_drawn_from_the_seed_as_peft_draws_them():
    """A: kaiming-uniform with a = sqrt(5), i.e. within 1 / sqrt(fan_in) (peft's nn.Linear init); one per seed."""
    a, again, other = (one_linear_with_adapters(seed) for seed in (0, 0, 1))
    down = a.lora_A.weight
    assert torch.equal(down, again.lora_A.weight) and not torch.equal(down, other.lora_A.weight)
    assert 0.9 / 48**0.5 < down.abs().max() <= 1 / 48**0.5
    assert torch.equal(a.lora_B.weight, torch.zeros(24, RANK))


def peft_twin(base: str, model) -> torch.nn.Module:
    """peft's LoRA on transformers' model of the same base, holding `model`'s adapters."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    twin = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                    target_modules=list(TARGETS)))
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if ".lora_" in name:
                p.copy_(ours[name.removeprefix("base_model.model.").replace(".default", "")])
    return twin


def adapter_grads_against_peft(base: str) -> float:
    """The largest relative difference (by norm) between zerotrain's and peft's gradients of each A and B on one
    batch, with B nonzero (at B = 0 A's gradient is zero) and the same adapters in both."""
    model = zerotrain_with_adapters(base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    twin = peft_twin(base, model)
    idx = inputs(400)
    targets = torch.roll(idx, -1, dims=1)
    summed_token_loss(model.train()(idx), targets).backward()
    summed_token_loss(twin.train()(input_ids=idx).logits, targets).backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
              for n, p in twin.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * 2
    return max(((ours[n] - theirs[n]).norm() / theirs[n].norm()).item() for n in ours)


def test_adapter_gradients_equal_peft_and_a_wrong_scale_is_caught(base, monkeypatch):
    assert adapter_grads_against_peft(base) <= 1e-5
    monkeypatch.setattr(lora, "lora_scale", lambda cfg: cfg.alpha)  # planted: alpha, not alpha / rank
    assert adapter_grads_against_peft(base) > 1e-2


# ----------------------------------------------------------------------------- a trained run


def base_tensors_unchanged(model, base: str) -> bool:
    """Every frozen tensor of the trained model is bitwise the base file's."""
    stored = load_file(os.path.join(base, "model.safetensors"))
    frozen = {n: p for n, p in model.named_parameters() if ".lora_" not in n}
    assert frozen.keys() == stored.keys()
    return all(torch.equal(p.detach(), stored[n]) for n, p in frozen.items())


def test_training_moves_only_the_adapters_and_an_unfrozen_base_is_caught(trained, base, group, tmp_path, monkeypatch):
    result, _, _ = trained
    assert base_tensors_unchanged(result.engine.model, base)
    assert any(p.abs().max() > 0 for n, p in result.engine.model.named_parameters() if ".lora_B." in n)
    monkeypatch.setattr(lora, "freeze_base", lambda model: None)  # planted: the base trains too
    unfrozen = train(lora_config(tmp_path, base, steps=2), group, announce=False)
    assert not base_tensors_unchanged(unfrozen.engine.model, base)
    # ... and holds optimizer state for it: 8 bytes of moments per base value, beyond the adapters' alone
    base_values = sum(t.numel() for t in load_file(os.path.join(base, "model.safetensors")).values())
    assert result.per_rank["optimizer_bytes"] == [8 * result.engine.layout.padded_numel]
    adapter_values = sum(p.numel() for p in result.engine.params)
    assert unfrozen.per_rank["optimizer_bytes"][0] >= 8 * (base_values + adapter_values)


def test_the_checkpoint_holds_the_adapters_and_the_base_by_sha256(trained):
    _, _, step = trained
    import json

    with open(os.path.join(step, "manifest.json")) as f:
        manifest = json.load(f)
    held = checkpoint.checkpoint_model(step)
    assert held and all(".lora_A." in n or ".lora_B." in n for n in held)
    assert [f["name"] for f in manifest["init_from"]["files"]] == ["model.safetensors"]
    entry = manifest["init_from"]["files"][0]  # the digest of its 4 KiB blocks' sha256s (base_digest)
    assert len(entry["blocks_sha256"]) == 64 and manifest["init_from"]["block_bytes"] == 4096


def test_logits_equal_the_peft_adapter_and_the_merged_export_and_a_wrong_alpha_is_caught(trained, base, tmp_path,
                                                                                       monkeypatch, capsys):
    result, _, step = trained
    idx = inputs(400)
    ours = logits_of(result.engine.model, idx)
    assert main(["export", step, str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert main(["export", step, str(tmp_path / "merged"), "--format", "hf"]) == 0

    def peft_logits(folder):
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        return peft.PeftModel.from_pretrained(hf, str(folder)).eval()(input_ids=idx).logits.detach()

    assert (peft_logits(tmp_path / "adapter") - ours).abs().max() <= 1e-4
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert (merged.eval()(input_ids=idx).logits.detach() - ours).abs().max() <= 1e-4
    assert (logits_of(load_model(step), idx) - ours).abs().max() <= 1e-4  # what sample and eval load
    capsys.readouterr()
    assert main(["sample", step, "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert main(["eval", step, "--batches", "2"]) == 0
    said = capsys.readouterr()
    assert "sampled 4 tokens" in said.err and "val_loss" in said.out
    from zerotrain.hub import adapter

    real = adapter.peft_config
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, *adapted: {**real(run, path, *adapted),
                                                                             "lora_alpha": RANK})  # planted
    assert main(["export", step, str(tmp_path / "wrong"), "--format", "peft"]) == 0
    assert (peft_logits(tmp_path / "wrong") - ours).abs().max() > 1e-3


def test_lora_composes_with_bf16_zero2_accumulation_and_full_activation_checkpointing(group, base, tmp_path):
    """The run's own checks pass (invariants, the plan's state exactly); the base is held as the file's values in
    bf16, untouched; the plan's activations are what the first micro-batch saved."""
    cfg = lora_config(tmp_path, base, steps=2, precision="bf16", zero=2, accum=2, micro=1,
                      activation_checkpointing="full")
    result = train(cfg, group, announce=False)
    stored = load_file(os.path.join(base, "model.safetensors"))
    frozen = dict(result.engine.frozen)
    assert frozen.keys() == stored.keys()
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, stored[n].to(torch.bfloat16)) for n, p in frozen.items())
    assert result.plan["activations_measured"] == result.plan["rows"]["activations"]
    assert all(".lora_" in s.name for s in result.engine.layout.slots)


def test_a_gpt2_adapter_exports_to_peft_on_its_conv1d_layers(group, tmp_path):
    """GPT-2's c_attn, c_proj and c_fc are transformers' Conv1D (fan-in-fan-out): peft's adapters on them are the
    same A (R x in) and B (out x R) as zerotrain's."""
    base = str(tmp_path / "gpt2")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                         n_positions=16)).save_pretrained(base)
    result = train(lora_config(tmp_path / "run", base, steps=2, ckpt_every=2), group, announce=False)
    assert main(["export", result.checkpoints[-1], str(tmp_path / "adapter"), "--format", "peft"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    idx = inputs(64)
    ours = logits_of(result.engine.model, idx)
    assert (theirs(input_ids=idx).logits.detach() - ours).abs().max() <= 1e-4
    assert (logits_of(load_model(base), idx) - ours).abs().max() > 1e-3  # the adapters trained


def adapters_of(result) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in result.engine.model.named_parameters() if ".lora_" in n}


def stateful_dropout(self, x):
    """Planted: masks drawn from a generator seeded by --seed once per run (a resume restarts it; a recomputed
    forward draws the next numbers instead of the first forward's)."""
    if self.rows.keys is None or not self.training:
        return x
    generator = self.rows.__dict__.setdefault("generator", torch.Generator().manual_seed(self.rows.seed))
    return x * (torch.rand(x.shape, generator=generator) >= self.p) / (1 - self.p)


def test_a_lora_resume_with_dropout_is_bitwise_and_a_lossy_resume_or_a_seeded_generators_masks_are_caught(
        trained, base, group, tmp_path, monkeypatch):
    result, _, _ = trained
    halfway = result.checkpoints[0]

    def resume(name, at=halfway, steps=4):
        return train(lora_config(tmp_path / name, base, steps=steps, resume=at, lora_dropout=DROPOUT), group,
                     announce=False)

    resumed = resume("resumed")
    assert resumed.start_step == 2
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in result.records[2:]]
    final, again = adapters_of(result), adapters_of(resumed)
    assert all(torch.equal(final[n], again[n]) for n in final)
    from zerotrain.parallel import ZeroEngine

    real = ZeroEngine.load_shard_state_dict

    def lossy(self, sd):  # planted: the second moments are not restored
        real(self, {**sd, "exp_avg_sq": torch.zeros_like(sd["exp_avg_sq"])})

    with monkeypatch.context() as planted:
        planted.setattr(ZeroEngine, "load_shard_state_dict", lossy)
        lost = adapters_of(resume("lossy"))
    assert not all(torch.equal(final[n], lost[n]) for n in final)
    # planted: a stateful generator; its own uninterrupted run and its resume then part at step 3
    monkeypatch.setattr(lora.LoRADropout, "forward", stateful_dropout)
    whole = train(lora_config(tmp_path / "stateful", base, steps=3, ckpt_every=2, lora_dropout=DROPOUT), group,
                  announce=False)
    part = resume("stateful-resumed", at=whole.checkpoints[0], steps=3)
    assert [r["loss"] for r in part.records] != [r["loss"] for r in whole.records[2:]]


def test_validation_runs_without_dropout_alike_twice_and_dropout_left_on_is_caught(trained, monkeypatch):
    """The model trained with dropout validates as the model in eval mode (no dropout), pass after pass. Caught:
    torch's dropout, on whenever the model is in training mode (as before), and masks left on after a training
    micro-batch."""
    from zerotrain.data import BatchSchedule, make_source
    from zerotrain.training import evaluate, executor, loop

    result, cfg, _ = trained
    engine, source = result.engine, make_source(cfg, split="val")

    def validated(training=True):
        engine.model.train(training)
        return evaluate.validation_loss(engine.model, source, engine.mesh, batches=2, micro_batch=2)

    without = validated(training=False)
    assert validated() == validated() == without
    with monkeypatch.context() as planted:
        planted.setattr(lora.LoRADropout, "forward", lambda self, x: F.dropout(x, self.p, self.training))
        first, second = validated(), validated()
    assert first != second and without not in (first, second)
    real = executor.dropout_rows

    @contextlib.contextmanager
    def leaky(model, step, rows):  # planted: the last micro-batch's rows stay set
        with real(model, step, rows):
            yield
            kept = model.lora_rows.rows, model.lora_rows.keys
        model.lora_rows.rows, model.lora_rows.keys = kept

    monkeypatch.setattr(executor, "dropout_rows", leaky)
    try:
        loop.accumulate_gradients(engine, BatchSchedule(make_source(cfg), micro_batch=2, accum=1, rank=0,
                                                        world_size=1).batch(0))
        assert validated() != without
    finally:
        engine.model.lora_rows.rows = engine.model.lora_rows.keys = None
        engine.zero_grad()


def test_under_compile_the_dropout_runs_eagerly_outside_the_graph_and_a_traced_dropout_is_caught(monkeypatch):
    """--compile's model (model/compiled.py's `compiled`, the whole model: --compile at ZeRO-3, whose blocks are
    compiled alone, refuses LoRA) calls the adapters' dropout eagerly, outside the graph, and gives the eager model's
    output with the same masks, bitwise. A q_proj with its adapters alone, compiled by dynamo's eager backend: which
    code runs inside a graph is dynamo's decision, and the eager backend runs the graph with the eager kernels, without
    inductor's seconds of code generation. Planted: compiled without keep_eager, the dropout is traced into the graph
    (its masks drawn while compiling)."""
    from zerotrain.model import compiled as compiled_model

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    compiling, real_keep_mask = [], lora.keep_mask

    def watched_keep_mask(*args):
        compiling.append(torch.compiler.is_compiling())
        return real_keep_mask(*args)

    monkeypatch.setattr(lora, "keep_mask", watched_keep_mask)
    x = torch.randn(2, 12, 48, generator=torch.Generator().manual_seed(1))

    def adapted_linear() -> torch.nn.Module:
        model = torch.nn.Module()
        model.cfg = types.SimpleNamespace(arch="llama")  # what add_adapters reads of a model's config
        model.q_proj = torch.nn.Linear(48, 24, bias=False)
        lora.add_adapters(model, LoraConfig(rank=RANK, alpha=ALPHA, dropout=DROPOUT, targets="q_proj"), seed=0)
        with torch.no_grad():  # B nonzero, so that what the dropout drops shows in the output
            model.q_proj.lora_B.weight.normal_(generator=torch.Generator().manual_seed(2))
        return model

    def dropped(model, forward) -> torch.Tensor:
        with torch.no_grad(), lora.dropout_rows(model, step=3, rows=range(2)):
            return forward(x)

    model = adapted_linear()
    eager = dropped(model, model.q_proj)
    assert not torch.equal(eager, model.q_proj.eval()(x))  # the masks drop
    model.train()
    compiling.clear()
    torch._dynamo.reset()
    assert torch.equal(dropped(model, compiled_model.compiled(model.q_proj, per_block=False)), eager)
    assert compiling and not any(compiling), compiling
    monkeypatch.setattr(compiled_model, "keep_eager", lambda model: None)
    torch._dynamo.reset()
    compiling.clear()
    model = adapted_linear()
    dropped(model, compiled_model.compiled(model.q_proj, per_block=False))
    assert any(compiling)
    torch._dynamo.reset()


def test_the_command_line_does_not_import_dynamo_and_the_decorated_dropout_that_did_is_caught():
    """Every zerotrain command imports the adapters (hub/pretrained) but not torch._dynamo: 1.5 s of CPU of a
    launcher's 3.5 s (measured on the 2-core machine), which the ranks pay once, with torch's AdamW. The dropout stays
    out of compiled graphs by keep_eager as the model is compiled (the test above). Planted, in the same interpreter
    after the check: the dropout's forward decorated by torch.compiler.disable, as its class was, imports it."""
    code = ("import sys, torch; import zerotrain.cli.main; from zerotrain.model import lora; "
            "before = 'torch._dynamo' in sys.modules; torch.compiler.disable(lora.LoRADropout.forward); "
            "print(before, 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "True"], r.stderr[-2000:]


def gradient_with_dropout(base, group, out, recompute: str) -> list[torch.Tensor]:
    """The adapters' gradient of one step (2 micro-batches) with dropout, recomputing `recompute` in the backward."""
    from zerotrain.data import BatchSchedule, make_source
    from zerotrain.training import loop

    cfg = lora_config(out / recompute, base, steps=1, micro=1, accum=2, lora_dropout=DROPOUT,
                      activation_checkpointing=recompute)
    engine = loop.build_engine(cfg, group)
    engine.mesh.set_step(1)
    batch = BatchSchedule(make_source(cfg), micro_batch=1, accum=2, rank=0, world_size=1).batch(0)
    loop.accumulate_gradients(engine, batch)
    return [p.grad.clone() for p in engine.params]


def test_recomputed_forwards_drop_what_the_first_dropped_and_a_stateful_generator_is_caught(base, group, tmp_path,
                                                                                              monkeypatch):
    """Activation checkpointing (blocks, or full: the head too) gives the gradient of the run without, bitwise,
    with dropout 0.5 on every adapter; masks drawn from a seeded generator differ in the recomputed forward."""
    stored = gradient_with_dropout(base, group, tmp_path, "none")
    assert any(g.abs().max() > 0 for g in stored)
    for recompute in ("blocks", "full"):
        again = gradient_with_dropout(base, group, tmp_path, recompute)
        assert all(torch.equal(a, b) for a, b in zip(stored, again)), recompute
    monkeypatch.setattr(lora.LoRADropout, "forward", stateful_dropout)
    planted = [gradient_with_dropout(base, group, tmp_path / "planted", mode) for mode in ("none", "blocks")]
    assert not all(torch.equal(a, b) for a, b in zip(*planted))


def test_a_resume_that_would_train_other_adapters_or_every_weight_is_refused(trained, base, group, tmp_path):
    from zerotrain.errors import ConfigError

    halfway = trained[0].checkpoints[0]
    for change, said in (({"lora_rank": 0}, "this one would train every weight (--lora-rank 0)"),
                         ({"lora_alpha": 2 * ALPHA}, f"alpha {2 * ALPHA:g}, on q_proj"),
                         ({"lora_targets": "q_proj"},
                          "this one would train LoRA adapters of rank 4, alpha 8, on q_proj:")):
        cfg = lora_config(tmp_path / str(len(said)), base, resume=halfway)
        for key, value in change.items():
            setattr(cfg.lora, key.removeprefix("lora_"), value)
        with pytest.raises(ConfigError, match=f"its run trained LoRA adapters of rank 4, alpha 8, on q_proj,k_proj.*"
                                              f"{re.escape(said)}"):
            train(cfg, group, announce=False)


def test_a_random_base_is_rebuilt_from_its_seed_to_resume_and_load_and_another_seed_is_refused(group, tmp_path):
    from zerotrain.errors import ConfigError

    def config(name, **over):
        return tiny_config(tmp_path / name, steps=3, micro=2, lora_rank=RANK, lora_alpha=ALPHA, seed=3, **over)

    whole = train(config("whole", ckpt_every=1), group, announce=False)
    resumed = train(config("resumed", resume=whole.checkpoints[0]), group, announce=False)
    final, again = adapters_of(whole), adapters_of(resumed)
    assert all(torch.equal(final[n], again[n]) for n in final)
    idx = inputs(64)
    assert (logits_of(load_model(whole.checkpoints[-1]), idx) - logits_of(whole.engine.model, idx)).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match="--seed 4 builds another random base than the one its adapters were "
                                          "trained on \\(--seed 3\\)"):
        cfg = config("other-seed", resume=whole.checkpoints[0])
        cfg.loop.seed = 4
        train(cfg, group, announce=False)


def test_a_resume_on_another_base_is_refused_in_one_line(trained, base, tmp_path, capfd):
    _, _, step = trained
    other = tmp_path / "other-base"
    shutil.copytree(base, other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    done = zerotrain_here(capfd, "train", "--init-from", str(other), "--resume", os.path.dirname(step), "--data",
                          "synthetic", "--steps", "4", "--micro-batch", "2", "--seq-len", "16", "--lora-rank",
                          str(RANK), "--lora-alpha", str(ALPHA), "--out", str(tmp_path / "refused"), "--no-progress")
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "is not the base the adapters of" in errors[0] and "model.safetensors" in errors[0]
    assert "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- 2 ranks: TP and ZeRO


def mesh_config(out, micro=2, steps=3, **mesh):
    cfg = tiny_config(out, steps=steps, micro=micro, seq_len=16, lora_rank=RANK, lora_alpha=ALPHA, arch="llama",
                      n_head=4, n_kv_head=2, intermediate_size=64, tie_embeddings=False, **mesh)
    cfg.optim.lr, cfg.optim.grad_clip = 1e-2, 0.05  # every step clipped: the norm is the adapters' over the mesh
    return cfg


def gpt2_config(out, **mesh):
    """GPT-2's c_attn and c_fc sum their input's gradient themselves: the adapters share that all-reduce."""
    cfg = tiny_config(out, steps=3, micro=2, lora_rank=RANK, lora_alpha=ALPHA, **mesh)
    cfg.optim.lr, cfg.optim.grad_clip = 1e-2, 0.05
    return cfg


@pytest.fixture(scope="module")
def meshes(tmp_path_factory, group):
    """One start of 2 ranks: TP 2, TP 2 with A's gradient left partial (planted), ZeRO-1 over DP 2, DP 2 with
    dropout keys that leave out the rank (planted); and TP 1 in this process, on the same global batch of 2
    sequences and the same random base (the seed's). The compared runs drop half of the adapters' inputs: the masks
    are keyed by row of the global batch, so every split of it draws the same ones."""
    tmp = tmp_path_factory.mktemp("lora-meshes")
    # TP 2 also with accumulation (2 micro-batches of 1) and recomputed blocks: neither changes the math
    jobs = [(lora_jobs.lora_job, mesh_config(tmp / "tp2", nproc=2, tp=2, micro=1, accum=2,
                                             activation_checkpointing="blocks", lora_dropout=DROPOUT)),
            (lora_jobs.lora_job, gpt2_config(tmp / "gpt2-tp2", nproc=2, tp=2, lora_dropout=DROPOUT)),
            # DP 2 x 1: the same 2 sequences
            (lora_jobs.lora_job, mesh_config(tmp / "dp2", nproc=2, micro=1, lora_dropout=DROPOUT)),
            (lora_jobs.lora_unsummed_a_grad_job, mesh_config(tmp / "planted", nproc=2, tp=2)),
            (lora_jobs.lora_drifted_base_job, mesh_config(tmp / "drifted", nproc=2, micro=1)),
            (lora_jobs.lora_rowless_key_job, mesh_config(tmp / "rowless", nproc=2, micro=1, steps=1,
                                                         lora_dropout=DROPOUT))]
    two = run_job(functools.partial(in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    # 1 rank x 2 micro-batches of 1, against DP 2 x 1 and TP 2's 2 x 1
    one = lora_jobs.lora_job(mesh_config(tmp / "tp1", micro=1, accum=2, lora_dropout=DROPOUT), group)
    gpt2 = lora_jobs.lora_job(gpt2_config(tmp / "g1", lora_dropout=DROPOUT), group)
    return {"TP2": two[0], "GPT-2 TP2": two[1], "DP2": two[2], "planted": two[3], "drifted": two[4],
            "rowless": two[5], "TP1": one, "GPT-2 TP1": gpt2}


def rel(a, b) -> float:
    return max(((x - y).norm() / y.norm()).item() if torch.is_tensor(x) else abs(x - y) / abs(y) for x, y in zip(a, b))


def agrees(run, base) -> bool:
    names = sorted(base["params"])
    return (sorted(run["params"]) == names and rel(run["losses"], base["losses"]) <= 1e-5
            and rel(run["grad_norms"], base["grad_norms"]) <= 1e-5
            # another summation order over the mesh: float noise, measured 1.1e-5 on the adapters (A and B of
            # layer 1's q_proj) from the seed's initial model since each parameter is drawn from its own generator,
            # 3.8e-5 (layer 0's up_proj B, TP 2 against 1 rank x 2 micro-batches) with dropout 0.5
            and rel([run["params"][n] for n in names], [base["params"][n] for n in names]) <= 5e-5)


def test_tp2_lora_equals_tp1_and_a_partial_a_gradient_is_caught(meshes):
    assert agrees(meshes["TP2"], meshes["TP1"])
    assert agrees(meshes["GPT-2 TP2"], meshes["GPT-2 TP1"])
    # planted: each TP rank steps its replicated A by its own partial gradient; invariant (b) stops the run
    assert "invariant (b) failed: replicated parameters of rank(s) [1] differ" in meshes["planted"]["invariant"]
    assert meshes["TP2"]["frozen_grads"] == [] and all(".lora_" in n for n in meshes["TP2"]["trained"])


def dp_ranks_differ(masks) -> bool:
    """Whether DP 2's ranks (micro-batches of 1 row) dropped different inputs of layer 0's q_proj at step 1."""
    return not torch.equal(masks["q_proj"][0][0], masks["q_proj"][1][1])


def test_dropout_masks_are_the_global_batch_rows_on_every_split_and_a_key_without_the_rank_is_caught(meshes):
    """Step 1's masks of layer 0's q_proj input (replicated over TP) and o_proj input (split over TP), as the runs
    applied them: the DP ranks' differ (their rows do), each is the one rank's mask of the same row, the TP ranks
    of a replica agree on q_proj's and hold their slices of o_proj's. Caught: a key that counts a micro-batch's
    rows from 0 on every rank."""
    assert agrees(meshes["DP2"], meshes["TP1"])  # 2 ranks x 1 micro-batch = 1 rank x 2, with dropout
    one, dp2, tp2 = (meshes[k]["masks"] for k in ("TP1", "DP2", "TP2"))
    q, o = one["q_proj"][0], one["o_proj"][0]  # {row: mask} of the one rank
    assert sorted(q) == [0, 1] and 0.4 < float(q[0].float().mean()) < 0.6  # about half dropped
    assert not torch.equal(q[0], q[1]) and not torch.equal(o[0], o[1])  # the rows differ
    for rank in (0, 1):  # DP 2: rank r computes row r
        assert all(torch.equal(dp2[name][rank][rank], one[name][0][rank]) for name in ("q_proj", "o_proj"))
    assert dp_ranks_differ(dp2)
    for row in (0, 1):  # TP 2: both ranks compute both rows
        assert torch.equal(tp2["q_proj"][0][row], q[row]) and torch.equal(tp2["q_proj"][1][row], q[row])
        assert torch.equal(torch.cat([tp2["o_proj"][0][row], tp2["o_proj"][1][row]], dim=-1), o[row])
    assert not dp_ranks_differ(meshes["rowless"]["masks"])  # planted: rank 1 drew row 0's mask for its row 1


def test_zero1_over_two_ranks_shards_the_adapters_optimizer_state_and_the_base_holds_none(meshes):
    dp2, tp1 = meshes["DP2"], meshes["TP1"]
    assert agrees(dp2, tp1)
    adapters = sum(t.numel() for t in tp1["params"].values())
    assert dp2["shard_numel"] * 2 == dp2["padded_numel"] and adapters <= dp2["padded_numel"] < adapters + 2 * 256 * 8
    assert dp2["per_rank"]["optimizer_bytes"] == [8 * dp2["shard_numel"]] * 2  # exp_avg and exp_avg_sq of the shard
    assert tp1["per_rank"]["optimizer_bytes"] == [8 * tp1["padded_numel"]]
    assert dp2["frozen_grads"] == []


# ----------------------------------------------------------------------------- the plan


PLANNED = {"llama, every linear": dict(arch="llama", n_head=4, n_kv_head=2, intermediate_size=64,
                                       tie_embeddings=False),
           "llama, q and v, recomputed blocks": dict(arch="llama", n_head=4, n_kv_head=2, intermediate_size=64,
                                                     lora_targets="q_proj,v_proj", activation_checkpointing="blocks"),
           "gpt2, c_attn": dict(lora_targets="c_attn"),
           "llama, every linear, dropout": dict(arch="llama", n_head=4, n_kv_head=2, intermediate_size=64,
                                                tie_embeddings=False, lora_dropout=DROPOUT)}


def planned_run(tmp_path, group, name):
    cfg = tiny_config(tmp_path / name.replace(" ", "-").replace(",", ""), steps=1, micro=2, seq_len=16,
                      lora_rank=RANK, **PLANNED[name])
    return train(cfg, group, announce=False).plan


def test_the_plan_counts_lora_exactly_and_a_plan_without_the_adapters_activations_is_caught(tmp_path, group,
                                                                                           monkeypatch):
    """The run checks the state rows (the frozen base's among them) exactly after its first step; the activations
    it saved are compared here, to the byte."""
    from zerotrain.training import memory_plan

    for name in PLANNED:
        plan = planned_run(tmp_path, group, name)
        assert plan["rows"]["frozen_base"] > 0 and plan["activations_measured"] == plan["rows"]["activations"], name
    # the dropout's share is the same for every member of the Llama family (their linears are Llama's)
    shape = dict(PLANNED["llama, every linear"], micro=2, seq_len=16, lora_rank=RANK)
    share = {arch: memory_plan.memory_plan(tiny_config(tmp_path / arch, **{**shape, "arch": arch},
                                                       lora_dropout=DROPOUT)).rows["activations"]
             - memory_plan.memory_plan(tiny_config(tmp_path / arch, **{**shape, "arch": arch})).rows["activations"]
             for arch in ("llama", "qwen3", "mistral")}
    assert share["qwen3"] == share["mistral"] == share["llama"] > 0
    monkeypatch.setattr(memory_plan, "adapter_activations", lambda cfg, model, micro_batch: 0)  # planted
    plan = planned_run(tmp_path / "planted", group, "llama, every linear")
    assert plan["activations_measured"] != plan["rows"]["activations"]


def test_a_plan_without_the_frozen_base_fails_the_runs_own_check(tmp_path, group, monkeypatch):
    from zerotrain.errors import InvariantError
    from zerotrain.parallel import replicated

    # planted: the base counted as nothing by the replicated placement's answer, which the plan adds up
    monkeypatch.setattr(replicated, "frozen_parameters", lambda model: [])
    with pytest.raises(InvariantError, match="rank 0 holds .* bytes of frozen base, the plan 0"):
        planned_run(tmp_path, group, "gpt2, c_attn")


def test_invariant_b_checks_the_frozen_base_and_a_drifted_base_on_one_replica_is_caught(meshes):
    assert meshes["DP2"]["digests"][0] == meshes["DP2"]["digests"][1]
    caught = meshes["drifted"]["invariant"]
    assert "invariant (b) failed: parameters of rank(s) [1] differ from rank 0 at step 3" in caught


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"])
def test_every_llama_family_member_takes_adapters_on_its_seven_linears_starting_as_its_base(arch):
    from zerotrain.config import WINDOWED, ModelConfig
    from zerotrain.model import build_model

    cfg = ModelConfig(arch=arch, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, seq_len=16,
                      vocab_size=64, **({"sliding_window": 8} if arch in WINDOWED else {}))
    model, ids = build_model(cfg, 0), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
    lora.add_adapters(model, LoraConfig(rank=RANK, alpha=ALPHA), seed=0)
    adapted = {n.rsplit(".", 1)[-1] for n, _ in lora.adapted_modules(model, TARGETS)}
    assert adapted == set(TARGETS) and len(lora.adapter_names(model)) == 2 * len(TARGETS)
    with torch.no_grad():
        assert torch.equal(model(ids), before)


def test_a_phi3_runs_adapters_export_merged_and_refuse_peft_in_one_line(tmp_path, capfd):
    # Phi-3's Hugging Face layers fuse q, k, v (qkv_proj) and gate, up (gate_up_proj): no peft target holds an adapter
    # of zerotrain's q_proj alone
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--preset", "llama-tiny", "--arch", "phi3", "--data", "synthetic",
                       "--lora-rank", "4", "--steps", "2", "--ckpt-every", "2", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft")
    assert r.returncode == 2 and "is a Phi-3, whose Hugging Face model fuses q, k, v in qkv_proj" in r.stderr
    assert not (tmp_path / "adapter").exists()
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "merged"), "--format", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(ids).logits - load_model(str(out))(ids)).abs().max() < 1e-4


def test_a_lora_run_stopped_by_a_signal_without_a_save_cadence_records_its_base_and_resumes_on_it(base, tmp_path,
                                                                                                   capfd):
    # The stop's save is the run's only checkpoint: its manifest must name the base all the same (without it the
    # adapters would read as trained on a random base, and the resume on their own base would be refused)
    out = tmp_path / "run"
    argv = ["train", "--init-from", base, "--data", "synthetic", "--seq-len", "16", "--micro-batch", "2",
            "--lora-rank", "4", "--no-progress", "--log-every", "1", "--out", str(out)]  # a stop acts at a read step
    env = {**os.environ, "ZEROTRAIN_FAULTS": "sigterm@step=2"}
    r = subprocess.run([sys.executable, "-m", "zerotrain", *argv, "--steps", "5"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0 and "stopped by SIGTERM at step 2" in r.stdout + r.stderr, r.stderr[-2000:]
    manifest = json.load(open(out / "checkpoints" / "step_00000002" / "manifest.json"))
    assert [f["name"] for f in manifest["init_from"]["files"]] == ["model.safetensors"]
    r = zerotrain_here(capfd, *argv, "--steps", "5", "--resume", "auto")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.load(open(out / "summary.json"))
    assert summary["start_step"] == 2 and summary["steps"] == 5


@pytest.mark.parametrize("precision, planted", [("bf16", False), ("bf16", True), ("fp32", False)])
def test_the_frozen_base_is_built_in_the_runs_precision_from_its_first_byte(tmp_path, precision, planted, group,
                                                                            monkeypatch):
    """bf16: the base is never a whole fp32 copy first (Llama-3-8B: 32 GB on every rank before training). Planted: the
    base materialised in fp32 (as before), then rounded by the engine: caught where it is built."""
    from zerotrain.training import loop

    real, built = loop.materialise, {}

    def recorded(model, source, device, dtype=torch.float32):
        out = real(model, source, device, torch.float32 if planted else dtype)
        built.update({n: p.dtype for n, p in model.named_parameters()})
        return out

    monkeypatch.setattr(loop, "materialise", recorded)
    cfg = tiny_config(tmp_path, steps=1, seq_len=16, lora_rank=RANK, lora_alpha=ALPHA, precision=precision)
    engine = loop.build_engine(cfg, group)  # the module's process group: one per process at a time
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert built and (set(built.values()) == {want}) != planted
    assert all(p.dtype == want for _, p in engine.frozen)
