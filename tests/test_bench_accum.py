"""`zerotrain bench accum`: the JSON schema, the figure, and one-line errors (never timings)."""

from __future__ import annotations

import json
import math
import os
import sys

from conftest import zerotrain_here

from zerotrain.bench.accum import FIGURE_DPI, FIGURE_SIZE_IN, SCHEMA, STEP_PURPOSES
from zerotrain.bench.report import SCHEMA_VERSION

POINT_FIELDS = {
    "accum_steps", "micro_batch", "world_size", "effective_batch", "effective_batch_tokens", "timed_steps",
    "samples_per_s", "tokens_per_s", "optimizer_steps_per_s", "step_time_median_s", "step_time_p90_s",
    "mean_loss", "collective_calls_per_step", "bytes_per_step", "bytes_per_step_by_purpose",
}


def test_quick_sweep_writes_schema_json_and_a_two_panel_png_of_the_expected_size(tmp_path, capfd):
    import matplotlib.image

    proc = zerotrain_here(capfd, "bench", "accum", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "samples/s" in proc.stdout and "opt steps/s" in proc.stdout

    report = json.loads((tmp_path / "accum-curve.json").read_text())
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    assert {"platform", "cpu_count", "torch"} <= report["machine"].keys()
    assert report["config"]["launch"]["nproc"] == 2
    assert report["grid"] == [1, 2, 4, 8, 16]
    points = report["points"]
    assert [p["accum_steps"] for p in points] == [1, 2, 4, 8, 16]
    for p in points:
        assert POINT_FIELDS <= p.keys()
        assert p["world_size"] == 2 and p["micro_batch"] == report["config"]["loop"]["micro_batch"]
        assert p["effective_batch"] == p["world_size"] * p["micro_batch"] * p["accum_steps"]
        assert p["timed_steps"] == report["timed_steps"]
        for key in ("samples_per_s", "tokens_per_s", "optimizer_steps_per_s", "step_time_median_s", "bytes_per_step"):
            assert math.isfinite(p[key]) and p[key] > 0, key
        assert p["step_time_p90_s"] >= p["step_time_median_s"]
        assert math.isfinite(p["mean_loss"])
    # The engine communicates once per optimizer step: calls and bytes do not grow with accumulation.
    assert all(p["collective_calls_per_step"] == points[0]["collective_calls_per_step"] for p in points)
    assert all(p["bytes_per_step"] == points[0]["bytes_per_step"] for p in points)
    assert set(points[0]["collective_calls_per_step"]) == set(STEP_PURPOSES)

    image = matplotlib.image.imread(str(tmp_path / "accum-curve.png"))
    width, height = (round(v * FIGURE_DPI) for v in FIGURE_SIZE_IN)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0  # something was drawn


def test_missing_matplotlib_is_a_one_line_error_with_the_install_hint(tmp_path, capfd, monkeypatch):
    # None in sys.modules makes `import matplotlib` raise ImportError, as where it is not installed; in this process,
    # not a fresh one (which would import zerotrain and torch again for one line)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    proc = zerotrain_here(capfd, "bench", "accum", "--quick", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "pip install 'zerotrain[plot]'" in proc.stderr
    assert not os.path.exists(tmp_path / "out")


def test_bad_grid_is_a_one_line_error_naming_the_value(tmp_path, capfd):
    proc = zerotrain_here(capfd, "bench", "accum", "--quick", "--grid", "1,x,4", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--grid '1,x,4'" in proc.stderr and proc.stderr.strip().count("\n") == 0
