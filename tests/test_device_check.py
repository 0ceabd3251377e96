"""scripts/device_check.py, the device check's measurement, rehearsed on the CPU (--tiny): it runs every check and
prints one table of them, exits 1 when a row is out of its bound, and its sync counter counts a planted host read.
What it measures on CUDA was not measured here (no GPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)
import device_check  # noqa: E402

ROWS = ["syncs per step", "tokens/s: zerotrain", "tokens/s: fully_shard", "ratio zerotrain / baseline",
        "attention kernel", "peak memory vs plan", "determinism pair", "MoE bf16 step, grouped path, plan strict",
        "DPO step", "wall time"]


@pytest.mark.timeout(900)
def test_the_tiny_rehearsal_prints_one_table_of_every_check_within_bounds(tmp_path, capsys):
    # The script's main in this process (the script's own process would import torch and transformers anew): its
    # world of one is a group of this process, torn down after; the threads it sets are given back.
    threads = torch.get_num_threads()
    try:
        # a bound of 1000 syncs: the rehearsal's own count is the CPU's reads, not CUDA's syncs
        code = device_check.main(["--out", str(tmp_path), "--tiny", "--max-syncs-per-step", "1000"])
    finally:
        torch.set_num_threads(threads)
    r = capsys.readouterr()
    assert code == 0, r.out[-3000:] + r.err[-3000:]
    lines = r.out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    table = lines[start:]
    assert [c.strip() for c in table[0].split("|")] == ["check", "measured", "bound", "ok"]
    body = table[2:]
    assert len(body) == len(ROWS)
    for name, line in zip(ROWS, body):
        cells = [c.strip() for c in line.split("|")]
        assert cells[0].startswith(name) and len(cells) == 4 and cells[3] == "yes", line
    report = json.load(open(tmp_path / "device-check.json"))
    assert report["ok"] and report["tiny"] and report["determinism"]["equal"]
    assert report["moe"]["grouped_calls"] > 0 and report["moe"]["saved"] == report["moe"]["planned"]
    assert "flash_attention_for_cpu" in " ".join(report["zerotrain"]["attention"])
    assert report["zerotrain"]["syncs_per_step"] > 0  # the CPU's reads are counted


def test_a_row_out_of_bounds_exits_1_and_a_planted_host_read_is_counted():
    rows = [("syncs per step", "0.0", "<= 1", True), ("MoE", "saved 10 B, plan 12 B", "saved == plan", True)]
    assert device_check.verdict(rows) == 0
    assert device_check.verdict([*rows[:1], ("MoE", "saved 10 B, plan 12 B", "saved == plan", False)]) == 1
    x = torch.ones(3)
    with device_check.HostReads("cpu") as reads:
        y = (x * 2).sum()
        assert reads.take() == 0  # nothing read: the values stay tensors
        float(y), y.item(), (x > 0).nonzero()  # planted: three reads
        assert reads.take() == 3
    float(y)  # after the check: not counted, methods restored
    assert reads.take() == 0 and torch.Tensor.item.__name__ == "item"
