"""DeepSeek-V3 training against a plain transformers + AdamW loop that moves each router's e_score_correction_bias
by the auxiliary-loss-free rule after every step (speed x sign(mean load - load), the loads counted from its
routers' choices): 8 steps of --init-from at 1 rank (in this process), at ZeRO-3 on 2 ranks and at --ep 2 (one start
of 2 ranks for both) equal it: losses and gradient norms within 1e-5 relative, the final weights (the biases among
them) within 1e-5 relative (measured: losses 2.4e-7, 1.9e-7, 2.2e-7; weights 1.0e-7, 1.2e-7, 1.0e-7), every bias
within 1e-6 of the loop's; the bias update's sign flipped in the function the run calls is caught. At ZeRO-3 each
rank reads its slice of --init-from's file; resumed from step 4 the run ends bitwise where the uninterrupted one
does (the biases are checkpointed as parameters); `zerotrain export --format hf` of the run loads in transformers as
DeepseekV3ForCausalLM with the run's weights bitwise."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import torch.nn as nn
import transformers
from conftest import world_of_one
from dist_jobs import in_turn_job
from test_deepseek import hf_model
from test_gemma import one_thread
from test_qwen35 import ROWS, config_for, gaps, weights_of

from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.hub import init_from
from zerotrain.model import build_model, group_routing, is_decayed
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(900)
SPEED = 0.001
LIMIT = 600


def transformers_run(cfg, folder, lrs: list[float], saved) -> dict:
    """The steps in a plain loop over transformers' model (the class its config.json names: DeepseekV3ForCausalLM,
    Mistral4ForCausalLM), each router's bias (where the family has one) moved after each optimizer step from the
    step's loads (its top-k choices over the step's rows); the final weights read back as zerotrain's."""
    torch.manual_seed(0)
    model_class = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    hf = model_class.from_pretrained(str(folder), attn_implementation="eager").train()
    named = list(hf.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if is_decayed(n, p)], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if not is_decayed(n, p)], "weight_decay": 0.0}],
                                  lr=lrs[0], betas=(0.9, 0.95), eps=1e-8)
    routers = [m for m in hf.modules() if hasattr(m, "e_score_correction_bias")]
    loads = {}

    def count(router, inputs, output):
        loads[router] = loads.get(router, 0) + torch.bincount(output[2].flatten(), minlength=router.num_experts)

    for router in routers:
        router.register_forward_hook(count)
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "grad_norm": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        tokens = int((micro.labels != IGNORE).sum())
        logits = hf(micro.inputs).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), micro.labels.flatten(), ignore_index=IGNORE,
                                           reduction="sum") / tokens
        optimizer.zero_grad()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        with torch.no_grad():
            for router in routers:
                load = loads.pop(router).double()
                router.e_score_correction_bias += (SPEED * torch.sign(load.mean() - load)).float()
        out["loss"].append(float(loss.detach()))
    hf.save_pretrained(str(saved))
    source = init_from.weight_source(str(saved))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    out["weights"] = {n: p.detach() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"1 rank" | "zero3" | "ep2" | "sign flipped" | "transformers": {"loss", "grad_norm", "weights"}, "resumed":
    {"weights"}}."""
    from zerotrain.training.loop import train, train_job

    tmp = tmp_path_factory.mktemp("deepseek-runs")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    torch.manual_seed(0)
    folder = tmp / "model"
    hf_model(folder, initializer_range=0.02)
    speed = ("--routing-bias-speed", str(SPEED))
    two = {"zero3": config_for(folder, tmp / "zero3", *speed, "--nproc", "2", "--zero", "3", "--micro-batch", "1"),
           "ep2": config_for(folder, tmp / "ep2", *speed, "--nproc", "2", "--ep", "2", "--micro-batch", "1")}
    reports = run_job(functools.partial(in_turn_job, jobs=[(train_job, cfg) for cfg in two.values()]),
                      next(iter(two.values())), time_limit=LIMIT)
    out = {}
    for name, report in zip(two, reports):
        out[name] = {key: [r[key] for r in report["records"]] for key in ("loss", "grad_norm")} | {
            "weights": weights_of(tmp / name), "read": report["summary"]["per_rank"]["init_bytes_read"]}
    out["file bytes"] = (folder / "model.safetensors").stat().st_size
    with world_of_one() as comm:
        for name in ("1 rank", "sign flipped"):
            with pytest.MonkeyPatch.context() as mp:
                if name == "sign flipped":
                    mp.setattr("zerotrain.training.routing_bias.bias_update",
                               lambda loads, speed: -group_routing.bias_update(loads, speed))
                result = train(config_for(folder, tmp / name.replace(" ", "-"), *speed, "--ckpt-every", "4"), comm,
                               announce=False)
            out[name] = {key: [r[key] for r in result.records] for key in ("loss", "grad_norm")} | {
                "weights": {n: p.detach().clone() for n, p in result.engine.model.named_parameters()}}
            if name == "1 rank":
                lrs = [r["lr"] for r in result.records]
        # the 1-rank run resumed from its step 4: steps 5-8 again, the biases restored from the checkpoint
        step4 = next((tmp / "1-rank").rglob("step_00000004"))
        result = train(config_for(folder, tmp / "resumed", *speed, "--resume", str(step4)), comm, announce=False)
        out["folder"] = tmp / "1-rank"
        out["resumed"] = {"weights": {n: p.detach().clone() for n, p in result.engine.model.named_parameters()}}
        out["transformers"] = transformers_run(config_for(folder, tmp / "oracle"), folder, lrs, tmp / "oracle-weights")
    stack.close()
    return out


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2"])
def test_eight_steps_train_as_transformers_adamw_and_the_bias_rule_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert len(ours["loss"]) == 8
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap
    biases = [n for n in theirs["weights"] if n.endswith("e_score_correction_bias")]
    start = transformers_start_biases(runs)
    for n in biases:  # every bias moved by the rule, and to where transformers' loop moved it
        assert not torch.equal(theirs["weights"][n], start[n])
        assert (ours["weights"][n] - theirs["weights"][n]).abs().max() < 1e-6, n


def transformers_start_biases(runs) -> dict:
    """The biases the runs started from: the fixture's model built again (hf_model seeds itself)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf = hf_model(d, initializer_range=0.02)
    return {n: b.detach().clone() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}


