"""`zerotrain bench memory`: the JSON schema, the figure, and the plan beside every measurement (never timings)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch

from zerotrain.bench import memory
from zerotrain.bench.memory import FIGURE_DPI, FIGURE_SIZE_IN, SCHEMA, VARIANTS
from zerotrain.bench.report import SCHEMA_VERSION
from zerotrain.cli.main import main
from zerotrain.config import Config
from zerotrain.model import build_model
from zerotrain.parallel import layout_of
from zerotrain.parallel.units import units_whole_bytes

pytestmark = pytest.mark.timeout(300)
ACCUMULATING = ("ZeRO-1 accum", "ZeRO-2 accum step", "ZeRO-2 accum micro-batch", "ZeRO-3 accum step",
                "ZeRO-3 accum micro-batch")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run of every variant, shared by the tests that read it."""
    out = tmp_path_factory.mktemp("bench-memory")
    # the command's entry point, in this process (its ranks are processes of their own)
    assert main(["bench", "memory", "--quick", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    return out, json.loads((out / "bench-memory.json").read_text())


def test_quick_bench_measures_every_variant_beside_an_exact_plan(quick):
    import matplotlib.image

    out, report = quick
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == list(VARIANTS)
    for r in rows.values():
        assert {"measured", "planned", "state_bytes", "step_ms_median", "plan_state_exact"} <= r.keys()
        assert r["plan_state_exact"] and abs(r["plan_activation_error"]) <= 0.10, r["variant"]
        assert r["plan_param_peak_exact"], r["variant"]
        assert r["measured"]["grad_peak_bytes"] <= r["planned"]["grad_peak_bytes"], r["variant"]
        assert r["measured"]["peak_rss_bytes"] > r["planned"]["total"] > 0
    one, two = rows["ZeRO-1"]["measured"], rows["ZeRO-2"]["measured"]
    assert two["grad_bytes"] < one["grad_bytes"] / 2 + 1 and two["param_bytes"] == one["param_bytes"]
    blocks, full = rows["ZeRO-1 + blocks"]["measured"], rows["ZeRO-1 + full"]["measured"]
    assert full["activations"] < blocks["activations"] < one["activations"]
    assert rows["TP 2"]["measured"]["param_bytes"] < one["param_bytes"]
    c = report["comparisons"]
    assert c["plan_state_exact_everywhere"] and set(c["met"]) >= {"zero2_state_ratio", "zero3_step_time_ratio",
                                                                  "zero3_micro_batch_grad_bytes", "plan"}
    text = (out / "bench-memory.md").read_text()
    assert "| ZeRO-2 + full |" in text and "| ZeRO-3 accum micro-batch | 2 |" in text
    image = matplotlib.image.imread(out / "bench-memory.png")
    assert image.shape[:2] == (FIGURE_SIZE_IN[1] * FIGURE_DPI, FIGURE_SIZE_IN[0] * FIGURE_DPI)


def test_zero3_holds_the_shard_between_steps_and_the_units_whole_at_its_peak_as_planned(quick):
    _, report = quick
    rows = {r["variant"]: r for r in report["rows"]}
    two, three = rows["ZeRO-2"], rows["ZeRO-3"]
    assert three["zero"] == 3 and three["accum"] == 1
    m, p = three["measured"], three["planned"]
    assert m["param_bytes"] * 2 == two["measured"]["param_bytes"] == p["param_bytes"] * 2
    assert m["param_peak_bytes"] == p["param_bytes"] + p["parameter_units"] > m["param_bytes"]
    assert m["grad_bytes"] == two["measured"]["grad_bytes"]
    assert m["optimizer_bytes"] == two["measured"]["optimizer_bytes"]
    c = report["comparisons"]
    assert c["zero3_state_ratio"] == three["state_bytes_at_peak"] / two["state_bytes_at_peak"]
    # Paired per round: each round's ZeRO-3 median over the same round's ZeRO-2 median.
    assert c["zero3_step_time_ratio"] == statistics.median(
        a / b for a, b in zip(three["step_ms_per_repeat"], two["step_ms_per_repeat"]))


def assert_micro_batch_holds_less_gradient_than_step(rows: dict) -> None:
    for stage in (2, 3):
        step, micro = rows[f"ZeRO-{stage} accum step"], rows[f"ZeRO-{stage} accum micro-batch"]
        assert step["accum"] == micro["accum"] > 1
        assert micro["measured"]["grad_peak_bytes"] < step["measured"]["grad_peak_bytes"], \
            f"ZeRO-{stage}: micro-batch's gradient peak is not below step's"
        assert micro["measured"]["grad_bytes"] == step["measured"]["grad_bytes"]  # between steps: the shard


def test_accumulating_variants_hold_less_gradient_with_micro_batch_reduction(quick):
    _, report = quick
    rows = {r["variant"]: r for r in report["rows"]}
    assert all(rows[name]["accum"] == 2 for name in ACCUMULATING)
    assert [rows[name]["grad_reduce"] for name in ACCUMULATING] == ["step", "step", "micro-batch", "step",
                                                                    "micro-batch"]
    assert_micro_batch_holds_less_gradient_than_step(rows)


def test_a_bench_that_runs_micro_batch_as_step_is_caught(monkeypatch, tmp_path):
    """Planted: the variants' --grad-reduce never reaches their config; both then hold every bucket through the
    window, and the comparison above fails."""
    real = memory.variant_config
    monkeypatch.setattr(memory, "variant_config",
                        lambda cfg, v, accum: real(cfg, dataclasses.replace(v, grad_reduce="step"), accum))
    assert main(["bench", "memory", "--quick", "--steps", "1", "--warmup", "0", "--out", str(tmp_path), "--variants",
                 "ZeRO-2 accum step,ZeRO-2 accum micro-batch,ZeRO-3 accum step,ZeRO-3 accum micro-batch"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "bench-memory.json").read_text())["rows"]}
    assert list(rows) == list(ACCUMULATING[1:])
    with pytest.raises(AssertionError, match="micro-batch's gradient peak is not below step's"):
        assert_micro_batch_holds_less_gradient_than_step(rows)


def two_units_fp32_bytes(report: dict) -> int:
    """The root unit with the largest other, in fp32 bytes, from the run's model and layout (not its plan)."""
    cfg = Config.from_dict(report["config"])
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.loop.seed)
    return units_whole_bytes(model, layout_of(model, 2, cfg.parallel.bucket_numel), element_size=4)


