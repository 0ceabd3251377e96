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
from model_folders import read_weights
from reference_adamw import reference_adamw, reference_step
from test_deepseek import hf_model
from test_gemma import one_thread
from test_qwen35 import ROWS, STEPS, config_for, gaps, weights_of

from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.model import group_routing
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(900)
SPEED = 0.001
LIMIT = 600


def transformers_run(folder, lrs: list[float], scratch) -> dict:
    """The run's steps (config_for's batches, at learning rates `lrs`) in a plain loop over transformers' model of
    `folder` (the class its config.json names: DeepseekV3ForCausalLM, Mistral4ForCausalLM), each router's bias (where
    the family has one) moved after each optimizer step from the step's loads (its top-k choices over the step's
    rows); the final weights saved under `scratch` and read back as zerotrain's."""
    cfg = config_for(folder, scratch / "run")
    torch.manual_seed(0)
    model_class = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    hf = model_class.from_pretrained(str(folder), attn_implementation="eager").train()
    optimizer = reference_adamw(hf, lrs[0])
    move_biases = routing_bias_updates(hf.modules())
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "grad_norm": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        tokens = int((micro.labels != IGNORE).sum())
        logits = hf(micro.inputs).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), micro.labels.flatten(), ignore_index=IGNORE,
                                           reduction="sum") / tokens
        out["grad_norm"].append(reference_step(optimizer, hf, loss, lr))
        move_biases()
        out["loss"].append(float(loss.detach()))
    hf.save_pretrained(str(scratch / "weights"))
    out["weights"] = read_weights(scratch / "weights")
    return out


def routing_bias_updates(modules):
    """The auxiliary-loss-free update of transformers' routers among `modules`: their top-k choices counted by a
    forward hook; the function returned moves each router's bias by SPEED x sign(mean load - load) from the loads
    counted since its last call (after an optimizer step, as zerotrain's RoutingBias does)."""
    routers = [m for m in modules if hasattr(m, "e_score_correction_bias")]
    loads = {}

    def count(router, inputs, output):
        loads[router] = loads.get(router, 0) + torch.bincount(output[2].flatten(), minlength=router.num_experts)

    for router in routers:
        router.register_forward_hook(count)

    @torch.no_grad()
    def move_biases():
        for router in routers:
            load = loads.pop(router).double()
            router.e_score_correction_bias += (SPEED * torch.sign(load.mean() - load)).float()

    return move_biases


def in_turn_runs(jobs: dict, time_limit: float = LIMIT) -> dict:
    """Run {name: (job, config)} in turn on one start of 2 ranks; {name: {"loss", "grad_norm", "lr", "read"}} from
    each job's records, or its report where it returned an error (a planted bug the replica invariant stops)."""
    names, pairs = list(jobs), list(jobs.values())
    reports = run_job(functools.partial(in_turn_job, jobs=pairs), pairs[0][1], time_limit=time_limit)
    return {name: report if "error" in report else
            {key: [r[key] for r in report["records"]] for key in ("loss", "grad_norm", "lr")} | {
                "read": report["summary"]["per_rank"]["init_bytes_read"]}
            for name, report in zip(names, reports)}


def two_rank_runs(folder, tmp, *flags: str, more: dict | None = None) -> dict:
    """`folder` trained at ZeRO-3 and at --ep 2 (one row a micro-batch) and as `more`'s {name: (job, its flags)}, each
    with `flags`, in turn on one start of 2 ranks, each run's folder under `tmp`: in_turn_runs' figures and each run's
    final "weights"; "file bytes": the size of `folder`'s weights."""
    from zerotrain.training.loop import train_job

    runs = {"zero3": (train_job, ("--zero", "3", "--micro-batch", "1")),
            "ep2": (train_job, ("--ep", "2", "--micro-batch", "1")), **(more or {})}
    out = in_turn_runs({name: (job, config_for(folder, tmp / name.replace(" ", "-"), *flags, "--nproc", "2", *its))
                        for name, (job, its) in runs.items()})
    for name in runs:
        out[name]["weights"] = weights_of(tmp / name.replace(" ", "-"))
    out["file bytes"] = (folder / "model.safetensors").stat().st_size
    return out


