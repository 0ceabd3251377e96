"""`zerotrain bench ckpt`: the report's schema and table (figures are measured, never asserted)."""

import argparse
import json
import os

from zerotrain import bench

NUMBERS = ("bytes", "shard_bytes", "param_count", "disk_write_gbps", "save_gbps",
           "save_vs_disk", "sync_save_s", "load_gbps", "load_s", "verify_s", "async_stall_s",
           "async_stall_vs_sync_save", "async_start_s", "step_s")


def test_bench_ckpt_writes_its_json_report_and_markdown_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "ckpt", "--quick", "--preset", "tiny", "--repeats", "1", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads((out / "bench-ckpt.json").read_text())
    assert report["schema"] == "zerotrain.bench.ckpt" and report["preset"] == "tiny"
    for key in NUMBERS:
        assert isinstance(report[key], (int, float)), key
        assert report[key] >= 0 or key.startswith("async_stall"), key  # a stall within noise can come out negative
    assert report["param_count"] == 28_032 and report["bytes"] > 3 * 4 * 28_032  # 3 shard tensors, fp32
    assert set(report["file_write_gbps"]) == {"hash_in_thread", "hash_inline", "save_file_then_hash"}
    assert set(report["met"]) == {"save_vs_disk", "async_stall"} and all(isinstance(v, bool) for v in report["met"].values())
    assert {"platform", "cpu_count", "torch"} <= set(report["machine"])
    table = (out / "bench-ckpt.md").read_text()
    assert table.startswith("# bench ckpt: tiny on cpu")
    assert "| measure | result | target |" in table and "| synchronous save |" in table
    assert "| async save: training time lost |" in table and len(table.strip().splitlines()) == 16
    assert isinstance(report["async_kept"], bool) and "| what --async-save does here |" in table
    assert sorted(os.listdir(out)) == ["bench-ckpt.json", "bench-ckpt.md"]  # the scratch checkpoints are gone
    assert "wrote bench-ckpt.json and bench-ckpt.md" in capsys.readouterr().out
