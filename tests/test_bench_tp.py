"""`zerotrain bench tp`: the JSON schema, the figure, the bytes TP saves and the collectives it adds (never timings)."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
from unittest import mock

import pytest
import torch

from zerotrain.bench import tp as tp_bench
from zerotrain.bench.report import SCHEMA_VERSION
from zerotrain.bench.tp import (FIGURE_DPI, FIGURE_SIZE_IN, PARAM_RATIO_TARGET, SCHEMA, TP_PURPOSES, comparisons,
                                default_meshes, explain, parse_meshes, tp_job)
from zerotrain.cli.main import build_parser, main
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import build_model, gpt2, plan
from zerotrain.runtime.launch import run_job

ROW_FIELDS = {
    "mesh", "tp", "dp", "ranks", "threads_per_rank", "oversubscribed", "micro_batch", "accum", "global_batch",
    "global_batch_tokens", "param_count", "timed_steps", "step_ms_median", "step_ms_p10", "step_ms_p90",
    "tokens_per_s", "param_bytes_per_rank", "grad_bytes_per_rank", "optimizer_bytes_per_rank",
    "peak_rss_bytes_per_rank", "per_rank", "comm_calls_per_step_by_purpose", "comm_bytes_per_step_by_purpose",
    "comm_bytes_per_step", "tp_all_reduce_probe_ms", "dp_reduce_grads_probe_ms",
}
POSITIVE = ("step_ms_median", "tokens_per_s", "param_bytes_per_rank", "grad_bytes_per_rank",
            "optimizer_bytes_per_rank", "peak_rss_bytes_per_rank", "comm_bytes_per_step")


def tp_rank_numel(param_count: int, tp: int) -> int:
    """Parameters one rank of a TP group holds for the wide GPT: the full count less what the other ranks keep."""
    split = plan(ModelConfig(**PRESETS["wide"]), tp).values()
    return param_count - sum(math.prod(s.full_shape) - math.prod(s.local_shape()) for s in split)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[int, str, object]:
    """`zerotrain bench tp --quick --meshes 1x2,2x1` through its entry point, in this process (it starts the ranks):
    its exit code, what it printed, and its output folder."""
    out = tmp_path_factory.mktemp("bench-tp")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "tp", "--quick", "--meshes", "1x2,2x1", "--out", str(out)])
    return code, printed.getvalue(), out


def test_quick_bench_writes_one_row_per_mesh_and_tp2_halves_parameter_bytes_with_tp_collectives_only_there(quick):
    import matplotlib.image

    code, stdout, tmp_path = quick
    assert code == 0, stdout[-2000:]
    assert "| mesh |" in stdout

    report = json.loads((tmp_path / "bench-tp.json").read_text())
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    assert {"platform", "cpu_count", "torch"} <= report["machine"].keys()
    assert {k: report["config"]["model"][k] for k in PRESETS["wide"]} == PRESETS["wide"]
    rows = {r["mesh"]: r for r in report["rows"]}
    assert list(rows) == report["meshes"] == ["TP1 x DP2", "TP2 x DP1"]
    P = rows["TP1 x DP2"]["param_count"]
    for r in rows.values():
        assert ROW_FIELDS <= r.keys(), ROW_FIELDS - r.keys()
        for key in POSITIVE:
            assert math.isfinite(r[key]) and r[key] > 0, (r["mesh"], key)
        # The same model and the same global batch on every mesh, split as the mesh says.
        assert r["param_count"] == P
        assert r["global_batch"] == r["dp"] * r["micro_batch"] * r["accum"] == report["global_batch"]
        assert r["ranks"] == r["tp"] * r["dp"] and r["timed_steps"] == report["timed_steps"]
        assert r["step_ms_p10"] <= r["step_ms_median"] <= r["step_ms_p90"]
        assert max(r["per_rank"]["param_bytes"]) == r["param_bytes_per_rank"] and len(r["per_rank"]["param_bytes"]) == 2
        assert r["comm_bytes_per_step"] == pytest.approx(sum(r["comm_bytes_per_step_by_purpose"].values()))
    tp1, tp2 = rows["TP1 x DP2"], rows["TP2 x DP1"]

    # Parameter bytes: the whole model on a TP1 rank, the replicated parameters and one slice on a TP2 rank
    # (fp32, a few values of padding at most).
    assert tp1["param_bytes_per_rank"] == pytest.approx(4 * P, rel=1e-3)
    assert tp2["param_bytes_per_rank"] == pytest.approx(4 * tp_rank_numel(P, 2), rel=1e-3)
    assert tp2["param_bytes_per_rank"] < tp1["param_bytes_per_rank"]
    ratio = report["param_bytes_ratio_tp2_vs_tp1"]
    assert ratio == pytest.approx(tp2["param_bytes_per_rank"] / tp1["param_bytes_per_rank"])
    assert report["met"]["param_bytes_ratio_tp2_vs_tp1"] is (ratio <= PARAM_RATIO_TARGET) is True
    assert report["step_time_ratio_tp2xdp1_vs_tp1xdp2"] == pytest.approx(
        tp2["step_ms_median"] / tp1["step_ms_median"])

    # The TP all-reduces appear only where TP is on: two per block forward, two backward; with DP 1
    # ZeRO's reduce-scatter and all-gather move nothing, with DP 2 they move the gradients and parameters.
    n_layer = report["config"]["model"]["n_layer"]
    assert not set(TP_PURPOSES) & tp1["comm_bytes_per_step_by_purpose"].keys()
    assert tp1["tp_all_reduce_probe_ms"] is None and tp2["dp_reduce_grads_probe_ms"] is None
    for purpose in TP_PURPOSES:
        assert tp2["comm_calls_per_step_by_purpose"][purpose] == 2 * n_layer
        assert tp2["comm_bytes_per_step_by_purpose"][purpose] > 0
    assert tp2["comm_bytes_per_step_by_purpose"]["reduce_scatter_grads"] == 0
    assert tp1["comm_bytes_per_step_by_purpose"]["reduce_scatter_grads"] == pytest.approx(2 * P, rel=1e-3)

    table = (tmp_path / "bench-tp.md").read_text()
    assert all(f"| {name} |" in table for name in rows)
    assert f"{ratio:.3f}" in table and report["explanation"] in table
    # The explanation quotes this run's numbers, not fixed ones.
    assert f"{tp2['step_ms_median']:.0f} vs {tp1['step_ms_median']:.0f} ms" in report["explanation"]

    image = matplotlib.image.imread(str(tmp_path / "bench-tp.png"))
    width, height = (round(v * FIGURE_DPI) for v in FIGURE_SIZE_IN)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0  # something was drawn


def fake_row(tp: int, dp: int, param_bytes: int, step_ms: float) -> dict:
    """A report row as summarize() writes it, with only what comparisons() and explain() read."""
    zero = 0 if dp == 1 else 2000  # ZeRO's collectives move nothing with DP 1
    tp_calls = {"all_reduce_tp_activations": 4, "all_reduce_tp_grads": 4} if tp > 1 else {}
    tp_bytes = {"all_reduce_tp_activations": 500, "all_reduce_tp_grads": 500} if tp > 1 else {}
    return {"mesh": f"TP{tp} x DP{dp}", "tp": tp, "dp": dp, "param_bytes_per_rank": param_bytes,
            "step_ms_median": step_ms, "tokens_per_s": 512 / step_ms * 1000, "param_count": 1000,
            "comm_calls_per_step_by_purpose": {"reduce_scatter_grads": 1, "all_gather_params": 1, **tp_calls},
            "comm_bytes_per_step_by_purpose": {"reduce_scatter_grads": zero, "all_gather_params": zero, **tp_bytes},
            "tp_all_reduce_probe_ms": 0.5 if tp > 1 else None, "dp_reduce_grads_probe_ms": 3.0 if dp > 1 else None}


def test_param_target_is_met_by_a_halved_slice_and_the_worst_tp2_row_decides():
    honest = [fake_row(1, 2, 4000, 100.0), fake_row(2, 1, 2100, 120.0)]
    c = comparisons(honest)
    assert c["param_bytes_ratio_tp2_vs_tp1"] == pytest.approx(0.525) and c["met"]["param_bytes_ratio_tp2_vs_tp1"]
    assert c["step_time_ratio_tp2xdp1_vs_tp1xdp2"] == pytest.approx(1.2)
    assert comparisons(honest + [fake_row(2, 2, 2300, 90.0)])["param_bytes_ratio_tp2_vs_tp1"] == pytest.approx(0.575)
    assert comparisons([fake_row(1, 2, 4000, 100.0)])["met"]["param_bytes_ratio_tp2_vs_tp1"] is None


def keeping_the_full_weights():
    """Planted bug: GPT-2's TP parallelize replaces the split layers by this rank's slices but keeps the full blocks
    too, as a submodule of the model: their weights stay parameters, which the engine lays out and holds."""
    real = gpt2.parallelize

    def parallelize_keeping_the_full_blocks(model, tp_size, tp_rank, comm, *args):
        full = copy.deepcopy(model.transformer.h)
        slices = real(model, tp_size, tp_rank, comm, *args)
        model.full_blocks = full
        return slices

    return mock.patch.object(gpt2, "parallelize", parallelize_keeping_the_full_blocks)


def planted_tp_job(cfg, comm, *, warmup: int) -> dict | None:
    """The bench's own job on this mesh, with keeping_the_full_weights planted in the ranks."""
    with keeping_the_full_weights():
        return tp_job(cfg, comm, warmup=warmup)


