"""Qwen3.5 at --cp 2 and 4: the gated attention layers around the ring, the Gated DeltaNet layers from the states and
convolution inputs of the chunks before each rank's (model/delta_rule_cp.py). The run trains what one rank holding the
whole rows trains, packed records (starting inside chunks and at chunk boundaries) and one document a row, dense and
MoE (with --ep 2); the memory plan's --cp rows equal what each rank saves. In one process, in fp64, each rank's part of
a row equals the whole row's delta rule and convolution at --cp 2, 3 and 4. Planted in the product's functions and
caught: each chunk from a zero state, the convolution's inputs before a chunk dropped, a record starting at a chunk's
first token not resetting the linear layers there."""

from __future__ import annotations

import dataclasses
import functools

import cp_jobs
import dist_jobs
import pytest
import torch
from test_activation_bytes import QWEN35_CONFIGS
from test_context_parallel import config
from test_cp_dpo import gaps
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain.config import resolve, validate
from zerotrain.model import delta_rule_cp
from zerotrain.model.delta_rule import causal_conv, chunk_gated_delta_rule
from zerotrain.model.delta_rule_cp import SplitRows
from zerotrain.model.qwen35 import record_starts
from zerotrain.parallel import context
from zerotrain.parallel.ring_attention import zigzag_split, zigzag_unsplit

LIMIT, STEPS = 900, 3
pytestmark = pytest.mark.timeout(3 * LIMIT)

