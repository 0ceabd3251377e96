"""A parameter with no gradient in a micro-batch (a conditional module's, an unrouted expert's) has gradient zero at
every stage: stages 1, 2 and 3 with accumulation, --grad-reduce step and micro-batch, train alike and like plain
torch, whose AdamW sees a zero gradient (weight decay and the moments still move the parameter).

The model is GPT-2 with block 0's first norm skipped by the sequences whose first token is even
(unused_params_jobs.py); its parameters lie in the last bucket and in block 0's unit, beside ones that get gradients.
"""

import functools

import pytest
import torch
import unused_params_jobs
from conftest import tiny_config

from zerotrain.data import BatchSchedule, make_source
from zerotrain.errors import InvariantError
from zerotrain.model import build_model, summed_token_loss
from zerotrain.parallel import GradientOrderError, GradientReducer, ShardedParameters, ZeroEngine
from zerotrain.parallel.optim import adamw_param_groups, build_adamw
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import accumulate_gradients, build_engine
from zerotrain.training.schedule import lr_at

pytestmark = pytest.mark.timeout(300)
STEPS = 3
SPLITS = [(1, "step"), (2, "step"), (2, "micro-batch"), (3, "step"), (3, "micro-batch")]


def config(tmp_path, zero, grad_reduce, nproc=1, accum=4):
    cfg = tiny_config(tmp_path / f"z{zero}-{grad_reduce}-{nproc}", nproc=nproc, zero=zero, grad_reduce=grad_reduce,
                      micro=8 // (nproc * accum), accum=accum, steps=STEPS)
    cfg.optim.grad_clip = 0.0  # the reference's plain AdamW
    return cfg


def torch_reference(cfg, final: bool = False) -> dict[str, torch.Tensor]:
    """The conditional model trained by plain torch on each step's whole global batch at once; a parameter no
    sequence used has a zero gradient (not None, which AdamW would skip)."""
    model = build_model(cfg.model, cfg.loop.seed)
    o = cfg.optim
    opt = build_adamw(adamw_param_groups(model.named_parameters(), o.weight_decay), o)
    source = make_source(cfg)
    with unused_params_jobs.norm_skipped_by_data(final=final):
        for step in range(STEPS):
            x, y, _ = source.sequences(step, range(8))
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            (summed_token_loss(model(x), y) / source.token_count(step, 8)).backward()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, o, cfg.loop.steps)
            opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def worst(params: dict, ref: dict) -> float:
    return max((params[n] - ref[n]).abs().max().item() for n in ref)


# AdamW's first steps turn float noise in near-zero gradients into steps of up to lr: test_engine's bound with
# accumulation. Measured: 1.7e-6 on one rank, 1.6e-6 to 1.8e-6 on 2; 2.6e-5 with the final norm skipped
BOUND = 1e-4


def old_end_of_backward(monkeypatch, stage3_release: bool = False) -> None:
    """Planted: the engine as it was, doing nothing as a backward ends (no bucket launched for a gradient that did
    not come, no count started again); `stage3_release`: the engine's end of backward kept (its buckets launched, the
    reduce schedule's counts started again), stage 3's placement's dropped (every unit released, the units' counts
    of gradients started again)."""
    if not stage3_release:
        monkeypatch.setattr(GradientReducer, "_end_backward", lambda self: setattr(self, "_end_queued", False))
        return
    monkeypatch.setattr(ShardedParameters, "end_backward", lambda self: None)