def test_a_tp_rank_that_keeps_the_full_weights_misses_the_parameter_target(quick):
    # The bench's own job on TP2 x DP1 with the bug planted, one step, against the quick bench's TP1 x DP2 row.
    code, _, out = quick
    assert code == 0
    tp1 = next(r for r in json.loads((out / "bench-tp.json").read_text())["rows"] if r["tp"] == 1)
    args = build_parser().parse_args(["bench", "tp", "--quick", "--warmup", "0", "--steps", "1",
                                      "--out", str(out / "planted")])
    size = tp_bench._resolve_size(args)
    cfg = tp_bench._mesh_configs(tp_bench._sweep_config(args, size), [(2, 1)], size["global_batch"])[2, 1]
    planted = tp_bench.summarize(2, 1, cfg, [run_job(functools.partial(planted_tp_job, warmup=0), cfg,
                                                     time_limit=120)], 2)
    c = comparisons([tp1, planted])
    assert c["met"]["param_bytes_ratio_tp2_vs_tp1"] is False
    # What the bench measured (the engine's flat buffer): this rank's slices and the replicated parameters, and the
    # full blocks besides; more than the whole model a TP1 rank holds.
    with torch.device("meta"):
        whole = build_model(ModelConfig(**PRESETS["wide"]), seed=0)
    full_blocks = sum(p.numel() for name, p in whole.named_parameters() if name.startswith("transformer.h."))
    P = tp1["param_count"]
    assert planted["param_bytes_per_rank"] == pytest.approx(4 * (tp_rank_numel(P, 2) + full_blocks), rel=1e-3)
    assert c["param_bytes_ratio_tp2_vs_tp1"] > 1