def qwen35(tmp, name, data, nproc, arch="qwen3_5", ep=1, **run):
    """test_context_parallel's run (rows of 64, a global batch of 4 rows, every step clipped) with test_qwen35's tiny
    shape (test_activation_bytes.QWEN35_CONFIGS: two Gated DeltaNet layers of 2 key heads of 8 serving 4 value heads
    of 12, 4 taps, and two gated attention layers; the MoE's 4 experts beside a shared expert): at --cp 2 each rank
    holds chunks of 16 tokens, records of 5 to 18 tokens crossing them."""
    cfg = config(tmp, name, data, nproc, **{"steps": STEPS, **run})
    cfg.model = dataclasses.replace(QWEN35_CONFIGS[arch], seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    cfg.parallel.ep = ep
    return resolve(validate(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One start of 2 ranks (the --cp 2 runs and the planted), one of 4 (--cp 4, --cp 2 --tp 2), one of 1 (the
    references)."""
    tmp = tmp_path_factory.mktemp("cpqwen35")
    data = write_records(tmp / "data", make_records(400))
    out = {}
    start = functools.partial(dist_jobs.run_in_turn, out, time_limit=LIMIT)
    job, moe = cp_jobs.trained_job, "qwen3_5_moe"
    start({"cp2": (cp_jobs.chunk_starts_seen_job, qwen35(tmp, "cp2", data, 2, cp=2)),
           "cp2 z3": (job, qwen35(tmp, "cp2-z3", data, 2, cp=2, zero=3)),
           "cp2 unpacked": (job, qwen35(tmp, "cp2-unpacked", "synthetic", 2, cp=2)),
           "cp2 bf16": (job, qwen35(tmp, "cp2-bf16", data, 2, cp=2, precision="bf16")),
           "cp2 blocks": (job, qwen35(tmp, "cp2-blocks", data, 2, cp=2, activation_checkpointing="blocks")),
           "cp2 moe ep2": (job, qwen35(tmp, "cp2-moe-ep2", data, 2, moe, ep=2, cp=2)),
           "cp2 moe unpacked": (job, qwen35(tmp, "cp2-moe-unpacked", "synthetic", 2, moe, cp=2)),
           "state ignored": (cp_jobs.chunk_state_ignored_job, qwen35(tmp, "state", data, 2, cp=2)),
           "conv boundary dropped": (cp_jobs.conv_boundary_dropped_job, qwen35(tmp, "conv", data, 2, cp=2)),
           "boundary reset dropped": (cp_jobs.boundary_reset_dropped_job, qwen35(tmp, "reset", data, 2, cp=2))})
    start({"cp4": (cp_jobs.chunk_starts_seen_job, qwen35(tmp, "cp4", data, 4, cp=4)),
           "cp2 tp2": (job, qwen35(tmp, "cp2-tp2", data, 4, cp=2, tp=2))})
    start({"cp1": (job, qwen35(tmp, "cp1", data, 1)),
           "cp1 unpacked": (job, qwen35(tmp, "cp1-unpacked", "synthetic", 1)),
           "cp1 moe": (job, qwen35(tmp, "cp1-moe", data, 1, moe)),
           "cp1 moe unpacked": (job, qwen35(tmp, "cp1-moe-unpacked", "synthetic", 1, moe))})
    return out


def test_qwen35_at_cp2_and_4_trains_as_one_rank_and_planted_chunk_bugs_are_caught(runs):
    # 3 clipped steps: losses within 1e-6 relative of one rank's, gradient norms and final weights within 1e-5 (the
    # bounds of the other --cp tests), packed and one document a row, dense and MoE (--ep 2), at ZeRO-3, at --cp 4
    # and at --cp 2 --tp 2, the blocks recomputed; one rank's reference at ZeRO-1 for ZeRO-3 too (at one rank they
    # train bitwise alike, measured). Measured: losses <= 1.0e-7, grad norms <= 7.6e-8, weights <= 9.2e-7 packed
    # (cp2 7.1e-7, ZeRO-3 6.5e-7, MoE ep2 7.5e-7, cp4 9.2e-7, cp2 tp2 7.5e-7) and 2.3e-6 (dense), 4.4e-6 (MoE) one
    # document a row
    pairs = {"cp2": "cp1", "cp2 z3": "cp1", "cp2 unpacked": "cp1 unpacked", "cp2 moe ep2": "cp1 moe",
             "cp2 moe unpacked": "cp1 moe unpacked", "cp4": "cp1", "cp2 tp2": "cp1", "cp2 blocks": "cp1"}
    measured = {mine: gaps(runs[mine], runs[theirs]) for mine, theirs in pairs.items()}
    assert all(g["losses"] < 1e-6 and g["grad_norms"] < 1e-5 and g["params"] < 1e-5 for g in measured.values()), \
        measured
    # the packed rows had records starting at chunk boundaries and inside chunks (at --cp 2 in rank 1's chunks, at 16
    # and 32; at --cp 4 too)
    for name in ("cp2", "cp4"):
        seen = runs[name]["starts seen"]
        assert sum(r["at a boundary"] for r in seen) > 0 and all(r["inside"] > 0 for r in seen), (name, seen)
    # planted, each far off (measured: 1.2e-2, 4.0e-2 and 1.0e-2 apart): each chunk from a zero
    # state; zeros before each chunk in the convolution; a record starting at a chunk's first token not resetting
    # the state and the convolution there
    planted = {name: worst_gap(runs[name], runs["cp1"])
               for name in ("state ignored", "conv boundary dropped", "boundary reset dropped")}
    assert all(gap > 1e-3 for gap in planted.values()), planted


def test_the_plan_counts_what_a_rank_of_a_split_row_saves(runs):
    # to the byte: the linear layers on the rank's two chunks apart (their values widened, every chunk's state map
    # gathered, the states composed), the attention layers' ring; fp32 and bf16, packed and not, the MoE, --cp 4,
    # --tp 2, the blocks recomputed. (--ep's exchange is left out: its buffers follow the routing, in no --cp row.)
    for name in ("cp2", "cp2 unpacked", "cp2 bf16", "cp2 moe unpacked", "cp4", "cp2 tp2", "cp2 blocks"):
        plan = runs[name]["plan"]
        assert plan["rows"]["activations"] == plan["activations_measured"], (name, plan["rows"]["activations"],
                                                                            plan["activations_measured"])



# In one process, fp64: every rank's part of a row computed with the product's functions (delta_rule_cp.py and
# context.part_record_starts), the gather fed with what each rank's first pass sent for its two chunks (a chunk's
# state map and tails do not depend on the gather), equal the whole row's delta rule and convolution. Rows of 96:
# chunks of 24 at --cp 2, 16 at --cp 3, 12 at --cp 4; records starting at 0, 10, 24, 40, 64 and 75: inside chunks,
# at a chunk boundary at each --cp (24; 64 at --cp 3) and across the others.
RECORDS = (10, 14, 16, 24, 11, 21)


def split_row(fn, C: int, segments: torch.Tensor | None, *whole: torch.Tensor) -> torch.Tensor:
    """fn(rows, *parts) on each of C ranks' parts of the whole rows' `whole` (B, T, ...), put back whole."""
    sent = {}

    def rank_part(rank: int, gather) -> torch.Tensor:
        starts, before = (None, None) if segments is None else context.part_record_starts(segments, C, rank, 3)
        rows = SplitRows(gather, (rank, 2 * C - 1 - rank), starts, before)
        return fn(rows, *(zigzag_split(x, C, rank) for x in whole))

    for rank in range(C):  # what each rank sends (zeros come back)
        rank_part(rank, lambda x, rank=rank: sent.setdefault(rank, x).new_zeros(2 * C, *x.shape[1:]))
    gathered = lambda x: zigzag_unsplit([sent[r] for r in range(C)], dim=0)  # noqa: E731
    return zigzag_unsplit([rank_part(rank, gathered) for rank in range(C)], dim=1)


def split_gaps(C: int, packed: bool) -> tuple[float, float]:
    """The largest differences of the split delta rule's and convolution's outputs from the whole rows'."""
    g = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, dk, dv, W = 2, 96, 2, 4, 8, 12, 20
    q, k = (torch.randn(B, T, Hk, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, T, Hv, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, Hv, generator=g, dtype=torch.float64)
    x = torch.randn(B, W, T, generator=g, dtype=torch.float64)
    weight = torch.randn(W, 1, 4, generator=g, dtype=torch.float64)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(B, T) if packed else None
    starts = None if segments is None else record_starts(segments)

    out = split_row(lambda rows, *parts: delta_rule_cp.split_gated_delta_rule(*parts, rows), C, segments,
                    q, k, v, decay, beta)
    conv = split_row(lambda rows, x: delta_rule_cp.split_causal_conv(x.transpose(1, 2), weight, rows).transpose(1, 2),
                     C, segments, x.transpose(1, 2))
    whole = chunk_gated_delta_rule(q, k, v, decay, beta, starts)[0]
    return float((out - whole).abs().max()), float((conv.transpose(1, 2) - causal_conv(x, weight, starts)).abs().max())


@pytest.mark.parametrize("C", [2, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_each_ranks_chunks_from_the_earlier_chunks_states_equal_the_whole_rows_delta_rule(C, packed, monkeypatch):
    # measured: the delta rule <= 1.1e-15 apart (fp64), the convolution exactly
    rule, conv = split_gaps(C, packed)
    assert rule < 1e-12 and conv < 1e-12, (rule, conv)
    # planted in the product's functions and caught: each chunk from a zero state; zeros before each chunk in the
    # convolution; (packed rows) a record starting at a chunk's first token not resetting the state and the
    # convolution there
    with monkeypatch.context() as m:
        m.setattr(delta_rule_cp, "states_before", lambda M, B, chunks: torch.zeros_like(B[:2]))
        assert split_gaps(C, packed)[0] > 1e-3
    with monkeypatch.context() as m:
        m.setattr(delta_rule_cp, "inputs_before", lambda tails, chunks: torch.zeros_like(tails[:2]))
        assert split_gaps(C, packed)[1] > 1e-3
    if packed:
        with monkeypatch.context() as m:
            m.setattr(context, "part_record_starts", cp_jobs.without_chunk_firsts(context.part_record_starts))
            assert min(split_gaps(C, packed)) > 1e-3