def test_init_from_at_zero3_reads_each_ranks_slice_of_the_folder(runs):
    """Each of the 2 ranks read its owned ranges' rows of --init-from's file, not the whole model."""
    reads = runs["zero3"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.75 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_a_resume_continues_the_biases_bitwise(runs):
    """Resumed from step 4, the run's step 8 equals the uninterrupted run's bitwise, the routers' biases (moved by
    the rule at every step, kept in the checkpoint as parameters) among the weights."""
    ours, resumed = runs["1 rank"]["weights"], runs["resumed"]["weights"]
    assert all(torch.equal(resumed[n], ours[n]) for n in ours)
    assert any(n.endswith("e_score_correction_bias") for n in ours)


def test_the_trained_run_exports_as_deepseek_v3_with_its_trained_weights(runs, tmp_path):
    """`zerotrain export RUN OUT --format hf` of the 8-step run: transformers loads DeepseekV3ForCausalLM with the
    run's weights bitwise (in fp32, the routers' biases into their buffers) and they are the transformers loop's within
    1e-5 relative."""
    from zerotrain.cli.main import main

    assert main(["export", str(runs["folder"]), str(tmp_path / "out"), "--format", "hf", "--dtype", "fp32"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    source = init_from.weight_source(str(tmp_path / "out"))
    exported = build_model(source.model, 0)
    init_from.load_local(exported, source, {}, 0)
    ours = runs["1 rank"]["weights"]
    assert all(torch.equal(p.detach(), ours[n]) for n, p in exported.named_parameters())
    loaded = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    for n in [n for n in ours if n.endswith("e_score_correction_bias")]:
        assert torch.equal(loaded[n], ours[n])
    assert gaps(runs["1 rank"], runs["transformers"])["weights"] <= 1e-5


def test_the_bias_update_with_its_sign_flipped_is_caught(runs):
    biases = [n for n in runs["transformers"]["weights"] if n.endswith("e_score_correction_bias")]
    assert max((runs["sign flipped"]["weights"][n] - runs["transformers"]["weights"][n]).abs().max()
               for n in biases) > 1e-3
