"""zerotrain plan's largest sequence (--device-memory): the longest --seq-len whose own plan fits, at the run's --cp;
one step longer (2 x cp tokens) does not fit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zerotrain.cli import main as cli
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.parallel import parts
from zerotrain.training import memory_plan as plan_module

GIB = 2**30
# Llama-3.1-8B's shape on 8 ranks, bf16, ZeRO-3, full activation checkpointing, planned for CUDA, its context lifted
EIGHT_B = ["--preset", "llama-3.1-8b", "--nproc", "8", "--zero", "3", "--precision", "bf16",
           "--activation-checkpointing", "full", "--micro-batch", "1", "--device", "cuda", "--context", "16777216",
           "--seq-len", "131072"]


def planned(*flags):
    return config_from_args(build_parser().parse_args(["plan", *EIGHT_B, *flags]), environment=False)


def total_at(cfg, seq_len: int) -> int:
    return plan_module.memory_plan(replace(cfg, model=replace(cfg.model, seq_len=seq_len))).total


def fits_and_one_step_more_does_not(cfg, device_bytes: int, found: int) -> bool:
    step = 2 * cfg.parallel.cp
    return found % step == 0 and total_at(cfg, found) <= device_bytes < total_at(cfg, found + step)


def test_the_largest_sequence_fits_and_one_step_more_does_not_and_a_search_without_the_cp_rows_is_caught(monkeypatch):
    found = {}
    for cp in (1, 8):
        cfg = planned("--cp", str(cp))
        found[cp], capped = plan_module.largest_seq_len(cfg, 80 * GIB)
        assert not capped and fits_and_one_step_more_does_not(cfg, 80 * GIB, found[cp]), cp
    # 8 CP ranks hold a row of about 7 x the tokens one rank does (the state is the same; each rank keeps 1/8 of a row)
    assert (found[1], found[8]) == (231_832, 1_572_256)
    # the model's --context bounds it: a context that fits is the answer, said as such
    assert plan_module.largest_seq_len(planned("--cp", "8", "--context", "262144"), 80 * GIB) == (262_144, True)
    # not even 2 x cp tokens a row fit in 1 GiB (the state alone is more)
    assert plan_module.largest_seq_len(planned("--cp", "8"), GIB) == (0, False)
    # planted: the search's plans without context parallelism's part (every rank's activations of the whole row): its
    # answer is a shorter row, after which the run's own plan still has room
    cfg = planned("--cp", "8")
    with monkeypatch.context() as m:
        m.setattr(parts, "context_parallel_rows", lambda cp: [])
        wrong, _ = plan_module.largest_seq_len(cfg, 80 * GIB)
    assert wrong < found[8] and not fits_and_one_step_more_does_not(cfg, 80 * GIB, wrong)


def test_plan_says_the_largest_sequence_in_the_device_memory(capsys):
    assert cli.main(["plan", *EIGHT_B, "--cp", "8", "--device-memory", "80GiB"]) == 0
    table = capsys.readouterr().out
    assert "  largest sequence in 80.00 GiB: 1,572,256 tokens a row at --cp 8, micro-batch 1, 196,532 on each CP " \
        "rank\n" in table, table
    assert cli.main(["plan", *EIGHT_B, "--cp", "8", "--context", "262144", "--device-memory", "80GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["largest_seq_len"], report["seq_len_capped_by_context"], report["cp"]) == (262_144, True, 8)
    assert cli.main(["plan", *EIGHT_B, "--cp", "8", "--context", "262144", "--device-memory", "80GiB"]) == 0
    assert "262,144 tokens a row at --cp 8, micro-batch 1, 32,768 on each CP rank (the model's --context: longer " \
           "would need a longer context)" in capsys.readouterr().out
    assert cli.main(["plan", *EIGHT_B, "--cp", "8", "--device-memory", "1GiB"]) == 0
    assert "largest sequence in 1.00 GiB: none: not even 16 tokens a row fit at --cp 8, micro-batch 1" in \
        capsys.readouterr().out


@pytest.mark.parametrize("flags", [(), ("--device-memory", "80GiB")])
def test_without_device_memory_no_sequence_is_searched(capsys, flags):
    assert cli.main(["plan", *EIGHT_B, "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["largest_seq_len"] is None) == (not flags)


def test_the_largest_micro_batch_at_cp8_fits_and_one_more_does_not_and_whole_row_growth_is_caught(monkeypatch):
    # each micro-batch row adds T / C tokens' activations and the ring's buffers on a rank, not the whole row's
    for seq_len, answer in (("8192", 191), ("32768", 47)):
        cfg = planned("--cp", "8", "--seq-len", seq_len)
        B = plan_module.largest_micro_batch(cfg, 80 * GIB)
        assert B == answer
        assert plan_module.memory_plan(cfg, B).total <= 80 * GIB < plan_module.memory_plan(cfg, B + 1).total
    # planted: the growth per micro-batch counted as the whole row's (29 at 8192 tokens, where 191 fit)
    monkeypatch.setattr(plan_module, "context_parallel_rows", lambda cp: [])
    cfg = planned("--cp", "8", "--seq-len", "8192")
    B = plan_module.largest_micro_batch(cfg, 80 * GIB)
    assert B == 29 and plan_module.memory_plan(cfg, B + 1).total <= 80 * GIB


def test_offloaded_activations_at_cp8_are_the_rank_s_part_on_the_host_and_none_on_the_device():
    kept = plan_module.memory_plan(planned("--cp", "8", "--seq-len", "32768")).rows
    offloaded = plan_module.memory_plan(planned("--cp", "8", "--seq-len", "32768", "--offload-activations")).rows
    # (the context part's difference went to the device row: -7.9 GiB there, the whole row's 9.0 GiB on the host)
    assert (offloaded["activations"], offloaded["activations_host"]) == (0, kept["activations"]) != (0, 0)
