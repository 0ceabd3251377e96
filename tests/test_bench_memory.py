"""`zerotrain bench memory`: the JSON schema, the figure, and the plan beside every measurement (never timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerotrain.bench.memory import FIGURE_DPI, FIGURE_SIZE_IN, SCHEMA, VARIANTS
from zerotrain.bench.report import SCHEMA_VERSION
from zerotrain.cli.main import main

pytestmark = pytest.mark.timeout(300)


def test_quick_bench_measures_every_variant_beside_an_exact_plan(tmp_path):
    import matplotlib.image

    proc = subprocess.run([sys.executable, "-m", "zerotrain", "bench", "memory", "--quick", "--steps", "1",
                           "--warmup", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench-memory.json").read_text())
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == list(VARIANTS)
    for r in rows.values():
        assert {"measured", "planned", "state_bytes", "step_ms_median", "plan_state_exact"} <= r.keys()
        assert r["plan_state_exact"] and abs(r["plan_activation_error"]) <= 0.10, r["variant"]
        assert r["measured"]["peak_rss_bytes"] > r["planned"]["total"] > 0
    one, two = rows["ZeRO-1"]["measured"], rows["ZeRO-2"]["measured"]
    assert two["grad_bytes"] < one["grad_bytes"] / 2 + 1 and two["param_bytes"] == one["param_bytes"]
    blocks, full = rows["ZeRO-1 + blocks"]["measured"], rows["ZeRO-1 + full"]["measured"]
    assert full["activations"] < blocks["activations"] < one["activations"]
    assert rows["TP 2"]["measured"]["param_bytes"] < one["param_bytes"]
    c = report["comparisons"]
    assert c["plan_state_exact_everywhere"] and set(c["met"]) >= {"zero2_state_ratio", "plan"}
    assert "| ZeRO-2 + full |" in (tmp_path / "bench-memory.md").read_text()
    image = matplotlib.image.imread(tmp_path / "bench-memory.png")
    assert image.shape[:2] == (FIGURE_SIZE_IN[1] * FIGURE_DPI, FIGURE_SIZE_IN[0] * FIGURE_DPI)


@pytest.mark.parametrize("argv, named", [(["--zero", "2"], "--zero 2: bench memory runs its variants"),
                                         (["--nproc", "4"], "--nproc 4: bench memory runs 2 ranks")])
def test_flags_the_bench_sets_itself_are_refused_in_one_line(argv, named, capsys, tmp_path):
    assert main(["bench", "memory", "--quick", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
