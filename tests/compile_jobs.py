"""Jobs of the --compile tests, run by spawned ranks (importable by module name); the planted bug patches
model/compiled.py's own function."""

from __future__ import annotations

from unittest import mock

import torch
from torch._dynamo.utils import counters
from torch.nn.utils.stateless import _reparametrize_module

from dist_jobs import error_of_training, summary
from zerotrain.config import Config
from zerotrain.model import compiled
from zerotrain.parallel import Comm
from zerotrain.training import memory_plan
from zerotrain.training.invariants import InvariantError
from zerotrain.training.loop import train


def compiled_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, and what dynamo compiled for this run: graphs and graph breaks (counters span the jobs run in
    turn, so this run's are the difference)."""
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    out = summary(train(cfg, comm))
    out["graphs"] = counters["stats"]["unique_graphs"] - graphs
    out["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    out["compiled_calls"] = counters["stats"]["calls_captured"]
    return out


def stale_blocks_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each block compiled with the parameter values it was first gathered with, kept as the graph's own
    (as a compile that froze the weights would): the first step computes with this step's values, every later one with
    stale ones."""

    def stale_compile_blocks(model):
        for block in compiled.transformer_blocks(model):
            forward, kept = block.forward, {}

            def stale(*args, forward=forward, kept=kept, block=block, **kwargs):
                if not kept:  # the first forward's gathered values, kept from then on
                    kept.update({n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()})
                with _reparametrize_module(block, kept):
                    return forward(*args, **kwargs)

            block.forward = torch.compile(stale)
        return model

    with mock.patch.object(compiled, "compile_blocks", stale_compile_blocks):
        return summary(train(cfg, comm))


def unplanned_block_buckets_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: the plan counts the eager budget of gradient buckets (the two largest), not a compiled block's
    buckets open together; the run's plan check (strict under the tests) says so after its first step."""
    with mock.patch.object(memory_plan, "compiled_block_buckets", lambda model, layout: 0):
        return error_of_training(cfg, comm, InvariantError)
