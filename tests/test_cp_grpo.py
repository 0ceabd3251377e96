"""GRPO at --cp 2: the completions sampled whole on every rank (a DP rank's CP ranks draw the same), the loss's rows
split over the CP ranks and each completion's token log-probs gathered whole (policy, reference, generating policy),
trains what one rank trains over 4 steps; log-probs gathered out of the row's order, or a reference of one rank's
part of each row, are caught."""

from __future__ import annotations

import functools

import cp_jobs
import dist_jobs
import pytest
from conftest import world_of_one
from test_cp_dpo import gaps
from test_grpo_parallel import argv, config, data  # noqa: F401 (data: the module fixture)

from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import release_run_folders

STEPS = 4
LIMIT = 600
pytestmark = pytest.mark.timeout(2 * LIMIT)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    """Each run's log, final weights and rollouts by name: 8 completions a step (2 prompts x G 4, micro-batch 4 x
    accum 2), 4 steps at lr 1e-3 clipped at 1. dapo with the KL term (the reference's frozen copy) at ZeRO-1; grpo (each
    completion's token mean) with --grpo-iterations 2 (the generating policy's log-probs) at ZeRO-3. One start of 2
    ranks (--cp 2, and the two planted), the same runs on one rank here."""
    tmp = tmp_path_factory.mktemp("cpgrpo")
    # rows of 16: a prompt's 10 tokens and up to 6 completion tokens, which fall in chunks 2 (rank 1) and 3 (rank 0)
    split = ["--micro-batch", "4", "--accum", "2", "--steps", str(STEPS), "--seq-len", "16"]
    cp2 = ["--nproc", "2", "--cp", "2"]
    kinds = {"dapo": [], "grpo z3": ["--grpo-loss", "grpo", "--grpo-iterations", "2", "--zero", "3"]}

    def args(name, *more):
        return argv(data, "llama", tmp / name, [*split, *more])

    two = {"cp2 dapo": args("cp2-dapo", *cp2), "cp2 grpo z3": args("cp2-grpo", *cp2, *kinds["grpo z3"]),
           "rank order": args("rank-order", *cp2), "reference of one part": args("one-part", *cp2)}
    jobs = {"rank order": cp_jobs.grpo_rank_order_job, "reference of one part": cp_jobs.grpo_reference_of_one_part_job}
    pairs = [(jobs.get(name, cp_jobs.grpo_trained_job), config(a)) for name, a in two.items()]
    try:
        out = dict(zip(two, run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), pairs[0][1],
                                    time_limit=LIMIT)))
        with world_of_one() as comm:
            for kind, more in kinds.items():
                out[f"cp1 {kind}"] = cp_jobs.grpo_trained_job(config(args(f"cp1-{kind}", *more)), comm)
    finally:
        release_run_folders()
    return out


def test_grpo_at_cp2_trains_as_one_rank_and_log_probs_out_of_order_or_of_one_part_are_caught(runs):
    for kind, generations in (("grpo z3", STEPS // 2), ("dapo", STEPS)):
        cp2, cp1 = runs[f"cp2 {kind}"], runs[f"cp1 {kind}"]
        # the same completions drawn: 8 a generation
        assert cp2["rollouts"] == cp1["rollouts"] and len(cp1["rollouts"]) == 8 * generations
        # the loss within 1e-6 (absolute: it is about 0.05 and changes sign; each generation's first step's is 0 in
        # exact arithmetic, -1.9e-9 in fp32), gradient norms and final weights within 1e-5 relative
        gap = {**gaps(cp2, cp1), "losses": loss_gap(cp2, cp1)}
        assert gap["losses"] < 1e-6 and gap["grad_norms"] < 1e-5 and gap["params"] < 1e-5, (kind, gap)
    # planted: the ranks' parts of each row gathered in rank order, not the zig-zag's (measured: losses 0.18 off,
    # the final weights 2.5e-2)
    assert loss_gap(runs["rank order"], runs["cp1 dapo"]) > 1e-2 and gaps(runs["rank order"], runs["cp1 dapo"])[
        "params"] > 1e-3
    # planted: the reference's log-probs of this rank's part only, the others' 0: the KL term of their tokens is
    # wrong (measured: the loss 14.8 off; each rank's gradient, of its own tokens, is right)
    assert loss_gap(runs["reference of one part"], runs["cp1 dapo"]) > 1.0


def loss_gap(a: dict, b: dict) -> float:
    """The largest difference of a step's loss between two runs."""
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