@pytest.mark.parametrize("tp_ms, says", [(120.0, "TP2 x DP1 is 1.20x slower per step than TP1 x DP2 (120 vs 100 ms"),
                                         (80.0, "TP2 x DP1 is not slower than TP1 x DP2 here: 0.80x the step time")])
def test_explanation_states_the_measured_direction_and_size_of_the_step_time_gap(tp_ms, says):
    rows = [fake_row(1, 2, 4000, 100.0), fake_row(2, 1, 2100, tp_ms)]
    report = {"rows": rows, "config": {"model": {"n_layer": 2, "seq_len": 64}}, "global_batch": 8, **comparisons(rows)}
    text = explain(report)
    assert text.startswith(says)
    assert "4 all-reduces of activations in the forward and 4 of their gradients in the backward" in text
    assert "2 forward and 2 backward per block" in text and "about 4 ms" in text and "about 6 ms" in text


def test_default_meshes_add_tp2_x_dp2_only_when_four_ranks_have_a_core_each():
    assert default_meshes(2) == [(1, 2), (2, 1)]
    assert default_meshes(4) == [(1, 2), (2, 1), (2, 2)]
    assert parse_meshes("1x2, 2X1,1x2") == [(1, 2), (2, 1)]


@pytest.mark.parametrize("argv, named", [
    (["--meshes", "2by1"], "--meshes '2by1'"),
    (["--meshes", "1x0"], "--meshes '1x0'"),
    (["--nproc", "4"], "--nproc 4"),
    (["--micro-batch", "2"], "--micro-batch 2"),
    (["--global-batch", "3"], "--global-batch 3"),
    (["--meshes", "3x1"], "TP3 x DP1"),  # 3 does not divide the wide GPT's 8 heads
    (["--repeats", "0"], "--repeats"),
    (["--steps", "0"], "--steps"),
])
def test_bad_values_are_one_line_errors_with_exit_code_2(argv, named, capsys, tmp_path):
    assert main(["bench", "tp", "--quick", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1
