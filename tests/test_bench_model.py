"""`zerotrain bench model`: the report's schema and table (figures are measured, never asserted)."""

import argparse
import json

import pytest

from zerotrain import bench


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bench_model_writes_its_json_report_and_markdown_table(tmp_path, capsys, arch):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "model", "--arch", arch, "--quick", "--repeats", "1", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads((out / "bench-model.json").read_text())
    assert report["schema"] == "zerotrain.bench.model" and report["arch"] == arch
    assert report["logits_max_abs_diff"] < 1e-4  # the two models hold the same weights: the timing compares like
    for key in ("train_step_s", "generation_s"):
        assert set(report[key]) == {"zerotrain", "transformers"} and all(v > 0 for v in report[key].values())
    assert set(report["met"]) == {"train", "generation"}
    table = (out / "bench-model.md").read_text()
    assert table.startswith(f"# bench model: {arch} (quick)") and len(table.strip().splitlines()) == 6
    assert "wrote bench-model.json and bench-model.md" in capsys.readouterr().out
