"""Mistral 4 under tensor parallelism against test_mistral4_training's plain transformers + AdamW loop: 8 steps of
--init-from at --tp 2 on 2 ranks (test_deepseek_tp's runs: the latent attention split by heads, the experts and the
shared expert by rows of their width) equal it: losses, gradient norms and the final weights within 1e-5 relative
(measured: losses 1.8e-7, gradient norms 2.6e-6, weights 7.4e-7).
What Mistral 4 adds to DeepSeek-V3's decoder under TP: its queries scaled by their positions on each rank's own heads,
and its softmax router read from the replicated hidden state on every rank.

Planted in the product's code, on TP rank 1 only, and caught: its heads' queries left unscaled (the final weights then
1.3e-3 off the loop's: the tiny model's near-uniform attention moves the losses by 1.6e-5 only), and its router's
softmax read from half of the hidden state's units (a TP-partial input: its replicated router weight then moves
otherwise than rank 0's, which the run's replica invariant stops).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from test_deepseek_training import assert_trained_as_transformers, in_turn_runs, transformers_run
from test_gemma import one_thread
from test_mistral4 import mistral4_model
from test_qwen35 import config_for, gaps, weights_of

from zerotrain.model import deepseek, group_routing

pytestmark = pytest.mark.timeout(900)
FLAGS = ("--nproc", "2", "--tp", "2")


def unscaled_queries(real):
    """Planted: the query scaling left out (DeepSeek-V3's unscaled queries)."""
    return lambda cfg, positions: None


def router_from_a_partial_input(real):
    """Planted: the router's softmax read from the second half of the hidden state's units only."""
    def scores(flat, weight):
        half = flat.shape[1] // 2
        return real(torch.cat([torch.zeros_like(flat[:, :half]), flat[:, half:]], dim=1), weight)
    return scores


PLANTED = {"queries unscaled on rank 1": (deepseek, "query_scale", unscaled_queries),
           "router from a partial input on rank 1": (group_routing, "softmax_scores", router_from_a_partial_input)}


def planted_on_rank_1_job(cfg, comm, bug: str):
    """`train_job` with PLANTED[bug]'s function replaced on TP rank 1 only (rank 0 runs the real one)."""
    from zerotrain.training.loop import train_job

    module, name, planted = PLANTED[bug]
    real = getattr(module, name)
    if comm.rank == 1:
        setattr(module, name, planted(real))
    try:
        return train_job(cfg, comm)
    except Exception as e:  # a check that stops the run on every rank
        return {"error": str(e)}
    finally:
        setattr(module, name, real)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tp2" | planted | "transformers": {"loss", "grad_norm", ...}}; "tp2" and "transformers" with "weights"."""
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("mistral4-tp")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    folder = tmp / "model"
    mistral4_model(folder, initializer_range=0.02)
    jobs = {"tp2": (train_job, config_for(folder, tmp / "tp2", *FLAGS))}
    jobs.update({bug: (functools.partial(planted_on_rank_1_job, bug=bug),
                       config_for(folder, tmp / bug.replace(" ", "-"), *FLAGS)) for bug in PLANTED})
    out = in_turn_runs(jobs)
    for name in [n for n in jobs if "error" not in out[n]]:
        out[name]["weights"] = weights_of(tmp / name.replace(" ", "-"))
    out["transformers"] = transformers_run(folder, out["tp2"]["lr"], tmp / "oracle")
    stack.close()
    return out


def test_eight_steps_at_tp_train_as_transformers_adamw_does(runs):
    assert_trained_as_transformers(runs["tp2"], runs["transformers"])


def test_queries_left_unscaled_on_one_tp_rank_are_caught(runs):
    assert gaps(runs["queries unscaled on rank 1"], runs["transformers"])["weights"] > 1e-4


def test_the_router_read_from_a_tp_partial_input_is_caught(runs):
    """Rank 1's router chooses other experts for the same tokens: its replicated router weight moves differently,
    which the run's replica invariant stops."""
    report = runs["router from a partial input on rank 1"]
    assert "replicated parameters of rank(s) [1] differ from rank 0" in report.get("error", ""), report
