"""`zerotrain equivalence` and the one-round-per-step contract: each check shown to pass, and shown to catch a bug."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from collections import Counter

from zerotrain.cli.commands.equivalence import BOUND
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.parallel import engine as zero
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import train

CLI_TIMEOUT_S = 240


def run_equivalence(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "equivalence.json"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "equivalence", "--json", str(report), *flags],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    return proc, (json.loads(report.read_text()) if report.exists() else {})


def test_equivalence_passes_on_the_default_config_and_catches_the_wrong_weightings(tmp_path):
    proc, report = run_equivalence(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and report["passed"]
    assert report["config"]["data"]["data"] == "synthetic-varlen"  # the TOML key of --data
    assert len(set(report["micro_batch_tokens"])) > 1  # micro-batches really carry different token counts
    assert [row["split"] for row in report["checked"]] == ["1 x 16 x 1", "1 x 2 x 8", "2 x 2 x 4"]
    for row in report["checked"]:
        assert row["initial_params_match"]
        assert row["grad_max_abs_diff"] <= BOUND
        assert row["sgd_param_max_abs_diff"] <= BOUND
        assert row["adamw_param_max_abs_diff"] <= BOUND
        assert row["reduce_scatter_rounds"] == 1 and row["all_gather_rounds"] == 1
    assert {row["weighting"] for row in report["wrong_variants"]} == {"unscaled", "mean"}
    assert report["wrong_variants_caught"]
    assert proc.stdout.count("FAIL (caught)") == 2


def test_equivalence_exits_nonzero_when_the_loss_scaling_is_broken(tmp_path):
    proc, report = run_equivalence(tmp_path, "--break", "scaling")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not report["passed"]
    chunked = [row for row in report["checked"] if row["micro_batch"] * row["ranks"] < report["global_batch"]]
    assert chunked and all(row["grad_max_abs_diff"] > BOUND for row in chunked)


def test_per_micro_batch_mean_weighting_on_varlen_data_misses_the_bound_by_far(tmp_path):
    proc, report = run_equivalence(tmp_path, "--break", "mean-weighting")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {row["split"]: row for row in report["checked"]}
    # One micro-batch is its own mean: exact. Chunks of unequal token counts are not.
    assert rows["1 x 16 x 1"]["grad_max_abs_diff"] <= BOUND
    for split in ("1 x 2 x 8", "2 x 2 x 4"):
        assert rows[split]["grad_max_abs_diff"] > 100 * BOUND
        assert not rows[split]["passed"]


# ------------------------------------------------------------------ one collective round per optimizer step
def _eager_on_grad_ready(self, p):
    """Planted bug: every micro-batch's backward reduce-scatters its bucket, as if no_sync were ignored."""
    s = self._slot_of[id(p)]
    self._ready[s.bucket] += 1
    if self._ready[s.bucket] % self._bucket_sizes[s.bucket] == 0:
        self._launch(s.bucket)


def rounds_job(cfg: Config, comm: Comm, *, accums: list[int], eager: bool) -> dict | None:
    """Train 2 steps at each accumulation; collective rounds per optimizer step (calls per bucket)."""
    if eager:
        zero.ZeroOneEngine._on_grad_ready = _eager_on_grad_ready
    out = {}
    for accum in accums:
        c = copy.deepcopy(cfg)
        c.loop.accum = accum
        before = Counter(comm.calls)
        engine = train(c, comm).engine
        calls = Counter(comm.calls) - before
        buckets = len(engine.layout.buckets)
        out[accum] = {"buckets": buckets,
                      "reduce_scatter": calls["reduce_scatter_grads"] / (c.loop.steps * buckets),
                      "all_gather": calls["all_gather_params"] / (c.loop.steps * buckets)}
    return out if comm.rank == 0 else None


def _rounds(eager: bool, accums: list[int]) -> dict:
    cfg = Config()
    cfg.data.source = "synthetic"
    cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.steps = 2, 1, 2
    cfg.parallel.bucket_mb = 0.02  # several buckets, so "one round" means one call per bucket
    cfg.parallel.overlap = "on"  # buckets launch from backward's hooks, where a missed no_sync would show
    cfg.logging.progress, cfg.loop.check_every, cfg.launch.timeout = False, 0, 60.0
    return run_job(functools.partial(rounds_job, accums=accums, eager=eager), cfg, time_limit=120)


def test_one_reduce_scatter_round_and_one_all_gather_round_per_step_for_accum_1_4_16():
    rounds = _rounds(eager=False, accums=[1, 4, 16])
    for accum in (1, 4, 16):
        assert rounds[accum]["buckets"] > 1
        assert rounds[accum]["reduce_scatter"] == 1, (accum, rounds[accum])
        assert rounds[accum]["all_gather"] == 1, (accum, rounds[accum])


def test_round_count_catches_an_engine_that_communicates_every_micro_batch():
    rounds = _rounds(eager=True, accums=[4])
    assert rounds[4]["reduce_scatter"] == 4
    assert rounds[4]["all_gather"] == 1
