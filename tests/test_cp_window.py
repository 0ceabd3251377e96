"""Sliding windows (Mistral's) in the ring: at --cp 4 each block of the ring is skipped where the window holds none of
its keys, computed as without a window where it holds them all, and masked by the row's positions in between; the
run trains what one rank holding the whole rows trains (packed records, the window within each; Mistral's window on
every layer, Gemma 3's on its local ones); a ring that ignores
the window, or measures it in a rank's local indices, is caught."""

from __future__ import annotations

import functools

import cp_jobs
import dist_jobs
import pytest
import torch
from test_context_parallel import config
from test_cp_dpo import gaps
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain.config import resolve, validate
from zerotrain.parallel.ring_attention import hop_blocks, window_mask, window_reach, zigzag_split

WINDOW, LIMIT, STEPS = 12, 900, 3
pytestmark = pytest.mark.timeout(3 * LIMIT)


def windowed(tmp, name, data, nproc, arch="mistral", **run):
    """test_context_parallel's tiny Llama on packed rows of 64 as Mistral (every layer's window 12 tokens) or as Gemma
    3 (its first layer's window 12, the second global; a local rotary base of its own)."""
    cfg = config(tmp, name, data, nproc, **{"steps": STEPS, **run})
    cfg.model.arch, cfg.model.sliding_window = arch, WINDOW
    if arch == "gemma3":
        cfg.model.sliding_window_pattern, cfg.model.rope_local_theta = 2, 1000.0
    return resolve(validate(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One start of 4 ranks (--cp 4 at ZeRO-1 and 3, and the planted), one of 1 (the references)."""
    tmp = tmp_path_factory.mktemp("cpwindow")
    data = write_records(tmp / "data", make_records(400))  # records of 5 to 18 tokens: the window bites in them
    out = {}

    start = functools.partial(dist_jobs.run_in_turn, out, time_limit=LIMIT)

    job = cp_jobs.trained_job
    # 4 ranks, DP 1: the global batch is 4 rows as at 1 rank (micro-batch 2 x accum 2)
    start({"cp4": (job, windowed(tmp, "cp4", data, 4, cp=4)),
           "cp4 z3": (job, windowed(tmp, "cp4-z3", data, 4, cp=4, zero=3)),
           "window ignored": (cp_jobs.window_everywhere_job, windowed(tmp, "ignored", data, 4, cp=4)),
           "local positions": (cp_jobs.window_in_local_positions_job, windowed(tmp, "local", data, 4, cp=4)),
           "cp4 unpacked": (job, windowed(tmp, "cp4-unpacked", "synthetic", 4, cp=4)),
           "cp4 gemma3": (job, windowed(tmp, "cp4-gemma3", data, 4, "gemma3", cp=4))})
    start({"cp1": (job, windowed(tmp, "cp1", data, 1)),
           "cp1 unpacked": (job, windowed(tmp, "cp1-unpacked", "synthetic", 1)),
           "cp1 gemma3": (job, windowed(tmp, "cp1-gemma3", data, 1, "gemma3"))})
    return out


def test_each_block_s_reach_is_the_window_s_over_the_row_s_positions():
    # --cp 4, rows of 64 (chunks of 8), window 12: every hop's block against the brute-force mask of the whole row
    C, chunk, T = 4, 8, 64
    whole = torch.arange(T)
    reaches = []
    for rank in range(C):
        for source in range(C):
            block = hop_blocks(rank, source, chunk)
            if block is None:
                continue
            rows, keys, _ = block
            q = zigzag_split(whole, C, rank, dim=0)[rows]
            k = zigzag_split(whole, C, source, dim=0)[keys]
            truth = (q[:, None] >= k[None, :]) & (q[:, None] - k[None, :] < WINDOW)
            reach = window_reach(rank, source, rows, keys, chunk, C, WINDOW)
            reaches.append(reach)
            assert torch.equal(window_mask(rank, source, rows, keys, chunk, C, WINDOW, whole.device), truth)
            causal = (q[:, None] >= k[None, :])
            assert reach == ("outside" if not truth.any() else "inside" if torch.equal(truth, causal) else "partial")
            assert window_reach(rank, source, rows, keys, chunk, C, 0) == "inside"  # no window
    # skipped: rank 3's chunks 3 and 4 over rank 0's chunk 0, rank 0's chunk 7 over rank 3's chunks 3 and 4
    assert reaches.count("outside") == 2 and reaches.count("partial") == 14
    assert window_reach(0, 0, slice(0, 8), slice(0, 8), chunk, C, WINDOW) == "inside"  # one chunk over itself


def test_a_window_at_cp4_trains_as_one_rank_and_a_ring_ignoring_it_or_in_local_positions_is_caught(runs):
    # 3 clipped steps: losses within 1e-6 relative of one rank's, gradient norms and final weights within 1e-5, at
    # ZeRO-1 and 3 (one rank's reference at ZeRO-1 for both: at one rank they train bitwise alike, measured), on
    # unpacked rows (the tiny Markov chain's: one document a row, the window alone), and as Gemma 3 (sliding and
    # global layers); measured at most 9.4e-8, 4.0e-8 and 6.8e-7 (Gemma 3's weights)
    pairs = {"cp4": "cp1", "cp4 z3": "cp1", "cp4 unpacked": "cp1 unpacked", "cp4 gemma3": "cp1 gemma3"}
    measured = {mine: gaps(runs[mine], runs[theirs]) for mine, theirs in pairs.items()}
    assert all(g["losses"] < 1e-6 and g["grad_norms"] < 1e-5 and g["params"] < 1e-5 for g in measured.values()), \
        measured
    # the plan counts a rank's activations to the byte: no window mask (each hop builds its block's and drops it)
    for name in ("cp4", "cp4 unpacked", "cp4 gemma3"):
        assert runs[name]["plan"]["rows"]["activations"] == runs[name]["plan"]["activations_measured"], name
    # planted: every block computed whole (the window ignored); a partial block's window in local indices: measured
    # 1.8e-2 and 3.1e-2 off
    for planted in ("window ignored", "local positions"):
        assert worst_gap(runs[planted], runs["cp1"]) > 1e-3, planted
