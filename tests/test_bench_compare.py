"""`zerotrain bench compare`: it runs end to end, its strategies compute the same thing, its checks can fail."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
from conftest import tiny_config, zerotrain_here

from zerotrain.bench import baselines as strategies
from zerotrain.bench.compare import AGREEMENT_BOUND, agreement_failures, param_gaps
from zerotrain.cli.main import main
from zerotrain.config import Config
from zerotrain.data import BatchSchedule, make_source
from zerotrain.parallel import Comm
from zerotrain.runtime.launch import run_job
from zerotrain.training.schedule import lr_at

CI_SIZED = ["--quick", "--warmup", "1", "--repeats", "1", "--steps", "1"]


def test_quick_compare_writes_four_strategies_that_agree_with_ddp(tmp_path, capfd):
    out = tmp_path / "compare"
    proc = zerotrain_here(capfd, "bench", "compare", *CI_SIZED, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "compare.json").read_text())
    assert (report["schema"], report["version"]) == ("zerotrain.bench.compare", 1)
    results = report["strategies"]
    assert set(results) == set(strategies.NAMES)
    for name, r in results.items():
        assert r["param_max_abs_diff_vs_ddp"] <= AGREEMENT_BOUND, name
        assert r["step_ms"]["median"] > 0 and r["tokens_per_s"] > 0
        assert len(r["optimizer_state_bytes"]["per_rank"]) == 2 and r["peak_rss_bytes"]["max"] > 0
    assert report["agreement_failures"] == []
    # Measured from the tensors held and the collectives called: DDP keeps 8 bytes per parameter and
    # all-reduces once; ZeRO-1 keeps 8P/W and moves one all-reduce's worth (within padding);
    # ZeroRedundancyOptimizer adds a broadcast of every shard to the all-reduce.
    assert results["ddp"]["optimizer_state_bytes"]["max"] == 8 * report["param_count"]
    assert results["zerotrain"]["optimizer_state_bytes"]["max_bytes_per_param"] == pytest.approx(4.0, rel=1e-3)
    assert results["ddp"]["comm_bytes_per_step"]["vs_one_allreduce"] == pytest.approx(1.0, rel=1e-6)
    assert results["zerotrain"]["comm_bytes_per_step"]["vs_one_allreduce"] == pytest.approx(1.0, rel=1e-3)
    assert results["ddp_zero"]["comm_bytes_per_step"]["vs_one_allreduce"] == pytest.approx(1.5, rel=1e-3)
    table = (out / "compare.md").read_text()
    assert all(r["label"] in table for r in results.values())
    assert "| strategy |" in proc.stdout

    import matplotlib.pyplot as plt

    image = plt.imread(out / "compare.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_quick_compare_trains_a_llama_with_all_four_strategies_and_they_agree_with_ddp(tmp_path, capfd):
    out = tmp_path / "compare-llama"
    proc = zerotrain_here(capfd, "bench", "compare", *CI_SIZED, "--arch", "llama", "--preset", "llama-tiny",
                          "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "compare.json").read_text())
    assert report["config"]["model"]["arch"] == "llama"
    results = report["strategies"]
    assert set(results) == set(strategies.NAMES)  # FSDP2 among them: it shards Llama's blocks, not GPT-2's
    for name, r in results.items():
        assert r["param_max_abs_diff_vs_ddp"] <= AGREEMENT_BOUND, name
    assert results["fsdp2"]["optimizer_state_bytes"]["max"] < results["ddp"]["optimizer_state_bytes"]["max"]
    assert report["agreement_failures"] == []


def planted_lr_job(cfg: Config, comm: Comm) -> dict:
    """All four strategies, plus zerotrain with 1.5x the learning rate, trained on the same batches."""
    planted = copy.deepcopy(cfg)
    planted.optim.lr *= 1.5
    runs = {name: (strategies.build(name, cfg, comm), cfg) for name in strategies.NAMES}
    runs["zerotrain_lr_x1.5"] = (strategies.build("zerotrain", planted, comm), planted)
    schedule = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=comm.rank, world_size=comm.world_size)
    for step in range(cfg.loop.steps):
        batch = schedule.batch(step)
        for strategy, c in runs.values():
            strategy.step(batch, lr_at(step, c.optim, c.loop.steps))
    return param_gaps({name: s.full_params() for name, (s, _) in runs.items()}, "ddp")


def test_agreement_check_passes_the_honest_strategies_and_trips_on_a_planted_lr(tmp_path):
    # Accumulation and clipping on, so no_sync and the clipped paths of all four are compared too.
    cfg = tiny_config(tmp_path, nproc=2, micro=2, accum=2, steps=3, threads=1)
    cfg.optim.grad_clip = 0.05  # below the tiny model's gradient norm: every step clips
    gaps = run_job(planted_lr_job, cfg, time_limit=120)
    honest = {name: gaps[name] for name in strategies.NAMES}
    assert max(honest.values()) <= AGREEMENT_BOUND, honest
    assert gaps["zerotrain_lr_x1.5"] > 10 * AGREEMENT_BOUND
    failures = agreement_failures(gaps)
    assert len(failures) == 1 and failures[0].startswith("zerotrain_lr_x1.5:")


def test_agreement_failures_name_every_strategy_out_of_bound_including_nan():
    gaps = {"ddp": 0.0, "zerotrain": 1e-7, "fsdp2": 2e-5, "ddp_zero": float("nan")}
    failures = agreement_failures(gaps)
    assert [f.split(":")[0] for f in failures] == ["FSDP2 fully_shard", "DDP + ZeroRedundancyOptimizer"]


@pytest.mark.parametrize("argv, named", [
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "0"], "--warmup"),
    (["--precision", "bf16"], "--precision bf16"),
    (["--heavy", "--preset", "tiny"], "--preset tiny"),
])
def test_bad_values_are_one_line_errors_with_exit_code_2(argv, named, capsys, tmp_path):
    assert main(["bench", "compare", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1


def test_missing_matplotlib_is_a_one_line_error_with_exit_code_2(tmp_path, capsys, monkeypatch):
    # None in sys.modules makes `import matplotlib` raise ImportError, as where it is not installed; in this process,
    # not a fresh one (which would import zerotrain and torch again for one line)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "compare", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'zerotrain[plot]'" in err and len(err.strip().splitlines()) == 1
    assert not os.listdir(tmp_path)