def test_a_parameter_unused_in_some_micro_batches_trains_alike_at_every_stage_and_like_torch_on_one_rank(
        tmp_path, one_rank, monkeypatch):
    runs = {}
    for zero, reduce in SPLITS:
        runs[zero, reduce] = unused_params_jobs.trained(config(tmp_path, zero, reduce), one_rank)
        assert runs[zero, reduce]["counts"]["unused"] > 0 and runs[zero, reduce]["counts"]["used"] > 0
    first = runs[1, "step"]
    for split, run in runs.items():  # one rank: every stage adds the same gradients in the same order
        assert run["losses"] == first["losses"], split
        assert all(torch.equal(run["params"][n], first["params"][n]) for n in first["params"]), split
    ref = torch_reference(config(tmp_path, 1, "step"))
    assert worst(first["params"], ref) < BOUND

    # The engine as it was: a bucket waiting for the skipped norm's gradient held up the next micro-batch's, whose
    # first gradient found its bucket reduced; the error now says it is the engine's doing, not the caller's.
    old_end_of_backward(monkeypatch)
    for zero in (2, 3):
        with pytest.raises(GradientOrderError, match=r"arrived after its bucket \d+ was reduced, though no earlier "
                                                     r"backward reduced this window.*an engine error, not the "
                                                     r"caller's"):
            unused_params_jobs.trained(config(tmp_path / "old", zero, "micro-batch"), one_rank)
    # Stage 3's units, whose count of gradients carried over, stayed whole into the next micro-batch: more
    # parameters whole at once than the plan, caught by the run's check after step 1.
    monkeypatch.undo()
    old_end_of_backward(monkeypatch, stage3_release=True)
    with pytest.raises(InvariantError, match=r"memory plan failed at step 1: rank 0 held [\d,]+ bytes of parameters"):
        unused_params_jobs.trained(config(tmp_path / "old-units", 3, "step"), one_rank)


def test_the_final_norm_unused_in_some_micro_batches_holds_no_bucket_back_and_trains_like_stage1(
        tmp_path, one_rank, monkeypatch):
    """The final norm is first in the backward and lies in the first bucket: a bucket waiting for its gradient would
    hold every bucket after it to the end of the backward (all of them, where --grad-reduce micro-batch plans two).
    The forward's output says which parameters backward will reach, so the bucket goes as soon as the others are in:
    the run's strict check of the plan after step 1 passes. Planted: the forward's reach not taken (every bucket
    waits for every parameter); the gradient peak is beyond the plan."""
    first = unused_params_jobs.trained(config(tmp_path, 1, "step"), one_rank, final=True)
    assert first["counts"]["unused"] > 0 and first["counts"]["used"] > 0
    for zero in (2, 3):
        run = unused_params_jobs.trained(config(tmp_path, zero, "micro-batch"), one_rank, final=True)
        assert run["losses"] == first["losses"] and \
            all(torch.equal(run["params"][n], first["params"][n]) for n in first["params"])
    assert worst(first["params"], torch_reference(config(tmp_path, 1, "step"), final=True)) < BOUND
    monkeypatch.setattr(GradientReducer, "_reached_by_forward", lambda self, *args: None)
    with pytest.raises(InvariantError, match=r"memory plan failed at step 1: rank 0 held [\d,]+ bytes of gradients "
                                             r"at once, the plan at most [\d,]+"):
        unused_params_jobs.trained(config(tmp_path / "planted", 2, "micro-batch"), one_rank, final=True)