def assert_micro_batch_bound_is_stage1_over_d_plus_two_units(report: dict) -> None:
    rows = {r["variant"]: r for r in report["rows"]}
    c = report["comparisons"]
    one, micro = rows["ZeRO-1 accum"]["measured"], rows["ZeRO-3 accum micro-batch"]["measured"]
    assert c["zero1_grad_bytes_over_dp_plus_two_units"] == one["grad_peak_bytes"] / 2 + two_units_fp32_bytes(report), \
        "the bound is not ZeRO-1's gradient bytes / D plus two units"
    assert c["zero3_micro_batch_grad_peak_bytes"] == micro["grad_peak_bytes"]
    assert c["met"]["zero3_micro_batch_grad_bytes"] == (micro["grad_peak_bytes"] <=
                                                        c["zero1_grad_bytes_over_dp_plus_two_units"])


def test_the_micro_batch_bound_counts_two_units_and_a_bound_of_the_whole_model_is_caught(quick, monkeypatch):
    _, report = quick
    assert_micro_batch_bound_is_stage1_over_d_plus_two_units(report)
    assert report["comparisons"]["met"]["zero3_micro_batch_grad_bytes"]
    # Planted: "two units" as every bucket of the model, a bound no stage-3 run could miss.
    monkeypatch.setattr(memory, "two_units_grad_bytes", lambda row: 4 * row["param_count"])
    with pytest.raises(AssertionError, match="not ZeRO-1's gradient bytes / D plus two units"):
        assert_micro_batch_bound_is_stage1_over_d_plus_two_units(
            {**report, "comparisons": memory.comparisons(report["rows"])})


@pytest.mark.parametrize("argv, named", [
    (["--zero", "2"], "--zero 2: bench memory runs its variants"),
    (["--nproc", "4"], "--nproc 4: bench memory runs 2 ranks"),
    (["--grad-reduce", "micro-batch"], "--grad-reduce micro-batch: bench memory runs its variants"),
    (["--accum", "1"], "--accum 1: bench memory's accum variants need at least 2"),
    (["--variants", "ZeRO-4"], "--variants 'ZeRO-4': 'ZeRO-4' not among ZeRO-1, "),
])
def test_flags_the_bench_sets_itself_are_refused_in_one_line(argv, named, capsys, tmp_path):
    assert main(["bench", "memory", "--quick", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
