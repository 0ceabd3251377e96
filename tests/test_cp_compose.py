"""Context parallelism (--cp 2) composed with LoRA (its dropout masks the whole row's) and with hybrid sharding
(--dp-replicate 2) trains as one rank holding the whole rows does (DPO and GRPO: test_cp_dpo.py, test_cp_grpo.py)."""

from __future__ import annotations

import functools

import cp_jobs
import dist_jobs
import pytest
from conftest import tiny_config
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain.config import apply_preset, resolve, validate

STEPS, SEQ = 3, 64
LIMIT = 900
pytestmark = pytest.mark.timeout(3 * LIMIT)


def config(tmp, name, data, nproc, zero=1, cp=1, micro=2, accum=2, lora=False, **run):
    """A tiny Llama (4 heads over 2 KV heads) on packed records of several lengths in rows of 64; a global batch of 4
    rows; every step clipped, invariant (b) every step. `lora`: rank-4 adapters on the attention and MLP projections
    with dropout 0.1 (the base frozen)."""
    cfg = tiny_config(tmp / name, nproc=nproc, zero=zero, micro=micro, accum=accum,
                      **{"steps": STEPS, "threads": 1, "check_every": 1, **run})
    apply_preset(cfg, "llama-tiny")
    cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len = str(data), 256, SEQ
    cfg.parallel.cp = cp
    cfg.optim.grad_clip = 0.5
    if lora:
        cfg.lora.rank, cfg.lora.dropout, cfg.optim.lr = 4, 0.1, 1e-2
    return resolve(validate(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each job's rank-0 result by name: one start of 2 ranks (LoRA at --cp 2, and planted), one of 4 (--cp 2
    --dp-replicate 2, and planted), one of 1 (the references)."""
    tmp = tmp_path_factory.mktemp("cpcompose")
    data = write_records(tmp / "data", make_records(400))  # 4 records a row on average, of 5 to 18 tokens
    out = {}

    start = functools.partial(dist_jobs.run_in_turn, out, time_limit=LIMIT)

    job = cp_jobs.trained_job
    start({"cp2 lora": (job, config(tmp, "cp2-lora", data, 2, cp=2, lora=True)),
           "whole-row dropout": (cp_jobs.whole_row_dropout_job, config(tmp, "planted-lora", data, 2, cp=2, lora=True))})
    # 4 ranks: 2 replica groups of one DP rank's 2 CP ranks, ZeRO-3 over each group's 2 ranks (micro-batch 1 x 2)
    start({"cp2 r2 z3": (job, config(tmp, "cp2-r2", data, 4, zero=3, cp=2, micro=1, dp_replicate=2)),
           "unreplicated": (cp_jobs.unreplicated_job,
                            config(tmp, "unreplicated", data, 4, zero=3, cp=2, micro=1, dp_replicate=2))})
    start({"cp1 lora": (job, config(tmp, "cp1-lora", data, 1, lora=True)),
           "cp1 z3": (job, config(tmp, "cp1-z3", data, 1, zero=3))})
    return out


def test_lora_at_cp2_trains_as_one_rank_and_dropout_masks_of_the_rank_s_first_positions_are_caught(runs):
    # the adapters (dropout 0.1) on 2 CP ranks: losses, norms and final weights within 1e-6 of one rank's, 3 steps
    assert worst_gap(runs["cp2 lora"], runs["cp1 lora"]) < 1e-6
    # planted: each rank draws the masks of positions 0 to 31 of a row, not of its own zig-zag positions
    assert worst_gap(runs["whole-row dropout"], runs["cp1 lora"]) > 1e-3


def test_cp2_with_two_replica_groups_trains_as_one_rank_and_a_skipped_replica_all_reduce_is_caught(runs):
    # --cp 2 --dp-replicate 2 --zero 3 on 4 ranks: each replica group's CP pair shards the state, the shard
    # all-reduced across the groups; one rank with the whole global batch trains the same within 1e-6
    assert worst_gap(runs["cp2 r2 z3"], runs["cp1 z3"]) < 1e-6
    assert runs["cp2 r2 z3"]["sent"]["all_reduce_replicas"] > 0
    # planted: no all-reduce across the replica groups (each steps on its own half of the batch)
    assert worst_gap(runs["unreplicated"], runs["cp1 z3"]) > 1e-3
