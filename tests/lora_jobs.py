"""Jobs the LoRA tests run on 2 ranks (importable by module name in the spawned ranks)."""

from __future__ import annotations

import torch
from dist_jobs import summary

from zerotrain.config import Config
from zerotrain.errors import InvariantError
from zerotrain.parallel import Comm
from zerotrain.training.loop import train


def lora_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, the full adapters (TP slices gathered), and what each rank holds for the optimizer."""
    result = train(cfg, comm)
    engine = result.engine
    out = summary(result)
    out["params"] = engine.full_state_dict()
    out["per_rank"] = result.per_rank
    out["shard_numel"], out["padded_numel"] = engine.layout.shard_numel, engine.layout.padded_numel
    out["trained"] = [s.name for s in engine.layout.slots]
    out["frozen_grads"] = [n for n, p in engine.frozen if p.grad is not None]
    return out


def lora_unsummed_a_grad_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a column-parallel base's A keeps each TP rank's partial gradient (no all-reduce over TP)."""
    from zerotrain.model import layers

    saved = layers._SumOverReplicas.backward
    layers._SumOverReplicas.backward = staticmethod(lambda ctx, grad: (grad, None, None))
    try:
        return lora_job(cfg, comm)
    except InvariantError as e:  # raised on every rank alike: the ranks stay together for the next job
        return {"invariant": str(e)}
    finally:
        layers._SumOverReplicas.backward = saved


def lora_drifted_base_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: after step 1, rank 1's frozen base (not in the engine's buffers) moves by one ulp."""

    def drift(step, engine):
        if step == 1 and comm.rank == 1:
            weight = dict(engine.frozen)["model.norm.weight"]
            with torch.no_grad():
                weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))

    try:
        train(cfg, comm, after_update=drift)
    except InvariantError as e:  # raised on every rank alike
        return {"invariant": str(e)}
    return {}
