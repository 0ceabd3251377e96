"""GLM-4.5 at --cp 2: Llama's ring with rotary on the first half of each head's units, turned at each token's position
in the whole row (or its record), and DeepSeek-V3's experts with their routing bias moving by the whole batch's loads.
The run trains what one rank holding the whole rows trains, packed records and one document a row, ZeRO-1 and ZeRO-3,
with --ep 2 and with --tp 2; the memory plan's --cp rows equal what each rank saves. Its rotary half turned at the
rank's local positions is caught."""

from __future__ import annotations

import dataclasses
import functools

import cp_jobs
import dist_jobs
import pytest
from test_context_parallel import config
from test_cp_dpo import gaps
from test_glm45 import tiny_glm
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain.config import resolve, validate

LIMIT, STEPS = 900, 3
pytestmark = pytest.mark.timeout(3 * LIMIT)


def glm(tmp, name, data, nproc, ep=1, **run):
    """test_context_parallel's run (rows of 64, a global batch of 4 rows, every step clipped) with test_glm45's tiny
    GLM-4.5: a dense layer and two MoE layers (2 shared experts, 2 groups), 4 heads of 8 units over 2 KV heads, rotary
    on 4 of them, q/k/v biases and q/k norms, the routing bias moving."""
    cfg = config(tmp, name, data, nproc, **{"steps": STEPS, **run})
    cfg.model = dataclasses.replace(tiny_glm(), seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    cfg.parallel.ep = ep
    return resolve(validate(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One start of 2 ranks (--cp 2, --cp 2 --ep 2 and the planted), one of 4 (--cp 2 --tp 2), one of 1 (the
    references)."""
    tmp = tmp_path_factory.mktemp("cpglm")
    data = write_records(tmp / "data", make_records(400))  # records of 5 to 18 tokens, crossing the chunks
    out = {}

    start = functools.partial(dist_jobs.run_in_turn, out, time_limit=LIMIT)

    job = cp_jobs.trained_job
    start({"cp2": (job, glm(tmp, "cp2", data, 2, cp=2)),
           "cp2 z3": (job, glm(tmp, "cp2-z3", data, 2, cp=2, zero=3)),
           "cp2 unpacked": (job, glm(tmp, "cp2-unpacked", "synthetic", 2, cp=2)),
           "local positions": (cp_jobs.local_positions_job, glm(tmp, "local", data, 2, cp=2)),
           "cp2 ep2": (job, glm(tmp, "cp2-ep2", data, 2, cp=2, ep=2)),
           "cp2 blocks": (job, glm(tmp, "cp2-blocks", data, 2, cp=2, activation_checkpointing="blocks")),
           "cp2 bf16": (job, glm(tmp, "cp2-bf16", data, 2, cp=2, precision="bf16"))})
    start({"cp2 tp2 z3": (job, glm(tmp, "cp2-tp2-z3", data, 4, cp=2, tp=2, zero=3))})
    start({"cp1": (job, glm(tmp, "cp1", data, 1)),
           "cp1 unpacked": (job, glm(tmp, "cp1-unpacked", "synthetic", 1))})
    return out


def test_glm45_at_cp2_trains_as_one_rank_and_its_rotary_half_at_local_positions_is_caught(runs):
    # 3 clipped steps: losses within 1e-6 relative of one rank's, gradient norms and final weights (the routing bias
    # and the q/k/v biases among them) within 1e-5, at ZeRO-1 and 3 (one rank's reference at ZeRO-1 for both: at one
    # rank they train bitwise alike, measured), packed and one document a row. Measured: losses <= 8.6e-8, grad
    # norms <= 1.0e-6, weights <= 2.3e-6 (packed 4.0e-8 and 1.3e-7); --cp 2 --ep 2 7.5e-8, 3.7e-8, 1.2e-7; --cp 2
    # --tp 2 at ZeRO-3 on 4 ranks 7.5e-8, 3.2e-8, 2.7e-7; --activation-checkpointing blocks (its DeepSeek-V3 experts'
    # router recomputed) as --cp 2 without it
    pairs = {"cp2": "cp1", "cp2 z3": "cp1", "cp2 unpacked": "cp1 unpacked", "cp2 ep2": "cp1",
             "cp2 tp2 z3": "cp1", "cp2 blocks": "cp1"}
    measured = {mine: gaps(runs[mine], runs[theirs]) for mine, theirs in pairs.items()}
    assert all(g["losses"] < 1e-6 and g["grad_norms"] < 1e-5 and g["params"] < 1e-5 for g in measured.values()), \
        measured
    # the plan counts a rank's activations to the byte (the rotary tables of the rotated half, per packed row)
    for name in ("cp2", "cp2 unpacked", "cp2 bf16"):
        plan = runs[name]["plan"]
        assert plan["rows"]["activations"] == plan["activations_measured"], (name, plan["rows"]["activations"],
                                                                            plan["activations_measured"])
    # planted: the rotary half turned at the rank's own positions (within its two chunks): 1.3e-2 off
    planted = worst_gap(runs["local positions"], runs["cp1"])
    assert planted > 1e-3, planted
