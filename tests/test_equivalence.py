"""`zerotrain equivalence` and the one-round-per-step contract: each check shown to pass, and shown to catch a bug."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import json
from collections import Counter
from unittest import mock

import pytest
from dist_jobs import in_turn_job

from zerotrain.cli.commands.equivalence import BOUND, check, equivalence_job
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.parallel import engine as zero
from zerotrain.runtime.launch import run_job
from zerotrain.training import loop
from zerotrain.training.loop import train

SAFETY = 5  # float reordering must stay this many times below the bound on the default config


@dataclasses.dataclass
class Ran:
    """What the user sees of one `zerotrain equivalence`."""

    returncode: int
    stdout: str
    stderr: str


def run_equivalence(tmp_path, capsys, *flags: str) -> tuple[Ran, dict]:
    """The command through its entry point, in this process (it starts the ranks itself); its output and report."""
    report = tmp_path / "equivalence.json"
    capsys.readouterr()
    code = main(["equivalence", "--json", str(report), *flags])
    out, err = capsys.readouterr()
    return Ran(code, out, err), (json.loads(report.read_text()) if report.exists() else {})


def failed(row: dict) -> set[str]:
    return {name for name, ok in row["criteria"].items() if not ok}


def test_equivalence_passes_on_the_default_config_within_relative_bounds_and_catches_the_wrong_weightings(tmp_path,
                                                                                                          capsys):
    proc, report = run_equivalence(tmp_path, capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and report["passed"]
    assert report["bound"] == BOUND == 1e-5
    assert report["config"]["data"]["data"] == "synthetic-varlen"  # the TOML key of --data
    assert len(set(report["micro_batch_tokens"])) > 1  # micro-batches really carry different token counts
    assert [row["split"] for row in report["checked"]] == ["1 x 16 x 1", "1 x 2 x 8", "2 x 2 x 4"]
    for row in report["checked"]:
        assert row["criteria"] == {"initial": True, "rounds": True, "gradient": True, "sgd": True, "adamw": True}
        assert row["initial_params_match"]
        assert row["grad_norm"] > report["config"]["optim"]["grad_clip"]  # clipping is part of the checked step
        for name, key in (("gradient", "grad_rel_diff"), ("sgd", "sgd_rel_diff"), ("adamw", "adamw_rel_diff")):
            assert row[key] <= BOUND / SAFETY, (row["split"], name, row[key])
            assert row["margins"][name] is None or row["margins"][name] == pytest.approx(BOUND / row[key])
        assert row["grad_max_abs_diff"] <= BOUND and row["loss_rel_diff"] <= BOUND
        # one rank's gradients stay in its parameters: nothing to reduce-scatter
        assert row["reduce_scatter_rounds"] == (0 if row["ranks"] == 1 else 1) and row["all_gather_rounds"] == 1
    chunked = report["checked"][1:]
    assert all(row["grad_rel_diff"] > 0 for row in chunked)  # the splits really reorder the sums
    for name, key in (("gradient", "grad_rel_diff"), ("sgd", "sgd_rel_diff"), ("adamw", "adamw_rel_diff")):
        assert report["margins"][name] == pytest.approx(BOUND / max(row[key] for row in report["checked"]))
        assert report["margins"][name] >= SAFETY
    assert "margins (bound / largest difference over the checked splits): gradient " in proc.stdout
    # AdamW against the full batch's AdamW is reported, and is far from the bound: why it is not a criterion
    assert report["adamw_vs_full_batch_rel_diff"] > BOUND
    assert {row["weighting"] for row in report["wrong_variants"]} == {"unscaled", "mean"}
    assert report["wrong_variants_caught"]
    for row in report["wrong_variants"]:
        # the gradient and the SGD step miss by far; AdamW, checked on the split's own gradient, does not follow them
        assert failed(row) == {"gradient", "sgd"} and row["grad_rel_diff"] > 1000 * BOUND, row
        assert row["adamw_rel_diff"] <= BOUND
    assert proc.stdout.count("FAIL (caught: gradient, sgd)") == 2


def test_equivalence_exits_nonzero_when_the_loss_scaling_is_broken(tmp_path, capsys):
    proc, report = run_equivalence(tmp_path, capsys, "--break", "scaling")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not report["passed"] and report["break"] == "scaling"
    chunked = [row for row in report["checked"] if row["micro_batch"] * row["ranks"] < report["global_batch"]]
    assert chunked and all(failed(row) == {"gradient", "sgd"} and row["grad_rel_diff"] > 1000 * BOUND
                           and row["grad_max_abs_diff"] > 1e-4 for row in chunked)
    whole = [row for row in report["checked"] if row not in chunked]
    assert whole and all(row["passed"] for row in whole)  # one micro-batch is its own mean: unscaled is exact


def test_per_micro_batch_mean_weighting_on_varlen_data_misses_the_bound_by_far(tmp_path, capsys):
    proc, report = run_equivalence(tmp_path, capsys, "--break", "mean-weighting")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {row["split"]: row for row in report["checked"]}
    # One micro-batch is its own mean: exact. Chunks of unequal token counts are not.
    assert rows["1 x 16 x 1"]["grad_rel_diff"] <= BOUND and rows["1 x 16 x 1"]["passed"]
    for split in ("1 x 2 x 8", "2 x 2 x 4"):
        assert rows[split]["grad_rel_diff"] > 100 * BOUND
        assert rows[split]["grad_max_abs_diff"] > 1e-2
        assert not rows[split]["passed"]


def reduced_once_a_step():
    """Planted bug: the engine reduces a ZeRO-3 window's gradients once a step where the plan reduces each micro-batch
    into the shard: its window holds a full gradient (--grad-reduce step's memory), and its rounds say so."""
    real_init = zero.ZeroEngine.__init__

    def init_once_a_step(self, *args, **kw):
        real_init(self, *args, **kw)
        self.per_micro_batch = False

    return mock.patch.object(zero.ZeroEngine, "__init__", init_once_a_step)


def zero3_equivalence_job(cfg: Config, comm: Comm, **kwargs) -> list[dict] | None:
    """equivalence_job as the command runs it, then with reduced_once_a_step planted; the planted rows say so."""
    rows = equivalence_job(cfg, comm, **kwargs)
    with reduced_once_a_step():
        planted_rows = equivalence_job(cfg, comm, **kwargs)
    return None if comm.rank else rows + [{**row, "planted": True} for row in planted_rows]


def test_equivalence_at_zero_3_passes_with_one_reduce_scatter_round_per_micro_batch_and_catches_one_per_step():
    """ZeRO-3 reduces each micro-batch's gradients into the owned shard (--grad-reduce auto): the engine plans one
    reduce-scatter round per micro-batch and no all-gather after the update, and `equivalence --zero 3` checks that,
    at its defaults, as docs/parallelism.md runs it. An engine that reduces once a step there is caught."""
    report = check(equivalence_config("--zero", "3"), job=zero3_equivalence_job, time_limit=120)
    real = {row["split"]: row for row in report["checked"] if not row.get("planted")}
    planted = {row["split"]: row for row in report["checked"] if row.get("planted")}
    assert all(row["passed"] for row in real.values()), real
    for split, row in real.items():
        assert (row["reduce_scatter_rounds"], row["all_gather_rounds"]) == (row["accum"], 0), split
    assert planted["1 x 16 x 1"]["passed"]  # one micro-batch: once a step is once a micro-batch
    for split in ("1 x 2 x 8", "2 x 2 x 4"):
        assert failed(planted[split]) == {"rounds"} and planted[split]["reduce_scatter_rounds"] == 1, planted[split]


# ------------------------------------------------------------------ bugs planted in the code `zerotrain train` runs
# Each bug is planted in the spawned ranks, around the command's own job, and removed after it: each function
# gives a context manager (mock.patch.object) that plants it.
def local_token_scaling():
    """Planted bug: the loop's accumulation divides by this rank's token count instead of the global one."""
    real = loop.accumulate_gradients

    def locally_scaled(engine, batch, forward=None, loss_factor=1.0):
        return real(engine, dataclasses.replace(batch, global_tokens=batch.local_tokens), forward, loss_factor)

    return mock.patch.object(loop, "accumulate_gradients", locally_scaled)


def adamw_one_step_ahead():
    """Planted bug: the engine's AdamW step counter starts at 1, so the first update gets step 2's bias correction."""
    real_init = zero.ZeroEngine.__init__

    def init_one_step_ahead(self, *args, **kw):
        real_init(self, *args, **kw)
        for state in self.optimizer.state.values():
            state["step"] += 1

    return mock.patch.object(zero.ZeroEngine, "__init__", init_one_step_ahead)


def unclipped_apply():
    """Planted bug: the engine's apply never clips by the global gradient norm."""
    real_apply = zero.ZeroEngine.apply
    return mock.patch.object(zero.ZeroEngine, "apply", lambda self, lr, grad_norm: real_apply(self, lr, 0.0))


def publishing_twice():
    """Planted bug: the engine's apply all-gathers the updated parameters a second time (its own _publish_params,
    once more): the values are the same, the parameter traffic doubles."""
    real_apply = zero.ZeroEngine.apply

    def apply_and_publish_again(self, lr, grad_norm):
        real_apply(self, lr, grad_norm)
        self.wait_params()
        self._publish_params(wait=not self.gather_behind_forward)

    return mock.patch.object(zero.ZeroEngine, "apply", apply_and_publish_again)


def ignored_no_sync():
    """Planted bug: the engine's no_sync holds nothing back, so every micro-batch's backward launches its buckets'
    reduce-scatters from the engine's own gradient hook."""
    real = zero.ZeroEngine.no_sync
    return mock.patch.object(zero.ZeroEngine, "no_sync", lambda self, enabled=True: real(self, False))


# name: (the bug, the --overlap its check runs with)
PLANTED = {"local-token-scaling": (local_token_scaling, None),
           "adamw-bias-correction": (adamw_one_step_ahead, None),
           "no-clipping": (unclipped_apply, None),
           "all-gather-twice": (publishing_twice, None)}


def planted_equivalence_job(cfg: Config, comm: Comm, **kwargs) -> list[dict] | None:
    """equivalence_job once per PLANTED bug, each planted for its own run only; every row names its bug."""
    rows = []
    for name, (bug, overlap) in PLANTED.items():
        c = copy.deepcopy(cfg)
        c.parallel.overlap = overlap or c.parallel.overlap
        with bug():
            out = equivalence_job(c, comm, **kwargs)
        rows += [{**row, "planted": name} for row in out or []]
    return rows if comm.rank == 0 else None


def equivalence_config(*flags: str) -> Config:
    return config_from_args(build_parser().parse_args(["equivalence", *flags]))


@pytest.fixture(scope="module")
def planted() -> dict[str, dict]:
    """check()'s verdict on each PLANTED bug: {name: {"passed", "checked"}}, as check() would give it for that bug
    alone. The bugs take turns on the ranks of one check (one rank, then the configured ranks): starting ranks
    costs more than the tiny model's step."""
    report = check(equivalence_config(), job=planted_equivalence_job, time_limit=120)
    out = {}
    for name in PLANTED:
        checked = [row for row in report["checked"] if row["planted"] == name]
        out[name] = {"checked": checked, "passed": all(row["passed"] for row in checked)}  # as check() decides
    assert all(out[name]["checked"] for name in PLANTED)
    return out


def test_a_local_token_count_scaling_planted_in_the_loops_accumulation_fails_equivalence(planted):
    report = planted["local-token-scaling"]
    assert not report["passed"]
    rows = {row["split"]: row for row in report["checked"]}
    # On one rank the local count is the global one: the bug is invisible there, and the rows pass.
    assert rows["1 x 16 x 1"]["passed"] and rows["1 x 2 x 8"]["passed"]
    bad = rows["2 x 2 x 4"]
    assert failed(bad) == {"gradient", "sgd"} and bad["grad_rel_diff"] > 0.1, bad
    assert bad["adamw_rel_diff"] <= BOUND  # the update of the gradient it was given is still AdamW's


@pytest.mark.parametrize("bug, fails, on_one_micro_batch", [
    # AdamW's step against PyTorch's on the same gradient; the SGD run's optimizer is not the engine's AdamW
    ("adamw-bias-correction", {"adamw"}, True),
    # SGD's step is proportional to the clip factor; AdamW's first step sees it only through eps, on near-zero values
    ("no-clipping", {"sgd", "adamw"}, True),
    # the parameters stay right (the second all-gather brings the same values), on one micro-batch too
    ("all-gather-twice", {"rounds"}, True),
], ids=["adamw-bias-correction", "no-clipping", "all-gather-twice"])
def test_each_criterion_fails_on_its_own_while_the_gradient_passes(planted, bug, fails, on_one_micro_batch):
    report = planted[bug]
    assert not report["passed"]
    for row in report["checked"]:
        assert row["criteria"]["gradient"] and row["grad_rel_diff"] <= BOUND, row
        one_micro_batch = row["ranks"] == 1 and row["accum"] == 1
        assert failed(row) == (fails if on_one_micro_batch or not one_micro_batch else set()), row
    rows = {row["split"]: row for row in report["checked"]}
    if "adamw" in fails:
        assert rows["2 x 2 x 4"]["adamw_rel_diff"] > 1000 * BOUND
    if "sgd" in fails:  # unclipped, the step is grad_norm / clip times the clipped one
        assert rows["2 x 2 x 4"]["sgd_rel_diff"] == pytest.approx(rows["2 x 2 x 4"]["grad_norm"] - 1, rel=1e-3)
    if "rounds" in fails:
        assert rows["2 x 2 x 4"]["all_gather_rounds"] == 2 and rows["2 x 2 x 4"]["reduce_scatter_rounds"] == 1


# ------------------------------------------------------------------ one collective round per optimizer step
def rounds_job(cfg: Config, comm: Comm, *, accums: list[int], bug=None) -> dict | None:
    """Train 2 steps at each accumulation with `bug` (a PLANTED-style patch) planted if given; collective rounds per
    optimizer step (calls per bucket), or the GradientOrderError that stopped the run and the reduce-scatters
    issued before it."""
    out = {}
    with bug() if bug else contextlib.nullcontext():
        for accum in accums:
            c = copy.deepcopy(cfg)
            c.loop.accum = accum
            before = Counter(comm.calls)
            try:
                engine = train(c, comm).engine
            except zero.GradientOrderError as e:
                gc.collect()  # the engine's unwaited reduce-scatters go while the process group is alive
                calls = Counter(comm.calls) - before
                out[accum] = {"error": str(e), "reduce_scatter_calls": calls["reduce_scatter_grads"]}
                continue
            calls = Counter(comm.calls) - before
            buckets = len(engine.layout.buckets)
            out[accum] = {"buckets": buckets,
                          "reduce_scatter": calls["reduce_scatter_grads"] / (c.loop.steps * buckets),
                          "all_gather": calls["all_gather_params"] / (c.loop.steps * buckets)}
    return out if comm.rank == 0 else None


@pytest.fixture(scope="module")
def rounds() -> dict:
    """Rounds per step of the real engine at accumulation 1, 4 and 16, then of the engine with each planted bug at
    4 ("all-gather-twice", "ignored-no-sync"); all on one start of 2 ranks, the planted ones last."""
    cfg = Config()
    cfg.data.source = "synthetic"
    cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.steps = 2, 1, 2
    cfg.parallel.bucket_mb = 0.02  # several buckets, so "one round" means one call per bucket
    cfg.parallel.overlap = "on"  # buckets launch from backward's hooks, where a missed no_sync would show
    cfg.logging.progress, cfg.loop.check_every, cfg.launch.timeout = False, 0, 60.0
    cfg.checkpoint.final_save = False  # the rounds of training alone
    jobs = [(functools.partial(rounds_job, accums=[1, 4, 16]), cfg),
            (functools.partial(rounds_job, accums=[4], bug=publishing_twice), cfg),
            (functools.partial(rounds_job, accums=[4], bug=ignored_no_sync), cfg)]
    real, twice, no_sync = run_job(functools.partial(in_turn_job, jobs=jobs), cfg, time_limit=120)
    return {**real, "all-gather-twice": twice, "ignored-no-sync": no_sync}


def test_one_reduce_scatter_round_and_one_all_gather_round_per_step_for_accum_1_4_16(rounds):
    for accum in (1, 4, 16):
        assert rounds[accum]["buckets"] > 1
        assert rounds[accum]["reduce_scatter"] == 1, (accum, rounds[accum])
        assert rounds[accum]["all_gather"] == 1, (accum, rounds[accum])


def test_round_count_catches_an_engine_that_all_gathers_twice_per_step(rounds):
    assert rounds["all-gather-twice"][4] == {**rounds[4], "all_gather": 2}


def test_an_engine_whose_no_sync_holds_nothing_back_stops_before_a_second_reduce_scatter_round(rounds):
    stopped = rounds["ignored-no-sync"][4]
    # the first micro-batch's backward reduced every bucket; the second's first gradient found its bucket reduced
    assert stopped["reduce_scatter_calls"] == rounds[4]["buckets"]
    assert stopped["error"].startswith("the gradient of ") and "arrived after its bucket was reduced: run the " \
        "backward of every micro-batch but the last inside engine.no_sync()" in stopped["error"]