def test_a_stage3_unit_with_a_parameter_unused_is_released_with_its_other_gradients(tmp_path, one_rank, monkeypatch):
    """Block 1's first norm skipped by data: block 1's unit waits only for the gradients its forward reached, and is
    released before block 0 is gathered for its backward, as the plan has it (the root and one block whole). Planted:
    the unit waits for every parameter, stays whole beside block 0, and the plan's strict check fails."""
    monkeypatch.setattr(unused_params_jobs, "SKIPPED", 1)
    step = unused_params_jobs.trained(config(tmp_path, 1, "step"), one_rank)
    three = unused_params_jobs.trained(config(tmp_path, 3, "step"), one_rank)
    assert three["counts"]["unused"] > 0 and three["losses"] == step["losses"]
    assert all(torch.equal(three["params"][n], step["params"][n]) for n in step["params"])
    monkeypatch.setattr(ShardedParameters, "_unit_waits", lambda self: [len(unit) for unit in self._unit_params])
    with pytest.raises(InvariantError, match=r"memory plan failed at step 1: rank 0 held [\d,]+ bytes of parameters "
                                             r"at once, the plan at most [\d,]+"):
        unused_params_jobs.trained(config(tmp_path / "planted", 3, "step"), one_rank)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every split of SPLITS on one start of 2 ranks, which see different sequences and so skip the norm in
    different micro-batches."""
    tmp = tmp_path_factory.mktemp("unused")
    cfgs = {f"{zero} {reduce}": config(tmp, zero, reduce, nproc=2, accum=2) for zero, reduce in SPLITS}
    job = functools.partial(unused_params_jobs.stages_job, cfgs=cfgs)
    first = next(iter(cfgs.values()))
    return run_job(job, first, time_limit=200), torch_reference(first)


def test_a_parameter_unused_in_some_micro_batches_on_one_rank_and_not_the_other_trains_alike_on_2_ranks(two_ranks):
    runs, ref = two_ranks
    counts = [c for run in runs.values() for c in run["counts"]]
    assert all(c.get("unused", 0) > 0 for c in counts) and all(c.get("used", 0) > 0 for c in counts)

    def same(a, b) -> bool:
        return a["losses"] == b["losses"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])

    # The contracts of the stages, with the unused parameter: stage 2 is stage 1's additions (bitwise), stage 3
    # stage 2's at either --grad-reduce; reducing per micro-batch adds in another order (within float noise).
    assert same(runs["2 step"], runs["1 step"])
    assert same(runs["3 step"], runs["2 step"])
    assert same(runs["3 micro-batch"], runs["2 micro-batch"])
    assert worst(runs["2 micro-batch"]["params"], runs["2 step"]["params"]) < 1e-5  # measured: 1.4e-6
    for name, run in runs.items():
        assert worst(run["params"], ref) < BOUND, name


def test_a_backward_after_its_window_was_reduced_is_said_to_be_the_callers_and_the_next_window_starts_clean(
        tmp_path, one_rank, monkeypatch):
    """Every micro-batch run outside no_sync (the caller's mistake): the first backward reduces the window, the
    second's first gradient finds its bucket reduced, and the error says what the caller must do (not that the
    engine erred). zero_grad then starts a clean window: the next steps are a fresh engine's, bitwise. Planted: the
    window's start resets the counts only, and the reduce-scatters the failed window left in flight and its bucket
    buffers (one with the late gradient added) carry into the next window."""
    from test_engine import run_steps

    cfg = config(tmp_path, 2, "step")
    batch = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum, rank=0,
                          world_size=1).batch(0)
    real = GradientReducer.no_sync

    def after_a_misused_window():
        engine = build_engine(cfg, one_rank)
        with monkeypatch.context() as m:
            m.setattr(GradientReducer, "no_sync", lambda self, enabled=True: real(self, False))
            engine.zero_grad()
            with pytest.raises(GradientOrderError) as caught:
                accumulate_gradients(engine, batch)
        run_steps(engine, cfg, 2)
        return engine, caught.value.args[0]

    engine, message = after_a_misused_window()
    assert message.endswith("arrived after its bucket was reduced: run the backward of every micro-batch but the "
                            "last inside engine.no_sync(), and engine.zero_grad() before the next window")
    fresh = build_engine(cfg, one_rank)
    run_steps(fresh, cfg, 2)
    assert torch.equal(engine.held_params, fresh.held_params)

    def counts_only(self):
        self._ready, self._launched = [0] * len(self._ready), 0
        self._end_queued = self._reduces_now = self._window_reduced = False

    monkeypatch.setattr(GradientReducer, "_reset_window", counts_only)
    planted, _ = after_a_misused_window()
    assert not torch.equal(planted.held_params, fresh.held_params)
