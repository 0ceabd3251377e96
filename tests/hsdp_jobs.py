"""Jobs of the hybrid sharding tests (--dp-replicate), run by spawned ranks; planted bugs patch the engine itself."""

from __future__ import annotations

import os
from unittest import mock

import torch
from dist_jobs import error_of_training, summary

from zerotrain import checkpoint, load_model
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.config import Config
from zerotrain.parallel import Comm, GradientReducer
from zerotrain.training import invariants
from zerotrain.training.invariants import InvariantError
from zerotrain.training.loop import train


def replicated_job(cfg: Config, comm: Comm) -> dict:
    """Train (the memory plan checked strictly, as in every test); the log,
    the final parameters and what the engine holds on each rank: its parameters (the shard at stage 3), optimizer
    state and gradient shard in bytes; the bytes this rank sent by purpose."""
    result = train(cfg, comm)
    out = summary(result)
    engine = result.engine
    # the final model, as the run's last checkpoint holds it (an expert-parallel engine gathers no full model)
    final = load_model(os.path.join(cfg.checkpoint.dir, checkpoint.step_name(cfg.loop.steps)))
    out["params"] = {name: p.detach().clone() for name, p in final.named_parameters()}
    # per rank: its parameters (the shard at stage 3) and its gradient shard; its optimizer state is out["memory"]'s
    parts = engine.parts  # with --ep: the expert group too
    held = [sum(e.placement.param_bytes() for e in parts), sum(e.grads.grad_shard.numel() * e.grads.grad_shard.element_size() for e in parts)]
    out["held"] = comm.all_gather_rows(torch.tensor(held, dtype=torch.int64), "all_gather_test").tolist()
    out["shard_numel"] = sum(e.layout.shard_numel for e in parts)
    out["sent"] = dict(result.comm_bytes)
    out["param_norms"] = result.param_norms
    out["plan"] = result.plan
    out["per_rank"] = result.per_rank
    return out


def unreplicated_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: the shard is not all-reduced across the replica groups (each group steps on its own half of the
    batch); the error invariant (b) raises."""
    with mock.patch.object(GradientReducer, "all_reduce_replicas", lambda self: None):
        return error_of_training(cfg, comm, InvariantError)


def unreplicated_unchecked_job(cfg: Config, comm: Comm) -> dict:
    """The same planted bug with invariant (b) not checked: what the run trains."""
    with mock.patch.object(GradientReducer, "all_reduce_replicas", lambda self: None), \
            mock.patch.object(invariants, "check_no_drift", lambda *args: []):
        return replicated_job(cfg, comm)


def counted_on_every_replica_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: every replica group adds its copy of the shard's squares to the gradient norm (counted R times)."""
    real = GradientReducer._counted_grad_sumsq

    def every_copy(self):
        replicate, self.replicate = self.replicate, None
        try:
            return real(self)
        finally:
            self.replicate = replicate

    with mock.patch.object(GradientReducer, "_counted_grad_sumsq", every_copy):
        return replicated_job(cfg, comm)


def planned_job(cfg: Config, comm: Comm) -> dict:
    """Train (the memory plan checked strictly): rank 0's bytes sent by purpose, each rank's final parameter norm
    (of what it computes with), the plan's rows as the run reported them, and each rank's checkpoint bytes written
    and read by this job alone (the counters are the process's; one start of the ranks runs several jobs)."""
    before = bytes_counted()
    result = train(cfg, comm)
    mine = [v - before[k] for k, v in bytes_counted().items()]
    counted = comm.all_gather_rows(torch.tensor(mine, dtype=torch.int64), "all_gather_test").tolist()
    return {"sent": dict(result.comm_bytes), "param_norms": result.param_norms, "plan": result.plan,
            "grad_norms": [r["grad_norm"] for r in result.records],
            "per_rank": {key: [row[i] for row in counted] for i, key in enumerate(bytes_counted())}}