def one_rank_run(cfg, comm) -> dict:
    """`cfg`'s run in this process: {"loss", "grad_norm", "lr"} of each step, and the final "weights"."""
    from zerotrain.training.loop import train

    result = train(cfg, comm, announce=False)
    return {key: [r[key] for r in result.records] for key in ("loss", "grad_norm", "lr")} | {
        "weights": {n: p.detach().clone() for n, p in result.engine.model.named_parameters()}}


def exported_run(run, out, hf_class: str, loader=transformers.AutoModelForCausalLM):
    """`zerotrain export RUN OUT --format hf --dtype fp32`: (transformers' model of OUT, loaded by `loader` and
    checked to be `hf_class`; OUT's weights as zerotrain reads them back)."""
    from zerotrain.cli.main import main

    assert main(["export", str(run), str(out), "--format", "hf", "--dtype", "fp32"]) == 0
    theirs = loader.from_pretrained(str(out))
    assert type(theirs).__name__ == hf_class
    return theirs, read_weights(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"1 rank" | "zero3" | "ep2" | "sign flipped" | "resumed" | "transformers": {"loss", "grad_norm", "weights"},
    "folder": the 1-rank run}."""
    tmp = tmp_path_factory.mktemp("deepseek-runs")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    torch.manual_seed(0)
    folder = tmp / "model"
    hf_model(folder, initializer_range=0.02)
    speed = ("--routing-bias-speed", str(SPEED))
    out = two_rank_runs(folder, tmp, *speed)
    with world_of_one() as comm:
        for name in ("1 rank", "sign flipped"):
            with pytest.MonkeyPatch.context() as mp:
                if name == "sign flipped":
                    mp.setattr("zerotrain.training.routing_bias.bias_update",
                               lambda loads, speed: -group_routing.bias_update(loads, speed))
                out[name] = one_rank_run(config_for(folder, tmp / name.replace(" ", "-"), *speed, "--ckpt-every", "4"),
                                         comm)
        # the 1-rank run resumed from its step 4: steps 5-8 again, the biases restored from the checkpoint
        step4 = next((tmp / "1-rank").rglob("step_00000004"))
        out["resumed"] = one_rank_run(config_for(folder, tmp / "resumed", *speed, "--resume", str(step4)), comm)
        out["folder"] = tmp / "1-rank"
        out["transformers"] = transformers_run(folder, out["1 rank"]["lr"], tmp / "oracle")
    stack.close()
    return out


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2"])
def test_eight_steps_train_as_transformers_adamw_and_the_bias_rule_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert_trained_as_transformers(ours, theirs)
    assert_biases_moved_as_transformers_did(ours, theirs, start_biases(hf_model))


def assert_trained_as_transformers(ours: dict, theirs: dict):
    """The run's 8 steps: each one's loss and gradient norm, and the final weights, within 1e-5 relative of
    transformers' loop's (test_qwen35's gaps)."""
    assert len(ours["loss"]) == STEPS
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap


def start_biases(build, **changes) -> dict:
    """The routers' biases the runs started from: their folder's model built again by `build` (test_deepseek's
    hf_model or a family's, which seed themselves), at the training folders' initializer_range 0.02."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf = build(d, initializer_range=0.02, **changes)
    return {n: b.detach().clone() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}


def assert_biases_moved_as_transformers_did(ours: dict, theirs: dict, start: dict):
    """Every router's bias (each of `start`'s, the only ones transformers' loop has) moved by the rule, and to within
    1e-6 of where transformers' loop moved it."""
    assert start and set(start) == {n for n in theirs["weights"] if n.endswith("e_score_correction_bias")}
    for n in start:
        assert not torch.equal(theirs["weights"][n], start[n])
        assert (ours["weights"][n] - theirs["weights"][n]).abs().max() < 1e-6, n


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
    theirs, exported = exported_run(runs["folder"], tmp_path / "out", "DeepseekV3ForCausalLM")
    ours = runs["1 rank"]["weights"]
    assert all(torch.equal(p, ours[n]) for n, p in exported.items())
    loaded = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    for n in [n for n in ours if n.endswith("e_score_correction_bias")]:
        assert torch.equal(loaded[n], ours[n])
    assert gaps(runs["1 rank"], runs["transformers"])["weights"] <= 1e-5


def test_the_bias_update_with_its_sign_flipped_is_caught(runs):
    biases = [n for n in runs["transformers"]["weights"] if n.endswith("e_score_correction_bias")]
    assert max((runs["sign flipped"]["weights"][n] - runs["transformers"]["weights"][n]).abs().max()
               for n in biases) > 1e-3
